"""Password-less SSH inside the cluster, with host keys verified end to end.

The operator generates one ed25519 key per cluster, authorizes it on every node, and collects
each node's host key from its own verified connection. Node 0 gets the key, a known_hosts and
an ssh config with node aliases, so mpirun reaches every node with StrictHostKeyChecking yes.
"""
from __future__ import annotations

import io
import logging
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cluster.node import Node
from cluster.remote import connect, fan_out, remote_home, run
from cluster.resolve import Cluster
from core.constants import HOME_EXPR
from core.errors import ClusterError
from core.render import render

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeysResult:
    ssh_dir: str  # on node 0
    authorized: list[str]  # nodes where the key was newly added
    host_keys: dict[str, str]  # node -> "type base64"


def cluster_key_path(cluster: Cluster) -> Path:
    return cluster.state / "cluster_ed25519"


def cluster_key(cluster: Cluster):
    key = cluster_key_path(cluster)
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"xeon-cluster {cluster.name}",
                        "-f", str(key)], check=True, stdout=subprocess.DEVNULL)
    key.chmod(0o600)
    return key, key.with_suffix(".pub").read_text().strip()


def known_hosts_line(node: Node, key: str) -> str:
    host = node.private_host if node.port == 22 else f"[{node.private_host}]:{node.port}"
    return f"{host} {key}"


def _authorize(node: Node, pub: str) -> tuple[bool, str]:
    with connect(node) as conn:
        transport = conn.client.get_transport()
        server_key = transport.get_remote_server_key()
        host_key = f"{server_key.get_name()} {server_key.get_base64()}"
        script = (
            'f="${XC_AUTHORIZED_KEYS:-$HOME/.ssh/authorized_keys}"; umask 077; mkdir -p "$(dirname "$f")"; '
            f'touch "$f"; chmod 600 "$f"; if grep -qxF {shlex.quote(pub)} "$f"; then echo present; '
            f'else printf "%s\\n" {shlex.quote(pub)} >> "$f"; echo added; fi'
        )
        res = run(conn, script)
        if not res.ok:
            raise ClusterError(f"{node.name}: could not update authorized_keys: {res.stderr.strip()}")
        return res.stdout.strip() == "added", host_key


def _write_private(conn, path: str, data: bytes) -> None:
    sftp = conn.sftp()
    with sftp.open(path, "w") as fh:
        fh.chmod(0o600)  # before any byte of the key is written
        fh.write(data)


def _kept_lines(conn, ssh_dir: str, others: list[Node]) -> str:
    """The lines of node 0's known_hosts that record the nodes a smaller run leaves out."""
    if not others:
        return ""
    hosts = {known_hosts_line(n, "").strip() for n in others}
    res = run(conn, f"cat {shlex.quote(ssh_dir)}/known_hosts")
    return "".join(line + "\n" for line in (res.stdout.splitlines() if res.ok else [])
                   if line.split(" ", 1)[0] in hosts)


def setup_keys(cluster: Cluster, nodes: list[Node] | None = None) -> KeysResult:
    """Idempotent: re-running changes nothing on a node that is already set up."""
    nodes = list(nodes or cluster.nodes)
    key, pub = cluster_key(cluster)
    results = fan_out(nodes, lambda n: _authorize(n, pub), "authorizing the cluster key")
    host_keys = {n.name: hk for n, (_, hk) in zip(nodes, results)}
    added = [n.name for n, (new, _) in zip(nodes, results) if new]
    master = nodes[0]
    with connect(master) as conn:
        home = remote_home(conn)
        ssh_dir = f"{home}/ssh"
        res = run(conn, f"umask 077; mkdir -p {HOME_EXPR}/ssh && chmod 700 {HOME_EXPR}/ssh")
        if not res.ok:
            raise ClusterError(f"{master.name}: cannot create {ssh_dir}: {res.stderr.strip()}")
        _write_private(conn, f"{ssh_dir}/id_ed25519", key.read_bytes())
        conn.put(io.StringIO(pub + "\n"), f"{ssh_dir}/id_ed25519.pub")
        # A run on the first N nodes keeps node 0's view of the rest of the cluster (their aliases and the
        # host keys recorded before): fab doctor and a later run on all nodes go on reaching them.
        chosen = {n.name for n in nodes}
        others = [n for n in cluster.nodes if n.name not in chosen]
        lines = "".join(known_hosts_line(n, host_keys[n.name]) + "\n" for n in nodes)
        conn.put(io.StringIO(lines + _kept_lines(conn, ssh_dir, others)), f"{ssh_dir}/known_hosts")
        conn.put(io.StringIO(render("ssh_config.j2", cluster=cluster.name, nodes=nodes + others, ssh_dir=ssh_dir)),
                 f"{ssh_dir}/config")
        run(conn, f"chmod 600 {shlex.quote(ssh_dir)}/config {shlex.quote(ssh_dir)}/known_hosts")
    log.info("cluster key authorized on %d node(s) (%d new); ssh config on %s", len(nodes), len(added), master.name)
    return KeysResult(ssh_dir=ssh_dir, authorized=added, host_keys=host_keys)


MESH_TIMEOUT_S = 30


def verify_mesh(cluster: Cluster, nodes: list[Node] | None = None) -> dict[str, str]:
    """From node 0, ssh to every node with the cluster config; returns node -> problem (empty if fine)."""
    nodes = list(nodes or cluster.nodes)
    problems = {}
    with connect(nodes[0]) as conn:
        home = remote_home(conn)
        for n in nodes:
            # the bound runs on node 0, so a slow peer is that peer's problem, not node 0's
            res = run(conn, f"timeout {MESH_TIMEOUT_S} ssh -F {shlex.quote(home)}/ssh/config {n.name} true",
                      purpose=f"ssh from node 0 to {n.name}")
            if res.exited == 124:
                problems[n.name] = (f"ssh from node 0 did not finish within {MESH_TIMEOUT_S}s (a slow login shell "
                                    "on that node, e.g. ~/.bashrc running pyenv or conda init?)")
            elif not res.ok:
                problems[n.name] = (res.stderr.strip().splitlines() or ["ssh failed"])[-1]
    return problems
