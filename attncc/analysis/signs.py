"""Whether a weight is provably >= 0: interval arithmetic over every call.

`normalize sum` divides a row's weighted values by the row's sum of weights, which
means something only for weights that cannot be negative. The proof bounds every
sub-expression over all values its names can take (s anything, a float input
anything, positions and sizes at least 0 or 1, params their values) with float
intervals whose ends may be infinite; the weight is accepted when its lower end is
>= 0. It is sound, not complete: `exp`, `sigmoid`, `max(x, 0.0)`, `abs`, `x * x`,
`sqrt` of those, `log` of values >= 1, `x % c` and `x // c` of positive c, the roundings,
and sums, products and quotients (by positive values) of those are proven;
what it cannot bound is refused with the sub-expression named.
"""
from __future__ import annotations

import math

from .. import ir

ANY = (-math.inf, math.inf)
# Index names and the least value each takes (all are integers with no upper bound).
LEAST = {"b": 0, "h": 0, "q": 0, "k": 0, "qb": 0, "kb": 0, "dim": 1, "dim_v": 1, "len_q": 1,
         "len_k": 1}
# The widest head dim any kernel takes is far below this: bounding the dims above lets
# 1/sqrt(dim) be proven positive (over all dims its infimum is 0).
MOST_HEAD_DIM = 65536


def _interval(lo: float, hi: float):
    """[lo, hi], or ANY where arithmetic on infinities gave no number."""
    return ANY if math.isnan(lo) or math.isnan(hi) else (lo, hi)


def _product(a, b):
    corners = [x * y if not ((x == 0 and math.isinf(y)) or (y == 0 and math.isinf(x))) else 0.0
               for x in a for y in b]
    return _interval(min(corners), max(corners))


def _increasing(fn):
    def rule(a):
        return tuple(fn(x) for x in a)
    return rule


def _exp(x: float) -> float:
    return math.exp(x) if x < 709 else math.inf


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + _exp(-x)) if x > -709 else 0.0


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _rounded(fn):
    """floor, ceil and int (toward 0) are non-decreasing: the image of the ends."""
    return _increasing(lambda x: x if math.isinf(x) else float(fn(x)))


# Functions of one argument by the image of their argument's interval.
UNARY = {
    # Increasing on (0, inf), NaN below 0: only an argument proven > 0 is bounded.
    "log": lambda a: (_log(a[0]), _log(a[1])) if a[0] > 0 else ANY,
    "floor": _rounded(math.floor),
    "ceil": _rounded(math.ceil),
    "int": _rounded(math.trunc),
    "exp": _increasing(_exp),
    "sigmoid": _increasing(_logistic),
    "tanh": _increasing(math.tanh),
    # NaN below 0, which is not >= 0 either: only an argument proven >= 0 is bounded.
    "sqrt": lambda a: (math.sqrt(a[0]), math.sqrt(a[1])) if a[0] >= 0 else ANY,
    "abs": lambda a: (0.0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1])),
                      max(abs(a[0]), abs(a[1]))),
}


class _Bounds(ir.Visitor):
    """(lo, hi) of a number-valued node, over every call."""

    def __init__(self, variant: ir.Variant, bounded_dims: bool = False):
        self.params = {p.name: p.value for p in variant.params}
        self.most = {"dim": MOST_HEAD_DIM, "dim_v": MOST_HEAD_DIM} if bounded_dims else {}

    def Const(self, e):
        return (float(e.value), float(e.value)) if e.type != ir.BOOL else ANY

    def Param(self, e):
        value = self.params[e.name]
        return ANY if isinstance(value, bool) else (float(value), float(value))

    def Var(self, e):
        if e.name not in LEAST:
            return ANY
        return (float(LEAST[e.name]), float(self.most.get(e.name, math.inf)))

    def Load(self, e):
        return ANY

    def Neg(self, e):
        lo, hi = self(e.operand)
        return (-hi, -lo)

    def BinOp(self, e):
        if e.op == "*" and e.lhs == e.rhs:  # a square
            lo, hi = self(e.lhs)
            least = 0.0 if lo <= 0 <= hi else min(lo * lo, hi * hi)
            return (least, max(lo * lo, hi * hi))
        a, b = self(e.lhs), self(e.rhs)
        if e.op == "+":
            return _interval(a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return _interval(a[0] - b[1], a[1] - b[0])
        if e.op == "*":
            return _product(a, b)
        if e.op in ("/", "//") and b[0] > 0:
            quotient = _product(a, (1.0 / b[1] if b[1] != math.inf else 0.0, 1.0 / b[0]))
            # Floor division is the quotient's floor, which keeps its order.
            return quotient if e.op == "/" else _rounded(math.floor)(quotient)
        if e.op == "%" and b[0] > 0:  # takes the divisor's sign, as in Python
            return (0.0, b[1])
        return ANY  # a divisor that may be <= 0

    def Call(self, e):
        args = [self(a) for a in e.args]
        if e.fn in UNARY:
            return UNARY[e.fn](args[0])
        if e.fn == "max":
            return (max(args[0][0], args[1][0]), max(args[0][1], args[1][1]))
        if e.fn == "min":
            return (min(args[0][0], args[1][0]), min(args[0][1], args[1][1]))
        return ANY

    def Where(self, e):
        a, b = self(e.then), self(e.other)
        return (min(a[0], b[0]), max(a[1], b[1]))

    def other(self, e):
        return ANY


def why_not_nonnegative(e: ir.Expr, variant: ir.Variant) -> str | None:
    """None when `e` is >= 0 for every call; else why not, naming the smallest
    sub-expression whose lower bound the proof cannot lift to 0."""
    bounds = _Bounds(variant)
    if bounds(e)[0] >= 0:
        return None
    culprit = e
    while True:
        negative = [c for c in ir.children(culprit)
                    if not isinstance(c, (ir.Cmp, ir.And, ir.Or, ir.Not, ir.Member))
                    and bounds(c)[0] < 0]
        if len(negative) != 1 or isinstance(culprit, ir.Load):
            break
        culprit = negative[0]
    lo = bounds(e)[0]
    # What the proof found, not a claim about the values: it is sound, not complete.
    shown = "no lower bound" if lo == -math.inf else f"a lower bound of {lo:g}"
    part = "" if culprit is e else f" and cannot show that its part `{ir.print_expr(culprit)}` is >= 0"
    return f"the proof gives `{ir.print_expr(e)}` {shown}{part}"


def scale_is_positive(variant: ir.Variant) -> bool:
    """Whether the variant's scale is > 0 at every head dim (1/sqrt(dim) when it declares
    none). Where it is, a kernel may take a row's max of q·k before scaling it, and fold
    the scale and the max into one multiply-add (the Gluon forward's softmax)."""
    if variant.scale is None:
        return True
    return _Bounds(variant, bounded_dims=True)(variant.scale)[0] > 0
