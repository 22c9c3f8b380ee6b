"""Each kernel alone at low tile density, over every tile config: where the time goes
when a program visits only a few tiles.

    python benchmarks/archive/low_density.py [--seq 16384] [--densities 0.03,0.06] [--extra 'fwd:64x64w4s2;...']
                                     [--edits prefetch1,fused_delta,...]

The density curve's layout (benchmarks/density_curve.py: random per-head 128-blocks,
the same number per row, diagonal included), S = 16384, H = 16, D = 128, bf16. For
each density, the forward, dK/dV and dQ kernels are timed on their own (module
functions, no autograd or tuner; do_bench median, same inputs) at every candidate
config that keep() allows, beside dense attention's time for the same kernel at its
best config. The line each kernel should stay under is the density curve's:
1.2 * d * dense + dense / blocks. Each output is checked against the first config's.
--edits times text edits of the generated module beside the unedited one, in the same
process (each checked against the unedited output): prefetch1/prefetch2 load the tile
index one or two iterations ahead; fused_delta computes delta = rowsum(dO * O) inside
the one-launch backward (kernel `bwd+delta`, against the delta kernel + one launch);
persistent/persistent_flat run the forward as a persistent kernel. RESULTS.md runs
64-67 measured all of them; none was adopted. Prints a table last; writes JSON to
$OUT/low_density.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # density_curve
import attncc  # noqa: E402
from attncc.runtime import configs, tuning
from density_curve import BLOCK, DENSE_SPEC, model_ms, random_layout, sparse_spec  # noqa: E402

# bwd: dK/dV and dQ in one launch (layouts only); bwd+delta: the delta kernel, then bwd
KERNELS = ("fwd", "dkdv", "dq", "bwd", "bwd+delta")
EXTRA: dict = {}  # kernel -> configs timed after the candidates (--extra)

# A table-driven loop of the generated module: the tile index is loaded in the step's
# own argument list.
TABLE_LOOP = re.compile(r"^( +)for i in range\(0, tl\.load\((\w+)_count \+ (\w+)\)\):\n"
                        r"( +)(.*)tl\.load\(\2_list \+ lists \+ i\)(.*)$", re.M)


def prefetch_edit(distance: int):
    """Load the tile index `distance` iterations ahead, carried in registers."""
    def edit(m):
        ind, kind, at, body, pre, post = m.groups()
        lines = [f"{ind}n_tiles = tl.load({kind}_count + {at})"]
        lines += [f"{ind}ahead{j} = tl.load({kind}_list + lists + {j}, mask={j} < n_tiles, other=0)"
                  for j in range(distance)]
        lines += [f"{ind}for i in range(0, n_tiles):", f"{body}tile_id = ahead0"]
        lines += [f"{body}ahead{j} = ahead{j + 1}" for j in range(distance - 1)]
        lines += [f"{body}ahead{distance - 1} = tl.load({kind}_list + lists + i + {distance}, "
                  f"mask=i + {distance} < n_tiles, other=0)",
                  f"{body}{pre}tile_id{post}"]
        return "\n".join(lines)
    return edit


def table_loops(edit):
    def apply(source):
        source, count = TABLE_LOOP.subn(edit, source)
        assert count == 6, f"expected 6 table loops, edited {count}"
        return source
    return apply


# Delta = rowsum(dO * O) inside the one-launch backward instead of its own kernel: each
# dK/dV step loads the O tile beside dO, each dQ program its own rows' O once. For the
# experiment the host passes O itself (contiguous [B, H, S, D]) in the delta argument
# (launcher() below); the dQ programs keep their delta in registers.
FUSED_DELTA = [
    ("        DELTA = DELTA0 + pid_bh.to(tl.int64) * len_q\n",
     "        DELTA = DELTA0 + pid_bh.to(tl.int64) * len_q * HEAD_DIM\n"),
    ("    delta = _load(DELTA + offs_m, m_valid, MASKED, False)\n",
     "    o = _load(DELTA + offs_m[:, None] * HEAD_DIM + offs_d[None, :],\n"
     "              m_valid[:, None] & d_valid[None, :], MASKED, HEAD_DIM != HEAD_DIM_PAD)\n"
     "    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)\n"),
    ("        tl.store(DELTA + pid_bh.to(tl.int64) * len_q + offs_m, delta, mask=m_valid)\n", ""),
    ("_dq_program(tile_q, pid_bh, Q, K, V, DO, DQ, LSE, DELTA, DO, LSE,",
     "_dq_program(tile_q, pid_bh, Q, K, V, DO, DQ, LSE, DELTA, DELTA, LSE,"),
    # DELTA_FROM_O on, HAS_DLSE (a loss reading the LSE) off as in the one launch
    ("                    False, False)\n", "                    True, False)\n"),
]


def replacements(pairs):
    def apply(source):
        for old, new in pairs:
            assert source.count(old) == 1, f"{old!r} occurs {source.count(old)} times"
            source = source.replace(old, new)
        return source
    return apply


def persistent(flatten: bool):
    """The forward as a persistent kernel: PERSISTENT_PROGRAMS programs (the module
    global; 4 per SM by default) walk the (head, query tile) work items in grid-stride
    order over the tables' row_order, as the grid's programs read it. flatten: tl.range(..., flatten=True) fuses the work loop with the key loops
    into one pipelined loop, so the next row's first K/V loads overlap this row's end."""
    def apply(source):
        start = source.index("@triton.jit(do_not_specialize=SEED)\ndef attn_fwd(")
        sig_end = source.index("):\n", start) + 3
        signature = source[start:sig_end]
        params = [p.split(":")[0].strip() for p in signature[signature.index("def attn_fwd(") + 13:-3].split(",")]
        params = [p for p in params if p]
        head = ("    pid = tl.load(row_order + tl.program_id(0))  # longest first, by the tables' counts\n"
                "    n_tiles = tl.cdiv(len_q, BLOCK_M)\n"
                "    pid_bh = pid // n_tiles\n    tile_q = pid % n_tiles\n")
        assert source[sig_end:].startswith(head), "the forward does not start as expected"
        program = signature.replace("@triton.jit(do_not_specialize=SEED)\ndef attn_fwd(",
                                    "@triton.jit\ndef _fwd_program(tile_q, pid_bh, ")
        consts = params[params.index("BLOCK_M"):]
        plain = params[:params.index("BLOCK_M")]
        kernel = ("@triton.jit(do_not_specialize=SEED)\n"
                  f"def attn_fwd({', '.join(plain)}, n_query_tiles, n_work, "
                  f"{', '.join(c + ': tl.constexpr' for c in consts)}):\n"
                  f"    for work in tl.range(tl.program_id(0), n_work, tl.num_programs(0), flatten={flatten}):\n"
                  f"        unit = tl.load(row_order + work)  # the tables' order, as the grid's\n"
                  f"        _fwd_program(unit % n_query_tiles, unit // n_query_tiles, {', '.join(params)})\n\n\n")
        body_end = source.index("# ------------------------------------------------------------------ backward: preprocess")
        source = (source[:start] + program + source[sig_end + len(head):body_end] + kernel
                  + source[body_end:])
        launch = ("    _via(launcher, attn_fwd, _grid(triton.cdiv(len_q, bm), B * H))(\n"
                  "        q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *args,\n")
        assert source.count(launch) == 1, "the forward launch is not as expected"
        return source.replace(launch, (
            "    n_query_tiles = triton.cdiv(len_q, bm)\n"
            "    grid = (min(n_query_tiles * B * H, PERSISTENT_PROGRAMS),)\n"
            "    _via(launcher, attn_fwd, grid)(q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *args,\n"
            "                   n_query_tiles, n_query_tiles * B * H,\n")) + (
            "\n\nPERSISTENT_PROGRAMS = 4 * (torch.cuda.get_device_properties(0).multi_processor_count\n"
            "                               if torch.cuda.is_available() else 1)\n")
    return apply


EDITS = {"prefetch1": table_loops(prefetch_edit(1)), "prefetch2": table_loops(prefetch_edit(2)),
         "fused_delta": replacements(FUSED_DELTA), "persistent": persistent(False),
         "persistent_flat": persistent(True)}


def edited_module(module, name: str):
    """The module with edit `name` applied, imported from a temp file."""
    source = EDITS[name](open(module.__file__).read())
    path = os.path.join(tempfile.mkdtemp(prefix="attncc_edit_"), f"edited_{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"edited_{name}", path)
    edited = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = edited  # triton.jit reads the source through the module
    spec.loader.exec_module(edited)
    edited.FUSED_DELTA = name == "fused_delta"
    return edited


def launcher(module, kernel, q, k, v, out, lse, delta, do, inputs, config):
    if kernel == "fwd":
        return lambda: module.forward(q, k, v, inputs, config=config)
    if kernel == "bwd":
        return lambda: module.backward_one_launch(q, k, v, lse, delta, do, inputs, config=config)[:3]
    if kernel == "bwd+delta":
        if getattr(module, "FUSED_DELTA", False):  # the edit reads O where delta was
            return lambda: module.backward_one_launch(q, k, v, lse, out, do, inputs, config=config)[:3]
        return lambda: module.backward_one_launch(q, k, v, lse, module.backward_delta(out, do), do,
                                                  inputs, config=config)[:3]
    if kernel == "dq":
        return lambda: module.backward_dq(q, k, v, lse, delta, do, inputs, config=config)[:1]
    return lambda: module.backward_dkdv(q, k, v, lse, delta, do, inputs, config=config)


def sweep(kern, kernel, tensors, inputs, label, at_most=None, module=None, want=None):
    """[(ms, config label, max abs diff to the first)] over the kept candidates; `module`
    replaces the kernel's own (an edit), `want` the first config's output to compare to."""
    q, k, v, do = tensors
    m = module or kern.module
    first = configs.kept_candidates(kern.variant, q.shape[-1], "fwd")[0]
    out, lse = m.forward(q, k, v, inputs, config=first)
    delta = m.backward_delta(out, do)
    rows = []
    direction = "bwd" if kernel.startswith("bwd") else kernel
    configs = configs.kept_candidates(kern.variant, q.shape[-1], direction)[:at_most]
    if kern.variant.name != "dense":
        configs += [c for c in EXTRA.get(kernel, []) if c not in configs]
    for config in configs:
        name = configs.label(config)
        run = launcher(m, kernel, q, k, v, out, lse, delta, do, inputs, config)
        try:
            got = run()
            if want is None:
                want = got
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001 - out of resources: say so, go on
            print(f"{label} {kernel} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append((ms, name, diff))
        print(f"{label:6s} {kernel:5s} {name:14s} {ms:8.3f} ms  diff {diff:.1e}", flush=True)
    return rows, want


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--densities", default="0.03,0.06")
    ap.add_argument("--extra", default="",
                    help="configs to time after the candidates, e.g. 'fwd:64x64w4s2,64x32w4s1;dq:64x64w4s1'")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--edits", default="", help=f"comma-separated, of {sorted(EDITS)}")
    ap.add_argument("--at-most", type=int, default=None,
                    help="time only the first N kept candidates (and the --extra ones)")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    for entry in filter(None, args.extra.split(";")):
        kernel, _, listed = entry.partition(":")
        EXTRA[kernel] = [dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                                  map(int, re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", c).groups())))
                         for c in listed.split(",")]
    S, H, D = args.seq, 16, 128
    nb = S // BLOCK
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, H, S, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(4)]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "seq": S, "block": BLOCK, "rows": {}}
    dense = attncc.compile(DENSE_SPEC)
    best_dense = {}
    for kernel in KERNELS[:3]:
        rows, _ = sweep(dense, kernel, tensors, {}, "dense", at_most=4)  # its winners are in these
        results["rows"][f"dense-{kernel}"] = rows
        best_dense[kernel] = min(rows)[0]
    best_dense["bwd"] = best_dense["dkdv"] + best_dense["dq"]  # dense runs them apart
    best_dense["bwd+delta"] = best_dense["bwd"]
    sparse = attncc.compile(sparse_spec(BLOCK))
    edits = [e for e in args.edits.split(",") if e]
    modules = {"": None, **{e: edited_module(sparse.module, e) for e in edits}}
    table = []
    for d in (float(x) for x in args.densities.split(",")):
        layout = random_layout(H, nb, d, gen).cuda()
        actual = layout.float().mean().item()
        for kernel in kernels:
            want = None
            for edit, module in modules.items():
                label = f"d={d:g}" + (f" {edit}" if edit else "")
                rows, got = sweep(sparse, kernel, tensors, {"blocks": layout}, label, args.at_most,
                                  module=module, want=want)
                want = want or got
                results["rows"][f"{d}-{kernel}{'-' + edit if edit else ''}"] = rows
                tuned = min(rows[:tuning.TUNE_AT_MOST])
                best = min(rows)
                line = model_ms(best_dense[kernel], actual, nb)
                table.append((d, kernel + (f"+{edit}" if edit else ""), best_dense[kernel], line,
                              tuned, best))
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "low_density.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{results['gpu']}, torch {results['torch']}, triton {results['triton']}; "
          f"S={S} H={H} D={D} bf16, block {BLOCK}; kernels alone, ms")
    print(f"{'d':>5s} {'kernel':15s} {'dense':>7s} {'line':>7s} | {'first 4 best':>20s} | "
          f"{'all best':>20s} | ratio to line")
    for d, kernel, dense_ms, line, tuned, best in table:
        print(f"{d:5.3f} {kernel:15s} {dense_ms:7.3f} {line:7.3f} | {tuned[1]:>12s} {tuned[0]:7.3f} | "
              f"{best[1]:>12s} {best[0]:7.3f} | {tuned[0] / line:.2f} / {best[0] / line:.2f}")


if __name__ == "__main__":
    main()
