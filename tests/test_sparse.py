"""Block-sparse research patterns: the sparse examples against the float64 reference.

Each example from examples/ (Sparse Transformer strided, fixed and per-head patterns,
LongNet-style dilated blocks, MInference vertical-slash, NSA top-k selection) is
compiled and compared with `attncc.reference` under the interpreter (test_kernels'
`compare`), on small shapes: the static layouts also at blocks of 16 and 32 so that a
short sequence spans many blocks, with lengths that are not multiples of the block.
The runtime layouts are built by the code in the examples' own comments. Then layouts
per head and per batch row, layouts combined with causal and document masks, bad
layout tensors, and the host-side helpers of benchmarks/density_curve.py.
"""
from __future__ import annotations

import importlib.util
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

import attncc
from test_kernels import DEVICE, compare

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def example(name: str, **subs) -> attncc.Variant:
    """The example `name`, with `old=new` text substitutions (smaller blocks, params)."""
    text = (EXAMPLES / f"{name}.attn").read_text()
    for old, new in subs.items():
        assert old in text, f"{old!r} not in {name}.attn"
        text = text.replace(old, new)
    return attncc.parse(text)


def comment_code(name: str) -> str:
    """The indented Python in an example's header comment (how to build its layout)."""
    lines = [line[1:] for line in (EXAMPLES / f"{name}.attn").read_text().splitlines()
             if line.startswith("#     ")]
    return textwrap.dedent("\n".join(lines))


def run_comment_code(name: str, **env) -> dict:
    """Execute the comment's code with `env` (q, k, v, L, H, ...); `kernel` is captured."""
    calls = {}

    def kernel(q, k, v, **inputs):
        calls.update(inputs)
        return None

    scope = {"torch": torch, "kernel": kernel, **env}
    exec(compile(comment_code(name), f"{name}.attn comment", "exec"), scope)
    return calls


PER_HEAD = "attention l { input blocks: bool[h, qb, kb] layout blocks[h, qb, kb] block 16 }"
PER_BATCH = "attention l { input sel: bool[b, h, qb, kb] layout sel[b, h, qb, kb] block 16 }"


def _qkv(B=2, H=3, L=40):  # 40 tokens: 3 blocks of 16
    return [torch.randn(B, H, L, 16, device=DEVICE) for _ in range(3)]


# ----------------------------------------------------------- static layouts (block 16, 32)
@pytest.mark.parametrize("name,subs,H,L", [
    ("sparse_strided", {"block  128": "block 16"}, 2, 130),            # 9 blocks: diagonals 0-3, 4, 8
    ("sparse_fixed", {"block  128": "block 16", "int = 4": "int = 3"}, 2, 130),
    ("sparse_heads", {"block  64": "block 32", "int = 4": "int = 2"}, 2, 150),  # 5 blocks
    ("dilated_blocks", {"block  64": "block 16", "segment:  int = 4": "segment:  int = 2",
                        "dilation: int = 4": "dilation: int = 3"}, 2, 130),
], ids=["strided", "fixed", "heads", "dilated"])
def test_static_sparse_examples_on_small_blocks(name, subs, H, L):
    v = example(name, **subs)
    compare(v, B=1, H=H, Lq=L, Lk=L, D=16)


def test_sparse_heads_as_shipped_block_64():
    # Three blocks of 64 (the last one partial): even heads see a band, odd the diagonal.
    compare(example("sparse_heads"), B=1, H=2, Lq=140, Lk=140, D=16)


def test_sparse_heads_differ_by_head():
    from attncc.arguments import Problem
    from attncc.semantics.reference import allowed_pairs
    v = example("sparse_heads", **{"block  64": "block 16", "int = 4": "int = 2"})
    allowed = allowed_pairs(v, Problem(1, 4, 4, 96, 96, 16, 16), {}, "cpu").expand(1, 4, 96, 96)
    assert torch.equal(allowed[0, 0], allowed[0, 2]) and torch.equal(allowed[0, 1], allowed[0, 3])
    assert not torch.equal(allowed[0, 0], allowed[0, 1])
    # Even heads: a causal band of two blocks; odd heads: every second block diagonal.
    assert allowed[0, 0, 40, 16] and not allowed[0, 0, 40, 0]
    assert allowed[0, 1, 40, 0] and not allowed[0, 1, 40, 16]


def test_fixed_pattern_is_the_papers_element_mask():
    # With l = local * block and c = summary * block the layout is exact (Child et al. 3c).
    from attncc.arguments import Problem
    from attncc.semantics.reference import allowed_pairs
    v = example("sparse_fixed", **{"block  128": "block 16"})
    L, l, c = 200, 4 * 16, 16
    got = allowed_pairs(v, Problem(1, 1, 1, L, L, 16, 16), {}, "cpu").expand(1, 1, L, L)[0, 0]
    i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
    want = (j <= i) & ((i // l == j // l) | (j % l >= l - c))
    assert torch.equal(got, want)


# ----------------------------------------------------------- runtime layouts from the comments
def test_vertical_slash_from_its_comment_recipe():
    gen = torch.Generator().manual_seed(5)
    H, L = 2, 140
    q, k = torch.randn(1, H, L, 16, generator=gen), torch.randn(1, H, L, 16, generator=gen)
    blocks = run_comment_code("vertical_slash", q=q, k=k, v=k, L=L, H=H, n_vert=1,
                              n_slash=1)["blocks"]
    assert blocks.shape == (H, 3, 3) and blocks.dtype == torch.bool
    assert blocks.diagonal(dim1=1, dim2=2).all()
    compare(example("vertical_slash"), B=1, H=H, Lq=L, Lk=L, D=16, inputs={"blocks": blocks})


def test_nsa_selection_from_its_comment_recipe():
    gen = torch.Generator().manual_seed(6)
    B, H, Hkv, L = 2, 2, 1, 140
    q = torch.randn(B, H, L, 16, generator=gen)
    k = torch.randn(B, Hkv, L, 16, generator=gen)
    selected = run_comment_code("nsa_selected", q=q, k=k, v=k, L=L, n_top=1)["selected"]
    assert selected.shape == (B, H, 3, 3) and selected.dtype == torch.bool
    assert not selected.triu(1).any(), "the selection must be causal"
    assert selected[..., 0].all() and selected.diagonal(dim1=2, dim2=3).all()
    # Per batch row and head, the selections differ (else this would not test much).
    assert len({tuple(s.flatten().tolist()) for s in selected.flatten(0, 1)}) > 1
    compare(example("nsa_selected"), B=B, H=H, Hkv=Hkv, Lq=L, Lk=L, D=16,
            inputs={"selected": selected})


def nsa_top_indices(seed=6, B=2, H=2, Hkv=1, L=140, n_top=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, 16, generator=gen)
    k = torch.randn(B, Hkv, L, 16, generator=gen)
    return q, k, run_comment_code("nsa_topk", q=q, k=k, v=k, L=L, n_top=n_top)["top"]


def test_nsa_top_k_indices_from_its_comment_recipe():
    B, H, Hkv, L = 2, 2, 1, 140  # 3 blocks of 64: every list of 8 is padded with -1
    q, k, top = nsa_top_indices(B=B, H=H, Hkv=Hkv, L=L)
    assert top.shape == (B, H, 3, 8) and top.dtype == torch.int32
    assert (top[..., 0, 1:] == -1).all(), "the first block can select only itself"
    assert ((top >= -1) & (top <= torch.arange(3).view(3, 1))).all(), "selections are causal"
    compare(example("nsa_topk"), B=B, H=H, Hkv=Hkv, Lq=L, Lk=L, D=16, inputs={"top": top})


def test_index_lists_and_bool_layout_give_the_same_attention():
    # Two of 9 blocks per list, at block 16: the same selection both ways, bit for bit.
    gen = torch.Generator().manual_seed(3)
    B, H, L, n = 2, 3, 140, 9
    top = torch.stack([torch.randperm(n, generator=gen)[:2] for _ in range(B * H * n)])
    top = top.view(B, H, n, 2).int()
    top[0, 1, 4, 1] = -1
    selected = torch.zeros(B, H, n, n, dtype=torch.bool)
    selected.scatter_(-1, top.clamp(min=0).long(), top >= 0)
    selected[0, 1, 4, top[0, 1, 4, 0]] = True
    by_index = example("nsa_topk", **{"block  64": "block 16", "8]": "2]"})
    by_bool = example("nsa_selected", **{"block  64": "block 16"})
    q, k, v = (torch.randn(B, H, L, 16, generator=gen).to(DEVICE) for _ in range(3))
    # The same tiles for both: tuned on a GPU, the bool layout may pick tiles larger than
    # its block (index lists may not), and another tile size sums in another order.
    tiles = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    a = attncc.compile(by_index, config=tiles)(q, k, v, top=top.to(DEVICE))
    b = attncc.compile(by_bool, config=tiles)(q, k, v, selected=selected.to(DEVICE))
    assert torch.equal(a, b)


def test_query_tile_lists_select_columns():
    # `qb in rows[h, kb]`: per key block, the query blocks that may read it.
    v = attncc.parse("attention t { input rows: i64[h, kb, 2] layout qb in rows[h, kb] block 16 }")
    gen = torch.Generator().manual_seed(4)
    rows = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(2 * 4)]).view(2, 4, 2)
    compare(v, B=1, H=2, Lq=45, Lk=61, D=16, inputs={"rows": rows})


@pytest.mark.parametrize("change,message", [
    (lambda t: t.index_fill_(-1, torch.tensor([1]), 0).index_fill_(-1, torch.tensor([0]), 0),
     r"input 'top' lists tile 0 twice in one list; each list must name distinct tiles"),
    (lambda t: t.fill_(3), r"input 'top' holds tile index 3, outside \[0, 3\)"),
    (lambda t: t.fill_(-2), r"input 'top' holds tile index -2, outside \[0, 3\).*-1 for padding"),
], ids=["repeated", "too_large", "below_padding"])
def test_bad_index_lists_name_the_input_and_the_value(change, message):
    spec = example("nsa_topk", **{"8]": "2]"})
    q, k, v = _qkv(H=2, L=140)
    top = change(torch.tensor([[0, -1], [0, 1], [1, 2]], dtype=torch.int32).expand(2, 2, 3, 2).clone())
    top = top.to(DEVICE)
    with pytest.raises(ValueError, match=message):
        attncc.compile(spec)(q, k, v, top=top)
    with pytest.raises(ValueError, match=message):
        attncc.reference(spec, q, k, v, top=top)


def test_index_list_checked_once_then_again_after_an_in_place_write():
    spec = example("nsa_topk", **{"block  64": "block 16", "8]": "2]"})
    kernel = attncc.compile(spec)
    q, k, v = _qkv(H=2, L=40)
    top = torch.tensor([[0, -1], [0, 1], [1, 2]], dtype=torch.int32, device=DEVICE).expand(2, 2, 3, 2).clone()
    kernel(q, k, v, top=top)
    kernel(q, k, v, top=top)
    assert len(kernel._checked_lists) == 1
    top[0, 0, 2, 1] = 1  # now tile 1 twice: the version counter moved, so it is checked
    with pytest.raises(ValueError, match="lists tile 1 twice"):
        kernel(q, k, v, top=top)


def test_kept_tables_read_no_index_list_under_inference_mode(monkeypatch):
    """Their lists were checked when they were built; each call re-read them (a host
    sync) where an inference tensor has no version counter to trust."""
    from attncc.runtime import kernel as kernel_module
    spec = example("nsa_topk", **{"block  64": "block 16", "8]": "2]"})
    kernel = attncc.compile(spec)
    with torch.inference_mode():
        q, k, v = _qkv(H=2, L=40)
        top = torch.tensor([[0, -1], [0, 1], [1, 2]], dtype=torch.int32,
                           device=DEVICE).expand(2, 2, 3, 2).clone()
        tables = kernel.tile_tables(q, k, v, top=top)
        reads = []
        real = kernel_module.check_index_list
        monkeypatch.setattr(kernel_module, "check_index_list", lambda *a: reads.append(a) or real(*a))
        outs = [kernel(q, k, v, top=top, tables=tables) for _ in range(3)]
        assert reads == []
        assert torch.equal(outs[0], kernel(q, k, v, top=top)) and len(reads) == 1


def test_inference_tensors_are_read_afresh_each_call():
    """Under torch.inference_mode the mask's tensors have no version counter: the calls
    crashed reading it. Tables and index-list checks are then not reused, so a write
    between two calls is seen (the second call agrees with the reference on the new
    values, and a bad list is refused)."""
    doc_kernel = attncc.compile(EXAMPLES / "document.attn")
    lists_kernel = attncc.compile(example("nsa_topk", **{"block  64": "block 16", "8]": "2]"}))
    q, k, v = _qkv(H=2, L=40)
    with torch.inference_mode():
        doc = (torch.arange(40, device=DEVICE) // 10).to(torch.int32)
        doc_kernel(q, k, v, doc_q=doc, doc_k=doc)
        doc[:25] = 0  # documents 0 and 1 merge
        out = doc_kernel(q, k, v, doc_q=doc, doc_k=doc)
        want = attncc.reference(doc_kernel.variant, q.double(), k.double(), v.double(),
                                doc_q=doc, doc_k=doc)
        assert torch.allclose(out.double(), want, atol=1e-4)
        top = torch.tensor([[0, -1], [0, 1], [1, 2]], dtype=torch.int32,
                           device=DEVICE).expand(2, 2, 3, 2).clone()
        lists_kernel(q, k, v, top=top)
        top[0, 0, 2, 1] = 1
        with pytest.raises(ValueError, match="lists tile 1 twice"):
            lists_kernel(q, k, v, top=top)


# ----------------------------------------------------------- tile tables the caller keeps
def test_kept_tables_give_the_same_results_and_are_built_once_per_tile_size(monkeypatch):
    kernel = attncc.compile(PER_HEAD)
    gen = torch.Generator().manual_seed(8)
    blocks = random_layout((3, 3, 3), 0.5, gen).to(DEVICE)
    q, k, v = (t.requires_grad_() for t in _qkv())
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    builds = []
    real = kernel.module.tile_tables
    monkeypatch.setattr(kernel.module, "tile_tables", lambda *a: builds.append(a[8:10]) or real(*a))
    for _ in range(3):  # three steps, forward and backward
        out = kernel(q, k, v, blocks=blocks, tables=tables)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert sorted(set(builds)) == sorted(builds) == sorted(tables.store)
    want = kernel(q, k, v, blocks=blocks)
    assert torch.equal(out, want)
    assert all(torch.equal(g, w) for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))))


def test_kept_tables_refuse_a_call_they_do_not_describe():
    kernel = attncc.compile(PER_HEAD)
    blocks = torch.ones(3, 3, 3, dtype=torch.bool, device=DEVICE)
    q, k, v = _qkv()
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    with pytest.raises(ValueError, match=r"built for batch 2, heads 3/3, len_q 40.*this call is batch 2, heads 3/3, len_q 33"):
        kernel(q[:, :, :33], k, v, blocks=blocks, tables=tables)
    with pytest.raises(ValueError, match=r"built from another 'blocks'"):
        kernel(q, k, v, blocks=blocks.clone(), tables=tables)
    blocks[0, 0, 0] = False  # written in place: the version counter moves
    with pytest.raises(ValueError, match=r"built from another 'blocks' \(or it was written in place"):
        kernel(q, k, v, blocks=blocks, tables=tables)
    other = attncc.compile(PER_BATCH)
    with pytest.raises(ValueError, match=r"belong to a kernel of variant 'l', whose tiles differ"):
        other(q, k, v, sel=torch.ones(2, 3, 3, 3, dtype=torch.bool, device=DEVICE), tables=tables)
    with pytest.raises(ValueError, match=r"tables must come from kernel.tile_tables"):
        kernel(q, k, v, blocks=blocks, tables={})


def test_kept_tables_serve_every_kernel_of_their_variant():
    """They were tied to one Kernel object: a second compile of the same spec (one per
    layer) refused them, and an evaluation kernel refused even its own."""
    spec = PER_HEAD.replace("block 16 }", "block 16 dropout 0.2 }")
    layer1, layer2 = attncc.compile(spec), attncc.compile(spec)
    blocks = random_layout((3, 3, 3), 0.5, torch.Generator().manual_seed(9)).to(DEVICE)
    q, k, v = _qkv()
    tables = layer1.tile_tables(q, k, v, blocks=blocks)
    want = layer1(q, k, v, blocks=blocks, dropout_seed=4)
    assert torch.equal(layer2(q, k, v, blocks=blocks, dropout_seed=4, tables=tables), want)
    evaluation = layer1.evaluation_kernel()
    own = evaluation.tile_tables(q, k, v, blocks=blocks)
    plain = evaluation(q, k, v, blocks=blocks)
    assert torch.equal(evaluation(q, k, v, blocks=blocks, tables=own), plain)
    assert torch.equal(layer1(q, k, v, blocks=blocks, training=False, tables=own), plain)


def test_analytic_variants_have_no_tables_to_keep():
    with pytest.raises(ValueError, match=r"no tile tables to keep: .*analytic"):
        attncc.compile("attention c { mask q >= k }").tile_tables(*_qkv())


@pytest.mark.parametrize("spec,L,block", [
    ("attention c { mask q >= k }", 100, 16),
    ("attention c { mask q >= k }", 64, 64),
    ("attention f { }", 50, 16),
    ("attention w { mask q >= k and q - k < 20 }", 90, 16),
    (PER_HEAD, 40, 16),
    ("attention d { input doc: i32[q] mask doc[q] == doc[k] }", 70, 16),
], ids=["causal", "causal_one_tile", "full", "window", "layout", "document"])
def test_density_is_the_fraction_of_tiles_with_a_pair_that_attends(spec, L, block):
    from attncc.arguments import Problem
    from attncc.tools.density import tile_visit_fraction
    from attncc.semantics.reference import allowed_pairs
    variant = attncc.parse(spec)
    gen = torch.Generator().manual_seed(9)
    inputs = {}
    if variant.inputs and variant.inputs[0].name == "blocks":
        inputs = {"blocks": random_layout((3, 3, 3), 0.4, gen, diagonal=False)}
    elif variant.inputs:
        inputs = {"doc": torch.sort(torch.randint(0, 3, (L,), generator=gen)).values.int()}
    q, k, v = _qkv(L=L)
    got = attncc.compile(variant).density(q, k, v, block=block,
                                          **{n: t.to(DEVICE) for n, t in inputs.items()})
    allowed = allowed_pairs(variant, Problem(2, 3, 3, L, L, 16, 16), inputs, "cpu")
    visited, total = tile_visit_fraction(allowed.expand(2, 3, L, L), block, block)
    assert got == pytest.approx(visited / total)
    assert 0 < got <= 1


def test_kept_tables_report_density_at_the_layout_block():
    kernel = attncc.compile(example("nsa_topk", **{"block  64": "block 16", "8]": "2]"}))
    q, k, v = _qkv(H=2, L=40)  # 3 tiles; lists of 2: tile 0 and the diagonal
    top = torch.stack([torch.zeros(3), torch.arange(3)], -1).int().expand(2, 2, 3, 2).clone().to(DEVICE)
    top[..., 0, 1] = -1
    tables = kernel.tile_tables(q, k, v, top=top)
    assert tables.density == pytest.approx(5 / 9)  # (0,0), (1,0), (1,1), (2,0), (2,2)


# ----------------------------------------------------------- per head, per batch, with masks
def random_layout(shape, density, gen, diagonal=True):
    lay = torch.rand(shape, generator=gen) < density
    if diagonal:
        n = min(shape[-2], shape[-1])
        lay[..., torch.arange(n), torch.arange(n)] = True
    return lay


def test_per_head_layout_block_16_with_empty_rows():
    # 45 queries and 61 keys: 3 x 4 blocks of 16, both lengths cut mid-block, no causal mask.
    v = attncc.parse("attention l { input blocks: bool[h, qb, kb] layout blocks[h, qb, kb] block 16 }")
    gen = torch.Generator().manual_seed(1)
    blocks = random_layout((3, 3, 4), 0.4, gen)
    blocks[1, 2] = False  # head 1's last query block sees nothing
    blocks[2] = torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    got, _ = compare(v, B=2, H=3, Lq=45, Lk=61, D=16, inputs={"blocks": blocks})
    out, lse = got[0], got[1]
    assert torch.all(lse[:, 1, 32:] == -math.inf) and torch.all(out[:, 1, 32:] == 0)
    assert torch.isfinite(lse[:, 0]).all()


def test_per_batch_layout_block_32_gqa():
    # Per batch row and head, with two query heads per key/value head: dK/dV sums over
    # query heads whose layouts differ. 70 tokens: 3 blocks of 32, the last one partial.
    v = attncc.parse("attention l { input sel: bool[b, h, qb, kb] layout sel[b, h, qb, kb] block 32 }")
    gen = torch.Generator().manual_seed(2)
    sel = random_layout((2, 4, 3, 3), 0.3, gen)
    assert not torch.equal(sel[0], sel[1])
    compare(v, B=2, H=4, Hkv=2, Lq=70, Lk=70, D=16, inputs={"sel": sel})


def test_tables_order_each_sides_programs_longest_first():
    # The grid's program i runs unit order[i] of its side (batch·head major, as the grid
    # counts them): every unit once, the most-visiting first, equals in the grid's order.
    # A key tile's program visits its GQA group's query tiles, so its count is their sum.
    # The heavy tiles are BigBird's global row and column, on the last batch row's last
    # head only: the grid's order would start them last.
    v = attncc.parse("attention l { heads 4 / 2 input sel: bool[b, h, qb, kb] "
                     "layout sel[b, h, qb, kb] block 16 }")
    B, H, group, n = 2, 4, 2, 5
    sel = random_layout((B, H, n, n), 0.12, torch.Generator().manual_seed(6))
    sel[1, 2:] = torch.eye(n, dtype=torch.bool)  # the last kv head: its diagonal,
    sel[1, 3, 0, :] = sel[1, 3, :, 0] = True  # and on its second query head, row and column 0
    t = attncc.compile(v).module.tile_tables(B, H, 75, 75, 0, 0, 16, {"sel": sel}, 16, 16, "cpu",
                                             group)
    rows = (t["row_full_count"] + t["row_part_count"]).expand(B, H, n).reshape(-1)
    cols = (t["col_full_count"] + t["col_part_count"]).expand(B, H, n)
    cols = cols.reshape(B, H // group, group, n).sum(2).reshape(-1)
    assert torch.equal(rows, sel.sum(-1).reshape(-1))  # (the counts are the layout's)
    for visits, order in ((rows, t["row_order"]), (cols, t["col_order"])):
        assert order.dtype == torch.int32
        assert sorted(order.tolist()) == list(range(visits.numel()))
        seen = visits[order.long()]
        assert torch.all(seen[:-1] >= seen[1:])
        ties = seen[:-1] == seen[1:]
        assert torch.all(order[:-1][ties] < order[1:][ties])
    assert t["row_order"][0] == (1 * H + 3) * n + 0  # batch 1, head 3, query tile 0
    assert t["col_order"][0] == (1 * (H // group) + 1) * n + 0  # its kv head 1, key tile 0


@pytest.mark.parametrize("Lq,Lk", [(70, 70), (50, 90)], ids=["square", "more_keys"])
def test_layout_with_causal_mask_block_32(Lq, Lk):
    v = attncc.parse("attention l { input blocks: bool[h, qb, kb] mask q >= k "
                     "layout blocks[h, qb, kb] block 32 }")
    gen = torch.Generator().manual_seed(3)
    nq, nk = math.ceil(Lq / 32), math.ceil(Lk / 32)
    compare(v, B=1, H=2, Lq=Lq, Lk=Lk, D=16,
            inputs={"blocks": random_layout((2, nq, nk), 0.5, gen)})


def test_layout_with_document_mask_block_16():
    # Packed documents (cut mid-block) and a per-head layout: both must hold.
    v = attncc.parse("attention l { input doc_q: i32[q] input doc_k: i32[k] "
                     "input blocks: bool[h, qb, kb] mask doc_q[q] == doc_k[k] and q >= k "
                     "layout blocks[h, qb, kb] block 16 }")
    gen = torch.Generator().manual_seed(4)
    doc = torch.zeros(53, dtype=torch.int32)
    doc[13:] += 1
    doc[40:] += 1
    inputs = {"doc_q": doc, "doc_k": doc, "blocks": random_layout((2, 4, 4), 0.5, gen)}
    compare(v, B=1, H=2, Lq=53, Lk=53, D=16, inputs=inputs)


# ------------------------------------------ kernel tiles larger than the layout's block
def tile(m, n):
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=1)


@pytest.mark.parametrize("spec,config,H,Hkv,Lq,Lk", [
    # Each 32x32 tile covers 2x2 blocks of 16, some on and some off.
    (PER_HEAD, tile(32, 32), 3, 3, 45, 61),
    # Causal inside the layout; 64x32 tiles over 16-blocks, more keys than queries.
    ("attention l { input blocks: bool[h, qb, kb] mask q >= k layout blocks[h, qb, kb] block 16 }",
     tile(64, 32), 2, 2, 50, 90),
    # A static pattern read per element, GQA summing dK/dV over differing heads.
    ("attention l { layout abs(qb - kb) <= h or kb == 0 block 16 }", tile(32, 64), 4, 2, 70, 70),
    # Per batch row and head, tiles of 64 over blocks of 32.
    (PER_BATCH.replace("block 16", "block 32"), tile(64, 64), 2, 2, 100, 77),
], ids=["per_head_32x32", "causal_64x32", "static_gqa_32x64", "per_batch_64x64"])
def test_tiles_larger_than_the_block_evaluate_the_layout_per_element(spec, config, H, Hkv, Lq, Lk):
    v = attncc.parse(spec)
    gen = torch.Generator().manual_seed(7)
    nq, nk = math.ceil(Lq / v.block), math.ceil(Lk / v.block)
    inputs = {}
    if "blocks" in spec:
        inputs["blocks"] = random_layout((H, nq, nk), 0.4, gen)
    if "sel" in spec:
        inputs["sel"] = random_layout((2, H, nq, nk), 0.4, gen)
    compare(v, B=2, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=16, inputs=inputs, config=config)


def test_index_list_layouts_refuse_tiles_larger_than_the_block():
    spec = ("attention l { input top: i32[b, h, qb, 2] layout kb in top[b, h, qb] block 16 }")
    with pytest.raises(ValueError, match="do not nest in the layout's blocks of 16"):
        attncc.compile(spec, config=tile(32, 16))
    attncc.compile(spec, config=tile(16, 16))  # within the block: fine


# ----------------------------------------------------------- bad layout tensors
@pytest.mark.parametrize("spec,name,bad,expected", [
    (PER_HEAD, "blocks", torch.ones(3, 3, dtype=torch.bool), "(3, 3, 3)"),           # no head axis
    (PER_HEAD, "blocks", torch.ones(3, 2, 2, dtype=torch.bool), "(3, 3, 3)"),        # floor, not ceil
    (PER_HEAD, "blocks", torch.ones(1, 3, 3, dtype=torch.bool), "(3, 3, 3)"),        # no broadcasting
    (PER_BATCH, "sel", torch.ones(1, 3, 3, 3, dtype=torch.bool), "(2, 3, 3, 3)"),    # one batch row
    (PER_BATCH, "sel", torch.ones(3, 3, 3, dtype=torch.bool), "(2, 3, 3, 3)"),       # no batch axis
], ids=["no_head_axis", "floor_blocks", "one_head", "one_batch_row", "no_batch_axis"])
def test_layout_of_the_wrong_shape_names_the_argument_and_expected_shape(spec, name, bad, expected):
    with pytest.raises(ValueError, match=rf"input '{name}' has shape .*expected {re.escape(expected)}"):
        attncc.compile(spec)(*_qkv(), **{name: bad})


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float32], ids=str)
def test_layout_of_the_wrong_dtype_names_the_argument(dtype):
    with pytest.raises(ValueError, match=rf"input 'blocks' has dtype {dtype}.*bool"):
        attncc.compile(PER_HEAD)(*_qkv(), blocks=torch.ones(3, 3, 3, dtype=dtype))


def test_missing_layout_names_the_declaration():
    with pytest.raises(ValueError, match=r"missing input 'blocks'.*bool\[h, qb, kb\]"):
        attncc.compile(PER_HEAD)(*_qkv())


# ----------------------------------------------------------- benchmarks/density_curve.py
def _density_curve():
    spec = importlib.util.spec_from_file_location("density_curve", ROOT / "benchmarks" / "density_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_density_curve_layouts_have_the_density_and_the_diagonal():
    dc = _density_curve()
    gen = torch.Generator().manual_seed(0)
    for d in dc.DENSITIES:
        lay = dc.random_layout(16, 128, d, gen)
        assert lay.shape == (16, 128, 128) and lay.dtype == torch.bool
        assert lay.diagonal(dim1=1, dim2=2).all()
        per_row = lay.sum(-1)
        assert (per_row == per_row[0, 0]).all(), "every row holds the same number of tiles"
        assert abs(lay.float().mean().item() - d) <= 0.5 / 128 + 1e-9
    assert dc.random_layout(2, 8, 0.0, gen).sum() == 2 * 8  # at least the diagonal


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_density_curve_flex_block_mask_is_the_same_layout():
    dc = _density_curve()
    gen = torch.Generator().manual_seed(1)
    H, nb, block = 2, 5, 16
    lay = dc.random_layout(H, nb, 0.3, gen)
    bm = dc.flex_block_mask(lay, block, seq_len=nb * block)
    dense = bm.to_dense()  # [1, H, nb, nb] counts of partial + full blocks
    assert torch.equal(dense[0].bool(), lay)
    # Same result as attncc's reference on the same layout (FlexAttention runs eagerly on CPU).
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = (torch.randn(1, H, nb * block, 16, generator=gen) for _ in range(3))
    got = flex_attention(q, k, v, block_mask=bm)
    variant = attncc.parse(dc.sparse_spec(block))
    want = attncc.reference(variant, q.double(), k.double(), v.double(), blocks=lay)
    assert (got.double() - want).abs().max() < 1e-4


def test_density_curve_model_table_json_and_plot(tmp_path):
    dc = _density_curve()
    dense = {"fwd_ms": 10.0, "bwd_ms": 25.0}
    rows = [dict(density=d, actual_density=d, attncc={"fwd_ms": 12 * d + 0.1, "bwd_ms": 30 * d + 0.3},
                 flex={"fwd_ms": 14 * d + 0.1, "bwd_ms": 33 * d + 0.3}) for d in dc.DENSITIES]
    assert dc.model_ms(10.0, 0.5, 128) == pytest.approx(1.2 * 0.5 * 10.0 + 10.0 / 128)
    for r in rows:
        dc.add_ratios(r, dense, n_blocks=128)
    assert rows[-1]["attncc"]["fwd_ratio"] == pytest.approx(6.1 / (6.0 + 10 / 128))
    table = dc.format_table(rows, dense)
    assert "density" in table and "0.030" in table and "dense" in table
    # A backend that failed prints as '-' and plots nothing.
    rows.append(dict(density=0.75, actual_density=0.75, attncc={"error": "boom"}, flex={"error": "x"}))
    rows[0]["attncc"]["kernel_fwd_ms"] = 0.05  # do_bench 0.46 ms: the host is the limit
    assert "host-bound: attncc fwd at d=0.03" in dc.format_table(rows, dense)
    failed = dc.format_table(rows, dense).splitlines()[-3]
    assert failed.startswith("   0.750") and failed.count("-") >= 8
    paths = dc.write_results(rows, dense, {"S": 16384}, str(tmp_path))
    assert (tmp_path / "density_curve.json").exists() and (tmp_path / "density_curve.png").exists()
    assert set(paths) == {str(tmp_path / "density_curve.json"), str(tmp_path / "density_curve.png")}


def test_density_curve_needs_a_gpu(capsys, monkeypatch):
    dc = _density_curve()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dc.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ---------------------------------------------------- benchmarks/archive/low_density.py
def test_low_density_edits_apply_to_the_template_and_keep_the_results(monkeypatch):
    # The edits are text substitutions of the generated module: each must still find
    # its text in what the template renders, and compute what the unedited module does
    # (on the GPU the benchmark times them; here they run under the interpreter).
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # density_curve
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "archive"))
    import low_density as ld
    from density_curve import random_layout, sparse_spec
    kernel = attncc.compile(sparse_spec(16))
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 70, 16, generator=gen).to(DEVICE) for _ in range(4))
    inputs = {"blocks": random_layout(2, 5, 0.4, gen).to(DEVICE)}
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    out, lse = kernel.module.forward(q, k, v, inputs, config=config)

    def results(module):
        if getattr(module, "PERSISTENT_PROGRAMS", None):
            module.PERSISTENT_PROGRAMS = 3  # fewer programs than (head, query tile) items
        got = list(ld.launcher(module, "fwd", q, k, v, out, lse, None, do, inputs, config)())
        return got + list(ld.launcher(module, "bwd+delta", q, k, v, out, lse, None, do, inputs,
                                      config)())

    want = results(kernel.module)
    for name in ld.EDITS:
        got = results(ld.edited_module(kernel.module, name))
        for a, b in zip(got, want):
            # Compiled, an edit may sum in another order (fused_delta's delta is summed in
            # the kernel): equal to fp32 rounding there, bit for bit under the interpreter.
            same = torch.equal(a, b) if DEVICE == "cpu" else torch.allclose(a, b, rtol=1e-4, atol=1e-5)
            assert same, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on one)")
def test_forward_and_backward_with_kept_tables_replay_in_a_cuda_graph():
    # At low density a call is bound by the host; a model captured in a CUDA graph loses
    # that time. Capture needs calls with no host sync: kept tables (their density is
    # read when built) and configs tuned before capture.
    kernel = attncc.compile(PER_HEAD)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, 200, 64, generator=gen).cuda().requires_grad_() for _ in range(3))
    do = torch.randn(1, 3, 200, 64, generator=gen).cuda()
    blocks = (torch.rand(3, 13, 13, generator=gen) < 0.5).cuda()  # 200 tokens: 13 blocks of 16
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    step = lambda: torch.autograd.grad(kernel(q, k, v, blocks=blocks, tables=tables), (q, k, v), do)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()  # tunes, builds the tables of each tile size
    torch.cuda.current_stream().wait_stream(side)
    eager = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


# ------------------------------------------------------------- chance(p, ...) in a layout
SEEDED = """attention seeded {
    heads 4 / 2
    param seed: int = 5
    layout qb == kb or chance(0.3, seed, b, h, qb, kb)
    block 16
}"""


@pytest.mark.parametrize("config", [None, dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)],
                         ids=["tiles-within-block", "tiles-over-several-blocks"])
def test_chance_layout_matches_the_reference(config):
    # Tiles larger than the block evaluate the layout per element in the kernel (the
    # Triton copy of the hash); within the block, the host's tables decide (its torch copy).
    compare(attncc.parse(SEEDED), B=2, Lq=70, Lk=45, D=16, config=config)


def test_chance_draws_the_same_blocks_everywhere_with_about_p_on():
    from attncc.random_blocks import chance
    kernel = attncc.compile(SEEDED)
    qb = torch.arange(300).view(-1, 1)
    kb = torch.arange(300).view(1, -1)
    here = chance(0.3, 5, 1, 2, qb, kb)
    from attncc.random_blocks import threshold
    assert torch.equal(kernel.module._h_chance(threshold(0.3), 5, 1, 2, qb, kb), here)
    assert abs(here.float().mean().item() - 0.3) < 0.01  # 90,000 draws
    assert not torch.equal(here, chance(0.3, 6, 1, 2, qb, kb)), "another seed, another draw"
    assert not torch.equal(here, chance(0.3, 5, 1, 3, qb, kb)), "another head, another draw"
    assert chance(0.0, 1, qb, kb).sum() == 0 and chance(1.0, 1, qb, kb).all()
    # The reference evaluates the layout through the same function.
    v = attncc.parse(SEEDED)
    from attncc.semantics.evaluate import evaluate
    got = evaluate(v.layout, {"params": {"seed": 5}, "b": 1, "h": 2, "qb": qb, "kb": kb})
    assert torch.equal(got, (qb == kb) | here)


def test_chance_density_is_what_the_kernel_reports():
    kernel = attncc.compile(SEEDED.replace("block 16", "block 32"))
    q = torch.randn(1, 4, 32 * 40, 16, device=DEVICE)
    k = v = torch.randn(1, 2, 32 * 40, 16, device=DEVICE)
    # 40 x 40 blocks per head: the diagonal plus 30% of the rest.
    assert abs(kernel.density(q, k, v) - (1 / 40 + 0.3 * 39 / 40)) < 0.03


@pytest.mark.parametrize("spec, words", [
    # Keys are hashed as 32 bits: 2**32 + 5 drew seed 5's blocks.
    ("attention s { param seed: int = 4294967301  layout chance(0.3, seed, qb, kb)  block 16 }",
     r"key 4294967301 is outside \[0, 2\*\*32\).*draw the blocks of 5"),
    ("attention s { layout chance(0.3, -1, qb, kb)  block 16 }", r"key -1 is outside"),
    # On a grid of 2**-24: 1e-8 was never on, 3e-8 read as 6e-8.
    ("attention s { layout chance(3e-8, qb, kb)  block 16 }", r"3e-08 reads as 5.96e-08"),
])
def test_chance_refuses_keys_and_probabilities_it_would_change(spec, words):
    with pytest.raises(attncc.SpecError, match=words):
        attncc.parse(spec)


def test_a_dropout_too_close_to_one_to_draw_unbiased_is_refused():
    """p = 1 - 1e-10 kept 4.7e-10 of the elements, scaled by 1e10: the output's
    expectation 4.7x the attention's."""
    with pytest.raises(attncc.SpecError, match=r"dropout 0.9999999999 keeps fewer than one "
                                               r"element in 65536.*at most 0.99998"):
        attncc.parse("attention d { dropout 0.9999999999 }")
    attncc.parse("attention d { dropout 0.99998 }")


def test_python_chance_builds_the_same_ir_as_the_text():
    @attncc.variant(heads=(4, 2), params={"seed": 5}, block=16)
    class seeded:
        def layout(b, h, qb, kb, seed):
            return (qb == kb) | attncc.chance(0.3, seed, b, h, qb, kb)
    assert seeded == attncc.parse(SEEDED)
    with pytest.raises(attncc.SpecError, match="1 to 5 integer keys"):
        attncc.chance(0.3)
