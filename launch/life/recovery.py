"""What a restart cost: seconds from the notice (or the loss of a node) to the resumed run's
first optimizer step, split into the ending (the notice's checkpoint and teardown), waiting for nodes, staging and
start-up, and the steps done twice. Recorded on the resumed run (`recovery`) the moment its rank 0 marks its
first optimizer step (training.runtime.timeline's `first_step`, which a restart turns on with XC_TIMELINE=1; a script
without the mark: its first progress line), so `fab runs` shows it while the run goes on.

    noticed_at ------ restart.at ------ begun ------ launched ------ first step
      (rank 0's notice   (the run ended:   (nodes ready:  (staged: mpirun
       line streamed)     restarting)       the run's      starts)
                                            folder)
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from launch.life import records
from training.runtime import events
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)


class Recovery:
    """Made as a resumed run's folder is made (before the run that ended names it); fed the run's lines."""

    def __init__(self, runs_dir: Path, restart_of: str, resume_step: int | None):
        self.of, self.resume_step = restart_of, resume_step
        self.prev = records.load_or_none(RunPaths(restart_of, runs_dir=runs_dir).home)
        self.begun, self.launched_at, self.done = time.time(), None, False
        self.log_path = RunPaths(restart_of, runs_dir=runs_dir).home / "log.txt"

    @classmethod
    def of_request(cls, req) -> Recovery | None:
        if not req.restart_of:
            return None
        r = req.resume  # a dict, or a value with .step
        return cls(Path(req.runs_dir), req.restart_of, r.get("step") if isinstance(r, dict) else getattr(r, "step", None))

    def launched(self) -> None:
        self.launched_at = time.time()

    def hook(self, run_dir: Path, record):
        """The router's event hook: on the first optimizer step's mark (or first progress event), record the cost."""
        def seen(event: events.RunEvent) -> None:
            if self.done:
                return
            marked = event.kind == events.MARK and event.payload.get("name") == "first_step"
            if marked:
                at = event.time
            elif event.kind == events.PROGRESS:
                at = time.time()
            else:
                return
            self.done = True
            try:
                records.noted(run_dir, record, recovery=self.figures(at, "mark" if marked else "progress line"))
            except Exception:
                log.warning("run %s: its recovery figures were not recorded", record.run_id, exc_info=True)
        return seen

    def figures(self, first_step: float, how: str) -> dict:
        prev = self.prev
        pre = (prev.preempted if prev else None) or {}
        noticed = pre.get("noticed_at")
        ended = (prev.restart or {}).get("at") if prev else None
        if ended is None and prev and prev.started_at:
            ended = float(prev.started_at) + float(prev.wall_s or 0)
        start = noticed or ended or self.begun
        out = {"of": self.of, "from": "notice" if noticed else "loss", "first_step_by": how,
               "recovery_s": round(first_step - start, 3),
               "waiting_s": round(self.begun - ended, 3) if ended else None,
               "staging_s": round(self.launched_at - self.begun, 3) if self.launched_at else None,
               "startup_s": round(first_step - self.launched_at, 3) if self.launched_at else None}
        if noticed and ended:
            out["ending_s"] = round(ended - noticed, 3)
        reached = pre.get("notice_step", pre.get("step")) if pre else self._last_step()
        if reached is not None and self.resume_step is not None:
            out["steps_redone"] = max(0, int(reached) - int(self.resume_step))
        out["resumed_step"] = self.resume_step
        return out

    def _last_step(self) -> int | None:
        """The highest step the run that ended reached (a lost node: no notice says where it was): its record's, folded
        from its ranks' events at its end, else its log's progress events (node 0 lost with its events file)."""
        reached = ((self.prev.segment or {}) if self.prev else {}).get("to_step")
        if isinstance(reached, int):
            return reached
        try:
            steps = events.steps(self.log_path.read_text(errors="replace"))
        except OSError:
            return None
        return max(steps) if steps else None
