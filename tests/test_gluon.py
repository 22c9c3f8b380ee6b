"""The Gluon backend on the CPU: its module renders and parses, shares the portable
module's expressions, and the dispatch (`backend=`, `attncc compile --backend`) picks,
explains and refuses as documented. The kernels themselves run only on an sm_90 GPU:
benchmarks/gluon_check.py holds them to the float64 reference there.
"""
import ast
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

import attncc
from attncc import backends
from attncc.arguments import Problem
from attncc.backends import gluon as gluon_backend
from attncc.backends.gluon import codegen as gluon
from attncc.backends.gluon import tiles
from attncc.backends.tile_config import TileConfig
from attncc.runtime import configs, tuning
from attncc.tools.cli import main
from attncc.backends.portable.codegen import generate, template_context

GLUON = backends.named("gluon")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# One per skipping strategy and slot: dense, one analytic interval, two intervals, tables
# from a tensor mask, a layout, index lists, a score with a tensor read, a learnable input.
SAMPLE = ["full", "causal", "prefix_lm", "document", "bigbird", "nsa_topk", "alibi",
          "relative_bias"]


def _imports(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", SAMPLE)
def test_gluon_module_renders_parses_and_stands_alone(name):
    variant = attncc.parse_file(EXAMPLES / f"{name}.attn")
    assert GLUON.supports(variant) is None
    source = GLUON.render(variant).source
    assert source == gluon.generate(variant).source
    tree = ast.parse(source)
    # The standard library, torch, triton: no other module, the portable one included.
    assert _imports(tree) <= {"functools", "math", "threading", "torch", "triton"}
    assert "host." not in source
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"attn_fwd", "attn_fwd_ws", "_ws_loader", "_ws_consumer", "forward",
            "attn_bwd_dkdv", "backward_dkdv", "attn_bwd_dq", "backward_dq",
            "_common_args", "_grid", "RingCounter", "TileRing", "Channel", "Turns"} <= defined
    # The same mask and score code as the portable module: emitted once, in codegen. A mask
    # with reads by one position alone is the column-read form of it in every Gluon kernel.
    context = template_context(variant)
    for slot in ("mask", "score", "layout_elem"):
        if not context[slot]:
            continue
        assert context[slot] in generate(variant).source
        columns = gluon.template_context(variant)
        if slot == "mask" and columns["mask_columns"]:
            assert columns["mask_columns"] in source and columns["mask_query_columns"] in source
        else:
            assert context[slot] in source


def test_gluon_module_takes_the_portable_argument_list():
    """The Gluon kernels take the argument values the shared host side builds
    (codegen/templates/host_args.jinja's _common_args, as the portable kernels do), so
    they must declare COMMON_PARAMS in the same order."""
    variant = attncc.parse_file(EXAMPLES / "document.attn")
    tree = ast.parse(gluon.generate(variant).source)
    params = template_context(variant)["common_param_list"]
    for fn, before in (("attn_fwd", 8), ("attn_fwd_ws", 8), ("attn_bwd_dkdv", 11),
                       ("attn_bwd_dq", 19)):
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn)
        names = [a.arg for a in node.args.args]
        assert names[before:before + len(params)] == params


@pytest.mark.parametrize("name", ["document", "relative_bias"])
def test_both_modules_build_the_same_launch_arguments(name):
    # The host side (codegen/templates/host_args.jinja) is rendered into each module: for
    # the same call they hand their kernels the same values, tile tables included.
    from attncc.arguments import Problem
    from attncc.runtime.cache import load_generated
    from attncc.semantics.samples import sample_inputs
    variant = attncc.parse_file(EXAMPLES / f"{name}.attn")
    p = Problem(batch=2, heads_q=4, heads_kv=2, len_q=200, len_k=300, dim=64, dim_v=64,
                q_offset=100)
    inputs = sample_inputs(variant, p)
    q = torch.randn(2, 4, 200, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 300, 64, dtype=torch.bfloat16)
    call = dict(q_offset=100, k_offset=0, seed=3, block_m=64, block_n=128, tables=None,
                per_head=(k,))
    portable = load_generated(variant)[1]._common_args(q, k, inputs, None, **call)
    own = load_generated(variant, "gluon")[1]._common_args(q, k, inputs, None, **call)
    assert own[1] == portable[1]  # WIDE
    assert len(own[0]) == len(portable[0]) == len(template_context(variant)["common_param_list"])
    for a, b in zip(own[0], portable[0]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_variants_the_gluon_forward_does_not_take_are_named():
    dropout = attncc.parse_file(EXAMPLES / "dropout.attn")
    assert "dropout 0.1" in GLUON.supports(dropout)
    small_lists = attncc.parse("attention t { input top: i32[b, h, qb, 4] layout kb in top[b, h, qb] block 32 }")
    assert "at least 64 rows" in GLUON.supports(small_lists)
    lists64 = attncc.parse("attention t { input top: i32[b, h, qb, 4] layout kb in top[b, h, qb] block 64 }")
    assert GLUON.supports(lists64) is None
    # Its tiles must nest in the 64-blocks: only 64-row, 64-column configs are offered.
    kept = GLUON.candidates("fwd", 128, lists64)
    assert kept and all(c.block_m <= 64 and c.block_n <= 64 for c in kept)


def test_calls_the_gluon_forward_does_not_take_are_named():
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    unsupported = lambda q, k, v: GLUON.supports_call(causal, q, k, v, "fwd")
    q = torch.randn(1, 2, 8, 128, dtype=torch.bfloat16)
    assert unsupported(q, q, q) is None
    f32 = q.float()
    assert "float32" in unsupported(f32, f32, f32)
    d96 = torch.randn(1, 2, 8, 96, dtype=torch.float16)
    assert "head dim 96" in unsupported(d96, d96, d96)
    kt = torch.randn(1, 2, 128, 8, dtype=torch.bfloat16).transpose(2, 3)  # head dim strided
    assert "k has strides" in unsupported(q, kt, q)
    odd = torch.randn(1, 2, 8, 129, dtype=torch.bfloat16)[..., :128]  # rows of 258 bytes
    assert "16-byte aligned" in unsupported(q, q, odd)
    # No one-launch backward: that is the portable module's.
    assert "no backward kernel of one launch" in GLUON.supports_call(causal, q, q, q, "bwd")


def test_candidates_fit_and_pinned_configs_are_checked():
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    for dim in gluon_backend.HEAD_DIMS:
        kept = GLUON.candidates("fwd", dim, causal)
        assert kept and all(tiles.smem_bytes(c, dim) <= tiles.SMEM_LIMIT for c in kept)
        assert all(GLUON.check_config(c, "fwd", dim) is None for c in kept)
    assert "BLOCK_M >= 16 * num_warps" in GLUON.check_config(TileConfig(16, 16, 4, 1), "fwd", 128)
    assert "shared memory" in GLUON.check_config(TileConfig(128, 256, 8, 3), "fwd", 256)
    # Before a call (no head dim), only what does not depend on it.
    assert GLUON.check_config(TileConfig(128, 256, 8, 3), "fwd", None) is None
    assert GLUON.check_config(TileConfig(64, 64, 4, 2), "bwd", 128) is not None


def test_candidates_at_192_are_sized_for_both_widths():
    """q·k 192 comes with v 128 alone: its tiles' shared memory counts Q and K at 192 and V
    at 128 (the 128x128 tiles of two stages fit; at v 192 they would not)."""
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    kept = GLUON.candidates("fwd", Problem(1, 2, 2, 64, 64, 192, 128).tile_dim, causal)
    assert kept[0] == TileConfig(128, 128, tiles.WS_WARPS, 2)
    assert tiles.smem_bytes(kept[0], 192, 128) == 2 * (128 * 192 + 2 * 128 * (192 + 128))
    assert tiles.smem_bytes(kept[0], 192) == tiles.smem_bytes(kept[0], 192, 128) <= tiles.SMEM_LIMIT
    assert tiles.smem_bytes(kept[0], 192, 192) > tiles.SMEM_LIMIT
    assert all(GLUON.check_config(c, "fwd", 192) is None for c in kept)
    # The backward's: Q, K (192) and V, dO (128) held and streamed.
    for kind, held, streamed in (("dq", "block_m", "block_n"), ("dkdv", "block_n", "block_m")):
        kept = GLUON.candidates(kind, 192, causal)
        assert kept and all(GLUON.check_config(c, kind, 192) is None for c in kept)
        for c in kept:
            rows = getattr(c, held) + c.num_stages * getattr(c, streamed)
            assert tiles._backward_smem(kind, c, 192) == 2 * (192 + 128) * rows <= tiles.SMEM_LIMIT


@pytest.mark.parametrize("dims, segments", [((192, 128), (128, 64)), ((128, 64), (128, 0)),
                                            ((64, 64), (64, 0))])
def test_the_gluon_forward_launch_splits_qk_into_segments(dims, segments, monkeypatch):
    """The launcher (no GPU: the kernel and its descriptors stand-ins) hands the forward
    q·k's two power-of-two segments (192 = 128 + 64), with a bulk copy of each segment's
    width for Q and K, v's width for V and the output, which is v-wide."""
    from attncc.runtime.cache import load_generated
    module = load_generated(attncc.parse_file(EXAMPLES / "causal.attn"), "gluon")[1]
    launched = {}

    def descriptor(t, shape, strides, block, layout):
        return SimpleNamespace(tensor=t, width=block[-1])

    class Kernel:  # kernel[grid](*args, **constants) records the launch
        def __getitem__(self, grid):
            return lambda *args, **constants: launched.update(args=args, **constants)
    monkeypatch.setattr(module, "_bind_context", lambda device: None)
    monkeypatch.setattr(module, "TensorDescriptor", descriptor)
    monkeypatch.setattr(module, "attn_fwd", Kernel())
    d, dv = dims
    q = torch.randn(1, 2, 70, d, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 70, dv, dtype=torch.bfloat16)
    out, lse = module.forward(q, q, v, {}, config=dict(BLOCK_M=128, BLOCK_N=64, num_warps=8,
                                                       num_stages=2))
    assert out.shape == (1, 2, 70, dv) and lse.shape == (1, 2, 70)
    assert (launched["HEAD_DIM"], launched["HEAD_DIM_TAIL"]) == segments
    assert launched["HEAD_DIM_V"] == dv
    q_desc, k_desc, v_desc, o_desc, qt_desc, kt_desc, o_ptr = launched["args"][:7]
    assert q_desc.width == k_desc.width == segments[0]
    if segments[1]:
        assert qt_desc.width == kt_desc.width == segments[1]
    else:  # no tail: None, never read (HEAD_DIM_TAIL 0) nor encoded at launch
        assert qt_desc is None and kt_desc is None
    assert v_desc.width == o_desc.width == dv and o_ptr is out and o_desc.tensor is out


def test_the_kernels_read_a_masks_column_indexed_inputs_once_per_column():
    """A partial tile's mask reads by key position alone (document's doc_k[k], a
    per-head key gain h, k) load one element a thread in the forward and move into the
    tile's column slice, and in dK/dV (tiles transposed) the reads by query position;
    reads by both positions keep the tile's own layout."""
    from attncc.backends.gluon.codegen import column_reads_mask, generate
    document = attncc.parse_file(EXAMPLES / "document.attn")
    printed = column_reads_mask(document).text
    assert "gl.convert_layout(tl.load(in_doc_k_ptr + _index(k_lin," in printed
    assert "tl.load(in_doc_q_ptr + _index(q_pos," in printed and "doc_q_ptr + _index(k_lin" not in printed
    source = generate(document).source
    forward = source[source.index("def attn_fwd("):source.index("def attn_bwd")]
    assert forward.count("k_lin = _int(tile_k, WIDE) * BLOCK_N + gl.arange(0, BLOCK_N, lin_layout)") >= 4
    assert "lin_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])" in source  # WS consumers
    dq = source[source.index("def attn_bwd_dq("):]
    assert "gl.convert_layout(tl.load(in_doc_k_ptr + _index(k_lin," in dq[:dq.index("\n\n\n")]
    dkdv = source[source.index("def attn_bwd_dkdv("):]
    assert "gl.convert_layout(tl.load(in_doc_q_ptr + _index(q_lin," in dkdv[:dkdv.index("\n\n\n")]
    per_head = attncc.parse("attention g { input keep: bool[h, k] mask keep[h, k] and q >= k }")
    assert "(gl.convert_layout((tl.load(in_keep_ptr" in column_reads_mask(per_head).text
    for spec in ("attention p { input t: bool[q, k] mask t[q, k] }",
                 "attention r { input r: bool[q] mask r[q] and q >= k }"):
        assert column_reads_mask(attncc.parse(spec)) is None


def test_a_descriptor_of_a_known_shape_skips_the_checks_and_keeps_no_tensor():
    """A Gluon launch's descriptors after the first of a shape, strides, dtype and tile
    copy its checked fields (host time) and take the new tensor as their base; the kept
    fields hold no tensor, and a base that is not 16-byte aligned is checked again."""
    import gc
    import weakref
    from attncc.runtime.cache import load_generated
    module = load_generated(attncc.parse_file(EXAMPLES / "causal.attn"), "gluon")[1]
    module._DESCRIPTOR_FIELDS.clear()
    a, b = (torch.randn(1, 2, 70, 128, dtype=torch.bfloat16) for _ in range(2))
    first = module._descriptor(a, 64)
    second = module._descriptor(b, 64)
    checked = module.TensorDescriptor(b, list(b.shape), list(b.stride()), first.block_shape,
                                      first.layout)
    assert type(second) is module.TensorDescriptor and second.base is b
    assert {n: x for n, x in vars(second).items() if n != "base"} == \
        {n: x for n, x in vars(checked).items() if n != "base"}
    assert len(module._DESCRIPTOR_FIELDS) == 1
    other = module._descriptor(b, 128, 64)  # another tile: fields of its own
    assert other.block_shape[-2:] == [128, 64] and len(module._DESCRIPTOR_FIELDS) == 2
    kept = weakref.ref(a)
    del a, first
    gc.collect()
    assert kept() is None
    flat = torch.empty(2 * 70 * 128 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(1, 2, 70, 128)  # the same shape and strides, 2 bytes off
    with pytest.raises(AssertionError, match="16-byte aligned"):
        module._descriptor(shifted, 64)


@pytest.mark.parametrize("dims, config, consumers", [
    ((192, 128), dict(BLOCK_M=128, BLOCK_N=128, num_warps=9, num_stages=2), 2),
    ((64, 64), dict(BLOCK_M=192, BLOCK_N=128, num_warps=13, num_stages=2), 3)])
def test_the_warp_specialized_forward_copies_q_and_its_tail_per_consumer(dims, config, consumers,
                                                                         monkeypatch):
    """The warp-specialized launch (stand-ins, no GPU): Q, Q's tail segment and O move in
    one box per consumer warpgroup (64 rows), K and V in key tiles; q·k 192 with v 128
    runs two consumers, three consumers only head dim 64."""
    from attncc.runtime.cache import load_generated
    module = load_generated(attncc.parse_file(EXAMPLES / "causal.attn"), "gluon")[1]
    launched = {}

    def descriptor(t, shape, strides, block, layout):
        return SimpleNamespace(rows=block[-2], width=block[-1])

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **constants: launched.update(args=args, **constants)
    monkeypatch.setattr(module, "_bind_context", lambda device: None)
    monkeypatch.setattr(module, "TensorDescriptor", descriptor)
    monkeypatch.setattr(module, "attn_fwd_ws", Kernel())
    d, dv = dims
    q = torch.randn(1, 2, 70, d, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 70, dv, dtype=torch.bfloat16)
    module.forward(q, q, v, {}, config=config)
    assert launched["CONSUMERS"] == consumers and launched["num_warps"] == 4
    q_desc, k_desc, v_desc, o_desc, qt_desc, kt_desc = launched["args"][:6]
    assert q_desc.rows == o_desc.rows == 64 and k_desc.rows == v_desc.rows == config["BLOCK_N"]
    if d == 192:
        assert qt_desc.rows == 64 and kt_desc.rows == config["BLOCK_N"]
        assert (q_desc.width, qt_desc.width) == (128, 64)
    else:
        assert q_desc.width == d and qt_desc is None and kt_desc is None
    ws3 = TileConfig(192, 128, tiles.WS3_WARPS, 2)
    for dim in (128, 192):  # (128, 64) and (192, 128) pick tiles by q·k's 128 and 192
        assert "take head dims 64" in GLUON.check_config(ws3, "fwd", dim)


@pytest.mark.parametrize("dims, segments", [((192, 128), (128, 64)), ((128, 128), (128, 0)),
                                            ((64, 64), (64, 0))])
def test_the_gluon_backward_launches_split_qk_into_segments(dims, segments, monkeypatch):
    """The dQ and dK/dV launchers (stand-ins, no GPU) hand their kernels q·k's segments:
    Q, K, dQ and dK in a box of each segment's width (the tail's descriptors stand in
    for nothing where there is none), V and dO v-wide; dQ and dK come back q·k-wide,
    dV v-wide."""
    from attncc.runtime.cache import load_generated
    module = load_generated(attncc.parse_file(EXAMPLES / "causal.attn"), "gluon")[1]
    launched = {}

    def descriptor(t, shape, strides, block, layout):
        return SimpleNamespace(tensor=t, rows=block[-2], width=block[-1])

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **constants: launched.update({self.name: (args, constants)})
    monkeypatch.setattr(module, "_bind_context", lambda device: None)
    monkeypatch.setattr(module, "TensorDescriptor", descriptor)
    monkeypatch.setattr(module, "attn_bwd_dq", Kernel("dq"))
    monkeypatch.setattr(module, "attn_bwd_dkdv", Kernel("dkdv"))
    d, dv = dims
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 70, d, generator=gen).bfloat16() for _ in range(2))
    v, dout = (torch.randn(1, 2, 70, dv, generator=gen).bfloat16() for _ in range(2))
    lse, delta = torch.zeros(1, 2, 70), torch.zeros(1, 2, 70)
    config = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    dq, _ = module.backward_dq(q, k, v, lse, delta, dout, {}, config=config, out=dout)
    dk, dv_grad = module.backward_dkdv(q, k, v, lse, delta, dout, {}, config=config)
    assert dq.shape == dk.shape == (1, 2, 70, d) and dv_grad.shape == (1, 2, 70, dv)
    first, tail = segments
    for name, (segmented, own, rows) in {"dq": ((q, k, dq), (v, dout), (64, 32, 64)),
                                         "dkdv": ((q, k, dk), (v, dout, dv_grad), (64, 32, 32))
                                         }.items():
        args, constants = launched[name]
        assert (constants["HEAD_DIM"], constants["HEAD_DIM_TAIL"], constants["HEAD_DIM_V"]) == (
            first, tail, dv)
        tail_at = 5 if name == "dq" else 6  # after dQ's; after dK's and dV's
        firsts, tails = [args[i] for i in (0, 1, 4)], list(args[tail_at:tail_at + 3])
        others = list(args[2:4] + args[5:tail_at])  # v-wide: V, dO (and dV)
        assert [x.tensor for x in firsts] == list(segmented)
        assert [x.rows for x in firsts] == list(rows) and {x.width for x in firsts} == {first}
        if tail:
            assert [x.tensor for x in tails] == list(segmented)
            assert [x.rows for x in tails] == list(rows) and {x.width for x in tails} == {tail}
        else:  # None, never read (HEAD_DIM_TAIL 0) nor encoded at launch
            assert tails == [None] * 3
        assert all(x.width == dv for x in others) and [x.tensor for x in others] == list(own)


def test_backward_candidates_fit_and_bad_configs_are_named():
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    for dim in tiles.BACKWARD_HEAD_DIMS:
        for direction in ("dq", "dkdv"):
            kept = GLUON.candidates(direction, dim, causal)
            assert kept and all(GLUON.check_config(c, direction, dim) is None for c in kept)
    # At 256, two warpgroups side by side on 64 rows hold dK and dV, or dQ.
    for direction, held in (("dkdv", "block_n"), ("dq", "block_m")):
        assert {(c.num_warps, getattr(c, held)) for c in GLUON.candidates(direction, 256, causal)
                } == {(8, 64)}
    assert GLUON.candidates("bwd", 128, causal) == []
    for d in (128, 256):
        q = torch.randn(1, 2, 8, d, dtype=torch.bfloat16)
        assert GLUON.supports_call(causal, q, q, q, "dq") is None
        assert GLUON.supports_call(causal, q, q, q, "dkdv") is None
    assert "takes head dims 64, 128, 256 (the portable kernels take any)" in (
        gluon_backend.kernel_unsupported(causal, "dkdv", 32))
    # 8 warps stack 128 rows of wgmma, or sit side by side on 64: a 32-row tile cannot
    # be split among them.
    for direction in ("dq", "dkdv"):
        assert GLUON.check_config(TileConfig(64, 64, 8, 2), direction, 128) is None
    assert "(or 64 on 8 warps)" in GLUON.check_config(TileConfig(32, 64, 8, 2), "dq", 128)
    assert "(or 64 on 8 warps)" in GLUON.check_config(TileConfig(64, 32, 8, 2), "dkdv", 128)
    assert "shared memory" in GLUON.check_config(TileConfig(256, 128, 8, 3), "dkdv", 128)
    # A cached or shipped config is checked against the kernel it would run.
    good = GLUON.candidates("dkdv", 128, causal)[0]
    assert configs.usable("gluon", good, causal, 128, "dkdv")
    assert not configs.usable("gluon", TileConfig(64, 32, 8, 2), causal, 128, "dkdv")
    # The warp-specialized forward's config (9 warps) is the Gluon forward's alone.
    ws = TileConfig(128, 128, tiles.WS_WARPS, 2)
    assert configs.usable("gluon", ws, causal, 128, "fwd")
    assert not configs.usable("triton", ws, causal, 128, "fwd")


def test_three_consumer_warpgroups_take_192_rows_at_head_dim_64_only():
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    ws3 = TileConfig(192, 128, tiles.WS3_WARPS, 2)
    # Second at head dim 64, after the two-consumer kernel, until the GPU has timed it.
    assert GLUON.candidates("fwd", 64, causal)[1] == ws3
    assert ws3 not in GLUON.candidates("fwd", 128, causal) + GLUON.candidates("fwd", 256, causal)
    # A score or a mask reading tensors takes more registers than three consumers hold
    # beside 128-key score tiles: they get 64-key tiles instead.
    for name in ("alibi", "softcap", "document", "relative_bias"):
        heavy = GLUON.candidates("fwd", 64, attncc.parse_file(EXAMPLES / f"{name}.attn"))
        assert heavy[1] == TileConfig(192, 64, tiles.WS3_WARPS, 2) and ws3 not in heavy, name
    for name in ("causal", "sliding_window", "sigmoid_attention", "gpt_oss_sinks"):
        light = GLUON.candidates("fwd", 64, attncc.parse_file(EXAMPLES / f"{name}.attn"))
        assert light[1] == ws3 and TileConfig(192, 64, tiles.WS3_WARPS, 2) not in light, name
    assert GLUON.check_config(ws3, "fwd", 64) is None
    assert configs.usable("gluon", ws3, causal, 64, "fwd")
    assert "take head dims 64" in GLUON.check_config(ws3, "fwd", 128)
    # 64 rows per consumer warpgroup: the row count follows the warps.
    assert "BLOCK_M a multiple of 192" in GLUON.check_config(TileConfig(128, 128, 13, 2), "fwd", 64)
    assert "multiple of 128" in GLUON.check_config(TileConfig(192, 128, 9, 2), "fwd", 64)
    # Every other kernel's tiles span a power of two of rows.
    assert "power of two" in GLUON.check_config(TileConfig(192, 128, 8, 2), "fwd", 64)
    assert "power of two" in GLUON.check_config(TileConfig(192, 64, 4, 2), "dkdv", 64)
    assert "power of two" in GLUON.check_config(TileConfig(192, 64, 4, 2), "dq", 64)
    assert "power of two" in backends.portable().check_config(TileConfig(192, 128, 8, 2), "fwd", 64)
    # The generated module launches the kernel the tiles module names.
    namespace = {}
    source = gluon.generate(causal).source
    exec(source[source.index("WS_CONSUMERS = "):].split("\n")[0], namespace)
    assert namespace["WS_CONSUMERS"] == tiles.WS_CONSUMERS


def test_a_192_row_config_reads_back_and_nests_in_no_layout_block():
    ws3 = dict(BLOCK_M=192, BLOCK_N=128, num_warps=tiles.WS3_WARPS, num_stages=2)
    assert TileConfig.from_dict(ws3, "config") == TileConfig(192, 128, 13, 2)
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two from 16 to 256, got 192"):
        TileConfig.from_dict(dict(ws3, BLOCK_N=192), "config")
    with pytest.raises(ValueError, match=r"BLOCK_M must be a power of two from 16 to 256 \(or 192\)"):
        TileConfig.from_dict(dict(ws3, BLOCK_M=96), "config")
    # The portable kernels refuse it where a pin meets them.
    with pytest.raises(ValueError, match="BLOCK_M 192 is the Gluon forward's"):
        attncc.compile(str(EXAMPLES / "causal.attn"), config=dict(ws3, num_warps=8))
    # A 192-row tile straddles blocks of 256: index lists cannot say whether it is on.
    assert not TileConfig(192, 128, 13, 2).within(256)
    assert TileConfig(128, 128, 9, 2).within(256) and not TileConfig(128, 128, 9, 2).within(64)
    topk = attncc.parse("attention l { input top: i32[b, h, qb, 2] layout kb in top[b, h, qb] "
                        "block 256 }")
    assert TileConfig(192, 128, 13, 2) not in GLUON.candidates("fwd", 64, topk)
    with pytest.raises(ValueError, match="do not nest in the layout's blocks of 256"):
        configs.check_pinned(TileConfig(192, 128, 13, 2), topk, "config")


# The stand-in runs the portable kernels on CPU tensors, which needs the interpreter
# (conftest.py sets it only without a GPU), and what it records is the CPU's dispatch (a
# GPU's tuner and precompile launch the roles more often); on a GPU the real Gluon
# kernels are checked against float64 by benchmarks/gluon_check.py and gluon_backward.py.
CPU_STAND_IN = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="a CPU stand-in for the Gluon module (the interpreter)")


def _stand_in_gluon(kernel, monkeypatch, calls):
    """The kernel's backend set to Gluon, its Gluon module a stand-in that runs the
    portable kernels and records what it was asked (the CPU cannot run Hopper kernels)."""
    from types import SimpleNamespace

    portable = kernel.module

    def forward(q, k, v, values, *, config, **common):
        calls.append("forward")
        return portable.forward(q, k, v, values, config=config, **common)

    def backward_dkdv(q, k, v, lse, delta, dout, values, *, config, **common):
        calls.append("dkdv")
        return portable.backward_dkdv(q, k, v, lse, delta, dout, values, config=config, **common)

    def backward_dq(q, k, v, lse, delta, dout, values, *, config, out=None, **common):
        calls.append("dq")
        return portable.backward_dq(q, k, v, lse, delta, dout, values, config=config, out=out,
                                    **common)

    def backward_fused(q, k, v, lse, delta, dout, values, *, config, **common):
        # The split kernels on the delta given: it must carry the LSE's gradient.
        calls.append("fused")
        dq, _ = portable.backward_dq(q, k, v, lse, delta, dout, values, config=config, **common)
        return (dq, *portable.backward_dkdv(q, k, v, lse, delta, dout, values, config=config,
                                            **common))

    monkeypatch.setattr(gluon_backend, "_call_unsupported", lambda q, k, v: None)
    monkeypatch.setattr(kernel, "backends", (GLUON,))
    monkeypatch.setattr(kernel, "backend", "gluon")
    monkeypatch.setattr(kernel, "requested_backend", "gluon")
    monkeypatch.setitem(kernel._modules, "gluon", (None, SimpleNamespace(
        forward=forward, backward_dq=backward_dq, backward_dkdv=backward_dkdv,
        backward_fused=backward_fused)))


@CPU_STAND_IN
def test_the_backward_runs_the_gluon_dkdv_kernel_where_the_backend_takes_it(monkeypatch):
    spec = str(EXAMPLES / "causal.attn")
    kernel = attncc.compile(spec)
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=gen, requires_grad=True) for _ in range(3))
    kernel(q, k, v).sum().backward()
    assert calls == ["forward", "dq", "dkdv"]
    assert kernel.last_backward == {"dq": ("gluon", "backend='gluon' was asked for (dQ)"),
                                    "dkdv": ("gluon", "backend='gluon' was asked for (dK/dV)")}
    # The same gradients as the portable kernel's (the stand-in runs it).
    portable = attncc.compile(spec, backend="triton")
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    portable(q2, k2, v2).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    # A head dim the dK/dV kernel does not take: the portable one runs and says why.
    calls.clear()
    q, k, v = (torch.randn(1, 2, 24, 32, generator=gen, requires_grad=True) for _ in range(3))
    kernel(q, k, v).sum().backward()
    assert calls == ["forward"]
    for kind in ("dq", "dkdv"):
        backend, why = kernel.last_backward[kind]
        assert backend == "triton" and "head dim 32" in why


@CPU_STAND_IN
def test_the_backward_runs_the_gluon_kernels_at_192_128(monkeypatch):
    """DeepSeek-V3's training shape (q·k 192, v 128) takes the Gluon dQ and dK/dV
    kernels on an sm_90 (the stand-in says the GPU takes the call); test_head_dims_v.py
    checks that other pairs keep the portable ones and say why."""
    kernel = attncc.compile(str(EXAMPLES / "causal.attn"))
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 1, 17, 192, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 1, 17, 128, generator=gen, requires_grad=True)
    kernel(q, k, v).sum().backward()
    assert q.grad.shape == k.grad.shape == (1, 1, 17, 192) and v.grad.shape == (1, 1, 17, 128)
    assert calls == ["forward", "dq", "dkdv"]
    assert kernel.last_backward == {"dq": ("gluon", "backend='gluon' was asked for (dQ)"),
                                    "dkdv": ("gluon", "backend='gluon' was asked for (dK/dV)")}


@CPU_STAND_IN
def test_reads_stored_per_pair_keep_the_portable_dq(monkeypatch):
    """A read the Gluon dQ kernel does not own (`bias[b, h, q, k]`, stored once per
    pair) keeps the portable dQ kernel, named with its kind; dK/dV may still be Gluon's."""
    kernel = attncc.compile("""attention dense_bias { learnable input bias: f32[b, h, q, k]
        score s + bias[b, h, q, k] }""")
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 24, 64, generator=gen, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 24, 24, generator=gen, requires_grad=True)
    kernel(q, k, v, bias=bias).sum().backward()
    assert calls == ["forward", "dkdv"]
    backend, why = kernel.last_backward["dq"]
    assert backend == "triton" and "learnable inputs (bias (dense))" in why
    assert "broadcast, rows and relative table reads only" in why
    assert bias.grad is not None and bias.grad.abs().sum() > 0


LEARNED_ALIBI = """attention learned_alibi { learnable input sl: f32[h] mask q >= k
    score s + sl[h] * (k - q) }"""
KEY_GAIN = """attention key_gain { learnable input g: f32[b, h, k] mask q >= k
    score s + g[b, h, k] }"""
ROWS_AND_KEYS = """attention rows_and_keys { learnable input w: f32[b, h, q]
    learnable input g: f32[b, h, k] score s + w[b, h, q] * 0.5 + g[b, h, k] }"""


@pytest.mark.parametrize("spec", [LEARNED_ALIBI, KEY_GAIN, ROWS_AND_KEYS])
def test_owned_learnable_reads_keep_the_gluon_backward(spec):
    """Broadcast and rows reads are the Gluon dQ kernel's, reads of keys alone its dK/dV
    kernel's (OWNED_KINDS): neither role refuses them."""
    variant = attncc.parse(spec)
    for kind in ("dq", "dkdv"):
        assert gluon_backend.kernel_unsupported(variant, kind, 64) is None


T5_CAUSAL = """attention t5_causal { learnable input table: f32[h, 32] mask q >= k
    score s + table[h, where(max(q - k, 0) < 16, max(q - k, 0),
        min(16 + int(log(max(q - k, 16) / 16.0) / log(128.0 / 16.0) * 16.0), 31))] }"""


def _dq_kernel_source(variant) -> str:
    source = gluon.generate(variant).source
    start = source.index("def attn_bwd_dq(")
    return source[start:source.index("\ndef ", start + 1)]


@pytest.mark.parametrize("spec", [T5_CAUSAL, (EXAMPLES / "relative_bias.attn").read_text()],
                         ids=["t5_causal", "relative_bias"])
def test_a_table_read_through_q_minus_k_is_the_gluon_dqs(spec):
    """A table indexed through q - k alone is summed per diagonal by the Gluon dQ kernel
    (templates/owned_gradients.jinja): no entry loop, no atomics; on the candidates whose
    registers take it (tiles.dq_fits_registers): key tiles of 64, and at head dim 128 four
    warps and tables of up to 32 entries."""
    variant = attncc.parse(spec)
    for kind in ("dq", "dkdv"):
        assert gluon_backend.kernel_unsupported(variant, kind, 64) is None
    dq = _dq_kernel_source(variant)
    assert "gl.gather(" in dq and "diag_slot = _index(" in dq and "part0_acc +=" in dq
    assert "for entry in" not in dq and "atomic_add" not in dq
    assert [c.label() for c in GLUON.candidates("dq", 64, variant)] == ["64x64 w4 s2", "128x64 w8 s2"]
    at_128 = [c.label() for c in GLUON.candidates("dq", 128, variant)]
    if "relative_bias" in spec:  # 511 entries: at head dim 128 the portable dQ, saying why
        why = gluon_backend.kernel_unsupported(variant, "dq", 128)
        assert at_128 == [] and "512 entries" in why and "up to 32" in why
    else:
        assert at_128 == ["64x64 w4 s2", "64x64 w4 s3"]
        assert gluon_backend.kernel_unsupported(variant, "dq", 128) is None
    # A variant without one keeps every candidate.
    alibi = attncc.parse(LEARNED_ALIBI)
    assert GLUON.candidates("dq", 64, alibi) == tiles.dq_candidates(64)


def test_a_relative_table_in_a_weight_keeps_the_portable_dq():
    # Under `normalize none` (and `sum`) the Gluon dQ sums the weights' slopes per row
    # only: a table through q - k read by the weight stays on the portable dQ, named.
    variant = attncc.parse("""attention sig_rel { learnable input bias: f32[h, 32] mask q >= k
        normalize none weight sigmoid(s + bias[h, min(q - k, 31)]) }""")
    why = gluon_backend.kernel_unsupported(variant, "dq", 64)
    assert why is not None and "bias (table)" in why
    assert "gl.gather(" not in _dq_kernel_source(variant)


def test_a_table_read_not_through_q_minus_k_keeps_the_portable_dq():
    # Its entry is not constant along a tile's diagonals: the portable dQ's per-entry sum
    # takes it, and the refusal names the read and the kinds the Gluon dQ owns.
    variant = attncc.parse("""attention block_table { learnable input bias: f32[h, 17]
        score s + bias[h, min(max(q // 64 - k // 64 + 8, 0), 16)] }""")
    why = gluon_backend.kernel_unsupported(variant, "dq", 64)
    assert "bias (table)" in why and "broadcast, rows and relative table reads only" in why
    assert gluon_backend.kernel_unsupported(variant, "dkdv", 64) is None
    assert "gl.gather(" not in _dq_kernel_source(variant)


@CPU_STAND_IN
def test_a_t5_backward_runs_the_gluon_dq(monkeypatch):
    """On an sm_90 GPU (faked: the stand-in runs the portable kernels), a T5 variant's
    dQ and dK/dV both run Gluon, and the table's gradient reaches it."""
    kernel = attncc.compile(T5_CAUSAL)
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 3, 20, 64, generator=gen, requires_grad=True) for _ in range(3))
    table = torch.randn(3, 32, generator=gen, requires_grad=True)
    kernel(q, k, v, table=table).sum().backward()
    assert calls == ["forward", "dq", "dkdv"]
    assert [b for b, _ in kernel.last_backward.values()] == ["gluon", "gluon"]
    assert table.grad is not None and table.grad.abs().sum() > 0


@pytest.mark.slow
@CPU_STAND_IN
def test_owned_learnable_reads_run_the_gluon_backward(monkeypatch):
    """Both roles run Gluon, and the dK/dV gradients reach the inputs' (the stand-in
    runs the portable kernels, whose contract the Gluon launchers keep:
    test_gluon_launchers_sum_the_partials_their_kernels_write)."""
    variant = attncc.parse(ROWS_AND_KEYS)
    kernel = attncc.compile(variant)
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 24, 64, generator=gen, requires_grad=True) for _ in range(3))
    shapes = {"b": 1, "h": 2, "q": 24, "k": 24}
    inputs = {d.name: torch.randn([shapes[a] for a in d.axes], generator=gen, requires_grad=True)
              for d in variant.inputs}
    kernel(q, k, v, **inputs).sum().backward()
    assert calls == ["forward", "dq", "dkdv"]
    assert [b for b, _ in kernel.last_backward.values()] == ["gluon", "gluon"]
    for t in inputs.values():
        assert t.grad is not None and t.grad.abs().sum() > 0


@pytest.mark.parametrize("spec", [LEARNED_ALIBI, ROWS_AND_KEYS, T5_CAUSAL])
def test_gluon_launchers_sum_the_partials_their_kernels_write(monkeypatch, spec):
    """The Gluon launchers allocate the portable layout's partials, hand them to their
    kernels and sum them with the shared host pass (codegen/templates/owned_partials.jinja):
    stand-in kernels write known partials, and each input's gradient is their sum as the
    portable module's _add_partials lays it out."""
    from attncc.runtime.cache import load_generated
    variant = attncc.parse(spec)
    portable, module = load_generated(variant)[1], load_generated(variant, "gluon")[1]
    gen = torch.Generator().manual_seed(8)
    B, H, L, D = 2, 3, 200, 64
    q, k, v, dout = (torch.randn(B, H, L, D, generator=gen, dtype=torch.bfloat16) for _ in range(4))
    shapes = {"b": B, "h": H, "q": L, "k": L}
    inputs = {d.name: torch.randn([shapes.get(a, a) for a in d.axes], generator=gen) for d in variant.inputs}
    written = {}

    class StandIn:
        """A kernel launch that fills its partial buffers with random values."""
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                for name in module.OWNED_READS:
                    part = args[-len(module.COMMON_PARAMS):][module.COMMON_PARAMS.index(name)]
                    if isinstance(part, torch.Tensor) and part.dtype == torch.float32:
                        part.copy_(torch.randn(part.shape, generator=gen))
                        written[name] = part.clone()
            return launch

    monkeypatch.setattr(module, "_bind_context", lambda device: None)
    monkeypatch.setattr(module, "_descriptor", lambda t, rows, width=None: t)
    monkeypatch.setattr(module, "attn_bwd_dq", StandIn())
    monkeypatch.setattr(module, "attn_bwd_dkdv", StandIn())
    lse, delta = torch.zeros(B, H, L), torch.zeros(B, H, L)
    config = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    _, by_rows = module.backward_dq(q, k, v, lse, delta, dout, inputs, config=config)
    by_keys = module.backward_dkdv(q, k, v, lse, delta, dout, inputs, config=config)[2:]
    assert set(written) == set(module.OWNED_READS) and set(by_rows) == set(inputs)
    expected = {name: torch.zeros(t.shape) for name, t in inputs.items()}
    portable._add_partials(expected, written, q, k, inputs, 0, 0)
    for name, t in inputs.items():
        got = by_rows[name] + (by_keys[0][name] if by_keys else 0)
        assert got.shape == t.shape and torch.equal(got, expected[name]), name
        assert got.abs().sum() > 0


def _document_backward(monkeypatch, schedule: str, length: int = 12):
    """(kernel, calls, backward): document.attn on the stand-in Gluon module under
    ATTNCC_BACKWARD=`schedule`, the roles the module was asked for, and one forward +
    backward of `length` tokens."""
    from attncc.runtime import settings
    monkeypatch.setattr(settings, "TABLES_BACKWARD", schedule)
    kernel = attncc.compile(str(EXAMPLES / "document.attn"))
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 12, 64, generator=gen) for _ in range(3))
    doc = torch.tensor([0] * 5 + [1] * 7, dtype=torch.int32)

    def backward(length=length):
        qkv = [t[:, :, :length].clone().requires_grad_() for t in (q, k, v)]
        kernel(*qkv, doc_q=doc[:length], doc_k=doc[:length]).sum().backward()
    return kernel, calls, backward


@CPU_STAND_IN
def test_a_table_driven_backward_says_it_runs_one_portable_launch(monkeypatch):
    from attncc.runtime import settings
    kernel, calls, backward = _document_backward(monkeypatch, "one-launch")
    backward()
    assert calls == ["forward"]
    backend, why = kernel.last_backward["bwd"]
    assert backend == "triton" and "one portable launch (ATTNCC_BACKWARD=one-launch" in why
    monkeypatch.setattr(settings, "TABLES_BACKWARD", "sequential")
    backward()
    assert calls == ["forward", "forward", "dq", "dkdv"]


@CPU_STAND_IN
def test_a_table_driven_backward_runs_the_gluon_kernels_where_they_take_both_roles(monkeypatch):
    # ATTNCC_BACKWARD=auto: the Gluon dQ and dK/dV where Gluon takes both of the call's
    # roles; where it refuses either, the portable one launch, which says why.
    kernel, calls, backward = _document_backward(monkeypatch, "auto")
    backward()
    assert calls == ["forward", "dq", "dkdv"]
    assert kernel.last_backward["dq"][0] == kernel.last_backward["dkdv"][0] == "gluon"
    # A call like it runs its plan, without asking the backends again (host time).
    monkeypatch.setattr(kernel, "split_preferred", lambda *args: pytest.fail("asked again"))
    backward()
    assert calls == ["forward", "dq", "dkdv"] * 2
    monkeypatch.undo()
    kernel, calls, backward = _document_backward(monkeypatch, "auto")
    real = GLUON.supports_call
    monkeypatch.setattr(GLUON, "supports_call", lambda variant, q, k, v, kind: (
        "refused here" if kind == "dkdv" else real(variant, q, k, v, kind)))
    backward()
    assert calls == ["forward"]
    backend, why = kernel.last_backward["bwd"]
    assert backend == "triton" and "one portable launch where no other backend" in why


def test_the_fused_backwards_variant_question_is_answered_once_per_variant(monkeypatch):
    # Every deterministic=False backward asks whether the fused kernel takes the call;
    # the variant's part needs its tile plans, 0.3-1.1 ms of host time a call uncached.
    from attncc.analysis import bounds
    planned = []
    real = bounds.plan_loops
    monkeypatch.setattr(bounds, "plan_loops", lambda v, side: planned.append(side) or real(v, side))
    variant = attncc.parse("attention once_per_variant { mask q >= k and q - k < 77 }")
    first = gluon_backend.fused_variant_unsupported(variant)
    assert "bounds the queries a key meets" in first and len(planned) == 2
    for _ in range(3):
        assert gluon_backend.fused_unsupported(variant, 128).startswith(first)
    assert len(planned) == 2


def test_fused_candidates_fit_and_bad_configs_are_named():
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    # One tile: two consumer warpgroups on 64 key rows each and a producer warp, at 128.
    kept = GLUON.candidates("fused", 128, causal)
    assert kept == [TileConfig(64, 128, tiles.FUSED_WS_WARPS, 2)]
    assert tiles._fused_smem(kept[0], 128) <= tiles.SMEM_LIMIT
    assert GLUON.candidates("fused", 64, causal) == GLUON.candidates("fused", 256, causal) == []
    # Other tiles and stage counts are refused by name.
    for config in (TileConfig(64, 64, 8, 2), TileConfig(64, 128, 8, 2), TileConfig(128, 128, 9, 2)):
        assert "num_warps 9" in GLUON.check_config(config, "fused", 128)
    assert "head dims 128" in GLUON.check_config(kept[0], "fused", 64)
    assert "shared memory" in GLUON.check_config(TileConfig(64, 128, 9, 3), "fused", 128)


def test_the_fused_backward_names_what_it_does_not_take(monkeypatch):
    def why(name, dim=128, dim_v=None):
        variant = attncc.parse_file(EXAMPLES / f"{name}.attn")
        q = torch.randn(1, 2, 8, dim, dtype=torch.bfloat16)
        v = torch.randn(1, 2, 8, dim_v or dim, dtype=torch.bfloat16)
        return GLUON.supports_call(variant, q, q, v, "fused")

    # Under a Triton without Gluon's TMA reduce-add (3.6), nothing, and it says why.
    monkeypatch.setattr(gluon_backend, "_fused_triton_unsupported",
                        lambda: "Triton 3.6.0 has no Gluon TMA reduce-add (3.8 added it)")
    assert "TMA reduce-add" in why("causal")
    assert gluon_backend.fused_dq_add().startswith("none: ")
    monkeypatch.setattr(gluon_backend, "_fused_triton_unsupported", lambda: None)
    for name in ("causal", "full", "gqa_causal", "causal_bottom_right"):
        assert why(name) is None
    # Where it measured no faster than the split kernels: tile tables, a window.
    assert "tile tables" in why("bigbird") and "tile tables" in why("document")
    assert "bounds the queries a key meets" in why("sliding_window")
    assert "head dim 64" in why("causal", 64) and "head dim 256" in why("causal", 256)
    assert "(192, 128)" in why("causal", 192, 128)
    for name in ("softcap", "alibi"):  # registers: the 128-key tile spills
        assert "a score or a mask that reads tensors" in why(name)
    assert "learnable inputs (bias)" in why("relative_bias")
    assert "normalizes by `none`" in why("sigmoid_attention")
    # Each says that the split runs the call.
    assert why("softcap").endswith("the deterministic dQ and dK/dV kernels run it")


def _grads(kernel, q, k, v, dlse_weight=0.5, **options):
    """q, k, v's gradients of a loss reading the output and the LSE."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = kernel(*leaves, return_lse=True, **options)
    (out.square().sum() + dlse_weight * lse.sum()).backward()
    return [t.grad for t in leaves]


def _recording_gluon(kernel, monkeypatch, calls):
    """As _stand_in_gluon, with kernels that return zeros: which ones a call runs, with
    no kernel run (the interpreter's time)."""
    _stand_in_gluon(kernel, monkeypatch, calls)
    zeros = torch.zeros_like
    results = {
        "forward": lambda q, k, v, values: (zeros(q), q.new_zeros(q.shape[:3])),
        "dq": lambda q, k, v, lse, delta, dout, values: (
            zeros(q), {d.name: zeros(values[d.name]) for d in kernel.variant.learnable_inputs}),
        "dkdv": lambda q, k, v, *_: (zeros(k), zeros(v)),
        "fused": lambda q, k, v, *_: (zeros(q), zeros(k), zeros(v))}

    def recorded(name):
        def run(*args, config, **common):
            calls.append(name)
            return results[name](*args)
        return run
    monkeypatch.setitem(kernel._modules, "gluon", (None, SimpleNamespace(
        forward=recorded("forward"), backward_dq=recorded("dq"), backward_dkdv=recorded("dkdv"),
        backward_fused=recorded("fused"))))


@CPU_STAND_IN
def test_deterministic_false_runs_the_fused_backward(monkeypatch):
    monkeypatch.setattr(gluon_backend, "_fused_triton_unsupported", lambda: None)
    kernel = attncc.compile(str(EXAMPLES / "causal.attn"))
    calls = []
    _recording_gluon(kernel, monkeypatch, calls)
    q = torch.randn(1, 3, 9, 128, requires_grad=True)
    kernel(q, q, q, deterministic=False).sum().backward()
    assert calls == ["forward", "fused"]
    backend, why = kernel.last_backward["fused"]
    assert list(kernel.last_backward) == ["fused"] and backend == "gluon"
    assert "deterministic=False" in why and "no fixed order" in why
    assert gluon_backend.fused_dq_add() in why  # which add this Triton runs
    # The default, deterministic=True, and torch's deterministic mode whatever the call
    # says run the split deterministic kernels.
    for options in ({}, {"deterministic": True}):
        calls.clear()
        kernel(q, q, q, **options).sum().backward()
        assert calls == ["forward", "dq", "dkdv"] and "fused" not in kernel.last_backward
    calls.clear()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    kernel(q, q, q, deterministic=False).sum().backward()
    assert calls == ["forward", "dq", "dkdv"]


@pytest.mark.slow
@CPU_STAND_IN
def test_the_fused_backward_reads_the_delta_that_carries_the_lse_gradient(monkeypatch):
    # The stand-in fused kernel runs the portable split on the delta it is given: the
    # gradients, the LSE's included, match the portable kernels' only if that delta is
    # delta - dlse (runtime/scheduling.py's _fused).
    monkeypatch.setattr(gluon_backend, "_fused_triton_unsupported", lambda: None)
    spec = str(EXAMPLES / "causal.attn")
    kernel = attncc.compile(spec)
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 3, 21, 128, generator=gen) for _ in range(3))
    fused = _grads(kernel, q, k, v, deterministic=False)
    assert calls == ["forward", "fused"]
    portable = _grads(attncc.compile(spec, backend="triton"), q, k, v)
    for a, b in zip(fused, portable):
        assert torch.allclose(a, b, atol=1e-5)


@CPU_STAND_IN
def test_the_fused_backward_leaves_the_rest_to_the_split(monkeypatch):
    monkeypatch.setattr(gluon_backend, "_fused_triton_unsupported", lambda: None)
    q = torch.randn(1, 2, 12, 128, requires_grad=True)
    # Tile tables: the split kernels run, and last_backward says why.
    kernel = attncc.compile(str(EXAMPLES / "sparse_strided.attn"))
    _recording_gluon(kernel, monkeypatch, [])
    assert kernel.fused_backend(q, q, q) is None
    backend, why = kernel.last_backward["fused"]
    assert backend is None and "tile tables" in why and "deterministic kernels ran" in why
    # Learnable inputs' gradients are not the fused kernel's: it says so, and the split
    # kernels run (at head dim 64 here, where the Gluon dQ takes the 511-entry table).
    kernel = attncc.compile(str(EXAMPLES / "relative_bias.attn"))
    calls = []
    _recording_gluon(kernel, monkeypatch, calls)
    assert kernel.fused_backend(q, q, q) is None
    assert "learnable inputs (bias)" in kernel.last_backward["fused"][1]
    bias = torch.randn(2, 511, requires_grad=True)
    q = q[..., :64]
    kernel(q, q, q, bias=bias, deterministic=False).sum().backward()
    assert calls == ["forward", "dq", "dkdv"] and bias.grad is not None
    backend, why = kernel.last_backward["fused"]
    assert backend is None and "deterministic kernels ran" in why
    # A kernel on the portable backend alone has no fused backward.
    kernel = attncc.compile(str(EXAMPLES / "causal.attn"), backend="triton")
    x = torch.randn(1, 2, 12, 16, requires_grad=True)
    kernel(x, x, x, deterministic=False).sum().backward()
    assert "backend='triton' was asked for" in kernel.last_backward["fused"][1]


def test_deterministic_must_be_a_bool_or_none():
    kernel = attncc.compile(str(EXAMPLES / "causal.attn"))
    q = torch.randn(1, 2, 8, 16)
    for bad in ("no", 1):
        with pytest.raises(attncc.CallError, match=r"deterministic must be True or False"):
            kernel(q, q, q, deterministic=bad)


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'gluon'"):
        attncc.compile(str(EXAMPLES / "causal.attn"), backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's dispatch")
def test_dispatch_without_an_sm90_gpu():
    spec = str(EXAMPLES / "causal.attn")
    auto = attncc.compile(spec)
    assert auto.backend == "triton" and "interpreter" in auto.backend_reason
    asked = attncc.compile(spec, backend="triton")
    assert asked.backend == "triton" and "backend='triton'" in asked.backend_reason
    with pytest.raises(attncc.BackendError, match="backend='gluon' cannot run this: the Triton "
                                                  "interpreter"):
        attncc.compile(spec, backend="gluon")
    # The variant's own limits are named before the machine's.
    with pytest.raises(attncc.BackendError, match="dropout 0.1, which the Gluon forward"):
        attncc.compile(str(EXAMPLES / "dropout.attn"), backend="gluon")
    # auto runs the portable forward and says why, call by call; and the backward.
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    out = auto(q, q, q)
    assert auto.last_backend == ("triton", auto.backend_reason)
    assert torch.isfinite(out).all()
    assert auto.last_backward == {}
    out.sum().backward()
    assert auto.last_backward == {"dq": ("triton", auto.backend_reason),
                                  "dkdv": ("triton", auto.backend_reason)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's dispatch")
def test_no_gpu_is_named_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gluon_backend._device_unsupported.cache_clear()
    try:
        assert "no CUDA GPU" in GLUON.environment_unsupported()
    finally:
        gluon_backend._device_unsupported.cache_clear()


def test_cli_compile_backend_gluon_writes_both_modules(tmp_path, capsys):
    spec = EXAMPLES / "sliding_window.attn"
    assert main(["compile", str(spec), "--backend", "gluon", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "sliding_window_gluon.py").read_text()
    assert text == GLUON.render(attncc.load(spec)).source
    assert (tmp_path / "sliding_window.py").exists()  # its tables and backward
    assert "backend   gluon forward, dQ and dK/dV on an sm_90 GPU" in out
    assert "Gluon dQ tiles (head dim 128): 64x64 (4 warps, 2 stages)" in out
    assert "Gluon dK/dV tiles (head dim 128): 64x64 (4 warps, 2 stages)" in out


def test_cli_compile_backend_gluon_refuses_what_it_cannot_take(tmp_path, capsys):
    spec = str(EXAMPLES / "dropout.attn")
    assert main(["compile", spec, "--backend", "gluon", "-o", str(tmp_path)]) == 2
    assert "--backend gluon cannot compile this: variant 'dropout' has dropout" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
    assert main(["compile", spec, "--backend", "auto", "-o", str(tmp_path)]) == 0
    assert "backend   auto: the portable kernels, since variant 'dropout'" in capsys.readouterr().out
    assert not (tmp_path / "dropout_gluon.py").exists()


def _two_backend_call(monkeypatch, tmp_path):
    """A kernel and problem as tuning.choose sees them off the interpreter, and runs of
    the Gluon and portable forwards that return their backend's name; do_bench times each
    backend at `times[name]`, and `timed` lists what it timed."""
    import triton
    from types import SimpleNamespace
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    monkeypatch.setattr("attncc.runtime.settings.interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_MEMORY", {})
    variant = attncc.parse_file(EXAMPLES / "causal.attn")
    kernel = SimpleNamespace(variant=variant, key=variant.key(), pinned_config=None)
    problem = Problem(1, 1, 1, 4096, 4096, 128, 128)
    timed, times = [], {"gluon": 3.0, "triton": 4.0}
    runs = {name: (lambda config, name=name: name) for name in ("gluon", "triton")}
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **kw: (timed.append(fn()), times[fn()])[1])
    return kernel, problem, runs, timed, times


def test_auto_times_both_backends_once_and_remembers(monkeypatch, tmp_path):
    """The backend is a dimension of the tuner's candidates: each backend's first
    candidates are timed together, the fastest pair kept, in this process and on disk (a
    new process reads it without timing)."""
    kernel, problem, runs, timed, times = _two_backend_call(monkeypatch, tmp_path)
    choice = tuning.choose(kernel, problem, torch.bfloat16, "fwd", runs)
    assert choice == tuning.Choice("gluon", GLUON.candidates("fwd", 128, kernel.variant)[0])
    assert sorted(set(timed)) == ["gluon", "triton"] and len(timed) == 2 * tuning.TUNE_AT_MOST
    tuning._MEMORY.clear()  # as a new process: the choice comes from disk, untimed
    timed.clear()
    times.update(gluon=5.0)
    assert tuning.choose(kernel, problem, torch.bfloat16, "fwd", runs) == choice
    assert timed == []
    monkeypatch.setenv("ATTNCC_TUNE", "0")  # no timing: the portable forward's first candidate
    other = Problem(1, 1, 1, 4096, 4096, 64, 64)
    untimed = tuning.choose(kernel, other, torch.bfloat16, "fwd", runs)
    assert untimed.backend == "triton"


def test_the_tuner_caches_backend_and_config_under_one_key(monkeypatch, tmp_path):
    """One key per role and shape bucket (and the backends that competed) records the
    backend with its config; each competitor's own fastest is kept too, for a call only
    it can take, so that call needs no tuning."""
    import json
    kernel, problem, runs, timed, _ = _two_backend_call(monkeypatch, tmp_path)
    choice = tuning.choose(kernel, problem, torch.bfloat16, "dq", runs)
    data = json.loads(tuning._cache_file(kernel.variant).read_text())
    key = "dq-d128-bfloat16-g1-q4096-k4096"
    assert data[f"{key}-on-gluon+triton"] == choice.to_json() == {
        "backend": "gluon", "config": GLUON.candidates("dq", 128, kernel.variant)[0].as_dict()}
    assert data[f"{key}-on-triton"]["backend"] == "triton"
    assert set(data) == {f"{key}-on-gluon+triton", f"{key}-on-gluon", f"{key}-on-triton"}
    timed.clear()
    portable = tuning.choose(kernel, problem, torch.bfloat16, "dq", {"triton": runs["triton"]})
    assert portable == tuning.Choice.from_json(data[f"{key}-on-triton"], "test") and timed == []
    # The old file of configs alone is another file, never read as this one.
    assert tuning._cache_file(kernel.variant).name.endswith("-choices.json")


@pytest.mark.parametrize("entry", [
    {"backend": "gluon", "config": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)},
    {"backend": "triton", "config": dict(BLOCK_M=128, BLOCK_N=128, num_warps=9, num_stages=2)},
    {"backend": "cudnn", "config": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)},
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),  # a config alone, as before
], ids=["another backend", "another backend's config", "unknown backend", "no backend"])
def test_a_cached_entry_the_call_cannot_run_is_tuned_again(monkeypatch, tmp_path, entry):
    """A stale or edited entry naming another backend than the call's, or a config that is
    not one of its backend's candidates, is never run: the call is tuned."""
    import json
    kernel, problem, runs, timed, _ = _two_backend_call(monkeypatch, tmp_path)
    path = tuning._cache_file(kernel.variant)
    path.parent.mkdir(parents=True)
    key = "fwd-d128-bfloat16-g1-q4096-k4096-on-triton"
    path.write_text(json.dumps({key: entry}))
    choice = tuning.choose(kernel, problem, torch.bfloat16, "fwd", {"triton": runs["triton"]})
    assert choice.backend == "triton" and choice.config.num_warps != 9
    assert len(timed) == tuning.TUNE_AT_MOST  # tuned, not read
    assert json.loads(path.read_text())[key] == choice.to_json()


def test_a_gluon_pin_pins_only_the_gluon_forward():
    from types import SimpleNamespace
    variant = attncc.parse_file(EXAMPLES / "causal.attn")
    pin = TileConfig(128, 128, tiles.WS_WARPS, 2)
    asked = SimpleNamespace(variant=variant, key=variant.key(), pinned_config=pin,
                            requested_backend="gluon")
    assert tuning.pinned_config(asked, "gluon", "fwd") == pin
    # The backward is tuned: a Gluon forward config (9 warps) must not reach its kernels,
    # nor the portable ones.
    assert tuning.pinned_config(asked, "gluon", "dq") is None
    assert tuning.pinned_config(asked, "triton", "dq") is None
    portable = SimpleNamespace(variant=variant, key=variant.key(), pinned_config=pin,
                               requested_backend="triton")
    assert tuning.pinned_config(portable, "triton", "dq") == pin
    assert tuning.pinned_config(portable, "gluon", "fwd") is None


def test_a_pinned_config_is_checked_by_the_backend_it_pins():
    spec = str(EXAMPLES / "causal.attn")
    ws = dict(BLOCK_M=128, BLOCK_N=128, num_warps=tiles.WS_WARPS, num_stages=2)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16 for the portable"):
        attncc.compile(spec, config=ws)
    with pytest.raises(ValueError, match="num_warps must be an int from 1 to 16"):
        attncc.compile(spec, config=dict(ws, num_warps=32))


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on Hopper GPUs")
def test_a_gluon_launch_in_a_fresh_thread_finds_a_context():
    """A Gluon launch whose kernel is compiled and loaded already, made from a thread
    where nothing has touched CUDA yet (autograd's backward thread in a warm process),
    builds its TMA descriptors with a context current: before the launchers bound it,
    this failed with "Failed to create tensor map descriptor: invalid device context"
    (benchmarks/RESULTS.md run 134)."""
    import threading
    kernel = attncc.compile(str(EXAMPLES / "causal.attn"), backend="gluon")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen, dtype=torch.float16).cuda()
               for _ in range(3))
    module = kernel.module_of("gluon")
    config = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    want, _ = module.forward(q, k, v, {}, config=config)  # compiled and loaded here
    torch.cuda.synchronize()
    got, failure = [], []

    def launch():
        try:
            got.append(module.forward(q, k, v, {}, config=config)[0])
            torch.cuda.synchronize()
        except Exception as e:  # reported below, with its message
            failure.append(e)
    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    assert not failure, failure
    assert torch.equal(got[0], want)


@pytest.mark.parametrize("scale, positive", [(None, True), ("1.0 / sqrt(dim)", True),
                                             ("0.5 / dim_v", True), ("-0.125", False),
                                             ("dim - 1", False), ("c", False)])
def test_the_scale_is_proven_positive_only_where_it_is(scale, positive):
    from attncc.analysis.signs import scale_is_positive
    # `dim - 1` is 0 at head dim 1; the param c is -2.0.
    spec = "attention a {\n  param c: float = -2.0\n  mask q >= k\n" + (
        f"  scale {scale}\n" if scale else "") + "}"
    assert scale_is_positive(attncc.parse(spec)) is positive


@pytest.mark.parametrize("spec, folded", [
    ("attention a { mask q >= k }", True),
    ("attention a { mask q >= k\n scale -0.125 }", False),  # the row max of q·k flips sign
    ("attention a { mask q >= k\n score 30.0 * tanh(s / 30.0) }", False),  # a score acts on s
])
def test_the_gluon_kernels_fold_the_scale_into_the_exponent_where_it_is_positive(spec, folded):
    # exp2(qk * qk_scale - m) compiles to one FFMA an element where scaling, then
    # subtracting, take two (Nsight Compute counted the two on the H200: RESULTS run 181).
    source = GLUON.render(attncc.parse(spec)).source
    for line in ("p = gl.exp2(qk * qk_scale - m_use[:, None])",  # the forward
                 "p = gl.exp2(qk * qk_scale - lse2[:, None])",  # dQ
                 "p = gl.exp2(qk * qk_scale - lse2[None, :])"):  # dK/dV (P transposed)
        assert (line in source) is folded, line
    assert ("gl.max(qk, 1) * qk_scale" in source) is folded


def test_tile_at_reads_inside_the_tables_lists_at_every_position():
    # The Gluon kernels name the tile visited i-th, and prefetch past the last one (i up
    # to n_tiles + NUM_STAGES - 1; the copies are predicated off, the address is read
    # anyway). Every address read must lie inside the list it reads, whatever the mix
    # of full and partial tiles: a unit with no partial tiles once read the partial
    # list at entry -1, before the table's first element for the first unit.
    from pathlib import Path
    from types import SimpleNamespace
    from attncc.codegen import templating
    env = templating.environment(Path(gluon_backend.__file__).parent / "templates")
    macros = env.get_template("prologue.jinja").make_module(
        {"tables": True, "k_segments": [], "q_segments": []})
    code = compile(macros.tile_at("i", "tile", "masked", "col"), "tile_at", "exec")

    class Pointer:
        def __init__(self, name, offset=0):
            self.name, self.offset = name, offset

        def __add__(self, k):
            return Pointer(self.name, self.offset + k)
        __radd__ = __add__

    width = 6  # entries per list; the unit under test owns the first list (lists = 0)
    lists = {"col_full_list": list(range(100, 100 + width)),
             "col_part_list": list(range(200, 200 + width))}

    def load(pointer, mask, other):
        if not mask:
            return other
        assert 0 <= pointer.offset < width, (pointer.name, pointer.offset)
        return lists[pointer.name][pointer.offset]

    tl = SimpleNamespace(maximum=max, minimum=min, load=load,
                         where=lambda c, a, b: a if c else b)
    for n_full in range(4):
        for n_part in range(3):
            n_tiles = n_full + n_part
            for i in range(n_tiles + 3):
                scope = dict(tl=tl, i=i, n_full=n_full, n_tiles=n_tiles, lists=0,
                             col_full_list=Pointer("col_full_list"),
                             col_part_list=Pointer("col_part_list"))
                exec(code, scope)
                if i < n_tiles:  # a real position: its tile and whether it is partial
                    want = 200 + i - n_full if i >= n_full else 100 + i
                    assert (scope["tile"], scope["masked"]) == (want, i >= n_full)


def _kernel_source(variant, name: str) -> str:
    source = gluon.generate(variant).source
    start = source.index(f"def {name}(")
    return source[start:source.index("\ndef ", start + 1)]


@pytest.mark.parametrize("kernel", ["attn_bwd_dq", "attn_bwd_dkdv"])
def test_the_backward_folds_the_score_slope_into_p_before_the_wait_for_dp(kernel):
    """Softcap's d score / d s (1 - tanh²) multiplies P before the wait for dP, so that s
    and tanh are not held across the product (scores.jinja's fold_score_slope: spills
    356 -> 204 B in softcap's dK/dV under Triton 3.6); after the wait only P·slope is read.
    A kernel that owns a learnable read keeps dS by the score, which its sums need."""
    source = _kernel_source(attncc.parse_file(EXAMPLES / "softcap.attn"), kernel)
    wait = source.index("dp = warpgroup_mma_wait(")
    before, after = source[:wait], source[wait:source.index("ds_op = ", wait)]
    assert "p_ds = p * (" in before and "_tanh_fast(" in before
    assert "ds = p_ds * (dp - delta" in after
    assert "_tanh_fast(" not in after and " s " not in after and "(s " not in after
    # A read the dK/dV kernel owns (`cols`: bias[h, k]) needs dS by the score: not folded.
    owned = attncc.parse("""attention key_bias { learnable input bias: f32[h, k] mask q >= k
        score 30.0 * tanh((s + bias[h, k]) / 30.0) }""")
    dkdv = _kernel_source(owned, "attn_bwd_dkdv")
    assert "p_ds" not in dkdv and "ds = p * (dp - delta" in dkdv


def test_a_relative_table_in_a_weight_is_named_as_left_to_the_portable_dq():
    """Under `sum` or `none` a table through q - k stays on the portable dQ (its slopes are
    summed per row only); the refusal called it a table while listing "relative table"
    among the kinds the Gluon dQ owns."""
    variant = attncc.parse("attention t { learnable input tab: f32[h, 33]  normalize none  "
                           "weight sigmoid(s + tab[h, min(max(q - k, -16), 16) + 16]) }")
    why = gluon_backend.kernel_unsupported(variant, "dq", 64)
    assert "tab (table)" in why and "relative under softmax only" in why
