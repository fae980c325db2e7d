"""The AWS twin (`fab local-up --aws`, root only): the cluster's AWS side as `pulumi up` leaves it, on one machine.

- The control plane is a moto server (twin.control) on the twin's bridge, at the VPC router's address (.1 of
  the subnet). The Pulumi program itself, under mocks, makes the resources on it (twin.program): VPC and
  subnet (inside 198.18.0.0/15), security group, key pair, roles and instance profiles, launch templates, the nodes'
  spot group with its termination hook, the head's group of one, the store bucket.
- A watcher process (`python -m twin.watch STATE`) boots every instance the groups launch as a real sshd
  node in a network namespace of its own, at the instance's private address and its public one (a /24 of
  198.18.0.0/15 of its own, which moto hands out; the operator is .1 of it, on the bridge, and adminCidr), and
  removes it when the instance is terminated. Each namespace's nftables input chain holds its security groups'
  rules: a rule naming a group admits that group's members at the private address only, a CIDR rule its sources.
  A node boots as a real one does, as far as one machine allows: cloud-init's files from its launch template's user
  data (/etc/xeon-cluster/cluster.env), its host name from its instance id, and the user data's
  own publisher tagging the instance with its host keys and authorizing the mesh key (cluster.mesh), through its
  instance profile. Its IMDS (cluster.imds) answers at 169.254.169.254 inside the namespace, for that
  instance only.
- Each node sees its own /etc/xeon-cluster and ~/.xeon-cluster (a mount namespace), and at /opt/xeon-cluster/venv,
  where a baked image has the software, the venv the image would hold: built from the profile's package list
  (twin.image), never this machine's venv.
- `fab local-notice` makes an instance's IMDS announce a spot reclaim, a rebalance recommendation or the group's
  own termination; at its end the instance is terminated and the group launches a replacement. `fab local-kill`
  terminates one with no notice.
"""
from __future__ import annotations

import getpass
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cluster import local, netns
from core.cli import writable_dir
from core.constants import PROJECT_ROOT, REMOTE_HOME
from core.errors import ClusterError
from twin import image as twin_image

log = logging.getLogger(__name__)

STACK = "twin"  # the twin's stack, and so its cluster's name
REGION, ZONE = "us-east-1", "us-east-1a"
INSTANCE_TYPE = "c6i.2xlarge"  # the catalog's smallest: a twin node is a share of this machine, whatever it says
KEY_ID = "xc-twin"  # moto takes any credentials; these name the twin's, never a real account's
NEEDS_ROOT = ("--aws needs root (network namespaces, mounts and sshd at the instances' addresses)",
              "run 'sudo fab local-up --aws' (or as root), or 'fab local-up' for a local cluster without AWS")
KINDS = ("spot", "rebalance", "terminate")
DEFAULT_AFTER = {"spot": 120.0, "rebalance": 0.0, "terminate": 300.0}  # AWS's two minutes; the hook's heartbeat
BOOT_TIMEOUT_S = 60
PROFILE = "upstream"  # the stack's default profile, which the twin's program runs with
MOUNTS = ("/etc/xeon-cluster", "/opt/xeon-cluster/venv")  # + ~/.xeon-cluster: each node's own


def state_dir() -> Path:
    return local.state_dir(STACK)


@dataclass(frozen=True)
class Names:
    """One twin's Linux names, from its state folder's path (two checkouts never share one)."""

    id: str

    @classmethod
    def of(cls, state: Path) -> Names:
        return cls(hashlib.sha256(("aws:" + str(state.resolve())).encode()).hexdigest()[:6])

    @property
    def bridge(self) -> str:
        return f"xct{self.id}"

    def ns(self, instance_id: str) -> str:
        return f"xct-{self.id}-{instance_id}"

    def veth(self, k: int) -> str:
        return f"xcw{self.id}{k}"

    @property
    def hosts_prefix(self) -> str:
        return f"xct-{self.id}-"

    def owns_ns(self, name: str) -> bool:
        return name.startswith(self.hosts_prefix)

    def owns_link(self, name: str) -> bool:
        return name == self.bridge or re.fullmatch(rf"xcw{self.id}\d+", name) is not None


# -- the record -------------------------------------------------------------------------------------------------
def read(state: Path | None = None) -> dict | None:
    f = (state or state_dir()) / "twin.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError:
        raise ClusterError(f"the AWS twin's record {f} is corrupt", fix="run 'fab local-down' (it removes the twin by "
                           "its names) and 'fab local-up --aws' again") from None


def _write(state: Path, record: dict) -> None:
    tmp = state / "twin.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(state / "twin.json")


def require(state: Path | None = None) -> dict:
    record = read(state)
    if not record:
        raise ClusterError("no AWS twin is up", fix="start one with 'fab local-up --aws --nodes 2' (root)")
    return record


def environment(record: dict) -> dict[str, str]:
    """What points a checkout at the twin: its cluster, endpoints, store, credentials and the operator's key."""
    env = {"XC_CLUSTER": f"aws:{record['cluster']}", "XC_AWS_ENDPOINT_URL": record["endpoint"],
           "XC_S3_ENDPOINT_URL": record["endpoint"], "XC_STORE": record.get("store", ""), "AWS_REGION": record["region"],
           "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": KEY_ID, "XC_SSH_KEY": record["key"]}
    return {k: v for k, v in env.items() if v}


def export_line(record: dict) -> str:
    return "export " + " ".join(f"{k}={v}" for k, v in environment(record).items())


def use(record: dict) -> None:
    """Point this process at the twin (its AWS calls go to the twin's moto, never to AWS)."""
    for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        os.environ.pop(key, None)
    os.environ.update(environment(record))


def clients(record: dict):
    import boto3

    session = boto3.session.Session(aws_access_key_id=KEY_ID, aws_secret_access_key=KEY_ID,
                                    region_name=record["region"])
    return (session.client("ec2", endpoint_url=record["endpoint"]),
            session.client("autoscaling", endpoint_url=record["endpoint"]))


# -- up ---------------------------------------------------------------------------------------------------------
def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _pick_vpc(names: Names, prefix: int = 21, besides: tuple[str, ...] = ()) -> str:
    """A /21 of 198.18.0.0/15 that no interface here uses (settings want /16../24; its zone-a slice is a /24); with
    prefix 24, the twin's public addresses: a /24 outside the VPC (``besides``) too."""
    used = [ipaddress.IPv4Interface(m).network for m in re.findall(
        r"inet (\d+\.\d+\.\d+\.\d+/\d+)", netns._try(["ip", "-4", "-o", "addr", "show"]).stdout)]
    used += [ipaddress.IPv4Network(b) for b in besides]
    nets = list(netns.RANGE.subnets(new_prefix=prefix))
    start = int(names.id, 16) % len(nets)
    for k in range(len(nets)):
        net = nets[(start + k) % len(nets)]
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise ClusterError(f"every /{prefix} of 198.18.0.0/15 is in use on this machine", fix="run 'fab local-down' for a "
                       "twin you no longer need")


def _wait_http(url: str, proc: subprocess.Popen, what: str, log_file: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (log_file.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise ClusterError(f"{what} did not start ({tail})", fix=f"see {log_file}") from None
            time.sleep(0.1)


def _spawn(argv: list[str], log_file: Path, cpus: set[int] | None = None) -> subprocess.Popen:
    """A twin process of its own session, with the twin's credentials only (never the operator's AWS profile); with
    cpus, on those CPUs only (a node's share, as a local node's: its ranks then see the cores an instance has)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN")}
    env.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=KEY_ID)
    with open(log_file, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                cwd=str(PROJECT_ROOT), env=env,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)  # noqa: PLW1509


def check_tools() -> None:
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount"), ("nft", "nftables")):
        if not shutil.which(tool):
            raise ClusterError(f"--aws needs '{tool}', which is not installed", fix=f"install it with 'apt-get install "
                               f"{package}'")
    local.sshd_binary()
    try:
        import moto  # noqa: F401
        import pulumi  # noqa: F401
    except ImportError as exc:
        raise ClusterError(f"--aws needs {exc.name}, which is not installed", fix="run 'make venv' (it installs the "
                           "infra and dev extras)") from None


def up(count: int, state: Path | None = None) -> dict:
    """Start the twin with ``count`` nodes and its head; returns its record once every instance answers SSH."""
    state = state or state_dir()
    netns.require_root(NEEDS_ROOT)
    record = read(state)
    if record:
        if _alive(record.get("watcher", 0)) and _alive(record.get("moto", 0)):
            raise ClusterError(f"the AWS twin is already up with {record['nodes']} node(s)", fix="run 'fab local-down' "
                               "first to start another, or use it: " + export_line(record))
        down(state)
    names = Names.of(state)
    if netns.parts(names):
        netns.teardown(names)
    check_tools()
    netns.probe(netns.Twin(names.id), None)
    writable_dir(state, "the AWS twin's state folder", "set XC_STATE_DIR to a writable folder")
    state.chmod(0o700)
    started = time.monotonic()
    vpc = _pick_vpc(names)
    router = str(ipaddress.IPv4Network(vpc)[1])  # the VPC router's (.1 of the zone-a subnet, the VPC's first slice)
    # the instances' public addresses: the operator dials them from .1, the one address adminCidr admits
    public = _pick_vpc(names, 24, besides=(vpc,))
    operator = str(ipaddress.IPv4Network(public)[1])
    record = {"id": names.id, "cluster": STACK, "region": REGION, "zone": ZONE, "vpc": vpc,
              "router": router, "bridge": names.bridge, "nodes": count, "key": str(local.operator_key(state)),
              "made_dirs": [], "venv": str(twin_image.venv(PROFILE)), "public": public, "operator": operator}
    try:
        netns._run(["ip", "link", "add", names.bridge, "address", netns.bridge_mac(names.bridge), "type", "bridge"])
        netns._run(["ip", "addr", "add", f"{router}/{ipaddress.IPv4Network(vpc).prefixlen}", "dev", names.bridge])
        netns._run(["ip", "addr", "add", f"{operator}/24", "dev", names.bridge])
        netns._run(["ip", "link", "set", names.bridge, "up"])
        port = _free_port(router)
        record["endpoint"] = f"http://{router}:{port}"
        moto = _spawn([sys.executable, "-m", "twin.control", router, str(port), str(state / "lifecycle.jsonl"),
                       public], state / "moto.log")
        record["moto"] = moto.pid
        _write(state, record)
        _wait_http(f"{record['endpoint']}/moto-api/", moto, "the twin's moto server", state / "moto.log")
        local._keygen(local.operator_key(state), "xeon-cluster twin operator")
        record["made_dirs"] = _mount_points()
        _write(state, record)
        use(record)  # the program's own calls (prices, caller identity) go to the twin too
        from twin import program as twin_program  # lazy: the Pulumi program (~5 ms of fab's start-up) only twin-up runs

        config = {"adminCidr": f"{operator}/32", "sshPublicKey": local.operator_key(state).with_suffix(".pub").read_text(),
                  "nodeCount": count, "vpcCidr": vpc, "region": REGION, "availabilityZone": ZONE,
                  "instanceType": INSTANCE_TYPE, "sshUser": getpass.getuser(), "profile": PROFILE}
        program, outputs = twin_program.apply(record["endpoint"], config, STACK, ZONE, getpass.getuser())
        record.update(store=outputs["storeUrl"], groups={"nodes": outputs["autoScalingGroup"],
                                                          "head": outputs["headAutoScalingGroup"]},
                      left_out=program.left_out, made=len(program.made))
        record["subnet"] = _subnet(record, router)
        watcher = _spawn([sys.executable, "-m", "twin.watch", str(state)], state / "watcher.log")
        record["watcher"] = watcher.pid
        _write(state, record)
        _wait_booted(state, count + 1, watcher, started)
    except BaseException:
        down(state)
        raise
    record["up_s"] = round(time.monotonic() - started, 1)
    _write(state, record)
    return record


def _subnet(record: dict, router: str) -> str:
    """The nodes' subnet as the program made it on the twin (infra.network's zone slice of the VPC)."""
    ec2, asg = clients(record)
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[record["groups"]["nodes"]])["AutoScalingGroups"][0]
    cidr = ec2.describe_subnets(SubnetIds=group["VPCZoneIdentifier"].split(",")[:1])["Subnets"][0]["CidrBlock"]
    if ipaddress.ip_address(router) not in ipaddress.ip_network(cidr):
        raise ClusterError(f"the program put the nodes in {cidr}, which does not hold the twin's router {router}", fix=
                           "report it: the twin expects the zone-a slice to be the VPC's first")
    return cidr


def _mount_points() -> list[str]:
    """The folders each node mounts its own over; those this makes go again at 'fab local-down'."""
    made = []
    for path in (*MOUNTS, str(Path.home() / REMOTE_HOME)):
        p = Path(path)
        missing = []
        while not p.exists():
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            m.mkdir()
            made.append(str(m))
    return made


def _wait_booted(state: Path, want: int, watcher: subprocess.Popen, started: float) -> None:
    deadline = started + BOOT_TIMEOUT_S
    while True:
        ready = [b for b in booted(state) if b.get("ready")]
        if len(ready) >= want:
            return
        if watcher.poll() is not None:
            tail = ((state / "watcher.log").read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise ClusterError(f"the twin's watcher stopped: {tail}", fix=f"see {state / 'watcher.log'}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{len(ready)} of {want} twin instance(s) booted within {BOOT_TIMEOUT_S} s", fix=
                               f"see {state / 'watcher.log'}")
        time.sleep(0.2)


def booted(state: Path) -> list[dict]:
    out = []
    for f in sorted((state / "instances").glob("*/boot.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


# -- down -------------------------------------------------------------------------------------------------------
def down(state: Path | None = None) -> str | None:
    """Stop the watcher and moto, remove every instance's namespace and the bridge; None when no twin was up."""
    state = state or state_dir()
    try:
        record = read(state)
    except ClusterError:
        record = None
    names = Names.of(state)
    if not record and not netns.parts(names):
        return None
    netns.require_root(("removing the AWS twin needs root", "run 'fab local-down' as root"))
    for key in ("watcher", "moto"):
        pid = (record or {}).get(key)
        if pid and _alive(pid):
            os.killpg(pid, signal.SIGTERM) if _is_group_leader(pid) else os.kill(pid, signal.SIGTERM)
            local._signal_and_wait([pid], signal.SIGTERM, wait_s=3)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    removed = netns.teardown(names)
    for d in reversed((record or {}).get("made_dirs", [])):
        try:
            Path(d).rmdir()
        except OSError:
            pass
    for f in ("twin.json", "counter", "lifecycle.jsonl"):
        (state / f).unlink(missing_ok=True)
    shutil.rmtree(state / "instances", ignore_errors=True)
    shutil.rmtree(state / "actions", ignore_errors=True)
    return f"AWS twin down: {len([r for r in removed if names.owns_ns(r)])} instance(s) and the bridge removed"


def _is_group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def write_imds(node_dir: Path, **changes) -> None:
    """Change what an instance's IMDS answers (it reads the file again on every request)."""
    f = node_dir / "imds.json"
    doc = json.loads(f.read_text()) if f.is_file() else {}
    doc.update(changes)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(f)
