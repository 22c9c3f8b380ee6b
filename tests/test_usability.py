"""What a new user trips over (issue 22): each slip gets a clear error or a documented
behaviour, never a silent wrong result.

Calls: the tensor layout, bfloat16 under the interpreter, gradients an input cannot
get, SDPA's keywords, positional inputs, torch functions in the decorator, stray
compile options. Files: the test cache, permissions of generated modules. The CLI:
exit codes, --version, help texts, decorator files, a score that divides by zero.
Packaging: matplotlib as an extra, the tuning lock, tuning progress through logging.
"""
from __future__ import annotations

import logging
import math
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import attncc
from attncc.tools import check_command
from attncc.runtime import cache, settings, tuning
from attncc.tools.cli import build_parser, main
from attncc.errors import CallError, SpecError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PY_VARIANTS = EXAMPLES / "python_variants.py"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = not torch.cuda.is_available()


def randn(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype, device=DEVICE).requires_grad_(grad)


# ================================================================== the tensor layout
GQA = "attention g { heads 4 / 2  mask q >= k }"
SLOPES = "attention a { input slopes: f32[h]  score s + slopes[h] * (k - q) }"


def test_bshd_layout_gives_the_bhsd_result_in_its_own_layout():
    """layout='bshd' reads (batch, seq, heads, dim) through a transposed view (no copy),
    and returns the output, and the gradients, in that layout."""
    kernel = attncc.compile(GQA)
    B, L, D = 2, 19, 16
    q, k, v = randn(B, L, 4, D), randn(B, L, 2, D), randn(B, L, 2, D)
    dout = randn(B, L, 4, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves, layout="bshd")
    assert out.shape == (B, L, 4, D) and out.is_contiguous()
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref = attncc.reference(kernel.variant, *ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double().transpose(1, 2))
    assert (out.double() - ref.transpose(1, 2)).abs().max() < 1e-4
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.transpose(1, 2).shape
        assert (g.double() - r.transpose(1, 2)).abs().max() < 1e-4
    # The reference takes the same keyword, with the same meaning.
    same = attncc.reference(kernel.variant, *(t.double() for t in (q, k, v)), layout="bshd")
    assert torch.allclose(same, ref.transpose(1, 2))


def test_an_unknown_layout_is_refused_naming_both():
    with pytest.raises(CallError, match=r"layout='bhds'.*'bhsd'.*'bshd'"):
        attncc.compile(GQA)(randn(1, 4, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16),
                            layout="bhds")


def test_bshd_tensors_passed_as_bhsd_are_refused_when_heads_are_declared():
    q, k, v = randn(1, 24, 4, 16), randn(1, 24, 2, 16), randn(1, 24, 2, 16)
    for fn in (attncc.compile(GQA), lambda *a: attncc.reference(attncc.load(GQA), *a)):
        with pytest.raises(CallError, match=r"\(batch, seq, heads, dim\).*layout='bshd'"):
            fn(q, k, v)


def test_bshd_tensors_passed_as_bhsd_are_refused_when_an_input_shows_the_heads():
    kernel = attncc.compile(SLOPES)
    q, k, v = randn(1, 24, 4, 16), randn(1, 24, 4, 16), randn(1, 24, 4, 16)
    with pytest.raises(CallError, match=r"slopes.*layout='bshd'"):
        kernel(q, k, v, slopes=torch.rand(4, device=DEVICE))


def test_bhsd_tensors_passed_as_bshd_are_refused_the_other_way():
    q, k, v = randn(1, 4, 24, 16), randn(1, 2, 24, 16), randn(1, 2, 24, 16)
    with pytest.raises(CallError, match=r"layout='bhsd'"):
        attncc.compile(GQA)(q, k, v, layout="bshd")


def test_shape_errors_name_the_layout_expected():
    with pytest.raises(CallError, match=r"q must have 4 dimensions \(batch, seq, heads, dim\)"):
        attncc.compile(GQA)(randn(8, 4, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16), layout="bshd")
    with pytest.raises(CallError, match=r"as \(batch, heads, seq, dim\)"):
        attncc.compile("attention c { mask q >= k }")(randn(1, 3, 8, 16), randn(1, 2, 8, 16),
                                                      randn(1, 2, 8, 16))


# ================================================================== bfloat16, gradients
@pytest.mark.skipif(not INTERPRETED, reason="bfloat16 runs on a GPU")
def test_bfloat16_is_refused_under_the_interpreter_everywhere_the_kernels_run():
    kernel = attncc.compile("attention lay { input on: bool[qb, kb] layout on[qb, kb] block 16 }")
    q, k, v = (randn(1, 2, 32, 16, dtype=torch.bfloat16) for _ in range(3))
    on = torch.ones(2, 2, dtype=torch.bool)
    for call in (lambda: kernel(q, k, v, on=on), lambda: kernel.tile_tables(q, k, v, on=on),
                 lambda: kernel.density(q, k, v, on=on)):
        with pytest.raises(CallError, match=r"bfloat16.*interpreter.*float16 or float32.*GPU"):
            call()


def test_meta_tensors_are_refused_naming_the_way_to_get_shapes():
    """A model built on the meta device has no values to compute with: the call says so
    and names FakeTensorMode, under which the same call gives the output's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    kernel = attncc.compile(GQA)
    q = torch.empty(1, 4, 5, 16, device="meta")
    k = v = torch.empty(1, 2, 7, 16, device="meta")
    cache = torch.empty(1, 2, 16, 16, device="meta")
    for call in (lambda: kernel(q, k, v), lambda: kernel.decode(q[:, :, :1], cache, cache,
                                                                cache_seqlens=3)):
        with pytest.raises(CallError, match=r"meta device.*FakeTensorMode"):
            call()
    with FakeTensorMode():
        out = kernel(*(torch.empty(*t.shape, device=DEVICE) for t in (q, k, v)))
    assert out.shape == (1, 4, 5, 16) and out.dtype == torch.float32


def test_a_non_learnable_input_that_requires_grad_is_refused():
    spec = "attention b { input bias: f32[h]  score s + bias[h] }"
    variant = attncc.load(spec)
    q, k, v = randn(1, 2, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16)
    bias = torch.rand(2, device=DEVICE, requires_grad=True)
    for fn in (attncc.compile(spec), lambda *a, **kw: attncc.reference(variant, *a, **kw)):
        with pytest.raises(CallError, match=r"'bias' requires grad.*`learnable input bias"):
            fn(q, k, v, bias=bias)
    with torch.no_grad():  # no gradient is asked for: nothing to refuse
        attncc.reference(variant, q, k, v, bias=bias)


# ================================================================== SDPA habits, positional inputs
@pytest.mark.parametrize("keyword,value,fix", [
    ("is_causal", True, r"mask q >= k"),
    ("scale", 0.125, r"scale 0.125"),
    ("attn_mask", torch.ones(8, 8, dtype=torch.bool), r"input .*mask "),
    ("dropout_p", 0.1, r"dropout 0.1"),
    ("enable_gqa", True, r"fewer heads than q"),
])
def test_sdpa_keywords_say_how_to_declare_the_same_in_the_spec(keyword, value, fix):
    variant = attncc.load("attention c { mask q >= k }")
    q, k, v = randn(1, 2, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16)
    for fn in (attncc.compile(variant), lambda *a, **kw: attncc.reference(variant, *a, **kw)):
        with pytest.raises(CallError, match=rf"{keyword}=.*scaled_dot_product_attention.*{fix}"):
            fn(q, k, v, **{keyword: value})


def test_sparse_inputs_and_odd_density_blocks_are_refused_by_name():
    """A sparse layout tensor passed every check and failed inside PyTorch; density's
    block=0 and True were read as the layout's block and 1, 2.5 an IndexError."""
    kernel = attncc.compile("attention l { input on: bool[qb, kb] layout on[qb, kb] block 16 }")
    q = randn(1, 2, 32, 16)
    on = torch.ones(2, 2, dtype=torch.bool, device=DEVICE)
    for call in (kernel, kernel.tile_tables,
                 lambda *t, **kw: attncc.reference(kernel.variant, *t, **kw)):
        with pytest.raises(CallError, match=r"input 'on' is a torch.sparse_coo tensor.*on.to_dense\(\)"):
            call(q, q, q, on=on.to_sparse())
    for block in (0, True, 2.5):
        with pytest.raises(CallError, match=rf"block must be a positive int .*got {block!r}"):
            kernel.density(q, q, q, on=on, block=block)


def test_a_positional_input_is_refused_naming_its_keyword():
    variant = attncc.load(SLOPES)
    q, k, v = randn(1, 2, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16)
    slopes = torch.rand(2, device=DEVICE)
    for fn in (attncc.compile(variant), lambda *a, **kw: attncc.reference(variant, *a, **kw)):
        with pytest.raises(CallError, match=r"keyword arguments.*slopes=slopes"):
            fn(q, k, v, slopes)


def test_a_dropout_seed_for_a_variant_without_dropout_is_refused():
    """It was ignored: a caller who passed a seed expecting dropout trained without it."""
    variant = attncc.load("attention c { mask q >= k }")
    q, k, v = randn(1, 2, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16)
    packed = attncc.varlen(variant)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    flat = lambda t: t[0].transpose(0, 1)  # (8, heads, dim)
    for fn in (attncc.compile(variant), lambda *a, **kw: attncc.reference(variant, *a, **kw),
               lambda q, k, v, **kw: packed(flat(q), flat(k), flat(v), cu, cu, 8, 8, **kw)):
        with pytest.raises(CallError, match=r"dropout_seed=3 is given, but variant 'c' "
                                            r"declares no dropout.*`dropout 0.1`"):
            fn(q, k, v, dropout_seed=3)
    # flash-attn's API turns dropout off with dropout_p=0: its seed is then not passed on.
    from attncc.flash import flash_attn_func
    t = lambda x: x.transpose(1, 2)
    out = flash_attn_func(t(q), t(k), t(v), dropout_p=0.0, causal=True, dropout_seed=3)
    torch.testing.assert_close(t(out), attncc.reference(variant, q, k, v), atol=1e-5, rtol=1e-5)


# ================================================================== the decorator, compile()
def test_torch_functions_in_the_decorator_name_the_attncc_function():
    def score(s, q, k):
        return torch.where(q >= k, s, s * 0.5)
    with pytest.raises(SpecError, match=r"torch.where.*attncc.where\(c, a, b\)"):
        attncc.variant(type("v", (), {"score": staticmethod(score)}))

    with pytest.raises(SpecError, match=r"math.exp.*attncc.exp"):
        attncc.variant(type("v", (), {"score": staticmethod(lambda s: math.exp(s))}))


def test_compile_options_it_does_not_take_say_what_to_do():
    with pytest.raises(TypeError, match=r"block=.*`block 64`.*config="):
        attncc.compile("attention c { mask q >= k }", block=64)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'tiles'.*config="):
        attncc.compile("attention c { mask q >= k }", tiles=64)


# ================================================================== files
def test_the_suite_runs_on_a_cache_of_its_own():
    root = cache.cache_dir()
    assert Path(root).name.startswith("attncc-tests-")
    assert Path(root).parent == Path(tempfile.gettempdir())


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_generated_files_get_the_permissions_the_umask_gives(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = tmp_path / "m.py"
        assert cache.write_if_changed(path, "x = 1\n")
        assert stat.S_IMODE(path.stat().st_mode) == mode
    finally:
        os.umask(old)


def test_compile_writes_a_module_others_can_read(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["compile", str(EXAMPLES / "causal.attn"), "-o", str(tmp_path)]) == 0
        cached = Path(attncc.compile("attention perms_cached { mask q > k }").module.__file__)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "causal.py").stat().st_mode) == 0o644
    assert cached.is_relative_to(cache.cache_dir())
    assert stat.S_IMODE(cached.stat().st_mode) == 0o644


# ================================================================== the CLI
def test_compile_len_past_the_estimate_limit_is_an_error(tmp_path, capsys):
    assert main(["compile", str(EXAMPLES / "causal.attn"), "-o", str(tmp_path),
                 "--len", "16384"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--len 16384" in err and "8192" in err
    assert not (tmp_path / "causal.py").exists(), "refused before anything is written"


def test_compile_creates_a_missing_output_directory_and_says_so(tmp_path, capsys):
    out = tmp_path / "build" / "kernels"
    assert main(["compile", str(EXAMPLES / "causal.attn"), "-o", str(out)]) == 0
    assert (out / "causal.py").is_file()
    assert f"created {out}" in capsys.readouterr().out


def test_bench_on_a_missing_file_says_so_before_looking_for_a_gpu(tmp_path, capsys):
    for decode in ([], ["--decode"]):  # --decode looked for the GPU first
        assert main(["bench", str(tmp_path / "missing.attn"), *decode]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: no such file") and "GPU" not in err


@pytest.mark.parametrize("flags, words", [
    # Found only after every length was timed (a traceback, the run lost), or ignored.
    (["--plot", "out.txt"], "the drawing is a PNG"),
    (["--json", "no/such/folder/t.json"], "does not exist; create it first"),
    (["--plot", "no/such/folder/t.png"], "does not exist; create it first"),
    (["--decode", "--plot", "t.png"], "--decode has no drawing"),
    (["--batch", "8"], "--batch set a decode step, which only --decode times"),
    (["--new", "2", "--page", "16"], "--new, --page set a decode step"),
    (["--dim", "0"], "--dim 0: a head dim is at least 1"),
    (["--heads", "8/3"], "--heads 8/3: the query heads must be a positive multiple"),
    (["--decode", "--heads", "8/3"], "--heads 8/3"),
])
def test_bench_flags_are_checked_before_any_timing(flags, words, capsys):
    assert main(["bench", str(EXAMPLES / "causal.attn"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "GPU" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_a_gpu_is_an_error_like_the_others(capsys):
    assert main(["bench", str(EXAMPLES / "causal.attn")]) == 2
    assert capsys.readouterr().err.startswith("error: attncc bench needs a CUDA GPU")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"attncc {attncc.__version__}"


def test_every_argument_has_help_text():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"attncc {name} {action.dest} has no help text"


PY_SPEC = f"{PY_VARIANTS}:sliding_window"


def test_show_reads_a_variant_from_a_decorator_file(capsys):
    assert main(["show", PY_SPEC]) == 0
    assert capsys.readouterr().out == str(attncc.parse_file(EXAMPLES / "sliding_window.attn"))


def test_compile_and_check_read_a_variant_from_a_decorator_file(tmp_path, capsys):
    assert main(["compile", PY_SPEC, "-o", str(tmp_path)]) == 0
    assert (tmp_path / "sliding_window.py").is_file()
    assert main(["check", f"{PY_VARIANTS}:causal", "--len", "9", "--dim", "16"]) == 0
    assert "OK: every tensor within tolerance" in capsys.readouterr().out


@pytest.mark.parametrize("spec,message", [
    (f"{PY_VARIANTS}:nope", r"has no variant 'nope' \(it defines full, causal, .*and 18 more"),
    (f"{PY_VARIANTS}:causall", r"has no variant 'causall'; did you mean 'causal'\?"),
    (f"{PY_VARIANTS}:EXAMPLES", r"'EXAMPLES' .* is a dict, not a variant.*@attncc.variant"),
    (f"{PY_VARIANTS}:maximum", r"'maximum' .* is a function, not a variant.*@attncc.variant"),
    (str(PY_VARIANTS), r"defines 26 variants; name the one to use, as in .*python_variants.py:full"),
    ("missing.py:x", r"no such file: missing.py"),
])
@pytest.mark.parametrize("command", ["show", "compile", "check", "bench"])
def test_decorator_file_mistakes_are_named(spec, message, command, capsys, tmp_path):
    argv = [command, spec] + (["-o", str(tmp_path)] if command == "compile" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") or err.startswith(spec.split(":")[0])
    assert re.search(message, err), err


def test_a_file_with_one_variant_needs_no_name(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text("import attncc\n\n@attncc.variant\ndef mine(q, k):\n    return q >= k\n")
    assert main(["show", str(path)]) == 0
    assert capsys.readouterr().out == "attention mine {\n    mask    q >= k\n}\n"
    assert attncc.load(f"{path}:mine").name == "mine"  # the Python API reads the same


def test_a_decorator_file_that_raises_is_reported_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "broken.py"
    path.write_text("import attncc\n\nundefined_name\n")
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "NameError" in err and "broken.py:3" in err and "Traceback" not in err


def test_check_names_a_division_by_zero_in_the_score(capsys):
    spec = "attention inv { mask q >= k score s + 1.0 / (q - k) }"
    assert main(["check", spec, "--len", "8", "--dim", "16"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    assert re.search(r"score is not finite at allowed pairs.*q=0, k=0.*division by zero in "
                     r"`1.0 / \(q - k\)`", out, re.S), out


def test_the_guard_the_diagnosis_suggests_passes(capsys):
    """The guard the message names passes: the reference's gradients do not pick up the
    untaken branch's infinite derivative in s (tests/test_reference.py: a masked pair's
    as well)."""
    spec = "attention inv { mask q >= k score where(q == k, s, s / (q - k)) }"
    assert main(["check", spec, "--len", "8", "--dim", "16"]) == 0, capsys.readouterr().out


def test_the_diagnosis_names_log_of_a_negative_and_passes_finite_scores():
    from attncc.arguments import Problem
    p = Problem(1, 2, 2, 6, 6, 16, 16)
    bad = attncc.parse("attention l { score s + log(k - q + 2.0) }")
    hint = check_command.non_finite_score(bad, p, {})
    assert hint and "log" in hint and "`log(k - q + 2.0)`" in hint
    fine = attncc.parse("attention f { mask q > k score s + 1.0 / (q - k) }")
    assert check_command.non_finite_score(fine, p, {}) is None


# ================================================================== packaging, lock, logging
def test_matplotlib_is_an_optional_extra_and_the_test_extra_brings_it():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}
    assert "matplotlib" not in names(project["dependencies"])
    assert "filelock" in names(project["dependencies"])
    assert "matplotlib" in names(project["optional-dependencies"]["plot"])
    assert "matplotlib" in names(project["optional-dependencies"]["test"])


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["show", str(EXAMPLES / "causal.attn"), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'attncc[plot]'" in capsys.readouterr().err
    assert main(["bench", str(EXAMPLES / "causal.attn"), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'attncc[plot]'" in capsys.readouterr().err


def test_the_tuning_cache_lock_needs_no_fcntl(monkeypatch, tmp_path):
    import filelock  # noqa: F401  (imported first: it picks its own lock for the platform)
    monkeypatch.setitem(sys.modules, "fcntl", None)  # attncc's own code must not need it
    entry = {"backend": "triton", "config": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4,
                                                 num_stages=1)}
    tuning._store(tmp_path / "t.json", {"a": entry})
    assert tuning._load(tmp_path / "t.json") == {"a": tuning.Choice.from_json(entry, "t")}


def _fake_tuning(monkeypatch, tmp_path):
    import triton
    from types import SimpleNamespace
    from attncc.arguments import Problem
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNCC_TUNE", "1")  # GPU runs set 0 for correctness
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: 1.0)
    monkeypatch.setattr(tuning, "_MEMORY", {})
    kernel = SimpleNamespace(key="k-logging-test", pinned_config=None,
                             variant=attncc.parse("attention logged { mask q >= k }"))
    return lambda: tuning.config_for(kernel, Problem(1, 2, 2, 4096, 4096, 128, 128),
                                     torch.bfloat16, "fwd", lambda config: None)


def test_tuning_progress_is_logged_and_quiet_by_default(monkeypatch, tmp_path, capfd, caplog):
    tune = _fake_tuning(monkeypatch, tmp_path)
    with caplog.at_level(logging.INFO, logger="attncc.tuning"):
        tune()
    assert any("tuned logged" in r.getMessage() and r.name == "attncc.tuning" for r in caplog.records)
    assert "tuned" not in capfd.readouterr().err
    tuning._MEMORY.clear()  # tune again, into a fresh cache
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "again"))
    caplog.clear()
    tune()  # a library user who configured no logging sees nothing
    assert "tuned" not in capfd.readouterr().err


def test_the_cli_shows_tuning_progress(monkeypatch, tmp_path, capsys):
    tune = _fake_tuning(monkeypatch, tmp_path)
    from attncc.tools import cli
    monkeypatch.setitem(cli.COMMANDS, "show", lambda args: (tune(), 0)[1])
    assert main(["show", "x.attn"]) == 0
    assert "attncc: tuned logged" in capsys.readouterr().err
    assert not logging.getLogger("attncc").handlers, "the CLI's handler is removed after"



def test_interpreter_switched_on_after_triton_was_imported_is_named():
    """The CPU advice (set TRITON_INTERPRET=1) followed after triton is already imported
    crashed deep in Triton ("0 active drivers", or "Cannot call @triton.jit'd outside of
    the scope of a kernel"): Triton reads the variable as it imports."""
    import subprocess
    script = ("import triton, os\n"
              "os.environ['TRITON_INTERPRET'] = '1'\n"
              "import torch, attncc\n"
              "q = torch.randn(1, 1, 8, 16)\n"
              "try:\n"
              "    attncc.compile('attention c { mask q >= k }')(q, q, q)\n"
              "except attncc.CallError as e:\n"
              "    print('CallError:', e)\n")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "CallError: TRITON_INTERPRET=1 was set after triton was imported" in done.stdout, (
        done.stdout + done.stderr)


def test_torch_func_transforms_and_forward_ad_are_refused_by_name():
    """vmap, func.grad and func.jvp failed inside PyTorch ("Cannot access data pointer of
    Tensor that doesn't have storage"); a dual tensor's tangent was silently lost."""
    import torch.autograd.forward_ad as fwAD
    kernel = attncc.compile("attention c { mask q >= k }")
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    for transform in (lambda: torch.vmap(lambda x: kernel(x, k, v))(torch.stack([q, q])),
                      lambda: torch.func.grad(lambda x: kernel(x, k, v).sum())(q),
                      lambda: torch.func.jvp(lambda x: kernel(x, k, v), (q,), (q,))):
        with pytest.raises(CallError, match="torch.func transforms .* cannot run attncc"):
            transform()
    with fwAD.dual_level():
        with pytest.raises(CallError, match="forward-mode AD"):
            kernel(fwAD.make_dual(q, torch.randn_like(q)), k, v)
        kernel(q, k, v)  # no dual tensor: runs


def test_return_lse_must_be_a_bool():
    """return_lse="no" returned a tuple (a truthy string), where training= and
    deterministic= are checked."""
    kernel = attncc.compile("attention c { mask q >= k }")
    q = torch.randn(1, 1, 8, 16)
    for call in (kernel, lambda *t, **kw: attncc.reference(kernel.variant, *t, **kw)):
        with pytest.raises(CallError, match="return_lse must be True or False, got 'no'"):
            call(q, q, q, return_lse="no")
