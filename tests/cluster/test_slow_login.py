"""A node's login shell never stalls fab: local nodes start clean (the operator's ~/.bashrc does not run in
their sessions), and on any cluster a node that does not answer a command in time is one error line
naming it, never a hang or a traceback."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import start_cluster

pytestmark = pytest.mark.cluster

SLOW_RC = "touch {marker}\nsleep 120\n"


def _reload_with_env(lc, node: str, home: Path, keep_clean: bool = True) -> None:
    """Give one node's sessions HOME=home (so bash reads home/.bashrc, a file the test owns, instead of
    the operator's) and, with keep_clean=False, drop the clean-session setting, as a host whose login
    shell is slow would be; then make its sshd re-read its config."""
    config = lc.state / "nodes" / node / "sshd_config"
    lines = []
    for line in config.read_text().splitlines():
        if line.startswith("SetEnv "):
            line += f" HOME={home}"
            if not keep_clean:
                line = line.replace(" SHLVL=1", "")
        lines.append(line)
    config.write_text("\n".join(lines) + "\n")
    state = json.loads((lc.state / "state.json").read_text())
    entry = next(n for n in state["nodes"] if n["name"] == node)
    os.kill(entry["pid"], signal.SIGHUP)  # sshd -D re-executes itself with the new config
    deadline = time.time() + 15
    while time.time() < deadline:
        time.sleep(0.3)
        with socket.socket() as s:
            if s.connect_ex((entry["node"]["host"], entry["node"]["port"])) == 0:
                return
    raise AssertionError(f"{node}'s sshd did not come back after SIGHUP")


@pytest.fixture
def homes(tmp_path):
    out = {}
    for node in ("node0", "node1"):
        home = tmp_path / f"home-{node}"
        home.mkdir()
        (home / ".bashrc").write_text(SLOW_RC.format(marker=home / "bashrc-ran"))
        out[node] = home
    return out


# Each test reshapes its nodes' sshd config, so each has a cluster of its own.
def test_a_slow_bashrc_costs_local_nodes_nothing(tmp_path, homes):
    lc = start_cluster(tmp_path, 2)
    try:
        for node, home in homes.items():
            _reload_with_env(lc, node, home)
        t0 = time.time()
        res = lc.fab("keys", timeout=100)
        took = time.time() - t0
        assert res.returncode == 0, res.stdout + res.stderr
        assert took < 60, f"fab keys took {took:.0f}s: a node session ran the .bashrc that sleeps 120 s"
        for node, home in homes.items():
            assert not (home / "bashrc-ran").exists(), f"{node}'s session sourced {home}/.bashrc"
    finally:
        lc.fab("local-down", timeout=60)


def test_a_node_that_does_not_answer_in_time_is_one_error_line(tmp_path, homes):
    lc = start_cluster(tmp_path, 2)
    try:
        assert lc.fab("keys", timeout=100).returncode == 0  # keys in place before the node turns slow
        _reload_with_env(lc, "node1", homes["node1"], keep_clean=False)
        env = {"XC_SSH_COMMAND_TIMEOUT": "5"}
        script = tmp_path / "hello.py"
        script.write_text("print('hello')\n")
        for args in (("keys",), ("doctor", "--quick"), ("train", "--nodes", "2", "--script", str(script))):
            t0 = time.time()
            res = lc.fab(*args, env=env, timeout=170)
            took = time.time() - t0
            out = res.stdout + res.stderr
            assert res.returncode != 0, f"fab {' '.join(args)} passed with a node that stalls every command:\n{out}"
            assert "Traceback" not in out and "CommandTimedOut" not in out, out
            assert took < 120, f"fab {' '.join(args)} took {took:.0f}s: it waited for the slow shell"
            errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
            assert len(errors) == 1, out
            if args[0] != "doctor":  # doctor names the node in its table and ends with its verdict line
                assert "node1" in errors[0] or "127.0.0.3" in errors[0], errors[0]
            assert "login shell" in out, out
        assert (homes["node1"] / "bashrc-ran").exists()  # the fault was real: node1's shell did run it
    finally:
        lc.fab("local-down", timeout=60)
