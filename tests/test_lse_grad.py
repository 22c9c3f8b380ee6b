"""Gradients through the returned LSE: `out, lse = kernel(..., return_lse=True)`.

The LSE differentiates as attncc.reference's does: d LSE_i / d s_ij = P_ij, so a loss
built on it (a merge of partial attentions, sinks applied outside, exp(lse)) gets the
reference's gradients in q, k, v and learnable inputs. Each case compares the kernel in
float32 with the float64 reference's autograd on the same loss; the closed form of the
LSE's gradient is checked on its own. Paths: the sequential backward (delta computed in
the dQ kernel), the one-launch backward of table-driven variants (delta from the
preprocess), both for a table-driven variant, varlen, the flash API and context
parallelism on two gloo ranks. On a GPU the kernels run on CUDA tensors (the reference
stays on the CPU), and a Hopper GPU also runs the Gluon dQ kernel's dLSE path.
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
from attncc.flash import flash_attn_func, flash_attn_varlen_func
from attncc.runtime import settings

D = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SPECS = {
    "causal": "attention causal { mask q >= k }",
    # Strict: query 0 attends to nothing (LSE -inf).
    "window": "attention window { param window: int = 6  mask q > k and q - k <= window }",
    "document": "attention document { input doc_q: i32[q]  input doc_k: i32[k]  "
                "mask doc_q[q] == doc_k[k] and q >= k }",
    "learnable": "attention slopes { learnable input slopes: f32[h]  mask q >= k  "
                 "score s + slopes[h] * (k - q) }",
    # Tile tables: the one-launch backward (delta from the preprocess).
    "layout": "attention band { input extra: bool[qb, kb]  mask q >= k  "
              "layout abs(qb - kb) <= 1 or kb == 0 or extra[qb, kb]  block 16 }",
    "dropout": "attention drop { mask q >= k  dropout 0.25 }",
    "softcap": "attention capped { score 5.0 * tanh(s / 5.0) }",
}


def close(got: dict, ref: dict, what: str):
    """Every gradient within fp32 rounding of the float64 one; NaN never passes."""
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        g = got[name]
        assert not torch.isnan(g).any(), f"{what}: NaN in the gradient of {name}"
        scale = 1.0 + r.abs().max().item()
        torch.testing.assert_close(g.double(), r, atol=2e-4 * scale, rtol=1e-4,
                                   msg=lambda m: f"{what}, d{name}: {m}")


def gradients(call, loss, leaves: dict, dtype, device="cpu") -> dict:
    """d loss / d leaves (on the CPU), where call(xs) -> (out, lse) and loss(xs, out, lse)
    -> scalar; zeros for a leaf the loss does not reach (v, in a loss of the LSE alone)."""
    xs = {n: t.to(device, dtype).requires_grad_() for n, t in leaves.items()}
    out, lse = call(xs)
    grads = torch.autograd.grad(loss(xs, out, lse), list(xs.values()), allow_unused=True,
                                materialize_grads=True)
    return {n: g.cpu() for n, g in zip(xs, grads)}


def on_kernel_device(fixed: dict) -> dict:
    return {n: t.to(DEVICE) for n, t in fixed.items()}


# ------------------------------------------------------------------ losses on the LSE
def lse_only(xs, out, lse):
    return (lse.masked_fill(lse == -math.inf, 0.0) * xs["u"]).sum()


def sinks(xs, out, lse):
    """A learnable per-head sink applied outside: out * sigmoid(lse - sink)."""
    gate = torch.sigmoid(lse - xs["sink"].view(1, -1, 1))
    return (out * gate.unsqueeze(-1) * xs["w"]).sum()


def exp_lse(xs, out, lse):
    """Unnormalised (sigmoid-attention-like) output: out * exp(lse) = sum_j exp(s_ij) v_j."""
    return (out * torch.exp(lse).unsqueeze(-1) * xs["w"]).sum()


LOSSES = {"lse_only": lse_only, "sinks": sinks, "exp_lse": exp_lse}


def make_case(variant, B, H, Hkv, Lq, Lk, gen, q_scale=1.0):
    """(leaves, fixed inputs): q, k, v, the losses' weights and learnable inputs as leaves.
    q_scale stretches the scores (large ones make rows nearly one-hot)."""
    leaves = {"q": torch.randn(B, H, Lq, D, generator=gen, dtype=torch.float64) * q_scale,
              "k": torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64),
              "v": torch.randn(B, Hkv, Lk, D, generator=gen, dtype=torch.float64),
              "u": torch.randn(B, H, Lq, generator=gen, dtype=torch.float64),
              "w": torch.randn(B, H, Lq, D, generator=gen, dtype=torch.float64),
              "sink": torch.randn(H, generator=gen, dtype=torch.float64)}
    fixed = {}
    for decl in variant.inputs:
        if decl.name == "slopes":
            leaves["slopes"] = torch.rand(H, generator=gen, dtype=torch.float64) * 0.5
        elif decl.name in ("doc_q", "doc_k"):
            n = Lq if decl.name == "doc_q" else Lk
            fixed[decl.name] = torch.sort(torch.randint(0, 3, (n,), generator=gen)).values.int()
        elif decl.name == "extra":
            fixed["extra"] = torch.rand(math.ceil(Lq / 16), math.ceil(Lk / 16), generator=gen) < 0.3
    return leaves, fixed


def compare(spec, loss, *, B=1, H=2, Hkv=None, Lq=37, Lk=45, seed=0, q_scale=1.0):
    kernel = attncc.compile(spec)
    variant = kernel.variant
    leaves, fixed = make_case(variant, B, H, Hkv or H, Lq, Lk, torch.Generator().manual_seed(seed),
                              q_scale)
    extra = dict(dropout_seed=11) if variant.dropout else {}

    def caller(fn, fixed):
        def call(xs):
            learnable = {d.name: xs[d.name] for d in variant.inputs if d.learnable}
            return fn(xs["q"], xs["k"], xs["v"], return_lse=True, **extra, **fixed, **learnable)
        return call
    got = gradients(caller(kernel, on_kernel_device(fixed)), loss, leaves, torch.float32, DEVICE)
    ref = gradients(caller(lambda *a, **kw: attncc.reference(variant, *a, **kw), fixed), loss,
                    leaves, torch.float64)
    close(got, ref, f"{variant.name}, {loss.__name__}")
    return got


# (spec, loss, shape): every mask kind and path with a loss of the LSE; lengths off the
# tile, len_q != len_k where the mask leaves every row a key.
CASES = [
    ("causal", "sinks", dict(H=3, Hkv=1, Lq=37, Lk=45)),  # GQA, 3 heads
    ("causal", "lse_only", dict(Lq=45, Lk=45, q_scale=8.0)),  # scores of tens: rows near one-hot
    ("window", "lse_only", dict(Lq=33, Lk=33)),  # query 0 attends to nothing
    ("document", "exp_lse", dict(Lq=40, Lk=40)),
    ("learnable", "sinks", dict(Lq=21, Lk=30)),  # the slopes' gradient carries dLSE
    ("layout", "sinks", dict(Lq=40, Lk=40)),  # tile tables: the one-launch backward
    ("dropout", "sinks", dict(Lq=25, Lk=31)),  # the LSE is before dropout
    ("softcap", "exp_lse", dict(Lq=1, Lk=19)),  # one token; a score with a derivative
]
SLOW_CASES = [(spec, loss, shape) for spec in SPECS for loss in LOSSES
              for shape in (dict(Lq=37, Lk=45), dict(H=6, Hkv=2, Lq=50, Lk=17))]


@pytest.mark.parametrize("spec, loss, shape", CASES, ids=[f"{s}-{l}" for s, l, _ in CASES])
def test_lse_gradient_matches_reference(spec, loss, shape):
    compare(SPECS[spec], LOSSES[loss], **shape)


@pytest.mark.slow
@pytest.mark.parametrize("spec, loss, shape", SLOW_CASES,
                         ids=[f"{s}-{l}-{i}" for i, (s, l, _) in enumerate(SLOW_CASES)])
def test_lse_gradient_matches_reference_sweep(spec, loss, shape):
    compare(SPECS[spec], LOSSES[loss], seed=len(spec) + len(loss), **shape)


def test_table_variant_sequential_backward_carries_the_lse_gradient(monkeypatch):
    """A table-driven variant's dQ-then-dK/dV schedule: delta (minus dLSE) from the dQ kernel."""
    monkeypatch.setattr(settings, "TABLES_BACKWARD", "sequential")
    compare(SPECS["layout"], sinks, Lq=40, Lk=40, seed=3)


def test_lse_gradient_equals_its_closed_form():
    """sum_i u_i LSE_i: dq_i = scale u_i sum_j P_ij k_j, dk_j = scale sum_i u_i P_ij q_i,
    dv = 0, with P a plain masked softmax written here (not the reference)."""
    kernel = attncc.compile(SPECS["causal"])
    gen = torch.Generator().manual_seed(5)
    Lq, Lk = 19, 35
    q, k, v = (torch.randn(1, 2, n, D, generator=gen) for n in (Lq, Lk, Lk))
    u = torch.randn(1, 2, Lq, generator=gen)
    xs = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    _, lse = kernel(*xs, return_lse=True)
    dq, dk, dv = (g.cpu() for g in torch.autograd.grad((lse * u.to(DEVICE)).sum(), xs))
    scale = 1 / math.sqrt(D)
    qd, kd, ud = q.double(), k.double(), u.double()
    s = qd @ kd.transpose(-1, -2) * scale
    s = s.masked_fill(torch.arange(Lq)[:, None] < torch.arange(Lk)[None, :], -math.inf)
    p = torch.softmax(s, dim=-1)
    torch.testing.assert_close(dq.double(), scale * ud.unsqueeze(-1) * (p @ kd),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk.double(), scale * (p * ud.unsqueeze(-1)).transpose(-1, -2) @ qd,
                               atol=1e-5, rtol=1e-5)
    assert torch.all(dv == 0)


def test_rows_with_no_key_take_no_lse_gradient():
    """An empty row's LSE is the constant -inf: its gradient, even NaN or inf (as a loss
    like lse * 0 gives there), reaches nothing, as in the reference."""
    kernel = attncc.compile(SPECS["window"])
    variant = kernel.variant
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 24, D, generator=gen, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, 2, 24, D, generator=gen, dtype=torch.float64)
    dlse = torch.randn(1, 2, 24, generator=gen, dtype=torch.float64)
    dlse[:, 0, 0], dlse[:, 1, 0] = math.nan, math.inf  # query 0 attends to nothing

    def grads(fn, dtype, device="cpu"):
        xs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*xs, return_lse=True)
        assert torch.all(lse[:, :, 0] == -math.inf)
        g = torch.autograd.grad((out, lse), xs, (dout.to(device, dtype), dlse.to(device, dtype)))
        return {n: t.cpu() for n, t in zip("qkv", g)}
    got = grads(kernel, torch.float32, DEVICE)
    ref = grads(lambda *a, **kw: attncc.reference(variant, *a, **kw), torch.float64)
    close(got, ref, "window with NaN/inf dLSE on the empty row")
    assert torch.all(got["q"][:, :, 0] == 0)


def test_chunked_attention_merged_through_the_lse():
    """Keys split in two calls (k_offset), merged by the user through their LSEs: the
    gradients equal one call's over all keys, and the reference's of the same merge."""
    kernel = attncc.compile(SPECS["causal"])
    gen = torch.Generator().manual_seed(2)
    Lq, Lk, split = 30, 30, 13
    leaves = {"q": torch.randn(1, 3, Lq, D, generator=gen, dtype=torch.float64),
              "k": torch.randn(1, 3, Lk, D, generator=gen, dtype=torch.float64),
              "v": torch.randn(1, 3, Lk, D, generator=gen, dtype=torch.float64)}
    w = torch.randn(1, 3, Lq, D, generator=gen, dtype=torch.float64)

    def merged(fn):
        def call(xs):
            q, k, v = xs["q"], xs["k"], xs["v"]
            o1, l1 = fn(q, k[:, :, :split], v[:, :, :split], return_lse=True)
            o2, l2 = fn(q, k[:, :, split:], v[:, :, split:], return_lse=True, k_offset=split)
            lse = torch.logaddexp(l1, l2)  # every query sees key 0: finite
            out = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
            return out, lse
        return call
    loss = lambda xs, out, lse: (out * w.to(out.device, out.dtype)).sum()
    ref_fn = lambda *a, **kw: attncc.reference(kernel.variant, *a, **kw)
    got = gradients(merged(kernel), loss, leaves, torch.float32, DEVICE)
    close(got, gradients(merged(ref_fn), loss, leaves, torch.float64), "chunked merge")
    whole = lambda xs: ref_fn(xs["q"], xs["k"], xs["v"], return_lse=True)
    close(got, gradients(whole, loss, leaves, torch.float64), "chunked merge vs one call")


def test_unread_lse_passes_no_gradient_to_the_kernels(monkeypatch):
    """The common case costs nothing more: with the LSE returned but not in the loss, the
    dQ kernel gets dlse=None (no tensor of zeros to read)."""
    kernel = attncc.compile(SPECS["causal"])
    seen = []
    backward_dq = kernel.module.backward_dq

    def recording(*args, dlse=None, **kw):
        seen.append(dlse)
        return backward_dq(*args, dlse=dlse, **kw)
    monkeypatch.setattr(kernel.module, "backward_dq", recording)
    q, k, v = (torch.randn(1, 2, 20, D, device=DEVICE, requires_grad=True) for _ in range(3))
    out, lse = kernel(q, k, v, return_lse=True)
    out.sum().backward()
    assert seen and all(d is None for d in seen)
    seen.clear()
    out, lse = kernel(q, k, v, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert seen and all(d is not None for d in seen)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on Hopper GPUs")
def test_gluon_dq_kernel_carries_the_lse_gradient():
    """backend="gluon": the Gluon dQ kernel computes delta - dLSE itself (DELTA_FROM_O,
    HAS_DLSE) for its dK/dV kernel; fp16, a head dim it takes."""
    kernel = attncc.compile(SPECS["causal"], backend="gluon")
    gen = torch.Generator().manual_seed(12)
    Lq, Lk, dim = 200, 333, 64
    leaves = {"q": torch.randn(1, 4, Lq, dim, generator=gen, dtype=torch.float64),
              "k": torch.randn(1, 2, Lk, dim, generator=gen, dtype=torch.float64),
              "v": torch.randn(1, 2, Lk, dim, generator=gen, dtype=torch.float64),
              "sink": torch.randn(4, generator=gen, dtype=torch.float64),
              "w": torch.randn(1, 4, Lq, dim, generator=gen, dtype=torch.float64)}
    call = lambda fn: lambda xs: fn(xs["q"], xs["k"], xs["v"], return_lse=True)
    got = gradients(call(kernel), sinks, leaves, torch.float16, DEVICE)
    assert kernel.last_backward["dq"][0] == "gluon", kernel.last_backward
    ref = gradients(call(lambda *a, **kw: attncc.reference(kernel.variant, *a, **kw)), sinks,
                    leaves, torch.float64)
    for name, r in ref.items():  # fp16 rounding: relative to each gradient's size
        err = (got[name].double() - r).abs().max().item()
        assert err <= 2e-2 * (1.0 + r.abs().max().item()), f"d{name}: error {err}"


@pytest.mark.slow
def test_lse_gradient_under_torch_compile():
    """The backward op takes dlse as an optional tensor: traced by AOTAutograd alike."""
    kernel = attncc.compile(SPECS["causal"])
    gen = torch.Generator().manual_seed(13)
    leaves, _ = make_case(kernel.variant, 1, 2, 2, 21, 21, gen)

    def call(fn):
        return lambda xs: fn(xs["q"], xs["k"], xs["v"], return_lse=True)

    def compiled(xs):
        step = lambda q, k, v: kernel(q, k, v, return_lse=True)
        return torch.compile(step, backend="aot_eager", fullgraph=True)(xs["q"], xs["k"], xs["v"])
    ref = gradients(call(lambda *a, **kw: attncc.reference(kernel.variant, *a, **kw)), sinks,
                    leaves, torch.float64)
    close(gradients(compiled, sinks, leaves, torch.float32, DEVICE), ref, "torch.compile")


# ------------------------------------------------------------------ varlen and flash API
def test_varlen_lse_gradient():
    packed = attncc.varlen("attention c { mask q >= k }")
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 7, 7 + 19, 7 + 19 + 1], dtype=torch.int32)  # a one-token sequence
    T = int(cu[-1])
    leaves = {"q": torch.randn(T, 3, D, generator=gen, dtype=torch.float64),
              "k": torch.randn(T, 3, D, generator=gen, dtype=torch.float64),
              "v": torch.randn(T, 3, D, generator=gen, dtype=torch.float64),
              "sink": torch.randn(3, 1, generator=gen, dtype=torch.float64)}
    w = torch.randn(T, 3, D, generator=gen, dtype=torch.float64)

    def loss(xs, out, lse):  # lse (heads, total_q)
        gate = torch.sigmoid(lse - xs["sink"]).T.unsqueeze(-1)
        return (out * gate * w.to(out.device, out.dtype)).sum()
    call = lambda fn, cu: lambda xs: fn(xs["q"], xs["k"], xs["v"], cu, cu, 19, 19, return_lse=True)
    close(gradients(call(packed, cu.to(DEVICE)), loss, leaves, torch.float32, DEVICE),
          gradients(call(packed.reference, cu), loss, leaves, torch.float64), "varlen")


def test_flash_api_lse_gradient():
    """flash_attn_func(return_attn_probs=True)'s softmax_lse, bottom-right causal with
    seqlen_q < seqlen_k, against the reference of the same mask written here."""
    variant = attncc.parse("attention br { mask k <= q + len_k - len_q }")
    gen = torch.Generator().manual_seed(6)
    Lq, Lk = 13, 30
    leaves = {"q": torch.randn(2, Lq, 4, D, generator=gen, dtype=torch.float64),
              "k": torch.randn(2, Lk, 2, D, generator=gen, dtype=torch.float64),
              "v": torch.randn(2, Lk, 2, D, generator=gen, dtype=torch.float64),
              "u": torch.randn(2, 4, Lq, generator=gen, dtype=torch.float64)}
    w = torch.randn(2, Lq, 4, D, generator=gen, dtype=torch.float64)
    loss = lambda xs, out, lse: (out * w.to(out.device, out.dtype)).sum() + (lse * xs["u"]).sum()

    def flash(xs):
        out, lse, _ = flash_attn_func(xs["q"], xs["k"], xs["v"], causal=True,
                                      return_attn_probs=True)
        return out, lse

    def ref(xs):
        return attncc.reference(variant, xs["q"], xs["k"], xs["v"], return_lse=True, layout="bshd")
    close(gradients(flash, loss, leaves, torch.float32, DEVICE),
          gradients(ref, loss, leaves, torch.float64), "flash_attn_func")


def test_flash_varlen_api_lse_gradient():
    """flash_attn_varlen_func's softmax_lse (nheads, total_q) against per-sequence reference
    calls concatenated."""
    variant = attncc.parse("attention br { mask k <= q + len_k - len_q }")
    gen = torch.Generator().manual_seed(8)
    cu_q = torch.tensor([0, 5, 16], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 20], dtype=torch.int32)
    leaves = {"q": torch.randn(16, 2, D, generator=gen, dtype=torch.float64),
              "k": torch.randn(20, 2, D, generator=gen, dtype=torch.float64),
              "v": torch.randn(20, 2, D, generator=gen, dtype=torch.float64),
              "u": torch.randn(2, 16, generator=gen, dtype=torch.float64)}
    loss = lambda xs, out, lse: (torch.exp(lse) * xs["u"]).sum() + out.square().sum()

    def flash(xs):
        out, lse, _ = flash_attn_varlen_func(xs["q"], xs["k"], xs["v"], cu_q.to(DEVICE),
                                             cu_k.to(DEVICE), 11, 11, causal=True,
                                             return_attn_probs=True)
        return out, lse

    def ref(xs):
        outs, lses = [], []
        for i in range(2):
            sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            o, l = attncc.reference(variant, *(t[s].unsqueeze(0) for t, s in
                                               ((xs["q"], sq), (xs["k"], sk), (xs["v"], sk))),
                                    return_lse=True, layout="bshd")
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)
    close(gradients(flash, loss, leaves, torch.float32, DEVICE),
          gradients(ref, loss, leaves, torch.float64), "flash_attn_varlen_func")


# ------------------------------------------------------------------ context parallelism
CP_SPECS = {"window": SPECS["window"]}  # query 0 attends to nothing, in any piece
CP_LEN, CP_HEADS = 32, 2


def cp_problem(name):
    gen = torch.Generator().manual_seed(len(name))
    q, k, v, w = (torch.randn(1, CP_HEADS, CP_LEN, D, generator=gen) for _ in range(4))
    u = torch.randn(1, CP_HEADS, CP_LEN, generator=gen)
    return q, k, v, w, u


def cp_loss(out, lse, w, u):
    """The output gated by its LSE, and the LSE alone (finite rows)."""
    return ((out * torch.sigmoid(lse).unsqueeze(-1) * w).sum()
            + (lse.masked_fill(lse == -math.inf, 0.0) * u).sum())


def cp_rank(rank: int, world: int, init_file: str, out_dir: str):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        sharding = cp.Sharding.of(None, "zigzag")
        for name, spec in CP_SPECS.items():
            q, k, v, w, u = cp_problem(name)
            local = [sharding.shard(t).requires_grad_() for t in (q, k, v)]
            out, lse = cp.context_parallel_attention(attncc.compile(spec), *local,
                                                     return_lse=True)
            loss = cp_loss(out, lse, sharding.shard(w), sharding.shard(u))
            loss.backward()
            grads = {n: sharding.unshard(t.grad) for n, t in zip("qkv", local)}
            if rank == 0:
                torch.save(grads, os.path.join(out_dir, f"{name}.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow  # two gloo processes; test_distributed.py runs context parallelism by default
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the gloo ranks pass CPU tensors, which the kernels take only under "
                           "the Triton interpreter (without a GPU)")
def test_context_parallel_lse_gradient(tmp_path):
    """Two gloo ranks: the merged LSE's gradient reaches every piece pair."""
    for spec in CP_SPECS.values():
        attncc.compile(spec)  # generate once, so the ranks load from the cache
    try:
        mp.spawn(cp_rank, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    except Exception:
        errors = [p.read_text() for p in sorted(tmp_path.glob("error-*"))]
        pytest.fail("a rank failed:\n" + "\n".join(errors or ["(no traceback)"]))
    for name, spec in CP_SPECS.items():
        got = torch.load(tmp_path / f"{name}.pt")
        q, k, v, w, u = (t.double() for t in cp_problem(name))
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attncc.reference(attncc.parse(spec), *xs, return_lse=True)
        ref = dict(zip("qkv", torch.autograd.grad(cp_loss(out, lse, w, u), xs)))
        close(got, ref, f"context parallel {name}")
