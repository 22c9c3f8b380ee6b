"""Generated kernels against the float64 reference: every example, awkward shapes, dtypes.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py) in float32
and float16 (the interpreter mis-multiplies bfloat16: tests/README.md); on a GPU the same
tests run natively. A result passes when its error against float64 is within twice
the error of the same computation done eagerly in the same dtype, plus twice the
dtype's resolution at the result's scale (`within_tolerance`).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import attncc
from attncc import ir
from attncc.backends.portable.codegen import generate
from attncc.errors import CallError
from attncc.semantics.reference import scale_value
from attncc.semantics.tolerance import (gradient_scales, input_gradient_scales, max_abs_error,
                                   within_tolerance)

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.attn"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------- helpers
def max_err(x, ref) -> float:
    err = max_abs_error(x, ref)
    assert not math.isnan(err), "kernel produced NaN"
    assert not math.isinf(err), "infinities differ from the reference"
    return err


def make_inputs(variant: ir.Variant, B, H, Lq, Lk, gen, device=DEVICE) -> dict:
    """Fresh random stand-ins for a variant's runtime inputs (documents as sorted ids,
    index lists as distinct random tiles padded with -1)."""
    from attncc.arguments import Problem, TORCH_DTYPES, axis_extent, random_index_lists
    p = Problem(B, H, H, Lq, Lk, 16, 16)
    lists = ir.index_lists(variant.layout)
    out = {}
    for decl in variant.inputs:
        shape = tuple(axis_extent(a, variant, p) for a in decl.axes)
        dtype = TORCH_DTYPES[decl.dtype]
        if decl.name in lists:
            t = random_index_lists(shape, axis_extent(lists[decl.name], variant, p), gen)
        elif decl.type == ir.BOOL:
            t = torch.rand(shape, generator=gen) < 0.4
        elif decl.type == ir.INT:
            if len(shape) == 1 and decl.axes[0] in ("q", "k"):
                t = torch.sort(torch.randint(0, 3, shape, generator=gen)).values
            else:
                t = torch.randint(0, 4, shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * 0.5
        out[decl.name] = t.to(dtype).to(device)
    return out


def compare(variant, *, B=2, H=None, Hkv=None, Lq=37, Lk=45, D=32, dtype=torch.float32,
            seed=0, q_offset=0, k_offset=0, inputs=None, config=None, Dv=None):
    """Run kernel, eager-in-dtype and float64 reference; assert every result is close.
    Dv: v's head dim (D unless given)."""
    gen = torch.Generator().manual_seed(seed)
    if variant.heads:
        H, Hkv = variant.heads.q, variant.heads.kv
    H = H or 3
    Hkv = Hkv or H
    q = torch.randn(B, H, Lq, D, generator=gen)
    k = torch.randn(B, Hkv, Lk, D, generator=gen)
    v = torch.randn(B, Hkv, Lk, Dv or D, generator=gen)
    do = torch.randn(B, H, Lq, Dv or D, generator=gen)
    if inputs is None:
        from attncc.arguments import Problem, axis_extent
        inputs = make_inputs(variant, B, H, Lq + q_offset, Lk + k_offset, gen)
    inputs = {n: t.to(DEVICE) for n, t in inputs.items()}
    learnable = [d.name for d in variant.learnable_inputs]
    # The tensors are (batch, heads, seq, dim) whatever their sizes: said, so that shapes
    # with more heads than positions (one token) are not refused as ambiguous.
    extra = dict(q_offset=q_offset, k_offset=k_offset, layout="bhsd")
    if variant.dropout:  # a seed for a variant without dropout is refused
        extra["dropout_seed"] = seed + 11

    def run(fn, cast):
        qkv = [t.to(DEVICE, cast).requires_grad_() for t in (q, k, v)]
        ins = {n: (t.to(cast if cast == torch.float64 else t.dtype).requires_grad_()
                   if n in learnable else t) for n, t in inputs.items()}
        # `normalize none` has no LSE (return_lse is refused): zeros stand for it.
        with_lse = variant.normalize != "none"
        out = fn(*qkv, return_lse=with_lse, **ins, **extra)
        out, lse = out if with_lse else (out, torch.zeros(out.shape[:3], dtype=cast))
        # A score that ignores s (`score 0.0`) leaves q and k out of the graph: zeros.
        grads = torch.autograd.grad(out, qkv + [ins[n] for n in learnable], do.to(DEVICE, cast),
                                    allow_unused=True, materialize_grads=True)
        return [out, lse, *grads]

    kernel = attncc.compile(variant, config=config)
    got = run(kernel, dtype)
    ref = run(lambda *a, **kw: attncc.reference(variant, *a, **kw), torch.float64)
    eager = run(lambda *a, **kw: attncc.reference(variant, *a, **kw), dtype)
    names = ["out", "lse", "dq", "dk", "dv"] + [f"d{n}" for n in learnable]
    scales = gradient_scales(q, k, ref[0], do, scale_value(variant, D), H // Hkv)
    scales.update(input_gradient_scales(variant, q, k, v, ref[0], do, inputs, q_offset, k_offset))
    for name, g, r, e in zip(names, got, ref, eager):
        err, eager_err = max_err(g, r), max_err(e, r)
        assert within_tolerance(err, eager_err, dtype, r, scales.get(name, 1.0)), (
            f"{variant.name} {name}: kernel error {err:.3g} vs eager {eager_err:.3g} "
            f"(B={B} H={H}/{Hkv} Lq={Lq} Lk={Lk} D={D} {dtype})")
    return got, ref


# ------------------------------------------------------------------- every example
# gqa_causal declares 32 / 8 heads: 20 s under the interpreter, so only under -m slow
# (GQA at small head counts runs by default in the shape sweep and the decode tests).
# relative_bias's 511-entry table takes 9 s; its reads run by default in
# test_relative_reads.py (T5, the clipped table and the 511-entry one against the
# reference and an independent formula, on both paths). gpt_oss_sinks runs by default in
# test_recipes.py and test_sinks.py, against gpt-oss's own formula.
SLOW_EXAMPLES = {"gqa_causal", "relative_bias", "gpt_oss_sinks"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow] if p.stem in SLOW_EXAMPLES else [])
                                  for p in EXAMPLES], ids=lambda p: p.stem)
def test_example_matches_reference_fp32(path):
    variant = attncc.parse_file(path)
    equal = any(isinstance(a, str) and a in ("q", "k") for i in variant.inputs for a in i.axes) \
        and any("doc" in i.name for i in variant.inputs)
    compare(variant, Lq=37, Lk=37 if equal else 45, D=32)


@pytest.mark.parametrize("name", ["causal", "softcap", "document", "alibi"])
def test_examples_in_float16(name):
    compare(attncc.parse_file(EXAMPLES[0].parent / f"{name}.attn"), Lq=40, Lk=40, D=16,
            dtype=torch.float16)


@pytest.mark.parametrize("scale", ["8.0", "-8.0"])
def test_a_scale_of_either_sign_matches_the_reference(scale):
    # A positive scale is folded into each weight's exponent, exp2(qk * qk_scale - m),
    # the row max taken over q·k and scaled once; a negative one flips which q·k gives
    # the max and keeps scaling first (analysis/signs.scale_is_positive). At |scale| 8
    # the scores span hundreds: a max taken on the wrong side overflows exp2.
    compare(attncc.parse(f"attention a {{ mask q >= k\n scale {scale} }}"), Lq=21, Lk=29, D=16)


# ------------------------------------------------------------------- shape sweep
CAUSAL = "attention causal { mask q >= k }"
WINDOW_SINKS = "attention ws { mask q >= k and (q - k < 9 or k < 3) }"


@pytest.mark.parametrize("Lq,Lk,D,H,Hkv", [
    (1, 1, 16, 3, 3),     # one token
    (1, 20, 32, 4, 2),    # one query, GQA
    (20, 1, 16, 2, 2),    # one key
    (33, 33, 80, 3, 1),   # MQA, head dim 80 (padded to 128)
    (17, 40, 96, 2, 2),   # len_q < len_k, head dim 96
    (40, 17, 16, 8, 2),   # len_q > len_k, GQA 4
    (12, 30, 16, 8, 1),   # GQA 8 (MQA)
    (16, 16, 192, 1, 1),  # head dim 192
    (19, 19, 256, 1, 1),  # head dim 256
], ids=lambda x: str(x))
@pytest.mark.parametrize("spec", [CAUSAL, WINDOW_SINKS], ids=["causal", "window_sinks"])
def test_shape_sweep(spec, Lq, Lk, D, H, Hkv):
    compare(attncc.parse(spec), B=1, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D)


@pytest.mark.parametrize("spec,reversed_kernel", [
    (CAUSAL, "attn_fwd"),  # forward and dQ launch their last query tiles first
    ("attention anti_causal { mask q <= k }", "attn_bwd_dkdv"),  # dK/dV its last key tiles
])
def test_kernels_launched_longest_tiles_first_cover_every_tile(spec, reversed_kernel):
    variant = attncc.parse(spec)
    source = generate(variant).source
    start = source.index(f"def {reversed_kernel}(")
    assert "longest first" in source[start:source.index("\n# ---", start)]
    compare(variant, B=1, H=2, Lq=70, Lk=53, D=16)


class _Grid:
    """tl / gl for a program's tile-order lines run in Python: one program of a 1D grid."""

    def __init__(self, pid: int, size: int):
        self.pid, self.size = pid, size

    program_id = lambda self, axis: self.pid
    num_programs = lambda self, axis: self.size
    cdiv = staticmethod(lambda a, b: -(-a // b))
    minimum, maximum = staticmethod(min), staticmethod(max)


def _tile_order_lines(source: str, kernel: str) -> str:
    """The lines of `kernel` that pick its program's tile and batch·head."""
    body = source[source.index(f"def {kernel}("):]
    body = body[body.index("pid = "):]
    return "\n".join(line.strip() for line in body[:body.index("longest first")].splitlines())


@pytest.mark.parametrize("backend", ["portable", "gluon"])
@pytest.mark.parametrize("spec,kernel,tile,bh", [
    (CAUSAL, "attn_fwd", "tile_q", "pid_bh"),
    ("attention anti_causal { mask q <= k }", "attn_bwd_dkdv", "tile_k", "pid_bhk"),
])
def test_longest_tiles_run_first_across_heads_in_groups_that_fit_l2(backend, spec, kernel, tile,
                                                                    bh):
    # The rendered lines run in Python over every program of grids whose heads fall in
    # one group, several, and several with a smaller last one: each (tile, batch·head)
    # is taken once; the groups hold the heads whose other side (K and V, or Q and dO, 2
    # bytes each) fits 32 MiB, in order; within a group the tiles run longest first with
    # the heads varying fastest.
    variant = attncc.parse(spec)
    if backend == "gluon":
        from attncc.backends.gluon.codegen import generate as generate_gluon
        source = generate_gluon(variant).source
    else:
        source = generate(variant).source
    lines = _tile_order_lines(source, kernel) + "  # longest first"
    for n_bh, n_tiles, length, dim in [(6, 5, 64, 128), (8, 7, 20000, 128), (7, 3, 70000, 64),
                                      (5, 4, 1 << 20, 128)]:
        group = 1
        while group < n_bh and (group + 1) * length * dim * 4 <= 32 * 2 ** 20:
            group += 1
        seen = []
        for pid in range(n_bh * n_tiles):
            own, other = ("len_q", "len_k") if tile == "tile_q" else ("len_k", "len_q")
            names = {"tl": _Grid(pid, n_bh * n_tiles), "gl": _Grid(pid, n_bh * n_tiles),
                     "HEAD_DIM": dim, "BLOCK_M": 16, "BLOCK_N": 16, own: n_tiles * 16,
                     other: length}
            exec(lines, {}, names)
            seen.append((names[bh], names[tile]))
        assert sorted(seen) == [(h, t) for h in range(n_bh) for t in range(n_tiles)]
        expected = []  # both variants' heavy tiles are their last ones
        for first in range(0, n_bh, group):
            heads = range(first, min(first + group, n_bh))
            expected += [(h, t) for t in reversed(range(n_tiles)) for h in heads]
        assert seen == expected, (n_bh, n_tiles, length, dim, group)


def test_bottom_right_causal_with_more_keys_than_queries():
    compare(attncc.parse("attention br { mask q + len_k - len_q >= k }"), Lq=20, Lk=50)


def test_offsets_place_a_chunk_in_a_longer_sequence():
    # A sequence split across devices: this chunk's queries sit at 40.., keys at 16..
    compare(attncc.parse("attention w { mask q >= k and q - k < 30 }"), Lq=24, Lk=40,
            q_offset=40, k_offset=16)


def test_layout_with_offsets_and_mask():
    v = attncc.parse("attention l { input blocks: bool[h, qb, kb] "
                     "layout blocks[h, qb, kb] or qb == kb block 16 mask q >= k }")
    compare(v, Lq=40, Lk=50, q_offset=16, k_offset=0)


def test_strided_tensors_in_sequence_major_layout():
    # (batch, seq, heads, dim) storage seen as (batch, heads, seq, dim): a common layout.
    v = attncc.parse(WINDOW_SINKS)
    gen = torch.Generator().manual_seed(5)
    q, k, w = (torch.randn(2, 29, 3, 32, generator=gen).to(DEVICE).transpose(1, 2).requires_grad_()
               for _ in range(3))
    do = torch.randn(2, 29, 3, 32, generator=gen).to(DEVICE).transpose(1, 2)
    out = attncc.compile(v)(q, k, w)
    grads = torch.autograd.grad(out, (q, k, w), do)
    ref = attncc.reference(v, q.double(), k.double(), w.double())
    rgrads = torch.autograd.grad(ref, (q, k, w), do.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for g, r in zip(grads, rgrads):
        assert (g.double() - r).abs().max() < 1e-5


# ------------------------------------------------------------------- semantics
def test_rows_with_no_allowed_key_give_zero_output_lse_minus_inf_and_zero_grads():
    v = attncc.parse("attention e { mask k > q + 10 }")  # the last rows see no key
    got, ref = compare(v, Lq=30, Lk=30)
    out, lse, dq = got[0], got[1], got[2]
    empty = torch.arange(30) >= 19
    assert torch.all(lse[:, :, empty] == -math.inf)
    assert torch.all(out[:, :, empty] == 0) and torch.all(dq[:, :, empty] == 0)
    assert torch.isfinite(lse[:, :, ~empty]).all()


def test_mask_that_is_never_true():
    v = attncc.parse("attention none { mask q < 0 }")
    got, _ = compare(v, Lq=10, Lk=12)
    assert torch.all(got[0] == 0) and torch.all(got[1] == -math.inf)


def test_backward_is_deterministic():
    v = attncc.parse(WINDOW_SINKS)
    kernel = attncc.compile(v)
    gen = torch.Generator().manual_seed(3)
    q, k, w = (torch.randn(2, 3, 41, 32, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    do = torch.randn(2, 3, 41, 32, generator=gen).to(DEVICE)
    first = torch.autograd.grad(kernel(q, k, w), (q, k, w), do)
    second = torch.autograd.grad(kernel(q, k, w), (q, k, w), do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", [
    "attention c { heads 4 / 2 mask q >= k }",
    "attention l { input on: bool[qb, kb] layout on[qb, kb] block 16 mask q >= k }",
])
def test_delta_computed_in_the_dq_kernel_equals_the_separate_pass(spec):
    # Sequential backwards let the dQ kernel compute delta = rowsum(dO * O) and store
    # it for dK/dV; the one-launch backward (table-driven variants) runs the separate
    # pass first. Both must give the same gradients, and every delta row must be written.
    v = attncc.parse(spec)
    kernel = attncc.compile(v)
    m = kernel.module
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 45, 32, generator=gen).to(DEVICE)
    k, w = (torch.randn(2, 4 if v.heads is None else 2, 45, 32, generator=gen).to(DEVICE)
            for _ in range(2))
    inputs = make_inputs(v, 2, 4, 45, 45, gen)
    out, lse = kernel(q, k, w, return_lse=True, **inputs)
    do = torch.randn(out.shape, generator=gen).to(DEVICE)
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    separate_delta = m.backward_delta(out, do)
    dk, dv = m.backward_dkdv(q, k, w, lse, separate_delta, do, inputs, config=config)
    dq, _ = m.backward_dq(q, k, w, lse, separate_delta, do, inputs, config=config)
    in_dq_delta = torch.full_like(separate_delta, float("nan"))
    dq2, _ = m.backward_dq(q, k, w, lse, in_dq_delta, do, inputs, config=config, out=out)
    assert torch.allclose(in_dq_delta, separate_delta, rtol=1e-6, atol=1e-6)
    dk2, dv2 = m.backward_dkdv(q, k, w, lse, in_dq_delta, do, inputs, config=config)
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(dk, m.backward_dkdv(q, k, w, lse, in_dq_delta * 0.5, do, inputs,
                                               config=config)[0])  # delta matters to dK


@pytest.mark.parametrize("spec, H, Hkv", [
    ("attention l { input on: bool[h, qb, kb] layout on[h, qb, kb] block 16 mask q >= k }", 3, 3),
    ("attention g { heads 4 / 2 input on: bool[qb, kb] layout on[qb, kb] block 16 "
     "learnable input bias: f32[h] score s + bias[h] dropout 0.2 }", 4, 2),
])
def test_one_launch_backward_equals_the_two_kernels(spec, H, Hkv):
    # Table-driven variants run dK/dV and dQ as two roles of one grid (attn_bwd). Each
    # program does what the kernel of its role does, so the results must match the two
    # kernels' (learnable inputs' gradients and GQA's query heads per kv head included),
    # and every element must be written (the outputs start uninitialised).
    v = attncc.parse(spec)
    kernel = attncc.compile(v)
    m = kernel.module
    assert m.USES_TABLES
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, H, 45, 32, generator=gen).to(DEVICE)
    k, w = (torch.randn(2, Hkv, 51, 32, generator=gen).to(DEVICE) for _ in range(2))
    inputs = make_inputs(v, 2, H, 45, 51, gen)
    seed = dict(dropout_seed=3) if v.dropout else {}  # refused without dropout
    out, lse = kernel(q, k, w, return_lse=True, **seed, **inputs)
    do = torch.randn(out.shape, generator=gen).to(DEVICE)
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    delta = m.backward_delta(out, do)
    dq, dk, dv, dinputs = m.backward_one_launch(q, k, w, lse, delta, do, inputs, seed=3,
                                                config=config)
    dk2, dv2 = m.backward_dkdv(q, k, w, lse, delta, do, inputs, seed=3, config=config)
    dq2, dinputs2 = m.backward_dq(q, k, w, lse, delta, do, inputs, seed=3, config=config)
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2), *zip(dinputs.values(), dinputs2.values())):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert set(dinputs) == {d.name for d in v.learnable_inputs}


def test_dropout_is_reproducible_from_its_seed():
    v = attncc.parse("attention d { mask q >= k dropout 0.3 }")
    kernel = attncc.compile(v)
    q, k, w = (torch.randn(1, 2, 33, 16, device=DEVICE) for _ in range(3))
    # Seed 1 on purpose: Triton specialises int arguments equal to 1 into constants,
    # which once made the dropout hash fail to compile on the GPU.
    a = kernel(q, k, w, dropout_seed=1)
    assert torch.equal(a, kernel(q, k, w, dropout_seed=1))
    assert not torch.equal(a, kernel(q, k, w, dropout_seed=6))
    ref = attncc.reference(v, q.double(), k.double(), w.double(), dropout_seed=1)
    assert (a.double() - ref).abs().max() < 1e-5


def test_training_false_turns_dropout_off():
    v = attncc.parse("attention d { input on: bool[qb, kb] layout on[qb, kb] block 16 "
                     "mask q >= k dropout 0.3 }")
    kernel = attncc.compile(v)
    gen = torch.Generator().manual_seed(4)
    q, k, w = (torch.randn(1, 2, 40, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    on = (torch.rand(3, 3, generator=gen) < 0.7).to(DEVICE)
    do = torch.randn(1, 2, 40, 16, generator=gen).to(DEVICE)
    out = kernel(q, k, w, on=on, training=False)  # no seed needed: nothing is dropped
    grads = torch.autograd.grad(out, (q, k, w), do)
    q64, k64, w64 = (t.detach().double().requires_grad_() for t in (q, k, w))
    ref = attncc.reference(v, q64, k64, w64, on=on, training=False)
    ref_grads = torch.autograd.grad(ref, (q64, k64, w64), do.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max() < 1e-4
    # The same as a variant written without dropout, and not what training gives.
    plain = attncc.reference(attncc.parse("attention d { input on: bool[qb, kb] layout on[qb, kb] "
                                           "block 16 mask q >= k }"), q64, k64, w64, on=on)
    assert torch.allclose(ref, plain)
    assert not torch.allclose(kernel(q, k, w, on=on, dropout_seed=1).double(), ref, atol=1e-3)
    # Tables built by the kernel serve its evaluation calls too.
    tables = kernel.tile_tables(q, k, w, on=on)
    assert torch.equal(kernel(q, k, w, on=on, training=False, tables=tables), out)
    assert kernel.evaluation_kernel() is kernel.evaluation_kernel()
    no_dropout = attncc.compile("attention c { mask q >= k }")
    assert no_dropout.evaluation_kernel() is no_dropout
    with pytest.raises(CallError, match="training must be True or False, got 'no'"):
        kernel(q, k, w, on=on, training="no")


def test_learnable_bias_gets_gradients():
    path = EXAMPLES[0].parent / "relative_bias.attn"
    v = attncc.parse_file(path)
    assert v.learnable_inputs, "the example should declare a learnable bias"
    got, _ = compare(v, Lq=30, Lk=30, H=2)
    assert got[-1].abs().sum() > 0


def test_generated_source_is_deterministic_and_standalone():
    from attncc.backends.portable.codegen import generate
    for path in EXAMPLES:
        v = attncc.parse_file(path)
        a, b = generate(v).source, generate(attncc.parse_file(path)).source
        assert a == b
        assert "import attncc" not in a and "from attncc" not in a
        compile(a, str(path), "exec")


def test_tile_tables_are_rebuilt_after_an_in_place_change():
    v = attncc.parse("attention d { input doc: i32[q] input dk: i32[k] "
                     "mask doc[q] == dk[k] and q >= k }")
    kernel = attncc.compile(v)
    q, k, w = (torch.randn(1, 2, 40, 16, device=DEVICE) for _ in range(3))
    doc = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    kernel(q, k, w, doc=doc, dk=doc)
    doc[20:] = 1  # in place: two documents now
    out = kernel(q, k, w, doc=doc, dk=doc)
    ref = attncc.reference(v, q.double(), k.double(), w.double(), doc=doc, dk=doc)
    assert (out.double() - ref).abs().max() < 1e-5


def test_outputs_are_fully_written(monkeypatch):
    # Poison every allocation: an element the kernel forgets to write stays NaN.
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like",
                        lambda *a, **kw: real_empty_like(*a, **kw).fill_(float("nan")))
    v = attncc.parse(WINDOW_SINKS)
    q, k, w = (torch.randn(1, 2, 37, 16, device=DEVICE).requires_grad_() for _ in range(3))
    out, lse = attncc.compile(v)(q, k, w, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, w), torch.randn_like(out))
    for t in (out, lse, *grads):
        assert not torch.isnan(t).any()


# ------------------------------------------------------------------- autograd rules
def test_backward_twice_fails_like_autograd():
    kernel = attncc.compile(CAUSAL)
    q, k, w = (torch.randn(1, 1, 8, 16, device=DEVICE).requires_grad_() for _ in range(3))
    out = kernel(q, k, w)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def test_backward_after_in_place_change_fails_like_autograd():
    kernel = attncc.compile(CAUSAL)
    q, k, w = (torch.randn(1, 1, 8, 16, device=DEVICE).requires_grad_() for _ in range(3))
    x = q * 1.0
    out = kernel(x, k, w)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ------------------------------------------------------------------- call errors
def qkv(B=1, H=2, Lq=8, Lk=8, D=16, dtype=torch.float32):
    return (torch.randn(B, H, Lq, D, dtype=dtype, device=DEVICE),
            torch.randn(B, H, Lk, D, dtype=dtype, device=DEVICE),
            torch.randn(B, H, Lk, D, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("case,make,match", [
    ("rank", lambda: (torch.randn(2, 8, 16, device=DEVICE),) + qkv()[1:], "q must have 4 dimensions"),
    ("dtype differs", lambda: (qkv()[0].half(),) + qkv()[1:], "same dtype"),
    ("float64", lambda: qkv(dtype=torch.float64), "float16, bfloat16 or float32"),
    ("head dim 8", lambda: qkv(D=8), "head dim 8 is not supported"),
    ("head dim 512", lambda: qkv(D=512), "head dim 512 is not supported"),
    ("heads not a multiple", lambda: (torch.randn(1, 3, 8, 16, device=DEVICE),) + qkv()[1:], "not a multiple"),
    ("v head dim", lambda: qkv()[:2] + (torch.randn(1, 2, 8, 8, device=DEVICE),), "v's head dim 8 is not supported"),
    ("k, v lengths", lambda: qkv()[:2] + (torch.randn(1, 2, 9, 16, device=DEVICE),), "same sequence length"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_tensors_raise_value_errors_naming_them(case, make, match):
    with pytest.raises(ValueError, match=match):
        attncc.compile(CAUSAL)(*make())


def test_cpu_tensors_without_interpreter_say_how_to_fix(monkeypatch):
    # Compiled first, with the interpreter on: a module imported without it would stay in
    # sys.modules as compiled Triton, and later tests of the same variant would get it.
    kernel = attncc.compile(CAUSAL)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(CallError, match="TRITON_INTERPRET=1"):
        kernel(*(t.cpu() for t in qkv()))


DOC = "attention d { input doc: i32[q] mask doc[q] == doc[k] }"


@pytest.mark.parametrize("inputs,match", [
    ({}, "missing input 'doc'"),
    ({"doc": torch.zeros(8, dtype=torch.int32, device=DEVICE), "extra": torch.zeros(1)}, "unexpected input 'extra'"),
    ({"doc": torch.zeros(9, dtype=torch.int32, device=DEVICE)}, "input 'doc' has shape"),
    ({"doc": torch.zeros(8, dtype=torch.int64, device=DEVICE)}, "input 'doc' has dtype torch.int64"),
    ({"doc": [0] * 8}, "must be a torch.Tensor"),
], ids=["missing", "extra", "shape", "dtype", "not a tensor"])
def test_bad_inputs_raise_value_errors_naming_them(inputs, match):
    with pytest.raises(ValueError, match=match):
        attncc.compile(DOC)(*qkv(), **inputs)


def test_layout_offsets_must_align_with_blocks():
    kernel = attncc.compile("attention l { layout qb >= kb block 16 }")
    with pytest.raises(ValueError, match="multiples of the layout's block 16"):
        kernel(*qkv(), q_offset=8)


def test_pinned_config_is_checked():
    with pytest.raises(ValueError, match="BLOCK_M must be a power of two"):
        attncc.compile(CAUSAL, config=dict(BLOCK_M=48, BLOCK_N=16, num_warps=4, num_stages=1))
