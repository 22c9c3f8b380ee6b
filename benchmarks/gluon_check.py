"""GPU script for the Gluon backend: correctness of its forward against the float64
reference over the variant set, then its speed against the portable forward (and cuDNN
for full and causal), in one call.

    python benchmarks/gluon_check.py [--part correctness|speed|all] [--quick]

Correctness: every example variant the Gluon backend takes, compiled with
backend="gluon", in bf16 at head dim 128 on two shapes (len_q = len_k = 300 over two
batches; len_q 200 != len_k 517), fp16 on a subset, head dims 64 and 256 on a subset,
one query token, GQA, offsets, and the backward (portable, fed by the Gluon forward's
output and LSE) on a few; v narrower than q·k ((192, 128), (128, 64): DeepSeek's
shapes), also at every (192, 128) config pinned and against float64 SDPA for full and
causal attention; each held to attncc/semantics/tolerance.py's rule against
attncc.reference in float64, with the LSE's -inf rows matched exactly. With the
backward, the learnable inputs' gradients too (LEARNABLE, also gluon_backward.py's:
learned ALiBi slopes, per-query and per-key gains, T5 tables), and a repeated backward
must give every gradient bit for bit. A watchdog ends
the process if a case hangs (a wrong mbarrier phase deadlocks), naming the case.

Speed: head dim 128, 16 heads, 16384 tokens, bf16 (the ANCHORS shape); every Gluon
config against the portable forward at its tuned config, medians of do_bench, the
same inputs; TFLOP/s count only allowed pairs (q·k's and v's widths: 2 (D + Dv) flops
a pair). --dim-pairs 192:128 times full and causal at those widths too, against cuDNN. Full results go to $OUT/gluon_check.json.

Head dim 64 (--part d64): the forward of full and causal attention at 4096 tokens, 32
heads, bf16, every Gluon config (two consumer warpgroups on 128 rows, three on 192)
beside FlashAttention-4 (flash_attn.cute, where installed: ../shared/tools/fa4) and
cuDNN, interleaved in one process. The correctness sweep pins the three-consumer config
the tuner would offer each variant on its own D=64 cases (WS3_CASES).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import attncc  # noqa: E402
from attncc import backends
from attncc.backends.gluon import kernel_unsupported, tiles
from attncc.arguments import Problem
from attncc.semantics.samples import sample_inputs
from learnable_gradients import CASES as LEARNABLE_CASES
from attncc.semantics.tolerance import (gradient_scales, input_gradient_scales, max_abs_error,
                                        within_tolerance)

OUT = os.environ.get("OUT", "out")
GLUON = backends.named("gluon")


def forward_candidates(D, Dv=None):
    """The Gluon forward's tile configs, as the dicts config= takes (by the wider dim, as
    the runtime picks them)."""
    return [c.as_dict() for c in tiles.candidates(max(D, Dv or D))]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
RESULTS: dict = {"correctness": [], "speed": []}
DEV = "cuda"
TAG = ""  # suffix of the results file, one per process (--tag)


# ---------------------------------------------------------------- watchdog
class Watchdog:
    """Ends the process when one case runs past its deadline: a kernel that waits on an
    mbarrier phase that never completes would otherwise hang the whole call."""

    def __init__(self):
        self.case, self.deadline = None, math.inf
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, case: str, seconds: float):
        self.case, self.deadline = case, time.time() + seconds

    def _watch(self):
        while True:
            time.sleep(1.0)
            if time.time() > self.deadline:
                print(f"\nHANG: {self.case} ran past its deadline; results so far in {OUT}",
                      flush=True)
                RESULTS["hang"] = self.case
                _write()
                os._exit(3)


def _write():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"gluon_check{TAG}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


# ---------------------------------------------------------------- correctness
# Learnable score inputs of each kind the Gluon backward owns (analysis/gradient_owners.py):
# broadcast (slopes[h]: learned ALiBi; a per-head temperature), rows (w[b, h, q]), cols
# (g[b, h, k], dK/dV's) and tables (T5's buckets, bidirectional and causal).
LEARNABLE = {
    "learned_alibi": LEARNABLE_CASES["learned_alibi"],
    "temperature": """attention temperature { learnable input tau: f32[h] mask q >= k
        score s * tau[h] }""",
    "rows_gain": """attention rows_gain { learnable input w: f32[b, h, q] mask q >= k
        score s + w[b, h, q] * (k - q) * 0.01 }""",
    "key_gain": LEARNABLE_CASES["key_gain"],
    "sigmoid_bias": """attention sigmoid_bias { learnable input bias: f32[h] mask q >= k
        normalize none weight sigmoid(s + bias[h] - 6.0) }""",
    "t5_bidirectional": LEARNABLE_CASES["t5_bidirectional"],
    # learnable_gradients.py's causal T5 reads entry q - k < 0 at masked pairs, which the
    # reference refuses: here clamped at 0, as T5's own buckets are.
    "t5_causal": """attention t5_causal { learnable input table: f32[h, 32] mask q >= k
        score s + table[h, where(q - k < 16, max(q - k, 0),
            min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) * 16.0), 31))] }""",
    # Learnable reads inside a `weight` (session 24's fixes: a relative table's dQ lost its
    # weights to the diagonal loop's variable; a per-key read under `sum` got no gradient).
    "table_in_weight": """attention table_in_weight { learnable input tab: f32[h, 33]
        mask q >= k  normalize none  weight sigmoid(s + tab[h, min(max(q - k, -16), 16) + 16]) }""",
    "table_in_exp_sum": """attention table_in_exp_sum { learnable input tab: f32[h, 33]
        normalize sum  weight exp(s + tab[h, min(max(q - k, -16), 16) + 16]) }""",
    "key_gain_sum": """attention key_gain_sum { learnable input g: f32[b, h, k]  mask q >= k
        normalize sum  weight sigmoid(s + g[b, h, k]) }""",
}

# A sink of -inf (off) on rows with no key: the first 40 queries of every head see nothing,
# and every other head's sink is -inf (it gave NaN out, LSE and dK/dV before session 24).
SINK_OFF = """attention sink_off_rows { learnable input sinks: f32[h]  sink sinks[h]
    mask k + 40 <= q }"""


def learned_inputs(variant) -> list:
    """The learnable inputs that what a pair adds reads (a sink's take their gradient
    outside the kernels), sorted."""
    from attncc.analysis.gradient_owners import gradient_owners, learnable_reads
    from attncc.backends.portable.codegen import per_pair
    pair = per_pair(variant)
    return sorted({o.load.tensor for o in gradient_owners(pair, learnable_reads(pair))})


def realistic_inputs(inputs: dict, heads: int) -> dict:
    """sample_inputs' standard normal values, but learned ALiBi slopes (`sl`) about the
    usual geometric ones and a temperature (`tau`) about 1: a slope of 1 over 500 keys
    would leave every row one-hot."""
    out = dict(inputs)
    if "sl" in out:
        sl = out["sl"]
        out["sl"] = torch.logspace(-1, -8, heads, base=2, device=sl.device) * (1 + 0.2 * sl)
    if "tau" in out:
        out["tau"] = 1 + 0.2 * out["tau"]
    return out


def _compare(label, got, ref, eager, dtype, scale=1.0):
    err, eerr = max_abs_error(got, ref), max_abs_error(eager, ref)
    ok = within_tolerance(err, eerr, dtype, ref, scale)
    return dict(tensor=label, err=err, eager_err=eerr, ok=bool(ok))


def check_case(name, variant, *, B, Hq, Hkv, Lq, Lk, D, dtype, backward=False, q_offset=0,
               k_offset=0, seed=0, config=None, Dv=None):
    """`Dv`: v's head dim where it is not q·k's `D`."""
    dev = DEV
    torch.manual_seed(seed)
    if variant.heads:
        Hq, Hkv = variant.heads.q, variant.heads.kv
    Dv = Dv or D
    p = Problem(B, Hq, Hkv, Lq, Lk, D, Dv, q_offset, k_offset)
    inputs = realistic_inputs(sample_inputs(variant, p, seed=seed, device=dev), Hq)
    if name == "sink_off_rows":
        inputs["sinks"] = inputs["sinks"].clone()
        inputs["sinks"][::2] = float("-inf")
    learned = learned_inputs(variant) if backward else []
    for n in learned:
        inputs[n] = inputs[n].requires_grad_()
    q64 = torch.randn(B, Hq, Lq, D, device=dev, dtype=torch.float64)
    k64 = torch.randn(B, Hkv, Lk, D, device=dev, dtype=torch.float64)
    v64 = torch.randn(B, Hkv, Lk, Dv, device=dev, dtype=torch.float64)
    kernel = attncc.compile(variant, backend="gluon", config=config)
    q, k, v = (t.to(dtype).requires_grad_(backward) for t in (q64, k64, v64))
    offsets = dict(q_offset=q_offset, k_offset=k_offset)
    with_lse = variant.normalize != "none"  # `normalize none` has no LSE to return

    def attend(fn, *qkv, values=inputs):
        got = fn(*qkv, return_lse=with_lse, **offsets, **values)
        return got if with_lse else (got, None)
    out, lse = attend(kernel, q, k, v)
    ran = kernel.last_backend[0]
    # The reference on the kernel's own (rounded) inputs, in float64 and in the dtype.
    by_reference = lambda *qkv, **kw: attncc.reference(variant, *qkv, **kw)
    qr, kr, vr = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref_inputs = {**inputs, **{n: inputs[n].detach().double().requires_grad_() for n in learned}}
    ref, rlse = attend(by_reference, qr, kr, vr, values=ref_inputs)
    qe, ke, ve = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    eager_inputs = {**inputs, **{n: inputs[n].detach().clone().requires_grad_() for n in learned}}
    eager, else_ = attend(by_reference, qe, ke, ve, values=eager_inputs)
    rows = [_compare("out", out, ref, eager, dtype)]
    if with_lse:
        rows.append(_compare("lse", lse, rlse, else_, dtype))
    if Dv != D and name in ("full", "causal") and not (q_offset or k_offset):
        # An independent formula: SDPA's math backend in float64 (it takes Ev != E; its
        # is_causal is attncc's `causal`, diagonal from the top left).
        sdpa = lambda *t: torch.nn.functional.scaled_dot_product_attention(
            *t, is_causal=name == "causal", enable_gqa=Hq != Hkv)
        rows.append(_compare("out vs sdpa", out, sdpa(*(t.detach() for t in (qr, kr, vr))),
                             sdpa(q.detach(), k.detach(), v.detach()), dtype))
    if backward:
        do = torch.randn_like(out)
        leaves = (q, k, v, *(inputs[n] for n in learned))
        grads = torch.autograd.grad(out, leaves, do)
        rgrads = torch.autograd.grad(ref, (qr, kr, vr, *(ref_inputs[n] for n in learned)),
                                     do.double())
        egrads = torch.autograd.grad(eager, (qe, ke, ve, *(eager_inputs[n] for n in learned)), do)
        from attncc.semantics.reference import scale_value
        scales = gradient_scales(qr, kr, ref, do, scale_value(variant, D), Hq // Hkv)
        scales.update(input_gradient_scales(variant, q, k, v, ref, do, inputs, **offsets))
        for n, g, rg, eg in zip(["q", "k", "v", *learned], grads, rgrads, egrads):
            rows.append(_compare(f"d{n}", g, rg, eg, dtype, scales.get(f"d{n}", 1.0)))
        if learned:  # no atomics: a repeated forward and backward gives the same bits
            same = all(all(torch.equal(a, b) for a, b in
                           zip(grads, torch.autograd.grad(attend(kernel, q, k, v)[0], leaves, do)))
                       for _ in range(3))
            rows.append(dict(tensor="bit-identical repeats", ok=bool(same)))
        # backend="gluon": dQ and dK/dV run the Gluon kernels wherever they take the call.
        for kind in ("dq", "dkdv"):
            if (kernel_unsupported(variant, kind, D, Dv) is None
                    and kernel.last_backward[kind][0] != "gluon"):
                rows.append(dict(tensor=f"{kind} backend", error=str(kernel.last_backward),
                                 ok=False))
    return ran, rows


def correctness(args, dog):
    names = sorted(f[:-5] for f in os.listdir(EXAMPLES) if f.endswith(".attn"))
    variants = {n: attncc.parse_file(os.path.join(EXAMPLES, n + ".attn")) for n in names}
    variants.update({n: attncc.parse(spec) for n, spec in LEARNABLE.items()})
    variants["sink_off_rows"] = attncc.parse(SINK_OFF)
    taken = {n: v for n, v in variants.items() if GLUON.supports(v) is None}
    bf, fp = torch.bfloat16, torch.float16
    few = ["full", "causal", "sliding_window", "alibi", "softcap", "document", "bigbird"]
    cases = []  # (name, shape dict, dtype, backward)
    for n in taken:
        cases.append((n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, False))
        if n in ("full", "causal", "causal_bottom_right", "prefix_lm", "alibi", "sliding_window",
                 "longformer", "bigbird_seeded", "relative_bias"):
            cases.append((n, dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128), bf, False))
    if not args.quick:
        for n in few:
            cases.append((n, dict(B=1, Hq=4, Hkv=4, Lq=333, Lk=333, D=128), fp, False))
        for n in ("full", "causal", "document", "gqa_causal"):
            cases.append((n, dict(B=1, Hq=4, Hkv=1, Lq=257, Lk=257, D=64), bf, False))
        for n in ("full", "causal", "alibi"):
            cases.append((n, dict(B=1, Hq=2, Hkv=2, Lq=300, Lk=300, D=256), bf, False))
        cases += [("full", dict(B=1, Hq=2, Hkv=2, Lq=1, Lk=129, D=128), bf, False),
                  ("causal_bottom_right", dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, D=128), bf, False),
                  ("causal", dict(B=1, Hq=4, Hkv=2, Lq=1000, Lk=1000, D=128), bf, True),
                  ("full", dict(B=2, Hq=4, Hkv=4, Lq=300, Lk=517, D=128), bf, True),
                  ("sliding_window", dict(B=1, Hq=4, Hkv=4, Lq=700, Lk=700, D=128), fp, True),
                  ("alibi", dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, True),
                  ("softcap", dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128), bf, True),
                  ("relative_bias", dict(B=1, Hq=2, Hkv=2, Lq=300, Lk=300, D=128), bf, True),
                  ("gqa_causal", dict(B=1, Hq=4, Hkv=1, Lq=257, Lk=257, D=64), bf, True),
                  ("causal_bottom_right", dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, D=128), bf, True),
                  ("full", dict(B=1, Hq=2, Hkv=2, Lq=300, Lk=300, D=256), bf, True),
                  # gpt-oss's sinks (its heads 64 / 8): the Gluon forward's epilogue, and
                  # dQ, dK/dV fed its LSE.
                  ("gpt_oss_sinks", dict(B=1, Hq=64, Hkv=8, Lq=300, Lk=300, D=64), bf, True),
                  ("gpt_oss_sinks", dict(B=1, Hq=64, Hkv=8, Lq=1, Lk=300, D=64), bf, False),
                  ("sigmoid_attention", dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, True),
                  ("relu_attention", dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=64), bf, True),
                  ("sink_off_rows", dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, True),
                  ("sink_off_rows", dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=64), bf, True)]
        # v narrower than q·k: (192, 128) as 128 + 64 segments, the output through Q's
        # first segment's buffer; (128, 64), the output by plain stores.
        for n in ("full", "causal", "document", "alibi", "sliding_window", "gqa_causal"):
            cases.append((n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=192, Dv=128), bf, False))
        cases += [("causal", dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=192, Dv=128), bf, False),
                  ("full", dict(B=1, Hq=3, Hkv=1, Lq=1, Lk=300, D=192, Dv=128), bf, False),
                  ("full", dict(B=1, Hq=4, Hkv=4, Lq=333, Lk=333, D=192, Dv=128), fp, False),
                  ("gpt_oss_sinks", dict(B=1, Hq=64, Hkv=8, Lq=300, Lk=300, D=192, Dv=128), bf,
                   False),
                  ("causal", dict(B=1, Hq=4, Hkv=2, Lq=700, Lk=700, D=192, Dv=128), bf, True),
                  ("full", dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128, Dv=64), bf, False),
                  ("causal", dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=128, Dv=64), bf, False),
                  ("document", dict(B=1, Hq=4, Hkv=4, Lq=300, Lk=300, D=128, Dv=64), bf, True)]
        # Learnable inputs' gradients through the whole call (the Gluon dQ and dK/dV
        # own them): awkward lengths, 3 heads, GQA, one query token.
        for n in LEARNABLE:
            cases += [(n, dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=128), bf, True),
                      (n, dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=64), bf, True)]
        cases += [("learned_alibi", dict(B=2, Hq=2, Hkv=2, Lq=1, Lk=300, D=128), bf, True),
                  ("key_gain", dict(B=1, Hq=4, Hkv=1, Lq=257, Lk=257, D=64), fp, True)]
    offset_cases = [("causal", 64, 0), ("sliding_window", 96, 96)]
    ws3_cases = WS3_CASES
    if args.sweep != "all":
        keep = set(args.sweep.split(",")) if args.sweep else set()
        cases = [c for c in cases if c[0] in keep]
        offset_cases = [c for c in offset_cases if c[0] in keep]
        ws3_cases = [c for c in ws3_cases if c[0] in keep]
    failures = 0
    # Every candidate config of head dim 128 on a few variants (one per skipping
    # strategy and a score), pinned: the tuner may pick any of them.
    names = args.configs.split(",") if args.configs else []
    # Config-major, so that a config that hangs (the watchdog ends the process) comes
    # after every other config's results. Then every (192, 128) config on the variants of
    # --configs-192, in the same way.
    names192 = args.configs_192.split(",") if args.configs_192 and not args.quick else []
    plan = [(config, name, 128, None) for config in forward_candidates(128) for name in names]
    plan += [(config, name, 192, 128) for config in forward_candidates(192, 128)
             for name in names192]
    for config, name, D, Dv in plan:
        label = (f"{name} config {config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} "
                 f"s{config['num_stages']}" + (f" d{D}:{Dv}" if Dv else ""))
        dog.start(label, 60)
        try:
            rows = []
            for shape in (dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=D, Dv=Dv),
                          dict(B=1, Hq=2, Hkv=2, Lq=200, Lk=517, D=D, Dv=Dv)):
                if name == "document" and shape["Lq"] != shape["Lk"]:
                    continue
                ran, r = check_case(name, taken[name], dtype=bf, config=config, **shape)
                rows += r
            ok = all(r["ok"] for r in rows) and ran == "gluon"
        except Exception as e:
            ran, rows, ok = None, [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
            traceback.print_exc()
        failures += not ok
        RESULTS["correctness"].append(dict(case=label, ran=ran, ok=ok, rows=rows))
        worst = max((r.get("err", math.nan) for r in rows), default=math.nan)
        print(f"{'ok  ' if ok else 'FAIL'} {label}: max err {worst:.3g}", flush=True)
        _write()
    for name, shape, dtype, backward in cases:
        label = f"{name} {shape} {str(dtype)[6:]}{' +bwd' if backward else ''}"
        dog.start(label, 120)
        try:
            ran, rows = check_case(name, taken[name], dtype=dtype, backward=backward, **shape)
            ok = all(r["ok"] for r in rows) and ran == "gluon"
        except Exception as e:
            ran, rows, ok = None, [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
            traceback.print_exc()
        failures += not ok
        RESULTS["correctness"].append(dict(case=label, ran=ran, ok=ok, rows=rows))
        _write()  # case by case: a call that runs out of time keeps what it checked
        worst = max((r.get("err", math.nan) for r in rows), default=math.nan)
        print(f"{'ok  ' if ok else 'FAIL'} {label}: ran {ran}, max err {worst:.3g}", flush=True)
    # The three-consumer forward (192-row tiles) pinned, at head dim 64: tiles whose
    # diagonal spans one and a half key tiles, lengths off the tile, GQA, tile tables.
    for name, shape, dtype, backward in ([] if args.quick else ws3_cases):
        # The three-consumer tile the tuner would offer this variant (tiles.fits_registers).
        config = next(c.as_dict() for c in GLUON.candidates("fwd", 64, taken[name])
                      if c.num_warps == tiles.WS3_WARPS)
        label = (f"{name} {shape} {str(dtype)[6:]}{' +bwd' if backward else ''} "
                 f"{config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']}")
        dog.start(label, 120)
        try:
            ran, rows = check_case(name, taken[name], dtype=dtype, backward=backward,
                                   config=config, **shape)
            ok = all(r["ok"] for r in rows) and ran == "gluon"
        except Exception as e:
            ran, rows, ok = None, [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
            traceback.print_exc()
        failures += not ok
        RESULTS["correctness"].append(dict(case=label, ran=ran, ok=ok, rows=rows))
        _write()
        worst = max((r.get("err", math.nan) for r in rows), default=math.nan)
        print(f"{'ok  ' if ok else 'FAIL'} {label}: ran {ran}, max err {worst:.3g}", flush=True)
    if not args.quick:
        for name, qo, ko in offset_cases:
            label = f"{name} offsets {qo}/{ko} bf16"
            dog.start(label, 120)
            try:
                ran, rows = check_case(name, taken[name], B=1, Hq=2, Hkv=2, Lq=300, Lk=400, D=128,
                                       dtype=bf, q_offset=qo, k_offset=ko)
                ok = all(r["ok"] for r in rows) and ran == "gluon"
            except Exception as e:
                ran, rows, ok = None, [dict(error=f"{type(e).__name__}: {str(e)[:600]}")], False
                traceback.print_exc()
            failures += not ok
            RESULTS["correctness"].append(dict(case=label, ran=ran, ok=ok, rows=rows))
            print(f"{'ok  ' if ok else 'FAIL'} {label}: ran {ran}", flush=True)
    RESULTS["correctness_failures"] = failures
    return failures


# The D=64 cases the three-consumer forward is pinned on.
_bf, _fp = torch.bfloat16, torch.float16
WS3_CASES = [("full", dict(B=2, Hq=4, Hkv=4, Lq=300, Lk=300, D=64), _bf, False),
             ("full", dict(B=1, Hq=3, Hkv=3, Lq=200, Lk=517, D=64), _bf, False),
             ("full", dict(B=1, Hq=2, Hkv=2, Lq=1, Lk=129, D=64), _bf, False),
             ("causal", dict(B=1, Hq=3, Hkv=3, Lq=1000, Lk=1000, D=64), _bf, False),
             ("causal", dict(B=1, Hq=2, Hkv=2, Lq=200, Lk=517, D=64), _fp, False),
             ("causal", dict(B=1, Hq=4, Hkv=2, Lq=577, Lk=577, D=64), _bf, True),
             ("causal_bottom_right", dict(B=2, Hq=2, Hkv=2, Lq=193, Lk=300, D=64), _bf, False),
             ("sliding_window", dict(B=1, Hq=4, Hkv=4, Lq=700, Lk=700, D=64), _bf, False),
             ("gqa_causal", dict(B=1, Hq=4, Hkv=1, Lq=385, Lk=385, D=64), _bf, True),
             ("document", dict(B=1, Hq=4, Hkv=4, Lq=640, Lk=640, D=64), _bf, False),
             ("softcap", dict(B=1, Hq=3, Hkv=3, Lq=450, Lk=450, D=64), _bf, False),
             ("alibi", dict(B=2, Hq=4, Hkv=2, Lq=300, Lk=300, D=64), _fp, False),
             ("gpt_oss_sinks", dict(B=1, Hq=64, Hkv=8, Lq=300, Lk=300, D=64), _bf, False)]


# ---------------------------------------------------------------- speed
def _median_ms(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def speed(args, dog):
    from gpu_suite import VARIANTS, anchor_problem
    from attncc.tools.bench_command import pairs_per_head
    rows = []
    plan = [(n, 128, 128) for n in args.variants.split(",")]
    plan += [("full", int(d), int(d)) for d in args.full_dims.split(",") if d]
    for pair in filter(None, args.dim_pairs.split(",")):
        D, Dv = map(int, pair.split(":"))
        plan += [("full", D, Dv), ("causal", D, Dv)]
    for name, D, Dv in plan:
        dog.start(f"speed {name} d{D}:{Dv}", 240)
        variant, q, k, v, inputs = anchor_problem(name, 16384, D=D)
        q, k, v = (t.detach() for t in (q, k, v))
        if Dv != D:
            v = torch.randn(*v.shape[:3], Dv, device=v.device, dtype=v.dtype)
        p = Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], D, Dv)
        pairs = pairs_per_head(variant, p, inputs, "cuda")
        flops = 2 * q.shape[0] * q.shape[1] * (D + Dv) * pairs  # Q K^T, then P V
        portable = attncc.compile(variant, backend="triton")
        glu = attncc.compile(variant, backend="gluon")
        portable(q, k, v, **inputs)  # tunes
        out_p = portable(q, k, v, **inputs)
        entry = dict(variant=name, dim=D, tflop=flops / 1e12, times={})
        if Dv != D:
            entry["dim_v"] = Dv
        t_p = _median_ms(lambda: portable(q, k, v, **inputs))
        entry["times"]["portable"] = t_p
        for config in forward_candidates(D, Dv)[:args.first or None]:
            if config["num_warps"] in tiles.WS_CONSUMERS and os.environ.get("GLUON_SKIP_WS") == "1":
                continue  # it hung in the correctness part
            label = f"gluon {config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']}"
            run = lambda: glu.module_of("gluon").forward(q, k, v, inputs,
                                                         config=config)
            try:
                out_g, _ = run()
                diff = (out_g.float() - out_p.float()).abs().max().item()
                entry["times"][label] = _median_ms(run)
                entry.setdefault("max_diff_vs_portable", {})[label] = diff
            except Exception as e:
                entry["times"][label] = f"{type(e).__name__}: {str(e)[:200]}"
        if name in ("full", "causal"):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=name == "causal")
                    f()
                    entry["times"]["cudnn"] = _median_ms(f)
            except Exception as e:
                entry["times"]["cudnn"] = f"{type(e).__name__}: {str(e)[:200]}"
        # the portable kernel again, last: the clock drifts as the GPU warms (run 77)
        entry["times"]["portable (again)"] = _median_ms(lambda: portable(q, k, v, **inputs))
        rows.append(entry)
        RESULTS["speed"].append(entry)
        _write()
    return rows


def speed_d64(args, dog):
    """The forward at head dim 64 (the issue's shape: 4096 tokens, 32 heads, bf16): every
    Gluon config, FA4 and cuDNN on the same inputs, one after another per variant."""
    from gpu_suite import VARIANTS
    from attncc.tools.bench_command import pairs_per_head
    rows = []
    B, H, L, D = args.d64_batch, 32, 4096, 64
    for name in ("full", "causal"):
        dog.start(f"d64 {name}", 300)
        variant = attncc.parse(VARIANTS[name])
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=gen).to(DEV, torch.bfloat16) for _ in range(3))
        pairs = pairs_per_head(variant, Problem(B, H, H, L, L, D, D), {}, "cuda")
        entry = dict(variant=name, dim=D, batch=B, heads=H, tokens=L,
                     tflop=4 * B * H * D * pairs / 1e12, times={})
        runs = {}
        glu = attncc.compile(variant, backend="gluon")
        for config in forward_candidates(D):
            label = (f"gluon {config['BLOCK_M']}x{config['BLOCK_N']} w{config['num_warps']} "
                     f"s{config['num_stages']}")
            runs[label] = lambda config=config: glu.module_of("gluon").forward(q, k, v, {},
                                                                              config=config)
        causal = name == "causal"
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            runs["cudnn"] = cudnn
        except ImportError as e:
            entry["times"]["cudnn"] = f"ImportError: {e}"
        try:
            from flash_attn.cute import flash_attn_func as fa4
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # FA4 takes (B, L, H, D)
            runs["fa4"] = lambda: fa4(qt, kt, vt, causal=causal)
        except ImportError as e:
            entry["times"]["fa4"] = f"ImportError: {e} (install ../shared/tools/fa4)"
        reference = None
        for label, run in runs.items():
            try:
                out = run()
                out = out[0] if isinstance(out, tuple) else out
                if label == "fa4":
                    out = out.transpose(1, 2)
                if reference is None:
                    reference = out.float()
                entry.setdefault("max_diff", {})[label] = (out.float() - reference).abs().max().item()
                entry["times"][label] = _median_ms(run)
            except Exception as e:
                entry["times"][label] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(entry)
        RESULTS.setdefault("d64", []).append(entry)
        _write()
        fa4_ms = entry["times"].get("fa4")
        for label, t in entry["times"].items():
            if isinstance(t, float):
                vs = f", FA4/this {fa4_ms / t:.3f}" if isinstance(fa4_ms, float) else ""
                print(f"d64 {name} {label}: {t:.3f} ms ({entry['tflop'] / t * 1e3:.0f} TF/s){vs}",
                      flush=True)
            else:
                print(f"d64 {name} {label}: {t}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=["correctness", "speed", "d64", "all"])
    ap.add_argument("--d64-batch", type=int, default=4,
                    help="d64: the batch (4 x 4096 = 16384 tokens, the other parts' count)")
    ap.add_argument("--quick", action="store_true", help="bf16 head dim 128 correctness only")
    ap.add_argument("--variants", default="full,causal", help="speed: ANCHORS variants at D=128")
    ap.add_argument("--first", type=int, default=0,
                    help="speed: time only the first N Gluon configs of each head dim (0: all)")
    ap.add_argument("--full-dims", default="", help="speed: full attention at these head dims too")
    ap.add_argument("--dim-pairs", default="192:128",
                    help="speed: full and causal at these q·k:v head dims too ('' for none)")
    ap.add_argument("--sweep", default="all", help="correctness: the variants of the sweep (all)")
    ap.add_argument("--configs", default="",
                    help="correctness: variants checked at every head-dim-128 config")
    ap.add_argument("--configs-192", default="causal,document",
                    help="correctness: variants checked at every (192, 128) config")
    ap.add_argument("--order", default="correctness,speed",
                    help="which part first (speed first keeps the timings if time runs out)")
    ap.add_argument("--tag", default="", help="results file suffix: $OUT/gluon_check<TAG>.json")
    args = ap.parse_args()
    global TAG
    TAG = args.tag
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    RESULTS["versions"] = dict(torch=torch.__version__, triton=__import__("triton").__version__,
                               gpu=torch.cuda.get_device_name())
    dog = Watchdog()
    failures, rows = 0, []
    for part in args.order.split(","):
        if part == "correctness" and args.part in ("correctness", "all"):
            os.environ["ATTNCC_TUNE"] = "0"  # the first candidate, untimed (or the pinned one)
            failures = correctness(args, dog)
            _write()
        if part == "speed" and args.part in ("speed", "all"):
            os.environ.pop("ATTNCC_TUNE", None)  # speed: the portable kernel tuned
            rows = speed(args, dog)
    if args.part == "d64":
        speed_d64(args, dog)
    dog.start("done", math.inf)
    _write()
    print(f"\ncorrectness failures: {failures}")
    for e in rows:
        best = {k: v for k, v in e["times"].items() if isinstance(v, float)}
        line = ", ".join(f"{k} {v:.3f} ms ({e['tflop'] / v * 1e3:.0f} TF/s)" for k, v in best.items())
        print(f"{e['variant']} d{e['dim']}{':%d' % e['dim_v'] if 'dim_v' in e else ''}: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
