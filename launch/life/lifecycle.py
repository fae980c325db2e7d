"""One run's life: its paths (one home each), its record, and the one ending every run shares, attached or
detached, first try or resumed: what node 0 saw (exit status, the ranks' lines) becomes ok, failed,
preempted or interrupted, with the clean-up a failure gets. Also the look that records a run `abandoned`
when the process that should end it is gone and nothing of it is left on the nodes."""
from __future__ import annotations

import dataclasses
import json
import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from cluster import store as store_lib
from cluster.node import Node
from cluster.remote import connect, run
from core.constants import HOME_EXPR
from core.errors import ClusterError, Interrupted, NodeFailure, NodeLost, Preempted
from launch.life import records, store_run
from launch.life.cleanup import Sweep, runs_alive, sweep
from launch.life.records import Cause, RunRecord, RunResult, Status, supervisor_alive
from launch.life.stream import failed_rank
from launch.staging import outputs, userscript
from training.runtime import events
from training.runtime.notice import Notice
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)


@dataclass
class Run:
    """A run's plan view (rank -> host), its nodes, its paths and its record."""

    run_id: str
    runs_dir: Path
    home: str  # node 0's work root
    nodes: list[Node]
    plan: object  # LaunchPlan or detach.LogPlan: world_size, rank_host()
    record: RunRecord
    remote_output: str = ""
    is_job: bool = True  # a bundled job (results.json, checkpoints), not the user's script
    fetch_model: bool = True

    @property
    def master(self) -> Node:
        return self.nodes[0]

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.run_id, self.home, Path(self.runs_dir))

    @property
    def run_dir(self) -> Path:
        return self.paths.home

    @property
    def remote_run(self) -> str:
        return self.paths.node

    def write(self, status: Status, exit_code: int, wall: float, results: dict | None = None, **fields) -> None:
        records.ended(self.run_dir, self.record, status, exit_code, wall, results, **fields)

    def started(self) -> None:
        records.running(self.run_dir, self.record)

    def sweep(self) -> Sweep:
        result = sweep(self.nodes, self.run_id)
        if not result.clean:
            log.error("run %s: %s", self.run_id, result.claim())
        return result


@dataclass
class Outcome:
    """What node 0 saw when mpirun returned."""

    exit_code: int
    lines: list[str]
    finished: set = field(default_factory=set)  # ranks that printed [finished]
    wall_s: float = 0.0
    watch_failure: tuple[str, str] | None = None  # (node, reason) from the watchdog
    interrupted: bool = False
    noticed_at: float | None = None  # when rank 0's notice line came by: where a restart's recovery_s starts


def end(r: Run, o: Outcome, say) -> RunResult:
    """The one ending: writes the record, and returns the result or raises the error that says what happened."""
    # The ranks' events files, home before any record is written (the store carries them), are what the ranks said
    # even where the output stream lost lines (a dropped connection to node 0); the stream adds what they lack.
    ran = outputs.gather_events(r.nodes, r.run_id, HOME_EXPR, r.run_dir)
    o = dataclasses.replace(o, finished=o.finished | {e.rank for e in ran if e.kind == events.FINISHED})
    for e in ran:
        records.apply(r.record, e)
    if o.interrupted:
        swept = r.sweep()  # the second look: what the first sweep left, if anything
        r.write(Status.INTERRUPTED, 130, o.wall_s, cleanup=swept.to_dict(), cause=Cause.INTERRUPTED.value)
        raise Interrupted(f"run {r.run_id} interrupted after {o.wall_s:.0f}s: {swept.claim()} "
                          f"(log: {r.run_dir / 'log.txt'})")
    # Every rank exits 75 after rank 0's notice, but mpirun passes 75 on only when each node's ranks end before
    # Hydra tears that node down: a node torn down first gives 255. So: the notice, and a run that did not end 0.
    notice = (Notice.first(ran) or Notice.parse(o.lines)) if o.exit_code != 0 else None
    if notice is not None:
        _preempted(r, o, notice)
    extra: dict = {}
    if o.exit_code != 0:
        swept = r.sweep()
        if len(o.finished) != r.plan.world_size:  # the job did not publish its outputs itself
            store_run.publish_outputs(r)
        node, reason = o.watch_failure or failed_rank(o.lines, r.plan)
        # oneCCL may abort a rank during interpreter shutdown: once every rank has finished its work
        # and rank 0's results are written, the run counts, and the record says what happened after.
        done = len(o.finished) == r.plan.world_size
        results = fetch_results(r) if done and r.is_job else None
        if not done or (r.is_job and results is None):
            lost = sorted(swept.unchecked)
            if lost and (node is None or node not in lost):
                node, reason = lost[0], f"{lost[0]} stopped answering ({reason})"
            r.write(Status.FAILED, o.exit_code, o.wall_s, failed_node=node, reason=reason, cleanup=swept.to_dict(),
                    lost_nodes=lost, cause=(Cause.NODE_LOST if lost else Cause.CRASHED).value)
            fix = f"see {r.run_dir / 'log.txt'}"
            url = r.record.store
            if lost and (outputs.home_checkpoints(r.run_dir) or (url and _store_steps(url, r.run_id) != [])):
                fix = f"resume with 'fab train --resume {r.run_id}' (log: {r.run_dir / 'log.txt'})"
            kind = NodeLost if lost else NodeFailure
            raise kind(f"run {r.run_id} failed after {o.wall_s:.0f}s: {reason}; {swept.claim()}",
                       [node] if node else [], run_id=r.run_id, lost=lost, fix=fix)
        say(f"note: {reason} after every rank had finished its work; the results are kept ({swept.claim()})")
        extra = {"crashed_after_finish": {"node": node, "reason": reason, "exit_code": o.exit_code},
                 "cleanup": swept.to_dict()}
    else:
        results = fetch_results(r) if r.is_job else userscript.trainer_results(r.run_dir / "output")
        if not r.is_job:  # a script's outputs came home to runs/<id>/output: the store keeps them for any checkout
            store_run.publish_outputs(r)
        if r.record.detached:  # nobody watched its processes: nothing may be left
            extra = {"cleanup": r.sweep().to_dict()}
    alone = userscript.one_job_problem(r.nodes, r.run_id, r.plan.world_size, HOME_EXPR)
    if alone:
        r.write(Status.FAILED, 0, o.wall_s, results, reason=alone, **extra)
        raise ClusterError(f"run {r.run_id} finished but {alone}",
                           fix="a Trainer or accelerate script needs ACCELERATE_USE_CPU=true (fab sets it) or "
                               "--use_cpu True, a plain torch script torch.distributed.init_process_group "
                               "(see docs/scripts.md)")
    r.write(Status.OK, 0, o.wall_s, results, **extra)
    return RunResult(run_id=r.run_id, run_dir=r.run_dir, exit_code=0, wall_s=o.wall_s, results=results)


def _preempted(r: Run, o: Outcome, notice: Notice) -> None:
    rank, step, cause = notice.rank, notice.step, notice.cause
    node = r.plan.rank_host(rank) if 0 <= rank < r.plan.world_size else "?"
    swept = r.sweep()
    url = r.record.store
    if url:  # [store] the notice's checkpoint is in the store, or nowhere
        _preempted_in_store(r, o, url, node, notice, swept)
    try:
        got = outputs.fetch_checkpoint(r.master, r.run_dir, r.remote_output, r.fetch_model)
    except Exception as exc:
        log.warning("the notice's checkpoint did not come home: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
        got = None
    home = outputs.home_checkpoints(r.run_dir)
    ckpt = r.paths.home_checkpoint(step)
    if not home:
        r.write(Status.FAILED, o.exit_code, o.wall_s, failed_node=node, cleanup=swept.to_dict(), cause=cause,
                reason=f"spot notice on {node} at step {step}, but no checkpoint reached {r.run_dir}/checkpoints")
        raise NodeFailure(f"run {r.run_id} preempted on {node} at step {step} and no checkpoint came home; "
                          f"{swept.claim()}", [node], run_id=r.run_id, lost=sorted(swept.unchecked), fix="")
    if got is None or got[0] != step:
        step, ckpt = home[-1]
    r.write(Status.PREEMPTED, Notice.EXIT, o.wall_s, cause=cause,
            preempted={"node": node, "rank": rank, "step": step, "checkpoint": str(ckpt), "noticed_at": o.noticed_at},
            cleanup=swept.to_dict())
    base = r.run_dir.parent.parent
    rel = ckpt.relative_to(base) if base in ckpt.parents else ckpt
    raise Preempted(f"run {r.run_id} preempted on {node} at step {step}: checkpoint saved ({rel})",
                    run_id=r.run_id, node=node, fix=f"resume with 'fab train --resume {r.run_id}'")


STORE_TRIES = 3  # a store that does not answer while a resume is decided is asked again, STORE_RETRY_S apart
STORE_RETRY_S = 5.0


def _store_steps(url: str, run_id: str, tries: int | None = None) -> list[int] | None:
    """The run's complete checkpoints in the store; None when the store did not answer in ``tries`` attempts
    (expired credentials, a network cut): unknown, which is not 'no checkpoint'."""
    import time

    tries = tries or STORE_TRIES
    for attempt in range(1, tries + 1):
        try:
            return store_lib.checkpoints(url, run_id)
        except ClusterError as exc:
            log.warning("the store did not answer (try %d of %d): %s", attempt, tries, exc)
            if attempt < tries:
                time.sleep(STORE_RETRY_S)
    return None


def _preempted_in_store(r: Run, o: Outcome, url: str, node: str, notice: Notice, swept) -> None:
    """Preempted when the store holds a complete checkpoint (the notice's once durable, else the newest complete
    one before it); failed when it holds none. Raises."""
    rank, step, cause = notice.rank, notice.step, notice.cause
    steps = _store_steps(url, r.run_id)
    if steps is None:  # unknown: the run stays restartable, and its resume asks the store again
        r.write(Status.PREEMPTED, Notice.EXIT, o.wall_s, cause=Cause.STORE_UNREACHABLE.value,
                preempted={"node": node, "rank": rank, "step": step, "checkpoint": None, "notice_step": step,
                           "durable": None, "noticed_at": o.noticed_at, "notice_cause": cause},
                cleanup=swept.to_dict(), reason=f"spot notice on {node} at step {step}; the store {url} did not answer "
                                                f"({STORE_TRIES} tries), so its checkpoints are unknown")
        raise Preempted(f"run {r.run_id} preempted on {node} at step {step}; the store {url} did not answer, so which "
                        "checkpoint it holds is unknown", run_id=r.run_id, node=node,
                        fix=f"check the store's credentials ('fab doctor'), then 'fab train --resume {r.run_id}'")
    if not notice.durable:  # the ranks did not all see it confirmed in the store: never resume from it
        log.warning("the notice's checkpoint (step %s) did not become durable in the store", step)
        steps = [s for s in steps if s != step]
    if not steps:
        r.write(Status.FAILED, o.exit_code, o.wall_s, failed_node=node, cleanup=swept.to_dict(), cause=cause,
                reason=f"spot notice on {node} at step {step}, but no complete checkpoint reached the store {url}")
        raise NodeFailure(f"run {r.run_id} preempted on {node} at step {step} and no checkpoint reached the store "
                          f"{url}; {swept.claim()}", [node], run_id=r.run_id, lost=sorted(swept.unchecked), fix="")
    noticed, durable = step, notice.durable and step in steps
    if not durable:
        log.warning("the notice's checkpoint (step %s) is not in the store; the newest there is step %s", step, steps[-1])
        step = steps[-1]
    where = r.paths.store_url(url, step)
    r.write(Status.PREEMPTED, Notice.EXIT, o.wall_s, cause=cause,
            preempted={"node": node, "rank": rank, "step": step, "checkpoint": where, "notice_step": noticed,
                       "durable": durable, "noticed_at": o.noticed_at}, cleanup=swept.to_dict(),
            reason=None if durable else f"the notice's checkpoint (step {noticed}) did not become durable in the "
                                        f"store; resume uses the previous complete one (step {step})")
    said = "checkpoint saved" if durable else f"the notice's checkpoint was not durable; resume takes step {step}"
    raise Preempted(f"run {r.run_id} preempted on {node} at step {step}: {said} ({where})",
                    run_id=r.run_id, node=node, fix=f"resume with 'fab train --resume {r.run_id}'")


def fetch_results(r: Run) -> dict | None:
    with connect(r.master) as conn:
        res = run(conn, f"cat {shlex.quote(r.remote_output)}/results.json", timeout=60)
    if not res.ok:
        log.warning("the job wrote no results.json in %s", r.remote_output)
        return None
    try:
        return json.loads(res.stdout)
    except ValueError:
        return None


# -- runs nobody ends --------------------------------------------------------------------------------
def watched(rec: RunRecord) -> bool:
    """A run still in someone's hands: its supervisor lives (or lives where we cannot look), or a plain
    detached run, which node 0's wrapper ends and the next look concludes."""
    if rec.detached and (not rec.supervisor or rec.status == Status.RUNNING):  # node 0's wrapper ends it
        return True
    return supervisor_alive(rec.supervisor) is not False and rec.supervisor is not None


def reap(run_dir: Path, rec: RunRecord) -> RunRecord:
    """A running (or restarting) run whose supervisor died, with nothing of it left on the nodes, is recorded
    abandoned with what the look found; any other record is returned as it is."""
    if rec.status not in (Status.RUNNING, Status.RESTARTING) or watched(rec):
        return rec
    nodes = [Node(**n) for n in rec.nodes]
    unasked: dict[str, str] = {}
    alive = runs_alive(nodes, unasked).get(rec.run_id) if nodes else None
    if alive:  # its ranks live on without it: 'fab stop' ends them
        return rec
    records.abandoned(run_dir, rec, {
        "found": "no process of the run on " + (", ".join(n.name for n in nodes if n.name not in unasked) or
                                                "any node that answered"),
        "unchecked": unasked})
    log.info("run %s: its supervisor is gone and nothing of it is left on the nodes: recorded abandoned",
             rec.run_id)
    return rec
