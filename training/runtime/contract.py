"""The spot contract for scripts without a Trainer that import nothing of ours (docs/scripts.md, docs/examples/ddp_toy.py).

Every rank of a `fab train` run has, from the rank hook (hook/sitecustomize.py):
- XC_NOTICE_FILE: a path that appears (JSON: cause, rank) on EVERY rank once any rank's node got a spot notice or a
  group termination: "save now". Ranks see it within one poll of each other, not at the same step: agree on the
  step in the script (one all-reduce of "the file exists", MAX), as the example does.
- XC_CHECKPOINT_DIR: where rank 0 saves, as `checkpoint-<step>/`, writing an empty `xc-complete` file in it LAST.
  Complete checkpoints there go to the cluster's store (XC_STORE) from rank 0 while the run goes on.
- exit 75: "preempted, resume me". At that exit rank 0 prints the notice line (cause, step, durable) once the
  newest complete checkpoint is confirmed in the store (or the wait ran out), and the other ranks wait for it.
- XC_RESUME_FROM on a resume: the checkpoint folder (fetched from the store onto the node before the script starts).
The agent starts when the script makes its torch.distributed group; ranks share a notice through the group's
TCP key-value store (a key of ours), never through the script's collectives.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from pathlib import Path

# preempt at the top, not where it is used: the rank hook imports this module with a user's own `training` set
# aside, and a later `from training import ...` would find theirs (training/hook/sitecustomize.py)
from training.runtime import events, notice, preempt, publish, spot, store
from training.runtime.paths import Checkpoints

log = logging.getLogger("training.runtime.contract")
NOTICE_KEY, DONE_KEY = "xc/notice", "xc/notice-durable"


def _trainer_owns_it() -> bool:
    """A Trainer script: training.runtime.preempt gives it the notice line and the exit; the agent only writes the file."""
    preempt = sys.modules.get("training.runtime.preempt")
    return bool(preempt and preempt.ATTACHED)


class Agent(threading.Thread):
    def __init__(self, kv, rank: int, local_rank: int):
        super().__init__(name="xc-notice-file", daemon=True)
        self.kv, self.rank, self.local_rank = kv, rank, local_rank
        self.watcher = spot.NoticeWatcher()  # its check() and token; the polling is this thread's
        self.file = Path(os.environ["XC_NOTICE_FILE"])
        self.folder = Path(os.environ["XC_CHECKPOINT_DIR"])
        self.notice: dict | None = None
        self.publisher: publish.Publisher | None = None
        self.submitted: set[int] = set()
        self.imds: bool | None = None  # None until the first answer; False: no IMDS here
        self._halt = threading.Event()

    def poll(self) -> None:
        """One round: this node's IMDS, then the shared key; the file once a notice is known; rank 0 publishes."""
        if self.notice is None and self.imds is not False:
            try:
                seen = self.watcher.check()
                self.imds = True
            except (OSError, ConnectionError):
                self.imds = bool(self.imds)  # never reached: not on EC2, stay quiet; reached once: a blip
                seen = None
            if seen:
                self.notice = {"cause": seen["cause"], "rank": self.rank}
                self._share()
        if self.notice is None and self.kv is not None:
            try:
                if self.kv.check([NOTICE_KEY]):
                    self.notice = json.loads(self.kv.get(NOTICE_KEY))
            except Exception as exc:  # noqa: BLE001 - the script's group may be gone
                log.debug("notice key unreadable: %s", exc)
        if self.notice is not None and not self.file.exists():
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_name(self.file.name + ".tmp")
            tmp.write_text(json.dumps(self.notice))
            tmp.replace(self.file)
        if self.rank == 0 and not _trainer_owns_it():
            self.publish_new()

    def _share(self) -> None:
        if self.kv is not None:
            try:
                self.kv.set(NOTICE_KEY, json.dumps(self.notice))
            except Exception as exc:  # noqa: BLE001
                log.warning("could not share the notice with the other ranks: %s", exc)

    def publish_new(self) -> None:
        url, run_id = store.store_url(), os.environ.get("XC_RUN_ID")
        if not url or not run_id or not self.folder.is_dir():
            return
        for step in Checkpoints.steps(self.folder):
            if step not in self.submitted:
                if self.publisher is None:
                    self.publisher = publish.Publisher(url, run_id)
                    self.publisher.start()
                self.submitted.add(step)
                self.publisher.submit(self.folder / Checkpoints.name(step), step)

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll()
            self._halt.wait(self.watcher.interval)

    def at_exit(self) -> None:
        """The script is ending: after a notice, rank 0 says whether its newest checkpoint is durable and the others
        wait for that before they exit (mpirun would end rank 0 mid-upload); the node goes only once it is safe."""
        self._halt.set()
        if self.is_alive():
            self.join(self.watcher.interval + 5)  # no thread of ours inside the key-value store at interpreter exit
        if _trainer_owns_it():
            return
        self.poll()
        if self.notice is None:
            return
        ok = False
        if self.rank == 0:
            latest = Checkpoints.latest(self.folder)
            step = latest[0] if latest else -1
            if self.publisher is not None and step >= 0:
                ok = self.publisher.wait(preempt.wait_seconds(self.notice["cause"])) and self.publisher.confirmed(step)
            events.emit(notice.Notice(cause=self.notice["cause"], rank=int(self.notice["rank"]), step=step,
                                      checkpoint=Checkpoints.name(step), durable=ok).event())
            if self.kv is not None:
                self.kv.set(DONE_KEY, "1" if ok else "0")
        elif self.kv is not None:
            import datetime

            try:
                self.kv.wait([DONE_KEY], datetime.timedelta(seconds=preempt.wait_seconds(self.notice["cause"]) + 30))
                ok = self.kv.get(DONE_KEY) == b"1"
            except Exception as exc:  # noqa: BLE001 - rank 0 gone: nothing more to wait for
                log.warning("rank 0 did not say whether the checkpoint is durable: %s", exc)
        spot.release_node(self.watcher, self.rank, self.local_rank, durable=ok)


def start(dist) -> Agent | None:
    """Called by the rank hook once the script's torch.distributed group exists; None where it cannot run."""
    try:
        rank = dist.get_rank()
        kv = keep = None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if dist.get_world_size() > 1 and addr and port:
            import datetime

            from torch.distributed import distributed_c10d

            keep = distributed_c10d._get_default_store()  # rank 0 serves the store: hold it past destroy_process_group
            kv = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=60),
                               wait_for_workers=False)
        agent = Agent(kv, rank, int(os.environ.get("LOCAL_RANK", "0") or 0))
        agent.keep = keep
    except Exception as exc:  # noqa: BLE001 - a helper, never the rank's failure
        log.warning("the spot notice file is off: %s", exc)
        return None
    agent.start()
    atexit.register(agent.at_exit)
    return agent
