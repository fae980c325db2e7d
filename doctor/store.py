"""`fab doctor`'s store row: every node writes, reads back and deletes a probe object in the cluster's store,
with the credentials its ranks would get (in a 0600 file removed right after, never on a command line), asking
only what the node role allows (infra.store.node_statements): objects and listing under the cluster's prefix."""
from __future__ import annotations

import inspect
import io
import json
import shlex
import time
import uuid

from cluster import shipping
from cluster import store as store_lib
from cluster.node import Node
from cluster.remote import connect, fan_out, remote_home, run
from core.errors import ClusterError
from core.report import CLUSTER, Row
from training.store import S3Store, StoreError, explain, open_store

TAG = "xc-store-probe"
PROBE_PREFIX = ".xc-probe/"  # under the store's prefix, where the node role may write and delete


def node_probe(url: str) -> float:
    """Runs on the node (its source follows training/store.py's in the program): list under the prefix, then
    write, read back and delete a probe object; returns the seconds. Not HeadBucket, which needs s3:ListBucket
    without a prefix condition, which the node role has not. Raises StoreError with the one line."""
    started = time.monotonic()
    try:
        store = open_store(url)
        if isinstance(store, S3Store):
            reply = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.key(PROBE_PREFIX), MaxKeys=1)
            actual = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
            mine = store.client.meta.region_name
            if actual and mine and actual != mine:  # S3 redirects, but every byte would cross regions
                raise StoreError(f"store {url}: the bucket is in {actual} but AWS_REGION is {mine}", fix=f"export "
                                 f"AWS_REGION={actual} (or use a bucket in {mine})")
        key, body = f"{PROBE_PREFIX}{uuid.uuid4().hex}", uuid.uuid4().bytes
        store.put_bytes(key, body)
        if store.get_bytes(key) != body:
            raise StoreError(f"store {url}: a probe object read back differently", fix="check the store's consistency")
        store.delete(key)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the one line that says the fix
        raise explain(exc, url) from None
    return time.monotonic() - started


def program(url: str, env: dict[str, str]) -> str:
    """training/store.py (and what it imports) inside the program, then the probe: the node needs only python and
    boto3, not the shipped code."""
    return shipping.standalone(
        "import time, uuid\nfrom training.store import S3Store, StoreError, explain, open_store\n"
        f"PROBE_PREFIX = {PROBE_PREFIX!r}\n\n\n"
        + inspect.getsource(node_probe) + "\n\nimport os as _os\n"
        f"_os.environ.update({env!r})\n"
        "import json as _json\n"
        "try:\n"
        f"    print({TAG!r}, _json.dumps({{'ok': True, 'seconds': round(node_probe({url!r}), 3)}}))\n"
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
