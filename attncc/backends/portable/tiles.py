"""The portable kernels' tile configs: the candidates per direction, in the order they are
tried, the `keep()` rule that drops those a variant or head dim cannot run, and the
warps a launch takes."""
from __future__ import annotations

from ... import ir
from ..tile_config import TileConfig, fits_variant

WARPS = (1, 2, 4, 8, 16)  # Triton lays a block's threads out in powers of two of warps


def check_config(config: TileConfig) -> str | None:
    """Why the portable kernels cannot launch `config`, or None."""
    if config.num_warps not in WARPS:
        return (f"num_warps must be {', '.join(map(str, WARPS[:-1]))} or {WARPS[-1]} for the "
                f"portable kernels, got {config.num_warps}")
    if config.block_m & (config.block_m - 1):  # tl.arange spans a power of two
        return (f"BLOCK_M {config.block_m} is the Gluon forward's (three warpgroups); the "
                "portable kernels need BLOCK_M a power of two")
    return None


def kept_candidates(variant: ir.Variant, head_dim: int, direction: str) -> list:
    """The candidates keep() allows, in the order they are tried (the tuner times the
    first few, runtime/tuning.py's TUNE_AT_MOST). With a layout, tiles within its block
    come first: a larger tile covers several blocks, visits every tile any of them is on
    in, and evaluates the layout per element; it pays for layouts whose blocks cluster
    (bands), and on random layouts of 32-blocks it ran 3x slower than 32x32 tiles
    (RESULTS.md run 31)."""
    kept = [c for c in candidates(direction) if keep(c, variant, head_dim, direction)]
    if variant.block is None:
        return kept
    return ([c for c in kept if c.within(variant.block)]
            + [c for c in kept if not c.within(variant.block)])


def keep(config: TileConfig, variant: ir.Variant, head_dim: int, direction: str) -> bool:
    """Whether a candidate can run this variant at all."""
    if not fits_variant(config, variant):
        return False
    pad = max(16, 1 << (head_dim - 1).bit_length())
    backward = direction in ("dkdv", "dq", "bwd")
    if pad >= 512:  # v 512 wide (head_dim is the wider of q·k's and v's): one fp32 row is 2 KiB
        if backward and (config.block_m * config.block_n > 32 * 32 or config.num_stages > 1):
            return False
        if direction == "fwd" and (config.block_m * config.block_n > 64 * 32 or config.num_stages > 2):
            return False
    if pad >= 256:
        if backward and (config.block_m * config.block_n > 64 * 64 or config.num_stages > 1):
            return False  # two accumulators and four tiles of 256 columns
        if direction == "fwd" and (config.block_m > 64 or config.num_stages > 2):
            return False  # K and V stages of 256 columns: 3 stages of 64 rows need 256 KiB
    if pad >= 128 and backward and config.block_m * config.block_n > 64 * 128:
        return False
    if crashes_ptxas(config, pad, direction):
        return False
    return True


def crashes_ptxas(config: TileConfig, head_dim_pad: int, direction: str) -> bool:
    """Configs of the class whose kernels crashed ptxas (SIGSEGV, "error code -11")
    compiling for sm_90 under Triton 3.6, the GPU machine's: the kernels that keep a
    query tile and stream key tiles past it (the forward and dQ) at head dims up to 32,
    with a two-stage pipeline and query tiles of 64 rows or more. What crashed: forward
    64x32 w4 s2 at head dims 16 and 32; dQ 64x64 w4 s2 at 16, 64x64 w8 s2 and 128x64 w8
    s2 at 32 (the fault is inside ptxas; the class is what a sweep of every candidate at
    every head dim found: benchmarks/portable_compile.py --all-configs). Triton 3.9's
    ptxas compiles them, but the class is left out whatever the version, since the GPU's
    Triton may be either; the other candidates (three stages, smaller tiles) remain."""
    return (direction in ("fwd", "dq") and head_dim_pad <= 32 and config.num_stages == 2
            and config.block_m >= 64)


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
    return [TileConfig(*shape) for shape in shapes]
