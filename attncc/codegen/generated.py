"""What code generation produces for one variant, whether just rendered or read back
from the module cache (which must not need the generator: it imports sympy)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Generated:
    source: str
    strategy: str
    module_name: str


def module_name(variant, backend: str = "triton") -> str:
    """A variant's module name, but for the digest of its source that the cache appends:
    from the backend, the name (cut, ir.NAME_IN_FILES) and the key. Only characters of
    identifiers."""
    prefix = "attncc" if backend == "triton" else f"attncc_{backend}"
    return f"{prefix}_{variant.short_name}_{variant.key()}"
