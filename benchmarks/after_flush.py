"""What a forward's time depends on besides its kernel: one call timed alone (CUDA
events around it, nothing else in the window) after each of several kinds of preceding
GPU work, or under sustained load, for attncc and its peers on the same inputs.

    ATTNCC_TUNE=1 python benchmarks/after_flush.py [--variant causal] [--len 16384]
    ATTNCC_TUNE=1 python benchmarks/after_flush.py --sustained 4

Written for RESULTS.md run 179's question (attncc's causal forward ~2.0 ms under
do_bench, 1.77 back to back); runs 180-181 answered it: what precedes a call changes
nothing, and do_bench's figures are every kernel's at the 700 W power cap. What
precedes the call:
  itself     the same forward (the profiler's back-to-back figure)
  other      the same kernel on other inputs of the same shape (its data not in L2)
  zero       a 256 MB buffer zeroed (do_bench's flush: the L2 left full of dirty lines)
  read       a 256 MB buffer summed (the L2 full of clean lines of other data)
  idle       the GPU spinning ~0.3 ms in one tiny kernel (clocks after a light load)
  matmul     a bf16 8192^3 matrix product (~1 ms at full power)
If `read` is as fast as `itself` and `zero` is slow, the kernel pays for the dirty lines'
write-back; if `read` is slow too, for cold data (its tile order, its first wave's
loads); if `idle` or `matmul` is slow, for the clock. Medians of `--calls` timed calls;
the full numbers go to $OUT/after_flush.json, the table is printed last.

`--sustained SECONDS` instead runs each backend as do_bench does, flush and call back to
back with no synchronisation, for that long, while nvidia-smi samples the SM clock, the
power drawn and the throttle reasons; it prints each backend's median call over the
second half and the clock and power over the same span (do_bench's medians against
the calls timed alone above tell whether sustained load costs one kernel more than
another).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402

FLUSH_BYTES = 256 * 2 ** 20  # do_bench's cache-clearing buffer
VARIANTS = {"causal": "attention causal { mask q >= k }", "full": "attention full { }"}


def preceding_work(device) -> dict:
    """{name: fn} of what runs just before the timed call."""
    buffer = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return {"itself": None, "zero": buffer.zero_, "read": lambda: buffer.sum(),
            # ~0.3 ms at the ~2 GHz an H100's or H200's SMs run at
            "idle": lambda: torch.cuda._sleep(600_000), "matmul": lambda: a @ b}


def time_after(call, before, calls: int) -> list:
    """Milliseconds of `call` alone, each right after `before` (None: after `call`)."""
    times = []
    for _ in range(calls + 3):  # three warm-up rounds
        # A 2 ms spin first, so that the host has issued `call` before the GPU reaches
        # it: the window between the events then holds the kernels, not host work.
        torch.cuda._sleep(4_000_000)
        (before or call)()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times[3:]


def sustained(call, flush, seconds: float) -> dict:
    """Median ms of `call` over the second half of `seconds` of flush-and-call, back to
    back, with the SM clock (MHz), the power (W) and the throttle reasons sampled by
    nvidia-smi every 20 ms over the same half."""
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
         "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
    events = []
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        for _ in range(20):
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((time.monotonic(), start, end))
        if len(events) > 200:
            torch.cuda.synchronize()  # keep the queue and the event list bounded
    torch.cuda.synchronize()
    sampler.terminate()
    samples = [line.split(", ") for line in sampler.communicate()[0].splitlines()]
    half = len(samples) // 2
    clocks = [float(s[1]) for s in samples[half:] if len(s) == 4]
    power = [float(s[2]) for s in samples[half:] if len(s) == 4]
    reasons = sorted({s[3] for s in samples[half:] if len(s) == 4})
    times = [start.elapsed_time(end) for _, start, end in events[len(events) // 2:]]
    return {"ms": statistics.median(times), "calls": len(times),
            "sm_mhz": statistics.median(clocks) if clocks else None,
            "watts": statistics.median(power) if power else None, "throttle": reasons}


def backends(variant_name: str, q, k, v) -> dict:
    found = {}
    auto = attncc.compile(VARIANTS[variant_name])
    found["attncc (auto)"] = lambda: auto(q, k, v)
    gluon = attncc.compile(VARIANTS[variant_name], backend="gluon")
    found["attncc (Gluon)"] = lambda: gluon(q, k, v)
    portable = attncc.compile(VARIANTS[variant_name], backend="triton")
    found["attncc (portable)"] = lambda: portable(q, k, v)
    try:
        from flash_attn.cute import flash_attn_func
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        found["FA4"] = lambda: flash_attn_func(qt, kt, vt, causal=variant_name == "causal")
    except ImportError as err:
        print(f"FA4 not on the path ({err}): its row is left out", file=sys.stderr)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=variant_name == "causal")
    found["cuDNN"] = cudnn
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="causal", choices=sorted(VARIANTS))
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--sustained", type=float, default=0.0,
                    help="seconds of do_bench-like load per backend (0: time calls alone)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("after_flush.py times GPU kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.len, args.dim, generator=gen)
               .to("cuda", torch.bfloat16) for _ in range(3))
    work = preceding_work("cuda")
    rows = {}
    q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
    with torch.no_grad():
        found = backends(args.variant, q, k, v)
        on_other_inputs = backends(args.variant, q2, k2, v2)
        for label, call in [*found.items(), *on_other_inputs.items()]:
            call()  # tune, compile, plan
            torch.cuda.synchronize()
        if args.sustained:
            for label, call in found.items():
                rows[label] = sustained(call, work["zero"], args.sustained)
                time.sleep(2)  # let the clock and the power settle between backends
        else:
            for label, call in found.items():
                rows[label] = {name: time_after(call, before, args.calls)
                               for name, before in work.items()}
                rows[label]["other"] = time_after(call, on_other_inputs[label], args.calls)
    names = [*work, "other"]
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "after_flush.json"), "w") as f:
        json.dump({"args": vars(args), "gpu": torch.cuda.get_device_name(),
                   "triton": __import__("triton").__version__, "ms": rows}, f, indent=1)
    if args.sustained:
        print(f"\n{torch.cuda.get_device_name()}, {args.variant}, {args.heads} heads x {args.len}, "
              f"D={args.dim}, bf16: {args.sustained:g} s of flush and call per backend, second half")
        print(f"{'':18s}{'median ms':>10s}{'calls':>7s}{'SM MHz':>8s}{'W':>6s}  throttle reasons")
        for label, r in rows.items():
            print(f"{label:18s}{r['ms']:10.3f}{r['calls']:7d}{r['sm_mhz'] or 0:8.0f}"
                  f"{r['watts'] or 0:6.0f}  {' '.join(r['throttle'])}")
        return 0
    print(f"\n{torch.cuda.get_device_name()}, {args.variant}, {args.heads} heads x {args.len}, "
          f"D={args.dim}, bf16: median ms of one forward after ...")
    print(f"{'':18s}" + "".join(f"{name:>10s}" for name in names))
    for label, by in rows.items():
        print(f"{label:18s}" + "".join(f"{statistics.median(by[name]):10.3f}" for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
