"""A/B of the backward's schedules for table-driven variants, same process, same inputs.

    python benchmarks/archive/bwd_schedules.py [--len 16384] [--problems bigbird,document,d0.03,d0.06]
                                       [--schedules one-launch,sequential]

Schedules (attncc.runtime.settings.TABLES_BACKWARD): "one-launch" (dK/dV and dQ programs in one
grid, after the delta pass) and "sequential" (dQ computing delta, then dK/dV). Run 51
(RESULTS.md) also timed "streams", the dK/dV kernel on a side stream beside dQ, which
the one launch replaced; that schedule is gone from the runtime. Problems: the ANCHORS variants
bigbird and document (gpu_suite.anchor_problem), and `dX` for the density curve's
random per-head 128-block layout at density X (benchmarks/density_curve.py). Each
schedule is tuned on its own first use. Times, as do_bench medians: the backward alone
(autograd.grad of a kept graph) and forward + backward; the gradients of each schedule
are compared with the first's. Prints a table last; writes $OUT/bwd_schedules.json.
"""
import argparse
import json
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from attncc.runtime import settings
from density_curve import BLOCK, random_layout, sparse_spec  # noqa: E402
from gpu_suite import anchor_problem  # noqa: E402


def problem(name, L, D):
    if not re.fullmatch(r"d[0-9.]+", name):
        return anchor_problem(name, L, D)
    gen = torch.Generator().manual_seed(0)
    H = 16
    q, k, v = (torch.randn(1, H, L, D, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    layout = random_layout(H, L // BLOCK, float(name[1:]), gen).cuda()
    return attncc.parse(sparse_spec(BLOCK)), q, k, v, {"blocks": layout}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--problems", default="bigbird,document,d0.03,d0.06")
    ap.add_argument("--schedules", default=",".join(settings.BACKWARD_SCHEDULES))
    args = ap.parse_args()
    L, D = args.len, 128
    schedules = args.schedules.split(",")
    unknown = set(schedules) - set(settings.BACKWARD_SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; the runtime has {settings.BACKWARD_SCHEDULES}")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "len": L, "dim": D}
    print(meta, flush=True)
    rows = []
    for name in args.problems.split(","):
        variant, q, k, v, inputs = problem(name, L, D)
        kernel = attncc.compile(variant)
        do = torch.randn(q.shape, device=q.device, dtype=q.dtype)
        first = None
        for schedule in schedules:
            settings.TABLES_BACKWARD = schedule
            out = kernel(q, k, v, **inputs)
            grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # tunes
            bwd = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            fwd_bwd = bench(lambda: torch.autograd.grad(kernel(q, k, v, **inputs), (q, k, v), do))
            if first is None:
                first = grads
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, first))
            row = dict(problem=name, schedule=schedule, bwd_ms=bwd, fwd_bwd_ms=fwd_bwd,
                       max_abs_diff_to_first=diff)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bwd_schedules.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, S={L}, D={D}, bf16; ms")
    print(f"{'problem':10s} {'schedule':11s} {'bwd':>8s} {'fwd+bwd':>8s} {'diff':>8s}")
    for r in rows:
        print(f"{r['problem']:10s} {r['schedule']:11s} {r['bwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['max_abs_diff_to_first']:8.1e}")


if __name__ == "__main__":
    main()
