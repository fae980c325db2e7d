"""Bundled run_glue: sequence-pair / single-sentence classification with Trainer, across MPI ranks.

Flags are run_glue's (HfArgumentParser over model, data and TrainingArguments). Differences:
dynamic padding with length grouping by default (--pad_to_max_length restores the seeds'
pad-to-128), oneCCL / IPEX wired here when installed, metrics computed locally, and a
results.json written by rank 0. Without data flags it trains on the bundled paraphrase set.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from training.jobs import common, dist
from training.runtime import preempt, timeline
from training.speed import levers

log = logging.getLogger("training.jobs.glue")

TASK_TO_KEYS = {
    "cola": ("sentence", None), "mnli": ("premise", "hypothesis"), "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"), "qqp": ("question1", "question2"), "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None), "stsb": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2"),
}
DEFAULT_MODEL = common.DEFAULT_MODEL
resolve_model = common.resolve_model  # shared with the other jobs; kept here for existing imports
BUNDLED = Path(__file__).resolve().parent / "data" / "paraphrase"


EAGER_UP_TO = 128  # tokens; see ModelArguments.attn_implementation


def pick_attention(requested: str, max_len: int) -> str:
    return ("eager" if max_len <= EAGER_UP_TO else "sdpa") if requested == "auto" else requested


@dataclass
class ModelArguments(levers.SpeedArguments):
    model_name_or_path: str = field(default=DEFAULT_MODEL, metadata={"help": "Hub id or local path"})
    cache_dir: str | None = field(default=None, metadata={"help": "Where hub downloads are cached"})
    use_fast_tokenizer: bool = field(default=True)
    # torch's fused CPU attention (sdpa) spent a third of a bf16 training step in its backward pass at this
    # data's ~65 tokens (torch profiler). A bf16 step of batch 16, eager over sdpa (bench/attention_step.py):
    # 1.42x at 64 tokens, 1.27x at 128, 0.70x at 256, 0.38x at 384; in the job 5% more samples/s at the same
    # accuracy over 3 seeds (bench/glue_single_node.py --levers sdpa).
    attn_implementation: str = field(default="auto", metadata={
        "help": "auto (default: eager up to --max_seq_length 128, sdpa beyond) | eager | sdpa"})


@dataclass
class DataArguments:
    task_name: str | None = field(default=None, metadata={"help": "GLUE task from the hub: " + ", ".join(TASK_TO_KEYS)})
    train_file: str | None = field(default=None, metadata={"help": "CSV or JSON training data"})
    validation_file: str | None = field(default=None, metadata={"help": "CSV or JSON validation data"})
    test_file: str | None = field(default=None, metadata={"help": "CSV or JSON data to predict (--do_predict); "
                                                                   "labels not needed"})
    max_seq_length: int = field(default=128)
    pad_to_max_length: bool = field(default=False, metadata={
        "help": "Pad every example to max_seq_length (the seeds' recipe) instead of per batch"})
    # Exact lengths measured faster than rounding to 16, in fp32 and bf16 (bench/glue_single_node.py).
    pad_to_multiple_of: int = field(default=1, metadata={
        "help": "With per-batch padding, round lengths up to a multiple of this (1 = exact lengths)"})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)

    def __post_init__(self):
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            if self.task_name not in TASK_TO_KEYS:
                raise ValueError(f"--task_name {self.task_name} is not a GLUE task; use one of {', '.join(TASK_TO_KEYS)}")
        elif self.train_file is None and self.validation_file is None:
            self.train_file = str(BUNDLED / "train.csv")
            self.validation_file = str(BUNDLED / "validation.csv")
        for name in ("train_file", "validation_file", "test_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name} {path} does not exist; pass an existing CSV or JSON file")
            if path is not None and Path(path).suffix not in (".csv", ".json", ".jsonl"):
                raise ValueError(f"--{name} {path} must be a .csv or .json file")


def load_raw(data: DataArguments, model: ModelArguments):
    from datasets import load_dataset

    if data.task_name:
        return load_dataset("nyu-mll/glue", data.task_name, cache_dir=model.cache_dir)
    files = {k: v for k, v in (("train", data.train_file), ("validation", data.validation_file),
                               ("test", data.test_file)) if v}
    kind = "csv" if next(iter(files.values())).endswith(".csv") else "json"
    if kind == "csv" and data.test_file and len(files) > 1:
        header = {k: _csv_columns(v) - {"label", "idx"} for k, v in files.items()}
        first = next(v for k, v in header.items() if k != "test")
        if header["test"] != first:
            raise ValueError(f"--test_file has columns {', '.join(sorted(header['test']))} but the training data's "
                             f"text columns are {', '.join(sorted(first))}; give it the same text columns")
    return load_dataset(kind, data_files=files, cache_dir=model.cache_dir)


def _csv_columns(path: str) -> set[str]:
    import csv

    with open(path, newline="") as f:
        return set(next(csv.reader(f), []))


def text_keys(raw, data: DataArguments) -> tuple[str, str | None]:
    if data.task_name:
        return TASK_TO_KEYS[data.task_name]
    columns = [c for c in next(iter(raw.values())).column_names if c not in ("label", "idx")]
    for split, ds in raw.items():
        if split == "test" and not set(columns) <= set(ds.column_names):
            raise ValueError(f"--test_file has columns {', '.join(ds.column_names)} but the training data's text "
                             f"columns are {', '.join(columns)}; give it the same text columns")
    if "sentence1" in columns and "sentence2" in columns:
        return "sentence1", "sentence2"
    if not columns:
        raise ValueError("the data has no text column; expected sentence1/sentence2 or at least one text column")
    return columns[0], (columns[1] if len(columns) > 1 else None)


def compute_metrics_fn(task: str | None, is_regression: bool, num_labels: int):
    import numpy as np

    def compute(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        labels = p.label_ids
        if is_regression:
            return {"pearson": common.pearson(preds, labels), "spearmanr": common.spearman(preds, labels)}
        out = {"accuracy": common.accuracy(preds, labels)}
        if task == "cola":
            out = {"matthews_correlation": common.matthews(preds, labels)}
        elif num_labels == 2:
            out["f1"] = common.f1_binary(preds, labels)
        return out

    return compute


def write_predictions(trainer, predict_ds, output_dir: str, task: str | None, is_regression: bool,
                      label_list, is_main: bool) -> dict:
    """run_glue's predict_results_<task>.txt: 'index<TAB>prediction', label names for classification."""
    import numpy as np

    preds = trainer.predict(predict_ds, metric_key_prefix="predict").predictions  # gathered on every rank
    preds = preds[0] if isinstance(preds, tuple) else preds
    preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
    path = Path(output_dir) / f"predict_results_{task or 'custom'}.txt"
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write("index\tprediction\n")
            for index, item in enumerate(preds):
                f.write(f"{index}\t{item:3.3f}\n" if is_regression else f"{index}\t{label_list[item]}\n")
    return {"samples": len(preds), "file": path.name}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    info = dist.setup()
    timeline.start(info.is_main)
    common.setup_logging(info.is_main)
    started = time.monotonic()

    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        default_data_collator,
    )
    timeline.mark("imports", info.is_main)

    argv = common.job_argv(argv, info.precision)
    model_args, data_args, args = common.parse_job_args(argv, ModelArguments, DataArguments)
    levers.check(model_args, args, argv)  # bad flags: before loading anything
    from training.speed import speedup  # lazy: torch (~1000 modules), which the job's module does not import

    raw = load_raw(data_args, model_args)
    timeline.mark("data_loaded", info.is_main)
    key1, key2 = text_keys(raw, data_args)
    split = "train" if "train" in raw else "validation"
    label_feature = raw[split].features["label"]
    is_regression = (data_args.task_name == "stsb") or label_feature.dtype in ("float32", "float64")
    if is_regression:
        num_labels, label_list = 1, None
    elif hasattr(label_feature, "names"):
        label_list = label_feature.names
        num_labels = len(label_list)
    else:
        label_list = sorted(raw[split].unique("label"))
        num_labels = len(label_list)

    model_path = resolve_model(model_args.model_name_or_path)
    config = AutoConfig.from_pretrained(model_path, num_labels=num_labels, finetuning_task=data_args.task_name,
                                        cache_dir=model_args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=model_args.use_fast_tokenizer,
                                              cache_dir=model_args.cache_dir)
    max_len = min(data_args.max_seq_length, tokenizer.model_max_length)
    attn = pick_attention(model_args.attn_implementation, max_len)
    model = common.mean_loss_per_rank(
        AutoModelForSequenceClassification.from_pretrained(model_path, config=config, cache_dir=model_args.cache_dir,
                                                           attn_implementation=attn))
    fast = speedup.apply(model, model_args, args, argv, Trainer, lambda m: common.ipex_optimizers(m, args, info))
    model = fast.model
    timeline.mark("model_loaded", info.is_main)
    label_to_id = None if is_regression or hasattr(label_feature, "names") else {v: i for i, v in enumerate(label_list)}
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        out = tokenizer(*texts, padding=padding, max_length=max_len, truncation=True)
        out["length"] = [sum(m) for m in out["attention_mask"]]
        if label_to_id is not None and "label" in batch:
            # a test file without labels reads as None labels: -1, as GLUE's own test splits have
            out["label"] = [-1 if v is None else label_to_id[v] for v in batch["label"]]
        return out

    with args.main_process_first(desc="tokenizing"):
        parts = (key1, key2, padding, max_len, label_to_id)
        data = type(raw)({name: split.map(preprocess, batched=True, desc="tokenizing", new_fingerprint=common.map_fingerprint(
            split, preprocess, tokenizer, *parts)) for name, split in raw.items()})
    timeline.mark("tokenized", info.is_main)
    train_ds = data["train"] if args.do_train else None
    eval_ds = data["validation_matched" if data_args.task_name == "mnli" else "validation"] if args.do_eval else None
    train_ds = common.take(train_ds, data_args.max_train_samples)
    eval_ds = common.take(eval_ds, data_args.max_eval_samples)
    predict_ds = None
    if args.do_predict:
        split = "test_matched" if data_args.task_name == "mnli" else "test"
        if split not in data:
            raise ValueError("--do_predict needs data to predict; pass --test_file (CSV or JSON with the text columns)")
        # GLUE's test labels are -1 placeholders: the Trainer must not compute a loss on them
        predict_ds = common.take(data[split].remove_columns([c for c in ("label",) if c in data[split].column_names]),
                                 data_args.max_predict_samples)


    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=data_args.pad_to_multiple_of if data_args.pad_to_multiple_of > 1 else None)
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      processing_class=tokenizer, data_collator=collator, optimizers=fast.optimizers,
                      compute_metrics=compute_metrics_fn(data_args.task_name, is_regression, num_labels),
                      callbacks=[*timeline.callbacks(info.is_main), preempt.progress_callback()])  # the mark first
    common.quiet_trainer(trainer)
    fast.attach(trainer)
    hook = dist.comm_hook(trainer)
    results: dict = {"job": "glue", "model": model_args.model_name_or_path, "task": data_args.task_name,
                     "train_file": data_args.train_file, "world_size": info.world_size,
                     "data_fingerprint": common.fingerprint(data_args.train_file, data_args.validation_file),
                     "global_train_batch_size": args.per_device_train_batch_size * info.world_size
                     * args.gradient_accumulation_steps, "seed": args.seed,
                     "backend": info.backend, "precision": "bf16" if args.bf16 else "fp32", "ipex": info.ipex,
                     "padding": "max_length" if data_args.pad_to_max_length else f"batch/{data_args.pad_to_multiple_of}",
                     "group_by_length": common.length_grouping(args), "max_seq_length": max_len,
                     "per_device_train_batch_size": args.per_device_train_batch_size,
                     "threads": torch.get_num_threads(), "comm_hook": hook, "speed": fast.applied,
                     "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                     "ddp_bucket_cap_mb": args.ddp_bucket_cap_mb,
                     "gradient_accumulation_steps": args.gradient_accumulation_steps}
    common.train_and_record(trainer, results, train_ds, info)
    fast.finish()
    if eval_ds is not None:
        metrics = trainer.evaluate()
        labels = eval_ds["label"]
        if not is_regression:
            top = max(set(labels), key=labels.count)
            metrics["eval_majority_rate"] = labels.count(top) / len(labels)
        results["eval"] = dict(metrics, samples=len(eval_ds))
    if predict_ds is not None:
        results["predict"] = write_predictions(trainer, predict_ds, args.output_dir, data_args.task_name,
                                               is_regression, label_list, info.is_main)
    ev, tr = results.get("eval", {}), results.get("train", {})
    line = (f"eval accuracy {ev.get('eval_accuracy', float('nan')):.4f} "
            f"(majority {ev.get('eval_majority_rate', float('nan')):.4f}) f1 {ev.get('eval_f1', float('nan')):.4f} "
            f"train {tr.get('train_samples_per_second', float('nan')):.1f} samples/s in {tr.get('wall_s', 0):.1f}s")
    common.finish(info, args, results, started, line, trainer)
    return 0


if __name__ == "__main__":
    common.cli(main)  # bad flags and data: one 'error:' line, exit 2
