"""A head is cattle: a replacement head takes over the chains the one before it supervised.

While a supervisor runs on a head it keeps `runs/<chain>/supervisor.json` in the store: what another head needs to
go on with the chain (the cluster, the restart budget, the elastic policy, the code's digest; never a secret's
value). fab puts the supervisor's code into the store too (`code/<digest>.tar.gz`). A head at boot
(`node_setup/head_boot.py`, from its user data) fetches that code and runs `python -m launch.supervision.adopt`, which
starts a supervisor `--adopt CHAIN` for every chain whose newest run is not over and whose heartbeat is stale, and
never a second one for a chain a live process here already supervises. The adopted supervisor follows the run the
ranks still run (under node 0's wrapper), concludes it, and restarts it as the first supervisor would have; node 0
gone by then (reclaimed between two heads) is a lost node, as it would have been to the first supervisor.
A run given secrets (`--env KEY`) is restarted by another head with their values from SSM, where fab kept them
(launch.staging.run_secrets); where they are gone, it is not, and the record says so. A run of the user's own code
(--workdir, --script, data files) is restarted from the snapshot its record names in the store (launch.staging.snapshot,
a separate object from the supervisor's code): the adopted supervisor reads its list of files there, and every node
fetches it from there at staging, so nothing of the operator's machine, nor the folder as it was, is needed.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cluster import store as store_lib
from cluster.node import Node
from core.ec2 import ec2_client
from core.errors import ClusterError, NodeFailure, Preempted, Unreachable
from launch.life import detach, head, records
from launch.life.lifecycle import Outcome, Run, end
from launch.life.records import RunRecord, Status
from launch.plan.request import TrainRequest
from launch.staging import run_secrets, secrets
from training.runtime import spot, store
from training.runtime.paths import RunPaths
from training.runtime.spec import RunSpec

log = logging.getLogger(__name__)

JOB = head.JOB
CODE = "code"  # the store's folder of supervisor code tarballs, by digest
POLL_S = 5.0
GONE_LOOKS = 3  # node 0 unreachable this many looks in a row (POLL_S apart) is gone: reclaimed while no head ran
MAX_WAIT_S = 900.0  # a chain whose heartbeat stays fresh this long has a live supervisor elsewhere


def code_key(digest: str) -> str:
    return f"{CODE}/{digest}.tar.gz"


def put_code(url: str, digest: str, tarball: bytes) -> None:
    store_lib.put_once(url, code_key(digest), tarball)


def save_job(url: str, chain: str, spec: str, req, digest: str, secrets_at: str | None = None) -> None:
    """`secrets`: the names of the chain's secret --env values and arguments (a record keeps them masked);
    `secrets_at`: the cluster under whose SSM path fab keeps their values (launch.staging.run_secrets), if it did."""
    job = {"chain": chain, "spec": spec, "secrets": sorted(run_secrets.of_request(req)), "secrets_at": secrets_at,
           "code": digest}  # the recovery policy is in the runs' records (their RunSpec), not here
    store_lib.put_record(url, chain, JOB, json.dumps(job, indent=2).encode())


def drop_job(url: str, chain: str) -> None:
    store_lib.delete_record(url, chain, JOB)


def load_job(url: str, chain: str) -> dict | None:
    text = store_lib.read_text(url, RunPaths(chain).store_record(JOB))
    return json.loads(text) if text else None


def newest(url: str, chain: str) -> tuple[list[str], dict | None]:
    """The chain's run ids, first to newest (through restarted_as), and the newest run's summary."""
    ids, summary = [], None
    run_id = chain
    while run_id and run_id not in ids:
        got = store_lib.read_summary(url, run_id)
        if got is None:
            break
        ids.append(run_id)
        summary, run_id = got, got.get("restarted_as")
    return ids, summary


def live_chains(url: str) -> list[str]:
    """Chains with a job in the store whose newest run goes on or waits to restart."""
    out = []
    for chain in store_lib.run_ids(url):
        if load_job(url, chain) is None:
            continue
        _, summary = newest(url, chain)
        if summary and summary.get("status") in (Status.RUNNING, Status.RESTARTING):
            out.append(chain)
    return out


def stale(url: str, chain: str, now: float | None = None) -> float:
    """Seconds until the chain's heartbeat is stale (0: it is, or there is none, or the instance that beat is gone:
    a replaced head's successor need not wait STALE_BEATS intervals, two minutes at the default 30 s, for it)."""
    beat = head.heartbeat(url, chain)
    if not beat:
        return 0.0
    if beat.get("instance") and beat["instance"] != head.own_instance() and instance_gone(beat["instance"]):
        return 0.0
    interval = float(beat.get("interval_s", head.heartbeat_s()))
    return max(0.0, float(beat["at"]) + head.STALE_BEATS * interval - (now or time.time()))


GONE = ("shutting-down", "terminated", "stopping", "stopped")


def instance_gone(instance: str) -> bool:
    """EC2 says the instance is gone or going (or knows it no more); False where it cannot tell (then the stale
    wait decides)."""
    try:
        found = ec2_client(spot.cluster_env().get("XC_REGION") or None).describe_instances(InstanceIds=[instance])
    except Exception as exc:  # noqa: BLE001
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        return code == "InvalidInstanceID.NotFound"
    states = [i["State"]["Name"] for r in found["Reservations"] for i in r["Instances"]]
    return not states or all(s in GONE for s in states)


def supervised_here(chain: str) -> bool:
    """A process on this machine carries XC_SUPERVISOR=<chain> (what fab stop looks for on a head)."""
    res = subprocess.run(["sh", "-c", head.pids_command(chain)], capture_output=True, text=True, check=False)
    return bool(res.stdout.split())


def node_id(node: Node) -> str:
    """What names a node across discoveries: its instance (an AWS node's name is its position), else its name."""
    return node.labels.get("instance_id") or node.name


def listed(node: Node, members: Callable[[], set[str]] | None) -> bool | None:
    """Whether the cluster's discovery lists the node now (by node_id); None when there is none or it failed."""
    if members is None:
        return None
    try:
        return node_id(node) in members()
    except ClusterError as exc:
        log.debug("discovery: %s", exc.what)
        return None


def pending_outcome(url: str, chain: str, runs_dir: Path, out, members: Callable[[], set[str]] | None = None
                    ) -> tuple[RunRecord, list[str]]:
    """The chain's records brought here from the store, and its newest run followed to its end (its ranks go on
    under node 0's wrapper while no head supervises them): that run's record once concluded, and the chain's ids.
    Node 0 gone (the likely case after a reclaim between two heads) ends the run as one that lost a node
    (master_lost): at once when the cluster's discovery (`members`: node_id of each node it lists) no longer lists
    it; after GONE_LOOKS failed looks in a row when it does not answer, or when discovery cannot say. Any other
    failure of a look at a node 0 that discovery lists is raised, as before."""
    ids, _ = newest(url, chain)
    if not ids:
        raise ClusterError(f"chain {chain}: no record of it in the store", fix="'fab runs' lists what the store holds")
    for run_id in ids:
        run_dir = RunPaths(run_id, runs_dir=runs_dir).home
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").write_text(json.dumps(store_lib.read_summary(url, run_id), indent=2))
    run_dir = RunPaths(ids[-1], runs_dir=runs_dir).home
    rec = records.load(run_dir)
    if rec.status == Status.RUNNING:
        rec = records.noted(run_dir, rec, supervisor=records.this_process())
        out.write(f"run {rec.run_id}: taken over by this head's supervisor (pid {os.getpid()}); following it\n")
        out.flush()
        master = detach.master_node(rec)
        mirror = detach.LogMirror(run_dir, rec)  # the log reaches the store as it grows, not only at the end
        missed = 0
        try:
            while rec.status == Status.RUNNING:
                time.sleep(POLL_S)
                if not missed:  # a node 0 that did not answer the last look is not asked for its log
                    mirror.step(master)
                try:
                    rec = detach.conclude(run_dir, master, out, follower=True)
                    missed = 0
                except ClusterError as exc:  # for a node gone before this head recorded its host key: no dial
                    there = listed(master, members)
                    if there and not isinstance(exc, Unreachable):
                        raise
                    missed = GONE_LOOKS if there is False else missed + 1
                    if missed >= GONE_LOOKS:
                        rec = master_lost(run_dir, mirror, out, exc, "is no longer in the cluster" if there is False
                                          else f"did not answer {GONE_LOOKS} looks in a row")
        finally:
            mirror.close()
    return rec, ids


def master_lost(run_dir: Path, mirror: detach.LogMirror, out, exc: ClusterError, how: str) -> RunRecord:
    """Node 0 is gone (after a reclaim between two heads, the likely case): the ending the first supervisor gives a
    run whose node 0 went away under it (launch.run: mpirun's session lost, exit -1), through the one ending every
    run has: its other nodes swept, the run failed as node lost (or preempted, if rank 0's notice is in the log
    mirrored here), so that the chain's restart loop goes on as it would have. Returns the concluded record."""
    rec = records.load(run_dir)
    out.write(f"run {rec.run_id}: node 0 ({detach.master_node(rec).name}) {how} ({exc.what}): ending it as a run "
              "that lost a node\n")
    out.flush()
    home, _ = RunPaths.node_run_of(rec.remote_run)
    r = Run(rec.run_id, run_dir.parent, home, [Node(**n) for n in rec.nodes], detach.log_plan(rec), rec,
            remote_output=rec.remote_output or RunPaths(rec.run_id, home).node_output, is_job=bool(rec.job))
    wall = max(0.0, time.time() - float(rec.started_at or time.time()))
    try:
        end(r, Outcome(-1, mirror.router.lines, mirror.router.finished, wall), lambda msg: out.write(msg + "\n"))
    except ClusterError as ended:  # how it ended is in its record: the caller goes on from there
        out.write(f"{ended.what}\n")
    out.flush()
    return records.load(run_dir)


def as_exception(rec: RunRecord) -> ClusterError | None:
    """The error the first supervisor's restart loop would have caught for this ending; None: nothing to restart."""
    if rec.status == Status.PREEMPTED:
        node = (rec.preempted or {}).get("node")
        return Preempted(f"run {rec.run_id} was preempted on {node}", run_id=rec.run_id, node=node)
    if rec.status == Status.FAILED and rec.lost_nodes:
        lost = list(rec.lost_nodes)
        return NodeFailure(f"run {rec.run_id} lost {', '.join(lost)}", nodes=lost, run_id=rec.run_id, lost=lost)
    return None


def head_store() -> str:
    """The store of the cluster this head heads: xc-head-boot passes its cluster.env's on."""
    return store.store_url() or ""


def main() -> int:
    """On a head at boot: a supervisor --adopt for every orphaned chain. Prints one line per chain."""
    url = head_store()
    if not url:
        print("xc-head-adopt: no store (XC_STORE): nothing to take over", flush=True)
        return 0
    name = os.environ.get(head.HEAD_ENV) or spot.cluster_env().get("XC_HEAD_GROUP", "head")  # as fab names the head
    runs_dir = head.runs_here()
    folder = runs_dir / ".supervisors"
    folder.mkdir(parents=True, exist_ok=True)
    waiting = set(live_chains(url))
    if not waiting:
        print("xc-head-adopt: no chain to take over", flush=True)
    deadline = time.monotonic() + MAX_WAIT_S
    said: set[str] = set()
    while waiting:
        for chain in sorted(waiting):
            left = stale(url, chain)
            if chain not in live_chains(url) or supervised_here(chain):
                waiting.discard(chain)
            elif left > 0:
                if chain not in said:  # never a second supervisor of a live chain: its heartbeat must go stale
                    print(f"xc-head-adopt: chain {chain}: its heartbeat is fresh; waiting {left:.0f}s for it to go "
                          "stale", flush=True)
                    said.add(chain)
            else:
                waiting.discard(chain)
                _start(chain, name, runs_dir, folder)
        if waiting and time.monotonic() > deadline:
            print(f"xc-head-adopt: {', '.join(sorted(waiting))}: still a fresh heartbeat after {MAX_WAIT_S:.0f}s "
                  "(another head supervises them?): left alone", flush=True)
            return 1
        if waiting:
            time.sleep(POLL_S)
    return 0


def _start(chain: str, name: str, runs_dir: Path, folder: Path) -> None:
    log_path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-adopt-{chain}.log"
    with log_path.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.supervision.supervisor", "--adopt", chain],
                                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, head.ENV: chain, head.HEAD_ENV: name, "XC_RUNS_DIR": str(runs_dir)})
    print(f"xc-head-adopt: chain {chain}: supervisor pid {proc.pid}, log {log_path}", flush=True)


def kept_secrets(job: dict) -> dict[str, str] | None:
    """The values of the chain's secrets, from SSM where fab kept them; {} for a chain without any; None when they
    are lost (never kept, or gone)."""
    names = list(job.get("secrets") or ())
    if not names:
        return {}
    if not job.get("secrets_at"):
        return None
    return run_secrets.fetch(job["secrets_at"], job["chain"], names)


def adopted_request(url: str, job: dict, rec: RunRecord, runs_dir: Path, values: dict[str, str] | None = None):
    """The request the chain's restart loop goes on with: the record's, with what the record does not keep (the
    secrets' `values`: the record has them masked)."""
    kept = RunSpec.of_summary(store_lib.read_summary(url, rec.run_id) or rec.to_json()) or RunSpec()
    values = values or {}
    env = {k: values.get(k, v) for k, v in kept.what.env.items()}
    return TrainRequest.of(kept, env=env, args=secrets.fill_masked(list(kept.what.args), values),
                           valueless=set(job.get("secrets") or ()), runs_dir=runs_dir, nodes=len(rec.nodes) or None,
                           wrapped=True)


if __name__ == "__main__":
    sys.exit(main())
