"""Every failure the fuzzers and the reliability tests found, as a named test.

Each test names the bug it pins down; all of them are fixed. Nothing here is skipped.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attncc
from attncc import tuning

from test_caches import CALL_AND_CHECK, SPEC, _cached_module, env_for


# ------------------------------------------------------------------ layouts of one tile index
@pytest.mark.parametrize("layout", ["kb == 0", "qb < 2", "true", "qb < 0"])
def test_layout_that_reads_only_one_tile_index(layout):
    # _layout_grid returned the grid at its broadcast shape ([1, 1, QB, 1] for `qb < 2`)
    # and _tile_tables indexed both tile axes: IndexError with more than one tile.
    v = attncc.parse(f"attention one_index {{ layout {layout} block 16 }}")
    gen = torch.Generator().manual_seed(0)
    q, k, w = (torch.randn(2, 2, 40, 16, generator=gen) for _ in range(3))
    out = attncc.compile(v)(q, k, w)
    ref = attncc.reference(v, q.double(), k.double(), w.double())
    assert (out.double() - ref).abs().max() < 1e-5


# ------------------------------------------------------------------ caches and bad bytes
def test_tuning_file_with_bytes_that_are_not_utf8_is_rebuilt(tmp_path):
    # write_if_changed compared with read_text(), which raised UnicodeDecodeError.
    path = tmp_path / "v.json"
    path.write_bytes(b"{\"fwd\": \xff\xfe}")
    assert tuning._load(path) == {}
    config = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    tuning._store(path, "dq-d32", config)
    assert tuning._load(path) == {"dq-d32": config}


def test_module_file_with_bytes_that_are_not_utf8_is_rewritten(tmp_path):
    # A torn write left a module that no process could rewrite (same cause as above).
    cache = tmp_path / "cache"
    path = _cached_module(cache)
    whole = path.read_bytes()
    path.write_bytes(whole[:100] + b"\xff\xfe" + whole[102:])
    result = subprocess.run([sys.executable, "-c", CALL_AND_CHECK.format(spec=SPEC)],
                            env=env_for(cache), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert path.read_bytes() == whole
