"""rope.py — rotary position embeddings (RoPE), the angles every rope model shares, and the scalings that extend context.

Mirrors Megatron-LM's `megatron/core/models/common/embeddings/rotary_pos_embedding.py` (rotate-half layout, float32
angles, `--rotary-percent`, `--rotary-seq-len-interpolation-factor`, `--use-rope-scaling`), `yarn_rotary_pos_embedding.py`
(`--position-embedding-type yarn`) and `rope_utils.py` (`_apply_rotary_pos_emb_bshd`: rotate the first dims, pass the
rest). A file of its own because the position scalings live beside the plain angles they modify, each next to its
formula; gpt.py, the later models and the attention layers all read it.
Papers: Su et al. 2021 (RoFormer: rotary position embedding); Chen et al. 2023 (Extending context window of LLMs via
        position interpolation: "linear"); Peng et al. 2023 (YaRN); Meta 2024 (The Llama 3 herd of models: "llama3").

Run:    .venv/bin/python -m pytest -q tests/test_long_context.py

Plain RoPE rotates pair (x_i, x_{i+d/2}) of a head by the angle p·θ_i at position p, θ_i = base^(−2i/d), i < d/2.
Every scaling here changes only the angles (and YaRN also multiplies cos and sin by one number, mscale):
  linear    p·θ_i / factor                        (all frequencies slowed down: positions interpolated)
  llama3    θ_i / factor for long wavelengths, θ_i for short ones, a linear blend in between (by wavelength)
  yarn      θ_i / factor for low-frequency dims, θ_i for high-frequency ones, a ramp in between (by rotation count),
            and cos, sin × mscale (the "attention concentration": softmax logits grow by mscale²)

Dimension glossary
  s sequence    b batch    n heads    d head dim    r rotated dims (= int(d · rotary_percent), even)
"""
from __future__ import annotations

import math

import torch


def rope_cos_sin(s: int, d: int, base: float, device=None):
    """Plain RoPE angles as Megatron computes them (float32, rotate-half layout): cos and sin [s, 1, 1, d]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)  # [s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
    return emb.cos(), emb.sin()


def apply_rope(x, cos_sin):  # x [s, b, n, d]; cos, sin [s, 1, 1, r], r <= d: the first r dims rotate, the rest pass
    cos, sin = (t[: x.shape[0]].to(x.dtype) for t in cos_sin)
    r = cos.shape[-1]
    if r < x.shape[-1]:  # only here the slices and the re-joining cat (each a copy of x, forward and backward)
        return torch.cat([apply_rope(x[..., :r], (cos, sin)), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # rotate-half: (x1, x2) -> (−x2, x1)


# ---------------------------------------------------------------------------------------------- the scalings
def llama3_inv_freq(inv_freq, factor: float, low_freq_factor: float, high_freq_factor: float, original_max: int):
    """Llama 3.x (Megatron's RotaryEmbedding._apply_scaling, HF's "llama3"). With wavelength λ_i = 2π/θ_i and the
    original context L: λ_i > L/low_freq_factor -> θ_i/factor; λ_i < L/high_freq_factor -> θ_i; in between
    θ_i·((1−t)/factor + t) with t = (L/λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor) in [0, 1].
    Clamping t to [0, 1] gives all three cases in one line (tests/test_long_context.py checks it against the
    three-branch loop)."""
    wavelen = 2 * math.pi / inv_freq  # [r/2]
    t = ((original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - t) * inv_freq / factor + t * inv_freq


def yarn_correction_range(beta_fast: float, beta_slow: float, r: int, base: float, original_max: int,
                          round_to_int: bool = True):
    """The dims [low, high] over which YaRN ramps. Dim pair i turns L·θ_i/(2π) times over the original context L;
    it turns `rot` times at i = r·ln(L / (2π·rot)) / (2 ln base). Pairs turning more than beta_fast times (i < low)
    keep their frequency (extrapolation); fewer than beta_slow times (i > high) are interpolated (θ_i/factor)."""
    def dim(rot):
        return r * math.log(original_max / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim(beta_fast), dim(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, r - 1)


def yarn_mscale(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's attention concentration (Megatron's _yarn_get_concentration_factor): m(f, mscale) / m(f, mscale_all_dim)
    with m(f, x) = 0.1·x·ln f + 1 (1 when f <= 1). cos and sin are multiplied by it, so q·k by its square."""
    def m(x):
        return 1.0 if factor <= 1 else 0.1 * x * math.log(factor) + 1.0
    return float(m(mscale) / m(mscale_all_dim))


def yarn_inv_freq(inv_freq, base: float, factor: float, original_max: int, beta_fast: float, beta_slow: float,
                  round_to_int: bool = True):
    """YaRN's angles (Megatron's YarnRotaryEmbedding): θ_i·(1 − ramp_i) + (θ_i/factor)·ramp_i, where ramp_i rises
    linearly from 0 at i = low to 1 at i = high (yarn_correction_range) and is clamped to [0, 1] outside."""
    r = 2 * inv_freq.shape[0]
    low, high = yarn_correction_range(beta_fast, beta_slow, r, base, original_max, round_to_int)
    high = high + 0.001 if low == high else high  # Megatron's guard against a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp


# ---------------------------------------------------------------------------------------------- from a Config
def rotary_dim(c, d: int | None = None) -> int:
    """r: how many of the head's d dims rotate (Megatron's int(kv_channels · rotary_percent))."""
    return int((d or c.kv_channels) * c.rotary_percent)


def rope_cos_sin_mscale(c, s: int, d: int | None = None, device=None):
    """The angles of a Config's position embedding, for positions 0..s−1 and a rotated head dim d (default: the
    config's rotary_dim; multi-latent attention passes its qk_pos_emb_head_dim). Returns cos, sin [s, 1, 1, d]
    (NOT yet multiplied by mscale) and mscale (1.0 unless YaRN). float32, as Megatron's."""
    d = d or rotary_dim(c)
    inv_freq = 1.0 / (c.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    mscale = 1.0
    if c.position_embedding_type == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, c.rotary_base, c.yarn_rotary_scaling_factor,
                                 c.yarn_original_max_position_embeddings, c.yarn_beta_fast, c.yarn_beta_slow,
                                 c.yarn_correction_range_round_to_int)
        mscale = yarn_mscale(c.yarn_rotary_scaling_factor, c.yarn_mscale, c.yarn_mscale_all_dim)
    elif c.rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, c.rope_scaling_factor, c.rope_scaling_low_freq_factor,
                                   c.rope_scaling_high_freq_factor, c.rope_scaling_original_max_position_embeddings)
    pos = torch.arange(s, dtype=torch.float32, device=device)  # [s]
    if c.seq_len_interpolation_factor is not None:  # linear position interpolation: p -> p / factor
        pos = pos * (1 / c.seq_len_interpolation_factor)  # Megatron's order
    freqs = torch.outer(pos, inv_freq)  # [s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
    return emb.cos(), emb.sin(), mscale


def rope_for(c, s: int, device=None, d: int | None = None):
    """(cos·mscale, sin·mscale) [s, 1, 1, r] for apply_rope (d: the rotated dims, default rotary_dim(c)), or None
    when the config has no rotary embedding."""
    if c.position_embedding_type not in ("rope", "yarn"):
        return None
    cos, sin, mscale = rope_cos_sin_mscale(c, s, d, device=device)
    return (cos, sin) if mscale == 1.0 else (cos * mscale, sin * mscale)
