"""The network twin: a local cluster whose nodes are distinct hosts (`fab local-up --netns`, root only).

Node i is its sshd inside network namespace xc-<id>-node<i>, with a hostname of its own (a UTS namespace:
`node<i>`, resolved by every node through /etc/netns/<ns>/hosts) and exactly one link: a veth pair from its
eth0 to bridge xcb<id> in the root namespace. The bridge holds the operator's address, .1 of a /24 of
198.18.0.0/15 (the benchmarking range); node i has .(2+i). tc shapes each link at both ends (netem for a delay,
with its rate; tbf for a rate alone), so --latency D is the one-way delay of each link in each direction.
`fab local-link` cuts, restores or reshapes one link. <id> comes from the state folder's path, so two clusters
never share a name; `fab local-down` removes everything by those names, with a corrupt state file too.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cluster import local
from cluster.node import Node
from core.errors import ClusterError

RANGE = ipaddress.IPv4Network("198.18.0.0/15")
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` binds /etc/netns/NS/hosts over /etc/hosts
RATE = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)")
DELAY = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)")
RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
DELAY_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
NEEDS_ROOT = ("--netns needs root (network namespaces and tc)", "run as root or without --netns")


def check_shape(link: str | None, latency: str | None) -> None:
    """The flags' syntax, before anything is asked or made."""
    if link is not None and (not RATE.fullmatch(str(link)) or rate_bits(link) <= 0):
        raise ClusterError(f"--link {link!r} is not a rate like 3gbit or 500mbit", fix="pass a number above 0 with bit, "
                           "kbit, mbit, gbit or tbit")
    if latency is not None and not DELAY.fullmatch(str(latency)):
        raise ClusterError(f"--latency {latency!r} is not a delay like 50us or 1ms", fix="pass a number with us, ms or s")


def rate_bits(link: str) -> float:
    number, unit = RATE.fullmatch(link).groups()
    return float(number) * RATE_SCALE[unit]


def delay_s(latency: str) -> float:
    number, unit = DELAY.fullmatch(latency).groups()
    return float(number) * DELAY_SCALE[unit]


def qdisc_args(link: str | None, latency: str | None) -> list[str] | None:
    """What follows `tc qdisc replace dev X root` at one end of a link; None: the link is not shaped."""
    if latency:
        args = ["netem", "delay", latency]
        if link:  # queue two bandwidth-delay products, at least netem's default 1000 packets
            args += ["rate", link, "limit", str(max(1000, int(2 * rate_bits(link) / 8 * delay_s(latency) / 1514)))]
        return args
    if link:  # a bucket of 1 ms of traffic, at least 16 full frames; at most 50 ms queued
        burst = max(int(rate_bits(link) / 8 / 1000), 16 * 1514)
        return ["tbf", "rate", link, "burst", str(burst), "latency", "50ms"]
    return None


def describe(link: str | None, latency: str | None) -> str:
    return ", ".join([f"rate {link}"] * bool(link) + [f"latency {latency}"] * bool(latency)) or "unshaped"


@dataclass(frozen=True)
class Twin:
    """The names of one cluster's namespaces, veths and bridge (Linux caps interface names at 15 characters)."""

    id: str

    @classmethod
    def of(cls, state: Path) -> Twin:
        return cls(hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:6])

    @property
    def bridge(self) -> str:
        return f"xcb{self.id}"

    def ns(self, i: int) -> str:
        return f"xc-{self.id}-node{i}"

    def veth(self, i: int) -> str:
        return f"xcv{self.id}{i}"

    @property
    def hosts_prefix(self) -> str:  # its folders in /etc/netns
        return f"xc-{self.id}-"

    def owns_ns(self, name: str) -> bool:
        return re.fullmatch(rf"xc-{self.id}-(node\d+|probe)", name) is not None

    def owns_link(self, name: str) -> bool:
        return name == self.bridge or re.fullmatch(rf"xcv{self.id}\d+", name) is not None

    def wrap(self, i: int) -> list[str]:
        """The command that starts node i's sshd in its namespace, with its own hostname."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.ns(i), "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', f"node{i}"]


def require_root(need: tuple[str, str] = NEEDS_ROOT) -> None:
    if os.geteuid() != 0:
        raise ClusterError(need[0], fix=need[1])


def _try(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False, timeout=30)


def _run(argv: list[str]) -> str:
    res = _try(argv)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        raise ClusterError(f"'{' '.join(argv)}' failed: {why}", fix="run 'fab local-down' to remove what --netns made, "
                           "then try again")
    return res.stdout


def _spaces() -> list[str]:
    if not shutil.which("ip"):
        return []
    return [line.split()[0] for line in _try(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    if not shutil.which("ip"):
        return []
    return [line.split(":")[1].strip().split("@")[0] for line in _try(["ip", "-o", "link", "show"]).stdout.splitlines()
            if line.count(":") >= 2]


def parts(twin: Twin) -> list[str]:
    """What of this twin exists on the machine now: namespaces, veths, the bridge, hosts folders (``twin``: a Twin
    here, the AWS twin's Names in twin.up: anything with bridge, hosts_prefix, owns_ns and owns_link)."""
    found = [s for s in _spaces() if twin.owns_ns(s)] + [n for n in _links() if twin.owns_link(n)]
    return found + [str(d) for d in ETC_NETNS.glob(f"{twin.hosts_prefix}*")]


def probe(twin: Twin, latency: str | None) -> None:
    """The tools, network namespaces and (for --latency) netem, tried in a scratch namespace."""
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if not shutil.which(tool):
            raise ClusterError(f"--netns needs '{tool}', which is not installed", fix=f"install it with 'apt-get install "
                               f"{package}'")
    scratch = f"xc-{twin.id}-probe"
    res = _try(["ip", "netns", "add", scratch])
    if res.returncode != 0:
        raise ClusterError(f"this machine does not allow network namespaces ('ip netns add' said: "
                           f"{res.stderr.strip()})", fix="run --netns where it does (a container needs CAP_SYS_ADMIN and "
                           "CAP_NET_ADMIN) or leave out --netns")
    try:
        if latency:
            res = _try(["tc", "-n", scratch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", latency])
            if res.returncode != 0:
                raise no_netem(res.stderr)
    finally:
        _try(["ip", "netns", "del", scratch])


def no_netem(tc_said: str) -> ClusterError:
    return ClusterError(f"--latency needs the kernel's netem queueing discipline, which this kernel lacks (tc said: "
                        f"{tc_said.strip()})", fix="load it with 'modprobe sch_netem' or leave out --latency (--link "
                        "alone shapes with tbf)")


def pick_subnet(twin: Twin) -> str:
    """A /24 of 198.18.0.0/15 that no interface of this machine uses, starting from one derived from the id."""
    used = [ipaddress.IPv4Interface(m).network
            for m in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", _try(["ip", "-4", "-o", "addr", "show"]).stdout)]
    subnets = list(RANGE.subnets(new_prefix=24))
    start = int(twin.id, 16) % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise ClusterError("every /24 of 198.18.0.0/15 is in use on this machine", fix="run 'fab local-down' for a network "
                       "twin you no longer need")


def address(subnet: str, i: int) -> str:
    return str(ipaddress.IPv4Network(subnet)[2 + i])


def shape(twin: Twin, i: int, link: str | None, latency: str | None) -> None:
    """Both ends of node i's link: the bridge side shapes what the node receives, eth0 what it sends."""
    args = qdisc_args(link, latency)
    for tc, dev in ((["tc"], twin.veth(i)), (["tc", "-n", twin.ns(i)], "eth0")):
        if args and args[0] == "netem":
            res = _try([*tc, "qdisc", "replace", "dev", dev, "root", *args])
            if res.returncode != 0:
                if "kind is unknown" in res.stderr:
                    raise no_netem(res.stderr)
                raise ClusterError(f"tc could not shape {dev}: {res.stderr.strip()}", fix="check --link and --latency")
        elif args:
            _run([*tc, "qdisc", "replace", "dev", dev, "root", *args])
        else:
            _try([*tc, "qdisc", "del", "dev", dev, "root"])  # none there is fine


def bridge_mac(bridge: str) -> str:
    """A fixed, locally administered MAC for a bridge. Without one, the bridge takes the lowest MAC of its ports and
    changes it as nodes come and go: the namespaces' ARP entries for its address (the operator, the twin's control
    plane) then go stale, and their traffic to it stops for 30-60 s, until the entry is probed again."""
    digest = hashlib.sha256(bridge.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def build(twin: Twin, subnet: str, shapes: list[tuple[str | None, str | None]]) -> None:
    """Make whatever of the bridge and the nodes' namespaces, links and hosts files is missing (idempotent)."""
    net = ipaddress.IPv4Network(subnet)
    links, spaces = set(_links()), set(_spaces())
    if twin.bridge not in links:
        _run(["ip", "link", "add", twin.bridge, "address", bridge_mac(twin.bridge), "type", "bridge"])
    _run(["ip", "addr", "replace", f"{net[1]}/{net.prefixlen}", "dev", twin.bridge])
    _run(["ip", "link", "set", twin.bridge, "up"])
    hosts = ("# written by 'fab local-up --netns', removed by 'fab local-down'\n127.0.0.1 localhost\n"
             "::1 localhost ip6-localhost ip6-loopback\n"
             + "".join(f"{address(subnet, i)} node{i}\n" for i in range(len(shapes))))
    for i, (link, latency) in enumerate(shapes):
        ns, veth = twin.ns(i), twin.veth(i)
        if ns not in spaces:
            _run(["ip", "netns", "add", ns])
        if veth not in links:
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{address(subnet, i)}/{net.prefixlen}", "dev", "eth0"])
            for dev in ("lo", "eth0"):
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "link", "set", veth, "master", twin.bridge, "up"])
            shape(twin, i, link, latency)
        (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / ns / "hosts").write_text(hosts)


def _shapes(record: dict, count: int) -> list[tuple[str | None, str | None]]:
    links = record.get("links", {})
    return [(links.get(f"node{i}", {}).get("link", record.get("link")),
             links.get(f"node{i}", {}).get("latency", record.get("latency"))) for i in range(count)]


def up(count: int, port: int = local.DEFAULT_PORT, link: str | None = None, latency: str | None = None,
       state: Path | None = None, python: str | None = None) -> list[Node]:
    """A local cluster of `count` nodes in namespaces of their own; on a running twin, what is gone comes back."""
    check_shape(link, latency)
    require_root()
    state = state or local.state_dir()
    twin = Twin.of(state)
    existing = local._read_state(state)  # a corrupt file is its own one-line error, before anything is made
    if existing:
        record = existing.get("netns")
        if not record:
            raise ClusterError("a local cluster without --netns is up", fix="run 'fab local-down' first, then "
                               "'fab local-up --netns'")
        if (link, latency) != (None, None) and (link, latency) != (record.get("link"), record.get("latency")):
            raise ClusterError(f"the network twin is up with {describe(record.get('link'), record.get('latency'))}", fix=
                               "change a link with 'fab local-link --node NAME --link RATE --latency DELAY'")
        build(Twin(record["id"]), record["subnet"], _shapes(record, len(existing["nodes"])))
        return local.up(count, port, state=state, python=python)
    if parts(twin):  # no cluster, yet parts of one: what a killed 'fab local-up' left goes first
        teardown(twin)
    probe(twin, latency)
    subnet = pick_subnet(twin)
    record = {"id": twin.id, "bridge": twin.bridge, "subnet": subnet, "operator": str(ipaddress.IPv4Network(subnet)[1]),
              "link": link, "latency": latency, "links": {}}
    try:
        build(twin, subnet, [(link, latency)] * count)
        return local.up(count, port, first_address=address(subnet, 0), state=state, python=python,
                        wrap=twin.wrap, extra={"netns": record})
    except BaseException:
        teardown(twin)
        raise


def up_line(state: Path | None = None) -> str:
    """The twin's part of `fab local-up`'s closing line."""
    record = (local._read_state(state or local.state_dir()) or {}).get("netns") or {}
    if not record:
        return ""
    return (f"; network twin {record['subnet']} on bridge {record['bridge']} ({record['operator']}), each link "
            f"{describe(record.get('link'), record.get('latency'))}")


def _end_processes(ns: str) -> None:
    """Whatever still runs in one of the twin's namespaces (sessions' leftovers) goes with it."""
    pids = [int(p) for p in _try(["ip", "netns", "pids", ns]).stdout.split() if p.isdigit() and int(p) != os.getpid()]
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        local._signal_and_wait(pids, sig, wait_s)


def teardown(twin: Twin) -> list[str]:
    """Remove every namespace, veth, bridge and hosts folder of this twin (best effort); returns what went."""
    removed = []
    spaces = [s for s in _spaces() if twin.owns_ns(s)]
    for ns in spaces:
        _end_processes(ns)
    for name in sorted(_links(), key=lambda n: n == twin.bridge):  # the veths, then the bridge
        if twin.owns_link(name) and _try(["ip", "link", "del", name]).returncode == 0:
            removed.append(name)
    for ns in spaces:
        if _try(["ip", "netns", "del", ns]).returncode == 0:
            removed.append(ns)
    for d in ETC_NETNS.glob(f"{twin.hosts_prefix}*"):
        shutil.rmtree(d, ignore_errors=True)
    if ETC_NETNS.is_dir() and not any(ETC_NETNS.iterdir()):
        ETC_NETNS.rmdir()
    return removed


def down(state: Path | None = None) -> tuple[int, list[str]]:
    """`fab local-down`: the nodes' sshd (cluster.local), then the twin's network if there is one."""
    state = state or local.state_dir()
    twins = {Twin.of(state)}
    try:
        record = (local._read_state(state) or {}).get("netns")
        if record:
            twins.add(Twin(record["id"]))
    except local.CorruptState:
        pass
    left = [p for t in twins for p in parts(t)]
    if left and os.geteuid() != 0:
        raise ClusterError(f"the local cluster's network twin ({', '.join(left[:3])}) can be removed by root only", fix=
                           "run 'fab local-down' as root")
    try:
        stopped = local.down(state)
    finally:
        removed = [p for t in twins if left for p in teardown(t)]
    return stopped, removed


def set_link(name: str, cut: bool = False, restore: bool = False, link: str | None = None,
             latency: str | None = None, state: Path | None = None) -> str:
    """`fab local-link`: cut a node's link (its bridge-side veth down), restore it, or reshape it."""
    check_shape(link, latency)
    if cut and restore:
        raise ClusterError("--cut and --restore exclude each other", fix="pass one of them")
    if not (cut or restore or link or latency):
        raise ClusterError(f"nothing to change on {name}'s link", fix="pass --cut, --restore, --link RATE or --latency DELAY")
    state = state or local.state_dir()
    data = local._read_state(state)
    if not data:
        raise ClusterError("no local cluster is running", fix="start one with 'fab local-up --nodes 2 --netns'")
    record = data.get("netns")
    if not record:
        raise ClusterError("the local cluster was started without --netns, so its nodes have no links", fix="restart it "
                           "with 'fab local-down' and 'fab local-up --netns'")
    entry = next((e for e in data["nodes"] if e["name"] == name), None)
    if entry is None:
        raise ClusterError(f"no local node {name!r}", fix=f"the nodes are {', '.join(e['name'] for e in data['nodes'])}")
    require_root(("fab local-link needs root (it changes links with ip and tc)", "run it as root"))
    twin, i = Twin(record["id"]), entry["node"]["index"]
    done = []
    if link or latency:
        old = _shapes(record, len(data["nodes"]))[i]
        new = (link or old[0], latency or old[1])
        shape(twin, i, *new)
        record.setdefault("links", {})[name] = {"link": new[0], "latency": new[1]}
        (state / "state.json").write_text(json.dumps(data, indent=2))
        done.append(f"shaped to {describe(*new)}")
    if cut or restore:
        _run(["ip", "link", "set", twin.veth(i), "down" if cut else "up"])
        done.append("cut" if cut else "restored")
    hint = f"; restore it with 'fab local-link --node {name} --restore'" if cut else ""
    return f"{name}'s link ({twin.veth(i)}) {' and '.join(done)}{hint}"

