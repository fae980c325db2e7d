"""The one function that finds the nodes of a cluster, from a table of sources.

Sources: ``local`` (the local cluster of sshd processes on loopback), ``hosts:PATH`` (a static
hosts file for on-premise servers), ``aws[:NAME]`` and ``pulumi[:STACK]`` (cluster.aws, imported
only when named: it needs boto3).
"""
from __future__ import annotations

import dataclasses
import getpass
import logging
import os
import shlex
from collections.abc import Callable
from pathlib import Path

from cluster import aws, local  # aws is light: boto3 and the Pulumi CLI are used only when called
from cluster.node import Node
from core.constants import REMOTE_PYTHON
from core.errors import ClusterError

log = logging.getLogger(__name__)
HEAD = "head"  # the name of a hosts file's head line

def default_cluster() -> str:
    """XC_CLUSTER; else the local cluster when one is started; else the cluster of the Pulumi stack selected
    in the project (so 'pulumi up' then 'fab train' works as written); else 'local', whose error says how
    to start one."""
    if os.environ.get("XC_CLUSTER"):
        return os.environ["XC_CLUSTER"]
    if (local.state_dir() / "state.json").exists():
        return "local"
    return "pulumi" if aws.selected_stack_cluster() else "local"


def load_nodes(cluster: str | None = None) -> list[Node]:
    """Return the nodes of ``cluster`` ('local', 'hosts:PATH', 'aws[:NAME]', 'pulumi[:STACK]')."""
    spec = cluster or default_cluster()
    kind, _, arg = spec.partition(":")
    fn = SOURCES.get(kind)
    if fn is None:
        known = ", ".join(sorted(SOURCES))
        raise ClusterError(f"--cluster {spec!r} is not a known source", fix=f"use one of: {known} (hosts takes hosts:PATH)")
    nodes = fn(arg)
    if not nodes:
        raise ClusterError(f"cluster {spec!r} has no nodes", fix="start it first (local: 'fab local-up --nodes 2')")
    return nodes


def select(nodes: list[Node], count: int | None, cluster: str = "") -> list[Node]:
    """The first ``count`` nodes, with the errors a user needs when ``count`` does not fit."""
    if count is None:
        return list(nodes)
    if count < 1:
        raise ClusterError(f"--nodes {count} is below 1", fix="ask for at least one node")
    if count > len(nodes):
        where = f" {cluster!r}" if cluster else ""
        fix = (f"run 'fab local-up --nodes {count}' or lower --nodes" if cluster in ("", "local")
               else f"run 'pulumi up' with nodeCount={count} or lower --nodes")
        raise ClusterError(f"--nodes {count} but the cluster{where} has {len(nodes)} nodes", fix=f"{fix}")
    return list(nodes[:count])


def parse_hosts_file(path: str | Path) -> list[Node]:
    """The training nodes of a static hosts file (its head, a line named ``head``, is not one of them)."""
    return parse_hosts(path)[0]


def parse_hosts(path: str | Path) -> tuple[list[Node], Node | None]:
    """Parse a static hosts file: its nodes, and its head when a line is named ``head`` (it runs detached runs'
    supervisors; without one the operator's machine does).

    One node per line, first line = node 0::

        # name  address  [private=ADDR] [user=NAME] [port=N] [python=PATH]
        node0   203.0.113.10  private=10.0.0.10  user=ubuntu
        head    203.0.113.5   user=ubuntu
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ClusterError(f"hosts file {str(p)!r} does not exist", fix="create it (one 'name address [private=..] [user=..] [port=..]' per line)")
    nodes: list[Node] = []
    for lineno, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            parts = shlex.split(line)
        except ValueError as exc:  # an unbalanced quote
            raise ClusterError(f"{p}:{lineno}: {exc} in {raw.strip()!r}", fix="fix the quoting") from None
        if len(parts) < 2:
            raise ClusterError(f"{p}:{lineno}: expected 'name address [key=value...]', got {raw.strip()!r}", fix="write "
                               "one node per line: name address [private=..] [user=..] [port=..]")
        name, host, *rest = parts
        opts = {}
        for item in rest:
            key, sep, value = item.partition("=")
            if not sep or key not in {"private", "user", "port", "python"}:
                raise ClusterError(f"{p}:{lineno}: unknown field {item!r}", fix="allowed: private=, user=, port=, python=")
            opts[key] = value
        try:
            port = int(opts.get("port", 22))
        except ValueError:
            raise ClusterError(f"{p}:{lineno}: port={opts['port']!r} is not a number", fix="use 1..65535 (22 for "
                               "sshd)") from None
        if not 1 <= port <= 65535:
            raise ClusterError(f"{p}:{lineno}: port={port} is not a TCP port", fix="use 1..65535 (22 for sshd)")
        nodes.append(Node(
            name=name, host=host, private_host=opts.get("private", host),
            user=opts.get("user", getpass.getuser()), port=port, index=len(nodes),
            python=opts.get("python", REMOTE_PYTHON),
        ))
    names = [n.name for n in nodes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ClusterError(f"{p}: node name(s) {', '.join(dupes)} appear more than once", fix="give every node its own "
                           "name")
    seen: dict[tuple[str, int], str] = {}
    for n in nodes:  # one machine under two names would get two ranks pinned to the same cores
        other = seen.setdefault((n.host, n.port), n.name)
        if other != n.name:
            raise ClusterError(f"{p}: {other} and {n.name} are the same machine ({n.host}:{n.port})", fix="list each "
                               "machine once")
    head = next((n for n in nodes if n.name == HEAD), None)
    nodes = [dataclasses.replace(n, index=i) for i, n in enumerate(n for n in nodes if n.name != HEAD)]
    return nodes, dataclasses.replace(head, labels={"role": HEAD}) if head else None


def load_head(cluster: str | None = None) -> Node | None:
    """The cluster's head, where detached runs' supervisors run; None: the operator's machine keeps that role
    (a local cluster started with --no-head, a hosts file without a 'head' line, an AWS cluster whose head group
    has no running instance; a pulumi:STACK spec, which names no AWS cluster here: use aws:NAME)."""
    kind, _, arg = (cluster or default_cluster()).partition(":")
    if kind == "local":
        return local.head(local.state_dir(arg or None))
    if kind == "hosts" and arg:
        return parse_hosts(arg)[1]
    if kind == "aws":
        return aws.aws_head(arg)
    return None


def _hosts_source(arg: str) -> list[Node]:
    if not arg:
        raise ClusterError("--cluster hosts needs a file", fix="use --cluster hosts:PATH")
    return parse_hosts_file(arg)


def _local_source(arg: str) -> list[Node]:
    return local.nodes(local.state_dir(arg or None))


def _aws_source(arg: str) -> list[Node]:
    return aws.aws_nodes(arg)


def _pulumi_source(arg: str) -> list[Node]:
    return aws.pulumi_nodes(arg)


SourceFn = Callable[[str], list[Node]]
# kind -> a function of the text after 'kind:' returning the nodes ordered by index
SOURCES: dict[str, SourceFn] = {"local": _local_source, "hosts": _hosts_source, "aws": _aws_source,
                                "pulumi": _pulumi_source}
