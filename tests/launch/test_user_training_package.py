"""A user project with a top-level `training` package of its own: its `--workdir` is before our code on the
ranks' sys.path, yet the rank hook's spot behaviour stays on (it imports our training.* from our code, theirs set
aside and put back), a notice is taken, and `fab train --resume` fetches the checkpoint and continues. The user's
`training.paths` shares a name with ours: each side keeps seeing its own.

The hook's imports are checked in one process without a cluster (a Trainer script's path too); the notice and the
resume on the session's 2-node local cluster, against the fake IMDS on loopback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_imds import FakeIMDS

from training.runtime import notice

ROOT = Path(__file__).resolve().parents[2]
TOY = (ROOT / "docs" / "examples" / "ddp_toy.py").read_text()
INIT = 'if distributed:\n    dist.init_process_group("gloo")\n'


def _script() -> str:
    """docs/examples/ddp_toy.py that imports its own training.paths before and after the group is made (the rank
    hook imports ours then) and says which one it got."""
    assert INIT in TOY, "docs/examples/ddp_toy.py changed: update this test's INIT"
    said = ('print(f"rank {os.environ.get(\'RANK\')} {when}: {training.paths.WHO} '
            '{getattr(training, \'ours\', False)}", flush=True)\n')
    before = "import os\nimport training.paths\nwhen = 'before the group'\n" + said
    after = "import training.paths\nwhen = 'after the group'\n" + said
    return before + TOY.replace(INIT, INIT + after, 1)


def _project(root: Path) -> Path:
    (root / "training").mkdir(parents=True)
    (root / "training" / "__init__.py").write_text("ours = True  # the user's package\n")
    (root / "training" / "paths.py").write_text("WHO = 'the project paths'\n")
    return root


HOOK_CHECK = """
import training.paths as mine
import sitecustomize as hook
preempt = hook._ours("runtime.preempt")  # what a group or a Trainer makes the hook import
import transformers.trainer      # the hook patches the Trainer with our preempt
import training.paths as again
print(mine.WHO, again.WHO, again is mine)
print(preempt.__file__, preempt.store.__file__)
print(transformers.trainer.Trainer._xc_patched, hook._ours("runtime.contract").preempt is preempt)
"""


def test_the_rank_hook_imports_ours_and_leaves_the_projects_training_in_place(tmp_path):
    """What a rank of a --workdir run sees: its project before our code on PYTHONPATH, our hook first."""
    proj = _project(tmp_path / "proj")
    hook = ROOT / "training" / "hook"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(proj), str(ROOT)]), "XC_RUN_ID": "r1",
           "XC_RANK_REPORT": str(tmp_path / "run" / "ranks" / "{rank}.json"), "WORLD_SIZE": "2"}
    res = subprocess.run([sys.executable, "-c", HOOK_CHECK], cwd=proj, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs, ours, patched = res.stdout.splitlines()
    assert theirs == "the project paths the project paths True"
    assert ours.split() == [str(ROOT / "training" / "runtime" / "preempt.py"), str(ROOT / "training" / "runtime" / "store.py")]
    assert patched == "True True"  # one copy of ours: the Trainer's patch and the notice file share preempt


@pytest.mark.cluster
@pytest.mark.slow
def test_a_project_with_its_own_training_package_keeps_the_spot_hook_and_resumes(cluster2, tmp_path):
    proj = _project(tmp_path / "proj")
    (proj / "train.py").write_text(_script())
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        with cluster2.start("train", "--nodes", "2", "--workdir", str(proj), "--script", "train.py",
                            *imds.train_env(), "--", "--steps", "200", "--sleep", "0.05") as running:
            running.wait_for("step 50 loss", 300)
            imds.interrupt()
            ended = running.finish(300)
    finally:
        imds.close()  # the resumed run's ranks then find no IMDS: no second notice
    (run_id,) = cluster2.run_dirs() - before
    out = ended.stdout + ended.stderr
    assert ended.returncode == notice.EXIT, out[-3000:]
    assert "spot notice file is off" not in out, out[-3000:]
    said = notice.Notice.parse(out.splitlines())
    assert said is not None and said.cause == notice.SPOT and said.durable and said.step > 50, out[-3000:]
    for rank in (0, 1):
        for when in ("before the group", "after the group"):
            assert f"rank {rank} {when}: the project paths True" in out, out[-3000:]
    ckpt = cluster2.runs.parent / "store" / "runs" / run_id / "checkpoints" / f"checkpoint-{said.step}"
    assert (ckpt / "xc-complete").is_file() and (ckpt / "state.pt").is_file(), ckpt

    resumed = cluster2.fab("train", "--resume", run_id, timeout=300)
    again = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, again[-3000:]
    assert f"at step {said.step}" in again and "resumed from" in again, again[-3000:]
    assert "done at step 200" in again, again[-3000:]
    assert "rank 1 after the group: the project paths True" in again  # the fetch at start-up left theirs in place
