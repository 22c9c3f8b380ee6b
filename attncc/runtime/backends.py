"""Which backend runs a call's forward, dQ and dK/dV: "triton" (the portable kernels,
everywhere) or "gluon" (the Hopper kernels of backends/gluon/codegen.py), and why, in a sentence
the Kernel reports (`kernel.backend_reason`, `kernel.last_backend`, `kernel.last_backward`)
or raises for an explicit backend="gluon" it cannot honour.
"""
from __future__ import annotations

import functools

from ..backends.gluon.codegen import DTYPES, HEAD_DIMS
from ..errors import BackendError
from .settings import interpreting

BACKENDS = ("auto", "triton", "gluon")
# wgmma, TMA and the mbarrier ring are Hopper's; Blackwell wants tcgen05 and TMEM.
CAPABILITY = (9, 0)


def check_backend(backend) -> str:
    """`backend` of attncc.compile, checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, "
                         f"got {backend!r}")
    return backend


def environment_unsupported() -> str | None:
    """Why Gluon kernels cannot run in this process (no sm_90 GPU, the interpreter, a
    Triton without Gluon's Hopper module), or None when they can."""
    if interpreting():
        return "the Triton interpreter (TRITON_INTERPRET=1) runs only the portable kernels"
    return _device_unsupported()


@functools.lru_cache(maxsize=1)
def _device_unsupported() -> str | None:
    import torch
    if not torch.cuda.is_available():
        return "there is no CUDA GPU; the Gluon kernels need a Hopper GPU (sm_90)"
    capability = torch.cuda.get_device_capability()
    if capability != CAPABILITY:
        return (f"the GPU ({torch.cuda.get_device_name()}) is sm_{capability[0]}{capability[1]}; "
                "the Gluon kernels are written for Hopper (sm_90)")
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError as e:
        return f"this Triton has no Gluon Hopper module ({e})"
    return None


def call_unsupported(q, k, v) -> str | None:
    """Why the Gluon forward cannot take this call (the Kernel's own checks have passed),
    or None when it can."""
    dtype = str(q.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        return f"q, k, v are {dtype}; the Gluon forward takes float16 and bfloat16"
    dim = q.shape[-1]
    if dim not in HEAD_DIMS:
        return (f"head dim {dim}; the Gluon forward takes head dims "
                f"{', '.join(map(str, HEAD_DIMS))}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # TMA copies: the last dim contiguous, every other stride and the base 16-byte aligned.
        if t.stride(3) != 1:
            return (f"{name} has strides {tuple(t.stride())}: the Gluon forward's bulk copies need "
                    f"the head dim contiguous (call {name}.contiguous())")
        size = t.element_size()
        if any((s * size) % 16 for s in t.stride()[:3]) or t.data_ptr() % 16:
            return (f"{name} has strides {tuple(t.stride())}: the Gluon forward's bulk copies need "
                    "16-byte aligned rows (call .contiguous())")
    return None


def refuse(reason: str):
    """backend="gluon" asked for what the backend cannot do: say what, and the way out."""
    raise BackendError(f"backend='gluon' cannot run this: {reason}; use backend='auto' (which "
                    "runs the portable kernels where Gluon cannot) or backend='triton'")
