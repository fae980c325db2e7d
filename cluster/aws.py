"""Inventory sources for Fabric: ``aws[:NAME]`` asks EC2 for the cluster's tagged, running
instances (needs only AWS credentials) and records their host keys from their console output
(cluster.hostkeys); ``pulumi[:STACK]`` reads the stack's ``nodes`` output through the Pulumi CLI.
cluster.inventory imports this module only when a task names one of them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
from pathlib import Path

from cluster import hostkeys
from cluster.node import Node
from core.constants import PROJECT_ROOT, REMOTE_PYTHON, TAG_CLUSTER, TAG_INDEX, TAG_ROLE, TAG_SSH_USER
from core.ec2 import ec2_client
from core.errors import ClusterError

log = logging.getLogger(__name__)

PROJECT_DIR = PROJECT_ROOT  # where Pulumi.yaml lives
DEFAULT_USER = "ubuntu"


# -- aws --------------------------------------------------------------------------------------
def aws_nodes(cluster: str = "", region: str | None = None, client=None) -> list[Node]:
    """Running instances of ``cluster`` (default: $XC_AWS_CLUSTER, else the only cluster running)."""
    name = cluster or os.environ.get("XC_AWS_CLUSTER", "")
    with _aws_errors():
        client = client or ec2_client(region)
        if not name:
            name = _only_cluster(client)
        instances = _running(client, [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]},
                                      {"Name": "tag-key", "Values": [TAG_INDEX]}])
    if not instances:
        raise ClusterError(f"no running instances of cluster {name!r} in {client.meta.region_name}; "
                           "run 'pulumi up' (or check AWS_REGION and the cluster name)")
    by_index: dict[int, dict] = {}
    for inst in instances:
        tags = _tags(inst)
        try:
            index = int(tags[TAG_INDEX])
        except (KeyError, ValueError):
            raise ClusterError(f"instance {inst['InstanceId']} of cluster {name!r} has no numeric {TAG_INDEX} tag; "
                               "terminate it or tag it") from None
        if index in by_index:
            raise ClusterError(f"instances {by_index[index]['InstanceId']} and {inst['InstanceId']} both claim index "
                               f"{index} of cluster {name!r}; give each stack its own clusterName")
        by_index[index] = inst
    if 0 not in by_index:
        raise ClusterError(f"node 0 (the master) of cluster {name!r} is not running (spot interruption?); "
                           "run 'pulumi up' to replace it")
    missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
    if missing:
        log.warning("cluster %s: nodes %s are not running (spot interruption?); 'pulumi up' replaces them",
                    name, ", ".join(map(str, missing)))
    nodes = [_aws_node(by_index[i], position, name) for position, i in enumerate(sorted(by_index))]
    with _aws_errors():
        try:
            hostkeys.record_host_keys(nodes, client, hostkeys.known_hosts_path(name))
        except hostkeys.HostKeysPending as exc:
            # not fatal here: a task may use only the nodes that are ready; connect() refuses the others
            log.warning("%s", exc)
    return nodes


def _aws_node(inst: dict, position: int, cluster: str) -> Node:
    tags = _tags(inst)
    private = inst.get("PrivateIpAddress", "")
    return Node(
        name=tags.get("Name") or f"{cluster}-{tags[TAG_INDEX]}",
        host=inst.get("PublicIpAddress") or private,
        private_host=private,
        user=tags.get(TAG_SSH_USER, DEFAULT_USER),
        index=position,
        python=REMOTE_PYTHON,
        labels={"instance_id": inst["InstanceId"], "instance_type": inst.get("InstanceType", ""),
                "availability_zone": inst.get("Placement", {}).get("AvailabilityZone", ""),
                "role": tags.get(TAG_ROLE, ""), "cluster": cluster},
    )


def _only_cluster(client) -> str:
    names = {_tags(i)[TAG_CLUSTER] for i in _running(client, [{"Name": "tag-key", "Values": [TAG_CLUSTER]}])}
    if len(names) == 1:
        return names.pop()
    if not names:
        raise ClusterError(f"no running xeon-cluster instances in {client.meta.region_name}; run 'pulumi up' "
                           "(or check AWS_REGION)")
    raise ClusterError(f"{len(names)} clusters are running ({', '.join(sorted(names))}); pick one with "
                       "--cluster aws:NAME or XC_AWS_CLUSTER=NAME")


def _running(client, filters: list[dict]) -> list[dict]:
    filters = [*filters, {"Name": "instance-state-name", "Values": ["running"]}]
    pages = client.get_paginator("describe_instances").paginate(Filters=filters)
    return [inst for page in pages for res in page["Reservations"] for inst in res["Instances"]]


def _tags(inst: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


@contextlib.contextmanager
def _aws_errors():
    """Turn botocore's failures into the one-line errors the CLI shows."""
    from botocore import exceptions as err

    try:
        yield
    except (err.NoCredentialsError, err.PartialCredentialsError):
        raise ClusterError("no AWS credentials for --cluster aws; run 'aws configure' or export AWS_PROFILE "
                           "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)") from None
    except err.NoRegionError:
        raise ClusterError("no AWS region for --cluster aws; export AWS_REGION=<the stack's region>") from None
    except err.EndpointConnectionError as exc:
        raise ClusterError(f"cannot reach the EC2 API ({exc}); check the network or XC_AWS_ENDPOINT_URL") from None
    except err.ClientError as exc:
        error = exc.response.get("Error", {})
        raise ClusterError(f"AWS refused {exc.operation_name} ({error.get('Code')}: {error.get('Message')}); check that "
                           f"the credentials are valid and allow ec2:{exc.operation_name}") from None


# -- pulumi -----------------------------------------------------------------------------------
def pulumi_nodes(stack: str = "") -> list[Node]:
    """The nodes of the stack's cluster: its clusterName and region from ``pulumi stack output --json``, then
    the running instances as --cluster aws:NAME sees them (host keys, instance type, replacements included)."""
    outputs = stack_outputs(stack)
    where = f"stack {stack!r}" if stack else "the selected stack"
    if not outputs.get("nodes"):
        raise ClusterError(f"{where} has no 'nodes' output; run 'pulumi up' first")
    if not outputs.get("clusterName"):
        raise ClusterError(f"{where} has no 'clusterName' output (made by an older version); run 'pulumi up' to "
                           "refresh its outputs")
    return aws_nodes(outputs["clusterName"], region=outputs.get("region") or None)


def stack_outputs(stack: str = "") -> dict:
    project = Path(os.environ.get("XC_PULUMI_DIR") or PROJECT_DIR)
    argv = ["pulumi", "stack", "output", "--json", "--cwd", str(project)] + (["--stack", stack] if stack else [])
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ClusterError("--cluster pulumi needs the Pulumi CLI, which is not on PATH; install it (docs/ops.md) "
                           "or use --cluster aws:NAME, which needs only AWS credentials") from None
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        if "no stack" in reason.lower():
            raise ClusterError(f"Pulumi stack {stack or '(none selected)'} not found in {project} ({reason}); "
                               "see 'pulumi stack ls' and use --cluster pulumi:STACK")
        raise ClusterError(f"'pulumi stack output' failed in {project}: {reason}")
    try:
        return json.loads(proc.stdout or "{}")
    except json.JSONDecodeError:
        raise ClusterError(f"'pulumi stack output --json' printed no JSON in {project}; run it by hand") from None

