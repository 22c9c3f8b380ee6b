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
    kept = [c for c in candidates(direction, head_dim) if keep(c, variant, head_dim, direction)]
    if variant.block is None:
        return kept
    return ([c for c in kept if c.within(variant.block)]
            + [c for c in kept if not c.within(variant.block)])


def held_width(head_dim: int) -> int:
    """The columns the kernels hold for a q·k head dim: its power-of-two segments, as the
    generated module's _head_dim_split cuts it (192 = 128 + 64: 192; 80 = 64 + 16: 80;
    200 = 128 + 128: 256), not the next power of two."""
    first = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - first
    return first + (max(16, 1 << (rest - 1).bit_length()) if rest > 0 else 0)


def two_wide_segments(head_dim: int) -> bool:
    """A head dim the kernels hold as 128 plus a segment of 16 to 64 (129 to 192; DeepSeek's
    q·k 192): its own candidates (WIDE_SEGMENTS), neither 128's nor a padded 256's."""
    return 128 < held_width(head_dim) < 256


def keep(config: TileConfig, variant: ir.Variant, head_dim: int, direction: str) -> bool:
    """Whether a candidate can run this variant at all."""
    if not fits_variant(config, variant):
        return False
    if two_wide_segments(head_dim):
        return True  # WIDE_SEGMENTS holds only configs that fit (measured there)
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


# Head dims held as 128 + a smaller segment (two_wide_segments): per direction, most
# likely winner first, the tuner timing the first four. Chosen from ptxas's report for
# sm_90 (Triton 3.6, bf16, the causal example's kernels at q·k 192, v 128, compiled on the
# CPU: benchmarks/portable_compile.py's driver), since the padded-256 rules allowed only
# 32x32 single-stage backward tiles (the backward at 16K ran 4.6x cuDNN, RESULTS.md run
# 143). dK/dV holds K and V (192 + 128 columns) and accumulates dK and dV in fp32 (64
# rows: 80 KiB): with 4 warps every tile spilled 0.7-1.4 KB per thread; with 8, 32x128
# (FlashAttention-2's Triton dK/dV shape: 32 queries past 128 keys) spilled 272 B at 123
# KB of shared memory, 64x64 600 B, 32x64 68 B, 64x128 700 B; 3 stages doubled each
# spill. dQ holds Q, dO and dQ: 128x64 w8 compiled without spills at 3 stages (205 KB of
# shared memory) and 2 (164 KB), 64x64 w8 s2 too (123 KB); 64x128 s3 needs 287 KB. The
# forward holds Q and the output's accumulator (v's width): 64x64 w4 s3 (147 KB), 128x128
# w8 s2 (213 KB) and 128x64 w8 s2 without spills; 64x32 w4 s2, what the padded rules
# ran (3.43 ms at 16K), stays among the four timed.
WIDE_SEGMENTS = {
    "fwd": [(64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2),
            (16, 16, 4, 1)],
    "dkdv": [(32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 8, 2), (64, 128, 8, 2), (32, 32, 4, 1),
             (16, 16, 4, 1)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 1),
           (16, 16, 4, 1)],
}
WIDE_SEGMENTS["bwd"] = WIDE_SEGMENTS["dkdv"]  # one config for both roles: dK/dV's, the larger share


def candidates(direction: str, head_dim: int | None = None) -> list:
    """Hopper-oriented candidates, most likely winner first (ATTNCC_TUNE=0 takes it);
    `head_dim` (the wider of q·k's and v's) picks WIDE_SEGMENTS' lists where it applies."""
    if head_dim is not None and two_wide_segments(head_dim):
        if direction not in WIDE_SEGMENTS:
            raise ValueError(f"unknown direction {direction!r}")
        return [TileConfig(*shape) for shape in WIDE_SEGMENTS[direction]]
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
