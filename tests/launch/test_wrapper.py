"""Node 0's wrapper (launch.life.detach) run by bash on this machine: mpirun's stdout and stderr both reach
mpirun.log, its status reaches exit_code, and a supervisor's followed command shows the log and exits with that
status, while the wrapper itself runs on in its own session."""
from __future__ import annotations

import shlex
import subprocess
import sys

from launch.life import detach

RANKS = "import sys, time; print('out line', flush=True); time.sleep(1.5); print('err line', file=sys.stderr); sys.exit(3)"


def _wrapper(run_dir, secrets: bool = False) -> str:
    argv = f"{shlex.quote(sys.executable)} -c {shlex.quote(RANKS)}"
    return detach.wrapper_command(str(run_dir), "/usr/bin", argv, sys.executable, "/nonexistent", secrets)


def test_the_wrapper_keeps_both_streams_and_the_status(tmp_path):
    subprocess.run(["bash", "-c", _wrapper(tmp_path)], check=True, timeout=30)
    subprocess.run(["bash", "-c", f"while [ ! -f {tmp_path}/exit_code ]; do sleep 0.1; done"], timeout=30, check=True)
    assert (tmp_path / "mpirun.log").read_text().split() == ["out", "line", "err", "line"]
    assert (tmp_path / "exit_code").read_text().split()[0] == "3"


def test_a_followed_run_shows_the_log_and_exits_with_mpiruns_status(tmp_path):
    res = subprocess.run(["bash", "-c", detach.followed_command(str(tmp_path), _wrapper(tmp_path))],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 3, res
    assert res.stdout.split() == ["out", "line", "err", "line"], res.stdout
    assert res.stderr == ""  # tail's own notes (the log not there yet) are not the run's output
