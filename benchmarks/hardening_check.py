"""Issue 17 on the GPU: the kernel tests the hardening touched, the cases only a GPU can
hold, and the speed of the dense kernels beside the last recorded numbers. One call:

    python benchmarks/hardening_check.py [--part tests|limits|speed|all]   # ~6 min, all

1. pytest, compiled, ATTNCC_TUNE=0, 8 workers, at most 240 s: test_regressions.py
   (issue 17's cases), test_sparse.py, test_decode.py and the examples of
   test_kernels.py in fp32. Every launch changed (one grid axis, 64-bit loop bounds,
   namespaced inputs, WIDE), so these cover it.
2. Past CUDA's and int32's limits, each against the float64 reference: batch x heads
   = 70,400 (grid axis 1 allowed 65,535), with the portable and the Gluon forward; a
   bool[q, k] mask of 46,448**2 elements read near its end (32-bit offsets wrapped);
   a learnable f32[h, q, k] bias of 2.15e9 elements, its gradient written by atomics
   near its end.
3. Speed, tuned as usual: full and causal attention, forward and backward, bf16, 16K
   tokens, head dim 128, 16 heads, beside benchmarks/RESULTS.md (runs 41-42 on an
   H100, 79 on an H200); and what building tile tables on every call costs a document
   mask at 16K (kept tables are the comparison: they are built once).

Writes everything to $OUT/hardening.json and prints a short table last.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import attncc  # noqa: E402
from attncc.semantics.reference import scale_value
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

OUT = os.environ.get("OUT", "out")
RESULTS: dict = {}
# benchmarks/RESULTS.md, S = 16384, D = 128, 16 heads, bf16, tuned, ms: the portable
# forward and backward on an H100 (runs 41-42); on an H200 the portable forward and the
# Gluon ping-pong forward (run 79; no backward was timed there).
RECORDED = {"H100": {"full": dict(fwd=4.321, bwd=12.433), "causal": dict(fwd=2.187, bwd=6.565)},
            "H200": {"full": dict(fwd=4.402, gluon_fwd=3.782), "causal": dict(fwd=2.228, gluon_fwd=1.885)}}


def run_tests(limit_s: int = 240):
    env = dict(os.environ, ATTNCC_TUNE="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider",
           "tests/test_regressions.py", "tests/test_sparse.py", "tests/test_decode.py",
           "tests/test_kernels.py::test_example_matches_reference_fp32"]
    start = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        tail = (r.stdout + r.stderr)[-3000:]
        summary = tail.strip().splitlines()[-1] if tail.strip() else "(no output)"
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))[-3000:]
        summary = f"did not finish in {limit_s} s"
    RESULTS["tests"] = dict(command=" ".join(cmd[2:]), summary=summary, tail=tail,
                            seconds=time.perf_counter() - start)
    print(tail[-1500:], flush=True)


def against_reference(name, variant, q, k, v, inputs=None, learn=(), backend="auto", **call):
    """Max error of out and of every gradient against the float64 reference, held to
    attncc.tolerance's rule (the same computation done eagerly in q's dtype)."""
    inputs = inputs or {}
    do = torch.randn(q.shape[:3] + v.shape[-1:], device=q.device, dtype=q.dtype)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ins = {n: (t.detach().to(dtype if dtype == torch.float64 else t.dtype).requires_grad_()
                   if n in learn else t) for n, t in inputs.items()}
        out = fn(*leaves, **ins, **call)
        return [out, *torch.autograd.grad(out, leaves + [ins[n] for n in learn], do.to(dtype))]

    got = run(attncc.compile(variant, backend=backend), q.dtype)
    ref = run(lambda *a, **kw: attncc.reference(variant, *a, **kw), torch.float64)
    eager = run(lambda *a, **kw: attncc.reference(variant, *a, **kw), q.dtype)
    scales = gradient_scales(q.double(), k.double(), ref[0], do.double(),
                             scale_value(variant, q.shape[-1]), q.shape[1] // k.shape[1])
    errors, ok = {}, True
    for label, g, r, e in zip(["out", "dq", "dk", "dv", *(f"d{n}" for n in learn)], got, ref, eager):
        err, eager_err = max_abs_error(g, r), max_abs_error(e, r)
        errors[label] = err
        ok &= within_tolerance(err, eager_err, q.dtype, r, scales.get(label, 1.0))
    errors["ok"] = bool(ok)
    RESULTS.setdefault("limits", {})[name] = errors
    return errors


def limits():
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    randn = lambda *shape, dtype=torch.float16: torch.randn(*shape, device=dev, generator=gen, dtype=dtype)
    checks = []

    # Batch x heads past 65,535 (grid axis 1's limit): 1,100 x 64 = 70,400.
    causal = attncc.parse("attention causal { mask q >= k }")
    q, k, v = randn(1100, 64, 20, 16), randn(1100, 64, 20, 16), randn(1100, 64, 20, 16)
    checks.append(("70,400 batch-heads, causal", against_reference("grid_axis", causal, q, k, v)))
    doc = attncc.parse("attention doc { input doc: i32[q] mask doc[q] == doc[k] and q >= k }")
    ids = torch.tensor([0] * 9 + [1] * 11, dtype=torch.int32, device=dev)
    checks.append(("70,400 batch-heads, tile tables",
                   against_reference("grid_axis_tables", doc, q, k, v, {"doc": ids})))
    del q, k, v
    torch.cuda.empty_cache()
    # The same with the Gluon forward (sm_90; elsewhere it refuses, and that is recorded).
    q, k, v = (randn(1100, 64, 64, 64, dtype=torch.bfloat16) for _ in range(3))
    try:
        checks.append(("70,400 batch-heads, Gluon forward",
                       against_reference("grid_axis_gluon", causal, q, k, v, backend="gluon")))
    except attncc.AttnccError as e:
        RESULTS.setdefault("limits", {})["grid_axis_gluon"] = {"refused": str(e)[:300]}
    del q, k, v
    torch.cuda.empty_cache()

    # A bool[q, k] mask past 2**31 elements, read at its far corner.
    n, L = 46448, 64
    keep = torch.zeros(n, n, dtype=torch.bool, device=dev)
    keep[n - L:, n - L:] = torch.rand(L, L, device=dev, generator=gen) < 0.5
    big_mask = attncc.parse("attention big_mask { input keep: bool[q, k] mask keep[q, k] }")
    q, k, v = randn(1, 2, L, 64), randn(1, 2, L, 64), randn(1, 2, L, 64)
    checks.append((f"bool[q, k] mask of {n * n:.3g} elements", against_reference(
        "mask_2_31", big_mask, q, k, v, {"keep": keep}, q_offset=n - L, k_offset=n - L)))
    del keep
    torch.cuda.empty_cache()

    # A learnable f32[h, q, k] bias past 2**31 elements; the same call on a small copy
    # of the corner it reads must give the same output and bias gradient there.
    H, n = 16, 11600
    bias_spec = attncc.parse("attention big_bias { learnable input bias: f32[h, q, k] "
                             "score s + bias[h, q, k] }")
    kernel = attncc.compile(bias_spec)
    bias = torch.zeros(H, n, n, device=dev)
    corner = randn(H, L, L, dtype=torch.float32)
    bias[:, n - L:, n - L:] = corner
    q, k, v = randn(1, H, L, 64), randn(1, H, L, 64), randn(1, H, L, 64)
    do = randn(1, H, L, 64)
    big = bias.requires_grad_()
    out_big = kernel(q, k, v, bias=big, q_offset=n - L, k_offset=n - L)
    (g_big,) = torch.autograd.grad(out_big, big, do)
    small = corner.clone().requires_grad_()
    out_small = kernel(q, k, v, bias=small)
    (g_small,) = torch.autograd.grad(out_small, small, do)
    far = (g_big[:, n - L:, n - L:] - g_small).abs().max().item()
    elsewhere = g_big[:, : n - L].abs().max().item()
    errors = {"out_vs_small": (out_big - out_small).abs().max().item(), "dbias_vs_small": far,
              "dbias_outside_the_corner": elsewhere}
    errors.update({f"small_{n_}": e for n_, e in against_reference(
        "bias_small", bias_spec, q, k, v, {"bias": corner}, learn=("bias",)).items()})
    RESULTS.setdefault("limits", {})["bias_2_31"] = errors
    checks.append((f"f32[h, q, k] learnable bias of {H * n * n:.3g} elements", errors))
    del bias, big, g_big
    torch.cuda.empty_cache()
    return checks


def timed(fn, rep=100):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def speed():
    dev, L, H, D = "cuda", 16384, 16, 128
    rows = {}
    for name, spec in (("full", "attention full { }"), ("causal", "attention causal { mask q >= k }")):
        kernel = attncc.compile(spec, backend="triton")  # the portable kernels, both ways
        q, k, v = (torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        torch.autograd.grad(kernel(q, k, v), (q, k, v), do)  # compile and tune
        fwd = timed(lambda: kernel(q, k, v))
        both = timed(lambda: torch.autograd.grad(kernel(q, k, v), (q, k, v), do))
        rows[name] = dict(fwd_ms=fwd, bwd_ms=both - fwd)
        try:  # the forward attncc runs by default (the Gluon one on sm_90)
            auto = attncc.compile(spec)
            auto(q, k, v)
            rows[name].update(auto_fwd_ms=timed(lambda: auto(q, k, v)),
                              auto_backend=getattr(auto, "backend", "triton"))
        except Exception as e:
            rows[name]["auto_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del q, k, v, do
    # Tile tables on every call (no implicit cache) against kept ones, document mask.
    spec = "attention document { input doc: i32[q] mask doc[q] == doc[k] and q >= k }"
    kernel = attncc.compile(spec)
    q, k, v = (torch.randn(1, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    doc = (torch.arange(L, device=dev) // (L // 8)).to(torch.int32)
    do = torch.randn_like(q)
    kept = kernel.tile_tables(q, k, v, doc=doc)
    torch.autograd.grad(kernel(q, k, v, doc=doc), (q, k, v), do)
    torch.autograd.grad(kernel(q, k, v, doc=doc, tables=kept), (q, k, v), do)
    per_call = dict(
        fwd_ms=timed(lambda: kernel(q, k, v, doc=doc)),
        fwd_kept_ms=timed(lambda: kernel(q, k, v, doc=doc, tables=kept)),
        fwd_bwd_ms=timed(lambda: torch.autograd.grad(kernel(q, k, v, doc=doc), (q, k, v), do)),
        fwd_bwd_kept_ms=timed(lambda: torch.autograd.grad(kernel(q, k, v, doc=doc, tables=kept),
                                                          (q, k, v), do)))
    # The host's share: one table build, synchronised, at the forward's tiles.
    module, (bm, bn) = kernel.module, next(iter(kept.store))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        module.tile_tables(1, H, L, L, 0, 0, D, {"doc": doc}, bm, bn, q.device)
    torch.cuda.synchronize()
    per_call["table_build_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    rows["document_tables"] = per_call
    RESULTS["speed"] = rows
    return rows


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["tests", "limits", "speed", "all"], default="all")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    if args.part in ("tests", "all"):
        run_tests()
    checks, rows = [], {}
    parts = {"tests": (), "limits": (limits,), "speed": (speed,), "all": (limits, speed)}
    for part in parts[args.part]:
        try:
            result = part()
            checks, rows = (result, rows) if part is limits else (checks, result)
        except Exception:
            RESULTS[f"{part.__name__}_error"] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
    with open(os.path.join(OUT, "hardening.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    if "tests" in RESULTS:
        print("\n== tests (ATTNCC_TUNE=0):", RESULTS["tests"]["summary"],
              f"in {RESULTS['tests']['seconds']:.0f} s")
    print("== past the limits: max abs error against float64 (or the small copy)")
    for label, errors in checks:
        print(f"  {label:44s} " + "  ".join(f"{k} {v:.2e}" if not isinstance(v, bool) else
                                            f"{k} {v}" for k, v in errors.items()))
    if rows:
        gpu = torch.cuda.get_device_name()
        recorded = next((r for kind, r in RECORDED.items() if kind in gpu), {})
        print(f"== speed on {gpu}, S = 16384, D = 128, 16 heads, bf16, ms (RESULTS.md beside, "
              "same GPU kind only: runs 41-42 on an H100, 79 on an H200)")
        was = lambda name, key: (f" (was {recorded[name][key]:.3f})"
                                 if key in recorded.get(name, {}) else "")
        for name in ("full", "causal"):
            r = rows[name]
            auto = (f"   default fwd ({r['auto_backend']}) {r['auto_fwd_ms']:7.3f}{was(name, 'gluon_fwd')}"
                    if "auto_fwd_ms" in r else "")
            print(f"  {name:8s} portable fwd {r['fwd_ms']:7.3f}{was(name, 'fwd')}   "
                  f"bwd {r['bwd_ms']:7.3f}{was(name, 'bwd')}{auto}")
        d = rows["document_tables"]
        print(f"  document, tables per call vs kept: fwd {d['fwd_ms']:.3f} vs {d['fwd_kept_ms']:.3f}, "
              f"fwd+bwd {d['fwd_bwd_ms']:.3f} vs {d['fwd_bwd_kept_ms']:.3f}; one build "
              f"{d['table_build_ms']:.3f} ms (host and device, synchronised)")


if __name__ == "__main__":
    main()
