"""training/speed/native's bookkeeping: which path each kernel took (results.json's speed), one kernel off at a time
(bench/bert_step.py's <v>-no-<kernel>), the node-side check `python -m training.speed.native` (fab setup builds
the library with it, fab doctor's kernels row reads it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_GCC

from cluster.node import Node
from doctor.rows import kernels_row
from launch.plan.preflight import Facts
from training.speed import fastdrop, fused, native

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("fresh_native")


@NEEDS_GCC
def test_one_kernel_off_leaves_the_others_and_the_report_says_which_path_each_took():
    x = torch.randn(64, 32)
    with native.off("output"):
        assert native.lib("output") is None and native.lib("dropout") is not None
    assert native.lib("output") is not None and native.lib("output") is not None  # back on after the block
    fastdrop.dropout(x, 0.1)
    report = native.report()
    assert report["dropout"] == "native"
    assert report["output"] == "native (67% of calls); torch: off in this bench (33% of calls)"
    assert set(report) == {"dropout", "output"}  # kernels nothing asked for are left out


def test_an_unknown_kernel_is_refused_naming_the_kernels():
    with (pytest.raises(ValueError, match="no native kernel softmax; the kernels: dropout, output, adamw"),
          native.off("softmax")):
        pass


def test_turned_off_by_the_environment_the_report_gives_the_variable(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    fastdrop.dropout(torch.randn(8, 8), 0.5)
    assert native.report() == {"dropout": "torch: XC_NATIVE_KERNELS=0"}


def test_a_kernel_for_bf16_says_why_an_fp32_block_took_torchs_path():
    module = torch.nn.Linear(4, 4).train()
    assert fused._native("output", module, torch.randn(2, 4), module.weight, module.bias) is None
    assert native.report() == {"output": "torch (the kernel is for bf16 weights and activations on the CPU)"}
    module.eval()  # evaluation is not training's path: not tallied
    native.reset()
    assert fused._native("output", module, torch.randn(2, 4)) is None
    assert "output" not in native.report()


def _check(env: dict[str, str]) -> dict:
    res = subprocess.run([sys.executable, "-m", "training.speed.native"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


@NEEDS_GCC
def test_the_node_side_check_builds_and_loads_the_library():
    got = _check({})
    assert got["ok"] is True and got["detail"].startswith("built for this CPU and loaded: ")
    assert Path(got["detail"].rsplit(": ", 1)[1]).is_file()


@NEEDS_GCC
def test_the_node_side_check_remembers_a_load_and_then_needs_no_torch_import(tmp_path):
    """fab doctor and each cluster's first run ask every node: a load this venv's torch made before is read from a
    stamp beside the library instead of importing torch (~1.7 CPU-s). Shown with a `torch` that cannot import."""
    first = _check({})
    assert first["ok"] is True
    library = Path(first["detail"].rsplit(": ", 1)[1])
    assert list(library.parent.glob(library.name + ".loaded-*"))
    broken = tmp_path / "shadow" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch cannot import')\n")
    assert _check({"PYTHONPATH": str(broken.parent)}) == first
    for stamp in library.parent.glob(library.name + ".loaded-*"):
        stamp.unlink()
    assert _check({"PYTHONPATH": str(broken.parent)}) == {
        "ok": None, "detail": "built, not loaded: this torch cannot import (no job runs on this python)"}


def test_the_node_side_check_without_the_kernels_says_so():
    assert _check({native.ENV: "0"}) == {"ok": False, "detail": "XC_NATIVE_KERNELS=0: torch's own ops"}
    # no gcc on PATH: not built, with the compiler's absence as the reason
    assert _check({"PATH": "/nonexistent"}) == {
        "ok": False, "detail": "not built: gcc not found"}


def test_doctors_kernels_row():
    node = Node(name="node0", host="127.0.0.1", private_host="127.0.0.1", user="u")
    assert kernels_row(Facts(node)).skipped
    assert kernels_row(Facts(node, kernels=(None, "built, not loaded: No module named 'torch'"))).skipped
    row = kernels_row(Facts(node, kernels=(False, "not built: gcc not found")))
    assert not row.ok and row.detail == "not built: gcc not found" and "install gcc" in row.fix
    assert kernels_row(Facts(node, kernels=(True, "built for this CPU and loaded: /x.so"))).ok


def test_fab_runs_names_a_run_whose_kernels_fell_back_and_why(tmp_path):
    from launch.life import records, runs
    from launch.life.records import RunRecord, Status

    fell = RunRecord("r1", Status.OK, nodes=[{}])
    records.merge_results(fell, tmp_path, {"speed": {"model": "eager", "dropout": "torch: XC_NATIVE_KERNELS=0",
                                                     "output": "torch: XC_NATIVE_KERNELS=0", "adamw": "native"}})
    fp32 = RunRecord("r2", Status.OK, nodes=[{}], speed={
        "model": "eager", "dropout": "native", "output": "torch (the kernel is for bf16 weights and activations)"})
    assert RunRecord.from_json(fell.to_json()).speed == fell.speed  # kept in the run's record
    assert runs.speed_lines([fell, fp32]) == ["speed r1: torch's ops for dropout, output: XC_NATIVE_KERNELS=0"]
