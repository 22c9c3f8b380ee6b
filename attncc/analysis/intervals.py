"""Tile classification by interval arithmetic: may a tile attend, must all of it attend?

Skipping level 2 (docs/design.md, "Tiles and loop segments"). Each sub-expression of the mask gets bounds over the
tile — Bounds(lo, hi) for numbers, Truth(may, must) for conditions — from the tile's
position ranges and from per-block min/max summaries of the tensors it reads, by the
interval rules of attncc/operators.py. `may` is false only when no pair in the tile
can attend (skip the tile); `must` is true only when every pair attends (no
per-element mask). Both are sound by construction: interval arithmetic
over-approximates. What it cannot bound (a tensor read at a computed index, float
functions) becomes "unknown": may true, must false.

The result is a straight-line program (attncc/analysis/programs.py) over the tile's
positions (Tile), the index names it shares (off_b, off_h, dim, len_q, len_k as
ir.Var) and the summaries it reads (Summary); a backend prints it
(attncc/codegen/plan_code.py). The generated module runs it for every tile at once on
the host, and the tests run the same text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ir
from ..operators import UNKNOWN, UNKNOWN_TRUTH, Bounds, Truth, entry_of
from . import ranges
from .programs import Lit, Op, Program, Temp, Tile


@dataclass(frozen=True)
class SummaryRead:
    """A per-block min/max summary the code reads: `tensor` along `axis`, blocked by `var`."""
    tensor: str
    axis: int
    var: str  # "q" or "k": which tile's blocks


@dataclass(frozen=True)
class Summary:
    """The smallest ("lo") or largest ("hi") entry of one block of a summary read, the
    block of the tile's position along the read axis; `others`: the other indices
    (values the whole tile shares), None at the read axis."""
    read: SummaryRead
    others: tuple
    which: str


@dataclass
class Classification:
    """The program, the may and must it computes, and the summaries it reads."""
    program: Program = field(default_factory=Program)
    may: object = Lit(True)
    must: object = Lit(False)
    summaries: list = field(default_factory=list)  # of SummaryRead


def _lift(x):
    return Lit(x) if isinstance(x, (bool, int, float)) else x


def _is(x, value: bool) -> bool:
    return isinstance(x, Lit) and x.value is value


class _Code:
    """The interval algebra (operators.ALGEBRA) that writes a program: each operation an
    Op, each value used twice (`let`) a step of its own."""

    def __init__(self, program: Program, params: dict):
        self.program = program
        self.params = params

    def named(self, x):
        """x itself where it is a name or a plain literal, else a step naming it."""
        x = _lift(x)
        if isinstance(x, (Temp, Tile, ir.Var)):
            return x
        if isinstance(x, Lit) and repr(x.value).isalnum():
            return x
        return self.program.name(x)

    let = named

    def _op(self, fn, *args):
        return Op(fn, tuple(_lift(a) for a in args))

    def add(self, x, y):
        return self._op("+", x, y)

    def sub(self, x, y):
        return self._op("-", x, y)

    def mul(self, x, y):
        return self._op("*", x, y)

    def neg(self, x):
        return self._op("neg", x)

    def min(self, x, y):
        return self._op("min", x, y)

    def max(self, x, y):
        return self._op("max", x, y)

    def where(self, c, x, y):
        return self._op("where", c, x, y)

    def lt(self, x, y):
        return self._op("<", x, y)

    def le(self, x, y):
        return self._op("<=", x, y)

    def gt(self, x, y):
        return self._op(">", x, y)

    def ge(self, x, y):
        return self._op(">=", x, y)

    def eq(self, x, y):
        return self._op("==", x, y)

    def ne(self, x, y):
        return self._op("!=", x, y)

    def both(self, x, y):
        return self._op("and", x, y)

    def either(self, x, y):
        return self._op("or", x, y)

    def conj(self, x, y):
        x, y = _lift(x), _lift(y)
        if _is(x, False) or _is(y, False):
            return Lit(False)
        if _is(x, True):
            return y
        if _is(y, True):
            return x
        return self.both(x, y)

    def disj(self, x, y):
        x, y = _lift(x), _lift(y)
        if _is(x, True) or _is(y, True):
            return Lit(True)
        if _is(x, False):
            return y
        if _is(y, False):
            return x
        return self.either(x, y)

    def negate(self, x):
        x = _lift(x)
        if isinstance(x, Lit) and isinstance(x.value, bool):
            return Lit(not x.value)
        return self._op("not", x)

    def known(self, t: Truth):
        return self._op("known", t.may, t.must)

    def fdiv(self, x, c):
        return self._op("fdiv", x, c)

    def mod(self, x, c):
        return self._op("mod", x, c)

    def positive_int(self, b: Bounds):
        lo, hi = b
        if lo == hi and isinstance(lo, Lit) and type(lo.value) is int and lo.value > 0:
            return lo.value
        return None

    def increasing(self, fn, a, domain):
        return UNKNOWN  # exp/log/tanh/sqrt, rounding: kept out of tile decisions (NaN-prone bounds)


class _Classify(ir.Visitor):
    """Bounds or Truth of each node over one tile, its code written into a program."""

    def __init__(self, params: dict, inputs: dict, out: Classification, wrapped=frozenset()):
        self.params = params
        self.inputs = inputs
        self.wrapped = wrapped  # ids of nodes whose value may have wrapped (i64 arithmetic)
        self.out = out
        self.code = _Code(out.program, params)

    def __call__(self, e):
        if id(e) in self.wrapped:
            return UNKNOWN  # a wrapped value is not between its operands' bounds
        return super().__call__(e)

    def _named(self, r):
        if isinstance(r, Truth):
            return Truth(self.code.named(r.may), self.code.named(r.must))
        if isinstance(r, Bounds):
            return Bounds(self.code.named(r.lo), self.code.named(r.hi))
        return r

    def Const(self, e):
        if e.type == ir.BOOL:
            return Truth(Lit(e.value), Lit(e.value))
        v = Lit(int(e.value) if e.type == ir.INT else float(e.value))
        return Bounds(v, v)

    def Param(self, e):
        v = self.params[e.name]
        if isinstance(v, bool):
            return Truth(Lit(v), Lit(v))
        return Bounds(Lit(v), Lit(v))

    def Var(self, e):
        if e.name in ("q", "k"):
            return Bounds(Tile(e.name, "lo"), Tile(e.name, "hi"))
        return Bounds(e, e)

    def exact(self, e):
        """The value of an expression that is the same everywhere in the tile, else None."""
        r = self(e)
        if r is UNKNOWN or r.lo != r.hi:
            return None
        return r.lo

    def _summary(self, e: ir.Load):
        """Bounds of a read from its per-block summary, or UNKNOWN.

        Summarised when exactly one index is the bare position q or k, along a position
        axis (of either extent: `doc[k]` with `doc: i32[q]` is the usual self-attention
        document mask) or one of fixed size, and every other index is the same for the
        whole tile. Positions past the axis read its last entry, as the kernels clamp."""
        decl = self.inputs[e.tensor]
        if decl.type == ir.FLOAT:
            return UNKNOWN  # float tensors rarely decide masks; not summarised
        pos = [i for i, x in enumerate(e.indices)
               if isinstance(x, ir.Var) and x.name in ("q", "k")
               and (decl.axes[i] in ("q", "k") or isinstance(decl.axes[i], int))]
        if len(pos) != 1:
            return UNKNOWN
        axis = pos[0]
        others = []
        for i, x in enumerate(e.indices):
            if i == axis:
                others.append(None)
                continue
            value = self.exact(x)
            if value is None:
                return UNKNOWN
            others.append(value)
        read = SummaryRead(e.tensor, axis, e.indices[axis].name)
        if read not in self.out.summaries:
            self.out.summaries.append(read)
        return Bounds(self.code.named(Summary(read, tuple(others), "lo")),
                      self.code.named(Summary(read, tuple(others), "hi")))

    def Load(self, e):
        r = self._summary(e)
        if self.inputs[e.tensor].type != ir.BOOL:
            return r
        if r is UNKNOWN:  # a bool tensor: its min is "all true", its max "any true"
            return UNKNOWN_TRUTH
        return self._named(Truth(Op("nonzero", (r.hi,)), Op("nonzero", (r.lo,))))

    def Member(self, e):
        return UNKNOWN_TRUTH

    def other(self, e):
        """An operation: its interval rule (attncc/operators.py) on its operands'."""
        operands = [self(x) for x in ir.children(e)]
        return self._named(entry_of(e).interval(self.code, *operands))


def classify(mask, variant: ir.Variant) -> Classification:
    """The program computing `may` and `must` for one tile of `mask`."""
    wrapped = ranges.wraps(mask, variant) if mask is not None else set()
    out = Classification()
    if mask is None:
        out.may, out.must = Lit(True), Lit(True)
        return out
    walk = _Classify({p.name: p.value for p in variant.params}, {i.name: i for i in variant.inputs},
                     out, wrapped)
    truth = walk(mask)
    out.may, out.must = (_lift(x) for x in truth)
    return out
