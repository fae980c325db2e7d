"""Shared fixtures: a real local cluster (sshd on loopback) in a private state folder."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAB = [sys.executable, "-m", "fabric"]


def _port_free(port: int, hosts) -> bool:
    for host in hosts:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_cluster_port(nodes: int, first: int = 2) -> int:
    hosts = [f"127.0.0.{first + i}" for i in range(nodes)]
    for _ in range(50):
        port = random.randint(20000, 40000)
        if _port_free(port, hosts):
            return port
    raise RuntimeError("no free port for the local cluster")


def fab(*args: str, env: dict | None = None, timeout: float = 900, check: bool = False) -> subprocess.CompletedProcess:
    """Run the real `fab` CLI from the project root."""
    res = subprocess.run([*FAB, *args], cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    if check and res.returncode != 0:
        raise AssertionError(f"fab {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def fab_in_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The `fab` CLI run in this process (Fabric's own Program, the project's fabfile from ROOT), for checks
    that end before anything is started: ~0.75 s of interpreter start-up saved per call. Same result shape
    as fab(); the environment, argv and current directory are restored afterwards."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from fabric.main import make_program

    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    os.environ.update(env or {})
    sys.argv = ["fab", *args]  # core.cli.job_args reads the text after `--` from here
    os.chdir(ROOT)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                make_program().run(["fab", *args], exit=True)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    return subprocess.CompletedProcess(["fab", *args], code, out.getvalue(), err.getvalue())


class LocalCluster:
    def __init__(self, state_root: Path, runs: Path, nodes: int, port: int):
        self.state_root, self.runs, self.count, self.port = state_root, runs, nodes, port
        self.env = {"XC_STATE_DIR": str(state_root), "XC_RUNS_DIR": str(runs), "XC_CLUSTER": "local"}

    @property
    def state(self) -> Path:
        return self.state_root / "local"

    def fab(self, *args, **kw):
        return fab(*args, env={**self.env, **kw.pop("env", {})}, **kw)

    def run_dirs(self) -> set[str]:
        return {p.name for p in self.runs.iterdir()} if self.runs.exists() else set()


def start_cluster(tmp: Path, nodes: int) -> LocalCluster:
    lc = LocalCluster(tmp / "state", tmp / "runs", nodes, free_cluster_port(nodes))
    fab("local-up", "--nodes", str(nodes), "--port", str(lc.port), env=lc.env, check=True, timeout=60)
    return lc


@pytest.fixture(scope="session")
def cluster2(tmp_path_factory):
    lc = start_cluster(tmp_path_factory.mktemp("cluster2"), 2)
    yield lc
    fab("local-down", env=lc.env, timeout=60)


def processes_with_env(needle: str) -> list[int]:
    """PIDs whose environment holds the entry `needle` ('XC_RUN_ID=abc'), or any entry of that
    name when `needle` ends with '=' ('XC_RUN_ID=')."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = env.read_bytes().split(b"\0")
        except OSError:
            continue
        key = needle.encode()
        if any(e.startswith(key) for e in entries) if needle.endswith("=") else key in entries:
            found.append(int(env.parent.name))
    return found


def processes_with_cmdline(text: str) -> list[int]:
    """PIDs whose command line holds `text` (an sshd config path names the local cluster it belongs to)."""
    found = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in p.read_bytes():
                found.append(int(p.parent.name))
        except OSError:  # gone meanwhile
            continue
    return found
