"""Tile configs: what one is, which a variant may run, and in what order to try them.

A config is a dict {BLOCK_M, BLOCK_N, num_warps, num_stages} (plain data: the generated
modules read it, the tuning cache stores it as JSON). This module owns its keys and
their checks (`check_config`; a pinned or cached one must also suit the variant:
`check_pinned`, `usable`), the candidates per direction and the `keep()` rule, and how
a config is written in progress lines (`label`, `describe`), and how calls are grouped
to share one (`length_bucket`, `density_bucket`). runtime/tuning.py times them;
backends/gluon/codegen.py lists the Gluon forward's own.
"""
from __future__ import annotations

import json
import math
import os

from .. import ir

KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


# ---------------------------------------------------------------- how calls are grouped
def length_bucket(n: int) -> int:
    """Lengths tune in power-of-two buckets: 1000 and 1024 share a config."""
    return 1 << max(4, (max(1, n) - 1).bit_length())


def density_bucket(density: float) -> str:
    """Tile density to the nearest power of two from 1/64 to 1 ("1/32" for 0.03)."""
    return f"1/{2 ** min(6, max(0, round(-math.log2(max(density, 2 ** -6)))))}"


# ---------------------------------------------------------------- configs
def env_config():
    """ATTNCC_CONFIG='{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}'."""
    text = os.environ.get("ATTNCC_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"ATTNCC_CONFIG is not JSON ({e}); expected e.g. "
                         '{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}') from None
    return check_config(config, "ATTNCC_CONFIG")


def check_config(config: dict, where: str) -> dict:
    """A config a launch can take: tiles and warps powers of two in range, stages >= 1."""
    want = set(KEYS)
    if not isinstance(config, dict) or set(config) != want:
        raise ValueError(f"{where} must be a dict with exactly the keys {sorted(want)}, got {config!r}")
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    for key in ("BLOCK_M", "BLOCK_N"):
        v = config[key]
        if not is_int(v) or v < 16 or v > 256 or v & (v - 1):
            raise ValueError(f"{where}: {key} must be a power of two from 16 to 256, got {v!r}")
    # 9: the Gluon forward's warp-specialized kernel (backends/gluon/codegen.py, WS_WARPS).
    if config["num_warps"] not in (1, 2, 4, 8, 9, 16) or not is_int(config["num_warps"]):
        raise ValueError(f"{where}: num_warps must be 1, 2, 4, 8 or 16 (or 9: the Gluon "
                         f"forward's warp-specialized kernel), got {config['num_warps']!r}")
    if not is_int(config["num_stages"]) or not 1 <= config["num_stages"] <= 8:
        raise ValueError(f"{where}: num_stages must be an int from 1 to 8, "
                         f"got {config['num_stages']!r}")
    return dict(config)


def within_block(config: dict, variant: ir.Variant) -> bool:
    return config["BLOCK_M"] <= variant.block and config["BLOCK_N"] <= variant.block


def needs_tileswithin_block(variant: ir.Variant) -> bool:
    # An index list (`kb in t[...]`) says which blocks are on, not which positions, so
    # kernel tiles must nest inside its blocks (each tile on or off as a whole). Other
    # layouts are evaluated per element in tiles that span several blocks.
    return variant.block is not None and bool(ir.index_lists(variant.layout))


def check_pinned(config: dict, variant: ir.Variant, where: str) -> dict:
    """A pinned config must be one the kernels can run correctly for this variant."""
    if needs_tileswithin_block(variant) and not within_block(config, variant):
        raise ValueError(f"{where}: tiles {config['BLOCK_M']}x{config['BLOCK_N']} are larger than "
                         f"the layout's block {variant.block}; a layout given as index lists "
                         f"needs BLOCK_M and BLOCK_N of at most {variant.block}")
    return config


def kept_candidates(variant: ir.Variant, head_dim: int, direction: str) -> list:
    """The candidates keep() allows, in the order they are tried (the tuner times the
    first few, runtime/tuning.py's TUNE_AT_MOST). With a layout, tiles within its block come first: a larger tile
    covers several blocks, visits every tile any of them is on in, and evaluates the
    layout per element; it pays for layouts whose blocks cluster (bands), and on random
    layouts of 32-blocks it ran 3x slower than 32x32 tiles (RESULTS.md run 31)."""
    if direction.startswith("gluon-"):  # the Gluon kernels' own lists (backends/gluon/codegen.py)
        from ..backends.gluon import codegen as gluon
        kept = gluon.CANDIDATES[direction](head_dim)
        if needs_tileswithin_block(variant):
            kept = [c for c in kept if within_block(c, variant)]
        return kept
    kept = [c for c in candidates(direction) if keep(c, variant, head_dim, direction)]
    if variant.block is None:
        return kept
    return ([c for c in kept if within_block(c, variant)]
            + [c for c in kept if not within_block(c, variant)])


def keep(config: dict, variant: ir.Variant, head_dim: int, direction: str) -> bool:
    """Whether a candidate can run this variant at all."""
    if needs_tileswithin_block(variant) and not within_block(config, variant):
        return False
    pad = max(16, 1 << (head_dim - 1).bit_length())
    backward = direction in ("dkdv", "dq", "bwd")
    if pad >= 256:
        if backward and (config["BLOCK_M"] * config["BLOCK_N"] > 64 * 64
                         or config["num_stages"] > 1):
            return False  # two accumulators and four tiles of 256 columns
        if direction == "fwd" and (config["BLOCK_M"] > 64 or config["num_stages"] > 2):
            return False  # K and V stages of 256 columns: 3 stages of 64 rows need 256 KiB
    if pad >= 128 and backward and config["BLOCK_M"] * config["BLOCK_N"] > 64 * 128:
        return False
    if crashes_ptxas(config, pad, direction):
        return False
    return True


def crashes_ptxas(config: dict, head_dim_pad: int, direction: str) -> bool:
    """Configs of the class whose kernels crashed ptxas (SIGSEGV, "error code -11")
    compiling for sm_90 under Triton 3.6, the GPU machine's: the kernels that keep a
    query tile and stream key tiles past it (the forward and dQ) at head dims up to 32,
    with a two-stage pipeline and query tiles of 64 rows or more. What crashed: forward
    64x32 w4 s2 at head dims 16 and 32; dQ 64x64 w4 s2 at 16, 64x64 w8 s2 and 128x64 w8
    s2 at 32 (the fault is inside ptxas; the class is what a sweep of every candidate at
    every head dim found: benchmarks/portable_compile.py --all-configs). Triton 3.9's
    ptxas compiles them, but the class is left out whatever the version, since the GPU's
    Triton may be either; the other candidates (three stages, smaller tiles) remain."""
    return (direction in ("fwd", "dq") and head_dim_pad <= 32 and config["num_stages"] == 2
            and config["BLOCK_M"] >= 64)


def candidates(direction: str) -> list:
    """Hopper-oriented candidates, most likely winner first (ATTNCC_TUNE=0 takes it)."""
    # Measured on an H100 (benchmarks/RESULTS.md, run 12): forward 128x128 tiles with 8
    # warps and 3 stages beat 64x64 by 7-9% at D = 128 (with 2 stages they lost);
    # 32x128 dK/dV tiles spill their two accumulators and ran 3.6x slower. 16x16 tiles
    # (layouts of 16-blocks scattered at random) ran 16% faster with 2 stages (run 32).
    # At low tile density (a few tiles per row) a short pipeline pays: the forward with
    # 64x32 w4 s2 beat 128x128 w8 s3 by 12% at d = 0.03 and tied at d = 0.06 (runs 37-38),
    # so it is among the four tried; 64x128 w4 s3, which it replaced there, never won.
    if direction == "fwd":
        shapes = [(128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2),
                  (128, 128, 8, 2), (64, 64, 4, 4), (64, 128, 4, 3), (32, 32, 4, 2), (16, 16, 4, 2),
                  (16, 16, 4, 1)]
    elif direction in ("dkdv", "bwd"):  # the key tile stays on chip; query tiles stream past it
        # "bwd": dK/dV and dQ in one launch (table-driven variants), one config for both;
        # dK/dV is the larger share of the work, so its candidates.
        shapes = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3),
                  (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 32, 4, 1), (16, 16, 4, 2),
                  (16, 16, 4, 1)]
    elif direction == "dq":  # the query tile stays on chip; key tiles stream past it
        shapes = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3),
                  (64, 64, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 1), (16, 16, 4, 2),
                  (16, 16, 4, 1)]
    else:
        raise ValueError(f"unknown direction {direction!r}")
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def usable(config: dict, variant: ir.Variant, head_dim: int, direction: str) -> bool:
    """Whether a config read back from the cache may run this variant: keep() and the
    pinned-config rule (an edited file must not put tiles past an index list's block)."""
    try:
        check_pinned(config, variant, "the tuning cache")
    except ValueError:
        return False
    if direction.startswith("gluon-"):
        from ..backends.gluon import codegen as gluon
        return gluon.CHECKS[direction](config, head_dim) is None
    return config["num_warps"] != 9 and keep(config, variant, head_dim, direction)


def label(config: dict) -> str:
    tiles = (f"{config['BLOCK_M']}x{config['BLOCK_N']}" if "BLOCK_M" in config
             else f"BLOCK_N {config['BLOCK_N']}")
    splits = f" {config['num_splits']} splits" if "num_splits" in config else ""
    return f"{tiles} w{config['num_warps']} s{config['num_stages']}{splits}"


def describe(config: dict) -> str:
    text = " ".join(f"{k}={config[k]}" for k in ("BLOCK_M", "BLOCK_N") if k in config)
    text += f" warps={config['num_warps']} stages={config['num_stages']}"
    return text + (f" splits={config['num_splits']}" if "num_splits" in config else "")


def sentence(config: dict) -> str:
    """A config as `attncc compile` reports it: 128x128 (8 warps, 3 stages)."""
    stages = config["num_stages"]
    return (f"{config['BLOCK_M']}x{config['BLOCK_N']} ({config['num_warps']} warps, "
            f"{stages} stage{'s' if stages != 1 else ''})")
