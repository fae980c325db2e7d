"""Your own project: --workdir ships a folder as git would commit it (content-addressed, size-limited, through the
store as the run's snapshot: tests/launch/test_snapshot.py), --script
runs inside it, --module runs `python -m`, and --launcher accelerate starts `accelerate launch` per rank.

The listing and the rank script are checked here without a cluster; the runs on the session's 2-node local
cluster (marked `cluster`) are the done-when: a two-file project runs unchanged.
"""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.constants import HOME_EXPR
from core.errors import ClusterError
from core.render import render
from launch.life import records
from launch.plan import launcher
from launch.staging import workdir
from training.runtime.paths import RunPaths

MiB = 1 << 20


def tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, body in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return root


IGNORING = {
    ".gitignore": "*.bin\n!keep.bin\nbuild/\n/top.txt\ndocs/**/*.tmp\n# a comment\n\n",
    "sub/.gitignore": "*.log\n",
    "a.py": "", "x.bin": "", "keep.bin": "", "build/o.py": "", "top.txt": "", "sub/top.txt": "", "sub/x.log": "",
    "sub/deep/y.log": "", "sub/deep/z.py": "", "docs/a/b/q.tmp": "", "docs/a/r.tmp": "", "docs/k.md": "",
    "__pycache__/m.cpython-311.pyc": "", "pkg/__pycache__/n.pyc": "", "pkg/__init__.py": "",
}
SHIPPED = ['.gitignore', 'a.py', 'docs/k.md', 'keep.bin', 'pkg/__init__.py', 'sub/.gitignore', 'sub/deep/z.py',
           'sub/top.txt']


def test_the_listing_honours_gitignore_outside_a_repository(tmp_path):
    assert workdir.list_files(tree(tmp_path, IGNORING)) == SHIPPED


def test_without_git_the_plain_reading_lists_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir, "_git", lambda *a: None)  # as on a machine without git
    assert workdir.list_files(tree(tmp_path, IGNORING)) == SHIPPED


def test_inside_a_repository_git_decides_and_dot_git_never_ships(tmp_path):
    root = tree(tmp_path / "repo", {**IGNORING, "forced.bin": ""})
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-f", "forced.bin"], check=True)  # tracked though ignored
    assert workdir.list_files(root) == sorted([*SHIPPED, "forced.bin"])
    assert workdir.list_files(root / "sub") == [".gitignore", "deep/z.py", "top.txt"]  # a folder of the repo


def test_the_size_limit_is_one_line_naming_the_fix_and_ignored_files_do_not_count(tmp_path, monkeypatch):
    root = tree(tmp_path / "proj", {".gitignore": "huge.bin\n", "train.py": "", "weights.pt": b"\0" * (3 * MiB),
                                    "huge.bin": b"\0" * (8 * MiB)})
    monkeypatch.setenv(workdir.LIMIT_ENV, "2")
    with pytest.raises(ClusterError) as exc:
        workdir.scan(str(root))
    assert str(exc.value) == (f"--workdir {root} holds 3.0 MiB in 3 file(s) (limit 2 MiB, largest: weights.pt "
                              "3.0 MiB, .gitignore 0 KiB, train.py 0 KiB); add large files to .gitignore or raise "
                              "the limit with XC_WORKDIR_LIMIT_MB=4")
    monkeypatch.setenv(workdir.LIMIT_ENV, "4")
    assert workdir.scan(str(root)).size == 3 * MiB + len("huge.bin\n")
    monkeypatch.setenv(workdir.LIMIT_ENV, "lots")
    with pytest.raises(ClusterError, match="XC_WORKDIR_LIMIT_MB='lots' is not a positive whole number of MiB; "):
        workdir.scan(str(root))


def test_the_digest_follows_content_and_the_executable_bit(tmp_path):
    root = tree(tmp_path / "proj", {"train.py": "print(1)\n", "model.py": "X = 1\n"})
    first = workdir.scan(str(root)).digest
    assert workdir.scan(str(root)).digest == first  # unchanged: the same folder on the nodes, not sent again
    (root / "model.py").write_text("X = 2\n")
    second = workdir.scan(str(root)).digest
    assert second != first
    (root / "train.py").chmod(0o755)
    assert workdir.scan(str(root)).digest not in (first, second)


def test_script_and_module_are_checked_against_what_ships(tmp_path):
    root = tree(tmp_path / "proj", {".gitignore": "secret.py\n", "train.py": "", "secret.py": "",
                                    "pkg/__init__.py": "", "pkg/main.py": "", "app/__main__.py": ""})
    wd = workdir.check(str(root), "train.py", None, "python", False)
    assert workdir.relative_script(wd, str(root / "train.py")) == "train.py"  # absolute, inside DIR
    assert workdir.module_file(wd, "pkg.main") == "pkg/main.py"
    assert workdir.module_file(wd, "app") == "app/__main__.py"
    for script, message in (("secret.py", "but .gitignore leaves it out, so it is not shipped"),
                            ("nope.py", "does not exist in --workdir"),
                            ("../x.py", "is outside --workdir")):
        with pytest.raises(ClusterError, match=message):
            workdir.check(str(root), script, None, "python", False)
    with pytest.raises(ClusterError, match="neither pkg/other.py nor pkg/other/__main__.py"):
        workdir.check(str(root), None, "pkg.other", "python", False)


def _rank_sh(tmp_path, plan, entry: list[str], work: Path | None) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "home" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "node_env.sh").write_text(render(
        "node_env.sh.j2", run_id="r1", node="node0", python=sys.executable, code_dir=str(tmp_path / "code"),
        rank_cpus=[], env=[], workdir=str(work) if work else None))
    (run_dir / "rank.sh").write_text(render("rank.sh.j2", run_id="r1", run_dir=RunPaths("r1", HOME_EXPR).node,
                                                      pin="no", entry=launcher.shell_join(entry),
                                            launch=launcher.launch_words(plan)))
    subprocess.run(["bash", "-n", str(run_dir / "rank.sh")], check=True)
    return subprocess.run(["bash", str(run_dir / "rank.sh")], capture_output=True, text=True, timeout=120, check=False,
                          env={"PATH": "/usr/bin:/bin", "XC_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})


def _plan(launcher_name: str) -> launcher.LaunchPlan:
    node = launcher.NodePlan(name="node0", layout=SimpleNamespace(ppn=1))
    return launcher.LaunchPlan(run_id="r1", nodes=(node,), master_addr="127.0.0.1", master_port=29999,
                               backend="gloo", precision="fp32", entry=(), launcher=launcher_name)


SHOW = "import os, sys; print(os.getcwd()); print(sys.path[1]); import helper; print(helper.__file__)"


def test_rank_sh_runs_in_the_workdir_with_it_on_sys_path(tmp_path):
    work = tree(tmp_path / "work", {"helper.py": ""})
    res = _rank_sh(tmp_path, _plan("python"), ["-c", SHOW], work)
    assert res.returncode == 0, res.stderr
    cwd, path1, helper = res.stdout.split()
    assert cwd == str(work) and helper == str(work / "helper.py")
    assert path1.endswith("/code/training/hook")  # the line-buffering sitecustomize still comes first


def test_rank_sh_starts_accelerate_launch_as_one_process(tmp_path):
    work = tree(tmp_path / "work", {"acc.py": "import os\nfrom accelerate import Accelerator\na = Accelerator()\n"
                                    "print('accelerate', a.process_index, a.num_processes, os.environ['ACCELERATE_USE_CPU'],"
                                    " os.getcwd())\n"})
    res = _rank_sh(tmp_path, _plan("accelerate"), ["acc.py"], work)
    assert res.returncode == 0, res.stderr
    assert f"accelerate 0 1 True {work}" in res.stdout


# ---- on the local cluster ----------------------------------------------------------------------------------

MODEL_PY = """import torch


class Scale(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor
"""

TRAIN_PY = """import os, sys
import torch, torch.distributed as dist
from model import Scale

dist.init_process_group("gloo")
rank = dist.get_rank()
numbers = [float(x) for x in open("data/numbers.txt").read().split()]
t = Scale(2.0)(torch.tensor([sum(numbers) * (rank + 1)]))
dist.all_reduce(t)
fresh = not os.path.exists("written.txt")
open("written.txt", "w").write("a run wrote this in its own copy")
print(f"rank {rank} sum {t.item():.0f} in {os.path.basename(os.getcwd())} big.bin there {os.path.exists('big.bin')} "
      f"fresh {fresh} args {sys.argv[1:]}")
dist.destroy_process_group()
"""


def node_home(lc, name: str) -> Path:
    return lc.state / "nodes" / name / "home"


def _summary(lc, before: set[str]) -> dict:
    (run_id,) = lc.run_dirs() - before
    return records.load(lc.runs / run_id).to_json()


@pytest.mark.cluster
def test_a_two_file_project_runs_unchanged_and_ships_once(cluster2, tmp_path):
    proj = tree(tmp_path / "proj", {"train.py": TRAIN_PY, "model.py": MODEL_PY, "data/numbers.txt": "1 2 3\n",
                                    ".gitignore": "big.bin\n", "big.bin": b"\0" * (4 * MiB),
                                    "VERSION": uuid.uuid4().hex})  # a digest no earlier run shipped
    runs = []
    for _ in range(2):
        before = cluster2.run_dirs()
        res = cluster2.fab("train", "--nodes", "2", "--workdir", str(proj), "--script", "train.py", "--", "--lr", "1",
                           timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs.append((res.stdout + res.stderr, _summary(cluster2, before)))
    (first, summary), (second, again) = runs
    digest, key = summary["workdir"]["digest"], summary["spec"]["what"]["snapshot"]
    assert again["workdir"]["digest"] == digest and summary["workdir"]["files"] == 5  # big.bin left out
    # once into the store (the cluster's, here the local folder), once onto each node, whatever the runs
    assert again["spec"]["what"]["snapshot"] == key and f"code snapshot {key} (--workdir {proj}, 5 file(s)) put in" in first
    assert f"code snapshot {key} fetched from the store by node0, node1" in first
    assert f"code snapshot {key} (--workdir {proj}, 5 file(s)) already in the store: nothing sent" in second
    assert f"code snapshot {key} already on every node" in second
    for out in (first, second):  # 6 x 2 x (1 + 2): model.py imported, data read from the cwd, all-reduced
        assert "[0 node0] rank 0 sum 36 in work big.bin there False fresh True args ['--lr', '1']" in out
        assert "[1 node1] rank 1 sum 36 in work big.bin there False fresh True" in out
    for name in ("node0", "node1"):
        shipped = node_home(cluster2, name) / "snapshots" / key / "work"
        assert (shipped / "model.py").is_file() and (shipped / "data" / "numbers.txt").is_file()
        assert not (shipped / "big.bin").exists() and not (shipped / "written.txt").exists()
    assert summary["spec"]["what"]["workdir"] == str(proj) and summary["launcher"] == "python"


@pytest.mark.cluster
def test_a_module_entry_point_runs_with_python_m(cluster2, tmp_path):
    proj = tree(tmp_path / "proj", {
        "pkg/__init__.py": "", "pkg/util.py": "def world():\n    import os\n    return os.environ['WORLD_SIZE']\n",
        "pkg/main.py": "import os, sys\nfrom pkg.util import world\nimport helper\n"
                       "print(f'module {__name__} {__spec__.name} rank {os.environ[\"RANK\"]} of {world()} '\n"
                       "      f'{helper.NAME} args {sys.argv[1:]}')\n",
        "helper.py": "NAME = 'helper from the workdir'\n"})
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--workdir", str(proj), "--module", "pkg.main", "--", "--x", "y",
                       timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[0 node0] module __main__ pkg.main rank 0 of 2 helper from the workdir args ['--x', 'y']" in res.stdout
    assert "[1 node1] module __main__ pkg.main rank 1 of 2 helper from the workdir" in res.stdout
    summary = _summary(cluster2, before)
    assert summary["module"] == "pkg.main" and summary["script"] == "pkg/main.py" and summary["status"] == "ok"


ACCELERATE_PY = """import sys
import torch
from accelerate import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
print(f"accelerate {accelerator.process_index}/{accelerator.num_processes} {accelerator.distributed_type} "
      f"sum {total.item():.0f} args {sys.argv[1:]}")
accelerator.end_training()
"""


@pytest.mark.cluster
def test_an_accelerate_launched_script_sees_every_rank(cluster2, tmp_path):
    script = tmp_path / "acc.py"
    script.write_text(ACCELERATE_PY)
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--script", str(script), "--launcher", "accelerate", "--", "--a", "b",
                       timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[0 node0] accelerate 0/2 DistributedType.MULTI_CPU sum 3 args ['--a', 'b']" in res.stdout
    assert "[1 node1] accelerate 1/2 DistributedType.MULTI_CPU sum 3" in res.stdout
    assert _summary(cluster2, before)["launcher"] == "accelerate"


def test_relative_paths_reach_the_supervisor_absolute(tmp_path, monkeypatch):
    """`fab train --workdir . --script train.py --detach --max-restarts 1` from the user's folder: the supervisor (on
    the head, or a restart later) runs in another directory, so the request names the folder, a lone script and the
    data files as absolute paths (it said `--script train.py does not exist in --workdir .`)."""
    from launch.supervision import train_flags

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print('hi')\n")
    (proj / "train.csv").write_text("a,b\n1,2\n")
    monkeypatch.chdir(proj)
    runs = tmp_path / "runs"
    flags = train_flags.TrainFlags(workdir=".", script="train.py", detach=True, max_restarts="1",
                                   job_args=("--train_file", "train.csv", "--validation_file=train.csv", "--lr", "3"))
    req = train_flags.resolve(flags, runs).req
    what = req.spec.what
    assert what.workdir == str(proj) and what.script == "train.py"  # the script stays relative to the folder
    assert what.args == ("--train_file", str(proj / "train.csv"), f"--validation_file={proj / 'train.csv'}", "--lr", "3")
    lone = train_flags.resolve(train_flags.TrainFlags(script="train.py"), runs).req.spec.what
    assert lone.script == str(proj / "train.py") and lone.workdir is None
