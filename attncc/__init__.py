"""attncc: a compiler from attention variants to FlashAttention-2 style Triton kernels.

    kernel = attncc.compile("examples/sliding_window.attn")   # a path, the text, or a Variant
    out = kernel(q, k, v)                                     # (batch, heads, seq, dim), differentiable

See README.md for the language and the Python decorator.
"""
from .errors import AttnccError, BackendError, CallError, NoGPUError, SpecError, SpecWarning
from .frontend.decorator import FUNCTIONS as _FUNCTIONS, isin, variant
from .frontend.load import load
from .frontend.parser import parse, parse_file
from .ir import Variant
from .semantics.decoding import decode_reference
from .runtime.kernel import compile
from .runtime.packed import varlen, varlen_packing
from .semantics.reference import reference
from .version import __version__
from . import calls  # last: reads the calls' keywords into attncc.reserved (imports the runtime)

# attncc.where, attncc.minimum, attncc.exp, ...: the language's functions for decorated
# variants, one for each function of attncc/operators.py.
globals().update(_FUNCTIONS)

__all__ = ["compile", "varlen", "varlen_packing", "load", "parse", "parse_file", "reference", "decode_reference",
           "variant", "Variant", "isin", *_FUNCTIONS, "AttnccError", "SpecError", "SpecWarning",
           "CallError", "BackendError", "NoGPUError"]


def __getattr__(name: str):
    # attncc.flash (flash-attn's API) is imported on first use: it marks a function for
    # torch.compile, which imports torch._dynamo and sympy, seconds that `import attncc`
    # and a warm start must not pay. `import attncc.flash` works as for any submodule.
    if name == "flash":
        import importlib
        return importlib.import_module(".flash", __name__)
    raise AttributeError(f"module 'attncc' has no attribute {name!r}")
