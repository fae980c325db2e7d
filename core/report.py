"""A table of checks: one row per node and check, a verdict, and the fix of every red row (fab doctor, the preflight of fab train)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from core.errors import NodeFailure

log = logging.getLogger(__name__)


CLUSTER = "cluster"  # the "node" of rows about the nodes together


@dataclass(frozen=True)
class Row:
    node: str  # a node's name, or CLUSTER
    check: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("ok" if self.ok else "FAIL")


@dataclass
class Report:
    nodes: list[str]
    rows: list[Row] = field(default_factory=list)

    @property
    def failures(self) -> list[Row]:
        """Failed checks; a skipped row (not checkable because of another failure) is not one more problem."""
        return [r for r in self.rows if not r.ok and not r.skipped]

    @property
    def ok(self) -> bool:
        return not self.failures

    def row(self, node: str, check: str) -> Row | None:
        return next((r for r in self.rows if r.node == node and r.check == check), None)

    def verdict(self) -> str:
        skipped = sum(r.skipped for r in self.rows)
        extra = f" ({skipped} skipped)" if skipped else ""
        if self.ok:
            return f"verdict: healthy: {len(self.rows) - skipped} checks passed on {len(self.nodes)} node(s){extra}"
        names = ", ".join(f"{r.node} {r.check}" for r in self.failures)
        return f"verdict: {len(self.failures)} problem(s): {names}; fix the FAIL rows above{extra}"

    def render(self) -> str:
        check_w = max([5] + [len(r.check) for r in self.rows])
        out = []
        for group in [*self.nodes, CLUSTER]:
            rows = [r for r in self.rows if r.node == group]
            if not rows:
                continue
            out.append(f"{group}:" if group != CLUSTER else "across the nodes:")
            for r in rows:
                out.append(f"  {r.check:<{check_w}}  {r.status:<4}  {r.detail}")
                if r.fix and not r.ok and not r.skipped:
                    out.append(f"  {'':<{check_w}}        fix: {r.fix}")
        out.append(self.verdict())
        return "\n".join(out)

    def raise_if_failed(self, what: str = "doctor") -> None:
        if self.ok:
            return
        bad = self.failures
        nodes = sorted({r.node for r in bad if r.node != CLUSTER}, key=self._order)
        parts = [f"{r.node} {r.check}: {r.detail}" + (f" (fix: {r.fix})" if r.fix else "") for r in bad]
        raise NodeFailure(f"{what} found {len(bad)} problem(s): " + "; ".join(parts), nodes)

    def _order(self, name: str) -> int:
        return self.nodes.index(name) if name in self.nodes else len(self.nodes)
