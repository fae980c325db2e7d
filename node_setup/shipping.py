"""Ship the project's training/ code to nodes, content-addressed, so every node runs one revision."""
from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
from pathlib import Path

from .errors import ClusterError
from .remote import run

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("training",)


def _files(root: Path = PROJECT_ROOT) -> list[Path]:
    out = []
    for top in SHIPPED:
        for p in sorted((root / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".tmp"):
                out.append(p)
    return out


def code_hash(root: Path = PROJECT_ROOT) -> str:
    h = hashlib.sha256()
    for p in _files(root):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def code_tarball(root: Path = PROJECT_ROOT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in _files(root):
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
