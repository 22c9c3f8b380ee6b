"""gpt-oss-shaped attention with learnable sinks (issue 33), forward and backward: attncc
against FlashAttention-4's `learnable_sink` and against the path transformers takes for
gpt-oss under FlexAttention (FlexAttention has no sink: it returns the LSE and the output
is renormalised outside the kernel), on FlexAttention's Triton kernels and, where it runs,
its FLASH backend.

Shapes are gpt-oss's: 64 query heads on 8 key/value heads, head dim 64, bf16, one
learnable float32 logit per query head, layers that alternate between a sliding window of
128 keys and full causal attention. Every backend gets the same (batch, seq, heads, dim)
tensors (attncc with layout="bshd", FA4 natively, FlexAttention through a transposed view).

1. Correctness, at an awkward length (2047 queries and keys, off every tile): each
   backend's output and its gradients for q, k, v and the sinks against gpt-oss's own
   `sdpa()` formula retyped in float64 (the scaled scores, -inf where masked, the sinks as
   one more column, softmax, that column dropped), as relative L2 errors. Sinks are drawn
   far from the logits (±8) as well as near them.
2. Speed at --lengths (default 4096 and 16384): forward (grad enabled, as in training) and
   forward + backward, medians of triton's do_bench over interleaved rounds; the backward
   is their difference. Ratios are the other's time over attncc's (above 1: attncc faster).

Needs FA4 on the path for its rows (../shared/tools/fa4: `source .fa4/part2/install.sh`);
without it those rows say why they did not run. Full results go to $OUT/gpt_oss_sinks.json.

    PYTHONPATH=$PWD python benchmarks/gpt_oss_sinks.py [--lengths 4096 16384] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

import attncc

HEADS_Q, HEADS_KV, DIM, WINDOW = 64, 8, 64, 128
SCALE = 1.0 / math.sqrt(DIM)
LAYERS = {
    "sliding 128": f"""attention gpt_oss_sliding {{
        heads {HEADS_Q} / {HEADS_KV}
        learnable input sinks: f32[h]
        mask q >= k and q - k < {WINDOW}
        sink sinks[h]
    }}""",
    "full causal": f"""attention gpt_oss_full {{
        heads {HEADS_Q} / {HEADS_KV}
        learnable input sinks: f32[h]
        mask q >= k
        sink sinks[h]
    }}""",
}


def gpt_oss_sdpa(q, k, v, sinks, window):
    """gpt-oss's sdpa(), retyped for (batch, seq, heads, dim): the independent reference."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    n_q, n_k = q.shape[1], k.shape[1]
    pos_q = torch.arange(n_q, device=q.device)[:, None]
    pos_k = torch.arange(n_k, device=q.device)[None, :]
    allowed = pos_q >= pos_k
    if window is not None:
        allowed &= pos_q - pos_k < window
    scores = scores.masked_fill(~allowed, -math.inf)
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, n_q, 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def backends(layer: str) -> dict:
    """{name: (fn(q, k, v, sinks) -> out in bshd) or the reason it cannot run}."""
    window = WINDOW if layer.startswith("sliding") else None
    kernel = attncc.compile(LAYERS[layer])
    found = {"attncc": lambda q, k, v, s: kernel(q, k, v, sinks=s, layout="bshd")}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        def fa4_call(q, k, v, s):
            out = fa4(q, k, v, softmax_scale=SCALE, causal=True,
                      window_size=(WINDOW - 1, 0) if window else (None, None), learnable_sink=s)
            return out[0] if isinstance(out, tuple) else out
        found["FA4"] = fa4_call
    except Exception as err:  # not carried, or a version without the keyword
        found["FA4"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            keep = q_idx >= kv_idx
            return keep & (q_idx - kv_idx < WINDOW) if window else keep
        flex = torch.compile(flex_attention)
        masks = {}

        def flex_path(options):
            def call(q, k, v, s):
                n = q.shape[1]
                if n not in masks:  # built once per length, outside the timed region
                    masks[n] = create_block_mask(mask_mod, None, None, n, n, device=q.device)
                out, lse = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                block_mask=masks[n], scale=SCALE, enable_gqa=True,
                                return_lse=True, kernel_options=options)
                # transformers' renormalisation: the sink joins the denominator afterwards.
                lse = lse.unsqueeze(-1)
                sink = s.reshape(1, -1, 1, 1).expand_as(lse)
                combined = torch.logsumexp(torch.cat([lse, sink], dim=-1), dim=-1, keepdim=True)
                return (out * torch.exp(lse - combined)).to(q.dtype).transpose(1, 2)
            return call
        found["Flex (Triton)"] = flex_path(None)
        found["Flex FLASH"] = flex_path({"BACKEND": "FLASH"})
    except Exception as err:
        found["Flex (Triton)"] = found["Flex FLASH"] = f"{type(err).__name__}: {err}"
    return found


def inputs(batch: int, n: int, far: bool, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, n, h, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
               for h in (HEADS_Q, HEADS_KV, HEADS_KV))
    sinks = torch.randn(HEADS_Q, device="cuda", generator=gen)
    if far:  # half the heads' sinks far above the logits, half far below
        sinks = sinks + torch.where(torch.arange(HEADS_Q, device="cuda") % 2 == 0, 8.0, -8.0)
    dout = torch.randn(batch, n, HEADS_Q, DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, k, v, sinks, dout


def rel_error(got, ref) -> float:
    got = got.double()
    if not torch.isfinite(got).all():
        return math.nan
    return ((got - ref).norm() / ref.norm()).item()


def check(layer: str, found: dict, n: int = 2047) -> list:
    window = WINDOW if layer.startswith("sliding") else None
    rows = []
    for far in (False, True):
        q, k, v, sinks, dout = inputs(1, n, far, seed=11 + far)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
        ref = gpt_oss_sdpa(*leaves, window)
        ref_grads = torch.autograd.grad(ref, leaves, dout.double())
        for name, fn in found.items():
            if isinstance(fn, str):
                continue
            row = dict(layer=layer, backend=name, sinks="±8 from the logits" if far else "near")
            try:
                mine = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
                out = fn(*mine)
                grads = torch.autograd.grad(out, mine, dout, allow_unused=True)
                row["out"] = rel_error(out, ref)
                for label, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
                    row[label] = math.nan if g is None else rel_error(g, r)
                # bf16 operands land between 1e-3 and 1e-2 (METHOD.md); NaN never passes.
                row["ok"] = all(row[key] <= 2e-2 for key in ("out", "dq", "dk", "dv", "dsinks"))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                row["ok"] = False
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ref, ref_grads, leaves
        torch.cuda.empty_cache()
    return rows


def time_layer(layer: str, found: dict, n: int, rounds: int) -> list:
    from triton.testing import do_bench
    q, k, v, sinks, dout = inputs(1, n, False, seed=n)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    steps = {}
    for name, fn in found.items():
        if isinstance(fn, str):
            continue

        def forward(fn=fn):
            return fn(*leaves)

        def both(fn=fn):
            torch.autograd.grad(fn(*leaves), leaves, dout)
        try:
            both()  # compiles (FA4's CuTe kernels, FlexAttention's Triton) outside the timing
            steps[name] = (forward, both)
        except Exception as err:
            print(f"{layer} {n}: {name} did not run: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:200]}", flush=True)
            found[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    times = {name: ([], []) for name in steps}
    for _ in range(rounds):  # interleaved: each round times every backend once
        for name, (forward, both) in steps.items():
            times[name][0].append(do_bench(forward, warmup=25, rep=200, return_mode="median"))
            times[name][1].append(do_bench(both, warmup=25, rep=200, return_mode="median"))
    rows = []
    for name, (fwd, fb) in times.items():
        f, b = statistics.median(fwd), statistics.median(fb)
        rows.append(dict(layer=layer, len=n, backend=name, fwd_ms=f, fwd_bwd_ms=b, bwd_ms=b - f,
                         fwd_runs=fwd, fwd_bwd_runs=fb))
    mine = next((r for r in rows if r["backend"] == "attncc"), None)
    for r in rows:
        if mine:
            r["fwd_ratio"] = r["fwd_ms"] / mine["fwd_ms"]
            r["bwd_ratio"] = r["bwd_ms"] / mine["bwd_ms"]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part", choices=["all", "correctness", "speed"], default="all")
    args = parser.parse_args()
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}", flush=True)
    checks, speed, skipped = [], [], {}
    for layer in LAYERS:
        found = backends(layer)
        skipped.update({f"{layer}: {k}": v for k, v in found.items() if isinstance(v, str)})
        if args.part in ("all", "correctness"):
            checks += check(layer, found)
        if args.part in ("all", "speed"):
            for n in args.lengths:
                speed += time_layer(layer, found, n, args.rounds)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpt_oss_sinks.json"), "w") as f:
            json.dump(dict(checks=checks, speed=speed, skipped=skipped), f, indent=1)
    for reason in skipped.items():
        print("not run:", *reason)
    print("\ncorrectness (relative L2 error against float64 gpt-oss sdpa, length 2047)")
    for r in checks:
        errs = "  ".join(f"{key} {r[key]:.2e}" for key in ("out", "dq", "dk", "dv", "dsinks")
                         if key in r)
        print(f"  {r['layer']:12s} {r['backend']:14s} {r['sinks']:20s} "
              f"{'ok ' if r['ok'] else 'BAD'} {errs or r.get('error', '')}")
    print("\nspeed (B=1, 64/8 heads, D=64, bf16; ratio = other's ms / attncc's)")
    print(f"  {'layer':12s} {'len':>6s} {'backend':14s} {'fwd ms':>8s} {'bwd ms':>8s} "
          f"{'fwd ratio':>9s} {'bwd ratio':>9s}")
    for r in speed:
        print(f"  {r['layer']:12s} {r['len']:6d} {r['backend']:14s} {r['fwd_ms']:8.3f} "
              f"{r['bwd_ms']:8.3f} {r.get('fwd_ratio', math.nan):9.2f} "
              f"{r.get('bwd_ratio', math.nan):9.2f}")
    bad = [r for r in checks if r["backend"] == "attncc" and not r["ok"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
