"""A run's records in runs/<run-id>/: summary.json (status, nodes, command, environment, what --resume needs), results.json, and the one-line result."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from cluster import store
from cluster.resolve import Cluster
from launch import launcher, secrets
from launch.probe import NodeFacts
from launch.request import TrainRequest, file_digest, local_files

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    exit_code: int
    wall_s: float
    results: dict | None
    failed_node: str | None = None
    detached: bool = False  # still running on the nodes: 'fab logs -f' or 'fab runs' concludes it


def new_record(cluster: Cluster, req: TrainRequest, plan: launcher.LaunchPlan, facts: list[NodeFacts],
            args: list[str]) -> dict:
    nodes = [f.node for f in facts]
    return {
        "run_id": plan.run_id, "cluster": cluster.spec, "nodes": [n.to_dict() for n in nodes],
        "job": req.job if not req.script else None, "script": req.script, "args": list(args),
        "module": req.module, "launcher": plan.launcher,
        "workdir": plan.workdir.record() if plan.workdir is not None else None,  # path, digest, files, bytes
        "world_size": plan.world_size, "ppn": plan.ppn, "backend": plan.backend, "precision": plan.precision,
        "env": {**launcher.global_env(plan), **{k: secrets.MASK for k in plan.secret_env}},
        "node_env": {p.name: launcher.node_env(plan, p) for p in plan.nodes},
        "pinning": {p.name: dict(launcher.rank_cpus(p)) for p in plan.nodes},
        "topology": {f.node.name: f.topo.to_dict() for f in facts},
        # what --resume needs to run the same job again
        "request": {"job": req.job, "script": req.script, "workdir": req.workdir, "module": req.module,
                    "launcher": req.launcher, "args": list(req.args), "ppn": req.ppn,
                    "threads": req.threads, "backend": req.backend, "precision": req.precision,
                    "comm_hook": req.comm_hook, "env": secrets.masked(req.env, req.valueless), "save_every": req.save_every, "pin": req.pin, "timeout_s": req.timeout_s,
                    "data": {str(Path(p).expanduser().resolve()): file_digest(p) for _, p in local_files(req.args)}},
    }


def finish_run(run_dir: Path, record: dict, status: str, exit_code: int, wall: float, results: dict | None,
            **extra) -> None:
    summary = dict(record, status=status, exit_code=exit_code, wall_s=round(wall, 3), **extra)
    if results:
        tr = results.get("train", {})
        summary["train_samples_per_second"] = tr.get("train_samples_per_second")
        summary["eval"] = results.get("eval")
        (run_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    store.publish_records(run_dir, summary)  # [store] the records beside the run's checkpoints; never raises


def result_line(result: RunResult) -> str:
    r = result.results or {}
    ev, tr = r.get("eval", {}), r.get("train", {})
    parts = [f"run {result.run_id} finished in {result.wall_s:.0f}s"]
    if "eval_accuracy" in ev:
        parts.append(f"eval accuracy {ev['eval_accuracy']:.3f}")
        if "eval_majority_rate" in ev:
            parts.append(f"(majority class {ev['eval_majority_rate']:.3f})")
    if "eval_exact_match" in ev:  # qa: SQuAD's figures, in percent
        parts.append(f"eval exact match {ev['eval_exact_match']:.1f}")
    if "eval_f1" in ev:
        parts.append(f"f1 {ev['eval_f1']:.3f}")
        if "eval_baseline_f1" in ev:
            parts.append(f"(first-words baseline {ev['eval_baseline_f1']:.3f})")
    if "eval_perplexity" in ev:  # clm
        parts.append(f"eval loss {ev['eval_loss']:.3f} perplexity {ev['eval_perplexity']:.2f} "
                     f"(step 0: {ev.get('eval_perplexity_step0', float('nan')):.2f})")
    if "train_samples_per_second" in tr:
        parts.append(f"train {tr['train_samples_per_second']:.1f} samples/s")
    parts.append(f"-> {result.run_dir}")
    return " ".join(parts)
