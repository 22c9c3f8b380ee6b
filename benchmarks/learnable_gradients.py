"""GPU timing and determinism of learnable inputs' gradients (learned ALiBi slopes, T5
bias tables, a clipped relative table, a per-(b, h, k) gain), forward + backward, bf16.

    python benchmarks/learnable_gradients.py [--lengths 16384] [--baseline /path/to/tree]

Each case times forward + backward (do_bench, ms) of one attncc variant whose learnable
input takes gradients, runs the backward 5 times more and says whether every gradient
came out bit-identical, and reports which kernels ran (kernel.last_backward) and which
owner each learnable read got (attncc/analysis/gradient_owners.py). With --baseline, a
checkout of another attncc (say the commit before owned gradients, which added them all
with fp32 atomics: `git worktree add /tmp/atomic d2a9a27`) times the same cases in a
subprocess, and the table shows both. Results go to $OUT/learnable_gradients.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

OUT = os.environ.get("OUT", "out")
HERE = os.path.dirname(os.path.abspath(__file__))

T5_BUCKETS = ("where(k > q, 16, 0) + where(abs(k - q) < 8, abs(k - q), "
              "min(8 + int(log(max(abs(k - q), 1) / 8.0) / log(128.0 / 8.0) * 8.0), 15))")
CASES = {
    "learned_alibi": """attention learned_alibi { learnable input sl: f32[h]
        mask q >= k score s + sl[h] * (k - q) }""",
    "t5_bidirectional": f"""attention t5_bidirectional {{ scale 1.0
        learnable input table: f32[h, 32] score s + table[h, {T5_BUCKETS}] }}""",
    "t5_causal": """attention t5_causal { learnable input table: f32[h, 32] mask q >= k
        score s + table[h, where(q - k < 16, q - k,
            min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) * 16.0), 31))] }""",
    "relative_511": """attention relative_511 { learnable input bias: f32[h, 511]
        score s + bias[h, min(max(q - k, -255), 255) + 255] }""",
    "key_gain": """attention key_gain { learnable input g: f32[b, h, k] mask q >= k
        score s + g[b, h, k] }""",
}


def run_cases(lengths, heads, dim, batch) -> list:
    """Time every case in this process's attncc (the one on sys.path)."""
    import attncc
    from triton.testing import do_bench
    rows = []
    for L in lengths:
        for name, spec in CASES.items():
            variant = attncc.parse(spec)
            torch.manual_seed(0)
            q, k, v = (torch.randn(batch, heads, L, dim, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            inputs = {}
            for d in variant.inputs:
                shape = [{"b": batch, "h": heads, "q": L, "k": L}.get(a, a) for a in d.axes]
                inputs[d.name] = (torch.randn(shape, device="cuda") * 0.1).requires_grad_()
            if name == "learned_alibi":
                inputs["sl"] = torch.logspace(-1, -8, heads, base=2, device="cuda").requires_grad_()
            kernel = attncc.compile(variant)
            dout = torch.randn_like(q)
            leaves = [q, k, v, *inputs.values()]

            def step():
                out = kernel(q, k, v, **inputs)
                return torch.autograd.grad(out, leaves, dout)

            first = step()
            same = all(all(torch.equal(a, b) for a, b in zip(first, step())) for _ in range(5))
            ms = do_bench(step, warmup=25, rep=200)
            try:
                from attncc.analysis.gradient_owners import gradient_owners, learnable_reads
                owners = [o.kind for o in gradient_owners(variant, learnable_reads(variant))]
            except ImportError:  # a baseline from before owned gradients
                owners = ["atomics"]
            rows.append(dict(case=name, L=L, ms=ms, bit_identical=same, owners=owners,
                             last_backward=repr(kernel.last_backward)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--baseline", help="another attncc checkout to time the same cases with")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.rows_only:  # the baseline's subprocess: its attncc comes first on sys.path
        run_cases(lengths, args.heads, args.dim, args.batch)
        return
    sys.path.insert(0, os.path.join(HERE, ".."))
    mine = run_cases(lengths, args.heads, args.dim, args.batch)
    base = []
    if args.baseline:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # the baseline first, then the rest
                       [os.path.abspath(args.baseline), os.environ.get("PYTHONPATH", "")]),
                   ATTNCC_CACHE_DIR=os.environ.get("ATTNCC_CACHE_DIR", "/tmp/attncc-baseline"))
        done = subprocess.run([sys.executable, __file__, "--rows-only", "--lengths", args.lengths,
                               "--heads", str(args.heads), "--dim", str(args.dim),
                               "--batch", str(args.batch)], env=env, capture_output=True,
                              text=True)
        base = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode:
            print(done.stderr[-3000:])
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "learnable_gradients.json"), "w") as f:
        json.dump(dict(owned=mine, baseline=base), f, indent=1)
    by_case = {(r["case"], r["L"]): r for r in base}
    print(f"\n{'case':18s} {'L':>6s} {'owned ms':>9s} {'same bits':>9s} {'baseline ms':>11s} "
          f"{'same bits':>9s}  owners")
    for r in mine:
        b = by_case.get((r["case"], r["L"]), {})
        print(f"{r['case']:18s} {r['L']:6d} {r['ms']:9.2f} {str(r['bit_identical']):>9s} "
              f"{b.get('ms', float('nan')):11.2f} {str(b.get('bit_identical', '-')):>9s}  "
              f"{','.join(r['owners'])}")


if __name__ == "__main__":
    main()
