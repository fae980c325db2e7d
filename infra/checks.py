"""Checks 'pulumi preview' makes against the account before any resource is planned: the zone
offers every node type, and how much vCPU quota the nodes need. Both fail or print at preview,
not 20 minutes into 'pulumi up'.
"""
from __future__ import annotations

import pulumi
import pulumi_aws as aws

from core import catalog
from core.errors import ClusterError
from infra.settings import ClusterSettings

# Service Quotas codes of the EC2 vCPU limits that cover the standard (C, M, R, ...) families.
SPOT_QUOTA = "L-34B43A08"  # All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests
ON_DEMAND_QUOTA = "L-1216C47A"  # Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances


def check_zone(settings: ClusterSettings, provider: pulumi.ProviderResource) -> None:
    """Refuse a zone that does not offer instanceType, a fallback type or (image=bake) buildInstanceType, naming
    the zones that do: Image Builder would otherwise fail there after minutes, not at preview."""
    build = (settings.build_instance_type,) if settings.image == "bake" else ()
    kinds = list(dict.fromkeys([*settings.instance_types, *build]))
    found = aws.ec2.get_instance_type_offerings(
        location_type="availability-zone", filters=[{"name": "instance-type", "values": kinds}],
        opts=pulumi.InvokeOptions(provider=provider))
    offered: dict[str, set[str]] = {}
    for kind, zone in zip(found.instance_types or [], found.locations or []):
        offered.setdefault(kind, set()).add(zone)
    for kind in kinds:
        zones = sorted(offered.get(kind, ()))
        if settings.availability_zone in zones:
            continue
        where = ", ".join(zones) if zones else f"no zone of {settings.region}"
        if kind not in settings.instance_types:  # the build instance only: another build type is the fix
            raise ClusterError(f"buildInstanceType {kind} is not offered in {settings.availability_zone} (offered in: "
                               f"{where}); run 'pulumi config set buildInstanceType' with a type offered there "
                               "(e.g. c6i.2xlarge or m6i.2xlarge)")
        fix = (f"run 'pulumi config set availabilityZone {zones[0]}'" if zones
               else "pick another region or instance type")
        raise ClusterError(f"{kind} is not offered in {settings.availability_zone} (offered in: {where}); {fix}")


def partition(provider: pulumi.ProviderResource) -> str:
    """aws, aws-cn or aws-us-gov: managed policy ARNs differ between them."""
    return aws.get_partition(opts=pulumi.InvokeOptions(provider=provider)).partition or "aws"


def quota_line(settings: ClusterSettings) -> str:
    vcpus = max(catalog.lookup(t).vcpus for t in settings.instance_types) * settings.node_count
    code, market = (SPOT_QUOTA, "spot") if settings.spot else (ON_DEMAND_QUOTA, "on-demand")
    return (f"the nodes need {vcpus} {market} vCPUs of quota {code} in {settings.region}; see it with 'aws "
            f"service-quotas get-service-quota --service-code ec2 --quota-code {code} --region {settings.region}'")


def rolling_line(keys: tuple[str, ...], node_count: int, min_healthy: int) -> str:
    at_once = max(1, node_count - node_count * min_healthy // 100)
    return (f"changing any of {', '.join(keys)} rolls the nodes (instance refresh: {at_once} of {node_count} "
            f"at a time, never more than {node_count} running); a run in progress on them fails")
