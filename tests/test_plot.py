"""attncc.plot: the PNG is drawn, and its numbers are the dense truth.

Counts are checked against hand-derived truth tables for simple masks, and against
`reference.allowed_pairs` plus a naive per-tile loop for the rest.
"""
import math
import re
import struct

import pytest
import torch

import attncc
from attncc.tools import plot
from attncc.arguments import Problem
from attncc.tools.cli import main
from attncc.errors import AttnccError
from attncc.semantics.reference import allowed_pairs

SUMMARY = re.compile(r"allowed (\d+) of (\d+) \(q,k\) pairs.*?: (\d+) empty .*?, (\d+) partial .*?, "
                     r"(\d+) full .* of (\d+)$")

CAUSAL = "attention causal { mask q >= k }"
WINDOW = "attention window { mask q >= k and q - k < 64 }"
DOCS = """attention docs {
    input doc: i32[q]
    mask doc[q] == doc[k] and q >= k
}"""
LAYOUT = """attention banded {
    layout abs(qb - kb) <= 1 or kb == 0
    block 64
}"""
PER_HEAD = "attention widening { mask q >= k and q - k < 32 * (h + 1) }"
RUNTIME_LAYOUT = """attention sparse {
    heads 8 / 2
    input lay: bool[h, qb, kb]
    layout lay[h, qb, kb] or qb == kb
    block 32
    mask q >= k
}"""


def numbers(summary: str) -> tuple:
    """(allowed, pairs, empty, partial, full, tiles) from a summary line."""
    m = SUMMARY.search(summary)
    assert m, summary
    return tuple(int(x) for x in m.groups())


def png_size(path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def naive_truth(allowed: torch.Tensor, tile: int) -> tuple:
    """(allowed, pairs, empty, partial, full, tiles) by looping over tiles of a [H, Lq, Lk] mask."""
    h_n, lq, lk = allowed.shape
    empty = partial = full = 0
    for h in range(h_n):
        for q0 in range(0, lq, tile):
            for k0 in range(0, lk, tile):
                block = allowed[h, q0:q0 + tile, k0:k0 + tile]
                if not block.any():
                    empty += 1
                elif block.all():
                    full += 1
                else:
                    partial += 1
    return (int(allowed.sum()), allowed.numel(), empty, partial, full, empty + partial + full)


def dense_truth(variant, len_q, len_k, tile, heads):
    """The numbers from the public dense reference, with the plot's own sample inputs."""
    p = Problem(1, heads, variant.heads.kv if variant.heads else heads, len_q, len_k, 64, 64)
    inputs = plot.sample_inputs(variant, p)
    allowed = allowed_pairs(variant, p, inputs, "cpu").expand(1, heads, len_q, len_k)[0]
    return naive_truth(allowed, tile)


# ------------------------------------------------------------- truth tables by hand
@pytest.mark.parametrize("name, spec, length, tile, want", [
    # 256*257/2 pairs; the 4 diagonal tiles are partial, 6 below full, 6 above empty.
    ("causal", CAUSAL, 256, 64, (256 * 257 // 2, 256 ** 2, 6, 4, 6, 16)),
    # Ragged edge: tile (1, 0) covers q in [64, 100) and k in [0, 64): all attend.
    ("causal ragged", CAUSAL, 100, 64, (100 * 101 // 2, 100 ** 2, 1, 2, 1, 4)),
    # Each query sees min(q + 1, 64) keys; diagonal and sub-diagonal tiles are partial.
    ("window", WINDOW, 256, 64, (64 * 65 // 2 + 192 * 64, 256 ** 2, 9, 7, 0, 16)),
    # 10 band tiles plus (2, 0) and (3, 0), each a whole 64x64 block.
    ("layout", LAYOUT, 256, 64, (12 * 64 * 64, 256 ** 2, 4, 0, 12, 16)),
    # The same layout at tile 32: each layout block is four full tiles.
    ("layout fine", LAYOUT, 256, 32, (12 * 64 * 64, 256 ** 2, 16, 0, 48, 64)),
])
def test_truth_tables(tmp_path, name, spec, length, tile, want):
    out = tmp_path / "mask.png"
    summary = plot.plot_variant(attncc.parse(spec), out, len_q=length, len_k=length, tile=tile)
    assert numbers(summary) == want
    w, h = png_size(out)
    assert 800 <= w <= 2000 and 500 <= h <= 1500, (w, h)


def test_summary_fractions_are_printed(tmp_path):
    summary = plot.plot_variant(attncc.parse(CAUSAL), tmp_path / "c.png", len_q=256, len_k=256, tile=64)
    assert "(50.20%)" in summary  # 32896 / 65536
    assert "6 empty (37.5%), 4 partial (25.0%), 6 full (37.5%) of 16" in summary


# ------------------------------------------------------ against the dense reference
@pytest.mark.parametrize("spec, len_q, len_k, tile, heads", [
    (DOCS, 300, 300, 64, 1),
    (CAUSAL, 130, 200, 48, 1),
    (PER_HEAD, 256, 256, 32, 4),  # per-head without `heads`: 4 sample heads
    (RUNTIME_LAYOUT, 200, 200, 64, 8),  # layout block 32, drawn at tile 64, over all 8 heads
])
def test_matches_dense_reference(tmp_path, spec, len_q, len_k, tile, heads):
    variant = attncc.parse(spec)
    out = tmp_path / "mask.png"
    summary = plot.plot_variant(variant, out, len_q=len_q, len_k=len_k, tile=tile)
    assert numbers(summary) == dense_truth(variant, len_q, len_k, tile, heads)
    assert (f"over {heads} heads" in summary) == (heads > 1)
    w, h = png_size(out)
    assert w >= 800 and h >= 500
    if heads > 1:  # one row of panels per drawn head, up to 4
        assert h > 1500


def test_chunked_rows_match_allowed_pairs(monkeypatch):
    # Tiny chunks that do not line up with tiles: the row slicing must not change a count.
    monkeypatch.setattr(plot, "CHUNK_ELEMENTS", 7 * 8 * 100)
    variant = attncc.parse(RUNTIME_LAYOUT)
    p = Problem(1, 8, 2, 100, 90, 64, 64)
    inputs = plot.sample_inputs(variant, p)
    counts, masks = plot.measure(variant, p, inputs, 16, list(range(8)), [0, 5])
    full = allowed_pairs(variant, p, inputs, "cpu").expand(1, 8, 100, 90)[0]  # [H, Lq, Lk]
    for h in (0, 5):
        assert (torch.from_numpy(masks[h]) == full[h]).all()
    padded = torch.nn.functional.pad(full, (0, 6, 0, 12)).long()  # to 112 x 96
    want = padded.view(8, 7, 16, 6, 16).sum((2, 4))  # [H, QT, KT]
    assert torch.equal(counts, want)


def test_per_head_detection():
    assert plot.is_per_head(attncc.parse(PER_HEAD))
    assert plot.is_per_head(attncc.parse(RUNTIME_LAYOUT))  # reads an input with an h axis
    assert not plot.is_per_head(attncc.parse(CAUSAL))
    # Slopes per head only change scores, not which pairs attend.
    alibi = attncc.parse("attention alibi { input slopes: f32[h] mask q >= k "
                         "score s + slopes[h] * (k - q) }")
    assert not plot.is_per_head(alibi)


def test_sample_inputs_are_plausible_and_seeded():
    variant = attncc.parse(RUNTIME_LAYOUT.replace("input lay", "input doc: i32[q]\n    input lay"))
    p = Problem(1, 8, 2, 1000, 1000, 64, 64)
    a, b = plot.sample_inputs(variant, p), plot.sample_inputs(variant, p)
    assert all(torch.equal(a[n], b[n]) for n in a)
    doc = a["doc"]
    assert doc.dtype == torch.int32 and doc.shape == (1000,)
    assert (doc[1:] >= doc[:-1]).all() and 2 <= int(doc.max()) + 1 <= 8  # sorted documents
    lay = a["lay"]
    assert lay.dtype == torch.bool and lay.shape == (8, math.ceil(1000 / 32), math.ceil(1000 / 32))
    assert 0.1 < lay.float().mean() < 0.3


def test_title_says_inputs_are_samples(tmp_path, monkeypatch):
    titles = []
    real = plot._draw
    monkeypatch.setattr(plot, "_draw", lambda *a, **kw: titles.append(kw["title"]) or real(*a, **kw))
    plot.plot_variant(attncc.parse(DOCS), tmp_path / "d.png", len_q=128, len_k=128, tile=32)
    assert "docs" in titles[0] and "len_q=128" in titles[0] and "tile 32" in titles[0]
    assert "sample inputs" in titles[0] and "doc" in titles[0]


def test_too_long_is_refused(tmp_path):
    with pytest.raises(AttnccError, match=r"--len 5000 is too large to draw; use at most 4096"):
        plot.plot_variant(attncc.parse(CAUSAL), tmp_path / "x.png", len_q=5000, len_k=5000, tile=64)
    with pytest.raises(AttnccError, match=r"--len-k 8192 is too large"):
        plot.plot_variant(attncc.parse(CAUSAL), tmp_path / "x.png", len_q=64, len_k=8192, tile=64)
    assert not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------- the CLI
def test_cli_show_plot(tmp_path, capsys):
    spec = tmp_path / "causal.attn"
    spec.write_text(CAUSAL + "\n")
    out = tmp_path / "out.png"
    assert main(["show", str(spec), "--plot", str(out), "--len", "256"]) == 0
    printed = capsys.readouterr().out
    assert "attention causal" in printed
    assert f"wrote {out}: allowed 32896 of 65536" in printed
    png_size(out)


def test_cli_show_plot_too_long(tmp_path, capsys):
    spec = tmp_path / "causal.attn"
    spec.write_text(CAUSAL + "\n")
    assert main(["show", str(spec), "--plot", str(tmp_path / "o.png"), "--len", "5000"]) == 2
    assert "too large to draw" in capsys.readouterr().err


def test_too_many_tiles_is_refused(tmp_path):
    with pytest.raises(AttnccError, match=r"--tile 1 makes 16777216 tiles .* use a larger --tile"):
        plot.plot_variant(attncc.parse(CAUSAL), tmp_path / "x.png", len_q=4096, len_k=4096, tile=1)
