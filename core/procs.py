"""Is a process there, which one is it, what it listens on: the checks the local cluster, its twins and run records
share."""
from __future__ import annotations

import ipaddress
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


def listens(pid: int, address: str, port: int) -> bool:
    """Whether process pid holds the listening TCP socket on address:port (from /proc/net/tcp and its fds)."""
    want = f"{int.from_bytes(ipaddress.IPv4Address(address).packed, 'little'):08X}:{port:04X}"
    try:
        rows = [line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]]  # pid's netns
    except OSError:
        return False
    inodes = {f"socket:[{r[9]}]" for r in rows if len(r) > 9 and r[1] == want and r[3] == "0A"}  # 0A: LISTEN
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False


def cmdlines() -> list[tuple[int, str]]:
    out = []
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            out.append((int(f.parent.name), f.read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:  # gone meanwhile
            pass
    return out
