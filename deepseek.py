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
import re

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import parallel as P
from interop import convert
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
    yarn_apply_mscale multiplies its `scaling` by m(f, mscale_all_dim)² (hf_to_ours refuses the one
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
        if getattr(inference_context, "paged_attention", False):  # serving/engine.py's paged cache reads its blocks
            o = inference_context.attend(self, q, k, v, self.scale)  # itself (serving/paged_attention.py)
            return self.linear_proj(rearrange(o, "b n s d -> s b (n d)"))
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


# ---------------------------------------------------------------------------------------------- Hugging Face (interop/convert.py)
# The router features DeepSeek-V3 needs beyond gpt.Config's sigmoid top-k (parallel.py section 10): HF's value that
# needs no field, and the Config field (Megatron's name) that represents any other value once the router has it.
HF_ROUTING = {"n_group": (1, "moe_router_num_groups"), "topk_group": (1, "moe_router_group_topk"),
              "routed_scaling_factor": (1.0, "moe_router_topk_scaling_factor")}
# gpt.py's HF_LAYOUTS["deepseek_v3"] (interop/hf.py): experts stored one by one; the MTP layers' copies of the embedding
# and output weights (our MTP shares them, as Megatron's does: the import checks they are equal)
HF_LAYOUT = {"experts": ("gate_proj", "up_proj", "down_proj"),
             "copies": [(r"model\.layers\.\d+\.embed_tokens\.weight", ["model.embed_tokens.weight"]),
                        (r"model\.layers\.\d+\.shared_head\.head\.weight", ["lm_head.weight", "model.embed_tokens.weight"])]}
_MLA = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
        "self_attn.kv_a_layernorm": "self_attention.kv_layernorm", "self_attn.kv_b_proj": "self_attention.linear_kv_up_proj",
        "self_attn.o_proj": "self_attention.linear_proj", "self_attn.q_a_proj": "self_attention.linear_q_down_proj",
        "self_attn.q_a_layernorm": "self_attention.q_layernorm"}  # HF's layer -> ours, and three with RoPE rows:
_MLA_ROPE = {"self_attn.kv_a_proj_with_mqa": ("self_attention.linear_kv_down_proj", False),  # (whose rows are heads')
             "self_attn.q_proj": ("self_attention.linear_q_proj", True),
             "self_attn.q_b_proj": ("self_attention.linear_q_up_proj", True)}


def _hf_mtp(hc, sd, moe_last: bool, bad: dict) -> int | None:
    """mtp_num_layers of a DeepSeek-V3 state: config.json's num_nextn_predict_layers D when the state holds their
    tensors — depth k + 1 is stored after the decoder's L layers as model.layers.{L + k}: a whole decoder layer plus
    enorm, hnorm, eh_proj [h, 2h] and shared_head.norm (our MTPLayer's final_layernorm); its embed_tokens and
    shared_head.head are copies (HF_LAYOUT). None when the state holds none of them: transformers' DeepseekV3 neither
    builds nor saves them. Refused into `bad`: some depths stored and not others, and an MTP layer whose MLP kind
    (dense / MoE) is not the last decoder layer's, which is what Megatron builds it as."""
    d, L = getattr(hc, "num_nextn_predict_layers", 0) or 0, hc.num_hidden_layers
    stored = [f"model.layers.{L + k}.eh_proj.weight" in sd for k in range(d)]
    if not any(stored):
        return None
    if not all(stored):
        bad["num_nextn_predict_layers"] = f"{d} with model.layers.{L + stored.index(False)}.eh_proj.weight missing"
    for k in range(d):
        kind = lambda moe: "MoE" if moe else "dense"
        if (f"model.layers.{L + k}.mlp.gate.weight" in sd) != moe_last:
            bad[f"model.layers.{L + k}.mlp"] = (f"{kind(not moe_last)}, the last decoder layer's (which the MTP layer "
                                                f"is built as) {kind(moe_last)}")
    return d


def _hf_layer(H: str, O: str, hc, expert_bias: bool) -> list:
    """Rename rules of HF's decoder layer (prefix regex H, one group) -> our TransformerLayer (O): MLA, whose RoPE rows
    rope_interleave=False re-orders (hf_to_ours), and Llama's MLP or MoE layout."""
    dn, dr, n = hc.qk_nope_head_dim, hc.qk_rope_head_dim, hc.num_attention_heads
    pairs = lambda w: rearrange(w, "... (two half) h -> ... (half two) h", two=2)  # halves -> interleaved pairs

    def rope_rows(heads: bool):  # q [n·(dn+dr), h] or kv_a [rkv+dr, h] -> its RoPE rows in our interleaved order
        if getattr(hc, "rope_interleave", True):
            return lambda w: w
        if not heads:
            return lambda w: torch.cat([w[:-dr], pairs(w[-dr:])])
        return lambda w: rearrange(torch.cat([(w := rearrange(w, "(n d) h -> n d h", n=n))[:, :dn], pairs(w[:, dn:])], 1),
                                   "n d h -> (n d) h")
    return [*[(H + re.escape(a) + r"\.weight", O + b + ".weight") for a, b in _MLA.items()],
            *[(H + re.escape(a) + r"\.weight", O + b + ".weight", rope_rows(q)) for a, (b, q) in _MLA_ROPE.items()],
            (H + r"mlp\.gate\.e_score_correction_bias", O + "mlp.router.expert_bias" if expert_bias else None),
            *convert.mlp_renames(H, O)]


def hf_to_ours(src, Config, dtype=None) -> tuple:
    """(gpt.Config, full state dict) of a `transformers` DeepseekV3ForCausalLM: multi-latent attention (with or without
    q-lora), dense layers, and MoE layers with shared experts, and the multi-token prediction layers that DeepSeek's
    own checkpoints store after the decoder's (_hf_mtp; transformers' model has none).

    RoPE: HF's rope_interleave=True rotates interleaved pairs by de-interleaving first, exactly Megatron's MLA RoPE
    (apply_mla_rope): the weights map as they are. rope_interleave=False rotates halves; its RoPE rows are
    re-ordered [x0..x_{d/2-1} | x_{d/2}..] -> (x0, x_{d/2}), (x1, x_{d/2+1}), ... so that our de-interleave restores
    HF's layout (q and k alike: q·k unchanged). rope_type "yarn" maps as convert.rope_fields maps it (DeepSeek-V3
    ships with it); its softmax mscale (HF's yarn_apply_mscale) is then MLASelfAttention's, Megatron's.
    Refused, naming the value: rope types Megatron's MLA lacks (linear, llama3, ...), a yarn mscale_all_dim without
    mscale (HF's rope then ignores mscale_all_dim but its softmax does not: no Megatron mscale pair gives both), attention
    biases, num_key_value_heads != num_attention_heads, latent norms whose eps differs from rms_norm_eps (HF's
    q_a/kv_a_layernorm use 1e-6), and routing the router cannot do yet (expert bias, groups, scaling factor)."""
    hc, sd = src.config, src.state_dict()
    fields = set(Config.__dataclass_fields__)
    rp = getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    bad = convert.unlike(hc, dict(attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6,
                                  num_key_value_heads=hc.num_attention_heads))
    if kind not in ("default", "yarn"):  # Megatron's MLA has rope_type rope | yarn only
        bad["rope_type"] = kind
    elif kind == "yarn" and rp.get("mscale_all_dim") and not rp.get("mscale"):
        bad.update(rope_type=kind, mscale=rp.get("mscale"), mscale_all_dim=rp["mscale_all_dim"])
    L, k_dense = hc.num_hidden_layers, min(hc.first_k_dense_replace, hc.num_hidden_layers)
    moe = {}
    if k_dense < L:
        moe = dict(num_experts=hc.n_routed_experts, moe_layer_freq=[0] * k_dense + [1] * (L - k_dense),
                   moe_ffn_hidden_size=hc.moe_intermediate_size, moe_router_topk=hc.num_experts_per_tok,
                   moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.0,
                   moe_shared_expert_intermediate_size=hc.moe_intermediate_size * hc.n_shared_experts or None)
        for name, (plain, field) in HF_ROUTING.items():
            if field in fields:
                moe[field] = getattr(hc, name)
            elif getattr(hc, name) != plain:
                bad[name] = getattr(hc, name)
        if hc.n_group > 1 and hc.num_experts_per_tok // hc.topk_group != 2:  # a group's score: HF sums its top-2
            bad.update(topk_group=hc.topk_group, num_experts_per_tok=hc.num_experts_per_tok)  # experts, Megatron (ours)
            # its top k // group_topk (parallel.topk_routing): the same only when that is 2, as in DeepSeek-V3 (8 / 4)
        if hc.norm_topk_prob != (hc.num_experts_per_tok > 1):  # our sigmoid router renormalises iff k > 1
            bad.update(norm_topk_prob=hc.norm_topk_prob, num_experts_per_tok=hc.num_experts_per_tok)
        if "moe_router_enable_expert_bias" in fields:  # (the bias is then a buffer: no value is read here)
            moe["moe_router_enable_expert_bias"] = True
        elif any(bool(sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].any()) for i in range(k_dense, L)):
            bad["e_score_correction_bias"] = "non-zero"
    mtp = _hf_mtp(hc, sd, moe_last=k_dense < L, bad=bad)
    if bad:
        raise ValueError(f"gpt.from_hf: DeepseekV3 settings this model cannot represent: {bad}")
    c = convert.config_from(Config, src, dtype, dict(
        convert.HF_FIELDS, kv_channels="v_head_dim", layernorm_epsilon="rms_norm_eps", q_lora_rank="q_lora_rank",
        kv_lora_rank="kv_lora_rank", qk_head_dim="qk_nope_head_dim", qk_pos_emb_head_dim="qk_rope_head_dim",
        v_head_dim="v_head_dim", share_embeddings_and_output_weights=lambda hc: bool(hc.tie_word_embeddings)),
        mtp_num_layers=mtp, **convert.rope_fields(hc), normalization="RMSNorm", activation="silu", gated_linear_unit=True,
        add_bias_linear=False, multi_latent_attention=True, **moe)
    bias = "moe_router_enable_expert_bias" in fields
    mtp_of = lambda m: f"mtp.{int(m[1]) - L}." if int(m[1]) >= L else m[0]  # MTP depth k + 1: model.layers.{L + k}
    renames = [*convert.LLAMA_TOP, *_hf_layer(r"model\.layers\.(\d+)\.", r"decoder.layers.\1.", hc, bias),
               (r"mtp\.(\d+)\.(enorm|hnorm|eh_proj)\.weight", r"mtp.layers.\1.\2.weight"),
               (r"mtp\.(\d+)\.shared_head\.norm\.weight", r"mtp.layers.\1.final_layernorm.weight"),
               (r"mtp\.\d+\.(embed_tokens|shared_head\.head)\.weight", None),  # copies (HF_LAYOUT)
               *_hf_layer(r"mtp\.(\d+)\.", r"mtp.layers.\1.transformer_layer.", hc, bias)]
    full = convert.renamed({re.sub(r"^model\.layers\.(\d+)\.", mtp_of, k): v for k, v in sd.items()}, renames,
                           "gpt.from_hf: deepseek_v3")
    return c, convert.vocab(c, convert.llama_join(full, 1))
