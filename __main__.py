"""The Pulumi program: stack config -> ClusterSettings -> network, image, nodes -> stack outputs.

This is the only place that reads pulumi.Config; the components get validated settings.
"""
from __future__ import annotations

import pulumi
import pulumi_aws as aws

from core.errors import ClusterError
from infra import cost
from infra.image import Image
from infra.network import Network
from infra.nodes import Nodes
from infra.settings import CONFIG_KEYS, ClusterSettings


def read_settings() -> ClusterSettings:
    config = pulumi.Config()
    return ClusterSettings.from_config({key: config.get(key) for key in CONFIG_KEYS}, stack=pulumi.get_stack())


def main() -> dict:
    try:
        settings = read_settings()
        # One explicit provider: the region is stack config like everything else, and default tags
        # mark every resource as this cluster's.
        provider = aws.Provider("aws", region=settings.region, default_tags={"tags": settings.tags})
        opts = pulumi.ResourceOptions(providers=[provider])
        network = Network(settings.cluster_name, settings, opts)
        image = Image(settings.cluster_name, settings, network, opts)
        nodes = Nodes(settings.cluster_name, settings, network, image.ami_id, opts)
    except ClusterError as exc:
        raise pulumi.RunError(str(exc)) from None  # one line, no traceback

    estimate = cost.estimate(
        settings.instance_type, settings.node_count, availability_zone=settings.availability_zone,
        spot=settings.spot, root_volume_gib=settings.root_volume_gib, max_spot_price=settings.max_spot_price_usd,
        region=settings.region)
    pulumi.log.info(f"estimated cost: {estimate.summary()}")

    master = nodes.instances[0]
    outputs = {
        "clusterName": settings.cluster_name,
        "region": settings.region,
        "availabilityZone": settings.availability_zone,
        "instanceType": settings.instance_type,
        "nodes": nodes.nodes,
        "masterPrivateIp": master.private_ip,
        "masterPublicIp": master.public_ip,
        "sshUser": settings.ssh_user,
        "sshCommand": pulumi.Output.concat("ssh ", settings.ssh_user, "@", master.public_ip),
        "amiId": image.ami_id,
        # mpirun's hostfile as the seeds write it: private addresses, master first.
        "hostfile": nodes.nodes.apply(lambda ns: "".join(f"{n['privateIp']}\n" for n in ns)),
        "hourlyCostUsd": estimate.total_usd_h,
        "costEstimate": estimate.summary(),
    }
    for key, value in outputs.items():
        pulumi.export(key, value)
    return outputs


if __name__ == "__main__":
    main()
