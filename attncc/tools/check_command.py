"""`attncc check`: the compiled kernels against `attncc.reference` on random inputs, on the
GPU or else under the Triton interpreter, held to FlexAttention's error rule
(tools/tolerance.py); where a score is NaN or infinite on allowed pairs, the cause.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch

from .. import ir, load
from ..errors import AttnccError
from ..arguments import Problem
from .samples import default_heads, sample_inputs
from .tolerance import (gradient_scales, input_gradient_scales, max_abs_error, slack,
                        within_tolerance)

CHECK_DROPOUT_SEED = 1234         # one seed for the kernel and both references


def _ensure_interpreter_if_cpu():
    """Without a GPU, run the kernels under the Triton interpreter.

    Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function (3.x: through
    triton.knobs, at each decoration), so it is enough to set it before the generated
    module is imported, even if triton itself is imported already. A generated module
    imported earlier in this process without it keeps compiled JIT functions: then we
    stop and say so (see _check_interpreted)."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def _check_interpreted(kernel):
    fn = getattr(kernel.module, "attn_fwd", None)
    if fn is not None and type(fn).__name__ != "InterpretedFunction":
        raise AttnccError("the kernel module was imported in this process before TRITON_INTERPRET=1 "
                          "was set, so it cannot run on the CPU; run `TRITON_INTERPRET=1 attncc "
                          "check ...` in a fresh process")


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


def _run_attention(fn, variant, q, k, v, inputs, dout):
    """(results {name: tensor}) of fn = kernel or reference: out, lse, dq, dk, dv, d<input>."""
    learn = [d.name for d in variant.learnable_inputs]
    kwargs = {"dropout_seed": CHECK_DROPOUT_SEED} if variant.dropout else {}
    out, lse = fn(q, k, v, return_lse=True, layout="bhsd", **kwargs, **inputs)
    wrt = [q, k, v] + [inputs[n] for n in learn]
    grads = torch.autograd.grad(out, wrt, dout, allow_unused=True)
    res = {"out": out, "lse": lse}
    for name, g, x in zip(["dq", "dk", "dv"] + [f"d{n}" for n in learn], grads, wrt):
        res[name] = g if g is not None else torch.zeros_like(x)
    return res


def _leaf(t: torch.Tensor, dtype=None, grad=False) -> torch.Tensor:
    t = t.detach().clone() if dtype is None else t.detach().to(dtype)
    return t.requires_grad_(grad)


def check_shape(variant, kernel, *, batch, heads, len_q, len_k, dim, dtype, device, seed) -> list:
    """One comparison: rows (tensor, err_kernel, err_eager, ok) for every result tensor."""
    from ..semantics.reference import reference, scale_value
    hq, hkv = heads
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    q, k, v = randn(batch, hq, len_q, dim), randn(batch, hkv, len_k, dim), randn(batch, hkv, len_k, dim)
    dout = randn(batch, hq, len_q, dim)
    p = Problem(batch, hq, hkv, len_q, len_k, dim, dim)
    inputs = sample_inputs(variant, p, seed=seed, device=device)
    learnable = {d.name for d in variant.learnable_inputs}

    def case(qkv_dtype, input_cast):
        ins = {n: _leaf(t, input_cast if t.is_floating_point() else None, n in learnable)
               for n, t in inputs.items()}
        return [_leaf(x, qkv_dtype, True) for x in (q, k, v)], ins

    (kq, kk, kv), kin = case(dtype, None)
    with poisoned_allocations():
        got = _run_attention(kernel, variant, kq, kk, kv, kin, dout)
    ref_fn = lambda *a, **kw: reference(variant, *a, **kw)
    (rq, rk, rv), rin = case(torch.float64, torch.float64)
    truth = _run_attention(ref_fn, variant, rq, rk, rv, rin, dout.double())
    (eq, ek, ev), ein = case(dtype, None)
    eager = _run_attention(ref_fn, variant, eq, ek, ev, ein, dout)
    scales = gradient_scales(rq, rk, truth["out"], dout, scale_value(variant, dim), hq // hkv)
    scales.update(input_gradient_scales(variant, rq, rk, rv, truth["out"], dout, rin))
    rows = []
    for name in truth:
        e_k = max_abs_error(got[name], truth[name])
        e_e = max_abs_error(eager[name], truth[name])
        rows.append((name, e_k, e_e, within_tolerance(e_k, e_e, dtype, truth[name],
                                                      scales.get(name, 1.0))))
    return rows


def non_finite_score(variant: ir.Variant, p: Problem, inputs: dict, *, seed: int = 0):
    """Where the score is NaN or infinite on an allowed pair, and which operation made it
    so (a division by zero, the log of a negative number...), as a sentence; None when
    the score is finite wherever pairs attend. `check` prints it beside a failure, whose
    errors are otherwise only NaN. The scaled scores `s` are drawn at random."""
    from ..semantics.evaluate import evaluate
    from ..ir import print_expr
    from ..semantics.reference import allowed_pairs, index_env
    if variant.score is None:
        return None
    full = (p.batch, p.heads_q, p.len_q, p.len_k)
    env = index_env(variant, p, inputs, "cpu", torch.float64)
    env["s"] = torch.randn(full, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    value = lambda e: evaluate(e, env).expand(full)
    bad = ~torch.isfinite(value(variant.score)) & allowed_pairs(variant, p, inputs, "cpu").expand(full)
    if not bad.any():
        return None
    at = tuple(int(i) for i in bad.nonzero()[0])
    # Follow non-finite values down the tree to the operation that made the first one.
    node = variant.score
    while True:
        if isinstance(node, ir.Where):
            taken = node.then if bool(value(node.cond)[at]) else node.other
            inner = [taken] if not torch.isfinite(value(taken)[at]) else []
        else:
            inner = [c for c in ir.children(node) if not isinstance(c, (ir.Cmp, ir.And, ir.Or, ir.Not))
                     and not torch.isfinite(value(c)[at].double())]
        if not inner:
            break
        node = inner[0]
    args = [float(value(c)[at]) for c in ir.children(node)]
    text = f"`{print_expr(node)}`"
    if isinstance(node, ir.BinOp) and node.op in ("/", "//", "%") and args[1] == 0:
        cause = f"division by zero in {text} (`{print_expr(node.rhs)}` is 0)"
    elif isinstance(node, ir.Call) and node.fn in ("log", "sqrt") and args[0] <= 0:
        cause = f"{node.fn} of {args[0]:g} in {text}"
    elif isinstance(node, ir.Load):
        cause = f"input '{node.tensor}' holds {float(value(node)[at])} where {text} reads it"
    else:
        cause = f"{text} is {float(value(node)[at])}"
    b, h, q, k = at
    return (f"the score is not finite at allowed pairs ({int(bad.sum())} of them here), first at "
            f"b={b}, h={h}, q={q + p.q_offset}, k={k + p.k_offset}: {cause}. Guard it (as in "
            "where(q == k, 0.0, ...)) or mask those pairs out")


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


def check_command(args) -> int:
    device = _ensure_interpreter_if_cpu()
    import attncc
    variant = load(args.spec)
    on_gpu = device == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if on_gpu else torch.float32)
    if not on_gpu and dtype == torch.bfloat16:
        raise AttnccError("bfloat16 cannot be checked under the Triton interpreter (it computes "
                          "tl.dot on bfloat16 wrongly); use --dtype float32 or float16, or a GPU")
    if args.heads is not None:
        heads = args.heads
        if variant.heads is not None and heads != (variant.heads.q, variant.heads.kv):
            raise AttnccError(f"--heads {heads[0]}/{heads[1]} differs from the variant's declared "
                              f"heads {variant.heads.q}/{variant.heads.kv}")
        if heads[1] < 1 or heads[0] % heads[1]:
            raise AttnccError(f"--heads {heads[0]}/{heads[1]}: the query heads must be a multiple "
                              "of the key/value heads")
    else:
        heads = default_heads(variant, 3)
    if args.dim is not None and args.dim < 1:
        raise AttnccError(f"--dim {args.dim}: the head dim must be a positive number (the "
                          "kernels take 16 to 256)")
    dim = args.dim if args.dim is not None else (64 if on_gpu else 32)
    if args.len:
        shapes = [(n, n) for n in args.len]
    elif on_gpu:
        shapes = [(37, 37), (20, 45), (256, 256), (1000, 1000), (300, 1029)]
    else:
        shapes = [(37, 37), (20, 45)]
    batch = 2
    kernel = attncc.compile(variant)
    if not on_gpu:
        _check_interpreted(kernel)
    where = "GPU" if on_gpu else "CPU, Triton interpreter"
    print(f"{variant.name}: {kernel.strategy}")
    print(f"rule: kernel err <= 2 * eager err + {slack(dtype):g} x scale (max abs error against float64 "
          f"attncc.reference; eager = attncc.reference in {str(dtype).replace('torch.', '')})")
    failed, diagnosed = 0, False
    for i, (len_q, len_k) in enumerate(shapes):
        print(f"\nbatch {batch}, heads {heads[0]}/{heads[1]}, len_q {len_q}, len_k {len_k}, dim {dim}, "
              f"{str(dtype).replace('torch.', '')} ({where})")
        rows = check_shape(variant, kernel, batch=batch, heads=heads, len_q=len_q, len_k=len_k,
                           dim=dim, dtype=dtype, device=device, seed=args.seed + i)
        print(format_table(rows))
        failed += sum(not ok for *_, ok in rows)
        if failed and not diagnosed:
            diagnosed = True
            p = Problem(batch, heads[0], heads[1], len_q, len_k, dim, dim)
            hint = non_finite_score(variant, p, sample_inputs(variant, p, seed=args.seed + i))
            if hint:
                print(f"  cause: {hint}")
    if failed:
        print(f"\nFAIL: {failed} tensor comparison{'s' if failed != 1 else ''} out of tolerance")
    else:
        print("\nOK: every tensor within tolerance")
    return 1 if failed else 0
