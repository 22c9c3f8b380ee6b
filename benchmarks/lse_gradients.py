"""GPU check of gradients through the returned LSE and of scores that grow with
distance, in both backends, against the float64 reference's autograd.

    python benchmarks/lse_gradients.py [--backends gluon,triton]

Each case runs `kernel(q, k, v, return_lse=True, **inputs)` in bf16 (fp16 on a few),
takes the loss sum(out * g) + sum(lse * h) (h = 0 on some cases, to check the path
with no LSE gradient is unchanged), and compares dq, dk, dv and every learnable input's
gradient with float64 autograd of attncc.reference on the same inputs, under
attncc/semantics/tolerance.py's rule (twice the eager same-dtype error plus slack; NaN never
passes). The variants include a learned ALiBi whose slopes are negative (scores that
grow with distance: exp2 overflows wherever a masked or out-of-sequence pair is not
kept out) at lengths off the tile. `kernel.last_backward` says which kernels ran, so a
case that asked for Gluon and ran the portable dQ says so. Full results go to
$OUT/lse_gradients.json; a short table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc.arguments import Problem  # noqa: E402
from attncc.semantics.reference import scale_value  # noqa: E402
from attncc.semantics.samples import sample_inputs  # noqa: E402
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance  # noqa: E402

OUT = os.environ.get("OUT", "out")
DEV = "cuda"  # --device cpu: a smoke run under the Triton interpreter, float32
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")

LEARNED_ALIBI = """attention learned_alibi {
    learnable input sl: f32[h]
    mask q >= k
    score s + sl[h] * (k - q)
}"""
GROWING_TABLE = """attention growing_bias {
    learnable input bias: f32[h, 64]
    mask q - k < 40
    score s * (1.0 + 0.05 * (q - k)) + bias[h, min(max(q - k, 0), 63)]
}"""


def variants() -> dict:
    found = {n: attncc.parse_file(os.path.join(EXAMPLES, n + ".attn"))
             for n in ("full", "causal", "sliding_window", "document", "alibi", "softcap",
                       "gqa_causal", "relative_bias", "bigbird")}
    found["learned_alibi"] = attncc.parse(LEARNED_ALIBI)
    found["growing_bias"] = attncc.parse(GROWING_TABLE)
    return found


def check(variant, backend, *, B, Hq, Hkv, Lq, Lk, D, dtype, lse_weight, seed=0):
    torch.manual_seed(seed)
    if variant.heads:
        Hq, Hkv = variant.heads.q, variant.heads.kv
    p = Problem(B, Hq, Hkv, Lq, Lk, D, D, 0, 0)
    inputs = sample_inputs(variant, p, seed=seed, device=DEV)
    learnable = [d.name for d in variant.inputs if d.learnable]
    if variant.name == "learned_alibi":   # negative slopes: scores grow with distance
        inputs["sl"] = -torch.linspace(0.5, 3.5, Hq, device=DEV)
    q, k, v = (torch.randn(B, h, n, D, device=DEV, dtype=torch.float64).to(dtype)
               for h, n in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    g = torch.randn(B, Hq, Lq, D, device=DEV, dtype=torch.float64)
    h = lse_weight * torch.randn(B, Hq, Lq, device=DEV, dtype=torch.float64)

    def grads(run, cast, as_dtype):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        extra = {n: t.detach().to(cast if t.is_floating_point() and cast == torch.float64
                                  else t.dtype).requires_grad_(n in learnable)
                 if t.is_floating_point() else t for n, t in inputs.items()}
        out, lse = run(*leaves, extra)
        lse_finite = torch.where(torch.isinf(lse), 0.0, lse)   # empty rows: no gradient
        loss = (out.double() * g).sum() + (lse_finite.double() * h).sum()
        wrt = leaves + [extra[n] for n in learnable]
        return [out, lse] + list(torch.autograd.grad(loss, wrt, allow_unused=True))

    kernel = attncc.compile(variant, backend=backend)
    mine = grads(lambda q_, k_, v_, x: kernel(q_, k_, v_, return_lse=True, **x), dtype, dtype)
    ref = grads(lambda q_, k_, v_, x: attncc.reference(variant, q_, k_, v_, return_lse=True, **x),
                torch.float64, torch.float64)
    eager = grads(lambda q_, k_, v_, x: attncc.reference(variant, q_, k_, v_, return_lse=True, **x),
                  dtype, dtype)
    scales = gradient_scales(q, k, ref[0], g, scale_value(variant, D), Hq // Hkv)
    rows = []
    for name, a, r, e in zip(["out", "lse", "dq", "dk", "dv"] + [f"d{n}" for n in learnable],
                             mine, ref, eager):
        if r is None:
            continue
        err, eerr = max_abs_error(a, r), max_abs_error(e, r)
        ok = within_tolerance(err, eerr, dtype, r, scales.get(name, 1.0))
        rows.append(dict(tensor=name, err=err, eager_err=eerr, ok=bool(ok)))
    return rows, getattr(kernel, "last_backward", None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="gluon,triton")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    found = variants()
    shapes = [dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128),
              dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128),
              dict(B=1, Hq=6, Hkv=2, Lq=37, Lk=37, D=64)]
    cases = []
    for backend in args.backends.split(","):
        for name in found:
            for shape in shapes:
                cases.append((backend, name, shape, torch.bfloat16, 1.0))
            cases.append((backend, name, shapes[0], torch.bfloat16, 0.0))
        for name in ("causal", "learned_alibi", "softcap"):
            cases.append((backend, name, shapes[1], torch.float16, 1.0))
    if DEV == "cpu":
        cases = [(b, n, shapes[2], torch.float32, 1.0) for b in args.backends.split(",")
                 for n in ("causal", "learned_alibi", "growing_bias")]
    results, failures = [], 0
    for backend, name, shape, dtype, lse_weight in cases:
        label = (f"{backend:6s} {name:15s} {shape['B']}x{shape['Hq']}/{shape['Hkv']} "
                 f"{shape['Lq']}x{shape['Lk']} d{shape['D']} {str(dtype)[6:]} dlse={lse_weight:g}")
        try:
            rows, ran = check(found[name], backend, dtype=dtype, lse_weight=lse_weight, **shape)
            ok = all(r["ok"] for r in rows)
        except Exception as e:
            rows, ran, ok = [dict(error=f"{type(e).__name__}: {str(e)[:500]}")], None, False
            traceback.print_exc()
        failures += not ok
        results.append(dict(case=label, ok=ok, rows=rows, last_backward=repr(ran)))
        worst = max((r for r in rows if "err" in r), key=lambda r: r["err"] if r["err"] == r["err"]
                    else float("inf"), default=None)
        print(f"{'ok  ' if ok else 'FAIL'} {label} "
              f"{'' if worst is None else worst['tensor'] + ' ' + format(worst['err'], '.3g')} "
              f"ran={ran}", flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "lse_gradients.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nlse_gradients: {len(results) - failures} of {len(results)} cases within tolerance")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
