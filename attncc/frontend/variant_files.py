"""Variants written with the decorator, read from their Python file: `file.py:name`.

    attncc show examples/python_variants.py:sliding_window
    kernel = attncc.compile("examples/python_variants.py:sliding_window")

The file is imported (it runs, as `python file.py` would, with its directory first on
the import path) and `name` is the variant it defines under that name. A file that
defines exactly one variant may be given without `:name`.
"""
from __future__ import annotations

import importlib.util
import itertools
import re
import sys
import traceback
from pathlib import Path

from .. import ir
from ..errors import SpecError, did_you_mean

# "file.py" or "file.py:name"; the name is a Python identifier, so a drive letter or a
# colon elsewhere in the path is never taken for one.
PYTHON_SPEC = re.compile(r"^(?P<path>.+\.py)(?::(?P<name>[A-Za-z_]\w*))?$", re.S)
_imports = itertools.count()


def is_python_spec(text: str) -> bool:
    return PYTHON_SPEC.match(text) is not None


def load_python_variant(text: str) -> ir.Variant:
    m = PYTHON_SPEC.match(text)
    path, name = Path(m["path"]), m["name"]
    if not path.is_file():
        raise SpecError(f"{path} is a directory, not a Python file" if path.is_dir()
                        else f"no such file: {path}")
    module = _import(path)
    found = {attr: obj for attr, obj in vars(module).items()
             if isinstance(obj, ir.Variant) and not attr.startswith("_")}
    if name is None:
        if len(found) == 1:
            return next(iter(found.values()))
        if not found:
            raise SpecError(f"{path} defines no variant: decorate a function or class in it "
                            "with @attncc.variant")
        raise SpecError(f"{path} defines {len(found)} variants; name the one to use, as in "
                        f"{path}:{next(iter(found))} (it defines {_listed(found)})")
    if name not in vars(module):
        raise SpecError(f"{path} has no variant '{name}'{did_you_mean(name, found)} (it defines "
                        f"{_listed(found) or 'none'})")
    obj = vars(module)[name]
    if not isinstance(obj, ir.Variant):
        fix = ("decorate it with @attncc.variant" if callable(obj)
               else "name one made with @attncc.variant")
        kind = type(obj).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise SpecError(f"'{name}' in {path} is {article} {kind}, not a variant: {fix}")
    return obj


def _listed(names, at_most: int = 8) -> str:
    names = list(names)
    more = f", and {len(names) - at_most} more" if len(names) > at_most else ""
    return ", ".join(names[:at_most]) + more


def _import(path: Path):
    """Run the file as a fresh module; its own errors become one located SpecError."""
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"_attncc_variants_{next(_imports)}_{stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up
    sys.path.insert(0, str(path.resolve().parent))  # its own imports, as `python file.py`
    try:
        spec.loader.exec_module(module)
    except SpecError:
        raise
    except Exception as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if Path(f.filename).resolve() == path.resolve()]
        where = f" ({path}:{frames[-1].lineno})" if frames else ""
        raise SpecError(f"importing {path} raised {type(err).__name__}: {err}{where}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
        sys.modules.pop(module_name, None)
    return module
