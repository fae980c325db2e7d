"""`fab doctor`'s rows for the cluster's head: it answers, an AWS head runs with the head's instance role, it has this
revision's supervisor code, and each supervisor it runs is alive with a fresh heartbeat in the store."""
from __future__ import annotations

import time

from cluster import shipping
from cluster.node import Node
from cluster.remote import connect, run
from core.constants import HOME_EXPR
from core.errors import ClusterError
from core.report import Row
from launch.life import head as head_lib

# The role the head's instance profile gives it, from its own IMDSv2 (python3 is on every Ubuntu head).
ROLE_PROBE = ("python3 -c \"import urllib.request as u; m='http://169.254.169.254/latest/'; "
              "t=u.urlopen(u.Request(m+'api/token', method='PUT', headers={'X-aws-ec2-metadata-token-ttl-seconds': "
              "'60'}), timeout=3).read().decode(); print('role=' + u.urlopen(u.Request(m+'meta-data/iam/security-"
              "credentials/', headers={'X-aws-ec2-metadata-token': t}), timeout=3).read().decode().strip())\" "
              "2>/dev/null || echo role=")


def _look(head: Node, digest: str) -> tuple[bool, dict[str, list[int]], str | None]:
    """(this revision's code is on the head, chain -> pids of the supervisors it runs, an AWS head's instance role
    as its IMDS names it: '' for none, None where not asked)."""
    aws = bool(head.labels.get("aws_head"))
    with connect(head) as conn:
        res = run(conn, f"test -f {HOME_EXPR}/code/{digest}/.complete && echo code-ok; "
                        f"grep -az '^{head_lib.ENV}=' /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
                        + (f"{ROLE_PROBE}; " if aws else "") + "true", timeout=30)
    chains: dict[str, list[int]] = {}
    role = None
    for line in res.stdout.splitlines():
        if aws and line.startswith("role="):
            role = line.removeprefix("role=").strip()
        where, _, chain = line.partition(f":{head_lib.ENV}=")
        pid = where.split("/")[2] if where.startswith("/proc/") else ""
        if chain and pid.isdigit():
            chains.setdefault(chain, []).append(int(pid))
    return "code-ok" in res.stdout.split(), chains, role


def role_row(name: str, cluster: str, role: str) -> Row:
    """The head's instance role: Pulumi names it <cluster>-head-<suffix> (infra/head.py); the nodes' role, or none,
    cannot read the mesh key nor delete a chain's secrets, so the head could not supervise."""
    fix = "'pulumi up' gives the head its instance profile (infra/head.py); 'fab status' shows the head"
    if not role:
        return Row(name, "instance role", False, "none: its IMDS names no role (or did not answer)", fix)
    if not role.startswith(f"{cluster}-head"):
        return Row(name, "instance role", False, f"{role}, not the head's ({cluster}-head...)", fix)
    return Row(name, "instance role", True, role)


def head_rows(head: Node | None, store_url: str | None = None, now: float | None = None) -> list[Row]:
    if head is None:
        return []
    name = head.name
    try:
        has_code, chains, role = _look(head, shipping.code_hash(tops=shipping.HEAD_SHIPPED))
    except ClusterError as exc:
        return [Row(name, "reachable", False, f"{exc.what}", "check it with 'fab status' ('fab local-up' starts a local "
                    "head); meanwhile 'fab train --detach --no-head' supervises from this machine")]
    rows = [Row(name, "reachable", True, f"{head.user}@{head.host}:{head.port}")]
    if role is not None:
        rows.append(role_row(name, head.labels["aws_head"], role))
    if not head_lib.runs_on_head(head):
        rows.append(Row(name, "supervisor code", True, "not used: this machine keeps the supervisor role (the head "
                        "has no venv with the operator's packages)", skipped=True))
    elif has_code:
        rows.append(Row(name, "supervisor code", True, "this revision's code is under its home"))
    else:
        rows.append(Row(name, "supervisor code", True, "not there yet: the next 'fab train --detach' ships it",
                        skipped=True))
    stale = []
    for chain in sorted(chains):
        beat = head_lib.heartbeat(store_url, chain) if store_url else None
        if beat is None:
            continue
        age = (now or time.time()) - float(beat["at"])
        if age > head_lib.STALE_BEATS * float(beat.get("interval_s", head_lib.heartbeat_s())):
            stale.append(f"{chain} ({age:.0f}s)")
    said = ", ".join(f"{c} (pid {', '.join(map(str, p))})" for c, p in sorted(chains.items())) or "none running"
    if stale:
        rows.append(Row(name, "supervisors", False, f"{said}; no fresh heartbeat from {', '.join(stale)}",
                        "'fab runs' judges them; 'fab stop RUN' ends one"))
    else:
        rows.append(Row(name, "supervisors", True, said + (" (heartbeats fresh)" if chains and store_url else "")))
    return rows
