"""`fab train --resume RUN`: the same job, flags and data as RUN, from its latest complete checkpoint
at home (shipped from the operator's copy, so a new node 0 works), in a new run folder."""
from __future__ import annotations

import os
from pathlib import Path

from core.errors import ClusterError, NoCheckpoint, NoRecord
from launch import outputs, records, secrets
from launch.request import TrainRequest, file_digest


def resume_request(run_id: str, runs_dir: Path, nodes: int | None = None, fetch_model: bool = True) -> TrainRequest:
    """The request that continues RUN; refuses a finished run, changed data, a missing checkpoint."""
    run_dir = Path(runs_dir) / run_id
    try:
        summary = records.load(run_dir).to_json()
    except NoRecord:
        raise NoRecord(f"--resume {run_id}: no readable {run_dir}/summary.json; pass the id of a run "
                       f"under {runs_dir} (ls {runs_dir})") from None
    if summary.get("status") == "ok":
        raise ClusterError(f"--resume {run_id}: that run finished; its results are in {run_dir} (nothing to resume)")
    request = summary.get("request")
    if not request or request.get("script"):
        what = "was a --script run" if request else "was recorded before runs could be resumed"
        raise ClusterError(f"--resume {run_id}: it {what}; start it anew with 'fab train' (your script can "
                           "resume from XC_RESUME_FROM or --resume_from_checkpoint)")
    home = outputs.home_checkpoints(run_dir)
    if not home:
        raise NoCheckpoint(f"--resume {run_id}: no complete checkpoint in {run_dir}/checkpoints; start the run anew")
    step, checkpoint = home[-1]
    if not fetch_model_ok(checkpoint):
        raise ClusterError(f"--resume {run_id}: checkpoint step-{step} has no model weights (the run used "
                           "--no-fetch-model); start the run anew")
    for path, digest in request.get("data", {}).items():
        if not Path(path).is_file():
            raise ClusterError(f"--resume {run_id}: its data file {path} is gone; restore it or start anew")
        if file_digest(path) != digest:
            raise ClusterError(f"--resume {run_id}: its data file {path} changed since the run; a resumed run must "
                               "train on the same data (restore it or start anew)")
    args = list(request["args"])
    env = dict(request["env"])
    # the record keeps secrets as ***: the operator's own values stand in (--env KEY=VALUE overrides)
    hidden = {k for k, v in env.items() if v == secrets.MASK}
    env.update({k: os.environ[k] for k in hidden if k in os.environ})
    old_world = int(summary["world_size"])
    old_nodes = len(summary["nodes"])
    return TrainRequest(
        nodes=nodes or old_nodes, job=request["job"], args=args, ppn=request["ppn"], threads=request["threads"],
        backend=request["backend"], precision=request["precision"], env=env, valueless=hidden,
        comm_hook=request.get("comm_hook", "none"),  # records before --comm-hook sent fp32
        save_every=request["save_every"], pin=request["pin"], timeout_s=request["timeout_s"], runs_dir=runs_dir,
        fetch_model=fetch_model,
        resume={"run_id": run_id, "step": step, "checkpoint": str(checkpoint), "world_size": old_world})


def resumed_from(runs_dir: Path, run_id: str) -> str | None:
    """The run that run_id resumed, if any."""
    rec = records.load_or_none(Path(runs_dir) / run_id)
    return ((rec.resumed_from if rec else None) or {}).get("run_id")


def fetch_model_ok(checkpoint: Path) -> bool:
    return any(checkpoint.glob("*.safetensors")) or any(checkpoint.glob("*.bin"))


