"""IPEX measured: the glue job's training step (BERT-layout classifier, batch x tokens of the paraphrase data's
length, AdamW, one optimizer step each) at MiniLM-L6's and bert-base's shapes, with and without
`ipex.optimize`, fp32 and bf16, under torch 2.8.0 (+ intel-extension-for-pytorch 2.8.0) and under the
project's torch 2.13.0, on the same CPU, configurations interleaved round by round so drift hits all alike.

IPEX 2.8.0 needs torch 2.8.*, so it lives in a venv outside the repository (docs/ipex.md):
    python3 -m venv /work/ipex-venv
    /work/ipex-venv/bin/pip install torch==2.8.0 intel-extension-for-pytorch==2.8.0 transformers==5.23.0
    .venv/bin/python bench/ipex_step.py --other /work/ipex-venv/bin/python [--rounds 3] [--steps 4]
The driver runs every configuration as its own process (`--one ...`): samples/s is batch over the median
step time of --steps timed steps after two warm-up steps; the best round of each is kept. Prints the CPU
line and the machine's load with every figure, and last:  ipex_best=<best IPEX samples/s over the best
without IPEX, any torch, same shape and precision>.  Writes bench/results/ipex_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"minilm": (6, 384, 12, 1536), "bert-base": (12, 768, 12, 3072)}  # layers, width, heads, FFN


def one(shape: str, precision: str, use_ipex: bool, batch: int, tokens: int, steps: int) -> dict:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    layers, width, heads, ffn = SHAPES[shape]
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=ffn, num_labels=2, attn_implementation="eager")
    model = BertForSequenceClassification(config).train()
    model.get_input_embeddings().weight.requires_grad_(False)  # the job's default
    params = [p for p in model.parameters() if p.requires_grad]
    bf16 = precision == "bf16"
    if use_ipex:
        import intel_extension_for_pytorch as ipex

        optimizer = torch.optim.AdamW(params, lr=1e-4)
        model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=torch.bfloat16 if bf16 else torch.float32)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(1000, 29000, (batch, tokens))
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (batch,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"torch": torch.__version__, "ipex": use_ipex, "shape": shape, "precision": precision,
            "samples_per_second": batch / statistics.median(times), "step_s": statistics.median(times),
            "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", help="python of the venv with torch 2.8.0 and intel-extension-for-pytorch 2.8.0")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=65, help="the paraphrase data's mean length")
    p.add_argument("--shapes", default="minilm,bert-base")
    p.add_argument("--one", nargs=3, metavar=("SHAPE", "PRECISION", "IPEX"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        shape, precision, use_ipex = a.one
        print(json.dumps(one(shape, precision, use_ipex == "1", a.batch, a.tokens, a.steps)))
        return
    if not a.other:
        raise SystemExit("error: --other is missing; pass the python of the IPEX venv (docs/ipex.md)")
    sys.path.insert(0, str(ROOT / "bench"))
    from glue_single_node import cpu_line

    pythons = [("torch 2.13.0", sys.executable, False), ("torch 2.8.0", a.other, False),
               ("torch 2.8.0 + ipex.optimize", a.other, True)]
    best: dict[tuple, dict] = {}
    for round_ in range(a.rounds):
        for shape in a.shapes.split(","):
            for precision in ("fp32", "bf16"):
                for label, python, use_ipex in pythons:
                    cmd = [python, __file__, "--one", shape, precision, "1" if use_ipex else "0",
                           "--steps", str(a.steps), "--batch", str(a.batch), "--tokens", str(a.tokens)]
                    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    if res.returncode != 0:
                        raise SystemExit(f"error: {label} {shape} {precision} failed:\n{res.stderr[-2000:]}")
                    r = json.loads(res.stdout.strip().splitlines()[-1])
                    print(f"round {round_ + 1}: {shape:<10}{precision:<6}{label:<30}{r['samples_per_second']:8.2f} "
                          f"samples/s  (torch {r['torch']}, load {r['load']:.2f})", flush=True)
                    key = (shape, precision, label)
                    if key not in best or r["samples_per_second"] > best[key]["samples_per_second"]:
                        best[key] = {**r, "label": label}
    print(f"\n{cpu_line()}; batch {a.batch} x {a.tokens} tokens, AdamW (fused without IPEX), eager attention, "
          f"best of {a.rounds} round(s), median of {a.steps} steps")
    print(f"{'shape':<11}{'precision':<10}" + "".join(f"{label:>30}" for label, _, _ in pythons) + f"{'ipex / best other':>20}")
    ratios = []
    for shape in a.shapes.split(","):
        for precision in ("fp32", "bf16"):
            sps = [best[(shape, precision, label)]["samples_per_second"] for label, _, _ in pythons]
            ratio = sps[2] / max(sps[:2])
            ratios.append(ratio)
            print(f"{shape:<11}{precision:<10}" + "".join(f"{x:>30.2f}" for x in sps) + f"{ratio:>19.2f}x")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ipex_step.json").write_text(json.dumps({"cpu": cpu_line(), "rows": list(best.values()),
                                                     "batch": a.batch, "tokens": a.tokens}, indent=2))
    print(f"ipex_best={max(ratios):.2f}")


if __name__ == "__main__":
    main()
