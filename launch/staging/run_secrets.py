"""The secrets of a run an AWS head supervises, kept where a replacement head finds them.

fab puts each secret `--env` value of the chain (a bare `--env KEY`, or a name that reads as a secret:
launch.staging.secrets.is_secret) and each secret job argument's (of_request) as an SSM SecureString at
/xeon-cluster/<cluster>/runs/<chain>/<KEY>, encrypted with the cluster's own KMS key (cluster.mesh.secrets_key: only
the head's role may decrypt with it), before the supervisor starts on the head. A head that takes the chain over reads them back (only the head's role may: infra.policies.head_policy).
The supervisor deletes them when the chain ends, and `fab stop` when it ends the chain's supervisor (delete_chain: a
supervisor ended by SIGTERM deletes nothing). Records, logs and the store keep only the masked values. A head that
finds them gone ends the chain with that cause.
"""
from __future__ import annotations

import logging
import posixpath

from cluster.mesh import ROOT, secrets_key
from core.ec2 import aws_client, aws_errors
from launch.staging import secrets

log = logging.getLogger(__name__)


def of_request(req) -> dict[str, str]:
    """What a chain keeps in SSM: its secret --env values by key, and its secret job arguments' values under their
    flags' names in capitals (--hub_token -> HUB_TOKEN, as --resume reads them); records keep both masked."""
    return {**secrets.split(req.spec.what.env, req.valueless)[1], **secrets.arg_values_by_flag(req.spec.what.args)}


def folder(cluster: str, chain: str) -> str:
    return posixpath.join(ROOT, cluster, "runs", chain)  # an SSM path, not a run's folder (paths.RunPaths's)


def parameter(cluster: str, chain: str, key: str) -> str:
    return f"{folder(cluster, chain)}/{key}"


def put(cluster: str, chain: str, values: dict[str, str], region: str | None = None) -> None:
    """Operator side: each value as a SecureString encrypted with the cluster's key (raises ClusterError naming
    the SSM call that failed, or 'pulumi up' where the cluster has no key yet)."""
    if not values:
        return
    key_id = secrets_key(cluster, region)
    with aws_errors("ssm"):
        client = aws_client("ssm", region)
        for key, value in sorted(values.items()):
            client.put_parameter(Name=parameter(cluster, chain, key), Value=value, Type="SecureString",
                                 KeyId=key_id, Overwrite=True, Description=f"xeon-cluster {cluster}: a secret of chain {chain} "
                                 "(its supervisor deletes it when the chain ends)")
    log.info("%d secret(s) of chain %s in SSM under %s", len(values), chain, folder(cluster, chain))


def fetch(cluster: str, chain: str, keys: list[str], region: str | None = None) -> dict[str, str] | None:
    """Head side: every value, or None if any of them is gone."""
    names = [parameter(cluster, chain, k) for k in keys]
    got: dict[str, str] = {}
    with aws_errors("ssm"):
        client = aws_client("ssm", region)
        for i in range(0, len(names), 10):  # GetParameters takes at most 10 names
            res = client.get_parameters(Names=names[i:i + 10], WithDecryption=True)
            got.update({p["Name"]: p["Value"] for p in res["Parameters"]})
    if set(got) != set(names):
        return None
    return {k: got[parameter(cluster, chain, k)] for k in keys}


def delete(cluster: str | None, chain: str, keys: list[str], region: str | None = None) -> None:
    """When the chain ends (or its start failed): gone from SSM; nothing to do without a cluster (kept nowhere) or
    keys. A failure is logged, not raised: 'fab sweep' finds what is left under /xeon-cluster/<cluster>/."""
    if not cluster or not keys:
        return
    names = [parameter(cluster, chain, k) for k in keys]
    try:
        with aws_errors("ssm"):
            client = aws_client("ssm", region)
            for i in range(0, len(names), 10):  # DeleteParameters takes at most 10 names
                client.delete_parameters(Names=names[i:i + 10])
    except Exception as exc:  # noqa: BLE001 - the chain's end is not undone by a cleanup that failed
        log.warning("could not delete the secrets of chain %s from SSM (%s): 'fab sweep' lists them", chain, exc)


def delete_chain(cluster: str, chain: str, region: str | None = None) -> None:
    """Every secret kept for the chain, found by its path (`fab stop`: the operator may list and delete, never read
    them). A failure is logged, not raised, as in delete()."""
    try:
        with aws_errors("ssm"):
            client = aws_client("ssm", region)
            pages = client.get_paginator("describe_parameters").paginate(
                ParameterFilters=[{"Key": "Path", "Option": "Recursive", "Values": [folder(cluster, chain)]}])
            names = [p["Name"] for page in pages for p in page["Parameters"]]
    except Exception as exc:  # noqa: BLE001 - the stop is not undone by a cleanup that failed
        log.warning("could not list the secrets of chain %s in SSM (%s): 'fab sweep' lists them", chain, exc)
        return
    delete(cluster, chain, [n.rsplit("/", 1)[1] for n in names], region)
