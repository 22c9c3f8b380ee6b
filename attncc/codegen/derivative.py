"""Symbolic derivatives of `score`, with sympy, printed as Triton code.

The backward needs d score / d s (softcap gives 1 - tanh², ALiBi 1, s*s gives 2s) and,
for each `learnable` input read by the score, d score / d (that element). The score is
translated to sympy with `s` and each learnable read as symbols and every other
s-free piece (positions, other tensor reads) as an opaque symbol that prints back as
the forward's own code; sympy differentiates and simplifies; a small printer turns the
result into Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .. import ir
from .elementwise import TritonEmitter
from ..errors import SpecError

S = sympy.Symbol("s", real=True)


@dataclass(frozen=True)
class ScoreGradients:
    d_ds: str  # Triton code for d score / d s
    d_inputs: tuple  # ((ir.Load, code for d score / d that element), ...)


class _ToSympy:
    def __init__(self, variant: ir.Variant):
        self.learnable = {i.name for i in variant.learnable_inputs}
        self.opaque: dict = {}  # sympy symbol name -> IR subtree
        self.loads: dict = {}  # symbol -> ir.Load (learnable)

    def _depends(self, e) -> bool:
        return any((isinstance(n, ir.Var) and n.name == "s") or
                   (isinstance(n, ir.Load) and n.tensor in self.learnable) for n in ir.walk(e))

    def _symbol(self, e, table, prefix):
        for sym, node in table.items():
            if node == e:
                return sympy.Symbol(sym, real=True)
        name = f"{prefix}{len(table)}"
        table[name] = e
        return sympy.Symbol(name, real=True)

    def __call__(self, e):
        if isinstance(e, ir.Var) and e.name == "s":
            return S
        if isinstance(e, ir.Load) and e.tensor in self.learnable:
            return self._symbol(e, self.loads, "_L")
        if not self._depends(e):
            if isinstance(e, ir.Const) and e.type != ir.BOOL:
                return sympy.nsimplify(e.value) if e.type == ir.FLOAT else sympy.Integer(e.value)
            return self._symbol(e, self.opaque, "_C")
        if isinstance(e, ir.BinOp):
            a, b = self(e.lhs), self(e.rhs)
            if e.op == "+":
                return a + b
            if e.op == "-":
                return a - b
            if e.op == "*":
                return a * b
            if e.op == "/":
                return a / b
            raise SpecError(f"the score applies '{e.op}' to the score or a learnable input, "
                            "which has no derivative; the backward cannot be generated")
        if isinstance(e, ir.Neg):
            return -self(e.operand)
        if isinstance(e, ir.Call) and e.fn in ir.ROUNDING_FUNCTIONS:
            # Piecewise constant: derivative 0 wherever it has one (as torch.floor's), so
            # it stays an opaque value, printed as the forward computes it.
            return self._symbol(e, self.opaque, "_C")
        if isinstance(e, ir.Call):
            args = [self(a) for a in e.args]
            return {"abs": lambda x: sympy.Abs(x), "min": sympy.Min, "max": sympy.Max,
                    "exp": sympy.exp, "log": sympy.log, "tanh": sympy.tanh,
                    "sqrt": sympy.sqrt}[e.fn](*args)
        if isinstance(e, ir.Where):
            return sympy.Piecewise((self(e.then), self.cond(e.cond)), (self(e.other), True))
        raise SpecError(f"cannot differentiate {type(e).__name__} in the score")

    def cond(self, e):
        if not self._depends(e):
            return sympy.Symbol(self._symbol(e, self.opaque, "_C").name)  # a boolean leaf
        if isinstance(e, ir.Cmp):
            a, b = self(e.lhs), self(e.rhs)
            return {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge,
                    "==": sympy.Eq, "!=": sympy.Ne}[e.op](a, b)
        if isinstance(e, ir.And):
            return sympy.And(self.cond(e.lhs), self.cond(e.rhs))
        if isinstance(e, ir.Or):
            return sympy.Or(self.cond(e.lhs), self.cond(e.rhs))
        if isinstance(e, ir.Not):
            return sympy.Not(self.cond(e.operand))
        raise SpecError(f"cannot differentiate the condition {type(e).__name__} in the score")


class _TritonPrinter:
    """sympy -> Triton; opaque symbols print as the forward's code for their IR."""

    def __init__(self, opaque_code: dict):
        self.opaque_code = opaque_code

    def __call__(self, x) -> str:
        if x is sympy.true or x == sympy.true:
            return "True"
        if x is sympy.false or x == sympy.false:
            return "False"
        if isinstance(x, sympy.Symbol):
            return "s" if x == S else self.opaque_code[x.name]
        if x.is_Number:
            return repr(float(x))
        if isinstance(x, sympy.Add):
            return "(" + " + ".join(self(a) for a in x.args) + ")"
        if isinstance(x, sympy.Mul):
            num, den = [], []
            for a in x.args:
                if isinstance(a, sympy.Pow) and a.exp.is_Number and a.exp < 0:
                    den.append(self(sympy.Pow(a.base, -a.exp)))
                else:
                    num.append(self(a))
            text = " * ".join(num) if num else "1.0"
            return f"({text})" if not den else f"({text} / ({' * '.join(den)}))"
        if isinstance(x, sympy.Pow):
            base, e = x.base, x.exp
            if e.is_Integer and 0 < e <= 4:
                return "(" + " * ".join([self(base)] * int(e)) + ")"
            if e.is_Integer and e < 0:
                return f"(1.0 / {self(sympy.Pow(base, -e))})"
            if e == sympy.Rational(1, 2):
                return f"tl.sqrt({self(base)})"
            if e == sympy.Rational(-1, 2):
                return f"(1.0 / tl.sqrt({self(base)}))"
            return f"tl.exp({self(e)} * tl.log({self(base)}))"
        fn = type(x).__name__
        if fn == "Piecewise":
            out = self(x.args[-1][0])
            for value, cond in reversed(x.args[:-1]):
                out = f"tl.where({self(cond)}, {self(value)}, {out})"
            return out
        args = [self(a) for a in x.args]
        simple = {"exp": "tl.exp", "log": "tl.log", "tanh": "_tanh", "Abs": "tl.abs"}
        if fn in simple:
            return f"{simple[fn]}({args[0]})"
        if fn == "sign":
            return f"tl.where({args[0]} > 0, 1.0, tl.where({args[0]} < 0, -1.0, 0.0))"
        if fn == "Heaviside":
            return f"tl.where({args[0]} > 0, 1.0, 0.0)"
        if fn == "cosh":
            return f"((tl.exp({args[0]}) + tl.exp(-{args[0]})) * 0.5)"
        if fn in ("Min", "Max"):
            f = "tl.minimum" if fn == "Min" else "tl.maximum"
            out = args[0]
            for a in args[1:]:
                out = f"{f}({out}, {a})"
            return out
        ops = {"StrictLessThan": "<", "LessThan": "<=", "StrictGreaterThan": ">",
               "GreaterThan": ">=", "Equality": "==", "Unequality": "!="}
        if fn in ops:
            return f"({args[0]} {ops[fn]} {args[1]})"
        if fn == "And":
            return "(" + " & ".join(args) + ")"
        if fn == "Or":
            return "(" + " | ".join(args) + ")"
        if fn == "Not":
            return f"({args[0]} == 0)"
        raise SpecError(f"internal: no Triton form for sympy {fn} in a score derivative")


def score_gradients(variant: ir.Variant, emit: TritonEmitter) -> ScoreGradients:
    """Triton code for the derivatives the backward needs (identity when no score)."""
    if variant.score is None:
        return ScoreGradients("1.0", ())
    to = _ToSympy(variant)
    expr = to(variant.score)
    opaque_code = {name: emit(node) for name, node in to.opaque.items()}
    opaque_code.update({name: emit(node) for name, node in to.loads.items()})
    printer = _TritonPrinter(opaque_code)
    # Unsimplified on purpose: simplify() turns 1 - tanh(x)**2 into 1/cosh(x)**2.
    d_ds = printer(sympy.diff(expr, S))
    d_inputs = tuple((node, printer(sympy.diff(expr, sympy.Symbol(name, real=True))))
                     for name, node in to.loads.items())
    return ScoreGradients(d_ds, d_inputs)
