"""One bf16 training step of the glue model, eager (matmul) attention against sdpa, per sequence length.

MiniLM-L6 with a 2-label head, a batch of the bundled paraphrase pairs padded to each length, bf16
autocast, fused AdamW, this process's threads; the mean of 10 steps after 3 warm-up steps, eager and
sdpa measured alternately. This is what training/jobs/glue.py's `--attn_implementation auto` rests on
(eager up to 128 tokens, sdpa beyond). Prints the CPU model and flags. Last line:
    eager_over_sdpa=<speed ratio at 128 tokens>

    .venv/bin/python bench/attention_step.py [--lengths 64,128,256,384] [--batch 16]
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from glue_single_node import cpu_line


def step_ms(attn: str, length: int, batch: int, steps: int = 10) -> float:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from training.jobs.common import DEFAULT_MODEL, resolve_model
    from training.jobs.glue import BUNDLED

    path = resolve_model(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, attn_implementation=attn)
    with (BUNDLED / "train.csv").open() as f:
        rows = list(csv.DictReader(f))[:batch]
    enc = tok([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], padding="max_length",
              max_length=length, truncation=True, return_tensors="pt")
    labels = torch.tensor([int(r["label"]) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def one():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        one()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="64,128,256,384")
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    import torch

    print(cpu_line())
    print(f"glue model (MiniLM-L6), batch {a.batch}, bf16 autocast, fused AdamW, {torch.get_num_threads()} threads")
    print(f"{'tokens':>7}{'sdpa ms':>10}{'eager ms':>10}{'eager over sdpa':>17}")
    ratios = {}
    for length in (int(x) for x in a.lengths.split(",")):
        sdpa, eager = step_ms("sdpa", length, a.batch), step_ms("eager", length, a.batch)
        ratios[length] = sdpa / eager
        print(f"{length:>7}{sdpa:>10.0f}{eager:>10.0f}{ratios[length]:>16.2f}x", flush=True)
    print(f"eager_over_sdpa={ratios.get(128, float('nan')):.2f}")


if __name__ == "__main__":
    main()
