"""A rank's start-up without the cyclic collector's passes over its imports.

Importing torch, transformers and the Trainer leaves ~0.5M long-lived objects, and the collector's young-generation
passes while they are made took ~1.1 of a rank's ~5.5 CPU-s of imports (python -X importtime and time(1), gc on
and off, 1-layer MiniLM glue). The rank hook (training/hook/sitecustomize.py) raises the threshold before anything
imports; settle() freezes what start-up made (later full passes skip it) and puts the threshold back, when the
rank's process group forms or its Trainer starts training. A process that does neither keeps the raised
threshold: it still collects, every 100 000 allocations instead of every 700. Cyclic garbage made before the freeze
stays (~500 objects in a glue rank, by gc.collect() at that point)."""
from __future__ import annotations

import gc
import sys

HIGH = (100_000, 50, 100)  # the hook sets the same, without importing this module
DEFAULT = (700, 10, 10)  # CPython's own, where neither the hook nor hold() saw the threshold before it was raised
_before: list[tuple[int, int, int]] = []


def hold() -> None:
    """Raise the threshold for the imports ahead (a job run without the hook; again after its group formed)."""
    if gc.get_threshold() != HIGH:
        _before[:] = [gc.get_threshold()]
        gc.set_threshold(*HIGH)


def settle() -> None:
    """Freeze start-up's objects and put the threshold back (once per hold: later calls change nothing)."""
    if gc.get_threshold() != HIGH:
        return
    hook = sys.modules.get("sitecustomize")
    gc.freeze()
    gc.set_threshold(*(_before[0] if _before else getattr(hook, "GC_THRESHOLD", None) or DEFAULT))
