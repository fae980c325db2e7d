"""Speed levers the bundled jobs share: for the encoders (glue, qa) cheap dropout and frozen word embeddings,
as flags of their ModelArguments (training/speed/applied.py applies them to a loaded model); for the causal LM
(clm) blocked or fused attention, one-kernel GELU, cheap dropout and the chunked head and loss (causal_lm_config
here, before the model is built; training/speed/applied.py after)."""
from __future__ import annotations

from dataclasses import dataclass, field

from training.speed import mfu


@dataclass
class SpeedArguments:
    # torch's CPU dropout was ~23% of a bf16 step here (one Mersenne Twister draw per element, one thread)
    fast_dropout: bool = field(default=True, metadata={
        "help": "dropout from 16-bit uniforms, four per 64-bit draw (training/speed/fastdrop.py); False: torch's own"})
    # The word embeddings are over half of MiniLM's weights: their dense gradient, AdamW step and all-reduce
    # cost a step more than the few rows a batch touches are worth (bench/glue_single_node.py).
    freeze_embeddings: bool = field(default=True, metadata={
        "help": "keep the input word embeddings fixed: no gradient, optimizer state or all-reduce for them"})
    # bert-base, bf16 without AMX: +5-8% samples/s over autocast's per-step weight casts (docs/benchmarks.md)
    bf16_weights: str = field(default="auto", metadata={
        "help": "auto (default: on when training in bf16 without IPEX or --optim) | True | False: bf16 weights "
                "with fp32 master copies in AdamW instead of autocast casting every weight every step"})


def causal_lm_config(config, args) -> None:
    """Before the model is built: attention dropout as --attention_dropout says (0 lets torch's fused CPU
    attention run: its flash kernel has no dropout, so sdpa falls back to materialising every score matrix in
    fp32), and GPT-2's gelu_new as torch's fused tanh GELU (the same function, one kernel instead of six)."""
    if args.attention_dropout is not None and hasattr(config, "attn_pdrop"):
        config.attn_pdrop = args.attention_dropout
    if args.fused_gelu and getattr(config, "activation_function", None) == "gelu_new":
        config.activation_function = "gelu_pytorch_tanh"


def has_flag(argv: list[str], *flags: str) -> bool:
    return any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in argv)


def forced(value, flag: str) -> bool | None:
    """An auto | True | False flag's value: True or False where the user forced it, None for auto."""
    word = str(value).lower()
    if word in ("true", "1", "yes"):
        return True
    if word in ("false", "0", "no"):
        return False
    if word != "auto":
        raise ValueError(f"{flag} {value!r} is not one of auto, True, False")
    return None


def block_attention(value) -> bool:
    """--block_attention: auto takes the blocks where the CPU has no AMX (or oneDNN is capped below it)."""
    chosen = forced(value, "--block_attention")
    return not mfu.amx_matmuls() if chosen is None else chosen


def bf16_weights_wanted(value, bf16: bool, ipex: bool, optim_flag: bool = False) -> bool:
    """--bf16_weights: auto takes them wherever the run trains in bf16 and neither IPEX nor the user's --optim
    chooses the optimizer."""
    chosen = forced(value, "--bf16_weights")
    if chosen is False:
        return False
    if chosen and not bf16:
        raise ValueError("--bf16_weights needs bf16 precision; drop it, or run with --precision bf16 on a CPU with bf16")
    if chosen and ipex:
        raise ValueError("--bf16_weights and IPEX both want the optimizer; drop --bf16_weights where IPEX is installed")
    if chosen and optim_flag:
        raise ValueError("--bf16_weights steps its own fused AdamW; drop --optim, or pass --bf16_weights False")
    return bf16 and not ipex and not optim_flag


def check(model_args, args, argv: list[str]) -> None:
    """--bf16_weights' value against the run's precision and --optim, before the job loads anything."""
    bf16_weights_wanted(model_args.bf16_weights, args.bf16, False, has_flag(argv, "--optim"))
