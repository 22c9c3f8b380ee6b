"""Reads the keywords no input may take from the signatures of every public call that
takes a variant's inputs as keyword arguments (**inputs), and hands them to
attncc/reserved.py. Never a list kept by hand, which a new keyword would outgrow:
tests/test_call_names.py finds the **inputs calls on its own and checks they are here.
"""
from __future__ import annotations

import inspect

from . import distributed, reserved
from .runtime import decoding, packed
from .runtime.kernel import Kernel
from .semantics import decoding as decoding_reference, reference


def calls_taking_inputs() -> tuple:
    """(what the user calls, the function) for each call that takes **inputs. Its other
    parameters that can be passed by keyword are names no input may take."""
    return (("the kernel call", Kernel.__call__), ("kernel.decode", Kernel.decode),
            # What Kernel.decode and attncc.flash's flash_attn_with_kvcache call, with
            # the latter's rows_before_start: an input of that name could not pass.
            ("attncc.flash.flash_attn_with_kvcache", decoding.decode),
            ("kernel.tile_tables", Kernel.tile_tables), ("kernel.density", Kernel.density),
            ("kernel.check", Kernel.check),
            ("a varlen kernel's call", packed.VarlenKernel.__call__),
            ("varlen_kernel.reference", packed.VarlenKernel.reference),
            ("varlen_kernel.density", packed.VarlenKernel.density),
            ("attncc.reference", reference.reference),
            ("attncc.decode_reference", decoding_reference.decode_reference),
            ("attncc.context_parallel_attention", distributed.context_parallel_attention))


def read_call_keywords() -> dict[str, str]:
    """{keyword: the first call in calls_taking_inputs() that takes it}."""
    taken = {}
    for label, fn in calls_taking_inputs():
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                taken.setdefault(param.name, label)
    return taken


reserved.set_call_keywords(read_call_keywords())
