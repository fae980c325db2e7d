"""--max-restarts: a run that loses a node or gets a spot notice waits for the cluster to have its nodes
again and resumes by itself. Unit tests of the decisions, and one run on a real local cluster that is
preempted through a fake IMDS and then loses a node outright (sshd and processes killed)."""
from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import fab, processes_with_env, start_cluster
from fake_imds import FakeIMDS

from core.errors import ClusterError, NodeFailure, Preempted
from launch.life import records
from launch.life.records import RunRecord, RunResult, Status, load
from launch.plan.request import TrainRequest
from launch.run import DEMO_ARGS
from launch.supervision import restarts
from training.runtime.paths import Checkpoints
from training.runtime.spec import Recovery, RunSpec


def test_only_lost_nodes_and_preemptions_are_worth_a_restart():
    assert restarts.why_restart(Preempted("x", run_id="r1", node="node1")) == "run r1 was preempted on node1"
    assert restarts.why_restart(NodeFailure("x", ["node1"], run_id="r1", lost=["node1"])) == "run r1 lost node1"
    # a crash on nodes that still answer would crash again; a failure before launch has no run to resume
    assert restarts.why_restart(NodeFailure("x", ["node1"], run_id="r1")) is None
    assert restarts.why_restart(NodeFailure("x", ["node1"], lost=["node1"])) is None
    assert restarts.why_restart(ClusterError("x")) is None


def test_wait_for_nodes_says_each_new_problem_once_and_gives_up_after_the_wait(monkeypatch):
    answers = iter(["node1 unreachable", "node1 unreachable", "node1 has a spot interruption notice", None])
    monkeypatch.setattr(restarts, "missing", lambda spec, count, endpoint: next(answers))
    said = []
    restarts.wait_for_nodes("local", 2, 10, "http://x", said.append, poll_s=0)
    assert said[:2] == ["waiting for 2 node(s): node1 unreachable",
                        "waiting for 2 node(s): node1 has a spot interruption notice"]
    assert re.fullmatch(r"2 node\(s\) ready \(\d+\.\ds, 4 check\(s\)\)", said[2]) and len(said) == 3
    monkeypatch.setattr(restarts, "missing", lambda spec, count, endpoint: "node1 unreachable")
    with pytest.raises(ClusterError, match=r"within --restart-wait 0s \(node1 unreachable\)"):
        restarts.wait_for_nodes("local", 2, 0, "http://x", said.append, poll_s=0)


def test_a_node_whose_check_hangs_does_not_hold_the_next_check(monkeypatch):
    """A node EC2 takes mid-check can hold its SSH session for a minute: on the twin the restart's wait took 70 s
    for a replacement that had booted 55 s before. The check is given up by the clock."""
    import threading

    release = threading.Event()

    def ready(node, endpoint):
        if node.name == "node1":
            release.wait(30)  # the vanished host's session
            return "ok"
        return "ok"

    nodes = [SimpleNamespace(name="node0"), SimpleNamespace(name="node1")]
    monkeypatch.setattr(restarts, "open_cluster", lambda spec: SimpleNamespace(first=lambda count: nodes[:count]))
    monkeypatch.setattr(restarts, "node_ready", ready)
    monkeypatch.setattr(restarts, "CHECK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(restarts, "CHECK_MARGIN_S", 0.3)
    started = time.monotonic()
    try:
        assert restarts.missing("aws:x", 2, "") == "node1 did not finish the notice check within 0.5s"
        assert time.monotonic() - started < 5
        assert restarts.missing("aws:x", 1, "") is None
    finally:
        release.set()


LOCAL = SimpleNamespace(spec="local", nodes=())  # what train_with_restarts reads of a cluster: its spec (to
# rediscover it) and its nodes (none made with image=base)


def _fake_run(runs: Path, run_id: str, status: str, step: int | None, resumed_from: str | None = None) -> None:
    d = runs / run_id
    d.mkdir(parents=True)
    request = {"job": "glue", "script": None, "args": ["--seed", "1"], "ppn": "auto", "threads": "auto",
               "backend": "gloo", "precision": "fp32", "env": {}, "save_every": "20", "pin": True,
               "timeout_s": 300, "data": {}}
    RunRecord(run_id, Status(status), spec=request, world_size=2, nodes=[{}, {}],
              resumed_from={"run_id": resumed_from, "step": 1} if resumed_from else None)._save(d)
    if step is not None:
        ck = d / "checkpoints" / f"checkpoint-{step}"
        ck.mkdir(parents=True)
        (ck / "model.safetensors").write_bytes(b"w")
        (ck / Checkpoints.MARKER).write_text("{}")


def test_restarts_resume_from_the_newest_checkpoint_along_the_resume_chain(tmp_path, monkeypatch):
    _fake_run(tmp_path, "a", "failed", 20)
    _fake_run(tmp_path, "b", "failed", None, resumed_from="a")  # lost before its first checkpoint came home
    calls = []

    def fake_train(cluster, req, out):
        calls.append(req)
        if len(calls) == 1:
            raise NodeFailure("run b failed", ["node1"], run_id="b", lost=["node1"])
        return RunResult("c", tmp_path / "c", 0, 1.0, {})

    monkeypatch.setattr(restarts, "train", fake_train)
    monkeypatch.setattr(restarts, "open_cluster", lambda spec, **_: LOCAL)
    monkeypatch.setattr(restarts, "wait_for_nodes", lambda *a, **k: None)
    lines = []

    class Out:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    first = TrainRequest.of(nodes=2, job="glue", runs_dir=tmp_path, master_port=29611,
                         recovery=Recovery(max_restarts=1, restart_wait=5))
    assert restarts.train_with_restarts(LOCAL, first, out=Out()).run_id == "c"
    again = calls[1]
    # the run that was lost waits as 'restarting' and is resumed under a name of its own: the record says so
    assert again.restart_of == "b" and load(tmp_path / "b").restart["ended"] == "failed"
    assert again.resume.run_id == "a" and again.resume.step == 20
    assert again.spec.what.args == ("--seed", "1") and again.master_port == 29611
    assert "restart 1 of 1: run b lost node1" in "".join(lines)


def test_a_head_that_took_a_chain_over_counts_the_restarts_the_chain_already_had(tmp_path, monkeypatch):
    """launch.supervision.adopt: the second restart of a --max-restarts 2 chain reads '2 of 2' on the new head, and a
    chain that had both has none left."""
    _fake_run(tmp_path, "a", "preempted", 20)
    _fake_run(tmp_path, "b", "failed", None, resumed_from="a")
    monkeypatch.setattr(restarts, "train", lambda cluster, req, out: RunResult("c", tmp_path / "c", 0, 1.0, {}))
    monkeypatch.setattr(restarts, "open_cluster", lambda spec, **_: LOCAL)
    monkeypatch.setattr(restarts, "wait_for_nodes", lambda *a, **k: None)
    lost = NodeFailure("run b failed", ["node1"], run_id="b", lost=["node1"])
    out, req = io.StringIO(), TrainRequest.of(nodes=2, job="glue", runs_dir=tmp_path, recovery=Recovery(max_restarts=2))
    assert restarts.train_with_restarts(LOCAL, req, out=out, ended=lost, restarts_done=1).run_id == "c"
    assert "restart 2 of 2: run b lost node1" in out.getvalue()
    assert load(tmp_path / "b").restart["attempt"] == 2
    with pytest.raises(NodeFailure):
        restarts.train_with_restarts(LOCAL, req, out=io.StringIO(), ended=lost, restarts_done=2)


def test_no_restart_left_ends_with_the_failure_and_the_wait_problem(tmp_path, monkeypatch):
    _fake_run(tmp_path, "a", "preempted", 20)

    def preempted(cluster, req, out):
        raise Preempted("run a preempted on node1 at step 20: checkpoint saved (x); resume with "
                        "'fab train --resume a'", run_id="a", node="node1")

    monkeypatch.setattr(restarts, "train", preempted)
    monkeypatch.setattr(restarts, "open_cluster", lambda spec, **_: LOCAL)
    monkeypatch.setattr(restarts, "missing", lambda *a: "node1 has a spot interruption notice")
    req = TrainRequest.of(nodes=2, runs_dir=tmp_path)
    with pytest.raises(Preempted) as exc:
        restarts.train_with_restarts(LOCAL, req, out=io.StringIO())
    assert str(exc.value).endswith("resume with 'fab train --resume a'")
    with pytest.raises(Preempted) as exc:
        restarts.train_with_restarts(LOCAL, req.but(recovery=Recovery(max_restarts=2, restart_wait=0)),
                                     out=io.StringIO(), poll_s=0)
    assert str(exc.value).startswith("the cluster did not have 2 node(s) within --restart-wait 0s (node1 has a "
                                     "spot interruption notice); run a preempted")
    assert exc.value.run_id == "a" and exc.value.exit_code == 75
    rec = load(tmp_path / "a")  # waited as 'restarting', and ends as it ended when the wait gave up
    assert rec.status == Status.PREEMPTED and rec.restart is None
    assert RunSpec(recovery=Recovery(max_restarts=-1)).problem() == ("--max-restarts -1 is below 0", "pass 0 or more")


def _home_steps(run_dir: Path) -> list[int]:
    """Complete checkpoints of the run in its store: the local folder beside runs/ (the nodes share the disk)."""
    folder = run_dir.parent.parent / "store" / "runs" / run_dir.name / "checkpoints"
    return sorted(Checkpoints.step(d.name) for d in folder.glob("checkpoint-*")
                  if Checkpoints.step(d.name) is not None and (d / Checkpoints.MARKER).is_file())


# The resumed run must outlive the save of its first checkpoint into the store (the local store is beside runs/,
# so that is the save itself): 60 paced steps of the thin model, where the second run is killed at step 20 or 40.
@pytest.mark.cluster
@pytest.mark.slow
def test_a_preempted_run_and_a_killed_node_are_resumed_by_themselves(tmp_path, small_model):
    lc = start_cluster(tmp_path, 2)  # own cluster: a node of it is killed
    imds = FakeIMDS()
    running = lc.start("train", "--nodes", "2", "--save-every", "20", "--max-restarts", "2", "--restart-wait", "300",
                       *imds.train_env(), "--", *FakeIMDS.short_args(small_model), merge=True)
    try:
        first = running.wait_for(re.compile(r"^run (\S+): results in"), 300).group(1)
        running.wait_for(re.compile(r"\[progress\] step (1\d|[2-9]\d)/"), 400)
        imds.interrupt()  # a notice on every node: the run checkpoints and ends, the restart waits
        noticed = time.monotonic()
        running.wait_for(re.compile(r"waiting for 2 node\(s\): node\d has a spot interruption notice"), 200)
        waiting = time.monotonic()
        imds.clear()  # the nodes are 'replaced': no notice any more
        second = running.wait_for(re.compile(rf"^run (?!{first})(\S+): results in"), 300).group(1)
        print(f"notice -> waiting for nodes {waiting - noticed:.1f}s; notice withdrawn -> resumed run "
              f"{time.monotonic() - waiting:.1f}s")
        # the resumed run loses node1 outright once a checkpoint of its own is in the store
        deadline = time.monotonic() + 400
        while not _home_steps(lc.runs / second) and time.monotonic() < deadline and running.proc.poll() is None:
            time.sleep(0.5)
        assert _home_steps(lc.runs / second), running.stdout[-4000:]
        killed_at = time.monotonic()
        killed = lc.fab("local-kill", "--node", "node1", timeout=60)
        assert killed.returncode == 0 and killed.stdout.startswith("node1 killed"), killed.stdout + killed.stderr
        running.wait_for(re.compile(r"waiting for 2 node\(s\): .*node1"), 200)
        lost_at = time.monotonic()
        back = lc.fab("local-up", "--nodes", "2", "--port", str(lc.port), timeout=60)
        assert back.returncode == 0, back.stderr
        back_at = time.monotonic()
        third = running.wait_for(re.compile(rf"^run (?!{first}|{second})(\S+): results in"), 300).group(1)
        print(f"node killed -> run ended and waiting {lost_at - killed_at:.1f}s; node back -> resumed run "
              f"{time.monotonic() - back_at:.1f}s")
        ended = running.finish(900)
    finally:
        running.__exit__()
        imds.close()
        fab("local-down", env=lc.env, timeout=60)
    text = ended.stdout
    assert ended.returncode == 0, text[-4000:]
    assert "restart 1 of 2: run " + first + " was preempted on node" in text
    assert "restart 2 of 2: run " + second + " lost node1" in text
    assert re.search(rf"run {third} finished in \d+s eval accuracy", text)
    s1, s2, s3 = (records.load(lc.runs / r).to_json() for r in (first, second, third))
    assert s1["status"] == "preempted"
    assert s2["status"] == "failed" and s2["lost_nodes"] == ["node1"] and s2["resumed_from"]["run_id"] == first
    assert s3["status"] == "ok" and s3["resumed_from"]["run_id"] == second
    # the third run starts from a checkpoint the second one made, not from the first run's
    assert s3["resumed_from"]["step"] > s2["resumed_from"]["step"]
    assert s3["resumed_from"]["step"] in _home_steps(lc.runs / second)
    assert json.loads((lc.runs / third / "results.json").read_text())["resumed_from_step"] == s3["resumed_from"]["step"]
    for r in (first, second, third):
        assert processes_with_env(f"XC_RUN_ID={r}") == []


@pytest.mark.cluster
def test_a_run_that_fails_while_staging_still_gets_its_record(cluster2, monkeypatch, tmp_path):
    from cluster.resolve import open_cluster
    from launch import run as train_lib

    for key, value in cluster2.env.items():
        monkeypatch.setenv(key, value)

    def broken_tarball():
        raise ClusterError("the code tarball could not be built")

    monkeypatch.setattr(train_lib.shipping, "code_tarball", broken_tarball)
    req = TrainRequest.of(nodes=2, job="glue", args=list(DEMO_ARGS), runs_dir=tmp_path / "runs")
    with pytest.raises(ClusterError, match="could not be built"):
        train_lib.train(open_cluster("local"), req, out=io.StringIO())
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = records.load(run_dir).to_json()
    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert summary["reason"] == "before launch: the code tarball could not be built"
    assert summary["spec"]["what"]["args"] == list(DEMO_ARGS)  # a record good enough to run it again


@pytest.mark.cluster
@pytest.mark.slow
def test_losing_node0_mid_run_ends_with_a_record_and_nothing_left_on_the_others(tmp_path):
    lc = start_cluster(tmp_path, 2)  # own cluster: node0 is killed
    running = lc.start("train", "--nodes", "2", "--save-every", "0", "--", *DEMO_ARGS, merge=True)
    try:
        run_id = running.wait_for(re.compile(r"^run (\S+): results in"), 300).group(1)
        running.wait_for(re.compile(r"\[progress\] step [2-9]/"), 400)
        assert lc.fab("local-kill", "--node", "node0", timeout=60).returncode == 0
        ended = running.finish(300)
        text = ended.stdout
        assert ended.returncode == 1, text[-3000:]
        summary = records.load(lc.runs / run_id).to_json()
        assert summary["status"] == "failed" and summary["failed_node"] == "node0", summary.get("reason")
        assert summary["lost_nodes"] == ["node0"]
        assert summary["cleanup"]["unchecked"].keys() == {"node0"}  # not claimed clean: it could not be looked at
        assert "node0 not checked" in text.strip().splitlines()[-1]
        # node1 was reached and swept: nothing of the run is left there (node0's processes died with it)
        assert "node1" in summary["cleanup"]["killed"] and not summary["cleanup"]["left"]
        assert processes_with_env(f"XC_RUN_ID={run_id}") == []
    finally:
        running.__exit__()
        fab("local-down", env=lc.env, timeout=60)
