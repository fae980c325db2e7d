"""What a user's own script (--script / --module) leaves: its output folder, its metrics, and whether its
ranks formed one job.

- Output: the folder the script's --output_dir names (relative to where the rank runs: the run folder, or
  its work/ copy with --workdir), else $XC_OUTPUT_DIR (runs/<id>/output on the node), which every rank gets.
- Metrics: what the Trainer writes there (all_results.json, else trainer_state.json's last log entries),
  in the shape results.json has for the bundled jobs, so `fab runs` and `fab bench` read them alike.
- One job: every rank reports the largest torch.distributed group it joined (training/runtime's
  sitecustomize writes runs/<id>/ranks/<rank>.json at exit); a multi-rank run whose ranks joined none, or a
  smaller one, trained N models side by side, and is not called ok.
"""
from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

from cluster.node import Node
from cluster.remote import connect, fan_out, run
from launch.staging import jobflags
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)


def output_flag(args: list[str]) -> str | None:
    """The script's --output_dir as argparse takes it: the last one given."""
    return jobflags.get(args, "--output_dir")


def remote_output_dir(run_home: str, args: list[str], workdir: bool) -> str:
    """The node-0 folder a run's output lands in; run_home is <home>/runs/<id> there."""
    flag = output_flag(args)
    if flag is None:
        return f"{run_home}/output"  # the bundled jobs' default, and $XC_OUTPUT_DIR
    if flag.startswith("/"):
        return flag
    return f"{run_home}/work/{flag}" if workdir else f"{run_home}/{flag}"


def trainer_results(output: Path) -> dict | None:
    """results.json's shape from a Trainer's own files in a run's output; None when there are none."""
    metrics: dict = {}
    all_results = output / "all_results.json"
    if all_results.is_file():
        try:
            metrics = json.loads(all_results.read_text())
        except (OSError, ValueError):
            metrics = {}
    if not metrics and (output / "trainer_state.json").is_file():
        try:
            history = json.loads((output / "trainer_state.json").read_text()).get("log_history", [])
        except (OSError, ValueError):
            history = []
        for entry in history:
            metrics.update({k: v for k, v in entry.items() if k.startswith(("train_", "eval_"))})
    if not metrics:
        return None
    train = {k: v for k, v in metrics.items() if k.startswith("train_")}
    evals = {k: v for k, v in metrics.items() if k.startswith("eval_")}
    return {"source": "trainer", "train": train, "eval": evals}


def _reports(node: Node, run_home_expr: str) -> list[dict]:
    with connect(node) as conn:
        res = run(conn, f"cat {run_home_expr}/ranks/*.json 2>/dev/null; true", purpose="read the ranks' reports")
    out = []
    for chunk in res.stdout.replace("}{", "}\n{").splitlines():
        try:
            out.append(json.loads(chunk))
        except ValueError:
            continue
    return out


def one_job_problem(nodes: list[Node], run_id: str, world_size: int, home_expr: str) -> str | None:
    """None when every rank joined a group of the run's size, or when no rank reported (not Python);
    else what went wrong, in words."""
    if world_size < 2:
        return None
    run_home = RunPaths(shlex.quote(run_id), home_expr).node
    reports = [r for got in fan_out(nodes, lambda n: _reports(n, run_home), "reading the ranks' reports")
               for r in got]
    if not reports:
        return None
    alone = sorted(r["rank"] for r in reports if r.get("joined", 0) < world_size)
    if not alone:
        return None
    joined = sorted({r.get("joined", 0) for r in reports})
    return (f"its {world_size} ranks did not form one job: rank(s) {', '.join(map(str, alone))} joined "
            + ("no torch.distributed group" if joined == [0] else f"a group of {max(joined)}")
            + ", so each trained on its own")
