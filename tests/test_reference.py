"""The dense reference: against PyTorch SDPA wherever SDPA can say the same thing, against
hand-written masks where it cannot, its gradients, its empty rows, its dropout, and the
call-time checks it shares with the kernels."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attncc
from attncc import dropout as dropout_bits
from attncc.arguments import bind

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
F64 = torch.float64


def rand(*shape, dtype=F64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)


def qkv(b, hq, hkv, lq, lk, d, dv=None, dtype=F64):
    return rand(b, hq, lq, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype), \
        rand(b, hkv, lk, dv or d, dtype=dtype)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def spec(body: str, name="t"):
    return attncc.parse(f"attention {name} {{\n{body}\n}}")


def positions(lq, lk):
    return torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)  # [Lq, 1], [1, Lk]


# Shapes: len_q != len_k both ways, a single query or key, heads that are not powers of
# two, head dims from 16 to 128, and a value dim that differs from the head dim.
SHAPES = [  # (batch, heads, len_q, len_k, dim, dim_v)
    (2, 3, 17, 29, 16, 16),
    (1, 5, 1, 40, 64, 64),
    (2, 4, 33, 1, 128, 128),
    (1, 3, 64, 64, 32, 48),
    (3, 1, 45, 19, 96, 96),
]
SHAPE_IDS = [f"b{b}h{h}q{lq}k{lk}d{d}" for b, h, lq, lk, d, _ in SHAPES]


# -------------------------------------------------------------------------- vs SDPA
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_full_matches_sdpa(shape):
    b, h, lq, lk, d, dv = shape
    q, k, v = qkv(b, h, h, lq, lk, d, dv)
    out, lse = attncc.reference(attncc.parse_file(EXAMPLES / "full.attn"), q, k, v, return_lse=True)
    close(out, F.scaled_dot_product_attention(q, k, v))
    close(lse, torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1))


@pytest.mark.parametrize("length, d", [(1, 16), (23, 32), (64, 128)])
def test_causal_matches_sdpa_is_causal(length, d):
    q, k, v = qkv(2, 3, 3, length, length, d)
    # layout= said: with one token, 3 heads of 1 position also read as 1 head of 3.
    out = attncc.reference(attncc.parse_file(EXAMPLES / "causal.attn"), q, k, v, layout="bhsd")
    close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("lq, lk", [(7, 30), (30, 30), (1, 12)])
def test_bottom_right_causal_matches_an_explicit_mask(lq, lk):
    q, k, v = qkv(1, 5, 5, lq, lk, 32)
    qi, ki = positions(lq, lk)
    mask = ki <= qi + (lk - lq)  # the last query sees every key
    out = attncc.reference(attncc.parse_file(EXAMPLES / "causal_bottom_right.attn"), q, k, v)
    close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    # and torch's own name for it agrees with the explicit mask
    from torch.nn.attention.bias import causal_lower_right
    close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk)))


@pytest.mark.parametrize("window", [1, 4, 16])
def test_sliding_window_matches_an_explicit_mask(window):
    lq = lk = 37
    q, k, v = qkv(2, 3, 3, lq, lk, 16)
    qi, ki = positions(lq, lk)
    mask = (ki <= qi) & (qi - ki < window)
    variant = spec(f"param window: int = {window}\nmask q >= k and q - k < window")
    close(attncc.reference(variant, q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("hq, hkv", [(6, 2), (5, 1), (8, 8)])
def test_gqa_matches_sdpa_with_repeated_heads(hq, hkv):
    q, k, v = qkv(2, hq, hkv, 19, 23, 64)
    variant = spec(f"heads {hq} / {hkv}\nmask q >= k")
    out = attncc.reference(variant, q, k, v)
    group = hq // hkv
    qi, ki = positions(19, 23)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                          v.repeat_interleave(group, 1), attn_mask=ki <= qi)
    close(out, want)
    # query head h reads key/value head h // group, so a change to kv head 0 moves only
    # the first group's outputs
    k2 = k.clone()
    k2[:, 0] += 1.0
    moved = (attncc.reference(variant, q, k2, v) - out).abs().amax(dim=(0, 2, 3))  # [Hq]
    assert (moved[:group] > 0).all() and (moved[group:] == 0).all()


def test_gqa_without_a_heads_declaration_groups_the_same_way():
    q, k, v = qkv(1, 6, 3, 11, 11, 16)
    out = attncc.reference(attncc.parse_file(EXAMPLES / "causal.attn"), q, k, v)
    close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("heads", [3, 8])
def test_alibi_matches_a_float_mask(heads):
    lq = lk = 40
    q, k, v = qkv(2, heads, heads, lq, lk, 32)
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])  # f32[h]
    qi, ki = positions(lq, lk)
    bias = slopes.to(F64).view(-1, 1, 1) * (ki - qi)  # [H, Lq, Lk]
    bias = bias.masked_fill(ki > qi, -math.inf)
    out = attncc.reference(attncc.parse_file(EXAMPLES / "alibi.attn"), q, k, v, slopes=slopes)
    close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


@pytest.mark.parametrize("scale_text, scale", [("0.3", 0.3), ("1.0 / dim", 1 / 48),
                                               ("2.0 / sqrt(dim * 4)", 1 / math.sqrt(48))])
def test_custom_scale_matches_sdpa_scale(scale_text, scale):
    q, k, v = qkv(2, 3, 3, 21, 13, 48)
    out = attncc.reference(spec(f"scale {scale_text}"), q, k, v)
    close(out, F.scaled_dot_product_attention(q, k, v, scale=scale))


# ------------------------------------------------------ vs masks written out by hand
def masked_attention(q, k, v, allowed, scores=None, scale=None):
    """softmax over allowed keys, written out: the independent check for non-SDPA variants."""
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if scores is not None:
        s = scores(s)
    s = s.masked_fill(~allowed, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def test_examples_against_hand_written_masks():
    torch.manual_seed(torch.seed())
    L = 48
    qi, ki = positions(L, L)
    doc = torch.sort(torch.randint(0, 4, (L,), dtype=torch.int32)).values
    cases = {
        "prefix_lm": ("param prefix: int = 10\nmask q >= k or k < prefix", {}, (ki <= qi) | (ki < 10)),
        "document": ("input doc_q: i32[q]\ninput doc_k: i32[k]\nmask doc_q[q] == doc_k[k] and q >= k",
                     {"doc_q": doc, "doc_k": doc}, (doc.view(-1, 1) == doc.view(1, -1)) & (ki <= qi)),
        "dilated": ("param window: int = 12\nparam dilation: int = 3\n"
                    "mask q >= k and q - k < window and (q - k) % dilation == 0", {},
                    (ki <= qi) & (qi - ki < 12) & ((qi - ki) % 3 == 0)),
        "chunked": ("param chunk: int = 16\nmask q // chunk == k // chunk and q >= k", {},
                    (qi // 16 == ki // 16) & (ki <= qi)),
        "longformer": ("param window: int = 3\nparam n_global: int = 2\n"
                       "mask abs(q - k) <= window or q < n_global or k < n_global", {},
                       ((qi - ki).abs() <= 3) | (qi < 2) | (ki < 2)),
    }
    for name, (body, inputs, allowed) in cases.items():
        q, k, v = qkv(2, 3, 3, L, L, 16)
        out = attncc.reference(spec(body), q, k, v, **inputs)
        close(out, masked_attention(q, k, v, allowed))


def test_examples_parse_with_their_own_parameters_too():
    # The same masks as the shipped examples, now with the examples' own constants.
    for name in ("prefix_lm", "dilated_window", "chunked_local", "longformer", "sliding_window"):
        v = attncc.parse_file(EXAMPLES / f"{name}.attn")
        q, k, vv = qkv(1, 2, 2, 33, 33, 16)
        out = attncc.reference(v, q, k, vv)
        assert out.shape == (1, 2, 33, 16) and torch.isfinite(out).all()


def test_softcap_matches_its_formula():
    q, k, v = qkv(2, 3, 3, 30, 30, 128)
    q = q * 8  # large scores, so the cap matters
    qi, ki = positions(30, 30)
    out = attncc.reference(attncc.parse_file(EXAMPLES / "softcap.attn"), q, k, v)
    want = masked_attention(q, k, v, ki <= qi, scores=lambda s: 50.0 * torch.tanh(s / 50.0),
                            scale=1 / 12.0)
    close(out, want)


def test_relative_bias_reads_the_clipped_table():
    L, H = 300, 2  # longer than the 255 clip, so the end entries are used
    q, k, v = qkv(1, H, H, L, L, 16)
    bias = rand(H, 511, dtype=torch.float32)
    qi, ki = positions(L, L)
    index = (qi - ki).clamp(-255, 255) + 255  # [L, L]
    table = bias.to(F64)[:, index]  # [H, L, L]
    out = attncc.reference(attncc.parse_file(EXAMPLES / "relative_bias.attn"), q, k, v, bias=bias)
    close(out, masked_attention(q, k, v, torch.ones(L, L, dtype=torch.bool), scores=lambda s: s + table))


def test_bigbird_layout_is_applied_per_tile():
    L, block = 300, 128  # three tiles, the last one partial
    nb = math.ceil(L / block)
    random_blocks = torch.rand(nb, nb) < 0.5
    q, k, v = qkv(1, 2, 2, L, L, 16)
    qb = torch.arange(L) // block
    tiles = ((qb.view(-1, 1) - qb.view(1, -1)).abs() <= 1) | (qb.view(-1, 1) == 0) \
        | (qb.view(1, -1) == 0) | random_blocks[qb.view(-1, 1), qb.view(1, -1)]
    out = attncc.reference(attncc.parse_file(EXAMPLES / "bigbird.attn"), q, k, v,
                           random_blocks=random_blocks)
    close(out, masked_attention(q, k, v, tiles))


def test_offsets_are_positions_of_a_longer_sequence():
    # A query block at offset 20 of a 50-token causal document sees what rows 20.. of the
    # whole computation see, and its inputs are indexed by absolute position.
    L, off = 50, 20
    doc = torch.sort(torch.randint(0, 3, (L,), dtype=torch.int32)).values
    variant = attncc.parse_file(EXAMPLES / "document.attn")
    q, k, v = qkv(2, 3, 3, L, L, 16)
    whole = attncc.reference(variant, q, k, v, doc_q=doc, doc_k=doc)
    part = attncc.reference(variant, q[:, :, off:], k, v, q_offset=off, doc_q=doc, doc_k=doc)
    close(part, whole[:, :, off:])
    with pytest.raises(attncc.CallError, match=r"input 'doc_q' has shape \(30,\), expected \(50,\)"):
        attncc.reference(variant, q[:, :, off:], k, v, q_offset=off, doc_q=doc[off:], doc_k=doc)


# ------------------------------------------------------------------------ gradients
def test_gradcheck_causal():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 5, 6, 4))
    variant = attncc.parse_file(EXAMPLES / "causal.attn")
    assert torch.autograd.gradcheck(lambda q, k, v: attncc.reference(variant, q, k, v), (q, k, v))


def test_gradcheck_softcap_and_learnable_bias():
    variant = spec("learnable input bias: f64[h, 11]\nparam cap: float = 2.0\nmask q + 1 >= k\n"
                   "score cap * tanh(s / cap) + bias[h, min(max(q - k, -5), 5) + 5]")
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 6, 7, 4))
    bias = rand(2, 11, requires_grad=True)
    fn = lambda q, k, v, bias: attncc.reference(variant, q, k, v, bias=bias)
    assert torch.autograd.gradcheck(fn, (q, k, v, bias))
    out = fn(q, k, v, bias)
    (g,) = torch.autograd.grad((out * rand(*out.shape)).sum(), bias)
    # The mask keeps q - k >= -1, so entries 5 - 1 .. 10 are read and get gradients; the
    # entries for distances -5..-2 (0..3) are never read.
    assert (g[:, :4] == 0).all() and (g[:, 4:] != 0).all()


def test_gradcheck_lse():
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 1, 4, 5, 3))
    variant = attncc.parse_file(EXAMPLES / "causal_bottom_right.attn")
    assert torch.autograd.gradcheck(
        lambda q, k, v: attncc.reference(variant, q, k, v, return_lse=True)[1], (q, k, v))


# ---------------------------------------------------------------------- empty rows
def test_rows_with_no_keys_give_zero_and_minus_infinity_without_nan():
    # Queries 0..2 see nothing (k < q - 2 is empty for them); the others see something.
    variant = spec("mask k < q - 2")
    q, k, v = (t.requires_grad_() for t in qkv(2, 3, 3, 9, 9, 8))
    out, lse = attncc.reference(variant, q, k, v, return_lse=True)
    assert (out[:, :, :3] == 0).all()
    assert (lse[:, :, :3] == -math.inf).all() and torch.isfinite(lse[:, :, 3:]).all()
    (out.sum() + out.pow(2).sum()).backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert (q.grad[:, :, :3] == 0).all() and q.grad[:, :, 3:].abs().sum() > 0
    assert (k.grad[:, :, 6:] == 0).all()  # keys 6.. are seen by no query


def test_a_row_of_minus_infinity_scores_is_empty_as_in_the_kernels():
    """An additive float mask (`score s + bias`, the README's SDPA recipe) of -inf over a
    whole row: the kernels give 0 and LSE -inf; the reference gave NaN in the row and
    in every gradient. The formula: SDPA's softmax over the other rows, 0 in this one."""
    variant = spec("input bias: f64[b, h, q, k]\n score s + bias[b, h, q, k]")
    q, k, v = (t.requires_grad_() for t in qkv(1, 3, 3, 7, 9, 8))
    bias = torch.randn(1, 3, 7, 9, dtype=torch.float64)
    bias[:, 1, 4] = -math.inf
    bias[:, :, 2, ::2] = -math.inf  # a row with some keys left
    out, lse = attncc.reference(variant, q, k, v, bias=bias, return_lse=True)
    s = q @ k.transpose(-1, -2) / math.sqrt(8) + bias
    dead = torch.zeros(1, 3, 7, 1, dtype=torch.bool)
    dead[:, 1, 4] = True
    want = torch.where(dead, 0.0, torch.softmax(s.masked_fill(dead, 0.0), -1) @ v)
    assert torch.allclose(out, want) and (lse[:, 1, 4] == -math.inf).all()
    assert torch.isfinite(lse[~dead.squeeze(-1)]).all()
    grads = torch.autograd.grad(out.sum() + out.pow(2).sum(), (q, k, v))
    wgrads = torch.autograd.grad(want.sum() + want.pow(2).sum(), (q, k, v))
    for g, w in zip(grads, wgrads):
        assert torch.isfinite(g).all() and torch.allclose(g, w)


def test_a_variant_that_masks_everything():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 5, 7, 4))
    out, lse = attncc.reference(spec("mask false"), q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()
    out.sum().backward()
    assert all((g == 0).all() for g in (q.grad, k.grad, v.grad))


def _safe_divide(x, d):
    """x / d, 0 where d == 0, with a gradient that is 0 there (the double-where form)."""
    zero = d == 0
    return torch.where(zero, torch.zeros_like(x), x / torch.where(zero, torch.ones_like(d), d))


def _sdpa_with_scores(q, k, v, score_of, allowed=None):
    """softmax(score(q k^T / sqrt(d))) v, written independently of attncc."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = score_of(s)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return torch.softmax(s, -1) @ v


# Scores whose value is not used somewhere (an untaken branch of where, a masked pair)
# and whose derivative there is inf or NaN: the reference's gradients stay finite and
# equal the same attention written with the double-where form by hand.
@pytest.mark.parametrize("body, formula", [
    ("score where(q == k, 0.0, s / (q - k))",
     lambda s, qi, ki, b: _safe_divide(s, (qi - ki).to(s.dtype))),
    ("mask q != k\n score s / (q - k)",
     lambda s, qi, ki, b: _safe_divide(s, (qi - ki).to(s.dtype))),
    ("score where(s > 0.0, sqrt(s), s)",
     lambda s, qi, ki, b: torch.where(s > 0, torch.sqrt(torch.where(s > 0, s, torch.ones_like(s))), s)),
    ("learnable input g: f32[h]\n score where(q == k, s, s + g[h] / (q - k))",
     lambda s, qi, ki, b: s + _safe_divide(b.view(1, -1, 1, 1).expand_as(s),
                                           (qi - ki).to(s.dtype).expand_as(s))),
])
def test_unused_scores_with_infinite_derivatives_add_nothing_to_gradients(body, formula):
    variant = spec(body)
    lq, lk = 7, 9
    q, k, v = (t.requires_grad_() for t in qkv(2, 3, 3, lq, lk, 8))
    b = (torch.rand(3, dtype=F64) + 0.5).requires_grad_()
    inputs = {"g": b} if "g:" in body else {}
    qi, ki = positions(lq, lk)
    allowed = (qi != ki) if "mask" in body else None
    got = attncc.reference(variant, q, k, v, **inputs)
    dout = torch.randn_like(got)
    wrt = (q, k, v, *inputs.values())
    grads = torch.autograd.grad(got, wrt, dout)
    want = _sdpa_with_scores(q, k, v, lambda s: formula(s, qi, ki, b), allowed)
    want_grads = torch.autograd.grad(want, wrt, dout)
    close(got, want)
    for g, w in zip(grads, want_grads):
        assert torch.isfinite(g).all()
        close(g, w)


def test_gating_leaves_values_and_ordinary_gradients_as_they_were():
    """Softcap, causal, len_q != len_k: values with and without autograd agree, and the
    gradients equal the formula's (every allowed pair's derivative is finite)."""
    variant = spec("param cap: float = 5.0\n mask q >= k\n score cap * tanh(s / cap)")
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 6, 11, 8))
    out = attncc.reference(variant, q, k, v)
    with torch.no_grad():
        assert torch.equal(attncc.reference(variant, q, k, v), out)
    qi, ki = positions(6, 11)
    want = _sdpa_with_scores(q, k, v, lambda s: 5.0 * torch.tanh(s / 5.0), qi >= ki)
    dout = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(want, (q, k, v), dout)):
        close(g, w)


# -------------------------------------------------------------------------- dropout
def test_dropout_needs_a_seed():
    variant = attncc.parse_file(EXAMPLES / "dropout.attn")
    with pytest.raises(attncc.CallError, match="dropout_seed"):
        attncc.reference(variant, *qkv(1, 1, 1, 4, 4, 8))


def test_dropout_is_a_function_of_the_seed():
    variant = attncc.parse_file(EXAMPLES / "dropout.attn")
    q, k, v = qkv(2, 3, 3, 32, 32, 16)
    a = attncc.reference(variant, q, k, v, dropout_seed=1234)
    assert torch.equal(a, attncc.reference(variant, q, k, v, dropout_seed=1234))
    b = attncc.reference(variant, q, k, v, dropout_seed=1235)
    assert not torch.equal(a, b)
    # Some probabilities were dropped: the result is not the dropout-free one.
    plain = attncc.reference(attncc.parse_file(EXAMPLES / "causal.attn"), q, k, v)
    assert not torch.allclose(a, plain)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_a_fraction_one_minus_p(p):
    bh = torch.arange(16).view(-1, 1, 1)
    qi, ki = torch.arange(256).view(1, -1, 1), torch.arange(256).view(1, 1, -1)
    keep = dropout_bits.keep_mask(20240601, p, bh, qi, ki)  # [16, 256, 256], ~1M draws
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) < 0.003  # 5 standard deviations of a fair coin at 1M
    # no structure along any axis: each row and each column keeps about the same share
    assert (keep.double().mean(dim=(0, 2)) - (1 - p)).abs().max() < 0.06
    assert (keep.double().mean(dim=(0, 1)) - (1 - p)).abs().max() < 0.06


def test_dropout_is_unbiased():
    # E[dropout output] = output without dropout: the kept probabilities are scaled by
    # 1 / (1 - p). A chi-square test of the mean over seeds, element by element.
    variant = spec("mask q >= k\ndropout 0.3")
    plain = spec("mask q >= k")
    q, k, v = qkv(1, 2, 2, 16, 16, 8)
    want = attncc.reference(plain, q, k, v)
    runs = torch.stack([attncc.reference(variant, q, k, v, dropout_seed=s) for s in range(400)])
    mean, sem = runs.mean(0), runs.std(0) / math.sqrt(len(runs))
    varies = sem > 0  # the first query sees one key: dropped or not, never in between
    z2 = ((mean - want)[varies] / sem[varies]) ** 2
    assert 0.5 < z2.mean().item() < 1.7  # mean 1, sd ~0.13 over fresh inputs


# ------------------------------------------------------------------ call-time errors
def _call_error(variant, q, k, v, **inputs) -> str:
    with pytest.raises(attncc.CallError) as info:
        bind(variant, q, k, v, inputs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


CAUSAL = attncc.parse("attention c { mask q >= k }")
TABLE = attncc.parse("attention t {\n input slopes: f32[h]\n input doc: i32[k]\n"
                     " score s + slopes[h] + doc[k]\n}")


def test_call_errors_name_the_argument():
    q, k, v = qkv(2, 4, 2, 8, 10, 16)
    assert _call_error(CAUSAL, q[0], k, v).startswith("q must have 4 dimensions")
    assert _call_error(CAUSAL, q, k.unsqueeze(0), v).startswith("k must have 4 dimensions")
    assert _call_error(CAUSAL, q, k, v.float()).startswith("q, k and v must have the same dtype")
    assert "v must be a torch.Tensor" in _call_error(CAUSAL, q, k, v.tolist())
    assert "q must be a floating-point tensor" in _call_error(CAUSAL, q.long(), k, v)
    assert "k and v must have the same sequence length" in _call_error(CAUSAL, q, k, v[:, :, :9])
    assert "q and k must have the same head dim" in _call_error(CAUSAL, q, k[..., :8], v)
    assert "batch sizes differ" in _call_error(CAUSAL, q, k[:1], v[:1])
    q3 = rand(2, 3, 8, 16)
    assert "q has 3 heads, which is not a multiple of the 2 heads of k and v" in \
        _call_error(CAUSAL, q3, k, v)
    declared = attncc.parse("attention g { heads 4 / 1 }")
    assert "the variant declares heads 4 / 1, but q has 4 heads and k, v have 2" in \
        _call_error(declared, q, k, v)
    with pytest.raises(attncc.CallError, match="q_offset must be a non-negative int"):
        bind(CAUSAL, q, k, v, {}, q_offset=-1)


def test_call_errors_for_inputs():
    q, k, v = qkv(2, 4, 4, 8, 10, 16)
    slopes, doc = rand(4, dtype=torch.float32), torch.zeros(10, dtype=torch.int32)
    assert "missing input 'doc'" in _call_error(TABLE, q, k, v, slopes=slopes)
    assert "unexpected input 'bias'" in _call_error(TABLE, q, k, v, slopes=slopes, doc=doc,
                                                    bias=slopes)
    assert "unexpected input 'x': the variant 'c' declares no inputs" in \
        _call_error(CAUSAL, q, k, v, x=slopes)
    msg = _call_error(TABLE, q, k, v, slopes=slopes, doc=doc[:8])
    assert msg.startswith("input 'doc' has shape (8,), expected (10,) (k=10)")
    msg = _call_error(TABLE, q, k, v, slopes=slopes.double(), doc=doc)
    assert msg.startswith("input 'slopes' has dtype torch.float64, but the variant declares f32")
    assert "input 'slopes' must be a torch.Tensor, got list" in \
        _call_error(TABLE, q, k, v, slopes=[1.0] * 4, doc=doc)
    # and the reference, which binds first, raises the same
    with pytest.raises(ValueError, match="missing input 'slopes'"):
        attncc.reference(TABLE, q, k, v, doc=doc)


def test_out_of_range_reads_are_call_errors():
    variant = spec("input t: f32[h]\nscore s + t[q]")
    q, k, v = qkv(1, 2, 2, 5, 5, 8)
    with pytest.raises(attncc.CallError, match="input 't' is read at index 4 along axis 0, "
                                               "which has length 2"):
        attncc.reference(variant, q, k, v, t=rand(2, dtype=torch.float32))
