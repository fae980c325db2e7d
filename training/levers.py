"""Speed levers the bundled encoder jobs share (glue, qa): cheap dropout and frozen word embeddings, as
flags of their ModelArguments, and applying them to a loaded model."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("training.levers")


@dataclass
class SpeedArguments:
    # torch's CPU dropout was ~23% of a bf16 step here (one Mersenne Twister draw per element, one thread)
    fast_dropout: bool = field(default=True, metadata={
        "help": "dropout from 16-bit uniforms, four per 64-bit draw (training/fastdrop.py); False: torch's own"})
    # The word embeddings are over half of MiniLM's weights: their dense gradient, AdamW step and all-reduce
    # cost a step more than the few rows a batch touches are worth (bench/glue_single_node.py).
    freeze_embeddings: bool = field(default=True, metadata={
        "help": "keep the input word embeddings fixed: no gradient, optimizer state or all-reduce for them"})


def apply(model, args: SpeedArguments, argv: list[str]) -> None:
    """Fast dropout and frozen embeddings on model, as args say. A resumed checkpoint that trained the
    embeddings (started before they were frozen by default) keeps training them unless the flag was given."""
    from training import common, fastdrop

    if args.fast_dropout:
        fastdrop.install(model)
    if args.freeze_embeddings and not common.has_flag(argv, "--freeze_embeddings", "--no_freeze_embeddings"):
        args.freeze_embeddings = not resumes_trained_embeddings(model)
    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)


def resumes_trained_embeddings(model) -> bool:
    """Whether XC_RESUME_FROM's optimizer stepped every weight of model."""
    from training import spot, store

    store.fetch_resume()  # XC_RESUME_URL onto this node first: the job reads the checkpoint before training
    resume = spot.resume_from()
    if not resume or spot.optimizer_tensors(resume) != sum(1 for p in model.parameters() if p.requires_grad):
        return False
    log.warning("%s trained the word embeddings: the resumed run trains them too (--freeze_embeddings False)", resume)
    return True
