"""A PREDICTION, not a measurement: wall time and cost of the manual recipe's MRPC fine-tune (bert-base-cased, 3 epochs,
batch 32, 3668 training pairs = 345 steps) on 1, 2 and 4 nodes of an instance type, spot and on-demand.

    node samples/s  = measured single-node bert-base samples/s x the type's published cores / the cores measured,
                      in the precision fab's auto picks there: bf16 on a type with AMX, else fp32 (c6i's Ice
                      Lake has no bf16 instructions); a bf16 figure stands in only where no fp32 one was
                      measured, and the row says so
    compute a step  = 32 / (nodes x node samples/s)        (the global batch stays 32: the same fine-tune)
    all-reduce      = ring: 2 (N-1) / N x gradient bytes per node a step, at the type's network Gbit/s
                      (DESIGN.md; bench/scaling_twin.py), none of it hidden behind the backward pass (an
                      upper bound: DDP overlaps part of it)
    wall time       = 345 x (compute + all-reduce)          training only: no start-up, data or evaluation
    cost            = nodes x USD/h x wall time; spot at the live price where one is given, else "<= on-demand"
                      (spot never bills above on-demand at the default maximum price)
Cores are the only difference between CPUs it knows: clock, memory bandwidth and AMX are not in it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from core.catalog import CATALOG

MRPC_TRAIN = 3668
EPOCHS = 3
BATCH = 32
TYPES = ("c6i.16xlarge", "r7iz.16xlarge")
NODES = (1, 2, 4)
# bert-base-cased + a 2-label head; the job freezes the word embeddings (28996 x 768) by default
BERT_BASE_PARAMS = 108_310_272 + 768 * 2 + 2
BERT_BASE_TRAINED = BERT_BASE_PARAMS - 28996 * 768
WIRE_BYTES = {"fp32": 4, "bf16": 2}  # fab train's default between hosts is bf16 on the wire (--comm-hook auto)
# Training FLOPs of bert-base per token at MRPC's ~65 tokens: 6 x 85 M matmul parameters + attention (model_shapes)
BERT_BASE_FLOPS_PER_TOKEN = 6 * 12 * (4 * 768 ** 2 + 2 * 768 * 3072) + 12 * 12 * 768 * 65
MRPC_TOKENS = 65


@dataclass(frozen=True)
class Measured:
    samples_per_s: float  # bert-base at MRPC's lengths, batch 32 or near, one process
    cores: int  # the cores (torch threads) that measurement ran on
    source: str  # where the figure comes from, printed with the prediction
    precision: str = "bf16"  # of samples_per_s
    fp32_samples_per_s: float | None = None  # the same in fp32, where it was measured beside it

    def figure(self, precision: str) -> tuple[float, str]:
        """samples/s in `precision`, and "" or why the figure is another precision's."""
        if precision == self.precision:
            return self.samples_per_s, ""
        if precision == "fp32" and self.fp32_samples_per_s:
            return self.fp32_samples_per_s, ""
        return self.samples_per_s, f"{self.precision} figure for {precision}: optimistic"


def type_precision(instance_type: str) -> str:
    return "bf16" if CATALOG[instance_type].amx else "fp32"


def steps() -> int:
    return EPOCHS * math.ceil(MRPC_TRAIN / BATCH)


def ring_bytes(grad_bytes: float, nodes: int) -> float:
    return 2 * (nodes - 1) / nodes * grad_bytes


def predict(measured: Measured, instance_type: str, nodes: int, spot_usd_h: float | None = None,
            wire: str = "bf16", overlap: float = 0.0) -> dict:
    t = CATALOG[instance_type]
    precision = type_precision(instance_type)
    figure, caveat = measured.figure(precision)
    node_sps = figure * t.cores / measured.cores
    compute_s = BATCH / (nodes * node_sps)
    comm_s = ring_bytes(BERT_BASE_TRAINED * WIRE_BYTES[wire], nodes) * 8 / (t.network_gbit * 1e9)
    step_s = compute_s + comm_s * (1 - overlap)
    wall_s = steps() * step_s
    on_demand = nodes * t.on_demand_usd_h * wall_s / 3600
    spot = None if spot_usd_h is None else nodes * spot_usd_h * wall_s / 3600
    return {"instance_type": instance_type, "nodes": nodes, "precision": precision, "caveat": caveat,
            "node_samples_per_s": node_sps, "compute_s": compute_s,
            "comm_s": comm_s, "step_s": step_s, "wall_s": wall_s, "on_demand_usd": on_demand, "spot_usd": spot,
            "wire": wire, "steps": steps()}


def reduced(measured: Measured, instance_type: str, nodes: int, at: int, share: float) -> dict:
    """A run on `nodes` that went on at `at` nodes for `share` of its steps (fab train --min-nodes): the same
    steps and global batch, each reduced step at the smaller size's speed and price."""
    full, small = predict(measured, instance_type, nodes), predict(measured, instance_type, at)
    wall_full, wall_small = (1 - share) * full["wall_s"], share * small["wall_s"]
    usd_h = CATALOG[instance_type].on_demand_usd_h
    return {"instance_type": instance_type, "nodes": nodes, "at": at, "share": share,
            "wall_s": wall_full + wall_small, "on_demand_usd": usd_h * (nodes * wall_full + at * wall_small) / 3600,
            "full_wall_s": full["wall_s"], "full_on_demand_usd": full["on_demand_usd"]}


def table(measured: Measured, spot_usd_h: dict[str, float] | None = None) -> list[dict]:
    spot_usd_h = spot_usd_h or {}
    return [predict(measured, t, n, spot_usd_h.get(t)) for t in TYPES for n in NODES]


def from_bench_json(path: Path) -> Measured | None:
    """The default path's bert-base figure of bench/glue_single_node.py --model-shape bert-base, if it ran here."""
    try:
        data = json.loads(Path(path).read_text())
        row = data["configs"]["default"]
        fp32 = data["configs"].get("fp32") or {}
        return Measured(float(row["samples_per_second"]), int(row["threads"]),
                        f"{path.name}: bert-base shape, batch {data['batch']}, {data['cpu']}",
                        row.get("precision", "bf16"),
                        float(fp32["samples_per_second"]) if fp32.get("samples_per_second") else None)
    except (OSError, KeyError, ValueError, TypeError):
        return None


def from_run(results: dict) -> Measured | None:
    """From a 1-node run's model FLOP/s (results.json 'mfu'), as bert-base samples/s at the same FLOP/s: a
    smaller model reaches a lower share of the peak, so this underestimates bert-base's speed."""
    flops = (results.get("mfu") or {}).get("model_flops_per_s")
    if not flops:
        return None
    cores = int(results.get("threads") or 1) * int(results.get("world_size") or 1)
    sps = flops / (BERT_BASE_FLOPS_PER_TOKEN * MRPC_TOKENS)
    return Measured(sps, cores, f"the 1-node run's {flops / 1e9:.0f} GFLOP/s of {results.get('model')} "
                                "taken as bert-base's (an underestimate)")


def report_lines(measured: Measured, rows: list[dict]) -> list[str]:
    lines = [
        (f"## PREDICTION: the manual recipe's MRPC fine-tune (bert-base, {EPOCHS} epochs, batch {BATCH}, "
         f"{MRPC_TRAIN} pairs, {steps()} steps)"),
        "",
        (f"Predicted, not measured: {measured.samples_per_s:.2f} samples/s ({measured.precision})"
         + (f" and {measured.fp32_samples_per_s:.2f} (fp32)" if measured.fp32_samples_per_s else "")
         + f" on {measured.cores} core(s) ({measured.source}) scaled by each type's published cores, in the "
         "precision fab picks there (bf16 with AMX, else fp32); ring all-reduce of "
         f"{BERT_BASE_TRAINED / 1e6:.1f} M trained parameters in {rows[0]['wire']} at the type's network speed, "
         "none of it overlapped; training only (reports/predict.py)."),
        "",
        ("| instance type | nodes | precision | step (s) | of it all-reduce (s) | wall time (min) | on-demand (USD) "
         "| spot (USD) |"),
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        spot = f"{r['spot_usd']:.3f}" if r["spot_usd"] is not None else f"<= {r['on_demand_usd']:.3f}"
        precision = r["precision"] + (f" ({r['caveat']})" if r["caveat"] else "")
        lines.append(f"| {r['instance_type']} | {r['nodes']} | {precision} | {r['step_s']:.3f} | {r['comm_s']:.3f} "
                     f"| {r['wall_s'] / 60:.1f} | {r['on_demand_usd']:.3f} | {spot} |")
    lines += ["", ("At reduced size (`fab train --min-nodes`): the same run when half its steps went on with half the "
              "nodes after a preemption, instead of waiting for all of them; same steps and global batch."), "",
              "| instance type | nodes | half the steps at | wall time (min) | on-demand (USD) | at full size throughout |",
              "|---|---:|---:|---:|---:|---|"]
    for t in TYPES:
        r = reduced(measured, t, NODES[-1], NODES[-1] // 2, 0.5)
        lines.append(f"| {t} | {r['nodes']} | {r['at']} | {r['wall_s'] / 60:.1f} | {r['on_demand_usd']:.3f} | "
                     f"{r['full_wall_s'] / 60:.1f} min, {r['full_on_demand_usd']:.3f} USD |")
    return lines
