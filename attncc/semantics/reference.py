"""The dense reference: a variant evaluated on every (q, k) pair with plain PyTorch.

It is the ground truth of every kernel test, so it is written for clarity, not speed:
it materialises the B×H×Lq×Lk score matrix. Run it in float64 to measure errors.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import dropout as dropout_bits
from .. import ir
from ..arguments import (Problem, as_bhsd, bind, check_return_lse, check_seed,
                         refuse_positional, refuse_seed_without_dropout)
from ..errors import CallError
from .evaluate import evaluate


def index_env(variant: ir.Variant, p: Problem, inputs: dict, device, float_dtype) -> dict:
    """Index names as broadcastable tensors over [B, H, Lq, Lk]."""
    ar = lambda n: torch.arange(n, device=device)
    return {
        "b": ar(p.batch).view(-1, 1, 1, 1),
        "h": ar(p.heads_q).view(1, -1, 1, 1),
        "q": (ar(p.len_q) + p.q_offset).view(1, 1, -1, 1),
        "k": (ar(p.len_k) + p.k_offset).view(1, 1, 1, -1),
        "dim": p.dim, "len_q": p.len_q, "len_k": p.len_k,
        "params": {d.name: d.value for d in variant.params},
        "inputs": inputs,
    }


def scale_value(variant: ir.Variant, dim: int, dim_v: int | None = None) -> float:
    """The scale at q·k head dim `dim` and v head dim `dim_v` (default: dim); without a
    `scale` declaration 1/sqrt(dim), whatever v's width."""
    if variant.scale is None:
        return 1.0 / math.sqrt(dim)
    env = {"dim": dim, "dim_v": dim if dim_v is None else dim_v, "params": {d.name: d.value for d in variant.params}, "inputs": {}}
    return float(evaluate(variant.scale, env))


def layout_grid(variant: ir.Variant, p: Problem, inputs: dict, device) -> torch.Tensor:
    """The layout on its own tile grid: bool, broadcastable to [B, H, QB, KB]."""
    qb_n = math.ceil((p.q_offset + p.len_q) / variant.block)
    kb_n = math.ceil((p.k_offset + p.len_k) / variant.block)
    env = index_env(variant, p, inputs, device, torch.float64)
    env["qb"] = torch.arange(qb_n, device=device).view(1, 1, -1, 1)
    env["kb"] = torch.arange(kb_n, device=device).view(1, 1, 1, -1)
    # A constant layout (`true`) evaluates to a CPU scalar: put it where the indices are.
    grid = torch.as_tensor(evaluate(variant.layout, env), device=device)
    return grid.expand(*grid.shape[:2], qb_n, kb_n) if grid.dim() == 4 else grid.expand(1, 1, qb_n, kb_n)


def allowed_pairs(variant: ir.Variant, p: Problem, inputs: dict, device,
                  len_q: int | None = None) -> torch.Tensor:
    """Which (b, h, q, k) attend: bool, broadcastable to [B, H, Lq, Lk]. `len_q`: the
    value the spec's `len_q` reads, where it is not the rows computed (decoding's last
    rows of a longer sequence); default p.len_q."""
    env = index_env(variant, p, inputs, device, torch.float64)
    if len_q is not None:
        env["len_q"] = len_q
    allowed = torch.ones(1, 1, p.len_q, p.len_k, dtype=torch.bool, device=device)
    if not allowed.numel():
        return allowed  # an empty call: nothing to evaluate (`q // len_k` has no value at 0)
    if variant.mask is not None:
        allowed = allowed & evaluate(variant.mask, env)
    if variant.layout is not None:
        grid = layout_grid(variant, p, inputs, device)  # [B|1, H|1, QB, KB]
        qb = (env["q"] // variant.block).view(-1)
        kb = (env["k"] // variant.block).view(-1)
        allowed = allowed & grid[:, :, qb][:, :, :, kb]
    return allowed


def sink_logits(variant: ir.Variant, env: dict, p: Problem, dtype, gather=None,
                clamp: bool = False) -> torch.Tensor:
    """The sink σ of every row, [B, H, Lq, 1] in `dtype`: `variant.sink` over the index
    grid of `env` (its b, h and q), differentiable in the inputs it reads (`gather`,
    `clamp`: evaluate()'s)."""
    sink = evaluate(variant.sink, env, float_dtype=dtype, gather=gather, clamp=clamp)
    device = env["b"].device
    return torch.as_tensor(sink, device=device).to(dtype).expand(p.batch, p.heads_q, p.len_q, 1)


def reference(variant: ir.Variant, q, k, v, /, *positional, return_lse: bool = False,
              dropout_seed: int | None = None, training: bool = True, q_offset: int = 0,
              k_offset: int = 0, layout: str | None = None, **inputs):
    """Attention of `variant` computed densely; differentiable in q, k, v and float inputs.

    Tensors are (batch, heads, seq, dim), or (batch, seq, heads, dim) with layout="bshd"
    (the output too; the LSE is (batch, heads, seq) in both). Computes in the dtype of q
    (use float64 for ground truth). A query that attends to no key gets output 0 and
    LSE -inf, and zero gradients; with a `sink` its LSE is the sink σ. With dropout, `dropout_seed` must be given: the same
    seed gives the same mask as the kernels; `training=False` leaves dropout out, as the
    kernels do.
    """
    if positional:
        refuse_positional(variant, positional)
    check_return_lse(variant, return_lse)
    if not training and variant.dropout:
        variant = dataclasses.replace(variant, dropout=None)
    p = bind(variant, q, k, v, inputs, q_offset=q_offset, k_offset=k_offset,
             exact_float_inputs=False, layout=layout)
    q, k, v = (as_bhsd(t, layout) for t in (q, k, v))
    if variant.dropout and dropout_seed is None:
        raise CallError(f"the variant has dropout {variant.dropout}: pass dropout_seed=int "
                        "so the reference draws the same mask as the kernel")
    refuse_seed_without_dropout(variant, dropout_seed)
    if dropout_seed is not None:
        dropout_seed = check_seed(dropout_seed)
    dtype, device = q.dtype, q.device
    env = index_env(variant, p, inputs, device, dtype)
    group = p.group
    k_full = k.repeat_interleave(group, dim=1)  # [B, Hq, Lk, D]
    v_full = v.repeat_interleave(group, dim=1)  # [B, Hq, Lk, Dv]

    s = torch.matmul(q, k_full.transpose(-1, -2)) * scale_value(variant, p.dim, p.dim_v)  # [B, Hq, Lq, Lk]
    allowed = allowed_pairs(variant, p, inputs, device).expand_as(s)
    if variant.score is not None and s.numel():
        # A score that does not read s (`score 0.0`) evaluates to a CPU scalar: place it.
        # Gated to the allowed pairs: a masked pair's score adds nothing to any gradient,
        # even where its derivative is inf or NaN.
        s = torch.as_tensor(evaluate(variant.score, {**env, "s": s}, float_dtype=dtype,
                                     gate=allowed), device=device).to(dtype)
        s = s.expand(p.batch, p.heads_q, p.len_q, p.len_k)
    if variant.normalize != ir.SOFTMAX:
        return _weighted(variant, s, allowed, v_full, env, return_lse, layout)

    neg_inf = torch.tensor(-math.inf, dtype=dtype, device=device)
    # A score of -inf (an additive float mask's) attends to nothing, as a masked pair: a
    # row whose scores are all -inf is empty, 0 with LSE -inf, as in the kernels.
    allowed = allowed & (s != neg_inf)
    row_any = allowed.any(dim=-1, keepdim=True)  # [B, Hq, Lq, 1]
    if variant.sink is None:
        # Empty rows would give exp(-inf - -inf) = NaN, in values and gradients alike: give
        # them finite stand-ins that no result reads.
        s_for_lse = torch.where(allowed, s, torch.where(row_any, neg_inf, torch.zeros_like(s)))
        lse = torch.logsumexp(s_for_lse, dim=-1, keepdim=True)
    else:
        # gpt-oss's meaning: the sink is one more column of logits, softmaxed with the
        # row's scores and dropped. Every row has it, so no row is empty: LSE = σ there,
        # but for a row with no key and a sink of -inf (a head whose sink is off), empty
        # as without a sink: finite stand-ins there too, so no -inf - -inf reaches a
        # gradient.
        s_for_lse = torch.where(allowed, s, neg_inf)
        sink = sink_logits(variant, env, p, dtype)  # [B, H, Lq, 1]
        dead = ~row_any & (sink == -math.inf)
        sink = torch.where(dead, torch.zeros_like(sink), sink)
        lse = torch.logsumexp(torch.cat([s_for_lse, sink], -1), dim=-1, keepdim=True)
        row_any = ~dead
    probs = torch.where(allowed, torch.exp(s_for_lse - lse), torch.zeros_like(s))
    if variant.dropout:
        bh = (env["b"] * p.heads_q + env["h"])
        # Absolute positions (offsets included), as the kernels hash them.
        keep = dropout_bits.keep_mask(dropout_seed, variant.dropout, bh, env["q"], env["k"])
        probs = torch.where(keep, probs / (1.0 - variant.dropout), torch.zeros_like(probs))
    out = as_bhsd(torch.matmul(probs, v_full), layout)
    if return_lse:
        return out, torch.where(row_any, lse, neg_inf).squeeze(-1)
    return out


def _weighted(variant: ir.Variant, s, allowed, v_full, env, return_lse: bool, layout):
    """`normalize sum` or `none`: each attended pair adds weight(s') V_j; `sum` divides
    by the row's sum l (LSE log l; a row whose l is 0 gives 0 and LSE -inf)."""
    check_return_lse(variant, return_lse)
    dtype = s.dtype
    w = torch.as_tensor(evaluate(variant.weight, {**env, "s": s}, float_dtype=dtype,
                                 gate=allowed), device=s.device).to(dtype).expand_as(s)
    # A masked pair adds exactly nothing, whatever weight(-inf) or its gradient would be.
    w = torch.where(allowed, w, torch.zeros_like(w))
    if variant.normalize == ir.UNNORMALIZED:
        return as_bhsd(torch.matmul(w, v_full), layout)
    l = w.sum(dim=-1, keepdim=True)  # [B, Hq, Lq, 1]
    empty = l == 0
    out = as_bhsd(torch.matmul(w / torch.where(empty, torch.ones_like(l), l), v_full), layout)
    if return_lse:
        lse = torch.where(empty, torch.full_like(l, -math.inf), torch.log(torch.where(empty, torch.ones_like(l), l)))
        return out, lse.squeeze(-1)
    return out

