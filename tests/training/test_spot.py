"""Surviving spot: the IMDSv2 watcher, complete-only checkpoints, and a run told to stop by a fake IMDS
on loopback, brought home and resumed on a real local cluster."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from conftest import processes_with_env, progress_steps
from fake_imds import FakeIMDS

from launch.life import records
from training.runtime import spot
from training.runtime.paths import Checkpoints


def test_watcher_takes_a_token_then_sees_the_notice():
    imds = FakeIMDS()
    try:
        w = spot.NoticeWatcher(imds.url, interval=0.05)
        assert w.check() is None  # 404: no notice yet
        imds.interrupt()
        assert w.check()["action"] == "terminate"
        puts = [r for r in imds.requests if r[0] == "PUT"]
        assert len(puts) == 1 and all(code != 401 for _, _, code in imds.requests)  # one token, reused
        imds.token = "rotated"  # the token expired: refused once, fetched again
        assert w.check()["action"] == "terminate"
        assert [r[0] for r in imds.requests if r[2] == 401] == ["GET"]
    finally:
        imds.close()


def test_watcher_thread_reports_a_notice_and_stops_quietly_off_aws():
    imds = FakeIMDS()
    try:
        w = spot.NoticeWatcher(imds.url, interval=0.05)
        w.start()
        imds.interrupt()
        w.join(5)
        assert not w.is_alive() and w.notice["action"] == "terminate"
    finally:
        imds.close()
    off = spot.NoticeWatcher("http://127.0.0.1:9", interval=0.05)  # nothing listens: not on EC2
    off.start()
    off.join(5)
    assert not off.is_alive() and off.notice is None and off.active is False


def test_one_failed_first_look_does_not_turn_the_watcher_off(monkeypatch):
    """A loaded node's first look at IMDS can time out; the watcher goes on looking and sees the notice after."""
    imds = FakeIMDS()
    try:
        w = spot.NoticeWatcher(imds.url, interval=0.05)
        real, failed = w.check, []

        def first_fails():
            if not failed:
                failed.append(1)
                raise TimeoutError("timed out")
            return real()

        monkeypatch.setattr(w, "check", first_fails)
        w.start()
        imds.interrupt()
        w.join(5)
        assert failed and not w.is_alive() and w.active and w.notice["action"] == "terminate"
    finally:
        imds.close()


def test_the_poll_interval_comes_from_the_ranks_environment(monkeypatch):
    monkeypatch.delenv(spot.POLL_ENV, raising=False)
    assert spot.NoticeWatcher("http://x").interval == spot.POLL_S == 5.0
    monkeypatch.setenv(spot.POLL_ENV, "0.5")
    assert spot.NoticeWatcher("http://x").interval == 0.5
    assert spot.NoticeWatcher("http://x", interval=2).interval == 2
    for bad in ("often", "0", "61"):
        monkeypatch.setenv(spot.POLL_ENV, bad)
        with pytest.raises(ValueError, match=spot.POLL_ENV):
            spot.NoticeWatcher("http://x")


def test_a_pace_holds_each_step_to_its_floor_sleeping_not_computing(monkeypatch):
    """XC_PACE_S: the step boundary sleeps out the rest of the floor, so a step that took 0.05 s lasts 0.3 s and the
    process's CPU does not grow with it; a step longer than the floor is not held."""
    from types import SimpleNamespace

    monkeypatch.setenv(spot.PACE_ENV, "0.3")
    cb = spot.spot_callback(watcher=None, save_every="0")
    state, control = SimpleNamespace(global_step=0), SimpleNamespace(should_save=False, should_training_stop=False)
    cb.on_train_begin(None, state, control)
    ends = []
    for work in (0.05, 0.05, 0.5):
        time.sleep(work)
        state.global_step += 1
        cpu = time.process_time()
        cb.on_step_end(None, state, control)
        ends.append((time.monotonic(), time.process_time() - cpu))
    starts = [ends[0][0] - 0.3] + [t for t, _ in ends[:-1]]
    took = [t - s for (t, _), s in zip(ends, starts)]
    assert all(0.29 <= d < 0.45 for d in took[:2]), took
    assert 0.5 <= took[2] < 0.65, took  # longer than the floor: no sleep on top
    assert all(c < 0.05 for _, c in ends), ends  # sleeping, not spinning
    for bad in ("slow", "-1", "61"):
        monkeypatch.setenv(spot.PACE_ENV, bad)
        with pytest.raises(ValueError, match=spot.PACE_ENV):
            spot.spot_callback(watcher=None, save_every="0")


def test_only_complete_checkpoints_count(tmp_path, monkeypatch):
    for step, complete in ((10, True), (20, True), (30, False)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if complete:
            (d / Checkpoints.MARKER).write_text("{}")
    assert [p.name for _, p in Checkpoints.complete(tmp_path)] == ["checkpoint-10", "checkpoint-20"]
    monkeypatch.setenv("XC_RESUME_FROM", str(tmp_path / "checkpoint-30"))
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        spot.resume_from()
    monkeypatch.setenv("XC_RESUME_FROM", str(tmp_path / "checkpoint-20"))
    assert spot.resume_from().endswith("checkpoint-20") and spot.trainer_state_step(spot.resume_from()) == 20


def test_the_checkpoints_owner_finds_the_latest_and_purges_down_to_keep(tmp_path):
    for step in (5, 40, 300):  # numeric order, not the names' (checkpoint-300 < checkpoint-40 as text)
        d = tmp_path / Checkpoints.name(step)
        d.mkdir()
        Checkpoints.mark_complete(d, step)
    (tmp_path / "checkpoint-900").mkdir()  # no marker: partial, never the latest, never purged
    (tmp_path / "notes-7").mkdir()
    assert json.loads((tmp_path / "checkpoint-40" / Checkpoints.MARKER).read_text())["step"] == 40
    assert Checkpoints.latest(tmp_path) == (300, tmp_path / "checkpoint-300")
    assert [d.name for d in Checkpoints.purge(tmp_path, keep=2)] == ["checkpoint-5"]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["checkpoint-300", "checkpoint-40", "checkpoint-900", "notes-7"]
    assert Checkpoints.latest(tmp_path / "missing") is None and Checkpoints.complete(tmp_path / "missing") == []
    assert Checkpoints.is_name("checkpoint-12") and Checkpoints.is_name("step-12") and not Checkpoints.is_name("notes-7")
    assert list(tmp_path.glob(Checkpoints.GLOB)) and Checkpoints.GLOB == "checkpoint-*"
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    assert Checkpoints.name(7) == f"{PREFIX_CHECKPOINT_DIR}-7"  # the Trainer's own name for what it saves


@pytest.mark.parametrize("value, expect", [("600s", ("seconds", 600.0)), ("10m", ("seconds", 600.0)),
                                           ("200", ("steps", 200)), ("0", ("off", 0.0))])
def test_save_every(value, expect):
    assert spot.parse_save_every(value) == expect


def test_home_checkpoints_skip_partial_transfers(tmp_path):
    from launch.staging import outputs

    for name, marker in (("checkpoint-5", True), ("checkpoint-9", False), ("checkpoint-7.partial", True)):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if marker:
            (tmp_path / "checkpoints" / name / Checkpoints.MARKER).write_text("{}")
    (tmp_path / "checkpoints" / "step-3").mkdir()  # the name a home held before checkpoint-N: still read
    (tmp_path / "checkpoints" / "step-3" / Checkpoints.MARKER).write_text("{}")
    assert [s for s, _ in outputs.home_checkpoints(tmp_path)] == [3, 5]





@pytest.mark.cluster
@pytest.mark.slow
def test_notice_checkpoints_home_and_resume_finishes_like_an_uninterrupted_run(cluster2, small_model):
    """The thin model with a loss logged at every step: the resumed run logs the loss an uninterrupted run logs at
    every step after the checkpoint (the same batches, and the same dropout masks from every rank's restored RNG
    state), and ends with its eval loss. Whether a resumed run learns like one is test_cluster's demo run's part."""
    args = (*FakeIMDS.short_args(small_model), "--logging_steps", "1")
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        ended, stopped_in = imds.train_until(cluster2, args, at_step=10)
    finally:
        imds.close()
    out, err = ended.stdout, ended.stderr
    run_id = (cluster2.run_dirs() - before).pop()
    assert ended.returncode == 75, out + err
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"run {run_id} preempted on node(\d) at step (\d+): checkpoint saved \((\S+)\); "
                     rf"resume with 'fab train --resume {run_id}'", last)
    assert m, last
    step = int(m.group(2))
    assert stopped_in < 120, f"{stopped_in:.0f}s from notice to checkpoint at home"
    assert m.group(3) == f"{cluster2.runs.parent.as_uri()}/store/runs/{run_id}/checkpoints/checkpoint-{step}"
    ckpt = cluster2.runs.parent / "store" / "runs" / run_id / "checkpoints" / f"checkpoint-{step}"  # the local store
    assert (ckpt / Checkpoints.MARKER).is_file() and (ckpt / "optimizer.pt").is_file()
    # every rank's RNG state came home with it, not only node 0's: the resume continues the same run
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()
    summary = records.load(cluster2.runs / run_id).to_json()
    assert summary["status"] == "preempted" and summary["preempted"]["step"] == step
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    print(f"notice to checkpoint at home: {stopped_in:.1f}s (step {step})")

    res = cluster2.fab("train", "--resume", run_id, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    resumed = (cluster2.run_dirs() - before - {run_id}).pop()
    assert min(progress_steps(res.stdout)) > step  # no step trained twice beyond the checkpoint
    results = json.loads((cluster2.runs / resumed / "results.json").read_text())
    assert results["resumed_from_step"] == step
    rsum = records.load(cluster2.runs / resumed).to_json()
    assert rsum["resumed_from"] == {"run_id": run_id, "step": step}
    out_dir = cluster2.runs / resumed / "output"
    for name in ("model.safetensors", "config.json", "trainer_state.json", "all_results.json", "loss.png"):
        assert (out_dir / name).is_file(), name

    again = cluster2.fab("train", "--resume", resumed, timeout=120)
    assert again.returncode == 1 and "that run finished" in again.stderr

    plain = cluster2.fab("train", "--nodes", "2", "--save-every", "0", "--", *args, timeout=900)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    straight = (cluster2.run_dirs() - before - {run_id, resumed}).pop()
    losses, reference = _losses(cluster2.runs / resumed), _losses(cluster2.runs / straight)
    after = range(step + 1, FakeIMDS.SHORT_STEPS + 1)
    far = {s: (losses.get(s), reference[s]) for s in after if s not in losses
           or abs(losses[s] - reference[s]) > 1e-4 * abs(reference[s])}
    print(f"resumed at step {step}: losses of steps {after[0]}-{after[-1]} against an uninterrupted run's: max "
          f"relative difference {max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in after if s in losses):.2e}")
    assert not far, far
    ref_eval = json.loads((cluster2.runs / straight / "results.json").read_text())["eval"]
    assert abs(results["eval"]["eval_loss"] - ref_eval["eval_loss"]) <= 1e-4 * abs(ref_eval["eval_loss"])


def _losses(run_dir: Path) -> dict[int, float]:
    state = json.loads((run_dir / "output" / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


@pytest.mark.cluster
@pytest.mark.slow
def test_a_checkpoint_resumes_on_half_the_nodes_with_the_same_global_batch(cluster2, small_model):
    """The same checkpoint on half the nodes: gradient accumulation keeps the global batch, so the run has the
    same number of optimizer steps in all. The thin model: this is about the resume, not what it learns."""
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        ended, _ = imds.train_until(cluster2, FakeIMDS.short_args(small_model))
    finally:
        imds.close()
    assert ended.returncode == 75, ended.stdout[-3000:] + ended.stderr[-3000:]
    run_id = (cluster2.run_dirs() - before).pop()
    step = records.load(cluster2.runs / run_id).to_json()["preempted"]["step"]

    one = cluster2.fab("train", "--resume", run_id, "--nodes", "1", timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "resuming on 1 rank(s) instead of 2: gradient accumulation 1 -> 2 keeps the global batch at 16" in one.stdout
    totals = {int(t) for t in re.findall(r"\[progress\] step \d+/(\d+)", ended.stdout + one.stdout)}
    assert len(totals) == 1, totals
    assert min(progress_steps(one.stdout)) > step
    single = (cluster2.run_dirs() - before - {run_id}).pop()
    ssum = records.load(cluster2.runs / single).to_json()
    assert ssum["world_size"] == 1 and ssum["resumed_from"] == {"run_id": run_id, "step": step}
    accum = ssum["args"].index("--gradient_accumulation_steps")
    assert ssum["args"][accum + 1] == "2" and ssum["args"].count("--gradient_accumulation_steps") == 1
    assert json.loads((cluster2.runs / single / "results.json").read_text())["resumed_from_step"] == step
