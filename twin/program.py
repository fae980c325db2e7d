"""`pulumi up` for the AWS twin: the Pulumi program itself (__main__.py), run under Pulumi's mocks, where each
resource it declares is made on the twin's moto server with the inputs the program gave it. So the twin holds what
the program would leave on AWS, from the same settings and names, never from a second description of it.

What moto cannot hold is recorded and left out, each with its reason (Image Builder: the twin's image is this
machine's venv). The instances the groups launch are booted by twin.up.

A second apply with the first's Twin is the next `pulumi up` of the same stack (twin.stack decides what
changes); `rebake=True` replaces the image build, as `pulumi up --replace` of it would: a new AMI, and the
superseded one deregistered by the program's own clean-up (infra/amis.py).
"""
from __future__ import annotations

import base64
import json
import logging
import re
import runpy
import secrets
from collections.abc import Callable
from typing import ClassVar

from core.constants import PROJECT_ROOT, TAG_SSH_USER
from twin import stack as twin_stack

log = logging.getLogger(__name__)
PROJECT = "xeon-cluster"
IMAGE_BUILDER = "Image Builder: the twin's image is this machine's venv, mounted where a baked image has it"
IMAGE = "aws:imagebuilder/image:Image"


def _pascal(obj):
    """Pulumi's camelCase inputs as the AWS API's PascalCase shapes (nested)."""
    if isinstance(obj, dict):
        return {({"Id": "ID"}.get(k[:1].upper() + k[1:], k[:1].upper() + k[1:])): _pascal(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_pascal(v) for v in obj]
    if isinstance(obj, float) and obj.is_integer():  # Pulumi hands every number over as a float
        return int(obj)
    return obj


def _tags(tags: dict | None) -> list[dict]:
    return [{"Key": k, "Value": str(v)} for k, v in (tags or {}).items()]


def _bool(value) -> bool | None:
    return None if value is None else str(value).lower() == "true"


def _auto(name: str) -> str:
    """Pulumi's auto-naming: the logical name and a random suffix."""
    return f"{name}-{secrets.token_hex(4)}"


class Twin:
    """The mocks: make each resource on moto, answer each invoke as AWS would for the twin."""

    def __init__(self, client: Callable, zone: str, ssh_user: str):
        self.client, self.zone, self.ssh_user = client, zone, ssh_user
        self.made: list[tuple[str, str, str]] = []  # (type, logical name, id)
        self.left_out: dict[str, str] = {}  # "type name" -> why
        self._ami: str | None = None
        self.stack = twin_stack.Stack()  # each resource's state, for the next apply

    # -- the twin's image ---------------------------------------------------------------------------------------
    def ami(self) -> str:
        """An image moto already holds, as the twin's AMI (what boots is the twin's own node, whatever it says)."""
        if self._ami is None:
            images = self.client("ec2").describe_images(Owners=["amazon"])["Images"]
            ubuntu = [i for i in images if "ubuntu" in i.get("Name", "").lower()]
            self._ami = min(ubuntu or images, key=lambda i: i["ImageId"])["ImageId"]
        return self._ami

    def bake(self) -> str:
        """A new AMI as Image Builder makes one: CreateImage of a build instance (moto snapshots its root)."""
        ec2 = self.client("ec2")
        build = ec2.run_instances(ImageId=self.ami(), MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
        ami = ec2.create_image(InstanceId=build, Name=f"xc-twin-bake-{secrets.token_hex(4)}")["ImageId"]
        ec2.terminate_instances(InstanceIds=[build])
        return ami

    # -- pulumi.runtime.Mocks -----------------------------------------------------------------------------------
    def new_resource(self, args):
        return self.stack.register(args.typ, args.name, dict(args.inputs), self._make)

    def _make(self, typ: str, name: str, inputs: dict, was: tuple | None) -> tuple[str, dict]:
        """A resource made on moto, or updated there when ``was`` (its state) is given."""
        if (make := self.MAKERS.get(typ)) is None:
            why = IMAGE_BUILDER if typ.startswith("aws:imagebuilder/") else "not part of what the twin serves"
            if not typ.startswith(("pulumi", PROJECT)):
                self.left_out[f"{typ} {name}"] = why
            outputs = dict(inputs)
            if typ == IMAGE:  # a changed image is a new build (its inputs replace it), as is a forced one
                outputs["outputResources"] = [{"amis": [{"image": self.bake(), "region": ""}]}]
            outputs.setdefault("arn", f"arn:aws:twin:::{name}")
            return f"{name}-twin", outputs
        if was is not None:
            if typ not in self.UPDATERS:  # a change the twin cannot make is said, never silently dropped
                raise ValueError(f"the twin cannot update {typ} {name}: its inputs changed")
            rid, extra = self.UPDATERS[typ](self, name, was, inputs)
            return rid, {**was[2], **inputs, **extra}
        try:
            rid, extra = make(self, name, inputs)
        except Exception as exc:  # a setting moto cannot hold is named, the rest stands
            if typ in ESSENTIAL:
                raise
            self.left_out[f"{typ} {name}"] = f"moto refused it: {str(exc).splitlines()[0][:160]}"
            return f"{name}-twin", inputs
        self.made.append((typ, name, rid))
        return rid, {**inputs, **extra}

    def call(self, args):
        token, a = args.token, args.args
        if token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
            types = [v for f in a.get("filters", []) if f["name"] == "instance-type" for v in f["values"]]
            return {"id": "offerings", "instanceTypes": types, "locations": [self.zone] * len(types),
                    "locationTypes": ["availability-zone"] * len(types)}
        if token == "aws:index/getPartition:getPartition":
            return {"id": "aws", "partition": "aws", "dnsSuffix": "amazonaws.com"}
        if token == "aws:index/getCallerIdentity:getCallerIdentity":
            who = self.client("sts").get_caller_identity()
            return {"id": who["Account"], "accountId": who["Account"], "arn": who["Arn"], "userId": who["UserId"]}
        if token == "aws:index/getServicePrincipal:getServicePrincipal":
            name = f"{a['serviceName']}.amazonaws.com"
            return {"id": name, "name": name, "suffix": "amazonaws.com"}
        if token == "aws:ssm/getParameter:getParameter":  # Canonical's current Ubuntu AMI
            return {"id": a["name"], "name": a["name"], "type": "String", "value": self.ami()}
        if token == "aws:ec2/getAmi:getAmi":
            ids = [v for f in a.get("filters", []) if f["name"] == "image-id" for v in f["values"]]
            image = self.client("ec2").describe_images(ImageIds=ids or [self.ami()])["Images"][0]
            return {"id": image["ImageId"], "rootDeviceName": image.get("RootDeviceName", "/dev/sda1")}
        return {}

    # -- the resources ------------------------------------------------------------------------------------------
    def _ec2_tag(self, rid: str, tags: dict | None) -> None:
        if tags:
            self.client("ec2").create_tags(Resources=[rid], Tags=_tags(tags))

    def vpc(self, name, i):
        rid = self.client("ec2").create_vpc(CidrBlock=i["cidrBlock"])["Vpc"]["VpcId"]
        self._ec2_tag(rid, i.get("tags"))
        return rid, {"arn": f"arn:aws:ec2:::vpc/{rid}"}

    def gateway(self, name, i):
        ec2 = self.client("ec2")
        rid = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
        ec2.attach_internet_gateway(InternetGatewayId=rid, VpcId=i["vpcId"])
        self._ec2_tag(rid, i.get("tags"))
        return rid, {}

    def subnet(self, name, i):
        ec2 = self.client("ec2")
        rid = ec2.create_subnet(VpcId=i["vpcId"], CidrBlock=i["cidrBlock"], AvailabilityZone=i["availabilityZone"])[
            "Subnet"]["SubnetId"]
        if _bool(i.get("mapPublicIpOnLaunch")):  # moto's groups launch with the subnet's setting, not the template's
            ec2.modify_subnet_attribute(SubnetId=rid, MapPublicIpOnLaunch={"Value": True})
        self._ec2_tag(rid, i.get("tags"))
        return rid, {"arn": f"arn:aws:ec2:::subnet/{rid}"}

    def route_table(self, name, i):
        ec2 = self.client("ec2")
        rid = ec2.create_route_table(VpcId=i["vpcId"])["RouteTable"]["RouteTableId"]
        self._ec2_tag(rid, i.get("tags"))
        for route in i.get("routes") or []:
            ec2.create_route(RouteTableId=rid, DestinationCidrBlock=route["cidrBlock"], GatewayId=route["gatewayId"])
        return rid, {}

    def route_assoc(self, name, i):
        return self.client("ec2").associate_route_table(RouteTableId=i["routeTableId"], SubnetId=i["subnetId"])[
            "AssociationId"], {}

    def security_group(self, name, i):
        ec2 = self.client("ec2")
        rid = ec2.create_security_group(GroupName=i.get("name") or _auto(name), VpcId=i["vpcId"],
                                        Description=i.get("description") or name)["GroupId"]
        self._ec2_tag(rid, i.get("tags"))
        perms = [self._permission(rule, rid) for rule in i.get("ingress") or []]
        if perms:
            ec2.authorize_security_group_ingress(GroupId=rid, IpPermissions=perms)
        return rid, {"arn": f"arn:aws:ec2:::security-group/{rid}", "name": i.get("name") or name}

    @staticmethod
    def _permission(rule: dict, own: str) -> dict:
        groups = list(rule.get("securityGroups") or []) + ([own] if rule.get("self") else [])
        perm = {"IpProtocol": rule["protocol"], "IpRanges": [{"CidrIp": c} for c in rule.get("cidrBlocks") or []],
                "UserIdGroupPairs": [{"GroupId": g} for g in groups]}
        if rule["protocol"] != "-1":
            perm.update(FromPort=int(rule["fromPort"]), ToPort=int(rule["toPort"]))
        return perm

    def sg_rule(self, name, i):
        """aws:vpc/securityGroupIngressRule: one rule of its own."""
        rule = {"protocol": i.get("ipProtocol", "-1"), "fromPort": i.get("fromPort", 0), "toPort": i.get("toPort", 0),
                "cidrBlocks": [i["cidrIpv4"]] if i.get("cidrIpv4") else [],
                "securityGroups": [i["referencedSecurityGroupId"]] if i.get("referencedSecurityGroupId") else []}
        self.client("ec2").authorize_security_group_ingress(GroupId=i["securityGroupId"],
                                                            IpPermissions=[self._permission(rule, "")])
        return _auto(name), {}

    def placement_group(self, name, i):
        self.client("ec2").create_placement_group(GroupName=i["name"], Strategy=i.get("strategy", "cluster"),
                                                  TagSpecifications=[{"ResourceType": "placement-group",
                                                                      "Tags": _tags(i.get("tags"))}] if i.get("tags") else [])
        return i["name"], {}

    def key_pair(self, name, i):
        key_name = i.get("keyName") or _auto(name)
        self.client("ec2").import_key_pair(KeyName=key_name, PublicKeyMaterial=i["publicKey"])
        return key_name, {"keyName": key_name, "arn": f"arn:aws:ec2:::key-pair/{key_name}"}

    def role(self, name, i):
        role_name = i.get("name") or _auto(name)
        boundary = {"PermissionsBoundary": i["permissionsBoundary"]} if i.get("permissionsBoundary") else {}
        role = self.client("iam").create_role(RoleName=role_name, Path=i.get("path") or "/",
                                              AssumeRolePolicyDocument=i["assumeRolePolicy"], Tags=_tags(i.get("tags")),
                                              **boundary)
        return role_name, {"name": role_name, "arn": role["Role"]["Arn"], "uniqueId": role["Role"]["RoleId"]}

    def role_policy(self, name, i):
        policy_name = i.get("name") or _auto(name)
        self.client("iam").put_role_policy(RoleName=i["role"], PolicyName=policy_name, PolicyDocument=i["policy"])
        return f"{i['role']}:{policy_name}", {"name": policy_name}

    def instance_profile(self, name, i):
        iam, profile_name = self.client("iam"), i.get("name") or _auto(name)
        arn = iam.create_instance_profile(InstanceProfileName=profile_name, Path=i.get("path") or "/",
                                          Tags=_tags(i.get("tags")))["InstanceProfile"]["Arn"]
        if i.get("role"):
            iam.add_role_to_instance_profile(InstanceProfileName=profile_name, RoleName=i["role"])
        return profile_name, {"name": profile_name, "arn": arn}

    def launch_template(self, name, i):
        lt_name = i.get("name") or _auto(name)
        made = self.client("ec2").create_launch_template(LaunchTemplateName=lt_name, LaunchTemplateData=self._lt_data(
            i))["LaunchTemplate"]
        return made["LaunchTemplateId"], {"name": lt_name, "latestVersion": made["LatestVersionNumber"],
                                          "defaultVersion": made["DefaultVersionNumber"]}

    def new_template_version(self, name, was, i):
        ec2, default = self.client("ec2"), _bool(i.get("updateDefaultVersion"))
        n = ec2.create_launch_template_version(LaunchTemplateId=was[0], LaunchTemplateData=self._lt_data(i))[
            "LaunchTemplateVersion"]["VersionNumber"]
        if default:
            ec2.modify_launch_template(LaunchTemplateId=was[0], DefaultVersion=str(n))
        return was[0], {"latestVersion": n, **({"defaultVersion": n} if default else {})}

    def _lt_data(self, i: dict) -> dict:
        data = {"ImageId": i["imageId"], "InstanceType": i["instanceType"], "UserData": i.get("userData", ""),
                "MetadataOptions": _pascal(i.get("metadataOptions") or {}),
                "TagSpecifications": [{"ResourceType": t["resourceType"], "Tags": _tags(self._user(t.get("tags")))}
                                      for t in i.get("tagSpecifications") or []]}
        if i.get("keyName"):
            data["KeyName"] = i["keyName"]
        if i.get("iamInstanceProfile"):
            data["IamInstanceProfile"] = _pascal(i["iamInstanceProfile"])
        # a public address as the program asks: moto takes it from the twin's own range (twin.control)
        data["NetworkInterfaces"] = [{"DeviceIndex": int(n.get("deviceIndex", 0)), "Groups": list(n.get("securityGroups")
                                     or []), "AssociatePublicIpAddress": bool(_bool(n.get("associatePublicIpAddress")))}
                                     for n in i.get("networkInterfaces") or []]
        return data

    def _user(self, tags: dict | None) -> dict | None:
        """The twin's instances log in as this machine's user (sshUser names a user of the real AMI)."""
        return {**tags, TAG_SSH_USER: self.ssh_user} if tags and TAG_SSH_USER in tags else tags

    def group(self, name, i):
        asg, group_name = self.client("autoscaling"), i.get("name") or _auto(name)
        asg.create_auto_scaling_group(**self._group_args(group_name, i), Tags=[
            {"Key": t["key"], "Value": str(self._user({t["key"]: t["value"]})[t["key"]]),
             "PropagateAtLaunch": bool(_bool(t.get("propagateAtLaunch")))} for t in i.get("tags") or []])
        for hook in i.get("initialLifecycleHooks") or []:
            asg.put_lifecycle_hook(AutoScalingGroupName=group_name, LifecycleHookName=hook["name"],
                                   LifecycleTransition=hook["lifecycleTransition"],
                                   HeartbeatTimeout=int(hook.get("heartbeatTimeout", 3600)),
                                   DefaultResult=hook.get("defaultResult", "ABANDON"))
        return group_name, {"name": group_name, "arn": f"arn:aws:autoscaling:::autoScalingGroup/{group_name}"}

    def update_group(self, name, was, i):
        """A new template version is what the group launches next (no instance refresh: running ones stay)."""
        args = self._group_args(was[0], i)
        args.pop("PlacementGroup", None)
        self.client("autoscaling").update_auto_scaling_group(**args)
        return was[0], {}

    def _group_args(self, group_name: str, i: dict) -> dict:
        kwargs = {"AutoScalingGroupName": group_name, "MinSize": int(i["minSize"]), "MaxSize": int(i["maxSize"]),
                  "DesiredCapacity": int(i.get("desiredCapacity", i["minSize"])),
                  "VPCZoneIdentifier": ",".join(i.get("vpcZoneIdentifiers") or []),
                  "HealthCheckType": i.get("healthCheckType", "EC2"),
                  "HealthCheckGracePeriod": int(i.get("healthCheckGracePeriod", 300)),
                  "CapacityRebalance": bool(_bool(i.get("capacityRebalance")))}
        if i.get("placementGroup"):
            kwargs["PlacementGroup"] = i["placementGroup"]
        if i.get("launchTemplate"):
            kwargs["LaunchTemplate"] = {"LaunchTemplateId": i["launchTemplate"]["id"],
                                        "Version": str(i["launchTemplate"].get("version", "$Latest"))}
        if i.get("mixedInstancesPolicy"):
            kwargs["MixedInstancesPolicy"] = _pascal(i["mixedInstancesPolicy"])
        return kwargs

    def bucket(self, name, i):
        bucket = i.get("bucket") or (i.get("bucketPrefix") or f"{name}-") + secrets.token_hex(6)
        self.client("s3").create_bucket(Bucket=bucket)
        if i.get("tags"):
            self.client("s3").put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": _tags(i["tags"])})
        return bucket, {"bucket": bucket, "arn": f"arn:aws:s3:::{bucket}"}

    def bucket_policy(self, name, i):
        """The policy less its TLS-only statements: the twin serves plain HTTP, and moto enforces them."""
        policy = json.loads(i["policy"])
        kept = [st for st in policy.get("Statement", []) if "aws:SecureTransport" not in json.dumps(st.get("Condition"))]
        if len(kept) < len(policy.get("Statement", [])):
            self.left_out[f"aws:s3/bucketPolicy:BucketPolicy {name}: TLS-only statements"] = (
                "the twin's endpoint is plain HTTP; AWS's is TLS")
        if kept:
            self.client("s3").put_bucket_policy(Bucket=i["bucket"], Policy=json.dumps({**policy, "Statement": kept}))
        return f"{i['bucket']}-{name}", {}

    def log_group(self, name, i):
        group = i.get("name") or _auto(name)
        self.client("logs").create_log_group(logGroupName=group)
        return group, {"name": group, "arn": f"arn:aws:logs:::log-group:{group}"}

    def policy(self, name, i):
        made = self.client("iam").create_policy(PolicyName=i.get("name") or _auto(name), Path=i.get("path") or "/",
                                                PolicyDocument=i["policy"], Description=i.get("description") or "")
        return made["Policy"]["Arn"], {"arn": made["Policy"]["Arn"], "name": made["Policy"]["PolicyName"]}

    def kms_key(self, name, i):
        kms = self.client("kms")
        meta = kms.create_key(Description=i.get("description") or name, Policy=i.get("policy") or "",
                              Tags=[{"TagKey": k, "TagValue": str(v)} for k, v in (i.get("tags") or {}).items()]
                              )["KeyMetadata"]
        if _bool(i.get("enableKeyRotation")):
            kms.enable_key_rotation(KeyId=meta["KeyId"])
        return meta["KeyId"], {"arn": meta["Arn"], "keyId": meta["KeyId"]}

    def kms_alias(self, name, i):
        self.client("kms").create_alias(AliasName=i["name"], TargetKeyId=i["targetKeyId"])
        return i["name"], {"arn": f"arn:aws:kms:::{i['name']}"}

    MAKERS: ClassVar[dict[str, Callable]] = {}
    UPDATERS: ClassVar[dict[str, Callable]] = {}


# What the nodes, the head, the store and the secrets stand on: the twin does not come up without them.
ESSENTIAL = {"aws:ec2/vpc:Vpc", "aws:ec2/subnet:Subnet", "aws:ec2/securityGroup:SecurityGroup", "aws:ec2/keyPair:KeyPair",
             "aws:iam/role:Role", "aws:iam/instanceProfile:InstanceProfile", "aws:ec2/launchTemplate:LaunchTemplate",
             "aws:autoscaling/group:Group", "aws:s3/bucket:Bucket", "aws:kms/key:Key", "aws:kms/alias:Alias",
             "aws:iam/policy:Policy"}


def _bucket_part(put: str, shape: Callable[[dict], dict]) -> Callable:
    """A bucket setting made by one S3 call (versioning, policy, lifecycle, public access)."""
    def make(twin: Twin, name: str, i: dict):
        getattr(twin.client("s3"), put)(Bucket=i["bucket"], **shape(i))
        return f"{i['bucket']}-{name}", {}
    return make


def _lifecycle(i: dict) -> dict:
    rules = []
    for rule in i.get("rules") or []:
        out = _pascal({k: v for k, v in rule.items() if k != "filter"})
        prefix = (rule.get("filter") or {}).get("prefix")
        out["Filter"] = {"Prefix": prefix} if prefix is not None else {}
        rules.append(out)
    return {"LifecycleConfiguration": {"Rules": rules}}


Twin.MAKERS = {
    "aws:ec2/vpc:Vpc": Twin.vpc,
    "aws:ec2/internetGateway:InternetGateway": Twin.gateway,
    "aws:ec2/subnet:Subnet": Twin.subnet,
    "aws:ec2/routeTable:RouteTable": Twin.route_table,
    "aws:ec2/routeTableAssociation:RouteTableAssociation": Twin.route_assoc,
    "aws:ec2/securityGroup:SecurityGroup": Twin.security_group,
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": Twin.sg_rule,
    "aws:ec2/placementGroup:PlacementGroup": Twin.placement_group,
    "aws:ec2/keyPair:KeyPair": Twin.key_pair,
    "aws:iam/role:Role": Twin.role,
    "aws:iam/policy:Policy": Twin.policy,
    "aws:kms/key:Key": Twin.kms_key,
    "aws:kms/alias:Alias": Twin.kms_alias,
    "aws:iam/rolePolicy:RolePolicy": Twin.role_policy,
    "aws:iam/instanceProfile:InstanceProfile": Twin.instance_profile,
    "aws:ec2/launchTemplate:LaunchTemplate": Twin.launch_template,
    "aws:autoscaling/group:Group": Twin.group,
    "aws:s3/bucket:Bucket": Twin.bucket,
    "aws:s3/bucketVersioning:BucketVersioning": _bucket_part("put_bucket_versioning",
        lambda i: {"VersioningConfiguration": {"Status": i["versioningConfiguration"]["status"]}}),
    "aws:s3/bucketPolicy:BucketPolicy": Twin.bucket_policy,
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration": _bucket_part("put_bucket_lifecycle_configuration", _lifecycle),
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": _bucket_part("put_public_access_block", lambda i: {"PublicAccessBlockConfiguration": _pascal(
            {k: _bool(v) for k, v in i.items() if k != "bucket"})}),
    "aws:cloudwatch/logGroup:LogGroup": Twin.log_group,
}
Twin.UPDATERS = {"aws:ec2/launchTemplate:LaunchTemplate": Twin.new_template_version,
                 "aws:autoscaling/group:Group": Twin.update_group}


def apply(endpoint: str, config: dict[str, str], stack: str, zone: str, ssh_user: str, previous: Twin | None = None,
          rebake: bool = False) -> tuple[Twin, dict]:
    """Run the Pulumi program with ``config`` as stack ``stack``'s config; every resource lands on moto at
    ``endpoint``. Returns the mocks (what was made and what was left out) and the program's outputs. With
    ``previous`` (an earlier apply's Twin), the next `pulumi up` of that stack; ``rebake`` replaces its image build."""
    import boto3
    import pulumi

    session = boto3.session.Session(aws_access_key_id="xc-twin", aws_secret_access_key="xc-twin", region_name=
                                    re.sub(r"[a-z]$", "", zone))
    clients: dict = {}

    def client(service: str):
        if service not in clients:
            clients[service] = session.client(service, endpoint_url=endpoint)
        return clients[service]

    twin = previous or Twin(client, zone, ssh_user)
    twin.stack.begin(replace=[IMAGE] if rebake else [])
    pulumi.runtime.set_mocks(twin, project=PROJECT, stack=stack, preview=False,
                             monitor=twin_stack.monitor(twin.stack)(twin))
    pulumi.runtime.set_all_config({f"{PROJECT}:{k}": str(v) for k, v in config.items()})
    outputs: dict = {}

    @pulumi.runtime.test
    def program():
        exported = runpy.run_path(str(PROJECT_ROOT / "__main__.py"), run_name="xeon_cluster_program")["main"]()
        return pulumi.Output.all(**exported).apply(outputs.update)

    program()
    twin.stack.finish()
    for key, why in twin.left_out.items():
        log.debug("not in the twin: %s (%s)", key, why)
    return twin, json.loads(json.dumps(outputs, default=str))


def user_data(template_data: dict) -> str:
    """A launch template version's user data as text."""
    return base64.b64decode(template_data.get("UserData") or b"").decode()
