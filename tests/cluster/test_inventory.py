"""Inventory: the hosts-file source, node selection and their errors."""
import pytest

from cluster import inventory
from core.errors import ClusterError


def test_hosts_file(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# on-prem\nnode0 203.0.113.10 private=10.0.0.10 user=ubuntu\n\nnode1 203.0.113.11 port=2200  # spare\n")
    nodes = inventory.load_nodes(f"hosts:{f}")
    assert [n.name for n in nodes] == ["node0", "node1"]
    assert nodes[0].private_host == "10.0.0.10" and nodes[0].user == "ubuntu" and nodes[0].port == 22
    assert nodes[1].private_host == "203.0.113.11" and nodes[1].port == 2200 and nodes[1].index == 1


@pytest.mark.parametrize("content, message", [
    ("node0\n", "expected 'name address"),
    ("node0 1.2.3.4 colour=blue\n", "unknown field"),
    ("node0 1.2.3.4 port=ssh\n", "not a number"),
    ("a 1.2.3.4\na 1.2.3.5\n", "a appear more than once; give every node its own name"),
])
def test_hosts_file_errors(tmp_path, content, message):
    f = tmp_path / "hosts"
    f.write_text(content)
    with pytest.raises(ClusterError, match=message):
        inventory.parse_hosts_file(f)


def test_missing_hosts_file_and_unknown_source(tmp_path):
    with pytest.raises(ClusterError, match="does not exist"):
        inventory.load_nodes(f"hosts:{tmp_path}/nope")
    with pytest.raises(ClusterError, match="not a known source"):
        inventory.load_nodes("moon")


def test_select_errors_name_the_fix():
    nodes = [inventory.Node(f"n{i}", "h", "h", "u", index=i) for i in range(4)]
    assert [n.name for n in inventory.select(nodes, 2)] == ["n0", "n1"]
    with pytest.raises(ClusterError, match=r"--nodes 6 but the cluster 'local' has 4 nodes; run 'fab local-up --nodes 6'"):
        inventory.select(nodes, 6, "local")
    with pytest.raises(ClusterError, match=r"nodeCount=6"):
        inventory.select(nodes, 6, "aws")
    with pytest.raises(ClusterError, match="below 1"):
        inventory.select(nodes, 0)


def test_local_source_without_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path))
    with pytest.raises(ClusterError, match="fab local-up"):
        inventory.load_nodes("local")


@pytest.mark.parametrize("text, message", [
    ("node0 10.0.0.1 user='ubuntu\n", "No closing quotation in \"node0 10.0.0.1 user='ubuntu\"; fix the quoting"),
    ("node0 10.0.0.1 port=99999\n", "port=99999 is not a TCP port; use 1..65535"),
    ("node0 10.0.0.1\nnode1 10.0.0.1\n", "node0 and node1 are the same machine (10.0.0.1:22); list each machine once"),
])
def test_bad_hosts_files_are_one_line(tmp_path, text, message):
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    with pytest.raises(ClusterError) as err:
        inventory.parse_hosts_file(hosts)
    assert message in str(err.value) and "\n" not in str(err.value)
