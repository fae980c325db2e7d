"""A group termination (instance refresh, rebalance, scale-in) holds a leaving node for the hook's
300 s heartbeat timeout; while the notice's checkpoint uploads, the node records lifecycle heartbeats so that a slow
upload is not cut at 270 s. botocore's Stubber checks every call against the Auto Scaling service model."""
from __future__ import annotations

import time

import boto3
import pytest
from botocore.stub import Stubber
from fake_imds import FakeIMDS

from infra.nodes import TERMINATION_HEARTBEAT_S
from training.runtime import notice, preempt, publish, spot


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node of group dev-nodes with hook xc-checkpoint and its IMDS; yields (watcher, instance id, client)."""
    env = tmp_path / "cluster.env"
    env.write_text("XC_CLUSTER=dev\nXC_ASG_NAME=dev-nodes\nXC_LIFECYCLE_HOOK=xc-checkpoint\n")
    monkeypatch.setenv("XC_CLUSTER_ENV", str(env))
    imds = FakeIMDS()
    client = boto3.client("autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    try:
        yield spot.NoticeWatcher(imds.url), imds.instance_id, client
    finally:
        imds.close()


def test_the_heartbeat_extends_this_nodes_own_action_until_stopped(node):
    watcher, instance, client = node
    expected = {"AutoScalingGroupName": "dev-nodes", "LifecycleHookName": "xc-checkpoint", "InstanceId": instance}
    with Stubber(client) as stub:
        for _ in range(3):
            stub.add_response("record_lifecycle_action_heartbeat", {}, expected)
        beat = spot.LifecycleHeartbeat(watcher, client, every=0.05)
        beat.start()
        deadline = time.monotonic() + 5
        while beat.sent < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        beat.stop()
        beat.join(2)
        assert beat.sent == 3 and not beat.is_alive() and beat.error is None
        stub.assert_no_pending_responses()


def test_a_refused_heartbeat_stops_it_and_the_hooks_own_timeout_applies(node):
    """Another node's notice (this one is not leaving: no active action), or a role without the action."""
    watcher, _, client = node
    with Stubber(client) as stub:
        stub.add_client_error("record_lifecycle_action_heartbeat", "ValidationError",
                              "No active Lifecycle Action found with instance ID i-0")
        beat = spot.LifecycleHeartbeat(watcher, client, every=0.05)
        beat.start()
        beat.join(5)
        assert not beat.is_alive() and beat.sent == 0 and "No active Lifecycle Action" in beat.error


def test_the_budget_the_docs_name_fits_the_hook_and_aws_limits():
    # each heartbeat restarts the hook's timeout, well before it runs out; AWS caps a hold at 100 timeouts
    assert spot.HEARTBEAT_EVERY_S < TERMINATION_HEARTBEAT_S / 2
    assert publish.ON_GROUP_S < TERMINATION_HEARTBEAT_S < spot.GROUP_HOLD_S <= 100 * TERMINATION_HEARTBEAT_S


def test_only_a_group_termination_on_a_nodes_first_rank_starts_one(node, monkeypatch):
    watcher, _, _ = node
    started = []
    monkeypatch.setattr(spot.LifecycleHeartbeat, "start", lambda self: started.append(self))
    guard = preempt.Guard(watcher=watcher, callback=None, publisher=None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert preempt.heartbeat(guard, notice.SPOT) is None  # a spot notice: two minutes, nothing to extend
    beat = preempt.heartbeat(guard, notice.GROUP)
    assert started == [beat] and beat.watcher is watcher
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's other ranks leave it to the first
    assert preempt.heartbeat(guard, notice.GROUP) is None


def _rank(rank: int, port: int, beating: bool, out: str) -> None:
    """One of two gloo ranks deciding whether the notice's checkpoint is durable: rank 0's upload takes 2.5 s, past
    the hook's own wait (shortened to 1 s); rank 1's node is the one leaving, its heartbeat holding or not."""
    import json
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    publish.ON_GROUP_S, spot.GROUP_HOLD_S = 1.0, 8.0
    started = time.monotonic()

    class Upload:  # rank 0's publisher
        def wait(self, timeout):
            time.sleep(timeout)
            return time.monotonic() - started > 2.5

        def confirmed(self, step):
            return True

    beat = SimpleNamespace(sent=1, is_alive=lambda: True, stop=lambda: None)
    preempt.heartbeat = lambda guard, cause: beat if rank == 1 and beating else None
    guard = preempt.Guard(watcher=None, callback=None, publisher=SimpleNamespace(publisher=Upload() if rank == 0 else None))
    ok = preempt.durable(guard, 20, notice.GROUP, poll=0.2)
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ok": ok, "waited": time.monotonic() - started}, f)


@pytest.mark.parametrize("beating", [True, False])
def test_a_heartbeat_on_the_leaving_node_lets_every_rank_wait_for_the_upload(tmp_path, beating):
    """The ranks agree in their all-reduce that some node's heartbeat holds its action (the negated third flag), so
    rank 0 waits up to GROUP_HOLD_S instead of the hook's 270 s; without one the slow upload is cut as before."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, beating, str(tmp_path / "r")), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"r.{rank}").read_text()) for rank in (0, 1)]
    assert [g["ok"] for g in got] == ([True, True] if beating else [False, False])
    if beating:
        assert all(2.5 <= g["waited"] < 8.0 for g in got)
    else:
        assert all(g["waited"] < 2.5 for g in got)
