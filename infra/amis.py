"""Baked AMIs that leave with the stack: Image Builder's DeleteImage keeps the AMI and its EBS
snapshot (both billed), so a small dynamic resource per AMI deregisters it and deletes its
snapshots when it is deleted: at 'pulumi destroy', and when a rebuild supersedes it (a new AMI id
replaces the resource; Pulumi deletes the old one after the nodes moved to the new template).
"""
from __future__ import annotations

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, ResourceProvider


def _client(region: str):
    import os

    import boto3  # late: the provider runs in Pulumi's engine process, which imports it there

    return boto3.client("ec2", region_name=region, endpoint_url=os.environ.get("XC_AWS_ENDPOINT_URL") or None)


def snapshots_of(client, ami_id: str) -> list[str]:
    images = client.describe_images(Filters=[{"Name": "image-id", "Values": [ami_id]}])["Images"]
    if not images:
        return []
    return [m["Ebs"]["SnapshotId"] for m in images[0].get("BlockDeviceMappings", []) if m.get("Ebs", {}).get("SnapshotId")]


def delete_ami(client, ami_id: str, known_snapshots: list[str] | tuple[str, ...] = (), wait_s: float = 120.0,
               sleep=None) -> list[str]:
    """Deregister ``ami_id`` with its snapshots and make sure they are gone; returns the snapshot ids handled.
    DeregisterImage's DeleteAssociatedSnapshots does both at once; snapshots it leaves (an endpoint without it)
    are deleted here, retried while AWS still counts them in use (InvalidSnapshot.InUse right after the
    deregistration). ``known_snapshots`` come from the resource's state, so a retry after a failed delete,
    with the AMI already gone, still finds them. Gone already (deleted by hand) is fine: the goal is that
    nothing is left billed."""
    import time

    from botocore.exceptions import ClientError

    sleep = sleep or time.sleep
    present = snapshots_of(client, ami_id)
    snapshots = list(dict.fromkeys([*known_snapshots, *present]))
    if present:
        try:
            client.deregister_image(ImageId=ami_id, DeleteAssociatedSnapshots=True)
        except ClientError as exc:
            if exc.response["Error"]["Code"] not in ("InvalidAMIID.NotFound", "InvalidAMIID.Unavailable"):
                raise
    deadline = time.monotonic() + wait_s
    for snapshot in snapshots:
        while True:
            try:
                client.delete_snapshot(SnapshotId=snapshot)
                break
            except ClientError as exc:
                code = exc.response["Error"]["Code"]
                if code == "InvalidSnapshot.NotFound":  # deleted with the image, or by hand
                    break
                if code != "InvalidSnapshot.InUse" or time.monotonic() > deadline:
                    raise
                sleep(5)
    return snapshots


class AmiCleanupProvider(ResourceProvider):
    def create(self, props):
        # the snapshot ids go into the state: a delete retried after the AMI is gone still knows them
        try:
            snapshots = snapshots_of(_client(props["region"]), props["ami_id"])
        except Exception:  # noqa: BLE001 - no AWS at create (a preview, a test): the delete looks again
            snapshots = []
        return CreateResult(id_=props["ami_id"], outs={**props, "snapshot_ids": snapshots})

    def diff(self, _id, olds, news):
        changed = [k for k in ("ami_id", "region") if olds.get(k) != news.get(k)]
        return DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=False)

    def delete(self, _id, props):
        delete_ami(_client(props["region"]), props["ami_id"], props.get("snapshot_ids") or ())


class AmiCleanup(pulumi.dynamic.Resource):
    """Owns one baked AMI's lifetime: nothing to create, a deregistration to do when deleted."""

    def __init__(self, name: str, ami_id: pulumi.Input[str], region: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__(AmiCleanupProvider(), name, {"ami_id": ami_id, "region": region}, opts)
