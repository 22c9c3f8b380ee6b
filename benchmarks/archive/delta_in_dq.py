"""The backward with and without its delta pass, A/B in one process.

    python benchmarks/archive/delta_in_dq.py [--len 16384] [--variants sliding_window,causal,...]

"separate": attn_bwd_delta (rowsum(dO * O)), then dK/dV, then dQ: three launches.
"in dQ": the dQ kernel computes delta for its rows from O and dO, which it loads
anyway (dO) or once per program (O), and stores it for the dK/dV kernel launched
after it: two launches, one pass over dO fewer. Both at the tuned configs (one forward
+ backward through the kernel first), module functions called directly, do_bench
median, same inputs; gradients compared. Also the backward through autograd (kept
graph), which is what a user gets. Prints a table last.
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from attncc.runtime import tuning
from gpu_suite import anchor_problem  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--variants", default="sliding_window,causal,full,alibi,causal_gqa")
    args = ap.parse_args()
    L, H, D = args.len, 16, 128
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
    rows = []
    for name in args.variants.split(","):
        variant, q, k, v, inputs = anchor_problem(name, L, D)
        kernel = attncc.compile(variant)
        out, lse = kernel(q, k, v, return_lse=True, **inputs)
        do = torch.randn_like(out)
        autograd_ms = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
        m = kernel.module
        problem = kernel.check_call(q, k, v, inputs, 0, 0)
        cfg_dkdv = tuning.config_for(kernel, problem, q.dtype, "dkdv", lambda c: None)
        cfg_dq = tuning.config_for(kernel, problem, q.dtype, "dq", lambda c: None)
        qd, kd, vd, od, lsed = (t.detach() for t in (q, k, v, out, lse))

        def separate():
            delta = m.backward_delta(od, do)
            dk, dv = m.backward_dkdv(qd, kd, vd, lsed, delta, do, inputs, config=cfg_dkdv)
            dq, _ = m.backward_dq(qd, kd, vd, lsed, delta, do, inputs, config=cfg_dq)
            return dq, dk, dv

        def in_dq():
            return m.backward(qd, kd, vd, od, lsed, do, inputs, config_dkdv=cfg_dkdv,
                              config_dq=cfg_dq)[:3]

        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(separate(), in_dq()))
        a, b = bench(separate), bench(in_dq)
        rows.append((name, a, b, autograd_ms, diff))
        print(f"{name:15s} separate {a:.3f} ms  in dQ {b:.3f} ms  autograd {autograd_ms:.3f} ms  "
              f"max diff {diff:.1e}", flush=True)
        del q, k, v, out, lse, do, qd, kd, vd, od, lsed
        torch.cuda.empty_cache()
    print(f"\nS={L} H={H} D={D} bf16; backward only, ms")
    print("variant          separate    in dQ  speed-up  autograd (runtime)  max diff")
    for name, a, b, c, diff in rows:
        print(f"{name:15s} {a:9.3f} {b:8.3f}  {a / b:7.3f}x  {c:9.3f}            {diff:.1e}")


if __name__ == "__main__":
    main()
