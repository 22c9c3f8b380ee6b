"""Which helper functions a generated module needs, so that it defines no others.

The templates define small helpers (codegen/templates/expressions.py.jinja on the device,
codegen/templates/host_args.jinja on the host) that the emitted mask, score, layout
and bound code calls: `_tanh` for a score with tanh, the `_chance_*` hash for chance(),
`_h_tile_in` for an index list, and so on. Which ones a variant calls is read from the
module itself: rendered once with every helper, its code outside the optional helpers'
definitions names the ones it calls (and those call others: `_chance_start` calls
`_fmix32`); backends/portable/codegen.py then renders it again with only those. Reading the
rendered code, rather than predicting it, cannot miss a call an emitter or a template
makes.
"""
from __future__ import annotations

import re

# Helpers a module may leave out. The others (_fdiv, _int, _tile_index, _load, ...) are
# called by the templates' own code in every module.
DEVICE = ("_mod", "_min", "_max", "_where", "_index", "_tanh", "_fmix32", "_chance_start",
          "_chance_step", "_chance_keep", "_dropout_keep", "_dropout_keep_t")
HOST = ("_h_min", "_h_max", "_h_where", "_h_fdiv", "_h_mod", "_h_clamp", "_h_chance",
        "_h_fmix32", "_h_tile_in")
OPTIONAL = DEVICE + HOST
# tile_tables() runs the interval code the kernels run, whose helpers it binds to the
# host ones: `_min = _h_min` and so on, for these.
HOST_ALIASES = ("_min", "_max", "_where", "_fdiv", "_mod")
ALIAS_MARK = "# the kernels' helper names, on the host"


def _definition(source: str, name: str) -> str:
    """The text of `def name(...)`'s block (decorator included), or ''."""
    match = re.search(rf"^(@triton\.jit\n)?def {name}\(.*?(?=^\S)", source + "\nEND",
                      re.MULTILINE | re.DOTALL)
    return match.group(0) if match else ""


def _calls(text: str, names) -> set:
    return {name for name in names if re.search(rf"\b{name}\b", text)}


def needed(source: str) -> tuple[set, tuple]:
    """(helpers, host aliases) that `source`, rendered with every helper, uses."""
    definitions = {name: _definition(source, name) for name in OPTIONAL}
    outside = source
    for text in definitions.values():
        if text:
            outside = outside.replace(text, "")
    alias_lines = [line for line in outside.splitlines() if ALIAS_MARK in line]
    for line in alias_lines:
        outside = outside.replace(line, "")
    tables = _definition(outside, "tile_tables")
    aliases = tuple(name for name in HOST_ALIASES if re.search(rf"\b{name}\(", tables))
    used = _calls(outside, OPTIONAL) | {"_h" + name for name in aliases}
    while True:  # helpers calling helpers
        more = set().union(*(_calls(definitions[name], OPTIONAL) for name in used)) - used
        if not more:
            return used, aliases
        used |= more
