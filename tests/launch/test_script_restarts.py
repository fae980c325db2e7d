"""A user's own Trainer script, unchanged, on a 2-node local cluster against the fake IMDS:
a --workdir project (only the script) with its data files outside it, written as Hugging Face's run_glue.py is
(its own argument dataclasses, info logging on the main process, train -> save_metrics/save_state -> evaluate).

- a spot notice mid-run, `--detach --max-restarts 1`: the first run ends `preempted` with a complete checkpoint in the
  store, the supervisor resumes it by itself once the notice is gone, the resumed run's log shows the Trainer
  continuing from that checkpoint, and it ends `ok` with trainer_state.json's global_step the full run's step count
  and all_results.json home;
- in one attached run (fab's own restart loop): a rebalance recommendation, whose checkpoint reaches the store while
  the run goes on unrestarted, then a group termination (target-lifecycle-state Terminated), the same as the notice;
- on a local cluster with its head, the folder outside the checkout: the user edits the script and deletes a file of
  the folder (and the data files) while the run trains; the head's supervisor restarts the run after a notice from
  the run's snapshot in the store, and it ends ok.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path

import pytest
from conftest import fab, processes_with_env, resumed_after_notice, start_cluster, wait_until
from fake_imds import FakeIMDS
from test_user_scripts import _csv

from cluster import store as store_lib
from launch.life import records
from launch.life.records import Status
from training.runtime import notice

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# As run_glue.py is written (no spot code, no resume code of its own: resume_from_checkpoint stays None).
GLUE_LIKE = '''
import logging
import sys
from dataclasses import dataclass, field

import datasets
import transformers
from datasets import load_dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          HfArgumentParser, Trainer, TrainingArguments, set_seed)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(default=None)
    validation_file: str = field(default=None)
    max_seq_length: int = field(default=64)


model_args, data_args, training_args = HfArgumentParser(
    (ModelArguments, DataTrainingArguments, TrainingArguments)).parse_args_into_dataclasses()
logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)])
if training_args.should_log:
    transformers.utils.logging.set_verbosity_info()
log_level = training_args.get_process_log_level()
logger.setLevel(log_level)
datasets.utils.logging.set_verbosity(log_level)
transformers.utils.logging.set_verbosity(log_level)
set_seed(training_args.seed)

raw = load_dataset("csv", data_files={"train": data_args.train_file, "validation": data_args.validation_file})
tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, num_labels=2)
encoded = raw.map(lambda b: tokenizer(b["sentence1"], b["sentence2"], truncation=True,
                                      max_length=data_args.max_seq_length), batched=True)
trainer = Trainer(model=model, args=training_args, train_dataset=encoded["train"], eval_dataset=encoded["validation"],
                  data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer)
train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
metrics = train_result.metrics
trainer.save_model()
trainer.log_metrics("train", metrics)
trainer.save_metrics("train", metrics)
trainer.save_state()
metrics = trainer.evaluate()
trainer.log_metrics("eval", metrics)
trainer.save_metrics("eval", metrics)
'''

ROWS, BATCH, EPOCHS = 240, 4, 3
FULL_STEPS = math.ceil(ROWS / (BATCH * 2)) * EPOCHS  # 2 nodes, one rank each: 90


def _project(tmp_path: Path) -> tuple[Path, list[str]]:
    """The --workdir folder (the script alone) and the script's flags, its data files outside the folder."""
    project = tmp_path / "glue"
    project.mkdir()
    (project / "run_glue.py").write_text(GLUE_LIKE)
    data = tmp_path / "elsewhere"
    return project, ["--train_file", str(_csv(data / "train.csv", ROWS)), "--validation_file", str(_csv(data / "val.csv", 16)),
                     "--do_train", "--do_eval", "--per_device_train_batch_size", str(BATCH),
                     "--num_train_epochs", str(EPOCHS), "--logging_steps", "5", "--seed", "42", "--report_to", "none",
                     "--disable_tqdm", "True", "--output_dir", "out"]


def _log(run_dir: Path) -> str:
    try:
        return (run_dir / "log.txt").read_text(errors="replace")
    except OSError:
        return ""


def _store_ckpt(cluster, run_id: str, step: int) -> Path:
    return cluster.runs.parent / "store" / "runs" / run_id / "checkpoints" / f"checkpoint-{step}"


def _check_chain(cluster, first: str, cause: str) -> tuple[records.RunRecord, records.RunRecord]:
    """The first run preempted with a complete checkpoint in the store; the run it restarted as continued from that
    checkpoint to the full step count, ok, with its metrics home."""
    one = records.load(cluster.runs / first)
    assert one.status == Status.PREEMPTED and one.cause == cause, (one.status, one.cause, one.reason)
    step = one.preempted["step"]
    assert 5 <= step < FULL_STEPS, one.preempted
    ckpt = _store_ckpt(cluster, first, step)
    assert (ckpt / "xc-complete").is_file() and (ckpt / "optimizer.pt").is_file(), sorted(ckpt.parent.glob("*"))
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()  # every rank's RNG
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
    assert not (cluster.runs / first / "output" / "all_results.json").exists()  # the script stopped in train()
    second = one.restarted_as
    assert second, one
    two = records.load(cluster.runs / second)
    log = _log(cluster.runs / second)
    assert two.status == Status.OK, (two.status, two.reason, log[-3000:])
    assert two.resumed_from["run_id"] == first and two.resumed_from["step"] == step, two.resumed_from
    # the Trainer itself says it continues from the checkpoint (not from step 0)
    assert f"Resuming training from checkpoint with epoch {step * BATCH * 2 // ROWS} and global step {step}" in log, \
        log[-3000:]
    out = cluster.runs / second / "output"
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == FULL_STEPS, (state["global_step"], state["max_steps"])
    logged = [e["step"] for e in state["log_history"] if "loss" in e]
    assert logged and logged[-1] == FULL_STEPS and all(s > 0 for s in logged), logged
    results = json.loads((out / "all_results.json").read_text())
    assert "train_loss" in results and "eval_loss" in results, results
    return one, two


def _train_script(cluster2, small_model: str, project: Path, flags: list[str], imds, *fab_flags: str):
    """fab train of the unchanged run_glue.py on both nodes, one restart allowed, notices from imds."""
    return cluster2.start("train", "--nodes", "2", *fab_flags, "--max-restarts", "1", "--save-every", "0",
                          "--workdir", str(project), "--script", "run_glue.py", *imds.train_env(), "--",
                          "--model_name_or_path", small_model, *flags, merge=True)


def test_an_unchanged_glue_script_detached_is_preempted_and_resumed_by_its_supervisor(cluster2, small_model, tmp_path):
    project, flags = _project(tmp_path)
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    sup = None
    running = _train_script(cluster2, small_model, project, flags, imds, "--detach", "--restart-wait", "300")
    try:
        m = running.wait_for(re.compile(r"run (\S+) detached under its supervisor \(pid (\d+), up to 1 restart"), 600)
        first = m.group(1)
        assert running.finish(60).returncode == 0, running.stdout[-3000:]
        sup = records.load(cluster2.runs / first).supervisor
        wait_until("the first run's first logged loss", lambda: "'loss'" in _log(cluster2.runs / first), 400, poll=0.5)
        imds.interrupt()
        wait_until("the first run recorded restarting",
                   lambda: records.load(cluster2.runs / first).status == Status.RESTARTING, 300)
        imds.clear()  # the node is 'replaced': no notice any more, so the supervisor resumes
        second = wait_until("the resumed run", lambda: records.load(cluster2.runs / first).restarted_as, 300)
        wait_until("the resumed run's end", lambda: (r := records.load_or_none(cluster2.runs / second)) and r.status.terminal,
                   600, poll=2)
        wait_until("the supervisor's exit", lambda: not records.supervisor_alive(sup), 60)
    finally:
        imds.close()
        running.__exit__()
        if sup and records.supervisor_alive(sup):
            os.kill(sup["pid"], signal.SIGKILL)
    assert {first, second} <= cluster2.run_dirs() - before
    one, two = _check_chain(cluster2, first, notice.SPOT)
    print(f"spot: preempted at step {one.preempted['step']}, resumed as {two.run_id}, ended ok at step {FULL_STEPS}")


def test_a_rebalance_saves_while_an_unchanged_glue_script_trains_on_then_a_group_termination_restarts_it(
        cluster2, small_model, tmp_path):
    """One run for both notices (a run's ranks are ~15 CPU-s the suite waits for): a rebalance recommendation puts a
    checkpoint in the store while the run trains on, unrestarted; then a group termination, attached (fab's own
    restart loop), checkpoints it again, and it restarts from that checkpoint and ends ok."""
    project, flags = _project(tmp_path)
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        with _train_script(cluster2, small_model, project, flags, imds, "--restart-wait", "300") as running:
            running.wait_for("'loss'", 400)
            run_id = (cluster2.run_dirs() - before).pop()
            imds.recommend_rebalance()
            step = int(running.wait_for(re.compile(r"\[rebalance\] step=(\d+): checkpoint now, training goes on"),
                                        120).group(1))
            ckpt = _store_ckpt(cluster2, run_id, step)
            wait_until("the rebalance checkpoint in the store", lambda: (ckpt / "xc-complete").is_file(), 120, poll=0.5)
            assert running.proc.poll() is None  # it reached the store while the run went on
            assert cluster2.run_dirs() - before == {run_id} and "restart 1 of 1" not in running.stdout
            imds.terminate_by_group()
            running.wait_for("restart 1 of 1:", 300)
            imds.clear()
            ended = running.finish(600)
    finally:
        imds.close()
    assert ended.returncode == 0, ended.stdout[-3000:]
    assert 5 <= step < FULL_STEPS
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
    one, two = _check_chain(cluster2, run_id, notice.GROUP)
    assert one.preempted["step"] > step  # it trained on past the rebalance's checkpoint until the termination
    assert ended.stdout.count("restart 1 of 1") == 1
    print(f"rebalance: checkpoint at step {step}, training went on; group termination: preempted at step "
          f"{one.preempted['step']}, resumed as {two.run_id}, ok")


HELPER = "print('helpers from the snapshot', flush=True)\n"


def test_the_head_restarts_a_workdir_run_from_its_snapshot_after_the_folder_changed(tmp_path, small_model):
    """`fab train --workdir DIR --detach --max-restarts 1` on a cluster with a head: the folder (and the data files
    the flags name) go to the store once as the run's snapshot, and the head supervises (this machine may close).
    The user then edits the script, deletes a file the script imports and the data files; a spot notice ends the
    first run, and the head's supervisor resumes it from the snapshot, not the folder: it ends ok at the full step
    count. (Before the snapshot, the restart refused the changed folder.)"""
    lc = start_cluster(tmp_path / "c", 2, head=True)
    store = f"file://{tmp_path / 'store'}"
    env = {"XC_STORE": store, "XC_PUBLISH_S": "1", "XC_HEARTBEAT_S": "5"}
    project, flags = _project(tmp_path)
    (project / "run_glue.py").write_text("import glue_helpers  # noqa: F401\n" + GLUE_LIKE)
    (project / "glue_helpers.py").write_text(HELPER)
    imds = FakeIMDS()
    first = second = None
    try:
        with lc.start("train", "--nodes", "2", "--detach", "--max-restarts", "1", "--restart-wait", "300",
                      "--save-every", "0", "--workdir", str(project), "--script", "run_glue.py", *imds.train_env(),
                      "--", "--model_name_or_path", small_model, *flags, env=env, merge=True) as running:
            m = running.wait_for(re.compile(r"run (\S+) detached under its supervisor on the head head \(pid (\d+), "
                                            r"up to 1 restart\(s\)\): this machine may close now"), 600)
            first = m.group(1)
            ended = running.finish(60)
        assert ended.returncode == 0, ended.stdout[-3000:]
        key = re.search(rf"code snapshot (\w+) \(--workdir {re.escape(str(project))}, 4 file\(s\)\) put in the store",
                        ended.stdout).group(1)
        assert (tmp_path / "store" / "snapshots" / f"{key}.tar.gz").is_file()
        assert store_lib.read_summary(store, first)["spec"]["what"]["snapshot"] == key  # the record keeps the key
        wait_until("the first run's first logged loss", lambda: "'loss'" in (store_lib.read_log(store, first) or ""),
                   400, poll=0.5)
        # the user goes on working in the folder: the script edited, a file it imports deleted, the data gone too
        (project / "run_glue.py").write_text("raise SystemExit('the edited folder ran, not the snapshot')\n")
        (project / "glue_helpers.py").unlink()
        for data in (tmp_path / "elsewhere").iterdir():
            data.unlink()
        second, done = resumed_after_notice(imds, store, first)
        log = store_lib.read_log(store, second) or ""
    finally:
        imds.close()
        for pid in processes_with_env(f"XC_SUPERVISOR={first}") if first else []:
            os.kill(pid, signal.SIGKILL)
        fab("local-down", env=lc.env, timeout=60)
    assert done["status"] == "ok", (done.get("reason"), log[-3000:])
    one = store_lib.read_summary(store, first)
    step = one["preempted"]["step"]
    assert one["status"] == "preempted" and 0 < step < FULL_STEPS, one.get("preempted")
    assert done["resumed_from"] == {"run_id": first, "step": step} and done["spec"]["what"]["snapshot"] == key
    assert "helpers from the snapshot" in log and "the edited folder ran" not in log, log[-3000:]
    assert f"global step {step}" in log, log[-3000:]  # the Trainer continued from the notice's checkpoint
    state = json.loads((tmp_path / "store" / "runs" / second / "output" / "trainer_state.json").read_text())
    assert state["global_step"] == FULL_STEPS, state["global_step"]
    print(f"edited and deleted: preempted at step {step}, resumed from snapshot {key} as {second}, ended ok at {FULL_STEPS}")
