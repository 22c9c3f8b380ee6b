"""GPU check of v's head dim independent of q·k's (issue 34): correctness in fp16 and
bf16, and the (192, 128) speed at 16K tokens.

    python benchmarks/head_dims_v.py --part correctness [--match "MLA decode"]
    python benchmarks/head_dims_v.py --part speed [--len 16384]
    python benchmarks/head_dims_v.py --part mla [--hbm-tbs 4.8] [--tflops 989] [--nq 1,4]

correctness: (192, 128), (128, 64), (64, 512), (80, 96) forward and backward, causal
and not, GQA 6 / 2, lengths off the tile, against float64 autograd of attncc.reference,
held to attncc/semantics/tolerance.py's rule; then decoding with a v cache 128 wide
beside 192-wide keys, contiguous and paged, against decode_reference; then MLA decoding
(v = k[..., :512], 128 heads, n_q 1 and 4, ragged rows to 4000 keys, contiguous and
paged) at each wide-accumulator tile the tuner may pick (decoding.WIDE_SHAPES, pinned)
and tuned; then the Gluon MLA decode (backend="gluon", sm_90) at (576, 512) and at (64,
512) with a v cache of its own, in fp16 and bf16, at one split, three and its untuned
first config, with the cache past each row's keys filled with NaN (which no kernel may
read into a result).
speed: forward, backward (timed alone, on a kept graph) and forward + backward of causal
(192, 128) attention in bf16, batch 1, 16 heads: attncc as given (auto), with backend="gluon" and with backend="triton"; attncc
with q, k padded to 256 and v to 256 (what the padding workaround and a padded head dim
cost: the scale fixed to 1/sqrt(192)); cuDNN through SDPA (which takes d_qk 192 / d_v
128 on Hopper) and FA4 (flash_attn.cute) where installed.
mla: MLA decoding, one latent cache 576 wide with v = k[..., :512] (the kernel
takes the values from the K tile), batch 32, 128 query heads on one kv head, n_q 1 and
4 (--nq), caches of 4K to 32K tokens in bf16: correctness against decode_reference on
the first case, then per case and backend (auto, backend="gluon" and backend="triton": a
row each) the backend and config the call ran (tile, warps, stages, splits, programs
against the SMs), the time, the cache bytes read per second against the HBM
peak (--hbm-tbs, 4.8 TB/s for an H200) and the tensor FLOP/s against --tflops (989 for
dense bf16): at 128 heads MLA decoding does 2 x 128 x n_q x (576 + 512) FLOPs per
1152-byte cache row, about the H200's ridge at n_q 1 and compute-bound beyond, so
`bound` gives the larger of the two floors. Results go to $OUT/head_dims_v.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc.runtime import decoding  # noqa: E402
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance  # noqa: E402

OUT = os.environ.get("OUT", "out")
SHAPES = [(192, 128), (128, 64), (64, 512), (80, 96)]
CAUSAL = "attention causal { mask q >= k }"
FULL = "attention full { }"


def check(E: int, Ev: int, dtype, causal: bool) -> list:
    torch.manual_seed(E + Ev)
    B, Hq, Hkv, Lq, Lk = 2, 6, 2, 201, 333
    dev = "cuda"
    q = torch.randn(B, Hq, Lq, E, device=dev, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, E, device=dev, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Ev, device=dev, dtype=torch.float64)
    dout = torch.randn(B, Hq, Lq, Ev, device=dev, dtype=torch.float64)
    kernel = attncc.compile(CAUSAL if causal else FULL)

    def run(fn, cast):
        leaves = [t.to(cast).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, dout.to(cast))]

    reference = lambda *t: attncc.reference(kernel.variant, *t)
    mine, truth, eager = run(kernel, dtype), run(reference, torch.float64), run(reference, dtype)
    scales = gradient_scales(q, k, truth[0], dout, E ** -0.5, Hq // Hkv)
    rows = []
    for name, a, t, e in zip(("out", "dq", "dk", "dv"), mine, truth, eager):
        assert a.shape == t.shape, (name, a.shape, t.shape)
        err, eerr = max_abs_error(a, t), max_abs_error(e, t)
        rows.append(dict(tensor=name, err=err, eager_err=eerr,
                         ok=bool(within_tolerance(err, eerr, dtype, t, scales.get(name, 1.0)))))
    rows.append(dict(tensor="backend", value=str(kernel.last_backend)))
    rows.append(dict(tensor="backward", value=str(kernel.last_backward)))
    return rows


def check_decode(dtype, paged: bool) -> list:
    torch.manual_seed(7)
    B, Hq, Hkv, E, Ev, n_q = 4, 16, 1, 192, 128, 2
    kernel = attncc.compile(CAUSAL)
    q = torch.randn(B, Hq, n_q, E, device="cuda", dtype=dtype)
    seqlens = torch.tensor([1, 700, 1500, 4000], device="cuda", dtype=torch.int32)
    table = None
    if paged:
        page, pages = 64, 4 * 64
        k_cache = torch.randn(pages, page, Hkv, E, device="cuda", dtype=dtype)
        v_cache = torch.randn(pages, page, Hkv, Ev, device="cuda", dtype=dtype)
        table = torch.randperm(pages, device="cuda")[:B * 64].reshape(B, 64).int()
    else:
        k_cache = torch.randn(B, Hkv, 4096, E, device="cuda", dtype=dtype)
        v_cache = torch.randn(B, Hkv, 4096, Ev, device="cuda", dtype=dtype)
    out = kernel.decode(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    ref = attncc.decode_reference(kernel.variant, q.double(), k_cache.double(), v_cache.double(),
                                  cache_seqlens=seqlens, block_table=table)
    eager = attncc.decode_reference(kernel.variant, q, k_cache, v_cache, cache_seqlens=seqlens,
                                    block_table=table)
    err, eerr = max_abs_error(out, ref), max_abs_error(eager, ref)
    return [dict(tensor="out", err=err, eager_err=eerr,
                 ok=bool(out.shape == ref.shape and within_tolerance(err, eerr, dtype, ref, 1.0)))]


def check_mla_decode(n_q: int, paged: bool, config, dt=torch.bfloat16, backend="auto",
                     num_splits=None, E=576) -> list:
    """MLA decoding, v = k[..., :512] (one latent cache; or E=64: keys 64 wide beside a v
    cache 512 wide), 128 heads, ragged rows (one of 1 key, the others off the 64-key
    tile), at `config` or `num_splits` (None: tuned) on `backend`, against
    decode_reference in float64. The cache past each row's keys holds NaN: a kernel that
    reads it into a result fails."""
    torch.manual_seed(576 + n_q + E)
    B, H, Ev = 4, 128, 512
    kernel = attncc.compile(CAUSAL, backend=backend)
    q = torch.randn(B, H, n_q, E, device="cuda", dtype=dt)
    seqlens = torch.tensor([1, 700, 1500, 4000], device="cuda", dtype=torch.int32)
    table = None
    width = E + (Ev if E == 64 else 0)  # the values beside the keys, or within them
    if paged:
        page, pages = 64, 4 * 64
        cache = torch.randn(pages, page, 1, width, device="cuda", dtype=dt)
        table = torch.randperm(pages, device="cuda")[:B * 64].reshape(B, 64).int()
        for b, length in enumerate(seqlens.tolist()):
            pos = torch.arange(length, 64 * page, device="cuda")
            cache[table[b].long()[pos // page], pos % page] = float("nan")
    else:
        cache = torch.randn(B, 1, 4096, width, device="cuda", dtype=dt)
        for b, length in enumerate(seqlens.tolist()):
            cache[b, :, length:] = float("nan")
    if E == 64:  # two caches of their own (contiguous copies of the halves)
        k_cache, v_cache = cache[..., :E].contiguous(), cache[..., E:].contiguous()
    else:
        k_cache, v_cache = cache, cache[..., :Ev]
    out = kernel.decode(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                        config=config, num_splits=num_splits)
    plan = kernel._decode_plans[decoding.plan_key(q, k_cache, v_cache, seqlens, None, None,
                                                  table, num_splits, config, False, {})]
    ref = attncc.decode_reference(kernel.variant, q.double(), k_cache.double(),
                                  v_cache.double(), cache_seqlens=seqlens, block_table=table)
    eager = attncc.decode_reference(kernel.variant, q, k_cache, v_cache,
                                    cache_seqlens=seqlens, block_table=table)
    err, eerr = max_abs_error(out, ref), max_abs_error(eager, ref)
    ran = backend in ("auto", plan.backend)  # a backend asked for ran the call
    return [dict(tensor="out", err=err, eager_err=eerr, backend=plan.backend,
                 config=plan.config, reason=plan.reason,
                 ok=bool(ran and out.shape == ref.shape and not torch.isnan(out).any()
                         and within_tolerance(err, eerr, dt, ref, 1.0)))]


def correctness(match: str) -> list:
    results = []
    cases = [(f"E{E} Ev{Ev} {str(dt)[6:]} {'causal' if c else 'full'}",
              lambda E=E, Ev=Ev, dt=dt, c=c: check(E, Ev, dt, c))
             for E, Ev in SHAPES for dt in (torch.float16, torch.bfloat16) for c in (False, True)]
    cases += [(f"decode 192/128 {str(dt)[6:]} {'paged' if p else 'contiguous'}",
               lambda dt=dt, p=p: check_decode(dt, p))
              for dt in (torch.float16, torch.bfloat16) for p in (False, True)]
    wide = [None] + [dict(BLOCK_N=bn, num_warps=w, num_stages=s, num_splits=3)
                     for bn, w, s in decoding.WIDE_SHAPES]
    cases += [(f"MLA decode n_q {n_q} {'paged' if p else 'contiguous'} "
               + (decoding.label(c) if c else "tuned"),
               lambda n_q=n_q, p=p, c=c: check_mla_decode(n_q, p, c))
              for n_q in (1, 4) for p in (False, True) for c in wide]
    cases += [(f"MLA decode gluon {E}/512 n_q {n_q} {'paged' if p else 'contiguous'} "
               f"{str(dt)[6:]} " + (f"{sp} splits" if sp else "untuned"),
               lambda n_q=n_q, p=p, dt=dt, sp=sp, E=E: check_mla_decode(n_q, p, None, dt, "gluon",
                                                                        sp, E))
              for E in (576, 64) for n_q in (1, 4) for p in (False, True)
              for dt in (torch.float16, torch.bfloat16) for sp in (None, 1, 3)]
    for label, fn in cases:
        if match not in label:
            continue
        try:
            rows = fn()
            ok = all(r.get("ok", True) for r in rows)
        except Exception as e:
            rows, ok = [dict(error=f"{type(e).__name__}: {str(e)[:400]}")], False
            traceback.print_exc()
        results.append(dict(case=label, ok=ok, rows=rows))
        worst = max((r["err"] for r in rows if "err" in r), default=float("nan"))
        print(f"{'ok  ' if ok else 'FAIL'} {label:34s} worst error {worst:.3g}", flush=True)
    return results


def speed(length: int) -> list:
    from triton.testing import do_bench
    torch.manual_seed(0)
    B, H, E, Ev = 1, 16, 192, 128
    dt = torch.bfloat16
    q, k = (torch.randn(B, H, length, E, device="cuda", dtype=dt, requires_grad=True)
            for _ in range(2))
    v = torch.randn(B, H, length, Ev, device="cuda", dtype=dt, requires_grad=True)
    dout = torch.randn(B, H, length, Ev, device="cuda", dtype=dt)
    ours = attncc.compile(CAUSAL)
    # Each backend asked for by name (Gluon's dQ and dK/dV take (192, 128) too), beside
    # auto's choice above.
    gluon = attncc.compile(CAUSAL, backend="gluon")
    portable = attncc.compile(CAUSAL, backend="triton")
    padded = attncc.compile("attention causal_192 { scale 1.0 / sqrt(192.0)  mask q >= k }")
    p256 = [F.pad(t.detach(), (0, 256 - t.shape[-1])).requires_grad_() for t in (q, k, v)]

    candidates = {  # name: (function, its leaves, the output's gradient)
        "attncc (192, 128)": (ours, (q, k, v), dout),
        "attncc Gluon": (gluon, (q, k, v), dout),
        "attncc portable": (portable, (q, k, v), dout),
        "attncc padded to 256": (padded, p256, F.pad(dout, (0, 128))),
    }
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(*t):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(*t, is_causal=True)
        cudnn(q, k, v)
        candidates["cuDNN (SDPA)"] = (cudnn, (q, k, v), dout)
    except Exception as e:
        print(f"cuDNN: not run ({type(e).__name__}: {str(e)[:200]})")
    try:
        from flash_attn.cute import flash_attn_func as fa4

        def fa4_bhsd(*t):
            out = fa4(*(x.transpose(1, 2) for x in t), causal=True)
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        fa4_bhsd(q, k, v)
        candidates["FA4 (flash_attn.cute)"] = (fa4_bhsd, (q, k, v), dout)
    except Exception as e:
        print(f"FA4: not run ({type(e).__name__}: {str(e)[:200]})")
    flops_fwd = 2 * B * H * length * length * (E + Ev) / 2  # causal: half the pairs
    results = []
    for name, (fn, leaves, grad) in candidates.items():
        def both():
            torch.autograd.grad(fn(*leaves), leaves, grad)
        try:
            t_f, t_b = do_bench(lambda: fn(*leaves)), do_bench(both)
            kept = fn(*leaves)  # the backward alone, over a graph kept between runs
            t_bwd = do_bench(lambda: torch.autograd.grad(kept, leaves, grad, retain_graph=True))
        except Exception as e:
            print(f"{name}: failed ({type(e).__name__}: {str(e)[:200]})")
            continue
        row = dict(name=name, fwd_ms=t_f, bwd_ms=t_bwd, fwd_bwd_ms=t_b,
                   fwd_tflops=flops_fwd / t_f / 1e9, bwd_tflops=2.5 * flops_fwd / t_bwd / 1e9,
                   fwd_bwd_tflops=3.5 * flops_fwd / t_b / 1e9)
        results.append(row)
        print(f"{name:24s} forward {t_f:7.3f} ms ({row['fwd_tflops']:5.0f} TFLOP/s)   "
              f"backward {t_bwd:7.3f} ms ({row['bwd_tflops']:5.0f})   "
              f"forward+backward {t_b:7.3f} ms ({row['fwd_bwd_tflops']:5.0f})", flush=True)
    return results


def mla(hbm_tbs: float, tflops: float, n_qs: list, E: int = 576) -> list:
    """E=576: one latent cache, v = k[..., :512]; E=64: keys 64 wide beside a v cache 512
    wide of its own (the same bytes per position, 1152, and fewer q·k FLOPs)."""
    from triton.testing import do_bench
    torch.manual_seed(0)
    B, H, Ev, dt = 32, 128, 512, torch.bfloat16
    spec = "attention mla { scale 1.0 / sqrt(192.0)  mask q >= k }"
    kernels = {b: attncc.compile(spec, backend=b) for b in ("auto", "gluon", "triton")}
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    results, checked = [], set()
    for length in (4096, 8192, 16384, 32768):
        latent = torch.randn(B, 1, length, E, device="cuda", dtype=dt)
        values = latent[..., :Ev] if E > Ev else torch.randn(B, 1, length, Ev, device="cuda", dtype=dt)
        for n_q, (asked, kernel) in itertools.product(n_qs, kernels.items()):
            q = torch.randn(B, H, n_q, E, device="cuda", dtype=dt)
            step = lambda: kernel.decode(q, latent, values, cache_seqlens=length)
            row = dict(len=length, n_q=n_q, asked=asked)
            if asked not in checked:
                checked.add(asked)
                got = step()
                ref = attncc.decode_reference(kernel.variant, q[:2].double(), latent[:2].double(),
                                              values[:2].double(), cache_seqlens=length)
                eager = attncc.decode_reference(kernel.variant, q[:2], latent[:2],
                                                values[:2], cache_seqlens=length)
                err, eerr = max_abs_error(got[:2], ref), max_abs_error(eager, ref)
                row.update(err=err, eager_err=eerr,
                           ok=bool(within_tolerance(err, eerr, dt, ref, 1.0)))
            ms = do_bench(step)
            plan = kernel._decode_plans[decoding.plan_key(
                q, latent, values, length, None, None, None, None, None, False, {})]
            p, cfg = plan.problem, plan.config
            # The Gluon MLA decode's programs own 64 rows each (the portable's rows_block).
            tiles = -(-p.group * p.n_q // 64) if plan.backend == "gluon" else p.row_tiles
            programs = p.batch * p.heads_kv * tiles * cfg["num_splits"]
            nbytes = latent.numel() * latent.element_size() + (
                0 if E > Ev else values.numel() * values.element_size())
            flops = 2 * B * H * n_q * length * (E + Ev)
            tbs, tf = nbytes / ms / 1e9, flops / ms / 1e9
            bound = max(nbytes / hbm_tbs / 1e9, flops / tflops / 1e9)  # ms
            row.update(ms=ms, cache_tbs=tbs, of_peak=tbs / hbm_tbs, tflops=tf, bound_ms=bound,
                       backend=plan.backend, reason=plan.reason, config=cfg, programs=programs,
                       sms=n_sm)
            results.append(row)
            row["dims"] = (E, Ev)
            print(f"MLA decode {E}/{Ev} cache {length:6d} n_q {n_q} {asked:6s} -> {plan.backend:6s}: "
                  f"{ms:7.3f} ms (bound {bound:6.3f}), "
                  f"cache read {tbs:5.2f} TB/s ({100 * tbs / hbm_tbs:4.1f}% of {hbm_tbs}), "
                  f"{tf:4.0f} TFLOP/s; {decoding.label(cfg)}, {tiles} row tiles, "
                  f"{programs} programs on {n_sm} SMs"
                  + (f", error {row['err']:.3g} ({'ok' if row['ok'] else 'FAIL'})"
                     if "err" in row else ""), flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("correctness", "speed", "mla"), default="correctness")
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--tflops", type=float, default=989.0, help="dense bf16 tensor peak")
    ap.add_argument("--nq", default="1,4", help="MLA new tokens per row, comma-separated")
    ap.add_argument("--mla-dim", type=int, default=576, choices=(576, 64),
                    help="mla: keys 576 wide with v their first 512 columns, or 64 wide beside "
                         "a v cache of its own")
    ap.add_argument("--match", default="", help="correctness: only the cases whose label has this")
    args = ap.parse_args()
    if args.part == "correctness":
        results = correctness(args.match)
    elif args.part == "speed":
        results = speed(args.len)
    else:
        results = mla(args.hbm_tbs, args.tflops, [int(n) for n in args.nq.split(",")], args.mla_dim)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "head_dims_v.json"), "w") as f:
        json.dump(dict(part=args.part, results=results), f, indent=1)
    if args.part == "correctness":
        failed = [r["case"] for r in results if not r["ok"]]
        print(f"{len(results) - len(failed)} / {len(results)} cases ok"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
