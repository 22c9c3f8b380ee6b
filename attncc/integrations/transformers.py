"""Hugging Face transformers: attncc kernels behind `attn_implementation="attncc"`.

`register(name, variant)` adds two entries under one name: an attention function to
transformers' `AttentionInterface`, and a mask function to its
`AttentionMaskInterface`. The mask function materialises nothing: it hands the
attention function a `MaskInfo` (the 2D padding mask as a per-key keep vector, the
query and key offsets that a KV cache gives, and transformers' own mask function). The
attention function turns the layer's arguments into one attncc variant per kind of
layer, with no S x S mask:

  * causal (`is_causal`, else the module's), with absolute positions from the offsets;
  * `sliding_window` W: `q - k < W` when causal, `abs(q - k) < W` when not. The
    attention functions' W is exclusive on both sides (flash-attention's window is W - 1;
    a bidirectional model passes its mask's inclusive window + 1);
  * padding: `keep[b, k]`, only when some key is padded;
  * packed sequences (`position_ids` restarting inside a row, where transformers'
    mask keeps them apart: it does so without a padding mask and a cache):
    `seq[b, q] == seq[b, k]`;
  * `softcap`, `scaling` and `dropout` as the model passes them;
  * gpt-oss's `s_aux` (one learnable logit per head, its attention sinks): the
    variant's `sink hf_sinks[h]`, a learnable input of the parameter's dtype, so the
    parameter takes its gradient;
  * and the variant given to `register`, whose mask is conjoined with all of the above
    and whose score is applied before the softcap.

With `check_masks=True` (the default) the first layer of each kind in a forward pass
compares that reading with the boolean mask transformers' own `sdpa_mask` builds from
the same arguments, a block of query rows at a time, and raises a CallError naming the
first pair where they differ: a model whose mask holds more (chunked attention,
bidirectional image-token blocks, a custom mask function) is refused, never run with
the wrong mask. The check costs O(batch x len_q x len_k) boolean work and one host
synchronisation per mask per forward; turn it off once a model is known to pass
(and under torch.compile, which cannot trace it).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from .. import ir
from ..errors import CallError
from ..frontend.parser import parse

# transformers dispatches on these substrings of a name (and on "eager" itself):
# registering under them would shadow its own implementations or their checks.
_RESERVED = ("sdpa", "flex_attention", "flash_attention")
_REGISTERED: dict = {}  # name -> _Attention
KEEP, SEQ = "hf_keep", "hf_seq"  # the inputs the model's masks add to a variant
# Tensors models pass their attention that attncc reads (position_ids, s_aux) or that
# say what the mask already says (flash-attention's packed-sequence lengths, the cache's
# positions); any other tensor is refused.
_READ_OR_REDUNDANT = {"position_ids", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k",
                      "cache_position"}
SINKS = "hf_sinks"  # the input gpt-oss's s_aux becomes
# torch dtype -> the language's name of it, for the input s_aux becomes.
_DTYPE_WORDS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
                torch.float64: "f64"}
CHECK_ELEMENTS = 1 << 24  # booleans compared per block of query rows


MIN_VERSION = (5, 17)  # the mask interface's (q_length, q_offset) arguments; tested on 5.23 too


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("attncc.integrations.transformers needs Hugging Face transformers: "
                          "pip install 'attncc[hf]'") from e
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_VERSION:
        raise ImportError(f"attncc.integrations.transformers needs transformers >= "
                          f"{'.'.join(map(str, MIN_VERSION))}, found {transformers.__version__}: "
                          "pip install -U 'attncc[hf]'")
    return transformers


@dataclasses.dataclass(eq=False)
class MaskInfo:
    """What attncc's mask function hands the attention function in place of a mask."""
    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    keep: torch.Tensor | None  # (batch, kv_offset + kv_length) bool; None: nothing padded
    mask_function: Callable
    attention_mask: torch.Tensor | None  # the 2D mask as transformers received it
    use_vmap: bool
    checked: set = dataclasses.field(default_factory=set)  # readings already compared
    sequence_ids: dict = dataclasses.field(default_factory=dict)  # (id, version) -> (weakref, ids)

    # It stands where transformers would put its prepared 4D mask. `generate` with a
    # compileable (static) cache builds the mask before the forward and passes it back to
    # the model as `attention_mask`, whose mask preprocessing reads `ndim` and `shape`:
    # they say "a prepared (batch, 1, q_length, kv_length) mask", and `attncc_mask` then
    # rebuilds from the 2D mask it carries.
    ndim = 4

    @property
    def shape(self) -> tuple:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def _used_as_a_tensor(self, *args, **kwargs):
        raise CallError("the model computes with its attention mask itself (indexes, adds or "
                        "converts it), but attncc's transformers integration hands it a "
                        "description of the mask (MaskInfo), not a tensor; this model's "
                        "attention does not go through transformers' attention interface "
                        "alone: use another attn_implementation for it")

    __getitem__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = \
        __and__ = __rand__ = __or__ = __ror__ = __invert__ = _used_as_a_tensor
    to = size = dim = float = bool = masked_fill = expand = _used_as_a_tensor


def attncc_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                use_vmap: bool = False, **kwargs) -> MaskInfo:
    """The mask function attncc registers: no mask is built, only what it describes."""
    if isinstance(attention_mask, MaskInfo):
        # A MaskInfo handed back as the model's attention_mask (generate with a static
        # cache): read again from the 2D mask it was made from, at this call's sizes.
        attention_mask = attention_mask.attention_mask
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    keep = None
    if attention_mask is not None:
        # As transformers' prepare_padding_mask: indexed by absolute key position, keys
        # past the 2D mask are padding.
        width = kv_offset + kv_length
        keep = attention_mask.to(torch.bool)[:, :width]
        if keep.shape[1] < width:
            keep = torch.nn.functional.pad(keep, (0, width - keep.shape[1]), value=False)
        if bool(keep[:, kv_offset:].all()):
            keep = None  # nothing padded: the kernels need no keep vector
        else:
            keep = keep.contiguous()
    return MaskInfo(batch_size, q_length, kv_length, q_offset, kv_offset, keep, mask_function,
                    attention_mask, bool(use_vmap))


def _packed_sequence_ids(info: MaskInfo, position_ids, batch: int, q_len: int, kv_len: int):
    """Sequence ids (batch, len) int32 when `position_ids` packs several sequences into a
    row and the model's mask keeps them apart, else None. transformers separates packed
    sequences only in some calls (no padding mask, no cache), so its mask function is
    asked: may the first token of the second sequence see the last token of the first?"""
    if (position_ids is None or info is None or info.mask_function is None or info.q_offset
            or info.kv_offset or q_len != kv_len or position_ids.shape[-1] != q_len):
        return None
    # The id alone is not enough: a new position_ids tensor may get a freed one's id. The
    # entry keeps a weak reference to the tensor it was computed from and is used only
    # while that same tensor, unchanged, is the one passed.
    given = position_ids
    # An inference tensor has no version counter to see a write by: never reused.
    # Under torch.compile nothing is kept (Dynamo traces neither is_inference nor _version).
    key = None if torch.compiler.is_compiling() or given.is_inference() else (
        id(given), given._version)
    entry = info.sequence_ids.get(key) if key is not None else None
    if entry is None or entry[0]() is not given:
        position_ids = position_ids.expand(batch, -1)
        # A new sequence starts wherever the position does not follow the previous one.
        starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
        ids = starts.cumsum(-1).to(torch.int32)
        packed = ids[:, -1] > 0
        separated = False
        if bool(packed.any()):
            b = int(packed.nonzero()[0, 0])
            first = int((ids[b] == 1).nonzero()[0, 0])
            index = lambda i: torch.tensor(i, device=position_ids.device)
            separated = not bool(info.mask_function(index(b), index(0), index(first),
                                                    index(first - 1)))
        entry = (weakref.ref(given), ids.contiguous() if separated else None)
        if key is not None:
            info.sequence_ids[key] = entry
    return entry[1]


class _Attention:
    """The attention function registered under one name, and its compiled kernels."""

    CACHE_SIZE = 32

    def __init__(self, name: str, variant: ir.Variant | None, inputs, check_masks: bool):
        self.name = name
        self.variant = variant
        self.inputs = inputs
        self.check_masks = check_masks
        self.kernels: OrderedDict = OrderedDict()
        if variant is not None:
            clash = {d.name for d in variant.inputs} & {KEEP, SEQ, SINKS}
            if clash:
                raise CallError(f"variant '{variant.name}' declares {sorted(clash)[0]!r}, a name "
                                "attncc's transformers integration uses for the model's masks; "
                                "rename it")

    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: float | None = None, is_causal: bool | None = None,
                 sliding_window: int | None = None, softcap: float | None = None, **kwargs):
        for unsupported, given in kwargs.items():
            # A tensor the model hands its attention says something about it (a bias, a
            # block selection, a head mask): one attncc does not read would be dropped.
            if (unsupported in ("position_bias", "sinks") and given is not None) or (
                    isinstance(given, torch.Tensor) and unsupported not in _READ_OR_REDUNDANT):
                raise CallError(f"the model passes `{unsupported}` to its attention, which "
                                f"attncc's transformers integration does not implement; use "
                                f"another attn_implementation for this model")
        if kwargs.get("output_attentions"):
            _warn_once("output_attentions=True: attncc computes no attention weights (no S x S "
                       "matrix exists); the model gets None for them, as with sdpa")
        if attention_mask is not None and not isinstance(attention_mask, MaskInfo):
            shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else None
            raise CallError(
                f"attention_mask reached attn_implementation={self.name!r} as a "
                f"{type(attention_mask).__name__} of shape {shape}, not as attncc's MaskInfo: "
                "attncc reads the model's mask through the mask function registered with it, "
                "so pass a 2D padding mask (batch, seq) to the model, not a prepared 4D mask")
        info = attention_mask
        batch, heads, q_len, dim = query.shape
        kv_len = key.shape[2]
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if info is not None:
            if (info.q_length, info.kv_length) != (q_len, kv_len):
                raise CallError(f"the model's mask was made for {info.q_length} queries and "
                                f"{info.kv_length} keys, but the attention got {q_len} and "
                                f"{kv_len}")
            q_offset, k_offset = info.q_offset, info.kv_offset
        else:
            # No mask at all: the queries are the last ones (a KV cache), as in SDPA's path.
            q_offset, k_offset = (kv_len - q_len if causal and kv_len > q_len else 0), 0
        block = self.variant.block if self.variant is not None and self.variant.layout else None
        if block and (q_offset % block or k_offset % block):
            raise CallError(f"the registered variant '{self.variant.name}' has a layout (block "
                            f"{block}), whose tiles start at multiples of {block}, but this "
                            f"layer's queries start at position {q_offset} and its keys at "
                            f"{k_offset} (a KV cache's offsets, as in generate): a layout "
                            "cannot decode through a cache here; register a variant without "
                            "a layout for generation")
        sequence_ids = _packed_sequence_ids(info, kwargs.get("position_ids"), batch, q_len, kv_len)
        keep = info.keep if info is not None else None
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise CallError(f"sliding_window must be a positive int or None, got "
                            f"{sliding_window!r}")
        p = self.variant.dropout if self.variant is not None and self.variant.dropout else dropout
        if self.variant is not None and self.variant.dropout and dropout and dropout != p:
            _warn_once(f"the registered variant '{self.variant.name}' declares dropout {p:g}, "
                       f"which replaces the model's attention dropout {dropout:g}")
        reading = (bool(causal), sliding_window, keep is not None, sequence_ids is not None)
        sinks = _sinks(kwargs.get("s_aux"), heads, self.variant)
        kernel = self._kernel(reading, softcap, scaling, dim, float(p or 0.0),
                              None if sinks is None else _DTYPE_WORDS[sinks.dtype])
        inputs = dict(self._user_inputs(module))
        if sinks is not None:
            inputs[SINKS] = sinks
        if keep is not None:
            inputs[KEEP] = keep
        if sequence_ids is not None:
            inputs[SEQ] = sequence_ids
        if (self.check_masks and info is not None and info.mask_function is not None
                and reading not in info.checked):
            _check_reading(info, model_mask_variant(*reading), inputs, dim, query.device)
            info.checked.add(reading)
        # The model passes dropout 0 in evaluation; a registered variant's own dropout
        # follows the module's training flag, as nn.Dropout does.
        training = bool(getattr(module, "training", True))
        out = kernel(query, key, value, q_offset=q_offset, k_offset=k_offset, training=training,
                     layout="bhsd", **inputs)
        return out.transpose(1, 2).contiguous(), None  # (batch, seq, heads, dim)

    def _user_inputs(self, module) -> dict:
        if self.inputs is None:
            return {}
        return self.inputs(module) if callable(self.inputs) else self.inputs

    def _kernel(self, reading, softcap, scaling, dim, dropout_p, sink_dtype=None):
        key = (reading, softcap, scaling, dim, dropout_p, sink_dtype)
        kernel = self.kernels.get(key)
        if kernel is None:
            from .. import compile as compile_variant
            kernel = compile_variant(self._variant(reading, softcap, scaling, dim, dropout_p,
                                                   sink_dtype))
            self.kernels[key] = kernel
            if len(self.kernels) > self.CACHE_SIZE:
                self.kernels.popitem(last=False)
        else:
            self.kernels.move_to_end(key)
        return kernel

    def _variant(self, reading, softcap, scaling, dim, dropout_p, sink_dtype=None) -> ir.Variant:
        """The variant for one kind of layer: the model's masks, the registered variant's
        mask and score, then the softcap; with `sink_dtype`, the model's sinks (s_aux)."""
        from ..frontend.checker import check_variant
        model = model_mask_variant(*reading)
        base = self.variant or ir.Variant(name="hf")
        mask = model.mask
        if base.mask is not None:
            mask = base.mask if mask is None else ir.And(base.mask, mask)
        score = base.score
        if softcap is not None and softcap > 0:
            cap = ir.Const(float(softcap), ir.FLOAT)
            s = score if score is not None else ir.Var("s")
            score = ir.BinOp("*", cap, ir.Call("tanh", (ir.BinOp("/", s, cap),)))
        scale = base.scale
        if scale is None and scaling is not None and not math.isclose(scaling, dim ** -0.5,
                                                                     rel_tol=1e-12):
            scale = ir.Const(float(scaling), ir.FLOAT)
        elif scale is not None and scaling is not None:
            from ..semantics.reference import scale_value
            own = scale_value(base, dim)
            if not math.isclose(own, scaling, rel_tol=1e-6):
                _warn_once(f"the registered variant '{base.name}' declares `scale`, which "
                           f"replaces the model's scaling {scaling:g} (the variant's is "
                           f"{own:g} at head dim {dim}); leave `scale` out to keep the model's")
        inputs, sink, name = base.inputs + model.inputs, base.sink, f"{base.name}_{model.name}"
        if sink_dtype is not None:
            inputs += (ir.InputDecl(SINKS, sink_dtype, ("h",), learnable=True),)
            sink, name = ir.Load(SINKS, (ir.Var("h"),)), f"{name}_sinks"
        variant = dataclasses.replace(
            base, name=name, mask=mask, score=score, scale=scale,
            inputs=inputs, dropout=dropout_p or None, sink=sink)
        return check_variant(variant)


_WARNED: set = set()


def _warn_once(message: str):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"attncc (transformers): {message}", UserWarning, stacklevel=4)


def _sinks(s_aux, heads: int, variant: ir.Variant | None):
    """gpt-oss's `s_aux` (its attention sinks, a parameter of shape (num_heads,)) checked,
    or None where the model passes none."""
    if s_aux is None:
        return None
    if variant is not None and variant.sink is not None:
        raise CallError(f"the model passes attention sinks (s_aux) and the registered variant "
                        f"'{variant.name}' has a sink of its own; a row's softmax takes one "
                        "sink: register a variant without `sink`")
    if (not isinstance(s_aux, torch.Tensor) or tuple(s_aux.shape) != (heads,)
            or s_aux.dtype not in _DTYPE_WORDS):
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise CallError(f"the model passes s_aux (attention sinks) of shape {shape}; attncc "
                        f"reads it as gpt-oss does: one floating-point logit per query head, "
                        f"shape ({heads},)")
    return s_aux


def model_mask_variant(causal: bool, sliding_window: int | None, padded: bool,
                       packed: bool) -> ir.Variant:
    """The masks transformers gives a layer, as a variant (no score): see the module doc."""
    name, inputs, mask = ["hf"], [], []
    if causal:
        name.append("causal")
        mask.append("k <= q")
    if sliding_window is not None:
        name.append(f"window{sliding_window}")
        mask.append(f"q - k < {sliding_window}" if causal else f"abs(q - k) < {sliding_window}")
    if padded:
        name.append("padded")
        inputs.append(f"input {KEEP}: bool[b, k]")
        mask.append(f"{KEEP}[b, k]")
    if packed:
        name.append("packed")
        inputs.append(f"input {SEQ}: i32[b, q]")
        mask.append(f"{SEQ}[b, q] == {SEQ}[b, k]")
    body = "\n".join(inputs + ([f"mask {' and '.join(mask)}"] if mask else []))
    return parse(f"attention {'_'.join(name)} {{\n{body}\n}}")


def _check_reading(info: MaskInfo, model: ir.Variant, inputs: dict, dim: int, device):
    """Compare attncc's reading of the model's mask with transformers' own boolean mask,
    a block of query rows at a time; raise naming the first pair that differs."""
    from transformers.masking_utils import sdpa_mask

    from ..arguments import Problem
    from ..semantics.reference import allowed_pairs
    B, Lq, Lk = info.batch_size, info.q_length, info.kv_length
    rows = max(1, CHECK_ELEMENTS // max(1, B * Lk))
    for start in range(0, Lq, rows):
        n = min(rows, Lq - start)
        expected = sdpa_mask(batch_size=B, q_length=n, kv_length=Lk,
                             q_offset=info.q_offset + start, kv_offset=info.kv_offset,
                             mask_function=info.mask_function, attention_mask=info.attention_mask,
                             allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                             use_vmap=info.use_vmap, device=device)
        expected = expected.expand(B, 1, n, Lk)
        problem = Problem(B, 1, 1, n, Lk, dim, dim, info.q_offset + start, info.kv_offset)
        got = allowed_pairs(model, problem, {k: v for k, v in inputs.items()
                                             if k in (KEEP, SEQ)}, device).expand(B, 1, n, Lk)
        differ = expected != got
        if bool(differ.any()):
            b, _, i, j = (int(x) for x in differ.nonzero()[0])
            verdict = "allows" if expected[b, 0, i, j] else "forbids"
            raise CallError(
                f"transformers' mask for this layer {verdict} "
                f"query {info.q_offset + start + i} to attend key {info.kv_offset + j} (batch "
                f"{b}), but attncc reads the layer as `{model.mask and _text(model.mask)}`: the "
                "model's mask holds a pattern attncc's integration does not read (chunked "
                "attention, bidirectional blocks, a custom mask function). Use another "
                "attn_implementation for this model, or register a variant whose mask "
                "expresses the pattern")


def _text(e) -> str:
    from ..ir import print_expr
    return print_expr(e)


def register(name: str = "attncc", variant=None, *, inputs=None,
             check_masks: bool = True) -> str:
    """Register attncc under `name` in transformers' AttentionInterface and
    AttentionMaskInterface, so that `attn_implementation=name` runs a model's attention
    through attncc kernels. Returns the name.

    `variant` (a Variant, spec text or path, or a compiled kernel) adds its mask and score
    to every layer; its `inputs` are a dict of tensors, or a function of the attention
    module returning one. `check_masks` compares attncc's reading of each mask with
    transformers' (see the module docstring)."""
    transformers = _transformers()
    if not isinstance(name, str) or not name or "/" in name or ":" in name or "|" in name:
        raise CallError(f"name must be a plain name such as 'attncc' (no '/', ':' or '|', which "
                        f"transformers reads as hub kernels or prefixes), got {name!r}")
    reserved = "eager" if name == "eager" else next((r for r in _RESERVED if r in name), None)
    if reserved:
        raise CallError(f"name {name!r} contains '{reserved}', which transformers treats as its "
                        "own attention implementation; choose another name, such as 'attncc'")
    if variant is not None:
        from .. import load
        variant = load(getattr(variant, "variant", variant))  # a compiled kernel's variant
    attention = _Attention(name, variant, inputs, check_masks)
    from transformers.masking_utils import AttentionMaskInterface
    transformers.AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, attncc_mask)
    _REGISTERED[name] = attention
    return name


def registered() -> list:
    """The names registered through attncc in this process."""
    return sorted(_REGISTERED)
