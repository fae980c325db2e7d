"""Detached runs: `fab train --detach` starts mpirun on node 0 in its own session with its output in
the run's folder there and returns once every rank is running; `fab logs RUN [-f]` shows (follows) a
run's log with the same [rank host] prefixes; `fab runs` lists runs. Whichever of them first sees a
detached run ended brings its results and outputs home and writes its summary, as an attached run
does when mpirun returns.

On node 0, runs/<id>/ holds mpirun.log (secret values already replaced by *** on the node),
wrapper.pid (the shell that waits for mpirun) and, once mpirun has ended, exit_code.
"""
from __future__ import annotations

import base64
import io
import logging
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from cluster.node import Node
from cluster.remote import connect, run
from core.errors import ClusterError
from launch.life import lock, records
from launch.life.cleanup import runs_alive, sweep
from launch.life.lifecycle import Outcome, Run, end
from launch.life.records import RunRecord, RunResult, Status
from launch.life.stream import OutputRouter
from launch.staging import outputs, secrets
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300


@dataclass(frozen=True)
class LogPlan:
    """What reading a run's log needs of its plan: rank -> host (block placement)."""
    run_id: str
    ppn: int
    node_names: tuple[str, ...]
    secret_env: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.ppn * len(self.node_names)

    def rank_host(self, rank: int) -> str:
        return self.node_names[rank // self.ppn]


def wrapper_command(remote_run: str, mpirun_dir: str, argv_text: str, python: str, code_dir: str,
                    has_secrets: bool) -> str:
    """Shell text run on node 0: mpirun in its own session, surviving the SSH session that starts it."""
    sink = "> mpirun.log 2>&1"  # stdout first: '2>&1 > file' would send the ranks' stderr to /dev/null
    if has_secrets:
        sink = (f"2>&1 | {shlex.quote(python)} {shlex.quote(code_dir + '/training/runtime/redact.py')} "
                f"{secrets.FILE} > mpirun.log")
    inner = (f"PATH={shlex.quote(mpirun_dir)}:$PATH {argv_text} {sink}; "
             'echo "${PIPESTATUS[0]} $(date +%s.%N)" > exit_code.part && mv exit_code.part exit_code')
    # braces: '&' must background only the wrapper, or a subshell keeps the SSH session's output open
    return (f"cd {shlex.quote(remote_run)} && {{ nohup setsid bash -c {shlex.quote(inner)} > /dev/null 2>&1 "
            "< /dev/null & echo $! > wrapper.pid; }")


def followed_command(remote_run: str, wrapper: str) -> str:
    """The wrapper started, then its log followed until it ends; exits with mpirun's status. A supervisor runs its
    runs this way: the SSH session only reads, so the ranks go on when the supervisor's machine goes away."""
    run = shlex.quote(remote_run)
    return (f"{wrapper} && cd {run} && tail -n +1 --pid=\"$(cat wrapper.pid)\" -F mpirun.log 2>/dev/null; "
            f"exit \"$(cut -d' ' -f1 {run}/exit_code 2>/dev/null || echo 255)\"")


def start(facts, r: Run, command: str, say) -> RunResult:
    """Start the wrapper on node 0, wait until every node runs its ranks (or mpirun already ended), record
    the run as running. Raises ClusterError when the ranks did not start."""
    plan, master = r.plan, r.master
    r.record.detached, r.record.remote_run, r.record.started_at = True, r.remote_run, time.time()
    with connect(master) as conn:
        res = run(conn, command, timeout=60)
    if not res.ok:
        raise ClusterError(f"could not start mpirun on {master.name}: {res.stderr.strip()[-300:]}",
                           "check the node with 'fab doctor'")
    r.started()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _ended(master, r.remote_run) is not None:
            break  # a short job may end before we look: conclude it now, as an attached run would
        alive = runs_alive(r.nodes).get(plan.run_id, {})
        if all(alive.get(n.name, 0) >= plan.ppn for n in r.nodes):
            if plan.secret_env:  # every rank has read it, and the log filter did at its start
                secrets.forget([(f.node, RunPaths(plan.run_id, f.home).node) for f in facts])
            say(f"run {plan.run_id} detached: {plan.world_size} rank(s) running on {len(r.nodes)} node(s); follow it "
                f"with 'fab logs {plan.run_id} -f', list runs with 'fab runs', end it with 'fab stop {plan.run_id}'")
            return RunResult(run_id=plan.run_id, run_dir=r.run_dir, exit_code=0, wall_s=0.0, results=None,
                             detached=True)
        time.sleep(0.5)
    else:
        sweep(r.nodes, plan.run_id)
        r.write(Status.FAILED, 1, time.time() - r.record.started_at,
                reason=f"the ranks did not all start within {START_TIMEOUT_S}s")
        raise ClusterError(f"run {plan.run_id}: the ranks did not all start within {START_TIMEOUT_S}s",
                           f"see 'fab logs {plan.run_id}'")
    rec = conclude(r.run_dir, master, out=None)
    if rec.status != Status.OK:
        raise ClusterError(f"run {plan.run_id} {rec.status}: {rec.reason or 'see its log'}",
                           f"read its log in {r.run_dir / 'log.txt'}")
    return RunResult(run_id=plan.run_id, run_dir=r.run_dir, exit_code=0, wall_s=rec.wall_s,
                     results=records.results_of(r.run_dir))


# -- reading records ------------------------------------------------------------------------------
def master_node(rec: RunRecord) -> Node:
    return Node(**rec.nodes[0])


def log_plan(rec: RunRecord) -> LogPlan:
    return LogPlan(rec.run_id, int(rec.ppn or 1), tuple(rec.node_names))


def _ended(master: Node, remote_run: str) -> tuple[int, float] | None:
    """(mpirun's exit status, when it ended) once the wrapper has written them, else None."""
    with connect(master) as conn:
        res = run(conn, f"cat {shlex.quote(remote_run)}/exit_code 2>/dev/null", timeout=30)
    words = res.stdout.split()
    try:
        return (int(words[0]), float(words[1])) if res.ok and len(words) == 2 else None
    except ValueError:
        return None


def is_running_detached(rec: RunRecord) -> bool:
    """A run under node 0's wrapper that nobody follows: a plain detached one, or a supervisor's that outlived it."""
    return bool(rec.detached) and rec.status == Status.RUNNING and (
        not rec.supervisor or records.supervisor_alive(rec.supervisor) is False)


# -- ending ---------------------------------------------------------------------------------------
def conclude(run_dir: Path, master: Node, out: TextIO | None, follower: bool = False) -> RunRecord:
    """If the detached run has ended on node 0: its log and outputs home, then the one ending every run
    has (launch.life.lifecycle.end). Returns the record (still running while it runs). `follower`: the caller is
    the supervisor the record names (a head that took the run over), not a look at a run nobody follows."""
    rec = records.load(run_dir)
    if not (is_running_detached(rec) or follower and rec.detached and rec.status == Status.RUNNING):
        return rec
    ended = _ended(master, rec.remote_run)
    if ended is None:
        return rec
    code, ended_at = ended
    plan = log_plan(rec)
    nodes = [Node(**n) for n in rec.nodes]
    with connect(master) as conn:
        text = io.BytesIO()
        conn.get(f"{rec.remote_run}/mpirun.log", text)
    wall = max(0.0, ended_at - float(rec.started_at or ended_at))  # node 0's clock and ours: one host or NTP
    with (run_dir / "log.txt").open("w") as log_file:
        router = OutputRouter(plan, out or io.StringIO(), log_file)
        router.write(text.getvalue().decode(errors="replace"))
        router.flush_rest()
    home, _ = RunPaths.node_run_of(rec.remote_run)
    r = Run(rec.run_id, run_dir.parent, home, nodes, plan, rec,
            remote_output=rec.remote_output or RunPaths(rec.run_id, home).node_output, is_job=bool(rec.job))
    if r.is_job:
        _bring_home(master, r.remote_output, run_dir)
    try:
        end(r, Outcome(code, router.lines, router.finished, wall), lambda msg: log.info("%s", msg))
    except ClusterError as exc:  # the record says how it ended; whoever looked reads it there
        log.debug("run %s ended: %s", rec.run_id, exc)
    lock.release(nodes, plan.run_id)
    return records.load(run_dir)


class LogMirror:
    """runs/<id>/log.txt of a run taken over while it goes on (launch.supervision.adopt), appended from node 0's mpirun.log
    as it grows: whole lines, routed as the first supervisor routed them, so the head's Beat publishes them to the
    store for `fab logs -f` before the run ends. conclude() writes the whole log at the end."""

    def __init__(self, run_dir: Path, rec: RunRecord):
        self.path, self.remote, self.offset = run_dir / "log.txt", rec.remote_run, 0
        self.file, self.shown = self.path.open("w"), open(os.devnull, "w")  # noqa: SIM115 - closed by close()
        self.router = OutputRouter(log_plan(rec), self.shown, self.file)

    def step(self, master: Node) -> None:
        """What node 0's log gained since the last step; a node that does not answer now is asked next time."""
        try:
            with connect(master) as conn:
                # base64: the offset counts the file's bytes, whatever a rank printed (text decoding would turn
                # one byte that is not UTF-8 into three and skip what follows)
                res = run(conn, f"tail -c +{self.offset + 1} {shlex.quote(self.remote)}/mpirun.log | base64 -w0",
                          purpose="the run's log", timeout=30)
        except ClusterError as exc:
            log.debug("the log of %s: %s", self.remote, exc)
            return
        try:
            data = base64.b64decode(res.stdout.strip(), validate=True) if res.ok else b""
        except ValueError:
            return
        lines = data[:data.rfind(b"\n") + 1]
        self.offset += len(lines)
        self.router.write(lines.decode(errors="replace"))

    def close(self) -> None:
        self.file.close()
        self.shown.close()


def _bring_home(master: Node, remote_out: str, run_dir: Path) -> None:
    try:
        outputs.fetch_output(master, remote_out, run_dir / "output", True)
    except Exception as exc:  # node 0 gone: the record still gets written
        log.debug("outputs of %s", run_dir.name, exc_info=True)
        log.warning("could not bring the outputs home from %s: %s", master.name, exc)
