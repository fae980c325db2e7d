"""A causal LM's head and loss in row chunks: the full fp32 logits are never held at once.

GPT-2's head is a [tokens, 50257] matmul; transformers then takes log_softmax of the whole fp32 matrix and
keeps it for the backward pass (823 MB at 4 x 1024 tokens, and ~12% of a bf16 step on 2 cores for the
softmax and its backward alone: bench/clm_step.py). Here each chunk of rows is projected, its log-sum-exp
taken in fp32, and its gradient (softmax minus one-hot) turned into the hidden states' and the weight's
gradients at once, so the forward pass keeps only those two and no logits. The loss is the same sum over
the labelled tokens over the same divisor as transformers' ForCausalLMLoss (labels shifted by one, -100
ignored, `num_items_in_batch` when the Trainer passes it, else their count).
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
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        # one set of buffers for every chunk: a fresh 200 MB tensor per chunk costs its page faults each time
        n = min(chunk, rows)
        low = torch.empty((n, vocab), dtype=dtype, device=hidden.device)
        high = low if dtype == torch.float32 else torch.empty((n, vocab), dtype=torch.float32, device=hidden.device)
        part_w = torch.empty(weight.shape, dtype=dtype, device=weight.device) if need_w and dtype != torch.float32 else None
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            h, t, scale = h_all[start:stop], target[start:stop], row_scale[start:stop]
            logits, logp = low[:stop - start], high[:stop - start]
            torch.mm(h, w.t(), out=logits)
            if logp is not logits:
                logp.copy_(logits)
            torch.ops.aten._log_softmax.out(logp, 1, False, out=logp)  # in place, row by row, in fp32
            total -= (logp.gather(1, t) * scale).sum()
            if not (need_h or need_w):
                continue
            # d(sum of losses)/d(logits) = softmax - one-hot; the row scale goes on the small side of each matmul
            grad = torch.exp(logp, out=logits)
            grad.scatter_add_(1, t, torch.full(t.shape, -1.0, dtype=grad.dtype, device=grad.device))
            if need_h:
                grad_h[start:stop] = torch.mm(grad, w) * scale
            if need_w:
                hs = (h * scale).to(dtype)
                if part_w is None:
                    grad_w.addmm_(grad.t(), hs)
                else:
                    grad_w += torch.mm(grad.t(), hs, out=part_w)
        ctx.save_for_backward(grad_h if need_h else None, grad_w if need_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # the loss is a scalar: its gradients were computed in the forward pass, up to grad_out
        if grad_h is not None:
            grad_h = grad_h * grad_out.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_out).to(ctx.weight_dtype)
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
