"""Inventory sources for Fabric: ``aws[:NAME]`` asks EC2 for the running instances of the cluster's Auto Scaling
group (needs only AWS credentials) and records their host keys (cluster.hostkeys); ``pulumi[:STACK]`` reads the
stack's outputs through the Pulumi CLI. cluster.inventory imports this module only when a task names one of them.

A node is an instance of the cluster's group, as the tag ``aws:autoscaling:groupName`` says: EC2 Auto Scaling
sets it and nobody else can (the ``aws:`` prefix is reserved), where our own tags can be set by anyone allowed
``ec2:CreateTags``. An instance with the cluster's tags outside the group is never a node: a warning names it.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

from cluster import hostkeys
from cluster.node import Node
from core.constants import PROJECT_ROOT, REMOTE_PYTHON, TAG_CLUSTER, TAG_HOST_KEY, TAG_IMAGE, TAG_ROLE, TAG_SSH_USER
from core.ec2 import aws_errors, ec2_client
from core.errors import ClusterError

log = logging.getLogger(__name__)

PROJECT_DIR = PROJECT_ROOT  # where Pulumi.yaml lives
DEFAULT_USER = "ubuntu"
GROUP_TAG = "aws:autoscaling:groupName"  # set by EC2 Auto Scaling on the instances it launches; reserved to AWS


def node_group(cluster: str) -> str:
    """The name of the cluster's Auto Scaling group (infra.nodes.group_name; a test keeps the two equal)."""
    return f"{cluster}-nodes"


# -- aws --------------------------------------------------------------------------------------
def aws_nodes(cluster: str = "", region: str | None = None, client=None, group: str | None = None) -> list[Node]:
    """Running instances of ``cluster``'s Auto Scaling group ``group`` (default: NAME-nodes; the cluster default:
    $XC_AWS_CLUSTER, else the only cluster running), node 0 first: the one holding the master role tag, then the
    others oldest first."""
    name = cluster or os.environ.get("XC_AWS_CLUSTER", "")
    with aws_errors():
        client = client or ec2_client(region)
        if not name:
            name = _only_cluster(client)
        group = group or node_group(name)
        instances = members(_running(client, [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]},
                                              {"Name": "tag-key", "Values": [TAG_ROLE]}]), name, group)
        if not instances:
            raise ClusterError(f"no running instances of cluster {name!r} (Auto Scaling group {group}) in "
                               f"{client.meta.region_name}", fix="run 'pulumi up' (or check AWS_REGION and the cluster name)")
        ordered = order_nodes(client, instances, name)
    nodes = [_aws_node(inst, position, name) for position, inst in enumerate(ordered)]
    with aws_errors():
        try:
            hostkeys.record_host_keys(nodes, client, hostkeys.known_hosts_path(name))
        except hostkeys.HostKeysPending as exc:
            # not fatal here: a task may use only the nodes that are ready; connect() refuses the others
            log.warning("%s", exc)
    return nodes


def order_nodes(client, instances: list[dict], cluster: str) -> list[dict]:
    """Master first, then by launch time: survivors keep their order and a replacement comes last.
    When no running node holds the master tag (node 0 was reclaimed), the oldest survivor takes it."""
    by_age = sorted(instances, key=lambda i: (str(i.get("LaunchTime", "")), i["InstanceId"]))
    masters = [i for i in by_age if _tags(i).get(TAG_ROLE) == "master"]
    if masters:
        master = masters[0]
        extra = [i["InstanceId"] for i in masters[1:]]
        if extra:  # two fab processes promoted at once: the older master keeps the role
            client.create_tags(Resources=extra, Tags=[{"Key": TAG_ROLE, "Value": "worker"}])
    else:
        master = by_age[0]
        client.create_tags(Resources=[master["InstanceId"]], Tags=[{"Key": TAG_ROLE, "Value": "master"}])
        log.warning("cluster %s: no running node held the master tag; %s (the oldest) is node 0 now",
                    cluster, master["InstanceId"])
    return [master, *[i for i in by_age if i is not master]]


def members(instances: list[dict], cluster: str, group: str, warn: bool = True) -> list[dict]:
    """The instances of Auto Scaling group ``group``; each other one (our tags, set by hand) is named in a warning."""
    inside = [i for i in instances if _tags(i).get(GROUP_TAG) == group]
    for stray in (i for i in instances if i not in inside) if warn else ():
        elsewhere = _tags(stray).get(GROUP_TAG)
        where = f"is in Auto Scaling group {elsewhere}" if elsewhere else "is in no Auto Scaling group"
        log.warning("instance %s carries the tags of cluster %s but %s, not %s: not a node of the cluster; "
                    "find out who launched or tagged it, and terminate it or remove its %s tag",
                    stray["InstanceId"], cluster, where, group, TAG_CLUSTER)
    return inside


def head_group(cluster: str) -> str:
    """The name of the head's Auto Scaling group of one (infra.head.head_group_name; a test keeps the two equal)."""
    return f"{cluster}-head"


def head_instances(cluster: str, region: str | None = None) -> list[dict]:
    """The cluster's head: the instances of its own group (never one that only carries our tags), any state but
    terminated; 'fab status' lists it with its on-demand cost."""
    with aws_errors():
        pages = ec2_client(region).get_paginator("describe_instances").paginate(Filters=[
            {"Name": f"tag:{GROUP_TAG}", "Values": [head_group(cluster)]},
            {"Name": "instance-state-name", "Values": ["pending", "running", "shutting-down", "stopping", "stopped"]}])
        return [inst for page in pages for res in page["Reservations"] for inst in res["Instances"]]


def aws_head(cluster: str = "", region: str | None = None) -> Node | None:
    """The running instance of the cluster's head group, as a Node fab connects to (its host keys recorded from its
    tags, as a node's are), or None: no head is running. It runs supervisors from the venv at REMOTE_PYTHON."""
    name = cluster or os.environ.get("XC_AWS_CLUSTER", "")
    with aws_errors():
        client = ec2_client(region)
        name = name or _only_cluster(client)
        running = sorted(_running(client, [{"Name": f"tag:{GROUP_TAG}", "Values": [head_group(name)]}]),
                         key=lambda i: (str(i.get("LaunchTime", "")), i["InstanceId"]))
        if not running:
            return None
        inst, tags = running[-1], _tags(running[-1])
        private = inst.get("PrivateIpAddress", "")
        head = Node(name=head_group(name), host=dial(inst), private_host=private,
                    user=tags.get(TAG_SSH_USER, DEFAULT_USER), index=-1, python=REMOTE_PYTHON,
                    labels={"instance_id": inst["InstanceId"], "aws_head": name, "cluster": name,
                            "instance_type": inst.get("InstanceType", ""),
                            "host_key_tags": {k: v for k, v in tags.items() if k.startswith(TAG_HOST_KEY)}})
        try:
            hostkeys.record_host_keys([head], client, hostkeys.known_hosts_path(name))
        except hostkeys.HostKeysPending as exc:
            log.warning("%s", exc)
    return head


def starting_nodes(cluster: str, region: str | None = None, group: str | None = None) -> list[dict]:
    """Instances of the cluster's group that are not running yet or any more (a replacement booting, a node
    being reclaimed): 'fab status' shows them beside the nodes."""
    with aws_errors():
        pages = ec2_client(region).get_paginator("describe_instances").paginate(Filters=[
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}, {"Name": "tag-key", "Values": [TAG_ROLE]},
            {"Name": "instance-state-name", "Values": ["pending", "shutting-down", "stopping", "stopped"]}])
        found = [inst for page in pages for res in page["Reservations"] for inst in res["Instances"]]
    return members(found, cluster, group or node_group(cluster), warn=False)


# Set on a head inside the cluster's VPC: its SSH to the nodes goes to their private addresses, the only ones the
# nodes' security-group rule for the head's group admits (a group reference matches private addresses alone).
ADDRESS_ENV = "XC_AWS_ADDRESS"


def dial(inst: dict) -> str:
    """The address fab connects to: the public one from outside the VPC, the private one inside it (or where none)."""
    private = inst.get("PrivateIpAddress", "")
    if os.environ.get(ADDRESS_ENV) == "private":
        return private or inst.get("PublicIpAddress", "")
    return inst.get("PublicIpAddress") or private


def _aws_node(inst: dict, position: int, cluster: str) -> Node:
    tags = _tags(inst)
    private = inst.get("PrivateIpAddress", "")
    return Node(
        name=f"{cluster}-{position}",
        host=dial(inst),
        private_host=private,
        user=tags.get(TAG_SSH_USER, DEFAULT_USER),
        index=position,
        python=REMOTE_PYTHON,
        labels={"instance_id": inst["InstanceId"], "instance_type": inst.get("InstanceType", ""),
                "availability_zone": inst.get("Placement", {}).get("AvailabilityZone", ""),
                "role": "master" if position == 0 else "worker", "cluster": cluster,
                "lifecycle": inst.get("InstanceLifecycle", "on-demand"), "image": tags.get(TAG_IMAGE, ""),
                "launch_time": str(inst.get("LaunchTime", "")),
                "host_key_tags": {k: v for k, v in tags.items() if k.startswith(TAG_HOST_KEY)}},
    )


def _only_cluster(client) -> str:
    running = _running(client, [{"Name": "tag-key", "Values": [TAG_CLUSTER]}])
    names = {_tags(i)[TAG_CLUSTER] for i in running if _tags(i).get(GROUP_TAG) == node_group(_tags(i)[TAG_CLUSTER])}
    if len(names) == 1:
        return names.pop()
    if not names:
        raise ClusterError(f"no running xeon-cluster instances in {client.meta.region_name}", fix="run 'pulumi up' "
                           "(or check AWS_REGION)")
    raise ClusterError(f"{len(names)} clusters are running ({', '.join(sorted(names))})", fix="pick one with "
                       "--cluster aws:NAME or XC_AWS_CLUSTER=NAME")


def _running(client, filters: list[dict]) -> list[dict]:
    filters = [*filters, {"Name": "instance-state-name", "Values": ["running"]}]
    pages = client.get_paginator("describe_instances").paginate(Filters=filters)
    return [inst for page in pages for res in page["Reservations"] for inst in res["Instances"]]


def _tags(inst: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


# -- pulumi -----------------------------------------------------------------------------------
def pulumi_nodes(stack: str = "") -> list[Node]:
    """The nodes of the stack's cluster: its clusterName and region from ``pulumi stack output --json``, then
    the running instances as --cluster aws:NAME sees them (host keys, instance type, replacements included)."""
    outputs = stack_outputs(stack)
    where = f"stack {stack!r}" if stack else "the selected stack"
    if not outputs:
        raise ClusterError(f"{where} has no outputs", fix="run 'pulumi up' first")
    if not outputs.get("clusterName"):
        raise ClusterError(f"{where} has no 'clusterName' output (made by an older version)", fix="run 'pulumi up' to "
                           "refresh its outputs")
    return aws_nodes(outputs["clusterName"], region=outputs.get("region") or None,
                     group=outputs.get("autoScalingGroup") or None)


def stack_place(stack: str = "") -> tuple[str, str]:
    """(clusterName, region) of the stack (default: the selected one): from its outputs while it has them, else
    (after 'pulumi destroy', which keeps the config) from its config; the region defaults as in Pulumi.yaml."""
    outputs = stack_outputs(stack)
    if outputs.get("clusterName") and outputs.get("region"):
        return str(outputs["clusterName"]), str(outputs["region"])
    project = Path(os.environ.get("XC_PULUMI_DIR") or PROJECT_DIR)
    try:
        config = json.loads(_stack_config(str(project), stack, shutil.which("pulumi")))
    except json.JSONDecodeError:
        config = {}
    meta = _project_file(project)
    entry = (meta.get("config") or {}).get("region")
    default_region = str(entry.get("default") or "") if isinstance(entry, dict) else ""

    def value(key: str) -> str:
        got = config.get(f"{meta.get('name') or 'xeon-cluster'}:{key}")
        return str((got.get("value") if isinstance(got, dict) else got) or "")

    return (str(outputs.get("clusterName") or value("clusterName")),
            str(outputs.get("region") or value("region") or default_region))


def _project_file(project: Path) -> dict:
    """Pulumi.yaml as a dict ({} where there is none)."""
    import yaml

    path = project / "Pulumi.yaml"
    loaded = yaml.safe_load(path.read_text()) if path.is_file() else None
    return loaded if isinstance(loaded, dict) else {}


@functools.lru_cache(maxsize=8)
def _stack_config(project: str, stack: str, cli: str | None) -> str:
    """'pulumi config --json': {"<project>:<key>": {"value": ...}}; "{}" where it fails (the outputs' call said why)."""
    argv = [cli or "pulumi", "config", "--json", "--cwd", project] + (["--stack", stack] if stack else [])
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    except OSError:
        return "{}"
    text = proc.stdout.strip() if proc.returncode == 0 else ""
    return text if text.startswith("{") else "{}"


def selected_stack_cluster() -> str:
    """The clusterName of the stack selected in the project, or "" when there is no Pulumi CLI, no
    Pulumi.yaml, no selected stack or no cluster in it: the caller then falls back to 'local'."""
    project = Path(os.environ.get("XC_PULUMI_DIR") or PROJECT_DIR)
    if not shutil.which("pulumi") or not (project / "Pulumi.yaml").is_file():
        return ""
    try:
        return str(stack_outputs().get("clusterName") or "")
    except ClusterError:
        return ""


@functools.lru_cache(maxsize=8)
def _stack_outputs(project: str, stack: str, cli: str | None) -> str:
    argv = [cli or "pulumi", "stack", "output", "--json", "--cwd", project] + (["--stack", stack] if stack else [])
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ClusterError("--cluster pulumi needs the Pulumi CLI, which is not on PATH", fix="install it (docs/ops.md) "
                           "or use --cluster aws:NAME, which needs only AWS credentials") from None
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit status {proc.returncode}"
        if "no stack" in reason.lower():
            raise ClusterError(f"Pulumi stack {stack or '(none selected)'} not found in {project} ({reason})", fix=
                               "see 'pulumi stack ls' and use --cluster pulumi:STACK")
        raise ClusterError(f"'pulumi stack output' failed in {project}: {reason}")
    return proc.stdout or "{}"


def stack_outputs(stack: str = "") -> dict:
    """The stack's outputs (asked once per process: fab resolves a cluster more than once)."""
    project = str(Path(os.environ.get("XC_PULUMI_DIR") or PROJECT_DIR))
    text = _stack_outputs(project, stack, shutil.which("pulumi"))
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ClusterError(f"'pulumi stack output --json' printed no JSON in {project}", fix="run it by hand") from None
