"""What a head's supervisor leaves in the versioned store bucket. A whole log.txt every 5 s made a
version per upload (a 10 MB log: ~170 GB a day of old versions); now a record is published only when it changed,
the log in appended parts written once each, and logs and heartbeats carry the tag whose old versions expire after a
day. Against a real moto S3 server with versioning on, a simulated 10-minute run (a progress line every tick, the
head's publish every 5 s and heartbeat every 30 s) counts the versions it writes, beside the old way's."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from moto_fixture import client

from cluster import store as store_lib
from infra.bucket import CHECKPOINT_TAG_KEY, NONCURRENT_LOG_DAYS
from launch.life import head, records
from launch.life.records import RunRecord, Status
from training.runtime.paths import LOG_TAG

BUCKET = "xc-hygiene"
MINUTES, PUBLISH_S, HEARTBEAT_S = 10, 5, 30
LINE = b"[0] [progress] step %05d/12000 loss 0.4321 lr 2.0e-05 samples/s 22.15 " + b"x" * 40 + b"\n"


@pytest.fixture
def s3(aws_env, monkeypatch):
    monkeypatch.setenv("XC_S3_ENDPOINT_URL", aws_env)
    monkeypatch.setenv("XC_HEARTBEAT_S", str(HEARTBEAT_S))
    c = client("s3")
    c.create_bucket(Bucket=BUCKET)
    c.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    return c


def _running(runs: Path, run_id: str) -> Path:
    run_dir = runs / run_id
    run_dir.mkdir(parents=True)
    rec = RunRecord(run_id, job="glue", ppn=1, world_size=2, supervisor={"pid": os.getpid(), "host": "head"})
    rec._move(Status.RUNNING)._save(run_dir)
    return run_dir


def _ten_minutes(run_dir: Path, publish) -> None:
    """A progress line per 5 s tick; the record changes once mid-run (as a transition would change it)."""
    log = run_dir / "log.txt"
    for tick in range(MINUTES * 60 // PUBLISH_S):
        with log.open("ab") as f:
            f.write(LINE % tick)
        if tick == 60:
            rec = records.load(run_dir)
            rec.nodes = [{"name": "node0"}, {"name": "node1"}]
            rec._save(run_dir)
        publish(tick * PUBLISH_S)


def _versions(c, prefix: str) -> list[dict]:
    out = []
    for page in c.get_paginator("list_object_versions").paginate(Bucket=BUCKET, Prefix=prefix):
        out += page.get("Versions", [])
    return out


def test_a_ten_minute_run_leaves_a_version_per_change_and_old_ones_only_of_logs_and_heartbeats(s3, tmp_path):
    url = f"s3://{BUCKET}/cl"
    ticks = MINUTES * 60 // PUBLISH_S

    # now: the head's Beat, as its thread runs it (tick every publish_s, a heartbeat every heartbeat_s)
    runs = tmp_path / "new"
    run_dir = _running(runs, "r1")
    beat = head.Beat("r1", runs, url)
    _ten_minutes(run_dir, beat.tick)
    store_lib.publish_records(run_dir, url)  # the run's ending: the whole log once
    versions = _versions(s3, "cl/runs/r1/")
    by_key: dict[str, list[dict]] = {}
    for v in versions:
        by_key.setdefault(v["Key"], []).append(v)
    parts = sorted(k for k in by_key if "/log.parts/" in k)
    assert len(parts) == ticks and all(len(by_key[k]) == 1 for k in parts)  # each part written once
    assert len(by_key["cl/runs/r1/log.txt"]) == 1
    assert len(by_key["cl/runs/r1/summary.json"]) == 3  # running, its one change, the ending's publish
    assert len(by_key["cl/runs/r1/heartbeat.json"]) == MINUTES * 60 // HEARTBEAT_S
    # the parts are the log, byte for byte, and the reader takes whichever is longer
    whole = (run_dir / "log.txt").read_bytes()
    assert b"".join(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in parts) == whole
    assert store_lib.read_log(url, "r1") == whole.decode()
    old_now = [v for v in versions if not v["IsLatest"]]
    assert {v["Key"] for v in old_now} == {"cl/runs/r1/summary.json", "cl/runs/r1/heartbeat.json"}
    # what stays a month (untagged old versions): two summaries; logs and heartbeats carry the one-day tag
    for key in ("cl/runs/r1/log.txt", "cl/runs/r1/heartbeat.json", parts[0]):
        tags = {t["Key"]: t["Value"] for t in s3.get_object_tagging(Bucket=BUCKET, Key=key)["TagSet"]}
        assert f"{CHECKPOINT_TAG_KEY}={tags[CHECKPOINT_TAG_KEY]}" == LOG_TAG, key
    assert s3.get_object_tagging(Bucket=BUCKET, Key="cl/runs/r1/summary.json")["TagSet"] == []
    assert NONCURRENT_LOG_DAYS == 1
    kept_bytes = sum(v["Size"] for v in old_now)

    # before: the whole log.txt and records every 5 s
    runs_old = tmp_path / "old"
    old_dir = _running(runs_old, "r2")
    _ten_minutes(old_dir, lambda now: store_lib.publish_records(old_dir, url))
    old_versions = [v for v in _versions(s3, "cl/runs/r2/") if not v["IsLatest"]]
    old_logs = [v for v in old_versions if v["Key"].endswith("/log.txt")]
    assert len(old_logs) == ticks - 1
    old_bytes = sum(v["Size"] for v in old_versions)
    print(f"10-minute run, {ticks} publishes: old versions left {kept_bytes} B in "
          f"{len(old_now)} objects now, {old_bytes} B in {len(old_versions)} before ({old_bytes / kept_bytes:.0f}x)")
    assert kept_bytes * 50 < old_bytes


def test_a_restarted_supervisor_goes_on_after_the_parts_already_sent(s3, tmp_path):
    url = f"s3://{BUCKET}/cl"
    run_dir = _running(tmp_path, "r3")
    (run_dir / "log.txt").write_bytes(b"one\ntwo\npartial")
    assert store_lib.LivePublisher(url).publish(run_dir) == 2  # summary.json and the first part
    with (run_dir / "log.txt").open("ab") as f:
        f.write(b" line\nthree\n")
    again = store_lib.LivePublisher(url)  # a new process: it learns the offset from the store
    assert again.publish(run_dir) == 2  # summary.json (it knows nothing sent) and only the new lines
    assert again.publish(run_dir) == 0  # nothing changed: nothing written
    keys = sorted(v["Key"] for v in _versions(s3, "cl/runs/r3/log.parts/"))
    assert keys == ["cl/runs/r3/log.parts/000000000008", "cl/runs/r3/log.parts/000000000000"][::-1]
    assert store_lib.read_log(url, "r3") == "one\ntwo\npartial line\nthree\n"


def test_a_run_the_store_has_no_log_of_reads_as_none(s3):
    assert store_lib.read_log(f"s3://{BUCKET}/cl", "nope") is None


def test_an_ended_runs_parts_go_and_its_log_reads_without_them(s3, tmp_path, monkeypatch):
    """A run's log parts (one object every ~5 s) are deleted once its whole log.txt is published at its end, and a
    reader fetches no part that log.txt already covers; parts a running run's log.txt does not yet cover stay."""
    from training.runtime import store as runtime_store

    url = f"s3://{BUCKET}/cl"
    run_dir = _running(tmp_path, "r4")
    publisher = store_lib.LivePublisher(url)
    for n in range(3):
        with (run_dir / "log.txt").open("ab") as f:
            f.write(b"line %d\n" % n)
        publisher.publish(run_dir)
    store_lib.publish_records(run_dir, url)  # a transition while it runs: the parts stay
    with (run_dir / "log.txt").open("ab") as f:
        f.write(b"line 3\n")
    publisher.publish(run_dir)
    assert len(_versions(s3, "cl/runs/r4/log.parts/")) == 4
    fetched = []
    get = runtime_store.S3Store.get_bytes
    monkeypatch.setattr(runtime_store.S3Store, "get_bytes", lambda self, key: fetched.append(key) or get(self, key))
    assert store_lib.read_log(url, "r4") == "line 0\nline 1\nline 2\nline 3\n"  # parts longer than log.txt
    assert sum("/log.parts/" in k for k in fetched) == 4
    store_lib.publish_records(run_dir, url, ended=True)  # its end
    live = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="cl/runs/r4/log.parts/").get("Contents", [])]
    assert live == []
    fetched.clear()
    assert store_lib.read_log(url, "r4") == "line 0\nline 1\nline 2\nline 3\n"
    assert fetched == ["runs/r4/log.txt"]  # keys under the store's prefix
