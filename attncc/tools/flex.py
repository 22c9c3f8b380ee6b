"""The IR as FlexAttention and SDPA take it: `lower` evaluates an expression on the
tensors FlexAttention's mask_mod and score_mod receive, `flex_mods` builds the pair,
`sdpa_expressible` says when a variant is plain SDPA (for `attncc bench`).
"""
from __future__ import annotations

import math

import torch

from .. import ir
from ..semantics import operators, random_blocks


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _to_float(x):
    return x.to(torch.float32) if _is_tensor(x) and not x.is_floating_point() else (
        float(x) if not _is_tensor(x) else x)


def _min(a, b):
    if _is_tensor(a) or _is_tensor(b):
        return torch.where(a < b, a, b)
    return min(a, b)


def _max(a, b):
    if _is_tensor(a) or _is_tensor(b):
        return torch.where(a > b, a, b)
    return max(a, b)


def _unary(fn, name):
    def f(x):
        return fn(_to_float(x)) if _is_tensor(x) else getattr(math, name)(x)
    return f


def _rounding(fn, py):
    def f(x):
        return fn(_to_float(x)).long() if _is_tensor(x) else py(x)
    return f


_CALLS = {"abs": lambda x: x.abs() if _is_tensor(x) else abs(x), "min": _min, "max": _max,
          "exp": _unary(torch.exp, "exp"), "log": _unary(torch.log, "log"),
          "tanh": _unary(torch.tanh, "tanh"), "sqrt": _unary(torch.sqrt, "sqrt"),
          "floor": _rounding(torch.floor, math.floor), "ceil": _rounding(torch.ceil, math.ceil),
          "int": _rounding(torch.trunc, math.trunc)}


def lower(e, variant: ir.Variant, inputs: dict):
    """The expression as a Python function of an env {b, h, q, k, s, qb, kb, dim, len_q, len_k}.

    Unlike attncc.evaluate it does no data-dependent checks, so it runs under torch.vmap
    and torch.compile (FlexAttention calls mask_mod / score_mod on batched 0-d index
    tensors): loads clamp their indices into range, as the kernels do."""
    params = {d.name: d.value for d in variant.params}

    def go(e):
        if isinstance(e, ir.Var):
            name = e.name
            return lambda env: env[name]
        if isinstance(e, ir.Const):
            value = e.value
            return lambda env: value
        if isinstance(e, ir.Param):
            value = params[e.name]
            return lambda env: value
        if isinstance(e, ir.Load):
            tensor = inputs[e.tensor]
            idx = [go(i) for i in e.indices]
            sizes = tensor.shape

            def load(env):
                at = tuple(torch.clamp(torch.as_tensor(f(env)), 0, n - 1) for f, n in zip(idx, sizes))
                return tensor[at]
            return load
        if isinstance(e, ir.Member):
            tensor, item = inputs[e.tensor], go(e.item)
            idx, sizes = [go(i) for i in e.indices], inputs[e.tensor].shape

            def member(env):
                at = tuple(torch.clamp(torch.as_tensor(f(env)), 0, n - 1) for f, n in zip(idx, sizes))
                return (tensor[at] == torch.as_tensor(item(env)).unsqueeze(-1)).any(-1)
            return member
        if isinstance(e, ir.BinOp):
            a, b, op = go(e.lhs), go(e.rhs), e.op
            return lambda env: operators.apply(op, a(env), b(env))
        if isinstance(e, ir.Neg):
            a = go(e.operand)
            return lambda env: -a(env)
        if isinstance(e, ir.Cmp):
            a, b = go(e.lhs), go(e.rhs)
            fn = {"<": lambda x, y: x < y, "<=": lambda x, y: x <= y, ">": lambda x, y: x > y,
                  ">=": lambda x, y: x >= y, "==": lambda x, y: x == y,
                  "!=": lambda x, y: x != y}[e.op]
            return lambda env: fn(a(env), b(env))
        if isinstance(e, ir.And):
            a, b = go(e.lhs), go(e.rhs)
            return lambda env: a(env) & b(env)
        if isinstance(e, ir.Or):
            a, b = go(e.lhs), go(e.rhs)
            return lambda env: a(env) | b(env)
        if isinstance(e, ir.Not):
            a = go(e.operand)
            return lambda env: (~x) if _is_tensor(x := a(env)) else (not x)
        if isinstance(e, ir.Call) and e.fn == "chance":
            p = random_blocks.probability(e, {d.name: d.value for d in variant.params})
            keys = [go(x) for x in e.args[1:]]
            return lambda env: random_blocks.chance(p, *(f(env) for f in keys))
        if isinstance(e, ir.Call):
            args, fn = [go(x) for x in e.args], _CALLS[e.fn]
            return lambda env: fn(*(f(env) for f in args))
        if isinstance(e, ir.Where):
            c, a, b = go(e.cond), go(e.then), go(e.other)
            return lambda env: torch.where(torch.as_tensor(c(env)), a(env), b(env))
        raise TypeError(f"cannot lower {type(e).__name__} for FlexAttention")
    return go(e)


def flex_mods(variant: ir.Variant, *, len_q: int, len_k: int, dim: int, inputs: dict):
    """(mask_mod or None, score_mod or None): the variant for FlexAttention.

    mask_mod(b, h, q_idx, kv_idx) is the mask and the layout (evaluated on q // block,
    k // block); score_mod(score, b, h, q_idx, kv_idx) is the score transform. Neither
    includes dropout, which FlexAttention cannot express."""
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
    if variant.score is not None or variant.layout is not None or variant.inputs:
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
