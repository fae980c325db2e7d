"""A run's own packages on a node: the wheels fab put in the store for a requirements file, installed with pip
from there alone into the run's layer (a folder on the ranks' PYTHONPATH, after the project's code, before the
venv's site-packages).

The store keeps them as ``wheels/<key>/``: the wheels, the requirements they were resolved from, and
``wheels.json`` (the wheels' names and the nodes' platform), written last: a folder without it is incomplete.
The key is a hash of the requirements and the nodes' platform (launch/staging/requirements.py makes it), so the
same requirements go to the store once however many runs use them.

On a node, at staging (fab runs it over SSH with the ranks' environment: XC_STORE, XC_S3_ENDPOINT_URL and
credentials as the ranks get them):

    python -m training.runtime.pylayer KEY LAYER CACHE

A file store shares the disk: its folder is read as it is. From S3 the wheels come once per node into
CACHE/<key>/ (a replacement node gets them from the store, never from the internet). Then
``pip install --no-index --no-deps --target LAYER`` those wheels: the set is complete (fab resolved it), and the
venv's own packages (torch, transformers) are never touched.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from training.runtime import store as store_lib

WHEELS = "wheels"  # the store's folder of requirement wheels, one folder per key
MANIFEST = "wheels.json"  # written last: {"wheels": [file names], "platform": ..., "requirements": [...]}
REQUIREMENTS = "requirements.txt"  # the resolved requirements, for a reader of the store

# What fab asks node 0 before it downloads (sent as `python -c`, the node may not have this code yet): its Python and
# platform as packaging's environment markers name them, glibc, installed packages and its venv's profile marker.
PROBE_PY = r"""
import json, os, platform, sys
from importlib import metadata
iv = sys.implementation.version
ver = "%d.%d.%d" % (iv.major, iv.minor, iv.micro)
if iv.releaselevel != "final":
    ver += iv.releaselevel[0] + str(iv.serial)
env = {"implementation_name": sys.implementation.name, "implementation_version": ver, "os_name": os.name,
       "platform_machine": platform.machine(), "platform_release": platform.release(),
       "platform_system": platform.system(), "platform_version": platform.version(),
       "python_full_version": platform.python_version(),
       "platform_python_implementation": platform.python_implementation(),
       "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}
dists = {}
for d in metadata.distributions():
    name = d.metadata["Name"]
    if name:
        dists[name] = d.version
try:
    marker = open(os.path.join(sys.prefix, sys.argv[1])).read().strip()
except OSError:
    marker = ""
print(json.dumps({"env": env, "glibc": platform.libc_ver()[1] if platform.libc_ver()[0] == "glibc" else "",
                  "cache_tag": sys.implementation.cache_tag, "dists": dists, "marker": marker}))
"""


def prefix(key: str) -> str:
    return f"{WHEELS}/{key}"


def manifest(store, key: str) -> dict | None:
    """The key's manifest in the store, or None while the wheels are not all there."""
    data = store.get_bytes(f"{prefix(key)}/{MANIFEST}")
    return json.loads(data) if data else None


def fetch(url: str, key: str, cache: Path) -> tuple[Path, list[str]]:
    """The folder holding the key's wheels on this node, and their names; downloaded into cache/<key> unless
    there (or a file store's own folder). Raises StoreError."""
    store = store_lib.open_store(url)
    if isinstance(store, store_lib.FileStore):
        folder = store.path(prefix(key))
        found = manifest(store, key)
    else:
        folder = Path(cache) / key
        found = _read(folder / MANIFEST)
        if found is None:
            try:
                found = manifest(store, key)
                if found is not None:
                    partial = folder.with_name(f".{key}.{uuid.uuid4().hex[:8]}.partial")
                    store_lib.download_tree(store, prefix(key), partial)
                    shutil.rmtree(folder, ignore_errors=True)
                    try:
                        partial.rename(folder)
                    except OSError:  # another run on this node put it there first
                        shutil.rmtree(partial, ignore_errors=True)
            except Exception as exc:  # noqa: BLE001 - one line naming the fix
                raise store_lib.explain(exc, url) from None
    if found is None:
        raise store_lib.StoreError(f"the requirements' wheels {prefix(key)} are not in the store {url}",
                                   fix="start the run again with 'fab train' (it puts them there)")
    return folder, list(found["wheels"])


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def install(url: str, key: str, layer: Path, cache: Path) -> int:
    """The key's wheels into `layer`, fresh; returns how many. Raises StoreError, or RuntimeError from pip."""
    folder, wheels = fetch(url, key, cache)
    shutil.rmtree(layer, ignore_errors=True)
    layer.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(layer),
           "--disable-pip-version-check", "--no-warn-script-location", "--quiet", *(str(folder / w) for w in wheels)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
        raise RuntimeError(f"pip could not install the requirements' wheels: {lines[-1] if lines else res.returncode}")
    return len(wheels)


def main(argv: list[str]) -> int:
    key, layer, cache = argv
    url = store_lib.store_url()
    if not url:
        print("error: no store (XC_STORE) to take the requirements' wheels from", file=sys.stderr)
        return 2
    try:
        n = install(url, key, Path(layer), Path(cache))
    except (store_lib.StoreError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{n} package(s) installed in {layer}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
