"""chance(p, key, ...): a random block pattern drawn from a seed, as a layout expression.

The keys (a seed param, b, h, qb, kb: integers) are hashed with dropout's 32-bit
finaliser (attncc/dropout.py), one after another from a fixed start, and a block is on
when the hash's top 24 bits fall under round(p * 2**24). The host's tile tables, the
kernels (for tiles spanning several blocks) and the reference compute the same bits,
so the pattern is exact everywhere; an integer threshold, not a float comparison,
keeps fp32 and fp64 from disagreeing at the edge.
"""
from __future__ import annotations

import torch

from . import ir
from .dropout import MASK32, fmix32

START = 0x2545F491  # below 2**31, like dropout's multipliers, so Triton keeps it uint32
BITS = 24


def probability(call: ir.Call, params: dict):
    """p of chance(p, ...): a number literal or a number param (params: name -> value);
    None for anything else, which the checker refuses."""
    p = call.args[0]
    if isinstance(p, ir.Const) and p.type in (ir.INT, ir.FLOAT):
        return p.value
    value = params.get(p.name) if isinstance(p, ir.Param) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def threshold(p: float) -> int:
    """A block is on when (hash >> 8) < this: a fraction p of all hashes."""
    return int(round(p * 2 ** BITS))


def chance(p: float, *keys) -> torch.Tensor:
    """bool, broadcast over the keys (ints or integer tensors)."""
    h = fmix32((torch.as_tensor(keys[0]).long() & MASK32) ^ START)
    for key in keys[1:]:
        h = fmix32(h ^ (torch.as_tensor(key).long() & MASK32))
    return (h >> (32 - BITS)) < threshold(p)
