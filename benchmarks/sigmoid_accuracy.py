"""GPU check of sigmoid's fast form: what tanh.approx costs in accuracy, in the weights and
in sigmoid attention, against float64.

    python benchmarks/sigmoid_accuracy.py [--lens 1024,4096] [--heads 4]

A `sigmoid` in the pair weights of a 16-bit call runs as (1 + tanh.approx(x/2)) / 2 on
an NVIDIA GPU (codegen/templates/expressions.py.jinja, _sigmoid): PTX bounds tanh's
relative error by 2^-11, so the weight's absolute error by 2^-12, which is coarser than
the weight's own rounding into bf16 where the weight is far below 1 (σ(-9) ≈ 1.2e-4,
the example's bias). Part 1 runs the module's _sigmoid both ways over x in [-20, 20]
and reports the absolute and relative errors by range of x; it fails past 2^-12
absolute. Part 2 runs causal sigmoid attention in bf16 (bias -9 and -log n, both
backends) with the fast form and with a copy of the same modules whose APPROX_TANH is
off, and reports the errors of out, dq, dk, dv against attncc.reference in float64
beside the exact form's and the tolerance rule's verdict; it fails where the fast form
misses the rule. Full results go to $OUT/sigmoid_accuracy.json; a table is printed last.
Under TRITON_INTERPRET=1 on the CPU it is a smoke run of the exact form in float32.
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
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
SPEC = ("attention {name} {{ param bias: float = {bias}  mask q >= k  normalize none  "
        "weight sigmoid(s + bias) }}")


_sigmoid = None  # a generated module's, set by main


@triton.jit
def _apply(X, Y, N, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    if FAST:
        y = _sigmoid(x, "tf32")
    else:
        y = _sigmoid(x, "ieee")
    tl.store(Y + offs, y, mask=offs < N)


def weights_part(module) -> list:
    """_sigmoid's errors against float64 sigmoid, fast (DOT_PRECISION "tf32") and exact."""
    global _sigmoid
    _sigmoid = module._sigmoid
    x = torch.linspace(-20.0, 20.0, 1 << (12 if INTERPRET else 20), device=DEV)
    truth = torch.sigmoid(x.double())
    rows = []
    for fast in (True, False):
        y = torch.empty_like(x)
        _apply[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), FAST=fast, BLOCK=1024)
        for lo, hi in ((0.0, 20.0), (-4.0, 0.0), (-9.0, -4.0), (-20.0, -9.0)):
            band = (x >= lo) & (x < hi) if hi < 20 else (x >= lo)
            err = (y.double() - truth)[band].abs()
            rows.append({"form": "tanh.approx" if fast and module.APPROX_TANH else "exact",
                         "x": f"[{lo:g}, {hi:g})", "max_abs": err.max().item(),
                         "max_rel": (err / truth[band]).max().item()})
    return rows


def kernels(bias: float, backend: str):
    """(fast, exact): the same variant compiled twice, the second with APPROX_TANH off
    in its modules before any kernel of theirs compiles."""
    fast = attncc.compile(attncc.parse(SPEC.format(name="sig_fast", bias=bias)), backend=backend)
    exact = attncc.compile(attncc.parse(SPEC.format(name="sig_exact", bias=bias)), backend=backend)
    for name in {backend if backend != "auto" else "triton", "triton"}:
        exact.module_of(name).APPROX_TANH = tl.constexpr(False)
    return fast, exact


def attention_part(lens, heads: int, backends: list) -> list:
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    rows = []
    for n in lens:
        for bias in (-9.0, -math.log(n)):
            for backend in backends:
                gen = torch.Generator().manual_seed(n)
                q, k, v, dout = (torch.randn(1, heads, n, 128, generator=gen, dtype=torch.float64).to(DEV)
                                 for _ in range(4))
                fast, exact = kernels(bias, backend)

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
                    row = {"len": n, "bias": round(bias, 3), "backend": backend, "result": what,
                           "eager": e_eager}
                    for form, res in got.items():
                        err = max_abs_error(res[i], truth[i])
                        row[form] = err
                        row[f"{form}_ok"] = within_tolerance(err, e_eager, dtype, truth[i],
                                                             scales.get(what, 1.0))
                    rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="37" if INTERPRET else "1024,4096")
    ap.add_argument("--heads", type=int, default=1 if INTERPRET else 4)
    ap.add_argument("--backends", default="triton" if INTERPRET else "triton,gluon")
    args = ap.parse_args()
    module = attncc.compile(attncc.parse(SPEC.format(name="sig_probe", bias=-9.0))).module
    weights = weights_part(module)
    attention = attention_part([int(n) for n in args.lens.split(",")], args.heads,
                               args.backends.split(","))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "sigmoid_accuracy.json"), "w") as f:
        json.dump({"weights": weights, "attention": attention}, f, indent=1)
    print(f"{'form':12} {'x':12} {'max abs':>10} {'max rel':>10}")
    for r in weights:
        print(f"{r['form']:12} {r['x']:12} {r['max_abs']:10.2e} {r['max_rel']:10.2e}")
    print(f"\n{'len':>6} {'bias':>7} {'backend':8} {'result':6} {'eager':>9} {'exact':>9} {'fast':>9}  ok")
    for r in attention:
        print(f"{r['len']:6} {r['bias']:7} {r['backend']:8} {r['result']:6} {r['eager']:9.2e} "
              f"{r['exact']:9.2e} {r['fast']:9.2e}  {r['exact_ok']}/{r['fast_ok']}")
    bad = [r for r in weights if r["form"] == "tanh.approx" and r["max_abs"] > 2.0 ** -12]
    bad += [r for r in attention if not r["fast_ok"]]
    print(f"\n{len(bad)} out of bounds" if bad else "\nall within bounds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
