"""The one reader of job flags (the argv after `--`): '--flag value', '--flag=value' and bare '--flag'.
Every place that needs a job flag's value, the flags' values, or the argv without a flag asks it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    name: str  # '--output_dir'
    value: str | None  # None: nothing follows (a bare switch, or the argv ends)
    at: int  # index of the flag's word in argv
    value_at: int | None  # index of the value's word (== at for '--f=v'), None without a value
    joined: bool  # '--f=v'


def parse(args: list[str]) -> list[Flag]:
    """Every --flag in argv, in order. A word after a flag is its value unless it is a flag itself."""
    out = []
    for i, a in enumerate(args):
        if not a.startswith("--"):
            continue
        name, eq, value = a.partition("=")
        if eq:
            out.append(Flag(name, value, i, i, True))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(Flag(name, args[i + 1], i, i + 1, False))
        else:
            out.append(Flag(name, None, i, None, False))
    return out


def get(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of the last `name` in argv (as argparse takes it), else default."""
    found = [f.value for f in parse(args) if f.name == name]
    return found[-1] if found and found[-1] is not None else default


def values(args: list[str]) -> dict[str, str]:
    """{'--flag': value}; '' for a bare switch."""
    return {f.name: f.value if f.value is not None else "" for f in parse(args)}


def pairs(args: list[str]) -> list[tuple[str, str | None]]:
    return [(f.name, f.value) for f in parse(args)]


def without(args: list[str], name: str) -> list[str]:
    """argv with every `name` and its value left out."""
    drop = set()
    for f in parse(args):
        if f.name == name:
            drop.add(f.at)
            if f.value_at is not None:
                drop.add(f.value_at)
    return [a for i, a in enumerate(args) if i not in drop]


def has(args: list[str], name: str) -> bool:
    return any(f.name == name for f in parse(args))
