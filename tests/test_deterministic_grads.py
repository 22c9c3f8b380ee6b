"""Learnable inputs' gradients in a fixed order, with no atomics where a program owns
them (attncc/analysis/gradient_owners.py): the classification of reads, the generated
code (no atomic_add for the owned kinds), bit-identical gradients over repeated calls
and between the backward's two schedules, values against float64 autograd of the
reference and of independent formulas (T5's buckets, a learned ALiBi as a dense bias),
and `deterministic=True` refusing what would still add with atomics."""
import math

import pytest
import torch

import attncc
from attncc.analysis.gradient_owners import gradient_owners, learnable_reads
from attncc.errors import CallError
from attncc.frontend.parser import parse
from test_kernels import compare
from test_rounding import T5_BIDIRECTIONAL, T5_CAUSAL, t5_attention

pytestmark = pytest.mark.filterwarnings("ignore::attncc.errors.SpecWarning")
F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# One read of each kind a program owns; the comment names it.
OWNED = """attention owned {
    heads 4 / 2
    learnable input slopes: f32[h]
    learnable input w: f32[b, h, q]
    learnable input g: f32[b, h, k]
    learnable input bias: f32[b, h, q, k]
    learnable input r: f32[h, 16]
    mask q >= k
    score s + slopes[h] * (k - q) + w[b, h, q] + g[b, h, k] + bias[b, h, q, k]
        + r[h, min(max(q - k, 0), 15)]
}"""


def _kinds(spec: str) -> dict:
    v = parse(spec)
    return {attncc.ir.print_expr(o.load): (o.kind, o.relative)
            for o in gradient_owners(v, learnable_reads(v))}


def test_reads_are_classified_by_their_index():
    kinds = _kinds("""attention a {
        learnable input slopes: f32[h]
        learnable input w: f32[b, h, q]
        learnable input g: f32[h, k]
        learnable input bias: f32[b, h, q, k]
        learnable input sb: f32[q, k]
        learnable input r: f32[h, 64]
        learnable input z: f32[h]
        learnable input c: f32[2]
        score s * c[1] + slopes[h] * (k - q) + w[b, h, q] + g[h, k] + bias[b, h, q, k]
            + sb[q, k] + r[h, 32 + q - k] + r[0, q * 2 - k] + z[h // 2]
    }""")
    assert kinds == {
        "c[1]": ("broadcast", False), "slopes[h]": ("broadcast", False),
        "w[b, h, q]": ("rows", False), "g[h, k]": ("cols", False),
        "bias[b, h, q, k]": ("dense", False), "sb[q, k]": ("shared", False),
        "r[h, 32 + q - k]": ("table", True), "r[0, q * 2 - k]": ("table", False),
        "z[h // 2]": ("scattered", False)}
    # T5's bucket reads q and k through comparisons and abs of k - q: relative.
    assert _kinds(T5_BIDIRECTIONAL)[next(iter(_kinds(T5_BIDIRECTIONAL)))] == ("table", True)
    assert list(_kinds(T5_CAUSAL).values()) == [("table", True)]
    # Two reads of one dense input would both store to it: shared instead.
    assert set(_kinds("""attention a { learnable input x: f32[b, h, q, k]
        score s + x[b, h, q, k] * x[b, h, q, k] + x[b, h, k, q] }""").values()) == {("shared", False)}


@pytest.mark.parametrize("spec", [OWNED, T5_BIDIRECTIONAL, T5_CAUSAL,
                                  "attention t { learnable input t: f32[h] score s * t[h] }"],
                         ids=["owned", "t5", "t5_causal", "temperature"])
def test_owned_reads_use_no_atomics(spec):
    source = attncc.compile(spec).source
    assert "atomic_add" not in source
    assert "OWNED_READS" in source and "def atomic_reads" in source


def test_scattered_and_shared_reads_keep_atomics():
    source = attncc.compile("""attention a { learnable input z: f32[h]
        learnable input sb: f32[q, k] score s + z[h // 2] + sb[q, k] }""").source
    assert source.count("tl.atomic_add(") == 2


def _grads(kernel, q, k, v, do, inputs, fixed=None, **kw):
    """Gradients of q, k, v and `inputs` (on the device, back on the CPU); `fixed`:
    inputs that take none."""
    leaves = [t.detach().to(DEVICE).clone().requires_grad_() for t in (q, k, v, *inputs.values())]
    named = dict(zip(inputs, leaves[3:]))
    fixed = {n: t.to(DEVICE) for n, t in (fixed or {}).items()}
    out = kernel(*leaves[:3], layout="bhsd", **named, **fixed, **kw)
    return [g.cpu() for g in torch.autograd.grad(out, leaves, do.to(DEVICE))]


def _owned_problem(seed=3, B=2, Lq=21, Lk=30):
    gen = torch.Generator().manual_seed(seed)
    H, D = 4, 16
    q = torch.randn(B, H, Lq, D, generator=gen)
    k, v = (torch.randn(B, 2, Lk, D, generator=gen) for _ in range(2))
    do = torch.randn(B, H, Lq, D, generator=gen)
    inputs = {"slopes": torch.rand(H, generator=gen), "w": torch.randn(B, H, Lq + 9, generator=gen),
              "g": torch.randn(B, H, Lk, generator=gen),
              "bias": torch.randn(B, H, Lq + 9, Lk, generator=gen),
              "r": torch.randn(H, 16, generator=gen)}
    return q, k, v, do, inputs


CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("repeats, B, Lq, Lk", [(2, 1, 9, 14),
                                                pytest.param(20, 2, 21, 30, marks=pytest.mark.slow)])
def test_gradients_are_bit_identical_over_repeated_calls(repeats, B, Lq, Lk):
    kernel = attncc.compile(OWNED, config=CONFIG)
    q, k, v, do, inputs = _owned_problem(B=B, Lq=Lq, Lk=Lk)
    first = _grads(kernel, q, k, v, do, inputs, q_offset=9)
    for _ in range(repeats - 1):
        again = _grads(kernel, q, k, v, do, inputs, q_offset=9)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("B, Lq, Lk", [(1, 9, 14), pytest.param(2, 21, 30, marks=pytest.mark.slow)])
def test_owned_gradients_match_the_reference(B, Lq, Lk):
    # GQA 4/2, len_q != len_k, off the tiles, a query offset: every kind a program owns.
    compare(parse(OWNED), B=B, Lq=Lq, Lk=Lk, D=16, q_offset=9, config=CONFIG)


@pytest.mark.slow
def test_shared_and_scattered_gradients_match_the_reference():
    compare(parse("""attention a { heads 4 / 2
        learnable input sb: f32[q, k]
        learnable input z: f32[h]
        learnable input c: f32[3]
        score s * c[2] + sb[q, k] + z[h // 2] }"""), B=2, Lq=20, Lk=27, D=16, q_offset=3,
            k_offset=5)


DOCS = """attention docs {
    input doc: i32[q]
    learnable input slopes: f32[h]
    learnable input g: f32[b, h, k]
    learnable input r: f32[h, 16]
    mask doc[q] == doc[k] and q >= k
    score s + slopes[h] * (k - q) + g[b, h, k] + r[h, min(max(q - k, 0), 15)]
}"""


def test_one_launch_and_sequential_backwards_give_the_same_bits(monkeypatch):
    # Tile tables (a document mask): one portable launch (what the default, auto, runs
    # where no other backend takes both roles); ATTNCC_BACKWARD=sequential runs dQ then
    # dK/dV. Same config, so the same programs own the same partials, added in the same
    # order: the same bits under the interpreter. On a GPU the two schedules are different
    # compiled kernels, whose fp32 arithmetic ptxas contracts differently (an H200 read
    # differences of 3e-7 in dq and dk, dv equal, each schedule bit-identical over repeats).
    from attncc.runtime import settings
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 24, 16, generator=gen)
    k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(2))
    do = torch.randn(1, 2, 24, 16, generator=gen)
    doc = torch.tensor([0] * 7 + [1] * 12 + [2] * 5, dtype=torch.int32)
    inputs = dict(slopes=torch.rand(2, generator=gen), g=torch.randn(1, 2, 24, generator=gen),
                  r=torch.randn(2, 16, generator=gen))
    kernel = attncc.compile(DOCS, config=CONFIG)
    results = []
    for schedule, ran in (("one-launch", {"bwd"}), ("sequential", {"dq", "dkdv"})):
        monkeypatch.setattr(settings, "TABLES_BACKWARD", schedule)
        results.append(_grads(kernel, q, k, v, do, inputs, fixed={"doc": doc}))
        assert set(kernel.last_backward) == ran
    for a, b in zip(*results):
        if DEVICE == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * (1 + b.abs().max().item()))


# The fast suite checks T5's table gradient against the same formula in test_rounding.py.
@pytest.mark.slow
@pytest.mark.parametrize("spec, bidirectional, q_offset",
                         [(T5_BIDIRECTIONAL, True, 20), (T5_CAUSAL, False, 140)],
                         ids=["bidirectional", "causal"])
def test_t5_table_gradient_matches_an_independent_t5(spec, bidirectional, q_offset):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=F64) for n in (19, 150, 150))
    table = torch.randn(2, 32, generator=gen, dtype=F64) * 2
    do = torch.randn(1, 2, 19, 16, generator=gen, dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, table)]
    want = torch.autograd.grad(t5_attention(*leaves, bidirectional, q_offset), leaves, do)
    kernel = attncc.compile(spec)
    got = _grads(kernel, q.float(), k.float(), v.float(), do.float(), {"table": table.float()},
                 q_offset=q_offset)
    for name, g, w in zip(["dq", "dk", "dv", "dtable"], got, want):
        # Table entries sum dS over up to 19 x 150 pairs: the error scale is their |dS| sum.
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-5 * w.abs().max().item() + 2e-5,
                                   msg=lambda m: f"{name}: {m}")


# A clamped relative table: tiles far from the diagonal read one entry (their sum goes
# there), tiles near it many (summed per diagonal, then per entry).
CLAMPED = """attention clamped { learnable input r: f32[h, 9]
    score s + r[h, min(max(q - k, -4), 4) + 4] }"""


def test_relative_tables_sum_per_diagonal_without_a_loop():
    source = attncc.compile(CLAMPED).source
    assert "tl.gather(g_val" in source and "for entry in range" not in source
    # An index not through q - k alone keeps the loop over the entries a tile reads.
    other = attncc.compile("""attention a { learnable input r: f32[h, 64]
        score s + r[h, q * 2 - k] }""").source
    assert "tl.gather(g_val" not in other and "for entry in range" in other


@pytest.mark.parametrize("block_m, block_n, Lq, Lk", [
    (32, 16, 20, 64), pytest.param(16, 32, 37, 45, marks=pytest.mark.slow)])
def test_relative_table_gradient_matches_a_dense_gather(block_m, block_n, Lq, Lk):
    # Query tiles taller than key tiles (two diagonal classes per skewed row) and the
    # other way round (three), lengths off the tiles, len_q != len_k, 3 heads, a query
    # offset; at 20 x 64 the last key tile reads one entry, the others several.
    gen = torch.Generator().manual_seed(17)
    B, H, D, q_offset = 1, 3, 16, 8
    q = torch.randn(B, H, Lq, D, generator=gen, dtype=F64)
    k, v = (torch.randn(B, H, Lk, D, generator=gen, dtype=F64) for _ in range(2))
    do = torch.randn(B, H, Lq, D, generator=gen, dtype=F64)
    r = torch.randn(H, 9, generator=gen, dtype=F64)
    entry = ((torch.arange(Lq)[:, None] + q_offset - torch.arange(Lk)[None, :]).clamp(-4, 4) + 4)

    def dense(q, k, v, r):
        logits = q @ k.transpose(-1, -2) / math.sqrt(D) + r[:, entry]
        return torch.softmax(logits, -1) @ v

    leaves = [t.clone().requires_grad_() for t in (q, k, v, r)]
    want = torch.autograd.grad(dense(*leaves), leaves, do)
    kernel = attncc.compile(CLAMPED, config=dict(CONFIG, BLOCK_M=block_m, BLOCK_N=block_n))
    got = _grads(kernel, q.float(), k.float(), v.float(), do.float(), {"r": r.float()},
                 q_offset=q_offset)
    for name, g, w in zip(["dq", "dk", "dv", "dr"], got, want):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-5 * w.abs().max().item() + 2e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_learned_alibi_slopes_match_alibi_as_a_dense_bias():
    spec = """attention learned_alibi { learnable input slopes: f32[h]
        mask q >= k score s - slopes[h] * (q - k) }"""
    gen = torch.Generator().manual_seed(13)
    B, H, Lq, Lk, D = 2, 3, 23, 31, 16
    q = torch.randn(B, H, Lq, D, generator=gen, dtype=F64)
    k, v = (torch.randn(B, H, Lk, D, generator=gen, dtype=F64) for _ in range(2))
    do = torch.randn(B, H, Lq, D, generator=gen, dtype=F64)
    slopes = 2.0 ** -torch.arange(1, H + 1, dtype=F64)
    qpos = torch.arange(Lq)[:, None] + (Lk - Lq)  # bottom-right causal, via q_offset

    def dense(q, k, v, slopes):
        distance = (qpos - torch.arange(Lk)[None, :]).to(F64)
        bias = -slopes[:, None, None] * distance
        logits = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
        return torch.softmax(logits.masked_fill(distance < 0, float("-inf")), -1) @ v

    leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
    want = torch.autograd.grad(dense(*leaves), leaves, do)
    got = _grads(attncc.compile(spec), q.float(), k.float(), v.float(), do.float(),
                 {"slopes": slopes.float()}, q_offset=Lk - Lq)
    for name, g, w in zip(["dq", "dk", "dv", "dslopes"], got, want):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-5 * w.abs().max().item() + 2e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_deterministic_true_refuses_what_would_add_with_atomics():
    kernel = attncc.compile("""attention a { learnable input sb: f32[q, k]
        learnable input z: f32[h] score s + sb[q, k] + z[h // 2] }""")
    q, k, v = (torch.randn(1, 3, 8, 16, device=DEVICE) for _ in range(3))
    sb = torch.randn(8, 8, device=DEVICE, requires_grad=True)
    z = torch.randn(3, device=DEVICE, requires_grad=True)
    with pytest.raises(CallError, match=r"'sb'.*shared by several batch rows or heads"):
        kernel.module.SHARED_PARTIALS_BYTES = 0  # 3 heads' planes past twice the input's size
        try:
            kernel(q, k, v, sb=sb, z=z.detach(), deterministic=True)
        finally:
            kernel.module.SHARED_PARTIALS_BYTES = 1 << 28
    with pytest.raises(CallError, match=r"'z'.*`z\[h // 2\]`.*leave deterministic= out \(or False\)"):
        kernel(q, k, v, sb=sb, z=z, deterministic=True)
    # Within the budget the shared read has partials; an input that takes no gradient,
    # or a call without autograd, needs no refusal.
    kernel(q, k, v, sb=sb, z=z.detach(), deterministic=True)
    with torch.no_grad():
        kernel(q, k, v, sb=sb, z=z, deterministic=True)
    with pytest.raises(CallError, match=r"deterministic must be True or False"):
        kernel(q, k, v, sb=sb, z=z, deterministic=1)


def test_use_deterministic_algorithms_refuses_atomics_as_deterministic_true_does():
    """PyTorch's contract for the global flag: an op without a deterministic form raises
    (warns under warn_only). A learnable read added with atomics ran silently under it."""
    kernel = attncc.compile("attention a { learnable input z: f32[h] score s + z[h // 2] }")
    q, k, v = (torch.randn(1, 3, 8, 16, device=DEVICE) for _ in range(3))
    z = torch.randn(3, device=DEVICE, requires_grad=True)
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for argument in (None, False):
            with pytest.raises(CallError, match=r"use_deterministic_algorithms\(True\).*'z'"):
                kernel(q, k, v, z=z, deterministic=argument)
        kernel(q, k, v, z=z.detach())  # no gradient to add: nothing to refuse
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=r"use_deterministic_algorithms\(True\).*'z'"):
            kernel(q, k, v, z=z)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    kernel(q, k, v, z=z)  # the flag off: the default adds them with atomics, as documented


def test_deterministic_true_names_a_weights_read_too():
    # Under `normalize none` the learnable reads are in `weight`, not in a score: the
    # refusal must find them there (it once looked in the score alone and found none).
    kernel = attncc.compile("""attention a { learnable input z: f32[h] normalize none
        weight sigmoid(s + z[h // 2]) }""")
    q, k, v = (torch.randn(1, 3, 8, 16, device=DEVICE) for _ in range(3))
    z = torch.randn(3, device=DEVICE, requires_grad=True)
    with pytest.raises(CallError, match=r"'z'.*`z\[h // 2\]`.*leave deterministic= out \(or False\)"):
        kernel(q, k, v, z=z, deterministic=True)
