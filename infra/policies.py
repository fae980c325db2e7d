"""Every IAM policy document the Pulumi program writes, in one place: the nodes' and the head's roles, the
store's bucket policy, the EC2 trust policy. Plain functions of plain values (an AwsContext, names, ARNs), so
tests render and lint each one (tests/test_iam_lint.py runs parliament on all of them).

ARNs are built for the stack's partition (aws, aws-cn, aws-us-gov) and account; none is hard-coded to 'aws'.
"""
from __future__ import annotations

import json

from core.constants import TAG_CLUSTER, TAG_HOST_KEY, TAG_ROLE
from infra.checks import AwsContext

# Every role and instance profile the program creates lives under this IAM path: the deployer's iam: rights
# (docs/iam-policy-pulumi.json), its iam:PassRole and fab sweep's IAM deletes (docs/iam-policy.json) reach only it.
ROLE_PATH = "/xeon-cluster/"
# What user code on a node may write in the store, relative to the cluster's prefix: checkpoints and outputs
# (training/runtime/store.py publish_checkpoint, publish_output) and the store probe's object. Records, logs and heartbeats
# are the head's and the operator's: a node cannot rewrite a run's summary or another run's outputs' record.
NODE_WRITABLE = ("runs/*/checkpoints/*", "runs/*/output/*", ".xc-probe/*")
# What it may delete: old checkpoints (training/runtime/store.py keeps the newest KEEP_CHECKPOINTS) and the probe's object.
# No node may delete an object version (the bucket is versioned: an overwrite from a node leaves the previous
# version for the noncurrent-version rules).
NODE_DELETABLE = ("runs/*/checkpoints/*", ".xc-probe/*")
STORE_WRITE = ["s3:PutObject", "s3:PutObjectTagging", "s3:AbortMultipartUpload"]
SECRETS_ROOT = "/xeon-cluster"  # SSM Parameter Store: a detached run's secrets under <root>/<cluster>/


def secrets_path(cluster: str) -> str:
    return f"{SECRETS_ROOT}/{cluster}"


def mesh_key_parameter(cluster: str) -> str:
    """The mesh key, a SecureString only the head reads (cluster.mesh); beside it its public half, which nodes read."""
    return f"{secrets_path(cluster)}/mesh-key"


def mesh_key_public_parameter(cluster: str) -> str:
    return mesh_key_parameter(cluster) + ".pub"


def document(statements: list[dict]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def ec2_trust_policy(principal: str = "ec2.amazonaws.com") -> str:
    """Who may assume an instance role: EC2 (its service principal in the stack's partition)."""
    return document([{"Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {"Service": principal}}])


def tls_only_policy(bucket_arn: str) -> str:
    return document([{"Sid": "TlsOnly", "Effect": "Deny", "Principal": "*", "Action": "s3:*",
                      "Resource": [bucket_arn, f"{bucket_arn}/*"],
                      "Condition": {"Bool": {"aws:SecureTransport": "false"}}}])


def store_statements(bucket_arn: str, prefix: str, writable: tuple[str, ...] | None = NODE_WRITABLE,
                     deletable: tuple[str, ...] | None = NODE_DELETABLE, sid: str = "Store") -> list[dict]:
    """Read and list the cluster's prefix of its store; write only under ``writable`` and delete only under
    ``deletable`` (relative to the prefix; None: anywhere under it). Never s3:DeleteObjectVersion: versions are the
    operator's to remove."""
    objects = f"{bucket_arn}/{prefix}"

    def under(keys):
        return [f"{objects}/*"] if keys is None else [f"{objects}/{k}" for k in keys]

    return [{"Sid": f"{sid}Read", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"{objects}/*"]},
            {"Sid": f"{sid}Write", "Effect": "Allow", "Action": list(STORE_WRITE), "Resource": under(writable)},
            {"Sid": f"{sid}Delete", "Effect": "Allow", "Action": ["s3:DeleteObject"], "Resource": under(deletable)},
            {"Sid": f"{sid}List", "Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [bucket_arn],
             "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}}]


def host_key_statement(ctx: AwsContext, cluster: str) -> dict:
    """Tag the calling instance itself (ec2:SourceInstanceARN = the tagged one), one of the cluster's, with host-key
    tags only: node_setup/publish_host_keys.py at first boot."""
    instances = f"arn:{ctx.partition}:ec2:{ctx.region}:{ctx.account}:instance"
    return {"Sid": "PublishOwnHostKeys", "Effect": "Allow", "Action": ["ec2:CreateTags"],
            "Resource": [f"{instances}/*"],
            "Condition": {"ArnEquals": {"ec2:SourceInstanceARN": f"{instances}/${{ec2:InstanceID}}"},
                          "StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": cluster},
                          "ForAllValues:StringLike": {"aws:TagKeys": [f"{TAG_HOST_KEY}*"]}}}


def lifecycle_statement(ctx: AwsContext, group: str) -> dict:
    """Complete a leaving node's lifecycle action, or extend it with heartbeats while its checkpoint uploads
    (training/runtime/spot.py). On the cluster's own group only; AWS has no condition key for the instance a call names,
    so a node can act on any instance of its group, not only itself (docs/ops.md, 'What each role can do')."""
    return {"Sid": "CompleteClusterGroupsLifecycleAction", "Effect": "Allow",
            "Action": ["autoscaling:CompleteLifecycleAction", "autoscaling:RecordLifecycleActionHeartbeat"],
            "Resource": [ctx.group_arn(group)]}


def node_policy(ctx: AwsContext, cluster: str, group: str, bucket_arn: str | None = None,
                prefix: str | None = None) -> str:
    """What a node (and any user code on it) may do with the cluster's AWS identity: complete the termination
    lifecycle action of its own group, tag itself with its host keys, read the cluster's prefix of its store and
    write there only checkpoints, outputs and its probe (deleting only checkpoints and the probe). No wildcard
    action, no '*' resource."""
    store = store_statements(bucket_arn, prefix or cluster) if bucket_arn else []
    mesh = {"Sid": "ReadMeshPublicKey", "Effect": "Allow", "Action": ["ssm:GetParameter"],
            "Resource": [ctx.ssm_path_arns(mesh_key_public_parameter(cluster))[0]]}
    return document([lifecycle_statement(ctx, group), host_key_statement(ctx, cluster), mesh, *store])


def head_policy(ctx: AwsContext, cluster: str, group: str, bucket_arn: str, prefix: str | None = None) -> str:
    """The head (it runs the supervisors of detached runs, no user code): see the cluster's instances and group,
    read their console output for host keys, complete the nodes' lifecycle action, read and write the store's
    prefix (records, logs, heartbeats), read the run secrets and the mesh key under the cluster's SSM path and
    delete the secrets of the chains it ended, move
    the master role tag among the cluster's instances, tag itself with its own host keys. Nothing else."""
    instances = f"arn:{ctx.partition}:ec2:{ctx.region}:{ctx.account}:instance/*"
    return document([
        # Describe* calls take no resource-level permission: '*' is the only resource AWS accepts for them
        {"Sid": "DescribeCluster", "Effect": "Allow", "Resource": "*",
         "Action": ["ec2:DescribeInstances", "autoscaling:DescribeAutoScalingGroups"]},
        {"Sid": "ReadClusterHostKeys", "Effect": "Allow", "Action": ["ec2:GetConsoleOutput"], "Resource": [instances],
         "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": cluster}}},
        lifecycle_statement(ctx, group),
        *store_statements(bucket_arn, prefix or cluster, writable=None, deletable=None, sid="HeadStore"),
        {"Sid": "ReadRunSecrets", "Effect": "Allow", "Resource": ctx.ssm_path_arns(secrets_path(cluster)),
         "Action": ["ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath"]},
        # a chain's secrets (launch.ship.run_secrets) leave SSM when its supervisor ends it; never the mesh key
        {"Sid": "DeleteEndedRunSecrets", "Effect": "Allow", "Action": ["ssm:DeleteParameters"],
         "Resource": [ctx.ssm_path_arns(f"{secrets_path(cluster)}/runs")[1]]},
        # node order (cluster.aws.order_nodes): the master role tag moves to a survivor when node 0 is gone
        {"Sid": "MoveMasterTag", "Effect": "Allow", "Action": ["ec2:CreateTags"], "Resource": [instances],
         "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": cluster},
                       "ForAllValues:StringEquals": {"aws:TagKeys": [TAG_ROLE]}}},
        host_key_statement(ctx, cluster)])
