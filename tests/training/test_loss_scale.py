"""Loss and gradients must not depend on how many nodes run a job: for every bundled job, the step-1
loss and gradient norm of a 2-node run equal those of one process with the same global batch (same
samples: no length grouping, so both take the sampler's first 16). On a real 2-node local cluster.

Dropout is switched off (a copy of the model with zero dropout; clm's config override), since one
process and two ranks draw different masks; fp32 throughout. Then data parallelism must give the same gradient up to
the order of float sums: within 1e-3 relative, loss and norm, for every job. What this caught:
- the Trainer multiplied a mean loss by the world size (2x loss and 2x gradients): mean_loss_per_rank;
- clm: its step-0 evaluation left the model marked prepared by accelerate, which then never wrapped it
  in DDP: no gradient was all-reduced (9% larger norm, rank 0's half alone; the logged loss, a mean over
  ranks, matched): dist.ready_for_ddp;
- qa: pad positions inside the span softmax made the loss depend on per-batch padding (1.5% loss, 2.6%
  norm): qa.masked_span_loss."""
from __future__ import annotations

import json
import shutil

import pytest

from training.jobs import clm_data

pytestmark = pytest.mark.cluster

COMMON = ["--do_train", "--max_steps", "1", "--logging_steps", "1", "--seed", "42", "--train_sampling_strategy", "random",
          "--save_strategy", "no"]
JOBS = {
    "glue": ["--max_train_samples", "64"],
    "qa": ["--max_train_samples", "32", "--max_seq_length", "192", "--doc_stride", "64"],
    "clm": ["--max_train_samples", "64", "--config_overrides",
            clm_data.TINY + ",resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"],
}
GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory, small_model):
    """conftest's thin MiniLM (the default model's tokenizer, architecture and heads, cut small: what is checked is
    how the loss is scaled and reduced, not the width) with every dropout probability at 0 (every local node reads
    this one path)."""
    path = tmp_path_factory.mktemp("model") / "minilm-no-dropout"
    shutil.copytree(small_model, path)
    config = json.loads((path / "config.json").read_text())
    zeroed = {k: 0.0 for k in config if "dropout" in k and isinstance(config[k], (int, float))}
    assert zeroed, "the model's config names no dropout"
    (path / "config.json").write_text(json.dumps({**config, **zeroed}))
    return path


def first_step(cluster, job: str, nodes: int, model) -> dict:
    before = cluster.run_dirs()
    per_device = str(GLOBAL_BATCH // nodes)
    extra = [] if job == "clm" else ["--model_name_or_path", str(model)]
    # fp32: bf16 autocast rounds each rank's activations at its own batch shapes, a difference beyond reduction order
    res = cluster.fab("train", "--nodes", str(nodes), "--job", job, "--precision", "fp32", "--", *COMMON, *JOBS[job], *extra,
                      "--per_device_train_batch_size", per_device, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = cluster.runs / (cluster.run_dirs() - before).pop()
    state = json.loads((run_dir / "output" / "trainer_state.json").read_text())
    return next(e for e in state["log_history"] if "loss" in e and e.get("step") == 1)


@pytest.mark.parametrize("job", list(JOBS))
def test_step_one_loss_and_gradient_norm_do_not_depend_on_the_node_count(cluster2, job, no_dropout_model):
    one, two = first_step(cluster2, job, 1, no_dropout_model), first_step(cluster2, job, 2, no_dropout_model)
    print(f"{job}: step-1 loss 1 process {one['loss']:.4f}, 2 nodes {two['loss']:.4f}; "
          f"grad norm {one['grad_norm']:.4f} vs {two['grad_norm']:.4f}")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-3)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-3)
