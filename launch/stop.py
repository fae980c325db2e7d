"""`fab stop RUN`: end a run on every node with the clean-up a failure gets, free the cluster's lock,
and record the run as stopped (also a run whose fab died and left no record)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from cluster.resolve import Cluster
from core.errors import NodeFailure
from launch import lock
from launch.cleanup import runs_alive, sweep

FINAL = ("ok", "failed", "preempted", "interrupted", "stopped")


def stop(cluster: Cluster, run_id: str, runs_dir: Path) -> str:
    nodes = list(cluster.nodes)
    alive = runs_alive(nodes).get(run_id)
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
