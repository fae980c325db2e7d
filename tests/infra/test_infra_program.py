"""The Pulumi program under Pulumi's unit-test mocks (pulumi.runtime.set_mocks before infra is
imported): no CLI, no cloud, assertions on the inputs every resource would be created with.
"""
from __future__ import annotations

import base64
import fnmatch
import ipaddress
import json

import pulumi
import pytest
import yaml
from moto_fixture import isolate_aws
from pulumi_mocks import ACCOUNT, BAKED_AMI, BASE_AMI, KEY, ROOT, Recorder, make_program

from core import catalog
from core.constants import REMOTE_PYTHON
from infra import cost
from infra.image import BUILD_POLICIES, SCRIPT_PATH, component_document
from launch.life.head import HEARTBEAT
from node_setup import profiles
from training.runtime.paths import LOG_TAG, RunPaths
from training.runtime.store import PROBE_PREFIX

# pulumi_aws warns about a resource of its own we never use when its ec2 module loads.
pytestmark = pytest.mark.filterwarnings("ignore:.*EncryptionControl has been deprecated:DeprecationWarning")
LT = "aws:ec2/launchTemplate:LaunchTemplate"
GROUP = "aws:autoscaling/group:Group"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
SG = "aws:ec2/securityGroup:SecurityGroup"


@pytest.fixture
def program(monkeypatch, tmp_path):
    """Run __main__.py's main() with the given stack config; returns resources, invokes and outputs."""
    isolate_aws(monkeypatch, tmp_path)  # the cost lookup finds no credentials: catalog hint, no network
    return make_program()


def node_template(m: Recorder):
    (found,) = [r for r in m.of(LT) if r.name.endswith("-lt")]
    return found


def node_group(m: Recorder):
    (found,) = [r for r in m.of(GROUP) if r.name.endswith("-nodes")]
    return found


def role_policy(m: Recorder, role_name: str) -> list[dict]:
    role = m.named("aws:iam/role:Role", role_name)
    (policy,) = [p for p in m.of(ROLE_POLICY) if p.inputs["role"] == role.id]
    return json.loads(policy.inputs["policy"])["Statement"]


IMAGE_BUILDER = ("aws:imagebuilder/component:Component", "aws:imagebuilder/imageRecipe:ImageRecipe",
                 "aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration",
                 "aws:imagebuilder/image:Image", "aws:iam/role:Role", "aws:iam/instanceProfile:InstanceProfile",
                 "aws:iam/rolePolicyAttachment:RolePolicyAttachment")
NOT_BUILD = ("-node", "-head")  # the nodes' and the head's roles and profiles are no part of the image build


def test_security_group_admits_ssh_from_admin_only_and_the_rest_from_itself(program):
    run = program()
    sg = run.mocks.named(SG, "dev-sg")
    ingress = sg.inputs["ingress"]
    ssh = [r for r in ingress if r.get("cidrBlocks")]
    assert ssh == [{"description": "SSH from the operator", "protocol": "tcp", "fromPort": 22, "toPort": 22,
                    "cidrBlocks": ["203.0.113.7/32"]}]
    (from_head,) = [r for r in ingress if r.get("securityGroups")]  # tests/infra/test_head_infra.py: the head's group
    assert (from_head["protocol"], from_head["fromPort"], from_head["toPort"]) == ("tcp", 22, 22)
    intra = [r for r in ingress if not r.get("cidrBlocks") and r is not from_head]
    assert len(intra) == 1 and intra[0]["self"] is True and intra[0]["protocol"] == "-1"
    assert not intra[0].get("ipv6CidrBlocks") and not intra[0].get("securityGroups")
    assert all("0.0.0.0/0" not in r.get("cidrBlocks", []) for r in ingress)
    assert sg.inputs["egress"][0]["cidrBlocks"] == ["0.0.0.0/0"] and sg.inputs["egress"][0]["protocol"] == "-1"


def test_world_ssh_only_when_explicitly_allowed_and_nothing_else_opens(program):
    run = program(adminCidr="0.0.0.0/0", allowWorldSsh="true")
    for group in run.mocks.of(SG):  # the nodes' and the head's; the image build's admits nothing at all
        open_rules = [r for r in group.inputs["ingress"] if "0.0.0.0/0" in r.get("cidrBlocks", [])]
        expected = [] if group.name == "dev-build-sg" else [(22, 22, "tcp")]
        assert [(r["fromPort"], r["toPort"], r["protocol"]) for r in open_rules] == expected, group.name


def test_the_image_build_has_an_egress_only_group_of_its_own(program):
    """It runs pip and git downloads: no member of the nodes' group (every port open between members), no ingress."""
    m = program().mocks
    infra = m.one("aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration")
    build = m.named(SG, "dev-build-sg")
    assert infra.inputs["securityGroupIds"] == [build.id]
    assert build.inputs["ingress"] == [] and build.inputs["vpcId"] == m.named(SG, "dev-sg").inputs["vpcId"]
    assert [(e["protocol"], e["cidrBlocks"]) for e in build.inputs["egress"]] == [("-1", ["0.0.0.0/0"])]
    # nobody admits it either: the nodes' and the head's rules name only themselves and the head
    for group in (m.named(SG, "dev-sg"), m.named(SG, "dev-head-sg")):
        assert not [r for r in group.inputs["ingress"] if build.id in r.get("securityGroups", [])]
    # no bake, no build instance: no group for it
    assert not [g for g in program(image="base").mocks.of(SG) if g.name == "dev-build-sg"]


def test_every_role_the_program_makes_carries_the_permissions_boundary(program):
    """The deployer may write roles only with the boundary (docs/iam-policy-pulumi.json); the boundary holds what
    every role of the program is given (a node's, the head's, the build's) and nothing beyond the cluster's own."""
    from infra.policies import SSM_AGENT

    run = program()
    m = run.mocks
    boundary = m.one("aws:iam/policy:Policy")
    assert boundary.inputs["name"] == "xc-boundary-dev-us-east-1" and boundary.inputs["path"] == "/xeon-cluster/"
    arn = f"arn:aws:mock:::{boundary.name}"
    roles = m.of("aws:iam/role:Role")
    assert {r.name for r in roles} == {"dev-node", "dev-head", "dev-build"}
    assert all(r.inputs["permissionsBoundary"] == arn for r in roles), [r.inputs.get("permissionsBoundary")
                                                                        for r in roles]
    assert run.outputs["permissionsBoundary"] == arn
    assert all(run.depends_on(("aws:iam/role:Role", r.name), ("aws:iam/policy:Policy", boundary.name)) for r in roles)
    document = json.loads(boundary.inputs["policy"])
    allowed = document["Statement"]
    sids = [s["Sid"] for s in allowed]
    assert len(sids) == len(set(sids))
    assert len(boundary.inputs["policy"]) <= 6144  # a managed policy's limit (whitespace aside)

    def within(statement: dict) -> bool:
        def listed(v):
            return [v] if isinstance(v, str) else v
        return any(set(listed(statement["Action"])) <= set(listed(b["Action"])) and b.get("Condition") ==
                   statement.get("Condition") and all(any(fnmatch.fnmatchcase(r, w) for w in listed(b["Resource"]))
                                                      for r in listed(statement["Resource"])) for b in allowed)

    for role in ("dev-node", "dev-head"):
        for statement in role_policy(m, role):
            if statement["Sid"] == "DecryptSecretsWithTheClustersKey":  # by the key's ARN; the boundary: its alias
                (cap,) = [b for b in allowed if b["Sid"] == statement["Sid"]]
                assert cap["Condition"]["ForAnyValue:StringEquals"] == {"kms:ResourceAliases": [
                    "alias/xeon-cluster/dev"]} and fnmatch.fnmatchcase(statement["Resource"][0], cap["Resource"][0])
                continue
            assert within(statement), (role, statement["Sid"])
    # the build's managed policies pass but for ssm:GetParameter(s) on '*': AWS's public parameters only
    actions = {a for b in allowed for a in b["Action"]}
    assert set(SSM_AGENT) <= actions and {"imagebuilder:GetComponent", "logs:PutLogEvents"} <= actions
    gets = [b for b in allowed if "ssm:GetParameters" in b["Action"]]
    mine = f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/xeon-cluster/dev"
    assert all(r.startswith(("arn:aws:ssm:*:*:parameter/aws/service/", mine)) for b in gets for r in b["Resource"])
    # nothing of IAM, nothing that launches or passes a role, no '*' action
    assert not [a for a in actions if a.startswith(("iam:", "sts:")) or "*" in a or a == "ec2:RunInstances"]
    # no boundary-less role: image=base makes no build role, the other two carry it all the same
    base = program(image="base").mocks
    assert {r.name for r in base.of("aws:iam/role:Role")} == {"dev-node", "dev-head"}
    assert all(r.inputs["permissionsBoundary"] for r in base.of("aws:iam/role:Role"))



def test_launch_template_requires_imdsv2_and_encrypts_root_and_the_group_buys_spot(program):
    run = program(rootVolumeGib="200", maxSpotPrice="3.10")
    lt = node_template(run.mocks).inputs
    assert lt["metadataOptions"]["httpTokens"] == "required"
    assert lt["metadataOptions"]["httpPutResponseHopLimit"] == 1
    (root,) = lt["blockDeviceMappings"]
    assert root["deviceName"] == "/dev/sda1"  # the AMI's own root device, looked up
    assert root["ebs"] == {"volumeSize": 200, "volumeType": "gp3", "encrypted": "true", "deleteOnTermination": "true"}
    assert "instanceMarketOptions" not in lt  # an Auto Scaling group with a mixed policy refuses it
    assert lt["instanceType"] == "r7iz.16xlarge"
    policy = node_group(run.mocks).inputs["mixedInstancesPolicy"]
    assert policy["instancesDistribution"] == {
        "onDemandBaseCapacity": 0, "onDemandPercentageAboveBaseCapacity": 0,
        "spotAllocationStrategy": "capacity-optimized", "spotMaxPrice": "3.10"}
    cloud_config = base64.b64decode(lt["userData"]).decode()
    assert cloud_config.startswith("#cloud-config\n")
    parsed = yaml.safe_load(cloud_config)
    env = next(f["content"] for f in parsed["write_files"] if f["path"] == "/etc/xeon-cluster/cluster.env")
    assert "XC_CLUSTER=dev\n" in env and "XC_PROFILE=upstream\n" in env
    (ami_lookup,) = [c for c in run.mocks.calls if c[0] == "aws:ec2/getAmi:getAmi"]
    assert ami_lookup[1]["filters"] == [{"name": "image-id", "values": [BAKED_AMI]}]


def test_on_demand_has_no_spot_in_the_group(program):
    run = program(spot="false", nodeCount="3")
    assert "instanceMarketOptions" not in node_template(run.mocks).inputs
    group = node_group(run.mocks).inputs
    assert group["mixedInstancesPolicy"]["instancesDistribution"] == {
        "onDemandBaseCapacity": 3, "onDemandPercentageAboveBaseCapacity": 100}
    assert group["capacityRebalance"] is False


def test_capacity_rebalance_is_the_stacks_choice(program):
    """capacityRebalance true hands rebalance recommendations to the group (it replaces the node at once)."""
    assert node_group(program(capacityRebalance="true").mocks).inputs["capacityRebalance"] is True


def test_one_self_replacing_group_holds_the_nodes_in_one_zone_and_placement_group(program):
    run = program(nodeCount="3", availabilityZone="us-east-1c", clusterName="bert",
                  fallbackInstanceTypes="r7iz.metal-16xl")
    m = run.mocks
    subnet = m.one("aws:ec2/subnet:Subnet")
    assert subnet.inputs["availabilityZone"] == "us-east-1c"
    group = m.one("aws:ec2/placementGroup:PlacementGroup")
    assert group.inputs["strategy"] == "cluster"
    assert not m.of("aws:ec2/instance:Instance") and not m.of("aws:ec2/fleet:Fleet")
    lt = node_template(m)
    (nic,) = lt.inputs["networkInterfaces"]
    assert "subnetId" not in nic  # the group's subnet list places the nodes
    assert nic["securityGroups"] == [m.named(SG, "bert-sg").id]
    asg = node_group(m).inputs
    assert (asg["minSize"], asg["maxSize"], asg["desiredCapacity"]) == (3, 3, 3)
    assert asg["vpcZoneIdentifiers"] == [subnet.id] and asg["placementGroup"] == group.inputs["name"] == "bert-us-east-1c"
    # off by default: a rebalance recommendation checkpoints and trains on instead of ending the run
    assert asg["healthCheckType"] == "EC2" and asg["capacityRebalance"] is False
    template = asg["mixedInstancesPolicy"]["launchTemplate"]
    assert template["launchTemplateSpecification"] == {"launchTemplateId": lt.id, "version": "3"}
    assert template["overrides"] == [{"instanceType": "r7iz.16xlarge"}, {"instanceType": "r7iz.metal-16xl"}]
    # a changed template rolls the nodes without ever running more than the target count
    assert asg["instanceRefresh"] == {"strategy": "Rolling", "preferences": {
        "minHealthyPercentage": 50, "maxHealthyPercentage": 100, "skipMatching": True}}
    assert {t["key"]: (t["value"], t["propagateAtLaunch"]) for t in asg["tags"]} == {
        "Name": ("bert-node", True), "xeon-cluster:cluster": ("bert", True), "xeon-cluster:stack": ("dev", True),
        "xeon-cluster:role": ("worker", True), "xeon-cluster:ssh-user": ("ubuntu", True),
        "xeon-cluster:profile": ("upstream", True), "xeon-cluster:image": ("bake", True),
        # the bucket its nodes write, on the group only: fab sweep never empties a live group's store
        "xeon-cluster:store": (m.one("aws:s3/bucket:Bucket").id, False)}


@pytest.mark.parametrize("old, new", [("us-east-1a", "us-east-1b"), ("us-east-1a", "us-east-1c"),
                                      ("us-east-1b", "us-east-1d"), ("us-east-1c", "us-east-1f")])
def test_a_zone_move_makes_a_subnet_that_does_not_overlap_and_a_new_placement_group(program, old, new):
    """Issues 26 item 4 and 41 item 10: the new subnet is created before the old one goes, so the two must not
    overlap, whichever two zone letters (a->c and b->d collided when the VPC was cut in halves by parity)."""
    zones = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f")

    def net(zone):
        m = program(Recorder(offered_zones=zones), availabilityZone=zone).mocks
        return (ipaddress.ip_network(m.one("aws:ec2/subnet:Subnet").inputs["cidrBlock"]),
                m.one("aws:ec2/placementGroup:PlacementGroup").inputs["name"])

    (a, pg_a), (b, pg_b) = net(old), net(new)
    assert not a.overlaps(b) and pg_a != pg_b
    assert a.subnet_of(ipaddress.ip_network("10.42.0.0/16")) and b.subnet_of(ipaddress.ip_network("10.42.0.0/16"))
    assert a.prefixlen == b.prefixlen == 19  # an eighth of the /16 per zone letter


def test_a_zone_move_replaces_the_groups_old_one_first_so_one_pulumi_up_succeeds(program):
    """A zone move changes the nodes' subnet and placement group. The group is replaced, deleted
    first (its nodes drain through the hook inside it, so a run checkpoints), and Pulumi deletes the old subnet and
    placement group only after that, when nothing is left in them; the head's group likewise."""
    run = program()
    nodes, head = run.monitor.options("dev-nodes"), run.monitor.options((GROUP, "dev-head"))
    assert nodes.delete_before_replace and {"vpcZoneIdentifiers", "placementGroup"} <= set(nodes.replace_on_changes)
    assert "initialLifecycleHooks" in nodes.replace_on_changes  # a changed hook is in a new group, never lost
    assert head.delete_before_replace and "vpcZoneIdentifiers" in head.replace_on_changes
    subnet = run.mocks.one("aws:ec2/subnet:Subnet").name
    pg = run.mocks.one("aws:ec2/placementGroup:PlacementGroup").name
    # the groups use the subnet (and placement group), so Pulumi deletes those after the groups' replacement
    assert run.depends_on("dev-nodes", subnet) and run.depends_on("dev-nodes", pg)
    assert run.depends_on((GROUP, "dev-head"), subnet)
    # the subnet and placement group themselves are replaced create-before-delete (a new CIDR, a new name)
    assert not run.monitor.options(subnet).delete_before_replace and not run.monitor.options(pg).delete_before_replace


def test_fallback_types_of_another_shape_are_refused(program):
    with pytest.raises(pulumi.RunError, match=r"fallbackInstanceTypes: c6i.16xlarge \(64 vCPUs, 128 GiB\) is not the "
                                              r"shape of r7iz.16xlarge \(64 vCPUs, 512 GiB\)"):
        program(fallbackInstanceTypes="c6i.16xlarge")


def test_a_zone_without_the_instance_type_is_refused_naming_the_zones_that_offer_it(program):
    with pytest.raises(pulumi.RunError) as err:
        program(Recorder(offered_zones=("us-east-1b", "us-east-1d")))
    assert str(err.value) == ("r7iz.16xlarge is not offered in us-east-1a (offered in: us-east-1b, us-east-1d); "
                              "run 'pulumi config set availabilityZone us-east-1b'")
    with pytest.raises(pulumi.RunError, match="offered in: no zone of us-east-1"):
        program(Recorder(offered_zones=()))


def test_a_zone_without_the_build_instance_type_is_refused_at_preview(program):
    """image=bake launches buildInstanceType in the zone: a zone without it failed inside Image Builder after
    minutes; the preview's check now names it."""
    no_build = Recorder(zones_of={"c6i.2xlarge": ("us-east-1b",)})
    with pytest.raises(pulumi.RunError) as err:
        program(no_build)
    assert str(err.value).startswith("buildInstanceType c6i.2xlarge is not offered in us-east-1a (offered in: "
                                     "us-east-1b); run 'pulumi config set buildInstanceType'")
    program(Recorder(zones_of={"c6i.2xlarge": ("us-east-1b",)}), image="base")  # no build instance: no check


def test_a_zone_without_the_head_type_is_refused_at_preview(program):
    """The head's group of one launches headInstanceType in the zone: without it `pulumi up` failed only after the
    group's capacity wait (10 minutes)."""
    with pytest.raises(pulumi.RunError) as err:
        program(Recorder(zones_of={"t3.medium": ("us-east-1b",)}))
    assert str(err.value).startswith("headInstanceType t3.medium is not offered in us-east-1a (offered in: "
                                     "us-east-1b); run 'pulumi config set headInstanceType'")
    program(Recorder(zones_of={"t3.medium": ("us-east-1b",)}), headInstanceType="m6i.large")


def test_policy_arns_follow_the_partition(program):
    run = program(Recorder(offered_zones=("us-gov-west-1a",), partition="aws-us-gov"), region="us-gov-west-1")
    arns = sorted(a.inputs["policyArn"] for a in run.mocks.of("aws:iam/rolePolicyAttachment:RolePolicyAttachment"))
    assert arns == sorted(f"arn:aws-us-gov:iam::aws:policy/{p}" for p in BUILD_POLICIES)


def test_quota_and_rolling_lines_name_the_figures():
    from infra import checks
    from infra.settings import ClusterSettings

    settings = ClusterSettings(admin_cidr="203.0.113.7/32", ssh_public_key=KEY, node_count=4,
                               instance_type="c6i.16xlarge", fallback_instance_types="c7i.16xlarge")
    assert checks.quota_line(settings).startswith(
        "the nodes need 256 spot vCPUs of quota L-34B43A08 and the head 2 on-demand vCPUs of quota L-1216C47A in "
        "us-east-1;")
    on_demand = ClusterSettings(admin_cidr="203.0.113.7/32", ssh_public_key=KEY, node_count=2, spot=False,
                                instance_type="c6i.2xlarge", head_instance_type="t3.xlarge")
    assert checks.quota_line(on_demand).startswith(
        "the nodes and the head need 20 on-demand vCPUs (16 + 4) of quota L-1216C47A in us-east-1;")
    from core import catalog
    assert set(catalog.HEAD_VCPUS) == set(catalog.HEAD_USD_H)  # every head type a stack may take has its vCPUs
    assert checks.rolling_line(("image",), 4, 50).startswith(
        "changing any of image rolls the nodes (instance refresh: 2 of 4 at a time, never more than 4 running)")
    # a run on rolled nodes checkpoints at the termination hook (the line once said it fails)
    assert checks.rolling_line(("image",), 4, 50).endswith(
        "a run in progress on them checkpoints at the termination hook and ends preempted: 'fab train --resume "
        "RUN_ID' (or --max-restarts) continues it")


def test_bake_mode_feeds_the_image_builder_ami_into_the_launch_template(program):
    run = program()
    m = run.mocks
    component = m.one("aws:imagebuilder/component:Component")
    assert component.inputs["data"] == component_document("upstream")
    recipe = m.one("aws:imagebuilder/imageRecipe:ImageRecipe")
    assert recipe.inputs["parentImage"] == "ssm:/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/" \
                                           "ebs-gp3/ami-id"
    assert recipe.inputs["components"] == [{"componentArn": f"arn:aws:mock:::{component.name}"}]
    assert recipe.inputs["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
    infra = m.one("aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration")
    profile = m.named("aws:iam/instanceProfile:InstanceProfile", "dev-build")
    assert infra.inputs["instanceProfileName"] == profile.name
    assert infra.inputs["subnetId"] == m.one("aws:ec2/subnet:Subnet").id
    assert "xeon-cluster:cluster" not in infra.inputs["resourceTags"]  # the build instance is no node
    image = m.one("aws:imagebuilder/image:Image")
    assert image.inputs["imageRecipeArn"] == f"arn:aws:mock:::{recipe.name}"
    assert image.inputs["infrastructureConfigurationArn"] == f"arn:aws:mock:::{infra.name}"
    # least privilege: exactly the two managed policies Image Builder documents, nothing inline
    role = m.named("aws:iam/role:Role", "dev-build")
    assert json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert not [p for p in m.of("aws:iam/rolePolicy:RolePolicy") if p.inputs["role"] == role.id]
    assert sorted(a.inputs["policyArn"] for a in m.of("aws:iam/rolePolicyAttachment:RolePolicyAttachment")) == \
        sorted(f"arn:aws:iam::aws:policy/{p}" for p in BUILD_POLICIES)
    assert node_template(m).inputs["imageId"] == BAKED_AMI
    assert run.outputs["amiId"] == BAKED_AMI
    # nothing left billed: the build log expires, and the AMI (with its snapshot) leaves with the stack
    logs = m.one("aws:cloudwatch/logGroup:LogGroup").inputs
    assert logs["name"] == f"/aws/imagebuilder/{recipe.inputs['name']}" and logs["retentionInDays"] == 30
    (cleanup,) = [r for r in m.resources if r.type == "pulumi-python:dynamic:Resource"]
    assert cleanup.inputs["ami_id"] == BAKED_AMI and cleanup.inputs["region"] == "us-east-1"


def test_base_mode_uses_ubuntu_from_ssm_and_builds_no_image(program):
    run = program(image="base", ubuntuVersion="22.04", profile="oneccl")  # 22.04 has Python 3.10: the old stack
    assert not [r for r in run.mocks.resources if r.type in IMAGE_BUILDER and not r.name.endswith(NOT_BUILD)]
    lookups = [c for c in run.mocks.calls if c[0] == "aws:ssm/getParameter:getParameter"]
    assert len(lookups) == 2  # the nodes' AMI and the head's, both Canonical's
    assert {c[1]["name"] for c in lookups} == {
        "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"}
    assert node_template(run.mocks).inputs["imageId"] == BASE_AMI
    assert not run.mocks.of("pulumi-python:dynamic:Resource")  # Canonical's AMI is not ours to delete
    assert run.outputs["latestBaseAmiId"] == BASE_AMI


def test_base_mode_pins_the_ami_it_first_resolved():
    from infra.nodes import template_options
    from infra.settings import ClusterSettings

    def opts(image):
        settings = ClusterSettings(admin_cidr="203.0.113.7/32", ssh_public_key=KEY, image=image)
        return template_options(settings, None).ignore_changes

    assert opts("base") == ["imageId"]  # a new Canonical AMI does not roll the nodes by itself
    assert opts("bake") == [] and opts("ami-0123456789abcdef0") == []


def test_explicit_ami_is_used_as_is(program):
    run = program(image="ami-0123456789abcdef0")
    assert not [r for r in run.mocks.resources if r.type in IMAGE_BUILDER and not r.name.endswith(NOT_BUILD)]
    # the only Ubuntu lookup is the head's: the nodes boot the operator's AMI
    (lookup,) = [c for c in run.mocks.calls if c[0] == "aws:ssm/getParameter:getParameter"]
    assert lookup[1]["name"].startswith("/aws/service/canonical/ubuntu/server/24.04/")
    assert node_template(run.mocks).inputs["imageId"] == "ami-0123456789abcdef0"


def test_components_own_their_children_and_one_provider_serves_all(program):
    run = program(nodeCount="2")
    owners = {"aws:ec2/vpc:Vpc": "Network", "aws:ec2/securityGroup:SecurityGroup": "Network",
              "aws:ec2/placementGroup:PlacementGroup": "Network", "aws:imagebuilder/image:Image": "Image",
              "aws:iam/role:Role": "Image", LT: "Nodes", GROUP: "Nodes", "aws:ec2/keyPair:KeyPair": "Nodes",
              "aws:cloudwatch/logGroup:LogGroup": "Image"}
    for typ, component in owners.items():
        urns = [u for u in run.urns() if (f"::{typ}::" in u or f"${typ}::" in u) and not u.endswith(("::dev-node",
                                                                                                      "::dev-head"))]
        assert urns and all(f"xeon-cluster:infra:{component}${typ}::" in u for u in urns), (typ, urns)
    head = [u for u in run.urns() if u.endswith("::dev-head")]
    assert len(head) == 5 and all("xeon-cluster:infra:Head$" in u for u in head)  # role, policy, profile, LT, group
    provider = run.mocks.one("pulumi:providers:aws")
    assert provider.inputs["region"] == "us-east-1"
    assert json.loads(provider.inputs["defaultTags"]) == {"tags": {"xeon-cluster:cluster": "dev", "xeon-cluster:stack": "dev"}}
    for res in run.mocks.resources:
        if res.type.startswith("aws:"):
            assert res.provider and "pulumi:providers:aws::aws" in res.provider, res.type
    assert all("pulumi:providers:aws::aws" in (c[2] or "") for c in run.mocks.calls)


def test_nodes_have_a_termination_hook_and_a_role_scoped_to_their_own_group(program):
    """Capacity rebalancing and instance refreshes terminate nodes with no spot notice: a termination lifecycle
    hook holds a leaving node (default CONTINUE), and its role may complete that action on its own group only."""
    run = program(nodeCount="2")
    m = run.mocks
    group = node_group(m)
    assert not m.of("aws:autoscaling/lifecycleHook:LifecycleHook")  # in the group itself, from its creation
    (hook,) = group.inputs["initialLifecycleHooks"]
    assert hook["lifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
    assert hook["defaultResult"] == "CONTINUE" and hook["heartbeatTimeout"] >= 120
    assert group.inputs["name"] == "dev-nodes"
    role = m.named("aws:iam/role:Role", "dev-node")
    assert json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    statements = role_policy(m, "dev-node")
    (lifecycle,) = [s for s in statements if "autoscaling:CompleteLifecycleAction" in s["Action"]]
    # complete it, or keep it alive with heartbeats while the checkpoint uploads
    assert lifecycle["Action"] == ["autoscaling:CompleteLifecycleAction", "autoscaling:RecordLifecycleActionHeartbeat"]
    # the group's ARN from its name: the policy exists before the group, which waits for it
    assert lifecycle["Resource"] == [
        f"arn:aws:autoscaling:us-east-1:{ACCOUNT}:autoScalingGroup:*:autoScalingGroupName/dev-nodes"]
    policy = (ROLE_POLICY, "dev-node")
    assert run.depends_on("dev-nodes", policy) and not run.depends_on(policy, "dev-nodes")
    assert all(not a.endswith("*") for s in statements for a in s["Action"])  # no wildcard action
    profile = m.named("aws:iam/instanceProfile:InstanceProfile", "dev-node")
    template = node_template(m).inputs
    assert template["iamInstanceProfile"] == {"arn": f"arn:aws:mock:::{profile.name}"}
    assert template["metadataOptions"]["httpPutResponseHopLimit"] == 1 and template["metadataOptions"]["httpTokens"] == "required"
    user_data = base64.b64decode(template["userData"]).decode()
    assert "XC_ASG_NAME=dev-nodes" in user_data and f"XC_LIFECYCLE_HOOK={hook['name']}" in user_data


def test_nodes_publish_their_host_keys_as_tags_of_themselves_only(program):
    """Bare metal has no Latest console output: each node tags itself with its host keys at first boot."""
    run = program(nodeCount="2")
    template = node_template(run.mocks).inputs
    user_data = base64.b64decode(template["userData"]).decode()
    assert len(user_data.encode()) < 16 * 1024  # EC2's limit for user data
    cloud = yaml.safe_load(user_data)
    (publisher,) = [f for f in cloud["write_files"] if f["path"] == "/usr/local/sbin/xc-publish-host-keys"]
    assert publisher["content"] == (ROOT / "node_setup" / "publish_host_keys.py").read_text()
    assert publisher["permissions"] == "0755"
    assert cloud["runcmd"] == [["/usr/local/sbin/xc-name-node"], ["/usr/local/sbin/xc-publish-host-keys"]]
    (tagging,) = [s for s in role_policy(run.mocks, "dev-node") if "ec2:CreateTags" in s["Action"]]
    instances = f"arn:aws:ec2:us-east-1:{ACCOUNT}:instance"
    assert tagging["Action"] == ["ec2:CreateTags"] and tagging["Resource"] == [f"{instances}/*"]
    assert tagging["Condition"] == {
        "ArnEquals": {"ec2:SourceInstanceARN": f"{instances}/${{ec2:InstanceID}}"},  # itself only
        "StringEquals": {"aws:ResourceTag/xeon-cluster:cluster": "dev"},
        "ForAllValues:StringLike": {"aws:TagKeys": ["xeon-cluster:host-key:*"]}}  # no other tag, no role tag


def test_nodes_read_only_the_mesh_keys_public_half_to_authorize_it_at_boot(program):
    """A node the group launches while the operator is away authorizes the head's mesh key at boot: its
    cluster.env names the public half's parameter, which is all of SSM its role may read (never the private
    SecureString beside it, nor the run secrets: user code runs on nodes)."""
    run = program(nodeCount="2")
    env = node_env_of(run.mocks)
    assert env["XC_MESH_KEY_PARAMETER"] == "/xeon-cluster/dev/mesh-key.pub" and env["XC_SSH_USER"] == "ubuntu"
    ssm = [s for s in role_policy(run.mocks, "dev-node") if any(a.startswith("ssm:") for a in s["Action"])]
    assert ssm == [{"Sid": "ReadMeshPublicKey", "Effect": "Allow", "Action": ["ssm:GetParameter"],
                    "Resource": [f"arn:aws:ssm:us-east-1:{ACCOUNT}:parameter/xeon-cluster/dev/mesh-key.pub"]}]
    from cluster import mesh

    assert mesh.parameter("dev") + ".pub" == env["XC_MESH_KEY_PARAMETER"]  # what fab puts is what nodes read


def node_env_of(m) -> dict[str, str]:
    cloud = yaml.safe_load(base64.b64decode(node_template(m).inputs["userData"]).decode())
    text = next(f["content"] for f in cloud["write_files"] if f["path"] == "/etc/xeon-cluster/cluster.env")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


STORE_PROTECTIONS = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
                     "aws:s3/bucketVersioning:BucketVersioning", "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",
                     "aws:s3/bucketOwnershipControls:BucketOwnershipControls", "aws:s3/bucketPolicy:BucketPolicy",
                     "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")


def test_the_store_bucket_is_private_encrypted_versioned_and_kept_with_its_protections(program):
    run = program(nodeCount="2", checkpointRetentionDays="7")
    m = run.mocks
    bucket = m.one("aws:s3/bucket:Bucket")
    assert bucket.inputs["bucketPrefix"].startswith("xc-dev-") and bucket.inputs.get("forceDestroy") is not True
    # pulumi destroy keeps the bucket and everything that protects it, and nothing else
    protections = {m.one(typ).name for typ in STORE_PROTECTIONS}
    assert {name for name, kept in run.monitor.retained.items() if kept} == {bucket.name, *protections}
    assert all(m.one(typ).inputs["bucket"] == bucket.id for typ in STORE_PROTECTIONS)
    sse = m.one(STORE_PROTECTIONS[0]).inputs
    assert sse["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"
    assert m.one("aws:s3/bucketVersioning:BucketVersioning").inputs["versioningConfiguration"] == {"status": "Enabled"}
    block = m.one("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    assert all(block[k] is True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                          "restrictPublicBuckets"))
    owner = m.one("aws:s3/bucketOwnershipControls:BucketOwnershipControls").inputs
    assert owner["rule"]["objectOwnership"] == "BucketOwnerEnforced"
    tls = json.loads(m.one("aws:s3/bucketPolicy:BucketPolicy").inputs["policy"])["Statement"][0]
    assert tls["Effect"] == "Deny" and tls["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    life = m.one("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    assert run.depends_on(life.name, m.one("aws:s3/bucketVersioning:BucketVersioning").name)
    rules = {r["id"]: r for r in life.inputs["rules"]}
    checkpoints = rules["expire-checkpoints"]
    assert checkpoints["expiration"]["days"] == 7
    assert checkpoints["filter"]["and"] == {"prefix": "dev/runs/", "tags": {"xeon-cluster-kind": "checkpoint"}}
    assert checkpoints["noncurrentVersionExpiration"] == {"noncurrentDays": 1}  # a replaced checkpoint: one day
    assert rules["expire-noncurrent-versions"]["noncurrentVersionExpiration"]["noncurrentDays"] == 30
    # logs and heartbeats, tagged as they are written: their old versions last a day
    logs = rules["expire-noncurrent-logs"]
    assert logs["noncurrentVersionExpiration"] == {"noncurrentDays": 1}
    (key, value), = logs["filter"]["and"]["tags"].items()
    assert f"{key}={value}" == LOG_TAG and logs["filter"]["and"]["prefix"] == "dev/runs/"
    assert rules["remove-expired-delete-markers"]["expiration"] == {"expiredObjectDeleteMarker": True}
    assert rules["abort-incomplete-uploads"]["abortIncompleteMultipartUpload"]["daysAfterInitiation"] == 1
    assert all(r["status"] == "Enabled" for r in rules.values())
    assert run.outputs["storeUrl"] == f"s3://{bucket.id}/dev"


def test_pulumi_up_after_destroy_adopts_the_kept_bucket_instead_of_making_a_second(program):
    """`storeBucket` names the bucket 'pulumi destroy' kept; the program imports it (its name, no
    prefix), keeps it on the next destroy, and writes its protections again. Without it: a new bucket."""
    run = program(storeBucket="xc-dev-20261127abcd")
    bucket = run.mocks.one("aws:s3/bucket:Bucket")
    assert bucket.inputs["bucket"] == "xc-dev-20261127abcd" and "bucketPrefix" not in bucket.inputs
    options = run.monitor.options(("aws:s3/bucket:Bucket", bucket.name))
    assert options.import_id == "xc-dev-20261127abcd" and options.retain_on_delete
    assert all(run.mocks.one(typ).inputs["bucket"] == bucket.id for typ in STORE_PROTECTIONS)
    assert not [o for (typ, _), o in run.monitor.by_key.items() if o.import_id and typ != "aws:s3/bucket:Bucket"]
    fresh = program()
    new = fresh.mocks.one("aws:s3/bucket:Bucket")
    assert "bucket" not in new.inputs and fresh.monitor.options(("aws:s3/bucket:Bucket", new.name)).import_id == ""
    with pytest.raises(pulumi.RunError) as err:  # fab's and the nodes' policies reach xc-* buckets only
        program(storeBucket="my-team-data")
    assert str(err.value).startswith("storeBucket 'my-team-data' is not a store bucket's name")
    assert "pulumi config set storeBucket" in str(err.value) and "\n" not in str(err.value)


def test_nodes_write_only_checkpoints_outputs_and_the_probe_and_delete_only_checkpoints_and_the_probe(program):
    """User code on a node must not delete a run's outputs and records, nor any
    version, nor write a record (summary, log, heartbeat) of any run: those are the head's and the operator's."""
    run = program(nodeCount="2")
    m = run.mocks
    bucket = m.one("aws:s3/bucket:Bucket")
    store = [s for s in role_policy(m, "dev-node") if any(a.startswith("s3:") for a in s["Action"])]
    arn = f"arn:aws:s3:::{bucket.id}"
    (reads,) = [s for s in store if "s3:GetObject" in s["Action"]]
    assert reads["Action"] == ["s3:GetObject"] and reads["Resource"] == [f"{arn}/dev/*"]  # resume reads any of it
    (writes,) = [s for s in store if "s3:PutObject" in s["Action"]]
    assert writes["Action"] == ["s3:PutObject", "s3:PutObjectTagging", "s3:AbortMultipartUpload"]
    assert writes["Resource"] == [f"{arn}/dev/runs/*/checkpoints/*", f"{arn}/dev/runs/*/output/*",
                                  f"{arn}/dev/.xc-probe/*"]
    deletes = [s for s in store if "s3:DeleteObject" in s["Action"]]
    assert [s["Action"] for s in deletes] == [["s3:DeleteObject"]]
    assert deletes[0]["Resource"] == [f"{arn}/dev/runs/*/checkpoints/*", f"{arn}/dev/.xc-probe/*"]
    assert not [a for s in store for a in s["Action"] if "Version" in a or a in ("s3:*", "*")]
    listing = next(s for s in store if s["Action"] == ["s3:ListBucket"])
    assert listing["Resource"] == [arn] and listing["Condition"]["StringLike"]["s3:prefix"] == ["dev", "dev/*"]
    # the keys the nodes' own code writes (IAM's '*' spans '/', as fnmatch's does) against those it must not
    paths = RunPaths("r1")
    written = [paths.store_checkpoint(40) + "/model.safetensors", paths.store_output + "/eval/results.json",
               PROBE_PREFIX + "abc"]
    for key in written:
        assert any(fnmatch.fnmatchcase(f"{arn}/dev/{key}", r) for r in writes["Resource"]), key
    for key in [paths.store_record(n) for n in ("summary.json", "log.txt", "results.json", HEARTBEAT)]:
        assert not any(fnmatch.fnmatchcase(f"{arn}/dev/{key}", r) for r in writes["Resource"]), key


def test_outputs_name_the_cluster_and_its_group_and_cost(program):
    run = program(nodeCount="2", instanceType="c6i.16xlarge", rootVolumeGib="100", clusterName="bert")
    out = run.outputs
    assert (out["clusterName"], out["region"], out["nodeCount"], out["spot"]) == ("bert", "us-east-1", 2, True)
    assert out["autoScalingGroup"] == "bert-nodes" and out["sshUser"] == "ubuntu"
    assert out["headAutoScalingGroup"] == "bert-head" and out["headSshUser"] == "ubuntu"
    assert out["instanceTypes"] == ["c6i.16xlarge"] and out["secretsPath"] == "/xeon-cluster/bert"
    assert out["secretsKeyAlias"] == "alias/xeon-cluster/bert" and out["secretsKeyArn"]
    # no AWS credentials here: the estimate falls back to the catalog's on-demand price; the head is on-demand
    extras = 2 * (100 * cost.GP3_USD_PER_GIB_MONTH / cost.HOURS_PER_MONTH + cost.PUBLIC_IPV4_USD_H)
    head = 0.0416 + cost.HEAD_ROOT_GIB * cost.GP3_USD_PER_GIB_MONTH / cost.HOURS_PER_MONTH + cost.PUBLIC_IPV4_USD_H
    assert out["hourlyCostUsd"] == pytest.approx(
        2 * catalog.lookup("c6i.16xlarge").on_demand_usd_h + extras + head, abs=1e-3)
    assert "2 x c6i.16xlarge spot" in out["costEstimate"] and "+ head t3.medium on-demand $0.0510/h" in \
        out["costEstimate"]


def test_invalid_config_fails_with_one_line_before_any_resource(program):
    with pytest.raises(pulumi.RunError) as err:
        program(adminCidr="0.0.0.0/0")
    assert str(err.value).startswith("adminCidr 0.0.0.0/0 opens SSH to the whole internet")
    assert "\n" not in str(err.value)


def test_component_document_embeds_exactly_the_setup_script_fab_setup_runs():
    for name in ("oneccl", "upstream"):
        document = yaml.safe_load(component_document(name))
        build = next(p for p in document["phases"] if p["name"] == "build")
        write = next(s for s in build["steps"] if s["action"] == "CreateFile")
        (spec,) = write["inputs"]
        assert spec["path"] == SCRIPT_PATH
        assert spec["content"] == profiles.render_setup_script(name)
        run_step = next(s for s in build["steps"] if s["action"] == "ExecuteBash")
        assert run_step["inputs"]["commands"] == [f"bash {SCRIPT_PATH}"]
        validate = next(p for p in document["phases"] if p["name"] == "validate")
        marker_check, torch_check = validate["steps"][0]["inputs"]["commands"]
        spec = profiles.load_profile(name)
        assert marker_check == f'test "$(cat {spec.venv}/{profiles.MARKER_NAME})" = {spec.hash}'
        assert torch_check.startswith(REMOTE_PYTHON + " -c")  # the python every Node runs jobs with


@pytest.mark.parametrize("change", [{"spot": "false"}, {"maxSpotPrice": "2.50"}, {"sshUser": "admin"}])
def test_spot_price_and_ssh_user_changes_reach_the_launch_template_so_the_nodes_roll(program, change):
    """An instance refresh with skip_matching replaces only nodes whose template differs: spot, maxSpotPrice
    and sshUser used to change only the group's distribution or tags, so 'spot false' left the nodes on spot."""
    def template(**config):
        lt = node_template(program(**config).mocks).inputs
        return json.dumps(lt["tagSpecifications"], sort_keys=True)

    assert template(**change) != template()


def readme_aws_commands() -> list[str]:
    """The README's AWS block: the indented lines from the one that makes the ops venv to `pulumi destroy`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("make venv-ops"))
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line.split("  #")[0].strip())
    return block


def test_the_readmes_aws_commands_get_a_fresh_stack_past_configuration(program):
    """The README's first AWS commands, in order, on a fresh stack: its `pulumi config set` lines are the only
    settings, and the program under mocks plans every piece (a missing required setting raises RunError)."""
    commands = readme_aws_commands()
    order = ["pulumi stack init", "pulumi up", "fab train --nodes 4", "pulumi destroy"]
    at = [next(i for i, c in enumerate(commands) if c.startswith(o)) for o in order]
    assert at == sorted(at), commands
    shell = {'"$(curl -s https://checkip.amazonaws.com)/32"': "203.0.113.7/32",  # what each substitution prints
             '"$(cat ~/.ssh/id_ed25519.pub)"': KEY}
    config = {}
    for c in commands:
        if c.startswith("pulumi config set "):
            key, value = c.removeprefix("pulumi config set ").split(" ", 1)
            config[key] = shell.get(value, value)
    assert set(config) >= {"adminCidr", "sshPublicKey"}, commands
    run = program(required={}, **config)
    assert run.mocks.of(GROUP) and run.outputs["nodeCount"] == 4
    with pytest.raises(pulumi.RunError, match="adminCidr"):  # and the same stack without them would stop here
        program(required={})
