"""A line filter for a detached run's log on node 0: the values in secrets.env become ***.

    mpirun ... 2>&1 | python redact.py secrets.env > mpirun.log

It reads the values once at start (the file is removed when the run ends) and never prints them.
"""
from __future__ import annotations

import shlex
import sys

MIN_REDACT = 4  # as launch.staging.secrets: shorter values would blank out ordinary text


def secret_values(path: str) -> list[str]:
    values = []
    try:
        with open(path) as f:
            for line in f:
                words = shlex.split(line)
                if len(words) == 2 and words[0] == "export" and "=" in words[1]:
                    values.append(words[1].split("=", 1)[1])
    except OSError:
        pass
    return sorted((v for v in values if len(v) >= MIN_REDACT), key=len, reverse=True)


def main() -> None:
    values = secret_values(sys.argv[1]) if len(sys.argv) > 1 else []
    for line in sys.stdin:
        for value in values:
            line = line.replace(value, "***")
        sys.stdout.write(line)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
