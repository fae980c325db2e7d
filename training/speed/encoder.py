"""The encoders' speed levers (glue, qa: the flags of training/speed/levers.py's SpeedArguments) applied to a loaded
model: cheap dropout, training/speed/native's fused blocks, frozen word embeddings. It imports torch (through
fastdrop and fused): a job imports it where it has loaded its model, not at its own import."""
from __future__ import annotations

import logging

from training.runtime import spot, store
from training.speed import fastdrop, fused, levers

log = logging.getLogger("training.speed.encoder")


def apply(model, args: levers.SpeedArguments, argv: list[str]) -> None:
    """Fast dropout and frozen embeddings on model, as args say. A resumed checkpoint that trained the
    embeddings (started before they were frozen by default) keeps training them unless the flag was given."""
    if args.fast_dropout:
        fastdrop.install(model)
    fused.install(model)  # bf16 training with training/speed/native's kernels only; else the block's own forward
    if args.freeze_embeddings and not levers.has_flag(argv, "--freeze_embeddings", "--no_freeze_embeddings"):
        args.freeze_embeddings = not resumes_trained_embeddings(model)
    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)


def resumes_trained_embeddings(model) -> bool:
    """Whether XC_RESUME_FROM's optimizer stepped every weight of model."""
    store.fetch_resume()  # XC_RESUME_URL onto this node first: the job reads the checkpoint before training
    resume = spot.resume_from()
    if not resume or spot.optimizer_tensors(resume) != sum(1 for p in model.parameters() if p.requires_grad):
        return False
    log.warning("%s trained the word embeddings: the resumed run trains them too (--freeze_embeddings False)", resume)
    return True
