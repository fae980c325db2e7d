"""A resolved cluster: its spec, its nodes, and the operator-side folder that holds its state."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cluster import local
from cluster.inventory import Node, default_cluster, load_head, load_nodes, select
from core.cli import writable_dir


@dataclass(frozen=True)
class Cluster:
    spec: str
    nodes: tuple[Node, ...]  # the training nodes, node 0 first: never the head
    state: Path
    head: Node | None = None  # where detached runs' supervisors run; None: the operator's machine

    @property
    def name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", self.spec).strip("-") or "cluster"

    @property
    def is_local(self) -> bool:
        return self.spec.split(":", 1)[0] == "local"

    def first(self, count: int | None) -> list[Node]:
        return select(list(self.nodes), count, self.spec)


def state_name(spec: str, nodes) -> str:
    """One folder (and so one cluster key) per cluster, however it is named: aws, aws:NAME, pulumi and
    pulumi:STACK of the same cluster all resolve to its AWS cluster name."""
    names = {n.labels.get("cluster") for n in nodes}
    if len(names) == 1 and (name := names.pop()):
        return aws_state_name(name)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", spec)


def aws_state_name(cluster: str) -> str:
    return "aws-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", cluster)


def open_cluster(spec: str | None = None, require_running: bool | None = True) -> Cluster:
    """``require_running=False`` keeps stopped local nodes in the list (doctor reports them as down), None leaves
    them out, as an AWS cluster's discovery leaves out a lost instance (a run's restart takes the rest)."""
    spec = spec or default_cluster()
    if spec.split(":", 1)[0] == "local":
        state = local.state_dir(spec.partition(":")[2] or None)
        nodes = load_nodes(spec) if require_running else local.nodes(state, require_running=require_running)
    else:
        nodes = load_nodes(spec)
        state = local.state_dir().parent / state_name(spec, nodes)
    writable_dir(state, f"the state folder of cluster {spec!r}", "set XC_STATE_DIR to a writable folder", mode=0o700)
    return Cluster(spec=spec, nodes=tuple(nodes), state=state, head=load_head(spec))
