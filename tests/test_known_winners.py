"""Shipped winners (runtime/known_winners.py): the file is valid, lookups match only a
call's own GPU, direction, head dim, dtype and class at a nearby length, and a match
replaces tuning unless ATTNCC_TUNE=full asks for it."""
import json
import types

import pytest
import torch

import attncc
from attncc.backends.tile_config import TileConfig
from attncc.runtime import known_winners, tuning

CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
TILES = TileConfig.from_dict(CONFIG, "test")  # as the table holds it


def _rows(entries):
    """The table of one GPU, "GPU X"'s, for these entries."""
    return known_winners.table_from({"GPU X": entries}, "test")["GPU X"]


def test_the_shipped_file_is_valid():
    table = known_winners.load_table()  # raises on an entry that is not a config
    data = json.loads(known_winners.WINNERS_FILE.read_text())
    assert set(data) == {"about", "winners"}
    assert sum(len(rows) for per_gpu in table.values() for rows in per_gpu.values()) == \
        sum(len(entries) for entries in data["winners"].values())


def test_a_bad_entry_in_the_file_is_an_error(tmp_path):
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({"about": "", "winners": {"GPU X": {
        "fwd-d128-bfloat16-bounds@1/2-q16384-k16384": dict(CONFIG, num_warps=3)}}}))
    with pytest.raises(ValueError, match="num_warps"):
        known_winners.load_table(str(bad))
    bad.write_text(json.dumps({"about": "", "winners": {"GPU X": {
        "backend-d128-bfloat16-bounds@1/2-q16384-k16384": "cudnn"}}}))
    with pytest.raises(ValueError, match="triton or gluon"):
        known_winners.load_table(str(bad))


@pytest.mark.parametrize("key", ["fwd-d128-bfloat16-bounds+score@1/2-q16384-k4096",
                                 "gluon-fwd-d64-float16-full@1/1-q16-k32",
                                 "bwd-d128-bfloat16-layout@1/32-q16384-k16384"])
def test_keys_parse_back(key):
    head, q, k = known_winners._parse(key)
    assert known_winners.entry_key(*head, q, k) == key


def test_lookup_takes_the_nearest_length_within_a_factor_of_four():
    other = dict(CONFIG, BLOCK_N=32)
    table = {"GPU X": _rows({"fwd-d128-bfloat16-bounds@1/2-q16384-k16384": CONFIG,
                             "fwd-d128-bfloat16-bounds@1/2-q1024-k1024": other})}
    look = lambda **kw: known_winners.lookup(**{**dict(gpu="GPU X", direction="fwd", dim=128,
                                                     dtype="bfloat16", vclass="bounds@1/2",
                                                     len_q=16384, len_k=16384), **kw},
                                             table=table)
    assert look() == TILES
    assert look(len_q=65536, len_k=65536) == TILES
    assert look(len_q=131072, len_k=131072) is None  # 8x: tuned, not guessed
    assert look(len_q=2048, len_k=2048) == TileConfig.from_dict(other, "test")  # nearer to 1024
    assert look(len_q=512, len_k=16384) is None  # k near one entry, q near the other
    for change in (dict(gpu="GPU Y"), dict(direction="dq"), dict(dim=64),
                   dict(dtype="float16"), dict(vclass="bounds+score@1/2"),
                   dict(vclass="bounds@1/8"), dict(vclass="tables@1/2")):
        assert look(**change) is None, change


@pytest.mark.parametrize("spec, uses_tables, expected", [
    ("attention a { }", False, "full@1/2"),
    ("attention a { mask q >= k }", False, "bounds@1/2"),
    ("attention a { input sl: f32[h] mask q >= k score s + sl[h] * (k - q) }", False,
     "bounds+score@1/2"),
    ("attention a { mask q >= k score 30.0 * tanh(s / 30.0) }", False, "bounds+heavyscore@1/2"),
    ("attention a { input doc: i32[q] mask doc[q] == doc[k] }", True, "tables@1/2"),
    ("attention a { input r: bool[qb, kb] layout r[qb, kb] block 64 }", True, "layout@1/2"),
])
def test_variant_classes(spec, uses_tables, expected):
    assert known_winners.variant_class(attncc.parse(spec), uses_tables, "1/2") == expected


def _fake_call(monkeypatch, entries, spec="attention a { mask q >= k }"):
    """A kernel and problem as config_for sees them, on a pretend GPU named GPU X."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU X")
    monkeypatch.setattr(known_winners, "load_table", lambda *a: {"GPU X": _rows(entries)})
    monkeypatch.setattr(tuning, "_MEMORY", {})
    monkeypatch.setattr("attncc.runtime.settings.interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_versions", lambda: "test")
    variant = attncc.parse(spec)
    kernel = types.SimpleNamespace(variant=variant, key="k", pinned_config=None,
                                   module=types.SimpleNamespace(USES_TABLES=False))
    problem = types.SimpleNamespace(dim=128, dim_v=128, tile_dim=128, len_q=16000, len_k=16000, group=1)
    return kernel, problem


def test_a_shipped_winner_replaces_tuning(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    kernel, problem = _fake_call(monkeypatch, {"fwd-d128-bfloat16-bounds@1/2-q16384-k16384": CONFIG})
    ran = []
    config = tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run=ran.append,
                               shape_density=lambda: 0.45)
    assert config == TILES and ran == []  # nothing compiled or timed
    assert not list(tmp_path.rglob("*.json"))  # and nothing cached as if tuned


def test_tune_full_tunes_even_where_a_winner_is_shipped(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNCC_TUNE", "full")
    kernel, problem = _fake_call(monkeypatch, {"fwd-d128-bfloat16-bounds@1/2-q16384-k16384": CONFIG})
    timed = []
    monkeypatch.setattr(tuning, "time_candidates", lambda name, key, candidates, run, label: (
        timed.append(candidates) or [(1.0, candidates[0])]))
    config = tuning.config_for(kernel, problem, torch.bfloat16, "fwd", run=lambda c: None,
                               shape_density=lambda: 0.45)
    assert timed and len(timed[0]) == tuning.TUNE_AT_MOST and config == timed[0][0].config


def test_a_shipped_backend_choice_picks_the_backend_and_its_config(monkeypatch, tmp_path):
    """Where several backends can run a role, the shipped entry naming the faster picks
    one, and its shipped config runs: nothing compiled or timed. Without that entry, each
    backend's shipped config is timed against the other's, and nothing else."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    ws = dict(BLOCK_M=128, BLOCK_N=128, num_warps=9, num_stages=2)
    entries = {"fwd-d128-bfloat16-bounds@1/2-q16384-k16384": CONFIG,
               "gluon-fwd-d128-bfloat16-bounds@1/2-q16384-k16384": ws}
    kernel, problem = _fake_call(monkeypatch, {
        **entries, "backend-d128-bfloat16-bounds@1/2-q16384-k16384": "gluon"})
    ran = []
    runs = {name: lambda config, name=name: ran.append(name) for name in ("gluon", "triton")}
    choose = lambda: tuning.choose(kernel, problem, torch.bfloat16, "fwd", runs,
                                   shape_density=lambda: 0.45)
    assert choose() == tuning.Choice("gluon", TileConfig.from_dict(ws, "test")) and ran == []
    kernel, problem = _fake_call(monkeypatch, entries)
    timed = []
    monkeypatch.setattr(tuning, "time_candidates", lambda name, key, candidates, run, label: (
        timed.append(candidates) or [(2.0, candidates[0]), (1.0, candidates[1])]))
    assert choose() == tuning.Choice("triton", TILES)
    assert [c.backend for c in timed[0]] == ["gluon", "triton"]


def test_another_density_is_another_class(monkeypatch, tmp_path):
    # causal (half the tiles) and a 1024-wide window at 16K (1/16) want other tiles
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    kernel, problem = _fake_call(monkeypatch, {"fwd-d128-bfloat16-bounds@1/2-q16384-k16384": CONFIG})
    shipped = lambda d: known_winners.shipped(kernel, problem, torch.bfloat16, "fwd",
                                              ("triton",), d)
    assert shipped(lambda: 0.5) == {"triton": TILES}
    assert shipped(lambda: 0.26) == {"triton": TILES}  # 1/4: the neighbouring bucket
    assert shipped(lambda: 0.07) == {"triton": None}  # 1/16: too far
    assert shipped(None) is None  # a caller that cannot say its density gets none


def test_a_winner_the_variant_cannot_run_is_not_used(monkeypatch, tmp_path):
    # An index-list layout of 32-blocks needs tiles within its block: a shipped 128x64
    # winner for its class must be passed over (and the call tuned).
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    spec = "attention a { input t: i32[h, qb, 2] layout kb in t[h, qb] block 32 }"
    kernel, problem = _fake_call(monkeypatch, {"fwd-d128-bfloat16-layout@1/2-q16384-k16384": CONFIG},
                                 spec=spec)
    half = lambda: 0.5
    shipped = lambda: known_winners.shipped(kernel, problem, torch.bfloat16, "fwd", ("triton",),
                                            half)["triton"]
    assert shipped() is None
    # the same winner serves a layout whose tiles may span blocks
    spec = "attention a { input r: bool[qb, kb] layout r[qb, kb] block 32 }"
    kernel, problem = _fake_call(monkeypatch, {"fwd-d128-bfloat16-layout@1/2-q16384-k16384": CONFIG},
                                 spec=spec)
    assert shipped() == TILES


def test_an_unknown_tuning_mode_is_refused(monkeypatch):
    monkeypatch.setenv("ATTNCC_TUNE", "fulll")
    with pytest.raises(ValueError, match=r"ATTNCC_TUNE='fulll'.*full"):
        tuning.tune_mode()


def test_the_class_density_of_a_small_tensor_free_grid_is_computed_on_the_host(monkeypatch):
    """The shipped winners' class needs the call's tile density. A mask that reads no
    tensor, on a grid of at most HOST_DENSITY_TILES tiles, is measured on the host (no
    device kernels to load, no sync: RESULTS.md run 100); tensors or large grids stay on
    the call's device."""
    from attncc.arguments import Problem
    from attncc.runtime import kernel as kernel_module
    seen = []
    monkeypatch.setattr(kernel_module, "tile_density",
                        lambda module, p, inputs, device, block: seen.append(device) or 0.5)
    causal = attncc.compile("attention causal { mask q >= k }")
    document = attncc.compile("attention document { input doc: i32[q]  mask doc[q] == doc[k] }")
    small = Problem(1, 2, 2, 4096, 4096, 64, 64)
    large = Problem(1, 2, 2, 65536, 65536, 64, 64)  # 1024 x 1024 tiles of 64
    for kernel, p, expected in ((causal, small, "cpu"), (causal, large, "device"),
                                (document, small, "device")):
        assert kernel.tuning_inputs(p, {}, "device")[2]() == 0.5
        assert seen.pop() == expected
