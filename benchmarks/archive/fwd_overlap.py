"""Experiment: does issuing the next tile's QK^T before this tile's softmax pay in Triton?

    python benchmarks/archive/fwd_overlap.py [--len 16384]

FlashAttention-3 overlaps the softmax of one tile with the tensor-core products of
another ("intra-warpgroup pipelining"). Triton issues Hopper's wgmma asynchronously and
waits at the first use of its result, so a loop that computes the next tile's scores
first, then this tile's softmax and P V, gives it the chance to overlap them. Two
standalone forwards for full attention (no mask, no tables: the measurement isolates
the loop), the plain loop as attn_fwd's full tiles run it and the software-pipelined
one, checked against SDPA and timed (do_bench median) at a few configs; S = 16384,
H = 16, D = 128, bf16. Prints a table last.
"""
import argparse

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _plain(Q, K, V, O, qk_scale, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           D: tl.constexpr):
    tile_q, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * L * D
    offs_m = tile_q * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, L, BLOCK_N):
        kt = tl.load(K + base + (start + offs_n)[None, :] * D + offs_d[:, None])
        t = tl.dot(q, kt) * qk_scale
        m_new = tl.maximum(m_i, tl.max(t, 1))
        p = tl.math.exp2(t - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + base + (start + offs_n)[:, None] * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


@triton.jit
def _pipelined(Q, K, V, O, qk_scale, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr):
    tile_q, bh = tl.program_id(0), tl.program_id(1)
    base = bh.to(tl.int64) * L * D
    offs_m = tile_q * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kt = tl.load(K + base + offs_n[None, :] * D + offs_d[:, None])
    qk = tl.dot(q, kt)
    for start in range(0, L - BLOCK_N, BLOCK_N):
        # The next tile's scores first: its wgmma runs while this tile's softmax does.
        kt_next = tl.load(K + base + (start + BLOCK_N + offs_n)[None, :] * D + offs_d[:, None])
        qk_next = tl.dot(q, kt_next)
        t = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(t, 1))
        p = tl.math.exp2(t - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + base + (start + offs_n)[:, None] * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        qk = qk_next
    t = qk * qk_scale  # the last tile
    m_new = tl.maximum(m_i, tl.max(t, 1))
    p = tl.math.exp2(t - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.load(V + base + (L - BLOCK_N + offs_n)[:, None] * D + offs_d[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc)
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=16384)
    args = ap.parse_args()
    L, H, D = args.len, 16, 128
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    flops = 4 * H * L * L * D
    scale = D ** -0.5 * LOG2E
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for bm, bn, w, s in CONFIGS:
        for name, fn in (("plain", _plain), ("pipelined", _pipelined)):
            out = torch.empty_like(q)
            run = lambda: fn[(L // bm, H)](q, k, v, out, scale, L, BLOCK_M=bm, BLOCK_N=bn, D=D,
                                           num_warps=w, num_stages=s)
            try:
                run()
                err = (out.float() - want.float()).abs().max().item()
                ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
            except Exception as e:  # noqa: BLE001 - out of resources: say so, go on
                print(f"{name} {bm}x{bn} w{w} s{s}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            rows.append((f"{bm}x{bn} w{w} s{s}", name, ms, flops / ms / 1e9, err))
            print(f"{bm}x{bn} w{w} s{s} {name:9s} {ms:7.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s "
                  f"err {err:.1e}", flush=True)
    print(f"\nS={L} H={H} D={D} bf16, full attention, forward only")
    print("config           loop        ms   TFLOP/s   max err vs SDPA")
    for cfg, name, ms, tf, err in rows:
        print(f"{cfg:16s} {name:9s} {ms:7.3f} {tf:8.0f}   {err:.1e}")


if __name__ == "__main__":
    main()
