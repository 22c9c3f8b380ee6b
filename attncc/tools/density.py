"""Dense classifications for reports: the pairs a variant allows (from the reference's
mask) and the fraction of tiles holding any of them. O(len_q * len_k): for the
`compile --len` estimate and the tests, never for the kernels."""
from __future__ import annotations

import math

import torch

from .. import ir
from ..arguments import Problem


def tile_visit_fraction(allowed: torch.Tensor, block_m: int, block_n: int) -> tuple:
    """(visited, total) tiles of a dense mask [..., Lq, Lk], averaged over the leading dims.

    A tile is visited when any of its pairs attends (the dense classification; the
    kernels' analytic bounds may visit a few more)."""
    *lead, len_q, len_k = allowed.shape
    qt, kt = math.ceil(len_q / block_m), math.ceil(len_k / block_n)
    padded = torch.nn.functional.pad(allowed.to(torch.uint8), (0, kt * block_n - len_k,
                                                               0, qt * block_m - len_q))
    tiles = padded.view(*lead, qt, block_m, kt, block_n).amax(dim=(-3, -1))  # [..., QT, KT]
    n_lead = math.prod(lead) if lead else 1
    return tiles.sum().item() / n_lead, qt * kt


def dense_allowed(variant: ir.Variant, p: Problem, inputs: dict, device="cpu") -> torch.Tensor:
    """reference.allowed_pairs, broadcast over at most the batch and head dims it uses."""
    from ..semantics.reference import allowed_pairs
    a = allowed_pairs(variant, p, inputs, device)
    return a.expand(*a.shape[:2], p.len_q, p.len_k)
