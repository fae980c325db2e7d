"""The nodes: one launch template (IMDSv2 only, encrypted gp3 root, spot, placement group, the
cluster's subnet and security group) and N instances from it, tagged with role and index so
that cluster.aws finds them in order.
"""
from __future__ import annotations

import base64

import pulumi
import pulumi_aws as aws

from core.constants import TAG_INDEX, TAG_PROFILE, TAG_ROLE, TAG_SSH_USER
from core.render import render
from infra.settings import ClusterSettings


def user_data(settings: ClusterSettings) -> str:
    return render("cloud-init.yaml.j2", cluster=settings.cluster_name, stack=settings.stack,
                  profile=settings.profile, image_mode=settings.image, index_tag=TAG_INDEX)


def node_tags(settings: ClusterSettings, index: int) -> dict[str, str]:
    return {**settings.tags, "Name": f"{settings.cluster_name}-{index}", TAG_INDEX: str(index),
            TAG_ROLE: "master" if index == 0 else "worker", TAG_SSH_USER: settings.ssh_user,
            TAG_PROFILE: settings.profile}


class Nodes(pulumi.ComponentResource):
    instances: list[aws.ec2.Instance]

    def __init__(self, name: str, settings: ClusterSettings, network, ami_id: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("xeon-cluster:infra:Nodes", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = settings.tags

        key = aws.ec2.KeyPair(f"{name}-key", public_key=settings.ssh_public_key.strip(), tags=tags, opts=child)
        # The root device name belongs to the AMI (/dev/sda1 on Ubuntu, /dev/xvda elsewhere); a wrong
        # name would add a second volume instead of sizing and encrypting the root one.
        root_device = aws.ec2.get_ami_output(
            filters=[{"name": "image-id", "values": [ami_id]}], opts=pulumi.InvokeOutputOptions(parent=self),
        ).root_device_name
        market = None
        if settings.spot:
            spot = {"instance_interruption_behavior": "terminate", "spot_instance_type": "one-time"}
            if settings.max_spot_price:
                spot["max_price"] = settings.max_spot_price
            market = {"market_type": "spot", "spot_options": spot}

        self.launch_template = aws.ec2.LaunchTemplate(
            f"{name}-lt", image_id=ami_id, instance_type=settings.instance_type, key_name=key.key_name,
            user_data=base64.b64encode(user_data(settings).encode()).decode(),
            # hop limit 1: containers on a node cannot borrow its credentials; tags feed cloud-init.
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required",
                              "http_put_response_hop_limit": 1, "instance_metadata_tags": "enabled"},
            block_device_mappings=[{"device_name": root_device, "ebs": {
                "volume_size": settings.root_volume_gib, "volume_type": "gp3", "encrypted": "true",
                "delete_on_termination": "true"}}],
            network_interfaces=[{"device_index": 0, "subnet_id": network.subnet.id,
                                 "security_groups": [network.security_group.id],
                                 "associate_public_ip_address": "true", "delete_on_termination": "true"}],
            placement={"group_name": network.placement_group.name},
            instance_market_options=market,
            tag_specifications=[{"resource_type": "volume", "tags": tags}],
            update_default_version=True, tags=tags, opts=child)

        version = self.launch_template.latest_version.apply(str)
        self.instances = [
            aws.ec2.Instance(f"{name}-{i}", launch_template={"id": self.launch_template.id, "version": version},
                             tags=node_tags(settings, i), opts=child)
            for i in range(settings.node_count)
        ]
        self.nodes = pulumi.Output.all(*[
            pulumi.Output.all(inst.public_ip, inst.private_ip).apply(
                lambda ips, i=i: {"name": f"{settings.cluster_name}-{i}", "index": i,
                                  "role": "master" if i == 0 else "worker", "publicIp": ips[0], "privateIp": ips[1]})
            for i, inst in enumerate(self.instances)
        ])
        self.register_outputs({"nodes": self.nodes, "launch_template_id": self.launch_template.id})
