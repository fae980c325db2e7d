"""`fab doctor`'s store row: every node writes, reads back and deletes a probe object in the cluster's store,
with the credentials its ranks would get (in a 0600 file removed right after, never on a command line)."""
from __future__ import annotations

import io
import shlex
import uuid
from pathlib import Path

from cluster import store as store_lib
from cluster.node import Node
from cluster.remote import connect, fan_out, remote_home, run
from core.errors import ClusterError
from core.report import CLUSTER, Row
from training import store as shared

TAG = "xc-store-probe"


def program(url: str, env: dict[str, str]) -> str:
    """training/store.py itself, then the probe: the node needs only python and boto3, not the shipped code."""
    return (Path(shared.__file__).read_text() + "\n\nimport os as _os\n"
            f"_os.environ.update({env!r})\n"
            "try:\n"
            f"    print({TAG!r}, 'ok', round(probe({url!r}), 3))\n"
            "except StoreError as _exc:\n"
            f"    print({TAG!r}, 'error', _exc)\n")


def probe_node(node: Node, url: str, env: dict[str, str]) -> tuple[bool, str]:
    with connect(node) as conn:
        # a 0600 file removed at once (as secrets.env): invoke feeds stdin a byte at a time, too slow for 16 kB
        path = f"{remote_home(conn)}/.{TAG}-{uuid.uuid4().hex[:8]}.py"
        run(conn, f"(umask 077 && : > {shlex.quote(path)})")
        try:
            conn.put(io.StringIO(program(url, env)), path)
            res = run(conn, f"{shlex.quote(node.python)} {shlex.quote(path)}", timeout=120)
        finally:
            run(conn, f"rm -f {shlex.quote(path)}")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(TAG)), None)
    if line is None:
        return False, (res.stderr.strip().splitlines() or [f"exit status {res.exited}"])[-1]
    _, verdict, detail = line.split(" ", 2)
    return verdict == "ok", detail


def store_rows(nodes: list[Node], choice: store_lib.Choice, spec: str | None) -> list[Row]:
    """One row per node: 'store' ok with the probe's seconds, or the store's one-line error as the fix."""
    try:
        store_lib.check_reachable_from_nodes(choice, spec)
    except ClusterError as exc:  # an AWS cluster with no store of its own: one red row, no probe
        what, _, fix = str(exc).partition("; ")
        return [Row(CLUSTER, "store", False, what, fix)]
    env = store_lib.rank_env(choice, spec)
    results = fan_out(nodes, lambda n: _safe(n, choice.url, env), "probing the store")
    rows = []
    for node, (ok, detail) in zip(nodes, results):
        if ok:
            rows.append(Row(node.name, "store", True, f"{choice.url}: write, read, delete in {detail}s"))
        else:
            what, _, fix = detail.partition("; ")  # the store's one line: what, then the fix
            rows.append(Row(node.name, "store", False, what, fix or "check the store URL (--store / XC_STORE)"))
    return rows


def _safe(node: Node, url: str, env: dict[str, str]) -> tuple[bool, str]:
    try:
        return probe_node(node, url, env)
    except Exception as exc:  # noqa: BLE001 - an unreachable node is a red row, not an abort
        return False, str(exc)
