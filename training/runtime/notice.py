"""What a rank reports when a run stops for a notice, as a RunEvent (training.runtime.events writes and reads it).

Rank 0 emits ``Notice.event()`` and every rank exits ``EXIT`` (75); fab reads it back with ``Notice.parse``.
A run is preempted when the line is there and the run did not end 0 (see launch.life.lifecycle for why not exactly 75).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from training.runtime import events

EXIT = 75  # EX_TEMPFAIL: try again later

SPOT = "spot interruption"
GROUP = "group termination"
REBALANCE = "rebalance recommendation"  # saves and trains on: never ends a run
CAUSES = (SPOT, GROUP)


@dataclass(frozen=True)
class Notice:
    EXIT: ClassVar[int] = EXIT  # what every rank exits with after the notice
    SPOT: ClassVar[str] = SPOT
    GROUP: ClassVar[str] = GROUP

    cause: str  # SPOT or GROUP
    rank: int  # the rank that saw the notice first
    step: int  # the optimizer step of the notice's checkpoint (-1: none was saved)
    checkpoint: str  # its folder name, checkpoint-<step>
    durable: bool  # confirmed in the cluster's store by every rank; False without a store or when the upload failed

    def event(self) -> events.RunEvent:
        return events.RunEvent(events.NOTICE, self.rank, self.step, payload={
            "cause": self.cause, "checkpoint": self.checkpoint, "durable": self.durable})

    @staticmethod
    def parse(lines: Iterable[str]) -> Notice | None:
        """The first notice among a run's output lines (mpirun may prefix them), or None."""
        return Notice.first(events.of_lines(lines))

    @staticmethod
    def first(ran: Iterable[events.RunEvent]) -> Notice | None:
        """The first notice among a run's events, or None."""
        e = next((e for e in ran if e.kind == events.NOTICE), None)
        if e is None:
            return None
        return Notice(cause=e.payload["cause"], rank=e.rank, step=e.step, checkpoint=e.payload["checkpoint"],
                      durable=e.payload["durable"])
