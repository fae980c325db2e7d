"""The run's global batch across node counts: a run resumed (or going on, --min-nodes) on another number of
ranks keeps per-device batch x ranks x accumulation, so its optimizer steps and their batches stay the same.
`req` is a launch.plan.request.TrainRequest (not imported: the request module imports this one)."""
from __future__ import annotations

from core.errors import ClusterError
from launch.staging import jobflags

GRAD_ACCUM_ENV = "XC_GRAD_ACCUM"  # a --script run on fewer nodes: its accumulation factor (docs/scripts.md)


def micro_batches(req, args: list[str], world: int) -> int:
    """One optimizer step of the run in per-device batches: accumulation x ranks. For a bundled job its
    --gradient_accumulation_steps; for a script XC_GRAD_ACCUM (its own accumulation multiplies both sides)."""
    if req.spec.what.own:
        return int(req.spec.what.env.get(GRAD_ACCUM_ENV) or 1) * world
    return int(jobflags.get(args, "--gradient_accumulation_steps") or 1) * world


def same_global_batch(req, args: list[str], old_world: int, new_world: int) -> tuple[object, list[str], str | None]:
    """The request and job args whose gradient accumulation keeps the global batch of a run on old_world ranks:
    a bundled job's --gradient_accumulation_steps, a script's XC_GRAD_ACCUM (the rank hook scales a Trainer's)."""
    if old_world == new_world:
        return req, args, None
    units = micro_batches(req, args, old_world)
    if req.spec.what.own:
        env = req.spec.what.env
        factor = int(env.get(GRAD_ACCUM_ENV) or 1)
        if units % new_world:
            raise ClusterError(f"--resume on {new_world} rank(s): the run's {old_world} rank(s) x {GRAD_ACCUM_ENV} "
                               f"{factor} is not a multiple of {new_world}", fix="resume on a node count that divides it")
        new = units // new_world
        env = {k: v for k, v in env.items() if k != GRAD_ACCUM_ENV} | ({GRAD_ACCUM_ENV: str(new)} if new > 1 else {})
        note = (f"resuming on {new_world} rank(s) instead of {old_world}: {GRAD_ACCUM_ENV} {factor} -> {new} keeps the "
                f"global batch (your per-device batch x {units} x your own accumulation)")
        return req.but(env=env), args, note
    per_device = int(jobflags.get(args, "--per_device_train_batch_size") or 8)
    accum = int(jobflags.get(args, "--gradient_accumulation_steps") or 1)
    global_batch = per_device * units
    if units % new_world:
        raise ClusterError(f"--resume on {new_world} rank(s): the global batch {global_batch} ({per_device} x {accum} "
                           f"x {old_world} ranks) is not a multiple of {per_device} x {new_world}", fix="resume on a node "
                           "count that divides it")
    new_accum = units // new_world
    note = (f"resuming on {new_world} rank(s) instead of {old_world}: gradient accumulation {accum} -> {new_accum} "
            f"keeps the global batch at {global_batch}")
    def scaled(words: list[str]) -> list[str]:
        return jobflags.without(words, "--gradient_accumulation_steps") + ["--gradient_accumulation_steps", str(new_accum)]

    # the request too: its record is what the next resume of this run starts from
    return req.but(args=scaled(req.spec.what.args)), scaled(args), note


def smaller_sizes(units: int, ppn: int, least: int, most: int) -> list[int]:
    """Node counts from most down to least whose ranks divide the run's micro-batches per step exactly."""
    return [k for k in range(most, least - 1, -1) if units % (ppn * k) == 0]
