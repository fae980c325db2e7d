"""Deleting what ``fab sweep`` found, in dependency order: whatever launches instances first (so nothing
relaunches them), then the instances (waited for), what they used, Image Builder, IAM, logs, and the
network last. Each deletion prints one line; a failure is one line too and the sweep goes on.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable

from cluster import aws
from training.runtime.paths import RunPaths

# The order of deletion, and of the table fab sweep prints.
ORDER = (
    "auto scaling group", "ec2 fleet", "spot fleet", "spot request", "instance", "launch template", "ami",
    "snapshot", "volume", "key pair", "placement group", "imagebuilder pipeline", "imagebuilder image",
    "imagebuilder recipe", "imagebuilder component", "imagebuilder infra config", "imagebuilder distribution",
    "instance profile", "iam role", "iam policy", "log group", "ssm parameter", "kms key", "store objects",
    "s3 bucket", "network interface", "elastic ip", "security group", "subnet", "route table", "internet gateway", "vpc",
)
KEY_WAIT_DAYS = 7  # KMS's shortest wait before it deletes a key (infra/head.py KEY_DELETION_DAYS)
VERBS = {"spot fleet": "cancelled", "spot request": "cancelled", "instance": "terminated", "ami": "deregistered",
         "elastic ip": "released", "kms key": f"scheduled the deletion (in {KEY_WAIT_DAYS} days, billed no more) of"}
# A network piece that an instance just let go of can take a minute to be free (DependencyViolation).
BUSY_CODES = {"DependencyViolation", "InvalidNetworkInterface.InUse", "ResourceInUse"}
BUSY_TRIES, BUSY_WAIT_S = 7, 10
WAIT_S = 600  # for Auto Scaling groups and instances to be gone


class Failed(Exception):
    """A deletion that AWS answered but did not do."""


def delete_all(clients, orphans: list, out, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Delete ``orphans`` (sweep.run.Orphan) in ORDER; returns one line per failure, already printed."""
    failures: list[str] = []

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    def attempt(o, fn, done: str = "") -> bool:
        from botocore.exceptions import BotoCoreError, ClientError
        from botocore.parsers import ResponseParserError

        for tries in range(1, BUSY_TRIES + 1):
            try:
                fn()
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if _gone(code):
                    say(f"{o.kind} {o.id}: already gone")
                    return True
                if code in BUSY_CODES and tries < BUSY_TRIES:
                    sleep(BUSY_WAIT_S)
                    continue
                reason = f"{code}: {_first_line(exc.response.get('Error', {}).get('Message', ''))}"
            except (BotoCoreError, ResponseParserError, Failed) as exc:
                reason = _first_line(str(exc))
            else:
                say(done or f"{VERBS.get(o.kind, 'deleted')} {o.kind} {o.id}" + (f" ({o.name})" if o.name else ""))
                return True
            failures.append(f"could not delete {o.kind} {o.id}: {reason}")
            say(failures[-1])
            return False
        return False

    by_kind: dict[str, list] = {}
    for o in orphans:
        by_kind.setdefault(o.kind, []).append(o)
    for kind in ORDER:
        items = by_kind.get(kind, [])
        if kind == "security group" and items:
            _revoke_cross_references(clients["ec2"], items, attempt)
        for o in items if kind == "s3 bucket" else []:
            runs = o.ref.get("runs", [])
            say(f"emptying s3 bucket {o.id} ({o.name}" + (f"; runs {', '.join(runs)}" if runs else "")
                + "): its checkpoints, outputs and run records go with it")
        done = [o for o in items if attempt(o, functools.partial(DELETE[kind], clients, o))]
        if kind == "ami":
            for o in done:
                for snap in o.ref.get("untagged_snapshots", []):
                    say(f"note: snapshot {snap} of {o.id} has no cluster tag, so it stays (billed); delete it "
                        f"with 'aws ec2 delete-snapshot --snapshot-id {snap}'")
        for o in done if kind == "kms key" else []:
            for alias in o.ref.get("aliases", []):  # no right of fab's reaches an alias: it goes with its key
                say(f"note: alias {alias} goes with key {o.id} when KMS deletes it; a 'pulumi up' of cluster "
                    f"{o.cluster} before then needs it gone: 'aws kms delete-alias --alias-name {alias}'")
        if kind in WAIT and done:
            try:
                WAIT[kind](clients, [o.id for o in done], sleep)
            except Exception as exc:  # noqa: BLE001 - any failure to wait is one more line, not an abort
                failures.append(f"could not see the {kind}s {', '.join(o.id for o in done)} gone: "
                                f"{_first_line(str(exc))}")
                say(failures[-1])
    return failures


def _gone(code: str) -> bool:
    return code.endswith(("NotFound", "NotFoundException")) or code in ("NoSuchEntity", "ResourceNotFoundException",
                                                                        "NoSuchBucket")


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def _revoke_cross_references(ec2, groups: list, attempt) -> None:
    """Rules of one swept group that name another keep that other one from being deleted."""
    ids = {g.id for g in groups}
    for g in groups:
        for direction, rules in (("ingress", g.ref.get("ingress", [])), ("egress", g.ref.get("egress", []))):
            refs = [_only_pairs(rule, ids - {g.id}) for rule in rules]
            refs = [r for r in refs if r]
            if refs:
                revoke = ec2.revoke_security_group_ingress if direction == "ingress" \
                    else ec2.revoke_security_group_egress
                attempt(g, lambda g=g, revoke=revoke, refs=refs: revoke(GroupId=g.id, IpPermissions=refs),
                        f"revoked the {direction} rules of security group {g.id} that name other swept groups")


def _only_pairs(rule: dict, others: set[str]) -> dict | None:
    pairs = [{"GroupId": p["GroupId"]} for p in rule.get("UserIdGroupPairs", []) if p.get("GroupId") in others]
    if not pairs:
        return None
    keep = {k: rule[k] for k in ("IpProtocol", "FromPort", "ToPort") if k in rule}
    return {**keep, "UserIdGroupPairs": pairs}


# -- one deletion per kind ---------------------------------------------------------------------
def _fleet(c, o) -> None:
    reply = c["ec2"].delete_fleets(FleetIds=[o.id], TerminateInstances=True)
    for bad in reply.get("UnsuccessfulFleetDeletions", []):
        raise Failed(f"{bad.get('Error', {}).get('Code')}: {bad.get('Error', {}).get('Message')}")


def _spot_fleet(c, o) -> None:
    reply = c["ec2"].cancel_spot_fleet_requests(SpotFleetRequestIds=[o.id], TerminateInstances=True)
    for bad in reply.get("UnsuccessfulFleetRequests", []):
        raise Failed(f"{bad.get('Error', {}).get('Code')}: {bad.get('Error', {}).get('Message')}")


def _instance_profile(c, o) -> None:
    for role in o.ref.get("roles", []):
        c["iam"].remove_role_from_instance_profile(InstanceProfileName=o.id, RoleName=role)
    c["iam"].delete_instance_profile(InstanceProfileName=o.id)


def _role(c, o) -> None:
    iam = c["iam"]
    for page in iam.get_paginator("list_attached_role_policies").paginate(RoleName=o.id):
        for policy in page["AttachedPolicies"]:
            iam.detach_role_policy(RoleName=o.id, PolicyArn=policy["PolicyArn"])
    for page in iam.get_paginator("list_role_policies").paginate(RoleName=o.id):
        for policy in page["PolicyNames"]:
            iam.delete_role_policy(RoleName=o.id, PolicyName=policy)
    iam.delete_role(RoleName=o.id)


def _policy(c, o) -> None:
    """A managed policy (the roles' permissions boundary): its other versions first, as IAM requires."""
    iam = c["iam"]
    for page in iam.get_paginator("list_policy_versions").paginate(PolicyArn=o.ref["arn"]):
        for version in page["Versions"]:
            if not version["IsDefaultVersion"]:
                iam.delete_policy_version(PolicyArn=o.ref["arn"], VersionId=version["VersionId"])
    iam.delete_policy(PolicyArn=o.ref["arn"])


def _address(c, o) -> None:
    if o.ref.get("association"):
        c["ec2"].disassociate_address(AssociationId=o.ref["association"])
    c["ec2"].release_address(AllocationId=o.id)


def _route_table(c, o) -> None:
    for assoc in o.ref.get("associations", []):
        c["ec2"].disassociate_route_table(AssociationId=assoc)
    c["ec2"].delete_route_table(RouteTableId=o.id)


def _gateway(c, o) -> None:
    for vpc in o.ref.get("vpcs", []):
        c["ec2"].detach_internet_gateway(InternetGatewayId=o.id, VpcId=vpc)
    c["ec2"].delete_internet_gateway(InternetGatewayId=o.id)


def _versions(s3, bucket: str, batch: list[dict]) -> None:
    """These object versions and delete markers ({Key, VersionId}), a thousand a call."""
    for i in range(0, len(batch), 1000):
        reply = s3.delete_objects(Bucket=bucket, Delete={"Objects": batch[i:i + 1000], "Quiet": True})
        for bad in reply.get("Errors", [])[:1]:
            raise Failed(f"{bad.get('Code')}: {bad.get('Message')} ({bad.get('Key')}; "
                         f"{len(reply['Errors'])} object(s) not deleted)")


def _bucket(c, o) -> None:
    """Every object version and delete marker, then the bucket."""
    s3 = c["s3"]
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=o.id):
        _versions(s3, o.id, [{"Key": v["Key"], "VersionId": v["VersionId"]}
                             for v in page.get("Versions", []) + page.get("DeleteMarkers", [])])
    s3.delete_bucket(Bucket=o.id)


def _store_objects(c, o) -> None:
    """What no run needs in a kept store (sweep.find.LEFTOVERS), every version of it; a run's log parts
    first compacted into its log.txt where that is shorter (a run cut short before its end published it). Never
    while the cluster's Auto Scaling groups exist: its head and nodes read them."""
    from botocore.exceptions import ClientError

    live = c["autoscaling"].describe_auto_scaling_groups(
        AutoScalingGroupNames=[aws.node_group(o.cluster), aws.head_group(o.cluster)]).get("AutoScalingGroups", [])
    if live:
        raise Failed(f"the Auto Scaling group {live[0]['AutoScalingGroupName']} still exists, and its head and "
                     "nodes may need them; run 'pulumi destroy' first")
    s3, bucket, gaps = c["s3"], o.ref["bucket"], []
    for log, parts in o.ref.get("logs", {}).items():
        offsets = [int(key.rsplit("/", 1)[1]) for key, _ in parts]
        end = max(offset + size for offset, (_, size) in zip(offsets, parts))
        try:
            whole = s3.head_object(Bucket=bucket, Key=log)["ContentLength"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
            whole = 0
        if end <= whole:
            continue
        if offsets != [sum(size for _, size in parts[:i]) for i in range(len(parts))]:
            gaps.append(log)  # a missing part: its log.txt, shorter, and the parts stay as they are
            continue
        data = b"".join(s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key, _ in parts)
        s3.put_object(Bucket=bucket, Key=log, Body=data, Tagging=RunPaths.LOG_TAG)
    skip = {key for log in gaps for key, _ in o.ref["logs"][log]}
    _versions(s3, bucket, [v for v in o.ref["versions"] if v["Key"] not in skip])
    if gaps:
        raise Failed(f"the log parts of {', '.join(gaps)} have a gap and its log.txt is shorter: they stay")


def _ib(op: str, param: str):
    return lambda c, o: getattr(c["imagebuilder"], op)(**{param: o.ref["arn"]})


DELETE: dict[str, Callable] = {
    "auto scaling group": lambda c, o: c["autoscaling"].delete_auto_scaling_group(AutoScalingGroupName=o.id,
                                                                                  ForceDelete=True),
    "ec2 fleet": _fleet,
    "spot fleet": _spot_fleet,
    "spot request": lambda c, o: c["ec2"].cancel_spot_instance_requests(SpotInstanceRequestIds=[o.id]),
    "instance": lambda c, o: c["ec2"].terminate_instances(InstanceIds=[o.id]),
    "launch template": lambda c, o: c["ec2"].delete_launch_template(LaunchTemplateId=o.id),
    "ami": lambda c, o: c["ec2"].deregister_image(ImageId=o.id),
    "snapshot": lambda c, o: c["ec2"].delete_snapshot(SnapshotId=o.id),
    "volume": lambda c, o: c["ec2"].delete_volume(VolumeId=o.id),
    # by name: moto ignores KeyPairId, AWS takes either
    "key pair": lambda c, o: c["ec2"].delete_key_pair(KeyName=o.ref.get("name") or o.name),
    "placement group": lambda c, o: c["ec2"].delete_placement_group(GroupName=o.id),
    "imagebuilder pipeline": _ib("delete_image_pipeline", "imagePipelineArn"),
    "imagebuilder image": _ib("delete_image", "imageBuildVersionArn"),
    "imagebuilder recipe": _ib("delete_image_recipe", "imageRecipeArn"),
    "imagebuilder component": _ib("delete_component", "componentBuildVersionArn"),
    "imagebuilder infra config": _ib("delete_infrastructure_configuration", "infrastructureConfigurationArn"),
    "imagebuilder distribution": _ib("delete_distribution_configuration", "distributionConfigurationArn"),
    "instance profile": _instance_profile,
    "iam role": _role,
    "iam policy": _policy,
    "log group": lambda c, o: c["logs"].delete_log_group(logGroupName=o.id),
    "ssm parameter": lambda c, o: c["ssm"].delete_parameter(Name=o.id),
    "kms key": lambda c, o: c["kms"].schedule_key_deletion(KeyId=o.id, PendingWindowInDays=KEY_WAIT_DAYS),
    "store objects": _store_objects,
    "s3 bucket": _bucket,
    "network interface": lambda c, o: c["ec2"].delete_network_interface(NetworkInterfaceId=o.id),
    "elastic ip": _address,
    "security group": lambda c, o: c["ec2"].delete_security_group(GroupId=o.id),
    "subnet": lambda c, o: c["ec2"].delete_subnet(SubnetId=o.id),
    "route table": _route_table,
    "internet gateway": _gateway,
    "vpc": lambda c, o: c["ec2"].delete_vpc(VpcId=o.id),
}


# -- waiting for what goes away slowly ------------------------------------------------------------
def _groups_gone(c, names: list[str], sleep) -> None:
    # a force-deleted group lingers ("Delete in progress") while it terminates its instances
    deadline = time.monotonic() + WAIT_S
    while c["autoscaling"].describe_auto_scaling_groups(AutoScalingGroupNames=names)["AutoScalingGroups"]:
        if time.monotonic() > deadline:
            raise Failed(f"still there after {WAIT_S // 60} minutes")
        sleep(10)


def _instances_gone(c, ids: list[str], sleep) -> None:
    # the volumes, security groups and network they hold are free only once they are terminated
    c["ec2"].get_waiter("instance_terminated").wait(InstanceIds=ids, WaiterConfig={"Delay": 10,
                                                                                  "MaxAttempts": WAIT_S // 10})


WAIT = {"auto scaling group": _groups_gone, "instance": _instances_gone}
