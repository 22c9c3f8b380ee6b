"""attncc/operators.py, the one table of the language's operations: it covers every
operator the grammar has and every function the parser takes, each with every column;
its spellings report the helpers they call; and a function added to it is picked up by
the checker, the reference, the emitters, both interval analyses and the sympy bridge,
with nothing else changed."""
import dataclasses
import re
from pathlib import Path

import pytest
import sympy
import torch

import attncc
from attncc import ir, operators
from attncc.operators import FUNCTIONS
from attncc.analysis import intervals, ranges
from attncc.backends.portable import codegen
from attncc.codegen import derivative
from attncc.codegen.elementwise import TritonEmitter
from attncc.frontend import decorator
from attncc.semantics.evaluate import evaluate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRAMMAR = (Path(__file__).parent.parent / "grammar" / "attn.lark").read_text()
COLUMNS = [f.name for f in dataclasses.fields(operators.Operation)]
ENTRIES = [*operators.OPERATORS.values(), *operators.FUNCTIONS.values()]


def test_every_operator_of_the_grammar_has_an_entry_and_no_other():
    tokens = set()
    for terminal in ("COMP_OP", "ADD_OP", "MUL_OP"):
        line = re.search(rf"^{terminal}: (.*)$", GRAMMAR, re.M).group(1)
        tokens |= set(re.findall(r'"([^"]+)"', line))
    words = {w for w in ("and", "or", "not") if f'"{w}"' in GRAMMAR}
    assert "-> neg" in GRAMMAR  # unary minus
    assert tokens | words | {"neg"} == set(operators.OPERATORS)


def test_the_parser_takes_the_table_s_functions_and_no_others():
    for name, entry in operators.FUNCTIONS.items():
        n = entry.arity if isinstance(entry.arity, int) else entry.arity[0]
        with pytest.raises(attncc.SpecError) as err:  # the wrong count: the call was read
            attncc.parse(f"attention a {{ mask {name}({', '.join(['q'] * (n + 1))}) }}")
        assert "unknown function" not in str(err.value)
    with pytest.raises(attncc.SpecError, match="unknown function 'sigmoidal'"):
        attncc.parse("attention a { score sigmoidal(s) }")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_every_entry_fills_every_column(entry):
    for column in COLUMNS:
        value = getattr(entry, column)
        if column == "sympy":
            # None only where there is no form: // and % (no derivative, no loop bound).
            assert value is not None or entry.name in ("//", "%")
        elif column == "arity_words":
            assert bool(value) == isinstance(entry.arity, tuple)
        elif column in ("helpers", "host_helpers", "python", "float_operands"):
            assert value is not None
        else:
            assert value, column
    assert entry.python, "the decorator spells it somehow"


def test_both_interval_algebras_offer_all_a_rule_may_ask():
    symbolic_code = intervals._Code(None, {})
    for name in operators.ALGEBRA:
        assert callable(getattr(operators.NUMBERS, name)), name
        assert callable(getattr(symbolic_code, name)), name


def _sample(entry):
    """A node of `entry` on integer positions (chance: on a probability and keys)."""
    q, k = ir.Var("q"), ir.Var("k")
    if entry.name == "chance":
        return entry.make(ir.Const(0.5, ir.FLOAT), ir.Var("h"), q)
    if entry.name in ("and", "or", "not"):
        return entry.make(*[ir.Cmp("<", q, k)] * entry.arity)
    if entry.name == "where":
        return entry.make(ir.Cmp("<", q, k), q, k)
    return entry.make(*[q, k][:entry.arity])


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_spellings_report_the_helpers_they_call(entry):
    variant = attncc.parse("attention a { }")
    node = _sample(entry)
    for printer in (TritonEmitter(variant), codegen.TorchEmitter(variant, {})):
        code = printer.code(node)
        assert set(re.findall(r"(?<![\w.])(_\w+)\(", code.text)) <= code.helpers, code.text


# ------------------------------------------------------------------ a toy function
def _double_bounds(m, a):
    return operators.Bounds(m.mul(2, a.lo), m.mul(2, a.hi))


DOUBLE = operators.Operation(
    "double", 1, "(x)", "twice x", lambda x: ir.Call("double", (x,)), operators.same_kind,
    lambda x, *, float_dtype: 2 * x, lambda sp, x: 2 * x, _double_bounds, False,
    "(2 * {0})", "(2 * {0})", (), (), ("double",))


@pytest.fixture
def double(monkeypatch):
    """The table with one more function, for one test."""
    monkeypatch.setitem(operators.FUNCTIONS, "double", DOUBLE)
    return DOUBLE


def test_a_toy_function_is_picked_up_everywhere(double):
    # The checker (through the parser): its type rule, its arity, its name.
    v = attncc.parse("attention a { mask double(q) >= k  score s * double(s) }")
    assert v.mask == ir.Cmp(">=", ir.Call("double", (ir.Var("q"),)), ir.Var("k"))
    with pytest.raises(attncc.SpecError, match=r"double\(\) needs numbers"):
        attncc.parse("attention a { mask double(q >= k) }")
    with pytest.raises(attncc.SpecError, match=r"double\(\) takes 1 argument, not 2"):
        attncc.parse("attention a { mask double(q, k) >= k }")
    # The reference.
    q = torch.arange(5).view(-1, 1)
    assert torch.equal(evaluate(v.mask.lhs, {"q": q}), 2 * q)
    # The Triton and PyTorch emitters, and the generated module.
    assert TritonEmitter(v)(v.mask) == "((2 * q_pos) >= k_pos)"
    assert codegen.TorchEmitter(v, {})(v.mask.lhs) == "(2 * q_pos)"
    # 2q leaves 32 bits before q does: the module computes the mask in 64 on wide calls.
    source = codegen.generate(v).source
    assert "((2 * _int(q_pos, WIDE)) >= _int(k_pos, WIDE))" in source
    assert "((s * (2 * s)))" in source
    # The range analysis (over calls) and the tile classification (per tile).
    assert ranges.ranges_at(v.mask.lhs, v, extent=100)[id(v.mask.lhs)].hi == 198
    program = intervals.classify(v.mask, v).program
    assert (intervals.Temp(1), intervals.Op("*", (intervals.Lit(2), intervals.Tile("q", "hi")))) \
        in program.steps
    # The sympy bridge: s * double(s) reads as 2 s**2, whose derivative is 4 s.
    s = sympy.Symbol("s", real=True)
    assert derivative._Score(v)(v.score) == 2 * s ** 2
    grads = derivative.score_gradients(v, TritonEmitter(v))
    assert grads.d_ds.text == "(4.0 * s)"
    # The decorator: attncc.<name> is made from the table (when attncc is imported).
    traced = decorator._traced(double, "double")(decorator.Sym(ir.Var("q")))
    assert traced.node == v.mask.lhs


# --------------------------------------------------------------------------- sigmoid
SIGMOID = "attention gate { mask q >= k score s * sigmoid(60.0 * s) }"


def test_sigmoid_in_a_score_against_its_formula_where_its_argument_is_huge():
    """sigmoid(x) = 1 / (1 + e^-x), its derivative σ(1 − σ). The argument reaches ±200
    here: sympy's own derivative of 1 / (1 + e^-x), e^-x / (1 + e^-x)², would be
    inf / inf = NaN in fp32 there; σ(1 − σ) is 0. Causal, len_q ≠ len_k, lengths off the
    tile, three heads; kernels and gradients against float64 written from the formula."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 37, 16, generator=gen, dtype=torch.float32) * 1.5
    k = torch.randn(2, 3, 53, 16, generator=gen, dtype=torch.float32) * 1.5
    v = torch.randn(2, 3, 53, 16, generator=gen, dtype=torch.float32)
    dout = torch.randn(2, 3, 37, 16, generator=gen, dtype=torch.float32)
    kernel = attncc.compile(SIGMOID)
    leaves = [t.detach().to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves)
    out.backward(dout.to(DEVICE))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / 4.0  # the default scale, 1/sqrt(16)
    assert s.abs().max() * 60.0 > 150.0  # the argument is huge somewhere
    s = s * (1.0 / (1.0 + torch.exp(-60.0 * s)))
    allowed = torch.arange(37)[:, None] >= torch.arange(53)[None, :]
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v64
    want.backward(dout.double())
    for got, ref in ((out, want), *zip((t.grad for t in leaves), (q64.grad, k64.grad, v64.grad))):
        got = got.detach().double().cpu()
        assert torch.isfinite(got).all()
        error = (got - ref).abs().max().item()
        assert error <= 1e-3 * (1.0 + ref.abs().max().item()), error


@pytest.mark.parametrize("spec, factor", [
    ("attention c { score s * int(2.5) }", 2.0),
    ("attention c { score s * int(-2.5) }", -2.0),
    ("attention c { param x: float = 3.75\n score s * int(x) }", 3.0),
    ("attention c { input t: f32[4]\n score s * t[int(3.5)] }", None),
])
def test_rounding_a_constant_runs_in_the_kernels(spec, factor):
    """int() of a constant or float param, rounding toward zero: it was spelt .to() on a
    Python float, which has none, and failed at the first call."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 19, 16, generator=gen) for _ in range(3))
    table = torch.randn(4, generator=gen)
    inputs = {"t": table.to(DEVICE)} if "t:" in spec else {}
    out = attncc.compile(spec)(*(t.to(DEVICE) for t in (q, k, v)), **inputs).cpu()
    factor = float(table[3]) if factor is None else factor
    scores = q.double() @ k.double().transpose(-1, -2) / 4.0 * factor
    want = torch.softmax(scores, -1) @ v.double()
    assert (out.double() - want).abs().max() < 1e-5


def test_sigmoid_is_one_table_entry_the_decorator_and_reference_read():
    @attncc.variant
    class gate:
        def mask(q, k):
            return q >= k

        def score(s):
            return s * attncc.sigmoid(60.0 * s)
    assert attncc.parse(SIGMOID).score == gate.score
    x = torch.tensor([-800.0, -30.0, 0.0, 2.5, 800.0], dtype=torch.float64)
    sigmoid = lambda t: FUNCTIONS["sigmoid"].torch(t, float_dtype=torch.float64)
    assert torch.allclose(sigmoid(x), 1.0 / (1.0 + torch.exp(-x)))
    # On numbers (the interval rule's ends): finite where e^800 is not.
    assert [sigmoid(t) for t in (-800.0, 0.0, 800.0)] == [0.0, 0.5, 1.0]
