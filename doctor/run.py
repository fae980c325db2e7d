"""`fab doctor`: what is wrong with the nodes, one row per check, each failing row with its fix.

``preflight`` is the cheap part (reachability, python, the shipped code, profile markers, SSH mesh)
that `fab train` runs before it writes anything. ``doctor`` adds hardware, AMX, memory and disk,
the profile's package versions, the rendezvous port, clock skew and a real cross-node all-reduce.
Every remote step is bounded by a timeout: a broken cluster gives red rows, never a hang.
"""
from __future__ import annotations

import io
import logging
from typing import TextIO

from cluster import keys, shipping
from cluster import store as store_lib
from cluster.node import Node
from cluster.resolve import Cluster
from core.constants import DEFAULT_MASTER_PORT
from core.errors import ClusterError
from core.report import CLUSTER, Report, Row
from doctor.collective import allreduce_row, rendezvous_rows
from doctor.head import head_rows
from doctor.rows import clock_row, hardware_rows, package_rows, runs_rows
from doctor.store_probe import store_rows
from launch.plan.preflight import STACK, gather_all, mesh_rows, preflight_rows
from node_setup import profiles
from node_setup.setup import default_venv, venv_python

log = logging.getLogger(__name__)


def doctor(cluster: Cluster, nodes: list[Node], profile: str | profiles.Profile | None = None, full: bool = True,
           port: int = DEFAULT_MASTER_PORT, out: TextIO | None = None, backend: str = "auto",
           env: dict[str, str] | None = None, store: store_lib.Choice | None = None) -> Report:
    """Every check; ``full=False`` leaves out the rendezvous listener and the all-reduce."""
    out = out or io.StringIO()

    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    p = profile if isinstance(profile, profiles.Profile) or profile is None else profiles.load_profile(profile)
    venv = default_venv(p, nodes) if p else None
    digest = shipping.code_hash()
    packages = tuple(pkg.name for pkg in p.packages) if p else STACK
    say(f"doctor: checking {len(nodes)} node(s) of {cluster.spec}"
        + (f" against profile {p.name} (venv {venv})" if p else ""))
    facts = gather_all(nodes, digest=digest, full=True, python_word=venv_python(venv) if venv else None,
                        packages=packages)
    report = Report([n.name for n in nodes] + ([cluster.head.name] if cluster.head else []), preflight_rows(facts, digest))
    for f in facts:
        if not f.error:
            report.rows += hardware_rows(f)
    report.rows += package_rows(facts, p, venv)
    report.rows.append(clock_row([f for f in facts if not f.error]))
    report.rows += mesh_rows(cluster, nodes, facts)
    report.rows += runs_rows([f.node for f in facts if not f.error])
    report.rows += head_rows(cluster.head, store.url if store is not None else None)
    if store is not None:  # every node writes, reads and deletes a probe object in the cluster's store
        say(f"doctor: {store.line()}")
        report.rows += store_rows([f.node for f in facts if not f.error], store, cluster.spec)
    down = [f.node.name for f in facts if f.error]
    if not full:
        report.rows.append(Row(CLUSTER, "port, all-reduce", True, "not run (--quick)", skipped=True))
        return report
    if down:
        why = f"not run: {', '.join(down)} unreachable"
        report.rows.append(Row(CLUSTER, "rendezvous port", False, why, "fix the 'reachable' rows", skipped=True))
        report.rows.append(Row(CLUSTER, "all-reduce", False, why, "fix the 'reachable' rows", skipped=True))
        return report
    say(f"doctor: rendezvous port {port} on {nodes[0].name}")
    report.rows += rendezvous_rows(nodes, port)
    blocking = [r for r in report.failures if r.check in ("python", "rendezvous port") or r.check.startswith("ssh ")]
    if blocking:
        report.rows.append(Row(CLUSTER, "all-reduce", False, "not run: a job would fail on "
                               + ", ".join(f"{r.node} {r.check}" for r in blocking), "fix those rows", skipped=True))
        return report
    try:  # mpirun needs node 0 to reach every node; a check that changes the nodes says so
        added = keys.setup_keys(cluster, nodes).authorized
    except ClusterError as exc:
        report.rows.append(Row(CLUSTER, "all-reduce", False, f"not run: the cluster key could not be set up: {exc}",
                               "run 'fab keys'", skipped=True))
        return report
    if added:
        say(f"doctor: authorised this cluster's SSH key on {', '.join(added)} (mpirun reaches the nodes with it)")
    say(f"doctor: all-reduce across {len(nodes)} node(s) through mpirun")
    report.rows.append(allreduce_row(cluster, nodes, port, backend=backend, env=env))
    return report

