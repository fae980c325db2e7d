"""`fab setup` wall time on 1 local node against 8, with the test profile and fresh venvs.

Each size gets a fresh local cluster (new state folder, so every node builds its venv and pip-installs
the profile's package from PyPI), then a second `fab setup` on the same cluster (every node already
set up: the fan-out's own overhead). A warm-up run first fills pip's cache, so both sizes see the
same network. Prints the wall times, the ratio 8/1, the fan-out's concurrency (sum of the per-node
seconds over the wall time: 1 for one-after-another, N for N nodes fully in parallel) and the command.
Writes bench/results/setup_fanout.json.

    .venv/bin/python bench/setup_fanout.py [--sizes 1 8]

All local nodes share this machine's CPUs: on a machine with fewer cores than nodes, venv creation
and pip are CPU-bound and the ratio shows the cores, while the concurrency shows the fan-out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAB = [sys.executable, "-m", "fabric"]
ROW = re.compile(r"^(node\d+)\s+(ok|already set up|FAILED)\s+([\d.]+)$", re.MULTILINE)


def free_port(nodes: int) -> int:
    for _ in range(50):
        port = random.randint(20000, 32000)  # below the kernel's ephemeral range (32768 by default)
        try:
            for i in range(nodes):
                with socket.socket() as s:
                    s.bind((f"127.0.0.{2 + i}", port))
            return port
        except OSError:
            continue
    raise SystemExit("no free port for the local cluster")


def fab(env: dict, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    res = subprocess.run([*FAB, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=1800, check=False, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - started
    if res.returncode != 0:
        raise SystemExit(f"fab {' '.join(args)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
    return wall, res


def node_cpu_s(state: Path) -> float:
    """CPU seconds used on the nodes so far: each sshd listener's own time plus its reaped sessions'
    (every command of `fab setup` runs in such a session, so this is the nodes' whole share)."""
    total = 0
    for n in json.loads((state / "local" / "state.json").read_text())["nodes"]:
        fields = Path(f"/proc/{n['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def setup_run(env: dict, profile: str) -> dict:
    state = Path(env["XC_STATE_DIR"])
    cpu_before = node_cpu_s(state)
    wall, res = fab(env, "setup", "--profile", profile)
    cpu = node_cpu_s(state) - cpu_before
    rows = ROW.findall(res.stdout)
    seconds = [float(s) for _, _, s in rows]
    return {"wall_s": round(wall, 2), "results": sorted({r for _, r, _ in rows}),
            "node_s": {"min": min(seconds), "median": round(statistics.median(seconds), 2), "max": max(seconds)},
            "concurrency": round(sum(seconds) / wall, 2), "node_cpu_s": round(cpu, 2),
            # The wall time the nodes' CPU work alone needs on this machine's cores, run perfectly in parallel.
            "cpu_bound_s": round(cpu / len(os.sched_getaffinity(0)), 2)}


def measure(nodes: int, profile: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"xc-bench-{nodes}-"))
    env = {"XC_STATE_DIR": str(tmp / "state"), "XC_RUNS_DIR": str(tmp / "runs"), "XC_CLUSTER": "local"}
    try:
        fab(env, "local-up", "--nodes", str(nodes), "--port", str(free_port(nodes)))
        fresh = setup_run(env, profile)
        again = setup_run(env, profile)
    finally:
        subprocess.run([*FAB, "local-down"], cwd=ROOT, env={**os.environ, **env}, capture_output=True, check=False,
                       timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    assert fresh["results"] == ["ok"] and again["results"] == ["already set up"], (fresh, again)
    return {"nodes": nodes, "fresh": fresh, "already_set_up": again}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs=2, default=[1, 8], metavar=("SMALL", "LARGE"))
    p.add_argument("--profile", default="test")
    a = p.parse_args()
    small, large = a.sizes
    print("warm-up: 1 node (fills pip's cache; not counted)", flush=True)
    measure(1, a.profile)
    runs = {}
    for n in (small, large):
        print(f"{n} node(s): fresh cluster, fab setup --profile {a.profile} twice", flush=True)
        runs[n] = measure(n, a.profile)
        r = runs[n]
        print(f"  fresh: {r['fresh']['wall_s']:.1f} s wall, per node {r['fresh']['node_s']['min']:.1f}-"
              f"{r['fresh']['node_s']['max']:.1f} s, concurrency {r['fresh']['concurrency']:.2f}, node CPU "
              f"{r['fresh']['node_cpu_s']:.1f} s (>= {r['fresh']['cpu_bound_s']:.1f} s wall on this machine); "
              f"already set up: {r['already_set_up']['wall_s']:.1f} s", flush=True)
    ratio = runs[large]["fresh"]["wall_s"] / runs[small]["fresh"]["wall_s"]
    noop_ratio = runs[large]["already_set_up"]["wall_s"] / runs[small]["already_set_up"]["wall_s"]
    command = f".venv/bin/python bench/setup_fanout.py --sizes {small} {large} --profile {a.profile}"
    result = {
        "command": command, "setup_command": f"fab setup --profile {a.profile}", "cpus": os.cpu_count(),
        "runs": {str(k): v for k, v in runs.items()},
        "ratio_fresh": round(ratio, 2), "ratio_already_set_up": round(noop_ratio, 2),
    }
    print(f"fab setup --profile {a.profile}, fresh venvs: {small} node(s) {runs[small]['fresh']['wall_s']:.1f} s, "
          f"{large} nodes {runs[large]['fresh']['wall_s']:.1f} s: ratio {ratio:.2f} "
          f"(one after another would be ~{large / small:.0f}); concurrency at {large} nodes "
          f"{runs[large]['fresh']['concurrency']:.2f} on {os.cpu_count()} CPU(s); the nodes' CPU work alone needs "
          f"{runs[large]['fresh']['cpu_bound_s']:.1f} s of it")
    print(f"already set up: {small} node(s) {runs[small]['already_set_up']['wall_s']:.1f} s, {large} nodes "
          f"{runs[large]['already_set_up']['wall_s']:.1f} s: ratio {noop_ratio:.2f}")
    print(f"command: {command}")
    out = ROOT / "bench" / "results" / "setup_fanout.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
