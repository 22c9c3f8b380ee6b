"""The backward's schedules for table-driven variants side by side (ATTNCC_BACKWARD:
one-launch, auto, sequential): each checked against the float64 reference, then timed
on the same inputs in one process.

    ATTNCC_TUNE=1 python benchmarks/table_schedules.py [--len 16384]
        [--problems bigbird,document,d0.03,d0.125,d0.5] [--schedules one-launch,auto]

Problems: the ANCHORS variants bigbird and document (gpu_suite.anchor_problem), and `dX`
for the density curve's random per-head 128-block layout at density X
(benchmarks/density_curve.py), 16 heads, bf16, head dim 128. For each problem and
schedule: first a check at --check-len tokens (every output and gradient against
attncc.reference in float64, held to attncc/semantics/tolerance.py's rule; a NaN fails),
then the timing at --len: the backward alone (autograd.grad of a kept graph) and forward
+ backward, do_bench medians, each schedule tuned on its own first use, and the largest
gradient difference from the first schedule's (NaN counted as infinite). Run 200 found
an illegal memory access in the Gluon table-driven backward at d0.5; set
CUDA_LAUNCH_BLOCKING=1 to name the launch if it recurs (tuning raises KernelFaultError).
Prints a table last; writes $OUT/table_schedules.json.
"""
import argparse
import json
import math
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attncc  # noqa: E402
from attncc.runtime import settings  # noqa: E402
from density_curve import BLOCK, random_layout, sparse_spec  # noqa: E402
from gpu_suite import anchor_problem, error_vs_reference  # noqa: E402


def problem(name, L, D):
    """(variant, q, k, v, inputs) of `name` at L tokens (see the docstring)."""
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


def largest_difference(grads, first) -> float:
    """The largest absolute difference of two gradient lists; a NaN on either side is
    infinite (it must never be dropped by a max)."""
    worst = 0.0
    for a, b in zip(grads, first):
        d = (a.float() - b.float()).abs()
        if torch.isnan(d).any():
            return math.inf
        worst = max(worst, d.max().item())
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--check-len", type=int, default=1024)
    ap.add_argument("--problems", default="bigbird,document,d0.03,d0.125,d0.5")
    ap.add_argument("--schedules", default="one-launch,auto")
    args = ap.parse_args()
    L, D = args.len, 128
    schedules = args.schedules.split(",")
    unknown = set(schedules) - set(settings.BACKWARD_SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; the runtime has {settings.BACKWARD_SCHEDULES}")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "len": L, "check_len": args.check_len, "dim": D}
    print(meta, flush=True)
    rows = []
    for name in args.problems.split(","):
        variant, q, k, v, inputs = problem(name, L, D)
        small = problem(name, args.check_len, D)
        kernel = attncc.compile(variant)
        do = torch.randn(q.shape, device=q.device, dtype=q.dtype)
        first = None
        for schedule in schedules:
            settings.TABLES_BACKWARD = schedule
            checks = error_vs_reference(*small, torch.bfloat16, seed=7)
            failed = [c["tensor"] for c in checks if not c["ok"]]
            out = kernel(q, k, v, **inputs)
            grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # tunes
            bwd = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            fwd_bwd = bench(lambda: torch.autograd.grad(kernel(q, k, v, **inputs), (q, k, v), do))
            first = grads if first is None else first
            row = dict(problem=name, schedule=schedule, ran=kernel.last_backward,
                       check_failed=failed, checks=checks, bwd_ms=bwd, fwd_bwd_ms=fwd_bwd,
                       max_abs_diff_to_first=largest_difference(grads, first))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "checks"}, default=str),
                  flush=True)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "table_schedules.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, S={L}, D={D}, bf16; ms")
    print(f"{'problem':10s} {'schedule':11s} {'bwd':>8s} {'fwd+bwd':>8s} {'diff':>8s}  check at {args.check_len}")
    for r in rows:
        check = "ok" if not r["check_failed"] else "FAILED " + ",".join(r["check_failed"])
        print(f"{r['problem']:10s} {r['schedule']:11s} {r['bwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['max_abs_diff_to_first']:8.1e}  {check}")


if __name__ == "__main__":
    main()
