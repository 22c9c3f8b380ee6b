"""Host time of one `kernel.decode` step (issue 32, item 5): the Python a call runs
before its kernels reach the GPU.

    python benchmarks/decode_host.py --cpu [--calls 2000] [--profile]
    python benchmarks/decode_host.py            # on a GPU

--cpu (no GPU needed): the decode step of causal attention, GQA 32/8, head dim 128,
bf16, one new token, at batch 1 x 128K and batch 8 x 32K, with the kernel launches
stubbed: the generated module's three decode kernels are replaced by objects whose
launch does nothing and whose "compiled kernel" runs nothing, so what is timed is
attncc's own per-call Python (checks, plan lookup, allocations, argument lists) and the
call into Triton's launcher, not the interpreter or a GPU. The tensors are CPU tensors
(TRITON_INTERPRET=1 lets the call checks accept them; the interpreter's fixed config is
used). --profile prints cProfile's top entries of the steady state.

GPU mode: the same two problems on the GPU, per step: eager (do_bench, L2 flushed
before each call, as benchmarks/decode.py times it), replayed in a CUDA graph
(do_bench_cudagraph), SDPA (flash-decoding through enable_gqa), and the host time per
call (200 calls back to back, timed before the one synchronisation at the end: above
the GPU time, the host is the bound); then one more step on new queries against SDPA
(max error below 5% of SDPA's largest value), which the plan runs on relaunched kernels. The issue's target: eager within 10% of the graph
replay; graph replay >= 1.0x SDPA.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SPEC = "attention causal { mask q >= k }"
HEADS, DIM, N_Q = (32, 8), 128, 1
PROBLEMS = [(1, 131072), (8, 32768)]


class _StubCompiled:
    """Stands in for Triton's CompiledKernel: launching it does nothing."""
    function = 0
    packed_metadata = None

    @staticmethod
    def run(*args):
        return None


class _StubKernel:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` returns the stub compiled
    kernel, as Triton's JIT returns the CompiledKernel it launched."""

    def __init__(self, real):
        self.arg_names = real.arg_names

    def __getitem__(self, grid):
        return lambda *args, **options: _StubCompiled()


def _stub_launches(kernel):
    """Replace the module's decode kernels (and the launcher's stream lookup) by stubs."""
    from attncc.runtime import launch
    module = kernel.module
    for name in ("decode_split", "decode_merge", "decode_append"):
        setattr(module, name, _StubKernel(getattr(module, name)))
    launch.current_stream = lambda device: 0
    launch.current_device = lambda: 0


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):  # the best of five runs: other processes share this CPU
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def cpu_mode(calls: int, profile: bool) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)
    import torch
    import attncc
    kernel = attncc.compile(SPEC)
    _stub_launches(kernel)
    for batch, length in PROBLEMS:
        q = torch.randn(batch, HEADS[0], N_Q, DIM, dtype=torch.bfloat16)
        k = torch.empty(batch, HEADS[1], length, DIM, dtype=torch.bfloat16)
        v = torch.empty_like(k)
        lens = torch.full((batch,), length - 1, dtype=torch.int32)
        k_new = torch.randn(batch, HEADS[1], 1, DIM, dtype=torch.bfloat16)
        v_new = torch.randn_like(k_new)
        step = lambda: kernel.decode(q, k, v, cache_seqlens=lens)
        append = lambda: kernel.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new)
        print(f"B={batch} x {length}: decode {_per_call_us(step, calls):6.1f} us/call, "
              f"with k_new/v_new appended {_per_call_us(append, calls):6.1f} us/call "
              f"(launches stubbed, CPU)", flush=True)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def gpu_mode(calls: int) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import triton.testing
    import attncc
    kernel = attncc.compile(SPEC)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; causal, heads "
          f"{HEADS[0]}/{HEADS[1]}, dim {DIM}, bf16, {N_Q} new token; ms per step")
    print(f"{'cache':>10} {'eager':>8} {'graph':>8} {'sdpa':>8} {'eager/graph':>12} "
          f"{'sdpa/graph':>11} {'host us/call':>13}")
    for batch, length in PROBLEMS:
        gen = torch.Generator().manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)
        q = mk(batch, HEADS[0], N_Q, DIM)
        k, v = mk(batch, HEADS[1], length, DIM), mk(batch, HEADS[1], length, DIM)
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        step = lambda: kernel.decode(q, k, v, cache_seqlens=lens)
        step()  # tunes on the first call
        torch.cuda.synchronize()
        eager = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
        graph = triton.testing.do_bench_cudagraph(step, rep=200, return_mode="median")
        sdpa_fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        sdpa = triton.testing.do_bench(sdpa_fn, warmup=25, rep=200, return_mode="median")
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = min(calls, 200)  # 400 launches: within the GPU's queue, so no launch waits
        for _ in range(n):
            step()
        host = (time.perf_counter() - t0) / n * 1e6  # before the sync: issue time only
        torch.cuda.synchronize()
        # The plan's relaunch on new values (the kernels relaunched without the JIT) against
        # SDPA over the whole cache: a stale argument would show here.
        q.copy_(mk(batch, HEADS[0], N_Q, DIM))
        ref = sdpa_fn().float()
        error = ((step().float() - ref).abs().max() / ref.abs().max()).item()
        assert error < 0.05, f"decode differs from SDPA by {error:.3g} of its largest value"
        print(f"{batch:>3} x {length:<6} {eager:8.4f} {graph:8.4f} {sdpa:8.4f} "
              f"{eager / graph:12.3f} {sdpa / graph:11.3f} {host:13.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="stubbed launches, no GPU")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="--cpu: cProfile's top entries")
    args = ap.parse_args()
    cpu_mode(args.calls, args.profile) if args.cpu else gpu_mode(args.calls)


if __name__ == "__main__":
    main()
