"""`fab train --detach --max-restarts K` on a real 2-node local cluster: fab returns once the ranks run and
is then killed with -9 (its whole process group); the run's supervisor lives on in its own session, a
spot notice (fake IMDS) preempts the run, the supervisor waits while the notice stands, resumes by itself
once it is withdrawn, and the chain ends `ok` in `fab runs` with nothing left running."""
from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest
from conftest import PACE, fab, processes_with_env, progress_steps, start_cluster, wait_until
from fake_imds import FakeIMDS

from cluster import store as store_lib
from launch.life import records
from launch.life.records import Status


def _steps(run_dir) -> list[int]:
    try:
        text = (run_dir / "log.txt").read_text(errors="replace")
    except OSError:
        return []
    return progress_steps(text)


@pytest.mark.cluster
@pytest.mark.slow
def test_a_detached_run_survives_fab_kill_9_and_resumes_by_itself(tmp_path, small_model):
    lc = start_cluster(tmp_path, 2)  # own cluster: its supervisor outlives the test's fab; the cluster goes with it
    imds = FakeIMDS()
    running = lc.start("train", "--nodes", "2", "--detach", "--max-restarts", "2", "--restart-wait", "300",
                       "--save-every", "20", *imds.train_env(), "--", *FakeIMDS.short_args(small_model), merge=True,
                       new_session=True)
    sup_pid, sup, follow = None, None, None
    try:
        m = running.wait_for(re.compile(r"run (\S+) detached under its supervisor \(pid (\d+), up to 2 restart"), 600)
        first, sup_pid = m.group(1), int(m.group(2))
        os.killpg(running.proc.pid, signal.SIGKILL)  # fab and anything in its process group: not the supervisor
        running.finish(10)
        assert processes_with_env(f"XC_RUN_ID={first}"), "fab returned but no rank is running"
        rec = records.load(lc.runs / first)
        sup = rec.supervisor
        assert rec.status == Status.RUNNING and sup["pid"] == sup_pid
        assert records.supervisor_alive(rec.supervisor), "the supervisor died with fab"
        follow = lc.start("logs", first, "-f", merge=True)

        wait_until("training steps of the first run", lambda: max(_steps(lc.runs / first), default=0) >= 10, 400)
        imds.interrupt()  # every node gets a notice: the run checkpoints and ends; the supervisor waits
        noticed = time.monotonic()
        wait_until("the first run recorded restarting",
                   lambda: records.load(lc.runs / first).status == Status.RESTARTING, 240)
        listed = lc.fab("runs", timeout=60)
        assert re.search(rf"^{first}\s.*\srestarting\s", listed.stdout, re.MULTILINE), listed.stdout
        waiting = time.monotonic()
        imds.clear()  # the nodes are 'replaced': no notice any more
        second = wait_until("the resumed run", lambda: records.load(lc.runs / first).restarted_as, 300)
        resumed = time.monotonic()
        done = wait_until("the resumed run's end", lambda: (r := records.load_or_none(lc.runs / second)) and r.status.terminal and r,
                     600, poll=2)
        wait_until("the supervisor's exit", lambda: not records.supervisor_alive(sup), 60)
        follow_end = follow.finish(120)
        followed = follow_end.stdout
        print(f"notice -> restarting {waiting - noticed:.1f}s; notice withdrawn -> resumed {resumed - waiting:.1f}s")
    finally:
        imds.close()
        running.__exit__()
        if follow is not None:
            follow.__exit__()
        if sup and records.supervisor_alive(sup):
            os.kill(sup["pid"], signal.SIGKILL)
        fab("local-down", env=lc.env, timeout=60)
    assert done.status == Status.OK, (done.reason, (lc.runs / second / "log.txt").read_text()[-3000:])
    # 'fab logs -f' followed the supervised run through its restart to the end of the chain
    assert follow_end.returncode == 0, followed[-3000:]
    assert f"run {first} preempted; resumed as run {second}" in followed, followed[-3000:]
    assert "[progress] step" in followed and followed.strip().splitlines()[-1].startswith(f"run {second} finished in ")
    assert done.resumed_from["run_id"] == first and done.supervisor["pid"] == sup_pid
    first_rec = records.load(lc.runs / first)
    assert first_rec.status == Status.PREEMPTED and first_rec.restarted_as == second
    assert first_rec.cause == "spot interruption" and first_rec.preempted["step"] >= 10
    assert min(_steps(lc.runs / second)) > first_rec.preempted["step"]  # it went on from the checkpoint
    listed = fab("runs", env=lc.env, timeout=60).stdout
    assert re.search(rf"^{second}\s+glue\s+2\s+ok\s", listed, re.MULTILINE), listed
    assert re.search(rf"^{first}\s+glue\s+2\s+preempted -> {second}\s", listed, re.MULTILINE), listed
    # the store's copy of each record is the truth when runs/ is not there: the chain reads the same from it
    url = first_rec.env["XC_STORE"]
    copy = store_lib.read_summary(url, first)
    assert copy["status"] == "preempted" and copy["restarted_as"] == second, copy
    assert store_lib.read_summary(url, second)["status"] == "ok"
    shutil.move(lc.runs / first, tmp_path / "first-moved-away")
    listed = fab("runs", env=lc.env, timeout=60).stdout
    assert re.search(rf"^{first}\s+glue\s+2\s+preempted -> {second}\s.*\sstore$", listed, re.MULTILINE), listed
    assert processes_with_env(f"XC_RUN_ID={first}") == [] and processes_with_env(f"XC_RUN_ID={second}") == []


@pytest.mark.cluster
@pytest.mark.slow
def test_without_a_head_the_supervised_run_goes_on_when_fab_and_its_supervisor_are_killed(tmp_path, small_model):
    """No head, so this machine supervises. SIGKILL of fab and of the supervisor with its SSH sessions
    mid-run (a laptop closed for good): the ranks run under node 0's wrapper and go on; the next 'fab runs'
    concludes the run ok, with its results, and nothing of it is left running."""
    lc = start_cluster(tmp_path, 2)
    running = lc.start("train", "--nodes", "2", "--detach", "--max-restarts", "1", *PACE, "--",
                       *FakeIMDS.short_args(small_model), merge=True, new_session=True)
    sup_pid, run_id = None, None
    try:
        m = running.wait_for(re.compile(r"run (\S+) detached under its supervisor \(pid (\d+), up to 1 restart"), 600)
        run_id, sup_pid = m.group(1), int(m.group(2))
        said = running.stdout
        wait_until("training steps", lambda: max(_steps(lc.runs / run_id), default=0) >= 5, 400, poll=0.5)
        os.killpg(running.proc.pid, signal.SIGKILL)
        os.killpg(sup_pid, signal.SIGKILL)  # the supervisor's session: it and its SSH sessions to node 0
        running.finish(10)
        sup = records.load(lc.runs / run_id).supervisor
        wait_until("the supervisor's death", lambda: records.supervisor_alive(sup) is False, 30, poll=0.2)
        assert processes_with_env(f"XC_RUN_ID={run_id}"), "the ranks died with the supervisor"
        ok_row = re.compile(rf"^{run_id}\s+glue\s+2\s+ok\s", re.MULTILINE)
        listed = wait_until("'fab runs' showing the run ok",
                            lambda: (out := lc.fab("runs", timeout=120).stdout) and ok_row.search(out) and out, 600, poll=5)
    finally:
        running.__exit__()
        if sup_pid:
            try:
                os.killpg(sup_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        fab("local-down", env=lc.env, timeout=60)
    assert "closing this machine pauses recovery (no restart after a preemption until it is back) but does not " \
           "end the run" in said, said
    rec = records.load(lc.runs / run_id)
    assert rec.status == Status.OK and rec.supervisor["pid"] == sup_pid, (rec.status, rec.reason, listed)
    assert max(_steps(lc.runs / run_id)) == FakeIMDS.SHORT_STEPS and rec.train_samples_per_second, rec
    assert processes_with_env(f"XC_RUN_ID={run_id}") == []


TICKING = "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(0.2)\n"


@pytest.mark.cluster
def test_an_attached_run_whose_fab_was_killed_is_recorded_abandoned(cluster2, tmp_path):
    script = tmp_path / "ticking.py"
    script.write_text(TICKING)
    before = cluster2.run_dirs()
    with cluster2.start("train", "--nodes", "2", "--script", str(script), merge=True) as running:
        running.wait_for("tick 3", 240, count=2)
        run_id = (cluster2.run_dirs() - before).pop()
        assert records.load(cluster2.runs / run_id).status == Status.RUNNING
        running.signal(signal.SIGKILL)  # kill -9: nothing of fab gets to write the record
        running.finish(30)
    # its SSH session went with it, and mpirun and the ranks with that
    wait_until("the ranks' end", lambda: not processes_with_env(f"XC_RUN_ID={run_id}"), 60, poll=0.5)
    listed = cluster2.fab("runs", timeout=120)
    assert re.search(rf"^{run_id}\s+ticking\.py\s+2\s+abandoned\s", listed.stdout, re.MULTILINE), listed.stdout
    rec = records.load(cluster2.runs / run_id)
    assert rec.status == Status.ABANDONED and rec.abandoned["was"] == "running"
    assert rec.abandoned["found"] == "no process of the run on node0, node1" and rec.abandoned["unchecked"] == {}
    assert rec.abandoned["supervisor"]["pid"] == running.proc.pid
    # its lock on node 0 is no obstacle, also to a run recorded in another runs folder (a bench's, another
    # checkout's): the lock names the folder where the holder's record says it ended
    from cluster.node import Node
    from launch.life import lock

    said = []
    nodes = [Node(**n) for n in rec.nodes]
    lock.take(nodes, "a-later-run", said.append, tmp_path / "other-runs")
    lock.release(nodes, "a-later-run")
    assert said == [f"note: run {run_id} held the cluster but has no process left on any node: taking over its lock"]
