"""Issue 32's table in one call: attncc's forward and backward against FlexAttention
(its Triton kernels and, with kernel_options={"BACKEND": "FLASH"}, FlashAttention-4's),
FlashAttention-4 itself (`flash_attn.cute`, where it takes the variant; also with
deterministic=True, the peer of attncc's deterministic backward) and cuDNN.

    ATTNCC_TUNE=1 python benchmarks/training_speed.py [--variants causal,full] [--len 16384]
        [--dim 64 --heads 32 --len 4096] [--kernel-times]

The ANCHORS variants of gpu_suite.py at bf16, 16 heads (GQA 32/8), head dim 128, batch x
len = 16384 tokens. Every backend first runs one small call (1024 tokens) of the same
variant, checked against attncc.reference in float64; then each is timed on the same
inputs, interleaved: `--rounds` rounds, each timing every backend once (do_bench
medians, its L2 flush included), and the median of the rounds reported. The backward is
timed alone: CUDA events around autograd.grad after an untimed forward and an L2 flush,
the median of 50 (runs up to 202
took (forward + backward) - forward, which moved with any forward whose time jumps
between levels, Flex FLASH's on BigBird and document: RESULTS.md run 189; the JSON keeps
that difference too, `bwd_from_difference_ms`). FA4 and the FLASH backend
need FlashAttention-4 on the path (../shared/tools/fa4 carries it); without it their
cells say why. Ratios are the other's time / attncc's: above 1, attncc is faster.
Full results go to $OUT/training_speed.json; the short table is printed last.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from gpu_suite import VARIANTS, flex_mods, pairs_allowed, sample_inputs  # noqa: E402

DEFAULT_VARIANTS = ("full", "causal", "causal_gqa", "sliding_window", "document", "bigbird",
                    "alibi", "softcap")
WINDOW = 1024  # gpu_suite's sliding window
CUDNN_TAKES = ("full", "causal", "causal_gqa")
# What FA4's flash_attn_func is given for each variant it takes (causal, window, softcap).
FA4_TAKES = {"full": dict(causal=False), "causal": dict(causal=True),
             "causal_gqa": dict(causal=True), "softcap": dict(causal=True, softcap=30.0),
             "sliding_window": dict(causal=True, window_size=(WINDOW - 1, 0))}
CHECK_LEN = 1024


def problem(name: str, L: int, dim: int, seed: int, batch: int | None = None, heads: int = 16):
    variant = attncc.parse(VARIANTS[name])
    hq, hkv = (variant.heads.q, variant.heads.kv) if variant.heads else (heads, heads)
    B = batch or max(1, 16384 // L)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, dim, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for h in (hq, hkv, hkv))
    inputs = sample_inputs(name, variant, B, hq, L, "cuda", gen)
    dout = torch.randn(B, hq, L, dim, generator=gen).to("cuda", torch.bfloat16)
    return variant, q, k, v, inputs, dout


def backends(name: str, variant, q, k, v, inputs) -> tuple:
    """({label: fn(q, k, v) -> out in (B, H, L, D), or the reason it cannot run}, attncc's
    kernel); each fn takes leaf tensors in attncc's layout, so every backend sees the
    same values."""
    gqa = q.shape[1] != k.shape[1]
    kernel = attncc.compile(variant)
    found = {"attncc": lambda q, k, v: kernel(q, k, v, **inputs),
             # deterministic=False: the fused Gluon backward where it takes the call
             # (kernel.last_backward says which ran), FA4's default's peer.
             "attncc det=False": lambda q, k, v: kernel(q, k, v, deterministic=False, **inputs)}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # Each variant, length and kernel_options compiles flex_attention again; past Dynamo's
    # recompile limit it would run eager flex_attention (unfused math, 40x slower, both
    # backends alike): start each variant afresh, and fail rather than time that.
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = 64
    if hasattr(torch._dynamo.config, "fail_on_cache_limit_hit"):
        torch._dynamo.config.fail_on_cache_limit_hit = True
    flex = torch.compile(flex_attention, dynamic=False)
    mask_mod, score_mod = flex_mods(name, variant, inputs, q.shape[1])
    L = q.shape[2]
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cuda") if mask_mod else None

    def flex_with(options):
        return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=gqa, kernel_options=options)
    found["Flex (Triton)"] = flex_with(None)
    try:
        import flash_attn.cute  # noqa: F401  (the FLASH backend's kernels)
        found["Flex FLASH"] = flex_with({"BACKEND": "FLASH"})
    except ImportError as err:
        found["Flex FLASH"] = f"FlashAttention-4 not installed ({err})"
    if name in FA4_TAKES:
        try:
            from flash_attn.cute import flash_attn_func

            def fa4_with(**options):
                def fa4(q, k, v):
                    # FA4 takes (B, L, H, D); the transposes are views, so the timed call
                    # copies nothing FA4 would not (its own contiguity handling).
                    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), **FA4_TAKES[name], **options)
                    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
                return fa4
            found["FA4"] = fa4_with()
            # attncc's backward is deterministic: FA4's deterministic mode is its peer there.
            found["FA4 det."] = fa4_with(deterministic=True)
        except ImportError as err:
            found["FA4"] = found["FA4 det."] = f"FlashAttention-4 not installed ({err})"
    else:
        found["FA4"] = found["FA4 det."] = "takes no such mask or score"
    if name in CUDNN_TAKES:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=name != "full",
                                                      enable_gqa=gqa)
        found["cuDNN"] = cudnn
    else:
        found["cuDNN"] = "takes no such mask or score"
    return found, kernel


def check(name: str, dim: int) -> dict:
    """Each backend's output and gradients on a 1024-token call against float64."""
    variant, q, k, v, inputs, dout = problem(name, CHECK_LEN, dim, seed=1, batch=1)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attncc.reference(variant, q64, k64, v64, **inputs)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    rows = {}
    for label, fn in backends(name, variant, q, k, v, inputs)[0].items():
        if isinstance(fn, str):
            continue
        try:
            out = fn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        except Exception as err:  # a backend refusing the call: say so, go on
            rows[label] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            continue
        errors = [((a.double() - b).norm() / b.norm()).item()
                  for a, b in zip((out, *grads), (ref, *ref_grads))]
        worst = max(errors) if all(math.isfinite(e) for e in errors) else math.nan
        rows[label] = {"rel_errors": errors, "ok": math.isfinite(worst) and worst < 2e-2}
    return rows


def host_and_kernels(call, calls: int = 20) -> dict:
    """What a do_bench median holds besides the kernels: the host time to issue one call
    (calls issued back to back, the GPU kept busy) and the GPU time of its kernels alone
    (torch.profiler). do_bench flushes the L2 before each call; host time beyond that
    flush shows as idle GPU time inside the measured window."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels_us = sum(e.self_device_time_total for e in events) / calls
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return {"host_us": host_us, "kernels_ms": kernels_us / 1e3,
            "kernels": sorted(((e.key[:80], e.self_device_time_total / calls, e.count / calls)
                               for e in events), key=lambda x: -x[1])}


def graph_forward_ms(call) -> float | str:
    """do_bench of the forward replayed from a CUDA graph: no host work in the window, the
    same L2 flush. Beside the eager median it says how much of that is the host."""
    import triton
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()  # warm: tuned, compiled, planned
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            call()
        return triton.testing.do_bench(graph.replay, return_mode="median")
    except Exception as err:  # a backend whose call cannot be captured
        return f"{type(err).__name__}: {str(err)[:160]}"


class ClockSampler:
    """The SM clock (MHz) and board power (W) NVML reads every 10 ms while a timing runs
    (read only: nothing is set). The card caps its power: a kernel that draws more runs
    at a lower clock for the whole timing, which a single profiled step does not show.
    `summary()` is None where NVML cannot be loaded."""

    def __init__(self):
        self.samples = []
        self._stop = threading.Event()
        self._nvml = _nvml()

    def __enter__(self):
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._nvml is not None:
            self._thread.join()

    def _run(self):
        lib, handle = self._nvml
        clock, milliwatts = ctypes.c_uint(), ctypes.c_uint()
        while not self._stop.wait(0.01):
            if (lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(clock)) == 0  # NVML_CLOCK_SM
                    and lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(milliwatts)) == 0):
                self.samples.append((clock.value, milliwatts.value / 1000))

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        return {"sm_mhz": statistics.median(c for c, _ in self.samples),
                "watts": statistics.median(w for _, w in self.samples),
                "samples": len(self.samples)}


@functools.cache
def _nvml():
    """(library, handle of the current device) through NVML's C API, or None."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        # NVML numbers the devices apart from CUDA (CUDA_VISIBLE_DEVICES): find ours by
        # its PCI address.
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        handle = ctypes.c_void_p()
        if hasattr(props, "pci_bus_id"):
            bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            found = lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(handle))
        else:  # an older torch: the first device, right on a machine of one
            found = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))
        return (lib, handle) if found == 0 else None
    except (OSError, AttributeError):
        return None


def gpu_state() -> str:
    """The SM clock, temperature, power and active clock-limit reasons as nvidia-smi reads
    them right after a backend's timings (read only; nothing is set), or why not."""
    query = "clocks.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        return (done.stdout or done.stderr).strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"{type(err).__name__}: {err}"


def backward_alone_ms(fn, q, k, v, dout, warmup: int = 5, reps: int = 50) -> float:
    """The backward alone, the median of `reps` timed calls: each iteration runs a forward
    untimed, flushes the L2 as do_bench does, then times autograd.grad between two CUDA
    events. A fresh graph each time, not one kept graph repeated: FlexAttention's
    compiled backward donates its buffers and refuses retain_graph."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    timed = []
    for i in range(warmup + reps):
        out = fn(q, k, v)
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(out, (q, k, v), dout)
        end.record()
        if i >= warmup:
            timed.append((start, end))
        del out
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in timed)


def time_variant(name: str, L: int, dim: int, rounds: int, kernel_times: bool, heads: int) -> dict:
    import triton
    variant, q, k, v, inputs, dout = problem(name, L, dim, seed=0, heads=heads)
    found, kernel = backends(name, variant, q, k, v, inputs)
    runnable = {label: fn for label, fn in found.items() if not isinstance(fn, str)}
    times = {label: {"fwd": [], "fwd_bwd": [], "bwd": [], "gpu": [], "clocks": []}
             for label in runnable}
    failed = {}
    labels = list(runnable)
    for r in range(rounds):
        # Each round starts one backend later: late in a round the GPU is warmer and may
        # clock lower, and no backend should always take the same place.
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            fn = runnable[label]
            if label in failed:
                continue
            try:
                with ClockSampler() as fwd_clock:
                    fwd = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
                both = triton.testing.do_bench(
                    lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), return_mode="median")
                with ClockSampler() as bwd_clock:
                    alone = backward_alone_ms(fn, q, k, v, dout)
            except Exception as err:
                failed[label] = f"{type(err).__name__}: {str(err)[:200]}"
                continue
            times[label]["fwd"].append(fwd)
            times[label]["fwd_bwd"].append(both)
            times[label]["bwd"].append(alone)
            times[label]["gpu"].append(gpu_state())
            times[label]["clocks"].append({"fwd": fwd_clock.summary(), "bwd": bwd_clock.summary()})
    pairs = pairs_allowed(variant, q.shape[0], q.shape[1], L, inputs, "cuda")
    row = {"variant": name, "len": L, "batch": q.shape[0], "heads": q.shape[1], "dim": dim,
           "pairs": pairs, "cells": {},
           # What the tuner chose for the timed call: the backend of each kernel role.
           "attncc_ran": {"fwd": kernel.last_backend, "bwd": kernel.last_backward}}
    for label, fn in found.items():
        if isinstance(fn, str) or label in failed:
            row["cells"][label] = {"error": fn if isinstance(fn, str) else failed[label]}
            continue
        fwd = statistics.median(times[label]["fwd"])
        bwd = statistics.median(times[label]["bwd"])
        row["cells"][label] = {"fwd_ms": fwd, "bwd_ms": bwd, "rounds": times[label],
                               "fwd_bwd_ms": statistics.median(times[label]["fwd_bwd"]),
                               "bwd_from_difference_ms":
                                   statistics.median(times[label]["fwd_bwd"]) - fwd,
                               "fwd_tflops": 4 * dim * pairs / fwd / 1e9 if pairs else None,
                               "bwd_tflops": 10 * dim * pairs / bwd / 1e9 if pairs else None}
        if kernel_times:
            row["cells"][label]["fwd_graph_ms"] = graph_forward_ms(lambda: fn(q, k, v))
            row["cells"][label]["fwd_parts"] = host_and_kernels(lambda: fn(q, k, v))
            row["cells"][label]["fwd_bwd_parts"] = host_and_kernels(
                lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))
    del q, k, v, dout
    torch.cuda.empty_cache()
    return row


# Issue 32's targets: (what, peer, the variants it names, the ratio to reach), a ratio
# being the peer's time / attncc's. attncc's backward is deterministic: against FA4's
# default (unordered) backward and, separately, its deterministic one.
TARGETS = (
    ("fwd", "attncc", "FA4", ("full", "causal", "causal_gqa", "sliding_window", "softcap"), 1.0),
    ("fwd", "attncc", "Flex FLASH", ("document", "bigbird", "alibi"), 1.05),
    ("bwd", "attncc det=False", "FA4", ("full", "causal", "causal_gqa", "sliding_window", "softcap"), 1.0),
    ("bwd", "attncc", "FA4 det.", ("full", "causal", "causal_gqa", "sliding_window", "softcap"), 1.0),
    ("bwd", "attncc det=False", "Flex FLASH", ("document", "bigbird", "alibi"), 1.05),
)


def targets(rows: list) -> str:
    """One line per target: each named variant's ratio, and whether it is met."""
    by_name = {r["variant"]: r["cells"] for r in rows}
    lines = []
    for part, own, peer, names, want in TARGETS:
        cells = []
        for name in names:
            a, c = by_name.get(name, {}).get(own, {}), by_name.get(name, {}).get(peer, {})
            if f"{part}_ms" not in a or f"{part}_ms" not in c:
                continue
            ratio = c[f"{part}_ms"] / a[f"{part}_ms"]
            cells.append(f"{name} {ratio:.2f}{'' if ratio >= want else ' (missed)'}")
        if cells:
            lines.append(f"{own} {part} ≥ {want:.2f}× {peer}: " + ", ".join(cells))
    return "\n".join(lines)


def _median_of(cell: dict, phase: str, what: str) -> str:
    """The median over rounds of a ClockSampler reading, or '?' where none was read."""
    found = [c[phase][what] for c in cell["rounds"].get("clocks", []) if c.get(phase)]
    return f"{statistics.median(found):.0f}" if found else "?"


def table(rows: list, checks: dict) -> str:
    peers = ("attncc det=False", "Flex (Triton)", "Flex FLASH", "FA4", "FA4 det.", "cuDNN")
    lines = [f"{'variant':16s} {'attncc fwd/bwd ms':>18s} | " + " | ".join(f"÷ {p:>13s}" for p in peers)
             + " | checks (1024 tokens vs float64)"]
    for r in rows:
        a = r["cells"]["attncc"]
        if "error" in a:
            lines.append(f"{r['variant']:16s} attncc failed: {a['error']}")
            continue
        cells = []
        for p in peers:
            c = r["cells"].get(p, {})
            cells.append(f"{c['fwd_ms'] / a['fwd_ms']:6.2f}/{c['bwd_ms'] / a['bwd_ms']:<6.2f}"
                         if "fwd_ms" in c else f"{'—':>15s}")
        verdict = ", ".join(f"{label} {'ok' if c.get('ok') else 'FAIL' if 'ok' in c else 'error'}"
                            for label, c in checks.get(r["variant"], {}).items())
        lines.append(f"{r['variant']:16s} {a['fwd_ms']:8.3f} / {a['bwd_ms']:<7.3f} | "
                     + " | ".join(f"{c:>15s}" for c in cells) + f" | {verdict}")
        # The spread over rounds: a ratio closer to 1 than this is not a measured difference.
        spread = [f"{label} {min(c['rounds']['fwd']):.3f}-{max(c['rounds']['fwd']):.3f} / "
                  f"{min(c['rounds']['bwd']):.3f}-{max(c['rounds']['bwd']):.3f}"
                  for label, c in r["cells"].items() if "rounds" in c]
        lines.append(f"{'':16s} rounds' fwd / bwd ms: " + "; ".join(spread))
        clocks = [f"{label} {_median_of(c, 'fwd', 'sm_mhz')} / {_median_of(c, 'bwd', 'sm_mhz')} "
                  f"MHz, {_median_of(c, 'fwd', 'watts')} / {_median_of(c, 'bwd', 'watts')} W"
                  for label, c in r["cells"].items() if "rounds" in c]
        lines.append(f"{'':16s} SM clock and power while timed, fwd / bwd: " + "; ".join(clocks))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16,
                    help="query heads of the variants without GQA (issue 32's D=64 case: 32 at 4096)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the 1024-token checks")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also each backend's host time per call and its kernels' GPU time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("training_speed.py times GPU kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    checks, rows = {}, []
    for name in names:
        if not args.no_check:
            checks[name] = check(name, args.dim)
        rows.append(time_variant(name, args.len, args.dim, args.rounds, args.kernel_times,
                                 args.heads))
        print(json.dumps({"variant": name, "check": checks.get(name),
                          "cells": {k: {x: y for x, y in c.items() if x != "rounds"}
                                    for k, c in rows[-1]["cells"].items()}}), flush=True)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "training_speed.json"), "w") as f:
        json.dump({"torch": torch.__version__, "triton": __import__("triton").__version__,
                   "gpu": torch.cuda.get_device_name(), "checks": checks, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, bf16, D={args.dim}, {args.heads} heads, "
          f"{args.len} tokens a row, {max(1, 16384 // args.len)} rows")
    print(table(rows, checks))
    print("\nissue 32's targets (the peer's time / attncc's):\n" + targets(rows))
    if args.kernel_times:
        print("\nper call: host µs to issue / kernels' GPU ms (forward replayed from a CUDA graph, "
              "do_bench ms), forward | forward + backward")
        for r in rows:
            graph = lambda c: (f"{c['fwd_graph_ms']:.3f}" if isinstance(c["fwd_graph_ms"], float)
                               else "no graph")
            parts = [f"{label} {c['fwd_parts']['host_us']:.0f}/{c['fwd_parts']['kernels_ms']:.3f} "
                     f"(graph {graph(c)}) | "
                     f"{c['fwd_bwd_parts']['host_us']:.0f}/{c['fwd_bwd_parts']['kernels_ms']:.3f}"
                     for label, c in r["cells"].items() if "fwd_parts" in c]
            print(f"{r['variant']:16s} " + "; ".join(parts))
            for name, us, count in r["cells"]["attncc"].get("fwd_bwd_parts", {}).get("kernels", []):
                print(f"    attncc fwd+bwd kernel {us:9.1f} µs x{count:g}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
