"""What code generation produces for one variant, whether just rendered or read back
from the module cache (which must not need the generator: it imports sympy)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Generated:
    source: str
    strategy: str
    module_name: str
