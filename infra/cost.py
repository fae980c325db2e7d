"""What a cluster costs per hour: the live spot price when AWS answers, the catalog hint when not."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from core import catalog
from core.catalog import GP3_USD_PER_GIB_MONTH, HEAD_USD_H, HOURS_PER_MONTH, PUBLIC_IPV4_USD_H
from core.ec2 import ec2_client

log = logging.getLogger(__name__)

HEAD_ROOT_GIB = 40  # the head's encrypted gp3 root volume: the baked AMI's snapshot size (infra.settings.MIN_ROOT_GIB)


@dataclass(frozen=True)
class CostEstimate:
    instance_type: str
    node_count: int
    market: str  # "spot" or "on-demand"
    node_usd_h: float
    source: str  # where node_usd_h comes from
    extras_usd_h: float  # root volumes and public IPv4 addresses of all nodes
    head_instance_type: str = ""  # "" = no head in this estimate
    head_usd_h: float = 0.0  # the on-demand head with its volume and IPv4 address

    @property
    def total_usd_h(self) -> float:
        return round(self.node_count * self.node_usd_h + self.extras_usd_h + self.head_usd_h, 4)

    def summary(self) -> str:
        head = f" + head {self.head_instance_type} on-demand ${self.head_usd_h:.4f}/h" if self.head_instance_type else ""
        return (f"{self.node_count} x {self.instance_type} {self.market} at ${self.node_usd_h:.4f}/h ({self.source})"
                f" + volumes and IPv4 ${self.extras_usd_h:.4f}/h{head} = ${self.total_usd_h:.2f}/h")

    def to_dict(self) -> dict:
        return {**asdict(self), "total_usd_h": self.total_usd_h}


def spot_price(instance_type: str, availability_zone: str, region: str | None = None, client=None) -> float | None:
    """The current Linux spot price of one instance in one zone, or None when AWS lists none."""
    client = client or ec2_client(region)
    history = client.describe_spot_price_history(
        InstanceTypes=[instance_type], ProductDescriptions=["Linux/UNIX"], StartTime=datetime.now(timezone.utc),
        Filters=[{"Name": "availability-zone", "Values": [availability_zone]}],
    )["SpotPriceHistory"]
    if not history:
        return None
    return float(max(history, key=lambda h: h["Timestamp"])["SpotPrice"])


def estimate(instance_type: str, node_count: int, *, availability_zone: str, spot: bool = True,
             root_volume_gib: int = 100, max_spot_price: float | None = None, region: str | None = None,
             client=None, head_instance_type: str | None = None) -> CostEstimate:
    """Hourly cost of ``node_count`` nodes (and the head, when named); never fails: without AWS the catalog hint
    stands in."""
    from botocore.exceptions import BotoCoreError, ClientError

    hint = catalog.lookup(instance_type).on_demand_usd_h
    price, source = hint, "catalog on-demand hint, us-east-1"
    if spot:
        try:
            live = spot_price(instance_type, availability_zone, region, client)
        except (BotoCoreError, ClientError) as exc:
            log.warning("spot price of %s unavailable (%s); estimating with the on-demand price", instance_type, exc)
            live = None
        else:
            if live is None:
                log.warning("AWS lists no spot price for %s in %s", instance_type, availability_zone)
        if live is not None:
            price, source = live, f"spot price in {availability_zone}"
        else:
            source = "catalog on-demand hint: spot price unavailable"
        if max_spot_price is not None and max_spot_price < price:
            # A spot node never costs more than its max price (above it, AWS reclaims the node).
            price, source = max_spot_price, "maxSpotPrice cap"
    extras = node_count * (root_volume_gib * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH + PUBLIC_IPV4_USD_H)
    return CostEstimate(instance_type, node_count, "spot" if spot else "on-demand", price, source, round(extras, 4),
                        head_instance_type or "", round(head_usd_h(head_instance_type), 4) if head_instance_type else 0.0)


def head_usd_h(head_instance_type: str) -> float:
    """The head's hourly cost: its on-demand price, its root volume and its public IPv4 address."""
    return HEAD_USD_H[head_instance_type] + HEAD_ROOT_GIB * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH + PUBLIC_IPV4_USD_H
