"""attncc: a compiler from attention variants to FlashAttention-2 style Triton kernels.

    kernel = attncc.compile("examples/sliding_window.attn")   # a path, the text, or a Variant
    out = kernel(q, k, v)                                     # (batch, heads, seq, dim), differentiable

See README.md for the language and the Python decorator.
"""
from . import flash  # attncc.flash.flash_attn_func, flash_attn_varlen_func
from .errors import AttnccError, BackendError, CallError, NoGPUError, SpecError
from .frontend.decorator import chance, exp, isin, log, maximum, minimum, sqrt, tanh, variant, where
from .frontend.parser import parse, parse_file
from .ir import Variant
from .runtime.decoding import decode_reference
from .semantics.reference import reference
from .version import __version__


def load(spec) -> Variant:
    """A Variant from a Variant, a path to a .attn file, the text of one, or `file.py:name`
    (a variant made with @attncc.variant in that Python file, which is imported)."""
    import os
    if isinstance(spec, Variant):
        return spec
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and not _is_spec_text(spec)):
        from .frontend.variant_files import is_python_spec, load_python_variant
        if is_python_spec(str(os.fspath(spec))):
            return load_python_variant(str(os.fspath(spec)))
        return parse_file(spec)
    if isinstance(spec, str):
        return parse(spec)
    raise TypeError(f"expected a Variant, a path or spec text, got {type(spec).__name__}")


def _is_spec_text(text: str) -> bool:
    """Spec text, not a path: no such file exists and the text begins (after comments)
    with `attention`. A path may contain `{` or even newlines; spec text never names a file."""
    import os
    try:
        if os.path.exists(text):
            return False
    except (ValueError, OSError):  # an embedded NUL, a name too long for the system
        pass
    for line in text.splitlines():
        code = line.split("#", 1)[0].split()
        if code:
            return code[0].split("{", 1)[0] == "attention"
    return False


def compile(spec, *, backend: str = "auto", config: dict | None = None, **unknown):
    """Compile a variant into a differentiable kernel: kernel(q, k, v, **inputs).

    backend="auto" (default) | "triton" | "gluon": which kernels run the forward; see
    kernel.backend and kernel.backend_reason. `config` pins the kernels' tiles:
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}. Everything else
    about the attention is part of the variant."""
    if unknown:
        raise TypeError(_compile_option_hint(*next(iter(unknown.items()))))
    from .runtime.kernel import compile_variant
    return compile_variant(load(spec), backend=backend, config=config)


_CONFIG_EXAMPLE = '{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}'


def _compile_option_hint(name: str, value) -> str:
    """Why attncc.compile() takes no `name=`, and what to write instead."""
    if name == "block":
        block = value if isinstance(value, int) and not isinstance(value, bool) else 64
        return (f"attncc.compile() takes no block=: a layout's block is part of the variant; "
                f"declare `block {block}` in the spec (block= in @attncc.variant). Kernel "
                f"tile sizes are pinned with config={_CONFIG_EXAMPLE}")
    if name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"):
        return (f"attncc.compile() takes no {name}=: pin the tiles together, as "
                f"config={_CONFIG_EXAMPLE}")
    if name in ("heads", "scale", "dropout", "mask", "score", "layout", "params", "inputs"):
        return (f"attncc.compile() takes no {name}=: it is part of the variant; declare it in "
                f"the spec (or in @attncc.variant)")
    return (f"attncc.compile() got an unexpected keyword argument '{name}'; it takes a spec "
            f"(a path, spec text or Variant) and config={_CONFIG_EXAMPLE} to pin tiles")


def varlen(spec, **options):
    """A kernel over packed variable-length sequences (flash-attn's cu_seqlens form):
    vk(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **inputs)."""
    from .runtime.packed import varlen as make
    return make(spec, **options)


__all__ = ["compile", "varlen", "load", "parse", "parse_file", "reference", "decode_reference",
           "variant", "Variant", "where", "isin", "chance", "minimum", "maximum", "exp", "log",
           "tanh", "sqrt", "AttnccError", "SpecError", "CallError", "BackendError", "NoGPUError"]
