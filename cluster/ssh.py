"""`fab ssh NODE [-- CMD]`: OpenSSH to one node of the active cluster, with the key, user, port and known hosts that
fab itself uses (host keys verified, never added), through the address fab dials from where it runs (public from the
operator's machine, private on a head inside the VPC)."""
from __future__ import annotations

import os
import re
import subprocess

from cluster.keys import cluster_key_path
from cluster.node import Node
from cluster.remote import known_hosts_files
from cluster.resolve import Cluster
from core.errors import ClusterError


def pick(cluster: Cluster, name: str) -> Node:
    """node0..nodeN-1 (fab's order: node 0 first), head, or a node's own name as 'fab status' lists it."""
    if name == "head":
        if cluster.head is None:
            raise ClusterError(f"cluster {cluster.spec} has no head", fix="pick a node: 'fab status' lists them")
        return cluster.head
    m = re.fullmatch(r"node(\d+)", name)
    if m and int(m.group(1)) < len(cluster.nodes):
        return cluster.nodes[int(m.group(1))]
    for node in (*cluster.nodes, *([cluster.head] if cluster.head else [])):
        if name in (node.name, node.labels.get("instance_id")):
            return node
    names = ", ".join([f"node0..node{len(cluster.nodes) - 1}" if cluster.nodes else "no nodes"]
                      + (["head"] if cluster.head else []))
    raise ClusterError(f"cluster {cluster.spec} has no node {name!r}", fix=f"pass one of {names} ('fab status')")


def argv(cluster: Cluster, node: Node, command: list[str]) -> list[str]:
    """The ssh command line: StrictHostKeyChecking yes against the cluster's known_hosts files; the identity fab uses
    for the node (its own key on a local cluster, XC_SSH_KEY) alone, else the cluster key beside the user's own."""
    hosts = " ".join(str(p) for p in known_hosts_files(node) if p.exists())
    if not hosts:
        raise ClusterError(f"{node.name}: no host key of it is recorded yet",
                           fix="run 'fab keys' (or 'fab status') first, which records the cluster's host keys")
    out = ["ssh", "-p", str(node.port), "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={hosts}",
           "-o", "ConnectTimeout=10"]
    identity = node.labels.get("identity") or os.environ.get("XC_SSH_KEY")
    if identity:
        out += ["-i", os.path.expanduser(identity), "-o", "IdentitiesOnly=yes"]
    elif (key := cluster_key_path(cluster)).exists():
        out += ["-i", str(key)]
    out.append(f"{node.user}@{node.host}" if node.user else node.host)
    if command:
        out += ["--", " ".join(command)]  # as ssh itself joins them: the remote shell reads the words
    return out


def run(cluster: Cluster, name: str, command: list[str]) -> int:
    """ssh to the node, interactive without a command; the remote command's exit code (255: ssh's own failure)."""
    return subprocess.run(argv(cluster, pick(cluster, name), command), check=False).returncode
