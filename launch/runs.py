"""`fab runs` (the runs under runs/, newest first) and `fab logs RUN [-f]` (a run's log with its
[rank host] prefixes: live from node 0 while a detached run goes on, from runs/<id>/log.txt after).
Both conclude a detached run they find ended (launch.detach)."""
from __future__ import annotations

import io
import logging
import shlex
import time
from pathlib import Path
from typing import TextIO

from cluster import store as store_lib
from cluster.remote import connect
from core.errors import ClusterError
from launch import detach
from launch.records import RunResult, result_line
from launch.stop import check_run_id
from launch.stream import OutputRouter

log = logging.getLogger(__name__)


def metric(summary: dict) -> str:
    ev = summary.get("eval") or {}
    for key, label, fmt in (("eval_accuracy", "acc", "{:.3f}"), ("eval_f1", "f1", "{:.3f}"),
                            ("eval_exact_match", "em", "{:.1f}"), ("eval_perplexity", "ppl", "{:.2f}")):
        if key in ev:
            return f"{label} {fmt.format(ev[key])}"
    return "-"


def _wall(summary: dict) -> str:
    if summary.get("status") == "running" and summary.get("started_at"):
        return f"{time.time() - float(summary['started_at']):.0f}s+"
    wall = summary.get("wall_s")
    return f"{float(wall):.0f}s" if isinstance(wall, (int, float)) else "-"


def list_runs(runs_dir: Path, out: TextIO, store: str | None = None) -> int:
    """Print one row per run, newest first, with the store's runs not at home (started from another machine,
    or pulled nowhere yet) marked 'store'; returns how many."""
    runs_dir = Path(runs_dir)
    folders = sorted((d for d in runs_dir.iterdir() if (d / "summary.json").is_file()), reverse=True) \
        if runs_dir.is_dir() else []
    rows = []
    for folder in folders:
        try:
            summary = detach.load(folder)
        except ClusterError:
            continue
        if detach.is_running_detached(summary):
            try:
                summary = detach.conclude(folder, detach.master_node(summary), None)
            except Exception as exc:  # node 0 unreachable: list the run as its record says
                log.debug("concluding %s", folder.name, exc_info=True)
                log.warning("run %s: could not ask node 0 whether it ended: %s", folder.name, exc)
        rows.append(_row(folder.name, summary))
    if store:
        home = {r[0] for r in rows}
        try:
            remote = store_lib.store_runs(store)
        except ClusterError as exc:  # the store unreachable: the runs at home still list
            log.warning("%s", exc)
            remote = {}
        rows += [_row(run_id, summary, "store") for run_id, summary in remote.items() if run_id not in home]
        rows.sort(key=lambda r: r[0], reverse=True)
    if not rows:
        out.write(f"no runs in {runs_dir}; start one with 'fab train'\n")
        return 0
    header = ("run", "job", "nodes", "status", "wall", "metric", "samples/s", "where")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out.writelines("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n" for row in [header, *rows])
    return len(rows)


def _row(run_id: str, summary: dict, where: str = "home") -> tuple[str, ...]:
    job = summary.get("job") or Path(summary.get("script") or "?").name
    sps = summary.get("train_samples_per_second")
    return (run_id, job, str(len(summary.get("nodes", []))), summary.get("status", "?"), _wall(summary),
            metric(summary), f"{sps:.1f}" if isinstance(sps, (int, float)) else "-", where)


def show_log(runs_dir: Path, run_id: str, follow: bool, out: TextIO, store: str | None = None) -> str | None:
    """Print the run's log; with follow, until a detached run ends (then conclude it). Returns a closing
    line for a run concluded here, else None. A run not at home is read from the store."""
    check_run_id(run_id, runs_dir)
    run_dir = Path(runs_dir) / run_id
    if not run_dir.is_dir() and store and _log_from_store(store, run_id, out):
        return None
    if not run_dir.is_dir():
        raise ClusterError(f"no run {run_id} in {runs_dir}" + (f" nor in the store {store}" if store else "")
                           + "; pass an id from 'fab runs'")
    summary = detach.load(run_dir)
    plan = detach.log_plan(summary)
    if detach.is_running_detached(summary):
        master = detach.master_node(summary)
        remote = shlex.quote(summary["remote_run"])
        command = (f"cd {remote} && tail -n +1 --pid=\"$(cat wrapper.pid)\" -f mpirun.log" if follow
                   else f"cat {remote}/mpirun.log")
        router = OutputRouter(plan, out, io.StringIO())  # log.txt is written once, when the run is concluded
        with connect(master) as conn:
            conn.run(command, hide=False, warn=True, pty=False, in_stream=False, out_stream=router, err_stream=router)
        router.flush_rest()
        if not follow:
            return None
        summary = detach.conclude(run_dir, master, None)
        if summary.get("status") == "ok":
            return result_line(RunResult(run_id, run_dir, 0, float(summary.get("wall_s") or 0),
                                         detach.results_of(run_dir)))
        return f"run {run_id} {summary.get('status')}: {summary.get('reason', 'see the log above')}"
    log_file = run_dir / "log.txt"
    if not log_file.is_file():
        if summary.get("status") == "running":
            raise ClusterError(f"run {run_id} is running attached to another fab, which shows its output; its log "
                               f"is written when it ends")
        raise ClusterError(f"run {run_id} has no log.txt (it ended before launch: {summary.get('reason', '?')})")
    router = OutputRouter(plan, out, io.StringIO())
    router.write(log_file.read_text())
    router.flush_rest()
    return None


def _log_from_store(store: str, run_id: str, out: TextIO) -> bool:
    """The log.txt the store keeps of a run (one started from another machine); False when it has none."""
    summary = store_lib.read_summary(store, run_id)
    text = store_lib.read_text(store, f"runs/{run_id}/log.txt")
    if summary is None or text is None:
        return False
    router = OutputRouter(detach.log_plan(summary), out, io.StringIO())
    router.write(text)
    router.flush_rest()
    return True
