"""The language's operations, in one table: for every operator and function, all that
any pass knows of it. A walker over the IR looks an operation up here (`entry_of`) and
reads the column it needs; adding a function is adding an entry to FUNCTIONS.

    arity         how many operands: a number, or (fewest, most)
    signature     the operands' names, for messages: "(a, b)"
    doc           what it computes, in a line
    make          the IR node from the operands' nodes
    types         the type rule: types(node, operand types, scope) -> INT, FLOAT or BOOL,
                  or a SpecError naming the mistake (attncc/frontend/checker.py)
    torch         the meaning, on tensors and on Python numbers: torch(*operands,
                  float_dtype=...) (attncc/semantics/evaluate.py, tools/flex.py)
    sympy         the symbolic form, sympy(sympy_module, *operands); OPAQUE for a piecewise
                  constant operation (a derivative keeps it as a value), None for one with
                  no form (attncc/analysis/symbolic.py)
    interval      the interval rule: interval(algebra, *operands) -> Bounds, Truth or
                  UNKNOWN, the operands being Bounds (numbers) or Truths (conditions);
                  the algebra computes on the ends (ALGEBRA below says what it offers)
    float_operands  the operands are taken as floats (a printer casts them first)
    triton        how a kernel writes it: a format string ({0}, {1}: the operands; {int}:
                  the integer type) or, where it depends on the operands, a function of
                  (printer, node, operand codes) (attncc/codegen/elementwise.py)
    host          the same for the host's PyTorch code (backends/portable/codegen.py)
    helpers       the device helpers the Triton spelling calls, or a function of the node
    host_helpers  the host helpers the host spelling calls
    python        how traced Python spells it (attncc/frontend/decorator.py): special
                  methods of a traced value (for a binary operator the reflected one
                  second) and attncc's function names

Arithmetic means what Python's does: `/` is true division, always in floating point
(2 / 4 is 0.5); `//` floors (-7 // 2 is -4, where Triton's and C's integer // truncate
to -3); `%` takes the sign of the divisor (-7 % 2 is 1; Triton's and C's: -1). The
kernels call helpers with that meaning (codegen/templates/expressions.py.jinja on the
device, codegen/templates/host_args.jinja on the host), and
attncc/analysis/ranges.py refuses a `//` or `%` whose divisor can be 0.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import ir
from .errors import SpecError
from .ir import BOOL, FLOAT, INT, TYPE_WORDS
from .random_blocks import chance, probability, threshold

OPAQUE = "opaque"  # sympy column: a piecewise-constant value (derivative 0 where it has one)
CHANCE_MAX_KEYS = 5  # seed, b, h, qb, kb


@dataclass(frozen=True)
class Operation:
    """One operator or function of the language; the module docstring names the columns."""
    name: str
    arity: int | tuple
    signature: str
    doc: str
    make: Callable
    types: Callable
    torch: Callable
    sympy: Callable | str | None
    interval: Callable
    float_operands: bool
    triton: Callable | str
    host: Callable | str
    helpers: Callable | tuple
    host_helpers: tuple
    python: tuple
    arity_words: str = ""  # for a range of operands: what they are, in the arity message

    def arity_problem(self, n: int) -> str | None:
        """Why `n` operands are wrong for this operation, or None."""
        if isinstance(self.arity, tuple):
            least, most = self.arity
            if least <= n <= most:
                return None
            return (f"{self.name}() takes {self.arity_words}; got {n} "
                    f"argument{'s' if n != 1 else ''}")
        if n == self.arity:
            return None
        return f"{self.name}() takes {self.arity} argument{'s' if self.arity > 1 else ''}, not {n}"

    def helpers_of(self, node) -> tuple:
        return self.helpers(node) if callable(self.helpers) else self.helpers


# --------------------------------------------------------------------- type rules
def _refuse_conditions(types, message):
    if BOOL in types:
        raise SpecError(message)


def arithmetic(node, types, scope):
    _refuse_conditions(types, f"'{node.op}' needs numbers, not a condition; "
                  "use where(cond, a, b) to turn a condition into a number")
    return INT if all(t == INT for t in types) else FLOAT


def floor_division(node, types, scope):
    """`//` of integers: Triton's `//` takes no floats (and a float quotient floored is
    floor(a / b), which says so)."""
    if arithmetic(node, types, scope) == FLOAT:
        raise SpecError("'//' takes integers, and one side here is a float; write "
                        "floor(a / b) for the floor of a float quotient")
    return INT


def true_division(node, types, scope):
    arithmetic(node, types, scope)
    return FLOAT


def negation(node, types, scope):
    _refuse_conditions(types, "'-' needs a number, not a condition; did you mean `not`?")
    return types[0]


def comparison(node, types, scope):
    lt, rt = types
    if node.op in ("==", "!=") and lt == rt == BOOL:
        return BOOL
    # One side a condition, the other a number: most likely a chain, read as Python does.
    chain = (" (comparisons chain as in Python, `a >= b == c` being `a >= b and b == c`: "
             "parenthesize a condition to compare it, `(a >= b) == c`)") if lt != rt else ""
    _refuse_conditions(types, f"'{node.op}' compares numbers, not conditions{chain}")
    return BOOL


def _logical(word):
    def rule(node, types, scope):
        for t in types:
            if t != BOOL:
                raise SpecError(f"`{word}` needs conditions, not {TYPE_WORDS[t]}; "
                                "compare it first, as in `x != 0`")
        return BOOL
    return rule


def same_kind(node, types, scope):
    """abs, min, max: an integer of integers, else a number."""
    _refuse_conditions(types, f"{node.fn}() needs numbers, not a condition")
    return INT if all(t == INT for t in types) else FLOAT


def to_float(node, types, scope):
    _refuse_conditions(types, f"{node.fn}() needs numbers, not a condition")
    return FLOAT


def rounding(node, types, scope):
    """A number -> an integer: the way a float becomes an index (T5's log-spaced buckets)."""
    _refuse_conditions(types, f"{node.fn}() needs numbers, not a condition")
    if types[0] == INT:
        raise SpecError(f"{node.fn}() of an integer is that integer: its argument is already "
                        f"one, so drop {node.fn}() (it rounds numbers, as in {node.fn}(q / 8.0))")
    return INT


def conditional(node, types, scope):
    ct, at, bt = types
    if ct != BOOL:
        raise SpecError(f"the first argument of where() must be a condition, not {TYPE_WORDS[ct]}")
    if at == bt:
        return at
    if BOOL in (at, bt):
        raise SpecError("where(cond, a, b) needs a and b of the same kind: both conditions "
                        "or both numbers")
    return FLOAT


def random_draw(node, types, scope):
    """chance(p, key, ...): a random tile pattern. Only in a layout: it is drawn per layout
    block, and an element mask of it would leave no tile empty or full."""
    if scope.decl != "layout":
        raise SpecError(f"chance() can be used only in a `layout` (a random pattern of blocks), "
                        f"not in `{scope.decl}`; for random elements use `dropout`")
    p = probability(node, {n: d.value for n, d in scope.params.items()})
    if p is None:
        raise SpecError("the first argument of chance() is its probability: a number or a "
                        "number param, known when the kernel is compiled, as in chance(0.1, ...)")
    if not 0 <= p <= 1:
        raise SpecError(f"chance() takes a probability between 0 and 1, got {p!r}")
    from .random_blocks import BITS, threshold
    drawn = threshold(p) / 2 ** BITS
    if abs(drawn - p) > 0.01 * p:
        raise SpecError(f"chance({p!r}, ...): blocks are drawn on a grid of 2**-{BITS}, where "
                        f"{p!r} reads as {drawn:.3g}; use a probability of at least 3e-6, or 0")
    params = {n: d.value for n, d in scope.params.items()}
    for key in node.args[1:]:
        value = key.value if isinstance(key, ir.Const) else (
            params.get(key.name) if isinstance(key, ir.Param) else None)
        if isinstance(value, int) and not 0 <= value < 2 ** 32:
            raise SpecError(f"chance() key {value} is outside [0, 2**32): keys are hashed as 32 "
                            f"bits, so it would draw the blocks of {value % 2 ** 32}; reduce it, "
                            f"as in {value % 2 ** 32}")
    for t in types[1:]:
        if t != INT:
            raise SpecError(f"chance() draws from integer keys (a seed param, b, h, qb, kb), "
                            f"not {TYPE_WORDS[t]}")
    return BOOL


# -------------------------------------------------------------- meaning in PyTorch
def _tensors(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) for x in xs)


def _exact(fn):
    """An operation whose Python operator means the same on tensors and numbers."""
    return lambda *xs, float_dtype: fn(*xs)


def _true_division(a, b, *, float_dtype):
    if _tensors(a, b):
        return torch.as_tensor(a).to(float_dtype) / torch.as_tensor(b).to(float_dtype)
    return float(a) / float(b)


def _floor_division(a, b, *, float_dtype):
    return torch.div(a, b, rounding_mode="floor") if _tensors(a, b) else a // b


def _remainder(a, b, *, float_dtype):
    return torch.remainder(torch.as_tensor(a), b) if _tensors(a, b) else a % b


def _not(x, *, float_dtype):
    return ~x if isinstance(x, torch.Tensor) else not x


def _absolute(x, *, float_dtype):
    return x.abs() if isinstance(x, torch.Tensor) else abs(x)


def _extreme(tensor_fn, number_fn):
    def f(a, b, *, float_dtype):
        if not _tensors(a, b):
            return number_fn(a, b)
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        value = tensor_fn(a, b)
        if not (a.requires_grad or b.requires_grad):
            return value
        # At a tie neither side takes a gradient, as in the kernels' derivative (a step
        # that is 0 at 0: `max(s, 0.0)` at s = 0, a zero row of q); torch.maximum would
        # give each side half.
        return torch.where(a == b, value.detach(), value)
    return f


def _on_floats(tensor_fn, number_fn):
    """A float function: a tensor is taken in float_dtype, a number by `math`."""
    def f(x, *, float_dtype):
        return tensor_fn(x.to(float_dtype)) if isinstance(x, torch.Tensor) else number_fn(x)
    return f


def _rounded(tensor_fn, number_fn):
    """To int64, as the language's integers are."""
    def f(x, *, float_dtype):
        return tensor_fn(x.to(float_dtype)).long() if isinstance(x, torch.Tensor) else number_fn(x)
    return f


def _where(c, a, b, *, float_dtype):
    return torch.where(torch.as_tensor(c), a, b)


def _chance(p, *keys, float_dtype):
    return chance(float(p), *keys)


# ---------------------------------------------------------------- interval rules
class Bounds(NamedTuple):
    """A number lies in [lo, hi] everywhere the rule looks (a tile, or every call)."""
    lo: object
    hi: object


class Truth(NamedTuple):
    """A condition may hold somewhere (`may`) and must hold everywhere (`must`)."""
    may: object
    must: object


UNKNOWN = None  # a number the rule cannot bound
UNKNOWN_TRUTH = Truth(True, False)

# What an interval rule may ask of its algebra: the arithmetic and comparisons of two
# ends, `where(c, x, y)`, `both`/`either` (& and | of two truths), `conj`/`disj`/`negate`
# (the same, simplified where an operand is a constant), `known(truth)` (may == must),
# `fdiv`/`mod` by a constant, `positive_int(bounds)` (the constant positive integer the
# bounds are, or None), `increasing(fn, bounds, domain)` (the images of the ends of an
# increasing function, where `domain(lo, hi)` holds) and `let(x)` (x is used more than
# once: computed once). NUMBERS below computes on Python numbers; attncc/analysis/
# intervals.py writes code.
ALGEBRA = ("add", "sub", "mul", "neg", "min", "max", "where", "lt", "le", "gt", "ge", "eq",
           "ne", "both", "either", "conj", "disj", "negate", "known", "fdiv", "mod",
           "positive_int", "increasing", "let")


def _numeric(rule):
    """A rule over numbers: unknown when an operand is."""
    def wrapped(m, *operands):
        return UNKNOWN if any(x is UNKNOWN for x in operands) else rule(m, *operands)
    return wrapped


def _condition(rule):
    """A rule giving a truth: unknown when an operand is."""
    def wrapped(m, *operands):
        return UNKNOWN_TRUTH if any(x is UNKNOWN for x in operands) else rule(m, *operands)
    return wrapped


@_numeric
def _add_bounds(m, a, b):
    return Bounds(m.add(a.lo, b.lo), m.add(a.hi, b.hi))


@_numeric
def _sub_bounds(m, a, b):
    return Bounds(m.sub(a.lo, b.hi), m.sub(a.hi, b.lo))


@_numeric
def _mul_bounds(m, a, b):
    p = [m.let(m.mul(x, y)) for x in a for y in b]
    return Bounds(m.min(m.min(p[0], p[1]), m.min(p[2], p[3])),
                  m.max(m.max(p[0], p[1]), m.max(p[2], p[3])))


@_numeric
def _floordiv_bounds(m, a, b):
    c = m.positive_int(b)
    if c is None:
        return UNKNOWN
    return Bounds(m.fdiv(a.lo, c), m.fdiv(a.hi, c))


@_numeric
def _mod_bounds(m, a, b):
    # One period: the residues are in order; otherwise anything in [0, c).
    c = m.positive_int(b)
    if c is None:
        return UNKNOWN
    same = m.let(m.eq(m.fdiv(a.lo, c), m.fdiv(a.hi, c)))
    return Bounds(m.where(same, m.mod(a.lo, c), 0), m.where(same, m.mod(a.hi, c), c - 1))


def _unbounded(m, *operands):
    return UNKNOWN


@_numeric
def _neg_bounds(m, a):
    return Bounds(m.neg(a.hi), m.neg(a.lo))


def _compare(lo_side, hi_side, op):
    """x < y style: may where the smallest x and largest y compare so, must where the
    largest x and smallest y do."""
    @_condition
    def rule(m, a, b):
        return Truth(getattr(m, op)(getattr(a, lo_side), getattr(b, hi_side)),
                     getattr(m, op)(getattr(a, hi_side), getattr(b, lo_side)))
    return rule


def _equality(equal: bool):
    @_condition
    def rule(m, a, b):
        if isinstance(a, Truth):
            # Two conditions are equal where both are decided and agree.
            a_known, b_known = m.let(m.known(a)), m.let(m.known(b))
            same = m.let(m.both(m.both(a_known, b_known), m.eq(a.must, b.must)))
            diff = m.let(m.both(m.both(a_known, b_known), m.ne(a.must, b.must)))
            return Truth(m.negate(diff), same) if equal else Truth(m.negate(same), diff)
        overlap = m.let(m.both(m.le(a.lo, b.hi), m.le(b.lo, a.hi)))
        single = m.let(m.both(m.both(m.eq(a.lo, a.hi), m.eq(b.lo, b.hi)), m.eq(a.lo, b.lo)))
        return Truth(overlap, single) if equal else Truth(m.negate(single), m.negate(overlap))
    return rule


def _and_truths(m, a, b):
    return Truth(m.conj(a.may, b.may), m.conj(a.must, b.must))


def _or_truths(m, a, b):
    return Truth(m.disj(a.may, b.may), m.disj(a.must, b.must))


def _not_truth(m, a):
    return Truth(m.negate(a.must), m.negate(a.may))


@_numeric
def _abs_bounds(m, a):
    return Bounds(m.where(m.ge(a.lo, 0), a.lo, m.where(m.le(a.hi, 0), m.neg(a.hi), 0)),
                  m.max(m.neg(a.lo), a.hi))


@_numeric
def _min_bounds(m, a, b):
    return Bounds(m.min(a.lo, b.lo), m.min(a.hi, b.hi))


@_numeric
def _max_bounds(m, a, b):
    return Bounds(m.max(a.lo, b.lo), m.max(a.hi, b.hi))


def _logistic(x: float) -> float:
    """1 / (1 + e^-x), written so that neither branch overflows (e^-x would for x far
    below 0)."""
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


@functools.lru_cache(maxsize=None)
def _sympy_sigmoid(sp):
    """sigmoid as a sympy function of its own (made on first use: attncc is imported
    without sympy), whose derivative is written in itself, σ(1 − σ): the form sympy would
    derive from 1 / (1 + e^-x), e^-x / (1 + e^-x)², is inf / inf in fp32 for x below
    about -88, where σ(1 − σ) is 0."""
    class sigmoid(sp.Function):
        def fdiff(self, argindex=1):
            value = self.func(*self.args)
            return value * (1 - value)
    return sigmoid


def _increasing(fn, domain=lambda lo, hi: True):
    """A function increasing where `domain(lo, hi)` holds of the operand's bounds."""
    @_numeric
    def rule(m, a):
        return m.increasing(fn, a, domain)
    return rule


def _where_bounds(m, c, a, b):
    """The branch the condition decides, or the hull of both where it is undecided."""
    if a is UNKNOWN or b is UNKNOWN:
        return UNKNOWN
    if isinstance(a, Truth):
        return Truth(m.where(c.must, a.may, m.where(c.may, m.either(a.may, b.may), b.may)),
                     m.where(c.must, a.must, m.where(c.may, m.both(a.must, b.must), b.must)))
    return Bounds(m.where(c.must, a.lo, m.where(c.may, m.min(a.lo, b.lo), b.lo)),
                  m.where(c.must, a.hi, m.where(c.may, m.max(a.hi, b.hi), b.hi)))


def _random(m, p, *keys):
    return UNKNOWN_TRUTH  # a hash: no interval of its keys says anything


class _Numbers:
    """The interval algebra of Python numbers (attncc/analysis/ranges.py)."""
    add, sub, mul, neg = operator.add, operator.sub, operator.mul, operator.neg
    lt, le, gt, ge, eq, ne = operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne
    both = conj = operator.and_
    either = disj = operator.or_
    min, max = min, max

    @staticmethod
    def where(c, x, y):
        return x if c else y

    @staticmethod
    def negate(x):
        return not x

    @staticmethod
    def known(t):
        return t.may == t.must

    @staticmethod
    def fdiv(x, c):
        return x // c

    @staticmethod
    def mod(x, c):
        return x % c

    @staticmethod
    def positive_int(b):
        lo, hi = b
        return lo if lo == hi and isinstance(lo, int) and lo > 0 else None

    @staticmethod
    def increasing(fn, a, domain):
        return Bounds(fn(a.lo), fn(a.hi)) if domain(a.lo, a.hi) else UNKNOWN

    @staticmethod
    def let(x):
        return x


NUMBERS = _Numbers()


# --------------------------------------------------------------------- the table
def _binary(op, types, torch_fn, sympy_fn, interval, triton, host, python, *,
            helpers=(), host_helpers=(), doc):
    node = ir.Cmp if types is comparison else ir.BinOp
    return Operation(op, 2, "(a, b)", doc, lambda a, b: node(op, a, b), types, torch_fn,
                     sympy_fn, interval, False, triton, host, helpers, host_helpers, python)


def _chance_triton(printer, node, args):
    # Keys may be compile-time ints (a seed param): adding a 0-d int32 tensor makes each
    # a tensor, which .to(tl.uint32) needs.
    keys = [f"(({a}) + tl.zeros((), tl.int32))" for a in args[1:]]
    h = f"_chance_start({keys[0]})"
    for key in keys[1:]:
        h = f"_chance_step({h}, {key})"
    return f"_chance_keep({h}, {threshold(probability(node, printer.params))})"


def _chance_host(printer, node, args):
    return f"_h_chance({threshold(probability(node, printer.params))}, {', '.join(args[1:])})"


def _chance_helpers(node) -> tuple:
    return ("_chance_start", "_chance_keep") + (("_chance_step",) if len(node.args) > 2 else ())


OPERATORS = {e.name: e for e in [
    _binary("+", arithmetic, _exact(operator.add), lambda sp, a, b: a + b, _add_bounds,
            "({0} + {1})", "({0} + {1})", ("__add__", "__radd__"), doc="sum"),
    _binary("-", arithmetic, _exact(operator.sub), lambda sp, a, b: a - b, _sub_bounds,
            "({0} - {1})", "({0} - {1})", ("__sub__", "__rsub__"), doc="difference"),
    _binary("*", arithmetic, _exact(operator.mul), lambda sp, a, b: a * b, _mul_bounds,
            "({0} * {1})", "({0} * {1})", ("__mul__", "__rmul__"), doc="product"),
    _binary("/", true_division, _true_division, lambda sp, a, b: a / b, _unbounded,
            "(({0}) * 1.0 / ({1}))", "(torch.as_tensor({0}) * 1.0 / ({1}))",
            ("__truediv__", "__rtruediv__"), doc="true division, in floating point"),
    # // and % have no derivative, and the loop bounds leave them to the tile classes.
    _binary("//", floor_division, _floor_division, None, _floordiv_bounds, "_fdiv({0}, {1})",
            "_h_fdiv({0}, {1})", ("__floordiv__", "__rfloordiv__"), helpers=("_fdiv",),
            host_helpers=("_h_fdiv",), doc="floor division"),
    _binary("%", arithmetic, _remainder, None, _mod_bounds, "_mod({0}, {1})",
            "_h_mod({0}, {1})", ("__mod__", "__rmod__"), helpers=("_mod",),
            host_helpers=("_h_mod",), doc="remainder, with the sign of the divisor"),
    Operation("neg", 1, "(x)", "minus x", ir.Neg, negation, _exact(operator.neg),
              lambda sp, a: -a, _neg_bounds, False, "(-{0})", "(-{0})", (), (), ("__neg__",)),
    _binary("<", comparison, _exact(operator.lt), lambda sp, a, b: sp.Lt(a, b),
            _compare("lo", "hi", "lt"), "({0} < {1})", "({0} < {1})", ("__lt__",),
            doc="less than"),
    _binary("<=", comparison, _exact(operator.le), lambda sp, a, b: sp.Le(a, b),
            _compare("lo", "hi", "le"), "({0} <= {1})", "({0} <= {1})", ("__le__",),
            doc="at most"),
    _binary(">", comparison, _exact(operator.gt), lambda sp, a, b: sp.Gt(a, b),
            _compare("hi", "lo", "gt"), "({0} > {1})", "({0} > {1})", ("__gt__",),
            doc="greater than"),
    _binary(">=", comparison, _exact(operator.ge), lambda sp, a, b: sp.Ge(a, b),
            _compare("hi", "lo", "ge"), "({0} >= {1})", "({0} >= {1})", ("__ge__",),
            doc="at least"),
    _binary("==", comparison, _exact(operator.eq), lambda sp, a, b: sp.Eq(a, b),
            _equality(True), "({0} == {1})", "({0} == {1})", ("__eq__",), doc="equal"),
    _binary("!=", comparison, _exact(operator.ne), lambda sp, a, b: sp.Ne(a, b),
            _equality(False), "({0} != {1})", "({0} != {1})", ("__ne__",), doc="not equal"),
    Operation("and", 2, "(a, b)", "both hold", ir.And, _logical("and"), _exact(operator.and_),
              lambda sp, a, b: sp.And(a, b), _and_truths, False, "({0} & {1})", "({0} & {1})",
              (), (), ("__and__", "__rand__")),
    Operation("or", 2, "(a, b)", "either holds", ir.Or, _logical("or"), _exact(operator.or_),
              lambda sp, a, b: sp.Or(a, b), _or_truths, False, "({0} | {1})", "({0} | {1})",
              (), (), ("__or__", "__ror__")),
    Operation("not", 1, "(a)", "does not hold", ir.Not, _logical("not"), _not,
              lambda sp, a: sp.Not(a), _not_truth, False, "({0} == 0)",
              "(~torch.as_tensor({0}))", (), (), ("__invert__",)),
]}

ARITH_OPS = ("+", "-", "*", "/", "//", "%")
CMP_OPS = ("<", "<=", ">", ">=", "==", "!=")
# The comparison that holds exactly where one does not, and the one with its sides swapped.
NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}
MIRRORED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _function(name, arity, signature, doc, types, torch_fn, sympy_fn, interval, triton, host,
              python, *, helpers=(), host_helpers=(), arity_words=""):
    return Operation(name, arity, signature, doc, lambda *args: ir.Call(name, tuple(args)), types,
                     torch_fn, sympy_fn, interval, types in (to_float, rounding), triton, host,
                     helpers, host_helpers, python, arity_words)


FUNCTIONS = {e.name: e for e in [
    _function("abs", 1, "(x)", "absolute value", same_kind, _absolute,
              lambda sp, x: sp.Abs(x), _abs_bounds, "tl.abs({0})",
              "torch.abs(torch.as_tensor({0}))", ("__abs__",)),
    _function("min", 2, "(a, b)", "smaller of two", same_kind, _extreme(torch.minimum, min),
              lambda sp, a, b: sp.Min(a, b), _min_bounds, "tl.minimum({0}, {1})",
              "_h_min({0}, {1})", ("minimum",), host_helpers=("_h_min",)),
    _function("max", 2, "(a, b)", "larger of two", same_kind, _extreme(torch.maximum, max),
              lambda sp, a, b: sp.Max(a, b), _max_bounds, "tl.maximum({0}, {1})",
              "_h_max({0}, {1})", ("maximum",), host_helpers=("_h_max",)),
    _function("exp", 1, "(x)", "e to the power", to_float, _on_floats(torch.exp, math.exp),
              lambda sp, x: sp.exp(x), _increasing(math.exp, lambda lo, hi: hi < 60),
              "tl.exp({0})", "torch.exp({0})", ("exp",)),
    _function("log", 1, "(x)", "natural logarithm", to_float, _on_floats(torch.log, math.log),
              lambda sp, x: sp.log(x), _increasing(math.log, lambda lo, hi: lo > 0),
              "tl.log({0})", "torch.log({0})", ("log",)),
    _function("tanh", 1, "(x)", "hyperbolic tangent", to_float,
              _on_floats(torch.tanh, math.tanh), lambda sp, x: sp.tanh(x),
              _increasing(math.tanh), "_tanh({0})", "torch.tanh({0})", ("tanh",),
              helpers=("_tanh",)),
    _function("sigmoid", 1, "(x)", "the logistic function 1 / (1 + e^-x)", to_float,
              _on_floats(torch.sigmoid, _logistic), lambda sp, x: _sympy_sigmoid(sp)(x),
              _increasing(_logistic), "tl.sigmoid({0})", "torch.sigmoid({0})", ("sigmoid",)),
    _function("sqrt", 1, "(x)", "square root", to_float, _on_floats(torch.sqrt, math.sqrt),
              lambda sp, x: sp.sqrt(x), _increasing(math.sqrt, lambda lo, hi: lo >= 0),
              "tl.sqrt({0})", "torch.sqrt({0})", ("sqrt",)),
    # float -> int rounds toward zero (int()); floor and ceil round first. Straight to
    # {int}, 64 bits where the expression may need them: an int32 cast would wrap.
    _function("floor", 1, "(x)", "the largest integer <= a number, as an integer", rounding,
              _rounded(torch.floor, math.floor), OPAQUE, _increasing(math.floor),
              "tl.floor(({0})).to({int})", "torch.floor({0}).long()", ("floor", "__floor__")),
    _function("ceil", 1, "(x)", "the smallest integer >= a number, as an integer", rounding,
              _rounded(torch.ceil, math.ceil), OPAQUE, _increasing(math.ceil),
              "tl.ceil(({0})).to({int})", "torch.ceil({0}).long()", ("ceil", "__ceil__")),
    # math.trunc, as int() must return an int: the traced int(x) is attncc.trunc(x). tl.cast,
    # not .to(): the argument may be a constant (int(2.5)), which has no .to().
    _function("int", 1, "(x)", "a number rounded toward zero, as an integer (Python's int(), "
              "torch's .long())", rounding, _rounded(torch.trunc, math.trunc), OPAQUE,
              _increasing(math.trunc), "tl.cast({0}, {int})", "torch.trunc({0}).long()",
              ("trunc", "__trunc__")),
    Operation("where", 3, "(c, a, b)", "where(cond, a, b): a if cond else b", ir.Where,
              conditional, _where, lambda sp, c, a, b: sp.Piecewise((a, c), (b, True)),
              _where_bounds, False, "tl.where({0}, {1}, {2})", "_h_where({0}, {1}, {2})", (),
              ("_h_where",), ("where",)),
    _function("chance", (2, CHANCE_MAX_KEYS + 1), "(p, key, ...)",
              "chance(p, i, ...): true with probability p (a constant), drawn from a hash of "
              "one to five integers i, as in chance(0.1, seed, h, qb, kb); layouts only",
              random_draw, _chance, OPAQUE, _random, _chance_triton, _chance_host, ("chance",),
              helpers=_chance_helpers, host_helpers=("_h_chance",),
              arity_words=f"a probability and 1 to {CHANCE_MAX_KEYS} integer keys, as in "
                          "chance(0.1, seed, h, qb, kb)"),
]}

# Functions computed in floating point, and those rounding a number to an integer.
FLOAT_FUNCTIONS = tuple(n for n, e in FUNCTIONS.items() if e.types is to_float)
ROUNDING_FUNCTIONS = tuple(n for n, e in FUNCTIONS.items() if e.types is rounding)


class _EntryOf(ir.Visitor):
    """The table entry of an operation node."""

    def BinOp(self, e):
        return OPERATORS[e.op]

    Cmp = BinOp

    def Neg(self, e):
        return OPERATORS["neg"]

    def And(self, e):
        return OPERATORS["and"]

    def Or(self, e):
        return OPERATORS["or"]

    def Not(self, e):
        return OPERATORS["not"]

    def Call(self, e):
        return FUNCTIONS[e.fn]

    def Where(self, e):
        return FUNCTIONS["where"]


entry_of = _EntryOf()
