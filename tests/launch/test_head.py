"""The head: on a real 2-node local cluster with its head, a detached `--max-restarts 1` run's supervisor
runs in the head's session (XC_SUPERVISOR=<run id>, started through the head's sshd, none on this side); with the
operator's runs/ moved away a spot notice (fake IMDS) is recovered by the head, `fab runs` shows the chain ending ok
from the store with what the restart cost, `fab logs` shows the resumed run's progress, nothing is left running,
and the run's secret is in no file in clear. Without a cluster: a hosts file's head, the AWS head's systemd
command (built, not run), and the look that records a silent supervisor abandoned only on the head's word."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from conftest import fab, processes_with_env, progress_steps, resumed_after_notice, start_cluster, wait_until
from fake_imds import FakeIMDS

from cluster import store as store_lib
from cluster.inventory import parse_hosts
from cluster.node import Node
from launch.life import head as head_lib
from launch.life import records
from launch.life.records import RunRecord, Status
from training.runtime.paths import RunPaths

SECRET = "hushhush-4711-not-in-any-file"


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


@pytest.mark.cluster
@pytest.mark.slow
def test_the_head_supervises_a_detached_run_and_recovers_it_with_the_operators_runs_gone(tmp_path, small_model):
    lc = start_cluster(tmp_path, 2, head=True)  # own cluster: it needs its head
    store = f"file://{tmp_path / 'store'}"
    env = {"MYSECRET": SECRET, "XC_STORE": store, "XC_PUBLISH_S": "1", "XC_HEARTBEAT_S": "5"}
    imds = FakeIMDS()
    head_home = lc.state / "nodes" / "head" / "home"
    first = second = None
    try:
        with lc.start("train", "--nodes", "2", "--detach", "--max-restarts", "1", "--restart-wait", "300",
                      "--save-every", "20", "--env", "MYSECRET", *imds.train_env(), "--",
                      *FakeIMDS.short_args(small_model), env=env, merge=True) as running:
            m = running.wait_for(re.compile(r"run (\S+) detached under its supervisor on the head head \(pid (\d+), "
                                            r"up to 1 restart"), 600)
            first, pid = m.group(1), int(m.group(2))
            ended = running.finish(60)
        assert ended.returncode == 0, ended.stdout[-3000:]
        # the run's folder named is the head's: said so, with how to bring its results here
        assert f"run {first}: results in {head_home}/" in ended.stdout and \
            f" on the head head; 'fab pull {first}' brings them to you" in ended.stdout, ended.stdout[-3000:]
        # the supervisor: in the head's session, started through the head's sshd; nothing of it on this side
        assert processes_with_env(f"XC_SUPERVISOR={first}") == [pid]
        assert os.getsid(pid) == pid and os.getsid(pid) != os.getsid(0)
        assert f"XC_HOME={head_home}".encode() in _environ(pid) and b"XC_NODE=head" in _environ(pid)
        # from the head's own copy of the code, shipped under its home by content hash, not from this checkout
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        assert cwd.parent == head_home / "code" and (cwd / ".complete").is_file(), cwd
        assert (cwd / "launch" / "supervision" / "supervisor.py").read_bytes() == \
            (Path(__file__).resolve().parents[2] / "launch" / "supervision" / "supervisor.py").read_bytes()
        # fab doctor's head rows: it answers, has this revision's code, runs this chain's supervisor with a fresh beat
        doc = lc.fab("doctor", "--quick", env=env, timeout=300).stdout
        assert re.search(r"^head:\n  reachable +ok +", doc, re.MULTILINE), doc
        assert re.search(r"^  supervisor code +ok +this revision's code is under its home$", doc, re.MULTILINE), doc
        assert re.search(rf"^  supervisors +ok +{first} \(pid {pid}\)", doc, re.MULTILINE), doc
        assert (head_home / "runs" / first / "summary.json").is_file()
        if lc.runs.exists():  # this machine keeps nothing of the run: move whatever is there away
            shutil.move(lc.runs, tmp_path / "operator-runs-moved-away")
        # the head publishes a running run's log in appended parts: read as fab logs reads it
        wait_until("training steps of the first run, read from the store",
              lambda: max(progress_steps(store_lib.read_log(store, first) or ""), default=0) >= 10, 400)
        beat = json.loads(store_lib.read_text(store, RunPaths(first).store_record(head_lib.HEARTBEAT)))
        assert beat["pid"] == pid and beat["head"] == "head" and first in beat["current"]
        # a spot notice: the run checkpoints and ends; the head's supervisor resumes it
        second, done = resumed_after_notice(imds, store, first)
        listed = lc.fab("runs", timeout=120, env=env)
        follow = lc.fab("logs", first, "-f", timeout=120, env=env)
        shown = lc.fab("logs", second, timeout=120, env=env)
    finally:
        imds.close()
        for p in processes_with_env(f"XC_SUPERVISOR={first}") if first else []:
            os.kill(p, 9)
        fab("local-down", env=lc.env, timeout=60)
    assert done["status"] == "ok", done.get("reason")
    assert not (lc.runs / first).exists() and not (lc.runs / second).exists()
    rows = listed.stdout
    assert re.search(rf"^{second}\s+glue\s+2\s+ok\s.*\sstore$", rows, re.MULTILINE), rows
    assert re.search(rf"^{first}\s+glue\s+2\s+preempted -> {second}\s.*\sstore$", rows, re.MULTILINE), rows
    m = re.search(rf"^recovery {first} -> {second}: recovery_s=([\d.]+) from the notice .*waiting for nodes "
                  r"([\d.]+)s, staging ([\d.]+)s, start-up ([\d.]+)s\); steps_redone=(\d+)$", rows, re.MULTILINE)
    assert m, rows
    cost = RunRecord.from_json(store_lib.read_summary(store, second)).recovery
    parts = cost["ending_s"] + cost["waiting_s"] + cost["staging_s"] + cost["startup_s"]
    assert cost["first_step_by"] == "mark" and abs(parts - cost["recovery_s"]) < 0.01 and cost["recovery_s"] > 0
    pre = RunRecord.from_json(store_lib.read_summary(store, first)).preempted
    assert cost["steps_redone"] == pre["notice_step"] - pre["step"] and cost["resumed_step"] == pre["step"]
    # fab logs, from the store: the resumed run's progress goes on from the checkpoint; -f follows the chain
    assert shown.returncode == 0 and min(progress_steps(shown.stdout)) > pre["step"], shown.stdout[-2000:]
    assert follow.returncode == 0 and f"run {first} preempted; resumed as run {second}" in follow.stdout
    assert follow.stdout.strip().splitlines()[-1].startswith(f"run {second} finished in ")
    assert processes_with_env(f"XC_RUN_ID={first}") == [] and processes_with_env(f"XC_RUN_ID={second}") == []
    # the secret reached the ranks (the job ran with it) but no file in clear: head, nodes, operator, store
    for path in [*tmp_path.rglob("*")]:
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_hosts_file_may_name_a_head_which_is_no_training_node(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("head 10.0.0.5 user=ubuntu\nnode0 10.0.0.10\nnode1 10.0.0.11\n")
    nodes, head = parse_hosts(hosts)
    assert [(n.name, n.index) for n in nodes] == [("node0", 0), ("node1", 1)]
    assert head.name == "head" and head.host == "10.0.0.5" and head.labels == {"role": "head"}
    assert not head_lib.runs_on_head(head)  # no copy of the project there: this machine keeps the role, and says so
    assert "this machine ends and recovers the detached run" in head_lib.no_head_line("hosts:x", head)
    bare = tmp_path / "bare"
    bare.write_text("node0 10.0.0.10\n")
    assert parse_hosts(bare)[1] is None


def test_an_aws_heads_systemd_unit_is_built_with_the_chains_id(tmp_path):
    """Built and checked here, not run: no systemd on the local head (a process in its own session instead)."""
    argv = head_lib.systemd_argv("20260101-000000-glue-abcd", "/opt/xeon-cluster/venv/bin/python", "/opt/xc",
                                 {"XC_HEAD": "head"})
    assert argv[:4] == ["systemd-run", "--unit", "xc-run-20260101-000000-glue-abcd", "--collect"]
    assert "--property=Restart=on-failure" in argv and "--working-directory=/opt/xc" in argv
    assert "--setenv=XC_SUPERVISOR=20260101-000000-glue-abcd" in argv and "--setenv=XC_HEAD=head" in argv
    assert argv[-3:] == ["/opt/xeon-cluster/venv/bin/python", "-m", "launch.supervision.supervisor"]
    assert "XC_SUPERVISOR=20260101-000000-glue-abcd" in head_lib.pids_command("20260101-000000-glue-abcd")


def test_a_silent_supervisor_is_abandoned_only_when_the_head_confirms_it_gone(tmp_path, monkeypatch):
    store = f"file://{tmp_path / 'store'}"
    head = Node(name="head", host="127.0.0.9", private_host="127.0.0.9", user="me", labels={"local": True})
    rec = RunRecord(run_id="20260101-000000-glue-abcd", status=Status.RUNNING, env={"XC_STORE": store},
                    started_at=time.time() - 1000, supervisor={"pid": 1, "host": "h", "head": "head",
                                                                "chain": "20260101-000000-glue-abcd"})
    store_lib.put_record(store, rec.run_id, head_lib.HEARTBEAT, json.dumps({"at": time.time() - 10,
                                                                            "interval_s": 30}).encode())
    asked = []
    monkeypatch.setattr(head_lib, "supervisors_on", lambda h, chain: asked.append(chain) or [])
    assert head_lib.judge(rec, store, head, tmp_path / "runs") == (rec, "")  # a fresh heartbeat: not asked
    assert asked == []
    store_lib.put_record(store, rec.run_id, head_lib.HEARTBEAT, json.dumps({"at": time.time() - 200,
                                                                            "interval_s": 30}).encode())
    monkeypatch.setattr(head_lib, "supervisors_on", lambda h, chain: None)  # the head does not answer
    _, note = head_lib.judge(rec, store, head, tmp_path / "runs")
    assert "did not answer" in note and rec.status == Status.RUNNING
    monkeypatch.setattr(head_lib, "supervisors_on", lambda h, chain: [4242])  # it lives, only silent
    assert "still runs it" in head_lib.judge(rec, store, head, tmp_path / "runs")[1]
    monkeypatch.setattr(head_lib, "supervisors_on", lambda h, chain: [])  # the head confirms: none
    _, note = head_lib.judge(rec, store, head, tmp_path / "runs")
    assert "recorded abandoned" in note
    assert store_lib.read_summary(store, rec.run_id)["status"] == "abandoned"
    assert records.load(tmp_path / "runs" / rec.run_id).abandoned["was"] == "running"


def test_a_chain_an_aws_head_supervised_is_not_abandoned_while_a_new_head_may_take_it_over(tmp_path, monkeypatch):
    """supervisor.json in the store: the head that supervised it went without ending it, and the group's new head
    takes it over at boot (launch.supervision.adopt). Between the stale heartbeat and that take-over 'fab runs' leaves
    the record alone; a head long up that runs neither the chain nor its take-over has abandoned it."""
    store = f"file://{tmp_path / 'store'}"
    head = Node(name="head", host="127.0.0.9", private_host="127.0.0.9", user="me", labels={"aws_head": "dev"})
    rec = RunRecord(run_id="20260101-000000-glue-abcd", status=Status.RUNNING, env={"XC_STORE": store},
                    started_at=time.time() - 1000, supervisor={"pid": 1, "host": "h", "head": "head",
                                                                "chain": "20260101-000000-glue-abcd"})
    store_lib.put_record(store, rec.run_id, head_lib.HEARTBEAT, json.dumps({"at": time.time() - 200,
                                                                            "interval_s": 30}).encode())
    store_lib.put_record(store, rec.run_id, head_lib.JOB, b"{}")
    monkeypatch.setattr(head_lib, "supervisors_on", lambda h, chain: [])
    for boot, note in (((42.0, False), "the head came up 42s ago and takes such chains over at boot"),
                       ((5000.0, True), "the head came up 5000s ago and takes such chains over at boot"),
                       (None, "the head did not answer")):
        monkeypatch.setattr(head_lib, "boot_state", lambda h, boot=boot: boot)
        assert note in head_lib.judge(rec, store, head, tmp_path / "runs")[1]
        assert store_lib.read_summary(store, rec.run_id) is None  # nothing recorded
    monkeypatch.setattr(head_lib, "boot_state", lambda h: (5000.0, False))
    assert "recorded abandoned" in head_lib.judge(rec, store, head, tmp_path / "runs")[1]
    assert store_lib.read_summary(store, rec.run_id)["status"] == "abandoned"


@pytest.mark.cluster
def test_a_head_that_does_not_answer_refuses_a_detached_run_in_one_line_and_starts_nothing(tmp_path, cluster2):
    lc = start_cluster(tmp_path, 1, head=True)
    try:
        assert lc.fab("local-kill", "head", timeout=60).returncode == 0
        res = lc.fab("train", "--nodes", "1", "--detach", "--max-restarts", "1", "--", "--max_steps", "5",
                     timeout=180)
        assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
        last = res.stderr.strip().splitlines()[-1]
        assert re.fullmatch(r"error: the head head does not answer \(.+\): run \S+ was not started; check the head "
                            r"with 'fab status' and 'fab doctor', or pass --no-head to supervise from this machine",
                            last), last
        assert "Traceback" not in res.stderr
        run_id = re.search(r"run (\S+) was not started", last).group(1)
        assert not list(lc.runs.glob(f"{run_id}*")) and not processes_with_env(f"XC_RUN_ID={run_id}")
    finally:
        lc.fab("local-down", timeout=60)
    # a cluster without a head: local-kill head says so and kills nothing
    res = cluster2.fab("local-kill", "head", timeout=60)
    assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith(
        "error: this local cluster has no head (it was started with --no-head); kill a node instead"), res.stderr
    assert cluster2.fab("status", "--no-runs", timeout=60).returncode == 0  # its nodes still answer


def test_doctor_says_in_one_row_with_its_fix_that_the_head_does_not_answer():
    from doctor.head import head_rows

    silent = Node(name="head", host="127.0.0.9", private_host="127.0.0.9", user="me", port=9, labels={"local": True})
    rows = head_rows(silent, None)
    assert [(r.check, r.ok, r.skipped) for r in rows] == [("reachable", False, False)], rows
    assert "--no-head" in rows[0].fix and rows[0].detail
    assert head_rows(None) == []  # no head: no rows


def test_doctor_checks_an_aws_heads_instance_role_by_its_name():
    """The role an AWS head's IMDS names (the twin's head: tests/twin/test_twin.py): Pulumi's <cluster>-head-<suffix>."""
    from doctor.head import role_row

    ok = role_row("dev-head", "dev", "dev-head-3f9a2c1")
    assert (ok.check, ok.ok, ok.detail) == ("instance role", True, "dev-head-3f9a2c1")
    for role, said in (("", "none: its IMDS names no role"), ("dev-node-77aa", "dev-node-77aa, not the head's")):
        row = role_row("dev-head", "dev", role)
        assert not row.ok and row.detail.startswith(said) and "pulumi up" in row.fix, row


def test_no_head_keeps_the_supervisor_here_even_where_the_cluster_has_a_head(monkeypatch):
    """fab train --detach --no-head: the fix the head-not-answering error names; it goes with --detach only."""
    from core.errors import ClusterError
    from launch.plan.request import RUNS
    from launch.supervision import supervisor, train_flags

    with pytest.raises(ClusterError, match="--no-head goes with --detach"):
        train_flags.resolve(train_flags.TrainFlags(no_head=True), RUNS)
    r = train_flags.resolve(train_flags.TrainFlags(detach=True, max_restarts="1", no_head=True), RUNS)
    assert r.no_head and r.supervised
    started = []
    monkeypatch.setattr(supervisor, "start_on_head", lambda *a, **k: started.append("head"))
    monkeypatch.setattr(supervisor, "start", lambda *a, **k: started.append("here"))
    head = Node(name="head", host="127.0.0.9", private_host="127.0.0.9", user="me", labels={"local": True})

    class Cluster:
        spec, nodes = "local", []

    Cluster.head = head
    out = io.StringIO()
    assert supervisor.detached(Cluster, r, out) and started == ["here"]
    assert out.getvalue().startswith("note: cluster local: --no-head was given, so this machine supervises the run")
    started.clear()
    supervisor.detached(Cluster, dataclasses.replace(r, no_head=False), io.StringIO())
    assert started == ["head"]


def test_a_taken_over_runs_log_is_mirrored_by_the_byte_whatever_a_rank_prints(cluster2, monkeypatch, tmp_path):
    """launch.life.detach.LogMirror against a real node: node 0's mpirun.log grows in three goes, with a byte that is
    not UTF-8 and a line still being written; log.txt gets whole lines, and nothing after the odd byte is
    skipped (read as text, it counted 3 bytes for 1 and lost the next 2 of every later step)."""
    from cluster import local
    from launch.life import detach

    for key, value in cluster2.env.items():
        monkeypatch.setenv(key, value)
    node0 = local.nodes(cluster2.state)[0]
    remote = tmp_path / "remote"  # a local node sees this machine's folders
    remote.mkdir()
    log = remote / "mpirun.log"
    rec = RunRecord(run_id="mirror-1", remote_run=str(remote), ppn=1, nodes=[{"name": "node0"}, {"name": "node1"}])
    (tmp_path / "run").mkdir()
    mirror = detach.LogMirror(tmp_path / "run", rec)
    try:
        log.write_bytes(b"[0] caf\xe9 au lait\n[1] step 1\n[0] half a li")
        mirror.step(node0)
        assert mirror.offset == len(b"[0] caf\xe9 au lait\n[1] step 1\n")  # the unfinished line waits
        with log.open("ab") as f:
            f.write(b"ne\n[1] step 2\n")
        mirror.step(node0)
        mirror.step(node0)  # nothing new: nothing written twice
    finally:
        mirror.close()
    assert mirror.offset == log.stat().st_size
    assert (tmp_path / "run" / "log.txt").read_text().splitlines() == [
        "[0] caf\ufffd au lait", "[1] step 1", "[0] half a line", "[1] step 2"]  # as mpirun tagged them


def test_an_aws_head_without_the_projects_venv_leaves_the_supervisor_here_and_says_why(cluster2, monkeypatch):
    """An AWS head boots stock Ubuntu: fab looks for the venv there (over SSH) before it starts a supervisor on it,
    and without one this machine supervises, with the line saying so. A local node stands in for the head."""
    from cluster import local
    from launch.plan.request import RUNS
    from launch.supervision import supervisor, train_flags

    for key, value in cluster2.env.items():
        monkeypatch.setenv(key, value)
    node0 = local.nodes(cluster2.state)[0]
    head = dataclasses.replace(node0, name="dev-head", labels={**node0.labels, "aws_head": "dev"})
    assert not head_lib.lacks_venv(head)  # its python is there
    bare = dataclasses.replace(head, python="/opt/nothing/venv/bin/python")
    assert head_lib.lacks_venv(bare) and head_lib.runs_on_head(bare)
    started = []
    monkeypatch.setattr(supervisor, "start_on_head", lambda *a, **k: started.append("head"))
    monkeypatch.setattr(supervisor, "start", lambda *a, **k: started.append("here"))

    class Cluster:
        spec, nodes = "aws:dev", []

    def detached(on: Node, run) -> tuple[list[str], str]:
        """Where fab starts the supervisor for `run` on a cluster whose head is `on`, and the line it prints."""
        started.clear()
        Cluster.head = on
        out = io.StringIO()
        assert supervisor.detached(Cluster, run, out)
        return list(started), out.getvalue().strip()

    r = train_flags.resolve(train_flags.TrainFlags(detach=True, max_restarts="1"), RUNS)
    where, line = detached(bare, r)
    assert where == ["here"] and line.startswith(
        "note: cluster aws:dev: its head dev-head has no venv with the operator's packages to run a supervisor, so "
        "this machine supervises the run"), line
    assert line.endswith("(an AWS head needs the project's venv at /opt/nothing/venv/bin/python: image=bake gives it "
                         "the nodes' baked AMI)"), line
    # a head with its venv, but a request whose files are only on this machine (--workdir, data files; no store
    # to put them in): here too
    mine = dataclasses.replace(r, req=r.req.but(workdir="/home/me/proj", script="train.py",
                                                          args=["--train_file", "/home/me/train.csv"]))
    where, line = detached(head, mine)
    assert where == ["here"] and line.startswith(
        "note: cluster aws:dev: its head dev-head cannot read --workdir /home/me/proj, --train_file "
        "/home/me/train.csv from this machine, so this machine supervises"), line
    assert line.endswith("(with a store, fab train puts them there as the run's snapshot, which the head reads)"), line
    # fab train put them in the store as the run's snapshot: the head supervises, the user's own run too
    held = dataclasses.replace(mine, req=mine.req.but(snapshot="0123456789abcdef"))
    assert detached(head, held) == (["head"], "")
    assert detached(head, r) == (["head"], "")  # the bundled job: on the head
