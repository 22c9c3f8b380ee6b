"""Normalisers other than softmax (`normalize sum | none` with `weight EXPR`).

The kernels run under the Triton interpreter (float32) and are held to the tolerance
rule against formulas written here from the papers, in float64, independently of
attncc.reference: Apple's sigmoid attention `sigmoid(q.k * scale + b) @ v` (forward and
the gradients of q, k, v and of a learnable per-head b), ReLU attention
`relu(s) / n @ v`, and `sum` of `exp(s)`, which is softmax. Then the corners: masked
pairs of a weight that is not 0 at -inf, rows that see no key, awkward shapes, decode
with 1 to 8 splits, varlen, context parallelism on 2 gloo ranks, and the refusals.
"""
from __future__ import annotations

import datetime
import math
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attncc
from attncc import distributed as cp
from attncc.backends.gluon import GluonBackend
from attncc.errors import CallError, SpecError
from attncc.semantics.decoding import decode_reference
from attncc.semantics.tolerance import max_abs_error, within_tolerance

SIGMOID = ("attention sigmoid_bias { learnable input bias: f32[h]  mask q >= k  "
           "normalize none  weight sigmoid(s + bias[h]) }")
RELU = "attention relu { normalize none  weight max(s, 0.0) / len_k }"
SUM_EXP = "attention sum_exp { mask q >= k  normalize sum  weight exp(s) }"
# 1 + relu(s) is 1 at s = -inf: a kernel that masked with -inf would add masked pairs.
ONE_PLUS_RELU = "attention one_plus_relu { mask q >= k  normalize sum  weight 1.0 + max(s, 0.0) }"
STRICT_SUM = "attention strict_sum { mask q > k  normalize sum  weight sigmoid(s) }"
STRICT_NONE = "attention strict_none { mask q > k  normalize none  weight 1.0 + sigmoid(s) }"


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)


def causal(Lq, Lk, strict=False):
    q, k = (torch.arange(n, device=DEVICE) for n in (Lq, Lk))
    return q.view(-1, 1) > k.view(1, -1) if strict else q.view(-1, 1) >= k.view(1, -1)


def check(got: dict, ref: dict, eager: dict):
    """Every entry within the tolerance rule (kernel float32 vs float64, twice the error
    of the same formula evaluated in float32, plus a unit of resolution)."""
    for name in ref:
        err, err_eager = max_abs_error(got[name], ref[name]), max_abs_error(eager[name], ref[name])
        assert not math.isnan(err), f"{name}: NaN"
        assert within_tolerance(err, err_eager, torch.float32, ref[name]), (
            f"{name}: kernel error {err:.3g} vs eager {err_eager:.3g}")


def run(fn, tensors: dict, learnable: tuple, dout, dtype) -> dict:
    """fn's output and the gradients of q, k, v and the learnable tensors, in dtype."""
    xs = {n: (t.to(dtype).requires_grad_(n in ("q", "k", "v") or n in learnable)
              if t.is_floating_point() else t) for n, t in tensors.items()}
    out = fn(**xs)
    wanted = [n for n in xs if xs[n].requires_grad]
    grads = torch.autograd.grad(out, [xs[n] for n in wanted], dout.to(dtype))
    return {"out": out, **{f"d{n}": g for n, g in zip(wanted, grads)}}


def compare(spec, formula, *, B=1, H=3, Lq=37, Lk=45, D=24, inputs=None, seed=0):
    """The kernel and attncc.reference against `formula(q, k, v, **inputs)`, float64."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"q": randn(gen, B, H, Lq, D), "k": randn(gen, B, H, Lk, D),
               "v": randn(gen, B, H, Lk, D), **{n: t.to(DEVICE) for n, t in (inputs or {}).items()}}
    variant = attncc.parse(spec)
    learnable = tuple(d.name for d in variant.learnable_inputs)
    dout = randn(gen, B, H, Lq, D)
    kernel = attncc.compile(variant)
    call = lambda q, k, v, **rest: kernel(q, k, v, **rest)
    by_reference = lambda q, k, v, **rest: attncc.reference(variant, q, k, v, **rest)
    truth = run(formula, tensors, learnable, dout, torch.float64)
    check(run(call, tensors, learnable, dout, torch.float32), truth,
          run(formula, tensors, learnable, dout, torch.float32))
    for name, value in run(by_reference, tensors, learnable, dout, torch.float64).items():
        torch.testing.assert_close(value, truth[name], rtol=1e-10, atol=1e-10, msg=name)
    return kernel


# ------------------------------------------------------------- against the papers
def test_sigmoid_attention_with_a_learnable_bias_is_apples_formula():
    # Ramapuram et al. 2024: sigmoid(q k^T * scale + b) @ v, causal, b per head near
    # -log(n); its gradient as well as q's, k's and v's.
    def formula(q, k, v, bias):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.view(1, -1, 1, 1)
        w = torch.where(causal(q.shape[2], k.shape[2]), torch.sigmoid(s), 0.0)
        return w @ v
    bias = torch.tensor([-math.log(45), -1.0, 0.5], dtype=torch.float64)
    compare(SIGMOID, formula, inputs={"bias": bias})


def test_relu_attention_is_relu_over_the_length():
    # Wortsman et al. 2023: relu(q k^T * scale) / n @ v, no mask.
    def formula(q, k, v):
        return torch.relu(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])) / k.shape[2] @ v
    compare(RELU, formula, Lq=45, Lk=37)


def test_sum_of_exp_is_softmax_and_its_lse():
    def formula(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~causal(q.shape[2], k.shape[2]), -math.inf)
        return torch.softmax(s, -1) @ v
    kernel = compare(SUM_EXP, formula, Lq=45, Lk=45)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(gen, 1, 2, 29, 16).float() for _ in range(3))
    _, lse = kernel(q, k, v, return_lse=True)
    softmax_lse = attncc.compile("attention c { mask q >= k }")(q, k, v, return_lse=True)[1]
    torch.testing.assert_close(lse, softmax_lse, rtol=1e-5, atol=1e-5)


def test_masked_pairs_add_nothing_where_the_weight_at_minus_infinity_is_not_zero():
    def formula(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        w = torch.where(causal(q.shape[2], k.shape[2]), 1.0 + torch.relu(s), 0.0)
        return w @ v / w.sum(-1, keepdim=True)
    compare(ONE_PLUS_RELU, formula, Lq=45, Lk=45)


@pytest.mark.parametrize("spec", [STRICT_SUM, STRICT_NONE], ids=["sum", "none"])
def test_rows_that_see_no_key_give_zero_without_nan(spec):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (randn(gen, 1, 3, 20, 32).float().requires_grad_() for _ in range(3))
    kernel = attncc.compile(spec)
    out = kernel(q, k, v)
    out.backward(torch.randn_like(out))
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))  # query 0 sees no key
    for t in (out, q.grad, k.grad, v.grad):
        assert bool(torch.isfinite(t).all())
    assert torch.equal(q.grad[:, :, 0], torch.zeros_like(q.grad[:, :, 0]))
    if "sum" in spec:
        lse = kernel(q, k, v, return_lse=True)[1]
        assert bool((lse[:, :, 0] == -math.inf).all()) and bool(torch.isfinite(lse[:, :, 1:]).all())


@pytest.mark.parametrize("B, H, Lq, Lk, D", [(1, 1, 1, 1, 16), (1, 5, 1, 33, 80), (2, 3, 17, 1, 16),
                                              pytest.param(1, 6, 65, 31, 40, marks=pytest.mark.slow)],
                         ids=["one_token", "one_query", "one_key", "off_tile"])
def test_awkward_shapes(B, H, Lq, Lk, D):
    def formula(q, k, v, bias):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias.view(1, -1, 1, 1)
        return torch.where(causal(q.shape[2], k.shape[2]), torch.sigmoid(s), 0.0) @ v
    bias = torch.linspace(-3.0, 1.0, H, dtype=torch.float64)
    compare(SIGMOID, formula, B=B, H=H, Lq=Lq, Lk=Lk, D=D, inputs={"bias": bias}, seed=B * Lq + Lk)


def test_a_learnable_input_in_both_score_and_weight_gets_the_whole_gradient():
    # d/d t of weight(score(s)), by the chain rule through both declarations.
    spec = ("attention both { learnable input t: f32[h]  score s * 0.5 + t[h]  normalize sum  "
            "weight sigmoid(s) * sigmoid(s) + abs(t[h]) }")

    def formula(q, k, v, t):
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])) * 0.5 + t.view(1, -1, 1, 1)
        w = torch.sigmoid(s) ** 2 + t.abs().view(1, -1, 1, 1)
        return w @ v / w.sum(-1, keepdim=True)
    compare(spec, formula, H=2, inputs={"t": torch.tensor([0.7, -1.3], dtype=torch.float64)})


# Learnable reads a weight owns per key, and a relative table under a weight: the dK/dV
# step adds their gradient under `sum` and `none` too, and the dQ step's diagonal sums of
# the table do not overwrite the weights it reads after them (w was the loop's variable).
def _scores(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize("normalize", ["sum", pytest.param("none", marks=pytest.mark.slow)])
def test_a_per_key_learnable_read_in_a_weight_gets_its_gradient(normalize):
    spec = (f"attention per_key {{ learnable input g: f32[b, h, k]  mask q >= k  "
            f"normalize {normalize}  weight sigmoid(s + g[b, h, k]) }}")

    def formula(q, k, v, g):
        w = torch.where(causal(q.shape[2], k.shape[2]), torch.sigmoid(_scores(q, k) + g[:, :, None, :]), 0.0)
        return w @ v / (w.sum(-1, keepdim=True) if normalize == "sum" else 1.0)
    gen = torch.Generator().manual_seed(3)
    compare(spec, formula, B=2, Lq=37, Lk=33,
            inputs={"g": torch.randn(2, 3, 33, generator=gen, dtype=torch.float64) * 2})


@pytest.mark.parametrize("normalize, weight", [
    ("none", "sigmoid"), ("sum", "exp"), pytest.param("sum", "sigmoid", marks=pytest.mark.slow)])
def test_a_relative_table_in_a_weight_leaves_dq_its_weights(normalize, weight):
    spec = (f"attention rel {{ learnable input tab: f32[h, 33]  normalize {normalize}  "
            f"weight {weight}(s + tab[h, min(max(q - k, -16), 16) + 16]) }}")

    def formula(q, k, v, tab):
        qi, ki = (torch.arange(n, device=q.device) for n in (q.shape[2], k.shape[2]))
        slot = ((qi[:, None] - ki[None, :]).clamp(-16, 16) + 16)
        w = getattr(torch, weight)(_scores(q, k) + tab[:, slot][None])
        return w @ v / (w.sum(-1, keepdim=True) if normalize == "sum" else 1.0)
    gen = torch.Generator().manual_seed(4)
    compare(spec, formula, Lq=40, Lk=21,
            inputs={"tab": torch.randn(3, 33, generator=gen, dtype=torch.float64)})


# ------------------------------------------------------------- decode, varlen, context parallelism
@pytest.mark.parametrize("spec, splits", [
    (SIGMOID, (1, 3)), (ONE_PLUS_RELU, (1, 3)),
    pytest.param(SIGMOID, range(1, 9), marks=pytest.mark.slow),
    pytest.param(ONE_PLUS_RELU, range(1, 9), marks=pytest.mark.slow)],
    ids=["none", "sum", "none_1_to_8", "sum_1_to_8"])
def test_decode_splits_merge(spec, splits):
    # `sum` merges its splits by their LSEs (log l), `none` adds them up.
    variant = attncc.parse(spec)
    kernel = attncc.compile(variant)
    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, n_q, cap, D = 3, 4, 2, 3, 96, 16
    q = randn(gen, B, Hq, n_q, D)
    k, v = randn(gen, B, Hkv, cap, D), randn(gen, B, Hkv, cap, D)
    lens = torch.tensor([96, 1, 50], dtype=torch.int32, device=DEVICE)
    inputs = ({"bias": torch.tensor([-2.0, -1.0, 0.0, 1.0], device=DEVICE)} if variant.inputs
              else {})
    with_lse = variant.normalize == "sum"

    def reference(dtype):
        got = decode_reference(variant, q.to(dtype), k.to(dtype), v.to(dtype),
                               cache_seqlens=lens, return_lse=with_lse, **inputs)
        return got if with_lse else (got, None)
    ref, eager = reference(torch.float64), reference(torch.float32)
    for n in splits:
        got = kernel.decode(q.float(), k.float(), v.float(), cache_seqlens=lens,
                            return_lse=with_lse, num_splits=n, **inputs)
        out, lse = got if with_lse else (got, None)
        err = max_abs_error(out, ref[0])
        assert not math.isnan(err) and within_tolerance(err, max_abs_error(eager[0], ref[0]),
                                                        torch.float32, ref[0]), (n, err)
        if with_lse:
            torch.testing.assert_close(lse, ref[1].float(), rtol=1e-5, atol=1e-5)


def test_varlen_runs_each_sequence_on_its_own():
    # ReLU's len_k is each sequence's length under varlen: against the formula per sequence.
    gen = torch.Generator().manual_seed(6)
    lengths = [5, 19, 1, 33]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                      device=DEVICE)
    total, H, D = sum(lengths), 2, 16
    q, k, v = (randn(gen, total, H, D) for _ in range(3))
    packed = attncc.varlen(RELU)
    out = packed(q.float(), k.float(), v.float(), cu, cu, max(lengths), max(lengths))
    for start, n in zip(cu[:-1].tolist(), lengths):
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        want = torch.relu(qs @ ks.transpose(-1, -2) / math.sqrt(D)) / n @ vs
        torch.testing.assert_close(out[start:start + n].transpose(0, 1).double(), want,
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(CallError, match="normalize none"):
        packed(q.float(), k.float(), v.float(), cu, cu, max(lengths), max(lengths), return_lse=True)


CP_SPECS = {
    "none": "attention cp_sigmoid { mask q >= k  normalize none  weight sigmoid(s - 1.0) }",
    "sum": "attention cp_sum { mask q > k  normalize sum  weight 1.0 + max(s, 0.0) }",
}
CP_LENGTH, CP_HEADS = 32, 2


def cp_problem(name):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k, v, do = (torch.randn(1, CP_HEADS, CP_LENGTH, 16, generator=gen) for _ in range(4))
    return q, k, v, do


def cp_ranks(rank: int, world: int, init_file: str, out_dir: str):
    """One rank: each normaliser's call on its zig-zag shard; rank 0 saves the results."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        for name, spec in CP_SPECS.items():
            q, k, v, do = cp_problem(name)
            sharding = cp.Sharding.of(None, "zigzag")
            local = [sharding.shard(t).requires_grad_() for t in (q, k, v)]
            out = cp.context_parallel_attention(attncc.compile(spec), *local, scheme="zigzag")
            out.backward(sharding.shard(do))
            result = {n: sharding.unshard(t) for n, t in
                      [("out", out.detach()), ("dq", local[0].grad), ("dk", local[1].grad),
                       ("dv", local[2].grad)]}
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{name}.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="gloo ranks on the CPU, under the interpreter")
def test_context_parallel_on_two_ranks(tmp_path):
    for spec in CP_SPECS.values():
        attncc.compile(spec)  # generate once, so the ranks load from the cache
    try:
        mp.spawn(cp_ranks, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    except Exception:
        errors = [p.read_text() for p in sorted(tmp_path.glob("error-*"))]
        pytest.fail("a rank failed:\n" + "\n".join(errors or ["(no traceback)"]))
    for name, spec in CP_SPECS.items():
        variant = attncc.parse(spec)
        q, k, v, do = cp_problem(name)
        tensors = {"q": q.double(), "k": k.double(), "v": v.double()}
        by_reference = lambda q, k, v: attncc.reference(variant, q, k, v)
        got = torch.load(tmp_path / f"{name}.pt")
        check(got, run(by_reference, tensors, (), do, torch.float64),
              run(by_reference, tensors, (), do, torch.float32))


# ------------------------------------------------------------- the language and its refusals
def test_printed_and_parsed_back_and_keys_apart():
    v = attncc.parse(SIGMOID)
    assert attncc.parse(str(v)) == v and "normalize none" in str(v)
    softmax = attncc.parse("attention sigmoid_bias { learnable input bias: f32[h]  mask q >= k  score s + bias[h] }")
    assert v.key() != softmax.key()
    assert v.key() != attncc.parse(SIGMOID.replace("none", "sum")).key()


@pytest.mark.parametrize("weight", ["s", "exp(s) - 1.0", "sigmoid(s) * t[h]", "tanh(s)",
                                    "max(s, 0.0) / (q - k)",
                                    "sqrt(s)"])  # NaN at s < 0, in kernel and reference alike
def test_sum_refuses_a_weight_it_cannot_prove_non_negative(weight):
    with pytest.raises(SpecError, match="provably >= 0"):
        attncc.parse(f"attention w {{ input t: f32[h]  normalize sum  weight {weight} }}")


@pytest.mark.parametrize("weight", ["exp(s)", "sigmoid(s - 3.0)", "max(s, 0.0) * max(s, 0.0)",
                                    "abs(s) / len_k", "s * s + 1.0", "sqrt(abs(s)) * exp(t[h])",
                                    "where(q >= k, exp(s), 0.5)",
                                    # % and // by a positive constant, log of at least 1:
                                    # refused as "can be negative" before.
                                    "sigmoid(s) * (q % 3)", "sigmoid(s) * (q // 3)",
                                    "sigmoid(s) * log(len_k * 1.0)", "exp(s) * floor(len_k / 2.0)"])
def test_sum_takes_a_weight_it_can_prove_non_negative(weight):
    attncc.parse(f"attention w {{ input t: f32[h]  normalize sum  weight {weight} }}")


def test_a_weight_of_positions_modulo_a_constant_against_its_formula():
    """sigmoid(s) · (q mod 3), summed to 1 per row: rows q ≡ 0 (mod 3) weigh every key 0,
    so they give 0 (an empty row); the others the weighted mean of v."""
    kernel = attncc.compile("attention mod3 { mask q >= k  normalize sum  weight sigmoid(s) * (q % 3) }")
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 3, 23, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    out = kernel(*(t.to(DEVICE, torch.float32) for t in (q, k, v))).cpu().double()
    rows = torch.arange(23)
    w = torch.sigmoid(q @ k.transpose(-1, -2) / 4) * (rows % 3)[:, None]
    w = w * (rows[:, None] >= rows[None, :])
    total = w.sum(-1, keepdim=True)
    want = torch.where(total > 0, (w @ v) / total.clamp_min(1e-300), 0.0)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("spec, words", [
    ("attention w { weight sigmoid(s) }", "`weight` needs `normalize sum` or `normalize none`"),
    ("attention w { normalize none }", "needs `weight EXPR`"),
    ("attention w { normalize sofmax  weight s }", "did you mean 'softmax'"),
    ("attention w { normalize none  weight s  dropout 0.1 }", "dropout"),
    ("attention w { normalize none  weight s + kb }", "only mean something in `layout`"),
    ("attention w { normalize none  weight q > k }", "must be a number"),
    ("attention w { param weight: float = 1.0  normalize none  weight s }", "keyword"),
])
def test_mistakes_are_named(spec, words):
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace("`", "`")):
        attncc.parse(spec)


@pytest.mark.parametrize("normalize", ["sum", "none"])
def test_a_sink_needs_a_softmax(normalize):
    # A sink is one more logit in a softmax's denominator: under sum or none there is
    # none to join, so the pair is refused (at the sink's line), in both front ends.
    spec = ("attention w {\n    learnable input sinks: f32[h]\n    sink sinks[h]\n"
            f"    normalize {normalize}\n    weight exp(s)\n}}")
    with pytest.raises(SpecError, match="softmax's denominator") as err:
        attncc.parse(spec)
    assert err.value.line == 3 and "remove the sink" in err.value.message
    assert "remove `normalize` and `weight`" in err.value.message
    with pytest.raises(SpecError, match=f"`sink` with `normalize {normalize}`"):
        @attncc.variant(inputs={"sinks": "f32[h]"}, learnable=["sinks"], normalize=normalize)
        class w:
            def sink(h, sinks):
                return sinks[h]

            def weight(s):
                return attncc.exp(s)
    # What the message says to write: softmax, spelled out or not, keeps the sink.
    softmax = attncc.parse(spec.replace(f"normalize {normalize}", "normalize softmax")
                           .replace("weight exp(s)", ""))
    plain = attncc.parse(spec.replace(f"normalize {normalize}", "").replace("weight exp(s)", ""))
    assert softmax == plain and softmax.key() == plain.key() and softmax.sink is not None


def test_return_lse_under_none_is_refused_everywhere():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, 8, 16, generator=gen).to(DEVICE) for _ in range(3))
    variant = attncc.parse(RELU)
    with pytest.raises(CallError, match="divides by nothing"):
        attncc.compile(variant)(q, k, v, return_lse=True)
    with pytest.raises(CallError, match="divides by nothing"):
        attncc.reference(variant, q, k, v, return_lse=True)
    with pytest.raises(CallError, match="divides by nothing"):
        attncc.compile(variant).decode(q, k, v, cache_seqlens=4, return_lse=True)


def test_the_decorator_spells_the_same_variant():
    @attncc.variant(inputs={"bias": "f32[h]"}, learnable=["bias"], normalize="none")
    class sigmoid_bias:
        def mask(q, k):
            return q >= k

        def weight(s, h, bias):
            return attncc.sigmoid(s + bias[h])
    assert sigmoid_bias == attncc.parse(SIGMOID) and sigmoid_bias.key() == attncc.parse(SIGMOID).key()
    with pytest.raises(SpecError, match="normalize sum"):
        attncc.variant(normalize="sum")(type("w", (), {"weight": staticmethod(lambda s: s)}))


@pytest.mark.parametrize("spec", [SIGMOID.replace("learnable ", ""), ONE_PLUS_RELU],
                         ids=["none", "sum"])
def test_gluon_kernels_accumulate_weights_without_a_max(spec):
    # Rendering only (tests/test_gluon_compile.py compiles them for sm_90): the weights
    # are summed as they are, with no row max to rescale by, and masked pairs are zeroed
    # with a where in masked tiles only: the forward's w, the backward's d w / d s (and
    # the owned learnable read's slope) before dP, so that no mask outlives the products
    # into full tiles (issue 33: it cost every tile about ten instructions a pair).
    from attncc.backends.gluon.codegen import generate
    variant = attncc.parse(spec)
    assert GluonBackend().supports(variant) is None
    source = generate(variant).source
    assert "alpha" not in source and "w = gl.where(allowed, w, 0.0)" in source
    assert ("l_i = l_i + gl.sum(w, 1)" in source) == (variant.normalize == "sum")
    assert "ruled_out" not in source and "gl.where(allowed, ds" not in source
    assert source.count("dw = gl.where(allowed, dw, 0.0)") == 2  # dQ, dK/dV
    assert source.count("ds = ds * dw") == 2
    # Sigmoid's weights: the fast form for these 16-bit kernels, and σ(1 − σ) read from w.
    sigmoid = "sigmoid" in spec
    assert ('DOT_PRECISION = gl.constexpr("tf32")' in source) == sigmoid
    assert (source.count("dw = ((1.0 + (-1.0 * w)) * w)  # d w / d s") == 2) == sigmoid


def test_gluon_backward_masks_an_owned_reads_slope_before_dp():
    # The learnable bias's gradient (owned by the dQ kernel) sums dS/dw times its slope,
    # zeroed at masked pairs with dw, in the masked tiles' block before dP is waited for.
    from attncc.backends.gluon.codegen import generate
    source = generate(attncc.parse(SIGMOID)).source
    dq = source[source.index("def attn_bwd_dq"):]
    masked = dq.index("            part0_slope = gl.where(allowed, part0_slope, 0.0)")
    assert dq.index("part0_slope = ((1.0 + (-1.0 * w)) * w)") < masked
    assert masked < dq.index("dp = warpgroup_mma_wait(0") < dq.index("part0_acc += gl.sum(ds * part0_slope, 1)")


# ------------------------------------------------------------- differential attention (recipe)
def _differential_module():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "differential_attention.py"
    spec = importlib.util.spec_from_file_location("differential_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def diff_transformer(x, wq, wk, wv, wo, lq1, lk1, lq2, lk2, lam_init, heads):
    """Ye et al. 2024, eq. 1-3, written from the paper: two causal softmax maps per head,
    their difference with λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, times V (2d wide),
    RMS-normed per head and scaled by 1 − λ_init, then W_O."""
    B, S, D = x.shape
    d = D // (2 * heads)
    q, k = (x @ wq.T).view(B, S, heads, 2, d), (x @ wk.T).view(B, S, heads, 2, d)
    v = (x @ wv.T).view(B, S, heads, 2 * d)
    future = ~causal(S, S)

    def softmax_map(i):
        s = torch.einsum("bshd,bthd->bhst", q[:, :, :, i], k[:, :, :, i]) / math.sqrt(d)
        return torch.softmax(s.masked_fill(future, -math.inf), -1)
    lam = torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lam_init
    o = (softmax_map(0) - lam * softmax_map(1)) @ v.transpose(1, 2)  # [B, H, S, 2d]
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + torch.finfo(o.dtype).eps)
    return ((1 - lam_init) * o).transpose(1, 2).reshape(B, S, D) @ wo.T


def test_differential_attention_recipe_is_the_diff_transformer():
    recipe = _differential_module()
    torch.manual_seed(8)
    layer = recipe.DifferentialAttention(d_model=64, n_heads=2, layer=3).to(DEVICE)
    with torch.no_grad():
        for p in (layer.lq1, layer.lk1, layer.lq2, layer.lk2):
            p.normal_(0, 0.3)  # a λ far from λ_init, so its gradient shows
    x = torch.randn(1, 21, 64, dtype=torch.float64).to(DEVICE)
    names = ["wq", "wk", "wv", "wo", "lq1", "lk1", "lq2", "lk2"]
    weights = {"wq": layer.wq.weight, "wk": layer.wk.weight, "wv": layer.wv.weight,
               "wo": layer.wo.weight, "lq1": layer.lq1, "lk1": layer.lk1, "lq2": layer.lq2,
               "lk2": layer.lk2}
    dout = torch.randn(1, 21, 64, dtype=torch.float64).to(DEVICE)

    def formula(dtype):
        leaves = {n: w.detach().to(dtype).requires_grad_() for n, w in weights.items()}
        xs = x.to(dtype).requires_grad_()
        out = diff_transformer(xs, *(leaves[n] for n in names), layer.lam_init, 2)
        grads = torch.autograd.grad(out, [xs] + [leaves[n] for n in names], dout.to(dtype))
        return dict(zip(["out", "dx"] + [f"d{n}" for n in names], [out, *grads]))
    xs = x.float().requires_grad_()
    out = layer(xs)
    grads = torch.autograd.grad(out, [xs] + [weights[n] for n in names], dout.float())
    got = dict(zip(["out", "dx"] + [f"d{n}" for n in names], [out, *grads]))
    check(got, formula(torch.float64), formula(torch.float32))
    assert float(got["dlq1"].abs().max()) > 0  # λ's vectors do receive gradients


def test_bench_compares_with_nothing_that_normalises_otherwise():
    # SDPA normalises by softmax: `attncc bench` must not time it as the same attention
    # (the softmax of the same mask is benched on its own; FlexAttention is skipped too).
    from attncc.tools import flex
    assert flex.sdpa_expressible(attncc.parse(RELU), 64, 64) is None
    assert flex.sdpa_expressible(attncc.parse("attention f { }"), 64, 64) == {"is_causal": False}


def test_a_document_mask_runs_the_one_launch_backward_on_tile_tables():
    # Tile tables (a mask that reads a tensor): the one-launch backward and its delta pass.
    spec = ("attention doc_sum { input doc: i32[q]  mask doc[q] == doc[k] and q >= k  "
            "normalize sum  weight sigmoid(s) * sigmoid(s) }")
    doc = torch.tensor([0] * 9 + [1] * 20 + [2] * 16, dtype=torch.int32)

    def formula(q, k, v, doc):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        allowed = (doc.view(-1, 1) == doc.view(1, -1)) & causal(45, 45)
        w = torch.where(allowed, torch.sigmoid(s) ** 2, 0.0)
        return w @ v / w.sum(-1, keepdim=True)
    compare(spec, formula, Lq=45, Lk=45, inputs={"doc": doc})


# ------------------------------------------------------------- sigmoid's cost on the GPU
def test_sigmoid_weights_take_one_mufu_op_on_nvidia_for_16_bit_calls():
    # Rendering only (tests/test_gluon_compile.py compiles the Gluon kernels' for sm_90,
    # test_gluon_kernels_accumulate_weights_without_a_max renders them): the pair weights call
    # _sigmoid, tanh.approx (one MUFU op) on an NVIDIA GPU for 16-bit calls and
    # tl.sigmoid (ex2 and a reciprocal) for fp32 ones; the backward's σ(1 − σ) reads the
    # weights w it computed rather than two more sigmoids; a softmax score keeps tl.sigmoid.
    from attncc.backends.portable.codegen import generate, variant_code
    source = generate(attncc.parse(SIGMOID)).source
    assert 'if APPROX_TANH and DOT_PRECISION != "ieee":' in source
    assert 'tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;"' in source
    # fwd, dQ, dK/dV and decode: each its weights, once
    assert source.count("w = _sigmoid(((s + tl.load(in_bias_ptr") == 4 and source.count("_sigmoid(") == 5
    sigma_of_w = "((1.0 + (-1.0 * w)) * w)"
    assert source.count(f"ds = ds * ({sigma_of_w})") == 2  # dQ, dK/dV
    assert f"g_val = ds * ({sigma_of_w})" in source  # the learnable bias's gradient
    assert source.count("tl.sigmoid(") == 1  # the fp32 branch of _sigmoid
    softmax = variant_code(attncc.parse("attention gate { score s * sigmoid(s) }"))
    assert "tl.sigmoid(" in softmax.score.text and "tl.sigmoid(" in softmax.d_score.text
    assert "_sigmoid" not in softmax.score.text + softmax.d_score.text


def test_a_score_tanh_takes_one_mufu_op_on_nvidia_for_16_bit_calls():
    # Rendering only (the slow tests below and tests/test_gluon_compile.py compile it for
    # sm_90): a softcap's tanh, in the score and its derivative, calls _tanh_fast, which
    # is tanh.approx on an NVIDIA GPU for 16-bit calls and the exact _tanh for fp32 ones;
    # the Gluon module, whose kernels pass no DOT_PRECISION, defines its own.
    from attncc.backends.gluon.codegen import generate as generate_gluon
    from attncc.backends.portable.codegen import generate, variant_code
    softcap = attncc.load("examples/softcap.attn")
    code = variant_code(softcap)
    assert "_tanh_fast(" in code.score.text and "DOT_PRECISION" in code.score.names
    assert "_tanh_fast(" in code.d_score.text and "_tanh(" not in code.d_score.text
    for source in (generate(softcap).source, generate_gluon(softcap).source):
        assert 'if APPROX_TANH and DOT_PRECISION != "ieee":' in source
        assert 'tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;"' in source
        assert "        return _tanh(x)" in source  # the fp32 branch
    assert 'DOT_PRECISION = gl.constexpr("tf32")' in generate_gluon(softcap).source
    # A variant with no tanh defines neither helper.
    plain = generate(attncc.load("examples/alibi.attn")).source
    assert "_tanh_fast" not in plain and "APPROX_TANH" not in plain


@pytest.mark.parametrize("spec", [
    "attention sig { param bias: float = -2.0  mask q >= k  normalize none  weight sigmoid(s + bias) }",
    "attention doc_none { input doc: i32[q]  mask doc[q] == doc[k]  normalize none  weight sigmoid(s) }"],
    ids=["dq then dkdv", "one launch"])
def test_none_computes_no_delta(spec, monkeypatch):
    # delta = rowsum(dO * O) is the gradient of a row's normaliser: `none` has none, so
    # its backward neither runs the delta pass (tile tables' one launch) nor has the dQ
    # kernel read O for it (out=None).
    kernel = attncc.compile(attncc.parse(spec))
    module, outs = kernel.module, []
    # The interpreter runs no inline assembly: it takes tl.sigmoid, as the tests above do.
    assert bool(module.APPROX_TANH) == (DEVICE == "cuda" and torch.version.hip is None)
    dq = module.backward_dq
    monkeypatch.setattr(module, "backward_delta", lambda *a, **k: pytest.fail("delta pass under none"))
    monkeypatch.setattr(module, "backward_dq", lambda *a, out=None, **k: outs.append(out) or dq(*a, out=out, **k))
    gen = torch.Generator().manual_seed(3)
    tensors = {n: randn(gen, 1, 2, 21, 16) for n in ("q", "k", "v")}
    if "doc" in spec:
        tensors["doc"] = torch.tensor([0] * 8 + [1] * 13, dtype=torch.int32, device=DEVICE)
    dout = randn(gen, 1, 2, 21, 16)
    got = run(lambda q, k, v, **rest: kernel(q, k, v, **rest), tensors, (), dout, torch.float32)
    truth = run(lambda q, k, v, **rest: attncc.reference(kernel.variant, q, k, v, **rest),
                tensors, (), dout, torch.float64)
    for name, value in truth.items():  # with no delta, the gradients are still right
        assert max_abs_error(got[name], value) < 1e-4, name
    assert all(o is None for o in outs) and (len(outs) > 0) == ("doc" not in spec)


# Compiles the portable forward of an example (argv[2]) for sm_90 on the CPU (benchmarks/gluon_compile.py's
# stand-in driver) with the GPU's APPROX_TANH and counts the MUFU ops in its SASS.
COMPILE_FORWARD = r'''
import collections, importlib.util, re, subprocess, sys, tempfile
from pathlib import Path
import torch, triton
sys.path.insert(0, "benchmarks")
import attncc
from attncc.backends.portable.codegen import generate
from gluon_compile import Sm90Driver, _compile_only

path = Path(sys.argv[1]) / "probe_fwd.py"
path.write_text(generate(attncc.load(sys.argv[2])).source)
spec = importlib.util.spec_from_file_location("probe_fwd", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.APPROX_TANH = triton.language.constexpr(True)  # an NVIDIA GPU's; this import saw none
triton.runtime.driver.set_active(Sm90Driver())
compiled = []
_compile_only(compiled)
nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
for dtype in (torch.bfloat16, torch.float32):
    q = torch.randn(1, 1, 256, 128, dtype=dtype)
    module.forward(q, q, q, {}, config={"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2})
    cubin = Path(sys.argv[1]) / "fwd.cubin"
    cubin.write_bytes(compiled[-1].asm["cubin"])
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True).stdout
    print(str(dtype), dict(collections.Counter(re.findall(r"MUFU\.(\w+)", sass))))
'''


def _forward_mufu_ops(tmp_path, example: str) -> tuple:
    """(bf16, fp32): the MUFU ops by kind in the SASS of `example`'s portable forward."""
    import subprocess
    import sys
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", COMPILE_FORWARD, str(tmp_path), example],
                            cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    return eval(counts["torch.bfloat16"]), eval(counts["torch.float32"])


@pytest.mark.slow
def test_sigmoid_forward_takes_one_mufu_op_per_weight_on_sm90(tmp_path):
    # bf16: one MUFU.TANH per weight and no ex2 (128x128 tiles on 256 threads: 64 weights
    # a thread, in each of the 3 loops); fp32: tl.sigmoid's ex2 and reciprocal.
    bf16, fp32 = _forward_mufu_ops(tmp_path, "examples/sigmoid_attention.attn")
    assert bf16.get("TANH") == 3 * 64 and "EX2" not in bf16 and bf16.get("RCP", 0) < 8, bf16
    assert "TANH" not in fp32 and fp32.get("EX2") == 3 * 64 and fp32.get("RCP", 0) >= 3 * 64, fp32


@pytest.mark.slow
def test_a_softcap_score_takes_one_mufu_op_for_its_tanh_on_sm90(tmp_path):
    # bf16: tanh.approx, one MUFU.TANH beside each weight's ex2 (64 scores a thread in
    # each of the 3 loops) and no reciprocal; fp32: _tanh's exp and division (an ex2 and
    # a reciprocal more per score), no MUFU.TANH.
    bf16, fp32 = _forward_mufu_ops(tmp_path, "examples/softcap.attn")
    assert bf16.get("TANH") == 3 * 64 and bf16.get("RCP", 0) < 8, bf16
    assert bf16["EX2"] - bf16["TANH"] < 64, bf16  # the row rescales' ex2s beside one a score
    assert "TANH" not in fp32 and fp32.get("RCP", 0) >= 64, fp32
    assert fp32["EX2"] >= 2 * bf16["TANH"], fp32


@pytest.mark.parametrize("weight", ["max(s, 0.0)", "min(s, 0.0) + 1.0", "max(0.0, s)"])
def test_a_tie_in_max_or_min_passes_no_gradient_in_kernel_and_reference(weight):
    """A zero row of q gives s = 0 exactly, a tie of max(s, 0.0): the kernels' derivative
    is a step that is 0 there, torch.maximum gave half to each side, so the reference's
    dq differed (0.46 against 0) and `attncc check` failed a correct kernel. The formula:
    ReLU's derivative 0 at 0, as torch.relu has it."""
    spec = f"attention tie {{ normalize none  weight {weight} }}"
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    q[:, :, 3] = 0.0
    dout = torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attncc.reference(attncc.parse(spec), *leaves)
    dq_ref = torch.autograd.grad(ref, leaves[0], dout)[0]
    s = q @ k.transpose(-1, -2) / 4
    relu_slope = {"max(s, 0.0)": s > 0, "max(0.0, s)": s > 0, "min(s, 0.0) + 1.0": s < 0}[weight]
    dq_formula = ((dout @ v.transpose(-1, -2)) * relu_slope / 4) @ k
    torch.testing.assert_close(dq_ref, dq_formula)
    kq = q.to(DEVICE, torch.float32).requires_grad_()
    out = attncc.compile(spec)(kq, k.to(DEVICE, torch.float32), v.to(DEVICE, torch.float32))
    dq = torch.autograd.grad(out, kq, dout.to(DEVICE, torch.float32))[0]
    torch.testing.assert_close(dq.double().cpu(), dq_formula, rtol=0, atol=1e-4)
