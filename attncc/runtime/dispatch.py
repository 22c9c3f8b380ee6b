"""Which backends may run each kernel role of a call, and why, in the sentences the Kernel
reports (`kernel.backend_reason`, `kernel.last_backend`, `kernel.last_backward`) or
raises for a backend asked for by name that cannot run.

Everything here goes through the registry (attncc/backends/__init__.py) and the backend
protocol: no backend is named. A compiled kernel keeps the backends that can run its
variant on this machine (`kernel_backends`); each call narrows them to those that take its
tensors and role (`role_backends`); where several remain, the tuner picks one with its
tile config (runtime/tuning.py), and `tuner_reason` says why that one ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import backends
from ..backends.base import KERNEL_NAMES
from ..errors import BackendError
from . import settings

AUTO = "auto"


def check_backend(name) -> str:
    """`backend` of attncc.compile, checked."""
    known = (AUTO, backends.portable().name, *(b.name for b in backends.preferred()))
    if name not in known:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in known)}, "
                         f"got {name!r}")
    return name


def refuse(backend, reason: str):
    """A backend asked for by name cannot do what was asked: say what, and the way out."""
    portable = backends.portable()
    raise BackendError(f"backend='{backend.name}' cannot run this: {reason}; use backend='auto' "
                       f"(which runs the {portable.title} kernels where {backend.title} cannot) "
                       f"or backend='{portable.name}'")


def kernel_backends(variant, requested: str, pinned: Callable) -> tuple:
    """(backends, reason): the backends that may run a kernel of `variant` on this
    machine, in order of preference, as far as it is decided before a call, and why the
    first one. `pinned()`: whether a config is pinned (config= or ATTNCC_CONFIG), asked
    only where another backend could run; under auto a pin is the portable kernels'. A
    backend asked for by name that cannot run is refused."""
    portable = backends.portable()
    if requested == portable.name:
        return (portable,), f"backend='{portable.name}' was asked for"
    able, first_why = [], None
    for backend in backends.preferred():
        if requested not in (AUTO, backend.name):
            continue
        why = backend.supports(variant) or backend.environment_unsupported()
        if why is None and requested == AUTO and pinned():
            why = (f"a pinned config (config= or ATTNCC_CONFIG) is the portable kernel's; pass "
                   f"backend='{backend.name}' with config= to pin a {backend.title} one")
        if why is not None:
            if requested == backend.name:
                refuse(backend, why)
            first_why = first_why or why
            continue
        able.append(backend)
    if not able:
        return (portable,), first_why or "no other backend is registered"
    if requested == able[0].name:
        return (able[0],), f"backend='{able[0].name}' was asked for"
    return (*able, portable), able[0].auto_reason


@dataclass(frozen=True)
class Role:
    """One kernel role of one call ("fwd", "dq", "dkdv" or "bwd") and how each backend that
    may run it launches it: `runs` {backend name: run(TileConfig)}, in order of
    preference. `reason`: why these backends alone where one is left, else None (the
    tuner decides, and `tuner_reason` says why)."""
    direction: str
    runs: dict
    reason: str | None


def role_backends(kernel, kind: str, q, k, v) -> tuple:
    """(backends, reason) that may run role `kind` of this call: the kernel's backends
    that take its tensors and role, the portable one last (reason None where several
    remain). A backend asked for by name refuses a forward it cannot take; its backward
    kernels hand what they cannot take to the portable ones, and say why."""
    portable = backends.portable()
    if kernel.backends == (portable,):
        return (portable,), kernel.backend_reason
    requested = kernel.requested_backend
    able, first_why = [], None
    for backend in kernel.backends[:-1] if requested == AUTO else kernel.backends:
        why = backend.supports_call(kernel.variant, q, k, v, kind)
        if why is None and kind == "fwd" and requested == backend.name \
                and kernel.pinned_config is not None:
            why = backend.check_config(kernel.pinned_config, kind, q.shape[-1])
        if why is not None:
            if kind == "fwd" and requested == backend.name:
                refuse(backend, why)
            first_why = first_why or why
            continue
        able.append(backend)
    if not able:
        return (portable,), first_why
    if requested == able[0].name:
        return (able[0],), f"backend='{able[0].name}' was asked for ({KERNEL_NAMES[kind]})"
    return (*able, portable), None


def make_role(kernel, kind: str, q, k, v, run_of: Callable) -> Role:
    """The Role of `kind` for this call; `run_of(backend)` is its run(config) on that
    backend."""
    able, why = role_backends(kernel, kind, q, k, v)
    return Role(kind, {backend.name: run_of(backend) for backend in able}, why)


def tuner_reason(role: Role, backend: str, untimed: str | None) -> str:
    """Why `backend` runs a role several backends could run: the tuner chose it
    (`untimed`: why nothing was timed, tuning.untimed_reason's)."""
    title, what = backends.named(backend).title, KERNEL_NAMES[role.direction]
    if untimed is not None:
        return f"{untimed}, so the {title} {what}, which runs everywhere"
    return f"the tuner measured the {title} {what} faster for this shape"


def one_launch_reason() -> str:
    """Why a table-driven variant's backward runs on the portable kernels."""
    others = " or ".join(b.title for b in backends.preferred())
    where = f", on the {others} kernels where they can" if others else ""
    if settings.TABLES_BACKWARD == "auto":
        return (f"a variant with tile tables runs dK/dV and dQ in one {backends.portable().title} "
                f"launch where no other backend takes both (ATTNCC_BACKWARD=auto, the default; "
                f"sequential runs them apart{where})")
    return (f"a variant with tile tables runs dK/dV and dQ in one {backends.portable().title} "
            f"launch (ATTNCC_BACKWARD=one-launch; auto, the default, or sequential runs them "
            f"apart{where})")
