"""Checking a compiled kernel against attncc.reference in float64: forward and backward on
given tensors, held to the tolerance rule of semantics/tolerance.py. `kernel.check` calls
check_tensors; `attncc check` (tools/check_command.py) runs compare on random shapes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings

import torch

from .. import ir
from ..semantics.tolerance import (gradient_scales, input_gradient_scales, max_abs_error,
                                   within_tolerance)

CHECK_DROPOUT_SEED = 1234         # one seed for the kernel and both references


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty and friends fill new tensors with NaN (ints with their max) while active,
    so an output element the kernel never writes shows up as NaN instead of stale memory."""
    from torch.utils import deterministic
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = deterministic.fill_uninitialized_memory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.use_deterministic_algorithms(True, warn_only=True)
        deterministic.fill_uninitialized_memory = True
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
            deterministic.fill_uninitialized_memory = was_fill


def _run_attention(fn, variant, q, k, v, inputs, dout, offsets):
    """(results {name: tensor}) of fn = kernel or reference: out, lse, dq, dk, dv, d<input>."""
    learn = [d.name for d in variant.learnable_inputs]
    kwargs = {"dropout_seed": CHECK_DROPOUT_SEED} if variant.dropout else {}
    # `normalize none` has no LSE (return_lse is refused): only the output is checked.
    with_lse = variant.normalize != ir.UNNORMALIZED
    result = fn(q, k, v, return_lse=with_lse, layout="bhsd", **offsets, **kwargs, **inputs)
    out, lse = result if with_lse else (result, None)
    wrt = [q, k, v] + [inputs[n] for n in learn]
    grads = torch.autograd.grad(out, wrt, dout, allow_unused=True)
    res = {"out": out, **({"lse": lse} if with_lse else {})}
    for name, g, x in zip(["dq", "dk", "dv"] + [f"d{n}" for n in learn], grads, wrt):
        res[name] = g if g is not None else torch.zeros_like(x)
    return res


def _leaf(t: torch.Tensor, dtype=None, grad=False) -> torch.Tensor:
    t = t.detach().clone() if dtype is None else t.detach().to(dtype)
    return t.requires_grad_(grad)


def compare(variant, kernel, q, k, v, dout, inputs, *, progress=None, q_offset: int = 0,
            k_offset: int = 0) -> list:
    """Rows (tensor, err_kernel, err_eager, ok) of the kernel's out, lse and gradients
    against attncc.reference in float64, held to twice the error of the reference in
    q's dtype (eager) plus slack. q, k, v: (batch, heads, len, dim)."""
    offsets = dict(q_offset=q_offset, k_offset=k_offset)
    from ..semantics.reference import reference, scale_value
    dtype, dim = q.dtype, q.shape[-1]
    learnable = {d.name for d in variant.learnable_inputs}

    def case(qkv_dtype, input_cast):
        ins = {n: _leaf(t, input_cast if t.is_floating_point() else None, n in learnable)
               for n, t in inputs.items()}
        return [_leaf(x, qkv_dtype, True) for x in (q, k, v)], ins

    def timed(stage, run):
        start = time.perf_counter()
        result = run()
        if progress:
            progress(stage, time.perf_counter() - start)
        return result

    ref_fn = lambda *a, **kw: reference(variant, *a, **kw)
    def run_kernel():
        (kq, kk, kv), kin = case(dtype, None)
        with poisoned_allocations():  # its first use imports much of torch: timed with it
            return _run_attention(kernel, variant, kq, kk, kv, kin, dout, offsets)

    got = timed("kernel", run_kernel)
    (rq, rk, rv), rin = case(torch.float64, torch.float64)
    truth = timed("float64 reference", lambda: _run_attention(ref_fn, variant, rq, rk, rv, rin,
                                                              dout.double(), offsets))
    (eq, ek, ev), ein = case(dtype, None)
    eager = timed(f"{_dtype_name(dtype)} reference",
                  lambda: _run_attention(ref_fn, variant, eq, ek, ev, ein, dout, offsets))
    scales = gradient_scales(rq, rk, truth["out"], dout, scale_value(variant, dim, v.shape[-1]),
                             q.shape[1] // k.shape[1])
    scales.update(input_gradient_scales(variant, rq, rk, rv, truth["out"], dout, rin, **offsets))
    rows = []
    for name in truth:
        e_k = max_abs_error(got[name], truth[name])
        e_e = max_abs_error(eager[name], truth[name])
        rows.append((name, e_k, e_e, within_tolerance(e_k, e_e, dtype, truth[name],
                                                      scales.get(name, 1.0))))
    return rows


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass
class CheckReport:
    """What `kernel.check(q, k, v, **inputs)` found. rows: (tensor, kernel err, eager err,
    within tolerance) for out, lse and every gradient; warnings: params the check never
    exercised (semantics/unexercised.py). str() is `attncc check`'s table."""
    rows: list
    warnings: list

    @property
    def ok(self) -> bool:
        return all(ok for *_, ok in self.rows)

    @property
    def failed(self) -> list:
        """The names of the tensors out of tolerance."""
        return [name for name, *_, ok in self.rows if not ok]

    def __str__(self) -> str:
        verdict = ("OK: every tensor within tolerance" if self.ok
                   else f"FAIL: {', '.join(self.failed)} out of tolerance")
        return "\n".join([*(f"warning: {w}" for w in self.warnings), format_table(self.rows),
                          verdict])


def check_tensors(kernel, q, k, v, inputs: dict, *, dout=None, seed: int = 0, q_offset: int = 0,
                  k_offset: int = 0, layout: str | None = None) -> CheckReport:
    """kernel.check: the kernel against the float64 reference on the caller's q, k, v
    and inputs, at their offsets and in their layout as a call takes them, with dO (the
    output's shape) drawn from `seed` unless given."""
    from ..arguments import as_bhsd
    from ..errors import CallError
    from ..semantics.unexercised import unexercised_params
    p = kernel.check_call(q, k, v, inputs, q_offset, k_offset, layout)
    out_shape = (*q.shape[:-1], v.shape[-1])  # the output's: q's, with v's head dim
    if dout is None:
        gen = torch.Generator().manual_seed(seed)
        dout = torch.randn(out_shape, generator=gen, dtype=torch.float64).to(q.dtype).to(q.device)
    elif not isinstance(dout, torch.Tensor) or tuple(dout.shape) != out_shape:
        raise CallError(f"dout must be a tensor shaped like the output {out_shape} (q's shape "
                        f"with v's head dim), got "
                        f"{tuple(dout.shape) if isinstance(dout, torch.Tensor) else type(dout).__name__}")
    # The same attention read as (batch, heads, len, dim) views: what compare() takes.
    layout = layout or "bhsd"  # a call that did not say, and that check_call let through
    q, k, v, dout = (as_bhsd(t, layout) for t in (q, k, v, dout))
    rows = compare(kernel.variant, kernel, q, k, v, dout.to(q.dtype), inputs, q_offset=q_offset,
                   k_offset=k_offset)
    notes = unexercised_params(kernel.variant, [(p, {n: t.cpu() for n, t in inputs.items()})])
    for note in notes:
        warnings.warn(f"attncc check: {note}", stacklevel=3)
    return CheckReport(rows, notes)


def _fmt_err(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.2e}")


def format_table(rows: list) -> str:
    lines = [f"  {'tensor':<12} {'kernel err':>11} {'eager err':>11} {'ratio':>7}  result"]
    for name, e_k, e_e, ok in rows:
        if e_e > 0 and math.isfinite(e_k):
            ratio = f"{e_k / e_e:.2f}"
        else:
            ratio = "-"
        lines.append(f"  {name:<12} {_fmt_err(e_k):>11} {_fmt_err(e_e):>11} {ratio:>7}  "
                     f"{'OK' if ok else 'FAIL'}")
    return "\n".join(lines)
