"""The glue job's training step at bert-base shapes, variant against variant, timed interleaved in one process.

bert-base-cased's shape with random weights (bench/model_shapes.py), a 2-label head, batches of the bundled
paraphrase pairs (seeded shuffle, padded per batch; the glue job's token ids from bench/paraphrase_ids.json, no
tokenizer download), the glue job's levers (eager attention with fast dropout, frozen word embeddings, fused AdamW).
Variants:
  autocast      fp32 weights under bf16 autocast: the glue job's --bf16_weights False
  bf16w         bf16 weights with fp32 masters (training/speed/master.py) under autocast: the glue job's default in bf16
  pure          bf16 weights with fp32 masters, no autocast: layer norm, softmax and GELU in bf16 too
  fp32          fp32 weights, no autocast
  compile-<v>   the whole model torch.compile'd (inductor); use --multiple 16 or 32 to bound the recompiles
  regional-<v>  each encoder layer compiled on its own (nn.Module.compile): one graph reused 12 times
  <v>-sdpa      torch's scaled_dot_product_attention (its fused CPU kernels) instead of the jobs' eager attention
  <v>-torch     training/speed/native's kernels off for this variant: torch's own dropout, output block and AdamW step
                (what XC_NATIVE_KERNELS=0 gives a job), in the same process
  <v>-no-<k>    one kernel off (k: dropout, output, adamw; training/speed/native.KERNELS), or several: a+b
Default: bf16w, autocast and fp32 where the CPU has bf16 instructions (AMX or AVX512-BF16), else fp32 alone (bf16
without them is emulated: minutes a step).
Each variant trains its own copy of the same model on the same batches; rounds of --steps steps alternate between
the variants so that the shared machine's drift hits all alike; the figure is the median step of all rounds after
the first (warm-up, compilation). MFU: the model FLOPs of the real tokens over torch's matmul at the FFN shape in the
variant's precision (bf16's or fp32's), measured in the same run (best window before and after). The MFUs of two
precisions are over two different peaks (fp32's is a quarter of bf16's on AMX), so the variants are ranked by
samples per second, the figure a user buys: an fp32 variant can show the higher MFU at half the speed. Also the
step-1 loss without dropout of each variant against autocast's (same weights, same batch). Then (--loop-steps) the
fastest variant in a short glue-job-like loop: the Trainer's length-grouped sampler and a DataLoader with the job's
padding collation around the step, gradient clipping at 1.0 and a linear learning-rate schedule, the loss read
every 10 steps; it prints the loop's samples/s and the share of its time outside the step (the Trainer's own
callbacks and logging are not in it: bench/glue_single_node.py times the real job). Prints the CPU model and flags,
the threads and the load with every figure. Last line:
    <variant>_samples_per_s=... <variant>_mfu=... (from the median step) for each variant, threads=<n>,
    then best=<the variant with the most samples per second>
MFU from the best step is printed too: on a shared machine the neighbours only ever slow a step down.

    .venv/bin/python bench/bert_step.py [--variants autocast,bf16w,pure,bf16w-torch,bf16w-no-adamw,regional-bf16w]
        [--rounds 12] [--steps 1] [--multiple 16] [--batch 16] [--loop-steps 20] [--layers 12] [--peak-seconds 1]

Host-only: it needs nothing but torch and transformers (numpy comes with transformers; gcc builds
training/speed/native's kernels, and without it every variant runs torch's ops and the kernels line says so), no
project venv and no hub connection. From a checkout, or a copy of just its bench/ and training/ folders (the kernels
under test and the bundled data), on any host, with any python that has them:
    python3 bench/bert_step.py
(--threads N for fewer threads than torch's default; --layers 2 --batch 4 --rounds 2 --loop-steps 4
--peak-seconds 0.1 is a smoke run in seconds.)
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

import model_shapes
import paraphrase_ids
from glue_single_node import cpu_line, load_line, matmul_peak

LOG_EVERY = 10  # the glue job's logging_steps: the loss is read (a sync) every 10 steps in the loop


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
    return (variant.removeprefix("compile-").removeprefix("regional-").removesuffix("-sdpa").removesuffix("-torch")
            .partition("-no-")[0])


def precision(variant: str) -> str:
    """The peak a variant's MFU is over: fp32's for fp32 variants, bf16's for the others."""
    return "fp32" if base(variant) == "fp32" else "bf16"


def best(rows: dict[str, dict]) -> str:
    """The variant a user would pick: the most samples per second. Not the highest MFU: each variant's MFU is over
    its own precision's matmul peak, and fp32's peak is a fraction of bf16's, so on an AMX host fp32 showed 0.57
    against bf16w's 0.37 while bf16w trained 2.4x the samples per second."""
    return max(rows, key=lambda v: rows[v]["samples_per_s"])


def summary(rows: dict[str, dict], threads: int) -> str:
    """The bench's last line: each variant's samples/s and MFU, the threads, then best=<fastest variant>."""
    return " ".join(f"{v}_samples_per_s={r['samples_per_s']:.2f} {v}_mfu={r['mfu']:.3f}" for v, r in rows.items()) \
        + f" threads={threads} best={best(rows)}"


def config(layers: int, attention: str = "eager"):
    from transformers import BertConfig

    s = model_shapes.BERT_BASE
    return BertConfig(vocab_size=30522, hidden_size=s.width, num_hidden_layers=layers, num_attention_heads=s.heads,
                      intermediate_size=s.ffn, num_labels=2, attn_implementation=attention)


def build(variant: str, state: dict | None, layers: int = model_shapes.BERT_BASE.layers):
    with kernels(variant):
        return _build(variant, state, layers)


def _build(variant: str, state: dict | None, layers: int):
    import torch
    from transformers import BertForSequenceClassification

    from training.speed import fastdrop, fused, master

    torch.manual_seed(0)
    # <v>-sdpa: torch's scaled_dot_product_attention (its fused CPU kernels) instead of the jobs' eager attention
    model = BertForSequenceClassification(config(layers, "sdpa" if variant.endswith("-sdpa") else "eager"))
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


def job_loop(variant: str, built, batch: int, steps: int, multiple: int) -> dict:
    """`steps` steps of the variant as the glue job's Trainer loop takes them: the Trainer's length-grouped sampler
    over the bundled pairs, a DataLoader collating each batch (padding, masks), the step with the Trainer's gradient
    clipping (max_grad_norm 1.0; MasterAdamW's own clip where the glue job attaches it), a linear learning-rate
    schedule, the loss summed on the tensor and read every LOG_EVERY steps. The same batches run twice, the first
    pass untimed: each new length's first step is slow (oneDNN makes its kernels), which a job pays once per length
    and a 20-step loop would pay at most steps. Returns samples/s of the timed loop and of its steps alone."""
    import functools

    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from training.speed import master

    model, run, opt, autocast = built
    data = paraphrase_ids.examples()
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()

    def one_pass() -> tuple[float, float]:
        sampler = LengthGroupedSampler(batch, lengths=[len(ids) for ids, _, _ in data],
                                       generator=torch.Generator().manual_seed(42))
        loader = torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True,
                                             collate_fn=functools.partial(paraphrase_ids.collate, multiple=multiple))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / steps))
        done, in_step, total = 0, 0.0, torch.zeros(())
        start = time.perf_counter()
        while done < steps:
            for enc, labels in loader:
                t = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = run(**enc, labels=labels).loss
                loss.backward()
                if isinstance(opt, master.MasterAdamW):
                    opt.clip_grad_norm(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                total += loss.detach()
                done += 1
                if done % LOG_EVERY == 0 or done == steps:
                    total.item()
                in_step += time.perf_counter() - t
                if done == steps:
                    break
        return time.perf_counter() - start, in_step

    with kernels(variant):
        one_pass()
        for group in opt.param_groups:  # the first pass's schedule ended at 0
            group["lr"] = group["initial_lr"]
        wall, in_step = one_pass()
    return {"samples_per_s": steps * batch / wall, "step_samples_per_s": steps * batch / in_step,
            "outside": 1 - in_step / wall, "wall_s": wall}


def default_variants() -> str:
    from training.speed.mfu import cpu_flags

    return "bf16w,autocast,fp32" if {"amx_bf16", "avx512_bf16"} & cpu_flags() else "fp32"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", help="comma-separated; default bf16w,autocast,fp32 on a CPU with bf16 "
                   "instructions, fp32 elsewhere")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--multiple", type=int, default=1, help="pad lengths to a multiple of this (compile: 16 or 32)")
    p.add_argument("--loop-steps", type=int, default=20, help="steps of the glue-job-like loop (0: none)")
    p.add_argument("--layers", type=int, default=model_shapes.BERT_BASE.layers,
                   help="encoder layers (bert-base: 12; fewer for a smoke run)")
    p.add_argument("--peak-seconds", type=float, default=1.0, help="each of the matmul peak's 3 windows")
    p.add_argument("--threads", type=int, help="torch's threads (default: torch's own, one per core)")
    a = p.parse_args()
    if a.rounds < 2:
        p.error("--rounds must be at least 2: the first round is warm-up and is not counted")
    if not (ROOT / "training" / "speed").is_dir():
        raise SystemExit(f"{ROOT / 'training'} is missing: this bench times the glue job's kernels "
                         "(training/speed) on the bundled data (training/jobs/data); copy training/ beside bench/")
    import torch
    from transformers.utils import logging

    from training.speed import native

    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()

    def where() -> str:
        return f"{threads} threads, {load_line()}"

    logging.set_verbosity_error()
    variants = (a.variants or default_variants()).split(",")
    shape = dataclasses.replace(model_shapes.BERT_BASE, layers=a.layers)
    data = paraphrase_ids.batches(a.rounds * a.steps, a.batch, a.multiple)
    tokens = sum(int(e["attention_mask"].sum()) for e, _ in data) / len(data) / a.batch
    per_token = shape.flops_per_token(tokens)
    print(cpu_line())
    layers = "" if a.layers == model_shapes.BERT_BASE.layers else f" with {a.layers} of its 12 layers"
    print(f"bert-base shape{layers}, batch {a.batch}, {tokens:.0f} real tokens/sample, torch {torch.__version__}, "
          f"{where()}", flush=True)
    peaks = {d: matmul_peak(d, d=shape.width, ffn=shape.ffn, seconds=a.peak_seconds)
             for d in sorted({precision(v) for v in variants})}
    # the step-1 loss without dropout, same weights and batch, against autocast's
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    state = BertForSequenceClassification(config(a.layers)).state_dict()
    losses = {}
    for v in variants:
        model, run, opt, autocast = build(v, state, a.layers)
        model.eval()  # no dropout; gradients still flow
        with kernels(v):
            losses[v] = step(run, opt, autocast, *data[0])
    print(f"native kernels: {'built' if native.lib() is not None else native.why()}", flush=True)
    models = {v: build(v, state, a.layers) for v in variants}
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
        print(f"round {r + 1}/{a.rounds}: " + (" ".join(
            f"{v} {1000 * statistics.median(times[v][-a.steps:]):.0f} ms" for v in variants) if r else
            "warm-up, not counted;"), where(), flush=True)
    for d, before in peaks.items():
        peaks[d] = max(before, matmul_peak(d, d=shape.width, ffn=shape.ffn, seconds=a.peak_seconds))
        print(f"matmul peak {d} {peaks[d] / 1e9:.0f} GFLOP/s (FFN shape, best window before and after); {where()}")
    print(f"{'variant':<18}{'ms/step':>9}{'best':>6}{'worst':>7}{'samples/s':>10}{'MFU':>7}{'of peak':>8}"
          f"{'best MFU':>9}{'first round s':>14}{'step-1 loss':>13}{'vs autocast':>12}   ({threads} threads)")
    rows = {}
    ref = losses.get("autocast", next(iter(losses.values())))
    for v in variants:  # an fp32 variant's MFU is over the fp32 peak, the others' over bf16's
        peak = peaks[precision(v)]
        ms = statistics.median(times[v])
        rows[v] = {"samples_per_s": a.batch / ms, "mfu": per_token * tokens * a.batch / ms / peak}
        best_mfu = per_token * tokens * a.batch / min(times[v]) / peak
        print(f"{v:<18}{1000 * ms:>9.0f}{1000 * min(times[v]):>6.0f}{1000 * max(times[v]):>7.0f}"
              f"{rows[v]['samples_per_s']:>10.2f}{rows[v]['mfu']:>7.3f}{precision(v):>8}{best_mfu:>9.3f}"
              f"{first[v]:>14.1f}{losses[v]:>13.5f}{abs(losses[v] - ref) / abs(ref):>12.1e}")
    fastest = best(rows)
    if a.loop_steps:
        loop = job_loop(fastest, models[fastest], a.batch, a.loop_steps, a.multiple)
        print(f"glue-job-like loop, {fastest}, {a.loop_steps} steps (length-grouped sampler, collation, clipping, "
              f"schedule): {loop['samples_per_s']:.2f} samples/s, its steps alone {loop['step_samples_per_s']:.2f}; "
              f"{loop['outside']:.0%} of its time outside the step; {where()}")
    print(summary(rows, threads))


if __name__ == "__main__":
    main()
