"""The work behind `attncc compile`, `attncc check` and `attncc bench` (cli.py parses).

compile  writes the standalone generated module and says what was decided: skipping
         strategy, tile sizes, and with --len the fraction of tiles visited.
check    runs the compiled kernels against `attncc.reference` on random inputs, on the
         GPU or else under the Triton interpreter, with FlexAttention's error rule
         (`within_tolerance`).
bench    times forward and backward against SDPA and FlexAttention (CUDA only); the IR
         is translated to a FlexAttention mask_mod / score_mod (`flex_mods`).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import ir
from ..semantics import random_blocks
from ..runtime.arguments import Problem
from ..errors import AttnccError, NoGPUError
from ..runtime.cache import write_if_changed
from .samples import sample_inputs
from .tolerance import gradient_scales, max_abs_error, slack, within_tolerance

MAX_COMPILE_ESTIMATE_LEN = 8192   # `compile --len`: dense classification up to this length
MAX_BENCH_EXACT_LEN = 16384       # `bench`: exact pair counts up to this length, sampled beyond
BENCH_SAMPLE_SIDE = 8192          # `bench`: beyond it, pairs counted on a strided grid this wide
CHECK_DROPOUT_SEED = 1234         # one seed for the kernel and both references
ASSUMED_HEAD_DIM = 128            # `compile` reports tiles for this head dim (and 256 if they differ)


# ================================================================= shared helpers
def _load(spec):
    from .. import load
    return load(spec)


def default_heads(variant: ir.Variant, fallback: int) -> tuple:
    if variant.heads is not None:
        return variant.heads.q, variant.heads.kv
    return fallback, fallback


def tile_visit_fraction(allowed: torch.Tensor, block_m: int, block_n: int) -> tuple:
    """(visited, total) tiles of a dense mask [..., Lq, Lk], averaged over the leading dims.

    A tile is visited when any of its pairs attends (the dense classification; the
    kernels' analytic bounds may visit a few more)."""
    *lead, len_q, len_k = allowed.shape
    qt, kt = math.ceil(len_q / block_m), math.ceil(len_k / block_n)
    padded = torch.nn.functional.pad(allowed.to(torch.uint8), (0, kt * block_n - len_k,
                                                               0, qt * block_m - len_q))
    tiles = padded.view(*lead, qt, block_m, kt, block_n).amax(dim=(-3, -1))  # [..., QT, KT]
    n_lead = math.prod(lead) if lead else 1
    return tiles.sum().item() / n_lead, qt * kt


def dense_allowed(variant: ir.Variant, p: Problem, inputs: dict, device="cpu") -> torch.Tensor:
    """reference.allowed_pairs, broadcast over at most the batch and head dims it uses."""
    from ..semantics.reference import allowed_pairs
    a = allowed_pairs(variant, p, inputs, device)
    return a.expand(*a.shape[:2], p.len_q, p.len_k)


def _config_text(c: dict) -> str:
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']} ({c['num_warps']} warps, "
            f"{c['num_stages']} stage{'s' if c['num_stages'] != 1 else ''})")


@contextlib.contextmanager
def _env(name: str, value):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def kernel_directions(source: str) -> tuple:
    """The directions tuning.py picks tiles for in a generated module: the forward, then
    the backward's one launch (table-driven variants) or its two kernels."""
    return ("fwd", "bwd") if "\ndef attn_bwd(" in source else ("fwd", "dkdv", "dq")


def chosen_configs(variant: ir.Variant, source: str, head_dim: int, *, interpreter: bool) -> dict:
    """{direction: config}. On a GPU: the first candidate that keep() allows (what runs
    untuned, ATTNCC_TUNE=0; autotuning may pick another), or ATTNCC_CONFIG's pin.
    Under the interpreter: what tuning.config_for picks there."""
    from ..runtime import tuning
    kernel = SimpleNamespace(variant=variant, pinned_config=None)
    problem = SimpleNamespace(dim=head_dim, group=1, len_q=1, len_k=1)
    out = {}
    for d in kernel_directions(source):
        if interpreter or os.environ.get("ATTNCC_CONFIG"):
            with _env("TRITON_INTERPRET", "1" if interpreter else None):
                out[d] = tuning.config_for(kernel, problem, torch.float16, d)
        else:
            out[d] = tuning.kept_candidates(variant, head_dim, d)[0]
    return out


def _configs_text(configs: dict) -> str:
    return ", ".join(f"{d} {_config_text(c)}" for d, c in configs.items())


# ================================================================= compile
def compile_command(args) -> int:
    from ..codegen.portable import generate
    from ..codegen import gluon
    variant = _load(args.spec)
    if args.len is not None and not 1 <= args.len <= MAX_COMPILE_ESTIMATE_LEN:
        raise AttnccError(f"--len {args.len}: the tile estimate evaluates the dense mask, so it "
                          f"takes lengths 1 to {MAX_COMPILE_ESTIMATE_LEN}; at longer ones, "
                          "kernel.density(q, k, v, ...) measures it from the tile tables")
    backend = getattr(args, "backend", "triton")
    why = gluon.variant_unsupported(variant)
    if backend == "gluon" and why is not None:  # before anything is written
        raise AttnccError(f"--backend gluon cannot compile this: {why}; use --backend auto "
                          "or triton")
    gen = generate(variant)
    out_dir = Path(args.out)
    created = not out_dir.exists()  # -o makes a missing directory, parents included
    path = out_dir / f"{variant.name}.py"
    try:
        written = write_if_changed(path, gen.source)
    except OSError as err:
        raise AttnccError(f"cannot write {path}: {err.strerror or err}") from None
    print(f"variant   {variant.name}")
    state = ("written" if written else "unchanged") + (f", created {out_dir}" if created else "")
    print(f"module    {path} ({state}; imports only torch and triton)")
    print(f"strategy  {gen.strategy}")
    if backend != "triton":
        _write_gluon(variant, Path(args.out), backend, why)
    from ..analysis.bounds import plan_loops
    from ..codegen.decode import decode_strategy
    print(f"decoding  {decode_strategy(variant, plan_loops(variant, 'k'))} (kernel.decode)")
    pinned = os.environ.get("ATTNCC_CONFIG")
    gpu = chosen_configs(variant, gen.source, ASSUMED_HEAD_DIM, interpreter=False)
    wide = chosen_configs(variant, gen.source, 256, interpreter=False)
    interp = chosen_configs(variant, gen.source, ASSUMED_HEAD_DIM, interpreter=True)
    from ..runtime import tuning
    if pinned:
        note = " (pinned by ATTNCC_CONFIG)"
    elif hasattr(tuning, "tune"):
        note = " (untuned first choice; the first call autotunes unless ATTNCC_TUNE=0)"
    else:
        note = ""
    print(f"tiles     GPU{note}: {_configs_text(gpu)}")
    if wide != gpu:
        print(f"          GPU, head dim > 128: {_configs_text(wide)}")
    print(f"          interpreter: {_configs_text(interp)}")
    if args.len is not None:
        n = args.len
        hq, hkv = default_heads(variant, 1)
        p = Problem(batch=1, heads_q=hq, heads_kv=hkv, len_q=n, len_k=n, dim=ASSUMED_HEAD_DIM,
                    dim_v=ASSUMED_HEAD_DIM)
        allowed = dense_allowed(variant, p, sample_inputs(variant, p, seed=0))
        density = allowed.float().mean().item()
        bm, bn = gpu["fwd"]["BLOCK_M"], gpu["fwd"]["BLOCK_N"]
        visited, total = tile_visit_fraction(allowed, bm, bn)
        line = (f"visited   at len {n}: {visited / total:.3f} of the {bm}x{bn} forward tiles "
                f"({visited:g} of {total}); allowed pairs {density:.3f}")
        if variant.inputs:
            line += " (sample inputs: seeded random)"
        print(line)
    return 0


def _write_gluon(variant: ir.Variant, out: Path, backend: str, why: str | None):
    """--backend gluon|auto: the Gluon forward beside the portable module (which it needs:
    tile tables, argument values, the backward). Rendering needs no GPU. `why`: why the
    Gluon backend cannot take the variant (then auto says so and writes nothing more)."""
    from ..codegen import gluon
    if why is not None:
        print(f"backend   auto: the portable kernels, since {why}")
        return
    gen = gluon.generate(variant)
    path = out / f"{variant.name}_gluon.py"
    try:
        written = write_if_changed(path, gen.source)
    except OSError as err:
        raise AttnccError(f"cannot write {path}: {err.strerror or err}") from None
    print(f"gluon     {path} ({'written' if written else 'unchanged'}; the Hopper (sm_90) forward; "
          "its backward and tile tables come from the module above)")
    if backend == "gluon":
        print("backend   gluon forward on an sm_90 GPU (refused elsewhere and under the "
              "interpreter), portable backward")
    else:
        print("backend   auto: the Gluon forward on an sm_90 GPU where the tuner times it faster "
              "than the portable one, else the portable kernels; the backward is portable")
    print(f"          Gluon tiles (head dim {ASSUMED_HEAD_DIM}): "
          + ", ".join(_config_text(c) for c in gluon.candidates(ASSUMED_HEAD_DIM)[:4]))


# ================================================================= check
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
    out, lse = fn(q, k, v, return_lse=True, **kwargs, **inputs)
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
    from ..frontend.printer import print_expr
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
    variant = _load(args.spec)
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


# ================================================================= FlexAttention translation
def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _fdiv(a, b):
    return torch.div(a, b, rounding_mode="floor") if _is_tensor(a) or _is_tensor(b) else a // b


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


_CALLS = {"abs": lambda x: x.abs() if _is_tensor(x) else abs(x), "min": _min, "max": _max,
          "exp": _unary(torch.exp, "exp"), "log": _unary(torch.log, "log"),
          "tanh": _unary(torch.tanh, "tanh"), "sqrt": _unary(torch.sqrt, "sqrt")}


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
            fn = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
                  "/": lambda x, y: _to_float(x) / _to_float(y), "//": _fdiv,
                  "%": lambda x, y: x % y}[op]
            return lambda env: fn(a(env), b(env))
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


def _uses(variant: ir.Variant, name: str) -> bool:
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


# ================================================================= bench
def attention_flops(pairs_per_head: float, batch: int, heads: int, dim: int) -> dict:
    """FLOPs over attending pairs: 4·B·H·D·pairs forward (two matmuls), 2.5× that backward."""
    fwd = 4.0 * batch * heads * dim * pairs_per_head
    return {"fwd": fwd, "bwd": 2.5 * fwd}


def pairs_per_head(variant: ir.Variant, p: Problem, inputs: dict, device) -> tuple:
    """(allowed (q, k) pairs per batch·head, exact?) — dense up to MAX_BENCH_EXACT_LEN,
    else estimated on an evenly strided grid of at most BENCH_SAMPLE_SIDE² positions."""
    from ..semantics.reference import index_env, layout_grid
    from ..semantics.evaluate import evaluate
    n = max(p.len_q, p.len_k)
    p1 = Problem(1, p.heads_q, p.heads_kv, p.len_q, p.len_k, p.dim, p.dim_v, p.q_offset, p.k_offset)
    ins = {name: t[:1] if variant.input(name).axes[:1] == ("b",) else t for name, t in inputs.items()}
    if n <= MAX_BENCH_EXACT_LEN:
        a = dense_allowed(variant, p1, ins, device)
        return a.float().sum().item() / (a.shape[0] * a.shape[1]), True
    stride = math.ceil(n / BENCH_SAMPLE_SIDE)
    env = index_env(variant, p1, ins, device, torch.float64)
    env["q"] = torch.arange(0, p.len_q, stride, device=device).view(1, 1, -1, 1) + p.q_offset
    env["k"] = torch.arange(0, p.len_k, stride, device=device).view(1, 1, 1, -1) + p.k_offset
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    if variant.mask is not None:
        allowed = allowed & evaluate(variant.mask, env)
    if variant.layout is not None:
        grid = layout_grid(variant, p1, ins, device)
        allowed = allowed & grid[:, :, (env["q"] // variant.block).view(-1)][
            :, :, :, (env["k"] // variant.block).view(-1)]
    shape = torch.broadcast_shapes(allowed.shape, (1, 1, env["q"].shape[2], env["k"].shape[3]))
    density = allowed.expand(shape).float().mean().item()
    return density * p.len_q * p.len_k, False


def _time(fn) -> float:
    """Median milliseconds of fn over triton's do_bench (it warms up and flushes the L2)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bench_backend(make_call, q, k, v, learn, dout):
    """(fwd ms, fwd+bwd ms) of make_call() -> out."""
    wrt = [q, k, v] + learn

    def both():
        torch.autograd.grad(make_call(), wrt, dout)
    both()  # compile, autotune and cache outside the timed region
    torch.cuda.synchronize()
    return _time(make_call), _time(both)


def bench_backends(variant, kernel, *, n: int, batch: int, heads: tuple, dim: int, seed: int = 0):
    """{backend: {"fwd_ms", "fwdbwd_ms", "bwd_ms"} or {"skipped": reason}} at one length."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hkv = heads
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h, L: torch.randn(batch, h, L, dim, generator=gen).to(dev, dtype).requires_grad_()
    q, k, v = mk(hq, n), mk(hkv, n), mk(hkv, n)
    dout = torch.randn(batch, hq, n, dim, generator=gen).to(dev, dtype)
    p = Problem(batch, hq, hkv, n, n, dim, dim)
    inputs = sample_inputs(variant, p, seed=seed, device=dev)
    learnable = {d.name for d in variant.learnable_inputs}
    for name in learnable:
        inputs[name].requires_grad_()
    learn = [inputs[name] for name in sorted(learnable)]
    results = {}

    def record(name, fn):
        try:
            fwd, both = _bench_backend(fn, q, k, v, learn, dout)
            results[name] = {"fwd_ms": fwd, "fwdbwd_ms": both, "bwd_ms": both - fwd}
        except Exception as err:  # a backend that cannot run this shape is reported, not fatal
            results[name] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}

    seed_kw = {"dropout_seed": 1} if variant.dropout else {}
    record("attncc", lambda: kernel(q, k, v, **seed_kw, **inputs))

    from ..semantics.reference import scale_value
    scale = scale_value(variant, dim)
    sdpa = sdpa_expressible(variant, n, n)
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        if sdpa is None:
            results[name] = {"skipped": "not expressible in SDPA (only no mask, or causal with len_q == len_k)"}
            continue

        def call(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=hq != hkv, **sdpa)
        record(name, call)

    if variant.dropout:
        results["flex"] = {"skipped": "FlexAttention has no attention dropout"}
    else:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            mask_mod, score_mod = flex_mods(variant, len_q=n, len_k=n, dim=dim, inputs=inputs)
            flex = torch.compile(flex_attention)
            block_mask = None
            if mask_mod is not None:  # built once, outside the timed region
                block_mask = create_block_mask(mask_mod, batch if _uses(variant, "b") else None,
                                               hq if _uses(variant, "h") else None, n, n,
                                               device=dev)
            record("flex", lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                        scale=scale, enable_gqa=hq != hkv))
        except Exception as err:
            results["flex"] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    pairs, exact = pairs_per_head(variant, p, inputs, dev)
    flops = attention_flops(pairs, batch, hq, dim)
    for r in results.values():
        if "fwd_ms" in r:
            r["fwd_tflops"] = flops["fwd"] / (r["fwd_ms"] * 1e-3) / 1e12
            r["bwd_tflops"] = flops["bwd"] / (r["bwd_ms"] * 1e-3) / 1e12 if r["bwd_ms"] > 0 else math.nan
    meta = {"len": n, "batch": batch, "heads_q": hq, "heads_kv": hkv, "dim": dim,
            "pairs_per_head": pairs, "pairs_exact": exact, "flops_fwd": flops["fwd"],
            "flops_bwd": flops["bwd"]}
    return meta, results


def format_bench(meta: dict, results: dict) -> str:
    pairs = f"{meta['pairs_per_head']:.4g} pairs/head" + ("" if meta["pairs_exact"] else " (estimated)")
    lines = [f"len {meta['len']}, batch {meta['batch']}, heads {meta['heads_q']}/{meta['heads_kv']}, "
             f"dim {meta['dim']}, bfloat16, {pairs}",
             f"  {'backend':<11} {'fwd ms':>8} {'fwd TF/s':>9} {'bwd ms':>8} {'bwd TF/s':>9} "
             f"{'attncc/other fwd':>17} {'bwd':>6}"]
    mine = results.get("attncc", {})
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"  {name:<11} skipped: {r['skipped']}")
            continue
        # Speed ratio: how many times faster attncc is (the other's time over attncc's).
        rf = f"{r['fwd_ms'] / mine['fwd_ms']:.2f}x" if "fwd_ms" in mine else "-"
        rb = f"{r['bwd_ms'] / mine['bwd_ms']:.2f}x" if "bwd_ms" in mine and mine["bwd_ms"] > 0 else "-"
        lines.append(f"  {name:<11} {r['fwd_ms']:>8.3f} {r['fwd_tflops']:>9.1f} {r['bwd_ms']:>8.3f} "
                     f"{r['bwd_tflops']:>9.1f} {rf:>17} {rb:>6}")
    return "\n".join(lines)


def plot_bench(path, variant_name: str, runs: list):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    backends = sorted({b for _, res in runs for b, r in res.items() if "fwd_ms" in r},
                      key=lambda b: (b != "attncc", b))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(backends))
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
        for i, b in enumerate(backends):
            ys = [res.get(b, {}).get(key, 0.0) for _, res in runs]
            ax.bar([x + i * width for x in range(len(runs))], ys, width, label=b)
        ax.set_xticks([x + width * (len(backends) - 1) / 2 for x in range(len(runs))])
        ax.set_xticklabels([str(m["len"]) for m, _ in runs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s (allowed pairs)")
        ax.set_title(f"{variant_name}: {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_command(args) -> int:
    variant = _load(args.spec)  # a bad spec is named first, on any machine
    if args.plot:
        from .extras import require_plotting
        require_plotting()
    if not torch.cuda.is_available():
        raise NoGPUError("attncc bench needs a CUDA GPU; none was found")
    import attncc
    if args.heads is not None:
        heads = args.heads
        if variant.heads is not None and heads != (variant.heads.q, variant.heads.kv):
            raise AttnccError(f"--heads {heads[0]}/{heads[1]} differs from the variant's declared "
                              f"heads {variant.heads.q}/{variant.heads.kv}")
    else:
        heads = default_heads(variant, 16)
    kernel = attncc.compile(variant)
    print(f"{variant.name}: {kernel.strategy}; {torch.cuda.get_device_name()}")
    runs = []
    for n in args.len:
        batch = max(1, 16384 // n)
        meta, results = bench_backends(variant, kernel, n=n, batch=batch, heads=heads, dim=args.dim)
        runs.append((meta, results))
        print(format_bench(meta, results))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"variant": variant.name, "device": torch.cuda.get_device_name(),
             "runs": [{**m, "backends": r} for m, r in runs]}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_bench(args.plot, variant.name, runs)
        print(f"wrote {args.plot}")
    return 0
