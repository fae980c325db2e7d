"""The mesh key on AWS (cluster.mesh), against a moto server over HTTP: fab puts the cluster key in SSM as a
SecureString encrypted with the cluster's own KMS key (found by its alias, as 'pulumi up' makes it), with its public
half beside it; the head reads it back into its state folder, private to it; a node booting authorizes the public
half (node_setup/publish_host_keys.py, SigV4 by hand), once, and does nothing when no run has put a key yet. A cluster
without the key (a stack made before it) is an error naming 'pulumi up', never the account's aws/ssm key. The whole
flow, head and replacement node included, runs on the AWS twin (tests/twin/test_twin.py)."""
from __future__ import annotations

import os
import runpy
import stat
import subprocess
import sys
from pathlib import Path

import moto_fixture
from fake_imds import FakeIMDS

from cluster import mesh
from infra.policies import KEY_ALIAS_ROOT, SECRETS_ROOT, key_alias, mesh_key_parameter

ROOT = Path(__file__).resolve().parents[2]
PUBLISHER = ROOT / "node_setup" / "publish_host_keys.py"


def _key(folder: Path) -> Path:
    key = folder / "cluster_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "xeon-cluster aws-bert", "-f", str(key)],
                   check=True)
    return key


def cluster_key(cluster: str) -> str:
    """What 'pulumi up' makes (infra/head.py): the cluster's KMS key under its alias, and one of another cluster
    beside it; returns the cluster's key's ARN."""
    kms = moto_fixture.client("kms")
    arns = []
    for name in (cluster, f"{cluster}-other"):
        meta = kms.create_key(Description=f"xeon-cluster {name}")["KeyMetadata"]
        kms.create_alias(AliasName=key_alias(name), TargetKeyId=meta["KeyId"])
        arns.append(meta["Arn"])
    return arns[0]


def key_of(name: str) -> str | None:
    """The KeyId SSM keeps for a parameter (DescribeParameters; GetParameter does not say)."""
    found = moto_fixture.client("ssm").describe_parameters(
        ParameterFilters=[{"Key": "Name", "Values": [name]}])["Parameters"]
    return found[0].get("KeyId") if found else None


def test_the_parameters_are_where_the_policies_allow():
    assert mesh.ROOT == SECRETS_ROOT and mesh.parameter("bert") == mesh_key_parameter("bert")
    assert mesh.KEY_ALIAS_ROOT == KEY_ALIAS_ROOT and mesh.key_alias("bert") == key_alias("bert")


def test_fab_puts_the_key_as_a_secure_string_and_the_head_reads_it_back_private(aws_env, tmp_path):
    key = _key(tmp_path)
    arn = cluster_key("bert")
    mesh.publish("bert", key)
    ssm = moto_fixture.client("ssm")
    secret = ssm.get_parameter(Name="/xeon-cluster/bert/mesh-key")["Parameter"]
    assert secret["Type"] == "SecureString" and secret["Value"] != key.read_text()  # encrypted at rest
    # with the cluster's own key, not the account's aws/ssm key (which anyone allowed GetParameter decrypts with)
    assert key_of("/xeon-cluster/bert/mesh-key") == arn and arn.startswith("arn:aws:kms:")
    public = ssm.get_parameter(Name="/xeon-cluster/bert/mesh-key.pub")["Parameter"]
    assert public["Type"] == "String" and public["Value"] == key.with_suffix(".pub").read_text().strip()

    state = tmp_path / "head-state"
    got = mesh.fetch("bert", state, "xeon-cluster aws-bert")
    assert got == state / "cluster_ed25519" and got.read_text() == key.read_text()
    assert stat.S_IMODE(got.stat().st_mode) == 0o600 and stat.S_IMODE(state.stat().st_mode) == 0o700
    # the same line the operator's fab authorized on the nodes: cluster.keys finds it there, adds no second one
    assert got.with_suffix(".pub").read_text() == key.with_suffix(".pub").read_text()
    mesh.publish("bert", key)  # again, unchanged: put again, nothing else
    assert mesh.fetch("bert", state, "xeon-cluster aws-bert").read_text() == key.read_text()
    assert key_of("/xeon-cluster/bert/mesh-key") == arn


def test_a_cluster_without_its_key_is_told_to_run_pulumi_up_and_nothing_is_put(aws_env, tmp_path):
    """A stack made before the key existed: one line naming the fix, and no SecureString under the aws/ssm key."""
    import pytest

    from core.errors import ClusterError

    key = _key(tmp_path)
    cluster_key("other")  # another cluster's key is not this one's
    with pytest.raises(ClusterError) as info:
        mesh.publish("bert", key)
    assert str(info.value).startswith("cluster bert has no KMS key alias/xeon-cluster/bert for its secrets")
    assert "pulumi up" in info.value.fix and "\n" not in str(info.value)
    assert key_of("/xeon-cluster/bert/mesh-key") is None and key_of("/xeon-cluster/bert/mesh-key.pub") is None
    # a disabled key is no key either
    kms = moto_fixture.client("kms")
    kms.disable_key(KeyId=cluster_key("bert").rsplit("/", 1)[1])
    with pytest.raises(ClusterError, match="is Disabled.*pulumi up"):
        mesh.publish("bert", key)


def test_a_head_with_no_key_in_ssm_says_who_puts_it(aws_env, tmp_path):
    import pytest

    from core.errors import ClusterError

    with pytest.raises(ClusterError, match="no mesh key at /xeon-cluster/bert/mesh-key in SSM") as info:
        mesh.fetch("bert", tmp_path / "state", "xeon-cluster aws-bert")
    assert "fab train" in info.value.fix and not (tmp_path / "state" / "cluster_ed25519").exists()


def _boot(aws_env: str, tmp_path: Path, env_lines: str) -> subprocess.CompletedProcess:
    """The node's first-boot script, as cloud-init runs it: its IMDS, its cluster.env, its authorized_keys."""
    (tmp_path / "cluster.env").write_text(env_lines)
    (tmp_path / "etc-ssh").mkdir(exist_ok=True)
    (tmp_path / "etc-ssh" / "ssh_host_ed25519_key.pub").write_text(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExampleExampleExampleExampleExampleExam root@n\n")
    instance = moto_fixture.client("ec2").run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)[
        "Instances"][0]["InstanceId"]
    imds = FakeIMDS()
    imds.instance_id, imds.region = instance, moto_fixture.REGION
    try:
        return subprocess.run([sys.executable, str(PUBLISHER)], check=False, capture_output=True, text=True,
                              timeout=60, env={"PATH": os.environ["PATH"], "XC_IMDS_ENDPOINT": imds.url,
                                               "XC_EC2_ENDPOINT": aws_env, "XC_SSM_ENDPOINT": aws_env,
                                               "XC_SSH_HOST_KEY_DIR": str(tmp_path / "etc-ssh"),
                                               "XC_CLUSTER_ENV": str(tmp_path / "cluster.env"),
                                               "XC_AUTHORIZED_KEYS": str(tmp_path / "ssh" / "authorized_keys")})
    finally:
        imds.close()


def test_a_booting_node_authorizes_the_mesh_key_once_and_waits_for_none(aws_env, tmp_path):
    env = "XC_CLUSTER=bert\nXC_SSH_USER=ubuntu\nXC_MESH_KEY_PARAMETER=/xeon-cluster/bert/mesh-key.pub\n"
    keys = tmp_path / "ssh" / "authorized_keys"
    first = _boot(aws_env, tmp_path, env)  # a node of a cluster no run has used yet
    assert first.returncode == 0, first.stderr
    assert "no mesh key at /xeon-cluster/bert/mesh-key.pub yet" in first.stdout and not keys.exists()

    key = _key(tmp_path)
    cluster_key("bert")
    mesh.publish("bert", key)
    keys.parent.mkdir()
    keys.write_text("ssh-ed25519 AAAAoperator operator@laptop\n")  # the launch template's key pair
    for said in ("authorized", "already authorized"):  # a reboot adds no second line
        booted = _boot(aws_env, tmp_path, env)
        assert booted.returncode == 0, booted.stderr
        assert f"mesh key /xeon-cluster/bert/mesh-key.pub {said} in {keys}" in booted.stdout, booted.stdout
    pub = key.with_suffix(".pub").read_text().strip()
    assert keys.read_text().splitlines() == ["ssh-ed25519 AAAAoperator operator@laptop", pub]
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600

    plain = _boot(aws_env, tmp_path / "ssh", "XC_CLUSTER=bert\n")  # a head, or a node of an older stack: no parameter
    assert plain.returncode == 0 and "mesh key" not in plain.stdout, plain.stdout + plain.stderr


def test_the_ssm_call_is_signed_as_botocore_signs_it(monkeypatch):
    import datetime

    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    publisher = runpy.run_path(str(PUBLISHER), run_name="publisher")
    creds = {"AccessKeyId": "AKIDEXAMPLE", "SecretAccessKey": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"}
    url, body = "https://ssm.eu-west-1.amazonaws.com/", '{"Name": "/xeon-cluster/bert/mesh-key.pub"}'
    now = datetime.datetime(2026, 11, 27, 10, 0, 0, tzinfo=datetime.timezone.utc)
    ours = publisher["signed_headers"](url, body, "eu-west-1", creds, now, service="ssm",
                                       content_type="application/x-amz-json-1.1", target="AmazonSSM.GetParameter")
    request = AWSRequest(method="POST", url=url, data=body.encode(), headers={
        "Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": "AmazonSSM.GetParameter"})
    monkeypatch.setattr("botocore.auth.datetime.datetime", type("Frozen", (datetime.datetime,), {
        "utcnow": classmethod(lambda cls: now.replace(tzinfo=None)),
        "now": classmethod(lambda cls, tz=None: now if tz else now.replace(tzinfo=None))}))
    SigV4Auth(Credentials("AKIDEXAMPLE", creds["SecretAccessKey"]), "ssm", "eu-west-1").add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
