#!/opt/xeon-cluster/venv/bin/python
"""At the head's boot (its unit xc-head.service; on the AWS twin, its watcher): take over the chains the head before
it supervised (launch.chain.adopt). Written by cloud-init from the head's user data, so it is here before any of the
project's code: it fetches that code from the store (`code/<digest>.tar.gz`, put there by fab) for the chains that
have a `supervisor.json`, unpacks it under ~/.xeon-cluster/code/<digest> as fab would, and runs
`python -m launch.chain.adopt` from the newest. Needs the project's venv (boto3); without one it says so and ends.
Environment (the twin): XC_CLUSTER_ENV, XC_S3_ENDPOINT_URL.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

CODE_HOME = Path.home() / ".xeon-cluster" / "code"


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


def unpack(data: bytes, digest: str) -> Path:
    dest = CODE_HOME / digest
    if (dest / ".complete").is_file():
        return dest
    part = CODE_HOME / f"{digest}.part"
    part.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        extract(tar, part)
    part.rename(dest)
    (dest / ".complete").touch()
    return dest


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
    s3 = boto3.client("s3", region_name=conf.get("XC_REGION"), endpoint_url=os.environ.get("XC_S3_ENDPOINT_URL") or None)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/runs/")
    jobs = [o for page in pages for o in page.get("Contents", []) if o["Key"].endswith("/supervisor.json")]
    if not jobs:
        print("xc-head-boot: no chain to take over", flush=True)
        return 0
    import json

    newest = None
    for obj in sorted(jobs, key=lambda o: o["LastModified"]):
        digest = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())["code"]
        body = s3.get_object(Bucket=bucket, Key=f"{prefix}/code/{digest}.tar.gz")["Body"].read()
        newest = unpack(body, digest)
    env = {**os.environ, "XC_STORE": url, "AWS_REGION": conf.get("XC_REGION", "")}
    return subprocess.run([sys.executable, "-m", "launch.chain.adopt"], cwd=newest, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
