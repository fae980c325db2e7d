"""Host keys of AWS nodes from their console output (cluster.hostkeys): the parser on a recorded
console excerpt, the per-cluster known_hosts file, the aws source against the real moto server,
and a real SSH handshake through cluster.remote.connect() against that file.
"""
from __future__ import annotations

import base64
import io
import logging
import os
import runpy
import socket
import subprocess
import sys
import threading
import types
import urllib.parse
from pathlib import Path

import moto_fixture
import paramiko
import pytest
from botocore.exceptions import ClientError
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from fake_imds import FakeIMDS

from cluster import aws as discovery
from cluster import hostkeys
from cluster.node import Node
from cluster.remote import connect
from core.constants import TAG_CLUSTER, TAG_HOST_KEY, TAG_ROLE
from core.ec2 import ec2_client
from core.errors import ClusterError

ROOT = Path(__file__).resolve().parents[2]

# Real keys (ssh-keygen), as cloud-init prints them from /etc/ssh/ssh_host_*_key.pub.
ECDSA = ("ecdsa-sha2-nistp256", ("AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBF8QOuvpgDPRFtYEDURHb1KdVQB1eXQnJN"
                                 "kmSwxnskavJpzr2+Ie/80iE05IungN8gZpFOsUyB6rPorfKRh9hp4="))
ED25519 = ("ssh-ed25519", "AAAAC3NzaC1lZDI1NTE5AAAAIHH5QSNmB9u4TurcMLpI1tbP1SX1krqSqJj1pcQ0hc+Y")
RSA = ("ssh-rsa", ("AAAAB3NzaC1yc2EAAAADAQABAAABgQDLbgDjly8PixKXzDUE/OWjdBZji189pV2qskD8LUNHCEKh8SR+kp/a/1/kFQh7OWh8T8"
                   "YMcj13tnCy4gtrvhrGRmkj9drHg6MVqNQcJrHttFSpc5w9ng+ExY0QUXzkEwOFXJT7QZPhKNy31TjWTvgiI7NEe7x7db2puSmgd"
                   "jbhVMGQHf9AiGZFRiiwv19nvBnidEw91JOFfEn/7AulvZH/M8DSMusdpCL0/+a5YK6a6JB5WV6DggmJzL9fohFO9XQiYG6v/UYf"
                   "1sRJIUHXSZ+yVVZdmznuKaFGECTEZ9lLZzUgkzAu8wzPARQ9zL1ZBy60HLKegFmtIi5Qmr4M/9lCpO4Y7/nSFfrhCyDgib8Mpb"
                   "uERMVb8Rem4ayIbQL9fo5Pdf4HpLacheJhBDAMcNlR5yN2M//mQQIZt8SQqtGJjCsjlj8zp7PZTjEtA/UOfSaIjplR8dVJTx2p"
                   "kHZqgwBlG4evFxgHMPs81BlFbN8F7oD1ZdZaqqgy84TqZ/lVKG8="))
KEYS = [ECDSA, ED25519, RSA]


def console(keys=KEYS, host="ip-10-42-0-11") -> str:
    """An Ubuntu 24.04 EC2 serial console (CRLF, as the serial port delivers it) around cloud-init's key block."""
    lines = [
        ("[    0.000000] Linux version 6.8.0-1021-aws (buildd@lcy02-amd64-067) (x86_64-linux-gnu-gcc-13 (Ubuntu "
         "13.2.0-23ubuntu4) 13.2.0, GNU ld (GNU Binutils for Ubuntu) 2.42) #23-Ubuntu SMP Mon Dec  9 23:59:34 UTC 2024"),
        ("[    0.000000] Command line: BOOT_IMAGE=/vmlinuz-6.8.0-1021-aws root=PARTUUID=5b6d3e2c-01 ro console=tty1 "
         "console=ttyS0 nvme_core.io_timeout=4294967295 panic=-1"),
        "[    0.000000] x86/fpu: Supporting XSAVE feature 0x20000: 'AMX Tile config'",
        "[    1.204417] nvme nvme0: 2/0/0 default/read/poll queues",
        ("[    4.518902] cloud-init[574]: Cloud-init v. 24.4-0ubuntu1~24.04.2 running 'init-local' at Tue, 04 Feb 2025 "
         "10:12:03 +0000. Up 4.49 seconds."),
        "[    6.231187] cloud-init[612]: ci-info: +++++++++++++++++++++++Net device info++++++++++++++++++++++++",
        ("[    6.231405] cloud-init[612]: ci-info: | ens5 | True | 10.42.0.11 | 255.255.0.0 | global | "
         "0a:1b:2c:3d:4e:5f |"),
        "[    6.889021] cloud-init[612]: Generating public/private ed25519 key pair.",
        "[    6.889311] cloud-init[612]: Your identification has been saved in /etc/ssh/ssh_host_ed25519_key",
        "[    6.889701] cloud-init[612]: SHA256:1ppJvB6YjU8ls5f5aJhfShlwFbMZ5dl9uanBxzyxGms root@" + host,
        "[    6.890101] cloud-init[612]: +--[ED25519 256]--+",
        "[    6.890303] cloud-init[612]: |   .o+=*B=o.     |",
        "[    6.890501] cloud-init[612]: +----[SHA256]-----+",
        ("[    8.402118] cloud-init[733]: Cloud-init v. 24.4-0ubuntu1~24.04.2 running 'modules:config' at Tue, 04 Feb "
         "2025 10:12:08 +0000. Up 8.38 seconds."),
        "<14>Feb  4 10:12:09 ec2: ",
        "<14>Feb  4 10:12:09 ec2: #############################################################",
        "<14>Feb  4 10:12:09 ec2: -----BEGIN SSH HOST KEY FINGERPRINTS-----",
        "<14>Feb  4 10:12:09 ec2: 256 SHA256:29UnD2IYlGAJsXtVjZ2qIoQx4IozCOkRWKOYYx1FDY0 root@" + host + " (ECDSA)",
        "<14>Feb  4 10:12:09 ec2: 256 SHA256:1ppJvB6YjU8ls5f5aJhfShlwFbMZ5dl9uanBxzyxGms root@" + host + " (ED25519)",
        "<14>Feb  4 10:12:09 ec2: 3072 SHA256:GZNiUCupsp8071qdI2genEj4WK8SlqJJBdREpWgTdyg root@" + host + " (RSA)",
        "<14>Feb  4 10:12:09 ec2: -----END SSH HOST KEY FINGERPRINTS-----",
        "<14>Feb  4 10:12:09 ec2: #############################################################",
        "-----BEGIN SSH HOST KEY KEYS-----",
        *(f"{t} {k} root@{host}" for t, k in keys),
        "-----END SSH HOST KEY KEYS-----",
        ("[    9.112301] cloud-init[801]: Cloud-init v. 24.4-0ubuntu1~24.04.2 finished at Tue, 04 Feb 2025 10:12:09 "
         "+0000. Datasource DataSourceEc2Local.  Up 9.10 seconds"),
        "",
        "Ubuntu 24.04.1 LTS " + host + " ttyS0",
        "",
        host + " login: ",
    ]
    return "\r\n".join(lines)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()  # what the EC2 API returns in Output


# -- the parser -------------------------------------------------------------------------------
def test_parser_reads_the_key_block_and_nothing_else_of_a_recorded_console():
    assert hostkeys.parse_host_keys(console()) == KEYS  # not the fingerprints, the randomart or the login prompt
    assert hostkeys.parse_host_keys(hostkeys.console_text(b64(console()))) == KEYS  # base64 as the API sends it
    assert hostkeys.console_text(console()) == console()  # text (a client that decodes) passes through
    assert hostkeys.console_text(None) == hostkeys.console_text("") == ""


def test_parser_without_a_complete_block_finds_nothing():
    full = console()
    assert hostkeys.parse_host_keys(full.split("-----BEGIN SSH HOST KEY KEYS")[0]) == []  # still booting
    assert hostkeys.parse_host_keys(full.split("-----END SSH HOST KEY KEYS")[0]) == []  # cut while printing
    assert hostkeys.parse_host_keys("") == []


def test_parser_skips_garbled_lines_and_takes_the_last_boot():
    garbled = (ED25519[0], ED25519[1][:40])  # a line cut short on the serial console
    wrong_type = ("ssh-rsa", ED25519[1])  # blob says ssh-ed25519
    assert hostkeys.parse_host_keys(console([ECDSA, garbled, wrong_type, RSA])) == [ECDSA, RSA]
    rebooted = console([ECDSA]) + "\r\n[    0.000000] Linux version 6.8.0-1021-aws\r\n" + console([ED25519])
    assert hostkeys.parse_host_keys(rebooted) == [ED25519]


# -- the known_hosts file ---------------------------------------------------------------------
class FakeEC2:
    """GetConsoleOutput only (a unit stand-in: moto's console output is canned, see below)."""

    exceptions = types.SimpleNamespace(ClientError=ClientError)

    def __init__(self, outputs: dict[str, str], latest_unsupported: bool = False):
        self.outputs, self.latest_unsupported, self.calls = outputs, latest_unsupported, []

    def get_console_output(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("Latest") and self.latest_unsupported:
            raise ClientError({"Error": {"Code": "UnsupportedOperation", "Message": "Latest is Nitro only"}},
                              "GetConsoleOutput")
        return {"InstanceId": kwargs["InstanceId"], "Output": b64(self.outputs[kwargs["InstanceId"]])}


def aws_node(index: int, public: str, private: str, instance: str) -> Node:
    return Node(name=f"bert-{index}", host=public, private_host=private, user="ubuntu", index=index,
                labels={"instance_id": instance})


def test_keys_are_recorded_once_per_node_for_both_addresses(tmp_path):
    path = tmp_path / "aws-bert" / "known_hosts"
    ec2 = FakeEC2({"i-0a": console(), "i-0b": console([ED25519])})
    nodes = [aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a"), aws_node(1, "198.51.100.12", "10.42.0.12", "i-0b")]

    hostkeys.record_host_keys(nodes, ec2, path)

    assert [n.labels["known_hosts"] for n in nodes] == [str(path)] * 2
    assert path.read_text().splitlines() == [
        *(f"198.51.100.11,10.42.0.11 {t} {k} i-0a bert-0" for t, k in KEYS),
        f"198.51.100.12,10.42.0.12 {ED25519[0]} {ED25519[1]} i-0b bert-1"]
    assert ec2.calls == [{"InstanceId": "i-0a", "Latest": True}, {"InstanceId": "i-0b", "Latest": True}]
    # what connect() loads: paramiko finds each node's keys under either address
    loaded = paramiko.HostKeys(str(path))
    for addr in ("198.51.100.11", "10.42.0.11"):
        assert {t: loaded.lookup(addr)[t].get_base64() for t in loaded.lookup(addr)} == dict(KEYS)

    before = path.read_text()
    fresh = [aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a"), aws_node(1, "198.51.100.12", "10.42.0.12", "i-0b")]
    hostkeys.record_host_keys(fresh, ec2, path)  # cached: no API call, same file
    assert len(ec2.calls) == 2 and path.read_text() == before
    assert fresh[1].labels["known_hosts"] == str(path)

    # a new public address after stop/start: only that one is added, for the same instance
    moved = aws_node(1, "198.51.100.99", "10.42.0.12", "i-0b")
    hostkeys.record_host_keys([moved], ec2, path)
    assert path.read_text() == before + f"198.51.100.99 {ED25519[0]} {ED25519[1]} i-0b bert-1\n"


def test_a_changed_key_is_refused_and_the_file_kept(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(f"10.42.0.11 {ED25519[0]} {ED25519[1]} i-0a bert-0\n")
    other = ("ssh-ed25519", ed25519_key().get_base64())
    ec2 = FakeEC2({"i-0a": console([other])})
    node = aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a")  # new public address: the file lacks it
    with pytest.raises(ClusterError, match=rf"node bert-0 \(i-0a, 10\.42\.0\.11\): its console output shows a "
                                           rf"ssh-ed25519 host key that differs from the one in {path} line 1; if the instance was "
                                           r"replaced, remove that stale line"):
        hostkeys.record_host_keys([node], ec2, path)
    assert path.read_text() == f"10.42.0.11 {ED25519[0]} {ED25519[1]} i-0a bert-0\n"
    path.write_text(f"10.42.0.11 {ED25519[0]} {ED25519[1]}\n")  # written by hand: no instance to tell
    with pytest.raises(ClusterError, match="differs from the one in"):
        hostkeys.record_host_keys([node], ec2, path)


def test_an_address_taken_over_by_a_replacement_instance_gets_its_keys(tmp_path, caplog):
    # the spot node i-0old was replaced by i-0new, which got the same private address
    path = tmp_path / "known_hosts"
    path.write_text(f"198.51.100.11,10.42.0.11 {RSA[0]} {RSA[1]} i-0old bert-0\n"
                    f"198.51.100.12,10.42.0.12 {RSA[0]} {RSA[1]} i-0b bert-1\n")
    node = aws_node(0, "198.51.100.77", "10.42.0.11", "i-0new")
    with caplog.at_level(logging.WARNING, logger="cluster.hostkeys"):
        hostkeys.record_host_keys([node], FakeEC2({"i-0new": console([ED25519])}), path)
    assert path.read_text().splitlines() == [f"198.51.100.12,10.42.0.12 {RSA[0]} {RSA[1]} i-0b bert-1",
                                             f"198.51.100.77,10.42.0.11 {ED25519[0]} {ED25519[1]} i-0new bert-0"]
    assert "bert-0 (i-0new) now has address 10.42.0.11, recorded" in caplog.text and "for i-0old" in caplog.text


def test_a_node_without_keys_in_its_console_is_pending_and_the_others_are_recorded(tmp_path):
    path = tmp_path / "known_hosts"
    booting = console().split("-----BEGIN SSH HOST KEY KEYS")[0]
    ec2 = FakeEC2({"i-0a": console(), "i-0b": booting, "i-0c": ""})
    nodes = [aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a"), aws_node(1, "198.51.100.12", "10.42.0.12", "i-0b")]
    with pytest.raises(ClusterError, match=r"^node bert-1's instance tags and console output have no host keys "
                                           r"yet \(it is still booting\); retry in a minute$"):
        hostkeys.record_host_keys(nodes, ec2, path)
    assert len(path.read_text().splitlines()) == 3 and "bert-1" not in path.read_text()
    # Latest=True first, then the buffered output, before giving up on a node
    assert ec2.calls[1:] == [{"InstanceId": "i-0b", "Latest": True}, {"InstanceId": "i-0b"}]
    nodes.append(aws_node(2, "198.51.100.13", "10.42.0.13", "i-0c"))
    with pytest.raises(hostkeys.HostKeysPending, match=r"^nodes bert-1, bert-2's instance tags and console output "
                                                       r"have no host keys yet \(they are still booting\); retry in a minute$") as exc:
        hostkeys.record_host_keys(nodes, ec2, path)
    assert exc.value.nodes == ["bert-1", "bert-2"]


def test_the_file_lives_in_the_state_folder_and_only_for_plain_cluster_names(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path))
    assert hostkeys.known_hosts_path("bert-2") == tmp_path / "aws-bert-2" / "known_hosts"
    with pytest.raises(ClusterError, match=r"cluster name '../x' is not a plain name"):
        hostkeys.known_hosts_path("../x")


def test_latest_output_unsupported_falls_back_to_the_buffered_output(tmp_path):
    ec2 = FakeEC2({"i-0a": console()}, latest_unsupported=True)
    hostkeys.record_host_keys([aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a")], ec2, tmp_path / "kh")
    assert ec2.calls == [{"InstanceId": "i-0a", "Latest": True}, {"InstanceId": "i-0a"}]
    assert len((tmp_path / "kh").read_text().splitlines()) == 3


# -- the aws source against the real moto server ----------------------------------------------
def launch(index: int) -> str:
    # moto lets a test set the group tag that AWS reserves to EC2 Auto Scaling: an instance of bert's group
    tags = {"Name": "bert-node", TAG_CLUSTER: "bert", TAG_ROLE: "master" if index == 0 else "worker",
            discovery.GROUP_TAG: discovery.node_group("bert")}
    reply = ec2_client(moto_fixture.REGION).run_instances(
        ImageId="ami-0123456789abcdef0", MinCount=1, MaxCount=1, InstanceType="c6i.16xlarge",
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
    return reply["Instances"][0]["InstanceId"]


def test_moto_console_without_keys_is_the_clear_pending_error(aws_env, tmp_path, monkeypatch, caplog):
    # moto's GetConsoleOutput returns a canned kernel log (base64, as AWS does) without a key block:
    # this exercises the real API call and its decoding, and the "still booting" path.
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path / "state"))
    launch(0)
    client = ec2_client(moto_fixture.REGION)
    (inst,) = [i for r in client.describe_instances()["Reservations"] for i in r["Instances"]]
    output = client.get_console_output(InstanceId=inst["InstanceId"], Latest=True)["Output"]
    assert hostkeys.console_text(output).startswith("Linux version")

    with caplog.at_level(logging.WARNING, logger="cluster.aws"):
        (node,) = discovery.aws_nodes("bert")  # discovery goes on: a task may use only the ready nodes
    path = tmp_path / "state" / "aws-bert" / "known_hosts"
    assert node.labels["known_hosts"] == str(path) and not path.exists()
    assert "node bert-0's instance tags and console output have no host keys yet (it is still booting); retry in a minute" \
        in caplog.text
    with pytest.raises(ClusterError, match=r"node bert-0's instance tags and console output have no host keys yet .*retry in "
                                           r"a minute"):
        hostkeys.record_host_keys([node], client, path)


class ConsoleOverMoto:
    """The moto client, with GetConsoleOutput answering the recorded console (moto's is canned)."""

    def __init__(self, client, text: str):
        self._client, self._text, self.calls = client, text, []

    def __getattr__(self, name):
        return getattr(self._client, name)

    def get_console_output(self, **kwargs):
        self._client.get_console_output(**kwargs)  # the real call: the instance must exist
        self.calls.append(kwargs)
        return {"InstanceId": kwargs["InstanceId"], "Output": b64(self._text)}


def test_aws_source_records_the_keys_of_the_instances_it_found(aws_env, tmp_path, monkeypatch):
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path / "state"))
    ids = [launch(0), launch(1)]
    client = ConsoleOverMoto(ec2_client(moto_fixture.REGION), console())
    nodes = discovery.aws_nodes("bert", client=client)
    path = tmp_path / "state" / "aws-bert" / "known_hosts"
    assert [c["InstanceId"] for c in client.calls] == ids and all(c["Latest"] for c in client.calls)
    assert path.read_text().splitlines() == [f"{n.host},{n.private_host} {t} {k} {n.labels['instance_id']} {n.name}"
                                             for n in nodes for t, k in KEYS]
    assert all(n.labels["known_hosts"] == str(path) for n in nodes)
    discovery.aws_nodes("bert", client=client)
    assert len(client.calls) == 2  # cached


def test_refused_console_access_names_the_permission(aws_env, monkeypatch, tmp_path):
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path / "state"))
    launch(0)

    class Denied(ConsoleOverMoto):
        def get_console_output(self, **kwargs):
            raise ClientError({"Error": {"Code": "UnauthorizedOperation", "Message": "not allowed"}},
                              "GetConsoleOutput")

    with pytest.raises(ClusterError, match=r"AWS refused GetConsoleOutput \(UnauthorizedOperation: not allowed\); "
                                           r"check that the credentials are valid and allow ec2:GetConsoleOutput"):
        discovery.aws_nodes("bert", client=Denied(ec2_client(moto_fixture.REGION), ""))


# -- the second channel: the node's own instance tags (bare metal) -----------------------------
PUBLISHER = ROOT / "node_setup" / "publish_host_keys.py"


def host_key_folder(tmp_path: Path) -> Path:
    """/etc/ssh as a node has it: an RSA key too long for a tag, an ed25519 and an ECDSA key."""
    folder = tmp_path / "etc-ssh"
    folder.mkdir()
    for name, (keytype, key) in (("rsa", RSA), ("ed25519", ED25519), ("ecdsa", ECDSA)):
        (folder / f"ssh_host_{name}_key.pub").write_text(f"{keytype} {key} root@ip-10-42-0-11\n")
        (folder / f"ssh_host_{name}_key").write_text("private: never read\n")
    return folder


def test_the_publishers_signature_is_botocores(monkeypatch):
    # the node signs its one call by hand (no boto3 at first boot): it must be SigV4 exactly
    import datetime

    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    publisher = runpy.run_path(str(PUBLISHER), run_name="publisher")
    creds = {"AccessKeyId": "AKIDEXAMPLE", "SecretAccessKey": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
             "Token": "session-token"}
    body = publisher["create_tags_body"]("i-0123456789abcdef0", [ED25519, ECDSA])
    url = "https://ec2.eu-west-1.amazonaws.com/"
    now = datetime.datetime(2026, 11, 24, 10, 0, 0, tzinfo=datetime.timezone.utc)
    ours = publisher["signed_headers"](url, body, "eu-west-1", creds, now)

    request = AWSRequest(method="POST", url=url, data=body.encode(), headers={
        "Content-Type": "application/x-www-form-urlencoded; charset=utf-8"})
    monkeypatch.setattr("botocore.auth.datetime.datetime", type("Frozen", (datetime.datetime,), {
        "utcnow": classmethod(lambda cls: now.replace(tzinfo=None)),
        "now": classmethod(lambda cls, tz=None: now if tz else now.replace(tzinfo=None))}))
    SigV4Auth(Credentials("AKIDEXAMPLE", creds["SecretAccessKey"], "session-token"), "ec2", "eu-west-1").add_auth(
        request)
    assert request.headers["X-Amz-Date"] == ours["x-amz-date"] == "20261124T100000Z"
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-security-token"] == "session-token"
    assert dict(urllib.parse.parse_qsl(body))["Tag.1.Key"] == "xeon-cluster:host-key:ssh-ed25519"
    assert publisher["TAG_PREFIX"] == TAG_HOST_KEY


def test_a_node_publishes_its_keys_as_tags_and_fab_verifies_a_metal_node_by_them(aws_env, tmp_path, monkeypatch):
    monkeypatch.setenv("XC_STATE_DIR", str(tmp_path / "state"))
    instance = launch(0)
    imds = FakeIMDS()
    imds.instance_id, imds.region = instance, moto_fixture.REGION
    try:
        run = subprocess.run([sys.executable, str(PUBLISHER)], check=False, capture_output=True, text=True, timeout=60, env={
            "PATH": os.environ["PATH"], "XC_IMDS_ENDPOINT": imds.url, "XC_EC2_ENDPOINT": aws_env,
            "XC_SSH_HOST_KEY_DIR": str(host_key_folder(tmp_path))})
    finally:
        imds.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"published ssh-ed25519, ecdsa-sha2-nistp256 host keys of {instance} as its tags"
    client = ec2_client(moto_fixture.REGION)
    (inst,) = [i for r in client.describe_instances()["Reservations"] for i in r["Instances"]]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags[TAG_HOST_KEY + "ssh-ed25519"] == ED25519[1] and tags[TAG_HOST_KEY + "ecdsa-sha2-nistp256"] == ECDSA[1]
    assert TAG_HOST_KEY + "ssh-rsa" not in tags  # ~550 characters: over EC2's 256 for a tag value

    class Metal(ConsoleOverMoto):
        """r7iz.metal-*: no Latest output, and the buffered one does not show the key block yet."""

        def get_console_output(self, **kwargs):
            self.calls.append(kwargs)
            if kwargs.get("Latest"):
                raise ClientError({"Error": {"Code": "UnsupportedOperation", "Message": "not on metal"}},
                                  "GetConsoleOutput")
            return {"InstanceId": kwargs["InstanceId"], "Output": b64(console().split("-----BEGIN SSH")[0])}

    metal = Metal(client, "")
    (node,) = discovery.aws_nodes("bert", client=metal)
    path = tmp_path / "state" / "aws-bert" / "known_hosts"
    # the console is asked (both modes) and has no keys yet: DescribeInstances brought the tags, which count alone
    assert metal.calls == [{"InstanceId": instance, "Latest": True}, {"InstanceId": instance}]
    assert path.read_text().splitlines() == [f"{node.host},{node.private_host} {t} {k} {instance} bert-0"
                                             for t, k in (ECDSA, ED25519)]
    # a tag that disagrees with the key recorded for the instance is refused, as a console that does
    moved = aws_node(0, "198.51.100.99", node.private_host, instance)  # a new public address: looked up again
    moved.labels["host_key_tags"] = {TAG_HOST_KEY + "ssh-ed25519": ed25519_key().get_base64()}
    with pytest.raises(ClusterError, match=r"its instance tags show a ssh-ed25519 host key that differs from the "
                                           rf"one in {path} line 2"):
        hostkeys.record_host_keys([moved], metal, path)


def test_a_malformed_host_key_tag_is_ignored_and_the_console_still_counts(tmp_path, caplog):
    node = aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a")
    node.labels["host_key_tags"] = {TAG_HOST_KEY + "ssh-ed25519": ECDSA[1], TAG_HOST_KEY + "ssh-dss": "AAAA"}
    ec2 = FakeEC2({"i-0a": console([ED25519])})
    with caplog.at_level(logging.WARNING, logger="cluster.hostkeys"):
        hostkeys.record_host_keys([node], ec2, tmp_path / "kh")
    assert "ignoring the instance tag xeon-cluster:host-key:ssh-ed25519: not a well-formed ssh-ed25519" in caplog.text
    assert "ignoring the instance tag xeon-cluster:host-key:ssh-dss" in caplog.text
    assert (tmp_path / "kh").read_text().split()[1:3] == list(ED25519) and len(ec2.calls) == 1



def test_where_the_console_shows_keys_the_tags_must_agree_with_it(tmp_path):
    """Anyone allowed ec2:CreateTags on an instance can write its host-key tags; only the instance writes
    its console. A tag the console contradicts is refused, naming the node and the instance; nothing is recorded."""
    path = tmp_path / "known_hosts"
    forged = ("ssh-ed25519", ed25519_key().get_base64())
    node = aws_node(0, "198.51.100.11", "10.42.0.11", "i-0a")
    node.labels["host_key_tags"] = {TAG_HOST_KEY + forged[0]: forged[1]}
    with pytest.raises(ClusterError, match=r"^node bert-0 \(i-0a\): its instance tags show a ssh-ed25519 host key "
                                           r"and its console output a different one; do not connect; find out who "
                                           r"tagged i-0a \(CloudTrail CreateTags"):
        hostkeys.record_host_keys([node], FakeEC2({"i-0a": console()}), path)
    assert not path.exists()
    # a type the console does not show at all (an attacker's nistp384 beside cloud-init's keys) is refused too
    node.labels["host_key_tags"] = {TAG_HOST_KEY + ED25519[0]: ED25519[1], TAG_HOST_KEY + ECDSA[0]: ECDSA[1]}
    with pytest.raises(ClusterError, match=r"its instance tags show a ecdsa-sha2-nistp256 host key and its console "
                                           r"output none of that type"):
        hostkeys.record_host_keys([node], FakeEC2({"i-0a": console([ED25519, RSA])}), path)
    # agreeing channels: the console's keys are recorded (RSA too, which no tag can hold)
    ec2 = FakeEC2({"i-0a": console()})
    hostkeys.record_host_keys([node], ec2, path)
    assert [line.split()[1:3] for line in path.read_text().splitlines()] == [list(k) for k in KEYS]
    assert ec2.calls == [{"InstanceId": "i-0a", "Latest": True}]


# -- a real SSH handshake against the recorded keys -------------------------------------------
def ed25519_pem() -> str:
    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()


def ed25519_key(pem: str = "") -> paramiko.Ed25519Key:
    return paramiko.Ed25519Key.from_private_key(io.StringIO(pem or ed25519_pem()))


@pytest.fixture
def sshd():
    """A paramiko SSH server on 127.0.0.1 with an ed25519 host key; it refuses every login."""
    host_key = ed25519_key()
    listener = socket.create_server(("127.0.0.1", 0))
    transports = []

    class Refuse(paramiko.ServerInterface):
        def get_allowed_auths(self, username):
            return "publickey"

    def serve():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            t = paramiko.Transport(sock)
            t.add_server_key(host_key)
            transports.append(t)
            try:
                t.start_server(server=Refuse())
            except (paramiko.SSHException, EOFError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield host_key, listener.getsockname()[1]
    listener.close()
    for t in transports:
        t.close()
    thread.join(5)


def test_connect_accepts_the_host_key_from_the_console_and_refuses_others(sshd, tmp_path, monkeypatch):
    host_key, port = sshd
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/known_hosts of the user's
    monkeypatch.delenv("XC_KNOWN_HOSTS", raising=False)
    identity = tmp_path / "id_ed25519"
    identity.write_text(ed25519_pem())
    identity.chmod(0o600)

    def node(instance):
        return Node(name="bert-0", host="127.0.0.1", private_host="127.0.0.1", user="ubuntu", port=port,
                    labels={"instance_id": instance, "identity": str(identity)})

    path = tmp_path / "known_hosts"
    ok = node("i-0a")
    hostkeys.record_host_keys([ok], FakeEC2({"i-0a": console([(host_key.get_name(), host_key.get_base64())])}), path)
    assert path.read_text().startswith(f"[127.0.0.1]:{port} ssh-ed25519 ")
    # the handshake verified the host key and got as far as the login
    with pytest.raises(ClusterError, match=r"SSH login as 'ubuntu' refused"):
        connect(ok, timeout=5)

    wrong = tmp_path / "wrong"
    hostkeys.record_host_keys([node("i-0b")], FakeEC2({"i-0b": console([ED25519])}), wrong)
    with pytest.raises(ClusterError, match=r"host key CHANGED") as changed:
        connect(Node(**{**ok.to_dict(), "labels": {**ok.labels, "known_hosts": str(wrong)}}), timeout=5)
    # the fix names the file this cluster records its keys in, not ~/.ssh/known_hosts
    assert f"recorded in {wrong};" in str(changed.value)
    assert f"'ssh-keygen -f {wrong} -R \"[127.0.0.1]:{port}\"'" in str(changed.value)
    with pytest.raises(ClusterError, match=r"host key unknown"):
        connect(Node(**{**ok.to_dict(), "labels": {"identity": str(identity)}}), timeout=5)
