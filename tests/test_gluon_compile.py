"""The Gluon kernels compile for sm_90 on the CPU: Triton compiles a Gluon kernel for a
target given by hand, all the way to PTX and a cubin through its bundled ptxas, with no
GPU. What this catches: Gluon type and layout errors, a pipeline that lost its bulk
copies or barriers, shared memory past Hopper's. It proves nothing about the results:
benchmarks/gluon_check.py holds the kernels to the float64 reference on the GPU.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: under TRITON_INTERPRET (set by conftest.py before triton is
# imported) gluon.jit makes interpreted functions, which do not compile.
COMPILE_GLUON = r'''
import importlib.util, itertools, json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import attncc
from attncc.backends.gluon import codegen as gluon

head_dims = [int(d) for d in sys.argv[2].split(",")]


def load(example, path):
    variant = attncc.load(example)
    open(path, "w").write(gluon.generate(variant).source)
    name = f"gluon_{variant.name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return variant, module


POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "DLSE": "*fp32", "O": "*bf16", "DO": "*bf16"}
DTYPES = {"f32": "*fp32", "i32": "*i32", "bool": "*i1"}
# kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages, other constexprs); BLOCK_M is the
# query tile's rows (the warp-specialized forward's consumers take half each).
KERNELS = {"attn_fwd": (128, 128, 8, 2, {}),
           "attn_fwd_ws": (128, 128, 4, 2, {}),
           "attn_bwd_dq": (64, 64, 4, 2, {"DELTA_FROM_O": True, "HAS_DLSE": True}),
           "attn_bwd_dkdv": (64, 64, 4, 2, {})}


def signature(variant, module, fn, consts, dim, rows):
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_desc"):  # a TMA descriptor of [rows, dim] tiles
            block, layout = module._shared_layout(rows[n], dim, torch.bfloat16)
            sig[n] = f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"
        elif n in POINTERS:
            sig[n] = POINTERS[n]
        elif n.endswith(("_list", "_count")):  # tile tables
            sig[n] = "*i32"
        elif n.startswith(("d_in_", "part")):  # a learnable input's gradient or partials, fp32
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):  # input x is in_x_ptr (attncc/codegen/elementwise.py)
            sig[n] = DTYPES[variant.input(n[len("in_"):-len("_ptr")]).dtype]
        else:
            sig[n] = "fp32" if n in ("sm_scale", "qk_scale") else "i32"
    return sig


harness_spec = importlib.util.spec_from_file_location("gluon_compile", "benchmarks/gluon_compile.py")
harness = importlib.util.module_from_spec(harness_spec)
harness_spec.loader.exec_module(harness)


def report(example, name, dim, compiled):
    ttgir = compiled.asm["ttgir"]
    ops = ("ttng.async_tma_copy_global_to_local", "ttng.wait_barrier", "ttng.warp_group_dot",
           "ttng.async_tma_copy_local_to_global", "ttg.warp_specialize")
    cubin = compiled.asm["cubin"]
    forward = name.startswith("attn_fwd")
    print(json.dumps({"example": example, "kernel": name, "dim": dim,
                      "shared": compiled.metadata.shared, "cubin": len(cubin),
                      "ops": {op: op in ttgir for op in ops},
                      "stack": harness.stack_bytes(cubin),
                      "overlap": harness.softmax_overlap(harness.disassemble(cubin)) if forward else None}),
          flush=True)


only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(KERNELS)
for example in sys.argv[1].split(","):
    variant, module = load(example, f"{sys.argv[3]}/{len(sys.modules)}.py")
    for dim, name in itertools.product(head_dims, only):
        bm, bn, warps, stages, extra = KERNELS[name]
        fn = getattr(module, name)
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=dim, NUM_STAGES=stages, WIDE=False, **extra)
        half = bm // 2 if name == "attn_fwd_ws" else bm
        rows = dict(q_desc=bm, do_desc=bm, dq_desc=bm, o_desc=half, k_desc=bn, v_desc=bn,
                    dk_desc=bn, dv_desc=bn)
        src = GluonASTSource(fn=fn, signature=signature(variant, module, fn, consts, dim, rows),
                             constexprs=consts)
        report(example, name, dim, triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                  options=dict(num_warps=warps, num_stages=stages)))
'''


def _compile(examples: list, head_dims: list, tmp_path, kernels: tuple = ()) -> list:
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run([sys.executable, "-c", COMPILE_GLUON,
                             ",".join(str(ROOT / "examples" / e) for e in examples),
                             ",".join(map(str, head_dims)), str(tmp_path), *[",".join(kernels)] * bool(kernels)],
                            capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _check(results: list, examples: list, head_dims: list):
    from attncc.backends.gluon.tiles import SMEM_LIMIT
    kernels = ("attn_fwd", "attn_fwd_ws", "attn_bwd_dq", "attn_bwd_dkdv")
    assert sorted((Path(r["example"]).name, r["kernel"], r["dim"]) for r in results) == sorted(
        (e, k, d) for e in examples for k in kernels for d in head_dims)
    for r in results:
        what = f"{Path(r['example']).name}: {r['kernel']} at head dim {r['dim']}"
        assert r["cubin"] > 0, what
        assert 0 < r["shared"] <= SMEM_LIMIT, what
        ops = r["ops"]
        # Tiles arrive by bulk copy into the mbarrier ring, the products are wgmma, and the
        # result leaves by bulk copy.
        assert ops["ttng.async_tma_copy_global_to_local"] and ops["ttng.wait_barrier"], what
        assert ops["ttng.warp_group_dot"] and ops["ttng.async_tma_copy_local_to_global"], what
        assert ops["ttg.warp_specialize"] == (r["kernel"] == "attn_fwd_ws"), what


def test_gluon_kernels_compile_for_hopper(tmp_path):
    # One variant of each kind of tile plan: an analytic interval (causal) and tile tables
    # (document); about 15 s on two cores.
    examples = ["causal.attn", "document.attn"]
    _check(_compile(examples, [64], tmp_path), examples, [64])


@pytest.mark.slow
def test_gluon_kernels_compile_for_hopper_at_every_head_dim(tmp_path):
    # Two intervals, a layout, index lists, a score, a sink, a normaliser other than
    # softmax: every kernel at both backward head dims.
    examples = ["prefix_lm.attn", "bigbird.attn", "nsa_topk.attn", "relative_bias.attn",
                "gpt_oss_sinks.attn", "sigmoid_attention.attn"]
    _check(_compile(examples, [64, 128], tmp_path), examples, [64, 128])


def _check_overlap(results: list):
    # The forward runs the softmax of key tile i under the P V product of tile i - 1: in
    # the machine code, a tile loop computes all of the tile's exp2s (64 per thread: a
    # warpgroup's 64 x 128 slice of P over 128 threads) between the wait for S_i and
    # the wait for P_{i-1} V_{i-1}: the full tiles' loop (of each consumer warpgroup of
    # attn_fwd_ws); the partial tiles' loops wait for P V first (the mask beside the
    # in-flight product spilled). Before the full and partial tiles had loops of their
    # own, ptxas put the P V wait first: 0 of 66. And no spill inside a loop (Triton
    # 3.9's ptxas keeps a scalar on the stack across them).
    for r in results:
        what = f"{Path(r['example']).name}: {r['kernel']} at head dim {r['dim']}"
        loops = r["overlap"]
        overlapped = [loop for loop in loops if loop[0] is not None]
        assert len(overlapped) >= (2 if r["kernel"] == "attn_fwd_ws" else 1), \
            f"{what}: (exp2s under P V, in the loop, spills): {loops}"
        starved = [loop for loop in overlapped if loop[0] < 64]
        assert not starved, f"{what}: (exp2s under P V, in the loop, spills): {loops}"
        assert not any(loop[2] for loop in loops), f"{what}: spills: {loops}"


def test_gluon_forward_softmax_runs_under_the_pv_product(tmp_path):
    # Causal, the warp-specialized kernel (the first candidate at head dims 64 and 128):
    # the full tiles and the diagonal's partial ones in loops of their own; about 18 s.
    _check_overlap(_compile(["causal.attn"], [128], tmp_path, ("attn_fwd_ws",)))


@pytest.mark.slow
def test_gluon_forward_softmax_runs_under_the_pv_product_of_every_timed_variant(tmp_path):
    # The forward variants benchmarks/gpu_suite.py times, at its head dim, and causal's
    # one-partition kernel. Not held to it: head dim 64, where ptxas still waits for part
    # of the (shorter) P V product before the exp2s; tile tables, a plan of two segments
    # and a score of more than s (ALiBi), which keep one loop and no overlap. The
    # machine code that runs is the GPU machine's ptxas's (Triton 3.6, CUDA 12.8); Triton
    # 3.9's (CUDA 13) places the warp-specialized consumer's P V wait right after a
    # barrier arrive it puts after about 20 of the 66 exp2s: there, attn_fwd only.
    import triton
    kernels = ("attn_fwd", "attn_fwd_ws") if triton.__version__.startswith("3.6") else ("attn_fwd",)
    examples = ["full.attn", "gqa_causal.attn", "sliding_window.attn", "softcap.attn"]
    results = _compile(examples, [128], tmp_path, kernels)
    _check_overlap(results + _compile(["causal.attn"], [128], tmp_path, ("attn_fwd",)))
