"""A machine of the cluster, as every package sees it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from core.constants import REMOTE_HOME, REMOTE_PYTHON


@dataclass(frozen=True)
class Node:
    """A machine of the cluster as the operator and the other nodes see it."""

    name: str
    host: str  # address the operator connects to
    private_host: str  # address the other nodes use
    user: str
    port: int = 22
    index: int = 0
    # Per-node work root; None means ~/.xeon-cluster on the node itself.
    home: str | None = None
    python: str = REMOTE_PYTHON
    labels: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def workdir(self) -> str:
        return self.home or f"$HOME/{REMOTE_HOME}"

    def to_dict(self) -> dict:
        return asdict(self)
