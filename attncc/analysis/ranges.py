"""Integer ranges: what each integer sub-expression can reach, so that nothing wraps.

The language's integers are 64-bit, as in the reference (torch.int64). The kernels
compute in 32 bits where that gives the same values, and in 64 where it might not. To
know which, every integer node gets the interval of values it can take on any call:

  * positions, lengths, the batch and head indices and `dim` lie below the call's
    *extent* E = max(q_offset + len_q, k_offset + len_k, batch, heads, dim), which the
    runtime checks against MAX_EXTENT = 2**31 - 1 (lengths are at least 1: the kernels
    and the reference return early on empty calls); h also below the declared `heads`,
    where the variant declares them (a call with other heads is refused);
  * `qb` and `kb` below ceil(E / block);
  * a read of an integer input anywhere in its dtype's range;
  * constants and params exactly;
  * floor(x), ceil(x) and int(x) from the interval of the number x (`_float_bounds`),
    widened by the float32 rounding of the kernels. An x the analysis cannot bound (it
    reads `s` or a float input) is refused: its integer could be anything.

From these, a variant is refused with a SpecError (located by the parser) where

  * a `//` or `%` of integers has a divisor that can be 0, or any division has the
    constant divisor 0: the reference would raise and a kernel return garbage;
  * an expression can leave 64 bits without reading an i64 input: that is a spec
    error (`q * 10**18`), not data. Arithmetic on i64 data wraps in 64 bits, in the
    kernels exactly as in the reference; `wraps()` names such nodes, which the tile
    classification must not reason about with intervals.

`int32_extent` is the largest extent at which every integer node of an expression fits
in 32 bits: the generated module computes the expression in 64 bits on calls beyond
it (and always, when no extent is small enough).

Operations are bounded by their interval rules in attncc/operators.py, on Python
numbers; the divisions are bounded here, where their divisors are checked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import ir
from ..errors import SpecError
from ..operators import (FLOAT_FUNCTIONS, MIRRORED, NEGATED, NUMBERS, UNKNOWN_TRUTH, Bounds,
                         entry_of, rounding, same_kind)

MAX_EXTENT = 2 ** 31 - 1
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
DTYPE_RANGES = {
    "i8": (-2 ** 7, 2 ** 7 - 1), "i16": (-2 ** 15, 2 ** 15 - 1),
    "i32": (INT32_MIN, INT32_MAX), "i64": (INT64_MIN, INT64_MAX),
}


@dataclass(frozen=True)
class Range:
    """Values an integer node takes: [lo, hi], exact Python ints. `wide_data`: the node
    reads i64 data. Arithmetic on it may leave 64 bits and wrap (in the kernels as in
    the reference): `wrapped` marks a node where that may have happened, here or below,
    and lo and hi are then clipped to 64 bits."""
    lo: int
    hi: int
    wide_data: bool = False
    wrapped: bool = False

    def fits(self, lo: int, hi: int) -> bool:
        return lo <= self.lo and self.hi <= hi


class _Analysis(ir.Visitor):
    """Ranges of every integer node of one expression at one extent: visiting a node
    with its children's ranges gives its own Range, or None (not an integer)."""

    def __init__(self, params: dict, inputs: dict, block, extent: int, heads=None):
        self.params = params  # name -> value
        self.inputs = inputs  # name -> InputDecl
        self.block = block
        self.extent = extent
        self.heads = heads  # the declared query heads (`heads 6 / 2`): h's bound, or None
        self.ranges: dict = {}  # id(node) -> Range, for integer nodes
        self.problems: list = []  # (node, message): division by zero, 64-bit overflow

    def run(self, e):
        return self._node(e)

    def _fail(self, node, message: str):
        self.problems.append((node, message))

    def _var(self, name: str) -> Range:
        E = self.extent
        if name == "h" and self.heads is not None:  # a call must have the declared heads
            return Range(0, min(E, self.heads) - 1)
        if name in ("q", "k", "b", "h"):
            return Range(0, E - 1)
        if name in ("len_q", "len_k", "dim", "dim_v"):  # dim_v: in `scale` only, host-side
            return Range(1, E)
        if name in ("qb", "kb"):
            return Range(0, -(-E // (self.block or 1)) - 1)
        raise ValueError(name)

    def _node(self, e):
        kids = [self._node(c) for c in ir.children(e)]
        r = self(e, kids)
        if r is not None:
            self.ranges[id(e)] = r
        return r

    def _ruled(self, e, kids):
        """The table's interval rule on integer operands, checked for 64 bits."""
        bounds = entry_of(e).interval(NUMBERS, *(Bounds(k.lo, k.hi) for k in kids))
        return self._result(e, bounds.lo, bounds.hi, kids)

    def Var(self, e, kids):
        return None if e.name == "s" else self._var(e.name)

    def Const(self, e, kids):
        return Range(e.value, e.value) if e.type == ir.INT else None

    def Param(self, e, kids):
        v = self.params[e.name]
        return Range(v, v) if isinstance(v, int) and not isinstance(v, bool) else None

    def Load(self, e, kids):
        decl = self.inputs[e.tensor]
        if decl.dtype in DTYPE_RANGES:
            return Range(*DTYPE_RANGES[decl.dtype], wide_data=decl.dtype == "i64")
        return None

    def Neg(self, e, kids):
        return None if kids[0] is None else self._ruled(e, kids)

    def BinOp(self, e, kids):
        if e.op in ("+", "-", "*"):
            return None if None in kids else self._ruled(e, kids)
        return self._division(e, *kids)

    def Call(self, e, kids):
        entry = entry_of(e)
        if entry.types is same_kind and None not in kids:  # abs, min, max of integers
            return self._ruled(e, kids)
        if entry.types is rounding:
            return self._rounded(e)
        return None  # floats and chance

    def Where(self, e, kids):
        _, a, b = kids
        if a is None or b is None:
            return None
        a = self._narrowed(e.cond, e.then, a, True)
        b = self._narrowed(e.cond, e.other, b, False)
        if a.lo > a.hi or b.lo > b.hi:  # a branch never taken: the other's range
            a, b = (b, b) if a.lo > a.hi else (a, a)
        # No condition is bounded here: the rule takes the hull of both branches.
        bounds = entry_of(e).interval(NUMBERS, UNKNOWN_TRUTH, Bounds(a.lo, a.hi), Bounds(b.lo, b.hi))
        return self._result(e, bounds.lo, bounds.hi, [a, b])

    def other(self, e, kids):
        return None  # conditions and index lists

    def _narrowed(self, cond, branch, r: Range, holds: bool) -> Range:
        """`branch`'s range where `cond` holds (or fails): `where(x < 8, x, 8)` is below 8.
        Narrows by a comparison of the branch itself with a bounded integer, the pattern
        of a clamp written with where (T5's buckets); otherwise the range unchanged."""
        if not isinstance(cond, ir.Cmp) or r.wrapped or cond.op in ("==", "!="):
            return r
        op = cond.op if holds else NEGATED[cond.op]
        if cond.lhs == branch:
            other = self.ranges.get(id(cond.rhs))
        elif cond.rhs == branch:
            other = self.ranges.get(id(cond.lhs))
            op = MIRRORED[op]  # other op branch
        elif isinstance(branch, ir.Call) and branch.fn in ("min", "max") and len(branch.args) == 2:
            # min/max of the compared expression and a bound (T5's causal bucket,
            # `where(q - k < 16, max(q - k, 0), ..)`): narrow the expression, then bound it.
            x, y = (self.ranges.get(id(a)) for a in branch.args)
            if x is None or y is None or x.wrapped or y.wrapped:
                return r
            x = self._narrowed(cond, branch.args[0], x, holds)
            y = self._narrowed(cond, branch.args[1], y, holds)
            pick = max if branch.fn == "max" else min
            return Range(pick(x.lo, y.lo), pick(x.hi, y.hi), r.wide_data, r.wrapped)
        else:
            return r
        if other is None or other.wrapped:
            return r
        if op == "<":
            return Range(r.lo, min(r.hi, other.hi - 1), r.wide_data, r.wrapped)
        if op == "<=":
            return Range(r.lo, min(r.hi, other.hi), r.wide_data, r.wrapped)
        if op == ">":
            return Range(max(r.lo, other.lo + 1), r.hi, r.wide_data, r.wrapped)
        return Range(max(r.lo, other.lo), r.hi, r.wide_data, r.wrapped)

    def _rounded(self, e) -> Range:
        """floor/ceil/int of a number: its bounds rounded, after widening them by what
        float32 arithmetic can add (the kernels compute numbers in float32)."""
        (x,) = e.args
        bounds = self._float_bounds(x)
        if bounds is None:
            self._fail(e, f"{e.fn}() needs a number whose range is known, so that the integer "
                          f"it gives is too, but `{ir.print_expr(x)}` can be anything (it reads "
                          "the score s or a float input, divides by a value that can be 0, or takes "
                          "log or sqrt of one that can be 0 or less); bound it with min and "
                          f"max, as in {e.fn}(min(max(x, 0.0), 100.0))")
            return Range(INT64_MIN, INT64_MAX)
        lo, hi = bounds
        # IEEE + - * / round monotonically, so a bound their exact values respect is
        # respected by the float32 values up to a relative error. exp, log, tanh and sqrt
        # on a GPU are approximations, off by an absolute amount near 0 as well.
        near_zero = float(any(isinstance(n, ir.Call) and n.fn in FLOAT_FUNCTIONS
                              for n in ir.walk(x)))
        lo, hi = lo - FLOAT_SLACK * (near_zero + abs(lo)), hi + FLOAT_SLACK * (near_zero + abs(hi))
        rounded = entry_of(e).interval(NUMBERS, Bounds(lo, hi))
        return self._result(e, rounded.lo, rounded.hi, [])

    def _float_bounds(self, e):
        """(lo, hi) of a number-valued node, finite, or None where unknown."""
        return _FloatBounds(self)(e)

    def _division(self, e, a, b):
        """`/`, `//` and `%`: refused where the divisor can be 0."""
        if e.op == "/" or (a is None or b is None):
            # True division, or a float // or %: IEEE gives inf or NaN for a divisor that
            # happens to be 0, as the reference does; a constant 0 is a mistake.
            if _is_zero_constant(e.rhs, self.params) or (b is not None and b.lo == b.hi == 0):
                self._fail(e, f"division by zero: the divisor of '{e.op}' is 0")
            return None
        if a is None or b is None:
            return None
        kids = [a, b]
        # // and %: the divisor must not be 0 on any call.
        if b.lo <= 0 <= b.hi:
            if b.lo == b.hi == 0:
                self._fail(e, f"division by zero: the divisor of '{e.op}' is 0")
            else:
                self._fail(e, f"the divisor of '{e.op}' can be 0 (it ranges over "
                              f"{_interval(b)}), where '{e.op}' has no value; bound it away "
                              "from 0, as in max(x, 1)")
            return self._result(e, min(a.lo, -abs(a.hi)), max(a.hi, abs(a.lo)), kids)
        if e.op == "//":
            # Floor division is monotonic in each argument for a divisor of one sign.
            corners = [x // y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return self._result(e, min(corners), max(corners), kids)
        # %: the sign of the divisor, smaller in magnitude than it.
        if b.lo > 0:
            hi = b.hi - 1 if a.lo < 0 or a.hi >= b.hi else a.hi
            return self._result(e, 0, hi, kids)
        lo = b.lo + 1 if a.hi > 0 or a.lo <= b.lo else a.lo
        return self._result(e, lo, 0, kids)

    def _result(self, e, lo: int, hi: int, kids) -> Range:
        wide_data = any(k.wide_data for k in kids if k is not None)
        wrapped = any(k.wrapped for k in kids if k is not None)
        if INT64_MIN <= lo and hi <= INT64_MAX:
            return Range(lo, hi, wide_data, wrapped)
        if not wide_data:
            extreme = hi if hi > INT64_MAX else lo
            self._fail(e, f"this integer expression can reach {_big(extreme)}, beyond the 64-bit "
                          "integers that the kernels and the reference compute in")
        return Range(max(lo, INT64_MIN), min(hi, INT64_MAX), wide_data, True)


# Relative widening of a number's bounds before rounding: float32 rounds each operation by
# 2**-24 of its value, and a chain of a few operations (and GPU log/exp, a few ulp off)
# stays far below 1e-4. Wider bounds are only less tight, never wrong.
FLOAT_SLACK = 1e-4
# Past this a float32 computation may have overflowed to inf.
FLOAT_LIMIT = 1e30


def _finite(lo: float, hi: float):
    if math.isfinite(lo) and math.isfinite(hi) and -FLOAT_LIMIT < lo and hi < FLOAT_LIMIT:
        return lo, hi
    return None


class _FloatBounds(ir.Visitor):
    """(lo, hi) of a number-valued node, finite, or None where unknown; integer nodes
    from their ranges, operations by the table's rules."""

    def __init__(self, analysis: _Analysis):
        self.analysis = analysis

    def __call__(self, e):
        r = self.analysis.ranges.get(id(e))
        if r is not None:  # an integer node, promoted
            return None if r.wrapped else (float(r.lo), float(r.hi))
        return super().__call__(e)

    def Const(self, e):
        return _finite(e.value, e.value) if e.type == ir.FLOAT else None

    def Param(self, e):
        v = self.analysis.params[e.name]
        return _finite(v, v) if isinstance(v, float) else None

    def Where(self, e):
        kids = [self(e.then), self(e.other)]
        return None if None in kids else self._ruled(e, UNKNOWN_TRUTH, *map(Bounds._make, kids))

    def BinOp(self, e):
        kids = [self(c) for c in ir.children(e)]
        if None in kids:
            return None
        if e.op in ("+", "-", "*"):
            return self._ruled(e, *map(Bounds._make, kids))
        (alo, ahi), (blo, bhi) = kids
        if blo <= 0 <= bhi:
            return None  # a divisor that can be 0
        corners = [x / y for x in (alo, ahi) for y in (blo, bhi)]
        if e.op == "/":
            return _finite(min(corners), max(corners))
        if e.op == "//":
            return _finite(math.floor(min(corners)), math.floor(max(corners)))
        return (0.0, bhi) if blo > 0 else (blo, 0.0)  # %: the sign of the divisor

    def Neg(self, e):
        kids = [self(c) for c in ir.children(e)]
        return None if not kids or None in kids else self._ruled(e, *map(Bounds._make, kids))

    Call = Neg

    def _ruled(self, e, *operands):
        bounds = entry_of(e).interval(NUMBERS, *operands)
        return _finite(*bounds) if isinstance(bounds, Bounds) else None  # chance: a truth

    def other(self, e):
        return None  # s, float inputs, conditions


def _is_zero_constant(e, params: dict) -> bool:
    if isinstance(e, ir.Neg):
        return _is_zero_constant(e.operand, params)
    if isinstance(e, ir.Const) and e.type != ir.BOOL:
        return e.value == 0
    if isinstance(e, ir.Param):
        v = params[e.name]
        return not isinstance(v, bool) and v == 0
    return False


def _interval(r: Range) -> str:
    return f"[{_big(r.lo)}, {_big(r.hi)}]"


def _big(n: int) -> str:
    if abs(n) < 10 ** 12:
        return str(n)
    exponent = f"{math.log2(abs(n)):.1f}".removesuffix(".0")
    return f"about {'-' if n < 0 else ''}2**{exponent}"


def _context(variant: ir.Variant):
    return ({p.name: p.value for p in variant.params}, {i.name: i for i in variant.inputs},
            variant.block)


def _heads(variant: ir.Variant):
    return variant.heads.q if variant.heads else None


def check(e, params: dict, inputs: dict, block=None, on_error=None):
    """Refuse `e` (a SpecError) where a division can be by zero or an expression can
    leave 64 bits without reading i64 data. `on_error(node, err)` may locate the error
    before it is raised (the parser does)."""
    analysis = _Analysis(params, inputs, block, MAX_EXTENT)
    analysis.run(e)
    if analysis.problems:
        node, message = analysis.problems[0]  # innermost first: children are analysed first
        err = SpecError(message)
        if on_error:
            on_error(node, err)
        raise err


def check_variant(v: ir.Variant):
    """check() on every expression of a variant (the decorator's path)."""
    params, inputs, block = _context(v)
    for decl in ("scale", "mask", "layout", "score", "sink", "weight"):
        e = getattr(v, decl)
        if e is not None:
            try:
                check(e, params, inputs, block)
            except SpecError as err:
                raise SpecError(f"in `{decl}`: {err.message}") from None


def ranges_at(e, variant: ir.Variant, extent: int = MAX_EXTENT) -> dict:
    """{id(node): Range} for the integer nodes of `e` at `extent`."""
    analysis = _Analysis(*_context(variant), extent, _heads(variant))
    analysis.run(e)
    return analysis.ranges


def wraps(e, variant: ir.Variant) -> set:
    """ids of the integer nodes of `e` whose value may have wrapped in 64 bits (arithmetic
    on i64 data), here or below: interval reasoning about them would be unsound."""
    return {i for i, r in ranges_at(e, variant).items() if r.wrapped}


def fits_int32(e, variant: ir.Variant, extent: int) -> bool:
    ranges = ranges_at(e, variant, extent)
    return all(r.fits(INT32_MIN, INT32_MAX) and not r.wide_data for r in ranges.values())


def int32_extent(e, variant: ir.Variant):
    """The largest extent (<= MAX_EXTENT) at which every integer node of `e` fits in 32
    bits, or None when none does (a constant past 2**31, a read of i64 data)."""
    if e is None or fits_int32(e, variant, MAX_EXTENT):
        return MAX_EXTENT
    if not fits_int32(e, variant, 1):
        return None
    lo, hi = 1, MAX_EXTENT  # fits at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_int32(e, variant, mid) else (lo, mid)
    return lo
