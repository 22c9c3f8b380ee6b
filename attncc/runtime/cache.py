"""The on-disk cache of generated modules: where it lives, how files are written, and how a
variant's module is found (by IR and generator digest), checked and imported.

Nothing read from the cache is trusted: an index entry must name the variant's own
module, by the name codegen gives it, inside the cache, with the digest of its bytes, and
those bytes, read once, are what runs (never a .pyc beside them).
"""
from __future__ import annotations

import functools
import hashlib
import json
import linecache
import os
import re
import secrets
import sys
import types
from pathlib import Path

from .. import backends, ir
from ..codegen.generated import Generated, module_name
from ..errors import CacheError
from ..resources import grammar_path


def cache_dir() -> Path:
    root = os.environ.get("ATTNCC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "attncc")
    return Path(root)


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically, and only when the content differs; True when (re)written.

    Concurrent compiles of the same variant race harmlessly, a reader never sees a
    half-written file, and a damaged file (even one that is not UTF-8) is rewritten."""
    try:
        if path.read_bytes() == text.encode():
            return False
    except OSError:
        pass  # missing or unreadable: write it
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def _new_temp_file(path: Path):
    """(fd, name) of a new file beside `path`. Unlike mkstemp's (mode 0600), it gets the
    mode any new file gets, 0666 less the umask (0644 under the usual 022): generated
    modules are meant to be read and shipped."""
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # another writer's name, one chance in 2**48: draw again
            continue


def _import_module(name: str, path: Path, source: bytes):
    """Run `source`, the very bytes whose digest was checked, as module `name` at `path`.

    Never through Python's source loader: it would read the file again (a window for
    another writer between the check and the import) and prefer a __pycache__ .pyc whose
    header matches the file's mtime and size, which anyone who can write the cache could
    plant. The bytes are compiled here and no bytecode is read or written. linecache
    holds the same text under `path`, so triton.jit (which reads kernels' source through
    inspect) and tracebacks see exactly what runs."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]  # the name ends in the digest: the same bytes ran
    text = source.decode()
    # An entry without an mtime is one linecache.checkcache keeps (it never re-reads it).
    linecache.cache[str(path)] = (len(text), None, text.splitlines(keepends=True), str(path))
    code = compile(source, str(path), "exec", dont_inherit=True)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # triton.jit looks its functions' module up by name
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@functools.lru_cache(maxsize=1)
def generator_digest() -> str:
    """A hash of everything that turns a variant into code: attncc's own sources, the
    templates and the grammar. A module cached under another digest is never reused."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent  # attncc/, every subpackage included
    # Every backend's templates, in their folders (a template in a subfolder changes the
    # code as much as one at the top).
    sources = sorted(package.rglob("*.py")) + sorted(package.rglob("*.jinja"))
    for path in sources + [grammar_path()]:
        name = path.relative_to(package).as_posix() if path in sources else path.name
        h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _index_path(variant: ir.Variant, backend: str | None = None) -> Path:
    backend = backend or backends.portable().name
    suffix = "" if backend == backends.portable().name else f"-{backend}"
    return (cache_dir() / "modules" / "index"
            / f"{variant.short_name}-{variant.key()}-{generator_digest()}{suffix}.json")


def _load_indexed(variant: ir.Variant, backend: str | None = None):
    """(generated, module) from the cache without generating, or None on any miss: no
    index entry, a damaged one, or a module file whose bytes are not the ones indexed.
    Nothing the index says is trusted: the module it names must be this variant's, by
    the name codegen gives it (so no path of its choosing is imported), with the
    digest of the file's bytes."""
    backend = backend or backends.portable().name
    modules = cache_dir() / "modules"
    try:
        entry = json.loads(_index_path(variant, backend).read_text())
        name, strategy, digest = entry["module"], entry["strategy"], entry["sha256"]
        if not (isinstance(strategy, str) and isinstance(digest, str)
                and re.fullmatch(r"[0-9a-f]{64}", digest)
                and name == f"{module_name(variant, backend)}_{digest[:12]}"):
            return None
        path = modules / f"{name}.py"
        if path.resolve().parent != modules.resolve():
            return None  # a link out of the cache
        data = path.read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if hashlib.sha256(data).hexdigest() != digest:
        return None
    gen = Generated(source=data.decode(), strategy=strategy, module_name=name.rsplit("_", 1)[0])
    return gen, _import_module(name, path, data)


def write_to_cache(path: Path, text: str) -> bool:
    """write_if_changed into attncc's cache, with an error that names the fix."""
    try:
        return write_if_changed(path, text)
    except OSError as e:
        raise CacheError(cache_unwritable(path, e)) from None


def cache_unwritable(path: Path, e: OSError) -> str:
    return (f"cannot write attncc's cache at {cache_dir()} ({path.name}: {e.strerror or e}); "
            "set ATTNCC_CACHE_DIR to a writable directory")


def load_generated(variant: ir.Variant, backend: str | None = None):
    """(generated, module): import the variant's module from the cache, rendering it
    first when the cache does not hold it. A warm start skips the generator (and its
    sympy import, most of a second) by looking the module up by IR and generator hash.
    `backend`: the name of the backend whose module it is (attncc/backends/__init__.py's
    registry); the portable one's by default."""
    backend = backend or backends.portable().name
    found = _load_indexed(variant, backend)
    if found is not None:
        return found
    # The generators import sympy: only when there is code to generate.
    gen = backends.named(backend).render(variant)
    digest = hashlib.sha256(gen.source.encode()).hexdigest()
    name = f"{gen.module_name}_{digest[:12]}"
    path = cache_dir() / "modules" / f"{name}.py"
    write_to_cache(path, gen.source)
    entry = {"module": name, "strategy": gen.strategy, "sha256": digest}
    write_to_cache(_index_path(variant, backend), json.dumps(entry, indent=1) + "\n")
    return gen, _import_module(name, path, gen.source.encode())  # what was hashed, not the file
