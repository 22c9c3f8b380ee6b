"""v's head dim independent of q·k's (issue 34): DeepSeek's (192, 128), (128, 64),
FA3's (64, 512) and (80, 96), forward and gradients against float64
`scaled_dot_product_attention` (math backend), an independent formula; decoding with a
v cache of another width against decode_reference, contiguous and paged; packed
sequences; context parallelism on gloo; the flash-attn API with v wider and narrower;
`dim_v` in `scale`; DeepSeek-V3 through the transformers integration, v unpadded; the
Gluon backend's refusal, which sends such calls to the portable kernels.
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
from attncc import flash
from attncc.errors import CallError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the interpreter

CAUSAL = "attention causal { mask q >= k }"
WINDOW = "attention window { param window: int = 5  mask q >= k and q - k < window }"


def sdpa64(q, k, v, mask=None, scale=None):
    """float64 torch SDPA, math backend: the independent reference (it takes Ev != E)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                scale=scale)


def _close(got, want, what, tol):
    """got (on DEVICE) against want (float64, on the CPU)."""
    got = got.detach().cpu()
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"{what}: error {err:.3g}"
    assert not got.isnan().any(), f"{what}: NaN"


@pytest.mark.parametrize("dims", [(192, 128), (128, 64), (64, 512), (80, 96)],
                         ids=lambda d: f"E{d[0]}-Ev{d[1]}")
def test_forward_and_gradients_match_sdpa_in_float64(dims, monkeypatch):
    """Lengths off the tile, len_q != len_k (q >= k, both from position 0), GQA 4 / 2,
    fresh random values. The backward's launches split q·k's head dim as the forward's
    (192 = 128 + 64, 80 = 64 + 16), with no padded segment."""
    E, Ev = dims
    gen = torch.Generator().manual_seed(E * 1000 + Ev)
    B, Hq, Hkv, Lq, Lk = 1, 4, 2, 19, 23
    q = torch.randn(B, Hq, Lq, E, generator=gen)
    k = torch.randn(B, Hkv, Lk, E, generator=gen)
    v = torch.randn(B, Hkv, Lk, Ev, generator=gen)
    do = torch.randn(B, Hq, Lq, Ev, generator=gen)
    kernel = attncc.compile(CAUSAL)
    seen = {}
    _record_launches(monkeypatch, kernel.module, ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"), seen)
    leaves = [t.to(DEVICE, copy=True).requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves)
    assert out.shape == (B, Hq, Lq, Ev)
    out.backward(do.to(DEVICE))
    first = 1 << (E.bit_length() - 1)
    for name in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
        assert (seen[name]["HEAD_DIM_PAD"], seen[name]["HEAD_DIM_TAIL"]) == (first, E - first), name
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    mask = torch.arange(Lq)[:, None] >= torch.arange(Lk)[None, :]
    ref = sdpa64(*ref_leaves, mask=mask)  # default scale 1/sqrt(E), v's width aside
    ref.backward(do.double())
    _close(out, ref, "out", 1e-5)
    for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        assert got.grad.shape == want.shape, name
        _close(got.grad, want.grad, name, 1e-4)


def test_dim_v_in_scale_and_the_default_scale_stays_q_k_s():
    kernel = attncc.compile("attention vs { scale 1.0 / sqrt(dim_v * 1.0)  mask q >= k }")
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 9, 32, generator=gen), torch.randn(1, 2, 9, 32, generator=gen)
    v = torch.randn(1, 2, 9, 64, generator=gen)
    mask = torch.arange(9)[:, None] >= torch.arange(9)[None, :]
    out = kernel(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    _close(out, sdpa64(q.double(), k.double(), v.double(), mask, 1 / 8.0), "scale 1/sqrt(dim_v)",
           1e-5)
    _close(out, attncc.reference(kernel.variant, q.double(), k.double(), v.double()),
           "reference with dim_v", 1e-5)
    with pytest.raises(attncc.SpecError, match="dim_v"):
        attncc.parse("attention bad { mask k < dim_v }")


def test_v_head_dim_out_of_range_is_refused_naming_it():
    kernel = attncc.compile(CAUSAL)
    q = torch.randn(1, 1, 4, 32, device=DEVICE)
    with pytest.raises(CallError, match="v's head dim 8 .* 16 to 512"):
        kernel(q, q, torch.randn(1, 1, 4, 8, device=DEVICE))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_with_a_v_cache_of_another_width(paged):
    """n_q 3 new tokens with 2 appended, GQA 4 / 2, one and several splits."""
    gen = torch.Generator().manual_seed(11 + paged)
    B, Hq, Hkv, E, Ev = 2, 4, 2, 64, 32
    kernel = attncc.compile(WINDOW)
    q = torch.randn(B, Hq, 3, E, generator=gen)
    k_new, v_new = torch.randn(B, Hkv, 2, E, generator=gen), torch.randn(B, Hkv, 2, Ev, generator=gen)
    seqlens = torch.tensor([5, 27], dtype=torch.int32)
    if paged:
        page, pages = 8, 10
        k_cache = torch.randn(pages, page, Hkv, E, generator=gen)
        v_cache = torch.randn(pages, page, Hkv, Ev, generator=gen)
        table = torch.randperm(pages, generator=gen)[:8].reshape(B, 4).int()
    else:
        k_cache = torch.randn(B, Hkv, 32, E, generator=gen)
        v_cache = torch.randn(B, Hkv, 32, Ev, generator=gen)
        table = None
    ref = attncc.decode_reference(kernel.variant, q.double(), k_cache.double(), v_cache.double(),
                                  cache_seqlens=seqlens, k_new=k_new.double(),
                                  v_new=v_new.double(), block_table=table)
    on = dict(q=q, k_new=k_new, v_new=v_new, seqlens=seqlens, table=table)
    on = {n: t if t is None else t.to(DEVICE) for n, t in on.items()}
    for splits in (1, 3):
        kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)  # copies on the CPU too: appended to
        if DEVICE == "cpu":
            kc, vc = kc.clone(), vc.clone()
        out = kernel.decode(on["q"], kc, vc, cache_seqlens=on["seqlens"], k_new=on["k_new"],
                            v_new=on["v_new"], block_table=on["table"], num_splits=splits)
        assert out.shape == (B, Hq, 3, Ev)
        _close(out, ref, f"decode, {splits} splits", 1e-5)
    with pytest.raises(CallError, match="v_new has shape"):
        kernel.decode(on["q"], kc, vc, cache_seqlens=on["seqlens"], k_new=on["k_new"],
                      v_new=on["k_new"], block_table=on["table"])


def test_packed_sequences_with_v_of_another_width():
    gen = torch.Generator().manual_seed(5)
    lens = [7, 1, 12]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    q = torch.randn(20, 2, 48, generator=gen)
    k = torch.randn(20, 2, 48, generator=gen)
    v = torch.randn(20, 2, 80, generator=gen)
    do = torch.randn(20, 2, 80, generator=gen)
    vk = attncc.varlen(CAUSAL)
    leaves = [t.to(DEVICE, copy=True).requires_grad_() for t in (q, k, v)]
    out = vk(*leaves, cu.to(DEVICE), cu.to(DEVICE), max(lens), max(lens))
    assert out.shape == (20, 2, 80)
    out.backward(do.to(DEVICE))
    start = 0
    for n in lens:
        part = [t[start:start + n].transpose(0, 1)[None].double().requires_grad_() for t in (q, k, v)]
        mask = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
        ref = sdpa64(*part, mask=mask)
        ref.backward(do[start:start + n].transpose(0, 1)[None].double())
        _close(out[start:start + n], ref[0].transpose(0, 1), "varlen out", 1e-5)
        for leaf, want in zip(leaves, part):
            _close(leaf.grad[start:start + n], want.grad[0].transpose(0, 1), "varlen grad", 1e-4)
        start += n


@pytest.mark.parametrize("Ev", [32, 96], ids=["v-narrower", "v-wider"])
def test_flash_api_takes_v_of_another_width(Ev):
    gen = torch.Generator().manual_seed(Ev)
    q = torch.randn(2, 11, 4, 64, generator=gen)
    k = torch.randn(2, 13, 2, 64, generator=gen)
    v = torch.randn(2, 13, 2, Ev, generator=gen)
    out = flash.flash_attn_func(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=True)
    assert out.shape == (2, 11, 4, Ev)
    mask = (torch.arange(11)[:, None] + 2) >= torch.arange(13)[None, :]  # bottom-right
    ref = sdpa64(*(t.transpose(1, 2).double() for t in (q, k, v)), mask=mask).transpose(1, 2)
    _close(out, ref, "flash_attn_func", 1e-5)
    k_cache = torch.randn(2, 16, 2, 64, generator=gen)
    v_cache = torch.randn(2, 16, 2, Ev, generator=gen)
    got = flash.flash_attn_with_kvcache(q[:, :2].to(DEVICE), k_cache.to(DEVICE),
                                        v_cache.to(DEVICE), cache_seqlens=9, causal=True)
    assert got.shape == (2, 2, 4, Ev)
    mask = (torch.arange(2)[:, None] + 7) >= torch.arange(9)[None, :]
    ref = sdpa64(q[:, :2].transpose(1, 2).double(), k_cache[:, :9].transpose(1, 2).double(),
                 v_cache[:, :9].transpose(1, 2).double(), mask=mask).transpose(1, 2)
    _close(got, ref, "flash_attn_with_kvcache", 1e-5)
    with pytest.raises(CallError, match="but for the headdim"):
        flash.flash_attn_func(q.to(DEVICE), k.to(DEVICE), v[:, :5].to(DEVICE), causal=True)


def test_gluon_takes_v_of_another_width_where_its_kernels_do():
    """The Gluon forward takes (192, 128) and (128, 64), its dQ and dK/dV kernels (192,
    128) alone; other pairs are refused with the reason (the portable kernels run them)."""
    from attncc.backends import named
    causal = attncc.parse("attention causal { mask q >= k }")
    why = lambda q, v, kind: named("gluon").supports_call(causal, q, q, v, kind)
    for d, dv in ((192, 128), (128, 64)):
        q = torch.randn(1, 1, 64, d, dtype=torch.bfloat16)
        v = torch.randn(1, 1, 64, dv, dtype=torch.bfloat16)
        assert why(q, v, "fwd") is None
        for kind, name in (("dq", "dQ"), ("dkdv", "dK/dV")):
            if (d, dv) == (192, 128):
                assert why(q, v, kind) is None
                continue
            assert f"v has head dim {dv} and q, k {d}: the Gluon {name} kernel" in why(q, v, kind)
            assert "only at (q·k, v) (192, 128) (the portable kernels take any)" in why(q, v, kind)
    q = torch.randn(1, 1, 64, 128, dtype=torch.float16)
    v = torch.randn(1, 1, 64, 32, dtype=torch.float16)
    refused = why(q, v, "fwd")
    assert "v has head dim 32" in refused and "(192, 128)" in refused and "portable" in refused
    q192 = torch.randn(1, 1, 64, 192, dtype=torch.float16)
    assert "head dim 192; the Gluon forward takes head dims 64, 128, 256" in why(q192, q192, "fwd")
    assert why(q, q, "fwd") is None


def test_tile_candidates_account_for_the_wider_head_dim():
    """The runtime picks tiles by the wider of the two dims: v 512 wide keeps only the
    small tiles, whatever q·k's width."""
    from attncc.arguments import Problem
    from attncc.backends.portable.tiles import kept_candidates
    variant = attncc.parse(CAUSAL)
    p = Problem(1, 1, 1, 64, 64, 64, 512)
    assert p.tile_dim == 512
    fwd = kept_candidates(variant, p.tile_dim, "fwd")
    assert fwd and all(c.block_m * c.block_n <= 64 * 32 and c.num_stages <= 2 for c in fwd)
    assert len(fwd) < len(kept_candidates(variant, 64, "fwd"))
    bwd = kept_candidates(variant, p.tile_dim, "dkdv")
    assert bwd and all(c.block_m * c.block_n <= 32 * 32 and c.num_stages == 1 for c in bwd)


def test_two_segment_head_dims_take_their_own_tiles_not_a_padded_256s():
    """q·k 192 (held as 128 + 64) takes tiles.WIDE_SEGMENTS: pipelined 8-warp backward
    tiles, 32x128 first for dK/dV and 128x64 for dQ, where the padded-256 rules left
    only 32x32 single-stage ones. 80 and 96 keep 128's candidates, 256 and v 512 theirs;
    a layout's block still bounds the tiles."""
    from attncc.arguments import Problem
    from attncc.backends.portable.tiles import held_width, kept_candidates
    variant = attncc.parse(CAUSAL)
    assert [held_width(d) for d in (192, 160, 200, 80, 96, 128, 256, 576, 8)] == [
        192, 160, 256, 80, 96, 128, 256, 576, 16]
    shape = lambda c: (c.block_m, c.block_n, c.num_warps, c.num_stages)
    dim = Problem(1, 16, 16, 64, 64, 192, 128).tile_dim
    dkdv, dq = kept_candidates(variant, dim, "dkdv"), kept_candidates(variant, dim, "dq")
    assert shape(dkdv[0]) == (32, 128, 8, 2) and shape(dq[0]) == (128, 64, 8, 3)
    for kept in (dkdv, dq):  # the four the tuner times: pipelined
        assert all(c.num_stages >= 2 for c in kept[:4])
    assert all(c.num_warps == 8 for c in dkdv[:4])
    assert kept_candidates(variant, dim, "bwd") == dkdv
    assert shape(kept_candidates(variant, dim, "fwd")[0]) == (64, 64, 4, 3)
    padded = kept_candidates(variant, 256, "dkdv")
    assert all(c.block_m * c.block_n <= 64 * 64 and c.num_stages == 1 for c in padded)
    for d in (80, 96):
        for direction in ("fwd", "dq", "dkdv"):
            assert kept_candidates(variant, d, direction) == kept_candidates(variant, 128, direction)
    blocks = attncc.load(os.path.join(os.path.dirname(__file__), "..", "examples", "dilated_blocks.attn"))
    assert blocks.block == 64
    kept = kept_candidates(blocks, 192, "dkdv")
    assert shape(kept[0]) == (64, 64, 8, 2) and shape(kept[-1]) == (64, 128, 8, 2)


ONE_PLUS_RELU = "attention one_plus_relu { mask q >= k  normalize sum  weight 1.0 + max(s, 0.0) }"


@pytest.mark.slow  # about 50 s: eight variants' forward and backward under the interpreter
@pytest.mark.parametrize("name,E,Ev,Lq,Lk,H,Hkv", [
    ("causal_bottom_right", 192, 128, 23, 9, 2, 2),  # len_q > len_k
    ("document", 192, 128, 21, 21, 3, 1),            # heads not a power of two, MQA
    ("softcap", 80, 96, 1, 19, 2, 2),                # one query token
    ("relative_bias", 192, 128, 21, 21, 3, 1),
    ("sigmoid_attention", 80, 96, 17, 30, 3, 3),
    (ONE_PLUS_RELU, 192, 128, 23, 9, 2, 2),
    ("dropout", 192, 128, 21, 21, 3, 1),
    ("gpt_oss_sinks", 80, 96, 1, 19, 2, 2),
], ids=lambda x: str(x).split(" {")[0])
def test_split_head_dims_backward_on_examples(name, E, Ev, Lq, Lk, H, Hkv):
    """The split backward in each kind of kernel code: a score (softcap), learnable inputs
    (relative_bias's table, the sinks), `normalize none` (sigmoid) and `sum`, dropout,
    tile tables and the one-launch backward (document), against float64 autograd of
    attncc.reference, lengths off the tile."""
    from test_kernels import compare
    variant = (attncc.parse(name) if "{" in name else
               attncc.load(os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.attn")))
    compare(variant, B=1, H=H, Hkv=Hkv, Lq=Lq, Lk=Lk, D=E, Dv=Ev, seed=E + Lq)


@pytest.mark.slow  # about 3 s
def test_split_head_dim_gradients_with_peaked_scores_match_sdpa():
    """(192, 128) with q scaled 6x (the softmax nearly one-hot, rows far apart in LSE)
    and v 50x: gradients against float64 SDPA, no NaN."""
    gen = torch.Generator().manual_seed(192)
    q = torch.randn(1, 3, 37, 192, generator=gen) * 6
    k = torch.randn(1, 3, 41, 192, generator=gen)
    v = torch.randn(1, 3, 41, 128, generator=gen) * 50
    do = torch.randn(1, 3, 37, 128, generator=gen)
    kernel = attncc.compile(CAUSAL)
    leaves = [t.to(DEVICE, copy=True).requires_grad_() for t in (q, k, v)]
    kernel(*leaves).backward(do.to(DEVICE))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    sdpa64(*ref_leaves, mask=torch.arange(37)[:, None] >= torch.arange(41)[None, :]).backward(do.double())
    for name, got, want in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        _close(got.grad, want.grad, name, 1e-4)


@pytest.mark.slow  # about 7 s: a model's forward and backward under the interpreter
def test_deepseek_v3_runs_with_v_unpadded_and_matches_eager():
    """transformers' DeepSeek-V3 hands attention q·k 24 wide and v 16 wide (unpadded);
    attncc's logits and gradients match the eager implementation's."""
    transformers = pytest.importorskip("transformers")
    import copy

    import attncc.integrations.transformers as hf
    hf.register("attncc")
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
        num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=64, n_group=1, topk_group=1)
    seen = []
    original = hf._Attention.__call__

    def spy(self, module, query, key, value, *a, **kw):
        seen.append((query.shape[-1], value.shape[-1]))
        return original(self, module, query, key, value, *a, **kw)

    torch.manual_seed(0)
    ref = transformers.DeepseekV3ForCausalLM._from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    ours = transformers.DeepseekV3ForCausalLM._from_config(copy.deepcopy(config),
                                                           attn_implementation="attncc")
    ours.load_state_dict(ref.state_dict())
    ours, ref = ours.to(DEVICE), ref.to(DEVICE)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    hf._Attention.__call__ = spy
    try:
        got = ours(ids, use_cache=False).logits
    finally:
        hf._Attention.__call__ = original
    want = ref(ids, use_cache=False).logits
    assert seen and all(s == (24, 16) for s in seen), seen
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    got.sum().backward()
    want.sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        if b.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-5 * max(1.0, b.grad.abs().max().item())), name


# ------------------------------------------------------------------ context parallelism
def _cp_rank(rank, world, init_file, out_dir):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        q, k, v, do = _cp_tensors()
        kernel = attncc.compile(CAUSAL)
        sharding = cp.Sharding.of(None, "zigzag")
        local = [sharding.shard(t).requires_grad_() for t in (q, k, v)]
        out = cp.context_parallel_attention(kernel, *local, scheme="zigzag")
        out.backward(sharding.shard(do))
        result = {name: sharding.unshard(t) for name, t in
                  [("out", out.detach()), ("dq", local[0].grad), ("dk", local[1].grad),
                   ("dv", local[2].grad)]}
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "cp.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _cp_tensors():
    gen = torch.Generator().manual_seed(77)
    S = 32
    return (torch.randn(1, 2, S, 32, generator=gen), torch.randn(1, 2, S, 32, generator=gen),
            torch.randn(1, 2, S, 16, generator=gen), torch.randn(1, 2, S, 16, generator=gen))


@pytest.mark.slow  # about 20 s: two spawned processes importing torch and attncc
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo over CPU tensors, the interpreter's "
                    "path; on GPUs benchmarks/context_parallel.py")
def test_context_parallel_with_v_of_another_width(tmp_path):
    attncc.compile(CAUSAL)  # generated once, so the ranks load it from the cache
    try:
        mp.spawn(_cp_rank, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    except Exception:
        errors = [open(tmp_path / f).read() for f in sorted(os.listdir(tmp_path))
                  if f.startswith("error-")]
        pytest.fail("a rank failed:\n" + "\n".join(errors or ["(no traceback)"]))
    got = torch.load(tmp_path / "cp.pt")
    q, k, v, do = _cp_tensors()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    S = q.shape[2]
    ref = sdpa64(*leaves, mask=torch.arange(S)[:, None] >= torch.arange(S)[None, :])
    ref.backward(do.double())
    assert got["out"].shape == (1, 2, S, 16) and got["dv"].shape == v.shape
    _close(got["out"], ref, "cp out", 1e-5)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        _close(got[name], leaf.grad, f"cp {name}", 1e-4)
    assert math.isfinite(got["dq"].abs().max().item())


# ------------------------------------------------------------------ non-powers of two
def test_q_k_head_dim_splits_into_power_of_two_segments_not_padding():
    """192 = 128 + 64, 80 = 64 + 16, 96 = 64 + 32, 576 = 512 + 64; a power of two is one
    segment. The forward's, decoding's and the backward's step code sums the second
    segment's product into the first's (the dK/dV step in its transposed orientation),
    and dQ and dK accumulate their second segment on their own."""
    kernel = attncc.compile(CAUSAL)
    split = kernel.module._head_dim_split
    assert [split(d) for d in (192, 80, 96, 576, 128, 64, 24)] == [
        (128, 64), (64, 16), (64, 32), (512, 64), (128, 0), (64, 0), (16, 16)]
    source = kernel.source
    assert source.count("tl.dot(q_tail, kt_tail, qk, input_precision=DOT_PRECISION)") == 3
    assert source.count("tl.dot(k_tail, qt_tail, qk, input_precision=DOT_PRECISION)") == 1
    assert source.count("dq_tail = tl.dot(") == 1 and source.count("dk_tail = tl.dot(") == 1


@pytest.mark.parametrize("E", [96, 192])
def test_non_power_of_two_forward_and_decode_launch_unpadded_and_match_sdpa(E, monkeypatch):
    """The forward and decode launches get HEAD_DIM_PAD + HEAD_DIM_TAIL = E's segments (no
    256-wide tile for 192), and their results match float64 SDPA."""
    kernel = attncc.compile(CAUSAL)
    seen = {}
    _record_launches(monkeypatch, kernel.module, ("attn_fwd", "decode_split"), seen)
    gen = torch.Generator().manual_seed(E)
    q, k = torch.randn(1, 2, 13, E, generator=gen), torch.randn(1, 2, 13, E, generator=gen)
    v = torch.randn(1, 2, 13, 48, generator=gen)
    mask = torch.arange(13)[:, None] >= torch.arange(13)[None, :]
    _close(kernel(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)),
           sdpa64(q.double(), k.double(), v.double(), mask), "forward", 1e-5)
    out = kernel.decode(q[:, :, -2:].to(DEVICE), k.to(DEVICE, copy=True), v.to(DEVICE, copy=True),
                        cache_seqlens=13)
    _close(out, sdpa64(q.double(), k.double(), v.double(), mask)[:, :, -2:], "decode", 1e-5)
    first = 1 << (E.bit_length() - 1)
    for name in ("attn_fwd", "decode_split"):
        assert (seen[name]["HEAD_DIM_PAD"], seen[name]["HEAD_DIM_TAIL"]) == (first, E - first)


# ------------------------------------------------------------------ MLA decoding
def _record_launches(monkeypatch, module, names, seen):
    """Wrap the module's kernels `names` so that each launch's constexpr keywords are
    recorded in seen[name] (and the kernel still runs)."""
    for name in names:
        class Recording:
            def __init__(self, launcher, name):
                self.launcher, self.name = launcher, name

            def __getitem__(self, grid):
                def launch(*args, **kw):
                    seen[self.name] = kw
                    return self.launcher[grid](*args, **kw)
                return launch
        monkeypatch.setattr(module, name, Recording(getattr(module, name), name))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_mla_decode_takes_v_from_the_k_tile_and_appends_k_alone(paged, monkeypatch):
    """MLA decoding: one latent cache 576 wide whose first 512 columns are the values
    (v = k[..., :512], the same storage), 16 query heads on one kv head, 2 new tokens
    appended. The kernels are told V_IS_K (P·V reuses the K tile's first segment; the
    append writes k only), and the result matches decode_reference on a copy."""
    gen = torch.Generator().manual_seed(576 + paged)
    B, H, E, Ev, n_q = 2, 16, 576, 512, 2
    kernel = attncc.compile(CAUSAL)
    seen = {}
    _record_launches(monkeypatch, kernel.module, ("decode_split", "decode_append"), seen)
    q = torch.randn(B, H, n_q, E, generator=gen) * 0.1
    if paged:
        cache = torch.randn(6, 16, 1, E, generator=gen)
        table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    else:
        cache, table = torch.randn(B, 1, 40, E, generator=gen), None
    k_new = torch.randn(B, 1, 2, E, generator=gen)
    seqlens = torch.tensor([3, 30], dtype=torch.int32)
    copy = cache.clone()
    q, cache, k_new, seqlens = (t.to(DEVICE) for t in (q, cache.clone(), k_new, seqlens))
    table = table if table is None else table.to(DEVICE)
    ref = attncc.decode_reference(kernel.variant, q.double().cpu(), copy.double(),
                                  copy[..., :Ev].double(), cache_seqlens=seqlens.cpu(),
                                  k_new=k_new.double().cpu(), v_new=k_new[..., :Ev].double().cpu(),
                                  block_table=table if table is None else table.cpu())
    out = kernel.decode(q, cache, cache[..., :Ev], cache_seqlens=seqlens, k_new=k_new,
                        v_new=k_new[..., :Ev], block_table=table, num_splits=2)
    assert out.shape == (B, H, n_q, Ev)
    _close(out, ref, "MLA decode", 1e-5)
    assert seen["decode_split"]["V_IS_K"] and seen["decode_append"]["V_IS_K"]
    assert (seen["decode_split"]["HEAD_DIM_PAD"], seen["decode_split"]["HEAD_DIM_TAIL"]) == (512, 64)
    with pytest.raises(CallError, match=r"pass v_new=k_new\[\.\.\., :512\]"):
        kernel.decode(q, cache, cache[..., :Ev], cache_seqlens=seqlens, k_new=k_new,
                      v_new=k_new[..., :Ev].clone(), block_table=table)
    # v in a cache of its own: read as usual.
    separate = torch.randn(*cache.shape[:-1], Ev, generator=gen).to(DEVICE)
    kernel.decode(q, cache.clone(), separate, cache_seqlens=seqlens, block_table=table)
    assert not seen["decode_split"]["V_IS_K"]


def _mla_formula(q, latent, n_q):
    """MLA decoding written from its definition, in float64: q (H, n_q, 576) against one
    row's latent sequence (L, 576), query token i at position L - n_q + i, causal, scale
    1/sqrt(576), values the latent's first 512 columns; a token before position 0 sees
    no key and gives 0."""
    L = latent.shape[0]
    s = q.double() @ latent.double().T / math.sqrt(q.shape[-1])  # (H, n_q, L)
    allowed = (L - n_q + torch.arange(n_q))[:, None] >= torch.arange(L)[None, :]
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    return p @ latent[:, :512].double()


def _mla_case(paged, gen, B, H, n_q, n_new, cached, capacity, page=16):
    """A latent cache (contiguous, or in shuffled pages of `page`) holding `cached[b]`
    positions of each row's latent sequence, NaN everywhere a call must not read; q,
    k_new; and the rows' whole latent sequences after the append (for _mla_formula)."""
    E = 576
    logical = torch.randn(B, capacity, E, generator=gen)
    k_new = torch.randn(B, 1, n_new, E, generator=gen)
    q = torch.randn(B, H, n_q, E, generator=gen) * 2  # peaked softmax rows
    rows = [torch.cat([logical[b, :cached[b]], k_new[b, 0]]) for b in range(B)]
    dense = logical.clone()
    for b in range(B):
        dense[b, cached[b]:] = math.nan
    if not paged:
        return q, dense[:, None], None, k_new, rows
    per_row = capacity // page
    table = torch.randperm(B * per_row + 1, generator=gen)[:B * per_row].reshape(B, per_row)
    cache = torch.full((B * per_row + 1, page, 1, E), math.nan)
    for b in range(B):
        for j in range(per_row):
            cache[table[b, j], :, 0] = dense[b, j * page:(j + 1) * page]
    return q, cache, table.int(), k_new, rows


# (paged, B, heads, n_q, n_new, keys cached per row, splits)
MLA_ROW_TILE_CASES = [
    pytest.param((True, 1, 17, 4, 2, [37], 1), id="paged-68rows"),
    pytest.param((False, 2, 32, 3, 2, [0, 41], 2), id="contiguous-ragged-96rows"),
    pytest.param((False, 2, 128, 4, 1, [29, 6], 3), id="contiguous-128heads-nq4"),  # 8 row tiles
]


@pytest.mark.slow  # 1.5-9 s each: the interpreter at 576 wide, 64 rows a program
@pytest.mark.parametrize("case", MLA_ROW_TILE_CASES)
def test_mla_decode_at_eight_warps_over_row_tiles(case):
    """MLA decoding at the 8-warp config the GPU's tuner chooses among (pinned here: the
    interpreter ignores warps but runs the same kernel) with more rows (query heads x new
    tokens) than one program's 64: row tiles (the last part empty) reading the same K
    tiles; splits, tokens appended, tiles off the 16-key grid, a row holding
    fewer keys than n_q (its first token sees none), MLA's 128 heads; against the formula and
    decode_reference in float64."""
    paged, B, H, n_q, n_new, cached, splits = case
    gen = torch.Generator().manual_seed(5760 + paged)
    q, cache, table, k_new, rows = _mla_case(paged, gen, B, H, n_q, n_new, cached, 64)
    kernel = attncc.compile(CAUSAL)
    config = dict(BLOCK_N=16, num_warps=8, num_stages=2, num_splits=splits)
    seqlens = torch.tensor(cached, dtype=torch.int32)
    ref = attncc.decode_reference(kernel.variant, q.double(), cache.double(),
                                  cache[..., :512].double(), cache_seqlens=seqlens,
                                  k_new=k_new.double(), v_new=k_new[..., :512].double(),
                                  block_table=table)
    cache, q, k_new, seqlens = (t.to(DEVICE) for t in (cache, q, k_new, seqlens))
    out = kernel.decode(q, cache, cache[..., :512], cache_seqlens=seqlens, k_new=k_new,
                        v_new=k_new[..., :512], config=config,
                        block_table=table if table is None else table.to(DEVICE))
    want = torch.stack([_mla_formula(q[b].cpu(), rows[b], n_q) for b in range(B)])
    _close(out, want, "MLA decode against the formula", 1e-5)
    _close(out, ref, "MLA decode against decode_reference", 1e-5)
    if cached[0] + n_new < n_q:  # tokens before position 0: no key
        assert out[0, :, :n_q - cached[0] - n_new].abs().max() == 0
    plan = list(kernel._decode_plans.values())[-1]
    assert plan.config == config and plan.problem.v_is_k
    assert plan.problem.row_tiles == -(-H * n_q // 64) > 1


def test_mla_decode_configs_hold_the_accumulator_at_eight_warps():
    """MLA at its benchmark shape (B=32, 128 heads on one latent head, 576/512): a 64 x 512
    fp32 P·V accumulator is 256 registers a thread at 4 warps (ptxas spilled 2.8 KB a
    thread there), so every candidate runs 8 warps; the K tile is the V tile, so 64-key
    tiles in two stages fit shared memory; the splits fill the 132 SMs once (one
    program each: 2 row tiles x 32 rows x 2 splits = 128)."""
    from attncc.runtime.decoding import DecodeProblem, candidates, tuning_key
    variant = attncc.parse(CAUSAL)
    reach = lambda bn: 32768 // bn
    mla = DecodeProblem(32, 128, 1, 1, 0, 576, 32768, 0, 512, v_is_k=True)
    assert mla.wide_accumulator and mla.row_tiles == 2
    first = candidates(variant, mla, 2, 132, reach)
    assert first[0] == dict(BLOCK_N=64, num_warps=8, num_stages=2, num_splits=2)
    assert {c["num_warps"] for c in first} == {8}
    four = DecodeProblem(32, 128, 1, 4, 0, 576, 32768, 0, 512, v_is_k=True)
    assert four.row_tiles == 8 and candidates(variant, four, 2, 132, reach)[0]["num_splits"] == 1
    # A v cache of its own: its tiles take shared memory too, 64 keys in two stages do not fit.
    separate = DecodeProblem(32, 128, 1, 1, 0, 576, 32768, 0, 512)
    assert candidates(variant, separate, 2, 132, reach)[0]["BLOCK_N"] == 32
    assert tuning_key(mla, torch.bfloat16, None) != tuning_key(separate, torch.bfloat16, None)
    # Head dims to 256 keep their 4-warp tiles.
    assert not DecodeProblem(8, 32, 8, 1, 0, 256, 32768, 0).wide_accumulator
    assert candidates(variant, DecodeProblem(8, 32, 8, 1, 0, 128, 32768, 0), 2, 132,
                      reach)[0]["num_warps"] == 4


@pytest.mark.slow  # Dynamo's first compile in a process takes seconds
def test_torch_compile_traces_v_of_another_width():
    """The operator's fake implementation gives the output and dV v's width, so a traced
    graph (FakeTensors) agrees with the eager call."""
    kernel = attncc.compile(CAUSAL)
    traced = torch.compile(lambda q, k, v: kernel(q, k, v), backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 2, 9, 32, generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 9, 16, generator=gen).to(DEVICE).requires_grad_()
    out = traced(q, k, v)
    out.sum().backward()
    assert out.shape == (1, 2, 9, 16) and v.grad.shape == v.shape
    assert torch.equal(out, kernel(q, k, v))
