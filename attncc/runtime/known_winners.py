"""Winners the tuner found on GPUs we measured, shipped with attncc (known_winners.json).

Tuning a new variant compiles every candidate of every kernel: 24-42 s before the first
result on an H100 (ANCHORS.md). On a GPU listed in the file, the first call of a variant
instead runs the config measured best for its *class*, compiling one config per kernel:
variants of a class (no mask; a mask the loop bounds solve; a mask that needs tile
tables; a block layout; each with or without a score) shared their winners when
measured (benchmarks/compile_latency.py, RESULTS.md). A call matches an entry of the
same GPU, direction, head dim, dtype and class whose length buckets are within a factor
of four of its own (the nearest one); anything else is tuned as before, and so is
everything under `ATTNCC_TUNE=full`. A shipped config is checked like a cached one
(configs.usable) before it is used.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from .. import ir
from . import configs

WINNERS_FILE = Path(__file__).with_name("known_winners.json")
MAX_LENGTH_RATIO = 4  # a 16K winner serves 4K..64K


def variant_class(variant: ir.Variant, uses_tables: bool) -> str:
    """What the winners depend on beyond the shape: how tiles are skipped, and whether a
    score adds work (registers) to every tile."""
    if variant.block is not None:
        kind = "layout"
    elif uses_tables:
        kind = "tables"
    elif variant.mask is not None:
        kind = "bounds"
    else:
        kind = "full"
    return kind + ("+score" if variant.score is not None else "")


def entry_key(direction: str, dim: int, dtype: str, vclass: str, len_q: int, len_k: int,
              density: str | None = None) -> str:
    """fwd-d128-bfloat16-bounds-q16384-k16384[-density1/32]: lengths as length buckets."""
    key = f"{direction}-d{dim}-{dtype}-{vclass}-q{len_q}-k{len_k}"
    return key + (f"-density{density}" if density else "")


def _parse(key: str):
    """entry_key's inverse: ((direction, dim, dtype, class, density), len_q, len_k)."""
    parts = key.split("-")
    density = parts.pop()[len("density"):] if parts[-1].startswith("density") else None
    if parts[0] == "gluon":  # "gluon-fwd" has a dash of its own
        parts = ["gluon-fwd", *parts[2:]]
    direction, dim, dtype, vclass, q, k = parts
    return (direction, int(dim[1:]), dtype, vclass, density), int(q[1:]), int(k[1:])


@functools.lru_cache(maxsize=None)
def load_table(path: str = str(WINNERS_FILE)) -> dict:
    """{gpu name: {(direction, dim, dtype, class, density): [(len_q, len_k, winner)]}}.
    The file ships with attncc; an entry that is not a valid config (or backend name) is
    an error of the package, raised here rather than skipped."""
    data = json.loads(Path(path).read_text())
    table = {}
    for gpu, entries in data["winners"].items():
        per_gpu = table.setdefault(gpu, {})
        for key, winner in entries.items():
            head, len_q, len_k = _parse(key)
            if head[0] == "backend":
                if winner not in ("triton", "gluon"):
                    raise ValueError(f"{path}: {gpu} {key}: backend must be triton or gluon")
            else:
                winner = configs.check_config(winner, f"{path}: {gpu} {key}")
            per_gpu.setdefault(head, []).append((len_q, len_k, winner))
    return table


def lookup(gpu: str, direction: str, dim: int, dtype: str, vclass: str, len_q: int,
           len_k: int, density: str | None = None, table: dict | None = None):
    """The shipped winner nearest in length (buckets within MAX_LENGTH_RATIO), or None."""
    table = load_table() if table is None else table
    rows = table.get(gpu, {}).get((direction, dim, dtype, vclass, density), [])
    distance = lambda row: abs(math.log2(row[0] / len_q)) + abs(math.log2(row[1] / len_k))
    near = [row for row in rows if max(row[0] / len_q, len_q / row[0],
                                       row[1] / len_k, len_k / row[1]) <= MAX_LENGTH_RATIO]
    if not near:
        return None
    return min(near, key=distance)[2]


def shipped_winner(kernel, problem, dtype, direction: str, density=None):
    """The shipped winner for this call (a config, or for direction "backend" the faster
    backend's name), or None: none for this GPU and class, ATTNCC_TUNE=full, or one the
    variant cannot run."""
    import torch

    from .tuning import density_bucket, length_bucket, tune_mode
    if tune_mode() == "full" or not torch.cuda.is_available():
        return None
    winner = lookup(torch.cuda.get_device_name(), direction, problem.dim,
                    str(dtype).replace("torch.", ""),
                    variant_class(kernel.variant, kernel.module.USES_TABLES),
                    length_bucket(problem.len_q), length_bucket(problem.len_k),
                    density_bucket(density) if density is not None else None)
    if winner is None or direction == "backend":
        return winner
    return dict(winner) if configs.usable(winner, kernel.variant, problem.dim, direction) else None
