"""Where one backward's time goes: each ANCHORS variant named, compiled with
backend=auto (tuned on its first call), then one forward + backward under
torch.profiler; prints the GPU kernels with their times, the backends and configs the
tuner chose, and the backward's median wall time (do_bench) beside the sum of its
kernels.

    python benchmarks/backward_profile.py --variants sliding_window,causal [--env KEY=VALUE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import attncc  # noqa: E402
from attncc.runtime import tuning  # noqa: E402
from gpu_suite import anchor_problem  # noqa: E402

OUT = os.environ.get("OUT", "out")
HOST = False


def profile(name):
    import triton
    variant, q, k, v, inputs = anchor_problem(name, 16384)
    kern = attncc.compile(variant)
    do = torch.randn_like(q)
    step = lambda: torch.autograd.grad(kern(q, k, v, **inputs), (q, k, v), do)
    step()  # tunes
    torch.cuda.synchronize()
    fwd = triton.testing.do_bench(lambda: kern(q, k, v, **inputs), warmup=25, rep=100,
                                  return_mode="median")
    both = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.device_time_total / 1e3) for e in prof.key_averages()
               if e.device_time_total > 0]
    chosen = {key[1]: choice.to_json() for key, choice in tuning._MEMORY.items()
              if key[0] == kern.key and isinstance(choice, tuning.Choice)}
    host = {}
    if HOST:
        host = dict(fwd_us=issue_us(lambda: kern(q, k, v, **inputs)), step_us=issue_us(step))
        # The host side of 20 steps under cProfile, by own time and cumulative; the
        # whole listing in $OUT (pstats.Stats reads it).
        import cProfile
        import io
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        os.makedirs(OUT, exist_ok=True)
        profiler.dump_stats(os.path.join(OUT, f"backward_host_{name}.prof"))
        for order, count in (("tottime", 22), ("cumulative", 40)):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
            print(text.getvalue()[-7000:])
    return dict(variant=name, fwd_ms=fwd, bwd_ms=both - fwd, kernels=kernels, host=host,
                backends=dict(fwd=kern.last_backend, bwd=kern.last_backward), chosen=chosen)


def issue_us(call, calls: int = 50) -> float:
    """Host µs to issue one call, the median of `calls`, while a sleep kernel holds the
    GPU: no call waits for the GPU, so the time is the host's work alone (Python, the
    autograd engine, allocations, launches)."""
    import statistics
    import time
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles: longer than the calls' issue
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="sliding_window")
    ap.add_argument("--host", action="store_true",
                    help="the host µs to issue a call, and cProfile of 20 steps' host side")
    args = ap.parse_args()
    global HOST
    HOST = args.host
    rows = []
    for name in args.variants.split(","):
        try:
            row = profile(name)
        except Exception:
            traceback.print_exc()
            continue
        rows.append(row)
        print(f"\n{name}: fwd {row['fwd_ms']:.3f} ms, bwd {row['bwd_ms']:.3f} ms; "
              f"backends {json.dumps(row['backends'])}")
        if row["host"]:
            print(f"   host µs to issue (GPU held busy): forward {row['host']['fwd_us']:.0f}, "
                  f"forward + backward {row['host']['step_us']:.0f}")
        for kname, ms in sorted(row["kernels"], key=lambda x: -x[1])[:8]:
            print(f"   {ms:8.3f} ms  {kname[:90]}")
        print(f"   chosen: {json.dumps(row['chosen'])[:900]}")
        torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "backward_profile.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
