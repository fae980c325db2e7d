"""Causal self-attention in query blocks, as batched matmuls, for CPU training without AMX.

torch's CPU flash attention runs its small per-tile GEMMs far below the matmul peak where oneDNN has no AMX
(~140 ms a layer forward and backward at GPT-2's 4 x 12 heads x 1024 tokens x 64 on a 2-core AVX512-BF16 EPYC;
a quarter of a GPT-2 small step). Here query block i attends keys [0, end of block i) with two bmm and a
softmax, and the backward pass is bmm too, the key and value gradients accumulated in place (baddbmm_): the
blocks above the diagonal are never computed and only the diagonal block is masked. ~75 ms a layer there, and
the whole GPT-2 step ~10% faster (docs/benchmarks.md). The cost: the probabilities are kept for the backward
pass in the input's dtype, ~T^2/2 values a head (57 MB a layer at 4 x 12 heads x 1024 tokens in bf16) where
flash keeps none. With AMX, torch's flash kernel is the faster (28.7-29.3 ms against 32.4-33.5 a layer on a
16-core Xeon), so the clm job's `--block_attention auto` keeps it there. Anything else (a padding mask,
attention dropout, a KV cache, cross-attention) goes to transformers' sdpa.
"""
from __future__ import annotations

import torch

NAME = "xc_causal_blocks"
BLOCK = 128  # at 1024 tokens: 64 and 192 ~10% slower, 256 ~15%


class _CausalBlocks(torch.autograd.Function):
    """Forward and backward by hand, so that the key and value gradients of every block are accumulated in
    place by the matmuls (baddbmm_) rather than as autograd's partial sums over growing slices."""

    @staticmethod
    def forward(ctx, query, key, value, scaling, block):
        b, h, t, d = query.shape
        dv = value.shape[-1]
        q = (query * scaling).reshape(b * h, t, d).contiguous()
        k = key.to(query.dtype).reshape(b * h, t, d).contiguous()
        v = value.to(query.dtype).reshape(b * h, t, dv).contiguous()
        out = torch.empty((b * h, t, dv), dtype=query.dtype, device=query.device)
        above = torch.ones(block, block, dtype=torch.bool, device=query.device).triu(1)
        probs = []
        for start in range(0, t, block):
            stop = min(start + block, t)
            scores = torch.bmm(q[:, start:stop], k[:, :stop].transpose(1, 2))
            scores[:, :, start:].masked_fill_(above[:stop - start, :stop - start], float("-inf"))
            p = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
            out[:, start:stop] = torch.bmm(p, v[:, :stop])
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scaling, ctx.block, ctx.shapes = scaling, block, (query.shape, value.shape)
        return out.view(b, h, t, dv)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        (qshape, vshape), block = ctx.shapes, ctx.block
        t = q.shape[1]
        g = grad_out.to(q.dtype).reshape(v.shape).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for p, start in zip(probs, range(0, t, block)):
            stop = min(start + block, t)
            go = g[:, start:stop]
            ds = torch._softmax_backward_data(torch.bmm(go, v[:, :stop].transpose(1, 2)), p, -1, p.dtype)
            dq[:, start:stop] = torch.bmm(ds, k[:, :stop])
            dk[:, :stop].baddbmm_(ds.transpose(1, 2), q[:, start:stop])
            dv[:, :stop].baddbmm_(p.transpose(1, 2), go)
        dq.mul_(ctx.scaling)
        return dq.view(qshape), dk.view(qshape[:3] + dk.shape[-1:]), dv.view(vshape), None, None


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     block: int = BLOCK) -> torch.Tensor:
    """softmax(q k^T * scaling, causal) v for [batch, heads, tokens, dim] tensors, in query blocks."""
    with torch.autocast(query.device.type, enabled=False):
        return _CausalBlocks.apply(query, key, value, scaling, block)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface: blocks for plain causal self-attention, sdpa for anything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain = (attention_mask is None and not dropout and causal and query.shape[2] == key.shape[2] > 1
             and query.shape[1] == key.shape[1] and not kwargs.get("output_attentions")
             and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return causal_attention(query, key, value, scale).transpose(1, 2).contiguous(), None


def install(model) -> bool:
    """Use the blocks for model's attention where it runs sdpa now. Returns whether it was installed."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    # sdpa's mask function: no mask at all for unpadded causal batches, which is what takes the block path
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = NAME
    return True
