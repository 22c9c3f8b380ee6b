"""The gradient of a variant's `sink` (one extra logit σ per query row, gpt-oss's
learnable sinks), computed outside the kernels from what the backward has already.

With L = log(Σ_j e^s'_j + e^σ) and O = Σ_j P_j V_j, σ changes O only through L:
dO/dσ = -e^(σ-L)·O and dL/dσ = e^(σ-L). So dσ = -e^(σ-L)·(δ - dL), where δ - dL is
exactly the `delta` the dQ kernels (or backward_delta) store per row, the LSE's
gradient folded in (δ = rowsum(dO·O)). The dQ and dK/dV kernels need nothing new: they
read L, which holds the sink already.

dσ is per (b, h, q) row; the learnable inputs the sink reads take it through σ's
expression (torch.func.vjp: the backward op runs below autograd, where tensors record
no graph). Reads of an input reduce into its gradient in a fixed order, never with
atomics (index_add_ and scatter_add_ are atomic on CUDA): the gradient is the same, bit
for bit, on every call.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import ir
from ..analysis import sink_reads
from ..arguments import Problem
from ..semantics.reference import index_env, sink_logits

# Elements of one chunk's [reads, table entries] comparison in the fixed-order reduction.
_CHUNK_ELEMENTS = 1 << 24


def fixed_order_sum(values: torch.Tensor, flat_index: torch.Tensor, size: int) -> torch.Tensor:
    """out[t] = Σ values[i] over i with flat_index[i] == t, summed in one fixed order with
    no atomics. A few reads of a small table (a sink per head: the reads are reduced over
    b and q before they get here) compare every read with every entry, in chunks, and
    sum each entry's column; many reads of a large one (a sink per row) are sorted by
    entry (a stable sort) and each entry's run summed as a difference of float64 prefix
    sums, then written once per entry."""
    dtype, values, flat_index = values.dtype, values.reshape(-1).double(), flat_index.reshape(-1)
    if values.numel() * size <= _CHUNK_ELEMENTS * 4:
        entries = torch.arange(size, device=values.device)
        out = values.new_zeros(size)
        step = max(1, _CHUNK_ELEMENTS // max(size, 1))
        for start in range(0, values.numel(), step):
            hit = flat_index[start:start + step, None] == entries
            out = out + torch.where(hit, values[start:start + step, None], 0.0).sum(0)
        return out.to(dtype)
    order = torch.sort(flat_index, stable=True).indices
    index = flat_index[order]
    sums = torch.cat([values.new_zeros(1), values[order].cumsum(0)])
    last = torch.ones_like(index, dtype=torch.bool)  # the last read of each entry's run
    last[:-1] = index[1:] != index[:-1]
    ends = torch.nonzero(last).flatten() + 1
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    out = values.new_zeros(size)
    out[index[ends - 1]] = sums[ends] - sums[starts]
    return out.to(dtype)


class _FixedOrderGather(torch.autograd.Function):
    """table.reshape(-1)[flat_index], whose backward sums the gradients of the reads of
    each entry with fixed_order_sum (the indexing's own backward accumulates with
    index_put_, which need not be deterministic on CUDA)."""

    @staticmethod
    def forward(table, flat_index):
        return table.reshape(-1)[flat_index]

    @staticmethod
    def setup_context(ctx, inputs, output):
        table, flat_index = inputs
        ctx.save_for_backward(flat_index)
        ctx.table_shape = table.shape

    @staticmethod
    def backward(ctx, grad):
        (flat_index,) = ctx.saved_tensors
        size = 1
        for n in ctx.table_shape:
            size *= n
        return fixed_order_sum(grad, flat_index, size).view(ctx.table_shape), None


def _gather(table: torch.Tensor, indices: tuple) -> torch.Tensor:
    flat = torch.zeros_like(indices[0])
    for index, n in zip(indices, table.shape):
        flat = flat * n + index
    return _FixedOrderGather.apply(table, flat)


def sinks_at(variant: ir.Variant, problem: Problem, values: dict, device, positions=None,
             gather=None) -> torch.Tensor:
    """σ of the call's rows, [B, H, Lq] fp32: at the problem's query positions, or at the
    absolute `positions` (a 1-d tensor: a context-parallel rank's rows)."""
    if positions is not None:
        problem = dataclasses.replace(problem, len_q=positions.numel(), q_offset=0)
    env = index_env(variant, problem, values, device, torch.float32)
    if positions is not None:
        env["q"] = positions.to(device).view(1, 1, -1, 1)
    # Reads clamped as the kernels clamp them: the forward ran with those values.
    return sink_logits(variant, env, problem, torch.float32, gather=gather, clamp=True)[..., 0]


def row_sinks(variant: ir.Variant, problem: Problem, values: dict, like: torch.Tensor):
    """σ of every row, [B, H, Lq] fp32 on `like`'s device: the LSE of rows that see no key."""
    if not like.numel():
        return like
    return sinks_at(variant, problem, values, like.device).contiguous()


def merge_sink(variant: ir.Variant, problem: Problem, values: dict, out: torch.Tensor,
               lse: torch.Tensor, positions: torch.Tensor):
    """Fold the sink into attention computed without it, in place: out [B, H, L, D] and
    lse [B, H, L] (fp32, rows at the absolute `positions`) become the variant's. The
    merge of a key set holding one key of logit σ and no value: exact, and NaN-free
    where the row saw no key (LSE -inf there becomes σ)."""
    sink = sinks_at(variant, problem, values, lse.device, positions)
    merged = torch.logaddexp(lse, sink)
    # e^(lse - merged), 1 where both are -inf (no key, a sink of -inf): not e^NaN.
    out.mul_(torch.exp(_difference(lse, merged)).unsqueeze(-1))
    lse.copy_(merged)


def _per_variant(decide):
    """`decide(variant)`, remembered per variant object: every backward of a sink asks,
    and a frozen Variant hashes its whole expression tree on every lookup (~8 us), so
    the memory is keyed by identity and holds the variant (its id stays its own)."""
    memory: dict = {}

    def decided(variant: ir.Variant):
        kept = memory.get(id(variant))
        if kept is None or kept[0] is not variant:
            if len(memory) >= 64:
                memory.pop(next(iter(memory)), None)
            kept = memory[id(variant)] = (variant, decide(variant))
        return kept[1]
    return functools.wraps(decide)(decided)


# Remembered per variant: every backward of a sink asks.
sink_learnables = _per_variant(sink_reads.sink_learnables)
_direct_form = _per_variant(sink_reads.direct_sink_read)


def add_sink_gradients(variant: ir.Variant, problem: Problem, values: dict, lse: torch.Tensor,
                       delta: torch.Tensor, dinputs: dict, positions=None) -> dict:
    """`dinputs` ({learnable input: gradient}, from the kernels; an input only the sink
    reads may be absent) with the sink's gradient added. `lse`, `delta`: the forward's
    LSE and the backward's delta (δ - dLSE), [B, H, Lq] fp32; `positions`: as sinks_at's."""
    names = sink_learnables(variant)
    if not names:
        return dinputs
    direct = _direct_read(variant, problem, values)
    if direct is not None:
        return _add_direct_gradient(variant, values, lse, delta, dinputs, direct)
    device = lse.device
    fixed = {n: t for n, t in values.items() if n not in names}

    def sigma(*learnable):
        inputs = dict(fixed, **dict(zip(names, learnable)))
        return sinks_at(variant, problem, inputs, device, positions, gather=_gather)

    leaves = [values[n].detach().float() for n in names]
    sink, pullback = torch.func.vjp(sigma, *leaves)
    d_sink = -torch.exp(_difference(sink, lse)) * delta  # [B, H, Lq]
    out = dict(dinputs)
    for name, grad in zip(names, pullback(d_sink)):
        dtype = values[name].dtype
        earlier = out.get(name)
        out[name] = (grad if earlier is None else earlier.float() + grad).to(dtype)
    return out


_ROW_AXES = sink_reads.ROW_AXES


def _direct_read(variant: ir.Variant, problem: Problem, values: dict):
    """(input, its row axes) where the sink is one learnable input read as-is at distinct
    row index names that are also its declared axes (gpt-oss's `sinks[h]`, `s[b, h]`),
    else None. Such a sink's gradient is dσ summed over the rows' other axes: no
    expression to differentiate, and none of the general path's host work (a vjp through
    the evaluator costs about 2 ms a call, more than the kernels at short lengths)."""
    form = _direct_form(variant)
    if form is None or form[0] not in values:
        return None
    sizes = {"b": problem.batch, "h": problem.heads_q}
    if tuple(values[form[0]].shape) != tuple(sizes[a] for a in form[1]):
        return None
    return form


def _add_direct_gradient(variant, values, lse, delta, dinputs, direct) -> dict:
    name, axes = direct
    table = values[name]
    # σ broadcast over lse's [B, H, Lq]: the table's axes in row order, size 1 elsewhere.
    in_row_order = sorted(axes, key=_ROW_AXES.get)
    reordered = tuple(in_row_order) != axes  # s[h, b]; sinks[h] and s[b, h] are in order
    sigma = table.detach().float()
    if reordered:
        sigma = sigma.permute(*(axes.index(a) for a in in_row_order))
    shape = [1, 1, 1]
    for a in in_row_order:
        shape[_ROW_AXES[a]] = sigma.shape[in_row_order.index(a)]
    # -dσ = e^(σ-L)·delta [B, H, Lq], in one buffer: three passes over the rows and no more
    # (each a launch on a GPU; at short lengths the host time of launches is the cost).
    minus_d_sink = _difference(sigma.reshape(shape), lse).exp_().mul_(delta)
    # torch's sum reduces in a fixed order (no atomics): the same bits on every call; the
    # sign flips after it, exactly (a sum of negated terms is the negated sum), in the
    # subtraction from the kernels' gradient where there is one (one launch, not two).
    summed = [d for d in range(3) if d not in {_ROW_AXES[a] for a in axes}]
    minus_grad = minus_d_sink.sum(dim=summed)  # the remaining axes, in row order
    if reordered:
        minus_grad = minus_grad.permute(*(in_row_order.index(a) for a in axes))
    out = dict(dinputs)
    earlier = out.get(name)
    grad = minus_grad.neg_() if earlier is None else earlier.float() - minus_grad
    out[name] = grad.to(table.dtype)
    return out


def _difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a - b, and 0 where they are equal: where both are -inf (a row with no key and a sink
    of -inf, whose LSE is the sink's), e^(a - b) is then 1, the derivative of the LSE by
    the sink, not NaN."""
    return torch.where(a == b, 0.0, a - b)
