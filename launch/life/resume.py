"""`fab train --resume RUN`: the same job, flags and data as RUN, from its latest complete checkpoint in the
cluster's store (each new node takes it from there: nothing crosses the operator's link), in a new run
folder. Runs recorded before the store resume from their checkpoint at home, shipped as before.

The code: the run's snapshot in the store (launch.staging.snapshot), whatever the folder holds now; `--code current`
takes the folder (or the lone script) as it is now instead, and fab names the files that changed. A run recorded
without a snapshot (no store) resumes only with its folder, script and data files unchanged."""
from __future__ import annotations

import json
import os
from pathlib import Path

from cluster import store as store_lib
from core.errors import ClusterError, NoCheckpoint, NoRecord
from launch.life import records
from launch.plan.request import Resume, TrainRequest, file_digest
from launch.staging import secrets
from launch.staging import workdir as workdir_lib
from training.runtime.paths import Checkpoints, RunPaths
from training.runtime.spec import RunSpec


def _summary(run_id: str, run_dir: Path, runs_dir: Path, store: str | None) -> dict:
    """The run's record at home, else in the store (a run started from another machine)."""
    try:
        return records.load(run_dir).to_json()
    except NoRecord:
        pass
    summary = store_lib.read_summary(store, run_id) if store else None
    if summary is None:
        where = f" nor in the store {store}" if store else ""
        raise NoRecord(f"--resume {run_id}: no readable {run_dir}/summary.json{where}", fix="pass the id of a run "
                       "from 'fab runs'")
    return records.RunRecord.from_json(summary).to_json()


def store_checkpoint(run_id: str, summary: dict, store: str | None) -> tuple[int, str] | None:
    """(step, URL) of the run's newest complete checkpoint in the store it used (else the one chosen now)."""
    recorded = records.RunRecord.from_json(summary).store
    for url in dict.fromkeys(u for u in (recorded, store) if u):
        steps = store_lib.checkpoints(url, run_id)
        if steps:
            return steps[-1], RunPaths(run_id).store_url(url, steps[-1])
    return None


def resume_request(run_id: str, runs_dir: Path, nodes: int | None = None, fetch_model: bool = True,
                   store: str | None = None, code: str = "snapshot") -> TrainRequest:
    """The request that continues RUN; refuses a finished run, a missing checkpoint, and without a snapshot of its
    code (or with `code` "current") a folder, script or data file that is gone or (but for --code current's code)
    changed."""
    run_dir = RunPaths(run_id, runs_dir=runs_dir).home
    summary = _summary(run_id, run_dir, Path(runs_dir), store)
    if summary.get("status") == "ok":
        raise ClusterError(f"--resume {run_id}: that run finished", fix=f"its results are in {run_dir} (nothing to resume)")
    kept = RunSpec.of_summary(summary)
    if kept is None:
        raise ClusterError(f"--resume {run_id}: it was recorded before runs could be resumed",
                           fix="start it anew with 'fab train'")
    what = kept.what
    held = what.snapshot if code == "snapshot" else None
    if (what.own or what.workdir) and not held:
        same_code(run_id, what, summary.get("workdir"), changed_ok=code == "current")
    in_store = store_checkpoint(run_id, summary, store)
    if in_store:
        step, url = in_store
        checkpoint = None
    else:
        latest = Checkpoints.latest(RunPaths(run_id, runs_dir=runs_dir).home_checkpoints)
        if not latest:
            where = records.RunRecord.from_json(summary).store or store
            in_where = f"{where}/{RunPaths(run_id).store_checkpoints} nor in " if where else ""
            raise NoCheckpoint(f"--resume {run_id}: no complete checkpoint in {in_where}{run_dir}/checkpoints", fix="start "
                               "the run anew")
        (step, checkpoint), url = latest, None
        if not fetch_model_ok(checkpoint):
            raise ClusterError(f"--resume {run_id}: checkpoint {checkpoint.name} has no model weights (the run used "
                               "--no-fetch-model)", fix="start the run anew")
    for path, digest in ({} if held else what.data).items():  # a snapshot holds the run's data
        if not Path(path).is_file():
            raise ClusterError(f"--resume {run_id}: its data file {path} is gone", fix="restore it or start anew")
        if file_digest(path) != digest:
            raise ClusterError(f"--resume {run_id}: its data file {path} changed since the run", fix="a resumed run must "
                               "train on the same data (restore it or start anew)")
    env = dict(what.env)
    # the record keeps secrets as ***: the operator's own values stand in (--env KEY=VALUE overrides)
    hidden = {k for k, v in env.items() if v == secrets.MASK}
    env.update({k: os.environ[k] for k in hidden if k in os.environ})
    resume = Resume(run_id=run_id, step=step, world_size=int(summary["world_size"]),
                    checkpoint=str(checkpoint) if checkpoint else None, url=url, snapshot=what.snapshot,
                    current=code == "current")
    # masked job arguments (--hub_token ***): the operator's own value under the flag's name (HUB_TOKEN); --code
    # current: no snapshot, a new one of the folder as it is now
    return TrainRequest.of(kept, args=secrets.fill_masked(list(what.args), os.environ), env=env, valueless=hidden,
                           snapshot=held, nodes=nodes or len(summary["nodes"]), runs_dir=runs_dir,
                           fetch_model=fetch_model, resume=resume)


def same_code(run_id: str, what, shipped: dict | None, changed_ok: bool = False) -> None:
    """A resumed --script/--workdir run without a snapshot of its code runs the folder here: it must be there, and
    its content hash (or the lone script's) what the record keeps, unless `changed_ok` (--code current)."""
    if what.workdir:
        path = what.workdir
        if not Path(path).is_dir():
            fix = "restore the folder" if changed_ok else "restore the folder as it was, or start the run anew"
            raise ClusterError(f"--resume {run_id}: its --workdir {path} is gone", fix=fix)
        if changed_ok:
            return
        if shipped and shipped.get("digest") and workdir_lib.scan(path).digest != shipped["digest"]:
            raise ClusterError(f"--resume {run_id}: --workdir {path} changed since the run shipped it (content "
                               f"{workdir_lib.scan(path).digest[:12]}, the run's {shipped['digest'][:12]})",
                               fix="restore it as it was (git stash / checkout), resume with --code current (the "
                                   "folder as it is now), or start the run anew")
        return
    script, digest = what.script, what.script_digest
    if not Path(script).is_file():
        raise ClusterError(f"--resume {run_id}: its script {script} is gone", fix="restore it, or start the run anew")
    if digest and not changed_ok and file_digest(script) != digest:
        raise ClusterError(f"--resume {run_id}: its script {script} changed since the run",
                           fix="restore it as it was, resume with --code current (the file as it is now), or start "
                               "the run anew")


def resumed_from(runs_dir: Path, run_id: str) -> str | None:
    """The run that run_id resumed, if any."""
    try:
        summary = json.loads((RunPaths(run_id, runs_dir=runs_dir).home / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return (summary.get("resumed_from") or {}).get("run_id")


def fetch_model_ok(checkpoint: Path) -> bool:
    return any(checkpoint.glob("*.safetensors")) or any(checkpoint.glob("*.bin"))


