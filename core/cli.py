"""The fab command line's plumbing: job flags after `--`, one-line errors with their exit code, flag parsing
(numbers, folders, invoke's own parse errors)."""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import sys

from fabric.executor import Executor
from invoke.exceptions import Exit

from core.errors import ClusterError, format_error


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
        for noisy in ("paramiko", "invoke", "fabric", "botocore", "boto3"):  # botocore: "Found credentials in ..."
            logging.getLogger(noisy).setLevel(logging.WARNING)
        try:
            if getattr(c, "host", None):  # fab -H / -R: Fabric would run the whole task once per host
                raise ClusterError("fab -H/-R does not choose the nodes here (it would run the task once per host)", fix=
                                   "drop it and pick the cluster with --cluster local|hosts:PATH|aws[:NAME]|"
                                   "pulumi[:STACK] or XC_CLUSTER")
            return fn(c, *args, **kwargs)
        except KeyboardInterrupt:  # before a run's own handler is in place, or in a task without one
            raise Exit("interrupted", code=130) from None
        except ClusterError as exc:
            raise Exit(format_error(exc), code=exc.exit_code) from None
    return wrapper


def as_int(value, flag: str, low: int | None = None, high: int | None = None) -> int:
    """A whole-number flag within low..high: the one place flag text becomes a number (invoke hands it over as
    text, so a word where a number goes is one line here, not a traceback later)."""
    span = (f"{low}..{high}" if high is not None else f"{low} or more") if low is not None else "a whole number"
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        raise ClusterError(f"{flag} {value!r} is not a whole number", fix=f"pass {span}") from None
    if low is not None and n < low:
        raise ClusterError(f"{flag} {n} is below {low}", fix=f"pass {span}")
    if high is not None and n > high:
        raise ClusterError(f"{flag} {n} is above {high}", fix=f"pass {span}")
    return n


def as_float(value, flag: str, low: float = 0.0) -> float:
    """A number of seconds (or any real) at least ``low``: one line for a word where a number goes."""
    try:
        n = float(str(value).strip())
    except (TypeError, ValueError):
        raise ClusterError(f"{flag} {value!r} is not a number", fix=f"pass a number of at least {low:g}") from None
    if math.isnan(n) or n < low:
        raise ClusterError(f"{flag} {value} is below {low:g}", fix=f"pass a number of at least {low:g}")
    return n


def writable_dir(path, what: str, fix: str, mode: int = 0o777) -> None:
    """Make the folder (``mode`` when new) or refuse one this process cannot write in: as root only trying
    tells, access() says yes."""
    from pathlib import Path

    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=mode)
        probe = path / f".xc-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ClusterError(f"{what} {path} is not a writable folder ({exc.strerror or exc})", fix=f"{fix}") from None


def one_line_parse_errors() -> None:
    """invoke prints its own parse errors ('No idea what '--x' is!') as they are: give them the
    'error: <what>; <fix>' form of every other bad input. Called when the fabfile loads, before the
    task flags are parsed."""
    import re

    from invoke.exceptions import ParseError

    def text(self) -> str:
        msg = self.args[0] if self.args else "bad command line"
        task = getattr(self.context, "name", None)
        where = f"'fab --help {task}'" if task else "'fab -l'"
        m = re.fullmatch(r"No idea what '(.*)' is!", msg)
        if m and not task:
            msg = f"no task or flag {m.group(1)!r}"
        elif m:
            word = m.group(1)
            msg = f"{word!r} is not a flag of 'fab {task}'" if word.startswith("-") else \
                f"'fab {task}' takes no argument {word!r}"
        m = re.fullmatch(r"Flag <Argument: ([\w-]+)[^>]*> needed value and was not given one!", msg)
        if m:
            msg = f"--{m.group(1).replace('_', '-')} needs a value"
        return f"error: {msg}; see {where}"

    ParseError.__str__ = text


def env_pairs(items) -> dict[str, str]:
    """--env NAME=VALUE, or --env NAME for the operator's own value of NAME (kept out of every record)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ClusterError(f"--env {item!r} is not KEY=VALUE or KEY", fix="pass it as --env NAME=VALUE, or --env NAME "
                               "to pass your own value of NAME")
        if not sep:
            if key not in os.environ:
                raise ClusterError(f"--env {key} passes your own value of {key}, which is not set", fix=f"export {key} first "
                                   f"or pass --env {key}=VALUE")
            value = os.environ[key]
        out[key] = value
    return out


def valueless_keys(items) -> set[str]:
    """Keys passed as --env NAME: secret whatever their name (their value is the operator's own)."""
    return {item for item in items or [] if "=" not in item}
