"""torch.compile (inductor, CPU) against eager for the glue job's training step, with compile time amortised.

The glue job's default model and step: MiniLM-L6 with a 2-label head, eager attention, fast dropout, frozen
word embeddings, bf16 autocast, fused AdamW, this process's threads. Batches are the bundled paraphrase
pairs in a seeded shuffle, padded per batch to a multiple of --multiple (so that inductor sees a few shapes,
not one per batch). Eager runs the same batches first. Reports eager's and the compiled model's steady step
time (median of the last half of the steps, every shape seen by then), the compiled run's extra time over
its steady rate (compile time, recompiles included) and the steps a run needs before compiling pays off.
Prints the CPU model and flags. Last line:
    compiled_over_eager=<steady speed ratio> compile_s=<seconds> break_even_steps=<steps, or inf>

    .venv/bin/python bench/compile_step.py [--steps 40] [--batch 16] [--multiple 32]
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from glue_single_node import cpu_line


def batches(steps: int, batch: int, multiple: int):
    import random

    import torch
    from transformers import AutoTokenizer

    from training.jobs.common import DEFAULT_MODEL, resolve_model
    from training.jobs.glue import BUNDLED

    tok = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    with (BUNDLED / "train.csv").open() as f:
        rows = list(csv.DictReader(f))
    random.Random(42).shuffle(rows)
    out = []
    for i in range(steps):
        part = rows[i * batch % len(rows):][:batch]
        enc = tok([r["sentence1"] for r in part], [r["sentence2"] for r in part], padding=True,
                  pad_to_multiple_of=multiple, max_length=128, truncation=True, return_tensors="pt")
        out.append((dict(enc), torch.tensor([int(r["label"]) for r in part])))
    return out


def step_times(compiled: bool, data) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification

    from training.jobs.common import DEFAULT_MODEL, resolve_model
    from training.speed import fastdrop

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model(DEFAULT_MODEL), num_labels=2,
                                                               attn_implementation="eager")
    fastdrop.install(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    run = torch.compile(model) if compiled else model
    times = []
    for enc, labels in data:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--multiple", type=int, default=32)
    a = p.parse_args()
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()  # the 2-label head's load report, twice
    data = batches(a.steps, a.batch, a.multiple)
    shapes = sorted({enc["input_ids"].shape[1] for enc, _ in data})
    print(cpu_line())
    print(f"glue model (MiniLM-L6), batch {a.batch}, lengths {shapes} (multiples of {a.multiple}), bf16 autocast, "
          f"fused AdamW, {torch.get_num_threads()} threads, {a.steps} steps", flush=True)
    eager = step_times(False, data)
    comp = step_times(True, data)
    half = a.steps // 2
    e_ms, c_ms = (1000 * statistics.median(t[half:]) for t in (eager, comp))
    compile_s = sum(comp) - c_ms / 1000 * a.steps
    saved = (e_ms - c_ms) / 1000
    even = compile_s / saved if saved > 0 else math.inf
    print(f"{'':<10}{'steady ms':>10}{'first step s':>13}{'total s':>9}")
    for name, t, ms in (("eager", eager, e_ms), ("compiled", comp, c_ms)):
        print(f"{name:<10}{ms:>10.0f}{t[0]:>13.1f}{sum(t):>9.1f}")
    print(f"compile time (the compiled run's excess over its steady rate): {compile_s:.1f} s; steady speed "
          f"{e_ms / c_ms:.2f}x eager; pays off after {even:.0f} steps "
          f"({even * a.batch:.0f} samples at batch {a.batch})")
    print(f"compiled_over_eager={e_ms / c_ms:.2f} compile_s={compile_s:.1f} break_even_steps={even:.0f}")


if __name__ == "__main__":
    main()
