"""Kernel experiments: code edits and tile configs, A/B in one process.

    python benchmarks/archive/kernel_variants.py [--len 16384] [--variants full,causal]
                                         [--kernels fwd,dq,dkdv] [--edits baseline,tma,...]

Each experiment is a small, named edit of one kernel's section of the generated module
(a text substitution that must match the stated number of times), so a change can be
measured before it goes into backends/portable/templates/attention.py.jinja. Every (edit, config) pair
is checked against the unedited kernel at its first config in the same process and
timed with triton.testing.do_bench (median), on the ANCHORS shapes: 16 heads, head
dim 128 (or --dim), bf16, batch x seq = 16384 tokens. Prints a table last and writes JSON to
$OUT/kernel_variants.json. (Session 2's forward edits, run 12 in RESULTS.md, are in
the template now; this file's history has them.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import attncc  # noqa: E402
from attncc.runtime.cache import load_generated

SPECS = {"full": "attention full { }", "causal": "attention causal { mask q >= k }"}

# Where each kernel's code lies in the generated module: [start, end).
SECTIONS = {
    "fwd": ("def _fwd_step(", "# ------------------------------------------------------------------ backward: preprocess"),
    "dq": ("def _dq_step(", "# ------------------------------------------------------------------ backward: dK, dV"),
    "dkdv": ("def _dkdv_step(", "# ------------------------------------------------------------------ host side"),
}


def _descriptor(name, base, rows, stride, block):
    return (f"    {name} = tl.make_tensor_descriptor({base}, shape=[{rows}, HEAD_DIM], "
            f"strides=[{stride}, 1], block_shape=[{block}, HEAD_DIM])\n")


# kernel -> edit name -> [(old, new, count)]: old must occur exactly `count` times.
KV_CTX = ", K, V, stride_kn, stride_kd, stride_vn, stride_vd,"
KV_CTX_TMA = ", desc_k, desc_v, stride_kn, stride_kd, stride_vn, stride_vd,"
K_LOAD_T = """kt = _load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
               d_valid[:, None] & k_valid[None, :], MASKED, HEAD_DIM != HEAD_DIM_PAD)  # [D, BLOCK_N]"""
V_LOAD = """v = _load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
              k_valid[:, None] & d_valid[None, :], MASKED, HEAD_DIM != HEAD_DIM_PAD)  # [BLOCK_N, D]"""
V_LOAD_T = """vt = _load(V + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
               d_valid[:, None] & k_valid[None, :], MASKED, HEAD_DIM != HEAD_DIM_PAD)  # [D, BLOCK_N]"""
KV_BASE = "    V += off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh\n"
# TMA (tensor descriptors, built on the device per (batch, head)); rows past the end
# load as zeros, as the masked pointer loads do.
KV_DESCRIPTORS = (KV_BASE + _descriptor("desc_k", "K", "len_k", "stride_kn", "BLOCK_N")
                  + _descriptor("desc_v", "V", "len_k", "stride_vn", "BLOCK_N"))
TMA = {
    "fwd": [(KV_BASE, KV_DESCRIPTORS, 1), (KV_CTX, KV_CTX_TMA, None),
            (K_LOAD_T, "kt = desc_k.load([tile_k * BLOCK_N, 0]).T", 1),
            (V_LOAD, "v = desc_v.load([tile_k * BLOCK_N, 0])", 1)],
    "dq": [(KV_BASE, KV_DESCRIPTORS, 1), (KV_CTX, KV_CTX_TMA, None),
           (K_LOAD_T, "kt = desc_k.load([tile_k * BLOCK_N, 0]).T", 1),
           (V_LOAD_T, "vt = desc_v.load([tile_k * BLOCK_N, 0]).T", 1)],
    "dkdv": [("        DELTA = DELTA0 + pid_bh.to(tl.int64) * len_q\n",
              "        DELTA = DELTA0 + pid_bh.to(tl.int64) * len_q\n"
              + "    " + _descriptor("desc_q", "Q", "len_q", "stride_qm", "BLOCK_M")
              + "    " + _descriptor("desc_do", "DO", "len_q", "stride_dom", "BLOCK_M"), 1),
             (", Q, DO, LSE, DELTA, stride_qm", ", desc_q, desc_do, LSE, DELTA, stride_qm", None),
             ("""qt = _load(Q + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
               d_valid[:, None] & m_valid[None, :], MASKED, HEAD_DIM != HEAD_DIM_PAD)  # [D, BLOCK_M]""",
              "qt = desc_q.load([tile_q * BLOCK_M, 0]).T", 1),
             ("""do = _load(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
               m_valid[:, None] & d_valid[None, :], MASKED, HEAD_DIM != HEAD_DIM_PAD)  # [BLOCK_M, D]""",
              "do = desc_do.load([tile_q * BLOCK_M, 0])", 1)],
}
LOOP = {"fwd": "for tile_k in range(tile_lo, tile_hi):", "dq": "for tile_k in range(tile_lo, tile_hi):",
        "dkdv": "for tile_q in range(tile_lo, tile_hi):"}


def _ws(kernel):
    old = LOOP[kernel]
    return [(old, old.replace("range(tile_lo, tile_hi)",
                              "tl.range(tile_lo, tile_hi, warp_specialize=True)"), 1)]


def _reverse(kernel):
    # The longest rows of a causal mask are the last query tiles: start them first, so
    # the last wave of programs holds short ones.
    first = "    tile_q = pid % n_tiles\n" if kernel != "dkdv" else None
    return [(first, "    tile_q = n_tiles - 1 - pid % n_tiles\n", 1)] if first else None


# Full forward tiles (every pair allowed): the row max from the raw products, then one
# FMA per score for exp2's argument, instead of a multiply and a subtract.
FMA = [("    t = qk * qk_scale  # scale and log2(e) folded into one multiply\n    if MASKED:\n",
        "    if MASKED:\n        t = qk * qk_scale\n", 1),
       ("""    m_new = tl.maximum(m_i, tl.max(t, 1))
    # A row that has seen no allowed key keeps max -inf: subtract 0 instead, so that
    # exp2(-inf - -inf) never makes a NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(t - m_use[:, None])
""", """        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(t - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
""", 1)]

# Lazy rescaling (FlashAttention-4's trick): keep a row's running max until a tile
# raises it by more than 8 (log2 units, so p <= 256), and rescale acc and l_i only on
# tiles where some row's max moved; the final division cancels the stale max exactly.
LAZY = [("""    m_new = tl.maximum(m_i, tl.max(t, 1))
    # A row that has seen no allowed key keeps max -inf: subtract 0 instead, so that
    # exp2(-inf - -inf) never makes a NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(t - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
""", """    m_cand = tl.maximum(m_i, tl.max(t, 1))
    grow = m_cand > m_i + 8.0
    m_new = tl.where(grow, m_cand, m_i)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(t - m_use[:, None])
    if tl.max(grow.to(tl.int32), 0) > 0:
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    l_i = l_i + tl.sum(p, 1)
""", 1)]


def edits_for(kernel):
    table = {"baseline": [], "tma": TMA[kernel], "ws": _ws(kernel), "tma_ws": TMA[kernel] + _ws(kernel)}
    if _reverse(kernel):
        table["reverse"] = _reverse(kernel)
        table["tma_reverse"] = TMA[kernel] + _reverse(kernel)
    if kernel == "fwd":
        table["fma"] = FMA
        table["fma_reverse"] = FMA + _reverse(kernel)
        table["lazy"] = LAZY
        table["lazy_reverse"] = LAZY + _reverse(kernel)
    return table


# The first config of each kernel is the reference for the error column. Run 19 tried
# more (128x64 w4, 128x128 w4 and s4 forward; 128x64 w4 dQ; 64x128 w4 dK/dV): slower.
CONFIGS = {
    "fwd": [(128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2)],
    "dkdv": [(64, 64, 4, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 1)],
}


def edited_module(gen, kernel: str, edit: str, workdir: Path):
    source = gen.source
    start_text, end_text = SECTIONS[kernel]
    start = source.index(start_text)
    end = source.index(end_text, start)
    section = source[start:end]
    for old, new, count in edits_for(kernel)[edit]:
        found = section.count(old)
        assert (found >= 1 if count is None else found == count), \
            f"{kernel} edit {edit}: the text to replace occurs {found} times"
        section = section.replace(old, new)
    source = source[:start] + section + source[end:]
    name = f"{gen.module_name}_{kernel}_{edit}"
    path = workdir / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _launcher(module, kernel, q, k, v, out, lse, delta, do, config):
    if kernel == "fwd":
        return lambda: module.forward(q, k, v, {}, config=config)
    if kernel == "dq":
        return lambda: module.backward_dq(q, k, v, lse, delta, do, {}, config=config)[:1]
    return lambda: module.backward_dkdv(q, k, v, lse, delta, do, {}, config=config)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--variants", default="full,causal")
    ap.add_argument("--kernels", default="fwd,dq,dkdv")
    ap.add_argument("--edits", default=None, help="comma list; default: every edit of each kernel")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--configs", default=None,
                    help="KERNEL:MxNwWsS[,...] entries separated by ';' (e.g. 'fwd:128x64w4s3'), "
                         "replacing that kernel's CONFIGS; the first is the error reference")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    workdir = Path(tempfile.mkdtemp(prefix="attncc_kernels_"))
    # Device-side tensor descriptors need a scratch allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    if args.configs:
        for entry in args.configs.split(";"):
            kernel, _, listed = entry.partition(":")
            CONFIGS[kernel] = [tuple(int(x) for x in re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", c).groups())
                               for c in listed.split(",")]
    L, H, D = args.len, 16, args.dim
    B = max(1, 16384 // L)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B={B} H={H} L={L} D={D} bf16", flush=True)
    rows = []
    for vname in args.variants.split(","):
        causal = vname == "causal"
        pairs = L * L if not causal else L * (L + 1) // 2
        gen, _ = load_generated(attncc.parse(SPECS[vname]))
        for kernel in args.kernels.split(","):
            products = {"fwd": 2, "dq": 3, "dkdv": 4}[kernel]
            flops = 2 * products * D * pairs * B * H
            base = edited_module(gen, kernel, "baseline", workdir)
            m, n, w, s = CONFIGS[kernel][0]
            cfg0 = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            out, lse = base.forward(q, k, v, {}, config=cfg0)
            delta = base.backward_delta(out, do)
            want = _launcher(base, kernel, q, k, v, out, lse, delta, do, cfg0)()
            edits = args.edits.split(",") if args.edits else list(edits_for(kernel))
            for edit in edits:
                if edit not in edits_for(kernel):
                    continue
                try:
                    module = edited_module(gen, kernel, edit, workdir)
                except AssertionError as e:
                    print(f"{vname} {kernel} {edit}: {e}", flush=True)
                    continue
                for m, n, w, s in CONFIGS[kernel]:
                    config = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                    label = f"{m}x{n} w{w} s{s}"
                    run = _launcher(module, kernel, q, k, v, out, lse, delta, do, config)
                    try:
                        got = run()
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                        ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                    except Exception as e:  # out of resources, unsupported: say so and go on
                        print(f"{vname} {kernel} {edit} {label}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}", flush=True)
                        continue
                    rows.append(dict(variant=vname, kernel=kernel, edit=edit, config=label, ms=ms,
                                     tflops=flops / ms / 1e9, err=err))
                    print(f"{vname:7s} {kernel:5s} {edit:12s} {label:16s} {ms:8.3f} ms "
                          f"{flops / ms / 1e9:6.0f} TFLOP/s  err vs baseline {err:.2e}", flush=True)
    (out_dir / "kernel_variants.json").write_text(json.dumps(rows, indent=1))
    print("\nbest config per (variant, kernel, edit)")
    print("variant  kernel edit         config             ms    TFLOP/s   err")
    best = {}
    for r in rows:
        key = (r["variant"], r["kernel"], r["edit"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for key in sorted(best, key=lambda key: (key[0], key[1], best[key]["ms"])):
        r = best[key]
        print(f"{r['variant']:8s} {r['kernel']:6s} {r['edit']:12s} {r['config']:16s} {r['ms']:7.3f} "
              f"{r['tflops']:7.0f}   {r['err']:.1e}")


if __name__ == "__main__":
    main()
