"""Pictures of a variant: its element mask and its EMPTY / PARTIAL / FULL tiles, as a PNG.

`attncc show spec.attn --plot mask.png` calls `plot_variant`. Everything is computed
densely from the reference (`index_env`, `layout_grid`, the same rules as
`allowed_pairs`), so the picture is what the kernels must compute, not what the block
analysis believes. Runtime inputs are replaced by seeded sample tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import ir
from ..arguments import Problem
from ..errors import AttnccError
from ..semantics.evaluate import evaluate
from .extras import require_plotting
from ..semantics.reference import index_env, layout_grid
from ..semantics.samples import sample_inputs

MAX_LEN = 4096  # the drawn mask is len_q * len_k booleans per head
MAX_HEADS_DRAWN = 4
PER_HEAD_DEFAULT_HEADS = 4  # heads sampled when a per-head variant declares none
CHUNK_ELEMENTS = 1 << 22  # pairs evaluated at once: bounds the int64 intermediates
MAX_TILES = 1 << 22  # tile counts are kept per head in int64

EMPTY, PARTIAL, FULL = 0, 1, 2
CLASS_NAMES = ("EMPTY", "PARTIAL", "FULL")
CLASS_COLOURS = ("#e8e8e8", "#f4a261", "#2a9d8f")  # grey: skipped; orange: masked; teal: no mask
ALLOWED_COLOUR = "#1d3557"
MASK_OVERLAY_RGB = (0.11, 0.21, 0.34)  # ALLOWED_COLOUR, drawn translucent over PARTIAL tiles
MAX_PIXELS = 1024  # the mask is averaged down to at most this many pixels a side


@dataclass(frozen=True)
class Density:
    """What one drawing measured, summed over the heads evaluated."""
    heads: int  # heads the counts cover (1 when the variant is the same on every head)
    allowed: int  # (q, k) pairs that attend
    pairs: int  # all (q, k) pairs
    tiles: tuple  # (empty, partial, full) tile counts

    @property
    def allowed_fraction(self) -> float:
        return self.allowed / self.pairs

    def tile_fraction(self, cls: int) -> float:
        return self.tiles[cls] / sum(self.tiles)


# ---------------------------------------------------------------------- what to draw
def is_per_head(variant: ir.Variant) -> bool:
    """Whether which pairs attend can differ between heads: the mask or layout uses h,
    or reads an input that has an h axis."""
    for e in (variant.mask, variant.layout):
        if e is None:
            continue
        if "h" in ir.free_vars(e):
            return True
        if any("h" in variant.input(t).axes for t in ir.loaded_tensors(e)):
            return True
    return False


# ------------------------------------------------------------------- dense counting
def allowed_rows(variant: ir.Variant, p: Problem, inputs: dict, heads: torch.Tensor,
                 rows: torch.Tensor, grid: torch.Tensor | None = None) -> torch.Tensor:
    """`allowed_pairs` restricted to some heads and query rows: bool [len(heads), len(rows), Lk].

    The same rules as `reference.allowed_pairs`, with `h` and `q` narrowed so that a
    many-head, long problem is evaluated a slice at a time. `grid` is the layout's
    `layout_grid`, when the caller has it already.
    """
    env = index_env(variant, p, inputs, "cpu", torch.float64)
    env["h"] = heads.view(1, -1, 1, 1)
    env["q"] = (rows + p.q_offset).view(1, 1, -1, 1)
    allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # broadcasts: no pair is ruled out yet
    if variant.mask is not None:
        allowed = allowed & evaluate(variant.mask, env)
    if variant.layout is not None:
        if grid is None:
            grid = layout_grid(variant, p, inputs, "cpu")  # [B|1, H|1, QB, KB]
        if grid.shape[1] > 1:
            grid = grid[:, heads]
        qb = (env["q"] // variant.block).view(-1)
        kb = (env["k"] // variant.block).view(-1)
        allowed = allowed & grid[:, :, qb][:, :, :, kb]
    return allowed.expand(1, len(heads), len(rows), p.len_k)[0]  # [Hs, rows, Lk]


def classify(counts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Tile classes from allowed-pair counts and real tile sizes (same shapes)."""
    return torch.where(counts == 0, EMPTY, torch.where(counts == sizes, FULL, PARTIAL))


def tile_sizes(len_q: int, len_k: int, tile: int) -> torch.Tensor:
    """Real positions in each tile: [QT, KT]; the ragged last row and column are smaller."""
    def extents(n):
        return torch.clamp(n - torch.arange(0, n, tile), max=tile)
    return extents(len_q).view(-1, 1) * extents(len_k).view(1, -1)


def measure(variant: ir.Variant, p: Problem, inputs: dict, tile: int, heads: list,
            keep: list) -> tuple:
    """Count allowed pairs per tile on `heads`, a chunk of rows at a time.

    Returns (counts [len(heads), QT, KT] int64, masks {head: bool [Lq, Lk] numpy} for
    the heads in `keep`).
    """
    qt, kt = math.ceil(p.len_q / tile), math.ceil(p.len_k / tile)
    heads_t = torch.tensor(heads)
    grid = layout_grid(variant, p, inputs, "cpu") if variant.layout is not None else None
    counts = torch.zeros(len(heads), qt, kt, dtype=torch.long)
    masks = {h: np.zeros((p.len_q, p.len_k), dtype=bool) for h in keep}
    step = max(1, CHUNK_ELEMENTS // (len(heads) * p.len_k))
    pad_k = kt * tile - p.len_k
    for r0 in range(0, p.len_q, step):
        rows = torch.arange(r0, min(r0 + step, p.len_q))
        allowed = allowed_rows(variant, p, inputs, heads_t, rows, grid)  # [Hs, R, Lk]
        for h in keep:
            masks[h][r0:r0 + len(rows)] = allowed[heads.index(h)].numpy()
        # Summed in float32 (exact: a sum is at most len_k <= MAX_LEN), far faster than bool.
        padded = torch.nn.functional.pad(allowed.to(torch.float32), (0, pad_k))  # [Hs, R, KT*tile]
        per_row = padded.view(len(heads), len(rows), kt, tile).sum(-1)  # [Hs, R, KT]
        counts.index_add_(1, rows // tile, per_row.to(torch.long))
    return counts, masks


# --------------------------------------------------------------------------- drawing
def plot_variant(variant: ir.Variant, path, *, len_q: int, len_k: int | None = None,
                 tile: int = 64) -> str:
    """Draw `variant`'s mask and its tile classes at `tile` into the PNG `path`.

    Returns a one-line summary: allowed pairs and EMPTY / PARTIAL / FULL tile counts.
    """
    require_plotting()
    len_k = len_q if len_k is None else len_k
    for flag, n in (("--len", len_q), ("--len-k", len_k)):
        if n > MAX_LEN:
            raise AttnccError(f"{flag} {n} is too large to draw; use at most {MAX_LEN}")
        if n < 1:
            raise AttnccError(f"{flag} must be at least 1, got {n}")
    if tile < 1:
        raise AttnccError(f"--tile must be at least 1, got {tile}")
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise AttnccError(f"cannot write {path}: the folder {folder} does not exist; create it "
                          "first")

    per_head = is_per_head(variant)
    heads_q = variant.heads.q if variant.heads else (PER_HEAD_DEFAULT_HEADS if per_head else 1)
    heads_kv = variant.heads.kv if variant.heads else heads_q
    p = Problem(batch=1, heads_q=heads_q, heads_kv=heads_kv, len_q=len_q, len_k=len_k,
                dim=64, dim_v=64)
    inputs = sample_inputs(variant, p)

    # A variant that is the same on every head is measured on head 0 alone.
    heads = list(range(heads_q)) if per_head else [0]
    tiles = math.ceil(len_q / tile) * math.ceil(len_k / tile) * len(heads)
    if tiles > MAX_TILES:
        raise AttnccError(f"--tile {tile} makes {tiles} tiles over {len(heads)} head(s), too many "
                          f"to count (at most {MAX_TILES}); use a larger --tile")
    drawn = sorted({round(i * heads_q / MAX_HEADS_DRAWN) for i in range(MAX_HEADS_DRAWN)}
                   if per_head and heads_q > MAX_HEADS_DRAWN else heads)
    counts, masks = measure(variant, p, inputs, tile, heads, drawn)
    sizes = tile_sizes(len_q, len_k, tile)
    classes = classify(counts, sizes.expand_as(counts))  # [Hs, QT, KT]
    density = Density(heads=len(heads), allowed=int(counts.sum()),
                      pairs=len(heads) * len_q * len_k,
                      tiles=tuple(int((classes == c).sum()) for c in (EMPTY, PARTIAL, FULL)))

    summary = summarize(density, tile, per_head)
    title = _title(variant, p, tile, density, per_head, drawn, inputs)
    _draw(path, p, tile, density, title=title, masks=masks,
          classes={h: classes[heads.index(h)].numpy() for h in drawn})
    return summary


def summarize(d: Density, tile: int, per_head: bool) -> str:
    where = f" over {d.heads} heads" if per_head else ""
    e, pa, f = d.tiles
    n = sum(d.tiles)
    return (f"allowed {d.allowed} of {d.pairs} (q,k) pairs{where} ({100 * d.allowed_fraction:.2f}%); "
            f"{tile}x{tile} tiles: {e} empty ({100 * e / n:.1f}%), {pa} partial ({100 * pa / n:.1f}%), "
            f"{f} full ({100 * f / n:.1f}%) of {n}")


def _title(variant, p: Problem, tile: int, d: Density, per_head: bool, drawn: list,
           inputs: dict) -> str:
    lengths = f"len_q={p.len_q}" + (f", len_k={p.len_k}" if p.len_k != p.len_q else "")
    line1 = f"{variant.name}   ({lengths}, tile {tile})"
    if per_head:
        line1 += f", heads {', '.join(map(str, drawn))} of {p.heads_q}"
    line2 = (f"{100 * d.allowed_fraction:.1f}% of (q,k) pairs attend   |   tiles: "
             f"{100 * d.tile_fraction(EMPTY):.1f}% EMPTY, {100 * d.tile_fraction(PARTIAL):.1f}% PARTIAL, "
             f"{100 * d.tile_fraction(FULL):.1f}% FULL")
    lines = [line1, line2]
    if inputs:
        lines.append(f"sample inputs (seeded random, not real data): {', '.join(inputs)}")
    return "\n".join(lines)


def _pool(mask: np.ndarray, f: int) -> np.ndarray:
    """The fraction of True in each f x f block of `mask` (edge blocks: of their real part)."""
    if f == 1:
        return mask.astype(np.float32)
    rows, cols = math.ceil(mask.shape[0] / f), math.ceil(mask.shape[1] / f)
    padded = np.zeros((rows * f, cols * f), dtype=np.float32)
    padded[:mask.shape[0], :mask.shape[1]] = mask
    real = np.zeros_like(padded)
    real[:mask.shape[0], :mask.shape[1]] = 1
    block_sum = lambda a: a.reshape(rows, f, cols, f).sum(axis=(1, 3))  # [rows, cols]
    return block_sum(padded) / block_sum(real)


def _draw(path, p: Problem, tile: int, d: Density, *, title: str,
          masks: dict, classes: dict):
    # A bare Figure on the Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    drawn = sorted(masks)
    # Panels keep the matrix's aspect ratio, within reason, with the long side 6 inches.
    ratio = min(max(p.len_q / p.len_k, 1 / 3), 3)
    pw, ph = (6.0, 6.0 * ratio) if ratio <= 1 else (6.0 / ratio, 6.0)
    if len(drawn) > 1:
        pw, ph = pw * 0.8, ph * 0.8
    fig = Figure(figsize=(2 * pw + 1.0, len(drawn) * ph + 2.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(drawn), 2, squeeze=False)
    mask_cmap = LinearSegmentedColormap.from_list("attends", ["white", ALLOWED_COLOUR])
    tile_cmap = ListedColormap(list(CLASS_COLOURS))
    qt, kt = math.ceil(p.len_q / tile), math.ceil(p.len_k / tile)
    tile_extent = (0, kt * tile, qt * tile, 0)  # the ragged edge is cut off by the limits

    # Matplotlib would resample a 4096^2 mask at full size in float RGBA; average it
    # down to at most MAX_PIXELS a side first (a panel is ~600 pixels wide anyway).
    f = math.ceil(max(p.len_q, p.len_k) / MAX_PIXELS)
    pooled_extent = (0, math.ceil(p.len_k / f) * f, math.ceil(p.len_q / f) * f, 0)
    # The tile each pooled pixel's first position falls in, to find PARTIAL ones.
    px_qt = np.arange(0, p.len_q, f) // tile
    px_kt = np.arange(0, p.len_k, f) // tile

    for row, h in enumerate(drawn):
        ax_m, ax_t = axes[row]
        frac = _pool(masks[h], f)  # [ceil(Lq/f), ceil(Lk/f)] fraction attending
        ax_m.imshow(frac, cmap=mask_cmap, vmin=0, vmax=1, extent=pooled_extent,
                    interpolation="antialiased", aspect="auto")
        ax_t.imshow(classes[h], cmap=tile_cmap, vmin=0, vmax=2, extent=tile_extent,
                    interpolation="nearest", aspect="auto")
        # The mask, faintly, over the PARTIAL tiles: shows where the boundary runs in them.
        partial = (classes[h] == PARTIAL)[px_qt][:, px_kt]
        overlay = np.zeros((*frac.shape, 4), dtype=np.float32)
        overlay[..., :3] = MASK_OVERLAY_RGB
        overlay[..., 3] = 0.45 * frac * partial
        ax_t.imshow(overlay, extent=pooled_extent, interpolation="antialiased", aspect="auto")
        head = f"head {h}: " if len(drawn) > 1 or d.heads > 1 else ""
        ax_m.set_title(f"{head}element mask (q, k)", fontsize=10)
        ax_t.set_title(f"{head}tiles at {tile}x{tile}", fontsize=10)
        for ax in (ax_m, ax_t):
            ax.set_xlim(0, p.len_k)
            ax.set_ylim(p.len_q, 0)  # query 0 at the top, like an attention matrix
            ax.set_xlabel("key position k")
            ax.set_ylabel("query position q")
            if max(qt, kt) <= 32:  # tile boundaries, while they stay readable
                ax.set_xticks(np.arange(0, p.len_k + 1, tile), minor=True)
                ax.set_yticks(np.arange(0, p.len_q + 1, tile), minor=True)
                ax.grid(which="minor", color="#9a9a9a", linewidth=0.4, alpha=0.6)
                ax.tick_params(which="minor", length=0)

    legend = [Patch(facecolor=ALLOWED_COLOUR, label="attends"),
              Patch(facecolor="white", edgecolor="#888888", label="masked out"),
              Patch(facecolor=CLASS_COLOURS[EMPTY], edgecolor="#888888", label="EMPTY tile (skipped)"),
              Patch(facecolor=CLASS_COLOURS[PARTIAL], label="PARTIAL tile (mask per element)"),
              Patch(facecolor=CLASS_COLOURS[FULL], label="FULL tile (no mask)")]
    fig.suptitle(title, fontsize=11)
    fig.legend(handles=legend, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.savefig(path, dpi=100, format="png")
