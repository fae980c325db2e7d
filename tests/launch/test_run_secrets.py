"""The secrets of a chain an AWS head supervises (launch.staging.run_secrets), against a moto server over HTTP: fab
puts each secret --env value as a SecureString under /xeon-cluster/<cluster>/runs/<chain>/, a head that takes the
chain over reads them back, its supervisor deletes them at the chain's end; the store's job keeps only their names.
The whole flow (head killed, the replacement restarting the run with its secret) runs on the AWS twin
(tests/twin/test_twin.py)."""
from __future__ import annotations

import types

import moto_fixture
from test_mesh import cluster_key, key_of

from launch.plan.request import TrainRequest
from launch.staging import run_secrets
from launch.supervision import adopt


def test_put_then_a_head_reads_them_back_and_the_chains_end_deletes_them(aws_env):
    values = {f"KEY_{i}": f"value-{i}-hush" for i in range(12)}  # more than one GetParameters call takes
    arn = cluster_key("bert")
    run_secrets.put("bert", "c1", values)
    ssm = moto_fixture.client("ssm")
    stored = ssm.get_parameter(Name="/xeon-cluster/bert/runs/c1/KEY_0")["Parameter"]
    assert stored["Type"] == "SecureString" and stored["Value"] != "value-0-hush"  # encrypted at rest
    # each with the cluster's own key, which only the head's role may decrypt with (infra/policies.py key_policy)
    assert {key_of(f"/xeon-cluster/bert/runs/c1/{k}") for k in values} == {arn}
    assert run_secrets.fetch("bert", "c1", sorted(values)) == values
    assert run_secrets.fetch("bert", "c1", ["KEY_0", "NOT_PUT"]) is None  # one gone: lost, not half a set
    assert run_secrets.fetch("bert", "other-chain", ["KEY_0"]) is None
    run_secrets.delete("bert", "c1", sorted(values))
    left = ssm.describe_parameters(ParameterFilters=[{"Key": "Path", "Option": "Recursive",
                                                      "Values": ["/xeon-cluster/bert/runs"]}])["Parameters"]
    assert left == []
    run_secrets.delete("bert", "c1", sorted(values))  # again: nothing there, nothing raised


def test_fab_stop_deletes_a_chains_secrets_by_their_path_without_reading_them(aws_env):
    """A supervisor ended by SIGTERM deletes nothing: fab stop lists the chain's folder and deletes it."""
    cluster_key("bert")
    run_secrets.put("bert", "c1", {f"KEY_{i}": f"value-{i}" for i in range(12)})
    run_secrets.put("bert", "c2", {"KEEP": "other chain"})
    run_secrets.delete_chain("bert", "c1")
    ssm = moto_fixture.client("ssm")
    left = ssm.describe_parameters(ParameterFilters=[{"Key": "Path", "Option": "Recursive",
                                                      "Values": ["/xeon-cluster/bert/runs"]}])["Parameters"]
    assert [p["Name"] for p in left] == ["/xeon-cluster/bert/runs/c2/KEEP"]
    run_secrets.delete_chain("bert", "c1")  # nothing left: nothing raised


def test_the_store_keeps_the_names_and_a_replacement_head_gets_the_values_back(aws_env, tmp_path):
    store = (tmp_path / "store").as_uri()
    req = TrainRequest.of(nodes=2, env={"MYSECRET": "hush-1", "HF_TOKEN": "hush-2", "PLAIN": "p"}, valueless={"MYSECRET"},
                       args=["--hub_token", "hush-3", "--seed", "1", "--api-key=hush-4"])
    kept = run_secrets.of_request(req)
    # a bare --env KEY, a name that reads as a secret, and secret job arguments under their flags' names (as
    # --resume reads them): each masked in the record
    assert kept == {"MYSECRET": "hush-1", "HF_TOKEN": "hush-2", "HUB_TOKEN": "hush-3", "API_KEY": "hush-4"}
    adopt.save_job(store, "c1", "aws:bert", req, "digest", secrets_at="bert")
    saved = (tmp_path / "store").rglob("*.json")
    text = "".join(p.read_text() for p in saved)
    assert not [v for v in kept.values() if v in text]  # names only
    job = adopt.load_job(store, "c1")
    assert job["secrets"] == sorted(kept) and job["secrets_at"] == "bert"
    assert adopt.kept_secrets(job) is None  # fab has not put them: lost
    cluster_key("bert")
    run_secrets.put("bert", "c1", kept)
    assert adopt.kept_secrets(job) == kept
    assert adopt.kept_secrets({**job, "secrets_at": None}) is None  # kept nowhere (an older fab): lost
    assert adopt.kept_secrets({**job, "secrets": []}) == {}  # a chain without secrets needs none


def test_secrets_of_a_cluster_without_its_key_are_not_put_and_the_fix_is_named(aws_env):
    """A stack made before the key existed: 'pulumi up' makes it; nothing goes to SSM under the aws/ssm key."""
    import pytest

    from core.errors import ClusterError

    with pytest.raises(ClusterError, match="no KMS key alias/xeon-cluster/bert.*pulumi up"):
        run_secrets.put("bert", "c1", {"HF_TOKEN": "hush"})
    assert key_of("/xeon-cluster/bert/runs/c1/HF_TOKEN") is None
    run_secrets.put("bert", "c1", {})  # nothing to put: no key needed


def test_the_adopted_request_has_the_values_the_record_masks(aws_env, tmp_path):
    store = (tmp_path / "store").as_uri()
    args = ["--hub_token", "hush-3", "--seed", "1", "--api-key=hush-4"]
    req = TrainRequest.of(nodes=2, env={"MYSECRET": "hush-1", "PLAIN": "p"}, valueless={"MYSECRET"}, args=args)
    record = req.to_record()
    # what the store and the replacement head see
    what = record["what"]
    assert what["env"]["MYSECRET"] != "hush-1" and "hush-3" not in what["args"] and "--api-key=hush-4" not in what["args"]
    rec = types.SimpleNamespace(run_id="c1-r2", nodes=[{}, {}], to_json=lambda: {"spec": record})
    job = {"chain": "c1", "secrets": sorted(run_secrets.of_request(req)), "secrets_at": "bert", "min_nodes": None,
           "grow_back": True}
    again = adopt.adopted_request(store, job, rec, tmp_path / "runs", run_secrets.of_request(req))
    assert again.spec.what.env == {"MYSECRET": "hush-1", "PLAIN": "p"}  # the arguments' values go back in the arguments only
    assert again.spec.what.args == tuple(args)
    assert again.to_record()["what"]["env"] == what["env"] and again.to_record()["what"]["args"] == what["args"]
