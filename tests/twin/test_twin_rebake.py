"""A re-bake on the AWS twin, without root: the Pulumi program's resources on the twin's own
control plane (twin.control, which refuses an instance of an image that does not exist, as AWS does), a second
`pulumi up` that replaces the image build, the program's own clean-up (infra/amis.py) deregistering the superseded
AMI, and then the head's replacement, which must boot from what the head's launch template names."""
from __future__ import annotations

import subprocess
import sys

import pytest
from moto_fixture import _free_port, client, isolate_aws, wait_up

from core.constants import PROJECT_ROOT

pytestmark = pytest.mark.filterwarnings("ignore:.*EncryptionControl has been deprecated:DeprecationWarning")


@pytest.fixture
def twin_moto(tmp_path, monkeypatch):
    """A moto server on 127.0.0.1 that refuses what the twin's control plane (twin.control) refuses."""
    port, log = _free_port(), tmp_path / "moto.log"
    serve = ("import sys; from twin import control; control.refuse_missing_images(); "
             "control.template_versions_with_user_data(); "
             "from moto.server import main; main(['-H', '127.0.0.1', '-p', sys.argv[1]])")
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", serve, str(port)], cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL,
                                stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, "the twin's moto", lambda: log.read_text()[-2000:])
        isolate_aws(monkeypatch, tmp_path)
        for var, value in (("AWS_ACCESS_KEY_ID", "xc-twin"), ("AWS_SECRET_ACCESS_KEY", "xc-twin"),
                           ("XC_AWS_ENDPOINT_URL", url)):  # as twin.up.use points the operator's process
            monkeypatch.setenv(var, value)
        yield url
    finally:
        proc.kill()
        proc.wait()


def head_launch(group_name: str) -> tuple[list[dict], str, list[str]]:
    """The head group's instances, the image its launch template version names, and its failed launches."""
    asg, ec2 = client("autoscaling"), client("ec2")
    (group,) = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])["AutoScalingGroups"]
    spec = group["LaunchTemplate"]
    (version,) = ec2.describe_launch_template_versions(LaunchTemplateId=spec["LaunchTemplateId"],
                                                       Versions=[spec["Version"]])["LaunchTemplateVersions"]
    failed = [a["StatusMessage"] for a in asg.describe_scaling_activities(AutoScalingGroupName=group_name)["Activities"]
              if a["StatusCode"] == "Failed"]
    return group["Instances"], version["LaunchTemplateData"]["ImageId"], failed


def image_of(instance_id: str) -> str:
    return client("ec2").describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["ImageId"]


def exists(ami: str) -> bool:
    return bool(client("ec2").describe_images(Filters=[{"Name": "image-id", "Values": [ami]}])["Images"])


def test_after_a_rebake_and_its_clean_up_a_replacement_head_boots_from_an_image_its_template_names(twin_moto, tmp_path):
    from botocore.exceptions import ClientError

    from twin import program as twin_program

    key = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    config = {"adminCidr": "198.18.8.1/32", "sshPublicKey": key.with_suffix(".pub").read_text(), "nodeCount": 1,
              "vpcCidr": "198.18.8.0/21", "instanceType": "c6i.2xlarge", "sshUser": "root"}  # image=bake: the default
    twin, outputs = twin_program.apply(twin_moto, config, "twin", "us-east-1a", "root")
    group = outputs["headAutoScalingGroup"]
    (head,), first, _ = head_launch(group)
    assert image_of(head["InstanceId"]) == first == outputs["amiId"] and exists(first)  # the head boots the bake
    snapshots = [m["Ebs"]["SnapshotId"] for m in client("ec2").describe_images(ImageIds=[first])["Images"][0][
        "BlockDeviceMappings"] if "Ebs" in m]

    # the next `pulumi up`, with a new bake: the program's resources move as its ignore_changes allow, and the
    # AMI's clean-up resource, replaced, runs its delete
    twin, outputs = twin_program.apply(twin_moto, config, "twin", "us-east-1a", "root", previous=twin, rebake=True)
    second = outputs["amiId"]
    assert second != first and exists(second)
    assert "aws:imagebuilder/image:Image twin-image" in twin.stack.changed
    assert not exists(first)  # deregistered, with its snapshots, by infra/amis.py's own delete
    left = {s["SnapshotId"] for s in client("ec2").describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    assert snapshots and not set(snapshots) & left
    with pytest.raises(ClientError, match="InvalidAMIID.NotFound"):  # as AWS, the twin launches no deregistered AMI
        client("ec2").run_instances(ImageId=first, MinCount=1, MaxCount=1)

    # the head dies (a reclaim of its host, a failed health check): its group launches what its template names
    client("autoscaling").terminate_instance_in_auto_scaling_group(InstanceId=head["InstanceId"],
                                                                   ShouldDecrementDesiredCapacity=False)
    instances, named, failed = head_launch(group)
    assert not failed, f"the head's replacement failed: {failed} (its template names {named}; the bake is {second})"
    (replacement,) = instances
    assert replacement["InstanceId"] != head["InstanceId"]
    assert image_of(replacement["InstanceId"]) == named == second and exists(named)
