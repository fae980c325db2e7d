"""What the user asked for (TrainRequest), checked, and turned into a launch plan for the nodes probed."""
from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.remote import fan_out
from cluster.resolve import Cluster
from core.cli import writable_dir
from core.constants import PROJECT_ROOT
from core.errors import ClusterError
from launch.plan import launcher, topology
from launch.plan.batch import micro_batches, same_global_batch, smaller_sizes
from launch.plan.probe import NodeFacts, master_port, probe, resolve_backend, resolve_precision
from launch.ship import jobdata, jobflags, secrets, snapshot, workdir
from launch.ship.datafiles import FILE_FLAGS, file_digest, local_files, rewrite_files
from training.runtime import spot
from training.runtime import store as shared_store
from training.runtime.paths import Checkpoints
from training.runtime.wire import COMM_HOOKS

log = logging.getLogger(__name__)


RUNS = Path(os.environ.get("XC_RUNS_DIR") or PROJECT_ROOT / "runs")


BACKENDS = ("auto", "ccl", "gloo")


PRECISIONS = ("auto", "bf16", "fp32")


# bench/scaling_twin.py: on a link as tight as a c6i cluster's bf16 compression beat fp32 in 7 of 10 pairs of runs,
# tied in one and lost two (the twin's drift is as large); it halves the bytes, which a real link pays for (the
# bench's N-node model). On a loopback local cluster, with no wire, fp32 was faster (README, Benchmarks).
DEFAULT_COMM_HOOK = "auto"
LAUNCH_COMM_HOOKS = ("auto", *COMM_HOOKS)


def resolve_comm_hook(name: str, hosts: list[str]) -> str:
    """auto: bf16 gradients when the ranks talk over a network, fp32 when they share one host (one node, or a
    local cluster on this machine's loopback)."""
    if name != "auto":
        return name
    return "none" if len(set(hosts)) < 2 or all(_loopback(h) for h in hosts) else "bf16"


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class Resume:
    """Where a resumed run continues from: the run, its checkpoint's step, and the checkpoint (a folder at home
    for runs recorded before the store, else its URL in the store), and the world size it was saved on."""

    run_id: str
    step: int
    world_size: int
    checkpoint: str | None = None
    url: str | None = None
    snapshot: str | None = None  # the code snapshot the resumed run ran (launch.ship.snapshot)
    current: bool = False  # --code current: the folder as it is now, not that snapshot


@dataclass(frozen=True)
class Recovery:
    """How a chain recovers by itself, part of its record: every restart (by its supervisor, or by a head that took
    the chain over) reads it there. Up to max_restarts restarts, each waiting restart_wait seconds for the cluster;
    with min_nodes, a wait that ends short goes on with that many nodes or more at the same global batch, and back
    to full size at a checkpoint once nodes return (grow_back)."""

    max_restarts: int = 0
    restart_wait: float = 600
    min_nodes: int | None = None
    grow_back: bool = True

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ClusterError(f"--max-restarts {self.max_restarts} must be 0 or more", "pass 0 or more")
        if self.restart_wait < 0:
            raise ClusterError(f"--restart-wait {self.restart_wait} must be 0 or more seconds", "pass 0 or more")
        if self.min_nodes is not None and self.min_nodes < 1:
            raise ClusterError(f"--min-nodes {self.min_nodes} must be 1 or more", "pass 1 or more")

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, kept: dict | None) -> Recovery:
        """A record's policy; records written before it was kept there restart as plain --max-restarts 0 runs."""
        kept = kept or {}
        least = kept.get("min_nodes")
        return cls(max_restarts=int(kept.get("max_restarts", 0)), restart_wait=float(kept.get("restart_wait", 600)),
                   min_nodes=None if least is None else int(least), grow_back=bool(kept.get("grow_back", True)))


@dataclass(frozen=True)
class TrainRequest:
    """What one run does, resolved once from the flags (launch.chain.train_flags) or a record; never changed
    after: a step that needs another request makes one (dataclasses.replace)."""

    nodes: int | None = None
    job: str | None = "glue"
    script: str | None = None
    workdir: str | None = None  # --workdir DIR: your project, shipped; --script is then relative to it
    module: str | None = None  # --module NAME: `python -m NAME` from the workdir
    launcher: str = "python"  # or "accelerate": `accelerate launch` per rank
    requirements: str | None = None  # --requirements FILE (else DIR/requirements.txt): packages beyond the profile
    pylayer: str | None = None  # the key of their wheels in the store (launch.ship.requirements), installed per node
    # the key of the run's own files (--workdir, --script, data files) in the store (launch.ship.snapshot): every node
    # and every restart takes them from there, never from the folder here
    snapshot: str | None = None
    args: list[str] = field(default_factory=list)
    ppn: str = "auto"
    threads: str = "auto"
    backend: str = "auto"
    precision: str = "auto"
    comm_hook: str = DEFAULT_COMM_HOOK  # gradients on the wire: bf16 / fp16 halve the all-reduce bytes; none: fp32
    env: dict[str, str] = field(default_factory=dict)
    valueless: set[str] = field(default_factory=set)  # --env KEY: the operator's own value, a secret
    master_port: int | None = None
    pin: bool = True
    timeout_s: int = 300
    runs_dir: Path = RUNS
    restart_of: str | None = None  # the run this one resumes by itself (--max-restarts): it names this one
    save_every: str = spot.DEFAULT_SAVE_EVERY
    fetch_model: bool = True
    resume: Resume | None = None  # set by launch.life.resume
    run_id: str | None = None
    detach: bool = False  # return once the ranks run; launch.life.detach concludes the run later
    # a supervisor's runs: mpirun under node 0's wrapper, followed to its end; if this process dies the ranks go on
    wrapped: bool = False
    # what validate() found (the scanned --workdir), so the plan does not check again; set by validate only
    checked: tuple | None = field(default=None, repr=False, compare=False)
    recovery: Recovery = Recovery()  # --max-restarts, --restart-wait, --min-nodes, --no-grow-back
    concurrent: bool = False  # run even while another run holds the cluster's lock  # chosen by the caller (doctor) so it can end the run by id; default: a new one

    @property
    def store(self) -> str | None:
        """The cluster's store the ranks get (store_run.apply puts it in their environment)."""
        return self.env.get(shared_store.STORE_ENV) or None

    def to_record(self) -> dict:
        """What a record keeps to run this again (--resume, --max-restarts): secrets as ***, and the key of the run's
        code snapshot in the store; without one (no store), the digests of the data files and the lone script, which
        a resume must then find unchanged here."""
        own = self.snapshot is None  # else the snapshot's manifest has the digests, and these files may not be here
        return {"job": self.job, "script": self.script, "workdir": self.workdir, "module": self.module,
                "launcher": self.launcher, "requirements": self.requirements, "pylayer": self.pylayer,
                "snapshot": self.snapshot,
                "args": secrets.mask_args(self.args), "ppn": self.ppn,
                "threads": self.threads,
                "backend": self.backend, "precision": self.precision, "comm_hook": self.comm_hook,
                "env": secrets.masked(self.env, self.valueless), "save_every": self.save_every, "pin": self.pin,
                "timeout_s": self.timeout_s, "recovery": self.recovery.to_record(),
                "script_digest": file_digest(self.script) if own and self.script and not self.workdir else None,
                "data": {str(Path(p).expanduser().resolve()): file_digest(p) for _, p in local_files(self.args)}
                if own else {}}

    @classmethod
    def from_record(cls, request: dict, env: dict[str, str], valueless: set[str], **fields) -> TrainRequest:
        """The request a record kept (to_record's dict), with the environment to run it with and the fields that
        differ this time (nodes, runs_dir, fetch_model, resume)."""
        return cls(job=request["job"], script=request.get("script"), workdir=request.get("workdir"),
                   module=request.get("module"), launcher=request.get("launcher") or "python",
                   requirements=request.get("requirements"), pylayer=request.get("pylayer"),
                   snapshot=request.get("snapshot"), args=list(request["args"]), ppn=request["ppn"],
                   threads=request["threads"],
                   backend=request["backend"], precision=request["precision"], env=env, valueless=valueless,
                   comm_hook=request.get("comm_hook", "none"),  # records before --comm-hook sent fp32
                   save_every=request["save_every"], pin=request["pin"], timeout_s=request["timeout_s"],
                   recovery=Recovery.from_record(request.get("recovery")), **fields)


def _parse_auto_int(value: str, flag: str) -> int | None:
    if value in (None, "", "auto"):
        return None
    try:
        n = int(value)
    except ValueError:
        raise ClusterError(f"{flag} {value!r} is not a number", fix="use a positive integer or 'auto'") from None
    if n < 1:
        raise ClusterError(f"{flag} {n} must be at least 1", fix="pass a positive integer or 'auto'")
    return n


def validate(req: TrainRequest) -> TrainRequest:
    """Every flag and data file, before the cluster is asked anything; returns the request with what it found
    (the scanned --workdir) in `checked`."""
    hidden = sorted(k for k, v in req.env.items() if v == secrets.MASK)
    if hidden and req.resume:
        names = ", ".join(hidden)
        raise ClusterError(f"--resume {req.resume.run_id}: its record keeps {names} as {secrets.MASK} and your "
                           f"environment has no value for it", fix=f"export {hidden[0]} or pass --env {hidden[0]}=VALUE")
    flags = secrets.masked_arg_flags(req.args)
    if flags and req.resume:
        raise ClusterError(f"--resume {req.resume.run_id}: its record keeps the value of {', '.join(flags)} as "
                           f"{secrets.MASK} and your environment has no value for it",
                           fix=f"export {secrets.flag_env_name(flags[0])}=VALUE (the flag's name in capitals)")
    bundled = req.script is None and req.module is None
    if bundled and req.job not in launcher.JOBS:
        raise ClusterError(f"--job {req.job!r} is not a bundled job", fix=f"use one of: {', '.join(launcher.JOBS)} "
                           "(or --script PATH for your own)")
    held = None  # the run's snapshot in the store: its files are checked there, not here (they may be gone here)
    if req.snapshot:
        held = snapshot.load(req)
        snapshot.check_holds(held, req, req.snapshot)
    wd = workdir.check(req.workdir, req.script, req.module, req.launcher, bundled,
                       scanned=snapshot.workdir_of(held, req.workdir, req.snapshot) if held and req.workdir else None)
    if req.script is not None and wd is None and held is None and not Path(req.script).is_file():
        raise ClusterError(f"--script {req.script} does not exist", fix="pass the path of your training script")
    if req.backend not in BACKENDS:
        raise ClusterError(f"--backend {req.backend!r} is not one of {', '.join(BACKENDS)}", fix="pass one of them")
    if req.precision not in PRECISIONS:
        raise ClusterError(f"--precision {req.precision!r} is not one of {', '.join(PRECISIONS)}", fix="pass one of "
                           "them")
    if req.comm_hook not in LAUNCH_COMM_HOOKS:
        raise ClusterError(f"--comm-hook {req.comm_hook!r} is not one of {', '.join(LAUNCH_COMM_HOOKS)}", fix="pass one of "
                           "them (none sends fp32 gradients)")
    try:
        spot.parse_save_every(req.save_every)
    except ValueError as exc:
        raise ClusterError(f"--save-every: {exc}", fix="e.g. --save-every 10m or --save-every 200") from None
    try:
        spot.parse_poll(req.env.get(spot.POLL_ENV))
    except ValueError as exc:
        raise ClusterError(f"--env {exc}", fix=f"pass seconds between 0.1 and 60, e.g. --env {spot.POLL_ENV}=1") from None
    try:
        spot.parse_pace(req.env.get(spot.PACE_ENV))
    except ValueError as exc:
        raise ClusterError(f"--env {exc}", fix=f"pass seconds between 0 and 60, e.g. --env {spot.PACE_ENV}=0.5") from None
    if req.master_port is not None and not 1024 <= req.master_port <= 65535:
        raise ClusterError(f"--master-port {req.master_port} is not a usable TCP port", fix="use 1024..65535, or leave it "
                           "out to get a free one")
    if req.timeout_s < 1:
        raise ClusterError(f"--timeout {req.timeout_s} must be at least 1 second", fix="pass --timeout 1 or more "
                           "(default 300)")
    _parse_auto_int(req.ppn, "--ppn")
    _parse_auto_int(req.threads, "--threads")
    files = local_files(req.args) if held is None else []  # a snapshot's data files were checked when it was made
    for flag, path in files:
        if not Path(path).expanduser().is_file():
            raise ClusterError(f"{flag} {path} does not exist", fix="pass an existing data file (CSV, JSON or text)")
    if bundled:
        jobdata.check(req.job, req.args, files)
    writable_dir(req.runs_dir, "the runs folder", "set XC_RUNS_DIR to a writable folder")
    return dataclasses.replace(req, checked=(wd,))  # the one validation: plan_run reads it, not scanning again


def absolute_files(args: list[str]) -> list[str]:
    """The job arguments with every data-file path made absolute against fab's current directory: a supervisor (on
    the head, or a restart later) reads them from another directory."""
    out = list(args)
    for f in jobflags.parse(args):
        if f.name in FILE_FLAGS and f.value:
            path = str(Path(f.value).expanduser().resolve())
            out[f.value_at] = f"{f.name}={path}" if f.joined else path
    return out


def new_run_id(label: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{label}-{random.randbytes(2).hex()}"


def plan_run(cluster: Cluster, req: TrainRequest, say
             ) -> tuple[launcher.LaunchPlan, list[NodeFacts], list[str], dict, TrainRequest]:
    """The plan for the nodes probed; also the request as the run goes on with it (a copy: never changed in place)."""
    wd = (req.checked or validate(req).checked)[0]
    if req.module and req.script is None:  # own code from here on: the run keys its bundled-job steps on script
        req = dataclasses.replace(req, script=workdir.module_file(wd, req.module))
    nodes = cluster.first(req.nodes)
    say(f"cluster {cluster.spec}: {len(nodes)} of {len(cluster.nodes)} node(s): {', '.join(n.name for n in nodes)}")
    facts = fan_out(nodes, functools.partial(probe, time_bf16=req.precision == "auto"), "probing nodes")
    if req.script is None:
        jobdata.check_on_nodes(nodes, req.args)
    backend = resolve_backend(req.backend, facts)
    precision = resolve_precision(req.precision, facts)
    ppn = _parse_auto_int(req.ppn, "--ppn")
    threads = _parse_auto_int(req.threads, "--threads")
    if ppn is None:  # one rank per socket, the same on every node (mpirun -ppn is global)
        ppn = min(len([s for s in f.topo.cores_by_socket if s]) for f in facts)
    fits(ppn, threads, facts)
    layouts = topology.derive_layouts([f.topo for f in facts], ppn, threads, backend)
    node_plans = [launcher.NodePlan(name=f.node.name, layout=lay, malloc=f.topo.malloc)
                  for f, lay in zip(facts, layouts)]
    args, ship = rewrite_files(req.args, "../data" if wd is not None else "data")  # the rank's cwd: work/ or not
    world = ppn * len(node_plans)
    if req.resume:
        req, args, note = same_global_batch(req, args, req.resume.world_size, world)
        if note:
            say(note)
    elif req.recovery.min_nodes is not None and req.recovery.min_nodes < len(nodes):
        units = micro_batches(req, args, world)
        least = req.recovery.min_nodes
        if not smaller_sizes(units, ppn, least, len(nodes) - 1):
            raise ClusterError(f"--min-nodes {least}: no node count from {least} to {len(nodes) - 1} "
                               f"({ppn} rank(s) each) divides the run's {units} per-device batch(es) per step, so it "
                               "could never go on smaller", fix="pass a --min-nodes whose rank count divides it, or "
                               "--gradient_accumulation_steps that makes it divisible")
    if req.script:
        entry = (("-m", req.module) if req.module else (workdir.relative_script(wd, req.script),) if wd
                 else (f"script/{Path(req.script).name}",))
        label = "script"
    else:
        entry = launcher.JOBS[req.job]
        label = req.job
        if not jobflags.has(args, "--output_dir"):
            args += ["--output_dir", "output"]
    env = run_env(req, [n.private_host for n in nodes])
    plan = launcher.LaunchPlan(
        run_id=req.run_id or new_run_id(label), nodes=tuple(node_plans), master_addr=nodes[0].private_host,
        master_port=master_port(nodes[0], req.master_port), backend=backend, precision=precision, entry=tuple(entry),
        args=tuple(args), env_overrides=secrets.split(env, req.valueless)[0],
        secret_env={**secrets.split(req.env, req.valueless)[1], **secrets.arg_env(args)}, pin=req.pin,
        timeout_s=req.timeout_s,
        launcher=req.launcher, workdir=wd)
    return plan, facts, args, ship, req


def fits(ppn: int, threads: int | None, facts: list[NodeFacts]) -> None:
    """Ranks and threads within the smallest node: more ranks than cores, or threads beyond its CPUs,
    only thrash (a run of 99 ranks per 1-core node makes no progress at all)."""
    small = min(facts, key=lambda f: f.topo.physical_cores)
    cores, cpus = small.topo.physical_cores, small.topo.physical_cores * small.topo.threads_per_core
    if ppn > cores:
        raise ClusterError(f"--ppn {ppn} is more ranks than the {cores} physical core(s) of {small.node.name}", fix=
                           f"use --ppn {cores} or fewer")
    if threads is not None and threads * ppn > cpus:
        raise ClusterError(f"--threads {threads} x --ppn {ppn} is more than the {cpus} CPU(s) of {small.node.name}", fix=
                           f"use --threads {max(1, cpus // ppn)} or fewer")


def run_env(req: TrainRequest, hosts: list[str]) -> dict[str, str]:
    """The ranks' spot contract (training.runtime.spot) and wire precision, under the user's --env."""
    env = {"XC_SAVE_EVERY": req.save_every, "XC_COMM_HOOK": resolve_comm_hook(req.comm_hook, hosts)}
    if req.resume:
        env["XC_RESUME_FROM"] = f"resume/{Checkpoints.name(req.resume.step)}"
        if req.resume.url:  # [store] each node takes the checkpoint from the store (training.runtime.store)
            env["XC_RESUME_URL"] = req.resume.url
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
    hook = plan.env_overrides.get("XC_COMM_HOOK", "none")
    if plan.world_size > 1:
        lines.append(f"gradients on the wire: {'fp32' if hook == 'none' else hook} (--comm-hook"
                     f"{' none for fp32' if hook != 'none' else ' bf16 halves the bytes; auto sends fp32 within one host'})")
    if plan.workdir is not None:
        lines.append(f"workdir {plan.workdir.summary()}; every node runs in its own copy of it (runs/<id>/work)")
    if plan.launcher != "python":
        lines.append(f"launcher: {plan.launcher} launch, one process per rank: {' '.join(plan.entry)}")
    env = launcher.global_env(plan)
    lines.append("env: " + " ".join(f"{k}={v}" for k, v in env.items() if not k.startswith(("MASTER_", "XC_"))))
    return lines
