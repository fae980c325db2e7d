"""Jinja2 rendering of everything under templates/."""
from __future__ import annotations

import functools
import shlex
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shquote"] = env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def render(template: str, **context) -> str:
    return environment().get_template(template).render(**context)
