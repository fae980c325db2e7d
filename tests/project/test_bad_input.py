"""Bad input, tried by the dozen: every task refuses it with one line naming the fix, before anything starts.

Each case is a `fab` call: a real `fab` process for every case that needs a cluster or an environment of
its own, and for the first case of each task (the CLI wiring, end to end); the CLI run in-process for the rest
(the tasks' own flag rules). It must exit 1 with exactly one 'error:' line (the last), of the form
'error: <what>; <fix>', no traceback, no new run folder, and no process of any run alive. Cases without a
cluster get an empty state folder of their own (and must not start an sshd in it); cases that need one
share the session's 2-node local cluster.
"""
from __future__ import annotations

import importlib.util
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, fab, fab_in_process, processes_with_cmdline, ranks_on


@dataclass
class Case:
    id: str
    command: str  # fab's argv as shell words; {d} is the data folder, {state} the cluster's state folder
    message: str  # in the error line
    cluster: bool = False
    env: dict = field(default_factory=dict)
    prepare: str | None = None  # a function below that plants the fault and returns its undo


def T(id, command, message, **kw):  # a table row
    return Case(id, command, message, **kw)


def C(id, command, message, **kw):
    return Case(id, command, message, cluster=True, **kw)


CASES = [
    # ---- fab train: its flags ------------------------------------------------------------------------
    T("train-timeout-word", "train --timeout abc", "--timeout 'abc' is not a whole number; pass a whole number"),
    T("train-timeout-zero", "train --timeout 0", "--timeout 0 is below 1"),
    T("train-timeout-negative", "train --timeout -5", "--timeout -5 is below 1"),
    T("train-nodes-word", "train --nodes abc", "--nodes 'abc' is not a whole number"),
    T("train-nodes-zero", "train --nodes 0", "--nodes 0 is below 1"),
    T("train-nodes-no-value", "train --nodes", "--nodes needs a value; see 'fab --help train'"),
    T("train-unknown-flag", "train --bogus", "'--bogus' is not a flag of 'fab train'"),
    T("train-job", "train --job nope", "--job 'nope' is not a bundled job"),
    T("train-script-missing", "train --script /nonexistent.py", "--script /nonexistent.py does not exist"),
    T("train-job-and-script", "train --job qa --script {d}/hello.py", "exclude each other"),
    T("train-backend", "train --backend nccl", "--backend 'nccl' is not one of"),
    T("train-precision", "train --precision fp16", "--precision 'fp16' is not one of"),
    T("train-comm-hook", "train --comm-hook int8", "--comm-hook 'int8' is not one of auto, none, bf16, fp16; pass one of them"),
    T("train-ppn-word", "train --ppn abc", "--ppn 'abc' is not a number"),
    T("train-ppn-zero", "train --ppn 0", "--ppn 0 must be at least 1"),
    T("train-threads-negative", "train --threads -2", "--threads -2 must be at least 1"),
    T("train-master-port-high", "train --master-port 99999", "--master-port 99999 is above 65535; pass 1024..65535"),
    T("train-master-port-privileged", "train --master-port 22", "--master-port 22 is below 1024"),
    T("train-master-port-word", "train --master-port abc", "--master-port 'abc' is not a whole number"),
    T("train-save-every", "train --save-every abc", "--save-every: save_every 'abc' is neither"),
    T("train-save-every-negative", "train --save-every -5", "--save-every: save_every '-5' is neither"),
    T("train-notice-poll-word", "train --env XC_NOTICE_POLL_S=often",
      "--env XC_NOTICE_POLL_S='often' is not a number of seconds; pass seconds between 0.1 and 60"),
    T("train-notice-poll-zero", "train --env XC_NOTICE_POLL_S=0", "--env XC_NOTICE_POLL_S=0 is outside 0.1..60 seconds"),
    T("train-pace-word", "train --env XC_PACE_S=slow",
      "--env XC_PACE_S='slow' is not a number of seconds; pass seconds between 0 and 60"),
    T("train-pace-negative", "train --env XC_PACE_S=-1", "--env XC_PACE_S=-1 is outside 0..60 seconds"),
    T("train-max-restarts", "train --max-restarts -1", "--max-restarts -1 is below 0"),
    T("train-restart-wait", "train --restart-wait soon", "--restart-wait 'soon' is not a whole number"),
    T("train-min-nodes-zero", "train --min-nodes 0 --max-restarts 1", "--min-nodes 0 is below 1; pass 1 or more"),
    T("train-min-nodes-above", "train --nodes 2 --min-nodes 3 --max-restarts 1", "--min-nodes 3 is above --nodes 2; "
      "pass --min-nodes from 1 to 2"),
    T("train-min-nodes-alone", "train --min-nodes 1", "--min-nodes 1 applies when a run restarts by itself; pass "
      "--max-restarts K too"),
    T("train-env-unset", "train --env XC_SURELY_UNSET_VAR",
      "--env XC_SURELY_UNSET_VAR passes your own value of XC_SURELY_UNSET_VAR, which is not set"),
    T("train-env-no-key", "train --env =x", "--env '=x' is not KEY=VALUE or KEY"),
    T("train-env-bad-name", "train --env 1A=x", "--env '1A=x' is not KEY=VALUE or KEY"),
    T("train-resume-unknown", "train --resume nope", "--resume nope: no readable"),
    T("train-resume-with-job", "train --resume nope --job qa", "--resume nope runs that run's own job and flags"),
    T("train-runs-dir-unwritable", "train --script {d}/hello.py",
      "the runs folder /proc/xc-runs is not a writable folder (", env={"XC_RUNS_DIR": "/proc/xc-runs"}),
    # ---- fab train: your own project (--workdir, --module, --launcher) --------------------------------
    T("workdir-missing", "train --workdir /nonexistent --script train.py", "--workdir /nonexistent does not exist; "
      "pass the folder of your project"),
    T("workdir-a-file", "train --workdir {d}/hello.py --script hello.py", "--workdir {d}/hello.py is not a folder"),
    T("workdir-without-entry", "train --workdir {d}/proj", "--workdir is for your own code, not a bundled job; pass "
      "--script FILE or --module NAME"),
    T("workdir-with-job", "train --job qa --workdir {d}/proj", "--workdir is for your own code"),
    T("workdir-script-outside", "train --workdir {d}/proj --script ../hello.py", "--script ../hello.py is outside "
      "--workdir {d}/proj; pass a path relative to it"),
    T("workdir-script-missing", "train --workdir {d}/proj --script nope.py", "--script nope.py does not exist in "
      "--workdir {d}/proj"),
    T("workdir-script-ignored", "train --workdir {d}/proj --script ignored.py", "--script ignored.py is in --workdir "
      "{d}/proj but .gitignore leaves it out"),
    T("workdir-too-big", "train --workdir {d}/proj-big --script train.py", "--workdir {d}/proj-big holds 1.5 MiB in 2 "
      "file(s) (limit 1 MiB, largest: blob.txt 1.5 MiB, train.py 0 KiB); add large files to .gitignore or raise the "
      "limit with XC_WORKDIR_LIMIT_MB=2", env={"XC_WORKDIR_LIMIT_MB": "1"}),
    T("workdir-limit-word", "train --workdir {d}/proj --script train.py", "XC_WORKDIR_LIMIT_MB='lots' is not a "
      "positive whole number of MiB", env={"XC_WORKDIR_LIMIT_MB": "lots"}),
    T("module-without-workdir", "train --module pkg.main", "--module pkg.main runs a module of your project; pass its "
      "folder with --workdir DIR"),
    T("module-bad-name", "train --workdir {d}/proj --module pkg/main.py", "--module 'pkg/main.py' is not a dotted "
      "module name"),
    T("module-missing", "train --workdir {d}/proj --module pkg.nope", "--module pkg.nope: neither pkg/nope.py nor "
      "pkg/nope/__main__.py is among the files --workdir {d}/proj ships"),
    T("module-and-script", "train --module pkg.main --script {d}/hello.py", "--module pkg.main and --script "
      "{d}/hello.py exclude each other"),
    T("module-and-job", "train --job qa --module pkg.main", "--module pkg.main and --job qa exclude each other"),
    T("launcher-unknown", "train --launcher torchrun --script {d}/hello.py", "--launcher 'torchrun' is not one of "
      "python, accelerate"),
    T("launcher-bundled", "train --launcher accelerate", "--launcher accelerate is for your own code"),
    T("resume-with-workdir", "train --resume nope --workdir {d}/proj", "--resume nope runs that run's own job"),
    # ---- fab train: the cluster it names -------------------------------------------------------------
    T("no-local-cluster", "train", "no local cluster is running; start one with 'fab local-up --nodes 2'"),
    T("corrupt-state", "train --script {d}/hello.py", "the local cluster's state file {state}/state.json is "
      "corrupt; run 'fab local-down'", prepare="corrupt_state"),
    T("cluster-unknown", "train --cluster nope", "--cluster 'nope' is not a known source"),
    T("hosts-missing", "train --cluster hosts:/nonexistent", "hosts file '/nonexistent' does not exist"),
    T("hosts-quote", "train --cluster hosts:{d}/hosts-quote", "No closing quotation in"),
    T("hosts-port-range", "train --cluster hosts:{d}/hosts-port", "port=99999 is not a TCP port; use 1..65535"),
    T("hosts-port-word", "train --cluster hosts:{d}/hosts-port-word", "port='ssh' is not a number"),
    T("hosts-same-machine", "train --cluster hosts:{d}/hosts-same", "node0 and node1 are the same machine"),
    T("hosts-same-name", "train --cluster hosts:{d}/hosts-dupe", "node name(s) node0 appear more than once"),
    T("hosts-unknown-field", "train --cluster hosts:{d}/hosts-field", "unknown field 'gpu=1'"),
    T("hosts-one-field", "train --cluster hosts:{d}/hosts-short", "expected 'name address [key=value...]'"),
    T("hosts-unreachable", "train --nodes 1 --cluster hosts:{d}/hosts-down", "node0 (127.0.0.1:9) is unreachable"),
    # ---- job flags after `--` and the data files they name -------------------------------------------
    T("job-max-seq-length", "train -- --max_seq_length -5", "--max_seq_length -5 is out of range; pass a whole "
      "number at least 1"),
    T("job-epochs-word", "train -- --num_train_epochs many", "--num_train_epochs 'many' is not a number"),
    T("job-learning-rate-zero", "train -- --learning_rate=0", "--learning_rate 0 is out of range"),
    T("job-batch-zero", "train -- --per_device_train_batch_size 0", "--per_device_train_batch_size 0 is out"),
    T("job-number-no-value", "train -- --max_seq_length", "--max_seq_length needs a value"),
    T("job-model-id", "train -- --model_name_or_path 'not a model'", "--model_name_or_path 'not a model' is "
      "neither a hub id"),
    T("job-output-dir-empty", "train -- --output_dir=", "--output_dir needs a value"),
    T("data-missing", "train -- --train_file /nonexistent/train.csv", "--train_file /nonexistent/train.csv does "
      "not exist"),
    T("data-no-path", "train -- --train_file", "--train_file needs a file path"),
    T("data-test-file", "train --job qa -- --test_file {d}/qa-noqs.json", "--test_file is not a flag of the qa job"),
    T("glue-test-columns", "train -- --train_file {d}/glue-train.csv --test_file {d}/glue-single.csv",
      "--test_file {d}/glue-single.csv has text columns sentence but --train_file"),
    T("glue-empty-csv", "train -- --train_file {d}/glue-empty.csv", "glue-empty.csv has no rows"),
    T("glue-no-label", "train -- --train_file {d}/glue-nolabel.csv", "glue-nolabel.csv has no 'label' column "
      "(columns: sentence1, sentence2, score)"),
    T("glue-no-text", "train -- --train_file {d}/glue-onlylabel.csv", "has no text column besides label/idx"),
    T("glue-word-labels", "train -- --train_file {d}/glue-words.csv", "line 2: label 'yes' is not a number"),
    T("glue-empty-text", "train -- --train_file {d}/glue-emptytext.csv", "line 3: 'sentence2' is empty"),
    T("glue-extra-field", "train -- --train_file {d}/glue-extra.csv", "line 2 has more fields than the header"),
    T("glue-unseen-label", "train -- --train_file {d}/glue-train.csv --validation_file {d}/glue-val3.csv",
      "has label(s) 3 that --train_file"),
    T("glue-columns-differ", "train -- --train_file {d}/glue-train.csv --validation_file {d}/glue-single.csv",
      "has columns sentence, label but --train_file"),
    T("glue-suffix", "train -- --train_file {d}/clm.txt", "the glue job reads .csv or .json or .jsonl files"),
    T("glue-jsonl-line", "train -- --train_file {d}/glue-bad.jsonl", "glue-bad.jsonl line 2 is not JSON"),
    T("qa-not-json", "train --job qa -- --train_file {d}/qa-notjson.json", "qa-notjson.json is not valid JSON"),
    T("qa-no-data", "train --job qa -- --train_file {d}/qa-nodata.json", "has no 'data' list of articles"),
    T("qa-no-question", "train --job qa -- --train_file {d}/qa-noquestion.json",
      "data[0].paragraphs[0].qas[0] has no 'question' text"),
    T("qa-answer-outside", "train --job qa -- --train_file {d}/qa-outside.json",
      "answer_start 999 puts 'Ada' outside its context"),
    T("qa-answer-start-word", "train --job qa -- --validation_file {d}/qa-startword.json",
      "answer_start 'x' is not a character offset"),
    T("qa-no-questions", "train --job qa -- --train_file {d}/qa-noqs.json", "qa-noqs.json has no questions"),
    T("clm-empty", "train --job clm -- --train_file {d}/clm-empty.txt", "clm-empty.txt has no text"),
    T("clm-no-text-field", "train --job clm -- --train_file {d}/clm-notext.jsonl", "line 1 has no 'text' field"),
    T("clm-binary", "train --job clm -- --train_file {d}/clm-binary.txt", "clm-binary.txt is not UTF-8 text"),
    T("clm-suffix", "train --job clm -- --train_file {d}/glue-train.csv", "the clm job reads .txt or .json"),
    # ---- fab bench ----------------------------------------------------------------------------------
    T("bench-no-nodes", "bench --job clm", "--nodes is missing; give the sizes to compare"),
    T("bench-sizes-word", "bench --nodes 1,x", "--nodes '1,x': 'x' is not a node count"),
    T("bench-sizes-zero", "bench --nodes 0,2", "--nodes '0,2': 0 is below 1"),
    T("bench-comm-hook", "bench --nodes 1,2 --comm-hook fp8", "--comm-hook 'fp8' is not one of auto, none, bf16, fp16"),
    T("bench-one-run", "bench --runs a", "--runs 'a' names fewer than two runs; give at least two"),
    T("bench-unknown-runs", "bench --runs nope1,nope2", "--runs: no run nope1, nope2"),
    T("bench-runs-and-nodes", "bench --runs a,b --nodes 1,2", "--runs and --nodes exclude each other"),
    T("bench-job", "bench --nodes 1,2 --job nope", "--job 'nope' is not a bundled job"),
    T("bench-ppn", "bench --nodes 1,2 --ppn abc", "--ppn 'abc' is not a number"),
    T("bench-data", "bench --nodes 1,2 --job qa -- --train_file {d}/qa-notjson.json", "is not valid JSON"),
    T("bench-job-flag", "bench --nodes 1,2 -- --max_seq_length -5", "--max_seq_length -5 is out of range"),
    # ---- fab doctor, setup, keys, stop ---------------------------------------------------------------
    T("doctor-master-port-word", "doctor --master-port abc", "--master-port 'abc' is not a whole number"),
    T("doctor-master-port-low", "doctor --master-port 80", "--master-port 80 is below 1024"),
    T("doctor-nodes-zero", "doctor --nodes 0", "--nodes 0 is below 1"),
    T("doctor-backend", "doctor --backend nccl", "--backend 'nccl' is not one of auto, ccl, gloo"),
    T("doctor-quick-full", "doctor --quick --full", "--quick and --full exclude each other"),
    T("doctor-env", "doctor --env 'A B=1'", "--env 'A B=1' is not KEY=VALUE or KEY"),
    T("doctor-profile", "doctor --profile nope", "unknown profile 'nope'"),
    T("doctor-corrupt-state", "doctor", "state.json is corrupt", prepare="corrupt_state"),
    T("setup-profile", "setup --profile nope", "unknown profile 'nope'"),
    T("setup-nodes-word", "setup --nodes x", "--nodes 'x' is not a whole number"),
    T("setup-no-cluster", "setup", "no local cluster is running"),
    T("keys-cluster", "keys --cluster nope", "--cluster 'nope' is not a known source"),
    T("keys-hosts-no-path", "keys --cluster hosts:", "--cluster hosts needs a file; use --cluster hosts:PATH"),
    T("keys-unknown-flag", "keys --nodes 2", "'--nodes' is not a flag of 'fab keys'"),
    T("stop-no-run", "stop", "'stop' did not receive required positional arguments: 'run'"),
    T("stop-path", "stop ../../etc", "'../../etc' is not a run id"),
    # ---- the local cluster's tasks -------------------------------------------------------------------
    T("local-up-nodes-word", "local-up --nodes abc", "--nodes 'abc' is not a whole number; pass 1..64"),
    T("local-up-port-word", "local-up --port abc", "--port 'abc' is not a whole number; pass 1024..65535"),
    T("local-up-port-privileged", "local-up --port 22", "--port 22 is below 1024; pass 1024..65535"),
    T("local-up-port-high", "local-up --port 99999", "--port 99999 is above 65535"),
    T("local-up-nodes-many", "local-up --nodes 65", "--nodes 65 is above 64"),
    T("local-up-corrupt-state", "local-up --nodes 2", "state.json is corrupt", prepare="corrupt_state"),
    T("local-up-state-unwritable", "local-up --nodes 1", "the local cluster's state folder /proc/xc-state/local is "
      "not a writable folder (", env={"XC_STATE_DIR": "/proc/xc-state"}),
    T("keys-state-unwritable", "keys --cluster hosts:{d}/hosts-down", "the state folder of cluster 'hosts:",
      env={"XC_STATE_DIR": "/proc/xc-state"}),
    T("local-up-link-word", "local-up --netns --link fast", "--link 'fast' is not a rate like 3gbit or 500mbit; pass"),
    T("local-up-link-zero", "local-up --netns --link 0gbit", "--link '0gbit' is not a rate like 3gbit"),
    T("local-up-latency-word", "local-up --netns --link 1gbit --latency soon", "--latency 'soon' is not a delay like "
      "50us or 1ms; pass a number with us, ms or s"),
    T("local-up-link-without-netns", "local-up --link 1gbit", "--link and --latency shape the links of a network "
      "twin; add --netns"),
    T("local-link-no-cluster", "local-link --node node1 --cut", "no local cluster is running; start one with"),
    T("local-link-nothing", "local-link --node node1", "nothing to change on node1's link; pass --cut, --restore"),
    T("local-link-cut-and-restore", "local-link --node node1 --cut --restore", "--cut and --restore exclude each "
      "other"),
    T("local-link-latency-word", "local-link --node node1 --latency 5min", "--latency '5min' is not a delay like"),
    T("local-kill-no-node", "local-kill", "'local-kill' did not receive required positional arguments: 'node'"),
    T("local-kill-no-cluster", "local-kill --node node1", "no local cluster is running"),
    T("local-down-argument", "local-down node1", "'fab local-down' takes no argument 'node1'"),
    T("local-down-flag", "local-down --nodes 2", "'--nodes' is not a flag of 'fab local-down'"),
    T("no-such-task", "trian --nodes 2", "no task or flag 'trian'; see 'fab -l'"),
    T("demo-nodes-word", "demo --nodes two", "--nodes 'two' is not a whole number"),
    T("demo-port-privileged", "demo --port 80", "--port 80 is below 1024"),
    T("demo-runs-dir-unwritable", "demo", "the runs folder /proc/xc-runs is not a writable folder",
      env={"XC_RUNS_DIR": "/proc/xc-runs"}),
    # ---- fab kube -----------------------------------------------------------------------------------
    T("kube-nodes-word", "kube --nodes x", "--nodes 'x' is not a whole number"),
    T("kube-nodes-zero", "kube --nodes 0", "--nodes 0 is below 1"),
    T("kube-job", "kube --job nope", "--job 'nope' is not a bundled job"),
    T("kube-instance-type", "kube --instance-type t2.nano", "--instance-type 't2.nano' is not in the catalog"),
    T("kube-profile", "kube --profile nope", "unknown profile 'nope'"),
    T("kube-out-unwritable", "kube --out /proc/xc-kube", "--out /proc/xc-kube is not a writable folder ("),
    T("kube-output-dir", "kube -- --output_dir /tmp/x", "--output_dir is set by fab kube"),
    T("kube-namespace", "kube --namespace 'Team A'", "--namespace 'Team A' is not a Kubernetes namespace"),
    T("kube-pvc", "kube --pvc Big_Disk", "--pvc 'Big_Disk' is not a PersistentVolumeClaim name"),
    T("kube-image", "kube --image 'my image'", "--image 'my image' is not an image reference"),
    T("kube-job-flag", "kube --job qa -- --doc_stride 0", "--doc_stride 0 is out of range"),
    # ---- on a running cluster: what only the nodes can tell ------------------------------------------
    C("cluster-too-few-nodes", "train --nodes 3", "--nodes 3 but the cluster 'local' has 2 nodes; run 'fab "
      "local-up --nodes 3' or lower --nodes"),
    C("cluster-ppn", "train --ppn 99 --script {d}/hello.py", "--ppn 99 is more ranks than the "),
    C("cluster-threads", "train --threads 100000000 --script {d}/hello.py", "--threads 100000000 x --ppn 1 is "
      "more than the "),
    C("cluster-ccl-missing", "train --backend ccl", "--backend ccl but oneccl_bindings_for_pytorch is missing on "
      "node0, node1"),
    C("cluster-model-path", "train -- --model_name_or_path /nonexistent/model", "--model_name_or_path "
      "/nonexistent/model does not exist on node0, node1"),
    C("cluster-output-dir", "train -- --output_dir /proc/xc-out", "--output_dir /proc/xc-out cannot be created or "
      "written on node0"),
    C("cluster-host-key-changed", "train --script {d}/hello.py", "host key CHANGED since it was recorded in "
      "{state}/known_hosts; if the node was replaced, remove its old entry with 'ssh-keygen -f {state}/known_hosts "
      '-R "[127.0.0.2]:', prepare="changed_host_key"),
    C("cluster-min-nodes-above", "train --min-nodes 3 --max-restarts 1", "--min-nodes 3 is above the run's 2 "
      "node(s); pass --min-nodes from 1 to 2"),
    C("cluster-bench-sizes", "bench --nodes 1,3", "3 is more than the 2 node(s) of cluster 'local'"),
    C("cluster-doctor-nodes", "doctor --nodes 3", "--nodes 3 but the cluster 'local' has 2 nodes"),
    C("cluster-setup-nodes", "setup --nodes 3", "--nodes 3 but the cluster 'local' has 2 nodes"),
    C("cluster-stop-unknown-run", "stop 20990101-000000-glue-0000", "no run 20990101-000000-glue-0000: no folder"),
    C("cluster-local-kill-node", "local-kill --node node9", "no local node 'node9'; the nodes are node0, node1"),
    C("cluster-local-up-other-size", "local-up --nodes 3", "a local cluster with 2 nodes is already up"),
    C("cluster-local-link-plain", "local-link --node node1 --cut", "the local cluster was started without --netns, so "
      "its nodes have no links"),
]


def _ccl_on_nodes() -> bool:
    return importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None  # local nodes run this python


def _subprocess_ids() -> set[str]:
    """The cases that run as a real `fab` process, proving the CLI wiring end to end: every case that needs a
    cluster, and the first of each task's own. The rest check the tasks' own flag rules in-process."""
    first: dict[str, str] = {}
    for case in CASES:
        first.setdefault(shlex.split(case.command)[0], case.id)
    # a case with an environment of its own too: some settings are read once, when their module is imported
    return set(first.values()) | {c.id for c in CASES if c.cluster or c.env}


SUBPROCESS = _subprocess_ids()


def _params():
    for case in CASES:
        marks = [pytest.mark.cluster] if case.cluster else []
        if case.id == "cluster-ccl-missing" and _ccl_on_nodes():
            marks.append(pytest.mark.skip(reason="oneccl_bindings_for_pytorch is installed here"))
        yield pytest.param(case, id=case.id, marks=marks)


# ---- the faults some cases plant --------------------------------------------------------------------

def corrupt_state(state: Path):
    state.mkdir(parents=True, exist_ok=True)
    (state / "state.json").write_text('{"port": 1, "nodes": [{"pid": ')  # half written


def changed_host_key(state: Path):
    """node0's entry in the operator's known_hosts for this cluster now holds node1's key."""
    known = state / "known_hosts"
    before = known.read_text()
    other = (state / "nodes" / "node1" / "ssh_host_ed25519_key.pub").read_text().split()
    lines = [line if not line.startswith("[127.0.0.2]:") else f"{line.split()[0]} {other[0]} {other[1]}"
             for line in before.splitlines()]
    known.write_text("\n".join(lines) + "\n")
    return lambda: known.write_text(before)


# ---- the data files and hosts files the cases name ---------------------------------------------------

SQUAD_OK = {"context": "Ada Lovelace wrote the first program.", "qas": [
    {"id": "q1", "question": "Who wrote the first program?", "answers": [{"text": "Ada", "answer_start": 0}]}]}


def _squad(paragraph: dict) -> str:
    return json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": [paragraph]}]})


FILES = {
    "hello.py": "print('hello')\n",
    "proj/train.py": "print('train')\n",
    "proj/pkg/__init__.py": "",
    "proj/pkg/main.py": "print('main')\n",
    "proj/ignored.py": "",
    "proj/.gitignore": "ignored.py\n",
    "proj-big/train.py": "",
    "proj-big/blob.txt": "x" * (3 << 19),  # 1.5 MiB
    "glue-empty.csv": "",
    "glue-nolabel.csv": "sentence1,sentence2,score\nA cat.,A cat sat.,1\n",
    "glue-onlylabel.csv": "label,idx\n1,0\n",
    "glue-words.csv": "sentence1,sentence2,label\nStocks fell.,Stocks rose.,yes\n",
    "glue-emptytext.csv": "sentence1,sentence2,label\nA cat.,A cat sat.,1\nStocks fell.,,0\n",
    "glue-extra.csv": "sentence1,sentence2,label\nA cat, black,A cat sat.,1\n",
    "glue-train.csv": "sentence1,sentence2,label\nA cat.,A cat sat.,1\nStocks fell.,Stocks rose.,0\n",
    "glue-val3.csv": "sentence1,sentence2,label\nA dog.,A dog ran.,3\n",
    "glue-single.csv": "sentence,label\nA cat.,1\n",
    "glue-bad.jsonl": '{"sentence1": "a", "sentence2": "b", "label": 1}\n{"sentence1": "a",\n',
    "qa-notjson.json": '{"data": [',
    "qa-nodata.json": '{"version": "1.1"}',
    "qa-noquestion.json": _squad({"context": "Ada wrote it.", "qas": [{"id": "q1", "answers": []}]}),
    "qa-outside.json": _squad({**SQUAD_OK, "qas": [{**SQUAD_OK["qas"][0],
                                                    "answers": [{"text": "Ada", "answer_start": 999}]}]}),
    "qa-startword.json": _squad({**SQUAD_OK, "qas": [{**SQUAD_OK["qas"][0],
                                                      "answers": [{"text": "Ada", "answer_start": "x"}]}]}),
    "qa-noqs.json": _squad({"context": "Ada wrote it.", "qas": []}),
    "clm.txt": "A document.\n\nAnother one.\n",
    "clm-empty.txt": "\n\n   \n",
    "clm-notext.jsonl": '{"body": "a document"}\n',
    "hosts-quote": "node0 203.0.113.10 user='ubuntu\n",
    "hosts-port": "node0 203.0.113.10 port=99999\n",
    "hosts-port-word": "node0 203.0.113.10 port=ssh\n",
    "hosts-same": "node0 203.0.113.10\nnode1 203.0.113.10\n",
    "hosts-dupe": "node0 203.0.113.10\nnode0 203.0.113.11\n",
    "hosts-field": "node0 203.0.113.10 gpu=1\n",
    "hosts-short": "node0\n",
    "hosts-down": "node0 127.0.0.1 port=9\n",  # the discard port: nothing answers SSH there
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-input-data")
    for name, text in FILES.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    (d / "clm-binary.txt").write_bytes(b"\xff\xfe\x00\x81 not text")
    return d


# ---- the test ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(_params()))
def test_bad_input_is_one_line_and_starts_nothing(case, data, tmp_path, request):
    if case.cluster:
        lc = request.getfixturevalue("cluster2")
        env, state, runs = dict(lc.env), lc.state, lc.runs
    else:  # a state folder of its own, with no cluster in it
        state, runs = tmp_path / "state" / "local", tmp_path / "runs"
        env = {"XC_STATE_DIR": str(state.parent), "XC_RUNS_DIR": str(runs), "XC_CLUSTER": "local"}
    env.update(case.env)
    before = set(runs.iterdir()) if runs.exists() else set()
    ranks_before = ranks_on(state)  # only this cluster's: other workers' and suites' runs are not ours
    undo = globals()[case.prepare](state) if case.prepare else None
    try:
        argv = [w.format(d=data, state=state) for w in shlex.split(case.command)]
        res = fab(*argv, env=env, timeout=120) if case.id in SUBPROCESS else fab_in_process(*argv, env=env)
    finally:
        if undo:
            undo()
    out = res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, out
    assert "Traceback" not in out, out
    assert lines and lines[-1].startswith("error: "), out
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], out  # one error line
    assert case.message.format(d=data, state=state) in lines[-1], lines[-1]
    assert "; " in lines[-1], f"no fix named: {lines[-1]}"
    assert (set(runs.iterdir()) if runs.exists() else set()) == before  # no run folder
    assert ranks_on(state) - ranks_before == set()  # it started no rank
    if not case.cluster:  # and no sshd was started for it
        assert processes_with_cmdline(str(state)) == []
        assert case.prepare == "corrupt_state" or not (state / "state.json").exists()


def test_the_table_covers_every_task_with_sixty_cases_or_more():
    tasks = {shlex.split(c.command)[0] for c in CASES}
    assert {"train", "bench", "doctor", "setup", "stop", "keys", "local-up", "local-kill", "local-down", "kube",
            "demo"} <= tasks
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    assert sum(" -- " in f" {c.command} " for c in CASES) >= 20  # job flags and data files


@pytest.mark.parametrize("job, files", [
    ("glue", ["paraphrase/train.csv", "paraphrase/validation.csv"]),
    ("qa", ["squad/train.json", "squad/validation.json"]),
    ("clm", ["corpus/train.txt", "corpus/validation.txt"]),
])
def test_the_bundled_data_passes_the_checks(job, files):
    """The checks refuse what the jobs cannot use, not what they can: the bundled sets pass."""
    from launch.staging import jobdata

    paths = [str(ROOT / "training" / "jobs" / "data" / f) for f in files]
    args = ["--train_file", paths[0], "--validation_file", paths[1], "--max_seq_length", "128",
            "--learning_rate", "2e-5", "--num_train_epochs", "1", "--model_name_or_path", "bert-base-cased"]
    jobdata.check(job, args, [("--train_file", paths[0]), ("--validation_file", paths[1])])


def test_a_glue_test_file_needs_no_labels(data, tmp_path):
    from launch.staging import jobdata

    test = tmp_path / "test.csv"
    test.write_text("sentence1,sentence2\nA dog.,A dog ran.\n")
    train = str(data / "glue-train.csv")
    jobdata.check("glue", [], [("--train_file", train), ("--test_file", str(test))])
