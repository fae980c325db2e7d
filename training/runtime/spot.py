"""Surviving spot: the interruption watcher, checkpoints every --save_every, and resuming.

Contract with the operator (fab train), through the ranks' environment:
- XC_IMDS_ENDPOINT: base URL of the instance metadata service (default http://169.254.169.254).
- XC_SAVE_EVERY: "600s" / "10m" (training time) or "200" (steps); "0" turns periodic checkpoints off.
- XC_RESUME_FROM: a checkpoint folder to resume from (HF Trainer's resume_from_checkpoint); your
  own --script can read it too.
A checkpoint counts only once Checkpoints.MARKER is written in it, after the Trainer finished saving.
On a notice the job saves one, rank 0 prints training.runtime.notice's Notice line and every rank exits notice.EXIT (75):
training.runtime.preempt does that for the bundled jobs and, through the rank hook, for users' Trainer scripts.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from training.runtime import events
from training.runtime import notice as _notice
from training.runtime.paths import Checkpoints

log = logging.getLogger("training.runtime.spot")

DEFAULT_IMDS = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
# The Auto Scaling group's own terminations (capacity rebalancing, instance refresh, scale-in) give no spot
# notice: a termination lifecycle hook holds the node, and IMDS then answers this with "Terminated".
LIFECYCLE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
# An early warning (raised spot interruption risk): checkpoint now, train on.
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
SPOT_CAUSE, GROUP_CAUSE = _notice.SPOT, _notice.GROUP
CLUSTER_ENV = "/etc/xeon-cluster/cluster.env"  # written by the nodes' cloud-init: group and hook names
TOKEN_TTL_S = 21600
POLL_S = 5.0  # AWS's advice for instance-action; XC_NOTICE_POLL_S in the ranks' environment changes it
POLL_ENV = "XC_NOTICE_POLL_S"
FIRST_TRIES = 3  # looks at IMDS that must all fail before the watcher decides there is none
PREEMPTED_EXIT = _notice.EXIT
DEFAULT_SAVE_EVERY = "600s"
# A floor under each optimizer step, slept out on every rank before the step's notice check: a rehearsal's short run
# on a local cluster or the twin lasts long enough to raise a notice by hand, and the CPU idles between its steps.
PACE_ENV = "XC_PACE_S"


def _seconds(name: str, value: str | None, default: float, low: float, high: float) -> float:
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if not low <= seconds <= high:
        raise ValueError(f"{name}={value} is outside {low:g}..{high:g} seconds")
    return seconds


def parse_poll(value: str | None) -> float:
    """XC_NOTICE_POLL_S: seconds between IMDS polls, 0.1..60 (default POLL_S)."""
    return _seconds(POLL_ENV, value, POLL_S, 0.1, 60)


def parse_pace(value: str | None) -> float:
    """XC_PACE_S: the least seconds an optimizer step takes, 0..60 (default 0: as fast as the cores go)."""
    return _seconds(PACE_ENV, value, 0.0, 0, 60)


def parse_save_every(value: str | None) -> tuple[str, float]:
    """'600s' / '10m' / '1h' -> ('seconds', 600.0); '200' -> ('steps', 200); '0' -> ('off', 0)."""
    text = (value or DEFAULT_SAVE_EVERY).strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text)
    if not m:
        raise ValueError(f"save_every {value!r} is neither a step count (200) nor a duration (600s, 10m, 1h)")
    number, unit = float(m.group(1)), m.group(2)
    if number == 0:
        return "off", 0.0
    if not unit:
        if number != int(number):
            raise ValueError(f"save_every {value!r}: a step count is a whole number")
        return "steps", number
    return "seconds", number * {"s": 1, "m": 60, "h": 3600}[unit]


class NoticeWatcher(threading.Thread):
    """Polls IMDSv2's spot instance-action every POLL_S seconds (XC_NOTICE_POLL_S). Off AWS, where nothing
    answers the first token request, it stops at once: no further requests, no cost."""

    def __init__(self, base: str | None = None, interval: float | None = None, timeout: float = 2.0):
        super().__init__(name="spot-notice", daemon=True)
        self.base = (base or os.environ.get("XC_IMDS_ENDPOINT") or DEFAULT_IMDS).rstrip("/")
        self.interval = interval if interval is not None else parse_poll(os.environ.get(POLL_ENV))
        self.timeout = timeout
        self.notice: dict | None = None  # with "cause": SPOT_CAUSE or GROUP_CAUSE
        self.rebalance: dict | None = None  # a rebalance recommendation: checkpoint, but no notice
        self.active = True
        self._token: str | None = None
        self._token_at = 0.0
        self._halt = threading.Event()

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    def token(self) -> str:
        if self._token is None or time.monotonic() - self._token_at > TOKEN_TTL_S - 60:
            status, body = self._request("PUT", TOKEN_PATH, {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status != 200:
                raise ConnectionError(f"IMDS token request answered {status}")
            self._token, self._token_at = body.decode().strip(), time.monotonic()
        return self._token

    def get(self, path: str) -> tuple[int, bytes]:
        """One GET with the session token; a refused token (expired) is fetched again once."""
        status, body = 401, b""
        for _ in range(2):
            status, body = self._request("GET", path, {"X-aws-ec2-metadata-token": self.token()})
            if status != 401:
                break
            self._token = None
        return status, body

    def check(self) -> dict | None:
        """One poll: the notice (spot interruption, or the group terminating this node), or None. A
        rebalance recommendation is kept in self.rebalance and is no notice."""
        status, body = self.get(ACTION_PATH)
        if status == 200:
            try:
                notice = json.loads(body or b"{}") or {"action": "terminate"}
            except ValueError:
                notice = {"action": "terminate", "raw": body.decode(errors="replace")[:200]}
            return {**notice, "cause": SPOT_CAUSE}
        status, body = self.get(LIFECYCLE_PATH)
        if status == 200 and body.decode(errors="replace").strip() == "Terminated":
            return {"action": "terminate", "cause": GROUP_CAUSE}
        if self.rebalance is None:
            status, body = self.get(REBALANCE_PATH)
            if status == 200:
                try:
                    self.rebalance = json.loads(body or b"{}") or {"noticed": True}
                except ValueError:
                    self.rebalance = {"noticed": True}
        return None

    def run(self) -> None:
        reached, missed = False, 0
        while not self._halt.is_set():
            try:
                notice = self.check()
                reached = True
            except (OSError, ConnectionError) as exc:
                missed += 1
                # no IMDS here after FIRST_TRIES looks: not on EC2 (or it is blocked); stay quiet. One slow answer
                # (a loaded node's first look) is no reason to stop watching for the whole run
                if not reached and missed >= FIRST_TRIES:
                    log.debug("no instance metadata service at %s (%s): spot watcher off", self.base, exc)
                    self.active = False
                    return
                notice = None
            if notice:
                self.notice = notice
                return
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()


def trainer_state_step(folder: str | os.PathLike) -> int | None:
    """The global step a Trainer checkpoint's trainer_state.json records."""
    try:
        return int(json.loads((Path(folder) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError):
        return None


def optimizer_tensors(folder: str | os.PathLike) -> int | None:
    """How many parameters the checkpoint's optimizer state steps (None without an optimizer.pt)."""
    path = Path(folder) / "optimizer.pt"
    if not path.is_file():
        return None
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: counts, reads no moments
    return sum(len(g["params"]) for g in state.get("param_groups", []))


def check_resume_fits(model, folder: str | os.PathLike) -> None:
    """A checkpoint whose optimizer stepped other parameters than the model trains now fails deep in the
    Trainer ("doesn't match the size of optimizer's group"); say which run's flags to keep instead."""
    saved = optimizer_tensors(folder)
    now = sum(1 for p in model.parameters() if p.requires_grad)
    if saved is not None and saved != now:
        raise ValueError(f"XC_RESUME_FROM {folder}: its optimizer stepped {saved} parameter tensors but this job "
                         f"trains {now}; resume with the flags the run was started with (which weights are "
                         "frozen), or start it anew")


def resume_from() -> str | None:
    """XC_RESUME_FROM when it names a complete checkpoint; a partial one is an error, not a silent restart."""
    path = os.environ.get("XC_RESUME_FROM")
    if not path:
        return None
    if not (Path(path) / Checkpoints.MARKER).is_file():
        raise ValueError(f"XC_RESUME_FROM {path} is not a complete checkpoint (no {Checkpoints.MARKER} in it)")
    return path


def gather_rng_states(folder: Path, is_zero: bool) -> None:
    """Every rank's rng_state_<rank>.pth into rank 0's checkpoint: each rank writes its own on its own
    node, and only node 0's copy goes home, so without them a resume restarts the other ranks' dropout
    streams from the seed and no longer continues the run it resumes."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    rank = dist.get_rank()
    own = folder / f"rng_state_{rank}.pth"
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, (rank, own.read_bytes() if own.is_file() else None))
    if is_zero and folder.is_dir():
        for r, blob in states:
            target = folder / f"rng_state_{r}.pth"
            if blob is not None and not target.is_file():
                target.write_bytes(blob)


def spot_callback(watcher: NoticeWatcher | None = None, save_every: str | None = None):
    """A TrainerCallback: at each step boundary ONE all-reduce tells every rank whether a node got a
    notice (and which rank) and whether a periodic checkpoint is due (rank 0's clock decides)."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    mode, every = parse_save_every(save_every if save_every is not None else os.environ.get("XC_SAVE_EVERY"))
    pace = parse_pace(os.environ.get(PACE_ENV))

    class Spot(TrainerCallback):
        def __init__(self):
            self.watcher = watcher
            self.last_save = time.monotonic()
            self.last_step = time.monotonic()
            self.preempted_by: int | None = None  # the rank whose node got the notice
            self.cause: str | None = None
            self.step: int | None = None
            self.rebalance_saved = False

        def on_train_begin(self, args, state, control, **kw):
            self.last_save = self.last_step = time.monotonic()

        def on_step_end(self, args, state, control, **kw):
            if pace:
                time.sleep(max(0.0, self.last_step + pace - time.monotonic()))
                self.last_step = time.monotonic()
            rank = dist.get_rank() if dist.is_initialized() else 0
            noticed = self.watcher is not None and self.watcher.notice is not None
            group = noticed and self.watcher.notice.get("cause") == GROUP_CAUSE
            warned = self.watcher is not None and self.watcher.rebalance is not None and not self.rebalance_saved
            due = False
            if mode == "steps":
                due = state.global_step % int(every) == 0
            elif mode == "seconds" and rank == 0:
                due = time.monotonic() - self.last_save >= every
            flags = torch.tensor([rank + 1 if noticed else 0, int(due), int(warned), int(group)], dtype=torch.int64)
            if dist.is_initialized():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if flags[0] > 0:
                self.preempted_by, self.step = int(flags[0]) - 1, state.global_step
                self.cause = GROUP_CAUSE if flags[3] > 0 else SPOT_CAUSE
                control.should_save = True
                control.should_training_stop = True
            elif flags[1] > 0 or flags[2] > 0:  # a rebalance recommendation: a checkpoint now, training goes on
                if flags[2] > 0:
                    self.rebalance_saved = True
                    if rank == 0:
                        events.emit(events.RunEvent(events.REBALANCE, 0, state.global_step))
                control.should_save = True
            return control

        def on_save(self, args, state, control, **kw):
            self.last_save = time.monotonic()
            folder = Path(args.output_dir) / Checkpoints.name(state.global_step)
            gather_rng_states(folder, state.is_world_process_zero)
            if state.is_world_process_zero and folder.is_dir():  # the Trainer has finished writing it: it counts
                Checkpoints.mark_complete(folder, state.global_step)

    return Spot()


def cluster_env(path: str = CLUSTER_ENV) -> dict[str, str]:
    """KEY=VALUE lines of the node's cluster.env (cloud-init's); {} off AWS."""
    try:
        lines = Path(os.environ.get("XC_CLUSTER_ENV") or path).read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def _lifecycle_call(watcher: NoticeWatcher, call: str, client=None, **extra) -> bool:
    """One Auto Scaling call on this node's own lifecycle action (its group, hook and instance id); whether it was
    sent. Raises what the call raises; False where the node has no hook (off AWS, or from before the hook)."""
    env = cluster_env()
    group, hook = env.get("XC_ASG_NAME"), env.get("XC_LIFECYCLE_HOOK")
    if not (group and hook):
        return False
    status, body = watcher.get(INSTANCE_ID_PATH)
    if status != 200:
        return False
    if client is None:
        import boto3

        client = boto3.client("autoscaling", region_name=env.get("XC_REGION") or None,
                              endpoint_url=os.environ.get("XC_AWS_ENDPOINT_URL") or None)
    getattr(client, call)(AutoScalingGroupName=group, LifecycleHookName=hook, InstanceId=body.decode().strip(),
                          **extra)
    return True


def complete_lifecycle_action(watcher: NoticeWatcher, client=None) -> bool:
    """Tell the Auto Scaling group that this node may go (CONTINUE), so its replacement is not held back
    for the hook's whole heartbeat. Called once the notice's checkpoint is where it outlives this node.
    Returns whether it was sent; any failure only logs (the heartbeat's default result, CONTINUE, follows)."""
    try:
        return _lifecycle_call(watcher, "complete_lifecycle_action", client, LifecycleActionResult="CONTINUE")
    except Exception as exc:  # noqa: BLE001 - the hook's heartbeat ends it anyway
        log.warning("could not complete the lifecycle action of %s (%s): the group waits out the heartbeat",
                    cluster_env().get("XC_ASG_NAME"), exc)
        return False


# A group termination holds the node for the hook's heartbeat timeout (infra/nodes.py TERMINATION_HEARTBEAT_S, 300 s).
# While the notice's checkpoint uploads, the node records a heartbeat every HEARTBEAT_EVERY_S, each one restarting
# that timeout, for at most GROUP_HOLD_S in all: a bert-base checkpoint with its optimizer state (~1.3 GB) at a slow
# 10 MB/s needs ~130 s; GROUP_HOLD_S leaves room for ~10 GB. AWS ends any hold after 100 timeouts or 48 h.
HEARTBEAT_EVERY_S = 60.0
GROUP_HOLD_S = 1800.0


class LifecycleHeartbeat(threading.Thread):
    """RecordLifecycleActionHeartbeat for this node's own lifecycle action every ``every`` seconds until stopped.
    It stops by itself at the first call that fails or cannot be made (this node is not the one leaving, or the
    role lacks the action): then the hook's own timeout applies, and ``sent`` says how many went through."""

    def __init__(self, watcher: NoticeWatcher, client=None, every: float = HEARTBEAT_EVERY_S):
        super().__init__(name="lifecycle-heartbeat", daemon=True)
        self.watcher, self.client, self.every = watcher, client, every
        self.sent = 0
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                if not _lifecycle_call(self.watcher, "record_lifecycle_action_heartbeat", self.client):
                    return
            except Exception as exc:  # noqa: BLE001 - no hold to extend: the hook's timeout applies
                self.error = str(exc)
                log.info("no lifecycle heartbeat for this node (%s): the hook's own timeout applies", exc)
                return
            self.sent += 1
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()


def release_node(watcher: NoticeWatcher, rank: int, local_rank: int, durable: bool) -> bool:
    """After a group termination's checkpoint: the node's first rank lets the group take it once the checkpoint
    outlives it: in the store (durable), or on node 0 when this is another node; without a store node 0 (world
    rank 0's node, where the Trainer saves) waits out the hook's heartbeat so fab can still copy it."""
    if not (watcher.notice and watcher.notice.get("cause") == GROUP_CAUSE and local_rank == 0):
        return False
    local_size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MPI_LOCALNRANKS") or 1))
    if not durable and rank < local_size:
        return False
    return complete_lifecycle_action(watcher)
