"""Bringing a run's outputs home from node 0: the job's output_dir into runs/<id>/output/, complete
checkpoints into runs/<id>/checkpoints/checkpoint-N/ (while the run goes on, and at its end), loss.png; and every
node's rank events into runs/<id>/events.jsonl.
"""
from __future__ import annotations

import json
import logging
import math
import shlex
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from cluster.node import Node
from cluster.remote import connect, fan_out, run
from core.errors import ClusterError
from launch.staging import chart
from training.runtime import events
from training.runtime.paths import (
    Checkpoints,
    RunPaths,
)

log = logging.getLogger(__name__)

MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
PROGRESS_BYTES = 32 << 20  # files above this show transfer progress


def _listing(conn, folder: str) -> list[tuple[int, str]]:
    res = run(conn, f"cd {shlex.quote(folder)} 2>/dev/null && find . -type f -printf '%s %P\\n'", timeout=120)
    out = []
    for line in res.stdout.splitlines():
        size, _, rel = line.partition(" ")
        if size.isdigit() and rel:
            out.append((int(size), rel))
    return out


def _get(conn, remote: str, local: Path, size: int, say: Callable[[str], None] | None) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    callback = None
    if say and size > PROGRESS_BYTES:
        marks = set()

        def callback(done: int, total: int) -> None:
            pct = int(100 * done / max(total, 1)) // 25 * 25
            if pct not in marks:
                marks.add(pct)
                say(f"  {local.name}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB ({pct}%)")
    conn.sftp().get(remote, str(local), callback=callback)


def fetch_output(node: Node, remote_dir: str, local_dir: Path, with_model: bool = True,
                 say: Callable[[str], None] | None = None) -> list[str]:
    """Copy node 0's output_dir home, except checkpoints (fetched on their own) and, without
    with_model, model weights. Returns the relative paths copied."""
    copied = []
    with connect(node) as conn:
        for size, rel in _listing(conn, remote_dir):
            if Checkpoints.is_name(rel.split("/", 1)[0]) or (not with_model and rel.endswith(MODEL_SUFFIXES)):
                continue
            _get(conn, f"{remote_dir}/{rel}", local_dir / rel, size, say)
            copied.append(rel)
    if (local_dir / "trainer_state.json").is_file():
        draw_loss(local_dir / "trainer_state.json", local_dir / "loss.png")
    return copied


def gather_events(nodes: list[Node], run_id: str, home_expr: str, run_dir: Path) -> list[events.RunEvent]:
    """Every node's events/<rank>.jsonl into run_dir/events.jsonl, in time order; a node that does not answer
    adds nothing. Returns the events."""
    folder = RunPaths(shlex.quote(run_id), home_expr).node_events

    def read(node: Node) -> str:
        try:
            with connect(node) as conn:
                return run(conn, f"cat {folder}/*.jsonl 2>/dev/null; true", purpose="read the ranks' events",
                           timeout=60).stdout
        except Exception as exc:  # noqa: BLE001 - a lost node's events are lost with it; the run's end goes on
            log.debug("the events on %s: %s", node.name, exc)
            return ""

    found = events.read_jsonl("\n".join(fan_out(nodes, read, "reading the ranks' events")))
    if found:
        (run_dir / events.RUN_FILE).write_text("".join(e.to_json() + "\n" for e in found))
    return found


def latest_remote_checkpoint(conn, remote_dir: str) -> tuple[int, str] | None:
    """(step, path) of node 0's newest checkpoint with its completion marker."""
    res = run(conn, f"ls -d {shlex.quote(remote_dir)}/{Checkpoints.GLOB}/{Checkpoints.MARKER} 2>/dev/null", timeout=60)
    best = None
    for line in res.stdout.split():
        folder = line.rsplit("/", 1)[0]
        step = Checkpoints.step(folder.rsplit("/", 1)[-1])
        if step is not None and (best is None or step > best[0]):
            best = (step, folder)
    return best


def home_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints at home, oldest first (a transfer cut short is never counted)."""
    return Checkpoints.complete(RunPaths(run_dir.name, runs_dir=run_dir.parent).home_checkpoints)


def fetch_checkpoint(node: Node, run_dir: Path, remote_dir: str, with_model: bool = True,
                     say: Callable[[str], None] | None = None) -> tuple[int, Path] | None:
    """Bring node 0's newest complete checkpoint home (if not there yet); keep the last two."""
    with connect(node) as conn:
        latest = latest_remote_checkpoint(conn, remote_dir)
        if latest is None:
            return None
        step, folder = latest
        dest = RunPaths(run_dir.name, runs_dir=run_dir.parent).home_checkpoint(step)
        if not (dest / Checkpoints.MARKER).is_file():
            # The Trainer deletes all but its newest checkpoints; with frequent saves one can go while it
            # is being copied. A tree of hard links beside the output folder keeps its files for the copy.
            snap = f"{remote_dir.rstrip('/')}.xc-home-{Checkpoints.name(step)}"
            q = shlex.quote
            run(conn, f"rm -rf {q(snap)} && cp -al {q(folder)} {q(snap)}", timeout=60)
            try:
                partial = dest.with_name(dest.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                files = _listing(conn, snap)
                for size, rel in sorted(files, key=lambda f: f[1] == Checkpoints.MARKER):  # the marker last
                    if not with_model and rel.endswith(MODEL_SUFFIXES):
                        continue
                    _get(conn, f"{snap}/{rel}", partial / rel, size, say)
                if not (partial / Checkpoints.MARKER).is_file():
                    raise ClusterError(f"{node.name}: {Checkpoints.name(step)} lost its completion marker while copying",
                                       fix="run again with a larger --save-every (the Trainer deleted it mid-copy)")
                shutil.rmtree(dest, ignore_errors=True)
                partial.rename(dest)
            finally:
                run(conn, f"rm -rf {q(snap)}", timeout=60)
    for stale in dest.parent.glob("*.partial"):  # copies cut short by an earlier round
        shutil.rmtree(stale, ignore_errors=True)
    Checkpoints.purge(dest.parent)
    return step, dest


class CheckpointMirror(threading.Thread):
    """While the run goes on: every `interval` s, the newest complete checkpoint of node 0 comes home."""

    def __init__(self, node: Node, run_dir: Path, remote_dir: str, with_model: bool, interval: float = 15.0):
        super().__init__(name="checkpoint-mirror", daemon=True)
        self.args = (node, run_dir, remote_dir, with_model)
        self.interval = interval
        self.stopped = threading.Event()
        self.latest: tuple[int, Path] | None = None

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                got = fetch_checkpoint(*self.args)
                if got and got != self.latest:
                    log.info("checkpoint step %d copied home to %s", *got)
                    self.latest = got
            except Exception as exc:  # node 0 busy or gone: the next round, or the final fetch, retries
                log.debug("checkpoint mirror: %s", exc, exc_info=True)

    def stop(self) -> None:
        self.stopped.set()
        self.join(30)


def draw_loss(state_file: Path, png: Path) -> Path | None:
    """loss.png from the Trainer's log history (training loss, and eval loss where logged)."""
    try:
        history = json.loads(state_file.read_text()).get("log_history", [])
    except (OSError, ValueError):
        return None

    def points(key: str) -> list[tuple[float, float]]:  # a diverged run logs nan or inf: not drawable
        return [(h["step"], h[key]) for h in history if key in h and "step" in h and math.isfinite(h[key])]

    series = [(name, pts, style) for name, pts, style in (("train loss", points("loss"), "line"),
                                                          ("eval loss", points("eval_loss"), "points")) if pts]
    if not series:
        return None
    return chart.line_chart(series, png, "step", "loss")
