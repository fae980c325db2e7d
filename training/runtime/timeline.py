"""Start-up marks for bench/first_step.py: with XC_TIMELINE=1 in a rank's environment, rank 0 prints
`[timeline] NAME UNIX_SECONDS` at its milestones (the process's own start, read from /proc, then what the job
marks) and at the end of its first optimizer step. Without the variable nothing is printed or imported."""
from __future__ import annotations

import os
import time

from training.runtime import events

ENV = "XC_TIMELINE"


def enabled(is_main: bool = True) -> bool:
    return is_main and os.environ.get(ENV, "") not in ("", "0")


def process_start() -> float:
    """When this process started (Unix seconds): now, less its age (/proc/uptime minus /proc/self/stat's start
    time after boot, both in 10 ms; /proc/stat's boot time is whole seconds, too coarse for this)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def mark(name: str, is_main: bool = True, at: float | None = None) -> None:
    if enabled(is_main):
        events.emit(events.RunEvent(events.MARK, 0, None, time.time() if at is None else at, {"name": name}))


def start(is_main: bool) -> None:
    """The process's start and now (what importing and setting up the process group took)."""
    if enabled(is_main):
        mark("process_start", at=process_start())
        mark("dist_setup")


def callbacks(is_main: bool) -> list:
    """A TrainerCallback marking train_begin and first_step (the end of this process's first optimizer step: step 1,
    or the first after a checkpoint it resumed from)."""
    if not enabled(is_main):
        return []
    from transformers import TrainerCallback

    class FirstStep(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            mark("train_begin")

        marked = False

        def on_step_end(self, args, state, control, **kw):
            if not self.marked:
                self.marked = True
                mark("first_step")

    return [FirstStep()]
