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
from ..semantics.samples import default_heads, sample_inputs
from .flex import flex_mods, sdpa_expressible, variant_uses

# Pairs are counted exactly, a block of query rows at a time: at most this many (q, k)
# cells per block, so a 64K-token count holds a few hundred MB, not 4G cells. (A strided
# sample had counted `(q - k) % 4 == 0` 4x over at a stride of 4.)
PAIRS_PER_BLOCK = 2 ** 26


def attention_flops(pairs_per_head: float, batch: int, heads: int, dim: int) -> dict:
    """FLOPs over attending pairs: 4·B·H·D·pairs forward (two matmuls), 2.5× that backward."""
    fwd = 4.0 * batch * heads * dim * pairs_per_head
    return {"fwd": fwd, "bwd": 2.5 * fwd}


def pairs_per_head(variant: ir.Variant, p: Problem, inputs: dict, device) -> float:
    """Allowed (q, k) pairs per batch·head (the first batch row's inputs), exact."""
    from ..semantics.reference import allowed_pairs
    ins = {name: t[:1] if variant.input(name).axes[:1] == ("b",) else t for name, t in inputs.items()}
    rows = max(1, PAIRS_PER_BLOCK // max(1, p.len_k))
    total, heads = 0, 1
    for start in range(0, p.len_q, rows):
        block = Problem(1, p.heads_q, p.heads_kv, min(rows, p.len_q - start), p.len_k, p.dim,
                        p.dim_v, p.q_offset + start, p.k_offset)
        a = allowed_pairs(variant, block, ins, device, len_q=p.len_q)
        a = a.expand(*a.shape[:2], block.len_q, block.len_k)
        heads = a.shape[0] * a.shape[1]
        total += a.sum().item()
    return total / heads


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

    def record(name, fn, wrt=learn):
        try:
            fwd, both = _bench_backend(fn, q, k, v, wrt, dout)
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
                # σ is evaluated once, outside the timed region: evaluating the sink's
                # expression on every call (attncc's evaluator, a score of tensor ops) had
                # slowed Flex's row 6x at 1K tokens. So Flex takes no gradient for an input
                # only the sink reads; every other gradient is timed as attncc's is.
                from ..runtime.sinks import sinks_at
                sink = sinks_at(variant, p, inputs, dev).detach()
                elsewhere = set().union(*(ir.loaded_tensors(e) for e in
                                          (variant.mask, variant.score, variant.weight)
                                          if e is not None))
                flex_learn = [inputs[n] for n in sorted(learnable) if n in elsewhere]

                def flex_with_sink():
                    out, lse = flex(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=scale, enable_gqa=hq != hkv, return_lse=True)
                    return out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
                record("flex", flex_with_sink, flex_learn)
        except Exception as err:
            results["flex"] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    pairs = pairs_per_head(variant, p, inputs, dev)
    flops = attention_flops(pairs, batch, hq, dim)
    for r in results.values():
        if "fwd_ms" in r:
            r["fwd_tflops"] = flops["fwd"] / (r["fwd_ms"] * 1e-3) / 1e12
            r["bwd_tflops"] = flops["bwd"] / (r["bwd_ms"] * 1e-3) / 1e12 if r["bwd_ms"] > 0 else math.nan
    meta = {"len": n, "batch": batch, "heads_q": hq, "heads_kv": hkv, "dim": dim,
            "pairs_per_head": pairs, "flops_fwd": flops["fwd"],
            "flops_bwd": flops["bwd"]}
    return meta, results


def format_bench(meta: dict, results: dict) -> str:
    pairs = f"{meta['pairs_per_head']:.4g} pairs/head"
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
