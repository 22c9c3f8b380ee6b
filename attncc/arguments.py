"""Call-time arguments: checks q, k, v and the variant's inputs, and derives the problem shape.

Shared by the reference and the kernels so that both accept exactly the same calls and
word their errors the same way. Every error names the argument, what was given and
what was expected.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

from . import ir
from .errors import CallError, did_you_mean
from .analysis.ranges import MAX_EXTENT
from .reserved import call_keywords

TORCH_DTYPES = {
    "bool": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32,
    "i64": torch.int64, "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
    "f64": torch.float64,
}


@dataclass(frozen=True)
class Problem:
    """The sizes of one call: what the kernel grid and the index ranges come from."""
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    dim: int
    dim_v: int
    q_offset: int = 0
    k_offset: int = 0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def tile_dim(self) -> int:
        """The wider of q·k's and v's head dims: the one the tile candidates and their
        on-chip size checks are chosen by (a tile holds rows of both widths)."""
        return max(self.dim, self.dim_v)


def _shape(t) -> str:
    # An f-string, not str(): under torch.compile the checks run at trace time, where
    # sizes are symbolic, and Dynamo formats those but cannot call str() on them.
    inner = ", ".join(f"{s}" for s in t.shape)
    return f"({inner},)" if len(t.shape) == 1 else f"({inner})"  # Python's spelling


# How q, k, v (and the output) lay out their axes. "bhsd" is scaled_dot_product_attention's
# and the default; "bshd" is flash-attn's, read through a transposed view (no copy).
LAYOUTS = {"bhsd": "(batch, heads, seq, dim)", "bshd": "(batch, seq, heads, dim)"}


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise CallError(f"layout={layout!r} is not a layout attncc knows: pass layout='bhsd' for "
                        f"{LAYOUTS['bhsd']} tensors (the default, as scaled_dot_product_attention) "
                        f"or layout='bshd' for {LAYOUTS['bshd']} tensors (as flash-attn)")
    return layout


def as_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """q, k, v or the output as (batch, heads, seq, dim): a view, never a copy."""
    return t.transpose(1, 2) if layout == "bshd" else t


def refuse_positional(variant: ir.Variant, extra: tuple):
    """Inputs are keyword arguments; a positional one gets a message, not a TypeError."""
    names = [d.name for d in variant.inputs]
    given = f"{len(extra)} positional argument{'s' if len(extra) > 1 else ''} after q, k, v"
    if not names:
        raise CallError(f"got {given}, but the variant '{variant.name}' declares no inputs; "
                        "the call takes q, k, v and keyword options only")
    raise CallError(f"got {given}: the variant's inputs are keyword arguments; pass "
                    + ", ".join(f"{n}={n}" for n in names))


def bind(variant: ir.Variant, q, k, v, inputs: dict, *, q_offset: int = 0,
         k_offset: int = 0, exact_float_inputs: bool = True, layout: str | None = None) -> Problem:
    """Check a call and return its Problem; raises CallError naming what is wrong.

    `layout=None` is a call that did not say: read as "bhsd", unless the tensors fit both
    layouts and read as "bhsd" they would have more query heads than positions, where
    "bshd" is the likely reading and the call is refused (the two readings give different
    attention, and nothing in the call tells which was meant). A call that fits only the
    other layout is refused with a hint to pass it, when that reading is a likely one."""
    said = layout is not None
    layout = check_layout("bhsd" if layout is None else layout)
    check_input_names(variant, inputs)  # wrong whatever the layout: said first
    args = (variant, q, k, v, inputs, q_offset, k_offset, exact_float_inputs)
    # torch.compile traces this function. Dynamo in PyTorch 2.11 fails with an internal
    # error where a caught exception is raised again, with or without `from` (RESULTS.md
    # runs 89 and 91), so the message is kept and a new CallError raised outside the
    # except block.
    problem, message = None, None
    try:
        problem = _bind(*args, layout)
    except CallError as err:
        message = err.args[0]  # str(err) is not traceable
    other = "bshd" if layout == "bhsd" else "bhsd"
    if problem is not None:
        if said or _likely(problem):
            return problem
        seen_other = _try_bind(*args, other)
        if seen_other is None:
            return problem
        raise CallError(
            f"q {_shape(q)}, k {_shape(k)} and v {_shape(v)} fit both layouts, and the call "
            f"does not say which: read as {LAYOUTS['bhsd']} they have {problem.heads_q} query "
            f"heads but only {max(problem.len_q, problem.len_k)} positions, read as "
            f"{LAYOUTS['bshd']} {seen_other.heads_q} heads and {seen_other.len_q} queries; "
            f"pass layout='bshd' for {LAYOUTS['bshd']} tensors (as flash-attn), or "
            f"layout='bhsd' if they are {LAYOUTS['bhsd']}")
    seen_other = _try_bind(*args, other)
    if seen_other is not None and _likely(seen_other):
        message += f"; q, k and v look like {LAYOUTS[other]} tensors: pass layout='{other}'"
    raise CallError(message)


def _likely(p: Problem) -> bool:
    """Whether a reading of the tensors is a likely one: no more query heads than the
    longer sequence has positions. Every ordinary call has far fewer heads than positions;
    a reading with more is most often the other layout read by mistake. Two comparisons,
    not max(): under torch.compile, max() of symbolic lengths would guard on which is
    longer and recompile when that changes."""
    return p.heads_q <= p.len_q or p.heads_q <= p.len_k


def _try_bind(*args) -> Problem | None:
    """The call's Problem in the given layout (_bind's arguments), or None where it does
    not bind."""
    try:
        return _bind(*args)
    except CallError:
        return None


def _bind(variant, q, k, v, inputs, q_offset, k_offset, exact_float_inputs, layout) -> Problem:
    axes = LAYOUTS[layout]
    read = f"read as {axes} (layout='{layout}')"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise CallError(f"{name} must be a torch.Tensor of shape {axes}, got {type(t).__name__}")
        if t.dim() != 4:
            raise CallError(f"{name} must have 4 dimensions {axes} (layout='{layout}'), "
                            f"got shape {_shape(t)}")
        if not t.is_floating_point():
            raise CallError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise CallError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}; convert them with .to(dtype)")
    if not (q.device == k.device == v.device):
        raise CallError(f"q, k and v must be on the same device, got q on {q.device}, "
                        f"k on {k.device}, v on {v.device}")
    B, Hq, Lq, D = as_bhsd(q, layout).shape
    (_, Hkv, Lk, Dk), (_, Hv, Lv, Dv) = as_bhsd(k, layout).shape, as_bhsd(v, layout).shape
    if k.shape[0] != B or v.shape[0] != B:
        raise CallError(f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}; "
                        "dimension 0 must agree")
    if Hv != Hkv:
        raise CallError(f"k and v must have the same number of heads, got k {_shape(k)} and "
                        f"v {_shape(v)}, {read}")
    if Lv != Lk:
        raise CallError(f"k and v must have the same sequence length, got k {_shape(k)} and "
                        f"v {_shape(v)}, {read}")
    if Dk != D:
        raise CallError(f"q and k must have the same head dim, got q {_shape(q)} and k {_shape(k)}")
    if Hq == 0 or Hkv == 0:
        raise CallError(f"q has {Hq} heads and k, v have {Hkv}: attention needs at least one head "
                        f"(q {_shape(q)}, k {_shape(k)})")
    if variant.heads is not None:
        if (Hq, Hkv) != (variant.heads.q, variant.heads.kv):
            raise CallError(f"the variant declares heads {variant.heads.q} / {variant.heads.kv}, "
                            f"but q has {Hq} heads and k, v have {Hkv} (q {_shape(q)}, k "
                            f"{_shape(k)}, {read})")
    elif Hkv == 0 or Hq % Hkv:
        raise CallError(f"q has {Hq} heads, which is not a multiple of the {Hkv} heads of k and v "
                        f"(q {_shape(q)}, k {_shape(k)}, {read}); each key/value head must serve "
                        "a whole group of query heads")
    for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise CallError(f"{name} must be a non-negative int, got {off!r}")
    # Positions, and every size an expression reads, stay below 2**31: the range analysis
    # that keeps the kernels' integers from wrapping (attncc/analysis/ranges.py) assumes it.
    for what, extent in (("q_offset + len_q", q_offset + Lq), ("k_offset + len_k", k_offset + Lk),
                         ("the batch", B), ("the head count", Hq), ("the head dim", D)):
        if extent > MAX_EXTENT:
            raise CallError(f"{what} is {extent}; positions and sizes must stay below 2**31 "
                            f"(at most {MAX_EXTENT})")
    problem = Problem(B, Hq, Hkv, Lq, Lk, D, Dv, q_offset, k_offset)
    check_inputs(variant, problem, inputs, device=q.device, exact_float_inputs=exact_float_inputs)
    return problem


def check_seed(seed) -> int:
    """A dropout seed: an int in [0, 2**32), the 32 bits the dropout hash reads (so two
    seeds never give one mask by accident)."""
    if isinstance(seed, bool):
        raise CallError(f"dropout_seed must be an int in [0, 2**32), got {seed!r}")
    if isinstance(seed, torch.SymInt) or torch.compiler.is_compiling():
        # Traced by torch.compile: reading its value would specialise the graph on it.
        # The operator checks the real value when it runs (attncc/runtime/ops.py).
        return seed
    try:
        value = operator.index(seed)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        raise CallError(f"dropout_seed must be an int in [0, 2**32), got {type(seed).__name__} "
                        f"{seed!r}") from None
    if not 0 <= value < 2 ** 32:
        raise CallError(f"dropout_seed={value} is out of range: the dropout hash reads 32 bits, "
                        "so a seed is an int in [0, 2**32); reduce it, as in seed % 2**32")
    return value


def refuse_seed_without_dropout(variant: ir.Variant, seed) -> None:
    """A dropout_seed for a variant with no dropout would be ignored: a caller who passes
    one expects dropout, so the call is refused rather than run without it."""
    if seed is not None and not variant.dropout:
        raise CallError(f"dropout_seed={seed!r} is given, but variant '{variant.name}' declares no "
                        "dropout, so nothing would be dropped: declare it in the spec "
                        "(`dropout 0.1`, or dropout= in @attncc.variant), or leave dropout_seed out")


def axis_extent(axis, variant: ir.Variant, p: Problem) -> int:
    """The length an input axis must have for this call."""
    if isinstance(axis, int):
        return axis
    if axis == "b":
        return p.batch
    if axis == "h":
        return p.heads_q
    # Position axes cover every position the call sees: offset + length.
    if axis == "q":
        return p.q_offset + p.len_q
    if axis == "k":
        return p.k_offset + p.len_k
    if axis == "qb":
        return math.ceil((p.q_offset + p.len_q) / variant.block)
    if axis == "kb":
        return math.ceil((p.k_offset + p.len_k) / variant.block)
    raise ValueError(axis)


def _number(value, placeholder: str) -> str:
    return repr(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else placeholder


# What to write instead of scaled_dot_product_attention's keywords: in attncc they are
# part of the variant, declared in the spec, so the kernel is compiled for them.
SDPA_KEYWORDS = {
    "is_causal": lambda value: (
        "the mask is part of the variant; declare `mask q >= k` in the spec (SDPA's is_causal, "
        "top-left) or `mask q + len_k - len_q >= k` (bottom-right, for a KV cache)"),
    "scale": lambda value: (
        f"declare it in the spec, as in `scale {_number(value, '0.125')}` (scale= in "
        "@attncc.variant); the default is 1 / sqrt(dim), as SDPA's"),
    "attn_mask": lambda value: (
        "declare the mask in the spec: as an expression (`mask q >= k`), or as a tensor "
        "input, `input keep: bool[b, h, q, k]` with `mask keep[b, h, q, k]` (a float mask that "
        "SDPA adds: `input bias: f32[b, h, q, k]` with `score s + bias[b, h, q, k]`)"),
    "dropout_p": lambda value: (
        f"declare `dropout {_number(value, '0.1')}` in the spec (dropout= in @attncc.variant); "
        "calls then take dropout_seed= and training="),
    "enable_gqa": lambda value: (
        "nothing to enable: k and v may have fewer heads than q (declare `heads 32 / 8` in the "
        "spec to have the counts checked)"),
}


def check_input_names(variant: ir.Variant, inputs: dict):
    """Every declared input given, nothing else: SDPA's keywords say what to do instead."""
    declared = {i.name: i for i in variant.inputs}
    extra = sorted(set(inputs) - set(declared))
    for name in extra:
        if name in SDPA_KEYWORDS:
            raise CallError(f"{name}= is an argument of scaled_dot_product_attention, not of an "
                            f"attncc call: {SDPA_KEYWORDS[name](inputs[name])}")
    for name in extra:
        # A keyword of another call (kernel.check(..., return_lse=True), decode's layout=):
        # the did-you-mean below would offer the very name given.
        if name in call_keywords():
            raise CallError(f"{name}= is an option of {call_keywords()[name]}, which this call "
                            "does not take; leave it out here")
    if extra:
        # A misspelt input or call keyword (`retrun_lse=`, `q_ofset=`) lands here too.
        known = [*declared, *call_keywords()]
        hints = "".join(did_you_mean(e, known) if len(extra) == 1 else
                        did_you_mean(e, known).replace("; did you mean", f"; for '{e}', did you mean")
                        for e in extra)
        raise CallError(f"unexpected input{'s' if len(extra) > 1 else ''} "
                        f"{', '.join(repr(e) for e in extra)}: the variant '{variant.name}' declares "
                        + (", ".join(repr(d) for d in declared) if declared else "no inputs")
                        + hints)
    missing = [d for d in declared if d not in inputs]
    if missing:
        decl = declared[missing[0]]
        raise CallError(f"missing input '{decl.name}': the variant declares "
                        f"`input {decl.name}: {decl.dtype}[{', '.join(map(str, decl.axes))}]`; "
                        f"pass it as {decl.name}=tensor")


def check_inputs(variant: ir.Variant, p: Problem, inputs: dict, *, device,
                 exact_float_inputs: bool = True):
    """Check the variant's runtime inputs. The reference passes exact_float_inputs=False:
    it computes in the dtype of q, so float inputs of any precision (float64 for
    gradient checks) are fine there. Their names were checked first (check_input_names)."""
    declared = {i.name: i for i in variant.inputs}
    for name, decl in declared.items():
        t = inputs[name]
        if not isinstance(t, torch.Tensor):
            raise CallError(f"input '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:  # the kernels read memory at strides
            raise CallError(f"input '{name}' is a {t.layout} tensor; the kernels read dense "
                            f"tensors: pass {name}.to_dense()")
        want = tuple(axis_extent(a, variant, p) for a in decl.axes)
        if tuple(t.shape) != want:
            names = ", ".join(f"{a}={n}" for a, n in zip(decl.axes, want))
            # `want` spelled as a tuple by hand: PyTorch 2.11's Dynamo leaves a tuple in an
            # f-string unformatted in the error it reports (RESULTS.md run 92).
            expected = "(" + ", ".join(f"{n}" for n in want) + ("," if len(want) == 1 else "") + ")"
            raise CallError(f"input '{name}' has shape {_shape(t)}, expected {expected} "
                            f"({names}) for axes [{', '.join(map(str, decl.axes))}]")
        lenient = not exact_float_inputs and decl.type == ir.FLOAT and t.is_floating_point()
        if t.dtype != TORCH_DTYPES[decl.dtype] and not lenient:
            raise CallError(f"input '{name}' has dtype {t.dtype}, but the variant declares "
                            f"{decl.dtype} ({TORCH_DTYPES[decl.dtype]}); convert it with "
                            f".to({TORCH_DTYPES[decl.dtype]})")
        if t.device != device:
            raise CallError(f"input '{name}' is on {t.device} but q is on {device}; "
                            f"move it with .to(q.device)")
        if t.requires_grad and not decl.learnable and torch.is_grad_enabled():
            # The kernels give gradients to learnable inputs only: refuse rather than
            # leave .grad silently empty.
            raise CallError(f"input '{name}' requires grad, but the variant does not declare it "
                            f"learnable, so it would get no gradient; declare `learnable input "
                            f"{name}: {decl.dtype}[{', '.join(map(str, decl.axes))}]` (learnable="
                            f"[{name!r}] in @attncc.variant), or pass {name}.detach()")


def random_index_lists(shape: tuple, n_tiles: int, gen: torch.Generator) -> torch.Tensor:
    """Sample index lists (int64, `shape`, the list on the last axis): distinct random
    tiles in [0, n_tiles), padded with -1 where a list is longer than there are tiles."""
    *rows, length = shape
    order = torch.rand(*rows, n_tiles, generator=gen).argsort(-1)[..., :length]
    if length > n_tiles:
        pad = torch.full((*rows, length - n_tiles), -1, dtype=order.dtype)
        order = torch.cat([order, pad], -1)
    return order


def check_return_lse(variant: ir.Variant, return_lse: bool):
    """return_lse is a bool; `normalize none` divides by nothing, so it has no LSE to return."""
    if not isinstance(return_lse, bool):
        raise CallError(f"return_lse must be True or False, got {return_lse!r}")
    if return_lse and variant.normalize == ir.UNNORMALIZED:
        raise CallError(f"return_lse=True: variant '{variant.name}' has `normalize none`, which "
                        "divides by nothing, so there is no normaliser to return; use `normalize "
                        "sum` (whose LSE is the log of the row's sum of weights) or call without "
                        "return_lse")


def check_cache_length(length: int, capacity: int, n_new: int) -> None:
    """An int cache_seqlens: the keys cached and the new ones fit the cache's positions."""
    if length < 0:
        raise CallError(f"cache_seqlens must be >= 0, got {length}")
    if length + n_new > capacity:
        raise CallError(f"cache_seqlens={length} keys cached"
                        + (f" plus {n_new} new ones" if n_new else "")
                        + f" do not fit the cache's {capacity} positions: an int cache_seqlens "
                        f"runs from 0 to {capacity - n_new}; use a larger cache")


def check_cache_seqlens(cache_seqlens, batch: int):
    """cache_seqlens as a decode call takes it: an int (numpy's integers too) or a
    (batch,) tensor, one length per row; the int's range and the tensor's dtype and
    device are the caller's to check (kernel.decode and decode_reference differ there)."""
    if cache_seqlens is None:
        raise CallError("decode needs cache_seqlens=: the number of keys each batch row's cache "
                        "holds (before k_new), an int or a (batch,) int32 tensor")
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        return int(cache_seqlens)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise CallError(f"cache_seqlens must be an int or a (batch,) int32 tensor, got "
                        f"{type(cache_seqlens).__name__}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise CallError(f"cache_seqlens has shape {_shape(cache_seqlens)}, expected ({batch},): "
                        "one length per batch row")
    return cache_seqlens
