"""A causal LM's head and loss in row chunks: the full fp32 logits are never held at once.

GPT-2's head is a [tokens, 50257] matmul; transformers then takes log_softmax of the whole fp32 matrix and
keeps it for the backward pass (823 MB at 4 x 1024 tokens, and ~12% of a bf16 step on 2 cores for the
softmax and its backward alone: docs/benchmarks.md, "GPT-2 small without AMX"). Here each chunk of rows is
projected, its softmax taken in place in fp32, and its gradient (softmax minus one-hot) turned into the hidden
states' and the weight's gradients at once, so the forward pass keeps only those two and no logits. The loss
is the same sum over the labelled tokens over the same divisor as transformers' ForCausalLMLoss (labels
shifted by one, -100 ignored, `num_items_in_batch` when the Trainer passes it, else their count).
"""
from __future__ import annotations

import types

import torch

IGNORE = -100
CHUNK_ROWS = 1024  # 1024 x 50257 fp32 logits = 206 MB per chunk; measured no slower than 512 or 2048 rows


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, divisor, dtype, chunk):
        # hidden [N, d], weight [V, d] (any dtype; matmuls in `dtype`), labels [N]; returns sum(loss) / divisor
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        w, h_all = weight.to(dtype), hidden.to(dtype)
        rows, vocab = hidden.shape[0], weight.shape[0]
        valid = labels != IGNORE
        target = labels.clamp(min=0).unsqueeze(1)
        # per row: 1/divisor for a labelled token, 0 for an ignored one (its row of the gradient vanishes)
        row_scale = (valid.to(torch.float32) / float(divisor)).unsqueeze(1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # the weight's gradient is accumulated transposed: h.T @ grad runs ~1.5x faster than grad.T @ h here
        grad_wt = torch.zeros(weight.shape[::-1], dtype=torch.float32, device=weight.device) if need_w else None
        # one set of buffers for every chunk: a fresh 200 MB tensor per chunk costs its page faults each time
        n = min(chunk, rows)
        low = torch.empty((n, vocab), dtype=dtype, device=hidden.device)
        high = low if dtype == torch.float32 else torch.empty((n, vocab), dtype=torch.float32, device=hidden.device)
        part_w = torch.empty(weight.shape[::-1], dtype=dtype, device=weight.device) \
            if need_w and dtype != torch.float32 else None
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            h, t, scale = h_all[start:stop], target[start:stop], row_scale[start:stop]
            logits, probs = low[:stop - start], high[:stop - start]
            torch.mm(h, w.t(), out=logits)
            if probs is not logits:
                probs.copy_(logits)
            picked, top = probs.gather(1, t), probs.amax(1, keepdim=True)
            # softmax in place, in fp32; its largest value is 1/sum(exp(x - max)), never below 1/vocab, so
            # log-sum-exp = max - log(largest) with no exp over the row outside the softmax kernel
            torch.ops.aten._softmax.out(probs, 1, False, out=probs)
            lse = top - probs.amax(1, keepdim=True).log()
            total += ((lse - picked) * scale).sum()
            if not (need_h or need_w):
                continue
            # d(sum of losses)/d(logits) = softmax - one-hot; the row scale goes on the small side of each matmul
            if logits is not probs:
                logits.copy_(probs)
            grad = logits
            rows_here = torch.arange(stop - start, device=grad.device)
            grad.index_put_((rows_here, t.squeeze(1)), torch.tensor(-1.0, dtype=grad.dtype), accumulate=True)
            if need_h:
                grad_h[start:stop] = torch.mm(grad, w) * scale
            if need_w:
                hs = (h * scale).to(dtype)
                if part_w is None:
                    grad_wt.addmm_(hs.t(), grad)
                else:
                    grad_wt += torch.mm(hs.t(), grad, out=part_w)
        ctx.save_for_backward(grad_h if need_h else None, grad_wt if need_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_wt = ctx.saved_tensors
        grad_w = None
        # the loss is a scalar: its gradients were computed in the forward pass, up to grad_out
        if grad_h is not None:
            grad_h = grad_h * grad_out.to(grad_h.dtype)
        if grad_wt is not None:  # back to the weight's layout and dtype in the same pass as the scale
            grad_w = torch.empty(grad_wt.shape[::-1], dtype=ctx.weight_dtype, device=grad_wt.device)
            torch.mul(grad_wt.t(), grad_out, out=grad_w)
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         num_items_in_batch=None, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against labels (-100 ignored), or its sum over
    num_items_in_batch where given: hidden [..., d], labels [...], weight [vocab, d]. Under CPU autocast the
    matmuls run in autocast's dtype, as the head's linear would."""
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    else:
        dtype = hidden.dtype
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if num_items_in_batch is not None:
        divisor = float(num_items_in_batch)
    else:
        divisor = max(1.0, float((labels != IGNORE).sum()))
    with torch.autocast("cpu", enabled=False):
        loss = _LinearCrossEntropy.apply(hidden, weight, labels, divisor, dtype, chunk)
    return loss


def install(model) -> bool:
    """Make a causal LM's forward with labels return the chunked loss and no logits (without labels it is
    the model's own forward, logits and all). Returns whether it was installed: the model needs a base model
    that returns hidden states and an output embedding (GPT-2, Llama, ... in transformers)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None or model.base_model is model:
        return False
    own = model.forward
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:
            return own(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)[0]
        if "shift_labels" in kwargs:
            raise ValueError("shift_labels is not supported by the chunked loss")
        loss = linear_cross_entropy(hidden[:, :-1], self.get_output_embeddings().weight, labels[:, 1:],
                                    num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = types.MethodType(forward, model)
    return True
