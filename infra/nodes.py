"""The nodes: one launch template (IMDSv2 only, encrypted gp3 root, the cluster's security group)
and one Auto Scaling group over it, in the placement group, holding the stack's node count.

Why an Auto Scaling group and not an EC2 Fleet of type maintain: both replace a reclaimed spot node
by themselves, but only the group rolls a changed launch template (instance refresh) with a cap of
100% healthy capacity, so a new AMI or user data never doubles the spot vCPU quota or the placement
group; it can also replace nodes ahead of reclaim (capacity rebalancing, off unless capacityRebalance is
true: the early replacement ends the run even when no reclaim follows). Node order is not the
group's business: cluster.aws makes the node holding the master role tag node 0.
"""
from __future__ import annotations

import base64

import pulumi
import pulumi_aws as aws

from core.constants import PROJECT_ROOT, TAG_IMAGE, TAG_PROFILE, TAG_ROLE, TAG_SSH_USER, TAG_STORE
from core.render import render
from infra.checks import AwsContext
from infra.policies import ROLE_PATH, ec2_trust_policy, mesh_key_public_parameter, node_policy
from infra.settings import ClusterSettings

# Stack config keys whose change makes a new launch template version, which the group rolls out.
ROLLING_KEYS = ("image", "ubuntuVersion", "profile", "instanceType", "fallbackInstanceTypes", "rootVolumeGib",
                "sshPublicKey", "sshUser", "maxSpotPrice", "spot")
MIN_HEALTHY_PERCENT = 50  # a roll replaces at most half the nodes at a time, and never adds any
# The group's own terminations (capacity rebalancing, instance refresh, scale-in) give no spot notice: this
# hook holds a leaving node until it completes the action (after its checkpoint is safe) or the heartbeat
# runs out (then CONTINUE): long enough to save a bert-base checkpoint with its optimizer state (~1.3 GB)
# and move it off the node.
TERMINATION_HOOK = "xc-checkpoint"
TAG_MARKET = "xeon-cluster:market"  # in the launch template: a market change makes a new version, which rolls
TERMINATION_HEARTBEAT_S = 300


def group_name(settings: ClusterSettings) -> str:
    return f"{settings.cluster_name}-nodes"


def user_data(settings: ClusterSettings) -> str:
    return render("cloud-init.yaml.j2", role="node", cluster=settings.cluster_name, env=node_env(settings),
                  publisher=(PROJECT_ROOT / "node_setup" / "publish_host_keys.py").read_text())


def node_env(settings: ClusterSettings) -> dict[str, str]:
    """/etc/xeon-cluster/cluster.env of a node (training/runtime/spot.py reads the group and hook names there)."""
    return {"XC_CLUSTER": settings.cluster_name, "XC_STACK": settings.stack, "XC_PROFILE": settings.profile,
            "XC_IMAGE_MODE": settings.image, "XC_REGION": settings.region, "XC_ASG_NAME": group_name(settings),
            "XC_LIFECYCLE_HOOK": TERMINATION_HOOK, "XC_SSH_USER": settings.ssh_user,
            "XC_MESH_KEY_PARAMETER": mesh_key_public_parameter(settings.cluster_name)}


def termination_hook() -> dict:
    return {"name": TERMINATION_HOOK, "lifecycle_transition": "autoscaling:EC2_INSTANCE_TERMINATING",
            "heartbeat_timeout": TERMINATION_HEARTBEAT_S, "default_result": "CONTINUE"}


def node_tags(settings: ClusterSettings) -> dict[str, str]:
    """Tags every node is launched with; discovery moves the role tag to 'master' on node 0."""
    return {**settings.tags, "Name": f"{settings.cluster_name}-node", TAG_ROLE: "worker",
            TAG_SSH_USER: settings.ssh_user, TAG_PROFILE: settings.profile,
            # base: a replacement boots stock Ubuntu without the profile (--max-restarts refuses it)
            TAG_IMAGE: settings.image if settings.image in ("bake", "base") else "ami"}


def store_tag(store) -> list[dict]:
    """The group names the store bucket it writes: 'fab sweep --include-store' never empties a live group's store,
    and may remove an older bucket of the same cluster that no live group names (infra/bucket.py storeBucket)."""
    return [] if store is None else [{"key": TAG_STORE, "value": store.bucket.id, "propagate_at_launch": False}]


def template_options(settings: ClusterSettings, parent: pulumi.Resource) -> pulumi.ResourceOptions:
    # image=base resolves Canonical's current AMI on every run: without the pin a new Ubuntu
    # release would roll every node on the next unrelated 'pulumi up'.
    ignore = ["imageId"] if settings.image == "base" else []
    return pulumi.ResourceOptions(parent=parent, ignore_changes=ignore)


def instances_distribution(settings: ClusterSettings) -> dict:
    if not settings.spot:
        return {"on_demand_base_capacity": settings.node_count, "on_demand_percentage_above_base_capacity": 100}
    spot = {"on_demand_base_capacity": 0, "on_demand_percentage_above_base_capacity": 0,
            "spot_allocation_strategy": "capacity-optimized"}
    if settings.max_spot_price:
        spot["spot_max_price"] = settings.max_spot_price
    return spot


# A change of these moves every node (another zone's subnet and placement group): the group is replaced, the old
# one first (its nodes drain through the termination hook, which lives in the group itself and so holds them to
# the end), then the new one launches; the old subnet and placement group go last, once nothing is in them. One
# 'pulumi up', never more than nodeCount nodes.
REPLACING_CHANGES = ["vpcZoneIdentifiers", "placementGroup", "initialLifecycleHooks"]


class Nodes(pulumi.ComponentResource):
    def __init__(self, name: str, settings: ClusterSettings, network, ami_id: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None, store=None, ctx: AwsContext | None = None,
                 boundary: pulumi.Input[str] | None = None):
        super().__init__("xeon-cluster:infra:Nodes", name, None, opts)
        ctx = ctx or AwsContext(region=settings.region)
        child = pulumi.ResourceOptions(parent=self)
        tags = settings.tags

        self.key = aws.ec2.KeyPair(f"{name}-key", public_key=settings.ssh_public_key.strip(), tags=tags, opts=child)
        # The nodes' own identity (IMDSv2, hop limit 1). Its policy names the group by the ARN its name gives, so
        # the policy is in place before the group launches anything: a node's first boot finds its rights.
        self.role = aws.iam.Role(f"{name}-node", path=ROLE_PATH, tags=tags, opts=child,
                                 assume_role_policy=ec2_trust_policy(ctx.ec2_principal), permissions_boundary=boundary)
        bucket_arn = store.bucket.arn if store is not None else None
        prefix = store.prefix if store is not None else None
        policy = pulumi.Output.from_input(bucket_arn).apply(
            lambda arn: node_policy(ctx, settings.cluster_name, group_name(settings), arn, prefix))
        self.node_policy = aws.iam.RolePolicy(f"{name}-node", role=self.role.id, policy=policy, opts=child)
        self.instance_profile = aws.iam.InstanceProfile(f"{name}-node", path=ROLE_PATH,
                                                        role=self.role.name, tags=tags, opts=child)
        # The root device name belongs to the AMI (/dev/sda1 on Ubuntu, /dev/xvda elsewhere); a wrong
        # name would add a second volume instead of sizing and encrypting the root one.
        root_device = aws.ec2.get_ami_output(
            filters=[{"name": "image-id", "values": [ami_id]}], opts=pulumi.InvokeOutputOptions(parent=self),
        ).root_device_name

        self.launch_template = aws.ec2.LaunchTemplate(
            f"{name}-lt", image_id=ami_id, instance_type=settings.instance_type, key_name=self.key.key_name,
            user_data=base64.b64encode(user_data(settings).encode()).decode(),
            iam_instance_profile={"arn": self.instance_profile.arn},
            # hop limit 1: containers on a node cannot borrow its credentials
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required",
                              "http_put_response_hop_limit": 1},
            block_device_mappings=[{"device_name": root_device, "ebs": {
                "volume_size": settings.root_volume_gib, "volume_type": "gp3", "encrypted": "true",
                "delete_on_termination": "true"}}],
            # no subnet here: the group places nodes in its own subnet list
            network_interfaces=[{"device_index": 0, "security_groups": [network.security_group.id],
                                 "associate_public_ip_address": "true", "delete_on_termination": "true"}],
            # spot, maxSpotPrice and sshUser live in the group's distribution and tags, which an instance
            # refresh with skip_matching ignores: naming them in the template makes a change roll the nodes.
            tag_specifications=[{"resource_type": "volume", "tags": tags}, {"resource_type": "instance", "tags": {
                **tags, TAG_MARKET: f"spot:{settings.max_spot_price or 'on-demand-price'}" if settings.spot
                else "on-demand", TAG_SSH_USER: settings.ssh_user}}],
            update_default_version=True, tags=tags, opts=template_options(settings, self))

        self.group = aws.autoscaling.Group(
            f"{name}-nodes", name=group_name(settings),
            min_size=settings.node_count, max_size=settings.node_count, desired_capacity=settings.node_count,
            vpc_zone_identifiers=[network.subnet.id], placement_group=network.placement_group.name,
            health_check_type="EC2", health_check_grace_period=120,
            capacity_rebalance=settings.capacity_rebalance,  # spot only (settings.py)
            mixed_instances_policy={
                "instances_distribution": instances_distribution(settings),
                "launch_template": {
                    "launch_template_specification": {
                        "launch_template_id": self.launch_template.id,
                        "version": self.launch_template.latest_version.apply(str)},
                    "overrides": [{"instance_type": t} for t in settings.instance_types]}},
            instance_refresh={"strategy": "Rolling", "preferences": {
                "min_healthy_percentage": MIN_HEALTHY_PERCENT, "max_healthy_percentage": 100,
                "skip_matching": True}},
            wait_for_capacity_timeout="20m",
            # in the group from its creation: the first nodes are held too, and the hook leaves with the group
            # (after draining it), not before it
            initial_lifecycle_hooks=[termination_hook()],
            tags=[{"key": k, "value": v, "propagate_at_launch": True} for k, v in node_tags(settings).items()]
            + store_tag(store),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.node_policy], delete_before_replace=True,
                                        replace_on_changes=REPLACING_CHANGES))
        self.register_outputs({"group": self.group.name, "launch_template_id": self.launch_template.id})
