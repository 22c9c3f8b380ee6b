"""flash-attn's functional API over attncc kernels: `flash_attn_func`, `flash_attn_varlen_func`.

Each call's options (causal, window, softcap, ALiBi, dropout, scale) pick a variant,
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
to nothing gives output 0.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from .errors import CallError

CACHE_SIZE = 64  # compiled combinations kept; a workload rarely uses more than a few
_KERNELS: OrderedDict = OrderedDict()


def variant_text(*, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                 alibi: str | None = None, dropout_p: float = 0.0,
                 softmax_scale: float | None = None) -> str:
    """The attncc variant flash-attn's options describe. `alibi` is None, "h" for slopes
    of shape (nheads,) or "bh" for (batch, nheads)."""
    left, right = window_size
    aligned = "q + len_k - len_q"  # query i's position on the key axis: bottom-right
    name, lines, mask = ["flash"], [], []
    if softmax_scale is not None:
        lines.append(f"scale {_number(softmax_scale)}")
    if alibi is not None:
        lines.append(f"input alibi_slopes: f32[{'b, h' if alibi == 'bh' else 'h'}]")
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
    body = "".join(f"    {line}\n" for line in lines)
    return f"attention {'_'.join(name)} {{\n{body}}}\n"


def _number(x: float) -> str:
    """A float literal of the language that parses back to exactly `x`."""
    text = repr(float(x))
    return text if x >= 0 else f"({text})"


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             deterministic, return_attn_probs) -> dict:
    """Check flash-attn's keyword arguments; the variant_text keywords they select."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) \
            or not 0 <= dropout_p < 1:
        raise CallError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float))
                                      or isinstance(softmax_scale, bool)
                                      or not math.isfinite(softmax_scale)):
        raise CallError(f"softmax_scale must be None (1 / sqrt(headdim)) or a finite number, "
                        f"got {softmax_scale!r}")
    for name, flag in (("causal", causal), ("deterministic", deterministic),
                       ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise CallError(f"{name} must be True or False, got {flag!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise CallError(f"window_size must be a pair of ints (left, right), -1 meaning "
                        f"unbounded, got {window_size!r}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) \
            or not math.isfinite(softcap):
        raise CallError(f"softcap must be a finite number (0.0 turns it off), got {softcap!r}")
    alibi = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dim() not in (1, 2):
            shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else \
                type(alibi_slopes).__name__
            raise CallError(f"alibi_slopes must be a float32 tensor of shape (nheads,) or "
                            f"(batch, nheads), got {shape}")
        alibi = "bh" if alibi_slopes.dim() == 2 else "h"
    left, right = (w if w >= 0 else -1 for w in window_size)  # flash-attn: negative = unbounded
    return dict(causal=causal, window_size=(left, right), softcap=float(max(softcap, 0.0)),
                alibi=alibi, dropout_p=float(dropout_p),
                softmax_scale=None if softmax_scale is None else float(softmax_scale))


def kernel_for(*, packed: bool = False, **options):
    """The compiled kernel (with packed=True, the varlen kernel) that calls with these
    `variant_text` options run, compiled on first use and kept (CACHE_SIZE of them)."""
    options = dict(dict(causal=False, window_size=(-1, -1), softcap=0.0, alibi=None,
                        dropout_p=0.0, softmax_scale=None), **options)
    options["window_size"] = tuple(int(w) for w in options["window_size"])
    for name in ("softcap", "dropout_p"):
        options[name] = float(options[name])
    if options["softmax_scale"] is not None:
        options["softmax_scale"] = float(options["softmax_scale"])
    key = (packed, *sorted(options.items()))
    kernel = _KERNELS.get(key)
    if kernel is None:
        from .runtime.kernel import compile as compile_spec
        from .runtime.packed import varlen
        text = variant_text(**options)
        kernel = varlen(text) if packed else compile_spec(text)
        _KERNELS[key] = kernel
        if len(_KERNELS) > CACHE_SIZE:
            _KERNELS.popitem(last=False)
    else:
        _KERNELS.move_to_end(key)
    return kernel


def _check_layout(name: str, t, dims: str, n: int):
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.dim() != n:
        raise CallError(f"{name} must have {n} dimensions {dims}, as flash-attn takes it, got "
                        f"shape {tuple(t.shape)}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, dropout_seed: int | None = None):
    """flash-attn's `flash_attn_func` on attncc kernels.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    nheads a multiple of nheads_k (GQA/MQA). Returns out (batch, seqlen_q, nheads,
    headdim), or with return_attn_probs (out, softmax_lse (batch, nheads, seqlen_q),
    None): the attention probabilities are not returned. The backward is always
    deterministic. `dropout_seed` (attncc's, keyword only) fixes the dropout bits;
    without it a seed is drawn from torch's CPU generator."""
    _check_layout("q", q, "(batch, seqlen_q, nheads, headdim)", 4)
    _check_layout("k", k, "(batch, seqlen_k, nheads_k, headdim)", 4)
    _check_layout("v", v, "(batch, seqlen_k, nheads_k, headdim)", 4)
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs)
    kernel = kernel_for(packed=False, **options)
    inputs = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
    # (batch, seqlen, heads, dim) read as (batch, heads, seqlen, dim) through strides.
    result = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    return_lse=return_attn_probs, dropout_seed=dropout_seed, **inputs)
    if return_attn_probs:
        out, lse = result
        return out.transpose(1, 2), lse, None
    return result.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *,
                           dropout_seed: int | None = None, packing=None):
    """flash-attn's `flash_attn_varlen_func` on attncc kernels (attncc.varlen).

    q: (total_q, nheads, headdim), k, v: (total_k, nheads_k, headdim), packed by
    cu_seqlens_q/cu_seqlens_k (int32, (batch + 1,)). Causal masks, windows and ALiBi
    apply within each sequence, bottom-right aligned per sequence. Returns out (total_q,
    nheads, headdim), or (out, softmax_lse (nheads, total_q), None). Dropout bits are
    drawn per (seed, head, packed query, packed key) position. Paged KV (`block_table`)
    is not supported. The cu_seqlens values are read on every call (one host read), unless
    `packing` (attncc's, keyword only: attncc.varlen_packing(...)) was built from them."""
    if block_table is not None:
        raise CallError("block_table (paged KV cache) is not supported by attncc's "
                        "flash_attn_varlen_func; pass k and v packed as (total_k, nheads_k, "
                        "headdim)")
    _check_layout("q", q, "(total_q, nheads, headdim)", 3)
    _check_layout("k", k, "(total_k, nheads_k, headdim)", 3)
    _check_layout("v", v, "(total_k, nheads_k, headdim)", 3)
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       deterministic, return_attn_probs)
    kernel = kernel_for(packed=True, **options)
    inputs = {} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}
    result = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    return_lse=return_attn_probs, dropout_seed=dropout_seed, packing=packing,
                    **inputs)
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result
