"""The mesh key of an AWS cluster: the cluster key (cluster.keys.cluster_key) kept as an SSM SecureString at
/xeon-cluster/<cluster>/mesh-key, so that the head's supervisors reach the nodes with it and hand it to node 0
for mpirun. fab puts it there and authorizes it on the nodes before a supervisor starts on the head; the head
reads it into its own state folder. Only the head's role may read it (infra.policies.head_policy); nodes, which
run user code, may not.

It is encrypted with the cluster's own KMS key (infra/head.py), not the account's aws/ssm key, which anyone allowed
ssm:GetParameter may decrypt with: the key's policy lets only the head's role decrypt. fab finds the key by its
alias (secrets_key), so an aws:NAME cluster needs no Pulumi CLI; the run secrets use it too (launch.staging.run_secrets).
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from core.ec2 import aws_client, aws_errors
from core.errors import ClusterError

log = logging.getLogger(__name__)

ROOT = "/xeon-cluster"  # infra.policies.SECRETS_ROOT (tests/cluster/test_mesh.py keeps the two equal)
KEY_ALIAS_ROOT = "alias/xeon-cluster"  # infra.policies.KEY_ALIAS_ROOT (likewise)
KEY_FILE = "cluster_ed25519"  # cluster.keys.cluster_key's file in a cluster's state folder


def parameter(cluster: str) -> str:
    return f"{ROOT}/{cluster}/mesh-key"


def key_alias(cluster: str) -> str:
    """The alias of the cluster's secrets key, which 'pulumi up' makes (infra.policies.key_alias)."""
    return f"{KEY_ALIAS_ROOT}/{cluster}"


def secrets_key(cluster: str, region: str | None = None) -> str:
    """The ARN of the KMS key the cluster's SecureStrings are encrypted with, found by its alias. A stack made before
    the key existed has none: that is an error naming the fix, never a silent fall-back to the aws/ssm key (which
    every principal allowed ssm:GetParameter may decrypt with)."""
    with aws_errors("kms"):
        client = aws_client("kms", region)
        try:
            meta = client.describe_key(KeyId=key_alias(cluster))["KeyMetadata"]
        except client.exceptions.NotFoundException:
            raise ClusterError(f"cluster {cluster} has no KMS key {key_alias(cluster)} for its secrets (a stack made "
                               "before it)", fix="run 'pulumi up' in the cluster's stack: it makes the key") from None
    if not meta.get("Enabled", True):
        raise ClusterError(f"the KMS key {key_alias(cluster)} of cluster {cluster} is {meta.get('KeyState', 'disabled')}",
                           fix="run 'pulumi up' in the cluster's stack (or enable the key)")
    return meta["Arn"]


def publish(cluster: str, key: Path, region: str | None = None) -> None:
    """Operator side: the private key as a SecureString encrypted with the cluster's key (secrets_key). Put again on
    every call, with its public half beside it: the operator may not read them back, and an unchanged value only
    adds a version."""
    key_id = secrets_key(cluster, region)
    with aws_errors("ssm"):
        client = aws_client("ssm", region)
        client.put_parameter(Name=parameter(cluster), Value=key.read_text(), Type="SecureString", Overwrite=True,
                             KeyId=key_id, Description=f"xeon-cluster {cluster}: the mesh key (the head reads it)")
        client.put_parameter(Name=parameter(cluster) + ".pub", Value=key.with_suffix(".pub").read_text().strip(),
                             Type="String", Overwrite=True, Description=f"xeon-cluster {cluster}: the mesh key's "
                             "public half (a node the group launches authorizes it at boot)")
    log.info("mesh key of cluster %s in SSM at %s", cluster, parameter(cluster))


def fetch(cluster: str, state: Path, comment: str, region: str | None = None) -> Path:
    """Head side: the mesh key into ``state`` as the cluster key (0600, with its public half, whose ``comment`` is
    the operator's: cluster.keys finds it in authorized_keys by the whole line); returns its path."""
    with aws_errors("ssm"):
        client = aws_client("ssm", region)
        try:
            value = client.get_parameter(Name=parameter(cluster), WithDecryption=True)["Parameter"]["Value"]
        except client.exceptions.ParameterNotFound:
            raise ClusterError(f"no mesh key at {parameter(cluster)} in SSM", fix="start the run with 'fab train' "
                               "from the operator's machine: it puts the key there") from None
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = state / KEY_FILE
    tmp = key.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not for a moment
    with os.fdopen(fd, "w") as fh:
        fh.write(value if value.endswith("\n") else value + "\n")
    tmp.replace(key)
    pub = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], check=True, capture_output=True, text=True).stdout
    key.with_suffix(".pub").write_text(" ".join(pub.split()[:2] + [comment]) + "\n")  # ssh-keygen -y keeps a comment
    return key
