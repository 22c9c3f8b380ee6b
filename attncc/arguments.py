"""Call-time arguments: checks q, k, v and the variant's inputs, and derives the problem shape.

Shared by the reference and the kernels so that both accept exactly the same calls and
word their errors the same way. Every error names the argument, what was given and
what was expected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import ir
from .errors import CallError

TORCH_DTYPES = {
    "bool": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
    "i64": torch.int64, "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
    "f64": torch.float64,
}


@dataclass(frozen=True)
class Problem:
    """The sizes of one call: what the kernel grid and the index ranges come from."""
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    dim: int
    dim_v: int
    q_offset: int = 0
    k_offset: int = 0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv


def _shape(t) -> str:
    # An f-string, not str(): under torch.compile the checks run at trace time, where
    # sizes are symbolic, and Dynamo formats those but cannot call str() on them.
    return "(" + ", ".join(f"{s}" for s in t.shape) + ")"


def bind(variant: ir.Variant, q, k, v, inputs: dict, *, q_offset: int = 0,
         k_offset: int = 0, exact_float_inputs: bool = True) -> Problem:
    """Check a call and return its Problem; raises CallError naming what is wrong."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise CallError(f"{name} must be a torch.Tensor of shape (batch, heads, seq, dim), "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            raise CallError(f"{name} must have 4 dimensions (batch, heads, seq, dim) like "
                            f"scaled_dot_product_attention, got shape {_shape(t)}")
        if not t.is_floating_point():
            raise CallError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise CallError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}; convert them with .to(dtype)")
    if not (q.device == k.device == v.device):
        raise CallError(f"q, k and v must be on the same device, got q on {q.device}, "
                        f"k on {k.device}, v on {v.device}")
    B, Hq, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise CallError(f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}; "
                        "dimension 0 must agree")
    if k.shape[1] != v.shape[1]:
        raise CallError(f"k and v must have the same number of heads, got k {_shape(k)} and "
                        f"v {_shape(v)}")
    if k.shape[2] != v.shape[2]:
        raise CallError(f"k and v must have the same sequence length, got k {_shape(k)} and "
                        f"v {_shape(v)}")
    if k.shape[3] != D:
        raise CallError(f"q and k must have the same head dim, got q {_shape(q)} and k {_shape(k)}")
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if variant.heads is not None:
        if (Hq, Hkv) != (variant.heads.q, variant.heads.kv):
            raise CallError(f"the variant declares heads {variant.heads.q} / {variant.heads.kv}, "
                            f"but q has {Hq} heads and k, v have {Hkv}")
    elif Hq % Hkv:
        raise CallError(f"q has {Hq} heads, which is not a multiple of the {Hkv} heads of k and v; "
                        "each key/value head must serve a whole group of query heads")
    for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise CallError(f"{name} must be a non-negative int, got {off!r}")
    problem = Problem(B, Hq, Hkv, Lq, Lk, D, Dv, q_offset, k_offset)
    check_inputs(variant, problem, inputs, device=q.device, exact_float_inputs=exact_float_inputs)
    return problem


def axis_extent(axis, variant: ir.Variant, p: Problem) -> int:
    """The length an input axis must have for this call."""
    if isinstance(axis, int):
        return axis
    if axis == "b":
        return p.batch
    if axis == "h":
        return p.heads_q
    # Position axes cover every position the call sees: offset + length.
    if axis == "q":
        return p.q_offset + p.len_q
    if axis == "k":
        return p.k_offset + p.len_k
    if axis == "qb":
        return math.ceil((p.q_offset + p.len_q) / variant.block)
    if axis == "kb":
        return math.ceil((p.k_offset + p.len_k) / variant.block)
    raise ValueError(axis)


def check_inputs(variant: ir.Variant, p: Problem, inputs: dict, *, device,
                 exact_float_inputs: bool = True):
    """Check the variant's runtime inputs. The reference passes exact_float_inputs=False:
    it computes in the dtype of q, so float inputs of any precision (float64 for
    gradient checks) are fine there."""
    declared = {i.name: i for i in variant.inputs}
    extra = sorted(set(inputs) - set(declared))
    if extra:
        raise CallError(f"unexpected input{'s' if len(extra) > 1 else ''} "
                        f"{', '.join(repr(e) for e in extra)}: the variant '{variant.name}' declares "
                        + (", ".join(repr(d) for d in declared) if declared else "no inputs"))
    missing = [d for d in declared if d not in inputs]
    if missing:
        decl = declared[missing[0]]
        raise CallError(f"missing input '{decl.name}': the variant declares "
                        f"`input {decl.name}: {decl.dtype}[{', '.join(map(str, decl.axes))}]`; "
                        f"pass it as {decl.name}=tensor")
    for name, decl in declared.items():
        t = inputs[name]
        if not isinstance(t, torch.Tensor):
            raise CallError(f"input '{name}' must be a torch.Tensor, got {type(t).__name__}")
        want = tuple(axis_extent(a, variant, p) for a in decl.axes)
        if tuple(t.shape) != want:
            names = ", ".join(f"{a}={n}" for a, n in zip(decl.axes, want))
            raise CallError(f"input '{name}' has shape {_shape(t)}, expected {want} "
                            f"({names}) for axes [{', '.join(map(str, decl.axes))}]")
        lenient = not exact_float_inputs and decl.type == ir.FLOAT and t.is_floating_point()
        if t.dtype != TORCH_DTYPES[decl.dtype] and not lenient:
            raise CallError(f"input '{name}' has dtype {t.dtype}, but the variant declares "
                            f"{decl.dtype} ({TORCH_DTYPES[decl.dtype]}); convert it with "
                            f".to({TORCH_DTYPES[decl.dtype]})")
        if t.device != device:
            raise CallError(f"input '{name}' is on {t.device} but q is on {device}; "
                            f"move it with .to(q.device)")


def random_index_lists(shape: tuple, n_tiles: int, gen: torch.Generator) -> torch.Tensor:
    """Sample index lists (int64, `shape`, the list on the last axis): distinct random
    tiles in [0, n_tiles), padded with -1 where a list is longer than there are tiles."""
    *rows, length = shape
    order = torch.rand(*rows, n_tiles, generator=gen).argsort(-1)[..., :length]
    if length > n_tiles:
        pad = torch.full((*rows, length - n_tiles), -1, dtype=order.dtype)
        order = torch.cat([order, pad], -1)
    return order
