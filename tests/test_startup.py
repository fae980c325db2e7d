"""training/runtime/startup.py and the rank hook: the collector's threshold is raised for a rank's imports and put
back, with start-up's objects frozen, once its group forms."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from conftest import ROOT

from training.runtime import startup

PROBE = """
import gc, json, sys
seen = {"start": gc.get_threshold()}
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
seen.update(after=gc.get_threshold(), frozen=gc.get_freeze_count(), default=sys.modules["sitecustomize"].GC_THRESHOLD)
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_hold_then_settle_freezes_and_puts_the_threshold_back():
    before = gc.get_threshold()
    gc.set_threshold(1234, 11, 12)  # whatever this process had (an in-process job may have held it)
    try:
        startup.hold()
        assert gc.get_threshold() == startup.HIGH
        startup.hold()  # already held: the threshold to put back is still the first one
        frozen = gc.get_freeze_count()
        startup.settle()
        assert gc.get_threshold() == (1234, 11, 12) and gc.get_freeze_count() > frozen
        startup.settle()  # settled: nothing more happens
        assert gc.get_threshold() == (1234, 11, 12)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_rank_imports_under_the_raised_threshold_and_its_group_puts_it_back(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "training" / "hook"), str(ROOT)]),
           "XC_RANK_REPORT": str(tmp_path / "report-{rank}.json"), "XC_RUN_ID": "r1", "WORLD_SIZE": "1",
           "XC_NOTICE_FILE": str(tmp_path / "notice.json"), "XC_CHECKPOINT_DIR": str(tmp_path / "out")}
    res = subprocess.run([sys.executable, "-c", PROBE % port], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert tuple(seen["start"]) == startup.HIGH
    assert tuple(seen["after"]) == tuple(seen["default"]) != startup.HIGH and seen["frozen"] > 10_000, seen
