"""Winners the tuner found on GPUs we measured, shipped with attncc (known_winners.json).

Tuning a new variant compiles every candidate of every kernel: 29-50 s before the first
result on an H100 (RESULTS.md). On a GPU listed in the file, the first call of a variant
instead runs the config measured best for its *class*, compiling one config per kernel.
What the winners were measured to depend on (benchmarks/compile_latency.py) is the class:
how tiles are skipped (no mask; a mask the loop bounds solve; a mask that needs tile
tables; a block layout), the tile density of the call (a 1024-wide window wants small
tiles where causal wants large ones), and the score's weight (a score calling tanh, exp,
log or sqrt wants small tiles where a linear bias does not). A call matches an entry of
the same GPU, direction, head dim, dtype and kind of class whose density bucket is within
a factor of two and whose length buckets are within a factor of four of its own (the
nearest one); anything else is tuned as before, and so is
everything under `ATTNCC_TUNE=full`. A shipped config is checked like a cached one
(configs.usable) before it is used.

An entry's first word says what it holds: a direction ("fwd-..."), the portable kernel's
config; another backend's name and a direction ("NAME-fwd-..."), that backend's config; a direction
and "backend" ("backend-..." for the forward, "dqbackend-...", "dkdvbackend-..."), the
name of the backend measured faster for the role.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from .. import backends, ir
from ..backends.tile_config import TileConfig
from ..operators import FLOAT_FUNCTIONS
from . import configs

WINNERS_FILE = Path(__file__).with_name("known_winners.json")
CHOICE = "backend"  # the last word of the first of an entry naming the faster backend
MAX_LENGTH_RATIO = 4  # a 16K winner serves 4K..64K
MAX_DENSITY_RATIO = 2  # a 1/16 winner serves 1/8..1/32


def variant_class(variant: ir.Variant, uses_tables: bool, density_bucket: str) -> str:
    """What the winners depend on beyond the shape: how tiles are skipped, how many are
    visited (density1/2: half of them), and whether the score adds work to every
    element (a call of tanh, exp, log or sqrt: "heavy")."""
    if variant.block is not None:
        kind = "layout"
    elif uses_tables:
        kind = "tables"
    elif variant.mask is not None:
        kind = "bounds"
    else:
        kind = "full"
    if variant.score is not None:
        heavy = any(isinstance(e, ir.Call) and e.fn in FLOAT_FUNCTIONS
                    for e in ir.walk(variant.score))
        kind += "+heavyscore" if heavy else "+score"
    if variant.normalize != ir.SOFTMAX:
        # Other kernels' work per tile (no max, a weight): a class of its own, so that
        # no softmax winner stands in for a timing it never had.
        kind += f"+normalize-{variant.normalize}"
    return f"{kind}@{density_bucket}"


def entry_key(direction: str, dim: int, dtype: str, vclass: str, len_q: int, len_k: int) -> str:
    """fwd-d128-bfloat16-bounds@1/2-q16384-k16384: lengths as length buckets."""
    return f"{direction}-d{dim}-{dtype}-{vclass}-q{len_q}-k{len_k}"


def config_entry(backend: str, direction: str) -> str:
    """The first word(s) of the entry holding `backend`'s config for `direction`."""
    return direction if backend == backends.portable().name else f"{backend}-{direction}"


def choice_entry(direction: str) -> str:
    """The first word of the entry naming the faster backend for `direction`."""
    return CHOICE if direction == "fwd" else f"{direction}{CHOICE}"


def _what(head: str) -> tuple:
    """(backend, direction) an entry's first word(s) hold a config of, or (None, direction)
    for an entry naming the faster backend."""
    if head.endswith(CHOICE):
        return None, head[:-len(CHOICE)] or "fwd"
    backend, _, direction = head.rpartition("-")
    return backend or backends.portable().name, direction


def _parse(key: str):
    """entry_key's inverse: ((what, dim, dtype, class), len_q, len_k), `what` the first
    word(s): "fwd", "NAME-fwd" (NAME a backend's, which has no dash of its own), "backend"."""
    parts = key.split("-")
    if parts[0] in backends.names():
        parts = [f"{parts[0]}-{parts[1]}", *parts[2:]]
    what, dim, dtype, vclass, q, k = parts
    return (what, int(dim[1:]), dtype, vclass), int(q[1:]), int(k[1:])


@functools.lru_cache(maxsize=None)
def load_table(path: str = str(WINNERS_FILE)) -> dict:
    """{gpu name: {(what, dim, dtype, kind): [(density, len_q, len_k, winner)]}}, the
    class split into its kind and its density (1/16 -> 16), a winner a TileConfig or a
    backend's name. The file ships with attncc; an entry that is not a config its kernel
    takes (or a backend's name) is an error of the package, raised here rather than
    skipped."""
    return table_from(json.loads(Path(path).read_text())["winners"], path)


def table_from(winners: dict, path: str) -> dict:
    """load_table's table from the file's {gpu: {key: winner}}."""
    names = (backends.portable().name, *(b.name for b in backends.preferred()))
    table = {}
    for gpu, entries in winners.items():
        per_gpu = table.setdefault(gpu, {})
        for key, winner in entries.items():
            (what, dim, dtype, vclass), len_q, len_k = _parse(key)
            kind, density = _split_class(vclass)
            backend, direction = _what(what)
            where = f"{path}: {gpu} {key}"
            if backend is None:
                if winner not in names:
                    raise ValueError(f"{where}: backend must be {' or '.join(names)}")
            else:
                winner = TileConfig.from_dict(winner, where)
                why = backends.named(backend).check_config(winner, direction, dim)
                if why is not None:
                    raise ValueError(f"{where}: {why}")
            per_gpu.setdefault((what, dim, dtype, kind), []).append(
                (density, len_q, len_k, winner))
    return table


def _split_class(vclass: str):
    """"bounds@1/16" -> ("bounds", 16)."""
    kind, _, density = vclass.partition("@")
    return kind, int(density.split("/")[1])


def lookup(gpu: str, direction: str, dim: int, dtype: str, vclass: str, len_q: int,
           len_k: int, table: dict | None = None):
    """The nearest shipped winner of the same kind: density bucket within a factor of
    MAX_DENSITY_RATIO, length buckets within MAX_LENGTH_RATIO; or None."""
    table = load_table() if table is None else table
    kind, density = _split_class(vclass)
    rows = table.get(gpu, {}).get((direction, dim, dtype, kind), [])
    ratio = lambda a, b: max(a / b, b / a)
    near = [row for row in rows if ratio(row[0], density) <= MAX_DENSITY_RATIO
            and max(ratio(row[1], len_q), ratio(row[2], len_k)) <= MAX_LENGTH_RATIO]
    if not near:
        return None
    # a density step counts as two length steps: it moved the winners more (RESULTS.md)
    distance = lambda row: (2 * abs(math.log2(row[0] / density)) + abs(math.log2(row[1] / len_q))
                            + abs(math.log2(row[2] / len_k)))
    return min(near, key=distance)[3]


def shipped(kernel, problem, dtype, direction: str, options: tuple, density):
    """{backend: its shipped config, or None} for this call of role `direction`: the
    backends of `options` (names, in order of preference) the shipped winners leave, one
    where they name the faster for this class and it is among them. None where this GPU
    has no winners, or the caller cannot say its density. A config the variant cannot run
    (configs.usable) counts as none. (Under ATTNCC_TUNE=full, runtime/tuning.py does not
    ask.) `density()`: the call's tile density (computed only when this GPU has winners
    at all)."""
    import torch

    from .configs import density_bucket, length_bucket
    if density is None or not torch.cuda.is_available() or problem.dim_v != problem.dim:
        return None  # the winners were measured with v as wide as q and k
    gpu = torch.cuda.get_device_name()
    if gpu not in load_table():
        return None
    vclass = variant_class(kernel.variant, kernel.module.USES_TABLES, density_bucket(density()))
    look = lambda what: lookup(gpu, what, problem.dim, str(dtype).replace("torch.", ""), vclass,
                               length_bucket(problem.len_q), length_bucket(problem.len_k))
    if len(options) > 1 and look(choice_entry(direction)) in options:
        options = (look(choice_entry(direction)),)  # the other backends are never compiled
    found = {}
    for backend in options:
        config = look(config_entry(backend, direction))
        usable = config is not None and configs.usable(backend, config, kernel.variant,
                                                       problem.dim, direction)
        found[backend] = config if usable else None
    return found
