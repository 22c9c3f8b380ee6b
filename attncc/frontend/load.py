"""A Variant from whatever a user hands over: a Variant, a path to a .attn file, the
text of one, or `file.py:name` (a variant made with @attncc.variant in that file)."""
from __future__ import annotations

import os

from ..ir import Variant
from .parser import parse, parse_file


def load(spec) -> Variant:
    """A Variant from a Variant, a path to a .attn file, the text of one, or `file.py:name`
    (a variant made with @attncc.variant in that Python file, which is imported)."""
    if isinstance(spec, Variant):
        return spec
    if isinstance(spec, str) and not spec.strip():
        from ..errors import SpecError
        raise SpecError("the spec is empty: pass a .attn file, spec text (`attention NAME "
                        "{ ... }`) or FILE.py:NAME")
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and not _is_spec_text(spec)):
        from .variant_files import is_python_spec, load_python_variant
        if is_python_spec(str(os.fspath(spec))):
            return load_python_variant(str(os.fspath(spec)))
        return parse_file(spec)
    if isinstance(spec, str):
        return parse(spec)
    raise TypeError(f"expected a Variant, a path or spec text, got {type(spec).__name__}")


def _is_spec_text(text: str) -> bool:
    """Spec text, not a path: no such file exists and the text begins (after comments)
    with `attention`. A path may contain `{` or even newlines; spec text never names a file."""
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
