"""`fab bench`: one job with identical flags at several cluster sizes, and the report a blog post
would paste: a table (nodes, processes, time, samples/s, speed-up, efficiency, eval metric, cost)
and a chart of measured against ideal speed-up. Every number comes from the runs' own records
(runs/<run-id>/results.json and summary.json), so a report can also be rebuilt from earlier runs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cluster.resolve import Cluster
from core.catalog import CATALOG
from core.errors import ClusterError
from launch.life import records
from launch.plan.request import TrainRequest, new_run_id, validate
from launch.run import train
from launch.staging import jobflags, secrets
from reports import predict
from training.runtime.paths import RunPaths

log = logging.getLogger(__name__)

# The eval figure each bundled job is judged by: (results key, column title, better when higher).
METRICS = {
    "glue": ("eval_accuracy", "eval accuracy", True),
    "qa": ("eval_f1", "eval F1", True),
    "clm": ("eval_perplexity", "eval perplexity", False),
}
# What has to be equal for two runs to be comparable (besides their flags).
SAME = ("job", "model", "task", "dataset", "train_file", "data_fingerprint", "precision", "max_seq_length",
        "block_size", "doc_stride")


@dataclass
class RunRecord:
    run_id: str
    run_dir: Path
    results: dict
    summary: dict

    @property
    def nodes(self) -> int:
        return len(self.summary.get("nodes", [])) or 1

    @property
    def processes(self) -> int:
        return int(self.results.get("world_size") or self.summary.get("world_size") or 1)


@dataclass
class BenchResult:
    bench_id: str
    bench_dir: Path
    rows: list[dict]
    runs: list[RunRecord]


def parse_sizes(text: str, available: int | None = None, cluster: str = "") -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, without repeats), with the error a user needs when it is wrong."""
    sizes = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise ClusterError(f"--nodes {text!r}: {part!r} is not a node count", fix="give a comma-separated list "
                               "of whole numbers such as 1,2,4") from None
        if n < 1:
            raise ClusterError(f"--nodes {text!r}: {n} is below 1", fix="every size needs at least one node")
        sizes.append(n)
    sizes = sorted(set(sizes))
    if available is not None and sizes[-1] > available:
        too_big = [n for n in sizes if n > available]
        fix = (f"run 'fab local-up --nodes {too_big[-1]}'" if cluster in ("", "local")
               else f"run 'pulumi up' with nodeCount={too_big[-1]}")
        raise ClusterError(f"--nodes {text!r}: {', '.join(map(str, too_big))} is more than the {available} node(s) "
                           f"of cluster {cluster!r}", fix=f"{fix} or drop it from the list")
    return sizes


def load_run(run_dir: Path) -> RunRecord:
    run_dir = Path(run_dir)
    results_path = run_dir / "results.json"
    if not (run_dir / "summary.json").is_file():
        raise ClusterError(f"run {run_dir.name} has no summary.json in {run_dir}", "pass the id of a finished run")
    rec = records.load(run_dir)
    if rec.status != records.Status.OK or not results_path.is_file():
        raise ClusterError(f"run {run_dir.name} did not finish ({rec.status})", "a report compares finished runs only")
    return RunRecord(run_dir.name, run_dir, json.loads(results_path.read_text()), rec.to_json())


def flag_values(args: list[str]) -> dict[str, str]:
    """'--a 1 --b --c=x' -> {'--a': '1', '--b': '', '--c': 'x'}; the output folder is not a difference."""
    out = jobflags.values(args)
    out.pop("--output_dir", None)
    return out


def _shown(value: str | None) -> str:
    return "unset" if value is None else (value or "set")


def check_comparable(runs: list[RunRecord]) -> None:
    """Refuse runs whose model, data or flags differ: a speed-up between them would mean nothing."""
    base = runs[0]
    base_flags = flag_values(base.summary.get("args", []))
    for other in runs[1:]:
        where = f"runs {base.run_id} ({base.nodes} node(s)) and {other.run_id} ({other.nodes} node(s))"
        for key in SAME:
            a, b = base.results.get(key), other.results.get(key)
            if key == "train_file" and a and b:  # shipped copies differ in folder only
                a, b = Path(a).name, Path(b).name
            if a != b:
                raise ClusterError(f"{where} differ in {key} ({a} vs {b})", fix="a scaling report compares one job "
                                   "with identical model, data and flags: rerun them alike")
        flags = flag_values(other.summary.get("args", []))
        for flag in sorted(set(base_flags) | set(flags)):
            if base_flags.get(flag) != flags.get(flag):
                raise ClusterError(f"{where} differ in {flag} ({_shown(base_flags.get(flag))} vs "
                                   f"{_shown(flags.get(flag))})", fix="a scaling report compares identical flags: "
                                   "rerun them alike")
        a_n, b_n = base.results.get("train", {}).get("samples"), other.results.get("train", {}).get("samples")
        if a_n != b_n:
            raise ClusterError(f"{where} trained on {a_n} vs {b_n} samples", fix="rerun them with the same data")
    sizes = [r.nodes for r in runs]
    if len(set(sizes)) != len(sizes):
        raise ClusterError(f"two runs have the same node count ({sizes})", fix="pass one run per cluster size")
    if any("train" not in r.results for r in runs):
        raise ClusterError("a run has no training figures (--do_train was off)", fix="a scaling report needs them")


def node_price(node: dict) -> float | None:
    """On-demand USD/h of a node from its instance type label (AWS inventory); None if unknown."""
    kind = (node.get("labels") or {}).get("instance_type")
    return CATALOG[kind].on_demand_usd_h if kind in CATALOG else None


def rows_from(runs: list[RunRecord]) -> list[dict]:
    runs = sorted(runs, key=lambda r: r.nodes)
    base = runs[0]
    base_sps = base.results["train"]["train_samples_per_second"]
    metric_key, _, _ = METRICS.get(base.results.get("job"), ("eval_loss", "eval loss", False))
    rows = []
    for r in runs:
        tr = r.results["train"]
        sps = tr["train_samples_per_second"]
        speedup = sps / base_sps if base_sps else float("nan")
        ideal = r.nodes / base.nodes
        prices = [node_price(n) for n in r.summary.get("nodes", [])]
        wall = float(r.summary["wall_s"])
        cost = sum(prices) * wall / 3600 if prices and all(p is not None for p in prices) else None
        rows.append({
            "run_id": r.run_id, "nodes": r.nodes, "processes": r.processes, "wall_s": wall,
            "train_s": tr.get("train_runtime", tr.get("wall_s")), "train_samples_per_second": sps,
            "global_batch": r.results.get("global_train_batch_size"), "speedup": speedup, "ideal_speedup": ideal,
            "efficiency": speedup / ideal, "metric": metric_key,
            "metric_value": (r.results.get("eval") or {}).get(metric_key),
            "instance_types": sorted({(n.get("labels") or {}).get("instance_type") or "local"
                                      for n in r.summary.get("nodes", [])}),
            "cost_usd": cost, "mfu": (r.results.get("mfu") or {}).get("mfu"),
        })
    return rows


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def shared_cpus(run: RunRecord) -> int | None:
    """How many distinct CPUs the nodes of a local cluster have between them, when they share some."""
    cpu_sets = [tuple((n.get("labels") or {}).get("cpus") or ()) for n in run.summary.get("nodes", [])]
    if not cpu_sets or not all(cpu_sets):
        return None
    distinct = {c for cpus in cpu_sets for c in cpus}
    return len(distinct) if len(distinct) < sum(len(c) for c in cpu_sets) else None


def report_md(bench_id: str, runs: list[RunRecord], rows: list[dict], command: str) -> str:
    base = runs[0].results
    _, metric_title, higher = METRICS.get(base.get("job"), ("eval_loss", "eval loss", False))
    lines = [
        f"# Scaling: {base.get('job')} on {runs[0].summary.get('cluster', '?')}",
        "",
        f"`{command}`",
        "",
        (f"Model {base.get('model')}, precision {base.get('precision')}, per-process batch "
         f"{base.get('per_device_train_batch_size')}, {base.get('train', {}).get('samples')} training samples, "
         f"the same flags at every size. Bench {bench_id}."),
        "",
        (f"| nodes | processes | wall time (s) | train time (s) | train samples/s | speed-up | scaling efficiency "
         f"| MFU | {metric_title} | cost per run (USD) |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['processes']} | {r['wall_s']:.1f} | {_fmt(r['train_s'], '.1f')} "
                     f"| {r['train_samples_per_second']:.1f} | {r['speedup']:.2f}x | {100 * r['efficiency']:.0f}% "
                     f"| {_fmt(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' * (r['mfu'] is not None)} "
                     f"| {_fmt(r['metric_value'], '.4g')} | {_fmt(r['cost_usd'], '.4f')} |")
    shared = shared_cpus(runs[-1])
    if shared:
        note = (f"Note: the {runs[-1].nodes} nodes of this local cluster share {shared} CPU(s) of one machine, "
                f"so no speed-up beyond {shared}x is possible here; real nodes do not share cores.")
        lines += ["", note]
    lines += [
        "",
        "![measured against ideal speed-up](scaling.png)",
        "",
        (f"- Speed-up: train samples/s against the {rows[0]['nodes']}-node run (each run's results.json); "
         "ideal = node ratio; scaling efficiency = speed-up / ideal."),
        ("- The per-process batch is fixed, so the global batch grows with the processes (as in the blog "
         f"posts' manual recipe): {', '.join(str(r['global_batch']) for r in rows)}. Compare the {metric_title} "
         f"({'higher' if higher else 'lower'} is better) with that in mind."),
        ("- MFU (model FLOPs utilisation): the Trainer's count of model FLOPs (6 x non-embedding parameters x "
         "tokens, padding included) per second of training, over the matmul FLOP/s every process measured on its "
         "cores right after training, at the model's FFN shape and the run's precision (results.json 'mfu'); "
         "n/a for runs without it."),
        "- Wall time is the whole run: start-up, data preparation, training and evaluation.",
        ("- Cost per run: nodes x on-demand price of their instance type (core/catalog.py) x wall time; "
         "n/a where the nodes have no known price (local nodes). Spot prices are usually lower."),
        "",
        "| nodes | run |",
        "|---:|---|",
        *[f"| {r['nodes']} | {r['run_id']} |" for r in rows],
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=120)
    ax.plot(nodes, [r["ideal_speedup"] for r in rows], "--", color="grey", label="ideal (linear)")
    ax.plot(nodes, [r["speedup"] for r in rows], "o-", color="#0068b5", label="measured")
    for r in rows:
        ax.annotate(f"{r['speedup']:.2f}x ({100 * r['efficiency']:.0f}%)", (r["nodes"], r["speedup"]),
                    textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set_xticks(nodes)
    ax.set_xlabel("nodes")
    ax.set_ylabel(f"speed-up over {nodes[0]} node(s) (train samples/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    with_mfu = [r for r in rows if r.get("mfu") is not None]
    if with_mfu:
        right = ax.twinx()
        right.plot([r["nodes"] for r in with_mfu], [100 * r["mfu"] for r in with_mfu], "s:", color="#e07b00",
                   label="MFU")
        right.set_ylabel("MFU (% of measured matmul peak)")
        right.set_ylim(0, max(100 * r["mfu"] for r in with_mfu) * 1.6)
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


BERT_BASE_BENCH = Path(__file__).resolve().parent.parent / "bench" / "results" / "glue_single_node-bert-base.json"


def seeds_prediction(runs: list[RunRecord], bench_json: Path = BERT_BASE_BENCH) -> tuple[predict.Measured | None, list]:
    """The manual recipe's MRPC fine-tune predicted from bert-base measured on one node here (bench/glue_single_node.py
    --model-shape bert-base) or, without that, from this bench's 1-node run (reports/predict.py)."""
    one = next((r for r in runs if r.nodes == 1), None)
    measured = predict.from_bench_json(bench_json) or (predict.from_run(one.results) if one else None)
    return measured, (predict.table(measured) if measured else [])


def write_report(runs: list[RunRecord], bench_dir: Path, bench_id: str, command: str) -> list[dict]:
    """Check the runs compare like with like, then write results.json, report.md and scaling.png."""
    runs = sorted(runs, key=lambda r: r.nodes)
    check_comparable(runs)
    rows = rows_from(runs)
    bench_dir.mkdir(parents=True, exist_ok=True)
    base = runs[0].results
    measured, prediction = seeds_prediction(runs)
    payload = {"bench_id": bench_id, "command": command, "job": base.get("job"), "model": base.get("model"),
               "cluster": runs[0].summary.get("cluster"), "args": runs[0].summary.get("args"),
               "baseline_nodes": rows[0]["nodes"], "rows": rows, "runs": [r.run_id for r in runs],
               "prediction_seeds_mrpc": {"measured": dataclasses.asdict(measured) if measured else None,
                                         "rows": prediction}}
    (bench_dir / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    md = report_md(bench_id, runs, rows, command)
    if measured:
        md += "\n" + "\n".join(predict.report_lines(measured, prediction)) + "\n"
    (bench_dir / "report.md").write_text(md)
    plot(rows, bench_dir / "scaling.png", f"{base.get('job')} ({base.get('model')}): speed-up with nodes")
    return rows


def bench(cluster: Cluster, sizes_text: str, template: TrainRequest, out: TextIO = sys.stdout,
          command: str | None = None) -> BenchResult:
    """Run template's job at each size in sizes_text, one after another, then write the report."""
    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    what = template.spec.what
    if what.script is not None:
        raise ClusterError("fab bench runs the bundled jobs (--job glue|qa|clm), whose results.json the report "
                           "reads", fix="drop --script")
    sizes = parse_sizes(sizes_text, len(cluster.nodes), cluster.spec)
    validate(template)  # a bad job or missing data fails before the first run
    label = what.job
    bench_id = f"bench-{new_run_id(label)}"
    bench_dir = Path(template.runs_dir) / bench_id
    where = template.spec.where
    flags = [f"--env {k}={v}" for k, v in secrets.masked(what.env, template.valueless).items()]
    flags += ([] if where.pin else ["--no-pin"]) + ([f"--timeout {where.timeout_s}"] if where.timeout_s != 300 else [])
    command = command or (f"fab bench --nodes {','.join(map(str, sizes))} --job {label} "
                          + "".join(f + " " for f in flags) + "-- " + shlex.join(what.args))
    runs: list[RunRecord] = []
    started = time.monotonic()
    for i, n in enumerate(sizes, 1):
        say(f"[bench {i}/{len(sizes)}] {n} node(s): {label} "
            f"(elapsed {time.monotonic() - started:.0f}s)")
        try:
            result = train(cluster, template.but(nodes=n), out)
        except ClusterError as exc:
            done = ", ".join(f"{r.nodes} node(s): {r.run_id}" for r in runs) or "none"
            raise ClusterError(f"bench {bench_id} stopped: the {n}-node run failed: {exc} (finished runs: {done})") \
                from None
        record = load_run(result.run_dir)
        runs.append(record)
        tr = record.results.get("train", {})
        say(f"[bench {i}/{len(sizes)}] {n} node(s): {tr.get('train_samples_per_second', float('nan')):.1f} "
            f"train samples/s, {record.summary['wall_s']:.0f}s wall -> {result.run_id}")
    rows = write_report(runs, bench_dir, bench_id, command)
    return BenchResult(bench_id, bench_dir, rows, runs)


def report_from_runs(run_ids: str, runs_dir: Path, command: str | None = None) -> BenchResult:
    """A report over runs that already finished (`fab bench --runs ID,ID`), with the same checks."""
    ids = [x.strip() for x in run_ids.split(",") if x.strip()]
    if len(ids) < 2:
        raise ClusterError(f"--runs {run_ids!r} names fewer than two runs", fix="give at least two run ids, "
                           "comma-separated")
    missing = [x for x in ids if not RunPaths(x, runs_dir=runs_dir).home.is_dir()]
    if missing:
        raise ClusterError(f"--runs: no run {', '.join(missing)} in {runs_dir}", fix="see the folder names there")
    runs = [load_run(RunPaths(x, runs_dir=runs_dir).home) for x in ids]
    bench_id = f"bench-{new_run_id('report')}"
    bench_dir = Path(runs_dir) / bench_id
    rows = write_report(runs, bench_dir, bench_id, command or f"fab bench --runs {','.join(ids)}")
    return BenchResult(bench_id, bench_dir, rows, sorted(runs, key=lambda r: r.nodes))


def summary_line(result: BenchResult) -> str:
    parts = [f"{r['nodes']} node(s) {r['train_samples_per_second']:.1f} samples/s {r['speedup']:.2f}x "
             f"({100 * r['efficiency']:.0f}%)" + (f" MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "")
             for r in result.rows]
    line = f"bench {result.bench_id}: " + "; ".join(parts) + f" -> {result.bench_dir / 'report.md'}"
    _, prediction = seeds_prediction(result.runs)
    if prediction:
        line += ("\nPREDICTION, the manual recipe's MRPC fine-tune (bert-base, 3 epochs, batch 32), training time "
                 "and on-demand cost: ") + \
            "; ".join(f"{p['nodes']}x {p['instance_type']} {p['wall_s'] / 60:.1f} min {p['on_demand_usd']:.3f} USD"
                      for p in prediction) + " (report.md)"
    return line
