"""TensorBoard event files into the cluster's store while a run trains (rank 0), so `fab tensorboard` shows its
curves from any machine, before the run ends and after its nodes are gone.

The files go under the run's outputs in the store (runs/<id>/output/...), where the end-of-run upload puts them
too: a logging dir inside --output_dir keeps its relative path, one elsewhere goes to output/tensorboard/<name>.
Only files that changed since the last look are sent, every XC_TB_SYNC_S seconds (default 20), and once more when
training ends (a spot notice included).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from training.runtime import store
from training.runtime.paths import RunPaths

log = logging.getLogger("training.runtime.tbsync")
EVERY_S = 20.0


def available() -> bool:
    """TensorBoard's writer can be made (transformers' TensorBoardCallback needs tensorboard or tensorboardX)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def interval() -> float:
    try:
        return max(1.0, float(os.environ.get("XC_TB_SYNC_S") or EVERY_S))
    except ValueError:
        return EVERY_S


def store_prefix(run_id: str, logging_dir: Path, output_dir: Path) -> str:
    """Where the logging dir's files go in the store: under the run's outputs, as the end-of-run upload puts them."""
    out = RunPaths(run_id).store_output
    try:
        rel = logging_dir.resolve().relative_to(output_dir.resolve()).as_posix()
    except ValueError:
        rel = f"tensorboard/{logging_dir.name}"
    return f"{out}/{rel}" if rel != "." else out


class EventSync(threading.Thread):
    """Sends the event files that changed (by size and mtime) since the last look; failures are logged, never raised."""

    def __init__(self, url: str, prefix: str, folder: Path, every: float | None = None):
        super().__init__(name="tensorboard-sync", daemon=True)
        self.url, self.prefix, self.folder = url, prefix, Path(folder)
        self.every = interval() if every is None else every
        self.seen: dict[str, tuple[int, int]] = {}
        self.sent = 0
        self._done = threading.Event()
        self._lock = threading.Lock()

    def sync(self) -> int:
        """One look: the changed files sent; returns how many."""
        with self._lock:
            if not self.folder.is_dir():
                return 0
            count = 0
            try:
                target = store.open_store(self.url)
                for path in sorted(p for p in self.folder.rglob("*") if p.is_file()):
                    stat = path.stat()
                    rel = path.relative_to(self.folder).as_posix()
                    if self.seen.get(rel) == (stat.st_size, stat.st_mtime_ns):
                        continue
                    target.put_file(path, f"{self.prefix}/{rel}")
                    self.seen[rel] = (stat.st_size, stat.st_mtime_ns)
                    count += 1
            except Exception as exc:  # noqa: BLE001 - metrics never stop a run
                log.warning("tensorboard files did not reach the store: %s", store.explain(exc, self.url))
            self.sent += count
            return count

    def run(self) -> None:
        while not self._done.wait(self.every):
            self.sync()

    def finish(self) -> None:
        self._done.set()
        self.sync()


def logging_dir(trainer, args) -> Path | None:
    """The folder the Trainer's TensorBoard callback writes (transformers 5: the callback's own; 4.x: args')."""
    for cb in trainer.callback_handler.callbacks:
        if type(cb).__name__ == "TensorBoardCallback" and getattr(cb, "logging_dir", None):
            return Path(cb.logging_dir)
    if "tensorboard" not in (getattr(args, "report_to", None) or []):
        return None
    found = getattr(args, "logging_dir", None) or os.environ.get("TENSORBOARD_LOGGING_DIR")
    return Path(found) if found else None


def sync_callback(trainer):
    """A TrainerCallback that syncs rank 0's TensorBoard files to XC_STORE as the run goes; None without a store."""
    url, run_id = store.store_url(), os.environ.get("XC_RUN_ID")
    if not url or not run_id:
        return None
    from transformers import TrainerCallback

    class TensorBoardSync(TrainerCallback):
        def __init__(self):
            self.sync: EventSync | None = None

        def on_train_begin(self, args, state, control, **kw):
            folder = logging_dir(trainer, args) if state.is_world_process_zero else None
            if folder is not None and self.sync is None:
                self.sync = EventSync(url, store_prefix(run_id, folder, Path(args.output_dir)), folder)
                self.sync.start()

        def on_train_end(self, args, state, control, **kw):
            if self.sync is not None:
                self.sync.finish()
                log.info("tensorboard: %d event file uploads to the store", self.sync.sent)

    return TensorBoardSync()
