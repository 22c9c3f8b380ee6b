"""Functions torch.compile must run eagerly (they read tensor values or data pointers),
marked without importing torch._dynamo when attncc is imported."""
from __future__ import annotations

import functools

import torch


def run_eagerly(fn):
    """`torch.compiler.disable(fn)`, applied at the first call. The decorator imports
    torch._dynamo, and with it sympy and triton: seconds that `import attncc` and a warm
    start must not pay, and a triton imported before `attncc check` sets
    TRITON_INTERPRET keeps compiled JIT functions (tl.cdiv) that the interpreter cannot
    call."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return call
