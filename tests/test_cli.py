"""attncc compile / check / bench: the commands, their exit codes, and their helpers.

compile is checked against tile counts derived by hand; check runs once end to end under
the Triton interpreter and its pass/fail rule is a truth table; bench only has its no-GPU
path and its helpers (FlexAttention translation, SDPA eligibility, pair counts) here.
"""
import ast
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import attncc
from attncc.runtime import checking
from attncc.semantics import samples, tolerance
from attncc.tools import bench_command, check_command, density, flex
from attncc.arguments import Problem
from attncc.tools.cli import main
from attncc.backends.portable.codegen import generate
from attncc.semantics.reference import allowed_pairs, reference, scale_value

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_EXAMPLES = sorted(EXAMPLES.glob("*.attn"))


def run_cli(*argv, env_extra=None, drop=(), timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "attncc", *argv], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


# ------------------------------------------------------------------ compile
def _imports(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0] if node.level == 0 else ".")
    return names


@pytest.mark.parametrize("name", ["causal", "document", "bigbird", "relative_bias"])
def test_compile_writes_a_standalone_module(name, tmp_path, capsys):
    spec = EXAMPLES / f"{name}.attn"
    assert main(["compile", str(spec), "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    path = tmp_path / f"{name}.py"
    assert path.exists()
    text = path.read_text()
    assert _imports(ast.parse(text)) <= {"math", "torch", "triton", "__future__"}
    assert "import attncc" not in text and "from attncc" not in text
    variant = attncc.load(spec)
    assert text == generate(variant).source
    assert f"strategy  {generate(variant).strategy}" in out
    assert "interpreter: fwd 16x16" in out
    assert "written" in out


def _written_module(spec: str, tmp_path):
    """The file `attncc compile` writes for `spec`, imported as a user would."""
    import importlib.util
    variant = attncc.load(spec)
    path = tmp_path / f"{variant.name}.py"
    path.write_text(generate(variant).source)
    found = importlib.util.spec_from_file_location(f"written_{variant.name}", path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


SHARED_SINK = """attention shared_sink {
    learnable input t: f32[h]
    mask q >= k
    score s + t[h]
    sink t[h] }"""


@pytest.mark.parametrize("spec", [SHARED_SINK, str(EXAMPLES / "gpt_oss_sinks.attn")])
def test_the_written_modules_backward_adds_the_sinks_gradient(spec, tmp_path):
    """The sink's share of a learnable input's gradient is added outside the kernels; the
    written file left it out: `t[h]` added to every logit and to the sink changes
    nothing, yet the file gave dt = [0.36, -0.26], and gpt-oss's `sinks` had no entry."""
    module = _written_module(spec, tmp_path)
    variant = attncc.load(spec)
    (name,) = [d.name for d in variant.learnable_inputs]
    heads = variant.heads.q if variant.heads else 2
    kv_heads = variant.heads.kv if variant.heads else 2
    gen = torch.Generator().manual_seed(6)
    q, dout = (torch.randn(1, heads, 20, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, 23, 16, generator=gen) for _ in range(2))
    inputs = {name: torch.randn(heads, generator=gen) * 2}
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    on = [x.to(DEVICE) for x in (q, k, v, dout)]
    placed = {name: inputs[name].to(DEVICE)}
    out, lse = module.forward(*on[:3], placed, config=config)
    *_, grads = module.backward(*on[:3], out, lse, on[3], placed, config_dkdv=config,
                                config_dq=config)
    leaves = [x.double().requires_grad_() for x in (q, k, v, inputs[name])]
    want = reference(variant, *leaves[:3], **{name: leaves[3]})
    (want_grad,) = torch.autograd.grad(want, leaves[3], dout.double())
    torch.testing.assert_close(grads[name].cpu().double(), want_grad, rtol=0,
                               atol=1e-4 * (1 + want_grad.abs().max().item()))


def test_the_written_module_refuses_tiles_wider_than_an_index_lists_block(tmp_path):
    """An index list turns whole blocks on; a 64x64 tile over blocks of 32 read one list
    entry for two blocks: the file ran the README's own config 0.68 off, where
    attncc.compile refuses it."""
    module = _written_module("attention top { input top: i32[b, h, qb, 2]\n"
                             " layout kb in top[b, h, qb]\n block 32 }", tmp_path)
    q = torch.randn(1, 2, 64, 16)
    top = torch.tensor([[[[0, -1], [0, 1]]] * 2], dtype=torch.int32)
    on, top_on = q.to(DEVICE), top.to(DEVICE)
    with pytest.raises(ValueError, match="tiles of 64x64 do not nest in the layout's blocks of 32"):
        module.forward(on, on, on, {"top": top_on}, config=dict(BLOCK_M=64, BLOCK_N=64,
                                                                num_warps=4, num_stages=1))
    out, _ = module.forward(on, on, on, {"top": top_on}, config=dict(BLOCK_M=32, BLOCK_N=16,
                                                                     num_warps=4, num_stages=1))
    out = out.cpu()
    want = reference(attncc.load("attention top { input top: i32[b, h, qb, 2]\n"
                                 " layout kb in top[b, h, qb]\n block 32 }"),
                     q.double(), q.double(), q.double(), top=top)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-4)


def test_the_written_module_refuses_a_sink_expressions_gradient(tmp_path):
    module = _written_module("attention scaled_sink { learnable input t: f32[h]\n"
                             " sink 2.0 * t[h] }", tmp_path)
    q = torch.randn(1, 2, 5, 16, device=DEVICE)
    t = {"t": torch.zeros(2, device=DEVICE)}
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    out, lse = module.forward(q, q, q, t, config=config)
    with pytest.raises(NotImplementedError, match="reads learnable inputs t through an expression"):
        module.backward(q, q, q, out, lse, q, t, config_dkdv=config, config_dq=config)


@pytest.mark.parametrize("schedule,want", [("one-launch", "bwd "), ("sequential", "dq ")])
def test_compile_reports_the_backward_the_runtime_runs(schedule, want, tmp_path, capsys,
                                                       monkeypatch):
    # The backward's schedule is decided in one place (runtime/settings.py): with
    # ATTNCC_BACKWARD=sequential a table-driven variant runs dQ then dK/dV, and `compile`
    # says so instead of the one launch.
    from attncc.runtime import settings
    monkeypatch.setattr(settings, "TABLES_BACKWARD", schedule)
    assert main(["compile", str(EXAMPLES / "document.attn"), "-o", str(tmp_path)]) == 0
    tiles = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiles")][0]
    assert f", {want}" in tiles and (("dkdv " in tiles) == (schedule == "sequential"))


def test_compile_writes_only_when_changed(tmp_path, capsys):
    spec = str(EXAMPLES / "causal.attn")
    assert main(["compile", spec, "-o", str(tmp_path)]) == 0
    path = tmp_path / "causal.py"
    os.utime(path, (1, 1))
    assert main(["compile", spec, "-o", str(tmp_path)]) == 0
    assert "unchanged" in capsys.readouterr().out
    assert path.stat().st_mtime == 1


VISITED = re.compile(r"at len (\d+): ([0-9.]+) of the (\d+)x(\d+) forward tiles \((\d+) of (\d+)\)")


def _causal_tiles(n, bm, bn):
    """Tiles (i, j) holding some q >= k: the largest q of row tile i reaches key tile j."""
    qt, kt = -(-n // bm), -(-n // bn)
    visited = sum(1 for i in range(qt) for j in range(kt) if min(n, (i + 1) * bm) - 1 >= j * bn)
    return visited, qt * kt


def _window_tiles(n, bm, bn, window):
    qt, kt = -(-n // bm), -(-n // bn)
    visited = 0
    for i in range(qt):
        q_lo, q_hi = i * bm, min(n, (i + 1) * bm) - 1
        for j in range(kt):
            k_lo, k_hi = j * bn, min(n, (j + 1) * bn) - 1
            # some k in [q - window + 1, q] for some q in the tile
            visited += k_lo <= q_hi and k_hi >= q_lo - window + 1
    return visited, qt * kt


@pytest.mark.parametrize("name,n,expect", [
    ("causal", 256, _causal_tiles),
    ("causal", 1000, _causal_tiles),
    ("sliding_window", 4000, lambda n, bm, bn: _window_tiles(n, bm, bn, 1024)),
    ("full", 300, lambda n, bm, bn: (-(-n // bm) * -(-n // bn),) * 2),
])
def test_compile_reports_the_fraction_of_tiles_visited(name, n, expect, tmp_path, capsys):
    assert main(["compile", str(EXAMPLES / f"{name}.attn"), "-o", str(tmp_path), "--len", str(n)]) == 0
    m = VISITED.search(capsys.readouterr().out)
    assert m, "no 'visited' line"
    length, frac, bm, bn, visited, total = m.groups()
    assert int(length) == n
    want_visited, want_total = expect(n, int(bm), int(bn))
    assert (int(visited), int(total)) == (want_visited, want_total)
    assert float(frac) == pytest.approx(want_visited / want_total, abs=5e-4)


def test_compile_len_beyond_the_dense_limit_is_an_error(tmp_path, capsys):
    assert main(["compile", str(EXAMPLES / "causal.attn"), "-o", str(tmp_path), "--len", "9000"]) == 2
    assert "error: --len 9000" in capsys.readouterr().err


def test_compile_missing_spec_exits_2_without_traceback(tmp_path):
    r = run_cli("compile", str(tmp_path / "missing.attn"), "-o", str(tmp_path))
    assert r.returncode == 2
    assert "no such file" in r.stderr and "missing.attn" in r.stderr
    assert "Traceback" not in r.stderr


def test_compile_bad_spec_exits_2_with_a_located_message(tmp_path, capsys):
    spec = tmp_path / "bad.attn"
    spec.write_text("attention bad {\n    mask q >= kk\n}\n")
    assert main(["compile", str(spec), "-o", str(tmp_path)]) == 2
    assert "bad.attn:2:" in capsys.readouterr().err
    assert not (tmp_path / "bad.py").exists()


# ------------------------------------------------------------------ check
TABLE_ROW = re.compile(r"^\s+(out|lse|dq|dk|dv)\s+\S+\s+\S+\s+\S+\s+OK$", re.M)


@pytest.mark.slow  # a process of its own; the next test runs `attncc check` by default
def test_check_runs_under_the_interpreter():
    r = run_cli("check", str(EXAMPLES / "causal.attn"), "--len", "20,33",
                env_extra={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("len_q 20, len_k 20") == 1 and r.stdout.count("len_q 33, len_k 33") == 1
    assert len(TABLE_ROW.findall(r.stdout)) == 10
    assert "OK: every tensor within tolerance" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_check_sets_the_interpreter_itself_without_a_gpu():
    # A learnable input, GQA heads and empty rows (the first 3 queries see no key).
    spec = "attention shifted { learnable input bias: f32[h] mask q >= k + 3 score s + bias[h] }"
    r = run_cli("check", spec, "--len", "19", "--heads", "4/2", "--dim", "16", "--dtype", "float16",
                drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CPU, Triton interpreter" in r.stdout
    assert re.search(r"^\s+dbias\s.*OK$", r.stdout, re.M)
    # The bias was made up, and the output says so and how.
    assert "inputs: invented (seed 0, plus the shape's index; pass your own with --inputs " \
           "FILE.pt): bias: standard normal" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="bfloat16 is allowed on a GPU")
def test_check_refuses_bfloat16_under_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["check", str(EXAMPLES / "causal.attn"), "--dtype", "bfloat16"]) == 2
    assert "bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("err_kernel,err_eager,dtype,ok", [
    (0.0, 0.0, torch.float32, True),
    (1e-5, 0.0, torch.float32, True),            # atol covers an exact eager result
    (1.1e-5, 0.0, torch.float32, False),
    (2e-3 + 1e-5, 1e-3, torch.float32, True),    # exactly 2x + atol
    (2e-3 + 2e-5, 1e-3, torch.float32, False),
    (3e-3, 1e-3, torch.float16, True),           # half types: atol 1e-3
    (2e-3 + 8e-3, 1e-3, torch.bfloat16, True),  # bf16: atol 8e-3 (one bf16 ulp at 1)
    (1.1e-2, 1e-3, torch.bfloat16, False),
    (math.nan, 1e-3, torch.float16, False),      # NaN never passes
    (math.inf, 1e-3, torch.float16, False),      # -inf rows that do not match
    (1e-4, math.nan, torch.float32, False),
])
def test_within_tolerance_truth_table(err_kernel, err_eager, dtype, ok):
    assert tolerance.within_tolerance(err_kernel, err_eager, dtype) is ok


def test_gradient_slack_covers_the_rounded_output_of_a_one_key_row():
    # A row attending to one key has dS = 0 exactly, but FlashAttention's backward forms
    # delta from the stored bf16 O: dk keeps |dO * O| * u noise (GPU run 12 measured
    # 8.4e-3 against a unit-scale slack of 8e-3). The gradient scale covers that noise
    # in every draw, and an error of a real bug's size still fails.
    from attncc.semantics.tolerance import gradient_scales, within_tolerance
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(50):
        q, v, do = (torch.randn(2, 4, 1, 64, generator=gen, dtype=torch.float64) for _ in range(3))
        out = v / 0.9  # one key, kept by dropout 0.1
        delta = (do * out.bfloat16().double()).sum(-1)
        dk_noise = ((do * v).sum(-1) / 0.9 - delta)[..., None] * q / 8  # exact dk is 0
        scale = gradient_scales(q, q, out, do, 1 / 8, 1)["dk"]
        assert within_tolerance(dk_noise.abs().max().item(), 0.0, torch.bfloat16,
                                torch.zeros(1), scale)
        assert not within_tolerance(0.5, 0.0, torch.bfloat16, torch.zeros(1), scale)
        worst = max(worst, dk_noise.abs().max().item())
    assert worst > 8e-3, "the noise exceeds the unit-scale slack, so the scale is needed"


def test_max_abs_error_nan_and_infinite_rows():
    ref = torch.tensor([1.0, -math.inf, 2.0])
    assert tolerance.max_abs_error(torch.tensor([1.5, -math.inf, 2.0]), ref) == 0.5
    assert math.isinf(tolerance.max_abs_error(torch.tensor([1.0, 0.0, 2.0]), ref))       # lost -inf
    assert math.isinf(tolerance.max_abs_error(torch.tensor([-math.inf, -math.inf, 2.0]), ref))  # extra
    assert math.isnan(tolerance.max_abs_error(torch.tensor([1.0, -math.inf, math.nan]), ref))


class _FakeKernel:
    """The reference in the kernel's dtype, optionally broken after the fact."""

    def __init__(self, variant, damage=None):
        self.variant, self.damage = variant, damage

    def __call__(self, q, k, v, **kw):
        out, lse = reference(self.variant, q, k, v, **kw)
        if self.damage:
            out = self.damage(out)
        return out, lse


@pytest.mark.parametrize("damage,ok", [
    (None, True),
    (lambda o: o + 1e-2, False),
    (lambda o: torch.where(torch.arange(o.shape[2]).view(1, 1, -1, 1) == 5, torch.nan, o), False),
])
def test_check_shape_flags_a_wrong_output(damage, ok):
    variant = attncc.load(EXAMPLES / "relative_bias.attn")
    rows = check_command.check_shape(variant, _FakeKernel(variant, damage), batch=2, heads=(2, 2),
                                len_q=13, len_k=17, dim=16, dtype=torch.float32, device="cpu", seed=0)
    assert [r[0] for r in rows] == ["out", "lse", "dq", "dk", "dv", "dbias"]
    assert dict((r[0], r[3]) for r in rows)["out"] is ok
    assert dict((r[0], r[3]) for r in rows)["lse"] is True


def test_poisoned_allocations_fill_empty_tensors_with_nan():
    with checking.poisoned_allocations():
        assert torch.isnan(torch.empty(4)).all()
    assert not torch.are_deterministic_algorithms_enabled()


# ------------------------------------------------------------------ sample inputs, tiles
def test_sample_inputs_are_deterministic_documents_and_sparse_layouts():
    variant = attncc.load(EXAMPLES / "document.attn")
    p = Problem(1, 1, 1, 700, 900, 16, 16)
    a, b = samples.sample_inputs(variant, p, seed=3), samples.sample_inputs(variant, p, seed=3)
    assert torch.equal(a["doc_q"], b["doc_q"]) and a["doc_q"].dtype == torch.int32
    assert torch.equal(a["doc_k"][:700], a["doc_q"])  # one numbering of positions
    assert (a["doc_k"].diff() >= 0).all() and a["doc_k"].unique().numel() >= 2
    lay = samples.sample_inputs(attncc.load(EXAMPLES / "bigbird.attn"),
                                 Problem(1, 1, 1, 128 * 64, 128 * 64, 16, 16))["random_blocks"]
    assert lay.dtype == torch.bool and abs(lay.float().mean().item() - 0.25) < 0.03


def test_tile_visit_fraction_matches_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(2, 3, 45, 70, generator=g) < 0.02
    visited, total = density.tile_visit_fraction(allowed, 16, 32)
    naive = sum(bool(allowed[b, h, i:i + 16, j:j + 32].any())
                for b in range(2) for h in range(3) for i in range(0, 45, 16) for j in range(0, 70, 32))
    assert total == 3 * 3 and visited == pytest.approx(naive / 6)


# ------------------------------------------------------------------ bench
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_a_gpu_exits_2(capsys):
    assert main(["bench", str(EXAMPLES / "causal.attn")]) == 2
    assert capsys.readouterr().err.strip() == "error: attncc bench needs a CUDA GPU; none was found"


@pytest.mark.parametrize("spec", ALL_EXAMPLES, ids=lambda p: p.stem)
def test_flex_mask_mod_is_allowed_pairs(spec):
    variant = attncc.load(spec)
    hq, hkv = samples.default_heads(variant, 2)
    B, L = 2, 300
    p = Problem(B, hq, hkv, L, L - 37, 16, 16)
    inputs = samples.sample_inputs(variant, p, seed=1)
    mask_mod, _ = flex.flex_mods(variant, len_q=L, len_k=L - 37, dim=16, inputs=inputs)
    want = allowed_pairs(variant, p, inputs, "cpu").expand(B, hq, L, L - 37)
    if mask_mod is None:
        assert want.all()
        return
    got = mask_mod(torch.arange(B).view(-1, 1, 1, 1), torch.arange(hq).view(1, -1, 1, 1),
                   torch.arange(L).view(1, 1, -1, 1), torch.arange(L - 37).view(1, 1, 1, -1))
    assert torch.equal(got.expand_as(want), want)


@pytest.mark.parametrize("name", ["alibi", "softcap", "relative_bias", "document"])
def test_flex_mods_reproduce_the_reference_in_eager_flex_attention(name):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    variant = attncc.load(EXAMPLES / f"{name}.attn")
    B, H, L, D = 1, 2, 96, 16
    p = Problem(B, H, H, L, L, D, D)
    inputs = samples.sample_inputs(variant, p, seed=2)
    mask_mod, score_mod = flex.flex_mods(variant, len_q=L, len_k=L, dim=D, inputs=inputs)
    block_mask = None
    if mask_mod is not None:  # under vmap, as FlexAttention evaluates it
        block_mask = create_block_mask(mask_mod, B, H, L, L, device="cpu", BLOCK_SIZE=32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():  # eager flex_attention warns that it is slow
        warnings.simplefilter("ignore")
        got = flex_attention(q.float(), k.float(), v.float(), score_mod=score_mod,
                             block_mask=block_mask, scale=scale_value(variant, D))
    ref = reference(variant, q, k, v, **{n: t.double() if t.is_floating_point() else t
                                         for n, t in inputs.items()})
    assert (got.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name,len_q,len_k,want", [
    ("full", 128, 200, {"is_causal": False}),
    ("causal", 128, 128, {"is_causal": True}),
    ("causal", 128, 200, None),            # torch's is_causal is top-left: only equal lengths
    ("gqa_causal", 64, 64, {"is_causal": True}),
    ("dropout", 64, 64, {"is_causal": True, "dropout_p": 0.1}),
    ("sliding_window", 64, 64, None),
    ("alibi", 64, 64, None),
    ("bigbird", 256, 256, None),
])
def test_sdpa_expressible(name, len_q, len_k, want):
    assert flex.sdpa_expressible(attncc.load(EXAMPLES / f"{name}.attn"), len_q, len_k) == want


def test_pairs_per_head_are_counted_exactly_in_blocks_of_rows(monkeypatch):
    """Past 16K tokens the count was sampled on a strided grid: at a stride of 4 every
    sample of `(q - k) % 4 == 0` passed, and the bench's TFLOP/s read 4x too high."""
    variant = attncc.load(EXAMPLES / "causal.attn")
    p = Problem(4, 2, 2, 1000, 1000, 16, 16)
    pairs = bench_command.pairs_per_head(variant, p, {}, "cpu")
    assert pairs == 1000 * 1001 / 2
    monkeypatch.setattr(bench_command, "PAIRS_PER_BLOCK", 3000)  # blocks of 3 rows
    assert bench_command.pairs_per_head(variant, p, {}, "cpu") == pairs
    dilated = attncc.load(EXAMPLES / "dilated_window.attn")
    from attncc.semantics.reference import allowed_pairs
    q = Problem(1, 2, 2, 999, 1000, 16, 16)
    want = allowed_pairs(dilated, q, {}, "cpu").expand(1, 1, 999, 1000).sum().item()
    assert bench_command.pairs_per_head(dilated, q, {}, "cpu") == want
    flops = bench_command.attention_flops(pairs, batch=4, heads=2, dim=16)
    assert flops["fwd"] == 4 * 4 * 2 * 16 * pairs and flops["bwd"] == 2.5 * flops["fwd"]


def test_bench_table_formats_skips_and_ratios():
    meta = {"len": 4096, "batch": 4, "heads_q": 16, "heads_kv": 16, "dim": 128,
            "pairs_per_head": 8.4e6, "pairs_exact": True}
    res = {"attncc": {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_tflops": 100.0, "bwd_tflops": 120.0},
           "flex": {"fwd_ms": 1.5, "bwd_ms": 3.0, "fwd_tflops": 66.7, "bwd_tflops": 80.0},
           "sdpa-flash": {"skipped": "not expressible"}}
    text = bench_command.format_bench(meta, res)
    assert "1.50x" in text and "sdpa-flash  skipped: not expressible" in text


# ------------------------------------------------------------------ user errors, one line each
@pytest.mark.parametrize("argv, words", [
    (["check", "SPEC", "--seed", str(2 ** 64)], "--seed 18446744073709551616: a seed is an integer"),
    (["check", "SPEC", "--dim", "100000000000"], "--dim 100000000000: the kernels take head dims 16 to 256"),
    (["show", "SPEC", "--len", "64"], "--len size the drawing of --plot, which was not asked for"),
    (["show", "SPEC", "--plot", "mask.txt"], "the drawing is a PNG; name the file FILE.png"),
    (["compile", "attention triton { mask q >= k }"], "would hide the module 'triton'"),
    (["compile", "attention import { mask q >= k }"], "a Python keyword"),
    (["show", ""], "the spec is empty: pass a .attn file"),  # read as the directory '.'
])
def test_out_of_range_and_ignored_arguments_are_one_line_errors(argv, words, capsys):
    """--seed past 64 bits and --dim 1e11 crashed with tracebacks (exit 1, the code of a
    failed check); show's sizes without --plot did nothing; a variant named triton wrote
    triton.py, after which `import triton` failed in that directory."""
    argv = [str(EXAMPLES / "causal.attn") if a == "SPEC" else a for a in argv]
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_lengths_past_the_commands_limit_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check", str(EXAMPLES / "causal.attn"), "--len", "3000000000"])
    assert exit_.value.code == 2 and "lengths must be at most 65536" in capsys.readouterr().err


def test_compile_into_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    target = tmp_path / "afile"
    target.write_text("")
    assert main(["compile", str(EXAMPLES / "causal.attn"), "-o", str(target)]) == 2
    assert f"-o {target}: not a directory" in capsys.readouterr().err


def test_a_warning_raised_as_an_error_and_a_closed_pipe_end_without_a_traceback(tmp_path):
    """python -W error turned a SpecWarning into a traceback; `compile ... | head -1` gave
    a BrokenPipeError traceback; warnings were prefixed `<frozen runpy>:88:`."""
    spec = "attention escaping { input bias: f32[h, 10]\n score s + bias[h, q - k] }"
    env = dict(os.environ)  # as run_cli: attncc from ROOT, the working directory
    raised = subprocess.run([sys.executable, "-W", "error", "-m", "attncc", "show", spec],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert raised.returncode == 2 and "Traceback" not in raised.stderr
    assert "error (a warning, raised under -W error)" in raised.stderr
    shown = run_cli("show", spec)
    assert shown.returncode == 0 and "attncc: SpecWarning: " in shown.stderr
    assert "<frozen runpy>" not in shown.stderr
    piped = subprocess.run(f"{sys.executable} -m attncc compile {EXAMPLES / 'causal.attn'} "
                           f"-o {tmp_path} | head -1", shell=True, capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=120)
    assert piped.stdout.startswith("variant") and "Traceback" not in piped.stderr


def test_check_warns_when_every_length_lies_in_one_layout_block(capsys, monkeypatch):
    """The interpreter's default lengths (37; 20 x 45) are below every example layout's
    block (64 or 128): each layout reduced to one tile, and check printed OK silently."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["check", str(EXAMPLES / "bigbird.attn"), "--len", "20", "--dim", "16",
                 "--heads", "2", "--dtype", "float32"]) == 0
    assert "warning: every length checked lies within one layout block (128)" in capsys.readouterr().out
