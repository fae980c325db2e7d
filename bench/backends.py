"""gloo against oneCCL for the jobs' DDP traffic: all-reduce bus bandwidth and a 2-process bert-base training step.

Two processes, one core each (this machine's 2 cores), on the network twin (`fab local-up --nodes 2 --netns
--link RATE`, root only: each process in its own node's network namespace, their traffic through a veth pair and
a bridge shaped by tc at RATE) or, with --loopback or where the twin cannot be made, over loopback (said so on
every line). For each backend that can run here:
  all-reduce   bus bandwidth (2(n-1)/n x bytes / seconds, NCCL's definition) of one flat gradient the size of
               MiniLM-L6's (22.7 M) and bert-base's (109.5 M) trainable parameters, fp32 and bf16: the median of
               --iters all-reduces after one warm-up
  train step   bert-base's shape (random weights, bench/model_shapes.py) wrapped in DDP as the jobs wrap it (fp32
               gradients, DDP's default buckets), bf16 autocast where the CPU has bf16, fused AdamW, the bundled
               paraphrase pairs at --batch per process: samples/s of both processes together, the median step
               of --steps after two warm-up steps
ccl = oneCCL 2022.2 through a DDP comm hook (own ctypes shim), not the discontinued bindings: Intel stopped
publishing oneccl_bindings_for_pytorch (torch-ccl issue #80), so the ccl side is bench/ccl_shim/ccl_shim.cpp
(bench/ccl_comm.py builds it against the `oneccl-devel` wheel's CPU-only library and loads it with ctypes).
Its all-reduces call oneCCL directly; its train step is the same DDP model with a comm hook that all-reduces each
gradient bucket with oneCCL and averages it, --ccl-hook async (default: on one worker thread per process, buckets
in order, returning a future at once, so it overlaps the backward pass as gloo's all-reduces do) or sync (on the
backward pass's thread, blocking it: the first measurement's hook) or both (timed in turn); gloo then only
bootstraps and keeps time (the KVS address, DDP's initial broadcast and its per-forward broadcast of BERT's
small index buffers, the barriers). Before it is timed the ccl step is checked against the gloo path from the
same start: each hook's averaged gradients, and the parameters after one step, equal to gloo's and on both
ranks; the bench fails where they are not.
oneCCL's transport is its ofi ATL over libfabric's tcp provider (the one impi-rt ships) on the same interface
as gloo. Each all-reduce path first sums a known pattern and the bench fails where the sum is wrong. Without
oneCCL's wheels (not a dependency of the project) the bench says how to get them and measures gloo alone.
The CPU model and flags and the load are printed with every figure. Last line:
    gloo_samples_s=A ccl_samples_s=B ratio=R      (R = B / A), or, without ccl,
    gloo_samples_s=A ccl_samples_s=unmeasured
Writes bench/results/backends.json.

    sudo .venv/bin/python bench/backends.py [--link 12.5gbit] [--loopback] [--ccl-hook async|sync|both]
                                            [--iters 10] [--steps 5] [--batch 8]
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ccl_comm
from glue_single_node import cpu_line, load_line

SIZES = {"minilm": 22_713_216, "bert-base": 109_483_778}  # trainable parameters (bert-base: its 2-label head too)
FAB = [str(ROOT / ".venv" / "bin" / "fab")] if (ROOT / ".venv" / "bin" / "fab").exists() else ["fab"]


def worker(backend: str, rank: int, iters: int, steps: int, batch: int, hooks: tuple[str, ...]) -> dict:
    """One rank: the all-reduces, then the training step. MASTER_ADDR/PORT and WORLD_SIZE come from the env."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    n = dist.get_world_size()
    ccl = ccl_comm.Ccl(os.environ["XC_CCL_SHIM"]) if backend == "ccl" else None
    reduce = ccl.all_reduce if ccl else dist.all_reduce
    out: dict = {"allreduce": {}}
    for name, numel in SIZES.items():
        for dtype in (torch.float32, torch.bfloat16):
            t = ccl_comm.pattern(numel, rank + 1, dtype)
            ccl_comm.check_sum(reduce, t, rank, n)  # the warm-up: a wrong sum raises, and the bench fails
            times = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                reduce(t)
                times.append(time.perf_counter() - start)
            s = statistics.median(times)
            nbytes = numel * t.element_size()
            out["allreduce"][f"{name}/{str(dtype).removeprefix('torch.')}"] = {
                "bytes": nbytes, "median_s": s, "busbw_gbit": 2 * (n - 1) / n * nbytes * 8 / s / 1e9,
                "spread_s": [min(times), max(times)]}
            del t
    out["step"] = train_step(steps, batch, rank, n, ccl, hooks)
    if ccl:
        ccl.close()
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.destroy_process_group()
    return out


def train_step(steps: int, batch: int, rank: int, world: int, ccl=None, hooks: tuple[str, ...] = ("async",)) -> dict:
    """With ccl, DDP's gradient buckets go through oneCCL (a comm hook) instead of the gloo group; hooks: the hook
    modes timed (ccl_comm.Ccl.hook), one step each in turn, the first the headline figure. Before timing, the ccl
    step is checked against the gloo path from the same start (check_ccl_step; a mismatch fails the bench)."""
    import model_shapes
    import torch
    import torch.distributed as dist
    from compile_step import batches
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging

    from training.speed import fastdrop
    from training.speed.mfu import cpu_flags

    logging.set_verbosity_error()
    s = model_shapes.BERT_BASE
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        intermediate_size=s.ffn, num_labels=2, attn_implementation="eager"))
    fastdrop.install(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = SimpleNamespace(mode=hooks[0])
    if ccl:
        ddp.register_comm_hook(state, ccl.hook)
    else:
        hooks = ("builtin",)  # gloo: DDP's own all-reduce, no hook
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    bf16 = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    data = batches((steps * len(hooks) + 2) * world, batch, 1)[rank::world]

    def backward(enc, labels) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ddp(**enc, labels=labels).loss
        loss.backward()

    check = check_ccl_step(model, opt, backward, data[0], state, hooks) if ccl else None
    timed: list[tuple[str, float]] = []
    for i, (enc, labels) in enumerate(data):
        state.mode = hooks[i % len(hooks)]  # interleaved, so both hooks see the same load
        dist.barrier()
        start = time.perf_counter()
        backward(enc, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timed.append((state.mode, time.perf_counter() - start))
    by_hook = {}
    for mode in hooks:
        times = [t for m, t in timed[2:] if m == mode]
        step = statistics.median(times)
        by_hook[mode] = {"median_step_s": step, "samples_per_s": world * batch / step, "steps": times}
    return {**by_hook[hooks[0]], "hook": hooks[0], "by_hook": by_hook, "check": check,
            "precision": "bf16" if bf16 else "fp32",
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def check_ccl_step(model, opt, backward, batch, state, hooks) -> dict:
    """From the same parameters, dropout seed and batch: the averaged gradients of each ccl hook mode against the
    gloo path's (torch's default all-reduce hook over gloo), then one AdamW step through hooks[0]: its parameters
    must equal the gloo path's step and be equal on every rank. The gradients are compared as well as the
    parameters because AdamW's first step barely depends on the gradients' scale (a missing 1/world would pass).
    Leaves the model one step on, the optimizer without state. Raises where anything differs."""
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]

    def flat(ts) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in ts])

    def pass_through(mode: str) -> None:
        state.mode = mode
        torch.manual_seed(1)  # the same dropout masks every time
        backward(*batch)

    def max_diff(buf: torch.Tensor, ts) -> tuple[float, float]:
        """(max |t - buf|, max |buf|) over the flat view of ts."""
        worst, i = 0.0, 0
        for t in ts:
            n = t.numel()
            worst = max(worst, float((t.detach().reshape(-1) - buf[i:i + n]).abs().max()))
            i += n
        return worst, float(buf.abs().max())

    start = flat(params)
    pass_through("gloo")
    ref_grad = flat(p.grad for p in params)
    opt.step()  # the gloo path's parameters after one step
    ref_param = start
    with torch.no_grad():  # swap: the model back at the start, ref_param the gloo path's step
        i = 0
        for p in params:
            n = p.numel()
            after = p.detach().reshape(-1).clone()
            p.copy_(start[i:i + n].view_as(p))
            start[i:i + n] = after
            i += n
    opt.state.clear()
    opt.zero_grad(set_to_none=True)
    out: dict = {"grad": {}, "tolerance": {"grad_rtol": 1e-5, "param_atol": 1e-7}}
    for mode in reversed(hooks):  # hooks[0] last: it takes the step
        pass_through(mode)
        d, scale = max_diff(ref_grad, (p.grad for p in params))
        out["grad"][mode] = {"max_abs_diff": d, "max_abs_gloo": scale}
        if mode != hooks[0]:
            opt.zero_grad(set_to_none=True)
    del ref_grad
    opt.step()
    opt.state.clear()
    opt.zero_grad(set_to_none=True)
    out["param_vs_gloo"], _ = max_diff(ref_param, params)
    del ref_param, start
    worst = 0.0  # rank 0's parameters against every other rank's, tensor by tensor over gloo
    for p in params:
        theirs = p.detach().clone()
        dist.broadcast(theirs, 0)
        worst = max(worst, float((theirs - p.detach()).abs().max()))
    stats = torch.tensor([worst, out["param_vs_gloo"], *(g["max_abs_diff"] for g in out["grad"].values())],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    out["param_across_ranks"], out["param_vs_gloo"] = float(stats[0]), float(stats[1])
    for g, v in zip(out["grad"].values(), stats[2:].tolist(), strict=True):
        g["max_abs_diff"] = v
    bad = [f"{m} gradients differ from gloo's by up to {g['max_abs_diff']:.3g} (largest {g['max_abs_gloo']:.3g})"
           for m, g in out["grad"].items() if g["max_abs_diff"] > 1e-5 * g["max_abs_gloo"]]
    if out["param_vs_gloo"] > 1e-7:
        bad.append(f"parameters after one {hooks[0]} step differ from gloo's by up to {out['param_vs_gloo']:.3g}")
    if out["param_across_ranks"] != 0.0:
        bad.append(f"parameters after one {hooks[0]} step differ between ranks by up to {stats[0]:.3g}")
    if bad:
        raise RuntimeError("ccl step check FAILED: " + "; ".join(bad))
    return out


class Twin:
    """fab's network twin of 2 nodes in a state folder of its own (so no other cluster is touched)."""

    def __init__(self, tmp: Path, link: str, port: int):
        self.env = {**os.environ, "XC_STATE_DIR": str(tmp / "state"), "XC_RUNS_DIR": str(tmp / "runs")}
        self.link, self.port, self.tmp = link, port, tmp

    def fab(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*FAB, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=180,
                              check=False)

    def up(self) -> list[tuple[str, str]]:
        """[(namespace, address)] of node0 and node1."""
        res = self.fab("local-up", "--nodes", "2", "--netns", "--link", self.link, "--port", str(self.port))
        if res.returncode != 0:
            raise RuntimeError((res.stdout + res.stderr).strip().splitlines()[-1] if (res.stdout + res.stderr).strip()
                               else f"fab local-up exited {res.returncode}")
        rec = json.loads((self.tmp / "state" / "local" / "state.json").read_text())["netns"]
        net = ipaddress.IPv4Network(rec["subnet"])
        return [(f"xc-{rec['id']}-node{i}", str(net[2 + i])) for i in range(2)]

    def down(self) -> None:
        self.fab("local-down")


def launch(backend: str, places: list[tuple[list[str], str]], master: str, a, shim: str = "") -> dict:
    """Rank i runs under places[i]'s command prefix, pinned to core i; returns rank 0's figures. ccl ranks get
    oneCCL's settings (bench/ccl_comm.py) in their environment, and the shim's path."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank, (prefix, iface) in enumerate(places):
            core = rank % (os.cpu_count() or 1)
            env = {**os.environ, "MASTER_ADDR": master, "MASTER_PORT": str(a.master_port), "WORLD_SIZE": "2",
                   "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": iface}
            if backend == "ccl":
                env.update(ccl_comm.child_env(iface, core), XC_CCL_SHIM=shim)
            cmd = [*prefix, "taskset", "-c", str(core), sys.executable, __file__, "--worker",
                   backend, "--rank", str(rank), "--out", f"{tmp}/rank{rank}.json", "--iters", str(a.iters),
                   "--steps", str(a.steps), "--batch", str(a.batch), "--ccl-hook", a.ccl_hook]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{backend}: a rank failed:\n" + "\n".join(x[-1500:] for x in logs))
        return json.loads(Path(f"{tmp}/rank0.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="12.5gbit", help="the twin's link rate (tc), e.g. 12.5gbit or 25gbit")
    p.add_argument("--loopback", action="store_true", help="both processes on loopback, no twin")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--port", type=int, default=24100, help="the twin's first sshd port")
    p.add_argument("--master-port", type=int, default=29731)
    p.add_argument("--ccl-hook", choices=("async", "sync", "both"), default="async",
                   help="ccl's DDP comm hook: async (overlaps the backward pass), sync (blocks it; the first "
                        "measurement's), or both, timed in turn in the same ranks (async the headline figure)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        hooks = ccl_comm.HOOKS if a.ccl_hook == "both" else (a.ccl_hook,)
        Path(a.out).write_text(json.dumps(worker(a.worker, a.rank, a.iters, a.steps, a.batch, hooks)))
        return
    print(cpu_line())
    print(f"start: {load_line()}", flush=True)
    shim, why = ccl_comm.build()
    backends = ["gloo"] + (["ccl"] if shim else [])
    if shim:
        print(f"{ccl_comm.LABEL}; {hook_words(a.ccl_hook)}; transport ofi/tcp, CCL_YIELD=sched_yield; "
              f"shim {shim.relative_to(ROOT)}", flush=True)
    else:
        print(f"ccl: NOT measured: {why}; {ccl_comm.HOW}. Only gloo is measured.", flush=True)
    results: dict = {"cpu": cpu_line(), "backends": {}, "ccl": ccl_comm.LABEL if shim else None,
                     "ccl_hook": a.ccl_hook if shim else None,
                     "ccl_unmeasured_because": None if shim else why}
    with tempfile.TemporaryDirectory() as tmp:
        twin, where = None, "loopback (127.0.0.1; --loopback)"
        places: list[tuple[list[str], str]] = [([], "lo"), ([], "lo")]
        master = "127.0.0.1"
        if not a.loopback:
            twin = Twin(Path(tmp), a.link, a.port)
            try:
                nodes = twin.up()
                places = [(["ip", "netns", "exec", ns], "eth0") for ns, _ in nodes]
                master = nodes[0][1]
                where = f"network twin, link {a.link} (tc tbf on each veth end), {nodes[0][1]} <-> {nodes[1][1]}"
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                twin.down()
                twin, where = None, f"loopback (127.0.0.1): the network twin could not be made: {e}"
        print(f"where: {where}", flush=True)
        results["where"] = where
        try:
            for backend in backends:
                print(f"{backend}: 2 processes, 1 core each ...", flush=True)
                results["backends"][backend] = r = launch(backend, places, master, a, str(shim or ""))
                r["load"] = load_line()
                for key, v in r["allreduce"].items():
                    print(f"  all-reduce {key:<18} {v['bytes'] / 1e6:7.1f} MB  bus bandwidth {v['busbw_gbit']:6.2f} "
                          f"Gbit/s  (median {1000 * v['median_s']:.0f} ms, {1000 * v['spread_s'][0]:.0f}-"
                          f"{1000 * v['spread_s'][1]:.0f})", flush=True)
                st = r["step"]
                if st["check"]:
                    c = st["check"]
                    print(f"  step check: after one {st['hook']}-hook step from the gloo path's start, parameters "
                          f"equal on both ranks (max |diff| {c['param_across_ranks']:.3g}) and to gloo's (max |diff| "
                          f"{c['param_vs_gloo']:.3g}); averaged gradients against gloo's, max |diff|: "
                          + ", ".join(f"{m} hook {g['max_abs_diff']:.3g}" for m, g in c["grad"].items()), flush=True)
                for mode, h in st["by_hook"].items():
                    how = "DDP's own all-reduce" if mode == "builtin" else f"{mode} comm hook"
                    print(f"  bert-base train step, DDP ({how}), {st['precision']}, batch {a.batch} per process: "
                          f"{h['samples_per_s']:.2f} samples/s (median step {h['median_step_s']:.2f} s, steps "
                          + " ".join(f"{x:.2f}" for x in h["steps"]) + f"); {r['load']}; rank 0 peak RSS "
                          f"{r['maxrss_mb'] / 1024:.1f} GiB", flush=True)
        finally:
            if twin:
                twin.down()
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(results, indent=2))
    print(f"end: {load_line()}; {where}")
    print_side_by_side(results["backends"])


def hook_words(choice: str) -> str:
    return {"async": "async hook (the bucket's all-reduce on a worker thread, overlapping the backward pass)",
            "sync": "sync hook (each bucket's all-reduce blocks the backward pass)",
            "both": "async and sync hooks timed in turn (the async figure is the headline)"}[choice]


def print_side_by_side(res: dict) -> None:
    """The table of gloo beside ccl (bus bandwidth in Gbit/s, samples/s) and the last line."""
    gloo, ccl = res["gloo"], res.get("ccl")
    print(f"  {'':<36} {'gloo':>8} {'ccl':>8} {'ccl/gloo':>9}")
    rows = [(f"all-reduce {k} Gbit/s", v["busbw_gbit"], ccl and ccl["allreduce"][k]["busbw_gbit"])
            for k, v in gloo["allreduce"].items()]
    if ccl:
        rows += [(f"bert-base step samples/s, {m} hook", gloo["step"]["samples_per_s"], h["samples_per_s"])
                 for m, h in ccl["step"]["by_hook"].items()]
    else:
        rows.append(("bert-base step samples/s", gloo["step"]["samples_per_s"], None))
    for what, g, c in rows:
        print(f"  {what:<36} {g:8.2f} " + (f"{c:8.2f} {c / g:9.2f}" if c else f"{'-':>8} {'-':>9}"))
    g = gloo["step"]["samples_per_s"]
    if ccl:
        c = ccl["step"]["samples_per_s"]
        print(f"gloo_samples_s={g:.2f} ccl_samples_s={c:.2f} ratio={c / g:.2f}")
    else:
        print(f"gloo_samples_s={g:.2f} ccl_samples_s=unmeasured")

if __name__ == "__main__":
    main()
