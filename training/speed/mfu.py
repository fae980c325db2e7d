"""Model FLOPs utilisation of a training run: the Trainer's count of the model's FLOPs (6 x non-embedding
parameters x tokens, padding included, summed over ranks) per second of training, over what torch's matmul
reaches on the same cores, at the model's FFN shape and the run's precision, measured by every rank at once
right after training (so ranks sharing a node share it as they did while training).

Also the bf16-over-fp32 matmul timing that `--precision auto` rests on where AVX512-BF16 and no AMX, kept
per node (remembered_bf16_speedup); run as a script, this file prints it (launch/plan/probe.py)."""
from __future__ import annotations

import json
import os
import sys
import time

PEAK_SECONDS = 1.0
PEAK_WINDOWS = 5  # the peak is the best of these: a core shared for part of the second does not lower it
# The peak's timing costs every rank at most this share of its training time (a 10-s run times 0.5 s, not a second
# on top of its start-up), and never less than PEAK_FLOOR
PEAK_SHARE, PEAK_FLOOR = 0.05, 0.25


def peak_seconds(train_runtime: float) -> float:
    return min(PEAK_SECONDS, max(PEAK_FLOOR, PEAK_SHARE * train_runtime))


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def amx_matmuls() -> bool:
    """Whether oneDNN runs bf16 matmuls on AMX here: the CPU has it and ONEDNN_MAX_CPU_ISA caps nothing."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags() and not os.environ.get("ONEDNN_MAX_CPU_ISA")


def matmul_flops(dtype, rows: int, d: int, ffn: int, seconds: float = PEAK_SECONDS, warmup: int = 3,
                 clock=time.perf_counter) -> float:
    """FLOP/s of (rows x d) @ (d x ffn) on this process's threads, per second of `clock` (wall time; with
    time.process_time, per second of CPU the process got)."""
    import torch

    a, b = torch.randn(rows, d, dtype=dtype), torch.randn(d, ffn, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b)
    count, start = 0, clock()
    while clock() - start < seconds:
        torch.matmul(a, b)
        count += 1
    return 2 * rows * d * ffn * count / (clock() - start)


# Below this at a few rows, bf16 is emulated (no bf16 instructions reach oneDNN): at the full shape one emulated
# matmul takes seconds, and the timing would take minutes to say the same
EMULATED = 0.2


def bf16_speedup(rows: int = 2048, d: int = 768, ffn: int = 3072, rounds: int = 2, seconds: float = 0.15) -> float:
    """bf16 over fp32 matmul FLOP/s on this process's threads (BERT-base's FFN shape), the best of `rounds`
    alternating windows each: what precision auto weighs where no AMX settles it. A first look at 32 rows
    answers at once where bf16 is emulated (a CPU whose flags claim more than it has, oneDNN capped)."""
    import torch

    # per second of CPU, not of wall time: on a loaded machine a window the scheduler gave to others read bf16
    # as 0.95x fp32 where it is 2x (seen under `make test`, then remembered), and precision auto took fp32
    cpu = time.process_time
    threads = torch.get_num_threads()
    # one thread: on a loaded machine a two-thread fp32 look at 32 rows can stall on its own barriers for most of
    # the window and read as slow as emulated bf16 (seen under `make test`); one thread keeps the ratio
    torch.set_num_threads(1)
    try:
        small = (matmul_flops(torch.bfloat16, 32, d, ffn, seconds / 3, warmup=1, clock=cpu)
                 / matmul_flops(torch.float32, 32, d, ffn, seconds / 3, warmup=1, clock=cpu))
    finally:
        torch.set_num_threads(threads)
    if small < EMULATED:
        return small
    best = {torch.bfloat16: 0.0, torch.float32: 0.0}
    for _ in range(rounds):
        for dtype, top in list(best.items()):
            best[dtype] = max(top, matmul_flops(dtype, rows, d, ffn, seconds, clock=cpu))
    return best[torch.bfloat16] / best[torch.float32]


def peak_flops(dtype, rows: int, d: int, ffn: int, seconds: float = PEAK_SECONDS, windows: int = PEAK_WINDOWS) -> float:
    """The best FLOP/s of `windows` equal slices of `seconds`: what these cores reach when nothing else runs."""
    return max(matmul_flops(dtype, rows, d, ffn, seconds / windows, warmup=3 if i == 0 else 0) for i in range(windows))


def ffn_shape(config) -> tuple[int, int]:
    d = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 768
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d
    return int(d), int(ffn)


def record(results: dict, trainer, bf16: bool) -> None:
    """results['mfu'] = {model_flops_per_s, peak_flops_per_s (all ranks), mfu, ...} after trainer.train()."""
    import torch

    train = results.get("train") or {}
    flos, runtime = train.get("total_flos"), train.get("train_runtime")
    if not flos or not runtime:
        return
    d, ffn = ffn_shape(trainer.model.config)
    dtype = torch.bfloat16 if bf16 else torch.float32
    dist = torch.distributed.is_initialized()
    if dist:
        torch.distributed.barrier()  # every rank measures at the same time, as they trained
    seconds = peak_seconds(runtime)
    peak = torch.tensor([peak_flops(dtype, 2048, d, ffn, seconds)], dtype=torch.float32)  # every backend reduces fp32
    if dist:
        torch.distributed.all_reduce(peak)
    achieved = flos / runtime
    results["mfu"] = {"model_flops_per_s": achieved, "peak_flops_per_s": float(peak.item()),
                      "mfu": achieved / float(peak.item()), "peak_shape": [2048, d, ffn], "peak_seconds": seconds,
                      "precision": "bf16" if bf16 else "fp32"}


# What a node's bf16-over-fp32 answer depends on; bump METHOD when the timing above changes (2: CPU time, so that
# answers timed on a loaded machine by wall time are timed again)
METHOD = 2
CACHE_NAME = "xeon-cluster/bf16-speedup.json"


def cache_path() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), CACHE_NAME)


def cpu_identity() -> dict:
    """The CPU, its bf16-relevant flags, the cores this process may use, the torch build and oneDNN's ISA cap:
    read without importing torch, so a remembered answer costs a few milliseconds, not torch's start-up."""
    from importlib.metadata import version

    model, flags = "", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = sorted(x for x in value.split() if x.startswith(("avx512", "amx")))
    return {"method": METHOD, "cpu": model, "flags": flags, "cpus": len(os.sched_getaffinity(0)),
            "torch": version("torch"), "python": sys.prefix, "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}


KEEP = 16  # answers per file: one machine may hold several venvs, and local nodes share one home


def remembered_bf16_speedup(path: str | None = None) -> tuple[float, bool]:
    """(speedup, remembered): timed once per node and kept in ~/.cache/xeon-cluster/bf16-speedup.json under
    cpu_identity(), so every later `fab train` on that node skips torch's start-up and a second of matmuls.
    Another CPU, torch, venv or ISA cap times again; so does deleting the file."""
    path = path or cache_path()
    key = cpu_identity()
    try:
        with open(path) as f:
            entries = [e for e in json.load(f)["entries"] if isinstance(e, dict)]
    except (OSError, ValueError, KeyError, TypeError):
        entries = []
    for e in entries:
        if e.get("key") == key and isinstance(e.get("bf16_speedup"), (int, float)):
            return float(e["bf16_speedup"]), True
    speedup = bf16_speedup()
    entries = [e for e in entries if e.get("key") != key][-(KEEP - 1):]
    entries.append({"key": key, "bf16_speedup": speedup, "timed_at": time.time()})
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"entries": entries}, f, indent=1)
        os.replace(tmp, path)  # a concurrent prober never reads half a file (at worst it drops one answer)
    except OSError:  # a read-only or full home times again next run; the answer stands
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return speedup, False


if __name__ == "__main__":  # the launcher's probe sends this file to a node as `python -c`
    speedup, remembered = remembered_bf16_speedup()
    print(f"bf16_speedup={speedup:.3f} remembered={int(remembered)}")
