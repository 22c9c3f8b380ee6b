"""Compile the Gluon backend's kernels for sm_90 without a GPU, and report their resources.

A stand-in driver tells Triton the target is an sm_90 GPU; each launch in the generated
module becomes a compile (warmup), on CPU tensors, all the way to a cubin through
Triton's bundled ptxas. What this catches before any GPU time is spent: Gluon type and
layout errors, shared memory over the limit, register spills (from `ptxas -v`).
It proves nothing about the results: that is benchmarks/gluon_check.py's job, on the GPU.

For each forward kernel it also reads the machine code (SASS, from the cubin by Triton's
bundled nvdisasm) and counts, in each tile loop, the exp2s (MUFU.EX2) between the wait
for the scores S_i = Q K_i^T (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the wait for the last
tile's P V product (... 0x0): the softmax of tile i runs under P_{i-1} V_{i-1} only if
they sit there, and ptxas is free to move the waits (it did: benchmarks/RESULTS.md,
the forward's overlap). A kernel that spills inside its tile loops fails (its stack,
where ptxas keeps a scalar or two across the loops, is shown); with --require-overlap,
so does a loop with fewer than the tile's exp2s there.

    python benchmarks/gluon_compile.py [examples/causal.attn ...] [--dims 64,128,256] [--backward]
                                        [--all-configs] [--require-overlap]

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attncc  # noqa: E402
from attncc import backends
from attncc.backends.gluon import tiles
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


def _ptxas_report(ptx: str) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        target = re.search(r"\.target\s+(sm_\w+)", ptx)
        arch = target.group(1) if target else "sm_90a"
        out = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not (regs and spill):
        return f"ptxas -v said: {text.strip()[:200]}"
    return f"{regs.group(1)} regs, spills {spill.group(1)}/{spill.group(2)} B"


def disassemble(cubin: bytes) -> str:
    """The cubin's SASS, by the nvdisasm bundled with the importable Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def stack_bytes(cubin: bytes) -> int:
    """The kernel's stack frame (cuobjdump's resource usage): these kernels keep no
    local arrays, so anything there is spilled registers."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return max(int(n) for n in re.findall(r"STACK:(\d+)", out))


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BACK_BRANCH = re.compile(r"^@!?U?P\w+\s+BRA\s.*`\((\.L_x_\d+)\)")
_S_WAIT, _PV_WAIT = "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0"


def softmax_overlap(sass: str) -> list:
    """For each tile loop of a forward kernel (a conditional branch back to a label,
    around wgmma and no exit; a mbarrier's retry loop holds no wgmma), (exp2s between
    its S wait and the next P V wait, exp2s in the loop, spill loads and stores in the
    loop; None for the first where the loop has no S wait of its own). The loop body is
    read as a cycle: ptxas may rotate it, so the P V wait can
    come first in the listing."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
        found = _INSTRUCTION.search(line)
        if found:
            instructions.append(found.group(2))
    loops = []
    for end, text in enumerate(instructions):
        branch = _BACK_BRANCH.match(text)
        start = labels.get(branch.group(1)) if branch else None
        if start is None or start > end:
            continue
        body = instructions[start:end + 1]
        if not any(t.startswith("HGMMA") for t in body) or any(t == "EXIT" for t in body):
            continue
        between = None  # a loop that waits for S and P V at once overlaps nothing
        if _S_WAIT in body and _PV_WAIT in body:
            at, between = body.index(_S_WAIT), 0
            for step in range(1, len(body)):
                text = body[(at + step) % len(body)]
                if text == _PV_WAIT:
                    break
                between += text.startswith("MUFU.EX2")
        loops.append((between, sum(t.startswith("MUFU.EX2") for t in body),
                      sum(t.startswith(("LDL", "STL")) for t in body)))
    return loops


def overlap_failures(loops: list, exp2s_per_tile: int) -> list:
    """The loops that wait for S apart from P V but not all of the tile's exp2s between
    (a loop that waits for both at once, a partial tiles' one, is meant to)."""
    return [loop for loop in loops if loop[0] is not None and loop[0] < exp2s_per_tile]


def loop_spills(loops: list) -> int:
    """Spill loads and stores inside the tile loops, where they cost every step."""
    return sum(loop[2] for loop in loops)


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _check_forward(ck, config: dict, require_overlap: bool) -> int:
    """Print the forward's exp2s under P V per tile loop and its stack; 1 if it spills,
    or (`require_overlap`) if a loop's softmax does not run under P V."""
    cubin = ck.asm["cubin"]
    loops = softmax_overlap(disassemble(cubin))
    # Each of a consumer warpgroup's 128 threads computes its share of the warpgroup's
    # rows of P: the warp-specialized kernel has two consumers, the other num_warps / 4.
    warpgroups = 2 if config["num_warps"] == tiles.WS_WARPS else config["num_warps"] // 4
    per_tile = config["BLOCK_M"] // warpgroups * config["BLOCK_N"] // 128
    stack, in_loops = stack_bytes(cubin), loop_spills(loops)
    bad = overlap_failures(loops, per_tile) or not any(loop[0] is not None for loop in loops)
    shown = " ".join(f"{'-' if between is None else between}/{total}" for between, total, _ in loops)
    print(f"    exp2s under P V per tile loop (of {per_tile} per tile; -: waits for both at once): {shown or 'no loop found'}"
          f"{' (OVERLAP LOST)' if bad else ''}; stack {stack} B, "
          f"{in_loops} spill loads/stores in the tile loops{' (SPILLS)' if in_loops else ''}")
    return int(in_loops > 0 or (require_overlap and bool(bad)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--dims", default="128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--all-configs", action="store_true", help="every candidate, not the first")
    ap.add_argument("--backward", action="store_true", help="the dK/dV kernel too")
    ap.add_argument("--require-overlap", action="store_true",
                    help="fail a forward whose softmax does not run under P V in every tile loop "
                         "(a plan of two segments keeps one loop, which loses it)")
    args = ap.parse_args()
    specs = args.specs or sorted(glob.glob(str(Path(__file__).resolve().parent.parent / "examples" / "*.attn")))
    triton.runtime.driver.set_active(Sm90Driver())
    compiled: list = []
    _compile_only(compiled)
    out_dir = Path(tempfile.mkdtemp(prefix="attncc-gluon-"))
    failures = 0
    print(f"triton {triton.__version__}; modules in {out_dir}")
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
        _, host = load_generated(variant)
        for dim in (int(d) for d in args.dims.split(",")):
            heads = (variant.heads.q, variant.heads.kv) if variant.heads else (4, 2)
            dtype = getattr(torch, args.dtype)
            q = torch.randn(1, heads[0], 300, dim, dtype=dtype)
            k = torch.randn(1, heads[1], 300, dim, dtype=dtype)
            v = torch.randn_like(k)
            p = Problem(1, heads[0], heads[1], 300, 300, dim, dim, 0, 0)
            inputs = sample_inputs(variant, p)
            lse = torch.randn(1, heads[0], 300)
            delta = torch.randn(1, heads[0], 300)
            dout = torch.randn_like(q)
            kernels = [("", _dicts(tiles.candidates(dim)),
                        lambda c: module.forward(q, k, v, inputs, config=c))]
            if args.backward:
                kernels += [
                    (" dK/dV", _dicts(tiles.backward_candidates(dim)),
                     lambda c: module.backward_dkdv(q, k, v, lse, delta, dout, inputs,
                                                    config=c)),
                    (" dQ", _dicts(tiles.dq_candidates(dim)),
                     lambda c: module.backward_dq(q, k, v, lse, delta, dout, inputs,
                                                  config=c, out=dout))]
            for what, configs, launch in kernels:
                for config in configs if args.all_configs else configs[:1]:
                    label = (f"{variant.name}{what} d{dim} {config['BLOCK_M']}x{config['BLOCK_N']} "
                             f"w{config['num_warps']} s{config['num_stages']}")
                    compiled.clear()
                    try:
                        launch(config)
                        ck = compiled[-1]
                        print(f"{label}: ok, smem {ck.metadata.shared} B, {_ptxas_report(ck.asm['ptx'])}")
                        if not what:  # the forward: its overlap, and no spills
                            failures += _check_forward(ck, config, args.require_overlap)
                    except Exception as e:  # report and go on: the point is the whole list
                        failures += 1
                        msg = str(e).strip().splitlines()
                        print(f"{label}: FAILED {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}")
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
