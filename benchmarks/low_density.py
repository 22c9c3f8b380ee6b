"""Each kernel alone at low tile density, over every tile config: where the time goes
when a program visits only a few tiles.

    python benchmarks/low_density.py [--seq 16384] [--densities 0.03,0.06] [--extra 'fwd:64x64w4s2;...']

The density curve's layout (benchmarks/density_curve.py: random per-head 128-blocks,
the same number per row, diagonal included), S = 16384, H = 16, D = 128, bf16. For
each density, the forward, dK/dV and dQ kernels are timed on their own (module
functions, no autograd or tuner; do_bench median, same inputs) at every candidate
config that keep() allows, beside dense attention's time for the same kernel at its
best config. The line each kernel should stay under is the density curve's:
1.2 * d * dense + dense / blocks. Each output is checked against the first config's.
Prints a table last; writes JSON to $OUT/low_density.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402
from attncc import tuning  # noqa: E402
from density_curve import BLOCK, DENSE_SPEC, model_ms, random_layout, sparse_spec  # noqa: E402

KERNELS = ("fwd", "dkdv", "dq", "bwd")  # bwd: dK/dV and dQ in one launch (layouts only)
EXTRA: dict = {}  # kernel -> configs timed after the candidates (--extra)


def launcher(module, kernel, q, k, v, out, lse, delta, do, inputs, config):
    if kernel == "fwd":
        return lambda: module.forward(q, k, v, inputs, config=config)
    if kernel == "bwd":
        return lambda: module.backward_one_launch(q, k, v, lse, delta, do, inputs, config=config)[:3]
    if kernel == "dq":
        return lambda: module.backward_dq(q, k, v, lse, delta, do, inputs, config=config)[:1]
    return lambda: module.backward_dkdv(q, k, v, lse, delta, do, inputs, config=config)


def sweep(kern, kernel, tensors, inputs, label, at_most=None):
    """[(ms, config label, max abs diff to the first)] over the kept candidates."""
    q, k, v, do = tensors
    m = kern.module
    first = tuning.kept_candidates(kern.variant, q.shape[-1], "fwd")[0]
    out, lse = m.forward(q, k, v, inputs, config=first)
    delta = m.backward_delta(out, do)
    rows, want = [], None
    configs = tuning.kept_candidates(kern.variant, q.shape[-1], kernel)[:at_most]
    if kern.variant.name != "dense":
        configs += [c for c in EXTRA.get(kernel, []) if c not in configs]
    for config in configs:
        name = tuning._label(config)
        run = launcher(m, kernel, q, k, v, out, lse, delta, do, inputs, config)
        try:
            got = run()
            if want is None:
                want = got
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001 - out of resources: say so, go on
            print(f"{label} {kernel} {name}: {type(e).__name__}", flush=True)
            continue
        rows.append((ms, name, diff))
        print(f"{label:6s} {kernel:5s} {name:14s} {ms:8.3f} ms  diff {diff:.1e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--densities", default="0.03,0.06")
    ap.add_argument("--extra", default="",
                    help="configs to time after the candidates, e.g. 'fwd:64x64w4s2,64x32w4s1;dq:64x64w4s1'")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--at-most", type=int, default=None,
                    help="time only the first N kept candidates (and the --extra ones)")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    for entry in filter(None, args.extra.split(";")):
        kernel, _, listed = entry.partition(":")
        EXTRA[kernel] = [dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                                  map(int, re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", c).groups())))
                         for c in listed.split(",")]
    S, H, D = args.seq, 16, 128
    nb = S // BLOCK
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, H, S, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(4)]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "seq": S, "block": BLOCK, "rows": {}}
    dense = attncc.compile(DENSE_SPEC)
    best_dense = {}
    for kernel in KERNELS[:3]:
        rows = sweep(dense, kernel, tensors, {}, "dense", at_most=4)  # its winners are in these
        results["rows"][f"dense-{kernel}"] = rows
        best_dense[kernel] = min(rows)[0]
    best_dense["bwd"] = best_dense["dkdv"] + best_dense["dq"]  # dense runs them apart
    sparse = attncc.compile(sparse_spec(BLOCK))
    table = []
    for d in (float(x) for x in args.densities.split(",")):
        layout = random_layout(H, nb, d, gen).cuda()
        actual = layout.float().mean().item()
        for kernel in kernels:
            rows = sweep(sparse, kernel, tensors, {"blocks": layout}, f"d={d:g}", args.at_most)
            results["rows"][f"{d}-{kernel}"] = rows
            tuned = min(rows[:tuning.TUNE_AT_MOST])
            best = min(rows)
            line = model_ms(best_dense[kernel], actual, nb)
            table.append((d, kernel, best_dense[kernel], line, tuned, best))
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "low_density.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['gpu']}, torch {results['torch']}, triton {results['triton']}; "
          f"S={S} H={H} D={D} bf16, block {BLOCK}; kernels alone, ms")
    print(f"{'d':>5s} {'kernel':6s} {'dense':>7s} {'line':>7s} | {'first 4 best':>20s} | "
          f"{'all best':>20s} | ratio to line")
    for d, kernel, dense_ms, line, tuned, best in table:
        print(f"{d:5.3f} {kernel:6s} {dense_ms:7.3f} {line:7.3f} | {tuned[1]:>12s} {tuned[0]:7.3f} | "
              f"{best[1]:>12s} {best[0]:7.3f} | {tuned[0] / line:.2f} / {best[0] / line:.2f}")


if __name__ == "__main__":
    main()
