"""`fab train --workdir DIR`: your own project, shipped the way training/ is.

- Which files: what git would commit. Inside a repository `git ls-files --cached --others --exclude-standard`
  (every .gitignore, .git/info/exclude, your global excludes); outside one the same command over a scratch git
  folder, so DIR's .gitignore files count just alike; without git, a plain reading of DIR's .gitignore files
  (patterns, `!`, trailing `/`, `**`). Never .git/ or __pycache__/.
- How much: at most XC_WORKDIR_LIMIT_MB (default 200) MiB in all, refused before anything starts.
- Shipped once per content: with a store (every `fab train` has one) as the run's snapshot there
  (launch.staging.snapshot), which every node, and a restart, takes from the store; without one from this machine to
  `<home>/workdirs/<digest>/` on every node (an unchanged project is not sent again). Each run works in its own
  copy, `runs/<id>/work/`: its current directory, first on sys.path, so what a run writes never reaches the next
  run's project.
- `--script FILE` is then a path inside DIR, `--module NAME` a module of DIR (`python -m NAME`), and
  `--launcher accelerate` starts either through `accelerate launch` (see launch.plan.launcher.launch_words).
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import tarfile
import tempfile
import threading
import weakref
from pathlib import Path

from cluster.remote import run
from core.errors import ClusterError

LIMIT_ENV = "XC_WORKDIR_LIMIT_MB"
DEFAULT_LIMIT_MB = 200
LAUNCHERS = ("python", "accelerate")
NEVER = (".git", "__pycache__")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
MiB = 1 << 20


class Workdir:
    """DIR's shipped files (relative POSIX paths), their size and content digest; the tarball on demand."""

    def __init__(self, root: Path, label: str, files: list[str], size: int | None = None, digest: str | None = None):
        """`size` and `digest` given: the folder as a snapshot's manifest describes it (launch.staging.snapshot), not
        read from disk (a head, or a restart after the folder changed, may not have it as it was)."""
        self.root, self.label, self.files = root, label, files
        self.size = size if size is not None else sum((root / f).stat().st_size for f in files)
        self._digest: str | None = digest
        self._file_digests: dict[str, str] | None = None
        self._tarball: str | None = None
        self._lock = threading.Lock()

    @property
    def digest(self) -> str:
        """sha256 over every file's path, executable bit and bytes (16 hex digits, as the code's)."""
        if self._digest is None:
            self._hash()
        return self._digest

    @property
    def file_digests(self) -> dict[str, str]:
        """Each file's own digest (its executable bit and bytes): what tells which files changed."""
        if self._file_digests is None:
            self._hash()
        return self._file_digests

    def _hash(self) -> None:
        h, each = hashlib.sha256(), {}
        for rel in self.files:
            path = self.root / rel
            mode = b"x" if os.access(path, os.X_OK) else b"-"
            h.update(rel.encode() + b"\0" + mode + b"\0")
            one = hashlib.sha256(mode + b"\0")
            with path.open("rb") as fh:
                for chunk in iter(lambda: fh.read(MiB), b""):
                    h.update(chunk)
                    one.update(chunk)
            h.update(b"\0")
            each[rel] = one.hexdigest()[:16]
        digest = h.hexdigest()[:16]
        if self._digest is None:
            self._digest = digest
        self._file_digests = each

    def tarball(self) -> str:
        """A local .tar.gz of the files, built once (by the first node that needs it), removed with this object."""
        with self._lock:
            if self._tarball is None:
                fd, path = tempfile.mkstemp(prefix="xc-workdir-", suffix=".tar.gz")
                os.close(fd)
                weakref.finalize(self, _unlink, path)

                def owned_by_nobody(info: tarfile.TarInfo) -> tarfile.TarInfo:
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    return info

                with tarfile.open(path, "w:gz", compresslevel=1, dereference=True) as tar:
                    for rel in self.files:
                        tar.add(str(self.root / rel), arcname=rel, recursive=False, filter=owned_by_nobody)
                self._tarball = path
            return self._tarball

    def summary(self) -> str:
        return f"{self.label}: {len(self.files)} file(s), {_size(self.size)}, digest {self.digest}"

    def record(self) -> dict:
        return {"path": str(self.root), "digest": self.digest, "files": len(self.files), "bytes": self.size}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _size(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def limit_mb() -> int:
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT_MB
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ClusterError(f"{LIMIT_ENV}={text!r} is not a positive whole number of MiB", fix=f"unset it or set e.g. "
                           f"{LIMIT_ENV}=500")
    return value


# ---- which files ---------------------------------------------------------------------------------------

def list_files(root: Path) -> list[str]:
    """DIR's files as git would commit them, relative POSIX paths, sorted; .git/ and __pycache__/ never."""
    root = Path(root).resolve()
    found = _git_listing(root)
    if found is None:
        found = _plain_listing(root)
    return sorted({f for f in found if not set(Path(f).parts) & set(NEVER) and not f.endswith(".pyc")
                   and (root / f).is_file()})


def _git(*args: str) -> subprocess.CompletedProcess | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # a hook's GIT_DIR must not steer it
    try:
        return subprocess.run(["git", *args], capture_output=True, env=env, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):  # no git: the plain reading
        return None


def _git_listing(root: Path) -> list[str] | None:
    listing = ["ls-files", "-z", "--others", "--exclude-standard"]
    inside = _git("-C", str(root), "rev-parse", "--is-inside-work-tree")
    if inside is None:
        return None
    if inside.returncode == 0 and inside.stdout.strip() == b"true":
        res = _git("-C", str(root), *listing, "--cached")
        files = _split(res) if res is not None and res.returncode == 0 else None
        if files:  # none at all: DIR is ignored by an enclosing repository (a dotfiles '*'); read DIR alone
            return files
    with tempfile.TemporaryDirectory(prefix="xc-gitdir-") as scratch:
        made = _git("init", "-q", "--bare", scratch)
        if made is None or made.returncode != 0:
            return None
        res = _git(f"--git-dir={scratch}", f"--work-tree={root}", "-C", str(root), *listing)
        return _split(res) if res is not None and res.returncode == 0 else None


def _split(res: subprocess.CompletedProcess) -> list[str]:
    return [p for p in res.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _plain_listing(root: Path) -> list[str]:
    """Without git: walk DIR, each folder's .gitignore applying below it; an ignored folder is not entered."""
    out: list[str] = []

    def walk(folder: Path, rules: list) -> None:
        rel_folder = folder.relative_to(root).as_posix()
        rules = rules + _rules(folder / ".gitignore", "" if rel_folder == "." else rel_folder + "/")
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            rel = Path(entry.path).relative_to(root).as_posix()
            is_dir = entry.is_dir(follow_symlinks=False)
            if entry.name in NEVER or _ignored(rel, is_dir, rules):
                continue
            if is_dir:
                walk(Path(entry.path), rules)
            elif entry.is_file():
                out.append(rel)

    walk(root, [])
    return out


def _rules(gitignore: Path, base: str) -> list[tuple]:
    """(base, regex, negate, dir_only, anchored) for each pattern of one .gitignore."""
    try:
        lines = gitignore.read_text(errors="replace").splitlines()
    except OSError:
        return []
    rules = []
    for line in lines:
        line = line.rstrip() if not line.endswith("\\ ") else line
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:] if negate else line.removeprefix("\\")
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        rules.append((base, re.compile(_glob(line.lstrip("/")) + r"\Z"), negate, dir_only, anchored))
    return rules


def _glob(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i + 1] if pattern[i] == "\\" and i + 1 < len(pattern) else pattern[i]))
            i += 2 if pattern[i] == "\\" else 1
    return "".join(out)


def _ignored(rel: str, is_dir: bool, rules: list) -> bool:
    ignored = False
    for base, regex, negate, dir_only, anchored in rules:  # the last rule that matches decides
        if (dir_only and not is_dir) or not rel.startswith(base):
            continue
        sub = rel[len(base):]
        if regex.match(sub if anchored else sub.rsplit("/", 1)[-1]):
            ignored = not negate
    return ignored


# ---- the request's own code ----------------------------------------------------------------------------

def scan(path: str) -> Workdir:
    """DIR checked: a folder, within the size limit (one line naming the biggest files and the fix)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder"
        raise ClusterError(f"--workdir {path} {what}", fix="pass the folder of your project")
    limit = limit_mb()
    wd = Workdir(root.resolve(), path, list_files(root))
    if wd.size > limit * MiB:
        big = sorted(wd.files, key=lambda f: (wd.root / f).stat().st_size, reverse=True)[:3]
        names = ", ".join(f"{f} {_size((wd.root / f).stat().st_size)}" for f in big)
        raise ClusterError(f"--workdir {path} holds {_size(wd.size)} in {len(wd.files)} file(s) (limit {limit} MiB, "
                           f"largest: {names})", fix=f"add large files to .gitignore or raise the limit with "
                           f"{LIMIT_ENV}={-(-wd.size // MiB)}")
    return wd


def module_file(wd: Workdir, module: str) -> str | None:
    """The shipped file `python -m module` runs from DIR: a/b.py or a/b/__main__.py."""
    base = module.replace(".", "/")
    return next((f for f in (f"{base}.py", f"{base}/__main__.py") if f in wd.files), None)


def check(workdir: str | None, script: str | None, module: str | None, launcher: str, bundled: bool,
          scanned: Workdir | None = None) -> Workdir | None:
    """Every own-code flag before anything starts; returns DIR scanned (None without --workdir). `scanned`: DIR as
    the run's snapshot in the store holds it, checked instead of the folder as it is now."""
    if launcher not in LAUNCHERS:
        raise ClusterError(f"--launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}", fix="pass one of them")
    if bundled and (workdir or module or launcher != "python"):
        flag = "--workdir" if workdir else "--module" if module else "--launcher accelerate"
        raise ClusterError(f"{flag} is for your own code, not a bundled job", fix="pass --script FILE or --module NAME "
                           "(or drop it)")
    if module is not None and not _MODULE.match(module):
        raise ClusterError(f"--module {module!r} is not a dotted module name", fix="pass e.g. --module mypkg.train")
    if module and not workdir:
        raise ClusterError(f"--module {module} runs a module of your project", fix="pass its folder with --workdir DIR "
                           "(or --script FILE for a single file)")
    if not workdir:
        return None
    wd = scanned or scan(workdir)
    if module:
        if module_file(wd, module) is None:
            base = module.replace(".", "/")
            raise ClusterError(f"--module {module}: neither {base}.py nor {base}/__main__.py is among the files "
                               f"--workdir {workdir} ships", fix="pass a module inside it (a .gitignore'd file is not "
                               "shipped)")
        return wd
    if not script:
        raise ClusterError(f"--workdir {workdir} needs what to run in it", fix="pass --script FILE (relative to it) or "
                           "--module NAME")
    target = (wd.root / script).resolve()
    if wd.root not in target.parents:
        raise ClusterError(f"--script {script} is outside --workdir {workdir}", fix="pass a path relative to it, e.g. "
                           "--script train.py")
    if relative_script(wd, script) not in wd.files:
        if target.is_file() and scanned is None:
            raise ClusterError(f"--script {script} is in --workdir {workdir} but .gitignore leaves it out, so it is "
                               "not shipped", fix="un-ignore it or pass another file")
        raise ClusterError(f"--script {script} does not exist in --workdir {workdir}", fix="pass a file of your project "
                           "relative to it")
    return wd


def relative_script(wd: Workdir, script: str) -> str:
    """--script as a path inside DIR (it may be given relative to DIR or as an absolute path into it)."""
    return (wd.root / script).resolve().relative_to(wd.root).as_posix()


# ---- on a node --------------------------------------------------------------------------------------

def ensure(conn, home: str, wd: Workdir, work: str) -> bool:
    """DIR under <home>/workdirs/<digest> unless there, then the run's own copy at `work`; True if it was sent."""
    base = f"{home}/workdirs"
    dest = f"{base}/{wd.digest}"
    q, qb = shlex.quote(dest), shlex.quote(base)
    sent = not run(conn, f"test -f {q}.complete").ok
    if sent:
        tmp = f"{base}/.{wd.digest}.tar.gz"
        run(conn, f"mkdir -p {qb}")
        conn.put(wd.tarball(), tmp)
        res = run(conn, f"rm -rf {q}.part && mkdir -p {q}.part && tar -xzf {shlex.quote(tmp)} -C {q}.part && "
                        f"rm -f {shlex.quote(tmp)} && rm -rf {q} && mv {q}.part {q} && touch {q}.complete")
        if not res.ok:
            raise ClusterError(f"{conn.host}: could not unpack --workdir {wd.label}: {res.stderr.strip()[-300:]}")
    qw = shlex.quote(work)
    res = run(conn, f"rm -rf {qw} && (cp -a --reflink=auto {q} {qw} 2>/dev/null || (rm -rf {qw} && cp -a {q} {qw}))")
    if not res.ok:
        raise ClusterError(f"{conn.host}: could not copy --workdir {wd.label} to {work}: {res.stderr.strip()[-300:]}")
    return sent


def which_got(names: list[str], got_it: list[bool]) -> tuple[list[str], str]:
    """The nodes that got something now, and '; already on ...' for the others (empty when all got it)."""
    got = [n for n, g in zip(names, got_it) if g]
    rest = f"; already on {', '.join(n for n in names if n not in got)}" if got and len(got) < len(names) else ""
    return got, rest


def shipped_line(wd: Workdir, names: list[str], sent: list[bool]) -> str:
    got, rest = which_got(names, sent)
    if not got:
        return f"workdir {wd.digest} already on every node (unchanged: nothing sent)"
    return f"workdir {wd.digest} sent to {', '.join(got)} ({_size(os.path.getsize(wd.tarball()))} compressed){rest}"
