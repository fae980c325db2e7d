"""`fab doctor`: what is wrong with the nodes, one row per check, each failing row with its fix.

``preflight`` is the cheap part (reachability, python, the shipped code, profile markers, SSH mesh)
that `fab train` runs before it writes anything. ``doctor`` adds hardware, AMX, memory and disk,
the profile's package versions, the rendezvous port, clock skew and a real cross-node all-reduce.
Every remote step is bounded by a timeout: a broken cluster gives red rows, never a hang.
"""
from __future__ import annotations

import io
import logging
import re
import secrets
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TextIO

from . import checks, keys, profiles, shipping, topology
from .cluster import Cluster
from .errors import ClusterError, NodeFailure
from .inventory import Node
from .remote import connect, remote_home, run
from .setup import default_venv, installed_versions, venv_python

log = logging.getLogger(__name__)

CLUSTER = "cluster"  # the "node" of rows about the nodes together
DEFAULT_MASTER_PORT = 29500  # fab train's default rendezvous port
MIN_MEM_GIB = 4.0
MIN_FREE_GIB = 5.0  # wheels, the HF cache and checkpoints of a small model
# Without --profile: the training stack, compared across nodes.
STACK = ("torch", "transformers", "accelerate", "datasets", "impi-rt", "intel_extension_for_pytorch",
         "oneccl_bind_pt")
RENDEZVOUS_WAIT_S = 10.0
COLLECTIVE_TIMEOUT_S = 30  # gloo's own timeout for the rendezvous and each collective
ALLREDUCE_LIMIT_S = 5.0  # one 4 MB all-reduce; even gloo over TCP does it in well under a second
ALLREDUCE_DEADLINE_S = 240.0  # the whole job: probe, staging, mpirun, torch import on every rank


@dataclass(frozen=True)
class Row:
    node: str  # a node's name, or CLUSTER
    check: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("ok" if self.ok else "FAIL")


@dataclass
class Report:
    nodes: list[str]
    rows: list[Row] = field(default_factory=list)

    @property
    def failures(self) -> list[Row]:
        """Failed checks; a skipped row (not checkable because of another failure) is not one more problem."""
        return [r for r in self.rows if not r.ok and not r.skipped]

    @property
    def ok(self) -> bool:
        return not self.failures

    def row(self, node: str, check: str) -> Row | None:
        return next((r for r in self.rows if r.node == node and r.check == check), None)

    def verdict(self) -> str:
        skipped = sum(r.skipped for r in self.rows)
        extra = f" ({skipped} skipped)" if skipped else ""
        if self.ok:
            return f"verdict: healthy: {len(self.rows) - skipped} checks passed on {len(self.nodes)} node(s){extra}"
        names = ", ".join(f"{r.node} {r.check}" for r in self.failures)
        return f"verdict: {len(self.failures)} problem(s): {names}; fix the FAIL rows above{extra}"

    def render(self) -> str:
        check_w = max([5] + [len(r.check) for r in self.rows])
        out = []
        for group in [*self.nodes, CLUSTER]:
            rows = [r for r in self.rows if r.node == group]
            if not rows:
                continue
            out.append(f"{group}:" if group != CLUSTER else "across the nodes:")
            for r in rows:
                out.append(f"  {r.check:<{check_w}}  {r.status:<4}  {r.detail}")
                if r.fix and not r.ok and not r.skipped:
                    out.append(f"  {'':<{check_w}}        fix: {r.fix}")
        out.append(self.verdict())
        return "\n".join(out)

    def raise_if_failed(self, what: str = "doctor") -> None:
        if self.ok:
            return
        bad = self.failures
        nodes = sorted({r.node for r in bad if r.node != CLUSTER}, key=self._order)
        parts = [f"{r.node} {r.check}: {r.detail}" + (f" (fix: {r.fix})" if r.fix else "") for r in bad]
        raise NodeFailure(f"{what} found {len(bad)} problem(s): " + "; ".join(parts), nodes)

    def _order(self, name: str) -> int:
        return self.nodes.index(name) if name in self.nodes else len(self.nodes)


@dataclass
class Facts:
    """What one SSH session learned about a node; ``error`` is set when the node could not be reached."""

    node: Node
    error: str = ""
    home: str = ""
    python: str | None = None  # version of node.python, None if it does not run
    code: str | None = None  # digest of the installed copy of this revision, None if not there
    marker: str | None = None  # profile hash next to node.python's venv
    topo: topology.Topology | None = None
    topo_error: str = ""
    free_gib: float | None = None
    versions: dict[str, str] | None = None
    clock_offset: float | None = None


def split_fix(message: str) -> tuple[str, str]:
    """'what is wrong; how to fix it' -> (what, fix)."""
    what, _, fix = message.partition("; ")
    return what, fix


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
        facts.error = str(exc)
        return facts
    with conn:
        try:
            facts.home = remote_home(conn)
        except ClusterError as exc:
            facts.error = str(exc)
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
        # The node's clock against the operator's, halfway through the round trip.
        before = time.time()
        res = run(conn, "date +%s.%N", timeout=30)
        after = time.time()
        try:
            facts.clock_offset = float(res.stdout.strip()) - (before + after) / 2
        except ValueError:
            facts.clock_offset = None
    return facts


def _gather_all(nodes: list[Node], **kw) -> list[Facts]:
    def one(node: Node) -> Facts:
        try:
            return gather(node, **kw)
        except Exception as exc:  # a command past its timeout, a dropped connection: this node's row
            log.debug("gather on %s", node.name, exc_info=True)
            return Facts(node, error=f"{node.name}: {type(exc).__name__}: {exc}; check the node's load and sshd")

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
            what, fix = split_fix(f.error)
            rows.append(Row(n.name, "reachable", False, what, fix))
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
    facts = _gather_all(nodes, digest=digest, full=False)
    report = Report([n.name for n in nodes], preflight_rows(facts, digest))
    if mesh:
        report.rows += mesh_rows(cluster, nodes, facts)
    return report


def amx_expectation(node: Node, topo: topology.Topology) -> tuple[bool | None, str]:
    """(whether the node should have AMX, on what grounds); (None, ...) when nothing tells."""
    itype = node.labels.get("instance_type")
    if itype:
        try:
            from infra.catalog import CATALOG
        except ImportError:  # the operator may have installed node_setup without the infra extra
            CATALOG = {}
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
    return rows


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


LISTENER_PY = r"""
import socket, sys, time
host, port, expect, token, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind((host, port))
except OSError as e:
    print("bind-error", e.strerror or e, flush=True)
    sys.exit(3)
s.listen(64)
deadline, seen = time.monotonic() + wait, []
while len(seen) < expect and deadline > time.monotonic():
    s.settimeout(deadline - time.monotonic())
    try:
        c, addr = s.accept()
    except OSError:
        break
    with c:
        c.settimeout(2)
        try:
            c.sendall(token.encode() + b"\n")
            seen.append(addr[0])
        except OSError:
            pass
print("accepted", len(seen), flush=True)
"""

CLIENT_PY = r"""
import socket, sys, time
host, port, token, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
deadline, last = time.monotonic() + wait, "no attempt"
while time.monotonic() < deadline:
    try:
        with socket.create_connection((host, port), timeout=2) as c:
            c.settimeout(2)
            got = c.makefile("rb").readline().decode(errors="replace").strip()
        if got == token:
            print("reached")
            sys.exit(0)
        last = "another process answers on that port"
    except OSError as e:
        last = e.strerror or str(e) or type(e).__name__
    time.sleep(0.2)
print("failed", last)
sys.exit(5)
"""


def rendezvous_rows(nodes: list[Node], port: int) -> list[Row]:
    """A short-lived listener on node 0's private address; every other node connects to it."""
    master = nodes[0]
    clients = nodes[1:] or nodes  # one node: its own ranks still rendezvous on that address
    check = "rendezvous port"
    where = f"{master.name} {master.private_host}:{port}"
    token = secrets.token_hex(8)
    python = shlex.quote(master.python)
    listen = (f"timeout {int(RENDEZVOUS_WAIT_S) + 20} {python} -c {shlex.quote(LISTENER_PY)} "
              f"{shlex.quote(master.private_host)} {port} {len(clients)} {token} {RENDEZVOUS_WAIT_S + 5}")
    try:
        conn = connect(master)
    except ClusterError as exc:
        return [Row(n.name, check, False, f"not checked: {split_fix(str(exc))[0]}", skipped=True) for n in clients]
    with conn:
        listener = conn.run(listen, asynchronous=True, hide=True, warn=True, in_stream=False)

        def reach(node: Node) -> tuple[bool, str]:
            try:
                with connect(node) as c:
                    cmd = (f"timeout {int(RENDEZVOUS_WAIT_S) + 10} {shlex.quote(node.python)} -c "
                           f"{shlex.quote(CLIENT_PY)} {shlex.quote(master.private_host)} {port} {token} "
                           f"{RENDEZVOUS_WAIT_S}")
                    res = run(c, cmd, timeout=RENDEZVOUS_WAIT_S + 20)
                    return res.ok, (res.stdout.strip() or res.stderr.strip()).removeprefix("failed ")
            except Exception as exc:  # an unreachable client is reported by its own 'reachable' row too
                log.debug("rendezvous client %s", node.name, exc_info=True)
                return False, str(exc)

        with ThreadPoolExecutor(max_workers=min(32, len(clients))) as pool:
            results = list(pool.map(reach, clients))
        heard = listener.join()  # the listener ends once every client connected, or at its deadline
    bind_error = heard.stdout.strip() if heard.stdout.startswith("bind-error") else ""
    rows = []
    for n, (ok, detail) in zip(clients, results):
        if ok:
            rows.append(Row(n.name, check, True, f"{n.name} reached a listener on {where}"))
        elif bind_error:
            rows.append(Row(n.name, check, False, f"{where} is taken on {master.name} "
                            f"({bind_error.removeprefix('bind-error ')}): a job may be running",
                            "stop it, or pass another port with --master-port (to fab doctor and fab train)"))
        else:
            rows.append(Row(n.name, check, False, f"{n.name} cannot connect to {where}: {detail}",
                            f"allow TCP {port} inside the cluster (security group / firewall on {master.name})"))
    return rows


ALLREDUCE_PY = r'''"""fab doctor's all-reduce: every rank adds rank+1; the sum proves every rank took part.
The process group comes from the bundled jobs' own dist.setup(): the backend and CCL set-up fab train uses."""
import signal, sys, time
# A watchdog before anything can block: a rank that hangs dies, and mpirun then ends the job.
signal.alarm(int(sys.argv[1]))
import torch
import torch.distributed as dist
from training import dist as xdist
t0 = time.monotonic()
info = xdist.setup(precision="fp32", timeout_s=int(sys.argv[2]))
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((1 << 20,), float(rank + 1))
dist.all_reduce(x)  # the first one also sets up the connections
x.fill_(float(rank + 1))
t1 = time.monotonic()
dist.all_reduce(x)
t2 = time.monotonic()
ok = x.min().item() == x.max().item() == world * (world + 1) / 2
print(f"allreduce rank={rank} world={world} ok={int(ok)} init_s={t1 - t0:.3f} allreduce_s={t2 - t1:.4f} "
      f"backend={dist.get_backend()}", flush=True)
dist.destroy_process_group()
if ok:
    from training.common import FINISHED_TAG
    print(FINISHED_TAG, "rank", rank, flush=True)
sys.exit(0 if ok else 1)
'''
_ALLREDUCE_LINE = re.compile(r"allreduce rank=(\d+) world=(\d+) ok=(\d) init_s=([\d.]+) allreduce_s=([\d.]+) "
                             r"backend=(\w+)")
# What a failed collective set-up names: oneCCL reports a bad variable from a function named
# after it (env.cpp: env_2_worker_affinity), the loader a missing library.
_CAUSES = (
    (re.compile(r"env_2_(\w+): EXCEPTION: ([^\n]+)"), lambda m: f"CCL_{m.group(1).upper()}: {m.group(2).strip()}"),
    (re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file"),
     lambda m: f"library {m.group(1)} not found"),
    (re.compile(r"No module named '([\w.]+)'"), lambda m: f"python module {m.group(1)} missing"),
    (re.compile(r"\b(CCL_[A-Z_]+)\b[^\n]*"), lambda m: f"{m.group(1)}: {m.group(0).strip()[:160]}"),
    (re.compile(r"EXCEPTION: ([^\n]+)"), lambda m: f"oneCCL: {m.group(1).strip()}"),
)


def collective_cause(output: str) -> str | None:
    """The variable or library a failed all-reduce names, from the ranks' output; None if none is named."""
    error_lines = "\n".join(line for line in output.splitlines()
                            if re.search(r"EXCEPTION|[Ee]rror|cannot open|No module", line))
    for pattern, name in _CAUSES:
        m = pattern.search(error_lines)
        if m:
            return name(m)
    return None


def _recorded_backend(run_dir) -> str | None:
    """The backend fab train resolved, from the run's summary.json (absent when it failed before planning)."""
    import json

    try:
        return json.loads((run_dir / "summary.json").read_text()).get("backend")
    except (OSError, ValueError):
        return None


def allreduce_row(cluster: Cluster, nodes: list[Node], port: int, backend: str = "auto",
                  env: dict[str, str] | None = None) -> Row:
    """A 4 MB all-reduce across the nodes through the real launcher (fab train --script), with the
    backend and variables fab train would use."""
    from . import train as train_lib  # train imports this module for its preflight

    check = "all-reduce"
    folder = cluster.state / "doctor"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "allreduce.py"
    script.write_text(ALLREDUCE_PY)
    run_id = train_lib.new_run_id("doctor")
    req = train_lib.TrainRequest(nodes=len(nodes), job=None, script=str(script), backend=backend, precision="fp32",
                                 master_port=port, timeout_s=COLLECTIVE_TIMEOUT_S, runs_dir=folder / "runs",
                                 env=dict(env or {}), args=[str(COLLECTIVE_TIMEOUT_S * 2), str(COLLECTIVE_TIMEOUT_S)],
                                 run_id=run_id)
    buf = io.StringIO()
    outcome: dict = {}

    def job():
        try:
            outcome["result"] = train_lib.train(cluster, req, out=buf)
        except Exception as exc:  # the row reports it; the thread must not die silently
            log.debug("doctor all-reduce", exc_info=True)
            outcome["error"] = exc

    started = time.monotonic()
    worker = threading.Thread(target=job, name="doctor-allreduce", daemon=True)
    worker.start()
    worker.join(ALLREDUCE_DEADLINE_S)
    if worker.is_alive():
        train_lib.cleanup(nodes, run_id)  # ends the ranks, so mpirun and the thread end too
        worker.join(30)
        return Row(CLUSTER, check, False, f"no result within {ALLREDUCE_DEADLINE_S:.0f} s: the job hangs (ranks "
                   "killed)", f"check the rendezvous port and the 'ssh from' rows; the log is under {folder}/runs")
    wall = time.monotonic() - started
    output = buf.getvalue()
    lines = _ALLREDUCE_LINE.findall(output)
    used = _recorded_backend(folder / "runs" / run_id) or backend
    if "error" in outcome:
        cause = collective_cause(output)
        if cause:
            return Row(CLUSTER, check, False, f"the {used} job failed after {wall:.0f} s: {cause}",
                       f"fix {cause.split(':')[0]} on the nodes (or compare with --backend gloo); the log is under "
                       f"{folder}/runs")
        what = split_fix(str(outcome["error"]))[0]
        return Row(CLUSTER, check, False, f"the {used} job failed after {wall:.0f} s: {what}",
                   f"see the rows above and the log under {folder}/runs")
    world = int(lines[0][1]) if lines else 0
    slowest = max((float(x[4]) for x in lines), default=0.0)
    if not lines or len(lines) != world or not all(x[2] == "1" for x in lines):
        return Row(CLUSTER, check, False, f"{len(lines)} of {world} rank(s) reported a correct sum",
                   f"see the log under {folder}/runs")
    ran = sorted({x[5] for x in lines})
    if ran != [used]:
        return Row(CLUSTER, check, False, f"fab train chose backend {used} but the ranks ran {', '.join(ran)}",
                   "check that oneccl_bindings_for_pytorch imports on every node")
    if slowest > ALLREDUCE_LIMIT_S:
        return Row(CLUSTER, check, False, f"a 4 MB {used} all-reduce across {world} rank(s) took {slowest:.2f} s "
                   f"(limit {ALLREDUCE_LIMIT_S:g} s)", "check the network between the nodes (placement group, MTU)")
    return Row(CLUSTER, check, True, f"4 MB {used} all-reduce across {world} rank(s) on {len(nodes)} node(s) in "
               f"{slowest:.3f} s through mpirun (job {wall:.1f} s)")


def doctor(cluster: Cluster, nodes: list[Node], profile: str | profiles.Profile | None = None, full: bool = True,
           port: int = DEFAULT_MASTER_PORT, out: TextIO | None = None, backend: str = "auto",
           env: dict[str, str] | None = None) -> Report:
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
    facts = _gather_all(nodes, digest=digest, full=True, python_word=venv_python(venv) if venv else None,
                        packages=packages)
    report = Report([n.name for n in nodes], preflight_rows(facts, digest))
    for f in facts:
        if not f.error:
            report.rows += hardware_rows(f)
    report.rows += package_rows(facts, p, venv)
    report.rows.append(clock_row([f for f in facts if not f.error]))
    report.rows += mesh_rows(cluster, nodes, facts)
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

