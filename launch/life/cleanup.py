"""Ending a run on every node: kill each process whose environment carries the run's XC_RUN_ID
(ranks, their children, anything mpirun does not own), then look again and report what survived.
"""
from __future__ import annotations

import logging
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.node import Node
from cluster.remote import connect, run
from core.constants import HOME_EXPR
from core.errors import ClusterError
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)


def sweep_script(run_id: str) -> str:
    """Shell text for one node; built by concatenation because the shell's ${x#y} looks like a format field. One
    grep reads every process's environment: a tr and a grep per process cost ~1500 forks a look on a busy machine
    (process accounting over `make test`: 85 000 of its 111 000 processes)."""
    tag = shlex.quote(f"XC_RUN_ID={run_id}")
    scan = ("scan() { for e in $(grep -lzxF " + tag + " /proc/[0-9]*/environ 2>/dev/null); do p=${e#/proc/}; "
            "p=${p%/environ}; [ \"$p\" = \"$$\" ] || echo \"$p\"; done; true; }")
    return (scan + "; "
            "for p in $(scan); do kill -9 \"$p\" 2>/dev/null && echo \"killed $p\"; done; "
            # the run's secret --env values go with its processes
            "rm -f " + RunPaths(shlex.quote(run_id), HOME_EXPR).secrets_file + " 2>/dev/null; "
            # a second look after the kernel has reaped them: what is still there survived
            "sleep 0.5; for p in $(scan); do "
            "echo \"left $p $(tr '\\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-100)\"; done; true")


# Every run id with a live process on the node, with its process count: "run <id> <count>". Only processes in
# the node's own network namespace count: a network twin's nodes share this machine's processes, not its network.
# A local node's sessions carry XC_HOME (its sshd sets it), and so do the ranks started through them: there only
# processes with the same XC_HOME count, not those of another local cluster on the same machine. One grep finds the
# processes that carry a run id; only those are looked at further.
RUNS_ALIVE = ("for e in $(grep -lz '^XC_RUN_ID=' /proc/[0-9]*/environ 2>/dev/null); do "
              "[ \"${e%environ}ns/net\" -ef /proc/$$/ns/net ] || continue; "
              "[ -z \"${XC_HOME:-}\" ] || grep -qzxF \"XC_HOME=$XC_HOME\" \"$e\" 2>/dev/null || continue; "
              "grep -z -m1 '^XC_RUN_ID=' \"$e\" 2>/dev/null | tr '\\0' '\\n'; "
              "done | sort | uniq -c | while read n kv; do echo \"run ${kv#XC_RUN_ID=} $n\"; done; true")


def runs_alive(nodes: list[Node], unasked: dict[str, str] | None = None) -> dict[str, dict[str, int]]:
    """run id -> {node: live processes carrying it}; a node that cannot be asked is left out (and put in
    ``unasked`` with the reason, when given)."""
    found: dict[str, dict[str, int]] = {}

    def one(node: Node) -> None:
        try:
            with connect(node) as conn:
                res = run(conn, RUNS_ALIVE, timeout=60)
        except Exception as exc:  # an unreachable node has nothing we could find
            log.debug("listing runs on %s", node.name, exc_info=True)
            if unasked is not None:
                unasked[node.name] = exc.what if isinstance(exc, ClusterError) else f"{type(exc).__name__}: {exc}"
            return
        for line in res.stdout.splitlines():
            word, _, rest = line.partition(" ")
            run_id, _, count = rest.partition(" ")
            if word == "run" and run_id and count.isdigit():
                found.setdefault(run_id, {})[node.name] = int(count)

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(nodes)))) as pool:
        list(pool.map(one, nodes))
    order = [n.name for n in nodes]
    return {run_id: dict(sorted(where.items(), key=lambda kv: order.index(kv[0]))) for run_id, where in found.items()}


@dataclass
class Sweep:
    """What a clean-up did on each node, and what it could not check."""

    killed: dict[str, int] = field(default_factory=dict)
    left: dict[str, list[str]] = field(default_factory=dict)  # node -> ["pid command", ...]
    unchecked: dict[str, str] = field(default_factory=dict)  # node -> why

    @property
    def clean(self) -> bool:
        return not self.left and not self.unchecked

    def claim(self) -> str:
        """One clause for the operator; 'nothing is left running' only when every node was checked."""
        if self.clean:
            return "nothing is left running (checked on every node)"
        parts = [f"{node}: pid {', pid '.join(procs)}" for node, procs in self.left.items()]
        parts += [f"{node} not checked ({why})" for node, why in self.unchecked.items()]
        return "STILL RUNNING or unchecked: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {"killed": self.killed, "left": self.left, "unchecked": self.unchecked, "clean": self.clean}


def parse(stdout: str) -> tuple[int, list[str]]:
    killed, left = 0, []
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "killed":
            killed += 1
        elif word == "left":
            left.append(rest.strip())
    return killed, left


def sweep(nodes: list[Node], run_id: str, timeout: float = 60) -> Sweep:
    """Kill every process of the run on every node, in parallel; never raises for a node."""
    result = Sweep()
    script = sweep_script(run_id)

    def one(node: Node) -> None:
        try:
            with connect(node) as conn:
                res = run(conn, script, timeout=timeout)
        except ClusterError as exc:
            result.unchecked[node.name] = exc.what
            return
        except Exception as exc:  # a dropped connection or a timeout: say so, never claim it is clean
            log.debug("clean-up on %s", node.name, exc_info=True)
            result.unchecked[node.name] = f"{type(exc).__name__}: {exc}"
            return
        killed, left = parse(res.stdout)
        result.killed[node.name] = killed
        if left:
            result.left[node.name] = left
        if not res.ok and not left:
            result.unchecked[node.name] = f"clean-up exited {res.exited}: {res.stderr.strip()[-200:]}"

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(nodes)))) as pool:
        list(pool.map(one, nodes))
    return result
