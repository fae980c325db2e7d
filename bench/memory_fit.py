"""Whether a bench's batch fits this machine's memory, before it starts: a batch that fits, or one line naming --batch.

The GPT-2 shape at 1024 tokens is the one that does not fit everywhere: the manual recipe's path (fp32, full logits,
torch's math attention; always run beside the default) at --batch 16 was OOM-killed at 23 GB resident on a 24 GB
machine.
Peak resident memory of one clm run (`ru_maxrss`), measured with transformers 5.x and torch 2.13 on an AMD EPYC
(2026-11-27; one step each, but three for the manual recipe at batch 4):
  manual (fp32, previous path)  4.66 GiB at batch 1, 8.30 at 2, 16.49 at 4: 0.7 + 3.95 x batch GiB
  default, bf16                 2.71 at 1, 4.03 at 4: 2.3 + 0.44 x batch
  default, fp32                 2.59 at 1, 5.03 at 4: 1.8 + 0.81 x batch
The manual recipe's path bounds every run of the bench, and MARGIN covers allocator and version drift.
"""
from __future__ import annotations

import os
from pathlib import Path

GIB = 1 << 30
# (fixed GiB, GiB per sample of the batch) of the run that needs most, per --model-shape; shapes absent here fit
STEP_GIB = {"gpt2": (0.7, 3.95)}
MARGIN = 1.15
CHOICES = (16, 8, 4, 2, 1)
MEMORY_ENV = "BENCH_MEMORY_GIB"  # what the bench may use, where this machine's free memory is not the answer


def available_gib() -> float:
    """Memory this process may still take: MemAvailable, or the cgroup's room where that is less."""
    if os.environ.get(MEMORY_ENV):
        return float(os.environ[MEMORY_ENV])
    avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemAvailable:"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return avail / GIB


def needs_gib(shape: str, batch: int) -> float:
    fixed, per_sample = STEP_GIB.get(shape, (0.0, 0.0))
    return (fixed + per_sample * batch) * MARGIN


def pick_batch(shape: str, batch: int | None, default: int, available: float) -> tuple[int, str | None]:
    """(batch, a line saying why it was chosen, or None). A given --batch that does not fit, or a shape that fits
    no batch, raises SystemExit with one line naming the flag."""
    if shape not in STEP_GIB:
        return (batch or default), None
    if batch is not None:
        if needs_gib(shape, batch) <= available:
            return batch, None
        fits = next((b for b in CHOICES if b < batch and needs_gib(shape, b) <= available), None)
        fix = f"use --batch {fits} or lower" if fits else "free memory or use a bigger machine"
        raise SystemExit(f"error: --batch {batch} with --model-shape {shape} needs ~{needs_gib(shape, batch):.0f} GiB "
                         f"(the manual recipe's fp32 path), and {available:.1f} GiB is available; {fix}")
    for b in CHOICES:
        if b <= default and needs_gib(shape, b) <= available:
            note = None if b == default else (f"batch {b}: --batch {default} would need ~{needs_gib(shape, default):.0f} "
                                              f"GiB with --model-shape {shape}, {available:.1f} GiB is available")
            return b, note
    raise SystemExit(f"error: --model-shape {shape} needs ~{needs_gib(shape, 1):.1f} GiB even at --batch 1 (the "
                     f"manual recipe's fp32 path), and {available:.1f} GiB is available; free memory or use a bigger "
                     "machine")
