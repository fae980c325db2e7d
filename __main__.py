"""The Pulumi program: stack config -> ClusterSettings -> network, image, store, nodes, head -> stack outputs.

This is the only place that reads pulumi.Config; the components get validated settings.
"""
from __future__ import annotations

import pulumi
import pulumi_aws as aws

from core.errors import ClusterError
from infra import checks, cost
from infra.bucket import Store
from infra.head import HEAD_USER, Head
from infra.image import Image
from infra.network import Network
from infra.nodes import MIN_HEALTHY_PERCENT, ROLLING_KEYS, Nodes, group_name
from infra.policies import ROLE_PATH, boundary_name, boundary_policy, secrets_path
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
        checks.check_zone(settings, provider)
        ctx = checks.aws_context(provider, settings.region)  # partition, DNS suffix, account: ARNs built here
        network = Network(settings.cluster_name, settings, opts)
        store = Store(settings.cluster_name, settings, opts)
        boundary = permissions_boundary(settings, store, ctx, opts)
        image = Image(settings.cluster_name, settings, network, ctx.partition, opts, ec2_principal=ctx.ec2_principal,
                      boundary=boundary.arn)
        nodes = Nodes(settings.cluster_name, settings, network, image.ami_id, opts, store=store, ctx=ctx,
                      boundary=boundary.arn)
        head = Head(settings.cluster_name, settings, network, store, nodes.key.key_name, ctx, opts,
                    baked_ami=image.ami_id, boundary=boundary.arn)
    except ClusterError as exc:
        raise pulumi.RunError(str(exc)) from None  # one line, no traceback
    pulumi.log.info(checks.quota_line(settings))
    pulumi.log.info(checks.rolling_line(ROLLING_KEYS, settings.node_count, MIN_HEALTHY_PERCENT))

    estimate = cost.estimate(
        settings.instance_type, settings.node_count, availability_zone=settings.availability_zone,
        spot=settings.spot, root_volume_gib=settings.root_volume_gib, max_spot_price=settings.max_spot_price_usd,
        region=settings.region, head_instance_type=settings.head_instance_type)
    pulumi.log.info(f"estimated cost: {estimate.summary()}")

    outputs = {
        "clusterName": settings.cluster_name,
        "region": settings.region,
        "availabilityZone": settings.availability_zone,
        "instanceType": settings.instance_type,
        "instanceTypes": list(settings.instance_types),
        "nodeCount": settings.node_count,
        "spot": settings.spot,
        # The nodes come and go with spot capacity: 'fab status' lists the live ones (node 0 first).
        "autoScalingGroup": nodes.group.name,
        "sshUser": settings.ssh_user,
        "amiId": nodes.launch_template.image_id,  # the pinned one for image=base
        # the cluster's store: checkpoints, outputs and records next to the nodes (fab reads it as the default)
        "storeUrl": store.url,
        # the head (detached runs' supervisors): its group of one, its type and login, the run secrets' SSM path
        "headAutoScalingGroup": head.group.name,
        "headInstanceType": settings.head_instance_type,
        "headSshUser": HEAD_USER,
        "secretsPath": secrets_path(settings.cluster_name),
        # the customer-managed key of the SecureStrings under secretsPath (fab finds it by the alias)
        "secretsKeyAlias": head.key_alias.name,
        "secretsKeyArn": head.key.arn,
        # the permissions boundary on every role of the stack (docs/iam-policy-pulumi.json requires it)
        "permissionsBoundary": boundary.arn,
        "hourlyCostUsd": estimate.total_usd_h,
        "costEstimate": estimate.summary(),
    }
    if settings.image == "base":
        outputs["latestBaseAmiId"] = image.ami_id
        pulumi.Output.all(nodes.launch_template.image_id, image.ami_id).apply(lambda ids: _pinned_note(*ids))
    for key, value in outputs.items():
        pulumi.export(key, value)
    return outputs


def permissions_boundary(settings: ClusterSettings, store: Store, ctx: checks.AwsContext,
                         opts: pulumi.ResourceOptions) -> aws.iam.Policy:
    """The managed policy every role of the program carries as its permissions boundary: what the nodes, the head
    and the image build may do at most (infra.policies.boundary_policy), under the roles' path."""
    document = store.bucket.arn.apply(lambda arn: boundary_policy(ctx, settings.cluster_name, group_name(settings),
                                                                  arn, store.prefix))
    return aws.iam.Policy(f"{settings.cluster_name}-boundary", name=boundary_name(settings.cluster_name,
                          settings.region), path=ROLE_PATH, policy=document, tags=settings.tags,
                          description=f"xeon-cluster {settings.cluster_name}: the most any role of the cluster may do",
                          opts=opts)


def _pinned_note(pinned: str | None, latest: str | None) -> None:
    if pinned and latest and pinned != latest:
        pulumi.log.info(f"image=base: the nodes stay on {pinned}; Canonical's current AMI is {latest}: "
                        f"'pulumi config set image {latest}' rolls the nodes onto it")


if __name__ == "__main__":
    main()
