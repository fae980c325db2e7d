"""A real moto EC2 server on 127.0.0.1, started as a subprocess: boto3 talks HTTP to it exactly as
it would to AWS. conftest.py registers the fixtures (aws_env, moto_server) for every module, so that each pytest
worker starts one server: a session fixture imported into a module is that module's own, one server per module.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, what: str, said) -> None:
    """Until the moto server at url answers; killed, and the test failed with said() (its log), if it ends or takes
    over 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{what} did not start: {said()}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def moto_server():
    """URL of a moto server process, shared by the worker's modules and stopped at the session's end."""
    port = _free_port()
    # a file, not a pipe: nobody reads moto's request log, and a full pipe would freeze the server
    # (a call moto lacks, e.g. Image Builder's, logs a whole traceback)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"

        def said() -> str:
            log.seek(0)
            return log.read().decode()[-2000:]
        wait_up(url, proc, "moto server", said)
        yield url
        proc.kill()  # holds nothing worth a graceful stop, which takes werkzeug seconds
        proc.wait()


@pytest.fixture
def aws_env(moto_server, monkeypatch, tmp_path):
    """A fresh moto state, dummy credentials, and nothing that could reach a real AWS endpoint."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST"), timeout=10).close()
    isolate_aws(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("XC_AWS_ENDPOINT_URL", moto_server)
    return moto_server


def isolate_aws(monkeypatch, tmp_path):
    """No credentials, no config files, no instance metadata service: only what a test sets."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "XC_AWS_CLUSTER", "XC_AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


def client(service: str):
    """A boto3 client of any service on the moto server the aws_env fixture points at."""
    import os

    import boto3

    return boto3.client(service, region_name=REGION, endpoint_url=os.environ["XC_AWS_ENDPOINT_URL"])
