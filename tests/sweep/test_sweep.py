"""fab sweep: the real CLI against a real moto server process on 127.0.0.1, with a planted set of orphans of
cluster 'bert' and look-alikes that must survive (untagged, or tagged with another cluster). moto implements
neither Image Builder nor placement groups: those parts are tested on botocore's Stubber.
"""
from __future__ import annotations

import io
import json
import re

import moto_fixture
import pytest
from botocore.stub import Stubber
from conftest import fab

from core.constants import TAG_CLUSTER
from core.ec2 import aws_client
from core.errors import ClusterError
from sweep import delete as sweep_delete
from sweep import find as sweep_list
from sweep import run as sweep

REGION = moto_fixture.REGION
AMI = "ami-0123456789abcdef0"


def client(service: str):
    return aws_client(service, REGION)  # honours XC_AWS_ENDPOINT_URL: the moto server


def tags(cluster: str | None, name: str | None = None) -> list[dict]:
    out = [{"Key": TAG_CLUSTER, "Value": cluster}] if cluster else []
    return out + ([{"Key": "Name", "Value": name}] if name else [])


def spec(resource_type: str, cluster: str | None, name: str | None = None) -> list[dict]:
    return [{"ResourceType": resource_type, "Tags": tags(cluster, name)}]


def plant(cluster: str) -> dict[str, str]:
    """What `pulumi destroy` could leave of a cluster, every piece tagged: {what: id}."""
    ec2, ids = client("ec2"), {}
    ids["vpc"] = ec2.create_vpc(CidrBlock="10.42.0.0/16", TagSpecifications=spec("vpc", cluster, cluster))["Vpc"]["VpcId"]
    ids["subnet"] = ec2.create_subnet(VpcId=ids["vpc"], CidrBlock="10.42.0.0/24", AvailabilityZone=f"{REGION}a",
                                      TagSpecifications=spec("subnet", cluster))["Subnet"]["SubnetId"]
    ids["igw"] = ec2.create_internet_gateway(
        TagSpecifications=spec("internet-gateway", cluster))["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=ids["igw"], VpcId=ids["vpc"])
    ids["routes"] = ec2.create_route_table(VpcId=ids["vpc"], TagSpecifications=spec("route-table", cluster))[
        "RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=ids["routes"], DestinationCidrBlock="0.0.0.0/0", GatewayId=ids["igw"])
    ec2.associate_route_table(RouteTableId=ids["routes"], SubnetId=ids["subnet"])
    for sg in ("sg", "sg2"):
        ids[sg] = ec2.create_security_group(GroupName=f"{cluster}-{sg}", Description="nodes", VpcId=ids["vpc"],
                                            TagSpecifications=spec("security-group", cluster))["GroupId"]
    # each group admits the other: neither can go before those rules do
    for a, b in (("sg", "sg2"), ("sg2", "sg")):
        ec2.authorize_security_group_ingress(GroupId=ids[a], IpPermissions=[
            {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": ids[b]}]}])
    ids["key"] = ec2.create_key_pair(KeyName=f"{cluster}-key", TagSpecifications=spec("key-pair", cluster))["KeyPairId"]
    ids["template"] = ec2.create_launch_template(
        LaunchTemplateName=f"{cluster}-lt", LaunchTemplateData={"ImageId": AMI, "InstanceType": "c6i.2xlarge"},
        TagSpecifications=spec("launch-template", cluster))["LaunchTemplate"]["LaunchTemplateId"]
    ids["instance"] = ec2.run_instances(
        ImageId=AMI, MinCount=1, MaxCount=1, InstanceType="c6i.2xlarge", SubnetId=ids["subnet"],
        SecurityGroupIds=[ids["sg"]], TagSpecifications=spec("instance", cluster, f"{cluster}-node"),
    )["Instances"][0]["InstanceId"]
    ids["volume"] = ec2.create_volume(AvailabilityZone=f"{REGION}a", Size=100, VolumeType="gp3",
                                      TagSpecifications=spec("volume", cluster))["VolumeId"]
    ids["snapshot"] = ec2.create_snapshot(VolumeId=ids["volume"], TagSpecifications=spec("snapshot", cluster))[
        "SnapshotId"]
    ids["ami"] = ec2.create_image(InstanceId=ids["instance"], Name=f"{cluster}-oneccl",
                                  TagSpecifications=spec("image", cluster))["ImageId"]
    ids["eip"] = ec2.allocate_address(Domain="vpc", TagSpecifications=spec("elastic-ip", cluster))["AllocationId"]
    ids["spot"] = ec2.request_spot_instances(
        InstanceCount=1, LaunchSpecification={"ImageId": AMI, "InstanceType": "c6i.2xlarge"},
        TagSpecifications=spec("spot-instances-request", cluster))["SpotInstanceRequests"][0]["SpotInstanceRequestId"]
    ids["fleet"] = ec2.create_fleet(
        LaunchTemplateConfigs=[{"LaunchTemplateSpecification": {"LaunchTemplateId": ids["template"], "Version": "1"},
                                "Overrides": [{"InstanceType": "c6i.2xlarge"}]}],
        TargetCapacitySpecification={"TotalTargetCapacity": 1, "DefaultTargetCapacityType": "spot"},
        Type="maintain", TagSpecifications=spec("fleet", cluster))["FleetId"]
    ids["asg"] = f"{cluster}-nodes"
    client("autoscaling").create_auto_scaling_group(
        AutoScalingGroupName=ids["asg"], LaunchTemplate={"LaunchTemplateId": ids["template"], "Version": "$Latest"},
        MinSize=1, MaxSize=1, DesiredCapacity=1, VPCZoneIdentifier=ids["subnet"],
        Tags=[{"Key": TAG_CLUSTER, "Value": cluster, "PropagateAtLaunch": True}])
    iam = client("iam")
    document = json.dumps({"Version": "2012-10-17",
                           "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]})
    # the permissions boundary every role of the program carries (__main__.py), deleted once its roles are gone
    ids["boundary"] = f"xc-boundary-{cluster}-{REGION}"
    boundary = iam.create_policy(PolicyName=ids["boundary"], Path="/xeon-cluster/", PolicyDocument=document,
                                 Tags=tags(cluster))["Policy"]["Arn"]
    iam.create_policy_version(PolicyArn=boundary, PolicyDocument=document, SetAsDefault=True)  # a second version
    ids["role"] = f"{cluster}-build"
    iam.create_role(RoleName=ids["role"], AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17"}),
                    Tags=tags(cluster), Path="/xeon-cluster/", PermissionsBoundary=boundary)
    policy = iam.create_policy(PolicyName=f"{cluster}-read", PolicyDocument=document)["Policy"]["Arn"]
    iam.attach_role_policy(RoleName=ids["role"], PolicyArn=policy)  # detached first, the policy itself stays
    iam.put_role_policy(RoleName=ids["role"], PolicyName="inline", PolicyDocument=document)
    ids["profile"] = f"{cluster}-build"
    iam.create_instance_profile(InstanceProfileName=ids["profile"], Tags=tags(cluster))
    iam.add_role_to_instance_profile(InstanceProfileName=ids["profile"], RoleName=ids["role"])
    logs = client("logs")
    ids["build-log"] = f"/aws/imagebuilder/{cluster}-0123456789"  # Image Builder's own, untagged: found by name
    logs.create_log_group(logGroupName=ids["build-log"])
    ids["log"] = f"{cluster}-app"
    logs.create_log_group(logGroupName=ids["log"], tags={TAG_CLUSTER: cluster})
    ssm = client("ssm")  # what fab put outside the stack (cluster.mesh): found by its path, not a tag
    ids["mesh-key"], ids["mesh-key-pub"] = f"/xeon-cluster/{cluster}/mesh-key", f"/xeon-cluster/{cluster}/mesh-key.pub"
    ssm.put_parameter(Name=ids["mesh-key"], Value="private", Type="SecureString")
    ssm.put_parameter(Name=ids["mesh-key-pub"], Value="ssh-ed25519 AAAA", Type="String")
    ids["secret"] = f"/xeon-cluster/{cluster}/runs/20260101-000000-glue-abcd/HF_TOKEN"  # launch.staging.run_secrets
    ssm.put_parameter(Name=ids["secret"], Value="hf_x", Type="SecureString")
    kms = client("kms")  # the secrets key (infra/head.py), with its alias: pulumi destroy removes the alias first
    ids["kms-key"] = kms.create_key(Tags=[{"TagKey": TAG_CLUSTER, "TagValue": cluster}])["KeyMetadata"]["KeyId"]
    kms.create_alias(AliasName=f"alias/xeon-cluster/{cluster}", TargetKeyId=ids["kms-key"])
    ids["bucket"] = plant_bucket(f"xc-{cluster}-store", cluster, [f"{cluster}/runs/r1/checkpoints/checkpoint-4/model.pt",
                                                                  f"{cluster}/runs/r1/summary.json",
                                                                  f"{cluster}/runs/r2/output/metrics.json"])
    return ids


def plant_bucket(name: str, cluster: str | None, keys: list[str]) -> str:
    """A store bucket as infra.bucket makes it (tagged through the provider's default tags), holding ``keys``."""
    s3 = client("s3")
    s3.create_bucket(Bucket=name)
    if cluster:
        s3.put_bucket_tagging(Bucket=name, Tagging={"TagSet": tags(cluster)})
    for key in keys:
        s3.put_object(Bucket=name, Key=key, Body=b"x" * 1000)
    return name


def plant_survivors() -> dict[str, str]:
    """Look-alikes that fab sweep --cluster aws:bert must leave alone."""
    ec2, ids = client("ec2"), {}
    ids["volume"] = ec2.create_volume(AvailabilityZone=f"{REGION}a", Size=8, VolumeType="gp3",
                                      TagSpecifications=spec("volume", None, "bert-0"))["VolumeId"]  # Name alone
    ids["ernie-volume"] = ec2.create_volume(AvailabilityZone=f"{REGION}a", Size=8, VolumeType="gp3",
                                            TagSpecifications=spec("volume", "ernie"))["VolumeId"]
    ids["sg"] = ec2.create_security_group(GroupName="bert-lookalike", Description="not ours")["GroupId"]
    ids["key"] = ec2.create_key_pair(KeyName="bert-untagged")["KeyPairId"]
    ids["role"] = "bert-untagged"
    client("iam").create_role(RoleName=ids["role"], AssumeRolePolicyDocument="{}")
    for log in ("/aws/imagebuilder/bert-2-0123456789", "/aws/imagebuilder/other-0123456789", "bert-app-untagged"):
        client("logs").create_log_group(logGroupName=log)
    for name in ("/xeon-cluster/ernie/mesh-key", "/xeon-clusters/bert/mesh-key", "/team/bert/mesh-key"):
        client("ssm").put_parameter(Name=name, Value="not ours", Type="SecureString")
    ids["bucket"] = plant_bucket("xc-bert-untagged", None, ["bert/runs/r9/summary.json"])
    kms = client("kms")
    ids["ernie-key"] = kms.create_key(Tags=[{"TagKey": TAG_CLUSTER, "TagValue": "ernie"}])["KeyMetadata"]["KeyId"]
    ids["untagged-key"] = kms.create_key()["KeyMetadata"]["KeyId"]
    document = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*",
                                                                     "Resource": "*"}]})
    for name, path in (("xc-boundary-bert-eu-west-1", "/xeon-cluster/"), (f"xc-boundary-bert-{REGION}", "/team/")):
        client("iam").create_policy(PolicyName=name, Path=path, PolicyDocument=document)  # another region, path
    ids["ernie-bucket"] = plant_bucket("xc-ernie-store", "ernie", ["ernie/runs/r1/summary.json"])
    ids["other-bucket"] = plant_bucket("team-datasets", None, ["raw/part-0.parquet"])  # not a store: never asked
    return ids


def still_there(ids: dict[str, str]) -> dict[str, bool]:
    ec2 = client("ec2")
    volumes = {v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]}
    groups = {g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"]}
    keys = {k["KeyPairId"] for k in ec2.describe_key_pairs()["KeyPairs"]}
    roles = {r["RoleName"] for r in client("iam").list_roles()["Roles"]}
    logs = {g["logGroupName"] for g in client("logs").describe_log_groups()["logGroups"]}
    buckets = {b["Name"] for b in client("s3").list_buckets()["Buckets"]}
    params = {p["Name"] for p in client("ssm").describe_parameters()["Parameters"]}
    kms_keys = {k["KeyId"]: client("kms").describe_key(KeyId=k["KeyId"])["KeyMetadata"]["KeyState"]
                for k in client("kms").list_keys()["Keys"]}
    policies = {(p["Path"], p["PolicyName"]) for p in client("iam").list_policies(Scope="Local")["Policies"]}
    return {"parameters": {"/xeon-cluster/ernie/mesh-key", "/xeon-clusters/bert/mesh-key", "/team/bert/mesh-key"} <= params,
            "kms keys": kms_keys[ids["ernie-key"]] == kms_keys[ids["untagged-key"]] == "Enabled",
            "policies": {("/xeon-cluster/", "xc-boundary-bert-eu-west-1"), ("/team/", f"xc-boundary-bert-{REGION}")}
            <= policies,
            "bucket": ids["bucket"] in buckets, "ernie-bucket": ids["ernie-bucket"] in buckets,
            "other-bucket": ids["other-bucket"] in buckets, "volume": ids["volume"] in volumes, "ernie-volume": ids["ernie-volume"] in volumes,
            "sg": ids["sg"] in groups, "key": ids["key"] in keys, "role": ids["role"] in roles,
            "logs": {"/aws/imagebuilder/bert-2-0123456789", "/aws/imagebuilder/other-0123456789",
                     "bert-app-untagged"} <= logs}


def test_sweep_finds_every_orphan_deletes_them_and_spares_the_rest(aws_env):
    orphans, survivors = plant("bert"), plant_survivors()

    listed = fab("sweep", "--cluster", "aws:bert", timeout=300)
    assert listed.returncode == 1, listed.stdout + listed.stderr
    for what, rid in orphans.items():
        assert rid in listed.stdout, f"{what} {rid} not listed:\n{listed.stdout}"
    for rid in survivors.values():
        assert rid not in listed.stdout
    assert "/aws/imagebuilder/bert-2-" not in listed.stdout and "bert-app-untagged" not in listed.stdout
    assert "could not list Image Builder resources: " in listed.stderr  # moto has no Image Builder: a warning
    lines = listed.stdout.strip().splitlines()
    verdict = re.fullmatch(r"(\d+) resources of cluster bert left in us-east-1 \(~\$([\d.]+)/month\); delete them "
                           r"with 'fab sweep --cluster aws:bert --yes', which keeps the store xc-bert-store \(add "
                           r"--include-store to empty it\)", lines[-1])
    assert verdict, lines[-1]
    assert lines[0].split() == ["kind", "id", "name", "USD/month"] and len(lines) == int(verdict[1]) + 4
    assert lines[-3] == f"total: {verdict[1]} resource(s), ${verdict[2]}/month; instances at the on-demand price, " \
                        "the most a spot node costs"
    assert lines[-2] == "--yes keeps s3 bucket xc-bert-store (3 objects, 0.00 GiB; runs r1, r2): the cluster's " \
        "store, kept on purpose (its runs' models, checkpoints, records and logs, and the code its unfinished runs " \
        "resume from); delete it with 'fab sweep --cluster aws:bert --yes --include-store', or let the next 'pulumi " \
        "up' adopt it: 'pulumi config set storeBucket xc-bert-store'"

    def row(rid: str) -> str:
        return next(line for line in lines if f"  {rid}  " in line)

    assert row(orphans["volume"]).endswith(" 8.00")  # 100 GiB gp3
    assert row(orphans["snapshot"]).endswith(" 5.00")  # 100 GiB of snapshot
    assert row(orphans["eip"]).endswith(" 3.65")  # a public IPv4 address
    assert row(orphans["instance"]).endswith(" 248.20")  # c6i.2xlarge, $0.34/h x 730 h
    assert row(orphans["instance"]).startswith("instance ")
    assert re.fullmatch(rf"kms key +{orphans['kms-key']} +alias/xeon-cluster/bert +1\.00", row(orphans["kms-key"]))
    assert re.fullmatch(r"iam policy +xc-boundary-bert-us-east-1 +the roles' permissions boundary +0\.00",
                        row(orphans["boundary"]))
    assert re.fullmatch(r"s3 bucket +xc-bert-store +3 objects, 0\.00 GiB +0\.00", row(orphans["bucket"]))

    # the store goes only by name, and never while the cluster's group is there (its nodes may be writing)
    with pytest.raises(ClusterError, match=r"^--include-store would empty the store of cluster bert while its Auto "
                                           r"Scaling group bert-nodes still exists .*; nothing was deleted; run "
                                           r"'pulumi destroy'"):
        sweep.sweep("aws:bert", yes=True, include_store=True, out=io.StringIO())
    assert len(sweep.look(sweep.Clients(REGION), "bert").orphans) == int(verdict[1])

    swept = fab("sweep", "--cluster", "aws:bert", "--yes", timeout=300)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert f"terminated instance {orphans['instance']}" in swept.stdout
    assert f"deleted auto scaling group {orphans['asg']}" in swept.stdout
    assert f"deleted vpc {orphans['vpc']}" in swept.stdout
    assert f"deleted ssm parameter {orphans['mesh-key']}" in swept.stdout  # the mesh key outlives 'pulumi destroy'
    assert not {p["Name"] for p in client("ssm").describe_parameters()["Parameters"]} & {orphans["mesh-key"],
                                                                                          orphans["mesh-key-pub"]}
    assert f"deleted ssm parameter {orphans['secret']}" in swept.stdout  # a detached run's secret, too
    # the secrets key: scheduled for deletion (KMS's shortest wait), and its alias named, which goes with it
    assert f"scheduled the deletion (in 7 days, billed no more) of kms key {orphans['kms-key']}" in swept.stdout
    assert client("kms").describe_key(KeyId=orphans["kms-key"])["KeyMetadata"]["KeyState"] == "PendingDeletion"
    assert f"note: alias alias/xeon-cluster/bert goes with key {orphans['kms-key']} when KMS deletes it; a 'pulumi " \
           "up' of cluster bert before then needs it gone: 'aws kms delete-alias --alias-name " \
           "alias/xeon-cluster/bert'" in swept.stdout
    # the roles' boundary goes after the roles, its other versions first
    assert swept.stdout.index(f"deleted iam role {orphans['role']}") < swept.stdout.index(
        f"deleted iam policy {orphans['boundary']}")
    assert orphans["boundary"] not in {p["PolicyName"] for p in client("iam").list_policies(
        Scope="Local", PathPrefix="/xeon-cluster/")["Policies"]}
    assert "revoked the ingress rules of security group" in swept.stdout
    # --yes keeps the store (trained models), saying what it holds, why, and how it would go
    assert "keeping s3 bucket xc-bert-store (3 objects, 0.00 GiB; runs r1, r2): the cluster's store, kept on " \
           "purpose (its runs' models, checkpoints, records and logs, and the code its unfinished runs resume from); " \
           "delete it with 'fab sweep --cluster aws:bert --yes --include-store', or let the next 'pulumi up' adopt " \
           "it: 'pulumi config set storeBucket xc-bert-store'" in swept.stdout
    assert "emptying s3 bucket" not in swept.stdout and "deleted s3 bucket" not in swept.stdout
    assert swept.stdout.strip().splitlines()[-1].startswith("nothing left of cluster bert in us-east-1 but its store "
                                                            "xc-bert-store (kept) (not checked: ")
    assert orphans["bucket"] in {b["Name"] for b in client("s3").list_buckets()["Buckets"]}
    kept = sweep.look(sweep.Clients(REGION), "bert")
    assert [(o.kind, o.id) for o in kept.orphans] == [("s3 bucket", "xc-bert-store")]
    assert sweep.left_line(kept).endswith("; empty and delete it with 'fab sweep --cluster aws:bert --yes "
                                          "--include-store' once its models are safe elsewhere")

    # the group is gone now: --include-store empties and deletes the store, named with what it holds first
    emptied = fab("sweep", "--cluster", "aws:bert", "--yes", "--include-store", timeout=300)
    assert emptied.returncode == 0, emptied.stdout + emptied.stderr
    emptying = "emptying s3 bucket xc-bert-store (3 objects, 0.00 GiB; runs r1, r2): its checkpoints, outputs and " \
               "run records go with it"
    assert emptying in emptied.stdout
    assert emptied.stdout.index(emptying) < emptied.stdout.index("deleted s3 bucket xc-bert-store")
    assert emptied.stdout.strip().splitlines()[-1].startswith("nothing left of cluster bert in us-east-1 (not checked")
    assert sweep.look(sweep.Clients(REGION), "bert").orphans == []
    left = still_there(survivors)
    assert all(left.values()), left
    ec2 = client("ec2")
    assert ec2.describe_vpcs(Filters=[{"Name": "vpc-id", "Values": [orphans["vpc"]]}])["Vpcs"] == []
    assert client("iam").list_instance_profiles()["InstanceProfiles"] == []
    assert orphans["bucket"] not in {b["Name"] for b in client("s3").list_buckets()["Buckets"]}


def test_without_a_name_it_takes_the_only_cluster_and_refuses_several(aws_env):
    client("ec2").create_volume(AvailabilityZone=f"{REGION}a", Size=10, VolumeType="gp2",
                                TagSpecifications=spec("volume", "bert"))
    found = sweep.look(sweep.Clients(REGION), "")
    assert found.cluster == "bert" and [(o.kind, o.usd_month) for o in found.orphans] == [("volume", 1.0)]
    client("ec2").create_key_pair(KeyName="e", TagSpecifications=spec("key-pair", "ernie"))
    with pytest.raises(ClusterError, match=r"2 clusters have tagged resources in us-east-1 \(bert, ernie\); pick one "
                                           r"with --cluster aws:NAME"):
        sweep.look(sweep.Clients(REGION), "")
    res = fab("sweep", timeout=300)
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith("error: 2 clusters have tagged")


def test_sweep_is_for_aws_clusters_only():
    for spec_ in ("local", "hosts:/tmp/hosts"):
        with pytest.raises(ClusterError, match=rf"fab sweep is for AWS clusters, not '{spec_}'; pass --cluster aws"):
            sweep.target(spec_)
    assert sweep.target("aws:bert") == ("bert", None)


def test_costs_per_month():
    assert sweep_list.instance_usd_month("c6i.2xlarge", "running") == 248.2
    assert sweep_list.instance_usd_month("c6i.2xlarge", "stopped") == 0.0  # its volumes bill, on their own rows
    assert sweep_list.instance_usd_month("t3.micro", "running") is None  # not in the catalog
    assert sweep_list.volume_usd_month("gp3", 100) == 8.0 and sweep_list.volume_usd_month("io2", 100) is None
    found = sweep.Look("bert", REGION, [sweep_list.Orphan("volume", "vol-1", "", 8.0, "bert"),
                                        sweep_list.Orphan("volume", "vol-2", "", None, "bert")], [])
    table = sweep.render(found)
    assert table.splitlines()[2].endswith("  ?")
    assert table.splitlines()[-1] == "total: 2 resource(s), $8.00/month (1 without a known price)"
    assert sweep.left_line(found).startswith("2 resources of cluster bert left in us-east-1 (~$8.00/month)")


# -- on a stub: what moto does not implement --------------------------------------------------------
ARN = "arn:aws:imagebuilder:us-east-1:123456789012"
MINE, THEIRS = {TAG_CLUSTER: "bert"}, {TAG_CLUSTER: "ernie"}


def test_image_builder_resources_are_listed_and_deleted_in_order():
    """Tested on a stub (botocore Stubber): moto has no Image Builder. The replies follow botocore's model,
    which Stubber checks; the deletions must come pipeline, image, recipe, component, configurations."""
    ib = aws_client("imagebuilder", REGION)
    with Stubber(ib) as stub:
        stub.add_response("list_image_pipelines", {"imagePipelineList": [
            {"arn": f"{ARN}:image-pipeline/bert-p", "name": "bert-p", "tags": MINE},
            {"arn": f"{ARN}:image-pipeline/ernie-p", "name": "ernie-p", "tags": THEIRS}]}, {})
        stub.add_response("list_images", {"imageVersionList": [{"arn": f"{ARN}:image/bert-0123456789/1.0.0"}]},
                          {"owner": "Self"})
        stub.add_response("list_image_build_versions", {"imageSummaryList": [
            {"arn": f"{ARN}:image/bert-0123456789/1.0.0/1", "name": "bert-0123456789", "tags": MINE}]},
            {"imageVersionArn": f"{ARN}:image/bert-0123456789/1.0.0"})
        stub.add_response("list_image_recipes", {"imageRecipeSummaryList": [
            {"arn": f"{ARN}:image-recipe/bert-0123456789/1.0.0", "name": "bert-0123456789", "tags": MINE},
            {"arn": f"{ARN}:image-recipe/untagged/1.0.0", "name": "untagged"}]}, {"owner": "Self"})
        stub.add_response("list_components", {"componentVersionList": [
            {"arn": f"{ARN}:component/bert-oneccl-0123456789/1.0.0"}]}, {"owner": "Self"})
        stub.add_response("list_component_build_versions", {"componentSummaryList": [
            {"arn": f"{ARN}:component/bert-oneccl-0123456789/1.0.0/1", "name": "bert-oneccl", "tags": MINE}]},
            {"componentVersionArn": f"{ARN}:component/bert-oneccl-0123456789/1.0.0"})
        stub.add_response("list_infrastructure_configurations", {"infrastructureConfigurationSummaryList": [
            {"arn": f"{ARN}:infrastructure-configuration/bert-build", "name": "bert-build", "tags": MINE}]}, {})
        stub.add_response("list_distribution_configurations", {"distributionConfigurationSummaryList": []}, {})
        listed = sweep_list._imagebuilder(sweep.Clients(REGION, imagebuilder=ib))
        stub.assert_no_pending_responses()
    # every cluster's, never an untagged one; sweep.run.look keeps bert's
    assert [(o.id, o.cluster) for o in listed if o.cluster != "bert"] == [("image-pipeline/ernie-p", "ernie")]
    found = [o for o in listed if sweep.belongs(o, "bert")]
    assert [(o.kind, o.id) for o in found] == [
        ("imagebuilder pipeline", "image-pipeline/bert-p"), ("imagebuilder image", "image/bert-0123456789/1.0.0/1"),
        ("imagebuilder recipe", "image-recipe/bert-0123456789/1.0.0"),
        ("imagebuilder component", "component/bert-oneccl-0123456789/1.0.0/1"),
        ("imagebuilder infra config", "infrastructure-configuration/bert-build")]

    with Stubber(ib) as stub:
        for op, param, o in zip(["delete_image_pipeline", "delete_image", "delete_image_recipe", "delete_component",
                                 "delete_infrastructure_configuration"],
                                ["imagePipelineArn", "imageBuildVersionArn", "imageRecipeArn",
                                 "componentBuildVersionArn", "infrastructureConfigurationArn"], found):
            stub.add_response(op, {}, {param: o.ref["arn"]})
        out = io.StringIO()
        failures = sweep_delete.delete_all(sweep.Clients(REGION, imagebuilder=ib), list(reversed(found)), out)
        stub.assert_no_pending_responses()
    assert failures == []
    assert out.getvalue().splitlines()[0] == "deleted imagebuilder pipeline image-pipeline/bert-p (bert-p)"


def test_placement_groups_on_a_stub_and_a_failure_is_one_line_and_the_sweep_goes_on():
    """Tested on a stub (botocore Stubber): moto does not implement placement groups."""
    ec2 = aws_client("ec2", REGION)
    with Stubber(ec2) as stub:
        stub.add_response("describe_placement_groups", {"PlacementGroups": [
            {"GroupName": "bert-pg", "Strategy": "cluster", "Tags": [{"Key": TAG_CLUSTER, "Value": "bert"}]},
            {"GroupName": "other-pg", "Strategy": "cluster"}]},  # the filter is checked again: untagged stays
            {"Filters": [sweep_list.tagged(TAG_CLUSTER)]})
        found = sweep_list._placement_groups(sweep.Clients(REGION, ec2=ec2))
        assert [(o.kind, o.id, o.cluster) for o in found] == [("placement group", "bert-pg", "bert")]
        stub.add_response("delete_key_pair", {}, {"KeyName": "bert-key"})  # ORDER: key pairs first
        stub.add_client_error("delete_placement_group", "InvalidPlacementGroup.InUse", "in use by i-1",
                              expected_params={"GroupName": "bert-pg"})
        out = io.StringIO()
        failures = sweep_delete.delete_all(sweep.Clients(REGION, ec2=ec2),
                                           [*found, sweep_list.Orphan("key pair", "key-1", "bert-key")], out)
        stub.assert_no_pending_responses()
    assert failures == ["could not delete placement group bert-pg: InvalidPlacementGroup.InUse: in use by i-1"]
    assert out.getvalue().splitlines() == ["deleted key pair key-1 (bert-key)", failures[0]]


def test_a_running_head_is_priced_from_the_heads_table():
    """The head's type (t3.medium) is no node type: its month comes from the head's prices, not a '?'."""
    from core import catalog
    from sweep import find as sweep_list

    assert sweep_list.instance_usd_month("t3.medium", "running") == round(
        catalog.HEAD_USD_H["t3.medium"] * catalog.HOURS_PER_MONTH, 2) > 0
    assert sweep_list.instance_usd_month("t9.unknown", "running") is None
