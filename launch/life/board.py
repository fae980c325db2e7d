"""`fab tensorboard RUN...`: a run's TensorBoard event files from the cluster's store, served on this machine.

A chain (a run and the runs it was resumed as) shows as ONE run in TensorBoard: every segment's event files go into
one folder, named for the chain's first run, under ~/.cache/xeon-cluster/tensorboard/<the chains' first runs>/. While any chain goes on, its files are pulled again every few seconds
(only the ones that grew), so the curves move as the run trains.
"""
from __future__ import annotations

import ctypes
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cluster import store as store_lib
from core.errors import ClusterError
from launch.life.stop import check_run_id
from training.runtime.paths import RunPaths

EVENTS = "tfevents"  # what TensorBoard itself looks for in a file's name
REFRESH_S = 15.0


def cache_root() -> Path:
    return Path.home() / ".cache" / "xeon-cluster" / "tensorboard"


def chain(url: str, run_id: str, runs_dir: Path) -> list[tuple[str, int | None]]:
    """The chain's runs, first to last, whichever of them run_id names (summaries: resumed_from, restarted_as), each
    with the checkpoint step it resumed from (None for the first)."""
    def summary(rid: str) -> dict | None:
        local = runs_dir / rid / "summary.json"
        found = store_lib.read_summary(url, rid) if url else None
        if found is None and local.is_file():
            found = json.loads(local.read_text())
        return found

    first = summary(run_id)
    if first is None:
        raise ClusterError(f"no run {run_id} in the store {url} or under {runs_dir}",
                           fix="pass an id from 'fab runs' (or --store with the store the run used)")
    ids, seen = [run_id], {run_id: first}
    while (back := (seen[ids[0]].get("resumed_from") or {}).get("run_id")) and back not in seen:
        found = summary(back)
        if found is None:
            break
        ids.insert(0, back)
        seen[back] = found
    while (ahead := seen[ids[-1]].get("restarted_as")) and ahead not in seen:
        found = summary(ahead)
        if found is None:
            break
        ids.append(ahead)
        seen[ahead] = found
    return [(rid, (seen[rid].get("resumed_from") or {}).get("step") if i else None) for i, rid in enumerate(ids)]


def session_start(folder: Path, name: str, step: int, at: float) -> None:
    """An event file of one SessionLog START at step: TensorBoard's loader takes the first as the chain's start and
    each later one as a restart, dropping the points it has from that step on (the steps a resumed run does again),
    so a chain is one curve. Its name sorts where it belongs among the runs' files (a folder's files are read in name
    order). Without TensorBoard here (--no-serve), nothing is written."""
    try:
        from tensorboard.compat.proto import event_pb2  # optional: only fab tensorboard serves
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        return
    path = folder / f"events.out.tfevents.{name}"
    if path.exists():
        return
    with path.open("wb") as f:
        writer = RecordWriter(f)  # the version first, as a writer's own file has it: the loader reads STARTs after it
        writer.write(event_pb2.Event(wall_time=at, file_version="brain.Event:2").SerializeToString())
        writer.write(event_pb2.Event(wall_time=at, step=step, session_log=event_pb2.SessionLog(
            status=event_pb2.SessionLog.START)).SerializeToString())


def going_on(url: str, runs: list[tuple[str, int | None]]) -> bool:
    """The chain's last run has not ended, or it ended restarting (a next run will come)."""
    last = store_lib.read_summary(url, runs[-1][0]) if url else None
    return last is not None and (last.get("status") in ("running", "restarting") or bool(last.get("restarted_as")))


def _written_at(name: str) -> float:
    """When its writer made an event file: the seconds in its name (events.out.tfevents.<seconds>.<host>...)."""
    try:
        return float(name.split(EVENTS, 1)[1].split(".")[1])
    except (IndexError, ValueError):
        return 0.0


class Board:
    """The event files of some chains, pulled into one folder per chain."""

    def __init__(self, url: str | None, runs: list[str], runs_dir: Path, root: Path | None = None,
                 say: Callable[[str], None] = print):
        for run in runs:
            check_run_id(run, runs_dir)
        self.url, self.runs_dir, self.say = url, runs_dir, say
        self.chains = {run: chain(url, run, runs_dir) for run in runs}
        # TensorBoard's --logdir: one folder per chain under it, and nothing else
        self.root = (root or cache_root()) / "+".join(sorted({ids[0][0] for ids in self.chains.values()}))
        self.sizes: dict[Path, int] = {}

    def folder(self, run: str) -> Path:
        return self.root / self.chains[run][0][0]

    def pull(self) -> dict[str, int]:
        """Every chain's event files that are new or grew; returns run -> event files it has now."""
        counts = {}
        for run in list(self.chains):
            if self.url and going_on(self.url, self.chains[run]):
                self.chains[run] = chain(self.url, run, self.runs_dir)  # a restart adds a segment
            dest = self.folder(run)
            dest.mkdir(parents=True, exist_ok=True)
            session_start(dest, "0000000000.xc-start", 0, 0.0)  # before any run's file, from the first look on
            for seg, resumed_at in self.chains[run]:
                names = self._pull_segment(seg, dest)
                if resumed_at is not None and names:  # the resumed run's first step is the checkpoint's next
                    before = min(_written_at(n) for n in names) - 1
                    session_start(dest, f"{int(before):010d}.xc-resume-{seg}", resumed_at + 1, before)
            counts[run] = sum(1 for p in dest.iterdir() if EVENTS in p.name and ".xc-" not in p.name)
        return counts

    def _pull_segment(self, seg: str, dest: Path) -> list[str]:
        """The segment's event files into dest (those new or grown); returns their names."""
        entries = []
        if self.url:
            entries = [(e.key.rsplit("/", 1)[-1], e.size, e.key) for e in
                       store_lib.list_keys(self.url, RunPaths(seg).store_output) if EVENTS in e.key.rsplit("/", 1)[-1]]
            for name, size, key in entries:
                target = dest / name
                if self.sizes.get(target) != size:
                    store_lib.get_file(self.url, key, target)
                    self.sizes[target] = size
        if not entries:  # a run that never had a store: its outputs as they came home
            for path in (p for p in (self.runs_dir / seg / "output").rglob(f"*{EVENTS}*") if p.is_file()):
                entries.append((path.name, path.stat().st_size, None))
                if self.sizes.get(dest / path.name) != path.stat().st_size:
                    shutil.copy2(path, dest / path.name)
                    self.sizes[dest / path.name] = path.stat().st_size
        return [name for name, _, _ in entries]

    def describe(self, counts: dict[str, int]) -> list[str]:
        lines = []
        for run, count in counts.items():
            ids = [rid for rid, _ in self.chains[run]]
            segs = f"{len(ids)} runs: {' -> '.join(ids)}" if len(ids) > 1 else f"run {ids[0]}"
            lines.append(f"tensorboard {run}: {count} event file(s) from {segs} in {self.folder(run)}")
        return lines


try:
    _PRCTL = ctypes.CDLL(None).prctl  # looked up here, not in the forked child
except (OSError, AttributeError):
    _PRCTL = None


def _dies_with_parent() -> None:
    """In the child, before exec: the kernel kills it when fab ends, however fab ends (a SIGKILL runs no finally)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tensorboard_command() -> list[str]:
    exe = Path(sys.executable).parent / "tensorboard"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("tensorboard")
    if found:
        return [found]
    raise ClusterError("TensorBoard is not installed where fab runs", fix="pip install tensorboard (make test's venv "
                       "has it), or pass --no-serve and point your own TensorBoard at the folder printed")


def serve(board: Board, port: int, refresh_s: float = REFRESH_S) -> int:
    """TensorBoard on 127.0.0.1:port over the chains' folders, pulling again while any chain goes on; until Ctrl-C."""
    command = tensorboard_command()
    counts = board.pull()
    for line in board.describe(counts):
        board.say(line)
    if not any(counts.values()):
        raise ClusterError("no TensorBoard event files for " + ", ".join(counts) + " yet",
                           fix="a run writes them with --report_to tensorboard (the bundled jobs' default where "
                               "tensorboard is installed on the nodes); wait for its first logging step")
    # the Python loader: it drops a run's points past the step a resumed run restarts at (purge_orphaned_data), so a
    # chain is one curve; the faster Rust loader keeps both runs' points of the steps done twice
    proc = subprocess.Popen([*command, "--logdir", str(board.root), "--host", "127.0.0.1", "--port", str(port),
                             "--reload_interval", "5", "--load_fast", "false", "--purge_orphaned_data", "true"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_dies_with_parent)  # noqa: PLW1509 - one prctl call, no lock taken
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped fab stops its TensorBoard (the finally below)
    board.say(f"TensorBoard at http://127.0.0.1:{port}/ (Ctrl-C stops it); pulling new event files every "
              f"{refresh_s:.0f} s while a run goes on")
    try:
        while proc.poll() is None:
            time.sleep(refresh_s)
            if board.url and any(going_on(board.url, ids) for ids in board.chains.values()):
                board.pull()
        err = (proc.stderr.read() or "").strip().splitlines()
        raise ClusterError(f"TensorBoard ended: {err[-1] if err else f'exit {proc.returncode}'}",
                           fix=f"pass --port with a free port (was {port})")
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:  # TensorBoard can sit out a SIGTERM
                proc.kill()
                proc.wait()
