"""The AWS twin's image: the venv a baked AMI holds at /opt/xeon-cluster/venv, built from the node profile's own package
list (node_setup/profiles.toml), not this machine's venv. The twin's nodes and head run it, so a package the image
lacks (the head's supervisor once imported fabric, which no profile held) fails on the twin as it would on AWS.

Built once per profile hash under ~/.cache/xeon-cluster/twin-venvs/, with uv where the project's venv has it (from
uv's cache: seconds) else with pip, from the indexes pip is configured with (core/pipconfig.py).
"""
from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from core.constants import PROJECT_ROOT
from core.errors import ClusterError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (pyproject installs tomli there)
    import tomli as tomllib

MARKER = ".xc-twin-image"


def cache_root() -> Path:
    return Path.home() / ".cache" / "xeon-cluster" / "twin-venvs"


def requirements(profile_name: str, path: Path = PROJECT_ROOT / "node_setup" / "profiles.toml") -> list[str]:
    """The profile's pins as node_setup/profiles.toml lists them (read here: the twin is below node_setup's code)."""
    packages = tomllib.loads(path.read_text())["profiles"][profile_name]["packages"]
    built = [name for name, spec in packages.items() if spec.get("source") == "git"]
    if built:
        raise ClusterError(f"the AWS twin cannot build profile {profile_name}'s image: {', '.join(built)} is built "
                           "from source on the node", fix="use profile upstream on the twin")
    return [f"{name}=={spec['version']}" for name, spec in packages.items()]


def venv(profile_name: str, say=print) -> Path:
    """The image's venv for the profile: built if missing (a lock keeps two builders apart), else as it is."""
    pins = requirements(profile_name)
    digest = hashlib.sha256("\n".join(["pip seeded", *sorted(pins)]).encode()).hexdigest()[:16]
    where = cache_root() / f"{profile_name}-{digest}"
    if (where / MARKER).is_file():
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / MARKER).is_file():
            say(f"twin image: building profile {profile_name}'s venv from its package list ({where})")
            _build(where, pins)
    return where


def _build(where: Path, pins: list[str]) -> None:
    shutil.rmtree(where, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    uv = Path(sys.executable).parent / "uv"
    flags = subprocess.run([sys.executable, "-m", "core.pipconfig"], capture_output=True, text=True, check=False,
                           cwd=Path(__file__).resolve().parent.parent).stdout.split()
    if uv.is_file():
        # --seed: pip in the venv, as python3 -m venv makes it on a baked node (a run's requirements install with it)
        steps = [[str(uv), "venv", "-q", "--seed", str(where), "--python", base],
                 [str(uv), "pip", "install", "-q", "--python", str(where / "bin" / "python"), *flags, *pins]]
    else:
        steps = [[base, "-m", "venv", str(where)], [str(where / "bin" / "pip"), "install", "-q", *pins]]
    for step in steps:
        res = subprocess.run(step, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            shutil.rmtree(where, ignore_errors=True)
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ClusterError(f"the AWS twin could not build its image's venv: {tail[0]}",
                               fix="check that pip's configured index serves the profile's pins "
                                   "(node_setup/profiles.toml)")
    (where / MARKER).write_text(" ".join(pins) + "\n")
