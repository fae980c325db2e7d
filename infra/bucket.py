"""The cluster's store on AWS: one S3 bucket where runs keep what must outlive a node (checkpoints, outputs,
records) under <cluster>/runs/<id>/, next to the nodes: a checkpoint never crosses the operator's link.

Private and encrypted (SSE-S3, all four public-access blocks, bucket-owner-enforced ownership, TLS-only
policy), versioned: an object a node overwrites keeps its previous version, and nodes may not delete versions
(infra/policies.py). Lifecycle: checkpoints expire after checkpointRetentionDays and their noncurrent versions
after a day, as do noncurrent versions of logs and heartbeats; other noncurrent versions after NONCURRENT_DAYS;
incomplete multipart uploads after a day.

Kept on 'pulumi destroy' (retain_on_delete, shown there as delete[retain]), and so is every protection of it
(encryption, versioning, public-access block, ownership, TLS-only policy, lifecycle rules): a kept bucket of
trained models stays private and keeps expiring its checkpoints. 'fab sweep' lists it with its size and cost.
A later 'pulumi up' of the same cluster adopts it with storeBucket=<its name> (a Pulumi import) instead of
making a second bucket beside it; its protections are written again as they were.
"""
from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.policies import tls_only_policy
from infra.settings import ClusterSettings

CHECKPOINT_TAG_KEY = "xeon-cluster-kind"  # training/runtime/paths.py tag_of: checkpoint objects, logs and heartbeats
NONCURRENT_CHECKPOINT_DAYS = 1  # a replaced or deleted checkpoint (GBs) is billed one more day at most
NONCURRENT_DAYS = 30  # an overwritten or deleted record or output can be restored for a month
NONCURRENT_LOG_DAYS = 1  # logs and heartbeats (training/runtime/paths.py LOG_TAG) change often: their old versions, a day


def lifecycle_rules(prefix: str, retention_days: int) -> list[dict]:
    runs = f"{prefix}/runs/"
    return [
        {"id": "expire-checkpoints", "status": "Enabled",  # checkpoint objects carry this tag (training/runtime/store.py)
         "filter": {"and": {"prefix": runs, "tags": {CHECKPOINT_TAG_KEY: "checkpoint"}}},
         "expiration": {"days": retention_days},
         "noncurrent_version_expiration": {"noncurrent_days": NONCURRENT_CHECKPOINT_DAYS}},
        {"id": "expire-noncurrent-logs", "status": "Enabled",  # the head's heartbeats, runs' logs and log parts
         "filter": {"and": {"prefix": runs, "tags": {CHECKPOINT_TAG_KEY: "log"}}},
         "noncurrent_version_expiration": {"noncurrent_days": NONCURRENT_LOG_DAYS}},
        {"id": "expire-noncurrent-versions", "status": "Enabled", "filter": {"prefix": f"{prefix}/"},
         "noncurrent_version_expiration": {"noncurrent_days": NONCURRENT_DAYS}},
        # a delete marker whose versions all expired is removed (S3 refuses this with a tag filter: own rule)
        {"id": "remove-expired-delete-markers", "status": "Enabled", "filter": {"prefix": f"{prefix}/"},
         "expiration": {"expired_object_delete_marker": True}},
        {"id": "abort-incomplete-uploads", "status": "Enabled", "filter": {"prefix": ""},
         "abort_incomplete_multipart_upload": {"days_after_initiation": 1}}]


class Store(pulumi.ComponentResource):
    def __init__(self, name: str, settings: ClusterSettings, opts: pulumi.ResourceOptions | None = None):
        super().__init__("xeon-cluster:infra:Store", name, None, opts)
        # the bucket and all that protects it stay on 'pulumi destroy'
        kept = pulumi.ResourceOptions(parent=self, retain_on_delete=True)
        self.prefix = settings.cluster_name
        if settings.store_bucket:  # the bucket a destroyed stack kept: adopted as it is, never a second one
            self.bucket = aws.s3.Bucket(f"{name}-store", bucket=settings.store_bucket, force_destroy=False,
                                        tags=settings.tags, opts=pulumi.ResourceOptions.merge(
                                            kept, pulumi.ResourceOptions(import_=settings.store_bucket)))
        else:
            self.bucket = aws.s3.Bucket(f"{name}-store", bucket_prefix=f"xc-{settings.cluster_name}-"[:37],
                                        force_destroy=False, tags=settings.tags, opts=kept)
        bucket = self.bucket.id
        aws.s3.BucketServerSideEncryptionConfiguration(
            f"{name}-store-sse", bucket=bucket, rules=[{"apply_server_side_encryption_by_default": {
                "sse_algorithm": "AES256"}, "bucket_key_enabled": True}], opts=kept)
        versioning = aws.s3.BucketVersioning(f"{name}-store-versions", bucket=bucket,
                                             versioning_configuration={"status": "Enabled"}, opts=kept)
        aws.s3.BucketPublicAccessBlock(f"{name}-store-private", bucket=bucket, block_public_acls=True,
                                       block_public_policy=True, ignore_public_acls=True,
                                       restrict_public_buckets=True, opts=kept)
        aws.s3.BucketOwnershipControls(f"{name}-store-owner", bucket=bucket,
                                       rule={"object_ownership": "BucketOwnerEnforced"}, opts=kept)
        aws.s3.BucketPolicy(f"{name}-store-tls", bucket=bucket, policy=self.bucket.arn.apply(tls_only_policy),
                            opts=kept)
        # S3 applies noncurrent-version rules only once versioning is on: the rules follow it
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-store-life", bucket=bucket, rules=lifecycle_rules(self.prefix, settings.checkpoint_retention_days),
            opts=pulumi.ResourceOptions.merge(kept, pulumi.ResourceOptions(depends_on=[versioning])))
        self.url = pulumi.Output.concat("s3://", bucket, "/", self.prefix)
        self.register_outputs({"bucket": bucket, "storeUrl": self.url})
