"""Compile the portable kernels for sm_90 without a GPU, at the configs the runtime may pick.

The stand-in driver of benchmarks/gluon_compile.py tells Triton the target is an sm_90
GPU; each launch becomes a compile, all the way through Triton's bundled ptxas. What
this catches before any GPU time: a config the tuner may pick that the compiler cannot
compile (ptxas crashed with SIGSEGV on some forward and dQ configs at head dims 16 and 32
under Triton 3.6: backends/portable/tiles.py, keep()). The candidates are those keep() lets
through; the shipped winners must be among them (runtime/configs.py, usable).

    python benchmarks/portable_compile.py [examples/causal.attn ...] [--dims 16,32,64]
        [--dtypes float16,bfloat16] [--directions fwd,dq,dkdv] [--all-configs] [--dim-v 128]
    python benchmarks/portable_compile.py --mla [--nq 1,4]

--resources adds each kernel's registers and spills (`ptxas -v`). --mla compiles MLA
decoding's candidates instead (B=32, 128 heads on one latent head,
576/512 with v = k[..., :512], bf16, a 32K cache: runtime/decoding.py's candidates) and
prints each decode_split's shared memory, registers and spills (`ptxas -v`: the
ptxas bundled with Triton 3.6 reads its PTX; 3.9's may not).

Exits 1 if any compile failed. Runs with whichever Triton is importable.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attncc  # noqa: E402
from attncc.arguments import Problem  # noqa: E402
from attncc import backends  # noqa: E402
from attncc.runtime import tuning  # noqa: E402
from attncc.semantics.samples import sample_inputs  # noqa: E402
from gluon_compile import Sm90Driver, _compile_only, _ptxas_report  # noqa: E402

DIMS = "16,32,48,64,80,96,128,192,256"


def launches(module, variant, dim: int, dtype, dim_v: int) -> dict:
    """{direction: run(config)} on CPU tensors of a small awkward shape (GQA 4/2, 300)."""
    q = torch.randn(1, 4, 300, dim, dtype=dtype)
    k, v = torch.randn(1, 2, 300, dim, dtype=dtype), torch.randn(1, 2, 300, dim_v, dtype=dtype)
    dout = torch.randn(1, 4, 300, dim_v, dtype=dtype)
    inputs = sample_inputs(variant, Problem(1, 4, 2, 300, 300, dim, dim_v))
    lse, delta = torch.randn(1, 4, 300), torch.randn(1, 4, 300)
    runs = {"fwd": lambda c: module.forward(q, k, v, inputs, config=c),
            "dq": lambda c: module.backward_dq(q, k, v, lse, delta, dout, inputs, config=c, out=dout),
            "dkdv": lambda c: module.backward_dkdv(q, k, v, lse, delta, dout, inputs, config=c)}
    if module.USES_TABLES:
        runs["bwd"] = lambda c: module.backward_one_launch(q, k, v, lse, delta, dout, inputs, config=c)
    return runs


def mla_decode(n_qs: list, compiled: list) -> int:
    """Compile decode_split at each MLA decoding candidate; the number that failed."""
    from attncc.runtime import decoding
    kernel = attncc.compile("attention mla { scale 1.0 / sqrt(192.0)  mask q >= k }")
    B, H, E, Ev, dtype = 32, 128, 576, 512, torch.bfloat16
    latent = torch.empty(B, 1, 1024, E, dtype=dtype)  # the kernel does not specialise on capacity
    seqlens = torch.full((B,), 1000, dtype=torch.int32)
    failures = 0
    for n_q in n_qs:
        q = torch.empty(B, H, n_q, E, dtype=dtype)
        p = decoding.DecodeProblem(B, H, 1, n_q, 0, E, 32768, 0, Ev, v_is_k=True)
        for config in decoding.candidates(kernel.variant, p, 2, 132, lambda bn: 32768 // bn):
            label = f"mla decode n_q {n_q} {decoding.label(config)}"
            compiled.clear()
            try:
                kernel.module.decode(q, latent, latent[..., :Ev], seqlens, {}, config=config)
                split = next(ck for ck in compiled if ck.name.startswith("decode_split"))
                print(f"{label}: ok, smem {split.metadata.shared} B, "
                      f"{_ptxas_report(split.asm['ptx'])}", flush=True)
            except Exception as e:  # report and go on: the point is the whole list
                failures += 1
                lines = [x for x in str(e).strip().splitlines() if x.strip()]
                print(f"{label}: FAILED {type(e).__name__}: {lines[-1][:300] if lines else ''}",
                      flush=True)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--dims", default=DIMS)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--directions", default="fwd,dq,dkdv,bwd")
    ap.add_argument("--all-configs", action="store_true",
                    help="every kept candidate, not only the ones the tuner times")
    ap.add_argument("--dim-v", type=int, default=None,
                    help="v's head dim (default: each q·k head dim)")
    ap.add_argument("--mla", action="store_true", help="MLA decoding's candidates instead")
    ap.add_argument("--nq", default="1,4", help="with --mla: new tokens per row")
    ap.add_argument("--resources", action="store_true",
                    help="each kernel's registers and spills as ptxas -v reports them")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    specs = args.specs or [str(root / "examples" / "causal.attn")]
    triton.runtime.driver.set_active(Sm90Driver())
    compiled: list = []
    _compile_only(compiled)
    failures = 0
    print(f"triton {triton.__version__}", flush=True)
    if args.mla:
        failures = mla_decode([int(n) for n in args.nq.split(",")], compiled)
        print(f"{failures} failed")
        return 1 if failures else 0
    for spec in specs:
        variant = attncc.load(spec)
        module = attncc.compile(variant).module
        # The module takes tanh.approx where CUDA is there (APPROX_TANH reads
        # torch.cuda.is_available(), False on this CPU): compile what the GPU runs.
        if hasattr(module, "APPROX_TANH"):
            module.APPROX_TANH = triton.language.constexpr(True)
        for dim in (int(d) for d in args.dims.split(",")):
            for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
                dim_v = args.dim_v or dim
                for direction, run in launches(module, variant, dim, dtype, dim_v).items():
                    if direction not in args.directions.split(","):
                        continue
                    kept = backends.portable().candidates(direction, max(dim, dim_v), variant)
                    for config in kept if args.all_configs else kept[:tuning.TUNE_AT_MOST]:
                        label = (f"{variant.name} {direction} d{dim} v{dim_v} {str(dtype)[6:]} "
                                 f"{config.label()}")
                        start = time.perf_counter()
                        try:
                            before = len(compiled)
                            run(config.as_dict())
                            report = ""
                            if args.resources and len(compiled) > before:
                                report = ", " + _ptxas_report(compiled[-1].asm["ptx"])
                            print(f"{label}: ok ({time.perf_counter() - start:.1f} s{report})",
                                  flush=True)
                        except Exception as e:  # report and go on: the point is the whole list
                            failures += 1
                            lines = [x for x in str(e).strip().splitlines() if x.strip()]
                            print(f"{label}: FAILED {type(e).__name__}: {lines[0][:200] if lines else ''}",
                                  flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
