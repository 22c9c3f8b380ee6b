"""One forward each of attncc's Gluon kernel and FlashAttention-4's on the same inputs,
for Nsight Compute to profile side by side (where the tensor cores wait, what the warps
stall on, the clock the kernels ran at).

    ncu --kernel-name regex:'attn_fwd|flash' --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats --csv --page details \
        python benchmarks/profile_forward.py [--variant causal] > $OUT/ncu.csv

Each backend runs `--calls` times (the first ones compile and tune); correctness is
the other scripts' job. Without FA4 on the path only attncc's kernel runs.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402

VARIANTS = {"causal": "attention causal { mask q >= k }", "full": "attention full { }"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="causal", choices=sorted(VARIANTS))
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_forward.py runs GPU kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.len, args.dim, generator=gen)
               .to("cuda", torch.bfloat16) for _ in range(3))
    gluon = attncc.compile(VARIANTS[args.variant], backend="gluon")
    with torch.no_grad():
        for _ in range(args.calls):
            gluon(q, k, v)
        torch.cuda.synchronize()
        try:
            from flash_attn.cute import flash_attn_func
        except ImportError as err:
            print(f"FA4 not on the path ({err}): attncc's kernel only", file=sys.stderr)
            return 0
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for _ in range(args.calls):
            flash_attn_func(qt, kt, vt, causal=args.variant == "causal")
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
