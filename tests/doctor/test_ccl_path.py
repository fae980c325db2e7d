"""The oneCCL path and the clean-up after a failure.

Unit tests check what the ccl path builds (they run everywhere). Tests marked `ccl` run the path end to
end on a local cluster and need `oneccl_bindings_for_pytorch` importable in this venv (torch-ccl is not
on PyPI, so CI skips them; docs/software.md "oneCCL" says how to build it for a local run).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import processes_with_env

from doctor import collective as doctor
from launch.life import cleanup, records
from training.jobs import common, dist

HAVE_CCL = importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None
needs_ccl = pytest.mark.skipif(not HAVE_CCL, reason="oneccl_bindings_for_pytorch is not installed in this venv "
                               "(torch-ccl is not on PyPI; see docs/software.md 'oneCCL')")


def test_jobs_leave_the_existing_process_group_to_accelerate():
    # accelerate refuses ddp_backend="ccl" on CPU but adopts a group dist.setup() already made
    from transformers import TrainingArguments

    defaults = common.trainer_defaults(TrainingArguments)
    assert defaults["ddp_backend"] is None
    args = TrainingArguments(**defaults)
    assert args.ddp_backend is None


@pytest.mark.parametrize("env, expect", [
    ({"MPI_LOCALNRANKS": "2"}, ("1", "2")),  # Intel MPI's own count
    ({"CCL_LOCAL_SIZE": "4"}, ("1", "4")),  # the launcher's size, paired with this rank
    ({"CCL_LOCAL_SIZE": "4", "CCL_LOCAL_RANK": "3"}, ("3", "4")),  # both given: left alone
    ({}, (None, None)),  # nothing tells the local size: oneCCL decides
])
def test_ccl_local_pair_is_completed_or_left_alone(env, expect):
    env = dict(env)
    dist.ccl_local_pair(1, env)
    assert (env.get("CCL_LOCAL_RANK"), env.get("CCL_LOCAL_SIZE")) == expect


def test_sweep_script_is_shell_not_a_format_string():
    script = cleanup.sweep_script("20260101-000000-glue-ab12")
    assert "${e#/proc/}" in script and "${p%/environ}" in script  # the shell's own expansions, intact
    assert "grep -lzxF XC_RUN_ID=20260101-000000-glue-ab12 " in script
    assert "grep -lzxF 'XC_RUN_ID=a b'" in cleanup.sweep_script("a b")  # quoted for the shell
    subprocess.run(["bash", "-n", "-c", script], check=True)


def test_sweep_kills_what_carries_the_run_id_and_spares_the_rest(tmp_path):
    # The script itself, run locally: one process of the run, one bystander with another run id.
    mine = subprocess.Popen(["sleep", "300"], env={"XC_RUN_ID": "r-mine", "PATH": "/usr/bin:/bin"},
                            start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], env={"XC_RUN_ID": "r-mine-2", "PATH": "/usr/bin:/bin"})
    try:
        out = subprocess.run(["bash", "-c", cleanup.sweep_script("r-mine")], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        killed, left = cleanup.parse(out)
        assert killed == 1 and left == []
        assert mine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_claim_says_nothing_is_left_only_after_every_node_was_checked():
    assert cleanup.Sweep(killed={"node0": 2, "node1": 0}).claim().startswith("nothing is left running")
    unchecked = cleanup.Sweep(killed={"node0": 1}, unchecked={"node1": "node1 (127.0.0.3:22) is unreachable"})
    assert not unchecked.clean and "node1 not checked" in unchecked.claim()
    assert "nothing is left" not in unchecked.claim()
    left = cleanup.Sweep(killed={"node0": 0}, left={"node0": ["123 python -m training.jobs.glue"]})
    assert "node0: pid 123 python -m training.jobs.glue" in left.claim()


def test_sweep_reports_an_unreachable_node_as_unchecked():
    from cluster.node import Node

    res = cleanup.sweep([Node(name="node0", host="127.0.0.1", private_host="127.0.0.1", user="nobody", port=9)], "r1")
    assert not res.clean and "node0" in res.unchecked and "unreachable" in res.unchecked["node0"]


@pytest.mark.parametrize("output, cause", [
    ("[1] oneCCL: env.cpp:1432 env_2_worker_affinity: EXCEPTION: failed to parse worker affinity",
     "CCL_WORKER_AFFINITY: failed to parse worker affinity"),
    ("[0] OSError: libccl.so.1: cannot open shared object file: No such file or directory",
     "library libccl.so.1 not found"),
    ("[0] ModuleNotFoundError: No module named 'oneccl_bindings_for_pytorch'",
     "python module oneccl_bindings_for_pytorch missing"),
    ("[0] RuntimeError: connection refused", None),
])
def test_collective_cause_names_the_variable_or_library(output, cause):
    assert doctor.collective_cause(output) == cause


# ---- on a local cluster -------------------------------------------------------------------------

PLANT = """
import os, subprocess, sys, time
# a process of the run that mpirun does not own: its own session, the run's environment, and none
# of the rank's output pipes (a child holding them keeps mpirun waiting: another failure mode)
subprocess.Popen(["sleep", "600"], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("planted", flush=True)
if os.environ["PMI_RANK"] == "1":
    time.sleep(5)  # rank 0 plants its own before mpirun ends the job
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.cluster
def test_failed_run_cleans_up_what_mpirun_does_not_own_and_says_so_after_checking(cluster2, tmp_path):
    script = tmp_path / "plant.py"
    script.write_text(PLANT)
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    run_id = (cluster2.run_dirs() - before).pop()
    assert res.stdout.count("planted") == 2
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    last = res.stderr.strip().splitlines()[-1]
    assert "nothing is left running (checked on every node)" in last, last
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "failed" and summary["cleanup"]["clean"] is True
    assert sum(summary["cleanup"]["killed"].values()) >= 2  # both planted sleeps


ABORT_AFTER_FINISH = """
import os
rank = int(os.environ["PMI_RANK"])
import time
print("[finished] rank", rank, flush=True)
if rank == 1:
    time.sleep(3)  # the teardown comes after the work: rank 0's own marker is out by then
    os.abort()  # as torch-ccl's thread teardown does at interpreter exit now and then
"""

ABORT_BEFORE_FINISH = """
import os
rank = int(os.environ["PMI_RANK"])
if rank == 1:
    os.abort()
print("[finished] rank", rank, flush=True)
"""


@pytest.mark.cluster
def test_a_crash_after_every_rank_finished_does_not_fail_the_run(cluster2, tmp_path):
    script = tmp_path / "late.py"
    script.write_text(ABORT_AFTER_FINISH)
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "after every rank had finished its work" in res.stdout
    run_id = (cluster2.run_dirs() - before).pop()
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "ok"
    assert summary["crashed_after_finish"]["node"] == "node1"

    script.write_text(ABORT_BEFORE_FINISH)  # the same crash before the work is done is a failure
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), timeout=300)
    assert res.returncode == 1 and "node1" in res.stderr.strip().splitlines()[-1]
    run_id = (cluster2.run_dirs() - before).pop()
    assert records.load(cluster2.runs / run_id).to_json()["status"] == "failed"


# ---- the ccl path end to end (bindings needed) ----------------------------------------------------

TINY = ["--num_train_epochs", "1", "--per_device_train_batch_size", "8", "--max_train_samples", "64",
        "--max_eval_samples", "64", "--seed", "42"]


@pytest.fixture
def ccl_cluster(cluster2):
    return cluster2  # the shared cluster: these runs change nothing on it


@pytest.mark.ccl
@pytest.mark.cluster
@needs_ccl
@pytest.mark.parametrize("backend", ["ccl", "auto"])
def test_ccl_backend_trains_and_matches_gloo(ccl_cluster, backend):
    def run(b):
        before = ccl_cluster.run_dirs()
        res = ccl_cluster.fab("train", "--nodes", "2", "--backend", b, "--", *TINY, timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        run_id = (ccl_cluster.run_dirs() - before).pop()
        return res.stdout, json.loads((ccl_cluster.runs / run_id / "results.json").read_text())

    out, results = run(backend)
    assert "[0 node0] rank 0/2" in out and "[1 node1] rank 1/2" in out
    assert out.count("backend=ccl") == 2 and "backend=gloo" not in out
    assert results["backend"] == "ccl"
    _, gloo = run("gloo")
    assert gloo["backend"] == "gloo"
    # the same seed, data and global batch: the same training within reduction-order noise
    assert results["train"]["train_loss"] == pytest.approx(gloo["train"]["train_loss"], rel=0.02)
    assert results["eval"]["eval_accuracy"] == pytest.approx(gloo["eval"]["eval_accuracy"], abs=0.05)


@pytest.mark.ccl
@pytest.mark.cluster
@needs_ccl
def test_doctor_runs_ccl_and_names_a_broken_worker_affinity(ccl_cluster):
    ok = ccl_cluster.fab("doctor", "--nodes", "2", timeout=600)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    assert "ok    4 MB ccl all-reduce across 2 rank(s)" in ok.stdout
    bad = ccl_cluster.fab("doctor", "--nodes", "2", "--env", "CCL_WORKER_AFFINITY=nonsense", timeout=600)
    assert bad.returncode == 1
    row = next(line for line in bad.stdout.splitlines() if "all-reduce" in line and "FAIL" in line)
    assert "CCL_WORKER_AFFINITY" in row, bad.stdout[-3000:]


def test_ccl_tests_are_skipped_with_the_reason_when_bindings_are_missing():
    if HAVE_CCL:
        pytest.skip("the bindings are installed: the ccl tests run")
    assert "not installed" in needs_ccl.kwargs["reason"] and sys.modules.get("oneccl_bindings_for_pytorch") is None
