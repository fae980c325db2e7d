"""ClusterSettings: every knob of the Pulumi program, validated before any resource exists.

Config keys (camelCase, as in Pulumi.yaml) map one-to-one onto fields; ``from_config`` parses the
strings Pulumi hands over and every rule fails with one line naming the key, the rule and the fix.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from core import catalog
from core.constants import MAX_NODES, TAG_CLUSTER, TAG_STACK
from core.errors import ClusterError
from infra.cost import HEAD_USD_H
from node_setup import profiles

IMAGE_MODES = ("bake", "base")
UBUNTU_PYTHON = {"22.04": (3, 10), "24.04": (3, 12)}  # the release's python3
UBUNTU_VERSIONS = tuple(UBUNTU_PYTHON)
MIN_ROOT_GIB = 40  # the software stack needs ~20 GiB; the baked AMI's snapshot has this size
ZONE_SLICE_BITS = 3  # the VPC is cut into 8 slices, one per zone letter a..h (infra/network.py subnet_cidr)
AWS_RESERVED_ADDRESSES = 5  # AWS keeps the first four and the last address of every subnet
_PUBKEY_EXAMPLE = '"$(cat ~/.ssh/id_ed25519.pub)"'


def _fix(key: str, example: str) -> str:
    return f"run 'pulumi config set {key} {example}'"


@dataclass(frozen=True)
class ClusterSettings:
    admin_cidr: str = ""
    ssh_public_key: str = ""
    cluster_name: str = ""  # "" = the stack name
    stack: str = "dev"
    region: str = "us-east-1"
    availability_zone: str = ""  # "" = <region>a
    instance_type: str = "r7iz.16xlarge"
    fallback_instance_types: str = ""  # comma-separated, same vCPUs/cores/memory as instance_type
    node_count: int = 4
    spot: bool = True
    max_spot_price: str = ""  # USD per hour per node; "" = pay up to the on-demand price
    # The group replaces a node on a rebalance recommendation and terminates it, ending the run, even when no
    # interruption would have come; off, the ranks only checkpoint then and a real reclaim still gives 2 minutes.
    capacity_rebalance: bool = False
    allow_world_ssh: bool = False
    ssh_user: str = "ubuntu"
    root_volume_gib: int = 100
    checkpoint_retention_days: int = 14  # the store's checkpoints/ expire after this many days
    profile: str = "upstream"  # what make test runs; oneccl is the seeds' end-of-life stack
    image: str = "bake"  # bake | base | ami-...
    ubuntu_version: str = "24.04"
    build_instance_type: str = "c6i.2xlarge"
    vpc_cidr: str = "10.42.0.0/16"
    head_instance_type: str = "t3.medium"  # the small on-demand head that runs detached runs' supervisors
    store_bucket: str = ""  # a kept store bucket (xc-...) to adopt (import) instead of making a new one

    def __post_init__(self):
        # Fill the derived defaults, then check every rule in the order a user would fix them.
        if not self.cluster_name:
            object.__setattr__(self, "cluster_name", self.stack.lower())
        if not self.availability_zone:
            object.__setattr__(self, "availability_zone", f"{self.region}a")
        for check in (self._check_network, self._check_ssh, self._check_nodes, self._check_zone_slice,
                      self._check_image, self._check_head):
            check()

    # -- rules --------------------------------------------------------------------------------
    def _check_network(self):
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,27}[a-z0-9]", self.cluster_name):
            raise ClusterError(f"clusterName {self.cluster_name!r} must be 2-29 lowercase letters, digits or '-' "
                               f"(it names AWS resources)", fix=f"{_fix('clusterName', 'bert-4')}")
        if not re.fullmatch(r"[a-z]{2}(-gov)?-[a-z]+-\d", self.region):
            raise ClusterError(f"region {self.region!r} is not an AWS region name", fix=f"{_fix('region', 'us-east-1')}")
        if not re.fullmatch(re.escape(self.region) + r"[a-z]", self.availability_zone):
            raise ClusterError(f"availabilityZone {self.availability_zone!r} is not a zone of region {self.region}", fix=
                               f"{_fix('availabilityZone', self.region + 'b')}")
        try:
            vpc = ipaddress.IPv4Network(self.vpc_cidr)
        except ValueError:
            vpc = None
        if vpc is None or not vpc.is_private or not 16 <= vpc.prefixlen <= 24:
            raise ClusterError(f"vpcCidr {self.vpc_cidr!r} must be a private IPv4 network from /16 to /24", fix=
                               f"{_fix('vpcCidr', '10.42.0.0/16')}")

    def _check_zone_slice(self):
        # Each zone letter has its own slice of the VPC (infra/network.py), so a zone move never overlaps
        # the old subnet; the slice must hold the nodes, as many replacements launched while leaving nodes
        # are still held by the termination hook, the head and Image Builder's build instance.
        prefix = ipaddress.IPv4Network(self.vpc_cidr).prefixlen + ZONE_SLICE_BITS
        usable = 2 ** (32 - prefix) - AWS_RESERVED_ADDRESSES
        need = 2 * self.node_count + 2
        if usable < need:
            raise ClusterError(f"vpcCidr {self.vpc_cidr} gives each zone a /{prefix} subnet ({usable} usable "
                               f"addresses) but nodeCount {self.node_count} needs up to {need} (nodes, their "
                               f"replacements, the head, the image build)", fix=f"{_fix('vpcCidr', '10.42.0.0/16')}")

    def _check_ssh(self):
        if not self.admin_cidr:
            raise ClusterError("adminCidr is required (SSH is allowed only from it)", fix=
                               f"{_fix('adminCidr', '$(curl -s https://checkip.amazonaws.com)/32')}")
        try:
            net = ipaddress.IPv4Network(self.admin_cidr)
        except ValueError:
            raise ClusterError(f"adminCidr {self.admin_cidr!r} is not an IPv4 network with no host bits set", fix=
                               f"{_fix('adminCidr', '203.0.113.7/32')}") from None
        if net.prefixlen == 0 and not self.allow_world_ssh:
            raise ClusterError(f"adminCidr {self.admin_cidr} opens SSH to the whole internet", fix=f"use your own address "
                               f"({_fix('adminCidr', '203.0.113.7/32')}) or confirm with "
                               "'pulumi config set allowWorldSsh true'")
        key = self.ssh_public_key.strip()
        if not key:
            raise ClusterError("sshPublicKey is required (it is authorized for the ssh user on every node)",
                               fix=_fix('sshPublicKey', _PUBKEY_EXAMPLE))
        if "PRIVATE KEY" in key:
            raise ClusterError("sshPublicKey holds a PRIVATE key", fix="remove it from the stack config now and set "
                               "the .pub file instead: " + _fix('sshPublicKey', _PUBKEY_EXAMPLE))
        if not re.fullmatch(r"(ssh-ed25519|ssh-rsa) [A-Za-z0-9+/]+=*( .*)?", key):
            raise ClusterError("sshPublicKey must be one 'ssh-ed25519 AAAA...' or 'ssh-rsa AAAA...' line (EC2 imports "
                               "only these)", fix=_fix('sshPublicKey', _PUBKEY_EXAMPLE))
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", self.ssh_user):
            raise ClusterError(f"sshUser {self.ssh_user!r} is not a Linux user name", fix=f"{_fix('sshUser', 'ubuntu')}")

    def _check_nodes(self):
        main = catalog.lookup(self.instance_type)
        for name in self.instance_types[1:]:
            other = catalog.lookup(name)
            if (other.vcpus, other.cores, other.memory_gib) != (main.vcpus, main.cores, main.memory_gib):
                raise ClusterError(
                    f"fallbackInstanceTypes: {name} ({other.vcpus} vCPUs, {other.memory_gib} GiB) is not the shape of "
                    f"{self.instance_type} ({main.vcpus} vCPUs, {main.memory_gib} GiB), so ranks and threads would "
                    f"not fit every node", fix="list only types of the same shape or run "
                    "'pulumi config rm fallbackInstanceTypes'")
        if len(set(self.instance_types)) != len(self.instance_types):
            raise ClusterError(f"fallbackInstanceTypes {self.fallback_instance_types!r} repeats a type or instanceType", fix=
                               "list each other type once")
        if not 1 <= self.node_count <= MAX_NODES:
            raise ClusterError(f"nodeCount {self.node_count} must be between 1 and {MAX_NODES}", fix=
                               f"{_fix('nodeCount', '4')}")
        if self.max_spot_price:
            if not self.spot:
                raise ClusterError("maxSpotPrice is set but spot is false", fix="run 'pulumi config rm maxSpotPrice' "
                                   "or 'pulumi config set spot true'")
            if self.max_spot_price_usd is None or self.max_spot_price_usd <= 0:
                raise ClusterError(f"maxSpotPrice {self.max_spot_price!r} must be a positive USD amount per node-hour", fix=
                                   f"{_fix('maxSpotPrice', '2.50')} or remove it")
        if self.capacity_rebalance and not self.spot:
            raise ClusterError("capacityRebalance is true but spot is false (it rebalances spot nodes only)", fix=
                               "run 'pulumi config rm capacityRebalance' or 'pulumi config set spot true'")
        if not MIN_ROOT_GIB <= self.root_volume_gib <= 16384:
            raise ClusterError(f"rootVolumeGib {self.root_volume_gib} must be between {MIN_ROOT_GIB} and 16384", fix=
                               f"{_fix('rootVolumeGib', '100')}")
        if not 1 <= self.checkpoint_retention_days <= 3650:
            raise ClusterError(f"checkpointRetentionDays {self.checkpoint_retention_days} must be between 1 and 3650", fix=
                               f"{_fix('checkpointRetentionDays', '14')}")
        # the store's name: fab's and the nodes' policies reach xc-* buckets only (docs/iam-policy.json)
        if self.store_bucket and not re.fullmatch(r"xc-[a-z0-9][a-z0-9-]{0,58}[a-z0-9]", self.store_bucket):
            raise ClusterError(f"storeBucket {self.store_bucket!r} is not a store bucket's name (xc-<cluster>-..., as "
                               "'fab sweep' lists a kept one)", fix=f"{_fix('storeBucket', 'xc-' + self.cluster_name + '-...')} "
                               "with the kept bucket's name, or 'pulumi config rm storeBucket' for a new one")

    def _check_image(self):
        if self.image not in IMAGE_MODES and not re.fullmatch(r"ami-[0-9a-f]{8}([0-9a-f]{9})?", self.image):
            raise ClusterError(f"image {self.image!r} must be 'bake', 'base' or an AMI id like ami-0123456789abcdef0", fix=
                               f"{_fix('image', 'bake')}")
        if self.ubuntu_version not in UBUNTU_VERSIONS:
            raise ClusterError(f"ubuntuVersion {self.ubuntu_version!r} must be one of {', '.join(UBUNTU_VERSIONS)}", fix=
                               f"{_fix('ubuntuVersion', UBUNTU_VERSIONS[0])}")
        if not re.fullmatch(r"[a-z][a-z0-9-]*\.[a-z0-9-]+", self.build_instance_type):
            raise ClusterError(f"buildInstanceType {self.build_instance_type!r} is not an EC2 instance type", fix=
                               f"{_fix('buildInstanceType', 'c6i.2xlarge')}")
        known = profiles.load_profiles()
        if self.profile not in known:
            raise ClusterError(f"profile {self.profile!r} is not a software profile", fix=f"use one of {', '.join(known)} "
                               f"({_fix('profile', next(iter(known)))})")
        need = tuple(int(x) for x in known[self.profile].python_min.split("."))
        have = UBUNTU_PYTHON[self.ubuntu_version]
        if self.image in IMAGE_MODES and have < need:
            raise ClusterError(f"ubuntuVersion {self.ubuntu_version} has Python {'.'.join(map(str, have))} but "
                               f"profile {self.profile} needs {known[self.profile].python_min}", fix=
                               f"{_fix('ubuntuVersion', '24.04')}")

    def _check_head(self):
        if self.head_instance_type not in HEAD_USD_H:
            known = ", ".join(HEAD_USD_H)
            raise ClusterError(f"headInstanceType {self.head_instance_type!r} is not a head type this project knows "
                               f"the price of ({known})", fix=f"{_fix('headInstanceType', 't3.medium')}")

    # -- derived values -----------------------------------------------------------------------
    @property
    def max_spot_price_usd(self) -> float | None:
        try:
            return float(self.max_spot_price) if self.max_spot_price else None
        except ValueError:
            return None

    @property
    def tags(self) -> dict[str, str]:
        """Tags on every resource: how discovery, cost reports and cleanup find the cluster."""
        return {TAG_CLUSTER: self.cluster_name, TAG_STACK: self.stack}

    @property
    def instance_types(self) -> tuple[str, ...]:
        """instanceType first, then the fallbacks the spot allocation may take when it is scarce."""
        extra = [t.strip() for t in self.fallback_instance_types.split(",") if t.strip()]
        return (self.instance_type, *extra)

    @property
    def instance(self) -> catalog.InstanceType:
        return catalog.lookup(self.instance_type)

    @property
    def ubuntu_ami_parameter(self) -> str:
        """Canonical's public SSM parameter holding the current Ubuntu server AMI of this region."""
        volume = "ebs-gp3" if self.ubuntu_version >= "24.04" else "ebs-gp2"
        return f"/aws/service/canonical/ubuntu/server/{self.ubuntu_version}/stable/current/amd64/hvm/{volume}/ami-id"

    # -- Pulumi config ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, values: Mapping[str, str | None], stack: str) -> ClusterSettings:
        """Build from Pulumi config strings (``{'nodeCount': '4', ...}``); missing keys take the defaults."""
        kwargs: dict = {"stack": stack}
        for key, field in CONFIG_KEYS.items():
            raw = values.get(key)
            if raw is None:
                continue
            kwargs[field.name] = _parse(key, field.type, raw)
        return cls(**kwargs)


def _parse(key: str, kind: str, raw):
    text = str(raw).strip()
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ClusterError(f"{key} {text!r} is not a whole number", fix=f"{_fix(key, '<number>')}") from None
    if kind == "bool":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ClusterError(f"{key} {text!r} must be true or false", fix=f"{_fix(key, 'true')}")
    return text


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


# Config key -> dataclass field; 'stack' comes from Pulumi itself, not from config.
CONFIG_KEYS = {_camel(f.name): f for f in dataclasses.fields(ClusterSettings) if f.name != "stack"}
