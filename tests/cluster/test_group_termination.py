"""The Auto Scaling group's own terminations (capacity rebalancing, instance refresh, scale-in) give no spot
notice: a termination lifecycle hook holds the node and IMDS answers target-lifecycle-state "Terminated". The
ranks treat it as a notice (checkpoint, exit 75, the cause in summary.json) and complete the lifecycle action
once the checkpoint outlives the node; a rebalance recommendation is a checkpoint while training goes on.
Against the fake IMDS on loopback; the cluster tests on the session's 2-node local cluster."""
from __future__ import annotations

import json
import re

import pytest
from conftest import processes_with_env, progress_step, wait_until
from fake_imds import FakeIMDS

from launch.life import records
from training.runtime import spot
from training.runtime.paths import Checkpoints


def test_a_group_termination_is_a_notice_with_its_cause():
    imds = FakeIMDS()
    try:
        w = spot.NoticeWatcher(imds.url, interval=0.05)
        assert w.check() is None and w.rebalance is None  # InService, no recommendation
        imds.terminate_by_group()
        assert w.check() == {"action": "terminate", "cause": spot.GROUP_CAUSE}
        imds.clear()
        imds.interrupt()
        assert w.check()["cause"] == spot.SPOT_CAUSE
    finally:
        imds.close()


def test_a_rebalance_recommendation_is_kept_but_is_no_notice():
    imds = FakeIMDS()
    try:
        w = spot.NoticeWatcher(imds.url, interval=0.05)
        imds.recommend_rebalance()
        assert w.check() is None
        assert w.rebalance and "noticeTime" in w.rebalance
    finally:
        imds.close()


def test_the_node_completes_its_lifecycle_action_with_continue(tmp_path, monkeypatch):
    import boto3
    from botocore.stub import Stubber

    env = tmp_path / "cluster.env"
    env.write_text("XC_CLUSTER=dev\nXC_ASG_NAME=dev-nodes\nXC_LIFECYCLE_HOOK=xc-checkpoint\n")
    monkeypatch.setenv("XC_CLUSTER_ENV", str(env))
    imds = FakeIMDS()
    client = boto3.client("autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    try:
        w = spot.NoticeWatcher(imds.url)
        with Stubber(client) as stub:
            stub.add_response("complete_lifecycle_action", {}, {
                "AutoScalingGroupName": "dev-nodes", "LifecycleHookName": "xc-checkpoint",
                "InstanceId": imds.instance_id, "LifecycleActionResult": "CONTINUE"})
            assert spot.complete_lifecycle_action(w, client) is True
            stub.assert_no_pending_responses()
        env.write_text("XC_CLUSTER=dev\n")  # a node from before the hook: nothing to complete
        assert spot.complete_lifecycle_action(w, client) is False
    finally:
        imds.close()


@pytest.mark.cluster
@pytest.mark.slow
def test_a_rebalance_checkpoints_while_the_run_goes_on_then_a_group_termination_exits_75_and_resumes(cluster2,
                                                                                                   small_model):
    """One run for both (each run's ranks are CPU the suite waits for): a rebalance recommendation puts a checkpoint in
    the store while training goes on; then the group's termination checkpoints again, the run exits 75 naming its
    cause, and it resumes from that checkpoint."""
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    store = cluster2.runs.parent / "store" / "runs"  # the local store
    try:
        with cluster2.start("train", "--nodes", "2", "--save-every", "0", *imds.train_env(), "--",
                            *FakeIMDS.short_args(small_model)) as running:
            running.wait_for(lambda line: (progress_step(line) or 0) >= 5, 400)
            run_id = (cluster2.run_dirs() - before).pop()
            imds.recommend_rebalance()
            rebalanced = int(running.wait_for(re.compile(r"\[rebalance\] step=(\d+)"), 120).group(1))
            marker = store / run_id / "checkpoints" / f"checkpoint-{rebalanced}" / Checkpoints.MARKER
            wait_until("the rebalance checkpoint in the store", marker.is_file, 120, poll=0.5)
            assert running.proc.poll() is None  # it reached the store while the run went on
            imds.terminate_by_group()
            proc = running.finish(600)
    finally:
        imds.close()
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 75, out[-3000:] + err[-3000:]
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "preempted" and summary["cause"] == "group termination", summary
    step = summary["preempted"]["step"]
    assert step > rebalanced  # training went on after the rebalance's checkpoint
    assert (store / run_id / "checkpoints" / f"checkpoint-{step}" / Checkpoints.MARKER).is_file()
    assert not [ln for ln in imds.requests if "spot/instance-action" in ln[1] and ln[2] == 200]  # no spot notice
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    res = cluster2.fab("train", "--resume", run_id, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    resumed = (cluster2.run_dirs() - before - {run_id}).pop()
    assert json.loads((cluster2.runs / resumed / "results.json").read_text())["resumed_from_step"] == step


def test_node_0_without_a_store_keeps_its_node_until_the_heartbeat_ends(monkeypatch):
    """Without a store the checkpoint lives on node 0 until fab copies it: node 0 must not let the group take
    it early; other nodes, and node 0 once the store holds the checkpoint, release at once."""
    released = []
    monkeypatch.setattr(spot, "complete_lifecycle_action", lambda w, client=None: released.append(w) or True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    w = spot.NoticeWatcher("http://127.0.0.1:9")
    w.notice = {"action": "terminate", "cause": spot.GROUP_CAUSE}
    assert spot.release_node(w, rank=0, local_rank=0, durable=False) is False
    assert spot.release_node(w, rank=1, local_rank=0, durable=False) is True
    assert spot.release_node(w, rank=0, local_rank=0, durable=True) is True
    w.notice = {"action": "terminate", "cause": spot.SPOT_CAUSE}  # a spot interruption has no lifecycle action
    assert spot.release_node(w, rank=1, local_rank=0, durable=True) is False
    assert len(released) == 2
