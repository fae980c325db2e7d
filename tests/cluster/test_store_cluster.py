"""The store on a real 2-node local cluster with a moto S3 server over HTTP: a run preempted by the fake IMDS
leaves a complete checkpoint in S3 (nothing of it at home), `fab train --resume` takes it from there onto the
nodes and finishes, `fab pull` brings the results home, `fab runs` lists a run that exists only in the store."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import progress_steps
from fake_imds import FakeIMDS
from moto_fixture import client

from training.runtime.paths import Checkpoints

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BUCKET = "xc-cluster-store"



def test_preempted_to_s3_resumed_from_s3_and_pulled(cluster2, aws_env, small_model, monkeypatch, tmp_path):
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    s3 = client("s3")
    s3.create_bucket(Bucket=BUCKET)
    store = f"s3://{BUCKET}/cl"
    imds = FakeIMDS()
    before = cluster2.run_dirs()
    try:
        ended, _ = imds.train_until(cluster2, FakeIMDS.short_args(small_model), fab_args=("--store", store))
    finally:
        imds.close()
    out, err = ended.stdout, ended.stderr
    assert ended.returncode == 75, out[-3000:] + err[-3000:]
    assert f"store: {store} (--store)" in out.splitlines()[:3]  # the run's first lines name its store
    run_id = (cluster2.run_dirs() - before).pop()
    m = re.search(rf"preempted on node\d at step (\d+): checkpoint saved \({store}/runs/{run_id}/checkpoints/"
                  rf"checkpoint-(\d+)\)", err)
    assert m and m.group(1) == m.group(2), err[-2000:]
    step = int(m.group(1))
    assert re.search(rf"\[store\] checkpoint step {step} durable in {store}", out)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"cl/runs/{run_id}/")["Contents"]}
    ckpt = f"cl/runs/{run_id}/checkpoints/checkpoint-{step}/"
    for name in (Checkpoints.MARKER, "optimizer.pt", "model.safetensors", "rng_state_0.pth", "rng_state_1.pth"):
        assert ckpt + name in keys, name
    assert f"cl/runs/{run_id}/summary.json" in keys and f"cl/runs/{run_id}/log.txt" in keys
    # the credentials went to the ranks as secrets: the records keep ***
    summary = json.loads((cluster2.runs / run_id / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["env"]["AWS_SECRET_ACCESS_KEY"] == "***"
    assert summary["env"]["XC_STORE"] == store
    home_ckpts = cluster2.runs / run_id / "checkpoints"
    shutil.rmtree(home_ckpts, ignore_errors=True)  # nothing of the checkpoint at home (none was copied there)

    res = cluster2.fab("train", "--resume", run_id, "--store", store, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert min(progress_steps(res.stdout)) > step
    resumed = (cluster2.run_dirs() - before - {run_id}).pop()
    assert json.loads((cluster2.runs / resumed / "results.json").read_text())["resumed_from_step"] == step
    assert not home_ckpts.exists() and not (cluster2.runs / resumed / "checkpoints").exists()
    rsum = json.loads((cluster2.runs / resumed / "summary.json").read_text())
    assert rsum["env"]["XC_RESUME_URL"] == f"{store}/runs/{run_id}/checkpoints/checkpoint-{step}"

    # fab pull: the resumed run's records and outputs; the preempted run's checkpoint on request
    to = tmp_path / "pulled"
    pulled = cluster2.fab("pull", resumed, "--store", store, "--to", str(to), timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert re.search(r"pulled \d+ file\(s\)", pulled.stdout)
    for name in ("summary.json", "results.json", "log.txt", "output/model.safetensors", "output/trainer_state.json"):
        assert (to / name).is_file(), name
    ck = cluster2.fab("pull", run_id, "--store", store, "--checkpoints", "--to", str(tmp_path / "ck"), timeout=300)
    assert ck.returncode == 0 and (tmp_path / "ck" / f"checkpoints/checkpoint-{step}" / Checkpoints.MARKER).is_file()

    # a run recorded only in the store (started from another machine) still lists
    shutil.rmtree(cluster2.runs / resumed)
    listed = cluster2.fab("runs", "--store", store, timeout=120)
    row = next(ln.split() for ln in listed.stdout.splitlines() if ln.startswith(resumed))
    assert row[3] == "ok" and row[-1] == "store"
    logs = cluster2.fab("logs", resumed, "--store", store, timeout=120)
    assert logs.returncode == 0 and re.search(r"^\[0 node0\] \[finished\] rank 0$", logs.stdout, re.MULTILINE)
    missing = cluster2.fab("pull", "20260101-000000-glue-0000", "--store", store, timeout=120)
    assert missing.returncode == 1 and missing.stderr.strip().splitlines()[-1].startswith("error: no run ")


@pytest.mark.cluster
def test_doctor_has_a_store_row_per_node(cluster2, aws_env, monkeypatch):
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    client("s3").create_bucket(Bucket="xc-doctor-store")
    ok = cluster2.fab("doctor", "--quick", "--store", "s3://xc-doctor-store/p", timeout=300)
    rows = re.findall(r"^  store +(ok|FAIL) +(.*)$", ok.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["ok", "ok"], ok.stdout + ok.stderr
    assert "Contents" not in client("s3").list_objects_v2(Bucket="xc-doctor-store")  # each probe deleted itself
    bad = cluster2.fab("doctor", "--quick", "--store", "s3://xc-no-such-store/p", timeout=300)
    rows = re.findall(r"^  store +(ok|FAIL) +(.*)$", bad.stdout, re.MULTILINE)
    assert bad.returncode == 1 and [r[0] for r in rows] == ["FAIL", "FAIL"]
    assert rows[0][1].startswith("store s3://xc-no-such-store/p: the bucket does not exist")
    assert "(fix: create it ('pulumi up' makes the stack's)" in bad.stderr


FAILS_AFTER_WRITING = """import os, pathlib, time
out = pathlib.Path(os.environ["XC_OUTPUT_DIR"])
out.mkdir(parents=True, exist_ok=True)
if os.environ["RANK"] == "0":
    (out / "partial_metrics.json").write_text('{"step": 7}')
    time.sleep(60)
time.sleep(3)
raise SystemExit("rank 1 gives up")
"""


@pytest.mark.cluster
def test_a_failed_runs_outputs_and_records_reach_the_store(cluster2, aws_env, monkeypatch, tmp_path):
    """Outputs go to the store whatever the ending: what came home of a failed run goes beside its records."""
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    client("s3").create_bucket(Bucket="xc-failed-store")
    store = "s3://xc-failed-store/cl"
    script = tmp_path / "fails.py"
    script.write_text(FAILS_AFTER_WRITING)
    before = cluster2.run_dirs()
    res = cluster2.fab("train", "--nodes", "2", "--store", store, "--script", str(script), timeout=300)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    run_id = (cluster2.run_dirs() - before).pop()
    keys = {o["Key"] for o in client("s3").list_objects_v2(Bucket="xc-failed-store",
                                                           Prefix=f"cl/runs/{run_id}/").get("Contents", [])}
    assert f"cl/runs/{run_id}/output/partial_metrics.json" in keys, sorted(keys)
    assert {f"cl/runs/{run_id}/summary.json", f"cl/runs/{run_id}/log.txt"} <= keys
    assert json.loads(client("s3").get_object(Bucket="xc-failed-store", Key=f"cl/runs/{run_id}/summary.json")[
        "Body"].read())["status"] == "failed"
