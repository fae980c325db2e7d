"""`fab setup`: put a profile's software and the project's code on every node, in parallel.

The setup script is rendered once (node_setup.profiles) and the same text runs on every node.
Each node's full output goes to <cluster state>/setup/<node>.log; the operator sees one progress
line per step as it happens, then a table node -> result -> seconds.
"""
from __future__ import annotations

import io
import json
import logging
import re
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cluster import keys, shipping
from cluster.node import Node
from cluster.remote import connect, fan_out, remote_home, run
from cluster.resolve import Cluster
from core.errors import ClusterError, NodeFailure
from node_setup import profiles

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 3600  # the oneccl profile downloads ~1 GB of wheels; a hung pip must still end
TAIL_LINES = 12
OK, ALREADY, FAILED = "ok", "already set up", "FAILED"
CLUSTER_ENV = "/etc/xeon-cluster/cluster.env"  # written by the AWS nodes' cloud-init

# Installed versions of the given packages, as JSON; absent ones are left out.
VERSIONS_PY = r"""
import json, sys
from importlib import metadata
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


@dataclass(frozen=True)
class NodeSetup:
    node: str
    result: str  # OK, ALREADY or FAILED
    seconds: float
    log: Path
    reason: str = ""  # for FAILED: the last error line


def default_venv(profile: profiles.Profile, nodes: list[Node]) -> str:
    """The profile's venv, except that a per-user one ('~/...') on local nodes goes under each node's own
    work root: the local nodes share one filesystem, and one shared venv would hide per-node faults."""
    if profile.venv.startswith("~/") and nodes and all(n.labels.get("local") for n in nodes):
        return f"{profiles.WORK_ROOT_PREFIX}venv-{profile.name}"
    return profile.venv


def venv_python(venv: str) -> str:
    """The venv's python as one shell word, expanded on the node."""
    return profiles.venv_shell_word(venv) + "/bin/python"


def installed_versions(conn, python: str, names: list[str]) -> dict[str, str] | None:
    """name -> version read by ``python`` (a shell word) through importlib.metadata; None if it does not run."""
    res = run(conn, f"{python} -c {shlex.quote(VERSIONS_PY)} " + " ".join(map(shlex.quote, names)), timeout=60)
    if not res.ok:
        return None
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


class _LineSink(io.TextIOBase):
    """Gets a node's output as it arrives: every byte to the node's log, step lines to the operator."""

    SHOWN = ("==> ", "error:", "warning:", "set up (", "already set up")

    def __init__(self, node: str, log_file: TextIO, out: TextIO, out_lock: threading.Lock):
        self.node, self.log_file, self.out, self.out_lock = node, log_file, out, out_lock
        self.buffer = ""
        self.lock = threading.Lock()  # stdout and stderr arrive on two threads
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        with self.lock:
            self.log_file.write(text)
            self.log_file.flush()
            self.buffer += text
            *lines, self.buffer = self.buffer.split("\n")
            for line in lines:
                self._line(line.rstrip("\r"))
        return len(text)

    def flush(self) -> None:
        pass

    def close_line(self) -> None:
        with self.lock:
            if self.buffer:
                self._line(self.buffer)
                self.buffer = ""

    def _line(self, line: str) -> None:
        self.lines.append(line)
        if line.startswith(self.SHOWN):
            say(self.out, self.out_lock, f"{self.node}: {line.removeprefix('==> ')}")


def say(out: TextIO, lock: threading.Lock, text: str) -> None:
    with lock:
        out.write(text + "\n")
        out.flush()


def _reason(lines: list[str]) -> str:
    for line in reversed(lines):
        if line.startswith(("error:", "ERROR:")) or "Error" in line:
            return line.strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "no output")


def _setup_one(node: Node, profile: profiles.Profile, venv: str, script: str, digest: str, tarball: bytes,
               log_path: Path, out: TextIO, out_lock: threading.Lock) -> NodeSetup:
    started = time.monotonic()
    with log_path.open("w") as log_file:
        log_file.write(f"# fab setup --profile {profile.name} (hash {profile.hash}) on {node.name} "
                       f"({node.user}@{node.host}:{node.port}), {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n")
        sink = _LineSink(node.name, log_file, out, out_lock)

        def failed(reason: str) -> NodeSetup:
            log_file.write(f"error: {reason}\n")
            sink.lines.append(f"error: {reason}")
            return NodeSetup(node.name, FAILED, time.monotonic() - started, log_path, reason)

        try:
            conn = connect(node)
        except ClusterError as exc:
            return failed(str(exc))
        with conn:
            try:
                home = remote_home(conn)
                shipping.ensure_verified_code(conn, home, digest, tarball)
            except ClusterError as exc:
                return failed(f"shipping the code: {exc}")
            say(out, out_lock, f"{node.name}: code {digest} in {home}/code/{digest}")
            _forget_drifted(conn, node, profile, venv, sink, out, out_lock)
            path = f"{home}/setup/node_setup-{profile.name}-{profile.hash}.sh"
            run(conn, f"mkdir -p {shlex.quote(home)}/setup")
            conn.put(io.StringIO(script), path)
            try:  # the node's own `timeout` ends the script there too: no pip left running after a timeout
                res = conn.run(f"timeout {SETUP_TIMEOUT_S} bash {shlex.quote(path)}", hide=False, warn=True,
                               pty=False, in_stream=False, out_stream=sink, err_stream=sink,
                               timeout=SETUP_TIMEOUT_S + 30)
            except Exception as exc:  # CommandTimedOut and transport errors end this node, not the others
                sink.close_line()
                log.debug("setup on %s", node.name, exc_info=True)
                return failed(f"the setup script did not finish: {type(exc).__name__}: {exc}")
            sink.close_line()
            if res.ok:
                ok, detail = shipping.native_kernels(conn, f"{home}/code/{digest}", f"{shlex.quote(venv)}/bin/python")
                say(out, out_lock, f"{node.name}: native kernels {detail}" if ok is not False else
                    f"{node.name}: no native kernels ({detail}): torch's own ops")
    seconds = time.monotonic() - started
    if res.exited == 124:
        return NodeSetup(node.name, FAILED, seconds, log_path, f"error: the setup script ran past {SETUP_TIMEOUT_S} s")
    if not res.ok:
        return NodeSetup(node.name, FAILED, seconds, log_path, _reason(sink.lines))
    already = any(line.startswith("already set up") for line in sink.lines)
    return NodeSetup(node.name, ALREADY if already else OK, seconds, log_path)


def _setup_guarded(node: Node, *args, log_path: Path, **kwargs) -> NodeSetup:
    """_setup_one, with any unexpected error (an SFTP failure, a dropped connection) as this node's FAILED row."""
    started = time.monotonic()
    try:
        return _setup_one(node, *args, log_path=log_path, **kwargs)
    except Exception as exc:
        log.debug("setup on %s", node.name, exc_info=True)
        reason = f"{type(exc).__name__}: {exc}"
        with log_path.open("a") as fh:
            fh.write(f"error: {reason}\n")
        return NodeSetup(node.name, FAILED, time.monotonic() - started, log_path, reason)


def _forget_drifted(conn, node: Node, profile: profiles.Profile, venv: str, sink: _LineSink,
                    out: TextIO, out_lock: threading.Lock) -> None:
    """The marker only says the script once finished; if a package was changed since (a stray pip install),
    remove the marker so the script rebuilds the venv instead of calling it set up."""
    marker = f"{profiles.venv_shell_word(venv)}/{profiles.MARKER_NAME}"
    res = run(conn, f"cat {marker}")
    if not res.ok or res.stdout.strip() != profile.hash:
        return
    have = installed_versions(conn, venv_python(venv), [p.name for p in profile.packages])
    problems = profiles.matched_set_problems(profile, have or {})
    if problems:
        text = problems[0].split("; run ", 1)[0]
        sink.write(f"drift: {'; '.join(problems)}\n")
        say(out, out_lock, f"{node.name}: {text}: reinstalling")
        run(conn, f"rm -f {marker} || sudo -n rm -f {marker}")


def table(results: list[NodeSetup]) -> str:
    width = max([len("node")] + [len(r.node) for r in results])
    lines = [f"{'node':<{width}}  {'result':<14}  {'seconds':>7}"]
    lines += [f"{r.node:<{width}}  {r.result:<14}  {r.seconds:>7.1f}" for r in results]
    return "\n".join(lines)


def tail(path: Path, count: int = TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").rstrip("\n").splitlines()[-count:]
    except OSError:
        return []


def carried_profile(conn, venvs: list[str], by_hash: dict[str, str]) -> str | None:
    """The profile a node carries: the marker of a finished setup in one of the profiles' venvs (what is
    installed), else the XC_PROFILE its cluster.env names (a baked AMI's node before any fab setup)."""
    for venv in venvs:
        res = run(conn, f"cat {profiles.venv_shell_word(venv)}/{profiles.MARKER_NAME}")
        if res.ok and res.stdout.strip() in by_hash:
            return by_hash[res.stdout.strip()]
    res = run(conn, f"cat {CLUSTER_ENV}")
    m = re.search(r"^XC_PROFILE=(\S+)\s*$", res.stdout, re.MULTILINE) if res.ok else None
    return m.group(1) if m else None


def choose_profile(requested: str | None, carried: dict[str, str | None], venv_of, fallback: str,
                   force: bool = False) -> tuple[str, str]:
    """(profile, why): without --profile, the one the nodes carry; never a silent switch of a node's venv."""
    names = sorted({c for c in carried.values() if c})
    if requested is None:
        if len(names) > 1:
            which = ", ".join(f"{n}: {c}" for n, c in carried.items() if c)
            raise ClusterError(f"the nodes carry different profiles ({which})", fix="pass --profile NAME (with --force "
                               "to replace the others)")
        if names:
            return names[0], "carried by the nodes"
        return fallback, "default: no node carries one yet"
    clash = [(n, c) for n, c in carried.items() if c and c != requested and venv_of(c) == venv_of(requested)]
    if clash and not force:
        node, was = clash[0]
        raise ClusterError(f"{node} carries profile {was} in {venv_of(was)}, which --profile {requested} would "
                           f"replace", fix=f"pass --force to switch, or leave out --profile to keep {was}")
    return requested, "--force: replacing " + ", ".join(f"{c} on {n}" for n, c in clash) if clash else "--profile"


def resolve_profile(cluster: Cluster, nodes: list[Node], requested: str | None, force: bool = False) -> tuple[
        profiles.Profile, str]:
    """The profile to set up and why, after asking every node which one it carries."""
    known = profiles.load_profiles()
    if requested is not None and requested not in known:
        profiles.load_profile(requested)  # raises the one-line 'unknown profile' error
    venv_of = {name: default_venv(p, nodes) for name, p in known.items()}
    by_hash = {p.hash: name for name, p in known.items()}
    venvs = list(dict.fromkeys(venv_of.values()))

    def ask(node: Node) -> str | None:
        with connect(node) as conn:
            return carried_profile(conn, venvs, by_hash)

    carried = dict(zip([n.name for n in nodes], fan_out(nodes, ask, "reading the nodes' profiles")))
    name, why = choose_profile(requested, carried, lambda n: venv_of.get(n, f"?{n}"),
                               "test" if cluster.is_local else "upstream", force)
    return known[name], why


def setup_nodes(cluster: Cluster, nodes: list[Node], profile: str | profiles.Profile, venv: str | None = None,
                out: TextIO = sys.stdout) -> list[NodeSetup]:
    """Set every node up in parallel; raises NodeFailure naming the failed nodes after all have finished."""
    p = profile if isinstance(profile, profiles.Profile) else profiles.load_profile(profile)
    venv = venv or default_venv(p, nodes)
    script = profiles.render_setup_script(p, venv=venv)  # once: every node runs this same text
    digest, tarball = shipping.code_hash(), shipping.code_tarball()
    logs = cluster.state / "setup"
    logs.mkdir(parents=True, exist_ok=True)
    out_lock = threading.Lock()
    say(out, out_lock, f"setup: profile {p.name} (hash {p.hash}) on {len(nodes)} node(s), venv {venv}; "
                       f"logs in {logs}")
    for note in p.eol_notes:
        say(out, out_lock, f"warning: end-of-life: {note}")
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        futures = [pool.submit(_setup_guarded, n, p, venv, script, digest, tarball, log_path=logs / f"{n.name}.log",
                               out=out, out_lock=out_lock) for n in nodes]
        results = [f.result() for f in futures]
    keys_error = None
    if not any("unreachable" in r.reason for r in results):
        try:  # node 0 must reach every node with verified host keys: `fab doctor` checks it
            ks = keys.setup_keys(cluster, nodes)
            say(out, out_lock, f"keys: node 0 reaches every node with verified host keys ({ks.ssh_dir}/config)")
        except ClusterError as exc:
            keys_error = str(exc)
    wall = time.monotonic() - started
    say(out, out_lock, table(results))
    failed = [r for r in results if r.result == FAILED]
    for r in failed:
        say(out, out_lock, f"{r.node} FAILED: {r.reason}\n  last lines of {r.log}:\n"
            + "\n".join(f"  | {line}" for line in tail(r.log)))
    log.info("setup of profile %s on %d node(s) took %.1f s", p.name, len(nodes), wall)
    if failed:
        names = [r.node for r in failed]
        detail = "; ".join(f"{r.node}: {r.reason.removeprefix('error: ')}" for r in failed)
        raise NodeFailure(f"setup failed on {', '.join(names)} of {len(results)} node(s): {detail}", names, fix=f"fix that and "
                          f"re-run 'fab setup --profile {p.name}' (logs: {logs})")
    if keys_error:
        raise ClusterError(f"setup finished but the cluster key could not be installed: {keys_error}")
    say(out, out_lock, f"setup: {len(results)} node(s) on profile {p.name} and code {digest} in {wall:.1f} s")
    return results
