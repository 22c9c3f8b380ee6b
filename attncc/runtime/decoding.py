"""KV-cache decoding: `kernel.decode(...)`, its call checks, its tuned split count and
tiles (`decode_reference`, the dense reference of a decode call, is
attncc/semantics/decoding.py's).

A decode call computes the last n_q rows of each batch row's self-attention over the
L = cache_seqlens[b] + n_new tokens its cache holds (after appending k_new, v_new):
query token i sits at position L - n_q + i, keys at 0 .. L - 1, and the variant's
`len_q` and `len_k` are both L. So `q >= k` and the bottom-right spelling
`q + len_k - len_q >= k` are both causal, and a decode call gives what
kernel(q_full, k, v) gives for those rows. The kernels are the split-KV kernels of
backends/portable/templates/decode.py.jinja, in the variant's generated module, and on
an sm_90 GPU, for MLA's shapes (576-wide keys with v = k[..., :512], or 64-wide keys
beside a 512-wide v), the Gluon MLA decode of backends/gluon/templates/decode_mla.jinja
(which backend runs a call: decode_backends; the tuner times both).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .. import backends, ir
from ..backends.gluon import decode as gluon_decode
from . import dispatch, precompile, tuning
from ..arguments import (Problem, check_cache_length, check_cache_seqlens, check_input_names,
                         check_inputs, check_return_lse)
from .call_options import CallRecord, call_record, option
from ..errors import CallError
from ..analysis.ranges import MAX_EXTENT

CONFIG_KEYS = ("BLOCK_N", "num_warps", "num_stages", "num_splits")
MAX_SPLITS = 256
MIN_TILES_PER_SPLIT = 4  # fewer, and a program's fixed costs (q, bounds, partial) dominate
SHARED_MEMORY = 227 * 1024  # per SM on Hopper (H100, H200)
TUNE_AT_MOST = 6  # decode candidates are cheap to time (no backward, short calls)
INTERPRETER_SPLITS = 3  # under the interpreter: enough splits to exercise the merge
# A program's fp32 P·V accumulator (BLOCK_M x v's tile width) over this many elements
# needs more than 128 registers a thread at 4 warps: MLA's 64 x 512 needs 256, which
# ptxas spills (2.8 KB a thread on sm_90, every key tile). Such problems run at 8 warps,
# where Triton gives each warpgroup half the value columns (FlashMLA's split).
WIDE_ACCUMULATOR = 128 * 128
# Their tiles (BLOCK_N, num_warps, num_stages), most likely winner first: BLOCK_N 64 gives
# q·k wgmma instructions twice as wide as BLOCK_N 32's (n32, not n16), which reread the
# q tile from shared memory half as often; each compiles for sm_90 at 255 registers with
# at most ~350 B of spills (benchmarks/portable_compile.py --mla).
WIDE_SHAPES = [(64, 8, 2), (32, 8, 3), (32, 8, 2), (16, 8, 3)]

# Keywords of the training call that mean nothing here, each with what to do instead.
_NOT_DECODE_ARGUMENTS = {
    "q_offset": "decode places the new tokens at the end of each row's cache: query token i "
                "of row b sits at position cache_seqlens[b] + n_new - n_q + i",
    "k_offset": "the cache holds a row's keys from position 0",
    "dropout_seed": "decoding runs without dropout (as training=False)",
    "training": "decoding runs without dropout (as training=False)",
    "tables": "decoding classifies tiles itself and keeps no tile tables",
    "k": "pass the cache as k_cache, and the new keys (if any) as k_new",
    "v": "pass the cache as v_cache, and the new values (if any) as v_new",
}


@dataclass(frozen=True)
class DecodeProblem:
    """The sizes of one decode call: what the grid, the checks and the tuning key use."""
    batch: int
    heads_q: int
    heads_kv: int
    n_q: int
    n_new: int
    dim: int
    capacity: int  # positions a row's cache can hold
    page_size: int  # 0: a contiguous cache
    dim_v: int | None = None  # v's head dim; None: as wide as q's and k's
    v_is_k: bool = False  # v a view of k's first columns: its tiles are the K tiles' (MLA)

    @property
    def pads(self) -> tuple:
        """The kernels' tile widths of a K row (its power-of-two segments, as the generated
        module's _head_dim_split: 576 = 512 + 64) and of a V row (a power of two)."""
        pow2 = lambda d: max(16, 1 << (d - 1).bit_length())
        first = max(16, 1 << (self.dim.bit_length() - 1))
        k_width = first + (pow2(self.dim - first) if self.dim > first else 0)
        return k_width, pow2(self.dim if self.dim_v is None else self.dim_v)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def rows_block(self) -> int:
        """BLOCK_M: the group's heads x new tokens, as the module's decode_rows_block."""
        return min(64, max(16, 1 << (self.group * self.n_q - 1).bit_length()))

    @property
    def row_tiles(self) -> int:
        return -(-self.group * self.n_q // self.rows_block)

    @property
    def wide_accumulator(self) -> bool:
        """Whether the P·V accumulator needs 8 warps (WIDE_ACCUMULATOR)."""
        return self.rows_block * self.pads[1] > WIDE_ACCUMULATOR


def decode_problem(q, k_cache, v_cache, k_new, block_table, v_is_k: bool = False) -> DecodeProblem:
    """The sizes of a decode call whose shapes check_decode_call has checked; v_is_k as the
    generated module's v_is_k(k_cache, v_cache) says (it reads data pointers: real tensors)."""
    B, Hq, n_q, D = q.shape
    n_new = 0 if k_new is None else k_new.shape[2]
    if block_table is not None:  # (num_pages, page_size, kv heads, dim)
        page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
        return DecodeProblem(B, Hq, Hkv, n_q, n_new, D, block_table.shape[1] * page_size, page_size,
                             v_cache.shape[3], v_is_k)
    return DecodeProblem(B, Hq, k_cache.shape[1], n_q, n_new, D, k_cache.shape[2], 0, v_cache.shape[3],
                         v_is_k)


def _shape(t) -> str:
    inner = ", ".join(str(s) for s in t.shape)
    return f"({inner},)" if len(t.shape) == 1 else f"({inner})"  # Python's spelling


def _check_tensor(name: str, t, layout: str, q=None):
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor laid out {layout}, got {type(t).__name__}")
    if t.dim() != 4:
        raise CallError(f"{name} must have 4 dimensions {layout}, got shape {_shape(t)}")
    if q is not None:
        if t.dtype != q.dtype:
            raise CallError(f"{name} has dtype {t.dtype} but q has {q.dtype}; the cache, the new "
                            "keys and values and q must have one dtype")
        if t.device != q.device:
            raise CallError(f"{name} is on {t.device} but q is on {q.device}")


def check_decode_call(kernel, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                      inputs) -> tuple:
    """(DecodeProblem, cache_seqlens as a (B,) int32 tensor); raises CallError naming what is
    wrong. Never reads a tensor's values (no host synchronisation)."""
    from .settings import (MAX_HEAD_DIM_DECODE, MAX_HEAD_DIM_V, MIN_HEAD_DIM, SUPPORTED_DTYPES,
                           check_interpretable_dtype, check_kernel_device)
    _check_tensor("q", q, "(batch, heads, new tokens, dim)")
    check_kernel_device(q)
    if q.dtype not in SUPPORTED_DTYPES:
        raise CallError(f"q has dtype {q.dtype}; decoding takes float16, bfloat16 or float32")
    check_interpretable_dtype(q)
    B, Hq, n_q, D = q.shape
    if B == 0 or Hq == 0:
        raise CallError(f"q has shape {_shape(q)}: batch and heads must be at least 1")
    if not (MIN_HEAD_DIM <= D <= MAX_HEAD_DIM_DECODE):
        raise CallError(f"head dim {D} is not supported: decoding takes head dims "
                        f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM_DECODE} (q has shape {_shape(q)})")
    paged = block_table is not None
    layout = ("(num_pages, page_size, kv_heads, dim) with a block_table" if paged
              else "(batch, kv_heads, capacity, dim)")
    _check_tensor("k_cache", k_cache, layout, q)
    _check_tensor("v_cache", v_cache, layout, q)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise CallError(f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} must have "
                        "the same shape but for the head dim")
    Dv = v_cache.shape[3]
    if not (MIN_HEAD_DIM <= Dv <= MAX_HEAD_DIM_V):
        raise CallError(f"v's head dim {Dv} is not supported: the kernels take v head dims "
                        f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM_V} (v_cache has shape {_shape(v_cache)})")
    if k_cache.shape[3] != D:
        raise CallError(f"the cache's head dim is {k_cache.shape[3]} (k_cache {_shape(k_cache)}) "
                        f"but q's is {D}")
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise CallError("block_table must be a (batch, max_pages) int32 tensor of page "
                            f"indices, got {_shape(block_table) if isinstance(block_table, torch.Tensor) else type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise CallError(f"block_table has dtype {block_table.dtype}; it must be int32 "
                            "(convert it with .int())")
        if block_table.shape[0] != B:
            raise CallError(f"block_table has {block_table.shape[0]} rows but q has batch {B}; "
                            "it needs one row of page indices per batch row")
        if block_table.device != q.device:
            raise CallError(f"block_table is on {block_table.device} but q is on {q.device}")
        num_pages, page_size, Hkv = k_cache.shape[:3]
        if page_size < 1 or num_pages < 1:
            raise CallError(f"the paged cache {_shape(k_cache)} holds no positions")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != B:
            raise CallError(f"k_cache has batch {k_cache.shape[0]} but q has {B}. A contiguous "
                            "cache is (batch, kv_heads, capacity, dim); a paged one "
                            "(num_pages, page_size, kv_heads, dim) needs block_table=")
        Hkv, capacity = k_cache.shape[1], k_cache.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise CallError(f"q has {Hq} heads, which is not a multiple of the cache's {Hkv} kv heads "
                        f"(k_cache {_shape(k_cache)}, laid out {layout})")
    heads = kernel.variant.heads
    if heads is not None and (Hq, Hkv) != (heads.q, heads.kv):
        raise CallError(f"the variant declares heads {heads.q} / {heads.kv}, but q has {Hq} heads "
                        f"and the cache {Hkv}")
    if (k_new is None) != (v_new is None):
        raise CallError("pass both k_new and v_new (the new tokens' keys and values) or neither")
    n_new = 0
    if k_new is not None:
        for name, t, width in (("k_new", k_new, D), ("v_new", v_new, Dv)):
            _check_tensor(name, t, "(batch, kv_heads, new tokens, dim)", q)
            if tuple(t.shape[:2]) != (B, Hkv) or t.shape[3] != width:
                raise CallError(f"{name} has shape {_shape(t)}, expected ({B}, {Hkv}, n_new, {width}): "
                                "laid out (batch, kv_heads, new tokens, dim) like q, as wide as "
                                f"{name[0]}_cache")
        if k_new.shape[:3] != v_new.shape[:3]:
            raise CallError(f"k_new {_shape(k_new)} and v_new {_shape(v_new)} must have the same "
                            "shape but for the head dim")
        n_new = k_new.shape[2]
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(stride == 0 and size > 1 for size, stride in zip(cache.shape, cache.stride())):
                raise CallError(f"{name} {_shape(cache)} has strides {tuple(cache.stride())}: an "
                                "expanded tensor, whose positions share memory, so appending "
                                "k_new/v_new would write one key over another; pass a cache "
                                "of its own memory (.contiguous())")
    if capacity + n_new > MAX_EXTENT:
        raise CallError(f"the cache holds {capacity} positions and k_new {n_new} more; "
                        f"positions must stay below 2**31 (capacity + n_new at most "
                        f"{MAX_EXTENT}), as the range analysis of the variant's integers "
                        "assumes (attncc/analysis/ranges.py)")
    if n_new > capacity:
        raise CallError(f"k_new holds {n_new} new tokens but the cache only {capacity} "
                        "positions: they cannot be appended; use a larger cache")
    seqlens = _seqlens(cache_seqlens, B, q.device, capacity, n_new)
    problem = decode_problem(q, k_cache, v_cache, k_new, block_table)
    # Input axes on positions (q, k) and tiles (qb, kb) span the cache's capacity: every
    # position a call may place a key or a query at.
    p = Problem(B, Hq, Hkv, capacity, capacity, D, Dv)
    check_input_names(kernel.variant, inputs)
    check_inputs(kernel.variant, p, inputs, device=q.device)
    # Index lists are not checked (that reads them: a host synchronisation per step, as
    # a decode step's lists are new each time); an entry outside [0, tiles) matches no block.
    return problem, seqlens


def _seqlens(cache_seqlens, batch: int, device, capacity: int, n_new: int) -> torch.Tensor:
    """cache_seqlens as a (batch,) int32 tensor. An int is checked here (no sync): it must
    fit the cache with the new tokens. A tensor's values are not read (that is a host
    synchronisation per step): the kernels clamp each length to [0, capacity] and drop the
    new tokens past the capacity, and decode_reference does the same."""
    cache_seqlens = check_cache_seqlens(cache_seqlens, batch)
    if isinstance(cache_seqlens, int):
        check_cache_length(cache_seqlens, capacity, n_new)
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if cache_seqlens.dtype != torch.int32:
        raise CallError(f"cache_seqlens has dtype {cache_seqlens.dtype}; it must be int32 "
                        "(convert it with .int())")
    if cache_seqlens.device != device:
        raise CallError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
    # The kernels read length b at b: a strided view (a column of a table, an expanded
    # scalar) is copied, B int32s, rather than read at the wrong places.
    return cache_seqlens.contiguous()


# ---------------------------------------------------------------------------- configs
def check_decode_config(config: dict, where: str) -> dict:
    """A pinned config: exactly CONFIG_KEYS, each a positive int."""
    if not isinstance(config, dict) or set(config) != set(CONFIG_KEYS):
        raise ValueError(f"{where} must be a dict with exactly the keys {sorted(CONFIG_KEYS)}, "
                         f"got {config!r}")
    for key in CONFIG_KEYS:
        if not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1:
            raise ValueError(f"{where}: {key} must be a positive int, got {config[key]!r}")
    n = config["BLOCK_N"]
    if n < 16 or n & (n - 1):
        raise ValueError(f"{where}: BLOCK_N must be a power of two >= 16, got {n!r}")
    if config["num_splits"] > MAX_SPLITS:
        raise ValueError(f"{where}: num_splits must be at most {MAX_SPLITS}, got {config['num_splits']}")
    return dict(config)


def check_tuned_config(config: dict, where: str) -> dict:
    """A config the tuner stored: a pinned one's keys, and "backend": "gluon" for the
    Gluon MLA decode's (a portable config has no "backend")."""
    if isinstance(config, dict) and config.get("backend") == gluon_decode.BACKEND:
        plain = check_decode_config({k: v for k, v in config.items() if k != "backend"}, where)
        return dict(plain, backend=gluon_decode.BACKEND)
    return check_decode_config(config, where)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_per_sm(p: DecodeProblem, block_n: int, stages: int, elem: int) -> int:
    """How many decode programs an SM holds at once, from their shared memory (the
    pipeline keeps stages - 1 K and V tiles in flight, as Triton 3.x allocates them on
    Hopper) and at most 4 (registers: about 110 per thread at D = 128). A wide
    accumulator's program (8 warps at 255 registers) fills an SM's register file alone."""
    if p.wide_accumulator:
        return 1
    pad, pad_v = p.pads
    smem = max(1, stages - 1) * block_n * (pad + pad_v) * elem + p.rows_block * pad * elem
    return max(1, min(4, SHARED_MEMORY // smem))


def default_splits(p: DecodeProblem, block_n: int, stages: int, elem: int, n_sm: int,
                   reach_tiles: int) -> int:
    """Splits that fill one wave of the GPU: as many programs as its SMs hold at once
    (equal work per program, so a second, partial wave would leave SMs idle), with at
    least MIN_TILES_PER_SPLIT of the row's reachable key tiles each (counted at the cache's
    capacity: actual lengths live on the device, and each row divides its own tiles)."""
    per_split = p.batch * p.heads_kv * p.row_tiles
    wave = n_sm * programs_per_sm(p, block_n, stages, elem)
    return max(1, min(wave // per_split, reach_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def _fits(p: DecodeProblem, block_n: int, stages: int, elem: int) -> bool:
    pad, pad_v = p.pads
    return max(1, stages - 1) * block_n * (pad + pad_v) * elem <= SHARED_MEMORY - 16 * 1024


def _wide_fits(p: DecodeProblem, block_n: int, stages: int, elem: int) -> bool:
    """Whether a wide accumulator's program fits shared memory: `stages` K tiles (and V
    tiles, unless they are the K tiles) and the q tile, as Triton 3.6 allocates them for
    sm_90 (MLA: 221184 B at BLOCK_N 64, two stages; 184320 B at 32, three), with 4 KB
    to spare for the reductions' scratch."""
    pad, pad_v = p.pads
    row = pad + (0 if p.v_is_k else pad_v)
    smem = stages * block_n * row * elem + p.rows_block * pad * elem
    return smem <= SHARED_MEMORY - 4 * 1024


def candidates(variant: ir.Variant, p: DecodeProblem, elem: int, n_sm: int, reach_tiles,
               num_splits: int | None = None) -> list:
    """Decode configs, most likely winner first; `reach_tiles(block_n)` counts a full row's
    reachable key tiles. With a layout, key tiles stay within its block, so that a tile's
    layout is one value per row. The favourite tile is also tried with one program per
    SM (at 1 x 128K the fastest: RESULTS.md run 99), and with half and twice its splits.
    A wide accumulator (MLA) takes WIDE_SHAPES, at 8 warps."""
    wide = p.wide_accumulator
    shapes = WIDE_SHAPES if wide else [(64, 4, 3), (64, 4, 4), (128, 4, 2), (32, 4, 4), (128, 8, 3), (16, 4, 2)]
    fits = _wide_fits if wide else _fits
    out = []
    for bn, w, s in shapes:
        if variant.block is not None and bn > variant.block:
            continue
        if not fits(p, bn, s, elem):
            continue
        base = num_splits or default_splits(p, bn, s, elem, n_sm, reach_tiles(bn))
        splits = [base]
        if not out and num_splits is None:
            one_per_sm = max(1, min(n_sm // (p.batch * p.heads_kv * p.row_tiles), base))
            splits += [one_per_sm, max(1, base // 2), min(MAX_SPLITS, base * 2)]
        for sp in splits:
            c = dict(BLOCK_N=bn, num_warps=w, num_stages=s, num_splits=sp)
            if c not in out:
                out.append(c)
    if not out:  # nothing fits the estimate: the smallest tile, one stage
        out.append(dict(BLOCK_N=16, num_warps=8 if wide else 4, num_stages=1,
                        num_splits=num_splits or default_splits(p, 16, 1, elem, n_sm,
                                                                reach_tiles(16))))
    return out


def label(config: dict) -> str:
    """A decode config as progress lines write it: BLOCK_N 64 w4 s2 8 splits (with
    "Gluon " before it for the Gluon MLA decode's)."""
    return (("Gluon " if config.get("backend") == gluon_decode.BACKEND else "")
            + f"BLOCK_N {config['BLOCK_N']} w{config['num_warps']} s{config['num_stages']} "
            f"{config['num_splits']} splits")


def tuning_key(p: DecodeProblem, dtype, num_splits: int | None, gluon: str = "") -> str:
    """Configs are tuned per head dim, dtype, GQA group, new tokens, batch x kv heads (power-
    of-two bucket), cache capacity bucket and cache layout, and which backends' candidates
    were timed (`gluon`: "", "only" or "both")."""
    cache = f"page{p.page_size}" if p.page_size else "contiguous"
    bh = 1 << (p.batch * p.heads_kv - 1).bit_length()  # the split count follows it closely
    dims = (f"d{p.dim}" + (f"v{p.dim_v}" if p.dim_v not in (None, p.dim) else "")
            + ("-vk" if p.v_is_k else ""))  # v read from the K tiles: another kernel
    key = (f"decode-{dims}-{str(dtype).replace('torch.', '')}-g{p.group}-nq{p.n_q}"
           f"-bh{bh}-cap{tuning.length_bucket(p.capacity)}-{cache}")
    key += {"": "", "only": "-gluon", "both": "-gluon-portable"}[gluon]
    return key + (f"-splits{num_splits}" if num_splits else "")


def check_pins(num_splits, config) -> dict | None:
    """The call's pinned config (checked), or None; num_splits checked."""
    if config is not None:
        config = check_decode_config(config, "config")
        if num_splits is not None and num_splits != config["num_splits"]:
            raise CallError(f"num_splits={num_splits} differs from config's num_splits="
                            f"{config['num_splits']}; give one of them")
        return config
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
            raise CallError(f"num_splits must be an int from 1 to {MAX_SPLITS}, got {num_splits!r}")
    return None


def decode_backends(kernel, p: DecodeProblem, dtype, k_cache, v_cache, pinned: dict | None) -> tuple:
    """(gluon, reason): whether the Gluon MLA decode may run this call, "only" (asked for
    by name), "both" (auto: the tuner times its configs beside the portable decode's) or
    "" (not), and why the backend that runs it does where that is decided here (None:
    the tuner decides). backend="gluon" on a call the Gluon MLA decode refuses raises
    BackendError naming why; under auto the portable decode runs it."""
    if gluon_decode.BACKEND not in [b.name for b in kernel.backends]:
        return "", kernel.backend_reason  # portable asked for, or no sm_90 GPU here
    backend = backends.named(gluon_decode.BACKEND)
    forced = kernel.requested_backend == backend.name
    why = (gluon_decode.variant_refusal(kernel.variant)
           or gluon_decode.call_refusal(p, dtype, k_cache, v_cache, p.v_is_k))
    if why is None and pinned is not None:
        why = (gluon_decode.config_refusal(pinned) if forced else
               "a pinned config (config=) is the portable decode's under backend='auto'; pass "
               f"backend='{backend.name}' to pin the Gluon one")
    if why is not None:
        if forced:
            dispatch.refuse(backend, f"the Gluon MLA decode cannot take this call: {why}")
        return "", f"the portable decode runs it, as the Gluon MLA decode cannot: {why}"
    if forced:
        return "only", f"backend='{backend.name}' was asked for (the Gluon MLA decode)"
    return "both", None


def decode_config(kernel, p: DecodeProblem, dtype, run, *, num_splits=None, config=None,
                  gluon: str = "") -> dict:
    """The config of this call: pinned, or under the interpreter a fixed one, or tuned on
    the GPU (timing up to TUNE_AT_MOST candidates on the call's own inputs) and cached on
    disk beside the variant's other configs. `gluon` (decode_backends): whether the
    Gluon MLA decode's configs join the candidates ("both"), or are the only ones."""
    from .settings import interpreting
    config = check_pins(num_splits, config)
    if config is not None:
        return dict(config, backend=gluon_decode.BACKEND) if gluon == "only" else config
    if interpreting():
        splits = num_splits or max(1, min(INTERPRETER_SPLITS, -(-p.capacity // 16)))
        return dict(BLOCK_N=16, num_warps=4, num_stages=1, num_splits=splits)
    key = tuning_key(p, dtype, num_splits, gluon)
    untuned = tuning.tune_mode() == "0"
    mem_key = (kernel.key, key + ("-untuned" if untuned else ""))
    if mem_key in tuning._MEMORY:  # every call after the first: nothing else to do
        return tuning._MEMORY[mem_key]
    n_sm = _sm_count(torch.cuda.current_device())
    elem = torch.finfo(dtype).bits // 8
    reach = lambda bn: kernel.module.decode_reach_tiles(p.capacity, p.n_q, bn)
    kept = candidates(kernel.variant, p, elem, n_sm, reach, num_splits)
    if gluon:
        # At MLA's latent shape the Gluon decode first: it computes S once per tile where
        # Triton's layout of the portable kernel computes it on both warpgroups (~1.5x
        # the tensor work of a problem at the H200's ridge), so it is predicted the
        # faster at every n_q (the arithmetic: docs/design.md, section 8). At (64, 512)
        # the duplicated S is a ninth of the work and the problem memory-bound at n_q 1:
        # no prediction, so the portable configs first and the tuner decides.
        ours = gluon_decode.candidates(p, n_sm, num_splits)
        theirs = kept[:TUNE_AT_MOST - len(ours)]
        kept = ours if gluon == "only" else ours + theirs if p.v_is_k else theirs + ours
    if untuned:
        tuning._MEMORY[mem_key] = kept[0]
        return kept[0]
    path = tuning._cache_file(kernel.variant, "-decode")
    cached = tuning._load(path, check_tuned_config).get(key)
    if cached is None:
        cached = tuning.tune(kernel.variant.name, key, kept[:TUNE_AT_MOST], run, label=label)
        tuning._store(path, {key: cached}, check_tuned_config)
    tuning._MEMORY[mem_key] = cached
    return cached


# ---------------------------------------------------------------------------- the call
@call_record
class DecodeOptions(CallRecord):
    """The options of one kernel.decode call, as its op takes them (attncc/runtime/ops.py)."""
    num_splits: int = option("int", 0)  # 0: tuned
    config: tuple = option("int[]", ())  # CONFIG_KEYS' values in order; empty: tuned
    rows_before_start: bool = option("bool", False)  # attncc.flash's (the module's decode)

    @classmethod
    def of(cls, num_splits: int | None, pinned: dict | None,
           rows_before_start: bool) -> "DecodeOptions":
        """The record of a checked call: num_splits and the pinned config, or None."""
        return cls(num_splits or 0, tuple(pinned[key] for key in CONFIG_KEYS) if pinned else (),
                   rows_before_start)

    def run_arguments(self) -> dict:
        """The keyword arguments of run_decode."""
        return dict(num_splits=self.num_splits or None,
                    config=dict(zip(CONFIG_KEYS, self.config)) if self.config else None,
                    rows_before_start=self.rows_before_start)


class _NoBackward(torch.autograd.Function):
    """The output of a decode call some of whose tensors ask for gradients: decoding
    builds no graph of its own, so a backward reaching it raises instead of leaving their
    .grad silently empty."""

    @staticmethod
    def forward(ctx, out, *asking):
        return out.clone()  # a decode step's output: (B, H, n_q, D), small

    @staticmethod
    def backward(ctx, *grads):
        raise CallError("a backward reached the output of kernel.decode (or of "
                        "flash_attn_with_kvcache, which decodes), which is inference only and "
                        "has no gradients: call kernel(q, k, v, ...) (flash_attn_func) where "
                        "gradients are wanted, or decode under torch.no_grad()")


def _without_backward(result, return_lse: bool, tensors: list):
    """`result` (out, or (out, lse)) whose out raises on backward, where grad mode is on
    and one of `tensors` requires grad; else `result` as it is."""
    asking = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not (asking and torch.is_grad_enabled()):
        return result
    if return_lse:
        return _NoBackward.apply(result[0], *asking), _NoBackward.apply(result[1], *asking)
    return _NoBackward.apply(result, *asking)


def decode(kernel, q, k_cache, v_cache, /, *, cache_seqlens=None, k_new=None, v_new=None,
           block_table=None, return_lse: bool = False, num_splits: int | None = None,
           config: dict | None = None, rows_before_start: bool = False, **inputs):
    """See Kernel.decode: _decode_call's result, whose output raises on backward where a
    tensor of the call asks for gradients."""
    result = _decode_call(kernel, q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new,
                          v_new=v_new, block_table=block_table, return_lse=return_lse,
                          num_splits=num_splits, config=config,
                          rows_before_start=rows_before_start, **inputs)
    return _without_backward(result, return_lse is True,
                             [q, k_cache, v_cache, k_new, v_new, *inputs.values()])


def _decode_call(kernel, q, k_cache, v_cache, /, *, cache_seqlens=None, k_new=None, v_new=None,
                 block_table=None, return_lse: bool = False, num_splits: int | None = None,
                 config: dict | None = None, rows_before_start: bool = False, **inputs):
    """See Kernel.decode. An eager call like an earlier one (plan_key) runs that call's
    launch plan at once. Otherwise the call is checked here (what torch.compile traces:
    shapes, dtypes, devices and ints, no tensor values); an eager one then makes its plan
    and runs it, a traced one runs the variant's decode op (attncc/runtime/ops.py), which
    calls run_decode. rows_before_start is attncc.flash's: see the generated module's
    decode."""
    key = None
    if type(return_lse) is bool and _eager():
        key = plan_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits,
                       config, rows_before_start, inputs)
        plan = kernel._decode_plans.get(key)
        if plan is not None:
            check_return_lse(kernel.variant, return_lse)  # the key does not hold return_lse
            out, lse = plan(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, inputs)
            _appended(k_cache, v_cache, k_new)
            return (out, lse) if return_lse else out
    for name in _NOT_DECODE_ARGUMENTS:  # no input has these names (attncc/calls.py)
        if name in inputs:
            raise CallError(f"decode takes no {name}=: {_NOT_DECODE_ARGUMENTS[name]}")
    if not isinstance(return_lse, bool):
        raise CallError(f"return_lse must be True or False, got {return_lse!r}")
    check_return_lse(kernel.variant, return_lse)
    _, seqlens = check_decode_call(kernel, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                   block_table, inputs)
    pinned = check_pins(num_splits, config)
    if key is not None and q.shape[2]:
        plan = make_plan(kernel, q, k_cache, v_cache, seqlens, k_new, v_new, block_table, inputs,
                         num_splits=num_splits, config=pinned, rows_before_start=rows_before_start)
        keep_plan(kernel, key, plan)
        out, lse = plan(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, inputs)
        _appended(k_cache, v_cache, k_new)
        return (out, lse) if return_lse else out
    options = DecodeOptions.of(num_splits, pinned, rows_before_start)
    values = [inputs[d.name] for d in kernel.variant.inputs]
    out, lse = kernel._decode_op(kernel._op_id, q, k_cache, v_cache, seqlens, k_new, v_new,
                                 block_table, values, *options.op_arguments())
    if not torch.compiler.is_compiling():  # traced, functionalization keeps the write
        _appended(k_cache, v_cache, k_new)
    return (out, lse) if return_lse else out


def _appended(k_cache, v_cache, k_new) -> None:
    """After an append, bump the caches' version counters, as an in-place torch op would:
    the kernels write them behind autograd's back, and a graph that saved the cache
    earlier must raise on backward rather than read the new keys."""
    if k_new is not None:
        torch.autograd.graph.increment_version((k_cache, v_cache))


def run_decode(kernel, q, k_cache, v_cache, seqlens, k_new, v_new, block_table, values: dict, *,
               num_splits=None, config=None, rows_before_start=False):
    """The decode op's implementation: the append, the config (pinned, fixed under the
    interpreter, or tuned) and the launches, on a call `decode` has checked."""
    B, Hq, n_q, D = q.shape
    if n_q == 0:
        _check_latent_append(k_cache, v_cache, k_new, v_new)
        with torch.no_grad():
            if k_new is not None and k_new.shape[2]:  # no query: only the append
                kernel.module.decode_append_kv(k_new, v_new, k_cache, v_cache, seqlens, block_table)
        out = q.new_zeros((B, Hq, 0, v_cache.shape[3]))
        lse = torch.zeros((B, Hq, 0), device=q.device, dtype=torch.float32)
        return out, lse
    # The op runs on real tensors (a compiled graph's step): plans serve it too.
    key = plan_key(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, num_splits, config,
                   rows_before_start, values)
    plan = kernel._decode_plans.get(key) if key is not None else None
    if plan is None:
        plan = make_plan(kernel, q, k_cache, v_cache, seqlens, k_new, v_new, block_table, values,
                         num_splits=num_splits, config=config, rows_before_start=rows_before_start)
        if key is not None:
            keep_plan(kernel, key, plan)
    return plan(q, k_cache, v_cache, seqlens, k_new, v_new, block_table, values)


# ---------------------------------------------------------------------------- launch plans
# An eager decode step repeats the previous step's call but for the tensors' values
# (and, in a generation loop, a cache length one longer, which lives on the device).
# Its checks, config, grids, strides and argument lists are those of the first call of
# its kind, so they are worked out once into a plan (the generated module's
# decode_plan) and a later call with the same plan_key only allocates its outputs and
# launches, each kernel relaunched without Triton's per-call binding
# (attncc/runtime/launch.py). The key holds everything the checks, the config and the
# kernels' specialization read: each tensor's type, shape, strides, dtype, device and
# 16-byte alignment, the inputs' names, the options, the current CUDA device,
# ATTNCC_TUNE and whether v shares k's storage. An int cache_seqlens is checked by the plan on each call (its value
# changes every step); a tensor's values are never read, as on the checked path.
MAX_PLANS = 64  # per kernel: a model decodes with a handful of shapes


def _eager() -> bool:
    """Whether a call may skip the decode op: not traced by torch.compile, no tensor or
    function mode active (FakeTensorMode, a flop counter), no profiler recording ops."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._autograd._profiler_enabled())


def _tensor_key(t) -> tuple:
    """A plain tensor's part of a plan key; TypeError for anything else (a subclass goes
    through the op, which dispatches to it)."""
    if type(t) is not torch.Tensor:
        raise TypeError
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _typed(value) -> tuple:
    return type(value), value  # True and 1 are equal keys, but not equal options


def plan_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits, config,
             rows_before_start, inputs) -> tuple | None:
    """What a decode call's plan depends on, hashable; None when the call holds something
    that is not a plain tensor where a tensor goes (the checked path names it)."""
    try:
        return (_tensor_key(q), _tensor_key(k_cache), _tensor_key(v_cache),
                int if type(cache_seqlens) is int else _tensor_key(cache_seqlens),
                None if k_new is None else _tensor_key(k_new),
                None if v_new is None else _tensor_key(v_new),
                None if block_table is None else _tensor_key(block_table),
                _typed(num_splits), _typed(rows_before_start),
                None if config is None else tuple([(k, _typed(v)) for k, v in config.items()]),
                tuple([(name, _tensor_key(t)) for name, t in inputs.items()]),
                torch.cuda.current_device() if q.is_cuda else None,
                os.environ.get("ATTNCC_TUNE"),
                # v a view of k's first columns (MLA's latent cache) is a plan of its own:
                # its kernels read the values from the K tile.
                v_cache.data_ptr() == k_cache.data_ptr(),
                k_new is not None and v_new is not None and v_new.data_ptr() == k_new.data_ptr())
    except (TypeError, AttributeError):
        return None


def keep_plan(kernel, key: tuple, plan) -> None:
    plans = kernel._decode_plans
    if len(plans) >= MAX_PLANS:
        del plans[next(iter(plans))]  # the oldest
    plans[key] = plan


class DecodePlan:
    """The launches of decode calls alike (plan_key): the generated module's plan, run on
    each call's tensors. An int cache_seqlens becomes the (batch,) tensor the kernels read,
    after the check the checked path makes. `problem` and `config` say what it launches,
    `backend` on which backend and `reason` why (benchmarks print them)."""
    __slots__ = ("run", "batch", "capacity", "n_new", "device", "problem", "config", "backend",
                 "reason")

    def __init__(self, run, p: DecodeProblem, device, config: dict, backend: str, reason: str):
        self.run = run
        self.batch, self.capacity, self.n_new, self.device = p.batch, p.capacity, p.n_new, device
        self.problem, self.config, self.backend, self.reason = p, config, backend, reason

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, inputs):
        if type(cache_seqlens) is int:
            check_cache_length(cache_seqlens, self.capacity, self.n_new)
            cache_seqlens = torch.full((self.batch,), cache_seqlens, dtype=torch.int32,
                                       device=self.device)
        elif not cache_seqlens.is_contiguous():
            # As the checked call does (_seqlens): the kernels read length b at b.
            cache_seqlens = cache_seqlens.contiguous()
        return self.run(q, k_cache, v_cache, cache_seqlens, inputs, k_new, v_new, block_table)


def make_plan(kernel, q, k_cache, v_cache, seqlens, k_new, v_new, block_table, values: dict, *,
              num_splits=None, config=None, rows_before_start=False) -> DecodePlan:
    """The plan of a checked call with n_q >= 1 (seqlens a tensor): its config (pinned,
    fixed under the interpreter, or tuned, which runs candidates on the call's tensors)
    and the module's plan for it, each kernel launched through launch.Launch."""
    from .launch import Launch
    precompile.wait_for_triton()
    module = kernel.module
    _check_latent_append(k_cache, v_cache, k_new, v_new)
    p = decode_problem(q, k_cache, v_cache, k_new, block_table, module.v_is_k(k_cache, v_cache))
    gluon, reason = decode_backends(kernel, p, q.dtype, k_cache, v_cache,
                                    check_pins(num_splits, config))

    def plan_of(cfg):
        if cfg.get("backend") == gluon_decode.BACKEND:
            return kernel.module_of(gluon_decode.BACKEND).decode_mla_plan(
                q, k_cache, v_cache, seqlens, block_table, portable=module, config=cfg,
                v_is_k=p.v_is_k, k_new=k_new, v_new=v_new, rows_before_start=rows_before_start,
                launcher=Launch)
        return module.decode_plan(q, k_cache, v_cache, seqlens, values, k_new=k_new, v_new=v_new,
                                  block_table=block_table, config=cfg,
                                  rows_before_start=rows_before_start, launcher=Launch)

    def run(cfg):  # a tuning candidate: its own plan, run once
        return plan_of(cfg)(q, k_cache, v_cache, seqlens, values, k_new, v_new, block_table)

    cfg = decode_config(kernel, p, q.dtype, run, num_splits=num_splits, config=config, gluon=gluon)
    backend = cfg.get("backend", backends.portable().name)
    if reason is None:  # both could run it: the tuner's candidates decided
        title = backends.named(backend).title
        reason = (f"ATTNCC_TUNE=0 runs the first candidate, the {title} decode's"
                  if tuning.tune_mode() == "0" else
                  f"the tuner measured the {title} decode faster for this shape")
    return DecodePlan(plan_of(cfg), p, q.device, cfg, backend, reason)


def _check_latent_append(k_cache, v_cache, k_new, v_new):
    """Where v_cache is a view of k_cache's first columns (MLA's one latent cache), v_new
    must be k_new's: a separate one would overwrite the keys. Checked inside the decode
    op, on real tensors (torch.compile cannot trace a comparison of data pointers)."""
    if k_new is None or v_cache.data_ptr() != k_cache.data_ptr():
        return
    if v_new.data_ptr() != k_new.data_ptr() or v_new.stride() != k_new.stride():
        raise CallError("v_cache is a view of k_cache's first columns (one latent cache, as in "
                        "MLA), so the new values are the new keys' first columns: pass "
                        f"v_new=k_new[..., :{v_cache.shape[-1]}] (flash_attn_with_kvcache: "
                        f"v=k[..., :{v_cache.shape[-1]}]); a separate one would overwrite the "
                        "keys")
