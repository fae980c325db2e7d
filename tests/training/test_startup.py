"""training/runtime/startup.py and the rank hook: the collector's threshold is raised for a rank's imports and put
back, with start-up's objects frozen, once its group forms."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_transformers_import_structure_is_read_from_its_file_after_the_first_process(tmp_path):
    import types

    models = tmp_path / "models"
    models.mkdir()
    (models / "__init__.py").write_text("")
    calls = []

    def own(module_path, prefix=None):
        calls.append((module_path, prefix))
        return {frozenset({"torch"}): {"bert.modeling_bert": {"BertModel"}}, "prefix": prefix}

    def process():  # a fresh process's import_utils module, wrapped by the hook
        module = types.SimpleNamespace(__file__=str(tmp_path / "import_utils.py"), define_import_structure=own)
        startup.cache_import_structure(module, folder=tmp_path / "cache")
        return module

    (tmp_path / "import_utils.py").write_text("")
    expected = own(str(models / "__init__.py"))
    calls.clear()
    first = process().define_import_structure(str(models / "__init__.py"))
    assert first == expected and len(calls) == 1
    assert len(list((tmp_path / "cache").glob("hf-import-structure-*.pickle"))) == 1
    assert process().define_import_structure(str(models / "__init__.py")) == expected and len(calls) == 1  # read
    process().define_import_structure(str(models / "__init__.py"), prefix="models")
    assert len(calls) == 2  # another key
    (models / "bert").mkdir()  # the folder changed (a reinstall): read anew
    process().define_import_structure(str(models / "__init__.py"))
    assert len(calls) == 3
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: computed each time, no error
    blocked = types.SimpleNamespace(__file__=str(tmp_path / "import_utils.py"), define_import_structure=own)
    startup.cache_import_structure(blocked, folder=tmp_path / "a-file" / "cache")
    assert blocked.define_import_structure(str(models / "__init__.py")) == expected and len(calls) == 4
    assert not list(tmp_path.glob("**/*.tmp"))


IMPORT_PROBE = """
import json, os, sys
import transformers
from transformers import AutoModelForSequenceClassification
import transformers.utils.import_utils as iu
models = os.path.join(os.path.dirname(transformers.__file__), "models", "__init__.py")
print(json.dumps({"cached": getattr(iu.define_import_structure, "xc_cached", False),
                  "same": iu.define_import_structure(models) == iu.define_import_structure.original(models)}))
"""


def test_a_rank_reads_the_same_import_structure_that_transformers_computes(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "training" / "hook"), str(ROOT)]),
           "XC_RANK_REPORT": str(tmp_path / "report-{rank}.json")}
    for _ in range(2):  # the first may write the venv's file, the second reads it
        res = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True,
                             timeout=120, check=False)
        assert res.returncode == 0, res.stderr[-3000:]
        assert json.loads(res.stdout.strip().splitlines()[-1]) == {"cached": True, "same": True}
    assert list((Path(sys.prefix) / "var" / "xeon-cluster").glob("hf-import-structure-*.pickle"))
