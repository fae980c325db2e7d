"""RunSpec: one frozen, nested description of a run, its JSON codec and its rules (training/runtime/spec.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from training.runtime.spec import Recovery, RunSpec, Where


def test_fields_change_by_their_own_names_and_the_spec_round_trips_through_json():
    spec = RunSpec().but(nodes=4, min_nodes=2, max_restarts=3, script="train.py", job=None, args=["--lr", "1"],
                         env={"A": "1"}, precision="bf16", save_every="200")
    assert (spec.where.nodes, spec.recovery.min_nodes, spec.what.args, spec.speed.precision) == (4, 2, ("--lr", "1"),
                                                                                                 "bf16")
    kept = json.loads(json.dumps(spec.to_json()))
    assert set(kept) == {"what", "where", "speed", "saving", "recovery"} and kept["what"]["args"] == ["--lr", "1"]
    assert RunSpec.from_json(kept) == spec
    assert spec.but(recovery=Recovery(max_restarts=1)).recovery == Recovery(max_restarts=1)  # a whole section
    with pytest.raises(TypeError, match="no field bogus"):
        spec.but(bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.where.nodes = 2


def test_a_record_written_before_the_spec_had_sections_reads_back():
    flat = {"job": "glue", "script": None, "args": ["--seed", "1"], "ppn": "1", "threads": "auto", "backend": "gloo",
            "precision": "fp32", "env": {"A": "***"}, "save_every": "20", "pin": False, "timeout_s": 120,
            "recovery": {"max_restarts": 2, "restart_wait": 30, "min_nodes": 1, "grow_back": False},
            "script_digest": None, "data": {"/d/train.csv": "abc"}, "launcher": None}
    spec = RunSpec.from_json(flat)
    assert spec.where == Where(nodes=None, ppn="1", threads="auto", pin=False, timeout_s=120)
    assert spec.recovery == Recovery(max_restarts=2, restart_wait=30, min_nodes=1, grow_back=False)
    assert spec.speed.comm_hook == "none"  # records before --comm-hook sent fp32 gradients
    assert spec.what.launcher == "python" and spec.what.data == {"/d/train.csv": "abc"}  # null: the default
    assert RunSpec.of_summary({"request": flat}) == spec == RunSpec.of_summary({"spec": flat})
    assert RunSpec.of_summary({"status": "ok"}) is None


@pytest.mark.parametrize("changes, what", [
    ({"backend": "mpi"}, "--backend 'mpi' is not one of auto, ccl, gloo"),
    ({"precision": "fp8"}, "--precision 'fp8' is not one of auto, bf16, fp32"),
    ({"comm_hook": "int8"}, "--comm-hook 'int8' is not one of auto, none, bf16, fp16"),
    ({"save_every": "soon"}, "--save-every: save_every 'soon' is neither a step count (200) nor a duration "
                             + "(600s, 10m, 1h)"),
    ({"timeout_s": 0}, "--timeout 0 is below 1"),
    ({"ppn": "two"}, "--ppn 'two' is not a number"),
    ({"threads": "0"}, "--threads 0 must be at least 1"),
    ({"max_restarts": -1}, "--max-restarts -1 is below 0"),
    ({"restart_wait": -5}, "--restart-wait -5 is below 0"),
    ({"min_nodes": 0, "max_restarts": 1}, "--min-nodes 0 is below 1"),
    ({"min_nodes": 3, "nodes": 2, "max_restarts": 1}, "--min-nodes 3 is above --nodes 2"),
    ({"min_nodes": 1}, "--min-nodes 1 applies when a run restarts by itself"),
    ({"grow_back": False}, "--no-grow-back goes with --min-nodes"),
    ({"env": {"XC_NOTICE_POLL_S": "0"}}, "--env XC_NOTICE_POLL_S=0 is outside 0.1..60 seconds"),
])
def test_each_rule_names_the_flag_and_a_fix(changes, what):
    found = RunSpec().but(**changes).problem()
    assert found is not None and found[0] == what and found[1], found


def test_a_spec_within_every_rule_has_no_problem_and_counts_its_ranks():
    spec = RunSpec().but(nodes=2, min_nodes=1, max_restarts=1, grow_back=False, ppn="2", threads="auto")
    assert spec.problem() is None and RunSpec().problem() is None
    assert (spec.count("--ppn"), spec.count("--threads")) == (2, None)
