"""The language: what each construct parses to, precedence, and print/parse round trips."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attncc
from attncc import ir, operators
from attncc.analysis import ranges
from attncc.semantics.evaluate import evaluate
from attncc.ir import print_expr

Q, K, S, H = ir.Var("q"), ir.Var("k"), ir.Var("s"), ir.Var("h")


def i(n):
    return ir.Const(n, ir.INT)


def mask_of(text, decls=""):
    return attncc.parse(f"attention t {{ {decls}\n mask {text} }}").mask


def score_of(text, decls=""):
    return attncc.parse(f"attention t {{ {decls}\n score {text} }}").score


# -------------------------------------------------------------------- declarations
def test_every_declaration():
    v = attncc.parse("""
        # a comment line
        attention everything {      # and a trailing one
            heads   12 / 4
            scale   0.125
            param   w: int = 64
            param   c: float = 30
            param   on: bool = true
            input   slopes: f32[h]
            learnable input bias: bf16[h, 511]
            input   blocks: bool[qb, kb]
            mask    q >= k and q - k < w
            layout  blocks[qb, kb] or qb == kb
            block   64
            score   c * tanh(s / c) + slopes[h] + bias[h, q - k + 255]
            dropout 0.1
        }""")
    assert v.name == "everything"
    assert v.heads == ir.Heads(12, 4) and v.heads.group == 3
    assert v.scale == ir.Const(0.125, ir.FLOAT)
    assert v.params == (ir.ParamDecl("w", ir.INT, 64), ir.ParamDecl("c", ir.FLOAT, 30.0),
                        ir.ParamDecl("on", ir.BOOL, True))
    assert v.inputs == (ir.InputDecl("slopes", "f32", ("h",)),
                        ir.InputDecl("bias", "bf16", ("h", 511), learnable=True),
                        ir.InputDecl("blocks", "bool", ("qb", "kb")))
    assert v.learnable_inputs == (v.input("bias"),)
    assert v.block == 64 and v.dropout == 0.1
    assert attncc.parse(str(v)) == v


def test_declarations_in_any_order_and_names_used_before_declared():
    a = attncc.parse("attention a { mask q - k < w  param w: int = 4  heads 2 / 1 }")
    b = attncc.parse("attention a { heads 2 / 1  param w: int = 4  mask q - k < w }")
    assert a == b


def test_an_empty_variant_is_full_attention():
    v = attncc.parse("attention full {}")
    assert v == ir.Variant("full")


def test_a_byte_order_mark_and_windows_line_endings_are_accepted():
    text = "attention a {\r\n    mask q >= k\r\n}\r\n"
    assert attncc.frontend.parser.parse_bytes(b"\xef\xbb\xbf" + text.encode()) == attncc.parse(text)


def test_int_param_value_for_a_float_param_becomes_float():
    assert attncc.parse("attention a { param c: float = 3 }").params[0] == \
        ir.ParamDecl("c", ir.FLOAT, 3.0)


def test_variant_key_is_stable_and_distinguishes_variants():
    a = attncc.parse("attention a { mask q >= k }")
    assert a.key() == attncc.parse("attention a {\n  mask  q>=k  # same\n}").key()
    assert a.key() != attncc.parse("attention a { mask q > k }").key()
    assert len(a.key()) == 16 and hash(a) == hash(attncc.parse(str(a)))


# ---------------------------------------------------------------------- expressions
@pytest.mark.parametrize("text, tree", [
    ("q - k - 1 < 4", ir.Cmp("<", ir.BinOp("-", ir.BinOp("-", Q, K), i(1)), i(4))),
    ("q + k * 2 > 0", ir.Cmp(">", ir.BinOp("+", Q, ir.BinOp("*", K, i(2))), i(0))),
    ("q // 4 % 2 == 0", ir.Cmp("==", ir.BinOp("%", ir.BinOp("//", Q, i(4)), i(2)), i(0))),
    ("-q < -2", ir.Cmp("<", ir.Neg(Q), i(-2))),
    ("q > k or k < 1 and q < 1",
     ir.Or(ir.Cmp(">", Q, K), ir.And(ir.Cmp("<", K, i(1)), ir.Cmp("<", Q, i(1))))),
    ("not q > k and k < 1", ir.And(ir.Not(ir.Cmp(">", Q, K)), ir.Cmp("<", K, i(1)))),
    ("0 <= q - k < 8", ir.And(ir.Cmp("<=", i(0), ir.BinOp("-", Q, K)),
                              ir.Cmp("<", ir.BinOp("-", Q, K), i(8)))),
    ("k <= q <= k + 3 != 2", ir.And(ir.And(ir.Cmp("<=", K, Q), ir.Cmp("<=", Q, ir.BinOp("+", K, i(3)))),
                                    ir.Cmp("!=", ir.BinOp("+", K, i(3)), i(2)))),
    ("(q > k) == (k > 2)", ir.Cmp("==", ir.Cmp(">", Q, K), ir.Cmp(">", K, i(2)))),
    ("true", ir.Const(True, ir.BOOL)),
    ("abs(q - k) <= max(1, min(q, 7))",
     ir.Cmp("<=", ir.Call("abs", (ir.BinOp("-", Q, K),)),
            ir.Call("max", (i(1), ir.Call("min", (Q, i(7))))))),
])
def test_precedence_and_chaining(text, tree):
    assert mask_of(text) == tree


def test_numbers():
    assert score_of("s * 2.5e-1 + .5 + 1. + 3e2") == ir.BinOp(
        "+", ir.BinOp("+", ir.BinOp("+", ir.BinOp("*", S, ir.Const(0.25, ir.FLOAT)),
                                    ir.Const(0.5, ir.FLOAT)), ir.Const(1.0, ir.FLOAT)),
        ir.Const(300.0, ir.FLOAT))
    assert score_of("s - -1.5") == ir.BinOp("-", S, ir.Const(-1.5, ir.FLOAT))
    # 2 and 2.0 are different constants: integer and true division differ
    assert score_of("s / 2") != score_of("s / 2.0")


def test_floats_past_float32_are_refused_where_they_are_written():
    """The kernels compute in float32, where 1e39 is inf (and inf * 0 NaN) while the
    float64 reference stays finite: such a constant or param is refused, located."""
    assert score_of("s * 3.4e38") == ir.BinOp("*", S, ir.Const(3.4e38, ir.FLOAT))
    for text, where in (("attention t { score 1e39 * s }", ":1:21:"),
                        ("attention t { param c: float = -4e38\n score c + s }", ":1:33:")):
        with pytest.raises(attncc.SpecError, match=where + r".*beyond float32's range"):
            attncc.parse(text)
    with pytest.raises(attncc.SpecError, match=r"param 'c' \(-4e\+38\) is beyond float32"):
        @attncc.variant(params={"c": -4e38})
        def capped(s, c):
            return s * c
    with pytest.raises(attncc.SpecError, match=r"1e\+39 is beyond float32's range"):
        class big:
            def score(s):
                return s * 1e39
        attncc.variant(big)


@pytest.mark.parametrize("text, shown", [
    ("attention t { scale 1e20 * 1e20 }", r"`1e\+20 \* 1e\+20` \(1e\+40\)"),
    ("attention t { score s * exp(100.0) }", r"`exp\(100.0\)` \(2.69e\+43\)"),
    ("attention t { param c: float = 1e30\n mask q >= k\n score s - c * c * where(q >= k, 0.0, 1.0) }",
     r"`c \* c` \(1e\+60\)"),
])
def test_constant_float_expressions_past_float32_are_refused_too(text, shown):
    """Not only literals: an operation of constants beyond float32 is inf in the kernels
    (NaN after) and finite in the reference. Constants within range stay accepted."""
    with pytest.raises(attncc.SpecError, match=shown + r" is beyond float32's range"):
        attncc.parse(text)
    attncc.parse("attention t { scale 1e19 * 1e19 score s * exp(80.0) }")


@pytest.mark.parametrize("text, shown", [
    ("attention t { scale 1e-46 }", r"the number 1e-46"),
    ("attention t { param c: float = -1e-50\n score s + c }", r"the number 1e-50"),
])
def test_floats_below_float32_are_refused_too(text, shown):
    """A nonzero constant under float32's smallest subnormal is 0 in the kernels and not in
    the float64 reference: a scale of 1e-46 gave NaN rows. Subnormals stay accepted."""
    with pytest.raises(attncc.SpecError, match=shown + r" is below float32's range.*write 0.0"):
        attncc.parse(text)
    attncc.parse("attention t { scale 1e-40 score s * 0.0 }")
    attncc.parse("attention t { score s * (1e-30 * 1e-30) }")  # 0 in both precisions


@pytest.mark.parametrize("text, shown", [("attention t { score sqrt(-1.0) + s }", r"`sqrt\(-1.0\)`"),
                                         ("attention t { score log(-1.0) * s }", r"`log\(-1.0\)`")])
def test_a_constant_that_is_not_a_number_is_refused(text, shown):
    """NaN passed the range test (NaN > 3.4e38 is false), and every tensor came out NaN."""
    with pytest.raises(attncc.SpecError, match=shown + r" is not a number \(NaN\) for every call"):
        attncc.parse(text)


def test_where_and_loads():
    e = score_of("where(q >= k, s + t[h, k], s)", "input t: f32[h, k]")
    assert e == ir.Where(ir.Cmp(">=", Q, K), ir.BinOp("+", S, ir.Load("t", (H, K))), S)


def test_every_index_name_where_it_is_allowed():
    v = attncc.parse("""attention a {
        scale 1.0 / sqrt(dim)
        mask  b + h + q + k + dim + len_q + len_k >= 0
        layout qb + kb + h + b + len_q >= 0
        block 16
        score s + b + h + q + k + dim + len_q + len_k
    }""")
    assert ir.free_vars(v.mask) == {"b", "h", "q", "k", "dim", "len_q", "len_k"}
    assert ir.free_vars(v.layout) == {"qb", "kb", "h", "b", "len_q"}
    assert "s" in ir.free_vars(v.score)


# ---------------------------------------------------------- semantics of the operators
def test_integer_division_and_remainder_follow_python():
    e = mask_of("(q - 7) // 3 == k and (q - 7) % 3 == k")
    env = {"q": torch.arange(15), "k": None, "params": {}, "inputs": {}}
    for name, op in (("//", lambda a: a // 3), ("%", lambda a: a % 3)):
        node = e.lhs.lhs if name == "//" else e.rhs.lhs
        got = evaluate(node, env)
        assert got.tolist() == [op(x - 7) for x in range(15)]


def test_true_division_of_integers_is_a_float():
    got = evaluate(score_of("q / 2"), {"q": torch.arange(5), "params": {}, "inputs": {}})
    assert got.dtype == torch.float64 and got.tolist() == [x / 2 for x in range(5)]


# ---------------------------------------------------------------- print / parse trips
NAMES = st.sampled_from([Q, K, H, ir.Var("b"), ir.Var("len_q"), ir.Param("w")])
# Within float32's range, as the checker requires (nonzero values under 1.4e-45 are refused).
FLOATS = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).filter(
    lambda x: x == 0 or abs(x) > 1e-30).map(lambda x: ir.Const(x, ir.FLOAT))
INTS = st.integers(-1000, 1000).map(i)


def _ints(children):
    return st.one_of(
        st.tuples(st.sampled_from(operators.ARITH_OPS[:2] + ("*", "//", "%")), children, children)
        .map(lambda t: ir.BinOp(*t)),
        children.map(ir.Neg),
        st.tuples(st.sampled_from(["min", "max"]), children, children)
        .map(lambda t: ir.Call(t[0], (t[1], t[2]))),
        children.map(lambda c: ir.Call("abs", (c,))),
        children.map(lambda c: ir.Load("t", (c,))),
    )


INT_EXPR = st.recursive(st.one_of(NAMES, INTS), _ints, max_leaves=8)


def _floats(children):
    return st.one_of(
        st.tuples(st.sampled_from(operators.ARITH_OPS[:4]), children, children).map(lambda t: ir.BinOp(*t)),
        children.map(lambda c: ir.Call("tanh", (c,))),
        st.tuples(BOOL_EXPR, children, children).map(lambda t: ir.Where(*t)),
    )


def _bools(children):
    return st.one_of(
        st.tuples(children, children).map(lambda t: ir.And(*t)),
        st.tuples(children, children).map(lambda t: ir.Or(*t)),
        children.map(ir.Not),
    )


CMP = st.tuples(st.sampled_from(operators.CMP_OPS), INT_EXPR, INT_EXPR).map(lambda t: ir.Cmp(*t))
BOOL_EXPR = st.recursive(CMP, _bools, max_leaves=6)
SCORE_EXPR = st.recursive(st.one_of(st.just(S), FLOATS, INT_EXPR), _floats, max_leaves=8)
DECLS = "param w: int = 3\ninput t: i32[k]\n"  # t reads are integers


def _in_range(e) -> bool:
    """Whether attncc.analysis.ranges accepts `e` over DECLS: no divisor that can be 0, no
    integer past 64 bits. The parser must refuse exactly the trees it refuses."""
    try:
        ranges.check(e, {"w": 3}, {"t": ir.InputDecl("t", "i32", ("k",))})
    except attncc.SpecError:
        return False
    return not any(_beyond_float32(n) for n in ir.walk(e))


def _beyond_float32(node) -> bool:
    """A float operation of constants alone past float32's range, which the checker
    refuses as it refuses such a literal (1.0 / 1.4e-92)."""
    if ir.free_vars(node) or isinstance(node, ir.Const) or any(
            isinstance(n, ir.Load) for n in ir.walk(node)):
        return False
    try:
        value = float(evaluate(node, {"params": {"w": 3}, "inputs": {}}))
    except (ArithmeticError, ValueError, TypeError, RuntimeError):
        return False
    return isinstance(value, float) and abs(value) > 3.4028234663852886e38


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BOOL_EXPR)
def test_printed_masks_parse_back_to_the_same_tree(e):
    if _in_range(_fold(e)):
        assert mask_of(print_expr(e), DECLS) == _fold(e)
    else:
        with pytest.raises(attncc.SpecError, match="divisor|64-bit"):
            mask_of(print_expr(e), DECLS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCORE_EXPR)
def test_printed_scores_parse_back_to_the_same_tree(e):
    if _in_range(_fold(e)):
        assert score_of(print_expr(e), DECLS) == _fold(e)
    else:
        with pytest.raises(attncc.SpecError, match="divisor|64-bit|beyond float32"):
            score_of(print_expr(e), DECLS)


def _fold(e):
    """`e` with Neg(Const(3)) folded to Const(-3), as both front ends write it: -3 is
    written -3 and reads back as a constant, so the unfolded form is never built."""
    if isinstance(e, ir.Neg):
        inner = _fold(e.operand)
        if isinstance(inner, ir.Const) and inner.type != ir.BOOL:
            return ir.Const(-inner.value, inner.type)
        return ir.Neg(inner)
    if isinstance(e, (ir.Var, ir.Const, ir.Param)):
        return e
    kids = tuple(_fold(c) for c in ir.children(e))
    if isinstance(e, ir.Load):
        return ir.Load(e.tensor, kids)
    if isinstance(e, ir.Call):
        return ir.Call(e.fn, kids)
    return type(e)(*([e.op] if hasattr(e, "op") else []), *kids)


def test_float_constants_print_exactly():
    for x in (0.1, 1.5e-40, 123456789.123, 2.0 ** -30, 1e22):
        assert score_of(print_expr(ir.BinOp("*", S, ir.Const(x, ir.FLOAT)))).rhs.value == x


@pytest.mark.parametrize("text, says", [
    ("mask q => k", r":1:22: .*`=>` is not an operator; did you mean `>=`\?"),
    ("mask q =< k", r"`=<` is not an operator; did you mean `<=`\?"),
    ("mask (k < 30) == not (q > 3)", r"`not` cannot follow a comparison operator: parenthesize"),
    ("mask q - k >= -3 == (q < 50)", r"comparisons chain as in Python"),
])
def test_slips_in_comparisons_name_the_fix(text, says):
    """These said "expected a declaration ... or '}'", "unknown function 'not' ... did you
    mean 'int'?", or only that '==' compares numbers."""
    with pytest.raises(attncc.SpecError, match=says):
        attncc.parse(f"attention a {{ {text} }}")


@pytest.mark.parametrize("text", [
    "attention t { learnable input gate: f32[h, k]\n mask q >= k and gate[h, k] > 0.0 }",
    "attention t { learnable input gate: f32[h, kb]\n layout gate[h, kb] > 0.0\n block 16 }",
    "attention t { learnable input gate: f32[h, k]\n mask q >= k }",
])
def test_a_learnable_input_that_no_score_weight_or_sink_reads_is_refused(text):
    """Its gradient had nowhere to come from: the backward raised a bare KeyError after a
    forward that ran. The refusal names the plain declaration and .detach()."""
    with pytest.raises(attncc.SpecError, match=r":1:15: .*learnable input 'gate' is read by no score, "
                                               r"weight or sink.*input gate: f32\[h, k?b?\]` and "
                                               r"pass gate.detach\(\)"):
        attncc.parse(text)
    attncc.parse("attention t { learnable input z: f32[h]\n sink z[h] }")
    attncc.parse("attention t { learnable input g: f32[k]\n normalize sum\n weight max(s, 0.0) * abs(g[k]) }")
