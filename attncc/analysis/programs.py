"""The small IR of what the analyses compute per tile, for a backend to print: values
built from primitive operations, and straight-line programs naming them.

The loop bounds of attncc/analysis/bounds.py are values; the tile classification of
attncc/analysis/intervals.py is a program (`Program`). A backend's printer
(attncc/codegen/plan_code.py) writes them in its words and reports the helpers and
names it used.

    Op(fn, args)   a primitive (PRIMITIVES) applied to values
    Lit(value)     a Python int, float or bool
    Temp(n)        the value a program's n-th step named
    Tile(var, end) the first ("lo") or last ("hi") position of the tile's `var` (q or k)

and the leaves one analysis makes: ir.Var for an index name the tile shares
(intervals), a per-block summary read (intervals.Summary), an affine sympy form of the
positions (bounds.Affine), no bound at all (bounds.UNBOUNDED).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# fn -> what it computes. The arithmetic and comparisons are Python's on the values.
PRIMITIVES = {
    "+": "sum", "-": "difference", "*": "product", "neg": "minus x",
    "min": "the smaller", "max": "the larger", "where": "where(c, a, b): a if c else b",
    "fdiv": "floor division (by a constant)", "mod": "remainder with the divisor's sign",
    "<": "less", "<=": "at most", ">": "greater", ">=": "at least", "==": "equal",
    "!=": "not equal",
    "and": "both conditions", "or": "either condition", "not": "x == 0: the condition fails",
    "nonzero": "x != 0: a summary read as a condition",
    "known": "(may == must): a condition is decided, as a unit",
    "nonpositive": "(x <= 0), as a unit: an affine side condition of a loop bound",
}


@dataclass(frozen=True)
class Op:
    fn: str  # a key of PRIMITIVES
    args: tuple


@dataclass(frozen=True)
class Lit:
    value: int | float | bool


@dataclass(frozen=True)
class Temp:
    n: int


@dataclass(frozen=True)
class Tile:
    var: str  # "q" or "k"
    end: str  # "lo" or "hi"


@dataclass
class Program:
    """Straight-line steps (Temp, value), each naming a value the later ones read."""
    steps: list = field(default_factory=list)

    def name(self, value) -> Temp:
        temp = Temp(len(self.steps))
        self.steps.append((temp, value))
        return temp
