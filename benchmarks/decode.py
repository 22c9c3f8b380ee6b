"""Decoding on the GPU (issue 20): correctness in bf16 against the float64 reference, then
speed against FlexAttention's decoding kernel and SDPA.

    python benchmarks/decode.py [--part correctness|speed|all] [--variants causal,window,alibi]
                                [--sweep]

Correctness: each variant below on ragged caches (lengths 1, 1000 and 4133 of capacity
4224; heads 32/8, head dim 128, bf16), with 1 and 4 new tokens appended in place, on a
contiguous cache and on a paged one (page 64, shuffled pages), against decode_reference
in float64 with attncc's tolerance rule (twice the error of the same computation done
eagerly in bf16, plus bf16's resolution at the result's scale); then the output of each
speed problem itself, against its float64 reference.

Speed (the issue's targets): batch 8 x 32K cache and batch 1 x 128K, one new token,
heads 32/8, head dim 128, bf16; causal, sliding window 4096 + 4 sinks, and ALiBi. Each
backend runs the same decode step on the same tensors: attncc on the contiguous cache
(tuned: the first call prints the tuner's progress), attncc on a paged copy (page 64,
shuffled), FlexAttention compiled with a BlockMask on the one-token query (the script
checks inductor generated its `flex_decoding` kernel), and SDPA where the step is plain
attention over the whole cache (causal). Times are do_bench medians (warm-up, L2 flushed
before each call). Bandwidth is the bytes of K and V the step must read (the keys some
query row of each kv head's group attends) over the time, against 3.35 TB/s on an H100.
--sweep also times every decode candidate config on each problem (the tuner times six).

The table comes last; everything, with the tuned configs, goes to $OUT/decode.json.
A full run compiles about 40 kernels and 6 FlexAttention graphs: run the parts apart
(--part correctness; --part speed --variants causal,window; --variants alibi) when a
command's time is limited.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from attncc.runtime import decoding, tuning
from attncc.tools.decode_bench import bench_decode, decode_inputs, format_decode, paged_copy, peak_bandwidth, time_ms
from attncc.runtime.decoding import DecodeProblem, candidates
from attncc.semantics.decoding import decode_reference
from attncc.semantics.tolerance import max_abs_error, within_tolerance

HEADS, DIM = (32, 8), 128
DEVICE, DTYPE = "cuda", torch.bfloat16
LENGTHS, CAPACITY = [1, 1000, 4133], 4224  # correctness: ragged rows, none on the tile grid
SPEED_VARIANTS = {
    "causal": "attention causal { mask q >= k }",
    "window": "attention window_sinks { mask q >= k and (q - k < 4096 or k < 4) }",
    "alibi": "attention alibi { input slopes: f32[h]  mask q >= k  score s + slopes[h] * (k - q) }",
}
CORRECTNESS_VARIANTS = {
    **SPEED_VARIANTS,
    "window256": "attention window256 { mask q >= k and (q - k < 256 or k < 4) }",
    "bottom_right": "attention bottom_right { mask q + len_k - len_q >= k }",
    "softcap": "attention softcap { param cap: float = 30.0  mask q >= k  score cap * tanh(s / cap) }",
    "document": "attention document { input doc: i32[b, k]  mask doc[b, q] == doc[b, k] and q >= k }",
    "nsa_topk": ("attention nsa_topk { input top: i32[b, h, qb, 8]  mask q >= k  "
                 "layout kb in top[b, h, qb]  block 64 }"),
}
SPEED_PROBLEMS = [(8, 32768), (1, 131072)]


def device_inputs(variant, batch, capacity, seed):
    """decode_bench's stand-ins, with causal top-k lists for an index-list layout."""
    inputs = decode_inputs(variant, batch=batch, heads=HEADS, length=capacity, dim=DIM, seed=seed,
                           device=DEVICE)
    for decl in variant.inputs:
        if decl.name == "top":  # per query block: the diagonal block and 7 random earlier ones
            nb = -(-capacity // variant.block)
            gen = torch.Generator().manual_seed(seed)
            qb = torch.arange(nb).view(1, 1, nb, 1)
            scores = torch.rand(batch, HEADS[0], nb, nb, generator=gen)
            scores = scores.masked_fill(torch.arange(nb).view(1, 1, 1, nb) > qb, -1.0)
            scores[..., range(nb), range(nb)] = 2.0
            best = scores.topk(min(8, nb), -1)
            top = torch.where(best.values < 0, -1, best.indices)
            inputs["top"] = torch.nn.functional.pad(top, (0, 8 - top.shape[-1]), value=-1).int().to(DEVICE)
    return inputs


def check(name, got, ref, eager):
    rows = []
    for what, g, r, e in (("out", got[0], ref[0], eager[0]), ("lse", got[1], ref[1], eager[1])):
        err, err_eager = max_abs_error(g, r), max_abs_error(e, r)
        ok = within_tolerance(err, err_eager, DTYPE, r)
        rows.append({"tensor": what, "err": err, "eager_err": err_eager, "ok": ok})
    status = "ok" if all(r["ok"] for r in rows) else "FAIL"
    print(f"  {name:<58} out {rows[0]['err']:.2e} (eager {rows[0]['eager_err']:.2e})  "
          f"lse {rows[1]['err']:.2e} (eager {rows[1]['eager_err']:.2e})  {status}", flush=True)
    return rows


def correctness(variants: dict) -> list:
    print(f"correctness: {DTYPE} against decode_reference in float64 (rule: 2x the eager error "
          "in the same dtype + its resolution x scale)", flush=True)
    results = []
    lengths, capacity = LENGTHS, CAPACITY
    for vname, spec in variants.items():
        kernel = attncc.compile(spec)
        variant = kernel.variant
        for n_q in (1, 4):  # 4 new tokens are appended in place first; 1 is in the cache
            for paged in (False, True):
                seed = 7 * n_q + paged
                gen = torch.Generator().manual_seed(seed)
                mk = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)
                B, n_new = len(lengths), (n_q if n_q > 1 else 0)
                q = mk(B, HEADS[0], n_q, DIM)
                k, v = mk(B, HEADS[1], capacity, DIM), mk(B, HEADS[1], capacity, DIM)
                k_new, v_new = mk(B, HEADS[1], n_new, DIM), mk(B, HEADS[1], n_new, DIM)
                lens = torch.tensor([min(n, capacity - n_new) for n in lengths], dtype=torch.int32)
                lens = lens.to(DEVICE)
                inputs = device_inputs(variant, B, capacity, seed)
                ref_args = dict(cache_seqlens=lens, return_lse=True, **inputs)
                new = lambda t, cast: t.to(cast) if n_new else None
                ref = decode_reference(variant, q.double(), k.double(), v.double(),
                                       k_new=new(k_new, torch.float64), v_new=new(v_new, torch.float64),
                                       **ref_args)
                bf = lambda t: t.to(DTYPE)
                eager = decode_reference(variant, bf(q), bf(k), bf(v), k_new=new(k_new, DTYPE),
                                         v_new=new(v_new, DTYPE), **ref_args)
                kc, vc, table = bf(k), bf(v), None
                if paged:
                    kc, table = paged_copy(kc, 64, seed)
                    vc, _ = paged_copy(vc, 64, seed)
                got = kernel.decode(bf(q), kc, vc, cache_seqlens=lens, k_new=new(k_new, DTYPE),
                                    v_new=new(v_new, DTYPE), block_table=table, return_lse=True,
                                    **inputs)
                label = (f"{vname} n_q {n_q}{' appended' if n_new else ''} "
                         f"{'paged 64' if paged else 'contiguous'}")
                results.append({"case": label, "rows": check(label, got, ref, eager)})
    return results


def speed(variants: dict, sweep: bool) -> tuple:
    runs, checks = [], []
    for vname, spec in variants.items():
        kernel = attncc.compile(spec)
        for batch, length in SPEED_PROBLEMS:
            t0 = time.perf_counter()
            meta, results = bench_decode(kernel.variant, kernel, batch=batch, length=length,
                                         heads=HEADS, dim=DIM, n_q=1, page_size=64)
            meta["configs"] = {}
            for cache, page in (("contiguous", 0), ("paged", 64)):  # what the tuner chose
                p = DecodeProblem(batch, HEADS[0], HEADS[1], 1, 0, DIM, length, page)
                key = decoding.tuning_key(p, torch.bfloat16, None)
                meta["configs"][cache] = tuning._MEMORY.get((kernel.key, key))
            print(format_decode(meta, results), flush=True)
            print(f"  configs: {meta['configs']}  ({time.perf_counter() - t0:.0f} s with compiles)",
                  flush=True)
            checks.append(check_speed_output(vname, kernel, batch, length))
            if vname == "causal":  # every key is read: the GPU's own ceiling for these bytes
                meta["read_ceiling_bytes_per_s"] = read_ceiling(batch, length)
                print(f"  read ceiling (torch.sum over K and V): "
                      f"{meta['read_ceiling_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
            if sweep:
                meta["sweep"] = sweep_configs(kernel, batch, length)
            runs.append({**meta, "backends": results})
    return runs, checks


def read_ceiling(batch, length) -> float:
    """Bytes per second of a pure streaming read of a K and a V cache of this shape
    (torch.sum of each in fp32, timed as the decode steps are): what this GPU gives a
    kernel that only reads."""
    k, v = (torch.randn(batch, HEADS[1], length, DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    ms = time_ms(lambda: (k.sum(dtype=torch.float32), v.sum(dtype=torch.float32)))
    return 2 * k.numel() * k.element_size() / (ms * 1e-3)


def check_speed_output(vname, kernel, batch, length):
    """The speed problem's own output (one new token, full caches) against float64."""
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = mk(batch, HEADS[0], 1, DIM), mk(batch, HEADS[1], length, DIM), mk(batch, HEADS[1], length, DIM)
    inputs = device_inputs(kernel.variant, batch, length, 0)
    got = kernel.decode(q, k, v, cache_seqlens=length, return_lse=True, **inputs)
    ref = decode_reference(kernel.variant, q.double(), k.double(), v.double(), cache_seqlens=length,
                           return_lse=True, **inputs)
    eager = decode_reference(kernel.variant, q, k, v, cache_seqlens=length, return_lse=True, **inputs)
    label = f"{vname} batch {batch} x {length} (the speed problem)"
    return {"case": label, "rows": check(label, got, ref, eager)}


def sweep_configs(kernel, batch, length):
    """Every decode candidate (and more split counts) timed on one problem, on the
    contiguous cache and on the paged copy (page 64, shuffled), each called eagerly
    (do_bench, as the table) and replayed in a CUDA graph (do_bench_cudagraph: the
    kernels alone, no host time between them)."""
    import triton.testing
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = mk(batch, HEADS[0], 1, DIM), mk(batch, HEADS[1], length, DIM), mk(batch, HEADS[1], length, DIM)
    kp, table = paged_copy(k, 64, 0)
    vp, _ = paged_copy(v, 64, 0)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    inputs = device_inputs(kernel.variant, batch, length, 0)
    p = DecodeProblem(batch, HEADS[0], HEADS[1], 1, 0, DIM, length, 0)
    reach = lambda bn: kernel.module.decode_reach_tiles(length, 1, bn)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    configs = candidates(kernel.variant, p, 2, n_sm, reach)
    for splits in (8, 16, 32, 64, 128):
        c = dict(configs[0], num_splits=splits)
        if c not in configs:
            configs.append(c)
    calls = {"contiguous": lambda c: kernel.decode(q, k, v, cache_seqlens=lens, config=c, **inputs),
             "paged": lambda c: kernel.decode(q, kp, vp, cache_seqlens=lens, block_table=table,
                                              config=c, **inputs)}
    for c in configs:
        row = {"config": c}
        try:
            for cache, call in calls.items():
                row[cache] = time_ms(lambda: call(c))
                call(c)
                torch.cuda.synchronize()
                row[cache + "_graph"] = triton.testing.do_bench_cudagraph(lambda: call(c), rep=100,
                                                                          return_mode="median")
        except Exception as err:
            print(f"    {c}: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
            continue
        rows.append(row)
        print(f"    sweep {c}: " + ", ".join(f"{n} {row[n]:.4f}" for n in row if n != "config")
              + " ms", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["correctness", "speed", "all"], default="all")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names (default: all of the part's variants)")
    ap.add_argument("--sweep", action="store_true", help="also time every candidate config")
    ap.add_argument("--problems", default=None,
                    help="speed problems as BATCHxLENGTH, comma-separated (default: 8x32768,1x131072)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check this script without a GPU: the correctness part on small shapes "
                         "in float32 under the Triton interpreter")
    args = ap.parse_args()
    if args.cpu_smoke:
        global HEADS, DIM, DEVICE, DTYPE, LENGTHS, CAPACITY
        HEADS, DIM, DEVICE, DTYPE, LENGTHS, CAPACITY = (4, 2), 32, "cpu", torch.float32, [1, 40, 130], 192
        args.part = "correctness"
        os.environ["TRITON_INTERPRET"] = "1"  # read when the generated modules are imported
    pick = lambda table: {n: s for n, s in table.items()
                          if args.variants is None or n in args.variants.split(",")}
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"
    import triton
    report = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "peak_bytes_per_s": peak_bandwidth(name)}
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if args.part in ("correctness", "all"):
        # Correctness, not speed: the first candidate config, untuned (tuning compiles many).
        before = os.environ.get("ATTNCC_TUNE")
        os.environ["ATTNCC_TUNE"] = "0"
        report["correctness"] = correctness(pick(CORRECTNESS_VARIANTS))
        if before is None:
            del os.environ["ATTNCC_TUNE"]
        else:
            os.environ["ATTNCC_TUNE"] = before
    if args.problems:
        global SPEED_PROBLEMS
        SPEED_PROBLEMS = [tuple(int(n) for n in p.split("x")) for p in args.problems.split(",")]
    if args.part in ("speed", "all"):
        report["speed"], report["speed_checks"] = speed(pick(SPEED_VARIANTS), args.sweep)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)

    cases = report.get("correctness", []) + report.get("speed_checks", [])
    bad = [c["case"] for c in cases if not all(r["ok"] for r in c["rows"])]
    if cases:
        print(f"\ncorrectness: {len(cases) - len(bad)} of {len(cases)} cases within tolerance"
              + ("".join(f"\n  FAIL {c}" for c in bad)))
    if report.get("speed"):
        peak = report["peak_bytes_per_s"]
        print(f"\ndecode, 1 new token, heads 32/8, dim 128, bf16, {name} (peak "
              f"{peak / 1e12 if peak else float('nan'):.2f} TB/s)")
        print(f"{'variant':<8} {'problem':<11} {'attncc ms':>9} {'TB/s':>5} {'of peak':>7} "
              f"{'paged/contig':>12} {'vs flex':>8} {'vs sdpa':>8}")
        for r in report["speed"]:
            b = r["backends"]
            mine = b.get("attncc", {})
            if "ms" not in mine:
                print(f"{r['variant']:<8} attncc skipped: {mine.get('skipped')}")
                continue
            ratio = lambda other: (f"{b[other]['ms'] / mine['ms']:.2f}x" if "ms" in b.get(other, {})
                                   else "-")
            paged = (f"{b['attncc-paged']['ms'] / mine['ms']:.3f}" if "ms" in b.get("attncc-paged", {})
                     else "-")
            flex = ratio("flex") + ("" if b.get("flex", {}).get("decoding_kernel", True) else "*")
            frac = f"{mine['bytes_per_s'] / peak:.0%}" if peak else "-"
            print(f"{r['variant']:<8} {r['batch']}x{r['length']:<9} {mine['ms']:>9.4f} "
                  f"{mine['bytes_per_s'] / 1e12:>5.2f} {frac:>7} {paged:>12} {flex:>8} {ratio('sdpa'):>8}")
        print("(vs flex / sdpa: their time over attncc's; * flex did not use its decoding kernel)")
    print(f"wrote {os.path.join(out, 'decode.json')}")


if __name__ == "__main__":
    main()
