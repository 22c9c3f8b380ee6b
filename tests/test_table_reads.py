"""A fixed-size table read out of range (issue 31 item 3): `input bias: f32[h, 10]` read
at `bias[h, q - k]` compiles, the kernels clamp the index and return finite garbage,
the reference raises. The front ends warn with attncc.SpecWarning, located at the read,
naming the range that escapes and offering the clamp; safe reads stay silent.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import attncc
from attncc.errors import CallError, SpecWarning


def _warnings(spec: str) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attncc.parse(spec, "t.attn")
    return [w.message for w in caught if issubclass(w.category, SpecWarning)]


ESCAPING = {
    # (spec body, words the warning must hold)
    "negative": ("input bias: f32[h, 10]\n score s + bias[h, q - k]",
                 r"t\.attn:3:12: warning: in `score`, `bias\[h, q - k\]` reads 'bias' \(axis 2: "
                 r"10 entries\) at an index that goes below 0 and past 9 once a size or position "
                 r"reaches 2 .*To clamp, write `bias\[h, min\(max\(q - k, 0\), 9\)\]`"),
    "past the size": ("input bias: f32[h, 10]\n score s + bias[h, k]",
                      r"goes past 9 once a size or position reaches 11 \(it ranges over "
                      r"\[0, 2147483646\]\)"),
    "offset by a param": ("param w: int = 255\n learnable input bias: f32[h, 511]\n"
                          " score s + bias[h, q - k + w]",
                          r"below 0 and past 510 once a size or position reaches 257"),
    "every call": ("input t: f32[4]\n score s + t[-1]", r"goes below 0 on every call"),
    "declared heads, a table too small": ("heads 6 / 2\n learnable input t: f32[1]\n sink t[h // 3]",
                                          r"goes past 0 .*\(it ranges over \[0, 1\]\)"),
    "in a mask": ("input keep: bool[7]\n mask keep[q - k + 3]", r"in `mask`, `keep\[q - k \+ 3\]`"),
    "in a layout": ("input on: bool[4]\n block 16\n layout on[qb - kb]",
                    r"in `layout`, `on\[qb - kb\]`.*reaches 17"),
    "rounded": ("input t: f32[h, 8]\n score s + t[h, floor(q / 64.0)]",
                r"`t\[h, floor\(q / 64.0\)\]`.*past 7 once a size or position reaches 513"),
    "only masked pairs": ("input bias: f32[10]\n mask q >= k and q - k < 10\n"
                          " score s + bias[q - k]",
                          r"goes below 0"),
    # A min/max around the compared expression is narrowed by the condition as well, but
    # only by what the condition says: one past the table, or a floor never applied.
    "where max one past": ("input t: f32[h, 16]\n score s + t[h, where(q - k < 17, max(q - k, 0), 15)]",
                           r"goes past 15"),
    "where min no floor": ("input t: f32[h, 16]\n score s + t[h, where(q - k < 16, min(q - k, 3), 15)]",
                           r"goes below 0"),
}


@pytest.mark.parametrize("case", list(ESCAPING))
def test_a_read_that_can_leave_its_table_warns_with_the_clamp(case):
    body, words = ESCAPING[case]
    found = _warnings(f"attention r {{\n {body} }}")
    assert len(found) == 1, found
    assert re.search(words, str(found[0]), re.S), str(found[0])


SAFE = {
    "clamped": "input bias: f32[h, 10]\n score s + bias[h, min(max(q - k, 0), 9)]",
    "example clamp": ("learnable input bias: f32[h, 511]\n"
                      " score s + bias[h, min(max(q - k, -255), 255) + 255]"),
    "modulo": "input bias: f32[10]\n score s + bias[(q - k) % 10]",
    "constant": "input bias: f32[h, 10]\n score s + bias[h, 9]",
    "floor of positions": "input t: f32[8]\n score s + t[min(floor(q / 64.0), 7)]",
    "where clamp": "input bias: f32[10]\n score s + bias[where(abs(q - k) < 10, abs(q - k), 9)]",
    "where clamp flipped": "input bias: f32[10]\n score s + bias[where(9 < q % 20, 9, q % 20)]",
    "named axes": ("input doc: i32[q]\n input slopes: f32[h]\n mask doc[q] == 0\n"
                   " score s * slopes[h]"),
    "data index": "input idx: i32[k]\n input t: f32[4]\n score s + t[idx[k]]",
    # Positions against their lengths (tree verification over a KV cache): not judged.
    "lengths": ("param draft: int = 5\n input ancestors: bool[b, 5, 5]\n"
                " mask k < len_k - draft or ancestors[b, max(q - len_q + draft, 0), "
                "max(k - len_k + draft, 0)]"),
    "t5 buckets": ("input table: f32[h, 32]\n score s + table[h, where(k > q, 16, 0) + "
                   "where(abs(k - q) < 8, abs(k - q), min(8 + int(log(max(abs(k - q), 1) / 8.0) "
                   "/ log(128.0 / 8.0) * 8.0), 15))]"),
    # The compared expression itself as the branch, a min/max around it: both narrowed.
    "where on the clamp itself": ("input t: f32[h, 32]\n score s + t[h, where(max(q - k, 0) < 16, "
                                  "max(q - k, 0), 31)]"),
    # A per-kv-head table under declared heads: h // 3 stays below 2 (it warned that the
    # index reached 715827882, so every per-kv-head sink or bias warned).
    "declared heads": "heads 6 / 2\n learnable input t: f32[2]\n sink t[h // 3]",
    "declared heads in a score": "heads 4 / 4\n input t: f32[4, 8]\n score s + t[h, min(max(q - k, 0), 7)]",
    "t5 causal buckets": ("input table: f32[h, 32]\n mask q >= k\n score s + table[h, where(q - k < 16, "
                          "max(q - k, 0), min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) "
                          "* 16.0), 31))]"),
}


@pytest.mark.parametrize("case", list(SAFE))
def test_a_read_that_stays_in_its_table_is_silent(case):
    assert _warnings(f"attention r {{\n {SAFE[case]} }}") == []


def test_the_warning_is_a_python_warning_users_can_promote():
    with warnings.catch_warnings():
        warnings.simplefilter("error", attncc.SpecWarning)
        with pytest.raises(attncc.SpecWarning, match="below 0"):
            attncc.parse("attention r { input bias: f32[h, 10] score s + bias[h, q - k] }")


def test_the_decorator_warns_too():
    with pytest.warns(SpecWarning, match=r"variant 'shifted'.*`t\[q \+ 7\]`.*on every call"):
        @attncc.variant(inputs={"t": "f32[7]"})
        class shifted:
            def score(s, q, t):
                return s + t[q + 7]


def test_what_the_warning_warns_of_is_real():
    # The kernels' clamped read and the reference's refusal, on the warned spec.
    with pytest.warns(SpecWarning):
        variant = attncc.parse("attention r { input bias: f32[h, 10] score s + bias[h, q - k] }")
    q, k, v = (torch.randn(1, 2, 12, 16) for _ in range(3))
    with pytest.raises(CallError, match="out of range"):
        attncc.reference(variant, q, k, v, bias=torch.randn(2, 10), layout="bhsd")


def test_the_warning_points_at_the_users_line():
    # Not at attncc's internals: the line that parsed the spec, so filters by module work.
    with pytest.warns(SpecWarning) as caught:
        attncc.parse("attention r { input bias: f32[h, 10] score s + bias[h, q - k] }")
    assert caught[0].filename == __file__
