"""The mpirun command line and environments for a run (pure: builds, never executes).

Layout per node comes from launch.plan.topology.derive_layout; what reaches the ranks is
- global variables through `-genv` (mpirun runs with -genvnone so nothing else leaks in),
- per-node variables (CPU lists, CCL worker affinity, malloc preload) in node_env.sh,
- secret --env values in secrets.env (mode 0600, removed after the run; see launch.staging.secrets),
- pinning by rank.sh with taskset, because nodes may differ in their CPU sets.
"""
from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field

from core.constants import HOME_EXPR
from training.runtime.paths import RunPaths

JOBS = {
    "glue": ("-m", "training.jobs.glue"),
    "qa": ("-m", "training.jobs.qa"),
    "clm": ("-m", "training.jobs.clm"),
}


@dataclass(frozen=True)
class NodePlan:
    name: str
    layout: object  # launch.plan.topology.Layout
    malloc: str | None = None


@dataclass(frozen=True)
class LaunchPlan:
    run_id: str
    nodes: tuple[NodePlan, ...]
    master_addr: str
    master_port: int
    backend: str  # resolved: "ccl" or "gloo"
    precision: str  # resolved: "bf16" or "fp32"
    entry: tuple[str, ...]  # ("-m", "training.jobs.glue") or ("script.py",)
    args: tuple[str, ...] = ()
    env_overrides: dict = field(default_factory=dict)
    secret_env: dict = field(default_factory=dict, repr=False)  # never on mpirun's line: secrets.env per node
    pin: bool = True
    timeout_s: int = 300
    launcher: str = "python"  # or "accelerate": `accelerate launch` per rank (launch_words)
    workdir: object = field(default=None, compare=False)  # launch.staging.workdir.Workdir: --workdir, scanned and hashed

    @property
    def ppn(self) -> int:
        return self.nodes[0].layout.ppn

    @property
    def world_size(self) -> int:
        return self.ppn * len(self.nodes)

    def rank_host(self, rank: int) -> str:
        return self.nodes[rank // self.ppn].name


def global_env(plan: LaunchPlan) -> dict[str, str]:
    layout = plan.nodes[0].layout
    env = {
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port),
        "XC_RUN_ID": plan.run_id,
        "XC_BACKEND": plan.backend,
        "XC_PRECISION": plan.precision,
        "XC_DIST_TIMEOUT": str(plan.timeout_s),
        "OMP_NUM_THREADS": str(layout.omp_threads),
        "TOKENIZERS_PARALLELISM": "false",
        # Intel OpenMP (when preloaded): spin briefly, one thread per physical core.
        "KMP_BLOCKTIME": "1",
        "KMP_HW_SUBSET": "1T",
        # rank.sh pins (per-node CPU sets); without --no-pin placement is the OS's: Intel MPI never pins.
        "I_MPI_PIN": "0",
        # An unchanged Trainer or accelerate script on a machine without a GPU joins the ranks into one
        # MULTI_CPU job only when told it runs on CPU (the seeds' --no_cuda, now --use_cpu): transformers'
        # TrainingArguments and accelerate's AcceleratorState both read this (transformers 5.23, accelerate 1.15).
        "ACCELERATE_USE_CPU": "true",
    }
    if plan.backend == "ccl":
        env.update(CCL_WORKER_COUNT=str(layout.ccl_workers), CCL_ATL_TRANSPORT="ofi", CCL_PROCESS_LAUNCHER="none",
                   CCL_LOCAL_SIZE=str(plan.ppn))
    env.update({k: str(v) for k, v in plan.env_overrides.items()})
    return env


def node_env(plan: LaunchPlan, node: NodePlan) -> dict[str, str]:
    env = {}
    if plan.backend == "ccl" and node.layout.ccl_cpus:
        env["CCL_WORKER_AFFINITY"] = ",".join(map(str, node.layout.ccl_cpus))
    if node.malloc:
        env["LD_PRELOAD"] = node.malloc
    return {k: v for k, v in env.items() if k not in plan.env_overrides and k not in plan.secret_env}


def rank_cpus(node: NodePlan) -> list[tuple[int, str]]:
    """Local rank -> its CPUs (compute threads and its CCL workers share the rank's cores)."""
    return [(lr, ",".join(map(str, cpus))) for lr, cpus in enumerate(node.layout.rank_cpus)]


# The other nodes' proxies connect back to mpirun by node 0's host name, which on AWS (<cluster>-<instance id>, set at
# boot) resolves on node 0 alone: the AWS twin showed it (getaddrinfo failed on node 1). The interface that holds node
# 0's private address makes Hydra hand out that address instead; where none holds it (a NAT), Hydra keeps its way.
IFACE_SCRIPT = ('iface=$(ip -o -4 addr show 2>/dev/null | awk -v a="$1" \'{split($4, p, "/"); if (p[1] == a) print $2}\' '
                '| head -n 1); shift; exec "$0" ${iface:+-iface "$iface"} "$@"')


def iface_shim(mpirun: str, address: str) -> list[str]:
    """mpirun, run with -iface <the interface holding address> as found on node 0 itself (not for a loopback
    address: a local cluster's nodes all resolve each other)."""
    if ipaddress.ip_address(address).is_loopback:
        return [mpirun]
    return ["sh", "-c", IFACE_SCRIPT, mpirun, address]


def mpirun_argv(plan: LaunchPlan, ssh_config: str, mpirun: str = "mpirun") -> list[str]:
    """Intel MPI: hostfile order = node order, block placement, output lines prefixed by rank."""
    argv = [*iface_shim(mpirun, plan.master_addr), "-f", "hostfile", "-n", str(plan.world_size), "-ppn", str(plan.ppn),
            "-l", "-bootstrap", "ssh", "-bootstrap-exec-args", f"-F {ssh_config}", "-genvnone"]
    for key, value in global_env(plan).items():
        argv += ["-genv", key, value]
    rank_sh = f'exec {RunPaths(plan.run_id, HOME_EXPR).rank_script} "$@"'
    argv += ["bash", "-c", rank_sh, "rank.sh", *plan.args]
    return argv


def launch_words(plan: LaunchPlan) -> str:
    """What rank.sh runs the entry with. `accelerate launch` (as `mpirun ... accelerate launch main.py` in the
    Intel seed) starts exactly one process per rank: --cpu (ACCELERATE_USE_CPU, so Accelerator() and the Trainer
    go MULTI_CPU, and no config file of the node's steers it), the world from the plan, the rendezvous from
    MASTER_ADDR/MASTER_PORT; it reads RANK/WORLD_SIZE/LOCAL_RANK as rank.sh exports them."""
    if plan.launcher != "accelerate":
        return '"$XC_PYTHON"'
    mixed = "bf16" if plan.precision == "bf16" else "no"
    return ('"$XC_PYTHON" -m accelerate.commands.launch --cpu --quiet '
            f"--num_machines {len(plan.nodes)} --num_processes {plan.world_size} "
            f'--machine_rank "$(( ${{RANK:-0}} / {plan.ppn} ))" --main_process_ip "$MASTER_ADDR" '
            f'--main_process_port "$MASTER_PORT" --mixed_precision {mixed} --dynamo_backend no')


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
