"""Settings of the runtime read from the environment once, at import, and the limits of
what the kernels take. Each setting is refused at import when its value is unknown.
"""
from __future__ import annotations

import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# v's head dim is independent of q's and k's; up to 512 (MLA's latent values, and FA3's
# (64, 512) shape), the output accumulator then the widest tile a program keeps.
MAX_HEAD_DIM_V = 512
# Decoding takes q·k head dims to 576: MLA's latent keys (512 + 64 rotary columns), as
# two segments (the generated module's _head_dim_split) whose first holds the values.
MAX_HEAD_DIM_DECODE = 576


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (TRITON_INTERPRET=1: on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_interpretable_dtype(q) -> None:
    """Refuse bfloat16 under the interpreter, whose tl.dot computes it wrongly: every
    kernel entry point (calls and decoding) asks, so none returns garbage."""
    if q.dtype == torch.bfloat16 and interpreting():
        from ..errors import CallError
        raise CallError("bfloat16 cannot run under the Triton interpreter: it computes tl.dot "
                        "on bfloat16 wrongly, so the results would be garbage; use float16 "
                        "or float32 on the CPU, or run on a GPU")


def check_kernel_device(q) -> None:
    """Refuse a call whose tensors are where no kernel can run: the meta device (no
    values), or anything but a CUDA GPU outside the interpreter. Reads q's device only:
    under torch.compile and FakeTensorMode it is the device the tensors stand for."""
    from ..errors import CallError
    if q.device.type == "meta":
        raise CallError("q is on the meta device, which holds no values for a kernel to read; "
                        "for the output's shape and dtype alone, call under "
                        "torch._subclasses.fake_tensor.FakeTensorMode or torch.compile")
    if q.device.type == "cuda":
        return
    # Triton itself reads the environment to decide whether CPU tensors can run.
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise CallError(f"q is on {q.device}, but attncc kernels run on CUDA GPUs; move the "
                        "tensors with .cuda(), or set TRITON_INTERPRET=1 before triton is "
                        "imported (TRITON_INTERPRET=1 python ..., or os.environ at the top of "
                        "the script) to run the kernels (slowly) under the Triton interpreter "
                        "on the CPU")
    # Triton reads it once, as it imports: its own functions are then interpreted or not.
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(standard.sigmoid, InterpretedFunction):
        raise CallError("TRITON_INTERPRET=1 was set after triton was imported (by attncc, "
                        "or by a library such as transformers), so the kernels would not run "
                        "interpreted; set it before the first import, in a new process "
                        "(TRITON_INTERPRET=1 python ..., or os.environ at the top of the "
                        "script)")


# A bad ATTNCC_* value found while attncc is imported is kept here, and raised by
# check_settings: by attncc.compile (before any kernel exists) and by the command line
# inside its error handling, so that `attncc check` says `error: ...` with exit 2 (a
# raise at import came before the command line could catch it: a traceback, exit 1).
_REFUSED_SETTINGS: list = []


def refuse_setting(message: str) -> None:
    _REFUSED_SETTINGS.append(message)


def check_settings() -> None:
    """Raise SettingError for the first bad ATTNCC_* value seen at import."""
    if _REFUSED_SETTINGS:
        from ..errors import SettingError
        raise SettingError(_REFUSED_SETTINGS[0])


# Tile tables of calls without kept tables: "1" (default) reuses those of the kernel's 32
# latest calls whose tensors are the same ones, unwritten since (autograd's version
# counter: a write that bypasses it, through a custom kernel or `.data`, must call
# torch.autograd.graph.increment_version); "0" builds them on every call, for code that
# cannot. Building costs ~100 small launches: a document mask's forward at 16K tokens ran
# 3.9x slower with tables built per call (benchmarks/RESULTS.md run 82).
TABLE_CACHE = os.environ.get("ATTNCC_TABLE_CACHE", "1")
if TABLE_CACHE not in ("0", "1"):
    refuse_setting(f"ATTNCC_TABLE_CACHE={TABLE_CACHE!r}: expected 1 (reuse the tables of "
                   "recent calls, the default) or 0 (build them on every call)")
    TABLE_CACHE = "1"

# How the backward of a table-driven variant runs: "auto" (the default: dQ, then dK/dV,
# where a backend other than the portable one takes both of the call's roles, the Gluon
# kernels on Hopper; else dK/dV and dQ programs in one portable grid), "one-launch"
# (always that portable grid) or "sequential" (dQ, then dK/dV, whichever backends take
# them). Among the portable kernels the one launch beat both the sequential kernels and
# the two on two streams on every problem measured (RESULTS.md run 51: at tile density
# 0.03 1.26x faster than with streams, BigBird's 1.04x). On an H200 the Gluon dQ and
# dK/dV beat it once the tables ordered programs longest first: run 201 measured the
# backward 1.03-1.18x the one launch's on BigBird, document and random layouts of
# density 0.03-0.5, each checked against float64, and the whole step's kernels (a CUDA
# graph) 1.05-1.35x at 4K and 16K tokens (run 203). Run 200's illegal memory access at
# density 0.5 did not recur after tile_at's fix. A Gluon launch costs more host time (TMA
# descriptors built and encoded per launch), so where an eager step is host-bound (its
# kernels about a millisecond or less, timed alone) auto's step ran 0.69-0.87x as fast:
# "one-launch" is the setting for that.
BACKWARD_SCHEDULES = ("auto", "one-launch", "sequential")
TABLES_BACKWARD = os.environ.get("ATTNCC_BACKWARD", "auto")
if TABLES_BACKWARD not in BACKWARD_SCHEDULES:
    refuse_setting(f"ATTNCC_BACKWARD={TABLES_BACKWARD!r}: expected one of {BACKWARD_SCHEDULES}")
    TABLES_BACKWARD = "auto"


def backward_directions(uses_tables: bool, split_preferred: bool = False) -> tuple:
    """The tuning directions the backward of a module runs, decided here alone: "bwd" (dK/dV
    and dQ in one launch) for table-driven modules under the one-launch schedule, and
    under "auto" unless `split_preferred` (a backend other than the portable one takes
    this call's dQ and dK/dV: Kernel.split_preferred), else "dq" then "dkdv"."""
    one_launch = TABLES_BACKWARD == "one-launch" or (TABLES_BACKWARD == "auto"
                                                     and not split_preferred)
    if uses_tables and one_launch:
        return ("bwd",)
    return ("dq", "dkdv")
