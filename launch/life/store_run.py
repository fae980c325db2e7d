"""A run and the cluster's store: what the request carries to reach it, and a preempted run's ending, which
rests on the checkpoint the nodes wrote there (cluster.store, training.runtime.store)."""
from __future__ import annotations

import logging

from cluster import store as store_lib
from core.errors import ClusterError
from launch.plan.request import TrainRequest
from launch.staging import secrets
from training.runtime import store as training_store

log = logging.getLogger(__name__)


def apply(req: TrainRequest, choice: store_lib.Choice, spec: str | None = None) -> TrainRequest:
    """The request with the store's variables in the ranks' environment: the URL and endpoint as chosen now;
    credentials where the request has none of its own (--env wins; a resumed record's *** is filled in)."""
    env, wanted = dict(req.spec.what.env), store_lib.rank_env(choice, spec)
    for key, value in wanted.items():
        if key == training_store.STORE_ENV or key not in env or env[key] == secrets.MASK:
            env[key] = value
    for key in ("XC_S3_ENDPOINT_URL",):  # a resumed record's endpoint that no longer applies
        if key in env and key not in wanted:
            env.pop(key)
    return req.but(env=env)


def has_checkpoint(req: TrainRequest, run_id: str) -> bool:
    url = req.store
    if not url:
        return False
    try:
        return bool(store_lib.checkpoints(url, run_id))
    except ClusterError as exc:
        log.warning("%s", exc)
        return False


def publish_outputs(r) -> None:
    """[store] A run that ends without its job's own publish (a failure, or a --script run, whose ranks publish
    nothing but checkpoints): the outputs that came home to runs/<id>/output/ (metrics, state, logs; weights only
    if fetched) into the store beside its records, so 'fab pull' brings them to any checkout.
    From here, not node 0: the run's secrets, the only credentials a node off AWS has, are gone by now. Never
    raises: the run's ending is recorded whatever the store does."""
    url = r.record.store
    if not url:
        return
    try:
        sent = training_store.publish_output(r.run_dir / "output", url, r.run_id)
        if sent is not None:
            log.info("run %s: its outputs are in the store %s (%.1f MB)", r.run_id, url, sent / 1e6)
    except training_store.StoreError as exc:
        log.warning("run %s: its outputs did not reach the store: %s", r.run_id, exc)
