"""bench/suite_cpu.py: a command's CPU by kind of process and by test, read from /proc."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2.5: pass\n"


def test_it_counts_a_child_that_burns_cpu_under_its_test_and_keeps_the_exit_code(tmp_path):
    out = tmp_path / "procs.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "suite_cpu.py"), "--json", str(out), "--",
                          sys.executable, "-c", BURN + "raise SystemExit(3)"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 3, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and lines[1].startswith("wall ")
    burner = [p for p in json.loads(out.read_text()) if p["argv"][-1:] == [BURN + "raise SystemExit(3)"]]
    assert len(burner) == 1 and 1.0 <= burner[0]["cpu"] <= 3.0, burner  # seen once a second: up to 1 s lost
    assert "tests/bench/test_suite_cpu.py::test_it_counts" in burner[0]["test"]


def test_ranks_are_told_apart_by_job_flags_and_model():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import suite_cpu
    finally:
        sys.path.pop(0)
    rank = ["python", "-u", "-m", "training.jobs.glue", "--seed", "1", "--model_name_or_path", "/t/minilm-1-layer",
            "--max_steps", "4", "--output_dir", "o"]
    assert suite_cpu.kind({"argv": rank, "comm": "python"}) == "rank glue --seed --max_steps --output_dir (minilm-1-layer)"
    assert suite_cpu.kind({"argv": rank[:6], "comm": "python"}) == "rank glue --seed"


def test_it_says_how_to_call_it():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "suite_cpu.py")], capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].endswith(
        "give the command to measure after --, e.g. -- make test")


def test_a_process_without_the_tests_variable_counts_under_the_test_its_workers_folder_runs(tmp_path):
    """A rank sshd started has no PYTEST_CURRENT_TEST: it counts under the test that worker gw7 runs, found by the
    popen-gw7 folder it works in; one in no worker's folder counts under no test."""
    import os
    import tempfile

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import suite_cpu
    finally:
        sys.path.pop(0)
    folder = tmp_path / "popen-gw7" / "cluster0"
    folder.mkdir(parents=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    outside = tempfile.mkdtemp(prefix="suite-cpu-")  # no worker's folder above it, unlike tmp_path under xdist
    procs = [subprocess.Popen(sleep, env={**clean, "PYTEST_CURRENT_TEST": "tests/t.py::test_x (call)",
                                          "PYTEST_XDIST_WORKER": "gw7"}),
             subprocess.Popen(sleep, env=clean, cwd=folder), subprocess.Popen(sleep, env=clean, cwd=outside)]
    try:
        seen: dict = {}
        suite_cpu.sample(seen, running={})
        tests = {p.pid: next((v["test"] for (pid, _), v in seen.items() if pid == str(p.pid)), None) for p in procs}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        os.rmdir(outside)
    assert tests == {procs[0].pid: "tests/t.py::test_x", procs[1].pid: "tests/t.py::test_x", procs[2].pid: ""}
