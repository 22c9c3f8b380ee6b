"""`attncc bench --decode`: one decode step timed against FlexAttention's decoding kernel
and SDPA, on the same inputs, with the HBM bandwidth it achieves.

Every batch row holds a full cache of `length` keys and decodes n_q new tokens (query
token i at position length - n_q + i). The bandwidth counts the bytes of K and V the
step must read: for each kv head, the keys some query row of its group attends (the
whole cache for causal attention, the window and the sinks for a sliding window),
times 2 (K and V) times the head dim and the element size; divided by the median time
of do_bench, which flushes the L2 cache before each call.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import ir
from ..errors import AttnccError, NoGPUError
from ..arguments import Problem
from .flex import flex_mods, variant_uses
from ..semantics.samples import sample_inputs

# HBM bandwidth by device name (bytes/s), for the fraction of peak; None when unknown.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def peak_bandwidth(name: str):
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return None


def decode_inputs(variant: ir.Variant, *, batch: int, heads: tuple, length: int, dim: int,
                  seed: int = 0, device="cuda") -> dict:
    """The variant's inputs for decode calls on caches of `length` positions (their
    position and tile axes span the capacity): attncc.samples' stand-ins, ALiBi-style
    slopes for a float input on heads."""
    hq, hkv = heads
    p = Problem(batch, hq, hkv, length, length, dim, dim)
    inputs = sample_inputs(variant, p, seed=seed, device=device)
    for decl in variant.inputs:
        if decl.axes == ("h",) and decl.type == ir.FLOAT:  # slopes: 2^(-8 (h + 1) / H)
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)])
            inputs[decl.name] = slopes.to(inputs[decl.name].dtype).to(device)
    return inputs


def decode_allowed(variant: ir.Variant, *, batch: int, heads: tuple, length: int, n_q: int,
                   dim: int, inputs: dict, device) -> torch.Tensor:
    """Which (b, h, new token, key) pairs attend at decode time: bool [B|1, H|1, n_q, L].
    The rows are the last n_q positions, and len_q = len_k = length."""
    from ..semantics.reference import allowed_pairs
    hq, hkv = heads
    p = Problem(batch, hq, hkv, n_q, length, dim, dim, q_offset=length - n_q)
    return allowed_pairs(variant, p, inputs, device, len_q=length)


def keys_read(allowed: torch.Tensor, batch: int, heads: tuple) -> int:
    """Keys (summed over batch rows and kv heads) that some query row of the kv head's
    group attends: what a decode step must read of K, and of V."""
    hq, hkv = heads
    a = allowed.expand(batch, hq, *allowed.shape[2:])  # [B, Hq, n_q, L]
    per_kv = a.reshape(batch, hkv, (hq // hkv) * a.shape[2], a.shape[3]).any(2)  # [B, Hkv, L]
    return int(per_kv.sum().item())


def flex_decode(variant: ir.Variant, *, q, k, v, length: int, n_q: int, dim: int, inputs: dict):
    """(call, uses_decoding_kernel) for FlexAttention on the same decode step: mask_mod
    and score_mod from attncc's translation with the rows placed at length - n_q, a
    BlockMask over (n_q, length) built once, flex_attention compiled. uses_decoding_kernel
    says whether inductor generated its split-KV `flex_decoding` template for it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch._inductor.utils import run_and_get_code
    offset = length - n_q
    mask_mod, score_mod = flex_mods(variant, len_q=length, len_k=length, dim=dim, inputs=inputs)
    hq, hkv = q.shape[1], k.shape[1]
    block_mask = None
    if mask_mod is not None:
        def decode_mask(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + offset, kv_idx)
        uses = lambda name: variant_uses(variant, name)
        block_mask = create_block_mask(decode_mask, q.shape[0] if uses("b") else None,
                                       hq if uses("h") else None, n_q, length, device=q.device)
    decode_score = None
    if score_mod is not None:
        def decode_score(s, b, h, q_idx, kv_idx):
            return score_mod(s, b, h, q_idx + offset, kv_idx)
    from ..semantics.reference import scale_value
    compiled = torch.compile(flex_attention)
    call = lambda: compiled(q, k, v, score_mod=decode_score, block_mask=block_mask,
                            scale=scale_value(variant, dim), enable_gqa=hq != hkv)
    if variant.sink is not None:
        # FlexAttention has no sink in its softmax: its output is renormalised with the
        # returned LSE, as the training bench and transformers' gpt-oss path do.
        from ..runtime.sinks import sinks_at
        if ir.free_vars(variant.sink) & {"len_q", "len_k"}:
            raise ValueError("the sink reads len_q or len_k, which the Flex comparison does "
                             "not place at decode time")
        p = Problem(q.shape[0], hq, hkv, n_q, length, dim, dim, q_offset=offset)
        sink = sinks_at(variant, p, inputs, q.device)

        def call():
            out, lse = compiled(q, k, v, score_mod=decode_score, block_mask=block_mask,
                                scale=scale_value(variant, dim), enable_gqa=hq != hkv,
                                return_lse=True)
            return out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
    with torch._inductor.config.patch(fx_graph_cache=False):  # generate, so the code shows
        _, code = run_and_get_code(call)
    return call, any("flex_decoding" in c or "SPLIT_KV" in c for c in code)


def time_ms(fn) -> float:
    """Median milliseconds of fn (triton's do_bench: warm-up, L2 flushed before each call)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def paged_copy(cache: torch.Tensor, page_size: int, seed: int = 0) -> tuple:
    """(pages, block_table): the contiguous cache (B, Hkv, L, D) as shuffled pages
    (num_pages, page_size, Hkv, D)."""
    B, Hkv, L, D = cache.shape
    per_row = -(-L // page_size)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(B * per_row, generator=gen).to(cache.device)
    padded = torch.nn.functional.pad(cache, (0, 0, 0, per_row * page_size - L))
    rows = padded.view(B, Hkv, per_row, page_size, D).permute(0, 2, 3, 1, 4)
    pages = torch.empty((B * per_row, page_size, Hkv, D), dtype=cache.dtype, device=cache.device)
    pages[order] = rows.reshape(B * per_row, page_size, Hkv, D)
    return pages, order.view(B, per_row).to(torch.int32)


def bench_decode(variant: ir.Variant, kernel, *, batch: int, length: int, heads: tuple,
                 dim: int = 128, n_q: int = 1, page_size: int | None = None, flex: bool = True,
                 seed: int = 0, dtype=torch.bfloat16):
    """(meta, {backend: {"ms", "bytes_per_s", ...} or {"skipped": reason}}) for one decode
    step; backends: attncc (contiguous cache), attncc-paged (page_size, shuffled pages),
    flex (FlexAttention, its decoding kernel when inductor picks it), sdpa (where the
    step is plain attention over the whole cache)."""
    hq, hkv = heads
    dev = "cuda"
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(dev, dtype)
    q, k, v = mk(batch, hq, n_q, dim), mk(batch, hkv, length, dim), mk(batch, hkv, length, dim)
    inputs = decode_inputs(variant, batch=batch, heads=heads, length=length, dim=dim, seed=seed)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    allowed = decode_allowed(variant, batch=batch, heads=heads, length=length, n_q=n_q, dim=dim,
                             inputs=inputs, device=dev)
    n_keys = keys_read(allowed, batch, heads)
    nbytes = 2 * n_keys * dim * q.element_size()
    results = {}

    def record(name, fn, extra=None):
        try:
            ms = time_ms(fn)
            results[name] = {"ms": ms, "bytes_per_s": nbytes / (ms * 1e-3), **(extra or {})}
        except Exception as err:  # a backend that cannot run this step is reported, not fatal
            results[name] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}

    record("attncc", lambda: kernel.decode(q, k, v, cache_seqlens=lens, **inputs))
    if page_size:
        kp, table = paged_copy(k, page_size, seed)
        vp, _ = paged_copy(v, page_size, seed)
        record("attncc-paged", lambda: kernel.decode(q, kp, vp, cache_seqlens=lens,
                                                     block_table=table, **inputs),
               {"page_size": page_size})
        del kp, vp
    if flex and variant.normalize != "softmax":
        results["flex"] = {"skipped": f"FlexAttention normalises by softmax only, not "
                                      f"`normalize {variant.normalize}`"}
    elif flex:
        try:
            call, decoding = flex_decode(variant, q=q, k=k, v=v, length=length, n_q=n_q, dim=dim,
                                         inputs=inputs)
            record("flex", call, {"decoding_kernel": decoding})
        except Exception as err:
            results["flex"] = {"skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    plain = (variant.score is None and variant.layout is None and variant.normalize == "softmax"
             and variant.sink is None and bool(allowed.all()))
    if plain:
        from ..semantics.reference import scale_value
        scale = scale_value(variant, dim)
        record("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=scale, enable_gqa=hq != hkv))
    else:
        results["sdpa"] = {"skipped": "not plain attention over the whole cache"}
    name = torch.cuda.get_device_name()
    meta = {"variant": variant.name, "batch": batch, "length": length, "n_q": n_q,
            "heads_q": hq, "heads_kv": hkv, "dim": dim, "dtype": str(dtype).replace("torch.", ""),
            "keys_read": n_keys, "bytes_read": nbytes, "device": name,
            "peak_bytes_per_s": peak_bandwidth(name)}
    return meta, results


def format_decode(meta: dict, results: dict) -> str:
    peak = meta["peak_bytes_per_s"]
    lines = [f"{meta['variant']}: batch {meta['batch']} x {meta['length']} cache, {meta['n_q']} new "
             f"token{'s' if meta['n_q'] > 1 else ''}, heads {meta['heads_q']}/{meta['heads_kv']}, "
             f"dim {meta['dim']}, {meta['dtype']}; K+V read {meta['bytes_read'] / 1e6:.1f} MB",
             f"  {'backend':<13} {'ms':>8} {'TB/s':>6} {'of peak':>8} {'attncc faster':>14}"]
    mine = results.get("attncc", {}).get("ms")
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"  {name:<13} skipped: {r['skipped']}")
            continue
        frac = f"{r['bytes_per_s'] / peak:.0%}" if peak else "-"
        ratio = f"{r['ms'] / mine:.2f}x" if mine and name != "attncc" else "-"
        note = ""
        if name == "flex" and not r.get("decoding_kernel", True):
            note = "  (not its decoding kernel)"
        lines.append(f"  {name:<13} {r['ms']:>8.4f} {r['bytes_per_s'] / 1e12:>6.2f} {frac:>8} "
                     f"{ratio:>14}{note}")
    return "\n".join(lines)


def bench_decode_command(args) -> int:
    import attncc
    variant = attncc.load(args.spec)  # a bad spec is named first, on any machine
    if not torch.cuda.is_available():
        raise NoGPUError("attncc bench needs a CUDA GPU; none was found")
    # Without --heads or declared heads: 32 query heads sharing 8 kv heads (Llama-style GQA).
    heads = args.heads or ((variant.heads.q, variant.heads.kv) if variant.heads else (32, 8))
    if variant.heads is not None and heads != (variant.heads.q, variant.heads.kv):
        raise AttnccError(f"--heads {heads[0]}/{heads[1]} differs from the variant's declared "
                          f"heads {variant.heads.q}/{variant.heads.kv}")
    for flag, value in (("--batch", args.batch), ("--new", args.new), ("--page", args.page or 1)):
        if value < 1:
            raise AttnccError(f"{flag} must be at least 1, got {value}")
    kernel = attncc.compile(variant)
    print(f"{variant.name}: decoding {kernel.module.DECODE_STRATEGY}; {torch.cuda.get_device_name()}")
    runs = []
    for length in args.len:
        meta, results = bench_decode(variant, kernel, batch=args.batch, length=length,
                                     heads=heads, dim=args.dim, n_q=args.new,
                                     page_size=args.page)
        runs.append({**meta, "backends": results})
        print(format_decode(meta, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": variant.name, "runs": runs}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
