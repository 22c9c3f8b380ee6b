"""GPU measurement of the forward's fixed cost per program: what a query tile costs beyond
its key tiles (Q's load, the pipeline's fill, the output's store, the launch of one more
program), from causal sliding windows of growing width.

    python benchmarks/program_overhead.py [--windows 128,256,512,1024,2048,4096]

Each window w gives every query tile about w / BLOCK_N + 1 key tiles, so the forward's
time is close to a + b * tiles: the fit's slope b is one key tile's time and its
intercept a the per-program cost, both per SM (the time times the SMs, over the
programs). A persistent forward, which overlaps one tile's epilogue with the next one's
prologue, could save at most a's share. Each forward is checked against the float64
reference on a 1024-token call first. bf16, 16K tokens, 16 heads, D=128, do_bench
medians, each backend's forward (Gluon's and the portable one); ATTNCC_TUNE as set (the
same config for every window with ATTNCC_TUNE=0). Full
results go to $OUT/program_overhead.json; a table and the fit are printed last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
from attncc.semantics.tolerance import max_abs_error, within_tolerance  # noqa: E402

OUT = os.environ.get("OUT", "out")
SPEC = "attention window_{w} {{ mask q >= k and q - k < {w} }}"


def visited_tiles(w: int, n: int, block_m: int, block_n: int) -> float:
    """Key tiles a query tile visits, averaged over the query tiles (the first ones see
    fewer keys)."""
    total = 0
    for t in range(math.ceil(n / block_m)):
        q_lo, q_hi = t * block_m, min(n, (t + 1) * block_m) - 1
        k_lo, k_hi = max(0, q_lo - w + 1), q_hi
        total += k_hi // block_n - k_lo // block_n + 1
    return total / math.ceil(n / block_m)


def check(kernel) -> bool:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 1024, 128, generator=gen).to("cuda", torch.bfloat16)
               for _ in range(3))
    truth = attncc.reference(kernel.variant, q.double(), k.double(), v.double())
    eager = attncc.reference(kernel.variant, q, k, v)
    err = max_abs_error(kernel(q, k, v), truth)
    return within_tolerance(err, max_abs_error(eager, truth), torch.bfloat16, truth)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="128,256,512,1024,2048,4096")
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--block", type=int, default=128, help="the forward's BLOCK_M = BLOCK_N")
    ap.add_argument("--backends", default="gluon,triton",
                    help="each backend's forward, compiled with backend= that name")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, args.len, 128, generator=gen).to("cuda", torch.bfloat16)
               for _ in range(3))
    programs = 16 * math.ceil(args.len / args.block)
    rows, fits = [], {}
    for backend in args.backends.split(","):
        for w in map(int, args.windows.split(",")):
            kernel = attncc.compile(attncc.parse(SPEC.format(w=w)), backend=backend)
            ok = check(kernel)
            kernel(q, k, v)  # tunes and compiles
            ms = triton.testing.do_bench(lambda: kernel(q, k, v), return_mode="median")
            tiles = visited_tiles(w, args.len, args.block, args.block)
            # µs of one SM's time a program takes: the time times the SMs over the programs
            rows.append({"backend": backend, "window": w, "ok": ok, "ms": ms,
                         "tiles_per_program": tiles, "us_per_program_sm": ms * 1e3 * sms / programs})
        xs = [r["tiles_per_program"] for r in rows if r["backend"] == backend]
        ys = [r["us_per_program_sm"] for r in rows if r["backend"] == backend]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fits[backend] = {"us_per_key_tile": slope, "us_per_program": my - slope * mx}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "program_overhead.json"), "w") as f:
        json.dump({"rows": rows, "fits": fits, "sms": sms, "programs": programs,
                   "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__}, f, indent=1)
    print(f"{'backend':8} {'window':>7} {'ok':>5} {'ms':>8} {'tiles/prog':>10} {'µs/prog/SM':>11}")
    for r in rows:
        print(f"{r['backend']:8} {r['window']:7} {str(r['ok']):>5} {r['ms']:8.3f} "
              f"{r['tiles_per_program']:10.2f} {r['us_per_program_sm']:11.2f}")
    for backend, fit in fits.items():
        print(f"fit {backend}: {fit['us_per_key_tile']:.3f} µs a key tile, "
              f"{fit['us_per_program']:.3f} µs a program (per SM, {sms} SMs)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
