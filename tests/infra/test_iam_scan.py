"""The policies a security review reads first, through a scanner we did not write. cloudsplaining (the
least-privilege scanner a reviewer pastes policies into) runs over docs/iam-policy.json, docs/iam-policy-pulumi.json
and every role, trust, bucket, boundary and key policy the Pulumi program renders under mocks, in each partition.

- No high-priority finding anywhere: what `cloudsplaining scan-policy-file --high-priority-only` prints (Privilege
  Escalation, Data Exfiltration, Resource Exposure, Service Wildcard, Credentials Exposure), through the same
  scan_policy() the command calls, with its default exclusions; for trust, bucket and key policies, its
  resource-policy checks (assumable by anyone or from another account; open to the internet).
- No "Unrestricted Infrastructure Modification" either, but for the deployer's creates and what the permissions
  boundary lets the image build's SSM agent do, listed in ACCEPTED.
- A finding names the document and the statement (Sid) that allows it, so a policy edit that breaks a rule fails
  here with the statement to fix. Accepted findings are in ACCEPTED, each with its reason, and one that no longer
  occurs fails too (the list stays true).

And the rules the scanner does not know: roles and instance profiles under /xeon-cluster/, the deployer's iam:
rights only there, iam:PassRole only there and only to EC2, every role it writes only with a cluster's permissions
boundary, fab's deletes only of what carries the cluster's tag.
"""
from __future__ import annotations

import fnmatch
import json

import pytest
from iam_documents import ROOT, rendered

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
cloudsplaining = pytest.importorskip("cloudsplaining", reason="cloudsplaining (pyproject's dev extra) scans the "
                                     "IAM policies")
from cloudsplaining.command.scan_policy_file import scan_policy
from cloudsplaining.scan.assume_role_policy_document import AssumeRolePolicyDocument
from cloudsplaining.scan.policy_document import PolicyDocument
from cloudsplaining.scan.resource_policy_document import ResourcePolicyDocument
from cloudsplaining.shared.constants import DEFAULT_EXCLUSIONS_CONFIG
from cloudsplaining.shared.exclusions import Exclusions

from core.constants import TAG_CLUSTER
from infra.policies import BOUNDARY_PREFIX, ROLE_PATH, boundary_name

# cloudsplaining's result key -> the name its report prints; the first five are --high-priority-only's
CATEGORIES = {"PrivilegeEscalation": "Privilege Escalation", "DataExfiltration": "Data Exfiltration",
              "ResourceExposure": "Resource Exposure", "ServiceWildcard": "Service Wildcard",
              "CredentialsExposure": "Credentials Exposure",
              "InfrastructureModification": "Unrestricted Infrastructure Modification"}
INFRA = CATEGORIES["InfrastructureModification"]

# (kind, category) -> (why it stands, the actions accepted). Nothing high-priority is accepted.
ACCEPTED = {
    ("pulumi", INFRA): (
        ("pulumi up creates what AWS names only at creation (VPC, subnet, route table, gateway, security group, "
        "placement group, key pair, launch template, Auto Scaling group, Image Builder's component, recipe and "
        "image, the build's log group) and changes it by the ids it got back; those ids cannot be in a policy "
        "written beforehand. Launch template changes are tag-conditioned (PulumiChangeTheClustersLaunchTemplates)"),
        frozenset({
            "autoscaling:CancelInstanceRefresh", "autoscaling:CreateAutoScalingGroup", "autoscaling:CreateOrUpdateTags",
            "autoscaling:DeleteAutoScalingGroup", "autoscaling:DeleteLifecycleHook", "autoscaling:DeleteTags",
            "autoscaling:PutLifecycleHook", "autoscaling:StartInstanceRefresh", "autoscaling:UpdateAutoScalingGroup",
            "ec2:AssociateRouteTable", "ec2:AttachInternetGateway", "ec2:AuthorizeSecurityGroupEgress",
            "ec2:AuthorizeSecurityGroupIngress", "ec2:CreateInternetGateway", "ec2:CreateLaunchTemplate",
            "ec2:CreatePlacementGroup", "ec2:CreateRoute", "ec2:CreateRouteTable", "ec2:CreateSecurityGroup",
            "ec2:CreateSubnet", "ec2:CreateTags", "ec2:CreateVpc", "ec2:DeleteInternetGateway", "ec2:DeleteKeyPair",
            "ec2:DeletePlacementGroup", "ec2:DeleteRoute", "ec2:DeleteRouteTable", "ec2:DeleteSecurityGroup",
            "ec2:DeleteSnapshot", "ec2:DeleteSubnet", "ec2:DeleteTags", "ec2:DeleteVpc", "ec2:DeregisterImage",
            "ec2:DetachInternetGateway", "ec2:DisassociateRouteTable", "ec2:ImportKeyPair",
            "ec2:ModifySubnetAttribute", "ec2:ModifyVpcAttribute", "ec2:RevokeSecurityGroupEgress",
            "ec2:RevokeSecurityGroupIngress", "ec2:RunInstances", "imagebuilder:CreateComponent",
            "imagebuilder:CreateImage", "imagebuilder:CreateImageRecipe",
            "imagebuilder:CreateInfrastructureConfiguration", "imagebuilder:DeleteComponent",
            "imagebuilder:DeleteImage", "imagebuilder:DeleteImageRecipe",
            "imagebuilder:DeleteInfrastructureConfiguration", "imagebuilder:TagResource",
            "imagebuilder:UntagResource", "imagebuilder:UpdateInfrastructureConfiguration", "logs:CreateLogGroup",
            "logs:DeleteLogGroup", "logs:DeleteRetentionPolicy", "logs:PutRetentionPolicy", "logs:TagLogGroup",
            "logs:TagResource", "logs:UntagLogGroup", "logs:UntagResource"})),
    ("boundary", INFRA): (
        ("the permissions boundary grants nothing: it caps what the program's roles may do at what they are given. "
         "It lets through what AmazonSSMManagedInstanceCore gives the image build instance, whose SSM agent reports "
         "its own state with these calls on '*' (as AWS's managed policy writes them)"),
        frozenset({"ssm:PutComplianceItems", "ssm:UpdateAssociationStatus", "ssm:UpdateInstanceAssociationStatus",
                   "ssm:UpdateInstanceInformation"})),
}
EXCLUSIONS = Exclusions(DEFAULT_EXCLUSIONS_CONFIG)  # what the command uses by default


def sid(statement, index: int) -> str:
    return statement.json.get("Sid") or f"#{index}"


def culprits(policy: dict, actions: list[str]) -> list[str]:
    """The statements that allow any of ``actions`` with no condition (cloudsplaining flags no conditioned one)."""
    document = PolicyDocument(policy, exclusions=EXCLUSIONS)
    wanted = {a.lower() for a in actions}
    return [sid(s, i) for i, s in enumerate(document.statements)
            if s.effect_allow and not s.has_condition and wanted & {a.lower() for a in s.expanded_actions}]


def findings(kind: str, where: str, text: str) -> list[tuple[str, str, str, str]]:
    """(category, action, statement, the line a failure prints) for every finding of one document."""
    policy = json.loads(text)
    out = []

    def add(category: str, actions: list[str], statements: list[str]) -> None:
        for action in actions:
            named = ", ".join(statements) or "?"
            out.append((category, action, named, f"{where}: statement {named}: {category}: {action}"))

    if kind == "trust":
        document = AssumeRolePolicyDocument(policy, exclusions=EXCLUSIONS)
        for i, s in enumerate(document.statements):
            for principal in s.role_assumable_by_any_principal + s.role_assumable_by_cross_account_principals:
                add("Assumable by others", [principal], [s.statement.get("Sid") or f"#{i}"])
        return out
    if kind in ("bucket", "key"):  # resource policies: the store's bucket, the secrets key
        for i, s in enumerate(ResourcePolicyDocument(policy).statements):
            add("Internet accessible", s.internet_accessible_actions, [s.statement.get("Sid") or f"#{i}"])
        return out
    results = scan_policy(policy, DEFAULT_EXCLUSIONS_CONFIG)
    for key, category in CATEGORIES.items():
        for found in results[key]["findings"]:
            actions = found["actions"] if isinstance(found, dict) else [found]  # escalations: a set of actions
            if isinstance(found, dict):
                add(category, [f"{found['type']} ({' + '.join(actions)})"], culprits(policy, actions))
            else:
                add(category, actions, culprits(policy, actions))
    return out


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return rendered(tmp_path_factory)


def unaccepted(documents) -> tuple[list[str], set]:
    bad, seen = [], set()
    for doc in documents:
        for category, action, _, line in findings(doc.kind, doc.where, doc.text):
            reason_actions = ACCEPTED.get((doc.kind, category))
            if reason_actions and action in reason_actions[1]:
                seen.add((doc.kind, category, action))
            else:
                bad.append(line)
    return bad, seen


def test_cloudsplaining_finds_nothing_in_any_policy_but_the_accepted(documents):
    kinds = {d.kind for d in documents}
    assert kinds == {"fab", "pulumi", "node", "head", "trust", "bucket", "boundary", "key"}
    assert len([d for d in documents if d.kind == "trust"]) == 9  # node, head, build role in three partitions
    bad, seen = unaccepted(documents)
    assert not bad, "cloudsplaining: " + "; ".join(bad)
    listed = {(kind, category, a) for (kind, category), (_, actions) in ACCEPTED.items() for a in actions}
    assert seen == listed, f"accepted but no longer found (remove them from ACCEPTED): {sorted(listed - seen)}"
    assert all(reason for reason, _ in ACCEPTED.values())
    assert not [key for key in ACCEPTED if key[1] != INFRA]  # nothing high-priority is ever accepted


def test_the_fab_policy_has_no_unrestricted_infrastructure_modification_at_all():
    text = (ROOT / "docs" / "iam-policy.json").read_text()
    results = scan_policy(json.loads(text), DEFAULT_EXCLUSIONS_CONFIG)
    assert all(not results[key]["findings"] for key in CATEGORIES), {k: results[k]["findings"] for k in CATEGORIES}
    # the scanner is really consulted: the policy's delete statements are there, conditioned on the cluster's tag
    statements = {s["Sid"]: s for s in json.loads(text)["Statement"]}
    ec2 = statements["FabDeleteTheClustersEc2Resources"]
    assert "ec2:TerminateInstances" in ec2["Action"] and "ec2:DeleteVpc" in ec2["Action"]
    assert ec2["Condition"] == {"StringLike": {f"aws:ResourceTag/{TAG_CLUSTER}": "?*"}}


def test_a_policy_edit_that_breaks_a_rule_fails_naming_the_statement():
    """Bad input: the fab policy's tag condition dropped from its EC2 deletes, the deployer's SSM read widened to
    '*', and a node policy given iam:PassRole: each is a finding naming the statement to fix."""
    fab = json.loads((ROOT / "docs" / "iam-policy.json").read_text())
    for s in fab["Statement"]:
        if s["Sid"] == "FabDeleteTheClustersEc2Resources":
            del s["Condition"]
            s["Resource"] = "*"
    lines = [f[3] for f in findings("fab", "docs/iam-policy.json", json.dumps(fab))]
    assert ("docs/iam-policy.json: statement FabDeleteTheClustersEc2Resources: Unrestricted Infrastructure "
            "Modification: ec2:TerminateInstances") in lines

    pulumi = json.loads((ROOT / "docs" / "iam-policy-pulumi.json").read_text())
    for s in pulumi["Statement"]:
        if s["Sid"] == "PulumiReadUbuntuAmiParameters":
            s["Resource"] = "*"
    lines = [f[3] for f in findings("pulumi", "docs/iam-policy-pulumi.json", json.dumps(pulumi))]
    assert ("docs/iam-policy-pulumi.json: statement PulumiReadUbuntuAmiParameters: Data Exfiltration: "
            "ssm:GetParameter") in lines

    node = {"Version": "2012-10-17", "Statement": [
        {"Sid": "Mine", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "arn:aws:s3:::xc-a/dev/*"},
        {"Sid": "Oops", "Effect": "Allow", "Action": ["iam:PassRole", "ec2:RunInstances"], "Resource": "*"}]}
    (escalation,) = [f for f in findings("node", "node policy", json.dumps(node)) if f[0] == "Privilege Escalation"]
    assert escalation[2] == "Oops" and "iam:passrole" in escalation[1].lower()

    trust = {"Version": "2012-10-17", "Statement": [
        {"Sid": "Anyone", "Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {"AWS": "*"}}]}
    assert [f[2] for f in findings("trust", "trust", json.dumps(trust))] == ["Anyone"]
    bucket = {"Version": "2012-10-17", "Statement": [
        {"Sid": "Public", "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
         "Resource": "arn:aws:s3:::xc-a/*"}]}
    assert [f[2] for f in findings("bucket", "bucket", json.dumps(bucket))] == ["Public"]


def test_roles_and_instance_profiles_live_under_the_cluster_path(documents):
    roles = [d.resource for d in documents if d.kind == "trust"]
    assert roles and all(r.inputs["path"] == ROLE_PATH == "/xeon-cluster/" for r in roles)
    # one trusted principal each: EC2 in the stack's partition, nothing else, no one from another account
    for role in roles:
        (statement,) = json.loads(role.inputs["assumeRolePolicy"])["Statement"]
        assert statement["Action"] == "sts:AssumeRole" and list(statement["Principal"]) == ["Service"]
        assert statement["Principal"]["Service"].startswith("ec2.amazonaws.com")


def _statements(path: str) -> list[dict]:
    return json.loads((ROOT / path).read_text())["Statement"]


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def test_the_deployers_iam_rights_reach_only_the_cluster_path_and_pass_roles_only_to_ec2():
    path = ROLE_PATH.strip("/")
    boundary = f"arn:aws:iam::*:policy/{path}/{BOUNDARY_PREFIX}*"
    on_path = {f"arn:aws:iam::*:role/{path}/*", f"arn:aws:iam::*:instance-profile/{path}/*", boundary}
    iam = [s for s in _statements("docs/iam-policy-pulumi.json") if any(a.startswith("iam:") for a in
                                                                         _as_list(s["Action"]))]
    assert iam
    for s in iam:
        assert all(a.startswith("iam:") for a in _as_list(s["Action"])), s["Sid"]  # iam: statements are iam: only
        if _as_list(s["Action"]) == ["iam:CreateServiceLinkedRole"]:
            assert s["Resource"] == "arn:aws:iam::*:role/aws-service-role/*" and s["Condition"]["StringEquals"][
                "iam:AWSServiceName"], s["Sid"]
            continue
        assert set(_as_list(s["Resource"])) <= on_path, f"{s['Sid']} reaches {s['Resource']}"
        assert "*" not in "".join(_as_list(s["Action"])), s["Sid"]
        # managed policies: the clusters' boundaries only, and nothing else there
        assert (boundary in _as_list(s["Resource"])) == any("Policy" in a and "Role" not in a
                                                            for a in _as_list(s["Action"])), s["Sid"]
        if boundary in _as_list(s["Resource"]):
            assert _as_list(s["Resource"]) == [boundary], s["Sid"]
    # every role-writing right requires the cluster's permissions boundary, which no right takes off a role
    allowed = [s for s in iam if s["Effect"] == "Allow"]
    writes = {"iam:CreateRole", "iam:PutRolePolicy", "iam:DeleteRolePolicy", "iam:AttachRolePolicy",
              "iam:DetachRolePolicy", "iam:PutRolePermissionsBoundary"}
    for s in allowed:
        if writes & set(_as_list(s["Action"])):
            assert s["Condition"]["ArnLike"] == {"iam:PermissionsBoundary": boundary}, s["Sid"]
    assert writes <= {a for s in allowed for a in _as_list(s["Action"])}
    assert not [s for s in allowed if "iam:DeleteRolePermissionsBoundary" in _as_list(s["Action"])]
    (never,) = [s for s in iam if s["Effect"] == "Deny"]
    assert never["Action"] == "iam:DeleteRolePermissionsBoundary"
    # the boundary the program makes is one the condition admits: under the roles' path, named so
    assert fnmatch.fnmatchcase(f"arn:aws:iam::123456789012:policy{ROLE_PATH}{boundary_name('dev', 'us-east-1')}",
                               boundary)
    (passing,) = [s for s in iam if "iam:PassRole" in _as_list(s["Action"])]
    assert _as_list(passing["Action"]) == ["iam:PassRole"]
    assert _as_list(passing["Resource"]) == [f"arn:aws:iam::*:role/{path}/*"]
    assert passing["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}
    (attach,) = [s for s in iam if "iam:AttachRolePolicy" in _as_list(s["Action"])]
    assert set(attach["Condition"]["ArnEquals"]["iam:PolicyARN"]) == {  # no AdministratorAccess onto a role
        "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore",
        "arn:aws:iam::aws:policy/EC2InstanceProfileForImageBuilder"}
    # the SSM parameters it reads are Canonical's public AMI ids only, and launch templates change only when tagged
    ssm = [s for s in _statements("docs/iam-policy-pulumi.json") if any(a.startswith("ssm:") for a in
                                                                        _as_list(s["Action"]))]
    assert [_as_list(s["Resource"]) for s in ssm] == [["arn:aws:ssm:*:*:parameter/aws/service/canonical/*"]]
    (templates,) = [s for s in _statements("docs/iam-policy-pulumi.json")
                    if "ec2:ModifyLaunchTemplate" in _as_list(s["Action"])]
    assert "ec2:CreateLaunchTemplateVersion" in templates["Action"]
    assert templates["Condition"] == {"StringLike": {f"aws:ResourceTag/{TAG_CLUSTER}": "?*"}}


def test_fabs_deletes_need_the_clusters_tag_or_its_path_or_its_store_name():
    """Every write fab may make names its resource or needs a tag of this project: a fab user cannot terminate
    another team's instances, delete another team's roles, empty another team's buckets, or write another team's
    SSM parameters (fab puts only each cluster's mesh key, under /xeon-cluster/)."""
    reads = ("Describe", "Get", "List")
    for s in _statements("docs/iam-policy.json"):
        writes = [a for a in _as_list(s["Action"]) if not a.split(":")[1].startswith(reads)]
        if not writes:
            continue
        resources = _as_list(s["Resource"])
        tags = {k for op in s.get("Condition", {}).values() for k in op if "ResourceTag/xeon-cluster:" in k}
        scoped = all(r.startswith(("arn:aws:iam::*:role/xeon-cluster/", "arn:aws:iam::*:instance-profile/xeon-cluster/",
                                   "arn:aws:s3:::xc-", "arn:aws:logs:*:*:log-group:/aws/imagebuilder/",
                                   "arn:aws:ssm:*:*:parameter/xeon-cluster/"))
                     for r in resources)
        assert tags or scoped, f"docs/iam-policy.json statement {s['Sid']}: {writes} on {resources} needs the " \
                               "cluster's tag or a resource of this project"
