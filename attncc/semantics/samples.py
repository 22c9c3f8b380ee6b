"""Deterministic stand-ins for a variant's runtime inputs: what `attncc check`, `attncc
bench`, `attncc compile --len` and `attncc show --plot` run a variant on when the user
gives no tensors. One generator, so that every command shows the same documents and
layouts for the same seed."""
from __future__ import annotations

import torch

from .. import ir
from ..arguments import TORCH_DTYPES, Problem, axis_extent, random_index_lists

BOOL_DENSITY = 0.25  # sampled bool inputs (layouts) are true this often


def _doc_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    """n sorted random document ids: a few documents of random lengths."""
    n_docs = max(3, n // 512)
    return torch.sort(torch.randint(0, n_docs, (n,), generator=gen)).values


def sample_inputs(variant: ir.Variant, p: Problem, *, seed: int = 0,
                  bool_density: float = BOOL_DENSITY, device="cpu") -> dict:
    """Deterministic stand-ins for the variant's runtime inputs, in their declared dtypes.

    Integer tensors with one position axis (q or k) hold sorted random document ids,
    cut from one sequence over absolute positions, so that doc_q[i] == doc_k[i]; other
    integer tensors small ints in [0, 8); index lists (`kb in top[...]`) distinct random
    tiles, padded with -1; bool tensors (layouts) are true with
    probability `bool_density`; float tensors are standard normal.
    """
    gen = torch.Generator().manual_seed(seed)
    n_pos = max(p.q_offset + p.len_q, p.k_offset + p.len_k)
    docs = _doc_ids(n_pos, gen)
    out = {}
    lists = ir.index_lists(variant.layout)
    for decl in variant.inputs:
        shape = tuple(axis_extent(a, variant, p) for a in decl.axes)
        dtype = TORCH_DTYPES[decl.dtype]
        kind = _kind(decl, lists)
        if kind == "index list":
            t = random_index_lists(shape, axis_extent(lists[decl.name], variant, p), gen)
        elif kind == "layout":
            t = torch.rand(shape, generator=gen) < bool_density
        elif kind == "documents":
            axis = next(i for i, a in enumerate(decl.axes) if a in ("q", "k"))
            view = [1] * len(shape)
            view[axis] = shape[axis]
            t = docs[:shape[axis]].view(view).expand(shape)
        elif kind == "small ints":
            t = torch.randint(0, 8, shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
        out[decl.name] = t.to(dtype).contiguous().to(device)
    return out


def _kind(decl: ir.InputDecl, lists: dict) -> str:
    """Which of sample_inputs' stand-ins an input gets (a key of HOW_INVENTED)."""
    if decl.name in lists:
        return "index list"
    if decl.type == ir.BOOL:
        return "layout"
    if decl.type == ir.INT:
        one_position_axis = sum(a in ("q", "k") for a in decl.axes) == 1
        return "documents" if one_position_axis else "small ints"
    return "normal"


HOW_INVENTED = {
    "index list": "distinct random tile indices, padded with -1",
    "layout": f"true with probability {BOOL_DENSITY}",
    "documents": "sorted random document ids, one numbering of positions",
    "small ints": "random ints in [0, 8)",
    "normal": "standard normal",
}


def describe_invented(variant: ir.Variant) -> list:
    """How sample_inputs makes up each input, one "names: how" entry per kind of stand-in
    ("doc_q, doc_k: sorted random document ids, ..."), for commands to say what they ran on."""
    lists = ir.index_lists(variant.layout)
    by_kind: dict = {}
    for decl in variant.inputs:
        by_kind.setdefault(_kind(decl, lists), []).append(decl.name)
    return [f"{', '.join(names)}: {HOW_INVENTED[kind]}" for kind, names in by_kind.items()]


def default_heads(variant: ir.Variant, fallback: int) -> tuple:
    if variant.heads is not None:
        return variant.heads.q, variant.heads.kv
    return fallback, fallback
