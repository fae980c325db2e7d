"""Every IAM policy document this project ships or writes, for the scanners (tests/infra/test_iam_lint.py runs parliament,
tests/infra/test_iam_scan.py cloudsplaining): docs/iam-policy.json (fab), docs/iam-policy-pulumi.json (the deployer), and
what the Pulumi program renders under mocks in each partition: the nodes' and the head's role policies, the three
EC2 trust policies, the store's bucket policy, the permissions boundary of every role and the secrets key's key
policy. Import after pulumi_mocks (it installs the mocks first).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from moto_fixture import isolate_aws
from pulumi_mocks import ACCOUNT, Recorder, make_program

ROOT = Path(__file__).resolve().parent.parent
DOCS = {"fab": "docs/iam-policy.json", "pulumi": "docs/iam-policy-pulumi.json"}
PARTITIONS = (("aws", "us-east-1"), ("aws-cn", "cn-north-1"), ("aws-us-gov", "us-gov-west-1"))


@dataclass
class Rendered:
    kind: str  # fab, pulumi, node, head, trust, bucket, boundary, key
    where: str  # the file, or the resource and partition it was rendered for: what a failure names
    text: str
    resource: object = None  # the mocked resource it came from (a role's path, a trust's role)


def rendered(tmp_path_factory) -> list[Rendered]:
    """The documents, the program run once per partition; fab's and the deployer's are written for 'aws' and are
    read in the others with their partition substituted (as docs/ops.md tells the operator to)."""
    monkeypatch = pytest.MonkeyPatch()
    isolate_aws(monkeypatch, tmp_path_factory.mktemp("aws"))  # the cost lookup finds no credentials
    run = make_program()
    found = [Rendered(kind, path, (ROOT / path).read_text()) for kind, path in DOCS.items()]
    try:
        for partition, region in PARTITIONS:
            m = run(Recorder(offered_zones=(f"{region}a",), partition=partition), region=region).mocks
            for res in m.of("aws:iam/rolePolicy:RolePolicy"):
                found.append(Rendered(res.name.rpartition("-")[2], f"role policy {res.name} ({partition})",
                                      res.inputs["policy"], res))
            for role in m.of("aws:iam/role:Role"):
                found.append(Rendered("trust", f"trust policy of role {role.name} ({partition})",
                                      role.inputs["assumeRolePolicy"], role))
            for res in m.of("aws:s3/bucketPolicy:BucketPolicy"):
                found.append(Rendered("bucket", f"bucket policy {res.name} ({partition})", res.inputs["policy"], res))
            for res in m.of("aws:iam/policy:Policy"):
                found.append(Rendered("boundary", f"permissions boundary {res.name} ({partition})",
                                      res.inputs["policy"], res))
            roles = {f"arn:{partition}:mock:::{r.name}": f"arn:{partition}:iam::{ACCOUNT}:role{r.inputs['path']}{r.name}"
                     for r in m.of("aws:iam/role:Role")}  # the role ARNs AWS returns, where the mocks make up their own
            for res in m.of("aws:kms/key:Key"):
                text = res.inputs["policy"]
                for mocked, real in roles.items():
                    text = text.replace(f'"{mocked}"', f'"{real}"')
                found.append(Rendered("key", f"key policy of {res.name} ({partition})", text, res))
            if partition != "aws":
                for kind, path in DOCS.items():
                    text = (ROOT / path).read_text().replace('"arn:aws:', f'"arn:{partition}:')
                    found.append(Rendered(kind, f"{path} (as {partition})", text))
    finally:
        monkeypatch.undo()
    return found
