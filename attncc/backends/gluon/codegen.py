"""The Gluon backend's code generation: the variant's Hopper module.

The Gluon backend lowers the same analysed IR as the portable one into Hopper (sm_90)
kernels written in Gluon (backends/gluon/templates/attention_gluon.py.jinja beside this file): TMA copies into an
mbarrier-tracked ring, asynchronous wgmma. The forward runs the softmax of one key tile
under the P.V product of the previous one (and, warp-specialized, two consumer
warpgroups in ping-pong); the dK/dV kernel keeps a key tile's K, V, dK and dV on chip
while query tiles stream past, the dQ kernel a query tile's Q, dO and dQ while key tiles
do. What the backend takes, and its tile configs, are its class's (backends/gluon/__init__.py)
and backends/gluon/tiles.py's.
"""
from __future__ import annotations

from pathlib import Path

from ... import ir
from . import OWNED_KINDS, decode, fused_variant_unsupported, gluon_kind

TEMPLATES = Path(__file__).resolve().parent / "templates"


def generate(variant: ir.Variant):
    """The Gluon module source for `variant` (no GPU needed: rendering only). It defines
    the expression helpers its kernels call, as the printed code reports them: the
    mask, score, layout and derivative in the tile loops, and the loop bounds where no
    tile tables replace them; and those of the shared host side (its own code calls
    none of the optional helpers)."""
    import re

    from ...codegen import helpers, templating
    from ...codegen.generated import Generated, module_name
    from ...codegen.printed import used
    from ..portable.codegen import host_helpers, variant_code
    code = variant_code(variant)
    d_score = code.d_score if code.score is not None else None
    owned = [piece for g in code.input_grads
             if gluon_kind(g.owner.kind, g.owner.relative, variant.normalize) in OWNED_KINDS["dq"] + OWNED_KINDS["dkdv"]
             for piece in (g.d_code, g.diagonal_slot) if piece is not None]
    # The relative reads' per-diagonal offsets, scalar loads and the score of the scalars
    # (scores.jinja's read_diagonals and log2_scores).
    diagonal = [] if code.diagonal is None else [code.diagonal.uniform] + [
        piece for r in code.diagonal.reads for piece in (r.at, r.value)]
    called, _ = used([code.mask, column_reads_mask(variant), column_reads_mask(variant, "q"),
                      code.score, d_score,
                      code.layout_elem, code.sink, *owned, *diagonal,
                      *([] if code.uses_tables else [*code.k_segments, *code.q_segments])])
    # The shared host side (tile tables, launch arguments) is rendered into this module
    # too: its helpers are the portable module's.
    called |= host_helpers(code)
    context = dict(template_context(variant, code), emit=helpers.needed(called).__contains__)
    source = templating.environment(TEMPLATES).get_template("attention_gluon.py.jinja").render(**context)
    source = re.sub(r"\n{4,}", "\n\n\n", source)  # where left-out helpers were
    return Generated(source=source, strategy=context["strategy"],
                     module_name=module_name(variant, "gluon"))



def column_reads_mask(variant: ir.Variant, column: str = "k"):
    """The mask as the tiles whose columns run along `column` evaluate it ("k": the
    forward's and dQ's; "q": dK/dV's and the fused backward's, transposed), its reads by
    that position alone loaded once per column (codegen/elementwise.py's
    ColumnReadsEmitter), or None where it has no such read (the mask is then the shared
    one)."""
    from ...codegen.elementwise import ColumnReadsEmitter
    from ..portable.codegen import integer_width, per_pair
    pair = per_pair(variant)
    if pair.mask is None:
        return None
    wide = integer_width(pair.mask, pair)[0]
    linear = f"{column}_lin"
    printed = ColumnReadsEmitter(pair, column, linear, wide=wide).code(pair.mask)
    return printed if linear in printed.names else None


def template_context(variant: ir.Variant, code=None) -> dict:
    """The context the Gluon templates render with: the portable templates' (the Gluon
    module shares their expressions and host side), and which learnable reads' gradients
    its backward kernels own (OWNED_KINDS: `gluon_owns`, each read's `gluon_kind`, and
    whether the variant has any such read: `gluon_owned_reads`), and each kernel's owned
    reads with the name of the tile of their d w / d element under `sum` and `none`
    (`gluon_slopes`, `slope`: scores.jinja's masked_weights), and whether the module has
    the fused backward (`fused_backward`: a softmax variant without learnable inputs),
    and the mask with its reads by key position loaded once per column (`mask_columns`,
    the forward's and dQ's, or None), and by query position (`mask_query_columns`,
    dK/dV's and the fused backward's, whose tiles are transposed)."""
    from ..portable.codegen import template_context as shared_context, variant_code
    code = code or variant_code(variant)
    context = shared_context(variant, code)
    owned = OWNED_KINDS["dq"] + OWNED_KINDS["dkdv"]
    # `pairs`: a relative table's per-pair share of a tile, kept for owned_diagonal_sums.
    grads = [dict(g, gluon_kind=gluon_kind(g["kind"], g["diagonal_slot"] is not None, variant.normalize),
                  pairs=g["acc"].replace("_acc", "_pairs") if g["acc"] else None)
             for g in context["input_grads"]]
    slopes = {kernel: [dict(g, slope=g["acc"][:-len("_acc")] + "_slope") for g in grads
                       if g["gluon_kind"] in kinds]
              for kernel, kinds in OWNED_KINDS.items()}
    # The score of a tile whose relative reads each read one element (scores.jinja's
    # log2_scores, branch=True).
    uniform = code.diagonal.uniform.text if code.diagonal is not None else None
    return dict(context, input_grads=grads, gluon_owns=OWNED_KINDS, gluon_slopes=slopes,

                gluon_owned_reads=any(g["gluon_kind"] in owned for g in grads),
                mask_columns=getattr(column_reads_mask(variant), "text", None),
                mask_query_columns=getattr(column_reads_mask(variant, "q"), "text", None),
                uniform_score=uniform, fused_backward=fused_variant_unsupported(variant) is None,
                gluon_decode=decode.variant_refusal(variant) is None)
