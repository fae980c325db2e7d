"""How fast a run recovers on the AWS twin, with the product's default settings (root only).

The twin (`fab local-up --aws --nodes 2`: moto as EC2, S3 and Auto Scaling, each instance a real sshd node in a
network namespace), the glue job on the bundled MiniLM, paced so that a run lasts a few minutes
(XC_PACE_S=0.25), `fab train --nodes 2 --detach --max-restarts 2`: the head supervises. Nothing else is tuned: the
ranks' notice poll, the supervisor's polls and the head's heartbeat are the defaults.

  spot:      at step 8, `fab local-notice node1 --kind spot --after AFTER` (IMDS posts the notice; AFTER s later
             EC2 takes node1 and the group launches a replacement); the figure is the resumed run's recovery line
             (`fab runs`): the notice to its first optimizer step, by phase (ending, waiting for nodes, staging,
             start-up), and the supervisor's own lines about the wait.
  takeover:  at step 8, `fab local-kill head` (no notice); the figure is the seconds until a supervisor of the
             chain runs in the replacement head's namespace.

Prints the CPU line with every figure. Last line:
    notice_to_first_step_s=<run 1>,<run 2> takeover_s=<run 1>,<run 2>

    sudo .venv/bin/python bench/recovery_twin.py [--runs 2] [--after 5]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from glue_single_node import cpu_line, load_line

from training.runtime import events

KEEP_OUT = ("XC_CLUSTER", "XC_STORE", "XC_AWS_ENDPOINT_URL", "XC_S3_ENDPOINT_URL", "XC_SSH_KEY")
ARGS = ("--max_train_samples", "3840", "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
        "--max_eval_samples", "64", "--save_steps", "0")


def fab(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fabric", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def must(res: subprocess.CompletedProcess, what: str) -> str:
    if res.returncode:
        raise SystemExit(f"error: {what} failed ({res.returncode}): {(res.stdout + res.stderr)[-2000:]}")
    return res.stdout


def steps(env: dict, run_id: str) -> int:
    return max(events.steps(fab(env, "logs", run_id, timeout=60).stdout), default=0)


def wait(what: str, check, timeout: float, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {what}: not within {timeout:.0f}s")
        time.sleep(poll)


def supervisors(chain: str) -> set[str]:
    """The network namespaces of the processes that carry XC_SUPERVISOR=<chain>."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"XC_SUPERVISOR={chain}".encode() not in environ.read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        ns = subprocess.run(["ip", "netns", "identify", environ.parent.name], capture_output=True, text=True,
                            check=False).stdout.strip()
        if ns:
            found.add(ns)
    return found


def start(env: dict) -> str:
    from training.jobs.common import DEFAULT_MODEL, resolve_model

    # the bundled model's files, which the nodes (this machine's file system) read: the image has no offline copy
    out = must(fab(env, "train", "--nodes", "2", "--detach", "--max-restarts", "2", "--env", "XC_PACE_S=0.25", "--",
                   *ARGS, "--model_name_or_path", str(resolve_model(DEFAULT_MODEL))), "fab train --detach")
    run_id = re.search(r"run (\S+) detached", out)[1]

    def at_8() -> bool:
        if re.search(rf"^{run_id}\s+\S+\s+\d+\s+(failed|stopped)", fab(env, "runs", timeout=60).stdout, re.MULTILINE):
            raise SystemExit(f"error: run {run_id} ended before step 8: 'fab logs {run_id}' says why")
        return steps(env, run_id) >= 8
    wait(f"run {run_id} at step 8", at_8, 600, poll=2)
    return run_id


def spot(env: dict, after: float) -> float:
    first = start(env)
    must(fab(env, "local-notice", "node1", "--kind", "spot", "--after", str(after)), "fab local-notice")

    def recovered():
        line = re.search(rf"recovery {first} -> (\S+): recovery_s=([\d.]+).*", fab(env, "runs", timeout=60).stdout)
        return line
    line = wait("the resumed run's first step", recovered, 600, poll=2)
    print(f"spot: {line[0]}; {load_line()}", flush=True)
    twin = Path(env["XC_STATE_DIR"]) / "twin"
    logs = sorted(twin.glob("instances/*/home/runs/.supervisors/*.log"), key=lambda p: p.stat().st_mtime)
    said = [ln for ln in (logs[-1].read_text().splitlines() if logs else [])
            if re.search(r"waiting for|node\(s\) ready|restart \d+ of|resuming:", ln)]
    watched = (twin / "watcher.log").read_text().splitlines() if (twin / "watcher.log").is_file() else []
    for ln in [*said, *watched[-6:]]:  # the supervisor's wait, and when the twin took and booted instances
        print(f"  {ln}")
    fab(env, "stop", first, timeout=120)
    return float(line[2])


def takeover(env: dict) -> float:
    chain = start(env)
    old = wait("the chain's supervisor on the head", lambda: supervisors(chain), 60)
    must(fab(env, "local-kill", "head"), "fab local-kill head")
    gone = time.monotonic()
    wait("a supervisor on the new head", lambda: supervisors(chain) - old, 300, poll=0.5)
    took = time.monotonic() - gone
    print(f"takeover: head killed -> a supervisor of {chain} on the new head in {took:.1f}s (default heartbeat "
          f"30 s); {load_line()}", flush=True)
    fab(env, "stop", chain, timeout=120)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--after", type=float, default=5.0, help="seconds from the spot notice to EC2 taking the node")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("error: the AWS twin needs root; run it with sudo")
    tmp = Path(tempfile.mkdtemp(prefix="xc-recovery-"))
    env = {**os.environ, **dict.fromkeys(KEEP_OUT, ""), "XC_STATE_DIR": str(tmp / "state"),
           "XC_RUNS_DIR": str(tmp / "runs")}
    print(cpu_line(), flush=True)
    up = must(fab(env, "local-up", "--aws", "--nodes", "2", timeout=300), "fab local-up --aws")
    export = next(line for line in up.splitlines() if line.startswith("export "))
    env.update(dict(kv.split("=", 1) for kv in export.split()[1:]))
    try:
        notices = [spot(env, a.after) for _ in range(a.runs)]
        takeovers = [takeover(env) for _ in range(a.runs)]
    finally:
        fab(env, "local-down", timeout=300)
    print(f"notice_to_first_step_s={','.join(f'{s:.1f}' for s in notices)} "
          f"takeover_s={','.join(f'{s:.1f}' for s in takeovers)}")


if __name__ == "__main__":
    main()
