"""Triton's compiler failing on a generated kernel: the configs known to crash ptxas on
sm_90 are never candidates, and a compile failure that happens anyway is skipped by the
tuner or reaches the user as an attncc error naming the kernel, head dim and config.

The crashes were found by compiling every kept candidate for sm_90 on the CPU
(benchmarks/portable_compile.py --all-configs); the slow test here does that again with
the installed Triton.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attncc
from attncc.arguments import Problem
from attncc.errors import AttnccError, KernelCompileError
from attncc import backends
from attncc.backends.portable import tiles
from attncc.backends.tile_config import TileConfig
from attncc.runtime import configs, known_winners, tuning

PORTABLE = backends.portable()

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DIMS = (16, 32, 48, 64, 80, 96, 128, 192, 256)

# (direction, head dim, BLOCK_M, BLOCK_N, num_warps, num_stages) that ptxas crashed on
# (SIGSEGV, "error code -11") compiling examples/causal.attn for sm_90 under Triton 3.6,
# in fp16 (and in bf16 but for the two dQ ones at 32). Swept: every dQ and dK/dV
# candidate at head dims 16 to 256 in both dtypes (296 compiles, 4 crashed) and every
# forward candidate at 16 and 32 (40 compiles, 4 crashed). Triton 3.9 compiles all of
# them. Full attention and softcap (dQ, dK/dV) and bigbird (one-launch backward) at
# head dims 16 and 32 compiled every candidate keep() leaves
# (benchmarks/portable_compile.py --all-configs).
CRASHED_ON_TRITON_3_6 = [
    ("fwd", 16, 64, 32, 4, 2),
    ("fwd", 32, 64, 32, 4, 2),
    ("dq", 16, 64, 64, 4, 2),
    ("dq", 32, 64, 64, 8, 2),
    ("dq", 32, 128, 64, 8, 2),
]

VARIANTS = [attncc.load(EXAMPLES / name) for name in
            ("causal.attn", "full.attn", "softcap.attn", "document.attn", "bigbird.attn")]


def _config(m, n, w, s):
    return TileConfig(m, n, w, s)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_configs_that_crashed_the_compiler_are_never_candidates(variant):
    for direction, dim, *shape in CRASHED_ON_TRITON_3_6:
        config = _config(*shape)
        assert not tiles.keep(config, variant, dim, direction)
        assert config not in PORTABLE.candidates(direction, dim, variant)
        # ... and a cached or shipped one is not used either (configs.usable).
        assert not configs.usable(PORTABLE.name, config, variant, dim, direction)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_head_dim_keeps_candidates_for_the_tuner(variant):
    for dim in DIMS + (17, 40, 200):
        for direction in ("fwd", "dq", "dkdv", "bwd"):
            assert len(PORTABLE.candidates(direction, dim, variant)) >= 2, (dim, direction)


def test_shipped_winners_pass_the_filter():
    data = json.loads(known_winners.WINNERS_FILE.read_text())["winners"]
    plain = attncc.load(EXAMPLES / "causal.attn")
    checked = 0
    for entries in data.values():
        for key, winner in entries.items():
            (what, dim, _, _), _, _ = known_winners._parse(key)
            if isinstance(winner, dict) and "-" not in what:  # a portable kernel's config
                assert tiles.keep(TileConfig.from_dict(winner, key), plain, dim, what), key
                checked += 1
    assert checked > 0


class _Kernel:
    variant = attncc.load(EXAMPLES / "causal.attn")


def _ptxas_crash(config):
    from triton.runtime.errors import PTXASError
    raise PTXASError("`ptxas` raised SIGSEGV\n`ptxas` stderr:\n\nRepro command: ptxas k.ptx\n")


def test_a_compile_failure_at_run_time_names_the_kernel_head_dim_and_config():
    config = _config(64, 64, 4, 2)
    problem = Problem(2, 4, 2, 100, 100, 16, 16)
    with pytest.raises(KernelCompileError) as info:
        tuning.launch(_Kernel(), problem, torch.float16, "dq", _ptxas_crash, config)
    text = str(info.value)
    for part in ("could not compile the dQ kernel of 'causal'", "head dim 16 (float16)",
                 "BLOCK_M=64 BLOCK_N=64 warps=4 stages=2", "`ptxas` raised SIGSEGV",
                 "ATTNCC_CONFIG", "ATTNCC_TUNE=full"):
        assert part in text
    assert isinstance(info.value, AttnccError) and "Repro command" not in text


def test_other_errors_of_a_launch_pass_through_unchanged():
    def refuse(config):
        raise ValueError("not a compile failure")
    with pytest.raises(ValueError, match="not a compile failure"):
        tuning.launch(_Kernel(), Problem(1, 1, 1, 8, 8, 16, 16), torch.float16, "fwd", refuse,
                      _config(16, 16, 4, 1))


def _counting_run(bad):
    ran = []

    def run(config):
        ran.append(config.label())
        if config.label() == bad:
            _ptxas_crash(config)
    return run, ran


def test_the_untimed_choice_skips_a_config_that_fails_to_compile(caplog):
    kernel = attncc.compile(EXAMPLES / "causal.attn")
    kept = lambda: [_config(64, 64, 4, 2), _config(64, 64, 4, 3)]
    run, ran = _counting_run("64x64 w4 s2")
    with caplog.at_level("INFO", logger="attncc.tuning"):
        chosen = tuning.first_that_runs(kernel, Problem(1, 1, 1, 8, 8, 16, 16), torch.float16,
                                        "dq", kept, run)
    assert chosen == _config(64, 64, 4, 3) and ran == ["64x64 w4 s2", "64x64 w4 s3"]
    assert "64x64 w4 s2 failed to compile (PTXASError" in caplog.text


def test_the_tuner_skips_a_config_that_fails_to_compile(monkeypatch, caplog):
    import triton
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    run, _ = _counting_run("64x64 w4 s2")
    with caplog.at_level("INFO", logger="attncc.tuning"):
        best = tuning.tune("causal", "dq-d16", [_config(64, 64, 4, 2), _config(32, 64, 4, 2)], run)
    assert best == _config(32, 64, 4, 2)
    assert "64x64 w4 s2 failed (PTXASError" in caplog.text


@pytest.mark.slow
def test_portable_kernels_compile_for_hopper_at_every_head_dim(tmp_path):
    # Every kept candidate at head dims 16 and 32 (where ptxas crashed), the ones the tuner
    # times elsewhere, fp16 and bf16, for sm_90 with the installed Triton (no GPU needed).
    pytest.importorskip("triton.backends.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = str(ROOT / "benchmarks" / "portable_compile.py")
    runs = [["--dims", "16,32", "--directions", "fwd,dq,dkdv", "--all-configs"],
            ["--dims", ",".join(str(d) for d in DIMS), "--directions", "fwd,dq,dkdv"]]
    for args in runs:
        result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                                env=env, timeout=3600, cwd=ROOT)
        lines = [x for x in result.stdout.splitlines() if ": ok (" in x or ": FAILED " in x]
        assert result.returncode == 0 and lines, "\n".join(
            [x for x in lines if "FAILED" in x] or [result.stderr[-3000:]])
