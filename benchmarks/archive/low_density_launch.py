"""One kernel of the density curve's layout, launched a few times: a target for Nsight
Compute (ncu), which profiles one launch of it.

    ncu --kernel-name attn_fwd --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/archive/low_density_launch.py [--density 0.03] [--kernel fwd|bwd] [--config 64x32w4s2]

The layout is density_curve.py's (random per-head 128-blocks, S = 16384, H = 16,
D = 128, bf16); the module functions are called directly, with the config given.
"""
import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # density_curve
import attncc  # noqa: E402
from density_curve import BLOCK, random_layout, sparse_spec  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--density", type=float, default=0.03)
ap.add_argument("--kernel", choices=("fwd", "bwd"), default="fwd")
ap.add_argument("--config", default="64x32w4s2")
ap.add_argument("--launches", type=int, default=4)
args = ap.parse_args()
m, n, w, s = map(int, re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", args.config).groups())
config = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
S, H, D = 16384, 16, 128
gen = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(1, H, S, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
inputs = {"blocks": random_layout(H, S // BLOCK, args.density, gen).cuda()}
module = attncc.compile(sparse_spec(BLOCK)).module
out, lse = module.forward(q, k, v, inputs, config=config)
delta = module.backward_delta(out, do)
for _ in range(args.launches):
    if args.kernel == "fwd":
        module.forward(q, k, v, inputs, config=config)
    else:
        module.backward_one_launch(q, k, v, lse, delta, do, inputs, config=config)
torch.cuda.synchronize()
print(f"launched {args.kernel} {args.config} at density {args.density} {args.launches} times")
