"""The head: the machine next to the nodes that runs detached runs' supervisors, so that recovery
never needs the operator's machine. A supervisor there carries XC_SUPERVISOR=<its chain's first run id> in its
environment (how `fab stop` and the liveness check find it over SSH), publishes what changed of the records and
log of the runs it runs to the store every few seconds (the log in appended parts), and a heartbeat (runs/<id>/heartbeat.json) every 30 s; `fab runs`,
`fab logs` and `fab stop` read the store, so any operator machine with access to it and to the head sees the same.

A local cluster's head shares this machine's venv; the supervisor is started over SSH in a session of its own
(setsid), from the head's own copy of the code (cluster.shipping.HEAD_SHIPPED under its home, by content hash). An AWS head would run it as a systemd unit: `systemd_argv` builds that command; it is not run here.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import threading
import time
from pathlib import Path

from cluster import store as store_lib
from cluster.node import Node
from cluster.remote import connect, run
from core.constants import REMOTE_HOME
from core.errors import ClusterError
from launch.life import records
from launch.life.records import RunRecord, Status
from launch.plan import request
from training.runtime import spot
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)

ENV = "XC_SUPERVISOR"  # the chain's first run id, in the supervisor's environment
HEAD_ENV = "XC_HEAD"  # the head's name, in the supervisor's environment (records.this_process reads it)
HEARTBEAT = "heartbeat.json"
STALE_BEATS = 4  # a heartbeat older than this many intervals is stale
JOB = "supervisor.json"  # in the store while an AWS head supervises the chain: a new head takes it over at boot
BOOT_GRACE_S = 300.0  # a head up for less than this may not have reached its boot-time take-over yet


def heartbeat_s() -> float:
    return float(os.environ.get("XC_HEARTBEAT_S") or 30)


def publish_s() -> float:
    """How often a running run's log.txt (and record) reaches the store between transitions."""
    return float(os.environ.get("XC_PUBLISH_S") or 5)


def runs_here() -> Path:
    """The runs folder of this machine's work root: where a head's supervisors keep their runs."""
    return RunPaths.runs_under(os.environ.get("XC_HOME") or Path.home() / REMOTE_HOME)


def runs_on_head(head: Node | None) -> bool:
    """Whether detached runs' supervisors run on this head: a local head shares this machine's venv, an AWS head has
    the venv at REMOTE_PYTHON (the code is shipped to both); a hosts file's head would need a venv with the operator's
    packages (not built), and then this machine keeps the role."""
    return head is not None and bool(head.labels.get("local") or head.labels.get("aws_head"))


# What a supervisor imports beyond the standard library (node_setup/profiles.toml gives the baked venv all of them;
# packaging comes with transformers).
SUPERVISOR_IMPORTS = "import boto3, fabric, invoke, jinja2, packaging, paramiko, yaml"


def lacks_venv(node: Node) -> bool:
    """An AWS head boots the nodes' baked AMI with image=bake (infra/head.py), stock Ubuntu otherwise: without a venv
    at node.python (the twin's head has this machine's), it cannot run a supervisor, and this machine keeps the role. A head that does not answer is not judged here: starting
    the supervisor there says so."""
    if not node.labels.get("aws_head"):
        return False
    try:
        with connect(node) as conn:
            return not run(conn, f"{shlex.quote(node.python)} -c {shlex.quote(SUPERVISOR_IMPORTS)}",
                           purpose="the head's venv").ok
    except ClusterError:
        return False


def files_here(node: Node, req) -> str | None:
    """What of the request an AWS head cannot read: --workdir, --script and data files are on this machine, and only
    a local head shares its disk; once `fab train` put them in the store as the run's snapshot (launch.staging.snapshot),
    nothing: the head, and every node, takes them from there."""
    what = req.spec.what
    if not node.labels.get("aws_head") or what.snapshot:
        return None
    named = [f"--workdir {what.workdir}"] if what.workdir else [f"--script {what.script}"] if what.script else []
    named += [f"{flag} {path}" for flag, path in request.local_files(what.args)]
    return ", ".join(named) or None


def stays_here(node: Node | None, req, asked: bool = False) -> str | None:
    """Why this machine supervises a detached run although the cluster may have a head; None: the head does."""
    if asked:
        return "--no-head was given"
    if node is None:
        return "it has no head"
    if not runs_on_head(node) or lacks_venv(node):
        return f"its head {node.name} has no venv with the operator's packages to run a supervisor"
    here = files_here(node, req)
    return f"its head {node.name} cannot read {here} from this machine" if here else None


def no_head_line(spec: str, head: Node | None, supervised: bool = False, why: str | None = None) -> str:
    why = why or ("it has no head" if head is None else
                  f"its head {head.name} has no venv with the operator's packages to run a supervisor")
    hint = ("'fab local-up' starts a local head" if head is None or not head.labels.get("aws_head") else
            f"an AWS head needs the project's venv at {head.python}: image=bake gives it the nodes' baked AMI"
            if "venv" in why else
            "with a store, fab train puts them there as the run's snapshot, which the head reads")
    if supervised:
        return (f"note: cluster {spec}: {why}, so this machine supervises the run: its ranks run under node 0's own "
                "wrapper, so closing this machine pauses recovery (no restart after a preemption until it is back) "
                f"but does not end the run; 'fab runs' concludes it ({hint})")
    return (f"note: cluster {spec}: {why}, so this machine ends and recovers the detached run: keep it on and "
            f"online ({hint})")


# -- on the head: the heartbeat and the log, published while the supervisor lives -------------------------------
def own_instance() -> str | None:
    """This head's EC2 instance id (cloud-init's cluster.env), None off AWS: a new head that sees the heartbeat's
    instance gone takes the chain over at once instead of waiting for the beat to go stale."""
    return spot.cluster_env().get("XC_INSTANCE_ID") or None


class Beat(threading.Thread):
    """Every publish_s: what changed of the records and log.txt of every run this process supervises that still
    goes on (store_lib.LivePublisher: the log in appended parts); every heartbeat_s: runs/<id>/heartbeat.json for
    those runs and the chain's first run."""

    def __init__(self, chain: str, runs_dir: Path, url: str | None):
        super().__init__(name="heartbeat", daemon=True)
        self.chain, self.runs_dir, self.url = chain, Path(runs_dir), url
        self.stopping = threading.Event()
        self.live = store_lib.LivePublisher(url) if url else None
        self.last_beat: float | None = None

    def mine(self) -> list[RunRecord]:
        out = []
        for folder in sorted(self.runs_dir.iterdir()) if self.runs_dir.is_dir() else []:
            rec = records.load_or_none(folder) if (folder / "summary.json").is_file() else None
            if rec and (rec.supervisor or {}).get("pid") == os.getpid() and not rec.status.terminal:
                out.append(rec)
        return out

    def beat(self, current: list[RunRecord]) -> None:
        data = json.dumps({"at": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                           "head": os.environ.get(HEAD_ENV), "instance": own_instance(), "chain": self.chain,
                           "interval_s": heartbeat_s(), "current": [r.run_id for r in current]}).encode()
        for run_id in {self.chain, *(r.run_id for r in current)}:
            store_lib.put_record(self.url, run_id, HEARTBEAT, data)

    def tick(self, now: float) -> None:
        """One round at monotonic time ``now``: publish what changed; beat when heartbeat_s has passed."""
        current = self.mine()
        for rec in current:
            if self.live is not None:
                self.live.publish(RunPaths(rec.run_id, runs_dir=self.runs_dir).home)
        if self.last_beat is None or now - self.last_beat >= heartbeat_s():
            self.beat(current)
            self.last_beat = now

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.tick(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - a store hiccup never ends the supervisor
                log.debug("heartbeat: %s", exc)
            self.stopping.wait(publish_s())


# -- from the operator: finding, judging and ending a supervisor on the head -----------------------------------
def pids_command(chain: str) -> str:
    """Shell: the pids of processes whose environment holds XC_SUPERVISOR=<chain> (NUL-separated entries)."""
    return (f"grep -lzx {shlex.quote(f'{ENV}={chain}')} /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; true")


def supervisors_on(head: Node, chain: str) -> list[int] | None:
    """The head's processes carrying XC_SUPERVISOR=<chain>; None when the head does not answer."""
    try:
        with connect(head) as conn:
            res = run(conn, pids_command(chain), timeout=30)
    except ClusterError as exc:
        log.warning("the head %s did not answer: %s", head.name, exc.what)
        return None
    return [int(w) for w in res.stdout.split() if w.isdigit()] if res.ok else None


def boot_state(head: Node) -> tuple[float, bool] | None:
    """(seconds the head has been up, whether its boot-time take-over, launch.supervision.adopt, runs now); None when the
    head does not answer. The pattern's brackets keep the shell that greps from matching itself."""
    try:
        with connect(head) as conn:
            res = run(conn, "cut -d' ' -f1 /proc/uptime; grep -lz 'launch[.]chain[.]adopt' /proc/[0-9]*/cmdline "
                            "2>/dev/null | head -1; true", timeout=30)
    except ClusterError as exc:
        log.warning("the head %s did not answer: %s", head.name, exc.what)
        return None
    lines = res.stdout.split() if res.ok else []
    try:
        return float(lines[0]), len(lines) > 1
    except (IndexError, ValueError):
        return None


def end_on(head: Node, chain: str, wait_s: float = 15.0) -> list[int]:
    """SIGTERM to the supervisor of chain on the head (so it starts no restart), then wait for it to be gone;
    returns the pids it had. Raises ClusterError when the head does not answer."""
    pids = supervisors_on(head, chain)
    if pids is None:
        raise ClusterError(f"the head {head.name} did not answer: the supervisor of {chain} may still run there",
                           fix=f"check the head ('fab status'), then run 'fab stop {chain}' again")
    if pids:
        words = " ".join(map(str, pids))
        with connect(head) as conn:
            run(conn, f"kill -TERM {words} 2>/dev/null; for i in $(seq {int(wait_s * 10)}); do "
                      f"alive=; for p in {words}; do [ -e /proc/$p ] && alive=1; done; [ -z \"$alive\" ] && break; "
                      "sleep 0.1; done; true", timeout=wait_s + 30)
    return pids


def heartbeat(url: str, chain: str) -> dict | None:
    try:
        text = store_lib.read_text(url, RunPaths(chain).store_record(HEARTBEAT))
        return json.loads(text) if text else None
    except (ClusterError, ValueError):
        return None


def judge(rec: RunRecord, url: str, head: Node | None, runs_dir: Path, now: float | None = None
          ) -> tuple[RunRecord, str]:
    """A store record of a run a head's supervisor ends, as it stands: (record, note). A heartbeat older than
    STALE_BEATS intervals is reported; the run is recorded abandoned only when the head confirms that no process
    carries its XC_SUPERVISOR."""
    sup = rec.supervisor or {}
    if rec.status not in (Status.RUNNING, Status.RESTARTING) or not sup.get("head"):
        return rec, ""
    chain = sup.get("chain") or rec.run_id
    beat = heartbeat(url, chain)
    at = float(beat["at"]) if beat else float(rec.started_at or 0)
    interval = float(beat.get("interval_s", heartbeat_s())) if beat else heartbeat_s()
    age = (now or time.time()) - at
    if age <= STALE_BEATS * interval:
        return rec, ""
    said = f"no heartbeat from its supervisor on {sup['head']} for {age:.0f}s"
    if head is None or head.name != sup["head"]:
        return rec, f"{said}; its head is not this cluster's, so it is not judged from here"
    silent = f"{said}; the head did not answer, so it is not recorded abandoned"
    found = supervisors_on(head, chain)
    if found is None:
        return rec, silent
    if found:
        return rec, f"{said}, but the head still runs it (pid {', '.join(map(str, found))})"
    if store_lib.read_text(url, RunPaths(chain).store_record(JOB)):  # an AWS head's chain, never ended
        boot = boot_state(head)
        if boot is None:
            return rec, silent
        if boot[1] or boot[0] < BOOT_GRACE_S:
            return rec, (f"{said}; the head came up {boot[0]:.0f}s ago and takes such chains over at boot, so it is "
                         "not recorded abandoned")
    records.abandoned(RunPaths(rec.run_id, runs_dir=runs_dir).home, rec,
                      {"found": f"no process with {ENV}={chain} on the head {head.name}; {said}", "unchecked": {}})
    return rec, f"{said}; the head runs no supervisor of it: recorded abandoned"


def systemd_argv(run_id: str, python: str, project: str, env: dict[str, str]) -> list[str]:
    """What an AWS head would run instead of setsid (built and tested, not run here): a transient unit per
    chain, restarted if the supervisor crashes, stopped by `systemctl stop xc-run-<id>` (SIGTERM, as fab stop
    sends). The job on its stdin would carry no secret values: on AWS the head's role reads them from SSM
    Parameter Store under the cluster's path. A transient unit does not survive a reboot of the head."""
    return ["systemd-run", "--unit", unit(run_id), "--collect", "--property=Restart=on-failure",
            "--property=KillMode=mixed", f"--working-directory={project}",
            *(f"--setenv={k}={v}" for k, v in sorted({**env, ENV: run_id}.items())),
            python, "-m", "launch.supervision.supervisor"]


def unit(run_id: str) -> str:
    return f"xc-run-{run_id}"
