"""The AWS twin (`fab local-up --aws`, root only): the cluster's AWS side as `pulumi up` leaves it, on one machine.

- The control plane is a moto server (cluster.twin_moto) on the twin's bridge, at the VPC router's address (.1 of
  the subnet). The Pulumi program itself, under mocks, makes the resources on it (cluster.twin_program): VPC and
  subnet (inside 198.18.0.0/15), security group, key pair, roles and instance profiles, launch templates, the nodes'
  spot group with its termination hook, the head's group of one, the store bucket.
- A watcher process (`python -m cluster.twin watch STATE`) boots every instance the groups launch as a real sshd
  node in a network namespace of its own, at the instance's private address, and removes it when the instance is
  terminated. A node boots as a real one does, as far as one machine allows: cloud-init's files from its launch
  template's user data (/etc/xeon-cluster/cluster.env), its host name from its instance id, and the user data's
  own publisher tagging the instance with its host keys through its instance profile. Its IMDS
  (cluster.twin_imds) answers at 169.254.169.254 inside the namespace, for that instance only.
- Each node sees its own /etc/xeon-cluster and ~/.xeon-cluster (a mount namespace), and this machine's venv at
  /opt/xeon-cluster/venv, where a baked image has the software.
- `fab local-notice` makes an instance's IMDS announce a spot reclaim, a rebalance recommendation or the group's
  own termination; at its end the instance is terminated and the group launches a replacement. `fab local-kill`
  terminates one with no notice.
"""
from __future__ import annotations

import base64
import datetime
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
from core.render import render

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

    def owns_ns(self, name: str) -> bool:
        return name.startswith(f"xct-{self.id}-")

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


def _pick_vpc(names: Names) -> str:
    """A /21 of 198.18.0.0/15 that no interface here uses (settings want /16../24; its zone-a slice is a /24)."""
    used = [ipaddress.IPv4Interface(m).network for m in re.findall(
        r"inet (\d+\.\d+\.\d+\.\d+/\d+)", netns._try(["ip", "-4", "-o", "addr", "show"]).stdout)]
    nets = list(netns.RANGE.subnets(new_prefix=21))
    start = int(names.id, 16) % len(nets)
    for k in range(len(nets)):
        net = nets[(start + k) % len(nets)]
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise ClusterError("every /21 of 198.18.0.0/15 is in use on this machine", fix="run 'fab local-down' for a twin "
                       "you no longer need")


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


def _spawn(argv: list[str], log_file: Path) -> subprocess.Popen:
    """A twin process of its own session, with the twin's credentials only (never the operator's AWS profile)."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN")}
    env.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=KEY_ID)
    with open(log_file, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                cwd=str(PROJECT_ROOT), env=env)


def check_tools() -> None:
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("mount", "mount")):
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
    if local.state_dir().joinpath("state.json").exists() and state != local.state_dir():
        pass  # a local cluster beside the twin is fine: they share nothing
    record = read(state)
    if record:
        if _alive(record.get("watcher", 0)) and _alive(record.get("moto", 0)):
            raise ClusterError(f"the AWS twin is already up with {record['nodes']} node(s)", fix="run 'fab local-down' "
                               "first to start another, or use it: " + export_line(record))
        down(state)
    names = Names.of(state)
    if _parts(names):
        teardown(names)
    check_tools()
    netns.probe(netns.Twin(names.id), None)
    writable_dir(state, "the AWS twin's state folder", "set XC_STATE_DIR to a writable folder")
    state.chmod(0o700)
    started = time.monotonic()
    vpc = _pick_vpc(names)
    from infra.network import subnet_cidr

    subnet = subnet_cidr(vpc, ZONE)
    router = str(ipaddress.IPv4Network(subnet)[1])
    record = {"id": names.id, "cluster": STACK, "region": REGION, "zone": ZONE, "vpc": vpc, "subnet": subnet,
              "router": router, "bridge": names.bridge, "nodes": count, "key": str(local.operator_key(state)),
              "made_dirs": [], "venv": sys.prefix}
    try:
        netns._run(["ip", "link", "add", names.bridge, "type", "bridge"])
        netns._run(["ip", "addr", "add", f"{router}/{ipaddress.IPv4Network(subnet).prefixlen}", "dev", names.bridge])
        netns._run(["ip", "link", "set", names.bridge, "up"])
        port = _free_port(router)
        record["endpoint"] = f"http://{router}:{port}"
        moto = _spawn([sys.executable, "-m", "cluster.twin_moto", router, str(port), str(state / "lifecycle.jsonl")],
                      state / "moto.log")
        record["moto"] = moto.pid
        _write(state, record)
        _wait_http(f"{record['endpoint']}/moto-api/", moto, "the twin's moto server", state / "moto.log")
        local._keygen(local.operator_key(state), "xeon-cluster twin operator")
        record["made_dirs"] = _mount_points()
        _write(state, record)
        use(record)  # the program's own calls (prices, caller identity) go to the twin too
        from cluster import twin_program

        config = {"adminCidr": f"{router}/32", "sshPublicKey": local.operator_key(state).with_suffix(".pub").read_text(),
                  "nodeCount": count, "vpcCidr": vpc, "region": REGION, "availabilityZone": ZONE,
                  "instanceType": INSTANCE_TYPE, "sshUser": getpass.getuser()}
        program, outputs = twin_program.apply(record["endpoint"], config, STACK, ZONE, getpass.getuser())
        record.update(store=outputs["storeUrl"], groups={"nodes": outputs["autoScalingGroup"],
                                                          "head": outputs["headAutoScalingGroup"]},
                      left_out=program.left_out, made=len(program.made))
        watcher = _spawn([sys.executable, "-m", "cluster.twin", "watch", str(state)], state / "watcher.log")
        record["watcher"] = watcher.pid
        _write(state, record)
        _wait_booted(state, count + 1, watcher, started)
    except BaseException:
        down(state)
        raise
    record["up_s"] = round(time.monotonic() - started, 1)
    _write(state, record)
    return record


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


# -- the watcher: the groups' instances as namespace nodes ------------------------------------------------------
class Watcher:
    def __init__(self, state: Path):
        self.state = state
        self.record = require(state)
        self.names = Names(self.record["id"])
        self.ec2, self.asg = clients(self.record)
        self.user = getpass.getuser()
        self.op_pub = local.operator_key(state).with_suffix(".pub").read_text()

    def instances(self) -> list[dict]:
        groups = list(self.record["groups"].values())
        pages = self.ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "tag:aws:autoscaling:groupName", "Values": groups}])
        return [i for p in pages for r in p["Reservations"] for i in r["Instances"]]

    def boot_or_clean(self, inst: dict) -> None:
        """A boot that failed leaves nothing behind, so the next round tries again."""
        try:
            self.boot(inst)
        except BaseException:
            f = self.state / "instances" / inst["InstanceId"] / "boot.json"
            if f.is_file():
                self.remove(json.loads(f.read_text()), quiet=True)
            raise

    def once(self) -> None:
        now = {i["InstanceId"]: i for i in self.instances()}
        mine = {b["instance_id"]: b for b in booted(self.state)}
        for iid, inst in now.items():
            state = inst["State"]["Name"]
            if state == "running" and iid not in mine:
                self.boot_or_clean(inst)
            elif state in ("shutting-down", "terminated") and iid in mine:
                self.remove(mine[iid])
        for iid, b in mine.items():
            if iid not in now:
                self.remove(b)
        self.due()

    # one instance's machine
    def boot(self, inst: dict) -> None:
        iid, ip = inst["InstanceId"], inst["PrivateIpAddress"]
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        role = "head" if tags.get("aws:autoscaling:groupName") == self.record["groups"]["head"] else "node"
        node_dir = self.state / "instances" / iid
        for sub in ("etc", "home"):
            (node_dir / sub).mkdir(parents=True, exist_ok=True)
        node_dir.chmod(0o700)
        k = 1 + max([b.get("k", 0) for b in booted(self.state)] + [_counter(self.state)])
        (self.state / "counter").write_text(str(k))
        ns, veth, prefix = self.names.ns(iid), self.names.veth(k), ipaddress.IPv4Network(self.record["subnet"]).prefixlen
        hostname = f"{self.record['cluster']}-{iid}" if role == "node" else f"{self.record['cluster']}-head"
        boot = {"instance_id": iid, "ip": ip, "role": role, "ns": ns, "veth": veth, "k": k, "host": hostname,
                "group": tags.get("aws:autoscaling:groupName"), "since": time.time(), "ready": False}
        (node_dir / "boot.json").write_text(json.dumps(boot))
        netns._run(["ip", "netns", "add", ns])
        netns._run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        netns._run(["ip", "-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0"])
        netns._run(["ip", "-n", ns, "addr", "add", "169.254.169.254/32", "dev", "lo"])
        for dev in ("lo", "eth0"):
            netns._run(["ip", "-n", ns, "link", "set", dev, "up"])
        netns._run(["ip", "-n", ns, "route", "add", "default", "via", self.record["router"]])
        netns._run(["ip", "link", "set", veth, "master", self.names.bridge, "up"])
        (netns.ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
        (netns.ETC_NETNS / ns / "hosts").write_text(f"127.0.0.1 localhost\n{ip} {hostname}\n")
        # its metadata, then what cloud-init does with its user data
        self.imds_doc(iid, ip, role, node_dir)
        imds = _spawn(["ip", "netns", "exec", ns, sys.executable, "-m", "cluster.twin_imds", str(node_dir / "imds.json")],
                      node_dir / "imds.log")
        deadline = time.monotonic() + 30
        while not local.listens(imds.pid, "169.254.169.254", 80):  # on EC2 it answers before anything boots
            if imds.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"{iid}: its IMDS did not start", fix=f"see {node_dir / 'imds.log'}")
            time.sleep(0.05)
        files = self.cloud_init(inst, node_dir)
        env_file = node_dir / "etc" / "cluster.env"
        env_file.write_text(env_file.read_text() + f"XC_INSTANCE_ID={iid}\n")
        local._keygen(node_dir / "ssh_host_ed25519_key", f"{hostname}")
        auth = node_dir / "authorized_keys"
        auth.write_text(self.op_pub)  # the launch template's key pair: the operator's key
        auth.chmod(0o600)
        config = node_dir / "sshd_config"
        config.write_text(render("sshd_config_twin.j2", address=ip, node_dir=node_dir, user=self.user,
                                 endpoint=self.record["endpoint"], host=hostname))
        wrap = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c",
                ('hostname "$0" && mount --bind "$1" /etc/xeon-cluster && mount --bind "$2" "$HOME/.xeon-cluster" && '
                'mount --bind "$3" /opt/xeon-cluster/venv && shift 3 && exec "$@"'), hostname, str(node_dir / "etc"),
                str(node_dir / "home"), self.record["venv"]]
        sshd = _spawn([*wrap, local.sshd_binary(), "-D", "-e", "-f", str(config)], node_dir / "sshd.log")
        boot.update(pids={"imds": imds.pid, "sshd": sshd.pid})
        (node_dir / "boot.json").write_text(json.dumps(boot))
        deadline = time.monotonic() + 30
        while not local.listens(sshd.pid, ip, 22):
            if sshd.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"{iid}: sshd did not start", fix=f"see {node_dir / 'sshd.log'}")
            time.sleep(0.05)
        publisher = files.get("/usr/local/sbin/xc-publish-host-keys")
        if publisher:  # the node tags itself with its host keys, through its instance profile and IMDS
            script = node_dir / "xc-publish-host-keys"
            script.write_text(publisher)
            res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(script)], check=False, capture_output=True,
                                 text=True, timeout=60, env={**os.environ, "XC_EC2_ENDPOINT": self.record["endpoint"],
                                                             "XC_SSH_HOST_KEY_DIR": str(node_dir)})
            (node_dir / "publish.log").write_text(res.stdout + res.stderr)
        boot["ready"] = True
        (node_dir / "boot.json").write_text(json.dumps(boot))
        print(f"{time.strftime('%H:%M:%S')} {role} {iid} up at {ip} ({ns})", flush=True)

    def imds_doc(self, iid: str, ip: str, role: str, node_dir: Path, **changes) -> None:
        f = node_dir / "imds.json"
        doc = json.loads(f.read_text()) if f.is_file() else {
            "instance_id": iid, "local_ipv4": ip, "region": self.record["region"],
            "availability_zone": self.record["zone"], "role": f"{self.record['cluster']}-{role}",
            "access_key": KEY_ID, "secret_key": KEY_ID, "lifecycle_state": "InService"}
        doc.update(changes)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(f)

    def cloud_init(self, inst: dict, node_dir: Path) -> dict[str, str]:
        """Its launch template's user data: /etc/xeon-cluster files land in the node's own /etc/xeon-cluster;
        returns every file by its path (the scripts the twin runs itself)."""
        import yaml

        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        lt, version = tags.get("aws:ec2launchtemplate:id"), tags.get("aws:ec2launchtemplate:version", "$Latest")
        files: dict[str, str] = {}
        if not lt:
            return files
        data = self.ec2.describe_launch_template_versions(LaunchTemplateId=lt, Versions=[version])[
            "LaunchTemplateVersions"][0]["LaunchTemplateData"]
        text = base64.b64decode(data.get("UserData") or b"").decode()
        if text.startswith("#cloud-config"):
            for entry in (yaml.safe_load(text) or {}).get("write_files", []):
                files[entry["path"]] = entry.get("content", "")
                if entry["path"].startswith("/etc/xeon-cluster/"):
                    (node_dir / "etc" / entry["path"].rsplit("/", 1)[1]).write_text(entry.get("content", ""))
        return files

    def remove(self, boot: dict, quiet: bool = False) -> None:
        ns = boot["ns"]
        netns._end_processes(ns)  # an instance that is gone takes everything on it at once
        for pid in (boot.get("pids") or {}).values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        netns._try(["ip", "link", "del", boot["veth"]])
        netns._try(["ip", "netns", "del", ns])
        shutil.rmtree(netns.ETC_NETNS / ns, ignore_errors=True)
        node_dir = self.state / "instances" / boot["instance_id"]
        (node_dir / "boot.json").unlink(missing_ok=True)
        (node_dir / "gone").write_text(str(time.time()))
        if not quiet:
            print(f"{time.strftime('%H:%M:%S')} {boot['role']} {boot['instance_id']} gone", flush=True)

    # notices that end in a termination
    def due(self) -> None:
        actions = self.state / "actions"
        for f in sorted(actions.glob("*.json")) if actions.is_dir() else []:
            act = json.loads(f.read_text())
            at = act["at"]
            for entry in _journal(self.state, act["instance"], act["since"]):
                if entry["call"] == "complete":
                    at = min(at, entry["time"])
                elif entry["call"] == "heartbeat":
                    at = max(at, entry["time"] + act["after"])
            if time.time() < at:
                continue
            try:
                if act["kind"] == "terminate":  # the group ends what its hook held
                    self.asg.terminate_instance_in_auto_scaling_group(InstanceId=act["instance"],
                                                                      ShouldDecrementDesiredCapacity=False)
                else:  # EC2 reclaims a spot instance; the group sees it gone and replaces it
                    self.ec2.terminate_instances(InstanceIds=[act["instance"]])
            except Exception as exc:  # noqa: BLE001 - already gone (a local-kill came first)
                print(f"{act['instance']}: {exc}", flush=True)
            f.unlink()
            print(f"{time.strftime('%H:%M:%S')} {act['kind']} notice of {act['instance']} ended: terminated", flush=True)


def _counter(state: Path) -> int:
    try:
        return int((state / "counter").read_text())
    except (OSError, ValueError):
        return 0


def _journal(state: Path, instance: str, since: float) -> list[dict]:
    try:
        lines = (state / "lifecycle.jsonl").read_text().splitlines()
    except OSError:
        return []
    entries = [json.loads(line) for line in lines if line.strip()]
    return [e for e in entries if e.get("instance") == instance and e.get("time", 0) >= since]


def watch(state: Path) -> None:
    w = Watcher(state)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    while not stop:
        try:
            w.once()
        except Exception as exc:  # noqa: BLE001 - the twin keeps watching; the log says what failed
            print(f"{time.strftime('%H:%M:%S')} watcher: {type(exc).__name__}: {exc}", flush=True)
        time.sleep(0.3)


# -- naming an instance -----------------------------------------------------------------------------------------
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
        from cluster import aws

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
    w = Watcher.__new__(Watcher)
    w.record = record
    if kind == "spot":
        when = datetime.datetime.fromtimestamp(now + after, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        w.imds_doc(boot["instance_id"], boot["ip"], boot["role"], node_dir, notice={"action": "terminate", "time": when})
    elif kind == "rebalance":
        when = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        w.imds_doc(boot["instance_id"], boot["ip"], boot["role"], node_dir, rebalance={"noticeTime": when})
        return f"{name} ({boot['instance_id']}): rebalance recommendation served by its IMDS; the instance stays"
    else:
        w.imds_doc(boot["instance_id"], boot["ip"], boot["role"], node_dir, lifecycle_state="Terminated")
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
    _spawn([sys.executable, "-m", "cluster.twin", "end-local", str(state), name, str(after)], state / "notices.log")
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


# -- down -------------------------------------------------------------------------------------------------------
def _parts(names: Names) -> list[str]:
    found = [s for s in netns._spaces() if names.owns_ns(s)] + [n for n in netns._links() if names.owns_link(n)]
    return found + [str(d) for d in netns.ETC_NETNS.glob(f"xct-{names.id}-*")]


def teardown(names: Names) -> list[str]:
    removed = []
    spaces = [s for s in netns._spaces() if names.owns_ns(s)]
    for ns in spaces:
        netns._end_processes(ns)
    for name in sorted(netns._links(), key=lambda n: n == names.bridge):
        if names.owns_link(name) and netns._try(["ip", "link", "del", name]).returncode == 0:
            removed.append(name)
    for ns in spaces:
        if netns._try(["ip", "netns", "del", ns]).returncode == 0:
            removed.append(ns)
    for d in netns.ETC_NETNS.glob(f"xct-{names.id}-*"):
        shutil.rmtree(d, ignore_errors=True)
    if netns.ETC_NETNS.is_dir() and not any(netns.ETC_NETNS.iterdir()):
        netns.ETC_NETNS.rmdir()
    return removed


def down(state: Path | None = None) -> str | None:
    """Stop the watcher and moto, remove every instance's namespace and the bridge; None when no twin was up."""
    state = state or state_dir()
    try:
        record = read(state)
    except ClusterError:
        record = None
    names = Names.of(state)
    if not record and not _parts(names):
        return None
    netns.require_root(("removing the AWS twin needs root", "run 'fab local-down' as root"))
    for key in ("watcher", "moto"):
        pid = (record or {}).get(key)
        if pid and _alive(pid):
            os.killpg(pid, signal.SIGTERM) if _is_group_leader(pid) else os.kill(pid, signal.SIGTERM)
            local._signal_and_wait([pid], signal.SIGTERM, wait_s=3)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    removed = teardown(names)
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["watch"]:
        watch(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["end-local"]:
        _end_local(Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
