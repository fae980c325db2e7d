"""Ship the project's training/ code to nodes, content-addressed, so every node runs one revision; and what a
supervisor needs to the cluster's head, the same way."""
from __future__ import annotations

import hashlib
import io
import json
import shlex
import tarfile
from pathlib import Path

from cluster.remote import run
from core.constants import PROJECT_ROOT
from core.errors import ClusterError

SHIPPED = ("training",)
# what a supervisor imports and reads (templates, profiles): the head runs it from its own copy of these
HEAD_SHIPPED = ("cluster", "core", "launch", "node_setup", "templates", "training")


def _files(root: Path = PROJECT_ROOT, tops: tuple[str, ...] = SHIPPED) -> list[Path]:
    out = []
    for top in tops:
        for p in sorted((root / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".tmp"):
                out.append(p)
    return out


def code_hash(root: Path = PROJECT_ROOT, tops: tuple[str, ...] = SHIPPED) -> str:
    h = hashlib.sha256()
    for p in _files(root, tops):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def code_tarball(root: Path = PROJECT_ROOT, tops: tuple[str, ...] = SHIPPED) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in _files(root, tops):
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(root)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with p.open("rb") as fh:
                tar.addfile(info, fh)
    return buf.getvalue()


def ensure_code(conn, home: str, digest: str, tarball: bytes) -> str:
    """Install the code under <home>/code/<digest> unless it is there; returns that folder."""
    dest = f"{home}/code/{digest}"
    q = shlex.quote(dest)
    if run(conn, f"test -f {q}/.complete").ok:
        return dest
    tmp = f"{home}/code/.{digest}.tar.gz"
    run(conn, f"mkdir -p {shlex.quote(home)}/code")
    conn.put(io.BytesIO(tarball), tmp)
    res = run(conn, f"rm -rf {q}.part && mkdir -p {q}.part && tar -xzf {shlex.quote(tmp)} -C {q}.part && "
                    f"rm -f {shlex.quote(tmp)} && rm -rf {q} && mv {q}.part {q} && touch {q}/.complete")
    if not res.ok:
        raise ClusterError(f"{conn.host}: could not unpack the code: {res.stderr.strip()[-300:]}")
    return dest


# code_hash on the node, over an installed copy (python3 only: it runs before any venv exists).
# Sorting by path parts is what sorted(Path.rglob()) does on every python 3, so the digests agree.
REMOTE_HASH_PY = r"""
import hashlib, sys
from pathlib import Path
root = Path(sys.argv[1]); tops = sys.argv[2:]
files = [p for t in tops for p in (root / t).rglob("*")
         if p.is_file() and "__pycache__" not in p.relative_to(root).parts and p.suffix not in (".pyc", ".tmp")]
h = hashlib.sha256()
for p in sorted(files, key=lambda p: p.relative_to(root).parts):
    h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
print(h.hexdigest()[:16])
"""


def installed_code_hash(conn, code_dir: str) -> str | None:
    """The digest of the code installed in ``code_dir`` on the node; None if it is not there (complete)."""
    q = shlex.quote(code_dir)
    res = run(conn, f"test -f {q}/.complete && python3 -c {shlex.quote(REMOTE_HASH_PY)} {q} "
                    + " ".join(map(shlex.quote, SHIPPED)))
    return res.stdout.strip() if res.ok else None


def ensure_verified_code(conn, home: str, digest: str, tarball: bytes) -> str:
    """ensure_code, re-shipping a copy whose content no longer hashes to its digest (edited on the node)."""
    dest = ensure_code(conn, home, digest, tarball)
    if installed_code_hash(conn, dest) != digest:
        run(conn, f"rm -f {shlex.quote(dest)}/.complete")
        dest = ensure_code(conn, home, digest, tarball)
        found = installed_code_hash(conn, dest)
        if found != digest:
            raise ClusterError(f"{conn.host}: code in {dest} hashes to {found} after shipping, not {digest}", fix=
                               "check the node's disk and that python3 runs there")
    return dest


def standalone(tail: str, modules: tuple[str, ...] = ("paths", "events", "notice", "s3client", "store", "spot")) -> str:
    """A Python program for a node that has python but not the shipped code (a probe before setup, a check
    between runs): the named training/runtime modules travel inside it as text and import as `training.runtime.<name>`;
    `tail` runs after them and imports what it needs."""
    sources = {f"training.runtime.{m}": (PROJECT_ROOT / "training" / "runtime" / f"{m}.py").read_text() for m in modules}
    return ("import importlib.abc as _abc, importlib.util as _util, sys as _sys, types as _types\n"
            f"_SOURCES = {sources!r}\n"
            "class _Shipped(_abc.MetaPathFinder, _abc.Loader):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name in ('training', 'training.runtime'):\n"
            "            return _util.spec_from_loader(name, self, is_package=True)\n"
            "        return _util.spec_from_loader(name, self) if name in _SOURCES else None\n"
            "    def create_module(self, spec):\n"
            "        return None\n"
            "    def exec_module(self, module):\n"
            "        if module.__name__ in _SOURCES:\n"
            "            exec(compile(_SOURCES[module.__name__], module.__name__, 'exec'), module.__dict__)\n"
            "_sys.meta_path.insert(0, _Shipped())\n"
            + tail)


def native_kernels(conn, code_dir: str, python: str) -> tuple[bool | None, str]:
    """training/speed/native's kernels built (unless cached) and loaded on the node by `python` (a shell word): (True,
    where), (False, why not), or (None, why it could not be asked or means nothing there)."""
    res = run(conn, f"cd {shlex.quote(code_dir)} && {python} -m training.speed.native", timeout=300)
    try:
        got = json.loads(res.stdout.strip().splitlines()[-1])
        return (None if got["ok"] is None else bool(got["ok"])), str(got["detail"])
    except (ValueError, IndexError, KeyError, TypeError):
        return None, f"not checked: {(res.stderr.strip() or 'no output').splitlines()[-1]}"
