"""The glue job's training step at bert-base shapes, variant against variant, timed interleaved in one process.

bert-base-cased's shape with random weights (bench/model_shapes.py), a 2-label head, batches of the bundled
paraphrase pairs (seeded shuffle, padded per batch), the glue job's levers (eager attention with fast dropout,
frozen word embeddings, fused AdamW). Variants:
  autocast      fp32 weights under bf16 autocast: the glue job's --bf16_weights False
  bf16w         bf16 weights with fp32 masters (training/speed/master.py) under autocast: the glue job's default in bf16
  pure          bf16 weights with fp32 masters, no autocast: layer norm, softmax and GELU in bf16 too
  fp32          fp32 weights, no autocast
  compile-<v>   the whole model torch.compile'd (inductor); use --multiple 16 or 32 to bound the recompiles
  regional-<v>  each encoder layer compiled on its own (nn.Module.compile): one graph reused 12 times
  <v>-torch     training/speed/native's kernels off for this variant: torch's own dropout, output block and AdamW step
                (what XC_NATIVE_KERNELS=0 gives a job), in the same process
  <v>-no-<k>    one kernel off (k: dropout, output, adamw; training/speed/native.KERNELS), or several: a+b
Each variant trains its own copy of the same model on the same batches; rounds of --steps steps alternate between
the variants so that the shared machine's drift hits all alike; the figure is the median step of all rounds after
the first (warm-up, compilation). MFU: the model FLOPs of the real tokens over torch's bf16 matmul at the FFN shape,
measured in the same run (best one-second window before and after). Also the step-1 loss without dropout of each
variant against autocast's (same weights, same batch). Prints the CPU model and flags and the load. Last line:
    <variant>_mfu=... (from the median step) for each variant, then best=<variant>
MFU from the best step is printed too: on a shared machine the neighbours only ever slow a step down.
    .venv/bin/python bench/bert_step.py [--variants autocast,bf16w,pure,bf16w-torch,bf16w-no-adamw,regional-bf16w] [--rounds 12] [--steps 1] [--multiple 16] [--batch 16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import model_shapes
from compile_step import batches
from glue_single_node import cpu_line, load_line, matmul_peak


def kernels(variant: str):
    """The context a variant builds and steps in: training/speed/native off for <v>-torch, one kernel off for
    <v>-no-<kernel>."""
    import contextlib

    from training.speed import native

    if variant.endswith("-torch"):
        return native.off()
    _, _, kernels = variant.partition("-no-")
    return native.off(*kernels.split("+")) if kernels else contextlib.nullcontext()


def base(variant: str) -> str:
    return variant.removeprefix("compile-").removeprefix("regional-").removesuffix("-torch").partition("-no-")[0]


def build(variant: str, state: dict | None):
    with kernels(variant):
        return _build(variant, state)


def _build(variant: str, state: dict | None):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from training.speed import fastdrop, fused, master

    s = model_shapes.BERT_BASE
    config = BertConfig(vocab_size=30522, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                        intermediate_size=s.ffn, num_labels=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    if state is not None:
        model.load_state_dict(state)
    fastdrop.install(model)
    fused.install(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    if base(variant) in ("autocast", "fp32"):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    else:
        model, (opt, _) = master.bf16_master(model, _Args(), [n for n, _ in model.named_parameters()])
    if variant.startswith("regional-"):
        for layer in model.bert.encoder.layer:
            layer.compile()
    run = torch.compile(model) if variant.startswith("compile-") else model
    return model, run, opt, base(variant) not in ("pure", "fp32")


class _Args:
    learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon = 1e-4, 0.0, 0.9, 0.999, 1e-8


def step(run, opt, autocast: bool, enc, labels) -> float:
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = run(**enc, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="autocast,bf16w,pure")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--multiple", type=int, default=1, help="pad lengths to a multiple of this (compile: 16 or 32)")
    a = p.parse_args()
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    variants = a.variants.split(",")
    data = batches(a.rounds * a.steps, a.batch, a.multiple)
    tokens = sum(int(e["attention_mask"].sum()) for e, _ in data) / len(data) / a.batch
    per_token = model_shapes.BERT_BASE.flops_per_token(tokens)
    print(cpu_line())
    print(f"bert-base shape, batch {a.batch}, {tokens:.0f} real tokens/sample, {torch.get_num_threads()} threads; "
          f"{load_line()}", flush=True)
    fp32 = any(base(v) == "fp32" for v in variants)
    peaks = {d: matmul_peak(d, d=768, ffn=3072) for d in ("bf16", "fp32")[:1 + fp32]}
    # the step-1 loss without dropout, same weights and batch, against autocast's
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    s = model_shapes.BERT_BASE
    state = BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=s.width, num_hidden_layers=s.layers,
                                                     num_attention_heads=s.heads, intermediate_size=s.ffn,
                                                     num_labels=2)).state_dict()
    losses = {}
    for v in variants:
        model, run, opt, autocast = build(v, state)
        model.eval()  # no dropout; gradients still flow
        with kernels(v):
            losses[v] = step(run, opt, autocast, *data[0])
    models = {v: build(v, state) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, float] = {}
    for r in range(a.rounds):
        for v in variants:
            _, run, opt, autocast = models[v]
            start = time.perf_counter()
            for enc, labels in data[r * a.steps:(r + 1) * a.steps]:
                with kernels(v):
                    t = time.perf_counter()
                    step(run, opt, autocast, enc, labels)
                (times[v] if r else []).append(time.perf_counter() - t)
            if not r:
                first[v] = time.perf_counter() - start
        print(f"round {r + 1}/{a.rounds}: " + " ".join(
            f"{v} {1000 * statistics.median(times[v][-a.steps:]):.0f} ms" for v in variants if r), load_line(),
            flush=True)
    for d, before in peaks.items():
        peaks[d] = max(before, matmul_peak(d, d=768, ffn=3072))
        print(f"matmul peak {d} {peaks[d] / 1e9:.0f} GFLOP/s (FFN shape, best window before and after); "
              f"{load_line()}")
    print(f"{'variant':<18}{'ms/step':>9}{'best':>6}{'worst':>7}{'samples/s':>10}{'MFU':>7}{'best MFU':>9}"
          f"{'first round s':>14}{'step-1 loss':>13}{'vs autocast':>12}")
    mfus = {}
    ref = losses.get("autocast", next(iter(losses.values())))
    for v in variants:  # an fp32 variant's MFU is over the fp32 peak, the others' over bf16's
        peak = peaks["fp32" if base(v) == "fp32" else "bf16"]
        ms = statistics.median(times[v])
        mfus[v] = per_token * tokens * a.batch / ms / peak
        best = per_token * tokens * a.batch / min(times[v]) / peak
        print(f"{v:<18}{1000 * ms:>9.0f}{1000 * min(times[v]):>6.0f}{1000 * max(times[v]):>7.0f}"
              f"{a.batch / ms:>10.2f}{mfus[v]:>7.3f}{best:>9.3f}{first[v]:>14.1f}{losses[v]:>13.5f}"
              f"{abs(losses[v] - ref) / abs(ref):>12.1e}")
    print(" ".join(f"{v}_mfu={m:.3f}" for v, m in mfus.items()) + f" best={max(mfus, key=mfus.get)}")


if __name__ == "__main__":
    main()
