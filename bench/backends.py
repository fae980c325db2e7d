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
oneCCL runs only where its torch bindings (oneccl_bindings_for_pytorch) import: Intel discontinued them
(torch-ccl issue #80) and they are built for other torch versions; where they do not import the bench says so
and measures gloo alone. Prints the CPU model and flags and the load with every figure. Last line:
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

from glue_single_node import cpu_line, load_line

SIZES = {"minilm": 22_713_216, "bert-base": 109_483_778}  # trainable parameters (bert-base: its 2-label head too)
FAB = [str(ROOT / ".venv" / "bin" / "fab")] if (ROOT / ".venv" / "bin" / "fab").exists() else ["fab"]


def ccl_importable() -> tuple[bool, str]:
    """Whether oneCCL's torch bindings import in this venv, and if not why (the import's own error)."""
    res = subprocess.run([sys.executable, "-c", "import torch, oneccl_bindings_for_pytorch"], capture_output=True,
                         text=True, check=False)
    if res.returncode == 0:
        return True, ""
    return False, (res.stderr.strip().splitlines() or ["no output"])[-1]


def worker(backend: str, rank: int, iters: int, steps: int, batch: int) -> dict:
    """One rank: the all-reduces, then the training step. MASTER_ADDR/PORT and WORLD_SIZE come from the env."""
    import torch
    import torch.distributed as dist

    if backend == "ccl":
        import oneccl_bindings_for_pytorch  # noqa: F401  registers the backend
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    n = dist.get_world_size()
    out: dict = {"allreduce": {}}
    for name, numel in SIZES.items():
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.ones(numel, dtype=dtype)
            dist.all_reduce(t)
            times = []
            for _ in range(iters):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - start)
            s = statistics.median(times)
            nbytes = numel * t.element_size()
            out["allreduce"][f"{name}/{str(dtype).removeprefix('torch.')}"] = {
                "bytes": nbytes, "median_s": s, "busbw_gbit": 2 * (n - 1) / n * nbytes * 8 / s / 1e9,
                "spread_s": [min(times), max(times)]}
    out["step"] = train_step(steps, batch, rank, n)
    dist.destroy_process_group()
    return out


def train_step(steps: int, batch: int, rank: int, world: int) -> dict:
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


def launch(backend: str, places: list[tuple[list[str], str]], master: str, a) -> dict:
    """Rank i runs under places[i]'s command prefix, pinned to core i; returns rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank, (prefix, _) in enumerate(places):
            env = {**os.environ, "MASTER_ADDR": master, "MASTER_PORT": str(a.master_port), "WORLD_SIZE": "2",
                   "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": places[rank][1]}
            cmd = [*prefix, "taskset", "-c", str(rank % (os.cpu_count() or 1)), sys.executable, __file__, "--worker",
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
    have_ccl, why = ccl_importable()
    backends = ["gloo"] + (["ccl"] if have_ccl else [])
    if not have_ccl:
        print(f"ccl: NOT measured. oneccl_bindings_for_pytorch does not import here ({why}); Intel discontinued "
              "the bindings (torch-ccl issue #80) and publishes none for this torch, and building them from source "
              "did not fit this 2-core shared machine. Only gloo is measured.", flush=True)
    results: dict = {"cpu": cpu_line(), "backends": {}, "ccl_unmeasured_because": None if have_ccl else why}
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
                results["backends"][backend] = r = launch(backend, places, master, a)
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
    gloo = results["backends"]["gloo"]["step"]["samples_per_s"]
    if "ccl" in results["backends"]:
        ccl = results["backends"]["ccl"]["step"]["samples_per_s"]
        for key, v in results["backends"]["gloo"]["allreduce"].items():
            c = results["backends"]["ccl"]["allreduce"][key]["busbw_gbit"]
            print(f"  all-reduce {key}: ccl/gloo bus bandwidth {c / v['busbw_gbit']:.2f}")
        print(f"gloo_samples_s={gloo:.2f} ccl_samples_s={ccl:.2f} ratio={ccl / gloo:.2f}")
    else:
        print(f"gloo_samples_s={gloo:.2f} ccl_samples_s=unmeasured")


if __name__ == "__main__":
    main()
