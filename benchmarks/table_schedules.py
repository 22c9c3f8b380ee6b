"""The backward's schedules for table-driven variants side by side (ATTNCC_BACKWARD:
auto, one-launch, sequential): each checked against the float64 reference, then timed
on the same inputs in one process.

    ATTNCC_TUNE=1 python benchmarks/table_schedules.py [--lens 4096,16384] [--rounds 3]
        [--problems bigbird,document,d0.03,d0.125,d0.5] [--schedules one-launch,auto]

Problems: the ANCHORS variants bigbird and document (gpu_suite.anchor_problem: 16K
tokens a call, so at 4K four rows of 4K), and `dX` for the density curve's random
per-head 128-block layout at density X (benchmarks/density_curve.py, one row), 16 heads,
bf16, head dim 128. For each problem and schedule: first a check at --check-len tokens
(every output and gradient against attncc.reference in float64, held to
attncc/semantics/tolerance.py's rule; a NaN fails), then at each length the backward
alone (autograd.grad of a kept graph) and forward + backward, do_bench medians over
--rounds rounds with the schedules interleaved, each schedule tuned on its own first
use; then the same forward + backward captured in a CUDA graph and replayed (the
kernels without the host's time: where the eager step is slower than the replay, the
host bounds it); and the largest gradient difference from the first schedule's (NaN
counted as infinite). Set CUDA_LAUNCH_BLOCKING=1 to name the launch if a kernel faults
(tuning raises KernelFaultError). Prints a table last; writes $OUT/table_schedules.json.
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


def graph_ms(step) -> float:
    """The median time of `step` captured in a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return bench(graph.replay)


def backward_alone(kernel, q, k, v, inputs, do):
    """(gradients, ms) of the backward alone: autograd.grad of one kept graph, the first
    call tuning. The graph is dropped on return: a graph kept alive would keep q's
    gradient node on the default stream, which a CUDA-graph capture then refuses."""
    out = kernel(q, k, v, **inputs)
    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return grads, bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))


def measure(name, L, D, schedules, rounds):
    """Rows of one problem at L tokens: per schedule the backward, the eager step by
    round, the graph replay and the gradients' difference from the first schedule."""
    variant, q, k, v, inputs = problem(name, L, D)
    kernel = attncc.compile(variant)
    do = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    rows = {s: dict(problem=name, len=L, schedule=s, bwd_ms=[], step_ms=[]) for s in schedules}
    first = None
    for r in range(rounds):
        for schedule in schedules:
            settings.TABLES_BACKWARD = schedule
            row = rows[schedule]
            grads, ms = backward_alone(kernel, q, k, v, inputs, do)
            row["bwd_ms"].append(ms)
            row["step_ms"].append(bench(lambda: torch.autograd.grad(kernel(q, k, v, **inputs),
                                                                    (q, k, v), do)))
            if r == 0:
                first = grads if first is None else first
                row["ran"] = kernel.last_backward
                row["max_abs_diff_to_first"] = largest_difference(grads, first)
    for schedule in schedules:
        settings.TABLES_BACKWARD = schedule
        rows[schedule]["graph_ms"] = graph_ms(
            lambda: torch.autograd.grad(kernel(q, k, v, **inputs), (q, k, v), do))
    return list(rows.values())


def median(xs):
    return sorted(xs)[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="16384")
    ap.add_argument("--check-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--problems", default="bigbird,document,d0.03,d0.125,d0.5")
    ap.add_argument("--schedules", default="one-launch,auto")
    args = ap.parse_args()
    D = 128
    lens = [int(x) for x in args.lens.split(",")]
    schedules = args.schedules.split(",")
    unknown = set(schedules) - set(settings.BACKWARD_SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; the runtime has {settings.BACKWARD_SCHEDULES}")
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "lens": lens, "check_len": args.check_len, "dim": D,
            "rounds": args.rounds}
    print(meta, flush=True)
    checks, rows = {}, []
    for name in args.problems.split(","):
        small = problem(name, args.check_len, D)
        for schedule in schedules:
            settings.TABLES_BACKWARD = schedule
            checks[name, schedule] = error_vs_reference(*small, torch.bfloat16, seed=7)
        for L in lens:
            for row in measure(name, L, D, schedules, args.rounds):
                row["check_failed"] = [c["tensor"] for c in checks[name, row["schedule"]]
                                       if not c["ok"]]
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "table_schedules.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows,
                   "checks": {f"{n} {s}": c for (n, s), c in checks.items()}},
                  f, indent=1, default=str)
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, D={D}, bf16; "
          f"ms, medians of {args.rounds} rounds (step: eager forward + backward; graph: "
          f"the same step replayed)")
    print(f"{'problem':10s} {'len':>6s} {'schedule':11s} {'bwd':>7s} {'step':>7s} {'graph':>7s} "
          f"{'diff':>8s}  check at {args.check_len}")
    for r in rows:
        check = "ok" if not r["check_failed"] else "FAILED " + ",".join(r["check_failed"])
        print(f"{r['problem']:10s} {r['len']:6d} {r['schedule']:11s} {median(r['bwd_ms']):7.3f} "
              f"{median(r['step_ms']):7.3f} {r['graph_ms']:7.3f} "
              f"{r['max_abs_diff_to_first']:8.1e}  {check}")


if __name__ == "__main__":
    main()
