"""Differential attention (Diff Transformer, Ye et al., 2024) on attncc's causal kernel.

Each output head is the difference of two softmax attentions over the same values,

    DiffAttn(X) = (softmax(Q1 K1ᵀ / √d) − λ softmax(Q2 K2ᵀ / √d)) V,

with V twice as wide as the query and key heads, a per-head RMS norm scaled by
(1 − λ_init), and λ re-parametrised per layer as

    λ = exp(λq1 · λk1) − exp(λq2 · λk2) + λ_init,   λ_init = 0.8 − 0.6 exp(−0.3 (layer − 1)).

A difference of two softmaxes is not one normaliser, so it is a recipe around the kernel
rather than a variant: the two softmaxes are two heads per output head of one causal
kernel call, each reading the whole 2d-wide V (v's head dim is its own). λ is an
ordinary tensor computed from its four vectors,
so autograd gives their gradients through the kernel's. docs/recipes.md shows the same
recipe; tests/test_normalize.py checks this module against the paper's formula in
float64, the gradients of λ's vectors included.

    layer = DifferentialAttention(d_model=256, n_heads=4, layer=1)
    y = layer(x)                                  # x: (batch, seq, d_model)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import attncc

CAUSAL = "attention diff_causal { mask q >= k }"


def lambda_init(layer: int) -> float:
    """The paper's λ_init for layer `layer` (counted from 1)."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


def differential_lambda(lq1, lk1, lq2, lk2, lam_init: float):
    """λ = exp(λq1 · λk1) − exp(λq2 · λk2) + λ_init: a scalar with gradients to all four."""
    return torch.exp(torch.dot(lq1, lk1)) - torch.exp(torch.dot(lq2, lk2)) + lam_init


def differential_attention(kernel, q1, k1, q2, k2, v, lam, lam_init: float):
    """q1, k1, q2, k2: (batch, heads, seq, d); v: (batch, heads, seq, 2d). The heads'
    normalised differences, (batch, heads, seq, 2d)."""
    out = kernel(torch.cat([q1, q2], 1), torch.cat([k1, k2], 1), torch.cat([v, v], 1))
    first, second = out.chunk(2, dim=1)  # softmax 1 and softmax 2, each over all of V
    attn = first - lam * second
    return F.rms_norm(attn, attn.shape[-1:]) * (1 - lam_init)


class DifferentialAttention(nn.Module):
    """One causal multi-head differential attention layer (Diff Transformer v1)."""

    def __init__(self, d_model: int, n_heads: int, layer: int = 1):
        super().__init__()
        assert d_model % (2 * n_heads) == 0, "each head holds two query/key halves of d each"
        self.n_heads, self.d = n_heads, d_model // (2 * n_heads)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False)
                                              for _ in range(4))
        self.lam_init = lambda_init(layer)
        self.lq1, self.lk1, self.lq2, self.lk2 = (nn.Parameter(torch.randn(self.d) * 0.1)
                                                  for _ in range(4))
        self.kernel = attncc.compile(CAUSAL)

    def forward(self, x):  # x: (batch, seq, d_model)
        B, S, _ = x.shape
        H, d = self.n_heads, self.d
        # Queries and keys: (B, S, H, 2, d), the two halves of each head; values (B, S, H, 2d).
        q = self.wq(x).view(B, S, H, 2, d).permute(3, 0, 2, 1, 4)  # [2, B, H, S, d]
        k = self.wk(x).view(B, S, H, 2, d).permute(3, 0, 2, 1, 4)
        v = self.wv(x).view(B, S, H, 2 * d).transpose(1, 2)  # [B, H, S, 2d]
        lam = differential_lambda(self.lq1, self.lk1, self.lq2, self.lk2, self.lam_init)
        out = differential_attention(self.kernel, q[0], k[0], q[1], k[1], v, lam, self.lam_init)
        return self.wo(out.transpose(1, 2).reshape(B, S, H * 2 * d))
