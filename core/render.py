"""Jinja2 rendering of everything under templates/."""
from __future__ import annotations

import functools
import shlex

import jinja2

from core.constants import HOME_EXPR, PROJECT_ROOT

TEMPLATES = PROJECT_ROOT / "templates"


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
    env.globals["HOME_EXPR"] = HOME_EXPR  # the node's work root as a shell word, from core.constants
    return env


def render(template: str, **context) -> str:
    return environment().get_template(template).render(**context)
