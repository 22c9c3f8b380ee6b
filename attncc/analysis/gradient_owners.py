"""Who owns the gradient of each learnable read: the plan that lets a backward add
learnable inputs' gradients in a fixed order, with no floating-point atomics.

A learnable read `x[i0, i1, ...]` in the score receives dS * d score / d x at every
(b, h, q, k) pair. Which program may write an element depends on what its index varies
with; that decides the read's `kind`:

    broadcast  no q, no k (`slopes[h]`): each query-tile program sums its keys and
               stores one partial per (b, h, query tile); a second pass sums them.
    rows       q, not k (`w[b, h, q]`): the program that owns the query rows.
    cols       k, not q (`g[b, h, k]`): the program that owns the key tile (dK/dV),
               which loops over the heads of its group and the query tiles.
    table      q and k, through one axis of a small fixed size (T5's
               `bias[h, bucket(q - k)]`): each query-tile program sums its pairs per
               table entry (compare and sum, fp32) into one partial row of that axis per
               (b, h, query tile); a second pass sums them.
    dense      q and k, each element read at one pair (`bias[b, h, q, k]`, declared
               with those extents): the pair's program stores dS * d directly.
    shared     q and k on axes of their own, but not every owner on one (`bias[q, k]`
               read by every head): one partial per (b, h) of the (q, k) plane, summed,
               where it fits a per-call memory budget; past it, atomics.
    scattered  anything else (`w[h // 2]`, `bias[h, q - k + c]` on a runtime-sized
               axis): atomics, and `deterministic=True` refuses the call.

Every owned kind but dense ends in a partial tensor whose axes are owners (b, h, then
q, k or the table's slot) and a second pass in a fixed order (sums over axes): the read's
`axes` say, per axis of the input, which owner indexes it ("b", "h", "q", "k", "slot")
or which constant element it reads (an int). An owner no axis names is summed over.

Whether a table index goes through q - k only (`relative`) is decided here too, with
sympy on the affine pieces: such a read's entry is constant along each diagonal of a
tile, so a backend may sum the tile per diagonal and add each diagonal to its entry
(the portable backward does: docs/design.md); compare and sum over the entries a tile
touches takes any index. Backends print these records; nothing here is code text.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .. import ir
from .symbolic import IntegerPolynomial, NotSymbolic

# A table axis this long or shorter is summed per entry in registers (one fp32 each);
# a longer one is scattered.
MAX_TABLE_SLOTS = 1024

OWNERS = {"broadcast": ("b", "h"), "rows": ("b", "h", "q"), "cols": ("b", "h", "k"),
          "table": ("b", "h", "slot"), "dense": ("b", "h", "q", "k"),
          "shared": ("b", "h", "q", "k"), "scattered": ()}


@dataclass(frozen=True)
class GradientOwner:
    """How one learnable read's gradient is owned (the module docstring's kinds)."""
    load: ir.Load
    kind: str
    axes: tuple  # per axis of the input: an owner name or a constant index (int)
    slot_axis: int | None = None  # table: the axis summed per entry
    slots: int = 0  # table: that axis' size
    relative: bool = False  # table: its index goes through q - k only

    @property
    def owners(self) -> tuple:
        """The partial's axes, in order (OWNERS)."""
        return OWNERS[self.kind]

    @property
    def deterministic(self) -> bool:
        """Whether its gradient is written in a fixed order on every call (shared ones
        are where their partials fit the call's budget)."""
        return self.kind not in ("shared", "scattered")


class _Affine(IntegerPolynomial):
    """An index piece as a polynomial of positions and sizes (+ - * only)."""

    def Var(self, e):
        return sympy.Symbol(e.name, integer=True)


_Q, _K = sympy.Symbol("q", integer=True), sympy.Symbol("k", integer=True)


def _shift_free(e, params) -> bool:
    """Whether affine `e` is unchanged when q and k move together (a function of q - k)."""
    try:
        form = sympy.expand(_Affine(params)(e))
    except NotSymbolic:
        return False
    return sympy.expand(form.subs({_Q: _Q + 1, _K: _K + 1}) - form) == 0


def is_relative(e, params: dict) -> bool:
    """Whether index `e` depends on q and k through q - k only: every smallest piece that
    reads a position is affine and shift-free (`q - k + 5`), or a comparison of two such
    sides (`k > q`), and what reads those pieces reads no other position."""
    if not ({"q", "k"} & ir.free_vars(e)):
        return True
    if _shift_free(ir.BinOp("-", e.lhs, e.rhs) if isinstance(e, ir.Cmp) else e, params):
        return True
    if isinstance(e, (ir.Var, ir.Load, ir.Member)):
        return False  # a position alone, or a tensor read at positions
    return all(is_relative(c, params) for c in ir.children(e))


def _plain_axis(index):
    """The owner a plain index names (Var b, h, q, k), a constant index (an int), or None."""
    if isinstance(index, ir.Var) and index.name in ("b", "h", "q", "k"):
        return index.name
    if isinstance(index, ir.Const) and index.type == ir.INT:
        return index.value
    return None


def _param_value(index, params):
    if isinstance(index, ir.Param) and isinstance(params.get(index.name), int) \
            and not isinstance(params[index.name], bool):
        return params[index.name]
    return None


def classify(load: ir.Load, decl: ir.InputDecl, params: dict, reads_of_input: int) -> GradientOwner:
    """The owner of one learnable read. `reads_of_input`: how many reads of its input
    the score holds (a dense store is one writer per element only when there is one)."""
    varies = set().union(*(ir.free_vars(i) for i in load.indices)) & {"q", "k"}
    axes, loose = [], []
    for n, index in enumerate(load.indices):
        plain = _plain_axis(index)
        if plain is None:
            plain = _param_value(index, params)
        axes.append(plain)
        if plain is None:
            loose.append(n)
    named = [a for a in axes if isinstance(a, str)]
    scattered = GradientOwner(load, "scattered", tuple(axes))
    if len(named) != len(set(named)):
        return scattered  # `w[h, h]`: one owner on two axes
    if not varies:
        return GradientOwner(load, "broadcast", tuple(axes)) if not loose else scattered
    if varies == {"q"} or varies == {"k"}:
        kind = "rows" if varies == {"q"} else "cols"
        return GradientOwner(load, kind, tuple(axes)) if not loose else scattered
    if len(loose) == 1 and "q" not in named and "k" not in named:
        n = loose[0]
        size = decl.axes[n]
        if isinstance(size, int) and size <= MAX_TABLE_SLOTS:
            axes[n] = "slot"
            return GradientOwner(load, "table", tuple(axes), slot_axis=n, slots=size,
                                 relative=is_relative(load.indices[n], params))
        return scattered
    if loose:
        return scattered
    # q and k on axes of their own: one writer per element where every owner has an
    # axis of its own extent (no clamping folds two positions into one element).
    own_extents = all(decl.axes[n] == a for n, a in enumerate(axes) if isinstance(a, str))
    if set(named) == {"b", "h", "q", "k"} and own_extents and reads_of_input == 1:
        return GradientOwner(load, "dense", tuple(axes))
    return GradientOwner(load, "shared", tuple(axes))


def gradient_owners(variant: ir.Variant, loads) -> list:
    """The GradientOwner of each learnable read in `loads` (ir.Load), in order."""
    params = {p.name: p.value for p in variant.params}
    counts = {}
    for load in loads:
        counts[load.tensor] = counts.get(load.tensor, 0) + 1
    return [classify(load, variant.input(load.tensor), params, counts[load.tensor])
            for load in loads]


def learnable_reads(variant: ir.Variant) -> list:
    """The score's distinct reads of learnable inputs, in source order. Under `normalize
    sum` or `none` pass the variant as the kernels see a pair (`per_pair` in
    backends/portable/codegen.py puts weight(score) in the score's slot)."""
    learnable = {d.name for d in variant.learnable_inputs}
    if variant.score is None:
        return []
    found = [n for n in ir.walk(variant.score) if isinstance(n, ir.Load) and n.tensor in learnable]
    return list(dict.fromkeys(found))
