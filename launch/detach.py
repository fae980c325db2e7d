"""Detached runs: `fab train --detach` starts mpirun on node 0 in its own session with its output in
the run's folder there and returns once every rank is running; `fab logs RUN [-f]` shows (follows) a
run's log with the same [rank host] prefixes; `fab runs` lists runs. Whichever of them first sees a
detached run ended brings its results and outputs home and writes its summary, as an attached run
does when mpirun returns.

On node 0, runs/<id>/ holds mpirun.log (secret values already replaced by *** on the node),
wrapper.pid (the shell that waits for mpirun) and, once mpirun has ended, exit_code.
"""
from __future__ import annotations

import io
import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from cluster.node import Node
from cluster.remote import connect, run
from core.errors import ClusterError
from launch import lock, outputs, secrets
from launch.cleanup import runs_alive, sweep
from launch.records import RunResult, finish_run
from launch.stream import OutputRouter, failed_rank

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300


@dataclass(frozen=True)
class LogPlan:
    """What reading a run's log needs of its plan: rank -> host (block placement)."""
    run_id: str
    ppn: int
    node_names: tuple[str, ...]
    secret_env: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.ppn * len(self.node_names)

    def rank_host(self, rank: int) -> str:
        return self.node_names[rank // self.ppn]


def wrapper_command(remote_run: str, mpirun_dir: str, argv_text: str, python: str, code_dir: str,
                    has_secrets: bool) -> str:
    """Shell text run on node 0: mpirun in its own session, surviving the SSH session that starts it."""
    sink = "> mpirun.log"
    if has_secrets:
        sink = (f"| {shlex.quote(python)} {shlex.quote(code_dir + '/training/runtime/redact.py')} "
                f"{secrets.FILE} > mpirun.log")
    inner = (f"PATH={shlex.quote(mpirun_dir)}:$PATH {argv_text} 2>&1 {sink}; "
             'echo "${PIPESTATUS[0]} $(date +%s.%N)" > exit_code.part && mv exit_code.part exit_code')
    # braces: '&' must background only the wrapper, or a subshell keeps the SSH session's output open
    return (f"cd {shlex.quote(remote_run)} && {{ nohup setsid bash -c {shlex.quote(inner)} > /dev/null 2>&1 "
            "< /dev/null & echo $! > wrapper.pid; }")


def start(facts, plan, command: str, run_dir: Path, record: dict, say, out: TextIO = sys.stdout) -> RunResult:
    """Start the wrapper on node 0 (facts[0]), wait until every node runs its ranks (or mpirun already
    ended), record the run as running. Raises ClusterError when the ranks did not start."""
    nodes = [f.node for f in facts]
    master, remote_run = nodes[0], f"{facts[0].home}/runs/{plan.run_id}"
    record.update(detached=True, started_at=time.time(), remote_run=remote_run)
    with connect(master) as conn:
        res = run(conn, command, timeout=60)
    if not res.ok:
        raise ClusterError(f"could not start mpirun on {master.name}: {res.stderr.strip()[-300:]}")
    finish_run(run_dir, record, "running", -1, 0.0, None)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _ended(master, remote_run) is not None:
            break  # a short job may end before we look: conclude it now, as an attached run would
        alive = runs_alive(nodes).get(plan.run_id, {})
        if all(alive.get(n.name, 0) >= plan.ppn for n in nodes):
            if plan.secret_env:  # every rank has read it, and the log filter did at its start
                secrets.forget([(f.node, f"{f.home}/runs/{plan.run_id}") for f in facts])
            say(f"run {plan.run_id} detached: {plan.world_size} rank(s) running on {len(nodes)} node(s); follow it "
                f"with 'fab logs {plan.run_id} -f', list runs with 'fab runs', end it with 'fab stop {plan.run_id}'")
            return RunResult(run_id=plan.run_id, run_dir=run_dir, exit_code=0, wall_s=0.0, results=None,
                             detached=True)
        time.sleep(0.5)
    else:
        sweep(nodes, plan.run_id)
        finish_run(run_dir, record, "failed", 1, time.time() - record["started_at"], None,
                   reason=f"the ranks did not all start within {START_TIMEOUT_S}s")
        raise ClusterError(f"run {plan.run_id}: the ranks did not all start within {START_TIMEOUT_S}s; see "
                           f"'fab logs {plan.run_id}'")
    summary = conclude(run_dir, master_node(record), out=None)
    if summary["status"] != "ok":
        raise ClusterError(f"run {plan.run_id} {summary['status']}: {summary.get('reason', 'see its log')} "
                           f"(log: {run_dir / 'log.txt'})")
    return RunResult(run_id=plan.run_id, run_dir=run_dir, exit_code=0, wall_s=summary["wall_s"],
                     results=results_of(run_dir))


# -- reading records ------------------------------------------------------------------------------
def load(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        raise ClusterError(f"{run_dir} has no readable summary.json; pass a run id from 'fab runs'") from None


def master_node(summary: dict) -> Node:
    return Node(**summary["nodes"][0])


def log_plan(summary: dict) -> LogPlan:
    return LogPlan(summary["run_id"], int(summary["ppn"]), tuple(n["name"] for n in summary["nodes"]))


def results_of(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None


def _ended(master: Node, remote_run: str) -> tuple[int, float] | None:
    """(mpirun's exit status, when it ended) once the wrapper has written them, else None."""
    with connect(master) as conn:
        res = run(conn, f"cat {shlex.quote(remote_run)}/exit_code 2>/dev/null", timeout=30)
    words = res.stdout.split()
    try:
        return (int(words[0]), float(words[1])) if res.ok and len(words) == 2 else None
    except ValueError:
        return None


def is_running_detached(summary: dict) -> bool:
    return bool(summary.get("detached")) and summary.get("status") == "running"


# -- ending ---------------------------------------------------------------------------------------
def conclude(run_dir: Path, master: Node, out: TextIO | None) -> dict:
    """If the detached run has ended on node 0: its log, results and outputs home, its clean-up and
    summary, as for an attached run. Returns the summary (status still 'running' while it runs)."""
    summary = load(run_dir)
    if not is_running_detached(summary):
        return summary
    remote_run = summary["remote_run"]
    ended = _ended(master, remote_run)
    if ended is None:
        return summary
    code, ended_at = ended
    plan = log_plan(summary)
    nodes = [Node(**n) for n in summary["nodes"]]
    with connect(master) as conn:
        text = io.BytesIO()
        conn.get(f"{remote_run}/mpirun.log", text)
    wall = max(0.0, ended_at - float(summary["started_at"]))  # node 0's clock and ours: the same host or NTP
    with (run_dir / "log.txt").open("w") as log_file:
        router = OutputRouter(plan, out or io.StringIO(), log_file)
        router.write(text.getvalue().decode(errors="replace"))
        router.flush_rest()
    record = {k: v for k, v in summary.items() if k not in ("status", "exit_code", "wall_s")}
    remote_out = summary.get("remote_output") or f"{remote_run}/output"
    job = summary.get("job")
    results = None
    if code == 0 or len(router.finished) == plan.world_size:
        if job:
            results = _fetch_json(master, f"{remote_out}/results.json")
            _bring_home(master, remote_out, run_dir)
        swept = sweep(nodes, plan.run_id)  # a rank's teardown crash after [finished]: nothing may be left
        finish_run(run_dir, record, "ok", 0, wall, results, cleanup=swept.to_dict(),
                   **({"crashed_after_finish": {"exit_code": code}} if code else {}))
    else:
        swept = sweep(nodes, plan.run_id)
        node, reason = failed_rank(router.lines, plan)
        if job:
            _bring_home(master, remote_out, run_dir)
        finish_run(run_dir, record, "failed", code, wall, None, failed_node=node, reason=reason,
                   cleanup=swept.to_dict())
    lock.release(nodes, plan.run_id)
    return load(run_dir)


def _fetch_json(master: Node, path: str) -> dict | None:
    with connect(master) as conn:
        res = run(conn, f"cat {shlex.quote(path)}", timeout=60)
    try:
        return json.loads(res.stdout) if res.ok else None
    except ValueError:
        return None


def _bring_home(master: Node, remote_out: str, run_dir: Path) -> None:
    try:
        outputs.fetch_output(master, remote_out, run_dir / "output", True)
    except Exception as exc:  # node 0 gone: the record still gets written
        log.debug("outputs of %s", run_dir.name, exc_info=True)
        log.warning("could not bring the outputs home from %s: %s", master.name, exc)
