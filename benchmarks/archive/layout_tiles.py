"""Kernel tiles within a layout's block or larger than it: which is faster, per layout.

    python benchmarks/archive/layout_tiles.py [--seq 16384] [--block 16]

A tile larger than the block covers several blocks: it is visited when any of them is
on and evaluates the layout per element inside. That pays when on-blocks cluster (a
band) and costs when they are scattered (random). This times both kinds of layout,
forward and forward + backward, with tiles pinned within the block, pinned larger, and
as the tuner picks, on the same inputs, checking each output against the first.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attncc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    S, H, D, b = args.seq, 16, 128, args.block
    nb = S // b
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, generator=gen).cuda().bfloat16().requires_grad_()
               for _ in range(3))
    do = torch.randn_like(q)
    layouts = {
        # 8 blocks either side of the diagonal: clustered on-blocks.
        "band": (f"attention band {{ layout abs(qb - kb) <= 8 block {b} }}", {}),
        # The same density scattered at random.
        "random": (f"attention rnd {{ input blocks: bool[h, qb, kb] layout blocks[h, qb, kb] block {b} }}",
                   {"blocks": (torch.rand(H, nb, nb, generator=gen) < 17 / nb).cuda()}),
    }
    pins = {"within": dict(BLOCK_M=b, BLOCK_N=b, num_warps=4, num_stages=2),
            "64x64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
            "tuned": None}
    rows = []
    for name, (spec, inputs) in layouts.items():
        want = None
        for label, config in pins.items():
            kern = attncc.compile(spec, config=config)
            fn = lambda: kern(q, k, v, **inputs)
            out = fn()
            err = 0.0 if want is None else (out.float() - want.float()).abs().max().item()
            want = out if want is None else want
            t_f = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
            t_fb = triton.testing.do_bench(lambda: torch.autograd.grad(fn(), (q, k, v), do),
                                           warmup=10, rep=100, return_mode="median")
            rows.append((name, label, t_f, t_fb - t_f, err))
            print(f"{name:7s} {label:7s} fwd {t_f:7.3f} ms  bwd {t_fb - t_f:7.3f} ms  err {err:.1e}",
                  flush=True)
    print(f"\nS={S} H={H} D={D} bf16, block {b}, {torch.cuda.get_device_name()}")
    print("layout  tiles     fwd ms   bwd ms   max diff")
    for name, label, f, bw, err in rows:
        print(f"{name:7s} {label:7s} {f:8.3f} {bw:8.3f}   {err:.1e}")


if __name__ == "__main__":
    main()
