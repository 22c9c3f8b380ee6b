"""The IR as FlexAttention and SDPA take it: `lower` evaluates an expression on the
tensors FlexAttention's mask_mod and score_mod receive, `flex_mods` builds the pair,
`sdpa_expressible` says when a variant is plain SDPA (for `attncc bench`).
"""
from __future__ import annotations

import torch

from .. import ir
from ..operators import entry_of


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def lower(e, variant: ir.Variant, inputs: dict):
    """The expression as a Python function of an env {b, h, q, k, s, qb, kb, dim, len_q, len_k}.

    Unlike attncc.evaluate it does no data-dependent checks, so it runs under torch.vmap
    and torch.compile (FlexAttention calls mask_mod / score_mod on batched 0-d index
    tensors): loads clamp their indices into range, as the kernels do. Operations mean
    what attncc/operators.py says, on tensors and on Python numbers alike."""
    return _Lower(variant, inputs)(e)


class _Lower(ir.Visitor):
    """Each node as a function of the env."""

    def __init__(self, variant: ir.Variant, inputs: dict):
        self.params = {d.name: d.value for d in variant.params}
        self.inputs = inputs

    def Var(self, e):
        name = e.name
        return lambda env: env[name]

    def Const(self, e):
        value = e.value
        return lambda env: value

    def Param(self, e):
        value = self.params[e.name]
        return lambda env: value

    def _clamped(self, tensor, indices):
        idx, sizes = [self(i) for i in indices], tensor.shape
        return lambda env: tuple(torch.clamp(torch.as_tensor(f(env)), 0, n - 1)
                                 for f, n in zip(idx, sizes))

    def Load(self, e):
        tensor = self.inputs[e.tensor]
        at = self._clamped(tensor, e.indices)
        return lambda env: tensor[at(env)]

    def Member(self, e):
        tensor, item = self.inputs[e.tensor], self(e.item)
        at = self._clamped(tensor, e.indices)
        return lambda env: (tensor[at(env)] == torch.as_tensor(item(env)).unsqueeze(-1)).any(-1)

    def other(self, e):
        """An operation, in FlexAttention's float32."""
        fn = entry_of(e).torch
        operands = [self(x) for x in ir.children(e)]
        return lambda env: fn(*(f(env) for f in operands), float_dtype=torch.float32)


def flex_mods(variant: ir.Variant, *, len_q: int, len_k: int, dim: int, inputs: dict):
    """(mask_mod or None, score_mod or None): the variant for FlexAttention.

    mask_mod(b, h, q_idx, kv_idx) is the mask and the layout (evaluated on q // block,
    k // block); score_mod(score, b, h, q_idx, kv_idx) is the score transform. Neither
    includes dropout, which FlexAttention cannot express, nor a normaliser other than
    softmax (FlexAttention has only softmax: the benches skip it for those)."""
    const = {"len_q": len_q, "len_k": len_k, "dim": dim}
    mask = lower(variant.mask, variant, inputs) if variant.mask is not None else None
    layout = lower(variant.layout, variant, inputs) if variant.layout is not None else None
    score = lower(variant.score, variant, inputs) if variant.score is not None else None
    mask_mod = score_mod = None
    if mask is not None or layout is not None:
        block = variant.block

        def mask_mod(b, h, q_idx, kv_idx):
            env = {"b": b, "h": h, "q": q_idx, "k": kv_idx, **const}
            ok = mask(env) if mask is not None else None
            if layout is not None:
                env["qb"], env["kb"] = q_idx // block, kv_idx // block
                lay = layout(env)
                ok = lay if ok is None else ok & lay
            return torch.as_tensor(ok) if not _is_tensor(ok) else ok
    if score is not None:
        def score_mod(s, b, h, q_idx, kv_idx):
            out = score({"s": s, "b": b, "h": h, "q": q_idx, "k": kv_idx, **const})
            return out.to(s.dtype) if _is_tensor(out) else torch.full_like(s, out)
    return mask_mod, score_mod


def variant_uses(variant: ir.Variant, name: str) -> bool:
    """Whether the mask or layout depends on index `name` (directly or through an input axis)."""
    for e in (variant.mask, variant.layout):
        if e is None:
            continue
        if name in ir.free_vars(e) or any(name in variant.input(t).axes for t in ir.loaded_tensors(e)):
            return True
    return False


def sdpa_expressible(variant: ir.Variant, len_q: int, len_k: int):
    """None when SDPA cannot compute the variant, else its keyword arguments (is_causal...)."""
    if (variant.score is not None or variant.layout is not None or variant.inputs
            or variant.sink is not None or variant.normalize != ir.SOFTMAX):
        return None
    causal = ir.Cmp(">=", ir.Var("q"), ir.Var("k"))
    if variant.mask is None:
        kwargs = {"is_causal": False}
    elif variant.mask == causal and len_q == len_k:
        kwargs = {"is_causal": True}
    else:
        return None
    if variant.dropout:
        kwargs["dropout_p"] = variant.dropout  # same cost; its random bits differ from attncc's
    return kwargs
