"""Notices and kills for `fab local-notice` and `fab local-kill`: on the AWS twin an instance's IMDS posts the notice
and, at its end, EC2 or the group takes the instance (twin.watch); on a plain local cluster the node's own
metadata service posts it and the node goes at its end as `fab local-kill` takes it.
"""
from __future__ import annotations

import datetime
import json
import re
import sys
import time
from pathlib import Path

from cluster import aws, local
from core.errors import ClusterError
from twin.up import DEFAULT_AFTER, KINDS, _spawn, booted, clients, read, require, state_dir, write_imds


def resolve(name: str, record: dict) -> dict:
    """'head', 'nodeI' (fab's node I: the master first, then the oldest), '<cluster>-I', or an instance id."""
    boots = [b for b in booted(state_dir_of(record)) if b.get("ready")]
    if name == "head":
        heads = [b for b in boots if b["role"] == "head"]
        if not heads:
            raise ClusterError("the AWS twin has no head up", fix="wait for its group to replace it ('fab status')")
        return heads[0]
    by_id = {b["instance_id"]: b for b in boots}
    if name in by_id:
        return by_id[name]
    m = re.fullmatch(rf"(?:node|{re.escape(record['cluster'])}-)(\d+)", name)
    if m:
        ec2, _ = clients(record)
        order = [i["InstanceId"] for i in aws.order_nodes(ec2, aws.members(aws._running(ec2, [
            {"Name": "tag:aws:autoscaling:groupName", "Values": [record["groups"]["nodes"]]}]), record["cluster"],
            record["groups"]["nodes"], warn=False), record["cluster"])]
        i = int(m[1])
        if i < len(order) and order[i] in by_id:
            return by_id[order[i]]
    nodes = ", ".join(f"node{i}" for i in range(record["nodes"]))
    raise ClusterError(f"no twin instance {name!r}", fix=f"name one of {nodes}, head, or an instance id ('fab status')")


def state_dir_of(record: dict) -> Path:
    return Path(record["key"]).parent


def notice(name: str, kind: str, after: float | None, state: Path | None = None) -> str:
    if kind not in KINDS:
        raise ClusterError(f"--kind {kind!r} is not a notice", fix=f"use one of {', '.join(KINDS)}")
    if after is not None and after < 0:
        raise ClusterError(f"--after {after} is below 0", fix="give the seconds until the instance goes, e.g. --after 30")
    record = read(state)
    if not record:
        return local_notice(name, kind, after)
    state = state or state_dir()
    boot = resolve(name, record)
    after = DEFAULT_AFTER[kind] if after is None else after
    now = time.time()
    node_dir = state / "instances" / boot["instance_id"]
    if kind == "spot":
        when = datetime.datetime.fromtimestamp(now + after, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        write_imds(node_dir, notice={"action": "terminate", "time": when})
    elif kind == "rebalance":
        when = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        write_imds(node_dir, rebalance={"noticeTime": when})
        return f"{name} ({boot['instance_id']}): rebalance recommendation served by its IMDS; the instance stays"
    else:
        write_imds(node_dir, lifecycle_state="Terminated")
    actions = state / "actions"
    actions.mkdir(exist_ok=True)
    (actions / f"{boot['instance_id']}.json").write_text(json.dumps(
        {"instance": boot["instance_id"], "kind": kind, "at": now + after, "after": after, "since": now}))
    how = ("EC2 terminates it" if kind == "spot" else
           "its group terminates it once it completes the lifecycle action or the heartbeat runs out")
    return f"{name} ({boot['instance_id']}): {kind} notice served by its IMDS; in {after:g} s {how}, and the group replaces it"


def local_notice(name: str, kind: str, after: float | None, state: Path | None = None) -> str:
    """On a local cluster: the node's own metadata service posts the notice; at its end the node goes as
    'fab local-kill' takes it ('fab local-up' brings it back, as a group would)."""
    state = state or local.state_dir()
    data = local._read_state(state)
    if not data:
        raise ClusterError("no AWS twin and no local cluster is up", fix="start one with 'fab local-up --nodes 2' "
                           "or 'sudo fab local-up --aws --nodes 2'")
    entry = next((e for e in data["nodes"] if e["name"] == name), None)
    if entry is None:
        raise ClusterError(f"no local node {name!r}", fix=f"the nodes are {', '.join(e['name'] for e in data['nodes'])}")
    if not entry.get("imds"):
        raise ClusterError(f"{name} was started without a metadata service", fix="restart the cluster with 'fab "
                           "local-down' and 'fab local-up'")
    after = DEFAULT_AFTER[kind] if after is None else after
    doc_file = Path(entry["imds"]["doc"])
    doc = json.loads(doc_file.read_text())
    now = datetime.datetime.now(datetime.timezone.utc)
    if kind == "spot":
        doc["notice"] = {"action": "terminate", "time": (now + datetime.timedelta(seconds=after)).strftime(
            "%Y-%m-%dT%H:%M:%SZ")}
    elif kind == "rebalance":
        doc["rebalance"] = {"noticeTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    else:
        doc["lifecycle_state"] = "Terminated"
    tmp = doc_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(doc_file)
    if kind == "rebalance":
        return f"{name}: rebalance recommendation served by its metadata service; the node stays"
    _spawn([sys.executable, "-m", "twin.notice", "end-local", str(state), name, str(after)], state / "notices.log")
    return (f"{name}: {kind} notice served by its metadata service; in {after:g} s the node goes as 'fab local-kill' "
            f"takes it; 'fab local-up --nodes {len(data['nodes'])}' brings it back")


def _end_local(state: Path, name: str, after: float) -> None:
    time.sleep(after)
    try:
        local.kill_node(name, state)
    except ClusterError as exc:  # the cluster went down meanwhile
        print(f"{name}: {exc}", flush=True)


def kill(name: str, state: Path | None = None) -> str:
    record = require(state)
    boot = resolve(name, record)
    ec2, _ = clients(record)
    ec2.terminate_instances(InstanceIds=[boot["instance_id"]])
    return f"{name} ({boot['instance_id']}) terminated with no notice; its group launches a replacement"


if __name__ == "__main__":
    if sys.argv[1:2] == ["end-local"]:
        _end_local(Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
