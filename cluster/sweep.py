"""``fab sweep``: what of a cluster is still in its region after ``pulumi destroy``, with its cost per month,
and (with --yes) its deletion in dependency order (cluster.sweep_delete).

A resource belongs to cluster NAME only when it carries the tag xeon-cluster:cluster=NAME (every resource
of the stack does, through the provider's default tags) or xeon-cluster:image-build=NAME (Image Builder's
build instance), the store bucket included. The one exception is Image Builder's own build log group, /aws/imagebuilder/<recipe>,
whose recipe infra.image names NAME-<digest>. Nothing else is listed, so nothing else is ever deleted.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass

from cluster.sweep_delete import ORDER, delete_all
from cluster.sweep_list import SOURCES, Orphan
from core import catalog
from core.constants import TAG_CLUSTER
from core.ec2 import aws_client, aws_errors
from core.errors import ClusterError

log = logging.getLogger(__name__)

# Credentials that do not work fail every call alike: an error, not a warning per kind.
FATAL_CODES = {"AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken",
               "ExpiredTokenException", "SignatureDoesNotMatch", "RequestExpired"}


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

    def __missing__(self, service: str):
        self[service] = aws_client(service, self.region)
        return self[service]


# -- the command ----------------------------------------------------------------------------------
def sweep(spec: str | None, yes: bool = False, out=None, clients: Clients | None = None) -> int:
    """List what cluster ``spec`` (aws[:NAME] or pulumi[:STACK]) left; delete it with ``yes``. Returns the exit code."""
    out = out or sys.stdout
    name, region = target(spec)
    with aws_errors():
        c = clients if clients is not None else Clients(region)
        first = look(c, name)
    if first.orphans:
        print(render(first), file=out)
    else:
        print(nothing_left(first), file=out)
        return 0
    if not yes:
        print(left_line(first), file=out)
        return 1
    failures = delete_all(c, first.orphans, out)
    with aws_errors():
        again = look(c, first.cluster)
    if again.orphans:
        print(render(again), file=out)
        print(left_line(again), file=out)
        return 1
    if failures:
        print(f"{len(failures)} deletion(s) of cluster {first.cluster} failed (above), although nothing tagged is "
              "left now; run 'fab sweep' again to check", file=out)
        return 1
    print(nothing_left(again), file=out)
    return 0


def target(spec: str | None) -> tuple[str, str | None]:
    """(cluster name or "" for the only one in the region, region or None for AWS_REGION)."""
    spec = spec or "aws"
    kind, _, arg = spec.partition(":")
    if kind == "aws":
        return arg or os.environ.get("XC_AWS_CLUSTER", ""), None
    if kind == "pulumi":
        from cluster.aws import stack_outputs

        outputs = stack_outputs(arg)
        if not outputs.get("clusterName"):
            raise ClusterError(f"stack {arg or '(selected)'} has no 'clusterName' output (destroyed already?); pass "
                               "--cluster aws:NAME with the stack's clusterName")
        return outputs["clusterName"], outputs.get("region") or None
    raise ClusterError(f"fab sweep is for AWS clusters, not {spec!r}; pass --cluster aws[:NAME] or pulumi[:STACK]")


def look(c: Clients, name: str) -> Look:
    """Everything of cluster ``name`` (or of the only cluster with tagged resources in the region)."""
    found, unchecked = [], []
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
            raise ClusterError(f"{len(names)} clusters have tagged resources in {region} ({', '.join(names)}); "
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
    return Look(name, region, mine, unchecked)


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


def nothing_left(found: Look) -> str:
    unchecked = f" (not checked: {', '.join(found.unchecked)})" if found.unchecked else ""
    if not found.cluster:
        return f"nothing tagged {TAG_CLUSTER} left in {found.region}{unchecked}"
    return f"nothing left of cluster {found.cluster} in {found.region}{unchecked}"


def left_line(found: Look) -> str:
    n = len(found.orphans)
    return (f"{n} resource{'s' if n != 1 else ''} of cluster {found.cluster} left in {found.region} "
            f"(~${found.usd_month:.2f}/month); delete them with 'fab sweep --cluster aws:{found.cluster} --yes'")
