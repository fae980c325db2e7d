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
from launch.staging import jobdata, jobflags, secrets, snapshot, workdir
from launch.staging.datafiles import FILE_FLAGS, file_digest, local_files, rewrite_files
from training.runtime import store as shared_store
from training.runtime.paths import Checkpoints
from training.runtime.spec import RunSpec

log = logging.getLogger(__name__)


RUNS = Path(os.environ.get("XC_RUNS_DIR") or PROJECT_ROOT / "runs")


# bench/scaling_twin.py: on a link as tight as a c6i cluster's bf16 compression beat fp32 in 7 of 10 pairs of runs,
# tied in one and lost two (the twin's drift is as large); it halves the bytes, which a real link pays for (the
# bench's N-node model). On a loopback local cluster, with no wire, fp32 was faster (README, Benchmarks).
DEFAULT_COMM_HOOK = RunSpec().speed.comm_hook


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
    snapshot: str | None = None  # the code snapshot the resumed run ran (launch.staging.snapshot)
    current: bool = False  # --code current: the folder as it is now, not that snapshot


@dataclass(frozen=True)
class TrainRequest:
    """One launch of a run: its RunSpec (what the record keeps) and what is this launch's own (where the runs folder
    is, which run it resumes, whether it detaches). Resolved once from the flags (launch.supervision.train_flags) or a
    record; never changed after: a step that needs another request makes one (`but`)."""

    spec: RunSpec = field(default_factory=RunSpec)
    valueless: set[str] = field(default_factory=set)  # --env KEY: the operator's own value, a secret
    master_port: int | None = None
    runs_dir: Path = RUNS
    restart_of: str | None = None  # the run this one resumes by itself (--max-restarts): it names this one
    fetch_model: bool = True
    resume: Resume | None = None  # set by launch.life.resume
    run_id: str | None = None  # chosen by the caller (doctor) so it can end the run by id; default: a new one
    detach: bool = False  # return once the ranks run; launch.life.detach concludes the run later
    # a supervisor's runs: mpirun under node 0's wrapper, followed to its end; if this process dies the ranks go on
    wrapped: bool = False
    # what validate() found (the scanned --workdir), so the plan does not check again; set by validate only
    checked: tuple | None = field(default=None, repr=False, compare=False)
    concurrent: bool = False  # run even while another run holds the cluster's lock

    @classmethod
    def of(cls, spec: RunSpec | None = None, **fields) -> TrainRequest:
        """A request from fields by their own names, the spec's (nodes=2, script=...) and this launch's alike."""
        return cls(spec=spec or RunSpec()).but(**fields)

    def but(self, **changes) -> TrainRequest:
        """A copy with fields changed by their own names, the spec's and this launch's alike."""
        mine = {k: v for k, v in changes.items() if k not in _SPEC_FIELDS}
        theirs = {k: v for k, v in changes.items() if k in _SPEC_FIELDS}
        return dataclasses.replace(self, spec=self.spec.but(**theirs) if theirs else self.spec, **mine)

    @property
    def store(self) -> str | None:
        """The cluster's store the ranks get (store_run.apply puts it in their environment)."""
        return self.spec.what.env.get(shared_store.STORE_ENV) or None

    def to_record(self) -> dict:
        """The spec as a record keeps it to run this again (--resume, --max-restarts, a head's takeover): secrets as
        ***, and the key of the run's code snapshot in the store; without one (no store), the digests of the data
        files and the lone script, which a resume must then find unchanged here."""
        what = self.spec.what
        own = what.snapshot is None  # else the snapshot's manifest has the digests, and these files may not be here
        kept = self.spec.but(
            args=secrets.mask_args(what.args), env=secrets.masked(what.env, self.valueless),
            script_digest=file_digest(what.script) if own and what.script and not what.workdir else None,
            data={str(Path(p).expanduser().resolve()): file_digest(p) for _, p in local_files(what.args)} if own else {})
        return kept.to_json()

    @classmethod
    def from_record(cls, kept: dict, env: dict[str, str], valueless: set[str], **fields) -> TrainRequest:
        """The request a record kept (to_record's dict), with the environment to run it with and the fields that
        differ this time (nodes, runs_dir, fetch_model, resume)."""
        return cls.of(RunSpec.from_json(kept), env=env, valueless=valueless, **fields)


_SPEC_FIELDS = frozenset(RunSpec.fields())


def validate(req: TrainRequest) -> TrainRequest:
    """Every flag and data file, before the cluster is asked anything; returns the request with what it found
    (the scanned --workdir) in `checked`."""
    what = req.spec.what
    hidden = sorted(k for k, v in what.env.items() if v == secrets.MASK)
    if hidden and req.resume:
        names = ", ".join(hidden)
        raise ClusterError(f"--resume {req.resume.run_id}: its record keeps {names} as {secrets.MASK} and your "
                           f"environment has no value for it", fix=f"export {hidden[0]} or pass --env {hidden[0]}=VALUE")
    flags = secrets.masked_arg_flags(what.args)
    if flags and req.resume:
        raise ClusterError(f"--resume {req.resume.run_id}: its record keeps the value of {', '.join(flags)} as "
                           f"{secrets.MASK} and your environment has no value for it",
                           fix=f"export {secrets.flag_env_name(flags[0])}=VALUE (the flag's name in capitals)")
    bundled = not what.own
    if bundled and what.job not in launcher.JOBS:
        raise ClusterError(f"--job {what.job!r} is not a bundled job", fix=f"use one of: {', '.join(launcher.JOBS)} "
                           "(or --script PATH for your own)")
    held = None  # the run's snapshot in the store: its files are checked there, not here (they may be gone here)
    if what.snapshot:
        held = snapshot.load(req)
        snapshot.check_holds(held, req, what.snapshot)
    scanned = snapshot.workdir_of(held, what.workdir, what.snapshot) if held and what.workdir else None
    wd = workdir.check(what.workdir, what.script, what.module, what.launcher, bundled, scanned=scanned)
    if what.script is not None and wd is None and held is None and not Path(what.script).is_file():
        raise ClusterError(f"--script {what.script} does not exist", fix="pass the path of your training script")
    broken = req.spec.problem()
    if broken:
        raise ClusterError(*broken)
    if req.master_port is not None and not 1024 <= req.master_port <= 65535:
        raise ClusterError(f"--master-port {req.master_port} is not a usable TCP port", fix="use 1024..65535, or leave it "
                           "out to get a free one")
    files = local_files(what.args) if held is None else []  # a snapshot's data files were checked when it was made
    for flag, path in files:
        if not Path(path).expanduser().is_file():
            raise ClusterError(f"{flag} {path} does not exist", fix="pass an existing data file (CSV, JSON or text)")
    if bundled:
        jobdata.check(what.job, what.args, files)
    writable_dir(req.runs_dir, "the runs folder", "set XC_RUNS_DIR to a writable folder")
    return req.but(checked=(wd,))  # the one validation: plan_run reads it, not scanning again


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
    if req.spec.what.module and req.spec.what.script is None:  # own code from here on: bundled-job steps key on script
        req = req.but(script=workdir.module_file(wd, req.spec.what.module))
    what, speed = req.spec.what, req.spec.speed
    nodes = cluster.first(req.spec.where.nodes)
    say(f"cluster {cluster.spec}: {len(nodes)} of {len(cluster.nodes)} node(s): {', '.join(n.name for n in nodes)}")
    facts = fan_out(nodes, functools.partial(probe, time_bf16=speed.precision == "auto"), "probing nodes")
    if what.script is None:
        jobdata.check_on_nodes(nodes, what.args)
    backend = resolve_backend(speed.backend, facts)
    precision = resolve_precision(speed.precision, facts)
    ppn, threads = req.spec.count("--ppn"), req.spec.count("--threads")
    if ppn is None:  # one rank per socket, the same on every node (mpirun -ppn is global)
        ppn = min(len([s for s in f.topo.cores_by_socket if s]) for f in facts)
    fits(ppn, threads, facts)
    layouts = topology.derive_layouts([f.topo for f in facts], ppn, threads, backend)
    node_plans = [launcher.NodePlan(name=f.node.name, layout=lay, malloc=f.topo.malloc)
                  for f, lay in zip(facts, layouts)]
    args, ship = rewrite_files(what.args, "../data" if wd is not None else "data")  # the rank's cwd: work/ or not
    world = ppn * len(node_plans)
    if req.resume:
        req, args, note = same_global_batch(req, args, req.resume.world_size, world)
        if note:
            say(note)
    elif (least := req.spec.recovery.min_nodes) is not None and least < len(nodes):
        units = micro_batches(req, args, world)
        if not smaller_sizes(units, ppn, least, len(nodes) - 1):
            raise ClusterError(f"--min-nodes {least}: no node count from {least} to {len(nodes) - 1} "
                               f"({ppn} rank(s) each) divides the run's {units} per-device batch(es) per step, so it "
                               "could never go on smaller", fix="pass a --min-nodes whose rank count divides it, or "
                               "--gradient_accumulation_steps that makes it divisible")
    what = req.spec.what  # same_global_batch may have changed its env
    if what.script:
        entry = (("-m", what.module) if what.module else (workdir.relative_script(wd, what.script),) if wd
                 else (f"script/{Path(what.script).name}",))
        label = "script"
    else:
        entry = launcher.JOBS[what.job]
        label = what.job
        if not jobflags.has(args, "--output_dir"):
            args += ["--output_dir", "output"]
    env = run_env(req, [n.private_host for n in nodes])
    plan = launcher.LaunchPlan(
        run_id=req.run_id or new_run_id(label), nodes=tuple(node_plans), master_addr=nodes[0].private_host,
        master_port=master_port(nodes[0], req.master_port), backend=backend, precision=precision, entry=tuple(entry),
        args=tuple(args), env_overrides=secrets.split(env, req.valueless)[0],
        secret_env={**secrets.split(what.env, req.valueless)[1], **secrets.arg_env(args)}, pin=req.spec.where.pin,
        timeout_s=req.spec.where.timeout_s, launcher=what.launcher, workdir=wd)
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
    spec = req.spec
    env = {"XC_SAVE_EVERY": spec.saving.save_every, "XC_COMM_HOOK": resolve_comm_hook(spec.speed.comm_hook, hosts)}
    if req.resume:
        env["XC_RESUME_FROM"] = f"resume/{Checkpoints.name(req.resume.step)}"
        if req.resume.url:  # [store] each node takes the checkpoint from the store (training.runtime.store)
            env["XC_RESUME_URL"] = req.resume.url
    return {**env, **spec.what.env}


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
