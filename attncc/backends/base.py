"""What a backend is to the runtime: the one protocol every backend folder implements.

A backend renders a variant into a module of kernels (its code generator and templates,
in its folder), says what it can run (a variant, this machine, a call) with a reason
where it cannot, and lists the tile configs its kernels take. The runtime picks among
the backends that can run a kernel role through this protocol alone (attncc/runtime/dispatch.py),
and the tuner treats the backend as one more dimension of its candidates
(attncc/runtime/tuning.py).
"""
from __future__ import annotations

from typing import Callable, Protocol

from .tile_config import TileConfig

# The kernel roles, as the tuner names them: the forward, dQ, dK/dV, and "bwd", dK/dV and
# dQ in one launch (the portable module's, for table-driven variants).
DIRECTIONS = ("fwd", "dq", "dkdv", "bwd")
# The role of a call with deterministic=False where a backend has it: dK, dV and dQ in one
# pass, dQ added across key tiles in no fixed order (the Gluon module's; such a backend
# says how in its `fused_add`).
FUSED = "fused"
# What each role's kernel is called in messages.
KERNEL_NAMES = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV", "bwd": "backward",
                FUSED: "fused backward"}
# Each role's entry point in a generated module (attncc/codegen/interface.py).
ENTRY_POINTS = {"fwd": "forward", "dq": "backward_dq", "dkdv": "backward_dkdv",
                "bwd": "backward_one_launch", FUSED: "backward_fused"}


class Backend(Protocol):
    name: str  # as users ask for it: attncc.compile(..., backend=name)
    title: str  # in sentences: "the Gluon forward", "the portable dQ"
    # kernel.backend_reason where backend="auto" makes it the kernel's backend.
    auto_reason: str
    # `attncc compile`'s words: what the written module holds, and where its kernels
    # run when the backend is asked for by name (`forced_note`) or chosen by auto.
    module_note: str
    forced_note: str
    auto_note: str

    def environment_unsupported(self) -> str | None:
        """Why its kernels cannot run in this process (the GPU, the interpreter, the
        Triton), or None."""

    def supports(self, variant) -> str | None:
        """Why it cannot run this variant at all, or None."""

    def supports_call(self, variant, q, k, v, kind: str) -> str | None:
        """Why its kernel of role `kind` ("fwd", "dq", "dkdv") cannot take this call (its
        dtype, head dim, strides), or None. The Kernel's own checks have passed."""

    def render(self, variant):
        """The module source for `variant` (a codegen.generated.Generated); no GPU needed."""

    def candidates(self, direction: str, head_dim: int, variant) -> list[TileConfig]:
        """The tile configs its kernel of `direction` may run for this variant at this
        head dim, most likely winner first (ATTNCC_TUNE=0 takes the first that runs)."""

    def check_config(self, config: TileConfig, direction: str, head_dim: int | None) -> str | None:
        """Why its kernel of `direction` cannot run `config` (head_dim None: before a
        call, the rules that do not depend on it), or None."""

    def entry(self, module, kind: str) -> Callable:
        """The function of `module` (this backend's, rendered by `render`) that launches
        role `kind`, called as the portable module's is."""
