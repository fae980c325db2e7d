"""Metrics while a run trains: rank 0's TensorBoard event files reach the store as the run goes (not only at its
end), and `fab tensorboard` shows a chain (a run and the run it was resumed as) as one run, served by TensorBoard
itself on 127.0.0.1."""
from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import FabProcess, fab, tiny_gpt2, wait_until

from training.runtime import tbsync


def _train(tmp_path: Path, store: Path, run_id: str, steps: int, monkeypatch, resume: Path | None = None) -> list[str]:
    """A tiny causal LM trained to step `steps` (from `resume`'s checkpoint if given; checkpoint-2 saved) with
    report_to tensorboard and the sync callback; the store's event files seen at each logging step (what a watcher
    could have pulled while it trained)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    monkeypatch.setenv("XC_STORE", store.as_uri())
    monkeypatch.setenv("XC_RUN_ID", run_id)
    monkeypatch.setenv("XC_TB_SYNC_S", "1")
    seen: list[str] = []

    class Look(TrainerCallback):
        def on_log(self, args, state, control, **kw):
            time.sleep(1.2)  # one sync period
            seen.append(",".join(sorted(str(p.relative_to(store)) for p in store.rglob("*tfevents*"))))

    rows = [{"input_ids": torch.randint(0, 300, (16,)), "labels": torch.randint(0, 300, (16,))} for _ in range(steps)]
    args = TrainingArguments(output_dir=str(tmp_path / run_id), use_cpu=True, report_to="tensorboard", max_steps=steps,
                             per_device_train_batch_size=1, logging_steps=1, save_strategy="steps", save_steps=2,
                             seed=7, disable_tqdm=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=rows, callbacks=[Look()])
    trainer.add_callback(tbsync.sync_callback(trainer))
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return seen


def _summary(store: Path, run_id: str, **fields) -> None:
    folder = store / "runs" / run_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps({"run_id": run_id, **fields}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_event_files_reach_the_store_while_it_trains_and_a_chain_is_one_run_in_tensorboard(tmp_path, monkeypatch):
    store = tmp_path / "store"
    first, second = "20261128-100000-glue-aaaa", "20261128-100500-glue-bbbb"
    seen = _train(tmp_path, store, first, 3, monkeypatch)
    assert seen[0], seen  # after the first logging step, before the end: the file was already in the store
    assert all(s.startswith(f"runs/{first}/output/runs/") for s in seen[-1].split(",")), seen
    resumed_at = time.time()  # the second segment resumes from the first's step 2, as a chain's next run does
    _train(tmp_path, store, second, 4, monkeypatch, resume=tmp_path / first / "checkpoint-2")
    _summary(store, first, status="preempted", restarted_as=second)
    _summary(store, second, status="ok", resumed_from={"run_id": first, "step": 2})
    env = {"XC_CLUSTER": "", "XC_STORE": "", "HOME": str(tmp_path / "home")}
    url = store.as_uri()

    # the second run names the chain from its start: both segments' files in one folder
    res = fab("tensorboard", second, "--no-serve", "--store", url, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    folder = tmp_path / "home" / ".cache" / "xeon-cluster" / "tensorboard" / first / first
    assert f"tensorboard {second}: 2 event file(s) from 2 runs: {first} -> {second} in {folder}" in res.stdout, \
        res.stdout
    names = sorted(p.name for p in folder.glob("*tfevents*"))
    # the two runs' files, the chain's start before them and between them (by name, the order TensorBoard reads them
    # in) the mark of the resume
    assert len(names) == 4 and names[0].endswith(".xc-start") and names[2].endswith(f".xc-resume-{second}"), names

    port = _free_port()
    with FabProcess("tensorboard", first, "--port", str(port), "--store", url, env=env, merge=True) as served:
        served.wait_for(lambda line: f"TensorBoard at http://127.0.0.1:{port}/" in line, 60)

        def runs() -> list[str] | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as r:
                    return json.loads(r.read()) or None
            except OSError:
                return None
        assert wait_until("TensorBoard's run list", runs, 90) == [first]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run={first}&tag=train/loss",
                                    timeout=10) as r:
            points = json.loads(r.read())  # [wall time, step, value]: TensorBoard's own reading of our files
        # one curve: steps 1-2 from the first run, 3-4 from the resumed one (TensorBoard drops the first's step 3,
        # which the resumed run logged again)
        assert [p[1] for p in points] == [1, 2, 3, 4], points
        assert [p[0] < resumed_at for p in points] == [True, True, False, False], (points, resumed_at)

    def serving() -> list[str]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if f"--port\0{port}\0" in (proc / "cmdline").read_text():
                    found.append(proc.name)
            except OSError:
                continue
        return found
    # fab ended (killed, as the test's exit does it): its TensorBoard with it, nothing left serving
    assert wait_until("TensorBoard's end with fab's", lambda: not serving(), 20, poll=0.5)


def test_bad_input_is_one_line(tmp_path):
    env = {"XC_CLUSTER": "", "XC_STORE": "", "HOME": str(tmp_path)}
    store = (tmp_path / "store")
    store.mkdir()
    res = fab("tensorboard", "20261128-100000-glue-cccc", "--no-serve", "--store", store.as_uri(), env=env, timeout=60)
    assert res.returncode != 0 and "no run 20261128-100000-glue-cccc in the store" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2, res.stderr
    res = fab("tensorboard", "../etc", "--no-serve", "--store", store.as_uri(), env=env, timeout=60)
    assert res.returncode != 0 and "is not a run id" in res.stderr, res.stderr


@pytest.mark.parametrize("inside", [True, False])
def test_the_store_key_keeps_the_folder_under_the_outputs(tmp_path, inside):
    out = tmp_path / "out"
    logs = out / "runs" / "Nov28_x" if inside else tmp_path / "elsewhere" / "tb"
    expect = "runs/r1/output/runs/Nov28_x" if inside else "runs/r1/output/tensorboard/tb"
    assert tbsync.store_prefix("r1", logs, out) == expect
