"""`fab` from the user's own repository: the venv's `fab` is the project's (core/fabmain.py), which loads
this checkout's fabfile and fabric.yaml where Fabric finds no fabfile at or above the current folder. The tasks,
the job flags after `--` and the cluster the checkout started are then found from any folder.

These run the installed script itself (`.venv/bin/fab`, what the README puts on PATH), not `python -m fabric`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, fab

VENV_FAB = Path(sys.executable).parent / "fab"


def fab_at(cwd: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    assert "core.fabmain" in VENV_FAB.read_text(), f"{VENV_FAB} is Fabric's own fab, not the project's; run 'make venv'"
    return subprocess.run([str(VENV_FAB), *args], cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def test_fab_lists_the_checkouts_tasks_from_a_folder_outside_it(tmp_path):
    outside = fab_at(tmp_path, "--list")
    assert outside.returncode == 0, outside.stderr
    assert "  train " in outside.stdout and "  status " in outside.stdout
    assert outside.stdout == fab("--list").stdout  # the very listing Fabric's own fab gives inside the checkout


def test_a_fabfile_of_the_users_own_still_wins_and_an_explicit_root_is_fabrics(tmp_path):
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "fabfile.py").write_text("from invoke import task\n\n\n@task\ndef hello(c):\n    print('hi')\n")
    own = fab_at(tmp_path / "own", "--list")
    assert own.returncode == 0 and "hello" in own.stdout and "train" not in own.stdout, own.stdout + own.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    named = fab_at(tmp_path, "-r", str(empty), "--list")  # -r DIR: Fabric's answer, no fallback
    assert named.returncode == 1 and "Can't find any collection named 'fabfile'" in named.stderr + named.stdout


def test_the_default_state_and_runs_folders_are_the_checkouts_from_any_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XC_STATE_DIR", "XC_RUNS_DIR")}
    code = "from cluster.local import state_dir; from launch.plan.request import RUNS; print(state_dir()); print(RUNS)"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    assert res.stdout.split() == [str(ROOT / ".cluster" / "local"), str(ROOT / "runs")]


TRAIN_PY = """import sys
import torch, torch.distributed as dist
from helper import WORD

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():.0f} {WORD} args {sys.argv[1:]}")
dist.destroy_process_group()
"""


@pytest.mark.cluster
def test_status_and_a_workdir_run_from_the_users_own_repository(cluster2, tmp_path):
    repo = tmp_path / "myproj"
    repo.mkdir()
    (repo / "train.py").write_text(TRAIN_PY)
    (repo / "helper.py").write_text("WORD = 'from-the-users-repo'\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    status = fab_at(repo, "status", "--no-runs", env=cluster2.env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith("cluster: local, 2 node(s)")
    assert f"127.0.0.2:{cluster2.port}" in status.stdout and f"127.0.0.3:{cluster2.port}" in status.stdout
    before = cluster2.run_dirs()
    res = fab_at(repo, "train", "--nodes", "2", "--workdir", ".", "--script", "train.py", "--", "--lr", "1",
                 env=cluster2.env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # the job flags after `--` reached the script: the checkout's fabric.yaml (its executor) was loaded too
    assert "[0 node0] rank 0 sum 3 from-the-users-repo args ['--lr', '1']" in res.stdout
    assert "[1 node1] rank 1 sum 3 from-the-users-repo args ['--lr', '1']" in res.stdout
    assert len(cluster2.run_dirs() - before) == 1  # the run's record is where the checkout keeps them


def test_every_task_answers_task_help_both_ways(capsys, monkeypatch):
    """`fab TASK --help` shows the task's help, as `fab --help TASK` does, for every task: invoke's parser alone took
    `--help` as the value of a task's positional argument (`fab local-notice --help`: "no local node '--help'")."""
    from core.fabmain import make_fab

    monkeypatch.chdir(ROOT)
    names = [m.group(1) for line in fab("--list").stdout.splitlines() if (m := re.match(r"^  ([a-z][a-z-]*)(\s|$)", line))]
    assert {"local-notice", "logs", "train", "local-down"} <= set(names)
    for name in names:
        for argv in (["fab", name, "--help"], ["fab", "--help", name], ["fab", name, "-h"]):
            make_fab().run(argv, exit=False)
            out = capsys.readouterr()
            assert f"Usage: fab [--core-opts] {name} " in out.out, f"{' '.join(argv)}: {out.out[-300:]}{out.err[-300:]}"
    make_fab().run(["fab", "local-notice"], exit=False)  # without --help the positional stays required
    assert "did not receive required positional arguments: 'node'" in capsys.readouterr().err
