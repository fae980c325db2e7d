"""Gradient compression on the wire (fab train --comm-hook): the hooks average like DDP's own all-reduce,
within the wire format's rounding, on two real gloo processes; DDP's timings reach results.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training.jobs import dist

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as td
    from torch.nn.parallel import DistributedDataParallel as DDP
    from training.jobs import dist
    rank, hook, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    td.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 32))
    if hook != "none":
        model.register_comm_hook(None, dist.compress_hook(getattr(torch, hook)))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank + 1))
    model(x).pow(2).sum().backward()
    print(json.dumps([model.module.weight.grad.flatten().tolist(), model.module.bias.grad.tolist()]), flush=True)
    td.barrier()
    os._exit(0)  # gloo's teardown aborts now and then ('terminate called'); the job's finish() has barriers for it
""")


def _grads(tmp_path: Path, hook: str) -> list[float]:
    store = tmp_path / f"store-{hook}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), hook, str(store)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    w0, b0 = json.loads(outs[0][0])
    w1, b1 = json.loads(outs[1][0])
    assert w0 == w1 and b0 == b1  # every rank ends with the same averaged gradient
    return w0 + b0


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> list[float]:
    """DDP's own fp32 all-reduce: computed once for both wire formats."""
    return _grads(tmp_path_factory.mktemp("exact"), "none")


@pytest.mark.parametrize("hook, tolerance", [("bfloat16", 2 ** -7), ("float16", 2 ** -10)])
def test_compressed_all_reduce_averages_like_fp32_within_the_wire_formats_rounding(tmp_path, exact, hook, tolerance):
    wire = _grads(tmp_path, hook)
    assert len(exact) == 64 * 32 + 32
    # errors relative to the largest gradient: terms of opposite sign cancel, so elementwise ratios mislead
    worst = max(abs(a - b) for a, b in zip(exact, wire)) / max(abs(a) for a in exact)
    assert 0 < worst <= 2 * tolerance  # it did go through the narrower format, and only rounded


def test_an_unknown_hook_is_one_line_naming_the_choices(monkeypatch):
    monkeypatch.setenv("XC_COMM_HOOK", "int8")
    with pytest.raises(ValueError, match=r"XC_COMM_HOOK='int8' is not one of none, bf16, fp16; pass --comm-hook"):
        dist.comm_hook(object())
