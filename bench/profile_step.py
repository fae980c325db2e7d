"""Where the glue job's training step spends its time, by op family, with torch.profiler.

The step of bench/bert_step.py (bert-base shape, random weights, the bundled pairs' token ids, the glue job's
kernels), for one variant (default bf16w: bf16 weights with fp32 masters, the glue job's bf16 default). After warm-up
steps, --steps steps run under torch.profiler; each op's self CPU time (an op's time on the calling thread, which
waits for its OpenMP workers) is put in one family:

  matmul         mm, addmm, bmm, linear and oneDNN's own matmul ops (forward and backward)
  attention      softmax and its backward, the mask (where, masked_fill)
  layer norm     native_layer_norm and its backward
  gelu           gelu and its backward
  dropout        the jobs' dropout kernel and torch's (bernoulli, native_dropout, the mask multiply)
  optimizer      the fused AdamW step on fp32 masters, the bf16 copy back, the gradient norm (clipping)
  output block   the jobs' fused dense + dropout + residual kernel
  casts          copies and dtype conversions (autocast's casts among them)
  adds and sums  residual adds, bias gradients' sums, scaling, fills
  embedding      the embeddings' lookups and their backward
  loss           log-softmax and NLL, forward and backward
  other aten     every other aten op (views, allocations, ...)
  outside ops    the step's wall time no op accounts for: Python, autograd's engine, the framework

The jobs' own kernels (training/speed/native, called through ctypes) are timed by wrapping each call in a
record_function. Collation (the DataCollatorWithPadding-like padding of a batch) is timed apart, per batch. Prints
the CPU model and flags, the threads and the load, ms per step per family and its share, the step's MFU against the
bf16 (or fp32) matmul peak measured in the same run, and what the step would reach with matmuls alone (the ceiling
the other families leave). Last line:
    profile variant=<v> step_ms=... mfu=... matmul_share=... matmul_only_mfu=... top=<the largest non-matmul family>

    .venv/bin/python bench/profile_step.py [--variant bf16w] [--steps 6] [--warmup 3] [--batch 16] [--layers 12]
        [--threads N] [--peak-seconds 1] [--table N]   # --table: also torch's own top-N op table
Host-only like bench/bert_step.py: torch and transformers, and this checkout's bench/ and training/.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bert_step
import model_shapes
import paraphrase_ids
from glue_single_node import cpu_line, load_line, matmul_peak

FAMILIES = ("matmul", "attention", "layer norm", "gelu", "dropout", "optimizer", "output block", "casts",
            "adds and sums", "embedding", "loss", "other aten", "outside ops")
NATIVE = {"xc_dropout": "dropout", "xc_adamw": "optimizer", "xc_sumsq": "optimizer", "xc_output": "output block",
          "xc_dense": "output block"}


def family(name: str) -> str | None:
    """The family of a profiled event's name; None: not an op of its own (a wrapper whose children are counted)."""
    n = name.lower()
    if n.startswith("xc::"):
        kernel = n.removeprefix("xc::")
        return next((f for prefix, f in NATIVE.items() if kernel.startswith(prefix)), "other aten")
    if n.startswith("phase::") or not n.startswith(("aten::", "mkldnn", "onednn", "ipex")):
        return None
    op = n.split("::", 1)[1]
    if any(k in op for k in ("mm", "matmul", "linear", "baddbmm", "addbmm")) or n.startswith(("mkldnn", "onednn")):
        return "matmul"
    if "softmax" in op and "log_softmax" not in op or op in ("where", "masked_fill", "masked_fill_"):
        return "attention"
    if "layer_norm" in op:
        return "layer norm"
    if "gelu" in op:
        return "gelu"
    if "dropout" in op or "bernoulli" in op:
        return "dropout"
    if "adam" in op or "foreach" in op or "norm" in op and "layer" not in op:
        return "optimizer"
    if op in ("copy_", "_to_copy", "to", "clone", "contiguous"):
        return "casts"
    if op in ("add", "add_", "sum", "mul", "mul_", "div", "div_", "fill_", "zero_", "sub", "rsub"):
        return "adds and sums"
    if "embedding" in op or op == "index_select":
        return "embedding"
    if "log_softmax" in op or "nll_loss" in op or "cross_entropy" in op:
        return "loss"
    return "other aten"


def wrap_native() -> None:
    """Every call into training/speed/native's library runs inside record_function('xc::<function>')."""
    import torch

    from training.speed import native

    real = native.lib

    class Timed:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            fn = getattr(self._lib, name)
            if not callable(fn):
                return fn

            def call(*args):
                with torch.profiler.record_function(f"xc::{name}"):
                    return fn(*args)
            return call

    def lib(*args, **kwargs):
        found = real(*args, **kwargs)
        return None if found is None else Timed(found)

    native.lib = lib


def phases_step(run, opt, autocast: bool, enc, labels) -> float:
    """bert_step.step with its three phases named in the profile."""
    import torch

    with torch.profiler.record_function("phase::forward"), torch.autocast("cpu", dtype=torch.bfloat16,
                                                                            enabled=autocast):
        loss = run(**enc, labels=labels).loss
    with torch.profiler.record_function("phase::backward"):
        loss.backward()
    with torch.profiler.record_function("phase::optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="bf16w", help="a variant of bench/bert_step.py (default bf16w)")
    p.add_argument("--steps", type=int, default=6, help="profiled steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before the profile (each new length's first is slow)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=model_shapes.BERT_BASE.layers)
    p.add_argument("--threads", type=int, help="torch's threads (default: torch's own, one per core)")
    p.add_argument("--peak-seconds", type=float, default=1.0)
    p.add_argument("--table", type=int, default=0, help="also print torch's own table of the top N ops")
    a = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers.utils import logging

    logging.set_verbosity_error()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    wrap_native()
    shape = dataclasses.replace(model_shapes.BERT_BASE, layers=a.layers)
    # the warm-up sees every batch once, so that no profiled step is a length's first
    data = paraphrase_ids.batches(a.steps, a.batch)
    tokens = sum(int(e["attention_mask"].sum()) for e, _ in data) / len(data) / a.batch
    print(cpu_line())
    print(f"bert-base shape, {a.layers} layers, batch {a.batch}, {tokens:.0f} real tokens/sample, variant {a.variant}, "
          f"torch {torch.__version__}, {threads} threads, {load_line()}", flush=True)
    dtype = bert_step.precision(a.variant)
    peak = matmul_peak(dtype, d=shape.width, ffn=shape.ffn, seconds=a.peak_seconds)
    _, run, opt, autocast = bert_step.build(a.variant, None, a.layers)
    with bert_step.kernels(a.variant):
        for i in range(max(a.warmup, 1)):
            for enc, labels in data if i == 0 else data[:1]:
                phases_step(run, opt, autocast, enc, labels)
        walls = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for enc, labels in data:
                t = time.perf_counter()
                phases_step(run, opt, autocast, enc, labels)
                walls.append(time.perf_counter() - t)
    rows = paraphrase_ids.examples()
    t = time.perf_counter()
    for i in range(20):
        paraphrase_ids.collate(rows[i * a.batch:(i + 1) * a.batch])
    collate_ms = (time.perf_counter() - t) / 20 * 1000
    peak = max(peak, matmul_peak(dtype, d=shape.width, ffn=shape.ffn, seconds=a.peak_seconds))

    # self time per family over top-level ops only: an op inside another op's time is already in its parent's
    # total, so count each event's self time (children subtracted), which sums to the ops' total without overlap
    spent = dict.fromkeys(FAMILIES, 0.0)
    phase = {}
    for e in prof.events():
        if e.name.startswith("phase::"):
            phase[e.name[7:]] = phase.get(e.name[7:], 0.0) + e.cpu_time_total / 1e3
            continue
        f = family(e.name)
        if f is not None:
            spent[f] += e.self_cpu_time_total / 1e3
    steps = len(walls)
    wall_ms = sum(walls) * 1000 / steps
    per_step = {f: ms / steps for f, ms in spent.items()}
    per_step["outside ops"] = max(0.0, wall_ms - sum(v for f, v in per_step.items() if f != "outside ops"))
    flops = shape.flops_per_token(tokens) * tokens * a.batch
    mfu = flops / (wall_ms / 1000) / peak
    matmul_only = flops / (per_step["matmul"] / 1000) / peak if per_step["matmul"] else 0.0
    print(f"matmul peak {dtype} {peak / 1e9:.0f} GFLOP/s (FFN shape, best window before and after); "
          f"{threads} threads, {load_line()}")
    print(f"step: {wall_ms:.0f} ms median of {steps} ({1000 * statistics.median(walls):.0f} ms median step), "
          f"{a.batch / (wall_ms / 1000):.2f} samples/s, MFU {mfu:.3f}; phases per step: "
          + ", ".join(f"{k} {v / steps:.0f} ms" for k, v in phase.items()))
    print(f"{'family':<14}{'ms/step':>9}{'share':>8}")
    for f in FAMILIES:
        print(f"{f:<14}{per_step[f]:>9.1f}{per_step[f] / wall_ms:>8.1%}")
    print(f"{'collation':<14}{collate_ms:>9.1f}{'':>8}  (per batch, outside the step: the DataLoader's work)")
    print(f"matmuls alone would run the step at MFU {matmul_only:.3f} of the {dtype} peak: the ceiling the other "
          f"families leave is {per_step['matmul'] / wall_ms:.1%} of the step")
    if a.table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.table))
    top = max((f for f in FAMILIES if f != "matmul"), key=per_step.get)
    print(f"profile variant={a.variant} step_ms={wall_ms:.0f} mfu={mfu:.3f} matmul_share="
          f"{per_step['matmul'] / wall_ms:.3f} matmul_only_mfu={matmul_only:.3f} top={top.replace(' ', '_')}")


if __name__ == "__main__":
    main()
