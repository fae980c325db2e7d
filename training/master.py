"""bf16 weights with fp32 master copies: the model computes in bf16 without autocast casting its weights every
step, while AdamW steps fp32 copies of them so that small updates are not rounded away."""
from __future__ import annotations

import torch


class MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 copies of a bf16 model's parameters. step() takes the bf16 gradients into the copies,
    steps them, and writes the result back to the model rounded to bf16. Its param_groups are the copies', so
    the Trainer's schedulers set their learning rate as for any optimizer. A checkpoint holds the bf16 weights
    and AdamW's moments; on resume the masters start again from the bf16 weights."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], no_decay: set[str], lr: float,
                 weight_decay: float, **kw):
        self.model_params = [p for _, p in named]
        self.masters = [p.detach().float().requires_grad_(True) for p in self.model_params]
        groups = [{"params": [m for (n, _), m in zip(named, self.masters) if n not in no_decay],
                   "weight_decay": weight_decay},
                  {"params": [m for (n, _), m in zip(named, self.masters) if n in no_decay], "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]], lr=lr, **kw)

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none)


def bf16_master(model, args, decay_names: list[str]):
    """(model in bf16, (MasterAdamW, None)) for Trainer(optimizers=...)."""
    model = model.to(torch.bfloat16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = {n for n, _ in named if n not in set(decay_names)}
    opt = MasterAdamW(named, no_decay, lr=args.learning_rate, weight_decay=args.weight_decay,
                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, fused=True)
    return model, (opt, None)
