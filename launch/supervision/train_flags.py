"""`fab train`'s flags resolved once into a TrainRequest. A flag the user did not give is None: a new run
takes the request's defaults for it, a `--resume` keeps the recorded value. So `--timeout 300` or `--ppn
auto` on a resume reset a recorded value, which comparing values to their defaults could not tell."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path

from core.cli import as_int, env_pairs, job_args, valueless_keys
from core.errors import ClusterError
from launch.life import resume as resume_lib
from launch.plan.request import TrainRequest, absolute_files
from launch.staging.snapshot import CODE_CHOICES


def _flag(help_text: str, default=None):
    """A flag: its default and its `fab --help train` line, in one place."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainFlags:
    """What was typed after `fab train`, as text; None where a flag was not given. Each field is one flag of the
    task (underscores become dashes); adding a flag is a field here plus its use in `resolve`."""

    # One line each, so that --help reads in one screen; docs/train.md#flags has the details.
    nodes: str | None = _flag("use the first N nodes (default: all)")
    job: str | None = _flag("bundled job: glue (default) | qa | clm")
    script: str | None = _flag("your own script (its flags after --)")
    workdir: str | None = _flag("ship your project folder; run --script in it")
    module: str | None = _flag("run `python -m NAME` from --workdir")
    launcher: str | None = _flag("python (default) | accelerate")
    requirements: str | None = _flag("pip packages to add (default: DIR/requirements.txt)")
    ppn: str | None = _flag("processes per node (default: one per socket)")
    threads: str | None = _flag("OpenMP threads per process (default: its cores)")
    backend: str | None = _flag("auto | ccl | gloo")
    precision: str | None = _flag("auto (default) | bf16 | fp32")
    comm_hook: str | None = _flag("gradients between nodes: auto | none | bf16 | fp16")
    env: list[str] = field(default_factory=list, metadata={"iterable": True, "help": (
        "KEY=VALUE for every rank; a bare KEY: a secret")})
    master_port: str | None = _flag("rendezvous port on node 0 (default: a free one)")
    no_pin: bool = _flag("do not pin ranks to cores", False)
    timeout: str | None = _flag("seconds a collective may wait (default 300)")
    save_every: str | None = _flag("checkpoint every 10m (default), 600s or N steps", None)
    no_fetch_model: bool = _flag("bring home no model or checkpoint weights", False)
    resume: str | None = _flag("continue RUN_ID from its latest checkpoint")
    code: str | None = _flag("with --resume: snapshot (default) | current")
    max_restarts: str | None = _flag("resume by itself up to K times (default 0)")
    restart_wait: str | None = _flag("seconds to wait for nodes to return (default 600)")
    min_nodes: str | None = _flag("go on with M nodes at the same global batch")
    no_grow_back: bool = _flag("with --min-nodes: stay smaller when nodes return", False)
    concurrent: bool = _flag("run while another run holds the cluster", False)
    detach: bool = _flag("return once every rank runs; 'fab logs RUN -f'", False)
    no_head: bool = _flag("with --detach: supervise from here, not the head", False)
    cluster: str | None = _flag("local | hosts:PATH | aws[:NAME] | pulumi[:STACK]")
    store: str | None = _flag("s3://BUCKET/PREFIX or file:///FOLDER for runs")
    job_args: list[str] = field(default_factory=list)  # after --, not a flag


def _flags() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainFlags) if "help" in f.metadata]


def task_options() -> dict:
    """@task's keyword arguments for `fab train`: each flag's help and which flags repeat."""
    return {"help": {f.name.replace("_", "-"): f.metadata["help"] for f in _flags()},
            "iterable": [f.name for f in _flags() if f.metadata.get("iterable")]}


def takes_flags(fn):
    """fn(c, flags: TrainFlags) as a task whose options are TrainFlags' fields (invoke reads the signature)."""
    kind = inspect.Parameter.KEYWORD_ONLY

    @functools.wraps(fn)
    def task_body(c, **given):
        values = {k: (list(v or []) if isinstance(v, list) or k == "env" else v) for k, v in given.items()}
        for f in _flags():
            if isinstance(f.default, bool):
                values[f.name] = bool(values.get(f.name))
        return fn(c, TrainFlags(**values, job_args=job_args()))

    params = [inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(f.name, kind, default=f.default if isinstance(f.default, bool) else None)
               for f in _flags()]
    task_body.__signature__ = inspect.Signature(params)
    return task_body


@dataclass(frozen=True)
class Resolved:
    req: TrainRequest
    supervised: bool  # --detach with --max-restarts: a supervisor process of its own runs it
    no_head: bool = False  # --no-head: this machine keeps the supervisor role even where the cluster has a head

    @property
    def max_restarts(self) -> int:
        return self.req.spec.recovery.max_restarts


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
        given["timeout_s"] = as_int(f.timeout, "--timeout")
    if f.master_port is not None:
        given["master_port"] = as_int(f.master_port, "--master-port", 1024, 65535)
    if f.code is not None and not f.resume:
        raise ClusterError(f"--code {f.code} goes with --resume: a new run ships the folder as it is",
                           fix="pass --resume RUN too, or drop --code")
    if f.code is not None and f.code not in CODE_CHOICES:
        raise ClusterError(f"--code {f.code!r} is not one of {', '.join(CODE_CHOICES)}",
                           fix="pass --code snapshot (the run's own code, the default) or --code current (the folder "
                               "as it is now)")
    if f.resume:
        if f.job or f.script or f.workdir or f.module or f.launcher or f.requirements or f.job_args:
            raise ClusterError(f"--resume {f.resume} runs that run's own job and flags",
                               "drop --job/--script/--workdir/--module/--launcher/--requirements and the flags after --")
        req = resume_lib.resume_request(f.resume, runs_dir, nodes=n, fetch_model=not f.no_fetch_model, store=store,
                                        code=f.code or "snapshot")
        env, valueless = {**req.spec.what.env, **env_pairs(f.env)}, req.valueless | valueless_keys(f.env)
        pin = req.spec.where.pin and not f.no_pin
    else:
        # paths as fab's current directory names them, absolute: the supervisor resolves them from its own
        here = (lambda p: str(Path(p).expanduser().resolve()))
        req = TrainRequest.of(nodes=n, job=f.job or "glue", workdir=f.workdir and here(f.workdir), module=f.module,
                           script=f.script and (f.script if f.workdir else here(f.script)),
                           launcher=f.launcher or "python", args=absolute_files(list(f.job_args)),
                           requirements=f.requirements and here(f.requirements),
                           fetch_model=not f.no_fetch_model, runs_dir=runs_dir)
        env, valueless, pin = env_pairs(f.env), valueless_keys(f.env), not f.no_pin
    # text to numbers only: their ranges are the spec's rules (RunSpec.problem, below)
    restarts = as_int(f.max_restarts if f.max_restarts is not None else 0, "--max-restarts")
    wait = as_int(f.restart_wait if f.restart_wait is not None else 600, "--restart-wait")
    least = as_int(f.min_nodes, "--min-nodes") if f.min_nodes is not None else None
    supervised = bool(f.detach and restarts)
    req = req.but(env=env, valueless=valueless, pin=pin, concurrent=bool(f.concurrent), max_restarts=restarts,
                  restart_wait=wait, min_nodes=least, grow_back=not f.no_grow_back,
                  detach=bool(f.detach) and not supervised, **given)
    broken = req.spec.problem()  # the spec's own rules, here before anything runs (validate checks them again)
    if broken:
        raise ClusterError(*broken)
    if f.no_head and not f.detach:
        raise ClusterError("--no-head goes with --detach: an attached run is driven from here anyway",
                           fix="pass --detach too, or drop --no-head")
    return Resolved(req, supervised, bool(f.no_head))
