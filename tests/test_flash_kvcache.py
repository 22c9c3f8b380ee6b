"""attncc.flash.flash_attn_with_kvcache against flash-attn's documented semantics.

The truth is `kvcache_semantics`, written from flash-attn's docstring of
flash_attn_with_kvcache with torch ops in float64, not from attncc's variants or
decode_reference: each row's cache holds cache_seqlens[b] keys (gathered through the
block table when paged), the new k, v follow them, and the seqlen_q queries are the
last rows of a bottom-right aligned attention over the L = cache_seqlens[b] +
seqlen_new keys: query i at position L - seqlen_q + i, window (left, right) keeping
keys in [pos - left, pos + right] (-1 unbounded; causal bounds the right at 0), a
query before position 0 included. Shapes are awkward: lengths off the tile, one token,
more queries than keys, head counts 3/1 and 6/2, shuffled pages.
"""
from __future__ import annotations

import math

import pytest
import torch

from attncc.errors import CallError
from attncc.flash import flash_attn_with_kvcache
from attncc.semantics.tolerance import max_abs_error, within_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kvcache_semantics(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *, causal=False,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None):
    """Out (batch, seqlen_q, nheads, d) and LSE (batch, nheads, seqlen_q), -inf for a row
    that attends to nothing (flash-attn writes +inf there), computed row by row."""
    B, Sq, H, D = q.shape
    outs, lses = [], []
    for b in range(B):
        n = int(cache_seqlens[b]) if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens
        if block_table is None:
            keys, values = k_cache[b, :n], v_cache[b, :n]
        else:
            page_size = k_cache.shape[1]
            pos = torch.arange(n, device=q.device)
            page = block_table[b].long()[pos // page_size]
            keys, values = k_cache[page, pos % page_size], v_cache[page, pos % page_size]
        if k is not None:
            keys, values = torch.cat([keys, k[b]]), torch.cat([values, v[b]])
        L = keys.shape[0]
        group = H // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[b], keys) * (softmax_scale or D ** -0.5)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos_q = torch.arange(Sq, device=q.device).view(-1, 1) + L - Sq
        j = torch.arange(L, device=q.device).view(1, -1)
        allowed = torch.ones(Sq, L, dtype=torch.bool, device=q.device)
        left, right = window_size
        if causal:
            allowed &= j <= pos_q
        if left >= 0:
            allowed &= j >= pos_q - left
        if right >= 0:
            allowed &= j <= pos_q + right
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            s = s - slopes.to(s.dtype).view(H, 1, 1) * (pos_q - j).abs()
        s = s.masked_fill(~allowed, -math.inf)
        lse = torch.logsumexp(s, -1)  # (H, Sq); -inf where nothing is allowed
        p = torch.where(allowed, torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None]), 0)
        outs.append(torch.einsum("hqk,khd->qhd", p, values))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def paged(cache, page_size, gen):
    """(B, capacity, Hkv, D) as shuffled pages (num_pages, page_size, Hkv, D), one spare
    page of NaN that no row owns, and the block table."""
    B, cap, Hkv, D = cache.shape
    per_row = -(-cap // page_size)
    order = torch.randperm(B * per_row + 1, generator=gen)[:B * per_row]
    pages = torch.full((B * per_row + 1, page_size, Hkv, D), math.nan, dtype=cache.dtype)
    padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per_row * page_size - cap))
    pages[order] = padded.reshape(B * per_row, page_size, Hkv, D)
    return pages.to(DEVICE), order.view(B, per_row).int().to(DEVICE)


def run(*, heads=(6, 2), seqlen_q=1, seqlen_new=0, lens=(1, 37, 50), capacity=64, D=16,
        dtype=torch.float32, page_size=None, int_lens=False, alibi=None, num_splits=0, seed=0,
        **options):
    """One flash_attn_with_kvcache call against kvcache_semantics in float64 and in
    `dtype`; checks the in-place append too. Returns (out, lse)."""
    Hq, Hkv = heads
    B = len(lens)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seqlen_q, Hq, D, generator=gen)
    k_cache, v_cache = (torch.randn(B, capacity, Hkv, D, generator=gen) for _ in range(2))
    k_new, v_new = (torch.randn(B, seqlen_new, Hkv, D, generator=gen) if seqlen_new else None
                    for _ in range(2))
    table = None
    if page_size:
        k_cache, table = paged(k_cache, page_size, torch.Generator().manual_seed(seed))
        v_cache, _ = paged(v_cache, page_size, torch.Generator().manual_seed(seed))
    slopes = None
    if alibi == "h":
        slopes = torch.rand(Hq, generator=gen)
    elif alibi == "bh":
        slopes = torch.rand(B, Hq, generator=gen)
    seqlens = lens[0] if int_lens else torch.tensor(lens, dtype=torch.int32)
    to = lambda t, dt: None if t is None else t.to(DEVICE, dt)

    def truth(dt):
        return kvcache_semantics(to(q, dt), to(k_cache, dt), to(v_cache, dt), to(k_new, dt),
                                 to(v_new, dt), seqlens, table, alibi_slopes=to(slopes, dt),
                                 **options)
    ref, eager = truth(torch.float64), truth(dtype)
    kc, vc = to(k_cache, dtype), to(v_cache, dtype)
    out, lse = flash_attn_with_kvcache(
        to(q, dtype), kc, vc, to(k_new, dtype), to(v_new, dtype),
        cache_seqlens=seqlens if int_lens else seqlens.to(DEVICE), block_table=table,
        alibi_slopes=to(slopes, torch.float32), num_splits=num_splits, return_softmax_lse=True,
        **options)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (B, Hq, seqlen_q)
    for name, got, r, e in (("out", out, ref[0], eager[0]), ("lse", lse, ref[1], eager[1])):
        assert torch.equal(torch.isneginf(got), torch.isneginf(r)), f"{name}: empty rows differ"
        finite = ~torch.isneginf(r)
        err, err_eager = max_abs_error(got[finite], r[finite]), max_abs_error(e[finite], r[finite])
        assert not math.isnan(err), f"{name}: NaN"
        assert within_tolerance(err, err_eager, dtype, r[finite]), (
            f"{name}: error {err:.3g} vs eager {err_eager:.3g}")
    if seqlen_new:  # the new tokens are in the caches, in place, where flash-attn puts them
        for b in range(B):
            start = lens[0] if int_lens else lens[b]
            for j in range(seqlen_new):
                pos = start + j
                for cache, new in ((kc, k_new), (vc, v_new)):
                    got = cache[b, pos] if table is None else \
                        cache[table[b, pos // page_size], pos % page_size]
                    torch.testing.assert_close(got, new[b, j].to(DEVICE, dtype), rtol=0, atol=0)
    return out, lse


SLOW = pytest.mark.slow


@pytest.mark.parametrize("options", [
    pytest.param(dict(causal=True), marks=SLOW, id="causal"),
    pytest.param(dict(causal=False), marks=SLOW, id="full"),
    pytest.param(dict(causal=True, window_size=(7, -1)), marks=SLOW, id="causal-window"),
    pytest.param(dict(causal=False, window_size=(5, 3)), id="window-both-sides"),
    pytest.param(dict(causal=True, softcap=5.0, softmax_scale=0.3), id="softcap-scale"),
])
def test_matches_flash_attn_semantics(options):
    # Three new queries and three appended tokens on ragged rows (1 + 3 keys: the first
    # query of that row sits at position 1), GQA 6/2.
    run(seqlen_q=3, seqlen_new=3, lens=(1, 37, 50), **options)


@pytest.mark.parametrize("page_size", [pytest.param(16, marks=SLOW), 24])
def test_paged_cache_with_shuffled_pages(page_size):
    run(seqlen_q=2, seqlen_new=2, lens=(30, 5, 61), capacity=64, page_size=page_size,
        causal=True, window_size=(20, -1), seed=2)


@pytest.mark.parametrize("options", [
    pytest.param(dict(causal=False), marks=SLOW, id="full"),
    pytest.param(dict(causal=False, window_size=(1, 2)), id="window"),
    pytest.param(dict(causal=True), marks=SLOW, id="causal")])
def test_queries_before_the_first_key_follow_flash_attn(options):
    # 5 queries over rows of 2 and 0 keys: queries at positions -3 .. 1 and -5 .. -1. Not
    # causal, they see every key (or their window's); causal, those before 0 see nothing.
    run(seqlen_q=5, lens=(2, 0, 9), heads=(3, 1), seed=3, **options)


def test_alibi_int_lengths_float16_and_one_token():
    run(seqlen_q=1, seqlen_new=1, lens=(40, 40), int_lens=True, causal=True, alibi="bh", D=40,
        dtype=torch.float16, seed=4)


@SLOW
def test_alibi_per_head_one_split():
    run(seqlen_q=2, lens=(9, 20), causal=True, alibi="h", num_splits=1, seed=5)


def test_whole_cache_without_cache_seqlens():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(DEVICE)
    kc, vc = (torch.randn(2, 33, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    out = flash_attn_with_kvcache(q, kc, vc, causal=True)
    ref, _ = kvcache_semantics(q.double(), kc.double(), vc.double(), None, None, 33, None,
                               causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def _call(**overrides):
    args = dict(q=torch.randn(2, 1, 4, 16), k_cache=torch.randn(2, 32, 2, 16),
                v_cache=torch.randn(2, 32, 2, 16), cache_seqlens=3)
    args.update(overrides)
    return flash_attn_with_kvcache(**{n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                      for n, t in args.items()})


@pytest.mark.parametrize("overrides, words", [
    (dict(rotary_cos=torch.randn(32, 8), rotary_sin=torch.randn(32, 8)), "rotary_cos is not supported"),
    (dict(rotary_sin=torch.randn(32, 8)), "rotary_sin is not supported"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "cache_leftpad is not supported"),
    (dict(cache_batch_idx=torch.arange(2, dtype=torch.int32)), "cache_batch_idx is not supported"),
    (dict(k=torch.randn(2, 1, 2, 16)), "both k and v"),
    (dict(k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16), cache_seqlens=None), "pass cache_seqlens"),
    (dict(cache_seqlens=32, k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16)), "do not fit the cache"),
    (dict(num_splits=-1), "num_splits must be"),
    (dict(return_softmax_lse=1), "return_softmax_lse must be"),
    (dict(q=torch.randn(2, 4, 16)), "(batch, seqlen_q, nheads, headdim)"),
    (dict(window_size=(3,)), "window_size must be a pair"),
    # Shapes are named as the caller passed them, (batch, seqlen, nheads, headdim), not as
    # the (batch, heads, seq, dim) views decoding is handed.
    (dict(k=torch.randn(2, 1, 3, 16), v=torch.randn(2, 1, 3, 16)),
     "k must have shape (batch, seqlen_new, nheads_k, headdim) = (2, seqlen_new, 2, 16), as q's "
     "batch and k_cache's heads and headdim, got (2, 1, 3, 16)"),
    (dict(k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 2, 2, 16)), "k and v must hold the same"),
    (dict(q=torch.randn(2, 1, 3, 16)), "nheads (3) must be a multiple of nheads_k (2) "
                                       "(q (2, 1, 3, 16), k_cache (2, 32, 2, 16))"),
    (dict(q=torch.randn(2, 1, 4, 32)), "same headdim, got q (2, 1, 4, 32) and k_cache (2, 32, 2, 16)"),
    (dict(q=torch.randn(3, 1, 4, 16)), "same batch size, got q (3, 1, 4, 16) and k_cache (2, 32, 2, 16)"),
    (dict(v_cache=torch.randn(2, 28, 2, 16)), "got k_cache (2, 32, 2, 16) and v_cache (2, 28, 2, 16)"),
    # Said in flash-attn's shapes and names, not decoding's (b, h, s, d) views and k_new.
    (dict(q=torch.randn(2, 1, 4, 8), k_cache=torch.randn(2, 32, 2, 8), v_cache=torch.randn(2, 32, 2, 8)),
     "headdim 8 is not supported (q (2, 1, 4, 8))"),
    (dict(q=torch.randn(0, 1, 4, 16), k_cache=torch.randn(0, 32, 2, 16), v_cache=torch.randn(0, 32, 2, 16),
          cache_seqlens=torch.zeros(0, dtype=torch.int32)), "q has batch size 0 (q (0, 1, 4, 16))"),
    (dict(k=torch.randn(2, 1, 2, 16).half(), v=torch.randn(2, 1, 2, 16).half()),
     "k has dtype torch.float16 but q has torch.float32"),
])
def test_bad_calls_are_refused(overrides, words):
    with pytest.raises(CallError) as err:
        _call(**overrides)
    assert words in str(err.value)


def test_strided_cache_seqlens_are_read_by_row():
    """A column of a per-row table (stride 2) and an expanded scalar (stride 0) were read
    as if contiguous: lengths [5, 111, 30] for [5, 30, 12], wrong outputs, and the new
    keys written at the wrong places. numpy's integers count as an int."""
    import numpy as np
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 1, 4, 16, generator=gen).to(DEVICE)
    k_new, v_new = (torch.randn(3, 1, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    table = torch.tensor([[5, 111], [30, 222], [12, 333]], dtype=torch.int32)
    cases = [(table[:, 0].to(DEVICE), [5, 30, 12]),
             (torch.tensor([9], dtype=torch.int32, device=DEVICE).expand(3), [9, 9, 9]),
             (np.int32(9), [9, 9, 9])]
    for passed, lengths in cases:
        kc, vc = (torch.randn(3, 48, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
        ref, _ = kvcache_semantics(q.double(), kc.double(), vc.double(), k_new.double(),
                                   v_new.double(), torch.tensor(lengths), None, causal=True)
        out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=passed, causal=True)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(kc[b, n], k_new[b, 0], rtol=0, atol=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's refusal")
def test_bfloat16_decoding_is_refused_under_the_interpreter():
    """The interpreter's tl.dot computes bfloat16 wrongly: calls refused it, decoding
    returned values off by 1e8."""
    with pytest.raises(CallError, match="bfloat16 cannot run under the Triton interpreter"):
        _call(q=torch.randn(2, 1, 4, 16, dtype=torch.bfloat16),
              k_cache=torch.randn(2, 32, 2, 16, dtype=torch.bfloat16),
              v_cache=torch.randn(2, 32, 2, 16, dtype=torch.bfloat16))
