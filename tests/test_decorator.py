"""The Python front end: decorated functions trace to the same IR as the .attn text."""
import importlib.util
from pathlib import Path

import pytest

import attncc
from attncc import ir
from attncc.frontend.decorator import build_variant

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
SPECS = sorted(EXAMPLES_DIR.glob("*.attn"))


def _python_examples() -> dict:
    # examples/ is not a package; load the module from its file.
    spec = importlib.util.spec_from_file_location("python_variants",
                                                  EXAMPLES_DIR / "python_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXAMPLES


PY = _python_examples()


def test_every_attn_example_has_a_python_twin_and_back():
    assert len(SPECS) >= 12
    assert sorted(p.stem for p in SPECS) == sorted(PY)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_decorator_builds_the_same_variant(path):
    from_text = attncc.parse_file(path)
    from_python = PY[path.stem]
    assert from_python == from_text
    assert from_python.key() == from_text.key()  # and so the same kernel module name


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_print_then_parse_gives_the_same_variant(path):
    v = attncc.parse_file(path)
    printed = str(v)
    assert attncc.parse(printed) == v
    assert str(attncc.parse(printed)) == printed  # printing is a fixed point
    assert attncc.parse(str(PY[path.stem])) == PY[path.stem]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_examples_have_a_header_comment(path):
    lines = path.read_text().splitlines()
    header = [l for l in lines[:lines.index(next(l for l in lines if l.startswith("attention")))]]
    assert len(header) >= 3 and all(l.startswith("#") for l in header), path.name
    assert attncc.parse_file(path).name == path.stem


def test_load_accepts_a_variant_a_path_and_text():
    v = PY["sliding_window"]
    path = EXAMPLES_DIR / "sliding_window.attn"
    assert attncc.load(v) is v
    assert attncc.load(path) == v
    assert attncc.load(str(path)) == v
    assert attncc.load(path.read_text()) == v


# ------------------------------------------------------------------ what traces to what
def test_operators_trace_to_the_language_operators():
    @attncc.variant(params={"w": 8}, inputs={"t": "f32[h, k]"})
    class v:
        def mask(q, k, w):
            return ~((q - k) // w == 0) | (abs(k % 3) != 1) & (q < 2 * k)

        def score(s, h, k, t):
            return attncc.where(k > 0, -s / 2.0 + t[h, k], attncc.exp(s) - 1)

    text = attncc.parse("""attention v {
        param w: int = 8
        input t: f32[h, k]
        mask  not ((q - k) // w == 0) or abs(k % 3) != 1 and q < 2 * k
        score where(k > 0, -s / 2.0 + t[h, k], exp(s) - 1)
    }""")
    assert v == text


def test_reflected_operators_keep_operand_order():
    v = attncc.variant(lambda q, k: 10 - q > 1 // (k + 1), name="r")
    assert v.mask == ir.Cmp(">", ir.BinOp("-", ir.Const(10, ir.INT), ir.Var("q")),
                            ir.BinOp("//", ir.Const(1, ir.INT),
                                     ir.BinOp("+", ir.Var("k"), ir.Const(1, ir.INT))))


def test_scale_may_be_a_number_or_a_function():
    a = attncc.variant(lambda q, k: q >= k, name="a", scale=0.125)
    b = attncc.variant(lambda q, k: q >= k, name="a", scale=lambda dim: 1.0 / attncc.sqrt(dim))
    assert a.scale == ir.Const(0.125, ir.FLOAT)
    assert b == attncc.parse("attention a { scale 1.0 / sqrt(dim)  mask q >= k }")


def test_scale_given_twice_is_refused_not_overridden():
    class doubled:
        def scale(dim):
            return 2.0
    with pytest.raises(attncc.SpecError, match=r"'doubled' declares its scale twice: in "
                                               r"scale=0.5 and in its scale\(\) function"):
        attncc.variant(doubled, scale=0.5)
    assert attncc.variant(doubled).scale == ir.Const(2.0, ir.FLOAT)


def test_a_function_without_a_name_is_asked_for_one():
    with pytest.raises(attncc.SpecError, match=r"'<lambda>' is not a name a variant can take.*"
                                               r"name='causal'"):
        attncc.variant(lambda q, k: q >= k)
    assert attncc.variant(lambda q, k: q >= k, name="causal").name == "causal"
    with pytest.raises(attncc.SpecError, match="the variant name '' is not a name"):
        attncc.variant(lambda q, k: q >= k, name="")
    with pytest.raises(attncc.SpecError, match=r"name= is the variant's name, a string; got 3"):
        attncc.variant(lambda q, k: q >= k, name=3)


def test_build_variant_without_the_decorator():
    v = build_variant("w", mask=lambda q, k, n: q - k < n, params={"n": 3}, heads=(6, 2))
    assert v == attncc.parse("attention w { heads 6 / 2  param n: int = 3  mask q - k < n }")


# --------------------------------------------------------------------------- errors
def _error(fn, **kw) -> str:
    with pytest.raises(attncc.SpecError) as info:
        fn(**kw)
    return str(info.value)


def test_python_and_instead_of_ampersand():
    def mask(q, k):
        return q >= k and q - k < 4
    msg = _error(lambda: attncc.variant(mask))
    assert "in mask() at" in msg and "test_decorator.py" in msg
    assert "write `&`, `|`, `~` instead of and, or, not" in msg


def test_python_chained_comparison_is_refused():
    msg = _error(lambda: attncc.variant(lambda q, k: 0 <= q - k < 4, name="c"))
    assert "no truth value" in msg and "two comparisons" in msg


def test_python_builtin_min_is_refused():
    msg = _error(lambda: attncc.variant(lambda q, k: min(q, k) > 0, name="m"))
    assert "attncc.minimum/maximum" in msg


def test_unknown_parameter_name_suggests_the_close_one():
    def mask(q, kk):
        return q >= kk
    msg = _error(lambda: attncc.variant(mask))
    assert "parameter 'kk' is not an index name, param or input; did you mean 'k'?" in msg


def test_parameter_not_allowed_in_this_declaration():
    def mask(q, s):
        return s > 0
    msg = _error(lambda: attncc.variant(mask))
    assert "'s' cannot be used in `mask`" in msg


@pytest.mark.parametrize("type_text, words", [
    ("f32 h", "write its type as 'dtype[axes]'"),
    ("f32[h", "write its type as 'dtype[axes]'"),
    ("float32[h]", "unknown element type 'float32'"),
    ("f32[t]", "unknown axis 't' of 'x'"),
])
def test_bad_input_type_string(type_text, words):
    msg = _error(lambda: attncc.variant(lambda q, k, x: x[q] > 0, name="v", inputs={"x": type_text}))
    assert words in msg


def test_mask_that_is_not_a_condition():
    msg = _error(lambda: attncc.variant(lambda q, k: q - k, name="v"))
    assert msg == ("error: variant 'v': `mask` must be a condition (true/false), but this is an "
                   "integer; compare it, as in `q >= k`")


def test_tensor_used_without_an_index():
    msg = _error(lambda: attncc.variant(lambda q, k, x: x, name="v", inputs={"x": "bool[q]"}))
    assert "'x' is a tensor; index it, as in x[q]" in msg


def test_learnable_name_that_is_not_an_input():
    msg = _error(lambda: attncc.variant(lambda q, k: q >= k, name="v", learnable=["bias"]))
    assert "learnable names ['bias'] are not inputs; declare them in inputs=" in msg
    msg = _error(lambda: attncc.variant(lambda q, k, s, biases: s + biases[0], name="v",
                                        inputs={"biases": "f32[4]"}, learnable=["bias"]))
    assert "learnable names ['bias'] are not inputs; did you mean 'biases'?" in msg


def test_class_with_an_unknown_member():
    def make():
        @attncc.variant
        class v:
            def mask(q, k):
                return q >= k

            def scroe(s):
                return s
    msg = _error(make)
    assert "has ['scroe']; it may define only mask, score, layout, scale, sink and weight" in msg


def test_param_of_unsupported_type():
    msg = _error(lambda: attncc.variant(lambda q, k, w: q - k < w, name="v", params={"w": "8"}))
    assert "param 'w' must be an int, float or bool, got str" in msg


def test_non_finite_constant():
    msg = _error(lambda: attncc.variant(lambda q, k: q < float("inf"), name="v"))
    assert "not finite" in msg


def test_heads_that_do_not_divide():
    msg = _error(lambda: attncc.variant(lambda q, k: q >= k, name="v", heads=(12, 5)))
    assert "the query heads (12) must be a multiple of the key/value heads (5)" in msg


@pytest.mark.parametrize("name", ["training", "tables", "q_offset", "v"])
def test_an_input_named_like_a_call_keyword_is_refused(name):
    # kernel(q, k, v, training=...) could never pass such an input: say so at compile time.
    with pytest.raises(attncc.SpecError, match=f"cannot be named '{name}'.*{name}="):
        attncc.variant(name="clash", inputs={name: "f32[h]"})(lambda q, k: q >= k)


def test_a_precedence_slip_with_ampersand_names_the_parentheses():
    """`q >= k & (q - k < 5)` is `q >= (k & (...))` in Python: the message spoke of `and`
    only, which the user never wrote."""
    with pytest.raises(attncc.SpecError, match=r"here `and` is `&`.*parenthesize each comparison"):
        @attncc.variant
        def m(q, k):
            return q >= k & (q - k < 5)


def test_the_hint_listing_attncc_functions_is_not_cut():
    """The decorator's list of functions was cut in the middle by the message limit."""
    import math
    with pytest.raises(attncc.SpecError) as err:
        @attncc.variant
        class m:
            def score(s):
                return 30.0 * math.tanh(s / 30.0)
    assert " ... " not in str(err.value) and "attncc.where" in str(err.value)
