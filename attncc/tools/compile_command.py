"""`attncc compile`: write the standalone generated module and say what was decided:
skipping strategy, decoding's, tile sizes, and with --len the fraction of tiles visited.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import backends, ir, load
from ..backends.base import KERNEL_NAMES
from ..errors import AttnccError
from ..arguments import Problem
from ..runtime.cache import write_if_changed
from .density import dense_allowed, tile_visit_fraction
from ..semantics.samples import default_heads, sample_inputs

MAX_COMPILE_ESTIMATE_LEN = 8192   # `compile --len`: dense classification up to this length
ASSUMED_HEAD_DIM = 128            # `compile` reports tiles for this head dim (and 192, 256 where they differ)


@contextlib.contextmanager
def _env(name: str, value):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def kernel_directions(source: str) -> tuple:
    """The directions the runtime picks tiles for with a generated module: the forward,
    then what runtime/settings.py's backward_directions decides for it without a call to
    ask other backends about (the one launch of table-driven modules, unless
    ATTNCC_BACKWARD=sequential, or dQ then dK/dV)."""
    from ..runtime.settings import backward_directions
    uses_tables = re.search(r"^USES_TABLES = True\b", source, re.M) is not None
    return ("fwd", *backward_directions(uses_tables))


def chosen_configs(variant: ir.Variant, source: str, head_dim: int, *, interpreter: bool) -> dict:
    """{direction: TileConfig} of the portable kernels. On a GPU: the first candidate (what
    runs untuned, ATTNCC_TUNE=0; autotuning may pick another), or ATTNCC_CONFIG's pin.
    Under the interpreter: what tuning.config_for picks there."""
    from ..runtime import tuning
    kernel = SimpleNamespace(variant=variant, pinned_config=None)
    problem = SimpleNamespace(dim=head_dim, group=1, len_q=1, len_k=1)
    out = {}
    for d in kernel_directions(source):
        if interpreter or os.environ.get("ATTNCC_CONFIG"):
            with _env("TRITON_INTERPRET", "1" if interpreter else None):
                out[d] = tuning.config_for(kernel, problem, torch.float16, d)
        else:
            out[d] = backends.portable().candidates(d, head_dim, variant)[0]
    return out


def _configs_text(chosen: dict) -> str:
    return ", ".join(f"{d} {c.sentence()}" for d, c in chosen.items())


# Modules a written NAME.py would hide from imports in its directory (itself importing
# torch and triton), besides the standard library's.
_IMPORTED = {"torch", "triton", "attncc", "numpy", "jinja2", "sympy", "lark", "transformers"}


def check_module_name(name: str) -> None:
    """NAME.py must import as `import NAME` and hide no module beside it."""
    import keyword
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise AttnccError(f"the variant is named '{name}', a Python keyword, so {name}.py "
                          "cannot be imported as `import " + name + "`; rename the variant")
    if name in _IMPORTED or name in sys.stdlib_module_names:
        raise AttnccError(f"the variant is named '{name}', so {name}.py would hide the module "
                          f"'{name}' from imports in its directory (the file itself imports "
                          "torch and triton); rename the variant")


def compile_command(args) -> int:
    variant = load(args.spec)
    check_module_name(variant.name)
    if args.len is not None and not 1 <= args.len <= MAX_COMPILE_ESTIMATE_LEN:
        raise AttnccError(f"--len {args.len}: the tile estimate evaluates the dense mask, so it "
                          f"takes lengths 1 to {MAX_COMPILE_ESTIMATE_LEN}; at longer ones, "
                          "kernel.density(q, k, v, ...) measures it from the tile tables")
    portable = backends.portable()
    requested = getattr(args, "backend", portable.name)
    # The other backends whose modules are written beside the portable one, and why one
    # cannot take the variant.
    others = {b: b.supports(variant) for b in backends.preferred()
              if requested in ("auto", b.name)}
    for backend, why in others.items():
        if requested == backend.name and why is not None:  # before anything is written
            raise AttnccError(f"--backend {backend.name} cannot compile this: {why}; use "
                              f"--backend auto or {portable.name}")
    gen = portable.render(variant)
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir() or out_dir.is_symlink() and not out_dir.exists():
        raise AttnccError(f"-o {out_dir}: not a directory; name a directory to write "
                          f"{variant.name}.py into (it is made if missing)")
    created = not out_dir.exists()  # -o makes a missing directory, parents included
    path = out_dir / f"{variant.name}.py"
    try:
        written = write_if_changed(path, gen.source)
    except OSError as err:
        raise AttnccError(f"cannot write {path}: {err.strerror or err}") from None
    print(f"variant   {variant.name}")
    state = ("written" if written else "unchanged") + (f", created {out_dir}" if created else "")
    print(f"module    {path} ({state}; {portable.module_note})")
    print(f"strategy  {gen.strategy}")
    for backend, why in others.items():
        _write_backend_module(backend, variant, out_dir, requested, why, gen.source)
    from ..analysis.bounds import plan_loops
    from ..codegen.decode import decode_strategy
    print(f"decoding  {decode_strategy(variant, plan_loops(variant, 'k'))} (kernel.decode)")
    pinned = os.environ.get("ATTNCC_CONFIG")
    gpu = chosen_configs(variant, gen.source, ASSUMED_HEAD_DIM, interpreter=False)
    # Wider head dims take other tiles: 192 is held as 128 + 64 (tiles.WIDE_SEGMENTS),
    # 256 as itself.
    wider = {label: chosen_configs(variant, gen.source, dim, interpreter=False)
             for label, dim in (("192 (128 + 64)", 192), ("256", 256))}
    interp = chosen_configs(variant, gen.source, ASSUMED_HEAD_DIM, interpreter=True)
    from ..runtime import tuning
    if pinned:
        note = " (pinned by ATTNCC_CONFIG)"
    elif hasattr(tuning, "tune"):
        note = " (untuned first choice; the first call autotunes unless ATTNCC_TUNE=0)"
    else:
        note = ""
    print(f"tiles     GPU{note}: {_configs_text(gpu)}")
    for label, configs in wider.items():
        if configs != gpu:
            print(f"          GPU, head dim {label}: {_configs_text(configs)}")
    print(f"          interpreter: {_configs_text(interp)}")
    if args.len is not None:
        n = args.len
        hq, hkv = default_heads(variant, 1)
        p = Problem(batch=1, heads_q=hq, heads_kv=hkv, len_q=n, len_k=n, dim=ASSUMED_HEAD_DIM,
                    dim_v=ASSUMED_HEAD_DIM)
        allowed = dense_allowed(variant, p, sample_inputs(variant, p, seed=0))
        density = allowed.float().mean().item()
        bm, bn = gpu["fwd"].block_m, gpu["fwd"].block_n
        visited, total = tile_visit_fraction(allowed, bm, bn)
        line = (f"visited   at len {n}: {visited / total:.3f} of the {bm}x{bn} forward tiles "
                f"({visited:g} of {total}); allowed pairs {density:.3f}")
        if variant.inputs:
            line += " (sample inputs: seeded random)"
        print(line)
    return 0


def _write_backend_module(backend, variant: ir.Variant, out: Path, requested: str,
                          why: str | None, source: str):
    """--backend NAME|auto: another backend's module beside the portable one (which it may
    need: tile tables, argument values, the backward). Rendering needs no GPU. `why`: why
    the backend cannot take the variant (then auto says so and writes nothing more)."""
    portable = backends.portable()
    if why is not None:
        print(f"backend   auto: the {portable.title} kernels, since {why}")
        return
    gen = backend.render(variant)
    path = out / f"{variant.name}_{backend.name}.py"
    try:
        written = write_if_changed(path, gen.source)
    except OSError as err:
        raise AttnccError(f"cannot write {path}: {err.strerror or err}") from None
    print(f"{backend.name:<10}{path} ({'written' if written else 'unchanged'}; "
          f"{backend.module_note})")
    if requested == backend.name:
        print(f"backend   {backend.name} {backend.forced_note}")
    else:
        print(f"backend   auto: the {backend.title} {backend.auto_note}, else the "
              f"{portable.title} kernels")
    if "bwd" in kernel_directions(source):
        print(f"          backward: dK/dV and dQ in one {portable.title} launch (tile tables; "
              f"ATTNCC_BACKWARD=sequential runs them apart, on the {backend.title} kernels)")
    for direction in ("fwd", "dq", "dkdv"):
        kept = backend.candidates(direction, ASSUMED_HEAD_DIM, variant)
        if kept:
            kernel = "" if direction == "fwd" else f" {KERNEL_NAMES[direction]}"
            print(f"          {backend.title}{kernel} tiles (head dim {ASSUMED_HEAD_DIM}): "
                  + ", ".join(c.sentence() for c in kept[:4]))
