"""`fab ssh NODE [-- CMD]` on a real local cluster: OpenSSH with the cluster's key, user and verified host keys, to the
node named, with the remote command's exit code."""
from __future__ import annotations

import pytest
from conftest import fab, start_cluster

from cluster.node import Node


@pytest.fixture(scope="module")
def headed(tmp_path_factory):
    lc = start_cluster(tmp_path_factory.mktemp("ssh"), 2, head=True)
    yield lc
    fab("local-down", env=lc.env, timeout=60)


def served_by(out: str) -> str:
    """The server address of $SSH_CONNECTION ('client port server port'): which node the session reached (local
    nodes share this machine's host name, not their addresses)."""
    return out.split()[2]


def test_a_command_runs_on_the_node_named_and_its_exit_code_comes_back(headed):
    for name, address in (("node0", "127.0.0.2"), ("node1", "127.0.0.3"), ("head", "127.0.0.4")):
        r = headed.fab("ssh", name, "--", "echo", "$SSH_CONNECTION", timeout=60)
        assert r.returncode == 0, r.stderr
        assert served_by(r.stdout) == address, (name, r.stdout)
    assert headed.fab("ssh", "node1", "--", "exit", "7", timeout=60).returncode == 7
    assert headed.fab("ssh", "node1", "--", "nproc", timeout=60).stdout.strip().isdigit()


def test_a_node_the_cluster_lacks_is_one_line_naming_the_choices(headed, cluster2):
    r = headed.fab("ssh", "node5", "--", "true", timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: cluster local has no node 'node5'; pass one of node0..node1, head ('fab status')"]
    r = cluster2.fab("ssh", "head", "--", "true", timeout=60)  # started with --no-head
    assert r.returncode == 1 and "has no head" in r.stderr


def test_host_keys_are_checked_never_added(tmp_path):
    from cluster import ssh as ssh_lib
    from cluster.resolve import Cluster

    known = tmp_path / "known_hosts"
    known.write_text("[127.0.0.9]:2222 ssh-ed25519 AAAA\n")
    node = Node(name="node0", host="127.0.0.9", private_host="127.0.0.9", port=2222, user="u", labels={"known_hosts": str(known)})
    argv = ssh_lib.argv(Cluster(spec="hosts:x", nodes=(node,), state=tmp_path), node, ["ls", "-l"])
    assert f"UserKnownHostsFile={known}" in argv
    assert [a for a in argv if a.startswith("StrictHostKeyChecking")] == ["StrictHostKeyChecking=yes"]  # the one
    assert argv[-3:] == ["u@127.0.0.9", "--", "ls -l"]
