"""Which parameters the per-tile device functions are handed and never read, so that
a generated module passes each of them only what its code uses.

The step functions (`_fwd_step`, `_dq_step`, `_dkdv_step`, `_decode_allowed`,
`_decode_step`) and the tile-run functions that call them (`_fwd_tiles`, ...) take their
row and context arguments from name lists the templates spell once (`fwd_row`,
`fwd_ctx`, ... in backends/portable/templates/macros.jinja and backends/portable/templates/decode.py.jinja), so
that every signature and every call site agree. Those lists hold every name a variant's
mask, score, layout or dropout might read: the query tile's index and bounds, the head,
the offsets, the seed. A variant reads a few of them. Which ones is read from the module
itself, as codegen/helpers.py reads which helpers it calls: rendered once with the full
lists, a name that no such function reads (other than by handing it on to another of
them) is dropped from the lists, and backends/portable/codegen.py renders again. Triton inlines
these functions, so the unread parameters cost nothing at run time; leaving them out is
for the reader of the generated module.
"""
from __future__ import annotations

import ast

# The functions that take each template list as parameters, and hand it on to each
# other (a step function and the tile-run function that calls it).
USERS = {
    "fwd_row": ("_fwd_step", "_fwd_tiles"),
    "fwd_ctx": ("_fwd_step", "_fwd_tiles", "_dq_step", "_dq_tiles"),
    "dq_row": ("_dq_step", "_dq_tiles"),
    "dkdv_ctx": ("_dkdv_step", "_dkdv_tiles"),
    "dkdv_col": ("_dkdv_step", "_dkdv_tiles"),
    "dec_row": ("_decode_allowed", "_decode_step", "_decode_tiles"),
    "dec_ctx": ("_decode_allowed", "_decode_step", "_decode_tiles"),
}
PASSING = tuple(sorted(set().union(*USERS.values())))
NOTHING = {name: frozenset() for name in USERS}  # the first rendering drops nothing


class _Reads(ast.NodeVisitor):
    """Names a function reads, not counting the arguments it hands to PASSING functions."""

    def __init__(self):
        self.names: set = set()

    def visit_Name(self, node):
        self.names.add(node.id)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in PASSING:
            return  # handing the lists on is not reading them
        self.generic_visit(node)


def unread(source: str) -> dict:
    """For each template list (USERS), the names none of the functions taking it reads."""
    functions = {node.name: node for node in ast.parse(source).body
                 if isinstance(node, ast.FunctionDef) and node.name in PASSING}
    params, read = {}, {}
    for name, f in functions.items():
        params[name] = {a.arg for a in f.args.args if not _is_constexpr(a)}
        reads = _Reads()
        for statement in f.body:
            reads.visit(statement)
        read[name] = reads.names
    out = {}
    for listed, users in USERS.items():
        present = [u for u in users if u in functions]
        if not present:
            out[listed] = frozenset()
            continue
        # A parameter of every user that no user reads.
        taken = set.intersection(*(params[u] for u in present))
        out[listed] = frozenset(taken - set().union(*(read[u] for u in present)))
    return out


def _is_constexpr(arg: ast.arg) -> bool:
    return arg.annotation is not None and "constexpr" in ast.unparse(arg.annotation)


def without(names: str, dropped) -> str:
    """The jinja filter: a ", "-separated name list less the `dropped` names."""
    return ", ".join(n for n in (s.strip() for s in names.split(",")) if n and n not in dropped)
