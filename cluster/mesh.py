"""The mesh key of an AWS cluster: the cluster key (cluster.keys.cluster_key) kept as an SSM SecureString at
/xeon-cluster/<cluster>/mesh-key, so that the head's supervisors reach the nodes with it and hand it to node 0
for mpirun. fab puts it there and authorizes it on the nodes before a supervisor starts on the head; the head
reads it into its own state folder. Only the head's role may read it (infra.policies.head_policy); nodes, which
run user code, may not.
"""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from core.ec2 import aws_client, aws_errors
from core.errors import ClusterError

log = logging.getLogger(__name__)

ROOT = "/xeon-cluster"  # infra.policies.SECRETS_ROOT (tests/test_mesh.py keeps the two equal)
KEY_FILE = "cluster_ed25519"  # cluster.keys.cluster_key's file in a cluster's state folder


def parameter(cluster: str) -> str:
    return f"{ROOT}/{cluster}/mesh-key"


def publish(cluster: str, key: Path, region: str | None = None) -> None:
    """Operator side: the private key as a SecureString (encrypted with the account's aws/ssm key). Put again on
    every call, with its public half beside it: the operator may not read them back, and an unchanged value only
    adds a version."""
    with aws_errors("ssm"):
        client = aws_client("ssm", region)
        client.put_parameter(Name=parameter(cluster), Value=key.read_text(), Type="SecureString", Overwrite=True,
                             Description=f"xeon-cluster {cluster}: the mesh key (the head reads it)")
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
