"""Where the grammar lives, in a checkout and once installed.

In a source checkout it sits at the top of the repository beside attncc/; a wheel
installs it inside the package as attncc/_data/ (see pyproject.toml). The kernel
templates are package data of their backends (attncc/backends/<name>/templates/,
attncc/codegen/templates/ for the shared ones).
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"attncc's {name}/ folder is missing from {_PACKAGE}; "
                            "reinstall attncc")


def grammar_path() -> Path:
    return _data_dir("grammar") / "attn.lark"
