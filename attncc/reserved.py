"""The keywords of the calls that take a variant's inputs as keyword arguments: no input
may take one of these names, or it could never be passed.

The names are read from the calls' own signatures by attncc/calls.py, which `import
attncc` runs last (it imports the runtime); the front end and the argument checks read
them here, so that nothing below the runtime imports it.
"""
from __future__ import annotations

_TAKEN: dict[str, str] = {}  # keyword -> the first call that takes it


def set_call_keywords(taken: dict[str, str]) -> None:
    _TAKEN.clear()
    _TAKEN.update(taken)


def call_keywords() -> dict[str, str]:
    """{keyword: what the user calls that takes it}."""
    if not _TAKEN:  # a bug in attncc, not the user's: checking names before they are known
        raise RuntimeError("attncc's reserved call keywords were read before attncc/calls.py "
                           "set them")
    return _TAKEN
