"""Differential fuzzing: random variants and shapes, kernels against the float64 reference.

A hypothesis strategy builds random Variants from the pieces real variants are made of:
masks from affine comparisons of q, k, len_q and len_k (small integer coefficients and
constants), `%` and `//` by small constants and document-id reads, joined by and/or/not;
score modifications (scaling, softcap, ALiBi, a leaky `where`); a block layout, some
with random blocks from `chance(p, seed, h, qb, kb)`; GQA groups of 1, 2 and 4; params;
dropout. And what an adversary tries (issue 17): constants and windows from 2**31 up,
hash-like masks with coefficients near 2**31, i64 document ids that agree in their low
32 bits, scores constant over a tile (`0.0`, `x[h]`, `0.01 * q`), input and variant
names that are Python keywords, builtins or names of the generated code, and calls
placed near position 2**31 by q_offset/k_offset. And learnable inputs: a learned ALiBi
slope drawn large and of either sign, a score that grows with distance (issue 30).
Each is compiled and run on random
shapes (len_q != len_k, lengths 1 to 70 that are not multiples of 16, head dims
16/32/48/80), and the forward (out, lse) and backward (dq, dk, dv) are held to
`attncc.tolerance`'s rule against `attncc.reference` in float64 (float32 under the
interpreter).

The front end is fuzzed against itself with the same strategy: printing a variant and
parsing the text gives the same IR, and so does building it with the decorator from
Python functions that spell the same expressions.

CI runs a seeded, bounded number of examples (derandomized: the same examples every
run): the first of the eight kernel shards (10 examples), the others with `-m slow`.
Run far more with

    ATTNCC_FUZZ_EXAMPLES=1000 python -m pytest -n 2 -m "" tests/test_fuzz.py

(the number of kernel examples, split over the shards, all of which `-m ""` runs; the
front-end tests run five times as many). A failure hypothesis finds becomes a named test in test_regressions.py.
"""
from __future__ import annotations

import dataclasses
import keyword
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import attncc
from attncc.frontend import checker
from attncc import ir, operators
from attncc.frontend.decorator import build_variant
from attncc.ir import print_variant
from test_kernels import compare

KERNEL_SHARDS = 8  # parametrized, so `pytest -n 2` spreads the kernel examples over workers
KERNEL_EXAMPLES = int(os.environ.get("ATTNCC_FUZZ_EXAMPLES", "80"))
FRONT_END_EXAMPLES = 5 * KERNEL_EXAMPLES if "ATTNCC_FUZZ_EXAMPLES" in os.environ else 300

kernel_settings = settings(max_examples=max(1, math.ceil(KERNEL_EXAMPLES / KERNEL_SHARDS)),
                           deadline=None, derandomize=True, print_blob=True,
                           suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])
front_end_settings = settings(max_examples=FRONT_END_EXAMPLES, deadline=None,
                              derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ IR building blocks
Q, K, LQ, LK = ir.Var("q"), ir.Var("k"), ir.Var("len_q"), ir.Var("len_k")
S, H = ir.Var("s"), ir.Var("h")


def c_int(n):
    return ir.Const(n, ir.INT)


def c_float(x):
    return ir.Const(float(x), ir.FLOAT)


@st.composite
def affine(draw, params=()):
    """a*x + b*y + ... + c over q, k, len_q, len_k: always led by a variable (so that a
    Python function spelling it traces to the same tree), small coefficients."""
    names = draw(st.lists(st.sampled_from([Q, K, LQ, LK]), min_size=1, max_size=3,
                          unique=True))
    expr = None
    for var in names:
        coef = draw(st.sampled_from([1, 1, 1, 2, 3, -1, -2]))
        if expr is None:
            if coef == 1:
                term = var
            elif coef == -1:
                term = ir.Neg(var)
            else:
                term = ir.BinOp("*", c_int(coef), var)
            expr = term
        else:
            mag = abs(coef)
            term = var if mag == 1 else ir.BinOp("*", c_int(mag), var)
            expr = ir.BinOp("+" if coef > 0 else "-", expr, term)
    const = draw(st.sampled_from([None, None, 1, 2, 3, 5, 8, 17, "param"] if params
                                 else [None, None, 1, 2, 3, 5, 8, 17]) | LARGE)
    if const == "param":
        expr = ir.BinOp(draw(st.sampled_from("+-")), expr, ir.Param(params[0]))
    elif const is not None:
        expr = ir.BinOp(draw(st.sampled_from("+-")), expr, c_int(const))
    return expr


CMP = st.sampled_from(operators.CMP_OPS)
SMALL = st.sampled_from([2, 3, 4, 5, 7, 8, 16])
# Constants past 32 bits, now and then: a kernel computing in int32 gets them wrong.
LARGE = st.sampled_from([2 ** 31 - 1, 2 ** 31, 3_000_000_000, -2 ** 31 - 5])
BIG_COEFFICIENT = st.sampled_from([1103515245, 2 ** 31 - 1, 65599, 12345, 1])


@st.composite
def atom(draw, params=(), docs=False):
    # The adversary's atoms (hash, doc_arith) come now and then: they leave every tile
    # partial, so each costs the interpreter a full pass over the tiles.
    kinds = (["affine"] * 4 + ["affine_const", "mod", "floordiv"] * 2 + ["hash"]
             + (["doc"] * 4 + ["doc_arith"] if docs else []))
    kind = draw(st.sampled_from(kinds))
    if kind == "hash":
        # (a*q + b*k) % m, with a and b up to 2**31: past 32 bits, inside 64.
        expr = ir.BinOp("+", ir.BinOp("*", Q, c_int(draw(BIG_COEFFICIENT))),
                        ir.BinOp("*", K, c_int(draw(BIG_COEFFICIENT))))
        m = draw(SMALL)
        return ir.Cmp(draw(CMP), ir.BinOp("%", expr, c_int(m)), c_int(draw(st.integers(0, m - 1))))
    if kind == "doc_arith":
        # Arithmetic on document ids (i64 ones are far past 32 bits).
        lhs = ir.BinOp("%", ir.BinOp("+", ir.Load("doc_q", (Q,)), K), c_int(draw(SMALL)))
        return ir.Cmp(draw(CMP), lhs, c_int(draw(st.integers(0, 2))))
    if kind == "affine":
        return ir.Cmp(draw(CMP), draw(affine(params)), draw(affine(params)))
    if kind == "affine_const":
        return ir.Cmp(draw(CMP), draw(affine(params)),
                      draw(st.sampled_from([c_int(0), c_int(4), c_int(-3), c_int(30)])
                           | LARGE.map(c_int)))
    if kind == "mod":
        m = draw(SMALL)
        lhs = ir.BinOp("%", draw(affine()), c_int(m))
        rhs = draw(st.one_of(st.integers(0, m - 1).map(c_int),
                             affine().map(lambda a: ir.BinOp("%", a, c_int(m)))))
        return ir.Cmp(draw(CMP), lhs, rhs)
    if kind == "floordiv":
        m = draw(SMALL)
        lhs = ir.BinOp("//", draw(affine()), c_int(m))
        rhs = draw(st.one_of(st.integers(-1, 3).map(c_int),
                             affine().map(lambda a: ir.BinOp("//", a, c_int(m)))))
        return ir.Cmp(draw(CMP), lhs, rhs)
    # Document ids, as in examples/document.attn.
    return ir.Cmp(draw(st.sampled_from(["==", "==", "!=", "<="])),
                  ir.Load("doc_q", (Q,)), ir.Load("doc_k", (K,)))


@st.composite
def boolean(draw, params=(), docs=False, depth=2):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(atom(params, docs))
    op = draw(st.sampled_from(["and", "and", "or", "or", "not"]))
    if op == "not":
        return ir.Not(draw(boolean(params, docs, depth - 1)))
    a, b = draw(boolean(params, docs, depth - 1)), draw(boolean(params, docs, depth - 1))
    return ir.And(a, b) if op == "and" else ir.Or(a, b)


# Names an input or a variant may take that the generated code, Python or its imports
# also use: none may change what the kernels compute.
HOSTILE_NAMES = ["def", "torch", "tl", "triton", "inputs", "off_h", "off_b", "q_pos", "grid",
                 "device", "in_doc", "d_in_slope", "lambda", "math", "B", "H", "_c0",
                 "row_full_list", "LEARNABLE", "self"]
VARIANT_NAMES = ["fuzz", "fuzz", "fuzz", "torch", "def", "n" * 300]


def renamed(e, names: dict):
    """`e` with its input reads renamed by `names`."""
    if e is None or isinstance(e, (ir.Var, ir.Const, ir.Param)):
        return e
    changes = {}
    for f in dataclasses.fields(e):
        value = getattr(e, f.name)
        if f.name == "tensor":
            changes[f.name] = names.get(value, value)
        elif isinstance(value, tuple):
            changes[f.name] = tuple(renamed(x, names) for x in value)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = renamed(value, names)
    return dataclasses.replace(e, **changes)


@st.composite
def variants(draw):
    """A random Variant, checked by attncc's checker as both front ends would."""
    params, inputs = [], []
    use_window_param = draw(st.booleans())
    if use_window_param:
        params.append(ir.ParamDecl("w", ir.INT, draw(st.sampled_from([0, 1, 4, 9, 33, 2 ** 31 - 1]))))
    docs = draw(st.booleans())
    mask = draw(st.one_of(st.none(), boolean(("w",) if use_window_param else (), docs)))
    if mask is not None and docs and not ({"doc_q", "doc_k"} & ir.loaded_tensors(mask)):
        docs = False
    if mask is None or "w" not in {n.name for n in ir.walk(mask) if isinstance(n, ir.Param)}:
        params = []
    if docs:
        dtype = draw(st.sampled_from(["i32", "i32", "i64"]))  # i64 ids differ past 32 bits
        inputs += [ir.InputDecl("doc_q", dtype, ("q",)), ir.InputDecl("doc_k", dtype, ("k",))]

    score_kind = draw(st.sampled_from(["none", "scale", "softcap", "alibi", "leaky", "constant",
                                       "per_head", "per_row", "learned_alibi"]))
    score = None
    if score_kind in ("scale", "softcap"):
        value = draw(st.sampled_from([0.5, 2.0, 3.0, -1.0] if score_kind == "scale"
                                     else [1.0, 5.0, 20.0]))
        if draw(st.booleans()):
            params.append(ir.ParamDecl("c", ir.FLOAT, value))
            c = ir.Param("c")
        else:
            c = c_float(value)
        score = (ir.BinOp("*", S, c) if score_kind == "scale"
                 else ir.BinOp("*", c, ir.Call("tanh", (ir.BinOp("/", S, c),))))
    elif score_kind == "alibi":
        inputs.append(ir.InputDecl("slope", "f32", ("h",)))
        score = ir.BinOp("+", S, ir.BinOp("*", ir.Load("slope", (H,)), ir.BinOp("-", K, Q)))
    elif score_kind == "learned_alibi":
        # A learnable slope, drawn large and of either sign (random_inputs): negative, the
        # score grows with distance, past the end of a tile's rows too (issue 30).
        inputs.append(ir.InputDecl("slope", "f32", ("h",), learnable=True))
        score = ir.BinOp("+", S, ir.BinOp("*", ir.Load("slope", (H,)), ir.BinOp("-", K, Q)))
    elif score_kind == "leaky":
        score = ir.Where(ir.Cmp(">", S, c_int(0)), S, ir.BinOp("*", c_float(0.5), S))
    # Scores that do not vary over the whole tile: the kernels broadcast them.
    elif score_kind == "constant":
        score = c_float(draw(st.sampled_from([0.0, 1.5])))
    elif score_kind == "per_head":
        inputs.append(ir.InputDecl("slope", "f32", ("h",)))
        score = ir.Load("slope", (H,))
    elif score_kind == "per_row":
        score = ir.BinOp("*", c_float(0.25), ir.BinOp("%", Q, c_int(5)))

    layout = block = None
    if draw(st.integers(0, 3)) == 0:
        qb, kb = ir.Var("qb"), ir.Var("kb")
        n = draw(st.integers(0, 2))
        layout = ir.Or(ir.Cmp("<=", ir.Call("abs", (ir.BinOp("-", qb, kb),)), c_int(n)),
                       ir.Cmp("==", kb, c_int(0)))
        if draw(st.booleans()):  # random blocks from a seed
            p = draw(st.sampled_from([0.1, 0.3, 0.5]))
            seed = c_int(draw(st.integers(0, 1000)))
            layout = ir.Or(layout, ir.Call("chance", (c_float(p), seed, H, qb, kb)))
        block = draw(st.sampled_from([16, 32]))

    heads = None
    if draw(st.booleans()):
        hkv = draw(st.sampled_from([1, 2]))
        group = draw(st.sampled_from([1, 2, 4] if hkv == 1 else [1, 2]))
        heads = ir.Heads(hkv * group, hkv)
    scale = draw(st.sampled_from([None, None, None, c_float(0.125), c_float(0.3)]))
    dropout = draw(st.sampled_from([None, None, None, 0.1, 0.3]))
    # Hostile names, now and then, for the inputs and the variant.
    names = {}
    if inputs and draw(st.integers(0, 2)) == 0:
        chosen = draw(st.lists(st.sampled_from(HOSTILE_NAMES), min_size=len(inputs),
                               max_size=len(inputs), unique=True))
        names = {decl.name: name for decl, name in zip(inputs, chosen)}
        inputs = [dataclasses.replace(decl, name=names[decl.name]) for decl in inputs]
        mask, score = renamed(mask, names), renamed(score, names)
    v = ir.Variant(name=draw(st.sampled_from(VARIANT_NAMES)), heads=heads, scale=scale,
                   params=tuple(params), inputs=tuple(inputs), mask=mask, layout=layout,
                   block=block, score=score, dropout=dropout)
    return checker.check_variant(v)


# Lengths 1..70 that are not multiples of the 16-wide tiles, one token included.
LENGTHS = st.sampled_from([n for n in range(1, 71) if n % 16])


def _extent_inputs(variant) -> bool:
    """Whether an input is as long as the positions (then offsets must stay small)."""
    return any(a in ("q", "k", "qb", "kb") for d in variant.inputs for a in d.axes)


@st.composite
def offsets(draw, variant):
    """q_offset, k_offset: mostly 0; small; or near 2**31 for one side or both, where
    positions and the arithmetic on them leave 32 bits (not with inputs as long as the
    positions, nor with a layout, whose tables and reference cover every block from 0)."""
    kind = draw(st.sampled_from(["zero", "zero", "small", "near_q", "near_k", "near_both"]))
    if kind.startswith("near") and (_extent_inputs(variant) or variant.layout is not None):
        kind = "small"
    if kind in ("near_q", "near_k") and variant.score is not None and (
            {"q", "k"} & ir.free_vars(variant.score)):
        # ALiBi's slope * (k - q) at q - k ~ 2**31 is a score of ~1e8: float precision,
        # not integers, would decide the result.
        kind = "near_both"
    step = variant.block or 1  # a layout's offsets are multiples of its block
    small = lambda: step * draw(st.integers(0, 40 // step + 1))
    near = lambda: 2 ** 31 - 80 - draw(st.integers(0, 60))  # + a length of at most 70
    if kind == "zero":
        return 0, 0
    if kind == "small":
        return small(), small()
    return (near() if kind in ("near_q", "near_both") else 0,
            near() if kind in ("near_k", "near_both") else 0)


@st.composite
def shapes(draw, variant):
    if variant.heads:
        hq, hkv = variant.heads.q, variant.heads.kv
    else:
        hkv = draw(st.sampled_from([1, 2]))
        hq = hkv * draw(st.sampled_from([1, 2, 4] if hkv == 1 else [1, 2]))
    batch = 1 if hq >= 4 else draw(st.sampled_from([1, 2]))
    lq = draw(LENGTHS)
    lk = draw(LENGTHS.filter(lambda n: n != lq) if draw(st.integers(0, 4)) else LENGTHS)
    q_offset, k_offset = draw(offsets(variant))
    return dict(B=batch, H=hq, Hkv=hkv, Lq=lq, Lk=lk, D=draw(st.sampled_from([16, 32, 48, 80])),
                seed=draw(st.integers(0, 2 ** 16)), q_offset=q_offset, k_offset=k_offset)


# i64 document ids that agree in their low 32 bits: read as int32 they are one document.
I64_IDS = torch.tensor([7, 7 + 2 ** 32, 7 - 2 ** 33, 7 + 2 ** 40])


def random_inputs(variant, shape, data):
    """Document ids (sorted runs, or shuffled: the kernels must be right either way)
    and ALiBi slopes for the variant's declared inputs."""
    gen = torch.Generator().manual_seed(shape["seed"] + 1)
    out = {}
    for decl in variant.inputs:
        n = {"q": shape["q_offset"] + shape["Lq"], "k": shape["k_offset"] + shape["Lk"],
             "h": shape["H"]}[decl.axes[0]]
        if decl.type == ir.FLOAT and decl.learnable:  # learned slopes: large, either sign
            out[decl.name] = (torch.rand(n, generator=gen) * 2 - 1) * 4.0
        elif decl.type == ir.FLOAT:  # the slopes
            out[decl.name] = torch.rand(n, generator=gen) * 0.5
        else:
            docs = data.draw(st.integers(1, 4), label=f"{decl.name} documents")
            ids = torch.randint(0, docs, (n,), generator=gen)
            if data.draw(st.integers(0, 3), label=f"{decl.name} sorted"):
                ids = torch.sort(ids).values
            out[decl.name] = I64_IDS[ids] if decl.dtype == "i64" else ids.to(torch.int32)
    return out


def check_kernel(variant, shape, inputs):
    """Forward (out, lse) and backward (dq, dk, dv) within tolerance of float64."""
    compare(variant, dtype=torch.float32, inputs=inputs, **shape)


# ------------------------------------------------------------------ kernels vs reference
# The first shard runs by default; the rest behind `slow` (-m slow), to keep the default
# suite within five minutes on two cores.
@pytest.mark.parametrize("shard", [pytest.param(i, marks=[pytest.mark.slow] if i else [])
                                   for i in range(KERNEL_SHARDS)])
@kernel_settings
@given(data=st.data())
def test_random_variant_matches_reference(shard, data):
    variant = data.draw(variants(), label="variant")
    shape = data.draw(shapes(variant), label="shape")
    inputs = random_inputs(variant, shape, data)
    print(print_variant(variant), shape)
    check_kernel(variant, shape, inputs)


# ------------------------------------------------------------------ front end vs itself
@front_end_settings
@given(variants())
def test_print_then_parse_gives_the_same_ir(variant):
    text = print_variant(variant)
    again = attncc.parse(text)
    assert again == variant, text
    assert print_variant(again) == text
    assert again.key() == variant.key()


def python_source(e) -> str:
    """The expression as Python the decorator traces: & | ~ for and/or/not, attncc's
    functions for the language's. Written independently of attncc.ir.print_variant."""
    if isinstance(e, (ir.Var, ir.Param)):
        return e.name
    if isinstance(e, ir.Const):
        return repr(e.value)
    if isinstance(e, ir.Load):
        return f"{e.tensor}[{', '.join(python_source(i) for i in e.indices)}]"
    if isinstance(e, ir.BinOp):
        return f"({python_source(e.lhs)} {e.op} {python_source(e.rhs)})"
    if isinstance(e, ir.Neg):
        return f"(-{python_source(e.operand)})"
    if isinstance(e, ir.Cmp):
        return f"({python_source(e.lhs)} {e.op} {python_source(e.rhs)})"
    if isinstance(e, ir.And):
        return f"({python_source(e.lhs)} & {python_source(e.rhs)})"
    if isinstance(e, ir.Or):
        return f"({python_source(e.lhs)} | {python_source(e.rhs)})"
    if isinstance(e, ir.Not):
        return f"(~{python_source(e.operand)})"
    if isinstance(e, ir.Call):
        fn = {"min": "minimum", "max": "maximum"}.get(e.fn, e.fn)
        return f"{fn}({', '.join(python_source(a) for a in e.args)})"
    if isinstance(e, ir.Where):
        return f"where({python_source(e.cond)}, {python_source(e.then)}, {python_source(e.other)})"
    raise TypeError(e)


def python_function(decl: str, e):
    """def <decl>(<the names e reads>): return <e as Python>, built with exec."""
    names = sorted({n.name for n in ir.walk(e) if isinstance(n, (ir.Var, ir.Param))}
                   | {n.tensor for n in ir.walk(e) if isinstance(n, ir.Load)})
    src = f"def {decl}({', '.join(names)}):\n    return {python_source(e)}\n"
    namespace = {"abs": abs, "tanh": attncc.tanh, "exp": attncc.exp, "log": attncc.log,
                 "sqrt": attncc.sqrt, "where": attncc.where, "minimum": attncc.minimum,
                 "maximum": attncc.maximum, "chance": attncc.chance}
    exec(compile(src, f"<fuzz {decl}>", "exec"), namespace)
    return namespace[decl]


@front_end_settings
@given(variants())
def test_decorator_builds_the_same_ir_as_the_text(variant):
    # A Python keyword cannot name a function's parameter: the .attn text only.
    assume(not any(keyword.iskeyword(i.name) for i in variant.inputs))
    pieces = {d: python_function(d, getattr(variant, d))
              for d in ("mask", "score", "layout") if getattr(variant, d) is not None}
    built = build_variant(
        variant.name, **pieces,
        scale=None if variant.scale is None else variant.scale.value,
        heads=None if variant.heads is None else (variant.heads.q, variant.heads.kv),
        params={p.name: p.value for p in variant.params},
        inputs={i.name: f"{i.dtype}[{', '.join(map(str, i.axes))}]" for i in variant.inputs},
        learnable=[i.name for i in variant.inputs if i.learnable],
        block=variant.block, dropout=variant.dropout)
    assert built == variant, print_variant(variant)
    assert built == attncc.parse(print_variant(variant))


def test_the_strategy_covers_what_it_promises():
    """The fuzzers are only as good as their variants: check the strategy really makes
    every promised piece (a guard against a strategy that silently narrows)."""
    seen = set()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(variants())
    def collect(v):
        nodes = [n for d in (v.mask, v.score, v.layout) if d is not None for n in ir.walk(d)]
        seen.update(type(n).__name__ for n in nodes)
        seen.update(f"op{n.op}" for n in nodes if isinstance(n, (ir.BinOp, ir.Cmp)))
        seen.update(f"var_{n.name}" for n in nodes if isinstance(n, ir.Var))
        seen.update(f"fn_{n.fn}" for n in nodes if isinstance(n, ir.Call))
        seen.update(["layout"] if v.layout is not None else [])
        seen.update([f"group{v.heads.group}"] if v.heads else [])
        seen.update(["dropout"] if v.dropout else [])
        seen.update(["params"] if v.params else [])
        seen.update(["scale"] if v.scale is not None else [])

        seen.update(["int_past_32_bits"] if any(
            isinstance(n, (ir.Const, ir.Param)) and not isinstance(n, ir.Param)
            and isinstance(n.value, int) and not -2 ** 31 <= n.value < 2 ** 31 for n in nodes)
            or any(isinstance(p.value, int) and p.value >= 2 ** 31 - 1 for p in v.params) else [])
        seen.update(["i64_input"] if any(i.dtype == "i64" for i in v.inputs) else [])
        seen.update(["constant_score"] if v.score is not None
                    and not ({"s", "k"} & ir.free_vars(v.score)) else [])
        seen.update(["hostile_name"] if any(i.name in HOSTILE_NAMES for i in v.inputs) else [])
        seen.update(["learnable_growing_score"] if any(i.learnable for i in v.inputs)
                    and {"q", "k"} <= ir.free_vars(v.score) else [])
        seen.update(["long_name"] if len(v.name) > 100 else [])

    collect()
    promised = {"And", "Or", "Not", "Cmp", "Load", "Param", "Where", "Call", "Neg",
                "op%", "op//", "op*", "op==", "op<", "op>=", "op!=",
                "var_q", "var_k", "var_len_q", "var_len_k", "var_s", "var_h",
                "layout", "fn_chance", "group1", "group2", "group4", "dropout", "params", "scale",
                "int_past_32_bits", "i64_input", "constant_score", "hostile_name", "long_name",
                "learnable_growing_score"}
    assert promised <= seen, sorted(promised - seen)


def test_the_shapes_cover_offsets_near_2_31():
    seen = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def collect(data):
        variant = data.draw(variants())
        shape = data.draw(shapes(variant))
        for name in ("q_offset", "k_offset"):
            seen.add(f"{name}_near_2_31" if shape[name] > 2 ** 30 else
                     f"{name}_small" if shape[name] else f"{name}_zero")
        assert max(shape["q_offset"] + shape["Lq"], shape["k_offset"] + shape["Lk"]) < 2 ** 31

    collect()
    assert seen >= {f"{n}_{k}" for n in ("q_offset", "k_offset") for k in ("zero", "small", "near_2_31")}
