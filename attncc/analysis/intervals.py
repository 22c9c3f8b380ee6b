"""Tile classification by interval arithmetic: may a tile attend, must all of it attend?

Skipping level 2 (docs/design.md, "Tiles and loop segments"). Each sub-expression of the mask gets bounds over the
tile — (lo, hi) for numbers, (may, must) for conditions — from the tile's position
ranges and from per-block min/max summaries of the tensors it reads. `may` is false
only when no pair in the tile can attend (skip the tile); `must` is true only when
every pair attends (no per-element mask). Both are sound by construction: interval
arithmetic over-approximates. What it cannot bound (a tensor read at a computed
index, float functions) becomes "unknown": may true, must false.

The output is straight-line code (statements plus two names) over scalars named
`q_lo, q_hi, k_lo, k_hi, off_b, off_h, len_q, len_k` and helper functions `_min, _max,
_where, _fdiv, _mod`. The generated Triton module runs it per tile; the tests and the
layout-table builder run the same text with torch tensors (see `classify_dense`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ir
from . import ranges

UNKNOWN = None


@dataclass
class SummaryRead:
    """A per-block min/max summary the code reads: `tensor` along `axis`, blocked by `var`."""
    tensor: str
    axis: int
    var: str  # "q" or "k": which tile's blocks


@dataclass
class IntervalCode:
    lines: list = field(default_factory=list)
    may: str = "True"
    must: str = "False"
    summaries: list = field(default_factory=list)  # of SummaryRead


class _Emitter:
    def __init__(self, params: dict, inputs: dict, summary_code, prefix: str, wrapped=frozenset()):
        self.params = params
        self.inputs = inputs
        self.wrapped = wrapped  # ids of nodes whose value may have wrapped (i64 arithmetic)
        self.summary_code = summary_code  # (SummaryRead, other index codes, "lo"|"hi") -> code
        self.prefix = prefix
        self.out = IntervalCode()
        self.n = 0

    def tmp(self, code: str) -> str:
        if code.replace("_", "").isalnum() or code in ("True", "False"):
            return code
        name = f"{self.prefix}{self.n}"
        self.n += 1
        self.out.lines.append(f"{name} = {code}")
        return name

    # ---- numbers: (lo, hi) code, or UNKNOWN
    def num(self, e):
        if id(e) in self.wrapped:
            return UNKNOWN  # a wrapped value is not between its operands' bounds
        if isinstance(e, ir.Const):
            v = int(e.value) if e.type == ir.INT else float(e.value)
            return (repr(v), repr(v))
        if isinstance(e, ir.Param):
            v = self.params[e.name]
            v = int(v) if isinstance(v, bool) else v
            return (repr(v), repr(v))
        if isinstance(e, ir.Var):
            if e.name in ("q", "k"):
                return (f"{e.name}_lo", f"{e.name}_hi")
            name = {"b": "off_b", "h": "off_h", "dim": "HEAD_DIM"}.get(e.name, e.name)
            return (name, name)
        if isinstance(e, ir.Neg):
            x = self.num(e.operand)
            return UNKNOWN if x is UNKNOWN else (self.tmp(f"-{x[1]}"), self.tmp(f"-{x[0]}"))
        if isinstance(e, ir.BinOp):
            return self.binop(e)
        if isinstance(e, ir.Call):
            return self.call(e)
        if isinstance(e, ir.Where):
            c = self.cond(e.cond)
            a, b = self.num(e.then), self.num(e.other)
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            may, must = c
            lo = self.tmp(f"_where({must}, {a[0]}, _where({may}, _min({a[0]}, {b[0]}), {b[0]}))")
            hi = self.tmp(f"_where({must}, {a[1]}, _where({may}, _max({a[1]}, {b[1]}), {b[1]}))")
            return (lo, hi)
        if isinstance(e, ir.Load):
            return self.load(e)
        return UNKNOWN

    def exact(self, e):
        """Code for an expression that is the same everywhere in the tile, else None."""
        r = self.num(e)
        if r is UNKNOWN or r[0] != r[1]:
            return None
        return r[0]

    def load(self, e: ir.Load):
        decl = self.inputs[e.tensor]
        if decl.type == ir.FLOAT:
            return UNKNOWN  # float tensors rarely decide masks; not summarised
        # Summarised when exactly one index is the bare position q or k, along a position
        # axis (of either extent: `doc[k]` with `doc: i32[q]` is the usual self-attention
        # document mask) or one of fixed size, and every other index is the same for the
        # whole tile. Positions past the axis read its last entry, as the kernels clamp.
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
            code = self.exact(x)
            if code is None:
                return UNKNOWN
            others.append(code)
        read = SummaryRead(e.tensor, axis, e.indices[axis].name)
        if read not in self.out.summaries:
            self.out.summaries.append(read)
        return (self.tmp(self.summary_code(read, others, "lo")),
                self.tmp(self.summary_code(read, others, "hi")))

    def binop(self, e):
        a, b = self.num(e.lhs), self.num(e.rhs)
        if a is UNKNOWN or b is UNKNOWN:
            return UNKNOWN
        if e.op == "+":
            return (self.tmp(f"{a[0]} + {b[0]}"), self.tmp(f"{a[1]} + {b[1]}"))
        if e.op == "-":
            return (self.tmp(f"{a[0]} - {b[1]}"), self.tmp(f"{a[1]} - {b[0]}"))
        if e.op == "*":
            p = [self.tmp(f"{x} * {y}") for x in a for y in b]
            return (self.tmp(f"_min(_min({p[0]}, {p[1]}), _min({p[2]}, {p[3]}))"),
                    self.tmp(f"_max(_max({p[0]}, {p[1]}), _max({p[2]}, {p[3]}))"))
        const = self._positive_int_const(e.rhs)
        if e.op == "//" and const:
            return (self.tmp(f"_fdiv({a[0]}, {const})"), self.tmp(f"_fdiv({a[1]}, {const})"))
        if e.op == "%" and const:
            # One period: the residues are in order; otherwise anything in [0, c).
            same = self.tmp(f"_fdiv({a[0]}, {const}) == _fdiv({a[1]}, {const})")
            return (self.tmp(f"_where({same}, _mod({a[0]}, {const}), 0)"),
                    self.tmp(f"_where({same}, _mod({a[1]}, {const}), {const - 1})"))
        return UNKNOWN

    def _positive_int_const(self, e):
        if isinstance(e, ir.Const) and e.type == ir.INT and e.value > 0:
            return e.value
        if isinstance(e, ir.Param):
            v = self.params[e.name]
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    def call(self, e):
        args = [self.num(a) for a in e.args]
        if any(a is UNKNOWN for a in args):
            return UNKNOWN
        if e.fn == "abs":
            (lo, hi), = args
            return (self.tmp(f"_where({lo} >= 0, {lo}, _where({hi} <= 0, -{hi}, 0))"),
                    self.tmp(f"_max(-{lo}, {hi})"))
        if e.fn in ("min", "max"):
            (alo, ahi), (blo, bhi) = args
            f = "_min" if e.fn == "min" else "_max"
            return (self.tmp(f"{f}({alo}, {blo})"), self.tmp(f"{f}({ahi}, {bhi})"))
        return UNKNOWN  # exp/log/tanh/sqrt: kept out of tile decisions (NaN-prone bounds)

    # ---- conditions: (may, must) code
    def cond(self, e):
        if isinstance(e, ir.Const):
            return ("True", "True") if e.value else ("False", "False")
        if isinstance(e, ir.Param):
            v = "True" if self.params[e.name] else "False"
            return (v, v)
        if isinstance(e, ir.And):
            (a_may, a_must), (b_may, b_must) = self.cond(e.lhs), self.cond(e.rhs)
            return (self._and(a_may, b_may), self._and(a_must, b_must))
        if isinstance(e, ir.Or):
            (a_may, a_must), (b_may, b_must) = self.cond(e.lhs), self.cond(e.rhs)
            return (self._or(a_may, b_may), self._or(a_must, b_must))
        if isinstance(e, ir.Not):
            may, must = self.cond(e.operand)
            return (self._not(must), self._not(may))
        if isinstance(e, ir.Cmp):
            return self.cmp(e)
        if isinstance(e, ir.Where):
            c_may, c_must = self.cond(e.cond)
            (a_may, a_must), (b_may, b_must) = self.cond(e.then), self.cond(e.other)
            may = self.tmp(f"_where({c_must}, {a_may}, _where({c_may}, {a_may} | {b_may}, {b_may}))")
            must = self.tmp(f"_where({c_must}, {a_must}, _where({c_may}, {a_must} & {b_must}, {b_must}))")
            return (may, must)
        if isinstance(e, ir.Load):
            r = self.load(e)  # bool tensor: min is "all true", max is "any true"
            if r is UNKNOWN:
                return ("True", "False")
            return (self.tmp(f"{r[1]} != 0"), self.tmp(f"{r[0]} != 0"))
        return ("True", "False")

    def _and(self, a, b):
        if "False" in (a, b):
            return "False"
        if a == "True":
            return b
        if b == "True":
            return a
        return self.tmp(f"{a} & {b}")

    def _or(self, a, b):
        if "True" in (a, b):
            return "True"
        if a == "False":
            return b
        if b == "False":
            return a
        return self.tmp(f"{a} | {b}")

    def _not(self, a):
        if a in ("True", "False"):
            return "False" if a == "True" else "True"
        return self.tmp(f"{a} == 0")

    def cmp(self, e):
        if self._is_bool(e.lhs):
            # Equality of two conditions: decided only when both are decided.
            (a_may, a_must), (b_may, b_must) = self.cond(e.lhs), self.cond(e.rhs)
            a_known = self.tmp(f"({a_may} == {a_must})")
            b_known = self.tmp(f"({b_may} == {b_must})")
            same = self.tmp(f"{a_known} & {b_known} & ({a_must} == {b_must})")
            diff = self.tmp(f"{a_known} & {b_known} & ({a_must} != {b_must})")
            if e.op == "==":
                return (self._not(diff), same)
            return (self._not(same), diff)
        a, b = self.num(e.lhs), self.num(e.rhs)
        if a is UNKNOWN or b is UNKNOWN:
            return ("True", "False")
        (alo, ahi), (blo, bhi) = a, b
        if e.op == "<":
            return (self.tmp(f"{alo} < {bhi}"), self.tmp(f"{ahi} < {blo}"))
        if e.op == "<=":
            return (self.tmp(f"{alo} <= {bhi}"), self.tmp(f"{ahi} <= {blo}"))
        if e.op == ">":
            return (self.tmp(f"{ahi} > {blo}"), self.tmp(f"{alo} > {bhi}"))
        if e.op == ">=":
            return (self.tmp(f"{ahi} >= {blo}"), self.tmp(f"{alo} >= {bhi}"))
        overlap = self.tmp(f"({alo} <= {bhi}) & ({blo} <= {ahi})")
        single = self.tmp(f"({alo} == {ahi}) & ({blo} == {bhi}) & ({alo} == {blo})")
        if e.op == "==":
            return (overlap, single)
        return (self._not(single), self._not(overlap))  # !=

    def _is_bool(self, e):
        return isinstance(e, (ir.Cmp, ir.And, ir.Or, ir.Not)) or (
            isinstance(e, ir.Const) and e.type == ir.BOOL) or (
            isinstance(e, ir.Param) and isinstance(self.params[e.name], bool)) or (
            isinstance(e, ir.Load) and self.inputs[e.tensor].type == ir.BOOL) or (
            isinstance(e, ir.Where) and self._is_bool(e.then))


def classify_code(mask, variant: ir.Variant, summary_code, prefix: str = "_iv") -> IntervalCode:
    """Straight-line code computing `may` and `must` for one tile of `mask`."""
    wrapped = ranges.wraps(mask, variant) if mask is not None else set()
    em = _Emitter({p.name: p.value for p in variant.params}, {i.name: i for i in variant.inputs},
                  summary_code, prefix, wrapped)
    if mask is None:
        em.out.may, em.out.must = "True", "True"
    else:
        em.out.may, em.out.must = em.cond(mask)
    return em.out
