"""Forward-kernel experiments: code changes and tile configs, A/B in one process.

    python benchmarks/fwd_variants.py [--len 16384] [--variants full,causal]

Each experiment is a small, named edit of the generated module's source (applied as a
text substitution that must match exactly once), so a change can be measured before it
goes into templates/attention.py.jinja. Every (edit, config) pair is checked against
SDPA in the same process and timed with triton.testing.do_bench (median), on the
ANCHORS shapes: 16 heads, head dim 128, bf16, batch x seq = 16384 tokens. The cuDNN
backend of SDPA is timed on the same inputs for scale. Prints a table last and writes
JSON to $OUT/fwd_variants.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attncc  # noqa: E402
from attncc.runtime import load_generated  # noqa: E402

SPECS = {"full": "attention full { }", "causal": "attention causal { mask q >= k }"}

K_LOAD = """    kt = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                 mask=d_valid[:, None] & k_valid[None, :], other=0.0)  # [D, BLOCK_N]"""
V_LOAD = """    v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=k_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, D]"""

# name -> [(old, new)]: each old text must occur exactly once in the forward step.
EDITS = {
    "baseline": [],
    # K loaded row-major as stored ([BLOCK_N, D]) and transposed as a view for the dot.
    "k_rowmajor": [(K_LOAD, """    kt = tl.trans(tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                          mask=k_valid[:, None] & d_valid[None, :], other=0.0))  # [D, BLOCK_N]""")],
    # Full tiles are complete and (at D = 128) need no head-dim padding: load unmasked.
    "unmasked_full": [
        (K_LOAD, """    if MASKED:
        kt = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=d_valid[:, None] & k_valid[None, :], other=0.0)
    else:
        kt = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd)"""),
        (V_LOAD, """    if MASKED:
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=k_valid[:, None] & d_valid[None, :], other=0.0)
    else:
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)"""),
    ],
}
EDITS["both"] = [
    (K_LOAD, """    if MASKED:
        kt = tl.trans(tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                              mask=k_valid[:, None] & d_valid[None, :], other=0.0))
    else:
        kt = tl.trans(tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd))"""),
    EDITS["unmasked_full"][1],
]

CONFIGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3)]


def edited_module(variant, edit: str, workdir: Path):
    gen, _ = load_generated(variant)
    source = gen.source
    # Edits apply to the forward step only (the dQ step loads K the same way).
    start = source.index("def _fwd_step(")
    end = source.index("@triton.jit", start)
    step = source[start:end]
    for old, new in EDITS[edit]:
        count = step.count(old)
        assert count == 1, f"edit {edit}: the text to replace occurs {count} times"
        step = step.replace(old, new)
    source = source[:start] + step + source[end:]
    name = f"{gen.module_name}_{edit}"
    path = workdir / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--variants", default="full,causal")
    ap.add_argument("--edits", default=",".join(EDITS))
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    workdir = Path(tempfile.mkdtemp(prefix="attncc_fwd_"))
    L, H, D = args.len, 16, 128
    B = max(1, 16384 // L)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B={B} H={H} L={L} D={D} bf16", flush=True)
    rows = []
    for vname in args.variants.split(","):
        causal = vname == "causal"
        pairs = L * L if not causal else L * (L + 1) // 2
        flops = 4 * D * pairs * B * H
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal), warmup=25, rep=200, return_mode="median")
        rows.append(dict(variant=vname, edit="cuDNN (SDPA)", config="-", ms=ms,
                         tflops=flops / ms / 1e9, err=0.0))
        variant = attncc.parse(SPECS[vname])
        for edit in args.edits.split(","):
            module = edited_module(variant, edit, workdir)
            for m, n, w, s in CONFIGS:
                config = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                label = f"{m}x{n} w{w} s{s}"
                run = lambda: module.forward(q, k, v, {}, config=config)
                try:
                    out, _ = run()
                    err = (out.float() - want.float()).abs().max().item()
                    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                except Exception as e:  # out of resources: say so and go on
                    print(f"{vname} {edit} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append(dict(variant=vname, edit=edit, config=label, ms=ms,
                                 tflops=flops / ms / 1e9, err=err))
                print(f"{vname:7s} {edit:14s} {label:16s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} "
                      f"TFLOP/s  max err {err:.2e}", flush=True)
    (out_dir / "fwd_variants.json").write_text(json.dumps(rows, indent=1))
    print("\nvariant  edit            config             ms    TFLOP/s   max err")
    for r in sorted(rows, key=lambda r: (r["variant"], r["ms"])):
        print(f"{r['variant']:8s} {r['edit']:15s} {r['config']:16s} {r['ms']:7.3f} {r['tflops']:7.0f}"
              f"   {r['err']:.1e}")


if __name__ == "__main__":
    main()
