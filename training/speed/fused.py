"""An encoder layer's output blocks in bf16 training (the attention's and the FFN's): dense + dropout + residual +
layer norm as a bias-free matmul and one native pass (training/speed/native) forward and one backward, where torch's
ops take a pass each. Forward: the bias, the dropout (drawn as training/speed/fastdrop.py's native kernel draws it),
the residual and the layer norm; backward: the layer norm's gradient, the dropout's and the column sums for gamma,
beta and the bias.

The matmuls are the ones autograd would run. Training in bf16 with the kernels built only: eval, fp32, autocast
over fp32 weights, torch's own dropout (--fast_dropout False) and XC_NATIVE_KERNELS=0 keep the block's own
forward. (The FFN's dense + GELU had a kernel too; on an AMX Xeon it saved under 3% of a step, and it was
deleted: docs/benchmarks.md.)"""
from __future__ import annotations

import types

import torch

from training.speed import native
from training.speed.fastdrop import FastDropout, mask_seed

ROW_MAX = 4096  # kernels.c's ROW_MAX: wider layer norms take the block's own forward


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def _input_grads(ctx, gz, x2, weight):
    gx = torch.mm(gz, weight).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
    gw = torch.mm(gz.t(), x2) if ctx.needs_input_grad[1] else None
    return gx, gw


class _DenseDropAddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, gamma, beta, p, eps, lib):
        x2 = _rows(x)
        h = torch.mm(x2, weight.t())
        rows, cols = h.shape
        res = _rows(residual)
        y, r = torch.empty_like(h), torch.empty_like(h)
        mask = torch.empty(h.shape, dtype=torch.uint8)
        mean, rstd = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
        seed = mask_seed() if p > 0 else 0
        ctx.scale = 1.0 / (1.0 - p)
        lib.xc_dense_out_bf16_forward(h.data_ptr(), bias.data_ptr(), res.data_ptr(), gamma.data_ptr(),
                                      beta.data_ptr(), y.data_ptr(), r.data_ptr(), mask.data_ptr(), mean.data_ptr(),
                                      rstd.data_ptr(), rows, cols, seed, round(p * 65536), ctx.scale, eps,
                                      torch.get_num_threads())
        ctx.save_for_backward(x2, weight, r, mean, rstd, gamma, mask)
        ctx.lib, ctx.in_shape, ctx.out_shape = lib, x.shape, residual.shape
        return y.view(residual.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, r, mean, rstd, gamma, mask = ctx.saved_tensors
        rows, cols = r.shape
        g = _rows(grad)
        threads = torch.get_num_threads()
        g_res, gz = torch.empty_like(g), torch.empty_like(g)
        sums = torch.empty(3, cols, dtype=torch.float32)
        scratch = torch.empty(3 * threads * cols, dtype=torch.float32)
        ctx.lib.xc_dense_out_bf16_backward(g.data_ptr(), r.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                                           gamma.data_ptr(), mask.data_ptr(), ctx.scale, g_res.data_ptr(),
                                           gz.data_ptr(), sums[0].data_ptr(), sums[1].data_ptr(), sums[2].data_ptr(),
                                           scratch.data_ptr(), rows, cols, threads)
        gx, gw = _input_grads(ctx, gz, x2, weight)
        d_gamma, d_beta, d_bias = sums.to(weight.dtype).unbind(0)
        need = ctx.needs_input_grad
        return (gx, gw, d_bias if need[2] else None, g_res.view(ctx.out_shape) if need[3] else None,
                d_gamma if need[4] else None, d_beta if need[5] else None, None, None, None)


def _native(kernel: str, module, *tensors):
    """training/speed/native's library where the block trains in bf16 on CPU with a gradient, else None."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    if any(t is None or t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in tensors):
        native.took(kernel, "torch (the kernel is for bf16 weights and activations on the CPU)")
        return None
    return native.lib(kernel)


def _output_forward(self, hidden_states, input_tensor):
    d, norm = self.dense, self.LayerNorm
    lib = _native("output", self, hidden_states, input_tensor, d.weight, d.bias, norm.weight, norm.bias)
    if (lib is None or input_tensor.shape[-1] > ROW_MAX or input_tensor.shape[:-1] != hidden_states.shape[:-1]
            or not 0.0 <= self.dropout.p < 1.0):  # the own forward says what is wrong with p
        return type(self).forward(self, hidden_states, input_tensor)
    return _DenseDropAddNorm.apply(hidden_states, d.weight, d.bias, input_tensor, norm.weight, norm.bias,
                                   self.dropout.p, norm.eps, lib)


def _output_block(module) -> bool:
    """dense, then dropout (training/speed/fastdrop's, whose masks the kernel draws alike), residual and layer norm over
    the last dimension: BERT's (and its kin's) SelfOutput and Output."""
    norm = getattr(module, "LayerNorm", None)
    return (isinstance(getattr(module, "dense", None), torch.nn.Linear)
            and isinstance(getattr(module, "dropout", None), FastDropout)
            and isinstance(norm, torch.nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None
            and len(norm.normalized_shape) == 1)


def install(model) -> int:
    """Route every encoder output block (`dense`, fast dropout, residual, `LayerNorm`) through the fused path when
    it trains in bf16. Returns how many were routed."""
    routed = 0
    for module in model.modules():
        if _output_block(module):
            module.forward = types.MethodType(_output_forward, module)
            routed += 1
    return routed
