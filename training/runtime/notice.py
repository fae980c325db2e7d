"""What a rank reports when a run stops for a notice: one line, written and read only here.

Rank 0 prints ``Notice.format()`` and every rank exits ``EXIT`` (75); fab reads it back with ``Notice.parse``.
A run is preempted when the line is there and the run did not end 0 (see launch.life.lifecycle for why not exactly 75).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from training.runtime import paths

TAG = "[preempted]"
EXIT = 75  # EX_TEMPFAIL: try again later

SPOT = "spot interruption"
GROUP = "group termination"
REBALANCE = "rebalance recommendation"  # saves and trains on: never ends a run
CAUSES = (SPOT, GROUP)


@dataclass(frozen=True)
class Notice:
    cause: str  # SPOT or GROUP
    rank: int  # the rank that saw the notice first
    step: int  # the optimizer step of the notice's checkpoint (-1: none was saved)
    checkpoint: str  # its folder name, checkpoint-<step>
    durable: bool  # confirmed in the cluster's store by every rank; False without a store or when the upload failed

    def format(self) -> str:
        return f"{TAG} {json.dumps(asdict(self), sort_keys=True)}"

    @staticmethod
    def parse(lines: Iterable[str]) -> Notice | None:
        """The first notice line among a run's output lines (mpirun may prefix them), or None."""
        for line in lines:
            at = line.find(TAG + " {")
            if at < 0:
                continue
            try:
                raw = json.loads(line[at + len(TAG) + 1:])
                return Notice(cause=str(raw["cause"]), rank=int(raw["rank"]), step=int(raw["step"]),
                              checkpoint=str(raw["checkpoint"]), durable=bool(raw["durable"]))
            except (ValueError, KeyError, TypeError):
                continue
        return None


def checkpoint_name(step: int) -> str:
    """One name for a checkpoint on the node, at home and in the store (the Trainer's own)."""
    return paths.checkpoint_name(step)
