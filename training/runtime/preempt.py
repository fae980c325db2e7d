"""A run's spot behaviour for any transformers.Trainer: ONE implementation for the bundled jobs
(common.train_and_record) and for users' unchanged Trainer scripts (the rank hook, hook/sitecustomize.py).

- ``attach(trainer)``: the IMDS watcher, the step-boundary agreement (spot.spot_callback: spot notice, group
  termination, rebalance recommendation, --save-every), the store's publisher (publish.publisher_callback) and its
  TensorBoard sync (tbsync.sync_callback).
- ``resume_checkpoint(trainer)``: XC_RESUME_URL fetched from the store, XC_RESUME_FROM checked (complete, fits).
- ``end_if_noticed(trainer)``: after train() returns on a notice: is the notice's checkpoint durable (confirmed in
  the store, agreed by every rank)? rank 0 emits ``notice.Notice(...).event()``, the node lets its Auto Scaling
  group take it only once that is safe (spot.release_node), every rank exits ``notice.EXIT`` (75).
- ``patch(Trainer)``: what the rank hook applies to the Trainer class (once) so that every Trainer a script trains
  gets the above, plus the loss fix for mean-loss heads (``fix_mean_loss``).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from training.runtime import events, notice, publish, spot, startup, store, tbsync
from training.runtime.paths import Checkpoints

log = logging.getLogger("training.runtime.preempt")

# Heads whose loss is the mean over the rank's own batch (they ignore num_items_in_batch): transformers 5 multiplies
# their loss by the world size when average_tokens_across_devices is on and the forward takes **kwargs.
MEAN_LOSS_HEADS = ("ForSequenceClassification", "ForQuestionAnswering", "ForMultipleChoice",
                   "ForNextSentencePrediction", "ForImageClassification", "ForAudioClassification",
                   "ForVideoClassification")
# Heads whose loss is a sum divided by the global token count: the Trainer's scaling is right for them.
GLOBAL_TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_warned: set[str] = set()
ATTACHED = False  # a Trainer in this process has our notice behaviour (training.runtime.contract then only writes its file)


@dataclass
class Guard:
    watcher: spot.NoticeWatcher
    callback: object  # spot_callback's Spot
    publisher: object | None  # publish.publisher_callback's Publish, None without a store


def attach(trainer) -> Guard:
    """Our notice behaviour on this Trainer (idempotent: the bundled jobs and the hook may both ask)."""
    global ATTACHED
    guard = getattr(trainer, "_xc_guard", None)
    if guard is not None:
        return guard
    ATTACHED = True
    watcher = spot.NoticeWatcher()
    watcher.start()
    callback = spot.spot_callback(watcher)
    trainer.add_callback(callback)
    publisher = publish.publisher_callback()  # after spot's: its on_save marks the checkpoint complete first
    if publisher is not None:
        trainer.add_callback(publisher)
    synced = tbsync.sync_callback(trainer)  # after the Trainer's own TensorBoard callback, which names the folder
    if synced is not None:
        trainer.add_callback(synced)
    if not any(getattr(cb, "xc_progress", False) for cb in trainer.callback_handler.callbacks):
        # a user's script: fab logs shows its steps as a bundled job's
        trainer.add_callback(progress_callback(after_bar=not trainer.args.disable_tqdm))
    guard = trainer._xc_guard = Guard(watcher, callback, publisher)
    return guard


def progress_callback(every: int | None = None, after_bar: bool = False):
    """A TrainerCallback printing rank 0's progress line (events.progress): the first step, every ~5% of the steps,
    the last, and at least every 30 s. A Trainer's own tqdm bar rewrites one line with carriage returns, which a
    log read line by line (fab logs -f, the store's log) shows only when a newline comes, minutes later; after_bar
    (a Trainer showing its bar): the line goes after the bar's, on its stream (events.emit)."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        xc_progress = True  # attach() gives one to a Trainer that has none

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
            due = step == 1 or step % step_every == 0 or step == total or time.monotonic() - self.last > 30
            if state.is_world_process_zero and due:
                self.last = time.monotonic()
                events.emit(events.progress(step, total, time.monotonic() - self.started, self.loss, state.epoch),
                            after_bar=after_bar)

    return Progress()


def resume_checkpoint(trainer) -> str | None:
    """The complete checkpoint this run resumes from (XC_RESUME_URL fetched onto the node, XC_RESUME_FROM), or None."""
    store.fetch_resume()  # XC_RESUME_URL: the checkpoint from the cluster's store onto this node (once per process)
    resume = spot.resume_from()
    if resume:
        spot.check_resume_fits(trainer.model, resume)
    return resume


def _rank() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    return rank, int(os.environ.get("LOCAL_RANK", "0") or 0), world


def wait_seconds(cause: str) -> float:
    """How long rank 0 may wait for the notice's checkpoint to reach the store: a spot notice leaves ~120 s; a
    group termination is held by the lifecycle hook for its heartbeat (300 s), longer while heartbeats go on."""
    return publish.ON_GROUP_S if cause == notice.GROUP else publish.ON_NOTICE_S


def heartbeat(guard: Guard, cause: str) -> spot.LifecycleHeartbeat | None:
    """For a group termination, each node's first rank keeps its own lifecycle action alive while the checkpoint
    uploads (spot.LifecycleHeartbeat); None otherwise."""
    if cause != notice.GROUP or _rank()[1] != 0:
        return None
    beat = spot.LifecycleHeartbeat(guard.watcher)
    beat.start()
    return beat


def durable(guard: Guard, step: int, cause: str, poll: float = 1.0) -> bool:
    """Whether checkpoint-<step> is confirmed in the store, agreed by every rank: rank 0 (the only publisher)
    waits for its upload, the others wait with it in short all-reduces (a MIN of 0/1 flags), so no long
    collective meets the process group's timeout. False without a store, on a failed upload or past the wait.
    A group termination waits up to spot.GROUP_HOLD_S once a node's lifecycle heartbeat holds it (the third flag,
    negated so that MIN finds any), else the hook's own timeout (wait_seconds)."""
    import torch
    import torch.distributed as dist

    publisher = guard.publisher.publisher if guard.publisher is not None else None
    dist_on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    beat = heartbeat(guard, cause)
    started, held = time.monotonic(), False
    try:
        while True:
            deadline = started + (spot.GROUP_HOLD_S if held else wait_seconds(cause))
            if publisher is not None:  # rank 0 with a store
                idle = publisher.wait(min(poll, max(0.0, deadline - time.monotonic())))
                done = idle or time.monotonic() >= deadline
                ok = idle and publisher.confirmed(step)
            else:  # other ranks hold nothing; without a store nothing is durable
                done, ok = True, guard.publisher is not None and _rank()[0] != 0
            if not dist_on:
                return bool(ok)
            beating = beat is not None and beat.sent > 0 and beat.is_alive()
            flags = torch.tensor([int(done), int(ok), -int(beating)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            held = held or bool(flags[2] < 0)
            if flags[0] > 0:
                return bool(flags[1] > 0)
    finally:
        if beat is not None:
            beat.stop()


def end_if_noticed(trainer) -> None:
    """After trainer.train(): if the ranks agreed on a notice, say so once (rank 0) and exit 75 on every rank."""
    guard = getattr(trainer, "_xc_guard", None)
    if guard is None:
        return
    guard.watcher.stop()
    cb = guard.callback
    if cb.preempted_by is None:
        if guard.publisher is not None:
            guard.publisher.wait()  # the last periodic checkpoints reach the store before the run's end
        return
    import torch.distributed as dist

    rank, local_rank, _ = _rank()
    folder = Path(trainer.args.output_dir) / Checkpoints.name(cb.step)
    saved = (folder / Checkpoints.MARKER).is_file()
    ok = durable(guard, cb.step, cb.cause)
    if rank == 0:
        if not ok:
            log.error("the notice's checkpoint (step %s) is not durable in the store%s", cb.step,
                      "" if guard.publisher is not None else " (no store: XC_STORE is not set)")
        step = cb.step if saved else -1
        events.emit(notice.Notice(cause=cb.cause, rank=cb.preempted_by, step=step,
                                  checkpoint=Checkpoints.name(step), durable=ok).event())
    spot.release_node(guard.watcher, rank, local_rank, durable=ok)  # after the checkpoint is safe, never before
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(notice.EXIT)


def fix_mean_loss(trainer) -> str:
    """transformers 5 multiplies the loss by the world size (average_tokens_across_devices, a forward taking
    **kwargs) expecting a loss summed over the global batch's tokens: right for causal LMs, N times too big for
    a head whose loss is a mean over the rank's own batch. For those, the Trainer treats the model as taking no
    loss kwargs, as the bundled jobs do (common.mean_loss_per_rank): no world-size factor, and the loss is divided
    by the gradient accumulation steps as it should be. Where the head cannot be told, warns once with the fix.
    Returns what was decided: 'fixed', 'kept', 'warned' or 'n/a'."""
    args = trainer.args
    if not (getattr(args, "average_tokens_across_devices", False) and getattr(trainer, "model_accepts_loss_kwargs", False)
            and getattr(trainer, "compute_loss_func", None) is None):
        return "n/a"
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    name = type(model).__name__
    if name.endswith(MEAN_LOSS_HEADS):
        trainer.model_accepts_loss_kwargs = False
        return "fixed"
    if name.endswith(GLOBAL_TOKEN_HEADS):
        return "kept"
    if name not in _warned and _rank()[2] > 1 and _rank()[0] == 0:
        _warned.add(name)
        log.warning("%s: cannot tell whether its loss is a mean over each rank's batch; if it is, transformers "
                    "multiplies it by the world size (%d): pass --average_tokens_across_devices False (or set "
                    "model.accepts_loss_kwargs = False)", name, _rank()[2])
    return "warned"


GRAD_ACCUM_ENV = "XC_GRAD_ACCUM"  # a run going on at fewer nodes: accumulate this many times more (docs/scripts.md)


def scale_accumulation(trainer) -> int:
    """A Trainer script resumed on fewer nodes (fab train --min-nodes) keeps its global batch: its own
    gradient_accumulation_steps times XC_GRAD_ACCUM (once per trainer). Returns the steps it accumulates."""
    factor = int(os.environ.get(GRAD_ACCUM_ENV) or 1)
    if factor > 1 and not getattr(trainer, "_xc_accum_scaled", False):
        before = trainer.args.gradient_accumulation_steps
        trainer.args.gradient_accumulation_steps = before * factor
        trainer._xc_accum_scaled = True
        if _rank()[0] == 0:
            log.warning("gradient accumulation %d -> %d (%s=%d): the run goes on at fewer nodes with its global batch",
                        before, before * factor, GRAD_ACCUM_ENV, factor)
    return trainer.args.gradient_accumulation_steps


def patch(trainer_cls) -> None:
    """The rank hook's change to transformers.Trainer (once): train() gets the loss fix and attach(), resumes from
    the run's checkpoint when the script named none, and ends the rank on a notice."""
    if getattr(trainer_cls, "_xc_patched", False):
        return
    train = trainer_cls.train

    def train_(self, resume_from_checkpoint=None, *args, **kwargs):
        startup.settle()
        fix_mean_loss(self)
        scale_accumulation(self)
        attach(self)
        if resume_from_checkpoint is None:
            resume_from_checkpoint = resume_checkpoint(self)
            if resume_from_checkpoint:
                log.warning("resuming from %s (XC_RESUME_FROM)", resume_from_checkpoint)
        out = train(self, resume_from_checkpoint, *args, **kwargs)
        end_if_noticed(self)
        return out

    trainer_cls.train = train_
    trainer_cls._xc_patched = True
