"""The fab tasks: thin wrappers that parse options and call the library (`fab -l` lists them).

Job flags go after `--`:  fab train --nodes 4 --job glue -- --num_train_epochs 3
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from fabric import task as fabric_task
from invoke import Collection

from cluster import keys as keys_lib
from cluster import local as local_lib
from cluster import netns as netns_lib
from cluster import ssh as ssh_lib
from cluster import store as store_lib
from cluster.inventory import load_head
from cluster.resolve import open_cluster
from core.cli import as_float, as_int, cli, env_pairs, job_args, one_line_parse_errors, valueless_keys
from core.constants import DEFAULT_MASTER_PORT, MAX_NODES
from core.errors import ClusterError
from doctor import run as doctor_lib
from doctor import status as status_lib
from launch import run as train_lib
from launch.life import board as board_lib
from launch.life import records, store_run
from launch.life import runs as runs_lib
from launch.life import stop as stop_lib
from launch.plan import request as request_lib
from launch.staging import requirements as requirements_lib
from launch.staging import snapshot as snapshot_lib
from launch.supervision import restarts as restarts_lib
from launch.supervision import supervisor as supervisor_lib
from launch.supervision import train_flags as flags_lib
from node_setup import profiles as profiles_lib
from node_setup import setup as setup_lib
from reports import bench as bench_lib
from reports import kube as kube_lib
from sweep import run as sweep_lib
from training.runtime.spec import RunSpec
from twin import notice as notice_lib
from twin import up as twin_lib

one_line_parse_errors()  # an unknown flag or a missing value: one 'error:' line too


def _twin_by_default() -> None:
    """After 'fab local-up --aws' this checkout uses the twin, as after 'fab local-up' it uses the local cluster, until
    'fab local-down': its cluster, endpoints, store and credentials (never AWS's). XC_CLUSTER or --cluster choose
    otherwise."""
    if os.environ.get("XC_CLUSTER") or any(a == "--cluster" or a.startswith("--cluster=") for a in sys.argv):
        return
    try:
        record = twin_lib.read()
    except (ClusterError, OSError):  # a corrupt or unreadable record: the tasks that need the twin say so
        return
    if record:
        twin_lib.use(record)


_twin_by_default()


def task(*args, **kwargs):
    """Fabric's @task without invoke's automatic short flags: -e or -f meant different things in different
    tasks, and -i is fab's own identity file. Long flags only, one meaning each."""
    if args and callable(args[0]):
        return fabric_task(auto_shortflags=False)(args[0])
    return fabric_task(*args, auto_shortflags=False, **kwargs)


def _cluster(c, cluster):
    """--cluster flag < XC_CLUSTER < fabric.yaml's xc.cluster < the started local cluster < the selected
    Pulumi stack < 'local' (whose error says how to start one)."""
    return cluster or os.environ.get("XC_CLUSTER") or c.config.get("xc", {}).get("cluster") or None


@task(help={"nodes": "number of nodes (default 2)", "port": "sshd port on every node (default 2222)",
            "netns": "a network twin: each node in its own network namespace, linked to a bridge (root only)",
            "link": "with --netns: each link's rate, e.g. 3gbit or 500mbit (default: unshaped)",
            "latency": "with --netns: each link's one-way delay, e.g. 50us or 1ms (needs the kernel's netem)",
            "no-head": "no head beside the nodes: detached runs' supervisors then run on this machine",
            "aws": "the AWS twin: moto as the control plane, each instance an sshd node in its own namespace (root)"})
@cli
def local_up(c, nodes="2", port=str(local_lib.DEFAULT_PORT), netns=False, link=None, latency=None, no_head=False,
             aws=False):
    """Start a local cluster: N sshd nodes on 127.0.0.2, 127.0.0.3, ... and its head on the next address."""
    count, port = as_int(nodes, "--nodes", 1, MAX_NODES), as_int(port, "--port", 1024, 65535)
    if aws:
        if netns or link or latency or no_head:
            raise ClusterError("--aws takes only --nodes", fix="leave out --netns, --link, --latency and --no-head")
        record = twin_lib.up(count)
        print(f"AWS twin up in {record['up_s']:.0f} s: cluster {record['cluster']}, {count} node(s) and a head in "
              f"{record['subnet']}, control plane {record['endpoint']}, store {record['store']}")
        print(twin_lib.export_line(record))
        return
    if netns:
        started = netns_lib.up(count, port=port, link=link, latency=latency)
    elif link or latency:
        raise ClusterError("--link and --latency shape the links of a network twin", fix="add --netns (root only) or "
                           "leave them out")
    else:
        started = local_lib.up(count, port=port, head=not no_head)
    head = local_lib.head()
    print(f"local cluster up: {len(started)} node(s) on port {started[0].port}: "
          + ", ".join(f"{n.name}={n.host}" for n in started) + (f"; head={head.host}" if head else "")
          + netns_lib.up_line())


@task(help={"node": "node1 (fab's node 1), head, or an instance id", "kind": "spot | rebalance | terminate (the "
            "group's own termination, held by its lifecycle hook)", "after": "seconds until the instance goes "
            "(default: spot 120, terminate 300, the hook's heartbeat)"})
@cli
def local_notice(c, node, kind="spot", after=None):
    """Make a node's IMDS announce a notice (the AWS twin's, or a local node's own); at its end the node goes."""
    print(notice_lib.notice(node, kind, as_float(after, "--after") if after is not None else None))


@task(help={"node": "the node whose link changes, e.g. node1", "cut": "take the link down: the node runs on, "
            "unreachable", "restore": "bring a cut link back", "link": "the link's new rate, e.g. 100mbit",
            "latency": "the link's new one-way delay, e.g. 5ms"})
@cli
def local_link(c, node, cut=False, restore=False, link=None, latency=None):
    """Cut, restore or reshape one node's link in a network twin ('fab local-up --netns'; root only)."""
    print(netns_lib.set_link(node, cut=bool(cut), restore=bool(restore), link=link, latency=latency))


@task(help={"node": "the node to take away, e.g. node1 (on the AWS twin: node1, head or an instance id)"})
@cli
def local_kill(c, node):
    """Take one local node away outright (its sshd and every process on it), as a reclaimed spot node goes;
    'fab local-up' with the same --nodes brings it back. On the AWS twin: terminate the instance with no notice."""
    if twin_lib.read():
        print(notice_lib.kill(node))
        return
    if node == local_lib.HEAD and local_lib.nodes(require_running=False) and local_lib.head() is None:
        raise ClusterError("this local cluster has no head (it was started with --no-head)",
                           fix="kill a node instead (fab status lists them), or restart it with a head: 'fab local-down' "
                           "then 'fab local-up --nodes N'")
    n = local_lib.kill_node(node)
    print(f"{node} killed ({n} process(es)); bring it back with 'fab local-up'")


@task
@cli
def local_down(c):
    """Stop the local cluster's sshd processes (and their sessions); a network twin's namespaces and links go too."""
    twin = twin_lib.down()
    if twin:
        print(twin)
    n, removed = netns_lib.down()
    if twin and not n and not removed:
        return
    print((f"local cluster down: {n} node(s) stopped" if n else "no local cluster was running")
          + (f"; network twin removed ({', '.join(removed)})" if removed else ""))


@task(help={"cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK] (default: the started local cluster, else "
                        "the selected Pulumi stack)"})
@cli
def keys(c, cluster=None):
    """Per-cluster SSH key on every node; known_hosts and ssh config on node 0 (idempotent)."""
    cl = open_cluster(_cluster(c, cluster))
    res = keys_lib.setup_keys(cl)
    problems = keys_lib.verify_mesh(cl)
    if problems:
        raise ClusterError("node 0 cannot reach " + "; ".join(f"{k}: {v}" for k, v in problems.items()))
    print(f"keys: {len(cl.nodes)} node(s) authorized ({len(res.authorized)} new); "
          f"node 0 reaches every node with verified host keys ({res.ssh_dir}/config)")


@task(**flags_lib.task_options())  # every flag and its help line: launch/supervision/train_flags.py's TrainFlags
@cli
@flags_lib.takes_flags
def train(c, flags: flags_lib.TrainFlags):
    """Run a training job across the cluster with mpirun; results land in runs/<run-id>/.
    Each flag in full: docs/train.md#flags."""
    cluster = _cluster(c, flags.cluster)
    chosen_store = store_lib.choose(flags.store, c.config, cluster)  # one resolver for every task
    r = flags_lib.resolve(flags, request_lib.RUNS, store=chosen_store.url)
    req = store_run.apply(r.req, chosen_store, cluster)  # XC_STORE and credentials (as secrets)
    req = request_lib.validate(req)  # every flag and data file before the cluster is asked anything
    chosen = open_cluster(cluster)
    store_lib.check(chosen_store, chosen.spec)  # reachable and writable, before launch
    print(status_lib.cluster_line(chosen), flush=True)
    print(chosen_store.line(), flush=True)  # every run's first lines name its store
    whose = store_lib.credentials_line(chosen_store, chosen.spec)  # off AWS: the operator's own credentials
    if whose:
        print(whose, flush=True)
    req = requirements_lib.prepare(req, chosen, lambda line: print(line, flush=True))  # wheels in the store, or refused
    req = snapshot_lib.prepare(req, lambda line: print(line, flush=True))  # the run's own files: a snapshot in the store
    runs_lib.reap_all(request_lib.RUNS)  # runs whose fab died: recorded abandoned before this one starts
    if (r.supervised or req.detach) and supervisor_lib.detached(chosen, dataclasses.replace(r, req=req), sys.stdout):
        return  # on the cluster's head when it has one, else here
    result = restarts_lib.train_with_restarts(chosen, req)
    if not result.detached:
        print(records.result_line(result))


@fabric_task(help={"run": "the run id (from 'fab runs')", "follow": "keep streaming until the run ends, then bring "
                                                                   "its results home",
                   "store": "where to look for a run not under runs/ (default: as fab train chooses it)",
                   "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK] (whose store)"})  # -f: its only short flag
@cli
def logs(c, run, follow=False, store=None, cluster=None):
    """A run's log with [rank host] prefixes: live from node 0 while a detached run goes on, else runs/<id>/log.txt."""
    where = store_lib.choose(store, c.config, _cluster(c, cluster)).url  # a run from another machine
    closing = runs_lib.show_log(request_lib.RUNS, run, bool(follow), sys.stdout, store=where,
                                head=load_head(_cluster(c, cluster)))
    if closing:
        print(closing)


@task(help={"store": "s3://BUCKET/PREFIX or file:///FOLDER (default: XC_STORE, fabric.yaml xc.store, the stack's "
                     "bucket, ./store)", "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]"})
@cli
def runs(c, store=None, cluster=None):
    """The runs under runs/ and in the cluster's store, newest first: id, job, nodes, status, wall, metric, samples/s."""
    runs_lib.list_runs(request_lib.RUNS, sys.stdout, store=store_lib.choose(store, c.config, _cluster(c, cluster)).url,
                       head=load_head(_cluster(c, cluster)))  # asked only about a supervisor gone silent


@task(help={"cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK] (default: the local cluster if started, "
                       "else the selected Pulumi stack)", "no_runs": "skip asking the nodes for runs left running"})
@cli
def status(c, cluster=None, no_runs=False):
    """The active cluster: nodes (node 0 first), type, spot or on-demand, state, uptime, $/h, and runs left on them."""
    lines, ok = status_lib.status(open_cluster(_cluster(c, cluster), require_running=False), check_runs=not no_runs)
    if not no_runs:
        lines += [f"runs: {rid} recorded abandoned (its fab or supervisor died; nothing of it left on the nodes)"
                  for rid in runs_lib.reap_all(request_lib.RUNS)]
    print("\n".join(lines))
    if not ok:
        sys.exit(1)


@task(help={"cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]"})
@cli
def stop(c, run, cluster=None):
    """End RUN on every node (the clean-up a failure gets) and record it as stopped; frees the cluster."""
    stop_lib.check_run_id(run, request_lib.RUNS)  # before the cluster is asked anything
    where = store_lib.choose(None, c.config, _cluster(c, cluster)).url  # a run a head's supervisor runs
    print(stop_lib.stop(open_cluster(_cluster(c, cluster)), run, request_lib.RUNS, store=where))


@task(help={"node": "node0..nodeN-1 (node 0 first, as 'fab status' lists them), head, or a node's own name",
            "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]"})
@cli
def ssh(c, node, cluster=None):
    """SSH to one node with the cluster's key, user and verified host keys; 'fab ssh node1 -- nproc' runs one command
    there and exits with its exit code."""
    code = ssh_lib.run(open_cluster(_cluster(c, cluster)), node, job_args())
    if code:
        sys.exit(code)


@task(help={"cluster": "aws[:NAME] | pulumi[:STACK] (default: the selected stack's cluster and region, else aws: "
                       "the only cluster with tagged resources in the region)",
            "yes": "delete everything listed, in dependency order, but the store",
            "include-store": "with --yes, empty and delete the store too (refused while the cluster's group exists)"})
@cli
def sweep(c, cluster=None, yes=False, include_store=False):
    """List what a cluster left in its region after 'pulumi destroy' and its cost (exit 1 if any); --yes deletes it."""
    code = sweep_lib.sweep(_cluster(c, cluster), yes=yes, include_store=include_store)
    if code:
        sys.exit(code)


@task(help={"nodes": "local nodes to start (default 2)", "port": "sshd port (default 2222)"})
@cli
def demo(c, nodes="2", port=str(local_lib.DEFAULT_PORT)):
    """Start a local cluster, fine-tune MiniLM on the bundled paraphrase set, print the result, stop it."""
    train_lib.demo(as_int(nodes, "--nodes", 1, MAX_NODES), port=as_int(port, "--port", 1024, 65535))


@task(help={"profile": "software profile from node_setup/profiles.toml (default: the one the nodes carry; on "
                       "nodes without one: test on a local cluster, else upstream)",
            "nodes": "set up the first N nodes (default: all)",
            "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]",
            "force": "replace the profile a node carries in the same venv with --profile"})
@cli
def setup(c, profile=None, nodes=None, cluster=None, force=False):
    """Install a software profile and the training code on every node, in parallel (idempotent)."""
    count = as_int(nodes, "--nodes", 1) if nodes is not None else None
    if profile is not None:
        profiles_lib.load_profile(profile)  # an unknown name before any node is asked
    cl = open_cluster(_cluster(c, cluster))
    chosen = cl.first(count)
    spec, why = setup_lib.resolve_profile(cl, chosen, profile, force=force)
    print(f"setup: profile {spec.name} ({why})")
    setup_lib.setup_nodes(cl, chosen, spec, out=sys.stdout)


@task(iterable=["env"],
      help={"profile": "also check the versions pinned by this profile", "nodes": "check the first N nodes",
            "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]", "quick": "skip the port and all-reduce",
            "full": "every check, the all-reduce too (default)", "master-port": "rendezvous port (default 29500)",
            "backend": "all-reduce backend: auto (what fab train picks: ccl where the bindings are on every node) "
                       "| ccl | gloo",
            "env": "variable for the all-reduce's ranks, KEY=VALUE (repeatable), as fab train --env",
            "store": "the store every node must reach (default: as fab train chooses it)"})
@cli
def doctor(c, profile=None, nodes=None, cluster=None, quick=False, full=False, master_port=None, backend="auto",
           env=None, store=None):
    """Check the nodes: CPU, AMX, memory, disk, versions, SSH, port, clock, all-reduce; red rows say the fix."""
    if quick and full:
        raise ClusterError("--quick and --full exclude each other", fix="pass one of them")
    count = as_int(nodes, "--nodes", 1) if nodes is not None else None
    port = as_int(master_port, "--master-port", 1024, 65535) if master_port else DEFAULT_MASTER_PORT
    if backend not in RunSpec.BACKENDS:
        raise ClusterError(f"--backend {backend!r} is not one of {', '.join(RunSpec.BACKENDS)}", fix="pass one of them")
    extra_env = env_pairs(env)
    p = profiles_lib.load_profile(profile) if profile is not None else None  # the flags before the nodes
    cl = open_cluster(_cluster(c, cluster), require_running=False)  # a stopped node is a row, not an abort
    chosen = cl.first(count)
    report = doctor_lib.doctor(cl, chosen, profile=p, full=not quick, port=port, out=sys.stdout,
                               backend=backend, env=extra_env,
                               store=store_lib.choose(store, c.config, cl.spec))  # a 'store' row per node
    print(report.render())
    report.raise_if_failed("doctor")


@task(help={"nodes": "cluster sizes to compare, e.g. 1,2,4", "job": "bundled job: glue | qa | clm",
            "runs": "instead of running: a report over these finished runs (ids, comma-separated)",
            "ppn": "processes per node (default auto)", "threads": "OpenMP threads per process (default auto)",
            "backend": "auto | ccl | gloo", "precision": "auto | bf16 | fp32",
            "comm-hook": "gradients on the wire: auto (default) | none (fp32) | bf16 | fp16",
            "env": "KEY=VALUE (or KEY: your own value, kept secret) for every rank of every size; repeatable",
            "timeout": "seconds a collective may wait, as in fab train (default 300)",
            "no-pin": "do not pin ranks to cores", "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]"},
      iterable=["env"])
@cli
def bench(c, nodes=None, job="glue", runs=None, ppn="auto", threads="auto", backend="auto", precision="auto",
          comm_hook=request_lib.DEFAULT_COMM_HOOK, env=None, timeout="300", no_pin=False, cluster=None):
    """The same job with identical flags at each size; writes runs/bench-<id>/ (report.md, scaling.png)."""
    if runs and nodes:
        raise ClusterError("--runs and --nodes exclude each other", fix="pass --runs to report on finished runs or "
                           "--nodes to run anew")
    if runs:
        result = bench_lib.report_from_runs(runs, request_lib.RUNS)
    else:
        if not nodes:
            raise ClusterError("--nodes is missing", fix="give the sizes to compare, e.g. --nodes 1,2,4")
        req = request_lib.TrainRequest.of(job=job, args=job_args(), ppn=str(ppn), threads=str(threads), backend=backend,
                                     precision=precision, comm_hook=str(comm_hook), env=env_pairs(env),
                                     valueless=valueless_keys(env), timeout_s=as_int(timeout, "--timeout", 1), pin=not no_pin)
        bench_lib.parse_sizes(str(nodes))  # the flags and data before the cluster is asked anything
        chosen_store = store_lib.choose(None, c.config, _cluster(c, cluster))  # checkpoints where fab train keeps them
        req = request_lib.validate(store_run.apply(req, chosen_store, _cluster(c, cluster)))
        chosen = open_cluster(_cluster(c, cluster))
        store_lib.check(chosen_store, chosen.spec)
        print(chosen_store.line(), flush=True)
        result = bench_lib.bench(chosen, str(nodes), req)
    print(bench_lib.summary_line(result))


@task(help={"nodes": "pods (one per node): 1 master + N-1 workers (default 2)", "job": "bundled job: glue | qa | clm",
            "out": "output folder (default runs/kube-<job>-<N>)", "image": "image name for the Dockerfile and pods",
            "instance-type": f"node type sizing the pods (default {kube_lib.DEFAULT_INSTANCE})",
            "profile": "software profile installed in the image (default upstream)",
            "namespace": "Kubernetes namespace (default kubeflow)", "pvc": "PersistentVolumeClaim for caches and output"})
@cli
def kube(c, nodes=None, job="glue", out=None, image="xeon-cluster-train:latest", instance_type=kube_lib.DEFAULT_INSTANCE,
         profile="upstream", namespace="kubeflow", pvc="xeon-cluster-pvc"):
    """Render a Kubeflow PyTorchJob manifest and a Dockerfile for a bundled job (kubectl create -f ...)."""
    req = kube_lib.KubeRequest(nodes=as_int(nodes or 2, "--nodes", 1), job=job, args=job_args(), image=image,
                               instance_type=instance_type, profile=profile, namespace=namespace, pvc=pvc)
    paths = kube_lib.render_kube(req, Path(out) if out else request_lib.RUNS / f"kube-{job}-{req.nodes}")
    print(f"wrote {paths['manifest']} and {paths['dockerfile']} (build context {paths['manifest'].parent}): "
          f"docker build -t {image} {paths['manifest'].parent} && kubectl create -f {paths['manifest']}")


ns = Collection(local_up, local_down, local_kill, local_link, local_notice, keys, setup, doctor, train, logs, runs, stop, status, ssh,
                sweep, demo, bench, kube)


# -- the cluster's store: tasks appended here, one resolver for all of them ------------------------------------------
_STORE_HELP = "s3://BUCKET/PREFIX or file:///FOLDER (default: XC_STORE, fabric.yaml xc.store, the stack's bucket, ./store)"


@task(help={"run": "the run id (from 'fab runs')", "checkpoints": "its complete checkpoints too",
            "to": "the folder to fill (default runs/<run>)", "no-fetch-model": "leave the model weights in the store",
            "store": _STORE_HELP, "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK] (whose store)"})
@cli
def pull(c, run, checkpoints=False, to=None, no_fetch_model=False, store=None, cluster=None):
    """Bring a run's records and outputs (with --checkpoints, its checkpoints) home from the cluster's store."""
    stop_lib.check_run_id(run, request_lib.RUNS)
    chosen = store_lib.choose(store, c.config, _cluster(c, cluster))
    print(chosen.line(), flush=True)
    dest = Path(to) if to else request_lib.RUNS / run
    store_lib.pull(chosen.url, run, dest, bool(checkpoints), not no_fetch_model, say=lambda m: print(m, flush=True))


ns.add_task(pull)


@task(help={"run": "a run id from 'fab runs', or several joined by commas; a chain (a run and the runs it was resumed "
                   "as) shows as one run", "port": "TensorBoard's port on 127.0.0.1 (default 6006)",
            "no-serve": "pull the event files and print their folder, without starting TensorBoard",
            "store": _STORE_HELP, "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK] (whose store)"})
@cli
def tensorboard(c, run, port="6006", no_serve=False, store=None, cluster=None):
    """A run's TensorBoard curves: its event files from the cluster's store, served on localhost, pulled again while
    it trains."""
    runs = [r for r in run.replace(" ", ",").split(",") if r]
    chosen = store_lib.choose(store, c.config, _cluster(c, cluster))
    print(chosen.line(), flush=True)
    board = board_lib.Board(chosen.url, runs, request_lib.RUNS, say=lambda m: print(m, flush=True))
    if no_serve:
        counts = board.pull()
        print("\n".join(board.describe(counts)))
        if not any(counts.values()):
            raise ClusterError("no TensorBoard event files for " + ", ".join(runs) + " yet",
                               fix="a run writes them with --report_to tensorboard (the bundled jobs' default); wait "
                                   "for its first logging step")
        return
    board_lib.serve(board, as_int(port, "--port", 1, 65535))


ns.add_task(tensorboard)
