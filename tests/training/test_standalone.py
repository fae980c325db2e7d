"""The programs fab sends to a node that may not have the shipped code (the doctor's store probe, the restart
loop's notice check) run with a bare interpreter, from an empty folder, with the project out of reach: the
training modules they need travel inside them (cluster.shipping.standalone)."""
from __future__ import annotations

import json
import subprocess
import sys

from cluster import shipping
from doctor import store_probe as doctor_store
from launch.supervision import restarts


def _run_bare(program: str, cwd, *args: str) -> subprocess.CompletedProcess:
    # -I -S: no PYTHONPATH, no site-packages (the editable install), no script folder: only what it carries
    return subprocess.run([sys.executable, "-I", "-S", "-c", program, *args], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_the_store_probe_runs_on_a_node_without_the_project(tmp_path):
    store = tmp_path / "store"
    res = _run_bare(doctor_store.program(store.as_uri(), {}), tmp_path)
    assert res.returncode == 0, res.stderr
    tag, _, reply = res.stdout.strip().partition(" ")
    assert tag == doctor_store.TAG and json.loads(reply)["ok"] is True and json.loads(reply)["seconds"] >= 0
    assert (store / ".xc-probe").is_dir() and not any((store / ".xc-probe").iterdir())  # written and deleted


def test_the_notice_check_runs_on_a_node_without_the_project(tmp_path):
    res = _run_bare(shipping.standalone(restarts._CHECK), tmp_path, "http://127.0.0.1:9")  # nothing listens there
    assert res.returncode == 0 and res.stdout.strip() == "none", res.stderr
