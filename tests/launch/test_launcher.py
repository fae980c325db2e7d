"""The mpirun argv / environment builder and the templates it renders (pure; nothing runs)."""
import subprocess
from pathlib import Path

import pytest

from core.constants import HOME_EXPR
from core.render import render
from launch.plan import launcher, topology
from training.runtime.paths import RunPaths

DATA = Path(__file__).parents[1] / "data"


def plan(backend="gloo", nodes=2, ppn=None, overrides=None, pin=True):
    topo = topology.parse((DATA / "r7iz.metal-32xl.probe").read_text())
    layout = topology.derive_layout(topo, ppn=ppn, backend=backend)
    node_plans = tuple(launcher.NodePlan(f"node{i}", layout, topo.malloc) for i in range(nodes))
    return launcher.LaunchPlan(run_id="r1", nodes=node_plans, master_addr="10.0.0.10", master_port=29500,
                               backend=backend, precision="bf16", entry=("-m", "training.jobs.glue"),
                               args=("--learning_rate", "2e-5", "--output_dir", "out dir"),
                               env_overrides=overrides or {}, pin=pin)


def test_world_size_and_rank_to_host_follow_block_placement():
    p = plan(nodes=4)
    assert p.ppn == 2 and p.world_size == 8
    assert [p.rank_host(r) for r in range(8)] == ["node0", "node0", "node1", "node1", "node2", "node2",
                                                   "node3", "node3"]


def test_mpirun_argv_shape():
    argv = launcher.mpirun_argv(plan(), ssh_config="/home/u/.xeon-cluster/ssh/config", mpirun="/opt/v/bin/mpirun")
    p = plan()
    # node 0 at a private address: mpirun runs through the shim that finds its interface, with that address
    assert argv[:5] == ["sh", "-c", launcher.IFACE_SCRIPT, "/opt/v/bin/mpirun", p.master_addr]
    assert argv[5:11] == ["-f", "hostfile", "-n", "4", "-ppn", "2"]
    assert "-l" in argv  # rank prefixes on every line
    i = argv.index("-bootstrap-exec-args")
    assert argv[i + 1] == "-F /home/u/.xeon-cluster/ssh/config"
    assert "-genvnone" in argv  # nothing from node 0's shell leaks into the ranks
    assert argv[-4:] == ["--learning_rate", "2e-5", "--output_dir", "out dir"]  # job args untouched
    assert "runs/r1/rank.sh" in argv[len(argv) - argv[::-1].index("-c")]  # bash -c, after the shim's sh -c


def test_iface_shim_names_the_interface_that_holds_the_address(tmp_path):
    """Run for real: the shim puts -iface <the interface with that address> in front of mpirun's own flags."""
    argv = ["sh", "-c", launcher.IFACE_SCRIPT, "echo", "127.0.0.1", "-f", "hostfile"]
    assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split() == [
        "-iface", "lo", "-f", "hostfile"]
    argv[4] = "192.0.2.77"  # held by no interface here: mpirun's flags alone
    assert subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split() == ["-f", "hostfile"]
    assert launcher.iface_shim("mpirun", "127.0.0.2") == ["mpirun"]  # a local cluster: as before


def genv(argv):
    out = {}
    for i, a in enumerate(argv):
        if a == "-genv":
            out[argv[i + 1]] = argv[i + 2]
    return out


def test_gloo_env():
    env = genv(launcher.mpirun_argv(plan(), ssh_config="c"))
    assert env["OMP_NUM_THREADS"] == "32"
    assert env["MASTER_ADDR"] == "10.0.0.10" and env["MASTER_PORT"] == "29500"
    assert env["XC_BACKEND"] == "gloo" and env["XC_PRECISION"] == "bf16"
    assert env["I_MPI_PIN"] == "0"  # rank.sh pins per node
    assert not any(k.startswith("CCL_") for k in env)


def test_no_pin_leaves_placement_to_the_os():
    # I_MPI_PIN=1 would turn Intel MPI's own pinning on: --no-pin must not pin by any route
    env = genv(launcher.mpirun_argv(plan(pin=False), ssh_config="c"))
    assert env["I_MPI_PIN"] == "0"


def test_ccl_env_and_worker_affinity():
    p = plan(backend="ccl", ppn=2)
    env = genv(launcher.mpirun_argv(p, ssh_config="c"))
    assert env["CCL_WORKER_COUNT"] == "2"
    assert env["OMP_NUM_THREADS"] == "30"
    assert env["CCL_ATL_TRANSPORT"] == "ofi"
    node_env = launcher.node_env(p, p.nodes[0])
    assert node_env["CCL_WORKER_AFFINITY"] == "30,31,62,63"
    assert node_env["LD_PRELOAD"].endswith("libtcmalloc.so.4")


def test_overrides_win_over_derived_values():
    p = plan(overrides={"OMP_NUM_THREADS": "7", "LD_PRELOAD": ""})
    env = genv(launcher.mpirun_argv(p, ssh_config="c"))
    assert env["OMP_NUM_THREADS"] == "7"
    assert "LD_PRELOAD" not in launcher.node_env(p, p.nodes[0])


def test_rendered_node_env_and_rank_script_are_valid_bash(tmp_path):
    p = plan(backend="ccl", ppn=2)
    env_sh = render("node_env.sh.j2", run_id="r1", node="node0", python="/opt/x/bin/python",
                    code_dir="/home/u/.xeon-cluster/code/abc", rank_cpus=launcher.rank_cpus(p.nodes[0]),
                    env=sorted(launcher.node_env(p, p.nodes[0]).items()))
    assert "export XC_CPUS_0=" + ",".join(map(str, range(32))) in env_sh
    assert "export CCL_WORKER_AFFINITY=30,31,62,63" in env_sh
    rank_sh = render("rank.sh.j2", run_id="r1", run_dir=RunPaths("r1", HOME_EXPR).node, pin="yes",
                     entry=launcher.shell_join(list(p.entry)))
    assert "{{" not in env_sh + rank_sh
    for name, text in (("env.sh", env_sh), ("rank.sh", rank_sh)):
        f = tmp_path / name
        f.write_text(text)
        subprocess.run(["bash", "-n", str(f)], check=True)
    # the environment file really exports what it says
    out = subprocess.run(["bash", "-c", f"source {tmp_path / 'env.sh'}; echo $XC_CPUS_1; echo $XC_PYTHON"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [",".join(map(str, range(32, 64))), "/opt/x/bin/python"]


def test_hostfile_and_ssh_config_templates():
    from cluster.node import Node

    nodes = [Node(f"node{i}", f"203.0.113.{i}", f"10.0.0.{i}", "ubuntu", 22, i) for i in range(3)]
    assert render("hostfile.j2", nodes=nodes).split() == ["node0", "node1", "node2"]
    cfg = render("ssh_config.j2", cluster="c", nodes=nodes, ssh_dir="/h/ssh")
    assert "StrictHostKeyChecking yes" in cfg
    assert cfg.count("StrictHostKeyChecking") == 1  # one setting, and it is yes
    assert "HostName 10.0.0.2" in cfg  # private addresses inside the cluster
    assert "UserKnownHostsFile /h/ssh/known_hosts" in cfg


def test_shell_join_quotes():
    assert launcher.shell_join(["a b", "c"]) == "'a b' c"


@pytest.mark.parametrize("job", list(launcher.JOBS))
def test_every_bundled_job_is_an_importable_module(job):
    import importlib

    kind, module = launcher.JOBS[job]
    assert kind == "-m"
    assert hasattr(importlib.import_module(module), "main")


def _run_rank_sh(tmp_path, env: dict) -> dict:
    """Execute the real rank.sh as mpirun would start it, with a python entry that prints its environment."""
    import json as _json
    import sys as _sys

    run_dir = tmp_path / "home" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "node_env.sh").write_text(render("node_env.sh.j2", run_id="r1", node="node0", python=_sys.executable,
                                                code_dir=str(tmp_path), rank_cpus=[], env=[]))
    entry = launcher.shell_join(["-c", "import json, os; print(json.dumps(dict(os.environ)))"])
    (run_dir / "rank.sh").write_text(render("rank.sh.j2", run_id="r1", run_dir=RunPaths("r1", HOME_EXPR).node,
                                                      pin="no", entry=entry))
    out = subprocess.run(["bash", str(run_dir / "rank.sh")], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "XC_HOME": str(tmp_path / "home"), **env}).stdout
    return _json.loads(out)


def test_rank_script_completes_oneccls_local_pair(tmp_path):
    # oneCCL with CCL_PROCESS_LAUNCHER=none reads a rank's place on its node only from BOTH variables
    env = _run_rank_sh(tmp_path, {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "CCL_LOCAL_SIZE": "2"})
    assert (env["CCL_LOCAL_RANK"], env["CCL_LOCAL_SIZE"]) == ("1", "2")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")


def test_rank_script_sets_no_ccl_variables_for_gloo(tmp_path):
    env = _run_rank_sh(tmp_path, {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"})
    assert not any(k.startswith("CCL_") for k in env)


def _own_address() -> tuple[str, str] | None:
    """(address, interface) of this machine's first non-loopback IPv4 interface."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], check=False, capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields[1] != "lo":
            return fields[3].split("/")[0], fields[1]
    return None


def test_rank_script_names_gloos_interface_where_node_0_is_reached(tmp_path):
    """On AWS a node's host name resolves to 127.0.1.1 (cloud-init's hosts line), so gloo would bind and advertise
    loopback: rank.sh names the interface that holds the route to MASTER_ADDR (here node 0 is this machine, as on
    node 0 itself, whose route is `local ... dev lo`). A loopback master (the local cluster) and a user's own value
    are left alone."""
    own = _own_address()
    if own is None:
        pytest.skip("this machine has no non-loopback IPv4 interface to route to")
    address, iface = own
    assert _run_rank_sh(tmp_path / "a", {"MASTER_ADDR": address})["GLOO_SOCKET_IFNAME"] == iface
    assert "GLOO_SOCKET_IFNAME" not in _run_rank_sh(tmp_path / "b", {"MASTER_ADDR": "127.0.0.2"})
    assert _run_rank_sh(tmp_path / "c", {"MASTER_ADDR": address, "GLOO_SOCKET_IFNAME": "x0"})["GLOO_SOCKET_IFNAME"] == "x0"


def test_ccl_plan_sends_the_local_size_for_rank_sh_to_pair():
    p = plan(backend="ccl", ppn=2)
    env = genv(launcher.mpirun_argv(p, ssh_config="c"))
    assert env["CCL_PROCESS_LAUNCHER"] == "none" and env["CCL_LOCAL_SIZE"] == "2"


def test_a_failed_rank_is_named_with_its_exceptions_own_line():
    from launch.life.stream import failed_rank

    p = plan(nodes=2, ppn=1)
    lines = ["[0] [progress] step 1/10", "[1] Traceback (most recent call last):",
             '[1]   File "/x/training/jobs/glue.py", line 90, in load', "[1]     raise ValueError(msg)",
             "[1] KeyError: 'label'", "[1] ", "[1] During handling of the above exception, another exception occurred:",
             "[1] Traceback (most recent call last):", '[1]   File "/x/training/jobs/glue.py", line 95, in load',
             "[1] ValueError: data/0-train.csv has no column 'label'; name the label column --label_column",
             "[0] Traceback (most recent call last):", "[0] RuntimeError: Connection closed by peer",
             "===================================================================================",
             "=   RANK 1 PID 4321 RUNNING AT node1", "=   EXIT CODE: 1"]
    reason = ("rank 1 on node1 failed: ValueError: data/0-train.csv has no column 'label'; name the label column "
              "--label_column")
    assert failed_rank(lines, p) == ("node1", reason)
    # torch's '[rankN]: ' prefix, once the process group is up
    torch_lines = ["[0] [rank0]: Traceback (most recent call last):", '[0] [rank0]:   File "/x/trainer.py", line 1',
                   "[0] [rank0]: TypeError: BF16 all reduce communication hook required CUDA 11+"]
    assert failed_rank(torch_lines, p) == ("node0", ("rank 0 on node0 failed: TypeError: BF16 all reduce "
                                                    "communication hook required CUDA 11+"))
    # without a traceback: Intel MPI's block
    assert failed_rank(lines[-3:], p) == ("node1", "rank 1 on node1 exit code: 1")
    # rank 1 killed: rank 0's traceback only says its peer went away; mpirun names the rank that died
    killed = ["[0] [rank0]: Traceback (most recent call last):", '[0] [rank0]:   File "/x/spot.py", line 264',
              ("[0] [rank0]: RuntimeError: [/w/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:58554. This is typically caused by a remote worker crashing."),
              "===================================================================================",
              "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "=   RANK 1 PID 5943 RUNNING AT node1",
              "=   KILLED BY SIGNAL: 9 (Killed)"]
    dead = "rank 1 on node1 killed by signal: 9 (killed) (rank 0 then lost its connection to it)"
    assert failed_rank(killed, p) == ("node1", dead)
    # a rank that failed on its own keeps its own line, whatever mpirun says of the others
    assert failed_rank(torch_lines + killed[-4:], p)[0] == "node0"


def test_gradients_go_on_the_wire_in_bf16_between_hosts_and_fp32_within_one():
    from launch.plan.request import TrainRequest, run_env

    hosts = ["10.0.1.5", "10.0.1.6"]
    # auto: bf16 between hosts (half the bytes on a real link), fp32 on loopback (bench/scaling_twin.py, README)
    assert run_env(TrainRequest(), hosts)["XC_COMM_HOOK"] == "bf16"
    assert run_env(TrainRequest(), ["198.18.0.2", "198.18.0.3"])["XC_COMM_HOOK"] == "bf16"  # the netns twin
    assert run_env(TrainRequest(), ["127.0.0.2", "127.0.0.3"])["XC_COMM_HOOK"] == "none"  # local cluster
    assert run_env(TrainRequest(), ["10.0.1.5"])["XC_COMM_HOOK"] == "none"  # one node: no wire between hosts
    assert run_env(TrainRequest.of(comm_hook="none"), hosts)["XC_COMM_HOOK"] == "none"
    assert run_env(TrainRequest.of(comm_hook="bf16"), ["127.0.0.2", "127.0.0.3"])["XC_COMM_HOOK"] == "bf16"
    assert run_env(TrainRequest.of(env={"XC_COMM_HOOK": "fp16"}), hosts)["XC_COMM_HOOK"] == "fp16"  # --env has the last word
    env = launcher.global_env(plan(overrides=run_env(TrainRequest.of(comm_hook="fp16"), hosts)))
    assert env["XC_COMM_HOOK"] == "fp16"
