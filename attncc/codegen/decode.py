"""The decoding part of a generated module: what backends/portable/templates/decode.py.jinja needs beyond
the main kernels' context (codegen.generate adds it to the same module).

The decode kernels reuse the variant's slots as the main kernels emit them (mask, score,
the key-loop bounds of attncc/analysis/bounds.py); only the layout is emitted again, over the
rows of a decode tile: `qb` is each row's layout block and `kb` the tile's, and an
index list (`kb in top[b, h, qb]`) is read entry by entry, since decoding has no tile
tables.
"""
from __future__ import annotations

from ..analysis import bounds
from .. import ir
from .elementwise import TritonEmitter, input_arg_names, input_code
from .printed import Code


class DecodeLayoutEmitter(TritonEmitter):
    """The layout as Triton code over a decode tile (qb -> q_blk, kb -> k_blk); `wide`
    as the main kernels' layout (codegen.integer_width)."""

    def __init__(self, variant: ir.Variant, wide: str | None = None):
        super().__init__(variant, {"qb": "q_blk", "kb": "k_blk"}, wide=wide)

    def Member(self, e):
        decl = self.inputs[e.tensor]
        base = input_code(decl.name)
        last = len(decl.axes) - 1  # the list axis: a fixed size (checker._type_of_member)
        self.use(("_in_list",), (f"{base}_ptr", f"{base}_stride{last}"))
        return (f"_in_list({self(e.item)}, {base}_ptr + {self.offset(decl, e.indices)}, "
                f"{decl.axes[last]}, {base}_stride{last})")


def decode_params(variant: ir.Variant) -> list:
    """The one ordered list of run-time decode kernel parameters beyond tensors and strides."""
    names = ["batch", "n_heads_q", "group", "n_q", "n_new", "capacity", "num_pages", "sm_scale",
             "qk_scale"]
    for decl in variant.inputs:
        names += input_arg_names(decl)
    return names


def decode_strategy(variant: ir.Variant, plan: bounds.LoopPlan) -> str:
    """One line: how a decode call divides and skips the key tiles."""
    if not plan.segments:
        return "the mask is never true: no key is read"
    if plan.needs_classify:
        what = "the mask and the layout" if variant.layout is not None else "the mask"
        hull = ("within analytic key bounds" if any(s.reach_lo or s.reach_hi for s in plan.segments)
                else "over the whole cache")
        return (f"key tiles {hull} split across programs; each tile evaluates {what} per "
                "element first and reads only the keys some row attends (none: nothing read)")
    n = len(plan.segments)
    if any(s.reach_lo or s.reach_hi for s in plan.segments):
        text = (f"the reachable key tiles (analytic bounds, {n} interval{'s' if n > 1 else ''} "
                "per row) split across programs")
    else:
        text = "every key tile of the row split across programs"
    if any(s.full_known for s in plan.segments):
        text += "; full tiles skip the mask"
    return text


def decode_layout(variant: ir.Variant, layout_wide=None) -> Code | None:
    """The layout over a decode tile, `wide` as the main kernels' layout."""
    if variant.layout is None:
        return None
    return DecodeLayoutEmitter(variant, layout_wide).code(variant.layout)


def decode_context(variant: ir.Variant, fwd_plan: bounds.LoopPlan, layout: Code | None) -> dict:
    params = decode_params(variant)
    return dict(
        decode_classify=fwd_plan.needs_classify,
        decode_layout=layout.text if layout is not None else None,
        decode_args=", ".join(params),
        decode_param_list=params,
        decode_strategy=decode_strategy(variant, fwd_plan),
    )
