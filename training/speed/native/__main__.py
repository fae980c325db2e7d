"""`python -m training.speed.native`: build the kernels for this CPU (unless cached) and load them, then print one JSON
line, {"ok": true | false | null (no torch here to load them), "detail": str}. fab setup runs it once per node, so that no rank builds at its start, and
fab doctor's kernels row reads it."""
from __future__ import annotations

import json
import os
import subprocess

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
    try:
        ok = native.lib() is not None
    except ImportError as e:  # a venv without torch runs no job: nothing there would call the kernels
        print(json.dumps({"ok": None, "detail": f"built, not loaded: {e} (no job runs on this python)"}))
        return 0
    print(json.dumps({"ok": ok, "detail": f"built for this CPU and loaded: {path}" if ok else native.why()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
