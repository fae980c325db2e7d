"""Secrets in --env: values that must reach the ranks and nothing else.

A key is secret when its name looks like one (TOKEN, KEY, SECRET, PASSWORD) or when it was passed
as ``--env KEY`` with no value (the operator's own value, read from their environment). Secret
values never go on mpirun's command line: each node gets them in runs/<id>/secrets.env (mode
0600, sourced by rank.sh, removed after the run), and every record and log line shows ``***``.
"""
from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
FILE = "secrets.env"
MIN_REDACT = 4  # shorter values would blank out ordinary text of the log


def is_secret(key: str, valueless: frozenset[str] | set[str] = frozenset()) -> bool:
    return key in valueless or bool(_SECRET_NAME.search(key))


def split(env: dict[str, str], valueless=frozenset()) -> tuple[dict[str, str], dict[str, str]]:
    """(public, secret) parts of ``env``."""
    public = {k: v for k, v in env.items() if not is_secret(k, valueless)}
    return public, {k: v for k, v in env.items() if k not in public}


def masked(env: dict[str, str], valueless=frozenset()) -> dict[str, str]:
    return {k: (MASK if is_secret(k, valueless) else v) for k, v in env.items()}


def redact(text: str, values) -> str:
    for value in sorted((v for v in values if len(v) >= MIN_REDACT), key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


def env_file(secret: dict[str, str]) -> str:
    import shlex

    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(secret.items()))


def remove_script(run_dir: str) -> str:
    import shlex

    return f"rm -f {shlex.quote(run_dir)}/{FILE}"


def forget(where) -> None:
    """Remove secrets.env from each (node, run folder); never raises (the clean-up sweep removes it too)."""
    from cluster.remote import connect, run

    for node, run_dir in where:
        try:
            with connect(node) as conn:
                run(conn, remove_script(run_dir), timeout=30)
        except Exception as exc:  # an unreachable node: the sweep of the failure tries again
            log.debug("removing %s on %s", FILE, node.name, exc_info=True)
            log.warning("could not remove %s from %s: %s", FILE, node.name, exc)
