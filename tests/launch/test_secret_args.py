"""A job's arguments named like secrets (`--hub_token hf_...`) are masked in records and logs as
`--env` values are, and a resume or a restart still runs with the real value."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from core.errors import ClusterError
from launch.life.records import RunRecord, Status
from launch.plan.request import TrainRequest, validate
from launch.staging import secrets
from launch.supervision import restarts
from training.runtime.paths import Checkpoints

HF = "hf_AbCdEf0123456789"
ARGS = ["--hub_token", HF, "--api-key=sk-live-42xyz", "--tokenizer_name", "bert-base-uncased", "--max_tokens", "64",
        "--pad_token_id", "0", "--db_password", "pw-1234", "--credentials", "cred-5678", "--seed", "3"]


def test_values_of_flags_named_like_secrets_are_masked_and_nothing_else():
    assert secrets.mask_args(ARGS) == [
        "--hub_token", "***", "--api-key=***", "--tokenizer_name", "bert-base-uncased", "--max_tokens", "64",
        "--pad_token_id", "0", "--db_password", "***", "--credentials", "***", "--seed", "3"]
    assert sorted(secrets.arg_env(ARGS).values()) == sorted([HF, "sk-live-42xyz", "pw-1234", "cred-5678"])
    assert all(k.startswith(secrets.ARG_ENV) for k in secrets.arg_env(ARGS))
    assert secrets.masked_arg_flags(secrets.mask_args(ARGS)) == ["--hub_token", "--api-key", "--db_password",
                                                                 "--credentials"]
    assert secrets.mask_args(["--push_to_hub", "--hub_token"]) == ["--push_to_hub", "--hub_token"]  # no value
    assert secrets.unmask_args(secrets.mask_args(ARGS), ARGS) == ARGS
    assert secrets.flag_env_name("--api-key") == "API_KEY"


def test_the_record_keeps_them_masked_and_the_log_redacts_them(tmp_path):
    req = TrainRequest.of(job="glue", args=list(ARGS), ppn="1", threads="2", timeout_s=120, save_every="20")
    kept = json.dumps(req.to_record())
    assert HF not in kept and "sk-live-42xyz" not in kept and '"--hub_token", "***"' in kept
    # the plan's secrets (what secrets.env holds and the log filters redact) carry the argument values: attached,
    # fab's own stream; detached, the filter on node 0 that reads secrets.env
    from launch.life.detach import LogPlan
    from launch.life.stream import OutputRouter
    from training.runtime import redact

    log = io.StringIO()
    router = OutputRouter(LogPlan("r1", 1, ("node0",), secret_env=secrets.arg_env(ARGS)), io.StringIO(), log)
    router.write(f"[0] pushing with token {HF} to the hub\n")
    router.flush_rest()
    assert HF not in log.getvalue() and "pushing with token *** to the hub" in log.getvalue()
    env_file = tmp_path / secrets.FILE
    env_file.write_text(secrets.env_file(secrets.arg_env(ARGS)))
    assert HF in redact.secret_values(str(env_file))


def _resumable(runs: Path, args: list[str]) -> None:
    d = runs / "old"
    d.mkdir(parents=True)
    request = {"job": "glue", "script": None, "args": secrets.mask_args(args), "ppn": "1", "threads": "2",
               "backend": "gloo", "precision": "fp32", "env": {}, "save_every": "20", "pin": True, "timeout_s": 900,
               "data": {}}
    RunRecord("old", Status.PREEMPTED, spec=request, world_size=2, nodes=[{}, {}])._save(d)
    ck = d / "checkpoints" / "checkpoint-20"
    ck.mkdir(parents=True)
    (ck / "model.safetensors").write_bytes(b"w")
    (ck / Checkpoints.MARKER).write_text("{}")


def test_a_resume_takes_the_value_from_the_operators_environment_or_refuses_in_one_line(tmp_path, monkeypatch):
    from launch.supervision.train_flags import TrainFlags, resolve

    args = ["--hub_token", HF, "--seed", "3"]
    _resumable(tmp_path, args)
    monkeypatch.delenv("HUB_TOKEN", raising=False)
    req = resolve(TrainFlags(resume="old"), tmp_path).req
    with pytest.raises(ClusterError) as err:
        validate(req)
    assert str(err.value.what) == ("--resume old: its record keeps the value of --hub_token as *** and your "
                                   "environment has no value for it")
    assert err.value.fix == "export HUB_TOKEN=VALUE (the flag's name in capitals)" and "\n" not in str(err.value)
    monkeypatch.setenv("HUB_TOKEN", HF)
    assert resolve(TrainFlags(resume="old"), tmp_path).req.spec.what.args == tuple(args)


def test_a_restart_by_the_supervisor_goes_on_with_the_runs_own_value(tmp_path, monkeypatch):
    args = ["--hub_token", HF, "--seed", "3"]
    _resumable(tmp_path, args)
    monkeypatch.delenv("HUB_TOKEN", raising=False)
    req = TrainRequest.of(job="glue", args=list(args), runs_dir=tmp_path)
    nxt = restarts.next_request("old", req, print)
    assert nxt.spec.what.args == tuple(args) and nxt.resume.step == 20
