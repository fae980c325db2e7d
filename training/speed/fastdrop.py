"""Dropout that costs what a multiply does, for CPU training.

torch's CPU dropout draws one Mersenne Twister number per element on one thread: 2.3 ms for a
[16, 65, 384] activation, 30x a multiply, ~23% of a bf16 MiniLM training step. Here one 64-bit draw gives
four 16-bit uniforms, and an element is kept when its uniform is at or above p quantised to 1/65536
(p=0.1 keeps 0.899994). The 64-bit draws come from numpy's SFC64, 2.4x faster than torch's generator
(0.97 against 2.35 ms for 800k words on one thread), seeded for each mask by one draw from torch's generator,
so torch.manual_seed and a checkpoint's rng state still decide every mask. (Splitting torch's draws over
threads did not help: the idle OpenMP workers spin on the cores the other threads need.) The mask is applied,
and its gradient taken, in one pass each, where x * mask * scale takes two.

Where training/speed/native's kernels are built (gcc on the node), drawing, applying and keeping the mask is one pass
on torch's threads, its gradient another: the draws there are splitmix64 of a counter from a seed drawn from
torch's generator, so masks differ from the numpy path's but follow torch.manual_seed alike.
"""
from __future__ import annotations

import numpy as np
import torch

from training.speed import native

ATTENTION = "xc_eager"  # eager attention with this dropout on its probabilities


def mask_seed() -> int:
    """One draw from torch's generator, that a mask's stream starts from: torch.manual_seed and a checkpoint's
    rng state decide every mask, whichever path (numpy's, a native kernel's) draws it."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def draws(words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """words uniform 64-bit draws as int64, from a generator seeded by torch's."""
    if torch.device(device).type != "cpu":
        return torch.randint(-2**63, 2**63 - 1, (words,), dtype=torch.int64, device=device)
    seed = mask_seed()
    raw = np.random.Generator(np.random.SFC64(seed)).integers(0, 2**64, size=words, dtype=np.uint64)
    return torch.from_numpy(raw.view(np.int64))


class _Masked(torch.autograd.Function):
    """x * keep * scale, forward and backward, as one addcmul each (one rounding, as the two multiplies give)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.addcmul(x.new_zeros(()), x, keep, value=scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, keep, value=ctx.scale), None, None


class _Native(torch.autograd.Function):
    """The mask drawn, applied and kept (one byte an element) in one pass, and applied to the gradient in one:
    training/speed/native/kernels.c, from a seed drawn from torch's generator."""

    @staticmethod
    def forward(ctx, x, p, lib):
        x = x.contiguous()
        y, mask = torch.empty_like(x), torch.empty(x.shape, dtype=torch.uint8)
        seed = mask_seed()
        ctx.scale, ctx.kernel = 1.0 / (1.0 - p), _kernels(lib, x.dtype)
        ctx.kernel[0](x.data_ptr(), y.data_ptr(), mask.data_ptr(), x.numel(), seed, round(p * 65536), ctx.scale,
                      torch.get_num_threads())
        ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(mask)
        return y

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.kernel[1](grad.data_ptr(), mask.data_ptr(), out.data_ptr(), grad.numel(), ctx.scale,
                      torch.get_num_threads())
        return out, None, None


_DTYPE = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _kernels(lib, dtype):
    """(forward, backward) of the native dropout for dtype."""
    return getattr(lib, f"xc_dropout_{_DTYPE[dtype]}_forward"), getattr(lib, f"xc_dropout_{_DTYPE[dtype]}_backward")


def _native_lib(x: torch.Tensor, kernel: str):
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        native.took(kernel, f"torch ({x.dtype} on {x.device.type}: the kernel takes bf16 or fp32 on the CPU)")
        return None
    return native.lib(kernel)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    lib = _native_lib(x, "dropout")
    if lib is not None:
        return _Native.apply(x, p, lib)
    n = x.numel()
    uniform16 = draws((n + 3) // 4, x.device).view(torch.int16)[:n].view(x.shape)
    # the mask in x's dtype: a bool one is cast to it in every multiply, forward and backward (~30% of the op)
    keep = torch.ge(uniform16, -32768 + round(p * 65536), out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return _Masked.apply(x, keep, 1.0 / (1.0 - p))


class FastDropout(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout_p=None, **kwargs):
    """transformers' eager attention (BERT's), with the dropout above."""
    p = kwargs.pop("dropout", 0.0) if dropout_p is None else dropout_p
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3))
    weights = scores * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = dropout(torch.nn.functional.softmax(weights, dim=-1), p, module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def install(model, attention: bool = True) -> int:
    """Swap every nn.Dropout for FastDropout, and (attention) BERT's eager attention for ATTENTION. Returns how
    many dropout modules were swapped."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout:
                setattr(parent, name, FastDropout(child.p))
                swapped += 1
    if attention and getattr(model.config, "_attn_implementation", None) == "eager":
        AttentionInterface.register(ATTENTION, eager_attention)
        # without a mask function of its own, transformers builds no padding mask for a custom attention
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        model.config._attn_implementation = ATTENTION
    return swapped
