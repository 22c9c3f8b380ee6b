"""The dropout mask: a counter-based hash of (seed, batch·head, query, key).

Kernels recompute the same bits in the forward and the backward instead of storing an
S×S mask, and the reference computes them here, bit for bit, from the same seed. The
hash is murmur3's 32-bit finaliser applied three times; PyTorch has no wrapping uint32
multiply, so it runs in int64 and keeps the low 32 bits after each step.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
C1, C2 = 0x85EBCA6B, 0xC2B2AE35


def fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * C1) & MASK32
    x = x ^ (x >> 13)
    x = (x * C2) & MASK32
    return x ^ (x >> 16)


def threshold(p: float) -> int:
    """Keep an element when its hash is >= this: a fraction 1 - p of 2**32."""
    return min(MASK32, int(round(p * 2.0 ** 32)))


def keep_mask(seed: int, p: float, bh: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """True where an element survives; bh, q, k broadcast (local indices, int64)."""
    row = fmix32(fmix32((seed & MASK32) ^ fmix32(bh)) ^ q)
    return fmix32(row ^ k) >= threshold(p)
