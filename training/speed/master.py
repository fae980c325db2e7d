"""bf16 weights with fp32 master copies: the model computes in bf16 without autocast casting its weights every
step, while AdamW steps fp32 copies of them so that small updates are not rounded away."""
from __future__ import annotations

import ctypes
import math

import torch

from training.speed import levers, native


class MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 copies of a bf16 model's parameters. step() takes the bf16 gradients into the copies,
    steps them, and writes the result back to the model rounded to bf16. Its param_groups are the copies', so
    the Trainer's schedulers set their learning rate as for any optimizer. Its state_dict holds the masters
    (fp32_masters) beside AdamW's moments, so a resumed run steps on from exactly where it stopped; a
    checkpoint without them (an autocast run's) starts the masters from the model's weights as loaded.

    The copies and their gradients live in two flat fp32 buffers made once: a gradient taken in each step by
    one multi-tensor copy, not a fresh fp32 tensor per weight (4 bytes a weight, new pages every step).

    clip_grad_norm() is the Trainer's clip (attach() routes it here) without its pass over the gradients: the
    norm is taken from the bf16 gradients, and where it is over max_norm the fused step divides the fp32
    copies by the clip factor as it reads them."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], no_decay: set[str], lr: float,
                 weight_decay: float, **kw):
        self.model_params = [p for _, p in named]
        sizes = [p.numel() for p in self.model_params]
        flat = self._flat = torch.empty(sum(sizes), dtype=torch.float32)
        self._grads = [g.view_as(p) for g, p in zip(torch.zeros_like(flat).split(sizes), self.model_params)]
        self.masters = [m.view_as(p) for m, p in zip(flat.split(sizes), self.model_params)]
        torch._foreach_copy_(self.masters, [p.detach() for p in self.model_params])
        groups = [{"params": [m for (n, _), m in zip(named, self.masters) if n not in no_decay],
                   "weight_decay": weight_decay},
                  {"params": [m for (n, _), m in zip(named, self.masters) if n in no_decay], "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]], lr=lr, **kw)
        self._native = None  # training/speed/native's kernels once looked up; False: torch's path

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The total 2-norm of the model's gradients; the next step scales them by max_norm / (norm + 1e-6)
        where that is below 1, as torch.nn.utils.clip_grad_norm_ would. Each gradient's norm is summed in fp32
        and rounded to bf16, as the Trainer's clip of bf16 gradients does (asking _foreach_norm for fp32
        results casts every gradient first: 10x slower); where training/speed/native is built, in one pass over all of
        them (3.8 against 6.5 ms at bert-base's gradients), the same norms bit for bit (tested)."""
        grads = [p.grad for p in self.model_params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norms = self._native_norms()
        if norms is None:
            norms = torch.stack(torch._foreach_norm(grads, 2))
        norm = torch.linalg.vector_norm(norms.float())
        # the fused step divides each gradient by grad_scale (torch.optim.AdamW reads the attribute); that costs
        # it a pass (~7 ms at bert-base), so only where the norm is over: the Trainer's clip multiplies always
        scale = (norm + 1e-6) / max_norm
        self.grad_scale = scale if scale.item() > 1.0 else None
        return norm

    def _native_norms(self) -> torch.Tensor | None:
        """Each gradient's norm, fp32 sums rounded to bf16 as _foreach_norm gives them, from one native pass over
        every bf16 gradient (torch: a call per weight); None where the kernels or the gradients do not fit."""
        grads = [p.grad for p in self.model_params]
        if not self._native_step_ready() or any(
                g is not None and (g.dtype != torch.bfloat16 or not g.is_contiguous()) for g in grads):
            return None
        ptrs = (ctypes.c_void_p * len(grads))(*(None if g is None else g.data_ptr() for g in grads))
        sums = torch.empty(len(self._chunks), dtype=torch.float32)
        self._native.xc_sumsq_bf16(ptrs, self._chunks, len(self._chunks), sums.data_ptr(), torch.get_num_threads())
        per = torch.zeros(len(grads), dtype=torch.float32).index_add_(0, self._chunk_tensor, sums)
        return per.sqrt().to(torch.bfloat16)[[g is not None for g in grads]]

    @torch.no_grad()
    def step(self, closure=None):
        if self._native_step_ready():
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            try:
                self._native_step()
            finally:
                self.grad_scale = None
            return loss
        for p, m, g in zip(self.model_params, self.masters, self._grads):
            m.grad = None if p.grad is None else g
        stepped = [(m.grad, p.grad) for p, m in zip(self.model_params, self.masters) if p.grad is not None]
        if stepped:
            torch._foreach_copy_(*map(list, zip(*stepped)))
        try:
            loss = super().step(closure)
        finally:
            self.grad_scale = None
        torch._foreach_copy_(self.model_params, self.masters)
        return loss

    def _native_step_ready(self) -> bool:
        if self._native is None:
            plain = all(not g.get(k) for g in self.param_groups for k in ("amsgrad", "maximize", "capturable",
                                                                            "differentiable"))
            # the kernel takes one beta1, beta2 and eps for every tensor
            plain = plain and len({(tuple(g["betas"]), g["eps"]) for g in self.param_groups}) == 1
            if not plain:
                native.took("adamw", "torch (the kernel takes no amsgrad, maximize, capturable, differentiable or per-group betas)")
            lib = native.lib("adamw") if plain else None
            self._native = lib if lib is not None and plain else False
            if self._native:
                size = 1 << 16  # one OpenMP task: large enough to stream, small enough to share out evenly
                chunks = [(t, b, min(b + size, m.numel())) for t, m in enumerate(self.masters)
                          for b in range(0, m.numel(), size)]
                self._chunks = (native.Chunk * len(chunks))(*chunks)
                self._chunk_tensor = torch.tensor([t for t, _, _ in chunks], dtype=torch.int64)
        return bool(self._native)

    def _native_step(self) -> None:
        """AdamW as torch's fused step computes it, in one pass over each weight (training/speed/native/kernels.c):
        the bf16 gradient read where autograd left it, the bf16 weight written from its new master. torch's
        path: a copy of every gradient to fp32, the fused step, a copy of every master back to bf16."""
        n = len(self.masters)
        group_of = {id(m): g for g in self.param_groups for m in g["params"]}
        ptrs = {k: (ctypes.c_void_p * n)() for k in ("grad", "weight", "master", "m", "v")}
        coef = (native.AdamWCoef * n)()
        keep_alive, steps, stepped = [], [], []
        beta1 = beta2 = eps = None
        for t, (p, m) in enumerate(zip(self.model_params, self.masters)):
            ptrs["weight"][t], ptrs["master"][t] = p.data_ptr(), m.data_ptr()
            if p.grad is None:
                continue
            g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            keep_alive.append(g)
            state = self.state[m]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            ptrs["grad"][t], ptrs["m"][t], ptrs["v"][t] = g.data_ptr(), state["exp_avg"].data_ptr(), \
                state["exp_avg_sq"].data_ptr()
            steps.append(state["step"])
            stepped.append((t, group_of[id(m)]))
        if not steps:
            return
        torch._foreach_add_(steps, 1)
        for (t, group), step in zip(stepped, torch.stack(steps).tolist()):
            lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
            coef[t].keep = 1 - lr * group["weight_decay"]
            coef[t].step_size = lr / (1 - beta1 ** step)
            coef[t].bc2_sqrt = math.sqrt(1 - beta2 ** step)
        scale = getattr(self, "grad_scale", None)
        scale = 1.0 if scale is None else float(scale)
        self._native.xc_adamw_bf16(ptrs["grad"], ptrs["weight"], ptrs["master"], ptrs["m"], ptrs["v"], coef,
                                   self._chunks, len(self._chunks), beta1, beta2, eps, scale, torch.get_num_threads())

    def state_dict(self):
        return {**super().state_dict(), "fp32_masters": self._flat}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        flat = state_dict.pop("fp32_masters", None)
        super().load_state_dict(state_dict)
        if flat is not None and flat.shape == self._flat.shape:
            self._flat.copy_(flat)
        else:  # the Trainer loads a checkpoint's weights into the model before the optimizer's state
            torch._foreach_copy_(self.masters, [p.detach() for p in self.model_params])

    @torch.no_grad()
    def to_fp32(self, model) -> None:
        """The model back in fp32 holding the masters themselves: what is saved and evaluated after training
        is what an autocast run would leave, not the weights rounded to bf16."""
        model.float()
        torch._foreach_copy_(self.model_params, self.masters)

    def zero_grad(self, set_to_none: bool = True):
        for p in self.model_params:
            p.grad = None
        for m in self.masters:
            m.grad = None


def install(model, model_args, args, optimizers, argv: list[str], trainer_cls):
    """(model, optimizers) for the Trainer: the model in bf16 with MasterAdamW where --bf16_weights says and the
    run trains; model_args.bf16_weights becomes what was chosen (results.json)."""
    model_args.bf16_weights = args.do_train and levers.bf16_weights_wanted(model_args.bf16_weights, args.bf16, optimizers != (None, None),
                                                       levers.has_flag(argv, "--optim"))
    if not model_args.bf16_weights:
        return model, optimizers
    return bf16_master(model, args, trainer_cls.get_decay_parameter_names(None, model))


def attach(trainer, optimizers) -> bool:
    """Route the Trainer's gradient clipping (and its norm for the logs) to MasterAdamW.clip_grad_norm where
    MasterAdamW steps; its own clip rewrites every bf16 gradient each step, factor 1.0 included (norm and step
    47.9 against 55.0 ms at bert-base when not clipped, 51.7 against 54.5 when clipped).
    Returns whether it did (a Trainer without those methods keeps its own clip)."""
    opt = optimizers[0]
    if not isinstance(opt, MasterAdamW) or not all(hasattr(trainer, m) for m in ("_clip_grad_norm", "_get_grad_norm")):
        return False
    trainer._clip_grad_norm = lambda model: opt.clip_grad_norm(trainer.args.max_grad_norm)
    trainer._get_grad_norm = lambda model, grad_norm=None: (
        opt.clip_grad_norm(float("inf")) if grad_norm is None else grad_norm)
    return True


def restore_fp32(model, optimizers) -> None:
    """After training: the saved and evaluated model holds the fp32 masters, as an autocast run leaves it."""
    if isinstance(optimizers[0], MasterAdamW):
        optimizers[0].to_fp32(model)


def bf16_master(model, args, decay_names: list[str]):
    """(model in bf16, (MasterAdamW, None)) for Trainer(optimizers=...)."""
    model = model.to(torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = {n for n, _ in named if n not in set(decay_names)}
    opt = MasterAdamW(named, no_decay, lr=args.learning_rate, weight_decay=args.weight_decay,
                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=True)
    return model, (opt, None)
