"""GPU check that every head dim flash-attn takes (16 to 256) compiles and is right,
forward and backward, through attncc.flash.flash_attn_func (the path where Triton 3.6's
ptxas crashed at head dim 16: issue 31), fp16 and bf16, causal and not.

    python benchmarks/head_dims.py [--dims 16,32,...]

Each case runs with the config the runtime picks (ATTNCC_TUNE decides: 0 takes the
first candidate that compiles, the default the shipped winner or a tuning run) and is
held to attncc/semantics/tolerance.py's rule against float64 autograd of the same flash
semantics (attncc.reference of the variant flash_attn_func compiled). Full results go
to $OUT/head_dims.json; a short table is printed last.
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
from attncc import flash  # noqa: E402
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance  # noqa: E402

OUT = os.environ.get("OUT", "out")


def check(dim: int, dtype, causal: bool, seed: int = 0) -> list:
    torch.manual_seed(seed)
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 129, 203, 6, 2
    q = torch.randn(batch, seqlen_q, heads, dim, device="cuda", dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, heads_k, dim, device="cuda", dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, heads_k, dim, device="cuda", dtype=torch.float64)
    dout = torch.randn(batch, seqlen_q, heads, dim, device="cuda", dtype=torch.float64)
    variant = flash.kernel_for(causal=causal).variant

    def run(fn, cast):
        leaves = [t.to(cast).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, dout.to(cast))]

    def reference(q_, k_, v_):  # the same call through the variant's dense reference
        out = attncc.reference(variant, q_.transpose(1, 2), k_.transpose(1, 2),
                               v_.transpose(1, 2))
        return out.transpose(1, 2)

    mine = run(lambda *t: flash.flash_attn_func(*t, causal=causal), dtype)
    truth = run(reference, torch.float64)
    eager = run(reference, dtype)
    scales = gradient_scales(q.transpose(1, 2), k.transpose(1, 2), truth[0].transpose(1, 2),
                             dout.transpose(1, 2), dim ** -0.5, heads // heads_k)
    rows = []
    for name, a, t, e in zip(("out", "dq", "dk", "dv"), mine, truth, eager):
        err, eerr = max_abs_error(a, t), max_abs_error(e, t)
        rows.append(dict(tensor=name, err=err, eager_err=eerr,
                         ok=bool(within_tolerance(err, eerr, dtype, t, scales.get(name, 1.0)))))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="16,32,48,64,80,96,128,160,192,256")
    args = ap.parse_args()
    results, failures = [], 0
    for dim in map(int, args.dims.split(",")):
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                label = f"d{dim:<3d} {str(dtype)[6:]:8s} {'causal' if causal else 'full':6s}"
                try:
                    rows = check(dim, dtype, causal)
                    ok = all(r["ok"] for r in rows)
                except Exception as e:
                    rows, ok = [dict(error=f"{type(e).__name__}: {str(e)[:400]}")], False
                    traceback.print_exc()
                failures += not ok
                results.append(dict(case=label, ok=ok, rows=rows))
                worst = max((r for r in rows if "err" in r), default=None,
                            key=lambda r: r["err"] if r["err"] == r["err"] else float("inf"))
                print(f"{'ok  ' if ok else 'FAIL'} {label} "
                      + ("" if worst is None else f"{worst['tensor']} {worst['err']:.3g}"),
                      flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "head_dims.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nhead_dims: {len(results) - failures} of {len(results)} cases within tolerance")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
