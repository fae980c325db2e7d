"""Per-node rows from the gathered facts: CPU and AMX, memory, disk, package versions, clock skew."""
from __future__ import annotations

import logging

from cluster.node import Node
from core.catalog import CATALOG
from core.report import CLUSTER, Row
from doctor import checks
from launch.life.cleanup import runs_alive
from launch.plan import topology
from launch.plan.preflight import Facts
from node_setup import profiles

log = logging.getLogger(__name__)


MIN_MEM_GIB = 4.0


MIN_FREE_GIB = 5.0  # wheels, the HF cache and checkpoints of a small model


def amx_expectation(node: Node, topo: topology.Topology) -> tuple[bool | None, str]:
    """(whether the node should have AMX, on what grounds); (None, ...) when nothing tells."""
    itype = node.labels.get("instance_type")
    if itype in CATALOG:
        return CATALOG[itype].amx, f"instance type {itype}"
    if "amx" in node.labels:
        return bool(node.labels["amx"]), "the node's amx label"
    by_model = checks.model_has_amx(topo.model)
    if by_model is not None:
        return by_model, f"CPU model {topo.model}"
    if checks.AMX_FLAGS & topo.flags:
        return True, "the CPU's own amx flags"
    return None, f"CPU model {topo.model!r} is not one this project knows"


def hardware_rows(f: Facts) -> list[Row]:
    name = f.node.name
    if f.topo is None:
        return [Row(name, "CPU", False, f"lscpu failed: {f.topo_error}", "install util-linux on the node")]
    t = f.topo
    rows = [Row(name, "CPU", True, f"{t.model}; {t.sockets} socket(s), {t.physical_cores} physical core(s) usable "
                f"({t.cores_per_socket} per socket, {t.threads_per_core} thread(s) per core)")]
    expect, why = amx_expectation(f.node, t)
    if expect is None:
        have = "present" if checks.AMX_FLAGS <= t.flags else "absent"
        rows.append(Row(name, "AMX", True, f"skipped: {why}, so AMX is not expected or ruled out (flags {have}, "
                        f"kernel {t.kernel}); label the node amx=true to check it", skipped=True))
    else:
        res = checks.amx_check(set(t.flags), t.kernel, expect)
        rows.append(Row(name, "AMX", res.ok, f"{res.detail} (expected from {why})" if expect else res.detail,
                        res.fix))
    ok = t.mem_gib >= MIN_MEM_GIB
    rows.append(Row(name, "memory", ok, f"{t.mem_gib:.1f} GiB (at least {MIN_MEM_GIB:g})",
                    "" if ok else "use an instance type with more memory"))
    if f.free_gib is None:
        rows.append(Row(name, "disk", False, f"could not read the free space under {f.home}",
                        "check that df works on the node"))
    else:
        ok = f.free_gib >= MIN_FREE_GIB
        rows.append(Row(name, "disk", ok, f"{f.free_gib:.1f} GiB free under {f.home} (at least {MIN_FREE_GIB:g})",
                        "" if ok else "free space there or grow the root volume (rootVolumeGib)"))
    rows.append(kernels_row(f))
    return rows


def kernels_row(f: Facts) -> Row:
    """training/speed/native's library: built for this node's CPU and loaded by its python."""
    if f.kernels is None:
        return Row(f.node.name, "kernels", True, "not checked: this revision's code is not on the node yet (fab "
                   "setup or fab train ships it)", skipped=True)
    ok, detail = f.kernels
    if ok is None:
        return Row(f.node.name, "kernels", True, detail, skipped=True)
    return Row(f.node.name, "kernels", bool(ok), detail, "" if ok else
               "install gcc on the node (fab setup's profiles do); without it the jobs take torch's slower ops")


def package_rows(facts: list[Facts], profile: profiles.Profile | None, venv: str | None) -> list[Row]:
    rows = []
    fix = f"run 'fab setup --profile {profile.name}'" if profile else "run 'fab setup'"
    for f in facts:
        if f.error:
            continue
        name = f.node.name
        where = venv or f.node.python
        if f.versions is None:
            rows.append(Row(name, "packages", False, f"the python of {where} does not run"
                            + (f": profile {profile.name} is not set up" if profile else ""), fix))
        elif profile:
            problems = profiles.matched_set_problems(profile, f.versions)
            listed = ", ".join(f"{k} {v}" for k, v in sorted(f.versions.items()))
            if problems:
                rows.append(Row(name, f"profile {profile.name}", False,
                                "; ".join(p.split("; run 'fab setup", 1)[0] for p in problems), fix))
            else:
                rows.append(Row(name, f"profile {profile.name}", True,
                                f"{listed}: the matched set pinned by profile {profile.name}"))
        else:
            listed = ", ".join(f"{k} {v}" for k, v in sorted(f.versions.items())) or "none of the training stack"
            rows.append(Row(name, "packages", True, f"{listed} (no --profile: compared across nodes only)"))
    per_node = {f.node.name: f.versions for f in facts if f.versions is not None}
    if len(per_node) > 1:
        for res in checks.versions_identical(per_node):
            rows.append(Row(CLUSTER, res.name, res.ok, res.detail, res.fix))
    return rows


def clock_row(facts: list[Facts]) -> Row:
    offsets = {f.node.name: f.clock_offset for f in facts if f.clock_offset is not None}
    res = checks.clock_skew_check(offsets)
    return Row(CLUSTER, res.name, res.ok, res.detail, res.fix)


def runs_rows(nodes: list[Node]) -> list[Row]:
    """Processes of runs still on the nodes: a run going on, or one whose fab died (kill -9, a closed
    laptop) and left its ranks training with nobody to end them."""
    unasked: dict[str, str] = {}
    alive = runs_alive(nodes, unasked)
    rows = [Row(CLUSTER, "runs", False, f"could not ask {name} for runs: {why}", "check the node with 'fab doctor'")
            for name, why in unasked.items()]
    if not alive:
        asked = "the nodes" if not unasked else "the nodes that answered"
        return [*rows, Row(CLUSTER, "runs", True, f"no process of any run on {asked}")]
    for run_id, where in sorted(alive.items()):
        on = ", ".join(f"{n} ({c})" for n, c in where.items())
        rows.append(Row(CLUSTER, "runs", False, f"run {run_id} has processes on {on}",
                        f"if no fab is watching it, end it with 'fab stop {run_id}'"))
    return rows
