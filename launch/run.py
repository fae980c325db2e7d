"""`fab train`: probe the nodes, derive the layout, ship code and data, run mpirun on node 0,
stream every rank's output, collect results into runs/<run-id>/, and clean up after a failure.
"""
from __future__ import annotations

import io
import logging
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from cluster import keys, local, resolve, shipping
from cluster.node import Node
from cluster.remote import connect, fan_out, run
from cluster.resolve import Cluster
from core.constants import HOME_EXPR
from core.errors import ClusterError
from core.render import render
from launch.life import detach, lock, records, store_run
from launch.life.cleanup import Sweep, sweep
from launch.life.lifecycle import Outcome, Run, end
from launch.life.records import RunResult, Status, new_record, result_line, this_process
from launch.life.recovery import Recovery
from launch.life.stream import OutputRouter
from launch.life.watchdog import Watchdog
from launch.plan import launcher
from launch.plan.preflight import preflight
from launch.plan.probe import NodeFacts
from launch.plan.request import TrainRequest, describe, plan_run, validate
from launch.staging import outputs, requirements, secrets, snapshot, userscript, workdir
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)




def cleanup(nodes: list[Node], run_id: str) -> Sweep:
    """Kill every process of this run on every node and check that none is left."""
    result = sweep(nodes, run_id)
    if not result.clean:
        log.error("run %s: %s", run_id, result.claim())
    return result


def _stage(fact: NodeFacts, plan: launcher.LaunchPlan, node_plan: launcher.NodePlan, digest: str, tarball: bytes,
           ship: dict[str, Path], script: str | None, is_master: bool, hostfile: str, resume: Path | None = None,
           pylayer: str | None = None, held: str | None = None) -> tuple[str, bool | None]:
    """Code, run folder, scripts and data on one node; returns (code folder, whether --workdir was sent now, or with
    `held`, the run's code snapshot in the store, whether this node fetched it from there now)."""
    with connect(fact.node) as conn:
        code_dir = shipping.ensure_code(conn, fact.home, digest, tarball)
        run_dir = RunPaths(plan.run_id, fact.home).node
        res = run(conn, f"mkdir -p {shlex.quote(run_dir)}/data {shlex.quote(run_dir)}/script")
        if not res.ok:
            raise ClusterError(f"{fact.node.name}: cannot create {run_dir}: {res.stderr.strip()}")
        env_sh = render("node_env.sh.j2", run_id=plan.run_id, node=fact.node.name, python=fact.node.python,
                        code_dir=code_dir, rank_cpus=launcher.rank_cpus(node_plan),
                        env=sorted(launcher.node_env(plan, node_plan).items()),
                        workdir=f"{run_dir}/work" if plan.workdir is not None else None,
                        pylayer=f"{run_dir}/pylayer" if pylayer else None)
        rank_sh = render("rank.sh.j2", run_id=plan.run_id, run_dir=RunPaths(plan.run_id, HOME_EXPR).node,
                         pin="yes" if plan.pin else "no",
                         entry=launcher.shell_join(list(plan.entry)), launch=launcher.launch_words(plan))
        conn.put(io.StringIO(env_sh), f"{run_dir}/node_env.sh")
        if plan.secret_env:  # created empty with mode 0600 first: the values never sit in a readable file
            run(conn, f"(umask 077 && : > {shlex.quote(run_dir)}/{secrets.FILE})")
            conn.put(io.StringIO(secrets.env_file(plan.secret_env)), f"{run_dir}/{secrets.FILE}")
        if pylayer:  # the requirements' wheels from the store, into the run's layer (with the ranks' environment)
            requirements.install(conn, fact.node.python, code_dir, run_dir, fact.home, pylayer, plan.env_overrides)
        conn.put(io.StringIO(rank_sh), f"{run_dir}/rank.sh")
        run(conn, f"chmod 700 {shlex.quote(run_dir)}/rank.sh")
        if held:  # the run's own files from the store (never from this machine, which may not have them as they were)
            sent = snapshot.fetch(conn, fact.node.python, code_dir, run_dir, fact.home, held, plan.env_overrides)
        else:  # no store: from this machine
            for name, local in ship.items():
                conn.put(str(local), f"{run_dir}/data/{name}")
            if script and plan.workdir is None:
                conn.put(script, f"{run_dir}/script/{Path(script).name}")
            sent = None if plan.workdir is None else workdir.ensure(conn, fact.home, plan.workdir, f"{run_dir}/work")
        if is_master:
            conn.put(io.StringIO(hostfile), f"{run_dir}/hostfile")
        if resume:  # every rank loads the weights from its own node
            target = f"{run_dir}/resume/{Path(resume).name}"
            files = [f for f in Path(resume).rglob("*") if f.is_file()]
            dirs = sorted({shlex.quote(f"{target}/{f.parent.relative_to(resume)}") for f in files})
            run(conn, "mkdir -p " + " ".join(dirs or [shlex.quote(target)]))
            for f in files:
                conn.put(str(f), f"{target}/{f.relative_to(resume)}")
        return code_dir, sent


def train(cluster: Cluster, req: TrainRequest, out: TextIO = sys.stdout) -> RunResult:
    """Run a job across the first req.spec.where.nodes nodes. Raises ClusterError / NodeFailure on failure."""
    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    plan, facts, args, ship, req = plan_run(cluster, req, say)
    for line in describe(plan, facts):
        say(line)
    nodes = [f.node for f in facts]
    # Cheap checks before anything is written (the mesh is verified below, after the keys).
    preflight(cluster, nodes, mesh=False).raise_if_failed("preflight")
    if req.concurrent:
        return _run(cluster, req, plan, facts, args, ship, say, out)
    lock.take(nodes, plan.run_id, say, Path(req.runs_dir))
    detached = False
    try:
        result = _run(cluster, req, plan, facts, args, ship, say, out)
        detached = result.detached
        return result
    finally:
        if not detached:  # a detached run holds the cluster until it is concluded
            lock.release(nodes, plan.run_id)


def _run(cluster: Cluster, req: TrainRequest, plan: launcher.LaunchPlan, facts: list[NodeFacts], args: list[str],
         ship: dict[str, Path], say, out: TextIO) -> RunResult:
    nodes = [f.node for f in facts]
    master = facts[0]
    record = new_record(cluster, req, plan, facts, args)
    r = Run(plan.run_id, Path(req.runs_dir), master.home, nodes, plan, record,
            remote_output=_remote_output_dir(master, plan, args), is_job=req.spec.what.script is None,
            fetch_model=req.fetch_model)
    try:
        r.run_dir.mkdir(parents=True)
    except OSError as exc:
        raise ClusterError(f"cannot create the run folder {r.run_dir}: {exc.strerror}",
                           "set XC_RUNS_DIR to a writable folder") from None
    say(f"run {plan.run_id}: results in {r.run_dir}")
    recovery = Recovery.of_request(req)  # a restart: what it costs, from the run that ended to this one's first step
    if req.restart_of:  # the run that ended names the one that goes on for it
        records.resumed_as(RunPaths(req.restart_of, runs_dir=req.runs_dir).home, plan.run_id)
    if req.resume:
        record.resumed_from = {"run_id": req.resume.run_id, "step": req.resume.step}
    # who ends this run: this process (fab, or the supervisor of a detached run with restarts); a plain
    # detached run is ended by whichever fab looks after node 0's wrapper has finished
    record.supervisor = None if req.detach else this_process()
    try:
        ks_dir, digest = _prepare(cluster, req, plan, facts, ship)
    except BaseException as exc:  # the run folder exists: it gets its record
        stopped = isinstance(exc, KeyboardInterrupt)
        r.write(Status.INTERRUPTED if stopped else Status.FAILED, 130 if stopped else 1, 0.0,
                reason=f"before launch: {'interrupted' if stopped else exc}")
        raise
    say(f"code {digest} on every node")
    mpirun = str(Path(master.node.python).parent / "mpirun")
    argv = launcher.mpirun_argv(plan, ssh_config=f"{ks_dir}/config", mpirun=mpirun)
    command = (f"cd {shlex.quote(r.remote_run)} && "
               f"PATH={shlex.quote(str(Path(mpirun).parent))}:$PATH exec {launcher.shell_join(argv)}")
    record.command, record.code = argv, digest
    (r.run_dir / "command.sh").write_text(command + "\n")
    if req.detach:
        record.remote_output = r.remote_output
        say(f"launching {plan.world_size} rank(s) with mpirun on {master.node.name}, detached")
        return detach.start(facts, r, detach.wrapper_command(
            r.remote_run, str(Path(mpirun).parent), launcher.shell_join(argv), master.node.python,
            f"{master.home}/code/{digest}", bool(plan.secret_env)), say)
    if req.wrapped:  # mpirun outlives this process: 'fab runs' concludes the run if it is gone by then
        record.detached, record.remote_run, record.remote_output = True, r.remote_run, r.remote_output
        command = detach.followed_command(r.remote_run, detach.wrapper_command(
            r.remote_run, str(Path(mpirun).parent), launcher.shell_join(argv), master.node.python,
            f"{master.home}/code/{digest}", bool(plan.secret_env)))
    r.started()  # 'fab runs' lists it while it goes on
    if recovery:
        recovery.launched()
    say(f"launching {plan.world_size} rank(s) with mpirun on {master.node.name}")
    started = time.monotonic()
    exit_code = 1
    mirror = None
    if r.is_job and not req.store:  # [store] with a store, nothing is mirrored home
        mirror = outputs.CheckpointMirror(master.node, r.run_dir, r.remote_output, req.fetch_model)
        mirror.start()
    with (r.run_dir / "log.txt").open("w") as log_file:
        router = OutputRouter(plan, out, log_file, on_event=recovery.hook(r.run_dir, record) if recovery else None)
        ctrl_c = CtrlC(nodes, plan.run_id, say)
        watch = Watchdog(nodes, plan.run_id, lambda: cleanup(nodes, plan.run_id))
        try:
            with ctrl_c, watch, connect(master.node) as conn:
                ctrl_c.conn = conn
                res = conn.run(command, hide=False, warn=True, pty=False, in_stream=False,
                               out_stream=router, err_stream=router)
                exit_code = res.exited
        except Exception as exc:  # noqa: BLE001
            # node 0 gone mid-run, or the output reader broke: a failed run like any other (clean-up, summary)
            if not ctrl_c.pressed:
                router.write(f"\nlost the connection to {master.node.name}: {type(exc).__name__}: {exc}\n")
            exit_code = -1
        except KeyboardInterrupt:
            router.flush_rest()
            say("interrupted: stopping every rank")
            swept = cleanup(nodes, plan.run_id)
            say(f"run {plan.run_id} interrupted: {swept.claim()}")
            r.write(Status.INTERRUPTED, 130, time.monotonic() - started, cleanup=swept.to_dict())
            raise
        finally:
            router.flush_rest()
            if plan.secret_env:
                secrets.forget([(f.node, RunPaths(plan.run_id, f.home).node) for f in facts])
            if mirror:
                mirror.stop()
            # every ending brings the output home; after Ctrl-C without the weights (the user asked to stop)
            _bring_home(master, r.run_dir, r.remote_output, req.but(fetch_model=False)
                        if ctrl_c.pressed else req, say)
    return end(r, Outcome(exit_code, router.lines, router.finished, time.monotonic() - started,
                          watch.failure, bool(ctrl_c.pressed), router.noticed_at), say)


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
    resume = Path(req.resume.checkpoint) if req.resume and req.resume.checkpoint else None  # [store]: None
    held = req.spec.what.snapshot if req.store else None

    def stage(node: Node):
        i = nodes.index(node)
        what = req.spec.what
        return _stage(facts[i], plan, plan.nodes[i], digest, tarball, ship, what.script, i == 0, hostfile, resume,
                      what.pylayer, held)

    staged = fan_out(nodes, stage, "staging the run")
    if held:
        log.info(snapshot.fetched_line(held, [n.name for n in nodes], [sent for _, sent in staged]))
    elif plan.workdir is not None:
        log.info(workdir.shipped_line(plan.workdir, [n.name for n in nodes], [sent for _, sent in staged]))
    return ks.ssh_dir, digest


class CtrlC:
    """One Ctrl-C ends the run: the ranks are killed on every node, so mpirun ends within seconds, and the
    run is recorded as interrupted; a second one stops waiting for mpirun. (invoke only forwards it to a
    terminal the command does not have, and keeps waiting for the end of training.)"""

    def __init__(self, nodes: list[Node], run_id: str, say):
        self.nodes, self.run_id, self.say = nodes, run_id, say
        self.pressed = 0
        self.conn = None
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # doctor runs jobs from a worker thread
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum, frame) -> None:
        self.pressed += 1
        if self.pressed == 1:
            self.say("interrupted: stopping every rank (Ctrl-C again to stop waiting for mpirun)")
            threading.Thread(target=cleanup, args=(self.nodes, self.run_id), name="ctrl-c", daemon=True).start()
        elif self.conn is not None:
            self.conn.close()


def _remote_output_dir(master: NodeFacts, plan: launcher.LaunchPlan, args: list[str]) -> str:
    return userscript.remote_output_dir(RunPaths(plan.run_id, master.home).node, args, plan.workdir is not None)


def _bring_home(master: NodeFacts, run_dir: Path, remote_out: str, req: TrainRequest, say) -> None:
    """The job's output_dir into runs/<id>/output/, whatever the run's ending; never raises."""
    try:
        copied = outputs.fetch_output(master.node, remote_out, run_dir / "output", req.fetch_model, say)
        if copied:
            say(f"outputs: {len(copied)} file(s) from {master.node.name} in {run_dir / 'output'}"
                + ("" if req.fetch_model else " (model weights left on the node: --no-fetch-model)"))
    except Exception as exc:  # node 0 gone: what came home while the run went on is what there is
        log.warning("could not bring the outputs home from %s: %s", master.node.name, exc, exc_info=log.isEnabledFor(logging.DEBUG))


# The demo's job flags: small enough for a 2-core machine, long enough to learn the task.
DEMO_ARGS = ["--num_train_epochs", "2", "--per_device_train_batch_size", "8", "--learning_rate", "1e-4",
             "--max_train_samples", "800", "--seed", "42"]


def demo(nodes: int = 2, port: int | None = None, out: TextIO = sys.stdout) -> RunResult:
    """Local cluster up, fine-tune on the bundled paraphrase set, cluster down (even on failure)."""
    req = TrainRequest.of(nodes=nodes, job="glue", args=list(DEMO_ARGS))
    store = store_run.store_lib.choose(None, None, "local")  # [store] XC_STORE, else the local folder: no server
    req = store_run.apply(req, store, "local")
    req = validate(req)  # an unwritable runs folder is refused before any sshd starts
    already = (local.state_dir() / "state.json").exists()
    local.up(nodes, **({"port": port} if port else {}))
    try:
        store_run.store_lib.check(store, "local")
        out.write(store.line() + "\n")
        result = train(resolve.open_cluster("local"), req, out)
        out.write(result_line(result) + "\n")
        return result
    finally:
        if not already:
            local.down()
            out.write("local cluster stopped\n")
