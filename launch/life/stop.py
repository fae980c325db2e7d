"""`fab stop RUN`: end a run on every node with the clean-up a failure gets, free the cluster's lock,
and record the run as stopped (also a run whose fab died and left no record)."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from cluster import store as store_lib
from cluster.resolve import Cluster
from core.errors import ClusterError, NodeFailure
from launch.life import head, lock, records
from launch.life.cleanup import runs_alive, sweep
from launch.life.records import Status
from launch.staging import run_secrets
from training.runtime.paths import RunPaths

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_run_id(run_id: str, runs_dir: Path) -> None:
    """A run id is a folder name under runs/: never a path (the record is written under it)."""
    if not RUN_ID.fullmatch(run_id or ""):
        raise ClusterError(f"{run_id!r} is not a run id", fix=f"pass the name of a run folder under {runs_dir}, e.g. "
                           "20261122-113856-glue-3b36")


def stop(cluster: Cluster, run_id: str, runs_dir: Path, store: str | None = None) -> str:
    """A run not under runs_dir (its supervisor runs on the head) is read from the store, its supervisor ended on
    the head, and its stopped record saved here and published to the store."""
    check_run_id(run_id, runs_dir)
    run_id = latest(Path(runs_dir), run_id, store)  # a supervised run goes on under the id it was resumed as
    nodes = list(cluster.nodes)
    run_dir = RunPaths(run_id, runs_dir=runs_dir).home
    rec = _record(run_dir, run_id, store)
    killed = _end_on_head(cluster, rec) or _end_supervisor(rec)
    alive = runs_alive(nodes).get(run_id)
    if not alive and rec is None:  # a mistyped id gets no folder of its own
        raise ClusterError(f"no run {run_id}: no folder in {runs_dir} and no process of it on the nodes",
                           f"pass an id from 'ls {runs_dir}' or from the runs row of 'fab doctor'")
    swept = sweep(nodes, run_id)
    lock.release(nodes, run_id)
    if rec is None:  # a run whose fab died before it wrote a record
        rec = records.RunRecord(run_id=run_id)
    if rec.can(Status.STOPPED) and (alive or killed or not (rec.status and rec.status.terminal)
                                    or rec.status == Status.RESTARTING):
        records.stopped(run_dir, rec, swept.to_dict())
    if not swept.clean:
        raise NodeFailure(f"run {run_id}: {swept.claim()}", sorted({*swept.left, *swept.unchecked}), fix="")
    sup = (f"its supervisor (pid {rec.supervisor['pid']}" + (f" on the head {rec.supervisor['head']}"
           if rec.supervisor.get("head") else "") + ") ended; ") if killed else ""
    if alive:
        where = ", ".join(f"{n} ({c})" for n, c in alive.items())
        return f"run {run_id} stopped: {sup}killed its processes on {where}; {swept.claim()}"
    return f"run {run_id} had no process on the nodes; {sup}{swept.claim()}"


def _record(run_dir: Path, run_id: str, store: str | None) -> records.RunRecord | None:
    """The run's record at home, else the store's copy (a run a head's supervisor ran)."""
    rec = records.load_or_none(run_dir)
    if rec is None and store:
        summary = store_lib.read_summary(store, run_id)
        rec = records.RunRecord.from_json(summary) if summary else None
    return rec


def _end_on_head(cluster: Cluster, rec: records.RunRecord | None) -> bool:
    """SIGTERM to the run's supervisor on the cluster's head, found by its XC_SUPERVISOR; True if one ended."""
    sup = (rec.supervisor if rec else None) or {}
    if not sup.get("head") or cluster.head is None or cluster.head.name != sup["head"]:
        return False
    chain = sup.get("chain") or rec.run_id
    ended = bool(head.end_on(cluster.head, chain))
    if cluster.head.labels.get("aws_head"):  # the chain is over: its secrets leave SSM (launch.staging.run_secrets)
        run_secrets.delete_chain(cluster.head.labels["aws_head"], chain)
    return ended


def latest(runs_dir: Path, run_id: str, store: str | None = None) -> str:
    """The last run of a resume chain that run_id starts (run_id itself when it was not resumed)."""
    seen = {run_id}
    while True:
        rec = _record(RunPaths(run_id, runs_dir=runs_dir).home, run_id, store)
        if rec is None or not rec.restarted_as or rec.restarted_as in seen:
            return run_id
        run_id = rec.restarted_as
        seen.add(run_id)


def _end_supervisor(rec: records.RunRecord | None, wait_s: float = 10.0) -> bool:
    """SIGTERM to the run's supervisor when it lives on this host (so it starts no restart); True if it ended."""
    if rec is None or not records.supervisor_alive(rec.supervisor) or rec.supervisor["pid"] == os.getpid():
        return False
    try:
        os.kill(int(rec.supervisor["pid"]), signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and records.supervisor_alive(rec.supervisor):
        time.sleep(0.1)
    return True
