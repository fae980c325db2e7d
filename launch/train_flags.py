"""`fab train`'s flags resolved once into a TrainRequest. A flag the user did not give is None: a new run
takes the request's defaults for it, a `--resume` keeps the recorded value. So `--timeout 300` or `--ppn
auto` on a resume reset a recorded value, which comparing values to their defaults could not tell."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from core.cli import as_int, env_pairs, valueless_keys
from core.errors import ClusterError
from launch import resume as resume_lib
from launch.request import TrainRequest


@dataclass(frozen=True)
class TrainFlags:
    """What was typed after `fab train`, as text; None where a flag was not given."""

    nodes: str | None = None
    job: str | None = None
    script: str | None = None
    workdir: str | None = None
    module: str | None = None
    launcher: str | None = None
    ppn: str | None = None
    threads: str | None = None
    backend: str | None = None
    precision: str | None = None
    comm_hook: str | None = None
    env: list[str] = field(default_factory=list)
    master_port: str | None = None
    no_pin: bool = False
    timeout: str | None = None
    save_every: str | None = None
    no_fetch_model: bool = False
    resume: str | None = None
    max_restarts: str | None = None
    restart_wait: str | None = None
    concurrent: bool = False
    detach: bool = False
    job_args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resolved:
    req: TrainRequest
    max_restarts: int
    restart_wait: int
    supervised: bool  # --detach with --max-restarts: a supervisor process of its own runs it


def resolve(f: TrainFlags, runs_dir: Path, store: str | None = None) -> Resolved:
    """The request, checked for flags that exclude each other; raises ClusterError naming the fix."""
    n = as_int(f.nodes, "--nodes", 1) if f.nodes is not None else None
    if f.job and f.script:
        raise ClusterError(f"--job {f.job} and --script {f.script} exclude each other",
                           "pass --job for a bundled job or --script for your own")
    if f.module and (f.job or f.script):
        raise ClusterError(f"--module {f.module} and --{'job ' + f.job if f.job else 'script ' + f.script} exclude "
                           "each other", "pass one of them")
    given = {k: str(v) for k, v in (("ppn", f.ppn), ("threads", f.threads), ("backend", f.backend),
                                    ("precision", f.precision), ("comm_hook", f.comm_hook),
                                    ("save_every", f.save_every)) if v is not None}
    if f.timeout is not None:
        given["timeout_s"] = as_int(f.timeout, "--timeout", 1)
    if f.master_port is not None:
        given["master_port"] = as_int(f.master_port, "--master-port", 1024, 65535)
    if f.resume:
        if f.job or f.script or f.workdir or f.module or f.launcher or f.job_args:
            raise ClusterError(f"--resume {f.resume} runs that run's own job and flags",
                               "drop --job/--script/--workdir/--module/--launcher and the flags after --")
        req = resume_lib.resume_request(f.resume, runs_dir, nodes=n, fetch_model=not f.no_fetch_model, store=store)
        env, valueless = {**req.env, **env_pairs(f.env)}, req.valueless | valueless_keys(f.env)
        pin = req.pin and not f.no_pin
    else:
        req = TrainRequest(nodes=n, job=f.job or "glue", script=f.script, workdir=f.workdir, module=f.module,
                           launcher=f.launcher or "python", args=list(f.job_args), fetch_model=not f.no_fetch_model,
                           runs_dir=runs_dir)
        env, valueless, pin = env_pairs(f.env), valueless_keys(f.env), not f.no_pin
    restarts = as_int(f.max_restarts if f.max_restarts is not None else 0, "--max-restarts", 0)
    wait = as_int(f.restart_wait if f.restart_wait is not None else 600, "--restart-wait", 0)
    supervised = bool(f.detach and restarts)
    req = dataclasses.replace(req, env=env, valueless=valueless, pin=pin, concurrent=bool(f.concurrent),
                              detach=bool(f.detach) and not supervised, **given)
    return Resolved(req, restarts, wait, supervised)
