"""Checks 'pulumi preview' makes against the account before any resource is planned: the zone
offers every node type, and how much vCPU quota the nodes need. Both fail or print at preview,
not 20 minutes into 'pulumi up'.
"""
from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from core import catalog
from core.errors import ClusterError
from infra.settings import ClusterSettings

# Service Quotas codes of the EC2 vCPU limits that cover the standard (C, M, R, ...) families.
SPOT_QUOTA = "L-34B43A08"  # All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests
ON_DEMAND_QUOTA = "L-1216C47A"  # Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances


def check_zone(settings: ClusterSettings, provider: pulumi.ProviderResource) -> None:
    """Refuse a zone that does not offer instanceType, a fallback type, headInstanceType or (image=bake)
    buildInstanceType, naming the zones that do: Image Builder or the head's group would otherwise fail there after
    minutes (the group's capacity wait), not at preview."""
    build = (settings.build_instance_type,) if settings.image == "bake" else ()
    kinds = list(dict.fromkeys([*settings.instance_types, *build, settings.head_instance_type]))
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
        if kind == settings.head_instance_type and kind not in settings.instance_types:
            raise ClusterError(f"headInstanceType {kind} is not offered in {settings.availability_zone} (offered in: "
                               f"{where})", fix="run 'pulumi config set headInstanceType' with a type offered there "
                               "(e.g. t3.medium or m6i.large)")
        if kind not in settings.instance_types:  # the build instance only: another build type is the fix
            raise ClusterError(f"buildInstanceType {kind} is not offered in {settings.availability_zone} (offered in: "
                               f"{where})", fix="run 'pulumi config set buildInstanceType' with a type offered there "
                               "(e.g. c6i.2xlarge or m6i.2xlarge)")
        fix = (f"run 'pulumi config set availabilityZone {zones[0]}'" if zones
               else "pick another region or instance type")
        raise ClusterError(f"{kind} is not offered in {settings.availability_zone} (offered in: {where})", fix=f"{fix}")


@dataclass(frozen=True)
class AwsContext:
    """Where the stack runs, for the ARNs and endpoints the program writes itself: aws, aws-cn or aws-us-gov
    (managed policy, S3 and Auto Scaling ARNs differ between them), the partition's DNS suffix (amazonaws.com,
    amazonaws.com.cn), the account and EC2's service principal there."""
    partition: str = "aws"
    dns_suffix: str = "amazonaws.com"
    account: str = "*"  # unknown (a preview without credentials): any account, still this partition and group
    region: str = "us-east-1"
    ec2_principal: str = "ec2.amazonaws.com"

    def group_arn(self, group: str) -> str:
        """An Auto Scaling group's ARN from its name: known before the group exists, so a policy naming it
        can be in place before the group launches its first instance."""
        return (f"arn:{self.partition}:autoscaling:{self.region}:{self.account}:autoScalingGroup:*:"
                f"autoScalingGroupName/{group}")

    def ssm_path_arns(self, path: str) -> list[str]:
        """The parameters under ``path`` (/xeon-cluster/<cluster>) and the path itself (GetParametersByPath)."""
        base = f"arn:{self.partition}:ssm:{self.region}:{self.account}:parameter{path}"
        return [base, f"{base}/*"]


def aws_context(provider: pulumi.ProviderResource, region: str) -> AwsContext:
    opts = pulumi.InvokeOptions(provider=provider)
    part = aws.get_partition(opts=opts)
    account = aws.get_caller_identity(opts=opts).account_id
    principal = aws.get_service_principal(service_name="ec2", region=region, opts=opts).name
    partition = part.partition or "aws"
    return AwsContext(partition=partition, dns_suffix=part.dns_suffix or _DNS_SUFFIX.get(partition, "amazonaws.com"),
                      account=account or "*", region=region, ec2_principal=principal or "ec2.amazonaws.com")


_DNS_SUFFIX = {"aws-cn": "amazonaws.com.cn"}


def quota_line(settings: ClusterSettings) -> str:
    """The vCPUs of quota the nodes and the on-demand head take, by quota code."""
    vcpus = max(catalog.lookup(t).vcpus for t in settings.instance_types) * settings.node_count
    head = catalog.HEAD_VCPUS[settings.head_instance_type]
    see = (f"see {{}} with 'aws service-quotas get-service-quota --service-code ec2 --quota-code {{}} "
           f"--region {settings.region}'")
    if settings.spot:
        return (f"the nodes need {vcpus} spot vCPUs of quota {SPOT_QUOTA} and the head {head} on-demand vCPUs of "
                f"quota {ON_DEMAND_QUOTA} in {settings.region}; " + see.format("each", "CODE") +
                f" (CODE {SPOT_QUOTA}, then {ON_DEMAND_QUOTA})")
    return (f"the nodes and the head need {vcpus + head} on-demand vCPUs ({vcpus} + {head}) of quota "
            f"{ON_DEMAND_QUOTA} in {settings.region}; " + see.format("it", ON_DEMAND_QUOTA))


def rolling_line(keys: tuple[str, ...], node_count: int, min_healthy: int) -> str:
    at_once = max(1, node_count - node_count * min_healthy // 100)
    return (f"changing any of {', '.join(keys)} rolls the nodes (instance refresh: {at_once} of {node_count} "
            f"at a time, never more than {node_count} running); a run in progress on them checkpoints at the "
            "termination hook and ends preempted: 'fab train --resume RUN_ID' (or --max-restarts) continues it")
