"""The baked AMI's clean-up step (infra/amis.py) against a real moto EC2 server on 127.0.0.1: what
'pulumi destroy' and a superseding rebuild run when they delete the AMI's resource."""
from __future__ import annotations

import moto_fixture
import pytest

from infra.amis import AmiCleanupProvider, delete_ami

pytestmark = pytest.mark.filterwarnings("ignore:.*EncryptionControl has been deprecated:DeprecationWarning")


def baked_ami(ec2, name: str) -> tuple[str, list[str]]:
    """An AMI made as Image Builder makes one: CreateImage of a build instance (moto snapshots it)."""
    build = ec2.run_instances(ImageId="ami-0123456789abcdef0", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    ami = ec2.create_image(InstanceId=build, Name=name)["ImageId"]
    ec2.terminate_instances(InstanceIds=[build])
    mappings = ec2.describe_images(ImageIds=[ami])["Images"][0]["BlockDeviceMappings"]
    snapshots = [m["Ebs"]["SnapshotId"] for m in mappings]
    assert snapshots
    return ami, snapshots


def test_deleting_the_resource_deregisters_the_ami_and_deletes_its_snapshot(aws_env):
    ec2 = moto_fixture.client("ec2")
    ami, snapshots = baked_ami(ec2, "bert-oneccl")
    other, other_snapshots = baked_ami(ec2, "someone-else")

    AmiCleanupProvider().delete(ami, {"ami_id": ami, "region": moto_fixture.REGION})

    assert ec2.describe_images(Filters=[{"Name": "image-id", "Values": [ami]}])["Images"] == []
    left = {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    assert not set(snapshots) & left
    assert set(other_snapshots) <= left and ec2.describe_images(ImageIds=[other])["Images"]  # only its own
    assert delete_ami(ec2, ami) == []  # gone already (deleted by hand): nothing to do, no error


def test_a_new_ami_replaces_the_resource_and_an_unchanged_one_does_not():
    provider = AmiCleanupProvider()
    old = {"ami_id": "ami-0aaaaaaaaaaaaaaaa", "region": "us-east-1"}
    assert provider.diff("x", old, dict(old)).changes is False
    diff = provider.diff("x", old, {**old, "ami_id": "ami-0bbbbbbbbbbbbbbbb"})
    assert diff.replaces == ["ami_id"] and diff.delete_before_replace is False  # nodes move first, then delete


def _client_error(code: str):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}}, "DeleteSnapshot")


def test_the_snapshot_still_in_use_right_after_deregistering_is_retried_not_leaked():
    """AWS counts the snapshot in use for a moment after DeregisterImage: DeleteSnapshot then fails with
    InvalidSnapshot.InUse, which used to fail 'pulumi destroy' and leave the snapshot billed."""
    import boto3
    from botocore.stub import Stubber

    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    ami, snap = "ami-0aaaaaaaaaaaaaaaa", "snap-0aaaaaaaaaaaaaaaa"
    with Stubber(ec2) as stub:
        stub.add_response("describe_images", {"Images": [{"ImageId": ami, "BlockDeviceMappings": [
            {"DeviceName": "/dev/xvda", "Ebs": {"SnapshotId": snap}}]}]},
            {"Filters": [{"Name": "image-id", "Values": [ami]}]})
        # one call deregisters the image and its snapshots where the endpoint supports it (AWS does)
        stub.add_response("deregister_image", {"Return": True}, {"ImageId": ami, "DeleteAssociatedSnapshots": True})
        stub.add_client_error("delete_snapshot", "InvalidSnapshot.InUse", expected_params={"SnapshotId": snap})
        stub.add_response("delete_snapshot", {}, {"SnapshotId": snap})
        naps = []
        assert delete_ami(ec2, ami, sleep=naps.append) == [snap]
        stub.assert_no_pending_responses()
    assert naps == [5]


def test_a_retried_delete_finds_the_snapshots_in_the_state_after_the_ami_is_gone(aws_env):
    """A delete that failed after deregistering used to find no image on the retry, hence no snapshot ids:
    the snapshot leaked. The ids are kept in the resource's state at create and used on delete."""
    ec2 = moto_fixture.client("ec2")
    ami, snapshots = baked_ami(ec2, "bert-oneccl")
    state = AmiCleanupProvider().create({"ami_id": ami, "region": moto_fixture.REGION}).outs
    assert state["snapshot_ids"] == snapshots
    ec2.deregister_image(ImageId=ami)  # the first try got this far, then failed

    AmiCleanupProvider().delete(ami, state)

    left = {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]}
    assert not set(snapshots) & left
