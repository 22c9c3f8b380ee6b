"""What `kernel.decode` computes, densely: the float64 reference of decoding (a cache,
new tokens appended, the last rows of the query sequence), one batch row at a time
through attncc.reference."""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import ir
from ..arguments import check_cache_length, check_cache_seqlens, check_return_lse
from .reference import reference as reference_rows


def gather_cache(cache: torch.Tensor, block_table, b: int, length: int) -> torch.Tensor:
    """Row b's first `length` cached positions as (kv_heads, length, dim)."""
    if block_table is None:
        return cache[b, :, :length]
    num_pages, page_size = cache.shape[:2]
    pos = torch.arange(length, device=cache.device)
    # An entry outside [0, num_pages) reads the page clamped into range, as the kernels do.
    pages = block_table[b].long()[pos // page_size].clamp(0, num_pages - 1)
    return cache[pages, pos % page_size].transpose(0, 1)  # (length, kv_heads, dim) -> heads first


def decode_reference(variant: ir.Variant, q, /, k_cache, v_cache, *, cache_seqlens, k_new=None,
                     v_new=None, block_table=None, return_lse: bool = False, **inputs):
    """What `kernel.decode` computes, densely, one batch row at a time: the row's cache
    (gathered through block_table when paged) with k_new, v_new appended is the key
    sequence of L tokens; q fills the last n_q rows of an L-row query sequence (the others
    are zeros, and unused); attncc.reference gives the rows. Computes in q's dtype (use
    float64 for truth); never writes the cache. Dropout is left out, as decoding does.
    Out-of-contract values read as the kernels read them: a tensor's lengths clamped to
    [0, capacity] (new tokens past the capacity dropped), block-table entries clamped to
    [0, num_pages); an int length outside the cache is refused, as kernel.decode refuses it.

    A variant that does not read len_q gets the same rows from attncc.reference with
    q_offset = L - n_q, which costs n_q x L per head instead of L x L (long caches)."""
    check_return_lse(variant, return_lse)
    variant = dataclasses.replace(variant, dropout=None)
    reads_len_q = any("len_q" in ir.free_vars(e) for e in (variant.mask, variant.score,
                                                              variant.layout, variant.weight)
                      if e is not None)

    def reference(*args, return_lse, **kwargs):
        # `normalize none` has no LSE: the kernels' is -inf, which nothing reads.
        if variant.normalize != ir.UNNORMALIZED:
            return reference_rows(*args, return_lse=return_lse, **kwargs)
        o = reference_rows(*args, **kwargs)
        return o, torch.full(o.shape[:-1], -math.inf, dtype=o.dtype, device=o.device)

    B, Hq, n_q, D = q.shape
    capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                else k_cache.shape[2])
    # An int is checked as kernel.decode checks it; a tensor's lengths are clamped to
    # [0, capacity], as the kernels read them.
    cache_seqlens = check_cache_seqlens(cache_seqlens, B)
    if isinstance(cache_seqlens, int):
        check_cache_length(cache_seqlens, capacity, 0 if k_new is None else k_new.shape[2])
    lengths = [min(max(int(x), 0), capacity) for x in
               ([cache_seqlens] * B if isinstance(cache_seqlens, int) else cache_seqlens.tolist())]
    outs, lses = [], []
    for b in range(B):
        keys = [gather_cache(k_cache, block_table, b, lengths[b]).to(q.dtype)]
        values = [gather_cache(v_cache, block_table, b, lengths[b]).to(q.dtype)]
        if k_new is not None:
            keys.append(k_new[b].to(q.dtype))
            values.append(v_new[b].to(q.dtype))
        k_row = torch.cat(keys, 1)[None]  # (1, Hkv, L, D)
        v_row = torch.cat(values, 1)[None]
        L = min(k_row.shape[2], capacity)
        k_row, v_row = k_row[:, :, :L], v_row[:, :, :L]
        out = q.new_zeros((1, Hq, n_q, v_row.shape[3]))
        lse = torch.full((1, Hq, n_q), -math.inf, dtype=q.dtype, device=q.device)
        seen = min(n_q, L)  # tokens at positions >= 0: the last `seen` of the n_q
        if seen:
            row_inputs = _row_inputs(variant, inputs, b, L)
            if reads_len_q:
                q_rows = q.new_zeros((1, Hq, L, D))
                q_rows[:, :, L - seen:] = q[b:b + 1, :, n_q - seen:]
                o, s = reference(variant, q_rows, k_row, v_row, return_lse=True,
                                 layout="bhsd", **row_inputs)
                o, s = o[:, :, L - seen:], s[:, :, L - seen:]
            else:
                o, s = reference(variant, q[b:b + 1, :, n_q - seen:], k_row, v_row,
                                 q_offset=L - seen, return_lse=True, layout="bhsd", **row_inputs)
            out[:, :, n_q - seen:] = o
            lse[:, :, n_q - seen:] = s
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out


def _row_inputs(variant: ir.Variant, inputs: dict, b: int, L: int) -> dict:
    """The inputs of batch row b for a sequence of L tokens: batch axes at b, position and
    tile axes cut to L (index lists drop tiles past it: they hold no key)."""
    lists = ir.index_lists(variant.layout)
    out = {}
    for decl in variant.inputs:
        t = inputs[decl.name]
        for axis, a in enumerate(decl.axes):
            if a == "b":
                t = t.narrow(axis, b, 1)
            elif a in ("q", "k"):
                t = t.narrow(axis, 0, L)
            elif a in ("qb", "kb"):
                t = t.narrow(axis, 0, -(-L // variant.block))
        if decl.name in lists:  # entries naming no block of the L keys match nothing
            n_tiles = -(-L // variant.block)
            t = torch.where((t >= n_tiles) | (t < -1), torch.full_like(t, -1), t)
        out[decl.name] = t
    return out
