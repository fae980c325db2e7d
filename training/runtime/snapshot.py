"""A run's code on a node, from the store: the snapshot fab put there when the run started (launch/staging/snapshot.py
makes it), never the operator's machine, so a restart or a replacement node needs neither it nor the folder as it
was.

The store keeps it as ``snapshots/<key>.tar.gz`` (the tarball: ``work/`` for --workdir, ``script/<name>`` for a lone
--script, ``data/<name>`` for the data files its flags name) and ``snapshots/<key>.json`` (what it holds, each
file's digest), written last: a snapshot without its manifest is incomplete. The key is a hash of the content, so
the same folder goes to the store once however many runs use it.

On a node, at staging (fab runs it over SSH with the ranks' environment: XC_STORE, XC_S3_ENDPOINT_URL and
credentials as the ranks get them):

    python -m training.runtime.snapshot KEY CACHE RUN_DIR

The tarball is unpacked once per node into CACHE/<key>/ (a file store's tarball read where it lies, an S3 one
downloaded first), then copied into the run's folder: work/ (the run's own copy: what a run writes never reaches
the next run's), script/ and data/. Prints one JSON line: whether this node took it from the store now, or
what went wrong and the fix.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path

from training.runtime import store as store_lib

FOLDER = "snapshots"  # the store's folder of run snapshots
PARTS = ("work", "script", "data")  # the tarball's top folders, as they lie in a run's folder on a node
COMPLETE = ".complete"


def tarball_key(key: str) -> str:
    return f"{FOLDER}/{key}.tar.gz"


def manifest_key(key: str) -> str:
    return f"{FOLDER}/{key}.json"


def manifest(store, key: str) -> dict | None:
    """The snapshot's manifest, or None while it is not (all) in the store."""
    data = store.get_bytes(manifest_key(key))
    return json.loads(data) if data else None


def extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Files and folders under relative paths only (fab's tarball holds nothing else), as tarfile's data filter.
    node_setup/head_boot.py has its own: it runs on a head before any of the project's code is there."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    members = tar.getmembers()
    for m in members:
        path = Path(m.name)
        if not (m.isfile() or m.isdir()) or path.is_absolute() or ".." in path.parts:
            raise ValueError(f"the snapshot holds {m.name!r}: only files and folders under relative paths")
        m.mode &= 0o755
    tar.extractall(dest, members=members)


def unpack(url: str, key: str, cache: Path) -> tuple[Path, bool]:
    """The snapshot unpacked under cache/<key> (once per node); returns it and whether it came from the store now.
    Raises StoreError."""
    dest = Path(cache) / key
    if (dest / COMPLETE).is_file():
        return dest, False
    part = Path(cache) / f".{key}.{uuid.uuid4().hex[:8]}.part"
    try:
        store = store_lib.open_store(url)
        if isinstance(store, store_lib.FileStore) and not store.root.is_dir():
            raise store_lib.StoreError(f"the store {url} is a folder this node does not have",
                                       fix="use a store every node reaches (--store s3://... or a shared folder)")
        if manifest(store, key) is None:
            raise store_lib.StoreError(f"{tarball_key(key)} is not in the store {url}",
                                       fix="resume with --code current (the folder as it is now), or start the run "
                                           "anew")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{key}.") as tmp:
            if isinstance(store, store_lib.FileStore):
                tarball = store.path(tarball_key(key))
            else:
                tarball = Path(tmp) / "snapshot.tar.gz"
                store.get_file(tarball_key(key), tarball)
            part.mkdir()
            with tarfile.open(tarball, "r:gz") as tar:
                extract(tar, part)
        (part / COMPLETE).touch()
    except Exception as exc:  # noqa: BLE001 - one line naming the fix
        shutil.rmtree(part, ignore_errors=True)
        raise store_lib.explain(exc, url) from None
    if dest.exists() and not (dest / COMPLETE).is_file():  # a copy cut short earlier
        shutil.rmtree(dest, ignore_errors=True)
    try:
        part.rename(dest)
    except OSError:  # another run on this node put it there first
        shutil.rmtree(part, ignore_errors=True)
    return dest, True


def _copy(src: Path, dest: Path) -> None:
    """cp -a, sharing blocks where the file system can (as --workdir's copy always was)."""
    res = subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dest)], capture_output=True, text=True,
                         check=False)
    if res.returncode == 0:
        return
    if src.is_dir():
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src, dest, symlinks=True)
    else:
        shutil.copy2(src, dest)


def place(unpacked: Path, run_dir: Path) -> list[str]:
    """The snapshot's parts into the run's folder: work/ replaced by a copy, script/ and data/ files added."""
    placed = []
    for part in PARTS:
        src = unpacked / part
        if not src.is_dir():
            continue
        target = run_dir / part
        if part == "work":
            shutil.rmtree(target, ignore_errors=True)
            _copy(src, target)
        else:
            target.mkdir(parents=True, exist_ok=True)
            for f in sorted(src.iterdir()):
                _copy(f, target / f.name)
        placed.append(part)
    return placed


def main(argv: list[str]) -> int:
    """One JSON line on stdout: {"fetched": bool}, or {"error": what, "fix": fix} (exit 1)."""
    key, cache, run_dir = argv
    url = store_lib.store_url()
    try:
        if not url:
            raise store_lib.StoreError("no store (XC_STORE) to take it from",
                                       fix="start the run again with 'fab train'")
        unpacked, fetched = unpack(url, key, Path(cache))
        place(unpacked, Path(run_dir))
    except store_lib.StoreError as exc:
        print(json.dumps({"error": exc.what, "fix": exc.fix}))
        return 1
    except OSError as exc:
        print(json.dumps({"error": f"could not copy it into {run_dir}: {exc}", "fix": "free space on the node"}))
        return 1
    print(json.dumps({"fetched": fetched}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
