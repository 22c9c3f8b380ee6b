"""Tile configurations: the candidates, the keep() rule, and the choice for a call.

A config is BLOCK_M, BLOCK_N, num_warps, num_stages. `keep(config, variant, ...)`
filters the candidate list (tiles no larger than a layout's block, shared memory that
fits); `config_for` picks one per variant, head dim, dtype and direction. Under the
Triton interpreter small tiles keep the CPU tests fast.
"""
from __future__ import annotations

import json
import os

from . import ir


def _env_config():
    """ATTNCC_CONFIG='{"BLOCK_M": 64, ...}' pins a config for every kernel (debugging, tuning)."""
    text = os.environ.get("ATTNCC_CONFIG")
    return json.loads(text) if text else None


def keep(config: dict, variant: ir.Variant, head_dim: int, direction: str) -> bool:
    """Whether a candidate can run this variant at all."""
    if variant.block is not None:
        # Kernel tiles nest inside layout blocks, so a tile is on or off as a whole.
        if config["BLOCK_M"] > variant.block or config["BLOCK_N"] > variant.block:
            return False
    pad = max(16, 1 << (head_dim - 1).bit_length())
    if direction == "bwd" and pad >= 256 and config["BLOCK_M"] * config["BLOCK_N"] > 64 * 64:
        return False  # dK, dV, K, V and a Q tile of 256 columns overflow shared memory
    if direction == "fwd" and pad >= 256 and (config["BLOCK_M"] > 64 or config["num_stages"] > 2):
        return False  # K and V stages of 256 columns: 3 stages of 64 rows need 256 KiB
    return True


def candidates(direction: str) -> list:
    if direction == "fwd":
        shapes = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                  (64, 32, 4, 2), (32, 32, 4, 2), (16, 16, 4, 1)]
    else:
        shapes = [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2),
                  (32, 32, 4, 1), (16, 16, 4, 1)]
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def config_for(kernel, problem, dtype, direction: str) -> dict:
    pinned = kernel.pinned_config or _env_config()
    if pinned:
        return dict(pinned)
    from .runtime import interpreting
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    for config in candidates(direction):
        if keep(config, kernel.variant, problem.dim, direction):
            return config
    raise AssertionError("no tile configuration fits; the smallest should always be kept")
