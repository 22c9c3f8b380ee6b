"""Compile the Gluon backend's kernels for sm_90 without a GPU, and report their resources.

A stand-in driver tells Triton the target is an sm_90 GPU; each launch in the generated
module becomes a compile (warmup), on CPU tensors, all the way to a cubin through
Triton's bundled ptxas. What this catches before any GPU time is spent: Gluon type and
layout errors, shared memory over the limit, register spills (from `ptxas -v`).
It proves nothing about the results: that is benchmarks/gluon_check.py's job, on the GPU.

    python benchmarks/gluon_compile.py [examples/causal.attn ...] [--dims 64,128,256] [--backward]
    python benchmarks/gluon_compile.py examples/causal.attn --dims 192:128 --all-configs

(--dims: "D" for q, k, v all D wide, "D:DV" for v DV wide; --backward compiles the dQ,
dK/dV and fused backward kernels at the dims the Gluon backend takes them, and names the
fused backward's dQ add under this Triton.)

Runs with whichever Triton is importable (put another first on PYTHONPATH to try it).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attncc  # noqa: E402
from attncc import backends
from attncc.backends.base import FUSED
from attncc.backends.gluon import fused_dq_add, kernel_unsupported, tiles
from attncc.arguments import Problem
from attncc.runtime.cache import load_generated
from attncc.semantics.samples import sample_inputs


class Sm90Driver:
    """Just enough of a driver for JITFunction.run(warmup=True): the target, no device."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):
        raise AttributeError(f"the offline sm_90 driver has no {name}")



def _dicts(configs):
    """Tile configs as the dicts a generated module's config= takes."""
    return [c.as_dict() for c in configs]

def _compile_only(compiled: list):
    """Turn `kernel[grid](...)` into a compile that records the CompiledKernel."""
    def getitem(self, grid):
        def launch(*args, **kwargs):
            compiled.append(self.run(*args, grid=grid, warmup=True, **kwargs))
        return launch
    triton.runtime.jit.KernelInterface.__getitem__ = getitem


def ptxas_resources(ptx: str):
    """(registers, spill store bytes, spill load bytes) of a kernel's PTX as ptxas -v
    reports them for its target, or ptxas's words where it said no such thing."""
    # The ptxas Triton compiles with first; where its PTX is newer than that one reads
    # (Triton 3.9's fixed bin/ptxas), its ptxas-blackwell (CUDA 13) reads it, sm_90 too.
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        target = re.search(r"\.target\s+(sm_\w+)", ptx)
        arch = target.group(1) if target else "sm_90a"
        for ptxas in (Path(get_ptxas(90).path), bin_dir / "ptxas-blackwell"):
            out = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o",
                                  str(Path(d) / "k.o")], capture_output=True, text=True)
            if "Unsupported .version" not in out.stderr:
                break
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not (regs and spill):
        return f"ptxas -v said: {text.strip()[:200]}"
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def _ptxas_report(ptx: str) -> str:
    resources = ptxas_resources(ptx)
    if isinstance(resources, str):
        return resources
    return "%d regs, spills %d/%d B" % resources


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--all-configs", action="store_true", help="every candidate, not the first")
    ap.add_argument("--backward", action="store_true",
                    help="the dQ, dK/dV and fused backward kernels too")
    args = ap.parse_args()
    specs = args.specs or sorted(glob.glob(str(Path(__file__).resolve().parent.parent / "examples" / "*.attn")))
    triton.runtime.driver.set_active(Sm90Driver())
    compiled: list = []
    _compile_only(compiled)
    out_dir = Path(tempfile.mkdtemp(prefix="attncc-gluon-"))
    failures = 0
    print(f"triton {triton.__version__}; modules in {out_dir}")
    if args.backward:
        print(f"fused backward's dQ add: {fused_dq_add()}")
    for spec in specs:
        variant = attncc.parse_file(spec)
        why = backends.named("gluon").supports(variant)
        if why:
            print(f"{variant.name}: not taken ({why})")
            continue
        gen = backends.named("gluon").render(variant)
        path = out_dir / f"{gen.module_name}.py"
        path.write_text(gen.source)
        module = _import(path, gen.module_name)
        # The module takes tanh.approx where CUDA is there (APPROX_TANH reads
        # torch.cuda.is_available(), False on this CPU): compile what the GPU runs.
        if hasattr(module, "APPROX_TANH"):
            module.APPROX_TANH = triton.language.constexpr(True)
        _, host = load_generated(variant)
        for dims in args.dims.split(","):
            d, _, dv = dims.partition(":")
            dim, dim_v = int(d), int(dv or d)
            heads = (variant.heads.q, variant.heads.kv) if variant.heads else (4, 2)
            dtype = getattr(torch, args.dtype)
            q = torch.randn(1, heads[0], 300, dim, dtype=dtype)
            k = torch.randn(1, heads[1], 300, dim, dtype=dtype)
            v = torch.randn(1, heads[1], 300, dim_v, dtype=dtype)
            p = Problem(1, heads[0], heads[1], 300, 300, dim, dim_v, 0, 0)
            inputs = sample_inputs(variant, p)
            lse = torch.randn(1, heads[0], 300)
            delta = torch.randn(1, heads[0], 300)
            dout = torch.randn(1, heads[0], 300, dim_v, dtype=dtype)
            kernels = [("", _dicts(backends.named("gluon").candidates("fwd", p.tile_dim, variant)),
                        lambda c: module.forward(q, k, v, inputs, config=c))]
            if args.backward and not kernel_unsupported(variant, "dkdv", dim, dim_v):
                kernels += [
                    (" dK/dV", _dicts(tiles.backward_candidates(p.tile_dim)),
                     lambda c: module.backward_dkdv(q, k, v, lse, delta, dout, inputs,
                                                    config=c)),
                    (" dQ", _dicts(tiles.dq_candidates(p.tile_dim)),
                     lambda c: module.backward_dq(q, k, v, lse, delta, dout, inputs,
                                                  config=c, out=dout))]
            if args.backward and not kernel_unsupported(variant, FUSED, dim, dim_v):
                kernels += [(" fused", _dicts(tiles.fused_candidates(dim)),
                             lambda c: module.backward_fused(q, k, v, lse, delta, dout, inputs,
                                                             config=c))]
            for what, configs, launch in kernels:
                for config in configs if args.all_configs else configs[:1]:
                    label = (f"{variant.name}{what} d{dims} {config['BLOCK_M']}x{config['BLOCK_N']} "
                             f"w{config['num_warps']} s{config['num_stages']}")
                    compiled.clear()
                    try:
                        launch(config)
                        ck = compiled[-1]
                        print(f"{label}: ok, smem {ck.metadata.shared} B, {_ptxas_report(ck.asm['ptx'])}")
                    except Exception as e:  # report and go on: the point is the whole list
                        failures += 1
                        msg = str(e).strip().splitlines()
                        print(f"{label}: FAILED {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}")
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
