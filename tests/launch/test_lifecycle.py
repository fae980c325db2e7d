"""The run's lifecycle without a cluster: the record's state machine, summary.json written from and read
into the dataclass (old records too), the one ending's branches (ok, crash after finish, lost node,
preempted, interrupted), `fab stop` of a supervised run and the abandoned look, against fake nodes
(tests/fake_node.py) at the SSH boundary. Seconds, not minutes."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_node import FakeCluster, FakeNode

from core import procs
from core.errors import ClusterError, Interrupted, NodeFailure, NodeLost, Preempted, format_error
from launch.life import cleanup, detach, lifecycle, records, stop
from launch.life.lifecycle import Outcome, Run
from launch.life.records import FAILURES, TERMINAL, BadTransition, RunRecord, Status
from launch.staging import outputs, userscript
from training.runtime import events
from training.runtime import notice as notice_lib
from training.runtime.notice import GROUP, SPOT, Notice
from training.runtime.paths import Checkpoints, RunPaths

HOME = "/h"


# -- the state machine ---------------------------------------------------------------------------------
def test_status_sets_and_named_transitions():
    assert Status.RUNNING not in TERMINAL and Status.RESTARTING not in TERMINAL
    assert Status.OK in TERMINAL and Status.OK not in FAILURES
    assert {Status.PREEMPTED, Status.ABANDONED, Status.STOPPED} <= FAILURES
    rec = RunRecord("r1")
    rec._move(Status.RUNNING)._move(Status.PREEMPTED)._move(Status.RESTARTING)
    rec._move(Status.PREEMPTED, restarted_as="r2")
    assert rec.status == Status.PREEMPTED and rec.restarted_as == "r2"
    with pytest.raises(BadTransition):  # an ended run is never running again
        rec._move(Status.RUNNING)
    with pytest.raises(BadTransition):
        RunRecord("r", Status.OK)._move(Status.STOPPED)
    with pytest.raises(BadTransition):  # a field the record does not have is a bug, not a new key
        RunRecord("r", Status.RUNNING)._move(Status.OK, no_such_field=1)
    assert RunRecord("r", Status.RESTARTING).can(Status.ABANDONED)
    assert not RunRecord("r", Status.RUNNING).can(Status.RUNNING)


def test_every_named_transition_reaches_the_stores_copy(tmp_path):
    """The one writer saves at home and publishes to the store: stopped, restarting, restarted_as and
    abandoned read the same in runs/<id>/summary.json and in the store's copy (file:// store, real files)."""
    from cluster import store as store_lib

    url = f"file://{tmp_path / 'store'}"
    runs = tmp_path / "runs"

    def rec(run_id):
        return RunRecord(run_id, env={"XC_STORE": url}, started_at=1.0)

    def both(run_id):
        return records.load(runs / run_id).to_json(), store_lib.read_summary(url, run_id)

    a = records.running(runs / "a", rec("a"))
    records.ended(runs / "a", a, Status.PREEMPTED, 75, 3.0, cause="spot interruption")
    records.restarting(runs / "a", 1, 2, "spot interruption")
    home, copy = both("a")
    assert home == copy and copy["status"] == "restarting" and copy["restart"]["attempt"] == 1
    records.resumed_as(runs / "a", "b")
    home, copy = both("a")
    assert home == copy and copy["status"] == "preempted" and copy["restarted_as"] == "b" and "restart" not in copy
    b = records.running(runs / "b", rec("b"))
    records.stopped(runs / "b", b, {"killed": {}})
    home, copy = both("b")
    assert home == copy and copy["status"] == "stopped" and copy["exit_code"] == 143
    c = records.running(runs / "c", rec("c"))
    records.abandoned(runs / "c", c, {"found": "nothing"})
    assert both("c")[1]["status"] == "abandoned" and both("c")[1]["abandoned"]["was"] == "running"
    with pytest.raises(BadTransition):
        records.ended(runs / "c", records.load(runs / "c"), Status.STOPPED, 0, 0.0)


def test_summary_json_round_trips_and_old_records_still_read(tmp_path):
    rec = RunRecord("r1", nodes=[{"name": "node0"}], job="glue", args=["--seed", "1"], world_size=2, ppn=1,
                    cause="spot interruption")
    rec._move(Status.RUNNING, started_at=1.5)
    rec._save(tmp_path)
    data = json.loads((tmp_path / "summary.json").read_text())
    # the fields every reader used stay, unset optional ones stay out, statuses are their plain words
    assert data["status"] == "running" and data["script"] is None and "preempted" not in data
    assert data["cause"] == "spot interruption"
    back = records.load(tmp_path)
    assert back == rec
    # a record written before this change: no supervisor, keys this version does not know are kept
    old = {"run_id": "old", "status": "ok", "exit_code": 0, "wall_s": 12.0, "nodes": [{"name": "node0"}],
           "job": "glue", "eval": {"eval_accuracy": 0.8}, "some_future_key": [1]}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps(old))
    rec = records.load(tmp_path / "old")
    assert rec.status == Status.OK and rec.eval == {"eval_accuracy": 0.8} and rec.supervisor is None
    rec._save(tmp_path / "old")
    assert json.loads((tmp_path / "old" / "summary.json").read_text())["some_future_key"] == [1]
    with pytest.raises(ClusterError) as exc:
        records.load(tmp_path / "none")
    assert exc.value.fix == "pass a run id from 'fab runs'"


def test_errors_carry_what_and_fix_and_are_formatted_once():
    e = ClusterError("--nodes 6 but the cluster has 4 nodes", "lower --nodes")
    assert (e.what, e.fix) == ("--nodes 6 but the cluster has 4 nodes", "lower --nodes")
    assert format_error(e) == "error: --nodes 6 but the cluster has 4 nodes; lower --nodes"
    text = ClusterError("x is wrong; do y")  # nothing splits text: a '; ' inside 'what' stays in 'what'
    assert (text.what, text.fix, str(text)) == ("x is wrong; do y", "", "x is wrong; do y")
    p = Preempted("run a preempted", run_id="a", node="node1", fix="resume with 'fab train --resume a'")
    assert format_error(p) == "run a preempted; resume with 'fab train --resume a'" and p.exit_code == 75


def test_fan_out_keeps_each_nodes_own_exception(monkeypatch):
    from cluster import remote

    a, b = FakeNode("node0"), FakeNode("node1", reachable=False)
    fc = FakeCluster(a, b)

    def boom(node):
        if node.name == "node0":
            raise ValueError("bad value")
        return fc.connect(node)

    with pytest.raises(NodeFailure) as exc:
        remote.fan_out(fc.nodes, boom, "checking")
    err = exc.value
    assert err.nodes == ["node0", "node1"] and err.lost == ["node1"]
    assert isinstance(err.errors["node0"], ValueError) and err.errors["node1"].node == "node1"
    assert "node0: ValueError: bad value" in err.what


# -- the one ending ------------------------------------------------------------------------------------
def _run(tmp_path: Path, monkeypatch, *fakes: FakeNode, job: bool = True, detached: bool = False) -> Run:
    fc = FakeCluster(*fakes)
    fc.install(monkeypatch, lifecycle, cleanup, outputs, userscript)
    plan = detach.LogPlan("r1", 1, tuple(f.name for f in fakes))
    rec = RunRecord("r1", nodes=[n.to_dict() for n in fc.nodes], job="glue" if job else None, ppn=1,
                    world_size=len(fakes), detached=detached or None)
    (tmp_path / "r1").mkdir(parents=True)
    rec._move(Status.RUNNING)._save(tmp_path / "r1")
    return Run("r1", tmp_path, HOME, fc.nodes, plan, rec, remote_output=f"{HOME}/runs/r1/output", is_job=job)


def _finished(n: int) -> list[str]:
    return [f"[{r}] [finished] rank {r}" for r in range(n)]


def test_ok_brings_results_into_the_record(tmp_path, monkeypatch):
    n0 = FakeNode("node0", files={f"{HOME}/runs/r1/output/results.json": b'{"eval": {"eval_accuracy": 0.9}, '
                                  b'"train": {"train_samples_per_second": 3.5}}'})
    r = _run(tmp_path, monkeypatch, n0, FakeNode("node1"), detached=True)
    result = lifecycle.end(r, Outcome(0, _finished(2), {0, 1}, 10.0), print)
    rec = records.load(tmp_path / "r1")
    assert result.results["eval"]["eval_accuracy"] == 0.9
    assert rec.status == Status.OK and rec.train_samples_per_second == 3.5 and rec.wall_s == 10.0
    assert rec.cleanup["clean"] is True  # a detached run is swept: nobody watched its processes
    assert (tmp_path / "r1" / "results.json").is_file()


def test_a_crash_after_every_rank_finished_keeps_the_results(tmp_path, monkeypatch):
    n0 = FakeNode("node0", files={f"{HOME}/runs/r1/output/results.json": b"{}"}, procs={"r1": 1})
    r = _run(tmp_path, monkeypatch, n0, FakeNode("node1"))
    said = []
    lifecycle.end(r, Outcome(134, _finished(2) + ["[1] Abort in ccl teardown"], {0, 1}, 5.0), said.append)
    rec = records.load(tmp_path / "r1")
    assert rec.status == Status.OK and rec.crashed_after_finish["exit_code"] == 134
    assert rec.cleanup["killed"] == {"node0": 1, "node1": 0} and not n0.procs
    assert said and said[0].startswith("note: ")


def test_a_lost_node_fails_the_run_as_node_lost(tmp_path, monkeypatch):
    n1 = FakeNode("node1", reachable=False)
    r = _run(tmp_path, monkeypatch, FakeNode("node0", procs={"r1": 2}), n1)
    with pytest.raises(NodeLost) as exc:
        lifecycle.end(r, Outcome(255, ["[0] training", "connection to node1 lost"], set(), 30.0), print)
    assert exc.value.lost == ["node1"] and exc.value.run_id == "r1" and exc.value.nodes == ["node1"]
    rec = records.load(tmp_path / "r1")
    assert rec.status == Status.FAILED and rec.lost_nodes == ["node1"] and rec.failed_node == "node1"
    assert rec.cause == records.Cause.NODE_LOST == "node lost"  # a value, not free text
    assert rec.cleanup["unchecked"]["node1"].startswith("node1 (127.0.0.9:2222) is unreachable")


def test_a_crash_on_nodes_that_answer_is_a_plain_failure(tmp_path, monkeypatch):
    r = _run(tmp_path, monkeypatch, FakeNode("node0"), FakeNode("node1"))
    with pytest.raises(NodeFailure) as exc:
        lifecycle.end(r, Outcome(1, ["[1] Traceback (most recent call last):", "[1] ValueError: nan"], set(), 3.0),
                      print)
    assert not isinstance(exc.value, NodeLost) and exc.value.lost == []
    assert records.load(tmp_path / "r1").failed_node == "node1" and records.load(tmp_path / "r1").cause == "crashed"
    assert exc.value.fix == f"see {tmp_path / 'r1' / 'log.txt'}"


def test_the_ranks_events_come_home_and_fold_into_the_record_even_where_the_stream_lost_them(tmp_path, monkeypatch):
    ranks = [dataclasses.replace(events.progress(s, 10, float(s), 0.5), time=100.0 + s) for s in (1, 2, 3)]
    n0 = FakeNode("node0", files={f"{HOME}/runs/r1/events/0.jsonl": "".join(e.to_json() + "\n" for e in ranks).encode(),
                                  f"{HOME}/runs/r1/output/results.json": b"{}"})
    n1 = FakeNode("node1", files={f"{HOME}/runs/r1/events/1.jsonl":
                                  (events.RunEvent(events.FINISHED, 1, time=200.0).to_json() + "\n").encode()})
    r = _run(tmp_path, monkeypatch, n0, n1)
    r.record.segment = {"nodes": 2, "world_size": 2, "accumulation": 1, "from_step": 0}
    # the stream lost node 0's last lines: rank 0's own end came by, rank 1's did not; the files say both finished
    lifecycle.end(r, Outcome(134, ["[0] [finished] rank 0", "[1] Abort in ccl teardown"], {0}, 5.0), print)
    rec = records.load(tmp_path / "r1")
    assert rec.status == Status.OK and rec.crashed_after_finish["exit_code"] == 134
    gathered = events.read_jsonl((tmp_path / "r1" / events.RUN_FILE).read_text())
    assert [e.kind for e in gathered] == ["progress"] * 3 + ["finished"] and gathered[-1].rank == 1
    failed = _run(tmp_path / "b", monkeypatch, FakeNode("node0", files={
        f"{HOME}/runs/r1/events/0.jsonl": "".join(e.to_json() + "\n" for e in ranks[:2]).encode()}), FakeNode("node1"))
    failed.record.segment = {"nodes": 2, "world_size": 2, "accumulation": 1, "from_step": 0}
    with pytest.raises(NodeFailure):
        lifecycle.end(failed, Outcome(1, ["[1] Traceback (most recent call last):"], set(), 3.0), print)
    assert records.load(tmp_path / "b" / "r1").segment["to_step"] == 2  # the step it reached, from its events


def test_preempted_brings_its_checkpoint_home(tmp_path, monkeypatch):
    ck = f"{HOME}/runs/r1/output/checkpoint-20"
    n0 = FakeNode("node0", files={f"{ck}/model.safetensors": b"w", f"{ck}/{Checkpoints.MARKER}": b"{}"})
    r = _run(tmp_path, monkeypatch, n0, FakeNode("node1"))
    notice = "[0] " + Notice(SPOT, rank=1, step=20, checkpoint="checkpoint-20", durable=False).event().line()
    lifecycle.end(r, Outcome(0, [notice], set(), 8.0), print)  # exit 0: the notice alone is no preemption
    assert records.load(tmp_path / "r1").status == Status.OK
    r = _run(tmp_path / "b", monkeypatch, n0, FakeNode("node1"))
    with pytest.raises(Preempted) as exc:
        lifecycle.end(r, Outcome(notice_lib.EXIT, [notice], set(), 8.0), print)
    assert exc.value.node == "node1" and exc.value.fix == "resume with 'fab train --resume r1'"
    rec = records.load(tmp_path / "b" / "r1")
    assert rec.status == Status.PREEMPTED and rec.exit_code == 75 and rec.preempted["step"] == 20
    assert rec.cause == "spot interruption"
    assert (tmp_path / "b" / "r1" / "checkpoints" / "checkpoint-20" / "model.safetensors").read_bytes() == b"w"


def test_a_notice_whose_checkpoint_is_not_durable_resumes_from_the_previous_complete_one(tmp_path, monkeypatch):
    from training.runtime import store as training_store

    url = f"file://{tmp_path / 'store'}"
    store = training_store.open_store(url)
    for step in (10, 20):  # 20 is the notice's: its upload never finished, so it has no marker
        store.put_bytes(f"{RunPaths('r1').store_checkpoint(step)}/model.safetensors", b"w")
    store.put_bytes(f"{RunPaths('r1').store_checkpoint(10)}/{Checkpoints.MARKER}", b"{}")
    r = _run(tmp_path, monkeypatch, FakeNode("node0"), FakeNode("node1"))
    r.record.env["XC_STORE"] = url
    notice = "[0] " + Notice(GROUP, rank=1, step=20, checkpoint="checkpoint-20", durable=False).event().line()
    with pytest.raises(Preempted) as exc:
        lifecycle.end(r, Outcome(notice_lib.EXIT, [notice], set(), 8.0), print)
    assert "not durable" in exc.value.what and "step 10" in exc.value.what
    rec = records.load(tmp_path / "r1")
    assert rec.status == Status.PREEMPTED and rec.cause == GROUP
    assert rec.preempted["step"] == 10 and rec.preempted["notice_step"] == 20 and rec.preempted["durable"] is False
    assert "did not become durable" in rec.reason
    assert training_store.open_store(url).get_bytes("runs/r1/summary.json")  # the store's copy says it too


def test_a_store_that_does_not_answer_is_its_own_cause_retried_and_the_run_stays_restartable(tmp_path, monkeypatch):
    """Expired credentials while the ending is decided are not 'no checkpoint' (a failure that
    is not restarted): the store is asked again, and if it still does not answer the run is preempted with the
    cause 'store unreachable', which --max-restarts resumes (asking the store again then)."""
    from cluster import store as store_lib
    from core.errors import ClusterError

    asked = []

    def expired(url, run_id):
        asked.append(run_id)
        raise ClusterError("store s3://xc-a/cl: the credentials expired", fix="renew them")

    monkeypatch.setattr(store_lib, "checkpoints", expired)
    monkeypatch.setattr(lifecycle, "STORE_RETRY_S", 0.0)
    r = _run(tmp_path, monkeypatch, FakeNode("node0"), FakeNode("node1"))
    url = f"file://{tmp_path / 'store'}"  # the records' copies go there; its checkpoints are what fails
    r.record.env["XC_STORE"] = url
    notice = "[0] " + Notice(GROUP, rank=1, step=20, checkpoint="checkpoint-20", durable=True).event().line()
    with pytest.raises(Preempted) as exc:  # Preempted: restarts.why_restart restarts it
        lifecycle.end(r, Outcome(notice_lib.EXIT, [notice], set(), 8.0), print)
    assert asked == ["r1"] * lifecycle.STORE_TRIES and lifecycle.STORE_TRIES >= 2
    assert "did not answer" in exc.value.what and "fab train --resume r1" in exc.value.fix
    rec = records.load(tmp_path / "r1")
    assert rec.status == Status.PREEMPTED and rec.cause == records.Cause.STORE_UNREACHABLE == "store unreachable"
    assert Status.RESTARTING in records.TRANSITIONS[rec.status]
    assert rec.preempted["checkpoint"] is None and rec.preempted["notice_cause"] == GROUP

    # a store that answers on the second try: the ordinary ending, from the checkpoint it holds
    answers = iter([ClusterError("store: timed out", fix="retry"), [10, 20]])

    def flaky(url, run_id):
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(store_lib, "checkpoints", flaky)
    r = _run(tmp_path / "b", monkeypatch, FakeNode("node0"), FakeNode("node1"))
    r.record.env["XC_STORE"] = url
    with pytest.raises(Preempted):
        lifecycle.end(r, Outcome(notice_lib.EXIT, [notice], set(), 8.0), print)
    rec = records.load(tmp_path / "b" / "r1")
    assert rec.cause == GROUP and rec.preempted["step"] == 20 and rec.preempted["durable"] is True


def test_preempted_without_a_checkpoint_is_a_failure(tmp_path, monkeypatch):
    r = _run(tmp_path, monkeypatch, FakeNode("node0"), FakeNode("node1"))
    with pytest.raises(NodeFailure):
        lifecycle.end(r, Outcome(75, ["[0] " + Notice(SPOT, 0, 5, "checkpoint-5", False).event().line()], set(), 8.0), print)
    assert records.load(tmp_path / "r1").status == Status.FAILED


def test_interrupted_is_recorded_with_what_is_left(tmp_path, monkeypatch):
    r = _run(tmp_path, monkeypatch, FakeNode("node0", procs={"r1": 1}), FakeNode("node1"))
    with pytest.raises(Interrupted) as exc:
        lifecycle.end(r, Outcome(130, [], set(), 4.0, interrupted=True), print)
    assert exc.value.exit_code == 130 and "nothing is left running" in exc.value.what
    assert records.load(tmp_path / "r1").status == Status.INTERRUPTED


# -- runs nobody ends ----------------------------------------------------------------------------------
def _dead_process() -> dict:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    sup = {"pid": p.pid, "host": records.this_process()["host"], "start": procs.start_time(p.pid) or "0"}
    p.wait()
    return sup


def test_a_run_whose_supervisor_died_is_abandoned_once_nothing_is_left(tmp_path, monkeypatch):
    n0, n1 = FakeNode("node0", procs={"r1": 1}), FakeNode("node1")
    r = _run(tmp_path, monkeypatch, n0, n1)
    r.record.supervisor = _dead_process()
    r.record._save(r.run_dir)
    rec = lifecycle.reap(r.run_dir, records.load(r.run_dir))
    assert rec.status == Status.RUNNING  # its ranks still run: 'fab stop' ends them, it is not abandoned
    n0.procs.clear()
    rec = lifecycle.reap(r.run_dir, records.load(r.run_dir))
    assert rec.status == Status.ABANDONED and records.load(r.run_dir).status == Status.ABANDONED
    assert rec.abandoned["was"] == "running" and "node0, node1" in rec.abandoned["found"]
    # a live supervisor (this process), and a plain detached run, are left to their own ending
    mine = RunRecord("r2", Status.RUNNING, nodes=rec.nodes, supervisor=records.this_process())
    assert lifecycle.reap(tmp_path, mine).status == Status.RUNNING
    plain = RunRecord("r3", Status.RUNNING, nodes=rec.nodes, detached=True)
    assert lifecycle.reap(tmp_path, plain).status == Status.RUNNING
    assert not any("kill -9" in c for c in n0.commands)  # looking never kills


def test_stop_ends_the_supervisor_then_the_ranks(tmp_path, monkeypatch):
    n0 = FakeNode("node0", procs={"r1": 2})
    r = _run(tmp_path, monkeypatch, n0, FakeNode("node1"))
    fc = FakeCluster(n0, FakeNode("node1"))
    monkeypatch.setattr(cleanup, "connect", fc.connect)
    monkeypatch.setattr(stop.lock, "release", lambda nodes, run_id: None)
    sup = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        r.record.supervisor = {"pid": sup.pid, "host": records.this_process()["host"],
                               "start": procs.start_time(sup.pid)}
        r.record._save(r.run_dir)
        line = stop.stop(fc, "r1", tmp_path)
        assert sup.wait(timeout=5) == -15  # SIGTERM: it starts no restart
    finally:
        if sup.poll() is None:
            os.kill(sup.pid, 9)
    assert line.startswith(f"run r1 stopped: its supervisor (pid {sup.pid}) ended; killed its processes on node0")
    rec = records.load(r.run_dir)
    assert rec.status == Status.STOPPED and rec.cleanup["killed"]["node0"] == 2


def test_stop_follows_a_resume_chain_to_its_newest_run(tmp_path):
    RunRecord("a", Status.PREEMPTED, restarted_as="b")._save(_mk(tmp_path / "a"))
    RunRecord("b", Status.RUNNING)._save(_mk(tmp_path / "b"))
    assert stop.latest(tmp_path, "a") == "b" and stop.latest(tmp_path, "b") == "b"


def _mk(p: Path) -> Path:
    p.mkdir(parents=True)
    return p


# -- the request, resolved once ------------------------------------------------------------------------
def _resumable(runs: Path) -> None:
    d = _mk(runs / "old")
    request = {"job": "glue", "script": None, "args": ["--seed", "1"], "ppn": "1", "threads": "2", "backend": "gloo",
               "precision": "fp32", "env": {}, "save_every": "20", "pin": True, "timeout_s": 900, "data": {}}
    RunRecord("old", Status.PREEMPTED, spec=request, world_size=2, nodes=[{}, {}])._save(d)
    ck = _mk(d / "checkpoints" / "checkpoint-20")
    (ck / "model.safetensors").write_bytes(b"w")
    (ck / Checkpoints.MARKER).write_text("{}")


def test_resume_keeps_recorded_values_only_for_flags_not_given(tmp_path):
    from launch.supervision.train_flags import TrainFlags, resolve

    _resumable(tmp_path)
    kept = resolve(TrainFlags(resume="old"), tmp_path).req
    assert (kept.spec.where.ppn, kept.spec.where.threads, kept.spec.where.timeout_s, kept.spec.speed.backend, kept.spec.saving.save_every) == ("1", "2", 900, "gloo", "20")
    # a flag given at its default value still says what the user wants: it resets the recorded one
    reset = resolve(TrainFlags(resume="old", ppn="auto", timeout="300", backend="auto"), tmp_path).req
    assert (reset.spec.where.ppn, reset.spec.where.timeout_s, reset.spec.speed.backend, reset.spec.where.threads) == ("auto", 300, "auto", "2")
    assert reset.resume.step == 20 and reset.spec.what.args == ("--seed", "1")
    new = resolve(TrainFlags(job_args=["--seed", "2"]), tmp_path)
    assert (new.req.spec.where.ppn, new.req.spec.where.timeout_s, new.req.spec.what.launcher, new.max_restarts, new.supervised) == \
        ("auto", 300, "python", 0, False)
    both = resolve(TrainFlags(detach=True, max_restarts="2"), tmp_path)
    assert both.supervised and not both.req.detach and both.max_restarts == 2  # the supervisor runs it attached
    with pytest.raises(ClusterError) as exc:
        resolve(TrainFlags(resume="old", job_args=["--seed", "3"]), tmp_path)
    assert exc.value.fix == "drop --job/--script/--workdir/--module/--launcher/--requirements and the flags after --"


def test_a_script_run_resumes_with_its_own_code_and_refuses_changed_code(tmp_path):
    """--resume (and so --max-restarts) takes --script/--workdir runs: the same script, folder and flags; a folder
    or script that changed since the run shipped it is refused with the fix."""
    from launch.plan.request import file_digest
    from launch.staging import workdir as workdir_lib
    from launch.supervision.train_flags import TrainFlags, resolve

    proj = _mk(tmp_path / "proj")
    (proj / "train.py").write_text("print('hi')\n")
    lone = tmp_path / "lone.py"
    lone.write_text("print('lone')\n")
    for run_id, script, wd in (("wd", "train.py", str(proj)), ("lone", str(lone), None)):
        d = _mk(tmp_path / "runs" / run_id)
        request = {"job": "glue", "script": script, "workdir": wd, "module": None, "launcher": "python",
                   "args": ["--output_dir", "out"], "ppn": "1", "threads": "2", "backend": "gloo", "precision": "fp32",
                   "env": {}, "save_every": "20", "pin": True, "timeout_s": 900, "data": {},
                   "script_digest": None if wd else file_digest(script)}
        RunRecord(run_id, Status.PREEMPTED, spec=request, world_size=2, nodes=[{}, {}],
                  workdir=workdir_lib.scan(wd).record() if wd else None)._save(d)
        ck = _mk(d / "checkpoints" / "checkpoint-20")
        (ck / "model.safetensors").write_bytes(b"w")
        (ck / Checkpoints.MARKER).write_text("{}")
    req = resolve(TrainFlags(resume="wd"), tmp_path / "runs").req
    assert (req.spec.what.script, req.spec.what.workdir, req.spec.what.launcher, req.spec.what.args) == ("train.py", str(proj), "python", ("--output_dir", "out"))
    assert req.resume.step == 20
    assert resolve(TrainFlags(resume="lone"), tmp_path / "runs").req.spec.what.script == str(lone)
    (proj / "train.py").write_text("print('changed')\n")
    with pytest.raises(ClusterError) as exc:
        resolve(TrainFlags(resume="wd"), tmp_path / "runs")
    assert "changed since the run shipped it" in exc.value.what and "start the run anew" in exc.value.fix
    lone.write_text("print('changed')\n")
    with pytest.raises(ClusterError) as exc:
        resolve(TrainFlags(resume="lone"), tmp_path / "runs")
    assert "changed since the run" in exc.value.what


def test_a_request_round_trips_through_its_record_with_secrets_masked(tmp_path):
    from launch.plan.request import TrainRequest

    data = tmp_path / "train.csv"
    data.write_text("a,b\n1,2\n")
    req = TrainRequest.of(job="glue", args=["--train_file", str(data), "--seed", "3"], ppn="1", threads="2",
                       env={"HF_TOKEN": "s3cret", "A": "1"}, valueless={"HF_TOKEN"}, timeout_s=120, save_every="20")
    kept = req.to_record()
    assert kept["what"]["env"] == {"HF_TOKEN": "***", "A": "1"} and "s3cret" not in json.dumps(kept)
    assert kept["what"]["data"] == {str(data.resolve()): request_digest(data)}
    back = TrainRequest.from_record(json.loads(json.dumps(kept)), {"HF_TOKEN": "s3cret", "A": "1"}, {"HF_TOKEN"},
                                    runs_dir=tmp_path)
    assert back == req.but(runs_dir=tmp_path, data=kept["what"]["data"])  # the digests a resume checks ride along


def request_digest(path) -> str:
    from launch.plan.request import file_digest

    return file_digest(str(path))


def test_the_last_output_dir_wins_and_a_file_flag_without_a_value_is_one_line():
    from launch.plan import request
    from launch.staging import userscript

    assert userscript.output_flag(["--output_dir", "a", "--seed", "1", "--output_dir=b"]) == "b"  # argparse's rule
    assert userscript.output_flag(["--seed", "1"]) is None
    with pytest.raises(ClusterError) as exc:
        request.rewrite_files(["--seed", "1", "--train_file"])
    assert exc.value.what == "--train_file needs a file path" and exc.value.fix == "pass the data file after it"


def test_one_parser_reads_job_flags():
    from launch.staging import jobflags

    argv = ["--a", "1", "--b", "--c=x=y", "pos", "--a", "2", "--d"]
    assert jobflags.values(argv) == {"--a": "2", "--b": "", "--c": "x=y", "--d": ""}
    assert jobflags.get(argv, "--a") == "2" and jobflags.get(argv, "--b") is None
    assert jobflags.get(argv, "--zz", "dflt") == "dflt"
    assert jobflags.without(argv, "--a") == ["--b", "--c=x=y", "pos", "--d"]
    assert jobflags.has(argv, "--d") and not jobflags.has(argv, "--e")


def test_the_supervisors_job_crosses_a_pipe_even_with_a_scanned_workdir(tmp_path):
    import pickle

    from launch.plan.request import TrainRequest, validate
    from launch.supervision import supervisor
    from training.runtime.spec import Recovery

    (tmp_path / "train.py").write_text("print(1)\n")
    req = TrainRequest.of(job=None, script="train.py", workdir=str(tmp_path), runs_dir=tmp_path / "runs",
                       env={"HF_TOKEN": "s3cret"}, valueless={"HF_TOKEN"})
    req = validate(req)
    assert req.checked and req.checked[0] is not None  # plan_run will not scan --workdir again
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.env = {}  # resolved once: a step that needs another request makes one
    req = req.but(recovery=Recovery(max_restarts=2, restart_wait=60))
    job = pickle.loads(supervisor.payload("local", req))
    assert job["req"].checked is None and job["req"].spec.what.workdir == str(tmp_path) and job["req"].spec.recovery.max_restarts == 2
    assert job["req"].spec.what.env == {"HF_TOKEN": "s3cret"}  # on the pipe only: fab writes no file with it
