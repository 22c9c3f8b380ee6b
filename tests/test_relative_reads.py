"""Reads through q - k alone (attncc/codegen/relative_reads.py): a tile whose diagonals
each read one element of such a read loads it once and adds it, the other tiles read per
pair. Rendering (which reads take the path, which kernels carry it) and, under the
interpreter, T5's and clipped tables' outputs and gradients against the float64
reference and an independent formula, at shapes whose tiles take both paths."""
import math

import pytest
import torch

import attncc
from attncc.backends.gluon.codegen import generate as gluon_generate
from attncc.backends.portable.codegen import generate
from test_deterministic_grads import _grads
from test_kernels import compare
from test_rounding import T5_BIDIRECTIONAL, T5_CAUSAL, t5_attention, t5_relative_position_bucket

pytestmark = pytest.mark.filterwarnings("ignore::attncc.errors.SpecWarning")
F64 = torch.float64
UNIFORM_TEST = "if rel0_lo == rel0_hi:"

CLIPPED = """attention clipped { learnable input bias: f32[h, 13]
    score s + bias[h, min(max(q - k, -6), 6) + 6] }"""


def _tiles(entry, Lq, Lk, bm, bn) -> tuple:
    """(tiles whose every diagonal reads one entry, tiles that read several) of a tile
    grid, from `entry`: [Lq', Lk'] entries of the padded grid (rows and columns past the
    lengths too: the kernels' diagonals include them)."""
    uniform = mixed = 0
    for i in range(0, Lq, bm):
        for j in range(0, Lk, bn):
            if entry[i:i + bm, j:j + bn].unique().numel() == 1:
                uniform += 1
            else:
                mixed += 1
    return uniform, mixed


def _padded(Lq, Lk, bm, bn, q_offset):
    """q - k over the padded tile grid: [ceil(Lq/bm)*bm, ceil(Lk/bn)*bn]."""
    rows = torch.arange(-(-Lq // bm) * bm)[:, None] + q_offset
    return rows - torch.arange(-(-Lk // bn) * bn)[None, :]


def test_relative_reads_take_the_fast_path_in_every_portable_kernel():
    source = generate(attncc.load(T5_BIDIRECTIONAL)).source
    # The forward, dQ and dK/dV steps each test their tile once: one element broadcast,
    # or the per-pair gather.
    assert source.count(UNIFORM_TEST) == 3
    assert source.count("t = ((s + rel0_pairs)) * LOG2E") == 3
    assert source.count("rel0 = tl.load(in_table_ptr + rel0_lo).to(tl.float32)") == 3
    clipped = generate(attncc.load(CLIPPED)).source
    assert clipped.count(UNIFORM_TEST) == 3


@pytest.mark.parametrize("spec", [T5_BIDIRECTIONAL, T5_CAUSAL, CLIPPED], ids=["t5", "t5-causal", "clipped"])
def test_relative_reads_take_the_fast_path_in_every_gluon_kernel(spec):
    source = gluon_generate(attncc.load(spec)).source
    lines = source.splitlines()
    # Each softmax step tests its tile once: the forward's two (tile 0, the loop) in the
    # plain and the warp-specialized kernel, dQ's and dK/dV's. The element is loaded
    # before the tile's products; after them, t is the score of that scalar, or of the
    # per-pair gather, which is left only in the branch for tiles that read several.
    assert source.count("if (rel0_lo == rel0_hi):") == 6
    assert source.count("rel0 = tl.load(in_") == 6
    uniform = [n for n, line in enumerate(lines) if "if (rel0_lo == rel0_hi):" in line]
    assert all(lines[n + 1].strip() == "t = ((s + rel0)) * LOG2E" for n in uniform)
    assert all(lines[n + 2].strip() == "else:" and "tl.load(" in lines[n + 3] for n in uniform)
    assert sum("LOG2E" in line and "tl.load(" in line for line in lines) == 6
    # dK/dV's tiles are transposed: keys down its rows, whose positions are shifted per
    # diagonal, against the query tile's first position.
    assert source.count("diag_k = k_pos - diag_w * BLOCK_N") == 1
    assert source.count("diag_q = q_pos - diag_w * BLOCK_M") == 5
    assert source.count("diag_t = gl.arange(0, BLOCK_N, row_layout)[:, None]") == 1


@pytest.mark.parametrize("score", ["s + bias[h, q]", "s + bias[h, q - 2 * k]",
                                   "s + bias[h, min(k, 15)]", "bias[h, min(max(q - k, 0), 15)]"],
                         ids=["q", "q-2k", "k", "no-s"])
def test_reads_not_through_q_minus_k_alone_stay_per_pair(score):
    variant = attncc.load(f"attention a {{ input bias: f32[h, 16] score {score} }}")
    assert "rel0" not in generate(variant).source
    assert "rel0" not in gluon_generate(variant).source


def test_only_the_relative_read_of_a_score_is_named():
    source = generate(attncc.load("""attention a { input w: f32[h, 64] input r: f32[h, 9]
        score s + w[h, min(q, 63)] + r[h, min(max(k - q, -4), 4) + 4] }""")).source
    assert source.count(UNIFORM_TEST) == 3 and "rel1" not in source
    # The score still reads w per pair, and r from its tile of values.
    scores = [line for line in source.splitlines() if "rel0_pairs)) * LOG2E" in line]
    assert len(scores) == 3 and all("in_w_ptr" in x for x in scores)
    gluon = gluon_generate(attncc.load("""attention a { input w: f32[h, 64] input r: f32[h, 9]
        score s + w[h, min(q, 63)] + r[h, min(max(k - q, -4), 4) + 4] }""")).source
    assert gluon.count("if (rel0_lo == rel0_hi):") == 6 and "rel1" not in gluon


# Each shape has tiles of both kinds (asserted): lengths off the tiles, len_q != len_k,
# 3 heads, a query offset; one token. Seconds each under the interpreter: the fast suite
# runs the clipped table's smallest case.
@pytest.mark.slow
@pytest.mark.parametrize("spec, bidirectional, Lq, Lk, q_offset, bm, bn", [
    (T5_BIDIRECTIONAL, True, 21, 300, 130, 32, 32),
    (T5_CAUSAL, False, 19, 200, 180, 16, 32),
    (T5_BIDIRECTIONAL, True, 1, 150, 130, 16, 16),
], ids=["t5", "t5_causal", "t5_one_token"])
def test_t5_matches_an_independent_t5_on_both_paths(spec, bidirectional, Lq, Lk, q_offset, bm, bn):
    rel = -_padded(Lq, Lk, bm, bn, q_offset)
    uniform, mixed = _tiles(t5_relative_position_bucket(rel, bidirectional), Lq, Lk, bm, bn)
    assert uniform and mixed
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, Lq, 16, generator=gen, dtype=F64) * 2
    k, v = (torch.randn(1, 3, Lk, 16, generator=gen, dtype=F64) for _ in range(2))
    table = torch.randn(3, 32, generator=gen, dtype=F64) * 3
    do = torch.randn(1, 3, Lq, 16, generator=gen, dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    want = torch.autograd.grad(t5_attention(*leaves, bidirectional, q_offset), leaves, do)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1}
    got = _grads(attncc.compile(spec, config=config), q.float(), k.float(), v.float(),
                 do.float(), {"table": table.float()}, q_offset=q_offset)
    for name, g, w in zip(["dq", "dk", "dv", "dtable"], got, want):
        assert not g.isnan().any()
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-5 * w.abs().max().item() + 2e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("Lq, Lk, q_offset, bm, bn", [
    (9, 40, 0, 16, 16), pytest.param(37, 45, 0, 16, 16, marks=pytest.mark.slow),
    pytest.param(20, 70, 9, 32, 16, marks=pytest.mark.slow)])
def test_clipped_table_matches_the_reference_on_both_paths(Lq, Lk, q_offset, bm, bn):
    entry = _padded(Lq, Lk, bm, bn, q_offset).clamp(-6, 6) + 6
    uniform, mixed = _tiles(entry, Lq, Lk, bm, bn)
    assert uniform and mixed
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1}
    got, _ = compare(attncc.load(CLIPPED), B=1, H=3, Lq=Lq, Lk=Lk, D=16, q_offset=q_offset,
                     config=config)
    assert not any(g.isnan().any() for g in got)


@pytest.mark.slow
def test_relative_511_far_tiles_read_the_clipped_end():
    # relative_511's clip (benchmarks/learnable_gradients.py) at 64-wide tiles: a key
    # 300 positions behind reads the last entry on every diagonal of its tile.
    spec = """attention relative_511 { learnable input bias: f32[h, 511]
        score s + bias[h, min(max(q - k, -255), 255) + 255] }"""
    Lq, Lk, bm, bn = 70, 330, 64, 64
    uniform, mixed = _tiles(_padded(Lq, Lk, bm, bn, 0).clamp(-255, 255), Lq, Lk, bm, bn)
    assert uniform and mixed
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 3, Lq, 16, generator=gen, dtype=F64)
    k, v = (torch.randn(1, 3, Lk, 16, generator=gen, dtype=F64) for _ in range(2))
    bias = torch.randn(3, 511, generator=gen, dtype=F64)
    do = torch.randn(1, 3, Lq, 16, generator=gen, dtype=F64)
    entry = (torch.arange(Lq)[:, None] - torch.arange(Lk)[None, :]).clamp(-255, 255) + 255

    def dense(q, k, v, bias):
        logits = q @ k.transpose(-1, -2) / math.sqrt(16) + bias[:, entry]
        return torch.softmax(logits, -1) @ v

    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    want = torch.autograd.grad(dense(*leaves), leaves, do)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1}
    got = _grads(attncc.compile(spec, config=config), q.float(), k.float(), v.float(),
                 do.float(), {"bias": bias.float()})
    for name, g, w in zip(["dq", "dk", "dv", "dbias"], got, want):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-5 * w.abs().max().item() + 2e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_int_and_bool_relative_reads_match_the_reference():
    # The broadcast element keeps the read's type: an integer and a boolean table.
    spec = """attention typed { input ids: i32[h, 9] input on: bool[h, 9]
        score s + 0.25 * ids[h, min(max(q - k, -4), 4) + 4]
            + where(on[h, min(max(k - q, -4), 4) + 4], 1.5, -0.5) }"""
    Lq, Lk, bm, bn = 9, 40, 16, 16
    uniform, mixed = _tiles(_padded(Lq, Lk, bm, bn, 0).clamp(-4, 4), Lq, Lk, bm, bn)
    assert uniform and mixed
    variant = attncc.load(spec)
    assert generate(variant).source.count("rel1_lo == rel1_hi") == 3
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1}
    compare(variant, B=1, H=3, Lq=Lq, Lk=Lk, D=16, config=config)
