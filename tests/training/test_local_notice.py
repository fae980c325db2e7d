"""`fab local-notice` on a plain local cluster: every node has its own metadata service (cluster.imds on its
address, one port above sshd's, named to its sessions by sshd), which posts the notice; at its end the node goes
as `fab local-kill` takes it. A 2-node run that takes such a notice ends preempted: checked by hand in the issue's
closing note; here the parts, on a cluster of the test's own (the notice takes a node down)."""
from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from conftest import start_cluster

pytestmark = pytest.mark.cluster


def imds_get(endpoint: str, path: str) -> tuple[int, str]:
    token = urllib.request.urlopen(urllib.request.Request(
        endpoint + "/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}),
        timeout=5).read().decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint + path, headers={
                "X-aws-ec2-metadata-token": token}), timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_local_notice_posts_on_the_nodes_own_imds_and_takes_the_node_at_its_end(tmp_path):
    lc = start_cluster(tmp_path, 2)
    try:
        state = json.loads((lc.state / "state.json").read_text())
        endpoints = {e["name"]: e["imds"]["endpoint"] for e in state["nodes"]}
        assert endpoints["node1"] == f"http://127.0.0.3:{lc.port + 1}"
        config = (lc.state / "nodes" / "node1" / "sshd_config").read_text()
        assert f"XC_IMDS_ENDPOINT={endpoints['node1']}" in config  # node1's sessions (its ranks) poll their own
        assert imds_get(endpoints["node1"], "/latest/meta-data/spot/instance-action")[0] == 404

        said = lc.fab("local-notice", "node0", "--kind", "rebalance", timeout=60)
        assert said.returncode == 0 and "node stays" in said.stdout, said.stdout + said.stderr
        assert imds_get(endpoints["node0"], "/latest/meta-data/events/recommendations/rebalance")[0] == 200
        assert imds_get(endpoints["node1"], "/latest/meta-data/events/recommendations/rebalance")[0] == 404

        said = lc.fab("local-notice", "node1", "--kind", "spot", "--after", "2", timeout=60)
        assert said.returncode == 0 and "in 2 s the node goes" in said.stdout, said.stdout + said.stderr
        status, body = imds_get(endpoints["node1"], "/latest/meta-data/spot/instance-action")
        assert status == 200 and json.loads(body)["action"] == "terminate"
        deadline = time.monotonic() + 30
        while not re.search(r"^node1 .* DOWN", lc.fab("status", "--no-runs", timeout=60).stdout, re.MULTILINE):
            assert time.monotonic() < deadline, "node1 still up 30 s after its notice ended"
            time.sleep(1)
        # the group's part: 'fab local-up' brings it back, with a metadata service that has nothing to say
        lc.fab("local-up", "--nodes", "2", "--port", str(lc.port), "--no-head", check=True, timeout=60)
        assert imds_get(endpoints["node1"], "/latest/meta-data/spot/instance-action")[0] == 404

        for args, want in ((["local-notice", "node9"], "no local node 'node9'"),
                           (["local-notice", "node1", "--kind", "storm"], "--kind 'storm' is not a notice")):
            res = lc.fab(*args, timeout=60)
            assert res.returncode != 0 and want in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr
    finally:
        lc.fab("local-down", timeout=60)
    none = lc.fab("local-notice", "node1", timeout=60)
    assert none.returncode != 0 and "no AWS twin and no local cluster is up" in none.stderr, none.stderr
