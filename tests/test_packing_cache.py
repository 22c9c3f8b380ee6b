"""The packing cache of varlen calls (attncc/runtime/packed.py): every call runs the
packing its cu_seqlens tensors hold at the call, however they were written since the
last call (through a numpy view, `.data`, `copy_`, the storage, another tensor over the
same memory), and kept packings (`attncc.varlen_packing`, `packing=`) are refused when a
write PyTorch sees changed their tensors.

The truth is an independent dense float64 formula of packed attention (each query
attends the keys of its own sequence, bottom-right causal), written here from the cu
values, not attncc.reference.
"""
from __future__ import annotations

import math

import numpy
import pytest
import torch

import attncc
from attncc.errors import CallError
from attncc.flash import flash_attn_varlen_func
from attncc.runtime import packed
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAUSAL = "attention c { mask q + len_k - len_q >= k }"  # bottom-right, as flash-attn's


def cu_of(lengths) -> list:
    return [0, *numpy.cumsum(lengths, dtype=numpy.int64).tolist()]


def dense_packed(q, k, v, cu_q: list, cu_k: list, causal: bool):
    """Packed attention from the definition: out (total_q, heads, dim), LSE (heads,
    total_q); a query that sees no key gives 0 and LSE -inf. Differentiable, in the
    leaves' dtype, when q requires grad; else in float64 on detached copies."""
    if not q.requires_grad:
        q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    H, D = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(H // t.shape[1], 1) for t in (k, v))
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        # Bottom-right causal: query i sees keys j <= i + len_k - len_q, so the first
        # len_q - len_k queries see none (all of them when there is no key).
        blind = q1 - q0 if k1 == k0 else (max(0, (q1 - q0) - (k1 - k0)) if causal else 0)
        blind = min(blind, q1 - q0)
        outs.append(q.new_zeros(blind, H, D))
        lses.append(q.new_full((H, blind), -math.inf))
        seeing = q[q0 + blind:q1]
        if seeing.shape[0] == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", seeing, k[k0:k1]) * D ** -0.5
        if causal:
            i = torch.arange(blind, q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            scores = scores.masked_fill(torch.arange(k1 - k0)[None, :] > i, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v[k0:k1]))
        lses.append(torch.logsumexp(scores, -1))
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros(H, 0)
    if q.requires_grad and not out.requires_grad:  # no query sees a key: zero gradients
        out = out + 0 * q
    return out, lse


def assert_matches(out, lse, truth):
    """fp32 kernel against the float64 formula (NaN anywhere fails)."""
    ref_out, ref_lse = truth
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=2e-4, atol=2e-4)


# Ways of giving a cu_seqlens tensor new values; each returns the tensor to pass next
# (the same one, or another over the same memory).
def _numpy_view(cu, values):
    cu.numpy()[:] = values
    return cu


def _data(cu, values):
    cu.data[:] = torch.tensor(values, dtype=torch.int32)
    return cu


def _copy(cu, values):
    cu.copy_(torch.tensor(values, dtype=torch.int32))
    return cu


def _storage(cu, values):
    cu.untyped_storage().copy_(torch.tensor(values, dtype=torch.int32).untyped_storage())
    return cu


def _same_address_new_tensor(cu, values):
    # Another tensor over the same memory: the same data_ptr and a fresh version counter.
    memory = cu.numpy()
    memory[:] = values
    return torch.from_numpy(memory)


MUTATIONS = {"numpy_view": _numpy_view, "data": _data, "copy_": _copy,
             "storage": _storage, "same_address_new_tensor": _same_address_new_tensor}


def cpu_int32(values):
    # Host tensors: the writes above go through numpy, which a CUDA tensor has no view
    # for; the cache reads a GPU tensor's values the same way.
    return torch.tensor(values, dtype=torch.int32)


def qkv(total_q, total_k, H=2, Hkv=1, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n, h: (torch.randn(n, h, D, generator=gen) * 2).to(DEVICE)
    return make(total_q, H), make(total_k, Hkv), make(total_k, Hkv)


@pytest.mark.skipif(DEVICE != "cpu", reason="writes through numpy views need host tensors")
# Every way on the varlen kernel; flash_attn_varlen_func shares its cache, so it is
# checked with the two the issue names.
@pytest.mark.parametrize("mutation, entry", [
    *((m, "varlen") for m in MUTATIONS), ("numpy_view", "flash"), ("data", "flash")])
def test_a_call_runs_the_packing_its_tensors_hold_now(mutation, entry):
    """The issue's repro: the same max_seqlen, cu written between two calls."""
    before_q, after_q = [0, 5, 9, 13], [0, 3, 3, 13]  # after: an empty sequence too
    before_k, after_k = [0, 2, 11, 13], [0, 7, 8, 13]
    q, k, v = qkv(13, 13)
    cu_q, cu_k = cpu_int32(before_q), cpu_int32(before_k)
    vk = attncc.varlen(CAUSAL)

    def call(cu_q, cu_k):
        if entry == "varlen":
            return vk(q, k, v, cu_q, cu_k, 13, 13, return_lse=True)
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 13, causal=True,
                                             return_attn_probs=True)
        return out, lse

    assert_matches(*call(cu_q, cu_k), dense_packed(q, k, v, before_q, before_k, True))
    cu_q = MUTATIONS[mutation](cu_q, after_q)
    assert_matches(*call(cu_q, cu_k), dense_packed(q, k, v, after_q, before_k, True))
    cu_k = MUTATIONS[mutation](cu_k, after_k)
    assert_matches(*call(cu_q, cu_k), dense_packed(q, k, v, after_q, after_k, True))
    # And back: a packing seen before is found again, by its values.
    cu_q = MUTATIONS[mutation](cu_q, before_q)
    cu_k = MUTATIONS[mutation](cu_k, before_k)
    assert_matches(*call(cu_q, cu_k), dense_packed(q, k, v, before_q, before_k, True))


@pytest.mark.skipif(DEVICE != "cpu", reason="writes through numpy views need host tensors")
def test_values_written_behind_the_version_counter_are_checked_again():
    vk = attncc.varlen(CAUSAL)
    q, k, v = qkv(10, 10)
    cu = cpu_int32([0, 4, 10])
    vk(q, k, v, cu, cu, 6, 6)
    cu.numpy()[1] = 11
    with pytest.raises(CallError, match=r"cu_seqlens_q must be non-decreasing"):
        vk(q, k, v, cu, cu, 6, 6)
    cu.numpy()[1] = 1  # valid, but its second sequence (9 tokens) exceeds max_seqlen
    with pytest.raises(CallError, match=r"max_seqlen_q=6 is smaller than the longest sequence "
                                        r"\(sequence 1 has 9 tokens\)"):
        vk(q, k, v, cu, cu, 6, 6)


def test_one_packing_serves_every_call_with_the_same_values():
    """Keyed by values: new tensors with the same lengths (a new step of a model) reuse
    the per-position tensors, so the kernels' tile tables are reused too."""
    vk = attncc.varlen(CAUSAL)
    q, k, v = qkv(12, 12)
    seen = []
    bind = vk._bind

    def spy(*args, **kwargs):
        result = bind(*args, **kwargs)
        seen.append(result[3]["varlen_seq_q"])
        return result

    vk._bind = spy
    for lengths in ([5, 7], [5, 7], [7, 5]):
        cu = torch.tensor(cu_of(lengths), dtype=torch.int32, device=DEVICE)
        assert_matches(*vk(q, k, v, cu, cu, 7, 7, return_lse=True),
                       dense_packed(q, k, v, cu_of(lengths), cu_of(lengths), True))
    assert seen[0] is seen[1] and seen[2] is not seen[0]


# ------------------------------------------------------------------ kept packings
def test_a_kept_packing_reads_no_values_and_gives_the_same_result(monkeypatch):
    lens_q, lens_k = [6, 0, 9, 1], [3, 4, 12, 2]
    cu_q, cu_k = (torch.tensor(cu_of(x), dtype=torch.int32, device=DEVICE)
                  for x in (lens_q, lens_k))
    q, k, v = qkv(16, 21, H=3, Hkv=3)
    kept = attncc.varlen_packing(cu_q, cu_k, 9, 12)
    assert "4 sequences" in repr(kept)

    def no_read(*args):
        raise AssertionError("a call given packing= read cu_seqlens")

    monkeypatch.setattr(packed, "read_cu_seqlens", no_read)
    truth = dense_packed(q, k, v, cu_of(lens_q), cu_of(lens_k), True)
    vk = attncc.varlen(CAUSAL)
    assert_matches(*vk(q, k, v, cu_q, cu_k, 9, 12, packing=kept, return_lse=True), truth)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 12, causal=True,
                                         return_attn_probs=True, packing=kept)
    assert_matches(out, lse, truth)


def _kept_call(**changes):
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    q, k, v = qkv(10, 10)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                max_seqlen_k=6)
    args["packing"] = attncc.varlen_packing(cu, cu, 6, 6)
    for name, change in changes.items():
        args[name] = change(args[name])
    return attncc.varlen(CAUSAL)(**args)


@pytest.mark.parametrize("changes, match", [
    (dict(cu_seqlens_q=lambda cu: cu.add_(0)),
     r"built from cu_seqlens_q as it was then, but it was written in place since"),
    (dict(cu_seqlens_k=lambda cu: cu.clone()),
     r"built from cu_seqlens_k as it was then, but this call passes another cu_seqlens_k"),
    (dict(max_seqlen_k=lambda m: 5), r"max_seqlen_k=5 is smaller than the longest sequence"),
    (dict(q=lambda q: q[:9]), r"cu_seqlens_q ends at 10, but q has 9 tokens"),
    (dict(packing=lambda p: p.packing), r"packing must come from attncc.varlen_packing"),
], ids=["written", "another_tensor", "max_seqlen", "total", "not_kept"])
def test_kept_packings_refuse_calls_they_do_not_describe(changes, match):
    with pytest.raises(CallError, match=match):
        _kept_call(**changes)


def test_kept_packings_check_their_values_when_built():
    cu = torch.tensor([0, 7, 4, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(CallError, match=r"cu_seqlens_q must be non-decreasing"):
        attncc.varlen_packing(cu, cu, 10, 10)
    good = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(CallError, match=r"max_seqlen_k=3 is smaller than the longest"):
        attncc.varlen_packing(good, good, 6, 3)


def test_inputs_named_like_packed_call_arguments_are_refused():
    # The front end reads the reserved names from the calls' signatures: packing= too.
    with pytest.raises(attncc.SpecError, match=r"an input cannot be named 'packing': a varlen "
                                               r"kernel's call already takes packing="):
        attncc.varlen("attention p { input packing: f32[h] score s + packing[h] }")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_needs_a_kept_packing():
    cu = torch.tensor([0, 300, 301, 700], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(700, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    kept = attncc.varlen_packing(cu, cu, 399, 399)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (tuning) outside the capture
        flash_attn_varlen_func(q, k, v, cu, cu, 399, 399, causal=True, packing=kept)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CallError, match=r"a CUDA graph cannot capture.*packing=packing"):
        with torch.cuda.graph(graph):
            flash_attn_varlen_func(q, k, v, cu, cu, 399, 399, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 399, 399, causal=True, packing=kept)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = dense_packed(q, k, v, cu.tolist(), cu.tolist(), True)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.slow  # ~20 s of tracing under the interpreter
@pytest.mark.skipif(DEVICE != "cpu", reason="writes through numpy views need host tensors")
def test_compiled_calls_run_the_packing_their_tensors_hold_now():
    """Under torch.compile the values are read eagerly (a graph break), on every call."""
    q, k, v = qkv(14, 14, H=2, Hkv=2)
    attend = torch.compile(lambda q, k, v, cu: flash_attn_varlen_func(
        q, k, v, cu, cu, 14, 14, causal=True, return_attn_probs=True)[:2], backend="aot_eager")
    cu = cpu_int32([0, 5, 14])
    assert_matches(*attend(q, k, v, cu), dense_packed(q, k, v, [0, 5, 14], [0, 5, 14], True))
    cu.numpy()[1] = 11
    assert_matches(*attend(q, k, v, cu), dense_packed(q, k, v, [0, 11, 14], [0, 11, 14], True))


# ------------------------------------------------------------------------- fuzzing
def random_cuts(gen, n_sequences: int, total: int) -> list:
    """cu_seqlens of n sequences over `total` tokens, empty sequences allowed."""
    if n_sequences == 0:
        return [0]
    cuts = sorted(torch.randint(0, total + 1, (n_sequences - 1,), generator=gen).tolist())
    return [0, *cuts, total]


def fuzz_packings(seed: int, n_calls: int = 3):
    """One random problem (heads, dim, causal, entry point, value scale) and a sequence of
    calls on the same q, k, v and the same max_seqlen, the cu tensors given new random
    packings in a random way between calls (or left as they are)."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[torch.randint(len(options), (1,), generator=gen).item()]
    n_sequences = pick([0, 1, 2, 3, 5])
    total_q = 0 if n_sequences == 0 else pick([1, 7, 19, 33])
    total_k = total_q if pick([True, False]) else (0 if n_sequences == 0 else pick([1, 9, 26]))
    H, Hkv = pick([(2, 2), (3, 1), (6, 2), (5, 5)])
    causal, entry, mutation = pick([True, False]), pick(["varlen", "flash"]), pick(list(MUTATIONS))
    magnitude = pick([1.0, 4.0, 12.0])  # large scores stress the online softmax
    q, k, v = qkv(total_q, total_k, H=H, Hkv=Hkv, D=pick([16, 32]), seed=seed)
    q = q * magnitude
    vk = attncc.varlen(CAUSAL if causal else "attention full { }")
    values_q = random_cuts(gen, n_sequences, total_q)
    values_k = values_q if total_k == total_q and pick([True, False]) else \
        random_cuts(gen, n_sequences, total_k)
    cu_q, cu_k = cpu_int32(values_q), cpu_int32(values_k)
    if values_k is values_q and pick([True, False]):
        cu_k = cu_q  # one tensor for both sides, as self-attention passes it
    max_q, max_k = max(total_q, 0), max(total_k, 0)
    for call in range(n_calls):
        if entry == "varlen":
            out, lse = vk(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True)
        else:
            out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                 causal=causal, return_attn_probs=True)
        truth = dense_packed(q, k, v, values_q, values_k, causal)
        eager = dense_packed(q.float(), k.float(), v.float(), values_q, values_k, causal)
        for name, got, ref in (("out", out, truth[0]), ("lse", lse, truth[1])):
            err = max_abs_error(got, ref)
            assert within_tolerance(err, max_abs_error(eager[0 if name == "out" else 1].float(),
                                                       ref), torch.float32, ref), (
                f"seed {seed} call {call} ({mutation}, {entry}, causal={causal}): {name} "
                f"error {err:.3g} with cu_q {values_q}, cu_k {values_k}")
        if call == n_calls - 1:
            check_gradients(q, k, v, values_q, values_k, causal, entry, cu_q, cu_k, seed)
            continue
        if n_sequences == 0:
            continue
        # New values for one side or both, written the chosen way (or none at all).
        side = pick(["q", "k", "both", "none"])
        shared = cu_k is cu_q
        if side in ("q", "both") or (shared and side != "none"):
            values_q = random_cuts(gen, n_sequences, total_q)
            cu_q = MUTATIONS[mutation](cu_q, values_q)
            if shared:
                cu_k, values_k = cu_q, values_q
        if side in ("k", "both") and not shared:
            values_k = random_cuts(gen, n_sequences, total_k)
            cu_k = MUTATIONS[mutation](cu_k, values_k)


def check_gradients(q, k, v, values_q, values_k, causal, entry, cu_q, cu_k, seed):
    """dq, dk, dv of the packed call against the formula's in float64, with its fp32
    gradients as the eager baseline (attncc/semantics/tolerance.py's rule)."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if entry == "varlen":
        vk = attncc.varlen(CAUSAL if causal else "attention full { }")
        out = vk(*leaves, cu_q, cu_k, q.shape[0], k.shape[0])
    else:
        out = flash_attn_varlen_func(*leaves, cu_q, cu_k, q.shape[0], k.shape[0], causal=causal)
    got = torch.autograd.grad(out, leaves, dout, allow_unused=True)

    def formula(dtype):
        xs = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = dense_packed(*xs, values_q, values_k, causal)
        return torch.autograd.grad(ref, xs, dout.cpu().to(dtype), allow_unused=True)

    truth, eager = formula(torch.float64), formula(torch.float32)
    # dq and dk inherit rounding noise from the stored output (tolerance.py): its size.
    ref_out, _ = dense_packed(q, k, v, values_q, values_k, causal)
    heads_first = lambda t: t.detach().double().cpu().transpose(0, 1)
    scales = gradient_scales(heads_first(q), heads_first(k), heads_first(ref_out),
                             heads_first(dout), q.shape[-1] ** -0.5, q.shape[1] // k.shape[1])
    for name, g, r, e in zip(("dq", "dk", "dv"), got, truth, eager):
        r = torch.zeros_like(leaves[0 if name == "dq" else 1], dtype=torch.float64).cpu() \
            if r is None else r
        e = torch.zeros_like(r, dtype=torch.float32) if e is None else e
        assert g is not None and g.shape == r.shape, name
        err = max_abs_error(g, r)
        assert within_tolerance(err, max_abs_error(e, r), torch.float32, r,
                                scales.get(name, 1.0)), (
            f"seed {seed} ({entry}, causal={causal}): {name} error {err:.3g} with cu_q "
            f"{values_q}, cu_k {values_k}")


@pytest.mark.skipif(DEVICE != "cpu", reason="writes through numpy views need host tensors")
@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_packings_mutated_between_calls(seed):
    fuzz_packings(seed)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="writes through numpy views need host tensors")
@pytest.mark.parametrize("seed", range(4, 64))
def test_fuzzed_packings_mutated_between_calls_at_length(seed):
    fuzz_packings(seed, n_calls=4)


def test_a_packing_first_seen_under_inference_mode_serves_training_calls():
    """Kept by value, the packing of an evaluation step under torch.inference_mode is the
    one a training step with the same lengths finds: its tensors must be normal ones
    (saved for backward, their versions read by the tables' cache)."""
    values = cu_of([6, 0, 11])
    q, k, v = qkv(17, 17, H=3, Hkv=1, seed=5)
    vk = attncc.varlen(CAUSAL)
    with torch.inference_mode():
        cu = torch.tensor(values, dtype=torch.int32, device=DEVICE)
        assert_matches(*vk(q, k, v, cu, cu, 11, 11, return_lse=True),
                       dense_packed(q, k, v, values, values, True))
        kept = attncc.varlen_packing(cu, cu, 11, 11)
        assert_matches(*vk(q, k, v, cu, cu, 11, 11, return_lse=True, packing=kept),
                       dense_packed(q, k, v, values, values, True))
    cu = torch.tensor(values, dtype=torch.int32, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = vk(*leaves, cu, cu, 11, 11)
    dout = torch.randn(out.shape, device=DEVICE)
    out.backward(dout)
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref, _ = dense_packed(*ref_leaves, values, values, True)
    ref.backward(dout.double().cpu())
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(DEVICE != "cpu", reason="writes through numpy views need host tensors")
def test_the_packed_flash_forms_read_the_values_or_take_a_kept_packing():
    from attncc.flash import flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func
    q, k, v = qkv(15, 15, H=2, Hkv=2, seed=7)
    cu = cpu_int32([0, 8, 15])
    qkv_packed = torch.stack([q, k, v], dim=1)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv_packed, cu, 15, causal=True,
                                                   return_attn_probs=True)
    assert_matches(out, lse, dense_packed(q, k, v, [0, 8, 15], [0, 8, 15], True))
    cu.numpy()[1] = 2
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv_packed, cu, 15, causal=True,
                                                   return_attn_probs=True)
    assert_matches(out, lse, dense_packed(q, k, v, [0, 2, 15], [0, 2, 15], True))
    kept = attncc.varlen_packing(cu, cu, 15, 15)
    out, lse, _ = flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), cu, cu, 15, 15,
                                                  causal=True, return_attn_probs=True,
                                                  packing=kept)
    assert_matches(out, lse, dense_packed(q, k, v, [0, 2, 15], [0, 2, 15], True))
