"""The order a bundled job trains its examples in, the same at every node count.

The Trainer's own samplers shuffle per run (and group lengths in megabatches sized by the per-device batch and
accumulation), so a run that goes on with fewer nodes and more gradient accumulation (`fab train --min-nodes`) would
see other batches. GlobalOrder yields one stream per epoch from the seed alone; Accelerate hands stream batch k to
rank k mod world, and the Trainer accumulates A of them per rank, so optimizer step s always takes the stream's
examples [s*G, (s+1)*G) with G = per-device batch x ranks x accumulation, the run's global batch, whatever the
world size. The tail that does not fill a global batch is left out of that epoch (a different tail each epoch).
"""
from __future__ import annotations

import torch

MEGABATCH = 50  # global batches per length group, as the Trainer's LengthGroupedSampler groups per-device ones


class GlobalOrder(torch.utils.data.Sampler):
    def __init__(self, size: int, global_batch: int, seed: int, lengths: list[int] | None = None):
        self.size, self.global_batch, self.seed, self.lengths = size, max(1, global_batch), seed, lengths
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size - self.size % self.global_batch if self.size >= self.global_batch else self.size

    def __iter__(self):
        gen = torch.Generator()
        gen.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=gen).tolist()[:len(self)]
        if self.lengths is not None:  # long with long: less padding per batch, the same groups at any world size
            span = MEGABATCH * self.global_batch
            order = [i for at in range(0, len(order), span)
                     for i in sorted(order[at:at + span], key=lambda i: -self.lengths[i])]
        return iter(order)


def keep(trainer, train_ds, world_size: int, grouped: bool) -> GlobalOrder:
    """The trainer's training sampler from here on: GlobalOrder over train_ds, length-grouped when the job groups."""
    args = trainer.args
    lengths = None
    if grouped and "input_ids" in getattr(train_ds, "column_names", ()):
        lengths = [len(ids) for ids in train_ds["input_ids"]]
    sampler = GlobalOrder(len(train_ds), args.per_device_train_batch_size * world_size
                          * args.gradient_accumulation_steps, args.data_seed if args.data_seed is not None
                          else args.seed, lengths)
    trainer._get_train_sampler = lambda *a, **k: sampler
    return sampler
