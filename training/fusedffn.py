"""The encoder FFN's first half, dense + GELU, as a bias-free matmul and one native pass (training/native):
the bias added, GELU and its slope computed and kept, where torch's addmm first copies the bias into every row
of its output and GELU's backward computes erf and exp again. Backward is one pass for the input gradient of
GELU and the bias gradient (column sums), then the two matmuls autograd would do. Training in bf16 only; eval,
fp32 and autocast over fp32 weights keep the module's own forward."""
from __future__ import annotations

import types

import torch


class _DenseGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lib):
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        h = torch.mm(x2, weight.t())
        rows, cols = h.shape
        y, slope = torch.empty_like(h), torch.empty_like(h)
        lib.xc_bias_gelu_bf16_forward(h.data_ptr(), bias.data_ptr(), y.data_ptr(), slope.data_ptr(), rows, cols,
                                      torch.get_num_threads())
        ctx.save_for_backward(x2, weight, slope)
        ctx.lib, ctx.in_shape = lib, x.shape
        return y.view(*x.shape[:-1], cols)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, slope = ctx.saved_tensors
        rows, cols = slope.shape
        g = grad.reshape(rows, cols)
        if not g.is_contiguous():
            g = g.contiguous()
        threads = torch.get_num_threads()
        gz, gb = torch.empty_like(g), torch.empty(cols, dtype=torch.float32)
        scratch = torch.empty(threads * cols, dtype=torch.float32)
        ctx.lib.xc_gelu_bf16_backward(g.data_ptr(), slope.data_ptr(), gz.data_ptr(), gb.data_ptr(),
                                      scratch.data_ptr(), rows, cols, threads)
        gx = torch.mm(gz, weight).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        gw = torch.mm(gz.t(), x2) if ctx.needs_input_grad[1] else None
        return gx, gw, gb.to(weight.dtype) if ctx.needs_input_grad[2] else None, None


def _exact_gelu(act) -> bool:
    from transformers.activations import GELUActivation

    return isinstance(act, GELUActivation) and act.act is torch.nn.functional.gelu


def _forward(self, hidden_states):
    d = self.dense
    if (self.training and torch.is_grad_enabled() and d.bias is not None and hidden_states.device.type == "cpu"
            and hidden_states.dtype == d.weight.dtype == d.bias.dtype == torch.bfloat16):
        from training import native

        lib = native.lib()
        if lib is not None:
            return _DenseGelu.apply(hidden_states, d.weight, d.bias, lib)
    return type(self).forward(self, hidden_states)


def install(model) -> int:
    """Route every encoder intermediate block (a Linear `dense` then exact GELU, BERT's and its kin's) through the
    fused path when it trains in bf16. Returns how many blocks were routed."""
    routed = 0
    for module in model.modules():
        if isinstance(getattr(module, "dense", None), torch.nn.Linear) and _exact_gelu(
                getattr(module, "intermediate_act_fn", None)):
            module.forward = types.MethodType(_forward, module)
            routed += 1
    return routed
