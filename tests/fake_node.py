"""A fake node in the manner of fabric's fabric/testing/base.py MockRemote: what a real node would answer
to the commands the run's lifecycle sends (sweep, runs alive, cat, find, ls, cp -al, sftp get), from an
in-memory file tree and process table, and a record of every command it was sent. It stands in for the
SSH boundary only (cluster.remote.connect), so the code under test is the real code above it."""
from __future__ import annotations

import fnmatch
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from cluster.node import Node
from core.errors import Unreachable


@dataclass
class Result:
    stdout: str = ""
    stderr: str = ""
    exited: int = 0

    @property
    def ok(self) -> bool:
        return self.exited == 0


@dataclass
class FakeNode:
    name: str
    host: str = "127.0.0.9"
    files: dict[str, bytes] = field(default_factory=dict)
    procs: dict[str, int] = field(default_factory=dict)  # run id -> live processes
    reachable: bool = True
    commands: list[str] = field(default_factory=list)

    @property
    def node(self) -> Node:
        return Node(name=self.name, host=self.host, private_host=self.host, user="u", port=2222)

    def answer(self, cmd: str) -> Result:
        self.commands.append(cmd)
        if "kill -9" in cmd:  # launch.life.cleanup.sweep_script
            run_id = re.search(r"XC_RUN_ID=([^'\s]+)", cmd).group(1)
            n = self.procs.pop(run_id, 0)
            return Result("".join(f"killed {1000 + i}\n" for i in range(n)))
        if "uniq -c" in cmd:  # launch.life.cleanup.RUNS_ALIVE
            return Result("".join(f"run {r} {n}\n" for r, n in self.procs.items() if n))
        m = re.fullmatch(r"cat \S+(/runs/\S+\*\.jsonl) 2>/dev/null; true", cmd)  # the ranks' events, under any home
        if m:
            return Result("".join(v.decode() for k, v in sorted(self.files.items()) if fnmatch.fnmatch(k, "*" + m.group(1))))
        m = re.fullmatch(r"cat (\S+)", cmd)
        if m:
            path = shlex.split(m.group(1))[0]
            return Result(self.files[path].decode()) if path in self.files else Result(exited=1)
        m = re.match(r"cd (\S+) 2>/dev/null && find \. -type f", cmd)
        if m:
            top = shlex.split(m.group(1))[0].rstrip("/") + "/"
            return Result("".join(f"{len(v)} {k[len(top):]}\n" for k, v in sorted(self.files.items())
                                  if k.startswith(top)))
        m = re.match(r"ls -d (\S+) 2>/dev/null", cmd)
        if m:
            pattern = m.group(1).replace("'", "")
            return Result("\n".join(k for k in self.files if fnmatch.fnmatch(k, pattern)))
        m = re.match(r"rm -rf (\S+) && cp -al (\S+) (\S+)", cmd)
        if m:
            src, dst = (shlex.split(g)[0] for g in m.group(2, 3))
            for k, v in list(self.files.items()):
                if k.startswith(src + "/"):
                    self.files[dst + k[len(src):]] = v
            return Result()
        return Result()

    def connect(self):
        if not self.reachable:
            raise Unreachable(f"{self.name} ({self.host}:2222) is unreachable (Connection refused)",
                              "check that the node is up", node=self.name)
        return FakeConn(self)


class FakeConn:
    def __init__(self, node: FakeNode):
        self.fake = node

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def close(self):
        pass

    def run(self, cmd: str, **kw) -> Result:
        return self.fake.answer(cmd)

    def sftp(self):
        return self

    def get(self, remote: str, local, callback=None):
        data = self.fake.files[remote]
        if isinstance(local, (str, Path)):
            Path(local).write_bytes(data)
        else:
            local.write(data)


class FakeCluster:
    """The nodes by name, and the connect() that reaches them."""

    def __init__(self, *nodes: FakeNode):
        self.fakes = {n.name: n for n in nodes}
        self.nodes = [n.node for n in nodes]
        self.spec = "fake"

    def connect(self, node: Node, timeout: float = 10.0):
        return self.fakes[node.name].connect()

    def install(self, monkeypatch, *modules) -> None:
        for mod in modules:
            monkeypatch.setattr(mod, "connect", self.connect)


__all__ = ["FakeCluster", "FakeNode", "io"]
