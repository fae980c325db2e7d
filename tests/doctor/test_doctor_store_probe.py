"""fab doctor's store row asks only what the node role allows: the real moto server process on
127.0.0.1 holds the bucket; the node role (infra.bucket.node_statements) is enforced on the client, since moto's IAM
emulation ignores the s3:prefix condition that the role's listing depends on."""
from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys

import moto_fixture
import pytest
from botocore.exceptions import ClientError

from doctor import store_probe as doctor_store
from training.runtime import store as shared
from training.runtime.store import S3Store, StoreError

BUCKET, PREFIX = "xc-doc-store", "doc"
URL = f"s3://{BUCKET}/{PREFIX}"
ACTION = {"HeadBucket": "s3:ListBucket", "ListObjectsV2": "s3:ListBucket", "ListObjects": "s3:ListBucket",
          "PutObject": "s3:PutObject", "GetObject": "s3:GetObject", "DeleteObject": "s3:DeleteObject"}


try:  # the node role's store statements: infra.policies now, infra.bucket before
    from infra.policies import store_statements as node_statements
except ImportError:
    from infra.bucket import node_statements


def allowed(operation: str, params: dict) -> bool:
    """The node role's S3 statements, evaluated for one call: action, resource, and the s3:prefix condition."""
    arn = f"arn:aws:s3:::{BUCKET}"
    resource = f"{arn}/{params['Key']}" if "Key" in params else arn
    for statement in node_statements(arn, PREFIX):
        if ACTION.get(operation) not in statement["Action"]:
            continue
        if not any(fnmatch.fnmatchcase(resource, r) for r in statement["Resource"]):
            continue
        like = statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if like is not None and not any(fnmatch.fnmatchcase(params.get("Prefix", "\0none"), p) for p in like):
            continue
        return True
    return False


def node_role_client(calls: list[str]):
    client = moto_fixture.client("s3")

    def police(model, params, **_):
        calls.append(model.name)
        if not allowed(model.name, params):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "not allowed by the node role"}},
                              model.name)

    client.meta.events.register("provide-client-params.s3.*", lambda params, model, **kw: police(model, params))
    return client


def test_the_node_probe_asks_only_what_the_node_role_allows(aws_env, monkeypatch):
    moto_fixture.client("s3").create_bucket(Bucket=BUCKET)
    calls: list[str] = []
    client = node_role_client(calls)
    monkeypatch.setattr(shared, "open_store", lambda url: S3Store(url, client=client))

    # one probe for the operator's check and every node's row: HeadBucket, which the node role refuses (the row
    # was red on every AWS node), gives way to ListObjectsV2 under the prefix
    assert shared.probe(URL) >= 0
    assert calls == ["HeadBucket", "ListObjectsV2", "PutObject", "GetObject", "DeleteObject"]
    assert "Contents" not in moto_fixture.client("s3").list_objects_v2(Bucket=BUCKET)  # the probe deleted itself
    # outside the prefix the role refuses, and the row says so in the store's one line
    with pytest.raises(StoreError, match=rf"store s3://{BUCKET}/other: access denied \(AccessDenied\); allow"):
        shared.probe(f"s3://{BUCKET}/other")


def test_the_program_a_node_runs_is_the_node_probe(aws_env, tmp_path):
    """The text fab doctor puts on a node (training/runtime/store.py and what it imports, then the probe), run as the node
    runs it."""
    moto_fixture.client("s3").create_bucket(Bucket=BUCKET)
    env = {"XC_S3_ENDPOINT_URL": aws_env, "AWS_REGION": moto_fixture.REGION, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing"}
    text = doctor_store.program(URL, env)
    assert "round(probe(" in text  # training.runtime.store.probe: HeadBucket gives way to ListObjectsV2 where refused
    script = tmp_path / "probe.py"
    script.write_text(text)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "XC_"))}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=clean,
                         cwd=tmp_path, check=False)
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith(doctor_store.TAG))
    assert line.startswith(doctor_store.TAG + " ") and json.loads(line.split(" ", 1)[1])["ok"] is True, \
        run.stdout + run.stderr
