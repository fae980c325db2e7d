"""The data files a run's flags name (`--train_file` ...): files on the operator's machine that go to the nodes,
in the run folder's data/ (from the run's snapshot in the store, launch.staging.snapshot, or from this machine)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from core.errors import ClusterError
from launch.staging import jobflags

# Flags of the bundled jobs whose values are files on the operator's machine: shipped to the nodes.
FILE_FLAGS = ("--train_file", "--validation_file", "--test_file")


def local_files(args: list[str]) -> list[tuple[str, str]]:
    """(flag, path) for every data-file flag in the job arguments (both '--f x' and '--f=x')."""
    out = []
    for f in jobflags.parse(args):
        if f.name in FILE_FLAGS:
            if f.value is None:
                raise ClusterError(f"{f.name} needs a file path", "pass the data file after it")
            out.append((f.name, f.value))
    return out


def rewrite_files(args: list[str], base: str = "data") -> tuple[list[str], dict[str, Path]]:
    """Point data-file flags at <base>/<name>, the run folder's data/ as the rank sees it from its current
    directory (the run folder, or its work/ with --workdir: base '../data'); returns new args and name -> local
    path. A relative path is the operator's: resolved against fab's current directory."""
    ship: dict[str, Path] = {}
    out = list(args)
    for f in jobflags.parse(args):
        if f.name not in FILE_FLAGS:
            continue
        if not f.value:
            raise ClusterError(f"{f.name} needs a file path", fix="pass the data file after it")
        local = Path(f.value).expanduser().resolve()
        name = f"{len(ship)}-{local.name}"
        ship[name] = local
        out[f.value_at] = f"{f.name}={base}/{name}" if f.joined else f"{base}/{name}"
    return out, ship


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with Path(path).expanduser().open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
