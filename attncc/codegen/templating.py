"""The jinja environment every backend renders its templates in.

A backend keeps its templates in its own folder (attncc/backends/<name>/templates/);
the templates every backend shares live in attncc/codegen/templates/: the module header,
the expression helpers, a tile's score and mask text, which tiles a program takes and
visits, and the host side (tile tables, launch arguments, grid). A backend's
environment searches its own folder first, then the shared one, so
`{% include "expressions.py.jinja" %}` means the same file from any backend.

Macros write their text from column 0, and the call site indents it with jinja's
filter: `{{ segment_ranges(...) | indent(8, true) }}`.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from . import parameters

SHARED_TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.lru_cache(maxsize=None)
def environment(templates: Path) -> jinja2.Environment:
    """The environment of a backend whose templates are in `templates`."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(templates), str(SHARED_TEMPLATES)]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["py"] = repr  # Python literals, readable (tojson would escape < and >)
    env.filters["without"] = parameters.without
    return env
