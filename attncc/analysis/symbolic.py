"""IR <-> sympy: how the language's operations read in sympy and back, through the
`sympy` column of attncc/operators.py. The one bridge between the two: the loop bounds
(attncc/analysis/bounds.py) read a mask's comparisons as affine forms of q and k, and
the backward (attncc/codegen/derivative.py) reads the score as a function of s and
prints its derivative.

`ToSympy` translates operations; what the leaves become (position symbols, the score,
opaque values) and which operations a reader takes are its subclasses' to say;
`IntegerPolynomial` is the reader of index arithmetic (+ - * on integers) both analyses
share.
`operation_of` goes back from a sympy function to the table entry it is the form of.
"""
from __future__ import annotations

import functools

import sympy

from .. import ir
from ..operators import FUNCTIONS, OPAQUE, entry_of


class NotSymbolic(Exception):
    """`node` has no sympy form for this reader (an operation it does not take, or one
    with none: // and %; a leaf it cannot name)."""

    def __init__(self, node):
        super().__init__(ir.print_expr(node))
        self.node = node


class ToSympy(ir.Visitor):
    """IR -> sympy. Subclasses give the leaves (Var, Const, Param, Load), `takes` (which
    operations they read) and `opaque` (the value of a piecewise-constant operation)."""

    def takes(self, entry) -> bool:
        return True

    def opaque(self, e):
        raise NotSymbolic(e)

    def condition(self, e):
        """An operand that is a condition (of and, or, not, and where's first)."""
        return self(e)

    def _form(self, e):
        """The sympy form of operation `e`, or NotSymbolic before any operand is read."""
        entry = entry_of(e)
        if entry.sympy is None or not self.takes(entry):
            raise NotSymbolic(e)
        return entry.sympy

    def _operation(self, e, operands):
        if entry_of(e).sympy is OPAQUE:
            return self.opaque(e)
        form = self._form(e)
        return form(sympy, *operands())

    def BinOp(self, e):
        return self._operation(e, lambda: (self(e.lhs), self(e.rhs)))

    Cmp = BinOp

    def Neg(self, e):
        return self._operation(e, lambda: (self(e.operand),))

    def And(self, e):
        return self._operation(e, lambda: (self.condition(e.lhs), self.condition(e.rhs)))

    Or = And

    def Not(self, e):
        return self._operation(e, lambda: (self.condition(e.operand),))

    def Call(self, e):
        return self._operation(e, lambda: tuple(self(a) for a in e.args))

    def Where(self, e):
        # The branch first, then the condition: the order a reader's opaque values are
        # numbered in, which sympy orders terms by.
        def operands():
            then = self(e.then)
            return self.condition(e.cond), then, self(e.other)
        return self._operation(e, operands)

    def other(self, e):
        raise NotSymbolic(e)



class IntegerPolynomial(ToSympy):
    """A polynomial with integer coefficients: + - * only, integer constants and integer
    parameters. Subclasses name the variables (Var)."""

    def __init__(self, params: dict):
        self.params = params

    def takes(self, entry) -> bool:
        return entry.name in ("+", "-", "*", "neg")

    def Const(self, e):
        if e.type != ir.INT:
            raise NotSymbolic(e)
        return sympy.Integer(e.value)

    def Param(self, e):
        value = self.params[e.name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise NotSymbolic(e)
        return sympy.Integer(value)

@functools.lru_cache(maxsize=None)
def _functions() -> dict:
    """sympy function class -> the table's entry whose form it is (exp, Abs, Min, ...)."""
    out = {}
    for entry in FUNCTIONS.values():
        if not callable(entry.sympy) or isinstance(entry.arity, tuple):
            continue
        form = entry.sympy(sympy, *sympy.symbols(f"x0:{entry.arity}", real=True))
        if form.func not in (sympy.Add, sympy.Mul, sympy.Pow):  # sqrt is a power
            out[form.func] = entry
    return out


def operation_of(x):
    """The table entry whose sympy form `x` (a sympy function application) is, or None."""
    return _functions().get(x.func)
