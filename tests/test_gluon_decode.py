"""The Gluon MLA decode without a GPU: what its module renders, which calls it takes and
why it refuses the others (backends/gluon/decode.py), and how the decode role is given
to it or to the portable decode (runtime/decoding.py's decode_backends and
decode_config). Its sm_90 compile is tests/test_gluon_compile.py's; its results are held
to decode_reference on the GPU by benchmarks/head_dims_v.py --part correctness.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import attncc
from attncc import backends
from attncc.backends.gluon import codegen as gluon_codegen, decode as gluon_decode
from attncc.errors import BackendError
from attncc.runtime import decoding, tuning

MLA = "attention mla { scale 1.0 / sqrt(192.0) mask q >= k }"
GLUON, PORTABLE = backends.named("gluon"), backends.portable()


def latent(batch=2, capacity=128, dim=576, dtype=torch.bfloat16, paged=False, page=64):
    """A latent cache and its v view, contiguous (batch, 1, capacity, dim) or paged."""
    shape = (batch * capacity // page, page, 1, dim) if paged else (batch, 1, capacity, dim)
    k = torch.randn(shape, dtype=dtype)
    return k, k[..., :512]


def problem(k, v, *, n_q=1, heads=128, batch=2, paged=False):
    q = torch.randn(batch, heads, n_q, k.shape[-1], dtype=k.dtype)
    table = (torch.arange(batch * (k.shape[0] // batch), dtype=torch.int32).view(batch, -1)
             if paged else None)
    module = attncc.compile(MLA).module
    return decoding.decode_problem(q, k, v, None, table, module.v_is_k(k, v))


def mla_problem(batch, capacity, n_q=1):
    """A contiguous MLA decode call's sizes, without its tensors."""
    return decoding.DecodeProblem(batch, 128, 1, n_q, 0, 576, capacity, 0, 512, True)


def fake_kernel(requested="auto", spec=MLA, able=(GLUON, PORTABLE)):
    """What decode_backends reads of a Kernel compiled with backend=`requested` on a
    machine where the backends `able` can run the variant."""
    variant = attncc.parse(spec)
    return SimpleNamespace(variant=variant, requested_backend=requested, backends=tuple(able),
                           backend_reason=f"backend='{PORTABLE.name}' was asked for")


def test_the_gluon_module_holds_the_mla_decode_only_for_variants_it_takes():
    source = gluon_codegen.generate(attncc.parse(MLA)).source
    assert "def decode_mla_split(" in source and "def decode_mla_plan(" in source
    # One kernel for both pairs: the values are the K tile's first columns, or V's tiles.
    assert "if V_IS_K:\n        v_smem = k_smem" in source
    alibi = attncc.load("examples/alibi.attn")  # reads `slopes`, an input tensor
    assert not gluon_codegen.template_context(alibi)["gluon_decode"]  # what the template tests
    assert "slopes" in gluon_decode.variant_refusal(alibi)


@pytest.mark.parametrize("spec, words", [
    ("attention a { input w: f32[h] score s + w[h] }", "reads input tensors (w)"),
    ("attention a { normalize none weight sigmoid(s) }", "softmax only"),
    ("attention a { input sk: f32[h] sink sk[h] }", "reads input tensors"),
])
def test_variants_the_gluon_decode_refuses_are_named(spec, words):
    assert words in gluon_decode.variant_refusal(attncc.parse(spec))


def test_mla_calls_it_takes_and_the_reason_for_each_it_refuses():
    k, v = latent()
    assert gluon_decode.call_refusal(problem(k, v), k.dtype, k, v, True) is None
    k, v = latent(paged=True)
    assert gluon_decode.call_refusal(problem(k, v, paged=True), k.dtype, k, v, True) is None
    k, v = latent(paged=True, page=32)  # a page holds half a key tile
    why = gluon_decode.call_refusal(problem(k, v, paged=True), k.dtype, k, v, True)
    assert "pages hold 32 positions" in why and "multiple of 64" in why
    k = torch.randn(2, 1, 128, 576, dtype=torch.bfloat16)
    v = torch.randn(2, 1, 128, 512, dtype=torch.bfloat16)  # a separate v
    assert "not a view of k_cache" in gluon_decode.call_refusal(problem(k, v), k.dtype, k, v, False)
    k, v = latent(dim=192)
    assert "(576, 512) and (64, 512) only" in gluon_decode.call_refusal(problem(k, v), k.dtype, k,
                                                                        v, False)
    # (64, 512): keys 64 wide beside a v cache of its own, contiguous or paged.
    k = torch.randn(2, 1, 128, 64, dtype=torch.float16)
    v = torch.randn(2, 1, 128, 512, dtype=torch.float16)
    assert gluon_decode.call_refusal(problem(k, v), k.dtype, k, v, False) is None
    v = torch.randn(2, 1, 128, 256, dtype=torch.float16)
    assert "q·k is 64 wide and v 256" in gluon_decode.call_refusal(problem(k, v), k.dtype, k, v,
                                                                   False)
    k, v = latent(dtype=torch.float32)
    assert "float16 and bfloat16" in gluon_decode.call_refusal(problem(k, v), k.dtype, k, v, True)
    # A cache whose rows are not 16-byte aligned cannot be read by TMA.
    odd = torch.randn(2, 1, 128, 577, dtype=torch.bfloat16)[..., :576]
    assert "16-byte aligned rows" in gluon_decode.call_refusal(problem(odd, odd[..., :512]),
                                                               odd.dtype, odd, odd[..., :512], True)


def test_the_decode_role_goes_to_both_backends_under_auto_and_to_the_one_asked_for():
    k, v = latent()
    p = problem(k, v)
    assert decoding.decode_backends(fake_kernel(), p, k.dtype, k, v, None) == ("both", None)
    gluon, why = decoding.decode_backends(fake_kernel("gluon", able=(GLUON,)), p, k.dtype, k, v, None)
    assert gluon == "only" and "backend='gluon' was asked for" in why
    gluon, why = decoding.decode_backends(fake_kernel(PORTABLE.name, able=(PORTABLE,)), p,
                                          k.dtype, k, v, None)
    assert gluon == "" and why == f"backend='{PORTABLE.name}' was asked for"
    # Auto on a call the Gluon decode refuses: the portable decode, and why.
    k2 = torch.randn(2, 1, 128, 576, dtype=torch.bfloat16)
    v2 = torch.randn(2, 1, 128, 512, dtype=torch.bfloat16)
    gluon, why = decoding.decode_backends(fake_kernel(), problem(k2, v2), k2.dtype, k2, v2, None)
    assert gluon == "" and "the portable decode runs it" in why and "not a view" in why
    # A pinned config is the portable decode's under auto; the Gluon one's when asked for.
    pin = dict(BLOCK_N=64, num_warps=8, num_stages=2, num_splits=4)
    assert decoding.decode_backends(fake_kernel(), p, k.dtype, k, v, pin)[0] == ""
    assert decoding.decode_backends(fake_kernel("gluon", able=(GLUON,)), p, k.dtype, k, v, pin)[0] == "only"


def test_backend_gluon_on_a_call_its_decode_refuses_raises_the_reason():
    k = torch.randn(2, 1, 128, 576, dtype=torch.bfloat16)
    v = torch.randn(2, 1, 128, 512, dtype=torch.bfloat16)
    with pytest.raises(BackendError, match="not a view of k_cache.*backend='auto'"):
        decoding.decode_backends(fake_kernel("gluon", able=(GLUON,)), problem(k, v), k.dtype, k, v,
                                 None)
    k, v = latent()
    with pytest.raises(BackendError, match="BLOCK_N 32.*runs BLOCK_N 64"):
        decoding.decode_backends(fake_kernel("gluon", able=(GLUON,)), problem(k, v), k.dtype, k, v,
                                 dict(BLOCK_N=32, num_warps=8, num_stages=2, num_splits=1))
    with pytest.raises(BackendError, match="reads input tensors"):
        decoding.decode_backends(fake_kernel("gluon", "attention a { input w: f32[h] score s + w[h] }",
                                             able=(GLUON,)), problem(k, v), k.dtype, k, v, None)


def _untuned_config(monkeypatch, kernel, p, dtype, gluon, **pins):
    """decode_config as on a 132-SM GPU with ATTNCC_TUNE=0."""
    monkeypatch.setattr(decoding, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("attncc.runtime.settings.interpreting", lambda: False)
    monkeypatch.setenv("ATTNCC_TUNE", "0")
    monkeypatch.setattr(tuning, "_MEMORY", {})
    return decoding.decode_config(kernel, p, dtype, None, gluon=gluon, **pins)


def test_untuned_mla_decode_runs_the_gluon_kernel_first(monkeypatch):
    kernel = attncc.compile(MLA)
    p, dtype = mla_problem(32, 4096), torch.bfloat16
    cfg = _untuned_config(monkeypatch, kernel, p, dtype, "both")
    # 32 rows x 2 row tiles = 64 programs: two splits fill the 132 SMs once.
    assert cfg == dict(BLOCK_N=64, num_warps=8, num_stages=2, num_splits=2, backend="gluon")
    cfg = _untuned_config(monkeypatch, kernel, p, dtype, "")
    assert "backend" not in cfg
    cfg = _untuned_config(monkeypatch, kernel, p, dtype, "only", num_splits=5)
    assert cfg["backend"] == "gluon" and cfg["num_splits"] == 5


def test_tuned_configs_keep_their_backend_and_their_own_keys():
    cfg = dict(BLOCK_N=64, num_warps=8, num_stages=2, num_splits=3, backend="gluon")
    assert decoding.check_tuned_config(cfg, "x") == cfg
    with pytest.raises(ValueError):
        decoding.check_tuned_config(dict(cfg, backend="other"), "x")
    with pytest.raises(ValueError):  # a pin names no backend: the call's backend= does
        decoding.check_decode_config(cfg, "config")
    k, v = latent()
    p = problem(k, v)
    keys = {decoding.tuning_key(p, k.dtype, None, g) for g in ("", "only", "both")}
    assert len(keys) == 3  # each set of candidates tunes apart
    assert decoding.tuning_key(p, k.dtype, None) == decoding.tuning_key(p, k.dtype, None, "")
    assert decoding.label(cfg).startswith("Gluon BLOCK_N 64")


def test_gluon_candidates_fill_one_wave_with_at_least_four_tiles_a_split():
    splits = [c["num_splits"] for c in gluon_decode.candidates(mla_problem(32, 32768), 132, None)]
    assert splits == [2, 1, 4]
    p4 = mla_problem(32, 32768, n_q=4)  # 256 programs: more than a wave already
    assert [c["num_splits"] for c in gluon_decode.candidates(p4, 132, None)] == [1, 2]
    assert [c["num_splits"] for c in gluon_decode.candidates(p4, 132, 7)] == [7]
    short = mla_problem(1, 128)  # 2 tiles: one split
    assert [c["num_splits"] for c in gluon_decode.candidates(short, 132, None)] == [1, 2]


def test_a_decode_plan_says_which_backend_runs_it_and_why():
    # Asked for the portable kernels, the plan says so (benchmarks print plan.backend and
    # plan.reason beside the config); on a GPU too, where the call's tensors live there.
    kernel = attncc.compile("attention small { mask q >= k }", backend=PORTABLE.name)
    gen = torch.Generator().manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 2, 1, 16, generator=gen).to(device)
    cache = torch.randn(1, 2, 20, 16, generator=gen).to(device)
    kernel.decode(q, cache, cache.clone(), cache_seqlens=7)
    (plan,) = kernel._decode_plans.values()
    assert plan.backend == PORTABLE.name and plan.reason == f"backend='{PORTABLE.name}' was asked for"
    assert "backend" not in plan.config


@pytest.mark.parametrize("paged, splits, dim", [(False, 3, 576), (True, 1, 576), (True, 2, 64)])
def test_the_gluon_plan_launches_its_kernel_with_every_argument_and_the_portable_merge(paged, splits,
                                                                                       dim):
    # The host side without a GPU: a launcher that records each launch. decode_mla_split
    # gets one argument per parameter (its constexprs as options), on one program per
    # 64 rows and split; the splits are merged by the portable module's decode_merge.
    kernel = attncc.compile(MLA)
    gluon = kernel.module_of("gluon")
    k, v = latent(batch=2, capacity=256, paged=paged, dim=dim)
    if dim == 64:  # (64, 512): a v cache of its own
        v = torch.randn(*k.shape[:3], 512, dtype=k.dtype)
    q = torch.randn(2, 128, 2, dim, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32).view(2, 4) if paged else None
    lens = torch.tensor([5, 200], dtype=torch.int32)
    launches = []

    def launcher(fn, grid, options):
        return lambda *args: launches.append((fn, grid, options, args))

    cfg = dict(BLOCK_N=64, num_warps=8, num_stages=2, num_splits=splits, backend="gluon")
    run = gluon.decode_mla_plan(q, k, v, lens, table, portable=kernel.module, config=cfg,
                                v_is_k=dim == 576, launcher=launcher)
    out, lse = run(q, k, v, lens, {}, None, None, table)
    assert out.shape == (2, 128, 2, 512) and lse.shape == (2, 128, 2)
    fn, grid, options, args = launches[0]
    assert fn is gluon.decode_mla_split and grid == (2 * 4, splits)  # 256 rows: 4 row tiles
    # num_warps and the compile options every launch states are no parameters.
    assert options["enable_fp_fusion"] is True
    assert len(args) + len(options) - 2 == len(fn.arg_names)
    assert options["PAGED"] == paged and options["ONE_SPLIT"] == (splits == 1)
    assert (options["HEAD_DIM"], options["HEAD_DIM_TAIL"]) == ((512, 64) if dim == 576 else (64, 0))
    assert options["HEAD_DIM_V"] == 512 and options["V_IS_K"] == (dim == 576)
    assert [f for f, *_ in launches[1:]] == ([kernel.module.decode_merge] if splits > 1 else [])


def test_untuned_64_512_decode_runs_the_portable_kernel_first(monkeypatch):
    # No prediction at (64, 512): the portable configs first, the Gluon ones after them.
    kernel = attncc.compile(MLA)
    p = decoding.DecodeProblem(32, 128, 1, 1, 0, 64, 4096, 0, 512, False)
    cfg = _untuned_config(monkeypatch, kernel, p, torch.bfloat16, "both")
    assert "backend" not in cfg
