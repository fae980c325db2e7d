"""fab sweep and the cluster's store, against the real moto server process on 127.0.0.1:
under the documented policy (docs/iam-policy.json's S3 statements, enforced by moto's IAM emulation), the store is
found beside buckets the policy does not let fab read; --include-store is refused while the cluster's group exists;
a bare 'fab sweep' looks in the selected stack's region.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import urllib.request
from pathlib import Path

import moto_fixture
import pytest
from test_discovery_aws import fake_pulumi
from test_sweep import client, plant_bucket, spec

from core.errors import ClusterError
from sweep import run as sweep

REGION = moto_fixture.REGION
ROOT = Path(__file__).resolve().parents[2]


def buckets() -> set[str]:
    return {b["Name"] for b in client("s3").list_buckets()["Buckets"]}


@contextlib.contextmanager
def documented_policy(url: str, monkeypatch):
    """fab's credentials become an IAM user's with docs/iam-policy.json's S3 statements (everything but S3 allowed),
    and the moto server checks every request against them until the block ends."""
    document = json.loads((ROOT / "docs" / "iam-policy.json").read_text())
    s3_only = [st for st in document["Statement"]
               if all(a.startswith("s3:") for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"]))]
    assert {st["Sid"] for st in s3_only} >= {"FabStoreBuckets", "FabFindStoreBuckets"}
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "NotAction": "s3:*", "Resource": "*"}, *s3_only,
        # one store bucket whose tags even fab may not read: one warning, not the end of the S3 listing
        {"Effect": "Deny", "Action": "s3:GetBucketTagging", "Resource": "arn:aws:s3:::xc-locked-*"}]}
    iam = client("iam")
    iam.create_user(UserName="operator")
    iam.put_user_policy(UserName="operator", PolicyName="fab", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="operator")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])

    def auth(count: str) -> None:
        request = urllib.request.Request(f"{url}/moto-api/reset-auth", data=count.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})  # not a form: moto reads the body
        urllib.request.urlopen(request, timeout=10).close()

    auth("0")  # from now on moto authenticates and authorizes every request
    try:
        yield
    finally:
        auth("inf")  # the server is shared with the other tests of this worker


def test_the_store_is_found_beside_buckets_the_documented_policy_hides(aws_env, monkeypatch, caplog):
    store = plant_bucket("xc-bert-store", "bert", ["bert/runs/r1/summary.json"])
    plant_bucket("team-datasets", None, ["raw/part-0.parquet"])  # not a store: fab may not read its tags
    plant_bucket("xc-locked-data", "bert", [])
    client("ec2").create_volume(AvailabilityZone=f"{REGION}a", Size=10, VolumeType="gp2",
                                TagSpecifications=spec("volume", "bert"))
    with documented_policy(aws_env, monkeypatch):
        from botocore.exceptions import ClientError

        with pytest.raises(ClientError, match="AccessDenied"):  # moto enforces the policy: asking every bucket fails
            client("s3").get_bucket_tagging(Bucket="team-datasets")
        with caplog.at_level(logging.WARNING):
            found = sweep.look(sweep.Clients(REGION), "bert")
    assert [(o.kind, o.id) for o in found.orphans if o.kind == "s3 bucket"] == [("s3 bucket", store)]
    assert "volume" in {o.kind for o in found.orphans}
    assert "S3 buckets" not in found.unchecked and "s3 bucket xc-locked-data" in found.unchecked
    assert "could not read s3 bucket xc-locked-data (AccessDenied" in caplog.text
    assert "team-datasets" not in caplog.text
    assert sweep.nothing_left(found).endswith("(not checked: placement groups, Image Builder resources, s3 bucket "
                                              "xc-locked-data)")


def test_include_store_is_refused_while_the_group_exists_even_untagged(aws_env):
    ec2 = client("ec2")
    template = ec2.create_launch_template(LaunchTemplateName="ernie-lt", LaunchTemplateData={
        "ImageId": "ami-0123456789abcdef0", "InstanceType": "c6i.2xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    scaling = client("autoscaling")
    scaling.create_auto_scaling_group(  # named as infra.nodes names it, without the cluster's tag
        AutoScalingGroupName="ernie-nodes", MinSize=0, MaxSize=0, DesiredCapacity=0,
        VPCZoneIdentifier=ec2.describe_subnets()["Subnets"][0]["SubnetId"],
        LaunchTemplate={"LaunchTemplateId": template, "Version": "$Latest"})
    store = plant_bucket("xc-ernie-store", "ernie", ["ernie/runs/r1/output/model.safetensors"])
    with pytest.raises(ClusterError, match=r"--include-store would empty the store of cluster ernie while its Auto "
                                           r"Scaling group ernie-nodes still exists"):
        sweep.sweep("aws:ernie", yes=True, include_store=True, out=io.StringIO())
    assert store in buckets()
    out = io.StringIO()
    assert sweep.sweep("aws:ernie", yes=True, out=out) == 0  # --yes alone keeps it, group or not
    assert store in buckets() and "keeping s3 bucket xc-ernie-store (1 objects" in out.getvalue()
    scaling.delete_auto_scaling_group(AutoScalingGroupName="ernie-nodes", ForceDelete=True)
    out = io.StringIO()
    assert sweep.sweep("aws:ernie", yes=True, include_store=True, out=out) == 0
    assert store not in buckets() and "deleted s3 bucket xc-ernie-store" in out.getvalue()


def test_include_store_while_the_cluster_lives_removes_only_old_buckets_no_live_group_writes(aws_env):
    """'pulumi up' after 'pulumi destroy' made a second bucket beside the kept one; the live groups
    name their store (TAG_STORE), so --include-store may remove the old bucket and leaves the live cluster alone."""
    from core.constants import TAG_CLUSTER, TAG_STORE

    ec2 = client("ec2")
    template = ec2.create_launch_template(LaunchTemplateName="otto-lt", LaunchTemplateData={
        "ImageId": "ami-0123456789abcdef0", "InstanceType": "c6i.2xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
    group = ec2.create_security_group(GroupName="otto-sg", Description="live", TagSpecifications=[
        {"ResourceType": "security-group", "Tags": [{"Key": TAG_CLUSTER, "Value": "otto"}]}])["GroupId"]
    scaling = client("autoscaling")
    for name in ("otto-nodes", "otto-head"):
        scaling.create_auto_scaling_group(
            AutoScalingGroupName=name, MinSize=0, MaxSize=0, DesiredCapacity=0, VPCZoneIdentifier=subnet,
            LaunchTemplate={"LaunchTemplateId": template, "Version": "$Latest"},
            Tags=[{"Key": TAG_CLUSTER, "Value": "otto", "PropagateAtLaunch": True},
                  {"Key": TAG_STORE, "Value": "xc-otto-new", "PropagateAtLaunch": False}])
    new = plant_bucket("xc-otto-new", "otto", ["otto/runs/r2/summary.json"])
    old = plant_bucket("xc-otto-old", "otto", ["otto/runs/r1/output/model.safetensors"])
    out = io.StringIO()
    assert sweep.sweep("aws:otto", yes=True, include_store=True, out=out) == 0
    assert old not in buckets() and new in buckets(), out.getvalue()
    said = out.getvalue()
    assert "deleted s3 bucket xc-otto-old" in said and "keeping s3 bucket xc-otto-new: the store of the live Auto " \
        "Scaling group otto-" in said
    live = {g["AutoScalingGroupName"] for g in scaling.describe_auto_scaling_groups()["AutoScalingGroups"]}
    assert {"otto-nodes", "otto-head"} <= live  # the live cluster stays, all of it
    assert ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"]
    # a live group that does not say which store it writes (a stack from before the tag): refused, nothing deleted
    scaling.delete_tags(Tags=[{"ResourceId": "otto-head", "ResourceType": "auto-scaling-group", "Key": TAG_STORE}])
    with pytest.raises(ClusterError, match="while its Auto Scaling group otto-head still exists"):
        sweep.sweep("aws:otto", yes=True, include_store=True, out=io.StringIO())
    assert new in buckets()


def test_a_bare_sweep_looks_in_the_selected_stacks_region(aws_env, tmp_path, monkeypatch):
    """After 'pulumi destroy' the stack has no outputs but keeps its config: its region (eu-west-1) beats
    AWS_REGION (us-east-1) when no --cluster is given."""
    fake_pulumi(tmp_path, monkeypatch, (
        "args = sys.argv[1:]\n"
        "if args[:2] == ['stack', 'output']: print('{}')\n"
        "elif args[:1] == ['config']: print(json.dumps({'xeon-cluster:region': {'value': 'eu-west-1', 'secret': False},"
        " 'xeon-cluster:clusterName': {'value': 'bert', 'secret': False}}))\n"
        "else: sys.exit(2)\n"))
    import boto3

    far = boto3.client("ec2", region_name="eu-west-1", endpoint_url=aws_env)
    volume = far.create_volume(AvailabilityZone="eu-west-1a", Size=10, VolumeType="gp2",
                               TagSpecifications=spec("volume", "bert"))["VolumeId"]
    client("ec2").create_volume(AvailabilityZone=f"{REGION}a", Size=10, VolumeType="gp2",
                                TagSpecifications=spec("volume", "ernie"))
    assert sweep.target(None) == ("bert", "eu-west-1")
    out = io.StringIO()
    assert sweep.sweep(None, out=out) == 1
    assert volume in out.getvalue() and "ernie" not in out.getvalue()
    assert "of cluster bert left in eu-west-1" in out.getvalue().strip().splitlines()[-1]
    monkeypatch.setenv("XC_AWS_CLUSTER", "ernie")  # named by the environment: AWS_REGION, as before
    assert sweep.target(None) == ("ernie", None)
    assert sweep.target("pulumi") == ("bert", "eu-west-1")  # the stack named: its config, once destroyed


def test_after_a_clean_destroy_the_kept_store_alone_exits_0(aws_env):
    """pulumi destroy keeps the store on purpose: a sweep that finds only it says so and how it goes, and exits 0
    (it exited 1, so a teardown script failed after a clean destroy); anything else left, or --include-store
    asked, is still exit 1."""
    store = plant_bucket("xc-oscar-store", "oscar", ["oscar/runs/r1/summary.json"])
    out = io.StringIO()
    assert sweep.sweep("aws:oscar", out=out) == 0
    assert out.getvalue().strip().splitlines()[-1].startswith("1 resource of cluster oscar left in ")
    assert "empty and delete it with 'fab sweep --cluster aws:oscar --yes --include-store'" in out.getvalue()
    assert sweep.sweep("aws:oscar", include_store=True, out=io.StringIO()) == 1
    client("ec2").create_volume(AvailabilityZone=f"{REGION}a", Size=10, VolumeType="gp2",
                                TagSpecifications=spec("volume", "oscar"))
    assert sweep.sweep("aws:oscar", out=io.StringIO()) == 1
    assert store in buckets()


def test_yes_removes_what_no_run_needs_from_the_kept_store_and_keeps_the_runs(aws_env, monkeypatch):
    """After 'pulumi destroy', the kept store still holds what no run needs: the head's code tarballs (every version
    of them), the probe's object, the snapshot and wheels of a finished run, and log parts. 'fab sweep' lists them
    on rows of their own, beside the store it keeps (and why), under the documented policy; --yes removes every
    version of them, writes a run's log.txt from its parts where that was missing, and keeps the runs, and the
    snapshot and wheels of the run that may be resumed. Never while the cluster's group exists."""
    s3 = client("s3")
    store = plant_bucket("xc-bert-store", "bert", [])
    s3.put_bucket_versioning(Bucket=store, VersioningConfiguration={"Status": "Enabled"})

    def put(key: str, body: bytes = b"x") -> None:
        s3.put_object(Bucket=store, Key=f"bert/{key}", Body=body)

    for run, status, code in (("r1", "ok", "s1"), ("r2", "failed", "s2")):
        spec = {"what": {"snapshot": code, "pylayer": f"w{code[1]}"}}  # RunSpec.to_json's sections
        put(f"runs/{run}/summary.json", json.dumps({"status": status, "spec": spec}).encode())
        put(f"snapshots/{code}.tar.gz"), put(f"snapshots/{code}.json"), put(f"wheels/w{code[1]}/a-1-py3-none-any.whl")
    put("code/0123456789abcdef.tar.gz"), put("code/0123456789abcdef.tar.gz", b"again")  # two versions
    put(".xc-probe/probe-1")
    put("runs/r1/log.txt", b"a\nb\n"), put("runs/r1/log.parts/000000000000", b"a\n")
    put("runs/r1/log.parts/000000000002", b"b\n")  # log.txt covers them: deleted
    put("runs/r2/log.parts/000000000000", b"x\n"), put("runs/r2/log.parts/000000000002", b"y\n")  # no log.txt yet
    put("runs/r2/output/model.safetensors")
    ec2 = client("ec2")
    template = ec2.create_launch_template(LaunchTemplateName="bert-lt", LaunchTemplateData={
        "ImageId": "ami-0123456789abcdef0", "InstanceType": "c6i.2xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    scaling = client("autoscaling")  # the head's group, untagged: only its name says whose it is
    scaling.create_auto_scaling_group(AutoScalingGroupName="bert-head", MinSize=0, MaxSize=0, DesiredCapacity=0,
                                      VPCZoneIdentifier=ec2.describe_subnets()["Subnets"][0]["SubnetId"],
                                      LaunchTemplate={"LaunchTemplateId": template, "Version": "$Latest"})

    out = io.StringIO()
    with documented_policy(aws_env, monkeypatch):  # finding them (the runs' records read too) needs no new right
        assert sweep.sweep("aws:bert", out=out) == 1  # leftovers cost: a dry run says there is something to sweep
    lines = out.getvalue().splitlines()
    rows = {line.split()[2]: line for line in lines if line.startswith("store objects ")}
    assert sorted(rows) == [f"{store}/bert/{w}/" for w in (".xc-probe", "code", "runs/*/log.parts", "snapshots",
                                                           "wheels")]
    assert "  2 version(s), 0.00 GiB: the head's code tarballs (fab puts them again)" in rows[f"{store}/bert/code/"]
    assert "2 version(s), 0.00 GiB: code snapshots no resumable run names" in rows[f"{store}/bert/snapshots/"]
    assert "4 version(s), 0.00 GiB: log parts (compacted" in rows[f"{store}/bert/runs/*/log.parts/"]
    kept = next(line for line in lines if line.startswith("--yes keeps s3 bucket "))
    assert kept.startswith(f"--yes keeps s3 bucket {store} (7 objects, 0.00 GiB; runs r1, r2): the cluster's store, "
                           "kept on purpose (its runs' models, checkpoints, records and logs, and the code its "
                           "unfinished runs resume from)")

    out = io.StringIO()  # the head's group is there: its boot reads the code tarballs, so nothing of them goes
    assert sweep.sweep("aws:bert", yes=True, out=out) == 1
    assert "could not delete store objects xc-bert-store/bert/code/: the Auto Scaling group bert-head still " \
           "exists, and its head and nodes may need them; run 'pulumi destroy' first" in out.getvalue()
    scaling.delete_auto_scaling_group(AutoScalingGroupName="bert-head", ForceDelete=True)

    out = io.StringIO()  # (moto checks a multi-object delete against the bucket's ARN, not each object's: as fab)
    assert sweep.sweep("aws:bert", yes=True, out=out) == 0, out.getvalue()
    said = out.getvalue()
    assert f"deleted store objects {store}/bert/code/ (2 version(s)" in said
    assert said.strip().splitlines()[-1].startswith(f"nothing left of cluster bert in {REGION} but its store "
                                                    f"{store} (kept)")
    left = {v["Key"].removeprefix("bert/") for v in s3.list_object_versions(Bucket=store).get("Versions", [])}
    assert left == {"runs/r1/summary.json", "runs/r2/summary.json", "runs/r1/log.txt", "runs/r2/log.txt",
                    "runs/r2/output/model.safetensors", "snapshots/s2.tar.gz", "snapshots/s2.json",
                    "wheels/w2/a-1-py3-none-any.whl"}
    assert not s3.list_object_versions(Bucket=store).get("DeleteMarkers")  # versions gone, not hidden behind markers
    assert s3.get_object(Bucket=store, Key="bert/runs/r2/log.txt")["Body"].read() == b"x\ny\n"
    assert s3.get_object(Bucket=store, Key="bert/runs/r1/log.txt")["Body"].read() == b"a\nb\n"
    assert s3.get_object_tagging(Bucket=store, Key="bert/runs/r2/log.txt")["TagSet"] == [
        {"Key": "xeon-cluster-kind", "Value": "log"}]  # the log's lifecycle rule finds it


def test_the_sweeps_names_are_the_programs():
    """What fab sweep finds by name or waits on is what the program makes (infra/ and launch/ are above cluster/)."""
    from infra import head, policies
    from launch.supervision import adopt
    from sweep import delete as sweep_delete
    from sweep import find as sweep_list

    assert (sweep_list.ROLE_PATH, sweep_list.BOUNDARY_PREFIX) == (policies.ROLE_PATH, policies.BOUNDARY_PREFIX)
    assert policies.boundary_name("bert", REGION) == f"{sweep_list.BOUNDARY_PREFIX}bert-{REGION}"
    assert sweep_delete.KEY_WAIT_DAYS == head.KEY_DELETION_DAYS
    assert adopt.CODE in sweep_list.LEFTOVERS
