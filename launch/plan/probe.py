"""Probing the nodes before a run: CPU topology, the Python and which of oneCCL / IPEX import; and the backend and precision they allow."""
from __future__ import annotations

import logging
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from cluster.node import Node
from cluster.remote import connect, remote_home, run
from core.errors import ClusterError, PortHeld
from launch.plan import topology

MFU_PY = Path(__file__).resolve().parents[2] / "training" / "speed" / "mfu.py"

log = logging.getLogger(__name__)


@dataclass
class NodeFacts:
    node: Node
    home: str
    topo: topology.Topology
    has_ccl: bool
    has_ipex: bool
    python_ok: str
    bf16_speedup: float | None = None  # bf16 over fp32 matmul, measured where AVX512-BF16 and no AMX
    bf16_remembered: bool = False  # the node's answer from an earlier run (training/speed/mfu.py's cache)

    def bf16_pays(self) -> bool:
        return self.topo.amx or (self.topo.bf16 and (self.bf16_speedup or 0.0) >= 1.0)


PROBE_PY = ("import importlib.util as u, sys; "
            "print('ccl=%d ipex=%d py=%s' % (u.find_spec('oneccl_bindings_for_pytorch') is not None, "
            "u.find_spec('intel_extension_for_pytorch') is not None, sys.version.split()[0]))")


def probe(node: Node, time_bf16: bool = True) -> NodeFacts:
    """The node's facts; with time_bf16 (precision auto), bf16 against fp32 matmuls timed where AMX does not settle it."""
    with connect(node) as conn:
        home = remote_home(conn)
        res = run(conn, topology.PROBE)
        if not res.ok:
            raise ClusterError(f"{node.name}: reading the CPU topology failed: {res.stderr.strip()[-200:]}")
        try:
            topo = topology.parse(res.stdout)
        except ValueError as exc:
            raise ClusterError(f"{node.name}: {exc}") from None
        py = run(conn, f"{shlex.quote(node.python)} -c {shlex.quote(PROBE_PY)}")
        if not py.ok:
            raise ClusterError(f"{node.name}: python {node.python} does not run", fix="set the node up with 'fab setup'")
        m = re.search(r"ccl=(\d) ipex=(\d) py=(\S+)", py.stdout)
        speedup, remembered = bf16_speedup(conn, node) if time_bf16 and topo.bf16 and not topo.amx else (None, False)
        return NodeFacts(node=node, home=home, topo=topo, has_ccl=m.group(1) == "1",
                         has_ipex=m.group(2) == "1", python_ok=m.group(3), bf16_speedup=speedup,
                         bf16_remembered=remembered)


def bf16_speedup(conn, node: Node) -> tuple[float, bool]:
    """Time bf16 against fp32 matmuls on the node (training/speed/mfu.py, sent as `python -c`: the node may not
    have this project yet). AVX512-BF16 kernels can be slower than fp32 ones: on Sapphire Rapids cores with
    oneDNN capped below AMX bf16 ran 0.58x fp32 (docs/benchmarks.md, "Without AMX"). Timed once per node: later runs read
    the node's ~/.cache/xeon-cluster/bf16-speedup.json, (speedup, True)."""
    res = run(conn, f"{shlex.quote(node.python)} -c {shlex.quote(MFU_PY.read_text())}", timeout=120)
    m = re.search(r"bf16_speedup=([0-9.]+) remembered=([01])", res.stdout)
    if not res.ok or not m:
        raise ClusterError(f"{node.name}: timing bf16 against fp32 matmuls failed: "
                           f"{(res.stderr or res.stdout).strip()[-200:]}", fix="pass --precision bf16 or fp32 to skip it")
    return float(m.group(1)), m.group(2) == "1"


# The rendezvous port on node 0: the one asked for if nothing holds it (TIME_WAIT does not count, as
# for torch's store). Else a free one below the kernel's ephemeral range (ip_local_port_range), so that runs
# and clusters sharing a machine never meet on one port and no outgoing connection (ssh, the store, gloo's
# own pairs) takes it between this probe and rank 0's listen: a port the kernel picks with bind(0) comes
# from that range, and in the test suite one was taken that way (EADDRINUSE at init_process_group).
PORT_PY = """
import random, socket, sys
def free(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        return s.getsockname()[1], None
    except OSError as exc:
        return None, exc.strerror
    finally:
        s.close()
wanted = int(sys.argv[1])
if wanted:
    port, why = free(wanted)
    print(f"free {port}" if port else f"busy {why}")
    sys.exit()
try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    low = 32768
pool = range(20000, low) if low > 21000 else range(0)
for port in random.sample(pool, min(len(pool), 200)):
    if free(port)[0]:
        print("free", port)
        break
else:
    print("free", free(0)[0])
"""


def master_port(node: Node, wanted: int | None) -> int:
    with connect(node) as conn:
        res = run(conn, f"{shlex.quote(node.python)} -c {shlex.quote(PORT_PY)} {int(wanted or 0)}", timeout=30)
    word, _, rest = res.stdout.strip().partition(" ")
    if word == "busy":
        raise PortHeld(f"--master-port {wanted} is in use on {node.name} ({rest})", "leave --master-port out "
                       "to get a free port, or pass another")
    if word != "free":
        raise ClusterError(f"{node.name}: could not check the rendezvous port: {(res.stderr or res.stdout).strip()[-200:]}")
    return int(rest)


def resolve_backend(requested: str, facts: list[NodeFacts]) -> str:
    missing = [f.node.name for f in facts if not f.has_ccl]
    if requested == "ccl" and missing:
        raise ClusterError(f"--backend ccl but oneccl_bindings_for_pytorch is missing on {', '.join(missing)}", fix=
                           "run 'fab setup --profile oneccl' or use --backend gloo")
    if requested == "auto":
        return "gloo" if missing else "ccl"
    return requested


def resolve_precision(requested: str, facts: list[NodeFacts]) -> str:
    if requested == "auto":
        chosen = "bf16" if all(f.bf16_pays() for f in facts) else "fp32"
        timed = [f"{f.node.name} {f.bf16_speedup:.2f}x" + (" (remembered)" if f.bf16_remembered else "")
                 for f in facts if f.bf16_speedup is not None]
        if timed:  # say what the choice rests on: bf16 matmuls against fp32 ones, where measured
            log.info("precision auto: %s; bf16 matmuls against fp32 ones timed on %s", chosen, ", ".join(timed))
        return chosen
    if requested == "bf16":
        slow = [f.node.name for f in facts if not f.topo.bf16]
        if slow:
            log.warning("bf16 requested but node(s) %s have neither AMX nor AVX512-BF16: oneDNN emulates it there, at about 1%% "
                        "of fp32's matmul speed on an AVX2-only EPYC; use --precision auto or fp32", ", ".join(slow))
    return requested
