"""Peak GPU memory of forward + backward against sequence length (should be linear).

    python benchmarks/memory.py [--lens 8192,32768,131072]

Causal document mask (64 documents), 8 heads, head dim 128, bf16, batch 1: the shape
of the ANCHORS.md memory row. "extra" is the peak during fwd+bwd minus the memory
held before it (q, k, v, dO and the inputs), so it counts what attncc allocates:
the output, LSE, delta, gradients, tile tables and summaries.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("ATTNCC_TUNE", "0")  # memory, not speed: no tuning compiles
import attncc  # noqa: E402

SPEC = ("attention document { input doc_q: i32[q] input doc_k: i32[k] "
        "mask doc_q[q] == doc_k[k] and q >= k }")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="8192,32768,131072")
    args = ap.parse_args()
    kernel = attncc.compile(SPEC)
    rows = []
    for L in (int(x) for x in args.lens.split(",")):
        torch.cuda.empty_cache()
        q, k, v = (torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16)
        doc = (torch.arange(L, device="cuda") * 64 // L).to(torch.int32)
        torch.autograd.grad(kernel(q, k, v, doc_q=doc, doc_k=doc), (q, k, v), do)  # compile, cache
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(kernel(q, k, v, doc_q=doc, doc_k=doc), (q, k, v), do)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        rows.append(dict(len=L, extra_mib=extra, qkv_mib=3 * q.numel() * 2 / 2 ** 20))
        print(f"S={L:7d}: peak extra memory fwd+bwd {extra:8.1f} MiB "
              f"(q, k, v together {rows[-1]['qkv_mib']:.0f} MiB)", flush=True)
        del q, k, v, do, grads
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    json.dump(rows, open(os.path.join(out, "memory.json"), "w"), indent=1)
    for a, b in zip(rows, rows[1:]):
        print(f"{a['len']} -> {b['len']}: x{b['len'] / a['len']:.0f} tokens, "
              f"x{b['extra_mib'] / a['extra_mib']:.2f} memory")


if __name__ == "__main__":
    main()
