"""A run's own files as a snapshot in the store (launch/staging/snapshot.py, training/runtime/snapshot.py), without a
cluster: put there once per content, unpacked once per node and copied into each run, and what a restart or a
resume runs whatever the folder holds by then. The local cluster's restart from it: tests/launch/test_script_restarts.py."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from core.errors import ClusterError
from launch.life import records
from launch.life.records import RunRecord, Status
from launch.plan.request import TrainRequest, validate
from launch.staging import snapshot
from training.runtime import snapshot as node_side
from training.runtime import store as store_lib
from training.runtime.paths import Checkpoints


def _project(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "train.py").write_text("from model import f\nprint(f())\n")
    (root / "model.py").write_text("def f():\n    return 1\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("big.bin\n")
    (root / "big.bin").write_bytes(b"\0" * 1024)
    return root


def _request(tmp_path: Path, proj: Path, **kw) -> TrainRequest:
    data = tmp_path / "elsewhere" / "train.csv"
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("sentence1,sentence2,label\na,b,0\n")
    fields = {"job": None, "script": "train.py", "workdir": str(proj), "args": ["--train_file", str(data)],
              "env": {"XC_STORE": (tmp_path / "store").as_uri()}, "runs_dir": tmp_path / "runs", **kw}
    return validate(TrainRequest.of(**fields))


@pytest.fixture
def puts(monkeypatch):
    """The keys put in a file store, in order."""
    sent: list[str] = []
    real = store_lib.FileStore.put_file

    def counted(self, local, key, progress=None):
        sent.append(key)
        return real(self, local, key, progress)

    monkeypatch.setattr(store_lib.FileStore, "put_file", counted)
    return sent


def test_the_same_folder_twice_is_put_in_the_store_once(tmp_path, puts):
    proj = _project(tmp_path / "proj")
    said: list[str] = []
    first = snapshot.prepare(_request(tmp_path, proj), said.append)
    key = first.spec.what.snapshot
    assert key and puts == [f"snapshots/{key}.tar.gz"]
    assert said[0].startswith(f"code snapshot {key} (--workdir {proj}, 5 file(s)) put in the store, ")
    assert first.to_record()["what"]["snapshot"] == key  # the run's record keeps the key
    second = snapshot.prepare(_request(tmp_path, proj), said.append)  # a second run of the same folder
    assert second.spec.what.snapshot == key and puts == [f"snapshots/{key}.tar.gz"]  # nothing uploaded again
    assert said[1] == f"code snapshot {key} (--workdir {proj}, 5 file(s)) already in the store: nothing sent"
    # the key is the content's: the same files in another folder are the same snapshot; an edit is a new one
    twin = _project(tmp_path / "twin")
    assert snapshot.prepare(_request(tmp_path, twin), said.append).spec.what.snapshot == key and len(puts) == 1
    (proj / "model.py").write_text("def f():\n    return 2\n")
    assert snapshot.prepare(_request(tmp_path, proj), said.append).spec.what.snapshot != key and len(puts) == 2
    held = json.loads((tmp_path / "store" / "snapshots" / f"{key}.json").read_text())
    assert sorted(held["workdir"]["files"]) == [".gitignore", "model.py", "run.sh", "train.py"]  # big.bin ignored
    assert list(held["data"]) == ["0-train.csv"]


def test_without_a_store_nothing_is_put_anywhere(tmp_path, puts):
    proj = _project(tmp_path / "proj")
    req = _request(tmp_path, proj, env={})
    assert snapshot.prepare(req, print) is req and puts == []
    bundled = validate(TrainRequest.of(job="glue", env={"XC_STORE": (tmp_path / "store").as_uri()},
                                    runs_dir=tmp_path / "runs"))
    assert snapshot.prepare(bundled, print) is bundled  # nothing of this machine's to ship


def test_a_node_unpacks_a_snapshot_once_and_copies_it_into_each_run(tmp_path, monkeypatch):
    proj = _project(tmp_path / "proj")
    req = snapshot.prepare(_request(tmp_path, proj), print)
    monkeypatch.setenv("XC_STORE", req.store)
    cache, runs = tmp_path / "node" / "snapshots", tmp_path / "node" / "runs"
    for run, fetched in (("one", "fetched"), ("two", "cached")):
        (runs / run / "data").mkdir(parents=True)
        assert node_side.main([req.spec.what.snapshot, str(cache), str(runs / run)]) == 0
        work = runs / run / "work"
        assert (work / "train.py").read_text() == (proj / "train.py").read_text()
        assert not (work / "big.bin").exists() and (runs / run / "data" / "0-train.csv").is_file()
        assert os.stat(work / "run.sh").st_mode & stat.S_IXUSR  # the executable bit travels
    (runs / "one" / "work" / "written.txt").write_text("a run wrote this")  # a run's own copy, not the cache's
    assert not (runs / "two" / "work" / "written.txt").exists()
    assert not (cache / req.spec.what.snapshot / "work" / "written.txt").exists()
    assert sorted(p.name for p in cache.iterdir()) == [req.spec.what.snapshot]  # no partial copies left
    res = node_side.main(["0123456789abcdef", str(cache), str(runs / "one")])  # not in the store
    assert res == 1


def test_a_restart_runs_the_snapshot_whatever_the_folder_holds_now(tmp_path):
    proj = _project(tmp_path / "proj")
    req = snapshot.prepare(_request(tmp_path, proj), print)
    kept = json.loads(json.dumps(req.to_record()))
    assert kept["what"]["data"] == {} and kept["what"]["script_digest"] is None  # the manifest has them, and they may not be here
    (proj / "train.py").write_text("raise SystemExit('edited')\n")
    (proj / "model.py").unlink()
    (tmp_path / "elsewhere" / "train.csv").unlink()
    again = validate(TrainRequest.from_record(kept, req.spec.what.env, set(), runs_dir=tmp_path / "runs"))
    wd = again.checked[0]
    assert again.spec.what.snapshot == req.spec.what.snapshot and "model.py" in wd.files and wd.digest == req.checked[0].digest
    for path in proj.rglob("*"):  # the folder gone altogether (a head never had it)
        path.unlink()
    proj.rmdir()
    assert validate(TrainRequest.from_record(kept, req.spec.what.env, set(), runs_dir=tmp_path / "runs")).checked[0].files
    (tmp_path / "store" / "snapshots" / f"{req.spec.what.snapshot}.json").unlink()
    with pytest.raises(ClusterError) as exc:
        validate(TrainRequest.from_record(kept, req.spec.what.env, set(), runs_dir=tmp_path / "runs"))
    assert exc.value.what == (f"the run's code snapshot snapshots/{req.spec.what.snapshot}.tar.gz is not in the store "
                              f"{req.store}") and "--code current" in exc.value.fix


def _recorded(tmp_path: Path, req: TrainRequest, run_id: str = "20260101-000000-script-abcd") -> str:
    run_dir = tmp_path / "runs" / run_id
    run_dir.mkdir(parents=True)
    rec = RunRecord(run_id, Status.PREEMPTED, spec=json.loads(json.dumps(req.to_record())), world_size=2,
                    nodes=[{}, {}], workdir=req.checked[0].record())
    rec._save(run_dir)
    ck = run_dir / "checkpoints" / "checkpoint-20"
    ck.mkdir(parents=True)
    (ck / "model.safetensors").write_bytes(b"w")
    (ck / Checkpoints.MARKER).write_text("{}")
    assert records.load(run_dir).spec["what"]["snapshot"] == req.spec.what.snapshot
    return run_id


def test_resume_takes_the_snapshot_and_code_current_names_what_changed(tmp_path):
    from launch.supervision.train_flags import TrainFlags, resolve

    proj = _project(tmp_path / "proj")
    req = snapshot.prepare(_request(tmp_path, proj), print)
    run_id = _recorded(tmp_path, req)
    (proj / "train.py").write_text("print('edited')\n")
    (proj / "model.py").unlink()
    (proj / "new.py").write_text("")
    store = req.store
    resumed = resolve(TrainFlags(resume=run_id), tmp_path / "runs", store=store).req  # no refusal: the snapshot
    assert resumed.spec.what.snapshot == req.spec.what.snapshot and resumed.resume.step == 20 and not resumed.resume.current
    assert validate(resumed).checked[0].files == req.checked[0].files
    current = resolve(TrainFlags(resume=run_id, code="current"), tmp_path / "runs", store=store).req
    assert current.spec.what.snapshot is None and current.resume.current and current.resume.snapshot == req.spec.what.snapshot
    said: list[str] = []
    after = snapshot.prepare(validate(current), said.append)
    assert after.spec.what.snapshot not in (None, req.spec.what.snapshot)
    assert said[-1] == (f"--code current: resuming {run_id} with --workdir {proj} as it is now: changed train.py; "
                        "added new.py; removed model.py")
    (tmp_path / "elsewhere" / "train.csv").write_text("sentence1,sentence2,label\nc,d,1\n")
    with pytest.raises(ClusterError) as exc:  # other code, yes; other data, no
        snapshot.prepare(validate(current), said.append)
    assert exc.value.what == (f"--resume {run_id} --code current: its data file {tmp_path / 'elsewhere' / 'train.csv'} "
                              "changed since the run")
    assert exc.value.fix.startswith("restore it, or resume without --code current")


def test_the_code_flag_goes_with_resume_and_names_its_choices(tmp_path):
    from launch.supervision.train_flags import TrainFlags, resolve

    with pytest.raises(ClusterError) as exc:
        resolve(TrainFlags(code="current"), tmp_path)
    assert exc.value.what == "--code current goes with --resume: a new run ships the folder as it is"
    with pytest.raises(ClusterError) as exc:
        resolve(TrainFlags(resume="x", code="latest"), tmp_path)
    assert exc.value.what == "--code 'latest' is not one of snapshot, current" and "--code current" in exc.value.fix


def test_an_aws_head_supervises_a_run_whose_files_are_in_the_store(tmp_path):
    from cluster.node import Node
    from launch.life import head

    proj = _project(tmp_path / "proj")
    aws = Node(name="dev-head", host="10.0.0.5", private_host="10.0.0.5", user="ubuntu", labels={"aws_head": "dev"})
    req = _request(tmp_path, proj)
    assert head.files_here(aws, req) == f"--workdir {proj}, --train_file {tmp_path / 'elsewhere' / 'train.csv'}"
    assert head.files_here(aws, snapshot.prepare(req, print)) is None
    assert head.files_here(aws, req.but(workdir=None, script=None, args=[])) is None
