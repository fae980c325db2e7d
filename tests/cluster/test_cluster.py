"""Integration on a real local cluster: sshd nodes on loopback, real SSH, real Intel MPI, real training."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PACE, processes_with_cmdline, processes_with_env, start_cluster, wait_until

from launch.life import records
from launch.run import DEMO_ARGS
from training.runtime import events

pytestmark = pytest.mark.cluster

TINY_ARGS = ["--num_train_epochs", "1", "--per_device_train_batch_size", "8", "--max_train_samples", "32",
             "--max_eval_samples", "32"]


def node_home(lc, name):
    return lc.state / "nodes" / name / "home"


def test_keys_give_node0_verified_ssh_to_every_node(cluster2):
    first = cluster2.fab("keys", check=True)
    assert "2 node(s) authorized" in first.stdout
    again = cluster2.fab("keys", check=True)
    assert "(0 new)" in again.stdout  # idempotent
    ssh_dir = node_home(cluster2, "node0") / "ssh"
    assert (ssh_dir / "id_ed25519").stat().st_mode & 0o777 == 0o600
    known = (ssh_dir / "known_hosts").read_text().splitlines()
    for i, line in enumerate(known):  # each entry is the node's real host key
        host_pub = (cluster2.state / "nodes" / f"node{i}" / "ssh_host_ed25519_key.pub").read_text().split()
        assert line.split()[1:] == host_pub[:2]
        assert line.startswith(f"[127.0.0.{2 + i}]:{cluster2.port} ")
    cfg = (ssh_dir / "config").read_text()
    assert "StrictHostKeyChecking yes" in cfg
    # node 0's config reaches node1 ...
    ok = subprocess.run(["ssh", "-F", str(ssh_dir / "config"), "node1", "echo $XC_NODE"],
                        capture_output=True, text=True, timeout=30, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == "node1"
    # ... and refuses a node whose host key does not match (checking is really on)
    bad_known = ssh_dir.parent / "bad_known_hosts"
    other = (cluster2.state / "nodes" / "node0" / "ssh_host_ed25519_key.pub").read_text().split()
    bad_known.write_text(f"[127.0.0.3]:{cluster2.port} {other[0]} {other[1]}\n")
    bad = subprocess.run(["ssh", "-F", str(ssh_dir / "config"), "-o", f"UserKnownHostsFile={bad_known}",
                          "node1", "true"], capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode != 0 and "host key" in bad.stderr.lower()
    # the private key never reaches the terminal
    assert "PRIVATE KEY" not in first.stdout + first.stderr


def test_the_probe_times_bf16_against_fp32_only_where_amx_does_not_settle_it(cluster2, monkeypatch, tmp_path):
    import dataclasses

    from cluster import local, remote
    from launch.plan import probe, topology
    from training.speed import mfu

    parse = topology.parse

    def flags(add, drop):  # the node's real lscpu, with its bf16 flags set as a CPU of that kind has them
        return lambda text: dataclasses.replace(parse(text), flags=(parse(text).flags - drop) | add)

    node = local.nodes(cluster2.state)[1]
    monkeypatch.setattr(topology, "parse", flags({"avx512_bf16"}, {"amx_bf16", "amx_tile"}))
    # its own cache file: other workers' runs on this machine share the real one (~/.cache/xeon-cluster)
    name = f"xeon-cluster/test-{os.getpid()}-{time.monotonic_ns()}.json"
    own = tmp_path / "mfu.py"
    own.write_text(probe.MFU_PY.read_text().replace(f'CACHE_NAME = "{mfu.CACHE_NAME}"', f'CACHE_NAME = "{name}"'))
    assert name in own.read_text()
    monkeypatch.setattr(probe, "MFU_PY", own)
    with remote.connect(node) as conn:  # where the node's sessions keep it (a local node shares this machine's home)
        cache = Path(remote.run(conn, "echo ${XDG_CACHE_HOME:-$HOME/.cache}").stdout.strip()) / name
    # real SSH; training/speed/mfu.py sent whole as `python -c` and run by the node's python on real matmuls
    first = probe.probe(node)
    speedup = first.bf16_speedup
    assert speedup is not None and 0.01 < speedup < 100 and not first.bf16_remembered, first
    assert [e["bf16_speedup"] for e in json.loads(cache.read_text())["entries"]] == [pytest.approx(speedup, abs=1e-3)]
    again = probe.probe(node)  # the node's answer is kept: the next run neither starts torch nor times matmuls
    assert again.bf16_remembered and again.bf16_speedup == speedup
    cache.unlink()
    assert probe.probe(node, time_bf16=False).bf16_speedup is None  # --precision bf16 or fp32: nothing timed
    monkeypatch.setattr(topology, "parse", flags({"avx512_bf16", "amx_bf16", "amx_tile"}, set()))
    assert probe.probe(node).bf16_speedup is None  # AMX settles it


@pytest.mark.slow
def test_two_node_glue_run_learns_and_records_everything(uninterrupted_demo):
    res = uninterrupted_demo()  # the demo's arguments on 2 nodes (glue, the default job)
    assert res["returncode"] == 0 and res["run_dir"], res["stdout"][-3000:] + res["stderr"][-3000:]
    out = res["stdout"]
    # every rank's start-up line, prefixed with rank and host, streamed through
    assert "[0 node0] rank 0/2" in out and "[1 node1] rank 1/2" in out
    assert "backend=gloo" in out
    assert "[0 node0] [progress] step" in out
    run_dir = Path(res["run_dir"])
    results = json.loads((run_dir / "results.json").read_text())
    summary = records.load(run_dir).to_json()
    assert results["world_size"] == 2 and results["backend"] == "gloo" and results["job"] == "glue"
    ev = results["eval"]
    assert ev["eval_accuracy"] > ev["eval_majority_rate"] + 0.05, ev
    assert results["train"]["train_samples_per_second"] > 0
    assert summary["status"] == "ok" and summary["wall_s"] > 0
    assert summary["env"]["OMP_NUM_THREADS"] == "1"  # each local node owns one core of this machine
    # auto gives fp32 gradients on loopback; DDP's own timings and the run's MFU are measured, not assumed
    assert results["comm_hook"] == "none" and summary["spec"]["speed"]["comm_hook"] == "auto"
    ddp = results["ddp"]
    assert ddp["comm_ms"] > 0 and ddp["backward_compute_ms"] > 0 and 0 <= ddp["comm_exposed_ms"] <= ddp["comm_ms"]
    assert ddp["gradient_as_bucket_view"] is True and ddp["comm_hook"] is None  # DDP's own account of its settings
    mfu = results["mfu"]
    assert mfu["peak_flops_per_s"] > 1e9 and 0 < mfu["mfu"] < 1 and mfu["precision"] == results["precision"]
    assert mfu["model_flops_per_s"] == pytest.approx(results["train"]["total_flos"] / results["train"]["train_runtime"])
    # the path each kernel took, from the run's own calls; bf16-only kernels say why not in fp32
    speed, native = results["speed"], "native" if shutil.which("gcc") else "torch: the library could not be built"
    assert speed["model"] == "eager" and speed["dropout"].startswith(native)
    assert speed["fast_dropout"] is True and speed["freeze_embeddings"] is True  # the levers speed.apply chose
    assert speed["bf16_weights"] is speed["master_clip"] is (results["precision"] == "bf16")
    if results["precision"] == "fp32":
        assert speed["output"] == "torch (the kernel is for bf16 weights and activations on the CPU)"
    else:
        assert speed["output"].startswith(native) and speed["adamw"].startswith(native), speed
    assert set(summary["topology"]) == {"node0", "node1"}
    assert summary["command"][0].endswith("mpirun")
    assert (run_dir / "log.txt").read_text().count("[progress]") >= 5
    # every rank's events came home as data, the same steps the log's readable lines say
    ran = events.read_jsonl((run_dir / events.RUN_FILE).read_text())
    assert {e.rank for e in ran if e.kind == events.FINISHED} == {0, 1}
    assert [e.step for e in ran if e.kind == events.PROGRESS] == events.steps((run_dir / "log.txt").read_text())
    assert "mpirun" in (run_dir / "command.sh").read_text()
    # two balanced classes start near ln 2 = 0.69 per example whatever the node count; the Trainer's
    # world-size multiplication of a mean loss showed ~1.39 on 2 nodes (and doubled the gradients)
    state = json.loads((run_dir / "output" / "trainer_state.json").read_text())
    first = next(e["loss"] for e in state["log_history"] if "loss" in e)
    assert 0.4 < first < 0.95, first


def test_comm_hook_bf16_reaches_ddp_on_both_nodes(cluster2, small_model):
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--comm-hook", "bf16", "--", *TINY_ARGS, "--model_name_or_path", small_model,
                       timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "gradients on the wire: bf16 (--comm-hook none for fp32)" in res.stdout
    run_dir = cluster2.runs / (cluster2.run_dirs() - before).pop()
    results = json.loads((run_dir / "results.json").read_text())
    assert results["comm_hook"] == "bf16"
    assert results["ddp"]["comm_hook"] == "xc_bfloat16_wire_hook"  # DDP itself names the hook it ran
    assert results["ddp"]["gradient_as_bucket_view"] is True


def test_user_script_runs_unchanged_with_rank_variables(cluster2, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()} on {os.environ[\"XC_NODE\"]} sum {t.item():.0f} '\n"
        "      f'threads {os.environ[\"OMP_NUM_THREADS\"]} args {sys.argv[1:]}')\n"
        "dist.destroy_process_group()\n")
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), "--", "--flag", "a b", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "[0 node0] rank 0 of 2 on node0 sum 3 threads 1 args ['--flag', 'a b']" in res.stdout
    assert "[1 node1] rank 1 of 2 on node1 sum 3" in res.stdout


def test_killed_rank_fails_the_whole_job_quickly_and_leaves_nothing(cluster2, small_model):
    before = cluster2.run_dirs()
    with cluster2.start("train", "--nodes", "2", "--", "--num_train_epochs", "50", "--per_device_train_batch_size", "8",
                        "--model_name_or_path", small_model, merge=True) as running:
        running.wait_for("[progress] step", 240)
        run_id = (cluster2.run_dirs() - before).pop()
        victims = [p for p in processes_with_env(f"XC_RUN_ID={run_id}")
                   if p in processes_with_env("PMI_RANK=1")
                   and b"python" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert victims, "rank 1's python process not found"
        killed_at = time.monotonic()
        os.kill(victims[0], signal.SIGKILL)
        ended = running.finish(90)
        elapsed = time.monotonic() - killed_at
    out = ended.stdout
    assert ended.returncode != 0
    assert elapsed < 60, f"job took {elapsed:.0f}s to fail"
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: run") and "node1" in last, last
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "failed" and summary["failed_node"] == "node1"
    assert not (cluster2.runs / run_id / "results.json").exists()  # no partial result presented


def test_a_run_on_fewer_nodes_keeps_node0s_view_of_the_whole_cluster(cluster2, tmp_path):
    """mpirun on node 0 reaches the nodes through its ssh config and known_hosts: a 1-node run must not
    leave them naming node 0 alone, or fab doctor (and the next 2-node run) cannot reach node1."""
    from conftest import free_cluster_port

    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    assert cluster2.fab("keys", timeout=120).returncode == 0
    ran = cluster2.fab("train", "--nodes", "1", "--script", str(script), timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    ssh_dir = node_home(cluster2, "node0") / "ssh"
    assert "Host node1" in (ssh_dir / "config").read_text()
    assert f"[127.0.0.3]:{cluster2.port} " in (ssh_dir / "known_hosts").read_text()
    doc = cluster2.fab("doctor", "--master-port", str(free_cluster_port(1)), timeout=300)
    assert doc.returncode == 0, doc.stdout[-3000:] + doc.stderr[-2000:]
    assert "FAIL" not in doc.stdout and "verdict: healthy" in doc.stdout


def test_master_port_is_free_per_run_and_a_held_one_is_refused_before_launch(cluster2, tmp_path):
    import socket

    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    with socket.socket() as held:  # another run, or another local cluster's node 0, on the default port
        held.bind(("", 29500))
        held.listen()
        before = cluster2.run_dirs()
        refused = cluster2.fab("train", "--script", str(script), "--master-port", "29500", timeout=120)
        assert refused.returncode == 1
        last = refused.stderr.strip().splitlines()[-1]
        assert last.startswith("error: --master-port 29500 is in use on node0 (") and "leave --master-port out" in last
        assert cluster2.run_dirs() == before  # refused before the run folder
        ran = cluster2.fab("train", "--script", str(script), timeout=300)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    summary = records.load(cluster2.runs / (cluster2.run_dirs() - before).pop()).to_json()
    port = int(summary["env"]["MASTER_PORT"])
    assert port != 29500 and 1024 <= port <= 65535
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port < ephemeral  # no outgoing connection can take it before rank 0 listens


def test_missing_sshd_is_reported_with_the_install_command(monkeypatch):
    from cluster import local
    from core.errors import ClusterError

    monkeypatch.setattr(local.shutil, "which", lambda name: None)
    monkeypatch.setattr(local.os, "access", lambda path, mode: False)
    with pytest.raises(ClusterError, match="apt-get install openssh-server"):
        local.sshd_binary()


def test_local_down_stops_exactly_its_own_processes(tmp_path):
    lc = start_cluster(tmp_path, 2)  # own cluster: local-down stops it
    pids = [n["pid"] for n in json.loads((lc.state / "state.json").read_text())["nodes"]]
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert all(os.path.exists(f"/proc/{p}") for p in pids)
        res = lc.fab("local-down", check=True)
        assert "2 node(s) stopped" in res.stdout
        for p in pids:
            stat = f"/proc/{p}/stat"
            assert not os.path.exists(stat) or Path(stat).read_text().split(")")[1].split()[0] == "Z"
        assert bystander.poll() is None  # an unrelated process is untouched
    finally:
        bystander.kill()
    assert "no local cluster" in lc.fab("local-down", check=True).stdout


def test_four_node_run(tmp_path, small_model):
    lc = start_cluster(tmp_path, 4)  # own cluster: four nodes
    try:
        res = lc.fab("train", "--nodes", "4", "--", *TINY_ARGS, "--model_name_or_path", small_model, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        for i in range(4):
            assert f"[{i} node{i}] rank {i}/4" in res.stdout
        results = json.loads(next(lc.runs.iterdir()).joinpath("results.json").read_text())
        assert results["world_size"] == 4
    finally:
        lc.fab("local-down")


def test_listens_names_the_process_that_holds_the_port():
    import socket

    from cluster.local import listens

    with socket.socket() as s:
        s.bind(("127.0.0.5", 0))
        port = s.getsockname()[1]
        assert not listens(os.getpid(), "127.0.0.5", port)  # bound, not listening
        s.listen()
        assert listens(os.getpid(), "127.0.0.5", port)
        assert not listens(os.getppid(), "127.0.0.5", port)  # another process
        assert not listens(os.getpid(), "127.0.0.6", port)  # another address


def test_local_up_on_a_port_another_process_holds_fails_naming_the_node(tmp_path):
    import socket

    from conftest import LocalCluster, fab, free_cluster_port

    lc = LocalCluster(tmp_path / "state", tmp_path / "runs", 2, free_cluster_port(2))
    with socket.socket() as held:  # node1's address and port, taken by someone else
        held.bind(("127.0.0.3", lc.port))
        held.listen()
        res = fab("local-up", "--nodes", "2", "--port", str(lc.port), env=lc.env, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == (f"error: node1: port 127.0.0.3:{lc.port} is already in use by "
                                                    "another process; pick another with --port")
    assert not (lc.state / "state.json").exists()
    # node0's sshd, started before node1 failed, was stopped again
    cfg = str(lc.state / "nodes" / "node0" / "sshd_config")
    assert processes_with_cmdline(cfg) == []


def test_a_corrupt_state_file_is_one_line_and_local_down_still_stops_the_nodes(tmp_path):
    from conftest import fab

    lc = start_cluster(tmp_path, 2)  # own cluster: its state file is corrupted
    (lc.state / "state.json").write_text('{"port": 1, "nodes": [{"pid": ')  # a half-written file
    res = lc.fab("train", "--nodes", "2", "--script", __file__, timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: the local cluster's state file {lc.state / 'state.json'} is corrupt; run 'fab local-down' (it finds "
        "the nodes' sshd by their config files) and then 'fab local-up'")
    down = fab("local-down", env=lc.env, timeout=60)
    assert down.returncode == 0 and down.stdout.strip() == "local cluster down: 2 node(s) stopped", down.stdout
    assert processes_with_cmdline(str(lc.state / "nodes")) == []
    assert fab("local-up", "--nodes", "2", "--port", str(lc.port), env=lc.env, timeout=60).returncode == 0
    fab("local-down", env=lc.env, timeout=60)


def test_one_ctrl_c_stops_the_run_within_seconds_and_leaves_nothing(cluster2, small_model):
    before = cluster2.run_dirs()
    with cluster2.start("train", "--nodes", "2", "--save-every", "0", *PACE, "--", *DEMO_ARGS, "--model_name_or_path",
                        small_model) as running:
        running.wait_for("[progress] step", 400)
        running.signal(signal.SIGINT)
        pressed = time.monotonic()
        ended = running.finish(120)
        took = time.monotonic() - pressed
    out, err = ended.stdout, ended.stderr
    print(f"Ctrl-C to exit: {took:.1f}s")
    assert ended.returncode == 130, out + err
    assert took < 10, f"{took:.1f}s from Ctrl-C to exit"
    run_id = (cluster2.run_dirs() - before).pop()
    assert "interrupted: stopping every rank" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"run {run_id} interrupted after ") and "nothing is left running (checked on every node)" in last
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130
    assert not (cluster2.runs / run_id / "results.json").exists()
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []


def test_a_rank_that_raises_is_named_with_its_exception_not_traceback(cluster2, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('the CSV has no rows')\n"
                      "import time\ntime.sleep(60)\n")
    before = cluster2.run_dirs()
    started = time.monotonic()
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), timeout=300)
    took = time.monotonic() - started
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert "rank 1 on node1 failed: ValueError: the CSV has no rows" in last, last
    assert took < 60, f"{took:.0f}s: rank 0 was not stopped when rank 1 died"
    summary = records.load(cluster2.runs / (cluster2.run_dirs() - before).pop()).to_json()
    assert summary["reason"] == "rank 1 on node1 failed: ValueError: the CSV has no rows"
    assert summary["failed_node"] == "node1"


def test_one_run_at_a_time_and_an_orphaned_run_is_found_and_stopped(cluster2, tmp_path):
    import re

    from conftest import free_cluster_port

    hello = tmp_path / "hello.py"
    hello.write_text("print('hello')\n")
    quiet = tmp_path / "quiet.py"  # a long step that prints nothing: nothing tells mpirun its reader is gone
    quiet.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    before = cluster2.run_dirs()
    with cluster2.start("train", "--nodes", "2", "--script", str(quiet), merge=True) as running:
        running.wait_for("started", 240, count=2)
        run_a = (cluster2.run_dirs() - before).pop()
        second = cluster2.fab("train", "--script", str(hello), timeout=120)
        assert second.returncode == 1
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: run {run_a} holds this cluster (node0 (") and f"'fab stop {run_a}'" in last, last
        assert cluster2.run_dirs() - before == {run_a}  # refused before its run folder
        running.signal(signal.SIGKILL)  # fab dies as on a closed laptop: its ranks train on with nobody to end them
        running.finish(30)
    time.sleep(2)
    assert processes_with_env(f"XC_RUN_ID={run_a}"), "the orphaned ranks should still be running"
    doc = cluster2.fab("doctor", "--quick", "--master-port", str(free_cluster_port(1)), timeout=300)
    assert doc.returncode == 1
    assert re.search(rf"run {run_a} has processes on node0 \(\d+\), node1 \(\d+\)", doc.stdout), doc.stdout[-3000:]
    assert f"fab stop {run_a}" in doc.stdout
    stopped = cluster2.fab("stop", run_a, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"run {run_a} stopped: killed its processes on node0")
    assert "nothing is left running (checked on every node)" in stopped.stdout
    assert processes_with_env(f"XC_RUN_ID={run_a}") == []
    assert records.load(cluster2.runs / run_a).to_json()["status"] == "stopped"
    after = cluster2.fab("train", "--script", str(hello), timeout=300)  # the cluster is free again
    assert after.returncode == 0, after.stdout[-2000:] + after.stderr[-2000:]


def _pids_of_node(cmd_part: str, node: str, lc) -> list[int]:
    """PIDs whose command line holds cmd_part and whose environment says they run on node `node` of local cluster
    `lc` (XC_HOME, which its sshd sets: not another worker's cluster on this machine)."""
    found = []
    home = f"XC_HOME={lc.state}/nodes/{node}/home".encode()
    for pid in processes_with_cmdline(cmd_part):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"XC_NODE={node}".encode() in env and home in env:
            found.append(pid)
    return found


def test_a_dead_mpi_proxy_ends_the_run_within_a_minute_naming_its_node(cluster2, tmp_path):
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    before = cluster2.run_dirs()
    run_id = None
    with cluster2.start("train", "--nodes", "2", "--script", str(quiet), merge=True) as running:
        try:
            running.wait_for("started", 240, count=2)
            run_id = (cluster2.run_dirs() - before).pop()
            proxies = _pids_of_node("hydra_pmi_proxy", "node1", cluster2)
            assert proxies, f"node1's hydra_pmi_proxy not found; fab said: {running.stdout[-2000:]}"
            killed = time.monotonic()
            for pid in proxies:
                os.kill(pid, signal.SIGKILL)
            ended = running.finish(120)
            elapsed = time.monotonic() - killed
        finally:
            if running.proc.poll() is None and run_id:  # a failed check must not leave its 600 s ranks behind
                running.proc.kill()
                cluster2.fab("stop", run_id, timeout=120)
    out = ended.stdout
    print(f"proxy killed -> fab exited in {elapsed:.1f}s")
    assert ended.returncode != 0 and elapsed < 60, f"{elapsed:.0f}s"
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"error: run {run_id} failed") and "node1" in last and "Traceback" not in last, last
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "failed"


def test_a_rank_that_dies_while_its_child_holds_its_output_ends_the_run_quickly(cluster2, tmp_path):
    script = tmp_path / "child_holds_stdout.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "print('started', flush=True)\n"
        "if os.environ.get('PMI_RANK') == '1':\n"
        "    subprocess.Popen(['sleep', '600'])  # inherits the rank's stdout and outlives it\n"
        "    time.sleep(2)\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n")
    before = cluster2.run_dirs()
    started = time.monotonic()
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), timeout=300)
    elapsed = time.monotonic() - started
    print(f"rank 1 exited with a child holding its output -> fab exited after {elapsed:.1f}s in all")
    assert res.returncode != 0 and elapsed < 90, f"{elapsed:.0f}s"
    last = res.stderr.strip().splitlines()[-1]
    run_id = (cluster2.run_dirs() - before).pop()
    assert last.startswith(f"error: run {run_id} failed") and "node1" in last, last
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []


def test_a_local_node_counts_only_its_own_clusters_runs(cluster2, tmp_path, monkeypatch):
    """Local clusters share this machine's processes: a run on one is not 'on' another's nodes (doctor's runs
    row, fab status, the one-run-at-a-time lock all ask cleanup.runs_alive)."""
    from cluster.resolve import open_cluster
    from launch.life.cleanup import runs_alive

    quiet = tmp_path / "quiet.py"
    quiet.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    other = start_cluster(tmp_path / "other", 2)  # own cluster: the one that must not see cluster2's run
    before = cluster2.run_dirs()
    try:
        with cluster2.start("train", "--nodes", "2", "--script", str(quiet), merge=True) as running:
            running.wait_for("started", 240, count=2)
            run_id = (cluster2.run_dirs() - before).pop()
            for key, value in cluster2.env.items():
                monkeypatch.setenv(key, value)
            assert runs_alive(open_cluster().nodes) == {run_id: {"node0": 1, "node1": 1}}
            for key, value in other.env.items():
                monkeypatch.setenv(key, value)
            assert runs_alive(open_cluster().nodes) == {}
            running.signal(signal.SIGINT)
            assert running.finish(120).returncode == 130
    finally:
        other.fab("local-down", timeout=60)
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []


def test_a_connection_is_reused_briefly_by_one_caller_at_a_time_and_closed_after_a_failure(cluster2, monkeypatch):
    from cluster import remote
    from cluster.resolve import open_cluster

    for key, value in cluster2.env.items():
        monkeypatch.setenv(key, value)
    node = open_cluster().nodes[0]

    def session(conn) -> str:  # the sshd process serving this connection: the parent of the login shell
        return remote.run(conn, "ps -o ppid= -p $$").stdout.strip()

    remote.close_idle()
    with remote.connect(node) as conn:
        first = session(conn)
        with remote.connect(node) as other:  # held meanwhile: a connection of its own
            assert session(other) != first
    with remote.connect(node) as conn:  # right after: the first block's, not a new login
        assert session(conn) == first
    monkeypatch.setattr(remote, "REUSE_S", 0.2)
    time.sleep(0.3)
    with remote.connect(node) as conn:  # kept too long: closed, and a new login
        second = session(conn)
    assert second != first
    wait_until("the closed connection's sshd to end", lambda: not os.path.exists(f"/proc/{first}"), 10)
    with pytest.raises(RuntimeError), remote.connect(node) as conn:
        assert session(conn) == second
        raise RuntimeError("a block that fails does not hand its connection on")
    assert not conn.is_connected
    with remote.connect(node) as conn:
        assert session(conn) not in (first, second)
    remote.close_idle()
    assert not conn.is_connected
