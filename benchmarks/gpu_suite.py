"""GPU suite: correctness in bf16/fp16 against the float64 reference, then timings of the
ANCHORS.md variant set against FlexAttention and SDPA, in one call.

    python benchmarks/gpu_suite.py --part correctness
    python benchmarks/gpu_suite.py --part speed [--lens 4096,16384] [--flex]

Writes full results as JSON to $OUT (or ./out) and prints a short table last.
Timing follows the device method: warm-up, median of many (triton.testing.do_bench),
the same inputs for every backend, 16 heads, head dim 128, batch x seq = 16384 tokens.
TFLOP/s count only allowed (q, k) pairs: 4*B*H*D*pairs forward, 2.5x that backward.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc import ir
from attncc.semantics.reference import allowed_pairs
from attncc.arguments import Problem
from attncc.semantics.tolerance import gradient_scales, within_tolerance

OUT = os.environ.get("OUT", "out")

# The ANCHORS.md variants, in the language.
VARIANTS = {
    "full": "attention full { }",
    "causal": "attention causal { mask q >= k }",
    "causal_gqa": "attention causal_gqa { heads 32 / 8 mask q >= k }",
    "sliding_window": "attention sliding { param window: int = 1024 mask q >= k and q - k < window }",
    "document": "attention document { input doc: i32[q] input doc_k: i32[k] mask doc[q] == doc_k[k] and q >= k }",
    "bigbird": ("attention bigbird { input random_blocks: bool[qb, kb] "
                "layout abs(qb - kb) <= 1 or qb == 0 or kb == 0 or random_blocks[qb, kb] block 128 }"),
    "alibi": "attention alibi { input slopes: f32[h] mask q >= k score s + slopes[h] * (k - q) }",
    "softcap": "attention softcap { mask q >= k score 30.0 * tanh(s / 30.0) }",
    # The BigBird pattern given wholly as one runtime tensor (issue 18's last target).
    "bigbird_tensor": ("attention bigbird_tensor { input blocks: bool[qb, kb] "
                       "layout blocks[qb, kb] block 128 }"),
}


def sample_inputs(name, variant, B, H, L, device, gen):
    if name == "document":
        # 8 documents of random lengths, the same split for every batch row.
        cuts = torch.sort(torch.randperm(L - 1, generator=gen)[:7] + 1)[0]
        doc = torch.zeros(L, dtype=torch.int32)
        for c in cuts:
            doc[c:] += 1
        return {"doc": doc.to(device), "doc_k": doc.to(device)}
    if name == "bigbird":
        nb = math.ceil(L / 128)
        # about 3 random key blocks per query block row
        r = torch.rand(nb, nb, generator=gen) < (3.0 / nb)
        return {"random_blocks": r.to(device)}
    if name == "bigbird_tensor":
        nb = math.ceil(L / 128)
        r = torch.rand(nb, nb, generator=gen) < (3.0 / nb)
        qb, kb = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
        blocks = ((qb - kb).abs() <= 1) | (qb == 0) | (kb == 0) | r
        return {"blocks": blocks.to(device)}
    if name == "alibi":
        return {"slopes": torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=device)}
    return {}


def anchor_problem(name, L, D=128, dev="cuda", seed=0):
    """(variant, q, k, v, inputs) for one ANCHORS variant: bf16, batch x L = 16384 tokens,
    16 heads (or the variant's GQA heads), leaf tensors that take gradients."""
    variant = attncc.parse(VARIANTS[name])
    hq, hkv = (variant.heads.q, variant.heads.kv) if variant.heads else (16, 16)
    B = max(1, 16384 // L)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=gen).to(dev, torch.bfloat16).requires_grad_()
               for h in (hq, hkv, hkv))
    return variant, q, k, v, sample_inputs(name, variant, B, hq, L, dev, gen)


def error_vs_reference(variant, q, k, v, inputs, dtype, seed):
    """(kernel err, eager err) per output, both against the float64 reference."""
    kern = attncc.compile(variant)
    # A sink's learnable inputs are checked too (their gradient is computed outside the
    # kernels, deterministically); other learnable inputs' atomics are not, here.
    read = ir.loaded_tensors(variant.sink) if variant.sink is not None else set()
    sinks = {n: t for n, t in inputs.items() if n in read and variant.input(n).learnable}
    fixed = {n: t for n, t in inputs.items() if n not in sinks}
    # `normalize none` has no LSE (return_lse is refused): a row of zeros stands for it.
    with_lse = variant.normalize != "none"

    def leaves(cast):
        return ([t.to(cast).requires_grad_() for t in (q, k, v)],
                {n: t.detach().to(torch.float64 if cast == torch.float64 else t.dtype,
                                  copy=True).requires_grad_() for n, t in sinks.items()})

    def run(fn, qkv, own):
        seeded = dict(dropout_seed=seed) if variant.dropout else {}  # refused without dropout
        got = fn(*qkv, return_lse=with_lse, **seeded, **fixed, **own)
        return got if with_lse else (got, torch.zeros(got.shape[:3], device=got.device))

    def reference(*args, **kw):
        return attncc.reference(variant, *args, **kw)
    qk, own = leaves(dtype)
    out, lse = run(kern, qk, own)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, qk + list(own.values()), do)
    q64, own64 = leaves(torch.float64)
    ref, rlse = run(reference, q64, own64)
    rgrads = torch.autograd.grad(ref, q64 + list(own64.values()), do.double())
    qe, owne = leaves(dtype)
    eager, else_ = run(reference, qe, owne)
    egrads = torch.autograd.grad(eager, qe + list(owne.values()), do)
    from attncc.semantics.reference import scale_value
    scales = gradient_scales(q64[0], q64[1], ref, do, scale_value(variant, q.shape[-1]),
                             q.shape[1] // k.shape[1])
    rows = []
    for label, a, r, e in [("out", out, ref, eager), ("lse", lse, rlse, else_)] + \
            [(f"d{n}", g, rg, eg) for n, g, rg, eg in zip(["q", "k", "v", *sinks], grads, rgrads,
                                                          egrads)]:
        inf_ok = bool(((a == -math.inf) == (r == -math.inf)).all()) if label == "lse" else True
        finite = torch.isfinite(r)
        ka = (a.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        ea = (e.double() - r)[finite].abs().max().item() if finite.any() else 0.0
        nan = bool(torch.isnan(a).any())
        rows.append(dict(tensor=label, kernel_err=ka, eager_err=ea, inf_rows_match=inf_ok, nan=nan,
                         ok=(not nan) and inf_ok and within_tolerance(ka, ea, dtype, r,
                                                                   scales.get(label, 1.0))))
    return rows


def correctness(args):
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    specs = dict(VARIANTS)
    specs.update({
        "bottom_right": "attention br { mask q + len_k - len_q >= k }",
        "prefix_lm": "attention p { param prefix: int = 100 mask q >= k or k < prefix }",
        "sinks_window": "attention s { mask q >= k and (q - k < 200 or k < 4) }",
        "chunked": "attention c { mask q // 128 == k // 128 and q >= k }",
        "dropout": "attention d { mask q >= k dropout 0.1 }",
        "rel_bias": ("attention rb { learnable input bias: f32[h, 511] "
                     "score s + bias[h, min(max(q - k, -255), 255) + 255] }"),
        "empty_rows": "attention e { mask k > q + 100 }",
        # gpt-oss's learnable sinks: a window layer, and rows with no key (O = 0, LSE = σ).
        "gpt_oss_sinks": ("attention gs { learnable input sinks: f32[h] "
                          "mask q >= k and q - k < 128 sink sinks[h] }"),
        "sink_empty_rows": "attention se { learnable input sinks: f32[h] mask k > q + 100 sink sinks[h] }",
        # Normalisers (README "Normalisers"): Apple's sigmoid attention with b = -log n,
        # ReLU attention, and `sum` of a weight that is 1 at -inf (masked pairs add nothing).
        "sigmoid": ("attention sig { param bias: float = -7.0 mask q >= k normalize none "
                    "weight sigmoid(s + bias) }"),
        "relu": "attention relu { normalize none weight max(s, 0.0) / len_k }",
        "sum_relu": "attention sr { mask q >= k normalize sum weight 1.0 + max(s, 0.0) }",
    })
    shapes = [  # B, Hq, Hkv, Lq, Lk, D
        (2, 4, 4, 1000, 1000, 128),
        (1, 3, 3, 517, 777, 80),
        (2, 4, 2, 1, 300, 64),
        (1, 2, 2, 300, 300, 256),
        (1, 8, 8, 384, 384, 96),
    ]
    if args.variants:
        specs = {n: specs[n] for n in args.variants.split(",")}
    results, failures = [], 0
    for name, src in specs.items():
        variant = attncc.parse(src)
        for (B, H, Hkv, Lq, Lk, D) in shapes:
            if variant.heads:
                H, Hkv = variant.heads.q, variant.heads.kv
            if name in ("document", "bigbird") and Lq != Lk:
                continue
            # bf16 everywhere; fp16 on the first shape (compiles cost more than runs here)
            for dtype in ((torch.bfloat16, torch.float16) if D == 128 else (torch.bfloat16,)):
                q = torch.randn(B, H, Lq, D, device=dev)
                k = torch.randn(B, Hkv, Lk, D, device=dev)
                v = torch.randn(B, Hkv, Lk, D, device=dev)
                inputs = sample_inputs(name, variant, B, H, Lq, dev, gen)
                if name == "rel_bias":
                    inputs = {"bias": torch.randn(H, 511, device=dev)}
                if variant.sink is not None:  # sinks from 40 below to 40 above the logits
                    inputs = {"sinks": torch.linspace(-40.0, 40.0, H, device=dev)}
                if name == "bigbird":
                    inputs = {"random_blocks": torch.rand(math.ceil(Lq / 128), math.ceil(Lk / 128), generator=gen).to(dev) < 0.3}
                try:
                    rows = error_vs_reference(variant, q, k, v, inputs, dtype, seed=7)
                except Exception as e:  # report and go on: one failure must not hide the rest
                    rows = [dict(tensor="error", ok=False, message=f"{type(e).__name__}: {e}",
                                 trace=traceback.format_exc()[-2000:])]
                bad = [r for r in rows if not r["ok"]]
                failures += bool(bad)
                results.append(dict(variant=name, shape=[B, H, Hkv, Lq, Lk, D], dtype=str(dtype),
                                    rows=rows))
                worst = max((r.get("kernel_err", 0) / (r.get("eager_err", 0) + 1e-6) for r in rows), default=0)
                print(f"{'FAIL' if bad else 'ok  '} {name:15s} {str((B, H, Hkv, Lq, Lk, D)):28s} "
                      f"{str(dtype):15s} worst kernel/eager {worst:.2f}"
                      + (f"  {bad[0]}" if bad else ""), flush=True)
    path = args.results or os.path.join(OUT, "correctness.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\ncorrectness: {len(results) - failures} of {len(results)} cases within tolerance in bf16/fp16")
    return failures


# ---------------------------------------------------------------- speed
def pairs_allowed(variant, B, H, L, inputs, dev):
    """Allowed (q, k) pairs summed over batch and heads (dense count, chunked by rows)."""
    total = 0
    p = Problem(B, H, variant.heads.kv if variant.heads else H, L, L, 128, 128)
    mask = allowed_pairs(variant, p, inputs, dev)
    total = mask.expand(B, H, L, L).sum().item() if mask.numel() < 2 ** 31 else None
    return total


def flex_mods(name, variant, inputs, H):
    """FlexAttention's mask_mod/score_mod for the ANCHORS variants."""
    from torch.nn.attention.flex_attention import create_block_mask
    window = 1024
    if name in ("full",):
        return None, None
    if name in ("causal", "causal_gqa", "softcap", "alibi"):
        mask_mod = lambda b, h, q, k: q >= k
    elif name == "sliding_window":
        mask_mod = lambda b, h, q, k: (q >= k) & (q - k < window)
    elif name == "document":
        doc = inputs["doc"]
        mask_mod = lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)
    elif name == "bigbird_tensor":
        blocks = inputs["blocks"]
        mask_mod = lambda b, h, q, k: blocks[q // 128, k // 128]
    elif name == "bigbird":
        rb = inputs["random_blocks"]
        mask_mod = lambda b, h, q, k: (((q // 128) - (k // 128)).abs() <= 1) | (q // 128 == 0) | (k // 128 == 0) | rb[q // 128, k // 128]
    else:
        raise KeyError(name)
    score_mod = None
    if name == "alibi":
        slopes = inputs["slopes"]
        score_mod = lambda s, b, h, q, k: s + slopes[h] * (k - q)
    if name == "softcap":
        score_mod = lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0)
    return mask_mod, score_mod


def bench(fn, rep=100):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def speed(args):
    import triton
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    lens = [int(x) for x in args.lens.split(",")]
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    results = []
    flex = None
    if args.flex:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        flex = torch.compile(flex_attention, dynamic=False)
    for L in lens:
        B = max(1, 16384 // L)
        for name in names:
            variant = attncc.parse(VARIANTS[name])
            H, Hkv = (variant.heads.q, variant.heads.kv) if variant.heads else (16, 16)
            D = args.dim
            q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
            inputs = sample_inputs(name, variant, B, H, L, dev, gen)
            pairs = pairs_allowed(variant, 1, 1, L, inputs, dev) * B * H if L <= 16384 else None
            fwd_flops = 4 * D * pairs
            row = dict(variant=name, L=L, B=B, H=H, Hkv=Hkv, D=D, density=pairs / (B * H * L * L))
            kern = attncc.compile(variant)
            do = torch.randn_like(q)
            t0 = time.perf_counter()
            torch.autograd.grad(kern(q, k, v, **inputs), (q, k, v), do)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0  # compile + tune, fwd and bwd
            configs = [None]
            if args.sweep:
                from attncc.runtime.configs import candidates, keep
                configs = [c for c in candidates("fwd") if keep(c, variant, D, "fwd")][:5]
            best = None
            for cfg in configs:
                kern.pinned_config = cfg
                try:
                    t_f = bench(lambda: kern(q, k, v, **inputs))
                    t_fb = bench(lambda: torch.autograd.grad(kern(q, k, v, **inputs), (q, k, v), do))
                except Exception as e:
                    print(f"  {name} L={L} config {cfg}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                if best is None or t_f < best[0]:
                    best = (t_f, t_fb - t_f, cfg)
            kern.pinned_config = None
            if best:
                row["backends"] = dict(fwd=kern.last_backend, bwd=kern.last_backward)
                row["attncc"] = dict(fwd_ms=best[0], bwd_ms=best[1], config=best[2],
                                     fwd_tflops=fwd_flops / best[0] / 1e9,
                                     bwd_tflops=2.5 * fwd_flops / best[1] / 1e9)
            # SDPA where expressible
            from torch.nn.attention import SDPBackend, sdpa_kernel
            import torch.nn.functional as F
            if name in ("full", "causal", "causal_gqa"):
                for backend, label in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"),
                                       (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
                    try:
                        with sdpa_kernel(backend):
                            fn = lambda: F.scaled_dot_product_attention(
                                q, k, v, is_causal=(name != "full"), enable_gqa=(H != Hkv))
                            t_f = bench(fn)
                            t_fb = bench(lambda: torch.autograd.grad(fn(), (q, k, v), do))
                        row[label] = dict(fwd_ms=t_f, bwd_ms=t_fb - t_f,
                                          fwd_tflops=fwd_flops / t_f / 1e9,
                                          bwd_tflops=2.5 * fwd_flops / (t_fb - t_f) / 1e9)
                    except Exception as e:
                        row[label] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
            if flex is not None:
                try:
                    from torch.nn.attention.flex_attention import create_block_mask
                    mask_mod, score_mod = flex_mods(name, variant, inputs, H)
                    t0 = time.perf_counter()
                    bm = create_block_mask(mask_mod, None, None, L, L, device=dev) if mask_mod else None
                    torch.cuda.synchronize()
                    row["flex_block_mask_ms"] = (time.perf_counter() - t0) * 1e3
                    fn = lambda: flex(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=(H != Hkv))
                    t_f = bench(fn)
                    t_fb = bench(lambda: torch.autograd.grad(fn(), (q, k, v), do))
                    row["flex"] = dict(fwd_ms=t_f, bwd_ms=t_fb - t_f, fwd_tflops=fwd_flops / t_f / 1e9,
                                       bwd_tflops=2.5 * fwd_flops / (t_fb - t_f) / 1e9)
                except Exception as e:
                    row["flex"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            results.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"speed_{'_'.join(map(str, lens))}.json"), "w") as f:
        json.dump(results, f, indent=1)
    # The short table, last.
    print(f"\n{'variant':16s} {'L':>6s} {'dens':>5s} | {'attncc f/b TF/s':>16s} | {'flex f/b':>12s} | "
          f"{'ratio f/b':>10s} | {'cudnn f/b':>12s} | {'flash f/b':>12s}")
    for r in results:
        a, fx = r.get("attncc", {}), r.get("flex", {})
        cu, fl = r.get("sdpa_cudnn", {}), r.get("sdpa_flash", {})
        fmt = lambda d: (f"{d['fwd_tflops']:5.0f}/{d['bwd_tflops']:5.0f}" if "fwd_tflops" in d else "      -     ")
        ratio = (f"{fx['fwd_ms'] / a['fwd_ms']:4.2f}/{fx['bwd_ms'] / a['bwd_ms']:4.2f}"
                 if "fwd_ms" in a and "fwd_ms" in fx else "    -     ")
        ran = r.get("backends", {})
        kinds = "/".join(b[0][0] for b in [ran.get("fwd") or "?"] + list((ran.get("bwd") or {}).values()))
        print(f"{r['variant']:16s} {r['L']:6d} {r['density']:5.2f} | {fmt(a):>16s} | {fmt(fx):>12s} | "
              f"{ratio:>10s} | {fmt(cu):>12s} | {fmt(fl):>12s} | {kinds}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["correctness", "speed", "all"], default="all")
    ap.add_argument("--lens", default="4096,16384")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--variants", default=None)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--results", default=None, help="where correctness writes its JSON")
    ap.add_argument("--sweep", action="store_true", help="try several tile configs, keep the best")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    failures = 0
    if args.part in ("correctness", "all"):
        failures = correctness(args)
    if args.part in ("speed", "all"):
        speed(args)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
