"""`fab train`: probe the nodes, derive the layout, ship code and data, run mpirun on node 0,
stream every rank's output, collect results into runs/<run-id>/, and clean up after a failure.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from training import launcher, spot
from training.common import FINISHED_TAG

from . import doctor, keys, outputs, shipping, topology
from .cleanup import Sweep, sweep
from .cluster import Cluster
from .errors import ClusterError, NodeFailure, Preempted
from .inventory import Node
from .remote import connect, fan_out, remote_home, run
from .render import render

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RUNS = Path(os.environ.get("XC_RUNS_DIR") or PROJECT_ROOT / "runs")
# Flags of the bundled jobs whose values are files on the operator's machine: shipped to the nodes.
FILE_FLAGS = ("--train_file", "--validation_file", "--test_file")
BACKENDS = ("auto", "ccl", "gloo")
PRECISIONS = ("auto", "bf16", "fp32")


@dataclass
class TrainRequest:
    nodes: int | None = None
    job: str | None = "glue"
    script: str | None = None
    args: list[str] = field(default_factory=list)
    ppn: str = "auto"
    threads: str = "auto"
    backend: str = "auto"
    precision: str = "auto"
    env: dict[str, str] = field(default_factory=dict)
    master_port: int | None = None
    pin: bool = True
    timeout_s: int = 300
    runs_dir: Path = RUNS
    save_every: str = spot.DEFAULT_SAVE_EVERY
    fetch_model: bool = True
    resume: dict | None = None  # set by node_setup.resume: run_id, step, checkpoint (local folder)
    run_id: str | None = None  # chosen by the caller (doctor) so it can end the run by id; default: a new one


@dataclass
class NodeFacts:
    node: Node
    home: str
    topo: topology.Topology
    has_ccl: bool
    has_ipex: bool
    python_ok: str


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    exit_code: int
    wall_s: float
    results: dict | None
    failed_node: str | None = None


def _parse_auto_int(value: str, flag: str) -> int | None:
    if value in (None, "", "auto"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise ClusterError(f"{flag} {value!r} is not a number; use a positive integer or 'auto'") from None
    if n < 1:
        raise ClusterError(f"{flag} {n} must be at least 1 (or 'auto')")
    return n


def validate(req: TrainRequest) -> None:
    if req.script is None and req.job not in launcher.JOBS:
        raise ClusterError(f"--job {req.job!r} is not a bundled job; use one of: {', '.join(launcher.JOBS)} "
                           "(or --script PATH for your own)")
    if req.script is not None and not Path(req.script).is_file():
        raise ClusterError(f"--script {req.script} does not exist; pass the path of your training script")
    if req.backend not in BACKENDS:
        raise ClusterError(f"--backend {req.backend!r} is not one of {', '.join(BACKENDS)}")
    if req.precision not in PRECISIONS:
        raise ClusterError(f"--precision {req.precision!r} is not one of {', '.join(PRECISIONS)}")
    try:
        spot.parse_save_every(req.save_every)
    except ValueError as exc:
        raise ClusterError(f"--save-every: {exc}; e.g. --save-every 10m or --save-every 200") from None
    _parse_auto_int(req.ppn, "--ppn")
    _parse_auto_int(req.threads, "--threads")
    for flag, path in local_files(req.args):
        if not Path(path).expanduser().is_file():
            raise ClusterError(f"{flag} {path} does not exist; pass an existing data file (CSV, JSON or text)")


def local_files(args: list[str]) -> list[tuple[str, str]]:
    """(flag, path) for every data-file flag in the job arguments (both '--f x' and '--f=x')."""
    out = []
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in FILE_FLAGS:
            if eq:
                out.append((flag, value))
            elif i + 1 < len(args):
                out.append((flag, args[i + 1]))
            else:
                raise ClusterError(f"{flag} needs a file path")
    return out


def rewrite_files(args: list[str]) -> tuple[list[str], dict[str, Path]]:
    """Point data-file flags at data/<name> inside the run folder; returns new args and name -> local path."""
    ship: dict[str, Path] = {}
    out = list(args)
    for i, a in enumerate(out):
        flag, eq, value = a.partition("=")
        if flag not in FILE_FLAGS:
            continue
        idx, path = (i, value) if eq else (i + 1, out[i + 1])
        local = Path(path).expanduser().resolve()
        name = f"{len(ship)}-{local.name}"
        ship[name] = local
        out[idx] = f"{flag}=data/{name}" if eq else f"data/{name}"
    return out, ship


PROBE_PY = ("import importlib.util as u, sys; "
            "print('ccl=%d ipex=%d py=%s' % (u.find_spec('oneccl_bindings_for_pytorch') is not None, "
            "u.find_spec('intel_extension_for_pytorch') is not None, sys.version.split()[0]))")


def probe(node: Node) -> NodeFacts:
    with connect(node) as conn:
        home = remote_home(conn)
        res = run(conn, topology.PROBE)
        if not res.ok:
            raise ClusterError(f"{node.name}: reading the CPU topology failed: {res.stderr.strip()[-200:]}")
        try:
            topo = topology.parse(res.stdout)
        except ValueError as exc:
            raise ClusterError(f"{node.name}: {exc}") from None
        py = run(conn, f"{shlex.quote(node.python)} -c {shlex.quote(PROBE_PY)}")
        if not py.ok:
            raise ClusterError(f"{node.name}: python {node.python} does not run; set the node up with 'fab setup'")
        m = re.search(r"ccl=(\d) ipex=(\d) py=(\S+)", py.stdout)
        return NodeFacts(node=node, home=home, topo=topo, has_ccl=m.group(1) == "1",
                         has_ipex=m.group(2) == "1", python_ok=m.group(3))


def resolve_backend(requested: str, facts: list[NodeFacts]) -> str:
    missing = [f.node.name for f in facts if not f.has_ccl]
    if requested == "ccl" and missing:
        raise ClusterError(f"--backend ccl but oneccl_bindings_for_pytorch is missing on {', '.join(missing)}; "
                           "run 'fab setup --profile oneccl' or use --backend gloo")
    if requested == "auto":
        return "gloo" if missing else "ccl"
    return requested


def resolve_precision(requested: str, facts: list[NodeFacts]) -> str:
    if requested == "auto":
        return "bf16" if all(f.topo.bf16 for f in facts) else "fp32"
    if requested == "bf16":
        slow = [f.node.name for f in facts if not f.topo.bf16]
        if slow:
            log.warning("bf16 requested but %s have neither AMX nor AVX512-BF16: it will be emulated (slow)",
                        ", ".join(slow))
    return requested


def new_run_id(label: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{random.randbytes(2).hex()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OutputRouter(io.TextIOBase):
    """Turns mpirun's '[rank] line' output into '[rank host] line', logs everything, draws progress."""

    RANK_LINE = re.compile(r"^\[(\d+)\] ?(.*)$")

    def __init__(self, plan: launcher.LaunchPlan, out: TextIO, log_file: TextIO):
        self.plan, self.out, self.log_file = plan, out, log_file
        self.buffer = ""
        self.lock = threading.Lock()
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.progress_shown = False
        self.lines: list[str] = []
        self.finished: set[int] = set()  # ranks that printed FINISHED_TAG: their work is done

    def write(self, text: str) -> int:
        with self.lock:
            self.buffer += text
            *lines, self.buffer = self.buffer.split("\n")
            for line in lines:
                self._line(line.rstrip("\r"))
        return len(text)

    def flush_rest(self) -> None:
        if self.buffer:
            self._line(self.buffer)
            self.buffer = ""
        if self.progress_shown:
            self.out.write("\n")
            self.progress_shown = False
        self.out.flush()

    def _line(self, line: str) -> None:
        self.log_file.write(line + "\n")
        self.log_file.flush()
        self.lines.append(line)
        m = self.RANK_LINE.match(line)
        if m:
            rank = int(m.group(1))
            host = self.plan.rank_host(rank) if rank < self.plan.world_size else "?"
            text = m.group(2)
            if text.startswith(FINISHED_TAG):
                self.finished.add(rank)
            shown = f"[{rank} {host}] {text}"
            if self.tty and text.startswith("[progress]"):
                self.out.write("\r\x1b[K" + shown)
                self.out.flush()
                self.progress_shown = True
                return
        else:
            shown = line
        if self.progress_shown:
            self.out.write("\n")
            self.progress_shown = False
        self.out.write(shown + "\n")
        self.out.flush()


_BAD_RANK = re.compile(r"RANK (\d+) PID (\d+) RUNNING AT (\S+)")
_EXIT = re.compile(r"(KILLED BY SIGNAL: \d+ \(\w+\)|EXIT CODE: \d+)")


def failed_rank(lines: list[str], plan: launcher.LaunchPlan) -> tuple[str | None, str]:
    """From Intel MPI's BAD TERMINATION block: the node and reason of the first failed rank."""
    text = "\n".join(lines)
    m = _BAD_RANK.search(text)
    e = _EXIT.search(text)
    reason = e.group(1).lower() if e else "failed"
    if m:
        return plan.rank_host(int(m.group(1))), f"rank {m.group(1)} on {plan.rank_host(int(m.group(1)))} {reason}"
    for line in lines:  # a traceback or error line from one rank
        r = OutputRouter.RANK_LINE.match(line)
        if r and re.search(r"(Error|error:|Traceback)", r.group(2)):
            rank = int(r.group(1))
            if rank < plan.world_size:
                return plan.rank_host(rank), f"rank {rank} on {plan.rank_host(rank)} failed: {r.group(2)[:200]}"
    return None, "mpirun failed"


def cleanup(nodes: list[Node], run_id: str) -> Sweep:
    """Kill every process of this run on every node and check that none is left."""
    result = sweep(nodes, run_id)
    if not result.clean:
        log.error("run %s: %s", run_id, result.claim())
    return result


def plan_run(cluster: Cluster, req: TrainRequest, say) -> tuple[launcher.LaunchPlan, list[NodeFacts], list[str], dict]:
    validate(req)
    nodes = cluster.first(req.nodes)
    say(f"cluster {cluster.spec}: {len(nodes)} of {len(cluster.nodes)} node(s): {', '.join(n.name for n in nodes)}")
    facts = fan_out(nodes, probe, "probing nodes")
    backend = resolve_backend(req.backend, facts)
    precision = resolve_precision(req.precision, facts)
    ppn = _parse_auto_int(req.ppn, "--ppn")
    threads = _parse_auto_int(req.threads, "--threads")
    if ppn is None:  # one rank per socket, the same on every node (mpirun -ppn is global)
        ppn = min(len([s for s in f.topo.cores_by_socket if s]) for f in facts)
    layouts = topology.derive_layouts([f.topo for f in facts], ppn, threads, backend)
    node_plans = [launcher.NodePlan(name=f.node.name, layout=lay, malloc=f.topo.malloc)
                  for f, lay in zip(facts, layouts)]
    args, ship = rewrite_files(req.args)
    if req.resume:
        from .resume import same_global_batch

        world = ppn * len(node_plans)
        args, note = same_global_batch(args, int(req.resume["world_size"]), world)
        if note:
            say(note)
    if req.script:
        entry = (f"script/{Path(req.script).name}",)
        label = "script"
    else:
        entry = launcher.JOBS[req.job]
        label = req.job
        if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in args):
            args += ["--output_dir", "output"]
    plan = launcher.LaunchPlan(
        run_id=req.run_id or new_run_id(label), nodes=tuple(node_plans), master_addr=nodes[0].private_host,
        master_port=req.master_port or 29500, backend=backend, precision=precision, entry=tuple(entry),
        args=tuple(args), env_overrides=run_env(req), pin=req.pin, timeout_s=req.timeout_s)
    return plan, facts, args, ship


def run_env(req: TrainRequest) -> dict[str, str]:
    """The ranks' spot contract (training.spot) under the user's --env."""
    env = {"XC_SAVE_EVERY": req.save_every}
    if req.resume:
        env["XC_RESUME_FROM"] = f"resume/step-{req.resume['step']}"
    return {**env, **req.env}


def describe(plan: launcher.LaunchPlan, facts: list[NodeFacts]) -> list[str]:
    lines = []
    for f, p in zip(facts, plan.nodes):
        lines.append(f"{f.node.name}: {f.topo.summary()}; malloc {Path(p.malloc).name if p.malloc else 'default'}")
    layout = plan.nodes[0].layout
    lines.append(f"layout: {len(plan.nodes)} node(s) x {plan.ppn} rank(s) = {plan.world_size} ranks, "
                 f"{layout.omp_threads} thread(s) per rank, {layout.ccl_workers} CCL worker(s) "
                 f"(override with --ppn / --threads)")
    for p in plan.nodes:
        pins = "; ".join(f"rank {lr}: cpus {c}" for lr, c in launcher.rank_cpus(p))
        lines.append(f"pinning {p.name}: {pins if plan.pin else 'off'}")
        for note in p.layout.notes:
            lines.append(f"note {p.name}: {note}")
    lines.append(f"backend: {plan.backend}  precision: {plan.precision}  master: {plan.master_addr}:{plan.master_port}")
    env = launcher.global_env(plan)
    lines.append("env: " + " ".join(f"{k}={v}" for k, v in env.items() if not k.startswith(("MASTER_", "XC_"))))
    return lines


def _stage(fact: NodeFacts, plan: launcher.LaunchPlan, node_plan: launcher.NodePlan, digest: str, tarball: bytes,
           ship: dict[str, Path], script: str | None, is_master: bool, hostfile: str, resume: Path | None = None) -> str:
    with connect(fact.node) as conn:
        code_dir = shipping.ensure_code(conn, fact.home, digest, tarball)
        run_dir = f"{fact.home}/runs/{plan.run_id}"
        res = run(conn, f"mkdir -p {shlex.quote(run_dir)}/data {shlex.quote(run_dir)}/script")
        if not res.ok:
            raise ClusterError(f"{fact.node.name}: cannot create {run_dir}: {res.stderr.strip()}")
        env_sh = render("node_env.sh.j2", run_id=plan.run_id, node=fact.node.name, python=fact.node.python,
                        code_dir=code_dir, rank_cpus=launcher.rank_cpus(node_plan),
                        env=sorted(launcher.node_env(plan, node_plan).items()))
        rank_sh = render("rank.sh.j2", run_id=plan.run_id, pin="yes" if plan.pin else "no",
                         entry=launcher.shell_join(list(plan.entry)))
        conn.put(io.StringIO(env_sh), f"{run_dir}/node_env.sh")
        conn.put(io.StringIO(rank_sh), f"{run_dir}/rank.sh")
        run(conn, f"chmod 700 {shlex.quote(run_dir)}/rank.sh")
        for name, local in ship.items():
            conn.put(str(local), f"{run_dir}/data/{name}")
        if script:
            conn.put(script, f"{run_dir}/script/{Path(script).name}")
        if is_master:
            conn.put(io.StringIO(hostfile), f"{run_dir}/hostfile")
        if resume:  # every rank loads the weights from its own node
            target = f"{run_dir}/resume/{Path(resume).name}"
            files = [f for f in Path(resume).rglob("*") if f.is_file()]
            dirs = sorted({shlex.quote(f"{target}/{f.parent.relative_to(resume)}") for f in files})
            run(conn, "mkdir -p " + " ".join(dirs or [shlex.quote(target)]))
            for f in files:
                conn.put(str(f), f"{target}/{f.relative_to(resume)}")
        return code_dir


def train(cluster: Cluster, req: TrainRequest, out: TextIO = sys.stdout) -> RunResult:
    """Run a job across the first req.nodes nodes. Raises ClusterError / NodeFailure on failure."""
    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    plan, facts, args, ship = plan_run(cluster, req, say)
    for line in describe(plan, facts):
        say(line)
    nodes = [f.node for f in facts]
    # Cheap checks before anything is written (the mesh is verified below, after the keys).
    doctor.preflight(cluster, nodes, mesh=False).raise_if_failed("preflight")
    run_dir = Path(req.runs_dir) / plan.run_id
    run_dir.mkdir(parents=True)
    say(f"run {plan.run_id}: results in {run_dir}")

    record = _record(cluster, req, plan, facts, args)
    if req.resume:
        record["resumed_from"] = {"run_id": req.resume["run_id"], "step": req.resume["step"]}
    try:
        ks_dir, digest = _prepare(cluster, req, plan, facts, ship)
    except BaseException as exc:  # the run folder exists: it gets its record
        stopped = isinstance(exc, KeyboardInterrupt)
        _finish(run_dir, record, "interrupted" if stopped else "failed", 130 if stopped else 1, 0.0, None,
                reason=f"before launch: {'interrupted' if stopped else exc}")
        raise
    say(f"code {digest} on every node")
    master = facts[0]
    mpirun = str(Path(master.node.python).parent / "mpirun")
    argv = launcher.mpirun_argv(plan, ssh_config=f"{ks_dir}/config", mpirun=mpirun)
    command = (f"cd {shlex.quote(master.home)}/runs/{plan.run_id} && "
               f"PATH={shlex.quote(str(Path(mpirun).parent))}:$PATH exec {launcher.shell_join(argv)}")
    record.update(command=argv, code=digest)
    (run_dir / "command.sh").write_text(command + "\n")
    say(f"launching {plan.world_size} rank(s) with mpirun on {master.node.name}")
    started = time.monotonic()
    exit_code = 1
    remote_out = _remote_output_dir(master, plan, args)
    mirror = None
    if req.script is None:
        mirror = outputs.CheckpointMirror(master.node, run_dir, remote_out, req.fetch_model)
        mirror.start()
    with (run_dir / "log.txt").open("w") as log_file:
        router = OutputRouter(plan, out, log_file)
        try:
            with connect(master.node) as conn:
                res = conn.run(command, hide=False, warn=True, pty=False, in_stream=False,
                               out_stream=router, err_stream=router)
                exit_code = res.exited
        except Exception as exc:  # noqa: BLE001
            # node 0 gone mid-run, or the output reader broke: a failed run like any other (clean-up, summary), not a traceback
            router.write(f"\nlost the connection to {master.node.name}: {type(exc).__name__}: {exc}\n")
            exit_code = -1
        except KeyboardInterrupt:
            router.flush_rest()
            say("interrupted: stopping every rank")
            swept = cleanup(nodes, plan.run_id)
            say(f"run {plan.run_id} interrupted: {swept.claim()}")
            _finish(run_dir, record, "interrupted", 130, time.monotonic() - started, None, cleanup=swept.to_dict())
            raise
        finally:
            router.flush_rest()
            if mirror:
                mirror.stop()
            if req.script is None:
                _bring_home(master, run_dir, remote_out, req, say)
    wall = time.monotonic() - started
    extra: dict = {}
    notice = next((ln for ln in router.lines if spot.PREEMPTED_TAG in ln), None)
    if exit_code != 0 and notice:
        _preempted(nodes, plan, master, run_dir, remote_out, record, req, notice, exit_code, wall, say)
    if exit_code != 0:
        swept = cleanup(nodes, plan.run_id)
        node, reason = failed_rank(router.lines, plan)
        # oneCCL may abort a rank during interpreter shutdown: once every rank has finished its work
        # and rank 0's results are written, the run counts, and the record says what happened after.
        done = len(router.finished) == plan.world_size
        results = _fetch_results(master, plan, args) if done and req.script is None else None
        if not done or (req.script is None and results is None):
            lost = sorted(swept.unchecked)
            if lost and (node is None or node not in lost):
                node, reason = lost[0], f"{lost[0]} stopped answering ({reason})"
            _finish(run_dir, record, "failed", exit_code, wall, None, failed_node=node, reason=reason,
                    cleanup=swept.to_dict(), lost_nodes=lost)
            hint = ""
            if lost and req.script is None and outputs.home_checkpoints(run_dir):
                hint = f"; resume with 'fab train --resume {plan.run_id}'"
            raise NodeFailure(f"run {plan.run_id} failed after {wall:.0f}s: {reason}; {swept.claim()} "
                              f"(log: {run_dir / 'log.txt'}){hint}", [node] if node else [], run_id=plan.run_id,
                              lost=lost)
        say(f"note: {reason} after every rank had finished its work; the results are kept ({swept.claim()})")
        extra = {"crashed_after_finish": {"node": node, "reason": reason, "exit_code": exit_code},
                 "cleanup": swept.to_dict()}
    elif req.script is None:
        results = _fetch_results(master, plan, args)
    else:
        results = None
    _finish(run_dir, record, "ok", 0, wall, results, **extra)
    return RunResult(run_id=plan.run_id, run_dir=run_dir, exit_code=0, wall_s=wall, results=results)


def _record(cluster: Cluster, req: TrainRequest, plan: launcher.LaunchPlan, facts: list[NodeFacts],
            args: list[str]) -> dict:
    nodes = [f.node for f in facts]
    return {
        "run_id": plan.run_id, "cluster": cluster.spec, "nodes": [n.to_dict() for n in nodes],
        "job": req.job if not req.script else None, "script": req.script, "args": list(args),
        "world_size": plan.world_size, "ppn": plan.ppn, "backend": plan.backend, "precision": plan.precision,
        "env": launcher.global_env(plan),
        "node_env": {p.name: launcher.node_env(plan, p) for p in plan.nodes},
        "pinning": {p.name: dict(launcher.rank_cpus(p)) for p in plan.nodes},
        "topology": {f.node.name: f.topo.to_dict() for f in facts},
        # what --resume needs to run the same job again
        "request": {"job": req.job, "script": req.script, "args": list(req.args), "ppn": req.ppn,
                    "threads": req.threads, "backend": req.backend, "precision": req.precision,
                    "env": dict(req.env), "save_every": req.save_every, "pin": req.pin, "timeout_s": req.timeout_s,
                    "data": {str(Path(p).expanduser().resolve()): file_digest(p) for _, p in local_files(req.args)}},
    }


def _prepare(cluster: Cluster, req: TrainRequest, plan: launcher.LaunchPlan, facts: list[NodeFacts],
             ship: dict[str, Path]) -> tuple[str, str]:
    """Keys, the mesh check, and code, data and scripts on every node; returns (ssh dir on node 0, code hash)."""
    nodes = [f.node for f in facts]
    ks = keys.setup_keys(cluster, nodes)
    problems = keys.verify_mesh(cluster, nodes)
    if problems:
        raise ClusterError("node 0 cannot reach " + "; ".join(f"{k}: {v}" for k, v in problems.items())
                           + "; run 'fab keys' and check the security group allows traffic inside the cluster")
    digest = shipping.code_hash()
    tarball = shipping.code_tarball()
    hostfile = render("hostfile.j2", nodes=nodes)
    resume = Path(req.resume["checkpoint"]) if req.resume else None

    def stage(node: Node):
        i = nodes.index(node)
        _stage(facts[i], plan, plan.nodes[i], digest, tarball, ship, req.script, i == 0, hostfile, resume)

    fan_out(nodes, stage, "staging the run")
    return ks.ssh_dir, digest


def file_digest(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with Path(path).expanduser().open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _remote_output_dir(master: NodeFacts, plan: launcher.LaunchPlan, args: list[str]) -> str:
    out_dir = _output_dir(args)
    return out_dir if out_dir.startswith("/") else f"{master.home}/runs/{plan.run_id}/{out_dir}"


def _bring_home(master: NodeFacts, run_dir: Path, remote_out: str, req: TrainRequest, say) -> None:
    """The job's output_dir into runs/<id>/output/, whatever the run's ending; never raises."""
    try:
        copied = outputs.fetch_output(master.node, remote_out, run_dir / "output", req.fetch_model, say)
        if copied:
            say(f"outputs: {len(copied)} file(s) from {master.node.name} in {run_dir / 'output'}"
                + ("" if req.fetch_model else " (model weights left on the node: --no-fetch-model)"))
    except Exception as exc:  # node 0 gone: what came home while the run went on is what there is
        log.warning("could not bring the outputs home from %s: %s", master.node.name, exc, exc_info=log.isEnabledFor(logging.DEBUG))


def _preempted(nodes, plan, master, run_dir, remote_out, record, req, notice, exit_code, wall, say) -> None:
    m = re.search(r"rank=(\d+) step=(\d+)", notice)
    rank, step = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    node = plan.rank_host(rank) if rank < plan.world_size else "?"
    swept = cleanup(nodes, plan.run_id)
    try:
        got = outputs.fetch_checkpoint(master.node, run_dir, remote_out, req.fetch_model)
    except Exception as exc:
        log.warning("the notice's checkpoint did not come home: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
        got = None
    home = outputs.home_checkpoints(run_dir)
    ckpt = run_dir / "checkpoints" / f"step-{step}"
    if not home:
        _finish(run_dir, record, "failed", exit_code, wall, None, failed_node=node, cleanup=swept.to_dict(),
                reason=f"spot notice on {node} at step {step}, but no checkpoint reached {run_dir}/checkpoints")
        raise NodeFailure(f"run {plan.run_id} preempted on {node} at step {step} and no checkpoint came home; "
                          f"{swept.claim()}", [node], run_id=plan.run_id, lost=sorted(swept.unchecked))
    if got is None or got[0] != step:
        step, ckpt = home[-1]
    _finish(run_dir, record, "preempted", spot.PREEMPTED_EXIT, wall, None, preempted={
        "node": node, "rank": rank, "step": step, "checkpoint": str(ckpt)}, cleanup=swept.to_dict())
    rel = ckpt.relative_to(run_dir.parent.parent) if run_dir.parent.parent in ckpt.parents else ckpt
    raise Preempted(f"run {plan.run_id} preempted on {node} at step {step}: checkpoint saved ({rel}); "
                    f"resume with 'fab train --resume {plan.run_id}'", run_id=plan.run_id, node=node)


def _output_dir(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a == "--output_dir":
            return args[i + 1]
        if a.startswith("--output_dir="):
            return a.split("=", 1)[1]
    return "output"


def _fetch_results(master: NodeFacts, plan: launcher.LaunchPlan, args: list[str]) -> dict | None:
    out_dir = _remote_output_dir(master, plan, args)
    with connect(master.node) as conn:
        res = run(conn, f"cat {shlex.quote(out_dir)}/results.json")
    if not res.ok:
        log.warning("the job wrote no results.json in %s", out_dir)
        return None
    return json.loads(res.stdout)


def _finish(run_dir: Path, record: dict, status: str, exit_code: int, wall: float, results: dict | None,
            **extra) -> None:
    summary = dict(record, status=status, exit_code=exit_code, wall_s=round(wall, 3), **extra)
    if results:
        tr = results.get("train", {})
        summary["train_samples_per_second"] = tr.get("train_samples_per_second")
        summary["eval"] = results.get("eval")
        (run_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))


def result_line(result: RunResult) -> str:
    r = result.results or {}
    ev, tr = r.get("eval", {}), r.get("train", {})
    parts = [f"run {result.run_id} finished in {result.wall_s:.0f}s"]
    if "eval_accuracy" in ev:
        parts.append(f"eval accuracy {ev['eval_accuracy']:.3f}")
        if "eval_majority_rate" in ev:
            parts.append(f"(majority class {ev['eval_majority_rate']:.3f})")
    if "eval_exact_match" in ev:  # qa: SQuAD's figures, in percent
        parts.append(f"eval exact match {ev['eval_exact_match']:.1f}")
    if "eval_f1" in ev:
        parts.append(f"f1 {ev['eval_f1']:.3f}")
        if "eval_baseline_f1" in ev:
            parts.append(f"(first-words baseline {ev['eval_baseline_f1']:.3f})")
    if "eval_perplexity" in ev:  # clm
        parts.append(f"eval loss {ev['eval_loss']:.3f} perplexity {ev['eval_perplexity']:.2f} "
                     f"(step 0: {ev.get('eval_perplexity_step0', float('nan')):.2f})")
    if "train_samples_per_second" in tr:
        parts.append(f"train {tr['train_samples_per_second']:.1f} samples/s")
    parts.append(f"-> {result.run_dir}")
    return " ".join(parts)


# The demo's job flags: small enough for a 2-core machine, long enough to learn the task.
DEMO_ARGS = ["--num_train_epochs", "2", "--per_device_train_batch_size", "8", "--learning_rate", "1e-4",
             "--max_train_samples", "800", "--seed", "42"]


def demo(nodes: int = 2, port: int | None = None, out: TextIO = sys.stdout) -> RunResult:
    """Local cluster up, fine-tune on the bundled paraphrase set, cluster down (even on failure)."""
    from . import local
    from .cluster import open_cluster

    already = (local.state_dir() / "state.json").exists()
    local.up(nodes, **({"port": port} if port else {}))
    try:
        result = train(open_cluster("local"), TrainRequest(nodes=nodes, job="glue", args=list(DEMO_ARGS)), out)
        out.write(result_line(result) + "\n")
        return result
    finally:
        if not already:
            local.down()
            out.write("local cluster stopped\n")
