"""Symbolic derivatives of `score`, with sympy, printed as Triton code.

The backward needs d score / d s (softcap gives 1 - tanh², ALiBi 1, s*s gives 2s) and,
for each `learnable` input read by the score, d score / d (that element). The score is
read into sympy (attncc/analysis/symbolic.py) with `s` and each learnable read as
symbols and every other s-free piece (positions, other tensor reads) as an opaque
symbol that prints back as the forward's own code; sympy differentiates; a small
printer turns the result into Triton, spelling the language's functions as the
`triton` column of attncc/operators.py does.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .. import ir
from ..analysis.symbolic import NotSymbolic, ToSympy, operation_of
from ..errors import SpecError
from ..frontend.checker import Scope, check_expr
from ..operators import FUNCTIONS, OPERATORS
from .elementwise import TritonEmitter
from .printed import Code, Printer

S = sympy.Symbol("s", real=True)


@dataclass(frozen=True)
class ScoreGradients:
    d_ds: Code  # Triton code for d score / d s
    d_inputs: tuple  # ((ir.Load, Code for d score / d that element), ...)


class _Score(ToSympy):
    """The score as a function of s and the learnable reads; what depends on neither is
    a constant or an opaque value."""

    def __init__(self, variant: ir.Variant):
        self.learnable = {i.name for i in variant.learnable_inputs}
        self.values: dict = {}  # sympy symbol name -> IR subtree (opaque values)
        self.loads: dict = {}  # symbol -> ir.Load (learnable)
        self.scope = Scope("score", {p.name: p for p in variant.params},
                           {i.name: i for i in variant.inputs})

    def _depends(self, e) -> bool:
        return any((isinstance(n, ir.Var) and n.name == "s") or
                   (isinstance(n, ir.Load) and n.tensor in self.learnable) for n in ir.walk(e))

    def _symbol(self, e, table, prefix):
        for sym, node in table.items():
            if node == e:
                return self._named(sym, node)
        name = f"{prefix}{len(table)}"
        table[name] = e
        return self._named(name, e)

    def _named(self, name: str, e):
        """The symbol of opaque value e: an integer one where the language types it so
        (the printer forms products of those in float: see _TritonPrinter.Mul)."""
        integer = not isinstance(e, ir.Load) and check_expr(e, self.scope) == ir.INT
        return sympy.Symbol(name, integer=True) if integer else sympy.Symbol(name, real=True)

    def __call__(self, e):
        if not self._depends(e):
            if isinstance(e, ir.Const) and e.type != ir.BOOL:
                # The float's exact value: nsimplify turned 2.718281828459045 into E and
                # 0.7071... into sqrt(2)/2, which have no Triton form.
                return sympy.Rational(e.value) if e.type == ir.FLOAT else sympy.Integer(e.value)
            return self._symbol(e, self.values, "_C")
        return super().__call__(e)

    def Var(self, e):
        return S  # the only index that depends on s

    def Load(self, e):
        return self._symbol(e, self.loads, "_L")  # a learnable read

    def opaque(self, e):
        # Piecewise constant (floor, ceil, int): derivative 0 wherever it has one (as
        # torch.floor's), so it stays an opaque value, printed as the forward computes it.
        return self._symbol(e, self.values, "_C")

    def condition(self, e):
        if not self._depends(e):
            return sympy.Symbol(self._symbol(e, self.values, "_C").name)  # a boolean leaf
        if not isinstance(e, (ir.Cmp, ir.And, ir.Or, ir.Not)):
            raise SpecError(f"cannot differentiate the condition {type(e).__name__} in the score")
        return super().__call__(e)

    def other(self, e):
        raise SpecError(f"cannot differentiate {type(e).__name__} in the score")


class _TritonPrinter(Printer):
    """sympy -> Triton; opaque symbols print as the forward's code for their IR (Code,
    whose uses this printer reports with its own). `computed`: (sympy expression, name)
    of a value the kernel holds already where the derivative is placed, printed as that
    name wherever the derivative contains it."""

    def __init__(self, opaque_code: dict, emit: TritonEmitter, computed: tuple | None = None):
        super().__init__()
        self.opaque_code = opaque_code
        self.emit = emit  # spells the language's functions as the forward's code does
        self.computed = computed
        # Products and powers of integers are new in a derivative ((q - k)**2 from s * (q -
        # k)**2 / 2): the range analysis never saw them, so they are formed in float, as the
        # forward's values are, where int32 would wrap. In a comparison they stay exact.
        self.in_relation = 0

    def _in_float(self, x) -> list:
        """["1.0"], to start the product x with, where x is a product of integers outside
        a comparison; else []."""
        return ["1.0"] if x.is_integer and not self.in_relation else []

    def __call__(self, x) -> str:
        if self.computed is not None and x == self.computed[0]:
            self.use(names=(self.computed[1],))
            return self.computed[1]
        if x is sympy.true or x == sympy.true:
            return "True"
        if x is sympy.false or x == sympy.false:
            return "False"
        if isinstance(x, sympy.Symbol):
            if x == S:
                self.use(names=("s",))
                return "s"
            code = self.opaque_code[x.name]
            self.use(code.helpers, code.names)
            return code.text
        if x.is_Number:
            return repr(float(x))
        return super().__call__(x)

    def _call(self, entry, *args) -> str:
        """The language's function `entry` on printed operands, as the kernels spell it."""
        self.use(self.emit.helpers_of(entry, None), self.emit.names_of(entry))
        return self.emit.spelling(entry).format(*args)

    def Add(self, x):
        return "(" + " + ".join(self(a) for a in x.args) + ")"

    def Mul(self, x):
        num, den = [], []
        for a in x.args:
            if isinstance(a, sympy.Pow) and a.exp.is_Number and a.exp < 0:
                den.append(sympy.Pow(a.base, -a.exp))
            else:
                num.append(a)
        text = " * ".join(self._in_float(sympy.Mul(*num)) + [self(a) for a in num]) if num else "1.0"
        if not den:
            return f"({text})"
        under = sympy.Mul(*den)
        return f"({text} / ({' * '.join(self._in_float(under) + [self(a) for a in den])}))"

    def Pow(self, x):
        base, e = x.base, x.exp
        if e.is_Integer and 0 < e <= 4:
            return "(" + " * ".join(self._in_float(x) + [self(base)] * int(e)) + ")"
        if e.is_Integer and e < 0:
            return f"(1.0 / {self(sympy.Pow(base, -e))})"
        if e == sympy.Rational(1, 2):
            return self._call(FUNCTIONS["sqrt"], self(base))
        if e == sympy.Rational(-1, 2):
            return f"(1.0 / {self._call(FUNCTIONS['sqrt'], self(base))})"
        return (f"{self._call(FUNCTIONS['exp'], f'{self(e)} * ' + self._call(FUNCTIONS['log'], self(base)))}")

    def Piecewise(self, x):
        out = self(x.args[-1][0])
        for value, cond in reversed(x.args[:-1]):
            out = self._call(FUNCTIONS["where"], self(cond), self(value), out)
        return out

    def sign(self, x):
        a = self(x.args[0])
        return f"tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, 0.0))"

    def Heaviside(self, x):
        return f"tl.where({self(x.args[0])} > 0, 1.0, 0.0)"

    def cosh(self, x):
        a = self(x.args[0])
        return f"((tl.exp({a}) + tl.exp(-{a})) * 0.5)"

    def And(self, x):
        return "(" + " & ".join(self(a) for a in x.args) + ")"

    def Or(self, x):
        return "(" + " | ".join(self(a) for a in x.args) + ")"

    def Not(self, x):
        return OPERATORS["not"].triton.format(self(x.args[0]))

    def other(self, x):
        """A relation, or a function of the language (exp, Abs, Min, ...)."""
        relation = _RELATIONS.get(type(x).__name__)
        if relation is not None:
            self.in_relation += 1
            try:
                return OPERATORS[relation].triton.format(self(x.args[0]), self(x.args[1]))
            finally:
                self.in_relation -= 1
        entry = operation_of(x)
        if entry is None:
            raise SpecError(f"internal: no Triton form for sympy {type(x).__name__} in a score derivative")
        args = [self(a) for a in x.args]
        if len(args) == 1:
            return self._call(entry, args[0])
        out = args[0]
        for a in args[1:]:  # Min and Max of several, pairwise
            out = self._call(entry, out, a)
        return out


_RELATIONS = {"StrictLessThan": "<", "LessThan": "<=", "StrictGreaterThan": ">",
              "GreaterThan": ">=", "Equality": "==", "Unequality": "!="}


def score_gradients(variant: ir.Variant, emit: TritonEmitter,
                    value_name: str | None = None) -> ScoreGradients:
    """Triton code for the derivatives the backward needs (identity when no score).
    `value_name`: the name of the score's own value where the derivatives are placed
    (the pair weights `w` under `normalize sum` or `none`): a derivative that contains
    the score, as sigmoid's σ(1 − σ) does, reads it instead of computing it again."""
    if variant.score is None:
        return ScoreGradients(Code("1.0"), ())
    to = _Score(variant)
    try:
        expr = to(variant.score)
    except NotSymbolic as err:
        raise SpecError(f"the score applies '{err.node.op}' to the score or a learnable input, "
                        "which has no derivative; the backward cannot be generated") from None
    opaque_code = {name: emit.code(node) for name, node in to.values.items()}
    opaque_code.update({name: emit.code(node) for name, node in to.loads.items()})
    computed = None
    if value_name is not None and not isinstance(expr, sympy.Symbol) and not expr.is_Number:
        computed = (expr, value_name)
    printer = _TritonPrinter(opaque_code, emit, computed)
    # Unsimplified on purpose: simplify() turns 1 - tanh(x)**2 into 1/cosh(x)**2.
    d_ds = printer.code(sympy.diff(expr, S))
    d_inputs = tuple((node, printer.code(sympy.diff(expr, sympy.Symbol(name, real=True))))
                     for name, node in to.loads.items())
    return ScoreGradients(d_ds, d_inputs)
