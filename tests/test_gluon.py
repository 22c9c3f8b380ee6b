"""The Gluon backend on the CPU: its module renders and parses, shares the portable
module's expressions, and the dispatch (`backend=`, `attncc compile --backend`) picks,
explains and refuses as documented. The kernels themselves run only on an sm_90 GPU:
benchmarks/gluon_check.py holds them to the float64 reference there.
"""
import ast
from pathlib import Path

import pytest
import torch

import attncc
from attncc.backends.gluon import codegen as gluon
from attncc.runtime import backends, configs, tuning
from attncc.tools.cli import main
from attncc.backends.portable.codegen import generate, template_context

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# One per skipping strategy and slot: dense, one analytic interval, two intervals, tables
# from a tensor mask, a layout, index lists, a score with a tensor read, a learnable input.
SAMPLE = ["full", "causal", "prefix_lm", "document", "bigbird", "nsa_topk", "alibi",
          "relative_bias"]


def _imports(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", SAMPLE)
def test_gluon_module_renders_parses_and_stands_alone(name):
    variant = attncc.parse_file(EXAMPLES / f"{name}.attn")
    assert gluon.variant_unsupported(variant) is None
    source = gluon.generate(variant).source
    tree = ast.parse(source)
    # The standard library, torch, triton: no other module, the portable one included.
    assert _imports(tree) <= {"functools", "math", "torch", "triton"}
    assert "host." not in source
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {"attn_fwd", "attn_fwd_ws", "_ws_loader", "_ws_consumer", "forward",
            "attn_bwd_dkdv", "backward_dkdv", "attn_bwd_dq", "backward_dq",
            "_common_args", "_grid", "RingCounter", "TileRing", "Channel", "Turns"} <= defined
    # The same mask and score code as the portable module: emitted once, in codegen.
    context = template_context(variant)
    for slot in ("mask", "score", "layout_elem"):
        if context[slot]:
            assert context[slot] in source and context[slot] in generate(variant).source


def test_gluon_module_takes_the_portable_argument_list():
    """The Gluon kernels take the argument values the shared host side builds
    (codegen/templates/host_args.jinja's _common_args, as the portable kernels do), so
    they must declare COMMON_PARAMS in the same order."""
    variant = attncc.parse_file(EXAMPLES / "document.attn")
    tree = ast.parse(gluon.generate(variant).source)
    params = template_context(variant)["common_param_list"]
    for fn, before in (("attn_fwd", 5), ("attn_fwd_ws", 5), ("attn_bwd_dkdv", 8),
                       ("attn_bwd_dq", 16)):
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn)
        names = [a.arg for a in node.args.args]
        assert names[before:before + len(params)] == params


@pytest.mark.parametrize("name", ["document", "relative_bias"])
def test_both_modules_build_the_same_launch_arguments(name):
    # The host side (codegen/templates/host_args.jinja) is rendered into each module: for
    # the same call they hand their kernels the same values, tile tables included.
    from attncc.arguments import Problem
    from attncc.runtime.cache import load_generated
    from attncc.semantics.samples import sample_inputs
    variant = attncc.parse_file(EXAMPLES / f"{name}.attn")
    p = Problem(batch=2, heads_q=4, heads_kv=2, len_q=200, len_k=300, dim=64, dim_v=64,
                q_offset=100)
    inputs = sample_inputs(variant, p)
    q = torch.randn(2, 4, 200, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 300, 64, dtype=torch.bfloat16)
    call = dict(q_offset=100, k_offset=0, seed=3, block_m=64, block_n=128, tables=None,
                per_head=(k,))
    portable = load_generated(variant)[1]._common_args(q, k, inputs, None, **call)
    own = load_generated(variant, "gluon")[1]._common_args(q, k, inputs, None, **call)
    assert own[1] == portable[1]  # WIDE
    assert len(own[0]) == len(portable[0]) == len(template_context(variant)["common_param_list"])
    for a, b in zip(own[0], portable[0]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_variants_the_gluon_forward_does_not_take_are_named():
    dropout = attncc.parse_file(EXAMPLES / "dropout.attn")
    assert "dropout 0.1" in gluon.variant_unsupported(dropout)
    small_lists = attncc.parse("attention t { input top: i32[b, h, qb, 4] layout kb in top[b, h, qb] block 32 }")
    assert "at least 64 rows" in gluon.variant_unsupported(small_lists)
    lists64 = attncc.parse("attention t { input top: i32[b, h, qb, 4] layout kb in top[b, h, qb] block 64 }")
    assert gluon.variant_unsupported(lists64) is None
    # Its tiles must nest in the 64-blocks: only 64-row, 64-column configs are offered.
    kept = configs.kept_candidates(lists64, 128, "gluon-fwd")
    assert kept and all(c["BLOCK_M"] <= 64 and c["BLOCK_N"] <= 64 for c in kept)


def test_calls_the_gluon_forward_does_not_take_are_named():
    q = torch.randn(1, 2, 8, 128, dtype=torch.bfloat16)
    assert backends.call_unsupported(q, q, q) is None
    f32 = q.float()
    assert "float32" in backends.call_unsupported(f32, f32, f32)
    d96 = torch.randn(1, 2, 8, 96, dtype=torch.float16)
    assert "head dim 96" in backends.call_unsupported(d96, d96, d96)
    kt = torch.randn(1, 2, 128, 8, dtype=torch.bfloat16).transpose(2, 3)  # head dim strided
    assert "k has strides" in backends.call_unsupported(q, kt, q)
    odd = torch.randn(1, 2, 8, 129, dtype=torch.bfloat16)[..., :128]  # rows of 258 bytes
    assert "16-byte aligned" in backends.call_unsupported(q, q, odd)


def test_candidates_fit_and_pinned_configs_are_checked():
    for dim in gluon.HEAD_DIMS:
        configs = gluon.candidates(dim)
        assert configs and all(gluon.smem_bytes(c, dim) <= gluon.SMEM_LIMIT for c in configs)
        assert all(gluon.check_config(c, dim) is None for c in configs)
    assert "BLOCK_M >= 16 * num_warps" in gluon.check_config(
        dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1), 128)
    assert "shared memory" in gluon.check_config(
        dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3), 256)


def test_backward_candidates_fit_and_bad_configs_are_named():
    for dim in gluon.BACKWARD_HEAD_DIMS:
        kept = gluon.backward_candidates(dim)
        assert kept and all(gluon.check_backward_config(c, dim) is None for c in kept)
    assert gluon.backward_candidates(256) == [] and gluon.dq_candidates(256) == []
    for dim in gluon.BACKWARD_HEAD_DIMS:
        kept = gluon.dq_candidates(dim)
        assert kept and all(gluon.check_dq_config(c, dim) is None for c in kept)
    causal = attncc.parse_file(EXAMPLES / "causal.attn")
    assert "head dim 256" in gluon.backward_unsupported(causal, "dkdv", 256)
    assert gluon.backward_unsupported(causal, "dq", 128) is None
    assert "multiple of 16 * num_warps" in gluon.check_dq_config(
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2), 128)
    # 8 warps stack 128 rows of wgmma: a 64-key tile cannot be split among them.
    assert "multiple of 16 * num_warps" in gluon.check_backward_config(
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2), 128)
    assert "shared memory" in gluon.check_backward_config(
        dict(BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3), 128)
    # A cached or shipped config is checked against the kernel it would run.
    variant = attncc.parse_file(EXAMPLES / "causal.attn")
    good = gluon.backward_candidates(128)[0]
    assert configs.usable(good, variant, 128, "gluon-dkdv")
    assert not configs.usable(dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2), variant,
                              128, "gluon-dkdv")


def _stand_in_gluon(kernel, monkeypatch, calls):
    """The kernel's backend set to Gluon, its Gluon module a stand-in that runs the
    portable kernels and records what it was asked (the CPU cannot run Hopper kernels)."""
    from types import SimpleNamespace

    def forward(q, k, v, values, *, host, config, **common):
        calls.append("forward")
        return host.forward(q, k, v, values, config=config, **common)

    def backward_dkdv(q, k, v, lse, delta, dout, values, *, host, config, **common):
        calls.append("dkdv")
        return host.backward_dkdv(q, k, v, lse, delta, dout, values, config=config, **common)

    def backward_dq(q, k, v, lse, delta, dout, values, *, host, config, out=None, **common):
        calls.append("dq")
        return host.backward_dq(q, k, v, lse, delta, dout, values, config=config, out=out,
                                **common)

    monkeypatch.setattr(backends, "call_unsupported", lambda q, k, v: None)
    monkeypatch.setattr(kernel, "backend", "gluon")
    monkeypatch.setattr(kernel, "requested_backend", "gluon")
    monkeypatch.setattr(kernel, "_gluon_generated", (None, SimpleNamespace(
        forward=forward, backward_dq=backward_dq, backward_dkdv=backward_dkdv)))


def test_the_backward_runs_the_gluon_dkdv_kernel_where_the_backend_takes_it(monkeypatch):
    spec = str(EXAMPLES / "causal.attn")
    kernel = attncc.compile(spec)
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=gen, requires_grad=True) for _ in range(3))
    kernel(q, k, v).sum().backward()
    assert calls == ["forward", "dq", "dkdv"]
    assert kernel.last_backward == {"dq": ("gluon", "backend='gluon' was asked for (dQ)"),
                                    "dkdv": ("gluon", "backend='gluon' was asked for (dK/dV)")}
    # The same gradients as the portable kernel's (the stand-in runs it).
    portable = attncc.compile(spec, backend="triton")
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    portable(q2, k2, v2).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    # A head dim the dK/dV kernel does not take: the portable one runs and says why.
    calls.clear()
    q, k, v = (torch.randn(1, 2, 24, 32, generator=gen, requires_grad=True) for _ in range(3))
    kernel(q, k, v).sum().backward()
    assert calls == ["forward"]
    for kind in ("dq", "dkdv"):
        backend, why = kernel.last_backward[kind]
        assert backend == "triton" and "head dim 32" in why


def test_learnable_inputs_keep_the_portable_dq(monkeypatch):
    """Their gradients are accumulated by the portable dQ kernel; dK/dV may still be Gluon's."""
    kernel = attncc.compile(str(EXAMPLES / "relative_bias.attn"))
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 24, 64, generator=gen, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 511, generator=gen, requires_grad=True)
    kernel(q, k, v, bias=bias).sum().backward()
    assert calls == ["forward", "dkdv"]
    backend, why = kernel.last_backward["dq"]
    assert backend == "triton" and "learnable inputs (bias)" in why
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_a_table_driven_backward_says_it_runs_one_portable_launch(monkeypatch):
    from attncc.runtime import settings
    monkeypatch.setattr(settings, "TABLES_BACKWARD", "one-launch")
    kernel = attncc.compile(str(EXAMPLES / "document.attn"))
    calls = []
    _stand_in_gluon(kernel, monkeypatch, calls)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=gen, requires_grad=True) for _ in range(3))
    doc = torch.tensor([0] * 12 + [1] * 20, dtype=torch.int32)
    kernel(q, k, v, doc_q=doc, doc_k=doc).sum().backward()
    assert calls == ["forward"]
    backend, why = kernel.last_backward["bwd"]
    assert backend == "triton" and "one portable launch" in why
    monkeypatch.setattr(settings, "TABLES_BACKWARD", "sequential")
    kernel(q, k, v, doc_q=doc, doc_k=doc).sum().backward()
    assert calls == ["forward", "forward", "dq", "dkdv"]


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'gluon'"):
        attncc.compile(str(EXAMPLES / "causal.attn"), backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's dispatch")
def test_dispatch_without_an_sm90_gpu():
    spec = str(EXAMPLES / "causal.attn")
    auto = attncc.compile(spec)
    assert auto.backend == "triton" and "interpreter" in auto.backend_reason
    asked = attncc.compile(spec, backend="triton")
    assert asked.backend == "triton" and "backend='triton'" in asked.backend_reason
    with pytest.raises(attncc.BackendError, match="backend='gluon' cannot run this: the Triton "
                                                  "interpreter"):
        attncc.compile(spec, backend="gluon")
    # The variant's own limits are named before the machine's.
    with pytest.raises(attncc.BackendError, match="dropout 0.1, which the Gluon forward"):
        attncc.compile(str(EXAMPLES / "dropout.attn"), backend="gluon")
    # auto runs the portable forward and says why, call by call; and the backward.
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    out = auto(q, q, q)
    assert auto.last_backend == ("triton", auto.backend_reason)
    assert torch.isfinite(out).all()
    assert auto.last_backward == {}
    out.sum().backward()
    assert auto.last_backward == {"dq": ("triton", auto.backend_reason),
                                  "dkdv": ("triton", auto.backend_reason)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's dispatch")
def test_no_gpu_is_named_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backends._device_unsupported.cache_clear()
    try:
        assert "no CUDA GPU" in backends.environment_unsupported()
    finally:
        backends._device_unsupported.cache_clear()


def test_cli_compile_backend_gluon_writes_both_modules(tmp_path, capsys):
    spec = EXAMPLES / "sliding_window.attn"
    assert main(["compile", str(spec), "--backend", "gluon", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "sliding_window_gluon.py").read_text()
    assert text == gluon.generate(attncc.load(spec)).source
    assert (tmp_path / "sliding_window.py").exists()  # its tables and backward
    assert "backend   gluon forward, dQ and dK/dV on an sm_90 GPU" in out
    assert "Gluon dQ tiles (head dim 128): 64x64 (4 warps, 2 stages)" in out
    assert "Gluon dK/dV tiles (head dim 128): 64x64 (4 warps, 2 stages)" in out


def test_cli_compile_backend_gluon_refuses_what_it_cannot_take(tmp_path, capsys):
    spec = str(EXAMPLES / "dropout.attn")
    assert main(["compile", spec, "--backend", "gluon", "-o", str(tmp_path)]) == 2
    assert "--backend gluon cannot compile this: variant 'dropout' has dropout" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
    assert main(["compile", spec, "--backend", "auto", "-o", str(tmp_path)]) == 0
    assert "backend   auto: the portable kernels, since variant 'dropout'" in capsys.readouterr().out
    assert not (tmp_path / "dropout_gluon.py").exists()


def test_auto_times_both_forwards_once_and_remembers(monkeypatch, tmp_path):
    """tuning.faster_backend: each backend timed at its own config, the faster kept, in
    this process and on disk (a new process reads it without timing)."""
    import triton
    from types import SimpleNamespace
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    variant = attncc.parse_file(EXAMPLES / "causal.attn")
    kernel = SimpleNamespace(variant=variant, key=variant.key(), pinned_config=None)
    problem = SimpleNamespace(dim=128, group=1, len_q=4096, len_k=4096)
    timed = []
    times = {"gluon": 3.0, "triton": 4.0}
    options = {name: (direction, lambda config, name=name: name)
               for name, direction in (("gluon", "gluon-fwd"), ("triton", "fwd"))}
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, **kw: (timed.append(fn()), times[fn()])[1])
    assert tuning.faster_backend(kernel, problem, torch.bfloat16, options) == "gluon"
    assert sorted(timed) == ["gluon", "triton"]
    tuning._MEMORY.clear()  # as a new process: the choice comes from disk, untimed
    timed.clear()
    times.update(gluon=5.0)
    assert tuning.faster_backend(kernel, problem, torch.bfloat16, options) == "gluon"
    assert timed == []
    monkeypatch.setenv("ATTNCC_TUNE", "0")  # no timing: the portable forward
    other = SimpleNamespace(dim=64, group=1, len_q=4096, len_k=4096)
    assert tuning.faster_backend(kernel, other, torch.bfloat16, options) == "triton"


def test_a_gluon_pin_pins_only_the_gluon_forward():
    from types import SimpleNamespace
    variant = attncc.parse_file(EXAMPLES / "causal.attn")
    pin = dict(BLOCK_M=128, BLOCK_N=128, num_warps=gluon.WS_WARPS, num_stages=2)
    problem = SimpleNamespace(dim=128, group=1, len_q=64, len_k=64)
    asked = SimpleNamespace(variant=variant, key=variant.key(), pinned_config=pin,
                            requested_backend="gluon")
    assert tuning.config_for(asked, problem, torch.bfloat16, "gluon-fwd") == pin
    # The backward is the portable one: a Gluon config (9 warps) must not reach it.
    assert tuning.config_for(asked, problem, torch.bfloat16, "dq") != pin
    portable = SimpleNamespace(variant=variant, key=variant.key(), pinned_config=pin,
                               requested_backend="triton")
    assert tuning.config_for(portable, problem, torch.bfloat16, "dq") == pin
