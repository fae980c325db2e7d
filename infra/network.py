"""The cluster's network: its own VPC with one public subnet in one zone, the nodes' security group that
admits SSH from the operator and the head and everything else only from its own members, the head's own
security group (SSH from the operator only), the image build's own (image=bake: egress only, nothing admitted),
and a cluster placement group (10 Gbit/s single flows instead of 5, lowest latency between nodes).
"""
from __future__ import annotations

import ipaddress

import pulumi
import pulumi_aws as aws

from infra.settings import ZONE_SLICE_BITS, ClusterSettings

ALL = {"protocol": "-1", "from_port": 0, "to_port": 0}
SSH = {"protocol": "tcp", "from_port": 22, "to_port": 22}


def subnet_cidr(vpc_cidr: str, zone: str) -> str:
    """The VPC's slice of the zone letter (a..h: eight slices, ClusterSettings checks one holds the nodes): a
    changed availabilityZone replaces the subnet (create before delete), and the new one, in its own letter's
    slice, never overlaps the old one, whichever two zones (a->c and b->d as well as a->b)."""
    slices = list(ipaddress.ip_network(vpc_cidr).subnets(prefixlen_diff=ZONE_SLICE_BITS))
    return str(slices[(ord(zone[-1]) - ord("a")) % len(slices)])


class Network(pulumi.ComponentResource):
    def __init__(self, name: str, settings: ClusterSettings, opts: pulumi.ResourceOptions | None = None):
        super().__init__("xeon-cluster:infra:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = settings.tags

        vpc = aws.ec2.Vpc(f"{name}-vpc", cidr_block=settings.vpc_cidr, enable_dns_support=True,
                          enable_dns_hostnames=True, tags={**tags, "Name": settings.cluster_name}, opts=child)
        gateway = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, tags=tags, opts=child)
        # One subnet = one zone for every node, the head and the image build instance (which needs a public IP).
        self.subnet = aws.ec2.Subnet(
            f"{name}-subnet", vpc_id=vpc.id, cidr_block=subnet_cidr(settings.vpc_cidr, settings.availability_zone),
            availability_zone=settings.availability_zone, map_public_ip_on_launch=True,
            tags={**tags, "Name": f"{settings.cluster_name}-{settings.availability_zone}"}, opts=child)
        routes = aws.ec2.RouteTable(f"{name}-routes", vpc_id=vpc.id, tags=tags, opts=child,
                                    routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": gateway.id}])
        aws.ec2.RouteTableAssociation(f"{name}-routes-assoc", subnet_id=self.subnet.id, route_table_id=routes.id,
                                      opts=child)

        egress = [{"description": "package mirrors, model hubs, AWS APIs", **ALL, "cidr_blocks": ["0.0.0.0/0"]}]
        ssh_from_admin = {"description": "SSH from the operator", **SSH, "cidr_blocks": [settings.admin_cidr]}
        # The head holds the mesh key and run secrets and runs no user code: its own group, SSH from the operator
        # only. Nodes reach it on no port (it connects to them; security groups let the replies back).
        self.head_security_group = aws.ec2.SecurityGroup(
            f"{name}-head-sg", vpc_id=vpc.id, tags={**tags, "Name": f"{settings.cluster_name}-head"}, opts=child,
            description=f"xeon-cluster {settings.cluster_name} head: SSH from the operator only",
            ingress=[ssh_from_admin], egress=egress)
        self.security_group = aws.ec2.SecurityGroup(
            f"{name}-sg", vpc_id=vpc.id, tags=tags, opts=child,
            description=f"xeon-cluster {settings.cluster_name}: SSH from the operator, all traffic between nodes",
            ingress=[
                ssh_from_admin,
                # the head's supervisors start and stop runs on the nodes over SSH
                {"description": "SSH from the head", **SSH, "security_groups": [self.head_security_group.id]},
                # mpirun, oneCCL and gloo pick ephemeral ports: open them all, to members only.
                {"description": "all traffic between cluster nodes", **ALL, "self": True},
            ],
            egress=egress,
        )
        # The image build instance runs pip and git downloads: no member of the nodes' group (open on every port
        # between members), nothing admitted at all (Image Builder drives it through SSM, outbound).
        self.build_security_group = aws.ec2.SecurityGroup(
            f"{name}-build-sg", vpc_id=vpc.id, tags={**tags, "Name": f"{settings.cluster_name}-build"}, opts=child,
            description=f"xeon-cluster {settings.cluster_name} image build: egress only", ingress=[],
            egress=egress) if settings.image == "bake" else None
        # A cluster placement group lives in one zone: its name carries the zone so that a move replaces it.
        self.placement_group = aws.ec2.PlacementGroup(f"{name}-pg", name=f"{settings.cluster_name}-{settings.availability_zone}",
                                                      strategy="cluster", tags=tags, opts=child)

        self.register_outputs({"subnet_id": self.subnet.id, "security_group_id": self.security_group.id,
                               "head_security_group_id": self.head_security_group.id,
                               "placement_group": self.placement_group.name})
