"""The operator's view of the cluster's store (training.runtime.store holds the shared code): which store a task
uses, whether it answers, what the ranks need to reach it, and bringing a run home from it.

Choosing it, the same for every task (train, pull, runs, logs, doctor): --store URL > XC_STORE > fabric.yaml
xc.store > the stack's storeUrl output (AWS clusters) > the local folder <runs dir's parent>/store, which the
local cluster's nodes share with the operator (so 'make demo' needs no server).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster import aws, inventory
from core.constants import PROJECT_ROOT
from core.errors import ClusterError
from training.runtime import events
from training.runtime import store as shared
from training.runtime.paths import Checkpoints, RunPaths

log = logging.getLogger(__name__)

RECORDS = ("summary.json", "results.json", "log.txt", events.RUN_FILE)
# The ranks reach the store with these: the URL, an S3-compatible endpoint, the region.
PUBLIC_ENV = ("XC_S3_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")  # secrets by their names
PROGRESS_BYTES = 32 << 20


@dataclass(frozen=True)
class Choice:
    url: str
    source: str  # which rung of the precedence chose it
    spec: str | None = field(default=None, compare=False)  # the cluster it was chosen for, once resolved

    @property
    def is_default(self) -> bool:
        return self.source == "the local folder"

    def line(self) -> str:
        return f"store: {self.url} ({self.source})"


def default_folder() -> Path:
    runs = Path(os.environ.get("XC_RUNS_DIR") or PROJECT_ROOT / "runs")
    return runs.expanduser().resolve().parent / "store"


def _aws_kind(spec: str | None) -> bool:
    return (spec or "").split(":", 1)[0] in ("aws", "pulumi")


def stack_store(spec: str | None) -> str | None:
    """The storeUrl output of the cluster's Pulumi stack, for an AWS cluster with a Pulumi CLI; else None."""
    if not _aws_kind(spec):
        return None
    import shutil

    if not shutil.which("pulumi"):
        return None
    kind, _, arg = spec.partition(":")
    try:
        outputs = aws.stack_outputs(arg if kind == "pulumi" else "")
    except ClusterError as exc:
        log.debug("no stack outputs for the store: %s", exc)
        return None
    if kind == "aws" and arg and outputs.get("clusterName") not in (None, arg):
        return None  # the selected stack is another cluster's
    return outputs.get("storeUrl") or None


def choose(flag: str | None = None, config: dict | None = None, spec: str | None = None) -> Choice:
    """--store > XC_STORE > fabric.yaml xc.store > the stack's storeUrl > the local folder."""
    if spec is None:
        spec = inventory.default_cluster()
    return replace(_choose(flag, config, spec), spec=spec)


def _choose(flag: str | None, config: dict | None, spec: str) -> Choice:
    if flag:
        return Choice(_normal(flag), "--store")
    from_env = os.environ.get(shared.STORE_ENV)
    if from_env:
        return Choice(_normal(from_env), shared.STORE_ENV)
    configured = ((config or {}).get("xc") or {}).get("store")
    if configured:
        return Choice(_normal(str(configured)), "fabric.yaml xc.store")
    from_stack = stack_store(spec)
    if from_stack:
        return Choice(_normal(from_stack), "the stack's storeUrl")
    return Choice(default_folder().as_uri(), "the local folder")


def as_cluster_error(exc: shared.StoreError) -> ClusterError:
    """The store's error as the CLI shows it: the same what and fix."""
    return ClusterError(exc.what, fix=exc.fix)


def _normal(url: str) -> str:
    """A plain path is a file store; URLs are checked for their scheme."""
    if "://" not in url:
        return Path(url).expanduser().resolve().as_uri()
    try:
        shared.open_store(url)
    except shared.StoreError as exc:
        raise as_cluster_error(exc) from None
    return url.rstrip("/")


def check(choice: Choice, spec: str | None = None) -> float:
    """Write, read and delete a probe object from here: one `error:` line naming the store and the fix."""
    check_reachable_from_nodes(choice, spec)
    if choice.url.startswith("file:"):  # the folder is made on first use, as a bucket is by 'pulumi up'
        try:
            Path(shared.open_store(choice.url).root).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise as_cluster_error(shared.explain(exc, choice.url)) from None
    try:
        return shared.probe(choice.url)
    except shared.StoreError as exc:
        raise as_cluster_error(exc) from None


def check_reachable_from_nodes(choice: Choice, spec: str | None = None) -> None:
    """The local folder is no store for cloud nodes: they cannot reach the operator's disk."""
    spec = spec or choice.spec
    if choice.is_default and _aws_kind(spec):
        raise ClusterError(f"cluster {spec} has no store: its stack has no storeUrl output (or no Pulumi CLI here) "
                           "and its nodes cannot reach this machine's folder", fix="run 'pulumi up' (it creates the "
                           "bucket) or pass --store s3://<bucket>/<prefix>")


def rank_env(choice: Choice, spec: str | None = None) -> dict[str, str]:
    """What the ranks need: XC_STORE, the endpoint and region, and (off AWS, for an s3 store) the operator's
    credentials, which launch.staging.secrets keeps off command lines and records by their names."""
    spec = spec or choice.spec
    env = {shared.STORE_ENV: choice.url}
    env.update({k: os.environ[k] for k in PUBLIC_ENV if os.environ.get(k)})
    if choice.url.startswith("s3:") and not _aws_kind(spec):
        env.update(operator_credentials())
    return env


def operator_credentials() -> dict[str, str]:
    """The operator's AWS credentials as variables, wherever boto3 finds them (environment, profile, SSO)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return {k: os.environ[k] for k in CREDENTIALS if os.environ.get(k)}
    try:
        import boto3

        creds = boto3.session.Session().get_credentials()
    except Exception:  # noqa: BLE001 - none found: the probe says so in its own words
        return {}
    if creds is None:
        return {}
    frozen = creds.get_frozen_credentials()
    out = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        out["AWS_SESSION_TOKEN"] = frozen.token
    return out


def credentials_line(choice: Choice, spec: str | None = None) -> str | None:
    """Off AWS an s3 store's ranks hold the operator's own credentials: whose, and until when, in one line for
    the run's first lines (None where the nodes use their instance role, or the store is a folder)."""
    if not choice.url.startswith("s3:") or _aws_kind(spec or choice.spec):
        return None
    try:
        import boto3

        session = boto3.session.Session()
        creds = session.get_credentials()
        if creds is None:
            return None
        sts = session.client("sts", endpoint_url=os.environ.get("XC_AWS_ENDPOINT_URL") or None)
        who = sts.get_caller_identity()["Arn"]
    except Exception as exc:  # noqa: BLE001 - a line that informs, never a reason to stop the run
        log.debug("could not tell whose credentials the nodes get: %s", exc)
        return "store credentials: the nodes get this machine's AWS credentials (whose, STS could not say)"
    expiry = getattr(creds, "_expiry_time", None)  # botocore's refreshable credentials (SSO, assumed roles)
    if expiry is not None:
        until = f"temporary, until {expiry.strftime('%Y-%m-%d %H:%M %Z').strip()}: a run outliving them loses the store"
    elif creds.get_frozen_credentials().token:
        until = "temporary (a session token of unknown expiry): a run outliving it loses the store"
    else:
        until = "a long-lived access key, which does not expire: prefer a role with a short session"
    return (f"store credentials: the nodes get {who}'s ({until}); they travel as run secrets, never on a command "
            "line or in a record")


# -- reading it ----------------------------------------------------------------------------------
def _store(url: str):
    try:
        return shared.open_store(url)
    except shared.StoreError as exc:
        raise as_cluster_error(exc) from None


def _guard(url: str, fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except ClusterError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store's failures become one line with the fix
        raise as_cluster_error(shared.explain(exc, url)) from None


def checkpoints(url: str, run_id: str) -> list[int]:
    """The run's complete checkpoints in the store, oldest first."""
    return _guard(url, shared.stored_steps, _store(url), run_id)


def read_summary(url: str, run_id: str, name: str = "summary.json") -> dict | None:
    """The run's summary.json in the store (or another of its JSON records: results.json)."""
    data = _guard(url, _store(url).get_bytes, RunPaths(run_id).store_record(name))
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def run_url(url: str, run_id: str) -> str:
    """Where the run's records and outputs are in the store, as a URL: what a line about its end names."""
    return f"{url.rstrip('/')}/{RunPaths(run_id).store}"


def read_text(url: str, key: str) -> str | None:
    data = _guard(url, _store(url).get_bytes, key)
    return None if data is None else data.decode(errors="replace")


def list_keys(url: str, prefix: str) -> list:
    """The objects under prefix (key, size)."""
    return _guard(url, _store(url).list, prefix)


def get_file(url: str, key: str, local: Path) -> None:
    _guard(url, _store(url).get_file, key, local)


def run_ids(url: str) -> list[str]:
    """The run ids the store has a folder for."""
    return _guard(url, _store(url).children, RunPaths.RUNS)


def store_runs(url: str) -> dict[str, dict]:
    """run id -> summary of every run recorded in the store."""
    out = {}
    for run_id in run_ids(url):
        summary = read_summary(url, run_id)
        if summary is not None:
            out[run_id] = summary
    return out


def publish_records(run_dir: Path, url: str | None, ended: bool = False) -> None:
    """summary.json, results.json, log.txt and events.jsonl of a run into its store; never raises (the run's end is
    recorded at home whatever the store does). ``ended``: the run's whole log is final, so the parts its supervisor
    published while it ran are deleted (one object every ~5 s a run, ~17k a day, would otherwise stay)."""
    if not url:
        return
    try:
        store = shared.open_store(url)
        for name in RECORDS:
            path = Path(run_dir) / name
            if path.is_file():
                store.put_bytes(RunPaths(Path(run_dir).name).store_record(name), path.read_bytes())
        log_txt = Path(run_dir) / "log.txt"
        if ended and log_txt.is_file():
            compact_log(store, Path(run_dir).name, log_txt.stat().st_size)
    except Exception as exc:  # noqa: BLE001
        log.warning("the run's records did not reach the store: %s", shared.explain(exc, url))


def _parts_end(parts) -> int:
    return max((int(e.key.rsplit("/", 1)[1]) + e.size for e in parts), default=0)


def compact_log(store, run_id: str, whole_size: int) -> int:
    """Delete a run's log parts once its whole log.txt (whole_size bytes) covers them; returns how many went."""
    parts = store.list(f"{RunPaths(run_id).store}/{RunPaths.LOG_PARTS}")
    if not parts or _parts_end(parts) > whole_size:
        return 0
    for e in parts:
        store.delete(e.key)
    return len(parts)


class LivePublisher:
    """What a head's supervisor publishes of a run still going on, every few seconds: summary.json and results.json
    only when they changed, and log.txt as appended parts (runs/<id>/log.parts/<byte offset>, whole lines), each
    written once. A whole log.txt every 5 s left a version per upload in the versioned bucket (a 10 MB log: ~170 GB
    a day of them); the whole log.txt is published at the run's transitions (publish_records). Raises ClusterError."""

    def __init__(self, url: str):
        self.url, self.store = url, None
        self.sent: dict[tuple[str, str], bytes] = {}  # (run id, name) -> what the store holds
        self.offsets: dict[str, int] = {}  # run id -> bytes of its log in parts

    def _offset(self, store, run_id: str) -> int:
        """Where the log's parts end: a restarted supervisor goes on after what its predecessor sent."""
        if run_id not in self.offsets:
            parts = _guard(self.url, store.list, f"{RunPaths(run_id).store}/{RunPaths.LOG_PARTS}")
            self.offsets[run_id] = _parts_end(parts)
        return self.offsets[run_id]

    def publish(self, run_dir: Path) -> int:
        """The changes of one run's records and log since the last call; returns how many objects it wrote."""
        self.store = self.store or _store(self.url)  # one client: a new one per call costs more than the call
        store, run_id, written = self.store, Path(run_dir).name, 0
        for name in ("summary.json", "results.json"):
            path = Path(run_dir) / name
            data = path.read_bytes() if path.is_file() else None
            if data is not None and self.sent.get((run_id, name)) != data:
                _guard(self.url, store.put_bytes, RunPaths(run_id).store_record(name), data)
                self.sent[(run_id, name)] = data
                written += 1
        offset = self._offset(store, run_id)
        try:
            with (Path(run_dir) / "log.txt").open("rb") as f:
                f.seek(offset)
                new = f.read()
        except OSError:
            new = b""
        new = new[:new.rfind(b"\n") + 1]  # whole lines: the rest goes with the next part
        if new:
            key = f"{RunPaths(run_id).store}/{RunPaths.LOG_PARTS}/{offset:012d}"
            _guard(self.url, store.put_bytes, key, new)
            self.offsets[run_id] = offset + len(new)
            written += 1
        return written


def read_log(url: str, run_id: str, parts_seen: dict[str, bytes] | None = None) -> str | None:
    """A run's log as the store has it: its whole log.txt (published at transitions) or the appended parts of a run
    still going on, whichever is longer (a log only grows). ``parts_seen`` keeps parts already read (they never
    change) across calls of a follower; none is fetched where log.txt already covers them. None when the store has
    neither."""
    store, where = _store(url), RunPaths(run_id)
    whole = _guard(url, store.get_bytes, where.store_record("log.txt"))
    seen = parts_seen if parts_seen is not None else {}
    listed = _guard(url, store.list, f"{where.store}/{RunPaths.LOG_PARTS}")
    if whole is not None and len(whole) >= _parts_end(listed):
        return whole.decode(errors="replace")
    for e in listed:
        if e.key not in seen:
            seen[e.key] = _guard(url, store.get_bytes, e.key) or b""
    parts = b"".join(seen[k] for k in sorted(seen))
    if whole is None and not parts:
        return None
    return max(whole or b"", parts, key=len).decode(errors="replace")


def put_record(url: str, run_id: str, name: str, data: bytes) -> None:
    """One record file of a run (the head's heartbeat.json) into its store; raises ClusterError."""
    _guard(url, _store(url).put_bytes, RunPaths(run_id).store_record(name), data)


def delete_record(url: str, run_id: str, name: str) -> None:
    _guard(url, _store(url).delete, RunPaths(run_id).store_record(name))


def put_once(url: str, key: str, data: bytes) -> None:
    """`key` (under the store's prefix) unless it is there already; raises ClusterError."""
    store = _store(url)
    if not _guard(url, store.list, key):
        _guard(url, store.put_bytes, key, data)


def pull(url: str, run_id: str, dest: Path, with_checkpoints: bool = False, with_model: bool = True,
         say: Callable[[str], None] | None = None) -> tuple[int, int]:
    """A run's records and outputs (and, if asked, its complete checkpoints) from the store into dest, with
    progress; returns (files, bytes). Raises ClusterError when the store has no such run."""
    store, where = _store(url), RunPaths(run_id)
    entries = _guard(url, store.list, where.store)
    if not entries:
        raise ClusterError(f"no run {run_id} in the store {url}", fix="pass an id from 'fab runs' (or --store with the "
                           "store the run used)")
    complete = {where.store_checkpoint(s) + "/" for s in _guard(url, shared.stored_steps, store, run_id)}
    wanted = []
    for e in entries:
        rel = e.key[len(where.store) + 1:]
        if rel.startswith("checkpoints/"):
            # only complete checkpoints, and their marker last (a copy cut short never counts at home either)
            if not with_checkpoints or not any(e.key.startswith(c) for c in complete):
                continue
        elif not with_model and rel.endswith(MODEL_SUFFIXES):
            continue
        wanted.append((e, rel))
    wanted.sort(key=lambda pair: pair[1].endswith("/" + Checkpoints.MARKER))
    total = sum(e.size for e, _ in wanted)
    done = 0
    started = time.monotonic()
    for e, rel in wanted:
        target = Path(dest) / rel
        callback = _progress(rel, e.size, say) if say and e.size > PROGRESS_BYTES else None
        try:
            store.get_file(e.key, target, callback)
        except OSError as exc:
            if exc.errno == errno.ENOSPC or isinstance(exc, PermissionError):
                why = "no space left on device" if exc.errno == errno.ENOSPC else "permission denied"
                raise ClusterError(f"pulling {run_id} from {url} into {dest}: {why}", fix="free space there or pass --to "
                                   "another folder") from None
            raise as_cluster_error(shared.explain(exc, url)) from None
        except Exception as exc:  # noqa: BLE001
            raise as_cluster_error(shared.explain(exc, url)) from None
        done += e.size
        if say:
            say(f"  {rel} ({e.size / 2**20:.1f} MiB; {done / 2**20:.0f}/{total / 2**20:.0f} MiB, "
                f"{100 * done / max(total, 1):.0f}%)")
    if say:
        say(f"pulled {len(wanted)} file(s), {done / 2**20:.1f} MiB in {time.monotonic() - started:.1f}s into {dest}")
    return len(wanted), done


MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _progress(rel: str, size: int, say):
    marks, got = set(), [0]

    def callback(n: int) -> None:  # boto3 reports increments; a file store the whole size at once
        got[0] += n
        pct = min(100, int(100 * got[0] / max(size, 1)) // 25 * 25)
        if pct not in marks:
            marks.add(pct)
            say(f"  {rel}: {got[0] / 2**20:.0f}/{size / 2**20:.0f} MiB ({pct}%)")
    return callback
