"""Cold and warm start: seconds from a new process to the first forward+backward result.

    python benchmarks/warm_start.py            # run twice: the second run is warm

The first run in a fresh cache compiles and tunes; the second finds the generated
module, the tuned configs (attncc's cache) and Triton's compiled kernels on disk.
"""
import os
import sys
import time

start = time.perf_counter()
import torch  # noqa: E402

after_torch = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import attncc  # noqa: E402

kernel = attncc.compile("attention causal { mask q >= k }")
q, k, v = (torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
out = kernel(q, k, v)
out.sum().backward()
torch.cuda.synchronize()
end = time.perf_counter()
print(f"import torch {after_torch - start:.2f} s; attncc compile + first causal fwd+bwd "
      f"(S=4096) {end - after_torch:.2f} s")
