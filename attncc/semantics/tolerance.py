"""When a kernel result counts as correct: the rule every test, `attncc check` and the
GPU suite apply.

FlexAttention's rule: the kernel's max abs error against the float64 reference is at
most twice the error of the same computation done eagerly in the kernel's dtype
(attncc.reference on the same inputs), plus a small absolute slack for results the
eager computation happens to get exactly right (a gradient that is exactly zero, say,
where the kernel's bf16-rounded O leaves rounding noise). The slack is one unit of the
dtype's resolution at unit scale, times the result's scale when that is larger.
NaN never passes.

For dq and dk the scale also covers what FlashAttention's backward cannot avoid: it
forms dS = P * (dP - delta) with delta = rowsum(dO * O) from the stored, rounded O, so
where the exact dS is 0 (a row that attends to one key) the kernel keeps rounding
noise of the size of |dO * O|, carried into dq by k * scale and into dk by q * scale
(summed over a GQA group). `gradient_scales` gives those sizes. A learnable input's
gradient sums the same noise over every pair that reduces into one of its elements,
times d score / d input there (a learned ALiBi slope: |k - q|, up to the length, over
every row of its head): `input_gradient_scales` gives those.
"""
from __future__ import annotations

import math

import torch

ABS_SLACK = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |x - ref| in float64 over finite reference entries. NaN in x gives nan; an
    entry where the reference is infinite (LSE of an empty row) must match exactly,
    else the error is inf."""
    x = x.detach().double()
    ref = ref.detach().double().to(x.device)
    if torch.isnan(x).any():
        return math.nan
    inf = torch.isinf(ref)
    if inf.any():
        if not torch.equal(x[inf], ref[inf]) or torch.isinf(x[~inf]).any():
            return math.inf
        x, ref = x[~inf], ref[~inf]
    if x.numel() == 0:
        return 0.0
    return (x - ref).abs().max().item()


def slack(dtype: torch.dtype, ref: torch.Tensor | None = None, scale: float = 1.0) -> float:
    scale = max(1.0, scale)
    if ref is not None:
        finite = ref[torch.isfinite(ref)]
        if finite.numel():
            scale = max(scale, finite.abs().max().item())
    return ABS_SLACK[dtype] * scale


def gradient_scales(q, k, out, dout, sm_scale: float, group: int) -> dict:
    """{"dq": s, "dk": s}: the size of the rounding noise dq and dk inherit from the
    stored O (see the module docstring), per unit of the dtype's resolution."""
    out = out.detach().double()
    noise = (dout.detach().double().to(out.device) * out).norm(dim=-1)
    noise = noise[torch.isfinite(noise)]
    if noise.numel() == 0:
        return {}
    noise = noise.max().item()
    return {"dq": noise * k.detach().abs().max().item() * sm_scale,
            "dk": noise * q.detach().abs().max().item() * sm_scale * group}


def input_gradient_scales(variant, q, k, v, out, dout, inputs: dict, q_offset: int = 0,
                          k_offset: int = 0) -> dict:
    """{"d<name>": s} for each learnable input: the dS noise per row (|dO * O|, as for dq)
    times max over keys of |d score / d element| at attending pairs, summed over the rows,
    for the element where that is largest. The derivative is a central difference of the
    float64 score (the score is smooth in its float inputs)."""
    from ..arguments import bind
    from ..semantics.evaluate import evaluate
    from ..semantics.reference import allowed_pairs, index_env, scale_value
    learnable = [d.name for d in variant.learnable_inputs]
    # Under `normalize sum` or `none` the inputs reach the loss through the weight.
    per_pair = variant.score if variant.normalize == "softmax" else variant.weighted
    if not learnable or per_pair is None:
        return {}
    # Everything is read where q is: a caller may hold its float64 copies on the CPU and
    # its inputs, out and dout where the kernel ran.
    q, k, v = (t.detach().double() for t in (q, k, v))
    values = {n: (t.detach().double() if t.is_floating_point() else t.detach()).to(q.device)
              for n, t in inputs.items()}
    out, dout = out.detach().to(q.device), dout.detach().to(q.device)
    p = bind(variant, q, k, v, values, q_offset=q_offset, k_offset=k_offset,
             exact_float_inputs=False)
    noise = (dout.detach().double() * out.detach().double()).norm(dim=-1)  # [B, H, Lq]
    noise = torch.nan_to_num(noise, nan=0.0, posinf=0.0)
    allowed = allowed_pairs(variant, p, values, q.device)
    s = torch.matmul(q, k.repeat_interleave(p.group, dim=1).transpose(-1, -2)) * scale_value(
        variant, p.dim, p.dim_v)

    def score(name, x):
        env = index_env(variant, p, {**values, name: x}, q.device, torch.float64)
        return torch.as_tensor(evaluate(per_pair, {**env, "s": s}), dtype=torch.float64)

    scales = {}
    for name in learnable:
        x = values[name]
        worst = 0.0
        for i in range(x.numel()):
            step = torch.zeros_like(x).view(-1)
            step[i] = 1e-4 * max(1.0, abs(x.view(-1)[i].item()))
            h = step[i].item()
            step = step.view_as(x)
            d = (score(name, x + step) - score(name, x - step)) / (2 * h)
            d = torch.where(allowed, d.abs(), torch.zeros((), dtype=torch.float64))
            d = torch.nan_to_num(d, nan=0.0, posinf=0.0).expand(*noise.shape, -1)
            worst = max(worst, (noise * d.amax(dim=-1)).sum().item())
        scales[f"d{name}"] = worst
    return scales


def within_tolerance(err_kernel: float, err_eager: float, dtype: torch.dtype,
                     ref: torch.Tensor | None = None, scale: float = 1.0) -> bool:
    if not (math.isfinite(err_kernel) and math.isfinite(err_eager)):
        return False
    return err_kernel <= 2.0 * err_eager + slack(dtype, ref, scale)
