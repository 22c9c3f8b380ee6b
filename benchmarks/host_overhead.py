"""Host time per call: how long Python takes to issue one forward (and forward +
backward), where the GPU work is too small to hide it.

    python benchmarks/host_overhead.py [--seq 256] [--profile]
    python benchmarks/host_overhead.py --cpu [--gpt-oss-seq 1024] [--profile]   # no GPU

At low tile density a call's kernels can finish before the host has issued the next
call (RESULTS.md: the density curve's d = 0.03 row). This times N calls back to back
with one synchronisation at the end, on a short sequence, for attncc (an analytic mask
and a runtime layout), FlexAttention (torch.compile'd) and SDPA, and prints the
per-call microseconds beside the kernels' own GPU time per call (torch.profiler): where
the wall time is well above the GPU time, the host is the bound. --profile adds
cProfile's top entries (cumulative) for attncc's layout forward + backward on kept
tables (`attncc kept`), and for the first training shape's step below (gpt-oss), both
listings written to $OUT.
No kernel is tuned here: configs are pinned, so only the steady-state path is timed.
Then two training shapes on the default path (auto backend, shipped or tuned configs,
tuned in the warm-up calls): gpt-oss's sliding layers (B=1, 64/8 heads, D=64, a window
of 128 and learnable sinks, (batch, seq, heads, dim) tensors, `--gpt-oss-seq`) and a
16-head D=128 causal call of 1K tokens. For these the host time to issue a call (the
loop before its one synchronisation) is printed beside the wall time, and whether every
launch plan (attncc/runtime/call_plans.py) relaunches its compiled kernels directly.

--cpu (no GPU needed): the two training shapes' host time on this CPU, in float16 (the
interpreter refuses bfloat16; the host path does not read the dtype), the generated
modules' kernels replaced by stubs whose launch computes nothing (as
benchmarks/decode_host.py stubs decoding's), so what is timed is attncc's and PyTorch's
own per-call work: the call checks, the plan lookups, the autograd formula and engine,
the generated module's argument building, allocations and the launch through the kept
compiled kernel. Per shape: the forward without and with autograd recording, forward +
backward (the backward as the difference), the ATen ops a call dispatches (on a GPU
each one that is not a view or an allocation is a launch), and for a sink the share of
its gradient's passes over the rows, which a GPU computes and this CPU does. CPU time
of the process, the best of five runs; one intra-op thread; glibc keeps freed large
blocks as a GPU's caching allocator does. --profile adds cProfile's entries.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402

LAYOUT = "attention sparse { input blocks: bool[h, qb, kb] layout blocks[h, qb, kb] block 128 }"
CAUSAL = "attention causal { mask q >= k }"
CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def per_call_us(fn, n=200) -> float:
    return issue_and_wall_us(fn, n)[1]


def issue_and_wall_us(fn, n=200) -> tuple:
    """(µs per call to issue n calls back to back, µs per call until they finished)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - t0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6


GPT_OSS_SLIDING = """attention gpt_oss_sliding {
    heads 64 / 8
    learnable input sinks: f32[h]
    mask q >= k and q - k < 128
    sink sinks[h]
}"""


def training_shapes(seq: int, device="cuda", dtype=torch.bfloat16) -> dict:
    """{name: (kernel, forward(), the tensors taking gradients, dO)} of the two training
    shapes, on the default path."""
    bf16 = dict(device=device, dtype=dtype, requires_grad=True)
    q = torch.randn(1, seq, 64, 64, **bf16)
    k, v = (torch.randn(1, seq, 8, 64, **bf16) for _ in range(2))
    sinks = torch.randn(64, device=device, requires_grad=True)
    sliding = attncc.compile(GPT_OSS_SLIDING)
    q2, k2, v2 = (torch.randn(1, 16, 1024, 128, **bf16) for _ in range(3))
    causal = attncc.compile(CAUSAL)
    return {
        f"gpt-oss sliding {seq}": (sliding, lambda: sliding(q, k, v, layout="bshd", sinks=sinks),
                                   (q, k, v, sinks), torch.randn_like(q)),
        "causal 16x1K D128": (causal, lambda: causal(q2, k2, v2), (q2, k2, v2),
                              torch.randn_like(q2)),
    }


def relaunches_directly(kernel) -> str:
    """Whether every launch of the kernel's plans leaves Triton's JIT (runtime/launch.py)."""
    launches = [run for plan in kernel._call_plans.values() for run in plan.launches.kept.values()]
    direct = sum(run.compiled is not None for run in launches)
    return f"{len(kernel._call_plans)} plans, {direct}/{len(launches)} launches relaunched directly"


def _profile_to_out(fn, file_name: str) -> None:
    """cProfile of 200 calls of fn: the full listing (cumulative and own time) to $OUT's
    `file_name`, the top own-time entries here."""
    per_call_us(fn, 20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    with open(os.path.join(os.environ.get("OUT", "."), file_name), "w") as f:
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(60)
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def gpu_us(fn, iters=10) -> float:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters


class _StubCompiled:
    """Stands in for Triton's CompiledKernel: launching it computes nothing. A forward's
    stand-in (`fills`) zeroes the LSE it would write (its float32 [B, H, L] tensor, no
    input), as the kernel leaves it finite: a sink's gradient runs exp(σ - LSE) on the
    CPU here, and the exp of garbage (NaN, 1e30) costs the CPU 3-30x the exp of real
    values. The zeroing (~3 us at 64 heads x 1K) is counted: the harness errs slow."""
    function = 0
    packed_metadata = None
    counting = False  # set while ATen ops are counted: the zeroing is the harness's op

    def __init__(self, fills: bool):
        self.fills = fills
        self.floats = None  # the positions of the float32 tensors among a launch's arguments

    def run(self, *args):
        if not self.fills or _StubCompiled.counting:
            return
        if self.floats is None:  # a plan relaunches with the same argument kinds
            self.floats = [i for i, a in enumerate(args)  # the LSE, not a float32 input
                           if isinstance(a, torch.Tensor) and a.dtype == torch.float32
                           and a.dim() == 3]
        for i in self.floats:
            args[i].zero_()


class _StubKernel:
    """Stands in for a kernel of the generated module: `kernel[grid](...)` returns the stub
    compiled kernel, as Triton's JIT returns the CompiledKernel it launched, so a launch
    plan keeps it and relaunches it directly (runtime/launch.py) as on a GPU."""

    def __init__(self, name, real):
        self.arg_names = real.arg_names
        self.fills = name.startswith("attn_fwd")

    def __getitem__(self, grid):
        return lambda *args, **options: _StubCompiled(self.fills)


def _stub_launches(kernel) -> None:
    """Replace every kernel of the generated module (and the launcher's stream lookup) by
    stubs: what is timed is attncc's and PyTorch's host work, not the interpreter."""
    from attncc.runtime import launch
    module = kernel.module
    for name, value in list(vars(module).items()):
        if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
            setattr(module, name, _StubKernel(name, value))
    launch.current_stream = lambda device: 0
    launch.current_device = lambda: 0


def _best_us(fn, calls: int) -> float:
    """CPU µs per call, the best of five runs of `calls` calls. Other processes share this
    CPU: the process's CPU time (not the wall time, which counts the time they take) and
    the best run keep their share out."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls * 1e6)
    return best


def _torch_ops_per_call(fn, calls: int = 20) -> tuple:
    """(ATen ops, of which allocations) a call dispatches, by torch.profiler: on a GPU each
    op that is not a view or an allocation is a kernel launch of its own."""
    from torch.profiler import ProfilerActivity, profile
    _StubCompiled.counting = True
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    _StubCompiled.counting = False
    # Top-level ops only (an op's own children, as_strided under transpose, are its cost).
    events = [e for e in prof.events() if e.name.startswith("aten::") and
              (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    allocations = sum(e.name in ("aten::empty", "aten::empty_like", "aten::empty_strided")
                      for e in events)
    return len(events) / calls, allocations / calls


def _sink_passes_us(batch: int, heads: int, length: int) -> float:
    """CPU µs of the passes runtime/sinks.py makes over a call's rows for a sink's gradient
    (e^(σ - L)·delta, summed): the kernels' work on a GPU, run on the CPU in this harness."""
    sigma = torch.randn(1, heads, 1)
    lse, delta = torch.randn(batch, heads, length), torch.randn(batch, heads, length)
    return _best_us(lambda: torch.sub(sigma, lse).exp_().mul_(delta).sum(dim=[0, 2]), 200)


def _cache_large_blocks() -> None:
    """Let glibc's malloc keep freed large blocks for reuse, as PyTorch's CUDA allocator
    caches its blocks: by default it maps each block of 128 KB or more afresh and unmaps
    it when freed, so every output a call allocates (dq, the LSE, a sink's [B, H, L]
    rows) costs page faults on first touch, tens of µs a call that a GPU never pays."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameters (malloc.h)
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):
        pass  # not glibc: the times then include the page faults


def cpu_mode(seq: int, calls: int, profile: bool) -> None:
    """The two training shapes' host time on this CPU, launches stubbed (module docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"
    _cache_large_blocks()
    # One thread, denormals flushed: the few element-wise passes the host runs (a sink's
    # gradient) then cost what they would cost a GPU launch, roughly, and not what a
    # thread pool fighting other processes for two cores costs.
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    # float16: the interpreter refuses bfloat16, and the host path does not read the dtype.
    for name, (kernel, fn, grads, do) in training_shapes(seq, "cpu", torch.float16).items():
        _stub_launches(kernel)

        def training_step():
            # A backward needs a fresh graph: time forward + backward, and the backward as
            # the difference from a forward that records autograd.
            return torch.autograd.grad(fn(), grads, do)

        with torch.no_grad():
            inference = _best_us(fn, calls)
        forward = _best_us(fn, calls)
        both = _best_us(training_step, calls)
        ops_fwd, allocs_fwd = _torch_ops_per_call(fn)
        ops_both, allocs_both = _torch_ops_per_call(training_step)
        print(f"{name:22s} fwd {inference:6.1f} us (recording autograd {forward:6.1f})  "
              f"fwd+bwd {both:7.1f} us (bwd {both - forward:6.1f}); ATen ops per call "
              f"fwd {ops_fwd:.0f} ({allocs_fwd:.0f} allocations), fwd+bwd {ops_both:.0f} "
              f"({allocs_both:.0f}); {relaunches_directly(kernel)}", flush=True)
        if kernel.variant.sink is not None:
            batch, length, heads = grads[0].shape[:3]  # (batch, seq, heads, dim)
            passes = _sink_passes_us(batch, heads, length)
            print(f"{'':22s} of which a sink gradient's element-wise passes over the "
                  f"[B, H, L] rows (a GPU's, on this CPU): ~{passes:.0f} us", flush=True)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                training_step()
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(35)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gpt-oss-seq", type=int, default=4096)
    ap.add_argument("--cpu", action="store_true", help="the training shapes' host time on the "
                    "CPU, launches stubbed (no GPU needed)")
    ap.add_argument("--calls", type=int, default=500, help="--cpu: calls per timed run")
    args = ap.parse_args()
    if args.cpu:
        return cpu_mode(args.gpt_oss_seq, args.calls, args.profile)
    training = []
    shapes = training_shapes(args.gpt_oss_seq)
    first_training = next(iter(shapes.values()))
    for name, (kernel, fn, grads, do) in shapes.items():
        fwd_bwd = lambda: torch.autograd.grad(fn(), grads, do)
        with torch.no_grad():
            fwd = issue_and_wall_us(fn)
        both = issue_and_wall_us(fwd_bwd)
        training.append((name, *fwd, *both, gpu_us(fwd_bwd), relaunches_directly(kernel)))
        print("{:22s} fwd issue {:7.1f} wall {:7.1f} us  fwd+bwd issue {:7.1f} wall {:7.1f} us "
              "(GPU {:6.1f}); {}".format(*training[-1]), flush=True)
    S, H, D = args.seq, 16, 128
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    blocks = torch.rand(H, S // 128, S // 128, device="cuda") < 0.1
    blocks |= torch.eye(S // 128, dtype=torch.bool, device="cuda")
    layout = attncc.compile(LAYOUT, config=CONFIG)
    causal = attncc.compile(CAUSAL, config=CONFIG)
    kept = layout.tile_tables(q, k, v, blocks=blocks)  # the tables a model would keep
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, S, S, device="cuda")
    cases = {
        "attncc causal": lambda: causal(q, k, v),
        "attncc layout": lambda: layout(q, k, v, blocks=blocks),
        "attncc kept": lambda: layout(q, k, v, blocks=blocks, tables=kept),
        "flex causal": lambda: flex(q, k, v, block_mask=bm),
        "sdpa causal": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    rows = []
    for name, fn in cases.items():
        fwd_bwd = lambda: torch.autograd.grad(fn(), (q, k, v), do)
        row = (name, per_call_us(fn), gpu_us(fn), per_call_us(fwd_bwd), gpu_us(fwd_bwd))
        rows.append(row)
        print("{:15s} fwd {:7.1f} us (GPU {:6.1f})  fwd+bwd {:7.1f} us (GPU {:6.1f})".format(*row),
              flush=True)
    if args.profile:
        fn = lambda: torch.autograd.grad(layout(q, k, v, blocks=blocks, tables=kept), (q, k, v), do)
        _profile_to_out(fn, "host_profile.txt")
        # The first training shape's step too (gpt-oss): its backward is the issue's.
        _, gpt_oss, gpt_oss_grads, gpt_oss_do = first_training
        _profile_to_out(lambda: torch.autograd.grad(gpt_oss(), gpt_oss_grads, gpt_oss_do),
                        "host_profile_gpt_oss.txt")
    print(f"\nS={S} H={H} D={D} bf16, {torch.cuda.get_device_name()}: wall time per call "
          "(N calls, one sync) and the kernels' GPU time per call, microseconds")
    print("case             fwd wall   GPU   fwd+bwd wall   GPU")
    for name, fwd, fwd_gpu, both, both_gpu in rows:
        print(f"{name:15s} {fwd:8.1f} {fwd_gpu:6.1f}   {both:11.1f} {both_gpu:6.1f}")
    print("\nTraining shapes (default path, bf16): host µs to issue a call, wall µs per call")
    print("case                    fwd issue   wall   fwd+bwd issue   wall    GPU")
    for name, f_issue, f_wall, b_issue, b_wall, b_gpu, _ in training:
        print(f"{name:22s} {f_issue:10.1f} {f_wall:6.1f}   {b_issue:13.1f} {b_wall:6.1f} {b_gpu:6.1f}")


if __name__ == "__main__":
    main()
