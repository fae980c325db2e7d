"""launch.supervision.adopt, on a file store: which chains a head taking over at boot would adopt, and when. The takeover
itself (a head killed mid-run, its replacement following the run and restarting it after a spot notice) runs on the
AWS twin: tests/twin/test_twin.py."""
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
from core.errors import ClusterError, NodeFailure, Preempted
from launch.life import detach, head
from launch.life.records import RunRecord, Status
from launch.supervision import adopt


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


def test_a_heartbeat_from_an_instance_ec2_has_taken_is_stale_at_once(tmp_path, aws_env, monkeypatch):
    """At the default 30 s heartbeat a replaced head waited up to two minutes (4 intervals) for its predecessor's beat
    to go stale. The beat names its instance: once EC2 says that instance is gone, the new head takes over at once;
    a running one (a live supervisor elsewhere), this head's own, or one EC2 cannot answer for, still waits."""
    from moto_fixture import client

    url = (tmp_path / "store").as_uri()
    ec2 = client("ec2")
    image = ec2.describe_images()["Images"][0]["ImageId"]
    old, live, mine = (i["InstanceId"] for i in ec2.run_instances(ImageId=image, MinCount=3, MaxCount=3)["Instances"])
    ec2.terminate_instances(InstanceIds=[old])
    env_file = tmp_path / "cluster.env"
    env_file.write_text(f"XC_REGION=us-east-1\nXC_INSTANCE_ID={mine}\n")
    monkeypatch.setenv("XC_CLUSTER_ENV", str(env_file))
    now = time.time()
    for chain, instance in (("a", old), ("b", live), ("c", mine), ("d", "i-0123456789abcdef0")):
        store_lib.put_record(url, chain, head.HEARTBEAT, json.dumps({"at": now - 3, "interval_s": 30,
                                                                      "instance": instance}).encode())
    assert adopt.stale(url, "a", now) == 0  # terminated: no two-minute wait
    assert 110 <= adopt.stale(url, "b", now) <= 120 and 110 <= adopt.stale(url, "c", now) <= 120
    assert adopt.stale(url, "d", now) == 0  # EC2 knows it no more
    monkeypatch.setenv("XC_AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # EC2 unreachable: the beat's own clock decides
    assert 110 <= adopt.stale(url, "a", now) <= 120
    assert head.own_instance() == mine


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

    boot = runpy.run_path(str(Path(__file__).resolve().parents[2] / "node_setup" / "head_boot.py"), run_name="boot")
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

    boot = runpy.run_path(str(Path(__file__).resolve().parents[2] / "node_setup" / "head_boot.py"), run_name="boot")

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


def test_the_boot_script_takes_over_only_chains_and_only_code_that_hashes_to_its_digest(aws_env, monkeypatch,
                                                                                        tmp_path):
    """On S3 (moto): beside a real chain, a `supervisor.json` a node may write (under runs/<id>/output/) with a bogus
    digest, never read; a chain whose digest is not one, and a chain whose tarball is not what its digest says: each
    skipped with one line, and the real chain's code (verified as cluster.shipping hashes it) runs
    launch.supervision.adopt. The planted file is no chain to launch.supervision.adopt either."""
    from pathlib import Path

    import boto3

    from cluster import shipping

    def tree(name: str, text: str) -> tuple[str, bytes]:
        root = tmp_path / name
        for rel, body in {"launch/__init__.py": "", "launch/supervision/__init__.py": "", "launch/supervision/adopt.py": text}.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(body)
        return shipping.code_hash(root, ("launch",)), shipping.code_tarball(root, ("launch",))

    adopt_py = "import os, sys; print('adopted from', os.getcwd(), os.environ['XC_STORE'], flush=True)\n"
    real, real_tar = tree("real", adopt_py)
    other, _ = tree("other", adopt_py.replace("adopted", "other"))
    _, tampered = tree("tampered", adopt_py.replace("adopted", "tampered"))
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env)
    s3.create_bucket(Bucket="xc-boot")
    chain = "20260101-000000-glue-abcd"

    def put(key: str, body: bytes) -> None:
        s3.put_object(Bucket="xc-boot", Key=f"dev/{key}", Body=body)

    put(f"code/{real}.tar.gz", real_tar)
    put(f"runs/{chain}/supervisor.json", json.dumps({"chain": chain, "code": real}).encode())
    put(f"code/{other}.tar.gz", tampered)  # not the tree `other` hashes
    put("runs/t-1/supervisor.json", json.dumps({"chain": "t-1", "code": other}).encode())
    put("runs/b-1/supervisor.json", json.dumps({"chain": "b-1", "code": "zz"}).encode())
    put(f"runs/{chain}/output/supervisor.json", b'{"code": "../../../planted"}')  # a node's role may write there
    env_file = tmp_path / "cluster.env"
    env_file.write_text("XC_CLUSTER=dev\nXC_REGION=us-east-1\nXC_STORE=s3://xc-boot/dev\n")
    home = tmp_path / "home"
    script = Path(__file__).resolve().parents[2] / "node_setup" / "head_boot.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, timeout=120,
                         env={**os.environ, "HOME": str(home), "XC_CLUSTER_ENV": str(env_file),
                              "XC_S3_ENDPOINT_URL": aws_env})
    lines = res.stdout.splitlines()
    code = home / ".xeon-cluster" / "code"
    assert res.returncode == 0 and lines[-1] == f"adopted from {code / real} s3://xc-boot/dev", res.stdout + res.stderr
    skipped = sorted(line.removeprefix("xc-head-boot: skipped dev/runs/") for line in lines
                     if line.startswith("xc-head-boot: skipped "))
    bad = "b-1/supervisor.json: its code 'zz' is not a 16-hex digest"
    hashed = shipping.code_hash(tmp_path / "tampered", ("launch",))
    tampered_line = f"t-1/supervisor.json: its code tarball hashes to {hashed}, not {other}: refused"
    assert skipped == [bad, tampered_line], res.stdout
    assert "/output/" not in res.stdout  # the planted file is never even looked at (the boot lists run folders only)
    assert sorted(p.name for p in code.iterdir()) == [real]  # the refused tarball was never unpacked
    assert (code / real / "launch" / "supervision" / "adopt.py").read_text() == adopt_py
    # the real code's own tarball, as fab puts it into the store, passes the check the boot script makes
    import runpy

    boot = runpy.run_path(str(script), run_name="boot")
    assert boot["tarball_digest"](shipping.code_tarball(tops=shipping.HEAD_SHIPPED)) == \
        shipping.code_hash(tops=shipping.HEAD_SHIPPED)
    # launch.supervision.adopt lists the real chain only, the planted file beside it
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    url = "s3://xc-boot/dev"
    _run(url, chain, Status.RUNNING)
    assert adopt.live_chains(url) == [chain]


def test_the_boot_script_lists_run_folders_only_never_the_objects_under_them(aws_env, monkeypatch, tmp_path):
    """The head's boot finds chains by one listing of runs/ by folder (Delimiter) and one HEAD of each run's
    supervisor.json: the outputs, checkpoints and log parts under the runs are never listed, and a key outside
    <prefix>/runs/<id>/supervisor.json is never read."""
    import runpy
    from pathlib import Path

    import boto3

    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env)
    s3.create_bucket(Bucket="xc-list")
    for run in ("r-1", "r-2", "r-3"):
        for rel in ("summary.json", "log/000000000000.part", "log/000000001000.part", "output/supervisor.json",
                    "checkpoints/checkpoint-1/model.bin"):
            s3.put_object(Bucket="xc-list", Key=f"dev/runs/{run}/{rel}", Body=b"{}")
    s3.put_object(Bucket="xc-list", Key="dev/runs/r-2/supervisor.json", Body=b'{"code": "0123456789abcdef"}')
    s3.put_object(Bucket="xc-list", Key="other/runs/r-9/supervisor.json", Body=b"{}")  # another cluster's prefix
    env_file = tmp_path / "cluster.env"
    env_file.write_text("XC_CLUSTER=dev\nXC_REGION=us-east-1\nXC_STORE=s3://xc-list/dev\n")
    monkeypatch.setenv("XC_CLUSTER_ENV", str(env_file))
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    calls: list[tuple[str, dict]] = []
    real_client = boto3.client

    def client(*args, **kw):
        c = real_client(*args, **kw)
        c.meta.events.register("provide-client-params.s3.*",
                               lambda params, model, **_: calls.append((model.name, dict(params))))
        return c

    monkeypatch.setattr(boto3, "client", client)
    boot = runpy.run_path(str(Path(__file__).resolve().parents[2] / "node_setup" / "head_boot.py"), run_name="boot")
    boot["main"].__globals__["CODE_HOME"] = tmp_path / "code"
    assert boot["main"]() == 1  # r-2's code is not in the store: nothing to take over, said so
    lists = [p for name, p in calls if name == "ListObjectsV2"]
    assert lists == [{"Bucket": "xc-list", "Prefix": "dev/runs/", "Delimiter": "/"}]
    keys = sorted(p["Key"] for name, p in calls if name != "ListObjectsV2")
    assert keys == ["dev/code/0123456789abcdef.tar.gz", "dev/runs/r-1/supervisor.json",
                    "dev/runs/r-2/supervisor.json", "dev/runs/r-2/supervisor.json", "dev/runs/r-3/supervisor.json"]
    assert {name for name, _ in calls} == {"ListObjectsV2", "HeadObject", "GetObject"}


def _orphan(tmp_path, monkeypatch, *fakes, spec: dict | None = None) -> str:
    """A chain `c1` whose run goes on under node 0's wrapper with no head (its record in a file store, running),
    on fake nodes at the SSH boundary (tests/fake_node.py); returns the store's URL."""
    from fake_node import FakeCluster

    from launch.life import cleanup, lifecycle
    from launch.staging import outputs, userscript

    fc = FakeCluster(*fakes)
    fc.install(monkeypatch, detach, cleanup, lifecycle, outputs, userscript)
    monkeypatch.setattr(adopt, "POLL_S", 0.0)
    url = (tmp_path / "store").as_uri()
    _run(url, "c1", Status.RUNNING, nodes=[n.to_dict() for n in fc.nodes], job="glue", ppn=1, world_size=len(fakes),
         detached=True, remote_run="/h/runs/c1", remote_output="/h/runs/c1/output", started_at=time.time() - 60,
         env={"XC_STORE": url}, spec=spec)
    return url


def test_node_0_gone_at_takeover_ends_the_run_as_a_lost_node_for_the_restart_loop(tmp_path, monkeypatch):
    """A reclaim between two heads: node 0 does not answer the new head. After GONE_LOOKS looks in a row the run
    gets the ending the first supervisor gives a run whose node 0 went away (lifecycle.end: the other nodes swept,
    failed as node lost), and that is an ending the restart loop restarts (as_exception), not an error that drops
    the chain with its record left running."""
    from fake_node import FakeNode

    n0, n1 = FakeNode("node0", reachable=False), FakeNode("node1", procs={"c1": 2})
    url = _orphan(tmp_path, monkeypatch, n0, n1)
    out = io.StringIO()
    rec, ids = adopt.pending_outcome(url, "c1", tmp_path / "runs", out)
    assert ids == ["c1"] and rec.status == Status.FAILED, out.getvalue()
    assert rec.lost_nodes == ["node0"] and rec.failed_node == "node0" and rec.cause == "node lost"
    assert n1.procs == {} and any("kill -9" in c for c in n1.commands)  # its ranks on the nodes left: swept
    assert store_lib.read_summary(url, "c1")["status"] == "failed"  # concluded where every checkout reads it
    assert f"did not answer {adopt.GONE_LOOKS} looks in a row" in out.getvalue()
    ended = adopt.as_exception(rec)
    assert isinstance(ended, NodeFailure) and ended.lost == ["node0"] and ended.run_id == "c1"


def test_node_0_missing_fewer_looks_than_that_is_followed_on(tmp_path, monkeypatch):
    from fake_node import FakeNode

    from core.errors import Unreachable

    url = _orphan(tmp_path, monkeypatch, FakeNode("node0"), FakeNode("node1"))
    looks = []

    def conclude(run_dir, master, out, follower=False):  # a blip, then the run's own ending
        looks.append(master.name)
        if len(looks) < adopt.GONE_LOOKS:
            raise Unreachable("node0 is unreachable (timed out)", node="node0")
        return RunRecord(run_id="c1", status=Status.OK)

    monkeypatch.setattr(detach, "conclude", conclude)
    rec, _ = adopt.pending_outcome(url, "c1", tmp_path / "runs", io.StringIO())
    assert rec.status == Status.OK and looks == ["node0"] * adopt.GONE_LOOKS


def test_node_0_no_longer_in_the_clusters_discovery_is_lost_at_the_first_look(tmp_path, monkeypatch):
    """On AWS a node 0 reclaimed before this head recorded its host key fails the look before any dial (not
    Unreachable): discovery no longer listing its instance makes it a lost node at once. Listed, the same failure
    is raised as before (a node that is there and refuses is no lost node)."""
    from fake_node import FakeNode


    def conclude(run_dir, master, out, follower=False):
        raise ClusterError(f"{master.name} (10.0.0.5:22): host key not yet known", fix="retry in a minute")

    url = _orphan(tmp_path, monkeypatch, FakeNode("node0", reachable=False), n1 := FakeNode("node1", procs={"c1": 1}))
    monkeypatch.setattr(detach, "conclude", conclude)
    with pytest.raises(ClusterError, match="host key not yet known"):
        adopt.pending_outcome(url, "c1", tmp_path / "runs", io.StringIO(), lambda: {"node0", "node1"})
    out = io.StringIO()
    rec, _ = adopt.pending_outcome(url, "c1", tmp_path / "runs2", out, lambda: {"node1"})
    assert rec.status == Status.FAILED and rec.lost_nodes == ["node0"] and n1.procs == {}
    assert "node 0 (node0) is no longer in the cluster (node0 (10.0.0.5:22): host key not yet known)" in out.getvalue()
    assert adopt.node_id(detach.master_node(rec)) == "node0"  # a node without an instance: its name


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_an_adopted_chain_whose_node_0_is_gone_restarts_or_is_concluded(tmp_path, monkeypatch, max_restarts):
    """supervisor --adopt with node 0 gone: with restarts left, the chain's restart loop is handed the lost node (and
    the restarts already done); with none, the chain ends with its record concluded (failed, not running), and its
    job and secrets are deleted either way. The restart loop itself is replaced here (tests/launch/test_restarts.py and the
    twin run it)."""
    from fake_node import FakeNode

    from cluster import resolve
    from launch.life.records import RunResult
    from launch.staging import run_secrets
    from launch.supervision import restarts, supervisor

    url = _orphan(tmp_path, monkeypatch, FakeNode("node0", reachable=False), FakeNode("node1", procs={"c1": 1}),
                  spec={"recovery": {"max_restarts": max_restarts, "restart_wait": 60}})  # the record's policy
    job = {"chain": "c1", "spec": "aws:dev", "secrets": ["HF_TOKEN"], "secrets_at": "dev", "code": "0123456789abcdef"}
    store_lib.put_record(url, "c1", adopt.JOB, json.dumps(job).encode())

    class Beat:
        def __init__(self, *a):
            pass

        def start(self):
            pass

    handed, deleted = [], []
    monkeypatch.setattr(adopt, "head_store", lambda: url)
    monkeypatch.setattr(supervisor, "_aws_head_env", lambda spec: None)
    monkeypatch.setattr(head, "runs_here", lambda: tmp_path / "runs")
    monkeypatch.setattr(head, "Beat", Beat)
    from types import SimpleNamespace

    from cluster.node import Node

    # the cluster's discovery on this head: node 0 reclaimed, node 1 still there
    discovered = SimpleNamespace(nodes=[Node(**n) for n in store_lib.read_summary(url, "c1")["nodes"][1:]])
    monkeypatch.setattr(resolve, "open_cluster", lambda spec, require_running=None: discovered)
    monkeypatch.setattr(adopt, "kept_secrets", lambda job: {"HF_TOKEN": "x"})
    monkeypatch.setattr(adopt, "adopted_request", lambda url, job, rec, runs_dir, values: "the request")
    monkeypatch.setattr(run_secrets, "delete", lambda at, chain, names: deleted.append((at, chain, list(names))))

    def train_with_restarts(cluster, req, ended=None, restarts_done=0):
        handed.append((req, ended, restarts_done))
        return RunResult(run_id="c1-2", run_dir=tmp_path / "runs" / "c1-2", exit_code=0, wall_s=1.0, results=None)

    monkeypatch.setattr(restarts, "train_with_restarts", train_with_restarts)
    monkeypatch.setenv("XC_RUNS_DIR", str(tmp_path / "runs"))
    got = supervisor.adopted("c1")
    assert store_lib.read_summary(url, "c1")["status"] == "failed"  # concluded, never left running
    assert adopt.load_job(url, "c1") is None and deleted == [("dev", "c1", ["HF_TOKEN"])]
    if max_restarts:
        assert got == 0 and len(handed) == 1
        req, ended, done = handed[0]
        assert (req, done) == ("the request", 0)
        assert isinstance(ended, NodeFailure) and ended.lost == ["node0"] and ended.run_id == "c1"
    else:
        assert got == 1 and handed == []


def test_the_recovery_policy_lives_in_the_record_and_a_taken_over_chain_keeps_it(tmp_path):
    """--max-restarts, --restart-wait, --min-nodes and --no-grow-back are the run's spec (RunSpec.recovery): the
    record keeps the spec, and the request a replacement head goes on with has it back, with no job field beside it."""
    from launch.plan.request import TrainRequest
    from training.runtime.spec import Recovery, RunSpec

    policy = Recovery(max_restarts=3, restart_wait=45, min_nodes=1, grow_back=False)
    req = TrainRequest.of(nodes=2, job="glue", args=["--seed", "1"], recovery=policy)
    kept = req.to_record()
    assert kept["recovery"] == {"max_restarts": 3, "restart_wait": 45, "min_nodes": 1, "grow_back": False}
    url = (tmp_path / "store").as_uri()
    _run(url, "c1", Status.PREEMPTED, spec=kept, nodes=[{}, {}])
    rec = RunRecord.from_json(store_lib.read_summary(url, "c1"))
    again = adopt.adopted_request(url, {"secrets": []}, rec, tmp_path / "runs", {})
    assert again.spec == req.spec and again.wrapped and again.spec.where.nodes == 2
    assert TrainRequest.from_record({**kept, "recovery": None}, {}, set()).spec.recovery == Recovery()
    old = {"job": "glue", "args": ["--seed", "1"], "recovery": kept["recovery"]}  # a record before RunSpec: flat
    assert RunSpec.from_json(old).recovery == policy and RunSpec.from_json(old).what.args == ("--seed", "1")
    assert RunSpec(recovery=Recovery(max_restarts=1, min_nodes=0)).problem()[0] == "--min-nodes 0 is below 1"
