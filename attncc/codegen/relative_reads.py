"""The score's relative reads: tensor reads whose element depends on q and k through
q - k alone (T5's `table[h, bucket(q - k)]`, a clipped `bias[h, min(max(q - k, -c), c) + c]`).

Such a read is constant along each diagonal of a tile. Where every diagonal a tile has
reads the same element (most tiles of a bucketed or clipped table: past the last bucket
the index saturates), the kernels load that element once, as a scalar, and add it to the
tile, instead of computing the index and gathering per pair: per pair, a T5 bucket costs
a libdevice log, a float-to-int conversion and a 4-byte gather, which made the portable
kernels 5-13x slower than a score without the read. Which tiles qualify is decided at run
time from the element's offset at each of the tile's diagonals (codegen/templates/
scores.jinja, read_diagonals), so any index through q - k qualifies, monotone or not; the
other tiles keep the per-pair read. Both paths read the same element for each pair and
compute the same formula: the scores are identical.

Whether an index goes through q - k only is analysis/gradient_owners.py's is_relative
(sympy on the affine pieces).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ir
from ..analysis.gradient_owners import is_relative
from .elementwise import TritonEmitter
from .printed import Code

# The positions one diagonal of a tile is read at: the template binds diag_q and diag_k,
# one of them a column of the tile's rows shifted to one diagonal per row, the other the
# first position of the tile's columns (scores.jinja, read_diagonals).
DIAGONAL_POSITIONS = {"q": "diag_q", "k": "diag_k"}


@dataclass(frozen=True)
class RelativeRead:
    """One relative read of the score: the template names its values after `name`."""
    name: str
    at: Code  # the element's offset at the diagonals diag_q - diag_k, indices clamped
    value: Code  # the element at offset `{name}_lo`: one scalar load
    per_pair: Code  # the read at each pair of the tile, as the per-pair score reads it


@dataclass(frozen=True)
class DiagonalScore:
    """The score with each relative read taken from `{name}_pairs`, the tile of its
    values (the scalar broadcast where the tile reads one element, else per_pair);
    everything else as in the per-pair score; `uniform`, the score of a tile whose every
    diagonal reads one element of each read, with each read the scalar `{name}` (the
    Gluon kernels branch between it and the per-pair score: a branch that yields the
    tile of values instead spilled there, templates/scores.jinja's log2_scores)."""
    reads: tuple
    score: Code
    uniform: Code


class _NamedReads(TritonEmitter):
    """The score's emitter, with the chosen reads written as their names."""

    def __init__(self, variant, names: dict, wide):
        super().__init__(variant, wide=wide)
        self.names_of_reads = names

    def Load(self, e):
        if e in self.names_of_reads:
            return self.names_of_reads[e]
        return super().Load(e)


def relative_loads(score: ir.Expr, params: dict) -> list:
    """The score's distinct reads that vary with q and k, through q - k only, in source order."""
    found = []
    for node in ir.walk(score):
        if not isinstance(node, ir.Load) or node in found:
            continue
        # Both positions: its tile of values then has the tile's shape on either path.
        varies = set().union(*(ir.free_vars(i) for i in node.indices)) & {"q", "k"}
        if varies == {"q", "k"} and all(is_relative(i, params) for i in node.indices):
            found.append(node)
    return found


def diagonal_score(variant: ir.Variant, wide: str | None) -> DiagonalScore | None:
    """The softmax score with its relative reads taken from their tiles of values, or
    None where the variant is not softmax (its weights are not scores.jinja's log2
    scores), its score has no relative read, or it ignores s (such a score is left per
    pair). `wide`: the per-pair score's integer width."""
    if variant.normalize != ir.SOFTMAX or variant.score is None \
            or "s" not in ir.free_vars(variant.score):
        return None
    params = {p.name: p.value for p in variant.params}
    loads = relative_loads(variant.score, params)
    if not loads:
        return None
    names = {load: f"rel{n}" for n, load in enumerate(loads)}
    reads = []
    for load, name in names.items():
        decl = variant.input(load.tensor)
        diagonal = TritonEmitter(variant, DIAGONAL_POSITIONS, wide=wide)
        at = diagonal.capture(lambda: diagonal.offset(decl, load.indices))
        scalar = TritonEmitter(variant, wide=wide)
        value = scalar.capture(lambda: scalar.loaded(decl, f"{name}_lo"))
        reads.append(RelativeRead(name, at, value, TritonEmitter(variant, wide=wide).code(load)))
    named = _NamedReads(variant, {load: f"{name}_pairs" for load, name in names.items()}, wide)
    scalars = _NamedReads(variant, names, wide)
    return DiagonalScore(tuple(reads), named.code(variant.score), scalars.code(variant.score))
