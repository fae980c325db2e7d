"""The head: a small on-demand instance next to the nodes that runs what must outlive the operator's laptop (the
supervisors of detached runs). An Auto Scaling group of one replaces it when it dies; it is never spot
(it recovers the nodes from their reclaims), requires IMDSv2, has an encrypted gp3 root, sits in the cluster's
subnet in a security group of its own (SSH from adminCidr only: nodes run user code and reach it on no port) and has
its own role (infra/policies.py head_policy). It carries the cluster tag but no role tag: discovery never takes it
for a node.

The cluster's secrets key is the head's too: a customer-managed KMS key (rotated yearly, alias
alias/xeon-cluster/<cluster>) that the mesh key and the run secrets in SSM are encrypted with (cluster.mesh,
launch.staging.run_secrets) and that only the head's role may decrypt with (infra/policies.py key_policy): the nodes and
the image build, whatever SSM parameters they may read, cannot read those values.

Its image: with image=bake, the nodes' baked AMI (Ubuntu with the project's venv at /opt/xeon-cluster/venv, so the
supervisors run there); otherwise stock Ubuntu (Canonical's SSM parameter, pinned like image=base), which has no
venv: the operator's machine then keeps the supervisor role and says so (launch.life.head.lacks_venv). Either way
with image=bake the head follows each new bake (the group replaces it, and the new head takes over the chains),
because the clean-up deregisters the superseded AMI: a template left on it could never replace a lost head. Stock
Ubuntu's newer AMIs do not replace a running head.
"""
from __future__ import annotations

import base64
import gzip

import pulumi
import pulumi_aws as aws

from core.constants import PROJECT_ROOT, TAG_PREFIX, TAG_SSH_USER
from core.render import render
from infra.checks import AwsContext
from infra.cost import HEAD_ROOT_GIB
from infra.nodes import TERMINATION_HOOK, group_name, store_tag
from infra.policies import ROLE_PATH, ec2_trust_policy, head_policy, key_alias, key_arn, key_policy, secrets_path
from infra.settings import ClusterSettings

TAG_HEAD = TAG_PREFIX + "head"  # on the head instance: the cluster it heads
KEY_DELETION_DAYS = 7  # a destroyed stack's key is deleted after the shortest wait KMS allows


def template_ignores(settings: ClusterSettings) -> list[str]:
    """What a 'pulumi up' leaves alone in the head's launch template: a new Canonical AMI (image=base or an explicit
    AMI's head), never a new bake, whose predecessor infra/image.py deregisters."""
    return [] if settings.image == "bake" else ["imageId"]
HEAD_USER = "ubuntu"  # the head always boots Ubuntu, whatever image the nodes run
UBUNTU_ROOT_DEVICE = "/dev/sda1"


def head_group_name(settings: ClusterSettings) -> str:
    return f"{settings.cluster_name}-head"


def head_env(settings: ClusterSettings, store_url: str) -> dict[str, str]:
    """/etc/xeon-cluster/cluster.env on the head: the nodes' group and hook, the store, the secrets' SSM path."""
    return {"XC_CLUSTER": settings.cluster_name, "XC_STACK": settings.stack, "XC_ROLE": "head",
            "XC_REGION": settings.region, "XC_ASG_NAME": group_name(settings), "XC_LIFECYCLE_HOOK": TERMINATION_HOOK,
            "XC_HEAD_GROUP": head_group_name(settings), "XC_STORE": store_url,
            "XC_SECRETS_PATH": secrets_path(settings.cluster_name)}


def head_user_data(settings: ClusterSettings, store_url: str) -> str:
    return render("cloud-init.yaml.j2", role="head", cluster=settings.cluster_name, env=head_env(settings, store_url),
                  publisher=(PROJECT_ROOT / "node_setup" / "publish_host_keys.py").read_text(),
                  head_boot=(PROJECT_ROOT / "node_setup" / "head_boot.py").read_text(), head_user=HEAD_USER)


def packed(user_data: str) -> bytes:
    """gzip (cloud-init unpacks it): the head's two boot scripts put its user data over EC2's 16 KB as plain text."""
    return gzip.compress(user_data.encode(), mtime=0)


def head_tags(settings: ClusterSettings) -> dict[str, str]:
    return {**settings.tags, "Name": head_group_name(settings), TAG_HEAD: settings.cluster_name,
            TAG_SSH_USER: HEAD_USER}


class Head(pulumi.ComponentResource):
    def __init__(self, name: str, settings: ClusterSettings, network, store, key_name: pulumi.Input[str],
                 ctx: AwsContext | None = None, opts: pulumi.ResourceOptions | None = None,
                 baked_ami: pulumi.Input[str] | None = None, boundary: pulumi.Input[str] | None = None):
        super().__init__("xeon-cluster:infra:Head", name, None, opts)
        ctx = ctx or AwsContext(region=settings.region)
        child = pulumi.ResourceOptions(parent=self)
        tags = settings.tags

        self.role = aws.iam.Role(f"{name}-head", path=ROLE_PATH, tags=tags, opts=child,
                                 assume_role_policy=ec2_trust_policy(ctx.ec2_principal), permissions_boundary=boundary)
        # the secrets key names the head's role in its policy, and the role's policy names the key
        self.key = aws.kms.Key(
            f"{name}-secrets", description=f"xeon-cluster {settings.cluster_name}: the mesh key and run secrets in "
            "SSM (only the head's role decrypts)", enable_key_rotation=True, deletion_window_in_days=KEY_DELETION_DAYS,
            policy=self.role.arn.apply(lambda arn: key_policy(ctx, settings.cluster_name, arn)), tags=tags,
            opts=child)
        self.key_alias = aws.kms.Alias(f"{name}-secrets", name=key_alias(settings.cluster_name),
                                       target_key_id=self.key.id, opts=child)
        policy = pulumi.Output.all(store.bucket.arn, self.key.id).apply(
            lambda a: head_policy(ctx, settings.cluster_name, group_name(settings), a[0], store.prefix,
                                  key=key_arn(ctx, a[1])))
        self.policy = aws.iam.RolePolicy(f"{name}-head", role=self.role.id, policy=policy, opts=child)
        self.instance_profile = aws.iam.InstanceProfile(f"{name}-head", path=ROLE_PATH,
                                                        role=self.role.name, tags=tags, opts=child)
        if settings.image == "bake" and baked_ami is not None:
            ami = baked_ami  # the nodes' image: its venv runs the supervisors
        else:
            ami = aws.ssm.get_parameter_output(name=settings.ubuntu_ami_parameter,
                                               opts=pulumi.InvokeOutputOptions(parent=self)).value
        user_data = store.url.apply(lambda url: base64.b64encode(packed(head_user_data(settings, url))).decode())
        burstable = settings.head_instance_type.startswith("t")
        self.launch_template = aws.ec2.LaunchTemplate(
            f"{name}-head", image_id=ami, instance_type=settings.head_instance_type, key_name=key_name,
            user_data=user_data, iam_instance_profile={"arn": self.instance_profile.arn},
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required",
                              "http_put_response_hop_limit": 1},
            block_device_mappings=[{"device_name": UBUNTU_ROOT_DEVICE, "ebs": {
                "volume_size": HEAD_ROOT_GIB, "volume_type": "gp3", "encrypted": "true",
                "delete_on_termination": "true"}}],
            network_interfaces=[{"device_index": 0, "security_groups": [network.head_security_group.id],
                                 "associate_public_ip_address": "true", "delete_on_termination": "true"}],
            # standard credits: a busy head is throttled to its baseline rather than billed for surplus credits
            credit_specification={"cpu_credits": "standard"} if burstable else None,
            tag_specifications=[{"resource_type": "volume", "tags": tags},
                                {"resource_type": "instance", "tags": head_tags(settings)}],
            update_default_version=True, tags=tags,
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=template_ignores(settings)))
        # A group of one: a head that dies (or fails its EC2 health check) is replaced. On-demand only: a plain
        # launch template with no market options. A changed template replaces the head, the old one first.
        self.group = aws.autoscaling.Group(
            f"{name}-head", name=head_group_name(settings), min_size=1, max_size=1, desired_capacity=1,
            vpc_zone_identifiers=[network.subnet.id], health_check_type="EC2", health_check_grace_period=120,
            launch_template={"id": self.launch_template.id,
                             "version": self.launch_template.latest_version.apply(str)},
            instance_refresh={"strategy": "Rolling", "preferences": {
                "min_healthy_percentage": 0, "max_healthy_percentage": 100}},
            wait_for_capacity_timeout="10m",
            tags=[{"key": k, "value": v, "propagate_at_launch": True} for k, v in head_tags(settings).items()]
            + store_tag(store),
            # its rights are in place before it boots; a zone move replaces it (old one first) so that nothing
            # is left in the old subnet when Pulumi deletes it
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.policy, self.key_alias], delete_before_replace=True,
                                        replace_on_changes=["vpcZoneIdentifiers"]))
        self.register_outputs({"group": self.group.name})
