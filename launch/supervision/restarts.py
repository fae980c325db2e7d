"""`fab train --max-restarts K`: after a preemption or a lost node, wait for the cluster to have its
nodes again (a local node brought back by 'fab local-up', a replacement instance on AWS), then resume
the run from its latest checkpoint at home, by itself. A run that crashed on nodes that still answer
is not restarted: it would crash again.
"""
from __future__ import annotations

import functools
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TextIO

from cluster import shipping
from cluster.node import Node
from cluster.remote import connect, fan_out, run
from cluster.resolve import Cluster, open_cluster
from core.errors import ClusterError, NoCheckpoint, NodeFailure, Preempted
from launch.life import elastic, records
from launch.life import resume as resume_lib
from launch.life.records import RunResult
from launch.plan.request import TrainRequest, new_run_id
from launch.run import train
from launch.staging import secrets
from training.runtime import timeline
from training.runtime.paths import RunPaths

# A check of the nodes every 2 s while a restart waits for them: each costs one SSH command per node (a small Python
# without the project's imports), only during the wait.
POLL_S = 2.0
# The notice check takes ~1 s; a node that EC2 takes mid-check answers nothing more (no reset from a vanished host), so
# a long timeout held every later check back: on the twin a check waited its 30 s for the reclaimed node.
CHECK_TIMEOUT_S = 8
CHECK_MARGIN_S = 4  # by the clock, past CHECK_TIMEOUT_S: a check still not back then is given up
# The node asks its own metadata service with the ranks' watcher code (stdlib only, sent as text): the run's
# XC_IMDS_ENDPOINT when it set one, else the node's (its environment's, or AWS's address).
_CHECK = """
import sys
from training.runtime.spot import NoticeWatcher
try:
    print("notice" if NoticeWatcher(sys.argv[1] or None, timeout=1.0).check() else "none")
except (OSError, ConnectionError):
    print("none")
"""


def why_restart(exc: ClusterError) -> str | None:
    """What ended the run, when waiting for nodes can help; None for a failure that would repeat."""
    if getattr(exc, "run_id", None) is None:
        return None
    if isinstance(exc, Preempted):
        return f"run {exc.run_id} was preempted on {exc.node}"
    if isinstance(exc, NodeFailure) and exc.lost:
        return f"run {exc.run_id} lost {', '.join(exc.lost)}"
    return None


def node_ready(node: Node, endpoint: str) -> str:
    """'ok', or why the node cannot take a run: a pending spot notice means it is about to go."""
    command = (f"{shlex.quote(node.python)} - {shlex.quote(endpoint)} <<'XC_SPOT_CHECK'\n"
               f"{shipping.standalone(_CHECK)}\nXC_SPOT_CHECK")
    with connect(node) as conn:
        res = run(conn, command, timeout=CHECK_TIMEOUT_S)
    if not res.ok:  # a node going away mid-check (its sessions killed) is not a node ready for a run
        return f"{node.name} did not finish the notice check (exit {res.exited})"
    if res.stdout.strip().endswith("notice"):
        return f"{node.name} has a spot interruption notice"
    return "ok"


def missing(spec: str, count: int, endpoint: str) -> str | None:
    """Why the cluster cannot yet run on `count` nodes, or None when it can. Each node's check gets CHECK_TIMEOUT_S
    and a little more by the clock: a node that EC2 takes mid-check can hold its SSH session for a minute (no reset
    comes from a vanished host), and the checks that follow must not wait for it."""
    try:
        nodes = open_cluster(spec).first(count)
    except ClusterError as exc:
        return exc.what
    pool = ThreadPoolExecutor(max_workers=min(32, max(1, len(nodes))))
    checks = {pool.submit(node_ready, n, endpoint): n for n in nodes}
    _, late = futures_wait(checks, timeout=CHECK_TIMEOUT_S + CHECK_MARGIN_S)
    pool.shutdown(wait=False, cancel_futures=True)  # a late check ends on its own; nobody waits for it
    doomed = []
    for check, node in checks.items():
        if check in late:
            doomed.append(f"{node.name} did not finish the notice check within "
                          f"{CHECK_TIMEOUT_S + CHECK_MARGIN_S:g}s")
            continue
        try:
            state = check.result()
        except ClusterError as exc:
            state = exc.what
        if state != "ok":
            doomed.append(state)
    return "; ".join(doomed) or None


def wait_for_nodes(spec: str, count: int, wait_s: float, endpoint: str, say, poll_s: float = POLL_S) -> None:
    started = time.monotonic()
    deadline = started + wait_s
    said, checks = None, 0
    while True:
        began = time.monotonic()
        problem = missing(spec, count, endpoint)
        checks += 1
        took = time.monotonic() - began
        if took > 3:  # a slow check is what a long wait is made of: say which
            say(f"a check of {count} node(s) took {took:.1f}s ({problem or 'all ready'})")
        if problem is None:
            say(f"{count} node(s) ready ({time.monotonic() - started:.1f}s, {checks} check(s))")
            return
        if problem != said:
            say(f"waiting for {count} node(s): {problem}")
            said = problem
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(f"the cluster did not have {count} node(s) within --restart-wait {wait_s:.0f}s "
                               f"({problem})")
        time.sleep(min(poll_s, left))


def next_request(run_id: str, req: TrainRequest, say) -> TrainRequest:
    """The resume of run_id from the newest checkpoint at home along its resume chain; the same request
    anew when none came home before the loss."""
    current = run_id
    while True:
        try:
            nxt = resume_lib.resume_request(current, req.runs_dir, nodes=req.spec.where.nodes,
                                            fetch_model=req.fetch_model)
            break
        except NoCheckpoint:
            earlier = resume_lib.resumed_from(req.runs_dir, current)
            if earlier is None:
                say(f"no checkpoint of {run_id} came home before it ended: starting it again from step 0")
                return req
            current = earlier
    # the record masks secret arguments: this run's own values go on
    kept, mine = nxt.spec.what, req.spec.what
    return nxt.but(args=secrets.unmask_args(kept.args, mine.args), master_port=req.master_port,
                   valueless=nxt.valueless | req.valueless,
                   env={**kept.env, **{k: v for k, v in mine.env.items() if k in kept.env}})  # *** in records


def refuse_base_image(cluster: Cluster, max_restarts: int) -> None:
    """--max-restarts resumes on the nodes the cluster has then: with image=base a replacement boots stock Ubuntu
    without the profile and the resume fails its preflight, so it is refused before anything starts."""
    base = [n.name for n in cluster.nodes if n.labels.get("image") == "base"]
    if max_restarts > 0 and base:
        raise ClusterError(f"--max-restarts {max_restarts} on cluster {cluster.spec}, whose nodes boot image=base: a "
                           "replacement node has no software profile until 'fab setup' runs, so the restart would fail",
                           fix="run without --max-restarts (resume with 'fab setup' then 'fab train --resume RUN'), "
                               "or 'pulumi config set image bake' and 'pulumi up'")


def train_with_restarts(cluster: Cluster, req: TrainRequest, out: TextIO = sys.stdout, poll_s: float = POLL_S,
                        ended: ClusterError | None = None, restarts_done: int = 0) -> RunResult:
    """Run, and after a preemption or a lost node wait for the cluster and resume, as the request's recovery policy
    says (req.spec.recovery, which every run of the chain keeps in its record). The run that ended is recorded
    `restarting` while this waits, and names the run it was resumed as. With min_nodes, a wait that ends short of
    every node goes on with fewer (launch.life.elastic). `ended`: a run of the chain already ended so (a head that
    took the chain over, launch.supervision.adopt): handled first, with the chain's `restarts_done` already counted."""
    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    max_restarts, restart_wait = req.spec.recovery.max_restarts, req.spec.recovery.restart_wait
    refuse_base_image(cluster, max_restarts)
    full = check_min_nodes(cluster, req)
    endpoint = req.spec.what.env.get("XC_IMDS_ENDPOINT") or ""  # else the node's own (a local node's sshd sets it)
    attempt = restarts_done
    while True:
        grow = None
        policy = req.spec.recovery
        size = req.spec.where.nodes
        if policy.min_nodes is not None and policy.grow_back and size is not None and size < full:
            req = req.but(run_id=req.run_id or new_run_id("script" if req.spec.what.own else req.spec.what.job))
            grow = elastic.GrowBack(req.run_id, req.runs_dir, req.store, full,
                                    functools.partial(_all_back, cluster.spec, full, endpoint), say, poll_s=poll_s)
            grow.start()
        try:
            if ended is not None:
                pending, ended = ended, None
                raise pending
            return train(cluster, req, out)
        except ClusterError as exc:
            _restart_failed(req, exc)
            if grow is not None and grow.fired is not None:
                req = _grow_back(req, grow.fired, full, attempt, max_restarts, say)
                cluster = open_cluster(cluster.spec, require_running=None)
                continue
            if not isinstance(exc, (Preempted, NodeFailure)):
                raise
            why = why_restart(exc)
            if why is None or attempt >= max_restarts:
                raise
            attempt += 1
            run_dir = RunPaths(exc.run_id, runs_dir=req.runs_dir).home
            rec = records.restarting(run_dir, attempt, max_restarts, why)
            say(f"restart {attempt} of {max_restarts}: {why}; waiting up to {restart_wait:.0f}s for the cluster")
            count = full
            try:
                wait_for_nodes(cluster.spec, full, restart_wait, endpoint, say, poll_s)
            except ClusterError as wait_exc:
                count, gave_up = _smaller(rec, wait_exc, req, full, cluster.spec, endpoint, say)
                if count is None:
                    records.restart_given_up(run_dir, gave_up)
                    raise type(exc)(f"{wait_exc.text}; {exc.what}", fix=exc.fix, **_same(exc)) from None
            at = time.monotonic()
            nxt = next_request(exc.run_id, req.but(nodes=count), say)
            req = _carry(nxt, req, restart_of=exc.run_id)
            found = time.monotonic()
            # a replaced node has a new address: discover them anew (a lost one left out: --min-nodes goes on without)
            cluster = open_cluster(cluster.spec, require_running=None)
            say(f"resuming: the checkpoint found in {found - at:.1f}s, the nodes discovered in "
                f"{time.monotonic() - found:.1f}s")
        finally:
            if grow is not None:
                grow.stop()


def _restart_failed(req: TrainRequest, exc: ClusterError) -> None:
    """A restart that failed before its run had a record (a node gone again, a bad checkpoint): the run it was to
    resume keeps how it ended, saying why, instead of waiting as `restarting` for nobody."""
    if not req.restart_of:
        return
    prev = RunPaths(req.restart_of, runs_dir=req.runs_dir).home
    rec = records.load_or_none(prev)
    if rec is not None and rec.status == records.Status.RESTARTING:
        records.restart_given_up(prev, f"its restart failed before launch: {exc.what}")


def _all_back(spec: str, full: int, endpoint: str) -> bool:
    return missing(spec, full, endpoint) is None


def check_min_nodes(cluster: Cluster, req: TrainRequest) -> int:
    """The run's full size; --min-nodes above it is refused before anything starts."""
    full, least = req.spec.where.nodes or len(cluster.nodes), req.spec.recovery.min_nodes
    if least is not None and least > full:
        raise ClusterError(f"--min-nodes {least} is above the run's {full} node(s)",
                           fix=f"pass --min-nodes from 1 to {full}")
    return full


def _carry(nxt: TrainRequest, req: TrainRequest, restart_of: str) -> TrainRequest:
    """The next segment's request (its recovery policy is the record's); rank 0 marks its first step, where
    recovery_s ends."""
    return nxt.but(restart_of=restart_of, run_id=None, env={**nxt.spec.what.env, timeline.ENV: "1"},
                               wrapped=req.wrapped)


def _smaller(rec, wait_exc: ClusterError, req: TrainRequest, full: int, spec: str, endpoint: str, say
             ) -> tuple[int | None, str | None]:
    """With --min-nodes: how many nodes the run goes on with now that the wait ran out, or (None, why not) to give
    up: the record and the log say why in one line."""
    policy = req.spec.recovery
    if policy.min_nodes is None or policy.min_nodes >= full:
        return None, None
    ready = ready_prefix(spec, full, endpoint)
    try:
        size = elastic.go_on_size(rec, ready, policy.min_nodes, full)
    except ClusterError as why:
        say(f"not going on smaller: {why.what}")
        return None, f"not going on smaller: {why.what}"
    say(f"{wait_exc.what}: going on with {size} of {full} node(s) at the same global batch (--min-nodes "
        f"{policy.min_nodes})" + ("; back to full size at the next checkpoint once they return" if policy.grow_back
                                  else "")
        + elastic.idle_note(rec, ready, size, full))
    return size, None


def ready_prefix(spec: str, full: int, endpoint: str) -> int:
    """How many of the cluster's first nodes (the ones a run of k takes) answer with no pending notice."""
    def state(node: Node) -> str:
        try:
            return node_ready(node, endpoint)
        except ClusterError as exc:
            return exc.what

    try:
        states = fan_out(list(open_cluster(spec, require_running=None).nodes[:full]), state, "reaching the nodes")
    except ClusterError:
        return 0
    count = 0
    for state in states:
        if state != "ok":
            break
        count += 1
    return count


def _grow_back(req: TrainRequest, step: int, full: int, attempt: int, max_restarts: int, say) -> TrainRequest:
    """The segment the watcher ended at checkpoint `step`: recorded stopped to grow back, resumed on full nodes."""
    run_dir = RunPaths(req.run_id, runs_dir=req.runs_dir).home
    nxt = next_request(req.run_id, req.but(nodes=full), say)
    step = nxt.resume.step if nxt.resume else step  # one more may complete while the ranks are being ended
    records.grown_back(run_dir, attempt, max_restarts, step, f"ended at checkpoint {step} to go on at {full} node(s)")
    return _carry(nxt, req, restart_of=req.run_id)


def _same(exc: ClusterError) -> dict:
    if isinstance(exc, Preempted):
        return {"run_id": exc.run_id, "node": exc.node}
    return {"nodes": exc.nodes, "run_id": exc.run_id, "lost": exc.lost}
