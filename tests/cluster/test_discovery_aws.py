"""The AWS side of the inventory and the cost estimate, against a real moto EC2 server process on
127.0.0.1 (boto3 over HTTP, no in-process patching); the 'pulumi' source against a fake CLI.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import moto_fixture
import pytest

from cluster import aws as discovery
from cluster.inventory import load_nodes, select
from core import catalog
from core.constants import REMOTE_PYTHON, TAG_CLUSTER, TAG_ROLE, TAG_SSH_USER
from core.ec2 import ec2_client
from core.errors import ClusterError
from infra import cost

AMI = "ami-0123456789abcdef0"
REGION = moto_fixture.REGION
isolate_aws = moto_fixture.isolate_aws


def ec2():
    return ec2_client(REGION)  # honours XC_AWS_ENDPOINT_URL: the moto server


def launch(cluster: str, role: str | None = "worker", *, user: str | None = None, group: str | None = "") -> str:
    """An instance of the cluster's group, launched one at a time so that launch order is known: moto lets us
    set the aws:autoscaling:groupName tag that AWS reserves to EC2 Auto Scaling (group=None: launched by hand)."""
    tags = {"Name": f"{cluster}-node", TAG_CLUSTER: cluster}
    if group is not None:
        tags[discovery.GROUP_TAG] = group or discovery.node_group(cluster)
    if role is not None:
        tags[TAG_ROLE] = role
    if user:
        tags[TAG_SSH_USER] = user
    reply = ec2().run_instances(ImageId=AMI, MinCount=1, MaxCount=1, InstanceType="c6i.16xlarge",
                                TagSpecifications=[{"ResourceType": "instance",
                                                    "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
    time.sleep(1.1)  # EC2 reports launch times in whole seconds: one second apart, their order is known
    return reply["Instances"][0]["InstanceId"]


def role_tags(ids) -> dict[str, str]:
    described = ec2().describe_instances(InstanceIds=list(ids))["Reservations"]
    return {i["InstanceId"]: {t["Key"]: t["Value"] for t in i["Tags"]}.get(TAG_ROLE)
            for r in described for i in r["Instances"]}


def test_aws_source_lists_the_master_first_then_the_others_oldest_first(aws_env):
    first = launch("bert", user="ubuntu")
    master = launch("bert", "master", user="ubuntu")  # not the oldest: the tag decides
    second, stopped = launch("bert", user="ubuntu"), launch("bert")
    launch("other", "master")
    launch("bert", None)  # the cluster's tag but no role (the image build instance): not a node
    ec2().stop_instances(InstanceIds=[stopped])

    nodes = load_nodes("aws:bert")  # through cluster.inventory, as 'fab --cluster aws:bert' does

    assert [n.labels["instance_id"] for n in nodes] == [master, first, second]
    assert [n.name for n in nodes] == ["bert-0", "bert-1", "bert-2"]
    assert [n.index for n in nodes] == [0, 1, 2]
    assert [n.labels["role"] for n in nodes] == ["master", "worker", "worker"]
    described = {i["InstanceId"]: i for r in ec2().describe_instances(InstanceIds=[master, first, second])[
        "Reservations"] for i in r["Instances"]}
    for node in nodes:
        inst = described[node.labels["instance_id"]]
        assert node.host == inst["PublicIpAddress"] and node.private_host == inst["PrivateIpAddress"]
        assert (node.user, node.port, node.python) == ("ubuntu", 22, REMOTE_PYTHON)
    with pytest.raises(ClusterError, match=r"--nodes 4 but the cluster 'aws:bert' has 3 nodes; run 'pulumi up'"):
        select(nodes, 4, "aws:bert")


def test_a_head_inside_the_vpc_dials_the_nodes_private_addresses(aws_env, monkeypatch):
    """The nodes' SSH rule admits the head's security group, which matches private addresses only: the head's
    supervisor (which sets XC_AWS_ADDRESS=private) must dial those; the operator outside dials the public ones."""
    from cluster.aws import ADDRESS_ENV

    launch("bert", "master", user="ubuntu")
    launch("bert", user="ubuntu")
    outside = load_nodes("aws:bert")
    assert all(n.host != n.private_host and n.private_host for n in outside)  # moto gives both, distinct
    monkeypatch.setenv(ADDRESS_ENV, "private")
    inside = load_nodes("aws:bert")
    assert [n.host for n in inside] == [n.private_host for n in outside]


def test_a_lost_master_hands_its_tag_to_the_oldest_survivor(aws_env, caplog):
    master, older, newer = launch("bert", "master"), launch("bert"), launch("bert")
    ec2().terminate_instances(InstanceIds=[master])  # node 0 reclaimed
    with caplog.at_level("WARNING"):
        nodes = load_nodes("aws:bert")
    assert [n.labels["instance_id"] for n in nodes] == [older, newer]
    assert role_tags([older, newer]) == {older: "master", newer: "worker"}  # the tag moved in EC2
    assert f"{older} (the oldest) is node 0 now" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = load_nodes("aws:bert")
    assert [n.labels["instance_id"] for n in again] == [older, newer] and "node 0 now" not in caplog.text


def test_two_masters_leave_the_role_with_the_older_one(aws_env):
    older, newer = launch("bert", "master"), launch("bert", "master")  # two operators promoted at once
    nodes = load_nodes("aws:bert")
    assert [n.labels["instance_id"] for n in nodes] == [older, newer]
    assert role_tags([older, newer]) == {older: "master", newer: "worker"}


def test_an_auto_scaling_group_node_lost_is_replaced_and_the_order_holds(aws_env):
    """The group as infra/nodes.py declares it (launch template, propagated tags), run by moto."""
    from infra.nodes import node_tags
    from infra.settings import ClusterSettings

    settings = ClusterSettings(admin_cidr="203.0.113.7/32", cluster_name="bert", ssh_public_key=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp9fX1kZXZlbG9wZXIta2V5LWZvci10ZXN0cw op@laptop"), image="base")
    template = ec2().create_launch_template(LaunchTemplateName="bert-lt", LaunchTemplateData={
        "ImageId": AMI, "InstanceType": "c6i.16xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    subnet = ec2().describe_subnets()["Subnets"][0]["SubnetId"]
    scaling = moto_fixture.client("autoscaling")
    scaling.create_auto_scaling_group(
        AutoScalingGroupName="bert-nodes", MinSize=3, MaxSize=3, DesiredCapacity=3, VPCZoneIdentifier=subnet,
        LaunchTemplate={"LaunchTemplateId": template, "Version": "$Latest"},
        Tags=[{"Key": k, "Value": v, "PropagateAtLaunch": True} for k, v in node_tags(settings).items()])
    first = load_nodes("aws:bert")
    assert len(first) == 3 and first[0].labels["role"] == "master"
    assert role_tags([n.labels["instance_id"] for n in first])[first[0].labels["instance_id"]] == "master"
    time.sleep(1.1)
    lost = first[0].labels["instance_id"]
    scaling.terminate_instance_in_auto_scaling_group(InstanceId=lost, ShouldDecrementDesiredCapacity=False)
    after = load_nodes("aws:bert")
    ids = [n.labels["instance_id"] for n in after]
    assert len(ids) == 3 and lost not in ids  # the group replaced the node by itself
    assert ids[:2] == [first[1].labels["instance_id"], first[2].labels["instance_id"]]  # survivors keep order
    assert ids[2] not in {n.labels["instance_id"] for n in first}  # the replacement comes last
    assert role_tags(ids)[ids[0]] == "master"


def test_an_instance_with_the_cluster_tags_outside_its_group_is_not_a_node(aws_env, caplog):
    """An instance launched by hand with xeon-cluster:cluster=barh and role=master, next to the cluster's
    Auto Scaling group, became barh-0 (the node that gets every run's secrets). The group below is the one
    infra/nodes.py declares, run by moto, which tags its instances with aws:autoscaling:groupName as AWS does."""
    from infra.nodes import group_name, node_tags
    from infra.settings import ClusterSettings

    settings = ClusterSettings(admin_cidr="203.0.113.7/32", cluster_name="barh", ssh_public_key=(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp9fX1kZXZlbG9wZXIta2V5LWZvci10ZXN0cw op@laptop"), image="base")
    assert group_name(settings) == discovery.node_group("barh")  # the one name, on both sides
    template = ec2().create_launch_template(LaunchTemplateName="barh-lt", LaunchTemplateData={
        "ImageId": AMI, "InstanceType": "c6i.16xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    moto_fixture.client("autoscaling").create_auto_scaling_group(
        AutoScalingGroupName=group_name(settings), MinSize=2, MaxSize=2, DesiredCapacity=2,
        VPCZoneIdentifier=ec2().describe_subnets()["Subnets"][0]["SubnetId"],
        LaunchTemplate={"LaunchTemplateId": template, "Version": "$Latest"},
        Tags=[{"Key": k, "Value": v, "PropagateAtLaunch": True} for k, v in node_tags(settings).items()])
    time.sleep(1.1)
    forged = launch("barh", "master", group=None)  # our tags, set by anyone allowed ec2:CreateTags
    elsewhere = launch("barh", "master", group="someone-elses-group")
    with caplog.at_level("WARNING", logger="cluster.aws"):
        nodes = load_nodes("aws:barh")
    ids = [n.labels["instance_id"] for n in nodes]
    assert len(ids) == 2 and forged not in ids and elsewhere not in ids
    group_ids = {i["InstanceId"] for g in moto_fixture.client("autoscaling").describe_auto_scaling_groups()[
        "AutoScalingGroups"] for i in g["Instances"]}
    assert set(ids) == group_ids and nodes[0].name == "barh-0"
    assert role_tags(ids)[ids[0]] == "master" and role_tags([forged])[forged] == "master"
    assert (f"instance {forged} carries the tags of cluster barh but is in no Auto Scaling group, not barh-nodes: "
            "not a node of the cluster") in caplog.text
    assert f"instance {elsewhere} carries the tags of cluster barh but is in Auto Scaling group someone-elses-group" \
        in caplog.text
    assert [i["InstanceId"] for i in discovery.starting_nodes("barh")] == []  # fab status: not among its nodes
    ec2().stop_instances(InstanceIds=[forged])
    assert [i["InstanceId"] for i in discovery.starting_nodes("barh")] == []
    # a forged instance alone is no cluster at all
    launch("ernie", "master", group=None)
    assert [n.name for n in load_nodes("aws:barh")] == ["barh-0", "barh-1"]
    with pytest.raises(ClusterError, match=r"no running instances of cluster 'ernie' \(Auto Scaling group "
                                           r"ernie-nodes\) in us-east-1; run 'pulumi up'"):
        load_nodes("aws:ernie")
    assert [n.name for n in load_nodes("aws")] == ["barh-0", "barh-1"]  # the only cluster: ernie's is no cluster


def test_cluster_name_comes_from_env_or_from_the_only_running_cluster(aws_env, monkeypatch):
    launch("solo", "master", user="ec2-user")
    assert [n.user for n in load_nodes("aws")] == ["ec2-user"]  # the only cluster; user from its tag
    launch("bert", "master")
    with pytest.raises(ClusterError, match=r"2 clusters are running \(bert, solo\); pick one with --cluster aws:NAME"):
        load_nodes("aws")
    monkeypatch.setenv("XC_AWS_CLUSTER", "bert")
    (node,) = load_nodes("aws")
    assert node.name == "bert-0" and node.user == "ubuntu"  # no ssh-user tag: Ubuntu's default


def test_no_running_nodes_is_a_clear_error(aws_env):
    with pytest.raises(ClusterError, match=r"no running instances of cluster 'bert' \(Auto Scaling group bert-nodes\) "
                                           r"in us-east-1; run 'pulumi up'"):
        load_nodes("aws:bert")
    with pytest.raises(ClusterError, match=r"no running xeon-cluster instances in us-east-1"):
        load_nodes("aws")


def test_missing_credentials_is_a_clear_error(moto_server, monkeypatch, tmp_path):
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("XC_AWS_ENDPOINT_URL", moto_server)  # even if signing passed, nothing leaves 127.0.0.1
    with pytest.raises(ClusterError, match=r"no AWS credentials for --cluster aws; run 'aws configure'"):
        load_nodes("aws:bert")


def test_importing_discovery_needs_neither_boto3_nor_pulumi():
    code = textwrap.dedent("""
        import sys
        sys.modules["boto3"] = sys.modules["botocore"] = sys.modules["pulumi"] = None  # import would fail
        import cluster.aws, core.catalog, infra.cost
        print(cluster.aws.aws_nodes.__name__, cluster.aws.pulumi_nodes.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.split() == ["aws_nodes", "pulumi_nodes"]


# -- cost -------------------------------------------------------------------------------------
def test_cost_uses_the_live_spot_price(aws_env):
    price = cost.spot_price("r7iz.16xlarge", "us-east-1a")
    assert price is not None and 0 < price < catalog.lookup("r7iz.16xlarge").on_demand_usd_h
    est = cost.estimate("r7iz.16xlarge", 4, availability_zone="us-east-1a", root_volume_gib=100)
    assert est.node_usd_h == price and est.source == "spot price in us-east-1a"
    assert est.total_usd_h == pytest.approx(4 * (price + 100 * 0.08 / 730 + 0.005), abs=1e-4)


def test_cost_falls_back_to_the_catalog_where_aws_lists_no_spot_price(aws_env):
    # moto's offerings mirror AWS: us-east-1e has no r7iz
    assert cost.spot_price("r7iz.16xlarge", "us-east-1e") is None
    est = cost.estimate("r7iz.16xlarge", 2, availability_zone="us-east-1e", root_volume_gib=50)
    assert est.node_usd_h == catalog.lookup("r7iz.16xlarge").on_demand_usd_h
    assert "spot price unavailable" in est.source


def test_cost_caps_at_max_price_and_on_demand_ignores_spot(aws_env):
    capped = cost.estimate("r7iz.16xlarge", 1, availability_zone="us-east-1e", max_spot_price=2.0)
    assert (capped.node_usd_h, capped.source) == (2.0, "maxSpotPrice cap")
    on_demand = cost.estimate("c6i.32xlarge", 3, availability_zone="us-east-1a", spot=False, root_volume_gib=100)
    assert on_demand.market == "on-demand" and on_demand.node_usd_h == 5.44
    assert "3 x c6i.32xlarge on-demand at $5.4400/h" in on_demand.summary()


def test_cost_without_credentials_still_estimates(moto_server, monkeypatch, tmp_path):
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("XC_AWS_ENDPOINT_URL", moto_server)
    est = cost.estimate("c6i.16xlarge", 2, availability_zone="us-east-1a")
    assert est.node_usd_h == 2.72 and "spot price unavailable" in est.source


def test_catalog_matches_the_instance_specs_aws_publishes(aws_env):
    # moto serves AWS's recorded DescribeInstanceTypes data: vCPUs, cores, memory, network, EFA
    types = ec2().describe_instance_types(InstanceTypes=list(catalog.CATALOG))["InstanceTypes"]
    assert len(types) == len(catalog.CATALOG)
    for t in types:
        entry = catalog.lookup(t["InstanceType"])
        assert t["VCpuInfo"]["DefaultVCpus"] == entry.vcpus, entry.name
        assert t["VCpuInfo"]["DefaultCores"] == entry.cores, entry.name
        assert t["MemoryInfo"]["SizeInMiB"] == entry.memory_gib * 1024, entry.name
        assert t["NetworkInfo"]["NetworkPerformance"].startswith(
            ("Up to " if entry.burst_network else "") + f"{entry.network_gbit:g} Gigabit"), entry.name
        assert t["NetworkInfo"]["EfaSupported"] == entry.efa, entry.name
        assert t["BareMetal"] == entry.metal, entry.name


# -- pulumi (fake CLI) ------------------------------------------------------------------------
STACK_OUTPUT = {"clusterName": "bert", "sshUser": "ubuntu", "nodeCount": 2, "autoScalingGroup": "bert-nodes"}


def fake_pulumi(tmp_path, monkeypatch, script: str):
    """A `pulumi` executable on PATH that records its argv and answers like the real CLI would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "pulumi"
    exe.write_text(f"#!{sys.executable}\nimport json, sys\n"
                   f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "argv.json"


def test_pulumi_source_reads_the_stack_outputs_with_a_fake_cli(aws_env, tmp_path, monkeypatch):
    ids = {0: launch("bert", "master", user="ubuntu"), 1: launch("bert", user="ubuntu")}
    argv = fake_pulumi(tmp_path, monkeypatch, f"print(json.dumps({dict(STACK_OUTPUT, region=REGION)!r}))\n")
    nodes = load_nodes("pulumi:prod")
    assert json.loads(argv.read_text()) == ["stack", "output", "--json", "--cwd", str(discovery.PROJECT_DIR),
                                            "--stack", "prod"]
    # the stack names the cluster; the nodes are its running instances, as --cluster aws:bert sees them
    assert [(n.name, n.index, n.user) for n in nodes] == [("bert-0", 0, "ubuntu"), ("bert-1", 1, "ubuntu")]
    assert [n.labels["instance_id"] for n in nodes] == [ids[0], ids[1]]
    assert {n.labels["instance_type"] for n in nodes} == {"c6i.16xlarge"}
    assert [n.to_dict() for n in nodes] == [n.to_dict() for n in load_nodes("aws:bert")]


def test_one_cluster_has_one_state_folder_and_key_whichever_way_it_is_named(aws_env, tmp_path, monkeypatch):
    from cluster.resolve import open_cluster

    launch("bert", "master")
    launch("bert")
    fake_pulumi(tmp_path, monkeypatch, f"print(json.dumps({dict(STACK_OUTPUT, region=REGION)!r}))\n")
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path / "state"))
    folders = {spec: open_cluster(spec).state for spec in ("aws", "aws:bert", "pulumi", "pulumi:prod")}
    assert set(folders.values()) == {tmp_path / "state" / "aws-bert"}, folders


def test_a_stack_without_its_cluster_name_says_run_pulumi_up(tmp_path, monkeypatch):
    fake_pulumi(tmp_path, monkeypatch, f"print(json.dumps({dict(STACK_OUTPUT, clusterName='')!r}))\n")
    with pytest.raises(ClusterError, match=r"stack 'prod' has no 'clusterName' output .*run 'pulumi up'"):
        load_nodes("pulumi:prod")


def test_pulumi_source_errors_name_the_stack_and_the_fix(tmp_path, monkeypatch):
    fake_pulumi(tmp_path, monkeypatch, "sys.stderr.write(\"error: no stack named 'prod' found\\n\"); sys.exit(255)\n")
    with pytest.raises(ClusterError, match=r"Pulumi stack prod not found .*pulumi stack ls"):
        load_nodes("pulumi:prod")


def test_pulumi_source_without_outputs_says_run_pulumi_up(tmp_path, monkeypatch):
    fake_pulumi(tmp_path, monkeypatch, "print('{}')\n")
    with pytest.raises(ClusterError, match=r"stack 'dev' has no outputs; run 'pulumi up' first"):
        load_nodes("pulumi:dev")


def test_pulumi_source_without_the_cli_points_to_aws(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no pulumi here
    with pytest.raises(ClusterError, match=r"needs the Pulumi CLI.*--cluster aws:NAME"):
        load_nodes("pulumi")
