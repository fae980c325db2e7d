"""The fab command line's plumbing: job flags after `--`, one-line errors with their exit code, flag parsing."""
from __future__ import annotations

import functools
import logging
import os
import sys

from fabric.executor import Executor
from invoke.exceptions import Exit

from core.errors import ClusterError


class JobArgsExecutor(Executor):
    """Leaves the text after `--` to the task (Fabric would run it as a shell command on hosts)."""

    def expand_calls(self, calls, apply_hosts=True):
        remainder, self.core.remainder = self.core.remainder, ""
        try:
            return super().expand_calls(calls, apply_hosts)
        finally:
            self.core.remainder = remainder


def job_args() -> list[str]:
    """The argv after the first `--`, quoting intact."""
    argv = sys.argv
    return list(argv[argv.index("--") + 1:]) if "--" in argv else []


def cli(fn):
    """One line and a non-zero exit for errors the user can fix; no traceback."""
    @functools.wraps(fn)
    def wrapper(c, *args, **kwargs):
        logging.basicConfig(level=logging.DEBUG if os.environ.get("XC_DEBUG") else logging.INFO,
                            format="%(message)s", stream=sys.stderr)
        for noisy in ("paramiko", "invoke", "fabric"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        try:
            return fn(c, *args, **kwargs)
        except KeyboardInterrupt:  # before a run's own handler is in place, or in a task without one
            raise Exit("interrupted", code=130) from None
        except ClusterError as exc:
            raise Exit(f"{getattr(exc, 'prefix', 'error: ')}{exc}", code=getattr(exc, "exit_code", 1)) from None
    return wrapper


def as_int(value, flag: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ClusterError(f"{flag} {value!r} is not a whole number") from None


def env_pairs(items) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ClusterError(f"--env {item!r} is not KEY=VALUE; pass it as --env NAME=VALUE")
        out[key] = value
    return out
