"""Seconds from `fab train` to rank 0's first optimizer step on a warm 2-node local cluster, by phase.

Starts its own local cluster (its own state folder, sshd on --port, default 2422, so that a cluster someone
else runs is left alone), makes it warm with one run of the same job (the page cache holds the venv, each
node remembers its bf16 timing), then runs `fab train --nodes 2` --runs times with XC_TIMELINE=1: rank 0
prints its milestones (training/runtime/timeline.py), and fab's own lines are timed as they arrive. Phases:

    cli        fab's own start-up, up to its first line
    probing    the cluster, node facts and the precision probe, up to the launch plan
    staging    keys, the mesh check, code and data on every node, up to 'launching ... with mpirun'
    mpirun     from there to rank 0's process start (mpirun, ssh, the rank script)
    torch      rank 0's torch import and its process group (training/jobs/dist.py's setup)
    imports    transformers and the job's modules
    data       reading the data set, and tokenizing it
    model      loading the model and applying the speed levers
    first step the Trainer's set-up and step 1, forward, backward and optimizer

The median run is printed with the min and max of each phase over the runs. Last line:
    first_step_s=<median seconds from `fab train` to rank 0's first optimizer step>
The local cluster is torn down at the end (also on failure). The nodes share this machine's cores.

    .venv/bin/python bench/first_step.py [--runs 3] [--port 2422] [--job glue] [-- job flags]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from glue_single_node import cpu_line, load_line

from training.runtime import events

FAB = str(ROOT / ".venv" / "bin" / "fab")
# fab train's lines that end a phase (their first words), in order
FAB_MARKS = [("probing", "backend:"), ("staging", "launching ")]
RANK_MARKS = ["process_start", "dist_setup", "imports", "data_loaded", "model_loaded", "tokenized", "train_begin",
              "first_step"]
PHASES = ["cli", "probing", "staging", "mpirun", "torch", "imports", "data", "model", "first step"]


def timed_run(cmd: list[str], env: dict) -> tuple[float, list[tuple[float, str]], int]:
    """(start, [(arrival, line)], exit code) of a command whose stdout lines are stamped as they arrive."""
    start = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.time(), line.rstrip("\n")) for line in p.stdout]
    return start, lines, p.wait()


def phases(start: float, lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per phase of one run, from fab's line arrival times and rank 0's [timeline] marks."""
    at: dict[str, float] = {}
    if lines:
        at["cli"] = lines[0][0]
    for t, text in lines:
        for name, prefix in FAB_MARKS:
            if name not in at and text.startswith(prefix):
                at[name] = t
        mark = events.first([text], events.MARK)
        if mark is not None:
            at.setdefault(mark.payload["name"], mark.time)
    missing = [m for m in ["cli", *(n for n, _ in FAB_MARKS), *RANK_MARKS] if m not in at]
    if missing:
        raise SystemExit(f"the run printed no mark for {', '.join(missing)}; its output:\n"
                         + "\n".join(text for _, text in lines[-30:]))
    ends = {"cli": at["cli"], "probing": at["probing"], "staging": at["staging"], "mpirun": at["process_start"],
            "torch": at["dist_setup"], "imports": at["imports"], "data": at["data_loaded"], "model": at["model_loaded"],
            "first step": at["first_step"]}
    out, prev = {}, start
    for name in PHASES:
        out[name] = ends[name] - prev
        prev = ends[name]
    out["data"] += at["tokenized"] - at["model_loaded"]  # tokenizing comes after the model
    out["first step"] -= at["tokenized"] - at["model_loaded"]
    out["total"] = at["first_step"] - start
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--port", default="2422")
    p.add_argument("--job", default="glue")
    a, job_flags = p.parse_known_args()
    job_flags = [f for f in job_flags if f != "--"] or ["--do_train", "--max_train_samples", "64", "--max_steps", "2"]
    state = tempfile.mkdtemp(prefix="xc-first-step-")
    env = {**os.environ, "XC_STATE_DIR": state}
    train = [FAB, "train", "--nodes", "2", "--job", a.job, "--env", "XC_TIMELINE=1", "--", *job_flags]
    runs: list[dict[str, float]] = []
    try:
        up = subprocess.run([FAB, "local-up", "--nodes", "2", "--port", a.port], cwd=ROOT, env=env,
                            capture_output=True, text=True, check=False)
        if up.returncode != 0:
            raise SystemExit(f"fab local-up failed:\n{up.stdout[-1500:]}{up.stderr[-1500:]}")
        print(f"local cluster: 2 nodes on port {a.port} (state {state}); warming it with one run", flush=True)
        _, lines, rc = timed_run(train, env)
        if rc != 0:
            raise SystemExit("the warm-up run failed:\n" + "\n".join(t for _, t in lines[-30:]))
        for i in range(a.runs):
            start, lines, rc = timed_run(train, env)
            if rc != 0:
                raise SystemExit(f"run {i + 1} failed:\n" + "\n".join(t for _, t in lines[-30:]))
            runs.append(phases(start, lines))
            print(f"run {i + 1}/{a.runs}: {runs[-1]['total']:.2f} s to the first step ({load_line()})", flush=True)
    finally:
        subprocess.run([FAB, "local-down"], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        shutil.rmtree(state, ignore_errors=True)
    median = statistics.median(r["total"] for r in runs)
    mid = min(runs, key=lambda r: abs(r["total"] - median))
    print(f"\n`fab train --nodes 2 --job {a.job} -- {' '.join(job_flags)}`, warm 2-node local cluster, "
          f"{a.runs} runs; {load_line()}")
    print(cpu_line())
    print(f"{'phase':<12}{'median run':>11}{'min':>8}{'max':>8}")
    for name in [*PHASES, "total"]:
        vals = [r[name] for r in runs]
        print(f"{name:<12}{mid[name]:>11.2f}{min(vals):>8.2f}{max(vals):>8.2f}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_step.json").write_text(json.dumps({"runs": runs, "median_s": median, "cpu": cpu_line(),
                                                     "command": " ".join(train[1:]), "load_at_end": load_line()},
                                                    indent=2))
    print(f"first_step_s={median:.2f}")


if __name__ == "__main__":
    main()
