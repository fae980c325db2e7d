"""The AWS twin's parts that need no root: its IMDS's answers over real HTTP, the refusal for a non-root user, and
the Pulumi program's resources made on a moto server (test_twin.py runs the whole twin, as root)."""
from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
from moto_fixture import client

from cluster import imds as twin_imds
from core.errors import ClusterError
from twin import up as twin


def test_imds_answers_as_ec2_does_and_reads_notices_as_they_come(tmp_path):
    doc = tmp_path / "imds.json"
    doc.write_text(json.dumps({"instance_id": "i-0abc", "region": "us-east-1", "role": "twin-node"}))
    server = twin_imds.serve(doc, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(path, token):
        req = urllib.request.Request(base + path, headers={"X-aws-ec2-metadata-token": token})
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read().decode()

    try:
        with pytest.raises(urllib.error.HTTPError) as no_ttl:  # IMDSv2: the TTL header is required
            urllib.request.urlopen(urllib.request.Request(base + "/latest/api/token", method="PUT"), timeout=5)
        assert no_ttl.value.code == 400
        token = urllib.request.urlopen(urllib.request.Request(
            base + "/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}),
            timeout=5).read().decode()
        with pytest.raises(urllib.error.HTTPError) as bad:
            get("/latest/meta-data/instance-id", "not-the-token")
        assert bad.value.code == 401
        assert get("/latest/meta-data/instance-id", token) == "i-0abc"
        assert get("/latest/meta-data/autoscaling/target-lifecycle-state", token) == "InService"
        assert json.loads(get("/latest/meta-data/iam/security-credentials/twin-node", token))["Code"] == "Success"
        with pytest.raises(urllib.error.HTTPError) as quiet:
            get("/latest/meta-data/spot/instance-action", token)
        assert quiet.value.code == 404
        doc.write_text(json.dumps({**json.loads(doc.read_text()), "notice": {"action": "terminate", "time": "T"},
                                   "lifecycle_state": "Terminated"}))
        assert json.loads(get("/latest/meta-data/spot/instance-action", token))["action"] == "terminate"
        assert get("/latest/meta-data/autoscaling/target-lifecycle-state", token) == "Terminated"
    finally:
        server.shutdown()


def test_aws_twin_needs_root_and_starts_nothing_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(twin.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(twin.netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError) as exc:
        twin.up(2, state=tmp_path / "twin")
    assert "--aws needs root" in str(exc.value) and "sudo fab local-up --aws" in exc.value.fix
    assert not (tmp_path / "twin").exists()


def test_the_pulumi_program_lands_on_moto_with_its_own_names(aws_env, tmp_path):
    from twin import program as twin_program

    key = tmp_path / "k"
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    config = {"adminCidr": "198.18.8.1/32", "sshPublicKey": key.with_suffix(".pub").read_text(), "nodeCount": 2,
              "vpcCidr": "198.18.8.0/21", "instanceType": "c6i.2xlarge", "sshUser": "root"}
    made, outputs = twin_program.apply(aws_env, config, "twin", "us-east-1a", "root")
    asg = client("autoscaling").describe_auto_scaling_groups()["AutoScalingGroups"]
    groups = {g["AutoScalingGroupName"]: g for g in asg}
    assert set(groups) == {outputs["autoScalingGroup"], outputs["headAutoScalingGroup"]} == {"twin-nodes", "twin-head"}
    assert groups["twin-nodes"]["DesiredCapacity"] == 2 and len(groups["twin-nodes"]["Instances"]) == 2
    subnet = client("ec2").describe_subnets(SubnetIds=[groups["twin-nodes"]["VPCZoneIdentifier"]])["Subnets"][0]
    assert subnet["CidrBlock"] == "198.18.8.0/24"  # infra.network's zone-a slice of the VPC
    nodes = client("ec2").describe_instances(Filters=[{"Name": "tag:aws:autoscaling:groupName", "Values": ["twin-nodes"]}])
    tags = {t["Key"]: t["Value"] for t in nodes["Reservations"][0]["Instances"][0]["Tags"]}  # not the image's build
    assert tags["xeon-cluster:ssh-user"] == "root" and tags["xeon-cluster:cluster"] == "twin"
    assert outputs["storeUrl"].startswith("s3://xc-twin-")
    assert any("imagebuilder" in k for k in made.left_out)  # named, with why, not silently dropped


def test_the_twins_image_is_the_profiles_package_list_not_this_venv():
    """The twin's nodes and head run the venv a baked image would hold: the profile's pins, built (once per profile
    hash) apart from this machine's venv, so a package the image lacks fails on the twin as it would on AWS."""
    from node_setup import profiles
    from twin import image as twin_image

    profile = profiles.load_profile("upstream")
    assert twin_image.requirements("upstream") == [p.requirement for p in profile.packages]  # what the bake installs
    with pytest.raises(ClusterError, match="built from source on the node"):
        twin_image.requirements("upstream-ccl")
    built = twin_image.venv("upstream", say=lambda line: None)
    assert built.name.startswith("upstream-") and (built / twin_image.MARKER).is_file()
    probe = ("import importlib.util as u; "
             "print(' '.join(m for m in ('fabric', 'jinja2', 'boto3', 'pip', 'moto', 'pytest') if u.find_spec(m)))")
    found = subprocess.run([str(built / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True)
    # the supervisor's packages, and pip as python3 -m venv leaves it (a run's requirements install with it); none of
    # the dev extras
    assert found.stdout.split() == ["fabric", "jinja2", "boto3", "pip"]
    assert twin_image.venv("upstream", say=pytest.fail) == built  # cached: built once per profile hash
