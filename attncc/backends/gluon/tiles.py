"""The Gluon kernels' tile configs: each kernel's candidates, most likely winner first, and
the check a pinned, cached or shipped config must pass (wgmma's rows per warp, Hopper's
shared memory)."""
from __future__ import annotations

from ... import ir
from ..tile_config import TileConfig

SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use
# num_warps of the warp-specialized forward -> its consumer warpgroups (64 query rows
# each, BLOCK_M = 64 x consumers), beside one producer warp; the generated module's
# WS_CONSUMERS. Three consumers at head dim 64, as FlashAttention-3 runs it (192 x 128
# tiles): there a key tile's two products are small beside the softmax, and a third
# warpgroup keeps the tensor cores fed.
WS_CONSUMERS = {9: 2, 13: 3}
WS_WARPS = 9    # two consumers
WS3_WARPS = 13  # three
# Three consumers share the 64K registers four ways (168 or 160 each, beside the
# producer's warpgroup): at head dim 128 the [64, 128] fp32 output alone takes 64 of
# them, and the kernel would spill.
WS3_HEAD_DIMS = (64,)


def score_registers_heavy(variant: ir.Variant) -> bool:
    """Whether a score element costs more than the product, a compare of positions and
    a weight of the score alone: a score expression, or a mask that reads tensors.
    Compiled for sm_90 (Triton 3.6, head dim 64), three consumers on 192 x 128 tiles
    spilled for these (alibi 1.4 KB, document 0.7 KB, softcap 180 B) and not for full,
    causal, sliding window, GQA, longformer, chunked, bigbird's layout, gpt-oss's
    sinks, sigmoid and relu weights; on 192 x 64 tiles none spilled."""
    mask_reads = variant.mask is not None and ir.loaded_tensors(variant.mask)
    return bool(variant.score is not None or mask_reads)


def fits_registers(config: TileConfig, variant: ir.Variant) -> bool:
    """Whether the candidate is the three-consumer tile the variant's registers take:
    BLOCK_N 128 where score elements are light, 64 where they are heavy (other configs
    always)."""
    if WS_CONSUMERS.get(config.num_warps) != 3:
        return True
    return (config.block_n <= 64) == score_registers_heavy(variant)


# The most entries of a relative table whose diagonal sums fit the dQ kernel's registers
# at head dim 128 (T5's 32 buckets; dq_fits_registers).
DIAGONAL_ENTRIES_AT_128 = 32


def dq_fits_registers(config: TileConfig, head_dim: int, table_entries: int) -> bool:
    """Whether the dQ candidate's registers take a variant whose relative tables (summed
    per diagonal: templates/owned_gradients.jinja) have up to `table_entries` entries
    (padded; 0: none). Compiled for sm_90, T5 bidirectional and causal (32) and
    examples/relative_bias.attn (512): every BLOCK_N 128 config spilled (0.3-1.3 KB:
    [BLOCK_M, 128] fp32 score tiles leave too few registers for the diagonals' sums); at
    head dim 128, where dQ's accumulator takes 64 more, Triton 3.6 (the GPU's) spilled
    12-40 bytes with 8 warps for T5 and 40-52 bytes at every config for the 512-entry
    table (3.9 spilled none of these); the rest spilled none on either. Shared memory fits every
    candidate: the skew's change of layout adds BLOCK_M x BLOCK_N x 4 bytes to the rings
    (196 KB at most, 128x64 with three stages at head dim 128)."""
    if not table_entries:
        return True
    if config.block_n > 64:
        return False
    return head_dim < 128 or (config.num_warps == 4 and table_entries <= DIAGONAL_ENTRIES_AT_128)


# Head dims of the Gluon dQ and dK/dV kernels: each thread holds its rows of dK and dV
# (or dQ) in fp32; at 256 columns that takes two warpgroups side by side on 64 rows
# (backward_candidates' and dq_candidates' comments).
BACKWARD_HEAD_DIMS = (64, 128, 256)
# (q·k, v) head dims of the Gluon dQ and dK/dV kernels besides equal ones: DeepSeek-V3's
# training shape. Q, K, dQ and dK are 192 wide in two column segments (128 + 64, as the
# forward splits Q·K^T: a tile's shape is a power of two), V, dO and dV 128; which tiles
# fit in registers is backward_candidates' and dq_candidates' comment.
BACKWARD_HEAD_DIM_PAIRS = ((192, 128),)
# (q·k, v) head dims of the Gluon forward besides equal ones: DeepSeek-V2/V3's 192 / 128
# (the 192-wide Q·K^T is one wgmma: 12 K steps of 16) and v half of q·k. The runtime
# picks tiles by the wider of the two; q·k 192 comes only with v 128, so the candidates
# at 192 are sized for that pair, and v 64 beside q·k 128 fits wherever 128 / 128 does.
HEAD_DIM_PAIRS = ((192, 128), (128, 64))
_V_BESIDE = {192: 128}


def smem_bytes(config: TileConfig, head_dim: int, dim_v: int | None = None) -> int:
    """Q, plus NUM_STAGES slots of K and V, in 16-bit elements. `head_dim` is q·k's (the
    wider of the two) and v's `dim_v` defaults to the widest the forward takes beside it."""
    dim_v = _V_BESIDE.get(head_dim, head_dim) if dim_v is None else dim_v
    stages = config.num_stages * config.block_n
    return 2 * (head_dim * (config.block_m + stages) + dim_v * stages)


def candidates(head_dim: int) -> list:
    """Forward tile configs, most likely winner first. BLOCK_M is 16 rows per warp (a
    warpgroup per 64 rows), as the wgmma layout needs."""
    # Head dim 128 (H200, bf16, 16K tokens; benchmarks/RESULTS.md runs 78-79): the
    # warp-specialized kernel (num_warps WS_WARPS) ran full attention 1.12x faster than
    # the best single-partition config, 128x128 w8 s2, and 64x64 w4 tiles (two programs
    # per SM) came next. Every other config listed for 64 and 128 passed the GPU checks;
    # the warp-specialized kernel was not run at head dim 256, so it is not offered there.
    # Head dim 64: three consumers (192 x 128, FlashAttention-3's tile there; 192 x 64
    # where the score takes more registers: fits_registers keeps one of the two) come
    # second, after the two-consumer kernel. Both passed the GPU checks; on an H200 they
    # are within 4% of each other (192 x 128 ahead on full attention, RESULTS run 185).
    # (128, 128, WS_WARPS, 3) at head dim 64 ran full attention 1.05x slower than two stages
    # and causal no faster (run 185), so only two stages are offered there.
    shapes = {64: [(128, 128, WS_WARPS, 2), (192, 128, WS3_WARPS, 2), (192, 64, WS3_WARPS, 2),
                   (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3),
                   (64, 128, 4, 3)],
              # (128, 128, WS_WARPS, 3) first: three stages, V released two tiles back
              # between the softmax and the wait for P V, so the softmax runs under the
              # warpgroup's own product (forward.jinja); 224 KB of shared memory. On an
              # H200 it ran 1-5% faster than two stages on seven
              # of the eight ANCHORS variants, 2% slower on softcap (RESULTS runs 185-186).
              128: [(128, 128, WS_WARPS, 3), (128, 128, WS_WARPS, 2), (128, 128, 8, 2),
                    (64, 64, 4, 2), (64, 64, 4, 3),
                    (128, 64, 8, 3), (128, 64, 8, 2), (64, 128, 4, 2)],
              # (192, 128): as at 128 (the same registers: O and S are 128 wide), with the
              # tiles whose K and V slots fit beside a 192-wide Q. Passed on an H200 (run 151).
              192: [(128, 128, WS_WARPS, 2), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                    (64, 64, 4, 3), (64, 64, 4, 2)],
              256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2)]}
    configs = [TileConfig(*shape) for shape in shapes.get(head_dim, [])]
    return [c for c in configs if smem_bytes(c, head_dim) <= SMEM_LIMIT]


# The two backward kernels are mirror images: one side's tile stays on chip, split among
# the warps 16 rows each (the wgmma layout), while the other side's tiles stream through
# the ring. {kind: (held side, streamed side, name)}.
_BACKWARD_SIDES = {"dkdv": ("block_n", "block_m", "dK/dV"), "dq": ("block_m", "block_n", "dQ")}
_KEY_OF = {"block_m": "BLOCK_M", "block_n": "BLOCK_N"}  # the sides as configs are written


def _backward_smem(kind: str, config: TileConfig, head_dim: int) -> int:
    """The held tiles (two: K, V or Q, dO) plus NUM_STAGES slots of the streamed two, in
    16-bit elements: one of each pair q·k's `head_dim` wide, the other v's (the widest
    the backward takes beside it)."""
    held, streamed, _ = _BACKWARD_SIDES[kind]
    dim_v = _V_BESIDE.get(head_dim, head_dim)
    return 2 * (head_dim + dim_v) * (getattr(config, held)
                                     + config.num_stages * getattr(config, streamed))


def _check_backward(kind: str, config: TileConfig, head_dim: int | None) -> str | None:
    held, streamed, name = _BACKWARD_SIDES[kind]
    w, rows, cols = config.num_warps, getattr(config, held), getattr(config, streamed)
    # Two warpgroups may sit side by side on 64 held rows, each over half of the columns
    # (the generated module's _wgmma_layout).
    side_by_side = w == 8 and rows == 64
    if w not in (4, 8) or (rows % (16 * w) and not side_by_side) or rows > 256 or cols % 16 \
            or not 16 <= cols <= 256 or rows & (rows - 1) or cols & (cols - 1) \
            or config.num_stages < 1:
        return (f"config {config.as_dict()} does not fit the Gluon {name} kernel: it needs "
                f"num_warps 4 or 8, {_KEY_OF[held]} a power of two, a multiple of 16 * num_warps "
                f"up to 256 (or 64 on 8 warps), "
                f"{_KEY_OF[streamed]} a power of two from 16 to 256 and num_stages >= 1")
    if head_dim is not None and _backward_smem(kind, config, head_dim) > SMEM_LIMIT:
        return (f"config {config.as_dict()} needs {_backward_smem(kind, config, head_dim)} bytes "
                f"of shared memory at head dim {head_dim}; Hopper has {SMEM_LIMIT}")
    return None


def _backward_configs(kind: str, shapes: list, head_dim: int) -> list:
    configs = [TileConfig(*shape) for shape in shapes]
    return [c for c in configs if _backward_smem(kind, c, head_dim) <= SMEM_LIMIT]


def backward_fits_registers(direction: str, config: TileConfig, head_dim: int,
                            variant: ir.Variant) -> bool:
    """Whether a (192, 128) backward candidate leaves room in registers for the sums of
    the variant's learnable inputs' gradients (other candidates always). Compiled for
    sm_90 on Triton 3.6, dK/dV on 64x64 tiles spilled 28 B for a per-query and per-key
    gain (tests/test_gluon_compile.py's rows_and_keys), 32x64 did not; dQ with three
    stages spilled 4 B for a learned alibi slope, two stages did not."""
    if head_dim != 192 or direction not in ("dq", "dkdv") or not variant.learnable_inputs:
        return True
    return config.block_m <= 32 if direction == "dkdv" else config.num_stages <= 2


def check_backward_config(config: TileConfig, head_dim: int | None) -> str | None:
    """Why a config cannot run the Gluon dK/dV kernel, or None."""
    return _check_backward("dkdv", config, head_dim)


def check_dq_config(config: TileConfig, head_dim: int | None) -> str | None:
    """Why a config cannot run the Gluon dQ kernel, or None."""
    return _check_backward("dq", config, head_dim)


def backward_candidates(head_dim: int) -> list:
    """dK/dV tile configs (BLOCK_M query rows stream past BLOCK_N key rows), most likely
    winner first. Each thread holds its rows of dK and dV (fp32) and of S^T and dP^T, so
    tiles stay small."""
    # Head dim 128 (H100, bf16, 16K tokens; benchmarks/RESULTS.md run 106): 64x64 tiles
    # on 4 warps (two programs per SM) ran full and causal 8% and 5% faster than 64x128 on
    # 8 warps, 32x128 13-30% slower.
    # (192, 128): dK (192 wide) and dV (128) take 320 fp32 accumulators a key row; with
    # one warpgroup per 64 key rows that is 160 registers a thread, and every such tile
    # spilled (compiled for sm_90 on Triton 3.6, causal: 64x64 w4 660 B, 32x64 w4 92 B,
    # 64x128 w8 680 B). Two warpgroups side by side on 64 key rows halve it (FA3 spreads
    # its hdim-192 dK/dV over three warpgroups for the same reason): no spill on 3.6 or
    # 3.9 for causal, alibi, document, softcap, relative bias, gpt-oss sinks, sigmoid,
    # relu, bigbird and NSA top-k (at most 253 registers, softcap's 64x64), nor for
    # tests/test_gluon_compile.py's learnable inputs on the tiles backward_fits_registers
    # keeps; 64x64 with three stages spilled for softcap (24 B), and is not listed. 127 KB
    # of shared memory at 64x64 s2. On an H200 (benchmarks/RESULTS.md runs 165-166) every
    # listed pair of dK/dV and dQ tiles passed against float64, and at 16K causal the
    # Gluon backward took 10.06 ms against the portable split's 9.42: the tuner keeps it
    # only where it wins.
    # 256: dK and dV take 512 fp32 values a key row, 128 registers a thread with the two
    # warpgroups side by side on 64 key rows (one warpgroup per 64 rows spilled 2 KB).
    # 32x64 and 16x64 compiled for sm_90 without spills on Triton 3.6 and 3.9 for causal,
    # alibi, document, softcap, relative bias, gpt-oss sinks, sigmoid, relu, bigbird, NSA
    # top-k and the four learnable inputs of tests/test_gluon_compile.py (at most 252
    # registers, rows_and_keys' 32x64); 64x64 and 32x64 with three stages spilled for
    # alibi (8 B). FA3's hdim-256 dK/dV holds 64 key rows on two warpgroups, too. 132 KB
    # of shared memory at 32x64. Passed against float64 on an H200 (run 165); at 16K
    # causal a call padded from 192 to 256 took 16.6 ms backward (run 166; 54.3 when
    # 256 ran the portable kernels).
    shapes = {64: [(64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3)],
              128: [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2)],
              192: [(64, 64, 8, 2), (32, 64, 8, 2), (32, 64, 8, 3)],
              256: [(32, 64, 8, 2), (16, 64, 8, 2)]}
    return _backward_configs("dkdv", shapes.get(head_dim, []), head_dim)


def dq_candidates(head_dim: int) -> list:
    """dQ tile configs (BLOCK_N key rows stream past BLOCK_M query rows), most likely
    winner first. Each thread holds its rows of dQ (fp32) and of S and dP."""
    shapes = {64: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2)],
              128: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)],
              # (192, 128): dQ (192 wide) is 96 registers a thread on 64 query rows a
              # warpgroup; these compiled for sm_90 without spills on Triton 3.6 and 3.9
              # for the variants backward_candidates names (at most 255 registers,
              # alibi's) and, on the tiles backward_fits_registers keeps, the learnable
              # inputs. 64x128 spilled for alibi, document, softcap and relative bias
              # (28-748 B) and is not listed. Passed on an H200 (run 165).
              192: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)],
              # 256: dQ is 128 registers a thread on one warpgroup per 64 query rows,
              # 64 with two side by side; these compiled for sm_90 without spills on
              # Triton 3.6 and 3.9 for the variants backward_candidates names at 256.
              # 196 KB of shared memory at 64x64. Passed on an H200 (run 165).
              256: [(64, 64, 8, 2), (64, 32, 8, 2)]}
    return _backward_configs("dq", shapes.get(head_dim, []), head_dim)


# The Gluon fused backward (templates/fused_bwd.jinja's attn_bwd_fused_ws): num_warps
# FUSED_WS_WARPS launches two consumer warpgroups on 64 key rows each beside a producer
# warp, on 128 key rows and 64-row query tiles, at head dim 128 (q·k and v alike).
FUSED_WS_WARPS = 9
FUSED_HEAD_DIMS = (128,)


def _fused_smem(config: TileConfig, head_dim: int) -> int:
    """K and V, NUM_STAGES slots of Q and dO (and of LSE and delta), P^T per consumer, two
    dS^T buffers and the two consumers' float32 dQ columns."""
    m, n, d = config.block_m, config.block_n, head_dim
    return (2 * 2 * n * d + config.num_stages * (2 * 2 * m * d + 2 * 4 * m)
            + 2 * n * m + 2 * 2 * n * m + 4 * m * d)


def check_fused_config(config: TileConfig, head_dim: int | None) -> str | None:
    """Why a config cannot run the Gluon fused backward, or None."""
    if config.num_warps != FUSED_WS_WARPS or (config.block_m, config.block_n) != (64, 128) \
            or config.num_stages < 2 or (head_dim is not None and head_dim not in FUSED_HEAD_DIMS):
        return (f"config {config.as_dict()} does not fit the Gluon fused backward: it takes "
                f"num_warps {FUSED_WS_WARPS} (two consumer warpgroups of 64 key rows and a "
                f"producer warp), BLOCK_M 64, BLOCK_N 128 and num_stages >= 2, at head dims "
                f"{', '.join(map(str, FUSED_HEAD_DIMS))}")
    if head_dim is not None and _fused_smem(config, head_dim) > SMEM_LIMIT:
        return (f"config {config.as_dict()} needs {_fused_smem(config, head_dim)} bytes of "
                f"shared memory at head dim {head_dim} in the fused backward; Hopper has {SMEM_LIMIT}")
    return None


def fused_candidates(head_dim: int) -> list:
    """Fused backward tile configs. One: FlashAttention-3's tile at head dim 128 (64 query
    rows past 128 key rows). Compiled for sm_90 on Triton 3.9 it holds 240 registers a
    consumer thread with 40-52 B of loop-invariant spills (full, causal, sliding window,
    GQA). On an H200 it ran the whole backward 1.09x faster than the split kernels (full
    and causal, RESULTS run 194), where the fused kernels of one partition (64x64 and
    64x128 on 8 warps) ran 0.61-0.77x: they are gone. Three stages do not fit in shared
    memory (240 KB)."""
    shapes = {128: [(64, 128, FUSED_WS_WARPS, 2)]}
    configs = [TileConfig(*shape) for shape in shapes.get(head_dim, [])]
    return [c for c in configs if check_fused_config(c, head_dim) is None]


def check_config(config: TileConfig, head_dim: int | None) -> str | None:
    """Why a config cannot run the Gluon forward, or None."""
    consumers = WS_CONSUMERS.get(config.num_warps)
    if consumers is not None:  # warp-specialized: a share of the rows per consumer warpgroup
        if config.block_m % (64 * consumers) or config.block_n > 256 or config.num_stages < 2:
            return (f"config {config.as_dict()} does not fit the warp-specialized Gluon forward: "
                    f"num_warps {config.num_warps} runs {consumers} consumer warpgroups of "
                    f"BLOCK_M / {consumers} rows, a multiple of 64 (wgmma's), so it needs BLOCK_M a "
                    f"multiple of {64 * consumers}, BLOCK_N <= 256 and num_stages >= 2")
        if consumers == 3 and head_dim is not None and head_dim not in WS3_HEAD_DIMS:
            return (f"config {config.as_dict()}: three consumer warpgroups take head dims "
                    f"{', '.join(map(str, WS3_HEAD_DIMS))} (their registers do not hold a "
                    f"[64, {head_dim}] output beside the scores); use num_warps {WS_WARPS}")
    elif config.num_warps not in (4, 8) or config.block_m < 16 * config.num_warps \
            or config.block_m & (config.block_m - 1) or config.block_n > 256 \
            or config.num_stages < 2:
        return (f"config {config.as_dict()} does not fit the Gluon forward: it needs num_warps "
                f"4 or 8 with BLOCK_M >= 16 * num_warps (a power of two), or the warp-specialized "
                f"{WS_WARPS} (BLOCK_M 128) or {WS3_WARPS} (BLOCK_M 192); BLOCK_N <= 256 and "
                "num_stages >= 2")
    if head_dim is not None and smem_bytes(config, head_dim) > SMEM_LIMIT:
        return (f"config {config.as_dict()} needs {smem_bytes(config, head_dim)} bytes of shared "
                f"memory at head dim {head_dim}; Hopper has {SMEM_LIMIT}")
    return None


# Each Gluon kernel's candidates and config check, by direction (it has no one-launch
# backward of the deterministic kind: "bwd" is the portable module's; "fused" is dK, dV
# and dQ in one pass, dQ summed by atomics).
CANDIDATES = {"fwd": candidates, "dq": dq_candidates, "dkdv": backward_candidates,
              "fused": fused_candidates}
CHECKS = {"fwd": check_config, "dq": check_dq_config, "dkdv": check_backward_config,
          "fused": check_fused_config}
