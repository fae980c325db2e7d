"""Secrets in --env: values that must reach the ranks and nothing else.

A key is secret when its name looks like one (TOKEN, KEY, SECRET, PASSWORD) or when it was passed
as ``--env KEY`` with no value (the operator's own value, read from their environment). Secret
values never go on mpirun's command line: each node gets them in runs/<id>/secrets.env (mode
0600, sourced by rank.sh, removed after the run), and every record and log line shows ``***``.
A job argument named like a secret (``--hub_token hf_...``) is masked the same way in records and logs; its value
still reaches the job on its command line.
"""
from __future__ import annotations

import logging
import re

from cluster import remote

log = logging.getLogger(__name__)

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
FILE = "secrets.env"
MIN_REDACT = 4  # shorter values would blank out ordinary text of the log


# A job argument is secret when its flag's last word names one (--hub_token, --api-key, --db_password, --secret,
# --credentials): the issue's *token*, *key*, *password*, *secret*, *credential*, read per word so that
# --tokenizer_name, --max_tokens or --pad_token_id stay visible. Its value is masked in records and logs.
_SECRET_ARG_WORD = re.compile(r"(token|key|password|passwd|secret|credentials?)$", re.IGNORECASE)
ARG_ENV = "XC_SECRET_ARG_"  # secret argument values ride in secrets.env too, only so that every log redacts them


def _secret_flag(word: str) -> bool:
    name = word.lstrip("-").split("=", 1)[0]
    return word.startswith("-") and bool(name) and bool(_SECRET_ARG_WORD.search(re.split(r"[-_.]", name)[-1]))


def secret_args(args) -> dict[int, str]:
    """Position -> value of every secret argument value: ``--hub_token VALUE`` and ``--hub_token=VALUE``."""
    args, out = list(args), {}
    for i, word in enumerate(args):
        if not _secret_flag(word):
            continue
        if "=" in word:
            out[i] = word.split("=", 1)[1]
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[i + 1] = args[i + 1]
    return out


def mask_args(args) -> list[str]:
    """The arguments as records and logs show them: secret values as ***."""
    hidden, out = secret_args(args), list(args)
    for i in hidden:
        out[i] = f"{out[i].split('=', 1)[0]}={MASK}" if _secret_flag(out[i]) else MASK
    return out


def arg_env(args) -> dict[str, str]:
    """The secret argument values under ARG_ENV names, for secrets.env: the log filters redact what it holds."""
    return {f"{ARG_ENV}{i}": v for i, v in secret_args(args).items() if v and v != MASK}


def arg_values_by_flag(args) -> dict[str, str]:
    """Secret argument values under their flags' names in capitals (--hub_token VALUE -> HUB_TOKEN): the names
    --resume reads them back from (fill_masked)."""
    args, out = list(args), {}
    for i, value in secret_args(args).items():
        if value and value != MASK:
            flag = args[i].split("=", 1)[0] if args[i].startswith("-") and "=" in args[i] else args[i - 1]
            out[flag_env_name(flag)] = value
    return out


def fill_masked(args, values) -> list[str]:
    """A record's masked arguments (--hub_token *** or --hub_token=***) with the value under the flag's name in
    capitals, where ``values`` (a mapping: the operator's environment, or what a head kept) has one."""
    args = list(args)
    return [_filled(word, before, values) for before, word in zip([None, *args], args)]


def _filled(word: str, before: str | None, values) -> str:
    if word.endswith(f"={MASK}"):
        flag = word.split("=", 1)[0]
        value = values.get(flag_env_name(flag))
        return f"{flag}={value}" if value else word
    if word == MASK and before:
        return values.get(flag_env_name(before)) or word
    return word


def unmask_args(masked, real) -> list[str]:
    """A record's masked arguments with the values of the same run's own (a restart by its supervisor)."""
    masked, real = list(masked), list(real)
    if len(masked) != len(real):
        return masked
    return [r if m != r and (m == MASK or m.endswith(f"={MASK}")) else m for m, r in zip(masked, real)]


def masked_arg_flags(args) -> list[str]:
    """The flags whose values a record keeps as ***."""
    out = []
    for i, word in enumerate(args):
        if word.endswith(f"={MASK}") and _secret_flag(word):
            out.append(word.split("=", 1)[0])
        elif word == MASK and i > 0 and _secret_flag(args[i - 1]):
            out.append(args[i - 1])
    return out


def flag_env_name(flag: str) -> str:
    """Where the operator gives a masked argument's value at --resume: --hub_token -> HUB_TOKEN."""
    return re.sub(r"[^A-Za-z0-9]", "_", flag.lstrip("-")).upper()


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
    for node, run_dir in where:
        try:
            with remote.connect(node) as conn:
                remote.run(conn, remove_script(run_dir), timeout=30)
        except Exception as exc:  # an unreachable node: the sweep of the failure tries again
            log.debug("removing %s on %s", FILE, node.name, exc_info=True)
            log.warning("could not remove %s from %s: %s", FILE, node.name, exc)
