"""The SASS of the portable kernels' key and query loops, counted per tile, without a GPU.

Compiles the forward, dQ and dK/dV kernels of each spec for sm_90 at the first config the
tuner tries (what ATTNCC_TUNE=0 runs), head dim 128, bf16, and reads each loop of the
cubin's SASS (a backward branch closes it): its instructions per thread, and those a
tile runs when it skips every branch over more than 100 instructions (the tile whose
relative reads each read one element skips the per-pair read and the table gradient's
per-diagonal sums: codegen/relative_reads.py, backends/portable/templates/backward.jinja),
with the counts that tell where the time goes: MUFU (exp2), F2I (float-to-int, a T5
bucket's int()), LDG and LDGSTS (global loads, cp.async), LDS, STL/LDL (spills), HGMMA.
A kernel's loops are its masked, full and masked tile loops, in that order.

    python benchmarks/sass_loops.py [--cases learned_alibi,t5_bidirectional] [spec.attn ...]

--cases names benchmarks/learnable_gradients.py's CASES. Runs with whichever Triton is
importable; the GPU machine's is 3.6 (/tmp/t36 where there is one). Each kernel takes
a minute of CPU.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attncc  # noqa: E402
from attncc import backends  # noqa: E402
from attncc.arguments import Problem  # noqa: E402
from attncc.semantics.samples import sample_inputs  # noqa: E402
from gluon_compile import Sm90Driver, _compile_only  # noqa: E402
from learnable_gradients import CASES  # noqa: E402

COUNTED = ("MUFU", "F2I", "LDG", "LDGSTS", "LDS", "STL", "LDL", "HGMMA", "FFMA", "BAR")
BRANCH_OVER = 100  # a forward branch over more instructions than this: a skippable region
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*)")


def sass_of(cubin: bytes) -> list:
    """(address, opcode, operands) of each instruction, from Triton's bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True).stdout
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(LINE.match, text.splitlines()) if m]


def _target(operands: str):
    found = re.search(r"0x([0-9a-f]+)", operands)
    return int(found.group(1), 16) if found else None


def loops(sass: list) -> list:
    """Per loop: (instructions, those a tile skipping the long branches runs, their counts)."""
    index = {addr: n for n, (addr, _, _) in enumerate(sass)}
    found = []
    for end, (addr, op, operands) in enumerate(sass):
        start = index.get(_target(operands)) if op.startswith("BRA") else None
        if start is None or start >= end:
            continue
        skipped = set()
        for n in range(start, end):
            op_n, to = sass[n][1], index.get(_target(sass[n][2]))
            if op_n.startswith("BRA") and to is not None and n < to <= end and to - n > BRANCH_OVER:
                skipped |= set(range(n + 1, to))
        ran = [sass[n][1].split(".")[0] for n in range(start, end + 1) if n not in skipped]
        found.append((end + 1 - start, len(ran), collections.Counter(ran)))
    return found


def kernels(variant) -> dict:
    """{direction: the CompiledKernel} at the first config, D=128 bf16, on CPU tensors."""
    module = attncc.compile(variant).module
    L, D, dtype = 1024, 128, torch.bfloat16
    q, k, v, do = (torch.randn(1, 2, L, D, dtype=dtype) for _ in range(4))
    inputs = sample_inputs(variant, Problem(1, 2, 2, L, L, D, D))
    lse, delta = torch.randn(1, 2, L), torch.randn(1, 2, L)
    runs = {"fwd": lambda c: module.forward(q, k, v, inputs, config=c),
            "dq": lambda c: module.backward_dq(q, k, v, lse, delta, do, inputs, config=c, out=do),
            "dkdv": lambda c: module.backward_dkdv(q, k, v, lse, delta, do, inputs, config=c)}
    compiled, out = [], {}
    _compile_only(compiled)
    for direction, run in runs.items():
        config = backends.portable().candidates(direction, D, variant)[0]
        compiled.clear()
        run(config.as_dict())
        out[direction] = (config.label(), compiled[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--cases", default="learned_alibi,t5_bidirectional")
    args = ap.parse_args()
    triton.runtime.driver.set_active(Sm90Driver())
    print(f"triton {triton.__version__}", flush=True)
    named = [(name, CASES[name]) for name in args.cases.split(",") if name]
    for name, spec in named + [(path, Path(path).read_text()) for path in args.specs]:
        for direction, (label, kernel) in kernels(attncc.load(spec)).items():
            for n, (size, ran, counts) in enumerate(loops(sass_of(kernel.asm["cubin"]))):
                print(f"{name} {direction} {label} loop {n}: {size} instructions, a tile "
                      f"skipping the long branches {ran}: "
                      + " ".join(f"{op}={counts[op]}" for op in COUNTED if counts[op]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
