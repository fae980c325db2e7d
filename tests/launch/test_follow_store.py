"""`fab logs RUN -f` from the store (a run a head supervises, followed from any checkout): a chain's end line names
the last run's place in the store and its figures, read from the store's records. No cluster: a file store with the
records a supervisor publishes."""
from __future__ import annotations

import io
import json
from pathlib import Path

from launch.life import runs
from launch.life.records import RunRecord, Status


def _publish(root: Path, run_id: str, record: RunRecord, log: str, results: dict | None = None) -> None:
    run = root / "runs" / run_id
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(record.to_json()))
    (run / "log.txt").write_text(log)
    if results is not None:
        (run / "results.json").write_text(json.dumps(results))


def test_a_chain_followed_in_the_store_ends_with_its_last_runs_place_and_figures(tmp_path):
    root = tmp_path / "store"
    url = root.as_uri()
    first, second = "20261129-081452-script-d598", "20261129-081650-script-76c3"
    _publish(root, first, RunRecord(first, status=Status.PREEMPTED, wall_s=71, restarted_as=second, ppn=1,
                                    nodes=[{"name": "twin-0"}]), "[0 twin-0] step 58\n")
    _publish(root, second, RunRecord(second, status=Status.OK, exit_code=0, wall_s=346, ppn=1,
                                     nodes=[{"name": "twin-0"}]), "[0 twin-0] step 375\n",
             {"eval": {"eval_accuracy": 0.985}, "train": {"train_samples_per_second": 15.4}})
    out = io.StringIO()
    line = runs._follow_store(url, first, out, 0.0, None, tmp_path / "runs")
    assert f"run {first} preempted; resumed as run {second}" in out.getvalue()
    # the place was printed as 's3:/bucket/prefix', the URL's '//' lost, with no run in it and no figures
    assert line == (f"run {second} finished in 346s eval accuracy 0.985 train 15.4 samples/s -> "
                    f"{url}/runs/{second}"), line
