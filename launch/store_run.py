"""A run and the cluster's store: what the request carries to reach it, and a preempted run's ending, which
rests on the checkpoint the nodes wrote there (cluster.store, training.store)."""
from __future__ import annotations

import logging
from pathlib import Path

from cluster import store as store_lib
from core.errors import ClusterError, NodeFailure, Preempted
from launch import secrets
from launch.records import finish_run
from launch.request import TrainRequest

log = logging.getLogger(__name__)


def apply(req: TrainRequest, choice: store_lib.Choice, spec: str | None = None) -> None:
    """The store's variables into the ranks' environment: the URL and endpoint as chosen now; credentials
    where the request has none of its own (--env wins; a resumed record's *** is filled in)."""
    for key, value in store_lib.rank_env(choice, spec).items():
        if key == "XC_STORE" or key not in req.env or req.env[key] == secrets.MASK:
            req.env[key] = value
    for key in ("XC_S3_ENDPOINT_URL",):  # a resumed record's endpoint that no longer applies
        if key in req.env and key not in store_lib.rank_env(choice, spec):
            req.env.pop(key)


def has_checkpoint(req: TrainRequest, run_id: str) -> bool:
    url = req.env.get("XC_STORE")
    if not url:
        return False
    try:
        return bool(store_lib.checkpoints(url, run_id))
    except ClusterError as exc:
        log.warning("%s", exc)
        return False


def preempted(plan, run_dir: Path, record: dict, req: TrainRequest, node: str, rank: int, step: int,
              exit_code: int, wall: float, swept) -> None:
    """Record the run as preempted when the store holds a complete checkpoint (the notice's, or the newest),
    and raise Preempted; else record it failed and raise NodeFailure. Always raises."""
    url = req.env["XC_STORE"]
    try:
        steps = store_lib.checkpoints(url, plan.run_id)
    except ClusterError as exc:
        log.warning("%s", exc)
        steps = []
    if not steps:
        finish_run(run_dir, record, "failed", exit_code, wall, None, failed_node=node, cleanup=swept.to_dict(),
                   reason=f"spot notice on {node} at step {step}, but no complete checkpoint reached the store {url}")
        raise NodeFailure(f"run {plan.run_id} preempted on {node} at step {step} and no checkpoint reached the store "
                          f"{url}; {swept.claim()}", [node], run_id=plan.run_id, lost=sorted(swept.unchecked))
    if step not in steps:
        log.warning("the notice's checkpoint (step %s) is not in the store; the newest there is step %s", step,
                    steps[-1])
        step = steps[-1]
    where = f"{url}/runs/{plan.run_id}/checkpoints/step-{step}"
    finish_run(run_dir, record, "preempted", 75, wall, None, preempted={
        "node": node, "rank": rank, "step": step, "checkpoint": where}, cleanup=swept.to_dict())
    raise Preempted(f"run {plan.run_id} preempted on {node} at step {step}: checkpoint saved ({where}); "
                    f"resume with 'fab train --resume {plan.run_id}'", run_id=plan.run_id, node=node)
