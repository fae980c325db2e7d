"""One S3 client per endpoint, region and credentials of this process (training.runtime.store's S3Store asks it).

A client costs ~0.25 s of CPU to make: its session parses botocore's JSON service model and endpoint rules anew.
Every S3Store made one, and a store is opened per operation (the head publishes a run's records every 5 s), so a
10-minute run's publishing spent most of its time making clients. boto3's default session is not used: it keeps
the credentials it first found; here a changed AWS_* variable (profile, keys, files) makes a new client, and a
client on an instance profile refreshes its own credentials. Clients are thread-safe; their making is locked.
"""
from __future__ import annotations

import os
import threading

CREDENTIALS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                   "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
_clients: dict[tuple, object] = {}
_lock = threading.Lock()


def s3_client(endpoint: str | None, region: str | None, pool: int):
    key = (os.getpid(), endpoint, region, pool, *(os.environ.get(k) for k in CREDENTIALS_ENV))  # pid: not across fork
    with _lock:
        if key not in _clients:
            import boto3
            from botocore.config import Config

            _clients[key] = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=Config(
                retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=pool, connect_timeout=10,
                read_timeout=60))
        return _clients[key]
