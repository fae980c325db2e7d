"""A run's places, in one value: on a node, at the operator's home and in the cluster's store.

Every module that needs a run's folder, its checkpoints or a store key asks ``RunPaths``; none builds or splits
those strings itself. It imports nothing outside the standard library: the ranks use it too.

    <node home>/runs/<id>/          rank.sh, node_env.sh, secrets.env, mpirun.log, data/, script/, output/, work/,
                                    ranks/<rank>.json, events/<rank>.jsonl, resume/<checkpoint>
    <runs dir>/<id>/                summary.json, results.json, log.txt, events.jsonl, output/,
                                    checkpoints/<checkpoint>
    <store>/runs/<id>/              checkpoints/<checkpoint>/ (complete once Checkpoints.MARKER is in it), output/,
                                    summary.json, results.json, log.txt, events.jsonl
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

RUNS = "runs"


class Checkpoints:
    """The one owner of a run's checkpoints: their folder names (the Trainer's checkpoint-<step>, on a node, at the
    operator's home and in the store), when one counts (its marker, written last), the newest, and purging the rest.
    Every module asks it; none builds, parses or globs those names itself. The store's copies are listed by
    training/runtime/store.py from these same names."""

    MARKER = "xc-complete"  # written last into a checkpoint folder: it is whole
    KEEP = 2  # complete checkpoints kept per run (home and store); the newest win
    _NAME = "checkpoint-{}"
    GLOB = _NAME.format("*")  # what a glob (pathlib's, a shell's) finds them by
    _STEP = re.compile(r"checkpoint-(\d+)")

    @classmethod
    def name(cls, step: int) -> str:
        return cls._NAME.format(int(step))

    @classmethod
    def step(cls, name: str) -> int | None:
        """The step of a checkpoint folder's name, else None; step-N is what stores and homes held before."""
        m = cls._STEP.fullmatch(name) or re.fullmatch(r"step-(\d+)", name)
        return int(m.group(1)) if m else None

    @classmethod
    def is_name(cls, name: str) -> bool:
        return cls.step(name) is not None

    @classmethod
    def mark_complete(cls, folder: str | os.PathLike, step: int) -> None:
        """Written last, once everything else of the checkpoint is: from then on it counts."""
        (Path(folder) / cls.MARKER).write_text(json.dumps({"step": int(step), "time": time.time()}))

    @classmethod
    def complete(cls, folder: str | os.PathLike) -> list[tuple[int, Path]]:
        """(step, folder) of the complete checkpoints in folder, oldest first; a partial one never counts."""
        base = Path(folder)
        found = [(cls.step(d.name), d) for d in base.iterdir()] if base.is_dir() else []
        return sorted((step, d) for step, d in found if step is not None and (d / cls.MARKER).is_file())

    @classmethod
    def steps(cls, folder: str | os.PathLike) -> list[int]:
        return [step for step, _ in cls.complete(folder)]

    @classmethod
    def latest(cls, folder: str | os.PathLike) -> tuple[int, Path] | None:
        found = cls.complete(folder)
        return found[-1] if found else None

    @classmethod
    def purge(cls, folder: str | os.PathLike, keep: int | None = None) -> list[Path]:
        """Delete all but the newest `keep` (default KEEP) complete checkpoints in folder; returns the deleted ones."""
        keep = cls.KEEP if keep is None else keep
        found = cls.complete(folder)
        old = [d for _, d in found[:max(0, len(found) - keep)]]
        for d in old:
            shutil.rmtree(d, ignore_errors=True)
        return old


# -- object tags in the store: infra/bucket.py's lifecycle rules select by them ----------------------------------------
CHECKPOINT_TAG = "xeon-cluster-kind=checkpoint"  # expires after checkpointRetentionDays
# A run's log (log.txt and its appended parts) and the head's heartbeats change often: their old versions expire
# after a day (records and outputs keep theirs for 30)
LOG_TAG = "xeon-cluster-kind=log"
LOG_NAMES = ("log.txt", "heartbeat.json")
LOG_PARTS = "log.parts"  # runs/<id>/log.parts/<byte offset>: a running run's log, each piece written once



@dataclass(frozen=True)
class RunPaths:
    RUNS: ClassVar[str] = RUNS
    LOG_PARTS: ClassVar[str] = LOG_PARTS
    LOG_TAG: ClassVar[str] = LOG_TAG

    run_id: str
    node_home: str = '"${XC_HOME:-$HOME/.xeon-cluster}"'  # the node's work root: a shell word or a path
    runs_dir: Path | None = None  # the operator's runs/ folder

    # -- on a node (shell words when node_home is one) ---------------------------------------------------------
    @property
    def node(self) -> str:
        return f"{self.node_home}/{RUNS}/{self.run_id}"

    def on_node(self, *parts: str) -> str:
        return "/".join((self.node, *parts))

    @property
    def rank_script(self) -> str:
        return self.on_node("rank.sh")

    @property
    def secrets_file(self) -> str:
        return self.on_node("secrets.env")

    @property
    def mpirun_log(self) -> str:
        return self.on_node("mpirun.log")

    @property
    def node_output(self) -> str:
        return self.on_node("output")

    @property
    def node_events(self) -> str:
        return self.on_node("events")

    # -- at the operator's home ---------------------------------------------------------------------------------
    @property
    def home(self) -> Path:
        if self.runs_dir is None:
            raise ValueError(f"run {self.run_id}: no runs folder given")
        return Path(self.runs_dir) / self.run_id

    @property
    def home_checkpoints(self) -> Path:
        return self.home / "checkpoints"

    def home_checkpoint(self, step: int) -> Path:
        return self.home_checkpoints / Checkpoints.name(step)

    # -- in the store (keys under its root) ---------------------------------------------------------------------
    @property
    def store(self) -> str:
        return f"{RUNS}/{self.run_id}"

    @property
    def store_checkpoints(self) -> str:
        return f"{self.store}/checkpoints"

    def store_checkpoint(self, step: int) -> str:
        return f"{self.store_checkpoints}/{Checkpoints.name(step)}"

    @property
    def store_output(self) -> str:
        return f"{self.store}/output"

    def store_record(self, name: str) -> str:
        return f"{self.store}/{name}"

    def store_url(self, root: str, step: int) -> str:
        """The checkpoint's URL: what XC_RESUME_URL carries to the ranks."""
        return f"{root.rstrip('/')}/{self.store_checkpoint(step)}"

    # -- lookups ---------------------------------------------------------------------------------------------------
    @staticmethod
    def runs_under(home: str | Path) -> Path:
        """The runs folder under a machine's work root: what a head's supervisors write records into."""
        return Path(home) / RUNS

    @staticmethod
    def node_run_of(path: str) -> tuple[str, str]:
        """(node home, run id) of a run folder on a node that RunPaths.node named."""
        home, sep, run_id = path.rstrip("/").rpartition(f"/{RUNS}/")
        if not sep or "/" in run_id:
            raise ValueError(f"{path} is not a run folder on a node")
        return home, run_id


def parse_checkpoint_url(url: str) -> tuple[str, str, int]:
    """(store root, run id, step) of a checkpoint URL that RunPaths.store_url made."""
    m = re.fullmatch(rf"(.*)/{RUNS}/([^/]+)/checkpoints/([^/]+)/?", url)
    step = Checkpoints.step(m.group(3)) if m else None
    if m is None or step is None:
        raise ValueError(f"{url} is not a run's checkpoint in a store")
    return m.group(1), m.group(2), step


def tag_of(key: str) -> str | None:
    """The object tag a store key's kind carries (None: untagged)."""
    if "/checkpoints/" in f"/{key}":
        return CHECKPOINT_TAG
    parts = key.split("/")  # a run's own log and heartbeat (runs/<id>/log.txt), not a file of its outputs
    if (len(parts) >= 3 and parts[-3] == RUNS and parts[-1] in LOG_NAMES) or (
            len(parts) >= 4 and parts[-4] == RUNS and parts[-2] == LOG_PARTS):
        return LOG_TAG
    return None
