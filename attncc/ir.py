"""The intermediate representation: frozen, hashable dataclasses for one attention variant.

Both front ends (the .attn language and the Python decorator) build these nodes, the
passes read them, and `Variant.key()` names every generated module and cache entry.
Nodes carry no source positions, so the same variant written either way is equal.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Union

# ----------------------------------------------------------------------------- types
INT, FLOAT, BOOL = "int", "float", "bool"

# Element types an `input` tensor can have, and the expression type a load of it gives.
DTYPES = {
    "bool": BOOL,
    "i8": INT, "i16": INT, "i32": INT, "i64": INT,
    "f16": FLOAT, "bf16": FLOAT, "f32": FLOAT, "f64": FLOAT,
}

# The normalisers a variant may declare (`normalize`): softmax divides e^score by its
# row's sum; `sum` divides `weight` by its row's sum; `none` adds `weight` as it is.
SOFTMAX, BY_SUM, UNNORMALIZED = "softmax", "sum", "none"
NORMALIZERS = (SOFTMAX, BY_SUM, UNNORMALIZED)

# Index names and what they stand for. All are integers except `s`, the scaled score.
INDEX_VARS = {
    "b": "batch index",
    "h": "query head index",
    "q": "query position",
    "k": "key position",
    "s": "scaled score (q . k times scale)",
    "qb": "query tile index (in `layout`)",
    "kb": "key tile index (in `layout`)",
    "dim": "head dimension",
    "dim_v": "v's head dimension (in `scale`; dim is q's and k's)",
    "len_q": "number of queries",
    "len_k": "number of keys",
}
TILE_VARS = ("qb", "kb")

# Axis extents an `input` may declare by name, and what they mean.
AXIS_EXTENTS = {
    "b": "the batch size",
    "h": "the number of query heads",
    "q": "len_q",
    "k": "len_k",
    "qb": "the number of query tiles (ceil(len_q / block))",
    "kb": "the number of key tiles (ceil(len_k / block))",
}

# How the language names each type in its messages.
TYPE_WORDS = {INT: "an integer", FLOAT: "a number", BOOL: "a condition (true/false)"}


# ----------------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Var:
    """An index name: b, h, q, k, s, qb, kb, dim, len_q, len_k."""
    name: str


@dataclass(frozen=True)
class Const:
    """A literal. `type` keeps 2 and 2.0 apart, since they print and divide differently."""
    value: Union[int, float, bool]
    type: str


@dataclass(frozen=True)
class Param:
    """A compile-time constant declared with `param`."""
    name: str


@dataclass(frozen=True)
class Load:
    """An element of a runtime `input` tensor."""
    tensor: str
    indices: tuple


@dataclass(frozen=True)
class Member:
    """`kb in tensor[i, ...]`: the tile index is one of the entries of a runtime index
    list (top-k key tiles per query tile). The indices select every axis of `tensor` but
    its last, which holds the list; entries of -1 pad a list and match no tile."""
    item: "Expr"  # Var("kb") or Var("qb")
    tensor: str
    indices: tuple


@dataclass(frozen=True)
class BinOp:
    op: str  # an arithmetic operator of attncc/operators.py: + - * / // %
    lhs: "Expr"
    rhs: "Expr"


@dataclass(frozen=True)
class Neg:
    operand: "Expr"


@dataclass(frozen=True)
class Cmp:
    op: str  # a comparison of attncc/operators.py: < <= > >= == !=
    lhs: "Expr"
    rhs: "Expr"


@dataclass(frozen=True)
class And:
    lhs: "Expr"
    rhs: "Expr"


@dataclass(frozen=True)
class Or:
    lhs: "Expr"
    rhs: "Expr"


@dataclass(frozen=True)
class Not:
    operand: "Expr"


@dataclass(frozen=True)
class Call:
    fn: str  # a function of attncc/operators.py (all but `where`, which has its own node)
    args: tuple


@dataclass(frozen=True)
class Where:
    cond: "Expr"
    then: "Expr"
    other: "Expr"


Expr = Union[Var, Const, Param, Load, Member, BinOp, Neg, Cmp, And, Or, Not, Call, Where]


# ------------------------------------------------------------------------ walking
class Visitor:
    """The base of every walk over expressions (and over the small programs the analyses
    return): `visitor(e, ...)` calls the method named after e's class (`Var`, `BinOp`,
    ...) with e and the rest, or `other` for a class it has no method for. Operations
    (BinOp, Neg, Cmp, And, Or, Not, Call, Where) mean what attncc/operators.py says."""

    def __call__(self, e, *args):
        return getattr(self, type(e).__name__, self.other)(e, *args)

    def other(self, e, *args):
        raise TypeError(f"{type(self).__name__} has no rule for {type(e).__name__}: {e!r}")


class _Children(Visitor):
    """The direct sub-expressions of a node, in source order."""

    def Var(self, e):
        return ()

    Const = Param = Var

    def Load(self, e):
        return e.indices

    def Member(self, e):
        return (e.item, *e.indices)

    def BinOp(self, e):
        return (e.lhs, e.rhs)

    Cmp = And = Or = BinOp

    def Neg(self, e):
        return (e.operand,)

    Not = Neg

    def Call(self, e):
        return e.args

    def Where(self, e):
        return (e.cond, e.then, e.other)

    def other(self, e, *args):
        raise TypeError(f"not an attncc expression: {e!r}")


children = _Children()


def walk(e: Expr):
    """Every node of `e`, parents before children."""
    yield e
    for c in children(e):
        yield from walk(c)


def free_vars(e: Expr) -> set:
    return {n.name for n in walk(e) if isinstance(n, Var)}


def loaded_tensors(e: Expr) -> set:
    return {n.tensor for n in walk(e) if isinstance(n, (Load, Member))}


class _Substitute(Visitor):
    """`e` with every Var named `name` replaced by `value`."""

    def __init__(self, name: str, value):
        self.name, self.value = name, value

    def Var(self, e):
        return self.value if e.name == self.name else e

    def Const(self, e):
        return e

    Param = Const

    def Load(self, e):
        return Load(e.tensor, tuple(self(i) for i in e.indices))

    def Member(self, e):
        return Member(self(e.item), e.tensor, tuple(self(i) for i in e.indices))

    def BinOp(self, e):
        return type(e)(e.op, self(e.lhs), self(e.rhs))

    Cmp = BinOp

    def And(self, e):
        return type(e)(self(e.lhs), self(e.rhs))

    Or = And

    def Neg(self, e):
        return type(e)(self(e.operand))

    Not = Neg

    def Call(self, e):
        return Call(e.fn, tuple(self(a) for a in e.args))

    def Where(self, e):
        return Where(self(e.cond), self(e.then), self(e.other))


def substitute(e: Expr, name: str, value: Expr) -> Expr:
    """`e` with the index name `name` replaced by the expression `value`."""
    return _Substitute(name, value)(e)


def index_lists(e: Expr | None) -> dict:
    """{tensor: "qb" or "kb"} for each input that `e` reads as an index list (`kb in t[...]`)."""
    if e is None:
        return {}
    return {n.tensor: n.item.name for n in walk(e) if isinstance(n, Member)}


# ---------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Heads:
    """`heads Hq / Hkv`: Hq query heads share Hkv key/value heads (GQA; MQA when Hkv = 1)."""
    q: int
    kv: int

    @property
    def group(self) -> int:
        return self.q // self.kv


@dataclass(frozen=True)
class ParamDecl:
    name: str
    type: str  # INT, FLOAT or BOOL
    value: Union[int, float, bool]


@dataclass(frozen=True)
class InputDecl:
    """`[learnable] input name: dtype[axes]`; each axis is an extent name or a size."""
    name: str
    dtype: str  # a key of DTYPES
    axes: tuple  # of str (a key of AXIS_EXTENTS) or int
    learnable: bool = False

    @property
    def type(self) -> str:
        return DTYPES[self.dtype]


# Variant fields that its repr (and so its key) names only when they are set.
_NAMED_WHEN_SET = ("sink",)

# Names may be long (64 KiB of spec); a file name may not (255 bytes on most systems).
NAME_IN_FILES = 48


@dataclass(frozen=True)
class Variant:
    """One attention variant: everything a kernel needs to know at compile time.

    Semantics (the reference implements exactly this): for each (b, h, q, k),
    s = scale * (Q[b,h,q] . K[b,h//group,k]); s' = score(s); the pair attends when
    `mask` holds and `layout` holds for tile (q // block, k // block). Attention is the
    softmax of s' over attending keys (a row with none gives 0 and LSE -inf), with
    dropout p applied to the probabilities, times V. A `sink` σ(b, h, q) is one more
    logit in each row's softmax that carries no value (gpt-oss's learnable sinks):
    L = log(Σ e^s' + e^σ), P = e^(s' - L), and a row with no key gives 0 and LSE σ.
    Under `normalize sum` a pair's probability is w = weight(s') over its row's sum l
    (LSE log l); under `normalize none` it is w itself (no LSE); masked pairs add
    exactly nothing either way. A sink is a softmax's logit, so it needs softmax.
    """
    name: str
    heads: Heads | None = None
    scale: Expr | None = None
    params: tuple = ()  # of ParamDecl
    inputs: tuple = ()  # of InputDecl
    mask: Expr | None = None
    layout: Expr | None = None
    block: int | None = None
    score: Expr | None = None
    dropout: float | None = None
    sink: Expr | None = None  # one extra logit per (b, h, q) row; reads no k and no s
    # The normaliser (README "Normalisers"): softmax, or `sum` / `none` of `weight`, a
    # function of the score's value s. Kept out of repr: key() adds them only where they
    # differ from softmax, so every softmax variant keeps its key, modules and tunings.
    normalize: str = field(default=SOFTMAX, repr=False)
    weight: Expr | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        """The dataclass's repr, less the fields added after keys were first shipped while
        they are unset: `key()` hashes it, and a variant that does not use them keeps its
        key (module names, tuning files, caches)."""
        shown = [f.name for f in dataclasses.fields(self) if f.repr
                 and (f.name not in _NAMED_WHEN_SET or getattr(self, f.name) is not None)]
        return f"Variant({', '.join(f'{n}={getattr(self, n)!r}' for n in shown)})"

    def param(self, name: str) -> ParamDecl:
        return {p.name: p for p in self.params}[name]

    def input(self, name: str) -> InputDecl:
        return {i.name: i for i in self.inputs}[name]

    @property
    def learnable_inputs(self) -> tuple:
        return tuple(i for i in self.inputs if i.learnable)

    @property
    def short_name(self) -> str:
        """The name as file and module names carry it: cut to NAME_IN_FILES characters,
        since the key beside it (a hash of the whole variant) keeps those unique."""
        return self.name[:NAME_IN_FILES]

    def key(self) -> str:
        """A short stable hash of everything in the variant, for module names and caches."""
        text = repr(self)
        if self.normalize != SOFTMAX:
            text += f" normalize={self.normalize!r} weight={self.weight!r}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def weighted(self) -> Expr | None:
        """What a pair adds under `sum` or `none`, as a function of the raw scaled
        product: `weight` with the score's value put in for s (None under softmax)."""
        if self.normalize == SOFTMAX:
            return None
        return substitute(self.weight, "s", self.score if self.score is not None else Var("s"))

    def __str__(self) -> str:
        return print_variant(self)


# ------------------------------------------------------------------ back to the language
# IR -> the language, as ast.unparse is to Python: parsing the printed text gives the same
# Variant (tests/test_language.py, test_fuzz.py).

# Binding strength, loosest first; a child binding looser than its parent needs parentheses.
OR, AND, NOT, CMP, SUM, PRODUCT, UNARY, ATOM = range(1, 9)
LEVEL = {"+": SUM, "-": SUM, "*": PRODUCT, "/": PRODUCT, "//": PRODUCT, "%": PRODUCT}


def print_expr(e) -> str:
    return _fmt(e)[0]


def _wrap(child, min_level: int) -> str:
    text, level = _fmt(child)
    return f"({text})" if level < min_level else text


class _Printer(Visitor):
    """(text, binding level) of an expression."""

    def Const(self, e):
        if e.type == BOOL:
            return ("true" if e.value else "false"), ATOM
        text = repr(e.value) if e.type == FLOAT else str(e.value)
        return text, (UNARY if text.startswith("-") else ATOM)

    def Var(self, e):
        return e.name, ATOM

    Param = Var

    def Load(self, e):
        return f"{e.tensor}[{', '.join(print_expr(i) for i in e.indices)}]", ATOM

    def Member(self, e):
        row = ", ".join(print_expr(i) for i in e.indices)
        return f"{_wrap(e.item, SUM)} in {e.tensor}[{row}]", CMP

    def Call(self, e):
        return f"{e.fn}({', '.join(print_expr(a) for a in e.args)})", ATOM

    def Where(self, e):
        return f"where({print_expr(e.cond)}, {print_expr(e.then)}, {print_expr(e.other)})", ATOM

    def Neg(self, e):
        return f"-{_wrap(e.operand, UNARY)}", UNARY

    def BinOp(self, e):
        lvl = LEVEL[e.op]
        # Left-associative: the right operand needs parentheses at equal strength.
        return f"{_wrap(e.lhs, lvl)} {e.op} {_wrap(e.rhs, lvl + 1)}", lvl

    def Cmp(self, e):
        # Comparisons chain in the language, so a comparison operand is always wrapped.
        return f"{_wrap(e.lhs, SUM)} {e.op} {_wrap(e.rhs, SUM)}", CMP

    def Not(self, e):
        return f"not {_wrap(e.operand, NOT)}", NOT

    def And(self, e):
        return f"{_wrap(e.lhs, AND)} and {_wrap(e.rhs, AND + 1)}", AND

    def Or(self, e):
        return f"{_wrap(e.lhs, OR)} or {_wrap(e.rhs, OR + 1)}", OR

    def other(self, e, *args):
        raise TypeError(f"not an attncc expression: {e!r}")


_fmt = _Printer()


def _fmt_value(value, type_: str) -> str:
    return print_expr(Const(value, type_))


def print_variant(v: Variant) -> str:
    lines = [f"attention {v.name} {{"]
    if v.heads:
        lines.append(f"    heads   {v.heads.q} / {v.heads.kv}")
    if v.scale is not None:
        lines.append(f"    scale   {print_expr(v.scale)}")
    for p in v.params:
        lines.append(f"    param   {p.name}: {p.type} = {_fmt_value(p.value, p.type)}")
    for i in v.inputs:
        axes = ", ".join(str(a) for a in i.axes)
        lines.append(f"    {'learnable ' if i.learnable else ''}input   {i.name}: {i.dtype}[{axes}]")
    if v.mask is not None:
        lines.append(f"    mask    {print_expr(v.mask)}")
    if v.layout is not None:
        lines.append(f"    layout  {print_expr(v.layout)}")
        lines.append(f"    block   {v.block}")
    if v.score is not None:
        lines.append(f"    score   {print_expr(v.score)}")
    if v.dropout is not None:
        lines.append(f"    dropout {v.dropout!r}")
    if v.sink is not None:
        lines.append(f"    sink    {print_expr(v.sink)}")
    if v.normalize != SOFTMAX:
        lines.append(f"    normalize {v.normalize}")
    if v.weight is not None:
        lines.append(f"    weight  {print_expr(v.weight)}")
    lines.append("}")
    return "\n".join(lines) + "\n"
