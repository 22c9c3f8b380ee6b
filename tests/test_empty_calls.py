"""Empty calls (no query, no key, no batch row, an all-empty packing) at every entry
point: outputs of the right shape, dtype and device that are part of the autograd graph,
so that a training step on an empty micro-batch runs its backward, with gradients of
the right shapes (zero: nothing attends). The truth is attncc.reference in float64 (and
SDPA's shapes where it defines the call): rows of q that see no key give 0, LSE -inf.
"""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.flash import flash_attn_func, flash_attn_varlen_func

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = "attention e { learnable input w: f32[h] mask q >= k score s + w[h] * (k - q) }"


def leaves(*shapes, dtype=torch.float32, seed=0):
    """Fresh random tensors (never zeros) that require grad."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=gen, dtype=torch.float64) * 3).to(dtype).to(DEVICE)
            .requires_grad_() for s in shapes]


def check_empty_result(out, lse, like_q, expected_lse_shape):
    assert out.shape == like_q.shape and out.dtype == like_q.dtype
    assert out.device == like_q.device
    assert out.requires_grad and out.grad_fn is not None, "the output left the autograd graph"
    assert not torch.isnan(out).any() and torch.all(out == 0)
    if lse is not None:
        assert lse.shape == expected_lse_shape and lse.dtype == torch.float32
        assert torch.all(lse == -math.inf)


def check_grads(tensors, truth=None):
    """Every leaf got a gradient of its own shape, all zero (and equal to the reference's
    where given: None there means no path, that is zero)."""
    for i, t in enumerate(tensors):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
        assert not torch.isnan(t.grad).any() and torch.all(t.grad == 0), i
        if truth is not None and truth[i] is not None:
            torch.testing.assert_close(t.grad.double(), truth[i], rtol=0, atol=0)


SHAPES = {  # (q shape, k shape) in (batch, heads, seq, dim)
    "no_query": ((2, 3, 0, 16), (2, 3, 5, 16)),
    "no_key": ((2, 3, 7, 16), (2, 3, 0, 16)),
    "no_batch_row": ((0, 3, 7, 16), (0, 3, 5, 16)),
    "nothing": ((1, 3, 0, 16), (1, 3, 0, 16)),
    "no_key_gqa": ((1, 6, 19, 16), (1, 2, 0, 16)),
}


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_kernel_calls_with_nothing_to_compute_stay_in_the_graph(case, return_lse):
    q_shape, k_shape = SHAPES[case]
    kernel = attncc.compile(SPEC)
    q, k, v = leaves(q_shape, k_shape, k_shape)
    (w,) = leaves((q_shape[1],), seed=1)
    result = kernel(q, k, v, w=w, return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    check_empty_result(out, lse, q, q_shape[:3])
    dout = torch.randn(out.shape, dtype=out.dtype, device=DEVICE)
    out.backward(dout)

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, w)]
    ref = attncc.reference(kernel.variant, *ref_leaves[:3], w=ref_leaves[3])
    torch.testing.assert_close(out.double(), ref)
    ref.backward(dout.double())
    check_grads([q, k, v, w], [t.grad for t in ref_leaves])
    # SDPA accepts the same call and keeps it differentiable, with the same shapes.
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.detach(), k.detach().repeat_interleave(q_shape[1] // k_shape[1], 1),
        v.detach().repeat_interleave(q_shape[1] // k_shape[1], 1))
    assert sdpa.shape == out.shape


def test_empty_calls_in_the_bshd_layout_keep_it():
    kernel = attncc.compile("attention c { mask q >= k }")
    q, k = leaves((2, 0, 3, 16), (2, 9, 3, 16))
    out = kernel(q, k, k, layout="bshd")
    check_empty_result(out, None, q, None)
    out.sum().backward()
    check_grads([q, k])


def test_only_the_tensors_that_require_grad_get_gradients():
    kernel = attncc.compile("attention c { mask q >= k }")
    q = torch.randn(1, 2, 5, 16, device=DEVICE)
    (k,) = leaves((1, 2, 0, 16))
    out = kernel(q, k, k.detach())
    out.sum().backward()
    check_grads([k])
    assert q.grad is None


@pytest.mark.parametrize("lens_q, lens_k", [
    ([0, 0, 0], [3, 0, 4]),  # no query anywhere
    ([2, 5, 1], [0, 0, 0]),  # no key anywhere: every row sees nothing
    ([0, 0], [0, 0]),  # nothing at all
    ([], []),  # no sequence: cu_seqlens = [0]
])
@pytest.mark.parametrize("entry", ["varlen", "flash_attn_varlen_func"])
def test_all_empty_packings_stay_in_the_graph(lens_q, lens_k, entry):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()],
                                   dtype=torch.int32, device=DEVICE)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    H = 3
    q, k, v = leaves((sum(lens_q), H, 16), (sum(lens_k), 1, 16), (sum(lens_k), 1, 16))
    max_q, max_k = max(lens_q, default=0), max(lens_k, default=0)
    if entry == "varlen":
        vk = attncc.varlen("attention c { learnable input w: f32[h] mask q >= k "
                           "score s + w[h] }")
        (w,) = leaves((H,), seed=2)
        out, lse = vk(q, k, v, cu_q, cu_k, max_q, max_k, w=w, return_lse=True)
        grads = [q, k, v, w]
    else:
        out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                 return_attn_probs=True)
        assert probs is None
        grads = [q, k, v]
    check_empty_result(out, lse, q, (H, q.shape[0]))
    out.backward(torch.randn(out.shape, device=DEVICE))
    check_grads(grads)


@pytest.mark.parametrize("q_len, k_len, batch", [(0, 6, 2), (6, 0, 2), (4, 5, 0)])
def test_flash_attn_func_with_nothing_to_compute_stays_in_the_graph(q_len, k_len, batch):
    q, k, v = leaves((batch, q_len, 4, 16), (batch, k_len, 2, 16), (batch, k_len, 2, 16))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_empty_result(out, lse, q, (batch, 4, q_len))
    out.sum().backward()
    check_grads([q, k, v])
    q.grad = k.grad = v.grad = None
    flash_attn_func(q, k, v, window_size=(3, 1)).sum().backward()
    check_grads([q, k, v])


@pytest.mark.parametrize("batch, length", [(1, 0), (0, 5)])
def test_tile_tables_and_density_of_empty_problems(batch, length):
    """A loop over micro-batches keeps tables or reads densities for each shape, the empty
    one included: no tile, density 0, and the calls given those tables stay in the graph."""
    kernel = attncc.compile("attention d { input doc: i32[b, q] "
                            "mask doc[b, q] == doc[b, k] and q >= k }")
    (q,) = leaves((batch, 2, length, 16))
    doc = torch.zeros(batch, length, dtype=torch.int32, device=DEVICE)
    assert kernel.density(q, q, q, doc=doc) == 0.0
    tables = kernel.tile_tables(q, q, q, doc=doc)
    out = kernel(q, q, q, doc=doc, tables=tables)
    check_empty_result(out, None, q, None)
    out.sum().backward()
    check_grads([q])


def test_learnable_inputs_on_an_empty_axis_get_empty_gradients():
    kernel = attncc.compile("attention l { learnable input w: f32[k] score s + w[k] }")
    q, k, v = leaves((1, 3, 4, 16), (1, 3, 0, 16), (1, 3, 0, 16))
    (w,) = leaves((0,), seed=3)
    out, lse = kernel(q, k, v, w=w, return_lse=True)
    check_empty_result(out, lse, q, (1, 3, 4))
    out.sum().backward()
    check_grads([q, k, v, w])
    vk = attncc.varlen("attention c { mask q >= k }")
    assert vk.density(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                      torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
                      torch.tensor([0, 0], dtype=torch.int32, device=DEVICE), 4, 0) == 0.0


@pytest.mark.parametrize("case", ["no_key", "no_query", "no_batch_row"])
def test_losses_on_the_lse_of_an_empty_call_give_zero_gradients(case):
    """The LSE is differentiable (a merge of partial attentions reads it): an empty
    call's backward takes its gradient too, and it moves nothing (the LSE is -inf
    whatever the inputs)."""
    q_shape, k_shape = SHAPES[case]
    kernel = attncc.compile(SPEC)
    q, k, v = leaves(q_shape, k_shape, k_shape)
    (w,) = leaves((q_shape[1],), seed=4)
    out, lse = kernel(q, k, v, w=w, return_lse=True)
    check_empty_result(out, lse, q, q_shape[:3])
    weights = torch.randn(lse.shape, device=DEVICE)
    # A finite loss: exp(lse) is 0 where a row sees no key.
    ((torch.exp(lse) * weights).sum() + out.sum()).backward()
    check_grads([q, k, v, w])
