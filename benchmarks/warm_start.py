"""Cold and warm start: where the seconds go from a new process to the first result.

    python benchmarks/warm_start.py              # run twice: the second run is warm
    python benchmarks/warm_start.py --profile F  # also write cProfile stats of the attncc phases

The first run in a fresh cache compiles and tunes; the second finds the generated
module, the tuned configs (attncc's cache) and Triton's compiled kernels on disk.
Phases are timed apart, each ending in a device synchronisation: `import torch`, CUDA
initialisation (which any GPU program pays), `import attncc`, `attncc.compile`, the
first forward and the first backward (causal, S = 4096, bf16). For scale, the same
process then times the first call of SDPA's cuDNN and flash backends on new shapes.
Python's bytecode cache counts too: run it with PYTHONDONTWRITEBYTECODE unset (the GPU
image sets it) and, where the tree is read-only, PYTHONPYCACHEPREFIX on a writable path.
"""
import argparse
import os
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--profile", help="write cProfile stats of compile + first fwd/bwd here")
args = parser.parse_args()

clock = time.perf_counter
phases = {}
start = clock()
import torch  # noqa: E402
phases["import torch"] = clock() - start

t = clock()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
phases["CUDA init"] = clock() - t
q, k, v = (torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
torch.cuda.synchronize()

profiler = None
if args.profile:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()

t = clock()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402
phases["import attncc"] = clock() - t

t = clock()
kernel = attncc.compile("attention causal { mask q >= k }")
phases["attncc.compile"] = clock() - t

t = clock()
out = kernel(q, k, v)
torch.cuda.synchronize()
phases["first forward"] = clock() - t

t = clock()
out.sum().backward()
torch.cuda.synchronize()
phases["first backward"] = clock() - t

if profiler:
    profiler.disable()
    profiler.dump_stats(args.profile)

attncc_total = sum(phases[p] for p in ("import attncc", "attncc.compile", "first forward",
                                       "first backward"))
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
    q2, k2, v2 = (x.detach()[:, :, :2048].clone().requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    t = clock()
    with sdpa_kernel(backend):
        o = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
        o.sum().backward()
    torch.cuda.synchronize()
    phases[f"{name} first fwd+bwd"] = clock() - t

for name, seconds in phases.items():
    print(f"{name:28s} {seconds:7.3f} s")
print(f"{'attncc, import to result':28s} {attncc_total:7.3f} s")
