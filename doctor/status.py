"""`fab status`: the active cluster at a glance: its nodes (node 0 first) with type, market, state,
uptime and price, and any run still holding processes on them (the orphan finder of a fab that died)."""
from __future__ import annotations

import time

from cluster import aws, local
from cluster.resolve import Cluster
from core.report import Row
from doctor.rows import runs_rows
from infra import cost


def cluster_line(cluster: Cluster) -> str:
    """Which cluster a task chose, and how it was named: the first line of 'fab train' and 'fab status'."""
    names = {n.labels.get("cluster") for n in cluster.nodes} - {None, ""}
    kind = cluster.spec.split(":", 1)[0]
    count = f"{len(cluster.nodes)} node(s)"
    if kind in ("aws", "pulumi") and names:
        region = {n.labels.get("availability_zone", "")[:-1] for n in cluster.nodes} - {""}
        where = f" in {region.pop()}" if len(region) == 1 else ""
        via = f"{cluster.spec}: " if kind == "pulumi" else ""
        return f"cluster: {via}aws:{names.pop()}{where}, {count}"
    return f"cluster: {cluster.spec}, {count}"


def uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes = int(seconds // 60)
    days, hours, mins = minutes // 1440, minutes // 60 % 24, minutes % 60
    return f"{days}d {hours}h" if days else (f"{hours}h {mins:02d}m" if hours else f"{mins}m")


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def local_rows(cluster: Cluster) -> tuple[list[tuple[str, ...]], float]:
    now = time.time()
    rows = [(n["name"], f"{n['host']}:{n['port']}", "local sshd" + (" (head)" if n["name"] == local.HEAD else ""), "-",
             "running" if n["running"] else "DOWN",
             uptime(now - n["since"] if n["since"] else None), "0.00") for n in local.node_status(cluster.state)]
    return rows, 0.0


def aws_rows(cluster: Cluster) -> tuple[list[tuple[str, ...]], float]:
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc)
    rows, total = [], 0.0
    region = None
    for node in cluster.nodes:
        spot = node.labels.get("lifecycle") == "spot"
        zone = node.labels.get("availability_zone", "")
        region = zone[:-1] or None
        kind = node.labels.get("instance_type", "")
        price = cost.estimate(kind, 1, availability_zone=zone, spot=spot, region=region).total_usd_h
        total += price
        launched = node.labels.get("launch_time", "")
        age = (now - datetime.fromisoformat(launched)).total_seconds() if launched else None
        rows.append((node.name, node.labels.get("instance_id", ""), kind, "spot" if spot else "on-demand",
                     "running", uptime(age), f"{price:.2f}"))
    name = next(iter({n.labels.get("cluster") for n in cluster.nodes}), "")
    for inst in aws.starting_nodes(name, region):
        rows.append(("-", inst["InstanceId"], inst.get("InstanceType", ""),
                     "spot" if inst.get("InstanceLifecycle") == "spot" else "on-demand",
                     inst.get("State", {}).get("Name", "?"), "-", "-"))
    for inst in aws.head_instances(name, region) if name else []:  # runs the detached runs' supervisors
        kind, state = inst.get("InstanceType", ""), inst.get("State", {}).get("Name", "?")
        zone = inst.get("Placement", {}).get("AvailabilityZone", "")
        # a head type is priced from the head's table (t3.*), not the nodes' catalog, which refuses it
        price = cost.head_usd_h(kind) if kind in cost.HEAD_USD_H else cost.estimate(
            kind, 1, availability_zone=zone, spot=False, region=zone[:-1] or region).total_usd_h
        total += price if state == "running" else 0.0
        launched = inst.get("LaunchTime")
        rows.append((f"{name}-head", inst["InstanceId"], kind, "on-demand", state,
                     uptime((now - launched).total_seconds() if launched else None), f"{price:.2f}"))
    return rows, total


def status(cluster: Cluster, check_runs: bool = True) -> tuple[list[str], bool]:
    """The lines to print, and whether all is well (every node running, no run left behind)."""
    kind = cluster.spec.split(":", 1)[0]
    if kind == "local":
        rows, total = local_rows(cluster)
    elif kind in ("aws", "pulumi"):
        rows, total = aws_rows(cluster)
    else:
        rows, total = [(n.name, f"{n.host}:{n.port}", "-" if n is not cluster.head else "head", "-", "listed", "-", "-")
                       for n in (*cluster.nodes, *filter(None, [cluster.head]))], 0.0
    lines = [cluster_line(cluster), *table(("node", "address/instance", "type", "market", "state", "uptime", "$/h"),
                                          rows)]
    lines.append(f"total: ${total:.2f}/h (${total * 730:,.0f} per month if left running)")
    ok = all(r[4] in ("running", "listed") for r in rows)
    if not ok:
        off = [f"{r[0] if r[0] != '-' else r[1]} ({r[4]})" for r in rows if r[4] not in ("running", "listed")]
        fix = ("'fab local-up' restarts the local nodes that are down" if kind == "local" else
               "the Auto Scaling group is replacing or starting them; run 'fab status' again in a few minutes")
        lines.append(f"not running: {', '.join(off)}; {fix}")
    if check_runs:
        found: list[Row] = runs_rows(list(cluster.nodes))
        for row in found:
            lines.append(f"runs: {row.detail}" + (f"; {row.fix}" if row.fix else ""))
        ok = ok and all(r.ok for r in found)
    return lines, ok
