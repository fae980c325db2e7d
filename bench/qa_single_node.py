"""Single-node samples/s and exact match / F1 of the qa job with its speed levers on and off.

The bundled encyclopedia QA set, MiniLM-L6 with a fresh QA head, one process, side by side:
  torch-dropout-trained   torch's dropout, every weight trained (the job before the levers)
  fast-dropout            training/speed/fastdrop.py's dropout, every weight trained
  autocast                the default with fp32 weights under autocast (--bf16_weights False)
  default                 the job's default: fast dropout, frozen word embeddings, bf16 weights where bf16 trains
Speed is the best of the seeds' runs (interleaved, so drift hits every config alike); exact match and
F1 are the mean over --seeds. Prints the CPU model and flags. Last line:
    speedup=<default over torch-dropout-trained samples/s> f1_delta=<default minus torch-dropout-trained F1, points>
Writes bench/results/qa_single_node.json.

    .venv/bin/python bench/qa_single_node.py [--samples 2410] [--epochs 1] [--seeds 42] [--configs ...]

The defaults train on the whole bundled set once (~13 minutes for three configs on a 2-core VM): shorter
runs leave the model barely trained (F1 below 25), where one seed's noise hides any lever.
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
sys.path.insert(0, str(ROOT / "bench"))

from glue_single_node import cpu_line

CONFIGS = {
    "torch-dropout-trained": ["--fast_dropout", "False", "--freeze_embeddings", "False", "--bf16_weights", "False"],
    "fast-dropout": ["--fast_dropout", "True", "--freeze_embeddings", "False", "--bf16_weights", "False"],
    "autocast": ["--bf16_weights", "False"],  # the default before bf16 weights were (fp32 weights, autocast)
    "default": [],
}


def run(extra: list[str], samples: int, epochs: int, batch: int, seed: int, out: Path) -> dict:
    args = [sys.executable, "-m", "training.jobs.qa", "--output_dir", str(out), "--do_train", "--do_eval",
            "--num_train_epochs", str(epochs), "--per_device_train_batch_size", str(batch),
            "--learning_rate", "1e-4", "--max_train_samples", str(samples), "--seed", str(seed), *extra]
    res = subprocess.run(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(args[1:])} failed:\n{res.stderr[-2000:]}")
    r = json.loads((out / "results.json").read_text())
    return {"samples_per_second": r["train"]["train_samples_per_second"], "exact_match": r["eval"]["eval_exact_match"],
            "f1": r["eval"]["eval_f1"], "precision": r["precision"], "threads": r["threads"],
            "trainable_params": r.get("trainable_params"), "command": " ".join(args[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2410, help="training questions (2410: all bundled)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seeds", default="42")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset; torch-dropout-trained (the speedup's base) and default always run")
    a = p.parse_args()
    unknown = set(a.configs.split(",")) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    chosen = {name: extra for name, extra in CONFIGS.items()
              if name in ("torch-dropout-trained", "default") or name in a.configs.split(",")}
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in a.seeds.split(",")):
            for name, extra in chosen.items():
                print(f"seed {seed}: {name} ...", flush=True)
                runs[name].append(run(extra, a.samples, a.epochs, a.batch, seed, Path(tmp) / f"{name}-{seed}"))
    print(f"\nqa job, MiniLM-L6, {a.samples} questions, {a.epochs} epoch(s), batch {a.batch}, one process, "
          f"{runs['default'][0]['threads']} threads, {runs['default'][0]['precision']}")
    print(cpu_line())
    print(f"{'config':<24}{'samples/s':>10}{'exact':>8}{'f1':>8}{'vs first':>10}   samples/s per seed; f1 per seed")
    rows = {}
    for name, rs in runs.items():
        rows[name] = {"samples_per_second": max(r["samples_per_second"] for r in rs),
                      "exact_match": sum(r["exact_match"] for r in rs) / len(rs), "f1": sum(r["f1"] for r in rs) / len(rs),
                      "runs": rs}
    base = rows["torch-dropout-trained"]
    for name, r in rows.items():
        r["speedup"] = r["samples_per_second"] / base["samples_per_second"]
        print(f"{name:<24}{r['samples_per_second']:>10.2f}{r['exact_match']:>8.2f}{r['f1']:>8.2f}{r['speedup']:>9.2f}x   "
              + " ".join(f"{x['samples_per_second']:.1f}" for x in r["runs"]) + "; "
              + " ".join(f"{x['f1']:.1f}" for x in r["runs"]))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "qa_single_node.json").write_text(json.dumps({"cpu": cpu_line(), "configs": rows, "seeds": a.seeds,
                                                          "samples": a.samples, "epochs": a.epochs}, indent=2))
    print(f"written to {out / 'qa_single_node.json'}")
    d = rows["default"]
    print(f"speedup={d['speedup']:.2f} f1_delta={d['f1'] - base['f1']:.2f}")


if __name__ == "__main__":
    main()
