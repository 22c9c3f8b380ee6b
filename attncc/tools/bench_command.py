"""`attncc bench`: forward and backward timed against SDPA (flash, cuDNN) and FlexAttention
on the same inputs (CUDA only), with TFLOP/s counted over the allowed pairs.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .. import ir, load
from ..errors import AttnccError, NoGPUError
from ..arguments import Problem
from .density import dense_allowed
from ..semantics.samples import default_heads, sample_inputs
from .flex import flex_mods, sdpa_expressible, variant_uses

MAX_BENCH_EXACT_LEN = 16384       # `bench`: exact pair counts up to this length, sampled beyond
BENCH_SAMPLE_SIDE = 8192          # `bench`: beyond it, pairs counted on a strided grid this wide


def attention_flops(pairs_per_head: float, batch: int, heads: int, dim: int) -> dict:
    """FLOPs over attending pairs: 4·B·H·D·pairs forward (two matmuls), 2.5× that backward."""
    fwd = 4.0 * batch * heads * dim * pairs_per_head
    return {"fwd": fwd, "bwd": 2.5 * fwd}


def pairs_per_head(variant: ir.Variant, p: Problem, inputs: dict, device) -> tuple:
    """(allowed (q, k) pairs per batch·head, exact?) — dense up to MAX_BENCH_EXACT_LEN,
    else estimated on an evenly strided grid of at most BENCH_SAMPLE_SIDE² positions."""
    from ..semantics.reference import index_env, layout_grid
    from ..semantics.evaluate import evaluate
    n = max(p.len_q, p.len_k)
    p1 = Problem(1, p.heads_q, p.heads_kv, p.len_q, p.len_k, p.dim, p.dim_v, p.q_offset, p.k_offset)
    ins = {name: t[:1] if variant.input(name).axes[:1] == ("b",) else t for name, t in inputs.items()}
    if n <= MAX_BENCH_EXACT_LEN:
        a = dense_allowed(variant, p1, ins, device)
        return a.float().sum().item() / (a.shape[0] * a.shape[1]), True
    stride = math.ceil(n / BENCH_SAMPLE_SIDE)
    env = index_env(variant, p1, ins, device, torch.float64)
    env["q"] = torch.arange(0, p.len_q, stride, device=device).view(1, 1, -1, 1) + p.q_offset
    env["k"] = torch.arange(0, p.len_k, stride, device=device).view(1, 1, 1, -1) + p.k_offset
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    if variant.mask is not None:
        allowed = allowed & evaluate(variant.mask, env)
    if variant.layout is not None:
        grid = layout_grid(variant, p1, ins, device)
        allowed = allowed & grid[:, :, (env["q"] // variant.block).view(-1)][
            :, :, :, (env["k"] // variant.block).view(-1)]
    shape = torch.broadcast_shapes(allowed.shape, (1, 1, env["q"].shape[2], env["k"].shape[3]))
    density = allowed.expand(shape).float().mean().item()
    return density * p.len_q * p.len_k, False


def _time(fn) -> float:
    """Median milliseconds of fn over triton's do_bench (it warms up and flushes the L2)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bench_backend(make_call, q, k, v, learn, dout):
    """(fwd ms, fwd+bwd ms) of make_call() -> out."""
    wrt = [q, k, v] + learn

    def both():
        torch.autograd.grad(make_call(), wrt, dout)
    both()  # compile, autotune and cache outside the timed region
    torch.cuda.synchronize()
    return _time(make_call), _time(both)


def bench_backends(variant, kernel, *, n: int, batch: int, heads: tuple, dim: int, seed: int = 0):
    """{backend: {"fwd_ms", "fwdbwd_ms", "bwd_ms"} or {"skipped": reason}} at one length."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hkv = heads
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h, L: torch.randn(batch, h, L, dim, generator=gen).to(dev, dtype).requires_grad_()
    q, k, v = mk(hq, n), mk(hkv, n), mk(hkv, n)
    dout = torch.randn(batch, hq, n, dim, generator=gen).to(dev, dtype)
    p = Problem(batch, hq, hkv, n, n, dim, dim)
    inputs = sample_inputs(variant, p, seed=seed, device=dev)
    learnable = {d.name for d in variant.learnable_inputs}
    for name in learnable:
        inputs[name].requires_grad_()
    learn = [inputs[name] for name in sorted(learnable)]
    results = {}

    def record(name, fn):
        try:
            fwd, both = _bench_backend(fn, q, k, v, learn, dout)
            results[name] = {"fwd_ms": fwd, "fwdbwd_ms": both, "bwd_ms": both - fwd}
        except Exception as err:  # a backend that cannot run this shape is reported, not fatal
            results[name] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}

    seed_kw = {"dropout_seed": 1} if variant.dropout else {}
    record("attncc", lambda: kernel(q, k, v, layout="bhsd", **seed_kw, **inputs))

    from ..semantics.reference import scale_value
    scale = scale_value(variant, dim)
    sdpa = sdpa_expressible(variant, n, n)
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        if sdpa is None:
            results[name] = {"skipped": "not expressible in SDPA (only no mask, or causal with len_q == len_k)"}
            continue

        def call(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=hq != hkv, **sdpa)
        record(name, call)

    if variant.dropout:
        results["flex"] = {"skipped": "FlexAttention has no attention dropout"}
    elif variant.normalize != "softmax":
        results["flex"] = {"skipped": f"FlexAttention normalises by softmax only, not `normalize "
                                      f"{variant.normalize}`: bench the same mask without it "
                                      "for the softmax baseline"}
    else:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            mask_mod, score_mod = flex_mods(variant, len_q=n, len_k=n, dim=dim, inputs=inputs)
            flex = torch.compile(flex_attention)
            block_mask = None
            if mask_mod is not None:  # built once, outside the timed region
                block_mask = create_block_mask(mask_mod, batch if variant_uses(variant, "b") else None,
                                               hq if variant_uses(variant, "h") else None, n, n,
                                               device=dev)
            if variant.sink is None:
                record("flex", lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                            scale=scale, enable_gqa=hq != hkv))
            else:
                # FlexAttention has no sink in its softmax: transformers' FlexAttention path
                # for gpt-oss renormalises its output with the returned LSE, as here.
                from ..runtime.sinks import sinks_at

                def flex_with_sink():
                    out, lse = flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=scale, enable_gqa=hq != hkv, return_lse=True)
                    sink = sinks_at(variant, p, inputs, dev)
                    return out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
                record("flex", flex_with_sink)
        except Exception as err:
            results["flex"] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    pairs, exact = pairs_per_head(variant, p, inputs, dev)
    flops = attention_flops(pairs, batch, hq, dim)
    for r in results.values():
        if "fwd_ms" in r:
            r["fwd_tflops"] = flops["fwd"] / (r["fwd_ms"] * 1e-3) / 1e12
            r["bwd_tflops"] = flops["bwd"] / (r["bwd_ms"] * 1e-3) / 1e12 if r["bwd_ms"] > 0 else math.nan
    meta = {"len": n, "batch": batch, "heads_q": hq, "heads_kv": hkv, "dim": dim,
            "pairs_per_head": pairs, "pairs_exact": exact, "flops_fwd": flops["fwd"],
            "flops_bwd": flops["bwd"]}
    return meta, results


def format_bench(meta: dict, results: dict) -> str:
    pairs = f"{meta['pairs_per_head']:.4g} pairs/head" + ("" if meta["pairs_exact"] else " (estimated)")
    lines = [f"len {meta['len']}, batch {meta['batch']}, heads {meta['heads_q']}/{meta['heads_kv']}, "
             f"dim {meta['dim']}, bfloat16, {pairs}",
             f"  {'backend':<11} {'fwd ms':>8} {'fwd TF/s':>9} {'bwd ms':>8} {'bwd TF/s':>9} "
             f"{'attncc/other fwd':>17} {'bwd':>6}"]
    mine = results.get("attncc", {})
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"  {name:<11} skipped: {r['skipped']}")
            continue
        # Speed ratio: how many times faster attncc is (the other's time over attncc's).
        rf = f"{r['fwd_ms'] / mine['fwd_ms']:.2f}x" if "fwd_ms" in mine else "-"
        rb = f"{r['bwd_ms'] / mine['bwd_ms']:.2f}x" if "bwd_ms" in mine and mine["bwd_ms"] > 0 else "-"
        lines.append(f"  {name:<11} {r['fwd_ms']:>8.3f} {r['fwd_tflops']:>9.1f} {r['bwd_ms']:>8.3f} "
                     f"{r['bwd_tflops']:>9.1f} {rf:>17} {rb:>6}")
    return "\n".join(lines)


def plot_bench(path, variant_name: str, runs: list):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    backends = sorted({b for _, res in runs for b, r in res.items() if "fwd_ms" in r},
                      key=lambda b: (b != "attncc", b))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(backends))
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
        for i, b in enumerate(backends):
            ys = [res.get(b, {}).get(key, 0.0) for _, res in runs]
            ax.bar([x + i * width for x in range(len(runs))], ys, width, label=b)
        ax.set_xticks([x + width * (len(backends) - 1) / 2 for x in range(len(runs))])
        ax.set_xticklabels([str(m["len"]) for m, _ in runs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s (allowed pairs)")
        ax.set_title(f"{variant_name}: {title}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_command(args) -> int:
    variant = load(args.spec)  # a bad spec is named first, on any machine
    if args.plot:
        from .extras import require_plotting
        require_plotting()
    if not torch.cuda.is_available():
        raise NoGPUError("attncc bench needs a CUDA GPU; none was found")
    import attncc
    if args.heads is not None:
        heads = args.heads
        if variant.heads is not None and heads != (variant.heads.q, variant.heads.kv):
            raise AttnccError(f"--heads {heads[0]}/{heads[1]} differs from the variant's declared "
                              f"heads {variant.heads.q}/{variant.heads.kv}")
    else:
        heads = default_heads(variant, 16)
    kernel = attncc.compile(variant)
    print(f"{variant.name}: {kernel.strategy}; {torch.cuda.get_device_name()}")
    runs = []
    for n in args.len:
        batch = max(1, 16384 // n)
        meta, results = bench_backends(variant, kernel, n=n, batch=batch, heads=heads, dim=args.dim)
        runs.append((meta, results))
        print(format_bench(meta, results))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"variant": variant.name, "device": torch.cuda.get_device_name(),
             "runs": [{**m, "backends": r} for m, r in runs]}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_bench(args.plot, variant.name, runs)
        print(f"wrote {args.plot}")
    return 0
