"""`fab bench` (scaling report) and `fab kube` (PyTorchJob + Dockerfile).

Unit tests build reports from run records written the way `fab train` writes them; the cluster
test runs `fab bench --nodes 1,2` for real and checks that every figure in the report, results.json
and the chart's data comes from the runs' own results.json and summary.json.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import fab

from cluster import store as store_lib
from core.errors import ClusterError
from launch.life import records
from node_setup import profiles
from reports import bench, kube

# A small clm run: tiny GPT-2, 256 blocks of 128 tokens, one epoch (16 steps per rank on 1 node).
BENCH_ARGS = ["--max_train_samples", "256", "--max_eval_samples", "32", "--num_train_epochs", "1",
              "--per_device_train_batch_size", "8", "--seed", "7"]


def fake_run(root: Path, run_id: str, nodes: int, sps: float, args=None, model="m", labels=None,
             fingerprint="abc", metric=0.8, samples=400, mfu=None) -> Path:
    """A finished run's folder as `fab train` leaves it (summary.json + results.json)."""
    d = root / run_id
    d.mkdir(parents=True)
    node_list = [{"name": f"node{i}", "labels": dict(labels or {})} for i in range(nodes)]
    records.RunRecord(run_id, records.Status.OK, wall_s=100.0 / nodes + 10, nodes=node_list, cluster="local",
                      world_size=nodes, args=args if args is not None else ["--seed", "1", "--output_dir", "output"]
                      )._save(d)
    (d / "results.json").write_text(json.dumps({
        "job": "glue", "model": model, "world_size": nodes, "precision": "bf16", "data_fingerprint": fingerprint,
        "train_file": f"/x/code/{run_id}/train.csv", "per_device_train_batch_size": 8,
        "global_train_batch_size": 8 * nodes,
        "train": {"train_samples_per_second": sps, "train_runtime": 100.0 / nodes, "samples": samples},
        "eval": {"eval_accuracy": metric}, **({"mfu": {"mfu": mfu}} if mfu is not None else {})}))
    return d


@pytest.mark.parametrize("text, sizes", [("1,2,4", [1, 2, 4]), ("4, 1,2,2", [1, 2, 4]), ("3", [3])])
def test_sizes_parse_sorted_without_repeats(text, sizes):
    assert bench.parse_sizes(text, 4, "local") == sizes


@pytest.mark.parametrize("text, message", [
    ("1,x", "--nodes '1,x': 'x' is not a node count"),
    ("1,,2", "'' is not a node count"),
    ("0,2", "0 is below 1"),
    ("1,2,8", "8 is more than the 4 node(s) of cluster 'local'; run 'fab local-up --nodes 8' or drop it"),
])
def test_bad_sizes_name_value_rule_and_fix(text, message):
    with pytest.raises(ClusterError, match=re.escape(message)):
        bench.parse_sizes(text, 4, "local")


def test_report_numbers_come_from_the_run_records(tmp_path):
    runs = [bench.load_run(fake_run(tmp_path, f"r{n}", n, sps, mfu=mfu))
            for n, sps, mfu in ((1, 10.0, 0.25), (2, 18.0, 0.2251), (4, 30.0, None))]
    rows = bench.write_report(list(reversed(runs)), tmp_path / "b", "b", "fab bench --nodes 1,2,4")
    assert [r["nodes"] for r in rows] == [1, 2, 4]
    assert [round(r["speedup"], 3) for r in rows] == [1.0, 1.8, 3.0]
    assert [round(r["efficiency"], 3) for r in rows] == [1.0, 0.9, 0.75]
    assert all(r["cost_usd"] is None for r in rows)  # local nodes have no price
    md = (tmp_path / "b" / "report.md").read_text()
    assert "| 2 | 2 | 60.0 | 50.0 | 18.0 | 1.80x | 90% | 22.5% | 0.8 | n/a |" in md
    assert "| 4 | 4 | 35.0 | 25.0 | 30.0 | 3.00x | 75% | n/a | 0.8 | n/a |" in md  # a run without MFU figures
    assert bench.summary_line(bench.BenchResult("b", tmp_path / "b", rows, runs)).startswith(
        "bench b: 1 node(s) 10.0 samples/s 1.00x (100%) MFU 25.0%; 2 node(s) 18.0 samples/s 1.80x (90%) MFU 22.5%; "
        "4 node(s) 30.0 samples/s 3.00x (75%) -> ")
    saved = json.loads((tmp_path / "b" / "results.json").read_text())
    assert saved["runs"] == ["r1", "r2", "r4"] and saved["baseline_nodes"] == 1
    png = (tmp_path / "b" / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_report_says_when_local_nodes_share_cpus(tmp_path):
    runs = [bench.load_run(fake_run(tmp_path, f"r{n}", n, 10.0, labels={"cpus": [0]})) for n in (1, 4)]
    bench.write_report(runs, tmp_path / "b", "b", "cmd")
    md = (tmp_path / "b" / "report.md").read_text()
    assert "the 4 nodes of this local cluster share 1 CPU(s) of one machine" in md
    apart = [bench.load_run(fake_run(tmp_path / "apart", f"r{n}", n, 10.0)) for n in (1, 2)]
    assert bench.shared_cpus(apart[1]) is None


def test_cost_per_run_uses_the_catalog_price_of_the_instance_type(tmp_path):
    from core.catalog import CATALOG

    labels = {"instance_type": "c6i.16xlarge"}
    runs = [bench.load_run(fake_run(tmp_path, f"r{n}", n, 10.0 * n, labels=labels)) for n in (1, 2)]
    rows = bench.rows_from(runs)
    price = CATALOG["c6i.16xlarge"].on_demand_usd_h
    assert rows[0]["cost_usd"] == pytest.approx(price * 110.0 / 3600)
    assert rows[1]["cost_usd"] == pytest.approx(2 * price * 60.0 / 3600)
    assert rows[1]["instance_types"] == ["c6i.16xlarge"]


@pytest.mark.parametrize("change, message", [
    ({"args": ["--seed", "2", "--output_dir", "output"]}, "differ in --seed (1 vs 2)"),
    ({"args": ["--seed", "1", "--bf16", "--output_dir", "x"]}, "differ in --bf16 (unset vs set)"),
    ({"model": "other"}, "differ in model (m vs other)"),
    ({"fingerprint": "zzz"}, "differ in data_fingerprint (abc vs zzz)"),
    ({"samples": 200}, "trained on 400 vs 200 samples"),
])
def test_runs_that_differ_are_refused(tmp_path, change, message):
    a = bench.load_run(fake_run(tmp_path, "a", 1, 10.0))
    b = bench.load_run(fake_run(tmp_path, "b", 2, 18.0, **change))
    with pytest.raises(ClusterError, match=re.escape(message)):
        bench.write_report([a, b], tmp_path / "bench", "x", "cmd")
    assert not (tmp_path / "bench").exists()  # nothing half-written


def test_a_failed_run_is_not_compared(tmp_path):
    d = fake_run(tmp_path, "bad", 1, 10.0)
    rec = records.load(d)
    rec.status = records.Status.FAILED  # as a failed run leaves it
    rec._save(d)
    with pytest.raises(ClusterError, match="did not finish"):
        bench.load_run(d)


# ---- fab kube --------------------------------------------------------------------------------

def render(tmp_path, *args):
    res = fab("kube", "--out", str(tmp_path / "k"), *args, timeout=120)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load((tmp_path / "k" / "pytorchjob.yaml").read_text())


def test_kube_manifest_is_a_pytorchjob_with_master_and_workers(tmp_path):
    doc = render(tmp_path, "--nodes", "4", "--job", "qa", "--instance-type", "c6i.32xlarge", "--",
                 "--max_seq_length", "384", "--doc_stride", "128")
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert doc["metadata"]["name"] == "xeon-qa-4n" and doc["metadata"]["namespace"] == "kubeflow"
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    for role in ("Master", "Worker"):
        pod = specs[role]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch"
        assert c["command"][:3] == ["python", "-m", "training.jobs.qa"]
        assert c["command"][3:7] == ["--max_seq_length", "384", "--doc_stride", "128"]
        assert c["command"][-2:] == ["--output_dir", "/pvc/output/xeon-qa-4n"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        # c6i.32xlarge: 128 vCPUs, 64 cores, 256 GiB, no AMX
        assert env["XC_BACKEND"] == "gloo" and env["XC_PRECISION"] == "fp32"
        assert env["OMP_NUM_THREADS"] == "60" and env["HF_HOME"].startswith("/pvc/")
        assert env["XC_HOME"].startswith("/pvc/")  # the clm token cache, shared by the pods
        assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "120", "memory": "228Gi"}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {"pvc-volume": "/pvc", "dshm": "/dev/shm"}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert vols["pvc-volume"]["persistentVolumeClaim"]["claimName"] == "xeon-cluster-pvc"
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "c6i.32xlarge"}


def test_kube_one_node_has_no_workers_and_the_image_gets_the_profile(tmp_path):
    doc = render(tmp_path, "--nodes", "1", "--job", "clm", "--profile", "oneccl")
    assert list(doc["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    (c,) = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["XC_BACKEND"] == "ccl" and env["CCL_WORKER_COUNT"] == "1"
    out = tmp_path / "k"
    # the image runs the very setup script `fab setup` runs, and carries the training code
    assert (out / "node_setup.sh").read_text() == profiles.render_setup_script("oneccl", venv=kube.VENV)
    dockerfile = (out / "Dockerfile").read_text()
    assert re.search(r"^FROM ubuntu:24\.04$", dockerfile, re.MULTILINE)
    assert "RUN bash /tmp/node_setup.sh" in dockerfile and "COPY training /workspace/training" in dockerfile
    assert (out / "training" / "jobs" / "clm.py").is_file() and not list((out / "training").rglob("__pycache__"))


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes 0 is below 1"),
    (["--nodes", "x"], "--nodes 'x' is not a whole number"),
    (["--job", "nope"], "--job 'nope' is not a bundled job"),
    (["--instance-type", "t2.nano"], "--instance-type 't2.nano' is not in the catalog; use one of c6i.2xlarge"),
    (["--", "--output_dir", "/tmp/x"], "--output_dir is set by fab kube"),
])
def test_kube_bad_input_is_one_line(tmp_path, args, message):
    res = fab("kube", "--out", str(tmp_path / "k"), *args, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, res.stderr
    assert not (tmp_path / "k").exists()


# ---- fab bench on the local cluster -------------------------------------------------------------

@pytest.mark.cluster
def test_bench_one_and_two_nodes_writes_report_and_chart_from_the_runs(cluster2, tmp_path):
    runs_dir = tmp_path / "runs"
    env = {"XC_RUNS_DIR": str(runs_dir)}
    res = cluster2.fab("bench", "--nodes", "1,2", "--job", "clm", "--", *BENCH_ARGS, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[bench 1/2] 1 node(s): clm" in res.stdout and "[bench 2/2] 2 node(s): clm" in res.stdout
    assert "[0 node0] [progress] step" in res.stdout  # the runs' live output streams through
    bench_dir = next(runs_dir.glob("bench-*"))
    saved = json.loads((bench_dir / "results.json").read_text())
    rows = saved["rows"]
    assert [r["nodes"] for r in rows] == [1, 2] and [r["processes"] for r in rows] == [1, 2]
    md = (bench_dir / "report.md").read_text()
    own = []
    for row, run_id in zip(rows, saved["runs"]):
        results = json.loads((runs_dir / run_id / "results.json").read_text())
        summary = records.load(runs_dir / run_id).to_json()
        assert results["world_size"] == row["nodes"] and summary["args"][:len(BENCH_ARGS)] == BENCH_ARGS
        # its checkpoints and records went where fab train keeps them: the cluster's store
        assert summary["env"]["XC_STORE"].startswith("file://"), summary["env"]
        assert store_lib.read_summary(summary["env"]["XC_STORE"], run_id)["status"] == "ok"
        own.append(results["train"]["train_samples_per_second"])
        assert row["train_samples_per_second"] == own[-1]
        assert row["metric_value"] == results["eval"]["eval_perplexity"]
        assert row["wall_s"] == summary["wall_s"]
        line = (f"| {row['nodes']} | {row['nodes']} | {summary['wall_s']:.1f} | "
                f"{results['train']['train_runtime']:.1f} | {own[-1]:.1f} | {own[-1] / own[0]:.2f}x |")
        assert line in md, md
        assert row["cost_usd"] is None and md.count("| n/a |") == 2
        assert row["mfu"] == results["mfu"]["mfu"] and 0 < row["mfu"] < 1  # measured by the run itself
        assert f"| {100 * row['mfu']:.1f}% |" in md
    assert rows[1]["speedup"] == pytest.approx(own[1] / own[0])
    assert rows[1]["efficiency"] == pytest.approx(own[1] / own[0] / 2)
    png = (bench_dir / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # the second run found the token files its node prepared in the first (one preparation per node)
    log2 = (runs_dir / saved["runs"][1] / "log.txt").read_text()
    assert "(reused)" in log2

    # the same report again from the finished runs ...
    again = cluster2.fab("bench", "--runs", ",".join(saved["runs"]), env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    second = json.loads(next(p for p in runs_dir.glob("bench-*") if p != bench_dir).joinpath("results.json")
                        .read_text())
    assert [r["train_samples_per_second"] for r in second["rows"]] == own
    # ... and a refusal when one run's flags were different
    changed = runs_dir / "changed"
    shutil.copytree(runs_dir / saved["runs"][1], changed)
    rec = records.load(changed)
    rec.args = [a if a != "7" else "8" for a in rec.args]  # --seed 7 -> 8
    rec._save(changed)
    bad = cluster2.fab("bench", "--runs", f"{saved['runs'][0]},changed", env=env, timeout=120)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("error: runs ") and "differ in --seed (7 vs 8)" in bad.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("args, message", [
    (["--nodes", "1,x"], "--nodes '1,x': 'x' is not a node count"),
    (["--nodes", "1,3"], "3 is more than the 2 node(s) of cluster 'local'; run 'fab local-up --nodes 3'"),
    (["--job", "clm"], "--nodes is missing"),
    (["--nodes", "1,2", "--job", "nope"], "--job 'nope' is not a bundled job"),
    (["--nodes", "1,2", "--job", "qa", "--", "--train_file", "/nonexistent/train.json"],
     "--train_file /nonexistent/train.json does not exist"),
    (["--runs", "nope1,nope2"], "no run nope1, nope2"),
    (["--runs", "a,b", "--nodes", "1,2"], "--runs and --nodes exclude each other"),
])
def test_bench_bad_input_is_one_line_and_runs_nothing(cluster2, tmp_path, args, message):
    runs_dir = tmp_path / "runs"
    res = cluster2.fab("bench", *args, env={"XC_RUNS_DIR": str(runs_dir)}, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, res.stderr
    assert "Traceback" not in res.stderr
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_kube_into_a_folder_it_cannot_write_is_one_line(tmp_path):
    res = fab("kube", "--out", "/proc/xc-kube", timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --out /proc/xc-kube is not a writable folder (") and last.endswith(
        "pass another with --out"), last
