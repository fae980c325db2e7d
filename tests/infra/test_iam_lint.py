"""Every IAM policy the Pulumi program writes, docs/iam-policy.json and docs/iam-policy-pulumi.json, linted with parliament: it knows
each action's resource types and condition keys, which neither moto nor Pulumi's mocks enforce.

The program runs under Pulumi's mocks in each partition (aws, aws-cn, aws-us-gov); its node and head policies, the
three EC2 trust policies, the store's bucket policy, the roles' permissions boundary and the secrets key's policy are
linted as rendered. Findings this project accepts are in
ACCEPTED, each with its reason; any other finding fails, and so does an accepted one that no longer occurs (the
list stays true). What only a real account can confirm is in docs/ops.md ("What only a real account confirms").
"""
from __future__ import annotations

import importlib.resources
import json
import re
import sys
import types

import pytest
from iam_documents import rendered

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

try:  # parliament 1.6.4 reads its data files through pkg_resources, which setuptools >= 81 no longer ships
    import pkg_resources  # noqa: F401
except ImportError:
    shim = types.ModuleType("pkg_resources")
    shim.resource_filename = lambda package, name: str(importlib.resources.files(package) / name)
    sys.modules["pkg_resources"] = shim
parliament = pytest.importorskip("parliament", reason="parliament (pyproject's dev extra) lints the IAM policies")

# (policy kind, parliament issue) -> why it stands; ONLY narrows some of them to the findings they stand for
ACCEPTED = {
    ("node", "UNKNOWN_CONDITION_FOR_ACTION"):
        "ec2:SourceInstanceARN on ec2:CreateTags: EC2 sets this key on every request made with an instance role's "
        "credentials (AWS's managed AWSEC2VssSnapshotPolicy uses it); parliament's table lists it only for some "
        "actions. It is what limits a node to tagging itself; a real account confirms it (docs/ops.md)",
    ("head", "UNKNOWN_CONDITION_FOR_ACTION"): "the head's own host-key statement, the same as the nodes'",
    ("trust", "MALFORMED"):
        "a role's trust policy names a Principal and has no Resource by design; parliament reads every document "
        "as an identity policy. The rest of the trust policy is checked in tests/infra/test_infra_program.py",
    ("fab", "RESOURCE_STAR"):
        "fab's reads only (GetConsoleOutput, ListRoleTags, GetInstanceProfile, List*BuildVersions): fab sweep reads "
        "every role, profile, instance and image build to find the cluster's by its tag, whose ids are not known when "
        "the policy is written. Its deletes name their resource types and need the cluster's tag",
    ("pulumi", "RESOURCE_STAR"):
        "docs/iam-policy-pulumi.json: pulumi up creates what AWS names at creation (VPC, subnet, security group, "
        "launch templates, groups) and reads with Describe*/Get*, which take no resource; its IAM and S3 statements "
        "are scoped to roles, instance profiles and xc-* buckets",
    ("pulumi", "PERMISSIONS_MANAGEMENT_ACTIONS"):
        "pulumi up creates the nodes', the head's and the image build's roles and writes their policies: a deploy "
        "identity does IAM writes by nature. Every iam: action is limited to roles and instance profiles under "
        "/xeon-cluster/ (service-linked roles: /aws-service-role/, three services by name)",
    ("pulumi", "PRIVILEGE_ESCALATION"):
        "iam:PassRole + ec2:RunInstances: the deployer may write inline policies into roles under /xeon-cluster/ and "
        "pass them to EC2 (only there, only to EC2), and only roles that carry a cluster's permissions boundary "
        "(iam:PermissionsBoundary), which caps them; parliament reads no conditions. The deployer writes that "
        "boundary too: docs/ops.md ('What each role can do') says how to take that right away once it exists",
    ("pulumi", "RESOURCE_MISMATCH"):
        "kms:CreateAlias, DeleteAlias and UpdateAlias are authorized on the alias and on its key: the key side is "
        "in the statement conditioned on the cluster's tag, the alias side (alias/xeon-cluster/*) in its own; "
        "parliament wants both in each",
    ("fab", "UNKNOWN_CONDITION_FOR_ACTION"):
        "kms:ResourceAliases on kms:DescribeKey and kms:Encrypt (the aliases of the key a request names; AWS "
        "documents it for every operation on a key): parliament's table predates it. It keeps fab to the keys "
        "under alias/xeon-cluster/",
    ("boundary", "UNKNOWN_CONDITION_FOR_ACTION"):
        "the boundary holds the head's and the nodes' statements as they are: ec2:SourceInstanceARN on ec2:CreateTags "
        "(as for the node and the head above) and kms:ResourceAliases on kms:Decrypt (as for fab's kms: rights)",
    ("boundary", "RESOURCE_STAR"):
        "the permissions boundary grants nothing, it caps: it lets through the '*' resources that the head's "
        "Describe* calls and the image build's AWS managed policies (SSM's agent, Image Builder's components and "
        "kms:Decrypt via Image Builder only) are given",
    ("key", "PERMISSIONS_MANAGEMENT_ACTIONS"):
        "the account administers its key (kms:PutKeyPolicy, as AWS's default key policy lets it); it may not use it: "
        "Decrypt is the head's role's alone, and no statement lets anyone make a grant",
    ("key", "RESOURCE_STAR"):
        "a key policy's Resource is always '*': the key it is attached to",
    ("pulumi", "RESOURCE_POLICY_PRIVILEGE_ESCALATION"):
        "pulumi up writes the store's TLS-only bucket policy (s3:PutBucketPolicy, xc-* buckets only)",
    ("fab", "PERMISSIONS_MANAGEMENT_ACTIONS"):
        "fab sweep deletes the cluster's leftover roles and instance profiles, which are IAM writes by nature; "
        "it creates, attaches or passes none",
}


# (policy kind, parliament issue) -> a pattern every such finding's detail must match
ONLY = {("pulumi", "RESOURCE_MISMATCH"): r'^\[(\{"action": "kms:(Create|Delete|Update)Alias", [^}]*\}(, )?)+\]$',
        ("fab", "UNKNOWN_CONDITION_FOR_ACTION"): r'^"Unknown condition kms:ResourceAliases for action kms:',
        ("boundary", "UNKNOWN_CONDITION_FOR_ACTION"): r'^"Unknown condition (kms:ResourceAliases for action '
                                                      r'kms:Decrypt|ec2:SourceInstanceARN for action ec2:CreateTags)"$'}


def lint(document: str) -> list[tuple[str, str]]:
    policy = parliament.analyze_policy_string(document, include_community_auditors=True)
    return [(f.issue, json.dumps(f.detail, default=str)[:300]) for f in policy.findings]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """kind -> every rendered policy of that kind, from the program in each partition, plus fab's own."""
    found: dict[str, list[str]] = {}
    for doc in rendered(tmp_path_factory):
        found.setdefault(doc.kind, []).append(doc.text)
    return found


def test_every_rendered_policy_and_fabs_own_lint_clean_but_for_the_accepted_findings(documents):
    assert {k: len(v) for k, v in documents.items()} == {"fab": 3, "pulumi": 3, "node": 3, "head": 3, "trust": 9,
                                                          "bucket": 3, "boundary": 3, "key": 3}
    seen, unexpected = set(), []
    for kind, docs in documents.items():
        for doc in docs:
            for issue, detail in lint(doc):
                if (kind, issue) in ACCEPTED and re.search(ONLY.get((kind, issue), ""), detail):
                    seen.add((kind, issue))
                else:
                    unexpected.append((kind, issue, detail))
    assert not unexpected, unexpected
    assert seen == set(ACCEPTED), f"accepted but no longer found (remove them): {set(ACCEPTED) - seen}"


def test_the_linter_catches_what_a_careless_policy_change_would_bring():
    """parliament is really consulted: a node policy that deletes any version anywhere, a misspelled action and
    an action pointed at another service's resource are each found."""
    def doc(statement: dict) -> str:
        return json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", **statement}]})

    issues = {i for i, _ in lint(doc({"Action": ["s3:DeleteObjectVersion"], "Resource": "*"}))}
    assert "RESOURCE_STAR" in issues
    assert "UNKNOWN_ACTION" in {i for i, _ in lint(doc({"Action": ["s3:DeleteObjekt"],
                                                       "Resource": "arn:aws:s3:::xc-dev/dev/*"}))}
    assert "RESOURCE_MISMATCH" in {i for i, _ in lint(doc({"Action": ["ssm:GetParameter"],
                                                          "Resource": "arn:aws:s3:::xc-dev/dev/*"}))}
    assert "UNKNOWN_CONDITION_FOR_ACTION" in {i for i, _ in lint(doc({
        "Action": ["s3:GetObject"], "Resource": "arn:aws:s3:::xc-dev/dev/*",
        "Condition": {"StringEquals": {"ec2:InstanceType": "t3.medium"}}}))}
