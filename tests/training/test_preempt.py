"""training.runtime.preempt, the one notice behaviour of every Trainer (bundled jobs and users' scripts), in this process:
a notice's checkpoint is claimed durable only when the store confirmed it, a store that stops answering right after
the notice gives durable=false and keeps the node from completing its lifecycle action; the rank hook is lazy and
patches transformers.Trainer; the loss fix tells mean-loss heads from causal LMs. A real Trainer on a tiny BERT, a
real moto S3 server behind a proxy the test can cut, the fake IMDS."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_imds import FakeIMDS
from moto_fixture import client

from training.runtime import notice, preempt, publish, spot
from training.runtime import store as shared
from training.runtime.paths import Checkpoints, RunPaths

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "xc-preempt"


class CutProxy:
    """TCP forwarding to `target` until cut(): then every connection, old or new, is held with no answer."""

    def __init__(self, target: str):
        host, port = target.rsplit("//", 1)[1].split(":")
        self.target, self.cut_ = (host, int(port)), threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            conn, _ = self.sock.accept()
            if self.cut_.is_set():
                continue  # accepted, never answered (the reference is dropped; the socket lingers half-open)
            up = socket.create_connection(self.target)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(65536):
                while self.cut_.is_set():
                    time.sleep(3600)
                dst.sendall(data)
        except OSError:
            pass

    def cut(self):
        self.cut_.set()


def _tiny_trainer(tmp_path, callbacks=()):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=2))
    rows = [{"input_ids": torch.randint(1, 64, (12,)), "labels": i % 2} for i in range(64)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                             per_device_train_batch_size=2, max_steps=30, logging_steps=100, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=rows, callbacks=list(callbacks))


def _raise_at(step: int, action):
    from transformers import TrainerCallback

    class At(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == step:
                time.sleep(1.5)  # the periodic checkpoints' uploads finish first
                action()
                time.sleep(0.6)  # the watcher (0.1 s polls) sees it before this step's agreement

    return At()


@pytest.fixture
def spot_env(aws_env, monkeypatch, tmp_path):
    imds = FakeIMDS()
    proxy = CutProxy(aws_env)
    client("s3").create_bucket(Bucket=BUCKET)
    cluster_env = tmp_path / "cluster.env"
    cluster_env.write_text("XC_ASG_NAME=dev-nodes\nXC_LIFECYCLE_HOOK=xc-checkpoint\n")
    for key, value in {"XC_IMDS_ENDPOINT": imds.url, "XC_NOTICE_POLL_S": "0.1", "XC_SAVE_EVERY": "2",
                       "XC_STORE": f"s3://{BUCKET}/cl", "XC_RUN_ID": "r1", "XC_S3_ENDPOINT_URL": proxy.url,
                       "XC_CLUSTER_ENV": str(cluster_env)}.items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "XC_RESUME_FROM", "XC_RESUME_URL"):
        monkeypatch.delenv(key, raising=False)
    released = []
    monkeypatch.setattr(spot, "complete_lifecycle_action", lambda w, client=None: released.append(w) or True)
    monkeypatch.setattr(publish, "ON_GROUP_S", 4)  # the hook's heartbeat, shortened for the test
    yield imds, proxy, released
    imds.close()


def _run_to_notice(tmp_path, action, capsys) -> notice.Notice:
    trainer = _tiny_trainer(tmp_path, [_raise_at(6, action)])
    preempt.attach(trainer)
    trainer.train()
    with pytest.raises(SystemExit) as ended:
        preempt.end_if_noticed(trainer)
    assert ended.value.code == notice.EXIT == 75
    said = notice.Notice.parse(capsys.readouterr().out.splitlines())
    assert said is not None
    return said


def test_a_store_that_stops_answering_after_a_notice_is_not_durable_and_the_node_stays(spot_env, tmp_path, capsys):
    imds, proxy, released = spot_env

    def notice_then_cut():
        imds.terminate_by_group()
        proxy.cut()

    said = _run_to_notice(tmp_path, notice_then_cut, capsys)
    assert said.cause == notice.GROUP and said.step == 6 and said.durable is False, said
    assert released == []  # node 0 holds its node: the checkpoint lives only here
    s3 = shared.S3Store(f"s3://{BUCKET}/cl", client=client("s3"))  # straight to moto, not through the cut proxy
    assert shared.stored_steps(s3, "r1") == [2, 4]  # the periodic ones before the cut; step 6 never counts
    assert (tmp_path / "out" / "checkpoint-6" / Checkpoints.MARKER).is_file()  # whole on the node, for fab to fetch


def test_a_notice_whose_checkpoint_reached_the_store_is_durable_and_the_node_goes(spot_env, tmp_path, capsys):
    imds, _, released = spot_env
    said = _run_to_notice(tmp_path, imds.terminate_by_group, capsys)
    assert said.cause == notice.GROUP and said.step == 6 and said.durable is True, said
    assert len(released) == 1
    s3 = shared.S3Store(f"s3://{BUCKET}/cl", client=client("s3"))
    assert shared.stored_steps(s3, "r1")[-1] == 6


def test_a_failed_upload_is_not_confirmed(tmp_path):
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / Checkpoints.MARKER).write_text("{}")
    (tmp_path / "store").write_text("a file where the store's folder should be")
    pub = publish.Publisher((tmp_path / "store").as_uri(), "r1")
    pub.start()
    pub.submit(folder, 3)
    assert pub.wait(30) and not pub.confirmed(3) and pub.failed_steps == [3]


def test_mean_loss_heads_are_fixed_causal_lms_kept(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    trainer = _tiny_trainer(tmp_path)
    assert trainer.model_accepts_loss_kwargs is True  # transformers 5 would scale BERT's mean loss by the world size
    assert preempt.fix_mean_loss(trainer) == "fixed" and trainer.model_accepts_loss_kwargs is False
    lm = Trainer(model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)),
                 args=TrainingArguments(output_dir=str(tmp_path / "lm"), use_cpu=True, report_to="none"))
    assert preempt.fix_mean_loss(lm) == "kept" and lm.model_accepts_loss_kwargs is True


HOOK_CHECK = '''
import json, os, sys
lazy = [m for m in ("transformers", "training", "torch") if m in sys.modules]
from transformers import Trainer
print(json.dumps({"lazy": lazy, "patched": getattr(Trainer, "_xc_patched", False),
                  "notice_file": os.environ.get("XC_NOTICE_FILE"), "checkpoint_dir": os.environ.get("XC_CHECKPOINT_DIR")}))
'''


def test_the_rank_hook_is_lazy_and_patches_every_trainer(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XC_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=f"{ROOT / 'training' / 'hook'}:{ROOT}", XC_RUN_ID="r1", RANK="0",
               XC_RANK_REPORT=str(tmp_path / "run" / "ranks" / "{rank}.json"), XC_OUTPUT_DIR=str(tmp_path / "run" / "output"))
    got = json.loads(subprocess.run([sys.executable, "-c", HOOK_CHECK], env=env, capture_output=True, text=True,
                                    check=True, timeout=120).stdout.splitlines()[-1])
    assert got == {"lazy": [], "patched": True, "notice_file": str(tmp_path / "run" / "notice" / "rank-0.json"),
                   "checkpoint_dir": str(tmp_path / "run" / "output")}
    off = subprocess.run([sys.executable, "-c", HOOK_CHECK], env={**env, "XC_SPOT_HOOK": "0"}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.splitlines()[-1]
    assert json.loads(off)["patched"] is False


TINY_SCRIPT = '''
import sys, time
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

class Slow(TrainerCallback):  # the user's own: a step takes a while, as on a real model
    def on_step_end(self, args, state, control, **kw):
        time.sleep(0.2)

torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32, num_labels=2))
rows = [{"input_ids": torch.randint(1, 64, (12,)), "labels": i % 2} for i in range(64)]
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none", save_strategy="no",
                         per_device_train_batch_size=2, max_steps=12, logging_steps=1, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Slow()])
trainer.train()
trainer.save_state()
print("done", flush=True)
'''


def test_an_unchanged_trainer_script_stops_on_a_notice_and_resumes_through_the_hook(tmp_path):
    """At the rank's level (one process, the hook on its path as fab puts it): exit 75 with the notice line and a
    durable checkpoint in the store; then XC_RESUME_URL alone makes the same unchanged script continue the step count."""
    script = tmp_path / "train.py"
    script.write_text(TINY_SCRIPT)
    imds = FakeIMDS()
    store_url = (tmp_path / "store").as_uri()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XC_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(PYTHONPATH=f"{ROOT / 'training' / 'hook'}:{ROOT}", XC_RUN_ID="r1", XC_STORE=store_url,
               XC_RANK_REPORT=str(tmp_path / "run" / "ranks" / "{rank}.json"), XC_IMDS_ENDPOINT=imds.url,
               XC_NOTICE_POLL_S="0.1", XC_SAVE_EVERY="0")
    try:
        imds.interrupt()  # the notice is there from the start: the ranks agree at an early step boundary
        first = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], env=env, capture_output=True,
                               text=True, timeout=300, check=False)
    finally:
        imds.close()
    assert first.returncode == notice.EXIT, first.stdout[-2000:] + first.stderr[-3000:]
    said = notice.Notice.parse(first.stdout.splitlines())
    assert said and said.cause == notice.SPOT and said.durable and 1 <= said.step < 12, first.stdout[-2000:]
    assert "done" not in first.stdout
    assert shared.stored_steps(shared.open_store(store_url), "r1") == [said.step]
    resume_url = f"{store_url}/{RunPaths('r1').store_checkpoint(said.step)}"
    second = subprocess.run([sys.executable, str(script), str(tmp_path / "out2")], env={**env, "XC_RESUME_URL": resume_url},
                            capture_output=True, text=True, timeout=300, check=False)
    assert second.returncode == 0 and "done" in second.stdout, second.stderr[-3000:]
    state = json.loads((tmp_path / "out2" / "trainer_state.json").read_text())
    assert state["global_step"] == 12 and [e["step"] for e in state["log_history"] if "loss" in e] == list(range(1, 13))
    trained = [ln for ln in second.stdout.splitlines() if ln.startswith("{'loss'")]  # this run's own log lines
    assert len(trained) == 12 - said.step, second.stdout[-2000:]  # it continued from the checkpoint, not from 0
