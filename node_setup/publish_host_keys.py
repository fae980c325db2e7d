#!/usr/bin/env python3
"""Publish this node's SSH host public keys as tags of its own EC2 instance, at first boot.

The second channel for host keys (cluster.hostkeys reads them back with DescribeInstances, an
authenticated AWS call): GetConsoleOutput's Latest mode works on Nitro-hypervisor types only, and
bare metal's buffered output may not show cloud-init's key block for a long time. Only the node's
own instance profile may write these tags, only on itself (infra.nodes.node_policy).

Then, on a node whose cluster.env names XC_MESH_KEY_PARAMETER, it authorizes the cluster's mesh key: the
public half fab keeps in SSM (cluster.mesh), so that the head's supervisors reach a node the group launched while
the operator's machine was away. No parameter yet (no run was started): nothing to do, fab authorizes the key
when it first trains.

Python's standard library alone: it runs from cloud-init before any project software is on the
node (image=base), so it signs its CreateTags and GetParameter calls with AWS Signature Version 4 itself.
Environment (tests): XC_IMDS_ENDPOINT, XC_EC2_ENDPOINT, XC_SSM_ENDPOINT, XC_SSH_HOST_KEY_DIR, XC_CLUSTER_ENV,
XC_AUTHORIZED_KEYS.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import pwd
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

TAG_PREFIX = "xeon-cluster:host-key:"  # core.constants.TAG_HOST_KEY
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521")
MAX_TAG_VALUE = 256  # EC2's limit: an RSA key (~550 characters) does not fit and is left out
# The instance profile's credentials can lag the boot, and a new role's policy takes a while to reach every IAM
# endpoint: retry with backoff (5, 10, 20, 40, 60, 60, ... s) for about ten minutes, then give up (the console
# output stays the other channel).
DEADLINE_S, FIRST_WAIT_S, MAX_WAIT_S = 600, 5, 60
DNS_SUFFIX = {"cn-": "amazonaws.com.cn"}  # by region prefix, where IMDS does not say (services/domain)


def waits(deadline_s: float = DEADLINE_S, first_s: float = FIRST_WAIT_S, cap_s: float = MAX_WAIT_S) -> list[float]:
    """The pauses between tries: doubling from first_s up to cap_s, adding up to deadline_s."""
    out: list[float] = []
    wait = first_s
    while sum(out) + wait <= deadline_s:
        out.append(wait)
        wait = min(wait * 2, cap_s)
    return out


def imds(base: str, path: str, token: str | None = None) -> str:
    if token is None:
        req = urllib.request.Request(base + "/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    else:
        req = urllib.request.Request(base + path, headers={"X-aws-ec2-metadata-token": token})
    with urllib.request.urlopen(req, timeout=5) as reply:
        return reply.read().decode()


def host_keys(folder: Path) -> list[tuple[str, str]]:
    """(type, base64) of the host keys that fit a tag, from ssh_host_*_key.pub."""
    out = []
    for pub in sorted(folder.glob("ssh_host_*_key.pub")):
        fields = pub.read_text().split()
        if len(fields) >= 2 and fields[0] in KEY_TYPES and len(fields[1]) <= MAX_TAG_VALUE:
            out.append((fields[0], fields[1]))
    return sorted(out, key=lambda k: KEY_TYPES.index(k[0]))


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


FORM = "application/x-www-form-urlencoded; charset=utf-8"


def signed_headers(url: str, body: str, region: str, creds: dict, now: datetime.datetime, service: str = "ec2",
                   content_type: str = FORM, target: str | None = None) -> dict[str, str]:
    """SigV4 headers for a POST: form-encoded to EC2's query API, or JSON with its X-Amz-Target (SSM)."""
    parts = urllib.parse.urlsplit(url)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"content-type": content_type, "host": parts.netloc, "x-amz-date": stamp}
    if target:
        headers["x-amz-target"] = target
    if creds.get("Token"):
        headers["x-amz-security-token"] = creds["Token"]
    names = sorted(headers)
    canonical = "\n".join(["POST", parts.path or "/", "", *(f"{n}:{headers[n]}" for n in names), "",
                           ";".join(names), hashlib.sha256(body.encode()).hexdigest()])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + creds["SecretAccessKey"]).encode(), day), region), service),
                "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds['AccessKeyId']}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return headers


def create_tags_body(instance: str, keys: list[tuple[str, str]]) -> str:
    params = {"Action": "CreateTags", "Version": "2016-11-15", "ResourceId.1": instance}
    for i, (keytype, b64) in enumerate(keys, 1):
        params[f"Tag.{i}.Key"], params[f"Tag.{i}.Value"] = TAG_PREFIX + keytype, b64
    return urllib.parse.urlencode(params)


def dns_suffix(base: str, token: str, region: str) -> str:
    """The partition's DNS suffix (amazonaws.com, amazonaws.com.cn, ...): IMDS's services/domain, else by region."""
    try:
        return imds(base, "/latest/meta-data/services/domain", token).strip()
    except urllib.error.HTTPError:
        return next((d for p, d in DNS_SUFFIX.items() if region.startswith(p)), "amazonaws.com")


def ec2_url(region: str, domain: str) -> str:
    return f"https://ec2.{region}.{domain}/"


def identity(base: str) -> tuple[str, str, str, dict]:
    """(instance id, region, DNS suffix, the instance profile's credentials), from IMDSv2."""
    token = imds(base, "", None)
    instance = imds(base, "/latest/meta-data/instance-id", token)
    region = imds(base, "/latest/meta-data/placement/region", token)
    domain = dns_suffix(base, token, region)
    role = imds(base, "/latest/meta-data/iam/security-credentials/", token).split()[0]
    return instance, region, domain, json.loads(imds(base, f"/latest/meta-data/iam/security-credentials/{role}", token))


def publish(base: str, endpoint: str | None, folder: Path) -> str:
    keys = host_keys(folder)
    if not keys:
        raise RuntimeError(f"no ed25519 or ecdsa host key in {folder}")
    instance, region, domain, creds = identity(base)
    url = endpoint or ec2_url(region, domain)
    body = create_tags_body(instance, keys)
    headers = signed_headers(url, body, region, creds, datetime.datetime.now(datetime.timezone.utc))
    req = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=20):
        pass
    return f"published {', '.join(t for t, _ in keys)} host keys of {instance} as its tags"


def mesh_public_key(base: str, endpoint: str | None, name: str) -> str | None:
    """The mesh key's public half from SSM parameter ``name``; None when there is none yet."""
    _, region, domain, creds = identity(base)
    url = endpoint or f"https://ssm.{region}.{domain}/"
    body = json.dumps({"Name": name})
    headers = signed_headers(url, body, region, creds, datetime.datetime.now(datetime.timezone.utc), service="ssm",
                             content_type="application/x-amz-json-1.1", target="AmazonSSM.GetParameter")
    req = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as reply:
            return json.loads(reply.read())["Parameter"]["Value"].strip()
    except urllib.error.HTTPError as exc:
        if exc.code == 400 and b"ParameterNotFound" in exc.read():
            return None
        raise


def authorize(pub: str, path: Path, owner: str | None) -> bool:
    """Add ``pub`` to the authorized_keys at ``path`` (as ``owner``, 0600) unless it is there; True if added."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = path.read_text().splitlines() if path.is_file() else []
    if pub in lines:
        return False
    with path.open("a") as fh:
        fh.write(pub + "\n")
    path.chmod(0o600)
    if owner:
        user = pwd.getpwnam(owner)
        for p in (path.parent, path):
            os.chown(p, user.pw_uid, user.pw_gid)
    return True


def cluster_env() -> dict[str, str]:
    path = Path(os.environ.get("XC_CLUSTER_ENV") or "/etc/xeon-cluster/cluster.env")
    lines = path.read_text().splitlines() if path.is_file() else []
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def authorize_mesh_key(base: str, env: dict[str, str]) -> str:
    name, user = env["XC_MESH_KEY_PARAMETER"], env.get("XC_SSH_USER") or None
    pub = mesh_public_key(base, os.environ.get("XC_SSM_ENDPOINT") or None, name)
    if pub is None:
        return f"no mesh key at {name} yet: fab authorizes it on this node when it first trains"
    where = os.environ.get("XC_AUTHORIZED_KEYS")
    path = Path(where) if where else Path(pwd.getpwnam(user or "root").pw_dir) / ".ssh" / "authorized_keys"
    added = authorize(pub, path, None if where else user)
    return f"mesh key {name} {'authorized' if added else 'already authorized'} in {path}"


def with_retries(what: str, call, sleep, deadline_s: float | None) -> int:
    pauses = waits(DEADLINE_S if deadline_s is None else deadline_s)
    tries = len(pauses) + 1
    for attempt in range(1, tries + 1):
        try:
            print(call(), flush=True)
            return 0
        except (OSError, ValueError, KeyError, IndexError, RuntimeError) as exc:
            detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
            print(f"{what}: try {attempt}/{tries}: {exc} {detail}".strip(), file=sys.stderr, flush=True)
            if attempt < tries:
                sleep(pauses[attempt - 1])
    return 1


def main(sleep=time.sleep, deadline_s: float | None = None) -> int:
    base = os.environ.get("XC_IMDS_ENDPOINT", "http://169.254.169.254").rstrip("/")
    endpoint = os.environ.get("XC_EC2_ENDPOINT") or None
    folder = Path(os.environ.get("XC_SSH_HOST_KEY_DIR", "/etc/ssh"))
    # a failure leaves the console output as the other channel for host keys
    rc = with_retries("xc-publish-host-keys", lambda: publish(base, endpoint, folder), sleep, deadline_s)
    env = cluster_env()
    if env.get("XC_MESH_KEY_PARAMETER"):
        rc |= with_retries("xc-authorize-mesh-key", lambda: authorize_mesh_key(base, env), sleep, deadline_s)
    return rc


if __name__ == "__main__":
    sys.exit(main())
