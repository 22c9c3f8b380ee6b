"""How a call's q, k, v are read when it does not pass layout= (issue 31 item 2, issue 30).

(batch, heads, seq, dim) and (batch, seq, heads, dim) have the same rank, so a call that
fits both must never be read the unlikely way in silence: read as bhsd, the default,
when that gives no more query heads than positions, refused asking for layout= when it
does. A call that fits only the other layout gets the hint to pass it only where that
reading is a likely one. Everything here is checked before a kernel runs, so the
reference (which shares the argument reading with the kernels) checks the results.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attncc
from attncc.errors import CallError

F64 = torch.float64
NO_HEADS = "attention plain { }"
CAUSAL = "attention causal { mask q >= k }"
HEADS_8 = "attention h8 { heads 8 / 8 }"


def rand(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen, dtype=F64) * 3  # large enough to sharpen softmax


def bshd(b, lq, lk, hq, hkv, d=16):
    return rand(b, lq, hq, d), rand(b, lk, hkv, d, seed=1), rand(b, lk, hkv, d, seed=2)


# flash-attn's layout passed without layout=: the bhsd reading binds too, and used to run.
BSHD_CALLS = {
    "mha": bshd(2, 24, 24, 4, 4),
    "gqa": bshd(1, 24, 24, 6, 2),
    "len_q > len_k": bshd(1, 20, 10, 3, 3),
    "one-token keys": bshd(2, 9, 1, 4, 4),
    "heads not a power of two": bshd(1, 33, 33, 5, 5),
}


@pytest.mark.parametrize("spec", [NO_HEADS, CAUSAL])
@pytest.mark.parametrize("case", list(BSHD_CALLS))
def test_bshd_tensors_without_layout_are_refused_not_misread(spec, case):
    q, k, v = BSHD_CALLS[case]
    variant = attncc.parse(spec)
    with pytest.raises(CallError, match=r"fit both layouts.*pass layout='bshd'.*layout='bhsd'"):
        attncc.reference(variant, q, k, v)
    # Said, the call runs and means the bshd attention.
    out = attncc.reference(variant, q, k, v, layout="bshd")
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True,
        is_causal=spec == CAUSAL).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_the_kernel_refuses_the_same_call():
    q, k, v = (t.float() for t in BSHD_CALLS["gqa"])
    with pytest.raises(CallError, match=r"24 query heads.*pass layout='bshd'"):
        attncc.compile(NO_HEADS)(q, k, v)


# Ordinary bhsd calls, as the README shows them: never refused, and read as bhsd.
BHSD_CALLS = {
    "long": (rand(1, 8, 300, 16), rand(1, 8, 300, 16, seed=1), rand(1, 8, 300, 16, seed=2)),
    "heads = positions": (rand(1, 8, 8, 16), rand(1, 8, 8, 16, seed=1), rand(1, 8, 8, 16, seed=2)),
    "odd": (rand(1, 3, 7, 16), rand(1, 3, 5, 16, seed=1), rand(1, 3, 5, 16, seed=2)),
    "gqa": (rand(2, 6, 13, 16), rand(2, 2, 13, 16, seed=1), rand(2, 2, 13, 16, seed=2)),
    # One query token against a cache: more heads than queries, but only bhsd binds.
    "decode": (rand(2, 8, 1, 16), rand(2, 8, 37, 16, seed=1), rand(2, 8, 37, 16, seed=2)),
    "decode gqa": (rand(2, 8, 1, 16), rand(2, 2, 40, 16, seed=1), rand(2, 2, 40, 16, seed=2)),
    # Few queries and many keys: more heads than queries, fewer than keys.
    "short q": (rand(1, 12, 4, 16), rand(1, 12, 64, 16, seed=1), rand(1, 12, 64, 16, seed=2)),
}


@pytest.mark.parametrize("case", list(BHSD_CALLS))
def test_ordinary_bhsd_calls_are_read_as_bhsd(case):
    q, k, v = BHSD_CALLS[case]
    out = attncc.reference(attncc.parse(NO_HEADS), q, k, v)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shapes", [
    ((2, 8, 1, 16), (2, 8, 1, 16)),    # one query, one key, 8 heads: or 8 tokens of 1 head
    ((1, 6, 5, 16), (1, 2, 5, 16)),    # more heads than positions
])
def test_a_bhsd_call_with_more_heads_than_positions_must_say_its_layout(shapes):
    # Both readings bind and give different attention: refused, and runs when said.
    (qs, ks) = shapes
    q, k, v = rand(*qs), rand(*ks, seed=1), rand(*ks, seed=2)
    variant = attncc.parse(NO_HEADS)
    with pytest.raises(CallError, match="fit both layouts"):
        attncc.reference(variant, q, k, v)
    out = attncc.reference(variant, q, k, v, layout="bhsd")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               rtol=1e-10, atol=1e-10)


def test_a_wrong_head_count_gets_no_misleading_layout_hint():
    # bhsd with 4 heads where 8 are declared: the bshd reading binds (8 heads, 4 queries)
    # but is the unlikely one, so the error names the head count and offers no layout.
    q, k, v = rand(2, 4, 8, 16), rand(2, 4, 8, 16, seed=1), rand(2, 4, 8, 16, seed=2)
    with pytest.raises(CallError, match="declares heads 8 / 8") as err:
        attncc.reference(attncc.parse(HEADS_8), q, k, v)
    assert "layout=" not in str(err.value).split("(layout='bhsd')")[-1]


@pytest.mark.parametrize("lq", [1, 24])
def test_the_hint_fires_when_the_other_reading_is_the_likely_one(lq):
    q, k, v = bshd(2, lq, 40, 8, 8)
    with pytest.raises(CallError, match=r"look like \(batch, seq, heads, dim\).*layout='bshd'"):
        attncc.reference(attncc.parse(HEADS_8), q, k, v)
    with pytest.raises(CallError, match=r"look like \(batch, heads, seq, dim\).*layout='bhsd'"):
        attncc.reference(attncc.parse(HEADS_8), *(t.transpose(1, 2) for t in (q, k, v)),
                         layout="bshd")
