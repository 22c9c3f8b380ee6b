"""GPU check of tanh's fast form in scores: what tanh.approx costs a softcap in accuracy
against float64, and what it saves in time, fast beside exact in one process.

    python benchmarks/softcap_accuracy.py [--lens 1024,4097] [--heads 3] [--speed-len 16384]

A `tanh` in the score (or weights) of a 16-bit call runs as tanh.approx.f32 on an NVIDIA
GPU (codegen/templates/expressions.py.jinja, _tanh_fast): PTX bounds its relative error
by 2^-11, so a softcap's score `cap * tanh(s / cap)` is off by at most cap * 2^-11.
Part 1 runs the module's _tanh_fast both ways over x in [-20, 20] and reports the
absolute and relative errors by range of x; it fails past 2^-10.9 relative. Part 2 runs
causal softcap attention (cap 30 with scores up to about 4 cap, the queries scaled up;
cap 5, where tanh saturates), bf16 and fp16, both backends, lengths off the tile and 3
heads, with the fast form and with a copy of the same modules whose APPROX_TANH is off,
and reports the errors of out, dq, dk, dv against attncc.reference in float64 beside the
exact form's and the tolerance rule's verdict; it fails where the fast form misses the
rule or gives a NaN. Part 3 times the causal softcap (cap 30) forward and forward +
backward at 16K tokens, 16 heads, D=128, bf16, fast beside exact, on each backend
(do_bench medians, the same inputs, each form tuned: ATTNCC_TUNE=1 for this part).
Full results go to $OUT/softcap_accuracy.json; tables are printed last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance  # noqa: E402

OUT = os.environ.get("OUT", "out")
SPEC = "attention {name} {{ mask q >= k  score {cap} * tanh(s / {cap}) }}"
REL_BOUND = 2.0 ** -10.9

_tanh_fast = None  # a generated module's, set by tanh_part


@triton.jit
def _apply(X, Y, N, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    if FAST:
        y = _tanh_fast(x, "tf32")
    else:
        y = _tanh_fast(x, "ieee")
    tl.store(Y + offs, y, mask=offs < N)


def tanh_part(module) -> list:
    """_tanh_fast's errors against float64 tanh, fast (DOT_PRECISION "tf32") and exact."""
    global _tanh_fast
    _tanh_fast = module._tanh_fast
    x = torch.linspace(-20.0, 20.0, 1 << 20, device="cuda")
    truth = torch.tanh(x.double())
    rows = []
    for fast in (True, False):
        y = torch.empty_like(x)
        _apply[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), FAST=fast, BLOCK=1024)
        for lo, hi in ((0.0, 0.25), (0.25, 1.0), (1.0, 4.0), (4.0, 20.0)):
            band = (x.abs() >= lo) & ((x.abs() < hi) if hi < 20 else (x.abs() <= hi)) & (x != 0)
            err = (y.double() - truth)[band].abs()
            rows.append({"form": "tanh.approx" if fast and module.APPROX_TANH else "exact",
                         "|x|": f"[{lo:g}, {hi:g})", "max_abs": err.max().item(),
                         "max_rel": (err / truth[band].abs()).max().item(),
                         "nan": bool(torch.isnan(y[band]).any())})
    return rows


def kernels(cap: float, backend: str):
    """(fast, exact): the same variant compiled twice, the second with APPROX_TANH off in
    its modules before any kernel of theirs compiles."""
    fast = attncc.compile(attncc.parse(SPEC.format(name=f"cap_fast_{int(cap)}", cap=cap)),
                          backend=backend)
    exact = attncc.compile(attncc.parse(SPEC.format(name=f"cap_exact_{int(cap)}", cap=cap)),
                           backend=backend)
    for name in {backend, "triton"}:
        exact.module_of(name).APPROX_TANH = tl.constexpr(False)
    return fast, exact


def attention_part(lens, heads: int, backends: list) -> list:
    rows = []
    for n in lens:
        for cap, q_gain in ((30.0, 4.0), (5.0, 1.0)):
            for dtype in (torch.bfloat16, torch.float16):
                for backend in backends:
                    gen = torch.Generator().manual_seed(n + int(cap))
                    q, k, v, dout = (torch.randn(1, heads, n, 128, generator=gen,
                                                 dtype=torch.float64).cuda() for _ in range(4))
                    q = q * q_gain  # |s| up to about 4 cap: tanh near its bounds
                    fast, exact = kernels(cap, backend)

                    def grads(fn, dt):
                        xs = [t.to(dt).requires_grad_() for t in (q, k, v)]
                        out = fn(*xs)
                        return [out, *torch.autograd.grad(out, xs, dout.to(dt))]
                    truth = grads(lambda *xs: attncc.reference(fast.variant, *xs), torch.float64)
                    eager = grads(lambda *xs: attncc.reference(fast.variant, *xs), dtype)
                    got = {"fast": grads(fast, dtype), "exact": grads(exact, dtype)}
                    scales = gradient_scales(q, k, truth[0], dout, 1 / math.sqrt(128), 1)
                    for i, what in enumerate(("out", "dq", "dk", "dv")):
                        e_eager = max_abs_error(eager[i], truth[i])
                        row = {"len": n, "cap": cap, "q_gain": q_gain,
                               "dtype": str(dtype).replace("torch.", ""), "backend": backend,
                               "result": what, "eager": e_eager}
                        for form, res in got.items():
                            err = max_abs_error(res[i], truth[i])
                            row[form] = err
                            row[f"{form}_ok"] = (not math.isnan(err)) and within_tolerance(
                                err, e_eager, dtype, truth[i], scales.get(what, 1.0))
                        rows.append(row)
    return rows


def speed_part(n: int, backends: list) -> list:
    os.environ["ATTNCC_TUNE"] = "1"  # timed: each form tuned (parts 1-2 ran untuned)
    rows = []
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 16, n, 128, generator=gen).to("cuda", torch.bfloat16)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for backend in backends:
        fast, exact = kernels(30.0, backend)
        row = {"backend": backend}
        for form, fn in (("fast", fast), ("exact", exact)):
            fwd = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
            both = triton.testing.do_bench(
                lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), return_mode="median")
            row[form] = {"fwd_ms": fwd, "bwd_ms": both - fwd}
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="1024,4097")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--backends", default="triton,gluon")
    ap.add_argument("--speed-len", type=int, default=16384, help="part 3's tokens (0: skip it)")
    args = ap.parse_args()
    backends = args.backends.split(",")
    module = attncc.compile(attncc.parse(SPEC.format(name="cap_probe", cap=30.0))).module
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}",
          flush=True)
    results = {"tanh": tanh_part(module)}
    results["attention"] = attention_part([int(n) for n in args.lens.split(",")], args.heads,
                                          backends)
    results["speed"] = speed_part(args.speed_len, backends) if args.speed_len else []
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "softcap_accuracy.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'form':12} {'|x|':12} {'max abs':>10} {'max rel':>10}")
    for r in results["tanh"]:
        print(f"{r['form']:12} {r['|x|']:12} {r['max_abs']:10.2e} {r['max_rel']:10.2e}"
              + ("  NaN" if r["nan"] else ""))
    print(f"\n{'len':>6} {'cap':>5} {'dtype':9} {'backend':8} {'result':6} {'eager':>9} "
          f"{'exact':>9} {'fast':>9}  ok (exact/fast)")
    for r in results["attention"]:
        print(f"{r['len']:6} {r['cap']:5g} {r['dtype']:9} {r['backend']:8} {r['result']:6} "
              f"{r['eager']:9.2e} {r['exact']:9.2e} {r['fast']:9.2e}  {r['exact_ok']}/{r['fast_ok']}")
    if results["speed"]:
        print(f"\ncausal softcap 30, {args.speed_len} tokens, 16 heads, D=128, bf16 (ms)")
        print(f"{'backend':8} {'fast fwd':>9} {'exact fwd':>10} {'fast bwd':>9} {'exact bwd':>10}")
        for r in results["speed"]:
            print(f"{r['backend']:8} {r['fast']['fwd_ms']:9.3f} {r['exact']['fwd_ms']:10.3f} "
                  f"{r['fast']['bwd_ms']:9.3f} {r['exact']['bwd_ms']:10.3f}")
    bad = [r for r in results["tanh"] if r["nan"] or (
        r["form"] == "tanh.approx" and not r["max_rel"] <= REL_BOUND)]
    bad += [r for r in results["attention"] if not r["fast_ok"]]
    print(f"\n{len(bad)} out of bounds" if bad else "\nall within bounds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
