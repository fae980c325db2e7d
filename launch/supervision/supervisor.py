"""`fab train --detach --max-restarts K`: the run's supervisor (the restart loop, the watchdog, the
checkpoint mirror: what an attached fab does) as a process of its own, in a session of its own, so it
outlives the operator's terminal and fab itself (kill -9 included). fab starts it, hands it the resolved
request on a pipe (secret --env values never touch a disk), waits until the first run's ranks run, prints
the run id and returns. The supervisor writes its pid into every run record it runs (`supervisor`), so
`fab runs`, `fab logs -f` and `fab stop` find it again; its own output goes to runs/.supervisors/<id>.log.

Run as `python -m launch.supervision.supervisor` (stdin: the pickled job)."""
from __future__ import annotations

import base64
import dataclasses
import io
import logging
import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from cluster import aws, keys, local, mesh, remote, resolve, shipping
from cluster.node import Node
from cluster.resolve import Cluster
from core.constants import PROJECT_ROOT
from core.errors import ClusterError, format_error
from launch.life import head, records
from launch.life.cleanup import runs_alive
from launch.life.records import Status, result_line
from launch.plan.request import new_run_id
from launch.staging import run_secrets
from launch.supervision import adopt, restarts
from training.runtime import spot
from training.runtime.paths import RunPaths
from training.runtime.spec import RunSpec

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900  # staging, probing and the ranks' start on a loaded machine
FOLDER = ".supervisors"


def detached(cluster, r, out: TextIO) -> bool:
    """`fab train --detach`: on a cluster with a head every detached run is supervised there (--max-restarts 0
    included); without one this machine keeps the role (one line says so): a supervised run's supervisor starts
    here, a plain detached run is left to the caller (node 0's wrapper). True when the run was started."""
    restarts.refuse_base_image(cluster, r.max_restarts)  # here, before a supervisor starts anywhere
    restarts.check_min_nodes(cluster, r.req)
    why = head.stays_here(cluster.head, r.req, asked=r.no_head)
    if why is None:
        start_on_head(cluster, r.req, out)
        return True
    out.write(head.no_head_line(cluster.spec, cluster.head, r.supervised, why) + "\n")
    if r.supervised:
        start(cluster.spec, r.req, out)
    return r.supervised


def start_on_head(cluster, req, out: TextIO) -> str:
    """Start the run's supervisor on the cluster's head, over SSH, and return once its first run's ranks run:
    the resolved request goes as one base64 line on the session's stdin (secrets stay in memory, on both ends);
    on the head `--on-head` starts it in a session of its own with XC_SUPERVISOR=<run id>, shows the plan lines
    here, and ends. It runs from the head's own copy of the project's code (shipping.HEAD_SHIPPED under
    <head home>/code/<hash>, shipped once per revision), not from this checkout. Nothing of the run is left on this
    machine."""
    label = "script" if req.spec.what.own else req.spec.what.job
    req = req.but(run_id=req.run_id or new_run_id(label), detach=False)
    secret_env = run_secrets.of_request(req)
    # on an AWS head: kept in SSM for a head that takes the chain over (run_secrets); a local head has none
    secrets_at = cluster.head.labels.get("aws_head") if secret_env else None
    job = base64.b64encode(payload(cluster.spec, req, secrets_at)).decode()
    env = {head.HEAD_ENV: cluster.head.name, **{k: os.environ[k] for k in ("XC_DEBUG", "XC_HEARTBEAT_S",
                                                                           "XC_PUBLISH_S") if os.environ.get(k)}}
    if cluster.spec.split(":")[0] == "local":  # how a local cluster is found: its state folder on this one machine
        env["XC_STATE_DIR"] = str(local.state_dir().parent)
    if cluster.head.labels.get("aws_head"):
        _mesh_key_to_ssm(cluster)
    try:
        conn = remote.connect(cluster.head)
    except ClusterError as exc:  # nothing sent yet: no run folder, no process anywhere
        raise ClusterError(f"the head {cluster.head.name} does not answer ({exc.what}): run {req.run_id} was not "
                           "started", fix="check the head with 'fab status' and 'fab doctor', or pass --no-head to "
                           "supervise from this machine") from None
    digest = shipping.code_hash(tops=shipping.HEAD_SHIPPED)
    tarball = shipping.code_tarball(tops=shipping.HEAD_SHIPPED)
    env["XC_CODE_DIGEST"] = digest
    if cluster.head.labels.get("aws_head") and req.store:  # what a replacement head takes the chain over with
        adopt.put_code(req.store, digest, tarball)
    with conn:
        code = shipping.ensure_code(conn, remote.remote_home(conn), digest, tarball)
        command = (f"cd {shlex.quote(code)} && exec env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
                   + f" {shlex.quote(cluster.head.python)} -m launch.supervision.supervisor --on-head")
        if secrets_at:
            run_secrets.put(secrets_at, req.run_id, secret_env)
        res = None
        try:
            res = conn.run(command, warn=True, pty=False, hide=False, in_stream=io.StringIO(job + "\n"),
                           out_stream=out, err_stream=out)
        finally:
            if res is None or res.exited != 0:  # no supervisor to delete them at the chain's end
                run_secrets.delete(secrets_at, req.run_id, sorted(secret_env))
    if res.exited != 0:
        raise ClusterError(f"run {req.run_id}: its supervisor did not start on the head {cluster.head.name} "
                           f"(exit {res.exited})", fix="see the lines above; 'fab status' shows the head")
    return req.run_id


def _mesh_key_to_ssm(cluster) -> None:
    """An AWS head reaches the nodes with the cluster's key, which it reads from SSM (cluster.mesh): put it there, and
    authorize it on the nodes, before the head is asked to start anything."""
    key, _ = keys.cluster_key(cluster)
    mesh.publish(cluster.head.labels["aws_head"], key)
    keys.setup_keys(cluster)


def _aws_head_env(spec: str) -> None:
    """On an AWS head: boto3's region from the head's cluster.env (cloud-init's), and the mesh key from SSM as this
    cluster's key in the head's own state folder (XC_SSH_KEY): what fab's SSH to the nodes uses."""
    conf = spot.cluster_env()
    if conf.get("XC_REGION"):
        os.environ.setdefault("AWS_REGION", conf["XC_REGION"])
    os.environ[aws.ADDRESS_ENV] = "private"  # inside the VPC: the nodes admit the head's group on private addresses
    name = spec.partition(":")[2] or conf.get("XC_CLUSTER", "")
    state = local.state_dir().parent / resolve.aws_state_name(name)
    comment = f"xeon-cluster {Cluster(spec=spec, nodes=(), state=state).name}"  # as cluster.keys.cluster_key writes it
    os.environ["XC_SSH_KEY"] = str(mesh.fetch(name, state, comment))


def on_head() -> int:
    """On the head: the job from stdin's one line; the runs under this machine's work root; the supervisor started
    with XC_SUPERVISOR=<run id> (start below), its plan lines printed until its ranks run."""
    job = pickle.loads(base64.b64decode(sys.stdin.readline()))
    req = dataclasses.replace(job["req"], runs_dir=head.runs_here())
    os.environ["XC_RUNS_DIR"] = str(req.runs_dir)
    try:
        if job["spec"].split(":")[0] == "aws":
            _aws_head_env(job["spec"])
        start(job["spec"], req, sys.stdout, env={head.ENV: req.run_id},
              secrets_at=job.get("secrets_at"))
    except ClusterError as exc:
        sys.stdout.write(format_error(exc) + "\n")
        return exc.exit_code
    return 0


def start(spec: str, req, out: TextIO, env: dict | None = None, secrets_at: str | None = None) -> str:
    """Start the supervisor; return once the first run's ranks all run (its id), or raise what stopped it."""
    folder = Path(req.runs_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    job = payload(spec, req, secrets_at)
    with log_path.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.supervision.supervisor"], cwd=PROJECT_ROOT, stdin=subprocess.PIPE,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    proc.stdin.write(job)
    proc.stdin.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    run_id, shown = None, 0
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        for line in text[shown:].splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            shown += len(line)
            if run_id is None:
                m = re.match(r"run (\S+): results in ", line)
                run_id = m.group(1) if m else None
                where = os.environ.get(head.HEAD_ENV)  # the folder named is the head's, not the operator's
                out.write(f"{line.rstrip()} on the head {where}; 'fab pull {run_id}' brings them to you\n"
                          if run_id and where else line)  # the plan and staging lines, as an attached run shows them
        out.flush()
        if run_id and _ranks_running(RunPaths(run_id, runs_dir=req.runs_dir).home):
            restarts_allowed = req.spec.recovery.max_restarts
            out.write(detached_line(run_id, proc.pid, restarts_allowed, os.environ.get(head.HEAD_ENV)) + "\n")
            return run_id
        if proc.poll() is not None:
            last = [ln for ln in text.splitlines() if ln.strip()]
            if proc.returncode == 0 and run_id:  # a short run ended before we looked
                out.write((last[-1] if last else f"run {run_id} ended") + "\n")
                return run_id
            why = last[-1] if last else f"it exited {proc.returncode}"
            raise ClusterError(f"the run's supervisor ended before its ranks ran: {why.removeprefix('error: ')}",
                               f"see {log_path}")
        time.sleep(0.5)
    raise ClusterError(f"the run's supervisor (pid {proc.pid}) did not start the ranks within {START_TIMEOUT_S}s",
                       f"see {log_path}; end it with 'fab stop {run_id}'" if run_id else f"see {log_path}")


def detached_line(run_id: str, pid: int, max_restarts: int, on_head: str | None) -> str:
    """The line `fab train --detach` ends with: where the run is supervised, and whether this machine may close."""
    follow = (f"follow it with 'fab logs {run_id} -f', list runs with 'fab runs', end it with 'fab stop {run_id}'")
    if on_head:
        return (f"run {run_id} detached under its supervisor on the head {on_head} (pid {pid}, up to {max_restarts} "
                f"restart(s)): this machine may close now (the head supervises the run without it); {follow}")
    return (f"run {run_id} detached under its supervisor (pid {pid}, up to {max_restarts} restart(s)) on this "
            f"machine: keep it on and online for recovery (closed, the run trains on but is not restarted); {follow}")


def payload(spec: str, req, secrets_at: str | None = None) -> bytes:
    """What the supervisor is handed on its stdin. What validate() found stays here (a scanned --workdir holds
    a lock): the supervisor, a process of its own, checks the request once itself. `secrets_at`: the cluster under
    whose SSM path fab put the chain's secrets (launch.staging.run_secrets)."""
    return pickle.dumps({"spec": spec, "req": req.but(checked=None), "secrets_at": secrets_at})


def _ranks_running(run_dir: Path) -> bool:
    rec = records.load_or_none(run_dir)
    if rec is None or rec.status != Status.RUNNING or not rec.nodes:
        return False
    nodes = [Node(**n) for n in rec.nodes]
    alive = runs_alive(nodes).get(rec.run_id, {})
    return all(alive.get(n.name, 0) >= int(rec.ppn or 1) for n in nodes)


def main() -> int:
    logging.basicConfig(level=logging.DEBUG if os.environ.get("XC_DEBUG") else logging.INFO, format="%(message)s",
                        stream=sys.stdout)
    for noisy in ("paramiko", "invoke", "fabric", "botocore", "boto3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to end
    if sys.argv[1:] == ["--on-head"]:
        return on_head()
    if sys.argv[1:2] == ["--adopt"]:
        return adopted(sys.argv[2])
    job = pickle.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    chain, req = os.environ.get(head.ENV), job["req"]
    kept = bool(chain and req.store and job["spec"].startswith("aws") and os.environ.get("XC_CODE_DIGEST"))
    if chain:  # on a head: its records, log and heartbeat reach the store while it lives
        head.Beat(chain, req.runs_dir, req.store).start()
    if kept:
        adopt.save_job(req.store, chain, job["spec"], req, os.environ["XC_CODE_DIGEST"], job.get("secrets_at"))
    try:
        result = restarts.train_with_restarts(resolve.open_cluster(job["spec"]), req.but(wrapped=True))
    except ClusterError as exc:
        sys.stdout.write(format_error(exc) + "\n")
        return exc.exit_code
    finally:
        if kept:
            adopt.drop_job(req.store, chain)
        run_secrets.delete(job.get("secrets_at"), chain or req.run_id, sorted(run_secrets.of_request(req)))
    sys.stdout.write(result_line(result) + "\n")
    return 0


def adopted(chain: str) -> int:
    """`--adopt CHAIN`, started by launch.supervision.adopt on a head that replaced the chain's: follow its newest run to
    its end, then go on with the chain's restart loop (the restarts it has left)."""
    url = adopt.head_store()
    job = adopt.load_job(url, chain) if url else None
    if job is None:
        sys.stdout.write(f"error: chain {chain}: no supervisor.json in the store {url or '(none)'}: nothing to adopt\n")
        return 1
    _aws_head_env(job["spec"])
    runs_dir = head.runs_here()
    os.environ["XC_RUNS_DIR"] = str(runs_dir)
    head.Beat(chain, runs_dir, url).start()
    try:
        cluster = resolve.open_cluster(job["spec"], require_running=None)  # the nodes' host keys, recorded on this head

        def members() -> set[str]:  # node 0 no longer among them: gone, a lost node for the restart loop
            return {adopt.node_id(n) for n in resolve.open_cluster(job["spec"], require_running=None).nodes}

        rec, ids = adopt.pending_outcome(url, chain, runs_dir, sys.stdout, members)
        ended = adopt.as_exception(rec)
        policy = RunSpec.from_json(rec.spec).recovery  # the chain's, as its record keeps it
        left = policy.max_restarts - (len(ids) - 1)
        if ended is None or left <= 0:
            sys.stdout.write(f"run {rec.run_id} {rec.status}: the chain is over\n")
            return 0 if rec.status == Status.OK else 1
        values = adopt.kept_secrets(job)
        if values is None:
            run_dir = RunPaths(rec.run_id, runs_dir=runs_dir).home
            records.restarting(run_dir, len(ids), policy.max_restarts, str(ended.what))
            records.restart_given_up(run_dir, "a head replacement lost the values of its secrets (" +
                                     ", ".join(job["secrets"]) + "): 'fab train --resume " + rec.run_id + "' gives them again")
            sys.stdout.write(f"run {rec.run_id}: not restarted: a head replacement lost the values of its secrets\n")
            return 1
        req = adopt.adopted_request(url, job, rec, runs_dir, values)
        result = restarts.train_with_restarts(cluster, req, ended=ended, restarts_done=len(ids) - 1)
    except ClusterError as exc:
        sys.stdout.write(format_error(exc) + "\n")
        return exc.exit_code
    finally:
        adopt.drop_job(url, chain)
        run_secrets.delete(job.get("secrets_at"), chain, list(job.get("secrets") or ()))  # the chain is over
    sys.stdout.write(result_line(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
