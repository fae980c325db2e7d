"""The local cluster: N sshd processes on 127.0.0.2, 127.0.0.3, ... reached over real SSH, and its head beside them.

Every node has its own host key, sshd config, authorized_keys and work root under one project-local folder, and
its sshd is pinned to its share of the CPUs so that a node's topology (as seen by the jobs) is its own."""
from __future__ import annotations

import getpass
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.node import Node
from core import procs
from core.cli import writable_dir
from core.constants import MAX_NODES, PROJECT_ROOT
from core.errors import ClusterError
from core.procs import listens
from core.render import render

log = logging.getLogger(__name__)

DEFAULT_PORT = 2222
FIRST_ADDRESS = "127.0.0.2"
HEAD = "head"  # the node beside the training nodes that runs detached runs' supervisors


def state_dir(name: str | None = None) -> Path:
    """The folder that holds all of a local cluster's state (XC_STATE_DIR overrides)."""
    base = Path(os.environ.get("XC_STATE_DIR") or PROJECT_ROOT / ".cluster")
    return base / (name or "local")


def sshd_binary() -> str:
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return cand
    fix = "apt-get install openssh-server" if os.geteuid() == 0 else "sudo apt-get install openssh-server"
    raise ClusterError("sshd is not installed", fix=f"install it with '{fix}'")


def operator_key(state: Path) -> Path:
    return state / "operator_ed25519"


def known_hosts(state: Path) -> Path:
    return state / "known_hosts"


def _keygen(path: Path, comment: str) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    path.chmod(0o600)


def _cpu_share(index: int, count: int) -> set[int]:
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // count)
    start = (index * per) % len(cpus)
    return set(cpus[start:start + per]) or {cpus[index % len(cpus)]}


def _alive(pid: int, marker: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return marker in cmdline


class CorruptState(ClusterError):
    """state.json cannot be read; 'fab local-down' still finds the nodes by their sshd config."""


def _read_state(state: Path) -> dict | None:
    f = state / "state.json"
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
        if not all(isinstance(n["pid"], int) and n["config"] and n["node"]["host"] for n in data["nodes"]):
            raise ValueError("a node without pid, config or host")
        return data
    except (OSError, ValueError, KeyError, TypeError):
        raise CorruptState(f"the local cluster's state file {f} is corrupt; run 'fab local-down' (it finds the "
                           "nodes' sshd by their config files) and then 'fab local-up'") from None


def nodes(state: Path | None = None, require_running: bool | None = True) -> list[Node]:
    """The cluster's nodes; ``require_running=False`` lists stopped ones too (for `fab doctor` to report), None
    leaves them out (as a lost instance leaves an AWS cluster: a run goes on with the rest, --min-nodes)."""
    state = state or state_dir()
    data = _read_state(state)
    if not data:
        raise ClusterError("no local cluster is running", fix="start one with 'fab local-up --nodes 2'")
    down = [n["name"] for n in data["nodes"] if not _alive(n["pid"], n["config"])]
    if require_running is None:
        return [Node(**n["node"]) for n in data["nodes"] if n["name"] not in down]
    if down and require_running:
        raise ClusterError(f"local node(s) {', '.join(down)} are not running", fix=f"restart with 'fab local-down' then 'fab local-up --nodes {len(data['nodes'])}'")
    return [Node(**n["node"]) for n in data["nodes"]]


def up(count: int, port: int = DEFAULT_PORT, first_address: str = FIRST_ADDRESS,
       state: Path | None = None, python: str | None = None, wrap=None, extra: dict | None = None,
       head: bool = False) -> list[Node]:
    """Start ``count`` sshd nodes (and, with ``head``, a node named head beside them: not a training node; it runs
    detached runs' supervisors); returns the training nodes. Refuses if a cluster of another size is up. ``wrap(i)``:
    the command that runs node i's sshd elsewhere (cluster.netns: its own namespace; no head), ``extra``: more state."""
    state, head = state or state_dir(), head and not wrap
    if not 1 <= count <= MAX_NODES:
        raise ClusterError(f"--nodes {count} is out of range", fix=f"a local cluster has 1..{MAX_NODES} nodes")
    if not 1024 <= port <= 65535:
        raise ClusterError(f"--port {port} is not a port a local cluster can use", fix="use 1024..65535")
    existing = _read_state(state)
    if existing:
        size = len(existing["nodes"])
        if size != count:
            raise ClusterError(f"a local cluster with {size} nodes is already up", fix=f"run 'fab local-down' first or "
                               f"use --nodes {size}")
        if all(_alive(n["pid"], n["config"]) for n in existing["nodes"]):
            log.info("local cluster already up with %d nodes", count)
        return _restart_down(state, existing, python)
    sshd = sshd_binary()
    base = ipaddress.IPv4Address(first_address)
    if not wrap and (not base.is_loopback or not (base + count - 1 + head).is_loopback):
        raise ClusterError("local nodes must live on 127.0.0.0/8", fix=f"{first_address} + {count} leaves it")
    user = getpass.getuser()
    writable_dir(state, "the local cluster's state folder", "set XC_STATE_DIR to a writable folder")
    state.chmod(0o700)
    _keygen(operator_key(state), "xeon-cluster local operator")
    op_pub = operator_key(state).with_suffix(".pub").read_text()
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir
    started: list[dict] = []
    try:
        for i in range(count + head):  # the head last, on the next address: node i stays 127.0.0.(2+i)
            started.append(_start_node(state, i, base, port, count, user, op_pub, sshd, python,
                                       wrap(i) if wrap else [], HEAD if i == count else None))
    except BaseException:
        _stop([s["pid"] for s in started], [s["config"] for s in started])
        _stop_imds(started)
        raise
    known_hosts(state).write_text("".join(_host_line(state, s) for s in started))
    top = {"head": started.pop()} if head else {}
    (state / "state.json").write_text(json.dumps({"port": port, "nodes": started, **top, **(extra or {})}, indent=2))
    return [Node(**s["node"]) for s in started]


def _start_node(state: Path, i: int, base: ipaddress.IPv4Address, port: int, count: int, user: str, op_pub: str,
                sshd: str, python: str | None, wrap: list[str], name: str | None = None) -> dict:
    name = name or f"node{i}"
    address = str(base + i)
    node_dir = state / "nodes" / name
    (node_dir / "home").mkdir(parents=True, exist_ok=True)
    node_dir.chmod(0o700)
    _keygen(node_dir / "ssh_host_ed25519_key", f"{name}@xeon-cluster-local")
    auth = node_dir / "authorized_keys"
    lines = auth.read_text().splitlines(keepends=True) if auth.exists() else []
    if op_pub not in lines:
        auth.write_text("".join(lines) + op_pub)
    auth.chmod(0o600)
    imds = _start_imds(node_dir, name, address, port, wrap) if name != HEAD else None
    config = node_dir / "sshd_config"
    config.write_text(render("sshd_config.j2", name=name, address=address, port=port, node_dir=node_dir, user=user,
                             imds=imds["endpoint"] if imds else None))
    log_file = node_dir / "sshd.log"
    cpus = _cpu_share(i, count)
    proc = subprocess.Popen(
        [*wrap, sshd, "-D", "-f", str(config), "-E", str(log_file)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda c=cpus: os.sched_setaffinity(0, c),  # noqa: PLW1509 (no threads here yet)
    )
    node = Node(name=name, host=address, private_host=address, user=user, port=port, index=i,
                home=str(node_dir / "home"), python=python or sys.executable,
                labels={"local": True, "cpus": sorted(cpus), "identity": str(operator_key(state)),
                        "known_hosts": str(known_hosts(state)), **({"role": HEAD} if name == HEAD else {})})
    entry = {"name": name, "pid": proc.pid, "config": str(config), "node": node.to_dict(), "wrap": wrap,
             **({"imds": imds} if imds else {})}
    try:
        _wait_listening(proc, address, port, log_file, name)
    except BaseException:
        _stop([proc.pid], [str(config)])
        _stop_imds([entry])
        raise
    log.info("%s up on %s:%d (pid %d, cpus %s)", name, address, port, proc.pid, ",".join(map(str, sorted(cpus))))
    return entry


def _start_imds(node_dir: Path, name: str, address: str, port: int, wrap: list[str]) -> dict:
    """The node's own metadata service (cluster.imds) on its address, one port above sshd's: nothing to say
    until 'fab local-notice' posts a notice there. Node sessions learn it from sshd (XC_IMDS_ENDPOINT)."""
    imds_port = port + 1 if port < 65535 else port - 1
    doc = node_dir / "imds.json"
    doc.write_text(json.dumps({"instance_id": f"local-{name}", "region": "local", "local_ipv4": address,
                               "lifecycle_state": "InService"}))
    with open(node_dir / "imds.log", "ab") as log_out:
        proc = subprocess.Popen([*wrap, sys.executable, "-m", "cluster.imds", str(doc), address, str(imds_port)],
                                stdin=subprocess.DEVNULL, stdout=log_out, stderr=log_out, start_new_session=True,
                                cwd=str(PROJECT_ROOT))
    entry = {"pid": proc.pid, "doc": str(doc), "endpoint": f"http://{address}:{imds_port}"}
    deadline = time.monotonic() + 10
    while not listens(proc.pid, address, imds_port):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop_imds([{"imds": entry}])
            tail = ((node_dir / "imds.log").read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise ClusterError(f"{name}: its metadata service did not start on {address}:{imds_port} ({tail})",
                               fix="pick another --port (the metadata service takes the port above it)")
        time.sleep(0.05)
    return entry


def _stop_imds(entries: list[dict]) -> None:
    found = [e["imds"] for e in entries if e.get("imds")]
    _stop([i["pid"] for i in found], [i["doc"] for i in found])


def _host_line(state: Path, entry: dict) -> str:
    node = entry["node"]
    key = (state / "nodes" / entry["name"] / "ssh_host_ed25519_key.pub").read_text().split()
    return f"[{node['host']}]:{node['port']} {key[0]} {key[1]}\n"


def _restart_down(state: Path, data: dict, python: str | None) -> list[Node]:
    """Start the nodes of a running cluster whose sshd is gone, with their old address, port, host key
    and work folder, so that a run can come back to them (fab train --max-restarts)."""
    entries, count = _entries(data), len(data["nodes"])
    base = ipaddress.IPv4Address(entries[0]["node"]["host"])
    op_pub = operator_key(state).with_suffix(".pub").read_text()
    sshd = sshd_binary()
    for i, entry in enumerate(entries):
        if _alive(entry["pid"], entry["config"]):
            continue
        _kill_tree(entry)  # what the dead node's sessions left behind goes with it
        fresh = _start_node(state, i, base, data["port"], count, entry["node"]["user"], op_pub, sshd,
                            python or entry["node"]["python"], entry.get("wrap", []), entry["name"])
        if i < count:
            data["nodes"][i] = fresh
        else:
            data["head"] = fresh
        log.info("%s restarted", entry["name"])
    (state / "state.json").write_text(json.dumps(data, indent=2))
    return [Node(**e["node"]) for e in data["nodes"]]


def _entries(data: dict) -> list[dict]:
    """Every sshd of the cluster: its nodes, then its head (when it has one)."""
    return data["nodes"] + ([data["head"]] if data.get("head") else [])


def head(state: Path | None = None) -> Node | None:
    """The cluster's head (not a training node: it runs detached runs' supervisors), or None without one."""
    data = _read_state(state or state_dir())
    return Node(**data["head"]["node"]) if data and data.get("head") else None


def _wait_listening(proc: subprocess.Popen, address: str, port: int, log_file: Path, name: str) -> None:
    """Until the sshd we started is the process listening on address:port: a reachable port alone may be
    another process's (another cluster, a stale sshd), and then ours dies with 'Address already in use'."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = (proc.stderr.read() or b"").decode().strip()
            tail = err or (log_file.read_text().strip().splitlines() or [""])[-1]
            if "Address already in use" in tail or "Address already in use" in log_file.read_text():
                raise ClusterError(f"{name}: port {address}:{port} is already in use by another process", fix="pick "
                                   "another with --port")
            raise ClusterError(f"{name}: sshd exited at start-up: {tail}")
        if listens(proc.pid, address, port):
            return
        time.sleep(0.05)
    raise ClusterError(f"{name}: sshd did not listen on {address}:{port} within 10 s", fix=f"see {log_file}")


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _stop(pids: list[int], markers: list[str]) -> list[int]:
    """SIGTERM our sshd listeners and their session processes; returns the pids stopped."""
    victims = []
    for pid, marker in zip(pids, markers):
        if _alive(pid, marker):
            victims.append(pid)
            victims.extend(_children(pid))
    _signal_and_wait(victims, signal.SIGTERM)
    _signal_and_wait([p for p in victims if procs.exists(p)], signal.SIGKILL, wait_s=0)
    return victims


def _signal_and_wait(pids: list[int], sig: int, wait_s: float = 5) -> None:
    """Send sig to every pid, then wait up to wait_s for all of them to be gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(procs.exists(p) for p in pids):
        time.sleep(0.05)


def _node_pids(entry: dict) -> list[int]:
    """The node's sshd and every process started through it (each session carries the node's XC_HOME)."""
    marker = f"XC_HOME={entry['node']['home']}".encode()
    pids = [entry["pid"], *_children(entry["pid"])] if _alive(entry["pid"], entry["config"]) else []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in env.read_bytes().split(b"\0"):
                pids.append(int(env.parent.name))
        except OSError:
            continue
    return sorted(set(pids) - {os.getpid()})


def _kill_tree(entry: dict) -> int:
    pids = _node_pids(entry)
    _signal_and_wait(pids, signal.SIGKILL)
    imds = entry.get("imds")
    if imds and _alive(imds["pid"], imds["doc"]):  # a reclaimed instance's metadata goes with it
        _signal_and_wait([imds["pid"]], signal.SIGKILL)
    return len(pids)


def kill_node(name: str, state: Path | None = None) -> int:
    """Take one node away outright, as a reclaimed instance goes: SIGKILL its sshd and every process on it,
    no clean-up. 'fab local-up' with the same --nodes brings it back. Returns how many processes died."""
    state = state or state_dir()
    data = _read_state(state)
    if not data:
        raise ClusterError("no local cluster is running", fix="start one with 'fab local-up --nodes 2'")
    entry = next((e for e in _entries(data) if e["name"] == name), None)
    if entry is None:
        raise ClusterError(f"no local node {name!r}", fix=f"the nodes are {', '.join(e['name'] for e in _entries(data))}")
    return _kill_tree(entry)


def down(state: Path | None = None) -> int:
    """Stop exactly this cluster's sshd processes; returns how many nodes were stopped."""
    state = state or state_dir()
    try:
        data = _read_state(state)
    except CorruptState:  # stop what can be identified: this cluster's sshd listeners, by their config path
        configs = [str(c) for c in (state / "nodes").glob("*/sshd_config")]
        found = [(pid, c) for pid, cmd in procs.cmdlines() if "[listener]" in cmd for c in configs if c + " " in cmd + " "]
        _stop([pid for pid, _ in found], [c for _, c in found])
        docs = [str(d) for d in (state / "nodes").glob("*/imds.json")]  # the nodes' metadata services too
        imds = [(pid, d) for pid, cmd in procs.cmdlines() if "cluster.imds" in cmd for d in docs if d in cmd]
        _stop([pid for pid, _ in imds], [d for _, d in imds])
        (state / "state.json").unlink()
        return len(found)
    if not data:
        return 0
    if data.get("head"):  # its supervisors have sessions of their own
        _kill_tree(data["head"])
    _stop([n["pid"] for n in _entries(data)], [n["config"] for n in _entries(data)])
    _stop_imds(_entries(data))
    (state / "state.json").unlink()
    return len(data["nodes"])


def node_status(state: Path | None = None) -> list[dict]:
    """Each node's name, address, sshd pid, whether it runs and since when (epoch seconds), for 'fab status'."""
    data = _read_state(state or state_dir())
    if not data:
        raise ClusterError("no local cluster is running", fix="start one with 'fab local-up --nodes 2'")
    out = []
    for entry in _entries(data):
        running = _alive(entry["pid"], entry["config"])
        out.append({"name": entry["name"], "host": entry["node"]["host"], "port": entry["node"]["port"],
                    "pid": entry["pid"], "running": running, "since": _started(entry["pid"]) if running else None})
    return out


def _started(pid: int) -> float | None:
    try:
        after_comm = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(after_comm[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None
