"""With image=base a replacement node boots stock Ubuntu without the software profile, so a run
that --max-restarts would resume on it fails its preflight. The nodes say how they were made (the group's
xeon-cluster:image tag, read into each node's labels by the aws inventory) and --max-restarts is refused on them in
one line, attached or detached, before anything starts."""
from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster import aws
from cluster.resolve import Cluster
from core.constants import TAG_CLUSTER, TAG_IMAGE
from core.errors import ClusterError
from launch.plan.request import TrainRequest
from launch.supervision import restarts, supervisor
from training.runtime.spec import Recovery


def _cluster(image: str) -> Cluster:
    insts = [{"InstanceId": f"i-{i}", "PrivateIpAddress": f"10.0.0.{i + 10}",
              "Tags": [{"Key": TAG_CLUSTER, "Value": "bert"}, {"Key": TAG_IMAGE, "Value": image}]} for i in range(2)]
    nodes = tuple(aws._aws_node(inst, i, "bert") for i, inst in enumerate(insts))
    return Cluster("aws:bert", nodes, Path("/nonexistent"))


def test_the_aws_inventory_reads_how_a_node_was_made():
    assert [n.labels["image"] for n in _cluster("base").nodes] == ["base", "base"]
    untagged = aws._aws_node({"InstanceId": "i-9", "Tags": []}, 0, "bert")  # a node from before the tag
    assert untagged.labels["image"] == ""


def _restarting(req: TrainRequest, times: int) -> TrainRequest:
    return req.but(recovery=Recovery(max_restarts=times))


def test_max_restarts_on_base_image_nodes_is_refused_before_anything_runs(monkeypatch):
    ran = []
    monkeypatch.setattr(restarts, "train", lambda cluster, req, out: ran.append(req) or "result")
    req = TrainRequest.of(job="glue")
    with pytest.raises(ClusterError) as err:
        restarts.train_with_restarts(_cluster("base"), _restarting(req, 2))
    assert not ran
    assert err.value.what.startswith("--max-restarts 2 on cluster aws:bert, whose nodes boot image=base")
    assert "pulumi config set image bake" in err.value.fix and "\n" not in str(err.value)
    # without restarts, or on a baked image (or nodes that do not say), the run goes ahead
    assert restarts.train_with_restarts(_cluster("base"), req) == "result"
    assert restarts.train_with_restarts(_cluster("bake"), _restarting(req, 2)) == "result"
    assert restarts.train_with_restarts(_cluster(""), _restarting(req, 2)) == "result"
    assert len(ran) == 3


def test_a_detached_supervised_run_is_refused_here_before_its_supervisor_starts(monkeypatch):
    started = []
    monkeypatch.setattr(supervisor, "start_on_head", lambda *a, **k: started.append(a))
    monkeypatch.setattr(supervisor, "start", lambda *a, **k: started.append(a))
    r = SimpleNamespace(req=TrainRequest.of(job="glue", recovery=Recovery(max_restarts=1)), max_restarts=1, supervised=True,
                        no_head=False)
    with pytest.raises(ClusterError, match="whose nodes boot image=base"):
        supervisor.detached(_cluster("base"), r, io.StringIO())
    assert not started
    assert supervisor.detached(_cluster("bake"), r, io.StringIO()) is True and len(started) == 1
