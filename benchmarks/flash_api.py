"""attncc.flash (flash-attn's API) on the GPU: correctness in bf16, then speed at 16K tokens.

    python benchmarks/flash_api.py [--tokens 16384] [--heads 16/16] [--skip-speed]
    TRITON_INTERPRET=1 python benchmarks/flash_api.py --smoke     # the code paths, on the CPU

1. Correctness. `flash_attn_func` and `flash_attn_varlen_func` in bf16 (and fp16 on one
   shape) against flash-attn's documented semantics computed densely in float64
   (`flash_semantics`, written from flash-attn's docstrings, as tests/test_flash.py
   does), forward and backward, held to attncc/semantics/tolerance.py's rule: error at most twice
   that of the same semantics computed eagerly in bf16, plus the dtype's slack. Shapes
   include seqlen_q != seqlen_k, GQA, head dim 80, a ragged varlen batch with a
   one-token and an empty sequence.
2. Speed, bf16, head dim 128, `--tokens` tokens: flash_attn_func causal, causal with a
   (1024, 0) window, causal with softcap 30, each against FlexAttention (compiled, the
   same mask and score) and SDPA where SDPA can express it (causal); and a varlen batch
   of documents of random lengths, causal, against FlexAttention with a document mask and
   SDPA called once per document. Also flash-attn itself where it is installed. Warm-up,
   median of do_bench's repetitions, the same inputs for every backend; each backend's
   output is compared with attncc's.

Writes everything as JSON to $OUT/flash_api.json (or ./out) and prints a short table last.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from attncc.flash import flash_attn_func, flash_attn_varlen_func
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

OUT = os.environ.get("OUT", "out")


def flash_semantics(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, softmax_scale=None):
    """flash-attn's attention densely, from its docstrings: q (batch, seqlen_q, nheads, d),
    k, v (batch, seqlen_k, nheads_k, d); out (batch, seqlen_q, nheads, d), lse (batch,
    nheads, seqlen_q), -inf and zero output where a row attends to nothing."""
    B, Sq, H, D = q.shape
    Sk, group = k.shape[1], H // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device).view(-1, 1)
    j = torch.arange(Sk, device=q.device).view(1, -1)
    diagonal = i + Sk - Sq
    allowed = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= diagonal
    if window_size[0] >= 0:
        allowed &= j >= diagonal - window_size[0]
    if window_size[1] >= 0:
        allowed &= j <= diagonal + window_size[1]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype)
        slopes = slopes.view(1, H, 1, 1) if slopes.dim() == 1 else slopes.view(B, H, 1, 1)
        s = s - slopes * (diagonal - j).abs()
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    any_key = allowed.any(-1, keepdim=True)
    p = torch.where(allowed, torch.exp(s - torch.where(any_key, lse.unsqueeze(-1), 0)), 0)
    return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v), lse


def varlen_semantics(q, k, v, cu_q, cu_k, *, alibi_slopes=None, **opts):
    """flash_semantics on each packed sequence alone, concatenated (out, lse (heads, total))."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i + 1] == bq[i]:
            continue
        slopes = None if alibi_slopes is None else alibi_slopes[i]
        out, lse = flash_semantics(q[bq[i]:bq[i + 1]][None], k[bk[i]:bk[i + 1]][None],
                                   v[bk[i]:bk[i + 1]][None], alibi_slopes=slopes, **opts)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


# ---------------------------------------------------------------- correctness
def check(fn, truth, tensors, do, dtype, scale):
    """Rows of (tensor, kernel err, eager err, ok) for fn against truth in float64."""
    def run(f, cast):
        leaves = [t.to(cast).requires_grad_() for t in tensors]
        out, lse = f(*leaves)
        return [out, lse, *torch.autograd.grad(out, leaves, do.to(cast))]

    got, ref, eager = run(fn, dtype), run(truth, torch.float64), run(truth, dtype)
    q, k, _ = tensors
    scales = gradient_scales(q, k, ref[0], do, scale, q.shape[-2] // k.shape[-2])
    rows = []
    for name, g, r, e in zip(["out", "lse", "dq", "dk", "dv"], got, ref, eager):
        ka, ea = max_abs_error(g, r), max_abs_error(e, r)
        rows.append(dict(tensor=name, kernel_err=ka, eager_err=ea,
                         ok=within_tolerance(ka, ea, dtype, r, scales.get(name, 1.0))))
    return rows


def correctness(dev, dtype, smoke):
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dev)
    shapes = [(2, 1000, 1200, 8, 2, 128), (1, 517, 300, 6, 6, 80), (2, 1, 700, 4, 1, 64)]
    if smoke:
        shapes = [(1, 37, 45, 4, 2, 16)]
    options = {
        "causal": dict(causal=True),
        "window_both_sides": dict(window_size=(128, 64)),
        "causal_window_softcap": dict(causal=True, window_size=(256, -1), softcap=30.0),
        "alibi_h": dict(alibi="h", causal=True),
        "alibi_bh_scale": dict(alibi="bh", softmax_scale=0.05),
    }
    results, failures = [], 0
    for (B, Sq, Sk, H, Hkv, D) in shapes:
        for name, opts in options.items():
            opts = dict(opts)
            alibi = opts.pop("alibi", None)
            if alibi:
                opts["alibi_slopes"] = torch.rand((H,) if alibi == "h" else (B, H), generator=gen).to(dev)
            q, k, v, do = rnd(B, Sq, H, D), rnd(B, Sk, Hkv, D), rnd(B, Sk, Hkv, D), rnd(B, Sq, H, D)
            for dt in ((dtype, torch.float16) if D == 128 and not smoke else (dtype,)):
                results.append(_case(f"func {name}", [B, Sq, Sk, H, Hkv, D], dt, lambda: check(
                    lambda q, k, v: flash_attn_func(q, k, v, return_attn_probs=True, **opts)[:2],
                    lambda q, k, v: flash_semantics(q, k, v, **opts),
                    (q, k, v), do, dt, opts.get("softmax_scale") or D ** -0.5)))
    # A ragged packed batch: a one-token and an empty sequence, more keys than queries.
    lens_q, lens_k = ([1000, 1, 0, 3000, 517], [1200, 5, 3, 3000, 400]) if not smoke else \
        ([6, 1, 0, 19, 8], [9, 4, 3, 19, 5])
    H, Hkv, D = (8, 2, 128) if not smoke else (4, 2, 16)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=dev)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    slopes = torch.rand(len(lens_q), H, generator=gen).to(dev)
    q, k, v = rnd(sum(lens_q), H, D), rnd(sum(lens_k), Hkv, D), rnd(sum(lens_k), Hkv, D)
    do = rnd(sum(lens_q), H, D)
    for name, opts in {"causal": dict(causal=True),
                       "causal_window_alibi_bh": dict(causal=True, window_size=(200, -1),
                                                      alibi_slopes=slopes)}.items():
        results.append(_case(f"varlen {name}", [lens_q, lens_k, H, Hkv, D], dtype, lambda: check(
            lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   return_attn_probs=True, **opts)[:2],
            lambda q, k, v: varlen_semantics(q, k, v, cu_q, cu_k, **opts),
            (q, k, v), do, dtype, D ** -0.5)))
    failures = sum(not all(r.get("ok") for r in case["rows"]) for case in results)
    print(f"\ncorrectness: {len(results) - failures} of {len(results)} cases within tolerance")
    return results, failures


def _case(name, shape, dtype, fn):
    try:
        rows = fn()
    except Exception as e:  # report and go on: one failure must not hide the rest
        rows = [dict(tensor="error", ok=False, message=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc()[-2000:])]
    bad = [r for r in rows if not r["ok"]]
    worst = max((r.get("kernel_err", 0) / (r.get("eager_err", 0) + 1e-6) for r in rows), default=0)
    print(f"{'FAIL' if bad else 'ok  '} {name:30s} {str(shape):40s} {str(dtype):15s} "
          f"worst kernel/eager {worst:.2f}" + (f"  {bad[0]}" if bad else ""), flush=True)
    return dict(case=name, shape=shape, dtype=str(dtype), rows=rows)


# ---------------------------------------------------------------- speed
def timer(smoke):
    if smoke:
        def bench(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return bench
    import triton
    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fwd_bwd(fn, leaves, do):
    """(forward, forward + backward) callables of one backend."""
    return fn, lambda: torch.autograd.grad(fn(), leaves, do)


def document_lengths(total, gen, lo=256, hi=4096):
    lens = []
    while sum(lens) < total:
        lens.append(min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), total - sum(lens)))
    return lens


def speed(args, dev, dtype, smoke):
    bench = timer(smoke)
    flex = flash_attn_ref = None
    if not smoke:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        try:
            import flash_attn
            flash_attn_ref = flash_attn
        except ImportError:
            pass
    hq, hkv = (int(x) for x in args.heads.split("/"))
    S, D = args.tokens, 128 if not smoke else 16
    gen = torch.Generator().manual_seed(1)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dev, dtype).requires_grad_()
    q, k, v = make(1, S, hq, D), make(1, S, hkv, D), make(1, S, hkv, D)
    do = torch.randn(1, S, hq, D, generator=gen).to(dev, dtype)
    window, cap = (1024, 30.0) if not smoke else (8, 30.0)
    cases = {
        "causal": (dict(causal=True), lambda b, h, i, j: i >= j, None),
        f"causal_window{window}": (dict(causal=True, window_size=(window, 0)),
                                   lambda b, h, i, j: (i >= j) & (i - j <= window), None),
        "causal_softcap30": (dict(causal=True, softcap=cap), lambda b, h, i, j: i >= j,
                             lambda s, b, h, i, j: cap * torch.tanh(s / cap)),
    }
    rows = []
    for name, (opts, mask_mod, score_mod) in cases.items():
        row = dict(case=name, tokens=S, heads=[hq, hkv], dim=D)
        ours = lambda: flash_attn_func(q, k, v, **opts)
        want = ours().detach().float()
        row["attncc"] = _time(bench, *fwd_bwd(ours, (q, k, v), do))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (1, heads, S, D) views
        if flex is not None:
            try:
                t0 = time.perf_counter()
                bm = create_block_mask(mask_mod, 1, None, S, S, device=dev)
                row["flex_block_mask_ms"] = (time.perf_counter() - t0) * 1e3
                f = lambda: flex(qt, kt, vt, score_mod=score_mod, block_mask=bm,
                                 enable_gqa=hq != hkv).transpose(1, 2)
                row["flex"] = _time(bench, *fwd_bwd(f, (q, k, v), do), want, f)
            except Exception as e:
                row["flex"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        if name == "causal":
            f = lambda: torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, enable_gqa=hq != hkv).transpose(1, 2)
            row["sdpa"] = _time(bench, *fwd_bwd(f, (q, k, v), do), want, f)
        if flash_attn_ref is not None:
            f = lambda: flash_attn_ref.flash_attn_func(q, k, v, **opts)
            row["flash_attn"] = _time(bench, *fwd_bwd(f, (q, k, v), do), want, f)
        rows.append(row)
        print(json.dumps(row), flush=True)

    # A varlen batch: documents of random lengths packed into S tokens, causal.
    lens = document_lengths(S, gen, *((256, 4096) if not smoke else (3, 20)))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qp, kp, vp = (t.detach()[0].requires_grad_() for t in (q, k, v))
    dop = do[0]
    row = dict(case=f"varlen_causal_{len(lens)}docs", tokens=S, heads=[hq, hkv], dim=D,
               lengths=lens)
    ours = lambda: flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens), causal=True)
    want = ours().detach().float()
    row["attncc"] = _time(bench, *fwd_bwd(ours, (qp, kp, vp), dop))
    # The same call given a kept packing: no host read of cu_seqlens (the default call
    # reads them, a synchronisation per call); the difference is that read's cost.
    kept = attncc.varlen_packing(cu, cu, max(lens), max(lens))
    ours_kept = lambda: flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens),
                                               causal=True, packing=kept)
    row["attncc_kept_packing"] = _time(bench, *fwd_bwd(ours_kept, (qp, kp, vp), dop), want,
                                       ours_kept)
    vk = attncc.flash.kernel_for(packed=True, causal=True)
    row["tile_density_128"] = vk.density(qp, kp, vp, cu, cu, max(lens), max(lens), block=128)
    doc = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
    row["dense_density_128"] = _document_causal_density(doc, 128)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (qp, kp, vp))
    if flex is not None:
        try:
            bm = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), 1, None,
                                   S, S, device=dev)
            f = lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=hq != hkv)[0].transpose(0, 1)
            row["flex"] = _time(bench, *fwd_bwd(f, (qp, kp, vp), dop), want, f)
        except Exception as e:
            row["flex"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")

    def sdpa_per_document():
        bounds = cu.tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            qt[:, :, a:b], kt[:, :, a:b], vt[:, :, a:b], is_causal=True,
            enable_gqa=hq != hkv)[0].transpose(0, 1) for a, b in zip(bounds, bounds[1:])])

    row["sdpa_per_document"] = _time(bench, *fwd_bwd(sdpa_per_document, (qp, kp, vp), dop), want,
                                     sdpa_per_document)
    if flash_attn_ref is not None:
        f = lambda: flash_attn_ref.flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens),
                                                          max(lens), causal=True)
        row["flash_attn"] = _time(bench, *fwd_bwd(f, (qp, kp, vp), dop), want, f)
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "lengths"}), flush=True)
    return rows


def _document_causal_density(doc, block):
    """The fraction of block x block tiles holding a pair of one document with q >= k."""
    S = doc.numel()
    n = -(-S // block)
    first = torch.full((n * block,), S, device=doc.device)  # past the end: no document
    first[:S] = doc
    last = torch.full((n * block,), -1, device=doc.device)
    last[:S] = doc
    lo, hi = first.view(n, block).amin(1), last.view(n, block).amax(1)
    qt, kt = torch.arange(n, device=doc.device).view(-1, 1), torch.arange(n, device=doc.device).view(1, -1)
    # Documents are contiguous, so a tile holds such a pair iff the documents of its query
    # and key blocks overlap and it is on or below the diagonal.
    overlap = (lo.view(-1, 1) <= hi.view(1, -1)) & (lo.view(1, -1) <= hi.view(-1, 1))
    return (overlap & (qt >= kt)).float().mean().item()


def _time(bench, fwd, fwd_bwd_fn, want=None, output=None):
    # One call of each first: tuning and compiling happen there, not in do_bench's
    # estimate of a call's time (which sets how many repetitions it runs).
    fwd_bwd_fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t_f = bench(fwd)
    t_fb = bench(fwd_bwd_fn)
    row = dict(fwd_ms=t_f, bwd_ms=t_fb - t_f)
    if want is not None:
        row["max_diff_vs_attncc"] = (output().detach().float() - want).abs().max().item()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", default="16/16", help="query/key heads, as 16/4")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU in float32 (under TRITON_INTERPRET=1): the code paths only")
    args = ap.parse_args()
    smoke = args.smoke
    dev, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    if smoke:
        args.tokens = min(args.tokens, 48)
    results, failures = correctness(dev, dtype, smoke)
    rows = [] if args.skip_speed else speed(args, dev, dtype, smoke)
    os.makedirs(OUT, exist_ok=True)
    info = dict(device=torch.cuda.get_device_name() if not smoke else "cpu (interpreter)",
                torch=torch.__version__, attncc=attncc.__version__)
    with open(os.path.join(OUT, "flash_api.json"), "w") as f:
        json.dump(dict(info=info, correctness=results, speed=rows), f, indent=1)
    print(f"\n{info['device']}, torch {info['torch']}, {str(dtype)[6:]}, head dim {128 if not smoke else 16}, "
          f"{args.tokens} tokens, heads {args.heads}")
    print(f"correctness: {len(results) - failures} of {len(results)} cases within tolerance")
    if rows:
        print(f"{'case':24s} | {'attncc fwd/bwd ms':>18s} | {'flex fwd/bwd':>14s} | "
              f"{'sdpa fwd/bwd':>14s} | {'flash-attn':>14s}")
        cell = lambda r: (f"{r['fwd_ms']:6.2f}/{r['bwd_ms']:6.2f}" if r and "fwd_ms" in r
                          else ("error" if r else "-"))
        for r in rows:
            print(f"{r['case'][:24]:24s} | {cell(r.get('attncc')):>18s} | {cell(r.get('flex')):>14s} | "
                  f"{cell(r.get('sdpa') or r.get('sdpa_per_document')):>14s} | "
                  f"{cell(r.get('flash_attn')):>14s}")
        varlen = rows[-1]
        print(f"varlen tile density (128): attncc {varlen['tile_density_128']:.4f}, "
              f"dense document-causal {varlen['dense_density_128']:.4f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
