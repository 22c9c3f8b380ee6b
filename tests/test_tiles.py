"""Block skipping is never less conservative than the dense mask (docs/design.md, "Tiles and loop segments").

For each skipping level, over many variants, shapes and tile sizes, against the dense
truth of `reference.allowed_pairs`:

  1. no tile that holds an allowed pair is skipped, and
  2. a tile classified FULL is complete (every position is real) and all its pairs attend.

Level 1, analytic bounds (attncc/analysis/bounds.py): the segment code is evaluated for every
tile of the other side and turned into tile ranges by `segment_ranges`, a replica of the
template's macro of that name (itself checked against the rendered kernel source).
Level 2, interval classification (attncc/analysis/intervals.py): the emitted lines run on a grid of
all tiles at once, with per-block min/max summaries built here from the inputs.
Level 3, tile tables: the generated module's host `tile_tables`, row and column lists.

Pure PyTorch on the CPU: nothing here launches a kernel.
"""
import functools
import math
import re
import zlib

import pytest
import torch

import attncc
from attncc.analysis import bounds, intervals
from attncc.backends.portable import codegen
from attncc.codegen import plan_code
from attncc import ir
from attncc.arguments import TORCH_DTYPES, Problem, axis_extent
from attncc.semantics.reference import allowed_pairs
from attncc.runtime.cache import load_generated

BATCH, HEADS, HEAD_DIM = 2, 3, 64
LENGTHS = [(1, 1), (7, 7), (16, 16), (33, 33), (100, 100), (257, 257),
           (7, 100), (100, 7), (33, 257), (257, 33), (1, 100), (16, 1), (100, 257)]
OFFSETS = [(5, 0), (0, 9), (13, 40)]
# Every length pair without offsets, and a few with each nonzero offset pair.
SHAPES = ([(lq, lk, 0, 0) for lq, lk in LENGTHS]
          + [(lq, lk, oq, ok) for lq, lk in [(1, 1), (33, 33), (7, 100), (257, 33), (100, 257)]
             for oq, ok in OFFSETS])
TILES = [(16, 16), (32, 32), (64, 64), (16, 64), (64, 32)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are small: intra-op threads cost far more than they save (100x
    on a loaded 2-core machine), so this module runs single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ the variants
# name -> (mask and declarations, how to draw the inputs). Every mask is written as
# the body of `attention <name> { ... }`. "sorted": integer position inputs hold sorted
# segment ids (documents); "random": any small ids.
MASKS = {
    "full": ("", "sorted"),
    "true": ("mask true", "sorted"),
    "never_false": ("mask false", "sorted"),
    "never_contradiction": ("mask q < k and k < q", "sorted"),
    "never_negative_q": ("mask q < 0", "sorted"),
    "causal": ("mask q >= k", "sorted"),
    "causal_bottom_right": ("mask q + len_k - len_q >= k", "sorted"),
    "anti_causal_strict": ("mask q < k", "sorted"),
    "diagonal": ("mask q == k", "sorted"),
    "diagonal_shifted": ("mask q == k + 3", "sorted"),
    "window_left_lt": ("param w: int = 5\n mask q >= k and q - k < w", "sorted"),
    "window_left_wide": ("param w: int = 40\n mask q >= k and q - k < w", "sorted"),
    "window_right_le": ("param w: int = 6\n mask k >= q and k - q <= w", "sorted"),
    "window_two_sided_affine": ("param w: int = 9\n mask q - k <= w and k - q <= w", "sorted"),
    "window_two_sided_abs": ("param w: int = 9\n mask abs(q - k) <= w", "sorted"),
    "window_chained": ("mask 0 <= q - k < 20", "sorted"),
    "window_bottom_right": ("mask q + len_k - len_q >= k and q + len_k - len_q - k < 12", "sorted"),
    "prefix_lm": ("param prefix: int = 20\n mask q >= k or k < prefix", "sorted"),
    "prefix_lm_long": ("param prefix: int = 70\n mask q >= k or k < prefix", "sorted"),
    "sink_window": ("mask q >= k and (q - k < 8 or k < 4)", "sorted"),
    "chunked_8": ("mask q // 8 == k // 8", "sorted"),
    "chunked_20_causal": ("param chunk: int = 20\n mask q // chunk == k // chunk and q >= k", "sorted"),
    "dilated_window": ("param window: int = 30\n param dilation: int = 3\n"
                       " mask q >= k and q - k < window and (q - k) % dilation == 0", "sorted"),
    "dilated_only": ("mask (q - k) % 4 == 0", "sorted"),
    "global_window_abs": ("mask abs(q - k) <= 6 or q < 3 or k < 3", "sorted"),
    "global_window_affine": ("mask (q - k <= 6 and k - q <= 6) or q < 3 or k < 3", "sorted"),
    "global_causal_four_terms": ("mask (q >= k and q - k < 5) or q < 2 or k < 2 or k > 90", "sorted"),
    "not_causal": ("mask not (q >= k)", "sorted"),
    "not_window": ("mask not (q >= k and q - k < 7)", "sorted"),
    "not_not": ("mask not not (q >= k)", "sorted"),
    "not_equal": ("mask q != k", "sorted"),
    "not_equal_causal": ("mask q != k and q >= k", "sorted"),
    "only_q": ("mask q < 5", "sorted"),
    "only_q_late": ("mask q >= 40", "sorted"),
    "only_k": ("mask k >= 3", "sorted"),
    "only_k_band": ("mask k >= 3 and k < 50", "sorted"),
    "only_lengths": ("mask len_q < len_k", "sorted"),
    "k_from_end": ("mask k < len_k - 10", "sorted"),
    "strided_2q": ("mask 2 * q >= k", "sorted"),
    "strided_3k": ("mask q >= 3 * k", "sorted"),
    "strided_mixed": ("mask -2 * q + 3 * k <= 7 and 5 * k + 2 >= q", "sorted"),
    "per_head_window": ("mask q >= k and q - k < 8 * (h + 1)", "sorted"),
    "per_batch_shift": ("mask q + b * 9 >= k", "sorted"),
    "head_dim": ("mask q - k < dim and q >= k", "sorted"),
    "max_call": ("mask k <= max(q, 10)", "sorted"),
    "min_call": ("mask k >= min(q, 50) - 3", "sorted"),
    "where_mask": ("mask where(q < 10, k < 5, q >= k)", "sorted"),
    "bool_equality": ("mask (q >= k) == (k < 10)", "sorted"),
    "bool_inequality": ("mask (q >= k) != (k < 10)", "sorted"),
    "document": ("input doc_q: i32[q]\n input doc_k: i32[k]\n mask doc_q[q] == doc_k[k]", "sorted"),
    "document_causal": ("input doc_q: i32[q]\n input doc_k: i32[k]\n"
                        " mask doc_q[q] == doc_k[k] and q >= k", "sorted"),
    "document_unsorted": ("input doc_q: i32[q]\n input doc_k: i32[k]\n"
                          " mask doc_q[q] == doc_k[k] and q >= k", "random"),
    "document_not_equal": ("input doc_q: i32[q]\n input doc_k: i32[k]\n mask doc_q[q] != doc_k[k]", "sorted"),
    "document_ordered": ("input doc_q: i32[q]\n input doc_k: i32[k]\n mask doc_q[q] >= doc_k[k]", "random"),
    "document_per_batch": ("input doc_q: i32[b, q]\n input doc_k: i32[b, k]\n"
                           " mask doc_q[b, q] == doc_k[b, k] and q >= k", "sorted"),
    "document_one_tensor": ("input doc: i32[q]\n mask doc[q] == doc[k] and q >= k", "sorted"),
    "document_one_tensor_k": ("input doc: i32[k]\n mask doc[q] == doc[k]", "sorted"),
    "fixed_size_ids": ("input ids: i32[64]\n mask ids[q] == ids[k] or ids[k] > 50", "random"),
    "document_arith": ("input doc_q: i32[q]\n input doc_k: i32[k]\n"
                       " mask abs(doc_q[q] - 2 * doc_k[k]) <= 1 or doc_q[q] // 2 == doc_k[k] % 3", "random"),
    "key_padding": ("input keep: bool[k]\n mask keep[k] and q >= k", "random"),
    "key_padding_not": ("input drop: bool[k]\n mask not drop[k]", "random"),
    "per_head_input": ("input w: i32[h]\n mask q >= k and q - k < w[h]", "random"),
    "bool_param": ("param causal: bool = true\n mask q >= k or not causal", "sorted"),
    "int_param_product": ("param stride: int = 3\n mask q >= k * stride - 10", "sorted"),
    "negative_window": ("param w: int = -3\n mask q - k < w", "sorted"),
    "float_window": ("mask q - k < 2.5 and q >= k", "sorted"),
    "nonlinear": ("mask q * k < 300", "sorted"),
    "dnf_too_large": ("mask (q < 1 or k < 1) and (q < 20 or k < 2) and (q < 3 or k < 30)"
                      " and (q < 40 or k < 4) and (q < 5 or k < 50)", "sorted"),
}


def variant_of(name: str, body: str) -> ir.Variant:
    return attncc.parse(f"attention {name} {{\n {body}\n}}")


VARIANTS = {name: variant_of(name, body) for name, (body, _) in MASKS.items()}


def rng_for(*key) -> torch.Generator:
    """A fresh generator per case, seeded from its name: independent of test order."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def draw_inputs(variant: ir.Variant, p: Problem, style: str, gen: torch.Generator) -> dict:
    """Inputs of the right shapes: bool tensors true with probability 0.6; integer
    tensors along a position axis sorted document ids ("sorted": a new id with
    probability 1/12 at each position) or ids in [0, 4) ("random"); per-head integers
    (window sizes) in [0, 60)."""
    out = {}
    for decl in variant.inputs:
        shape = tuple(axis_extent(a, variant, p) for a in decl.axes)
        positions = [i for i, a in enumerate(decl.axes) if a in ("q", "k")]
        if decl.type == ir.BOOL:
            t = torch.rand(shape, generator=gen) < 0.6
        elif positions and style == "sorted":
            t = (torch.rand(shape, generator=gen) < 1 / 12).long().cumsum(positions[0])
        elif positions:
            t = torch.randint(0, 4, shape, generator=gen)
        else:
            t = torch.randint(0, 60, shape, generator=gen)
        out[decl.name] = t.to(TORCH_DTYPES[decl.dtype])
    return out


def problem(len_q, len_k, q_offset=0, k_offset=0) -> Problem:
    return Problem(BATCH, HEADS, HEADS, len_q, len_k, HEAD_DIM, HEAD_DIM, q_offset, k_offset)


def dense(variant, p, inputs) -> torch.Tensor:
    """The element mask: bool [B|1, H|1, Lq, Lk] (size 1 where it depends on neither)."""
    return allowed_pairs(variant, p, inputs, "cpu")


class TileTruth:
    """Dense per-tile counts of a [..., Lq, Lk] element mask, for any tile size, from one
    2-D prefix sum (summed-area table) of the mask."""

    def __init__(self, allowed: torch.Tensor):
        self.lq, self.lk = allowed.shape[-2:]
        self.sat = torch.zeros(*allowed.shape[:-2], self.lq + 1, self.lk + 1, dtype=torch.int32)
        self.sat[..., 1:, 1:] = allowed.to(torch.int32).cumsum(-1).cumsum(-2)

    def __call__(self, bm: int, bn: int):
        """(some pair attends, every real pair attends), each [..., MT, NT], and whether
        each query tile and each key tile is complete (no position past the length),
        [MT, 1] and [1, NT]."""
        q_edges = torch.clamp(torch.arange(0, self.lq + bm, bm), max=self.lq)
        k_edges = torch.clamp(torch.arange(0, self.lk + bn, bn), max=self.lk)
        c = self.sat.index_select(-2, q_edges).index_select(-1, k_edges)  # [..., MT+1, NT+1]
        count = c[..., 1:, 1:] - c[..., :-1, 1:] - c[..., 1:, :-1] + c[..., :-1, :-1]
        rows, cols = q_edges.diff(), k_edges.diff()
        some = count > 0
        every = count == rows[:, None] * cols[None, :]
        return some, every, (rows == bm)[:, None], (cols == bn)[None, :]


def where_false(flags: torch.Tensor, limit: int = 5) -> list:
    """Up to `limit` index tuples of the False entries of a bool tensor, for messages."""
    return [tuple(i) for i in (~flags).nonzero().tolist()[:limit]]


# ------------------------------------------------------------------ run-time helpers
def _t(x):
    return torch.as_tensor(x)


HELPERS = {
    "_fdiv": lambda a, b: torch.div(_t(a), b, rounding_mode="floor"),
    "_mod": lambda a, b: torch.remainder(_t(a), b),
    "_min": lambda a, b: torch.minimum(_t(a), _t(b)),
    "_max": lambda a, b: torch.maximum(_t(a), _t(b)),
    "_where": lambda c, a, b: torch.where(_t(c), _t(a), _t(b)),
    # The template's 64-bit bound arithmetic: torch computes in int64 already.
    "_int": lambda x, wide: _t(x),
    "_tile_index": lambda x: _t(x),
}


class _TritonShim:
    """The few `tl` functions the template's segment arithmetic uses, on torch tensors."""
    maximum = staticmethod(HELPERS["_max"])
    minimum = staticmethod(HELPERS["_min"])
    where = staticmethod(HELPERS["_where"])


def _eval(code, env, shape):
    return torch.broadcast_to(_t(eval(code, env)).long(), shape)


# ------------------------------------------------------------------ level 1: loop bounds
def sides(solve_for, p, bm, bn):
    """(other side's name, offset, length, block), then the solved side's."""
    q_side, k_side = ("q", p.q_offset, p.len_q, bm), ("k", p.k_offset, p.len_k, bn)
    return (q_side, k_side) if solve_for == "k" else (k_side, q_side)


def tile_env(side):
    """The other side's tiles as the kernel sees them: {name}_lo, {name}_hi, [T] each."""
    name, off, length, block = side
    t = torch.arange(-(-length // block))
    return {f"{name}_lo": t * block + off,
            f"{name}_hi": torch.clamp(t * block + block, max=length) - 1 + off}


def segment_ranges(plan: bounds.LoopPlan, solve_for: str, p: Problem, bm: int, bn: int):
    """The template's `segment_ranges` macro in Python, for every tile of the other side
    at once: a list of (start, end, full_start, full_end) per segment, each [T]."""
    other, (_, off, length, B) = sides(solve_for, p, bm, bn)
    env = {**HELPERS, **tile_env(other), "len_q": p.len_q, "len_k": p.len_k,
           "len_q64": p.len_q, "len_k64": p.len_k}
    n = env[f"{other[0]}_lo"].shape
    ev = lambda code, default: _eval(code if code else str(default), env, n)
    fdiv = HELPERS["_fdiv"]
    last = off + length - 1
    out = []
    for seg in map(plan_code.segment_code, plan.segments):
        lo_g = torch.clamp(ev(seg.reach_lo, off), min=off)
        hi_g = torch.clamp(ev(seg.reach_hi, last), max=last)
        start = fdiv(lo_g - off, B)
        end = torch.maximum(fdiv(hi_g - off, B) + 1, start)
        if seg.full_known:
            flo_g = torch.clamp(ev(seg.full_lo, off), min=off)
            fhi_g = torch.clamp(ev(seg.full_hi, last), max=last)
            full_start = torch.minimum(torch.maximum(-fdiv(off - flo_g, B), start), end)
            full_end = torch.minimum(torch.maximum(fdiv(fhi_g - off + 1, B), full_start), end)
        else:
            full_start = full_end = end
        # A tile of the other side that runs past its sequence has no full tiles: its
        # rows (or columns) past the end must be masked too.
        name, _, _, other_block = other
        complete = env[f"{name}_hi"] - env[f"{name}_lo"] == other_block - 1
        full_start = torch.where(complete, full_start, end)
        full_end = torch.where(complete, full_end, end)
        out.append([start, end, full_start, full_end])
    if len(out) == 2:
        # Order by start; the second begins where the first ends.
        swap = out[1][0] < out[0][0]
        first = [torch.where(swap, b, a) for a, b in zip(*out)]
        second = [torch.where(swap, a, b) for a, b in zip(*out)]
        start2 = torch.maximum(second[0], first[1])
        end2 = torch.maximum(second[1], start2)
        full_start2 = torch.minimum(torch.maximum(second[2], start2), end2)
        full_end2 = torch.minimum(torch.maximum(second[3], full_start2), end2)
        out = [first, [start2, end2, full_start2, full_end2]]
    return out


def template_ranges(source: str, solve_for: str, p: Problem, bm: int, bn: int):
    """The same, by running the rendered kernel's own segment lines on torch tensors."""
    kernel = "def attn_fwd(" if solve_for == "k" else "def _dkdv_program("
    body = source[source.index(kernel):]
    lines = body.splitlines()
    first = next(i for i, l in enumerate(lines) if l.strip().startswith("# segment 1:"))
    last = next(i for i, l in enumerate(lines) if i > first and "_tiles(" in l)
    code = "\n".join(l.strip() for l in lines[first:last])
    other, _ = sides(solve_for, p, bm, bn)
    env = {**HELPERS, **tile_env(other), "tl": _TritonShim, "len_q": p.len_q, "len_k": p.len_k,
           "len_q64": p.len_q, "len_k64": p.len_k,
           "q_offset": p.q_offset, "k_offset": p.k_offset, "BLOCK_M": bm, "BLOCK_N": bn}
    exec(code, env)
    n = len(re.findall(r"^# segment \d+:", code, flags=re.M))
    return [[torch.broadcast_to(_t(env[f"{name}{i}"]), env[f"{other[0]}_lo"].shape)
             for name in ("start", "end", "full_start", "full_end")] for i in range(1, n + 1)]


def ranges_to_tiles(ranges, n_tiles: int):
    """(visits [T, N] int: how many segments visit each tile, full [T, N] bool)."""
    j = torch.arange(n_tiles)
    visits = torch.zeros(ranges[0][0].shape[0] if ranges else 0, n_tiles, dtype=torch.long)
    full = torch.zeros_like(visits, dtype=torch.bool)
    for start, end, full_start, full_end in ranges:
        visits += ((start[:, None] <= j) & (j < end[:, None])).long()
        full |= (full_start[:, None] <= j) & (j < full_end[:, None])
    return visits, full


@functools.lru_cache(maxsize=None)
def plan_of(name: str, solve_for: str) -> bounds.LoopPlan:
    return bounds.plan_loops(VARIANTS[name], solve_for)


def check_plan_tiles(name, p, truth, bm, bn):
    """Soundness of both loop plans (forward and dQ: key tiles; dK/dV: query tiles)."""
    some, every, q_complete, k_complete = truth(bm, bn)  # [b, h, MT, NT]
    some, every = some.any(1).any(0), every.all(1).all(0)  # the bounds ignore b and h
    for solve_for in "kq":
        plan = plan_of(name, solve_for)
        ctx = f"{name} solve_for={solve_for} {p} tiles={bm}x{bn}"
        # A full tile runs without the mask, so its solved side must be complete; the
        # other side's padding rows are never stored, so they need not be.
        t_some, t_every, t_complete = (some, every, k_complete) if solve_for == "k" else (
            some.T, every.T, q_complete.T)
        if not plan.segments:
            assert not t_some.any(), f"{ctx}: no loop at all, but tiles {where_false(~t_some)} attend"
            continue
        ranges = segment_ranges(plan, solve_for, p, bm, bn)
        n = t_some.shape[1]
        for start, end, _, _ in ranges:
            inside = (start >= 0) & (end <= n) | (end <= start)
            assert inside.all(), f"{ctx}: a tile range leaves [0, {n})"
        visits, full = ranges_to_tiles(ranges, n)
        assert (visits <= 1).all(), f"{ctx}: tiles visited twice at {where_false(visits <= 1)}"
        missed = t_some & (visits == 0)
        assert not missed.any(), f"{ctx}: skipped tiles that attend at {where_false(~missed)}"
        wrong = full & ~(t_every & t_complete)
        assert not wrong.any(), f"{ctx}: FULL tiles that are not at {where_false(~wrong)}"


def check_plan_positions(name, p, some_bh, every_bh, block):
    """The per-position bounds: each row's allowed keys lie within the union of the
    segments' reach, and keys in a tile's full range attend from every row of it
    (`block` rows a tile; block 1 is a single row). The same with q and k swapped."""
    for solve_for in "kq":
        plan = plan_of(name, solve_for)
        some, every = (some_bh, every_bh) if solve_for == "k" else (some_bh.T, every_bh.T)
        (O, o_off, o_len, _), (P, off, length, _) = sides(solve_for, p, block, block)
        ctx = f"{name} solve_for={solve_for} {p} rows per tile {block}"
        pos = torch.arange(length) + off  # solved positions, [N]
        # Single rows: the reach.
        rows = torch.arange(o_len) + o_off
        env = {**HELPERS, f"{O}_lo": rows, f"{O}_hi": rows, "len_q": p.len_q, "len_k": p.len_k,
               "len_q64": p.len_q, "len_k64": p.len_k}
        inside = torch.zeros(o_len, length, dtype=torch.bool)
        for seg in map(plan_code.segment_code, plan.segments):
            lo = _eval(seg.reach_lo, env, rows.shape)[:, None] if seg.reach_lo else -math.inf
            hi = _eval(seg.reach_hi, env, rows.shape)[:, None] if seg.reach_hi else math.inf
            inside |= (lo <= pos) & (pos <= hi)
        outside = some & ~inside
        assert not outside.any(), f"{ctx}: allowed outside the reach at {where_false(~outside)}"
        # Whole tiles of the other side: the full range.
        env.update(tile_env((O, o_off, o_len, block)))
        tiles = env[f"{O}_lo"].shape
        tile_of_row = torch.arange(o_len) // block
        for seg in map(plan_code.segment_code, plan.segments):
            if not seg.full_known:
                continue
            lo = _eval(seg.full_lo, env, tiles)[:, None] if seg.full_lo else -math.inf
            hi = _eval(seg.full_hi, env, tiles)[:, None] if seg.full_hi else math.inf
            in_full = torch.broadcast_to((lo <= pos) & (pos <= hi), (*tiles, length))[tile_of_row]  # [rows, N]
            wrong = in_full & ~every
            assert not wrong.any(), f"{ctx}: full range holds pairs that do not attend at {where_false(~wrong)}"


def cases(name, level):
    """(problem, inputs, dense mask) for every shape, inputs drawn fresh per case.

    A shape at which the mask reads an input out of range (`doc: i32[q]` read at `k`
    with more keys than queries) is not a valid call, and the reference refuses it:
    such shapes are left out (at least one shape of every mask remains)."""
    variant, style = VARIANTS[name], MASKS[name][1]
    valid = 0
    for lq, lk, oq, ok in SHAPES:
        p = problem(lq, lk, oq, ok)
        inputs = draw_inputs(variant, p, style, rng_for(level, name, lq, lk, oq, ok))
        try:
            allowed = dense(variant, p, inputs)
        except attncc.CallError:
            continue
        valid += 1
        yield p, inputs, allowed
    assert valid >= 5, f"{name}: only {valid} shapes are valid calls"


@pytest.mark.parametrize("name", list(MASKS))
def test_loop_bounds(name):
    for p, _, allowed in cases(name, "bounds"):
        truth = TileTruth(allowed)
        for bm, bn in TILES:
            check_plan_tiles(name, p, truth, bm, bn)
        some_bh, every_bh = allowed.any(1).any(0), allowed.all(1).all(0)
        for block in (1, 16, 32):
            check_plan_positions(name, p, some_bh, every_bh, block)


# Truth tables: tile ranges by hand for 64 x 64 with 16 x 16 tiles (4 x 4 tiles).
# Rows are query tiles; "F" full, "P" partial (visited, mask evaluated), "." skipped.
TRUTH = {
    "causal": ["P...", "FP..", "FFP.", "FFFP"],
    "anti_causal_strict": ["PFFF", ".PFF", "..PF", "...P"],
    "window_left_wide": ["P...", "FP..", "PFP.", "PPFP"],  # 0 <= q - k < 40
    "only_q": ["PPPP", "....", "....", "...."],
    "only_k": ["PFFF", "PFFF", "PFFF", "PFFF"],
    "never_false": ["....", "....", "....", "...."],
    "full": ["FFFF", "FFFF", "FFFF", "FFFF"],
    # k < 20 reaches into key tile 1; tile (0, 0) is full but lies in the causal segment.
    "prefix_lm": ["PP..", "FP..", "FFP.", "FFFP"],
}


@pytest.mark.parametrize("name", list(TRUTH))
def test_loop_bounds_truth_table(name):
    p = problem(64, 64)
    ranges = segment_ranges(bounds.plan_loops(VARIANTS[name], "k"), "k", p, 16, 16)
    visits, full = ranges_to_tiles(ranges, 4) if ranges else (torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.bool))
    got = ["".join("F" if f else "P" if v else "." for v, f in zip(vr, fr)) for vr, fr in zip(visits, full)]
    assert got == TRUTH[name]


@pytest.mark.parametrize("spec,rows,cols", [
    ("mask q >= k", True, False),            # later query tiles reach more keys
    ("mask q <= k", False, True),            # later key tiles reach more queries
    ("mask q >= k and q - k < 64", False, False),  # a window: every row alike
    ("mask k < 8 or q >= k", True, False),   # sinks beside causal: still grows
    ("mask q >= k or k >= q + 64", False, False),  # one segment grows, one shrinks
    ("", False, False),
])
def test_heavy_tiles_last(spec, rows, cols):
    variant = attncc.parse(f"attention v {{ {spec} }}")
    assert codegen.heavy_tiles_last(bounds.plan_loops(variant, "k"), "q") == rows
    assert codegen.heavy_tiles_last(bounds.plan_loops(variant, "q"), "k") == cols


@pytest.mark.parametrize("name", ["causal", "causal_bottom_right", "window_left_wide", "prefix_lm",
                                  "sink_window", "only_k_band", "strided_mixed", "not_window"])
def test_replica_matches_rendered_template(name):
    """The replica above is the template's arithmetic: run the rendered kernel's own
    segment lines (with `tl` on torch) and compare, on every shape and tile size."""
    variant = VARIANTS[name]
    source = codegen.generate(variant).source
    for lq, lk, oq, ok in SHAPES[::3]:
        p = problem(lq, lk, oq, ok)
        for bm, bn in TILES:
            for solve_for in "kq":
                mine = segment_ranges(bounds.plan_loops(variant, solve_for), solve_for, p, bm, bn)
                theirs = template_ranges(source, solve_for, p, bm, bn)
                assert len(mine) == len(theirs)
                for a, b in zip(mine, theirs):
                    for x, y in zip(a, b):
                        assert torch.equal(x, y), (name, solve_for, p, bm, bn)


# ------------------------------------------------------------------ level 2: intervals
def summarize(t: torch.Tensor, axis: int, start: int, length: int, block: int):
    """Per-block (min, max) of `t` along `axis` over positions [start, start + length),
    block by block (the dense counterpart of the template's `_summarize`)."""
    t = t.to(torch.int64)
    lo, hi = [], []
    for s in range(start, start + length, block):
        at = torch.arange(s, min(s + block, start + length)).clamp(max=t.shape[axis] - 1)
        part = t.index_select(axis, at)  # past the end: the last entry, as kernels clamp
        lo.append(part.amin(axis))
        hi.append(part.amax(axis))
    return torch.stack(lo, axis), torch.stack(hi, axis)


def summaries_for(reads, p, inputs, bm, bn) -> dict:
    out = {}
    for r in reads:
        start, length, block = (p.q_offset, p.len_q, bm) if r.var == "q" else (p.k_offset, p.len_k, bn)
        out[codegen._summary_base(r)] = summarize(inputs[r.tensor], r.axis, start, length, block)
    return out


@functools.lru_cache(maxsize=None)
def interval_code(name: str):
    classes = intervals.classify(VARIANTS[name].mask, VARIANTS[name])
    code = plan_code.classification_code(classes, codegen.torch_summary, temp_prefix="_c")
    return classes.summaries, compile("\n".join(code.lines), f"<{name} intervals>", "exec"), \
        compile(f"({code.may}, {code.must})", f"<{name} may, must>", "eval")


def interval_tiles(name, p, inputs, bm, bn):
    """(may, must), each bool [B, H, MT, NT], from the emitted classification lines run
    on every tile at once (the layout of the template's `tile_tables`)."""
    summaries, lines, result = interval_code(name)
    mt, nt = -(-p.len_q // bm), -(-p.len_k // bn)
    tile_q = torch.arange(mt).view(1, 1, -1, 1)
    tile_k = torch.arange(nt).view(1, 1, 1, -1)
    env = {**HELPERS, "tile_q": tile_q, "tile_k": tile_k,
           "q_lo": tile_q * bm + p.q_offset,
           "q_hi": torch.clamp(tile_q * bm + bm, max=p.len_q) - 1 + p.q_offset,
           "k_lo": tile_k * bn + p.k_offset,
           "k_hi": torch.clamp(tile_k * bn + bn, max=p.len_k) - 1 + p.k_offset,
           "off_b": torch.arange(p.batch).view(-1, 1, 1, 1),
           "off_h": torch.arange(p.heads_q).view(1, -1, 1, 1),
           "len_q": p.len_q, "len_k": p.len_k, "HEAD_DIM": p.dim}
    for base, (lo, hi) in summaries_for(summaries, p, inputs, bm, bn).items():
        env[f"{base}_lo"], env[f"{base}_hi"] = lo, hi
    exec(lines, env)
    shape = (p.batch, p.heads_q, mt, nt)
    may, must = eval(result, env)
    return torch.broadcast_to(_t(may), shape).bool(), torch.broadcast_to(_t(must), shape).bool()


@pytest.mark.parametrize("name", list(MASKS))
def test_intervals(name):
    for p, inputs, allowed in cases(name, "intervals"):
        truth = TileTruth(allowed)
        for bm, bn in TILES:
            may, must = interval_tiles(name, p, inputs, bm, bn)
            some, every, _, _ = truth(bm, bn)
            ctx = f"{name} {p} tiles={bm}x{bn}"
            skipped = some & ~may
            assert not skipped.any(), f"{ctx}: may is False on tiles that attend at {where_false(~skipped)}"
            wrong = must & ~every
            assert not wrong.any(), f"{ctx}: must is True on tiles with pairs that do not attend at {where_false(~wrong)}"


@pytest.mark.parametrize("name", ["causal", "window_left_lt", "chunked_8", "document_causal", "key_padding"])
def test_intervals_decide_simple_tiles(name):
    """Not vacuous: on these masks the classification finds EMPTY and FULL tiles."""
    p = problem(257, 257)
    inputs = draw_inputs(VARIANTS[name], p, "sorted", rng_for("decide", name))
    if name == "key_padding":  # a padded tail: the last keys are dropped
        inputs["keep"] = torch.arange(257) < 200
    if name == "document_causal":  # documents of 64 tokens
        inputs["doc_q"] = inputs["doc_k"] = (torch.arange(257) // 64).int()
    may, must = interval_tiles(name, p, inputs, 16, 16)
    assert (~may).any() and must.any()


# ------------------------------------------------------------------ level 3: tile tables
LAYOUTS = {
    "banded_or_first_column": "layout abs(qb - kb) <= 1 or kb == 0",
    "per_head_band": "layout abs(qb - kb) <= h",
    "per_head_pattern": "layout (qb + kb + h) % 3 == 0 or qb == kb",
    "runtime_per_head": "input lay: bool[h, qb, kb]\n layout lay[h, qb, kb] or qb == kb",
    "runtime_per_batch": "input lay: bool[b, qb, kb]\n layout lay[b, qb, kb]",
    "banded_and_causal": "layout abs(qb - kb) <= 1 or kb == 0\n mask q >= k",
    "banded_and_bottom_right": "layout abs(qb - kb) <= 2\n mask q + len_k - len_q >= k",
    "runtime_and_window": "input lay: bool[h, qb, kb]\n layout lay[h, qb, kb] or qb == kb\n"
                          " mask q >= k and q - k < 40",
    "banded_and_document": "input doc_q: i32[q]\n input doc_k: i32[k]\n layout abs(qb - kb) <= 1\n"
                           " mask doc_q[q] == doc_k[k]",
}
LAYOUT_LENGTHS = [(1, 1), (7, 33), (16, 16), (33, 7), (100, 100), (257, 257), (100, 257)]
# Every variant whose kernels loop over tile tables (some atom is not affine).
TABLE_MASKS = [name for name in MASKS
               if plan_of(name, "k").needs_classify or plan_of(name, "q").needs_classify]


@pytest.fixture(scope="module")
def generated_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNCC_CACHE_DIR", str(tmp_path_factory.mktemp("attncc_cache")))
        yield


def listed(lists, counts, shape):
    """The tiles a padded list names, as bool [B, H, T, N]; checks the list's form."""
    B, H, T, N = shape
    lists, counts = lists.expand(B, H, T, lists.shape[-1]).long(), counts.expand(B, H, T).long()
    assert ((counts >= 0) & (counts <= N)).all(), "a count is out of range"
    valid = torch.arange(lists.shape[-1]) < counts[..., None]
    assert ((lists >= 0) & (lists < N) | ~valid).all(), "a listed tile is out of range"
    ascending = (lists[..., 1:] > lists[..., :-1]) | ~valid[..., 1:]
    assert ascending.all(), f"a list is not strictly ascending at {where_false(ascending)}"
    out = torch.zeros(B, H, T, N + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(valid, lists, N), valid)
    return out[..., :N]


def check_tables(ctx, tables, p, truth, bm, bn):
    """Row and column tables against the dense truth: every attending tile is listed,
    every tile listed full is complete and attends everywhere, and both agree."""
    some, every, q_complete, k_complete = truth(bm, bn)
    shape = (p.batch, p.heads_q, *some.shape[-2:])
    some, every = some.expand(shape), every.expand(shape)
    # The full bit serves both directions, so both sides must be complete.
    complete = (q_complete & k_complete).expand(shape)
    tiles = {}
    for side, t in (("row", lambda x: x), ("col", lambda x: x.transpose(2, 3))):
        for kind in ("full", "part"):
            lst, cnt = tables[f"{side}_{kind}_list"], tables[f"{side}_{kind}_count"]
            # The kernel reads both lists with the full list's strides.
            assert lst.shape == tables[f"{side}_full_list"].shape, ctx
            assert lst.stride() == tables[f"{side}_full_list"].stride(), ctx
            assert cnt.stride() == tables[f"{side}_full_count"].stride(), ctx
            tiles[side, kind] = t(listed(lst, cnt, t(some).shape))
        full, part = tiles[side, "full"], tiles[side, "part"]
        both = full & part
        assert not both.any(), f"{ctx} {side}: tiles listed full and partial at {where_false(~both)}"
        missed = some & ~(full | part)
        assert not missed.any(), f"{ctx} {side}: attending tiles not listed at {where_false(~missed)}"
        wrong = full & ~(every & complete)
        assert not wrong.any(), f"{ctx} {side}: tiles listed full that are not at {where_false(~wrong)}"
    # The backward visits what the forward does.
    assert torch.equal(tiles["row", "full"], tiles["col", "full"]), ctx
    assert torch.equal(tiles["row", "part"], tiles["col", "part"]), ctx


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tile_tables_of_layouts(name, block, generated_cache):
    variant = variant_of(name, f"{LAYOUTS[name]}\n block {block}")
    _, module = load_generated(variant)
    # Tiles larger than the block too: each then covers several blocks (the kernels
    # evaluate the layout per element in its partial tiles).
    tiles = TILES + [(32, 16), (128, 64)]
    for lq, lk in LAYOUT_LENGTHS:
        # Offsets are multiples of the block, as the kernels require for layouts.
        for oq, ok in [(0, 0), (block, 0), (0, 2 * block)]:
            p = problem(lq, lk, oq, ok)
            inputs = draw_inputs(variant, p, "sorted", rng_for("layouts", name, block, lq, lk, oq, ok))
            truth = TileTruth(dense(variant, p, inputs))
            for bm, bn in tiles:
                tables = module.tile_tables(p.batch, p.heads_q, lq, lk, oq, ok, p.dim, inputs,
                                             bm, bn, "cpu")
                check_tables(f"{name} block {block} {p} tiles={bm}x{bn}", tables, p, truth, bm, bn)


@pytest.mark.parametrize("name", TABLE_MASKS)
def test_tile_tables_of_masks(name, generated_cache):
    _, module = load_generated(VARIANTS[name])
    for p, inputs, allowed in cases(name, "tables"):
        truth = TileTruth(allowed)
        for bm, bn in TILES:
            tables = module.tile_tables(p.batch, p.heads_q, p.len_q, p.len_k, p.q_offset,
                                         p.k_offset, p.dim, inputs, bm, bn, "cpu")
            check_tables(f"{name} {p} tiles={bm}x{bn}", tables, p, truth, bm, bn)


def test_summaries_match_the_template(generated_cache):
    """The summaries used above equal the generated module's `_summarize` (padding by
    repeating the last element, bool as int, any axis, any offset)."""
    _, module = load_generated(VARIANTS["document"])
    gen = rng_for("summaries")
    for shape, axis in [((100,), 0), ((2, 100), 1), ((100, 3), 0)]:
        for dtype in (torch.int32, torch.bool):
            t = torch.randint(0, 5, shape, generator=gen).to(dtype)
            for start, length, block in [(0, 100, 16), (13, 87, 32), (40, 1, 64), (0, 64, 64),
                                         (0, 130, 32), (90, 40, 16), (120, 7, 16)]:  # past the end
                mine = summarize(t, axis, start, length, block)
                theirs = module._summarize(t, axis, start, length, block)
                for a, b in zip(mine, theirs):
                    assert torch.equal(a, b.to(a.dtype)), (shape, axis, dtype, start, length, block)
