"""The sink's reads of learnable inputs: their gradient through the sink is added outside
the kernels, from the LSE and delta (runtime/sinks.py, and the backward of the file
`attncc compile` writes). Pure IR, no sympy: the runtime imports it on a warm start."""
from __future__ import annotations

from .. import ir

# Where a row's index names sit in an LSE's [B, H, Lq].
ROW_AXES = {"b": 0, "h": 1}


def sink_learnables(variant: ir.Variant) -> tuple:
    """The learnable inputs the sink reads, in declared order: their gradient through the
    sink is added outside the kernels (runtime/sinks.py), from the LSE and delta."""
    if variant.sink is None:
        return ()
    read = ir.loaded_tensors(variant.sink)
    return tuple(d.name for d in variant.learnable_inputs if d.name in read)


def direct_sink_read(variant: ir.Variant):
    """(input, its row axes) where the sink is one learnable input read as-is at distinct
    row index names that are also its declared axes (gpt-oss's `sinks[h]`, `s[b, h]`), else
    None. Such a sink's gradient is dσ summed over the rows' other axes: no expression to
    differentiate."""
    read = variant.sink
    if not isinstance(read, ir.Load):
        return None
    decl = next((d for d in variant.learnable_inputs if d.name == read.tensor), None)
    axes = tuple(getattr(i, "name", None) for i in read.indices)
    if decl is None or tuple(decl.axes) != axes or len(set(axes)) != len(axes) \
            or not all(a in ROW_AXES for a in axes):
        return None
    return read.tensor, axes
