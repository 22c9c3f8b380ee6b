"""Params a check never exercises: a `param window: int = 1024` checked at lengths 37 and
45 masks exactly what window 1023 or 1025 would, so an error in how the kernel applies
the window could not show. `attncc check` and `kernel.check` warn about such params.

A param is exercised when changing it a little (an int by one, a float by 1/16 of its
value, a bool flipped) changes which pairs attend, the score on a pair that attends, or
the scale, at one of the checked shapes. Everything is evaluated densely with the
reference's own evaluator, on the inputs the check runs on (one batch row of them), so
a check with a shape of more than MAX_SEARCH_ELEMENTS pairs x heads gets no warning.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import ir
from ..arguments import Problem
from .samples import sample_inputs

# The dense evaluation at a candidate length holds heads x length^2 elements a few
# times over; longer candidates are not tried (the warning then says so).
MAX_SEARCH_ELEMENTS = 1 << 25
SEARCH_UP_TO = 8192


def nearby_values(decl: ir.ParamDecl) -> list:
    """Values a little away from the param's own: where none changes the result, the
    check cannot tell the param's value from its neighbours'."""
    if decl.type == ir.BOOL:
        return [not decl.value]
    if decl.type == ir.INT:
        return [decl.value - 1, decl.value + 1]
    step = abs(decl.value) / 16 or 1 / 16
    return [decl.value - step, decl.value + step]


def with_param(variant: ir.Variant, name: str, value) -> ir.Variant:
    params = tuple(dataclasses.replace(d, value=value) if d.name == name else d
                   for d in variant.params)
    return dataclasses.replace(variant, params=params)


def behaviour(variant: ir.Variant, p: Problem, inputs: dict) -> tuple:
    """(allowed pairs, score on them (0 elsewhere), scale) over the whole problem. The
    raw scores `s` are one fixed random draw, so two variants' behaviours compare."""
    from ..semantics.evaluate import evaluate
    from ..semantics.reference import allowed_pairs, index_env, scale_value
    full = (p.batch, p.heads_q, p.len_q, p.len_k)
    allowed = allowed_pairs(variant, p, inputs, "cpu").expand(full)
    score = None
    # Under `normalize sum` or `none`, what a pair adds: the weight of the score.
    per_pair = variant.score if variant.normalize == ir.SOFTMAX else variant.weighted
    if per_pair is not None:
        env = index_env(variant, p, inputs, "cpu", torch.float64)
        env["s"] = torch.randn(full, generator=torch.Generator().manual_seed(0),
                               dtype=torch.float64)
        value = torch.as_tensor(evaluate(per_pair, env), dtype=torch.float64).expand(full)
        score = torch.where(allowed, value, torch.zeros((), dtype=torch.float64))
    return allowed, score, scale_value(variant, p.dim, p.dim_v)


def _same(a: tuple, b: tuple) -> bool:
    """Equal behaviours; a NaN score equals only a NaN (never skipped as "no difference")."""
    (allowed_a, score_a, scale_a), (allowed_b, score_b, scale_b) = a, b
    if not torch.equal(allowed_a, allowed_b):
        return False
    if score_a is not None:
        both_nan = torch.isnan(score_a) & torch.isnan(score_b)
        if not bool(((score_a == score_b) | both_nan).all()):
            return False
    return scale_a == scale_b or (scale_a != scale_a and scale_b != scale_b)


def _matters(variant: ir.Variant, name: str, p: Problem, inputs: dict) -> bool:
    own = behaviour(variant, p, inputs)
    return any(not _same(own, behaviour(with_param(variant, name, value), p, inputs))
               for value in nearby_values(variant.param(name)))


def _search_lengths(decl: ir.ParamDecl, longest: int) -> list:
    """Square lengths past the checked ones to look for one where the param matters:
    the int's own neighbourhood (a window of 1024 shows at 1025), then powers of two."""
    lengths = {1 << n for n in range(4, SEARCH_UP_TO.bit_length())}
    if decl.type == ir.INT:
        lengths |= {abs(decl.value) + d for d in (0, 1, 2)}
    return sorted(n for n in lengths if longest < n <= SEARCH_UP_TO)


def unexercised_params(variant: ir.Variant, checked: list) -> list:
    """One warning per param that no checked problem exercises, naming it and a square
    length at which it would matter (or the longest length tried). `checked`: (Problem,
    inputs) pairs, the shapes checked and the inputs each runs on."""
    warnings = []
    problems = [p for p, _ in checked]
    # One batch row is enough to compare (inputs are read by index, a row of theirs as
    # good as another); a shape too large to evaluate densely counts as exercising.
    checked = [(dataclasses.replace(p, batch=1), inputs) for p, inputs in checked]
    if any(p.heads_q * p.len_q * p.len_k > MAX_SEARCH_ELEMENTS for p, _ in checked):
        return []
    for decl in variant.params:
        if any(_matters(variant, decl.name, p, inputs) for p, inputs in checked):
            continue
        longest = max(max(p.len_q, p.len_k) for p in problems)
        heads = (problems[0].heads_q, problems[0].heads_kv)
        dim = problems[0].dim
        shown_at, tried = None, longest
        for n in _search_lengths(decl, longest):
            if heads[0] * n * n > MAX_SEARCH_ELEMENTS:
                break
            tried = n
            p = Problem(1, heads[0], heads[1], n, n, dim, dim)
            if _matters(variant, decl.name, p, sample_inputs(variant, p)):
                shown_at = n
                break
        shapes = ", ".join(sorted({f"{p.len_q}x{p.len_k}" for p in problems}))
        others = " or ".join(f"{v!r}" for v in nearby_values(decl))
        text = (f"param '{decl.name}' = {decl.value!r} never matters at the lengths checked "
                f"(len_q x len_k {shapes}): the mask, score and scale are the same with "
                f"{decl.name} = {others}, so an error in how the kernel applies it cannot show; ")
        if shown_at is not None:
            text += f"it matters at length {shown_at} (check with --len {shown_at})"
        elif isinstance(decl.value, int) and not isinstance(decl.value, bool) \
                and abs(decl.value) >= tried:
            # chunked_local's chunk of 8192: it matters from length 8193, past the search.
            text += (f"its value is past the longest length this search evaluates ({tried}), "
                     f"so it likely matters only beyond it (check with --len "
                     f"{abs(decl.value) + 1} where that fits)")
        else:
            text += f"it matters at no length up to {tried} either (is it used?)"
        warnings.append(text)
    return warnings
