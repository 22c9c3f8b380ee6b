"""docs/recipes.md: every `attn` block on the page compiles and matches an independent
float64 implementation of its paper's formula, written here without attncc.

The specs are read from the page itself, so the page cannot drift from what is tested;
`test_every_recipe_is_tested` fails when a recipe is added without a check.
"""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attncc
from test_rounding import t5_relative_position_bucket

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"
TESTED = {"gpt_oss_sliding", "t5_bidirectional", "prefix_lm_per_sample", "natten_2d", "tree_verify", "diff_causal", "mla_causal"}


def recipe_specs() -> dict[str, str]:
    blocks = re.findall(r"```attn\n(.*?)```", RECIPES.read_text(), flags=re.S)
    return {re.match(r"attention (\w+)", b).group(1): b for b in blocks}


def recipe(name: str):
    return attncc.compile(recipe_specs()[name])


def dense_attention(q, k, v, allowed):
    """softmax(q kᵀ / √d) v over the allowed pairs, float64; rows with none give 0."""
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def assert_close(out, expected, atol=2e-5):
    assert not out.isnan().any(), "NaN in the kernel's output"
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


def test_every_recipe_is_tested():
    assert set(recipe_specs()) == TESTED


def gpt_oss_attention(q, k, v, sinks, window):
    """gpt-oss's reference attention (its sdpa): scores, mask, a sink column per head,
    softmax, the sink column dropped, times V. Written from the model's code, float64."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    pos_q, pos_k = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    allowed = (pos_q >= pos_k) & (pos_q - pos_k < window)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_column = sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink_column], -1), -1)[..., :-1]
    return weights @ v


def test_gpt_oss_sinks():
    torch.manual_seed(6)
    kernel = recipe("gpt_oss_sliding")
    b, h, n, d = 1, 3, 150, 16           # longer than the 128-token window
    inputs = [torch.randn(b, h, n, d) for _ in range(3)]
    sinks = torch.tensor([40.0, -40.0, 0.7])   # far above, far below the logits, between
    leaves = [x.clone().requires_grad_() for x in inputs + [sinks]]
    q, k, v, s = leaves
    out = kernel(q, k, v, sinks=s)                                    # as on the page
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves64 = [x.detach().double().requires_grad_() for x in inputs + [sinks]]
    expected = gpt_oss_attention(*leaves64, window=128)
    expected.backward(grad.double())
    assert_close(out, expected)
    for mine, theirs in zip(leaves, leaves64):
        assert_close(mine.grad, theirs.grad, atol=1e-4)


def test_t5_bias_table_matches_t5s_bucketing():
    torch.manual_seed(7)
    kernel = recipe("t5_bidirectional")
    b, h, n_q, n_k, d = 1, 3, 13, 150, 16  # distances past T5's 128, and negative ones
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for n in (n_q, n_k, n_k))
    table = torch.randn(h, 32, requires_grad=True)
    out = kernel(q, k, v, table=table)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, table)]
    q64, k64, v64, table64 = leaves
    relative = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None]    # key - query
    bias = table64[:, t5_relative_position_bucket(relative, bidirectional=True)]
    expected = torch.softmax(q64 @ k64.transpose(-1, -2) + bias, -1) @ v64   # unscaled
    expected.backward(grad.double())
    assert_close(out, expected, atol=5e-5)
    for mine, theirs in zip((q, k, v, table), leaves):
        assert_close(mine.grad, theirs.grad, atol=2e-4)


def test_prefix_lm_per_sample():
    torch.manual_seed(1)
    kernel = recipe("prefix_lm_per_sample")
    b, h, n, d = 2, 3, 37, 16
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    prefix = torch.tensor([5, 30], dtype=torch.int32)
    out = kernel(q, k, v, prefix=prefix)
    pos = torch.arange(n)
    expected = torch.stack([
        dense_attention(q[i].double(), k[i].double(), v[i].double(),
                        (pos[:, None] >= pos[None, :]) | (pos[None, :] < int(prefix[i])))
        for i in range(b)])
    assert_close(out, expected)


def natten_neighbourhood(height, width, radius):
    """NATTEN's window: the (2r+1)² patches around each query, shifted inward at borders."""
    n = height * width
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        row = min(max(i // width, radius), height - 1 - radius)
        col = min(max(i % width, radius), width - 1 - radius)
        for r in range(row - radius, row + radius + 1):
            allowed[i, r * width + col - radius: r * width + col + radius + 1] = True
    return allowed


def test_natten_2d():
    torch.manual_seed(2)
    kernel = recipe("natten_2d")
    q, k, v = (torch.randn(1, 3, 6 * 7, 16) for _ in range(3))
    allowed = natten_neighbourhood(6, 7, 1)
    assert int(allowed.sum(1).min()) == int(allowed.sum(1).max()) == 9   # same count at borders
    assert_close(kernel(q, k, v), dense_attention(q.double(), k.double(), v.double(), allowed))


def test_tree_verify_over_a_kv_cache():
    torch.manual_seed(3)
    kernel = recipe("tree_verify")
    batch, hq, hkv, d, capacity, draft = 2, 4, 2, 16, 40, 5
    parent = [-1, 0, 0, 1, 1]      # candidate 0 continues the cached prefix
    ancestors = torch.zeros(draft, draft, dtype=torch.bool)
    for i in range(draft):
        j = i
        while j >= 0:
            ancestors[i, j], j = True, parent[j]
    ancestors = ancestors.expand(batch, draft, draft).contiguous()
    k_cache, v_cache = (torch.randn(batch, hkv, capacity, d) for _ in range(2))
    k_draft, v_draft = (torch.randn(batch, hkv, draft, d) for _ in range(2))
    q = torch.randn(batch, hq, draft, d)
    lens = torch.tensor([7, 20], dtype=torch.int32)
    cached_k, cached_v = k_cache.clone(), v_cache.clone()
    out = kernel.decode(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_draft, v_new=v_draft,
                        ancestors=ancestors)
    for i in range(batch):
        prefix = int(lens[i])
        keys = torch.cat([cached_k[i, :, :prefix], k_draft[i]], 1).repeat_interleave(2, 0)
        values = torch.cat([cached_v[i, :, :prefix], v_draft[i]], 1).repeat_interleave(2, 0)
        allowed = torch.ones(draft, prefix + draft, dtype=torch.bool)
        allowed[:, prefix:] = ancestors[i]
        assert_close(out[i], dense_attention(q[i].double(), keys.double(), values.double(), allowed))


def diff_attention_formula(q1, k1, q2, k2, v, lam, lam_init):
    """Diff Transformer (Ye et al., 2024), eq. 1 and the per-head norm, causal, float64."""
    n = q1.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    d = q1.shape[-1]
    a1 = torch.softmax(((q1 @ k1.transpose(-1, -2)) / d ** 0.5).masked_fill(~causal, -torch.inf), -1)
    a2 = torch.softmax(((q2 @ k2.transpose(-1, -2)) / d ** 0.5).masked_fill(~causal, -torch.inf), -1)
    attn = (a1 - lam * a2) @ v
    return F.rms_norm(attn, attn.shape[-1:]) * (1 - lam_init)


def test_diff_attention_forward_and_lambda_gradient():
    torch.manual_seed(4)
    kernel = recipe("diff_causal")

    def diff_attention(q1, k1, q2, k2, v, lam, lam_init):   # as on the page
        o = kernel(torch.cat([q1, q2], 1), torch.cat([k1, k2], 1), torch.cat([v, v], 1))
        a1, a2 = o.chunk(2, dim=1)
        attn = a1 - lam * a2
        return F.rms_norm(attn, attn.shape[-1:]) * (1 - lam_init)

    b, h, n, d = 1, 3, 21, 16
    inputs = [torch.randn(b, h, n, d) for _ in range(4)] + [torch.randn(b, h, n, 2 * d)]
    lam = torch.tensor(0.3)
    lam_init = 0.2
    leaves = [x.clone().requires_grad_() for x in inputs + [lam]]
    out = diff_attention(*leaves, lam_init)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves64 = [x.detach().double().requires_grad_() for x in inputs + [lam]]
    expected = diff_attention_formula(*leaves64, lam_init)
    expected.backward(grad.double())
    assert_close(out, expected, atol=5e-5)
    for mine, theirs in zip(leaves, leaves64):
        assert_close(mine.grad, theirs.grad, atol=2e-4)


def test_mla_shapes_with_v_of_its_own_width():
    torch.manual_seed(5)
    kernel = recipe("mla_causal")

    def mla_attention(q, k, v):             # as on the page
        return kernel(q, k, v)

    b, h, n, d_qk, d_v = 1, 3, 19, 48, 32
    q, k = (torch.randn(b, h, n, d_qk, requires_grad=True) for _ in range(2))
    v = torch.randn(b, h, n, d_v, requires_grad=True)
    out = mla_attention(q, k, v)
    grad = torch.randn_like(out)
    out.backward(grad)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    expected.backward(grad.double())
    assert out.shape == (b, h, n, d_v)
    assert_close(out, expected)
    for mine, theirs in ((q, q64), (k, k64), (v, v64)):
        assert_close(mine.grad, theirs.grad, atol=1e-4)


@pytest.mark.parametrize("name", sorted(TESTED))
def test_recipe_prints_back(name):
    """Each recipe is valid language text that round-trips through the printer."""
    variant = attncc.parse(recipe_specs()[name])
    assert attncc.parse(str(variant)) == variant
