"""Tile configs at run time: which a variant may run, pinned or read back, and how calls
are grouped to share one.

A config is a TileConfig (backends/tile_config.py); each backend lists its own candidates
and rules (backends/base.py). This module holds what is the runtime's: a pinned config
(`config=`, ATTNCC_CONFIG) read and checked (`pin`, `env_config`), whether a cached or
shipped one may run (`usable`), and the buckets calls share a config in (`length_bucket`,
`density_bucket`). runtime/tuning.py times the candidates.
"""
from __future__ import annotations

import json
import math
import os

from .. import backends, ir
from ..backends.tile_config import EXAMPLE, TileConfig, fits_variant


# ---------------------------------------------------------------- how calls are grouped
def length_bucket(n: int) -> int:
    """Lengths tune in power-of-two buckets: 1000 and 1024 share a config."""
    return 1 << max(4, (max(1, n) - 1).bit_length())


def density_bucket(density: float) -> str:
    """Tile density to the nearest power of two from 1/64 to 1 ("1/32" for 0.03)."""
    return f"1/{2 ** min(6, max(0, round(-math.log2(max(density, 2 ** -6)))))}"


# ---------------------------------------------------------------- pinned configs
def pin(config, variant: ir.Variant, where: str, *, portable: bool) -> TileConfig:
    """A pinned config (the dict users write), checked: the rules of every backend, the
    variant's layout, and with `portable` the portable kernels' own rules (a pin of
    another backend's kernels meets its rules at the call, where the head dim is known)."""
    config = check_pinned(TileConfig.from_dict(config, where), variant, where)
    why = backends.portable().check_config(config, "fwd", None) if portable else None
    if why is not None:
        raise ValueError(f"{where}: {why}")
    return config


def env_config() -> TileConfig | None:
    """ATTNCC_CONFIG='{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}': it pins
    the portable kernels."""
    text = os.environ.get("ATTNCC_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"ATTNCC_CONFIG is not JSON ({e}); expected e.g. {EXAMPLE}") from None
    config = TileConfig.from_dict(config, "ATTNCC_CONFIG")
    why = backends.portable().check_config(config, "fwd", None)
    if why is not None:
        raise ValueError(f"ATTNCC_CONFIG: {why}")
    return config


def check_pinned(config: TileConfig, variant: ir.Variant, where: str) -> TileConfig:
    """A pinned config must be one the kernels can run correctly for this variant."""
    if not fits_variant(config, variant):
        raise ValueError(f"{where}: tiles {config.block_m}x{config.block_n} do not nest in "
                         f"the layout's blocks of {variant.block}; a layout given as index lists "
                         f"needs BLOCK_M and BLOCK_N that divide {variant.block}")
    return config


# ---------------------------------------------------------------- configs read back
def usable(backend: str, config: TileConfig, variant: ir.Variant, head_dim: int,
           direction: str) -> bool:
    """Whether a config read back from the tuning cache or the shipped winners may run:
    one of the named backend's candidates for this variant, head dim and direction. A
    stale entry, an edited one, or one of another backend's kernels is tuned again."""
    return config in backends.named(backend).candidates(direction, head_dim, variant)
