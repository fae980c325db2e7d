"""A rank's start-up without the cyclic collector's passes over its imports, nor transformers' scan of its models.

Importing torch, transformers and the Trainer leaves ~0.5M long-lived objects, and the collector's young-generation
passes while they are made took ~1.1 of a rank's ~5.5 CPU-s of imports (python -X importtime and time(1), gc on
and off, 1-layer MiniLM glue). The rank hook (training/hook/sitecustomize.py) raises the threshold before anything
imports; settle() freezes what start-up made (later full passes skip it) and puts the threshold back, when the
rank's process group forms or its Trainer starts training. A process that does neither keeps the raised
threshold: it still collects, every 100 000 allocations instead of every 700. Cyclic garbage made before the freeze
stays (~500 objects in a glue rank, by gc.collect() at that point)."""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import pickle
import sys
from pathlib import Path

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


def cache_import_structure(import_utils, folder: str | os.PathLike | None = None) -> None:
    """transformers' define_import_structure, kept in a file after its first run (a rank hook on
    transformers.utils.import_utils). Each process that imports transformers' models otherwise reads ~1100 of its
    files and their `__all__`s again: 0.26 of a glue rank's ~4 CPU-s. The file is one per venv (under
    <venv>/var/xeon-cluster), keyed by the folder read, its mtime and import_utils' own, so a reinstalled
    transformers reads anew. Where the folder cannot be written, each process computes it as before."""
    original = import_utils.define_import_structure
    if getattr(original, "xc_cached", False):
        return
    where = Path(folder) if folder else Path(sys.prefix) / "var" / "xeon-cluster"
    stamp = os.stat(import_utils.__file__).st_mtime_ns

    def cached(module_path, prefix) -> Path | None:
        try:
            read = module_path if os.path.isdir(module_path) else os.path.dirname(module_path)
            key = repr((sys.version, str(module_path), prefix, stamp, os.stat(read).st_mtime_ns))
        except OSError:
            return None
        return where / f"hf-import-structure-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pickle"

    @functools.lru_cache
    def define_import_structure(module_path, prefix=None):
        path = cached(module_path, prefix)
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # noqa: BLE001, S110 - not there yet, or unreadable: computed, written for the next
            pass
        value = original(module_path, prefix)
        if path is not None:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                where.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(pickle.dumps(value))
                os.replace(tmp, path)
            except (OSError, pickle.PicklingError):
                with contextlib.suppress(OSError):
                    tmp.unlink()
        return value

    define_import_structure.xc_cached = True
    define_import_structure.original = original
    import_utils.define_import_structure = define_import_structure
