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
gradient bucket with oneCCL and returns it completed (no overlap with the backward pass); gloo then only
bootstraps and keeps time (the KVS address, DDP's initial broadcast and its per-forward broadcast of BERT's
small index buffers, the barriers).
oneCCL's transport is its ofi ATL over libfabric's tcp provider (the one impi-rt ships) on the same interface
as gloo. Each all-reduce path first sums a known pattern and the bench fails where the sum is wrong. Without
oneCCL's wheels (not a dependency of the project) the bench says how to get them and measures gloo alone.
The CPU model and flags and the load are printed with every figure. Last line:
    gloo_samples_s=A ccl_samples_s=B ratio=R      (R = B / A), or, without ccl,
    gloo_samples_s=A ccl_samples_s=unmeasured
Writes bench/results/backends.json.

    sudo .venv/bin/python bench/backends.py [--link 12.5gbit] [--loopback] [--iters 10] [--steps 5] [--batch 8]
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ccl_comm
from glue_single_node import cpu_line, load_line

SIZES = {"minilm": 22_713_216, "bert-base": 109_483_778}  # trainable parameters (bert-base: its 2-label head too)
FAB = [str(ROOT / ".venv" / "bin" / "fab")] if (ROOT / ".venv" / "bin" / "fab").exists() else ["fab"]


def worker(backend: str, rank: int, iters: int, steps: int, batch: int) -> dict:
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
    out["step"] = train_step(steps, batch, rank, n, ccl)
    if ccl:
        ccl.close()
    dist.destroy_process_group()
    return out


def train_step(steps: int, batch: int, rank: int, world: int, ccl=None) -> dict:
    """With ccl, DDP's gradient buckets go through oneCCL (a comm hook) instead of the gloo group."""
    import model_shapes
    import torch
    import torch.distributed as dist
    from compile_step import batches
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging

    from training import fastdrop
    from training.dist import cpu_flags

    logging.set_verbosity_error()
    s = model_shapes.BERT_BASE
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        intermediate_size=s.ffn, num_labels=2, attn_implementation="eager"))
    fastdrop.install(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if ccl:
        ddp.register_comm_hook(None, ccl.hook)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    bf16 = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    data = batches((steps + 2) * world, batch, 1)[rank::world]
    times = []
    for enc, labels in data:
        dist.barrier()
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ddp(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[2:])
    return {"median_step_s": step, "samples_per_s": world * batch / step, "steps": times[2:],
            "precision": "bf16" if bf16 else "fp32",
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}


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
                   "--steps", str(a.steps), "--batch", str(a.batch)]
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
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        Path(a.out).write_text(json.dumps(worker(a.worker, a.rank, a.iters, a.steps, a.batch)))
        return
    print(cpu_line())
    print(f"start: {load_line()}", flush=True)
    shim, why = ccl_comm.build()
    backends = ["gloo"] + (["ccl"] if shim else [])
    if shim:
        print(f"{ccl_comm.LABEL}; transport ofi/tcp, CCL_YIELD=sched_yield; shim {shim.relative_to(ROOT)}", flush=True)
    else:
        print(f"ccl: NOT measured: {why}; {ccl_comm.HOW}. Only gloo is measured.", flush=True)
    results: dict = {"cpu": cpu_line(), "backends": {}, "ccl": ccl_comm.LABEL if shim else None,
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
                print(f"  bert-base train step, DDP, {st['precision']}, batch {a.batch} per process: "
                      f"{st['samples_per_s']:.2f} samples/s (median step {st['median_step_s']:.2f} s, steps "
                      + " ".join(f"{x:.2f}" for x in st["steps"]) + f"); {r['load']}", flush=True)
        finally:
            if twin:
                twin.down()
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(results, indent=2))
    print(f"end: {load_line()}; {where}")
    print_side_by_side(results["backends"])


def print_side_by_side(res: dict) -> None:
    """The table of gloo beside ccl (bus bandwidth in Gbit/s, samples/s) and the last line."""
    gloo, ccl = res["gloo"], res.get("ccl")
    print(f"  {'':<36} {'gloo':>8} {'ccl':>8} {'ccl/gloo':>9}")
    rows = [(f"all-reduce {k} Gbit/s", v["busbw_gbit"], ccl and ccl["allreduce"][k]["busbw_gbit"])
            for k, v in gloo["allreduce"].items()]
    rows.append(("bert-base step samples/s", gloo["step"]["samples_per_s"], ccl and ccl["step"]["samples_per_s"]))
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
