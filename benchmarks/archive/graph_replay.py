"""Whether a CUDA graph replay runs slower than the call: each kernel's GPU time both ways.

Run 56 had the dense backward 14% slower replayed; runs 76-77 (RESULTS.md) found the
SM clock drifting under dense attention's power draw instead, hence the timing order.

    python benchmarks/archive/graph_replay.py [--seq 16384] [--spec 'attention dense { }']

One forward + backward (torch.autograd.grad) of the spec at the anchor shape (B = 1,
H = 16, D = 128, bf16) is run as a call and as a replay of a CUDA graph captured from
the same call, after a warm-up that compiles and tunes. Each is timed twice, in the
order call, replay, replay, call: do_bench's median of the whole, and torch.profiler's
per-kernel GPU time (mean of 5). A kernel slower replayed in both pairs, or one that
appears only in the graph, is the difference; one slower in whichever ran later is
the GPU's drift. Checks that the
replayed gradients equal the call's. Prints a table last; writes JSON to
$OUT/graph_replay.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attncc  # noqa: E402


def kernel_times(fn, iters=5) -> dict:
    """{kernel name: mean GPU microseconds per call of fn}."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / iters for e in prof.key_averages()
            if e.self_device_time_total > 0}


def gpu_state() -> str:
    """SM clock, temperature and power now (nvidia-smi), to see drift between timings."""
    query = "clocks.sm,temperature.gpu,power.draw"
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--spec", default="attention dense { }")
    args = ap.parse_args()
    S, H, D = args.seq, 16, 128
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, H, S, D, generator=gen).to("cuda", torch.bfloat16)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    kernel = attncc.compile(args.spec)
    call = lambda: torch.autograd.grad(kernel(q, k, v), (q, k, v), do)

    side = torch.cuda.Stream()  # warm-up (compile, tune) on a side stream, as capture asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    eager = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call()
    graph.replay()
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for a, b in zip(replayed, eager))

    # In the order call, replay, replay, call: a GPU that slows as it heats over the
    # run (clocks under sustained load) would otherwise count against the second.
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    order = [("call", call), ("replay", graph.replay), ("replay", graph.replay), ("call", call)]
    timed, states = [], []
    for name, fn in order:
        timed.append((name, bench(fn), kernel_times(fn)))
        states.append(gpu_state())
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "spec": args.spec, "seq": S, "grads_equal": equal,
              "order": [name for name, _ in order], "ms": [ms for _, ms, _ in timed],
              "kernels_us": [kernels for _, _, kernels in timed], "gpu_after_each": states}
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "graph_replay.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}; "
          f"{args.spec!r}, S={S} H={H} D={D} bf16, forward + backward")
    print("do_bench, ms, in the order run: " + ", ".join(
        f"{name} {ms:.3f}" for name, ms, _ in timed) + f"; replayed gradients equal the call's: {equal}")
    print("SM clock, temperature, power after each: " + " | ".join(states))
    names = sorted(set().union(*(kernels for _, _, kernels in timed)))
    print(f"{'kernel, us':44s}" + "".join(f"{name:>10s}" for name, _ in order))
    for kernel_name in names:
        cells = [kernels.get(kernel_name) for _, _, kernels in timed]
        print(f"{kernel_name[:44]:44s}" + "".join(f"{c:10.1f}" if c is not None else f"{'-':>10s}"
                                                 for c in cells))


if __name__ == "__main__":
    main()
