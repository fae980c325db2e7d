"""`fab doctor`'s rows for the cluster's head: it answers, it has this revision's supervisor code, and each
supervisor it runs is alive with a fresh heartbeat in the store. (An AWS head's role is not checked: fab does not
find an AWS head yet.)"""
from __future__ import annotations

import time

from cluster import shipping
from cluster.node import Node
from cluster.remote import connect, run
from core.constants import HOME_EXPR
from core.errors import ClusterError
from core.report import Row
from launch.life import head as head_lib


def _look(head: Node, digest: str) -> tuple[bool, dict[str, list[int]]]:
    """(this revision's code is on the head, chain -> pids of the supervisors it runs)."""
    with connect(head) as conn:
        res = run(conn, f"test -f {HOME_EXPR}/code/{digest}/.complete && echo code-ok; "
                        f"grep -az '^{head_lib.ENV}=' /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; true",
                  timeout=30)
    chains: dict[str, list[int]] = {}
    for line in res.stdout.splitlines():
        where, _, chain = line.partition(f":{head_lib.ENV}=")
        pid = where.split("/")[2] if where.startswith("/proc/") else ""
        if chain and pid.isdigit():
            chains.setdefault(chain, []).append(int(pid))
    return "code-ok" in res.stdout.split(), chains


def head_rows(head: Node | None, store_url: str | None = None, now: float | None = None) -> list[Row]:
    if head is None:
        return []
    name = head.name
    try:
        has_code, chains = _look(head, shipping.code_hash(tops=shipping.HEAD_SHIPPED))
    except ClusterError as exc:
        return [Row(name, "reachable", False, f"{exc.what}", "check it with 'fab status' ('fab local-up' starts a local "
                    "head); meanwhile 'fab train --detach --no-head' supervises from this machine")]
    rows = [Row(name, "reachable", True, f"{head.user}@{head.host}:{head.port}")]
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
