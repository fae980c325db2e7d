"""`fab stop RUN`: end a run on every node with the clean-up a failure gets, free the cluster's lock,
and record the run as stopped (also a run whose fab died and left no record)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

from cluster.resolve import Cluster
from core.errors import ClusterError, NodeFailure
from launch import lock
from launch.cleanup import runs_alive, sweep

FINAL = ("ok", "failed", "preempted", "interrupted", "stopped")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_run_id(run_id: str, runs_dir: Path) -> None:
    """A run id is a folder name under runs/: never a path (the record is written under it)."""
    if not RUN_ID.fullmatch(run_id or ""):
        raise ClusterError(f"{run_id!r} is not a run id; pass the name of a run folder under {runs_dir}, e.g. "
                           "20261122-113856-glue-3b36")


def stop(cluster: Cluster, run_id: str, runs_dir: Path) -> str:
    check_run_id(run_id, runs_dir)
    nodes = list(cluster.nodes)
    alive = runs_alive(nodes).get(run_id)
    if not alive and not (Path(runs_dir) / run_id).is_dir():  # a mistyped id gets no folder of its own
        raise ClusterError(f"no run {run_id}: no folder in {runs_dir} and no process of it on the nodes; pass an "
                           f"id from 'ls {runs_dir}' or from the runs row of 'fab doctor'")
    swept = sweep(nodes, run_id)
    lock.release(nodes, run_id)
    summary_path = Path(runs_dir) / run_id / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        summary = {"run_id": run_id}
    if alive or summary.get("status") not in FINAL:
        summary.update(status="stopped", stopped_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cleanup=swept.to_dict(),
                       exit_code=summary.get("exit_code", 143))
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    if not swept.clean:
        raise NodeFailure(f"run {run_id}: {swept.claim()}", sorted({*swept.left, *swept.unchecked}))
    if alive:
        where = ", ".join(f"{n} ({c})" for n, c in alive.items())
        return f"run {run_id} stopped: killed its processes on {where}; {swept.claim()}"
    return f"run {run_id} had no process on the nodes; {swept.claim()}"
