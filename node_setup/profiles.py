"""Named, pinned software profiles (node_setup/profiles.toml) and the node setup script made from them.

A profile is a matched set: torch, the packages built against it, the HF libraries the jobs are
tested with and Intel MPI, each from a named source. ``render_setup_script`` turns one into the
bash script that ``fab setup`` runs over SSH and the Image Builder component bakes into the AMI,
so both are the same text by construction.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from core.constants import REMOTE_VENV
from core.errors import ClusterError
from core.render import render

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

log = logging.getLogger(__name__)

PROFILES_FILE = Path(__file__).with_name("profiles.toml")
SETUP_TEMPLATE = "node_setup.sh.j2"
MARKER_NAME = ".xeon-cluster-profile"
DEFAULT_VENV = REMOTE_VENV
WORK_ROOT_PREFIX = "$XC_HOME/"
PYPI = "pypi"
# The profile nodes get when nobody names one (the Pulumi stack's `profile` default, `fab setup` off the local
# cluster): the stack `make test` runs (torch 2.13 CPU, transformers 5, gloo). `oneccl` stays for the seeds'
# exact stack, end-of-life upstream (Intel, 2025-10-10: intel-extension-for-pytorch issue #867, torch-ccl
# issue #80; IPEX's repository archived 2026-03-30) and only built here, never run.
DEFAULT_PROFILE = "upstream"
BACKENDS = ("ccl", "gloo")
PRECISIONS = ("ipex-bf16", "autocast-bf16", "fp32")
# Binary extensions of torch: a build for another torch major.minor fails at import or,
# worse, hangs in the first collective. Normalized names.
TORCH_BOUND = ("intel-extension-for-pytorch", "oneccl-bind-pt")

_PROFILE_KEYS = {"description", "backend", "precision", "python_min", "venv", "system_packages",
                 "extra_index_urls", "packages"}
_PACKAGE_KEYS = {"version", "source", "eol", "git", "commit", "module", "build_env"}
GIT = "git"  # source of a package built on the node from a pinned commit, against the venv's torch
# accelerate releases checked to adopt the process group dist.setup() made when ddp_backend is None
# (1.10.1 by reading PartialState, 1.15.0 by running --backend ccl): ccl profiles pin one of these or newer.
CCL_ACCELERATE_MIN = (1, 10)
_BUILD_ENV_VALUE = re.compile(r"^[A-Za-z0-9_./:$-]*$")
# An exact version: no specifier operators, wildcards or spaces.
_EXACT_VERSION = re.compile(r"^[0-9][0-9A-Za-z.!+_-]*$")


def normalize(name: str) -> str:
    """PEP 503 name: ``intel_extension_for_pytorch`` and ``Intel-Extension-For-PyTorch`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def major_minor(version: str) -> str:
    """'2.7.1+cpu' -> '2.7'."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def same_version(installed: str, pinned: str) -> bool:
    """A pin with a local label ('+cpu') must match exactly; without one, the public part must."""
    if "+" in pinned:
        return installed == pinned
    return installed.split("+", 1)[0] == pinned


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    source: str = PYPI  # "pypi", the URL of the index that serves it, or "git" (built on the node)
    eol: str | None = None
    git: str | None = None  # source "git": the repository, the full commit, the module to import after
    commit: str | None = None
    module: str | None = None
    build_env: tuple[tuple[str, str], ...] = ()  # variables of the build; "$VENV" is the profile's venv

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    backend: str
    precision: str
    python_min: str
    venv: str
    system_packages: tuple[str, ...]
    extra_index_urls: tuple[str, ...]
    packages: tuple[Package, ...]

    @property
    def hash(self) -> str:
        """Short sha256 of what gets installed. Descriptions and eol notes stay out of it so that
        rewording them does not make every node reinstall."""
        content = {
            "python_min": self.python_min,
            "system_packages": sorted(self.system_packages),
            "extra_index_urls": sorted(self.extra_index_urls),
            "packages": sorted([normalize(p.name), p.version, p.source]
                               + ([p.git, p.commit, sorted(p.build_env)] if p.source == GIT else [])
                               for p in self.packages),
        }
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]

    def version_of(self, name: str) -> str | None:
        for p in self.packages:
            if normalize(p.name) == normalize(name):
                return p.version
        return None

    @property
    def built_here(self) -> tuple[str, ...]:
        return tuple(pkg.name for pkg in self.packages if pkg.source == GIT)

    @property
    def eol_notes(self) -> list[str]:
        return [f"{p.name} {p.version}: {p.eol}" for p in self.packages if p.eol]


def torch_bound_mismatches(versions: dict[str, str], built_here: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(package, its version, torch version) for each torch extension built for another torch major.minor.
    Packages in ``built_here`` were compiled on the node against its torch: their version says nothing."""
    by_name = {normalize(k): (k, v) for k, v in versions.items()}
    if "torch" not in by_name:
        return []
    torch_version = by_name["torch"][1]
    skip = {normalize(n) for n in built_here}
    bound = [by_name[key] for key in TORCH_BOUND if key in by_name and key not in skip]
    return [(name, version, torch_version) for name, version in bound
            if major_minor(version) != major_minor(torch_version)]


def _parse(name: str, raw: dict, where: Path) -> Profile:
    def bad(what: str, fix: str) -> ClusterError:
        return ClusterError(f"profile {name!r} in {where}: {what}", fix=f"{fix}")

    unknown = set(raw) - _PROFILE_KEYS
    if unknown:
        raise bad(f"unknown key(s) {', '.join(sorted(unknown))}", f"use only {', '.join(sorted(_PROFILE_KEYS))}")
    missing = _PROFILE_KEYS - {"venv"} - set(raw)
    if missing:
        raise bad(f"missing key(s) {', '.join(sorted(missing))}", "add them (see the comment at the top of the file)")
    packages = []
    for pkg, spec in raw["packages"].items():
        if set(spec) - _PACKAGE_KEYS or "version" not in spec:
            raise bad(f"package {pkg} has keys {sorted(spec)}", "give it version (and source, eol)")
        build_env = spec.get("build_env", {})
        packages.append(Package(pkg, str(spec["version"]), spec.get("source", PYPI), spec.get("eol"),
                                spec.get("git"), spec.get("commit"), spec.get("module"),
                                tuple(sorted((str(k), str(v)) for k, v in build_env.items()))))
    profile = Profile(
        name=name,
        description=raw["description"],
        backend=raw["backend"],
        precision=raw["precision"],
        python_min=str(raw["python_min"]),
        venv=raw.get("venv", DEFAULT_VENV),
        system_packages=tuple(raw["system_packages"]),
        extra_index_urls=tuple(raw["extra_index_urls"]),
        packages=tuple(packages),
    )
    problems = profile_problems(profile)
    if problems:
        raise bad(*problems[0])
    return profile


def profile_problems(p: Profile) -> list[tuple[str, str]]:
    """The rules a profile itself must keep, as (what is wrong, how to fix it)."""
    problems = []
    if p.backend not in BACKENDS:
        problems.append((f"backend {p.backend!r} is not one of {', '.join(BACKENDS)}", "pick one of them"))
    if p.precision not in PRECISIONS:
        problems.append((f"precision {p.precision!r} is not one of {', '.join(PRECISIONS)}", "pick one of them"))
    if not re.fullmatch(r"\d+\.\d+", p.python_min):
        problems.append((f"python_min {p.python_min!r} is not MAJOR.MINOR", "write it like \"3.11\""))
    for pkg in p.packages:
        if pkg.source == GIT:
            if not (pkg.git and pkg.git.startswith("https://") and re.fullmatch(r"[0-9a-f]{40}", pkg.commit or "")
                    and pkg.module and pkg.module.isidentifier()):
                problems.append(((f"{pkg.name} is built from git but lacks an https git URL, a full 40-hex commit "
                                 "or the module to import"), "give git, commit and module"))
            bad_env = [k for k, v in pkg.build_env if not (k.isidentifier() and _BUILD_ENV_VALUE.match(v))]
            if bad_env:
                problems.append((f"{pkg.name} build_env {bad_env} has names or values the script cannot quote",
                                 "use NAME = \"letters, digits, _ . / : - and $VENV\""))
            continue
        if not _EXACT_VERSION.match(pkg.version):
            problems.append((f"{pkg.name} version {pkg.version!r} is not an exact pin",
                             "pin one release; profiles are matched sets"))
        if pkg.source not in (PYPI, GIT) and pkg.source not in p.extra_index_urls:
            problems.append((f"{pkg.name} comes from {pkg.source} which is not in extra_index_urls",
                             "add the URL to extra_index_urls"))
    unused = set(p.extra_index_urls) - {pkg.source for pkg in p.packages}
    if unused:
        # Every extra index is a place a package could be hijacked from: keep only the needed ones.
        problems.append((f"extra_index_urls {sorted(unused)} serve no package", "remove them"))
    names = {normalize(pkg.name) for pkg in p.packages}
    if p.backend == "ccl" and "oneccl-bind-pt" not in names:
        problems.append(("backend 'ccl' without oneccl_bind_pt", "add oneccl_bind_pt or use backend 'gloo'"))
    if p.precision == "ipex-bf16" and "intel-extension-for-pytorch" not in names:
        problems.append(("precision 'ipex-bf16' without intel_extension_for_pytorch",
                         "add it or use precision 'autocast-bf16'"))
    if p.backend == "ccl":
        acc = p.version_of("accelerate")
        if acc is None or tuple(int(x) for x in re.findall(r"\d+", acc)[:2]) < CCL_ACCELERATE_MIN:
            problems.append(((f"backend 'ccl' with accelerate {acc or 'unpinned'}: the releases checked to adopt the "
                             f"jobs' ccl process group are {'.'.join(map(str, CCL_ACCELERATE_MIN))} and newer"),
                             "pin accelerate 1.10.1 or newer"))
    for name, version, torch_version in torch_bound_mismatches({pkg.name: pkg.version for pkg in p.packages},
                                                               p.built_here):
        what = f"{name} {version} is built for torch {major_minor(version)}.* but torch is pinned {torch_version}"
        problems.append((what, "pin both from the same release line"))
    return problems


def load_profiles(path: Path | str | None = None) -> dict[str, Profile]:
    """Every profile of ``path`` (default: node_setup/profiles.toml), validated."""
    where = Path(path) if path else PROFILES_FILE
    try:
        data = tomllib.loads(where.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ClusterError(f"{where}: cannot read the profiles ({exc})", fix="restore the file from git") from exc
    return {name: _parse(name, raw, where) for name, raw in data.get("profiles", {}).items()}


def load_profile(name: str, path: Path | str | None = None) -> Profile:
    profiles = load_profiles(path)
    if name not in profiles:
        raise ClusterError(f"unknown profile {name!r}: the profiles are {', '.join(sorted(profiles))}", fix=
                           "pass one of them with --profile")
    return profiles[name]


def _resolve(profile: str | Profile) -> Profile:
    return profile if isinstance(profile, Profile) else load_profile(profile)


def pip_requirements(profile: str | Profile) -> list[str]:
    return [p.requirement for p in _resolve(profile).packages if p.source != GIT]


def venv_shell_word(venv: str) -> str:
    """The venv path as one bash word: '~/x' becomes "$HOME"/x and '$XC_HOME/x' the node's own work root
    (local-cluster nodes share one filesystem and each has its own $XC_HOME), both expanded on the node."""
    in_work_root = venv.startswith(WORK_ROOT_PREFIX)
    in_home = in_work_root or venv.startswith("~/")
    rest = venv.removeprefix(WORK_ROOT_PREFIX) if in_work_root else venv.removeprefix("~/")
    parts = PurePosixPath(rest).parts
    # The script empties this directory (venv --clear): refuse '/', '/opt', relative and '..' paths.
    dedicated = in_home or venv.startswith("/")
    dedicated = dedicated and ".." not in parts and len(parts) >= (1 if in_home else 3)
    if not dedicated or any(ord(c) < 32 for c in venv):
        raise ClusterError(f"venv path {venv!r} is not a dedicated directory", fix="use an absolute path at least two "
                           "levels deep (or ~/something), e.g. /opt/xeon-cluster/venv")
    if in_work_root:
        return '"${XC_HOME:?is not set: this venv path is for local-cluster nodes}"/' + shlex.quote(rest)
    if in_home:
        return '"$HOME"/' + shlex.quote(rest)
    return shlex.quote(venv)


def render_setup_script(profile: str | Profile, venv: str | None = None) -> str:
    """The node setup script for ``profile``; ``venv`` overrides the profile's venv path."""
    p = _resolve(profile)
    venv = venv or p.venv
    script = render(SETUP_TEMPLATE,
        profile=p.name,
        hash=p.hash,
        venv=venv_shell_word(venv),
        marker=MARKER_NAME,
        python_min=p.python_min,
        python_min_tuple=", ".join(p.python_min.split(".")),
        system_packages=list(p.system_packages),
        extra_index_urls=list(p.extra_index_urls),
        requirements=pip_requirements(p),
        source_builds=[pkg for pkg in p.packages if pkg.source == GIT],
        eol_notes=p.eol_notes,
    )
    log.debug("rendered setup script for profile %s (hash %s, venv %s)", p.name, p.hash, venv)
    return script


def matched_set_problems(profile: str | Profile, installed: dict[str, str]) -> list[str]:
    """One line per installed version that breaks the profile's matched set; [] when it holds."""
    p = _resolve(profile)
    have = {normalize(k): v for k, v in installed.items()}
    fix = f"run 'fab setup --profile {p.name}'"
    problems = []
    for pkg in p.packages:
        version = have.get(normalize(pkg.name))
        if version is None:
            problems.append(f"{pkg.name} is not installed but profile {p.name} pins {pkg.version}; {fix}")
        elif not same_version(version, pkg.version):
            problems.append(f"{pkg.name} {version} is installed but profile {p.name} pins {pkg.version}; {fix}")
    for name, version, torch_version in torch_bound_mismatches(installed, p.built_here):
        problems.append(f"{name} {version} needs torch {major_minor(version)}.* but torch {torch_version} is "
                        f"installed, so it fails at import or hangs in collectives; {fix}")
    return problems
