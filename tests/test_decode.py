"""Split-KV decoding (`kernel.decode`) against the float64 reference of a decode call.

`decode_reference` gathers each batch row's cache (through the block table when paged),
appends the new keys and values, puts q in the last n_q rows of a query sequence as long
as the keys, and runs attncc.reference on it: the last n_q rows of the row's
self-attention. The kernels run under the Triton interpreter on the CPU (float32 and
float16), with ragged cache lengths (1, lengths off the 16-key tile), n_q of 1, 3 and
8, GQA and MQA, shuffled page tables, in-place appends, and variants with masks, score
mods and layouts. Cache positions no pair attends are poisoned with NaN, so a kernel
that read one would fail.
"""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.runtime import tuning
from attncc.runtime.decoding import DecodeProblem, candidates, check_decode_config, default_splits, tuning_key
from attncc.semantics.decoding import decode_reference
from attncc.errors import CallError
from attncc.semantics.reference import allowed_pairs
from attncc.arguments import Problem
from attncc.semantics.tolerance import max_abs_error, within_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = 16  # the interpreter's BLOCK_N (attncc/runtime/decoding.py)

CAUSAL = "attention causal { mask q >= k }"
WINDOW_SINKS = "attention window_sinks { mask q >= k and (q - k < 20 or k < 3) }"
BOTTOM_RIGHT = "attention bottom_right { mask q + len_k - len_q >= k }"
DOCUMENT = ("attention document { input doc: i32[b, k]  mask doc[b, q] == doc[b, k] and q >= k }")
ALIBI = "attention alibi { input slopes: f32[h]  mask q >= k  score s + slopes[h] * (k - q) }"
SOFTCAP = "attention softcap { param cap: float = 5.0  mask q >= k  score cap * tanh(s / cap) }"
NSA = ("attention nsa { input top: i32[b, h, qb, 2]  mask q >= k  layout kb in top[b, h, qb]"
       "  block 16 }")
HEAD_LAYOUT = ("attention head_layout { mask q >= k  layout kb <= qb and ((h % 2 == 0 and "
               "qb - kb < 2) or (h % 2 == 1 and (qb - kb) % 3 == 0))  block 16 }")
DROPOUT = "attention dropped { mask q >= k  dropout 0.5 }"
REL_BIAS = ("attention rel_bias { learnable input bias: f32[h, 63]  mask q >= k  "
            "score s + bias[h, min(max(q - k, 0), 62)] }")


# ------------------------------------------------------------------------- helpers
def randn(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def make_inputs(variant, B, Hq, capacity, gen) -> dict:
    """Stand-ins for the inputs: sorted document ids per row, ALiBi-like slopes, and per
    (row, head, query block) two causal key blocks: a random one and the diagonal."""
    out = {}
    for decl in variant.inputs:
        if decl.name == "doc":
            t = torch.sort(torch.randint(0, 4, (B, capacity), generator=gen), dim=1).values
        elif decl.name == "slopes":
            t = torch.rand(Hq, generator=gen) * 0.5
        elif decl.name == "bias":
            t = torch.randn(Hq, 63, generator=gen).requires_grad_()
        elif decl.name == "top":
            n_blocks = -(-capacity // variant.block)
            qb = torch.arange(n_blocks).view(1, 1, -1)
            first = (torch.rand(B, Hq, n_blocks, generator=gen) * (qb + 1)).long()
            second = torch.where(first == qb, -1, qb)
            t = torch.stack([first, second], -1)
        else:
            raise AssertionError(decl.name)
        out[decl.name] = t.to(attncc.arguments.TORCH_DTYPES[decl.dtype]).to(DEVICE)
    return out


def to_paged(cache: torch.Tensor, page_size: int, gen) -> tuple:
    """The contiguous cache (B, Hkv, capacity, D) as shuffled pages (num_pages, page_size,
    Hkv, D) plus a block table; two spare pages full of NaN that no row owns."""
    B, Hkv, capacity, D = cache.shape
    per_row = -(-capacity // page_size)
    n_pages = B * per_row + 2
    order = torch.randperm(n_pages, generator=gen)[:B * per_row].to(cache.device)
    pages = torch.full((n_pages, page_size, Hkv, D), math.nan, dtype=cache.dtype, device=cache.device)
    padded = torch.nn.functional.pad(cache, (0, 0, 0, per_row * page_size - capacity))
    rows = padded.view(B, Hkv, per_row, page_size, D).permute(0, 2, 3, 1, 4)  # [B, P, ps, Hkv, D]
    pages[order] = rows.reshape(B * per_row, page_size, Hkv, D)
    return pages, order.view(B, per_row).to(torch.int32)


def poison_unread(variant, k, v, seqlens, n_q, n_new, Hq, inputs, tile):
    """Copies of the caches with NaN at every position the call must not read: past each
    row's keys, and in every key tile (of `tile` keys) where no query row of the kv head's
    group attends. (V at a read position is multiplied by its probability, so one NaN
    read gives NaN even where the probability is 0.)"""
    from attncc.semantics.decoding import _row_inputs
    k, v = k.clone(), v.clone()
    B, Hkv, capacity, D = k.shape
    for b in range(B):
        L = min(int(seqlens[b]) + n_new, capacity)
        dead = torch.ones(Hkv, capacity, dtype=torch.bool, device=k.device)
        if L:
            p = Problem(1, Hq, Hkv, L, L, D, D)
            allowed = allowed_pairs(variant, p, _row_inputs(variant, inputs, b, L), k.device)
            allowed = allowed.expand(1, Hq, L, L)[0, :, max(L - n_q, 0):]  # [Hq, rows, L]
            read = allowed.any(1).view(Hkv, Hq // Hkv, L).any(1)  # [Hkv, L]
            read = torch.nn.functional.pad(read, (0, -(-L // tile) * tile - L))
            read = read.view(Hkv, -1, tile).any(2).repeat_interleave(tile, 1)[:, :L]
            dead[:, :L] = ~read
        for cache in (k, v):
            cache[b][dead] = math.nan
    return k, v


def check(out, lse, ref, eager, dtype):
    for name, got, r, e in (("out", out, ref[0], eager[0]), ("lse", lse, ref[1], eager[1])):
        err, err_eager = max_abs_error(got, r), max_abs_error(e, r)
        assert not math.isnan(err), f"{name}: NaN"
        assert within_tolerance(err, err_eager, dtype, r), (
            f"{name}: kernel error {err:.3g} vs eager {err_eager:.3g}")


def run_case(spec, *, heads=(4, 2), n_q=1, seqlens=(1, 37, 50), capacity=64, D=16,
             dtype=torch.float32, append=False, page_size=None, num_splits=None, config=None,
             seed=0, poison=True):
    """One decode call against decode_reference in float64 and in `dtype`; returns
    (out, lse, (k cache, v cache, block table, k_new, v_new, lengths) after the call)."""
    variant = attncc.load(spec)
    if variant.heads:
        heads = (variant.heads.q, variant.heads.kv)
    Hq, Hkv = heads
    B = len(seqlens)
    if DEVICE == "cuda" and config is None:
        # Poisoned tiles are TILE keys wide: pin the kernel's tile to them.
        config = dict(BLOCK_N=TILE, num_warps=4, num_stages=2, num_splits=num_splits or 3)
        num_splits = None
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, B, Hq, n_q, D)
    k = randn(gen, B, Hkv, capacity, D)
    v = randn(gen, B, Hkv, capacity, D)
    n_new = n_q if append else 0
    k_new = randn(gen, B, Hkv, n_new, D) if append else None
    v_new = randn(gen, B, Hkv, n_new, D) if append else None
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    inputs = make_inputs(variant, B, Hq, capacity, gen)

    def reference(cast):
        return decode_reference(variant, q.to(cast), k.to(cast), v.to(cast), cache_seqlens=lens,
                                k_new=None if k_new is None else k_new.to(cast),
                                v_new=None if v_new is None else v_new.to(cast),
                                return_lse=True, **inputs)
    ref, eager = reference(torch.float64), reference(dtype)
    kc, vc = k, v
    if poison:
        kc, vc = poison_unread(variant, k, v, seqlens, n_q, n_new, Hq, inputs,
                               config["BLOCK_N"] if config else TILE)
    kc, vc, table = kc.to(dtype), vc.to(dtype), None
    if page_size:
        kc, table = to_paged(kc, page_size, torch.Generator().manual_seed(seed + 1))
        vc, _ = to_paged(vc, page_size, torch.Generator().manual_seed(seed + 1))
    kernel = attncc.compile(variant)
    out, lse = kernel.decode(
        q.to(dtype), kc, vc, cache_seqlens=lens, block_table=table, return_lse=True,
        k_new=None if k_new is None else k_new.to(dtype),
        v_new=None if v_new is None else v_new.to(dtype), num_splits=num_splits, config=config,
        **inputs)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:3]
    check(out, lse, ref, eager, dtype)
    return out, lse, (kc, vc, table, k_new, v_new, lens)


# ------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("n_q, append, splits", [(1, False, None), (3, True, 1), (8, False, 4)])
def test_causal_ragged_lengths_gqa(n_q, append, splits):
    # Lengths 1 (shorter than n_q without an append: the first tokens see no key), 37 and
    # 50 (off the tile), GQA 4/2; one split, the default (3 under the interpreter), and 4.
    run_case(CAUSAL, n_q=n_q, append=append, num_splits=splits)


@pytest.mark.parametrize("spec, heads", [(WINDOW_SINKS, (6, 2)), (WINDOW_SINKS, (4, 1))],
                         ids=["gqa6/2", "mqa4/1"])
def test_window_and_sinks_read_only_their_keys(spec, heads):
    # The middle of each long row is poisoned with NaN: only the window and the sinks
    # may be read (two key intervals per row, split across programs).
    run_case(spec, heads=heads, n_q=3, seqlens=(64, 41, 2), capacity=64, append=True)


def test_odd_head_dim_and_float16():
    run_case(ALIBI, heads=(2, 2), n_q=2, seqlens=(30, 17), D=40, dtype=torch.float16)


def test_bottom_right_spelling_is_causal_at_decode_time():
    # len_q = len_k at decode time, so `q + len_k - len_q >= k` is `q >= k`: same result.
    a, la, _ = run_case(BOTTOM_RIGHT, n_q=3, seqlens=(20, 33), seed=3)
    b, lb, _ = run_case(CAUSAL, n_q=3, seqlens=(20, 33), seed=3)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- paged caches
@pytest.mark.parametrize("page_size, config", [
    (16, None), (32, None), (64, None),
    (16, dict(BLOCK_N=32, num_warps=4, num_stages=1, num_splits=2)),  # pages smaller than a tile
], ids=["page16", "page32", "page64", "page16-tile32"])
def test_paged_cache_with_shuffled_pages(page_size, config):
    out, lse, _ = run_case(CAUSAL, n_q=3, seqlens=(50, 1, 64), append=True, page_size=page_size,
                           config=config, seed=5)
    flat, flat_lse, _ = run_case(CAUSAL, n_q=3, seqlens=(50, 1, 64), append=True, config=config,
                                 seed=5)
    # The same tiles in the same order: bit for bit what the contiguous cache gives.
    torch.testing.assert_close(out, flat, rtol=0, atol=0)
    torch.testing.assert_close(lse, flat_lse, rtol=0, atol=0)


@pytest.mark.parametrize("page_size", [None, 16])
def test_append_writes_the_new_tokens_in_place(page_size):
    _, _, (kc, vc, table, k_new, v_new, lens) = run_case(
        CAUSAL, n_q=3, seqlens=(0, 20, 61), append=True, page_size=page_size, poison=False)
    B, Hkv, n_new, D = k_new.shape
    for cache, new in ((kc, k_new), (vc, v_new)):
        for b in range(B):
            for j in range(n_new):
                pos = int(lens[b]) + j
                if pos >= 64:
                    continue  # past the capacity: dropped
                if table is None:
                    got = cache[b, :, pos]
                else:
                    got = cache[table[b, pos // page_size], pos % page_size]
                torch.testing.assert_close(got, new[b, :, j], rtol=0, atol=0)


def test_append_leaves_the_rest_of_the_cache_alone():
    gen = torch.Generator().manual_seed(7)
    kernel = attncc.compile(CAUSAL)
    q = randn(gen, 2, 4, 2, 16)
    k, v = randn(gen, 2, 2, 32, 16), randn(gen, 2, 2, 32, 16)
    k_new, v_new = randn(gen, 2, 2, 2, 16), randn(gen, 2, 2, 2, 16)
    lens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)
    before_k, before_v = k.clone(), v.clone()
    kernel.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    expect_k[0, :, 5:7], expect_v[0, :, 5:7] = k_new[0], v_new[0]
    expect_k[1, :, 30:32], expect_v[1, :, 30:32] = k_new[1], v_new[1]
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)


# ------------------------------------------------------------------------- variants
@pytest.mark.parametrize("spec", [DOCUMENT, ALIBI, SOFTCAP, NSA, HEAD_LAYOUT, DROPOUT, REL_BIAS],
                         ids=["document", "alibi", "softcap", "nsa_topk", "head_layout", "dropout",
                              "learnable_bias"])
def test_variants(spec):
    # Document ids and layouts are classified per tile inside the kernel: the tiles they
    # rule out are poisoned, so skipping them is tested too. Dropout is left out, and a
    # learnable input is only read.
    run_case(spec, n_q=3, seqlens=(64, 23, 40), append=True, seed=11)


def test_layout_with_key_tiles_larger_than_its_blocks():
    # 32-key tiles over 16-blocks: the layout is evaluated per key, not once per tile.
    run_case(NSA, n_q=3, seqlens=(64, 23, 40), append=True, seed=12,
             config=dict(BLOCK_N=32, num_warps=4, num_stages=1, num_splits=2))


def test_empty_rows_give_zero_and_minus_infinity():
    kernel = attncc.compile(CAUSAL)
    gen = torch.Generator().manual_seed(2)
    q = randn(gen, 2, 2, 3, 16)
    k, v = randn(gen, 2, 2, 32, 16), randn(gen, 2, 2, 32, 16)
    out, lse = kernel.decode(q, k, v, cache_seqlens=torch.tensor([0, 2], dtype=torch.int32,
                                                                 device=DEVICE),
                             return_lse=True, num_splits=2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())
    # Row 1 holds 2 keys for 3 tokens: token 0 would sit at position -1.
    assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
    assert bool((lse[1, :, 0] == -math.inf).all()) and bool(torch.isfinite(lse[1, :, 1:]).all())


def test_a_bad_block_table_entry_cannot_fault():
    # Entries outside [0, num_pages) are the caller's mistake: clamped into range, so the
    # kernels (and the append) stay inside the cache.
    kernel = attncc.compile(CAUSAL)
    gen = torch.Generator().manual_seed(3)
    pages_k, pages_v = randn(gen, 4, 16, 2, 16), randn(gen, 4, 16, 2, 16)
    table = torch.tensor([[0, 10 ** 6], [-7, 3]], dtype=torch.int32, device=DEVICE)
    out = kernel.decode(randn(gen, 2, 4, 1, 16), pages_k, pages_v, cache_seqlens=30,
                        k_new=randn(gen, 2, 2, 1, 16), v_new=randn(gen, 2, 2, 1, 16),
                        block_table=table)
    assert bool(torch.isfinite(out).all())


def test_decode_builds_no_graph_and_a_backward_through_it_raises():
    """Decoding has no gradients. A backward reaching its output left q's and the
    learnable slopes' .grad silently empty (the rest of the loss still flowed); it
    raises now. Under no_grad, or with nothing asking, the output has no graph."""
    kernel = attncc.compile(ALIBI)
    q = torch.randn(1, 2, 1, 16, device=DEVICE, requires_grad=True)
    k, v = torch.randn(1, 2, 16, 16, device=DEVICE), torch.randn(1, 2, 16, 16, device=DEVICE)
    slopes = torch.rand(2, device=DEVICE)
    out, lse = kernel.decode(q, k, v, cache_seqlens=9, slopes=slopes, return_lse=True)
    want = kernel.decode(q.detach(), k, v, cache_seqlens=9, slopes=slopes)
    assert torch.equal(out.detach(), want) and want.grad_fn is None
    with pytest.raises(CallError, match=r"kernel.decode \(or of flash_attn_with_kvcache, which decodes\), which is inference only"):
        (out.sum() + (q ** 2).sum()).backward()
    with pytest.raises(CallError, match=r"kernel.decode \(or of flash_attn_with_kvcache, which decodes\), which is inference only"):
        lse.sum().backward()
    with torch.no_grad():
        assert kernel.decode(q, k, v, cache_seqlens=9, slopes=slopes).grad_fn is None


# ------------------------------------------------------------------------- errors
def _call(**overrides):
    kernel = attncc.compile(overrides.pop("spec", CAUSAL))
    args = dict(q=torch.randn(2, 4, 1, 16), k_cache=torch.randn(2, 2, 32, 16),
                v_cache=torch.randn(2, 2, 32, 16), cache_seqlens=torch.tensor([3, 4], dtype=torch.int32))
    args.update(overrides)
    args = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return kernel.decode(q, kc, vc, **args)


@pytest.mark.parametrize("overrides, words", [
    (dict(cache_seqlens=None), "needs cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([3, 4])), "must be int32"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), "one length per batch row"),
    (dict(q_offset=3), "takes no q_offset"),
    (dict(k_new=torch.randn(2, 2, 1, 16)), "both k_new and v_new"),
    (dict(k_new=torch.randn(2, 4, 1, 16), v_new=torch.randn(2, 4, 1, 16)), "expected (2, 2, n_new, 16)"),
    (dict(v_cache=torch.randn(2, 2, 31, 16)), "the same shape"),
    (dict(k_cache=torch.randn(2, 3, 32, 16), v_cache=torch.randn(2, 3, 32, 16)), "not a multiple"),
    (dict(k_cache=torch.randn(1, 2, 32, 16), v_cache=torch.randn(1, 2, 32, 16)), "needs block_table="),
    (dict(k_cache=torch.randn(8, 16, 2, 16), v_cache=torch.randn(8, 16, 2, 16),
          block_table=torch.zeros(2, 2)), "must be int32"),
    (dict(k_cache=torch.randn(8, 16, 2, 16), v_cache=torch.randn(8, 16, 2, 16),
          block_table=torch.zeros(3, 2, dtype=torch.int32)), "one row of page indices"),
    (dict(q=torch.randn(2, 4, 1, 16).double()), "float16, bfloat16 or float32"),
    (dict(num_splits=0), "num_splits must be"),
    (dict(spec=ALIBI), "missing input 'slopes'"),
    (dict(spec=ALIBI, slopes=torch.rand(3)), "input 'slopes' has shape"),
])
def test_bad_calls_are_refused(overrides, words):
    with pytest.raises(CallError) as err:
        _call(**overrides)
    assert words in str(err.value)


def test_decode_reference_takes_and_refuses_the_lengths_decode_does():
    """decode_reference raised TypeError, AttributeError or IndexError on lengths that
    kernel.decode takes (a numpy int) or refuses by name."""
    import numpy as np
    kernel = attncc.compile(CAUSAL)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 2, 1, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 1, 12, 16, generator=gen).to(DEVICE) for _ in range(2))
    ref = decode_reference(kernel.variant, q.double(), k.double(), v.double(), cache_seqlens=np.int32(5))
    assert max_abs_error(kernel.decode(q, k, v, cache_seqlens=np.int32(5)), ref) < 1e-5
    for bad, words in ((torch.tensor(5, dtype=torch.int32), r"shape \(\), expected \(2,\)"),
                       ([3, 4], "must be an int or a \\(batch,\\) int32 tensor, got list"),
                       (torch.tensor([5], dtype=torch.int32), r"shape \(1,\), expected \(2,\)")):
        for call in (kernel.decode, lambda *t, **kw: decode_reference(kernel.variant, *t, **kw)):
            with pytest.raises(CallError, match=words):
                call(q, k, v, cache_seqlens=bad if not torch.is_tensor(bad) else bad.to(DEVICE))


def test_an_input_named_like_a_decode_keyword_is_refused():
    with pytest.raises(attncc.SpecError, match="kernel.decode already takes block_table="):
        attncc.parse("attention clash { input block_table: i32[b]  mask q >= k }")


def test_a_bad_config_is_refused():
    with pytest.raises(ValueError, match="exactly the keys"):
        _call(config=dict(BLOCK_N=16))


# ------------------------------------------------------------------------- tuning
def test_split_count_fills_one_wave_and_respects_layout_blocks():
    few = DecodeProblem(1, 32, 8, 1, 0, 128, 131072, 0)
    many = DecodeProblem(8, 32, 8, 1, 0, 128, 32768, 0)
    # H100: 132 SMs, three 64-key bf16 programs each (two stages of K and V in flight).
    assert default_splits(few, 64, 3, 2, 132, reach_tiles=2048) == 49  # 392 programs <= 396
    assert default_splits(many, 64, 3, 2, 132, reach_tiles=512) == 6  # 384 programs
    # A 4096-key window reaches 65 tiles: at least 4 per split.
    assert default_splits(few, 64, 3, 2, 132, reach_tiles=65) == 16
    assert default_splits(DecodeProblem(1, 32, 8, 1, 0, 128, 100, 0), 64, 3, 2, 132, 2) == 1
    window = attncc.compile("attention w { mask q >= k and (q - k < 4096 or k < 4) }")
    assert window.module.decode_reach_tiles(131072, 1, 64) == 65  # 64 window tiles + the sinks'
    assert window.module.decode_reach_tiles(100, 1, 64) == 2
    nsa = attncc.parse(NSA.replace("block 16", "block 32"))
    reach = lambda bn: 131072 // bn
    assert all(c["BLOCK_N"] <= 32 for c in candidates(nsa, few, 2, 132, reach))
    first = candidates(attncc.parse(CAUSAL), few, 2, 132, reach)
    # The tuner tries one program per SM (132 // 8), fewer and more.
    assert [c["num_splits"] for c in first[:4]] == [49, 16, 24, 98]
    eight = candidates(attncc.parse(CAUSAL), many, 2, 132, lambda bn: 32768 // bn)
    assert [c["num_splits"] for c in eight[:4]] == [6, 2, 3, 12]
    assert "page64" in tuning_key(DecodeProblem(1, 32, 8, 1, 1, 128, 4096, 64), torch.bfloat16, None)


def test_decode_configs_are_cached_apart_from_the_training_configs(tmp_path):
    path = tmp_path / "t-decode.json"
    config = dict(BLOCK_N=64, num_warps=4, num_stages=3, num_splits=8)
    tuning._store(path, {"decode-d128": config}, check_decode_config)
    assert tuning._load(path, check_decode_config) == {"decode-d128": config}
    assert tuning._load(path) == {}  # not a training choice: that loader ignores the file
    variant = attncc.parse(CAUSAL)
    assert tuning._cache_file(variant, "-decode") != tuning._cache_file(variant)


# ------------------------------------------------------------------------- bench --decode
def test_bench_decode_without_a_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from attncc.tools.cli import main
    assert main(["bench", "examples/causal.attn", "--decode", "--len", "4096"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_decode_counts_the_keys_a_step_must_read_and_matches_flex():
    # The window reads 20 keys per row plus 3 sinks: (20 + 3) keys x 2 kv heads x 2 rows.
    # FlexAttention (eager, on the CPU) given the bench's translation of the variant, with
    # the rows at the end of the cache, computes what decode_reference does.
    import warnings
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from attncc.tools.flex import flex_mods
    from attncc.tools.decode_bench import decode_allowed, format_decode, keys_read
    variant = attncc.parse(WINDOW_SINKS)
    B, heads, L, n_q, D = 2, (4, 2), 100, 1, 16
    allowed = decode_allowed(variant, batch=B, heads=heads, length=L, n_q=n_q, dim=D, inputs={},
                             device="cpu")
    assert keys_read(allowed, B, heads) == (20 + 3) * 2 * B
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((4, 2), (2, L), (2, L)))
    for spec, inputs in ((WINDOW_SINKS, {}), (ALIBI, {"slopes": torch.rand(4, generator=gen)})):
        variant = attncc.parse(spec)
        mask_mod, score_mod = flex_mods(variant, len_q=L, len_k=L, dim=D, inputs=inputs)
        mask = create_block_mask(lambda b, h, i, j: mask_mod(b, h, i + L - 2, j), None, None, 2, L,
                                 device="cpu")
        score = (lambda s, b, h, i, j: score_mod(s, b, h, i + L - 2, j)) if score_mod else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = flex_attention(q, k, v, enable_gqa=True, block_mask=mask, score_mod=score)
        ref = decode_reference(variant, q.double(), k.double(), v.double(), cache_seqlens=L,
                               **inputs)
        assert max_abs_error(out, ref) < 1e-5
    meta = {"variant": "w", "batch": B, "length": L, "n_q": 1, "heads_q": 4, "heads_kv": 2,
            "dim": D, "dtype": "bfloat16", "bytes_read": 4e6, "peak_bytes_per_s": 3.35e12}
    text = format_decode(meta, {"attncc": {"ms": 0.002, "bytes_per_s": 2e12},
                                "flex": {"ms": 0.003, "bytes_per_s": 1.3e12, "decoding_kernel": False},
                                "sdpa": {"skipped": "not plain"}})
    assert "60%" in text and "1.50x" in text and "not its decoding kernel" in text


def test_bench_decode_compares_a_sink_variant_with_the_sink(monkeypatch):
    """FlexAttention was timed as the same step without the variant's sink (0.2 off on a
    sink variant), and SDPA counted as the same step too. flex_decode's call now folds
    the sink in through Flex's LSE; run eagerly here (on the CPU, compiled Flex returns
    no LSE)."""
    import warnings
    from attncc.tools import decode_bench
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    variant = attncc.parse("attention s { learnable input sinks: f32[h]  mask q >= k  "
                           "sink sinks[h] }")
    B, heads, L, n_q, D = 1, (4, 2), 40, 2, 16
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((4, n_q), (2, L), (2, L)))
    inputs = {"sinks": torch.tensor([3.0, 4.0, -2.5, 5.0])}  # logits far above the scores
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call, _ = decode_bench.flex_decode(variant, q=q, k=k, v=v, length=L, n_q=n_q, dim=D,
                                           inputs=inputs)
        out = call()
    ref = decode_reference(variant, q.double(), k.double(), v.double(), cache_seqlens=L,
                           **{n: t.double() for n, t in inputs.items()})
    assert max_abs_error(out, ref) < 1e-5


def test_the_tuned_config_is_stored_and_reused(tmp_path, monkeypatch):
    # The GPU branch of decode_config, with the timing replaced: tuned once on the first
    # call's key, read back from memory, then from disk by a process that forgot it.
    from attncc.runtime import decoding, settings
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)  # GPU runs of the suite set it to 0
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(decoding, "_sm_count", lambda device: 132)
    timed = []

    def fake_tune(name, key, configs, run, context="", label=None):
        timed.append((key, configs))
        return configs[-1]
    monkeypatch.setattr(tuning, "tune", fake_tune)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = attncc.compile(WINDOW_SINKS.replace("< 20", "< 4096").replace("< 3", "< 4"))
    p = DecodeProblem(8, 32, 8, 1, 0, 128, 32768, 64)
    first = decoding.decode_config(kernel, p, torch.bfloat16, run=None)
    assert len(timed) == 1 and len(timed[0][1]) == decoding.TUNE_AT_MOST
    assert timed[0][0] == tuning_key(p, torch.bfloat16, None)
    # The window reaches 65 tiles of 64 keys: at most 16 splits of at least 4 tiles.
    assert timed[0][1][0] == dict(BLOCK_N=64, num_warps=4, num_stages=3, num_splits=6)
    assert decoding.decode_config(kernel, p, torch.bfloat16, run=None) == first
    monkeypatch.setattr(tuning, "_MEMORY", {})
    assert decoding.decode_config(kernel, p, torch.bfloat16, run=None) == first
    assert len(timed) == 1  # read from the -decode file, not tuned again
    pinned = decoding.decode_config(kernel, p, torch.bfloat16, run=None, num_splits=3)
    assert pinned["num_splits"] == 3 and len(timed) == 2


# ------------------------------------------------------------------------- every example
EXAMPLES = sorted((__import__("pathlib").Path(__file__).parent.parent / "examples").glob("*.attn"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_decodes(path):
    # Each example on ragged rows with three appended tokens, against decode_reference
    # (inputs from test_kernels.make_inputs: document ids, index lists, layouts, slopes).
    from test_kernels import make_inputs
    variant = attncc.parse_file(path)
    Hq, Hkv = (variant.heads.q, variant.heads.kv) if variant.heads else (4, 2)
    B, D, n_q, cap = 2, 16, 3, max(96, 2 * (variant.block or 0))
    gen = torch.Generator().manual_seed(0)
    inputs = make_inputs(variant, B, Hq, cap, cap, gen)
    q = randn(gen, B, Hq, n_q, D)
    k, v = randn(gen, B, Hkv, cap, D), randn(gen, B, Hkv, cap, D)
    k_new, v_new = randn(gen, B, Hkv, n_q, D), randn(gen, B, Hkv, n_q, D)
    lens = torch.tensor([cap - n_q, 17], dtype=torch.int32, device=DEVICE)

    with_lse = variant.normalize != "none"  # `normalize none` has no LSE to return

    def reference(cast):
        got = decode_reference(variant, q.to(cast), k.to(cast), v.to(cast), cache_seqlens=lens,
                               k_new=k_new.to(cast), v_new=v_new.to(cast), return_lse=with_lse,
                               **inputs)
        return got if with_lse else (got, torch.zeros(got.shape[:3], dtype=cast))
    out = attncc.compile(variant).decode(q, k, v, cache_seqlens=lens, k_new=k_new,
                                         v_new=v_new, return_lse=with_lse, **inputs)
    out, lse = out if with_lse else (out, torch.zeros(out.shape[:3]))
    check(out, lse, reference(torch.float64), reference(torch.float32), torch.float32)


COMPILE_FOR_HOPPER = r'''
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import attncc
from attncc.backends.portable.codegen import generate

variant = attncc.parse(sys.argv[1])
path = sys.argv[2]
open(path, "w").write(generate(variant).source)
spec = importlib.util.spec_from_file_location("decode_module", path)
module = importlib.util.module_from_spec(spec)
sys.modules["decode_module"] = module
spec.loader.exec_module(module)
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KNew": "*bf16", "VNew": "*bf16",
            "Out": "*bf16", "BT": "*i32", "SEQLENS": "*i32", "LSE": "*fp32",
            "PartOut": "*fp32", "PartLSE": "*fp32"}
DTYPES = {"f32": "*fp32", "i32": "*i32", "bool": "*i1"}
UNIT = {"stride_qd", "stride_kd", "stride_vd", "stride_knd", "stride_vnd", "stride_btn"}

def compile_for_sm90(fn, consts, stages):
    consts = dict(consts, **{n: 1 for n in fn.arg_names if n in UNIT})  # as the launcher does
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = POINTERS[n]
        elif n.endswith("_ptr"):  # an input x is in_x_ptr (attncc/codegen/elementwise.py)
            sig[n] = DTYPES[variant.input(n[len("in_"):-len("_ptr")]).dtype]
        else:
            sig[n] = "fp32" if n in ("sm_scale", "qk_scale") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=stages))
    return "async_copy_global_to_local" in compiled.asm["ttgir"]

for paged in (False, True):
    tiles = dict(BLOCK_M=16, PAGED=paged, PAGE_SIZE=64 if paged else 1, BLOCK_N=64, HEAD_DIM=128,
                 HEAD_DIM_PAD=128, HEAD_DIM_TAIL=0, HEAD_DIM_V=128, HEAD_DIM_V_PAD=128, V_IS_K=False,
                 DOT_PRECISION="tf32", WIDE=False)
    pipelined = compile_for_sm90(module.decode_split, dict(tiles, ONE_SPLIT=False, ROWS_BEFORE_START=False), 3)
    print("decode_split", "paged" if paged else "contiguous", "pipelined" if pipelined else "NOT PIPELINED")
    compile_for_sm90(module.decode_append, dict(PAGED=paged, PAGE_SIZE=tiles["PAGE_SIZE"], BLOCK_T=16,
                                                HEAD_DIM=128, HEAD_DIM_PAD=128, HEAD_DIM_V=128,
                                                HEAD_DIM_V_PAD=128, V_IS_K=False), 1)
compile_for_sm90(module.decode_merge, dict(HEAD_DIM=128, ROWS=4, D_BLOCK=64), 1)
print("compiled")
'''


@pytest.mark.slow
@pytest.mark.parametrize("spec", [ALIBI, NSA.replace("block 16", "block 64")], ids=["alibi", "nsa"])
def test_decode_kernels_compile_for_hopper_and_pipeline_their_loads(spec, tmp_path):
    # The interpreter runs kernels the compiler may refuse: compile them for sm_90 with the
    # installed Triton (no GPU needed), and check that K and V loads are pipelined
    # (asynchronous copies), which a branch or a loop in the key loop would prevent.
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.backends.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER, spec, str(tmp_path / "m.py")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled" in result.stdout and "NOT PIPELINED" not in result.stdout, result.stdout


# ------------------------------------------------------------------------- out-of-contract values
# Lengths and block-table entries live on the device: reading them to check them would be
# a host synchronisation per step. The kernels clamp them; decode_reference must read them
# the same way (a tensor's length to [0, capacity], a page index to [0, num_pages)). An int
# length is checked on the host: outside the cache, both refuse it.
CAP = 48
EDGES = (0, 1, CAP, CAP + 1, 2 ** 31 - 1, 2 ** 31, -1, 2 ** 40)
INT32 = [x for x in EDGES if -2 ** 31 <= x < 2 ** 31]


@pytest.mark.parametrize("n_q, append, page_size", [
    (1, False, None), pytest.param(3, True, None, marks=pytest.mark.slow), (3, True, 16),
    pytest.param(2, False, 16, marks=pytest.mark.slow)])
def test_tensor_lengths_at_the_int32_edges_match_the_reference(n_q, append, page_size):
    # One row per edge: negative, empty, one, full, one past the capacity, and 2**31 - 1,
    # which wrapped int32 when the new tokens were added to it.
    run_case(CAUSAL, n_q=n_q, seqlens=INT32, capacity=CAP, append=append,
             page_size=page_size, poison=False, seed=21)


@pytest.mark.parametrize("length", EDGES)
@pytest.mark.parametrize("n_new", [0, 2])
def test_int_lengths_at_the_edges_match_or_are_refused_by_both(length, n_new):
    # An int length either fits the cache with the new tokens (and matches the
    # reference) or is refused, with the same message, by kernel.decode and the reference.
    fits = 0 <= length <= CAP - n_new
    if fits and length not in (0, 1, CAP - n_new):
        pytest.skip("the fitting edges are 0, 1 and the capacity")
    variant = attncc.parse(CAUSAL)
    gen = torch.Generator().manual_seed(length % 1000 + n_new)
    q = randn(gen, 2, 4, 2, 16)
    k, v = randn(gen, 2, 2, CAP, 16), randn(gen, 2, 2, CAP, 16)
    new = dict(k_new=randn(gen, 2, 2, n_new, 16), v_new=randn(gen, 2, 2, n_new, 16)) if n_new else {}
    ref = lambda: decode_reference(variant, q.double(), k.double(), v.double(), cache_seqlens=length,
                                   return_lse=True, **{n: t.double() for n, t in new.items()})
    if not fits:
        with pytest.raises(CallError, match="cache_seqlens must be >= 0|do not fit the cache"):
            attncc.compile(variant).decode(q, k, v, cache_seqlens=length, **new)
        with pytest.raises(CallError, match="cache_seqlens must be >= 0|do not fit the cache"):
            ref()
        return
    expect = ref()
    out, lse = attncc.compile(variant).decode(q, k, v, cache_seqlens=length, return_lse=True, **new)
    torch.testing.assert_close(out.double(), expect[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), expect[1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_fuzz_lengths_at_the_int32_edges(seed):
    # Random calls built from the edges: per row a tensor length from INT32, or one int
    # from EDGES for every row; n_q and n_new from 0 to 5 (more queries than keys
    # included), contiguous or paged (pages of 16 or 24), GQA 6/2. Each call matches
    # decode_reference, or kernel.decode and the reference both raise a CallError.
    import random
    rnd = random.Random(seed)
    B, Hq, Hkv, D = rnd.randint(1, 4), 6, 2, 16
    n_q, n_new = rnd.randint(1, 5), rnd.choice([0, 1, 3, 5])
    page_size = rnd.choice([None, 16, 24])
    variant = attncc.parse(rnd.choice([CAUSAL, WINDOW_SINKS, ALIBI]))
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, B, Hq, n_q, D)
    k, v = randn(gen, B, Hkv, CAP, D), randn(gen, B, Hkv, CAP, D)
    table = None
    if page_size:
        k, table = to_paged(k, page_size, torch.Generator().manual_seed(seed))
        v, _ = to_paged(v, page_size, torch.Generator().manual_seed(seed))
    new = dict(k_new=randn(gen, B, Hkv, n_new, D), v_new=randn(gen, B, Hkv, n_new, D)) if n_new else {}
    inputs = make_inputs(variant, B, Hq, CAP, gen)
    if rnd.random() < 0.5:
        lens = rnd.choice(EDGES)
    else:
        lens = torch.tensor([rnd.choice(INT32) for _ in range(B)], dtype=torch.int32, device=DEVICE)
    try:
        ref = decode_reference(variant, q.double(), k.double(), v.double(), cache_seqlens=lens,
                               block_table=table, return_lse=True, **inputs,
                               **{n: t.double() for n, t in new.items()})
    except CallError as refused:
        with pytest.raises(CallError) as err:
            attncc.compile(variant).decode(q, k, v, cache_seqlens=lens, block_table=table, **new,
                                           **inputs)
        assert str(err.value) == str(refused)
        return
    out, lse = attncc.compile(variant).decode(q, k, v, cache_seqlens=lens, block_table=table,
                                              return_lse=True, **new, **inputs)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    torch.testing.assert_close(out.double(), ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref[1], rtol=1e-4, atol=1e-4)


def test_lengths_outside_int32_in_a_tensor_are_refused_by_dtype():
    # 2**31 and 2**40 fit no int32 tensor; an int64 one is refused by name.
    with pytest.raises(CallError, match="must be int32"):
        _call(cache_seqlens=torch.tensor([2 ** 31, 2 ** 40]))


@pytest.mark.parametrize("overrides, words", [
    (dict(k_new=torch.randn(2, 2, 33, 16), v_new=torch.randn(2, 2, 33, 16)), "cannot be appended"),
    (dict(cache_seqlens=2 ** 40), "do not fit the cache's 32 positions"),
])
def test_new_tokens_or_lengths_past_the_cache_are_refused(overrides, words):
    with pytest.raises(CallError) as err:
        _call(**overrides)
    assert words in str(err.value)


@pytest.mark.parametrize("append", [False, True])
def test_block_table_entries_out_of_range_read_as_the_kernels_clamp_them(append):
    # Entries below 0 read page 0 and entries past the last page read the last page, in
    # the kernels and in decode_reference (which raised IndexError or wrapped before).
    # With an append, no row reads a slot another row writes (clamped entries alias
    # pages: a row reading what another appends would read it before or after the write).
    variant = attncc.parse(CAUSAL)
    gen = torch.Generator().manual_seed(8)
    pages_k, pages_v = randn(gen, 5, 16, 2, 16), randn(gen, 5, 16, 2, 16)
    second = [3, 1, 2] if append else [3, -1, 2 ** 31 - 1]
    table = torch.tensor([[-7, 10 ** 6, 2 ** 31 - 1], second], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 40], dtype=torch.int32, device=DEVICE)
    q = randn(gen, 2, 4, 2, 16)
    new = {}
    if append:
        new = dict(k_new=randn(gen, 2, 2, 2, 16), v_new=randn(gen, 2, 2, 2, 16))
    ref = decode_reference(variant, q.double(), pages_k.double(), pages_v.double(), cache_seqlens=lens,
                           block_table=table, return_lse=True, **{n: t.double() for n, t in new.items()})
    out, lse = attncc.compile(variant).decode(q, pages_k, pages_v, cache_seqlens=lens, block_table=table,
                                              return_lse=True, **new)
    torch.testing.assert_close(out.double(), ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref[1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------- torch.compile
# kernel.decode is an operator (attncc/runtime/ops.py): a compiled generation loop traces
# a step as one node, with no graph break, and the in-place append survives
# functionalization. Compiled results equal eager ones bit for bit (the same kernels).
@pytest.mark.parametrize("page_size", [pytest.param(None, marks=pytest.mark.slow), 16])
def test_decode_under_torch_compile_fullgraph(page_size, backend="aot_eager"):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    kernel = attncc.compile(ALIBI)
    gen = torch.Generator().manual_seed(13)
    B, Hq, Hkv, cap, D = 2, 6, 2, 48, 16
    q = randn(gen, B, Hq, 2, 16)
    k, v = randn(gen, B, Hkv, cap, D), randn(gen, B, Hkv, cap, D)
    k_new, v_new = randn(gen, B, Hkv, 2, D), randn(gen, B, Hkv, 2, D)
    slopes = torch.rand(Hq, generator=gen).to(DEVICE)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)
    table = None
    if page_size:
        k, table = to_paged(k, page_size, torch.Generator().manual_seed(1))
        v, _ = to_paged(v, page_size, torch.Generator().manual_seed(1))

    def step(q, k, v, lens, k_new, v_new, slopes):
        out, lse = kernel.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                 block_table=table, return_lse=True, num_splits=2, slopes=slopes)
        return out * 2, lse, kernel.decode(q, k, v, cache_seqlens=7, block_table=table, slopes=slopes)

    k_eager, v_eager = k.clone(), v.clone()
    want = step(q, k_eager, v_eager, lens, k_new, v_new, slopes)
    counter = CompileCounterWithBackend(backend)
    got = torch.compile(step, backend=counter, fullgraph=True)(q, k, v, lens, k_new, v_new, slopes)
    assert counter.frame_count == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for cache, eager in ((k, k_eager), (v, v_eager)):  # the append happened, in place
        torch.testing.assert_close(cache, eager, rtol=0, atol=0, equal_nan=True)  # spare pages: NaN
    ref = decode_reference(kernel.variant, q.double(), k.double(), v.double(), cache_seqlens=lens + 2,
                           block_table=table, slopes=slopes.double(), return_lse=True)
    torch.testing.assert_close(got[0].double() / 2, ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].double(), ref[1], rtol=1e-4, atol=1e-4)


def test_decode_under_torch_compile_refuses_bad_calls_at_trace_time():
    import torch._dynamo
    torch._dynamo.reset()
    kernel = attncc.compile(CAUSAL)
    q, k = torch.randn(2, 4, 1, 16, device=DEVICE), torch.randn(2, 2, 32, 16, device=DEVICE)
    step = torch.compile(lambda q, k: kernel.decode(q, k, k, cache_seqlens=2 ** 40),
                         backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="do not fit the cache"):
        step(q, k)
