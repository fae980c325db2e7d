"""Every IAM policy document the Pulumi program writes, in one place: the nodes' and the head's roles, the
permissions boundary every role of the program carries, the secrets key's key policy, the store's bucket policy,
the EC2 trust policy. Plain functions of plain values (an AwsContext, names, ARNs), so tests render and lint each
one (tests/infra/test_iam_lint.py runs parliament on all of them).

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
# What it may delete: old checkpoints (training/runtime/store.py keeps the newest Checkpoints.KEEP) and the probe's object.
# No node may delete an object version (the bucket is versioned: an overwrite from a node leaves the previous
# version for the noncurrent-version rules).
NODE_DELETABLE = ("runs/*/checkpoints/*", ".xc-probe/*")
STORE_WRITE = ["s3:PutObject", "s3:PutObjectTagging", "s3:AbortMultipartUpload"]
SECRETS_ROOT = "/xeon-cluster"  # SSM Parameter Store: a detached run's secrets under <root>/<cluster>/
# The customer-managed KMS key the SecureString parameters under <root>/<cluster>/ are encrypted with (infra/head.py):
# only the head's role may decrypt with it. fab finds it by this alias (cluster.mesh.secrets_key), with no Pulumi CLI.
KEY_ALIAS_ROOT = "alias/xeon-cluster"
# The permissions boundary on every role the program makes (nodes, head, image build): a managed policy under
# ROLE_PATH whose name starts so; the deployer may write roles only with it (docs/iam-policy-pulumi.json).
BOUNDARY_PREFIX = "xc-boundary-"
# What the build instance's two AWS managed policies (infra/image.py BUILD_POLICIES) grant, as the boundary admits it:
# SSM's agent (how Image Builder drives the instance) and Image Builder's components, logs and buckets. Its
# ssm:GetParameter(s) on '*' are capped to AWS's public parameters: no parameter of the account.
SSM_AGENT = ["ssm:DescribeAssociation", "ssm:DescribeDocument", "ssm:GetDeployablePatchSnapshotForInstance",
             "ssm:GetDocument", "ssm:GetManifest", "ssm:ListAssociations", "ssm:ListInstanceAssociations",
             "ssm:PutComplianceItems", "ssm:PutConfigurePackageResult", "ssm:PutInventory",
             "ssm:UpdateAssociationStatus", "ssm:UpdateInstanceAssociationStatus", "ssm:UpdateInstanceInformation",
             "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel", "ssmmessages:OpenControlChannel",
             "ssmmessages:OpenDataChannel", "ec2messages:AcknowledgeMessage", "ec2messages:DeleteMessage",
             "ec2messages:FailMessage", "ec2messages:GetEndpoint", "ec2messages:GetMessages", "ec2messages:SendReply"]


def secrets_path(cluster: str) -> str:
    return f"{SECRETS_ROOT}/{cluster}"


def mesh_key_parameter(cluster: str) -> str:
    """The mesh key, a SecureString only the head reads (cluster.mesh); beside it its public half, which nodes read."""
    return f"{secrets_path(cluster)}/mesh-key"


def mesh_key_public_parameter(cluster: str) -> str:
    return mesh_key_parameter(cluster) + ".pub"


def key_alias(cluster: str) -> str:
    """The alias of the cluster's secrets key (cluster.mesh.key_alias is the same: tests/cluster/test_mesh.py)."""
    return f"{KEY_ALIAS_ROOT}/{cluster}"


def boundary_name(cluster: str, region: str) -> str:
    """The boundary's IAM name (IAM is global: the region keeps two stacks of one cluster name apart)."""
    return f"{BOUNDARY_PREFIX}{cluster}-{region}"


def key_arn(ctx: AwsContext, key_id: str) -> str:
    return f"arn:{ctx.partition}:kms:{ctx.region}:{ctx.account}:key/{key_id}"


def ssm_service(ctx: AwsContext) -> str:
    """SSM's endpoint in the stack's region: kms:ViaService when SSM encrypts or decrypts a SecureString."""
    return f"ssm.{ctx.region}.{ctx.dns_suffix}"


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
    return document(node_statements(ctx, cluster, group, bucket_arn, prefix))


def node_statements(ctx: AwsContext, cluster: str, group: str, bucket_arn: str | None = None,
                    prefix: str | None = None) -> list[dict]:
    store = store_statements(bucket_arn, prefix or cluster) if bucket_arn else []
    mesh = {"Sid": "ReadMeshPublicKey", "Effect": "Allow", "Action": ["ssm:GetParameter"],
            "Resource": [ctx.ssm_path_arns(mesh_key_public_parameter(cluster))[0]]}
    return [lifecycle_statement(ctx, group), host_key_statement(ctx, cluster), mesh, *store]


def build_statements(ctx: AwsContext) -> list[dict]:
    """What the image build's role gets from its two AWS managed policies, as the boundary lets it through."""
    p = ctx.partition
    return [
        {"Sid": "BuildSsmAgent", "Effect": "Allow", "Action": list(SSM_AGENT), "Resource": "*"},
        {"Sid": "BuildReadPublicParameters", "Effect": "Allow", "Action": ["ssm:GetParameter", "ssm:GetParameters"],
         "Resource": [f"arn:{p}:ssm:*:*:parameter/aws/service/*"]},
        {"Sid": "BuildReadComponents", "Effect": "Allow", "Action": ["imagebuilder:GetComponent"], "Resource": "*"},
        {"Sid": "BuildDecryptComponents", "Effect": "Allow", "Action": ["kms:Decrypt"], "Resource": "*",
         "Condition": {"ForAnyValue:StringEquals": {"kms:EncryptionContextKeys": "aws:imagebuilder:arn",
                                                    "aws:CalledVia": ["imagebuilder.amazonaws.com"]}}},
        {"Sid": "BuildReadImageBuilderBuckets", "Effect": "Allow", "Action": ["s3:GetObject"],
         "Resource": [f"arn:{p}:s3:::ec2imagebuilder*"]},
        {"Sid": "BuildLogs", "Effect": "Allow", "Action": ["logs:CreateLogGroup", "logs:CreateLogStream",
                                                            "logs:PutLogEvents"],
         "Resource": [f"arn:{p}:logs:*:*:log-group:/aws/imagebuilder/*"]}]


def boundary_policy(ctx: AwsContext, cluster: str, group: str, bucket_arn: str, prefix: str | None = None) -> str:
    """The permissions boundary of every role the program makes: the union of what the nodes', the head's and the
    image build's roles are given, and no more. A role under /xeon-cluster/ that someone writes a wider policy into
    still cannot do more than this. A statement of one role that another role's statement already covers is left
    out (a node's store rights are within the head's); the key is named by its alias (it is made after the roles)."""
    statements: list[dict] = []
    for statement in [*head_statements(ctx, cluster, group, bucket_arn, prefix),
                      *node_statements(ctx, cluster, group, bucket_arn, prefix), *build_statements(ctx)]:
        if not any(_covers(kept, statement) for kept in statements):
            statements.append(statement)
    return json.dumps({"Version": "2012-10-17", "Statement": statements}, separators=(",", ":"))


def _covers(wide: dict, narrow: dict) -> bool:
    """Whether ``wide`` allows all that ``narrow`` does, judged simply: the same condition, every action of
    ``narrow`` in ``wide`` and every resource of ``narrow`` under one of ``wide``'s (a trailing '*' only)."""
    def listed(value) -> list[str]:
        return [value] if isinstance(value, str) else list(value)

    if wide.get("Condition") != narrow.get("Condition") or not set(listed(narrow["Action"])) <= set(listed(
            wide["Action"])):
        return False
    return all(any(r == w or (w.endswith("*") and r.startswith(w[:-1])) for w in listed(wide["Resource"]))
               for r in listed(narrow["Resource"]))


def key_policy(ctx: AwsContext, cluster: str, head_role_arn: str) -> str:
    """The secrets key's policy: the account administers the key (through IAM policies, as AWS's default key policy
    lets it) but may not use it; principals of the account whose IAM policy allows kms:Encrypt (fab's, in
    docs/iam-policy.json) encrypt the cluster's SecureStrings with it through SSM; only the head's role decrypts
    them, through SSM, and only those under the cluster's path. No grant-making: a grant could hand Decrypt on."""
    root = f"arn:{ctx.partition}:iam::{ctx.account}:root"
    parameters = f"arn:{ctx.partition}:ssm:{ctx.region}:{ctx.account}:parameter{secrets_path(cluster)}/*"
    via_ssm = {"kms:ViaService": ssm_service(ctx)}
    return document([
        {"Sid": "AccountAdministersTheKey", "Effect": "Allow", "Principal": {"AWS": root}, "Resource": "*",
         "Action": ["kms:CancelKeyDeletion", "kms:CreateAlias", "kms:DeleteAlias", "kms:DescribeKey",
                    "kms:DisableKey", "kms:DisableKeyRotation", "kms:EnableKey", "kms:EnableKeyRotation",
                    "kms:GetKeyPolicy", "kms:GetKeyRotationStatus", "kms:ListGrants",
                    "kms:ListKeyPolicies", "kms:ListKeyRotations", "kms:ListResourceTags", "kms:PutKeyPolicy",
                    "kms:RevokeGrant", "kms:RotateKeyOnDemand", "kms:ScheduleKeyDeletion", "kms:TagResource",
                    "kms:UntagResource", "kms:UpdateAlias", "kms:UpdateKeyDescription"]},
        {"Sid": "AccountEncryptsTheClustersSecretsThroughSsm", "Effect": "Allow", "Principal": {"AWS": root},
         "Action": ["kms:Encrypt"], "Resource": "*",
         "Condition": {"StringEquals": via_ssm, "StringLike": {"kms:EncryptionContext:PARAMETER_ARN": parameters}}},
        {"Sid": "OnlyTheHeadDecrypts", "Effect": "Allow", "Principal": {"AWS": head_role_arn},
         "Action": ["kms:Decrypt"], "Resource": "*",
         "Condition": {"StringEquals": via_ssm, "StringLike": {"kms:EncryptionContext:PARAMETER_ARN": parameters}}}])


def decrypt_statement(ctx: AwsContext, cluster: str, key: str | None = None) -> dict:
    """Decrypt the SecureStrings under the cluster's SSM path with its key, through SSM only: with ``key`` (its
    ARN) that key; without, the key the cluster's alias names (the boundary, written before the key exists)."""
    statement = {"Sid": "DecryptSecretsWithTheClustersKey", "Effect": "Allow", "Action": ["kms:Decrypt"],
                 "Resource": [key] if key else [key_arn(ctx, "*")],
                 "Condition": {"StringEquals": {"kms:ViaService": ssm_service(ctx)}}}
    if not key:
        statement["Condition"]["ForAnyValue:StringEquals"] = {"kms:ResourceAliases": [key_alias(cluster)]}
    return statement


def head_policy(ctx: AwsContext, cluster: str, group: str, bucket_arn: str, prefix: str | None = None,
                key: str | None = None) -> str:
    """The head (it runs the supervisors of detached runs, no user code): see the cluster's instances and group,
    read their console output for host keys, complete the nodes' lifecycle action, read and write the store's
    prefix (records, logs, heartbeats), read the run secrets and the mesh key under the cluster's SSM path (and
    decrypt them with the cluster's key, ARN ``key``) and delete the secrets of the chains it ended, move
    the master role tag among the cluster's instances, tag itself with its own host keys. Nothing else."""
    return document(head_statements(ctx, cluster, group, bucket_arn, prefix, key))


def head_statements(ctx: AwsContext, cluster: str, group: str, bucket_arn: str, prefix: str | None = None,
                    key: str | None = None) -> list[dict]:
    instances = f"arn:{ctx.partition}:ec2:{ctx.region}:{ctx.account}:instance/*"
    return [
        # Describe* calls take no resource-level permission: '*' is the only resource AWS accepts for them
        {"Sid": "DescribeCluster", "Effect": "Allow", "Resource": "*",
         "Action": ["ec2:DescribeInstances", "autoscaling:DescribeAutoScalingGroups"]},
        {"Sid": "ReadClusterHostKeys", "Effect": "Allow", "Action": ["ec2:GetConsoleOutput"], "Resource": [instances],
         "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": cluster}}},
        lifecycle_statement(ctx, group),
        *store_statements(bucket_arn, prefix or cluster, writable=None, deletable=None, sid="HeadStore"),
        {"Sid": "ReadRunSecrets", "Effect": "Allow", "Resource": ctx.ssm_path_arns(secrets_path(cluster)),
         "Action": ["ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath"]},
        decrypt_statement(ctx, cluster, key),
        # a chain's secrets (launch.staging.run_secrets) leave SSM when its supervisor ends it; never the mesh key
        {"Sid": "DeleteEndedRunSecrets", "Effect": "Allow", "Action": ["ssm:DeleteParameters"],
         "Resource": [ctx.ssm_path_arns(f"{secrets_path(cluster)}/runs")[1]]},
        # node order (cluster.aws.order_nodes): the master role tag moves to a survivor when node 0 is gone
        {"Sid": "MoveMasterTag", "Effect": "Allow", "Action": ["ec2:CreateTags"], "Resource": [instances],
         "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_CLUSTER}": cluster},
                       "ForAllValues:StringEquals": {"aws:TagKeys": [TAG_ROLE]}}},
        host_key_statement(ctx, cluster)]
