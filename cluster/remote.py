"""Fabric connections with verified host keys, and parallel fan-out over nodes."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import paramiko
from fabric import Connection
from invoke.exceptions import CommandTimedOut

from cluster.node import Node
from core.constants import HOME_EXPR
from core.errors import ClusterError, HostKeyUnknown, NodeFailure, Unreachable

log = logging.getLogger(__name__)
T = TypeVar("T")

# Work root on a node: local nodes get theirs from sshd (SetEnv), real nodes use ~/.xeon-cluster.


def known_hosts_files(node: Node) -> list[Path]:
    files = [Path(node.labels["known_hosts"])] if node.labels.get("known_hosts") else []
    if os.environ.get("XC_KNOWN_HOSTS"):
        files.append(Path(os.environ["XC_KNOWN_HOSTS"]).expanduser())
    if not node.labels.get("local"):
        files.append(Path("~/.ssh/known_hosts").expanduser())
    return [f for f in files if f.is_file()]


def _key_known(client: paramiko.SSHClient, node: Node) -> bool:
    name = node.host if node.port == 22 else f"[{node.host}]:{node.port}"
    return bool(client.get_host_keys().lookup(name))


def recorded_in(node: Node, spec: str) -> Path | None:
    """The known_hosts file (of those this cluster uses) that holds the node's entry: the one to edit."""
    files = known_hosts_files(node)
    for f in files:
        try:
            if paramiko.HostKeys(str(f)).lookup(spec):
                return f
        except (OSError, paramiko.SSHException):
            continue
    return files[0] if files else None


class _Unknown(paramiko.SSHException):
    """Raised by the policy for a host key in no known_hosts file: told apart by type, not by text."""


class _Reject(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        raise _Unknown(hostname)


# A fab command talks to each node some twenty times in its first seconds (plan, lock, keys, stage, launch); a new
# SSH session costs ~25 ms of CPU between paramiko and sshd and ~75 ms of waiting, a command on an open one ~7 ms.
# So a connection left by a `with connect(...)` block is kept and handed, to one caller at a time, to the next
# connect() of the same node within REUSE_S. Only that briefly: a link cut meanwhile would show as a command's
# timeout, not the connect's; older ones are closed. A connection whose block raised is closed, never kept.
REUSE_S = 2.0
_idle: dict[tuple, list[tuple[float, Connection]]] = {}
_idle_lock = threading.Lock()


class _Kept(Connection):
    """A Connection whose `with` block hands it back for reuse instead of closing it (close() still closes)."""

    def __exit__(self, *exc) -> None:
        if exc[0] is not None or not self.is_connected:
            self.close()
            return
        with _idle_lock:
            _idle.setdefault(self._xc_key, []).append((time.monotonic(), self))


def _reusable(key: tuple) -> Connection | None:
    now, found, stale = time.monotonic(), None, []
    with _idle_lock:
        for k in list(_idle):
            keep = []
            for at, conn in reversed(_idle[k]):  # the most recently used first
                if found is None and k == key and now - at < REUSE_S and conn.is_connected:
                    found = conn
                elif now - at < REUSE_S:
                    keep.append((at, conn))
                else:
                    stale.append(conn)
            if keep:
                _idle[k] = keep[::-1]
            else:
                del _idle[k]
    for conn in stale:
        conn.close()
    return found


def close_idle() -> None:
    """Close every kept connection (at exit, and where a caller wants none left open)."""
    with _idle_lock:
        conns = [c for held in _idle.values() for _, c in held]
        _idle.clear()
    for conn in conns:
        conn.close()


atexit.register(close_idle)


def connect(node: Node, timeout: float = 10.0) -> Connection:
    """An open Connection; unknown or changed host keys are refused, never added. Within REUSE_S of a `with`
    block's end, that block's connection to the same node, as the same user with the same key and known_hosts."""
    identity = node.labels.get("identity") or os.environ.get("XC_SSH_KEY")
    key = (node.host, node.port, node.user, identity, tuple(map(str, known_hosts_files(node))))
    kept = _reusable(key)
    if kept is not None:
        return kept
    kwargs: dict = {"timeout": timeout, "banner_timeout": timeout, "auth_timeout": timeout}
    if identity:
        kwargs["key_filename"] = str(Path(identity).expanduser())
        kwargs["look_for_keys"] = False
        kwargs["allow_agent"] = False
    conn = _Kept(node.host, user=node.user, port=node.port, connect_kwargs=kwargs, inline_ssh_env=True)
    conn._xc_key = key
    conn.client.set_missing_host_key_policy(_Reject())
    for f in known_hosts_files(node):
        conn.client.load_host_keys(str(f))
    where = f"{node.name} ({node.host}:{node.port})"
    if node.labels.get("instance_id") and not _key_known(conn.client, node):
        # a cloud node's key comes only from its console output: without it, do not even dial
        raise ClusterError(f"{where}: host key not yet known", fix="its keys are read from the instance's console "
                           "output once it has booted: retry in a minute")
    try:
        conn.open()
    except paramiko.BadHostKeyException:
        spec = node.host if node.port == 22 else f"[{node.host}]:{node.port}"
        file = recorded_in(node, spec)
        raise ClusterError(f"{where}: host key CHANGED since it was recorded in {file}", fix=f"if the node was replaced, "
                           f"remove its old entry with 'ssh-keygen -f {file} -R \"{spec}\"' and verify the new "
                           "key") from None
    except paramiko.AuthenticationException:
        raise ClusterError(f"{where}: SSH login as {node.user!r} refused", fix="check the key (XC_SSH_KEY) "
                           "and that it is in the node's authorized_keys") from None
    except _Unknown:
        if node.labels.get("instance_id"):
            raise HostKeyUnknown(f"{where}: host key not yet known", "its keys are read from the instance's console "
                                 "output once it has booted: retry in a minute") from None
        raise HostKeyUnknown(f"{where}: host key unknown", "compare its fingerprint with one from a trusted "
                             "channel and add it to ~/.ssh/known_hosts, or set XC_KNOWN_HOSTS") from None
    except paramiko.SSHException as exc:
        raise ClusterError(f"{where}: SSH failed: {exc}", "check the node's sshd") from None
    except (TimeoutError, OSError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise Unreachable(f"{where} is unreachable ({reason})", "check that the node is up ('fab local-up' or "
                          "'pulumi up') and that SSH is allowed from this machine", node=node.name) from None
    return conn


def _quiet_late_kill(args) -> None:
    """invoke stops a timed-out command from a timer thread (Runner.kill); when the connection is closed by then
    (the error already said which node stalled), paramiko raises EOFError there: not the user's business."""
    frames = []
    tb = args.exc_traceback
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if issubclass(args.exc_type, (EOFError, OSError)) and "kill" in frames:
        log.debug("a timed-out command's late kill found its connection closed", exc_info=(args.exc_type,
                                                                                           args.exc_value,
                                                                                           args.exc_traceback))
        return
    _previous_hook(args)


_previous_hook = threading.excepthook
threading.excepthook = _quiet_late_kill


def command_timeout() -> float:
    """Seconds any one node command may take (XC_SSH_COMMAND_TIMEOUT, default 120): a node that does not
    answer in time is an error naming it, never a hang."""
    raw = os.environ.get("XC_SSH_COMMAND_TIMEOUT", "")
    try:
        value = float(raw) if raw else 120.0
    except ValueError:
        raise ClusterError(f"XC_SSH_COMMAND_TIMEOUT={raw!r} is not a number of seconds", fix="set it to e.g. 120") from None
    if value <= 0:
        raise ClusterError(f"XC_SSH_COMMAND_TIMEOUT={raw!r} must be above 0", fix="set it to e.g. 120")
    return value


def run(conn: Connection, command: str, purpose: str = "", **kw):
    """conn.run without echo, never raising on exit status (callers check .ok), bounded in time: a command
    that outlasts its timeout is one ClusterError naming the node, what the command was for, and the fix."""
    kw.setdefault("hide", True)
    kw.setdefault("warn", True)
    kw.setdefault("in_stream", False)
    kw.setdefault("timeout", command_timeout())
    started = time.monotonic()
    try:
        res = conn.run(command, **kw)
        # invoke reports a timeout only if its timer thread has finished killing the command by then; a kill
        # still under way comes back as a plain failure: the clock tells them apart
        timed_out = kw["timeout"] is not None and not res.ok and time.monotonic() - started >= kw["timeout"]
    except CommandTimedOut:
        timed_out = True
    if timed_out:
        what = purpose or " ".join(command.split()[:3])
        raise ClusterError(f"{conn.host}:{conn.port} did not finish {what!r} within {kw['timeout']:g}s", fix="a node whose "
                           "login shell is slow (~/.bashrc running pyenv or conda init, a stale pyenv lock in "
                           "~/.pyenv/shims) or that is overloaded stalls every command: fix its shell start-up, "
                           "or raise XC_SSH_COMMAND_TIMEOUT") from None
    return res


def remote_home(conn: Connection) -> str:
    res = run(conn, f"mkdir -p {HOME_EXPR} && cd {HOME_EXPR} && pwd")
    if not res.ok:
        raise ClusterError(f"{conn.host}: cannot create the work folder: {res.stderr.strip()}")
    return res.stdout.strip()


def fan_out(nodes: list[Node], fn: Callable[[Node], T], what: str, max_workers: int = 32) -> list[T]:
    """Run fn(node) on every node in parallel; collect all failures into one NodeFailure whose ``errors``
    keeps each node's own exception (as fabric's GroupResult does), and whose ``lost`` names the
    nodes that did not answer."""
    results: dict[str, T] = {}
    errors: dict[str, BaseException] = {}

    def call(node):
        try:
            results[node.name] = fn(node)
        except Exception as exc:  # a node's failure is reported, not a traceback
            if not isinstance(exc, ClusterError):
                log.debug("%s on %s failed", what, node.name, exc_info=True)
            errors[node.name] = exc

    with ThreadPoolExecutor(max_workers=min(max_workers, max(1, len(nodes)))) as pool:
        list(pool.map(call, nodes))
    if errors:
        names = [n.name for n in nodes if n.name in errors]
        lines = {n: _line(n, errors[n]) for n in names}
        lost = [n for n in names if isinstance(errors[n], Unreachable)]
        if len(names) == 1:
            exc = errors[names[0]]
            fix = exc.fix if isinstance(exc, ClusterError) else ""
            raise NodeFailure(f"{what} failed: {exc.what if isinstance(exc, ClusterError) else lines[names[0]]}",
                              names, lost=lost, errors=errors, fix=fix)
        raise NodeFailure(f"{what} failed on {len(names)} nodes: " + "; ".join(lines[n] for n in names), names,
                          lost=lost, errors=errors, fix="")
    return [results[n.name] for n in nodes]


def _line(name: str, exc: BaseException) -> str:
    return exc.text if isinstance(exc, ClusterError) else f"{name}: {type(exc).__name__}: {exc}"
