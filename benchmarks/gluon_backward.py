"""GPU script for the Gluon backend's backward (issue 18, stage 3): the dQ and dK/dV
kernels checked against the float64 reference, then timed against the portable ones, in
one call; and the fused backward of deterministic=False (issue 32), checked and timed.

    python benchmarks/gluon_backward.py [--part correctness|speed|all] [--variants full,causal]
    python benchmarks/gluon_backward.py --part speed --dim 192 --dim-v 128
    python benchmarks/gluon_backward.py --part fused [--sweep causal,...] [--variants full,...]
    python benchmarks/gluon_backward.py --part fused-speed [--variants full,causal] [--dim 64]

Correctness: each example variant the Gluon backward takes, on awkward shapes (300
tokens over two batches with GQA 4/2; len_q 200 != len_k 517; one query token; head dim
64 too; fp16 too; (q·k, v) (192, 128) and head dim 256, every config there on the
awkward shapes), the other configs on a few; dQ (computing delta itself), dK and dV of
the Gluon kernels, fed the portable forward's output and LSE, held to
attncc/semantics/tolerance.py's rule against attncc.reference in float64. Variants with
learnable score inputs whose gradients the Gluon kernels own (LEARNABLE: learned ALiBi
slopes, a per-query and a per-key gain, T5 bias tables, besides the relative_bias
example) also hold each input's gradient to the float64 reference (error scale
tolerance.input_gradient_scales) and the learned ALiBi slopes' to an independent dense
formula, and repeat the backward to check that every gradient comes out bit-identical.
A watchdog names a case that hangs.

Speed: the ANCHORS shape (bf16, 16 heads, 16384 tokens, head dim --dim, v's --dim-v,
e.g. DeepSeek-V3's 192 and 128): each kernel's
portable candidates (the four the tuner times) against every Gluon config, the same
inputs, medians of do_bench, ms. Full results go to $OUT/gluon_backward-PART.json; a short
table is printed last.

Fused (--part fused): which Triton runs and how its fused backward adds dQ (a TMA
reduce-add per partial from Triton 3.8, per-element atomics on 3.6), then correctness
through the public call, kernel(..., deterministic=False) under autograd with a loss
that reads the LSE too: last_backward must name the fused Gluon backward, and dq, dk, dv
must hold attncc/semantics/tolerance.py's rule against the float64 reference, on the
awkward shapes above (GQA, len_q != len_k, one query token, a chunk at q_offset 317,
head dim 64, fp16), every variant the fused kernel takes; each further fused config on
a few, through the launcher (--sweep: only these examples). Then (fused-speed: only)
speed at the ANCHORS shape (head dim --dim; --variants,
default full, causal, causal_gqa 32/8, sliding_window 1024, causal + softcap 30): the
whole backward as each schedule launches it, the fused Gluon one (delta pass, the
kernel, dQ's cast) per config, the split Gluon kernels (dQ computing delta, then dK/dV)
and the portable split at their first configs, with each fused config's largest
difference from the split Gluon gradients.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import traceback

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import attncc  # noqa: E402
from attncc.arguments import Problem  # noqa: E402
from attncc import backends  # noqa: E402
from attncc.backends.base import FUSED  # noqa: E402
from attncc.backends.gluon import (fused_dq_add, fused_variant_unsupported,  # noqa: E402
                                   kernel_unsupported, tiles)
from attncc.semantics.samples import sample_inputs  # noqa: E402
from attncc.semantics.tolerance import (gradient_scales, input_gradient_scales,  # noqa: E402
                                        max_abs_error, within_tolerance)
from gluon_check import LEARNABLE, Watchdog, learned_inputs, realistic_inputs  # noqa: E402

OUT = os.environ.get("OUT", "out")
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
RESULTS: dict = {"correctness": [], "speed": []}
PART = "all"  # --part, for the results file's name


def _write():
    os.makedirs(OUT, exist_ok=True)
    # One file per part: a speed-only call must not overwrite a correctness call's results.
    with open(os.path.join(OUT, f"gluon_backward-{PART}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


GLUON, PORTABLE = backends.named("gluon"), backends.portable()

REPEATS = 3  # backward calls after the first whose gradients must match it bit for bit


def _dicts(configs):
    """Tile configs as the dicts a generated module's config= takes."""
    return [c.as_dict() for c in configs]


def portable_candidates(variant, D, direction):
    return _dicts(PORTABLE.candidates(direction, D, variant))


def backward_candidates(D):
    return _dicts(tiles.backward_candidates(D))


def dq_candidates(D):
    return _dicts(tiles.dq_candidates(D))


def _label(c):
    return f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"


def fused_candidates(D):
    return _dicts(tiles.fused_candidates(D))


def check_dkdv(variant, *, B, Hq, Hkv, Lq, Lk, D, dtype, config, dq_config, seed=0, q_offset=0,
               k_offset=0, Dv=None):
    """Rows (tensor, err, eager_err, ok) for the Gluon dQ (with its delta) and dK/dV
    kernels on one problem (v `Dv` wide, D where not given)."""
    dev = "cuda"
    Dv = Dv or D
    torch.manual_seed(seed)
    if variant.heads:
        Hq, Hkv = variant.heads.q, variant.heads.kv
    p = Problem(B, Hq, Hkv, Lq, Lk, D, Dv, q_offset, k_offset)
    inputs = realistic_inputs(sample_inputs(variant, p, seed=seed, device=dev), Hq)
    q, k, v = (torch.randn(B, h, n, d, device=dev, dtype=torch.float64).to(dtype)
               for h, n, d in ((Hq, Lq, D), (Hkv, Lk, D), (Hkv, Lk, Dv)))
    kernel = attncc.compile(variant, backend="gluon")
    host, glu = kernel.module, kernel.module_of("gluon")
    offsets = dict(q_offset=q_offset, k_offset=k_offset)
    # The forward is only the backward's input: its first candidate that fits, as
    # ATTNCC_TUNE=0 takes it (a score reading a table may not fit the favourite tile:
    # T5 at 128x128 s3 asked for 360448 B of shared memory, which run 155 took for dQ's).
    for fwd_config in portable_candidates(variant, p.tile_dim, "fwd"):
        try:
            out, lse = host.forward(q, k, v, inputs, config=fwd_config, **offsets)
            break
        except triton.runtime.errors.OutOfResources:
            continue
    dout = torch.randn_like(out)
    delta = host.backward_delta(out, dout)

    def gluon_backward():
        """dq, dk, dv and the score's learnable inputs' gradients, as the runtime adds
        them: dQ's, plus dK/dV's for reads of keys alone."""
        dk, dv, *by_keys = glu.backward_dkdv(q, k, v, lse, delta, dout, inputs, config=config,
                                             **offsets)
        dq, dinputs = glu.backward_dq(q, k, v, lse, own_delta, dout, inputs, config=dq_config,
                                      out=out, **offsets)
        return dq, dk, dv, {n: g + by_keys[0][n] if by_keys else g
                            for n, g in dinputs.items() if n in learned}

    learned = learned_inputs(variant)
    own_delta = host.new_delta(q)
    dq, dk, dv, dinputs = gluon_backward()
    rows = [dict(tensor="delta", err=(own_delta - delta).abs().max().item(),
                 ok=bool(torch.allclose(own_delta, delta, rtol=1e-4, atol=1e-4)))]
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    leaves = {n: inputs[n].double().requires_grad_() for n in learned}
    ref = attncc.reference(variant, qr, kr, vr, **offsets, **{**inputs, **leaves})
    rgrads = torch.autograd.grad(ref, (qr, kr, vr, *leaves.values()), dout.double())
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    eager_leaves = {n: inputs[n].clone().requires_grad_() for n in learned}
    eager = attncc.reference(variant, qe, ke, ve, **offsets, **{**inputs, **eager_leaves})
    egrads = torch.autograd.grad(eager, (qe, ke, ve, *eager_leaves.values()), dout)
    from attncc.semantics.reference import scale_value
    scales = gradient_scales(qr, kr, ref, dout, scale_value(variant, D), Hq // Hkv)
    scales.update(input_gradient_scales(variant, q, k, v, ref, dout, inputs, **offsets))
    for n, g, rg, eg in zip(["q", "k", "v", *learned], (dq, dk, dv, *(dinputs[n] for n in learned)),
                            rgrads, egrads):
        err, eerr = max_abs_error(g, rg), max_abs_error(eg, rg)
        ok = within_tolerance(err, eerr, dtype, rg, scales.get(f"d{n}", 1.0))
        rows.append(dict(tensor=f"d{n}", err=err, eager_err=eerr, ok=bool(ok)))
    formula = DENSE_FORMULAS.get(variant.name)
    if formula is not None:  # the same gradient from the paper's formula, written out here
        name, bias, causal = formula
        want = _dense_bias_gradient(variant, q, k, v, dout, inputs[name], bias, causal, **offsets)
        err = max_abs_error(dinputs[name], want)
        eerr = max_abs_error(egrads[3 + learned.index(name)], want)
        rows.append(dict(tensor=f"d{name} (dense formula)", err=err, eager_err=eerr,
                         ok=bool(within_tolerance(err, eerr, dtype, want, scales[f"d{name}"]))))
    if learned:
        # No atomics: every repeat writes the same bits (dq's delta included).
        first = [dq, dk, dv, *(dinputs[n] for n in learned)]
        same = all(all(torch.equal(a, b) for a, b in zip(first, [*again[:3], *again[3].values()]))
                   for again in (gluon_backward() for _ in range(REPEATS)))
        rows.append(dict(tensor="bit-identical repeats", ok=bool(same)))
    return rows


def _t5_buckets(rel, bidirectional):
    """T5's relative position buckets (Raffel et al., 2020; 32 buckets, max distance 128)
    of rel = key position - query position, as its reference implementation computes
    them: half the buckets per direction when bidirectional, exact up to half of those,
    logarithmic beyond."""
    buckets = 32
    if bidirectional:
        buckets //= 2
        base, n = (rel > 0).long() * buckets, rel.abs()
    else:
        base, n = 0, (-rel).clamp(min=0)
    exact = buckets // 2
    far = exact + (torch.log(n.double().clamp(min=1) / exact) / math.log(128 / exact)
                   * (buckets - exact)).long()
    return base + torch.where(n < exact, n, far.clamp(max=buckets - 1))


# Variants whose learnable input's gradient is also computed apart from attncc.reference:
# (input, its dense bias [H or 1, Lq, Lk] from the input and rel = k - q, causal).
DENSE_FORMULAS = {
    "learned_alibi": ("sl", lambda sl, rel: sl.view(-1, 1, 1) * rel, True),
    "t5_bidirectional": ("table", lambda table, rel: table[:, _t5_buckets(rel, True)], False),
    "t5_causal": ("table", lambda table, rel: table[:, _t5_buckets(rel, False)], True),
}


def _dense_bias_gradient(variant, q, k, v, dout, x, bias, causal, q_offset=0, k_offset=0):
    """d loss / d x for plain softmax attention in float64 whose score adds the dense
    bias(x, k - q) (under the causal mask where `causal`), by autograd."""
    from attncc.semantics.reference import scale_value
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64, v64 = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    pos_q = torch.arange(q.shape[2], device=q.device) + q_offset
    pos_k = torch.arange(k.shape[2], device=q.device) + k_offset
    rel = pos_k[None, :] - pos_q[:, None]
    x64 = x.double().requires_grad_()
    s = q64 @ k64.transpose(-1, -2) * scale_value(variant, q.shape[-1]) + bias(x64, rel)
    if causal:
        s = s.masked_fill(rel > 0, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key attends to nothing
    return torch.autograd.grad(w @ v64, x64, dout.double())[0]


def correctness(args, dog):
    names = sorted(f[:-5] for f in os.listdir(EXAMPLES) if f.endswith(".attn"))
    variants = {n: attncc.parse_file(os.path.join(EXAMPLES, n + ".attn")) for n in names}
    variants.update({n: attncc.parse(spec) for n, spec in LEARNABLE.items()})
    taken = {n: v for n, v in variants.items() if GLUON.supports(v) is None
             and kernel_unsupported(v, "dq", 64) is None}  # (a long relative table: 64 only)
    if args.sweep:
        taken = {n: v for n, v in taken.items() if n in args.sweep.split(",")}
    bf, fp = torch.bfloat16, torch.float16
    first = backward_candidates(128)[0]
    first_dq = {d: dq_candidates(d)[0] for d in (64, 128)}
    cases = []  # (variant name, shape, dtype, dK/dV config, dQ config)
    for n in taken:
        cases.append((n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, first, first_dq[128]))
        if n in ("full", "causal", "causal_bottom_right", "prefix_lm", "alibi", "sliding_window",
                 "softcap", "bigbird_seeded"):
            cases.append((n, dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128), bf, first, first_dq[128]))
    for n in ("full", "causal", "document", "gqa_causal"):
        if n in taken:
            cases.append((n, dict(B=1, Hq=4, Hkv=1, Lq=257, Lk=257, D=64), bf,
                          backward_candidates(64)[0], first_dq[64]))
    for n in ("causal", "softcap", "alibi"):
        if n in taken:
            cases.append((n, dict(B=1, Hq=4, Hkv=4, Lq=333, Lk=333, D=128), fp, first, first_dq[128]))
    for n in ("full", "causal_bottom_right"):
        if n in taken:
            cases.append((n, dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, D=128), bf, first, first_dq[128]))
    # Learnable inputs on awkward shapes: len_q != len_k and 3 heads, GQA at head dim 64,
    # one query token, fp16.
    for n in [*LEARNABLE, "relative_bias"]:
        if n in taken:
            cases.append((n, dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128), bf, first, first_dq[128]))
            cases.append((n, dict(B=1, Hq=4, Hkv=1, Lq=257, Lk=257, D=64), bf,
                          backward_candidates(64)[0], first_dq[64]))
    for n in ("learned_alibi", "rows_gain", "key_gain", "t5_causal"):
        if n in taken:
            cases.append((n, dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, D=128), bf, first, first_dq[128]))
            cases.append((n, dict(B=1, Hq=4, Hkv=4, Lq=333, Lk=333, D=128), fp, first, first_dq[128]))
    others = zip(backward_candidates(128)[1:], dq_candidates(128)[1:])
    for config, dq_config in others:
        for n in ("full", "causal", "document", "learned_alibi", "key_gain", "t5_bidirectional"):
            if n in taken:
                cases.append((n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, config,
                              dq_config))
    # DeepSeek-V3's (q·k, v) = (192, 128), and head dim 256: every config the backend
    # offers the variant (tiles.backward_fits_registers keeps fewer for learnable inputs),
    # each dK/dV one beside each dQ one in turn, on the awkward shapes; fp16 and one query
    # token too.
    for n, (d, dv) in itertools.product(
            ("full", "causal", "document", "gqa_causal", "alibi", "softcap", "sliding_window",
             "gpt_oss_sinks", "sigmoid_attention", "learned_alibi", "rows_and_keys", "key_gain"),
            ((192, 128), (256, 256))):
        wide = dict(D=d, Dv=dv)
        if n not in taken or kernel_unsupported(taken[n], "dq", d, dv) \
                or kernel_unsupported(taken[n], "dkdv", d, dv):
            continue
        dkdv_configs = _dicts(GLUON.candidates("dkdv", d, taken[n]))
        dq_configs = _dicts(GLUON.candidates("dq", d, taken[n]))
        for i in range(max(len(dkdv_configs), len(dq_configs))):
            config, dq_config = dkdv_configs[i % len(dkdv_configs)], dq_configs[i % len(dq_configs)]
            cases.append((n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, **wide), bf, config, dq_config))
            cases.append((n, dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, **wide), bf, config, dq_config))
        cases.append((n, dict(B=1, Hq=4, Hkv=4, Lq=333, Lk=333, **wide), fp, dkdv_configs[0],
                      dq_configs[0]))
        cases.append((n, dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, **wide), bf, dkdv_configs[0],
                      dq_configs[0]))
    failures = 0
    for name, shape, dtype, config, dq_config in cases:
        label = f"{name} {shape} {str(dtype)[6:]} dK/dV {_label(config)} dQ {_label(dq_config)}"
        dog.start(label, 90)
        try:
            rows = check_dkdv(taken[name], dtype=dtype, config=config, dq_config=dq_config,
                              **shape)
            ok = all(r["ok"] for r in rows)
        except Exception as e:
            rows, ok = [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
            traceback.print_exc()
        failures += not ok
        RESULTS["correctness"].append(dict(case=label, ok=ok, rows=rows))
        _write()
        worst = max((r.get("err", math.nan) for r in rows), default=math.nan)
        print(f"{'ok  ' if ok else 'FAIL'} {label}: max err {worst:.3g}", flush=True)
    RESULTS["correctness_failures"] = failures
    return failures


def _median_ms(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def speed(args, dog):
    from gpu_suite import anchor_problem
    from attncc.tools.bench_command import pairs_per_head
    rows = []
    for name in args.variants.split(","):
        dog.start(f"speed {name}", 400)
        variant, q, k, v, inputs = anchor_problem(name, 16384, D=args.dim)
        D, Dv = args.dim, args.dim_v or args.dim
        q, k = (t.detach() for t in (q, k))
        v = v.detach()[..., :Dv].contiguous()  # v's own width: DeepSeek's 128 beside 192
        p = Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], D, Dv)
        pairs = pairs_per_head(variant, p, inputs, "cuda")
        # Four products per pair: S and dK of 2*D, dP and dV of 2*Dv.
        flops = 2 * 2 * q.shape[0] * q.shape[1] * (D + Dv) * pairs
        kernel = attncc.compile(variant, backend="gluon")
        host, glu = kernel.module, kernel.module_of("gluon")
        out, lse = host.forward(q, k, v, inputs,
                                config=portable_candidates(variant, p.tile_dim, "fwd")[0])
        dout = torch.randn_like(out)
        delta = host.backward_delta(out, dout)
        entry = dict(variant=name, dim=D, dim_v=Dv, tflop=flops / 1e12, times={}, diffs={})
        ref_dk = None
        for config in portable_candidates(variant, D, "dkdv")[:4]:
            run = lambda c=config: host.backward_dkdv(q, k, v, lse, delta, dout, inputs, config=c)
            try:
                dk, dv = run()
                ref_dk = (dk, dv) if ref_dk is None else ref_dk
                entry["times"][f"portable dK/dV {_label(config)}"] = _median_ms(run)
            except Exception as e:
                entry["times"][f"portable dK/dV {_label(config)}"] = f"{type(e).__name__}: {str(e)[:200]}"
        scratch = host.new_delta(q)
        for config in portable_candidates(variant, D, "dq")[:4]:
            run = lambda c=config: host.backward_dq(q, k, v, lse, scratch, dout, inputs, config=c,
                                                    out=out)
            try:
                run()
                entry["times"][f"portable dQ {_label(config)}"] = _median_ms(run)
            except Exception as e:
                entry["times"][f"portable dQ {_label(config)}"] = f"{type(e).__name__}: {str(e)[:200]}"
        for config in _dicts(GLUON.candidates("dq", p.tile_dim, variant)):
            run = lambda c=config: glu.backward_dq(q, k, v, lse, scratch, dout, inputs,
                                                   config=c, out=out)
            try:
                run()
                entry["times"][f"gluon dQ {_label(config)}"] = _median_ms(run)
            except Exception as e:
                entry["times"][f"gluon dQ {_label(config)}"] = f"{type(e).__name__}: {str(e)[:200]}"
        for config in _dicts(GLUON.candidates("dkdv", p.tile_dim, variant)):
            run = lambda c=config: glu.backward_dkdv(q, k, v, lse, delta, dout, inputs,
                                                     config=c)
            try:
                dk, dv = run()
                entry["diffs"][_label(config)] = max((dk.float() - ref_dk[0].float()).abs().max().item(),
                                                     (dv.float() - ref_dk[1].float()).abs().max().item())
                entry["times"][f"gluon dK/dV {_label(config)}"] = _median_ms(run)
            except Exception as e:
                entry["times"][f"gluon dK/dV {_label(config)}"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(entry)
        RESULTS["speed"].append(entry)
        _write()
    return rows


def _public_grads(variant, shape, dtype, seed=0, deterministic=False):
    """(gradients of kernel(..., deterministic=) with a loss reading O and the LSE, the
    float64 reference's, the eager reference's at `dtype`, error scales, last_backward)."""
    dev = "cuda"
    B, Hq, Hkv, Lq, Lk, D = (shape[n] for n in ("B", "Hq", "Hkv", "Lq", "Lk", "D"))
    offsets = dict(q_offset=shape.get("q_offset", 0), k_offset=shape.get("k_offset", 0))
    torch.manual_seed(seed)
    if variant.heads:
        Hq, Hkv = variant.heads.q, variant.heads.kv
    p = Problem(B, Hq, Hkv, Lq, Lk, D, D, *offsets.values())
    inputs = realistic_inputs(sample_inputs(variant, p, seed=seed, device=dev), Hq)
    base = [torch.randn(B, h, n, D, device=dev, dtype=torch.float64)
            for h, n in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk))]
    dout = torch.randn(B, Hq, Lq, D, device=dev, dtype=torch.float64)
    dlse = torch.randn(B, Hq, Lq, device=dev, dtype=torch.float64)
    kernel = attncc.compile(variant, backend="gluon")

    def grads(fn, cast):
        leaves = [t.to(cast).requires_grad_() for t in base]
        out, lse = fn(*leaves)
        # A row with no key has LSE -inf: its gradient there is 0 whatever dlse says.
        loss = (out * dout.to(cast)).sum() + (torch.where(lse.isinf(), 0.0, lse)
                                              * dlse.to(lse.dtype)).sum()
        return torch.autograd.grad(loss, leaves), leaves

    got, _ = grads(lambda q, k, v: kernel(q, k, v, return_lse=True, deterministic=deterministic,
                                          **offsets, **inputs), dtype)
    ran = kernel.last_backward
    reference = lambda q, k, v: attncc.reference(variant, q, k, v, return_lse=True, **offsets,
                                                 **inputs)
    ref, ref_leaves = grads(reference, torch.float64)
    eager, _ = grads(reference, dtype)
    from attncc.semantics.reference import scale_value
    out64 = attncc.reference(variant, *ref_leaves, **offsets, **inputs)
    scales = gradient_scales(ref_leaves[0], ref_leaves[1], out64, dout, scale_value(variant, D),
                             Hq // Hkv)
    return got, ref, eager, scales, ran


def check_fused_call(variant, shape, dtype):
    """Rows for the public call with deterministic=False: that the fused Gluon backward
    ran, and its dq, dk, dv against the float64 reference (a NaN fails)."""
    got, ref, eager, scales, ran = _public_grads(variant, shape, dtype)
    fused = ran.get("fused", (None, ""))
    rows = [dict(tensor="ran the fused Gluon backward", ok=bool(list(ran) == ["fused"]
                                                                 and fused[0] == "gluon"),
                 ran=str(ran))]
    for n, g, rg, eg in zip("qkv", got, ref, eager):
        err, eerr = max_abs_error(g, rg), max_abs_error(eg, rg)
        ok = within_tolerance(err, eerr, dtype, rg, scales.get(f"d{n}", 1.0)) \
            and bool(torch.isfinite(g).all())
        rows.append(dict(tensor=f"d{n}", err=err, eager_err=eerr, ok=bool(ok)))
    return rows


def check_fused_config(variant, shape, dtype, config, seed=0):
    """Rows for one fused config through the launcher (the tuner picks one config per
    call; the others are reached here), against the float64 reference."""
    dev = "cuda"
    B, Hq, Hkv, Lq, Lk, D = (shape[n] for n in ("B", "Hq", "Hkv", "Lq", "Lk", "D"))
    torch.manual_seed(seed)
    if variant.heads:
        Hq, Hkv = variant.heads.q, variant.heads.kv
    p = Problem(B, Hq, Hkv, Lq, Lk, D, D, 0, 0)
    inputs = realistic_inputs(sample_inputs(variant, p, seed=seed, device=dev), Hq)
    q, k, v = (torch.randn(B, h, n, D, device=dev, dtype=torch.float64).to(dtype)
               for h, n in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    kernel = attncc.compile(variant, backend="gluon")
    host, glu = kernel.module, kernel.module_of("gluon")
    out, lse = host.forward(q, k, v, inputs, config=portable_candidates(variant, p.tile_dim, "fwd")[0])
    dout = torch.randn_like(out)
    grads = glu.backward_fused(q, k, v, lse, host.backward_delta(out, dout), dout, inputs,
                               config=config)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = attncc.reference(variant, qr, kr, vr, **inputs)
    rgrads = torch.autograd.grad(ref, (qr, kr, vr), dout.double())
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    egrads = torch.autograd.grad(attncc.reference(variant, qe, ke, ve, **inputs), (qe, ke, ve), dout)
    from attncc.semantics.reference import scale_value
    scales = gradient_scales(qr, kr, ref, dout, scale_value(variant, D), Hq // Hkv)
    rows = []
    for n, g, rg, eg in zip("qkv", grads, rgrads, egrads):
        err, eerr = max_abs_error(g, rg), max_abs_error(eg, rg)
        ok = within_tolerance(err, eerr, dtype, rg, scales.get(f"d{n}", 1.0))
        rows.append(dict(tensor=f"d{n}", err=err, eager_err=eerr, ok=bool(ok)))
    return rows


def fused_correctness(args, dog):
    names = sorted(f[:-5] for f in os.listdir(EXAMPLES) if f.endswith(".attn"))
    variants = {n: attncc.parse_file(os.path.join(EXAMPLES, n + ".attn")) for n in names}
    taken = {n: v for n, v in variants.items() if GLUON.supports(v) is None
             and kernel_unsupported(v, FUSED, 128) is None}
    if args.sweep:
        taken = {n: v for n, v in taken.items() if n in args.sweep.split(",")}
    bf, fp = torch.bfloat16, torch.float16
    cases = []  # (variant name, shape, dtype)
    for n in taken:
        cases.append((n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf))
        cases.append((n, dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128), bf))
    for n in ("full", "causal", "gqa_causal", "bigbird"):
        if n in taken:  # len_q off the 4-element alignment of the statistics' bulk copies
            cases.append((n, dict(B=1, Hq=4, Hkv=1, Lq=257, Lk=257, D=128), bf))
            cases.append((n, dict(B=1, Hq=4, Hkv=4, Lq=333, Lk=333, D=128), fp))
    for n in ("full", "causal_bottom_right", "sliding_window"):
        if n in taken:
            cases.append((n, dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, D=128), bf))
    for n in ("causal", "sliding_window"):  # a chunk of a longer sequence
        if n in taken:
            cases.append((n, dict(B=1, Hq=2, Hkv=1, Lq=200, Lk=517, D=128, q_offset=317), bf))
    failures = 0
    for name, shape, dtype in cases:
        label = f"{name} {shape} {str(dtype)[6:]} kernel(..., deterministic=False)"
        dog.start(label, 120)
        try:
            rows = check_fused_call(taken[name], shape, dtype)
            ok = all(r["ok"] for r in rows)
        except Exception as e:
            rows, ok = [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
            traceback.print_exc()
        failures += not ok
        RESULTS["correctness"].append(dict(case=label, ok=ok, rows=rows))
        _write()
        worst = max((r.get("err", 0.0) for r in rows), default=math.nan)
        print(f"{'ok  ' if ok else 'FAIL'} {label}: max err {worst:.3g}", flush=True)
    for d in tiles.FUSED_HEAD_DIMS:
        for n in ("full", "causal", "document", "softcap"):
            if n not in taken:
                continue
            for config in _dicts(GLUON.candidates(FUSED, d, taken[n]))[1:]:
                shape = dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=d)
                label = f"{n} {shape} bf16 fused {_label(config)}"
                dog.start(label, 120)
                try:
                    rows = check_fused_config(taken[n], shape, bf, config)
                    ok = all(r["ok"] for r in rows)
                except Exception as e:
                    rows, ok = [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
                    traceback.print_exc()
                failures += not ok
                RESULTS["correctness"].append(dict(case=label, ok=ok, rows=rows))
                _write()
                worst = max((r.get("err", 0.0) for r in rows), default=math.nan)
                print(f"{'ok  ' if ok else 'FAIL'} {label}: max err {worst:.3g}", flush=True)
    RESULTS["correctness_failures"] = failures
    return failures


def fused_speed(args, dog):
    """The whole backward three ways on each --variants anchor (see the docstring)."""
    from gpu_suite import anchor_problem
    rows = []
    for name in args.variants.split(","):
        dog.start(f"fused {name}", 500)
        variant, q, k, v, inputs = anchor_problem(name, 16384, D=args.dim)
        q, k, v = (t.detach() for t in (q, k, v))
        D = args.dim
        kernel = attncc.compile(variant, backend="gluon")
        host, glu = kernel.module, kernel.module_of("gluon")
        out, lse = host.forward(q, k, v, inputs, config=portable_candidates(variant, D, "fwd")[0])
        dout = torch.randn_like(out)
        entry = dict(variant=name, dim=D, heads=f"{q.shape[1]}/{k.shape[1]}", times={}, diffs={})

        def split(module, dq_config, dkdv_config):
            delta = host.new_delta(q)
            dq, _ = module.backward_dq(q, k, v, lse, delta, dout, inputs, config=dq_config, out=out)
            return (dq, *module.backward_dkdv(q, k, v, lse, delta, dout, inputs, config=dkdv_config))

        def fused(config):
            delta = host.backward_delta(out, dout)
            return glu.backward_fused(q, k, v, lse, delta, dout, inputs, config=config)

        runs = {"gluon split": lambda: split(glu, dq_candidates(D)[0], backward_candidates(D)[0]),
                "portable split": lambda: split(host, portable_candidates(variant, D, "dq")[0],
                                                portable_candidates(variant, D, "dkdv")[0])}
        # A variant the fused kernel does not take has none rendered: say why, time the rest.
        why = fused_variant_unsupported(variant)
        if why is None:
            runs.update({f"gluon fused {_label(c)}": (lambda c=c: fused(c))
                         for c in fused_candidates(D)})
        else:
            entry["fused_skipped"] = why
            print(f"{name} d{D}: no fused backward ({why})", flush=True)
        reference = None
        for label, run in runs.items():
            try:
                grads = run()
                if reference is None:
                    reference = grads  # the split Gluon kernels', first in `runs`
                else:
                    entry["diffs"][label] = max((a.float() - b.float()).abs().max().item()
                                                for a, b in zip(grads, reference))
                entry["times"][label] = _median_ms(run)
            except Exception as e:
                entry["times"][label] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
        rows.append(entry)
        RESULTS["fused"] = RESULTS.get("fused", []) + [entry]
        _write()
        split_ms = entry["times"].get("gluon split")
        print(f"{name} d{D}: " + ", ".join(
            f"{k} {t:.3f} ms" + (f" ({split_ms / t:.2f}x split)" if isinstance(split_ms, float)
                                  and k.startswith("gluon fused") else "")
            for k, t in entry["times"].items() if isinstance(t, float)), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all",
                    choices=["correctness", "speed", "fused", "fused-speed", "all"])
    ap.add_argument("--variants", default=None,
                    help="speed: ANCHORS variants (default full,causal; fused and "
                         "fused-speed: full,causal,causal_gqa,sliding_window,softcap)")
    ap.add_argument("--dim", type=int, default=128, help="speed: q·k's head dim")
    ap.add_argument("--dim-v", type=int, default=0, help="speed: v's head dim (--dim's if 0)")
    ap.add_argument("--sweep", default="", help="correctness: only these examples")
    args = ap.parse_args()
    global PART
    PART = args.part
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    RESULTS["versions"] = dict(torch=torch.__version__, triton=__import__("triton").__version__,
                               gpu=torch.cuda.get_device_name())
    if args.variants is None:
        args.variants = ("full,causal,causal_gqa,sliding_window,softcap"
                         if args.part.startswith("fused") else "full,causal")
    dog = Watchdog()
    failures, rows = 0, []
    if args.part.startswith("fused"):
        RESULTS["fused_dq_add"] = fused_dq_add()
        print(f"fused backward's dQ add: {RESULTS['fused_dq_add']}", flush=True)
        os.environ["ATTNCC_TUNE"] = "0"  # the first candidate, as an untuned call takes it
        if args.part == "fused":
            failures = fused_correctness(args, dog)
        fused_speed(args, dog)
        dog.start("done", math.inf)
        _write()
        print(f"\ncorrectness failures: {failures} (triton {triton.__version__}, dQ add: "
              f"{RESULTS['fused_dq_add']})")
        return 1 if failures else 0
    if args.part in ("correctness", "all"):
        os.environ["ATTNCC_TUNE"] = "0"
        failures = correctness(args, dog)
    if args.part in ("speed", "all"):
        rows = speed(args, dog)
    dog.start("done", math.inf)
    _write()
    print(f"\ncorrectness failures: {failures}")
    for e in rows:
        best = {k: v for k, v in e["times"].items() if isinstance(v, float)}
        print(f"{e['variant']} d{e['dim']}: " + ", ".join(f"{k} {v:.3f}" for k, v in best.items()))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
