"""attncc: a compiler from attention variants to FlashAttention-2 style Triton kernels.

    kernel = attncc.compile("examples/sliding_window.attn")   # a path, the text, or a Variant
    out = kernel(q, k, v)                                     # (batch, heads, seq, dim), differentiable

See README.md for the language and the Python decorator.
"""
from .decoding import decode_reference
from .decorator import chance, exp, isin, log, maximum, minimum, sqrt, tanh, variant, where
from .errors import AttnccError, CallError, NoGPUError, SpecError
from .ir import Variant
from .parser import parse, parse_file
from .reference import reference

__version__ = "0.1.0"


def load(spec) -> Variant:
    """A Variant from a Variant, a path to a .attn file, or the text of one."""
    import os
    if isinstance(spec, Variant):
        return spec
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and "{" not in spec):
        return parse_file(spec)
    if isinstance(spec, str):
        return parse(spec)
    raise TypeError(f"expected a Variant, a path or spec text, got {type(spec).__name__}")


def compile(spec, **options):
    """Compile a variant into a differentiable kernel: kernel(q, k, v, **inputs)."""
    from .runtime import compile_variant
    return compile_variant(load(spec), **options)


__all__ = ["compile", "load", "parse", "parse_file", "reference", "decode_reference", "variant",
           "Variant", "where", "isin", "chance", "minimum", "maximum", "exp", "log", "tanh", "sqrt",
           "AttnccError", "SpecError", "CallError", "NoGPUError"]
