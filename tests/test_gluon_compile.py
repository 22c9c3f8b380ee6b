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
import importlib.util, itertools, json, re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import tma
import attncc
from attncc.backends.gluon import codegen as gluon, kernel_unsupported

# "128" (q, k, v all 128 wide) or "192:128" (q·k 192, v 128; the backward kernels where
# the Gluon backend takes the pair).
head_dims = [(int(d), int(dv or d)) for d, _, dv in (a.partition(":") for a in sys.argv[2].split(","))]
kernels = sys.argv[4].split(",")
SASS = "sass" in sys.argv[5:]  # also count packed predicates in the disassembly (slow)
# With "spills", each kernel's registers and spill bytes too (ptxas -v, a second or so each).
with_spills = "spills" in sys.argv[5:]
if with_spills:
    sys.path.insert(0, "benchmarks")
    from gluon_compile import ptxas_resources


def load(example, path):
    variant = attncc.load(example)
    open(path, "w").write(gluon.generate(variant).source)
    name = f"gluon_{variant.name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "APPROX_TANH"):  # the path an NVIDIA GPU takes; this import saw none
        module.APPROX_TANH = triton.language.constexpr(True)
    return variant, module


POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "DLSE": "*fp32", "O": "*bf16", "DO": "*bf16",
            "DQ": "*fp32"}
DTYPES = {"f32": "*fp32", "i32": "*i32", "bool": "*i1"}
# label: (kernel, BLOCK_M, BLOCK_N, num_warps, num_stages, other constexprs); BLOCK_M is
# the query tile's rows (the warp-specialized forward's CONSUMERS take a share each).
KERNELS = {"attn_fwd": ("attn_fwd", 128, 128, 8, 2, {}),
           "attn_fwd_ws": ("attn_fwd_ws", 128, 128, 4, 2, {"CONSUMERS": 2}),
           "attn_fwd_ws_s3": ("attn_fwd_ws", 128, 128, 4, 3, {"CONSUMERS": 2}),
           "attn_fwd_ws3": ("attn_fwd_ws", 192, 128, 4, 2, {"CONSUMERS": 3}),
           "attn_fwd_ws3_n64": ("attn_fwd_ws", 192, 64, 4, 2, {"CONSUMERS": 3}),
           "attn_bwd_dq": ("attn_bwd_dq", 64, 64, 4, 2, {"DELTA_FROM_O": True, "HAS_DLSE": True}),
           # dQ's other candidates for relative tables (tiles.dq_fits_registers)
           "attn_bwd_dq_m128_w8": ("attn_bwd_dq", 128, 64, 8, 2, {"DELTA_FROM_O": True, "HAS_DLSE": True}),
           "attn_bwd_dq_s3": ("attn_bwd_dq", 64, 64, 4, 3, {"DELTA_FROM_O": True, "HAS_DLSE": True}),
           "attn_bwd_dkdv": ("attn_bwd_dkdv", 64, 64, 4, 2, {}),
           # Two warpgroups side by side on 64 key rows (the (192, 128) candidates'), on
           # 32-query tiles for variants with learnable inputs (tiles.backward_fits_registers).
           "attn_bwd_dkdv_w8": ("attn_bwd_dkdv", 64, 64, 8, 2, {}),
           "attn_bwd_dkdv_w8_m32": ("attn_bwd_dkdv", 32, 64, 8, 2, {}),
           # dQ's two warpgroups side by side on 64 query rows (the head dim 256 candidates').
           "attn_bwd_dq_w8": ("attn_bwd_dq", 64, 64, 8, 2, {"DELTA_FROM_O": True, "HAS_DLSE": True}),
           # The fused backward (deterministic=False): two consumer warpgroups on 64 key
           # rows each and a producer warp, launched as 4 warps (tiles.fused_candidates).
           "attn_bwd_fused_ws": ("attn_bwd_fused_ws", 64, 128, 4, 2, {})}


def signature(variant, module, fn, consts, widths, rows):
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n == "dq_desc" and fn.__name__ == "attn_bwd_fused_ws":  # its float32 dQ columns
            width = widths["dq_desc"]
            sig[n] = f"tensordesc<fp32[1,1,{rows[n]},{width}],{module._float32_layout(rows[n], width)!r}>"
        elif n in ("lse_desc", "delta_desc"):  # flat rows of float32 statistics
            layout = module.gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
            sig[n] = f"tensordesc<fp32[{rows['q_desc']}],{layout!r}>"
        elif n.endswith("_desc"):  # a TMA descriptor of [rows, width] tiles
            block, layout = module._shared_layout(rows[n], widths.get(n, widths["q_desc"]),
                                                  torch.bfloat16)
            sig[n] = f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"
        elif n in POINTERS:
            sig[n] = POINTERS[n]
        elif n.endswith(("_list", "_count", "_order")):  # tile tables
            sig[n] = "*i32"
        elif n.startswith(("d_in_", "part")):  # a learnable input's gradient or partials, fp32
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):  # input x is in_x_ptr (attncc/codegen/elementwise.py)
            sig[n] = DTYPES[variant.input(n[len("in_"):-len("_ptr")]).dtype]
        else:
            sig[n] = "fp32" if n in ("sm_scale", "qk_scale") else "i32"
    return sig


def sass(cubin: bytes) -> str:
    """The cubin's machine code, by Triton's bundled nvdisasm."""
    import pathlib, subprocess, tempfile
    nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def opcodes(sass: str) -> dict:
    """How often each SASS opcode (FFMA, P2R, ...: the name before its first dot) occurs."""
    found = {}
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            found[m.group(1)] = found.get(m.group(1), 0) + 1
    return found


def exp2_between_waits(sass: str) -> list:
    """For each wait for S (the first of two wgmma groups, DEPBAR gsb0 0x1) in program
    order, the exponentials (MUFU.EX2) before the next wait for P V (gsb0 0x0): those
    run under the warpgroup's own P V product."""
    counts, inside = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            inside = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            if inside is not None:
                counts.append(inside)
            inside = None
        elif inside is not None and "MUFU.EX2" in line:
            inside += 1
    return counts


def report(example, name, dims, compiled):
    ttgir = compiled.asm["ttgir"]
    ops = ("ttng.async_tma_copy_global_to_local", "ttng.wait_barrier", "ttng.warp_group_dot",
           "ttng.async_tma_copy_local_to_global", "ttg.warp_specialize", "tt.atomic_rmw",
           "ttng.async_tma_reduce")
    print(json.dumps({"example": example, "kernel": name, "dim": "%d:%d" % dims,
                      "tma_reduce": hasattr(tma, "async_atomic_add"),
                      "shared": compiled.metadata.shared, "cubin": len(compiled.asm["cubin"]),
                      "ops": {op: op in ttgir for op in ops},
                      "tanh_approx": "tanh.approx.f32" in compiled.asm["ptx"],
                      # P2R: predicates packed into a register (a tile of mask bits kept
                      # live across a kernel's products takes about one per pair).
                      "opcodes": opcodes(sass(compiled.asm["cubin"])) if SASS else None,
                      "exp2_between_waits": exp2_between_waits(sass(compiled.asm["cubin"])) if SASS else None,
                      "ptxas": ptxas_resources(compiled.asm["ptx"]) if with_spills else None}),
          flush=True)


for example in sys.argv[1].split(","):
    variant, module = load(example, f"{sys.argv[3]}/{len(sys.modules)}.py")
    for dims, label in itertools.product(head_dims, kernels):
        name, bm, bn, warps, stages, extra = KERNELS[label]
        forward = name.startswith("attn_fwd")
        kind = "fused" if name.startswith("attn_bwd_fused") else name[len("attn_bwd_"):]
        if not forward and kernel_unsupported(variant, kind, *dims):
            continue  # the pairs the backward kernels do not take
        fn = getattr(module, name)
        # q·k's segments (192 = 128 + 64), as the launchers split them.
        first, tail = module._segments(dims[0])
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=first, HEAD_DIM_TAIL=tail,
                      HEAD_DIM_V=dims[1], NUM_STAGES=stages, WIDE=False, **extra)
        # (the fused backward's one head dim takes no tail or v width of its own)
        consts = {n: value for n, value in consts.items() if n in fn.arg_names}
        widths = dict(q_desc=first, k_desc=first, qt_desc=tail or first, kt_desc=tail or first,
                      dq_desc=first, dk_desc=first, dqt_desc=tail or first,
                      dkt_desc=tail or first, v_desc=dims[1], o_desc=dims[1],
                      do_desc=dims[1], dv_desc=dims[1])
        share = bm // extra.get("CONSUMERS", 1)  # a consumer's rows: its Q and O boxes
        rows = dict(q_desc=share, do_desc=bm, dq_desc=bm, o_desc=share, k_desc=bn, v_desc=bn,
                    dk_desc=bn, dv_desc=bn, qt_desc=share, kt_desc=bn, dqt_desc=bm,
                    dkt_desc=bn)
        if name == "attn_bwd_fused_ws":  # column halves of K, Q, dK, dQ; row halves of V, dK, dV
            half = first // 2
            widths.update(q_desc=half, k_desc=half, dk_desc=half, dq_desc=half)
            rows.update(v_desc=bn // 2, dk_desc=bn // 2, dv_desc=bn // 2)
        src = GluonASTSource(fn=fn, signature=signature(variant, module, fn, consts, widths, rows),
                             constexprs=consts)
        report(example, label, dims, triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                    options=dict(num_warps=warps, num_stages=stages)))
'''


KERNELS = ("attn_fwd", "attn_fwd_ws", "attn_bwd_dq", "attn_bwd_dkdv")


def _compile(examples: list, head_dims: list, tmp_path, kernels=KERNELS, sass=False,
             spills=False) -> list:
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run([sys.executable, "-c", COMPILE_GLUON,
                             ",".join(str(ROOT / "examples" / e) for e in examples),
                             ",".join(map(str, head_dims)), str(tmp_path), ",".join(kernels),
                             *(["sass"] if sass else []), *(["spills"] if spills else [])],
                            capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _check(results: list, examples: list, head_dims: list, kernels=KERNELS):
    """`head_dims`: 64 (all three 64 wide) or "192:128" (q·k, v: the backward kernels
    where the Gluon backend takes the pair)."""
    import attncc
    from attncc.backends.gluon import kernel_unsupported
    from attncc.backends.gluon.tiles import BACKWARD_HEAD_DIM_PAIRS, SMEM_LIMIT
    pairs = [f"{d}:{d}" if isinstance(d, int) else d for d in head_dims]
    backward_pairs = {f"{d}:{dv}" for d, dv in BACKWARD_HEAD_DIM_PAIRS}
    paths = {Path(r["example"]).name: Path(r["example"]) for r in results}
    variants = {e: attncc.parse(paths.get(e, ROOT / "examples" / e).read_text()) for e in examples}

    def taken(e, k, d):  # the backward kernels' refusals (a 512-entry table's dQ at 128) skip
        dims = tuple(map(int, d.split(":")))
        kind = "dq" if k.startswith("attn_bwd_dq") else "fused" if k.startswith("attn_bwd_fused") else "dkdv"
        return k.startswith("attn_fwd") or (
            (dims[0] == dims[1] or d in backward_pairs)
            and kernel_unsupported(variants[e], kind, *dims) is None)
    assert sorted((Path(r["example"]).name, r["kernel"], r["dim"]) for r in results) == sorted(
        (e, k, d) for e in examples for k in kernels for d in pairs if taken(e, k, d))
    for r in results:
        what = f"{Path(r['example']).name}: {r['kernel']} at head dim {r['dim']}"
        assert r["cubin"] > 0, what
        assert 0 < r["shared"] <= SMEM_LIMIT, what
        ops = r["ops"]
        # Tiles arrive by bulk copy into the mbarrier ring, the products are wgmma, and the
        # result leaves by bulk copy through Q's buffer (its first segment's: 128 of 192),
        # by plain stores where v is narrower than that (128 / 64).
        d, dv = map(int, r["dim"].split(":"))
        assert ops["ttng.async_tma_copy_global_to_local"] and ops["ttng.wait_barrier"], what
        assert ops["ttng.warp_group_dot"], what
        assert ops["ttng.async_tma_copy_local_to_global"] == (dv == 1 << (d.bit_length() - 1)), what
        assert ops["ttg.warp_specialize"] == r["kernel"].startswith(("attn_fwd_ws", "attn_bwd_fused_ws")), what
        # The pair weights' sigmoid and a score's tanh take the one-MUFU form (tanh.approx)
        # on the GPU.
        fast = Path(r["example"]).name.startswith("sigmoid_") or "tanh(" in Path(r["example"]).read_text()
        assert r["tanh_approx"] == fast, what
        # Only the fused backward adds across programs (the others write each tile once),
        # by a bulk reduce-add per dQ partial (it runs only where Triton has one).
        fused = r["kernel"].startswith("attn_bwd_fused")
        assert ops["ttng.async_tma_reduce"] == fused, what
        assert not ops["tt.atomic_rmw"], what


def test_gluon_kernels_compile_for_hopper(tmp_path):
    # One variant of each kind of tile plan: an analytic interval (causal) and tile tables
    # (document); about 15 s on two cores.
    examples = ["causal.attn", "document.attn"]
    _check(_compile(examples, [64], tmp_path), examples, [64])


@pytest.mark.slow
def test_gluon_kernels_compile_for_hopper_at_every_head_dim(tmp_path):
    # Two intervals, a layout, index lists, a score (a bias; a softcap, whose tanh takes
    # tanh.approx), a sink, a normaliser other than softmax: every kernel at both
    # backward head dims.
    examples = ["prefix_lm.attn", "bigbird.attn", "nsa_topk.attn", "relative_bias.attn",
                "softcap.attn", "gpt_oss_sinks.attn", "sigmoid_attention.attn"]
    _check(_compile(examples, [64, 128], tmp_path), examples, [64, 128])


@pytest.mark.slow
def test_gluon_forward_compiles_with_v_narrower_than_qk(tmp_path):
    # DeepSeek's (192, 128): Q and K 192 wide (128 + 64 column buffers, two wgmmas: a
    # TMA box must be a power of two wide), V and O 128, at the 128x128 tiles of two stages (208 KB of shared memory); and (128, 64).
    examples = ["causal.attn", "document.attn"]
    kernels = ("attn_fwd", "attn_fwd_ws")
    _check(_compile(examples, ["192:128", "128:64"], tmp_path, kernels), examples,
           ["192:128", "128:64"], kernels)


@pytest.mark.slow
def test_gluon_backward_compiles_at_192_128_without_spills(tmp_path):
    # DeepSeek-V3's training shape: dQ and dK/dV with Q, K, dQ and dK in 128 + 64 column
    # segments, V, dO and dV 128 wide, at the first tiles backends/gluon/tiles.py lists at
    # 192 (dK/dV's two warpgroups side by side on 64 key rows). Alibi took the most
    # registers of the examples (255 in dQ on Triton 3.6); causal and the tile tables
    # (document); then two variants with learnable inputs. Run it on Triton 3.6 too
    # (tests/README.md). About two minutes.
    import attncc
    from attncc import backends
    from attncc.backends.gluon import tiles
    GLUON = backends.named("gluon")
    assert (tiles.dq_candidates(192)[0].as_dict() ==
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))
    assert (tiles.backward_candidates(192)[0].as_dict() ==
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2))
    examples = ["causal.attn", "document.attn", "alibi.attn"]
    kernels = ("attn_bwd_dq", "attn_bwd_dkdv_w8")
    results = _compile(examples, ["192:128"], tmp_path, kernels, spills=True)
    _check(results, examples, ["192:128"], kernels)
    # Learnable inputs' gradient sums in both kernels, on the tiles their candidates keep.
    learnable = _learnable_specs(tmp_path, ["learned_alibi", "rows_and_keys"])
    variant = attncc.parse_file(learnable[1])
    assert (tiles.backward_candidates(192)[0] not in GLUON.candidates("dkdv", 192, variant)
            and GLUON.candidates("dkdv", 192, variant)[0].as_dict() ==
            dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2))
    names = [Path(p).name for p in learnable]
    learnable_kernels = ("attn_bwd_dq", "attn_bwd_dkdv_w8_m32")
    wide = _compile(learnable, ["192:128"], tmp_path, learnable_kernels, spills=True)
    _check(wide, names, ["192:128"], learnable_kernels)
    for r in results + wide:
        regs, spill_stores, spill_loads = r["ptxas"]
        assert regs <= 255 and spill_stores == spill_loads == 0, r


@pytest.mark.slow
def test_gluon_backward_keeps_no_mask_live_across_its_products(tmp_path):
    # Issue 33: sigmoid attention's backward zeroed masked pairs after dP, from a tile of
    # ruled-out marks that the compiler kept live across the products in every tile, as
    # packed predicates: 62 and 92 P2R in its dK/dV and dQ at head dim 128, 1 in causal
    # softmax's; its full tiles ran 547 and 476 SASS instructions a thread against 330
    # and 303 now (softmax 422, 237). Its d w / d s is masked before dP now, in masked tiles.
    examples = ["causal.attn", "sigmoid_attention.attn"]
    kernels = ("attn_bwd_dq", "attn_bwd_dkdv")
    results = _compile(examples, [128], tmp_path, kernels, sass=True)
    _check(results, examples, [128], kernels)
    for r in results:
        p2r = r["opcodes"].get("P2R", 0)
        assert p2r <= 4, f"{Path(r['example']).name}: {r['kernel']}: {p2r} P2R"


@pytest.mark.slow
def test_gluon_kernels_take_each_exponent_from_one_multiply_add(tmp_path):
    # The forward, dQ and dK/dV compute exp2(qk * qk_scale - m) where the scale is
    # positive: one FFMA an element where scaling, then subtracting, take an FMUL and an
    # FADD (Nsight Compute on the H200, RESULTS run 181: 4.1 non-fused FP32 instructions
    # an element before, FlashAttention-4's one FFMA and two others). A negative scale
    # keeps the two: against it, the folded kernels hold at least an FFMA more for each
    # score element a thread owns in each copy of the loop body.
    flipped = tmp_path / "causal_flipped.attn"
    flipped.write_text("attention causal_flipped { mask q >= k\n  scale -0.08838834764831845 }\n")
    examples = ["causal.attn", str(flipped)]
    kernels = ("attn_fwd_ws", "attn_bwd_dq", "attn_bwd_dkdv")
    results = _compile(examples, [128], tmp_path, kernels, sass=True)
    counts = {(Path(r["example"]).name, r["kernel"]): r["opcodes"] for r in results}
    # Score elements a thread owns: a 64 x 128 tile over a warpgroup (the forward, one
    # per consumer), 64 x 64 over 128 threads in each backward kernel.
    owned = {"attn_fwd_ws": 64 * 128 // 128, "attn_bwd_dq": 64 * 64 // 128,
             "attn_bwd_dkdv": 64 * 64 // 128}
    for kernel, elements in owned.items():
        folded = counts[("causal.attn", kernel)]
        plain = counts[("causal_flipped.attn", kernel)]
        assert folded.get("FFMA", 0) >= plain.get("FFMA", 0) + elements, (kernel, folded, plain)
        assert folded.get("FMUL", 0) < plain.get("FMUL", 0), (kernel, folded, plain)


@pytest.mark.slow
def test_the_three_stage_forward_runs_the_softmax_under_its_own_product(tmp_path):
    # Issue 32, item 1. The consumer loop waits for S, computes the softmax, then waits
    # for the last tile's P V; at two stages (V released right after that wait) ptxas
    # places the wait above every exponential, at three (tile i - 2's V released between
    # the softmax and the wait) some exponentials stay between the waits: of the two
    # consumers' 66 a step, 64 and 23 on Triton 3.9, 27 and 30 on 3.6 (its ptxas), none
    # at two stages (sm_90 SASS).
    examples = ["causal.attn"]
    kernels = ("attn_fwd_ws", "attn_fwd_ws_s3")
    results = {r["kernel"]: r["exp2_between_waits"]
               for r in _compile(examples, [128], tmp_path, kernels, sass=True)}
    assert max(results["attn_fwd_ws"]) == 0, results
    assert min(results["attn_fwd_ws_s3"]) >= 20, results


# Learnable score inputs whose gradients the Gluon dQ and dK/dV kernels own
# (backends/gluon/__init__.py's OWNED_KINDS): a per-head slope (broadcast), a per-query
# and a per-key gain (rows; cols, in dK/dV), a T5 bucket table, and a weight's bias.
LEARNABLE_SPECS = {
    "learned_alibi": """attention learned_alibi { learnable input sl: f32[h] mask q >= k
        score s + sl[h] * (k - q) }""",
    "rows_and_keys": """attention rows_and_keys { learnable input w: f32[b, h, q]
        learnable input g: f32[b, h, k] mask q >= k score s + w[b, h, q] * 0.5 + g[b, h, k] }""",
    "t5_bidirectional": """attention t5_bidirectional { scale 1.0
        learnable input table: f32[h, 32] score s + table[h, where(k > q, 16, 0)
            + where(abs(k - q) < 8, abs(k - q),
                    min(8 + int(log(max(abs(k - q), 1) / 8.0) / log(128.0 / 8.0) * 8.0), 15))] }""",
    "sigmoid_bias": """attention sigmoid_bias { learnable input bias: f32[h] mask q >= k
        normalize none weight sigmoid(s + bias[h]) }""",
}


@pytest.mark.slow
def test_gluon_backward_compiles_at_head_dim_256_without_spills(tmp_path):
    # dK and dV (or dQ) 256 wide: two warpgroups side by side on 64 held rows, at the
    # first tiles backends/gluon/tiles.py lists at 256; alibi and a per-query and per-key
    # gain took the most registers (252 in dK/dV on Triton 3.6). Run it on Triton 3.6
    # too (tests/README.md). About two minutes.
    from attncc.backends.gluon import tiles
    assert tiles.dq_candidates(256)[0].as_dict() == dict(BLOCK_M=64, BLOCK_N=64, num_warps=8,
                                                         num_stages=2)
    assert tiles.backward_candidates(256)[0].as_dict() == dict(BLOCK_M=32, BLOCK_N=64,
                                                               num_warps=8, num_stages=2)
    paths = [str(ROOT / "examples" / e) for e in ("causal.attn", "alibi.attn")]
    paths += _learnable_specs(tmp_path, ["rows_and_keys"])
    names = [Path(p).name for p in paths]
    kernels = ("attn_bwd_dq_w8", "attn_bwd_dkdv_w8_m32")
    results = _compile(paths, [256], tmp_path, kernels, spills=True)
    _check(results, names, [256], kernels)
    for r in results:
        regs, spill_stores, spill_loads = r["ptxas"]
        assert regs <= 255 and spill_stores == spill_loads == 0, r


@pytest.mark.slow
def test_gluon_fused_backward_compiles_with_few_spills(tmp_path):
    # deterministic=False's kernel (tiles.fused_candidates) at head dim 128, for the
    # variants it takes: full, causal (from either corner), GQA. Compiled on Triton 3.9 each
    # consumer holds 240 registers and spills 40-52 bytes of loop-invariant addresses
    # (reloaded from L1 once a step); more would mean dK, dV or a score tile left
    # registers. Triton 3.6 has no TMA reduce-add, so the fused backward is not taken
    # there and nothing compiles. About a minute.
    from attncc.backends.gluon import fused_dq_add, tiles
    assert tiles.fused_candidates(128)[0].as_dict() == dict(
        BLOCK_M=64, BLOCK_N=128, num_warps=tiles.FUSED_WS_WARPS, num_stages=2)
    examples = ["causal.attn", "full.attn", "gqa_causal.attn", "causal_bottom_right.attn"]
    kernels = ("attn_bwd_fused_ws",)
    results = _compile(examples, [128], tmp_path, kernels, spills=True)
    _check(results, examples, [128], kernels)
    if fused_dq_add().startswith("none"):
        assert results == []
        return
    assert len(results) == len(examples)
    for r in results:
        regs, spill_stores, spill_loads = r["ptxas"]
        assert regs <= 255 and max(spill_stores, spill_loads) <= 64, r


def _learnable_specs(tmp_path, names=tuple(LEARNABLE_SPECS)) -> list:
    """LEARNABLE_SPECS written out as .attn files: their paths."""
    paths = []
    for name in names:
        paths.append(tmp_path / f"{name}.attn")
        paths[-1].write_text(LEARNABLE_SPECS[name])
    return [str(p) for p in paths]


@pytest.mark.slow
def test_gluon_kernels_with_learnable_inputs_compile_for_hopper(tmp_path):
    # Their gradients' sums and partial stores in both backward kernels, at both
    # backward head dims; about six minutes on two cores.
    paths = _learnable_specs(tmp_path)
    names = [Path(p).name for p in paths]
    _check(_compile(paths, [64, 128], tmp_path), names, [64, 128])


@pytest.mark.slow
@pytest.mark.parametrize("examples, kernel", [
    (["causal.attn", "sliding_window.attn"], "attn_fwd_ws3"),
    (["document.attn", "softcap.attn"], "attn_fwd_ws3_n64")])
def test_three_consumer_forward_compiles_for_hopper(tmp_path, examples, kernel):
    # The warp-specialized forward with three 64-row consumer warpgroups (head dim 64
    # only), on the tiles backends/gluon/tiles.py's fits_registers gives each: 192 x 128
    # for a plain score, 192 x 64 for a score or a mask that reads tensors.
    _check(_compile(examples, [64], tmp_path, (kernel,)), examples, [64], (kernel,))


# Relative table reads (T5's buckets both ways and causal, the clipped relative-bias
# example), which the Gluon dQ sums per diagonal (templates/owned_gradients.jinja).
RELATIVE_TABLE_SPECS = {
    "t5_bidirectional": LEARNABLE_SPECS["t5_bidirectional"],
    "t5_causal": """attention t5_causal { learnable input table: f32[h, 32] mask q >= k
        score s + table[h, where(q - k < 16, max(q - k, 0),
            min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) * 16.0), 31))] }""",
}


@pytest.mark.slow
def test_gluon_dq_sums_relative_tables_within_shared_memory_and_registers(tmp_path):
    # The dQ kernel's diagonal sums at each candidate tiles.dq_fits_registers keeps for
    # them: within Hopper's shared memory, and without the spills that made those
    # candidates' choice (0.3-1.3 KB at 128-key tiles). The score's once-per-tile read of
    # the same tables adds a few bytes on Triton 3.6 (4-36 B), which the H200 ran 5-8%
    # faster than the per-pair read without them (benchmarks/RESULTS.md run 168): at most
    # 64 bytes each way. Run it with Triton 3.6 too (the GPU machine's). About a minute
    # and a half on two cores.
    paths = []
    for name, spec in RELATIVE_TABLE_SPECS.items():
        paths.append(tmp_path / f"{name}.attn")
        paths[-1].write_text(spec)
    t5 = [str(p) for p in paths]
    results = []
    for examples, dim, kernels in ((t5 + ["relative_bias.attn"], 64, ("attn_bwd_dq", "attn_bwd_dq_m128_w8")),
                                   (t5, 128, ("attn_bwd_dq", "attn_bwd_dq_s3"))):
        got = _compile(examples, [dim], tmp_path, kernels, spills=True)
        _check(got, [Path(e).name for e in examples], [dim], kernels)
        results += got
    for r in results:
        assert not isinstance(r["ptxas"], str) and max(r["ptxas"][1:]) <= 64, \
            f"{Path(r['example']).name}: {r['kernel']} at {r['dim']}: {r['ptxas']}"


# The Gluon MLA decode (backends/gluon/templates/decode_mla.jinja) at its one config, at
# both (q·k, v) pairs (576 / 512 with v k's view, 64 / 512 with a v of its own), for each
# of its compile-time cases: contiguous or paged, one split or several, rows before
# position 0 (attncc.flash's) and 64-bit positions.
COMPILE_MLA_DECODE = r'''
import importlib.util, itertools, json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import attncc
from attncc.backends.gluon import codegen as gluon, decode
sys.path.insert(0, "benchmarks")
from gluon_compile import ptxas_resources

CASES = {"contiguous": {}, "paged_one_split": {"PAGED": True, "PAGE_SIZE": 64, "ONE_SPLIT": True},
         "before_start_wide": {"ROWS_BEFORE_START": True, "WIDE": True}}
for i, spec in enumerate(sys.argv[1].split("|")):
    variant = attncc.parse(spec)
    path = f"{sys.argv[2]}/mla{i}.py"
    open(path, "w").write(gluon.generate(variant).source)
    loader = importlib.util.spec_from_file_location(f"mla{i}", path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[f"mla{i}"] = module
    loader.loader.exec_module(module)
    fn = module.decode_mla_split
    for (dim, dim_v), (case, extra) in itertools.product(decode.PAIRS, CASES.items()):
        first, tail = module._segments(dim)
        v_is_k = (dim, dim_v) == decode.LATENT
        consts = dict(BLOCK_M=decode.ROWS, BLOCK_N=decode.BLOCK_N, HEAD_DIM=first, HEAD_DIM_TAIL=tail,
                      HEAD_DIM_V=dim_v, V_IS_K=v_is_k, NUM_STAGES=decode.NUM_STAGES, PAGED=False,
                      PAGE_SIZE=1, ONE_SPLIT=False, ROWS_BEFORE_START=False, WIDE=False)
        consts.update(extra)
        # Without a tail segment the first's descriptors stand in; v k's where v_is_k.
        boxes = dict(q_desc=(decode.ROWS, first), qt_desc=(decode.ROWS, tail or first),
                     k_desc=(decode.BLOCK_N, first), kt_desc=(decode.BLOCK_N, tail or first),
                     v_desc=(decode.BLOCK_N, first if v_is_k else dim_v))
        pointers = dict(BT="*i32", SEQLENS="*i32", Out="*bf16", LSE="*fp32", PartOut="*fp32",
                        PartLSE="*fp32")
        sig = {}
        for n in fn.arg_names:
            if n in consts:
                sig[n] = "constexpr"
            elif n in boxes:
                block, layout = module._shared_layout(*boxes[n], torch.bfloat16)
                sig[n] = f"tensordesc<bf16[{','.join(map(str, block))}],{layout!r}>"
            else:
                sig[n] = pointers.get(n, "fp32" if n in ("sm_scale", "qk_scale") else "i32")
        compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=decode.NUM_WARPS, num_stages=decode.NUM_STAGES))
        ttgir = compiled.asm["ttgir"]
        print(json.dumps({"variant": variant.name, "case": case, "dims": [dim, dim_v],
                          "tiles": decode.shared_bytes(dim, dim_v, v_is_k),
                          "shared": compiled.metadata.shared,
                          "tma": "ttng.async_tma_copy_global_to_local" in ttgir,
                          "wgmma": ttgir.count("ttng.warp_group_dot "),
                          "ptxas": ptxas_resources(compiled.asm["ptx"])}), flush=True)
'''


@pytest.mark.slow
def test_gluon_mla_decode_compiles_within_registers_and_shared_memory(tmp_path):
    # MLA's decode: Q (64 x 576) and two key tiles (64 x 576) in shared memory, 221184 B
    # of the 232448 an SM has, plus the scratch of P's layout change and of the row
    # reductions, and the barriers: 225304 B on Triton 3.6 and 3.9; at (64, 512) Q (64 x
    # 64) and two stages of K (64 x 64) and V (64 x 512): 159768 B. O's 64 x 512 fp32
    # accumulator, split over two warpgroups, is 128 registers a thread. Causal fits 255
    # registers without spilling on both versions (254-255 at 576); a score of the head
    # and the positions (an ALiBi-like slope, softcapped) spills nothing on 3.9 and 8
    # bytes each way on 3.6 at 576 with 64-bit positions (WIDE: positions or inputs past
    # 2**31): at most 8 asserted. Run it on Triton 3.6 too (tests/README.md). About 30 s.
    from attncc.backends.gluon import decode
    from attncc.backends.gluon.tiles import SMEM_LIMIT
    pytest.importorskip("triton.experimental.gluon")
    specs = ["attention mla { scale 1.0 / sqrt(192.0) mask q >= k }",
             "attention mla_slopes { scale 1.0 / sqrt(192.0) param cap: float = 50.0 mask q >= k "
             "score cap * tanh(s / cap) - 0.01 * h * (q - k) }"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    result = subprocess.run([sys.executable, "-c", COMPILE_MLA_DECODE, "|".join(specs), str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    results = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 * 2 * 3, result.stdout
    assert decode.shared_bytes(*decode.LATENT, True) == 221184
    for r in results:
        assert r["tiles"] < r["shared"] <= SMEM_LIMIT, r
        # Q·K^T (in two segments at 576 = 512 + 64) and P·V, each issued once a tile.
        assert r["tma"] and r["wgmma"] == (3 if r["dims"] == [576, 512] else 2), r
        regs, spill_stores, spill_loads = r["ptxas"]
        assert regs <= 255 and max(spill_stores, spill_loads) <= 8, r
        if r["variant"] == "mla":
            assert spill_stores == spill_loads == 0, r
