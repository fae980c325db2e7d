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


def delete_ami(client, ami_id: str) -> list[str]:
    """Deregister ``ami_id`` and delete its EBS snapshots; returns the snapshot ids deleted.
    Gone already (deleted by hand) is fine: the goal is that nothing is left billed."""
    images = client.describe_images(Filters=[{"Name": "image-id", "Values": [ami_id]}])["Images"]
    if not images:
        return []
    snapshots = [m["Ebs"]["SnapshotId"] for m in images[0].get("BlockDeviceMappings", [])
                 if m.get("Ebs", {}).get("SnapshotId")]
    client.deregister_image(ImageId=ami_id)  # a snapshot in use by a registered AMI cannot be deleted
    for snapshot in snapshots:
        client.delete_snapshot(SnapshotId=snapshot)
    return snapshots


class AmiCleanupProvider(ResourceProvider):
    def create(self, props):
        return CreateResult(id_=props["ami_id"], outs=props)

    def diff(self, _id, olds, news):
        changed = [k for k in ("ami_id", "region") if olds.get(k) != news.get(k)]
        return DiffResult(changes=bool(changed), replaces=changed, delete_before_replace=False)

    def delete(self, _id, props):
        delete_ami(_client(props["region"]), props["ami_id"])


class AmiCleanup(pulumi.dynamic.Resource):
    """Owns one baked AMI's lifetime: nothing to create, a deregistration to do when deleted."""

    def __init__(self, name: str, ami_id: pulumi.Input[str], region: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__(AmiCleanupProvider(), name, {"ami_id": ami_id, "region": region}, opts)
