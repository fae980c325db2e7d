"""Is a process there, and which one is it: the one check the local cluster and run records share."""
from __future__ import annotations

import os
from pathlib import Path


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot), which tells it from a later one with its pid; None when
    it is gone, a zombie, or there is no /proc to read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" or len(fields) < 20 else fields[19]


def exists(pid: int) -> bool:
    """The pid names a live process (ours or not), not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if not Path("/proc/self/stat").is_file():  # no /proc (macOS): the signal's answer is all there is
        return True
    return start_time(pid) is not None
