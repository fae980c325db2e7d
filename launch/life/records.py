"""A run's record in runs/<run-id>/summary.json: one typed RunRecord with a Status and named transitions,
written from the dataclass and read back into it (older records too); results.json and the one-line result.

Model: skypilot's sky/jobs/state.py (a status enum with terminal and failure sets, every change of state
through one function)."""
from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster import store as store_lib
from core import procs
from core.errors import ClusterError, NoRecord
from launch.plan import batch, launcher
from launch.staging import secrets
from training.runtime import events
from training.runtime import store as shared_store
from training.runtime.notice import Notice

log = logging.getLogger(__name__)


class Status(str, enum.Enum):
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"
    PREEMPTED = "preempted"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"
    RESTARTING = "restarting"  # ended by a preemption or a lost node; its supervisor waits to resume it
    ABANDONED = "abandoned"  # its supervisor died without ending it and nothing of it is left on the nodes

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def failure(self) -> bool:
        return self in FAILURES


class Cause(str, enum.Enum):
    """Why a run ended other than ok, as a value (the record's `cause`), never free text."""
    SPOT = Notice.SPOT
    GROUP = Notice.GROUP
    NODE_LOST = "node lost"
    CRASHED = "crashed"
    INTERRUPTED = "interrupted"
    RESIZED = "resized"  # ended at a checkpoint by its supervisor to go on at another node count (--min-nodes)
    STORE_UNREACHABLE = "store unreachable"  # a preemption whose checkpoint the store could not confirm or deny

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset({Status.OK, Status.FAILED, Status.PREEMPTED, Status.INTERRUPTED, Status.STOPPED,
                      Status.ABANDONED})
FAILURES = frozenset({Status.FAILED, Status.PREEMPTED, Status.INTERRUPTED, Status.STOPPED, Status.ABANDONED})
# Named transitions: a new record (None) may be born running or already ended (a failure before launch).
TRANSITIONS: dict[Status | None, frozenset[Status]] = {
    None: frozenset(Status) - {Status.RESTARTING, Status.ABANDONED},
    Status.RUNNING: frozenset(Status) - {Status.RUNNING},
    Status.PREEMPTED: frozenset({Status.RESTARTING, Status.STOPPED}),
    Status.FAILED: frozenset({Status.RESTARTING, Status.STOPPED}),  # a lost node: restart, or stopped by hand
    Status.RESTARTING: frozenset({Status.PREEMPTED, Status.FAILED, Status.STOPPED, Status.ABANDONED}),
    Status.OK: frozenset(), Status.INTERRUPTED: frozenset({Status.STOPPED}), Status.STOPPED: frozenset(),
    Status.ABANDONED: frozenset({Status.STOPPED}),
}


class BadTransition(RuntimeError):
    """A programming error: the lifecycle asked for a change of state its table does not allow."""


# Fields every summary.json carries (None included); the optional ones appear only when set.
ALWAYS = ("run_id", "status", "exit_code", "wall_s", "cluster", "nodes", "job", "script", "args", "module",
          "launcher", "workdir", "world_size", "ppn", "backend", "precision", "env", "node_env", "pinning",
          "topology", "spec")


@dataclass
class RunRecord:
    run_id: str
    status: Status | None = None  # None until first written
    exit_code: int = -1
    wall_s: float = 0.0
    cluster: str | None = None
    nodes: list[dict] = field(default_factory=list)
    job: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)
    module: str | None = None
    launcher: str | None = None
    workdir: dict | None = None
    world_size: int | None = None
    ppn: int | None = None
    backend: str | None = None
    precision: str | None = None
    env: dict = field(default_factory=dict)
    node_env: dict = field(default_factory=dict)
    pinning: dict = field(default_factory=dict)
    topology: dict = field(default_factory=dict)
    spec: dict | None = None  # the run's RunSpec (to_json): what --resume, a restart or a head runs again
    # optional: written only when set
    command: list[str] | None = None
    code: str | None = None
    started_at: float | None = None
    detached: bool | None = None
    remote_run: str | None = None
    remote_output: str | None = None
    resumed_from: dict | None = None
    reason: str | None = None
    failed_node: str | None = None
    lost_nodes: list[str] | None = None
    cleanup: dict | None = None
    preempted: dict | None = None
    cause: str | None = None  # a Cause's value: spot interruption, group termination, node lost, crashed, interrupted
    crashed_after_finish: dict | None = None
    train_samples_per_second: float | None = None
    eval: dict | None = None
    speed: dict | None = None  # results.json's: the path each native kernel took
    stopped_at: str | None = None
    supervisor: dict | None = None  # {"pid", "host", "start"}: the process that ends this run
    restart: dict | None = None  # {"attempt", "of", "ended": status, "why"} while restarting
    restarted_as: str | None = None
    abandoned: dict | None = None  # what the look that found it abandoned saw
    segment: dict | None = None  # {"nodes", "world_size", "accumulation", "from_step", "to_step"}: its part of a chain
    gave_up: str | None = None  # why its supervisor did not resume it
    recovery: dict | None = None  # a resumed run: seconds from the notice to its first optimizer step, by phase
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they were

    # -- the one way a status changes (the named transitions below call it; no other module does) -------------
    def can(self, to: Status) -> bool:
        return to in TRANSITIONS[self.status]

    def _move(self, to: Status, **fields) -> RunRecord:
        if to not in TRANSITIONS[self.status]:
            raise BadTransition(f"run {self.run_id}: {self.status} -> {to} is not a transition")
        self.status = Status(to)
        for k, v in fields.items():
            if k not in _FIELDS:
                raise BadTransition(f"RunRecord has no field {k!r}")
            setattr(self, k, v)
        return self

    @property
    def store(self) -> str | None:
        """The store the run's ranks used (None: a run recorded before stores)."""
        return (self.env or {}).get(shared_store.STORE_ENV)

    @property
    def node_names(self) -> list[str]:
        return [n.get("name", "?") for n in self.nodes]

    # -- summary.json ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name in ALWAYS or value is not None:
                out[f.name] = value.value if isinstance(value, Status) else value
        return out

    @classmethod
    def from_json(cls, data: dict) -> RunRecord:
        if "request" in data and "spec" not in data:  # the RunSpec's key in records written before it had one
            data = {**{k: v for k, v in data.items() if k != "request"}, "spec": data["request"]}
        known = {k: v for k, v in data.items() if k in _FIELDS and k != "extra"}
        extra = {k: v for k, v in data.items() if k not in _FIELDS}
        status = known.pop("status", None)
        try:
            known["status"] = Status(status) if status is not None else None
        except ValueError:  # a status this version does not know: shown as failed, kept as it was
            known["status"], extra["status_unknown"] = Status.FAILED, status
        return cls(run_id=str(known.pop("run_id", data.get("run_id", "?"))), extra=extra, **known)

    def _save(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        tmp = run_dir / "summary.json.part"  # readers in other processes never see half a record
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True, default=str))
        os.replace(tmp, run_dir / "summary.json")


_FIELDS = {f.name for f in dataclasses.fields(RunRecord)}


def load(run_dir: Path) -> RunRecord:
    run_dir = Path(run_dir)
    try:
        data = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        raise NoRecord(f"{run_dir} has no readable summary.json", "pass a run id from 'fab runs'") from None
    if not isinstance(data, dict):
        raise NoRecord(f"{run_dir}/summary.json is not a run record", "pass a run id from 'fab runs'")
    data.setdefault("run_id", run_dir.name)
    return RunRecord.from_json(data)


def load_or_none(run_dir: Path) -> RunRecord | None:
    try:
        return load(run_dir)
    except ClusterError:
        return None


# -- the process that ends a run ---------------------------------------------------------------------
def this_process() -> dict:
    """What identifies this process later: pid, host and its start time (so a reused pid is not taken for it); a
    supervisor on a head adds the head's name and its chain's first run id (its XC_SUPERVISOR)."""
    on_head = {"head": os.environ["XC_HEAD"], "chain": os.environ.get("XC_SUPERVISOR")} \
        if os.environ.get("XC_HEAD") else {}
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": procs.start_time(os.getpid()), **on_head}


def supervisor_alive(sup: dict | None) -> bool | None:
    """True/False for a supervisor on this host; None when it cannot be told from here (another host, none)."""
    if not sup or sup.get("host") != socket.gethostname():
        return None
    pid = int(sup.get("pid") or 0)
    if pid <= 0:
        return None
    if not Path("/proc/self/stat").is_file():  # no /proc (macOS): the pid alone, without the reuse check
        return procs.exists(pid)
    start = procs.start_time(pid)
    return start is not None and (sup.get("start") is None or start == sup.get("start"))


def merge_results(record: RunRecord, run_dir: Path, results: dict | None) -> None:
    if results:
        record.train_samples_per_second = results.get("train", {}).get("train_samples_per_second")
        record.eval, record.speed = results.get("eval"), results.get("speed")
        (Path(run_dir) / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))


def results_of(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "results.json").read_text())
    except (OSError, ValueError):
        return None


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass
class RunResult:
    run_id: str
    run_dir: Path | str  # a URL for a run followed in the store
    exit_code: int
    wall_s: float
    results: dict | None
    failed_node: str | None = None
    detached: bool = False  # still running without this fab: 'fab logs -f' or 'fab runs' shows its end


def new_record(cluster, req, plan, facts, args: list[str]) -> RunRecord:
    """The record of a run about to start (status None until it is first written)."""
    return RunRecord(
        run_id=plan.run_id, cluster=cluster.spec, nodes=[f.node.to_dict() for f in facts],
        job=req.spec.what.job if not req.spec.what.script else None, script=req.spec.what.script,
        args=secrets.mask_args(args), module=req.spec.what.module,
        launcher=plan.launcher, workdir=plan.workdir.record() if plan.workdir is not None else None,
        world_size=plan.world_size, ppn=plan.ppn, backend=plan.backend, precision=plan.precision,
        env={**launcher.global_env(plan), **{k: secrets.MASK for k in plan.secret_env
                                             if not k.startswith(secrets.ARG_ENV)}},
        node_env={p.name: launcher.node_env(plan, p) for p in plan.nodes},
        pinning={p.name: dict(launcher.rank_cpus(p)) for p in plan.nodes},
        topology={f.node.name: f.topo.to_dict() for f in facts},
        spec=req.to_record(), segment=_segment(req, plan, args),
        started_at=time.time())


def _segment(req, plan, args: list[str]) -> dict:
    return {"nodes": len(plan.nodes), "world_size": plan.world_size,
            "accumulation": batch.micro_batches(req, args, plan.world_size) // plan.world_size,
            "from_step": req.resume.step if req.resume else 0}


def _reached(record: RunRecord, step) -> None:
    if record.segment is not None and isinstance(step, int):
        record.segment = {**record.segment, "to_step": step}


def apply(record: RunRecord, event: events.RunEvent) -> RunRecord:
    """The record after one of its ranks' events: the run's end folds runs/<id>/events.jsonl into it before it
    writes the ending, so a run that failed before its results still records the step it reached. Statuses change
    only through the named transitions below."""
    if event.kind == events.PROGRESS and isinstance(event.step, int):
        reached = (record.segment or {}).get("to_step")
        if not isinstance(reached, int) or event.step > reached:
            _reached(record, event.step)
    return record


# -- the one writer: every change of a record is one of these, saved at home AND published to the store ---
def _commit(run_dir: Path, record: RunRecord) -> RunRecord:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    record._save(run_dir)
    # [store] the records beside the run's checkpoints; never raises
    store_lib.publish_records(run_dir, record.store, ended=record.status != Status.RUNNING)
    return record


def running(run_dir: Path, record: RunRecord) -> RunRecord:
    """The run has started ('fab runs' lists it while it goes on)."""
    record._move(Status.RUNNING, exit_code=-1, wall_s=0.0)
    return _commit(run_dir, record)


def ended(run_dir: Path, record: RunRecord, status: Status, exit_code: int, wall: float,
          results: dict | None = None, **fields) -> RunRecord:
    """The run's own process ends it: ok, failed, preempted or interrupted, with its results."""
    if Status(status) not in (Status.OK, Status.FAILED, Status.PREEMPTED, Status.INTERRUPTED):
        raise BadTransition(f"run {record.run_id}: {status} is not how a run ends by itself")
    record._move(Status(status), exit_code=exit_code, wall_s=round(wall, 3), **fields)
    merge_results(record, run_dir, results)
    _reached(record, ((results or {}).get("train") or {}).get("global_step") or (record.preempted or {}).get("step"))
    return _commit(run_dir, record)


def stopped(run_dir: Path, record: RunRecord, cleanup: dict) -> RunRecord:
    """'fab stop' ended it."""
    wall = record.wall_s or (time.time() - record.started_at if record.started_at else 0.0)
    record._move(Status.STOPPED, stopped_at=now_iso(), cleanup=cleanup, wall_s=round(wall, 3),
                 exit_code=record.exit_code if record.exit_code != -1 else 143)
    return _commit(run_dir, record)


def abandoned(run_dir: Path, record: RunRecord, seen: dict) -> RunRecord:
    """Its supervisor is gone and nothing of it is left on the nodes."""
    record._move(Status.ABANDONED, abandoned={"at": now_iso(), "was": str(record.status),
                                              "supervisor": record.supervisor, **seen})
    return _commit(run_dir, record)


def restarting(run_dir: Path, attempt: int, of: int, why: str) -> RunRecord:
    """A preempted or failed run whose supervisor waits for nodes to resume it."""
    record = load(run_dir)
    record._move(Status.RESTARTING, restart={"attempt": attempt, "of": of, "ended": str(record.status), "why": why,
                                             "at": time.time()})
    return _commit(run_dir, record)


def _back(record: RunRecord) -> Status:
    return Status((record.restart or {}).get("ended", "failed"))


def restart_given_up(run_dir: Path, why: str | None = None) -> RunRecord:
    """No nodes came back in time (or too few to go on smaller: why): the run keeps how it ended."""
    record = load(run_dir)
    record._move(_back(record), restart=None, gave_up=why)
    return _commit(run_dir, record)


def grown_back(run_dir: Path, attempt: int, of: int, step: int, why: str) -> RunRecord:
    """Its supervisor ended it at checkpoint `step` to go on at full size: stopped, cause resized."""
    record = load(run_dir)
    record._move(Status.RESTARTING, cause=Cause.RESIZED.value, reason=why,
                 restart={"attempt": attempt, "of": of, "ended": str(Status.STOPPED), "why": why, "at": time.time()})
    _reached(record, step)
    return _commit(run_dir, record)


def resumed_as(run_dir: Path, next_run: str) -> RunRecord:
    """The run that ended names the one that goes on for it."""
    record = load(run_dir)
    record._move(_back(record), restarted_as=next_run, restart=None)
    return _commit(run_dir, record)


def noted(run_dir: Path, record: RunRecord, **fields) -> RunRecord:
    """No transition: a resumed run's recovery cost (`recovery`), the supervisor following it now (`supervisor`)."""
    for name, value in fields.items():
        setattr(record, name, value)
    return _commit(run_dir, record)


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
