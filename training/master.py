"""bf16 weights with fp32 master copies: the model computes in bf16 without autocast casting its weights every
step, while AdamW steps fp32 copies of them so that small updates are not rounded away."""
from __future__ import annotations

import torch


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

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The total 2-norm of the model's gradients; the next step scales them by max_norm / (norm + 1e-6)
        where that is below 1, as torch.nn.utils.clip_grad_norm_ would. Each gradient's norm is summed in fp32
        and rounded to bf16, as the Trainer's clip of bf16 gradients does (asking _foreach_norm for fp32
        results casts every gradient first: 10x slower)."""
        grads = [p.grad for p in self.model_params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)).float())
        # the fused step divides each gradient by grad_scale (torch.optim.AdamW reads the attribute); that costs
        # it a pass (~7 ms at bert-base), so only where the norm is over: the Trainer's clip multiplies always
        scale = (norm + 1e-6) / max_norm
        self.grad_scale = scale if scale.item() > 1.0 else None
        return norm

    @torch.no_grad()
    def step(self, closure=None):
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


def wanted(value, bf16: bool, ipex: bool, optim_flag: bool = False) -> bool:
    """--bf16_weights: auto takes them wherever the run trains in bf16 and neither IPEX nor the user's --optim
    chooses the optimizer."""
    from training import levers

    chosen = levers.forced(value, "--bf16_weights")
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
    from training import common

    wanted(model_args.bf16_weights, args.bf16, False, common.has_flag(argv, "--optim"))


def install(model, model_args, args, optimizers, argv: list[str], trainer_cls):
    """(model, optimizers) for the Trainer: the model in bf16 with MasterAdamW where --bf16_weights says and the
    run trains; model_args.bf16_weights becomes what was chosen (results.json)."""
    from training import common

    model_args.bf16_weights = args.do_train and wanted(model_args.bf16_weights, args.bf16, optimizers != (None, None),
                                                       common.has_flag(argv, "--optim"))
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
