"""Experiment: the backward's dK/dV kernel on a side stream, concurrent with dQ.

    python benchmarks/bwd_streams.py [--len 16384] [--variants bigbird,document,...]

The two kernels read the same inputs and write different outputs, so they can overlap;
at low density each is short and leaves SMs idle in its tail. Times the backward alone
(autograd.grad of a kept graph, median of triton.testing.do_bench) with
attncc.runtime.CONCURRENT_BACKWARD off and on, same process, same inputs, tuned configs.
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import attncc  # noqa: E402
from attncc import runtime  # noqa: E402
from gpu_suite import anchor_problem  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--len", type=int, default=16384)
ap.add_argument("--variants", default="bigbird,document,sliding_window,causal,full")
args = ap.parse_args()
L, D = args.len, 128
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
rows = []
for name in args.variants.split(","):
    variant, q, k, v, inputs = anchor_problem(name, L, D)
    kernel = attncc.compile(variant)
    out = kernel(q, k, v, **inputs)
    do = torch.randn_like(out)
    result = {}
    for on in (False, True):
        runtime.CONCURRENT_BACKWARD = on
        grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        result[on] = (triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median"), grads)
    same = all(torch.equal(a, b) for a, b in zip(result[False][1], result[True][1]))
    rows.append((name, result[False][0], result[True][0], same))
    print(f"{name:15s} sequential {result[False][0]:.3f} ms  concurrent {result[True][0]:.3f} ms  "
          f"identical grads {same}", flush=True)
print("\nvariant         sequential  concurrent  speed-up  identical")
for name, a, b, same in rows:
    print(f"{name:15s} {a:9.3f}   {b:9.3f}   {a / b:6.3f}x   {same}")
