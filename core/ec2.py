"""The one boto3 client factory (Pulumi-free), for the AWS inventory, the live spot prices and fab sweep,
and the one place that turns botocore's failures into the CLI's one-line errors."""
from __future__ import annotations

import contextlib
import functools
import os

from core.errors import ClusterError

# AWS API names as the error lines show them; a service not listed shows as its boto3 name.
API_NAMES = {"ec2": "EC2", "iam": "IAM", "logs": "CloudWatch Logs", "autoscaling": "Auto Scaling",
             "imagebuilder": "Image Builder"}


def aws_client(service: str, region: str | None = None):
    """A boto3 client; XC_AWS_ENDPOINT_URL points it elsewhere (the tests use a moto server)."""
    import boto3  # late: importing infra must work where boto3 or credentials are missing
    import botocore.session

    # A fresh session per call picks up credentials as they are now; the shared loader spares
    # each one re-reading botocore's service models (half a second for EC2's).
    session = botocore.session.get_session()
    session.register_component("data_loader", _loader())
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    return boto3.session.Session(botocore_session=session, region_name=region).client(
        service, endpoint_url=os.environ.get("XC_AWS_ENDPOINT_URL") or None)


def ec2_client(region: str | None = None):
    return aws_client("ec2", region)


@functools.lru_cache(maxsize=1)
def _loader():
    from botocore.loaders import create_loader

    return create_loader()


@contextlib.contextmanager
def aws_errors(service: str = "ec2"):
    """Turn botocore's failures into the one-line errors the CLI shows."""
    from botocore import exceptions as err
    from botocore.parsers import ResponseParserError

    try:
        yield
    except (err.NoCredentialsError, err.PartialCredentialsError):
        raise ClusterError("no AWS credentials for --cluster aws", fix="run 'aws configure' or export AWS_PROFILE "
                           "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)") from None
    except err.NoRegionError:
        raise ClusterError("no AWS region for --cluster aws", fix="export AWS_REGION=<the stack's region>") from None
    except err.EndpointConnectionError as exc:
        raise ClusterError(f"cannot reach the {API_NAMES.get(service, service)} API ({exc})", fix="check the network or "
                           "XC_AWS_ENDPOINT_URL") from None
    except err.ClientError as exc:
        error = exc.response.get("Error", {})
        raise ClusterError(f"AWS refused {exc.operation_name} ({error.get('Code')}: {error.get('Message')})", fix=f"check that "
                           f"the credentials are valid and allow {service}:{exc.operation_name}") from None
    except (err.BotoCoreError, ResponseParserError) as exc:  # e.g. a reply that does not parse
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ClusterError(f"the {API_NAMES.get(service, service)} API failed ({reason})", fix="retry, or check "
                           "XC_AWS_ENDPOINT_URL") from None
