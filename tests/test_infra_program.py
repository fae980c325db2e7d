"""The Pulumi program under Pulumi's unit-test mocks (pulumi.runtime.set_mocks before infra is
imported): no CLI, no cloud, assertions on the inputs every resource would be created with.
"""
from __future__ import annotations

import base64
import json
import runpy
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pytest
import yaml

BAKED_AMI = "ami-0baked00000000000"
BASE_AMI = "ami-0ubuntu0000000000"
ROOT = Path(__file__).resolve().parent.parent
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp9fX1kZXZlbG9wZXIta2V5LWZvci10ZXN0cw operator@laptop"
REQUIRED = {"adminCidr": "203.0.113.7/32", "sshPublicKey": KEY}
# pulumi_aws warns about a resource of its own we never use when its ec2 module loads.
pytestmark = pytest.mark.filterwarnings("ignore:.*EncryptionControl has been deprecated:DeprecationWarning")


@dataclass
class Res:
    type: str
    name: str
    inputs: dict
    id: str
    provider: str | None


class Recorder(pulumi.runtime.Mocks):
    """Records every resource and invoke; answers with the computed outputs AWS would return."""

    def __init__(self):
        self.resources: list[Res] = []
        self.calls: list[tuple[str, dict, str]] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        outputs = dict(args.inputs)
        if args.typ == "aws:imagebuilder/image:Image":
            outputs["outputResources"] = [{"amis": [{"image": BAKED_AMI, "region": "us-east-1"}]}]
        elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            outputs["latestVersion"] = 3
        elif args.typ == "aws:ec2/instance:Instance":
            n = len(self.of("aws:ec2/instance:Instance"))
            outputs.update(publicIp=f"198.51.100.{10 + n}", privateIp=f"10.42.0.{10 + n}")
        elif args.typ == "aws:ec2/keyPair:KeyPair":
            outputs["keyName"] = args.name
        outputs.setdefault("name", args.name)
        outputs.setdefault("arn", f"arn:aws:mock:::{args.name}")
        self.resources.append(Res(args.typ, args.name, args.inputs, f"{args.name}-id", args.provider))
        return f"{args.name}-id", outputs

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append((args.token, args.args, args.provider))
        if args.token == "aws:ssm/getParameter:getParameter":
            return {"name": args.args["name"], "value": BASE_AMI, "type": "String", "id": args.args["name"]}
        if args.token == "aws:ec2/getAmi:getAmi":
            return {"id": "ami", "rootDeviceName": "/dev/sda1"}
        return {}

    def of(self, typ: str) -> list[Res]:
        return [r for r in self.resources if r.type == typ]

    def one(self, typ: str) -> Res:
        found = self.of(typ)
        assert len(found) == 1, f"{len(found)} x {typ}"
        return found[0]


pulumi.runtime.set_mocks(Recorder(), project="xeon-cluster", stack="dev", preview=False)

from moto_fixture import isolate_aws

from core import catalog
from core.constants import REMOTE_PYTHON
from infra import cost
from infra.image import BUILD_POLICIES, SCRIPT_PATH, component_document
from node_setup import profiles


@dataclass
class Run:
    mocks: Recorder
    monitor: pulumi.runtime.mocks.MockMonitor
    outputs: dict = field(default_factory=dict)

    def urns(self) -> list[str]:
        return list(self.monitor.get_registered_resources())


@pytest.fixture
def program(monkeypatch, tmp_path):
    """Run __main__.py's main() with the given stack config; returns resources, invokes and outputs."""
    isolate_aws(monkeypatch, tmp_path)  # the cost lookup finds no credentials: catalog hint, no network

    def run(**config) -> Run:
        mocks = Recorder()
        monitor = pulumi.runtime.mocks.MockMonitor(mocks)
        pulumi.runtime.set_mocks(mocks, project="xeon-cluster", stack="dev", preview=False, monitor=monitor)
        pulumi.runtime.set_all_config({f"xeon-cluster:{k}": str(v) for k, v in {**REQUIRED, **config}.items()})
        result = Run(mocks, monitor)

        @pulumi.runtime.test
        def main():
            exported = runpy.run_path(str(ROOT / "__main__.py"), run_name="xeon_cluster_program")["main"]()
            return pulumi.Output.all(**exported).apply(result.outputs.update)

        main()
        return result

    return run


IMAGE_BUILDER = ("aws:imagebuilder/component:Component", "aws:imagebuilder/imageRecipe:ImageRecipe",
                 "aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration",
                 "aws:imagebuilder/image:Image", "aws:iam/role:Role", "aws:iam/instanceProfile:InstanceProfile",
                 "aws:iam/rolePolicyAttachment:RolePolicyAttachment")


def test_security_group_admits_ssh_from_admin_only_and_the_rest_from_itself(program):
    run = program()
    sg = run.mocks.one("aws:ec2/securityGroup:SecurityGroup")
    ingress = sg.inputs["ingress"]
    ssh = [r for r in ingress if r.get("cidrBlocks")]
    assert ssh == [{"description": "SSH from the operator", "protocol": "tcp", "fromPort": 22, "toPort": 22,
                    "cidrBlocks": ["203.0.113.7/32"]}]
    intra = [r for r in ingress if not r.get("cidrBlocks")]
    assert len(intra) == 1 and intra[0]["self"] is True and intra[0]["protocol"] == "-1"
    assert not intra[0].get("ipv6CidrBlocks") and not intra[0].get("securityGroups")
    assert all("0.0.0.0/0" not in r.get("cidrBlocks", []) for r in ingress)
    assert sg.inputs["egress"][0]["cidrBlocks"] == ["0.0.0.0/0"] and sg.inputs["egress"][0]["protocol"] == "-1"


def test_world_ssh_only_when_explicitly_allowed_and_nothing_else_opens(program):
    run = program(adminCidr="0.0.0.0/0", allowWorldSsh="true")
    ingress = run.mocks.one("aws:ec2/securityGroup:SecurityGroup").inputs["ingress"]
    open_rules = [r for r in ingress if "0.0.0.0/0" in r.get("cidrBlocks", [])]
    assert [(r["fromPort"], r["toPort"], r["protocol"]) for r in open_rules] == [(22, 22, "tcp")]


def test_launch_template_requires_imdsv2_encrypts_root_and_uses_spot(program):
    run = program(rootVolumeGib="200", maxSpotPrice="3.10")
    lt = run.mocks.one("aws:ec2/launchTemplate:LaunchTemplate").inputs
    assert lt["metadataOptions"]["httpTokens"] == "required"
    assert lt["metadataOptions"]["httpPutResponseHopLimit"] == 1
    (root,) = lt["blockDeviceMappings"]
    assert root["deviceName"] == "/dev/sda1"  # the AMI's own root device, looked up
    assert root["ebs"] == {"volumeSize": 200, "volumeType": "gp3", "encrypted": "true", "deleteOnTermination": "true"}
    assert lt["instanceMarketOptions"] == {"marketType": "spot", "spotOptions": {
        "instanceInterruptionBehavior": "terminate", "spotInstanceType": "one-time", "maxPrice": "3.10"}}
    assert lt["instanceType"] == "r7iz.16xlarge"
    cloud_config = base64.b64decode(lt["userData"]).decode()
    assert cloud_config.startswith("#cloud-config\n")
    parsed = yaml.safe_load(cloud_config)
    env = next(f["content"] for f in parsed["write_files"] if f["path"] == "/etc/xeon-cluster/cluster.env")
    assert "XC_CLUSTER=dev\n" in env and "XC_PROFILE=oneccl\n" in env
    (ami_lookup,) = [c for c in run.mocks.calls if c[0] == "aws:ec2/getAmi:getAmi"]
    assert ami_lookup[1]["filters"] == [{"name": "image-id", "values": [BAKED_AMI]}]


def test_on_demand_has_no_market_options(program):
    lt = program(spot="false").mocks.one("aws:ec2/launchTemplate:LaunchTemplate").inputs
    assert "instanceMarketOptions" not in lt


def test_all_nodes_share_one_zone_one_placement_group_and_carry_their_tags(program):
    run = program(nodeCount="3", availabilityZone="us-east-1c", clusterName="bert")
    m = run.mocks
    subnet = m.one("aws:ec2/subnet:Subnet")
    assert subnet.inputs["availabilityZone"] == "us-east-1c"
    group = m.one("aws:ec2/placementGroup:PlacementGroup")
    assert group.inputs["strategy"] == "cluster"
    lt = m.one("aws:ec2/launchTemplate:LaunchTemplate")
    assert lt.inputs["placement"] == {"groupName": group.name}
    (nic,) = lt.inputs["networkInterfaces"]
    assert nic["subnetId"] == subnet.id
    assert nic["securityGroups"] == [m.one("aws:ec2/securityGroup:SecurityGroup").id]
    instances = m.of("aws:ec2/instance:Instance")
    assert len(instances) == 3
    for i, inst in enumerate(instances):
        assert inst.inputs["launchTemplate"] == {"id": lt.id, "version": "3"}
        assert not {"subnetId", "availabilityZone", "placementGroup", "vpcSecurityGroupIds"} & set(inst.inputs)
        assert inst.inputs["tags"] == {
            "Name": f"bert-{i}", "xeon-cluster:cluster": "bert", "xeon-cluster:stack": "dev",
            "xeon-cluster:role": "master" if i == 0 else "worker", "xeon-cluster:index": str(i),
            "xeon-cluster:ssh-user": "ubuntu", "xeon-cluster:profile": "oneccl"}


def test_bake_mode_feeds_the_image_builder_ami_into_the_launch_template(program):
    run = program()
    m = run.mocks
    component = m.one("aws:imagebuilder/component:Component")
    assert component.inputs["data"] == component_document("oneccl")
    recipe = m.one("aws:imagebuilder/imageRecipe:ImageRecipe")
    assert recipe.inputs["parentImage"] == "ssm:/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/" \
                                           "ebs-gp3/ami-id"
    assert recipe.inputs["components"] == [{"componentArn": f"arn:aws:mock:::{component.name}"}]
    assert recipe.inputs["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
    infra = m.one("aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration")
    profile = m.one("aws:iam/instanceProfile:InstanceProfile")
    assert infra.inputs["instanceProfileName"] == profile.name
    assert infra.inputs["subnetId"] == m.one("aws:ec2/subnet:Subnet").id
    assert "xeon-cluster:cluster" not in infra.inputs["resourceTags"]  # the build instance is no node
    image = m.one("aws:imagebuilder/image:Image")
    assert image.inputs["imageRecipeArn"] == f"arn:aws:mock:::{recipe.name}"
    assert image.inputs["infrastructureConfigurationArn"] == f"arn:aws:mock:::{infra.name}"
    # least privilege: exactly the two managed policies Image Builder documents, nothing inline
    role = m.one("aws:iam/role:Role")
    assert json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    assert not m.of("aws:iam/rolePolicy:RolePolicy")
    assert sorted(a.inputs["policyArn"] for a in m.of("aws:iam/rolePolicyAttachment:RolePolicyAttachment")) == \
        sorted(f"arn:aws:iam::aws:policy/{p}" for p in BUILD_POLICIES)
    assert m.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["imageId"] == BAKED_AMI
    assert run.outputs["amiId"] == BAKED_AMI


def test_base_mode_uses_ubuntu_from_ssm_and_builds_no_image(program):
    run = program(image="base", ubuntuVersion="22.04")
    assert not [r for r in run.mocks.resources if r.type in IMAGE_BUILDER]
    (lookup,) = [c for c in run.mocks.calls if c[0] == "aws:ssm/getParameter:getParameter"]
    assert lookup[1]["name"] == "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id"
    assert run.mocks.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["imageId"] == BASE_AMI


def test_explicit_ami_is_used_as_is(program):
    run = program(image="ami-0123456789abcdef0")
    assert not [r for r in run.mocks.resources if r.type in IMAGE_BUILDER]
    assert not [c for c in run.mocks.calls if c[0] == "aws:ssm/getParameter:getParameter"]
    assert run.mocks.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["imageId"] == "ami-0123456789abcdef0"


def test_components_own_their_children_and_one_provider_serves_all(program):
    run = program(nodeCount="2")
    owners = {"aws:ec2/vpc:Vpc": "Network", "aws:ec2/securityGroup:SecurityGroup": "Network",
              "aws:ec2/placementGroup:PlacementGroup": "Network", "aws:imagebuilder/image:Image": "Image",
              "aws:iam/role:Role": "Image", "aws:ec2/launchTemplate:LaunchTemplate": "Nodes",
              "aws:ec2/instance:Instance": "Nodes", "aws:ec2/keyPair:KeyPair": "Nodes"}
    for typ, component in owners.items():
        urns = [u for u in run.urns() if f"::{typ}::" in u or f"${typ}::" in u]
        assert urns and all(f"xeon-cluster:infra:{component}${typ}::" in u for u in urns), (typ, urns)
    provider = run.mocks.one("pulumi:providers:aws")
    assert provider.inputs["region"] == "us-east-1"
    assert json.loads(provider.inputs["defaultTags"]) == {"tags": {"xeon-cluster:cluster": "dev", "xeon-cluster:stack": "dev"}}
    for res in run.mocks.resources:
        if res.type.startswith("aws:"):
            assert res.provider and "pulumi:providers:aws::aws" in res.provider, res.type
    assert all("pulumi:providers:aws::aws" in (c[2] or "") for c in run.mocks.calls)


def test_outputs_list_nodes_hostfile_and_cost(program):
    run = program(nodeCount="2", instanceType="c6i.16xlarge", rootVolumeGib="100")
    out = run.outputs
    assert out["nodes"] == [
        {"name": "dev-0", "index": 0, "role": "master", "publicIp": "198.51.100.10", "privateIp": "10.42.0.10"},
        {"name": "dev-1", "index": 1, "role": "worker", "publicIp": "198.51.100.11", "privateIp": "10.42.0.11"}]
    assert out["masterPrivateIp"] == "10.42.0.10" and out["sshUser"] == "ubuntu"
    assert out["sshCommand"] == "ssh ubuntu@198.51.100.10"
    assert out["hostfile"] == "10.42.0.10\n10.42.0.11\n"
    # no AWS credentials here: the estimate falls back to the catalog's on-demand price
    extras = 2 * (100 * cost.GP3_USD_PER_GIB_MONTH / cost.HOURS_PER_MONTH + cost.PUBLIC_IPV4_USD_H)
    assert out["hourlyCostUsd"] == pytest.approx(2 * catalog.lookup("c6i.16xlarge").on_demand_usd_h + extras, abs=1e-3)
    assert "2 x c6i.16xlarge spot" in out["costEstimate"]


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
