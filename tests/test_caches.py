"""Caches that cannot corrupt: the generated-module cache and the tuning cache.

Real processes race on one cache directory; damaged files must be detected and
rewritten, never imported or trusted as they are; and every cache key changes with
whatever changes the code or the machine.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import attncc
import attncc.version
from attncc.backends.tile_config import TileConfig
from attncc.runtime import cache, settings, tuning
from attncc.backends.portable.codegen import generate

SPEC = "attention cached { mask q >= k and q - k < 21 }"
CALL_AND_CHECK = """
import attncc, torch
kernel = attncc.compile({spec!r})
q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))
out = kernel(q, k, v)
ref = attncc.reference(kernel.variant, q.double(), k.double(), v.double())
assert (out.double() - ref).abs().max() < 1e-4, "wrong result"
print(kernel.module.__file__)
"""


def env_for(cache: Path) -> dict:
    env = dict(os.environ, ATTNCC_CACHE_DIR=str(cache), TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(attncc.__file__).parent.parent),
                                         env.get("PYTHONPATH", "")])
    return env


def python(code: str, cache: Path, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env_for(cache), capture_output=True,
                          text=True, timeout=timeout)


def module_files(cache: Path, variant) -> list:
    return sorted((cache / "modules").glob(f"{generate(variant).module_name}_*.py"))


# ------------------------------------------------------------------ (a) racing processes
def test_processes_compiling_the_same_variant_at_once_share_one_module(tmp_path):
    """Processes start together (each signals it has imported everything, then waits
    for one start signal), compile and run the same variant into one empty cache."""
    cache, n = tmp_path / "cache", 4
    script = textwrap.dedent("""
        import os, sys, time
        import attncc, torch
        ready, start = sys.argv[1], sys.argv[2]
        open(ready, "w").close()
        while not os.path.exists(start):
            time.sleep(0.0005)
    """) + CALL_AND_CHECK.format(spec=SPEC)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"ready{i}"),
                               str(tmp_path / "start")], env=env_for(cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(n)):
            assert time.time() < deadline, "the processes never got ready"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.01)
        (tmp_path / "start").touch()
        results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out, err, rc in results:
        assert rc == 0, err
    variant = attncc.parse(SPEC)
    files = module_files(cache, variant)
    assert len(files) == 1, files
    assert {out.strip() for out, _, _ in results} == {str(files[0])}
    assert files[0].read_text() == generate(variant).source
    leftovers = [p.name for p in (cache / "modules").iterdir() if p != files[0]
                 and p.name not in ("__pycache__", "index")]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    (index,) = (cache / "modules" / "index").iterdir()  # one entry, no temporary file
    assert json.loads(index.read_text())["module"] == files[0].stem


# ------------------------------------------------------------------ (b) damaged modules
def _cached_module(cache: Path) -> Path:
    result = python(CALL_AND_CHECK.format(spec=SPEC), cache)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.parent == cache / "modules" and path.read_text() == generate(attncc.parse(SPEC)).source
    return path


DAMAGES = {
    "truncated": lambda whole: whole[: len(whole) // 2],  # a SyntaxError if imported
    # Valid Python that would import cleanly and then do the wrong thing.
    "garbage_python": lambda whole: "def forward(*a, **k):\n    raise SystemExit('imported a damaged module')\n",
    "empty": lambda whole: "",
    "stale_text": lambda whole: whole.replace("BLOCK", "BL0CK", 3),
}


# Each damage costs two fresh processes; the two that fail differently (a SyntaxError, a
# module that imports and misbehaves) run by default, the others behind `slow`.
@pytest.mark.parametrize("damages", [("truncated", "garbage_python"),
                                     pytest.param(("empty", "stale_text"), marks=pytest.mark.slow)])
def test_a_damaged_module_file_is_rewritten_not_imported(tmp_path, damages):
    """Each damage in turn, each followed by a fresh process compiling the variant.
    (Bytes that are not UTF-8: see test_regressions.py.)"""
    cache = tmp_path / "cache"
    path = _cached_module(cache)
    whole = path.read_text()
    for damage in damages:
        path.write_text(DAMAGES[damage](whole))
        result = python(CALL_AND_CHECK.format(spec=SPEC), cache)
        assert result.returncode == 0, (damage, result.stderr[-2000:])
        assert Path(result.stdout.strip()) == path, damage
        assert path.read_text() == whole, f"{damage}: the damaged file was not rewritten"


@pytest.mark.parametrize("damages", [
    ("{",),
    # The other damages, each a process of its own: behind `slow`, for the suite's time.
    pytest.param(("", '{"module": "elsewhere", "strategy": "", "sha256": "0"}'),
                 marks=pytest.mark.slow)], ids=["truncated", "empty_and_elsewhere"])
def test_a_warm_start_imports_the_cached_module_without_the_generator(tmp_path, damages):
    """The second process finds the module through the index (IR and generator hash),
    so it neither imports sympy nor renders the template; a damaged index is a miss."""
    cache = tmp_path / "cache"
    probe = CALL_AND_CHECK.format(spec=SPEC) + "import sys; print('sympy' in sys.modules)\n"
    cold = python(probe, cache)
    assert cold.returncode == 0, cold.stderr
    assert cold.stdout.split() [-1] == "True"
    warm = python(probe, cache)
    assert warm.returncode == 0, warm.stderr
    assert warm.stdout.split() == [cold.stdout.split()[0], "False"]
    (index,) = (cache / "modules" / "index").glob("cached-*.json")
    for damage in damages:
        index.write_text(damage)
        again = python(probe, cache)
        assert again.returncode == 0, (damage, again.stderr)
        assert again.stdout.split() == [cold.stdout.split()[0], "True"], damage
        assert json.loads(index.read_text())["module"] in again.stdout, "the index was not rewritten"


def test_the_module_index_is_keyed_by_the_generator(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    variant = attncc.parse(SPEC)
    first = cache._index_path(variant)
    monkeypatch.setattr(cache, "generator_digest", lambda: "another-attncc")
    assert cache._index_path(variant) != first and variant.key() in first.name


# ------------------------------------------------------------------ (c) the tuning cache
CONFIG = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
CHOICE = tuning.Choice("triton", TileConfig.from_dict(CONFIG, "test"))  # as the cache stores it


@pytest.mark.parametrize("damage", [
    b"", b"{", b"{\"fwd-d64\": ", b"[1, 2, 3]", b"null", b"\"text\"",
    b"{\"fwd-d64\": {\"backend\": \"triton\", \"config\": {\"BLOCK_M\": 64}}}",  # missing keys
    b"{\"fwd-d64\": {\"backend\": \"triton\", \"config\": {\"BLOCK_M\": 48, \"BLOCK_N\": 32, "
    b"\"num_warps\": 4, \"num_stages\": 2}}}",
    b"{\"fwd-d64\": 7}",
    b"{\"fwd-d64\": {\"BLOCK_M\": 64, \"BLOCK_N\": 32, \"num_warps\": 4, \"num_stages\": 2}}",
], ids=["empty", "open_brace", "truncated", "list", "null", "string", "missing_keys",
        "bad_block", "not_a_dict", "config_alone"])
def test_a_damaged_tuning_file_is_ignored_and_rebuilt(tmp_path, damage):
    path = tmp_path / "tuning" / "v.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(damage)
    assert tuning._load(path) == {}
    tuning._store(path, {"dq-d32": CHOICE.to_json()})
    assert json.loads(path.read_text()) == {"dq-d32": CHOICE.to_json()}
    assert tuning._load(path) == {"dq-d32": CHOICE}


def test_tuning_entries_accumulate_and_a_missing_file_is_created(tmp_path):
    path = tmp_path / "deep" / "dir" / "v.json"
    other = lambda **change: tuning.Choice("triton",
                                           TileConfig.from_dict(dict(CONFIG, **change), "t"))
    assert tuning._load(path) == {}
    tuning._store(path, {"a": CHOICE.to_json()})
    tuning._store(path, {"b": other(BLOCK_M=128).to_json()})
    tuning._store(path, {"a": other(num_warps=8).to_json()})  # a later winner replaces it
    assert tuning._load(path) == {"a": other(num_warps=8), "b": other(BLOCK_M=128)}


STORE_MANY = """
import os, sys, time
from pathlib import Path
from attncc.runtime import tuning
path, who, start, n = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
while not os.path.exists(start):
    time.sleep(0.0005)
entry = {"backend": "triton", "config": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)}
for i in range(n):
    tuning._store(path, {f"{who}-{i}": entry})
"""


def test_processes_storing_different_keys_at_once_keep_every_entry(tmp_path):
    """Two processes each store their own keys concurrently. The read-modify-write holds
    a file lock and every write is an atomic replace, so the file is always valid JSON
    and no process loses another's entry."""
    path, n = tmp_path / "tuning" / "v.json", 40
    procs = [subprocess.Popen([sys.executable, "-c", STORE_MANY, str(path), who,
                               str(tmp_path / "start"), str(n)], env=env_for(tmp_path),
                              stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    time.sleep(1.0)  # both have imported attncc.runtime.tuning (a light import) by now
    (tmp_path / "start").touch()
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    data = json.loads(path.read_text())
    assert all(tuning.Choice.from_json(c, "t") for c in data.values())
    assert set(data) == {f"{w}-{i}" for w in "ab" for i in range(n)}


# ------------------------------------------------------------------ (d) cache keys
def test_module_name_and_digest_change_with_the_ir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    a = attncc.parse("attention w { param window: int = 8 mask q >= k and q - k < window }")
    b = attncc.parse("attention w { param window: int = 9 mask q >= k and q - k < window }")
    assert a.key() != b.key()
    ga, gb = generate(a), generate(b)
    assert ga.module_name != gb.module_name and a.key() in ga.module_name
    assert ga.source != gb.source
    (gen_a, mod_a), (gen_b, mod_b) = cache.load_generated(a), cache.load_generated(b)
    assert mod_a.__file__ != mod_b.__file__
    assert len(list((tmp_path / "modules").glob("attncc_w_*.py"))) == 2
    # And the same IR, parsed again, names the same module.
    assert cache.load_generated(attncc.parse(
        "attention w { param window: int = 8 mask q >= k and q - k < window }"))[1] is mod_a


def test_module_name_changes_with_every_part_of_the_variant():
    base = "attention v { heads 4 / 2 param c: float = 2.0 mask q >= k score s * c }"
    edits = [base.replace("4 / 2", "4 / 1"), base.replace("2.0", "2.5"),
             base.replace("q >= k", "q > k"), base.replace("s * c", "s + c"),
             base.replace("score", "dropout 0.1 score"), base.replace("attention v", "attention u"),
             base.replace("mask", "scale 0.5 mask")]
    names = {generate(attncc.parse(t)).module_name for t in [base] + edits}
    assert len(names) == len(edits) + 1


def test_tuning_file_path_names_the_gpu_and_every_version(tmp_path, monkeypatch):
    import triton
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    v = attncc.parse("attention w { param window: int = 8 mask q - k < window }")
    path = tuning._cache_file(v)
    versions = tuning._versions()
    gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    for part in (gpu, f"triton{triton.__version__}",
                 f"torch{torch.__version__.split('+')[0]}", f"attncc{attncc.__version__}"):
        assert part in versions, (part, versions)
    assert path.parent == tmp_path / "tuning" / versions
    assert v.key() in path.name
    other = attncc.parse("attention w { param window: int = 9 mask q - k < window }")
    assert tuning._cache_file(other) != path
    monkeypatch.setattr(attncc.version, "__version__", "9.9.9")
    assert tuning._cache_file(v) != path and "attncc9.9.9" in str(tuning._cache_file(v))
    monkeypatch.setattr(triton, "__version__", "0.0.1")
    assert "triton0.0.1" in str(tuning._cache_file(v))
    monkeypatch.setattr(torch, "__version__", "0.0.2+cpu")
    assert "torch0.0.2-" in str(tuning._cache_file(v))


# ------------------------------------------------------------------ (e) untimed choice
def test_untuned_choice_skips_a_config_that_does_not_fit(monkeypatch, caplog):
    """ATTNCC_TUNE=0 takes the first candidate that fits the GPU, says which it skipped,
    and remembers the choice (run 12: a score reading a tensor overflowed shared memory
    at 128x128 tiles)."""
    import triton
    from types import SimpleNamespace
    from attncc.arguments import Problem
    monkeypatch.setenv("ATTNCC_TUNE", "0")
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    kernel = SimpleNamespace(key="k-untuned-test", pinned_config=None,
                             variant=attncc.parse("attention rel { mask q >= k }"))
    problem = Problem(1, 2, 2, 4096, 4096, 128, 128)
    tried = []

    def run(config):
        tried.append(config)
        if config.block_m == 128:
            raise triton.runtime.errors.OutOfResources(360448, 232448, "shared memory")

    with caplog.at_level(logging.INFO, logger="attncc.tuning"):
        chosen = tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run)
    assert chosen.block_m == 64 and tried[0].block_m == 128
    assert "does not fit" in caplog.text
    n = len(tried)
    assert tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run) == chosen
    assert len(tried) == n, "the choice is remembered, not retried"


def test_tuning_progress_names_the_layout_density_it_tuned_on(monkeypatch, caplog, tmp_path):
    """A layout variant's config serves every layout of its shape, so the tuner says
    which density it was chosen at."""
    import triton
    from types import SimpleNamespace
    spec = "attention lay { input on: bool[qb, kb] layout on[qb, kb] block 16 }"
    real = attncc.compile(spec)
    q = k = v = torch.randn(1, 2, 64, 16)
    on = torch.zeros(4, 4, dtype=torch.bool)
    on[:, 0] = True  # one block of four per row
    problem = real.check_call(q, k, v, {"on": on}, 0, 0)
    context = real._tuning_context(problem, {"on": on}, q.device)
    assert context() == "on a layout of tile density 0.250"
    assert real.density(q, k, v, on=on) == 0.25
    assert attncc.compile("attention c { mask q >= k }")._tuning_context(problem, {}, q.device) is None

    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))  # a fresh tuning cache
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    kernel = SimpleNamespace(key="k-density-test", pinned_config=None, variant=real.variant)
    with caplog.at_level(logging.INFO, logger="attncc.tuning"):
        tuning.config_for(kernel, problem, torch.bfloat16, "fwd", lambda config: None, context)
    assert "(on a layout of tile density 0.250)" in caplog.text and "tuned lay" in caplog.text


def test_kept_tables_tune_per_density_bucket(monkeypatch, caplog, tmp_path):
    """Few tiles per row want other tiles than many (RESULTS.md run 38), and kept tables
    know their density without a sync in the call: their calls tune per bucket."""
    import triton
    from types import SimpleNamespace
    from attncc.arguments import Problem
    assert [tuning.density_bucket(d) for d in (0.03, 0.0312, 0.04, 0.06, 0.3, 1.0, 0.0)] == \
        ["1/32", "1/32", "1/32", "1/16", "1/4", "1/1", "1/64"]
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    timings = {64: 2.0, 128: 1.0}  # 128-row tiles win at one density...
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: timings[fn()])
    kernel = SimpleNamespace(key="k-bucket-test", pinned_config=None,
                             variant=attncc.parse("attention lay { input on: bool[qb, kb] "
                                                  "layout on[qb, kb] block 128 }"))
    problem = Problem(1, 2, 2, 4096, 4096, 128, 128)
    run = lambda config: config.block_m
    caplog.set_level(logging.INFO, logger="attncc.tuning")
    dense = tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run, density=0.5)
    timings.update({64: 1.0, 128: 2.0})  # ...64-row tiles at another
    sparse = tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run, density=0.03)
    assert (dense.block_m, sparse.block_m) == (128, 64)
    assert caplog.text.count("tuned lay") == 2
    caplog.clear()
    assert tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run, density=0.035) == sparse
    assert tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run, density=0.45) == dense
    assert "tuned" not in caplog.text, "same buckets: found, not tuned again"


def test_a_call_with_kept_tables_passes_their_density_to_the_tuner(monkeypatch):
    spec = "attention lay { input on: bool[qb, kb] layout on[qb, kb] block 16 }"
    kernel = attncc.compile(spec)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    on = torch.zeros(4, 4, dtype=torch.bool)
    on[:, 0] = True
    seen = []
    real = tuning.choose
    contexts = []

    def spy(*a, **kw):
        seen.append(a[6] if len(a) > 6 else kw.get("density"))
        contexts.append(a[5]() if len(a) > 5 and a[5] else None)
        return real(*a, **kw)

    monkeypatch.setattr(tuning, "choose", spy)
    tables = kernel.tile_tables(q, k, v, on=on)
    assert tables.density == 0.25
    kernel(q.requires_grad_(), k, v, on=on, tables=tables).sum().backward()
    kernel(q, k, v, on=on).sum().backward()
    assert seen == [0.25, 0.25, None, None]  # forward and one-launch backward, then no tables
    # The progress lines name the density tuned on: the kept tables' own, or the layout's.
    assert contexts == ["on kept tables of tile density 0.250"] * 2 + \
        ["on a layout of tile density 0.250"] * 2


@pytest.mark.parametrize("name, value, says", [
    ("ATTNCC_BACKWARD", "streams",
     "ATTNCC_BACKWARD='streams': expected one of ('auto', 'one-launch', 'sequential')"),
    # Refused at import as well, not only by the first call that tunes (none does under
    # the interpreter).
    ("ATTNCC_TUNE", "2", "ATTNCC_TUNE='2' is not a tuning mode; use 0 (no timing"),
    ("ATTNCC_TUNE_CANDIDATES", "many",
     "ATTNCC_TUNE_CANDIDATES='many': expected a whole number of tile configs"),
    ("ATTNCC_TABLE_CACHE", "yes", "ATTNCC_TABLE_CACHE='yes': expected 1"),
])
def test_an_unknown_setting_is_refused_by_name(name, value, says):
    """By attncc.compile, and by the command line as a one-line error with exit 2: raised
    at import, it came before the command line could catch it (a traceback, exit 1,
    which `attncc check` means for a check out of tolerance)."""
    env = dict(os.environ, **{name: value})
    done = subprocess.run([sys.executable, "-c", "import attncc; attncc.compile('attention c {}')"],
                          env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert f"attncc.errors.SettingError: {says}" in done.stderr


def test_a_bad_setting_is_a_command_line_error(monkeypatch, capsys):
    """What the import recorded (above), raised inside the command line's handling."""
    from attncc.runtime import settings
    from attncc.tools.cli import main
    monkeypatch.setattr(settings, "_REFUSED_SETTINGS", ["ATTNCC_TUNE='2' is not a tuning mode"])
    assert main(["check", "attention c { mask q >= k }"]) == 2
    assert capsys.readouterr().err == "error: ATTNCC_TUNE='2' is not a tuning mode\n"


# ------------------------------------------------------------------ (d) what runs is what was hashed
PLANT_SPEC = "attention planted { mask q >= k and q - k < 13 }"
PLANTED_FLAG = "_attncc_planted_bytecode_ran"


def _fresh_load(variant):
    """cache.load_generated as a new process would: the module not imported yet."""
    for name in [n for n in sys.modules if n.startswith("attncc_planted_")]:
        del sys.modules[name]
    return cache.load_generated(variant)


def _plant_pyc(path: Path, source: str):
    """A .pyc of `source` that Python's source loader would take for `path`'s: its header
    carries the .py's mtime and size, the check the loader makes."""
    from importlib._bootstrap_external import _code_to_timestamp_pyc
    from importlib.util import cache_from_source
    st = path.stat()
    code = compile(source, str(path), "exec")
    pyc = Path(cache_from_source(str(path)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(_code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size))
    return pyc


def test_a_planted_pyc_beside_a_verified_module_never_runs(tmp_path, monkeypatch):
    import builtins
    import importlib.util
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delattr(builtins, PLANTED_FLAG, raising=False)
    variant = attncc.parse(PLANT_SPEC)
    gen, module = _fresh_load(variant)
    path = Path(module.__file__)
    assert not (path.parent / "__pycache__").exists(), "importing wrote bytecode"
    _plant_pyc(path, gen.source + f"\nimport builtins; builtins.{PLANTED_FLAG} = True\n")
    # The plant is one Python's own loader takes: importing the file that way runs it.
    spec = importlib.util.spec_from_file_location("probe_of_the_plant", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert getattr(builtins, PLANTED_FLAG, False), "the planted pyc is not a valid one"
    delattr(builtins, PLANTED_FLAG)
    # attncc's warm start verifies the .py (it is intact) and runs those bytes only.
    gen2, module2 = _fresh_load(variant)
    assert not hasattr(builtins, PLANTED_FLAG), "attncc ran the planted bytecode"
    assert module2 is not module and module2.__file__ == str(path) and gen2.source == gen.source
    # Kernels still get their source (triton.jit reads it through inspect) and code
    # objects name the file, so tracebacks point at it.
    fwd = module2.attn_fwd.fn
    assert inspect.getsource(fwd) in path.read_text()
    assert fwd.__code__.co_filename == str(path)


def test_a_modified_module_is_refused_and_rewritten_not_run(tmp_path, monkeypatch):
    import builtins
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delattr(builtins, PLANTED_FLAG, raising=False)
    variant = attncc.parse(PLANT_SPEC)
    gen, module = _fresh_load(variant)
    path = Path(module.__file__)
    path.write_text(gen.source + f"\nimport builtins; builtins.{PLANTED_FLAG} = True\n")
    _plant_pyc(path, path.read_text())  # and a pyc to match the modified file
    gen2, module2 = _fresh_load(variant)
    assert not hasattr(builtins, PLANTED_FLAG), "attncc ran a modified module"
    assert path.read_text() == gen.source == gen2.source, "the modified file was not rewritten"
