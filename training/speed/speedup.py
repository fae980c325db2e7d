"""A job's speed in one call: every lever its flags ask for, installed on a loaded model, and what was installed.

``apply`` is the jobs' one entry: the encoders' (glue, qa) cheap dropout,
training/speed/native's fused blocks, frozen word embeddings and bf16 weights with fp32 masters; the causal LM's
(clm) cheap dropout, blocked attention and chunked head and loss. It imports torch (through fastdrop and fused): a
job reaches it where it has loaded its model, not at its own import."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from training.runtime import spot, store
from training.speed import blockattn, fastdrop, fused, levers, lmloss, master

log = logging.getLogger("training.speed")

NO_OPTIMIZERS = (None, None)


@dataclass
class SpeedReport:
    """The model and optimizers the Trainer takes, and what was applied: results.json's ``speed``."""
    model: Any
    optimizers: tuple = NO_OPTIMIZERS
    applied: dict = field(default_factory=dict)

    def attach(self, trainer) -> None:
        """The Trainer's gradient clipping through MasterAdamW where it steps (training/speed/master.py)."""
        self.applied["master_clip"] = master.attach(trainer, self.optimizers)

    def finish(self) -> None:
        """After training: the model to save and evaluate holds the fp32 masters."""
        master.restore_fp32(self.model, self.optimizers)


def apply(model, model_args, args, argv: list[str], trainer_cls,
          optimizers: Callable[[Any], tuple] | None = None) -> SpeedReport:
    """The levers on model as model_args say (an encoder's levers.SpeedArguments, or the causal LM's), then
    optimizers(model) -> (model, optimizers) (IPEX's, where installed), then bf16 master weights where chosen."""
    optimizers = optimizers or (lambda m: (m, NO_OPTIMIZERS))
    if not isinstance(model_args, levers.SpeedArguments):
        applied = causal_lm(model, model_args)
        model, opts = optimizers(model)
        return SpeedReport(model, opts, applied)
    encoder(model, model_args, argv)
    model, opts = optimizers(model)
    model, opts = master.install(model, model_args, args, opts, argv, trainer_cls)
    applied = {"fast_dropout": model_args.fast_dropout, "freeze_embeddings": model_args.freeze_embeddings,
               "bf16_weights": model_args.bf16_weights,
               "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    return SpeedReport(model, opts, applied)


def encoder(model, args: levers.SpeedArguments, argv: list[str]) -> None:
    """Fast dropout, the fused output blocks and frozen embeddings on model, as args say. A resumed checkpoint that
    trained the embeddings (started before they were frozen by default) keeps training them unless the flag was
    given."""
    if args.fast_dropout:
        fastdrop.install(model)
    fused.install(model)  # bf16 training with training/speed/native's kernels only; else the block's own forward
    if args.freeze_embeddings and not levers.has_flag(argv, "--freeze_embeddings", "--no_freeze_embeddings"):
        args.freeze_embeddings = not resumes_trained_embeddings(model)
    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)


def causal_lm(model, args) -> dict:
    """Fast dropout, causal attention in blocks (training/speed/blockattn.py) and the chunked head and loss
    (training/speed/lmloss.py). Returns what was applied (fast_dropout: how many dropout modules were swapped)."""
    # GPT-2's eager attention scales and masks its own way: its probabilities keep torch's dropout
    swapped = fastdrop.install(model, attention=False) if args.fast_dropout else 0
    blocks = levers.block_attention(getattr(args, "block_attention", "False")) and blockattn.install(model)
    return {"fast_dropout": swapped, "chunked_loss": bool(args.chunked_loss and lmloss.install(model)),
            "block_attention": blocks,
            "attn_implementation": model.config._attn_implementation,
            "attention_dropout": getattr(model.config, "attn_pdrop", None),
            "activation": getattr(model.config, "activation_function", None)}


def resumes_trained_embeddings(model) -> bool:
    """Whether XC_RESUME_FROM's optimizer stepped every weight of model."""
    store.fetch_resume()  # XC_RESUME_URL onto this node first: the job reads the checkpoint before training
    resume = spot.resume_from()
    if not resume or spot.optimizer_tensors(resume) != sum(1 for p in model.parameters() if p.requires_grad):
        return False
    log.warning("%s trained the word embeddings: the resumed run trains them too (--freeze_embeddings False)", resume)
    return True
