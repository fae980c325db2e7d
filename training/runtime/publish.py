"""Checkpoints into the cluster's store while training goes on (rank 0, the node that holds them whole).

After the Trainer saves and training.runtime.spot marks a checkpoint complete, rank 0 snapshots it with hard links
(instant; the Trainer may delete its folder meanwhile) and one background thread uploads it with boto3's
parallel multipart transfers, marker last. Training does not wait, except on a spot notice: the job then
waits (``wait()``) until the notice's checkpoint is durable in the store before the ranks exit.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path

from training.runtime import events, store
from training.runtime.paths import Checkpoints

log = logging.getLogger("training.runtime.store")
ON_NOTICE_S = 100  # a spot notice leaves ~120 s: the checkpoint must be durable well before the node goes
# A group termination is held by the lifecycle hook for its heartbeat (300 s, infra/nodes.py TERMINATION_HEARTBEAT_S),
# counted from before the notice was seen: less the poll, the step, the save and the ranks' exit.
ON_GROUP_S = 270


def _snapshot(folder: Path) -> Path:
    snap = folder.with_name(f".xc-store-{folder.name}")
    shutil.rmtree(snap, ignore_errors=True)
    for path in folder.rglob("*"):
        target = snap / path.relative_to(folder)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    return snap


class Publisher(threading.Thread):
    """One upload at a time, in the order saved; failures are logged (the run goes on) and counted."""

    def __init__(self, url: str, run_id: str):
        super().__init__(name="store-publisher", daemon=True)
        self.url, self.run_id = url, run_id
        self.todo: queue.Queue = queue.Queue()
        self.durable: list[int] = []  # steps whose upload finished, marker last
        self.failed: list[str] = []
        self.failed_steps: list[int] = []

    def submit(self, folder: Path, step: int) -> None:
        self.todo.put((_snapshot(folder), step, time.monotonic()))

    def run(self) -> None:
        while True:
            item = self.todo.get()
            if item is None:
                return
            snap, step, saved_at = item
            try:
                started = time.monotonic()
                where = store.publish_checkpoint(snap, step=step, run_id=self.run_id, url=self.url)
                self.durable.append(step)
                size = sum(p.stat().st_size for p in snap.rglob("*") if p.is_file())
                events.emit(events.RunEvent(events.DURABLE, 0, step, payload={
                    "ok": True, "where": where, "bytes": size, "seconds": time.monotonic() - started,
                    "after": time.monotonic() - saved_at}))
            except store.StoreError as exc:
                self.failed.append(str(exc))
                self.failed_steps.append(step)
                events.emit(events.RunEvent(events.DURABLE, 0, step, payload={"ok": False, "error": str(exc)}))
            finally:
                shutil.rmtree(snap, ignore_errors=True)
                self.todo.task_done()

    def confirmed(self, step: int) -> bool:
        """checkpoint-<step> reached the store whole (its marker last) and no upload of it failed."""
        return step in self.durable and step not in self.failed_steps

    def wait(self, timeout: float | None = None) -> bool:
        """Until every checkpoint submitted so far is in the store (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.todo.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


def publisher_callback():
    """A TrainerCallback that sends each complete checkpoint to XC_STORE from rank 0; None without a store.
    Add it after training.runtime.spot's callback, which writes the marker in the same on_save."""
    url, run_id = store.store_url(), os.environ.get("XC_RUN_ID")
    if not url or not run_id:
        return None
    from transformers import TrainerCallback

    class Publish(TrainerCallback):
        def __init__(self):
            self.publisher: Publisher | None = None

        def on_save(self, args, state, control, **kw):
            folder = Path(args.output_dir) / Checkpoints.name(state.global_step)
            if state.is_world_process_zero and (folder / Checkpoints.MARKER).is_file():
                if self.publisher is None:
                    self.publisher = Publisher(url, run_id)
                    self.publisher.start()
                self.publisher.submit(folder, state.global_step)

        def wait(self, timeout: float | None = None) -> bool:
            return self.publisher is None or self.publisher.wait(timeout)

    return Publish()


def output(output_dir) -> None:
    """The job's outputs into the store (XC_STORE) at its end; a failure is logged, the results stay on node 0."""
    try:
        sent = store.publish_output(output_dir)
        if sent is not None:
            log.info("outputs in the store: %.0f MB", sent / 1e6)
    except store.StoreError as exc:
        log.error("outputs did not reach the store: %s", exc)
