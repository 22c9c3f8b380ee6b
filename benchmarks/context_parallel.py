"""Context parallelism on several GPUs against one GPU on the same sequence.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc_per_node=2 benchmarks/context_parallel.py [--len 131072] [--scheme zigzag]

Causal attention, bf16, head dim 128, 16 heads, batch 1 by default. Rank 0 first runs
the whole sequence alone on its GPU (the others wait), then every rank runs its shard
with attncc.distributed.context_parallel_attention; each is timed forward and forward +
backward (median of --iters after warm-up, the same inputs throughout; a context-parallel
iteration is timed from a barrier to the last rank's end). Speed-up = one GPU's time /
the group's; efficiency = speed-up / GPUs. Also timed: one hop's transfers alone (the
keys and values of a shard; the fp32 dK/dV returned), to compare with the compute they
overlap.

Correctness first, on every rank count: at --check-len tokens, causal, sliding window,
document mask, a block layout and dropout, forward and gradients of the gathered
result against the float64 reference with the tolerance rule (attncc/semantics/tolerance.py); at
the timed length, the gathered causal result against the single-GPU kernel's.

Configs: the tuner picks tiles per length bucket on first use (about 30 s at these
lengths; the pieces' calls are tuned at the piece length, the single GPU at the whole
length); pin one with ATTNCC_CONFIG='{...}'. The configs used are printed and saved.
Without CUDA (a smoke test of this script), it runs with gloo under the Triton
interpreter at a tiny shape: `torchrun --nproc_per_node=2 benchmarks/context_parallel.py`.

Results: a table on stdout (rank 0) and $OUT/context_parallel.json.
"""
import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
import torch.distributed as dist  # noqa: E402

LAYOUT_BLOCK = 128 if torch.cuda.is_available() else 16  # the CPU smoke test's pieces are 16 long

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc import distributed as cp
from attncc.runtime import tuning
from attncc.semantics.reference import scale_value
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

SPECS = {
    "causal": "attention causal { mask q >= k }",
    "sliding_window": "attention sliding_window { param window: int = 1024  "
                      "mask q >= k and q - k < window }",
    "document": "attention document { input doc_q: i32[q]  input doc_k: i32[k]  "
                "mask doc_q[q] == doc_k[k] and q >= k }",
    "layout": "attention band { input extra: bool[qb, kb]  mask q >= k  "
              "layout abs(qb - kb) <= 1 or kb == 0 or extra[qb, kb]  block %d }" % LAYOUT_BLOCK,
    "dropout": "attention drop { mask q >= k  dropout 0.1 }",
}


def setup():
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        # Long timeout: the other ranks wait while rank 0 runs (and tunes) the one-GPU case.
        timeout = datetime.timedelta(minutes=30)
        try:  # eager communicator: later P2P batches may then involve a subset of ranks
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        except TypeError:
            dist.init_process_group("nccl", timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    dist.barrier()
    return rank, world, device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def inputs_for(name, S, device, gen):
    if name == "document":
        doc = torch.sort(torch.randint(0, 8, (S,), generator=gen)).values.to(torch.int32)
        return {"doc_q": doc.to(device), "doc_k": doc.to(device)}
    if name == "layout":
        n = S // LAYOUT_BLOCK
        return {"extra": (torch.rand(n, n, generator=gen) < 0.1).to(device)}
    return {}


def check(name, sharding, scheme, S, H, D, dtype, device):
    """CP forward and gradients, gathered, against the float64 reference (rank 0)."""
    variant = attncc.parse(SPECS[name])
    kernel = attncc.compile(variant)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, H, S, D, generator=gen).to(device, dtype) for _ in range(4))
    inputs = inputs_for(name, S, device, gen)
    local = [sharding.shard(t).detach().requires_grad_() for t in (q, k, v)]
    seed = dict(dropout_seed=5) if variant.dropout else {}  # refused without dropout
    out, lse = cp.context_parallel_attention(kernel, *local, scheme=scheme, return_lse=True,
                                             **seed, **inputs)
    out.backward(sharding.shard(do))
    got = [sharding.unshard(t) for t in (out.detach(), lse, *(t.grad for t in local))]
    if sharding.rank != 0:
        return None
    results = {}

    def run(dt):
        qkv = [t.to(dt).requires_grad_() for t in (q, k, v)]
        o, l = attncc.reference(variant, *qkv, return_lse=True, **seed, **inputs)
        return [o, l, *torch.autograd.grad(o, qkv, do.to(dt))]
    ref, eager = run(torch.float64), run(dtype)
    scales = gradient_scales(q, k, ref[0], do, scale_value(variant, D), 1)
    ok = True
    for label, g, r, e in zip(["out", "lse", "dq", "dk", "dv"], got, ref, eager):
        err, err_eager = max_abs_error(g, r), max_abs_error(e, r)
        passed = within_tolerance(err, err_eager, dtype, r, scales.get(label, 1.0))
        ok &= passed
        results[label] = dict(error=err, eager_error=err_eager, passed=passed)
    print(f"check {name:15s} S={S} {scheme}: {'pass' if ok else 'FAIL'} "
          + " ".join(f"{n} {r['error']:.2g}/{r['eager_error']:.2g}" for n, r in results.items()),
          flush=True)
    return dict(variant=name, passed=ok, **results)


def _as_json(chosen):
    """A tuner's choice (tuning._MEMORY's value: a Choice, a TileConfig, or a decode
    config's dict) as JSON."""
    if isinstance(chosen, tuning.Choice):
        return chosen.to_json()
    return chosen.as_dict() if hasattr(chosen, "as_dict") else chosen


def timed(fn, iters, device, world_group=True):
    """Median seconds of fn() over iters, each started together on every rank (barrier)
    and ended when the slowest rank ends."""
    times = []
    for _ in range(iters):
        if world_group:
            dist.barrier()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], device=device)
        if world_group:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser()
    gpu = torch.cuda.is_available()
    ap.add_argument("--len", type=int, default=131072 if gpu else 64)
    ap.add_argument("--heads", type=int, default=16 if gpu else 2)
    ap.add_argument("--dim", type=int, default=128 if gpu else 16)
    ap.add_argument("--scheme", default="zigzag", choices=cp.SCHEMES)
    ap.add_argument("--iters", type=int, default=10 if gpu else 2)
    ap.add_argument("--warmup", type=int, default=3 if gpu else 1)
    ap.add_argument("--check-len", type=int, default=4096 if gpu else 64)
    ap.add_argument("--check-heads", type=int, default=4 if gpu else 2)
    ap.add_argument("--no-single", action="store_true", help="skip the one-GPU run")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile one context-parallel forward and forward + "
                         "backward (rank 0's kernels, CUDA time per kernel name)")
    args = ap.parse_args()
    rank, world, device = setup()
    # The tuner's progress (logged at INFO where attncc logs, printed where it prints).
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(name)s: %(message)s")
    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter mis-multiplies bf16
    sharding = cp.Sharding.of(None, args.scheme)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"{world} ranks on {torch.cuda.get_device_name() if gpu else 'CPU (interpreter)'}; "
        f"torch {torch.__version__}; ATTNCC_CONFIG={os.environ.get('ATTNCC_CONFIG')}")

    checks = [check(name, sharding, args.scheme, args.check_len, args.check_heads, args.dim,
                    dtype, device) for name in SPECS]

    S, H, D = args.len, args.heads, args.dim
    kernel = attncc.compile(SPECS["causal"])
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, H, S, D, generator=gen).to(device, dtype) for _ in range(4))
    pairs = S * (S + 1) / 2 * H
    flops_fwd, flops_bwd = 4 * D * pairs, 2.5 * 4 * D * pairs
    result = dict(len=S, heads=H, dim=D, dtype=str(dtype), world=world, scheme=args.scheme,
                  device=torch.cuda.get_device_name() if gpu else "cpu",
                  torch=torch.__version__, attncc_config=os.environ.get("ATTNCC_CONFIG"),
                  checks=[c for c in checks if c])

    # One GPU: the whole sequence on rank 0.
    single = {}
    if not args.no_single:
        if rank == 0:
            qkv = [t.clone().requires_grad_() for t in (q, k, v)]

            def fwd():
                with torch.no_grad():
                    kernel(*qkv)

            def fwd_bwd():
                torch.autograd.grad(kernel(*qkv), qkv, do)
            for _ in range(args.warmup):
                fwd_bwd()
            single["fwd"] = timed(fwd, args.iters, device, world_group=False)
            single["fwd_bwd"] = timed(fwd_bwd, args.iters, device, world_group=False)
            out_single, lse_single = kernel(*qkv, return_lse=True)
            grads_single = torch.autograd.grad(out_single, qkv, do)
            single_results = [out_single.detach(), lse_single, *grads_single]
            result["single_gpu_forward_backend"] = kernel.last_backend
            say(f"one GPU: forward {single['fwd'][0] * 1e3:.2f} ms, "
                f"forward+backward {single['fwd_bwd'][0] * 1e3:.2f} ms; forward backend "
                f"{kernel.last_backend}")
        dist.barrier()

    # Context parallel: each rank its shard.
    local = [sharding.shard(t).detach().requires_grad_() for t in (q, k, v)]
    do_local = sharding.shard(do)

    def cp_fwd():
        with torch.no_grad():
            cp.context_parallel_attention(kernel, *local, scheme=args.scheme)

    def cp_fwd_bwd():
        out = cp.context_parallel_attention(kernel, *local, scheme=args.scheme)
        torch.autograd.grad(out, local, do_local)
    for _ in range(args.warmup):
        cp_fwd_bwd()
    parallel = {"fwd": timed(cp_fwd, args.iters, device),
                "fwd_bwd": timed(cp_fwd_bwd, args.iters, device)}
    # Which forward the pieces ran (the last pair's; every pair decides alike).
    result["pieces_forward_backend"] = kernel.last_backend
    say(f"context-parallel pieces: forward backend {kernel.last_backend}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for name, fn in (("forward", cp_fwd), ("forward + backward", cp_fwd_bwd)):
            dist.barrier()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
            with profile(activities=activities) as prof:
                fn()
                sync(device)
            table = prof.key_averages().table(
                sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=14,
                max_name_column_width=60)
            say(f"\nprofile of one context-parallel {name} (rank 0):\n{table}")

    # Against the single GPU at the timed length.
    out, lse = cp.context_parallel_attention(kernel, *local, scheme=args.scheme, return_lse=True)
    grads = torch.autograd.grad(out, local, do_local)
    gathered = [sharding.unshard(t) for t in (out.detach(), lse, *grads)]
    if rank == 0 and single:
        result["max_abs_diff_from_single_gpu"] = {
            n: max_abs_error(g, s) for n, g, s in zip(["out", "lse", "dq", "dk", "dv"], gathered,
                                                       single_results)}
        say("largest difference from the single-GPU kernel: " + ", ".join(
            f"{n} {e:.3g}" for n, e in result["max_abs_diff_from_single_gpu"].items()))

    # One hop's transfers alone: keys and values of a shard (bf16) and dK/dV (fp32).
    def exchange(tensors):
        peer_send, peer_recv = (rank + 1) % world, (rank - 1) % world
        ops = [dist.P2POp(dist.isend, t, peer_send) for t in tensors]
        ops += [dist.P2POp(dist.irecv, torch.empty_like(t), peer_recv) for t in tensors]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    transfer = {}
    if world > 1:
        kv = [local[1].detach(), local[2].detach()]
        dkdv = [t.float() for t in kv]
        exchange(kv)
        transfer["keys"] = timed(lambda: exchange(kv), args.iters, device)
        transfer["dkdv"] = timed(lambda: exchange(dkdv), args.iters, device)

    # The tuner's choices in this process (empty when ATTNCC_CONFIG pins one).
    result["configs"] = {"-".join(map(str, key[1:])): _as_json(choice)
                         for key, choice in tuning._MEMORY.items()}
    result["single_gpu_s"] = {n: dict(median=m, all=t) for n, (m, t) in single.items()}
    result["context_parallel_s"] = {n: dict(median=m, all=t) for n, (m, t) in parallel.items()}
    result["one_hop_transfer_s"] = {n: dict(median=m, all=t) for n, (m, t) in transfer.items()}
    if rank == 0:
        say(f"\nconfigs used: {json.dumps(result['configs'])}")
        say(f"\ncausal, {S} tokens, {H} heads, head dim {D}, {dtype}, {args.scheme} over {world} ranks")
        say("| pass | 1 GPU ms | TFLOP/s | %d GPUs ms | TFLOP/s per GPU | speed-up | efficiency |" % world)
        say("|---|---|---|---|---|---|---|")
        for n, flops in (("fwd", flops_fwd), ("fwd_bwd", flops_fwd + flops_bwd)):
            t_cp = parallel[n][0]
            row = f"| {n} |"
            if single:
                t1 = single[n][0]
                speedup = t1 / t_cp
                result.setdefault("speedup", {})[n] = speedup
                result.setdefault("efficiency", {})[n] = speedup / world
                row += f" {t1 * 1e3:.1f} | {flops / t1 / 1e12:.0f} |"
            else:
                row += " — | — |"
            row += f" {t_cp * 1e3:.1f} | {flops / t_cp / world / 1e12:.0f} |"
            row += (f" {result['speedup'][n]:.2f}x | {result['efficiency'][n]:.2f} |" if single
                    else " — | — |")
            say(row)
        for n, (m, _) in transfer.items():
            what = f"k, v in {dtype}" if n == "keys" else "dK, dV in fp32"
            say(f"one hop's transfer alone ({what}): {m * 1e3:.2f} ms")
        failed = [c["variant"] for c in result["checks"] if not c["passed"]]
        say(f"checks: {len(result['checks']) - len(failed)} of {len(result['checks'])} pass"
            + (f"; FAILED: {failed}" if failed else ""))
        out_dir = os.environ.get("OUT", "out")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "context_parallel.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
