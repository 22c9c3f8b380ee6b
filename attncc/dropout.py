"""The dropout mask: a counter-based hash of (seed, batch·head, query position, key position).

Kernels recompute the same bits in the forward and the backward instead of storing an
S×S mask, and the reference computes them here, bit for bit, from the same seed. The
hash is a murmur3-style 32-bit finaliser applied three times, with multipliers below
2**31 so that Triton keeps them uint32 on every version. PyTorch has no wrapping uint32
multiply, so here it runs in int64 and keeps the low 32 bits after each step.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
C1, C2 = 0x7FEB352D, 0x1B873593


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * C1) & MASK32
    x = x ^ (x >> 15)
    x = (x * C2) & MASK32
    return x ^ (x >> 16)


def threshold(p: float) -> int:
    """Keep an element when its hash's top 31 bits are >= this: a fraction 1 - p.

    31 bits, not 32, so that the comparison fits int32 in every Triton version."""
    return min(2 ** 31 - 1, int(round(p * 2.0 ** 31)))


def keep_mask(seed: int, p: float, bh: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """True where an element survives; bh, q, k broadcast (int64). q and k are absolute
    positions (offsets included), so a call placed inside a longer sequence with
    q_offset/k_offset drops the same elements as the whole sequence's call."""
    row = fmix32(fmix32((seed & MASK32) ^ fmix32(bh)) ^ q)
    return (fmix32(row ^ k) >> 1) >= threshold(p)
