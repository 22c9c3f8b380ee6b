"""Kernel plan -> Triton module source: fills backends/portable/templates/attention.py.jinja for one variant.

Everything the template needs is computed here from the checked IR: the mask, score
and derivative code, the loop plans of both directions, the tile-classification code
(in Triton for the kernels and in PyTorch for the host-side tile tables), and the one
list of kernel parameters that every call site is generated from. Same variant, same
bytes: nothing here depends on the machine, the time or dict order.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import jinja2

from ... import ir
from ...analysis import bounds, intervals, ranges
from ...codegen.derivative import score_gradients
from ...ir import print_variant
from ...semantics import dropout, operators
from ...codegen import helpers, interface, parameters, templating
from ...codegen.decode import decode_context
from ...codegen.elementwise import (TritonEmitter, chance_threshold, element_offset, grad_arg_name,
                          input_arg_names, input_code)
from ...codegen.generated import Generated, module_name

BIG = str(1 << 62)  # "unbounded" inside loop-bound code, which runs in 64 bits
# An expression whose integers fit 32 bits only below an extent this small is always
# computed in 64 bits: one compiled kernel, not two, for variants that are wide anyway.
ALWAYS_WIDE_BELOW = 1 << 16


TEMPLATES = Path(__file__).resolve().parent / "templates"


def _environment() -> jinja2.Environment:
    return templating.environment(TEMPLATES)


# --------------------------------------------------------------- PyTorch emission (host)
class TorchEmitter(TritonEmitter):
    """The layout and the scale as PyTorch code for the host (tile tables, sm_scale)."""

    def __init__(self, variant, var_code):
        super().__init__(variant, var_code)

    def Const(self, e):
        return repr(e.value)  # torch computes in int64 (or float64) already

    def Param(self, e):
        return repr(self.params[e.name])

    def Load(self, e):
        name = input_code(e.tensor)
        idx = ", ".join(f"_h_clamp({self(i)}, {name}.shape[{n}])" for n, i in enumerate(e.indices))
        # Integers in 64 bits, as the language's are: an i32 read times a constant must not
        # wrap in int32 here either.
        return f"{name}[{idx}].long()" if self.inputs[e.tensor].type == ir.INT else f"{name}[{idx}]"

    def Member(self, e):
        rows = self.Load(ir.Load(e.tensor, e.indices))
        return f"_h_tile_in({self(e.item)}, {rows})"

    def BinOp(self, e):
        a, b = self(e.lhs), self(e.rhs)
        if e.op in operators.HELPERS:  # Python's // and % (semantics/operators.py)
            return f"{operators.HELPERS[e.op][1]}({a}, {b})"
        if e.op == "/":
            return f"(torch.as_tensor({a}) * 1.0 / ({b}))"
        return f"({a} {e.op} {b})"

    def Not(self, e):
        return f"(~torch.as_tensor({self(e.operand)}))"

    def Call(self, e):
        if e.fn == "chance":
            keys = ", ".join(self(a) for a in e.args[1:])
            return f"_h_chance({chance_threshold(e, self.params)}, {keys})"
        args = [self(a) for a in e.args]
        if e.fn in ("min", "max"):
            return f"_h_{e.fn}({args[0]}, {args[1]})"
        if e.fn == "abs":
            return f"torch.abs(torch.as_tensor({args[0]}))"
        if e.fn in ir.ROUNDING_FUNCTIONS:
            rounding = {"floor": "floor", "ceil": "ceil", "int": "trunc"}[e.fn]
            return f"torch.{rounding}(torch.as_tensor({args[0]}) * 1.0).long()"
        return f"torch.{e.fn}(torch.as_tensor({args[0]}) * 1.0)"

    def Where(self, e):
        return f"_h_where({self(e.cond)}, {self(e.then)}, {self(e.other)})"


# --------------------------------------------------------------- the plan
def _segment_code(seg: bounds.Segment) -> bounds.Segment:
    # Loop bounds run in 64 bits (once per program): a window of 2**31 - 1 must not wrap.
    # The template defines len_q64 and len_k64; q_lo, q_hi, k_lo, k_hi are 64-bit there.
    fix = lambda c: None if c is None else re.sub(r"\blen_(q|k)\b", r"len_\g<1>64",
                                                  c.replace("_BIG", BIG))
    return bounds.Segment(fix(seg.reach_lo), fix(seg.reach_hi), fix(seg.full_lo),
                          fix(seg.full_hi), seg.full_known)


def heavy_tiles_last(plan: bounds.LoopPlan, other: str) -> bool:
    """True when a later tile of the `other` side (q for the forward and dQ loops, k for
    dK/dV) reaches more tiles: some segment's upper reach follows the other side's
    position while its lower reach does not (causal), and no segment shrinks that way.
    The kernels then launch their tiles last-first (see the template's tile_order)."""
    follows = lambda code: code is not None and re.search(rf"\b{other}_(lo|hi)\b", code) is not None
    grows = [follows(s.reach_hi) and not follows(s.reach_lo) for s in plan.segments]
    shrinks = [follows(s.reach_lo) and not follows(s.reach_hi) for s in plan.segments]
    return any(grows) and not any(shrinks)


def _summary_base(read: intervals.SummaryRead) -> str:
    # The per-block summary of one input along one axis, blocked by q or k tiles.
    return f"blocks_{input_code(read.tensor)}_a{read.axis}{read.var}"


def _torch_summary(read, others, which):
    base = _summary_base(read)
    idx = ", ".join(f"tile_{read.var}" if code is None else code for code in others)
    return f"{base}_{which}[{idx}]"


def _input_grads(variant, emit: TritonEmitter, grads) -> list:
    out = []
    for load, d_code in grads.d_inputs:
        decl = variant.input(load.tensor)
        used = set().union(*(ir.free_vars(i) for i in load.indices)) if load.indices else set()
        reduce = {(False, False): "all", (True, False): "cols", (False, True): "rows",
                  (True, True): "none"}[("q" in used, "k" in used)]
        out.append({"name": decl.name, "ptr": grad_arg_name(decl), "d_code": d_code,
                    "offset": element_offset(emit, decl, load.indices), "reduce": reduce})
    return out


def integer_width(e, variant: ir.Variant):
    """(flag, extent): how `e`'s integers are emitted (TritonEmitter's `wide`) and the
    largest call extent at which 32 bits suffice (ranges.int32_extent)."""
    extent = ranges.int32_extent(e, variant)
    if extent == ranges.MAX_EXTENT:
        return None, extent
    if extent is None or extent < ALWAYS_WIDE_BELOW:
        return "True", ranges.MAX_EXTENT
    return "WIDE", extent


def common_params(variant: ir.Variant, uses_tables: bool) -> list:
    """The one ordered list of run-time kernel parameters beyond q, k, v and strides."""
    names = ["n_heads_q", "group", "len_q", "len_k", "q_offset", "k_offset", "sm_scale",
             "qk_scale", "seed"]
    for decl in variant.inputs:
        names += input_arg_names(decl)
    names += [grad_arg_name(d) for d in variant.learnable_inputs]
    if uses_tables:
        names += interface.TABLE_FIELDS
    return names


def describe_strategy(variant: ir.Variant, plan: bounds.LoopPlan, summary_reads,
                      uses_tables: bool) -> str:
    """One line for `attncc compile` and the module header: how tiles get skipped."""
    if not plan.segments:
        return "the mask is never true: every tile is skipped"
    if uses_tables:
        sources = []
        if variant.layout is not None:
            sources.append(f"the layout (block {variant.block})")
        if summary_reads:
            sources.append("per-block min/max of " + ", ".join(sorted({r.tensor for r in summary_reads})))
        if variant.mask is not None:
            sources.append("interval bounds of the mask")
        return ("tile tables built on the device from " + " and ".join(sources)
                + "; full and partial tiles looped separately")
    parts = []
    if any(s.reach_lo or s.reach_hi for s in plan.segments):
        n = len(plan.segments)
        parts.append(f"analytic key bounds ({n} interval{'s' if n > 1 else ''} per query tile)")
    else:
        parts.append("every key tile visited")
    if any(s.full_known for s in plan.segments):
        parts.append("full tiles skip the mask")
    return "; ".join(parts)


def generate(variant: ir.Variant) -> Generated:
    """The Triton module source for `variant`."""
    context = template_context(variant)
    template = _environment().get_template("attention.py.jinja")
    first = template.render(**context)  # every helper, every parameter
    used, aliases = helpers.needed(first)
    source = template.render(**dict(context, emit=used.__contains__, host_aliases=aliases,
                                    unread=parameters.unread(first)))
    source = re.sub(r"\n{4,}", "\n\n\n", source)  # where left-out helpers were
    return Generated(source=source, strategy=context["strategy"], module_name=module_name(variant))


def template_context(variant: ir.Variant) -> dict:
    """Everything the templates fill in for `variant`: the expressions, the loop plans,
    the tile-classification code and the kernel parameter list. Every backend's
    template renders from this one dict, so the pieces exist once."""
    # Each expression in 32-bit integers where that cannot wrap, else in 64 (ranges.py).
    widths = {decl: integer_width(getattr(variant, decl), variant)
              for decl in ("mask", "score", "layout")}
    int32_extent = min(extent for _, extent in widths.values())
    emit_mask = TritonEmitter(variant, wide=widths["mask"][0])
    emit = TritonEmitter(variant, wide=widths["score"][0])  # the score and its derivatives
    fwd_plan = bounds.plan_loops(variant, "k")
    bwd_plan = bounds.plan_loops(variant, "q")
    # Tiles the analytic plan cannot decide are classified on the device into tables.
    uses_tables = fwd_plan.needs_classify or bwd_plan.needs_classify
    host_cls = intervals.classify_code(variant.mask, variant, _torch_summary, prefix="_c")
    summary_reads = host_cls.summaries
    grads = score_gradients(variant, emit)
    params = common_params(variant, uses_tables)
    spec_text = print_variant(variant)
    key = variant.key()
    layout_torch = None
    if variant.layout is not None:
        layout_torch = TorchEmitter(variant, {"qb": "qb", "kb": "kb", "b": "off_b", "h": "off_h",
                                              "dim": "HEAD_DIM"})(variant.layout)
    if variant.scale is None:
        scale_code = "1.0 / math.sqrt(dim)"
    else:
        scale_code = f"float({TorchEmitter(variant, {'dim': 'dim'})(variant.scale)})"
    strategy = describe_strategy(variant, fwd_plan, summary_reads, uses_tables)
    # A kernel tile larger than the layout's block covers several blocks, some of which
    # may be off: its partial tiles evaluate the layout per element. Index lists
    # (`kb in t[...]`) have no per-element form; their tiles stay within one block.
    layout_elem = None
    if variant.layout is not None and not ir.index_lists(variant.layout):
        layout_elem = TritonEmitter(variant, {"qb": f"_fdiv(q_pos, {variant.block})",
                                              "kb": f"_fdiv(k_pos, {variant.block})"},
                                    wide=widths["layout"][0])(variant.layout)
    context = dict(
        # every helper: generate() renders a second time with only those used (helpers.py)
        emit=lambda name: True, host_aliases=helpers.HOST_ALIASES, unread=parameters.NOTHING,
        version=_package_version(),
        spec_comment="\n".join(f"#   {line}" for line in spec_text.rstrip().splitlines()),
        spec_text=spec_text,
        strategy=strategy,
        variant_name=variant.name,
        key=key,
        input_names=[i.name for i in variant.inputs],
        input_codes={i.name: input_code(i.name) for i in variant.inputs},
        int32_extent=int32_extent,
        learnable_names=[i.name for i in variant.learnable_inputs],
        dropout=bool(variant.dropout),
        dropout_p=repr(float(variant.dropout or 0.0)),
        dropout_threshold=dropout.threshold(variant.dropout or 0.0),
        tables=uses_tables,
        table_fields=interface.TABLE_FIELDS,
        table_inputs=sorted({r.tensor for r in summary_reads}
                            | (ir.loaded_tensors(variant.layout) if variant.layout is not None else set())),
        host_classify_lines=host_cls.lines,
        host_classify_may=host_cls.may,
        host_classify_must=host_cls.must,
        mask=emit_mask(variant.mask) if variant.mask is not None else None,
        score=emit(variant.score) if variant.score is not None else None,
        # A score that does not vary over both q and k (`score 0.0`, `score x[h]`) is
        # broadcast to the tile: the softmax sums over the tile's columns.
        score_is_tile=variant.score is not None and (
            "s" in ir.free_vars(variant.score) or {"q", "k"} <= ir.free_vars(variant.score)),
        d_score=grads.d_ds,
        # d score / d s at a masked pair may be inf or NaN (`s * sqrt(q - k)` past a
        # causal mask) and multiplies a dS of 0 there: the backward zeroes those pairs.
        d_score_finite=_is_constant(grads.d_ds),
        input_grads=_input_grads(variant, emit, grads),
        layout=variant.layout is not None,
        block=variant.block,
        layout_torch=layout_torch,
        layout_elem=layout_elem,
        k_segments=[_segment_code(s) for s in fwd_plan.segments],
        q_segments=[_segment_code(s) for s in bwd_plan.segments],
        heavy_rows_last=heavy_tiles_last(fwd_plan, "q"),
        heavy_cols_last=heavy_tiles_last(bwd_plan, "k"),
        common_args=", ".join(params),
        # What the per-tile step and tile-run functions take of them: not the tile
        # tables, which only the programs' loops over listed tiles read.
        step_args=", ".join(p for p in params if p not in interface.TABLE_FIELDS),
        # A dQ program loops over its query tile's row of the tables, a dK/dV program
        # over its key tile's column.
        dq_program_args=", ".join(p for p in params if p not in interface.table_fields("col")),
        dkdv_program_args=", ".join(p for p in params if p not in interface.table_fields("row")),
        common_param_list=params,
        summary_specs=[[r.tensor, r.axis, r.var] for r in summary_reads],
        summary_bases=[_summary_base(r) for r in summary_reads],
        scale_code=scale_code,
        **decode_context(variant, fwd_plan, widths["layout"][0]),
    )
    return context


def _package_version() -> str:
    from ...version import __version__
    return __version__


def _is_constant(code: str) -> bool:
    """Whether generated code is a literal number (a derivative that cannot be inf)."""
    try:
        return math.isfinite(float(code))
    except ValueError:
        return False
