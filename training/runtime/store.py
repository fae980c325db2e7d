"""The cluster's store: where a run keeps what must outlive a node (checkpoints, outputs, records).

One URL names it: ``file:///folder`` (a folder every node shares: the local cluster's, the operator's disk)
or ``s3://bucket/prefix`` (AWS, or any S3-compatible endpoint named by XC_S3_ENDPOINT_URL). Its layout is
training/runtime/paths.py's RunPaths; a checkpoint counts once Checkpoints.MARKER is in it (written last).

Contract with the operator through the ranks' environment: XC_STORE (the URL), XC_S3_ENDPOINT_URL,
XC_RUN_ID, XC_RESUME_URL (a checkpoint in the store to resume from). Credentials: the node's instance
profile on AWS, else AWS_* variables, which reach the ranks only through secrets.env.
This module is shared with the operator (cluster.store): stdlib only, boto3 imported when an s3 URL is used.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from training.runtime import paths
from training.runtime.paths import Checkpoints, RunPaths, tag_of
from training.runtime.s3client import s3_client

log = logging.getLogger("training.runtime.store")

CHUNK = 32 << 20  # multipart part size: a bert-base optimizer.pt (880 MB) goes up as ~28 parallel parts
STORE_ENV = "XC_STORE"  # the ranks' store URL; read through store_url() on the nodes, RunRecord.store at home
CONCURRENCY = 16


def store_url() -> str | None:
    """The cluster's store as the ranks were given it; None without one."""
    return os.environ.get(STORE_ENV) or None


class StoreError(ValueError):
    """What went wrong with the store, and the fix, kept apart (a job shows them as one `error:` line, as bad
    flags; the operator's side turns them into a ClusterError with the same fields)."""

    def __init__(self, what: str, fix: str = ""):
        self.what, self.fix = what, fix
        super().__init__(f"{what}; {fix}" if fix else what)


@dataclass(frozen=True, order=True)
class Entry:
    key: str  # relative to the store's root
    size: int


class FileStore:
    """A folder; writes go to a temporary name first and are renamed, so a reader never sees half a file."""

    def __init__(self, url: str):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"store {url}: a file URL names a folder on this machine (file:///abs/path)", fix=
                             "drop the host part")
        self.url, self.root = url.rstrip("/"), Path(unquote(parsed.path))

    def path(self, key: str) -> Path:
        return self.root / key

    def put_file(self, local: Path, key: str, progress=None) -> None:
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            os.link(local, tmp)  # same disk: instant, and the Trainer deleting its copy later leaves this one
        except OSError:
            shutil.copyfile(local, tmp)
        tmp.replace(dest)
        tmp.unlink(missing_ok=True)  # rename(2) leaves both names when dest is already a link to the same file
        if progress:
            progress(dest.stat().st_size)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(data)
        tmp.replace(dest)

    def get_file(self, key: str, local: Path, progress=None) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path(key), local)
        if progress:
            progress(local.stat().st_size)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[Entry]:
        base = self.path(prefix)
        if not base.is_dir():
            return []
        return sorted(Entry(str(p.relative_to(self.root)), p.stat().st_size) for p in base.rglob("*")
                      if p.is_file() and not p.name.endswith(".tmp"))

    def children(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self.path(prefix), ignore_errors=True)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)


class S3Store:
    """A bucket and prefix, through boto3's transfer manager (parallel multipart uploads and downloads)."""

    def __init__(self, url: str, client=None):
        parsed = urlparse(url)
        if not parsed.netloc:
            raise StoreError(f"store {url}: an s3 URL names a bucket (s3://bucket/prefix)")
        self.url, self.bucket = url.rstrip("/"), parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.endpoint = os.environ.get("XC_S3_ENDPOINT_URL") or None
        self._client = client

    @property
    def client(self):
        if self._client is None:
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
            if region is None and self.endpoint:
                region = "us-east-1"  # an S3-compatible endpoint ignores it, boto3 wants one
            self._client = s3_client(self.endpoint, region, CONCURRENCY + 4)  # one per credentials, not per store
        return self._client

    def key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _transfer(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=CONCURRENCY,
                              use_threads=True)

    def put_file(self, local: Path, key: str, progress=None) -> None:
        # checkpoints carry a tag: the bucket's lifecycle rule expires them (and only them) after the retention
        extra = {"Tagging": tag_of(key)} if tag_of(key) else None
        self.client.upload_file(str(local), self.bucket, self.key(key), Config=self._transfer(), Callback=progress,
                                ExtraArgs=extra)

    def put_bytes(self, key: str, data: bytes) -> None:
        tag = tag_of(key)
        self.client.put_object(Bucket=self.bucket, Key=self.key(key), Body=data, **({"Tagging": tag} if tag else {}))

    def get_file(self, key: str, local: Path, progress=None) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.part")
        self.client.download_file(self.bucket, self.key(key), str(tmp), Config=self._transfer(), Callback=progress)
        tmp.replace(local)

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def list(self, prefix: str) -> list[Entry]:
        out, base = [], self.key(prefix).rstrip("/") + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self.prefix) + 1:] if self.prefix else obj["Key"]
                out.append(Entry(rel, int(obj["Size"])))
        return sorted(out)

    def children(self, prefix: str) -> list[str]:
        base, names = self.key(prefix).rstrip("/") + "/", []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base,
                                                                          Delimiter="/"):
            names += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names)

    def delete_prefix(self, prefix: str) -> None:
        keys = [self.key(e.key) for e in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                                   "Quiet": True})

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(key))


def open_store(url: str):
    scheme = urlparse(url).scheme
    if scheme == "file":
        return FileStore(url)
    if scheme == "s3":
        return S3Store(url)
    raise StoreError(f"store {url!r} is neither file:///folder nor s3://bucket/prefix", fix="pass one of those to --store "
                     "(or XC_STORE)")


def explain(exc: BaseException, url: str) -> StoreError:
    """What failed with the store at url, and the fix (decided on the error's class and S3's code)."""
    name = type(exc).__name__
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, ImportError):
        return StoreError(f"store {url}: {exc.name or 'boto3'} is not installed here", fix="run 'fab setup' (every profile installs boto3)")
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StoreError(f"store {url}: no space left on device ({exc.filename or 'disk'})", fix="free space there or pass --store elsewhere")
    if isinstance(exc, PermissionError):
        return StoreError(f"store {url}: permission denied ({exc.filename})", fix="make it writable or pass --store elsewhere")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return StoreError(f"store {url}: no AWS credentials", fix="export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE); on AWS the nodes use the stack's instance profile ('pulumi up')")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"):
        where = os.environ.get("XC_S3_ENDPOINT_URL") or "S3"
        return StoreError(f"store {url} is unreachable ({where}: {name})", fix="check the network and XC_S3_ENDPOINT_URL, or pass "
                "--store with a reachable store")
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:  # botocore's ClientError and its modelled subclasses
        err = response["Error"]
        code = str(err.get("Code"))
        headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        if code in ("NoSuchBucket", "404"):
            return StoreError(f"store {url}: the bucket does not exist", fix="create it ('pulumi up' makes the stack's) or pass "
                    "--store s3://<an existing bucket>/<prefix>")
        if code in ("AccessDenied", "403", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(f"store {url}: access denied ({code})", fix="allow s3:GetObject, s3:PutObject, s3:DeleteObject and "
                    "s3:ListBucket on it for these credentials (the stack's node role does)")
        if code in ("PermanentRedirect", "301", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
            region = headers.get("x-amz-bucket-region") or err.get("Region") or "another region"
            return StoreError(f"store {url}: the bucket is in {region}", fix=f"export AWS_REGION={region} (or use a bucket in this region)")
        return StoreError(f"store {url}: S3 refused the request ({code}: {err.get('Message')})", fix="check the bucket and its policy")
    return StoreError(f"store {url}: {name}: {exc}", fix="check the store URL (--store / XC_STORE)")


PROBE_PREFIX = ".xc-probe/"  # under the store's prefix, where the node role may write and delete


def check_region(store) -> None:
    """A bucket in another region than the client's: S3 redirects, but every byte then crosses regions. HeadBucket
    says where it is; where it is refused (it needs s3:ListBucket without a prefix condition, which the node role
    has not) ListObjectsV2 under the store's prefix, which the node role allows, asks instead."""
    if not isinstance(store, S3Store):
        return
    try:
        reply = store.client.head_bucket(Bucket=store.bucket)
    except Exception as exc:  # S3's own error code decides
        if str(getattr(exc, "response", {}).get("Error", {}).get("Code")) not in ("403", "AccessDenied"):
            raise
        reply = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.key(PROBE_PREFIX), MaxKeys=1)
    actual = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
    mine = store.client.meta.region_name
    if actual and mine and actual != mine:
        raise StoreError(f"store {store.url}: the bucket is in {actual} but AWS_REGION is {mine}", fix=f"export "
                         f"AWS_REGION={actual} (or use a bucket in {mine})")


def probe(url: str) -> float:
    """List under the prefix, then write, read back and delete one small object: only what the node role
    allows, so the operator's check and every node's (fab doctor) are the same. Returns the seconds it took.
    Raises StoreError."""
    started = time.monotonic()
    try:
        store = open_store(url)
        check_region(store)
        key, body = f"{PROBE_PREFIX}{uuid.uuid4().hex}", uuid.uuid4().bytes
        store.put_bytes(key, body)
        if store.get_bytes(key) != body:
            raise StoreError(f"store {url}: a probe object read back differently", fix="check the store's consistency")
        store.delete(key)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the one line that says the fix
        raise explain(exc, url) from None
    return time.monotonic() - started


# -- trees: checkpoints and outputs -------------------------------------------------------------------
def upload_tree(store, folder: Path, prefix: str, skip=lambda rel: False, progress=None) -> int:
    """Every file of folder under prefix, Checkpoints.MARKER last; returns the bytes sent."""
    files = sorted((p for p in Path(folder).rglob("*") if p.is_file()), key=lambda p: p.name == Checkpoints.MARKER)
    sent = 0
    for path in files:
        rel = path.relative_to(folder).as_posix()
        if skip(rel):
            continue
        store.put_file(path, f"{prefix}/{rel}", progress)
        sent += path.stat().st_size
    return sent


def download_tree(store, prefix: str, dest: Path, skip=lambda rel: False, progress=None) -> int:
    """Every object under prefix into dest (Checkpoints.MARKER last); returns the bytes received."""
    entries = sorted(store.list(prefix), key=lambda e: e.key.endswith("/" + Checkpoints.MARKER))
    got = 0
    for e in entries:
        rel = e.key[len(prefix.rstrip("/")) + 1:]
        if skip(rel):
            continue
        store.get_file(e.key, Path(dest) / rel, progress)
        got += e.size
    return got


def stored_steps(store, run_id: str) -> list[int]:
    """Steps of the run's checkpoints whose marker is in the store, oldest first."""
    where = RunPaths(run_id).store_checkpoints
    steps = []
    for e in store.list(where):
        folder, _, marker = e.key[len(where) + 1:].partition("/")
        step = Checkpoints.step(folder) if marker == Checkpoints.MARKER else None
        if step is not None:
            steps.append(step)
    return sorted(steps)


def publish_checkpoint(path: str | os.PathLike, step: int | None = None, run_id: str | None = None,
                       url: str | None = None) -> str | None:
    """Copy a complete checkpoint folder into the store (its marker last), then drop the run's older
    checkpoints there beyond Checkpoints.KEEP. Returns its URL, or None when no store is configured.
    Raises StoreError. Call it after the checkpoint's Checkpoints.MARKER is written."""
    url = url or store_url()
    run_id = run_id or os.environ.get("XC_RUN_ID")
    if not url or not run_id:
        return None
    folder = Path(path)
    step = Checkpoints.step(folder.name) if step is None else step
    if step is None:
        raise StoreError(f"{folder} is not a checkpoint folder ({Checkpoints.GLOB})",
                         fix="name the folder as the Trainer does, or give step=")
    try:
        store = open_store(url)
        prefix = RunPaths(run_id).store_checkpoint(step)
        upload_tree(store, folder, prefix)
        for old in stored_steps(store, run_id)[:-Checkpoints.KEEP]:
            store.delete_prefix(RunPaths(run_id).store_checkpoint(old))
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, url) from None
    return f"{url}/{prefix}"


def fetch_resume(dest: str | os.PathLike | None = None) -> str | None:
    """XC_RESUME_URL (a checkpoint in the store) onto this node, at XC_RESUME_FROM; returns the local path.
    A file store shares the disk: its folder is used as it is. With several ranks per node the first local
    rank downloads and the others wait for the folder to appear whole."""
    source = os.environ.pop("XC_RESUME_URL", None)  # once per process: later readers find XC_RESUME_FROM
    if not source:
        return None
    try:
        base, run_id, step = paths.parse_checkpoint_url(source)
    except ValueError as exc:
        raise StoreError(f"XC_RESUME_URL: {exc}", fix="resume with 'fab train --resume RUN'") from None
    key = RunPaths(run_id).store_checkpoint(step)
    store = open_store(base)
    if isinstance(store, FileStore):
        os.environ["XC_RESUME_FROM"] = str(store.path(key))
        return os.environ["XC_RESUME_FROM"]
    target = Path(dest or os.environ.get("XC_RESUME_FROM") or f"resume/{Path(key).name}")
    if os.environ.get("LOCAL_RANK", "0") == "0" and not (target / Checkpoints.MARKER).is_file():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        started = time.monotonic()
        try:
            got = download_tree(store, key, partial)
        except Exception as exc:  # noqa: BLE001
            raise explain(exc, base) from None
        if not (partial / Checkpoints.MARKER).is_file():
            raise StoreError(f"XC_RESUME_URL {source} is not a complete checkpoint (no {Checkpoints.MARKER})", fix="resume "
                             "from another step")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        log.info("checkpoint %s from the store: %.0f MB in %.1fs", Path(key).name, got / 1e6,
                 time.monotonic() - started)
    deadline = time.monotonic() + float(os.environ.get("XC_DIST_TIMEOUT") or 600)
    while not (target / Checkpoints.MARKER).is_file():
        if time.monotonic() > deadline:
            raise StoreError(f"the checkpoint from {source} did not arrive in {target}")
        time.sleep(0.5)
    os.environ["XC_RESUME_FROM"] = str(target)
    return str(target)


def publish_output(output_dir: str | os.PathLike, url: str | None = None, run_id: str | None = None) -> int | None:
    """The job's output_dir (not its checkpoints) into <store>/runs/<id>/output/; returns bytes, None w/o store."""
    url = url or store_url()
    run_id = run_id or os.environ.get("XC_RUN_ID")
    if not url or not run_id or not Path(output_dir).is_dir():
        return None
    try:
        return upload_tree(open_store(url), Path(output_dir), RunPaths(run_id).store_output,
                           skip=lambda rel: Checkpoints.is_name(rel.split("/", 1)[0]) or rel.startswith(".xc-"))
    except Exception as exc:  # noqa: BLE001
        raise explain(exc, url) from None
