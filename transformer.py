"""transformer.py — the transformer's building blocks every model here shares: norms, attention, MLP, layer, stack.

Mirrors Megatron-LM's `megatron/core/transformer/` — `attention.py`, `mlp.py`, `transformer_layer.py`,
`transformer_block.py` — with the same parameter names and tensor layouts, so a Megatron-core checkpoint loads by
name (fused QKV grouped per query group, SwiGLU fc1 as [gate; up]). A file of its own, as in Megatron, so that
gpt.py holds only the model skeleton (Config, embedding, Model, generation) and each layer is read once, here.
Papers: Vaswani et al. 2017 (attention); Touvron et al. 2023 (Llama: RMSNorm, SwiGLU); Ainslie et al. 2023 (GQA);
        Shoeybi et al. 2019 (Megatron-LM tensor parallelism: the column/row-parallel split of attention and MLP).

Run:    .venv/bin/python -m pytest -q tests/test_tensor_parallel.py

Dimension glossary
  b batch    s sequence (s/tp under sequence parallelism)    h hidden
  n attention heads (local: n/tp)   g query groups = key/value heads (local: g/tp)   d head dim (kv_channels)
  f ffn hidden size (f/tp per rank)
"""
from __future__ import annotations

import contextlib
import math

import torch.nn.functional as F
from einops import rearrange
from torch import nn

import parallel as P
from rope import apply_rope

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
ACTIVATIONS["quick_gelu"] = lambda x: x * F.sigmoid(1.702 * x)  # CLIP's (Radford et al. 2021; Megatron's quick_gelu)



def Norm(c) -> nn.Module:
    """LayerNorm or RMSNorm; under sequence parallelism its weights see s/tp tokens, so their grads are partial."""
    cls = nn.LayerNorm if c.normalization == "LayerNorm" else nn.RMSNorm
    m = cls(c.hidden_size, eps=c.layernorm_epsilon, dtype=c.params_dtype)
    for name, p in m.named_parameters():
        P.mark(p, ("ones",) if name == "weight" else ("zeros",), sequence_parallel=c.sequence_parallel)
    return m


# ---------------------------------------------------------------------------------------------- attention and MLP
class Attention(nn.Module):
    """Multi-head / grouped-query attention, heads split over TP. Self-attention uses one fused `linear_qkv` whose
    output is grouped per query group, [q heads of the group; k; v] (Megatron's layout); cross-attention uses
    `linear_q` and `linear_kv` ([k; v] per group) on a separate key/value input."""

    def __init__(self, c, grid=None, cross: bool = False, rng=None):
        super().__init__()
        tp = grid.tp.size if grid is not None else 1
        h, d, n, g = c.hidden_size, c.kv_channels, c.num_attention_heads, c.num_query_groups
        self.n, self.g, self.d, self.rng, self.p = n // tp, g // tp, d, rng, c.attention_dropout
        self.scale = c.softmax_scale if c.softmax_scale is not None else 1.0 / math.sqrt(d)
        kw = dict(grid=grid, bias=c.add_qkv_bias, std=c.init_method_std, sequence_parallel=c.sequence_parallel,
                  dtype=c.params_dtype)
        if cross:
            self.linear_q = P.ColumnParallelLinear(h, n * d, **kw)
            self.linear_kv = P.ColumnParallelLinear(h, 2 * g * d, **kw)
        else:
            self.linear_qkv = P.ColumnParallelLinear(h, (n + 2 * g) * d, **kw)
        self.linear_proj = P.RowParallelLinear(n * d, h, grid, bias=c.add_bias_linear, std=c.output_std,
                                               sequence_parallel=c.sequence_parallel, dtype=c.params_dtype)

    def forward(self, x, rope=None, mask=None, kv_input=None, causal=True):
        """x [s(/tp), b, h] -> [s(/tp), b, h]. mask: bool [b|1, n|1, sq, sk] True = attend, or a float bias."""
        if kv_input is None:
            qkv = rearrange(self.linear_qkv(x), "s b (g m d) -> s b g m d", g=self.g, d=self.d)  # m = n/g + 2
            q = rearrange(qkv[:, :, :, :-2], "s b g m d -> s b (g m) d")  # [s, b, n, d]
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [s, b, g, d]
        else:
            q = rearrange(self.linear_q(x), "s b (n d) -> s b n d", d=self.d)
            k, v = rearrange(self.linear_kv(kv_input), "s b (g two d) -> two s b g d", two=2, d=self.d)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (rearrange(t, "s b n d -> b n s d") for t in (q, k, v))
        p = self.p if self.training else 0.0
        ctx = self.rng.fork(device=x.device) if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with ctx:  # attention dropout acts on heads, which are TP shards: the model-parallel RNG stream
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale,
                                               is_causal=causal and mask is None, enable_gqa=self.g != self.n)
        return self.linear_proj(rearrange(o, "b n s d -> s b (n d)"))  # [s(/tp), b, h]


class MLP(nn.Module):
    """h -> f -> h. Gated (SwiGLU): fc1 holds [gate; up] fused, sharded with stride 2 so rank r has [gate_r; up_r]."""

    def __init__(self, c, grid=None, ffn_hidden_size: int | None = None):
        super().__init__()
        f = ffn_hidden_size or c.ffn_hidden_size
        self.gated, self.act = c.gated_linear_unit, ACTIVATIONS[c.activation]
        self.linear_fc1 = P.ColumnParallelLinear(c.hidden_size, f * (2 if self.gated else 1), grid,
                                                 bias=c.add_bias_linear, std=c.init_method_std,
                                                 sequence_parallel=c.sequence_parallel,
                                                 stride=2 if self.gated else 1, dtype=c.params_dtype)
        self.linear_fc2 = P.RowParallelLinear(f, c.hidden_size, grid, bias=c.add_bias_linear, std=c.output_std,
                                              sequence_parallel=c.sequence_parallel, dtype=c.params_dtype)

    def forward(self, x):  # [s(/tp), b, h]
        y = self.linear_fc1(x)  # [s, b, f/tp] or [s, b, 2f/tp]
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = self.act(gate) * up
        else:
            y = self.act(y)
        return self.linear_fc2(y)  # [s(/tp), b, h]


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x))).

    apply_residual_connection_post_layernorm (legacy Megatron's flag): the residual branch starts from norm(x), not x.
    With it, a stack of these layers plus the final norm is exactly the post-LN transformer of original BERT with its
    norms shifted by one (layer i's input_layernorm = BERT's embedding LayerNorm for i = 0, else layer i−1's output
    LayerNorm) — see convert.bert_from_hf."""

    def __init__(self, c, grid=None, rng=None, layer_number: int = 0, moe: bool | None = None):
        super().__init__()
        self.c, self.rng = c, rng
        self.input_layernorm = Norm(c)
        self.self_attention = Attention(c, grid, rng=rng)
        self.pre_mlp_layernorm = Norm(c)
        if c.is_moe_layer(layer_number) if moe is None else moe:  # MoE (parallel.py section 10) instead of the MLP
            shared = c.moe_shared_expert_intermediate_size
            self.mlp = P.MoELayer(c, grid, ACTIVATIONS[c.activation], MLP(c, grid, shared) if shared else None)
        else:
            self.mlp = MLP(c, grid)

    def drop(self, x):  # hidden dropout; under SP the activations are sequence shards -> model-parallel stream
        return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=self.c.sequence_parallel)

    def forward(self, x, rope=None, mask=None):  # [s(/tp), b, h]
        post = self.c.apply_residual_connection_post_layernorm
        ln = self.input_layernorm(x)
        x = (ln if post else x) + self.drop(self.self_attention(ln, rope=rope, mask=mask))
        ln = self.pre_mlp_layernorm(x)
        return (ln if post else x) + self.drop(self.mlp(ln))


class Decoder(nn.Module):
    def __init__(self, c, grid, rng, num_layers: int, post_process: bool, layer_offset: int = 0):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(c, grid, rng, layer_offset + i) for i in range(num_layers)])
        self.final_layernorm = Norm(c) if post_process else None

    def forward(self, x, rope=None, mask=None):
        for layer in self.layers:
            x = layer(x, rope=rope, mask=mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x
