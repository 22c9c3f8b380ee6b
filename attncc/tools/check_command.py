"""`attncc check`: the compiled kernels against `attncc.reference` on random inputs, on the
GPU or else under the Triton interpreter, held to FlexAttention's error rule
(semantics/tolerance.py); where a score is NaN or infinite on allowed pairs, the cause.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from .. import ir, load
from ..errors import AttnccError
from ..arguments import Problem
from ..runtime.checking import _dtype_name, compare, format_table
from ..semantics.samples import default_heads, describe_invented, sample_inputs
from ..semantics.tolerance import slack



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


def check_shape(variant, kernel, *, batch, heads, len_q, len_k, dim, dtype, device, seed,
                inputs=None, progress=None, dim_v=None) -> list:
    """One comparison on random q, k, v and dO (and the variant's inputs: `inputs`, else
    invented by sample_inputs): rows (tensor, err_kernel, err_eager, ok) for every result
    tensor. `progress(stage, seconds)` is told as each of the three runs ends. `dim_v`:
    v's head dim (dim's by default), the output's too."""
    hq, hkv = heads
    dim_v = dim if dim_v is None else dim_v
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    q, k, v = randn(batch, hq, len_q, dim), randn(batch, hkv, len_k, dim), randn(batch, hkv, len_k, dim_v)
    dout = randn(batch, hq, len_q, dim_v)
    if inputs is None:
        inputs = sample_inputs(variant, Problem(batch, hq, hkv, len_q, len_k, dim, dim_v), seed=seed,
                               device=device)
    else:
        inputs = {n: t.to(device) for n, t in inputs.items()}
    return compare(variant, kernel, q, k, v, dout, inputs, progress=progress)


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


def check_lengths(args, on_gpu: bool) -> list:
    """The (len_q, len_k) pairs to check: --len (square), or --len-q with --len-k paired
    in order (a single value pairs with each of the other's), else the defaults."""
    if args.len and (args.len_q or args.len_k):
        raise AttnccError("--len gives square lengths; use either it or --len-q with --len-k")
    if args.len:
        return [(n, n) for n in args.len]
    if args.len_q or args.len_k:
        if not (args.len_q and args.len_k):
            given, missing = ("--len-q", "--len-k") if args.len_q else ("--len-k", "--len-q")
            raise AttnccError(f"{given} needs {missing} too (or use --len for square lengths)")
        lq, lk = args.len_q, args.len_k
        if len(lq) != len(lk) and 1 not in (len(lq), len(lk)):
            raise AttnccError(f"--len-q gives {len(lq)} lengths and --len-k {len(lk)}; they "
                              "pair in order, so give as many of each (or one of either)")
        n = max(len(lq), len(lk))
        return [(lq[i if len(lq) > 1 else 0], lk[i if len(lk) > 1 else 0]) for i in range(n)]
    if on_gpu:
        return [(37, 37), (20, 45), (256, 256), (1000, 1000), (300, 1029)]
    return [(37, 37), (20, 45)]


def load_inputs(path: str, variant) -> dict:
    """--inputs FILE: a dict {input name: tensor} saved with torch.save. The names are
    checked here; shapes and dtypes against each checked shape (check_inputs_fit)."""
    how = "save them with torch.save({'name': tensor, ...}, FILE)"
    if not variant.inputs:
        raise AttnccError(f"--inputs {path}: the variant '{variant.name}' declares no inputs")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise AttnccError(f"--inputs {path}: no such file") from None
    except Exception as e:  # a pickle of other objects, or not a torch file at all
        raise AttnccError(f"--inputs {path}: cannot read it as a dict of tensors "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); {how}") from None
    if not isinstance(data, dict):
        raise AttnccError(f"--inputs {path} holds a {type(data).__name__}, not a dict of "
                          f"tensors; {how}")
    declared = [d.name for d in variant.inputs]
    for name, t in data.items():
        if not isinstance(name, str) or name not in declared:
            raise AttnccError(f"--inputs {path}: {name!r} is not an input of '{variant.name}', "
                              f"which declares {', '.join(declared)}")
        if not isinstance(t, torch.Tensor):
            kind = type(t).__name__
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            raise AttnccError(f"--inputs {path}: '{name}' is {article} {kind}, not a tensor")
    missing = [n for n in declared if n not in data]
    if missing:
        raise AttnccError(f"--inputs {path}: missing {', '.join(repr(n) for n in missing)}; the "
                          f"variant declares {', '.join(declared)} (give them all)")
    return data


def check_inputs_fit(variant, inputs: dict, path: str, problem) -> None:
    """The call's own checks (shapes, dtypes) of given inputs at one checked shape, before
    any kernel runs: a mismatch is found in a second, not after minutes of checking."""
    from ..arguments import bind
    from ..errors import CallError
    p = problem
    fake = lambda h, n, d: torch.empty(p.batch, h, n, d, device="meta")
    try:
        bind(variant, fake(p.heads_q, p.len_q, p.dim), fake(p.heads_kv, p.len_k, p.dim),
             fake(p.heads_kv, p.len_k, p.dim_v), {n: t.to("meta") for n, t in inputs.items()})
    except CallError as e:
        raise AttnccError(f"--inputs {path} at batch {p.batch}, heads {p.heads_q}/{p.heads_kv}, "
                          f"len_q {p.len_q}, len_k {p.len_k}: {e}. Given inputs are used at every "
                          "length checked: choose --len-q/--len-k (and --heads) to fit them") from None


def _progress(text: str, end: str = "\n") -> None:
    """Progress on stderr, so that stdout stays the report."""
    print(f"attncc check: {text}", end=end, file=sys.stderr, flush=True)


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
    from ..runtime.settings import MAX_HEAD_DIM, MAX_HEAD_DIM_V, MIN_HEAD_DIM
    if args.dim is not None and not MIN_HEAD_DIM <= args.dim <= MAX_HEAD_DIM:
        raise AttnccError(f"--dim {args.dim}: the kernels take head dims {MIN_HEAD_DIM} to "
                          f"{MAX_HEAD_DIM}")
    if not 0 <= args.seed < 2 ** 63:
        raise AttnccError(f"--seed {args.seed}: a seed is an integer from 0 to 2**63 - 1")
    dim = args.dim if args.dim is not None else (64 if on_gpu else 32)
    dim_v = getattr(args, "dim_v", None)
    if dim_v is not None and not MIN_HEAD_DIM <= dim_v <= MAX_HEAD_DIM_V:
        raise AttnccError(f"--dim-v {dim_v}: the kernels take v head dims {MIN_HEAD_DIM} to "
                          f"{MAX_HEAD_DIM_V}")
    dim_v = dim if dim_v is None else dim_v
    dims = f"dim {dim}" if dim_v == dim else f"dim {dim}, dim_v {dim_v}"
    shapes = check_lengths(args, on_gpu)
    batch = 2
    problems = [Problem(batch, heads[0], heads[1], lq, lk, dim, dim_v) for lq, lk in shapes]
    kernel = attncc.compile(variant)
    given = load_inputs(args.inputs, variant) if args.inputs else None
    if given is not None:
        for p in problems:
            check_inputs_fit(variant, given, args.inputs, p)
    # The inputs each shape runs on: the given ones, else invented per shape (its seed).
    inputs = [given if given is not None else sample_inputs(variant, p, seed=args.seed + i)
              for i, p in enumerate(problems)]
    if not on_gpu:
        _check_interpreted(kernel)
    where = "GPU" if on_gpu else "CPU, Triton interpreter"
    print(f"{variant.name}: {kernel.strategy}")
    print(f"rule: kernel err <= 2 * eager err + {slack(dtype):g} x scale (max abs error against float64 "
          f"attncc.reference; eager = attncc.reference in {_dtype_name(dtype)})")
    if given is not None:
        print(f"inputs: {', '.join(given)} from {args.inputs}")
    elif variant.inputs:
        print(f"inputs: invented (seed {args.seed}, plus the shape's index; pass your own with "
              f"--inputs FILE.pt): {'; '.join(describe_invented(variant))}")
    from ..semantics.unexercised import unexercised_params
    for warning in unexercised_params(variant, list(zip(problems, inputs))):
        print(f"warning: {warning}")
    if variant.block is not None and max(max(p.len_q, p.len_k) for p in problems) <= variant.block:
        # Every length inside one block: the layout decides one tile, never its pattern.
        print(f"warning: every length checked lies within one layout block ({variant.block}), "
              f"so the layout is checked at one tile only; pass --len {4 * variant.block} (or "
              "longer) to check its pattern")
    failed, diagnosed = 0, False
    for i, p in enumerate(problems):
        what = (f"batch {batch}, heads {heads[0]}/{heads[1]}, len_q {p.len_q}, len_k {p.len_k}, "
                f"{dims}, {_dtype_name(dtype)} ({where})")
        print(f"\n{what}", flush=True)
        _progress(f"[{i + 1}/{len(problems)}] {what}: running the kernel and the references")
        stages = []
        start = time.perf_counter()
        rows = check_shape(variant, kernel, batch=batch, heads=heads, len_q=p.len_q,
                           len_k=p.len_k, dim=dim, dim_v=dim_v, dtype=dtype, device=device,
                           seed=args.seed + i, inputs=inputs[i],
                           progress=lambda stage, s: stages.append(f"{stage} {s:.1f} s"))
        _progress(f"[{i + 1}/{len(problems)}] len_q {p.len_q}, len_k {p.len_k} done in "
                  f"{time.perf_counter() - start:.1f} s ({', '.join(stages)})")
        print(format_table(rows))
        failed += sum(not ok for *_, ok in rows)
        if failed and not diagnosed:
            diagnosed = True
            hint = non_finite_score(variant, p, inputs[i])
            if hint:
                print(f"  cause: {hint}")
    if failed:
        print(f"\nFAIL: {failed} tensor comparison{'s' if failed != 1 else ''} out of tolerance")
    else:
        print("\nOK: every tensor within tolerance")
    return 1 if failed else 0
