"""The Gluon backend's code generation: which variants it can render, its module, and its
tile configs (runtime/backends.py decides which backend runs a call).

The Gluon backend lowers the same analysed IR as the portable one into Hopper (sm_90)
kernels written in Gluon (backends/gluon/templates/attention_gluon.py.jinja beside this file): TMA copies into an
mbarrier-tracked ring, asynchronous wgmma. The forward runs the softmax of one key tile
under the P.V product of the previous one (and, warp-specialized, two consumer
warpgroups in ping-pong); the dK/dV kernel keeps a key tile's K, V, dK and dV on chip
while query tiles stream past, the dQ kernel a query tile's Q, dO and dQ while key tiles
do. The backward reads the forward's output and LSE, which both backends write alike, so
each of the three kernels picks its backend on its own. What the backend does not take
yet is named here, so that
`backend="gluon"` refuses it with that sentence and `backend="auto"` runs the portable
kernels and says why.
"""
from __future__ import annotations

from pathlib import Path

from ... import ir

HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
TEMPLATES = Path(__file__).resolve().parent / "templates"
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may use
# num_warps of the warp-specialized forward (two consumer warpgroups and a producer warp);
# the generated module's WS_WARPS.
WS_WARPS = 9


def variant_unsupported(variant: ir.Variant) -> str | None:
    """Why the Gluon forward cannot run this variant, or None when it can."""
    if variant.dropout:
        return (f"variant '{variant.name}' has dropout {variant.dropout}, which the Gluon "
                "forward does not implement yet")
    if variant.block is not None and variant.block < 64 and ir.index_lists(variant.layout):
        return (f"variant '{variant.name}' lists layout blocks of {variant.block} by index; its "
                "tiles must nest in them, and a wgmma tile has at least 64 rows")
    return None


def smem_bytes(config: dict, head_dim: int) -> int:
    """Q, plus NUM_STAGES slots of K and V, in 16-bit elements."""
    return 2 * head_dim * (config["BLOCK_M"] + 2 * config["num_stages"] * config["BLOCK_N"])


def candidates(head_dim: int) -> list:
    """Forward tile configs, most likely winner first. BLOCK_M is 16 rows per warp (a
    warpgroup per 64 rows), as the wgmma layout needs."""
    # Head dim 128 (H200, bf16, 16K tokens; benchmarks/RESULTS.md runs 78-79): the
    # warp-specialized kernel (num_warps WS_WARPS) ran full attention 1.12x faster than
    # the best single-partition config, 128x128 w8 s2, and 64x64 w4 tiles (two programs
    # per SM) came next. Every config listed for 64 and 128 passed the GPU checks; the
    # warp-specialized kernel was not run at head dim 256, so it is not offered there.
    shapes = {64: [(128, 128, WS_WARPS, 2), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                   (128, 64, 8, 3), (64, 128, 4, 3)],
              128: [(128, 128, WS_WARPS, 2), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                    (128, 64, 8, 3), (128, 64, 8, 2), (64, 128, 4, 2)],
              256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2)]}[head_dim]
    configs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in shapes]
    return [c for c in configs if smem_bytes(c, head_dim) <= SMEM_LIMIT]


# Head dims of the Gluon dK/dV kernel: each thread holds its rows of dK and dV in fp32,
# and at 256 columns the two accumulators alone would take every register.
BACKWARD_HEAD_DIMS = (64, 128)


def backward_unsupported(variant: ir.Variant, kind: str, head_dim: int) -> str | None:
    """Why the Gluon dQ (kind "dq") or dK/dV ("dkdv") kernel cannot take a call of this
    variant at this head dim, or None."""
    name = {"dq": "dQ", "dkdv": "dK/dV"}[kind]
    if head_dim not in BACKWARD_HEAD_DIMS:
        return (f"head dim {head_dim}: the Gluon {name} kernel takes head dims "
                f"{', '.join(map(str, BACKWARD_HEAD_DIMS))} (at 256 its fp32 accumulators "
                "do not fit in registers beside the score tiles)")
    if kind == "dq" and variant.learnable_inputs:
        names = ", ".join(d.name for d in variant.learnable_inputs)
        return (f"variant '{variant.name}' has learnable inputs ({names}), whose gradients "
                "the portable dQ kernel accumulates; the Gluon dQ kernel does not yet")
    return None


# The two backward kernels are mirror images: one side's tile stays on chip, split among
# the warps 16 rows each (the wgmma layout), while the other side's tiles stream through
# the ring. {kind: (held side, streamed side, name)}.
_BACKWARD_SIDES = {"dkdv": ("BLOCK_N", "BLOCK_M", "dK/dV"), "dq": ("BLOCK_M", "BLOCK_N", "dQ")}


def _backward_smem(kind: str, config: dict, head_dim: int) -> int:
    """The held tiles (two: K, V or Q, dO) plus NUM_STAGES slots of the streamed two, in
    16-bit elements."""
    held, streamed, _ = _BACKWARD_SIDES[kind]
    return 2 * head_dim * (2 * config[held] + 2 * config["num_stages"] * config[streamed])


def _check_backward(kind: str, config: dict, head_dim: int) -> str | None:
    held, streamed, name = _BACKWARD_SIDES[kind]
    w = config["num_warps"]
    if w not in (4, 8) or config[held] % (16 * w) or config[held] > 256 \
            or config[streamed] % 16 or not 16 <= config[streamed] <= 256 \
            or config["num_stages"] < 1:
        return (f"config {config} does not fit the Gluon {name} kernel: it needs num_warps 4 or "
                f"8, {held} a multiple of 16 * num_warps up to 256, {streamed} a multiple of 16 "
                "up to 256 and num_stages >= 1")
    if _backward_smem(kind, config, head_dim) > SMEM_LIMIT:
        return (f"config {config} needs {_backward_smem(kind, config, head_dim)} bytes of shared "
                f"memory at head dim {head_dim}; Hopper has {SMEM_LIMIT}")
    return None


def _backward_configs(kind: str, shapes: list, head_dim: int) -> list:
    configs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in shapes]
    return [c for c in configs if _backward_smem(kind, c, head_dim) <= SMEM_LIMIT]


def check_backward_config(config: dict, head_dim: int) -> str | None:
    """Why a config cannot run the Gluon dK/dV kernel, or None."""
    return _check_backward("dkdv", config, head_dim)


def check_dq_config(config: dict, head_dim: int) -> str | None:
    """Why a config cannot run the Gluon dQ kernel, or None."""
    return _check_backward("dq", config, head_dim)


def backward_candidates(head_dim: int) -> list:
    """dK/dV tile configs (BLOCK_M query rows stream past BLOCK_N key rows), most likely
    winner first. Each thread holds its rows of dK and dV (fp32) and of S^T and dP^T, so
    tiles stay small."""
    # Head dim 128 (H100, bf16, 16K tokens; benchmarks/RESULTS.md run 106): 64x64 tiles
    # on 4 warps (two programs per SM) ran full and causal 8% and 5% faster than 64x128 on
    # 8 warps, 32x128 13-30% slower.
    shapes = {64: [(64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (64, 128, 8, 3)],
              128: [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2)]}
    return _backward_configs("dkdv", shapes.get(head_dim, []), head_dim)


def dq_candidates(head_dim: int) -> list:
    """dQ tile configs (BLOCK_N key rows stream past BLOCK_M query rows), most likely
    winner first. Each thread holds its rows of dQ (fp32) and of S and dP."""
    shapes = {64: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2)],
              128: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)]}
    return _backward_configs("dq", shapes.get(head_dim, []), head_dim)


def check_config(config: dict, head_dim: int) -> str | None:
    """Why a pinned config cannot run the Gluon forward, or None."""
    bm, w = config["BLOCK_M"], config["num_warps"]
    if w == WS_WARPS:
        w = 8  # two consumer warpgroups
    if w not in (4, 8) or bm < 16 * w or config["BLOCK_N"] > 256 or config["num_stages"] < 2:
        return (f"config {config} does not fit the Gluon forward: it needs num_warps 4, 8 or 9 (warp-specialized), "
                "BLOCK_M >= 16 * num_warps, BLOCK_N <= 256 and num_stages >= 2")
    if smem_bytes(config, head_dim) > SMEM_LIMIT:
        return (f"config {config} needs {smem_bytes(config, head_dim)} bytes of shared memory "
                f"at head dim {head_dim}; Hopper has {SMEM_LIMIT}")
    return None


def generate(variant: ir.Variant):
    """The Gluon module source for `variant` (no GPU needed: rendering only). It defines
    the expression helpers its kernels call, as the printed code reports them: the
    mask, score, layout and derivative in the tile loops, and the loop bounds where no
    tile tables replace them (its own code calls none of the optional helpers)."""
    import re

    from ...codegen import helpers, templating
    from ...codegen.generated import Generated, module_name
    from ...codegen.printed import used
    from ..portable.codegen import template_context, variant_code
    code = variant_code(variant)
    d_score = code.d_score if code.score is not None else None
    called, _ = used([code.mask, code.score, d_score, code.layout_elem,
                      *([] if code.uses_tables else [*code.k_segments, *code.q_segments])])
    context = dict(template_context(variant, code), emit=helpers.needed(called).__contains__)
    source = templating.environment(TEMPLATES).get_template("attention_gluon.py.jinja").render(**context)
    source = re.sub(r"\n{4,}", "\n\n\n", source)  # where left-out helpers were
    return Generated(source=source, strategy=context["strategy"],
                     module_name=module_name(variant, "gluon"))


# Each Gluon kernel's tile candidates and config check, by tuning direction.
CANDIDATES = {"gluon-fwd": candidates, "gluon-dq": dq_candidates,
              "gluon-dkdv": backward_candidates}
CHECKS = {"gluon-fwd": check_config, "gluon-dq": check_dq_config,
          "gluon-dkdv": check_backward_config}
