"""Reads of fixed-size tables whose index can leave the table.

`input bias: f32[h, 10]` read as `bias[h, q - k]` is valid, but q - k can be negative
or past 9: the kernels clamp such an index to the nearest entry (a read never faults),
while the reference raises a CallError. The spec compiles, and the kernels return
finite garbage, so the front ends warn (attncc.SpecWarning) where the range analysis
(attncc/analysis/ranges.py) shows that an index on a numbered axis can leave it, and
offer the clamp the author likely meant.

Only indices computed from positions, indices, params and constants are judged: an
index that reads another input depends on that input's data, which is the caller's to
keep in range, and one that reads len_q or len_k usually relates a position to its
length (`k - len_k + draft`, below `draft` without offsets), which intervals cannot
see, so it would be warned about where it is right. The analysis knows nothing of the
mask, so a read that only escapes at pairs the mask removes is warned about too: the
reference evaluates the score at every pair and raises there as well.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ir
from .ranges import MAX_EXTENT, ranges_at


@dataclass(frozen=True)
class EscapingRead:
    """One index of one read that can leave its axis of `size` entries."""
    load: ir.Load
    axis: int  # 0-based
    size: int
    lo: int  # the index's range at the largest extent
    hi: int
    safe_extent: int  # the largest extent at which it stays in range; 0: none

    def message(self, decl: str) -> str:
        """The warning: the read, the range that escapes and from when, the clamp."""
        index = self.load.indices[self.axis]
        side = " and ".join((["below 0"] if self.lo < 0 else [])
                            + ([f"past {self.size - 1}"] if self.hi >= self.size else []))
        when = ("on every call" if self.safe_extent == 0
                else f"once a size or position reaches {self.safe_extent + 1}")
        clamped = list(self.load.indices)
        clamped[self.axis] = ir.Call("min", (ir.Call("max", (index, ir.Const(0, ir.INT))),
                                             ir.Const(self.size - 1, ir.INT)))
        fixed = ir.print_expr(ir.Load(self.load.tensor, tuple(clamped)))
        return (f"in `{decl}`, `{ir.print_expr(self.load)}` reads '{self.load.tensor}' (axis "
                f"{self.axis + 1}: {self.size} entries) at an index that goes {side} {when} "
                f"(it ranges over [{self.lo}, {self.hi}]); the kernels then clamp it to the "
                f"nearest entry, while attncc.reference raises. To clamp, write `{fixed}`")


def escaping_reads(variant: ir.Variant) -> list:
    """(declaration, EscapingRead) for each index of a numbered axis that can leave it."""
    sizes = {i.name: i.axes for i in variant.inputs}
    found = []
    for decl in ("mask", "layout", "score", "sink", "weight"):
        e = getattr(variant, decl)
        if e is None:
            continue
        for node in ir.walk(e):
            if not isinstance(node, ir.Load):
                continue
            for axis, (index, size) in enumerate(zip(node.indices, sizes[node.tensor])):
                if not isinstance(size, int) or _not_judged(index):
                    continue
                read = _escape(variant, node, axis, index, size)
                if read is not None:
                    found.append((decl, read))
    return found


def _not_judged(e) -> bool:
    return any(isinstance(n, (ir.Load, ir.Member))
               or (isinstance(n, ir.Var) and n.name in ("len_q", "len_k")) for n in ir.walk(e))


def _range(variant, index, extent: int):
    return ranges_at(index, variant, extent).get(id(index))


def _escape(variant, load, axis: int, index, size: int):
    r = _range(variant, index, MAX_EXTENT)
    if r is None or r.wrapped or (0 <= r.lo and r.hi < size):
        return None
    fits = lambda extent: (lambda x: 0 <= x.lo and x.hi < size)(_range(variant, index, extent))
    safe = 0
    if fits(1):
        lo, hi = 1, MAX_EXTENT  # fits at lo, not at hi: ranges grow with the extent
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        safe = lo
    return EscapingRead(load, axis, size, r.lo, r.hi, safe)
