"""Name and type rules of the language, shared by both front ends.

`type_of` types one node from its children's types; `check_variant` checks a whole
Variant. Both raise SpecError without a position: the .attn parser attaches one (it
knows where each node came from), the decorator reports the Python function instead.
"""
from __future__ import annotations

import math
import re
import struct

from .. import ir
from ..operators import FUNCTIONS, entry_of
from ..reserved import call_keywords
from ..analysis import float_decisions, ranges, reads, signs
from ..errors import SpecError, SpecWarning, did_you_mean, warn

# A name as the grammar's NAME token spells it; the decorator's names must match it too,
# since names end up in generated code and module names.
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")

# Which index names each declaration may use, and why the others are out.
ALLOWED_VARS = {
    "mask": {"b", "h", "q", "k", "dim", "len_q", "len_k"},
    "layout": {"b", "h", "qb", "kb", "dim", "len_q", "len_k"},
    "score": {"b", "h", "q", "k", "s", "dim", "len_q", "len_k"},
    "weight": {"b", "h", "q", "k", "s", "dim", "len_q", "len_k"},
    "scale": {"dim", "dim_v"},
    "param": set(),
    "sink": {"b", "h", "q", "dim", "len_q", "len_k"},
}
WHY_NOT = {
    ("mask", "s"): "a mask decides which pairs attend before any score exists; "
                   "to change scores, use `score`",
    ("mask", "qb"): "qb and kb are tile indices and only mean something in `layout`",
    ("mask", "kb"): "qb and kb are tile indices and only mean something in `layout`",
    ("score", "qb"): "qb and kb are tile indices and only mean something in `layout`",
    ("score", "kb"): "qb and kb are tile indices and only mean something in `layout`",
    ("weight", "qb"): "qb and kb are tile indices and only mean something in `layout`",
    ("weight", "kb"): "qb and kb are tile indices and only mean something in `layout`",
    ("layout", "q"): "a layout decides whole tiles; use qb and kb there, or put "
                     "element conditions in `mask`",
    ("layout", "k"): "a layout decides whole tiles; use qb and kb there, or put "
                     "element conditions in `mask`",
    ("layout", "s"): "a layout decides whole tiles before any score exists",
    ("sink", "k"): "a sink is one extra logit per query row, the same for every key; "
                   "to change a pair's score, use `score`",
    ("sink", "s"): "a sink is one extra logit per query row, not a function of the pair's "
                   "score; to change scores, use `score`",
    ("sink", "qb"): "qb and kb are tile indices and only mean something in `layout`",
    ("sink", "kb"): "qb and kb are tile indices and only mean something in `layout`",
    **{(decl, "dim_v"): "v's head dim only sizes the output; `scale` may read it"
       for decl in ("mask", "layout", "score", "sink", "weight")},
}

# Deeper expressions are refused: every pass walks the IR recursively, and no real
# variant is more than a few operators deep.
MAX_DEPTH = 128

TYPE_WORDS = ir.TYPE_WORDS

DECL_NAMES = ("heads", "scale", "param", "input", "mask", "layout", "block", "score", "dropout",
              "sink", "normalize", "weight")


class Scope:
    """What names mean inside one declaration of one variant."""

    def __init__(self, decl: str, params: dict, inputs: dict):
        self.decl = decl
        self.params = params  # name -> ParamDecl
        self.inputs = inputs  # name -> InputDecl

    def all_names(self):
        return set(ALLOWED_VARS[self.decl]) | set(self.params) | set(self.inputs) | set(FUNCTIONS)

    def resolve(self, name: str):
        """The IR node a bare name stands for, or a SpecError."""
        if name in self.params:
            return ir.Param(name)
        if name in ir.INDEX_VARS:
            if name in ALLOWED_VARS[self.decl]:
                return ir.Var(name)
            why = WHY_NOT.get((self.decl, name))
            if self.decl in ("param", "scale"):
                why = f"`{self.decl}` must be a constant, known when the kernel is compiled"
            raise SpecError(f"'{name}' cannot be used in `{self.decl}`"
                            + (f": {why}" if why else ""))
        if name in self.inputs:
            inp = self.inputs[name]
            raise SpecError(f"'{name}' is a tensor with {len(inp.axes)} "
                            f"ax{'is' if len(inp.axes) == 1 else 'es'}; index it, "
                            f"as in {name}[{', '.join(_axis_hint(a) for a in inp.axes)}]")
        if name in FUNCTIONS:
            raise SpecError(f"'{name}' is a function; call it, as in {name}(...)")
        hint = did_you_mean(name, self.all_names())
        if not hint:
            known = [v for v in ir.INDEX_VARS if v in ALLOWED_VARS[self.decl]]
            known += list(self.params) + list(self.inputs)
            shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
            hint = f"; `{self.decl}` can use {shown}" if known else ""
        raise SpecError(f"unknown name '{name}'{hint}")


def _axis_hint(axis) -> str:
    return axis if isinstance(axis, str) else "0"


def type_of(node, child_types: list, scope: Scope) -> str:
    """The type of `node` given its children's types; raises SpecError on a mismatch."""
    return _Types(scope)(node, child_types)


class _Types(ir.Visitor):
    """The type of one node from its children's: names and reads here, operations by
    their rules in attncc/operators.py."""

    def __init__(self, scope: Scope):
        self.scope = scope

    def Var(self, node, child_types):
        return ir.FLOAT if node.name == "s" else ir.INT

    def Const(self, node, child_types):
        if node.type == ir.FLOAT:
            check_float32(node.value, f"the number {node.value!r}")
        return node.type

    def Param(self, node, child_types):
        return self.scope.params[node.name].type

    def Load(self, node, child_types):
        scope = self.scope
        inp = scope.inputs.get(node.tensor)
        if inp is None:
            raise SpecError(f"unknown tensor '{node.tensor}'"
                            f"{did_you_mean(node.tensor, scope.inputs)}"
                            + ("" if scope.inputs else "; declare it with `input`"))
        if scope.decl in ("scale", "param"):
            raise SpecError(f"`{scope.decl}` must be a constant, so it cannot read the "
                            f"tensor '{node.tensor}'")
        if len(node.indices) != len(inp.axes):
            raise SpecError(f"'{node.tensor}' has {len(inp.axes)} "
                            f"ax{'is' if len(inp.axes) == 1 else 'es'} but is indexed with "
                            f"{len(node.indices)}")
        for i, t in enumerate(child_types):
            if t != ir.INT:
                raise SpecError(f"index {i + 1} of '{node.tensor}' must be an integer, "
                                f"not {TYPE_WORDS[t]}")
        return inp.type

    def Member(self, node, child_types):
        return _type_of_member(node, child_types, self.scope)

    def other(self, node, child_types):
        """An operation: its rule in the table."""
        try:
            entry = entry_of(node)
        except (TypeError, KeyError):
            raise SpecError(f"internal: {node!r} is no operation of the language") from None
        t = entry.types(node, child_types, self.scope)
        if t == ir.FLOAT:
            _check_constant_float(node, self.scope)
        return t


def _check_constant_float(node, scope: Scope):
    """A float operation of constants alone (`1e20 * 1e20`, `exp(100.0)`) beyond float32's
    range is refused as a literal is: the kernels compute it in float32 (inf, and NaN
    after), the reference in float64."""
    if ir.free_vars(node) or any(isinstance(n, ir.Load) for n in ir.walk(node)):
        return
    from ..semantics.evaluate import evaluate  # imported here: it needs torch
    env = {"params": {p.name: p.value for p in scope.params.values()}, "inputs": {}}
    try:
        if any(isinstance(n, ir.BinOp) and n.op in ("/", "//", "%")
               and float(evaluate(n.rhs, env)) == 0 for n in ir.walk(node)):
            return  # a division by zero: the range analysis names it
        value = float(evaluate(node, env))
    except (ArithmeticError, ValueError, TypeError, RuntimeError):
        return  # a division by zero further in (`0 // 0`): the range analysis names it
    if math.isnan(value):  # sqrt(-1.0), log(-1.0): NaN in every pair it reaches
        raise SpecError(f"`{ir.print_expr(node)}` is not a number (NaN) for every call; the "
                        "function is undefined at that constant")
    check_float32(value, f"`{ir.print_expr(node)}` ({value:.3g})", underflow=False)


def _type_of_member(node: ir.Member, child_types: list, scope: Scope) -> str:
    """`kb in top[b, h, qb]`: a tile index against a runtime list of tile indices."""
    inp = scope.inputs.get(node.tensor)
    if inp is None:
        raise SpecError(f"unknown tensor '{node.tensor}'{did_you_mean(node.tensor, scope.inputs)}"
                        + ("" if scope.inputs else "; declare it with `input`"))
    if scope.decl != "layout":
        raise SpecError("`in` tests a tile index against a list of tile indices, so it belongs "
                        f"in `layout`, not `{scope.decl}`")
    if not (isinstance(node.item, ir.Var) and node.item.name in ir.TILE_VARS):
        raise SpecError("the left side of `in` must be kb or qb, the tile index to look up, as in "
                        f"`kb in {node.tensor}[b, h, qb]`")
    example = f"input {node.tensor}: i32[b, h, qb, 8]"
    if inp.type != ir.INT:
        raise SpecError(f"'{node.tensor}' must hold integer tile indices to be used with `in`, "
                        f"but it is {inp.dtype}; declare it as `{example}`")
    if not isinstance(inp.axes[-1], int):
        raise SpecError(f"the last axis of '{node.tensor}' holds the index list, so it must be a "
                        f"fixed size (the list length), not '{inp.axes[-1]}'; as in `{example}`")
    if len(node.indices) != len(inp.axes) - 1:
        raise SpecError(f"`in` reads whole index lists: index every axis of '{node.tensor}' but its "
                        f"last ({len(inp.axes) - 1} of {len(inp.axes)}), got {len(node.indices)}")
    for i, t in enumerate(child_types[1:]):
        if t != ir.INT:
            raise SpecError(f"index {i + 1} of '{node.tensor}' must be an integer, "
                            f"not {TYPE_WORDS[t]}")
    return ir.BOOL


def check_expr(e, scope: Scope, on_error=None) -> str:
    """Type `e` bottom-up; `on_error(node, err)` may attach a position before it propagates."""
    kids = [check_expr(c, scope, on_error) for c in ir.children(e)]
    try:
        if isinstance(e, ir.Var):
            scope.resolve(e.name)  # raises if the name is out of place here
        return type_of(e, kids, scope)
    except SpecError as err:
        if on_error:
            on_error(e, err)
        raise


def check_depth(e):
    """Refuse an expression nested deeper than MAX_DEPTH, without recursing to find out."""
    stack = [(e, 1, None)]
    while stack:
        node, depth, path = stack.pop()
        path = (node, path)
        if depth > MAX_DEPTH:
            raise SpecError(too_deep_message(_linked(path), _ir_operator, _ir_first))
        stack.extend((c, depth + 1, path) for c in ir.children(node))


def _linked(path) -> list:
    """(node, (parent, (...))) as a list, root first."""
    out = []
    while path is not None:
        node, path = path
        out.append(node)
    return out[::-1]


ADDITIVE = ("+", "-")


def _ir_operator(node):
    """The operator that chains with itself on the left (`a + b - c`), or None."""
    if isinstance(node, ir.BinOp):
        return "+-" if node.op in ADDITIVE else "*/"
    return {ir.And: "and", ir.Or: "or", ir.Not: "not", ir.Neg: "-"}.get(type(node))


def _ir_first(node):
    return node.lhs if isinstance(node, (ir.BinOp, ir.And, ir.Or)) else node.operand


def too_deep_message(path, operator, first) -> str:
    """Why the expression whose root-to-leaf `path` is deeper than MAX_DEPTH is refused.
    A long run of one operator (`s + s + ... + s`) nests nothing the user wrote, so it
    is named as a chain, with its length. `operator(node)` says what a node chains
    with (or None), `first(node)` its left operand (the tree's own shape, IR or parse)."""
    best, best_top, run = 0, None, 0
    for i in range(1, len(path)):
        above, node = path[i - 1], path[i]
        kind = operator(above)
        run = run + 1 if kind is not None and operator(node) == kind and first(above) is node else 0
        if run > best:
            best, best_top = run, path[i - run]
    if best_top is not None and best >= MAX_DEPTH // 2:
        kind, node, length = operator(best_top), best_top, 0
        while operator(node) == kind:
            length, node = length + 1, first(node)
        return (f"this expression has an operator chain longer than {MAX_DEPTH} levels allow: "
                f"{length} `{_chain_words(kind)}` in a row; a variant's expressions are a few "
                "operators long")
    return (f"this expression is nested more than {MAX_DEPTH} levels deep; a variant's "
            "expressions are a few operators long")


def _chain_words(kind: str) -> str:
    return {"+-": "+` or `-", "*/": "*`, `/`, `//` or `%"}.get(kind, kind)


def check_declared_type(decl: str, t: str):
    """The type each expression declaration must have."""
    if decl in ("mask", "layout") and t != ir.BOOL:
        example = "qb >= kb" if decl == "layout" else "q >= k"
        raise SpecError(f"`{decl}` must be a condition (true/false), but this is "
                        f"{TYPE_WORDS[t]}; compare it, as in `{example}`")
    if decl in ("score", "scale", "sink", "weight") and t == ir.BOOL:
        raise SpecError(f"`{decl}` must be a number, but this is a condition; "
                        "use where(cond, a, b) to choose between numbers")


def check_block(block: int):
    if block < 16 or block > 256 or block & (block - 1):
        raise SpecError(f"block {block} is not supported: use a power of two from 16 to 256")


def check_heads(hq: int, hkv: int):
    if hq < 1 or hkv < 1:
        raise SpecError(f"heads {hq} / {hkv}: both head counts must be at least 1")
    if hq % hkv:
        raise SpecError(f"heads {hq} / {hkv}: the query heads ({hq}) must be a multiple of the "
                        f"key/value heads ({hkv}) so that each key/value head serves a whole group")


def check_dropout(p):
    if not (0 <= p < 1):
        raise SpecError(f"dropout {p} is out of range: the probability must be in [0, 1)")
    if p > 1 - 2 ** -16:
        # Elements are dropped under round(p * 2**31) of a 31-bit hash and kept ones scaled
        # by 1 / (1 - p): past this the kept fraction differs from 1 - p enough to bias
        # the output's expectation (4.7x at p = 1 - 1e-10).
        raise SpecError(f"dropout {p} keeps fewer than one element in 65536, where the drawn "
                        "fraction no longer matches 1 - p and the 1 / (1 - p) scale biases the "
                        "output; use dropout at most 0.99998")


def check_normalize(name: str):
    if name not in ir.NORMALIZERS:
        raise SpecError(f"unknown normaliser '{name}': use softmax, sum or none"
                        f"{did_you_mean(name, ir.NORMALIZERS)}")


def check_normaliser(v: ir.Variant):
    """`weight` goes with `normalize sum` or `none`, and `sum` needs a weight that
    cannot be negative (a row's sum could otherwise be 0 or change sign)."""
    if v.normalize == ir.SOFTMAX:
        if v.weight is not None:
            raise SpecError("`weight` needs `normalize sum` or `normalize none`: under softmax "
                            "a pair's weight is e^score; to change it, use `score`")
        return
    if v.sink is not None:
        raise SpecError(f"`sink` with `normalize {v.normalize}` is not supported: a sink is one "
                        "more logit in a softmax's denominator (e^sink joins the sum of e^s), "
                        f"and `normalize {v.normalize}` has no softmax; remove the sink, or "
                        "remove `normalize` and `weight` to keep softmax with its sink")
    if v.weight is None:
        raise SpecError(f"`normalize {v.normalize}` needs `weight EXPR`, what a pair adds as a "
                        "function of its score s, as in `weight sigmoid(s - 9.0)`")
    if v.dropout is not None:
        raise SpecError(f"`dropout` with `normalize {v.normalize}` is not supported: dropout "
                        "is implemented for softmax only; remove one of the two")
    if v.normalize == ir.BY_SUM:
        why = signs.why_not_nonnegative(v.weight, v)
        if why is not None:
            raise SpecError(f"`normalize sum` divides by the row's sum of weights, so the weight "
                            f"must be provably >= 0, but {why}; use a weight such as "
                            "exp(s), sigmoid(s), max(s, 0.0), abs(s) or s * s, or `normalize none`")


def check_input(inp: ir.InputDecl):
    taken_by = call_keywords().get(inp.name)
    if taken_by is not None:
        raise SpecError(f"an input cannot be named '{inp.name}': {taken_by} already takes "
                        f"{inp.name}= (inputs are passed as keyword arguments); choose another name")
    if inp.dtype not in ir.DTYPES:
        raise SpecError(f"unknown element type '{inp.dtype}': use one of {', '.join(ir.DTYPES)}"
                        f"{did_you_mean(inp.dtype, ir.DTYPES)}")
    for a in inp.axes:
        if isinstance(a, int):
            if a < 1:
                raise SpecError(f"axis size {a} of '{inp.name}' must be at least 1")
        elif a not in ir.AXIS_EXTENTS:
            raise SpecError(f"unknown axis '{a}' of '{inp.name}': an axis is a size or one of "
                            f"{', '.join(ir.AXIS_EXTENTS)}{did_you_mean(a, ir.AXIS_EXTENTS)}")
    if inp.learnable and inp.type != ir.FLOAT:
        raise SpecError(f"learnable input '{inp.name}' must have a floating-point type "
                        "(f16, bf16, f32, f64) to receive gradients")


KEYWORDS = ("attention", "heads", "scale", "param", "input", "learnable", "mask", "layout",
            "block", "score", "dropout", "sink", "normalize", "weight", "and", "or", "not", "in",
            "true", "false")


def check_identifier(name, what: str):
    if not isinstance(name, str) or not IDENTIFIER.match(name):
        raise SpecError(f"{what} {name!r} is not a name: use ASCII letters, digits and '_', "
                        "not starting with a digit")


def check_name_free(name: str, taken: set):
    check_identifier(name, "the name")
    if name in KEYWORDS:
        raise SpecError(f"'{name}' is a keyword of the language; choose another name")
    if name in ir.INDEX_VARS:
        raise SpecError(f"'{name}' is an index name ({ir.INDEX_VARS[name]}); choose another name")
    if name in FUNCTIONS:
        raise SpecError(f"'{name}' is a function; choose another name")
    if name in taken:
        raise SpecError(f"'{name}' is declared twice")


# The largest float32: the kernels compute the language's floats in float32, where a
# larger constant is inf (and inf * 0 NaN), while the float64 reference stays finite.
FLOAT32_MAX = 3.4028234663852886e38


def check_float32(value: float, what: str, underflow: bool = True):
    if abs(value) > FLOAT32_MAX:
        raise SpecError(f"{what} is beyond float32's range (at most 3.4e38 in size), which the "
                        "kernels compute in; scale it down")
    # Below float32's smallest subnormal a written number is 0 in the kernels and not in
    # the float64 reference: a scale of 1e-46 gave NaN rows. (A product of constants that
    # underflows is 0 in both, to within what either can tell apart: not refused.)
    if underflow and value != 0 and struct.unpack("f", struct.pack("f", value))[0] == 0:
        raise SpecError(f"{what} is below float32's range (at least 1.4e-45 in size), so the "
                        "kernels, which compute in float32, would read it as 0; write 0.0, or "
                        "scale it up")


def check_param_value(p: ir.ParamDecl):
    """A param's value must be a finite number of its type, an int within 64 bits."""
    want = {ir.INT: int, ir.FLOAT: float, ir.BOOL: bool}[p.type]
    if not isinstance(p.value, want) or (want is int and isinstance(p.value, bool)):
        raise SpecError(f"param '{p.name}' is declared {p.type} but its value is {p.value!r}")
    if p.type == ir.FLOAT and not math.isfinite(p.value):
        raise SpecError(f"param '{p.name}' is {p.value}: a param must be a finite number; "
                        "the language has no infinities")
    if p.type == ir.FLOAT:
        check_float32(p.value, f"param '{p.name}' ({p.value!r})")
    if p.type == ir.INT and not -2 ** 63 <= p.value < 2 ** 63:
        raise SpecError(f"param '{p.name}' is {p.value}, too large: integers must fit in 64 bits")


def check_variant(v: ir.Variant) -> ir.Variant:
    """Check a whole variant (the decorator's path: the parser checks as it goes)."""
    check_identifier(v.name, "the variant name")
    taken = set()
    for p in v.params:
        check_name_free(p.name, taken)
        check_param_value(p)
        taken.add(p.name)
    for i in v.inputs:
        check_name_free(i.name, taken)
        check_input(i)
        taken.add(i.name)
    if v.heads:
        check_heads(v.heads.q, v.heads.kv)
    params = {p.name: p for p in v.params}
    inputs = {i.name: i for i in v.inputs}
    check_normalize(v.normalize)
    for decl in ("scale", "mask", "layout", "score", "sink", "weight"):
        e = getattr(v, decl)
        if e is not None:
            check_depth(e)
            check_declared_type(decl, check_expr(e, Scope(decl, params, inputs)))
    check_structure(v)
    ranges.check_variant(v)
    for decl, finding in reads.escaping_reads(v) + float_decisions.float_decisions(v):
        warn(SpecWarning(f"variant '{v.name}': {finding.message(decl)}"))
    return v


def check_structure(v: ir.Variant):
    """Rules that tie declarations together."""
    if v.block is not None:
        check_block(v.block)
    if v.layout is not None and v.block is None:
        raise SpecError("`layout` needs a tile size: add `block N` (a power of two, 16 to 256)")
    if v.block is not None and v.layout is None:
        raise SpecError("`block` sets the tile size of a `layout`, but there is no layout")
    if v.dropout is not None:
        check_dropout(v.dropout)
    check_normaliser(v)
    for i in v.inputs:
        if any(a in ir.TILE_VARS for a in i.axes if isinstance(a, str)) and v.block is None:
            raise SpecError(f"input '{i.name}' has a tile axis (qb or kb), which needs `block N`")
    check_learnable_reads(v)


def check_learnable_reads(v: ir.Variant):
    """A learnable input's gradient flows through the score, the weight and the sink. One
    that none of them reads (a mask's or layout's yes/no has no slope) would get none:
    the backward had no entry for it."""
    differentiable = [e for e in (v.score, v.weight, v.sink) if e is not None]
    read = {n.tensor for e in differentiable for n in ir.walk(e) if isinstance(n, ir.Load)}
    for i in v.inputs:
        if i.learnable and i.name not in read:
            raise SpecError(f"learnable input '{i.name}' is read by no score, weight or sink, so "
                            "it would get no gradient (a mask or layout holds or not, with no "
                            f"slope); declare it `input {i.name}: {i.dtype}"
                            f"[{', '.join(map(str, i.axes))}]` and pass {i.name}.detach()")
