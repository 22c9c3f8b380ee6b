"""Decisions a mask or layout takes on floats: where the kernels and the reference can
disagree about which pairs attend.

`mask k <= q / 1.1` is valid, but its division is a float: the kernels compute it in
float32 (on a GPU with fused multiply-adds), the reference in float64. A score computed
in two precisions differs by a rounding error, within the check's tolerance; a decision
taken on such a value does not: at q = 33, q / 1.1 is 30 in one precision and just
below it in the other, so key 30 is kept by one and dropped by the other, and the
whole row differs. A float constant that float32 cannot hold (0.1) moves a boundary the
same way, even on float inputs compared with it. Comparisons of integers, and
conditions built from them, are exact everywhere.

So the front ends warn (attncc.SpecWarning) at each comparison, and each rounding of a
float to an integer (`floor`, `ceil`, `int`), in a `mask` or `layout` that reads a
float the two precisions may hold differently: one computed by arithmetic or a float
function, a constant or param float32 cannot hold, an f64 input. A float input of 32
bits or fewer, a constant such as 0.5, min, max, abs or where of them, and such a value
scaled by a power of two are the same in both, so `gate[k] > 0.5` and `k <= q * 0.5`
give no warning. Integers past 2**24, which float32 rounds, are left alone: positions that large are rare. Scores, sinks and weights are
judged where they decide on such a float (a table index, a `where` condition), not
where a value stays a value (it only rounds), a decision reads the score itself, or a
table index rounds a float function (T5's log buckets: _decides_a_value says why).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from types import SimpleNamespace

from .. import ir
from ..operators import conditional, entry_of, rounding, same_kind

# Where a decision picks pairs (mask, layout) or values (a table entry, a where branch in
# a score, sink or weight: `t[int((k - q) * 0.7)]` read entry 63 in float32, 62 in float64).
DECISIONS = ("mask", "layout", "score", "sink", "weight")


@dataclass(frozen=True)
class FloatDecision:
    """One comparison or rounding in a mask or layout that reads a float."""
    node: object  # ir.Cmp (a comparison) or ir.Call (a rounding)

    def message(self, decl: str) -> str:
        text = ir.print_expr(self.node)
        if isinstance(self.node, ir.Cmp):
            what, example = "compares floats", "`k <= q / 1.1` as `11 * k <= 10 * q`"
        else:
            what = f"rounds a float to an integer with {self.node.fn}()"
            example = "`floor(q / 8.0)` as `q // 8`"
        differs = ("can be kept by one and dropped by the other, and `attncc check` then "
                   "fails whole rows" if decl in ("mask", "layout") else
                   "can take one value in the kernels and another in the reference (another "
                   "table entry, the other branch), and `attncc check` then fails")
        return (f"in `{decl}`, `{text}` {what}: the kernels compute its floats in float32 (on "
                "a GPU with fused multiply-adds) and attncc.reference in float64, so a pair "
                f"that sits on its boundary {differs}. Write it in integers (for example, "
                f"{example})")


def float_decisions(variant: ir.Variant) -> list:
    """(declaration, FloatDecision) for each decision on floats in a mask or layout."""
    found = []
    for decl in DECISIONS:
        e = getattr(variant, decl)
        if e is None:
            continue
        types: dict = {}
        # What the operators' type rules read of a declaration (chance() asks for a layout).
        scope = SimpleNamespace(decl=decl, params={p.name: p for p in variant.params},
                                inputs={i.name: i for i in variant.inputs})
        _type(e, variant, scope, types)
        for node in ir.walk(e):
            kids = ir.children(node)
            decides = (isinstance(node, ir.Cmp)
                       or (isinstance(node, ir.Call) and entry_of(node).types is rounding))
            if decides and decl not in ("mask", "layout") and not _decides_a_value(node):
                continue
            if decides and any(_rounded(k, variant, types) for k in kids):
                found.append((decl, FloatDecision(node)))
    return found


def _decides_a_value(node) -> bool:
    """In a score, sink or weight: whether a decision is judged. Not one on the score itself
    (`where(s > 0.0, s, 0.0)` rounds with the score, which the check's tolerance is for),
    nor a rounding of a float function's value (T5's log buckets: their thresholds are
    irrational, and positions land on them only where both precisions agree, as at
    powers of the base); a comparison, or a rounding of arithmetic (`int((k - q) * 0.7)`,
    an integer at k - q = 90), is."""
    if "s" in ir.free_vars(node):
        return False
    if isinstance(node, ir.Cmp):
        return True
    return not any(isinstance(n, ir.Call) and entry_of(n).types not in (same_kind, conditional)
                   and entry_of(n).types is not rounding for n in ir.walk(node.args[0]))


def _rounded(e, variant: ir.Variant, types: dict) -> bool:
    """Whether float e may hold different values in float32 and float64."""
    if types[id(e)] != ir.FLOAT:
        return False
    if isinstance(e, ir.Load):
        return variant.input(e.tensor).dtype == "f64"
    if isinstance(e, ir.Const):
        return not _float32_holds(e.value)
    if isinstance(e, ir.Param):
        return not _float32_holds(next(p.value for p in variant.params if p.name == e.name))
    kids = ir.children(e)
    if isinstance(e, ir.Neg) or (isinstance(e, (ir.Call, ir.Where))
                                 and entry_of(e).types in (same_kind, conditional)):
        # A sign or a choice between values: rounded only where a value is.
        return any(_rounded(k, variant, types) for k in kids
                   if types[id(k)] != ir.BOOL)
    if isinstance(e, ir.BinOp) and _scaled_by_power_of_two(e, variant, types):
        return False
    return True  # arithmetic, or a float function


def _scaled_by_power_of_two(e: ir.BinOp, variant: ir.Variant, types: dict) -> bool:
    """Whether e multiplies or divides an exact value by a constant power of two (`q *
    0.5`, `k / 4.0`): only the exponent changes, the same in both precisions."""
    sides = {"*": [(e.lhs, e.rhs), (e.rhs, e.lhs)], "/": [(e.lhs, e.rhs)]}.get(e.op, [])
    return any(isinstance(c, ir.Const) and _power_of_two(c.value)
               and not _rounded(x, variant, types) for x, c in sides)


def _power_of_two(value) -> bool:
    return value != 0 and math.isfinite(value) and abs(math.frexp(value)[0]) == 0.5


def _float32_holds(value) -> bool:
    return struct.unpack("f", struct.pack("f", float(value)))[0] == float(value)


def _type(e, variant: ir.Variant, scope, types: dict) -> str:
    """e's type (ir.INT, FLOAT or BOOL), recorded for every node in `types` by id. The
    variant has been checked, so the operators' own type rules cannot refuse it."""
    kids = [_type(k, variant, scope, types) for k in ir.children(e)]
    if isinstance(e, ir.Var):
        t = ir.FLOAT if e.name == "s" else ir.INT
    elif isinstance(e, ir.Const):
        t = e.type
    elif isinstance(e, ir.Param):
        t = next(p.type for p in variant.params if p.name == e.name)
    elif isinstance(e, ir.Load):
        t = variant.input(e.tensor).type
    elif isinstance(e, ir.Member):
        t = ir.BOOL
    else:
        t = entry_of(e).types(e, kids, scope)
    types[id(e)] = t
    return t
