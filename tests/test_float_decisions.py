"""A mask or layout that decides on floats (attncc/analysis/float_decisions.py): the
kernels compute the floats in float32 and the reference in float64, so a pair on the
boundary can be kept by one and dropped by the other. The front ends warn, located, and
name the integer form; decisions both precisions take alike stay silent.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import attncc
from attncc.errors import SpecWarning

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _warnings(spec: str) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attncc.parse(spec, "t.attn")
    return [str(w.message) for w in caught if issubclass(w.category, SpecWarning)]


@pytest.mark.parametrize("body, words", [
    ("mask k <= q / 1.1", "t.attn:2:7: warning: in `mask`, `k <= q / 1.1` compares floats"),
    ("mask q * 0.1 - k * 0.1 < 0.3 and k <= q", "`q * 0.1 - k * 0.1 < 0.3` compares floats"),
    ("param r: float = 1.1\n mask k * r <= q", "`k * r <= q` compares floats"),
    ("input g: f32[k]\n mask g[k] > 0.1", "`g[k] > 0.1` compares floats"),  # 0.1: not a float32
    ("input g: f64[k]\n mask g[k] > 0.5", "`g[k] > 0.5` compares floats"),
    ("mask floor(q / 3.0) == k // 3", "`floor(q / 3.0)` rounds a float to an integer with floor()"),
    ("block 16\n layout qb * 0.3 < kb", "in `layout`, `qb * 0.3 < kb` compares floats"),
    # A score that decides on such a float: entry 63 in float32, 62 in float64 at k - q = 90.
    ("input t: f32[100]\n score s + t[min(max(int((k - q) * 0.7), 0), 99)]",
     "in `score`, `int((k - q) * 0.7)` rounds a float"),
    ("score where((q - k) * 0.3 >= -15.0, s, s - 5.0)", "in `score`, `(q - k) * 0.3 >= -15.0`"),
    ("mask k <= q * 0.5 / 3.0", "`k <= q * 0.5 / 3.0` compares floats"),  # 3: no power of two
])
def test_a_decision_on_rounded_floats_warns_where_it_is(body, words):
    found = _warnings(f"attention t {{\n {body}\n}}")
    assert len(found) == 1 and words in found[0], found
    assert "float32" in found[0] and "float64" in found[0] and "Write it in integers" in found[0]


@pytest.mark.parametrize("body", [
    "input g: f32[k]\n mask g[k] > 0.5",           # stored float32 against an exact constant
    "input g: f16[k]\n mask max(g[k], -g[k]) < 0.25",
    "param r: float = 0.25\n mask where(q > k, 1.0, r) > 0.5",
    "mask 11 * k <= 10 * q",                      # the integer form the warning offers
    "mask q >= k\n score s / 1.1 + q * 0.1",      # a score's float only rounds
    "score where(s * 1.1 > 0.3, s, 0.0)",          # a decision on the score itself
    "mask k <= q * 0.5 and k >= q / 4.0",          # scaled by powers of two: exact in both
])
def test_decisions_both_precisions_take_alike_are_silent(body):
    assert _warnings(f"attention t {{\n {body}\n}}") == []


def test_no_example_warns():
    for path in sorted(EXAMPLES.glob("*.attn")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attncc.load(path)
        assert not [w for w in caught if "compares floats" in str(w.message)
                    or "rounds a float" in str(w.message)], path.name


def test_the_decorator_warns_too():
    with pytest.warns(SpecWarning, match=r"variant 'ratio'.*`k <= q / 1.1` compares floats"):
        @attncc.variant
        def ratio(q, k):
            return k <= q / 1.1


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter divides as IEEE float32 does; a GPU's division "
                           "and fused multiply-adds may round the boundary elsewhere")
def test_what_it_warns_of_is_real():
    """At q = 33, q / 1.1 is 30 in float32 and just below it in float64: the kernels
    keep key 30 and the reference drops it."""
    assert float(torch.tensor(33.0) / torch.tensor(1.1)) == 30.0
    assert 33.0 / 1.1 < 30.0
    with pytest.warns(SpecWarning):
        kernel = attncc.compile("attention ratio { mask k <= q / 1.1 }")
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, 40, 16, generator=gen) for _ in range(3))
    out = kernel(q, k, v)
    want = attncc.reference(kernel.variant, q.double(), k.double(), v.double())
    row_error = (out.double() - want).abs().amax(-1)[0, 0]
    assert row_error[33] > 1e-3 and row_error[:33].max() < 1e-4
