"""launch.chain.adopt, on a file store: which chains a head taking over at boot would adopt, and when. The takeover
itself (a head killed mid-run, its replacement following the run and restarting it after a spot notice) runs on the
AWS twin: tests/test_twin.py."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest

from cluster import store as store_lib
from core.errors import NodeFailure, Preempted
from launch.chain import adopt
from launch.life import head
from launch.life.records import RunRecord, Status


def _run(url: str, run_id: str, status: Status, **fields) -> None:
    rec = RunRecord(run_id=run_id, status=status, supervisor={"pid": 1, "host": "x-head", "head": "x-head"}, **fields)
    store_lib.put_record(url, run_id, "summary.json", json.dumps(rec.to_json()).encode())


def _job(url: str, chain: str) -> None:
    store_lib.put_record(url, chain, adopt.JOB, json.dumps({"chain": chain, "code": "abc"}).encode())


def test_a_head_adopts_only_chains_with_a_job_that_go_on_and_only_once_their_heartbeat_is_stale(tmp_path):
    url = (tmp_path / "store").as_uri()
    _run(url, "a", Status.PREEMPTED, restarted_as="a2")
    _run(url, "a2", Status.RUNNING)  # the chain's newest run goes on
    _job(url, "a")
    _run(url, "b", Status.OK)  # over
    _job(url, "b")
    _run(url, "c", Status.RUNNING)  # no job: started by a version that kept none, or not on a head
    assert adopt.live_chains(url) == ["a"]
    assert adopt.newest(url, "a")[0] == ["a", "a2"]
    assert adopt.stale(url, "a") == 0  # no heartbeat at all
    now = time.time()
    store_lib.put_record(url, "a", head.HEARTBEAT, json.dumps({"at": now - 3, "interval_s": 5}).encode())
    assert 16 <= adopt.stale(url, "a", now) <= 17  # 4 intervals of 5 s, 3 s of them gone
    assert adopt.stale(url, "a", now + 30) == 0
    adopt.drop_job(url, "a")
    assert adopt.live_chains(url) == []  # a chain that ended drops its job


def test_the_ending_a_first_supervisor_would_have_caught():
    pre = RunRecord(run_id="r", status=Status.PREEMPTED, preempted={"node": "dev-1", "step": 40})
    exc = adopt.as_exception(pre)
    assert isinstance(exc, Preempted) and exc.run_id == "r" and exc.node == "dev-1"
    lost = adopt.as_exception(RunRecord(run_id="r", status=Status.FAILED, lost_nodes=["dev-1"]))
    assert isinstance(lost, NodeFailure) and lost.lost == ["dev-1"]
    for status in (Status.OK, Status.STOPPED, Status.FAILED):
        assert adopt.as_exception(RunRecord(run_id="r", status=status)) is None  # nothing to restart


def test_the_boot_script_unpacks_the_code_as_fab_ships_it_and_says_when_there_is_nothing_to_take_over(tmp_path):
    import runpy
    from pathlib import Path

    boot = runpy.run_path(str(Path(__file__).resolve().parent.parent / "node_setup" / "head_boot.py"), run_name="boot")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"print('x')\n"
        info = tarfile.TarInfo("launch/x.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    boot["main"].__globals__["CODE_HOME"] = tmp_path / "code"
    dest = boot["unpack"](buf.getvalue(), "d1")
    assert dest == tmp_path / "code" / "d1" and (dest / ".complete").is_file()
    assert (dest / "launch" / "x.py").read_bytes() == data
    assert boot["unpack"](b"not a tarball", "d1") == dest  # there already: not fetched again
    env = tmp_path / "cluster.env"
    env.write_text("XC_CLUSTER=dev\nXC_STORE=file:///nowhere\n")
    res = subprocess.run([sys.executable, str(Path(boot["__file__"]))], capture_output=True, text=True, check=False,
                         timeout=60, env={**os.environ, "XC_CLUSTER_ENV": str(env)})
    assert res.returncode == 0 and "no S3 store in cluster.env (file:///nowhere): nothing to take over" in res.stdout


@pytest.mark.parametrize("filters", [True, False] if hasattr(tarfile, "data_filter") else [False])
def test_the_boot_script_unpacks_only_files_under_relative_paths_with_or_without_tarfiles_filters(tmp_path, filters):
    """Debian 12's Python 3.11.2 has no extraction filters: the boot script's own guard refuses what the data
    filter would, and a tarball as fab ships it unpacks the same either way."""
    import runpy
    from pathlib import Path

    boot = runpy.run_path(str(Path(__file__).resolve().parent.parent / "node_setup" / "head_boot.py"), run_name="boot")

    def tarball(*members: tarfile.TarInfo) -> tarfile.TarFile:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for m in members:
                tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
        buf.seek(0)
        return tarfile.open(fileobj=buf, mode="r:gz")

    def file(name: str, mode: int = 0o644) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.size, info.mode = 1, mode
        return info

    link = tarfile.TarInfo("launch/etc")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc"
    # an absolute path: the data filter strips its leading slash, the guard refuses it; neither writes outside dest
    for bad in (file("../outside.py"), link, *([] if filters else [file("/tmp/absolute.py")])):
        dest = tmp_path / f"bad-{filters}-{bad.name.replace('/', '_')}"
        with pytest.raises((ValueError, tarfile.TarError)), tarball(file("launch/ok.py"), bad) as tar:
            boot["extract"](tar, dest, filters)
        if not filters:
            assert not dest.exists(), bad.name  # refused before anything was written
    assert not (tmp_path / "outside.py").exists()
    dest = tmp_path / f"good-{filters}"
    with tarball(file("launch/x.py", 0o4777)) as tar:
        boot["extract"](tar, dest, filters)
    assert (dest / "launch" / "x.py").read_bytes() == b"x"
    assert (dest / "launch" / "x.py").stat().st_mode & 0o7777 == 0o755  # no setuid, not world-writable


def test_a_chain_this_machine_already_supervises_is_seen_as_such():
    chain = f"test-{os.getpid()}-chain"
    assert not adopt.supervised_here(chain)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, head.ENV: chain})
    try:
        deadline = time.monotonic() + 10
        while not adopt.supervised_here(chain):
            assert time.monotonic() < deadline, "the process carrying XC_SUPERVISOR was not found"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert not adopt.supervised_here(chain)
