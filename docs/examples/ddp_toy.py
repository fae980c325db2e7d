"""A plain-PyTorch DDP script that survives spot with xeon-cluster's contract, importing nothing of ours.

    fab train --nodes 2 --script docs/examples/ddp_toy.py -- --steps 200

The contract (docs/scripts.md, "Spot notices in your own script"), all environment variables:
  XC_NOTICE_FILE     appears on every rank once a node got a spot notice or a group termination: save now
  XC_CHECKPOINT_DIR  where rank 0 saves checkpoint-<step>/, writing an empty file `xc-complete` in it last
  exit 75            preempted: fab records the run `preempted` and `fab train --resume` restarts it
  XC_RESUME_FROM     on a resume: the checkpoint folder to continue from
  XC_GRAD_ACCUM      going on with fewer nodes (fab train --min-nodes): this many batches per optimizer step
Outside fab none is set: the script trains as any DDP script does (torchrun, or one process).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to give a test time for a notice)")
a = p.parse_args()

distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step = 0
resume = os.environ.get("XC_RESUME_FROM")
if resume:  # model, optimizer and step: the run continues where the checkpoint left it
    state = torch.load(os.path.join(resume, "state.pt"), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
    print(f"resumed from {resume} at step {step}", flush=True)
ddp = DDP(model) if distributed else model
gen = torch.Generator().manual_seed(1000 * rank + step)  # this rank's data from where the run is
w_true = torch.arange(8, dtype=torch.float32)


def save(step: int) -> None:
    """Rank 0 writes checkpoint-<step>/ and marks it complete last; a half-written folder never counts."""
    folder = os.path.join(os.environ.get("XC_CHECKPOINT_DIR", "checkpoints"), f"checkpoint-{step}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, os.path.join(folder, "state.pt"))
    open(os.path.join(folder, "xc-complete"), "w").close()


notice_file = os.environ.get("XC_NOTICE_FILE")
accum = int(os.environ.get("XC_GRAD_ACCUM", "1"))  # fewer ranks, more batches each: the same global batch
while step < a.steps:
    opt.zero_grad()
    for _ in range(accum):
        x = torch.randn(32, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x).squeeze(-1), x @ w_true) / accum
        loss.backward()
    opt.step()
    step += 1
    time.sleep(a.sleep)
    # Every rank asks at the same step whether any rank has the notice file: one all-reduce, so all stop together.
    noticed = torch.tensor([int(bool(notice_file) and os.path.exists(notice_file))])
    if distributed:
        dist.all_reduce(noticed, op=dist.ReduceOp.MAX)
    if noticed.item():
        if rank == 0:
            save(step)
            print(f"notice: saved step {step}, exiting 75", flush=True)
        if distributed:
            dist.barrier()  # rank 0's checkpoint is written before any rank leaves
            dist.destroy_process_group()
        sys.exit(75)
    if rank == 0 and step % 50 == 0:
        print(f"step {step} loss {loss.item() * accum:.4f}", flush=True)

if rank == 0:
    print(f"done at step {step} loss {loss.item() * accum:.4f}", flush=True)
if distributed:
    dist.destroy_process_group()
