"""A run's places, in one value: on a node, at the operator's home and in the cluster's store.

Every module that needs a run's folder, its checkpoints or a store key asks ``RunPaths``; none builds or splits
those strings itself. It imports nothing outside the standard library: the ranks use it too.

    <node home>/runs/<id>/          rank.sh, node_env.sh, secrets.env, mpirun.log, data/, script/, output/, work/,
                                    ranks/<rank>.json, events/<rank>.jsonl, resume/<checkpoint>
    <runs dir>/<id>/                summary.json, results.json, log.txt, events.jsonl, output/,
                                    checkpoints/<checkpoint>
    <store>/runs/<id>/              checkpoints/<checkpoint>/ (complete once COMPLETE_MARKER is in it), output/,
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

RUNS = "runs"
COMPLETE_MARKER = "xc-complete"  # written last into a checkpoint folder: it is whole
KEEP_CHECKPOINTS = 2  # complete checkpoints kept per run (home and store); the newest win
_CHECKPOINT = "checkpoint-{}"  # one name for a checkpoint on the node (the Trainer's), at home and in the store
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d+)")


def checkpoint_name(step: int) -> str:
    return _CHECKPOINT.format(int(step))


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name, else None; step-N is what stores and homes held before."""
    m = _CHECKPOINT_RE.fullmatch(name) or re.fullmatch(r"step-(\d+)", name)
    return int(m.group(1)) if m else None


# The one owner of checkpoints in a folder (a node's output_dir, the operator's runs/<id>/checkpoints); the store's
# are listed by training/runtime/store.py from these same names.
CHECKPOINT_GLOB = _CHECKPOINT.format("*")  # what a glob (pathlib's, a shell's) finds them by


def is_checkpoint(name: str) -> bool:
    return checkpoint_step(name) is not None


def mark_complete(folder: str | os.PathLike, step: int) -> None:
    """Written last, once everything else of the checkpoint is: from then on it counts."""
    (Path(folder) / COMPLETE_MARKER).write_text(json.dumps({"step": int(step), "time": time.time()}))


def complete_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints in folder, oldest first; a partial one never counts."""
    base = Path(folder)
    found = [(checkpoint_step(d.name), d) for d in base.iterdir()] if base.is_dir() else []
    return sorted((step, d) for step, d in found if step is not None and (d / COMPLETE_MARKER).is_file())


def latest_checkpoint(folder: str | os.PathLike) -> tuple[int, Path] | None:
    found = complete_checkpoints(folder)
    return found[-1] if found else None


def purge_checkpoints(folder: str | os.PathLike, keep: int = KEEP_CHECKPOINTS) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints in folder; returns the deleted ones."""
    found = complete_checkpoints(folder)
    old = [d for _, d in found[:max(0, len(found) - keep)]]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
    return old


@dataclass(frozen=True)
class RunPaths:
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
        return self.home_checkpoints / checkpoint_name(step)

    # -- in the store (keys under its root) ---------------------------------------------------------------------
    @property
    def store(self) -> str:
        return f"{RUNS}/{self.run_id}"

    @property
    def store_checkpoints(self) -> str:
        return f"{self.store}/checkpoints"

    def store_checkpoint(self, step: int) -> str:
        return f"{self.store_checkpoints}/{checkpoint_name(step)}"

    @property
    def store_output(self) -> str:
        return f"{self.store}/output"

    def store_record(self, name: str) -> str:
        return f"{self.store}/{name}"

    def store_url(self, root: str, step: int) -> str:
        """The checkpoint's URL: what XC_RESUME_URL carries to the ranks."""
        return f"{root.rstrip('/')}/{self.store_checkpoint(step)}"


def runs_under(home: str | Path) -> Path:
    """The runs folder under a machine's work root: what a head's supervisors write records into."""
    return Path(home) / RUNS


def parse_checkpoint_url(url: str) -> tuple[str, str, int]:
    """(store root, run id, step) of a checkpoint URL that RunPaths.store_url made."""
    m = re.fullmatch(rf"(.*)/{RUNS}/([^/]+)/checkpoints/([^/]+)/?", url)
    step = checkpoint_step(m.group(3)) if m else None
    if m is None or step is None:
        raise ValueError(f"{url} is not a run's checkpoint in a store")
    return m.group(1), m.group(2), step


def node_run_of(path: str) -> tuple[str, str]:
    """(node home, run id) of a run folder on a node that RunPaths.node named."""
    home, sep, run_id = path.rstrip("/").rpartition(f"/{RUNS}/")
    if not sep or "/" in run_id:
        raise ValueError(f"{path} is not a run folder on a node")
    return home, run_id


# -- object tags in the store: infra/store.py's lifecycle rules select by them ----------------------------------------
CHECKPOINT_TAG = "xeon-cluster-kind=checkpoint"  # expires after checkpointRetentionDays
# A run's log (log.txt and its appended parts) and the head's heartbeats change often: their old versions expire
# after a day (records and outputs keep theirs for 30)
LOG_TAG = "xeon-cluster-kind=log"
LOG_NAMES = ("log.txt", "heartbeat.json")
LOG_PARTS = "log.parts"  # runs/<id>/log.parts/<byte offset>: a running run's log, each piece written once


def tag_of(key: str) -> str | None:
    """The object tag a store key's kind carries (None: untagged)."""
    if "/checkpoints/" in f"/{key}":
        return CHECKPOINT_TAG
    parts = key.split("/")  # a run's own log and heartbeat (runs/<id>/log.txt), not a file of its outputs
    if (len(parts) >= 3 and parts[-3] == RUNS and parts[-1] in LOG_NAMES) or (
            len(parts) >= 4 and parts[-4] == RUNS and parts[-2] == LOG_PARTS):
        return LOG_TAG
    return None
