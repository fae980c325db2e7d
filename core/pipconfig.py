"""pip's own configuration as uv's flags, so that `make venv` can install with uv from the same places.

uv reads neither pip.conf nor PIP_* variables. `pip config list` shows both (files as `global.key=...`,
variables as `:env:.key=...`); the keys that say where packages come from become uv flags, the rest (cert,
timeout) uv takes from the environment (SSL_CERT_FILE) or does not need. pip picks the best version across all
its indexes; `--index-strategy unsafe-best-match` makes uv do the same instead of stopping at the first index
that has the package.

    .venv/bin/python -m core.pipconfig     # prints the flags, one line
"""
from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "no-index": "--no-index"}


def uv_flags(config_list: str) -> list[str]:
    """Flags for `uv pip install` from `pip config list`'s output. A variable overrides the files' value of the
    same key, as it does for pip; a list value (space-separated) gives one flag per item."""
    rank = {"global": 0, "install": 1, ":env:": 2}  # pip's own order: [install] over [global], variables over both
    values: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        where, _, rest = line.partition(".")
        key, sep, value = rest.partition("=")
        if not sep or key not in FLAGS or where not in rank:
            continue
        if key not in values or rank[where] >= values[key][0]:
            values[key] = (rank[where], value.strip().strip("'\""))
    flags = ["--index-strategy", "unsafe-best-match"]
    for key, (_, value) in values.items():
        if key == "no-index":
            if value.lower() in ("1", "true", "yes", "on"):
                flags.append(FLAGS[key])
            continue
        for item in value.split():
            flags += [FLAGS[key], item]
    return flags


def main() -> int:
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          check=False)
    print(shlex.join(uv_flags(done.stdout if done.returncode == 0 else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
