"""What ``fab sweep`` lists, one function per kind: every resource that carries a cluster tag (of any
cluster; sweep.run picks one), with what deleting it needs and its cost per month where known; in the kept
store, what no run needs (LEFTOVERS), on rows of its own.
"""
from __future__ import annotations

import concurrent.futures
import logging
import re
from dataclasses import dataclass, field

from cluster.mesh import ROOT
from core import catalog
from core.constants import TAG_CLUSTER, TAG_IMAGE_BUILD
from training.runtime import pylayer, snapshot
from training.runtime.paths import RunPaths
from training.runtime.spec import RunSpec

log = logging.getLogger(__name__)

KEYS = (TAG_CLUSTER, TAG_IMAGE_BUILD)
STORE_BUCKET_PREFIX = "xc-"  # infra.bucket names every store bucket xc-<cluster>-<suffix>
# Credentials that do not work fail every call alike: an error, not a warning per kind (or per bucket).
FATAL_CODES = {"AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken",
               "ExpiredTokenException", "SignatureDoesNotMatch", "RequestExpired", "InvalidAccessKeyId"}
# One server-side filter per key (moto ANDs a filter's values where AWS ORs them); each match is checked again here.
ONLY_CLUSTER = (TAG_CLUSTER,)
LIVE_INSTANCES = ["pending", "running", "stopping", "stopped", "shutting-down"]
BILLED_STATES = ("pending", "running")
KMS_KEY_USD_MONTH, GONE_KEY_STATES = 1.0, ("PendingDeletion", "PendingReplicaDeletion")  # none once scheduled
# infra.policies' (tests/sweep/test_sweep.py keeps them equal): the roles' boundary is xc-boundary-<cluster>-<region>
ROLE_PATH, BOUNDARY_PREFIX = "/xeon-cluster/", "xc-boundary-"
# What of a kept store under <cluster>/ no run needs: launch.supervision.adopt.CODE, training/runtime/store.py PROBE_PREFIX...
LEFTOVERS = {"code": "the head's code tarballs (fab puts them again)", ".xc-probe": "the store probe's object",
             snapshot.FOLDER: "code snapshots no resumable run names",
             pylayer.WHEELS: "requirement wheels no resumable run names",
             RunPaths.LOG_PARTS: "log parts (compacted into their run's log.txt first)"}


@dataclass
class Orphan:
    kind: str  # one of sweep.delete.ORDER
    id: str
    name: str = ""
    usd_month: float | None = 0.0  # None: not known
    cluster: str = ""  # the tag's value; "" for a build log group found by its name
    ref: dict = field(default_factory=dict)  # what deleting it needs besides its id


def _pages(client, op: str, key: str, **kwargs) -> list[dict]:
    if client.can_paginate(op):
        return [item for page in client.get_paginator(op).paginate(**kwargs) for item in page.get(key, [])]
    return getattr(client, op)(**kwargs).get(key, [])


def _tags(tags) -> dict[str, str]:
    """EC2's [{'Key', 'Value'}] or Image Builder's and CloudWatch's {key: value}."""
    return dict(tags) if isinstance(tags, dict) else {t["Key"]: t["Value"] for t in tags or []}


def _cluster(tags: dict[str, str]) -> str:
    return tags.get(TAG_CLUSTER) or tags.get(TAG_IMAGE_BUILD) or ""


def tagged(key: str) -> dict:
    return {"Name": "tag-key", "Values": [key]}


def _ec2(c, op: str, key: str, kind: str, id_key: str, name=None, cost=None, ref=None, keep=None,
         keys=ONLY_CLUSTER, **kwargs) -> list[Orphan]:
    """Tagged EC2 resources of one kind; ``name``, ``cost``, ``ref`` and ``keep`` take the item."""
    extra = kwargs.pop("Filters", [])
    out, seen = [], set()
    for item in [i for k in keys for i in _pages(c["ec2"], op, key, Filters=[tagged(k), *extra], **kwargs)]:
        tags = _tags(item.get("Tags"))
        if not _cluster(tags) or (keep and not keep(item)) or item[id_key] in seen:
            continue
        seen.add(item[id_key])
        out.append(Orphan(kind, item[id_key], tags.get("Name") or (name(item) if name else ""),
                          cost(item) if cost else 0.0, _cluster(tags), ref(item) if ref else {}))
    return out


def instance_usd_month(instance_type: str, state: str) -> float | None:
    if state not in BILLED_STATES:
        return 0.0  # a stopped instance bills only its volumes, listed on their own
    entry = catalog.CATALOG.get(instance_type)
    if entry is None and instance_type in catalog.HEAD_USD_H:  # the head
        return round(catalog.HEAD_USD_H[instance_type] * catalog.HOURS_PER_MONTH, 2)
    return round(entry.on_demand_usd_h * catalog.HOURS_PER_MONTH, 2) if entry else None


def volume_usd_month(volume_type: str, gib: int) -> float | None:
    price = catalog.EBS_USD_PER_GIB_MONTH.get(volume_type)
    return round(price * gib, 2) if price is not None else None


def _instances(c) -> list[Orphan]:
    # the image build's instance carries only the image-build tag
    live = {"Name": "instance-state-name", "Values": LIVE_INSTANCES}
    out, seen = [], set()
    for key in KEYS:
        for inst in [i for r in _pages(c["ec2"], "describe_instances", "Reservations", Filters=[tagged(key), live])
                     for i in r["Instances"]]:
            tags = _tags(inst.get("Tags"))
            if _cluster(tags) and inst["InstanceId"] not in seen:
                seen.add(inst["InstanceId"])
                state, itype = inst["State"]["Name"], inst.get("InstanceType", "")
                label = ", ".join(filter(None, [tags.get("Name"), f"{itype} {state}"]))
                out.append(Orphan("instance", inst["InstanceId"], label, instance_usd_month(itype, state),
                                  _cluster(tags)))
    return out


def _spot_requests(c) -> list[Orphan]:
    return _ec2(c, "describe_spot_instance_requests", "SpotInstanceRequests", "spot request", "SpotInstanceRequestId",
                name=lambda r: r.get("InstanceId", ""), Filters=[{"Name": "state", "Values": ["open", "active"]}])


def _fleets(c) -> list[Orphan]:
    # neither fleet API filters by tag
    out = []
    for fleet in _pages(c["ec2"], "describe_fleets", "Fleets"):
        tags = _tags(fleet.get("Tags"))
        if _cluster(tags) and fleet.get("FleetState") in ("submitted", "active", "modifying"):
            out.append(Orphan("ec2 fleet", fleet["FleetId"], tags.get("Name", ""), 0.0, _cluster(tags)))
    for config in _pages(c["ec2"], "describe_spot_fleet_requests", "SpotFleetRequestConfigs"):
        tags = _tags(config.get("Tags"))
        if _cluster(tags) and config.get("SpotFleetRequestState") in ("submitted", "active", "modifying"):
            out.append(Orphan("spot fleet", config["SpotFleetRequestId"], tags.get("Name", ""), 0.0, _cluster(tags)))
    return out


def _groups(c) -> list[Orphan]:
    out = []
    for group in _pages(c["autoscaling"], "describe_auto_scaling_groups", "AutoScalingGroups",
                        Filters=[tagged(TAG_CLUSTER)]):
        tags = {t["Key"]: t["Value"] for t in group.get("Tags", [])}
        if _cluster(tags):
            status = f" ({group['Status']})" if group.get("Status") else ""
            out.append(Orphan("auto scaling group", group["AutoScalingGroupName"],
                              f"{len(group.get('Instances', []))} instance(s){status}", 0.0, _cluster(tags)))
    return out


def _storage(c) -> list[Orphan]:
    return [
        *_ec2(c, "describe_launch_templates", "LaunchTemplates", "launch template", "LaunchTemplateId",
              name=lambda t: t["LaunchTemplateName"]),
        *_ec2(c, "describe_images", "Images", "ami", "ImageId", name=lambda i: i.get("Name", ""), Owners=["self"],
              ref=lambda i: {"snapshots": _snapshots_of(i)}),
        *_ec2(c, "describe_snapshots", "Snapshots", "snapshot", "SnapshotId", OwnerIds=["self"],
              name=lambda s: f"{s.get('VolumeSize', 0)} GiB",
              cost=lambda s: round(s.get("VolumeSize", 0) * catalog.SNAPSHOT_USD_PER_GIB_MONTH, 2)),
        *_ec2(c, "describe_volumes", "Volumes", "volume", "VolumeId", keys=KEYS,
              name=lambda v: f"{v['Size']} GiB {v.get('VolumeType', '')} {v.get('State', '')}".strip(),
              cost=lambda v: volume_usd_month(v.get("VolumeType", ""), v["Size"])),
        *_ec2(c, "describe_key_pairs", "KeyPairs", "key pair", "KeyPairId", name=lambda k: k["KeyName"],
              ref=lambda k: {"name": k["KeyName"]}),
    ]


def _placement_groups(c) -> list[Orphan]:
    return _ec2(c, "describe_placement_groups", "PlacementGroups", "placement group", "GroupName",
                name=lambda g: g.get("Strategy", ""))


def _network(c) -> list[Orphan]:
    ipv4 = round(catalog.PUBLIC_IPV4_USD_H * catalog.HOURS_PER_MONTH, 2)
    return [
        *_ec2(c, "describe_network_interfaces", "NetworkInterfaces", "network interface", "NetworkInterfaceId",
              name=lambda n: n.get("Status", "")),
        *_ec2(c, "describe_addresses", "Addresses", "elastic ip", "AllocationId", name=lambda a: a.get("PublicIp", ""),
              cost=lambda a: ipv4, ref=lambda a: {"association": a.get("AssociationId", "")}),
        # a VPC's default group goes with the VPC and cannot be deleted before
        *_ec2(c, "describe_security_groups", "SecurityGroups", "security group", "GroupId",
              name=lambda g: g["GroupName"], keep=lambda g: g["GroupName"] != "default",
              ref=lambda g: {"ingress": g.get("IpPermissions", []), "egress": g.get("IpPermissionsEgress", [])}),
        *_ec2(c, "describe_subnets", "Subnets", "subnet", "SubnetId", name=lambda s: s.get("CidrBlock", "")),
        # the main route table goes with its VPC too
        *_ec2(c, "describe_route_tables", "RouteTables", "route table", "RouteTableId",
              keep=lambda t: not any(a.get("Main") for a in t.get("Associations", [])),
              ref=lambda t: {"associations": [a["RouteTableAssociationId"] for a in t.get("Associations", [])
                                              if not a.get("Main") and a.get("RouteTableAssociationId")]}),
        *_ec2(c, "describe_internet_gateways", "InternetGateways", "internet gateway", "InternetGatewayId",
              ref=lambda g: {"vpcs": [a["VpcId"] for a in g.get("Attachments", [])]}),
        *_ec2(c, "describe_vpcs", "Vpcs", "vpc", "VpcId", name=lambda v: v.get("CidrBlock", "")),
    ]


def _snapshots_of(image: dict) -> dict[str, int]:
    """The AMI's snapshots and their GiB: the AMI's storage bills on them."""
    ebs = [m["Ebs"] for m in image.get("BlockDeviceMappings", []) if m.get("Ebs", {}).get("SnapshotId")]
    return {e["SnapshotId"]: e.get("VolumeSize", 0) for e in ebs}


def _each(fn, items: list) -> list:
    """One API call per item (tags that the list calls do not return), eight at a time."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(fn, items))


def _iam(c) -> list[Orphan]:
    iam = c["iam"]
    # AWS's own roles (/aws-service-role/, /aws-reserved/) are not ours; list_roles returns no tags
    roles = [r for r in _pages(iam, "list_roles", "Roles") if not r.get("Path", "/").startswith("/aws-")]
    out = []
    for role, tags in zip(roles, _each(lambda r: _tags(iam.list_role_tags(RoleName=r["RoleName"])["Tags"]), roles)):
        if _cluster(tags):
            out.append(Orphan("iam role", role["RoleName"], tags.get("Name", ""), 0.0, _cluster(tags)))
    # get_instance_profile, not list_instance_profile_tags: it also names the roles to take out first
    profiles = _each(lambda p: iam.get_instance_profile(InstanceProfileName=p["InstanceProfileName"]),
                     _pages(iam, "list_instance_profiles", "InstanceProfiles"))
    profiles = [p["InstanceProfile"] for p in profiles]
    for profile in profiles:
        tags = _tags(profile.get("Tags"))
        if _cluster(tags):
            roles_in = [r["RoleName"] for r in profile.get("Roles", [])]
            out.append(Orphan("instance profile", profile["InstanceProfileName"], ", ".join(roles_in), 0.0,
                              _cluster(tags), {"roles": roles_in}))
    return out


def _boundaries(c) -> list[Orphan]:
    """The permissions boundary of a cluster's roles (a managed policy under ROLE_PATH): IAM is global, so only this
    region's, by its name."""
    region = c["ec2"].meta.region_name
    return [Orphan("iam policy", p["PolicyName"], "the roles' permissions boundary", 0.0,
                   p["PolicyName"][len(BOUNDARY_PREFIX):-len(region) - 1], {"arn": p["Arn"]})
            for p in _pages(c["iam"], "list_policies", "Policies", Scope="Local", PathPrefix=ROLE_PATH)
            if re.fullmatch(rf"{BOUNDARY_PREFIX}.+-{re.escape(region)}", p["PolicyName"]) and p.get("Path") == ROLE_PATH]


def _keys(c) -> list[Orphan]:
    """The cluster's secrets key (infra/head.py: the mesh key's and run secrets'), by its tag; one already scheduled
    for deletion bills nothing and is left to KMS. Keys whose tags fab may not read (AWS's own) are not ours."""
    from botocore.exceptions import ClientError

    kms, out = c["kms"], []

    def key_tags(key: dict) -> dict[str, str]:
        try:
            return {t["TagKey"]: t["TagValue"] for t in kms.list_resource_tags(KeyId=key["KeyId"]).get("Tags", [])}
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in FATAL_CODES:
                raise
            return {}

    keys = _pages(kms, "list_keys", "Keys")
    for key, tags in zip(keys, _each(key_tags, keys)):
        meta = kms.describe_key(KeyId=key["KeyId"])["KeyMetadata"] if _cluster(tags) else {"KeyManager": "AWS"}
        if meta.get("KeyState") in GONE_KEY_STATES or meta.get("KeyManager") == "AWS":
            continue
        aliases = [a["AliasName"] for a in _pages(kms, "list_aliases", "Aliases", KeyId=key["KeyId"])]
        out.append(Orphan("kms key", key["KeyId"], ", ".join(aliases) or meta.get("KeyState", ""), KMS_KEY_USD_MONTH,
                          _cluster(tags), {"aliases": aliases}))
    return out


def _log_groups(c) -> list[Orphan]:
    logs = c["logs"]
    groups = _pages(logs, "describe_log_groups", "logGroups")

    def tags(g: dict) -> dict[str, str]:
        arn = g.get("logGroupArn") or g["arn"].removesuffix(":*")
        return _tags(logs.list_tags_for_resource(resourceArn=arn).get("tags", {}))

    out = []
    for group, tagged in zip(groups, _each(tags, groups)):
        name = group["logGroupName"]
        if _cluster(tagged) or name.startswith("/aws/imagebuilder/"):
            gib = group.get("storedBytes", 0) / 2**30
            out.append(Orphan("log group", name, f"{gib:.2f} GiB stored", round(gib * catalog.LOG_USD_PER_GIB_MONTH, 2),
                              _cluster(tagged)))
    return out


IMAGEBUILDER = (  # kind, list call, its result key, its arguments, and the call listing each item's builds
    ("imagebuilder pipeline", "list_image_pipelines", "imagePipelineList", {}, None),
    ("imagebuilder image", "list_images", "imageVersionList", {"owner": "Self"},
     ("list_image_build_versions", "imageSummaryList", "imageVersionArn")),
    ("imagebuilder recipe", "list_image_recipes", "imageRecipeSummaryList", {"owner": "Self"}, None),
    ("imagebuilder component", "list_components", "componentVersionList", {"owner": "Self"},
     ("list_component_build_versions", "componentSummaryList", "componentVersionArn")),
    ("imagebuilder infra config", "list_infrastructure_configurations", "infrastructureConfigurationSummaryList", {},
     None),
    ("imagebuilder distribution", "list_distribution_configurations", "distributionConfigurationSummaryList", {},
     None),
)


def _imagebuilder(c) -> list[Orphan]:
    ib = c["imagebuilder"]
    out = []
    for kind, op, key, kwargs, builds in IMAGEBUILDER:
        items = _pages(ib, op, key, **kwargs)
        if builds:  # versions carry no tags; their builds do
            items = [b for v in items for b in _pages(ib, builds[0], builds[1], **{builds[2]: v["arn"]})]
        for item in items:
            tags = _tags(item.get("tags"))
            if _cluster(tags):
                short = item["arn"].split(":", 5)[-1]  # image-recipe/NAME/1.0.0
                out.append(Orphan(kind, short, item.get("name", ""), 0.0, _cluster(tags), {"arn": item["arn"]}))
    return out


def _bucket_region(s3, bucket: dict) -> str:
    if bucket.get("BucketRegion"):
        return bucket["BucketRegion"]
    return s3.get_bucket_location(Bucket=bucket["Name"]).get("LocationConstraint") or "us-east-1"


def _bucket_tags(s3, name: str) -> dict[str, str]:
    from botocore.exceptions import ClientError

    try:
        return _tags(s3.get_bucket_tagging(Bucket=name).get("TagSet"))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchTagSet", "NoSuchBucket"):
            return {}
        raise


def bucket_contents(s3, name: str) -> dict:
    """Every version of every object (a versioned bucket bills them all): count, bytes, the runs they hold, and each
    key's versions ([{VersionId, Size, IsLatest, marker}])."""
    count, size, runs, keys = 0, 0, set(), {}
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=name):
        for marker, items in ((False, page.get("Versions", [])), (True, page.get("DeleteMarkers", []))):
            for item in items:
                count += 1
                size += item.get("Size", 0)
                parts = item["Key"].split("/")
                if "runs" in parts[:-2]:  # <cluster>/runs/<id>/...
                    runs.add(parts[parts.index("runs") + 1])
                keys.setdefault(item["Key"], []).append({"VersionId": item["VersionId"], "Size": item.get("Size", 0),
                                                         "IsLatest": item.get("IsLatest", False), "marker": marker})
    return {"objects": count, "bytes": size, "runs": sorted(runs), "keys": keys}


def _resumable_code(s3, bucket: str, base: str, runs: list[str]) -> set[tuple[str, str]]:
    """(folder, key) of the snapshots and wheels named by the store's runs that may be resumed (launch.life.resume
    refuses only a finished run; a run without a readable record has nothing to resume from)."""
    import json

    from botocore.exceptions import ClientError

    def named(run: str) -> list[tuple[str, str]]:
        try:
            summary = json.loads(s3.get_object(Bucket=bucket, Key=base + RunPaths(run).store_record("summary.json"))["Body"].read())
        except (ClientError, ValueError):
            return []
        kept = RunSpec.of_summary(summary) if summary.get("status") != "ok" else None
        what = kept.what if kept else RunSpec().what
        return [(snapshot.FOLDER, what.snapshot), (pylayer.WHEELS, what.pylayer)]

    return {pair for pairs in _each(named, runs) for pair in pairs if pair[1]}


def store_leftovers(s3, bucket: str, cluster: str, held: dict) -> list[Orphan]:
    """A row per kind of LEFTOVERS in cluster's kept store, with every version of its objects (a delete marker alone
    would leave them billed); log parts with the current ones each run's log.txt is compacted from."""
    base, found = f"{cluster}/", {}
    for key, versions in held["keys"].items():
        rel = key.removeprefix(base).split("/") if key.startswith(base) else []
        parts = len(rel) == 4 and rel[0] == RunPaths.RUNS and rel[2] == RunPaths.LOG_PARTS
        folder = RunPaths.LOG_PARTS if parts else rel[0] if rel else ""
        if len(rel) >= 2 and folder in LEFTOVERS:  # snapshots/<key>.tar.gz, snapshots/<key>.json, wheels/<key>/...
            found.setdefault(folder, {})[key] = versions
    kept = _resumable_code(s3, bucket, base, held["runs"]) if found.keys() & {snapshot.FOLDER, pylayer.WHEELS} else set()
    out = []
    for folder, keys in found.items():
        keys = {k: v for k, v in keys.items() if (folder, k.removeprefix(base).split("/")[1].split(".")[0]) not in kept}
        if not keys:
            continue
        versions = [{"Key": k, "VersionId": v["VersionId"]} for k, vs in keys.items() for v in vs]
        size = sum(v["Size"] for vs in keys.values() for v in vs)
        ref = {"bucket": bucket, "versions": versions, "bytes": size}
        if folder == RunPaths.LOG_PARTS:
            ref["logs"] = {}
            for k, vs in sorted(keys.items()):
                for v in [v for v in vs if v["IsLatest"] and not v["marker"]]:
                    ref["logs"].setdefault(k.rsplit("/", 2)[0] + "/log.txt", []).append([k, v["Size"]])
        where = f"{RunPaths.RUNS}/*/{RunPaths.LOG_PARTS}" if folder == RunPaths.LOG_PARTS else folder
        out.append(Orphan("store objects", f"{bucket}/{base}{where}/", f"{len(versions)} version(s), {size / 2**30:.2f} "
                          f"GiB: {LEFTOVERS[folder]}", round(size / 2**30 * catalog.S3_USD_PER_GIB_MONTH, 2), cluster,
                          ref))
    return out


def _buckets(c) -> list[Orphan]:
    """The cluster's store (infra.bucket): kept by 'pulumi destroy' because it may hold trained models. Only
    buckets named as stores are asked anything (docs/iam-policy.json allows the bucket calls on xc-* only), and
    one that still refuses is a warning naming it, not the end of the S3 listing."""
    from botocore.exceptions import ClientError

    s3, region = c["s3"], c["ec2"].meta.region_name

    def store(bucket: dict) -> list[Orphan]:
        name = bucket["Name"]
        try:
            tags = _bucket_tags(s3, name) if _bucket_region(s3, bucket) == region else {}
            if not _cluster(tags):
                return []
            held = bucket_contents(s3, name)
            extra = store_leftovers(s3, name, _cluster(tags), held)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code") in FATAL_CODES:
                raise
            log.warning("could not read s3 bucket %s (%s: %s); it is not listed", name, error.get("Code"),
                        error.get("Message", ""))
            getattr(c, "unchecked", []).append(f"s3 bucket {name}")
            return []
        # the bucket's row is what --yes keeps: all but the leftovers on their own rows
        objects = held["objects"] - sum(len(o.ref["versions"]) for o in extra)
        gib = (held["bytes"] - sum(o.ref["bytes"] for o in extra)) / 2**30
        return [Orphan("s3 bucket", name, f"{objects} objects, {gib:.2f} GiB", round(gib * catalog.S3_USD_PER_GIB_MONTH,
                       2), _cluster(tags), {"objects": objects, "runs": held["runs"]}), *extra]

    named = [b for b in _pages(s3, "list_buckets", "Buckets") if b["Name"].startswith(STORE_BUCKET_PREFIX)]
    return [o for found in _each(store, named) for o in found]


def _parameters(c) -> list[Orphan]:
    """The SSM parameters fab put under /xeon-cluster/<cluster>/ outside the stack (the mesh key and its public half,
    cluster.mesh; the run secrets under runs/<chain>/, launch.staging.run_secrets), which 'pulumi destroy' leaves. Found
    by their path (a put that overwrites cannot tag), from their metadata: their values are never read."""
    found = _pages(c["ssm"], "describe_parameters", "Parameters",
                   ParameterFilters=[{"Key": "Path", "Option": "Recursive", "Values": [ROOT]}])
    return [Orphan("ssm parameter", p["Name"], p.get("Type", ""), 0.0, parts[2]) for p in found
            if len(parts := p["Name"].split("/")) > 3 and "/".join(parts[:2]) == ROOT and parts[2]]


SOURCES = (  # what it lists (for the warning), the lister, and whether a failure there is only a warning
    ("Auto Scaling groups", _groups, True),
    ("EC2 Fleets and spot fleets", _fleets, True),
    ("spot requests", _spot_requests, False),
    ("instances", _instances, False),
    ("launch templates, AMIs, snapshots, volumes and key pairs", _storage, False),
    ("placement groups", _placement_groups, True),
    ("Image Builder resources", _imagebuilder, True),
    ("IAM roles and instance profiles", _iam, True),
    ("permissions boundaries", _boundaries, True),
    ("KMS keys", _keys, True),
    ("log groups", _log_groups, True),
    ("SSM parameters", _parameters, True),
    ("S3 buckets", _buckets, True),
    ("network pieces", _network, False),
)
