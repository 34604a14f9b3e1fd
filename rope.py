"""rope.py — rotary position embeddings (RoPE), the angles every rope model shares.

Mirrors Megatron-LM's `megatron/core/models/common/embeddings/rotary_pos_embedding.py` (rotate-half layout, float32
angles). A file of its own because the position scalings that extend context (linear, Llama 3, YaRN) live beside the
plain angles they modify, each next to its formula; gpt.py, the later models and the attention layers all read it.
Paper: Su et al. 2021 (RoFormer: rotary position embedding).

Run:    .venv/bin/python -m pytest -q tests/test_tensor_parallel.py   (rope models are tested through gpt.py)

Dimension glossary
  s sequence    b batch    n heads    d head dim (rotated part)
"""
from __future__ import annotations

import torch


def rope_cos_sin(s: int, d: int, base: float, device=None):
    """RoPE angles as Megatron computes them (float32, rotate-half layout): cos and sin [s, 1, 1, d]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)  # [s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
    return emb.cos(), emb.sin()


def apply_rope(x, cos_sin):  # x [s, b, n, d]
    cos, sin = (t[: x.shape[0]].to(x.dtype) for t in cos_sin)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
