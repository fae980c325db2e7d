"""`fab train --detach --max-restarts K`: the run's supervisor (the restart loop, the watchdog, the
checkpoint mirror: what an attached fab does) as a process of its own, in a session of its own, so it
outlives the operator's terminal and fab itself (kill -9 included). fab starts it, hands it the resolved
request on a pipe (secret --env values never touch a disk), waits until the first run's ranks run, prints
the run id and returns. The supervisor writes its pid into every run record it runs (`supervisor`), so
`fab runs`, `fab logs -f` and `fab stop` find it again; its own output goes to runs/.supervisors/<id>.log.

Run as `python -m launch.life.supervisor` (stdin: the pickled job)."""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from cluster.node import Node
from core.constants import PROJECT_ROOT
from core.errors import ClusterError
from launch.life import records
from launch.life.cleanup import runs_alive
from launch.life.records import Status
from training.paths import RunPaths

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900  # staging, probing and the ranks' start on a loaded machine
FOLDER = ".supervisors"


def start(spec: str, req, max_restarts: int, restart_wait: float, out: TextIO) -> str:
    """Start the supervisor; return once the first run's ranks all run (its id), or raise what stopped it."""
    folder = Path(req.runs_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    job = payload(spec, req, max_restarts, restart_wait)
    with log_path.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.life.supervisor"], cwd=PROJECT_ROOT, stdin=subprocess.PIPE,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    proc.stdin.write(job)
    proc.stdin.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    run_id, shown = None, 0
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        for line in text[shown:].splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            shown += len(line)
            if run_id is None:
                out.write(line)  # the plan and staging lines, as an attached run shows them
                m = re.match(r"run (\S+): results in ", line)
                run_id = m.group(1) if m else None
        out.flush()
        if run_id and _ranks_running(RunPaths(run_id, runs_dir=req.runs_dir).home):
            out.write(f"run {run_id} detached under its supervisor (pid {proc.pid}, up to {max_restarts} restart(s)): "
                      f"follow it with 'fab logs {run_id} -f', list runs with 'fab runs', end it with "
                      f"'fab stop {run_id}'\n")
            return run_id
        if proc.poll() is not None:
            last = [ln for ln in text.splitlines() if ln.strip()]
            if proc.returncode == 0 and run_id:  # a short run ended before we looked
                out.write((last[-1] if last else f"run {run_id} ended") + "\n")
                return run_id
            why = last[-1] if last else f"it exited {proc.returncode}"
            raise ClusterError(f"the run's supervisor ended before its ranks ran: {why.removeprefix('error: ')}",
                               f"see {log_path}")
        time.sleep(0.5)
    raise ClusterError(f"the run's supervisor (pid {proc.pid}) did not start the ranks within {START_TIMEOUT_S}s",
                       f"see {log_path}; end it with 'fab stop {run_id}'" if run_id else f"see {log_path}")


def payload(spec: str, req, max_restarts: int, restart_wait: float) -> bytes:
    """What the supervisor is handed on its stdin. What validate() found stays here (a scanned --workdir holds
    a lock): the supervisor, a process of its own, checks the request once itself."""
    return pickle.dumps({"spec": spec, "req": dataclasses.replace(req, checked=None), "max_restarts": max_restarts,
                         "restart_wait": restart_wait})


def _ranks_running(run_dir: Path) -> bool:
    rec = records.load_or_none(run_dir)
    if rec is None or rec.status != Status.RUNNING or not rec.nodes:
        return False
    nodes = [Node(**n) for n in rec.nodes]
    alive = runs_alive(nodes).get(rec.run_id, {})
    return all(alive.get(n.name, 0) >= int(rec.ppn or 1) for n in nodes)


def main() -> int:
    from cluster.resolve import open_cluster
    from core.errors import format_error
    from launch.life import restarts
    from launch.life.records import result_line

    logging.basicConfig(level=logging.DEBUG if os.environ.get("XC_DEBUG") else logging.INFO, format="%(message)s",
                        stream=sys.stdout)
    for noisy in ("paramiko", "invoke", "fabric", "botocore", "boto3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to end
    job = pickle.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    try:
        result = restarts.train_with_restarts(open_cluster(job["spec"]), job["req"], job["max_restarts"],
                                              job["restart_wait"])
    except ClusterError as exc:
        sys.stdout.write(format_error(exc) + "\n")
        return exc.exit_code
    sys.stdout.write(result_line(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
