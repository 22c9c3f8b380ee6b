"""Packed variable-length sequences (attncc.varlen): each packed sequence gets what the
variant gives it alone, tiles joining two sequences are never visited, bad packings
are refused naming the argument.

The truth for a packed call is the float64 reference of the *original* variant run on
each sequence by itself, so a mistake in the rewrite fails here; dropout, whose bits
depend on packed positions, is checked against the reference of the packed call.
"""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import CallError
from attncc.runtime.packed import varlen_variant
from attncc.semantics.reference import scale_value
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def per_sequence(variant, q, k, v, cu_q, cu_k, inputs, axes):
    """attncc.reference of `variant` on each sequence alone, concatenated: out, lse."""
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i, ((q0, q1), (k0, k1)) in enumerate(zip(zip(bounds_q, bounds_q[1:]),
                                                  zip(bounds_k, bounds_k[1:]))):
        if q1 == q0:
            continue
        one = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0)  # (1, heads, len, dim)
        sliced = {}
        for name, t in inputs.items():
            axis = axes[name]
            sliced[name] = (t[q0:q1] if axis == "q" else t[k0:k1] if axis == "k"
                            else t[i:i + 1] if axis == "b" else t)
        # layout said: a one-token sequence has more heads than positions, and would be
        # refused as fitting both layouts.
        out, lse = attncc.reference(variant, one(q, q0, q1), one(k, k0, k1), one(v, k0, k1),
                                    return_lse=True, layout="bhsd", **sliced)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def check_packed(spec, lens_q, lens_k=None, *, H=2, Hkv=None, D=16, make_inputs=None, seed=0):
    """Kernel (fp32) against the float64 per-sequence reference, with the fp32 reference as
    the eager baseline (attncc/semantics/tolerance.py's rule), forward and backward."""
    variant = attncc.parse(spec)
    lens_k = lens_q if lens_k is None else lens_k
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    Tq, Tk, Hkv = sum(lens_q), sum(lens_k), Hkv or H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, H, D, generator=gen).to(DEVICE)
    k = torch.randn(Tk, Hkv, D, generator=gen).to(DEVICE)
    v = torch.randn(Tk, Hkv, D, generator=gen).to(DEVICE)
    do = torch.randn(Tq, H, D, generator=gen).to(DEVICE)
    inputs = make_inputs(gen, cu_q, cu_k) if make_inputs else {}
    axes = {d.name: d.axes[0] for d in variant.inputs}
    vk = attncc.varlen(variant)

    def run(fn, dtype):
        qkv = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*qkv, cu_q, cu_k, inputs)
        return [out, lse, *torch.autograd.grad(out, qkv, do.to(dtype))]

    got = run(lambda q, k, v, cq, ck, ins: vk(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                               return_lse=True, **ins), torch.float32)
    truth = lambda dtype: run(lambda q, k, v, cq, ck, ins: per_sequence(
        variant, q, k, v, cq, ck, ins, axes), dtype)
    ref, eager = truth(torch.float64), truth(torch.float32)
    scales = gradient_scales(q.transpose(0, 1), k.transpose(0, 1), ref[0].transpose(0, 1),
                             do.transpose(0, 1), scale_value(variant, D), H // Hkv)
    for name, g, r, e in zip(["out", "lse", "dq", "dk", "dv"], got, ref, eager):
        err, eager_err = max_abs_error(g, r), max_abs_error(e, r)
        assert within_tolerance(err, eager_err, torch.float32, r, scales.get(name, 1.0)), (
            f"{variant.name} {name}: kernel error {err:.3g} vs eager {eager_err:.3g}")
    return got


RAGGED = [5, 1, 0, 23, 9]  # lengths off the tile grid, a single token and an empty sequence


def sorted_ids(gen, n, high=3):
    return torch.sort(torch.randint(0, high, (n,), generator=gen)).values.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("spec, lens_k, heads, make_inputs", [
    ("attention causal { mask q >= k }", None, (2, 2), None),
    # flash-attn's convention with more keys than queries per sequence (and fewer).
    ("attention br { mask q + len_k - len_q >= k }", [7, 1, 4, 20, 3], (4, 2), None),
    ("attention window_alibi { input slopes: f32[h] mask q >= k and q - k < 6 "
     "score s + slopes[h] * (k - q) }", None, (3, 1),
     lambda gen, cq, ck: {"slopes": torch.rand(3, generator=gen).to(DEVICE)}),
    # Inputs on position axes are packed like q and k; on the batch axis, one per sequence.
    ("attention docs { input doc_q: i32[q] input doc_k: i32[k] input bias: f32[b, h] "
     "mask doc_q[q] == doc_k[k] and q >= k score s + bias[b, h] }", None, (2, 2),
     lambda gen, cq, ck: {"doc_q": (d := sorted_ids(gen, int(cq[-1]))), "doc_k": d,
                          "bias": torch.randn(len(RAGGED), 2, generator=gen).to(DEVICE)}),
    # A position input read at a computed index reads within the sequence.
    ("attention shifted { input w: f32[k] mask k <= q score s + w[min(k + 1, len_k - 1)] }",
     None, (2, 2),
     lambda gen, cq, ck: {"w": torch.randn(int(ck[-1]), generator=gen).to(DEVICE)}),
    ("attention softcap_full { score 5.0 * tanh(s / 5.0) }", [3, 2, 6, 11, 1], (2, 2), None),
    # A sink read at a computed index into a key-axis input: the rewrite read the
    # sequence's start at k, which a sink has not (a NameError inside the kernel).
    ("attention key_sink { input w: f32[k] mask q >= k sink w[min(q, len_k - 1)] }", None,
     (2, 2), lambda gen, cq, ck: {"w": 3.0 * torch.randn(int(ck[-1]), generator=gen).to(DEVICE)}),
], ids=["causal", "bottom_right_gqa", "window_alibi_mqa", "documents_and_batch_input",
        "computed_index", "softcap_len_q_ne_len_k", "sink_at_a_computed_key_index"])
def test_each_sequence_gets_what_the_variant_gives_it_alone(spec, lens_k, heads, make_inputs):
    H, Hkv = heads
    check_packed(spec, RAGGED, lens_k, H=H, Hkv=Hkv, make_inputs=make_inputs)


def test_sequences_with_no_keys_give_zero_rows_and_lse_minus_inf():
    out, lse, dq, *_ = check_packed("attention full { }", [4, 3, 5], [6, 0, 2])
    empty = slice(4, 7)  # the second sequence's queries
    assert torch.all(out[empty] == 0) and torch.all(lse[:, empty] == -math.inf)
    assert torch.all(dq[empty] == 0)


def test_rewrite_reads_positions_within_each_sequence():
    v = varlen_variant(attncc.parse(
        "attention t { input d: i32[q] input bias: f32[b, h] "
        "mask k <= q + len_k - len_q and d[k] == d[q] and q % 4 == 0 "
        "score s + bias[b, h] * (k - q) }"))
    text = str(v)
    # Linear in q and k: packed positions plus one per-sequence term (zero where the q and
    # k packings agree), so tiles are bounded as tightly as in a dense call.
    assert ("mask    varlen_seq_q[q] == varlen_seq_k[k] and (q - k + "
            "varlen_q_minus_start_q_plus_start_k_minus_len_q_plus_len_k[q] >= 0 and "
            "d[k + varlen_k_start_q_minus_start_k[k]] == d[q] and "
            "(q + varlen_q_minus_start_q[q]) % 4 == 0)\n") in text
    assert "score   s + bias[q, h] * (-q + k + varlen_q_start_q_minus_start_k[q])" in text
    assert "input   bias: f32[q, h]" in text


def test_dropout_matches_the_reference_of_the_packed_call():
    variant = attncc.parse("attention d { mask q >= k dropout 0.3 }")
    vk = attncc.varlen(variant)
    lens = [6, 1, 13]
    cu = cu_of(lens)
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(20, 2, 16, generator=gen).to(DEVICE) for _ in range(4))
    args = (cu, cu, 13, 13)

    def run(fn, dtype):
        qkv = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*qkv, *args, dropout_seed=7)
        return [out, *torch.autograd.grad(out, qkv, do.to(dtype))]

    got = run(vk, torch.float32)
    ref, eager = run(vk.reference, torch.float64), run(vk.reference, torch.float32)
    scales = gradient_scales(q, k, ref[0], do, 16 ** -0.5, 1)
    for name, g, r, e in zip(["out", "dq", "dk", "dv"], got, ref, eager):
        assert within_tolerance(max_abs_error(g, r), max_abs_error(e, r), torch.float32, r,
                                scales.get(name, 1.0)), name
    # The bits are the packed call's: the same seed on another packing draws other bits.
    assert not torch.equal(ref[0][:6], vk.reference(q.double(), k.double(), v.double(),
                                                     cu_of([6, 14]), cu_of([6, 14]), 14, 14,
                                                     dropout_seed=8)[:6])


def tile_sequences(cu, n_tiles, block, total):
    """Per tile: the first and the last sequence its positions belong to."""
    bounds = cu.tolist()
    seq_of = lambda pos: next(i for i in range(len(bounds) - 1) if bounds[i] <= pos < bounds[i + 1])
    return [(seq_of(t * block), seq_of(min(total, t * block + block) - 1)) for t in range(n_tiles)]


@pytest.mark.parametrize("lens_q, lens_k", [
    ([32, 16, 48, 16], None),  # sequences start on tile starts
    ([21, 7, 40, 12, 24], None),  # they do not
    ([21, 7, 40, 12, 24], [30, 2, 33, 19, 20]),  # the q and k packings differ
])
def test_tiles_joining_two_sequences_are_never_visited(lens_q, lens_k):
    block, H, D = 16, 2, 16
    vk = attncc.varlen("attention causal { mask q >= k }")
    lens_k = lens_k or lens_q
    cu_q, cu_k, Tq, Tk = cu_of(lens_q), cu_of(lens_k), sum(lens_q), sum(lens_k)
    q, k = torch.randn(Tq, H, D, device=DEVICE), torch.randn(Tk, H, D, device=DEVICE)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    # The expected fraction: tiles holding a pair of one sequence with in-sequence query
    # position >= key position.
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q)), torch.tensor(lens_q)).to(DEVICE)
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k)), torch.tensor(lens_k)).to(DEVICE)
    pos_q = torch.arange(Tq, device=DEVICE) - cu_q[:-1].long()[seq_q]
    pos_k = torch.arange(Tk, device=DEVICE) - cu_k[:-1].long()[seq_k]
    allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_q[:, None] >= pos_k[None, :])
    nq, nk = -(-Tq // block), -(-Tk // block)
    padded = torch.zeros(nq * block, nk * block, dtype=torch.bool, device=DEVICE)
    padded[:Tq, :Tk] = allowed
    expected = padded.view(nq, block, nk, block).any(3).any(1).float().mean().item()
    density = vk.density(q, k, k, *args, block=block)
    if lens_k is lens_q:
        # q - k + t[q] >= 0 with t = 0 everywhere: as tight as the dense classification.
        assert density == pytest.approx(expected)
    else:
        assert expected <= density <= 1.25 * expected
    # The kernels' own tables: no visited tile has all its queries in one sequence and all
    # its keys in another.
    _, _, _, bound = vk._bind(q, k, k, *args, {})
    tables = vk.kernel.module.tile_tables(1, H, Tq, Tk, 0, 0, D, bound, block, block, DEVICE)
    spans_q, spans_k = tile_sequences(cu_q, nq, block, Tq), tile_sequences(cu_k, nk, block, Tk)
    visited = 0
    for kind in ("full", "part"):
        counts, lists = tables[f"row_{kind}_count"], tables[f"row_{kind}_list"]
        for tq in range(nq):
            for tk in lists[0, 0, tq, :counts[0, 0, tq]].tolist():
                (q_first, q_last), (k_first, k_last) = spans_q[tq], spans_k[tk]
                assert q_first <= k_last and k_first <= q_last, (tq, tk)
                visited += 1
    assert visited == round(density * nq * nk)


def test_packed_tensors_are_read_in_place():
    vk = attncc.varlen("attention c { mask q >= k }")
    cu = cu_of([5, 9])
    q = torch.randn(14, 2, 16, device=DEVICE)
    seen = {}
    forward = vk.kernel.module.forward

    def spy(q4, k4, v4, *args, **kwargs):
        seen["q"] = q4
        return forward(q4, k4, v4, *args, **kwargs)

    vk.kernel.module.forward = spy
    try:
        out = vk(q, q, q, cu, cu, 9, 9)
    finally:
        vk.kernel.module.forward = forward
    assert seen["q"].data_ptr() == q.data_ptr() and seen["q"].shape == (1, 2, 14, 16)
    assert out.shape == (14, 2, 16) and out.is_contiguous()


# ---------------------------------------------------------------------- call errors
def _call(**changes):
    vk = attncc.varlen("attention c { mask q >= k }")
    q = torch.randn(10, 2, 16, device=DEVICE)
    args = dict(q=q, k=q, v=q, cu_seqlens_q=cu_of([4, 6]), cu_seqlens_k=cu_of([4, 6]),
                max_seqlen_q=6, max_seqlen_k=6)
    args.update(changes)
    return vk(**args)


int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("changes, match", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10], device=DEVICE)),
     r"cu_seqlens_q has dtype torch.int64; it must be torch.int32"),
    (dict(cu_seqlens_k=int32([[0, 4, 10]])), r"cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_q=int32([0, 7, 4, 10])),
     r"cu_seqlens_q must be non-decreasing .* entry 2 \(4\) is less than entry 1 \(7\)"),
    (dict(cu_seqlens_k=int32([2, 4, 10])), r"cu_seqlens_k must start at 0, got 2"),
    (dict(cu_seqlens_q=int32([0, 4, 9])), r"cu_seqlens_q ends at 9, but q has 10 tokens"),
    (dict(cu_seqlens_k=int32([0, 10]), max_seqlen_k=10),
     r"cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    (dict(max_seqlen_q=5),
     r"max_seqlen_q=5 is smaller than the longest sequence \(sequence 1 has 6 tokens\)"),
    (dict(max_seqlen_k=6.0), r"max_seqlen_k must be a non-negative int, got 6.0"),
    (dict(cu_seqlens_q=[0, 4, 10]), r"cu_seqlens_q must be a torch.Tensor"),
    (dict(q=torch.randn(1, 10, 2, 16)), r"q must have 3 dimensions \(total_q, heads, dim\)"),
    (dict(varlen_seq_q=int32([0] * 10)), r"'varlen_seq_q' is computed from cu_seqlens"),
    # A dense call's keywords: a bare TypeError, or a message about varlen's own inputs.
    (dict(layout="bshd"), r"a varlen call takes no layout=: q, k and v are \(total, heads, dim\)"),
    (dict(q_offset=4), r"a varlen call takes no q_offset=: positions count from each"),
])
def test_bad_packings_raise_call_errors_naming_the_argument(changes, match):
    with pytest.raises(CallError, match=match):
        _call(**changes)


def test_batch_inputs_need_one_entry_per_sequence():
    vk = attncc.varlen("attention b { input bias: f32[b, h] score s + bias[b, h] }")
    q = torch.randn(10, 2, 16, device=DEVICE)
    with pytest.raises(CallError, match=r"input 'bias' has 3 entries on its batch axis, but "
                                        r"cu_seqlens_q describes 2 sequences"):
        vk(q, q, q, cu_of([4, 6]), cu_of([4, 6]), 6, 6, bias=torch.zeros(3, 2, device=DEVICE))


@pytest.mark.parametrize("spec, match", [
    ("attention l { layout qb == kb block 16 }", r"has a layout \(block 16\).*blocks of the stream"),
    ("attention c { input varlen_x: f32[h] score s + varlen_x[h] }", r"declares 'varlen_x'"),
    ("attention r { input t: f32[b, h] score s + t[0, h] }", r"read at batch index `0`"),
    ("attention p { input t: f32[b, q] score s + t[b, q] }", r"input 't' has axes \[b, q\]"),
    ("attention hb { input t: f32[h, b] score s + t[h, b] }",
     r"input 't' has axes \[h, b\].*declare the batch axis first"),
])
def test_variants_that_cannot_run_packed_are_refused(spec, match):
    """(An input [h, b] was read as [h, q], its shape errors naming axes never declared.)"""
    with pytest.raises(CallError, match=match):
        attncc.varlen(spec)


def test_an_offset_past_int32_is_refused_not_wrapped():
    """A linear mask's per-sequence offset (coefficient x packed start) was cast to int32
    unchecked: it wrapped, outputs were off by 1 and every LSE -inf."""
    vk = attncc.varlen("attention big { mask 50000000 * k <= 49999999 * q + "
                       "50000000 * (len_k - len_q) }")
    q = torch.randn(30, 1, 16, device=DEVICE)
    k = torch.randn(170, 1, 16, device=DEVICE)
    with pytest.raises(CallError, match=r"per-sequence offset .* reaches \d+ at this packing, "
                                        r"past the int32"):
        vk(q, k, k, cu_of([10, 10, 10]), cu_of([60, 60, 50]), 10, 60)


def test_varlen_of_a_kernel_keeps_its_config_and_backend():
    """A pinned config crashed (a TileConfig passed where a dict is taken) and the
    backend fell back to auto, so backend="triton" could not be asked for packed calls."""
    config = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    kernel = attncc.compile("attention c { mask q >= k }", config=config, backend="triton")
    vk = attncc.varlen(kernel)
    assert vk.kernel.requested_backend == "triton"
    assert vk.kernel.pinned_config.as_dict() == config
    vk2 = attncc.varlen("attention c { mask q >= k }", config=config, backend="triton")
    assert vk2.kernel.requested_backend == "triton"
    with pytest.raises(CallError, match=r"varlen\(kernel\) takes the kernel's own config"):
        attncc.varlen(kernel, backend="triton")
    q = torch.randn(10, 2, 16, device=DEVICE)
    out = vk(q, q, q, cu_of([4, 6]), cu_of([4, 6]), 6, 6)
    ref = vk.reference(q.double(), q.double(), q.double(), cu_of([4, 6]), cu_of([4, 6]), 6, 6)
    assert max_abs_error(out, ref) < 1e-5
