"""Secrets passed with --env reach the ranks and nothing else: not mpirun's command line, not
summary.json or command.sh, not the log (a job that prints one shows ***), and the per-node
secrets.env (mode 0600) is gone after the run. On a real 2-node local cluster."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from conftest import processes_with_cmdline

from launch.life import records
from launch.staging import secrets

pytestmark = pytest.mark.cluster

SCRIPT = """\
import hashlib, os, stat, time
token, own = os.environ["HF_TOKEN"], os.environ["XC_TEST_OWN"]
mode = stat.S_IMODE(os.stat("secrets.env").st_mode)
print(f"sha {hashlib.sha256(token.encode()).hexdigest()} own {hashlib.sha256(own.encode()).hexdigest()} "
      f"mode {mode:o} plain {os.environ['PLAIN']}", flush=True)
print(f"leak {token} and {own}", flush=True)
time.sleep(3)
"""


def test_a_secret_reaches_the_ranks_and_no_record(cluster2, tmp_path):
    script = tmp_path / "secrets_job.py"
    script.write_text(SCRIPT)
    before = cluster2.run_dirs()
    on_command_lines = []
    with cluster2.start("train", "--nodes", "2", "--script", str(script), "--env", "HF_TOKEN=secret123", "--env",
                        "XC_TEST_OWN", "--env", "PLAIN=visible", env={"XC_TEST_OWN": "operator-own-value"}) as running:
        while running.proc.poll() is None:  # mpirun, hydra, ssh and the ranks are all running meanwhile
            on_command_lines += processes_with_cmdline("secret123") + processes_with_cmdline("operator-own-value")
            time.sleep(0.2)
        ended = running.finish(60)
    out, err = ended.stdout, ended.stderr
    assert ended.returncode == 0, out[-2000:] + err[-2000:]
    # only fab's own command line holds the value the operator typed; nothing fab started does
    assert set(on_command_lines) <= {running.proc.pid}

    sha = hashlib.sha256(b"secret123").hexdigest()
    own = hashlib.sha256(b"operator-own-value").hexdigest()
    for rank, node in ((0, "node0"), (1, "node1")):
        assert f"[{rank} {node}] sha {sha} own {own} mode 600 plain visible" in out  # the values arrived
        assert f"[{rank} {node}] leak *** and ***" in out  # printed by the job, redacted by fab
    assert "secret123" not in out + err and "operator-own-value" not in out + err

    (run_id,) = cluster2.run_dirs() - before
    run_dir = cluster2.runs / run_id
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            assert b"secret123" not in text and b"operator-own-value" not in text, path
    summary = records.load(run_dir).to_json()
    assert summary["env"]["HF_TOKEN"] == secrets.MASK and summary["env"]["XC_TEST_OWN"] == secrets.MASK
    assert summary["env"]["PLAIN"] == "visible"  # an ordinary value is recorded as it was
    store = (cluster2.runs.parent / "store").as_uri()  # the run's store, named in its record (docs/store.md)
    assert summary["spec"]["what"]["env"] == {"HF_TOKEN": "***", "XC_TEST_OWN": "***", "PLAIN": "visible", "XC_STORE": store}
    assert "HF_TOKEN" not in (run_dir / "command.sh").read_text()
    assert list(Path(cluster2.state_root).rglob(secrets.FILE)) == []  # every node's secrets.env went with the run


def test_redaction_and_the_secret_names():
    assert secrets.is_secret("HF_TOKEN") and secrets.is_secret("aws_secret_access_key")
    assert secrets.is_secret("DB_PASSWORD") and secrets.is_secret("WANDB_API_KEY")
    assert not secrets.is_secret("OMP_NUM_THREADS") and secrets.is_secret("MY_VAR", {"MY_VAR"})
    assert secrets.redact("token=abcd1234 again abcd1234", ["abcd1234"]) == "token=*** again ***"
    assert secrets.redact("a b c", ["b"]) == "a b c"  # too short to redact without blanking the log
    assert secrets.env_file({"B": "it's", "A": "x y"}) == "export A='x y'\nexport B='it'\"'\"'s'\n"
