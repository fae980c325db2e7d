"""The network twin (`fab local-up --netns`): nodes in network namespaces of their own, reachable only through
their links, which tc shapes and `fab local-link` cuts; `fab local-down` leaves nothing of it.

The cluster tests need root and a machine where `ip netns add` works; elsewhere they skip saying why. A link's
latency needs the kernel's netem; where it is missing the twin is shaped by rate alone and the latency test
checks the one-line error instead.
"""
from __future__ import annotations

import functools
import getpass
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LocalCluster, free_cluster_port, processes_with_cmdline

from cluster import netns
from core import procs
from core.constants import MAX_NODES
from core.errors import ClusterError


def _ip(*args: str, check: bool = True) -> str:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check:
        assert res.returncode == 0, f"ip {' '.join(args)}: {res.stderr}"
    return res.stdout


@functools.cache
def netns_missing() -> str | None:
    """Why the twin cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "--netns needs root (network namespaces and tc)"
    if not (shutil.which("ip") and shutil.which("tc") and shutil.which("unshare")):
        return "ip, tc or unshare is not installed"
    name = f"xc-testprobe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return f"'ip netns add' does not work on this machine: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return None


@functools.cache
def have_netem() -> bool:
    name = f"xc-testnetem-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], capture_output=True, check=True)
    try:
        return subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                              capture_output=True, check=False).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def start_twin(tmp: Path, nodes: int, *shaping: str) -> tuple[LocalCluster, subprocess.CompletedProcess]:
    reason = netns_missing()
    if reason:
        pytest.skip(reason)
    lc = LocalCluster(tmp / "state", tmp / "runs", nodes, free_cluster_port(nodes))
    res = lc.fab("local-up", "--nodes", str(nodes), "--port", str(lc.port), "--netns", *shaping, timeout=120)
    return lc, res


def scrub(lc: LocalCluster) -> None:
    """Whatever a failed test left of the twin goes, whatever the state file says."""
    lc.fab("local-down", timeout=120)
    netns.teardown(netns.Twin.of(lc.state))


def record(lc: LocalCluster) -> dict:
    return json.loads((lc.state / "state.json").read_text())


def ssh(lc: LocalCluster, host: str, command: str) -> subprocess.CompletedProcess:
    """The operator's own ssh to a node, with the cluster's key and verified host keys."""
    return subprocess.run(["ssh", "-i", str(lc.state / "operator_ed25519"), "-o",
                           f"UserKnownHostsFile={lc.state / 'known_hosts'}", "-o", "BatchMode=yes", "-o",
                           "ConnectTimeout=10", "-p", str(lc.port), f"{getpass.getuser()}@{host}",
                           command], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    shaping = ["--link", "1gbit"] + (["--latency", "1ms"] if not netns_missing() and have_netem() else [])
    lc, res = start_twin(tmp_path_factory.mktemp("twin"), 2, *shaping)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        lc.up_output = res.stdout
        lc.fab("keys", check=True, timeout=120)  # node 0 reaches the others with verified host keys
        yield lc
    finally:
        scrub(lc)


def sshd_pid(lc: LocalCluster, name: str) -> int:
    return next(e["pid"] for e in record(lc)["nodes"] if e["name"] == name)


def transfer_s(ns: str, host: str, size: int) -> float:
    """Seconds to send `size` bytes from the operator to a sink inside namespace `ns` and hear back."""
    sink = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", (
        "import socket\n"
        f"s = socket.create_server(({host!r}, 0))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "c, _ = s.accept()\n"
        "n = 0\n"
        f"while n < {size}:\n"
        "    b = c.recv(1 << 20)\n"
        "    if not b:\n"
        "        break\n"
        "    n += len(b)\n"
        "c.sendall(b'k')\n")], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        with socket.create_connection((host, port), timeout=30) as conn:
            start = time.monotonic()
            conn.sendall(b"x" * size)
            assert conn.recv(1) == b"k"
            return time.monotonic() - start
    finally:
        sink.kill()
        sink.wait(10)


# ---- without a cluster: the flags and the names ----------------------------------------------------------

def test_shaping_is_netem_for_a_delay_and_tbf_for_a_rate_alone():
    assert netns.qdisc_args(None, None) is None
    assert netns.qdisc_args(None, "50us") == ["netem", "delay", "50us"]
    assert netns.qdisc_args("3gbit", "50us")[:5] == ["netem", "delay", "50us", "rate", "3gbit"]
    assert netns.qdisc_args("10gbit", "10ms")[-1] == str(int(2 * 10e9 / 8 * 0.01 / 1514))  # 2 BDPs queue
    tbf = netns.qdisc_args("500mbit", None)
    assert tbf[:3] == ["tbf", "rate", "500mbit"] and int(tbf[tbf.index("burst") + 1]) >= 16 * 1514
    for bad in ("x", "3gb", "0gbit", "3 gbit", "-1mbit"):
        with pytest.raises(ClusterError, match=r"is not a rate like 3gbit or 500mbit; pass"):
            netns.check_shape(bad, None)
    for bad in ("soon", "1", "5min", "-1ms"):
        with pytest.raises(ClusterError, match=r"is not a delay like 50us or 1ms; pass"):
            netns.check_shape(None, bad)


def test_names_fit_linux_interface_names_and_differ_per_state_folder(tmp_path):
    a, b = netns.Twin.of(tmp_path / "a"), netns.Twin.of(tmp_path / "b")
    assert a.id != b.id and a == netns.Twin.of(tmp_path / "a")
    assert all(len(n) <= 15 for n in (a.bridge, a.veth(MAX_NODES - 1)))
    assert a.owns_link(a.veth(12)) and a.owns_link(a.bridge) and not a.owns_link(b.veth(0))
    assert a.owns_ns(a.ns(3)) and not a.owns_ns(b.ns(3))


def test_without_root_the_twin_is_one_line_and_nothing_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError) as err:
        netns.up(2, state=tmp_path / "state" / "local")
    assert str(err.value) == "--netns needs root (network namespaces and tc); run as root or without --netns"
    assert not (tmp_path / "state").exists()


# ---- a real twin -----------------------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_twin_comes_up_on_its_own_addresses_and_doctor_quick_is_green(twin):
    rec = record(twin)["netns"]
    subnet = ipaddress.IPv4Network(rec["subnet"])
    assert subnet.subnet_of(ipaddress.IPv4Network("198.18.0.0/15")) and subnet.prefixlen == 24
    hosts = [e["node"]["host"] for e in record(twin)["nodes"]]
    assert hosts == [str(subnet[2]), str(subnet[3])]
    assert f"node1={subnet[3]}" in twin.up_output and f"network twin {subnet}" in twin.up_output
    doc = twin.fab("doctor", "--quick", timeout=180)
    assert doc.returncode == 0, doc.stdout[-3000:] + doc.stderr[-2000:]
    assert "verdict: healthy" in doc.stdout


@pytest.mark.cluster
def test_each_node_is_reachable_only_through_its_link(twin):
    rec = record(twin)["netns"]
    tw = netns.Twin(rec["id"])
    subnet = rec["subnet"]
    for i, entry in enumerate(record(twin)["nodes"]):
        host, ns, pid = entry["node"]["host"], tw.ns(i), entry["pid"]
        with socket.create_connection((host, twin.port), timeout=10) as conn:  # through the bridge: sshd answers
            assert conn.recv(64).startswith(b"SSH-2.0-")
        with pytest.raises(OSError):  # the loopback cluster's addresses hold nothing of it
            socket.create_connection((f"127.0.0.{2 + i}", twin.port), timeout=3).close()
        assert _ip("netns", "identify", str(pid)).strip() == ns  # the sshd lives in the node's namespace
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        # inside: lo and eth0, its one address, and one route: the link's subnet
        assert {line.split(":")[1].strip().split("@")[0] for line in _ip("-n", ns, "-o", "link").splitlines()} \
            == {"lo", "eth0"}
        assert _ip("-n", ns, "-4", "-o", "addr", "show", "dev", "eth0").split()[3] == f"{host}/24"
        assert [r.strip() for r in _ip("-n", ns, "-4", "route").splitlines()] == \
            [f"{subnet} dev eth0 proto kernel scope link src {host}"]  # no default route, no other way out
        for family in ("-4", "-6"):  # every route of every table leaves through eth0 or stays on lo
            routes = _ip("-n", ns, family, "route", "show", "table", "all").splitlines()
            assert all(" dev eth0 " in r or " dev lo " in r for r in routes), routes
    # on the operator's side each link is one port of the bridge
    ports = {line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show", "master",
                                                                     tw.bridge).splitlines()}
    assert ports == {tw.veth(0), tw.veth(1)}
    # a node is a host of its own: its hostname resolves to its own address, the others' through the links
    node0, node1 = (e["node"]["host"] for e in record(twin)["nodes"])
    res = ssh(twin, node1, "hostname; getent hosts node0; python3 -c 'import socket; "
                           "print(socket.gethostbyname(socket.gethostname()))'")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["node1", node0, "node0", node1]
    config = twin.state / "nodes" / "node0" / "home" / "ssh" / "config"  # node 0 reaches node1 through both links
    res = ssh(twin, node0, f"ssh -F {config} node1 hostname")
    assert res.returncode == 0 and res.stdout.strip() == "node1", res.stderr


@pytest.mark.cluster
def test_each_link_is_shaped_at_both_ends_and_local_link_reshapes_it(twin):
    rec = record(twin)["netns"]
    tw = netns.Twin(rec["id"])
    node0, node1 = (e["node"]["host"] for e in record(twin)["nodes"])
    for show in (["tc", "qdisc", "show", "dev", tw.veth(1)], ["tc", "-n", tw.ns(1), "qdisc", "show", "dev", "eth0"]):
        out = subprocess.run(show, capture_output=True, text=True, check=True).stdout
        assert "rate 1Gbit" in out, out
        assert ("netem" in out and "delay 1ms" in out) if rec["latency"] else "tbf" in out, out
    res = twin.fab("local-link", "--node", "node1", "--link", "20mbit", timeout=60)
    try:
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip().startswith(f"node1's link ({tw.veth(1)}) shaped to rate 20mbit")
        slow = transfer_s(tw.ns(1), node1, 2_500_000)  # 20 Mbit/s: 1 s
        fast = transfer_s(tw.ns(0), node0, 2_500_000)  # 1 Gbit/s: 20 ms
        print(f"2.5 MB through node1's 20mbit link: {slow:.2f} s; through node0's 1gbit link: {fast:.3f} s")
        assert slow >= 0.8 and fast < slow / 3, (slow, fast)
    finally:
        twin.fab("local-link", "--node", "node1", "--link", "1gbit", check=True, timeout=60)


@pytest.mark.cluster
def test_a_link_delays_each_way_by_its_latency(twin):
    if not have_netem():
        pytest.skip("this kernel has no netem queueing discipline (sch_netem): links are shaped by rate only")
    node1 = record(twin)["nodes"][1]["node"]["host"]
    rtts = []
    for _ in range(10):
        start = time.monotonic()
        socket.create_connection((node1, twin.port), timeout=10).close()  # SYN / SYN-ACK: one round trip
        rtts.append(time.monotonic() - start)
    print(f"TCP connect round trip to node1 through its 1ms link: min {min(rtts) * 1e3:.2f} ms")
    assert min(rtts) >= 0.0019  # 1 ms out, 1 ms back


@pytest.mark.cluster
def test_without_netem_a_latency_is_one_line_naming_netem(twin):
    if have_netem():
        pytest.skip("this kernel has netem: the latency test measures the delay instead")
    res = twin.fab("local-link", "--node", "node1", "--latency", "1ms", timeout=60)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and lines[-1].startswith("error: --latency needs the kernel's netem queueing "
                                                        "discipline, which this kernel lacks"), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.cluster
def test_a_cut_link_makes_doctor_name_the_node_and_a_restored_one_is_green(twin):
    tw = netns.Twin(record(twin)["netns"]["id"])
    cut = twin.fab("local-link", "--node", "node1", "--cut", timeout=60)
    try:
        assert cut.returncode == 0, cut.stderr
        assert cut.stdout.strip() == (f"node1's link ({tw.veth(1)}) cut; restore it with 'fab local-link --node "
                                      "node1 --restore'")
        assert "state DOWN" in _ip("link", "show", tw.veth(1))
        assert sshd_pid(twin, "node1") in processes_with_cmdline(str(twin.state / "nodes" / "node1"))  # it runs on
        start = time.monotonic()
        doc = twin.fab("doctor", "--quick", timeout=180)
        print(f"doctor --quick with node1's link cut: exit {doc.returncode} in {time.monotonic() - start:.1f} s")
        error = doc.stderr.strip().splitlines()[-1]
        assert doc.returncode != 0 and error.startswith("error: doctor found"), doc.stdout[-3000:] + doc.stderr
        assert "node1 reachable: node1 (" in error and "is unreachable" in error, error
        assert "node0 reachable" not in error and "Traceback" not in doc.stderr
    finally:
        restored = twin.fab("local-link", "--node", "node1", "--restore", timeout=60)
    assert restored.returncode == 0 and restored.stdout.strip() == f"node1's link ({tw.veth(1)}) restored"
    doc = twin.fab("doctor", "--quick", timeout=180)
    assert doc.returncode == 0, doc.stdout[-3000:] + doc.stderr[-2000:]


@pytest.mark.cluster
def test_a_killed_node_comes_back_in_its_own_namespace(twin):
    tw = netns.Twin(record(twin)["netns"]["id"])
    old = sshd_pid(twin, "node1")
    assert twin.fab("local-kill", "--node", "node1", timeout=60).returncode == 0
    assert twin.fab("status", "--no-runs", timeout=60).returncode == 1  # node1 DOWN
    other = twin.fab("local-up", "--nodes", "2", "--netns", "--link", "5mbit", timeout=60)
    assert other.returncode == 1 and "error: the network twin is up with rate 1gbit" in other.stderr, other.stderr
    back = twin.fab("local-up", "--nodes", "2", timeout=60)  # the plain form brings the dead node back too
    assert back.returncode == 0, back.stderr
    new = sshd_pid(twin, "node1")
    assert new != old and _ip("netns", "identify", str(new)).strip() == tw.ns(1)
    res = ssh(twin, record(twin)["nodes"][1]["node"]["host"], "hostname")
    assert res.returncode == 0 and res.stdout.strip() == "node1", res.stderr


@pytest.mark.cluster
def test_a_failed_start_leaves_nothing_of_the_twin(tmp_path, monkeypatch):
    reason = netns_missing()
    if reason:
        pytest.skip(reason)
    state = tmp_path / "state" / "local"
    tw = netns.Twin.of(state)
    made = []

    def failing_up(*args, **kwargs):  # the network is there when the nodes' sshd would start
        made.extend(netns.parts(tw))
        raise ClusterError("node1: sshd exited at start-up: planted")

    monkeypatch.setattr(netns.local, "up", failing_up)
    with pytest.raises(ClusterError, match="planted"):
        netns.up(2, port=free_cluster_port(2), link="1gbit", state=state)
    assert {tw.bridge, tw.veth(0), tw.veth(1), tw.ns(0), tw.ns(1)} <= set(made)
    assert netns.parts(tw) == []


@pytest.mark.cluster
@pytest.mark.parametrize("state_file", ["intact", "corrupt"])
def test_local_down_leaves_no_namespace_link_bridge_or_sshd(tmp_path, state_file):
    lc, res = start_twin(tmp_path, 2, "--link", "100mbit")
    tw = netns.Twin.of(lc.state)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        node1 = record(lc)["nodes"][1]["node"]["host"]
        # a process a session left behind (not a child of sshd) lives in node1's namespace until the twin goes
        assert ssh(lc, node1, "setsid sleep 600 </dev/null >/dev/null 2>&1 &").returncode == 0
        time.sleep(0.5)
        inside = [int(p) for p in _ip("netns", "pids", tw.ns(1)).split()]
        assert len(inside) >= 2  # sshd and the sleep
        if state_file == "corrupt":
            (lc.state / "state.json").write_text("{")
        down = lc.fab("local-down", timeout=120)
        assert down.returncode == 0, down.stderr
        assert down.stdout.startswith("local cluster down: 2 node(s) stopped; network twin removed (")
        assert not [s for s in _ip("netns", "list").split() if s.startswith(f"xc-{tw.id}-")]
        assert not [n for n in _ip("-o", "link", "show").split() if n.rstrip(":").split("@")[0].startswith(
            (tw.bridge, f"xcv{tw.id}"))]
        assert processes_with_cmdline(str(lc.state)) == []
        assert not [p for p in inside if procs.exists(p)]  # gone (a zombie this machine's init has not reaped yet
        # counts as gone)
        assert not list(Path("/etc/netns").glob(f"xc-{tw.id}-*"))
        assert not (lc.state / "state.json").exists()
        again = lc.fab("local-down", timeout=60)
        assert again.returncode == 0 and again.stdout.strip() == "no local cluster was running"
    finally:
        scrub(lc)


def test_the_aws_twins_security_group_rules_admit_a_group_at_the_private_address_only():
    """twin.watch.sg_rules, as the nodes' group has it (infra.network): SSH from adminCidr, SSH from the head's
    group, all traffic between members. A group reference names the instance's private address; a CIDR rule either."""
    from twin.watch import sg_rules

    ssh = {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22}
    rules = sg_rules("198.18.0.5", [{**ssh, "IpRanges": [{"CidrIp": "198.19.7.1/32"}], "UserIdGroupPairs": []},
                                    {**ssh, "IpRanges": [], "UserIdGroupPairs": [{"GroupId": "sg-head"}]},
                                    {"IpProtocol": "-1", "IpRanges": [], "UserIdGroupPairs": [{"GroupId": "sg-nodes"}]}],
                     {"sg-head": ["198.18.0.4"], "sg-nodes": ["198.18.0.6", "198.18.0.5"]})
    accept = [line.removeprefix("add rule inet xc_sg input ") for line in rules.splitlines() if line.startswith("add rule")]
    assert accept == ['iif "lo" accept', "ct state established,related accept",
                      "ip saddr 198.19.7.1/32 tcp dport 22 accept",
                      "ip saddr @g_sg_head ip daddr 198.18.0.5 tcp dport 22 accept",
                      "ip saddr @g_sg_nodes ip daddr 198.18.0.5 accept"]
    assert "policy drop;" in rules and "add element inet xc_sg g_sg_nodes { 198.18.0.5, 198.18.0.6 }" in rules
    if netns_missing() is None and shutil.which("nft"):  # the kernel takes it, twice (the second replaces the first)
        ns = f"xc-testsg-{os.getpid()}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            for _ in range(2):
                res = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True,
                                     text=True, check=False)
                assert res.returncode == 0, res.stderr
            listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "chain", "inet", "xc_sg", "input"],
                                    capture_output=True, text=True, check=True).stdout
            assert listed.count(" accept") == 5, listed
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
