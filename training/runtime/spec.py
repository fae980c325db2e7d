"""RunSpec: what a run is, in one frozen, nested value: what runs, where and on how many nodes, how fast, how
often it saves, how it recovers. The flags build it, the record keeps it (to_json), --resume, the supervisor and a
head that takes a chain over read it back (from_json). Each rule on its values is checked here (problem), once.

Standard library only: the operator side and the ranks both read it."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import ClassVar

from training.runtime import spot
from training.runtime.wire import COMM_HOOKS

BACKENDS = ("auto", "ccl", "gloo")
PRECISIONS = ("auto", "bf16", "fp32")
COMM_HOOK_CHOICES = ("auto", *COMM_HOOKS)


@dataclass(frozen=True)
class What:
    """The code and its inputs. A bundled job (job) unless script or module names the user's own; workdir is their
    project, shipped; snapshot and pylayer are the store's keys of that code and of the extra packages; digests are
    what a resume without a snapshot must find unchanged here (the lone script's, the data files')."""

    job: str | None = "glue"
    script: str | None = None
    workdir: str | None = None
    module: str | None = None
    launcher: str = "python"  # or "accelerate"
    requirements: str | None = None
    pylayer: str | None = None
    snapshot: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    script_digest: str | None = None
    data: dict[str, str] = field(default_factory=dict)  # absolute path -> digest

    def __post_init__(self):
        object.__setattr__(self, "args", tuple(self.args))

    @property
    def own(self) -> bool:
        """The user's own code (--script or --module), not a bundled job."""
        return bool(self.script or self.module)


@dataclass(frozen=True)
class Where:
    """How many nodes (None: all of the cluster's), ranks and threads on each, pinned or not, and how long a
    collective may wait."""

    nodes: int | None = None
    ppn: str = "auto"
    threads: str = "auto"
    pin: bool = True
    timeout_s: int = 300


@dataclass(frozen=True)
class Speed:
    backend: str = "auto"
    precision: str = "auto"
    comm_hook: str = "auto"  # gradients on the wire: bf16 / fp16 halve the all-reduce bytes; none: fp32


@dataclass(frozen=True)
class Saving:
    save_every: str = spot.DEFAULT_SAVE_EVERY  # 600s, 10m, 200 (steps), 0 (off)


@dataclass(frozen=True)
class Recovery:
    """How a chain recovers by itself: up to max_restarts restarts, each waiting restart_wait seconds for the
    cluster; with min_nodes, a wait that ends short goes on with that many nodes or more at the same global batch,
    and back to full size at a checkpoint once nodes return (grow_back)."""

    max_restarts: int = 0
    restart_wait: float = 600
    min_nodes: int | None = None
    grow_back: bool = True


_SECTIONS = {"what": What, "where": Where, "speed": Speed, "saving": Saving, "recovery": Recovery}
_HOME = {f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
# fields that may be null (their annotation says so): a record's null there is kept, elsewhere it means the default
_NULLABLE = {f.name for cls in _SECTIONS.values() for f in dataclasses.fields(cls) if "None" in str(f.type)}


@dataclass(frozen=True)
class RunSpec:
    KEY: ClassVar[str] = "spec"  # its key in a run's summary.json
    BACKENDS: ClassVar[tuple[str, ...]] = BACKENDS

    what: What = What()
    where: Where = Where()
    speed: Speed = Speed()
    saving: Saving = Saving()
    recovery: Recovery = Recovery()

    def but(self, **changes) -> RunSpec:
        """A copy with fields changed by their own names (nodes=3, min_nodes=2), whatever their section, or a whole
        section by its name (recovery=Recovery(...))."""
        unknown = sorted(set(changes) - set(self.fields()))
        if unknown:
            raise TypeError(f"RunSpec has no field {', '.join(unknown)}")
        whole = {k: v for k, v in changes.items() if k in _SECTIONS}
        by_section: dict[str, dict] = {}
        for name, value in changes.items():
            if name not in _SECTIONS:
                by_section.setdefault(_HOME[name], {})[name] = value
        return dataclasses.replace(self, **whole, **{s: dataclasses.replace(whole.get(s, getattr(self, s)), **c)
                                                     for s, c in by_section.items()})

    @staticmethod
    def fields() -> tuple[str, ...]:
        """The names `but` takes: every field's own, and each section's."""
        return (*_HOME, *_SECTIONS)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"what": dataclasses.asdict(self.what) | {"args": list(self.what.args)}}

    @classmethod
    def from_json(cls, kept: dict | None) -> RunSpec:
        """The spec a record keeps: to_json's nested dict, or the flat one records kept before (each field under its
        own name, the policy under "recovery"); a field a record lacks, or keeps as null, takes its default."""
        kept = dict(kept or {})
        if not any(isinstance(kept.get(s), dict) for s in ("what", "where")):
            flat = {"comm_hook": "none"}  # records before --comm-hook sent fp32
            flat |= {k: v for k, v in kept.items() if k in _HOME} | dict(kept.get("recovery") or {})
            kept = {s: {k: v for k, v in flat.items() if _HOME.get(k) == s} for s in _SECTIONS}
        return cls(**{name: section(**{k: v for k, v in (kept.get(name) or {}).items()
                                       if k in _HOME and _HOME[k] == name and (v is not None or k in _NULLABLE)})
                      for name, section in _SECTIONS.items()})

    @classmethod
    def of_summary(cls, summary: dict | None) -> RunSpec | None:
        """The spec a run's summary.json keeps (under KEY; "request" in records written before); None if none."""
        summary = summary or {}
        kept = summary.get(cls.KEY) or summary.get("request")
        return cls.from_json(kept) if kept else None

    def problem(self) -> tuple[str, str] | None:
        """The first rule the values break, as (what, fix) for a one-line error; None when every rule holds."""
        for rule in (self._choices, self._counts, self._recovery, self._env):
            found = rule()
            if found:
                return found
        return None

    def _choices(self):
        s = self.speed
        for flag, value, choices, fix in (
                ("--backend", s.backend, BACKENDS, "pass one of them"),
                ("--precision", s.precision, PRECISIONS, "pass one of them"),
                ("--comm-hook", s.comm_hook, COMM_HOOK_CHOICES, "pass one of them (none sends fp32 gradients)")):
            if value not in choices:
                return f"{flag} {value!r} is not one of {', '.join(choices)}", fix
        try:
            spot.parse_save_every(self.saving.save_every)
        except ValueError as exc:
            return f"--save-every: {exc}", "e.g. --save-every 10m or --save-every 200"
        return None

    def _counts(self):
        w = self.where
        if w.timeout_s < 1:
            return f"--timeout {w.timeout_s} is below 1", "pass 1 or more seconds (default 300)"
        for flag, value in (("--ppn", w.ppn), ("--threads", w.threads)):
            if value in (None, "", "auto"):
                continue
            if not re.fullmatch(r"-?\d+", str(value)):
                return f"{flag} {value!r} is not a number", "use a positive integer or 'auto'"
            if int(value) < 1:
                return f"{flag} {value} must be at least 1", "pass a positive integer or 'auto'"
        return None

    def _recovery(self):
        r, nodes = self.recovery, self.where.nodes
        if r.max_restarts < 0:
            return f"--max-restarts {r.max_restarts} is below 0", "pass 0 or more"
        if r.restart_wait < 0:
            return f"--restart-wait {r.restart_wait:g} is below 0", "pass 0 or more seconds"
        if r.min_nodes is not None:
            if r.min_nodes < 1:
                return f"--min-nodes {r.min_nodes} is below 1", "pass 1 or more"
            if nodes is not None and r.min_nodes > nodes:
                return f"--min-nodes {r.min_nodes} is above --nodes {nodes}", f"pass --min-nodes from 1 to {nodes}"
            if not r.max_restarts:
                return f"--min-nodes {r.min_nodes} applies when a run restarts by itself", "pass --max-restarts K too"
        elif not r.grow_back:
            return "--no-grow-back goes with --min-nodes", "pass --min-nodes M too, or drop --no-grow-back"
        return None

    def _env(self):
        env = self.what.env
        for parse, name, low in ((spot.parse_poll, spot.POLL_ENV, "0.1"), (spot.parse_pace, spot.PACE_ENV, "0")):
            try:
                parse(env.get(name))
            except ValueError as exc:
                example = "1" if name == spot.POLL_ENV else "0.5"
                return f"--env {exc}", f"pass seconds between {low} and 60, e.g. --env {name}={example}"
        return None

    def count(self, flag: str) -> int | None:
        """--ppn / --threads as a number; None for auto (problem() has checked the text)."""
        value = {"--ppn": self.where.ppn, "--threads": self.where.threads}[flag]
        return None if value in (None, "", "auto") else int(value)

