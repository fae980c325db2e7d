"""What every bundled job shares: logging, the progress line, metrics, results.json."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("training")

PROGRESS_TAG = "[progress]"


def setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("training").setLevel(logging.INFO if is_main else logging.WARNING)
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    datasets.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()  # rank 0 prints progress lines instead
    datasets.utils.logging.disable_progress_bar()


def progress_line(step: int, total: int, started: float, loss: float | None = None,
                  epoch: float | None = None) -> str:
    elapsed = time.monotonic() - started
    eta = elapsed / step * (total - step) if step else 0.0
    parts = [f"{PROGRESS_TAG} step {step}/{total} ({100 * step / max(total, 1):.0f}%)"]
    if loss is not None and math.isfinite(loss):
        parts.append(f"loss {loss:.4f}")
    if epoch is not None:
        parts.append(f"epoch {epoch:.2f}")
    parts.append(f"elapsed {elapsed:.0f}s eta {eta:.0f}s")
    return " ".join(parts)


def progress_callback(every: int | None = None):
    """A TrainerCallback printing one progress line per ~5% of the steps (rank 0 only)."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def __init__(self):
            self.started = self.last = time.monotonic()
            self.loss = None

        def on_train_begin(self, args, state, control, **kw):
            self.started = self.last = time.monotonic()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.loss = float(logs["loss"])

        def on_step_end(self, args, state, control, **kw):
            total = state.max_steps or 1
            step_every = every or max(1, total // 20)
            step = state.global_step
            # the first step, every ~5%, the last, and at least every 30 s on long runs
            due = step == 1 or step % step_every == 0 or step == total or time.monotonic() - self.last > 30
            if state.is_world_process_zero and due:
                self.last = time.monotonic()
                print(progress_line(step, total, self.started, self.loss, state.epoch), flush=True)

    return Progress()


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


def write_results(output_dir: str | os.PathLike, payload: dict) -> Path:
    """Write results.json atomically (a partial file is never presented as a result)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    final = out / "results.json"
    tmp.replace(final)
    return final
