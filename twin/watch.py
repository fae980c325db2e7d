"""The AWS twin's watcher (`python -m twin.watch STATE`, started by `fab local-up --aws`): every instance
the twin's groups launch becomes a real sshd node in a network namespace of its own, at its private address, with
its own IMDS, and its public address; an instance that is terminated goes with everything on it. Its namespace's
nftables input chain enforces its security groups (sg_rules), updated as the groups' members come and go. It also
ends the notices that `fab local-notice` posted: EC2 takes a spot instance, the group one its hook held (early once
the node completes its lifecycle action; later with each heartbeat it records). See twin/up.py for the whole
twin.
"""
from __future__ import annotations

import base64
import getpass
import gzip
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster import local, netns
from core import procs
from core.constants import REMOTE_PYTHON
from core.errors import ClusterError
from core.render import render
from twin.up import KEY_ID, Names, _alive, _spawn, booted, clients, require, write_imds

# Each pass lists the groups' instances from moto: at 0.3 s the server and this watcher took ~40 CPU-s over the
# twin's tests (bench/suite_cpu.py); a second keeps EC2's own pace (an instance is seen within its first second).
POLL_S = 1.0


class Watcher:
    def __init__(self, state: Path):
        self.state = state
        self.record = require(state)
        self.names = Names(self.record["id"])
        self.ec2, self.asg = clients(self.record)
        self.user = getpass.getuser()
        self.op_pub = local.operator_key(state).with_suffix(".pub").read_text()
        self.now: dict[str, dict] = {}  # the groups' instances at this pass, by id
        self.enforced: tuple | None = None  # the members and rules the namespaces were last given
        self.template_groups: dict[tuple, list[str]] = {}

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
        now = self.now = {i["InstanceId"]: i for i in self.instances()}
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
        self.enforce()
        self.due()

    # the security groups, as each instance's own firewall
    def groups_of(self, inst: dict) -> list[str]:
        """Its security groups: the instance's, else its launch template's interface's (moto's groups launch
        without them)."""
        if inst.get("SecurityGroups"):
            return sorted(g["GroupId"] for g in inst["SecurityGroups"])
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        key = (tags.get("aws:ec2launchtemplate:id"), tags.get("aws:ec2launchtemplate:version", "$Latest"))
        if key[0] and key not in self.template_groups:
            data = self.ec2.describe_launch_template_versions(LaunchTemplateId=key[0], Versions=[key[1]])[
                "LaunchTemplateVersions"][0]["LaunchTemplateData"]
            self.template_groups[key] = sorted(g for n in data.get("NetworkInterfaces", []) for g in n.get("Groups", []))
        return self.template_groups.get(key, [])

    def enforce(self, new: str | None = None) -> None:
        """Each booted instance's namespace (and ``new``'s, booting) gets its groups' rules with the groups' current
        members; when nothing changed since the last time, only ``new``'s."""
        live = {iid: i for iid, i in self.now.items() if i["State"]["Name"] in ("pending", "running")}
        groups = {iid: self.groups_of(i) for iid, i in live.items()}
        members: dict[str, list[str]] = {}
        for iid, gs in groups.items():
            for g in gs:
                members.setdefault(g, []).append(live[iid]["PrivateIpAddress"])
        wanted = sorted({g for gs in groups.values() for g in gs})
        found = self.ec2.describe_security_groups(Filters=[{"Name": "group-id", "Values": wanted}]) if wanted else {}
        perms = {sg["GroupId"]: sg["IpPermissions"] for sg in found.get("SecurityGroups", [])}  # a deleted one: none
        world = (sorted((k, sorted(v)) for k, v in members.items()), json.dumps(perms, sort_keys=True))
        targets = {b["instance_id"] for b in booted(self.state)} if world != self.enforced else set()
        for iid in sorted(targets | {new} - {None}):
            if iid in live:
                inst = live[iid]
                rules = sg_rules(inst["PrivateIpAddress"], [p for g in groups[iid] for p in perms.get(g, [])], members)
                res = subprocess.run(["ip", "netns", "exec", self.names.ns(iid), "nft", "-f", "-"], input=rules,
                                     capture_output=True, text=True, check=False, timeout=30)
                if res.returncode != 0:
                    raise ClusterError(f"{iid}: nft refused its security groups' rules: {res.stderr.strip()}",
                                       fix="check that the kernel has nf_tables ('nft list ruleset' as root)")
        self.enforced = world

    # one instance's machine
    def boot(self, inst: dict) -> None:
        iid, ip, public = inst["InstanceId"], inst["PrivateIpAddress"], inst.get("PublicIpAddress")
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
        boot = {"instance_id": iid, "ip": ip, "public": public, "role": role, "ns": ns, "veth": veth, "k": k, "host": hostname,
                "group": tags.get("aws:autoscaling:groupName"), "since": time.time(), "ready": False}
        (node_dir / "boot.json").write_text(json.dumps(boot))
        netns._run(["ip", "netns", "add", ns])
        netns._run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        netns._run(["ip", "-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0"])
        netns._run(["ip", "-n", ns, "addr", "add", "169.254.169.254/32", "dev", "lo"])
        for dev in ("lo", "eth0"):
            netns._run(["ip", "-n", ns, "link", "set", dev, "up"])
        netns._run(["ip", "-n", ns, "route", "add", "default", "via", self.record["router"]])
        if public:  # as AWS maps it: eth0 holds only the private address; the "internet" (operator) is the public /24
            netns._run(["ip", "-n", ns, "addr", "add", f"{public}/32", "dev", "lo"])
            netns._run(["ip", "-n", ns, "route", "add", self.record["public"], "dev", "eth0"])
        self.enforce(new=iid)  # before anything listens; the others admit it (or not) from now on
        netns._run(["ip", "link", "set", veth, "master", self.names.bridge, "up"])
        (netns.ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
        # its host name as cloud-init's hosts line maps it (templates/cloud-init.yaml.j2): to 127.0.1.1, not to its
        # address, so that whatever binds or advertises the host name's address (gloo) meets loopback, as on AWS
        (netns.ETC_NETNS / ns / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n")
        # the VPC's resolver answers at once; the machine's own, routed out of the bridge, would not answer at all
        # (each lookup a 10-20 s timeout: torch's rendezvous looks its peers up): a refusal is as quick
        (netns.ETC_NETNS / ns / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        # its metadata, then what cloud-init does with its user data
        self.imds_doc(iid, ip, role, node_dir)
        imds = _spawn(["ip", "netns", "exec", ns, sys.executable, "-m", "cluster.imds", str(node_dir / "imds.json")],
                      node_dir / "imds.log")
        deadline = time.monotonic() + 30
        while not procs.listens(imds.pid, "169.254.169.254", 80):  # on EC2 it answers before anything boots
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
        # a node gets its share of this machine's CPUs, as a local node does: otherwise every node's ranks see them all
        # and two nodes' threads fight over the same cores (test_twin's spot test took 71 s instead of 52)
        cpus = local._cpu_share((k - 1) % int(self.record["nodes"]), int(self.record["nodes"])) if role == "node" else None
        listen = ["-o", f"ListenAddress={public}"] if public else []  # its config's is the private address
        sshd = _spawn([*wrap, local.sshd_binary(), "-D", "-e", "-f", str(config), *listen], node_dir / "sshd.log", cpus)
        boot.update(pids={"imds": imds.pid, "sshd": sshd.pid})
        (node_dir / "boot.json").write_text(json.dumps(boot))
        deadline = time.monotonic() + 30
        while not procs.listens(sshd.pid, ip, 22):
            if sshd.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"{iid}: sshd did not start", fix=f"see {node_dir / 'sshd.log'}")
            time.sleep(0.05)
        publisher = files.get("/usr/local/sbin/xc-publish-host-keys")
        if publisher:  # the node tags itself with its host keys, through its instance profile and IMDS
            script = node_dir / "xc-publish-host-keys"
            script.write_text(publisher)
            res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(script)], check=False, capture_output=True,
                                 text=True, timeout=60, env={**os.environ, "XC_EC2_ENDPOINT": self.record["endpoint"],
                                                             "XC_SSM_ENDPOINT": self.record["endpoint"],
                                                             "XC_SSH_HOST_KEY_DIR": str(node_dir),
                                                             "XC_CLUSTER_ENV": str(env_file),
                                                             "XC_AUTHORIZED_KEYS": str(auth)})
            (node_dir / "publish.log").write_text(res.stdout + res.stderr)
        head_boot = files.get("/usr/local/sbin/xc-head-boot")
        if role == "head" and head_boot:  # its xc-head.service: take over the chains of the head before it
            script = node_dir / "xc-head-boot"
            script.write_text(head_boot)
            ep = self.record["endpoint"]
            # a unit's environment: nothing of the operator's (its XC_STATE_DIR, its keys); credentials from IMDS
            boot["pids"]["head_boot"] = _spawn([*wrap, "env", "-i", f"PATH={os.defpath}", f"HOME={Path.home()}",
                                                f"XC_S3_ENDPOINT_URL={ep}", f"XC_AWS_ENDPOINT_URL={ep}",
                                                REMOTE_PYTHON, str(script)], node_dir / "head-boot.log").pid
        boot["ready"] = True
        (node_dir / "boot.json").write_text(json.dumps(boot))
        print(f"{time.strftime('%H:%M:%S')} {role} {iid} up at {ip} ({ns})", flush=True)

    def imds_doc(self, iid: str, ip: str, role: str, node_dir: Path) -> None:
        write_imds(node_dir, instance_id=iid, local_ipv4=ip, region=self.record["region"],
                   availability_zone=self.record["zone"], role=f"{self.record['cluster']}-{role}", access_key=KEY_ID,
                   secret_key=KEY_ID, lifecycle_state="InService")

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
        raw = base64.b64decode(data.get("UserData") or b"")
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode()  # cloud-init takes either
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


def sg_rules(private: str, permissions: list[dict], members: dict[str, list[str]]) -> str:
    """An `nft -f` script: the input chain of an instance at ``private`` (and its public address) that admits what its
    security groups' ingress ``permissions`` do (EC2's IpPermissions), and replies. A rule naming a group admits its
    ``members`` (their private addresses) at the private address only, as on AWS: a group reference matches traffic
    inside the VPC alone. A CIDR rule admits its sources at either address. The rest is dropped, as a security group
    drops it (a connection times out). Applied again, it replaces the chain and sets in one transaction, keeping the
    connections it admitted."""
    sets = {g: "g_" + re.sub(r"\W", "_", g) for p in permissions for g in (u["GroupId"] for u in p.get("UserIdGroupPairs", []))}
    lines = ["table inet xc_sg {"]
    lines += [f"  set {name} {{ type ipv4_addr; }}" for name in sets.values()]
    lines += ["  chain input { type filter hook input priority 0; policy drop; }", "}",
              "flush chain inet xc_sg input"]
    for g, name in sets.items():
        lines.append(f"flush set inet xc_sg {name}")
        if members.get(g):
            lines.append(f"add element inet xc_sg {name} {{ {', '.join(sorted(members[g]))} }}")
    rule = "add rule inet xc_sg input "
    lines += [rule + 'iif "lo" accept', rule + "ct state established,related accept"]
    for p in permissions:
        what = _match(p)
        lines += [f"{rule}ip saddr {r['CidrIp']} {what}accept" for r in p.get("IpRanges", [])]
        lines += [f"{rule}ip saddr @{sets[u['GroupId']]} ip daddr {private} {what}accept"
                  for u in p.get("UserIdGroupPairs", [])]
    return "\n".join(lines) + "\n"


def _match(permission: dict) -> str:
    """The protocol and ports of one IpPermission as nft matches ("" for all traffic)."""
    proto = str(permission.get("IpProtocol", "-1")).lower()
    proto = {"6": "tcp", "17": "udp", "1": "icmp"}.get(proto, proto)
    if proto in ("-1", "all"):
        return ""
    low, high = permission.get("FromPort"), permission.get("ToPort")
    if proto in ("tcp", "udp") and low is not None and int(low) >= 0:
        return f"{proto} dport {low} " if low == high else f"{proto} dport {low}-{high} "
    return f"meta l4proto {proto} "


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
        time.sleep(POLL_S)


if __name__ == "__main__":
    watch(Path(sys.argv[1]))
