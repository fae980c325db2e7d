"""One run per cluster at a time: a lock folder on node 0 naming the run that holds it.

A lock whose run has no process left on any node, and that is older than STALE_S (staging takes
less), belonged to an operator that is gone: it is taken over, and the run says so.
"""
from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path

from cluster.node import Node
from cluster.remote import connect, run
from core.constants import HOME_EXPR
from core.errors import ClusterError
from launch.life import records
from launch.life.cleanup import runs_alive
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)

LOCK = f"{HOME_EXPR}/run.lock"
STALE_S = 120


def _holder(nodes: list[Node]) -> dict | None:
    with connect(nodes[0]) as conn:
        res = run(conn, f"cat {LOCK}/holder.json")
    if not res.ok:
        return None
    try:
        return json.loads(res.stdout)
    except ValueError:
        return {"run_id": "?", "since": 0}


def take(nodes: list[Node], run_id: str, say, runs_dir: Path | None = None) -> None:
    """Hold the cluster for run_id, or raise naming the run that holds it. A holder whose summary.json (in the runs
    folder it named, or in runs_dir) says it ended has ended (every run that made a folder writes one), whatever its
    node 0 kept."""
    holder = json.dumps({"run_id": run_id, "since": time.time(), "runs_dir": str(runs_dir) if runs_dir else None})
    for _ in range(2):
        with connect(nodes[0]) as conn:
            res = run(conn, f"mkdir -p {HOME_EXPR} && mkdir {LOCK} 2>/dev/null && "
                            f"echo {shlex.quote(holder)} > {LOCK}/holder.json && echo taken")
        if res.stdout.strip() == "taken":
            return
        held = _holder(nodes) or {"run_id": "?", "since": 0}
        other = held.get("run_id", "?")
        alive = runs_alive(nodes).get(other)
        since = float(held.get("since") or 0)
        # its record where its operator keeps runs (another checkout's runs/, a bench's XC_RUNS_DIR), or in ours
        ended = any(_ended(RunPaths(other, runs_dir=Path(d)).home / "summary.json")
                    for d in dict.fromkeys((held.get("runs_dir"), runs_dir)) if d)
        if alive or (time.time() - since < STALE_S and not ended):
            where = ", ".join(f"{n} ({c} process(es))" for n, c in (alive or {}).items()) or "starting"
            raise ClusterError(f"run {other} holds this cluster ({where}, since "
                               f"{time.strftime('%H:%M:%S', time.localtime(since))})", fix=f"wait for it to end, end it "
                               f"with 'fab stop {other}', or pass --concurrent")
        say(f"note: run {other} held the cluster but has no process left on any node: taking over its lock")
        release(nodes, other)
    raise ClusterError(f"could not take the run lock {LOCK} on {nodes[0].name}", fix="remove it by hand if no run is going")


def _ended(summary: Path) -> bool:
    """A run that wrote its final record; a detached or attached run records 'running' while it goes on."""
    rec = records.load_or_none(summary.parent)
    return rec is not None and rec.status is not None and rec.status.terminal


def release(nodes: list[Node], run_id: str) -> None:
    """Remove the lock if run_id holds it; never raises (a lost node 0 keeps its lock, which then goes stale)."""
    try:
        held = _holder(nodes)
        if held and held.get("run_id") == run_id:
            with connect(nodes[0]) as conn:
                run(conn, f"rm -rf {LOCK}")
    except Exception:
        log.debug("releasing the run lock of %s", run_id, exc_info=True)
