"""Where the grammar and the kernel templates live, in a checkout and once installed.

In a source checkout they sit at the top of the repository beside attncc/; a wheel
installs them inside the package as attncc/_data/ (see pyproject.toml).
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


def templates_dir() -> Path:
    return _data_dir("templates")
