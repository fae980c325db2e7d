"""`fab status` and the default cluster: on a real local cluster, and on a moto-backed AWS cluster
picked from a (fake) selected Pulumi stack without --cluster, as the README's three commands run."""
from __future__ import annotations

import os

import moto_fixture
import pytest
from conftest import fab, free_cluster_port
from test_discovery_aws import fake_pulumi, launch


@pytest.mark.cluster
def test_status_of_a_local_cluster_shows_each_node_and_a_down_one(tmp_path):
    env = {"XC_STATE_DIR": str(tmp_path / "state"), "XC_RUNS_DIR": str(tmp_path / "runs")}
    fab("local-up", "--nodes", "2", "--port", str(free_cluster_port(2)), env=env, check=True, timeout=120)
    try:
        res = fab("status", env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == "cluster: local, 2 node(s)"
        assert lines[1].split() == ["node", "address/instance", "type", "market", "state", "uptime", "$/h"]
        assert [ln.split()[0] for ln in lines[2:4]] == ["node0", "node1"]
        assert all(" running " in ln for ln in lines[2:4])
        assert lines[-1] == "runs: no process of any run on the nodes"
        fab("local-kill", "--node", "node1", env=env, check=True, timeout=60)
        down = fab("status", env=env, timeout=120)
        assert down.returncode == 1
        assert " DOWN " in next(ln for ln in down.stdout.splitlines() if ln.startswith("node1 "))
        assert "not running: node1 (DOWN); 'fab local-up' restarts the local nodes that are down" in down.stdout
    finally:
        fab("local-down", env=env, timeout=120)


def aws_cli_env(tmp_path, monkeypatch) -> dict:
    """A selected stack 'dev' of cluster 'bert' (fake pulumi CLI), no local cluster, moto for EC2."""
    fake_pulumi(tmp_path, monkeypatch, "print(json.dumps({'clusterName': 'bert', 'region': 'us-east-1', "
                                       "'nodeCount': 4}))\n")
    return {"PATH": os.environ["PATH"], "XC_STATE_DIR": str(tmp_path / "state"), "XC_RUNS_DIR": str(tmp_path / "runs"),
            "XC_CLUSTER": ""}


def test_after_pulumi_up_status_and_train_use_the_stack_without_cluster_flag(aws_env, tmp_path, monkeypatch):
    ids = [launch("bert", "master"), *[launch("bert") for _ in range(3)]]
    launch("other", "master")
    env = aws_cli_env(tmp_path, monkeypatch)

    res = fab("status", "--no-runs", env=env, timeout=120)
    lines = res.stdout.splitlines() or [res.stderr]
    assert lines[0] == "cluster: pulumi: aws:bert in us-east-1, 4 node(s)", res.stdout + res.stderr
    rows = [ln.split() for ln in lines[2:6]]
    assert [r[0] for r in rows] == ["bert-0", "bert-1", "bert-2", "bert-3"]
    assert [r[1] for r in rows] == ids  # node 0 is the master, the rest oldest first
    assert {r[2] for r in rows} == {"c6i.16xlarge"} and {r[4] for r in rows} == {"running"}
    assert all(float(r[6]) > 0 for r in rows)  # a price per node, from moto's spot history or the catalog
    assert res.returncode == 0 and lines[6].startswith("total: $")

    # the stack's store (its storeUrl output): the bucket on moto, reached through XC_S3_ENDPOINT_URL
    (tmp_path / "with-store").mkdir()
    fake_pulumi(tmp_path / "with-store", monkeypatch, "print(json.dumps({'clusterName': 'bert', 'region': "
                "'us-east-1', 'nodeCount': 4, 'storeUrl': 's3://bert-store/bert'}))\n")
    moto_fixture.client("s3").create_bucket(Bucket="bert-store")
    env.update(PATH=os.environ["PATH"], XC_S3_ENDPOINT_URL=aws_env)
    train = fab("train", "--nodes", "4", env=env, timeout=300)
    assert train.stdout.splitlines()[:2] == ["cluster: pulumi: aws:bert in us-east-1, 4 node(s)",
                                             "store: s3://bert-store/bert (the stack's storeUrl)"], train.stderr
    # moto's instances print no host keys: fab refuses to dial a node it cannot verify, and says why
    last = train.stderr.strip().splitlines()[-1]
    assert train.returncode == 1 and last.startswith("error: probing nodes failed on 4 nodes: bert-0 ("), last
    assert last.count("host key not yet known") == 4
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


def test_no_local_cluster_and_no_stack_falls_back_to_the_local_error(tmp_path, monkeypatch):
    fake_pulumi(tmp_path, monkeypatch, "sys.stderr.write('error: no stack selected\\n'); sys.exit(255)\n")
    res = fab("status", env={"PATH": os.environ["PATH"], "XC_STATE_DIR": str(tmp_path / "state"), "XC_CLUSTER": ""},
              timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == \
        "error: no local cluster is running; start one with 'fab local-up --nodes 2'"


def test_an_instance_still_booting_is_listed_as_such(aws_env, tmp_path, monkeypatch):
    launch("bert", "master")
    stopped = launch("bert")
    moto_fixture.client("ec2").stop_instances(InstanceIds=[stopped])
    res = fab("status", "--no-runs", env=aws_cli_env(tmp_path, monkeypatch), timeout=120)
    assert res.returncode == 1
    row = next(ln.split() for ln in res.stdout.splitlines() if stopped in ln)
    assert row[0] == "-" and row[4] == "stopped"
    assert f"not running: {stopped} (stopped)" in res.stdout


def test_the_head_is_listed_on_demand_with_its_cost_and_a_look_alike_is_not(aws_env, tmp_path, monkeypatch):
    """The head (its own Auto Scaling group of one, infra/head.py) shows in 'fab status' as on-demand,
    and its price is in the total; an instance that only carries the head group's name as a plain tag does not."""
    from cluster import aws as discovery
    from infra.head import head_group_name
    from infra.settings import ClusterSettings

    settings = ClusterSettings(admin_cidr="203.0.113.7/32", cluster_name="bert", ssh_public_key=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp9fX1kZXZlbG9wZXIta2V5LWZvci10ZXN0cw op@laptop"), image="base")
    assert head_group_name(settings) == discovery.head_group("bert")  # the one name, on both sides
    launch("bert", "master")
    head = launch("bert", None, group=discovery.head_group("bert"))  # as the head's group tags its instance
    launch("bert", None, group=None)  # cluster-tagged, in no group: neither node nor head
    env = aws_cli_env(tmp_path, monkeypatch)
    res = fab("status", "--no-runs", env=env, timeout=120)
    rows = {ln.split()[0]: ln.split() for ln in res.stdout.splitlines() if ln.startswith(("bert-", "-"))}
    assert rows["bert-head"][1] == head and rows["bert-head"][3] == "on-demand" and float(rows["bert-head"][6]) > 0
    node, head_price = float(rows["bert-0"][6]), float(rows["bert-head"][6])
    total = float(next(ln for ln in res.stdout.splitlines() if ln.startswith("total: $")).split("$")[1].split("/")[0])
    assert total == pytest.approx(node + head_price, abs=0.011), res.stdout
    assert res.returncode == 0 and len(rows) == 2, res.stdout
