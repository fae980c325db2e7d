"""`python -m training.speed.native`: build the kernels for this CPU (unless cached) and load them, then print one JSON
line, {"ok": true | false | null (no torch here to load them), "detail": str}. fab setup runs it once per node, so that no rank builds at its start, and
fab doctor's kernels row reads it. A load is remembered beside the library, per venv and torch version: the next check
(each fab doctor, each cluster's first run) reads that instead of importing torch again (~1.7 CPU-s a node)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from training.speed import native


def main() -> int:
    if os.environ.get(native.ENV, "1") == "0":
        print(json.dumps({"ok": False, "detail": f"{native.ENV}=0: torch's own ops"}))
        return 0
    try:
        path = native.build()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        print(json.dumps({"ok": False, "detail": f"not built: {detail.splitlines()[-1] if detail else e}"}))
        return 0
    loaded = _loaded_stamp(path)
    if loaded is not None and loaded.is_file():
        print(json.dumps({"ok": True, "detail": f"built for this CPU and loaded: {path}"}))
        return 0
    try:
        ok = native.lib() is not None
    except ImportError as e:  # a venv without torch runs no job: nothing there would call the kernels
        print(json.dumps({"ok": None, "detail": f"built, not loaded: {e} (no job runs on this python)"}))
        return 0
    if ok and loaded is not None:
        try:
            loaded.write_text(f"{sys.prefix}\n")
        except OSError:  # a read-only cache checks again next time
            pass
    print(json.dumps({"ok": ok, "detail": f"built for this CPU and loaded: {path}" if ok else native.why()}))
    return 0


def _loaded_stamp(library: Path) -> Path | None:
    """Beside the library: this venv's torch loaded it. None where torch is not installed here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        return None
    key = hashlib.sha256(f"{sys.prefix}\0{torch}".encode()).hexdigest()[:16]
    return library.with_name(f"{library.name}.loaded-{key}")


if __name__ == "__main__":
    raise SystemExit(main())
