"""``fab sweep``: what of a cluster is still in its region after ``pulumi destroy``, with its cost per month,
and (with --yes) its deletion in dependency order (sweep.delete).

A resource belongs to cluster NAME only when it carries the tag xeon-cluster:cluster=NAME (every resource
of the stack does, through the provider's default tags) or xeon-cluster:image-build=NAME (Image Builder's
build instance), the store bucket included. Two exceptions, found by name: Image Builder's own build log group,
/aws/imagebuilder/<recipe>, whose recipe infra.image names NAME-<digest>, and the SSM parameters fab puts under
/xeon-cluster/NAME/ (cluster.mesh: the mesh key and its public half). Nothing else is listed, so nothing else is
ever deleted.

The store (the cluster's S3 bucket: trained models, checkpoints, run records) is listed but kept by --yes, which says
so and why; only --include-store empties it, and never while the cluster's Auto Scaling group still exists (its nodes
may be writing). What in it no run needs is listed on rows of its own and goes with --yes (sweep.find
LEFTOVERS: the head's code tarballs, snapshots and wheels no resumable run names, log parts, compacted first). The
cluster's KMS key (scheduled for deletion) and its roles' permissions boundary are found by tag and by name.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from cluster import aws
from core import catalog
from core.constants import TAG_CLUSTER, TAG_STORE
from core.ec2 import aws_client, aws_errors
from core.errors import ClusterError
from sweep.delete import ORDER, delete_all
from sweep.find import FATAL_CODES, SOURCES, Orphan

log = logging.getLogger(__name__)



@dataclass
class Look:
    cluster: str
    region: str
    orphans: list[Orphan]
    unchecked: list[str]  # what could not be listed (warned)

    @property
    def usd_month(self) -> float:
        return sum(o.usd_month or 0.0 for o in self.orphans)


class Clients(dict):
    """boto3 clients by service name, made on first use; tests hand in stubbed ones."""

    def __init__(self, region: str | None = None, **given):
        super().__init__(given)
        self.region = region
        self.unchecked: list[str] = []  # single resources a lister could not read (warned)

    def __missing__(self, service: str):
        self[service] = aws_client(service, self.region)
        return self[service]


# -- the command ----------------------------------------------------------------------------------
def sweep(spec: str | None, yes: bool = False, out=None, clients: Clients | None = None,
          include_store: bool = False) -> int:
    """List what cluster ``spec`` (aws[:NAME] or pulumi[:STACK]) left; delete it with ``yes`` (the store too with
    ``include_store``; while the cluster's groups exist, only the old store buckets none of them writes, and refused
    when a group does not say which it writes). Returns the exit code."""
    out = out or sys.stdout
    name, region = target(spec)
    with aws_errors():
        c = clients if clients is not None else Clients(region)
        first = look(c, name)
        live = live_stores(c, first) if yes and include_store and first.cluster else None
    if live is not None:
        return sweep_old_stores(c, first, live, out)
    if first.orphans:
        print(render(first), file=out)
    else:
        print(nothing_left(first), file=out)
        return 0
    kept = [] if include_store else [o for o in first.orphans if o.kind == "s3 bucket"]
    if not yes:
        for o in kept:
            print(kept_line(o, first.cluster, "--yes keeps"), file=out)
        print(left_line(first), file=out)
        # after a clean `pulumi destroy` the store is what is left, kept on purpose: that is no failure (exit 0)
        return 1 if include_store or any(o.kind != "s3 bucket" for o in first.orphans) else 0
    for o in kept:
        print(kept_line(o, first.cluster, "keeping"), file=out)
    # with --include-store the bucket goes whole, what no run needs in it too
    gone = [o for o in first.orphans if o not in kept and not (include_store and o.kind == "store objects")]
    failures = delete_all(c, gone, out)
    with aws_errors():
        again = look(c, first.cluster)
    left = [o for o in again.orphans if o.id not in {k.id for k in kept}]
    if left:
        print(render(replace(again, orphans=left)), file=out)
        print(left_line(replace(again, orphans=left)), file=out)
        return 1
    if failures:
        print(f"{len(failures)} deletion(s) of cluster {first.cluster} failed (above), although nothing tagged is "
              "left now; run 'fab sweep' again to check", file=out)
        return 1
    print(nothing_left(again, kept), file=out)
    return 0


def target(spec: str | None) -> tuple[str, str | None]:
    """(cluster name or "" for the only one in the region, region or None for AWS_REGION). No spec at all: the
    selected Pulumi stack's cluster and region where there is one (its config still names them after 'pulumi
    destroy'), else aws."""
    if spec is None and not os.environ.get("XC_AWS_CLUSTER"):
        place = _selected_stack()
        if place:
            log.info("fab sweep: cluster %s in %s, from the selected Pulumi stack", place[0] or "(any)", place[1])
            return place
    spec = spec or "aws"
    kind, _, arg = spec.partition(":")
    if kind == "aws":
        return arg or os.environ.get("XC_AWS_CLUSTER", ""), None
    if kind == "pulumi":
        name, region = aws.stack_place(arg)
        if not name:
            raise ClusterError(f"stack {arg or '(selected)'} names no cluster in its outputs or its config "
                               "(clusterName)", fix="pass --cluster aws:NAME with the stack's clusterName")
        return name, region or None
    raise ClusterError(f"fab sweep is for AWS clusters, not {spec!r}", fix="pass --cluster aws[:NAME] or pulumi[:STACK]")


def _selected_stack() -> tuple[str, str] | None:
    """(clusterName or "", region) of the stack selected in the project; None without a Pulumi CLI, project or stack."""
    import shutil

    project = Path(os.environ.get("XC_PULUMI_DIR") or aws.PROJECT_DIR)
    if not shutil.which("pulumi") or not (project / "Pulumi.yaml").is_file():
        return None
    try:
        name, region = aws.stack_place()
    except ClusterError as exc:
        log.debug("no selected stack for fab sweep: %s", exc)
        return None
    return (name, region) if region else None


def live_stores(c: Clients, found: Look) -> dict[str, str] | None:
    """While the cluster's Auto Scaling groups exist (its nodes may be writing): bucket -> the group whose store it is
    (each group's TAG_STORE); None when no group exists. Raises when a group does not say which store it writes:
    --include-store would then empty the store under it."""
    groups = [o.id for o in found.orphans if o.kind == "auto scaling group"]
    if "Auto Scaling groups" in found.unchecked:
        raise ClusterError(f"--include-store: the Auto Scaling groups of cluster {found.cluster} could not be listed, "
                           "so whether one still writes to its store is unknown; nothing was deleted",
                           fix="grant autoscaling:DescribeAutoScalingGroups (docs/iam-policy.json) and run it again")
    names = list(dict.fromkeys([*groups, aws.node_group(found.cluster)]))
    live = c["autoscaling"].describe_auto_scaling_groups(AutoScalingGroupNames=names).get("AutoScalingGroups", [])
    if not live:
        return None
    owned, untold = {}, []
    for g in live:
        store = {t["Key"]: t["Value"] for t in g.get("Tags", [])}.get(TAG_STORE)
        if store:
            owned[store] = g["AutoScalingGroupName"]
        else:
            untold.append(g["AutoScalingGroupName"])
    if untold:
        raise ClusterError(
            f"--include-store would empty the store of cluster {found.cluster} while its Auto Scaling group "
            f"{', '.join(untold)} still exists (its nodes may be writing to it); nothing was deleted",
            fix=f"run 'pulumi destroy' (or 'fab sweep --cluster aws:{found.cluster} --yes', which keeps the store) "
                "first, then --include-store")
    return owned


def sweep_old_stores(c: Clients, found: Look, live: dict[str, str], out) -> int:
    """--yes --include-store while the cluster lives: only its store buckets that no live group writes (left by an
    earlier stack: 'pulumi up' after 'pulumi destroy' made a second one); the live cluster and its store stay."""
    stores = [o for o in found.orphans if o.kind == "s3 bucket"]
    for o in stores:
        if o.id in live:
            print(f"keeping s3 bucket {o.id}: the store of the live Auto Scaling group {live[o.id]}", file=out)
    old = [o for o in stores if o.id not in live]
    print(f"cluster {found.cluster} is live (Auto Scaling group {', '.join(sorted(set(live.values())))}): only its "
          f"{len(old)} old store bucket(s) that no live group writes are removed; the rest of it stays", file=out)
    failures = delete_all(c, old, out)
    return 1 if failures else 0


def look(c: Clients, name: str) -> Look:
    """Everything of cluster ``name`` (or of the only cluster with tagged resources in the region)."""
    found, unchecked = [], []
    if hasattr(c, "unchecked"):
        c.unchecked = []
    for label, lister, optional in SOURCES:
        try:
            found += lister(c)
        except Exception as exc:
            if not optional or not _skippable(exc):
                raise
            log.warning("could not list %s: %s", label, _reason(exc))
            unchecked.append(label)
    region = c["ec2"].meta.region_name
    if not name:
        names = sorted({o.cluster for o in found if o.cluster})
        if len(names) > 1:
            raise ClusterError(f"{len(names)} clusters have tagged resources in {region} ({', '.join(names)})", fix=
                               "pick one with --cluster aws:NAME")
        name = names[0] if names else ""
    mine = [o for o in found if belongs(o, name)] if name else []
    listed = {o.id for o in mine}
    for o in mine:
        if o.kind == "ami":  # its storage is billed on its snapshots: count only those not listed anyway
            untagged = {s: gib for s, gib in o.ref.pop("snapshots", {}).items() if s not in listed}
            o.ref["untagged_snapshots"] = sorted(untagged)
            o.usd_month = round(sum(untagged.values()) * catalog.SNAPSHOT_USD_PER_GIB_MONTH, 2)
    mine.sort(key=lambda o: (ORDER.index(o.kind), o.name, o.id))
    return Look(name, region, mine, unchecked + list(getattr(c, "unchecked", [])))


def belongs(o: Orphan, name: str) -> bool:
    if o.cluster:
        return o.cluster == name
    # <name>-<digest> with no '-' in the digest: cluster 'bert' never takes the logs of 'bert-2'
    return o.kind == "log group" and re.fullmatch(rf"/aws/imagebuilder/{re.escape(name)}-[^-/]+", o.id) is not None


def _skippable(exc: Exception) -> bool:
    """A kind the endpoint or the credentials' policy does not offer: warn and go on."""
    from botocore import exceptions as err
    from botocore.parsers import ResponseParserError  # what an endpoint without the call answers, e.g. moto's

    if isinstance(exc, (err.NoCredentialsError, err.PartialCredentialsError, err.NoRegionError)):
        return False
    if isinstance(exc, err.ClientError):
        return exc.response.get("Error", {}).get("Code") not in FATAL_CODES
    return isinstance(exc, (err.BotoCoreError, ResponseParserError))


def _reason(exc: Exception) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        text = f"{exc.operation_name} failed ({error.get('Code')}: {error.get('Message', '')}"
        return (text.strip().splitlines() or [""])[0][:200] + ")"
    # a ResponseParserError ends its first line with "Further retries may succeed:"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(" Further retries")[0][:200]


# -- the report ------------------------------------------------------------------------------------
def render(found: Look) -> str:
    if not found.orphans:
        return ""
    rows = [("kind", "id", "name", "USD/month")] + [
        (o.kind, o.id, o.name, "?" if o.usd_month is None else f"{o.usd_month:.2f}") for o in found.orphans]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    usd_w = max(len(r[3]) for r in rows)
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{usd_w}}".rstrip()
             for r in rows]
    unknown = sum(o.usd_month is None for o in found.orphans)
    note = f" ({unknown} without a known price)" if unknown else ""
    if any(o.kind == "instance" and o.usd_month for o in found.orphans):
        note += "; instances at the on-demand price, the most a spot node costs"
    lines.append(f"total: {len(found.orphans)} resource(s), ${found.usd_month:.2f}/month{note}")
    return "\n".join(lines)


def nothing_left(found: Look, kept: list[Orphan] = ()) -> str:
    unchecked = f" (not checked: {', '.join(found.unchecked)})" if found.unchecked else ""
    if not found.cluster:
        return f"nothing tagged {TAG_CLUSTER} left in {found.region}{unchecked}"
    store = f" but its store {', '.join(o.id for o in kept)} (kept)" if kept else ""
    return f"nothing left of cluster {found.cluster} in {found.region}{store}{unchecked}"


def kept_line(o: Orphan, cluster: str, verb: str) -> str:
    """What --yes keeps on purpose, and why, in one line."""
    runs = o.ref.get("runs", [])
    return (f"{verb} s3 bucket {o.id} ({o.name}" + (f"; runs {', '.join(runs)}" if runs else "") + "): the "
            "cluster's store, kept on purpose (its runs' models, checkpoints, records and logs, and the code its "
            f"unfinished runs resume from); delete it with 'fab sweep --cluster aws:{cluster} --yes --include-store', "
            f"or let the next 'pulumi up' adopt it: 'pulumi config set storeBucket {o.id}'")


def left_line(found: Look) -> str:
    n = len(found.orphans)
    stores = [o.id for o in found.orphans if o.kind == "s3 bucket"]
    command = f"fab sweep --cluster aws:{found.cluster} --yes"
    if stores and len(stores) == n:  # only the store is left: it goes only when asked by name
        fix = f"empty and delete it with '{command} --include-store' once its models are safe elsewhere"
    else:
        keeps = f", which keeps the store {', '.join(stores)} (add --include-store to empty it)" if stores else ""
        fix = f"delete them with '{command}'{keeps}"
    return (f"{n} resource{'s' if n != 1 else ''} of cluster {found.cluster} left in {found.region} "
            f"(~${found.usd_month:.2f}/month); {fix}")
