"""The one table of instance types this project knows, with what the launcher and the cost
estimate need. Figures are AWS's published specs (DescribeInstanceTypes); prices are Linux
on-demand in us-east-1, a hint only: the cost estimate prefers the live spot price.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import ClusterError


@dataclass(frozen=True)
class InstanceType:
    name: str
    cpu: str
    vcpus: int
    cores: int  # physical cores in the instance
    sockets: int  # as the guest sees them (lscpu); one NUMA node per socket
    memory_gib: int
    network_gbit: float  # sustained; "up to" figures are marked by burst_network
    amx: bool  # Advanced Matrix Extensions (bf16 matmul in hardware): Sapphire Rapids and later
    efa: bool  # Elastic Fabric Adapter available
    on_demand_usd_h: float
    burst_network: bool = False
    metal: bool = False

    @property
    def cores_per_socket(self) -> int:
        return self.cores // self.sockets

    @property
    def threads_per_core(self) -> int:
        return self.vcpus // self.cores


_ICX = "Xeon Platinum 8375C (Ice Lake)"
_SPR_Z = "Xeon Gold 6455B (Sapphire Rapids)"
_SPR_C = "Xeon Platinum 8488C (Sapphire Rapids)"

CATALOG: dict[str, InstanceType] = {t.name: t for t in (
    #            name               cpu     vcpu cores sock  GiB  Gbit   AMX    EFA    $/h
    InstanceType("c6i.2xlarge",     _ICX,      8,   4,   1,   16, 12.5, False, False, 0.34, burst_network=True),
    InstanceType("m6i.4xlarge",     _ICX,     16,   8,   1,   64, 12.5, False, False, 0.768, burst_network=True),
    InstanceType("c6i.8xlarge",     _ICX,     32,  16,   1,   64, 12.5, False, False, 1.36),
    InstanceType("c6i.16xlarge",    _ICX,     64,  32,   1,  128, 25.0, False, False, 2.72),
    InstanceType("c6i.32xlarge",    _ICX,    128,  64,   2,  256, 50.0, False, True,  5.44),
    InstanceType("c7i.16xlarge",    _SPR_C,   64,  32,   1,  128, 25.0, True,  False, 2.856),
    InstanceType("c7i.48xlarge",    _SPR_C,  192,  96,   2,  384, 50.0, True,  True,  8.568),
    InstanceType("r7iz.8xlarge",    _SPR_Z,   32,  16,   1,  256, 12.5, True,  False, 2.976),
    InstanceType("r7iz.16xlarge",   _SPR_Z,   64,  32,   1,  512, 25.0, True,  False, 5.952),
    InstanceType("r7iz.32xlarge",   _SPR_Z,  128,  64,   2, 1024, 50.0, True,  True,  11.904),
    InstanceType("r7iz.metal-16xl", _SPR_Z,   64,  32,   1,  512, 25.0, True,  False, 5.952, metal=True),
    InstanceType("r7iz.metal-32xl", _SPR_Z,  128,  64,   2, 1024, 50.0, True,  True,  11.904, metal=True),
)}


# us-east-1 list prices of what else a cluster leaves billed; a month bills as 730 hours.
HOURS_PER_MONTH = 730
EBS_USD_PER_GIB_MONTH = {"gp3": 0.08, "gp2": 0.10}
GP3_USD_PER_GIB_MONTH = EBS_USD_PER_GIB_MONTH["gp3"]
SNAPSHOT_USD_PER_GIB_MONTH = 0.05  # standard tier, full size: an upper bound, snapshots are incremental
PUBLIC_IPV4_USD_H = 0.005  # every public IPv4 address, charged since 2024
S3_USD_PER_GIB_MONTH = 0.023  # S3 Standard, first 50 TB (us-east-1)
LOG_USD_PER_GIB_MONTH = 0.03  # CloudWatch Logs storage


def lookup(name: str) -> InstanceType:
    try:
        return CATALOG[name]
    except KeyError:
        raise ClusterError(
            f"instanceType {name!r} is not in the catalog", fix=f"use one of {', '.join(CATALOG)} "
            "or add a row to core/catalog.py") from None


# The head's types (small Intel on-demand instances) and their Linux on-demand price in us-east-1, a hint as the
# nodes' rows are; 'fab status' and 'fab sweep' price a running head from it (the nodes' rows refuse its type).
# The head is never spot: it must outlive the nodes' reclaims to recover them.
HEAD_USD_H = {"t3.small": 0.0208, "t3.medium": 0.0416, "t3.large": 0.0832, "t3.xlarge": 0.1664,
              "c6i.large": 0.085, "m6i.large": 0.096, "m7i.large": 0.1008, "r6i.xlarge": 0.252}
# Their vCPUs, which count against the account's on-demand Standard quota (T, C, M and R alike).
HEAD_VCPUS = {"t3.small": 2, "t3.medium": 2, "t3.large": 2, "t3.xlarge": 4,
              "c6i.large": 2, "m6i.large": 2, "m7i.large": 2, "r6i.xlarge": 4}
