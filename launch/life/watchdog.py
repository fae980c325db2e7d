"""A run's MPI plumbing, watched while it runs: when a node's hydra_pmi_proxy dies, its ranks live on
as orphans and mpirun waits on them (minutes), so fab would sit silent. Every few seconds each node
is asked which of the run's processes sit under a proxy; a node whose ranks have none is named, and
the run is ended with the clean-up a failure gets."""
from __future__ import annotations

import logging
import shlex
import threading

from cluster.node import Node
from cluster.remote import connect, run

log = logging.getLogger(__name__)

INTERVAL_S = 5.0
PROXY = "hydra_pmi_proxy"


def probe_script(run_id: str) -> str:
    """One line per process of the run: 'proc PID PPID PARENT_COMM NODE' (NODE: its XC_NODE, or -). One
    grep finds the run's processes, so a probe costs a few process starts, not one per process on the node."""
    tag = shlex.quote(f"XC_RUN_ID={run_id}")
    return ("for e in $(grep -lzxF " + tag + " /proc/[0-9]*/environ 2>/dev/null); do p=${e#/proc/}; p=${p%/environ}; "
            "node=$(grep -zm1 '^XC_NODE=' \"$e\" 2>/dev/null | tr -d '\\0'); node=${node#XC_NODE=}; "
            "pp=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f2); "
            "pc=$(cat /proc/${pp:-0}/comm 2>/dev/null); "
            "echo \"proc $p ${pp:-0} ${pc:--} ${node:--}\"; done; true")


def proxy_gone(node: str, output: str) -> bool:
    """The node has processes of the run and none of them is a child of the MPI proxy. On a local
    cluster every node sees the whole machine's processes: only those naming this node count."""
    mine = []
    for line in output.splitlines():
        words = line.split()
        if len(words) == 5 and words[0] == "proc" and words[4] in (node, "-"):
            mine.append(words[3])
    return bool(mine) and PROXY not in mine


class Watchdog:
    def __init__(self, nodes: list[Node], run_id: str, on_failure):
        self.nodes, self.run_id, self.on_failure = nodes, run_id, on_failure
        self.failure: tuple[str, str] | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()

    def _loop(self) -> None:
        script = probe_script(self.run_id)
        suspect: set[str] = set()
        while not self.stopped.wait(INTERVAL_S):
            for node in self.nodes:
                try:
                    with connect(node) as conn:
                        res = run(conn, script, timeout=30)
                except Exception:  # an unreachable node is mpirun's and the clean-up's to report
                    log.debug("watching %s", node.name, exc_info=True)
                    continue
                if self.stopped.is_set():
                    return
                if not proxy_gone(node.name, res.stdout):
                    suspect.discard(node.name)
                elif node.name in suspect:  # twice in a row: not a rank caught between exec and exit
                    reason = f"{node.name}: the run's MPI proxy ({PROXY}) died and left its ranks orphaned"
                    self.failure = (node.name, reason)
                    self.on_failure()
                    return
                else:
                    suspect.add(node.name)
