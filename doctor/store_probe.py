"""`fab doctor`'s store row: every node writes, reads back and deletes a probe object in the cluster's store,
with the credentials its ranks would get (in a 0600 file removed right after, never on a command line), asking
only what the node role allows (infra.bucket.node_statements): objects and listing under the cluster's prefix."""
from __future__ import annotations

import io
import json
import shlex
import uuid

from cluster import shipping
from cluster import store as store_lib
from cluster.node import Node
from cluster.remote import connect, fan_out, remote_home, run
from core.errors import ClusterError
from core.report import CLUSTER, Row

TAG = "xc-store-probe"


def program(url: str, env: dict[str, str]) -> str:
    """training/runtime/store.py (and what it imports) inside the program, then the probe: the node needs only python and
    boto3, not the shipped code."""
    return shipping.standalone(
        "from training.runtime.store import StoreError, probe\n"
        "import os as _os\n"
        f"_os.environ.update({env!r})\n"
        "import json as _json\n"
        "try:\n"
        f"    print({TAG!r}, _json.dumps({{'ok': True, 'seconds': round(probe({url!r}), 3)}}))\n"
        "except StoreError as _exc:\n"
        f"    print({TAG!r}, _json.dumps({{'ok': False, 'what': _exc.what, 'fix': _exc.fix}}))\n")


def probe_node(node: Node, url: str, env: dict[str, str]) -> dict:
    """{'ok': True, 'seconds': s} or {'ok': False, 'what': ..., 'fix': ...}."""
    with connect(node) as conn:
        # a 0600 file removed at once (as secrets.env): invoke feeds stdin a byte at a time, too slow for 16 kB
        path = f"{remote_home(conn)}/.{TAG}-{uuid.uuid4().hex[:8]}.py"
        run(conn, f"(umask 077 && : > {shlex.quote(path)})")
        try:
            conn.put(io.StringIO(program(url, env)), path)
            res = run(conn, f"{shlex.quote(node.python)} {shlex.quote(path)}", timeout=120)
        finally:
            run(conn, f"rm -f {shlex.quote(path)}")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(TAG + " ")), None)
    if line is None:
        return {"ok": False, "what": (res.stderr.strip().splitlines() or [f"exit status {res.exited}"])[-1]}
    return json.loads(line[len(TAG) + 1:])


def store_rows(nodes: list[Node], choice: store_lib.Choice, spec: str | None) -> list[Row]:
    """One row per node: 'store' ok with the probe's seconds, or the store's one-line error as the fix."""
    try:
        store_lib.check_reachable_from_nodes(choice, spec)
    except ClusterError as exc:  # an AWS cluster with no store of its own: one red row, no probe
        return [Row(CLUSTER, "store", False, exc.what, exc.fix)]
    env = store_lib.rank_env(choice, spec)
    results = fan_out(nodes, lambda n: _safe(n, choice.url, env), "probing the store")
    rows = []
    for node, got in zip(nodes, results):
        if got["ok"]:
            rows.append(Row(node.name, "store", True, f"{choice.url}: write, read, delete in {got['seconds']}s"))
        else:
            rows.append(Row(node.name, "store", False, got["what"],
                            got.get("fix") or "check the store URL (--store / XC_STORE)"))
    return rows


def _safe(node: Node, url: str, env: dict[str, str]) -> dict:
    try:
        return probe_node(node, url, env)
    except ClusterError as exc:
        return {"ok": False, "what": exc.what, "fix": exc.fix}
    except Exception as exc:  # noqa: BLE001 - an unreachable node is a red row, not an abort
        return {"ok": False, "what": f"{type(exc).__name__}: {exc}"}
