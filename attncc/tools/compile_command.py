"""`attncc compile`: write the standalone generated module and say what was decided:
skipping strategy, decoding's, tile sizes, and with --len the fraction of tiles visited.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import ir, load
from ..errors import AttnccError
from ..runtime import configs
from ..arguments import Problem
from ..runtime.cache import write_if_changed
from .density import dense_allowed, tile_visit_fraction
from ..semantics.samples import default_heads, sample_inputs

MAX_COMPILE_ESTIMATE_LEN = 8192   # `compile --len`: dense classification up to this length
ASSUMED_HEAD_DIM = 128            # `compile` reports tiles for this head dim (and 256 if they differ)


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
    then what runtime/settings.py's backward_directions decides for it (the one launch of
    table-driven modules, unless ATTNCC_BACKWARD=sequential, or dQ then dK/dV)."""
    from ..runtime.settings import backward_directions
    uses_tables = re.search(r"^USES_TABLES = True\b", source, re.M) is not None
    return ("fwd", *backward_directions(uses_tables))


def chosen_configs(variant: ir.Variant, source: str, head_dim: int, *, interpreter: bool) -> dict:
    """{direction: config}. On a GPU: the first candidate that keep() allows (what runs
    untuned, ATTNCC_TUNE=0; autotuning may pick another), or ATTNCC_CONFIG's pin.
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
            out[d] = configs.kept_candidates(variant, head_dim, d)[0]
    return out


def _configs_text(chosen: dict) -> str:
    return ", ".join(f"{d} {configs.sentence(c)}" for d, c in chosen.items())


def compile_command(args) -> int:
    from ..backends.portable.codegen import generate
    from ..backends.gluon import codegen as gluon
    variant = load(args.spec)
    if args.len is not None and not 1 <= args.len <= MAX_COMPILE_ESTIMATE_LEN:
        raise AttnccError(f"--len {args.len}: the tile estimate evaluates the dense mask, so it "
                          f"takes lengths 1 to {MAX_COMPILE_ESTIMATE_LEN}; at longer ones, "
                          "kernel.density(q, k, v, ...) measures it from the tile tables")
    backend = getattr(args, "backend", "triton")
    why = gluon.variant_unsupported(variant)
    if backend == "gluon" and why is not None:  # before anything is written
        raise AttnccError(f"--backend gluon cannot compile this: {why}; use --backend auto "
                          "or triton")
    gen = generate(variant)
    out_dir = Path(args.out)
    created = not out_dir.exists()  # -o makes a missing directory, parents included
    path = out_dir / f"{variant.name}.py"
    try:
        written = write_if_changed(path, gen.source)
    except OSError as err:
        raise AttnccError(f"cannot write {path}: {err.strerror or err}") from None
    print(f"variant   {variant.name}")
    state = ("written" if written else "unchanged") + (f", created {out_dir}" if created else "")
    print(f"module    {path} ({state}; imports only torch and triton)")
    print(f"strategy  {gen.strategy}")
    if backend != "triton":
        _write_gluon(variant, Path(args.out), backend, why, gen.source)
    from ..analysis.bounds import plan_loops
    from ..codegen.decode import decode_strategy
    print(f"decoding  {decode_strategy(variant, plan_loops(variant, 'k'))} (kernel.decode)")
    pinned = os.environ.get("ATTNCC_CONFIG")
    gpu = chosen_configs(variant, gen.source, ASSUMED_HEAD_DIM, interpreter=False)
    wide = chosen_configs(variant, gen.source, 256, interpreter=False)
    interp = chosen_configs(variant, gen.source, ASSUMED_HEAD_DIM, interpreter=True)
    from ..runtime import tuning
    if pinned:
        note = " (pinned by ATTNCC_CONFIG)"
    elif hasattr(tuning, "tune"):
        note = " (untuned first choice; the first call autotunes unless ATTNCC_TUNE=0)"
    else:
        note = ""
    print(f"tiles     GPU{note}: {_configs_text(gpu)}")
    if wide != gpu:
        print(f"          GPU, head dim > 128: {_configs_text(wide)}")
    print(f"          interpreter: {_configs_text(interp)}")
    if args.len is not None:
        n = args.len
        hq, hkv = default_heads(variant, 1)
        p = Problem(batch=1, heads_q=hq, heads_kv=hkv, len_q=n, len_k=n, dim=ASSUMED_HEAD_DIM,
                    dim_v=ASSUMED_HEAD_DIM)
        allowed = dense_allowed(variant, p, sample_inputs(variant, p, seed=0))
        density = allowed.float().mean().item()
        bm, bn = gpu["fwd"]["BLOCK_M"], gpu["fwd"]["BLOCK_N"]
        visited, total = tile_visit_fraction(allowed, bm, bn)
        line = (f"visited   at len {n}: {visited / total:.3f} of the {bm}x{bn} forward tiles "
                f"({visited:g} of {total}); allowed pairs {density:.3f}")
        if variant.inputs:
            line += " (sample inputs: seeded random)"
        print(line)
    return 0


def _write_gluon(variant: ir.Variant, out: Path, backend: str, why: str | None, source: str):
    """--backend gluon|auto: the Gluon forward beside the portable module (which it needs:
    tile tables, argument values, the backward). Rendering needs no GPU. `why`: why the
    Gluon backend cannot take the variant (then auto says so and writes nothing more)."""
    from ..backends.gluon import codegen as gluon
    if why is not None:
        print(f"backend   auto: the portable kernels, since {why}")
        return
    gen = gluon.generate(variant)
    path = out / f"{variant.name}_gluon.py"
    try:
        written = write_if_changed(path, gen.source)
    except OSError as err:
        raise AttnccError(f"cannot write {path}: {err.strerror or err}") from None
    print(f"gluon     {path} ({'written' if written else 'unchanged'}; the Hopper (sm_90) forward, "
          "dQ and dK/dV kernels; tile tables and argument values come from the module above)")
    if backend == "gluon":
        print("backend   gluon forward, dQ and dK/dV on an sm_90 GPU (refused elsewhere and under "
              "the interpreter)")
    else:
        print("backend   auto: the Gluon forward, dQ and dK/dV on an sm_90 GPU where the tuner "
              "times them faster than the portable ones, else the portable kernels")
    if "bwd" in kernel_directions(source):
        print("          backward: dK/dV and dQ in one portable launch (tile tables; "
              "ATTNCC_BACKWARD=sequential runs them apart, on the Gluon kernels)")
    print(f"          Gluon tiles (head dim {ASSUMED_HEAD_DIM}): "
          + ", ".join(configs.sentence(c) for c in gluon.candidates(ASSUMED_HEAD_DIM)[:4]))
    for name, kept in (("dQ", gluon.dq_candidates), ("dK/dV", gluon.backward_candidates)):
        print(f"          Gluon {name} tiles (head dim {ASSUMED_HEAD_DIM}): "
              + ", ".join(configs.sentence(c) for c in kept(ASSUMED_HEAD_DIM)))
