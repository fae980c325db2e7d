"""core/pipconfig.py: pip's configuration as uv's flags (make venv installs the project's packages with uv)."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from core import pipconfig

ROOT = Path(__file__).resolve().parents[2]

LISTED = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/srv/other'
global.index-url='https://mirror.example/simple'
install.index-url='https://install-section.example/simple'
"""


def test_where_packages_come_from_becomes_uv_flags_and_the_rest_is_left_out():
    flags = pipconfig.uv_flags(LISTED)
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"]  # pip's best version across every index
    pairs = list(zip(flags[2::2], flags[3::2]))
    assert ("--find-links", "/opt/wheels") in pairs and ("--find-links", "/srv/other") not in pairs  # env wins
    assert ("--index-url", "https://install-section.example/simple") in pairs  # [install] over [global]
    assert ("--extra-index-url", "file:///opt/a/simple") in pairs and ("--extra-index-url", "file:///opt/b/simple") in pairs
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert not any("cert" in f or "timeout" in f for f in flags)


def test_no_index_and_an_empty_configuration():
    assert pipconfig.uv_flags(":env:.no-index='true'\n")[2:] == ["--no-index"]
    assert pipconfig.uv_flags(":env:.no-index='0'\n")[2:] == []
    assert pipconfig.uv_flags("") == ["--index-strategy", "unsafe-best-match"]


def test_the_module_prints_one_shell_line_of_this_pips_configuration():
    done = subprocess.run([sys.executable, "-m", "core.pipconfig"], cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=60)
    assert shlex.split(done.stdout)[:2] == ["--index-strategy", "unsafe-best-match"]
    assert len(done.stdout.splitlines()) == 1
