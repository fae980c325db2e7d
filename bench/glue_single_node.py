"""Single-node samples/s of the glue job's default path against the manual recipe.

Same model (MiniLM-L6 by default; --model-shape bert-base or gpt2, the manual recipe's own, from a config with random
weights: bench/model_shapes.py), same data (the bundled paraphrase set; gpt2: the clm job on the bundled
corpus in blocks of 1024 tokens), same machine, run side by side:
  manual      pad every example to 128 tokens, fp32, torch's default threads, torch's dropout: the blog recipe
  dynamic     per-batch padding to the longest example, length grouping, fp32
  default     the job's default: dynamic padding, precision auto (bf16 on AMX; with AVX512-BF16 alone, or
              oneDNN capped below AMX, bf16 only where its matmuls time faster than fp32's)
  default-16  the default with lengths rounded up to a multiple of 16
Prints, for every config: samples/s, real tokens/s, MFU (model FLOPs per second of the real tokens
over this machine's matmul throughput at the model's shapes and the config's precision, measured in
the same run: the best one-second window before and after the runs), eval accuracy and F1 after the
same epochs on the same data (mean over --seeds), the ratios to the manual recipe; then the bound on
what padding alone can give (padded tokens / real tokens) and the CPU model and flags, and the matmul
ceiling: the MFU of the model's own matmuls alone at the default's shapes (what the step would reach
if nothing else took time). Last line:
    mfu=<default's MFU> ratio=<default vs manual samples/s> acc_delta=<default minus manual eval accuracy>
    (gpt2: then loss_delta=<|step-1 loss of the default minus the previous path|>, exit 1 above 1e-3)
Writes bench/results/glue_single_node.json (-<shape> and -<isa> added to the name for --model-shape and
--onednn-max-isa). Every figure line carries the machine's load (uptime): the machine may be shared.
Accuracy means something only on minilm (real weights); the other shapes time the step.

    .venv/bin/python bench/glue_single_node.py [--samples 800] [--epochs 2] [--batch 16] [--levers fused-adamw,...]
        [--onednn-max-isa AVX512_CORE_BF16]     # matmuls without AMX on a Sapphire Rapids: the no-AMX target
        [--model-shape bert-base|gpt2]          # the manual recipe's models (gpt2: 16 samples, 1 epoch, the
                                                # largest batch up to 16 that fits memory)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import memory_fit
import model_shapes

CONFIGS = {
    # torch's dropout and every weight trained, as the manual recipe has
    "manual": (["--pad_to_max_length", "True", "--fast_dropout", "False", "--freeze_embeddings", "False"], "fp32"),
    "dynamic": ([], "fp32"),
    "default": ([], "auto"),
    "default-16": (["--pad_to_multiple_of", "16"], "auto"),
}
# oneDNN's names for ONEDNN_MAX_CPU_ISA; it ignores any other value without a word
ONEDNN_ISAS = ["SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
               "AVX10_1_512_AMX_FP16", "ALL"]
# Levers on the default path, measured with --levers (each alone, against "default" in the same run)
MALLOC = {"jemalloc": "/lib/x86_64-linux-gnu/libjemalloc.so.2", "tcmalloc": "/lib/x86_64-linux-gnu/libtcmalloc.so.4"}
# levers that are environment variables of the job
LEVER_ENV = {"no-native-kernels": {"XC_NATIVE_KERNELS": "0"}}  # torch's ops where training/speed/native has kernels
LEVERS = {
    "bf16": ([], "bf16"),  # bf16 autocast whatever auto picks
    "sdpa": (["--attn_implementation", "sdpa"], "auto"),
    "bf16-weights": (["--bf16_weights", "True"], "auto"),  # the default (auto) where bf16 trains
    "autocast": (["--bf16_weights", "False"], "auto"),  # fp32 weights cast by autocast each step: the old default
    "torch-dropout": (["--fast_dropout", "False"], "auto"),
    "foreach-adamw": (["--optim", "adamw_torch"], "auto"),
    "batch-32": (["--per_device_train_batch_size", "32"], "auto"),
    "batch-64": (["--per_device_train_batch_size", "64"], "auto"),
    # the learning rate scaled with the batch (linear rule), so that fewer steps still move as far
    "batch-32-lr": (["--per_device_train_batch_size", "32", "--learning_rate", "2e-4"], "auto"),
    "batch-64-lr": (["--per_device_train_batch_size", "64", "--learning_rate", "4e-4"], "auto"),
    "freeze-embeddings": (["--freeze_embeddings", "True"], "auto"),  # the default since it was measured here
    "trained-embeddings": (["--freeze_embeddings", "False"], "auto"),
    "compile": (["--torch_compile", "True", "--pad_to_multiple_of", "32"], "auto"),
    "fused-adamw": (["--optim", "adamw_torch_fused"], "auto"),  # the Trainer's own default in transformers 5
    "eager": (["--attn_implementation", "eager"], "auto"),
    "fp32": ([], "fp32"),
    "no-native-kernels": ([], "auto"),  # AdamW step and dropout by torch (and numpy), not training/speed/native
    "jemalloc": ([], "auto"),
    "tcmalloc": ([], "auto"),
    "glibc-malloc": ([], "auto"),  # no preloaded allocator: glibc's malloc, as a job started by hand gets
}


def padding_bound(samples: int, max_len: int = 128) -> tuple[int, int]:
    import csv

    from transformers import AutoTokenizer

    from training.jobs.glue import BUNDLED, DEFAULT_MODEL, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    with (BUNDLED / "train.csv").open() as f:
        rows = list(csv.DictReader(f))[:samples]
    enc = tok([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], truncation=True, max_length=max_len)
    real = sum(len(ids) for ids in enc["input_ids"])
    return real, max_len * len(rows)


def model_flops_per_token(tokens_per_sample: float, shape: str = "minilm") -> float:
    """Training FLOPs per real token: 6 x the non-embedding parameters (forward 2, backward 4) plus attention's
    score and value products, 12 x layers x width x sequence length (bench/model_shapes.py)."""
    return model_shapes.shape(shape).flops_per_token(tokens_per_sample)


def load_line() -> str:
    """The machine's load average, printed with every figure: on a shared machine it says what a figure is worth."""
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} {five:.2f} on {os.cpu_count()} cpus"


def matmul_peak(dtype_name: str, rows: int = 2048, d: int = 384, ffn: int = 1536, windows: int = 3,
                seconds: float = 1.0) -> float:
    """FLOP/s of torch's matmul at the model's FFN shape (rows = batch x tokens), this process's threads: the
    best of `windows` windows of `seconds` each (the VM's neighbours only ever slow a window down)."""
    import torch

    from training.speed.mfu import matmul_flops

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    return max(matmul_flops(dt, rows, d, ffn, seconds) for _ in range(windows))


def model_peak(dtype_name: str, shape) -> float:
    """The peak MFU divides by: the FFN's matmul, and for a causal LM the best of it and the head's (width x
    vocabulary, a third of GPT-2's FLOPs), which runs faster on wide outputs: the higher peak, the lower MFU."""
    peak = matmul_peak(dtype_name, d=shape.width, ffn=shape.ffn)
    return max(peak, matmul_peak(dtype_name, d=shape.width, ffn=shape.head_vocab)) if shape.head_vocab else peak


def matmul_ceiling(dtype_name: str, batch: int, tokens: int, seconds: float = 1.0, windows: int = 3,
                   shape: str = "minilm") -> float:
    """FLOP/s of one encoder layer's own matmuls, forward and backward, at the job's shapes (batch x tokens
    rows): the q, k, v, o and FFN linears (output, input gradient, weight gradient as autograd lays them out)
    and attention's score and value products. Their FLOPs are the model FLOPs per layer, so this over the
    peak is the MFU the step would reach if nothing but its matmuls took time."""
    import time

    import torch

    s = model_shapes.shape(shape)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    d, ffn, heads, rows = s.width, s.ffn, s.heads, batch * tokens
    calls, flops = [], 0
    # per layer, plus (gpt2) the output projection spread over the layers: its FLOPs count in the model's
    for k, n in [(d, d)] * 4 + [(d, ffn), (ffn, d)] + ([(d, s.head_vocab // s.layers)] if s.head_vocab else []):
        x, w, g, b = (torch.randn(*s, dtype=dt) for s in ((rows, k), (n, k), (rows, n), (n,)))
        calls += [lambda x=x, w=w, b=b: torch.addmm(b, x, w.t()), lambda g=g, w=w: torch.mm(g, w),
                  lambda g=g, x=x: torch.mm(g.t(), x)]
        flops += 3 * 2 * rows * k * n
    q, p_ = torch.randn(batch * heads, tokens, d // heads, dtype=dt), torch.randn(batch * heads, tokens, tokens, dtype=dt)
    kt = q.transpose(1, 2)
    calls += [lambda: torch.bmm(q, kt), lambda: torch.bmm(p_, q), lambda: torch.bmm(p_, kt.transpose(1, 2)),
              lambda: torch.bmm(kt, p_), lambda: torch.bmm(p_.transpose(1, 2), q), lambda: torch.bmm(q, kt)]
    flops += 6 * 2 * batch * heads * tokens * tokens * (d // heads)
    for call in calls:
        call()
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for call in calls:
                call()
            count += 1
        best = max(best, flops * count / (time.perf_counter() - start))
    return best


def cpu_line() -> str:
    model, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "?":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    shown = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
    line = f"cpu: {model}, {os.cpu_count()} cpus, flags {' '.join(shown) or 'none of amx/avx512'}"
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):  # the flags above are the CPU's, not what the matmuls used
        line += f"; oneDNN capped at {os.environ['ONEDNN_MAX_CPU_ISA']} (ONEDNN_MAX_CPU_ISA)"
    return line


def shape_args(shape: str, model_dir: Path | None, out: Path) -> list[str]:
    """The job's flags that make it train the shape: the random-weight model, or clm's GPT-2 small."""
    if shape == "bert-base":
        return ["--model_name_or_path", str(model_dir), "--max_eval_samples", "64"]
    if shape == "gpt2":
        return ["--config_overrides", model_shapes.gpt2_overrides(), "--block_size", str(model_shapes.GPT2_BLOCK),
                "--eval_strategy", "no", "--data_cache_dir", str(out / "clm-cache"), "--save_strategy", "no",
                "--logging_steps", "1"]  # the step-1 loss, for the check against the previous path
    return []


# gpt2 runs the clm job. "previous" is its path before the levers of training/speed/levers.py (causal_lm): sdpa with
# GPT-2's attention dropout (torch's unfused math attention), the full fp32 logits and transformers' loss,
# torch's dropout, gelu_new. The manual recipe is that path in fp32 with the unfused AdamW of their transformers.
# The check: one step of each path with every dropout at 0 (else the two draw different masks: 1.3e-3 apart in
# one run), the same seed, batch and precision, step-1 losses within LOSS_TOLERANCE.
PREVIOUS_CLM = ["--attention_dropout", "0.1", "--chunked_loss", "False", "--fast_dropout", "False",
                "--fused_gelu", "False", "--block_attention", "False"]
CLM_CONFIGS = {"manual": ([*PREVIOUS_CLM, "--optim", "adamw_torch"], "fp32"), "default": ([], "auto")}
CLM_LEVERS = {"fp32": ([], "fp32"), "bf16": ([], "bf16"), "eager": (["--attn_implementation", "eager"], "auto"),
              "full-logits": (["--chunked_loss", "False"], "auto"),
              "flash-attention": (["--block_attention", "False"], "auto"),
              "attention-dropout": (["--attention_dropout", "0.1"], "auto"),
              "torch-dropout": (["--fast_dropout", "False"], "auto"), "gelu-new": (["--fused_gelu", "False"], "auto"),
              "previous": (PREVIOUS_CLM, "auto"), "no-native-kernels": ([], "auto"),
              "glibc-malloc": ([], "auto")}
NO_DROPOUT = ["--attention_dropout", "0.0", "--config_overrides",
              model_shapes.gpt2_overrides() + ",resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"]
LOSS_TOLERANCE = 1e-3


def step1_loss(out: Path) -> float | None:
    """The loss the Trainer logged at step 1 (the gpt2 runs log every step), from trainer_state.json."""
    state = out / "trainer_state.json"
    if not state.is_file():
        return None
    return next((e["loss"] for e in json.loads(state.read_text())["log_history"] if e.get("step") == 1
                 and "loss" in e), None)


def rank_malloc() -> str | None:
    """The allocator fab train preloads for a rank on this machine (launch/plan/topology.py): every config runs
    with it, as the jobs do on nodes; the glibc-malloc lever runs without."""
    from launch.plan.topology import local_malloc

    return local_malloc()


def run(name: str, extra: list[str], precision: str, samples: int, batch: int, out: Path, epochs: int = 1,
        seed: int = 42, shape: str = "minilm", model_dir: Path | None = None) -> dict:
    job, evals = ("training.jobs.clm", []) if shape == "gpt2" else ("training.jobs.glue", ["--do_eval"])
    args = [sys.executable, "-m", job, "--output_dir", str(out / name), "--do_train", *evals,
            "--num_train_epochs", str(epochs), "--per_device_train_batch_size", str(batch), "--learning_rate", "1e-4",
            "--max_train_samples", str(samples), "--seed", str(seed), *shape_args(shape, model_dir, out), *extra]
    env = {**os.environ, "XC_PRECISION": precision,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if name in MALLOC:
        if not Path(MALLOC[name]).is_file():
            raise SystemExit(f"{name}: {MALLOC[name]} is not installed (apt-get install libjemalloc2 / libtcmalloc-minimal4)")
        env["LD_PRELOAD"] = MALLOC[name]
    elif name == "glibc-malloc":
        env.pop("LD_PRELOAD", None)
    elif "LD_PRELOAD" not in os.environ and (lib := rank_malloc()):
        env["LD_PRELOAD"] = lib
    env.update(LEVER_ENV.get(name, {}))
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed:\n{res.stderr[-2000:]}")
    results = json.loads((out / name / "results.json").read_text())
    ev = results.get("eval", {})
    return {"samples_per_second": results["train"]["train_samples_per_second"],
            "eval_accuracy": ev.get("eval_accuracy"), "eval_f1": ev.get("eval_f1"),
            "train_s": results["train"]["train_runtime"], "precision": results["precision"],
            "padding": results.get("padding", f"block/{results.get('block_size')}"), "threads": results["threads"],
            "command": " ".join(args[1:]), "job_mfu": (results.get("mfu") or {}).get("mfu"), "load": load_line(),
            "step1_loss": step1_loss(out / name)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, help="default 800; gpt2: 16 blocks of 1024 tokens (its step is timed, "
                   "random weights learn nothing to measure)")
    p.add_argument("--epochs", type=int, help="default 2, enough for MiniLM to beat the majority class; gpt2: 1")
    p.add_argument("--batch", type=int, help="default 16; gpt2: the largest of 16, 8, 4, 2, 1 that fits this "
                   "machine's memory (bench/memory_fit.py), and a --batch that does not fit is refused")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seeds", default="42", help="comma-separated; eval accuracy and F1 are the mean over them")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset; 'manual' is always run")
    p.add_argument("--levers", default="", help=f"also these levers on the default path: {','.join(LEVERS)}")
    p.add_argument("--onednn-max-isa", metavar="ISA", type=str.upper, choices=ONEDNN_ISAS,
                   help="cap oneDNN's instruction set for the peak and every run, e.g. AVX512_CORE_BF16: bf16 "
                        "matmuls without AMX, as on a CPU with AVX512-BF16 only")
    p.add_argument("--model-shape", choices=model_shapes.SHAPES, default="minilm",
                   help="minilm (real weights, accuracy measured), or the manual recipe's bert-base / gpt2 from a "
                        "config with random weights (gpt2 runs the clm job at 1024 tokens)")
    a = p.parse_args()
    gpt2 = a.model_shape == "gpt2"
    a.samples, a.epochs = a.samples or (16 if gpt2 else 800), a.epochs or (1 if gpt2 else 2)
    a.batch, why = memory_fit.pick_batch(a.model_shape, a.batch, 16, memory_fit.available_gib())  # before any run
    if why:
        print(why, flush=True)
    known = CLM_LEVERS if a.model_shape == "gpt2" else LEVERS
    unknown = [x for x in a.levers.split(",") if x and x not in known]
    if unknown:
        p.error(f"--levers {unknown[0]} is not a lever of --model-shape {a.model_shape}; use some of: {','.join(known)}")
    if a.onednn_max_isa:
        # read once, at oneDNN's first matmul: set before this process or its runs make one
        os.environ["ONEDNN_MAX_CPU_ISA"] = a.onednn_max_isa
    shape = model_shapes.shape(a.model_shape)
    if a.model_shape == "gpt2":
        real = padded = a.samples * model_shapes.GPT2_BLOCK
    else:
        real, padded = padding_bound(a.samples)
    tokens = round(real / a.samples)
    # bf16 only where the runs can be bf16: emulated bf16 (no bf16 instructions) times at ~1 GFLOP/s, minutes
    from training.speed.mfu import cpu_flags

    has_bf16 = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    wanted = ("bf16", "fp32") if has_bf16 or "bf16" in a.levers.split(",") else ("fp32",)
    before = {p: model_peak(p, shape) for p in wanted}
    ceiling_before = {p: matmul_ceiling(p, a.batch, tokens, shape=a.model_shape) for p in wanted}
    print(f"matmul peak before the runs ({load_line()}): "
          + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in before.items()), flush=True)
    configs, levers = (CLM_CONFIGS, CLM_LEVERS) if a.model_shape == "gpt2" else (CONFIGS, LEVERS)
    rows: dict[str, dict] = {}
    seeds = [int(x) for x in a.seeds.split(",")]
    accs: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_shapes.write_bert_base(Path(tmp) / "bert-base") if a.model_shape == "bert-base" else None
        # Interleaved rounds (one per seed per --rounds), best speed of each: drift in the machine's load hits
        # every config alike. Accuracy and F1: the mean over the seeds.
        for round_, seed in enumerate(seed for _ in range(a.rounds) for seed in seeds):
            chosen = {k: v for k, v in levers.items() if k in a.levers.split(",")}
            for name, (extra, precision) in {**configs, **chosen}.items():
                if name != "manual" and name not in a.configs.split(",") and name not in chosen:
                    continue
                print(f"round {round_ + 1}/{a.rounds * len(seeds)} (seed {seed}): {name} ...", flush=True)
                r = run(name, extra, precision, a.samples, a.batch, Path(tmp), a.epochs, seed, a.model_shape, model_dir)
                print(f"  {r['samples_per_second']:.2f} samples/s, {r['precision']}, {r['load']}", flush=True)
                accs.setdefault(name, []).append((r["eval_accuracy"] or 0.0, r["eval_f1"] or 0.0))
                best = rows.get(name)
                r["all_samples_per_second"] = (best or {}).get("all_samples_per_second", []) + [r["samples_per_second"]]
                if best is None or r["samples_per_second"] > best["samples_per_second"]:
                    rows[name] = r
                else:
                    best["all_samples_per_second"] = r["all_samples_per_second"]
    for name, r in rows.items():
        r["eval_accuracy"] = sum(x for x, _ in accs[name]) / len(accs[name])
        r["eval_f1"] = sum(f for _, f in accs[name]) / len(accs[name])
        r["eval_accuracy_per_run"] = [x for x, _ in accs[name]]
    per_token = model_flops_per_token(real / a.samples, a.model_shape)
    # measured before the runs and after them, the best of both: a peak measured in a slow minute would flatter MFU
    peaks = {p: max(before.get(p, 0.0), model_peak(p, shape))
             for p in sorted({r["precision"] for r in rows.values()})}
    default_row = rows.get("default", rows["manual"])
    ceiling = max(ceiling_before.get(default_row["precision"], 0.0),
                  matmul_ceiling(default_row["precision"], a.batch, tokens, shape=a.model_shape))
    base = rows["manual"]["samples_per_second"]
    what = ("clm job, GPT-2 small shape (random weights), {n} blocks of 1024 tokens" if a.model_shape == "gpt2" else
            "glue job, " + ("MiniLM-L6" if a.model_shape == "minilm" else "bert-base shape (random weights)")
            + ", {n} paraphrase pairs")
    print(f"\n{what.format(n=a.samples)}, {a.epochs} epoch(s), batch {a.batch}, one process, "
          f"{rows['manual']['threads']} threads; {load_line()} at the end")
    print(cpu_line())
    print(f"allocator: {os.environ.get('LD_PRELOAD') or rank_malloc() or 'glibc malloc'} (what fab train preloads "
          f"for a rank here; lever glibc-malloc: none)")
    print("matmul peak at the model's shapes (best of before and after the runs): "
          + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in peaks.items())
          + f"; model FLOPs per real token {per_token / 1e6:.1f} M ({real / a.samples:.0f} tokens/sample)")
    print(f"{'config':<20}{'padding':<12}{'precision':<11}{'samples/s':>10}{'tokens/s':>10}{'MFU':>7}"
          f"{'eval acc':>9}{'f1':>7}{'vs manual':>10}{'train s':>9}{'job MFU':>8}   all rounds   load during")
    for name, r in rows.items():
        r["ratio_vs_manual"] = r["samples_per_second"] / base
        r["tokens_per_second"] = r["samples_per_second"] * real / a.samples
        r["mfu"] = r["tokens_per_second"] * per_token / peaks[r["precision"]]
        rounds = " ".join(f"{x:.2f}" for x in r["all_samples_per_second"])
        acc, f1 = r.get("eval_accuracy") or float("nan"), r.get("eval_f1") or float("nan")
        print(f"{name:<20}{r['padding']:<12}{r['precision']:<11}{r['samples_per_second']:>10.2f}"
              f"{r['tokens_per_second']:>10.0f}{r['mfu']:>7.3f}{acc:>9.3f}{f1:>7.3f}{r['ratio_vs_manual']:>9.2f}x"
              f"{r['train_s']:>9.1f}{r.get('job_mfu') or float('nan'):>8.3f}   "
              f"{rounds}   {r['load']}")
    if len(seeds) > 1 or a.rounds > 1:
        print(f"eval accuracy per run (seeds {a.seeds}): " + "; ".join(
            f"{n} " + " ".join(f"{x:.3f}" for x in r["eval_accuracy_per_run"]) for n, r in rows.items()))
    print(f"padding bound (padded tokens / real tokens): {padded}/{real} = {padded / real:.2f}x")
    share = default_row["tokens_per_second"] * per_token / ceiling
    print(f"matmul ceiling: the model's own matmuls alone (forward and backward, {a.batch} x {real / a.samples:.0f} "
          f"tokens, {default_row['precision']}) run at {ceiling / 1e9:.0f} GFLOP/s, MFU "
          f"{ceiling / peaks[default_row['precision']]:.3f} if nothing else took time; they are "
          f"{share:.0%} of the default's step")
    result = {"samples": a.samples, "batch": a.batch, "real_tokens": real, "padded_tokens": padded,
              "padding_bound": padded / real, "configs": rows, "cpu": cpu_line(),
              "matmul_peak_flops": peaks, "model_flops_per_token": per_token, "matmul_ceiling_flops": ceiling,
              "command": f"bench/glue_single_node.py --samples {a.samples} --epochs {a.epochs} --batch {a.batch} "
                         f"--rounds {a.rounds} --seeds {a.seeds} --levers {a.levers}"
                         + (f" --onednn-max-isa {a.onednn_max_isa}" if a.onednn_max_isa else "")
                         + f" --model-shape {a.model_shape}", "model_shape": a.model_shape, "load_at_end": load_line()}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "glue_single_node" + ("" if a.model_shape == "minilm" else f"-{a.model_shape}") + (
        f"-{a.onednn_max_isa.lower()}" if a.onednn_max_isa else "") + ".json"
    (out / name).write_text(json.dumps(result, indent=2))
    print(f"written to {out / name}")
    default = default_row
    acc_delta = (default.get("eval_accuracy") or 0.0) - (rows["manual"].get("eval_accuracy") or 0.0)
    check = ""
    if a.model_shape == "gpt2":
        with tempfile.TemporaryDirectory() as tmp:
            new, old = (run(cfg, extra + NO_DROPOUT, "auto", a.batch, a.batch, Path(tmp), 1, seeds[0], "gpt2")
                        ["step1_loss"] for cfg, extra in (("check-default", []), ("check-previous", PREVIOUS_CLM)))
        delta = abs(new - old) if new is not None and old is not None else float("inf")
        print(f"step-1 loss, one step each without dropout (seed {seeds[0]}, batch {a.batch}, precision auto): "
              f"default {new}, previous path {old}, |delta| {delta:.5f}: "
              f"{'within' if delta <= LOSS_TOLERANCE else 'NOT within'} {LOSS_TOLERANCE}")
        if "previous" in rows:
            print(f"with dropout (different masks): default {default_row['step1_loss']}, previous "
                  f"{rows['previous']['step1_loss']}")
        check = f" loss_delta={delta:.5f}"
        result["loss_check"] = {"default": new, "previous": old, "delta": delta, "tolerance": LOSS_TOLERANCE}
        (out / name).write_text(json.dumps(result, indent=2))
    print(f"mfu={default['mfu']:.3f} ratio={default['ratio_vs_manual']:.2f} acc_delta={acc_delta:.3f}{check}")
    if check and delta > LOSS_TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
