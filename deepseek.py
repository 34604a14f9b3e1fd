"""deepseek.py — DeepSeek-V3's layers: multi-latent attention (MLA) and multi-token prediction (MTP).

Mirrors Megatron-LM's `megatron/core/transformer/multi_latent_attention.py` (MLASelfAttention) and
`megatron/core/transformer/multi_token_prediction.py` (MultiTokenPredictionLayer / Block, MTPLossAutoScaler), with
their parameter names and layouts, so a Megatron-core checkpoint loads by name. Not a model file: `--model gpt`
with `--multi-latent-attention` (gpt.Model.build_decoder passes MLASelfAttention to transformer.Decoder) and
`--mtp-num-layers D` (gpt.Model builds MTPBlock on the last pipeline stage and adds its loss).
Papers: DeepSeek-AI 2024, "DeepSeek-V2" (MLA: low-rank KV compression, decoupled RoPE);
        DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (MTP, §2.2).

Run:    .venv/bin/python -m pytest -q tests/test_mla_mtp.py
        make train NPROC=2 TP=2 RUN=runs/mla ARGS="--multi-latent-attention --mtp-num-layers 1"

Dimension glossary
  b batch    s sequence (s/tp under sequence parallelism)    h hidden    n attention heads (local: n/tp)
  rq q_lora_rank    rkv kv_lora_rank    dn qk_head_dim (no position)    dr qk_pos_emb_head_dim (RoPE part)
  dv v_head_dim     D mtp_num_layers (prediction depths)
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import parallel as P
from transformer import Norm, TransformerLayer, apply_rope, with_cache, yarn_mscale


# ---------------------------------------------------------------------------------------------- multi-latent attention
def replicated_linear(c, in_features: int, out_features: int) -> nn.Linear:
    """A linear layer every TP rank holds whole (MLA's down projections, TE's parallel_mode="duplicated"). Under
    sequence parallelism it sees this rank's s/tp tokens, so its gradient is partial: summed over TP like a norm's."""
    m = nn.Linear(in_features, out_features, bias=False, dtype=c.params_dtype)
    P.mark(m.weight, ("normal", c.init_method_std), sequence_parallel=c.sequence_parallel)
    return m


def apply_mla_rope(x, cos_sin):
    """Megatron's RoPE for MLA (rope_utils._apply_rotary_pos_emb_bshd, multi_latent_attention=True): the rotated
    part is stored in interleaved pairs (x0, x1), (x2, x3), ...; de-interleave to [x0, x2, ...; x1, x3, ...], then
    rotate half. x [s, b, n|1, dr]. q and k are permuted alike, so q·k is that of the interleaved rotation."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos_sin)


class MLASelfAttention(nn.Module):
    """Multi-latent attention. Per token:
        q      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))  [n, dn + dr]   (or linear_q_proj(x): no q-lora)
        c, kr  = linear_kv_down_proj(x) split [rkv | dr];   [k_nope; v] = linear_kv_up_proj(kv_layernorm(c))  [n, dn + dv]
        k      = [k_nope; rope(kr)] — kr is ONE position key shared by all heads; q's last dr dims are rotated too
        out    = linear_proj(softmax(q·k · scale) · v),   scale = 1/sqrt(dn + dr)   (× m(f, mscale_all_dim)² under YaRN)
    TP, as Megatron's TE spec: the down projections are replicated (whole on every rank; their outputs are small);
    the up projections are column-parallel (heads split), linear_proj row-parallel. Without SP every rank holds
    the whole c, so the shared kr enters its heads through f (copy_to_tp: its gradient is summed over the ranks'
    heads); under SP the down projections run on the rank's s/tp tokens, the up projections all-gather the
    sequence (as any column-parallel layer), and kr is all-gathered explicitly (backward: reduce-scatter).
    Megatron's local spec instead shards the down projections by output and all-gathers them: same numbers.
    RoPE seam: `rope` is gpt.Model.rope's (cos, sin) of dr dims. YaRN has two mscales, as Megatron's MLA: cos/sin
    (so only the dr position dims of q·k) carry the concentration m(f, mscale)/m(f, mscale_all_dim) (rope.yarn_mscale),
    and the softmax scale, all dn + dr dims, carries m(f, mscale_all_dim)² (MultiLatentAttention.softmax_scale), with
    m(f, x) = 0.1·x·ln f + 1. HF's DeepseekV3 does the same: its rope's attention_factor is the concentration and
    yarn_apply_mscale multiplies its `scaling` by m(f, mscale_all_dim)² (convert.deepseek_from_hf refuses the one
    HF setting where they part: mscale unset with mscale_all_dim set). DeepSeek-V3 (mscale = mscale_all_dim = 1):
    cos/sin unscaled, softmax × (0.1·ln 40 + 1)² = 1.87."""

    def __init__(self, c, grid=None, rng=None):
        super().__init__()
        tp = P.tp_of(grid)
        n, h = c.num_attention_heads, c.hidden_size
        self.c, self.tp, self.rng, self.p = c, tp, rng, c.attention_dropout
        self.n = n // (tp.size if tp else 1)
        self.dn, self.dr, self.dv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        q_dim = c.qk_head_dim + c.qk_pos_emb_head_dim
        self.scale = c.softmax_scale if c.softmax_scale is not None else 1.0 / math.sqrt(q_dim)
        if c.position_embedding_type == "yarn":  # Megatron's softmax_scale: yarn_get_mscale(f, mscale_all_dim)²/√q_dim
            self.scale *= yarn_mscale(c.yarn_rotary_scaling_factor, c.yarn_mscale_all_dim) ** 2
        kw = dict(grid=grid, bias=False, std=c.init_method_std, sequence_parallel=c.sequence_parallel,
                  dtype=c.params_dtype)
        if c.q_lora_rank is None:
            self.linear_q_proj = P.ColumnParallelLinear(h, n * q_dim, **kw)
        else:
            self.linear_q_down_proj = replicated_linear(c, h, c.q_lora_rank)
            self.q_layernorm = Norm(c, c.q_lora_rank)
            self.linear_q_up_proj = P.ColumnParallelLinear(c.q_lora_rank, n * q_dim, **kw)
        self.linear_kv_down_proj = replicated_linear(c, h, c.kv_lora_rank + c.qk_pos_emb_head_dim)
        self.kv_layernorm = Norm(c, c.kv_lora_rank)
        self.linear_kv_up_proj = P.ColumnParallelLinear(c.kv_lora_rank, n * (c.qk_head_dim + c.v_head_dim), **kw)
        self.linear_proj = P.RowParallelLinear(n * c.v_head_dim, h, grid, bias=c.add_bias_linear, std=c.output_std,
                                               sequence_parallel=c.sequence_parallel, dtype=c.params_dtype)

    def forward(self, x, rope=None, mask=None, inference_context=None):
        """x [s(/tp), b, h] -> [s(/tp), b, h]. mask: bool [b|1, n|1, sq, sk] True = attend, or a float bias.
        inference_context: the KV cache (transformer.InferenceContext), holding each head's whole k and v."""
        if self.c.q_lora_rank is None:
            q = self.linear_q_proj(x)  # [s, b, n/tp·(dn+dr)]
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))  # [s(/tp), b, rq] -> [s, b, ..]
        latent, k_pe = self.linear_kv_down_proj(x).split([self.c.kv_lora_rank, self.dr], dim=-1)  # [s(/tp), b, ·]
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent))  # [s, b, n/tp·(dn+dv)]
        sp = self.c.sequence_parallel and self.tp is not None
        k_pe = P.gather_from_sp(k_pe, self.tp) if sp else P.copy_to_tp(k_pe, self.tp)  # [s, b, dr], for every head
        q_nope, q_pe = rearrange(q, "s b (n d) -> s b n d", n=self.n).split([self.dn, self.dr], dim=-1)
        k_nope, v = rearrange(kv, "s b (n d) -> s b n d", n=self.n).split([self.dn, self.dv], dim=-1)
        if rope is not None:
            q_pe, k_pe = apply_mla_rope(q_pe, rope), apply_mla_rope(k_pe[:, :, None], rope)[:, :, 0]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [s, b, n/tp, dn+dr]
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.n, -1)], dim=-1)  # [s, b, n/tp, dn+dr]
        q, k, v = (rearrange(t, "s b n d -> b n s d") for t in (q, k, v))
        if inference_context is not None:  # decoding: this call's k, v join the cached ones [b, n/tp, t + s, ·]
            k, v, mask = with_cache(inference_context, self, q, k, v, mask)
        p = self.p if self.training else 0.0
        ctx = self.rng.fork(device=x.device) if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with ctx:  # attention dropout acts on heads, which are TP shards: the model-parallel RNG stream
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale,
                                               is_causal=mask is None)  # [b, n/tp, s, dv]
        return self.linear_proj(rearrange(o, "b n s d -> s b (n d)"))  # [s(/tp), b, h]


# ---------------------------------------------------------------------------------------------- multi-token prediction
def roll_left(t, dim: int = -1):
    """Megatron's roll_tensor (context parallelism 1): shift left by one along `dim`, the last entry set to 0."""
    t = torch.roll(t, shifts=-1, dims=dim)
    t.select(dim, -1).fill_(0)
    return t


# Megatron's MTPLossAutoScaler: identity on the main hidden states whose backward also feeds d(mtp_loss) = scale, so
# the MTP loss joins backward while the reported LM loss stays the main loss alone — the same autograd trick as MoE's
# aux loss, so the same function (parallel.py section 10a).
MTPLossAutoScaler = P.AuxLossScaler


class MTPLayer(nn.Module):
    """Depth k: h_k = final_layernorm(transformer_layer(eh_proj([enorm(emb(ids rolled k)); hnorm(h_{k-1})])))
    [s(/tp), b, h]. eh_proj [2h -> h] is column-parallel and its output all-gathered over TP (then re-split along
    the sequence under SP), as Megatron's _concat_embeddings does."""

    def __init__(self, c, grid=None, rng=None, attention=None):
        super().__init__()
        self.c, self.tp = c, P.tp_of(grid)
        self.enorm, self.hnorm = Norm(c), Norm(c)
        self.eh_proj = P.ColumnParallelLinear(2 * c.hidden_size, c.hidden_size, grid, bias=False,
                                              std=c.init_method_std, gather_output=True,
                                              sequence_parallel=c.sequence_parallel, dtype=c.params_dtype)
        # the decoder's last layer's kind (dense or MoE), as Megatron builds the MTP layer from that layer's spec
        self.transformer_layer = TransformerLayer(c, grid, rng, c.num_layers - 1, attention=attention)
        self.final_layernorm = Norm(c)

    def forward(self, hidden, emb, rope=None, mask=None):  # [s(/tp), b, h] each
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # [s, b, h]
        if self.c.sequence_parallel and self.tp is not None:
            x = P.scatter_to_sp(x, self.tp)  # [s/tp, b, h]
        return self.final_layernorm(self.transformer_layer(x, rope=rope, mask=mask))


class MTPBlock(nn.Module):
    """D MTP layers on the last pipeline stage; the embedding and the output layer are the model's (shared).

    Depth k predicts token i+k+1 at position i: its input ids and labels are the main ones rolled left k times
    (the last k positions are padding, masked out). The loss follows the one loss rule (DESIGN.md §2):
        mtp = mtp_loss_scaling_factor / D · Σ_k Σ_valid CE_k / num_tokens
    where num_tokens is the global count of MAIN loss tokens (set_num_tokens, from the schedules), so every
    layout and micro-batching gives the same gradient (Megatron's --calculate-per-token-loss). Unset (a model run
    outside the schedules): the micro-batch's b·s. The reported LM loss is the main loss alone; the per-depth
    means are logged separately (`logged_losses`)."""

    def __init__(self, c, grid=None, rng=None, attention=None):
        super().__init__()
        self.c = c
        self.layers = nn.ModuleList([MTPLayer(c, grid, rng, attention) for _ in range(c.mtp_num_layers)])
        self.num_tokens = None
        self.window = torch.zeros(c.mtp_num_layers, 2, dtype=torch.float64)  # per depth: CE sum, token count

    def set_num_tokens(self, num_tokens):  # the schedules' loss-token protocol (parallel.py section 7)
        self.num_tokens = num_tokens

    def forward(self, hidden, input_ids, labels, embed, per_token_loss, rope=None, mask=None):
        """hidden [s(/tp), b, h]: the decoder's output; input_ids, labels [b, s]; embed(ids, position_ids) is the
        model's embedding, per_token_loss(x, labels) -> [b, s] its output layer + cross-entropy.
        Returns `hidden` with the MTP loss attached to its backward (MTPLossAutoScaler)."""
        b, s = input_ids.shape
        ids, pos = input_ids, torch.arange(s, device=input_ids.device).expand(b, s)
        valid = torch.ones_like(labels, dtype=hidden.dtype)
        h, total, stats = hidden, 0.0, []
        for layer in self.layers:
            ids, pos, labels, valid = roll_left(ids), roll_left(pos), roll_left(labels), roll_left(valid)
            h = layer(h, embed(ids, pos), rope=rope, mask=mask)  # [s(/tp), b, h]
            loss = (per_token_loss(h, labels) * valid).sum()  # this depth's CE summed over its valid tokens
            total = total + loss
            stats.append(torch.stack([loss.detach().double().cpu(), valid.sum().double().cpu()]))
        if self.training:
            self.window += torch.stack(stats)
        scale = self.c.mtp_loss_scaling_factor / len(self.layers) / (self.num_tokens or b * s)
        return MTPLossAutoScaler.apply(hidden, total, scale)

    def logged_losses(self) -> dict:
        """{"mtp_k_loss": tensor([CE sum, tokens])} of the training forwards since the last call (then reset): the
        loop sums them over ranks and logs sum / count (TP ranks hold equal copies: the ratio is unchanged)."""
        out = {f"mtp_{k + 1}_loss": self.window[k].clone() for k in range(len(self.layers))}
        self.window.zero_()
        return out
