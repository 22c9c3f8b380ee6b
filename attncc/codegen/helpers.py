"""Which helper functions a generated module defines: those its code calls.

The templates define small helpers (codegen/templates/expressions.py.jinja on the device,
codegen/templates/host_args.jinja on the host), each optional one behind
`emit(name)`: `_tanh` for a score with tanh, the `_chance_*` hash for chance(),
`_h_tile_in` for an index list, and so on. The printers report the helpers each piece
of a variant's code calls (attncc/codegen/printed.py); a backend adds those its
templates' own code calls for the variant, and `needed` adds the helpers those call.
"""
from __future__ import annotations

# What the definitions of helpers call of the others.
CALLS = {
    "_index": ("_int",),
    "_tanh_fast": ("_tanh",),
    "_chance_start": ("_fmix32",), "_chance_step": ("_fmix32",),
    "_dropout_keep": ("_fmix32",), "_dropout_keep_t": ("_fmix32",),
    "_h_chance": ("_h_fmix32",),
}
# The host runs the tile classification the kernels' way, with the kernels' helper
# names bound to its own (`_min = _h_min` in tile_tables), for these.
HOST_ALIASES = ("_min", "_max", "_where", "_fdiv", "_mod")


def needed(called) -> set:
    """`called` and every helper they call, however indirectly."""
    out, todo = set(), list(called)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(CALLS.get(name, ()))
    return out


def host_aliases(called) -> tuple:
    """The kernels' helper names host code calls (HOST_ALIASES order): each is bound to
    its host helper, `_fdiv` to `_h_fdiv`."""
    return tuple(name for name in HOST_ALIASES if name in called)


def host_helper(alias: str) -> str:
    return "_h" + alias
