"""MPI rank variables -> torch.distributed, with the backend and precision the node really has.

Intel MPI's hydra sets PMI_RANK / PMI_SIZE / MPI_LOCALRANKID; Open MPI sets OMPI_COMM_WORLD_*;
torchrun sets RANK / WORLD_SIZE / LOCAL_RANK. The launcher passes MASTER_ADDR / MASTER_PORT and
XC_BACKEND / XC_PRECISION (auto | ccl | gloo, auto | bf16 | fp32).
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
import socket
from dataclasses import dataclass

from training.runtime import startup
from training.runtime.wire import COMM_HOOKS
from training.speed import mfu

log = logging.getLogger(__name__)

_RANK_VARS = {
    "rank": ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"),
    "world": ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"),
    "local": ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"),
}


def _first(env, names, default):
    for n in names:
        if env.get(n, "") != "":
            return int(env[n])
    return default


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str  # what torch.distributed reports, or "none" for a single process
    precision: str  # "bf16" or "fp32"
    ipex: bool
    host: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def summary(self) -> str:
        threads = os.environ.get("OMP_NUM_THREADS", "?")
        try:
            cpus = sorted(os.sched_getaffinity(0))
            contiguous = len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1))
            cpus_s = f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
        except (AttributeError, OSError):
            cpus_s = "?"
        return (f"rank {self.rank}/{self.world_size} local {self.local_rank} on {self.host}: backend={self.backend} "
                f"precision={self.precision} ipex={'yes' if self.ipex else 'no'} threads={threads} cpus={cpus_s}")


def rank_env(env=None) -> tuple[int, int, int]:
    env = os.environ if env is None else env
    return (_first(env, _RANK_VARS["rank"], 0), _first(env, _RANK_VARS["world"], 1),
            _first(env, _RANK_VARS["local"], 0))


def resolve_precision(requested: str | None = None) -> str:
    """auto: bf16 where AMX runs the matmuls; where only AVX512-BF16 (or oneDNN capped below AMX) would,
    bf16 only if its matmul is measured faster than fp32's (the lowest of all ranks' figures, so they agree)."""
    requested = (requested or os.environ.get("XC_PRECISION") or "auto").lower()
    if requested not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision {requested!r} is not one of auto, bf16, fp32")
    if requested != "auto":
        return requested
    import torch
    import torch.distributed as tdist

    flags = mfu.cpu_flags()
    if not ({"amx_bf16", "avx512_bf16"} & flags):
        speedup = 0.0
    elif mfu.amx_matmuls():
        speedup = float("inf")  # AMX: 8x fp32's matmul on Sapphire Rapids (README), not worth a second of measuring
    else:
        speedup = mfu.bf16_speedup()
    agreed = torch.tensor([speedup], dtype=torch.float64)
    if tdist.is_initialized():  # every rank takes part, whatever its CPU, and all pick the same
        tdist.all_reduce(agreed, op=tdist.ReduceOp.MIN)
    return "bf16" if agreed.item() >= 1.0 else "fp32"


def ccl_local_pair(local: int, env) -> None:
    """oneCCL without its own launcher reads a rank's place on its node only from the pair
    CCL_LOCAL_RANK + CCL_LOCAL_SIZE; with one of them missing it counts ranks per hostname, which
    breaks where nodes share a hostname (containers, the local cluster)."""
    size = env.get("CCL_LOCAL_SIZE") or next(
        (env[k] for k in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE") if env.get(k)), None)
    if size is not None:
        env.setdefault("CCL_LOCAL_SIZE", str(size))
        env.setdefault("CCL_LOCAL_RANK", str(local))


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def setup(backend: str | None = None, precision: str | None = None, timeout_s: int | None = None) -> DistInfo:
    """Export the torch.distributed variables from the MPI ones and init the process group."""
    import torch.distributed as dist

    rank, world, local = rank_env()
    if world > 1:  # with a world of one, leave no hint that would make accelerate wrap DDP
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    want = (backend or os.environ.get("XC_BACKEND") or "auto").lower()
    if want not in ("auto", "ccl", "gloo"):
        raise ValueError(f"backend {want!r} is not one of auto, ccl, gloo")
    if want in ("auto", "ccl"):
        if have("oneccl_bindings_for_pytorch"):
            ccl_local_pair(local, env=os.environ)
            importlib.import_module("oneccl_bindings_for_pytorch")  # registers the "ccl" backend
            want = "ccl"
        elif want == "ccl":
            raise RuntimeError("backend ccl requested but oneccl_bindings_for_pytorch is not installed; "
                               "use the 'oneccl' profile ('fab setup --profile oneccl') or --backend gloo")
        else:
            want = "gloo"
    got = "none"
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s or int(os.environ.get("XC_DIST_TIMEOUT", "300")))
        dist.init_process_group(backend=want, rank=rank, world_size=world, timeout=timeout)
        startup.hold()  # the rank hook settled at the group; the model's and the Trainer's imports are still ahead
    if dist.is_initialized():
        got = dist.get_backend()
    info = DistInfo(rank=rank, world_size=world, local_rank=local, backend=got,
                    precision=resolve_precision(precision), ipex=have("intel_extension_for_pytorch"),
                    host=os.environ.get("XC_NODE") or socket.gethostname())
    print(info.summary(), flush=True)  # every rank: one start-up line for the operator
    return info


def optimize_with_ipex(model, optimizer, info: DistInfo):
    """ipex.optimize when IPEX is installed (transformers no longer wires it)."""
    if not info.ipex:
        return model, optimizer
    import intel_extension_for_pytorch as ipex
    import torch

    dtype = torch.bfloat16 if info.precision == "bf16" else torch.float32
    return ipex.optimize(model, optimizer=optimizer, dtype=dtype)


def compress_hook(dtype):
    """A DDP communication hook: each bucket goes on the wire as `dtype`, already divided by the world size,
    and comes back as fp32. torch's own bf16 hook refuses every backend but NCCL and XCCL by its name, while
    gloo reduces bf16 as well (and oneCCL does)."""
    import torch
    import torch.distributed as tdist

    def hook(process_group, bucket):
        group = process_group if process_group is not None else tdist.group.WORLD
        buffer = bucket.buffer()
        wire = buffer.to(dtype).div_(group.size())
        fut = tdist.all_reduce(wire, group=group, async_op=True).get_future()

        def back(f):
            return buffer.copy_(f.value()[0])

        return fut.then(back)

    hook.__name__ = hook.__qualname__ = f"xc_{torch.finfo(dtype).dtype}_wire_hook"
    return hook


def comm_hook(trainer) -> str:
    """How DDP will move gradients, set before the Trainer wraps the model: compression on the wire,
    XC_COMM_HOOK (fab train --comm-hook: half the bytes of fp32 per all-reduce; the optimizer still steps on
    fp32 gradients), and gradients kept in DDP's buckets unless XC_BUCKET_VIEW=0."""
    name = os.environ.get("XC_COMM_HOOK", "none") or "none"
    if name not in COMM_HOOKS:
        raise ValueError(f"XC_COMM_HOOK={name!r} is not one of {', '.join(COMM_HOOKS)}; pass --comm-hook with one of them")
    handler = trainer.accelerator.ddp_handler
    if handler is None:  # a single process: nothing is wrapped
        return name
    import dataclasses

    fields = {f.name: getattr(handler, f.name) for f in dataclasses.fields(handler)}
    # the gradients live in DDP's buckets: no copy of every gradient into them and back out each step
    fields["gradient_as_bucket_view"] = os.environ.get("XC_BUCKET_VIEW", "1") != "0"
    if name == "none":
        trainer.accelerator.ddp_handler = type(handler)(**fields)
        return name
    import torch

    hook = compress_hook({"fp16": torch.float16, "bf16": torch.bfloat16}[name])

    class WireHook(type(handler)):  # accelerate registers it when it wraps the model, in trainer.train()
        def register_comm_hook(self, model):
            model.register_comm_hook(None, hook)

    trainer.accelerator.ddp_handler = WireHook(**fields)
    return name


def ddp_stats(trainer) -> dict | None:
    """DDP's own timings of the steps it sampled (the first 10, then every 100th), in ms: forward, backward
    compute, all-reduce, and how much of the all-reduce overlapped the backward pass; `comm_exposed_ms` is
    the part the step waited for. None outside DDP, or where torch no longer offers the figures."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer, "model_wrapped", None)
    if not isinstance(model, DistributedDataParallel):
        return None
    try:
        data = model._get_ddp_logging_data()
    except Exception:  # noqa: BLE001 - a private API: its absence costs the figures, not the run
        return None
    keys = {"forward_ms": "avg_forward_compute_time", "backward_compute_ms": "avg_backward_compute_time",
            "comm_ms": "avg_backward_comm_time", "overlap_ms": "avg_backward_compute_comm_overlap_time"}
    out = {k: data[v] / 1e6 for k, v in keys.items() if isinstance(data.get(v), (int, float))}
    if len(out) < len(keys):
        return None
    out["comm_exposed_ms"] = max(0.0, out["comm_ms"] - out["overlap_ms"])
    out["bucket_sizes"] = data.get("bucket_sizes")
    out["comm_hook"] = data.get("comm_hook")
    out["gradient_as_bucket_view"] = bool(model.gradient_as_bucket_view)
    return out


def ready_for_ddp(trainer) -> bool:
    """Let accelerate wrap the model in DDP after an evaluation ran first (clm's step-0 loss): accelerate 1.15
    (accelerator.py prepare_model) marks a model prepared also for evaluation_mode=True, as the Trainer's
    evaluation_loop asks, and its training prepare then returns it unwrapped: every rank trains its own copy,
    no gradient is all-reduced, and the logged loss (a mean over ranks) hides it. True when cleared."""
    model = trainer.model
    if trainer.model_wrapped is model and getattr(model, "_is_accelerate_prepared", False):
        model._is_accelerate_prepared = False
        return True
    return False
