"""The one boto3 EC2 client factory (Pulumi-free), for the AWS inventory and the live spot prices."""
from __future__ import annotations

import functools
import os


def ec2_client(region: str | None = None):
    """A boto3 EC2 client; XC_AWS_ENDPOINT_URL points it elsewhere (the tests use a moto server)."""
    import boto3  # late: importing infra must work where boto3 or credentials are missing
    import botocore.session

    # A fresh session per call picks up credentials as they are now; the shared loader spares
    # each one re-reading botocore's EC2 model (half a second).
    session = botocore.session.get_session()
    session.register_component("data_loader", _loader())
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return boto3.session.Session(botocore_session=session, region_name=region).client(
        "ec2", endpoint_url=os.environ.get("XC_AWS_ENDPOINT_URL") or None)


@functools.lru_cache(maxsize=1)
def _loader():
    from botocore.loaders import create_loader

    return create_loader()
