"""Runs you can manage, on a real 2-node local cluster: `fab train --detach` returns while the ranks
run, `fab logs RUN -f` follows to the end and brings the results home, `fab runs` lists a finished, a
failed and a stopped run, and `fab stop` leaves nothing running."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import processes_with_cmdline, processes_with_env

from launch.life import records

pytestmark = pytest.mark.cluster

SLOW = """\
import os, sys, time

for i in range(int(sys.argv[1])):
    print(f"tick {i} token {os.environ.get('HF_TOKEN', '-')}", flush=True)
    time.sleep(1)
"""
GLUE_SHORT = ["--max_steps", "4", "--max_train_samples", "64", "--max_eval_samples", "32",
              "--per_device_train_batch_size", "8"]


def run_id_of(res) -> str:
    line = next(ln for ln in res.stdout.splitlines() if " detached: " in ln)
    return line.split()[1]


def test_detach_then_logs_follow_to_the_end_brings_results_home(cluster2, tmp_path):
    started = time.monotonic()
    res = cluster2.fab("train", "--nodes", "2", "--detach", "--", *GLUE_SHORT, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run_id = run_id_of(res)
    assert f"follow it with 'fab logs {run_id} -f'" in res.stdout
    assert processes_with_env(f"XC_RUN_ID={run_id}"), "fab returned but no rank is running"
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "running" and summary["detached"] is True

    follow = cluster2.fab("logs", run_id, "-f", timeout=600)
    assert follow.returncode == 0, follow.stdout[-2000:] + follow.stderr[-2000:]
    lines = follow.stdout.splitlines()
    assert any(ln.startswith("[0 node0] ") for ln in lines) and any(ln.startswith("[1 node1] ") for ln in lines)
    assert lines[-1].startswith(f"run {run_id} finished in ") and "eval accuracy" in lines[-1]
    run_dir = cluster2.runs / run_id
    summary = records.load(run_dir).to_json()
    assert summary["status"] == "ok" and (run_dir / "results.json").is_file()
    assert (run_dir / "output" / "results.json").is_file() and (run_dir / "log.txt").stat().st_size > 0
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    again = cluster2.fab("logs", run_id, timeout=60)  # from runs/<id>/log.txt now, with the same prefixes
    assert again.returncode == 0 and "[1 node1] " in again.stdout
    assert time.monotonic() - started < 600


def test_runs_lists_a_finished_a_failed_and_a_stopped_run(cluster2, tmp_path):
    ok_script, bad_script, slow = tmp_path / "ok.py", tmp_path / "bad.py", tmp_path / "slow.py"
    ok_script.write_text("print('fine')\n")
    bad_script.write_text("raise ValueError('planted failure')\n")
    slow.write_text(SLOW)
    before = cluster2.run_dirs()
    assert cluster2.fab("train", "--script", str(ok_script), timeout=300).returncode == 0
    (ok_id,) = cluster2.run_dirs() - before
    failed = cluster2.fab("train", "--script", str(bad_script), timeout=300)
    assert failed.returncode == 1
    (failed_id,) = cluster2.run_dirs() - before - {ok_id}
    detached = cluster2.fab("train", "--script", str(slow), "--detach", "--", "600", timeout=300)
    assert detached.returncode == 0, detached.stdout[-2000:] + detached.stderr[-2000:]
    stopped_id = run_id_of(detached)

    running = cluster2.fab("runs", timeout=120)
    row = {ln.split()[0]: ln.split() for ln in running.stdout.splitlines()[1:]}
    assert row[stopped_id][3] == "running"

    stop = cluster2.fab("stop", stopped_id, timeout=120)
    assert stop.returncode == 0, stop.stderr
    deadline = time.monotonic() + 30
    while processes_with_cmdline(stopped_id) and time.monotonic() < deadline:
        time.sleep(0.5)  # mpirun and its waiting shell end once the ranks are gone
    assert processes_with_env(f"XC_RUN_ID={stopped_id}") == [] and processes_with_cmdline(stopped_id) == []

    listed = cluster2.fab("runs", timeout=120)
    assert listed.returncode == 0
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["run", "job", "nodes", "status", "wall", "metric", "samples/s", "where"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert (rows[ok_id][1:4], rows[failed_id][1:4], rows[stopped_id][1:4]) == (
        ["ok.py", "2", "ok"], ["bad.py", "2", "failed"], ["slow.py", "2", "stopped"])
    order = [ln.split()[0] for ln in lines[1:]]
    assert order.index(stopped_id) < order.index(failed_id) < order.index(ok_id)  # newest first


def test_a_detached_run_keeps_secrets_out_of_the_node_log_too(cluster2, tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text(SLOW)
    res = cluster2.fab("train", "--script", str(slow), "--detach", "--env", "HF_TOKEN=secret123", "--", "3",
                       timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run_id = run_id_of(res)
    follow = cluster2.fab("logs", run_id, "-f", timeout=300)
    assert follow.returncode == 0 and "[0 node0] tick 2 token ***" in follow.stdout
    for path in [*Path(cluster2.runs).rglob("*"), *Path(cluster2.state_root).rglob("mpirun.log")]:
        if path.is_file():
            assert b"secret123" not in path.read_bytes(), path
    assert not list(Path(cluster2.state_root).rglob("secrets.env"))


def test_logs_of_an_unknown_run_is_one_line(cluster2):
    res = cluster2.fab("logs", "20990101-000000-none-0000", timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith("error: no run 20990101-000000-none-0000 in ")


def test_a_record_that_kept_its_flags_under_request_reads_as_its_spec_and_is_written_back_as_spec(tmp_path):
    """Records written before RunSpec kept the run's flags flat under "request": they load with them as the spec,
    and --resume reads the same policy from either."""
    from training.runtime.spec import RunSpec

    flat = {"job": "glue", "args": ["--seed", "1"], "ppn": "1", "recovery": {"max_restarts": 2, "min_nodes": 1}}
    rec = records.RunRecord.from_json({"run_id": "old", "status": "preempted", "request": flat})
    assert rec.spec == flat and "request" not in rec.extra
    assert "spec" in rec.to_json() and "request" not in rec.to_json()
    spec = RunSpec.from_json(rec.spec)
    assert (spec.recovery.max_restarts, spec.recovery.min_nodes, spec.where.ppn) == (2, 1, "1")
