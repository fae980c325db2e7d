"""`fab kube`: the same bundled job as a Kubeflow PyTorchJob, for clusters that run Kubernetes.

Renders into one folder, which is also the image's build context: pytorchjob.yaml, Dockerfile,
node_setup.sh (the profile's setup script: the image gets exactly the nodes' software) and a
copy of training/. Pod size comes from the instance type of the catalog: a pod takes its node
minus room for the kubelet and the OS, one training process per pod.
"""
from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cluster.shipping import PROJECT_ROOT
from core.catalog import CATALOG
from core.constants import REMOTE_VENV
from core.errors import ClusterError
from core.render import render
from launch.plan import launcher, request
from launch.staging import jobdata
from node_setup import profiles

log = logging.getLogger(__name__)

DEFAULT_INSTANCE = "r7iz.16xlarge"  # as infra/settings.py's instanceType default
MOUNT = "/pvc"
VENV = REMOTE_VENV
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"  # from google-perftools, in every profile
DEFAULT_BASE = "ubuntu:24.04"  # python 3.12: what the upstream profile needs


@dataclass
class KubeRequest:
    nodes: int
    job: str = "glue"
    args: list[str] = field(default_factory=list)
    out_dir: Path | None = None
    name: str | None = None
    namespace: str = "kubeflow"
    image: str = "xeon-cluster-train:latest"
    profile: str = "upstream"
    instance_type: str = DEFAULT_INSTANCE
    pvc: str = "xeon-cluster-pvc"
    base_image: str = DEFAULT_BASE


@dataclass
class PodSize:
    cpu: str
    memory: str
    threads: int
    shm: str
    precision: str


def pod_size(instance_type: str) -> PodSize:
    """A node's pod: its vCPUs and memory less a reserve for the kubelet, daemons and the OS."""
    if instance_type not in CATALOG:
        raise ClusterError(f"--instance-type {instance_type!r} is not in the catalog", fix=f"use one of "
                           f"{', '.join(CATALOG)} or add a row to core/catalog.py")
    it = CATALOG[instance_type]
    cpu = it.vcpus - max(2, it.vcpus // 16)
    memory = int(it.memory_gib * 0.9) - 2
    return PodSize(cpu=str(cpu), memory=f"{memory}Gi", threads=max(1, cpu // it.threads_per_core),
                   shm=f"{max(2, memory // 8)}Gi", precision="bf16" if it.amx else "fp32")


def validate(req: KubeRequest) -> None:
    if req.job not in launcher.JOBS:
        raise ClusterError(f"--job {req.job!r} is not a bundled job", fix=f"use one of: {', '.join(launcher.JOBS)}")
    if req.nodes < 1:
        raise ClusterError(f"--nodes {req.nodes} is below 1", fix="a PyTorchJob needs at least its master")
    name = req.name or default_name(req)
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise ClusterError(f"--name {name!r} is not a Kubernetes name", fix="use lower-case letters, digits and '-' "
                           "(at most 63 characters)")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", req.namespace):
        raise ClusterError(f"--namespace {req.namespace!r} is not a Kubernetes namespace", fix="use lower-case letters, "
                           "digits and '-' (at most 63 characters)")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", req.pvc):
        raise ClusterError(f"--pvc {req.pvc!r} is not a PersistentVolumeClaim name", fix="use lower-case letters, digits, "
                           "'-' and '.'")
    if not re.fullmatch(r"[A-Za-z0-9][\w.:/@-]*", req.image):
        raise ClusterError(f"--image {req.image!r} is not an image reference", fix="pass e.g. "
                           "registry.example.com/xeon-cluster-train:latest")
    for flag in ("--output_dir",):
        if any(a == flag or a.startswith(flag + "=") for a in req.args):
            raise ClusterError(f"{flag} is set by fab kube (under {MOUNT}/output/<name> on the PVC)", fix="drop it")
    jobdata.check(req.job, req.args, [])  # the job's numbers; its data files are on the PVC, not here


def default_name(req: KubeRequest) -> str:
    return f"xeon-{req.job}-{req.nodes}n"


def job_env(req: KubeRequest, size: PodSize, backend: str) -> list[tuple[str, str]]:
    env = [
        ("XC_BACKEND", backend),
        ("XC_PRECISION", size.precision),
        ("OMP_NUM_THREADS", str(size.threads)),
        ("KMP_BLOCKTIME", "1"),
        ("LD_PRELOAD", TCMALLOC),
        ("TOKENIZERS_PARALLELISM", "false"),
        # Caches on the PVC: hub downloads and the clm job's token files are made once for all pods.
        ("HF_HOME", f"{MOUNT}/hf_cache"),
        ("HF_DATASETS_CACHE", f"{MOUNT}/hf_cache/datasets"),
        ("XC_HOME", f"{MOUNT}/xeon-cluster"),
        ("LOGLEVEL", "INFO"),
    ]
    if backend == "ccl":
        env += [("CCL_WORKER_COUNT", "1"), ("CCL_ATL_TRANSPORT", "ofi")]
    return env


def render_kube(req: KubeRequest, out_dir: Path) -> dict[str, Path]:
    """Write pytorchjob.yaml, Dockerfile, node_setup.sh and training/ into out_dir."""
    validate(req)
    for flag, path in request.local_files(req.args):  # pods see the PVC and the image, not this machine
        if not path.startswith(MOUNT + "/"):
            log.warning("%s %s: the pods read it at that path; copy it to the PVC (%s/...) and pass that path",
                        flag, path, MOUNT)
    profile = profiles.load_profile(req.profile)
    size = pod_size(req.instance_type)
    name = req.name or default_name(req)
    backend = profile.backend
    command = ["python", *launcher.JOBS[req.job], *req.args, "--output_dir", f"{MOUNT}/output/{name}"]
    roles = [("Master", 1)] + ([("Worker", req.nodes - 1)] if req.nodes > 1 else [])
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".xc-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ClusterError(f"--out {out_dir} is not a writable folder ({exc.strerror})", fix="pass another with --out") from None
    manifest = render("pytorchjob.yaml.j2", name=name, namespace=req.namespace, job=req.job, nodes=req.nodes,
                      roles=roles, image=req.image, command=command, env=job_env(req, size, backend), cpu=size.cpu,
                      memory=size.memory, shm=size.shm, mount=MOUNT, pvc=req.pvc,
                      node_selector=[("node.kubernetes.io/instance-type", req.instance_type)])
    dockerfile = render("Dockerfile.j2", profile=profile.name, hash=profile.hash, image=req.image,
                        context=str(out_dir), base_image=req.base_image, venv=VENV)
    paths = {"manifest": out_dir / "pytorchjob.yaml", "dockerfile": out_dir / "Dockerfile",
             "setup": out_dir / "node_setup.sh", "training": out_dir / "training"}
    paths["manifest"].write_text(manifest)
    paths["dockerfile"].write_text(dockerfile)
    paths["setup"].write_text(profiles.render_setup_script(profile, venv=VENV))
    shutil.rmtree(paths["training"], ignore_errors=True)
    shutil.copytree(PROJECT_ROOT / "training", paths["training"],
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.tmp"))
    return paths
