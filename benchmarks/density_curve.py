"""Time against tile density for a runtime block layout: attncc and FlexAttention.

    python benchmarks/density_curve.py [--seq 16384] [--heads 16] [--dim 128]
                                       [--densities 0.03,0.06,0.125,0.25,0.5] [--no-flex]
                                       [--block 128] [--sparse-config JSON] [--graphs]

One variant, `attention sparse { input blocks: bool[h, qb, kb] layout blocks[h, qb, kb]
block 128 }`, run on random per-head layouts of 128 x 128 tiles at each density d (every
query-block row holds the same number of tiles, round(d * blocks), its diagonal tile
always among them), forward and backward, bf16, B = 1. FlexAttention gets a BlockMask
built from the same boolean layout (BlockMask.from_kv_blocks, every kept tile FULL, so
neither backend evaluates a mask inside a tile). Dense attncc (`attention dense { }`)
is the reference point: a kernel whose cost follows density should take about
d * dense, and each row has at least one tile, so the table prints the ratio of each
time to 1.2 * d * dense + dense / blocks (20% slack plus one tile row's share).

Timing as in gpu_suite.py: warm-up first (attncc compiles once; each layout's tables are
built once and kept, `sparse.tile_tables(...)`, so the kernels are tuned per density
bucket, in a first call outside the timings; FlexAttention compiles once, since the
BlockMask's shapes do not change),
then triton.testing.do_bench medians, the same q, k, v, dO and layout for both
backends; the backward is (forward + backward) - forward. Each entry also holds the
kernels' own GPU time per call (torch.profiler): at low density a call can be bound by
the host (Python, autograd, launches), and then do_bench exceeds it. --graphs adds
times from CUDA graph replays of each call, where the host's time is gone. Writes density_curve.json
and density_curve.png (time against density, both backends, the 1.2 * d * dense
line) to $OUT (or ./out), and prints the table last. Needs a CUDA GPU; the helpers
above main() run anywhere (tests/test_sparse.py tests them on the CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attncc  # noqa: E402

DENSITIES = (0.03, 0.06, 0.125, 0.25, 0.5)
BLOCK = 128
DENSE_SPEC = "attention dense { }"


def sparse_spec(block: int = BLOCK) -> str:
    return (f"attention sparse {{ input blocks: bool[h, qb, kb] layout blocks[h, qb, kb] "
            f"block {block} }}")


# ---------------------------------------------------------------- helpers (no GPU)
def random_layout(heads: int, n_blocks: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """bool [heads, n_blocks, n_blocks]: each row holds max(1, round(density * n_blocks))
    tiles, its diagonal tile and the rest drawn uniformly from the other columns."""
    per_row = max(1, min(n_blocks, round(density * n_blocks)))
    scores = torch.rand(heads, n_blocks, n_blocks, generator=gen)
    eye = torch.eye(n_blocks, dtype=torch.bool).expand(heads, -1, -1)
    scores = scores.masked_fill(eye, 2.0)  # the diagonal always wins
    top = scores.topk(per_row, dim=-1).indices
    return torch.zeros(heads, n_blocks, n_blocks, dtype=torch.bool).scatter_(-1, top, True)


def flex_block_mask(layout: torch.Tensor, block: int, seq_len: int):
    """A FlexAttention BlockMask [1, H, nb, nb] holding exactly `layout`'s tiles, all FULL
    (no mask_mod is evaluated inside them); partial-tile lists are empty."""
    from torch.nn.attention.flex_attention import BlockMask
    lay = layout.unsqueeze(0)  # [1, H, nb, nb]
    full_count = lay.sum(-1).to(torch.int32)
    order = torch.argsort((~lay).to(torch.int8), dim=-1, stable=True)  # kept columns first
    cols = torch.arange(lay.shape[-1], device=lay.device).expand_as(lay)
    full_idx = torch.gather(cols, -1, order).to(torch.int32).contiguous()
    zero_count = torch.zeros_like(full_count)
    zero_idx = torch.zeros_like(full_idx)

    def mask_mod(b, h, q_idx, kv_idx):  # only for partial tiles, of which there are none
        return layout[h, q_idx // block, kv_idx // block]

    return BlockMask.from_kv_blocks(zero_count, zero_idx, full_count, full_idx,
                                    BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


def model_ms(dense_ms: float, density: float, n_blocks: int) -> float:
    """What a density-proportional kernel may take: 1.2 * d * dense plus one tile row."""
    return 1.2 * density * dense_ms + dense_ms / n_blocks


def add_ratios(row: dict, dense: dict, n_blocks: int) -> dict:
    """Put time / model_ms into each backend's entry of `row`, forward and backward, for
    calls and, where timed, graph replays; both against dense attncc's call time (long
    enough that the host does not show; its replays ran slower in run 56, 14.3 against
    12.6 ms backward, and would flatter the ratios)."""
    for backend in ("attncc", "flex"):
        entry = row.get(backend) or {}
        for kind in ("", "graph_"):
            for direction in ("fwd", "bwd"):
                t, ref = entry.get(f"{kind}{direction}_ms"), dense.get(f"{direction}_ms")
                if t is not None and ref:
                    entry[f"{kind}{direction}_ratio"] = t / model_ms(ref, row["actual_density"],
                                                                     n_blocks)
    return row


def format_table(rows: list, dense: dict) -> str:
    def cell(entry, key, fmt):
        v = (entry or {}).get(key)
        return format(v, fmt) if v is not None else "-"

    head = (f"{'density':>8s} {'actual':>7s} | {'attncc fwd':>10s} {'bwd':>8s} | "
            f"{'flex fwd':>9s} {'bwd':>8s} | {'ratio to 1.2*d*dense+row: attncc f/b':>37s} | "
            f"{'flex f/b':>11s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        a, f = r.get("attncc"), r.get("flex")
        lines.append(
            f"{r['density']:8.3f} {r['actual_density']:7.4f} | {cell(a, 'fwd_ms', '10.3f')} "
            f"{cell(a, 'bwd_ms', '8.3f')} | {cell(f, 'fwd_ms', '9.3f')} {cell(f, 'bwd_ms', '8.3f')} | "
            f"{cell(a, 'fwd_ratio', '.2f') + '/' + cell(a, 'bwd_ratio', '.2f'):>37s} | "
            f"{cell(f, 'fwd_ratio', '.2f') + '/' + cell(f, 'bwd_ratio', '.2f'):>11s}")
    lines.append(f"{'dense':>8s} {1.0:7.4f} | {cell(dense, 'fwd_ms', '10.3f')} "
                 f"{cell(dense, 'bwd_ms', '8.3f')} |  (attncc, full attention; times in ms)")
    if any("graph_fwd_ms" in (r.get("attncc") or {}) for r in rows):
        lines += ["", "CUDA graph replays (no host time; ratios against the dense call time):",
                  f"{'density':>8s} | {'attncc fwd':>10s} {'bwd':>8s} | {'flex fwd':>9s} {'bwd':>8s} | "
                  f"{'ratio attncc f/b':>16s} | {'flex f/b':>11s}"]
        for r in rows + [dict(density=1.0, attncc=dense)]:
            a, f = r.get("attncc"), r.get("flex")
            lines.append(
                f"{r['density']:8.3f} | {cell(a, 'graph_fwd_ms', '10.3f')} {cell(a, 'graph_bwd_ms', '8.3f')} | "
                f"{cell(f, 'graph_fwd_ms', '9.3f')} {cell(f, 'graph_bwd_ms', '8.3f')} | "
                f"{cell(a, 'graph_fwd_ratio', '.2f') + '/' + cell(a, 'graph_bwd_ratio', '.2f'):>16s} | "
                f"{cell(f, 'graph_fwd_ratio', '.2f') + '/' + cell(f, 'graph_bwd_ratio', '.2f'):>11s}")
    for r in rows + [dict(density=1.0, attncc=dense)]:
        for backend in ("attncc", "flex"):
            e = r.get(backend) or {}
            for direction in ("fwd", "bwd"):
                t, kt = e.get(f"{direction}_ms"), e.get(f"kernel_{direction}_ms")
                if t is not None and kt and t > 1.3 * kt:
                    lines.append(f"host-bound: {backend} {direction} at d={r['density']:g}: "
                                 f"{t:.3f} ms per call, of which the kernels take {kt:.3f} ms")
    return "\n".join(lines)


def plot(rows: list, dense: dict, n_blocks: int, path: str) -> bool:
    """Time against density, forward and backward side by side; False without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("density_curve: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    for i, direction in enumerate(("fwd", "bwd")):
        ax = fig.add_subplot(1, 2, i + 1)
        for backend, style in (("attncc", "o-"), ("flex", "s-")):
            pts = [(r["actual_density"], r[backend][f"{direction}_ms"]) for r in rows
                   if f"{direction}_ms" in (r.get(backend) or {})]
            if pts:
                ax.plot(*zip(*pts), style, label=backend)
        ref = dense.get(f"{direction}_ms")
        if ref:
            ds = sorted(r["actual_density"] for r in rows)
            ax.plot(ds, [model_ms(ref, d, n_blocks) for d in ds], "k--",
                    label="1.2·d·dense + one tile row")
            ax.axhline(ref, color="gray", lw=0.8, ls=":", label="dense attncc")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tile density d")
        ax.set_ylabel("ms")
        ax.set_title("forward" if direction == "fwd" else "backward")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_results(rows: list, dense: dict, meta: dict, out_dir: str, n_blocks: int = 128) -> list:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "density_curve.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, dense=dense, rows=rows), f, indent=1)
    paths = [path]
    png = os.path.join(out_dir, "density_curve.png")
    if plot(rows, dense, n_blocks, png):
        paths.append(png)
    return paths


# ---------------------------------------------------------------- GPU
def bench(fn, rep=100):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def gpu_kernel_ms(fn, iters=5) -> float:
    """GPU time of the kernels one call of `fn` launches (torch.profiler), without the
    host's gaps: where do_bench is well above it, the call is bound by the host."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3


def time_fwd_bwd(fn, q, k, v, do) -> dict:
    """Median forward ms and backward ms ((forward + backward) - forward), and the same
    from the kernels' own GPU time (kernel_fwd_ms, kernel_bwd_ms)."""
    fwd_bwd = lambda: torch.autograd.grad(fn(), (q, k, v), do)
    t_f = bench(fn)
    t_fb = bench(fwd_bwd)
    row = dict(fwd_ms=t_f, bwd_ms=t_fb - t_f)
    try:
        k_f, k_fb = gpu_kernel_ms(fn), gpu_kernel_ms(fwd_bwd)
        row.update(kernel_fwd_ms=k_f, kernel_bwd_ms=k_fb - k_f)
    except Exception as e:  # the profiler is a diagnosis, never a reason to lose a timing
        row["kernel_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def graph_fwd_bwd(fn, q, k, v, do) -> dict:
    """Forward and backward ms from CUDA graph replays: the kernels without the host's
    Python, as a model captured in a graph runs them; and whether the replayed gradients
    equal an eager call's. Warm-up on a side stream, as torch.cuda.graph asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.autograd.grad(fn(), (q, k, v), do)
    torch.cuda.current_stream().wait_stream(side)
    eager = torch.autograd.grad(fn(), (q, k, v), do)
    fwd_graph, fwd_bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd_graph):
        fn()
    with torch.cuda.graph(fwd_bwd_graph):
        grads = torch.autograd.grad(fn(), (q, k, v), do)
    fwd_bwd_graph.replay()
    torch.cuda.synchronize()
    t_f, t_fb = bench(fwd_graph.replay), bench(fwd_bwd_graph.replay)
    return dict(graph_fwd_ms=t_f, graph_bwd_ms=t_fb - t_f,
                graph_grads_equal_eager=all(torch.equal(a, b) for a, b in zip(grads, eager)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--block", type=int, default=BLOCK, help="the layout's block (a power of two)")
    ap.add_argument("--sparse-config", default=None,
                    help="pin the sparse kernel's tiles (JSON, as ATTNCC_CONFIG); dense stays tuned")
    ap.add_argument("--graphs", action="store_true",
                    help="also time CUDA graph replays of each call (no host time)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("density_curve.py needs a CUDA GPU; none was found", file=sys.stderr)
        return 2
    import triton
    dev, dtype = "cuda", torch.bfloat16
    B, H, S, D = 1, args.heads, args.seq, args.dim
    block = args.block
    nb = math.ceil(S / block)
    densities = [float(x) for x in args.densities.split(",")]
    meta = dict(B=B, H=H, S=S, D=D, dtype="bfloat16", block=block, gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                attncc=getattr(attncc, "__version__", "?"), date=time.strftime("%Y-%m-%d %H:%M"))
    print(" ".join(f"{k}={v}" for k, v in meta.items()), flush=True)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    layouts = {d: random_layout(H, nb, d, gen).to(dev) for d in densities}

    pinned = json.loads(args.sparse_config) if args.sparse_config else None
    meta["sparse_config"] = pinned
    sparse = attncc.compile(sparse_spec(block), config=pinned)
    dense_kernel = attncc.compile(DENSE_SPEC)
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)

    # Warm-up: compile and tune once (on the middle density), outside every timing.
    t0 = time.perf_counter()
    mid = layouts[densities[len(densities) // 2]]
    torch.autograd.grad(sparse(q, k, v, blocks=mid), (q, k, v), do)
    torch.autograd.grad(dense_kernel(q, k, v), (q, k, v), do)
    torch.cuda.synchronize()
    meta["attncc_warmup_s"] = time.perf_counter() - t0
    print(f"attncc compile + tune: {meta['attncc_warmup_s']:.1f} s", flush=True)

    dense = time_fwd_bwd(lambda: dense_kernel(q, k, v), q, k, v, do)
    if args.graphs:
        dense.update(graph_fwd_bwd(lambda: dense_kernel(q, k, v), q, k, v, do))
    print(f"dense attncc: fwd {dense['fwd_ms']:.3f} ms, bwd {dense['bwd_ms']:.3f} ms", flush=True)

    rows = []
    for d in densities:
        lay = layouts[d]
        row = dict(density=d, actual_density=lay.float().mean().item(),
                   tiles_per_row=int(lay[0, 0].sum().item()))
        try:
            # Kept tables, as a model with a fixed layout would hold them: the kernels
            # are then tuned for this layout's density bucket (in the warm-up call).
            tables = sparse.tile_tables(q, k, v, blocks=lay)
            fn = lambda: sparse(q, k, v, blocks=lay, tables=tables)
            t0 = time.perf_counter()
            torch.autograd.grad(fn(), (q, k, v), do)
            torch.cuda.synchronize()
            row["attncc_first_call_s"] = time.perf_counter() - t0
            row["attncc"] = time_fwd_bwd(fn, q, k, v, do)
            if args.graphs:
                row["attncc"].update(graph_fwd_bwd(fn, q, k, v, do))
        except Exception as e:  # report and go on: one failure must not hide the rest
            row["attncc"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        if flex is not None:
            try:
                t0 = time.perf_counter()
                bm = flex_block_mask(lay, block, S)
                torch.cuda.synchronize()
                row["flex_block_mask_ms"] = (time.perf_counter() - t0) * 1e3
                ffn = lambda: flex(q, k, v, block_mask=bm)
                t0 = time.perf_counter()
                torch.autograd.grad(ffn(), (q, k, v), do)  # compile outside the timing
                torch.cuda.synchronize()
                row["flex_first_call_s"] = time.perf_counter() - t0
                with torch.no_grad():  # same computation? (both in bf16)
                    row["max_abs_diff_attncc_flex"] = (ffn() - fn()).abs().max().item()
                row["flex"] = time_fwd_bwd(ffn, q, k, v, do)
            except Exception as e:
                row["flex"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            if args.graphs and "error" not in row["flex"]:
                try:
                    row["flex"].update(graph_fwd_bwd(ffn, q, k, v, do))
                except Exception as e:  # torch.compile'd code may refuse capture: say so
                    row["flex"]["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        add_ratios(row, dense, nb)
        rows.append(row)
        print(json.dumps(row), flush=True)

    paths = write_results(rows, dense, meta, args.out, nb)
    print(f"\nwrote {', '.join(paths)}\n")
    print(f"S={S} H={H} D={D} bf16, block {block} ({nb} x {nb} blocks per head)"
          + (f", sparse kernel pinned to {pinned}" if pinned else ""))
    print(format_table(rows, dense))
    return 0


if __name__ == "__main__":
    sys.exit(main())
