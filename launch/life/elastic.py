"""`fab train --min-nodes M`: a run whose N nodes are not all back within --restart-wait goes on with k of them
(M <= k < N) at the same global batch, and grows back to N at its next complete checkpoint once they return.

The size: the largest k whose ranks divide the run's per-device batches per step (launch.plan.batch), so gradient
accumulation x N/k keeps every optimizer step's examples (training.jobs.order). Growing back: a watcher, while a smaller
segment runs, asks whether N nodes answer; once they do it waits for a checkpoint newer than the newest it saw, then
ends the segment's ranks, and the supervisor resumes from that checkpoint on N nodes."""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from cluster import store as store_lib
from cluster.node import Node
from core.errors import ClusterError
from launch.life import records
from launch.life.cleanup import sweep
from launch.plan.batch import micro_batches, smaller_sizes
from launch.plan.request import TrainRequest
from training.runtime import events
from training.runtime.paths import Checkpoints, RunPaths
from training.runtime.spec import RunSpec

log = logging.getLogger(__name__)


def _divisor(rec: records.RunRecord) -> tuple[int, int]:
    """The run's per-device batches per optimizer step (accumulation x ranks) and its ranks per node."""
    like = TrainRequest.of(RunSpec.from_json(rec.spec))
    return micro_batches(like, list(rec.args), int(rec.world_size or 1)), int(rec.ppn or 1)


def go_on_size(rec: records.RunRecord, ready: int, least: int, full: int) -> int:
    """The node count the run goes on with: the most of the ready ones from least to full-1 that divide its
    batch; raises ClusterError (one line, the record's reason) when none does."""
    units, ppn = _divisor(rec)
    if ready < least:
        raise ClusterError(f"only {ready} of {full} node(s) answered, fewer than --min-nodes {least}")
    sizes = smaller_sizes(units, ppn, least, min(ready, full - 1))
    if not sizes:
        raise ClusterError(f"{ready} of {full} node(s) answered, but no node count from {least} to "
                           f"{min(ready, full - 1)} ({ppn} rank(s) each) divides the run's {units} per-device "
                           "batch(es) per step")
    return sizes[0]


def idle_note(rec: records.RunRecord, ready: int, size: int, full: int) -> str:
    """The end of go_on_size's one-line message: empty when the run takes every ready node, else how many sit
    idle, still billed, why (the batch divisor) and what to change."""
    ready = min(ready, full - 1)
    if ready <= size:
        return ""
    units, ppn = _divisor(rec)
    times = ppn * ready // math.gcd(units, ppn * ready)  # the accumulation factor that `ready` nodes divide
    return (f"; {ready - size} ready node(s) sit idle, still billed: no count from {size + 1} to {ready} "
            f"({ppn} rank(s) each) divides the run's {units} per-device batch(es) per step; a gradient accumulation "
            f"{times}x as large (the per-device batch {times}x smaller keeps the global batch) would let {ready} in, "
            f"and --min-nodes {size + 1} ends the chain instead of going on with idle nodes")


class GrowBack(threading.Thread):
    """While run_id runs smaller than full: once ready() says the full size answers, the next complete checkpoint
    in the store ends the run's ranks (fired then names it). The supervisor's train() sees the ranks end."""

    def __init__(self, run_id: str, runs_dir, store: str | None, full: int, ready: Callable[[], bool], say,
                 poll_s: float = 10.0):
        super().__init__(daemon=True, name=f"grow-back-{run_id}")
        self.run_id, self.runs_dir, self.store, self.full = run_id, runs_dir, store, full
        self.ready, self.say, self.poll_s = ready, say, poll_s
        self.fired: int | None = None  # the checkpoint's step it ended the run at
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def _newest(self) -> int:
        steps = store_lib.checkpoints(self.store, self.run_id) if self.store else []
        return steps[-1] if steps else -1

    def _total(self) -> int:
        """The run's optimizer steps in all, from its newest progress line at home (unknown: never reached)."""
        try:
            text = (RunPaths(self.run_id, runs_dir=self.runs_dir).home / "log.txt").read_text(errors="replace")
        except OSError:
            return 1 << 62
        totals = [e.payload["total"] for e in events.of_lines(text[-20000:].splitlines()) if e.kind == events.PROGRESS]
        return int(totals[-1]) if totals else 1 << 62

    def run(self) -> None:
        try:
            self._watch()
        except Exception:  # a watcher's failure must not end the run it watches
            log.warning("run %s: the grow-back watcher stopped", self.run_id, exc_info=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.ready():
                break
        else:
            return
        seen = self._newest()
        self.say(f"{self.full} node(s) answer again: run {self.run_id} grows back at its next complete checkpoint")
        while not self._stop.wait(self.poll_s / 2):
            step = self._newest()
            if step > seen and step >= self._total():  # the run's last checkpoint: it is ending by itself
                return
            if step > seen:
                self.fired = step
                self.say(f"{Checkpoints.name(step)} of run {self.run_id} is complete: ending it to go on at "
                         f"{self.full} node(s)")
                rec = records.load_or_none(RunPaths(self.run_id, runs_dir=self.runs_dir).home)
                if rec is not None:
                    sweep([Node(**n) for n in rec.nodes], self.run_id)
                return
