"""What a rank tells launch, as data: one RunEvent schema and its one codec.

A rank emits an event; the codec writes it twice: as the readable line people see in the run's output and log.txt
(``[progress] step 5/40 (12%) loss 0.6931 ...``), which ``parse`` reads back into the same event while the run goes
on, and as one JSON line in the rank's own events file (``XC_EVENTS``: the node's runs/<id>/events/<rank>.jsonl),
which comes home and to the store as the run's events.jsonl (every rank's, in time order). Nothing else in the
project writes or parses these lines or files (tests/project/test_layout.py checks it).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time as _time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

PROGRESS = "progress"  # rank 0: an optimizer step done; payload: total, loss, epoch, elapsed, eta
EVAL = "eval"  # rank 0: an evaluation's loss; payload: loss, perplexity
FINISHED = "finished"  # every rank, as its last act: a crash after it (oneCCL's teardown at exit) loses nothing
NOTICE = "preempted"  # rank 0: the run stops for a notice; payload: the Notice's fields (training.runtime.notice)
REBALANCE = "rebalance"  # rank 0: a rebalance recommendation; it saved a checkpoint and trains on
DURABLE = "store"  # rank 0: a checkpoint reached the store (payload ok=True) or did not (ok=False, error)
MARK = "timeline"  # rank 0 with XC_TIMELINE=1: a start-up milestone; payload: name; time: when

FILE_ENV = "XC_EVENTS"  # a rank's events file; "{rank}" in it becomes the rank (RANK)
RUN_FILE = "events.jsonl"  # a run's events, every rank's, at home and in the store


@dataclass(frozen=True)
class RunEvent:
    kind: str
    rank: int = 0  # the rank that emits it; a notice's: the rank that saw the notice first
    step: int | None = None
    time: float = field(default_factory=_time.time)
    payload: dict = field(default_factory=dict)

    def line(self) -> str:
        """The readable line this event is written as."""
        return _WRITE[self.kind](self)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunEvent:
        raw = json.loads(text)
        step = raw.get("step")
        return cls(str(raw["kind"]), int(raw.get("rank", 0)), None if step is None else int(step),
                   float(raw.get("time", 0.0)), dict(raw.get("payload") or {}))


def emit(event: RunEvent, after_bar: bool = False) -> None:
    """The readable line on stdout, and the event in this rank's events file where XC_EVENTS names one. after_bar:
    on stderr after a newline instead, where a progress bar holds stderr's unfinished line (the two streams reach
    the log through separate pipes, so a line on stdout could land at the end of the bar's)."""
    if after_bar:
        print("\n" + event.line(), file=sys.stderr, flush=True)
    else:
        print(event.line(), flush=True)
    target = os.environ.get(FILE_ENV)
    if not target:
        return
    path = target.replace("{rank}", os.environ.get("RANK", "0"))
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(event.to_json() + "\n")
    except OSError as exc:  # the line went out: launch still sees the event; only the file misses it
        print(f"warning: the event was not written to {path}: {exc}", flush=True)


def read_jsonl(text: str) -> list[RunEvent]:
    """The events of events files' text (one or several concatenated), in time order; a torn last line is skipped."""
    found = []
    for line in text.splitlines():
        try:
            found.append(RunEvent.from_json(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return sorted(found, key=lambda e: (e.time, e.rank))


def parse(text: str, rank: int = 0) -> RunEvent | None:
    """The event a line of a rank's output says (its mpirun '[rank] ' prefix already taken off), or None."""
    if not text.startswith("["):
        return None
    tag, _, rest = text.partition("] ")
    reader = _READ.get(tag[1:])
    if reader is None:
        return None
    try:
        return reader(rest, rank)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def of_lines(lines: Iterable[str]) -> Iterator[RunEvent]:
    """The events among output lines that may carry mpirun's '[rank] ' or fab's '[rank host] ' prefix, in order."""
    for line in lines:
        m = _RANKED.match(line)
        event = parse(m.group(2), int(m.group(1))) if m else parse(line)
        if event is not None:
            yield event


def first(lines: Iterable[str], kind: str) -> RunEvent | None:
    return next((e for e in of_lines(lines) if e.kind == kind), None)


def steps(text: str) -> list[int]:
    """The optimizer steps a run's log says were done (its progress events), in order."""
    return [e.step for e in of_lines(text.splitlines()) if e.kind == PROGRESS]


def progress(step: int, total: int, elapsed: float, loss: float | None = None, epoch: float | None = None) -> RunEvent:
    eta = elapsed / step * (total - step) if step else 0.0
    payload = {"total": total, "elapsed": elapsed, "eta": eta}
    if loss is not None and math.isfinite(loss):
        payload["loss"] = loss
    if epoch is not None:
        payload["epoch"] = epoch
    return RunEvent(PROGRESS, 0, step, payload=payload)


_RANKED = re.compile(r"^\[(\d+)(?: [^\]]*)?\] ?(.*)$")  # mpirun's "[0] ", fab's "[0 node0] "
_PROGRESS = re.compile(r"step (\d+)/(\d+) \(\d+%\)(?: loss (\S+))?(?: epoch (\S+))? elapsed (\S+)s eta (\S+)s")
_EVAL = re.compile(r"eval step (\d+) loss (\S+) perplexity (\S+)")
_DURABLE = re.compile(r"(error: )?checkpoint step (\d+) ")


def _write_progress(e: RunEvent) -> str:
    if e.kind == EVAL:
        return f"[progress] eval step {e.step} loss {e.payload['loss']:.4f} perplexity {e.payload['perplexity']:.2f}"
    p = e.payload
    parts = [f"[progress] step {e.step}/{p['total']} ({100 * e.step / max(p['total'], 1):.0f}%)"]
    if "loss" in p:
        parts.append(f"loss {p['loss']:.4f}")
    if "epoch" in p:
        parts.append(f"epoch {p['epoch']:.2f}")
    parts.append(f"elapsed {p['elapsed']:.0f}s eta {p['eta']:.0f}s")
    return " ".join(parts)


def _read_progress(rest: str, rank: int) -> RunEvent | None:
    m = _EVAL.fullmatch(rest)
    if m:
        return RunEvent(EVAL, rank, int(m.group(1)), payload={"loss": float(m.group(2)),
                                                               "perplexity": float(m.group(3))})
    m = _PROGRESS.fullmatch(rest)
    if not m:
        return None
    payload = {"total": int(m.group(2)), "elapsed": float(m.group(5)), "eta": float(m.group(6))}
    if m.group(3):
        payload["loss"] = float(m.group(3))
    if m.group(4):
        payload["epoch"] = float(m.group(4))
    return RunEvent(PROGRESS, rank, int(m.group(1)), payload=payload)


def _write_notice(e: RunEvent) -> str:
    return f"[preempted] {json.dumps({**e.payload, 'rank': e.rank, 'step': e.step}, sort_keys=True)}"


def _read_notice(rest: str, rank: int) -> RunEvent:
    raw = json.loads(rest)
    payload = {"cause": str(raw["cause"]), "checkpoint": str(raw["checkpoint"]), "durable": bool(raw["durable"])}
    return RunEvent(NOTICE, int(raw["rank"]), int(raw["step"]), payload=payload)


def _write_durable(e: RunEvent) -> str:
    p = e.payload
    if p.get("ok"):
        return (f"[store] checkpoint step {e.step} durable in {p['where']}: {p['bytes'] / 1e6:.0f} MB uploaded in "
                f"{p['seconds']:.1f}s ({p['after']:.1f}s after its save)")
    return f"[store] error: checkpoint step {e.step} did not reach the store: {p['error']}"


def _read_durable(rest: str, rank: int) -> RunEvent | None:
    m = _DURABLE.match(rest)
    return RunEvent(DURABLE, rank, int(m.group(2)), payload={"ok": not m.group(1), "text": rest}) if m else None


def _write_mark(e: RunEvent) -> str:
    return f"[timeline] {e.payload['name']} {e.time:.3f}"


def _read_mark(rest: str, rank: int) -> RunEvent:
    name, at = rest.split()[:2]
    return RunEvent(MARK, rank, None, float(at), {"name": name})


def _read_rebalance(rest: str, rank: int) -> RunEvent | None:
    m = re.match(r"step=(\d+):", rest)
    return RunEvent(REBALANCE, rank, int(m.group(1))) if m else None


def _read_finished(rest: str, rank: int) -> RunEvent:
    return RunEvent(FINISHED, int(rest.split()[1]) if rest.startswith("rank ") else rank)


_WRITE = {
    PROGRESS: _write_progress,
    EVAL: _write_progress,
    FINISHED: lambda e: f"[finished] rank {e.rank}",
    NOTICE: _write_notice,
    REBALANCE: lambda e: f"[rebalance] step={e.step}: checkpoint now, training goes on",
    DURABLE: _write_durable,
    MARK: _write_mark,
}
_READ = {"progress": _read_progress, "finished": _read_finished, "preempted": _read_notice,
         "rebalance": _read_rebalance, "store": _read_durable, "timeline": _read_mark}
