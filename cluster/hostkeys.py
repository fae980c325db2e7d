"""Verified host keys for AWS nodes, read through the authenticated AWS API (no trust on first use).

Two channels, both tied by DescribeInstances to the instance that holds the node's addresses; where the console
shows keys, the tags must agree with it (channels_agree): only the instance writes its console, while anyone
allowed ec2:CreateTags on it can write its tags:
- the instance's own tags ``xeon-cluster:host-key:<type>``, which the node writes at first boot with its
  instance profile, allowed to tag only itself (node_setup/publish_host_keys.py, infra.nodes.node_policy);
  DescribeInstances returns them with the instance, so they cost no call. They work on bare metal.
- its console output: cloud-init prints the host public keys between ``-----BEGIN SSH HOST KEY KEYS-----``
  and ``-----END SSH HOST KEY KEYS-----``, handed only to an authenticated ``ec2:GetConsoleOutput`` caller.
  Latest mode works on Nitro-hypervisor types only; bare metal has only the buffered output, which can lag
  by a long time.
The keys go into one known_hosts file per cluster, which cluster.remote.connect() loads.
"""
from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from pathlib import Path

from cluster import local
from cluster.node import Node
from core.constants import TAG_HOST_KEY
from core.errors import ClusterError

log = logging.getLogger(__name__)

BEGIN = "-----BEGIN SSH HOST KEY KEYS-----"
END = "-----END SSH HOST KEY KEYS-----"
# Key types and how many length-prefixed fields their public key blob holds.
KEY_FIELDS = {"ssh-ed25519": 2, "ecdsa-sha2-nistp256": 3, "ecdsa-sha2-nistp384": 3, "ecdsa-sha2-nistp521": 3,
              "ssh-rsa": 3}
_KEY_RE = re.compile(r"(?:^|\s)(" + "|".join(map(re.escape, KEY_FIELDS)) + r")\s+(AAAA[A-Za-z0-9+/]+={0,2})(?=\s|$)")


class HostKeysPending(ClusterError):
    """Some nodes have not printed their host keys to the console yet."""

    def __init__(self, message: str, nodes: list[str]):
        super().__init__(message)
        self.nodes = nodes


def parse_host_keys(console: str) -> list[tuple[str, str]]:
    """(keytype, base64) pairs of the last complete host key block in ``console``; [] if none."""
    block: list[tuple[str, str]] | None = None
    current: list[tuple[str, str]] | None = None
    for line in console.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if BEGIN in line:
            current = []
        elif END in line:
            if current is not None:
                block = current
            current = None
        elif current is not None:
            match = _KEY_RE.search(line)
            if match and _well_formed(match[1], match[2]) and match.groups() not in current:
                current.append((match[1], match[2]))
    return block or []


def _well_formed(keytype: str, b64: str) -> bool:
    """The blob decodes to exactly the fields of its declared type (a console line can be garbled)."""
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    fields, pos = [], 0
    while pos + 4 <= len(blob):
        size = int.from_bytes(blob[pos:pos + 4], "big")
        fields.append(blob[pos + 4:pos + 4 + size])
        pos += 4 + size
    return pos == len(blob) and len(fields) == KEY_FIELDS[keytype] and fields[0] == keytype.encode()


def console_text(output: str | None) -> str:
    """GetConsoleOutput's ``Output``: base64 from the API (boto3 passes it through), or already text."""
    if not output:
        return ""
    if BEGIN in output:
        return output
    try:
        return base64.b64decode("".join(output.split()), validate=True).decode("utf-8", "replace")
    except (binascii.Error, ValueError):
        return output


def tag_host_keys(tags: dict[str, str]) -> list[tuple[str, str]]:
    """(keytype, base64) pairs from the instance's xeon-cluster:host-key:<type> tags; malformed ones are skipped."""
    keys = []
    for key, value in sorted(tags.items()):
        keytype = key.removeprefix(TAG_HOST_KEY)
        if key.startswith(TAG_HOST_KEY) and keytype in KEY_FIELDS and _well_formed(keytype, value.strip()):
            keys.append((keytype, value.strip()))
        elif key.startswith(TAG_HOST_KEY):
            log.warning("ignoring the instance tag %s: not a well-formed %s public key", key, keytype or "host")
    return keys


def console_host_keys(client, instance_id: str) -> list[tuple[str, str]]:
    """Host keys from the instance's console output: the latest (Nitro), else the buffered one."""
    for kwargs in ({"Latest": True}, {}):
        try:
            reply = client.get_console_output(InstanceId=instance_id, **kwargs)
        except client.exceptions.ClientError as exc:
            if not kwargs:
                raise
            log.debug("GetConsoleOutput(Latest=True) for %s failed (%s); trying the buffered output", instance_id, exc)
            continue
        keys = parse_host_keys(console_text(reply.get("Output")))
        if keys:
            return keys
    return []


def channels_agree(node: Node, instance: str, tagged: list[tuple[str, str]],
                   shown: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str]:
    """The keys to trust and the channel they came from. Where the console shows keys, they are the ones, and
    every key in the instance's tags must be among them: the tags are also writable by anyone allowed
    ec2:CreateTags on the instance, the console output only by the instance itself. Without console keys (bare
    metal's buffered output lags), the tags alone."""
    if not shown:
        return tagged, "its instance tags show"
    for keytype, key in tagged:
        if (keytype, key) not in shown:
            seen = "a different one" if keytype in dict(shown) else "none of that type"
            raise ClusterError(
                f"node {node.name} ({instance}): its instance tags show a {keytype} host key and its console output "
                f"{seen}",
                fix=f"do not connect; find out who tagged {instance} (CloudTrail CreateTags: anyone allowed "
                    "ec2:CreateTags on it can), or terminate it and let its Auto Scaling group replace it")
    return shown, "its console output shows"


def known_hosts_path(cluster: str) -> Path:
    """<state folder>/aws-<cluster>/known_hosts, next to the local cluster's state."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cluster):
        raise ClusterError(f"cluster name {cluster!r} is not a plain name (letters, digits, '.', '_', '-')", fix=
                           "fix the instances' xeon-cluster:cluster tag")
    return local.state_dir(f"aws-{cluster}") / "known_hosts"


def _addresses(node: Node) -> list[str]:
    addrs = dict.fromkeys(a for a in (node.host, node.private_host) if a)
    return [a if node.port == 22 else f"[{a}]:{node.port}" for a in addrs]


def _index(lines: list[str]) -> dict[str, list[tuple[int, str, str, str]]]:
    """address -> [(line number, keytype, key, instance id recorded with it)]."""
    known: dict[str, list[tuple[int, str, str, str]]] = {}
    for i, line in enumerate(lines):
        fields = line.split()
        if len(fields) < 3 or line.startswith(("#", "@", "|")):
            continue
        instance = fields[3] if len(fields) > 3 and fields[3].startswith("i-") else ""
        for addr in fields[0].split(","):
            known.setdefault(addr, []).append((i, fields[1], fields[2], instance))
    return known


def record_host_keys(nodes: list[Node], client, path: Path) -> None:
    """Point every node's ``known_hosts`` label at ``path`` and add, from the console output, the
    keys of each node whose addresses the file lacks. Raises ClusterError for a node whose key
    changed, HostKeysPending (after recording the others) for nodes whose keys are not printed yet.
    """
    lines = path.read_text().splitlines() if path.is_file() else []
    known = _index(lines)
    drop: set[int] = set()
    added: list[str] = []
    pending: list[str] = []
    for node in nodes:
        node.labels["known_hosts"] = str(path)
        instance = node.labels.get("instance_id", "")
        addrs = _addresses(node)
        if all(any(rec in ("", instance) for *_, rec in known.get(a, [])) for a in addrs):
            continue  # recorded before, for this instance
        keys, channel = channels_agree(node, instance, tag_host_keys(node.labels.get("host_key_tags") or {}),
                                       console_host_keys(client, instance))
        if not keys:
            pending.append(node.name)
            continue
        fresh = dict(keys)
        for addr in addrs:
            for lineno, keytype, key, rec in known.get(addr, []):
                if rec and rec != instance:  # the API says the address now belongs to another instance
                    if lineno not in drop:
                        log.warning("%s (%s) now has address %s, recorded in %s for %s, which was replaced; "
                                    "dropping the old instance's keys", node.name, instance, addr, path, rec)
                    drop.add(lineno)
                elif fresh.get(keytype, key) != key:
                    raise ClusterError(
                        f"node {node.name} ({instance}, {addr}): {channel} a {keytype} host key that "
                        f"differs from the one in {path} line {lineno + 1}", fix="if the instance was replaced, remove "
                        "that stale line and retry, otherwise do not connect and find out why the key changed")
        have = {(addr, keytype, key) for addr in addrs for n, keytype, key, _ in known.get(addr, []) if n not in drop}
        for keytype, key in keys:
            missing = [a for a in addrs if (a, keytype, key) not in have]
            if missing:
                added.append(f"{','.join(missing)} {keytype} {key} {instance} {node.name}")
        log.info("host keys of %s (%s), as %s: %s", node.name, instance, channel, ", ".join(t for t, _ in keys))
    if added or drop:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text("".join(line + "\n" for i, line in enumerate(lines) if i not in drop) +
                       "".join(line + "\n" for line in added))
        os.replace(tmp, path)
    if pending:
        who = f"node {pending[0]}'s" if len(pending) == 1 else f"nodes {', '.join(pending)}'s"
        they = "it is" if len(pending) == 1 else "they are"
        raise HostKeysPending(f"{who} instance tags and console output have no host keys yet ({they} still booting); "
                              "retry in a minute", pending)
