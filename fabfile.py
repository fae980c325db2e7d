"""The fab tasks: thin wrappers that parse options and call the library (`fab -l` lists them).

Job flags go after `--`:  fab train --nodes 4 --job glue -- --num_train_epochs 3
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from fabric import task
from invoke import Collection

from cluster import keys as keys_lib
from cluster import local as local_lib
from cluster.resolve import open_cluster
from core.cli import as_int, cli, env_pairs, job_args
from core.constants import DEFAULT_MASTER_PORT
from core.errors import ClusterError
from doctor import run as doctor_lib
from launch import records
from launch import request as request_lib
from launch import restarts as restarts_lib
from launch import resume as resume_lib
from launch import run as train_lib
from launch import stop as stop_lib
from node_setup import setup as setup_lib
from reports import bench as bench_lib
from reports import kube as kube_lib


def _cluster(c, cluster):
    """--cluster flag < XC_CLUSTER < fabric.yaml's xc.cluster < 'local'."""
    return cluster or os.environ.get("XC_CLUSTER") or c.config.get("xc", {}).get("cluster") or None


@task(help={"nodes": "number of nodes (default 2)", "port": "sshd port on every node (default 2222)"})
@cli
def local_up(c, nodes="2", port=str(local_lib.DEFAULT_PORT)):
    """Start a local cluster: N sshd nodes on 127.0.0.2, 127.0.0.3, ... (the active cluster)."""
    started = local_lib.up(as_int(nodes, "--nodes"), port=as_int(port, "--port"))
    print(f"local cluster up: {len(started)} node(s) on port {started[0].port}: "
          + ", ".join(f"{n.name}={n.host}" for n in started))


@task(help={"node": "the node to take away, e.g. node1"})
@cli
def local_kill(c, node):
    """Take one local node away outright (its sshd and every process on it), as a reclaimed spot node goes;
    'fab local-up' with the same --nodes brings it back."""
    n = local_lib.kill_node(node)
    print(f"{node} killed ({n} process(es)); bring it back with 'fab local-up'")


@task
@cli
def local_down(c):
    """Stop the local cluster's sshd processes (and nothing else)."""
    n = local_lib.down()
    print(f"local cluster down: {n} node(s) stopped" if n else "no local cluster was running")


@task(help={"cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK] (default: local)"})
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


@task(
    iterable=["env"],
    help={
        "nodes": "use the first N nodes (default: all)",
        "job": "bundled job: glue (default) | qa | clm",
        "script": "run your own training script instead (its flags after --)",
        "ppn": "processes per node (default auto: one per socket)",
        "threads": "OpenMP threads per process (default auto: the process's cores)",
        "backend": "auto | ccl | gloo",
        "precision": "auto | bf16 | fp32",
        "env": "extra or overriding variable for every rank, KEY=VALUE (repeatable)",
        "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]",
        "master-port": "rendezvous port on node 0 (default: a free port there, picked per run)",
        "no-pin": "do not pin ranks to cores",
        "timeout": "seconds a collective may wait before the job fails (default 300)",
        "save-every": "checkpoint every DURATION of training (10m, 600s) or N steps (default 10m; 0: only on a "
                      "spot notice)",
        "no-fetch-model": "bring home metrics, logs and trainer state but not model or checkpoint weights",
        "resume": "continue RUN_ID from its latest checkpoint at home: same job, flags and data",
        "max-restarts": "after a preemption or a lost node, resume by itself up to K times (default 0)",
        "restart-wait": "seconds to wait for the cluster to have its nodes again before a restart (default 600)",
        "concurrent": "run even while another run holds the cluster (by default one run at a time)",
    },
)
@cli
def train(c, nodes=None, job=None, script=None, ppn="auto", threads="auto", backend="auto", precision="auto",
          env=None, cluster=None, master_port=None, no_pin=False, timeout="300", save_every=None, no_fetch_model=False,
          resume=None, max_restarts="0", restart_wait="600", concurrent=False):
    """Run a training job across the cluster with mpirun; results land in runs/<run-id>/."""
    n = as_int(nodes, "--nodes") if nodes is not None else None
    if resume:
        if job or script or job_args():
            raise ClusterError(f"--resume {resume} runs that run's own job and flags; drop --job/--script and the "
                               "flags after --")
        req = resume_lib.resume_request(resume, request_lib.RUNS, nodes=n, fetch_model=not no_fetch_model)
    else:
        req = request_lib.TrainRequest(nodes=n, job=job or "glue", script=script, args=job_args(), env=env_pairs(env),
                                     fetch_model=not no_fetch_model)
        if save_every is not None:
            req.save_every = str(save_every)
    # on --resume the recorded choices stand unless a flag says otherwise
    for name, value, default in (("ppn", str(ppn), "auto"), ("threads", str(threads), "auto"),
                                 ("backend", backend, "auto"), ("precision", precision, "auto")):
        if not resume or value != default:
            setattr(req, name, value)
    if resume:
        req.env.update(env_pairs(env))
    req.master_port = as_int(master_port, "--master-port") if master_port else None
    req.pin = req.pin and not no_pin
    req.concurrent = bool(concurrent)
    if not resume or int(as_int(timeout, "--timeout")) != 300:
        req.timeout_s = as_int(timeout, "--timeout")
    spec = open_cluster(_cluster(c, cluster)).spec
    result = restarts_lib.train_with_restarts(spec, req, as_int(max_restarts, "--max-restarts"),
                                              as_int(restart_wait, "--restart-wait"))
    print(records.result_line(result))


@task(help={"cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]"})
@cli
def stop(c, run, cluster=None):
    """End RUN on every node (the clean-up a failure gets) and record it as stopped; frees the cluster."""
    print(stop_lib.stop(open_cluster(_cluster(c, cluster)), run, request_lib.RUNS))


@task(help={"nodes": "local nodes to start (default 2)", "port": "sshd port (default 2222)"})
@cli
def demo(c, nodes="2", port=str(local_lib.DEFAULT_PORT)):
    """Start a local cluster, fine-tune MiniLM on the bundled paraphrase set, print the result, stop it."""
    train_lib.demo(as_int(nodes, "--nodes"), port=as_int(port, "--port"))


@task(help={"profile": "software profile from node_setup/profiles.toml (default: the one the nodes carry; on "
                       "nodes without one: test on a local cluster, else upstream)",
            "nodes": "set up the first N nodes (default: all)",
            "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]",
            "force": "replace the profile a node carries in the same venv with --profile"})
@cli
def setup(c, profile=None, nodes=None, cluster=None, force=False):
    """Install a software profile and the training code on every node, in parallel (idempotent)."""
    cl = open_cluster(_cluster(c, cluster))
    chosen = cl.first(as_int(nodes, "--nodes") if nodes is not None else None)
    spec, why = setup_lib.resolve_profile(cl, chosen, profile, force=force)
    print(f"setup: profile {spec.name} ({why})")
    setup_lib.setup_nodes(cl, chosen, spec, out=sys.stdout)


@task(iterable=["env"],
      help={"profile": "also check the versions pinned by this profile", "nodes": "check the first N nodes",
            "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]", "quick": "skip the port and all-reduce",
            "full": "every check, the all-reduce too (default)", "master-port": "rendezvous port (default 29500)",
            "backend": "all-reduce backend: auto (what fab train picks: ccl where the bindings are on every node) "
                       "| ccl | gloo",
            "env": "variable for the all-reduce's ranks, KEY=VALUE (repeatable), as fab train --env"})
@cli
def doctor(c, profile=None, nodes=None, cluster=None, quick=False, full=False, master_port=None, backend="auto",
           env=None):
    """Check the nodes: CPU, AMX, memory, disk, versions, SSH, port, clock, all-reduce; red rows say the fix."""
    if quick and full:
        raise ClusterError("--quick and --full exclude each other; pass one of them")
    cl = open_cluster(_cluster(c, cluster), require_running=False)  # a stopped node is a row, not an abort
    chosen = cl.first(as_int(nodes, "--nodes") if nodes is not None else None)
    port = as_int(master_port, "--master-port") if master_port else DEFAULT_MASTER_PORT
    if backend not in request_lib.BACKENDS:
        raise ClusterError(f"--backend {backend!r} is not one of {', '.join(request_lib.BACKENDS)}")
    report = doctor_lib.doctor(cl, chosen, profile=profile, full=not quick, port=port, out=sys.stdout,
                               backend=backend, env=env_pairs(env))
    print(report.render())
    report.raise_if_failed("doctor")


@task(help={"nodes": "cluster sizes to compare, e.g. 1,2,4", "job": "bundled job: glue | qa | clm",
            "runs": "instead of running: a report over these finished runs (ids, comma-separated)",
            "ppn": "processes per node (default auto)", "threads": "OpenMP threads per process (default auto)",
            "backend": "auto | ccl | gloo", "precision": "auto | bf16 | fp32",
            "cluster": "local | hosts:PATH | aws[:NAME] | pulumi[:STACK]"})
@cli
def bench(c, nodes=None, job="glue", runs=None, ppn="auto", threads="auto", backend="auto", precision="auto",
          cluster=None):
    """The same job with identical flags at each size; writes runs/bench-<id>/ (report.md, scaling.png)."""
    if runs and nodes:
        raise ClusterError("--runs and --nodes exclude each other: --runs reports on finished runs, --nodes runs anew")
    if runs:
        result = bench_lib.report_from_runs(runs, request_lib.RUNS)
    else:
        if not nodes:
            raise ClusterError("--nodes is missing; give the sizes to compare, e.g. --nodes 1,2,4")
        req = request_lib.TrainRequest(job=job, args=job_args(), ppn=str(ppn), threads=str(threads), backend=backend,
                                     precision=precision)
        result = bench_lib.bench(open_cluster(_cluster(c, cluster)), str(nodes), req)
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
    req = kube_lib.KubeRequest(nodes=as_int(nodes or 2, "--nodes"), job=job, args=job_args(), image=image,
                               instance_type=instance_type, profile=profile, namespace=namespace, pvc=pvc)
    paths = kube_lib.render_kube(req, Path(out) if out else request_lib.RUNS / f"kube-{job}-{req.nodes}")
    print(f"wrote {paths['manifest']} and {paths['dockerfile']} (build context {paths['manifest'].parent}): "
          f"docker build -t {image} {paths['manifest'].parent} && kubectl create -f {paths['manifest']}")


ns = Collection(local_up, local_down, local_kill, keys, setup, doctor, train, stop, demo, bench, kube)
