"""A run's code as a snapshot in the cluster's store: what every node, every restart and any head runs it from.

- What: `--workdir DIR` (the files launch.staging.workdir ships: what git would commit), or a lone `--script FILE`, and
  the data files the run's flags name (`--train_file` ...), packed once at `fab train` time into one tarball:
  `work/...`, `script/<name>`, `data/<name>` (the names the ranks see, launch.staging.datafiles).
- Where: the store's `snapshots/<key>.tar.gz`, with `snapshots/<key>.json` (each file's digest) written last; the
  key a hash of the content, so an unchanged folder is put there once however many runs use it (the upload is
  skipped when the key is there).
- Who reads it: every node at staging (training.runtime.snapshot, from the store, never from this machine), and the
  supervisor of a restart, on this machine or a head, which reads only the manifest: the folder on this machine
  may change, move or go while the run trains and restarts. The run's record keeps the key (`request.snapshot`);
  `fab train --resume RUN` uses it too, `--code current` makes a new one from the folder as it is now and names the
  files that changed.
- Without a store (a request made in code, with no XC_STORE in its environment) nothing is put anywhere: the files
  go from this machine to each node as before.
"""
from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
from pathlib import Path

from cluster import remote
from cluster.store import PUBLIC_ENV
from core.errors import ClusterError
from launch.staging import workdir as workdir_lib
from launch.staging.datafiles import file_digest, local_files, rewrite_files
from training.runtime import snapshot as shared
from training.runtime import store as store_lib

CODE_CHOICES = ("snapshot", "current")  # fab train --resume RUN --code


def _store_error(exc: BaseException, url: str) -> ClusterError:
    err = store_lib.explain(exc, url)
    return ClusterError(err.what, fix=err.fix)


def has_own_files(req) -> bool:
    """Whether the request ships anything of this machine's: --workdir, a --script, data files."""
    return bool(req.spec.what.workdir or req.spec.what.script or local_files(req.spec.what.args))


def contents(req, wd) -> tuple[dict, list[tuple[Path, str]]]:
    """(manifest, [(local file, name in the tarball)]) of the request's own files; `wd`: --workdir scanned."""
    members: list[tuple[Path, str]] = []
    manifest: dict = {"workdir": None, "script": None, "data": {}}
    if wd is not None:
        manifest["workdir"] = {"digest": wd.digest, "bytes": wd.size, "files": dict(sorted(wd.file_digests.items()))}
        members += [(wd.root / rel, f"work/{rel}") for rel in wd.files]
    elif req.spec.what.script:
        local = Path(req.spec.what.script).expanduser()
        manifest["script"] = {"name": local.name, "digest": file_digest(str(local))[:16]}
        members.append((local, f"script/{local.name}"))
    _, ship = rewrite_files(req.spec.what.args)
    for name, local in ship.items():
        manifest["data"][name] = {"digest": file_digest(str(local))[:16], "bytes": local.stat().st_size}
        members.append((local, f"data/{name}"))
    return manifest, members


def key_of(manifest: dict) -> str:
    """The content's key: the folder's digest, the script's and the data files' (by the names the ranks see)."""
    content = {"workdir": (manifest["workdir"] or {}).get("digest"),
               "script": [manifest["script"]["name"], manifest["script"]["digest"]] if manifest["script"] else None,
               "data": {name: d["digest"] for name, d in manifest["data"].items()}}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def pack(members: list[tuple[Path, str]], dest: Path) -> int:
    """The tarball (owned by nobody, executable bits kept); returns its size."""
    def owned_by_nobody(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(dest, "w:gz", compresslevel=6, dereference=True) as tar:
        for local, name in members:
            tar.add(str(local), arcname=name, recursive=False, filter=owned_by_nobody)
    return dest.stat().st_size


def put(url: str, manifest: dict, members: list[tuple[Path, str]]) -> tuple[str, int | None]:
    """The snapshot into the store unless its key is there; (key, bytes sent or None when it was there already).
    Raises ClusterError."""
    key = key_of(manifest)
    try:
        store = store_lib.open_store(url)
        if shared.manifest(store, key) is not None:
            return key, None
        with tempfile.TemporaryDirectory(prefix="xc-snapshot-") as tmp:
            tarball = Path(tmp) / f"{key}.tar.gz"
            size = pack(members, tarball)
            store.put_file(tarball, shared.tarball_key(key))
        store.put_bytes(shared.manifest_key(key), json.dumps({**manifest, "key": key, "tarball_bytes": size},
                                                             indent=1).encode())
    except ClusterError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _store_error(exc, url) from None
    return key, size


def load(req) -> dict:
    """The manifest of the request's snapshot, from its store; one line with the fix when it is not there."""
    url, key = req.store, req.spec.what.snapshot
    if not url:
        raise ClusterError(f"the run's code is the snapshot {key} in a store, and this run has none",
                           fix="pass --store with the store the run used")
    try:
        found = shared.manifest(store_lib.open_store(url), key)
    except Exception as exc:  # noqa: BLE001
        raise _store_error(exc, url) from None
    if found is None:
        raise ClusterError(f"the run's code snapshot {shared.tarball_key(key)} is not in the store {url}",
                           fix="pass --store with the store the run used, or resume with --code current (the "
                               "folder as it is now)")
    return found


def workdir_of(manifest: dict, path: str, key: str) -> workdir_lib.Workdir:
    """--workdir as the snapshot holds it (its files and digest), whatever the folder here holds now."""
    held = manifest.get("workdir")
    if not held:
        raise ClusterError(f"the run's code snapshot {key} holds no --workdir {path}",
                           fix="resume with --code current (the folder as it is now), or start the run anew")
    return workdir_lib.Workdir(Path(path), path, sorted(held["files"]), size=held["bytes"], digest=held["digest"])


def check_holds(manifest: dict, req, key: str) -> None:
    """The snapshot holds what the request runs: its lone --script and every data file its flags name."""
    if req.spec.what.script and not req.spec.what.workdir and not manifest.get("script"):
        raise ClusterError(f"the run's code snapshot {key} holds no --script {req.spec.what.script}",
                           fix="resume with --code current (the file as it is now), or start the run anew")
    missing = sorted(set(rewrite_files(req.spec.what.args)[1]) - set(manifest.get("data") or {}))
    if missing:
        raise ClusterError(f"the run's code snapshot {key} holds no data file {missing[0]}",
                           fix="resume with --code current (the files as they are now), or start the run anew")


def changed(before: dict, after: dict) -> tuple[list[str], list[str], list[str]]:
    """(changed, added, removed) file names between two manifests: --workdir's files, or the lone script."""
    def files(m: dict) -> dict[str, str]:
        if m.get("workdir"):
            return dict(m["workdir"]["files"])
        if m.get("script"):
            return {m["script"]["name"]: m["script"]["digest"]}
        return {}

    old, new = files(before), files(after)
    return (sorted(f for f in old.keys() & new.keys() if old[f] != new[f]), sorted(new.keys() - old.keys()),
            sorted(old.keys() - new.keys()))


def _names(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def changes_line(before: dict | None, after: dict, run_id: str, what: str) -> str:
    """What `--code current` resumes with, compared with the run's own snapshot: file names, never contents."""
    if before is None:
        return f"--code current: resuming {run_id} with {what} as it is now (the run kept no snapshot to compare with)"
    mod, add, gone = changed(before, after)
    if not (mod or add or gone):
        return f"--code current: {what} is as run {run_id} shipped it: nothing changed"
    parts = [f"{label} {_names(names)}" for label, names in (("changed", mod), ("added", add), ("removed", gone))
             if names]
    return f"--code current: resuming {run_id} with {what} as it is now: " + "; ".join(parts)


def _same_data(before: dict, after: dict, req) -> None:
    """--code current takes the code as it is now, never other data: a data file that changed is refused."""
    where = rewrite_files(req.spec.what.args)[1]
    for name, d in (after.get("data") or {}).items():
        old = (before.get("data") or {}).get(name)
        if old is not None and old["digest"] != d["digest"]:
            raise ClusterError(f"--resume {req.resume.run_id} --code current: its data file {where.get(name, name)} "
                               "changed since the run", fix="restore it, or resume without --code current (the run's "
                               "snapshot holds the data as it started)")


def prepare(req, say):
    """The request with its own files in the store as a snapshot (spec.what.snapshot: its key); unchanged when it ships
    none, has no store, or already runs a snapshot (a resume of the run's own). Raises ClusterError before anything
    starts."""
    code = req.spec.what
    if code.snapshot or not req.store or not has_own_files(req):
        return req
    wd = req.checked[0] if req.checked else workdir_lib.check(code.workdir, code.script, code.module, code.launcher,
                                                              not code.own)
    manifest, members = contents(req, wd)
    current = req.resume is not None and req.resume.current
    before = None
    if current and req.resume.snapshot:
        before = load(req.but(snapshot=req.resume.snapshot))
        _same_data(before, manifest, req)
    key, sent = put(req.store, manifest, members)
    what = (f"--workdir {code.workdir}" if wd is not None else f"--script {code.script}" if code.script else
            "the data files")
    files = len(members)
    if sent is None:
        say(f"code snapshot {key} ({what}, {files} file(s)) already in the store: nothing sent")
    else:
        say(f"code snapshot {key} ({what}, {files} file(s)) put in the store, {_size(sent)}: the nodes and every "
            "restart take it from there")
    if current:
        say(changes_line(before, manifest, req.resume.run_id, what))
    return req.but(snapshot=key)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


# ---- on a node ----------------------------------------------------------------------------------------------

def fetch(conn, python: str, code_dir: str, run_dir: str, home: str, key: str, env: dict[str, str]) -> bool:
    """The snapshot into the run's folder on the node, from the store the ranks' environment `env` names (with the
    credentials of the run's secrets.env where it has one); True when this node took it from the store now, False
    when it had it. Raises ClusterError."""
    import shlex

    q = shlex.quote
    store_env = " ".join(f"{k}={q(v)}" for k, v in env.items() if k in (store_lib.STORE_ENV, *PUBLIC_ENV))
    command = (f"cd {q(run_dir)} && {{ [ ! -f ./secrets.env ] || . ./secrets.env; }} && env {store_env} "
               f"PYTHONPATH={q(code_dir)} {q(python)} -m training.runtime.snapshot {q(key)} "
               f"{q(home + '/' + shared.FOLDER)} {q(run_dir)}")
    res = remote.run(conn, command, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    try:
        said = json.loads(lines[-1])
    except (IndexError, ValueError):
        why = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
        said = {"error": why[-1] if why else f"exit {res.exited}", "fix": "check the node with 'fab doctor'"}
    if not res.ok or "error" in said:
        raise ClusterError(f"{conn.host}: the run's code snapshot {key}: {said.get('error')}",
                           fix=said.get("fix") or "start the run again with 'fab train'")
    return bool(said.get("fetched"))


def fetched_line(key: str, names: list[str], fetched: list[bool]) -> str:
    got, rest = workdir_lib.which_got(names, fetched)
    if not got:
        return f"code snapshot {key} already on every node"
    return f"code snapshot {key} fetched from the store by {', '.join(got)}{rest}"
