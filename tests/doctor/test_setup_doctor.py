"""`fab setup` and `fab doctor` on a real local cluster: real pip installs from PyPI into per-node venvs,
and real faults planted on one node (a changed package, a missing host key, a stopped sshd, edited code)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
from conftest import free_cluster_port, start_cluster

from launch.life import records
from node_setup import profiles

pytestmark = pytest.mark.cluster

TEST_PROFILE = profiles.load_profile("test")
PIN = TEST_PROFILE.version_of("six")
ROW = re.compile(r"^(node\d+)\s+(ok|already set up|FAILED)\s+([\d.]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def lc(tmp_path_factory):  # own cluster: fab setup installs packages into its nodes' environment
    cluster = start_cluster(tmp_path_factory.mktemp("setup-doctor"), 2)
    yield cluster
    cluster.fab("local-down", timeout=60)


def home(lc, i: int):
    return lc.state / "nodes" / f"node{i}" / "home"


def venv(lc, i: int):
    return home(lc, i) / "venv-test"  # per node: local nodes share one filesystem


def results(stdout: str) -> dict[str, tuple[str, float]]:
    """The closing table of `fab setup`: node -> (result, seconds)."""
    return {node: (result, float(sec)) for node, result, sec in ROW.findall(stdout)}


def six_in(venv_dir) -> tuple[str, str]:
    res = subprocess.run([str(venv_dir / "bin" / "python"), "-c", "import six; print(six.__version__, six.__file__)"],
                         capture_output=True, text=True, timeout=60, check=True)
    version, path = res.stdout.split()
    return version, path


def section(stdout: str, name: str) -> str:
    """The rows of one node's table (or 'across the nodes') in `fab doctor`'s report."""
    m = re.search(rf"^{re.escape(name)}:\n((?:  .*\n)+)", stdout, re.MULTILINE)
    assert m, f"no {name} table in:\n{stdout}"
    return m.group(1)


def row(stdout: str, name: str, check: str) -> str:
    m = re.search(rf"^  {re.escape(check)}\s+(ok|FAIL|skip)\s+(.*)$", section(stdout, name), re.MULTILINE)
    assert m, f"no {check!r} row for {name} in:\n{stdout}"
    return f"{m.group(1)} {m.group(2)}"


@pytest.fixture
def ready(lc):
    """The test profile set up on both nodes (a no-op after the first time); returns the shipped code digest."""
    res = lc.fab("setup", "--profile", "test", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    return re.search(r"^node1: code (\w+) in ", res.stdout, re.MULTILINE).group(1)


def doctor(lc, *args, timeout=300):
    return lc.fab("doctor", "--profile", "test", "--master-port", str(free_cluster_port(1)), *args, timeout=timeout)


def test_setup_fails_on_one_node_finishes_the_other_then_installs_and_is_a_no_op(lc):
    # Something real in node1's venv path: a folder with a user's file, which the script must not clear.
    bad = venv(lc, 1)
    bad.mkdir(parents=True)
    (bad / "notes.txt").write_text("keep me")

    first = lc.fab("setup", "--profile", "test", timeout=300)
    assert first.returncode == 1, first.stdout + first.stderr
    table = results(first.stdout)
    assert table["node0"][0] == "ok" and table["node1"][0] == "FAILED", first.stdout
    # Parallel and streamed: node1's failure is shown while node0 is still installing.
    out = first.stdout
    assert out.index("node1: error: ") < out.index("node0: set up (profile test"), out
    # The failed node is named with the tail of its log, and the error line names it too.
    assert re.search(r"^node1 FAILED: .*is not a venv", out, re.MULTILINE)
    assert re.search(r"^  \| error: .*venv-test exists and is not a venv", out, re.MULTILINE)
    last = first.stderr.strip().splitlines()[-1]
    assert last.startswith("error: setup failed on node1 of 2 node(s): ") and "is not a venv" in last, last
    assert "Traceback" not in first.stderr
    log = (lc.state / "setup" / "node1.log").read_text()
    assert "==> [test] creating venv" in log and "is not a venv" in log
    assert "pip install" in (lc.state / "setup" / "node0.log").read_text()
    assert (bad / "notes.txt").read_text() == "keep me" and not (bad / "bin").exists()
    # node0 really has the package from PyPI in its own venv.
    version, path = six_in(venv(lc, 0))
    assert version == PIN and path.startswith(str(venv(lc, 0)))

    shutil.rmtree(bad)
    second = lc.fab("setup", "--profile", "test", timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    table2 = results(second.stdout)
    assert table2["node0"][0] == "already set up" and table2["node1"][0] == "ok", second.stdout
    for i in (0, 1):
        version, path = six_in(venv(lc, i))
        assert version == PIN and path.startswith(str(venv(lc, i)) + "/")
        marker = venv(lc, i) / profiles.MARKER_NAME
        assert marker.read_text().strip() == TEST_PROFILE.hash
    # Every node ran the one rendered text.
    script = profiles.render_setup_script("test", venv="$XC_HOME/venv-test")
    for i in (0, 1):
        assert (home(lc, i) / "setup" / f"node_setup-test-{TEST_PROFILE.hash}.sh").read_text() == script

    third = lc.fab("setup", "--profile", "test", timeout=300)
    assert third.returncode == 0, third.stdout + third.stderr
    table3 = results(third.stdout)
    assert {r for r, _ in table3.values()} == {"already set up"}, third.stdout
    assert "pip install" not in third.stdout
    # A no-op is much faster than the install it skips.
    assert table3["node1"][1] < table2["node1"][1] / 2, (table2, table3)


def test_plain_setup_keeps_the_profile_the_nodes_carry(lc, ready):
    res = lc.fab("setup", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert res.stdout.startswith("setup: profile test (carried by the nodes)\n"), res.stdout[:500]
    assert {r for r, _ in results(res.stdout).values()} == {"already set up"}, res.stdout


def test_doctor_is_green_on_a_healthy_cluster(lc, ready):
    res = doctor(lc, timeout=400)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = res.stdout
    assert "FAIL" not in out and re.search(r"^verdict: healthy: \d+ checks passed on 2 node\(s\)", out, re.MULTILINE)
    for node in ("node0", "node1"):
        for check in ("reachable", "python", "code", "CPU", "memory", "disk", "profile test", "ssh from node0"):
            assert row(out, node, check).startswith("ok "), (node, check, out)
        assert re.search(r"socket\(s\), \d+ physical core\(s\) usable", row(out, node, "CPU"))
        assert f"six {PIN}" in row(out, node, "profile test")
        assert row(out, node, "AMX").split()[0] in ("ok", "skip")
        # the test profile's venv has no torch: the library is built there, and nothing would load it
        assert row(out, node, "kernels").startswith("skip built, not loaded: No module named 'torch'"), out
    assert row(out, "node1", "rendezvous port").startswith("ok node1 reached a listener on node0 127.0.0.2:")
    assert row(out, "across the nodes", "six version") == f"ok six {PIN} on all 2 nodes"
    assert row(out, "across the nodes", "clock skew").startswith("ok clock skew")
    allreduce = row(out, "across the nodes", "all-reduce")
    assert allreduce.startswith("ok 4 MB gloo all-reduce across 2 rank(s) on 2 node(s)"), allreduce
    # The all-reduce went through the real launcher: its run record is a real mpirun run.
    summary = records.load(next((lc.state / "doctor" / "runs").glob("*/summary.json")).parent).to_json()
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["command"][0].endswith("mpirun")
    # doctor chose the run's id itself (to end it by id on a hang), and changed nothing it did not say
    assert "-doctor-" in summary["run_id"]
    assert "authorised" not in out  # fab setup put the cluster key in place already
    # Without --profile the training stack of each node's python is compared across the nodes.
    plain = lc.fab("doctor", "--quick", timeout=300)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-2000:]
    assert row(plain.stdout, "across the nodes", "torch version").startswith("ok torch ")
    if shutil.which("gcc"):  # the nodes' own python has torch: built for this CPU and loaded
        assert row(plain.stdout, "node1", "kernels").startswith("ok built for this CPU and loaded: "), plain.stdout
    assert "(no --profile: compared across nodes only)" in row(plain.stdout, "node1", "packages")


def test_doctor_catches_a_package_differing_on_one_node_and_setup_repairs_it(lc, ready):
    pip = subprocess.run([str(venv(lc, 1) / "bin" / "python"), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", "six==1.17.0"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert pip.returncode == 0, pip.stderr
    res = doctor(lc, "--quick")
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout
    assert row(out, "node1", "profile test") == \
        f"FAIL six 1.17.0 is installed but profile test pins {PIN}"
    assert "fix: run 'fab setup --profile test'" in section(out, "node1")
    assert row(out, "node0", "profile test").startswith("ok ")
    assert row(out, "across the nodes", "six version").startswith(f"FAIL six differs: node1 has 1.17.0; 1 node(s) "
                                                                 f"have {PIN}")
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: doctor found 2 problem(s): node1 profile test: six 1.17.0"), last

    # The fix the row names works: setup notices the change behind the marker and reinstalls node1 only.
    fixed = lc.fab("setup", "--profile", "test", timeout=300)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "node1: six 1.17.0 is installed but profile test pins" in fixed.stdout
    table = results(fixed.stdout)
    assert table["node0"][0] == "already set up" and table["node1"][0] == "ok", fixed.stdout
    assert six_in(venv(lc, 1))[0] == PIN
    assert doctor(lc, "--quick").returncode == 0


def test_doctor_names_a_missing_host_key_and_fab_keys_fixes_it(lc, ready):
    known = home(lc, 0) / "ssh" / "known_hosts"
    lines = known.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(f"[127.0.0.3]:{lc.port} ")]
    assert len(kept) == len(lines) - 1
    known.write_text("".join(kept))
    res = doctor(lc)  # full: the all-reduce must not be tried (it would fail) and must not hang
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout
    assert row(out, "node1", "ssh from node0").startswith("FAIL node0 cannot ssh to node1: Host key verification failed")
    assert "fix: run 'fab keys'" in section(out, "node1")
    assert row(out, "node0", "ssh from node0").startswith("ok ")
    assert row(out, "across the nodes", "all-reduce").startswith("skip not run: a job would fail on node1 ssh from")
    assert "node1 ssh from node0" in res.stderr.strip().splitlines()[-1]
    assert known.read_text() == "".join(kept)  # doctor diagnoses; it does not repair behind the user's back

    assert lc.fab("keys", timeout=120).returncode == 0
    assert doctor(lc, "--quick").returncode == 0


def test_fab_train_preflight_refuses_code_edited_on_a_node_and_setup_reships_it(lc, ready, tmp_path):
    digest = ready
    edited = home(lc, 1) / "code" / digest / "training" / "jobs" / "dist.py"
    original = edited.read_text()
    edited.write_text(original + "\n# edited on the node\n")
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    runs_before = set(os.listdir(lc.runs)) if lc.runs.exists() else set()
    res = lc.fab("train", "--nodes", "2", "--script", str(script), timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: preflight found 1 problem(s): node1 code: ") and "changed on the node" in last, last
    assert "fab setup" in last
    assert (set(os.listdir(lc.runs)) if lc.runs.exists() else set()) == runs_before  # nothing started

    again = lc.fab("setup", "--profile", "test", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert edited.read_text() == original
    assert row(doctor(lc, "--quick").stdout, "node1", "code") == f"ok revision {digest} installed and verified"


def test_doctor_reports_a_node_that_is_down_without_hanging(lc, ready):
    state = json.loads((lc.state / "state.json").read_text())
    os.kill(state["nodes"][1]["pid"], signal.SIGTERM)
    try:
        started = time.monotonic()
        res = doctor(lc)  # full, so the port and all-reduce checks face the dead node too
        elapsed = time.monotonic() - started
        assert res.returncode == 1, res.stdout + res.stderr
        out = res.stdout
        assert row(out, "node1", "reachable").startswith("FAIL node1 (127.0.0.3:") and "unreachable" in out
        assert row(out, "node1", "ssh from node0").startswith("FAIL node0 cannot ssh to node1")
        assert row(out, "node0", "reachable").startswith("ok ")  # the live node is still checked in full
        assert row(out, "node0", "profile test").startswith("ok ")
        assert row(out, "across the nodes", "all-reduce").startswith("skip not run: node1 unreachable")
        assert "error: doctor found 2 problem(s): node1 reachable" in res.stderr
        assert elapsed < 90, elapsed
    finally:  # same keys and homes: local-up restarts the stopped cluster as it was
        lc.fab("local-up", "--nodes", "2", "--port", str(lc.port), check=True, timeout=60)
