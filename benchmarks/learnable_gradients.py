"""GPU timing and determinism of learnable inputs' gradients (learned ALiBi slopes, T5
bias tables, a clipped relative table, a per-(b, h, k) gain), forward + backward, bf16.

    python benchmarks/learnable_gradients.py [--lengths 16384] [--cases t5_causal,...]
        [--tune 0] [--config JSON] [--baseline /path/to/tree] [--baseline-timeout 300] [--flex]

Each case times forward + backward (CUDA events around each call, after warm-up calls;
the median, ms) of one attncc variant whose learnable input takes gradients, runs the
backward `--repeats` times more and says whether every gradient came out bit-identical,
and reports which kernels ran (kernel.last_backward) and which owner each learnable read
got (attncc/analysis/gradient_owners.py). With --baseline, a checkout of another attncc
(say the commit before owned gradients, which added them all with fp32 atomics:
`git worktree add /tmp/atomic d2a9a27`) times the same cases on the same inputs in a
subprocess, and the table shows both. With --flex, FlexAttention's Triton kernels run the
same cases (a score_mod closing over the same learnable tensors, so its captured-buffer
gradients are what is timed) and report their largest difference from attncc's output
and gradients. Results go to $OUT/learnable_gradients.json.

A fair and quick comparison pins the tile configs on both sides: `--tune 0` (each
kernel's first candidate, untimed: ATTNCC_TUNE=0) or `--config` (one config for every
kernel: ATTNCC_CONFIG). Without either, each side autotunes its first call, timing up to
four configs per kernel, each compiled cold (the baseline's kernels in a cache of their
own): about 12 compiles per case and side, and the atomic baseline's table gradients add
one fp32 atomic per (b, h, q, k) pair into 32 addresses per head (4e9 at 16K tokens and
16 heads), so each timed call of a candidate may be slow too. Runs 143-144 ran every
case that way and did not finish in 600 s; pinned, a case is 3 compiles a side. Timing
stops after --budget seconds per case (one timed call at least), and the baseline
subprocess after --baseline-timeout: the cases it finished are kept, the others show nan.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

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
        score s + table[h, where(q - k < 16, max(q - k, 0),
            min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) * 16.0), 31))] }""",
    "relative_511": """attention relative_511 { learnable input bias: f32[h, 511]
        score s + bias[h, min(max(q - k, -255), 255) + 255] }""",
    "key_gain": """attention key_gain { learnable input g: f32[b, h, k] mask q >= k
        score s + g[b, h, k] }""",
}


def inputs_for(name, variant, L, heads, dim, batch):
    """q, k, v, dout and the learnable inputs of one case: seeded, the same on both sides."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, L, dim, device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))
    inputs = {}
    for d in variant.inputs:
        shape = [{"b": batch, "h": heads, "q": L, "k": L}.get(a, a) for a in d.axes]
        inputs[d.name] = torch.randn(shape, device="cuda", generator=gen) * 0.1
    if name == "learned_alibi":
        inputs["sl"] = torch.logspace(-1, -8, heads, base=2, device="cuda")
    return [t.requires_grad_() for t in (q, k, v)], dout, {n: t.requires_grad_() for n, t in inputs.items()}


def flex_score_mod(name, inputs):
    """FlexAttention's score_mod (and whether the case is causal) for a case: the same
    formula as its attncc spec, closing over the same learnable tensors, so Flex's
    captured-buffer gradients are the ones timed."""
    import math

    def t5_large(a, exact, span, top):  # min(exact + int(log(a / exact) / log(span / exact) * exact), top)
        big = exact + (torch.log(a.clamp(min=exact).float() / exact) / math.log(span / exact) * exact).to(torch.int32)
        return torch.clamp(big, max=top)

    if name == "learned_alibi":
        sl = inputs["sl"]
        return (lambda s, b, h, q, k: s + sl[h] * (k - q)), True
    if name == "t5_bidirectional":
        table = inputs["table"]

        def mod(s, b, h, q, k):
            a = torch.abs(k - q)
            bucket = torch.where(k > q, 16, 0) + torch.where(a < 8, a, t5_large(a, 8, 128.0, 15))
            return s + table[h, bucket]
        return mod, False
    if name == "t5_causal":
        table = inputs["table"]

        def mod(s, b, h, q, k):
            d = q - k
            # Flex evaluates masked pairs of a partial block too: keep their index in range.
            return s + table[h, torch.where(d < 16, d.clamp(min=0), t5_large(d, 16, 128.0, 31))]
        return mod, True
    if name == "relative_511":
        bias = inputs["bias"]
        return (lambda s, b, h, q, k: s + bias[h, torch.clamp(q - k, -255, 255) + 255]), False
    if name == "key_gain":
        g = inputs["g"]
        return (lambda s, b, h, q, k: s + g[b, h, k]), True
    raise KeyError(name)


def run_flex(cases, lengths, heads, dim, batch, repeats, reps, budget_s) -> list:
    """The same cases through FlexAttention's Triton kernels (torch.compile'd
    flex_attention, a block mask for the causal ones), on the same inputs: its time, its
    gradients' determinism, and its largest difference from attncc's output and learnable
    gradients (the two compute the same function, so a large one means a wrong case)."""
    import attncc
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for L in lengths:
        for name in cases:
            variant = attncc.parse(CASES[name])
            (q, k, v), dout, inputs = inputs_for(name, variant, L, heads, dim, batch)
            score_mod, causal = flex_score_mod(name, inputs)
            mask = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L)
                    if causal else None)
            from attncc.semantics.reference import scale_value
            scale = scale_value(variant, dim)
            leaves = [q, k, v, *inputs.values()]

            def step():
                out = flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale)
                return (out, *torch.autograd.grad(out, leaves, dout))
            try:
                first = step()
                torch.cuda.synchronize()
            except Exception as err:  # Flex refusing a case is a result, not a crash
                rows.append(dict(case=name, L=L, skipped=f"{type(err).__name__}: {str(err)[:300]}"))
                print(json.dumps(rows[-1]), flush=True)
                continue
            same = all(all(torch.equal(a, b) for a, b in zip(first[1:], step()[1:]))
                       for _ in range(repeats))
            kernel = attncc.compile(variant)
            out = kernel(q, k, v, **inputs)
            mine = torch.autograd.grad(out, list(inputs.values()), dout)
            diff = {"out": (out.float() - first[0].float()).abs().max().item()}
            for (n, t), a in zip(inputs.items(), mine):
                scale_g = a.abs().max().item() or 1.0
                diff[n] = (a - first[4 + list(inputs).index(n)]).abs().max().item() / scale_g
            ms, timed = median_ms(lambda: step(), warmup=2, reps=reps, budget_s=budget_s)
            rows.append(dict(case=name, L=L, ms=ms, calls_timed=timed, bit_identical=same,
                             max_diff_vs_attncc=diff))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def median_ms(step, warmup: int, reps: int, budget_s: float) -> tuple:
    """(median ms, calls timed): `warmup` untimed calls, then up to `reps` calls timed
    one by one with CUDA events, stopping once `budget_s` has passed (one at least)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - start < budget_s):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times), len(times)


def run_cases(cases, lengths, heads, dim, batch, repeats, reps, budget_s) -> list:
    """Time `cases` in this process's attncc (the one on sys.path)."""
    import attncc
    rows = []
    for L in lengths:
        for name in cases:
            variant = attncc.parse(CASES[name])
            (q, k, v), dout, inputs = inputs_for(name, variant, L, heads, dim, batch)
            kernel = attncc.compile(variant)
            leaves = [q, k, v, *inputs.values()]

            def step():
                out = kernel(q, k, v, **inputs)
                return torch.autograd.grad(out, leaves, dout)

            began = time.perf_counter()
            first = step()  # compiles, and tunes unless the configs are pinned
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - began
            same = all(all(torch.equal(a, b) for a, b in zip(first, step())) for _ in range(repeats))
            ms, timed = median_ms(step, warmup=2, reps=reps, budget_s=budget_s)
            try:
                from attncc.analysis.gradient_owners import gradient_owners, learnable_reads
                owners = [o.kind for o in gradient_owners(variant, learnable_reads(variant))]
            except ImportError:  # a baseline from before owned gradients
                owners = ["atomics"]
            rows.append(dict(case=name, L=L, ms=ms, calls_timed=timed, bit_identical=same,
                             first_call_s=round(first_call_s, 1), owners=owners,
                             last_backward=repr(kernel.last_backward)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_baseline(tree, argv, timeout_s) -> list:
    """The same cases timed by the attncc in `tree`, in a subprocess; its rows as they
    came, up to `timeout_s` (the subprocess is stopped there)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # the baseline first, then the rest
                   [os.path.abspath(tree), os.environ.get("PYTHONPATH", "")]),
               ATTNCC_CACHE_DIR=os.environ.get("ATTNCC_CACHE_DIR", "/tmp/attncc") + "-baseline")
    rows, started = [], time.perf_counter()
    with subprocess.Popen([sys.executable, __file__, "--rows-only", *argv], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            print(f"baseline stopped after {time.perf_counter() - started:.0f} s (--baseline-timeout)")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if proc.returncode:
            print(err[-3000:])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tune", choices=["0", "1", "full"],
                    help="ATTNCC_TUNE for both sides (0: each kernel's first config, untimed)")
    ap.add_argument("--config", help="ATTNCC_CONFIG for both sides, e.g. "
                    '\'{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}\'')
    ap.add_argument("--repeats", type=int, default=5, help="backwards compared bit for bit")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per case, at most")
    ap.add_argument("--budget", type=float, default=10.0, help="seconds of timed calls per case")
    ap.add_argument("--baseline", help="another attncc checkout to time the same cases with")
    ap.add_argument("--baseline-timeout", type=float, default=300.0)
    ap.add_argument("--flex", action="store_true",
                    help="also time FlexAttention (Triton) with the same captured-buffer gradients")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; the cases are {', '.join(CASES)}")
    if args.tune is not None:
        os.environ["ATTNCC_TUNE"] = args.tune  # the baseline's subprocess inherits both
    if args.config is not None:
        os.environ["ATTNCC_CONFIG"] = args.config
    timing = (args.repeats, args.reps, args.budget)
    if args.rows_only:  # the baseline's subprocess: its attncc comes first on sys.path
        run_cases(cases, lengths, args.heads, args.dim, args.batch, *timing)
        return
    sys.path.insert(0, os.path.join(HERE, ".."))
    mine = run_cases(cases, lengths, args.heads, args.dim, args.batch, *timing)
    base = []
    if args.baseline:
        argv = ["--lengths", args.lengths, "--cases", args.cases, "--heads", str(args.heads),
                "--dim", str(args.dim), "--batch", str(args.batch), "--repeats", str(args.repeats),
                "--reps", str(args.reps), "--budget", str(args.budget)]
        base = run_baseline(args.baseline, argv, args.baseline_timeout)
    flex = run_flex(cases, lengths, args.heads, args.dim, args.batch, *timing) if args.flex else []
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "learnable_gradients.json"), "w") as f:
        json.dump(dict(owned=mine, baseline=base, flex=flex, tune=args.tune, config=args.config),
                  f, indent=1)
    by_case = {(r["case"], r["L"]): r for r in base}
    flex_of = {(r["case"], r["L"]): r for r in flex}
    print(f"\n{'case':18s} {'L':>6s} {'owned ms':>9s} {'same bits':>9s} {'baseline ms':>11s} "
          f"{'same bits':>9s} {'flex ms':>8s} {'same bits':>9s}  owners")
    for r in mine:
        b = by_case.get((r["case"], r["L"]), {})
        f = flex_of.get((r["case"], r["L"]), {})
        print(f"{r['case']:18s} {r['L']:6d} {r['ms']:9.2f} {str(r['bit_identical']):>9s} "
              f"{b.get('ms', float('nan')):11.2f} {str(b.get('bit_identical', '-')):>9s} "
              f"{f.get('ms', float('nan')):8.2f} {str(f.get('bit_identical', '-')):>9s}  "
              f"{','.join(r['owners'])}")


if __name__ == "__main__":
    main()
