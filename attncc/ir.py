"""The intermediate representation: frozen, hashable dataclasses for one attention variant.

Both front ends (the .attn language and the Python decorator) build these nodes, the
passes read them, and `Variant.key()` names every generated module and cache entry.
Nodes carry no source positions, so the same variant written either way is equal.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Union

# ----------------------------------------------------------------------------- types
INT, FLOAT, BOOL = "int", "float", "bool"

# Element types an `input` tensor can have, and the expression type a load of it gives.
DTYPES = {
    "bool": BOOL,
    "i8": INT, "i16": INT, "i32": INT, "i64": INT,
    "f16": FLOAT, "bf16": FLOAT, "f32": FLOAT, "f64": FLOAT,
}

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

FUNCTIONS = {  # name -> (number of arguments, description)
    "abs": (1, "absolute value"),
    "min": (2, "smaller of two"),
    "max": (2, "larger of two"),
    "exp": (1, "e to the power"),
    "log": (1, "natural logarithm"),
    "tanh": (1, "hyperbolic tangent"),
    "sqrt": (1, "square root"),
    "floor": (1, "the largest integer <= a number, as an integer"),
    "ceil": (1, "the smallest integer >= a number, as an integer"),
    "int": (1, "a number rounded toward zero, as an integer (Python's int(), torch's .long())"),
    "where": (3, "where(cond, a, b): a if cond else b"),
    "chance": (None, "chance(p, i, ...): true with probability p (a constant), drawn from a "
                     "hash of one to five integers i, as in chance(0.1, seed, h, qb, kb); "
                     "layouts only"),
}
CHANCE_MAX_KEYS = 5  # seed, b, h, qb, kb
FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sqrt")
# Number -> integer: the way a float becomes an index (T5's log-spaced position buckets).
ROUNDING_FUNCTIONS = ("floor", "ceil", "int")

ARITH_OPS = ("+", "-", "*", "/", "//", "%")
CMP_OPS = ("<", "<=", ">", ">=", "==", "!=")


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
    op: str  # one of ARITH_OPS
    lhs: "Expr"
    rhs: "Expr"


@dataclass(frozen=True)
class Neg:
    operand: "Expr"


@dataclass(frozen=True)
class Cmp:
    op: str  # one of CMP_OPS
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
    fn: str  # one of FUNCTIONS except `where`
    args: tuple


@dataclass(frozen=True)
class Where:
    cond: "Expr"
    then: "Expr"
    other: "Expr"


Expr = Union[Var, Const, Param, Load, Member, BinOp, Neg, Cmp, And, Or, Not, Call, Where]


def children(e: Expr) -> tuple:
    """The direct sub-expressions of `e`, in source order."""
    if isinstance(e, (Var, Const, Param)):
        return ()
    if isinstance(e, Load):
        return e.indices
    if isinstance(e, Member):
        return (e.item, *e.indices)
    if isinstance(e, (BinOp, Cmp, And, Or)):
        return (e.lhs, e.rhs)
    if isinstance(e, (Neg, Not)):
        return (e.operand,)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Where):
        return (e.cond, e.then, e.other)
    raise TypeError(f"not an attncc expression: {e!r}")


def walk(e: Expr):
    """Every node of `e`, parents before children."""
    yield e
    for c in children(e):
        yield from walk(c)


def free_vars(e: Expr) -> set:
    return {n.name for n in walk(e) if isinstance(n, Var)}


def loaded_tensors(e: Expr) -> set:
    return {n.tensor for n in walk(e) if isinstance(n, (Load, Member))}


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


# Names may be long (64 KiB of spec); a file name may not (255 bytes on most systems).
NAME_IN_FILES = 48


@dataclass(frozen=True)
class Variant:
    """One attention variant: everything a kernel needs to know at compile time.

    Semantics (the reference implements exactly this): for each (b, h, q, k),
    s = scale * (Q[b,h,q] . K[b,h//group,k]); s' = score(s); the pair attends when
    `mask` holds and `layout` holds for tile (q // block, k // block). Attention is the
    softmax of s' over attending keys (a row with none gives 0 and LSE -inf), with
    dropout p applied to the probabilities, times V.
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
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

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


def _fmt(e):
    """(text, binding level) of an expression."""
    if isinstance(e, Const):
        if e.type == BOOL:
            return ("true" if e.value else "false"), ATOM
        text = repr(e.value) if e.type == FLOAT else str(e.value)
        return text, (UNARY if text.startswith("-") else ATOM)
    if isinstance(e, (Var, Param)):
        return e.name, ATOM
    if isinstance(e, Load):
        return f"{e.tensor}[{', '.join(print_expr(i) for i in e.indices)}]", ATOM
    if isinstance(e, Member):
        row = ", ".join(print_expr(i) for i in e.indices)
        return f"{_wrap(e.item, SUM)} in {e.tensor}[{row}]", CMP
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(print_expr(a) for a in e.args)})", ATOM
    if isinstance(e, Where):
        return f"where({print_expr(e.cond)}, {print_expr(e.then)}, {print_expr(e.other)})", ATOM
    if isinstance(e, Neg):
        return f"-{_wrap(e.operand, UNARY)}", UNARY
    if isinstance(e, BinOp):
        lvl = LEVEL[e.op]
        # Left-associative: the right operand needs parentheses at equal strength.
        return f"{_wrap(e.lhs, lvl)} {e.op} {_wrap(e.rhs, lvl + 1)}", lvl
    if isinstance(e, Cmp):
        # Comparisons chain in the language, so a comparison operand is always wrapped.
        return f"{_wrap(e.lhs, SUM)} {e.op} {_wrap(e.rhs, SUM)}", CMP
    if isinstance(e, Not):
        return f"not {_wrap(e.operand, NOT)}", NOT
    if isinstance(e, And):
        return f"{_wrap(e.lhs, AND)} and {_wrap(e.rhs, AND + 1)}", AND
    if isinstance(e, Or):
        return f"{_wrap(e.lhs, OR)} or {_wrap(e.rhs, OR + 1)}", OR
    raise TypeError(f"not an attncc expression: {e!r}")


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
    lines.append("}")
    return "\n".join(lines) + "\n"
