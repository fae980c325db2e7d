"""docs/iam-policy.json against every AWS call fab makes, built only: botocore's service
models map each client method named in fab's code (a call, a paginator, a name looked up in a table, or a bound
method picked first and called later, as fab sweep's revokes are) to its IAM action. A real AWS account would
confirm that no call needs a permission beyond its action."""
from __future__ import annotations

import json
import re
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parents[2]
# The services fab's own code makes clients for (core/ec2.py aws_client; sweep/run.py's table; the store).
SERVICES = ("ec2", "autoscaling", "iam", "imagebuilder", "logs", "kms", "s3", "ssm")
# Code fab runs with the operator's credentials: fab tasks, discovery, sweep, the cost lookup, doctor, and the
# store's client (training/runtime/store.py), which fab pull, fab runs, doctor's store row and resuming use at home.
FAB_CODE = ("cluster", "sweep", "core", "launch", "doctor", "infra/cost.py", "fabfile.py", "training/runtime/store.py")
# The AWS twin (twin/) is left out: it plays AWS itself against moto with moto's credentials, never the operator's,
# and its calls (create_vpc, create_auto_scaling_group, ...) are the deployer's and the cloud's, not fab's.
# Actions the scan finds that fab's credentials must not have: the mesh key and the run secrets are read only on the
# head, with its role (cluster.mesh.fetch, launch.staging.run_secrets.fetch; infra.policies.head_policy), which alone
# may decrypt them with the cluster's key, and list_tags_for_resource is the name of logs' call as well.
NOT_FABS = {"ssm:GetParameter", "ssm:GetParameters", "ssm:ListTagsForResource", "kms:Decrypt"}
# The scan goes by method name: fab's delete_policy is IAM's (the sweep's permissions boundary), not Auto Scaling's
OTHER_SERVICES_NAME = {"autoscaling:DeletePolicy"}
# A client method named in fab's code: called (.put_parameter(), "describe_instances" for a paginator or a table),
# or referenced to be called later (revoke = ec2.revoke_security_group_ingress if ... else ...).
METHOD_NAME = re.compile(r"""[."']([a-z][a-z0-9_]+)\b""")
# S3 operations whose IAM action has another name (the S3 user guide's table of actions per operation).
S3_ACTION_OF = {"ListObjectsV2": "ListBucket", "HeadBucket": "ListBucket", "HeadObject": "GetObject",
                "DeleteObjects": "DeleteObject", "ListObjectVersions": "ListBucketVersions",
                "ListBuckets": "ListAllMyBuckets", "CreateMultipartUpload": "PutObject", "UploadPart": "PutObject",
                "CompleteMultipartUpload": "PutObject"}
# boto3's transfer methods (not in the service model) and what they call; the store tags checkpoints on upload
TRANSFER = {"upload_file": {"s3:PutObject", "s3:PutObjectTagging", "s3:AbortMultipartUpload"},
            "download_file": {"s3:GetObject"}}


def fab_actions() -> set[str]:
    session = boto3.session.Session(region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    methods: dict[str, set[str]] = {}
    for service in SERVICES:
        client = session.client(service)
        for method, op in client.meta.method_to_api_mapping.items():
            if service == "s3":
                op = S3_ACTION_OF.get(op, op)
            methods.setdefault(method, set()).add(f"{client.meta.service_model.signing_name}:{op}")
    for method, actions in TRANSFER.items():
        methods.setdefault(method, set()).update(actions)
    # fab sweep deletes a store bucket's every version, which needs the versions' own action
    methods["list_object_versions"].add("s3:DeleteObjectVersion")
    # a SecureString put with the cluster's own KMS key (cluster.mesh, launch.staging.run_secrets): SSM encrypts it with
    # the caller's rights, which need kms:Encrypt on that key
    methods["put_parameter"].add("kms:Encrypt")
    files = [p for entry in FAB_CODE for p in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir()
                                                else [ROOT / entry])]
    names = {m.group(1) for f in files for m in METHOD_NAME.finditer(f.read_text())}
    return {action for name in names if name in methods for action in methods[name]}


def test_policy_allows_every_call_fab_makes_and_nothing_wildcard():
    policy = json.loads((ROOT / "docs" / "iam-policy.json").read_text())
    allowed = {a for st in policy["Statement"] if st["Effect"] == "Allow"
               for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    needed = fab_actions()
    assert "ec2:CreateTags" in needed and "ec2:DescribeInstances" in needed  # the scan sees discovery
    assert {"s3:GetObject", "s3:ListBucket", "s3:ListAllMyBuckets", "s3:DeleteBucket"} <= needed  # store, sweep
    assert {"ssm:PutParameter", "ssm:DescribeParameters", "ssm:DeleteParameter"} <= needed  # the mesh key, swept
    assert {"kms:DescribeKey", "kms:Encrypt"} <= needed  # the cluster's secrets key, found by its alias
    # fab sweep revokes the rules by which one swept security group names another (a bound method, called later)
    assert {"ec2:RevokeSecurityGroupIngress", "ec2:RevokeSecurityGroupEgress"} <= needed
    assert not NOT_FABS & allowed  # an operator cannot read the mesh key back
    missing = sorted(needed - allowed - NOT_FABS - OTHER_SERVICES_NAME)
    assert "iam:DeletePolicy" in allowed
    assert not missing, f"docs/iam-policy.json lacks {missing}"
    assert not [a for a in allowed if "*" in a]
