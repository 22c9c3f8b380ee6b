"""floor, ceil and int in the language (issue 31 item 10): numbers rounded to integers,
so that an index can be computed with log, as T5's log-spaced relative position buckets
are. Checked against an independent float64 implementation of T5's
`_relative_position_bucket`, forward and gradients, in the reference and the kernels; the
range analysis must bound the rounded integers soundly (32/64-bit choice, reads).
"""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc import ir
from attncc.analysis.ranges import FLOAT_SLACK, ranges_at
from attncc.errors import SpecError
from attncc.semantics.evaluate import evaluate
from attncc.tools import flex

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The range tests read small tables at unclamped indices on purpose; the warning about
# such reads has its own tests (test_table_reads.py).
pytestmark = pytest.mark.filterwarnings("ignore::attncc.errors.SpecWarning")
F64 = torch.float64

# T5's buckets written in the language: 32 buckets, exact below 8, log-spaced up to a
# distance of 128, one half per direction (bidirectional) or past keys only (causal).
T5_BIDIRECTIONAL = """attention t5 {
    learnable input table: f32[h, 32]
    score s + table[h, where(k > q, 16, 0) + where(abs(k - q) < 8, abs(k - q),
        min(8 + int(log(max(abs(k - q), 1) / 8.0) / log(128.0 / 8.0) * 8.0), 15))]
}"""
T5_CAUSAL = """attention t5_causal {
    learnable input table: f32[h, 32]
    mask q >= k
    score s + table[h, where(max(q - k, 0) < 16, max(q - k, 0),
        min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) * 16.0), 31))]
}"""


def t5_relative_position_bucket(relative_position, bidirectional, num_buckets=32,
                                max_distance=128):
    """T5's bucketing (transformers' T5Attention._relative_position_bucket), restated
    in float64: relative_position is key position - query position."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.to(F64) / max_exact)
                         / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


def t5_attention(q, k, v, table, bidirectional, q_offset):
    """Softmax attention with T5's bias: an independent formula, not the reference."""
    Lq, Lk = q.shape[2], k.shape[2]
    qpos = torch.arange(Lq)[:, None] + q_offset
    rel = torch.arange(Lk)[None, :] - qpos
    bias = table[:, t5_relative_position_bucket(rel, bidirectional)]  # [H, Lq, Lk]
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    if not bidirectional:
        logits = logits.masked_fill(rel > 0, float("-inf"))
    return torch.softmax(logits, -1) @ v


def _problem(seed, B=1, H=3, Lq=37, Lk=170, D=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=gen, dtype=F64) * 2
    k = torch.randn(B, H, Lk, D, generator=gen, dtype=F64) * 2
    v = torch.randn(B, H, Lk, D, generator=gen, dtype=F64)
    table = torch.randn(H, 32, generator=gen, dtype=F64) * 2
    do = torch.randn(B, H, Lq, D, generator=gen, dtype=F64)
    return q, k, v, table, do


def _grads(out, leaves, do):
    return torch.autograd.grad(out, leaves, do)


# q_offset 60 with 170 keys: distances from -96 to 169 cover both halves, the exact
# buckets, the log-spaced ones and the clamp at max_distance.
@pytest.mark.parametrize("spec, bidirectional, q_offset",
                         [(T5_BIDIRECTIONAL, True, 60), (T5_CAUSAL, False, 140)],
                         ids=["bidirectional", "causal"])
def test_t5_buckets_in_the_reference_match_t5(spec, bidirectional, q_offset):
    q, k, v, table, do = _problem(1)
    leaves = [t.requires_grad_() for t in (q, k, v, table)]
    got = attncc.reference(attncc.parse(spec), q, k, v, table=table, q_offset=q_offset,
                           layout="bhsd")
    want = t5_attention(q, k, v, table, bidirectional, q_offset)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(_grads(got, leaves, do), _grads(want, leaves, do)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spec, bidirectional, q_offset",
                         [(T5_BIDIRECTIONAL, True, 20),
                          pytest.param(T5_CAUSAL, False, 140, marks=pytest.mark.slow)],
                         ids=["bidirectional", "causal"])
def test_t5_buckets_in_the_kernels_match_t5(spec, bidirectional, q_offset):
    # Distances from -39 to 149 (bidirectional): every kind of bucket, tiles cut short.
    q, k, v, table, do = _problem(2, H=2, Lq=20, Lk=150)
    want_leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    want = t5_attention(*want_leaves, bidirectional, q_offset)
    want_grads = _grads(want, want_leaves, do)
    leaves = [t.float().to(DEVICE).requires_grad_() for t in (q, k, v, table)]
    kernel = attncc.compile(spec)
    got = kernel(*leaves[:3], table=leaves[3], q_offset=q_offset, layout="bhsd")
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-5)
    got_grads = _grads(got, leaves, do.float().to(DEVICE))
    for name, g, w in zip(["dq", "dk", "dv", "dtable"], got_grads, want_grads):
        scale = w.abs().max().item()
        torch.testing.assert_close(g.double().cpu(), w, rtol=0, atol=2e-5 * scale + 2e-5,
                                   msg=lambda m: f"{name}: {m}")


# floor and int differ on negative numbers: floor(-2.5) is -3, int(-2.5) is -2.
ROUNDED = {"floor": lambda x: torch.floor(x), "ceil": lambda x: torch.ceil(x),
           "int": lambda x: torch.trunc(x)}


@pytest.mark.parametrize("fn", list(ROUNDED))
def test_rounding_of_negative_and_positive_numbers_in_kernel_and_reference(fn):
    # A table read at fn((q - k) / 3.0) + 40: distances -26..26 cover both signs, and
    # values at exact integers (multiples of 3) as well as halves and thirds.
    spec = (f"attention r {{ input bias: f32[h, 81]\n"
            f" score s + bias[h, {fn}((q - k) / 3.0) + 40] }}")
    gen = torch.Generator().manual_seed(3)
    B, H, L, D = 1, 2, 27, 16
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=F64) for _ in range(3))
    bias = torch.randn(H, 81, generator=gen, dtype=F64) * 3
    rel = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    index = ROUNDED[fn](rel.to(F64) / 3.0).long() + 40
    want = torch.softmax(q @ k.transpose(-1, -2) / 4 + bias[:, index], -1) @ v
    variant = attncc.parse(spec)
    torch.testing.assert_close(attncc.reference(variant, q, k, v, bias=bias, layout="bhsd"),
                               want, rtol=1e-10, atol=1e-10)
    got = attncc.compile(variant)(*(t.float().to(DEVICE) for t in (q, k, v)),
                                  bias=bias.float().to(DEVICE), layout="bhsd")
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("divided, want", [
    ("n // 2", -4), ("7 // -2", -4), ("-7 // 2", -4), ("(dim - 21) // 3", -2), ("n % 2 - 2", -1)])
def test_floor_division_of_constants_floors_once_in_the_kernels(divided, want):
    """`//` of two compile-time constants (a param, dim, literals): Triton floors those
    as Python does, and the kernels' helper, written for its truncating `//` on tensors,
    floored them again (-7 // 2 gave -5). One key per row, k = q + want: row 10 must be
    v's row 10 + want, as the independent formula says."""
    spec = f"attention probe {{ param n: int = -7  mask k - q == {divided} }}"
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 20, 16, generator=gen) for _ in range(3))
    out = attncc.compile(spec)(*(t.to(DEVICE) for t in (q, k, v))).cpu()
    torch.testing.assert_close(out[0, 0, 10], v[0, 0, 10 + want], rtol=0, atol=1e-6)


def test_floor_division_of_a_float_is_refused_with_the_floor_to_write():
    with pytest.raises(SpecError, match=r"'//' takes integers.*floor\(a / b\)"):
        attncc.parse("attention f { score s + (q - k) // 2.5 }")


def test_a_mask_with_floor_skips_tiles_correctly():
    # Blocks of 5 positions, causal between blocks: the tile classification cannot
    # reason about floor, and must then visit, never skip, the tiles it needs.
    spec = "attention blocks { mask floor(q / 5.0) >= floor(k / 5.0) }"
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, L, 16, generator=gen, dtype=F64) for L in (45, 70, 70))
    qb, kb = torch.arange(45)[:, None] // 5, torch.arange(70)[None, :] // 5
    want = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(qb < kb, float("-inf")),
                         -1) @ v
    got = attncc.compile(spec)(*(t.float().to(DEVICE) for t in (q, k, v)), layout="bhsd")
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-5)


# ------------------------------------------------------------------ range analysis
def _index_range(spec: str, extent: int):
    variant = attncc.parse(spec)
    load = next(n for n in ir.walk(variant.score) if isinstance(n, ir.Load))
    return ranges_at(load.indices[-1], variant, extent)[id(load.indices[-1])]


@pytest.mark.parametrize("expr, exact", [
    ("floor(q / 8.0)", lambda E: (0, (E - 1) // 8)),
    ("ceil(q / 8.0)", lambda E: (0, -(-(E - 1) // 8))),
    ("int((k - q) / 8.0)", lambda E: (-((E - 1) // 8), (E - 1) // 8)),
    ("floor((k - q) / 8.0)", lambda E: (-(E - 1) // 8, (E - 1) // 8)),
    ("int(log(max(abs(k - q), 1) / 8.0) / log(16.0) * 8.0)",
     lambda E: (-6, int(math.log((E - 1) / 8) / math.log(16) * 8))),
])
@pytest.mark.parametrize("extent", [100, 5000, 2 ** 31 - 1])
def test_rounded_integers_get_sound_and_tight_ranges(expr, exact, extent):
    r = _index_range(f"attention r {{ input t: f32[7] score s + t[{expr}] }}", extent)
    lo, hi = exact(extent)
    assert r.lo <= lo and hi <= r.hi  # sound: every value the expression takes
    slack = lambda x: FLOAT_SLACK * (1 + abs(x)) + 1  # tight: off by the float32 slack at most
    assert lo - slack(lo) <= r.lo and r.hi <= hi + slack(hi)


def test_rounded_ranges_hold_the_values_the_reference_computes():
    spec = ("attention r { input t: f32[7]\n"
            " score s + t[int(log(max(abs(k - q), 1) / 8.0) / log(16.0) * 8.0) + ceil(q / 7.0)"
            " - floor(k / 3.0)] }")
    variant = attncc.parse(spec)
    E = 300
    pos = torch.arange(E)
    env = {"q": pos[:, None], "k": pos[None, :], "params": {}, "inputs": {}}
    for node in ir.walk(variant.score):
        if id(node) in (ranges := ranges_at(variant.score, variant, E)) and not isinstance(
                node, ir.Load):
            values = evaluate(node, env)
            r = ranges[id(node)]
            assert r.lo <= int(torch.as_tensor(values).min()) and \
                int(torch.as_tensor(values).max()) <= r.hi, ir.print_expr(node)


# ------------------------------------------------------------------ what is refused
@pytest.mark.parametrize("body, words", [
    ("score s + floor(q - k)", r"floor\(\) of an integer is that integer.*drop floor\(\)"),
    ("score s + int(s)", r"int\(\) needs a number whose range is known.*`s` can be anything"),
    ("input t: f32[h]\n score s + ceil(t[h] * 2.0)", r"ceil\(\) needs a number whose range"),
    ("score s + floor(log(q * 1.0))", r"floor\(\) needs a number.*log or sqrt"),
    ("score s + floor(1.0 / (q - k))", r"floor\(\) needs a number.*divides by a value"),
    ("score s + int(exp(q * 1.0))", r"int\(\) needs a number whose range"),
    ("score s + floor(true)", r"floor\(\) needs numbers, not a condition"),
    ("score s + floor(q / 8.0, 2)", r"floor\(\) takes 1 argument, not 2"),
])
def test_what_rounding_cannot_take_is_refused_with_the_fix(body, words):
    with pytest.raises(SpecError, match=words):
        attncc.parse(f"attention r {{ {body} }}")


# ------------------------------------------------------------------ other spellings
def test_the_decorator_spells_them_math_floor_ceil_trunc_and_attncc_functions():
    text = attncc.parse("attention r { input t: f32[h, 64]\n"
                        " score s + t[h, floor(q / 4.0) - ceil(k / 4.0) + int(q / 3.0)] }")

    @attncc.variant(inputs={"t": "f32[h, 64]"}, name="r")
    class with_math:
        def score(s, q, k, h, t):
            return s + t[h, math.floor(q / 4.0) - math.ceil(k / 4.0) + math.trunc(q / 3.0)]

    @attncc.variant(inputs={"t": "f32[h, 64]"}, name="r")
    class with_attncc:
        def score(s, q, k, h, t):
            return s + t[h, attncc.floor(q / 4.0) - attncc.ceil(k / 4.0) + attncc.trunc(q / 3.0)]

    assert with_math == text and with_attncc == text
    assert attncc.parse(str(text)) == text  # prints back in the language


def test_flex_lowering_rounds_as_the_reference():
    variant = attncc.parse(T5_BIDIRECTIONAL)
    table = torch.randn(3, 32, dtype=F64)
    fn = flex.lower(variant.score, variant, {"table": table})
    q, k = torch.arange(50)[:, None], torch.arange(200)[None, :]
    s = torch.randn(50, 200, dtype=F64)
    got = fn({"b": 0, "h": 1, "q": q, "k": k, "s": s})
    want = evaluate(variant.score, {"b": 0, "h": 1, "q": q, "k": k, "s": s,
                                    "params": {}, "inputs": {"table": table}})
    torch.testing.assert_close(got, want)


def test_t5_buckets_in_the_decode_kernels_match_the_decode_reference():
    # Split-KV decoding evaluates the score in its own kernels (attncc/codegen/decode.py).
    kernel = attncc.compile(T5_BIDIRECTIONAL)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 1, 16, generator=gen)
    k_cache, v_cache = (torch.randn(2, 3, 200, 16, generator=gen) for _ in range(2))
    lens = torch.tensor([150, 200], dtype=torch.int32)
    table = torch.randn(3, 32, generator=gen) * 2
    got = kernel.decode(*(t.to(DEVICE) for t in (q, k_cache, v_cache)),
                        cache_seqlens=lens.to(DEVICE), table=table.to(DEVICE))
    want = attncc.decode_reference(kernel.variant, q.double(), k_cache.double(), v_cache.double(),
                                   cache_seqlens=lens, table=table.double())
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=2e-5)
