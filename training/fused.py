"""An encoder layer's dense blocks in bf16 training, each as a bias-free matmul and one native pass
(training/native) forward and one backward, where torch's ops take a pass each:

- the FFN's first half, dense + GELU: the bias added, GELU and its slope computed and kept (torch's addmm first
  copies the bias into every row of its output, and GELU's backward computes erf and exp again); backward, GELU's
  gradient and the bias gradient's column sums in one pass.
- the attention's and the FFN's output, dense + dropout + residual + layer norm: the bias, the dropout (drawn as
  training/fastdrop.py's native kernel draws it), the residual and the layer norm in one pass; backward, the layer
  norm's gradient, the dropout's and the column sums for gamma, beta and the bias in one.

The matmuls are the ones autograd would run. Training in bf16 with the kernels built only: eval, fp32, autocast
over fp32 weights, torch's own dropout (--fast_dropout False) and XC_NATIVE_KERNELS=0 keep the block's own
forward."""
from __future__ import annotations

import types

import torch

from training.fastdrop import FastDropout, mask_seed

ROW_MAX = 4096  # kernels.c's ROW_MAX: wider layer norms take the block's own forward


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def _input_grads(ctx, gz, x2, weight):
    gx = torch.mm(gz, weight).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
    gw = torch.mm(gz.t(), x2) if ctx.needs_input_grad[1] else None
    return gx, gw


class _DenseGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lib):
        x2 = _rows(x)
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
        g = _rows(grad)
        threads = torch.get_num_threads()
        gz, gb = torch.empty_like(g), torch.empty(cols, dtype=torch.float32)
        scratch = torch.empty(threads * cols, dtype=torch.float32)
        ctx.lib.xc_gelu_bf16_backward(g.data_ptr(), slope.data_ptr(), gz.data_ptr(), gb.data_ptr(),
                                      scratch.data_ptr(), rows, cols, threads)
        gx, gw = _input_grads(ctx, gz, x2, weight)
        return gx, gw, gb.to(weight.dtype) if ctx.needs_input_grad[2] else None, None


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


def _native(module, *tensors):
    """training/native's library where the block trains in bf16 on CPU with a gradient, else None."""
    if not (module.training and torch.is_grad_enabled()):
        return None
    if any(t is None or t.device.type != "cpu" or t.dtype != torch.bfloat16 for t in tensors):
        return None
    from training import native

    return native.lib()


def _gelu_forward(self, hidden_states):
    d = self.dense
    lib = _native(self, hidden_states, d.weight, d.bias)
    if lib is None:
        return type(self).forward(self, hidden_states)
    return _DenseGelu.apply(hidden_states, d.weight, d.bias, lib)


def _output_forward(self, hidden_states, input_tensor):
    d, norm = self.dense, self.LayerNorm
    lib = _native(self, hidden_states, input_tensor, d.weight, d.bias, norm.weight, norm.bias)
    if (lib is None or input_tensor.shape[-1] > ROW_MAX or input_tensor.shape[:-1] != hidden_states.shape[:-1]
            or not 0.0 <= self.dropout.p < 1.0):  # the own forward says what is wrong with p
        return type(self).forward(self, hidden_states, input_tensor)
    return _DenseDropAddNorm.apply(hidden_states, d.weight, d.bias, input_tensor, norm.weight, norm.bias,
                                   self.dropout.p, norm.eps, lib)


def _exact_gelu(act) -> bool:
    from transformers.activations import GELUActivation

    return isinstance(act, GELUActivation) and act.act is torch.nn.functional.gelu


def _output_block(module) -> bool:
    """dense, then dropout (training/fastdrop's, whose masks the kernel draws alike), residual and layer norm over
    the last dimension: BERT's (and its kin's) SelfOutput and Output."""
    norm = getattr(module, "LayerNorm", None)
    return (isinstance(getattr(module, "dense", None), torch.nn.Linear)
            and isinstance(getattr(module, "dropout", None), FastDropout)
            and isinstance(norm, torch.nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None
            and len(norm.normalized_shape) == 1)


def install(model) -> int:
    """Route every encoder intermediate block (Linear `dense` then exact GELU) and output block (`dense`, fast
    dropout, residual, `LayerNorm`) through the fused path when it trains in bf16. Returns how many were routed."""
    routed = 0
    for module in model.modules():
        if not isinstance(getattr(module, "dense", None), torch.nn.Linear):
            continue
        if _exact_gelu(getattr(module, "intermediate_act_fn", None)):
            module.forward = types.MethodType(_gelu_forward, module)
            routed += 1
        elif _output_block(module):
            module.forward = types.MethodType(_output_forward, module)
            routed += 1
    return routed
