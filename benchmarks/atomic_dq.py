"""The backward two ways, A/B in one process: split (dK/dV kernel + dQ kernel, seven
products per tile, deterministic) against atomic (the dK/dV kernel also adds dS K into
an fp32 dQ with atomics: five products per tile, dQ summed in a varying order).

    python benchmarks/atomic_dq.py [--len 16384] [--dim 128] [--variants full,causal,...]

For each variant of benchmarks/gpu_suite.py (the ANCHORS set): a forward + backward
through the kernel first (which tunes the split backward's two configs as a user's
call would), then the split backward timed as the runtime runs it (delta, dK/dV on a
side stream for table-driven variants, dQ), then the atomic backward at each candidate
config, each checked against the split gradients. Timing: do_bench median, same
inputs. Prints a table last; writes JSON to $OUT/atomic_dq.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc import tuning  # noqa: E402
from gpu_suite import VARIANTS, sample_inputs  # noqa: E402

ATOMIC_CONFIGS = [(64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2),
                  (64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 2), (128, 128, 8, 2)]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    dev, dtype, L, D = "cuda", torch.bfloat16, args.len, args.dim
    gen = torch.Generator().manual_seed(0)
    rows, table = [], []
    for name in args.variants.split(","):
        spec = VARIANTS[name]
        kern = attncc.compile(spec)
        Hq, Hkv = (32, 8) if "heads" in spec else (16, 16)
        B = max(1, 16384 // L)
        q = torch.randn(B, Hq, L, D, generator=gen).to(dev, dtype)
        k = torch.randn(B, Hkv, L, D, generator=gen).to(dev, dtype)
        v = torch.randn(B, Hkv, L, D, generator=gen).to(dev, dtype)
        inputs = sample_inputs(name, kern.variant, B, Hq, L, dev, gen)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = kern(qg, kg, vg, return_lse=True, **inputs)
        do = torch.randn(out.shape, generator=gen).to(dev, dtype)
        out.backward(do)  # tunes the split backward
        ref = (qg.grad, kg.grad, vg.grad)
        out, lse = out.detach(), lse.detach()
        m = kern.module
        problem = kern.check_call(q, k, v, inputs, 0, 0)
        cfg_dkdv = tuning.config_for(kern, problem, dtype, "dkdv", lambda c: None)
        cfg_dq = tuning.config_for(kern, problem, dtype, "dq", lambda c: None)

        # The split backward as the runtime runs it: forward + backward minus forward.
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ms_fwd_bwd = bench(lambda: torch.autograd.grad(kern(q, k, v, **inputs), (q, k, v), do))
        with torch.no_grad():
            ms_fwd = bench(lambda: kern(q, k, v, **inputs))
        q, k, v = (t.detach() for t in (q, k, v))
        ms_split = ms_fwd_bwd - ms_fwd
        # The kernels alone, sequential (no side stream): delta + dK/dV + dQ.
        delta = m.backward_delta(out, do)
        ms_split_seq = bench(lambda: m.backward(q, k, v, out, lse, do, inputs,
                                                config_dkdv=cfg_dkdv, config_dq=cfg_dq))
        results = []
        for bm, bn, w, s in ATOMIC_CONFIGS:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            label = f"{bm}x{bn}w{w}s{s}"
            try:
                run = lambda: m.backward_atomic(q, k, v, lse, m.backward_delta(out, do), do,
                                                inputs, config=cfg)
                dq, dk, dv = run()
                errs = [rel(a, b) for a, b in zip((dq, dk, dv), ref)]
                ms = bench(run)
            except Exception as e:  # noqa: BLE001 - out of resources: report and go on
                results.append({"config": label, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                print(name, label, "failed", type(e).__name__, str(e)[:120], flush=True)
                continue
            results.append({"config": label, "ms": ms, "err_vs_split": errs})
            print(f"{name:15s} atomic {label:14s} {ms:7.3f} ms  err dq/dk/dv "
                  + " ".join(f"{x:.1e}" for x in errs), flush=True)
        ok = [r for r in results if "ms" in r]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        row = {"variant": name, "len": L, "dim": D, "split_ms": ms_split,
               "split_seq_ms": ms_split_seq, "fwd_ms": ms_fwd,
               "config_dkdv": cfg_dkdv, "config_dq": cfg_dq, "atomic": results}
        rows.append(row)
        if best:
            table.append((name, ms_split, ms_split_seq, best["ms"], best["config"],
                          ms_split / best["ms"], max(best["err_vs_split"])))
        print(f"{name}: split {ms_split:.3f} ms (kernels alone {ms_split_seq:.3f}), "
              f"best atomic {best and best['ms']}", flush=True)
        del q, k, v, qg, kg, vg, out, lse, do, ref
        torch.cuda.empty_cache()

    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "atomic_dq.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
          f"  S={L} D={D} bf16")
    print(f"{'variant':15s} {'split':>8s} {'split seq':>9s} {'atomic':>8s} {'config':14s} "
          f"{'gain':>5s} {'max err':>8s}")
    for name, a, b, c, cfg, g, e in table:
        print(f"{name:15s} {a:8.3f} {b:9.3f} {c:8.3f} {cfg:14s} {g:5.2f} {e:8.1e}")


if __name__ == "__main__":
    main()
