"""The cheap checks fab train runs before it writes anything (reachability, python, the shipped code, profile markers, the SSH mesh); fab doctor starts from the same facts."""
from __future__ import annotations

import logging
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath

from cluster import keys, shipping
from cluster.node import Node
from cluster.remote import connect, remote_home, run
from cluster.resolve import Cluster
from core.errors import ClusterError
from core.report import CLUSTER, Report, Row
from launch.plan import topology
from node_setup import profiles
from node_setup.setup import installed_versions

log = logging.getLogger(__name__)


# Without --profile: the training stack, compared across nodes.
STACK = ("torch", "transformers", "accelerate", "datasets", "impi-rt", "intel_extension_for_pytorch",
         "oneccl_bind_pt")


@dataclass
class Facts:
    """What one SSH session learned about a node; ``error`` is set when the node could not be reached."""

    node: Node
    error: str = ""
    fix: str = ""  # how to fix what ``error`` says
    home: str = ""
    python: str | None = None  # version of node.python, None if it does not run
    code: str | None = None  # digest of the installed copy of this revision, None if not there
    marker: str | None = None  # profile hash next to node.python's venv
    topo: topology.Topology | None = None
    topo_error: str = ""
    free_gib: float | None = None
    versions: dict[str, str] | None = None
    clock_offset: float | None = None
    kernels: tuple[bool | None, str] | None = None  # shipping.native_kernels; None: the code is not there


def _marker_path(node: Node) -> str | None:
    python = PurePosixPath(node.python)
    if not python.is_absolute():
        return None
    return str(python.parent.parent / profiles.MARKER_NAME)


def gather(node: Node, digest: str, full: bool, python_word: str | None = None,
           packages: tuple[str, ...] = ()) -> Facts:
    """One session per node: everything the checks need, each command bounded by a timeout."""
    facts = Facts(node)
    try:
        conn = connect(node)
    except ClusterError as exc:
        facts.error, facts.fix = exc.what, exc.fix
        return facts
    with conn:
        try:
            facts.home = remote_home(conn)
        except ClusterError as exc:
            facts.error, facts.fix = exc.what, exc.fix
            return facts
        res = run(conn, f"{shlex.quote(node.python)} -c 'import sys; print(sys.version.split()[0])'", timeout=30)
        facts.python = res.stdout.strip() if res.ok else None
        facts.code = shipping.installed_code_hash(conn, f"{facts.home}/code/{digest}")
        marker = _marker_path(node)
        if marker:
            res = run(conn, f"cat {shlex.quote(marker)}", timeout=30)
            facts.marker = res.stdout.strip() if res.ok else None
        if not full:
            return facts
        res = run(conn, topology.PROBE, timeout=60)
        try:
            facts.topo = topology.parse(res.stdout)
        except ValueError as exc:
            facts.topo_error = str(exc)
        res = run(conn, f"df -Pk {shlex.quote(facts.home)} | tail -n 1", timeout=30)
        fields = res.stdout.split()
        if res.ok and len(fields) >= 4 and fields[3].isdigit():
            facts.free_gib = int(fields[3]) / 2**20
        facts.versions = installed_versions(conn, python_word or shlex.quote(node.python), list(packages))
        if facts.code:
            facts.kernels = shipping.native_kernels(conn, f"{facts.home}/code/{digest}",
                                                    python_word or shlex.quote(node.python))
        # The node's clock against the operator's, halfway through the round trip.
        before = time.time()
        res = run(conn, "date +%s.%N", timeout=30)
        after = time.time()
        try:
            facts.clock_offset = float(res.stdout.strip()) - (before + after) / 2
        except ValueError:
            facts.clock_offset = None
    return facts


def gather_all(nodes: list[Node], **kw) -> list[Facts]:
    def one(node: Node) -> Facts:
        try:
            return gather(node, **kw)
        except Exception as exc:  # a command past its timeout, a dropped connection: this node's row
            log.debug("gather on %s", node.name, exc_info=True)
            return Facts(node, error=f"{node.name}: {type(exc).__name__}: {exc}", fix="check the node's load and sshd")

    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        return list(pool.map(one, nodes))


def _profile_name(hash_: str) -> str:
    for name, p in profiles.load_profiles().items():
        if p.hash == hash_:
            return f"profile {name} ({hash_})"
    return f"an unknown profile ({hash_})"


def preflight_rows(facts: list[Facts], digest: str) -> list[Row]:
    rows = []
    for f in facts:
        n = f.node
        if f.error:
            rows.append(Row(n.name, "reachable", False, f.error, f.fix))
            continue
        rows.append(Row(n.name, "reachable", True, f"{n.user}@{n.host}:{n.port}, work folder {f.home}"))
        if f.python:
            rows.append(Row(n.name, "python", True, f"python {f.python} at {n.python}"))
        else:
            rows.append(Row(n.name, "python", False, f"{n.python} does not run",
                            "run 'fab setup' (or point the inventory's python= at a python with torch)"))
        if f.code == digest:
            rows.append(Row(n.name, "code", True, f"revision {digest} installed and verified"))
        elif f.code is None:
            rows.append(Row(n.name, "code", True, f"revision {digest} not on the node yet ('fab train' ships it)"))
        else:
            rows.append(Row(n.name, "code", False, f"{f.home}/code/{digest} was changed on the node (its files hash "
                            f"to {f.code})", f"run 'fab setup' to re-ship revision {digest}"))
    up = [f for f in facts if not f.error and f.python]
    minors = {f.node.name: ".".join(f.python.split(".")[:2]) for f in up}
    if len(set(minors.values())) > 1:
        detail = ", ".join(f"{k} {v}" for k, v in minors.items())
        rows.append(Row(CLUSTER, "python version", False, f"nodes run different pythons: {detail}",
                        "set every node up from the same image or profile ('fab setup')"))
    elif minors:
        rows.append(Row(CLUSTER, "python version", True, f"python {next(iter(minors.values()))} on {len(minors)} "
                        "node(s)"))
    markers = {f.node.name: f.marker for f in facts if not f.error}
    if any(markers.values()):
        if len(set(markers.values())) == 1:
            rows.append(Row(CLUSTER, "profile", True, f"{_profile_name(next(iter(markers.values())))} on "
                            f"{len(markers)} node(s)"))
        else:
            detail = ", ".join(f"{k} has {_profile_name(v) if v else 'no profile marker'}" for k, v in markers.items())
            rows.append(Row(CLUSTER, "profile", False, f"the nodes' python venvs were set up differently: {detail}",
                            "run 'fab setup --profile NAME' so every node has the same one"))
    return rows


def mesh_rows(cluster: Cluster, nodes: list[Node], facts: list[Facts]) -> list[Row]:
    """Node 0 reaching every node with the cluster's ssh config (verified host keys, as mpirun does)."""
    check = "ssh from " + nodes[0].name
    if facts[0].error:
        return [Row(n.name, check, False, f"not checked: {nodes[0].name} is unreachable", skipped=True)
                for n in nodes]
    try:
        problems = keys.verify_mesh(cluster, nodes)
    except Exception as exc:  # a hung ssh (CommandTimedOut) or a lost node 0 is a row, not a traceback
        log.debug("verify_mesh", exc_info=True)
        return [Row(n.name, check, False, f"{type(exc).__name__}: {exc}", "run 'fab keys'") for n in nodes]
    rows = []
    for n, f in zip(nodes, facts):
        problem = problems.get(n.name)
        if problem is None:
            rows.append(Row(n.name, check, True, f"{nodes[0].name} -> {n.name} ({n.private_host}:{n.port}) with "
                            "a verified host key"))
        elif re.search(r"host key|known_hosts|config file|Permission denied|No such file", problem, re.IGNORECASE):
            rows.append(Row(n.name, check, False, f"{nodes[0].name} cannot ssh to {n.name}: {problem}",
                            f"run 'fab keys' (records {n.name}'s verified host key and the cluster key on "
                            f"{nodes[0].name})"))
        else:
            rows.append(Row(n.name, check, False, f"{nodes[0].name} cannot ssh to {n.name}: {problem}",
                            f"check that {n.name} is up and that traffic inside the cluster is allowed "
                            "(security group), then run 'fab keys'"))
    return rows


def preflight(cluster: Cluster, nodes: list[Node], mesh: bool = True) -> Report:
    """The cheap checks `fab train` runs before it writes anything: a few seconds for any cluster size."""
    digest = shipping.code_hash()
    facts = gather_all(nodes, digest=digest, full=False)
    report = Report([n.name for n in nodes], preflight_rows(facts, digest))
    if mesh:
        report.rows += mesh_rows(cluster, nodes, facts)
    return report
