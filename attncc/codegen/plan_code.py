"""The analyses' per-tile results as code: the loop bounds of attncc/analysis/bounds.py
and the tile classification of attncc/analysis/intervals.py (values and programs of
attncc/analysis/programs.py), written with the helpers every backend defines (`_min`,
`_fdiv`, ...: codegen/templates/expressions.py.jinja on the device; on the host,
tile_tables binds the same names to its own). Printing reports the helpers and names
it used (attncc/codegen/printed.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from sympy.printing.str import StrPrinter

from ..analysis import bounds, intervals
from ..analysis.programs import Op
from .printed import Code, Printer, used

BIG = str(1 << 62)  # "unbounded" inside loop-bound code, which runs in 64 bits
# Loop bounds run in 64 bits (once per program): a window of 2**31 - 1 must not wrap.
# The templates define len_q64 and len_k64 beside len_q and len_k.
WIDE_LENGTHS = {"len_q": "len_q64", "len_k": "len_k64"}

SPELLING = {
    "+": "{0} + {1}", "-": "{0} - {1}", "*": "{0} * {1}", "neg": "-{0}",
    "min": "_min({0}, {1})", "max": "_max({0}, {1})", "where": "_where({0}, {1}, {2})",
    "fdiv": "_fdiv({0}, {1})", "mod": "_mod({0}, {1})",
    "<": "{0} < {1}", "<=": "{0} <= {1}", ">": "{0} > {1}", ">=": "{0} >= {1}",
    "==": "{0} == {1}", "!=": "{0} != {1}",
    "and": "{0} & {1}", "or": "{0} | {1}", "not": "{0} == 0", "nonzero": "{0} != 0",
    "known": "({0} == {1})", "nonpositive": "({0} <= 0)",
}
HELPERS = {"min": "_min", "max": "_max", "where": "_where", "fdiv": "_fdiv", "mod": "_mod"}
# Python's & and | bind tighter than comparisons: a comparison under them is bracketed.
_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
# The tile's shared index names, as the code that runs the program names them.
_INDEX_CODE = {"b": "off_b", "h": "off_h", "dim": "HEAD_DIM"}


class _Sympy(StrPrinter):
    """sympy's own printing (its order of terms and all) with symbols renamed."""

    def __init__(self, names: dict, seen: set):
        super().__init__()
        self._names = names
        self._seen = seen

    def _print_Symbol(self, expr):
        name = self._names.get(expr.name, expr.name)
        self._seen.add(name)
        return name


class ProgramPrinter(Printer):
    """Values and programs of attncc/analysis/programs.py as code. `symbols`: renamed
    symbols of affine forms; `temp_prefix`: a program's step names; `summary(read,
    others, which)`: the code of a summary read, the others already printed."""

    def __init__(self, *, symbols: dict | None = None, temp_prefix: str = "_t", summary=None):
        super().__init__()
        self.symbols = symbols or {}
        self.temp_prefix = temp_prefix
        self.summary = summary

    def Op(self, e):
        args = []
        for a in e.args:
            text = self(a)
            bracket = e.fn in ("and", "or") and isinstance(a, Op) and a.fn in _COMPARISONS
            args.append(f"({text})" if bracket else text)
        if e.fn in HELPERS:
            self.use((HELPERS[e.fn],))
        return SPELLING[e.fn].format(*args)

    def Lit(self, e):
        return repr(e.value)

    def _name(self, name: str) -> str:
        self.use(names=(name,))
        return name

    def Temp(self, e):
        return self._name(f"{self.temp_prefix}{e.n}")

    def Tile(self, e):
        return self._name(f"{e.var}_{e.end}")

    def Var(self, e):
        return self._name(_INDEX_CODE.get(e.name, e.name))

    def Affine(self, e):
        seen = set()
        text = _Sympy(self.symbols, seen).doprint(e.expr)
        self.use(names=seen)
        return text

    def Unbounded(self, e):
        return BIG

    def Summary(self, e):
        others = [None if o is None else self(o) for o in e.others]
        return self.summary(e.read, others, e.which)

    def steps(self, program) -> list:
        """A program's steps, one `name = value` line each, as Code."""
        return [self.capture(lambda: f"{self(temp)} = {self(value)}") for temp, value in program.steps]


@dataclass(frozen=True)
class SegmentCode:
    """A loop segment's bounds as code (None: unbounded), as the templates read them,
    and what they use."""
    reach_lo: str | None
    reach_hi: str | None
    full_lo: str | None
    full_hi: str | None
    full_known: bool
    helpers: frozenset
    names: frozenset


def bound_code(bound) -> Code:
    """One loop bound (a value of attncc/analysis/bounds.py) as 64-bit code."""
    return ProgramPrinter(symbols=WIDE_LENGTHS).code(bound)


def segment_code(seg: bounds.Segment) -> SegmentCode:
    ends = [None if b is None else bound_code(b)
            for b in (seg.reach_lo, seg.reach_hi, seg.full_lo, seg.full_hi)]
    helpers, names = used(ends)
    return SegmentCode(*(None if c is None else c.text for c in ends), seg.full_known,
                       frozenset(helpers), frozenset(names))


@dataclass(frozen=True)
class ClassificationCode:
    """The tile classification as lines of code and the may and must they compute."""
    lines: list
    may: str
    must: str
    helpers: frozenset
    names: frozenset


def classification_code(c: intervals.Classification, summary, temp_prefix: str) -> ClassificationCode:
    printer = ProgramPrinter(temp_prefix=temp_prefix, summary=summary)
    pieces = printer.steps(c.program) + [printer.code(c.may), printer.code(c.must)]
    helpers, names = used(pieces)
    return ClassificationCode([p.text for p in pieces[:-2]], pieces[-2].text, pieces[-1].text,
                              frozenset(helpers), frozenset(names))
