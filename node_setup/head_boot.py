#!/bin/sh
""":"
venv=${XC_HEAD_VENV:-/opt/xeon-cluster/venv}
if [ -x "$venv/bin/python" ]; then exec "$venv/bin/python" "$0" "$@"; fi
why="detached runs are supervised from the operator's machine; nothing to take over"
echo "xc-head-boot: no venv at $venv (image=base): $why"
exit 0
":"
At the head's boot (its unit xc-head.service; on the AWS twin, its watcher): take over the chains the head before
it supervised (launch.supervision.adopt). Written by cloud-init from the head's user data, so it is here before any of the
project's code: it fetches that code from the store (`code/<digest>.tar.gz`, put there by fab) for the chains that
have a `supervisor.json`, checks it against its digest, unpacks it under ~/.xeon-cluster/code/<digest> as fab would,
and runs `python -m launch.supervision.adopt` from the newest. Environment (the twin): XC_CLUSTER_ENV, XC_S3_ENDPOINT_URL.

The lines above are sh (this file's #! line): a head without the project's venv (image=base, or an AMI of one's own:
stock Ubuntu) says so in one line and ends 0, where a #! naming the venv's python failed the unit with 203/EXEC.
Python reads them as this docstring. A venv without boto3 says so too (main).

Only `<prefix>/runs/<id>/supervisor.json` is read (the head writes it; the nodes' role may write under a run's
output/ and checkpoints/, where a file of that name is not a chain), its `code` only as a 16-hex digest, and its
tarball only when it hashes to that digest (cluster.shipping.code_hash over its files): an entry that is not so is
skipped with one line, and the other chains are taken over.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CODE_HOME = Path.home() / ".xeon-cluster" / "code"
DIGEST = re.compile(r"[0-9a-f]{16}")  # cluster.shipping.code_hash: sha256's first 16 hex digits
RUN_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"  # a folder name, never a path (launch.life.stop.RUN_ID)


def cluster_env() -> dict[str, str]:
    path = Path(os.environ.get("XC_CLUSTER_ENV") or "/etc/xeon-cluster/cluster.env")
    lines = path.read_text().splitlines() if path.is_file() else []
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def extract(tar: tarfile.TarFile, dest: Path, filters: bool = hasattr(tarfile, "data_filter")) -> None:
    """The code tarball into dest. Pythons without tarfile's extraction filters (before 3.10.12 and 3.11.4: Debian
    12's 3.11.2) get the same guard by hand: fab's tarball (cluster.shipping) holds only files and folders under
    relative paths, so anything else is refused before a byte is written."""
    if filters:
        tar.extractall(dest, filter="data")
        return
    members = tar.getmembers()
    for m in members:
        path = Path(m.name)
        if not (m.isfile() or m.isdir()) or path.is_absolute() or ".." in path.parts:
            raise ValueError(f"the code tarball holds {m.name!r}: only files and folders under relative paths")
        m.mode &= 0o755  # no setuid, setgid or world-writable bits, as the data filter
    tar.extractall(dest, members=members)


def tarball_digest(data: bytes) -> str:
    """cluster.shipping.code_hash of the tree the tarball holds, from the tarball: fab's (code_tarball) holds each
    file once, under its relative path, in the order code_hash reads them, and nothing else; anything else is
    refused here, so that nothing unpacked goes unhashed."""
    h, seen = hashlib.sha256(), set()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar:
            if not m.isfile() or m.name in seen:
                raise ValueError(f"it holds {m.name!r}, which is not a file fab ships (or is there twice)")
            seen.add(m.name)
            h.update(m.name.encode() + b"\0" + tar.extractfile(m).read() + b"\0")
    return h.hexdigest()[:16]


def unpack(data: bytes, digest: str) -> Path:
    dest = CODE_HOME / digest
    if (dest / ".complete").is_file():
        return dest
    part = CODE_HOME / f"{digest}.part"
    for stale in (part, dest):  # what a boot cut short left
        shutil.rmtree(stale, ignore_errors=True)
    part.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        extract(tar, part)
    part.rename(dest)
    (dest / ".complete").touch()
    return dest


def job_key(key: str, base: str) -> str | None:
    """The chain's id when `key` is `<base>runs/<id>/supervisor.json`, else None."""
    m = re.fullmatch(re.escape(base + "runs/") + f"({RUN_ID})" + re.escape("/supervisor.json"), key)
    return m.group(1) if m else None


def chain_jobs(s3, bucket: str, base: str) -> list[tuple[object, str]]:
    """(LastModified, key) of each `<base>runs/<id>/supervisor.json` there is. The run ids come from one listing of
    `<base>runs/` by folder (Delimiter: a page per 1,000 runs, never the objects under them: outputs, checkpoints,
    log parts), then one HEAD per run: a run without a job (ended, or never detached) answers 404."""
    out = []
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base + "runs/", Delimiter="/")
    for folder in (p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])):
        key = folder + "supervisor.json"
        if job_key(key, base) is None:
            print(f"xc-head-boot: skipped {folder}: not a run's folder", flush=True)
            continue
        try:
            out.append((s3.head_object(Bucket=bucket, Key=key)["LastModified"], key))
        except s3.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
    return out


def chain_code(s3, bucket: str, base: str, key: str) -> Path:
    """The chain's code, unpacked here (already, or fetched from the store and checked against its digest);
    raises ValueError (or the store's error) saying why not."""
    if job_key(key, base) is None:
        raise ValueError("not a chain's (only <prefix>/runs/<id>/supervisor.json is)")
    try:
        digest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())["code"]
    except (ValueError, TypeError, KeyError):
        raise ValueError("not a supervisor.json with a code digest") from None
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise ValueError(f"its code {str(digest)[:40]!r} is not a 16-hex digest")
    if (CODE_HOME / digest / ".complete").is_file():
        return CODE_HOME / digest
    data = s3.get_object(Bucket=bucket, Key=f"{base}code/{digest}.tar.gz")["Body"].read()
    got = tarball_digest(data)
    if got != digest:
        raise ValueError(f"its code tarball hashes to {got}, not {digest}: refused")
    return unpack(data, digest)


def main() -> int:
    try:
        import boto3
    except ImportError:
        print("xc-head-boot: no venv with the project's packages here: no supervisor can be taken over", flush=True)
        return 0
    conf = cluster_env()
    url = conf.get("XC_STORE", "")
    if not url.startswith("s3://"):
        print(f"xc-head-boot: no S3 store in cluster.env ({url or 'none'}): nothing to take over", flush=True)
        return 0
    bucket, _, prefix = url[5:].partition("/")
    base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""  # as the store's keys are (S3Store.key)
    s3 = boto3.client("s3", region_name=conf.get("XC_REGION"), endpoint_url=os.environ.get("XC_S3_ENDPOINT_URL") or None)
    jobs = chain_jobs(s3, bucket, base)
    if not jobs:
        print("xc-head-boot: no chain to take over", flush=True)
        return 0
    newest = None
    for _, key in sorted(jobs):
        try:
            newest = chain_code(s3, bucket, base, key)
        except Exception as exc:  # noqa: BLE001 - one bad entry never stops the takeover of the others
            why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            print(f"xc-head-boot: skipped {key}: {why}"[:400], flush=True)
    if newest is None:
        print("xc-head-boot: no chain's code could be fetched: nothing taken over", flush=True)
        return 1
    env = {**os.environ, "XC_STORE": url, "AWS_REGION": conf.get("XC_REGION", "")}
    return subprocess.run([sys.executable, "-m", "launch.supervision.adopt"], cwd=newest, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
