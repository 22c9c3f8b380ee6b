"""Kernel plan -> Triton module source: fills backends/portable/templates/attention.py.jinja for one variant.

Everything the template needs is computed here from the checked IR: the mask, score
and derivative code, the loop plans of both directions, the tile-classification code
(in Triton for the kernels and in PyTorch for the host-side tile tables), and the one
list of kernel parameters that every call site is generated from. Each piece is printed
once, with the helpers and names it uses (attncc/codegen/printed.py); from those the
module is rendered once, defining the helpers it calls and passing its per-tile
functions the names they read. Same variant, same bytes: nothing here depends on the
machine, the time or dict order.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ... import dropout, ir
from ...analysis import bounds, intervals, ranges
from ...analysis.signs import scale_is_positive
from ...analysis.gradient_owners import GradientOwner, gradient_owners
from ...analysis.sink_reads import direct_sink_read, sink_learnables
from ...codegen.derivative import score_gradients
from ...ir import print_variant
from ..tile_config import needs_tiles_within_block
from ...codegen import helpers, interface, parameters, templating
from ...codegen.decode import decode_context, decode_layout
from ...codegen.elementwise import (ScoreEmitter, TritonEmitter, WeightEmitter, grad_arg_name,
                                     input_arg_names, input_code)
from ...codegen.generated import Generated, module_name
from ...codegen.plan_code import (ClassificationCode, bound_code, classification_code,
                                  segment_code)
from ...codegen.printed import Code, used
from ...codegen.relative_reads import DiagonalScore, diagonal_score

# An expression whose integers fit 32 bits only below an extent this small is always
# computed in 64 bits: one compiled kernel, not two, for variants that are wide anyway.
ALWAYS_WIDE_BELOW = 1 << 16


TEMPLATES = Path(__file__).resolve().parent / "templates"


def _environment() -> jinja2.Environment:
    return templating.environment(TEMPLATES)


# --------------------------------------------------------------- PyTorch emission (host)
class TorchEmitter(TritonEmitter):
    """The layout and the scale as PyTorch code for the host (tile tables, sm_scale):
    operations in the `host` spelling of attncc/operators.py."""

    cast = "torch.as_tensor({}) * 1.0"
    tile_constant_bool = None  # torch's comparisons are bools already

    def __init__(self, variant, var_code):
        super().__init__(variant, var_code)

    def Const(self, e):
        return repr(e.value)  # torch computes in int64 (or float64) already

    def Param(self, e):
        return repr(self.params[e.name])

    def Load(self, e):
        name = input_code(e.tensor)
        self.use(("_h_clamp",), (name,))
        idx = ", ".join(f"_h_clamp({self(i)}, {name}.shape[{n}])" for n, i in enumerate(e.indices))
        # Integers in 64 bits, as the language's are: an i32 read times a constant must not
        # wrap in int32 here either.
        return f"{name}[{idx}].long()" if self.inputs[e.tensor].type == ir.INT else f"{name}[{idx}]"

    def Member(self, e):
        rows = self.Load(ir.Load(e.tensor, e.indices))
        self.use(("_h_tile_in",))
        return f"_h_tile_in({self(e.item)}, {rows})"

    def spelling(self, entry):
        return entry.host

    def helpers_of(self, entry, e) -> tuple:
        return entry.host_helpers


# --------------------------------------------------------------- the plan
def segment_end_names(bound) -> set:
    """The names a loop bound reads."""
    return set(bound_code(bound).names)


def heavy_tiles_last(plan: bounds.LoopPlan, other: str) -> bool:
    """True when a later tile of the `other` side (q for the forward and dQ loops, k for
    dK/dV) reaches more tiles: some segment's upper reach follows the other side's
    position while its lower reach does not (causal), and no segment shrinks that way.
    The kernels then launch their tiles last-first (see the template's tile_order)."""
    position = {f"{other}_lo", f"{other}_hi"}
    follows = lambda bound: bound is not None and bool(position & segment_end_names(bound))
    grows = [follows(s.reach_hi) and not follows(s.reach_lo) for s in plan.segments]
    shrinks = [follows(s.reach_lo) and not follows(s.reach_hi) for s in plan.segments]
    return any(grows) and not any(shrinks)


def _summary_base(read: intervals.SummaryRead) -> str:
    # The per-block summary of one input along one axis, blocked by q or k tiles.
    return f"blocks_{input_code(read.tensor)}_a{read.axis}{read.var}"


def torch_summary(read, others, which):
    base = _summary_base(read)
    idx = ", ".join(f"tile_{read.var}" if code is None else code for code in others)
    return f"{base}_{which}[{idx}]"


@dataclass(frozen=True)
class InputGradient:
    """The gradient of one learnable read: who owns it (analysis/gradient_owners.py) and
    the code the kernels write it with."""
    name: str
    ptr: str  # the gradient's kernel argument
    d_code: Code  # d score / d the element
    offset: Code  # the element's offset (dense stores and scattered atomics)
    reduce: str  # what an atomic add sums over the tile first: "all", "cols", "rows" or "none"
    owner: GradientOwner
    part: str | None  # the kernel argument of its partials (owned kinds but dense)
    slot: Code | None  # table: the entry of the summed axis a pair reads, clamped
    # table through q - k only (owner.relative): the entry of a whole diagonal of a tile,
    # with q and k read from `diag_q` and `diag_k` (backward.jinja sums per diagonal)
    diagonal_slot: Code | None = None


def _input_grads(variant, emit: TritonEmitter, grads) -> list:
    out = []
    owners = gradient_owners(variant, [load for load, _ in grads.d_inputs])
    for n, ((load, d_code), owner) in enumerate(zip(grads.d_inputs, owners)):
        decl = variant.input(load.tensor)
        varies = set().union(*(ir.free_vars(i) for i in load.indices)) if load.indices else set()
        reduce = {(False, False): "all", (True, False): "cols", (False, True): "rows",
                  (True, True): "none"}[("q" in varies, "k" in varies)]
        slot = diagonal_slot = None
        if owner.kind == "table":
            axis, base = owner.slot_axis, input_code(decl.name)

            def write(printer):
                printer.use(("_index",), ("WIDE", f"{base}_size{axis}"))
                return f"_index({printer(load.indices[axis])}, {base}_size{axis}, WIDE)"
            slot = emit.capture(lambda: write(emit))
            if owner.relative:
                diagonal = TritonEmitter(variant, _DIAGONAL_POSITIONS, wide=emit.wide)
                diagonal_slot = diagonal.capture(lambda: write(diagonal))
        part = None if owner.kind in ("dense", "scattered") else f"part{n}_ptr"
        out.append(InputGradient(decl.name, grad_arg_name(decl), d_code,
                                 emit.capture(lambda: emit.offset(decl, load.indices)), reduce,
                                 owner, part, slot, diagonal_slot))
    return out


# Where a relative table's entry is read per diagonal (backward.jinja): q is the query
# tile's column of positions shifted to one diagonal per row, k the key tile's first.
_DIAGONAL_POSITIONS = {"q": Code("diag_q", names=frozenset({"q_pos"})),
                       "k": Code("diag_k", names=frozenset({"tile_k", "k_offset"}))}


def integer_width(e, variant: ir.Variant):
    """(flag, extent): how `e`'s integers are emitted (TritonEmitter's `wide`) and the
    largest call extent at which 32 bits suffice (ranges.int32_extent)."""
    extent = ranges.int32_extent(e, variant)
    if extent == ranges.MAX_EXTENT:
        return None, extent
    if extent is None or extent < ALWAYS_WIDE_BELOW:
        return "True", ranges.MAX_EXTENT
    return "WIDE", extent


def common_params(variant: ir.Variant, uses_tables: bool, partials=()) -> list:
    """The one ordered list of run-time kernel parameters beyond q, k, v and strides
    (`partials`: the learnable reads' partial buffers, InputGradient.part)."""
    names = ["n_heads_q", "group", "len_q", "len_k", "q_offset", "k_offset", "sm_scale",
             "qk_scale", "seed"]
    for decl in variant.inputs:
        names += input_arg_names(decl)
    names += [grad_arg_name(d) for d in variant.learnable_inputs]
    names += list(partials)
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


@dataclass(frozen=True)
class VariantCode:
    """A variant's code, printed once for every backend's templates; each piece says
    what it uses (attncc/codegen/printed.py)."""
    mask: Code | None
    score: Code | None
    d_score: Code  # d score / d s
    input_grads: list  # of InputGradient
    layout_elem: Code | None  # the layout per element, in tiles larger than its blocks
    decode_layout: Code | None  # the layout over a decode tile's rows
    layout_torch: Code | None  # the layout on the host's block grid
    scale: Code  # sm_scale, on the host
    classification: ClassificationCode  # the mask's tile classes, on the host
    summary_reads: list  # of intervals.SummaryRead
    fwd_plan: bounds.LoopPlan
    bwd_plan: bounds.LoopPlan
    k_segments: list  # of SegmentCode, the forward's key loops
    q_segments: list  # the dK/dV kernel's query loops
    int32_extent: int
    sink: Code | None = None  # σ of the program's query rows, a [BLOCK_M] vector or a scalar
    decode_sink: Code | None = None  # σ of a decode program's rows
    # The score of a tile whose reads through q - k each read one element (portable kernels)
    diagonal: DiagonalScore | None = None

    @property
    def uses_tables(self) -> bool:
        # Tiles the analytic plan cannot decide are classified on the device into tables.
        return self.fwd_plan.needs_classify or self.bwd_plan.needs_classify


def per_pair(variant: ir.Variant) -> ir.Variant:
    """The variant as the kernels see a pair: under `normalize sum` or `none` its score
    slot holds what the pair adds, weight(score(s)), so the score's code, derivatives
    (in s and in learnable inputs) and integer widths are the weight's."""
    if variant.normalize == ir.SOFTMAX:
        return variant
    return dataclasses.replace(variant, score=variant.weighted)


def variant_code(variant: ir.Variant) -> VariantCode:
    variant = per_pair(variant)
    # Each expression in 32-bit integers where that cannot wrap, else in 64 (ranges.py).
    widths = {decl: integer_width(getattr(variant, decl), variant)
              for decl in ("mask", "score", "layout", "sink")}
    # The score and its derivatives (under `sum` or `none`, the pair weights').
    emitter = ScoreEmitter if variant.normalize == ir.SOFTMAX else WeightEmitter
    emit = emitter(variant, wide=widths["score"][0])
    # Under `sum` or `none` the backward holds the pair weights w, the score's value,
    # where it applies the derivatives: σ(1 − σ) of `weight sigmoid(..)` reads it.
    grads = score_gradients(variant, emit, None if variant.normalize == ir.SOFTMAX else "w")
    fwd_plan = bounds.plan_loops(variant, "k")
    bwd_plan = bounds.plan_loops(variant, "q")
    classes = intervals.classify(variant.mask, variant)
    layout_torch = layout_elem = None
    if variant.layout is not None:
        layout_torch = TorchEmitter(variant, {"qb": "qb", "kb": "kb", "b": "off_b", "h": "off_h",
                                              "dim": "HEAD_DIM"}).code(variant.layout)
    # A kernel tile larger than the layout's block covers several blocks, some of which
    # may be off: its partial tiles evaluate the layout per element. Index lists
    # (`kb in t[...]`) have no per-element form; their tiles stay within one block.
    if variant.layout is not None and not ir.index_lists(variant.layout):
        blocks = {var: Code(f"_fdiv({var}_pos, {variant.block})", frozenset({"_fdiv"}),
                            frozenset({f"{var}_pos"})) for var in "qk"}
        layout_elem = TritonEmitter(variant, {"qb": blocks["q"], "kb": blocks["k"]},
                                    wide=widths["layout"][0]).code(variant.layout)
    if variant.scale is None:
        scale = Code("1.0 / math.sqrt(dim)")
    else:
        printer = TorchEmitter(variant, {"dim": "dim", "dim_v": "dim_v"})
        scale = printer.capture(lambda: f"float({printer(variant.scale)})")
    return VariantCode(
        mask=(TritonEmitter(variant, wide=widths["mask"][0]).code(variant.mask)
              if variant.mask is not None else None),
        score=emit.code(variant.score) if variant.score is not None else None,
        d_score=grads.d_ds,
        input_grads=_input_grads(variant, emit, grads),
        layout_elem=layout_elem,
        decode_layout=decode_layout(variant, widths["layout"][0]),
        layout_torch=layout_torch,
        scale=scale,
        classification=classification_code(classes, torch_summary, temp_prefix="_c"),
        summary_reads=classes.summaries,
        fwd_plan=fwd_plan,
        bwd_plan=bwd_plan,
        k_segments=[segment_code(s) for s in fwd_plan.segments],
        q_segments=[segment_code(s) for s in bwd_plan.segments],
        int32_extent=min(extent for _, extent in widths.values()),
        sink=sink_code(variant, widths["sink"][0]),
        decode_sink=sink_code(variant, widths["sink"][0], {
            "b": "off_b", "h": Code("heads", frozenset(), frozenset({"heads"})),
            "q": Code("(q_first + tok)", frozenset(), frozenset({"q_first", "tok"}))}),
        diagonal=diagonal_score(variant, widths["score"][0]),
    )


def sink_code(variant: ir.Variant, wide: str | None, var_code: dict | None = None) -> Code | None:
    """The sink of a program's query rows, a [BLOCK_M] vector (or a scalar): by default
    the main kernels' rows (offs_m, their indices in the sequence); `var_code`, the index
    names' code elsewhere (the decode kernel's rows)."""
    if variant.sink is None:
        return None
    rows = {"q": Code("(offs_m + q_offset)", frozenset(), frozenset({"offs_m", "q_offset"}))}
    return TritonEmitter(variant, var_code or rows, wide=wide).code(variant.sink)


# The module names these in decode_reach_tiles, which binds its own host versions: the
# device definitions stay in every module beside them, as they always have.
ALWAYS_DEFINED = ("_min", "_max", "_where")


def host_helpers(code: VariantCode) -> set:
    """The helpers the shared host side (codegen/templates/host_args.jinja: the tile
    tables, the scale) calls for this variant, in every backend's module."""
    aliases = helpers.host_aliases(code.classification.helpers)
    host, _ = used([code.layout_torch, code.scale])
    return host | {helpers.host_helper(a) for a in aliases}


def _pruning(variant: ir.Variant, code: VariantCode) -> dict:
    """What the portable module defines and passes, from what its code uses: `emit`
    (the helpers to define), `host_aliases` (the kernels' helper names tile_tables binds
    to the host's) and `unread` (the names each per-tile function list leaves out)."""
    grads = [piece for g in code.input_grads
             for piece in (g.d_code, g.offset, g.slot, g.diagonal_slot)]
    in_dq = [g for g in code.input_grads if g.owner.kind != "cols"]
    in_dkdv = [g for g in code.input_grads if g.owner.kind == "cols"]
    # What a dQ step reads for each read: its derivative, and where it writes (the
    # element's offset: dense stores and atomics; the table entry: table sums).
    dq_pieces = [p for g in in_dq for p in (g.d_code, g.slot, g.diagonal_slot, g.offset) if p is not None
                 and (p is not g.offset or g.owner.kind in ("dense", "shared", "scattered"))]
    shared = [g for g in in_dq if g.owner.kind == "shared"]
    d_score = code.d_score if code.score is not None else None
    # Where each piece is placed: the loop bounds of the main kernels without tables, of
    # decode_split always; the rest in the per-tile functions they read names of.
    diagonal = [] if code.diagonal is None else [code.diagonal.score] + [
        piece for r in code.diagonal.reads for piece in (r.at, r.value, r.per_pair)]
    device, _ = used([code.mask, code.score, d_score, code.layout_elem, code.decode_layout,
                      code.sink, code.decode_sink, *diagonal,
                      *grads, *code.k_segments, *([] if code.uses_tables else code.q_segments)])
    if variant.dropout:
        device |= {"_dropout_keep", "_dropout_keep_t"}
    aliases = helpers.host_aliases(code.classification.helpers)
    forward = used([code.mask, code.score, code.layout_elem])[1]
    reads = {
        "fwd": forward,
        "dq": forward | used([d_score, *dq_pieces])[1]
        | {g.ptr for g in in_dq if g.owner.kind in ("dense", "shared", "scattered")}
        | {g.part for g in shared} | {_switch(g) for g in shared}
        | ({"offs_m", "pid_bh", "len_q"} if shared else set()),
        "dkdv": forward | used([d_score, *[g.d_code for g in in_dkdv]])[1],
        "decode": used([code.mask, code.score, code.decode_layout])[1],
    }
    flags = {"score" if code.score is not None else "no score"}
    flags |= {"dropout"} if variant.dropout else set()
    flags |= {"normalised"} if variant.normalize != ir.UNNORMALIZED else set()
    flags |= {"decode layout"} if code.decode_layout is not None else set()
    return dict(emit=helpers.needed(device | host_helpers(code) | set(ALWAYS_DEFINED)).__contains__,
                host_aliases=aliases, unread=parameters.unread(flags, reads))


def generate(variant: ir.Variant) -> Generated:
    """The Triton module source for `variant`."""
    context = template_context(variant)
    source = _environment().get_template("attention.py.jinja").render(**context)
    source = re.sub(r"\n{4,}", "\n\n\n", source)  # where left-out helpers were
    return Generated(source=source, strategy=context["strategy"], module_name=module_name(variant))


def template_context(variant: ir.Variant, code: VariantCode | None = None) -> dict:
    """Everything the templates fill in for `variant`: the expressions, the loop plans,
    the tile-classification code and the kernel parameter list, and what the portable
    module defines and passes of them. Every backend's template renders from this one
    dict (`code`: the variant's, printed already), so the pieces exist once."""
    code = code or variant_code(variant)
    pair = per_pair(variant)
    uses_tables = code.uses_tables
    summary_reads = code.summary_reads
    params = common_params(variant, uses_tables, partial_params(code.input_grads))
    spec_text = print_variant(variant)
    context = dict(
        **_pruning(variant, code),
        version=_package_version(),
        spec_comment="\n".join(f"#   {line}" for line in spec_text.rstrip().splitlines()),
        spec_text=spec_text,
        strategy=describe_strategy(variant, code.fwd_plan, summary_reads, uses_tables),
        variant_name=variant.name,
        key=variant.key(),
        input_names=[i.name for i in variant.inputs],
        input_codes={i.name: input_code(i.name) for i in variant.inputs},
        int32_extent=code.int32_extent,
        learnable_names=[i.name for i in variant.learnable_inputs],
        # Those whose gradient the kernels write (the score or weight reads them); one only
        # the sink reads takes its gradient from runtime/sinks.py alone.
        kernel_grad_names=[i.name for i in variant.learnable_inputs
                           if any(g.name == i.name for g in code.input_grads)],
        # The sink's learnable reads: the file's backward adds a direct read's gradient
        # (sinks[h]) itself, and refuses an expression's, which needs attncc's runtime.
        sink_learnables=list(sink_learnables(variant)),
        # An index-list layout turns whole blocks on: every tile must nest in one.
        tiles_within_block=variant.block if needs_tiles_within_block(variant) else None,
        sink_direct=direct_sink_read(variant),
        dropout=bool(variant.dropout),
        dropout_p=repr(float(variant.dropout or 0.0)),
        dropout_threshold=dropout.threshold(variant.dropout or 0.0),
        tables=uses_tables,
        table_fields=interface.TABLE_FIELDS,
        table_inputs=sorted({r.tensor for r in summary_reads}
                            | (ir.loaded_tensors(variant.layout) if variant.layout is not None else set())),
        host_classify_lines=code.classification.lines,
        host_classify_may=code.classification.may,
        host_classify_must=code.classification.must,
        mask=_text(code.mask),
        score=_text(code.score),
        # Reads through q - k only: a tile whose diagonals each read one element of
        # them loads it once (codegen/relative_reads.py; the portable kernels)
        diagonal_reads=[] if code.diagonal is None else [
            {"name": r.name, "at": r.at.text, "value": r.value.text, "per_pair": r.per_pair.text} for r in code.diagonal.reads],
        diagonal_score=_text(code.diagonal.score if code.diagonal else None),
        sink=_text(code.sink),
        decode_sink=_text(code.decode_sink),
        # A score that does not vary over both q and k (`score 0.0`, `score x[h]`) is
        # broadcast to the tile: the softmax sums over the tile's columns.
        score_is_tile=pair.score is not None and (
            "s" in ir.free_vars(pair.score) or {"q", "k"} <= ir.free_vars(pair.score)),
        # softmax, or `sum`/`none` of the weight (the `score` slot then holds it).
        normalize=variant.normalize,
        # Nothing but the scale acts on q·k, and the scale is positive: the forwards take
        # the row max over q·k and scale it once, and every kernel computes a weight as
        # exp2(qk * qk_scale - m), one multiply-add, where scaling first takes two.
        fold_scale=(code.score is None and variant.normalize == "softmax"
                    and scale_is_positive(variant)),
        d_score=code.d_score.text,
        # d score / d s at a masked pair may be inf or NaN (`s * sqrt(q - k)` past a
        # causal mask) and multiplies a dS of 0 there: the backward zeroes those pairs.
        d_score_finite=_is_constant(code.d_score.text),
        input_grads=[_input_grad_context(g) for g in code.input_grads],
        partial_params=partial_params(code.input_grads),
        owned_reads=[g.part for g in code.input_grads if g.part],
        owned_reads_literal=_owned_reads_literal(code.input_grads),
        cols_reads=any(g.owner.kind == "cols" for g in code.input_grads),
        scattered_inputs=sorted({g.name for g in code.input_grads if g.owner.kind == "scattered"}),
        # What the dQ and dK/dV steps carry from tile to tile: their gradient tiles (dQ's
        # and dK's in q·k's two head-dim segments), and the sums of the learnable reads
        # their programs own.
        dq_carried=", ".join(["dq, dq_tail"] + [g.part.replace("_ptr", "_acc") for g in code.input_grads
                                       if g.owner.kind in ("broadcast", "rows", "table")]),
        dkdv_carried=", ".join(["dk, dk_tail, dv"] + [g.part.replace("_ptr", "_acc") for g in code.input_grads
                                             if g.owner.kind == "cols"]),
        layout=variant.layout is not None,
        block=variant.block,
        layout_torch=_text(code.layout_torch),
        layout_elem=_text(code.layout_elem),
        k_segments=code.k_segments,
        q_segments=code.q_segments,
        heavy_rows_last=heavy_tiles_last(code.fwd_plan, "q"),
        heavy_cols_last=heavy_tiles_last(code.bwd_plan, "k"),
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
        scale_code=code.scale.text,
        **decode_context(variant, code.fwd_plan, code.decode_layout),
    )
    return context


def _owned_reads_literal(input_grads) -> str:
    """OWNED_READS of the portable module, one read per line."""
    rows = [f"    {g.part!r}: ({g.name!r}, {g.owner.kind!r}, {tuple(g.owner.owners)!r}, "
            f"{tuple(g.owner.axes)!r}, {1 << max(g.owner.slots - 1, 1).bit_length()}),"
            for g in input_grads if g.part]
    return "{\n" + "\n".join(rows) + "\n}"


def _switch(g: InputGradient) -> str:
    """The run-time argument that says whether a shared read's partials fit this call."""
    return g.part.replace("part", "share").replace("_ptr", "")


def partial_params(input_grads) -> list:
    """The kernel arguments of the learnable reads' partials (and shared reads' switches)."""
    return [name for g in input_grads if g.part
            for name in ([g.part, _switch(g)] if g.owner.kind == "shared" else [g.part])]


def _input_grad_context(g: InputGradient) -> dict:
    """One learnable read, as the portable templates and the host's second pass take it."""
    o = g.owner
    return {"name": g.name, "ptr": g.ptr, "d_code": g.d_code.text, "offset": g.offset.text,
            "reduce": g.reduce, "kind": o.kind, "part": g.part, "slot": _text(g.slot),
            "diagonal_slot": _text(g.diagonal_slot),
            "slots": o.slots, "slots_pad": 1 << max(o.slots - 1, 1).bit_length(),
            "owners": list(o.owners), "axes": list(o.axes),
            "acc": g.part.replace("_ptr", "_acc") if g.part else None,
            "switch": _switch(g) if o.kind == "shared" else None}


def _text(code: Code | None):
    return None if code is None else code.text


def _package_version() -> str:
    from ...version import __version__
    return __version__


def _is_constant(code: str) -> bool:
    """Whether generated code is a literal number (a derivative that cannot be inf)."""
    try:
        return math.isfinite(float(code))
    except ValueError:
        return False
