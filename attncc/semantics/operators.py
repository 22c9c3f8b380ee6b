"""What the language's arithmetic means, in one place: Python's.

    /    true division, always in floating point (2 / 4 is 0.5)
    //   floor division (-7 // 2 is -4; Triton's and C's integer // truncate: -3)
    %    remainder with the sign of the divisor (-7 % 2 is 1; Triton's and C's: -1)

The evaluators of the IR on tensors or numbers (semantics/evaluate.py for the reference,
tools/flex.py for FlexAttention) compute through `apply`. The emitters print calls of
the helpers named in HELPERS, which the generated module defines with this meaning
(codegen/templates/expressions.py.jinja for the kernels, the host section of
backends/portable/templates/attention.py.jinja for the tile tables). analysis/ranges.py bounds them, and
refuses a `//` or `%` whose divisor can be 0.
"""
from __future__ import annotations

import torch

# op -> (kernel helper, host helper) for the operators Triton and torch spell otherwise.
HELPERS = {"//": ("_fdiv", "_h_fdiv"), "%": ("_mod", "_h_mod")}


def apply(op: str, a, b, float_dtype=torch.float32):
    """a `op` b for tensors or Python numbers, with the language's meaning."""
    tensors = isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if tensors:
            return torch.as_tensor(a).to(float_dtype) / torch.as_tensor(b).to(float_dtype)
        return float(a) / float(b)
    if op == "//":
        return torch.div(a, b, rounding_mode="floor") if tensors else a // b
    if op == "%":
        return torch.remainder(torch.as_tensor(a), b) if tensors else a % b
    raise ValueError(f"unknown arithmetic operator {op!r}")
