"""The portable backend: Triton kernels that run on any GPU Triton targets, and under the
Triton interpreter on the CPU. It runs every variant and every call the Kernel's checks
let through, so the registry puts it last (attncc/backends/__init__.py): some backend can
always run a kernel."""
from __future__ import annotations

from ..base import ENTRY_POINTS
from ..tile_config import TileConfig
from . import tiles


class PortableBackend:
    name = "triton"
    title = "portable"
    auto_reason = "the portable kernels run every variant, on every GPU and under the interpreter"
    module_note = "imports only torch, triton and the standard library"
    forced_note = "forward and backward, on every GPU and under the interpreter"
    auto_note = "forward and backward, on every GPU"

    def __repr__(self):
        return f"<attncc backend {self.name!r}>"

    def environment_unsupported(self) -> str | None:
        return None

    def supports(self, variant) -> str | None:
        return None

    def supports_call(self, variant, q, k, v, kind: str) -> str | None:
        return None

    def render(self, variant):
        from .codegen import generate  # imports sympy: only when there is code to generate
        return generate(variant)

    def candidates(self, direction: str, head_dim: int, variant) -> list[TileConfig]:
        return tiles.kept_candidates(variant, head_dim, direction)

    def check_config(self, config: TileConfig, direction: str, head_dim: int | None) -> str | None:
        return tiles.check_config(config)

    def entry(self, module, kind: str):
        return getattr(module, ENTRY_POINTS[kind])
