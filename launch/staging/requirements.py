"""`fab train`'s requirements: packages your code needs beyond the nodes' profile, from the store.

- Which file: `--requirements FILE`, else `requirements.txt` at the top of `--workdir`. Read here, at `fab train`
  time, with `packaging`: requirement lines, `-r OTHER` includes and `--hash` options (ignored); any other pip
  option, a direct reference (`name @ URL`) or a bad line is refused in one line.
- What wins: the nodes' torch and transformers. A requirement (or a requirement's own dependency) that excludes
  the version the nodes have is refused in one line naming both versions, before anything starts. The nodes'
  versions: those of their profile (node_setup/profiles.toml) when node 0's venv carries a profile's marker, else
  what node 0's venv has installed (the local cluster's nodes run this machine's venv).
- What is downloaded: what the nodes lack. Node 0 tells its Python, platform (glibc, machine) and installed
  packages; fab resolves the requirements with `pip download --only-binary=:all: --no-deps` for that platform,
  one level of dependencies at a time, leaving out every package the nodes already have in a fitting version.
  A requirement with no wheel for the nodes (only a source archive) is refused in one line: the nodes never build.
- Where: the store's `wheels/<key>/` (training/runtime/pylayer.py), the key a hash of the requirements, the nodes'
  platform and packages; put there once per key. The run records the key; every node installs from the store at
  staging (`install` below), so a restart or a replacement node needs neither this machine nor the internet.
"""
from __future__ import annotations

import email.parser
import hashlib
import json
import logging
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from cluster.remote import connect, run
from cluster.store import PUBLIC_ENV
from core.errors import ClusterError
from node_setup import profiles
from training.runtime import pylayer
from training.runtime import store as store_lib

log = logging.getLogger(__name__)

FILE = "requirements.txt"
WIN = ("torch", "transformers")  # the nodes' own: a requirement never changes them
FIX_PIN = "remove the pin (the profile's torch and transformers win)"
IGNORED_OPTIONS = ("--hash",)
_COMMENT = re.compile(r"(^|\s)#.*$")
_NOT_FOUND = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")


@dataclass(frozen=True)
class Line:
    req: Requirement
    where: str  # "requirements.txt line 3"


# ---- the file ----------------------------------------------------------------------------------------------

def find(requirements: str | None, workdir: str | None) -> Path | None:
    """--requirements FILE (it must exist), else DIR/requirements.txt when there, else None."""
    if requirements:
        path = Path(requirements).expanduser()
        if not path.is_file():
            raise ClusterError(f"--requirements {requirements} does not exist", fix="pass a pip requirements file")
        return path
    if workdir and (Path(workdir) / FILE).is_file():
        return Path(workdir) / FILE
    return None


def parse(path: Path, label: str | None = None, _seen: tuple = ()) -> list[Line]:
    """The requirement lines of `path` (and of the files it includes with -r), in order."""
    label = label or path.name
    if path.resolve() in _seen:
        raise ClusterError(f"{label} includes itself", fix="remove the -r line")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ClusterError(f"cannot read {label}: {exc}", fix="pass a readable text file") from None
    out: list[Line] = []
    for number, line in _logical_lines(text):
        where = f"{label} line {number}"
        first = line.split()[0]
        include = _included(line)
        if include is not None:
            inner = path.parent / include
            if not include or not inner.is_file():
                raise ClusterError(f"{where}: {line} names no file next to it", fix="include a file that exists")
            out += parse(inner, f"{label} -> {inner.name}", (*_seen, path.resolve()))
            continue
        if first.startswith("-"):
            raise ClusterError(f"{where}: the pip option {first} is not read", fix="list package requirements only "
                               "(fab downloads them with this machine's pip configuration)")
        words = [w for w in line.split() if not w.startswith(IGNORED_OPTIONS)]
        try:
            req = Requirement(" ".join(words))
        except InvalidRequirement as exc:
            raise ClusterError(f"{where}: {line!r} is not a requirement ({str(exc).splitlines()[0]})",
                               fix="write one package per line, e.g. tabulate==0.9.0") from None
        if req.url:
            raise ClusterError(f"{where}: {req.name} @ {req.url} is a direct reference",
                               fix="name a released version from pip's index instead")
        out.append(Line(req, where))
    return out


def _included(line: str) -> str | None:
    """The file of a `-r FILE` / `-rFILE` / `--requirement[=]FILE` line ("" when it names none); else None."""
    words = line.split()
    if words[0] in ("-r", "--requirement"):
        return words[1] if len(words) > 1 else ""
    if words[0].startswith("--requirement="):
        return words[0].partition("=")[2]
    if words[0].startswith("-r"):
        return words[0][2:]
    return None


def _logical_lines(text: str):
    """(first line number, line) with comments, blank lines and backslash continuations dealt with."""
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = _COMMENT.sub("", raw).strip()
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        if buf.strip():
            yield start, buf.strip()
        buf = ""
    if buf.strip():
        yield start, buf.strip()


# ---- the nodes' software ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeSoftware:
    """What node 0 runs: the environment markers are evaluated in, its glibc, installed packages (normalized
    names) and the profile its venv was set up with (None: not a profile's venv, e.g. the local cluster's)."""

    env: dict
    glibc: str
    cache_tag: str
    installed: dict = field(default_factory=dict)
    profile: profiles.Profile | None = None
    local: bool = False  # the local cluster: this machine's venv

    @property
    def python(self) -> str:
        return self.env["python_full_version"]

    def has(self, name: str) -> tuple[str | None, str]:
        """(version, who has it) of a package the nodes keep: the profile's pin, else the installed one."""
        name = canonicalize_name(name)
        if self.profile is not None and self.profile.version_of(name):
            return self.profile.version_of(name), f"the nodes' profile {self.profile.name} has"
        who = "the local cluster's nodes (this machine's venv) have" if self.local else "the nodes' venv has"
        return self.installed.get(name), who

    def platforms(self) -> list[str]:
        """pip's --platform tags for the nodes: manylinux for their glibc and every older one."""
        machine = self.env["platform_machine"]
        try:
            major, minor = (int(x) for x in self.glibc.split(".")[:2])
        except ValueError:
            return [f"linux_{machine}"]
        tags = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{machine}" for m, name in legacy.items() if m <= minor]

    def describe(self) -> str:
        return (f"Python {self.python}, {self.env['platform_machine']}"
                + (f", glibc {self.glibc}" if self.glibc else ""))


def node_software(cluster) -> NodeSoftware:
    """Node 0's software, asked over SSH (with its own python, as the ranks run)."""
    node = cluster.nodes[0]
    with connect(node) as conn:
        res = run(conn, f"{shlex.quote(node.python)} -c {shlex.quote(pylayer.PROBE_PY)} {profiles.MARKER_NAME}", timeout=60)
    try:
        facts = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ClusterError(f"{node.name}: could not read its Python's packages: {(res.stderr or res.stdout).strip()[-200:]}",
                           fix="check the node with 'fab doctor'") from None
    return software(facts, cluster.is_local)


def software(facts: dict, local: bool = False) -> NodeSoftware:
    profile = None
    if facts.get("marker"):
        profile = next((p for p in profiles.load_profiles().values() if p.hash == facts["marker"]), None)
    installed = {canonicalize_name(k): v for k, v in facts.get("dists", {}).items()}
    return NodeSoftware(facts["env"], facts.get("glibc", ""), facts.get("cache_tag", ""), installed, profile, local)


# ---- what wins ----------------------------------------------------------------------------------------------

def _fits(version: str | None, spec: SpecifierSet) -> bool:
    try:
        return version is not None and spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_pins(lines: list[Line], sw: NodeSoftware, label: str) -> None:
    """A requirement excluding the nodes' torch or transformers: refused in one line naming both versions."""
    for line in lines:
        name = canonicalize_name(line.req.name)
        if name in WIN and _applies(line.req, sw.env, ""):
            version, who = sw.has(name)
            if version and not _fits(version, line.req.specifier):
                raise ClusterError(f"{label} pins {_shown(line.req)}, but {who} {name} {version}", fix=FIX_PIN)


def _shown(req: Requirement) -> str:
    """name and specifier, as written (without extras and markers)."""
    return f"{req.name}{req.specifier}"


def _applies(req: Requirement, env: dict, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({**env, "extra": extra})


# ---- resolving and downloading -------------------------------------------------------------------------------

def key_of(lines: list[Line], sw: NodeSoftware) -> str:
    """The store key: the requirements, the nodes' platform and their packages (what is left out depends on it)."""
    env = {k: v for k, v in sw.env.items() if k not in ("platform_release", "platform_version")}  # the kernel's
    content = {"requirements": [str(line.req) for line in lines], "env": env, "glibc": sw.glibc,
               "cache_tag": sw.cache_tag, "installed": sorted(sw.installed.items()),
               "profile": sw.profile.hash if sw.profile else None}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"]
    log.debug("requirements: %s", shlex.join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if "No module named pip" in res.stderr:
        raise ClusterError(f"fab's Python ({sys.executable}) has no pip to download the requirements' wheels with",
                           fix=f"run '{sys.executable} -m ensurepip'")
    return res


def _metadata(wheel: Path) -> tuple[str, str, list[Requirement]]:
    """(name, version, Requires-Dist) of a wheel."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(zf.read(meta).decode("utf-8", "replace"))
    return msg["Name"], msg["Version"], [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def resolve(lines: list[Line], sw: NodeSoftware, dest: Path, label: str) -> list[Path]:
    """The wheels the nodes lack, downloaded into dest for their platform, one level of dependencies per `pip
    download`; what cannot be is refused in one line. No backtracking: a later requirement that the version
    chosen for an earlier one does not fit is refused, naming both."""
    asked: dict[str, SpecifierSet] = {}
    first: dict[str, str] = {}  # who asked for a package first
    extras: dict[str, set[str]] = {}
    chosen: dict[str, tuple[str, Path, list[Requirement]]] = {}
    pending = [(line.req, None) for line in lines if _applies(line.req, sw.env, "")]
    while pending:
        batch: dict[str, SpecifierSet] = {}
        after = []
        for req, parent in pending:
            name = canonicalize_name(req.name)
            asked[name] = asked.get(name, SpecifierSet()) & req.specifier
            first.setdefault(name, parent or label)
            new = set(req.extras) - extras.setdefault(name, set())
            extras[name] |= new
            if name in chosen:
                version, _, deps = chosen[name]
                if not _fits(version, asked[name]):
                    raise ClusterError(f"{label}: {parent or 'it'} asks for {name}{req.specifier}, but {name} "
                                       f"{version} was chosen for {first[name]}", fix=f"pin a version of {name} "
                                       "that fits both")
                after += _deps(deps, new, sw, name)
                continue
            have, who = sw.has(name)
            if name in WIN:  # never downloaded: the nodes' own wins, or the requirement is refused
                if have and not _fits(have, asked[name]):
                    asks = f"needs {name}{req.specifier}" if parent else f"pins {name}{req.specifier}"
                    raise ClusterError(f"{label}: {parent} {asks}, but {who} {name} {have}" if parent else
                                       f"{label} {asks}, but {who} {name} {have}", fix=FIX_PIN if not parent else
                                       f"drop {parent} or pick a release of it that works with {name} {have}")
                continue
            if name in batch or not _fits(have, asked[name]):
                batch[name] = asked[name]
        for name, (version, path) in (_download(batch, sw, dest, label) if batch else {}).items():
            deps = _metadata(path)[2]
            chosen[name] = (version, path, deps)
            after += _deps(deps, extras[name] | {""}, sw, name)
        pending = after
    return [path for _, path, _ in chosen.values()]


def _deps(deps: list[Requirement], extras: set[str], sw: NodeSoftware, parent: str) -> list:
    """(requirement, who needs it) for each dependency that applies on the nodes with these extras."""
    return [(dep, parent) for dep in deps if any(_applies(dep, sw.env, extra) for extra in extras)]


def _download(batch: dict[str, SpecifierSet], sw: NodeSoftware, dest: Path, label: str
              ) -> dict[str, tuple[str, Path]]:
    """One `pip download` of the batch for the nodes' platform; name -> (version, wheel)."""
    reqs = [Requirement(f"{name}{spec}") for name, spec in batch.items()]
    before = set(dest.glob("*.whl"))
    impl = {"cpython": "cp", "pypy": "pp"}.get(sw.env["implementation_name"], "py")
    abi = sw.cache_tag.replace("cpython-", "cp").replace("pypy", "pp") if sw.cache_tag else "none"
    args = ["download", "--only-binary=:all:", "--no-deps", "--progress-bar", "off", "-d", str(dest),
            "--python-version", sw.python, "--implementation", impl, "--abi", abi]
    for p in sw.platforms():
        args += ["--platform", p]
    res = _pip(*args, *map(str, reqs))
    if res.returncode != 0:
        raise _refusal(res, reqs, sw, label)
    out = {}
    for path in sorted(set(dest.glob("*.whl")) - before):
        name, version, _, _ = parse_wheel_filename(path.name)
        out[canonicalize_name(name)] = (str(version), path)
    missing = [str(r) for r in reqs if canonicalize_name(r.name) not in out]
    if missing:
        raise ClusterError(f"{label}: pip downloaded no wheel for {', '.join(missing)}", fix="check pip's output with "
                           "'fab -d train ...'")
    return out


def _refusal(res: subprocess.CompletedProcess, reqs: list[Requirement], sw: NodeSoftware, label: str) -> ClusterError:
    """pip download failed: a requirement with only a source archive, one not in the index, or pip's own error."""
    errors = [ln.removeprefix("ERROR: ") for ln in res.stderr.splitlines() if ln.startswith("ERROR:")]
    named = {canonicalize_name(m.group(1)) for e in errors if (m := _NOT_FOUND.match(e))}
    failed = next((r for r in reqs if canonicalize_name(r.name) in named), None)
    if failed is None:
        return ClusterError(f"{label}: pip download failed: {errors[-1] if errors else res.stderr.strip()[-300:]}",
                            fix="check the requirement and pip's configuration on this machine")
    listed = _pip("index", "versions", failed.name, "--json")
    try:
        versions = json.loads(listed.stdout.strip().splitlines()[-1])["versions"] if listed.returncode == 0 else []
    except (ValueError, IndexError, KeyError):
        versions = []
    if any(_fits(v, failed.specifier) for v in versions):
        return ClusterError(f"{label}: {failed} has no wheel for the nodes ({sw.describe()}), only a source archive",
                            fix="the nodes install wheels only: pick a version that publishes one, or drop it")
    return ClusterError(f"{label}: {failed} is not in pip's index", fix="check the name and version (fab downloads "
                        "with this machine's pip configuration)")


# ---- the store ---------------------------------------------------------------------------------------------

def prepare(req, cluster, say):
    """The request with its requirements' wheels in the store (spec.what.pylayer: their key); the request unchanged
    without a requirements file, or for a resume (it keeps its record's). Raises ClusterError before anything
    starts."""
    if req.resume is not None or req.spec.what.pylayer:
        return req
    path = find(req.spec.what.requirements, req.spec.what.workdir)
    if path is None:
        return req
    label = path.name if not req.spec.what.requirements else str(req.spec.what.requirements)
    lines = parse(path, label)
    if not lines:
        return req
    sw = node_software(cluster)
    check_pins(lines, sw, label)
    url = req.store
    if not url:
        raise ClusterError(f"{label}: the nodes install requirements from the cluster's store, and this run has none",
                           fix="pass --store URL")
    key = key_of(lines, sw)
    try:
        store = store_lib.open_store(url)
        there = pylayer.manifest(store, key)
    except Exception as exc:  # noqa: BLE001
        raise _store_error(exc, url) from None
    if there is not None and not there["wheels"]:
        say(f"requirements {label}: every package is already on the nodes")
        return req
    if there is not None:
        say(f"requirements {label}: wheels {key} already in the store ({len(there['wheels'])} package(s); nothing sent)")
        return req.but(pylayer=key)
    with tempfile.TemporaryDirectory(prefix="xc-wheels-") as tmp:
        wheels = resolve(lines, sw, Path(tmp), label)
        body = {"wheels": sorted(w.name for w in wheels), "platform": sw.describe(),
                "requirements": [str(line.req) for line in lines]}
        try:
            for w in wheels:
                store.put_file(w, f"{pylayer.prefix(key)}/{w.name}")
            store.put_bytes(f"{pylayer.prefix(key)}/{pylayer.REQUIREMENTS}",
                            "".join(f"{line.req}\n" for line in lines).encode())
            store.put_bytes(f"{pylayer.prefix(key)}/{pylayer.MANIFEST}", json.dumps(body, indent=2).encode())
        except Exception as exc:  # noqa: BLE001
            raise _store_error(exc, url) from None
        size = sum(w.stat().st_size for w in wheels)
    if not wheels:
        say(f"requirements {label}: every package is already on the nodes")
        return req
    names = ", ".join(parse_wheel_filename(w.name)[0] + " " + str(parse_wheel_filename(w.name)[1]) for w in wheels)
    say(f"requirements {label}: {len(wheels)} wheel(s) for the nodes ({sw.describe()}) put in the store as wheels "
        f"{key}, {size / 1024:.0f} KiB: {names}")
    return req.but(pylayer=key)


def _store_error(exc: BaseException, url: str) -> ClusterError:
    err = store_lib.explain(exc, url)
    return ClusterError(err.what, fix=err.fix)


# ---- on a node ----------------------------------------------------------------------------------------------

def install(conn, python: str, code_dir: str, run_dir: str, home: str, key: str, env: dict[str, str]) -> str:
    """The key's wheels into <run folder>/pylayer on the node, from the store the ranks' environment `env` names
    (with its endpoint, and the credentials of the run's secrets.env where it has one); returns the layer's path.
    Raises ClusterError."""
    layer = f"{run_dir}/pylayer"
    q = shlex.quote
    store_env = " ".join(f"{k}={q(v)}" for k, v in env.items() if k in (store_lib.STORE_ENV, *PUBLIC_ENV))
    command = (f"cd {q(run_dir)} && {{ [ ! -f ./secrets.env ] || . ./secrets.env; }} && env {store_env} "
               f"PYTHONPATH={q(code_dir)} {q(python)} -m training.runtime.pylayer {q(key)} {q(layer)} "
               f"{q(home + '/' + pylayer.WHEELS)}")
    res = run(conn, command, timeout=600)
    if not res.ok:
        why = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
        raise ClusterError(f"{conn.host}: installing the requirements' wheels {key} failed: "
                           f"{why[-1].removeprefix('error: ') if why else res.exited}",
                           fix="start the run again with 'fab train'")
    return layer
