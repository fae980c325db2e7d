"""Users' own scripts survive spot with no line changed (Trainer) or through the env-var contract (plain DDP), and an
unchanged Trainer script logs the same loss on 1 and 2 nodes. On the session's 2-node local cluster, against the
fake IMDS on loopback; the checkpoint goes to the local cluster's store (a folder)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_imds import FakeIMDS
from test_user_scripts import _csv

from training.runtime import notice

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "docs" / "examples" / "ddp_toy.py"

# An unchanged Trainer script, as HF's examples are written: seeded before the model is built, no spot code at all.
TRAINER_SCRIPT = '''
import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          HfArgumentParser, Trainer, TrainingArguments, set_seed)


@dataclass
class Data:
    model: str = field(default=None)
    train_file: str = field(default=None)


data, args = HfArgumentParser((Data, TrainingArguments)).parse_args_into_dataclasses()
set_seed(args.seed)
raw = load_dataset("csv", data_files={"train": data.train_file})
tok = AutoTokenizer.from_pretrained(data.model)
model = AutoModelForSequenceClassification.from_pretrained(data.model, num_labels=2, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0)
enc = raw.map(lambda b: tok(b["sentence1"], b["sentence2"], truncation=True, max_length=64), batched=True)
trainer = Trainer(model=model, args=args, train_dataset=enc["train"], data_collator=DataCollatorWithPadding(tok),
                  processing_class=tok)
trainer.train()
trainer.save_state()
print("done", flush=True)
'''


def _store_ckpt(cluster, run_id: str, step: int) -> Path:
    return cluster.runs.parent / "store" / "runs" / run_id / "checkpoints" / f"checkpoint-{step}"


def _notice(text: str) -> notice.Notice:
    found = notice.Notice.parse(text.splitlines())
    assert found is not None, text[-3000:]
    return found


def test_the_plain_ddp_example_saves_on_a_notice_exits_75_and_resumes(cluster2, tmp_path):
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        with cluster2.start("train", "--nodes", "2", "--script", str(TOY), *imds.train_env(), "--",
                            "--steps", "2000", "--sleep", "0.02") as running:
            running.wait_for("step 50 loss", 300)
            imds.interrupt()
            ended = running.finish(300)
    finally:
        imds.close()
    run_id = (cluster2.run_dirs() - before).pop()
    out = ended.stdout + ended.stderr
    assert ended.returncode == notice.EXIT, out[-3000:]
    said = _notice(out)
    assert said.cause == notice.SPOT and said.durable and said.step > 50, said
    ckpt = _store_ckpt(cluster2, run_id, said.step)
    assert (ckpt / "xc-complete").is_file() and (ckpt / "state.pt").is_file(), ckpt
    # the resume, at the rank's level (fab train --resume of a --script run is the operator's part): from XC_RESUME_FROM
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XC_", "RANK", "WORLD_SIZE"))}
    res = subprocess.run([sys.executable, str(TOY), "--steps", str(said.step + 20)], capture_output=True, text=True,
                         env={**env, "XC_RESUME_FROM": str(ckpt)}, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from {ckpt} at step {said.step}" in res.stdout and f"done at step {said.step + 20}" in res.stdout


def test_an_unchanged_trainer_script_checkpoints_on_a_notice_and_exits_75(cluster2, small_model, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    train_csv = _csv(tmp_path / "data" / "train.csv", 400)
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        with cluster2.start("train", "--nodes", "2", "--save-every", "0", "--script", str(script), *imds.train_env(),
                            "--", "--model", small_model, "--train_file", str(train_csv), "--output_dir", "out",
                            "--per_device_train_batch_size", "4", "--num_train_epochs", "3", "--logging_steps", "5",
                            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "True") as running:
            running.wait_for("'loss'", 400)
            imds.interrupt()
            ended = running.finish(400)
    finally:
        imds.close()
    run_id = (cluster2.run_dirs() - before).pop()
    out = ended.stdout + ended.stderr
    assert ended.returncode == notice.EXIT, out[-3000:]
    said = _notice(out)
    assert said.cause == notice.SPOT and said.durable and said.step >= 5, said
    ckpt = _store_ckpt(cluster2, run_id, said.step)
    assert (ckpt / "xc-complete").is_file() and (ckpt / "optimizer.pt").is_file(), ckpt
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == said.step
    assert (ckpt / "rng_state_0.pth").is_file() and (ckpt / "rng_state_1.pth").is_file()  # every rank's RNG
    assert "done" not in ended.stdout  # the script's own code after train() did not run


def _step_one_loss(cluster, script: Path, nodes: int, model: str, train_csv: Path) -> float:
    before = cluster.run_dirs()
    per_device = str(8 // nodes)
    res = cluster.fab("train", "--nodes", str(nodes), "--precision", "fp32", "--script", str(script), "--",
                      "--model", model, "--train_file", str(train_csv), "--output_dir", "out", "--max_steps", "1",
                      "--logging_steps", "1", "--per_device_train_batch_size", per_device, "--seed", "42",
                      "--train_sampling_strategy", "random", "--report_to", "none", "--save_strategy", "no",
                      timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = cluster.runs / (cluster.run_dirs() - before).pop()
    state = json.loads((run_dir / "output" / "trainer_state.json").read_text())
    return next(e for e in state["log_history"] if "loss" in e and e.get("step") == 1)["loss"]


def test_an_unchanged_trainer_script_logs_the_same_loss_on_one_and_two_nodes(cluster2, small_model, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    train_csv = _csv(tmp_path / "data" / "train.csv", 64)
    one = _step_one_loss(cluster2, script, 1, small_model, train_csv)
    two = _step_one_loss(cluster2, script, 2, small_model, train_csv)
    print(f"step-1 loss: 1 node {one:.5f}, 2 nodes {two:.5f}")
    assert two == pytest.approx(one, abs=1e-3)
