"""The backends, each a folder holding its class (the protocol of backends/base.py), its
code generator and its templates, and the registry the runtime finds them in.

The registry is in order of preference: under backend="auto" a kernel role runs on the
earliest backend that can take it, or on whichever of those the tuner measured faster.
The portable backend comes last: it runs every variant, everywhere, so some backend can
always run a kernel. Adding a backend is adding its folder and its line below.
"""
from __future__ import annotations

from .base import Backend
from .gluon import GluonBackend
from .portable import PortableBackend

REGISTRY: tuple = (
    GluonBackend(),
    PortableBackend(),
)


def names() -> tuple:
    """The registered backends' names, in order of preference."""
    return tuple(b.name for b in REGISTRY)


def named(name: str) -> Backend:
    """The registered backend called `name` (a name attncc.compile has checked)."""
    for backend in REGISTRY:
        if backend.name == name:
            return backend
    raise KeyError(f"no backend is registered as {name!r}; the backends are "
                   f"{', '.join(names())}")


def portable() -> Backend:
    """The backend that runs everything: the registry's last."""
    return REGISTRY[-1]


def preferred() -> tuple:
    """Every backend but the portable one, in order of preference."""
    return REGISTRY[:-1]
