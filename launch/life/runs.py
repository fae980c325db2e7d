"""`fab runs` (the runs under runs/, newest first) and `fab logs RUN [-f]` (a run's log with its
[rank host] prefixes: live from node 0 while a detached run goes on, from runs/<id>/log.txt after).
Both conclude a detached run they find ended (launch.life.detach)."""
from __future__ import annotations

import io
import logging
import shlex
import time
from pathlib import Path
from typing import TextIO

from cluster import store as store_lib
from cluster.node import Node
from cluster.remote import connect
from core.errors import ClusterError
from launch.life import detach, lifecycle, records
from launch.life import head as head_lib
from launch.life.records import RunRecord, RunResult, Status, result_line
from launch.life.stop import check_run_id
from launch.life.stream import OutputRouter
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)


def metric(rec: RunRecord) -> str:
    ev = rec.eval or {}
    for key, label, fmt in (("eval_accuracy", "acc", "{:.3f}"), ("eval_f1", "f1", "{:.3f}"),
                            ("eval_exact_match", "em", "{:.1f}"), ("eval_perplexity", "ppl", "{:.2f}"),
                            ("eval_loss", "loss", "{:.4f}")):  # a user's Trainer script: its eval loss at least
        if key in ev:
            return f"{label} {fmt.format(ev[key])}"
    return "-"


def _wall(rec: RunRecord) -> str:
    if rec.status == Status.RUNNING and rec.started_at:
        return f"{time.time() - float(rec.started_at):.0f}s+"
    return f"{float(rec.wall_s):.0f}s" if isinstance(rec.wall_s, (int, float)) else "-"


def look(run_dir: Path, rec: RunRecord) -> RunRecord:
    """The record as it stands now: a detached run that ended is concluded, a run nobody will end is
    recorded abandoned. Never raises for a node that does not answer."""
    try:
        if detach.is_running_detached(rec):
            return detach.conclude(run_dir, detach.master_node(rec), None)
        return lifecycle.reap(run_dir, rec)
    except Exception as exc:  # node 0 unreachable: the run as its record says
        log.debug("looking at %s", run_dir.name, exc_info=True)
        log.warning("run %s: could not ask its nodes how it stands: %s", run_dir.name, exc)
        return rec


def look_all(runs_dir: Path) -> list[RunRecord]:
    """Every run under runs_dir, newest first, each as it stands now (see look)."""
    runs_dir = Path(runs_dir)
    folders = sorted((d for d in runs_dir.iterdir() if (d / "summary.json").is_file()), reverse=True) \
        if runs_dir.is_dir() else []
    out = []
    for folder in folders:
        rec = records.load_or_none(folder)
        if rec is not None:
            out.append(look(folder, rec))
    return out


def reap_all(runs_dir: Path) -> list[str]:
    """Look at every run recorded as going on; the ids of those recorded abandoned by this look."""
    runs_dir = Path(runs_dir)
    found = []
    for folder in sorted(runs_dir.iterdir()) if runs_dir.is_dir() else []:
        rec = records.load_or_none(folder) if (folder / "summary.json").is_file() else None
        if rec is not None and rec.status in (Status.RUNNING, Status.RESTARTING) and \
                look(folder, rec).status == Status.ABANDONED:
            found.append(rec.run_id)
    return found


def _row(rec: RunRecord, where: str = "home") -> tuple[str, ...]:
    job = rec.job or Path(rec.script or "?").name
    sps = rec.train_samples_per_second
    status = str(rec.status) + (f" -> {rec.restarted_as}" if rec.restarted_as else "")
    return (rec.run_id, job, str(len(rec.nodes)), status, _wall(rec), metric(rec),
            f"{sps:.1f}" if isinstance(sps, (int, float)) else "-", where)


def list_runs(runs_dir: Path, out: TextIO, store: str | None = None, head: Node | None = None) -> int:
    """Print one row per run, newest first, with the store's runs not at home (started from another machine or
    by a head's supervisor, or pulled nowhere yet) marked 'store'; then what each restart cost and what the look
    at a head's silent supervisor found. Returns how many."""
    recs = [(rec, "home") for rec in look_all(runs_dir)]
    notes = []
    if store:
        home = {r.run_id for r, _ in recs}
        try:
            remote = store_lib.store_runs(store)
        except ClusterError as exc:  # the store unreachable: the runs at home still list
            log.warning("%s", exc)
            remote = {}
        for run_id, summary in remote.items():
            if run_id not in home:
                rec, note = head_lib.judge(RunRecord.from_json(summary), store, head, runs_dir)
                recs.append((rec, "store"))
                notes += [f"run {run_id}: {note}"] if note else []
        recs.sort(key=lambda r: r[0].run_id, reverse=True)
    if not recs:
        out.write(f"no runs in {runs_dir}; start one with 'fab train'\n")
        return 0
    rows = [_row(rec, where) for rec, where in recs]
    header = ("run", "job", "nodes", "status", "wall", "metric", "samples/s", "where")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out.writelines("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() + "\n" for row in [header, *rows])
    out.writelines(line + "\n" for line in [*filter(None, (recovery_line(r) for r, _ in recs)),
                                            *chain_lines([r for r, _ in recs]), *speed_lines([r for r, _ in recs]),
                                            *notes])
    return len(rows)


def speed_lines(recs: list[RunRecord]) -> list[str]:
    """One line per run whose native kernels would have run but took torch's ops, with why (results.json's
    speed: 'torch: <why>'; a kernel that does not apply, 'torch (<why>)', is no fallback)."""
    lines = []
    for rec in recs:
        off = {k: v.removeprefix("torch: ") for k, v in (rec.speed or {}).items() if str(v).startswith("torch: ")}
        if off:
            lines.append(f"speed {rec.run_id}: torch's ops for {', '.join(off)}: {'; '.join(sorted(set(off.values())))}")
    return lines


def chain_lines(recs: list[RunRecord]) -> list[str]:
    """One line per resume chain whose node count changed (--min-nodes): its sizes, e.g. 2→1→2 nodes, and how
    many of its optimizer steps went on at reduced size instead of waiting."""
    by_id = {r.run_id: r for r in recs}
    followers = {r.restarted_as for r in recs if r.restarted_as}
    lines = []
    for first in recs:
        if first.run_id in followers or not first.restarted_as:
            continue
        chain = [first]
        while chain[-1].restarted_as in by_id and len(chain) <= len(recs):
            chain.append(by_id[chain[-1].restarted_as])
        sizes = [len(r.nodes) for r in chain]
        if len(set(sizes)) < 2:
            continue
        full = max(sizes)
        segs = [r.segment or {} for r in chain]
        reduced = sum(s["to_step"] - s.get("from_step", 0) for s, n in zip(segs, sizes)
                      if n < full and isinstance(s.get("to_step"), int))
        last = segs[-1].get("to_step")
        share = f"; {reduced} of {last} optimizer steps at reduced size" if isinstance(last, int) and last else ""
        lines.append(f"chain {first.run_id}: {'→'.join(map(str, sizes))} nodes ({' -> '.join(r.run_id for r in chain)})"
                     f", {chain[-1].status}{share}")
    return lines


def recovery_line(rec: RunRecord) -> str | None:
    """What a restart cost: from the notice (or the loss) to the resumed run's first optimizer step, by phase."""
    c = rec.recovery
    if not c:
        return None
    phases = ", ".join(f"{label} {c[k]:.1f}s" for k, label in (("ending_s", "ending"), ("waiting_s", "waiting for nodes"),
                                                              ("staging_s", "staging"), ("startup_s", "start-up"))
                       if isinstance(c.get(k), (int, float)))
    redone = c.get("steps_redone")
    return (f"recovery {c.get('of', '?')} -> {rec.run_id}: recovery_s={c['recovery_s']:.1f} from the "
            f"{c.get('from', 'notice')} to the first optimizer step ({phases}); steps_redone="
            f"{redone if redone is not None else '?'}")


def show_log(runs_dir: Path, run_id: str, follow: bool, out: TextIO, poll_s: float = 1.0,
             store: str | None = None, head: Node | None = None) -> str | None:
    """Print the run's log; with follow, until the run ends (a detached run is then concluded; a supervised
    run is followed through its restarts). Returns a closing line when following, else None. A run not at
    home is read from the store."""
    check_run_id(run_id, runs_dir)
    run_dir = RunPaths(run_id, runs_dir=runs_dir).home
    if not run_dir.is_dir() and store and follow and store_lib.read_summary(store, run_id):
        return _follow_store(store, run_id, out, poll_s, head, Path(runs_dir))
    if not run_dir.is_dir() and store and _log_from_store(store, run_id, out):
        return None
    if not run_dir.is_dir():
        raise ClusterError(f"no run {run_id} in {runs_dir}" + (f" nor in the store {store}" if store else ""),
                           "pass an id from 'fab runs'")
    rec = records.load(run_dir)
    plan = detach.log_plan(rec)
    if detach.is_running_detached(rec):
        master = detach.master_node(rec)
        remote = shlex.quote(rec.remote_run)
        command = (f"cd {remote} && tail -n +1 --pid=\"$(cat wrapper.pid)\" -f mpirun.log" if follow
                   else f"cat {remote}/mpirun.log")
        router = OutputRouter(plan, out, io.StringIO())  # log.txt is written once, when the run is concluded
        with connect(master) as conn:
            conn.run(command, hide=False, warn=True, pty=False, in_stream=False, out_stream=router, err_stream=router)
        router.flush_rest()
        if not follow:
            return None
        return closing(detach.conclude(run_dir, master, None), run_dir)
    if follow and rec.supervisor and (supervised_alive(rec) or rec.restarted_as or not rec.status.terminal):
        return _follow_supervised(Path(runs_dir), rec, out, poll_s)
    log_file = run_dir / "log.txt"
    if not log_file.is_file():
        if rec.status == Status.RUNNING:
            raise ClusterError(f"run {run_id} is running attached to another fab, which shows its output",
                               f"its log is written as it goes; follow it with 'fab logs {run_id} -f'")
        raise ClusterError(f"run {run_id} has no log.txt (it ended before launch: {rec.reason or '?'})",
                           f"see {run_dir / 'summary.json'}")
    router = OutputRouter(plan, out, io.StringIO())
    router.write(log_file.read_text())
    router.flush_rest()
    return closing(rec, run_dir) if follow else None


def supervised_alive(rec: RunRecord) -> bool:
    return bool(records.supervisor_alive(rec.supervisor))


def closing(rec: RunRecord, run_dir: Path) -> str:
    if rec.status == Status.OK:
        return result_line(RunResult(rec.run_id, run_dir, 0, float(rec.wall_s or 0), records.results_of(run_dir)))
    return f"run {rec.run_id} {rec.status}: {rec.reason or 'see the log above'}"


def _follow_supervised(runs_dir: Path, rec: RunRecord, out: TextIO, poll_s: float) -> str:
    """Tail runs/<id>/log.txt as the run's supervisor writes it; on to the run it restarted as; until the
    supervisor has ended the last run of the chain (or is gone: then the record says abandoned)."""
    while True:
        run_dir = RunPaths(rec.run_id, runs_dir=runs_dir).home
        router = OutputRouter(detach.log_plan(rec), out, io.StringIO())
        offset = 0
        while True:
            rec = look(run_dir, records.load(run_dir))
            data = _read_from(run_dir / "log.txt", offset)
            offset += len(data)
            router.write(data.decode(errors="replace"))
            if rec.restarted_as or (rec.status.terminal and not supervised_alive(rec)):
                break
            time.sleep(poll_s)
        router.flush_rest()
        if not rec.restarted_as:
            return closing(rec, run_dir)
        out.write(f"run {rec.run_id} {rec.status}; resumed as run {rec.restarted_as}\n")
        nxt = RunPaths(rec.restarted_as, runs_dir=runs_dir).home
        while not (nxt / "summary.json").is_file():
            time.sleep(poll_s)
        rec = records.load(nxt)


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return b""
    return data[:data.rfind(b"\n") + 1]  # whole lines only: the rest comes with the next read


def _log_from_store(store: str, run_id: str, out: TextIO) -> bool:
    """The log.txt the store keeps of a run (one started from another machine); False when it has none."""
    summary = store_lib.read_summary(store, run_id)
    text = store_lib.read_log(store, run_id)
    if summary is None or text is None:
        return False
    router = OutputRouter(detach.log_plan(RunRecord.from_json(summary)), out, io.StringIO())
    router.write(text)
    router.flush_rest()
    return True


RESTART_GRACE_S = 30.0  # a few of the supervisor's publishes (every ~5 s)


def may_restart(rec: RunRecord) -> bool:
    """A supervised run that ended so that its supervisor may resume it (a preemption, a lost node)."""
    return bool(rec.supervisor) and not rec.gave_up and (
        rec.status == Status.PREEMPTED or (rec.status == Status.FAILED and bool(rec.lost_nodes)))


def _follow_store(store: str, run_id: str, out: TextIO, poll_s: float, head: Node | None, runs_dir: Path) -> str:
    """Follow a run the store records (a head's supervisor publishes its log.txt every few seconds): on to the
    run it restarted as, until the chain's last run has ended (or its silent supervisor is confirmed gone)."""
    while True:
        rec = RunRecord.from_json(store_lib.read_summary(store, run_id) or {"run_id": run_id})
        router, shown, last, grace = OutputRouter(detach.log_plan(rec), out, io.StringIO()), 0, False, 0.0
        parts: dict[str, bytes] = {}  # the log's parts already read: they never change
        while True:
            text = store_lib.read_log(store, run_id, parts) or ""
            whole = text[:text.rfind("\n") + 1]
            router.write(whole[shown:])
            shown = max(shown, len(whole))
            if last:
                break
            rec, _ = head_lib.judge(RunRecord.from_json(store_lib.read_summary(store, run_id) or rec.to_json()),
                                    store, head, runs_dir)
            ended = rec.status is not None and rec.status.terminal
            if ended and not rec.restarted_as and may_restart(rec):
                # its supervisor records the restart a moment after the end: the store may show the end first
                ended = (grace := grace or time.monotonic() + RESTART_GRACE_S) <= time.monotonic()
            last = bool(rec.restarted_as) or ended
            time.sleep(poll_s)  # once more after the end: the log is published after the record
        router.flush_rest()
        if not rec.restarted_as:
            return (result_line(RunResult(rec.run_id, store_lib.run_url(store, rec.run_id), 0, float(rec.wall_s or 0),
                                          store_lib.read_summary(store, rec.run_id, "results.json")))
                    if rec.status == Status.OK else f"run {rec.run_id} {rec.status}: {rec.reason or 'see the log above'}")
        out.write(f"run {rec.run_id} {rec.status}; resumed as run {rec.restarted_as}\n")
        run_id = rec.restarted_as
        while store_lib.read_summary(store, run_id) is None:
            time.sleep(poll_s)
