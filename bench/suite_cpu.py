"""Where a command's CPU goes: runs it, reads every process's CPU time from /proc once a second, and prints
the CPU seconds by kind of process (training ranks by job and flags, fab tasks, pytest workers, sshd, the
kernel's own threads) and by test (the PYTEST_CURRENT_TEST a process was started under). The suite is
CPU-bound on 2 cores, so this, not --durations' wall times (which overlap on the workers), says what a
change to the tests saves.

    .venv/bin/python bench/suite_cpu.py [--top 25] [--json out.json] -- make test

A process is first seen within a second of its start; its CPU is the last reading before it exited, so a
process that lives under a second may be missed and each loses up to a second of its end. Linux only.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from glue_single_node import cpu_line

HZ = os.sysconf("SC_CLK_TCK")
WORKER_DIR = re.compile(r"/popen-(gw\d+)/")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sample(seen: dict, before: bool = False, running: dict | None = None) -> None:
    """One pass over /proc: (pid, start time) -> {comm, argv, test, cpu, base}. A process already running
    before the command (before=True) counts only the CPU it takes from then on. `running` (xdist worker -> the
    test it runs, kept between passes) lets a process sshd started, which has no PYTEST_CURRENT_TEST, count under
    the test its worker runs when it is first seen, found by the worker's folder (pytest's popen-gwN) in its
    working directory or command line."""
    running = {} if running is None else running
    fresh = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ  # utime + stime
            key = (pid, fields[19])  # starttime: a reused pid is another process
            if key in seen:
                seen[key]["cpu"] = max(seen[key]["cpu"], cpu)
                if seen[key]["comm"] != comm:  # bash exec'd the rank: take the new command line
                    seen[key].update(comm=comm, argv=_argv(pid))
                continue
            test, worker = "", ""
            for kv in _read(f"/proc/{pid}/environ").split(b"\0"):
                if kv.startswith(b"PYTEST_CURRENT_TEST="):
                    test = kv[len(b"PYTEST_CURRENT_TEST="):].decode(errors="replace").split(" ")[0]
                elif kv.startswith(b"PYTEST_XDIST_WORKER="):
                    worker = kv[len(b"PYTEST_XDIST_WORKER="):].decode(errors="replace")
            seen[key] = {"comm": comm, "argv": _argv(pid), "test": test, "cpu": cpu, "base": cpu if before else 0.0}
            if test and worker:
                running[worker] = test
            elif not test:
                seen[key]["cwd"] = _cwd(pid)
                fresh.append(key)
        except (OSError, ValueError, IndexError):
            continue  # gone, or a kernel thread's unreadable environ
    for key in fresh:  # started by sshd (a rank, a node's helper): the test its worker runs, found by its folder
        found = WORKER_DIR.findall(seen[key].get("cwd", "") or " ".join(seen[key]["argv"]))
        if found and found[-1] in running:  # the innermost: a test's own folder may hold another worker-like one
            seen[key]["test"] = running[found[-1]]
            seen[key]["by_folder"] = True


def _cwd(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _argv(pid: str) -> list[str]:
    return [a.decode(errors="replace") for a in _read(f"/proc/{pid}/cmdline").split(b"\0") if a]


def kind(proc: dict) -> str:
    argv, comm = proc["argv"], proc["comm"]
    line = " ".join(argv)
    if not argv:
        return f"kernel {comm.split('/')[0]}"
    for i, a in enumerate(argv):
        if a == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("training."):
            rest = argv[i + 2:]
            flags = [x for x in rest if x.startswith("--") and x != "--model_name_or_path"][:3]
            model = [Path(rest[j + 1]).name for j, x in enumerate(rest[:-1]) if x == "--model_name_or_path"]
            return f"rank {argv[i + 1].rpartition('.')[2]} {' '.join(flags)}" + (f" ({model[0]})" if model else "")
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] == "fabric":
            return f"fab {argv[i + 2] if i + 2 < len(argv) else ''}".strip()
    if "accelerate" in line or line.endswith(".py") or any(a.endswith("train.py") for a in argv):
        return "rank (user script or accelerate)"
    if "exec(eval(sys.stdin" in line:
        return "pytest worker"
    if "pytest" in line:
        return "pytest"
    if "pip" in line:
        return "pip"
    if "moto" in line:
        return "moto server"
    return comm


def report(procs: list[dict], wall: float, top: int) -> str:
    total = sum(p["cpu"] for p in procs)
    by_kind, count = collections.Counter(), collections.Counter()
    by_test = collections.defaultdict(collections.Counter)
    for p in procs:
        k = kind(p)
        by_kind[k] += p["cpu"]
        count[k] += 1
        test = p["test"] or "(no test: the kernel, setup, processes of no worker's folder)"
        by_test[test][k.split(" ")[0]] += p["cpu"]
    busy = total / wall / (os.cpu_count() or 1)
    summary = f"wall {wall:.0f} s, CPU {total:.0f} s over {len(procs)} processes ({busy:.0%} of {os.cpu_count()} cpus)"
    lines = [cpu_line(), summary, "", "by kind:"]
    lines += [f"{c:9.1f} s {c / total:6.1%} {count[k]:5d}  {k}" for k, c in by_kind.most_common(top)]
    lines += ["", "by test:"]
    for test, c in sorted(by_test.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        s = sum(c.values())
        lines.append(f"{s:9.1f} s  {test}  ({', '.join(f'{k} {v:.0f}' for k, v in c.most_common(3))})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s [--top N] [--json F] -- CMD")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, help="also write every process seen here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command to measure after --, e.g. -- make test")
    seen: dict = {}
    running: dict = {}
    sample(seen, before=True)
    start = time.monotonic()
    child = subprocess.Popen(cmd)
    while child.poll() is None:
        sample(seen, running=running)
        time.sleep(1.0)
    wall = time.monotonic() - start
    procs = [dict(p, cpu=p["cpu"] - p.pop("base")) for (pid, _), p in seen.items() if pid != str(os.getpid())]
    procs = [p for p in procs if p["cpu"] > 0]
    print(report(procs, wall, a.top))
    if a.json:
        a.json.write_text(json.dumps(procs))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
