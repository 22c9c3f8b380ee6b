"""A/B on the GPU: generated modules before and after the parameter trimming of
codegen/parameters.py (run 104). The two module files are rendered on the CPU from the
two commits into .ab/ ({full,causal}_{old,new}.py); each is swapped into the same Kernel
(the same shipped configs) and forward + backward are timed interleaved, rounds of
do_bench medians, on the same inputs; outputs must match bit for bit."""
import importlib.util
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import attncc  # noqa: E402

SPECS = {"full": "attention full { }", "causal": "attention causal { mask q >= k }"}


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rows = []
for name, text in SPECS.items():
    kernel = attncc.compile(text, backend="triton")
    generated = kernel._generated[0]
    modules = {v: load(f".ab/{name}_{v}.py", f"ab_{name}_{v}") for v in ("old", "new")}
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 16384, 128, generator=gen).cuda().bfloat16() for _ in range(4))
    qkv = [t.requires_grad_() for t in (q, k, v)]
    results, times = {}, {"old": {"fwd": [], "fwd_bwd": []}, "new": {"fwd": [], "fwd_bwd": []}}
    for which, module in modules.items():
        kernel._generated = (generated, module)
        out = kernel(*qkv)
        results[which] = [out, *torch.autograd.grad(out, qkv, do)]
    same = all(torch.equal(a, b) for a, b in zip(results["old"], results["new"]))
    for _ in range(3):
        for which, module in modules.items():
            kernel._generated = (generated, module)
            with torch.no_grad():
                times[which]["fwd"].append(triton.testing.do_bench(lambda: kernel(*qkv), rep=200, return_mode="median"))
            times[which]["fwd_bwd"].append(triton.testing.do_bench(
                lambda: torch.autograd.grad(kernel(*qkv), qkv, do), rep=300, return_mode="median"))
    row = (name, same, {w: {p: sorted(ts)[1] for p, ts in t.items()} for w, t in times.items()}, times)
    rows.append(row)
    print(name, "bit-identical" if same else "DIFFER", row[2], flush=True)
print("\n| variant | outputs | old fwd | new fwd | old fwd+bwd | new fwd+bwd |")
for name, same, med, _ in rows:
    print(f"| {name} | {'identical' if same else 'DIFFER'} | {med['old']['fwd']:.3f} | {med['new']['fwd']:.3f} "
          f"| {med['old']['fwd_bwd']:.3f} | {med['new']['fwd_bwd']:.3f} |")
