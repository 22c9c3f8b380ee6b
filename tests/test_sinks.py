"""Learnable attention sinks (`sink EXPR`, gpt-oss's sinks) in every path.

The independent reference is gpt-oss's own `sdpa()` (gpt_oss/torch/model.py), retyped
for (batch, heads, seq, dim) tensors and any boolean mask: the scaled scores, -inf
where the mask forbids, the sinks concatenated as one more column, the softmax, that
column dropped. Computed in float64, differentiated by autograd for the sinks'
gradient, it checks the kernels (on the GPU where there is one, else under the
interpreter; the references run on the CPU): forward, LSE and every gradient,
with sinks 40 above and below the logits, rows that see no key, len_q != len_k, lengths
off the tile, heads that are not a power of two, GQA; then decoding with 1 to 8 splits,
packed sequences, context parallelism on two gloo ranks, the flash API's
learnable_sink=, and a tiny gpt-oss model against transformers' eager attention.
"""
from __future__ import annotations

import datetime
import math
import os
import traceback

import pytest
import torch

import attncc
from attncc.errors import CallError, SpecError
from attncc.runtime.sinks import fixed_order_sum
from attncc.semantics.tolerance import max_abs_error, slack, within_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the interpreter

GPT_OSS = """attention gpt_oss {
    heads 6 / 2
    learnable input sinks: f32[h]
    mask q >= k
    sink sinks[h]
}"""


# ---------------------------------------------------------------- the independent reference
def gpt_oss_sdpa(q, k, v, sinks, allowed, scale):
    """gpt-oss's sdpa(): scores scaled, -inf where not allowed, the sinks (one logit per
    query head, not scaled) as one more column, softmax, that column dropped. Returns
    (out, lse) with lse the log of the softmax's denominator (the sink's term in it)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed, -math.inf)
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([scores, column], dim=-1)
    weights = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bhkd->bhqd", weights, v), torch.logsumexp(logits, dim=-1)


def causal(len_q, len_k, shift=0):
    """q >= k + shift, top-left aligned: rows below `shift` see no key."""
    return torch.arange(len_q)[:, None] >= torch.arange(len_k)[None, :] + shift


def close(got, ref64, eager, what):
    err, err_eager = max_abs_error(got, ref64), max_abs_error(eager, ref64)
    assert not math.isnan(err), f"{what}: NaN"
    assert within_tolerance(err, err_eager, torch.float32, ref64), (
        f"{what}: kernel error {err:.3g} vs eager float32 {err_eager:.3g}")


def run_both(spec, B, len_q, len_k, D, sink_values, allowed, *, shift=0, seed=0):
    """The kernel and gpt_oss_sdpa (float64 and float32) on the same random inputs, with
    the same upstream gradients for the output and the LSE; asserts every result agrees.
    The kernel runs on DEVICE, the formula on the CPU; the kernel's results come back on
    the CPU."""
    kernel = attncc.compile(spec)
    Hq, Hkv = kernel.variant.heads.q, kernel.variant.heads.kv
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in
               ((Hq, len_q), (Hkv, len_k), (Hkv, len_k)))
    dout, dlse = torch.randn(B, Hq, len_q, D, generator=gen), torch.randn(B, Hq, len_q, generator=gen)

    def run(fn, dtype, device):
        leaves = [t.detach().to(device, dtype, copy=True).requires_grad_()
                  for t in (q, k, v, sink_values)]
        out, lse = fn(*leaves)
        ((out * dout.to(device, dtype)).sum() + (lse * dlse.to(device, dtype)).sum()).backward()
        return [t.detach().cpu() for t in [out, lse] + [t.grad for t in leaves]]

    got = run(lambda q, k, v, s: kernel(q, k, v, sinks=s, return_lse=True), torch.float32, DEVICE)
    formula = lambda q, k, v, s: gpt_oss_sdpa(q, k, v, s, allowed, D ** -0.5)
    ref, eager = run(formula, torch.float64, "cpu"), run(formula, torch.float32, "cpu")
    for name, g, r, e in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, ref, eager):
        close(g, r, e, name)
    return got, ref


# ---------------------------------------------------------------- the kernels
@pytest.mark.parametrize("B, heads, len_q, len_k, D, offset", [
    (1, (6, 2), 21, 21, 16, 0.0),     # GQA, heads not a power of two, lengths off the tile
    (1, (3, 3), 9, 35, 16, 40.0),     # len_q < len_k; sinks 40 above the logits
    pytest.param(2, (5, 1), 40, 23, 24, -40.0, marks=pytest.mark.slow),  # len_q > len_k, MQA
    pytest.param(1, (2, 1), 19, 7, 16, -40.0, marks=pytest.mark.slow),  # sinks 40 below
])
def test_the_kernels_match_gpt_oss_sdpa(B, heads, len_q, len_k, D, offset):
    spec = GPT_OSS.replace("heads 6 / 2", f"heads {heads[0]} / {heads[1]}")
    sinks = torch.randn(heads[0], generator=torch.Generator().manual_seed(7)) + offset
    got, _ = run_both(spec, B, len_q, len_k, D, sinks, causal(len_q, len_k))
    assert all(torch.isfinite(t).all() for t in got)
    if offset > 0:  # the sink takes nearly all the weight, and does not overflow
        assert got[0].abs().max() < 1e-6 and torch.allclose(got[1], sinks.view(1, -1, 1).expand_as(got[1]))


def test_rows_that_see_no_key_give_zero_and_the_sink_as_lse():
    spec = GPT_OSS.replace("mask q >= k", "mask q >= k + 5")
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3)) * 3
    (out, lse, *_), _ = run_both(spec, 1, 13, 13, 16, sinks, causal(13, 13, shift=5))
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    assert torch.allclose(lse[:, :, :5], sinks.view(1, 6, 1).expand(2, 6, 5))


def test_a_sink_of_minus_infinity_leaves_an_empty_row_empty_without_nan():
    """Heads whose sink is -inf (off) are the variant without a sink: a row with no key
    gives 0 and LSE -inf, and no NaN reaches any gradient (it gave NaN out and LSE, and
    NaN dK/dV over the row's whole key tile). The formula: gpt-oss's with -1e4 for -inf,
    the same in float64 wherever a row has a key."""
    spec = GPT_OSS.replace("mask q >= k", "mask q >= k + 5")
    kernel = attncc.compile(spec)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 6, 13, 16, generator=gen)
    k, v = (torch.randn(1, 2, 13, 16, generator=gen) for _ in range(2))
    sinks = torch.randn(6, generator=gen)
    sinks[[0, 3]] = -math.inf
    dout = torch.randn(1, 6, 13, 16, generator=gen)
    finite_lse = torch.ones(1, 6, 13, dtype=torch.bool)
    finite_lse[:, [0, 3], :5] = False  # rows 0-4 see no key; on those heads nothing else

    def run(fn, dtype, device, sink_values):
        leaves = [t.detach().to(device, dtype, copy=True).requires_grad_()
                  for t in (q, k, v, sink_values)]
        out, lse = fn(*leaves)
        kept = finite_lse.to(device)
        loss = (out * dout.to(device, dtype)).sum() + torch.where(kept, lse, 0.0).sum()
        loss.backward()
        return [t.detach().cpu().double() for t in [out, lse] + [t.grad for t in leaves]]

    got = run(lambda q, k, v, s: kernel(q, k, v, sinks=s, return_lse=True), torch.float32,
              DEVICE, sinks)
    formula = lambda q, k, v, s: gpt_oss_sdpa(q, k, v, s, causal(13, 13, shift=5), 0.25)
    want = run(formula, torch.float64, "cpu", torch.where(sinks.isinf(), -1e4, sinks))
    assert not any(t.isnan().any() for t in got)
    assert torch.equal(got[0][:, [0, 3], :5], torch.zeros(1, 2, 5, 16, dtype=torch.float64))
    assert (got[1][~finite_lse] == -math.inf).all()
    want[1] = torch.where(finite_lse, want[1], -math.inf)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_a_call_with_no_key_gives_the_sink_and_its_gradient():
    kernel = attncc.compile(GPT_OSS)
    q = torch.randn(1, 6, 4, 16).to(DEVICE)
    k = v = torch.randn(1, 2, 0, 16).to(DEVICE)
    sinks = torch.randn(6).to(DEVICE).requires_grad_()
    out, lse = kernel(q, k, v, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks.detach().view(1, 6, 1).expand(1, 6, 4))
    lse.sum().backward()  # L = σ there: dσ = dL
    assert torch.equal(sinks.grad, torch.full((6,), 4.0, device=DEVICE))


def test_sink_expressions_of_b_h_q_and_inputs_match_the_reference():
    """A learnable read at a computed index (h % 3), scaled, plus a per-row input read at
    b, h, q: the reference (float64) and the kernel agree on every result."""
    spec = """attention rowwise {
        heads 6 / 3
        learnable input sinks: f32[3]
        input bias: f32[b, h, q]
        mask q >= k and q - k < 9
        sink 2.0 * sinks[h % 3] + bias[b, h, q] - 0.01 * q
    }"""
    kernel, variant = attncc.compile(spec), attncc.parse(spec)
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 6, 17, 16, generator=gen), *(torch.randn(2, 3, 17, 16, generator=gen) for _ in range(2))
    inputs = {"sinks": torch.randn(3, generator=gen), "bias": torch.randn(2, 6, 17, generator=gen)}
    dout = torch.randn(2, 6, 17, 16, generator=gen)

    def run(fn, dtype, device):
        leaves = [t.detach().to(device, dtype, copy=True).requires_grad_()
                  for t in (q, k, v, inputs["sinks"])]
        out = fn(*leaves[:3], sinks=leaves[3], bias=inputs["bias"].to(device, dtype))
        (out * dout.to(device, dtype)).sum().backward()
        return [t.detach().cpu() for t in [out] + [t.grad for t in leaves]]

    got = run(kernel, torch.float32, DEVICE)
    reference = lambda *a, **i: attncc.reference(variant, *a, **i)
    ref, eager = run(reference, torch.float64, "cpu"), run(reference, torch.float32, "cpu")
    for name, g, r, e in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref, eager):
        close(g, r, e, name)


def test_a_constant_sink_is_softmax_plus_one():
    # `sink 0.0`: softmax with 1 added to the denominator ("off-by-one" attention).
    kernel = attncc.compile("attention plus_one { mask q >= k  sink 0.0 }")
    q, k, v = (torch.randn(1, 2, 17, 16, dtype=torch.float64) for _ in range(3))
    scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(~causal(17, 17), -math.inf)
    expected = torch.exp(scores) @ v / (1.0 + torch.exp(scores).sum(-1, keepdim=True))
    assert max_abs_error(kernel(*(t.float().to(DEVICE) for t in (q, k, v))), expected) < 1e-5


def test_the_sinks_gradient_is_the_same_bits_on_every_call():
    kernel = attncc.compile(GPT_OSS.replace("sink sinks[h]", "sink sinks[h % 4] * 0.5"))
    gen = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(1, 6, 20, 16, generator=gen), *(torch.randn(1, 2, 20, 16, generator=gen) for _ in range(2))
    q, k, v, sinks = (t.to(DEVICE) for t in (q, k, v, torch.randn(6, generator=gen)))
    grads = []
    for _ in range(2):
        s = sinks.clone().requires_grad_()
        kernel(q, k, v, sinks=s).pow(2).sum().backward()
        grads.append(s.grad)
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    assert torch.equal(grads[0][4:], torch.zeros(2, device=DEVICE))  # entries 4, 5 are never read


def test_an_input_only_the_sink_reads_takes_no_gradient_buffer_in_the_kernels():
    # The kernels never write its gradient: runtime/sinks.py computes all of it, so the
    # backward launches allocate and zero no buffer for it (a launch less on a GPU). An
    # input the score reads too keeps its buffer.
    assert attncc.compile(GPT_OSS).module.KERNEL_GRADS == []
    both = attncc.compile("""attention both { learnable input bias: f32[h] mask q >= k
        score s + bias[h] * 0.1 sink bias[h] }""")
    assert both.module.KERNEL_GRADS == ["bias"]
    module = attncc.compile(GPT_OSS).module
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 9, 16, generator=gen), *(torch.randn(1, 2, 9, 16, generator=gen)
                                                         for _ in range(2))
    q, k, v, sinks = (t.to(DEVICE) for t in (q, k, v, torch.randn(4, generator=gen)))
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    out, lse = module.forward(q, k, v, {"sinks": sinks}, config=config)
    dq, dinputs = module.backward_dq(q, k, v, lse, module.new_delta(q), torch.randn_like(out),
                                     {"sinks": sinks}, config=config, out=out)
    assert dinputs == {}


@pytest.mark.parametrize("axes", ["h", "b, h", "h, b"])
def test_a_sink_read_as_is_takes_the_summed_gradient_of_the_general_path(axes):
    """`sink t[h]` (and t[b, h], t[h, b]) skips the vjp through the evaluator: its
    gradient is dσ summed over the other row axes, the general path's value."""
    from attncc.arguments import Problem
    from attncc.runtime.sinks import _direct_read, add_sink_gradients
    B, H, L = 2, 6, 13
    shape = [{"b": B, "h": H}[a] for a in axes.split(", ")]
    spec = f"attention t {{ learnable input t: f32[{axes}]  mask q >= k  sink t[{axes}] }}"
    general = spec.replace(f"sink t[{axes}]", f"sink t[{axes}] + 0.0")  # not a bare read
    problem = Problem(B, H, H, L, L, 16, 16)
    gen = torch.Generator().manual_seed(4)
    values = {"t": torch.randn(*shape, generator=gen)}
    lse, delta = torch.randn(B, H, L, generator=gen), torch.randn(B, H, L, generator=gen)
    fast_variant, slow_variant = attncc.parse(spec), attncc.parse(general)
    assert _direct_read(fast_variant, problem, values) is not None
    assert _direct_read(slow_variant, problem, values) is None
    fast = add_sink_gradients(fast_variant, problem, values, lse, delta, {})["t"]
    slow = add_sink_gradients(slow_variant, problem, values, lse, delta, {})["t"]
    assert fast.shape == values["t"].shape
    assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reads, entries", [(1000, 7), (40000, 9000)])  # compared; sorted
def test_fixed_order_sum_adds_every_read_of_an_entry(reads, entries):
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(reads, generator=gen, dtype=torch.float64)
    index = torch.randint(0, entries, (reads,), generator=gen)
    expected = torch.zeros(entries, dtype=torch.float64).index_add_(0, index, values)
    got = fixed_order_sum(values.to(DEVICE), index.to(DEVICE), entries)
    assert torch.allclose(got.cpu(), expected, atol=1e-12)


# ---------------------------------------------------------------- the language
def test_sink_round_trips_through_the_language_and_the_decorator():
    variant = attncc.parse(GPT_OSS)
    assert "sink    sinks[h]" in str(variant)
    assert attncc.parse(str(variant)) == variant

    @attncc.variant(name="gpt_oss", heads=(6, 2), inputs={"sinks": "f32[h]"}, learnable=["sinks"])
    class gpt_oss:
        def mask(q, k):
            return q >= k

        def sink(h, sinks):
            return sinks[h]
    assert gpt_oss == variant
    # A variant without a sink keeps the key it had before sinks existed.
    assert "sink" not in repr(attncc.parse("attention causal { mask q >= k }"))


@pytest.mark.parametrize("body, words", [
    ("input t: f32[k]  sink t[k]", "'k' cannot be used in `sink`: a sink is one extra logit per query row"),
    ("sink s * 2.0", "'s' cannot be used in `sink`: a sink is one extra logit per query row, not a function of the pair's score"),
    ("sink q > 3", "`sink` must be a number, but this is a condition"),
    ("sink 1.0  sink 2.0", "`sink` is declared twice"),
])
def test_sinks_reading_k_or_s_are_refused(body, words):
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("`", "`").replace(".", r"\.")):
        attncc.parse(f"attention bad {{ mask q >= k  {body} }}")


def test_the_decorator_refuses_a_sink_reading_k():
    with pytest.raises(SpecError, match="'k' cannot be used in `sink`"):
        attncc.variant(type("bad", (), {"sink": staticmethod(lambda q, k: q - k)}))


# ---------------------------------------------------------------- decoding, varlen
@pytest.mark.parametrize("splits", [1, pytest.param(2, marks=pytest.mark.slow),
                                    pytest.param(3, marks=pytest.mark.slow),
                                    pytest.param(5, marks=pytest.mark.slow), 8])
def test_decode_adds_the_sink_once_over_any_split_count(splits):
    from attncc.semantics.decoding import decode_reference
    spec = GPT_OSS.replace("mask q >= k", "mask q >= k and q - k < 40")
    kernel, variant = attncc.compile(spec), attncc.parse(spec)
    gen = torch.Generator().manual_seed(splits)
    n_q, capacity = 3, 80
    q = torch.randn(3, 6, n_q, 16, generator=gen)
    k_cache, v_cache = (torch.randn(3, 2, capacity, 16, generator=gen) for _ in range(2))
    lengths = torch.tensor([1, 37, 77], dtype=torch.int32)
    sinks = torch.randn(6, generator=gen) * 4
    out, lse = kernel.decode(*(t.to(DEVICE) for t in (q, k_cache, v_cache)),
                             cache_seqlens=lengths.to(DEVICE), return_lse=True,
                             sinks=sinks.to(DEVICE), config=dict(BLOCK_N=16, num_warps=4,
                                                                 num_stages=1, num_splits=splits))
    ref = decode_reference(variant, q.double(), k_cache.double(), v_cache.double(),
                           cache_seqlens=lengths, return_lse=True, sinks=sinks.double())
    eager = decode_reference(variant, q, k_cache, v_cache, cache_seqlens=lengths,
                             return_lse=True, sinks=sinks)
    close(out, ref[0], eager[0], "out")
    close(lse, ref[1], eager[1], "lse")


@pytest.mark.slow
def test_packed_sequences_take_the_sink_per_sequence():
    spec = GPT_OSS.replace("mask q >= k", "mask q >= k and q - k < 6")
    kernel, dense = attncc.varlen(spec), attncc.compile(spec)
    lengths = [5, 11, 1]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    total = int(cu[-1])
    q, k, v = torch.randn(total, 6, 16, generator=gen), *(torch.randn(total, 2, 16, generator=gen) for _ in range(2))
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    sinks = torch.randn(6, generator=gen).to(DEVICE).requires_grad_()
    out = kernel(q, k, v, cu.to(DEVICE), cu.to(DEVICE), max(lengths), max(lengths), sinks=sinks)
    out.pow(2).sum().backward()
    packed_grad, sinks.grad = sinks.grad, None
    total_loss = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = dense(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), sinks=sinks)
        assert max_abs_error(out[a:b], one[0].transpose(0, 1)) < 1e-5
        total_loss = total_loss + one.pow(2).sum()
    total_loss.backward()
    assert torch.allclose(packed_grad, sinks.grad, atol=1e-5)


# ---------------------------------------------------------------- the flash API
def test_flash_learnable_sink_matches_gpt_oss_with_its_gradient():
    from attncc.flash import flash_attn_func, flash_attn_varlen_func
    gen = torch.Generator().manual_seed(9)
    B, len_q, len_k, D = 1, 13, 29, 16
    q = torch.randn(B, len_q, 6, D, generator=gen).to(DEVICE)
    k, v = (torch.randn(B, len_k, 2, D, generator=gen).to(DEVICE) for _ in range(2))
    sinks = (torch.randn(6, generator=gen) * 2).to(DEVICE).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=True, learnable_sink=sinks, return_attn_probs=True)
    out.sum().backward()
    # flash-attn's causal is bottom-right aligned: query i sees keys up to i + len_k - len_q.
    allowed = causal(len_q, len_k, shift=len_q - len_k)
    s64 = sinks.detach().cpu().double().requires_grad_()
    ref, ref_lse = gpt_oss_sdpa(*(t.cpu().double().transpose(1, 2) for t in (q, k, v)), s64, allowed,
                                D ** -0.5)
    ref.sum().backward()
    assert max_abs_error(out.transpose(1, 2), ref) < 1e-5
    assert max_abs_error(lse, ref_lse) < 1e-5
    assert max_abs_error(sinks.grad, s64.grad) < 1e-4
    # The varlen form: one sequence packed is the same call.
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (len_q, len_k))
    packed = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, len_q, len_k,
                                    causal=True, learnable_sink=sinks.detach())
    assert max_abs_error(packed, out[0]) < 1e-5
    # Decoding the last query against the cache: the same row as the full call's.
    from attncc.flash import flash_attn_with_kvcache
    last = flash_attn_with_kvcache(q[:, -1:], k, v, cache_seqlens=len_k, causal=True,
                                   learnable_sink=sinks.detach())
    assert max_abs_error(last, out[:, -1:]) < 1e-5
    with pytest.raises(CallError, match=r"learnable_sink must be a float32 tensor of shape \(nheads,\)"):
        flash_attn_func(q, k, v, learnable_sink=sinks.detach().double())
    with pytest.raises(CallError, match=r"learnable_sink must have shape \(nheads,\) = \(6,\)"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(2, device=DEVICE))


# ---------------------------------------------------------------- context parallelism
def _cp_rank(rank: int, init_file: str, out_dir: str):
    try:
        import torch.distributed as dist
        from attncc.distributed import Sharding, context_parallel_attention
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=120))
        kernel = attncc.compile(GPT_OSS)
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, h, 32, 16, generator=gen) for h in (6, 2, 2, 6))
        sinks = (torch.randn(6, generator=gen) * 3).requires_grad_()
        sharding = Sharding.of(None, "zigzag")
        local = [sharding.shard(t).requires_grad_() for t in (q, k, v)]
        out, lse = context_parallel_attention(kernel, *local, sinks=sinks, return_lse=True)
        (out * sharding.shard(dout)).sum().backward()
        dist.all_reduce(sinks.grad)  # each rank holds its rows' share
        result = dict(out=sharding.unshard(out.detach()), lse=sharding.unshard(lse.detach()),
                      dq=sharding.unshard(local[0].grad), dsinks=sinks.grad)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "cp.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
def test_context_parallel_merges_the_sink_once(tmp_path, monkeypatch):
    """The ranks run gloo over CPU tensors, so their kernels run under the interpreter even
    on a GPU machine (set in their environment: Triton reads it when the generated module
    is imported); the whole-sequence call they are compared with runs on DEVICE."""
    import torch.multiprocessing as mp
    kernel = attncc.compile(GPT_OSS)  # generated once, so the ranks load it from the cache
    try:
        with monkeypatch.context() as env:  # only the ranks': this process keeps its own
            env.setenv("TRITON_INTERPRET", "1")
            mp.spawn(_cp_rank, (str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    except Exception:
        errors = [p.read_text() for p in sorted(tmp_path.glob("error-*"))]
        pytest.fail("a rank failed:\n" + "\n".join(errors or ["(no traceback)"]))
    got = torch.load(tmp_path / "cp.pt")
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 32, 16, generator=gen).to(DEVICE) for h in (6, 2, 2, 6))
    sinks = (torch.randn(6, generator=gen) * 3).to(DEVICE).requires_grad_()
    q.requires_grad_()
    out, lse = kernel(q, k, v, sinks=sinks, return_lse=True)
    (out * dout).sum().backward()
    for name, mine, whole in (("out", got["out"], out), ("lse", got["lse"], lse),
                              ("dq", got["dq"], q.grad), ("dsinks", got["dsinks"], sinks.grad)):
        assert max_abs_error(mine, whole) < 1e-4, name


# ---------------------------------------------------------------- Hugging Face
@pytest.mark.slow
def test_a_tiny_gpt_oss_model_matches_eager_attention():
    """Sliding (window 8) and full layers, GQA 6 / 2, sinks far from zero: the logits and
    every layer's sinks.grad as transformers' eager attention gives them."""
    transformers = pytest.importorskip("transformers")
    from attncc.integrations.transformers import register
    register("attncc")
    config = transformers.GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=97,
        hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=6,
        num_key_value_heads=2, sliding_window=8, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=3.0)
    model, ids = model.to(DEVICE), torch.randint(0, 97, (2, 21)).to(DEVICE)

    def run(implementation):
        model.zero_grad()
        model.set_attn_implementation(implementation)
        logits = model(ids).logits
        logits.pow(2).mean().backward()
        return logits.detach(), [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]

    eager, eager_grads = run("eager")
    ours, our_grads = run("attncc")
    assert max_abs_error(ours, eager) < 1e-4
    for mine, theirs in zip(our_grads, eager_grads):
        assert max_abs_error(mine, theirs) <= 1e-3 * theirs.abs().max().item() + slack(torch.float32)


def test_a_sink_read_past_its_table_is_clamped_in_the_backward_as_in_the_forward():
    """`sink t[h, q - 2]` over a table of 4: the kernels clamp the index (the SpecWarning
    says so) and the forward ran, but the sink's gradient went through the reference's
    evaluator, which raises out of range: the training step died in .backward(). Against
    a float64 formula with the clamped index; row 0 sees no key (mask q >= k + 1)."""
    with pytest.warns(attncc.SpecWarning):
        kernel = attncc.compile("attention clamped_sink { learnable input t: f32[h, 4]\n"
                                " mask q >= k + 1\n sink t[h, q - 2] }")
    gen = torch.Generator().manual_seed(12)
    H, Lq, Lk, D = 3, 21, 18, 16
    q, do = (torch.randn(1, H, Lq, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, H, Lk, D, generator=gen) for _ in range(2))
    t = torch.randn(H, 4, generator=gen) * 3
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v, t)]
    out, lse = kernel(*leaves[:3], t=leaves[3], return_lse=True)
    got = [out, lse, *torch.autograd.grad((out * do.to(DEVICE)).sum() + lse.sum(), leaves)]

    q64, k64, v64, t64 = (x.double().requires_grad_() for x in (q, k, v, t))
    rows = torch.arange(Lq)
    sink = t64[:, (rows - 2).clamp(0, 3)]                                 # [H, Lq]
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~(rows[:, None] >= torch.arange(Lk)[None, :] + 1), float("-inf"))
    logits = torch.cat([s, sink[None, :, :, None]], dim=-1)
    want_lse = torch.logsumexp(logits, -1)
    want_out = torch.softmax(logits, -1)[..., :Lk] @ v64
    want = [want_out, want_lse, *torch.autograd.grad((want_out * do.double()).sum()
                                                     + want_lse.sum(), (q64, k64, v64, t64))]
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv", "dt"], got, want):
        g = g.detach().cpu().double()
        assert not torch.isnan(g).any(), name
        torch.testing.assert_close(g, w, rtol=0, atol=2e-4 * (1 + w.abs().max().item()),
                                   msg=lambda m: f"{name}: {m}")
