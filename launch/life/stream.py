"""The ranks' output as the operator sees it: [rank host] prefixes, a progress line, the log file; and which rank failed first."""
from __future__ import annotations

import io
import logging
import re
import threading
import time
from typing import TextIO

from launch.plan import launcher
from launch.staging import secrets
from training.runtime import events

log = logging.getLogger(__name__)


class OutputRouter(io.TextIOBase):
    """Turns mpirun's '[rank] line' output into '[rank host] line', logs everything, draws progress."""

    RANK_LINE = re.compile(r"^\[(\d+)\] ?(.*)$")
    CHUNK_TAG = re.compile(r"\[(\d+)\] ?")

    def __init__(self, plan: launcher.LaunchPlan, out: TextIO, log_file: TextIO, on_event=None):
        self.plan, self.out, self.log_file = plan, out, log_file
        self.on_event = on_event  # called with each of rank 0's events (a resumed run's recovery figures)
        self.noticed_at: float | None = None  # when rank 0's typed notice line came by (Unix seconds)
        self.buffer = ""
        self.partial: dict[int, str] = {}  # a rank's text written without its newline yet
        self.lock = threading.Lock()
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.progress_shown = False
        self.lines: list[str] = []
        self.finished: set[int] = set()  # ranks whose finished event came by: their work is done

    def write(self, text: str) -> int:
        with self.lock:
            self.buffer += text
            *lines, self.buffer = self.buffer.split("\n")
            for line in lines:
                self._split(line.rstrip("\r"))
        return len(text)

    def _split(self, line: str) -> None:
        """mpirun -l tags every chunk a rank writes, also one without a newline: '[0] abc[1] xyz' then '[0] def'.
        Each rank's pieces are joined into its own line, so its tag leads the line it belongs to."""
        tags = [m for m in self.CHUNK_TAG.finditer(line) if int(m.group(1)) < self.plan.world_size]
        if not tags or tags[0].start() != 0:
            self._line(line)
            return
        for m, nxt in zip(tags, [*tags[1:], None]):
            rank, piece = int(m.group(1)), line[m.end():nxt.start() if nxt else len(line)]
            if nxt is None:  # the newline closes this rank's line
                self._line(f"[{rank}] {self.partial.pop(rank, '')}{piece}")
            else:
                self.partial[rank] = self.partial.get(rank, "") + piece

    def flush_rest(self) -> None:
        if self.buffer:
            self._split(self.buffer)
            self.buffer = ""
        for rank in sorted(self.partial):
            self._line(f"[{rank}] {self.partial[rank]}")
        self.partial.clear()
        if self.progress_shown:
            self.out.write("\n")
            self.progress_shown = False
        self.out.flush()

    def _line(self, line: str) -> None:
        if self.plan.secret_env:  # a job that prints its token shows ***, here and in log.txt
            line = secrets.redact(line, self.plan.secret_env.values())
        self.log_file.write(line + "\n")
        self.log_file.flush()
        self.lines.append(line)
        m = self.RANK_LINE.match(line)
        if m:
            rank = int(m.group(1))
            host = self.plan.rank_host(rank) if rank < self.plan.world_size else "?"
            text = m.group(2)
            event = events.parse(text, rank)
            kind = event.kind if event is not None else None
            if kind == events.FINISHED:
                self.finished.add(rank)
            if rank == 0:
                if self.noticed_at is None and kind == events.NOTICE:
                    self.noticed_at = time.time()
                if self.on_event is not None and event is not None:
                    self.on_event(event)
            shown = f"[{rank} {host}] {text}"
            if self.tty and kind == events.PROGRESS:
                self.out.write("\r\x1b[K" + shown)
                self.out.flush()
                self.progress_shown = True
                return
        else:
            shown = line
        if self.progress_shown:
            self.out.write("\n")
            self.progress_shown = False
        self.out.write(shown + "\n")
        self.out.flush()


_BAD_RANK = re.compile(r"RANK (\d+) PID (\d+) RUNNING AT (\S+)")


_EXIT = re.compile(r"(KILLED BY SIGNAL: \d+ \(\w+\)|EXIT CODE: \d+)")


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .*)?$")
_TORCH_RANK = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes a rank's traceback lines once its process group is up


def raised(lines: list[str], plan: launcher.LaunchPlan) -> tuple[int, str] | None:
    """(rank, 'ValueError: ...') of the first rank that printed a traceback: its exception's own line."""
    first: int | None = None
    found: str | None = None
    for line in lines:
        r = OutputRouter.RANK_LINE.match(line)
        if not r or int(r.group(1)) >= plan.world_size:
            continue
        rank, text = int(r.group(1)), _TORCH_RANK.sub("", r.group(2))
        if first is None and text.startswith("Traceback (most recent call last)"):
            first = rank
        elif rank == first and _EXCEPTION.match(text):
            found = text  # the last one wins: chained exceptions end with the one that escaped
    return (first, found[:300]) if first is not None and found else None


# what a rank raises when another one died under it (gloo's words, and the socket's)
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker crash|Broken pipe", re.IGNORECASE)


def failed_rank(lines: list[str], plan: launcher.LaunchPlan) -> tuple[str | None, str]:
    """The node and reason of the first failed rank: its exception's own line when it printed a
    traceback, else Intel MPI's BAD TERMINATION block, else its first error line. A traceback that only
    says a peer went away is the symptom: where mpirun names another rank as the one that ended, that one."""
    exc = raised(lines, plan)
    text = "\n".join(lines)
    m = _BAD_RANK.search(text)
    e = _EXIT.search(text)
    reason = e.group(1).lower() if e else "failed"
    if exc and m and int(m.group(1)) != exc[0] and _PEER_LOST.search(exc[1]):
        dead = int(m.group(1))
        return plan.rank_host(dead), (f"rank {dead} on {plan.rank_host(dead)} {reason} (rank {exc[0]} then lost "
                                      f"its connection to it)")
    if exc:
        rank, line = exc
        return plan.rank_host(rank), f"rank {rank} on {plan.rank_host(rank)} failed: {line}"
    if m:
        return plan.rank_host(int(m.group(1))), f"rank {m.group(1)} on {plan.rank_host(int(m.group(1)))} {reason}"
    for line in lines:  # a traceback or error line from one rank
        r = OutputRouter.RANK_LINE.match(line)
        if r and re.search(r"(Error|error:|Traceback)", r.group(2)):
            rank = int(r.group(1))
            if rank < plan.world_size:
                return plan.rank_host(rank), f"rank {rank} on {plan.rank_host(rank)} failed: {r.group(2)[:200]}"
    return None, "mpirun failed"
