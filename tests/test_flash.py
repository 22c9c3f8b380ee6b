"""attncc.flash against flash-attn's documented semantics.

The truth here is `flash_semantics`, written from flash-attn's docstrings
(flash_attn/flash_attn_interface.py) with torch ops, not from the variants attncc
generates, so a mistranslation of an option fails: bottom-right causal when
seqlen_q != seqlen_k, window_size=(left, right) meaning keys [i + seqlen_k - seqlen_q -
left, i + seqlen_k - seqlen_q + right] with -1 unbounded, softcap * tanh(s / softcap) of
the scaled score, ALiBi adding -slope * |i + seqlen_k - seqlen_q - j|, rows attending
to nothing giving 0.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import attncc
from attncc.errors import CallError
from attncc.flash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                          flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                          flash_attn_varlen_qkvpacked_func, variant_text)
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def flash_semantics(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, softmax_scale=None):
    """flash-attn's attention, densely: q (batch, seqlen_q, nheads, d), k and v (batch,
    seqlen_k, nheads_k, d). Returns out (batch, seqlen_q, nheads, d), lse (batch, nheads,
    seqlen_q) with -inf for rows that attend to nothing."""
    B, Sq, H, D = q.shape
    Sk, group = k.shape[1], H // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device).view(-1, 1)
    j = torch.arange(Sk, device=q.device).view(1, -1)
    diagonal = i + Sk - Sq  # query i's key-axis position, bottom-right aligned
    allowed = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= diagonal
    left, right = window_size
    if left >= 0:
        allowed &= j >= diagonal - left
    if right >= 0:
        allowed &= j <= diagonal + right
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype)
        slopes = slopes.view(1, H, 1, 1) if slopes.dim() == 1 else slopes.view(B, H, 1, 1)
        s = s - slopes * (diagonal - j).abs()
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(allowed, torch.exp(s - torch.where(allowed.any(-1, keepdim=True),
                                                        lse.unsqueeze(-1), 0)), 0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def assert_close(got, ref, eager, tensors, do, *, scale=None):
    """attncc/semantics/tolerance.py's rule on out, lse, dq, dk, dv (q, k, v in any layout with the
    head dim last)."""
    q, k, _ = tensors
    group = q.shape[-2] // k.shape[-2]
    scales = gradient_scales(q, k, ref[0], do, scale or q.shape[-1] ** -0.5, group)
    names = ["out", "lse", "dq", "dk", "dv"] if len(got) == 5 else ["out", "dq", "dk", "dv"]
    for name, g, r, e in zip(names, got, ref, eager, strict=True):
        err, eager_err = max_abs_error(g, r), max_abs_error(e, r)
        assert within_tolerance(err, eager_err, torch.float32, r, scales.get(name, 1.0)), (
            f"{name}: kernel error {err:.3g} vs eager {eager_err:.3g}")


def run(fn, tensors, do, dtype):
    """[out, lse, dq, dk, dv] of fn returning (out, lse), or [out, dq, dk, dv] of fn
    returning out."""
    leaves = [t.to(dtype).requires_grad_() for t in tensors]
    result = fn(*leaves)
    out, rest = (result[0], list(result[1:])) if isinstance(result, tuple) else (result, [])
    return [out, *rest, *torch.autograd.grad(out, leaves, do.to(dtype))]


CASES = {
    "causal_fewer_queries_gqa": dict(shape=(2, 9, 21, 4, 2), causal=True),
    "causal_more_queries_mqa": dict(shape=(1, 23, 7, 3, 1), causal=True),  # empty rows
    "window_both_sides": dict(shape=(2, 19, 26, 2, 2), window_size=(3, 2)),
    "causal_window_softcap_scale": dict(shape=(1, 33, 33, 2, 1), causal=True,
                                        window_size=(5, 7), softcap=2.5, softmax_scale=0.4),
    "alibi_per_head": dict(shape=(2, 17, 11, 2, 2), alibi="h"),
    "alibi_per_batch_causal_window": dict(shape=(2, 14, 20, 4, 2), alibi="bh", causal=True,
                                          window_size=(6, -1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attn_func_follows_flash_attns_semantics(case):
    opts = dict(CASES[case])
    B, Sq, Sk, H, Hkv = opts.pop("shape")
    D = 16
    gen = torch.Generator().manual_seed(len(case))
    q = torch.randn(B, Sq, H, D, generator=gen).to(DEVICE)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(B, Sq, H, D, generator=gen).to(DEVICE)
    alibi = opts.pop("alibi", None)
    if alibi:
        opts["alibi_slopes"] = torch.rand((H,) if alibi == "h" else (B, H), generator=gen).to(DEVICE)

    def kernel(q, k, v):
        out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **opts)
        assert probs is None
        return out, lse

    got = run(kernel, (q, k, v), do, torch.float32)
    truth = lambda q, k, v: flash_semantics(q, k, v, **opts)
    ref, eager = run(truth, (q, k, v), do, torch.float64), run(truth, (q, k, v), do, torch.float32)
    assert_close(got, ref, eager, (q, k, v), do, scale=opts.get("softmax_scale"))
    assert got[0].shape == (B, Sq, H, D) and got[0].is_contiguous()


def test_dropout_matches_the_reference_of_the_generated_variant():
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(2, 13, 2, 16, generator=gen).to(DEVICE) for _ in range(4))
    variant = attncc.parse(variant_text(causal=True, dropout_p=0.25))

    def kernel(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.25, causal=True, dropout_seed=5)

    def reference(q, k, v):
        return attncc.reference(variant, q.transpose(1, 2), k.transpose(1, 2),
                                v.transpose(1, 2), dropout_seed=5).transpose(1, 2)

    got = run(kernel, (q, k, v), do, torch.float32)
    ref = run(reference, (q, k, v), do, torch.float64)
    eager = run(reference, (q, k, v), do, torch.float32)
    assert_close(got, ref, eager, (q, k, v), do)
    # Dropout is on: without it the output differs.
    no_dropout = flash_semantics(q.double(), k.double(), v.double(), causal=True)[0]
    assert max_abs_error(got[0], no_dropout) > 0.05


def packed(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def test_varlen_follows_flash_attns_semantics_per_sequence():
    # Ragged, a one-token sequence, an empty one, more keys than queries and fewer.
    lens_q, lens_k = [6, 1, 0, 19, 8], [9, 4, 3, 19, 5]
    opts = dict(causal=True, window_size=(4, -1), softcap=3.0)
    H, Hkv, D = 4, 2, 16
    gen = torch.Generator().manual_seed(2)
    slopes = torch.rand(len(lens_q), H, generator=gen).to(DEVICE)
    q = torch.randn(sum(lens_q), H, D, generator=gen).to(DEVICE)
    k, v = (torch.randn(sum(lens_k), Hkv, D, generator=gen).to(DEVICE) for _ in range(2))
    do = torch.randn(sum(lens_q), H, D, generator=gen).to(DEVICE)
    cu_q, cu_k = packed(lens_q), packed(lens_k)

    def kernel(q, k, v):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             alibi_slopes=slopes, return_attn_probs=True, **opts)
        return out, lse

    def truth(q, k, v):  # each sequence alone, as a batch of one
        outs, lses = [], []
        bq, bk = cu_q.tolist(), cu_k.tolist()
        for i in range(len(lens_q)):
            if lens_q[i] == 0:
                continue
            out, lse = flash_semantics(q[bq[i]:bq[i + 1]][None], k[bk[i]:bk[i + 1]][None],
                                       v[bk[i]:bk[i + 1]][None], alibi_slopes=slopes[i], **opts)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    got = run(kernel, (q, k, v), do, torch.float32)
    ref, eager = run(truth, (q, k, v), do, torch.float64), run(truth, (q, k, v), do, torch.float32)
    assert_close(got, ref, eager, (q, k, v), do)
    assert got[0].shape == (sum(lens_q), H, D) and got[1].shape == (H, sum(lens_q))


def test_varlen_dropout_matches_the_packed_reference():
    lens = [5, 1, 12]
    cu = packed(lens)
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(18, 2, 16, generator=gen).to(DEVICE) for _ in range(4))
    vk = attncc.varlen(variant_text(causal=True, dropout_p=0.2))

    def kernel(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, dropout_p=0.2, causal=True,
                                      dropout_seed=9)

    reference = lambda q, k, v: vk.reference(q, k, v, cu, cu, 12, 12, dropout_seed=9)
    got = run(kernel, (q, k, v), do, torch.float32)
    ref = run(reference, (q, k, v), do, torch.float64)
    eager = run(reference, (q, k, v), do, torch.float32)
    assert_close(got, ref, eager, (q, k, v), do)


def test_no_copy_of_q_k_v_and_one_compile_per_combination(monkeypatch):
    q = torch.randn(2, 11, 4, 16, device=DEVICE)
    k = torch.randn(2, 11, 2, 16, device=DEVICE)
    flash_attn_func(q, k, k, causal=True, window_size=(3, -1))
    kernel = attncc.flash.kernel_for(causal=True, window_size=(3, -1))
    seen = []
    forward = kernel.module.forward
    def spy(q4, k4, v4, *args, **kwargs):
        seen.append((q4, k4))
        return forward(q4, k4, v4, *args, **kwargs)

    monkeypatch.setattr(kernel.module, "forward", spy)
    n_compiled = len(attncc.flash._KERNELS)
    out = flash_attn_func(q, k, k, causal=True, window_size=(3, -7))  # negative = unbounded
    assert len(attncc.flash._KERNELS) == n_compiled  # the same combination: no new kernel
    (q4, k4), = seen
    assert q4.data_ptr() == q.data_ptr() and q4.stride() == q.transpose(1, 2).stride()
    assert k4.data_ptr() == k.data_ptr() and k4.stride() == k.transpose(1, 2).stride()
    assert out.is_contiguous() and out.shape == q.shape
    flash_attn_func(q, k, k, causal=True, window_size=(4, -1))
    assert len(attncc.flash._KERNELS) == n_compiled + 1  # another window: compiled once more


def _q(*shape):
    return torch.randn(*shape, device=DEVICE)


@pytest.mark.parametrize("call, match", [
    (lambda: flash_attn_func(_q(2, 4, 16), _q(2, 4, 16), _q(2, 4, 16)),
     r"q must have 4 dimensions \(batch, seqlen_q, nheads, headdim\)"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16), window_size=3),
     r"window_size must be a pair of integers"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16), dropout_p=1.0),
     r"dropout_p must be a probability in \[0, 1\)"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16),
                             softcap=float("nan")), r"softcap must be a finite number"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16),
                             alibi_slopes=_q(2).double()),
     r"input 'alibi_slopes' has dtype torch.float64"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16),
                             alibi_slopes=_q(1, 2, 3)),
     r"alibi_slopes must be a float32 tensor of shape"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 5, 2, 16), _q(1, 4, 2, 16)),
     r"k and v must have the same shape \(batch, seqlen_k, nheads_k\) but for the headdim"),
    (lambda: flash_attn_func(_q(2, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16)),
     r"q and k must have the same batch size"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 32), _q(1, 4, 2, 32)),
     r"q and k must have the same headdim"),
    (lambda: flash_attn_varlen_func(_q(4, 4, 16), _q(4, 3, 16), _q(4, 3, 16), packed([4]),
                                    packed([4]), 4, 4), r"nheads \(4\) must be a multiple of nheads_k \(3\)"),
    (lambda: flash_attn_func(_q(1, 4, 2, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16),
                             alibi_slopes=_q(3)), r"alibi_slopes must have shape \(nheads,\)"),
    (lambda: flash_attn_func(_q(1, 4, 3, 16), _q(1, 4, 2, 16), _q(1, 4, 2, 16)),
     r"nheads \(3\) must be a multiple of nheads_k \(2\)"),
    (lambda: flash_attn_varlen_func(_q(4, 2, 16), _q(4, 2, 16), _q(4, 2, 16), packed([4]),
                                    packed([4]), 4, 4, block_table=torch.zeros(1, 1)),
     r"block_table \(paged KV cache\) is not supported"),
    (lambda: flash_attn_varlen_func(_q(1, 4, 2, 16), _q(4, 2, 16), _q(4, 2, 16), packed([4]),
                                    packed([4]), 4, 4), r"q must have 3 dimensions \(total_q"),
    (lambda: flash_attn_varlen_func(_q(4, 2, 16), _q(4, 2, 16), _q(4, 2, 16), packed([4]),
                                    packed([4]).long(), 4, 4), r"cu_seqlens_k has dtype torch.int64"),
])
def test_bad_calls_raise_call_errors_naming_the_argument(call, match):
    with pytest.raises(CallError, match=match) as error:
        call()
    assert "layout" not in str(error.value)  # flash-attn has no such argument


# ---------------------------------------------------------------- packed q/k/v forms

def varlen_semantics(q, k, v, cu_q, cu_k, alibi_slopes=None, **opts):
    """flash_semantics on each packed sequence alone: out (total_q, nheads, d), lse
    (nheads, total_q)."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i] == bq[i + 1]:
            continue  # an empty sequence: no rows
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i]
        out, lse = flash_semantics(q[bq[i]:bq[i + 1]][None], k[bk[i]:bk[i + 1]][None],
                                   v[bk[i]:bk[i + 1]][None], alibi_slopes=slopes, **opts)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def run_packed(fn, leaves, splits, do, dtype):
    """[out, lse, dq, dk, dv] of fn on packed leaves: each leaf's gradient (one tensor,
    as flash-attn returns it) is split along its packing axis (None: not packed)."""
    leaves = [t.to(dtype).requires_grad_() for t in leaves]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    split = [g for g, axis in zip(grads, splits) for g in (g.unbind(axis) if axis is not None else [g])]
    return [out, lse, *split]


PACKED = {  # form: (shape (B, Sq, Sk, H, Hkv), options)
    "qkvpacked": ((2, 13, 13, 3, 3), dict(causal=True, window_size=(4, 2), softcap=2.0)),
    "kvpacked": ((2, 9, 21, 6, 2), dict(causal=True, alibi="bh")),
    "varlen_qkvpacked": (([5, 1, 0, 11], [5, 1, 0, 11], 3, 3), dict(causal=True, alibi="h",
                                                                      window_size=(3, -1))),
    "varlen_kvpacked": (([6, 1, 19], [9, 4, 7], 4, 2), dict(causal=True, softcap=3.0,
                                                           alibi="bh")),
}


@pytest.mark.parametrize("form", list(PACKED))
def test_packed_forms_follow_flash_attns_semantics_and_gradients_reach_the_packed_tensor(form):
    shape, opts = PACKED[form]
    opts = dict(opts)
    gen = torch.Generator().manual_seed(len(form))
    rand = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)
    D, alibi = 16, opts.pop("alibi", None)
    if form.startswith("varlen"):
        lens_q, lens_k, H, Hkv = shape
        B, total_q, total_k = len(lens_q), sum(lens_q), sum(lens_k)
        cu_q, cu_k = packed(lens_q), packed(lens_k)
        if alibi:
            opts["alibi_slopes"] = torch.rand((H,) if alibi == "h" else (B, H), generator=gen).to(DEVICE)
        do = rand(total_q, H, D)
        truth = lambda q, k, v: varlen_semantics(q, k, v, cu_q, cu_k, **opts)
        if form == "varlen_qkvpacked":
            leaves, splits = [rand(total_q, 3, H, D)], [1]
            call = lambda qkv: flash_attn_varlen_qkvpacked_func(
                qkv, cu_q, max(lens_q), return_attn_probs=True, **opts)[:2]
            reference = lambda qkv: truth(*qkv.unbind(1))
        else:
            leaves, splits = [rand(total_q, H, D), rand(total_k, 2, Hkv, D)], [None, 1]
            call = lambda q, kv: flash_attn_varlen_kvpacked_func(
                q, kv, cu_q, cu_k, max(lens_q), max(lens_k), return_attn_probs=True, **opts)[:2]
            reference = lambda q, kv: truth(q, *kv.unbind(1))
    else:
        B, Sq, Sk, H, Hkv = shape
        if alibi:
            opts["alibi_slopes"] = torch.rand((H,) if alibi == "h" else (B, H), generator=gen).to(DEVICE)
        do = rand(B, Sq, H, D)
        truth = lambda q, k, v: flash_semantics(q, k, v, **opts)
        if form == "qkvpacked":
            leaves, splits = [rand(B, Sq, 3, H, D)], [2]
            call = lambda qkv: flash_attn_qkvpacked_func(qkv, return_attn_probs=True, **opts)[:2]
            reference = lambda qkv: truth(*qkv.unbind(2))
        else:
            leaves, splits = [rand(B, Sq, H, D), rand(B, Sk, 2, Hkv, D)], [None, 2]
            call = lambda q, kv: flash_attn_kvpacked_func(q, kv, return_attn_probs=True, **opts)[:2]
            reference = lambda q, kv: truth(q, *kv.unbind(2))
    got = run_packed(call, leaves, splits, do, torch.float32)
    ref = run_packed(reference, leaves, splits, do, torch.float64)
    eager = run_packed(reference, leaves, splits, do, torch.float32)
    assert_close(got, ref, eager, tuple(ref[2:5]), do)


def test_packed_forms_refuse_a_wrong_packing_in_flash_attns_terms():
    with pytest.raises(CallError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\)"):
        flash_attn_qkvpacked_func(_q(1, 4, 2, 2, 16))
    with pytest.raises(CallError, match=r"kv must have 4 dimensions \(total_k, 2, nheads_k"):
        flash_attn_varlen_kvpacked_func(_q(4, 2, 16), _q(4, 2, 16), packed([4]), packed([4]), 4, 4)


# ---------------------------------------------------------------- argument conventions

def test_window_size_takes_every_integer_like_flash_attn_takes():
    gen = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 10, 2, 16, generator=gen).to(DEVICE) for _ in range(2))
    want = flash_attn_func(q, k, k, window_size=(3, 2))
    for window in [[3, 2], (np.int64(3), np.int32(2)), (torch.tensor(3), torch.tensor(2)),
                   torch.tensor([3, 2]), np.array([3, 2])]:  # flash-attn's tests: torch.randint
        assert torch.equal(flash_attn_func(q, k, k, window_size=window), want), window
    for bad in [(3.0, 2), (True, 2), (3, torch.tensor(2.0)), (3, np.float32(2)),
                3, (1, 2, 3)]:
        with pytest.raises(CallError, match=r"window_size(\[\d\])? must be a"):
            flash_attn_func(q, k, k, window_size=bad)


def test_a_window_side_reaching_seqlen_k_is_unbounded():
    # More queries than keys: a right side written as >= seqlen_k would still cut the
    # first rows' keys if taken literally; flash-attn takes it as unbounded. 2**63 - 1
    # (a common "infinite") must not reach the generated text.
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 23, 2, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 7, 1, 16, generator=gen).to(DEVICE) for _ in range(2))
    unbounded = flash_semantics(q.double(), k.double(), v.double())[0]
    left_only = flash_semantics(q.double(), k.double(), v.double(), window_size=(2, -1))[0]
    for window, want in [((-1, 7), unbounded), ((7, 2 ** 63 - 1), unbounded),
                         ((2, 7), left_only)]:
        torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window).double(), want,
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"{window}: {m}")
    # varlen: the bound is max_seqlen_k
    cu_q, cu_k = packed([23]), packed([7])
    got = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 23, 7, window_size=(2 ** 63 - 1, 7))
    torch.testing.assert_close(got.double(), unbounded[0], rtol=1e-5, atol=1e-5)


def test_varlen_lengths_are_checked_before_the_window_reads_them():
    """With a window, max_seqlen_k=None gave a bare TypeError (the window compared with it
    first); a 0-d cu_seqlens_q an IndexError."""
    q = torch.randn(10, 2, 16, device=DEVICE)
    cu = packed([4, 6])
    for max_k, words in ((None, "got None"), ("6", "got '6'"), (-1, "got -1")):
        with pytest.raises(CallError, match=f"max_seqlen_k must be a non-negative int, {words}"):
            flash_attn_varlen_func(q, q, q, cu, cu, 6, max_k, window_size=(4, 4))
    with pytest.raises(CallError, match=r"cu_seqlens_q must be a 1-D int32 tensor .* shape \(\)"):
        flash_attn_varlen_func(q, q, q, cu[1], cu, 6, 6, alibi_slopes=torch.rand(2, device=DEVICE))


def test_alibi_slopes_that_require_grad_are_read_detached_as_in_flash_attn():
    gen = torch.Generator().manual_seed(8)
    q, k = (torch.randn(2, 9, 2, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    slopes = torch.nn.Parameter(torch.rand(2, generator=gen).to(DEVICE))
    out = flash_attn_func(q, k, k, causal=True, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is None and q.grad is not None
    assert torch.equal(out, flash_attn_func(q, k, k, causal=True, alibi_slopes=slopes.detach()))


def test_return_attn_probs_with_dropout_is_refused():
    q = _q(1, 4, 2, 16)
    with pytest.raises(CallError, match=r"return_attn_probs=True with dropout_p > 0"):
        flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(CallError, match=r"return_attn_probs=True with dropout_p > 0"):
        flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), dropout_p=0.1, return_attn_probs=True)


def test_head_dims_are_named_in_flash_attns_shapes():
    """The kernels' message named the (batch, heads, seq, dim) view: (1, 2, 9, 8) for a q of
    (1, 9, 2, 8), and a batch of 1 the varlen call never had."""
    cu = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    for call, shape in ((lambda t: flash_attn_func(t, t, t), (1, 9, 2, 8)),
                        (lambda t: flash_attn_varlen_func(t, t, t, cu, cu, 9, 9), (9, 2, 8))):
        with pytest.raises(CallError, match=re.escape(f"headdim 8 is not supported (q {shape})")):
            call(torch.randn(*shape, device=DEVICE))


@pytest.mark.parametrize("options, words", [
    (dict(softmax_scale=1e-46), r"softmax_scale=1e-46 is below float32's range.*pass 0.0"),
    (dict(softcap=1e300), r"softcap=1e\+300 is beyond float32's range"),
    (dict(softcap=1e-300), r"softcap=1e-300 is below float32's range.*pass 0.0, which turns it off"),
])
def test_options_past_float32_are_refused_in_flash_attns_terms(options, words):
    """A scale of 1e-46 gave NaN rows without an error; a softcap of 1e300 a SpecError
    quoting a variant the caller never wrote."""
    q = _q(1, 4, 2, 16)
    with pytest.raises(CallError, match=words):
        flash_attn_func(q, q, q, **options)


# ---------------------------------------------------------------- torch.compile

def compiled_equals_eager(attend, dynamic, calls):
    """attend compiled whole (aot_eager, as tests/test_compile.py) gives eager's outputs
    and gradients bit for bit on each call (q, kv, softcap, left); with dynamic=True a
    new sequence length (same options) does not recompile."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(9)
    previous = None
    for L, left in calls:
        q = torch.randn(2, L, 6, 16, generator=gen).to(DEVICE).requires_grad_()
        kv = torch.randn(2, L + 3, 2, 2, 16, generator=gen).to(DEVICE).requires_grad_()
        do = torch.randn(2, L, 6, 16, generator=gen).to(DEVICE)
        results = []
        for fn in (compiled, attend):
            out = fn(q, kv, 2.5, left)
            results.append([out, *torch.autograd.grad(out, (q, kv), do)])
        for got, want in zip(*results, strict=True):
            assert torch.equal(got, want)
        if dynamic and previous is not None and previous[1] == left:
            assert counter.frame_count == previous[2], "a new sequence length recompiled"
        previous = (L, left, counter.frame_count)
    torch._dynamo.reset()


SLOPES = torch.rand(2, 6, generator=torch.Generator().manual_seed(10)).to(DEVICE)


@pytest.mark.slow  # 12 s under the interpreter: the CI budget
def test_flash_attn_func_under_torch_compile_with_symbolic_options():
    # softcap and the window side are arguments, symbolic under dynamic=True: each picks
    # the variant, so each is specialised; GQA, causal and ALiBi too.
    def attend(q, kv, softcap, left):
        return flash_attn_func(q, *kv.unbind(2), causal=True, window_size=(left, -1),
                               softcap=softcap, alibi_slopes=SLOPES)
    compiled_equals_eager(attend, True, [(11, 3), (14, 3)])


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [True, False])
def test_packed_entry_points_under_torch_compile(dynamic):
    def attend(q, kv, softcap, left):
        qkv = torch.stack([q[:, :, :2], q[:, :, 2:4], q[:, :, 4:]], 2)
        return flash_attn_kvpacked_func(q, kv, window_size=[left, 1], alibi_slopes=SLOPES) \
            + flash_attn_qkvpacked_func(qkv, softcap=softcap, causal=True).repeat(1, 1, 3, 1)
    compiled_equals_eager(attend, dynamic, [(11, 3), (14, 3), (14, 5)])
