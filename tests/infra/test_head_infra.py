"""The head in the Pulumi program, under Pulumi's mocks: a small on-demand instance in a group
of one, IMDSv2, encrypted, its own instance profile and least-privilege role, in the cluster's security group with
no world-open ingress, in the cost estimate, and the partition-aware ARNs of every policy."""
from __future__ import annotations

import base64
import gzip
import json

import pulumi
import pytest
import yaml
from moto_fixture import isolate_aws
from pulumi_mocks import ACCOUNT, BAKED_AMI, BASE_AMI, KEY, Recorder, make_program

from core.constants import PROJECT_ROOT as ROOT
from core.constants import TAG_ROLE
from infra import cost
from infra.settings import MIN_ROOT_GIB

pytestmark = pytest.mark.filterwarnings("ignore:.*EncryptionControl has been deprecated:DeprecationWarning")
LT = "aws:ec2/launchTemplate:LaunchTemplate"
GROUP = "aws:autoscaling/group:Group"
SG = "aws:ec2/securityGroup:SecurityGroup"


@pytest.fixture
def program(monkeypatch, tmp_path):
    isolate_aws(monkeypatch, tmp_path)  # the cost lookup finds no credentials: catalog hint, no network
    return make_program()


def statements(m: Recorder, role: str) -> list[dict]:
    role_id = m.named("aws:iam/role:Role", role).id
    (policy,) = [p for p in m.of("aws:iam/rolePolicy:RolePolicy") if p.inputs["role"] == role_id]
    return json.loads(policy.inputs["policy"])["Statement"]


def test_the_head_is_a_small_on_demand_instance_with_imdsv2_an_encrypted_root_and_its_own_profile(program):
    run = program(nodeCount="2")  # spot nodes: the head stays on-demand all the same
    m = run.mocks
    template = m.named(LT, "dev-head").inputs
    assert template["instanceType"] == "t3.medium" and cost.HEAD_USD_H["t3.medium"] < 0.1
    assert template["metadataOptions"] == {"httpEndpoint": "enabled", "httpTokens": "required",
                                           "httpPutResponseHopLimit": 1}
    (root,) = template["blockDeviceMappings"]
    # as big as the baked AMI's snapshot, which it boots
    assert root == {"deviceName": "/dev/sda1", "ebs": {"volumeSize": MIN_ROOT_GIB, "volumeType": "gp3",
                                                       "encrypted": "true", "deleteOnTermination": "true"}}
    assert "instanceMarketOptions" not in template  # never spot
    assert template["creditSpecification"] == {"cpuCredits": "standard"}
    # the nodes' baked AMI (image=bake, the default): its venv at /opt/xeon-cluster/venv runs the supervisors
    assert template["imageId"] == BAKED_AMI
    profile = m.named("aws:iam/instanceProfile:InstanceProfile", "dev-head")
    assert template["iamInstanceProfile"] == {"arn": f"arn:aws:mock:::{profile.name}"}
    assert profile.inputs["role"] == "dev-head" and profile.name != "dev-node"  # its own role, not the nodes'
    # under the path that the deployer's iam: rights and PassRole reach
    assert profile.inputs["path"] == m.named("aws:iam/role:Role", "dev-head").inputs["path"] == "/xeon-cluster/"
    assert template["keyName"] == "dev-key"
    (nic,) = template["networkInterfaces"]
    assert nic["securityGroups"] == [m.named(SG, "dev-head-sg").id]  # its own group, not the nodes'
    # replaced when it dies: a group of one, on-demand (a plain launch template, no mixed-instances policy)
    group = m.named(GROUP, "dev-head").inputs
    assert (group["minSize"], group["maxSize"], group["desiredCapacity"]) == (1, 1, 1)
    assert group["name"] == "dev-head" and group["healthCheckType"] == "EC2"
    assert "mixedInstancesPolicy" not in group and "placementGroup" not in group
    assert group["launchTemplate"] == {"id": m.named(LT, "dev-head").id, "version": "3"}
    assert group["vpcZoneIdentifiers"] == [m.one("aws:ec2/subnet:Subnet").id]
    # its rights are in place before it boots
    assert run.depends_on((GROUP, "dev-head"), ("aws:iam/rolePolicy:RolePolicy", "dev-head"))
    tags = {t["key"]: t["value"] for t in group["tags"]}
    assert tags["Name"] == "dev-head" and tags["xeon-cluster:cluster"] == "dev" and TAG_ROLE not in tags
    assert all(t["propagateAtLaunch"] for t in group["tags"] if t["key"] != "xeon-cluster:store")
    assert tags["xeon-cluster:store"] == m.one("aws:s3/bucket:Bucket").id  # the store it writes (fab sweep)
    assert run.outputs["headAutoScalingGroup"] == "dev-head"
    # every resource of the head says so in its name
    head = [r for r in m.resources if r.name.startswith("dev-head")]
    assert {r.type for r in head} >= {LT, GROUP, "aws:iam/role:Role", "aws:iam/rolePolicy:RolePolicy",
                                      "aws:iam/instanceProfile:InstanceProfile"}


def test_the_head_has_its_own_group_with_ssh_from_the_admin_cidr_only_and_the_nodes_take_ssh_from_it(program):
    """The head (mesh key, run secrets) shares no group with nodes that run user code."""
    run = program(adminCidr="198.51.100.0/28")
    m = run.mocks
    head, nodes = m.named(SG, "dev-head-sg"), m.named(SG, "dev-sg")
    ssh = {"protocol": "tcp", "fromPort": 22, "toPort": 22}
    assert head.inputs["ingress"] == [{"description": "SSH from the operator", **ssh,
                                       "cidrBlocks": ["198.51.100.0/28"]}]  # nothing from the nodes, not even SSH
    ingress = nodes.inputs["ingress"]
    assert {"description": "SSH from the head", **ssh, "securityGroups": [head.id]} in ingress
    assert {"description": "SSH from the operator", **ssh, "cidrBlocks": ["198.51.100.0/28"]} in ingress
    rest = [r for r in ingress if not r.get("cidrBlocks") and not r.get("securityGroups")]
    assert len(ingress) == 3 and len(rest) == 1 and rest[0]["self"] is True  # every port only between the nodes themselves
    everything = head.inputs["ingress"] + ingress
    assert not [r for r in everything if "0.0.0.0/0" in r.get("cidrBlocks", []) or "::/0" in r.get("ipv6CidrBlocks", [])]
    assert head.inputs["vpcId"] == nodes.inputs["vpcId"]


def test_without_a_bake_the_head_boots_stock_ubuntu(program):
    """image=base (or an AMI of the operator's): stock Ubuntu, with no venv; the operator's machine then keeps the
    supervisor role (launch.life.head.lacks_venv), and says so."""
    for image in ("base", "ami-0123456789abcdef0"):
        template = program(image=image).mocks.named(LT, "dev-head").inputs
        assert template["imageId"] == BASE_AMI, image


def test_the_heads_role_does_only_what_the_supervisor_needs(program):
    m = program().mocks
    found = {s["Sid"]: s for s in statements(m, "dev-head")}
    assert set(found) == {"DescribeCluster", "ReadClusterHostKeys", "CompleteClusterGroupsLifecycleAction",
                          "HeadStoreRead", "HeadStoreWrite", "HeadStoreDelete", "HeadStoreList", "ReadRunSecrets",
                          "DecryptSecretsWithTheClustersKey", "DeleteEndedRunSecrets", "MoveMasterTag",
                          "PublishOwnHostKeys"}
    # the SecureStrings it reads are encrypted with the cluster's own key: Decrypt on that key, through SSM only
    key = m.named("aws:kms/key:Key", "dev-secrets")
    assert found["DecryptSecretsWithTheClustersKey"]["Action"] == ["kms:Decrypt"]
    assert found["DecryptSecretsWithTheClustersKey"]["Resource"] == [f"arn:aws:kms:us-east-1:{ACCOUNT}:key/{key.id}"]
    assert found["DecryptSecretsWithTheClustersKey"]["Condition"] == {
        "StringEquals": {"kms:ViaService": "ssm.us-east-1.amazonaws.com"}}
    assert found["DescribeCluster"]["Action"] == ["ec2:DescribeInstances", "autoscaling:DescribeAutoScalingGroups"]
    assert found["CompleteClusterGroupsLifecycleAction"]["Resource"] == [
        f"arn:aws:autoscaling:us-east-1:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/dev-nodes"]
    assert found["ReadClusterHostKeys"]["Condition"] == {
        "StringEquals": {"aws:ResourceTag/xeon-cluster:cluster": "dev"}}
    bucket = f"arn:aws:s3:::{m.one('aws:s3/bucket:Bucket').id}"
    # records, logs and heartbeats are the head's to write: its whole prefix
    assert found["HeadStoreRead"]["Resource"] == found["HeadStoreWrite"]["Resource"] == [f"{bucket}/dev/*"]
    assert found["HeadStoreDelete"]["Resource"] == [f"{bucket}/dev/*"]
    assert found["HeadStoreList"]["Condition"] == {"StringLike": {"s3:prefix": ["dev", "dev/*"]}}
    secrets = found["ReadRunSecrets"]
    assert secrets["Action"] == ["ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath"]
    assert secrets["Resource"] == [f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/xeon-cluster/dev",
                                   f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/xeon-cluster/dev/*"]
    # the mesh key (cluster.mesh) is under the secrets' path: only the head reads it
    from cluster import mesh
    from launch.staging import run_secrets

    assert mesh.parameter("dev").startswith("/xeon-cluster/dev/")
    # a chain's secrets leave SSM with the chain: the head deletes those, and never the mesh key
    assert found["DeleteEndedRunSecrets"]["Action"] == ["ssm:DeleteParameters"]
    assert found["DeleteEndedRunSecrets"]["Resource"] == [
        f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/xeon-cluster/dev/runs/*"]
    assert run_secrets.parameter("dev", "c1", "K").startswith("/xeon-cluster/dev/runs/")
    assert not run_secrets.parameter("dev", "c1", "K").startswith(mesh.parameter("dev"))
    # it moves the master role tag among the cluster's instances (cluster.aws.order_nodes), and sets no other tag
    assert found["MoveMasterTag"]["Action"] == ["ec2:CreateTags"]
    assert found["MoveMasterTag"]["Condition"] == {
        "StringEquals": {"aws:ResourceTag/xeon-cluster:cluster": "dev"},
        "ForAllValues:StringEquals": {"aws:TagKeys": ["xeon-cluster:role"]}}
    actions = [a for sid, s in found.items() for a in s["Action"] if sid != "DeleteEndedRunSecrets"]
    assert not [a for a in actions if "*" in a or "Version" in a or a.startswith(("iam:", "ssm:Put", "ssm:Delete"))]
    assert all(s["Resource"] != "*" for sid, s in found.items() if sid != "DescribeCluster")


def test_the_secrets_key_is_the_clusters_own_and_only_the_heads_role_decrypts_with_it(program):
    """The mesh key and the run secrets are SecureStrings encrypted with a customer-managed key (not the account's
    aws/ssm key, which every principal allowed ssm:GetParameter may decrypt with): rotated, found by its alias, and
    its policy lets the account administer it and encrypt through SSM, and only the head's role decrypt."""
    run = program(clusterName="bert")
    m = run.mocks
    key = m.named("aws:kms/key:Key", "bert-secrets")
    assert key.inputs["enableKeyRotation"] is True and key.inputs["deletionWindowInDays"] == 7
    alias = m.named("aws:kms/alias:Alias", "bert-secrets")
    assert alias.inputs["name"] == "alias/xeon-cluster/bert" == run.outputs["secretsKeyAlias"]
    assert alias.inputs["targetKeyId"] == key.id
    assert run.outputs["secretsKeyArn"] == f"arn:aws:mock:::{key.name}"
    assert run.depends_on(("aws:kms/alias:Alias", "bert-secrets"), ("aws:kms/key:Key", "bert-secrets"))
    head_role = f"arn:aws:mock:::{m.named('aws:iam/role:Role', 'bert-head').name}"
    policy = {s["Sid"]: s for s in json.loads(key.inputs["policy"])["Statement"]}
    assert set(policy) == {"AccountAdministersTheKey", "AccountEncryptsTheClustersSecretsThroughSsm",
                           "OnlyTheHeadDecrypts"}
    root = {"AWS": f"arn:aws:iam::{ACCOUNT}:root"}
    parameters = f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/xeon-cluster/bert/*"
    admin = policy["AccountAdministersTheKey"]
    assert admin["Principal"] == root and "kms:PutKeyPolicy" in admin["Action"]
    # administering is not using: no Decrypt, no Encrypt, no grant that could hand Decrypt on, no wildcard
    assert not [a for a in admin["Action"] if "crypt" in a or "GenerateDataKey" in a or "*" in a or
                a in ("kms:CreateGrant", "kms:ReEncryptFrom", "kms:ReEncryptTo")]
    encrypt = policy["AccountEncryptsTheClustersSecretsThroughSsm"]
    assert encrypt["Principal"] == root and encrypt["Action"] == ["kms:Encrypt"]
    assert encrypt["Condition"] == {"StringEquals": {"kms:ViaService": "ssm.us-east-1.amazonaws.com"},
                                    "StringLike": {"kms:EncryptionContext:PARAMETER_ARN": parameters}}
    decrypt = policy["OnlyTheHeadDecrypts"]
    assert decrypt["Principal"] == {"AWS": head_role} and decrypt["Action"] == ["kms:Decrypt"]
    assert decrypt["Condition"] == encrypt["Condition"]
    # no other statement lets anyone decrypt
    assert [sid for sid, s in policy.items() if "kms:Decrypt" in s["Action"]] == ["OnlyTheHeadDecrypts"]
    # the nodes, which run user code, are given nothing of KMS
    nodes = statements(m, "bert-node")
    assert not [a for s in nodes for a in s["Action"] if a.startswith("kms:")]
    from cluster import mesh

    assert mesh.key_alias("bert") == alias.inputs["name"]  # where fab looks it up


def test_the_heads_user_data_says_where_the_group_store_and_secrets_are(program):
    run = program(clusterName="bert")
    m = run.mocks
    cloud = yaml.safe_load(gzip.decompress(base64.b64decode(m.named(LT, "bert-head").inputs["userData"])).decode())
    env = next(f["content"] for f in cloud["write_files"] if f["path"] == "/etc/xeon-cluster/cluster.env")
    bucket = m.one("aws:s3/bucket:Bucket").id
    for line in ("XC_ROLE=head", "XC_ASG_NAME=bert-nodes", "XC_LIFECYCLE_HOOK=xc-checkpoint",
                 f"XC_STORE=s3://{bucket}/bert", "XC_SECRETS_PATH=/xeon-cluster/bert", "XC_HEAD_GROUP=bert-head"):
        assert line in env.splitlines()
    namer = next(f["content"] for f in cloud["write_files"] if f["path"] == "/usr/local/sbin/xc-name-node")
    assert 'name="bert-head"' in namer
    assert cloud["packages"] == ["python3-venv"]


def test_head_instance_type_is_config_and_an_unknown_one_is_refused_in_one_line(program):
    run = program(headInstanceType="m7i.large")
    template = run.mocks.named(LT, "dev-head").inputs
    assert template["instanceType"] == "m7i.large" and "creditSpecification" not in template  # not burstable
    assert "head m7i.large on-demand" in run.outputs["costEstimate"]
    with pytest.raises(pulumi.RunError) as err:
        program(headInstanceType="p5.48xlarge")
    assert str(err.value).startswith("headInstanceType 'p5.48xlarge' is not a head type this project knows the price")
    assert "pulumi config set headInstanceType t3.medium" in str(err.value) and "\n" not in str(err.value)


def test_the_cost_estimate_adds_the_head_on_demand():
    without = cost.estimate("c6i.16xlarge", 2, availability_zone="us-east-1a", spot=False)
    with_head = cost.estimate("c6i.16xlarge", 2, availability_zone="us-east-1a", spot=False,
                              head_instance_type="t3.medium")
    assert with_head.total_usd_h - without.total_usd_h == pytest.approx(cost.head_usd_h("t3.medium"), abs=1e-4)
    assert cost.head_usd_h("t3.medium") == pytest.approx(0.0416 + 40 * 0.08 / 730 + 0.005, abs=1e-4)
    assert cost.HEAD_ROOT_GIB == MIN_ROOT_GIB
    assert "head" not in without.summary() and with_head.to_dict()["head_instance_type"] == "t3.medium"


def test_china_regions_get_aws_cn_arns_and_principals_everywhere(program):
    """No policy or trust the program writes names the 'aws' partition in aws-cn."""
    run = program(Recorder(offered_zones=("cn-north-1a",), partition="aws-cn"), region="cn-north-1")
    m = run.mocks
    documents = [p.inputs["policy"] for p in m.of("aws:iam/rolePolicy:RolePolicy")]
    documents += [r.inputs["assumeRolePolicy"] for r in m.of("aws:iam/role:Role")]
    documents += [p.inputs["policy"] for p in m.of("aws:s3/bucketPolicy:BucketPolicy")]
    documents += [p.inputs["policy"] for p in m.of("aws:iam/policy:Policy") + m.of("aws:kms/key:Key")]
    # node and head policies; node, head and build trusts; the bucket policy; the boundary; the key policy
    assert len(documents) == 8
    arns = [a for d in documents for a in _strings(json.loads(d)) if a.startswith("arn:")]
    assert arns and all(a.startswith("arn:aws-cn:") for a in arns), arns
    trusts = [json.loads(r.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] for r in m.of("aws:iam/role:Role")]
    assert trusts == [{"Service": "ec2.amazonaws.com.cn"}] * 3
    attached = [a.inputs["policyArn"] for a in m.of("aws:iam/rolePolicyAttachment:RolePolicyAttachment")]
    assert attached and all(a.startswith("arn:aws-cn:iam::aws:policy/") for a in attached)


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_the_head_takes_over_its_predecessors_chains_at_every_boot_through_a_real_unit(program):
    """A head is cattle: its user data installs xc-head-boot (node_setup/head_boot.py) and a systemd unit that runs it
    at every boot, as the login user, leaving the supervisors it starts running (KillMode=process). The AWS twin runs
    the same script when its head boots (tests/twin/test_twin.py)."""
    packed = base64.b64decode(program(clusterName="bert").mocks.named(LT, "bert-head").inputs["userData"])
    assert len(packed) < 16 * 1024 and packed[:2] == b"\x1f\x8b"  # EC2's limit; gzip, which cloud-init unpacks
    cloud = yaml.safe_load(gzip.decompress(packed).decode())
    files = {f["path"]: f for f in cloud["write_files"]}
    assert files["/usr/local/sbin/xc-head-boot"]["content"] == (ROOT / "node_setup" / "head_boot.py").read_text()
    assert files["/usr/local/sbin/xc-head-boot"]["permissions"] == "0755"
    unit = files["/etc/systemd/system/xc-head.service"]["content"].splitlines()
    for line in ("Type=oneshot", "RemainAfterExit=yes", "KillMode=process", "User=ubuntu",
                 "ExecStart=/usr/local/sbin/xc-head-boot", "WantedBy=multi-user.target"):
        assert line in unit, line
    assert cloud["runcmd"][-1] == ["systemctl", "enable", "--now", "xc-head.service"]


def test_the_heads_template_follows_a_new_bake_but_not_a_new_canonical_ami():
    """A re-bake deregisters the old AMI (infra/image.py): a head template that ignored the new image would name a
    deregistered AMI, and the head's replacement would fail with InvalidAMIID.NotFound for good."""
    from infra.head import template_ignores
    from infra.settings import ClusterSettings

    def ignores(image: str) -> list[str]:
        return template_ignores(ClusterSettings(admin_cidr="203.0.113.7/32", ssh_public_key=KEY, image=image))

    assert ignores("bake") == []
    assert ignores("base") == ["imageId"] and ignores("ami-0123456789abcdef0") == ["imageId"]
