"""The cluster's store on AWS: one S3 bucket where runs keep what must outlive a node (checkpoints, outputs,
records) under <cluster>/runs/<id>/, next to the nodes: a checkpoint never crosses the operator's link.

Private and encrypted (SSE-S3, all four public-access blocks, bucket-owner-enforced ownership, TLS-only
policy); checkpoints/ expire after checkpointRetentionDays and incomplete multipart uploads after a day.
Kept on 'pulumi destroy' (retain_on_delete, shown there as delete[retain]): trained models are never deleted
silently. 'fab sweep' lists it with its size and cost; 'fab sweep --yes' empties and deletes it.
"""
from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws

from infra.settings import ClusterSettings

CHECKPOINT_TAG_KEY = "xeon-cluster-kind"  # training/store.py CHECKPOINT_TAG tags every checkpoint object


def tls_only_policy(bucket_arn: str) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Sid": "TlsOnly", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
        "Resource": [bucket_arn, f"{bucket_arn}/*"], "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]})


def node_statements(bucket_arn: str, prefix: str) -> list[dict]:
    """The nodes' rights on the store: objects under the cluster's prefix, and listing that prefix only."""
    return [{"Sid": "StoreObjects", "Effect": "Allow",
             "Action": ["s3:GetObject", "s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject",
                        "s3:AbortMultipartUpload"],
             "Resource": [f"{bucket_arn}/{prefix}/*"]},
            {"Sid": "StoreList", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket_arn],
             "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}}]


class Store(pulumi.ComponentResource):
    def __init__(self, name: str, settings: ClusterSettings, opts: pulumi.ResourceOptions | None = None):
        super().__init__("xeon-cluster:infra:Store", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.prefix = settings.cluster_name
        self.bucket = aws.s3.Bucket(f"{name}-store", bucket_prefix=f"xc-{settings.cluster_name}-"[:37],
                                    force_destroy=False, tags=settings.tags,
                                    opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True))
        bucket = self.bucket.id
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-store-sse", bucket=bucket, rules=[{"apply_server_side_encryption_by_default": {
                "sse_algorithm": "AES256"}, "bucket_key_enabled": True}], opts=child)
        aws.s3.BucketPublicAccessBlock(f"{name}-store-private", bucket=bucket, block_public_acls=True,
                                       block_public_policy=True, ignore_public_acls=True,
                                       restrict_public_buckets=True, opts=child)
        aws.s3.BucketOwnershipControls(f"{name}-store-owner", bucket=bucket,
                                       rule={"object_ownership": "BucketOwnerEnforced"}, opts=child)
        aws.s3.BucketPolicy(f"{name}-store-tls", bucket=bucket, policy=self.bucket.arn.apply(tls_only_policy),
                            opts=child)
        aws.s3.BucketLifecycleConfiguration(f"{name}-store-life", bucket=bucket, rules=[
            {"id": "expire-checkpoints", "status": "Enabled",  # checkpoint objects carry this tag (training/store.py)
             "filter": {"and": {"prefix": f"{self.prefix}/runs/", "tags": {CHECKPOINT_TAG_KEY: "checkpoint"}}},
             "expiration": {"days": settings.checkpoint_retention_days}},
            {"id": "abort-incomplete-uploads", "status": "Enabled", "filter": {"prefix": ""},
             "abort_incomplete_multipart_upload": {"days_after_initiation": 1}}], opts=child)
        self.url = pulumi.Output.concat("s3://", bucket, "/", self.prefix)
        self.register_outputs({"bucket": bucket, "storeUrl": self.url})
