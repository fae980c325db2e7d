"""2-node scaling of the glue job on a network twin whose link is as tight as a c6i cluster's.

A network twin (`fab local-up --netns`, root only) makes two nodes distinct hosts, each pinned to one core,
linked through veths and a bridge shaped by tc. The link's rate is chosen so that all-reduce bytes over
compute time match BERT-base on c6i.16xlarge at 25 Gbit/s (the seeds' setup):
  reference   bert-base-cased, 108.3 M parameters -> 433 MB of fp32 gradients a step; run_glue on MRPC,
              batch 32, 3 epochs, 3668 pairs = 345 steps in 7 min 46 s on one c6i.16xlarge -> 1.35 s a step
              (the seed's figure, including its evaluation: a slight overestimate of compute). A 2-node ring
              all-reduce moves 2(N-1)/N x 433 MB = 433 MB per node a step: 0.139 s at 25 Gbit/s, 10.3% of
              the step.
  here        MiniLM-L6's gradient bytes and the step time of one twin node measured in this run give the
              rate with the same 10.3%.
Every run goes through `fab train` (mpirun over the twin's SSH). Per rank the batch and the number of
steps are those of the 1-node run (weak scaling), so
  efficiency     = samples/s on 2 nodes / (2 x samples/s on 1 node)
  comm_fraction  = the part of a step spent waiting on the all-reduce: DDP's own timings (all-reduce time
                   not overlapped with the backward pass) over the step time
for: the unshaped twin (this machine's ceiling), then on the c6i-like link fab train's defaults (bf16
gradients between hosts), fp32 gradients with DDP's default buckets, bf16 and fp16 gradient compression,
5 and 100 MB buckets, no_sync accumulation (2 micro-batches of half the batch per all-reduce), gradients
copied into DDP's buckets instead of living in them, a static graph, buffers not broadcast, and the word
embeddings trained (the job freezes them by default). Each row is checked against the hook and bucket
view DDP reports it ran. The 1-node figure is the mean of a run before and one after the 2-node runs.
One more 1-node run has the same job training on node1's core beside it (not through the network):
"vs loaded" divides by twice that figure, which takes out what sharing this VM's caches and memory
costs and separate hosts would not. Then a model of N nodes at 25 and 50 Gbit/s for BERT-base,
calibrated by the overlap measured here. Prints the CPU model and flags.
Last line:  efficiency=<best config's efficiency> comm_fraction=<its comm fraction>
Writes bench/results/scaling_twin.json.

    sudo .venv/bin/python bench/scaling_twin.py [--batch 32] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from glue_single_node import cpu_line

from launch.plan.request import DEFAULT_COMM_HOOK, resolve_comm_hook

FAB = [str(ROOT / ".venv" / "bin" / "fab")] if (ROOT / ".venv" / "bin" / "fab").exists() else ["fab"]
REF_PARAMS = 108_310_272 + 768 * 2 + 2  # bert-base-cased + a 2-label head
REF_STEP_S = (7 * 60 + 46) / (3 * -(-3668 // 32))
REF_LINK_BITS = 25e9


def ring_bytes(grad_bytes: float, nodes: int) -> float:
    """What each node sends (and receives) in a ring all-reduce."""
    return 2 * (nodes - 1) / nodes * grad_bytes


REF_RATIO = ring_bytes(REF_PARAMS * 4, 2) * 8 / REF_LINK_BITS / REF_STEP_S

# name: (extra TrainingArguments, fab train flags, per-rank batch divisor)
LEVERS = {
    "defaults": ([], [], 1),
    "fp32": ([], ["--comm-hook", "none"], 1),  # the default (auto) is bf16 between the twin's hosts
    "bf16-hook": ([], ["--comm-hook", "bf16"], 1),
    "fp16-hook": ([], ["--comm-hook", "fp16"], 1),
    "bucket-5mb": (["--ddp_bucket_cap_mb", "5"], [], 1),
    "bucket-100mb": (["--ddp_bucket_cap_mb", "100"], [], 1),
    "no_sync-2": (["--gradient_accumulation_steps", "2"], [], 2),
    "no-bucket-view": ([], ["--env", "XC_BUCKET_VIEW=0"], 1),
    "no-bcast-buffers": (["--ddp_broadcast_buffers", "False"], [], 1),
    "static-graph": (["--ddp_static_graph", "True"], [], 1),
    "embeddings-trained": (["--freeze_embeddings", "False"], [], 1),
}
WIRE = {"bf16": "xc_bfloat16_wire_hook", "fp16": "xc_float16_wire_hook"}  # the hook DDP reports per --comm-hook


def check_ran(name: str, flags: list[str], ddp: dict, hosts: list[str]) -> None:
    """A row is labelled with what DDP says it ran, never with what was asked for."""
    asked = flags[flags.index("--comm-hook") + 1] if "--comm-hook" in flags else DEFAULT_COMM_HOOK
    want = WIRE.get(resolve_comm_hook(asked, hosts))
    view = "XC_BUCKET_VIEW=0" not in flags
    if ddp.get("comm_hook") != want or ddp.get("gradient_as_bucket_view") != view:
        raise SystemExit(f"error: {name}: DDP ran comm hook {ddp.get('comm_hook')!r} and bucket view "
                         f"{ddp.get('gradient_as_bucket_view')}, not {want!r} and {view}; is the job's comm default changed?")


class Twin:
    def __init__(self, tmp: Path, port: int):
        self.env = {**os.environ, "XC_STATE_DIR": str(tmp / "state"), "XC_RUNS_DIR": str(tmp / "runs"),
                    "XC_CLUSTER": "local"}
        self.runs = tmp / "runs"
        self.port = port

    def fab(self, *args: str, timeout: int = 900) -> str:
        res = subprocess.run([*FAB, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL, check=False)
        if res.returncode != 0:
            raise SystemExit(f"fab {' '.join(args)} failed:\n{(res.stdout + res.stderr)[-3000:]}")
        return res.stdout

    def train(self, nodes: int, batch: int, samples: int, extra: list[str], flags: list[str]) -> dict:
        out = self.fab("train", "--nodes", str(nodes), "--ppn", "1", "--threads", "1", "--save-every", "0", *flags,
                       "--", "--num_train_epochs", "1", "--per_device_train_batch_size", str(batch),
                       "--max_train_samples", str(samples), "--learning_rate", "1e-4", "--seed", "42", *extra)
        run_id = re.search(r"^run (\S+): results in", out, re.MULTILINE).group(1)
        return json.loads((self.runs / run_id / "output" / "results.json").read_text())


class Neighbour:
    """The glue job on the other node's core, outside the twin and the network: a 1-node run beside it shares the
    VM's caches, memory and host as a 2-node run does, which separate c6i hosts would not."""

    def __init__(self, tmp: Path, cpus: list[int], batch: int):
        env = {**os.environ, "XC_PRECISION": "auto", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(len(cpus))}
        self.log = tmp / "neighbour.log"
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-m", "training.jobs.glue", "--do_train",
               "--output_dir", str(tmp / "neighbour"), "--max_steps", "100000", "--save_strategy", "no",
               "--per_device_train_batch_size", str(batch), "--learning_rate", "1e-4", "--seed", "43"]
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self):
        deadline = time.monotonic() + 300
        while "step 1/" not in self.log.read_text():  # training has begun: the load is on
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"error: the neighbour job did not start training:\n{self.log.read_text()[-2000:]}")
            time.sleep(1)
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # load only: nothing of it is kept
        self.proc.wait(timeout=60)


def row(name: str, res: dict, base_sps: float, batch: int) -> dict:
    sps = res["train"]["train_samples_per_second"]
    step_ms = 1000 * 2 * batch / sps  # one optimizer step of both ranks
    ddp = res.get("ddp") or {}
    # DDP times the backward passes that all-reduce; under no_sync that is one per optimizer step, as here
    exposed = ddp.get("comm_exposed_ms", float("nan"))
    return {"name": name, "samples_per_second": sps, "efficiency": sps / (2 * base_sps), "step_ms": step_ms,
            "comm_fraction": exposed / step_ms, "ddp": ddp,
            "eval_accuracy": res.get("eval", {}).get("eval_accuracy"), "train_loss": res["train"].get("train_loss")}


def model_table(compute_s: float, grad: float, overlap: float, compress: float) -> list[dict]:
    """BERT-base steps on N c6i.16xlarge: compute + the all-reduce's unoverlapped part, ring at link speed."""
    out = []
    for link in (25e9, 50e9):
        for n in (2, 4, 8, 16):
            for wire, factor in (("fp32", 1.0), ("bf16-hook", compress)):
                comm = ring_bytes(grad * factor, n) * 8 / link
                exposed = comm * (1 - overlap)
                out.append({"link_gbit": link / 1e9, "nodes": n, "wire": wire, "comm_s": comm,
                            "efficiency": compute_s / (compute_s + exposed), "speedup": n * compute_s / (compute_s + exposed)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="per-rank batch (the seeds' 32)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--port", type=int, default=24300)
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--link", help="a rate of your own (e.g. 2gbit) instead of the one derived from the c6i ratio")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("error: the network twin needs root (network namespaces and tc); run as root")
    print(cpu_line(), flush=True)
    results: dict = {"cpu": cpu_line(), "batch": a.batch, "steps": a.steps,
                     "reference": {"params": REF_PARAMS, "step_s": REF_STEP_S, "link_bits": REF_LINK_BITS,
                                   "comm_over_compute": REF_RATIO}}
    samples = a.batch * a.steps
    with tempfile.TemporaryDirectory() as tmp:
        twin = Twin(Path(tmp), a.port)
        twin.fab("local-up", "--nodes", "2", "--netns", "--port", str(a.port), timeout=120)
        try:
            print(f"1 node, batch {a.batch}, {a.steps} steps ...", flush=True)
            one = twin.train(1, a.batch, samples, [], [])
            first_sps = one["train"]["train_samples_per_second"]
            params = one["trainable_params"]  # what DDP all-reduces: frozen weights have no gradient
            grads = 4 * params
            results.update(params=params, grad_bytes=grads)
            base_sps = first_sps
            step_s = a.batch / base_sps
            rate = ring_bytes(grads, 2) * 8 / (REF_RATIO * step_s)
            link = a.link or f"{rate / 1e6:.0f}mbit"
            print(f"  {base_sps:.2f} samples/s, {step_s * 1000:.0f} ms a step; gradients {grads / 1e6:.1f} MB "
                  f"({params / 1e6:.1f} M parameters)", flush=True)
            print(f"reference: BERT-base on c6i.16xlarge, {REF_PARAMS * 4 / 1e6:.0f} MB a step over 25 Gbit/s in a "
                  f"{REF_STEP_S:.2f} s step: comm/compute {REF_RATIO:.3f}; the same here -> link {rate / 1e6:.0f}mbit"
                  + (f"; --link {a.link} instead" if a.link else ""), flush=True)
            print("1 node, the same job running on node1's core ...", flush=True)
            nodes = [n["node"] for n in json.loads((Path(tmp) / "state" / "local" / "state.json").read_text())["nodes"]]
            hosts, cpus = [n["private_host"] for n in nodes], nodes[1]["labels"]["cpus"]
            with Neighbour(Path(tmp), cpus, a.batch):
                loaded_sps = twin.train(1, a.batch, samples, [], [])["train"]["train_samples_per_second"]
            print(f"  {loaded_sps:.2f} samples/s", flush=True)
            rows = []
            print("2 nodes, unshaped link ...", flush=True)
            rows.append(row("unshaped", twin.train(2, a.batch, 2 * samples, [], []), base_sps, a.batch))
            check_ran("unshaped", [], rows[-1]["ddp"], hosts)
            for node in ("node0", "node1"):
                twin.fab("local-link", "--node", node, "--link", link, timeout=60)
            for name in a.levers.split(","):
                extra, flags, div = LEVERS[name]
                print(f"2 nodes, {link}, {name} ...", flush=True)
                res = twin.train(2, a.batch // div, 2 * samples, extra, flags)
                rows.append(row(name, res, base_sps, a.batch))
                check_ran(name, flags, rows[-1]["ddp"], hosts)
            # this machine drifts: the 1-node figure is the mean of one run before and one after the 2-node runs
            print("1 node again ...", flush=True)
            last_sps = twin.train(1, a.batch, samples, [], [])["train"]["train_samples_per_second"]
            base_sps = (first_sps + last_sps) / 2
            for r in rows:
                r["efficiency"] = r["samples_per_second"] / (2 * base_sps)
                r["efficiency_loaded"] = r["samples_per_second"] / (2 * loaded_sps)
        finally:
            subprocess.run([*FAB, "local-down"], cwd=ROOT, env=twin.env, capture_output=True, timeout=120, check=False)
    results.update(one_node_samples_per_second=base_sps, one_node_runs=[first_sps, last_sps], step_s=step_s, link=link,
                   one_node_loaded_samples_per_second=loaded_sps, rows=rows)
    print(f"\nglue job, MiniLM-L6, per-rank batch {a.batch}, {a.steps} steps, 1 core per node, gloo")
    print(cpu_line())
    print(f"1 node: {base_sps:.2f} samples/s (mean of {first_sps:.2f} before and {last_sps:.2f} after the 2-node runs); "
          f"twin link for the c6i ratio: {link}")
    print(f"1 node with the same job on node1's core: {loaded_sps:.2f} samples/s ({loaded_sps / base_sps:.2f}x alone); "
          f"'vs loaded' divides by twice this: the part of the loss that is not the VM being shared")
    print(f"{'config':<20}{'samples/s':>10}{'efficiency':>11}{'vs loaded':>10}{'step ms':>9}{'comm frac':>10}"
          f"{'allreduce ms':>13}{'overlap ms':>11}{'train loss':>11}")
    for r in rows:
        d = r["ddp"]
        print(f"{r['name']:<20}{r['samples_per_second']:>10.2f}{r['efficiency']:>11.3f}{r['efficiency_loaded']:>10.3f}"
              f"{r['step_ms']:>9.0f}{r['comm_fraction']:>10.3f}{d.get('comm_ms', float('nan')):>13.0f}{d.get('overlap_ms', float('nan')):>11.0f}"
              f"{r['train_loss'] or float('nan'):>11.4f}")
    shaped = [r for r in rows if r["name"] != "unshaped"]
    best = max(shaped, key=lambda r: r["efficiency"])
    fp32 = next((r for r in shaped if r["name"] == "fp32"), best)
    d = fp32["ddp"]
    overlap = d["overlap_ms"] / d["comm_ms"] if d.get("comm_ms") else 0.0
    table = model_table(REF_STEP_S, REF_PARAMS * 4, overlap, 0.5)
    results.update(best=best["name"], overlap_fraction=overlap, model=table)
    print(f"\nmodel: BERT-base on N x c6i.16xlarge, {REF_STEP_S:.2f} s of compute a step, ring all-reduce at link "
          f"speed, {overlap:.0%} of it hidden behind the backward pass (as measured here with fp32 buckets)")
    print(f"{'link':>6}{'nodes':>6}{'wire':>11}{'comm s':>8}{'efficiency':>11}{'speed-up':>9}")
    for m in table:
        print(f"{m['link_gbit']:>4.0f}Gb{m['nodes']:>6}{m['wire']:>11}{m['comm_s']:>8.3f}{m['efficiency']:>11.3f}"
              f"{m['speedup']:>8.2f}x")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = f"scaling_twin-{a.link}.json" if a.link else "scaling_twin.json"
    (out / name).write_text(json.dumps(results, indent=2))
    print(f"written to {out / name}")
    print(f"efficiency={best['efficiency']:.3f} comm_fraction={best['comm_fraction']:.3f}")


if __name__ == "__main__":
    main()
