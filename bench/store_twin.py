"""Where a spot notice's checkpoint goes: home over the operator's uplink (before) or into the cluster's store
next to the nodes (after), on a network twin (root only: network namespaces, veths, tc).

Three namespaces: the node, the operator and the store. The node's link to the operator is shaped by tc (tbf)
to --rate at both ends (40 Mbit/s: a home or office uplink); its link to the store is not (S3 in the same
region as the nodes). The store is a real moto S3 server in its own namespace; the checkpoint is bert-base's
size: BertForSequenceClassification from its config (random weights) after one AdamW step, saved as the
Trainer saves it (model.safetensors + optimizer.pt + a few small files).
  before, save:   notice -> the node saves -> its files cross the operator's link (a TCP stream standing in for
                  the SFTP copy launch/staging/outputs.py made: the same bytes, without SSH's few % of framing)
  before, resume: the operator's copy crosses the link back to the new node (launch/run.py's _stage did so)
  after, save:    notice -> the node saves -> training.runtime.store.publish_checkpoint uploads it to S3 (boto3's
                  transfer manager, multipart, marker last); the operator sends the notice and hears "durable"
  after, resume:  the operator sends the store URL; the node downloads it (training.runtime.store.download_tree)
Bytes over the operator's link come from its veth's counters (both directions), commands and replies included.
Last line:  notice_to_durable_s=<after, save> operator_bytes_resume=<after, resume>      (goals: <= 60, < 10e6)

    sudo .venv/bin/python bench/store_twin.py [--rate 40mbit] [--skip-before]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.runtime.paths import Checkpoints, RunPaths

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NS = {"node": "xcst-node", "op": "xcst-op", "s3": "xcst-s3"}
NODE_OP, OP = "198.18.254.1", "198.18.254.2"  # /30: the operator's link
NODE_S3, S3 = "198.18.254.5", "198.18.254.6"  # /30: the store's link
PORT, S3_PORT = 7070, 5000
BUCKET = "xc-twin-store"


def sh(*argv: str, check: bool = True) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and res.returncode:
        raise SystemExit(f"error: {' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def build(rate: str) -> None:
    from cluster.netns import qdisc_args

    teardown()
    for ns in NS.values():
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    for a, b, addr_a, addr_b, shaped in (("node", "op", NODE_OP, OP, True), ("node", "s3", NODE_S3, S3, False)):
        va, vb = f"v{a}{b}", f"v{b}{a}"
        sh("ip", "link", "add", va, "netns", NS[a], "type", "veth", "peer", "name", vb, "netns", NS[b])
        for ns, dev, addr in ((NS[a], va, addr_a), (NS[b], vb, addr_b)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            if shaped:
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc_args(rate, None))


def teardown() -> None:
    for ns in NS.values():
        sh("ip", "netns", "del", ns, check=False)


def link_bytes() -> int:
    stats = json.loads(sh("ip", "-n", NS["op"], "-s", "-j", "link", "show", "dev", "vopnode"))[0]["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def in_ns(ns: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", NS[ns], sys.executable, *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, text=True)


# -- the node: a bert-base model with its AdamW state, saving and resuming on command ------------------------
def node_main(work: Path) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from training.runtime import store

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig())  # bert-base: 12 x 768, 110 M parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, 30000, (2, 16))
    model(input_ids=batch, labels=torch.tensor([0, 1])).loss.backward()
    opt.step()  # AdamW's two moments exist now: the checkpoint's 2/3
    srv = socket.create_server((NODE_OP, PORT))
    print("ready", flush=True)
    step = 0
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rwb") as f:
            cmd = f.readline().decode().split()
            if not cmd or cmd[0] == "quit":
                return
            step += 1
            if cmd[0] in ("save-home", "save-store"):
                folder = work / f"checkpoint-{step}"
                shutil.rmtree(folder, ignore_errors=True)
                model.save_pretrained(folder)  # model.safetensors, config.json
                torch.save(opt.state_dict(), folder / "optimizer.pt")
                (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
                (folder / Checkpoints.MARKER).write_text("{}")
                if cmd[0] == "save-home":
                    send_tree(f, folder)
                else:
                    store.publish_checkpoint(folder, step=step, run_id="twin", url=cmd[1])
                    f.write(b"durable\n")
            elif cmd[0] == "resume-home":
                got = recv_tree(f, work / "resume-home")
                f.write(f"received {got}\n".encode())
            elif cmd[0] == "resume-store":
                st = store.open_store(cmd[1])
                steps = store.stored_steps(st, "twin")
                got = store.download_tree(st, RunPaths("twin").store_checkpoint(steps[-1]), work / "resume-store")
                f.write(f"received {got}\n".encode())
            f.flush()


def send_tree(f, folder: Path) -> None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        f.write(f"{path.stat().st_size} {path.relative_to(folder)}\n".encode())
        with path.open("rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)
    f.write(b"0 \n")


def recv_tree(f, dest: Path) -> int:
    total = 0
    while True:
        size, _, rel = f.readline().decode().rstrip("\n").partition(" ")
        if not rel:
            return total
        left = int(size)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        with (dest / rel).open("wb") as out:
            while left:
                chunk = f.read(min(left, 1 << 20))
                out.write(chunk)
                left -= len(chunk)
        total += int(size)


# -- the operator: one command per process, timed from its sending to the last byte of the answer -------------
def op_main(cmd: str, arg: str, home: Path) -> None:
    started = time.monotonic()
    with socket.create_connection((NODE_OP, PORT)) as conn, conn.makefile("rwb") as f:
        f.write(f"{cmd} {arg}\n".encode())
        if cmd == "resume-home":
            send_tree(f, home)
        f.flush()
        if cmd == "save-home":
            got, answer = recv_tree(f, home), "home"
        else:
            answer, got = f.readline().decode().strip(), 0
    print(json.dumps({"s": time.monotonic() - started, "answer": answer, "bytes": got}), flush=True)


def op(cmd: str, arg: str, home: Path) -> tuple[float, int, str]:
    before = link_bytes()
    proc = in_ns("op", __file__, "--op", cmd, arg, "--home", str(home))
    out = json.loads(proc.communicate()[0].strip().splitlines()[-1])
    return out["s"], link_bytes() - before, out["answer"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="40mbit", help="the operator's uplink (tc rate)")
    ap.add_argument("--skip-before", action="store_true", help="only the store path (the old one takes ~9 min)")
    ap.add_argument("--node", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--home", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.node:
        return node_main(Path(a.work))
    if a.op:
        return op_main(a.op[0], a.op[1], Path(a.home))
    if os.geteuid() != 0:
        raise SystemExit("error: the twin needs root (network namespaces and tc); run it with sudo")
    from glue_single_node import cpu_line

    print(cpu_line())
    print(f"command: {' '.join(sys.argv)}")
    build(a.rate)
    tmp = Path(tempfile.mkdtemp(prefix="xc-store-twin-"))
    procs = []
    try:
        env = {"AWS_ACCESS_KEY_ID": "twin", "AWS_SECRET_ACCESS_KEY": "twin-secret", "AWS_REGION": "us-east-1",
               "XC_S3_ENDPOINT_URL": f"http://{S3}:{S3_PORT}"}
        moto = subprocess.Popen(["ip", "netns", "exec", NS["s3"], sys.executable, "-m", "moto.server", "-H", S3, "-p",
                                 str(S3_PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(moto)
        node = in_ns("node", __file__, "--node", "--work", str(tmp / "node"), env=env)
        procs.append(node)
        assert node.stdout.readline().strip() == "ready", "the node did not start"
        time.sleep(3)  # moto listening
        subprocess.run(["ip", "netns", "exec", NS["node"], sys.executable, "-c",
                        ("import boto3, os; boto3.client('s3', endpoint_url=os.environ['XC_S3_ENDPOINT_URL'])"
                         f".create_bucket(Bucket='{BUCKET}')")], env={**os.environ, **env}, check=True)
        url = f"s3://{BUCKET}/twin-cluster"
        rows = {}
        home = tmp / "home"
        if not a.skip_before:
            rows["before, save"] = op("save-home", "-", home)
            rows["before, resume"] = op("resume-home", "-", home)
        rows["after, save"] = op("save-store", url, home)
        saved = max((tmp / "node").glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))
        size = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
        print(f"checkpoint: {size / 1e6:.0f} MB ({', '.join(sorted(p.name for p in saved.iterdir()))})", flush=True)
        rows["after, resume"] = op("resume-store", url, home)
        print(f"operator link {a.rate} (tbf), store link unshaped; moto S3 in its own namespace")
        print(f"{'path':<16} {'notice->durable / resume s':>27} {'bytes over the operator link':>30}")
        for name, (secs, sent, _) in rows.items():
            print(f"{name:<16} {secs:>27.1f} {sent:>30,}")
        save_s, resume_bytes = rows["after, save"][0], rows["after, resume"][1]
        goals = f"goals: <= 60 s {'met' if save_s <= 60 else 'MISSED'}, < 10 MB {'met' if resume_bytes < 10e6 else 'MISSED'}"
        print(goals)
        print(f"notice_to_durable_s={save_s:.1f} operator_bytes_resume={resume_bytes}")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        teardown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
