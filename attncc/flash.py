"""flash-attn's functional API over attncc kernels: `flash_attn_func`, `flash_attn_varlen_func`,
their packed forms (`flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`,
`flash_attn_varlen_qkvpacked_func`, `flash_attn_varlen_kvpacked_func`), and
`flash_attn_with_kvcache` (over kernel.decode).

Each call's options (causal, window, softcap, ALiBi, dropout, scale, a learnable sink)
pick a variant,
written as text by `variant_text` (print it to see what runs), compiled once and kept
in a small LRU cache. Options are compile-time constants of the variant, so each
distinct window size, softcap, dropout probability or softmax scale compiles once.
Tensors keep flash-attn's (batch, seqlen, heads, headdim) layout: the kernels read
`q.transpose(1, 2)` through its strides, with no copy, and the output is written in
the same layout.

Semantics follow flash-attn's documentation (flash_attn/flash_attn_interface.py): with
seqlen_q != seqlen_k, causal masks and windows are aligned to the bottom-right corner,
query i attending keys j in [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q +
right] (-1 meaning unbounded); softcap is `softcap * tanh(s / softcap)` of the scaled
score s; ALiBi then adds `-slope * |i + seqlen_k - seqlen_q - j|`; a row that attends
to nothing gives output 0. `learnable_sink` (FA4's keyword: float32 (nheads,), one
logit per head that joins every row's softmax denominator and carries no value, as in
gpt-oss) is the variant's `sink`, and takes a gradient. A window side >= seqlen_k (max_seqlen_k for varlen) is
unbounded, as flash-attn's kernels take it.

Everything up to the kernel call is plain Python on the options, which torch.compile
traces: an option that arrives symbolic (an int or float argument of a function compiled
with dynamic=True) is specialised, since it selects the compiled variant; Dynamo guards
on its value and recompiles for another.
"""
from __future__ import annotations

import itertools
import math
import numbers
import operator
import struct
from collections import OrderedDict

import torch

from .errors import CallError
from .frontend.checker import FLOAT32_MAX
from .runtime.settings import MAX_HEAD_DIM, MAX_HEAD_DIM_DECODE, MAX_HEAD_DIM_V, MIN_HEAD_DIM

CACHE_SIZE = 64  # compiled combinations kept; a workload rarely uses more than a few
_KERNELS: OrderedDict = OrderedDict()  # options key -> the name of its kernel in _KEPT


class _Kept:
    """The kept kernels, one attribute each. torch.compile reads an attribute afresh
    when it traces it, where it would read a dict as it first saw it in the trace (and
    miss a kernel compiled later in the same trace)."""


_KEPT = _Kept()


def variant_text(*, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                 alibi: str | None = None, dropout_p: float = 0.0,
                 softmax_scale: float | None = None, sink: bool = False) -> str:
    """The attncc variant flash-attn's options describe. `alibi` is None, "h" for slopes
    of shape (nheads,) or "bh" for (batch, nheads); `sink`: a learnable sink per head."""
    left, right = window_size
    aligned = "q + len_k - len_q"  # query i's position on the key axis: bottom-right
    name, lines, mask = ["flash"], [], []
    if softmax_scale is not None:
        lines.append(f"scale {_number(softmax_scale)}")
    if alibi is not None:
        lines.append(f"input alibi_slopes: f32[{'b, h' if alibi == 'bh' else 'h'}]")
    if sink:
        lines.append("learnable input learnable_sink: f32[h]")
    if causal:
        name.append("causal")
        mask.append(f"k <= {aligned}")
    if left >= 0:
        mask.append(f"k >= {aligned} - {left}")
    if right >= 0 and not causal:  # causal already bounds the right side at 0
        mask.append(f"k <= {aligned} + {right}")
    if left >= 0 or (right >= 0 and not causal):
        name.append("window")
    if mask:
        lines.append("mask " + " and ".join(mask))
    score = "s"
    if softcap > 0:
        name.append("softcap")
        cap = _number(softcap)
        score = f"{cap} * tanh(s / {cap})"
    if alibi is not None:
        name.append("alibi")
        slope = "alibi_slopes[b, h]" if alibi == "bh" else "alibi_slopes[h]"
        score += f" - {slope} * abs({aligned} - k)"
    if score != "s":
        lines.append(f"score {score}")
    if dropout_p > 0:
        name.append("dropout")
        lines.append(f"dropout {_number(dropout_p)}")
    if sink:
        name.append("sink")
        lines.append("sink learnable_sink[h]")
    body = "".join(f"    {line}\n" for line in lines)
    return f"attention {'_'.join(name)} {{\n{body}}}\n"


def _number(x: float) -> str:
    """A float literal of the language that parses back to exactly `x`."""
    text = repr(float(x))
    return text if x >= 0 else f"({text})"


def _concrete(x):
    """x as a plain Python number: a symbolic one (under torch.compile) is specialised, so
    another value recompiles. Imported on first use: symbolic_shapes imports sympy, which
    `import attncc` and a warm start (a kernel found in the cache) must not pay for."""
    from torch.fx.experimental.symbolic_shapes import guard_scalar
    return guard_scalar(x)


def _real(name: str, x, requirement: str) -> float:
    """A flash-attn float option as a Python float; `requirement` says what is allowed."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, torch.SymInt, torch.SymFloat)):
        raise CallError(f"{name} must be {requirement}, got {x!r}")
    return _concrete(float(x))  # under torch.compile, a symbolic float is specialised


def _integer(name: str, x) -> int:
    """A flash-attn int option: a Python int, a numpy integer or a one-element integer
    tensor (flash-attn's C++ binding takes any of them); bools and floats are refused."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            raise CallError(f"{name} must be an integer, got a {x.dtype} tensor of shape "
                            f"{tuple(x.shape)}")
    elif isinstance(x, bool) or type(x).__name__ == "bool_":  # numpy's bool has no __index__
        raise CallError(f"{name} must be an integer, got {x!r}")
    try:
        value = operator.index(x)  # under torch.compile, a symbolic int is specialised here
    except TypeError:
        raise CallError(f"{name} must be an integer, got {x!r} "
                        f"({type(x).__name__}); -1 means unbounded") from None
    return _concrete(value)


def _window(window_size, seqlen_k) -> tuple:
    """flash-attn's window_size as (left, right), -1 for an unbounded side: negative
    values and sides reaching seqlen_k (or max_seqlen_k) mean unbounded, as flash-attn's
    kernels take them."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise CallError(f"window_size must be a pair of integers (left, right), -1 meaning "
                        f"unbounded, got {window_size!r}") from None
    sides = []
    for name, side in (("window_size[0]", left), ("window_size[1]", right)):
        side = _integer(name, side)
        sides.append(-1 if side < 0 or side >= seqlen_k else side)
    return tuple(sides)


def _check_float32(name: str, x: float, zero: str):
    """The kernels compute in float32: a value past its range would be inf, one below it 0,
    where the float64 reference keeps it."""
    if abs(x) > FLOAT32_MAX:
        raise CallError(f"{name}={x!r} is beyond float32's range (at most 3.4e38), which the "
                        "kernels compute in")
    if x != 0 and struct.unpack("f", struct.pack("f", x))[0] == 0:
        raise CallError(f"{name}={x!r} is below float32's range (at least 1.4e-45), which "
                        f"the kernels compute in, so they would read it as 0; pass {zero}")


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             deterministic, return_attn_probs, seqlen_k, learnable_sink=None) -> dict:
    """Check flash-attn's keyword arguments; the variant_text keywords they select.
    seqlen_k is the key length (max_seqlen_k for varlen) that bounds the window."""
    dropout_p = _real("dropout_p", dropout_p, "a probability in [0, 1)")
    if not 0 <= dropout_p < 1:
        raise CallError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None:
        softmax_scale = _real("softmax_scale", softmax_scale,
                              "None (1 / sqrt(headdim)) or a finite number")
        if not math.isfinite(softmax_scale):
            raise CallError(f"softmax_scale must be None (1 / sqrt(headdim)) or a finite "
                            f"number, got {softmax_scale!r}")
        _check_float32("softmax_scale", softmax_scale, "0.0")
    for name, flag in (("causal", causal), ("deterministic", deterministic),
                       ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise CallError(f"{name} must be True or False, got {flag!r}")
    if return_attn_probs and dropout_p > 0:
        raise CallError("return_attn_probs=True with dropout_p > 0: attncc does not return "
                        "flash-attn's attention probabilities (with the dropout pattern); call "
                        "with return_attn_probs=False, or with dropout_p=0.0 to get (out, "
                        "softmax_lse, None)")
    softcap = _real("softcap", softcap, "a finite number (0.0 turns it off)")
    if not math.isfinite(softcap):
        raise CallError(f"softcap must be a finite number (0.0 turns it off), got {softcap!r}")
    if softcap > 0:
        _check_float32("softcap", softcap, "0.0, which turns it off")
    alibi = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() not in (1, 2):
            shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else \
                type(alibi_slopes).__name__
            raise CallError(f"alibi_slopes must be a float32 tensor of shape (nheads,) or "
                            f"(batch, nheads), got {shape}")
        alibi = "bh" if alibi_slopes.dim() == 2 else "h"
    if learnable_sink is not None and (not isinstance(learnable_sink, torch.Tensor)
                                       or learnable_sink.dim() != 1
                                       or learnable_sink.dtype != torch.float32):
        what = (f"a {learnable_sink.dtype} tensor of shape {tuple(learnable_sink.shape)}"
                if isinstance(learnable_sink, torch.Tensor) else type(learnable_sink).__name__)
        raise CallError(f"learnable_sink must be a float32 tensor of shape (nheads,), one "
                        f"logit per query head, got {what}")
    return dict(causal=causal, window_size=_window(window_size, seqlen_k),
                softcap=max(softcap, 0.0), alibi=alibi, dropout_p=dropout_p,
                softmax_scale=softmax_scale, sink=learnable_sink is not None)


_OPTION_NAMES = ("causal", "window_size", "softcap", "alibi", "dropout_p", "softmax_scale",
                 "sink")


def kernel_for(*, packed: bool = False, **options):
    """The compiled kernel (with packed=True, the varlen kernel) that calls with these
    `variant_text` options run, compiled on first use and kept (CACHE_SIZE of them)."""
    options = dict(dict(causal=False, window_size=(-1, -1), softcap=0.0, alibi=None,
                        dropout_p=0.0, softmax_scale=None, sink=False), **options)
    options["window_size"] = tuple(int(w) for w in options["window_size"])
    for name in ("softcap", "dropout_p"):
        options[name] = float(options[name])
    if options["softmax_scale"] is not None:
        options["softmax_scale"] = float(options["softmax_scale"])
    # A tuple in a fixed order (not sorted items), which torch.compile traces.
    key = (packed, *(options[name] for name in _OPTION_NAMES))
    # Under torch.compile, Dynamo guards on this attribute (an evicted kernel retraces).
    return getattr(_KEPT, _keep_compiled(key))


@torch.compiler.assume_constant_result
def _keep_compiled(key: tuple) -> str:
    """The name in _KEPT of the kernel of `key`, compiled if it is not kept, and marked
    recently used. torch.compile runs this at trace time (the key is constants by then)
    instead of tracing the parsing and code generation behind it."""
    if key in _KERNELS:
        _KERNELS.move_to_end(key)
        return _KERNELS[key]
    from .runtime.kernel import compile as compile_spec
    from .runtime.packed import varlen
    packed, options = key[0], dict(zip(_OPTION_NAMES, key[1:]))
    text = variant_text(**options)
    name = f"kernel_{next(_NAMES)}"
    setattr(_KEPT, name, varlen(text) if packed else compile_spec(text))
    _KERNELS[key] = name
    if len(_KERNELS) > CACHE_SIZE:
        delattr(_KEPT, _KERNELS.popitem(last=False)[1])
    return name


_NAMES = itertools.count()


def _check_layout(name: str, t, dims: str, n: int):
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.dim() != n:
        raise CallError(f"{name} must have {n} dimensions {dims}, as flash-attn takes it, got "
                        f"shape {tuple(t.shape)}")


def _check_qkv(q, k, v, packed: bool):
    """flash-attn's shape rules, said in its terms (the kernels would say them for the
    (batch, heads, seq, dim) views they are handed)."""
    seq = "total" if packed else "seqlen"
    lead = "" if packed else "batch, "
    _check_layout("q", q, f"({lead}{seq}_q, nheads, headdim)", 3 if packed else 4)
    for name, t in (("k", k), ("v", v)):
        _check_layout(name, t, f"({lead}{seq}_k, nheads_k, headdim)", 3 if packed else 4)
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise CallError(f"q, k and v must have one floating-point dtype, got q {q.dtype}, "
                        f"k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise CallError(f"q, k and v must be on one device, got q on {q.device}, k on "
                        f"{k.device}, v on {v.device}")
    if k.shape[:-1] != v.shape[:-1]:  # v's headdim may differ from q's and k's, as FA3 allows
        raise CallError(f"k and v must have the same shape ({lead}{seq}_k, nheads_k) but for the "
                        f"headdim, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not packed and k.shape[0] != q.shape[0]:
        raise CallError(f"q and k must have the same batch size, got q {tuple(q.shape)} and "
                        f"k {tuple(k.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise CallError(f"q and k must have the same headdim, got q {tuple(q.shape)} and "
                        f"k {tuple(k.shape)}")
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k:
        raise CallError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k}) "
                        f"(q {tuple(q.shape)}, k {tuple(k.shape)}): each key/value head "
                        f"serves a whole group of query heads")
    _check_headdims(q, v, MAX_HEAD_DIM)


def _check_headdims(q, v, largest: int):
    """The kernels' head dims, named in flash-attn's shapes, not the kernels' views."""
    if not MIN_HEAD_DIM <= q.shape[-1] <= largest:
        raise CallError(f"headdim {q.shape[-1]} is not supported (q {tuple(q.shape)}): attncc "
                        f"takes headdims {MIN_HEAD_DIM} to {largest} here")
    if v is not None and not MIN_HEAD_DIM <= v.shape[-1] <= MAX_HEAD_DIM_V:
        raise CallError(f"v's headdim {v.shape[-1]} is not supported (v {tuple(v.shape)}): "
                        f"attncc takes v headdims {MIN_HEAD_DIM} to {MAX_HEAD_DIM_V}")


def _alibi_inputs(alibi_slopes, batch: int | None, nheads: int) -> dict:
    """The kernel inputs for flash-attn's alibi_slopes. flash-attn gives the slopes no
    gradient, so a tensor that requires one (an nn.Parameter) is read detached, as
    flash-attn reads it."""
    if alibi_slopes is None:
        return {}
    # Compared a dimension at a time: under torch.compile the sizes may be symbolic.
    shape = alibi_slopes.shape
    per_head = alibi_slopes.dim() == 1 and shape[0] == nheads
    per_batch = (batch is not None and alibi_slopes.dim() == 2 and shape[0] == batch
                 and shape[1] == nheads)
    if not (per_head or per_batch):
        raise CallError(f"alibi_slopes must have shape (nheads,) = ({nheads},)"
                        + ("" if batch is None else f" or (batch, nheads) = ({batch}, {nheads})")
                        + f", got {tuple(shape)}")
    return {"alibi_slopes": alibi_slopes.detach()}


def _sink_inputs(learnable_sink, nheads: int) -> dict:
    """The kernel input for FA4's learnable_sink (checked by _options): read as given, so
    that it takes a gradient (FA4's dsink)."""
    if learnable_sink is None:
        return {}
    if learnable_sink.shape[0] != nheads:
        raise CallError(f"learnable_sink must have shape (nheads,) = ({nheads},), one logit "
                        f"per query head, got {tuple(learnable_sink.shape)}")
    return {"learnable_sink": learnable_sink}


# ---------------------------------------------------------------------------- KV cache
def _check_kvcache(q, k_cache, v_cache, k, v, paged: bool):
    """flash_attn_with_kvcache's shape rules, said in flash-attn's terms (decoding would
    say them for the (batch, heads, seq, dim) views it is handed)."""
    _check_layout("q", q, "(batch, seqlen_q, nheads, headdim)", 4)
    cache_dims = ("(num_blocks, page_block_size, nheads_k, headdim)" if paged
                  else "(batch, seqlen_cache, nheads_k, headdim)")
    _check_layout("k_cache", k_cache, cache_dims, 4)
    _check_layout("v_cache", v_cache, cache_dims, 4)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise CallError(f"k_cache and v_cache must have the same shape {cache_dims} but for the "
                        f"headdim, got k_cache {tuple(k_cache.shape)} and v_cache "
                        f"{tuple(v_cache.shape)}")
    if not paged and k_cache.shape[0] != q.shape[0]:
        raise CallError(f"q and k_cache must have the same batch size, got q {tuple(q.shape)} and "
                        f"k_cache {tuple(k_cache.shape)}; a paged cache (num_blocks, "
                        "page_block_size, nheads_k, headdim) needs block_table=")
    if k_cache.shape[3] != q.shape[3]:
        raise CallError(f"q and k_cache must have the same headdim, got q {tuple(q.shape)} and "
                        f"k_cache {tuple(k_cache.shape)}")
    nheads, nheads_k = q.shape[2], k_cache.shape[2]
    if nheads_k == 0 or nheads % nheads_k:
        raise CallError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k}) "
                        f"(q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}): each key/value "
                        "head serves a whole group of query heads")
    _check_headdims(q, None, MAX_HEAD_DIM_DECODE)
    if q.shape[0] == 0:
        raise CallError(f"q has batch size 0 (q {tuple(q.shape)}): decoding takes at least one "
                        "row")
    if (k is None) != (v is None):
        raise CallError("pass both k and v (the new tokens' keys and values) or neither")
    if k is None:
        return
    for name, t in (("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dtype != q.dtype:
            raise CallError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, the caches and "
                            "the new k and v must have one dtype")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        _check_layout(name, t, "(batch, seqlen_new, nheads_k, headdim)", 4)
        want = (q.shape[0], t.shape[1], nheads_k, cache.shape[3])
        if tuple(t.shape) != want:
            raise CallError(f"{name} must have shape (batch, seqlen_new, nheads_k, headdim) = "
                            f"({want[0]}, seqlen_new, {want[2]}, {want[3]}), as q's batch and "
                            f"{name}_cache's heads and headdim, got {tuple(t.shape)}")
    if k.shape[1] != v.shape[1]:
        raise CallError(f"k and v must hold the same number of new tokens, got k "
                        f"{tuple(k.shape)} and v {tuple(v.shape)}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None):
    """flash-attn's `flash_attn_with_kvcache` on attncc's decoding (kernel.decode).

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch, seqlen_cache,
    nheads_k, headdim), or with block_table (batch, max_num_blocks) int32 a paged cache
    (num_blocks, page_block_size, nheads_k, headdim), any page size. cache_seqlens: an int
    or a (batch,) int32 tensor, the keys each row's cache holds (None: the whole cache,
    without k and v). k, v (batch, seqlen_new, nheads_k, headdim), optional: written into
    the caches in place at positions cache_seqlens[b] + j first. Row b then holds L =
    cache_seqlens[b] + seqlen_new keys and query i sits at position L - seqlen_q + i
    (causal masks and windows aligned to the bottom-right corner); a query before
    position 0 (L < seqlen_q) attends the keys its window or the absence of a mask
    gives it, as in flash-attn. num_splits: 0 tunes the split count, n from 1 to 256 pins it.
    Returns out (batch, seqlen_q, nheads, headdim), and with return_softmax_lse the
    natural LSE (batch, nheads, seqlen_q) in float32 (-inf for a row that attends to
    nothing, where flash-attn writes +inf). rotary_cos/rotary_sin, cache_batch_idx and
    cache_leftpad are refused. Lengths and block-table values are read as
    kernel.decode reads them (README, Decoding). `learnable_sink` (float32 (nheads,),
    keyword only, as FA4's functions take it) adds one logit per head to every row's
    softmax (gpt-oss's sinks)."""
    from .runtime.decoding import decode
    for name, value, fix in (
            ("rotary_cos", rotary_cos, "apply the rotary embedding to q and k before the call"),
            ("rotary_sin", rotary_sin, "apply the rotary embedding to q and k before the call"),
            ("cache_batch_idx", cache_batch_idx, "pass the cache rows in batch order, or a paged "
                                                 "cache whose block_table picks each row's pages"),
            ("cache_leftpad", cache_leftpad, "keep each row's keys from position 0 of its cache")):
        if value is not None:
            raise CallError(f"{name} is not supported by attncc's flash_attn_with_kvcache: {fix}")
    paged = block_table is not None
    _check_kvcache(q, k_cache, v_cache, k, v, paged)
    if not isinstance(return_softmax_lse, bool):
        raise CallError(f"return_softmax_lse must be True or False, got {return_softmax_lse!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise CallError(f"num_splits must be 0 (chosen by attncc) or a positive int, got "
                        f"{num_splits!r}")
    if paged:
        capacity = (block_table.shape[1] if isinstance(block_table, torch.Tensor)
                    and block_table.dim() == 2 else 0) * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    # flash-attn's rule: a window side reaching the whole cache is unbounded.
    options = _options(0.0, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       False, False, seqlen_k=capacity, learnable_sink=learnable_sink)
    if cache_seqlens is None:
        if k is not None:
            raise CallError("pass cache_seqlens with k and v: the new tokens are written at "
                            "positions cache_seqlens[b] + j of each row")
        cache_seqlens = capacity  # flash-attn: every row holds the whole cache
    kernel = kernel_for(packed=False, **options)
    inputs = _alibi_inputs(alibi_slopes, q.shape[0], q.shape[2])
    inputs.update(_sink_inputs(learnable_sink, q.shape[2]))
    # flash-attn's (batch, seqlen, heads, dim) read as (batch, heads, seqlen, dim) through
    # strides; a paged cache has the same layout in both.
    caches = (k_cache, v_cache) if paged else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    new = {} if k is None else dict(k_new=k.transpose(1, 2), v_new=v.transpose(1, 2))
    out, lse = decode(kernel, q.transpose(1, 2), *caches, cache_seqlens=cache_seqlens,
                      block_table=block_table, return_lse=True, num_splits=num_splits or None,
                      rows_before_start=True, **new, **inputs)
    out = out.transpose(1, 2).contiguous()  # flash-attn returns a dense (batch, seqlen, ...)
    return (out, lse) if return_softmax_lse else out


def _seed_for(kernel, dropout_seed):
    """The dropout_seed a flash-attn call passes on: none where dropout_p is 0, which in
    flash-attn's API is how training code turns dropout off for evaluation (the kernel
    itself refuses a seed for a variant with no dropout)."""
    return dropout_seed if kernel.variant.dropout else None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, dropout_seed: int | None = None,
                    learnable_sink=None):
    """flash-attn's `flash_attn_func` on attncc kernels.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA). Returns out (batch, seqlen_q, nheads,
    headdim), or with return_attn_probs (out, softmax_lse (batch, nheads, seqlen_q),
    None): the attention probabilities are not returned, and return_attn_probs with
    dropout is refused. The backward is always deterministic. alibi_slopes get no
    gradient, as in flash-attn. `dropout_seed` (attncc's, keyword only) fixes the
    dropout bits; without it a seed is drawn from torch's CPU generator.
    `learnable_sink` (FA4's, keyword only): float32 (nheads,), one logit per head in
    every row's softmax denominator; it takes a gradient, deterministic."""
    _check_qkv(q, k, v, packed=False)
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs, seqlen_k=k.shape[1],
                       learnable_sink=learnable_sink)
    kernel = kernel_for(packed=False, **options)
    inputs = _alibi_inputs(alibi_slopes, q.shape[0], q.shape[2])
    inputs.update(_sink_inputs(learnable_sink, q.shape[2]))
    # (batch, seqlen, heads, dim) read as (batch, heads, seqlen, dim) through strides.
    result = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    return_lse=return_attn_probs, dropout_seed=_seed_for(kernel, dropout_seed),
                    layout="bhsd",
                    **inputs)
    if return_attn_probs:
        out, lse = result
        return out.transpose(1, 2), lse, None
    return result.transpose(1, 2)


# ---------------------------------------------------------------- packed q/k/v forms
# flash-attn's qkvpacked and kvpacked functions: the same calls on views of the packed
# tensor (no copy), so gradients flow back into it.

def _unpack(name: str, t, dims: str, n: int, axis: int, count: int) -> tuple:
    """The `count` tensors stacked on `axis` of flash-attn's packed `t`, as views."""
    _check_layout(name, t, dims, n)
    if t.shape[axis] != count:
        raise CallError(f"{name} must have shape {dims}, with {count} on dimension {axis}, "
                        f"got {tuple(t.shape)}")
    return t.unbind(axis)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              dropout_seed: int | None = None):
    """flash-attn's `flash_attn_qkvpacked_func`: `flash_attn_func` on qkv (batch, seqlen,
    3, nheads, headdim), q, k and v stacked on dimension 2."""
    q, k, v = _unpack("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)", 5, 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           dropout_seed=dropout_seed)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             dropout_seed: int | None = None):
    """flash-attn's `flash_attn_kvpacked_func`: `flash_attn_func` on q (batch, seqlen_q,
    nheads, headdim) and kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, "(batch, seqlen_k, 2, nheads_k, headdim)", 5, 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           dropout_seed=dropout_seed)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *,
                                     dropout_seed: int | None = None, packing=None):
    """flash-attn's `flash_attn_varlen_qkvpacked_func`: `flash_attn_varlen_func` on qkv
    (total, 3, nheads, headdim), one packing (cu_seqlens, max_seqlen) for q and k
    (`packing`: attncc.varlen_packing(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen))."""
    q, k, v = _unpack("qkv", qkv, "(total, 3, nheads, headdim)", 4, 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  dropout_seed=dropout_seed, packing=packing)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *,
                                    dropout_seed: int | None = None, packing=None):
    """flash-attn's `flash_attn_varlen_kvpacked_func`: `flash_attn_varlen_func` on q
    (total_q, nheads, headdim) and kv (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack("kv", kv, "(total_k, 2, nheads_k, headdim)", 4, 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  dropout_seed=dropout_seed, packing=packing)


# ---------------------------------------------------------------- variable length
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *,
                           dropout_seed: int | None = None, packing=None, learnable_sink=None):
    """flash-attn's `flash_attn_varlen_func` on attncc kernels (attncc.varlen).

    q: (total_q, nheads, headdim), k, v: (total_k, nheads_k, headdim), packed by
    cu_seqlens_q/cu_seqlens_k (int32, (batch + 1,)). Causal masks, windows and ALiBi
    apply within each sequence, bottom-right aligned per sequence; a window side >=
    max_seqlen_k is unbounded. Returns out (total_q, nheads, headdim), or (out,
    softmax_lse (nheads, total_q), None). Dropout bits are drawn per (seed, head, packed
    query, packed key) position. Paged KV (`block_table`) is not supported. The
    cu_seqlens values are read on every call (one host read), unless `packing` (attncc's,
    keyword only: attncc.varlen_packing(...)) was built from them. `learnable_sink`
    (FA4's, keyword only): as flash_attn_func's."""
    if block_table is not None:
        raise CallError("block_table (paged KV cache) is not supported by attncc's "
                        "flash_attn_varlen_func; pass k and v packed as (total_k, nheads_k, "
                        "headdim)")
    _check_qkv(q, k, v, packed=True)
    # Read before the call checks them: the window compares against max_seqlen_k, and the
    # ALiBi slopes' batch is cu_seqlens_q's length.
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if (not isinstance(value, numbers.Integral) or isinstance(value, bool)) or value < 0:
            raise CallError(f"{name} must be a non-negative int, got {value!r}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1:
            raise CallError(f"{name} must be a 1-D int32 tensor (batch + 1,), got "
                            + (f"shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor)
                               else type(cu).__name__))
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs, seqlen_k=max_seqlen_k,
                       learnable_sink=learnable_sink)
    kernel = kernel_for(packed=True, **options)
    inputs = _alibi_inputs(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1])
    inputs.update(_sink_inputs(learnable_sink, q.shape[1]))
    result = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    return_lse=return_attn_probs, dropout_seed=_seed_for(kernel, dropout_seed),
                    packing=packing,
                    **inputs)
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result
