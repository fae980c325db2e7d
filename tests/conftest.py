"""Shared fixtures: a real local cluster (sshd on loopback) in a private state folder."""
from __future__ import annotations

import gc
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import pytest

# the moto fixtures are defined here once: a session fixture that each module imported was one server per module
from moto_fixture import aws_env, moto_server  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
# tests/ is grouped by the room each file tests (launch/, cluster/, twin/, ...); a few files share helpers across rooms
# (the sweep's store tests use the AWS discovery tests' fake Pulumi), so every room is importable by module name, as
# the one flat folder was, however pytest is started
sys.path[1:1] = [str(d) for d in sorted(Path(__file__).resolve().parent.iterdir()) if any(d.glob("test_*.py"))]
FAB = [sys.executable, "-m", "fabric"]


# The files that take minutes, longest first: make test spreads files over parallel workers in collection order,
# and a long file that starts last is the whole suite's tail. Every other file keeps its place after these.
# Order from a --durations=0 profile of the whole suite (2026-11-27 20:18, worker-seconds per file: the twin's and
# elastic's ~400 each, all on one worker, so they start first).
LONG_FILES = ("test_twin.py", "test_elastic.py", "test_cluster.py", "test_jobs.py", "test_script_restarts.py", "test_spot.py",
              "test_loss_scale.py", "test_restarts.py", "test_supervisor.py", "test_setup_doctor.py", "test_store_cluster.py",
              "test_head.py", "test_group_termination.py", "test_script_notices.py", "test_runs.py", "test_preempt.py",
              "test_bench_kube.py", "test_netns.py", "test_user_training_package.py", "test_user_scripts.py",
              "test_workdir.py", "test_discovery_aws.py", "test_slow_login.py", "test_ccl_path.py")


def pytest_configure(config):
    # The workers import torch, transformers, moto and Pulumi: at Python's default thresholds the cyclic collector
    # walks their ~1M objects again and again while they import (a fifth of an import's CPU, perf), as the rank hook
    # avoids for the ranks (training/hook/sitecustomize.py)
    gc.set_threshold(100_000, 50, 100)
    # xdist (3.7+) otherwise queues files by their number of tests, most first, whatever the order below: the long
    # files, which have few tests each, then started last (the AWS twin's, 7 tests, at the very end)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: a file's own order stays


def _port_free(port: int, hosts) -> bool:
    for host in hosts:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _below_ephemeral() -> int:
    """The first port the kernel hands out for outgoing connections: a port above it can be taken by any ssh or
    HTTP client of a neighbouring test between our check and the listen (EADDRINUSE at init_process_group)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_cluster_port(nodes: int, first: int = 2) -> int:
    hosts = [f"127.0.0.{first + i}" for i in range(nodes)]
    for _ in range(50):
        port = random.randint(20000, max(20010, _below_ephemeral() - 2))
        if _port_free(port, hosts) and _port_free(port + 1, hosts):  # sshd, and each node's metadata service
            return port
    raise RuntimeError("no free port for the local cluster")


def fab(*args: str, env: dict | None = None, timeout: float = 900, check: bool = False) -> subprocess.CompletedProcess:
    """Run the real `fab` CLI from the project root."""
    res = subprocess.run([*FAB, *args], cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    if check and res.returncode != 0:
        raise AssertionError(f"fab {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


class FabProcess:
    """A `fab` running in the background: wait for a line, signal it, collect its end. Threads read stdout and
    stderr as they come (a waiting test never blocks on a full pipe); with merge=True stderr goes to stdout, in
    order; new_session=True puts it in a process group of its own. Use it as a context manager: a fab still
    running when the test leaves is killed."""

    def __init__(self, *args: str, env: dict | None = None, merge: bool = False, cwd: Path = ROOT,
                 new_session: bool = False):
        self.args = args
        self.proc = subprocess.Popen([*FAB, *args], cwd=cwd, text=True, env={**os.environ, **(env or {})},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                                     start_new_session=new_session)
        self.out: list[str] = []
        self.err: list[str] = []
        self._cursor = {"out": 0, "err": 0}  # wait_for looks after its previous match
        self._readers = [threading.Thread(target=lambda s, into: into.extend(iter(s.readline, "")), args=pair,
                                          daemon=True)
                         for pair in [(self.proc.stdout, self.out)] + ([] if merge else [(self.proc.stderr, self.err)])]
        for t in self._readers:
            t.start()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, want: str | re.Pattern | Callable[[str], bool], timeout: float, count: int = 1,
                 stream: str = "out"):
        """The count-th line after the previous match (of stdout, or stream='err') that holds `want`: a text (the
        line is returned), a compiled pattern (its match is returned) or a test of the line. An AssertionError with
        the output so far when it does not come within `timeout` seconds or fab ends first."""
        lines = self.out if stream == "out" else self.err
        if isinstance(want, re.Pattern):
            test = want.search
        else:
            test = want if callable(want) else (lambda line: want in line)
        deadline = time.monotonic() + timeout
        while True:
            found = 0
            for i in range(self._cursor[stream], len(lines)):
                hit = test(lines[i])
                found += bool(hit)
                if hit and found == count:
                    self._cursor[stream] = i + 1
                    return hit if isinstance(want, re.Pattern) else lines[i]
            ended = self.proc.poll() is not None and not any(t.is_alive() for t in self._readers)
            if ended or time.monotonic() > deadline:
                why = f"fab ended ({self.proc.returncode})" if ended else f"not in {timeout:.0f}s"
                raise AssertionError(f"{getattr(want, 'pattern', want)!r} x{count} not seen, {why}: fab "
                                     f"{' '.join(self.args)}\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}")
            time.sleep(0.1)

    def signal(self, sig: int = signal.SIGINT) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for fab's end (it is killed after `timeout` seconds: the test then fails on its exit code)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for t in self._readers:
            t.join(10)
        return subprocess.CompletedProcess(["fab", *self.args], self.proc.returncode, self.stdout, self.stderr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def progress_steps(text: str) -> list[int]:
    """The steps of every '[progress] step N/M' line in `text`."""
    return [int(s) for s in re.findall(r"\[progress\] step (\d+)/", text)]


def progress_step(line: str) -> int | None:
    """The step of a '[progress] step N/M' line, else None."""
    steps = progress_steps(line)
    return steps[0] if steps else None


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

    def start(self, *args, env: dict | None = None, merge: bool = False, new_session: bool = False) -> FabProcess:
        """`fab ARGS` on this cluster, in the background."""
        return FabProcess(*args, env={**self.env, **(env or {})}, merge=merge, new_session=new_session)

    def run_dirs(self) -> set[str]:
        return {p.name for p in self.runs.iterdir()} if self.runs.exists() else set()


def start_cluster(tmp: Path, nodes: int, head: bool = False) -> LocalCluster:
    """A local cluster of `nodes` nodes; with `head`, its head too (detached runs' supervisors then run there).
    Without, this machine keeps that role, as for a hosts file without a head: the path most tests check."""
    lc = LocalCluster(tmp / "state", tmp / "runs", nodes, free_cluster_port(nodes + head))
    fab("local-up", "--nodes", str(nodes), "--port", str(lc.port), *([] if head else ["--no-head"]), env=lc.env,
        check=True, timeout=60)
    return lc


@pytest.fixture(scope="session")
def cluster2(tmp_path_factory):
    lc = start_cluster(tmp_path_factory.mktemp("cluster2"), 2)
    yield lc
    fab("local-down", env=lc.env, timeout=60)


@pytest.fixture(scope="session")
def uninterrupted_demo(cluster2, tmp_path_factory) -> Callable[[], dict]:
    """One uninterrupted 2-node run of the demo's arguments (--save-every 0), trained once per `make test` and
    shared by the tests that read it (test_cluster checks that it learned and recorded everything; test_spot
    compares its resume with a thin run's instead, at a fifth of the CPU). Call it where the run is needed:
    whichever xdist worker calls first trains it on its cluster, a later call reads it (waiting on the lock while
    another worker trains it).
    The call returns the fab result (returncode, stdout, stderr) and the run's folder."""
    from filelock import FileLock

    from launch.run import DEMO_ARGS

    done = _shared_dir(tmp_path_factory) / "uninterrupted-demo.json"

    def get() -> dict:
        with FileLock(str(done) + ".lock"):
            if not done.is_file():
                before = cluster2.run_dirs()
                res = cluster2.fab("train", "--nodes", "2", "--save-every", "0", "--", *DEMO_ARGS, timeout=900)
                new = sorted(cluster2.run_dirs() - before)
                done.write_text(json.dumps({"returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
                                            "run_dir": str(cluster2.runs / new[0]) if len(new) == 1 else None}))
            return json.loads(done.read_text())

    return get


def _shared_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # workers' temp folders are siblings


# What the lifecycle tests' runs train: the bundled MiniLM's first encoder layer, its first 4 of 12 heads (128 of 384
# dims) and 256 of 1536 feed-forward units. A 2-node step costs ~1/3 of the 1-layer cut's; PACE holds each step to
# that cut's speed on an idle machine, so the runs last through the same wall-clock windows (a notice polled every
# 0.5 s, a head's take-over, a node coming back) while their ranks sleep between steps.
THIN = {"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 256, "num_hidden_layers": 1}
PACE = ("--env", "XC_PACE_S=0.08")


def _thin(name: str, value):
    """`value` (a tensor of the bundled model) cut to THIN's shape."""
    h, ffn = THIN["hidden_size"], THIN["intermediate_size"]
    if "intermediate" in name:
        return value[:ffn] if value.dim() == 1 else value[:ffn, :h]
    if value.dim() == 1:
        return value[:h]
    if "embeddings" in name:
        return value[:, :h]
    if ".output.dense." in name and "attention" not in name:
        return value[:h, :ffn]
    return value[:h, :h]


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """The bundled MiniLM cut to THIN (same tokenizer; embeddings, first layer and pooler sliced from its weights).
    For the runs whose tests are about the run's lifecycle (notices, restarts, stores, supervisors), not about
    learning; what learns keeps the bundled model. Built once per `make test`, shared by the xdist workers."""
    from filelock import FileLock

    folder = _shared_dir(tmp_path_factory) / "minilm-thin"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "config.json").is_file():
            from transformers import AutoConfig, AutoModel, AutoTokenizer

            from training.jobs.common import DEFAULT_MODEL, resolve_model

            src = resolve_model(DEFAULT_MODEL)
            full = AutoModel.from_pretrained(src)
            config = AutoConfig.from_pretrained(src)
            for key, value in THIN.items():
                setattr(config, key, value)
            thin = type(full)(config)
            kept = {k: _thin(k, v).clone() for k, v in full.state_dict().items() if k in thin.state_dict()}
            assert {k: v.shape for k, v in kept.items()} == {k: v.shape for k, v in thin.state_dict().items()}
            thin.load_state_dict(kept)
            tmp = folder.with_name(folder.name + ".partial")
            thin.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
            tmp.rename(folder)
    return str(folder)


NEEDS_GCC = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc: training/speed/native's kernels are not built")


@pytest.fixture
def fresh_native():
    """training/speed/native's loaded library and tally forgotten before and after the test (one that switches
    XC_NATIVE_KERNELS or reads the tally leaves nothing to the next)."""
    from training.speed import native

    native.reset()
    yield
    native.reset()


def processes_with_env(needle: str, prefix: bool = False) -> list[int]:
    """PIDs whose environment holds the entry `needle` ('XC_RUN_ID=abc'), or any entry of that
    name when `needle` ends with '=' ('XC_RUN_ID='), or any entry starting with it when `prefix`."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = env.read_bytes().split(b"\0")
        except OSError:
            continue
        key = needle.encode()
        if any(e.startswith(key) for e in entries) if prefix or needle.endswith("=") else key in entries:
            found.append(int(env.parent.name))
    return found


def ranks_on(state: Path) -> set[int]:
    """Processes of a run (XC_RUN_ID set) on the local cluster whose state folder is `state`: every session its
    nodes' sshd starts carries XC_HOME=<state>/nodes/<node>/home. Other clusters' runs (parallel workers) are not."""
    return set(processes_with_env("XC_RUN_ID=")) & set(processes_with_env(f"XC_HOME={state}/", prefix=True))


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


def wait_until(what: str, check, timeout: float, poll: float = 1.0):
    """check()'s first true answer within timeout seconds, else an AssertionError naming what was awaited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def resumed_after_notice(imds, store: str, first: str) -> tuple[str, dict]:
    """A spot notice on `first` (a head-supervised run with --max-restarts): the run checkpoints and ends restarting,
    its supervisor resumes it, the resumed run ends and the supervisor exits. Returns (resumed run, its summary)."""
    from cluster import store as store_lib
    from launch.life.records import Status

    imds.interrupt()
    wait_until("the first run restarting, in the store",
               lambda: store_lib.read_summary(store, first)["status"] == "restarting", 300)
    imds.clear()
    second = wait_until("the resumed run", lambda: store_lib.read_summary(store, first).get("restarted_as"), 300)
    done = wait_until("the resumed run's end", lambda: (s := store_lib.read_summary(store, second)) and
                      Status(s["status"]).terminal and s, 600, poll=2)
    wait_until("the supervisor's exit", lambda: not processes_with_env(f"XC_SUPERVISOR={first}"), 60)
    return second, done


def tiny_gpt2(n_head: int = 2, **config):
    """A 2-layer GPT-2 with every dropout off and sdpa attention, seeded: the causal LM tests' model."""
    import transformers

    c = transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=n_head,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config)
    import torch

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(c, attn_implementation="sdpa")
