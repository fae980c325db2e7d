"""Across the nodes: the rendezvous port reached from every node, and a 4 MB all-reduce through the real launcher."""
from __future__ import annotations

import io
import logging
import re
import secrets
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cluster.node import Node
from cluster.remote import connect, run
from cluster.resolve import Cluster
from core.errors import ClusterError
from core.report import CLUSTER, Row
from launch.life import records
from launch.plan.request import TrainRequest, new_run_id
from launch.run import cleanup, train

log = logging.getLogger(__name__)


RENDEZVOUS_WAIT_S = 10.0


COLLECTIVE_TIMEOUT_S = 30  # gloo's own timeout for the rendezvous and each collective


ALLREDUCE_LIMIT_S = 5.0  # one 4 MB all-reduce; even gloo over TCP does it in well under a second


ALLREDUCE_DEADLINE_S = 240.0  # the whole job: probe, staging, mpirun, torch import on every rank


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
        return [Row(n.name, check, False, f"not checked: {exc.what}", skipped=True) for n in clients]
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
from training.jobs import dist as xdist
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
    from training.runtime import events
    events.emit(events.RunEvent(events.FINISHED, rank))
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
    """The backend fab train resolved, from the run's record (absent when it failed before planning)."""
    rec = records.load_or_none(run_dir)
    return rec.backend if rec else None


def allreduce_row(cluster: Cluster, nodes: list[Node], port: int, backend: str = "auto",
                  env: dict[str, str] | None = None) -> Row:
    """A 4 MB all-reduce across the nodes through the real launcher (fab train --script), with the
    backend and variables fab train would use."""
    check = "all-reduce"
    folder = cluster.state / "doctor"
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "allreduce.py"
    script.write_text(ALLREDUCE_PY)
    run_id = new_run_id("doctor")
    req = TrainRequest.of(nodes=len(nodes), job=None, script=str(script), backend=backend, precision="fp32",
                                 master_port=port, timeout_s=COLLECTIVE_TIMEOUT_S, runs_dir=folder / "runs",
                                 env=dict(env or {}), args=[str(COLLECTIVE_TIMEOUT_S * 2), str(COLLECTIVE_TIMEOUT_S)],
                                 run_id=run_id)
    buf = io.StringIO()
    outcome: dict = {}

    def job():
        try:
            outcome["result"] = train(cluster, req, out=buf)
        except Exception as exc:  # the row reports it; the thread must not die silently
            log.debug("doctor all-reduce", exc_info=True)
            outcome["error"] = exc

    started = time.monotonic()
    worker = threading.Thread(target=job, name="doctor-allreduce", daemon=True)
    worker.start()
    worker.join(ALLREDUCE_DEADLINE_S)
    if worker.is_alive():
        cleanup(nodes, run_id)  # ends the ranks, so mpirun and the thread end too
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
        err = outcome["error"]
        what = err.what if isinstance(err, ClusterError) else str(err)
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
