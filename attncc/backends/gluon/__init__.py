"""The Gluon backend: Hopper (sm_90) kernels written in Gluon, for the forward, dQ and
dK/dV, and dK, dV and dQ fused in one pass for deterministic=False (codegen.py renders
them; tiles.py lists their configs).

The backward reads the forward's output and LSE, which both backends write alike, so
each of the three kernels runs on this backend or the portable one on its own. What the
backend does not take yet is named here, so that `backend="gluon"` refuses it with that
sentence and `backend="auto"` runs the portable kernels and says why.
"""
from __future__ import annotations

import functools
import os

from ... import ir
from ..base import ENTRY_POINTS, FUSED, KERNEL_NAMES
from ..tile_config import TileConfig, fits_variant
from . import tiles

HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")
# wgmma, TMA and the mbarrier ring are Hopper's; Blackwell wants tcgen05 and TMEM.
CAPABILITY = (9, 0)
# The learnable reads (analysis/gradient_owners.py's kinds) whose gradients each Gluon
# backward kernel owns, summing its pairs in registers and storing one partial per
# owner, as the portable kernels do. Reads of keys alone fall to dK/dV, every other read
# to dQ; a variant with a read its role's Gluon kernel does not own runs the portable one.
# The dQ kernel sums a table read per diagonal of its tile (templates/owned_gradients.jinja),
# so it owns those whose entry goes through q - k alone: `relative table` (gluon_kind).
OWNED_KINDS = {"dq": ("broadcast", "rows", "relative table"), "dkdv": ("cols",)}


def gluon_kind(kind: str, relative: bool, normalize: str) -> str:
    """A learnable read's kind (analysis/gradient_owners.py's) as OWNED_KINDS names it: a
    table whose index goes through q - k alone is a `relative table` under softmax (the
    per-diagonal sums are written for dS; under `sum` and `none` the weights' slopes
    are summed per row only, so such a table stays on the portable dQ there)."""
    return "relative table" if kind == "table" and relative and normalize == ir.SOFTMAX else kind


class GluonBackend:
    name = "gluon"
    title = "Gluon"
    auto_reason = ("an sm_90 GPU: the Gluon forward, dQ and dK/dV kernels run each call they "
                   "can take where the tuner timed them faster than the portable ones; see "
                   "kernel.last_backend and kernel.last_backward")
    module_note = ("the Hopper (sm_90) forward, dQ and dK/dV kernels (and for softmax variants "
                   "without learnable inputs the fused backward deterministic=False runs); tile "
                   "tables and argument values come from the module above")
    forced_note = ("forward, dQ and dK/dV on an sm_90 GPU (refused elsewhere and under the "
                   "interpreter)")
    auto_note = ("forward, dQ and dK/dV on an sm_90 GPU where the tuner times them faster than "
                 "the portable ones")

    def __repr__(self):
        return f"<attncc backend {self.name!r}>"

    def environment_unsupported(self) -> str | None:
        """No sm_90 GPU, the interpreter, or a Triton without Gluon's Hopper module."""
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "the Triton interpreter (TRITON_INTERPRET=1) runs only the portable kernels"
        return _device_unsupported()

    def supports(self, variant: ir.Variant) -> str | None:
        if variant.dropout:
            return (f"variant '{variant.name}' has dropout {variant.dropout}, which the Gluon "
                    "forward does not implement yet")
        if variant.block is not None and variant.block < 64 and ir.index_lists(variant.layout):
            return (f"variant '{variant.name}' lists layout blocks of {variant.block} by index; "
                    "its tiles must nest in them, and a wgmma tile has at least 64 rows")
        return None

    def supports_call(self, variant: ir.Variant, q, k, v, kind: str) -> str | None:
        return (_call_unsupported(q, k, v)
                or kernel_unsupported(variant, kind, q.shape[-1], v.shape[-1]))

    def render(self, variant: ir.Variant):
        from .codegen import generate
        return generate(variant)

    def candidates(self, direction: str, head_dim: int, variant: ir.Variant) -> list[TileConfig]:
        if direction not in tiles.CANDIDATES:
            return []
        return [c for c in tiles.CANDIDATES[direction](head_dim)
                if fits_variant(c, variant) and tiles.fits_registers(c, variant)
                and tiles.backward_fits_registers(direction, c, head_dim, variant)
                and (direction != "dq"
                     or tiles.dq_fits_registers(c, head_dim, _diagonal_table_entries(variant)))]

    def check_config(self, config: TileConfig, direction: str, head_dim: int | None) -> str | None:
        if direction not in tiles.CHECKS:
            return f"the Gluon backend has no {KERNEL_NAMES[direction]} kernel of one launch"
        return tiles.CHECKS[direction](config, head_dim)

    def entry(self, module, kind: str):
        return getattr(module, ENTRY_POINTS[kind])

    @property
    def fused_add(self) -> str:
        """How the fused backward adds each dQ partial under the installed Triton."""
        return fused_dq_add()


def fused_dq_add() -> str:
    """How the fused backward adds each key tile's dQ partial into the float32 sum under
    the installed Triton: one bulk TMA reduce-add where Gluon has it (Triton 3.8 on);
    without it the fused backward does not run."""
    import triton
    why = _fused_triton_unsupported()
    if why is None:
        return f"a TMA reduce-add per partial, Triton {triton.__version__}"
    return "none: " + why


@functools.lru_cache(maxsize=1)
def _device_unsupported() -> str | None:
    import torch
    if not torch.cuda.is_available():
        return "there is no CUDA GPU; the Gluon kernels need a Hopper GPU (sm_90)"
    capability = torch.cuda.get_device_capability()
    if capability != CAPABILITY:
        return (f"the GPU ({torch.cuda.get_device_name()}) is sm_{capability[0]}{capability[1]}; "
                "the Gluon kernels are written for Hopper (sm_90)")
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError as e:
        return f"this Triton has no Gluon Hopper module ({e})"
    return None


def _call_unsupported(q, k, v) -> str | None:
    """Why the Gluon kernels cannot take these tensors, or None."""
    dtype = str(q.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        return f"q, k, v are {dtype}; the Gluon forward takes float16 and bfloat16"
    dim, dim_v = q.shape[-1], v.shape[-1]
    if dim_v != dim:
        if (dim, dim_v) not in tiles.HEAD_DIM_PAIRS:
            return (f"v has head dim {dim_v} and q, k {dim}; the Gluon forward takes v of "
                    f"another width only at (q·k, v) {_pairs()} (the portable kernels take "
                    "any)")
    elif dim not in HEAD_DIMS:
        return (f"head dim {dim}; the Gluon forward takes head dims "
                f"{', '.join(map(str, HEAD_DIMS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # TMA copies: the last dim contiguous, every other stride and the base 16-byte aligned.
        if t.stride(3) != 1:
            return (f"{name} has strides {tuple(t.stride())}: the Gluon forward's bulk copies need "
                    f"the head dim contiguous (call {name}.contiguous())")
        size = t.element_size()
        if any((s * size) % 16 for s in t.stride()[:3]) or t.data_ptr() % 16:
            return (f"{name} has strides {tuple(t.stride())}: the Gluon forward's bulk copies need "
                    "16-byte aligned rows (call .contiguous())")
    return None


def _pairs(pairs=tiles.HEAD_DIM_PAIRS) -> str:
    return ", ".join(f"({d}, {dv})" for d, dv in pairs)


@functools.lru_cache(maxsize=64)
def _unowned_reads(variant: ir.Variant, kind: str) -> tuple:
    """The learnable reads of what a pair adds (the score, or under `normalize sum` or
    `none` the weight) whose gradients fall to role `kind` ("dq" or "dkdv") and that its
    Gluon kernel does not own, as "input (kind)"."""
    if not variant.learnable_inputs:
        return ()
    # Imported here: the analysis needs sympy, which a warm start never imports.
    from ...analysis.gradient_owners import gradient_owners, learnable_reads
    from ..portable.codegen import per_pair
    pair = per_pair(variant)
    return tuple(sorted({f"{o.load.tensor} ({o.kind})"
                         for o in gradient_owners(pair, learnable_reads(pair))
                         if (o.kind == "cols") == (kind == "dkdv")
                         and gluon_kind(o.kind, o.relative, variant.normalize) not in OWNED_KINDS[kind]}))


@functools.lru_cache(maxsize=64)
def _diagonal_table_entries(variant: ir.Variant) -> int:
    """The padded length of the longest table the Gluon dQ kernel sums per diagonal for
    `variant` (a relative table read's), 0 where it sums none."""
    if not variant.learnable_inputs:
        return 0
    from ...analysis.gradient_owners import gradient_owners, learnable_reads
    from ..portable.codegen import per_pair
    pair = per_pair(variant)
    return max([1 << max(o.slots - 1, 1).bit_length()  # as the kernels pad it (slots_pad)
                for o in gradient_owners(pair, learnable_reads(pair))
                if gluon_kind(o.kind, o.relative, variant.normalize) == "relative table"], default=0)


def kernel_unsupported(variant: ir.Variant, kind: str, head_dim: int,
                       dim_v: int | None = None) -> str | None:
    """Why the Gluon kernel of role `kind` cannot take a call of this variant at this head
    dim (and v's, `dim_v`, where given), or None: the forward takes every head dim the
    call checks let through; dQ and dK/dV fewer and one for all three, and neither a
    learnable read whose gradient it does not own (OWNED_KINDS); the fused backward
    fewer still (fused_unsupported); there is no one-launch deterministic backward."""
    if kind == "fwd":
        return None
    if kind == FUSED:
        return fused_unsupported(variant, head_dim, dim_v)
    if kind not in ("dq", "dkdv"):
        return f"the Gluon backend has no {KERNEL_NAMES[kind]} kernel of one launch"
    name = KERNEL_NAMES[kind]
    if dim_v is not None and dim_v != head_dim:
        if (head_dim, dim_v) not in tiles.BACKWARD_HEAD_DIM_PAIRS:
            return (f"v has head dim {dim_v} and q, k {head_dim}: the Gluon {name} kernel takes "
                    f"v of another width only at (q·k, v) {_pairs(tiles.BACKWARD_HEAD_DIM_PAIRS)} "
                    "(the portable kernels take any)")
    elif head_dim not in tiles.BACKWARD_HEAD_DIMS:
        return (f"head dim {head_dim}: the Gluon {name} kernel takes head dims "
                f"{', '.join(map(str, tiles.BACKWARD_HEAD_DIMS))} (the portable kernels take any)")
    # Inputs only a `sink` reads take their gradient outside the kernels (runtime/sinks.py).
    unowned = _unowned_reads(variant, kind)
    if unowned:
        return (f"variant '{variant.name}' reads learnable inputs ({', '.join(unowned)}) whose "
                f"gradients the portable {name} kernel owns; the Gluon {name} kernel owns those "
                f"of {_listed(OWNED_KINDS[kind])} reads only (analysis/gradient_owners.py "
                "names the kinds"
                + ("; a table read through q - k counts as relative under softmax only"
                   if variant.normalize != ir.SOFTMAX else "") + ")")
    entries = _diagonal_table_entries(variant) if kind == "dq" else 0
    if not any(tiles.dq_fits_registers(c, head_dim, entries) for c in tiles.dq_candidates(head_dim)):
        return (f"head dim {head_dim}: the Gluon dQ kernel sums a relative table of {entries} "
                f"entries (padded) per diagonal at head dim 64, and at 128 tables of up to "
                f"{tiles.DIAGONAL_ENTRIES_AT_128}; past that its registers spill "
                "(backends/gluon/tiles.py's dq_fits_registers)")
    return None


def fused_unsupported(variant: ir.Variant, head_dim: int, dim_v: int | None = None) -> str | None:
    """Why the Gluon fused backward (deterministic=False: dK, dV and dQ in one pass, dQ
    added across key tiles) cannot take a call of this variant at this head dim, or None:
    it runs at equal head dims of 128 (tiles.FUSED_HEAD_DIMS), softmax without learnable
    inputs, dropout or relative reads, scores and masks that hold few registers, and an
    analytic tile plan whose keys meet every query past the first (full, causal, GQA),
    under a Triton with Gluon's TMA reduce-add: where it measured faster than the split.
    The deterministic split runs everything else."""
    if dim_v is not None and dim_v != head_dim or head_dim not in tiles.FUSED_HEAD_DIMS:
        shape = f"(q·k, v) head dims ({head_dim}, {dim_v})" if dim_v not in (None, head_dim) \
            else f"head dim {head_dim}"
        why = (f"{shape}: the Gluon fused backward takes equal head dims "
               f"{', '.join(map(str, tiles.FUSED_HEAD_DIMS))}")
    else:
        why = fused_variant_unsupported(variant) or _fused_triton_unsupported()
    if why is None:
        return None
    return why + "; the deterministic dQ and dK/dV kernels run it"


def _fused_triton_unsupported() -> str | None:
    from triton.experimental.gluon.language.nvidia.hopper import tma
    if hasattr(tma, "async_atomic_add"):
        return None
    import triton
    return (f"Triton {triton.__version__} has no Gluon TMA reduce-add (3.8 added it); with an "
            "atomic per dQ element the fused backward ran 0.87-0.89x the split kernels' speed "
            "on an H200 (benchmarks/RESULTS.md run 194)")


@functools.lru_cache(maxsize=64)
def fused_variant_unsupported(variant: ir.Variant) -> str | None:
    """Why the fused backward cannot take `variant` at any head dim, or None: the Gluon
    module renders its kernel only where this is None (codegen.py). Kept per variant:
    every deterministic=False backward asks (Kernel.fused_backend), and the tile plans
    below cost 0.3-1.1 ms of host time a call uncached (causal, document, sliding window;
    one CPU core of the dev machine)."""
    if variant.dropout:  # (the Gluon backend takes no dropout yet: GluonBackend.supports)
        return f"variant '{variant.name}' has dropout, which the Gluon fused backward does not draw"
    if variant.learnable_inputs:
        names = ", ".join(d.name for d in variant.learnable_inputs)
        return (f"variant '{variant.name}' has learnable inputs ({names}), whose gradients the "
                "Gluon fused backward does not sum")
    if variant.normalize != ir.SOFTMAX:
        return (f"variant '{variant.name}' normalizes by `{variant.normalize}`; the Gluon fused "
                "backward is written for softmax")
    if _diagonal_table_entries(variant):
        return (f"variant '{variant.name}' reads a relative table, which the Gluon fused "
                "backward does not place")
    from ...analysis import bounds
    fwd_plan, bwd_plan = bounds.plan_loops(variant, "k"), bounds.plan_loops(variant, "q")
    if fwd_plan.needs_classify or bwd_plan.needs_classify:
        return (f"variant '{variant.name}' is planned by tile tables, where the Gluon fused "
                "backward ran no faster than the split kernels (BigBird 6% at 16K tokens on an "
                "H200: 1.00x with the tables' longest-first order, benchmarks/RESULTS.md run 198)")
    if any(seg.reach_hi is not None for seg in bwd_plan.segments):
        return (f"variant '{variant.name}' bounds the queries a key meets (a window or a "
                "prefix), where the Gluon fused backward's 128-key tiles ran slower than the split kernels "
                "(sliding window 1024 at 16K tokens on an H200: 0.82x, benchmarks/RESULTS.md "
                "run 194)")
    if tiles.score_registers_heavy(variant):
        return (f"variant '{variant.name}' has a score or a mask that reads tensors, whose "
                "registers the Gluon fused backward's 128-key tile spills (240 to 900 B "
                "compiled for sm_90)")
    return None


def _listed(words) -> str:
    """The words as a sentence lists them: "a", "a and b", "a, b and c"."""
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else list(words))
