"""Scores that grow with distance, and derivatives that are not finite past the mask.

A learned ALiBi slope that turns negative makes the score grow with q - k: in a query
tile that runs past len_q, the rows past the end computed exp2 of an unbounded score
(inf), times a dO of 0, and the NaN reached the slope's gradient, a sum over rows.
And a score whose derivative is inf or NaN at masked pairs (`s * sqrt(q - k + 1)`
under `q >= k`) multiplied a dS of 0 there and spread the NaN through dQ and dK.
Out-of-sequence and masked pairs must contribute exactly nothing.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import attncc
from test_kernels import DEVICE, compare

LEARNED_ALIBI = """attention learned_alibi {
    learnable input sl: f32[h]
    mask q >= k
    score s + sl[h] * (k - q)
}"""


def _finite(name, t):
    assert not torch.isnan(t).any() and not torch.isinf(t).any(), f"{name} is not finite: {t}"


@pytest.mark.parametrize("Lq,Lk,H", [(37, 37, 3), (45, 29, 5), (1, 33, 1)])
def test_learned_alibi_with_negative_slopes_has_finite_gradients(Lq, Lk, H):
    variant = attncc.parse(LEARNED_ALIBI)
    gen = torch.Generator().manual_seed(Lq * 100 + Lk)
    # Negative slopes make the score grow with distance, as fast as 3.5 per position.
    slopes = -3.5 + 4.0 * torch.rand(H, generator=gen)
    slopes[0] = -3.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the interpreter's exp2 overflow
        got, ref = compare(variant, B=1, H=H, Lq=Lq, Lk=Lk, D=16, inputs={"sl": slopes},
                           seed=Lq + Lk)
    for name, g, r in zip(["out", "lse", "dq", "dk", "dv", "dsl"], got, ref):
        _finite(f"reference {name}", r)  # every row has a key: even the LSE is finite
        _finite(name, g)


def test_derivative_that_is_nan_past_the_mask_contributes_nothing():
    """`s * sqrt(q - k + 1)` is NaN past the causal mask (q < k); inside it, it equals `s * sqrt(abs(q - k) + 1)`, which is finite everywhere: the
    float64 reference of that one is the independent answer."""
    nan_past_mask = attncc.parse("attention nan_past { mask q >= k\n score s * sqrt(q - k + 1) }")
    finite = attncc.parse("attention finite { mask q >= k\n score s * sqrt(abs(q - k) + 1) }")
    learn = attncc.parse("""attention nan_past_learned {
        learnable input x: f32[h]
        mask q >= k
        score s + x[h] * sqrt(q - k) }""")
    learn_finite = attncc.parse("""attention finite_learned {
        learnable input x: f32[h]
        mask q >= k
        score s + x[h] * sqrt(abs(q - k)) }""")
    gen = torch.Generator().manual_seed(5)
    B, H, Lq, Lk, D = 1, 3, 37, 29, 16
    q, k, v, do = (torch.randn(B, H, n, D, generator=gen) for n in (Lq, Lk, Lk, Lq))
    x = torch.randn(H, generator=gen)
    for bad, good, inputs in ((nan_past_mask, finite, {}), (learn, learn_finite, {"x": x})):
        def grads(fn, dtype, device):
            qkv = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
            ins = {n: t.to(device, dtype).requires_grad_() for n, t in inputs.items()}
            out = fn(*qkv, **ins)
            got = [out, *torch.autograd.grad(out, qkv + list(ins.values()), do.to(device, dtype))]
            return [t.cpu() for t in got]
        got = grads(attncc.compile(bad), torch.float32, DEVICE)
        want = grads(lambda *a, **kw: attncc.reference(good, *a, **kw), torch.float64, "cpu")
        for name, g, w in zip(["out", "dq", "dk", "dv", "dx"], got, want):
            _finite(f"{bad.name} {name}", g)
            torch.testing.assert_close(g.double(), w, atol=2e-4 * max(1.0, w.abs().max().item()),
                                       rtol=1e-3, msg=f"{bad.name} {name}")


def test_a_slope_gradient_that_is_exactly_zero_keeps_only_rounding_noise():
    """One key per row (len_k 1): the softmax is constant, the slope's gradient exactly 0,
    and what the kernel keeps is dS's rounding noise times |k - q| over every row: the
    tolerance scales with it (tolerance.input_gradient_scales), as dq's does. The fuzzer's
    example, positions near 2**31 included."""
    variant = attncc.parse("""attention one_key {
        scale 0.3
        learnable input slope: f32[h]
        score s + slope[h] * (k - q)
        dropout 0.1 }""")
    slopes = torch.tensor([-3.7, 2.9])
    got, ref = compare(variant, B=2, H=2, Lq=59, Lk=1, D=48, seed=58, inputs={"slope": slopes},
                       q_offset=2_147_483_555, k_offset=2_147_483_548)
    assert torch.equal(ref[-1].cpu(), torch.zeros(2, dtype=torch.float64))
    _finite("dslope", got[-1])
    assert got[-1].abs().max() < 1e-2  # noise, not a gradient


@pytest.mark.parametrize("spec, q_offset", [
    ("attention quad { score s * (q - k) * (q - k) * 0.0000000001 }", 50_000),
    ("attention cubic { score s * (q - k) * (q - k) * (q - k) * 0.0000000001 }", 2_000),
])
def test_a_derivatives_integer_products_do_not_wrap(spec, q_offset):
    """d score / d s = 1e-10 (q - k)**2 is a product the forward never forms: printed as
    an int32 product it wrapped past |q - k| = 46340 (the cube past 1290), and dq, dk were
    wrong while the forward was right. Against the float64 reference."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    kernel = attncc.compile(spec)
    leaves = [t.to(DEVICE, torch.float32).requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves, q_offset=q_offset)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = [g.cpu() for g in torch.autograd.grad(out, leaves, dout.to(DEVICE, torch.float32))]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attncc.reference(kernel.variant, *refs, q_offset=q_offset), refs, dout)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _finite(name, g)
        torch.testing.assert_close(g.double(), w, rtol=0, atol=1e-4 * (1 + w.abs().max().item()),
                                   msg=lambda m: f"{name}: {m}")
