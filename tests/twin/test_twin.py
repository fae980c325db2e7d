"""The AWS twin (`fab local-up --aws`): the AWS flow end to end on one machine. moto is the control plane (the
Pulumi program itself made the groups, bucket, roles and security group on it), every instance a real sshd node in
its own network namespace with its own IMDS; fab finds them through the EC2 and Auto Scaling APIs and verifies
their host keys from their instance tags, as on AWS. Root only (namespaces and mounts): skipped otherwise.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from conftest import FabProcess, fab, processes_with_env, progress_step, progress_steps, wait_until
from fake_imds import FakeIMDS
from test_fab_anywhere import fab_at
from test_netns import netns_missing
from test_requirements import pip_env, wheel
from test_script_restarts import GLUE_LIKE
from test_user_scripts import _csv

from core import procs
from core.constants import PROJECT_ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the AWS twin needs root (network namespaces, mounts)")]
# 40 steps (320 samples x 2 epochs at 8 per device on 2 nodes) on the thin model: room for a notice at step ~8
# and a resume, at two thirds of the notice tests' 60
def short_args(model: str, samples: int = 320) -> list[str]:
    args = list(FakeIMDS.short_args(model))
    args[args.index("--max_train_samples") + 1] = str(samples)
    return args


# The twin's windows are longer (a head's take-over, a group's replacement, S3 through moto): its runs go ~4 steps a
# second, so that a loaded machine's take-over (over 30 s in a suite) still finds the run training
TWIN_PACE = ("--env", "XC_PACE_S=0.25")
SECRET = "hushhush-twin-4711"
KEEP_OUT = ("XC_CLUSTER", "XC_STORE", "XC_AWS_ENDPOINT_URL", "XC_S3_ENDPOINT_URL", "XC_SSH_KEY")  # then the line's


class Twin:
    def __init__(self, env: dict, up_s: float, out: str):
        self.env, self.up_s, self.out = env, up_s, out
        self.plain = dict(env)  # as the checkout that started it has it: without the export line
        self.export = next(line for line in out.splitlines() if line.startswith("export "))
        self.env.update(dict(kv.split("=", 1) for kv in self.export.split()[1:]))

    def fab(self, *args, **kw):
        return fab(*args, env=self.env, **kw)

    def start(self, *args) -> FabProcess:
        return FabProcess(*args, env=self.env)

    def client(self, service: str):
        return boto3.client(service, region_name=self.env["AWS_REGION"], endpoint_url=self.env["XC_AWS_ENDPOINT_URL"],
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def group_ids(self, group: str) -> set[str]:
        pages = self.client("ec2").get_paginator("describe_instances").paginate(Filters=[
            {"Name": "tag:aws:autoscaling:groupName", "Values": [group]},
            {"Name": "instance-state-name", "Values": ["running"]}])
        return {i["InstanceId"] for p in pages for r in p["Reservations"] for i in r["Instances"]}

    def status_ids(self) -> dict[str, str]:
        res = self.fab("status", "--no-runs", timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        return dict(re.findall(r"^(twin-(?:\d+|head))\s+(i-[0-9a-f]+)", res.stdout, re.MULTILINE))

    def wait_replaced(self, gone: str, timeout: float = 60) -> set[str]:
        """The nodes' group back at 2 running instances without `gone`, each booted and answering fab status."""
        deadline = time.monotonic() + timeout
        while True:
            ids = self.group_ids("twin-nodes")
            if gone not in ids and len(ids) == 2:
                status = self.status_ids()
                if set(status.values()) >= ids:
                    return ids
            assert time.monotonic() < deadline, f"{gone} not replaced in {timeout:.0f} s: {ids}"
            time.sleep(1)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    reason = netns_missing()  # root, yet a container without CAP_NET_ADMIN / CAP_SYS_ADMIN
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("twin")
    env = {k: "" for k in KEEP_OUT} | {"XC_STATE_DIR": str(tmp / "state"), "XC_RUNS_DIR": str(tmp / "runs")}
    started = time.monotonic()
    res = fab("local-up", "--aws", "--nodes", "2", env=env, timeout=180)
    up_s = time.monotonic() - started
    assert res.returncode == 0, res.stdout + res.stderr
    yield Twin(env, up_s, res.stdout)
    record = json.loads((tmp / "state" / "twin" / "twin.json").read_text())
    down = fab("local-down", env=env, timeout=120)
    assert down.returncode == 0 and "AWS twin down" in down.stdout, down.stdout + down.stderr
    left = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert record["bridge"] not in left and f"xct-{record['id']}-" not in spaces  # nothing of the twin is left
    assert not any(procs.exists(record[k]) for k in ("moto", "watcher"))  # a zombie (unreaped here) counts as gone


def test_up_in_a_minute_and_status_lists_the_instances_from_the_ec2_api(twin):
    assert twin.up_s <= 60, f"fab local-up --aws took {twin.up_s:.0f} s"
    assert twin.env["XC_CLUSTER"] == "aws:twin" and twin.env["XC_STORE"].startswith("s3://xc-twin-")
    assert re.match(r"http://198\.1[89]\.\d+\.1:\d+$", twin.env["XC_AWS_ENDPOINT_URL"])  # the twin's own range
    # the bridge's MAC is its own (set, not the lowest of its ports'): a node joining or leaving does not change it
    bridge = json.loads((Path(twin.env["XC_STATE_DIR"]) / "twin" / "twin.json").read_text())["bridge"]
    assert Path(f"/sys/class/net/{bridge}/addr_assign_type").read_text().strip() == "3"  # NET_ADDR_SET
    shown = twin.status_ids()
    assert set(shown) == {"twin-0", "twin-1", "twin-head"}
    # the checkout that started it uses it without the export line, as after 'fab local-up'
    same = fab("status", "--no-runs", env=twin.plain, timeout=60)
    assert same.returncode == 0 and same.stdout.startswith("cluster: aws:twin"), same.stdout + same.stderr
    assert dict(re.findall(r"^(twin-(?:\d+|head))\s+(i-[0-9a-f]+)", same.stdout, re.MULTILINE)) == shown
    # fab ssh: node1's own host name (its UTS namespace, as cloud-init sets it) and the head's, with their exit codes
    named = twin.fab("ssh", "node1", "--", "hostname", timeout=60)
    assert named.returncode == 0 and named.stdout.strip() == f"twin-{shown['twin-1']}", named.stdout + named.stderr
    head = twin.fab("ssh", "head", "--", "hostname;", "exit", "3", timeout=60)
    assert head.returncode == 3 and head.stdout.strip() == "twin-head", head.stdout + head.stderr
    assert {shown["twin-0"], shown["twin-1"]} == twin.group_ids("twin-nodes")
    assert {shown["twin-head"]} == twin.group_ids("twin-head")
    # what the Pulumi program made, as pulumi up leaves it: the group's termination hook, the bucket, the roles
    hooks = twin.client("autoscaling").describe_lifecycle_hooks(AutoScalingGroupName="twin-nodes")["LifecycleHooks"]
    assert [h["LifecycleHookName"] for h in hooks] == ["xc-checkpoint"]
    bucket = twin.env["XC_STORE"].split("/")[2]
    assert twin.client("s3").get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    roles = {r["RoleName"] for r in twin.client("iam").list_roles()["Roles"]}
    assert any(r.startswith("twin-node") for r in roles) and any(r.startswith("twin-head") for r in roles)
    # every instance at a private address inside 198.18.0.0/15; the groups' public ones there too (see the next test)
    for res in twin.client("ec2").describe_instances()["Reservations"]:
        for inst in res["Instances"]:
            if inst["State"]["Name"] == "terminated":
                continue  # the image build's instance, in moto's default VPC, gone once its image was made
            assert inst["PrivateIpAddress"].startswith(("198.18.", "198.19.")), inst["PrivateIpAddress"]
            if inst["InstanceId"] in set(shown.values()):
                assert inst["PublicIpAddress"].startswith(("198.18.", "198.19.")), inst


# Port 22 of each ADDRESS (or SOURCE>ADDRESS: from that source address), all at once: the SSH banner's start or the
# error's name, as JSON. A security group drops what it does not admit: a connection to it times out.
PROBE = """
import concurrent.futures, json, socket, sys
def probe(target):
    source, _, address = target.rpartition(">")
    with socket.socket() as s:
        s.settimeout(3)
        try:
            if source:
                s.bind((source, 0))
            s.connect((address, 22))
            return s.recv(64).decode(errors="replace")[:8]
        except OSError as exc:
            return type(exc).__name__
with concurrent.futures.ThreadPoolExecutor(len(sys.argv)) as pool:
    print(json.dumps(dict(zip(sys.argv[1:], pool.map(probe, sys.argv[1:])))))
"""
# On the head: the environment its supervisor sets itself (launch.supervision.supervisor._aws_head_env), the nodes as it
# finds them (cluster.aws) and each one's host name over fab's SSH, host keys verified. The head's key from SSM is not
# what this checks: the operator's key (argv[1]), which the launch template's key pair authorizes, stands in for it.
HEAD_DIALS = """
import json, sys
from unittest import mock
from cluster import aws, remote
from launch.supervision import supervisor
with mock.patch("cluster.mesh.fetch", return_value=sys.argv[1]):
    supervisor._aws_head_env("aws:twin")
dialed = {}
for node in aws.aws_nodes("twin"):
    try:
        with remote.connect(node, timeout=5) as conn:
            dialed[node.name] = [node.host, remote.run(conn, "hostname", "the address test").stdout.strip()]
    except Exception as exc:
        dialed[node.name] = [node.host, f"{type(exc).__name__}: {exc}"]
print(json.dumps(dialed))
"""


def test_security_groups_admit_the_head_at_private_addresses_and_the_operator_at_public_ones(twin, tmp_path):
    """As on AWS: the nodes' rule naming the head's group admits the head at their private addresses only (a group
    reference matches traffic inside the VPC); the operator, outside, reaches public addresses, from adminCidr only.
    The head's own code dials the private ones (dialing the public ones timed out)."""
    record = json.loads((Path(twin.env["XC_STATE_DIR"]) / "twin" / "twin.json").read_text())
    ids = twin.status_ids()
    found = twin.client("ec2").describe_instances(InstanceIds=[ids[k] for k in ("twin-head", "twin-0", "twin-1")])
    by_id = {i["InstanceId"]: i for r in found["Reservations"] for i in r["Instances"]}
    head, node0, node1 = (by_id[ids[k]] for k in ("twin-head", "twin-0", "twin-1"))
    for inst in (head, node0, node1):  # a public address of its own, from the twin's range, outside the VPC
        public = ipaddress.ip_address(inst["PublicIpAddress"])
        assert public in ipaddress.ip_network(record["public"]) and public not in ipaddress.ip_network(record["vpc"])
    rules = [p for g in twin.client("ec2").describe_security_groups()["SecurityGroups"] for p in g["IpPermissions"]]
    assert {r["CidrIp"] for p in rules for r in p["IpRanges"]} == {f"{record['operator']}/32"}  # adminCidr
    pub, priv = (lambda i: i["PublicIpAddress"]), (lambda i: i["PrivateIpAddress"])

    def ns(inst: dict) -> list[str]:
        return ["ip", "netns", "exec", f"xct-{record['id']}-{inst['InstanceId']}"]

    probes = {"operator": ([], [pub(node1), pub(head), priv(node1), priv(head), f"{record['router']}>{pub(node1)}"]),
              "head": (ns(head), [priv(node0), priv(node1), pub(node0), pub(node1)]),
              "node0": (ns(node0), [priv(node1), pub(node1), priv(head)])}
    running = {k: subprocess.Popen([*w, sys.executable, "-c", PROBE, *t], stdout=subprocess.PIPE, text=True)
               for k, (w, t) in probes.items()}
    seen = {k: json.loads(p.communicate(timeout=60)[0]) for k, p in running.items()}
    ssh, dropped = "SSH-2.0-", "TimeoutError"
    want = {"operator": [ssh, ssh, dropped, dropped, dropped],  # the last from the router's address: not adminCidr
            "head": [ssh, ssh, dropped, dropped], "node0": [ssh, dropped, dropped]}
    assert {k: list(v.values()) for k, v in seen.items()} == want, seen
    env = {**os.environ, **twin.env, "XC_STATE_DIR": str(tmp_path / "head" / "state"), "XC_SSH_KEY": ""}
    res = subprocess.run([*ns(head), sys.executable, "-c", HEAD_DIALS, twin.env["XC_SSH_KEY"]], env=env,
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout) == {"twin-0": [priv(node0), f"twin-{node0['InstanceId']}"],
                                      "twin-1": [priv(node1), f"twin-{node1['InstanceId']}"]}, res.stdout


def _head_ns(twin) -> str:
    record = json.loads((Path(twin.env["XC_STATE_DIR"]) / "twin" / "twin.json").read_text())
    return f"xct-{record['id']}-{twin.status_ids()['twin-head']}"


def _chain(env: dict, first: str) -> list[tuple[str, str]]:
    """(run id, status) of the chain from `first`, as `fab runs` lists it from the store."""
    listed = fab("runs", env=env, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = dict(re.findall(r"^(\d{8}-\d{6}-\S+)\s+\S+\s+\d+\s+(\S+(?: -> \S+)?)", listed.stdout, re.MULTILINE))
    out, run_id = [], first
    while run_id in rows:
        out.append((run_id, rows[run_id]))
        run_id = rows[run_id].split(" -> ")[1] if " -> " in rows[run_id] else None
    return out


def _steps(twin, run_id: str) -> int:
    return max(progress_steps(twin.fab("logs", run_id, timeout=60).stdout), default=0)


# The user's own project: a Trainer script written as Hugging Face's run_glue.py is (test_script_restarts.GLUE_LIKE),
# preceded by one line that imports the package its requirements.txt names, which the image's venv lacks
IMPORTS = """import os
import {module}
print(f"rank {{os.environ.get('RANK')}} imported {module} {{{module}.__version__}}", flush=True)
"""
USER_ROWS, USER_BATCH, USER_EPOCHS = 1920, 4, 2
USER_STEPS = USER_ROWS // (USER_BATCH * 2) * USER_EPOCHS  # 2 nodes: 480 steps, 2 minutes at TWIN_PACE
# Or Hugging Face's own run_glue.py, unchanged, where the tester has a copy (it is not ours to ship; docs/testing.md):
# its requirements.txt names `evaluate` (the image lacks it), fab downloads it through this machine's pip index, and
# the folder keeps the accuracy metric that `evaluate.load("accuracy")` would fetch from the Hub, as a user offline does
HF_RUN_GLUE = os.environ.get("XC_TEST_HF_RUN_GLUE", "")
HF_EVALUATE = "evaluate==0.4.6"
ACCURACY = '''"""Accuracy, kept in the project: evaluate.load("accuracy") finds ./accuracy/accuracy.py before the Hub."""
import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="the share of predictions equal to their references", citation="",
                                   inputs_description="predictions, references: class ids",
                                   features=datasets.Features({"predictions": datasets.Value("int32"),
                                                               "references": datasets.Value("int32")}))

    def _compute(self, predictions, references):
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / len(references)}
'''


class UserProject:
    """The user's folder outside the checkout (script, requirements.txt, model, data), the script's flags, the pip
    settings fab downloads the wheels with, and how a rank's log shows that the requirement imported there."""

    def __init__(self, tmp_path: Path, small_model: str):
        self.folder = tmp_path / "myproject"
        (self.folder / "data").mkdir(parents=True)
        if HF_RUN_GLUE:
            shutil.copy(HF_RUN_GLUE, self.folder / "run_glue.py")
            (self.folder / "accuracy").mkdir()
            (self.folder / "accuracy" / "accuracy.py").write_text(ACCURACY)
            (self.folder / "requirements.txt").write_text(HF_EVALUATE + "\n")
            self.pip: dict[str, str] = {}  # this machine's own pip configuration, as a user's
            self.imported = r"^\[{rank} \S+\] .*Process rank: 0, device: cpu\S*, .*distributed training: True"
            # with what else the nodes' profile lacks of its dependencies (requests, on the twin's image)
            self.sent = r"^requirements requirements\.txt: \d+ wheel\(s\) .*: evaluate 0\.4\.6\b"
        else:
            links, module = tmp_path / "links", f"xcuser{uuid.uuid4().hex[:6]}"
            wheel(links, module, "1.0")
            (self.folder / "run_glue.py").write_text(IMPORTS.format(module=module) + GLUE_LIKE)
            (self.folder / "requirements.txt").write_text(f"{module}==1.0\n")
            self.pip = pip_env(links)
            self.imported = rf"^\[{{rank}} \S+\] rank {{rank}} imported {module} 1\.0$"
            self.sent = rf"^requirements requirements\.txt: 1 wheel\(s\) .*: {module} 1\.0$"
        shutil.copytree(small_model, self.folder / "model")
        _csv(self.folder / "data" / "train.csv", USER_ROWS)
        _csv(self.folder / "data" / "validation.csv", 16)
        self.flags = ["--model_name_or_path", "model", "--train_file", "data/train.csv", "--validation_file",
                      "data/validation.csv", "--max_seq_length", "64", "--do_train", "--do_eval",
                      "--per_device_train_batch_size", str(USER_BATCH), "--num_train_epochs", str(USER_EPOCHS),
                      "--logging_steps", "5", "--seed", "42", "--report_to", "tensorboard", "--disable_tqdm", "True",
                      "--output_dir", "out"]

    def imported_on(self, rank: int, log: str) -> bool:
        return re.search(self.imported.format(rank=rank), log, re.MULTILINE) is not None


def _keys(twin, bucket: str, prefix: str) -> list[str]:
    pages = twin.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for p in pages for o in p.get("Contents", [])]


def _user_steps(text: str) -> int:
    """Steps a Trainer script's log shows: one loss line every 5 (--logging_steps)."""
    return 5 * text.count("{'loss':")


def test_your_own_project_is_supervised_by_the_head_replaced_and_recovered_with_your_folder_and_runs_gone(
        twin, small_model, tmp_path):
    """From the user's own folder (outside the checkout): a run_glue.py-style script, its model, data and a
    requirements.txt naming a package the image lacks, `fab train --workdir . --detach --max-restarts 2`. The snapshot
    and the wheels go to S3; the supervisor runs on the head (in its namespace, from the product's code shipped under
    its home) and reaches the nodes with the mesh key from SSM; the package imports on every rank. The user edits
    the script and deletes the data; the head is killed mid-run: the group's replacement takes the chain over at
    boot and the run goes on. Then the operator's runs/ deleted and a spot notice on node1: the checkpoint reaches
    S3, the group replaces node1, the head restarts the run there from the snapshot and it ends ok at the full step
    count. A second checkout follows the taken-over run's log through that restart to the end (fab logs -f), lists
    the chain, pulls its outputs and finds TensorBoard event files of both runs of the chain."""
    from cluster import shipping

    before = twin.group_ids("twin-nodes")
    user = UserProject(tmp_path, small_model)
    proj = user.folder
    env = {**twin.env, "MYSECRET": SECRET, **user.pip}
    code = f"{Path.home()}/.xeon-cluster/code/{shipping.code_hash(tops=shipping.HEAD_SHIPPED)}"  # what fab ships
    # the default 30 s heartbeat: the new head takes over once EC2 says the old head's instance is gone, not after
    # the beat's 2 minutes. The secret must outlive its first head
    res = fab_at(proj, "train", "--nodes", "2", "--workdir", ".", "--script", "run_glue.py", "--detach",
                 "--max-restarts", "2", "--save-every", "0", "--env", "XC_NOTICE_POLL_S=0.5", *TWIN_PACE,
                 "--env", "MYSECRET", "--", *user.flags, env=env, timeout=300)
    assert res.returncode == 0 and "detached under its supervisor on the head twin-head" in res.stdout, \
        res.stdout[-3000:] + res.stderr[-3000:]
    assert "this machine may close now" in res.stdout and re.search(user.sent, res.stdout, re.MULTILINE), \
        res.stdout[-3000:]
    first = re.search(r"run (\S+) detached", res.stdout)[1]
    ssm = twin.client("ssm")
    kept = ssm.get_parameter(Name=f"/xeon-cluster/twin/runs/{first}/MYSECRET", WithDecryption=True)["Parameter"]
    assert kept["Type"] == "SecureString" and kept["Value"] == SECRET  # where a replacement head finds it

    def supervisors() -> dict[int, str]:
        """pid -> network namespace of each process supervising the chain, each checked to run the shipped code."""
        found = {}
        for pid in processes_with_env(f"XC_SUPERVISOR={first}"):
            ns = subprocess.run(["ip", "netns", "identify", str(pid)], check=False, capture_output=True, text=True)
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except FileNotFoundError:
                continue  # it ended between the listing and the look: the killed head's
            assert ns.returncode == 0, ns.stderr
            assert cwd == code  # the head's own home, mounted there: not this checkout
            found[pid] = ns.stdout.strip()
        return found

    def logged(run_id: str) -> str:
        return twin.fab("logs", run_id, timeout=60).stdout

    old_head = _head_ns(twin)
    assert set(supervisors().values()) == {old_head}
    wait_until("step 10", lambda: _user_steps(logged(first)) >= 10, 300, poll=2)
    text = logged(first)
    for rank in (0, 1):
        assert user.imported_on(rank, text), text[:3000]
    at_kill = _user_steps(text)
    # the user goes on working in the folder: the script edited, the data deleted
    (proj / "run_glue.py").write_text("raise SystemExit('the edited folder ran, not the snapshot')\n")
    shutil.rmtree(proj / "data")
    # what a node may write (its role: runs/*/output/*), newer than the chain's own: not a chain, and no stop to one
    twin.client("s3").put_object(Bucket=twin.env["XC_STORE"][5:].split("/", 1)[0], Body=b'{"code": "../../../x"}',
                                 Key=f"{twin.env['XC_STORE'][5:].split('/', 1)[1]}/runs/{first}/output/supervisor.json")
    killed = twin.fab("local-kill", "head", timeout=60)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    gone_at = time.monotonic()
    taken = wait_until("a supervisor on the new head", lambda: {p: ns for p, ns in supervisors().items()
                                                                 if ns and ns != old_head}, 180)
    took_s = time.monotonic() - gone_at
    assert len(taken) == 1 and not [ns for ns in supervisors().values() if ns == old_head], supervisors()
    new_head = _head_ns(twin)
    assert set(taken.values()) == {new_head}
    assert processes_with_env(f"XC_RUN_ID={first}")  # its ranks never stopped: node 0's wrapper holds them
    print(f"head killed -> its replacement supervises the chain: {took_s:.1f}s (default heartbeat, 30 s)")
    assert took_s < 90, took_s  # the stale wait alone would be 120 s
    stored = _user_steps(logged(first))  # what the store has of its log now
    shutil.rmtree(twin.env["XC_RUNS_DIR"], ignore_errors=True)  # nothing of the run is kept on this machine
    node1 = twin.status_ids()["twin-1"]
    # from a second checkout (nothing of this one's state or runs), pointed at the twin by the printed line; it
    # follows the taken-over run's log from the store, through the restart below, to the chain's end
    elsewhere = {**twin.env, "XC_STATE_DIR": str(tmp_path / "state"), "XC_RUNS_DIR": str(tmp_path / "runs")}
    with FabProcess("logs", first, "-f", env=elsewhere, merge=True) as follow:
        # the taken-over run's own progress, live: later steps than the store had reach it only from the new head
        follow.wait_for(lambda line: _user_steps(follow.stdout) > stored, 120)
        assert _chain(elsewhere, first) == [(first, "running")]  # shown while it goes on, not at its end
        # 30 s to checkpoint into S3 before EC2 takes node1 (AWS gives 120): at 5 s a loaded machine lost the race
        said = twin.fab("local-notice", "node1", "--kind", "spot", "--after", "30", timeout=60)
        assert said.returncode == 0 and node1 in said.stdout, said.stdout + said.stderr
        after = twin.wait_replaced(node1, timeout=150)  # EC2 took it, the group launched another, which booted
        assert node1 in before and len(after - before) == 1
        followed = follow.finish(600)
    chain = _chain(elsewhere, first)
    assert [s.split(" -> ")[0] for _, s in chain] == ["preempted", "ok"], (chain, followed.stdout[-3000:])
    resumed = chain[-1][0]
    lines = followed.stdout.strip().splitlines()
    assert followed.returncode == 0 and f"run {first} preempted; resumed as run {resumed}" in lines, lines[-30:]
    assert lines[-1].startswith(f"run {resumed} finished in "), lines[-30:]
    assert "the edited folder ran" not in followed.stdout
    bucket, prefix = twin.env["XC_STORE"][5:].split("/", 1)
    summary = json.loads(twin.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/runs/{first}/summary.json")[
        "Body"].read())
    step = summary["preempted"]["step"]
    assert step > at_kill, (summary["preempted"], at_kill)  # it trained on under the new head
    keys = [o["Key"] for o in twin.client("s3").list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/runs/{first}/")
            .get("Contents", [])]
    assert f"{prefix}/runs/{first}/checkpoints/checkpoint-{step}/xc-complete" in keys, keys  # durable in S3
    log = fab("logs", resumed, env=elsewhere, timeout=60).stdout
    assert f"global step {step}" in log, log[-3000:]  # the Trainer continued from the notice's checkpoint
    assert user.imported_on(1, log), log[-3000:]  # the replacement node1 got the package from the store
    pulled = fab("pull", resumed, env=elsewhere, timeout=120)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    out = tmp_path / "runs" / resumed / "output"
    for name in ("all_results.json", "model.safetensors", "trainer_state.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == USER_STEPS
    stored = {run: [k for k in _keys(twin, bucket, f"{prefix}/runs/{run}/output/") if "tfevents" in k]
              for run in (first, resumed)}
    assert all(stored.values()), stored  # each run's rank 0 sent its event files to S3
    board = fab("tensorboard", resumed, "--no-serve", env={**elsewhere, "HOME": str(tmp_path / "home")}, timeout=120)
    count = len(stored[first]) + len(stored[resumed])
    assert board.returncode == 0 and f"{count} event file(s) from 2 runs: {first} -> {resumed}" in board.stdout, \
        (board.stdout + board.stderr, stored)
    wait_until("the supervisor's exit", lambda: not processes_with_env(f"XC_SUPERVISOR={first}"), 60)
    assert not processes_with_env(f"XC_RUN_ID={first}") and not processes_with_env(f"XC_RUN_ID={resumed}")
    # the replacement head restarted the run with the secret from SSM, and deleted it when the chain ended
    left = ssm.describe_parameters(ParameterFilters=[{"Key": "Path", "Option": "Recursive",
                                                      "Values": [f"/xeon-cluster/twin/runs/{first}"]}])["Parameters"]
    assert left == [], left
    assert SECRET not in json.dumps(summary)
    doctor = twin.fab("doctor", "--quick", timeout=300)  # the keys are in place since the run
    assert doctor.returncode == 0 and "verdict: healthy" in doctor.stdout, doctor.stdout[-3000:] + doctor.stderr
    assert re.search(r"^\s*instance role\s+ok\s+twin-head$", doctor.stdout, re.MULTILINE), doctor.stdout[-3000:]


def test_rebalance_checkpoints_and_goes_on_then_the_groups_termination_ends_it_75(twin, small_model):
    """A rebalance recommendation: a checkpoint while training goes on. Then the group's own termination, held
    by its lifecycle hook: exit 75 with its cause; the node completes its lifecycle action once the checkpoint is
    in the store, and the group takes it then, long before the hook's 120 s here."""
    # 240 steps at TWIN_PACE, a minute (40 unpaced ended before the termination notice reached them); the notice ends
    # the run, so the steps after it cost nothing
    args = ["train", "--nodes", "2", "--save-every", "0", "--env", "XC_NOTICE_POLL_S=0.5", *TWIN_PACE, "--",
            *short_args(small_model, samples=1920)]
    with twin.start(*args) as running:
        running.wait_for(lambda line: (progress_step(line) or 0) >= 6, 400)
        said = twin.fab("local-notice", "node1", "--kind", "rebalance", timeout=60)
        assert said.returncode == 0 and "rebalance recommendation" in said.stdout, said.stdout + said.stderr
        line = running.wait_for("[rebalance]", 120)
        assert "checkpoint now, training goes on" in line
        step = int(re.search(r"step=(\d+)", line)[1])
        running.wait_for(lambda line: (progress_step(line) or 0) > step + 2, 200)  # it goes on
        said = twin.fab("local-notice", "node1", "--kind", "terminate", "--after", "120", timeout=60)
        assert said.returncode == 0, said.stdout + said.stderr
        node1 = re.search(r"\((i-[0-9a-f]+)\)", said.stdout)[1]
        noticed = time.monotonic()
        ended = running.finish(400)
    assert ended.returncode == 75, ended.stdout[-3000:] + ended.stderr[-3000:]
    run_id = re.search(r"run (\S+): results in", ended.stdout)[1]
    summary = twin.fab("runs", timeout=60).stdout
    assert run_id in summary
    record = json.loads((Path(twin.env["XC_RUNS_DIR"]) / run_id / "summary.json").read_text())
    assert record["status"] == "preempted" and record.get("cause") == "group termination", record
    twin.wait_replaced(node1, timeout=90)
    assert time.monotonic() - noticed < 120  # the completed lifecycle action let it go before the heartbeat


def test_a_detached_run_is_followed_and_stopped_through_the_twin(twin, small_model):
    # stopped once its log shows progress: 240 steps, so that it cannot end first on an idle machine (free: it stops)
    res = fab("train", "--nodes", "2", "--detach", *TWIN_PACE, "--env", "MYSECRET", "--",
              *short_args(small_model, samples=1920), env={**twin.env, "MYSECRET": SECRET}, timeout=300)
    assert res.returncode == 0 and "detached" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
    run_id = re.search(r"run (\S+) detached", res.stdout)[1]
    ssm, kept = twin.client("ssm"), f"/xeon-cluster/twin/runs/{run_id}/MYSECRET"
    assert ssm.get_parameter(Name=kept)["Parameter"]["Type"] == "SecureString"  # supervised on the head
    deadline = time.monotonic() + 120
    while "[progress]" not in (logs := twin.fab("logs", run_id, timeout=60)).stdout:
        assert time.monotonic() < deadline, logs.stdout[-2000:] + logs.stderr
        time.sleep(2)
    stopped = twin.fab("stop", run_id, timeout=120)
    assert stopped.returncode == 0 and "nothing is left running" in stopped.stdout, stopped.stdout + stopped.stderr
    assert re.search(rf"^{run_id}\s.*stopped", twin.fab("runs", timeout=60).stdout, re.MULTILINE)
    # its supervisor ended by SIGTERM deleted nothing: fab stop took the secret out of SSM
    assert not ssm.describe_parameters(ParameterFilters=[{"Key": "Name", "Values": [kept]}])["Parameters"]


def test_kill_without_notice_the_group_replaces_the_instance(twin):
    old = twin.status_ids()["twin-1"]
    said = twin.fab("local-kill", "node1", timeout=60)
    assert said.returncode == 0 and "terminated with no notice" in said.stdout, said.stdout + said.stderr
    assert old in said.stdout
    twin.wait_replaced(old)
    head = twin.status_ids()["twin-head"]
    said = twin.fab("local-kill", "head", timeout=60)
    assert said.returncode == 0 and head in said.stdout, said.stdout + said.stderr
    deadline = time.monotonic() + 60
    while twin.group_ids("twin-head") in (set(), {head}) or twin.status_ids().get("twin-head") in (None, head):
        assert time.monotonic() < deadline, "the head's group did not replace the head"
        time.sleep(1)


def test_bad_input_is_one_line_and_starts_nothing(twin, tmp_path):
    for args, want in ((["local-notice", "node7"], "no twin instance 'node7'"),
                       (["local-notice", "node1", "--kind", "storm"], "--kind 'storm' is not a notice"),
                       (["local-notice", "node1", "--after", "soon"], "--after 'soon' is not a number")):
        res = twin.fab(*args, timeout=60)
        assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and want in res.stderr, res.stderr
    assert not list((Path(twin.env["XC_STATE_DIR"]) / "twin" / "actions").glob("*.json"))
    none = fab("local-notice", "node1", env={"XC_STATE_DIR": str(tmp_path), "XC_CLUSTER": ""}, timeout=60)
    assert none.returncode != 0 and "no AWS twin and no local cluster is up" in none.stderr
    assert "fab local-up --aws" in none.stderr


def test_sweep_removes_everything_of_the_twins_cluster_but_the_kept_store(twin):
    """Last: it takes the cluster away, as after a 'pulumi destroy' that left things behind; the mesh key that the
    head's runs put in SSM (the rehearsal above) goes too."""
    def mesh() -> list[str]:
        found = twin.client("ssm").describe_parameters(ParameterFilters=[{"Key": "Path", "Option": "Recursive",
                                                                           "Values": ["/xeon-cluster/twin"]}])
        return [p["Name"] for p in found["Parameters"]]

    had = mesh()
    print(f"SSM parameters of cluster twin before the sweep: {had}")
    res = twin.fab("sweep", "--cluster", "aws:twin", "--yes", timeout=300)
    assert "nothing left of cluster twin" in res.stdout and "but its store" in res.stdout, res.stdout + res.stderr
    assert not twin.group_ids("twin-nodes") and not twin.group_ids("twin-head")
    assert all(f"deleted ssm parameter {name}" in res.stdout for name in had) and not mesh(), (had, res.stdout)
    deadline = time.monotonic() + 30
    while list((Path(twin.env["XC_STATE_DIR"]) / "twin" / "instances").glob("*/boot.json")):
        assert time.monotonic() < deadline, "the watcher kept namespaces of terminated instances"
        time.sleep(0.5)
