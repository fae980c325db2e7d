"""The manual recipe's MRPC fine-tune prediction (reports/predict.py): its arithmetic, worked by hand here, and where
`fab bench`'s report takes its measured figure from."""
from __future__ import annotations

import json

import pytest

from reports import bench, predict


def test_steps_are_the_manual_recipes_345():
    assert predict.steps() == 3 * 115 == 345  # ceil(3668 / 32) = 115 a epoch


def test_ring_all_reduce_moves_twice_n_minus_one_over_n_of_the_gradient():
    assert predict.ring_bytes(100.0, 1) == 0.0
    assert predict.ring_bytes(100.0, 2) == 100.0
    assert predict.ring_bytes(100.0, 4) == 150.0


def test_prediction_worked_by_hand():
    measured = predict.Measured(samples_per_s=4.0, cores=2, source="test", precision="fp32")
    # c6i.16xlarge: 32 cores, 25 Gbit/s, 2.72 USD/h on demand
    one = predict.predict(measured, "c6i.16xlarge", 1, spot_usd_h=1.0)
    assert one["node_samples_per_s"] == pytest.approx(64.0)  # 4 samples/s x 32 / 2 cores
    assert one["compute_s"] == pytest.approx(0.5)  # 32 / 64
    assert one["comm_s"] == 0.0  # one node: nothing to all-reduce
    assert one["wall_s"] == pytest.approx(345 * 0.5)
    assert one["on_demand_usd"] == pytest.approx(2.72 * 172.5 / 3600)
    assert one["spot_usd"] == pytest.approx(1.0 * 172.5 / 3600)

    four = predict.predict(measured, "c6i.16xlarge", 4)
    grad = predict.BERT_BASE_TRAINED * 2  # bf16 on the wire
    comm = 1.5 * grad * 8 / 25e9
    assert four["compute_s"] == pytest.approx(0.125)
    assert four["comm_s"] == pytest.approx(comm)
    assert four["wall_s"] == pytest.approx(345 * (0.125 + comm))
    assert four["on_demand_usd"] == pytest.approx(4 * 2.72 * 345 * (0.125 + comm) / 3600)
    assert four["spot_usd"] is None

    fp32 = predict.predict(measured, "r7iz.16xlarge", 2, wire="fp32", overlap=0.5)
    assert fp32["comm_s"] == pytest.approx(predict.BERT_BASE_TRAINED * 4 * 8 / 25e9)
    assert fp32["step_s"] == pytest.approx(0.25 + fp32["comm_s"] / 2)


def test_each_type_gets_the_precision_fab_picks_there():
    measured = predict.Measured(12.0, 2, "test", precision="bf16", fp32_samples_per_s=4.0)
    c6i, r7iz = (predict.predict(measured, t, 1) for t in ("c6i.16xlarge", "r7iz.16xlarge"))
    assert (c6i["precision"], c6i["node_samples_per_s"], c6i["caveat"]) == ("fp32", 4.0 * 32 / 2, "")  # no bf16 on Ice Lake
    assert (r7iz["precision"], r7iz["node_samples_per_s"], r7iz["caveat"]) == ("bf16", 12.0 * 32 / 2, "")  # AMX
    bf16_only = predict.Measured(12.0, 2, "test", precision="bf16")
    row = predict.predict(bf16_only, "c6i.16xlarge", 1)
    assert row["node_samples_per_s"] == 12.0 * 32 / 2 and row["caveat"] == "bf16 figure for fp32: optimistic"
    line = next(x for x in predict.report_lines(bf16_only, [row]) if x.startswith("| c6i"))
    assert "| fp32 (bf16 figure for fp32: optimistic) |" in line


def test_table_covers_both_types_at_1_2_4_nodes_and_labels_itself_a_prediction():
    measured = predict.Measured(4.0, 2, "test figure")
    rows = predict.table(measured, {"r7iz.16xlarge": 2.0})
    assert [(r["instance_type"], r["nodes"]) for r in rows] == [
        (t, n) for t in ("c6i.16xlarge", "r7iz.16xlarge") for n in (1, 2, 4)]
    lines = predict.report_lines(measured, rows)
    assert lines[0].startswith("## PREDICTION")
    assert "Predicted, not measured" in lines[2] and "test figure" in lines[2]
    assert any(line.startswith("| c6i.16xlarge | 1 |") and "| <= " in line for line in lines)  # no spot price
    assert not any(line.startswith("| r7iz.16xlarge") and "<=" in line for line in lines)


def test_bench_report_predicts_from_the_bert_base_bench_or_the_one_node_run(tmp_path):
    results = {"job": "glue", "model": "m", "world_size": 1, "threads": 2,
               "mfu": {"model_flops_per_s": 100e9}, "train": {"train_samples_per_second": 10.0}}
    run = bench.RunRecord("r1", tmp_path, results, {"nodes": [{"name": "node0"}], "wall_s": 1.0})
    measured, rows = bench.seeds_prediction([run], tmp_path / "absent.json")
    per_sample = predict.BERT_BASE_FLOPS_PER_TOKEN * predict.MRPC_TOKENS
    assert measured.samples_per_s == pytest.approx(100e9 / per_sample) and measured.cores == 2
    assert len(rows) == 6
    bench_json = tmp_path / "glue_single_node-bert-base.json"
    bench_json.write_text(json.dumps({"batch": 32, "cpu": "cpu: X", "configs": {
        "default": {"samples_per_second": 5.0, "threads": 2, "precision": "bf16"},
        "fp32": {"samples_per_second": 2.0, "threads": 2, "precision": "fp32"}}}))
    measured, rows = bench.seeds_prediction([run], bench_json)
    assert (measured.samples_per_s, measured.cores) == (5.0, 2) and "cpu: X" in measured.source
    assert measured.fp32_samples_per_s == 2.0
    assert rows[0]["instance_type"] == "c6i.16xlarge" and rows[0]["node_samples_per_s"] == pytest.approx(2.0 * 32 / 2)
    assert rows[3]["instance_type"] == "r7iz.16xlarge" and rows[3]["node_samples_per_s"] == pytest.approx(5.0 * 32 / 2)


def test_a_run_that_went_on_at_reduced_size_is_priced_by_the_part_at_each_size():
    measured = predict.Measured(samples_per_s=4.0, cores=2, source="test", precision="fp32")
    four, two = (predict.predict(measured, "c6i.16xlarge", n) for n in (4, 2))
    r = predict.reduced(measured, "c6i.16xlarge", 4, 2, 0.5)
    assert r["wall_s"] == pytest.approx(0.5 * four["wall_s"] + 0.5 * two["wall_s"])
    assert r["on_demand_usd"] == pytest.approx(2.72 * (4 * 0.5 * four["wall_s"] + 2 * 0.5 * two["wall_s"]) / 3600)
    assert r["full_wall_s"] == four["wall_s"] and r["wall_s"] > four["wall_s"]
    lines = predict.report_lines(measured, predict.table(measured))
    assert any(line.startswith("At reduced size (`fab train --min-nodes`)") for line in lines)
    assert sum(line.startswith(("| c6i.16xlarge | 4 | 2 |", "| r7iz.16xlarge | 4 | 2 |")) for line in lines) == 2
