"""The store library against a real moto S3 server over HTTP (and a file store in a folder): trees up and down
with multipart transfers, checkpoints that count only with their marker, pruning, resuming onto a node,
pulling a run home, the precedence that chooses the store, and the one-line errors of a bad store."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from moto_fixture import _free_port, client, wait_up

from cluster import store as store_lib
from core.errors import ClusterError
from training.runtime import publish, spot
from training.runtime import store as shared
from training.runtime.paths import Checkpoints

BUCKET = "xc-test-store"


@pytest.fixture
def s3(aws_env, monkeypatch):
    """s3://BUCKET/cl1 on the moto server, reached the way the ranks reach it (XC_S3_ENDPOINT_URL)."""
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    client("s3").create_bucket(Bucket=BUCKET)
    return f"s3://{BUCKET}/cl1"


def _checkpoint(folder, step: int, big: int = 0, complete: bool = True):
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "optimizer.pt").write_bytes(os.urandom(big or 1000))
    if complete:
        (folder / Checkpoints.MARKER).write_text("{}")
    return folder


def test_the_marker_name_is_spots():
    assert Checkpoints.MARKER == Checkpoints.MARKER


def test_a_checkpoint_goes_up_in_parallel_parts_and_counts_only_with_its_marker(s3, tmp_path):
    big = shared.CHUNK * 2 + 12345  # three parts
    url = shared.publish_checkpoint(_checkpoint(tmp_path / "checkpoint-10", 10, big), run_id="r1", url=s3)
    assert url == f"{s3}/runs/r1/checkpoints/checkpoint-10"
    s3c = client("s3")
    head = s3c.head_object(Bucket=BUCKET, Key="cl1/runs/r1/checkpoints/checkpoint-10/optimizer.pt")
    assert head["ContentLength"] == big and head["ETag"].strip('"').endswith("-3")  # a multipart upload's ETag
    # a checkpoint whose marker never arrived (the node went mid-upload) does not count
    store = shared.open_store(s3)
    shared.upload_tree(store, _checkpoint(tmp_path / "checkpoint-20", 20, complete=False), "runs/r1/checkpoints/checkpoint-20")
    assert shared.stored_steps(store, "r1") == [10]
    back = tmp_path / "back"
    assert shared.download_tree(store, "runs/r1/checkpoints/checkpoint-10", back) == big + 2 + len('{"global_step": 10}')
    assert (back / "optimizer.pt").read_bytes() == (tmp_path / "checkpoint-10" / "optimizer.pt").read_bytes()


def test_the_marker_is_written_last(tmp_path):
    order = []

    class Recorder(shared.FileStore):
        def put_file(self, local, key, progress=None):
            order.append(key.rsplit("/", 1)[-1])
            super().put_file(local, key, progress)

    folder = _checkpoint(tmp_path / "checkpoint-3", 3)
    (folder / "zz-last-by-name").write_text("x")
    shared.upload_tree(Recorder((tmp_path / "st").as_uri()), folder, "runs/r/checkpoints/checkpoint-3")
    assert order[-1] == Checkpoints.MARKER and len(order) == 4


def test_only_the_newest_checkpoints_stay_in_the_store(s3, tmp_path):
    for step in (5, 10, 15):
        shared.publish_checkpoint(_checkpoint(tmp_path / f"checkpoint-{step}", step), run_id="r2", url=s3)
    store = shared.open_store(s3)
    assert shared.stored_steps(store, "r2") == [10, 15]
    assert not [e for e in store.list("runs/r2") if "/checkpoint-5/" in e.key]


def test_the_publisher_uploads_in_the_background_from_a_snapshot(tmp_path):
    url = (tmp_path / "store").as_uri()
    pub = publish.Publisher(url, "r3")
    pub.start()
    folder = _checkpoint(tmp_path / "out" / "checkpoint-7", 7, big=5 << 20)
    pub.submit(folder, 7)
    import shutil

    shutil.rmtree(folder)  # the Trainer rotating its checkpoints away: the hard-linked snapshot stays
    assert pub.wait(60) and pub.durable == [7] and not pub.failed
    assert (tmp_path / "store/runs/r3/checkpoints/checkpoint-7/optimizer.pt").stat().st_size == 5 << 20
    assert not list((tmp_path / "out").glob(".xc-store-*"))  # the snapshot is gone once uploaded


def test_a_resume_takes_the_checkpoint_from_s3_onto_the_node(s3, tmp_path, monkeypatch):
    shared.publish_checkpoint(_checkpoint(tmp_path / "checkpoint-4", 4, big=3 << 20), run_id="r4", url=s3)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XC_RESUME_URL", f"{s3}/runs/r4/checkpoints/checkpoint-4")
    monkeypatch.setenv("XC_RESUME_FROM", "resume/checkpoint-4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    got = shared.fetch_resume()
    assert got == "resume/checkpoint-4" and spot.resume_from() == "resume/checkpoint-4"
    assert spot.trainer_state_step(got) == 4 and (tmp_path / "resume/checkpoint-4/optimizer.pt").stat().st_size == 3 << 20


def test_a_file_store_is_resumed_from_where_it_lies(tmp_path, monkeypatch):
    url = (tmp_path / "store").as_uri()
    shared.publish_checkpoint(_checkpoint(tmp_path / "checkpoint-2", 2), run_id="r5", url=url)
    monkeypatch.setenv("XC_RESUME_URL", f"{url}/runs/r5/checkpoints/checkpoint-2")
    monkeypatch.setenv("XC_RESUME_FROM", "resume/checkpoint-2")
    assert shared.fetch_resume() == str(tmp_path / "store/runs/r5/checkpoints/checkpoint-2")
    assert os.environ["XC_RESUME_FROM"] == str(tmp_path / "store/runs/r5/checkpoints/checkpoint-2")


def test_pull_brings_records_outputs_and_complete_checkpoints_with_progress(s3, tmp_path):
    store = shared.open_store(s3)
    store.put_bytes("runs/r6/summary.json", json.dumps({"run_id": "r6", "status": "ok", "job": "glue"}).encode())
    store.put_bytes("runs/r6/log.txt", b"[0 node0] hello\n")
    out = tmp_path / "output"
    out.mkdir()
    (out / "results.json").write_text("{}")
    (out / "model.safetensors").write_bytes(os.urandom(40 << 20))
    assert shared.publish_output(out, url=s3, run_id="r6") == 2 + (40 << 20)
    shared.publish_checkpoint(_checkpoint(tmp_path / "checkpoint-8", 8), run_id="r6", url=s3)
    shared.upload_tree(store, _checkpoint(tmp_path / "checkpoint-9", 9, complete=False), "runs/r6/checkpoints/checkpoint-9")

    lines: list[str] = []
    files, size = store_lib.pull(s3, "r6", tmp_path / "home", say=lines.append)
    assert {p.relative_to(tmp_path / "home").as_posix() for p in (tmp_path / "home").rglob("*") if p.is_file()} == {
        "summary.json", "log.txt", "output/results.json", "output/model.safetensors"}
    assert any("output/model.safetensors: 40/40 MiB (100%)" in ln for ln in lines), lines
    assert lines[-1].startswith(f"pulled {files} file(s)") and size > 40 << 20

    store_lib.pull(s3, "r6", tmp_path / "ck", with_checkpoints=True, with_model=False)
    got = {p.relative_to(tmp_path / "ck").as_posix() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    assert "checkpoints/checkpoint-8/xc-complete" in got and not any("checkpoint-9" in g for g in got)
    assert "output/model.safetensors" not in got  # weights stayed in the store

    assert store_lib.store_runs(s3) == {"r6": {"run_id": "r6", "status": "ok", "job": "glue"}}
    with pytest.raises(ClusterError, match=f"no run nope in the store {s3}"):
        store_lib.pull(s3, "nope", tmp_path / "x")


def test_the_store_is_chosen_by_flag_env_config_then_the_local_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("XC_STORE", raising=False)
    monkeypatch.setenv("XC_RUNS_DIR", str(tmp_path / "runs"))
    config = {"xc": {"store": "s3://from-config/p"}}
    assert store_lib.choose(None, {}, "local") == store_lib.Choice((tmp_path / "store").as_uri(), "the local folder")
    assert store_lib.choose(None, config, "local") == store_lib.Choice("s3://from-config/p", "fabric.yaml xc.store")
    monkeypatch.setenv("XC_STORE", "s3://from-env/q/")
    assert store_lib.choose(None, config, "local") == store_lib.Choice("s3://from-env/q", "XC_STORE")
    assert store_lib.choose(str(tmp_path / "flag"), config, "local").url == (tmp_path / "flag").as_uri()
    with pytest.raises(ClusterError, match="neither file:///folder nor s3://bucket/prefix"):
        store_lib.choose("gs://elsewhere/x", config, "local")
    # an AWS cluster whose stack gives no store cannot use this machine's folder: said before launch
    monkeypatch.delenv("XC_STORE")
    monkeypatch.setenv("PATH", str(tmp_path))  # no Pulumi CLI here
    choice = store_lib.choose(None, {}, "aws:demo")
    with pytest.raises(ClusterError, match="cluster aws:demo has no store.*pass --store s3://"):
        store_lib.check(choice, "aws:demo")


def test_credentials_reach_the_ranks_only_as_secrets_off_aws(monkeypatch):
    from launch.staging import secrets

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "verysecretvalue")
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    env = store_lib.rank_env(store_lib.Choice("s3://b-1/p", "--store"), "local")
    public, secret = secrets.split(env)
    assert public["XC_STORE"] == "s3://b-1/p" and public["XC_S3_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert secret == {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY", "AWS_SECRET_ACCESS_KEY": "verysecretvalue"}
    # on AWS the nodes' instance profile answers: no operator credentials travel at all
    assert not secrets.split(store_lib.rank_env(store_lib.Choice("s3://b-1/p", "x"), "pulumi"))[1]
    assert not secrets.split(store_lib.rank_env(store_lib.Choice("file:///s", "x"), "local"))[1]
    monkeypatch.setenv("XC_CLUSTER", "aws:demo")  # no --cluster flag: the default cluster is resolved once
    monkeypatch.setenv("XC_STORE", "s3://b-1/p")
    chosen = store_lib.choose(None, {}, None)
    assert chosen.spec == "aws:demo" and not secrets.split(store_lib.rank_env(chosen))[1]


def test_a_bad_store_is_one_line_with_the_fix(s3, tmp_path, monkeypatch):
    assert store_lib.check(store_lib.Choice(s3, "--store")) < 30  # the good one answers
    with pytest.raises(ClusterError, match="store s3://no-such-bucket-x/p: the bucket does not exist; create it"):
        store_lib.check(store_lib.Choice("s3://no-such-bucket-x/p", "--store"))
    client("s3").create_bucket(Bucket="xc-eu-bucket", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    with pytest.raises(ClusterError, match="the bucket is in eu-west-1 but AWS_REGION is us-east-1; export "
                                           "AWS_REGION=eu-west-1"):
        store_lib.check(store_lib.Choice("s3://xc-eu-bucket/p", "--store"))
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    with pytest.raises(ClusterError, match=rf"store {s3} is unreachable .*check the network and XC_S3_ENDPOINT_URL"):
        store_lib.check(store_lib.Choice(s3, "--store"))
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", os.environ["XC_AWS_ENDPOINT_URL"])
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ClusterError, match=rf"store {s3}: no AWS credentials; export AWS_ACCESS_KEY_ID"):
        store_lib.check(store_lib.Choice(s3, "--store"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() != 0:  # root writes anyway
        with pytest.raises(ClusterError, match="permission denied"):
            store_lib.check(store_lib.Choice(ro.as_uri(), "--store"))


@pytest.fixture
def strict_moto(tmp_path, monkeypatch):
    """A second moto server that checks credentials (as AWS does): unknown keys are refused."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc, "the strict moto server", lambda: "its output is discarded")
    yield url
    proc.kill()
    proc.wait()


def test_access_denied_is_one_line_with_the_fix(aws_env, strict_moto, monkeypatch):
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", strict_moto)
    with pytest.raises(ClusterError, match=r"store s3://any-bucket/p: access denied \(\w+\); allow "
                                           "s3:GetObject"):
        store_lib.check(store_lib.Choice("s3://any-bucket/p", "--store"))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs: a disk that fills up for real (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "tiny"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=False,
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_a_full_disk_is_one_line_with_the_fix(s3, tiny_disk, tmp_path):
    out = tmp_path / "output"
    out.mkdir()
    (out / "model.safetensors").write_bytes(os.urandom(3 << 20))
    shared.publish_output(out, url=s3, run_id="r7")
    shared.open_store(s3).put_bytes("runs/r7/summary.json", b"{}")
    with pytest.raises(ClusterError, match=rf"pulling r7 from {s3} into {tiny_disk}: no space left on device; free "
                                           "space there or pass --to another folder"):
        store_lib.pull(s3, "r7", tiny_disk)
    for p in tiny_disk.rglob("*"):
        if p.is_file():
            p.unlink()
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)  # the store's own disk, full to the last block
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    with pytest.raises(ClusterError, match=rf"store {tiny_disk.as_uri()}: no space left on device"):
        store_lib.check(store_lib.Choice(tiny_disk.as_uri(), "--store"))


def test_resume_takes_the_record_and_checkpoint_from_the_store(tmp_path, monkeypatch):
    from launch.life import resume
    from launch.plan.request import Resume, run_env

    url = (tmp_path / "store").as_uri()
    request = {"job": "glue", "script": None, "args": ["--seed", "1"], "ppn": "auto", "threads": "auto",
               "backend": "gloo", "precision": "fp32", "env": {"XC_STORE": url, "AWS_SECRET_ACCESS_KEY": "***"},
               "save_every": "20", "pin": True, "timeout_s": 300, "data": {}}
    summary = {"status": "preempted", "request": request, "world_size": 2, "nodes": [{}, {}], "env": {"XC_STORE": url}}
    store = shared.open_store(url)
    store.put_bytes("runs/r8/summary.json", json.dumps(summary).encode())  # started on another machine
    for step in (10, 20):
        shared.publish_checkpoint(_checkpoint(tmp_path / f"checkpoint-{step}", step), run_id="r8", url=url)
    shared.upload_tree(store, _checkpoint(tmp_path / "checkpoint-30", 30, complete=False), "runs/r8/checkpoints/checkpoint-30")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-operator")
    req = resume.resume_request("r8", tmp_path / "runs", store=url)
    assert req.resume == Resume("r8", 20, 2, None, f"{url}/runs/r8/checkpoints/checkpoint-20")
    assert req.spec.what.env["AWS_SECRET_ACCESS_KEY"] == "from-the-operator"  # the record's *** filled in, never stored
    env = run_env(req, ["127.0.0.2", "127.0.0.3"])
    assert env["XC_RESUME_URL"] == f"{url}/runs/r8/checkpoints/checkpoint-20" and env["XC_RESUME_FROM"] == "resume/checkpoint-20"
    with pytest.raises(ClusterError, match="--resume r9: no readable .* nor in the store"):
        resume.resume_request("r9", tmp_path / "runs", store=url)


def test_off_aws_the_run_says_whose_credentials_the_nodes_hold_and_until_when(s3, monkeypatch):
    """A local or hosts cluster with an s3 store gets the operator's credentials: the run's first lines say whose
    (STS, over moto's HTTP) and that a static key never expires or a session token does; on AWS nodes, or with a
    folder store, nothing is said (the nodes use their own role, or no credentials)."""
    choice = store_lib.Choice(s3, "--store")
    line = store_lib.credentials_line(choice, "local")
    assert line.startswith("store credentials: the nodes get arn:aws:") and "long-lived access key" in line, line
    assert "testing" not in line  # the key itself is never printed
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-session")
    assert "temporary (a session token" in store_lib.credentials_line(choice, "hosts:/x")
    assert store_lib.credentials_line(choice, "aws:dev") is None
    assert store_lib.credentials_line(store_lib.Choice("file:///tmp/st", "--store"), "local") is None


def test_a_file_put_again_leaves_no_temporary_name_beside_it(tmp_path):
    """A file store links the file in; putting the same (grown) file again, as the TensorBoard sync does, replaces the
    object and leaves only its name (rename(2) of two links to one file would keep both)."""
    from training.runtime.store import open_store

    local = tmp_path / "events.out.tfevents.1"
    local.write_bytes(b"a")
    target = open_store((tmp_path / "store").as_uri())
    target.put_file(local, "runs/r1/output/events.out.tfevents.1")
    with local.open("ab") as f:
        f.write(b"b")
    target.put_file(local, "runs/r1/output/events.out.tfevents.1")
    assert [p.name for p in (tmp_path / "store" / "runs" / "r1" / "output").iterdir()] == ["events.out.tfevents.1"]
    assert target.get_bytes("runs/r1/output/events.out.tfevents.1") == b"ab"


def test_a_folder_that_is_not_a_checkpoint_is_refused_without_its_step(tmp_path, s3):
    folder = tmp_path / "latest"
    folder.mkdir()
    with pytest.raises(shared.StoreError, match="is not a checkpoint folder"):
        shared.publish_checkpoint(folder, run_id="r9", url=s3)
    assert shared.stored_steps(shared.open_store(s3), "r9") == []
