"""interop/convert.py — checkpoint converters, a data layer below the model files: Hugging Face `transformers` models and
Megatron-core state dicts -> (our Config, our full state dict {global parameter name: tensor}).

It imports no model file (only parallel.py, transformer.py for YaRN's mscale, tokenizer_files.py for special tokens), and returns
plain data: a Hugging Face converter takes the HF model and the model file's Config class (for derived values such as
padded_vocab_size and num_query_groups) and returns (Config, full state dict); `megatron_state` takes the state dict
and our config. Each model file's `from_hf` / `from_megatron` builds its Model and hands it the full state dict with
`load`. So the imports run one way, parallel, rope, tokenizer_files <- convert <- gpt <- bert / t5 / retro / mamba, and every
external layout sits here side by side.
  Hugging Face   GPT-2, Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (gpt.py's
                 HF_CONVERTERS, by model_type), BERT (bert.py), T5 (t5.py), Mamba-2 (mamba.py): our external oracles —
                 tests/test_hf.py, test_mla_mtp.py, test_bert.py, test_t5.py, test_mamba.py check that the logits match.
  Megatron-core  GPTModel (dense and MoE), BertModel, T5Model, RetroModel: a rename, since our names and layouts are
                 Megatron's — tests/test_megatron_parity*.py check logits, loss and every gradient in float64.
                 Its distributed checkpoints (dist_checkpointing, torch_dist) are read by megatron_dist_state without
                 Megatron-core (layers and experts un-stacked, SwiGLU halves joined: the dict megatron_state takes)
                 and written by to_megatron_dist, which Megatron-core's dist_checkpointing.load takes
                 (`tools.py import-megatron` / `export-megatron`; tests/test_megatron_dist.py: the logits in float64).
  Export         gpt_to_hf, the inverse of gpt_from_hf: GPT-2, Llama, Mixtral directories (`tools.py export`) —
                 tests/test_export.py loads them with transformers and compares the logits; save_hf writes them with
                 the tokenizer, its special tokens and chat template, ready to serve (tests/test_serve_export.py).
Mirrors the name maps of Megatron-LM's tools/checkpoint/ loaders and of transformers' Megatron conversion scripts.

Layouts met on the way in
  fused QKV    HF: [q; k; v] of all heads (GPT-2's c_attn, BERT's three Linears, T5's q/k/v, Llama's q/k/v_proj)
               -> Megatron's per query group [q heads of g; k_g; v_g] (per head [q_h; k_h; v_h] without GQA)
  GPT-2        Conv1D stores [in, out]; nn.Linear (and ours) [out, in]
  SwiGLU       HF gate_proj / up_proj (T5: wi_0 / wi_1) -> linear_fc1 = [gate; up]; MoE experts' gate_up_proj [E, 2f, h]
               is [gate; up] per expert already
  routing      HF's softmax over all experts then top-k = moe_router_pre_softmax; renormalised (Mixtral, norm_topk_prob)
               = softmax over the top-k logits (_hf_moe_fields)
  BERT         post-LN = our stack with apply_residual_connection_post_layernorm, its norms shifted by one layer
  vocabulary   rows zero-padded (or cut) to our padded_vocab_size, which does not depend on TP; pad rows are never
               targets and their logits are cut before the caller sees them

Dimension glossary: gpt.py's (n heads, g query groups, d head dim, h hidden, V vocabulary).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange

import parallel as P
from interop import hf, tokenizer_files
from transformer import yarn_mscale


# ---------------------------------------------------------------------------------------------- Hugging Face: GPT-2, Llama
def gpt_from_hf(hf, Config, dtype=None) -> tuple:
    """(gpt.Config, full state dict) of a `transformers` GPT2LMHeadModel or LlamaForCausalLM (logits match)."""
    hc = hf.config
    if hc.model_type == "llama":
        return _llama_layout(hf, Config, dtype)
    if hc.model_type != "gpt2":
        raise ValueError(f"gpt.from_hf: unsupported model_type {hc.model_type!r} (gpt_from_hf reads gpt2 and llama)")
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    c = Config(num_layers=hc.n_layer, hidden_size=hc.n_embd, num_attention_heads=hc.n_head,
               ffn_hidden_size=hc.n_inner or 4 * hc.n_embd, max_position_embeddings=hc.n_positions,
               layernorm_epsilon=hc.layer_norm_epsilon, activation="gelu_tanh", vocab_size=hc.vocab_size,
               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype or next(hf.parameters()).dtype,
               mask_vocab_padding=True)  # transformers' loss has no padded rows
    full = {"embedding.word_embeddings.weight": sd["transformer.wte.weight"],
            "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
            "decoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
            "decoder.final_layernorm.bias": sd["transformer.ln_f.bias"]}
    names = {"ln_1": "input_layernorm", "attn.c_attn": "self_attention.linear_qkv", "ln_2": "pre_mlp_layernorm",
             "attn.c_proj": "self_attention.linear_proj", "mlp.c_fc": "mlp.linear_fc1", "mlp.c_proj": "mlp.linear_fc2"}
    for i in range(c.num_layers):
        for src, dst in names.items():
            for kind in ("weight", "bias"):
                t = sd[f"transformer.h.{i}.{src}.{kind}"]
                if kind == "weight" and not src.startswith("ln"):
                    t = t.t()  # HF's Conv1D stores [in, out]
                if src == "attn.c_attn":  # [q; k; v] of all heads -> Megatron's per-head [q_h; k_h; v_h]
                    t = rearrange(t, "(three n d) ... -> (n three d) ...", three=3, n=c.num_attention_heads)
                full[f"decoder.layers.{i}.{dst}.{kind}"] = t
    return c, _pad_vocab(c, full)


def _pad_vocab(c, full: dict) -> dict:
    for k in [k for k in full if k.endswith("word_embeddings.weight") or k == "output_layer.weight"]:
        full[k] = F.pad(full[k], (0, 0, 0, c.padded_vocab_size - c.vocab_size))  # padded rows are never targets
    return full


def _llama_layout(hf, Config, dtype=None, qkv_bias: bool = False, qk_norm: bool = False, **moe) -> tuple:
    """(gpt.Config, full state dict) of a model in Llama's layout — pre-RMSNorm layers, RoPE (_rope_fields),
    grouped-query attention from separate q/k/v_proj, SwiGLU gate/up/down_proj, no other biases — which Mistral,
    Qwen2/3 and the MoE families below share. qkv_bias: q/k/v_proj have biases (Qwen2's; o_proj none) -> add_qkv_bias;
    qk_norm: an RMSNorm over each head's d dims on q and k before RoPE (Qwen3's q_norm/k_norm) -> qk_layernorm;
    moe: _hf_moe_fields' Config fields, whose MoE layers hold mlp.gate (the router) and mlp.experts.gate_up_proj
    [E, 2f, h] / down_proj [E, h, f], plus mlp.shared_expert(_gate) when there is one.
    Refused by name: hidden_act other than silu, attention_bias (Llama's and Qwen3's also bias o_proj, which our
    layers cannot without biasing every linear) and mlp_bias."""
    hc, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    bad = [f"{k}={getattr(hc, k)!r}" for k, ok in [("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)]
           if getattr(hc, k, ok) != ok]
    if bad:
        raise ValueError(f"gpt.from_hf: {hc.model_type} with {', '.join(bad)} is not supported (silu, no biases are)")
    c = Config(num_layers=hc.num_hidden_layers, hidden_size=hc.hidden_size, num_attention_heads=hc.num_attention_heads,
               num_query_groups=hc.num_key_value_heads, kv_channels=getattr(hc, "head_dim", None),
               ffn_hidden_size=hc.intermediate_size, max_position_embeddings=hc.max_position_embeddings,
               normalization="RMSNorm", **_rope_fields(hc), layernorm_epsilon=hc.rms_norm_eps, activation="silu",
               gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm,
               share_embeddings_and_output_weights=hc.tie_word_embeddings, vocab_size=hc.vocab_size, hidden_dropout=0.0,
               attention_dropout=0.0, params_dtype=dtype or next(hf.parameters()).dtype, mask_vocab_padding=True, **moe)
    g = c.num_query_groups
    full = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not c.share_embeddings_and_output_weights:
        full["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(c.num_layers):
        h, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (rearrange(sd[h + f"self_attn.{t}_proj.weight"], "(g r) h -> g r h", g=g) for t in "qkv")
        full.update({o + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
                     o + "self_attention.linear_qkv.weight": rearrange(torch.cat([q, k, v], 1), "g r h -> (g r) h"),
                     o + "self_attention.linear_proj.weight": sd[h + "self_attn.o_proj.weight"],
                     o + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"]})
        if c.add_qkv_bias:
            q, k, v = (rearrange(sd[h + f"self_attn.{t}_proj.bias"], "(g r) -> g r", g=g) for t in "qkv")
            full[o + "self_attention.linear_qkv.bias"] = torch.cat([q, k, v], 1).flatten()
        if c.qk_layernorm:
            full[o + "self_attention.q_layernorm.weight"] = sd[h + "self_attn.q_norm.weight"]
            full[o + "self_attention.k_layernorm.weight"] = sd[h + "self_attn.k_norm.weight"]
        m, om = h + "mlp.", o + "mlp."
        mlps = [(m + "shared_expert.", om + "shared_experts.")] if c.moe_shared_expert_intermediate_size else []
        for src, dst in mlps if c.is_moe_layer(i) else [(m, om)]:  # the dense MLP, or the MoE layer's shared expert
            full[dst + "linear_fc1.weight"] = torch.cat([sd[src + "gate_proj.weight"], sd[src + "up_proj.weight"]])
            full[dst + "linear_fc2.weight"] = sd[src + "down_proj.weight"]
        if c.is_moe_layer(i):
            full[om + "router.weight"] = sd[m + "gate.weight"]
            for e in range(c.num_experts):  # HF's gate_up_proj [E, 2f, h] is [gate; up] per expert, as our fc1
                full[om + f"experts.linear_fc1.weight{e}"] = sd[m + "experts.gate_up_proj"][e]
                full[om + f"experts.linear_fc2.weight{e}"] = sd[m + "experts.down_proj"][e]
            if c.moe_shared_expert_gate:
                full[om + "shared_experts.gate_weight"] = sd[m + "shared_expert_gate.weight"]  # [1, h]
    return c, _pad_vocab(c, full)


# ---------------------------------------------------------------------------------------------- Hugging Face: Llama's family
# Each converter checks what its family adds to Llama's layout and hands the rest to _llama_layout.
def _full_attention(hc, every_layer: bool):
    """Refuse a sliding window that changes the logits: we have no sliding-window attention. Mistral, Mixtral and
    Qwen3-MoE slide every layer when sliding_window is set (`every_layer`); Qwen2, Qwen3 and Qwen2-MoE only the
    layers layer_types calls "sliding_attention". A window >= max_position_embeddings hides no position: accepted."""
    types = list(getattr(hc, "layer_types", None) or [])
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"gpt.from_hf: {hc.model_type} layer_types {unknown} are not supported (full_attention is)")
    w = getattr(hc, "sliding_window", None)
    slides = w is not None if every_layer else "sliding_attention" in types
    if slides and (w or 0) < hc.max_position_embeddings:
        where = "" if every_layer else f" on layers {[i for i, t in enumerate(types) if t == 'sliding_attention']}"
        raise ValueError(f"gpt.from_hf: {hc.model_type} sliding_window={w}{where} < max_position_embeddings="
                         f"{hc.max_position_embeddings}: sliding-window attention is not implemented here")


def _hf_moe_fields(hc, num_experts: int, renormalise: bool, moe_layers: list, shared: int | None = None) -> dict:
    """Config fields of HF MoE layers. Routing: HF takes softmax over all E experts, then the top k; without
    renormalisation those k probabilities weigh the experts = Megatron's moe_router_pre_softmax; renormalised to sum 1
    (Mixtral, norm_topk_prob) they are softmax over the k chosen logits = the top k of the logits, then softmax
    (pre_softmax off). moe_layers: 0/1 per layer. router_aux_loss_coef and output_router_logits shape a training loss,
    not the logits: not mapped (train with --moe-aux-loss-coeff)."""
    if getattr(hc, "router_jitter_noise", 0.0):
        raise ValueError(f"gpt.from_hf: {hc.model_type} router_jitter_noise={hc.router_jitter_noise} is not supported "
                         "(our router has no jitter)")
    if not any(moe_layers):
        return {}
    return dict(num_experts=num_experts, moe_router_topk=hc.num_experts_per_tok, moe_router_pre_softmax=not renormalise,
                moe_ffn_hidden_size=getattr(hc, "moe_intermediate_size", hc.intermediate_size),
                moe_layer_freq=1 if all(moe_layers) else [int(x) for x in moe_layers],
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=shared is not None)


def _qwen_moe_layers(hc) -> list:
    """Qwen-MoE's sparse layers: layer i is MoE unless in mlp_only_layers, when num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0 (Megatron's moe_layer_freq counts from layer 0: a 0/1 list then)."""
    return [i not in (hc.mlp_only_layers or []) and hc.num_experts > 0 and (i + 1) % hc.decoder_sparse_step == 0
            for i in range(hc.num_hidden_layers)]


def mistral_from_hf(hf, Config, dtype=None) -> tuple:
    """MistralForCausalLM: Llama's layout; its sliding_window must be None (Mistral-7B-v0.2 on) or hide nothing."""
    _full_attention(hf.config, every_layer=True)
    return _llama_layout(hf, Config, dtype)


def mixtral_from_hf(hf, Config, dtype=None) -> tuple:
    """MixtralForCausalLM: Mistral with MoE in every layer, the top k of softmax renormalised (the inverse of
    gpt_to_hf's Mixtral export)."""
    hc = hf.config
    _full_attention(hc, every_layer=True)
    return _llama_layout(hf, Config, dtype, **_hf_moe_fields(hc, hc.num_local_experts, True, [1] * hc.num_hidden_layers))


def qwen2_from_hf(hf, Config, dtype=None) -> tuple:
    """Qwen2ForCausalLM: Llama's layout with biases on q/k/v_proj (not o_proj) -> add_qkv_bias."""
    _full_attention(hf.config, every_layer=False)
    return _llama_layout(hf, Config, dtype, qkv_bias=True)


def qwen3_from_hf(hf, Config, dtype=None) -> tuple:
    """Qwen3ForCausalLM: Llama's layout with an explicit head_dim and per-head RMSNorms on q and k before RoPE
    (q_norm, k_norm: rms_norm_eps) -> qk_layernorm; attention_bias (q/k/v and o_proj) refused."""
    _full_attention(hf.config, every_layer=False)
    return _llama_layout(hf, Config, dtype, qk_norm=True)


def qwen2_moe_from_hf(hf, Config, dtype=None) -> tuple:
    """Qwen2MoeForCausalLM: Qwen2's attention (qkv_bias) and, on the layers _qwen_moe_layers picks, routed experts
    (moe_intermediate_size; norm_topk_prob) plus a shared expert (shared_expert_intermediate_size) whose output is
    scaled by sigmoid(shared_expert_gate(x)) -> moe_shared_expert_gate; other layers a dense MLP (intermediate_size)."""
    hc = hf.config
    _full_attention(hc, every_layer=False)
    moe = _hf_moe_fields(hc, hc.num_experts, hc.norm_topk_prob, _qwen_moe_layers(hc), hc.shared_expert_intermediate_size)
    return _llama_layout(hf, Config, dtype, qkv_bias=hc.qkv_bias, **moe)


def qwen3_moe_from_hf(hf, Config, dtype=None) -> tuple:
    """Qwen3MoeForCausalLM: Qwen3's attention (q/k norms) and Qwen2-MoE's layer choice and routing, no shared expert."""
    hc = hf.config
    _full_attention(hc, every_layer=True)
    return _llama_layout(hf, Config, dtype, qk_norm=True,
                         **_hf_moe_fields(hc, hc.num_experts, hc.norm_topk_prob, _qwen_moe_layers(hc)))


def _rope_theta(hc) -> float:
    rp = getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {}
    return float(rp.get("rope_theta", getattr(hc, "rope_theta", 10000.0)))


_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
              "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "attention_factor", "truncate"}}


def _rope_fields(hc) -> dict:
    """HF Llama's rope_parameters (transformers 5; `rope_scaling` before) -> our Config's position fields (transformer.py).
    Maps "default", "linear" (-> seq_len_interpolation_factor), "llama3" (-> rope_scaling*) and "yarn" (-> yarn_*,
    position_embedding_type "yarn"); refuses any other rope_type (dynamic, longrope, ...) and any key it does not
    know, naming it: ignoring one would silently change the logits."""
    rp = dict(getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {})
    kind = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    if kind not in _ROPE_KEYS:
        raise ValueError(f"gpt.from_hf: rope_type {kind!r} is not supported (default, linear, llama3, yarn are)")
    rp.pop("rope_theta", None)
    partial = rp.pop("partial_rotary_factor", None)
    if partial not in (None, 1, 1.0):  # its default rope rotates every dim anyway, its scaled ropes fail on it
        raise ValueError(f"gpt.from_hf: partial_rotary_factor={partial}: HF's Llama does not apply it, so no "
                         "rotary_percent reproduces its logits")
    unknown = sorted(set(rp) - _ROPE_KEYS[kind])
    if unknown:
        raise ValueError(f"gpt.from_hf: rope_type {kind!r} with unknown key(s) {unknown}")
    out = dict(position_embedding_type="rope", rotary_base=_rope_theta(hc))
    orig = rp.get("original_max_position_embeddings") or hc.max_position_embeddings
    if kind == "linear":
        out.update(seq_len_interpolation_factor=float(rp["factor"]))
    elif kind == "llama3":
        out.update(rope_scaling=True, rope_scaling_factor=float(rp["factor"]),
                   rope_scaling_low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
                   rope_scaling_high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
                   rope_scaling_original_max_position_embeddings=int(orig))
    elif kind == "yarn":  # HF's _compute_yarn_parameters, written as Megatron's yarn_* fields
        factor = float(rp.get("factor") or hc.max_position_embeddings / orig)
        mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
        if not (mscale and mscale_all_dim):  # HF then uses m(factor, 1) alone: Megatron's m(f, 1) / m(f, 0)
            mscale, mscale_all_dim = 1.0, 0.0
        out.update(position_embedding_type="yarn", yarn_rotary_scaling_factor=factor,
                   yarn_original_max_position_embeddings=int(orig), yarn_beta_fast=float(rp.get("beta_fast") or 32),
                   yarn_beta_slow=float(rp.get("beta_slow") or 1), yarn_mscale=float(mscale),
                   yarn_mscale_all_dim=float(mscale_all_dim),
                   yarn_correction_range_round_to_int=bool(rp.get("truncate", True)))
        implied = yarn_mscale(factor, mscale, mscale_all_dim)
        if rp.get("attention_factor") is not None and abs(rp["attention_factor"] - implied) > 1e-12:
            raise ValueError(f"gpt.from_hf: yarn attention_factor={rp['attention_factor']} differs from the mscale "
                             f"{implied} that factor/mscale/mscale_all_dim give (Megatron has no separate field)")
    return out

# ---------------------------------------------------------------------------------------------- Hugging Face: DeepSeek-V3
# The router features DeepSeek-V3 needs beyond gpt.Config's sigmoid top-k (parallel.py section 10): HF's value that
# needs no field, and the Config field (Megatron's name) that represents any other value once the router has it.
_DEEPSEEK_ROUTING = {"n_group": (1, "moe_router_num_groups"), "topk_group": (1, "moe_router_group_topk"),
                     "routed_scaling_factor": (1.0, "moe_router_topk_scaling_factor")}


def _deepseek_mtp(hc, sd, moe_last: bool, bad: dict) -> int | None:
    """mtp_num_layers of a DeepSeek-V3 state: config.json's num_nextn_predict_layers D when the state holds their
    tensors — depth k + 1 is stored after the decoder's L layers as model.layers.{L + k}: a whole decoder layer plus
    enorm, hnorm, eh_proj [h, 2h] and shared_head.norm (our MTPLayer's final_layernorm); its embed_tokens and
    shared_head.head are copies of the model's embedding and output weights, which our MTP shares as Megatron's
    does (hf.copies_of: the import checks they are equal). None when the state holds none of them: transformers'
    DeepseekV3 neither builds nor saves them. Refused into `bad`: some depths stored and not others, and an MTP layer
    whose MLP kind (dense / MoE) is not the last decoder layer's, which is what Megatron builds it as."""
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


def deepseek_from_hf(hf, Config, dtype=None) -> tuple:
    """(gpt.Config, full state dict) of a `transformers` DeepseekV3ForCausalLM: multi-latent attention (with or without
    q-lora), dense layers, and MoE layers with shared experts (deepseek.py), and the multi-token prediction layers
    that DeepSeek's own checkpoints store after the decoder's (_deepseek_mtp; transformers' model has none).

    RoPE: HF's rope_interleave=True rotates interleaved pairs by de-interleaving first, exactly Megatron's MLA RoPE
    (deepseek.apply_mla_rope): the weights map as they are. rope_interleave=False rotates halves; its RoPE rows are
    re-ordered [x0..x_{d/2-1} | x_{d/2}..] -> (x0, x_{d/2}), (x1, x_{d/2+1}), ... so that our de-interleave restores
    HF's layout (q and k alike: q·k unchanged). rope_type "yarn" maps as _rope_fields maps it (DeepSeek-V3 ships
    with it); its softmax mscale (HF's yarn_apply_mscale) is then deepseek.MLASelfAttention's, Megatron's.
    Refused, naming the value: rope types Megatron's MLA lacks (linear, llama3, ...), a yarn mscale_all_dim without
    mscale (HF's rope then ignores mscale_all_dim but its softmax does not: no Megatron mscale pair gives both), attention
    biases, num_key_value_heads != num_attention_heads, latent norms whose eps differs from rms_norm_eps (HF's
    q_a/kv_a_layernorm use 1e-6), and routing the router cannot do yet (expert bias, groups, scaling factor)."""
    hc, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    fields = {f for f in Config.__dataclass_fields__}
    rp = getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    bad = {k: v for k, v in dict(attention_bias=hc.attention_bias,
                                 hidden_act=hc.hidden_act, rms_norm_eps=hc.rms_norm_eps,
                                 num_key_value_heads=hc.num_key_value_heads).items()
           if v != dict(attention_bias=False, hidden_act="silu", rms_norm_eps=1e-6,
                        num_key_value_heads=hc.num_attention_heads)[k]}
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
        for name, (plain, field) in _DEEPSEEK_ROUTING.items():
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
    mtp = _deepseek_mtp(hc, sd, moe_last=k_dense < L, bad=bad)
    if bad:
        raise ValueError(f"gpt.from_hf: DeepseekV3 settings this model cannot represent: {bad}")
    c = Config(num_layers=L, mtp_num_layers=mtp, hidden_size=hc.hidden_size, num_attention_heads=hc.num_attention_heads,
               kv_channels=hc.v_head_dim, ffn_hidden_size=hc.intermediate_size, vocab_size=hc.vocab_size,
               max_position_embeddings=hc.max_position_embeddings, **_rope_fields(hc),
               normalization="RMSNorm", layernorm_epsilon=hc.rms_norm_eps,
               activation="silu", gated_linear_unit=True, add_bias_linear=False,
               share_embeddings_and_output_weights=bool(hc.tie_word_embeddings), hidden_dropout=0.0,
               attention_dropout=0.0, params_dtype=dtype or next(hf.parameters()).dtype, multi_latent_attention=True,
               mask_vocab_padding=True,
               q_lora_rank=hc.q_lora_rank, kv_lora_rank=hc.kv_lora_rank, qk_head_dim=hc.qk_nope_head_dim,
               qk_pos_emb_head_dim=hc.qk_rope_head_dim, v_head_dim=hc.v_head_dim, **moe)
    dn, dr = c.qk_head_dim, c.qk_pos_emb_head_dim

    def rope_rows(w, heads):  # [heads·(dn+dr) or rkv+dr, h]: the RoPE rows of each head in our interleaved order
        if getattr(hc, "rope_interleave", True):
            return w
        if heads == 0:  # kv_a_proj: [rkv | dr]
            return torch.cat([w[:-dr], rearrange(w[-dr:], "(two half) h -> (half two) h", two=2)])
        w = rearrange(w, "(n d) h -> n d h", n=heads)
        return rearrange(torch.cat([w[:, :dn], rearrange(w[:, dn:], "n (two half) h -> n (half two) h", two=2)], 1),
                         "n d h -> (n d) h")

    full = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not c.share_embeddings_and_output_weights:
        full["output_layer.weight"] = sd["lm_head.weight"]
    n = c.num_attention_heads

    def layer(h, o, moe: bool):  # HF's decoder layer `h` -> our TransformerLayer `o` (MLA, dense MLP or MoE)
        a, oa = h + "self_attn.", o + "self_attention."
        full.update({o + "input_layernorm.weight": sd[h + "input_layernorm.weight"],
                     o + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"],
                     oa + "linear_kv_down_proj.weight": rope_rows(sd[a + "kv_a_proj_with_mqa.weight"], 0),
                     oa + "kv_layernorm.weight": sd[a + "kv_a_layernorm.weight"],
                     oa + "linear_kv_up_proj.weight": sd[a + "kv_b_proj.weight"],
                     oa + "linear_proj.weight": sd[a + "o_proj.weight"]})
        if c.q_lora_rank is None:
            full[oa + "linear_q_proj.weight"] = rope_rows(sd[a + "q_proj.weight"], n)
        else:
            full.update({oa + "linear_q_down_proj.weight": sd[a + "q_a_proj.weight"],
                         oa + "q_layernorm.weight": sd[a + "q_a_layernorm.weight"],
                         oa + "linear_q_up_proj.weight": rope_rows(sd[a + "q_b_proj.weight"], n)})
        m, om = h + "mlp.", o + "mlp."
        shared = [(m + "shared_experts.", om + "shared_experts.")] if c.moe_shared_expert_intermediate_size else []
        for src, dst in shared if moe else [(m, om)]:  # the dense MLP, or the MoE layer's shared expert
            full[dst + "linear_fc1.weight"] = torch.cat([sd[src + "gate_proj.weight"], sd[src + "up_proj.weight"]])
            full[dst + "linear_fc2.weight"] = sd[src + "down_proj.weight"]
        if moe:
            full[om + "router.weight"] = sd[m + "gate.weight"]
            for e in range(c.num_experts):  # HF's gate_up_proj [E, 2f, h] is [gate; up] per expert, as our fc1
                full[om + f"experts.linear_fc1.weight{e}"] = sd[m + "experts.gate_up_proj"][e]
                full[om + f"experts.linear_fc2.weight{e}"] = sd[m + "experts.down_proj"][e]
            if "moe_router_enable_expert_bias" in fields:
                full[om + "router.expert_bias"] = sd[m + "gate.e_score_correction_bias"]
    for i in range(L):
        layer(f"model.layers.{i}.", f"decoder.layers.{i}.", moe=i >= k_dense)
    for k in range(c.mtp_num_layers or 0):  # depth k + 1, stored after the decoder's layers (_deepseek_mtp)
        h, o = f"model.layers.{L + k}.", f"mtp.layers.{k}."
        full.update({o + "enorm.weight": sd[h + "enorm.weight"], o + "hnorm.weight": sd[h + "hnorm.weight"],
                     o + "eh_proj.weight": sd[h + "eh_proj.weight"],
                     o + "final_layernorm.weight": sd[h + "shared_head.norm.weight"]})
        layer(h, o + "transformer_layer.", moe=k_dense < L)  # the kind of our last layer, as Megatron's
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in full:
            full[k] = F.pad(full[k], (0, 0, 0, c.padded_vocab_size - c.vocab_size))  # padded rows are never targets
    return c, full


# ---------------------------------------------------------------------------------------------- Hugging Face: BERT
def bert_from_hf(hf, Config, dtype=None) -> tuple:
    """(bert.Config, full state dict) of a `transformers` BertForPreTraining (or BertForMaskedLM: no binary head).

    HF BERT is post-LN: e = LN_emb(emb); per layer y = LN_att(e + attn(e)), e = LN_out(y + mlp(y)). That is our
    stack with apply_residual_connection_post_layernorm=True and the norms shifted by one: layer i's
    input_layernorm = LN_emb (i = 0) or layer i−1's LN_out, pre_mlp_layernorm = LN_att, final_layernorm = the last
    LN_out."""
    hc, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    if hc.model_type != "bert":
        raise ValueError(f"bert.from_hf: unsupported model_type {hc.model_type!r} (bert is)")
    if getattr(hc, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"bert.from_hf: position_embedding_type {hc.position_embedding_type!r} (absolute is supported)")
    binary = "cls.seq_relationship.weight" in sd
    tied = bool(getattr(hc, "tie_word_embeddings", True))
    c = Config(num_layers=hc.num_hidden_layers, hidden_size=hc.hidden_size, num_attention_heads=hc.num_attention_heads,
                    ffn_hidden_size=hc.intermediate_size, vocab_size=hc.vocab_size,
                    max_position_embeddings=hc.max_position_embeddings, layernorm_epsilon=hc.layer_norm_eps,
                    activation={"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}[hc.hidden_act],
                    num_tokentypes=hc.type_vocab_size, add_binary_head=binary, apply_residual_connection_post_layernorm=True,
                    share_embeddings_and_output_weights=tied, hidden_dropout=0.0, attention_dropout=0.0,
                    params_dtype=dtype or next(hf.parameters()).dtype, mask_vocab_padding=True)  # HF's loss: its vocab
    e, p = "bert.embeddings.", "cls.predictions."
    full = {"embedding.word_embeddings.weight": sd[e + "word_embeddings.weight"],
            "embedding.position_embeddings.weight": sd[e + "position_embeddings.weight"],
            "embedding.tokentype_embeddings.weight": sd[e + "token_type_embeddings.weight"],
            "lm_head.dense.weight": sd[p + "transform.dense.weight"], "lm_head.dense.bias": sd[p + "transform.dense.bias"],
            "lm_head.layer_norm.weight": sd[p + "transform.LayerNorm.weight"],
            "lm_head.layer_norm.bias": sd[p + "transform.LayerNorm.bias"], "output_layer.bias": sd[p + "bias"]}
    if not tied:
        full["output_layer.weight"] = sd[p + "decoder.weight"]
    if binary:
        full.update({"pooler.dense.weight": sd["bert.pooler.dense.weight"], "pooler.dense.bias": sd["bert.pooler.dense.bias"],
                     "binary_head.weight": sd["cls.seq_relationship.weight"],
                     "binary_head.bias": sd["cls.seq_relationship.bias"]})
    norm_in = e + "LayerNorm."
    for i in range(c.num_layers):
        h, o = f"bert.encoder.layer.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = torch.stack([sd[h + f"attention.self.{t}.{kind}"] for t in ("query", "key", "value")])
            full.update({
                o + f"input_layernorm.{kind}": sd[norm_in + kind],
                o + f"self_attention.linear_qkv.{kind}": rearrange(  # [q; k; v] -> Megatron's per head [q_h; k_h; v_h]
                    qkv, "three (n d) ... -> (n three d) ...", n=c.num_attention_heads),
                o + f"self_attention.linear_proj.{kind}": sd[h + f"attention.output.dense.{kind}"],
                o + f"pre_mlp_layernorm.{kind}": sd[h + f"attention.output.LayerNorm.{kind}"],
                o + f"mlp.linear_fc1.{kind}": sd[h + f"intermediate.dense.{kind}"],
                o + f"mlp.linear_fc2.{kind}": sd[h + f"output.dense.{kind}"]})
        norm_in = h + "output.LayerNorm."
    full.update({f"decoder.final_layernorm.{k}": sd[norm_in + k] for k in ("weight", "bias")})
    pad = c.padded_vocab_size - c.vocab_size  # padded rows / bias entries are zero: logit 0, never a target
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in full:
            full[k] = F.pad(full[k], (0, 0, 0, pad))
    full["output_layer.bias"] = F.pad(full["output_layer.bias"], (0, pad))
    return c, full


# ---------------------------------------------------------------------------------------------- Hugging Face: T5
def t5_from_hf(hf, Config, dtype=None) -> tuple:
    """(t5.Config, full state dict) of a `transformers` T5ForConditionalGeneration (logits match)."""
    hc, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    # tied: no lm_head of its own (a folder stores a tied one once), or a live model's lm_head is the embedding
    tied = "lm_head.weight" not in sd or (not sd["lm_head.weight"].is_meta
                                         and sd["lm_head.weight"].data_ptr() == sd["shared.weight"].data_ptr())
    gated = getattr(hc, "is_gated_act", hc.feed_forward_proj.startswith("gated"))
    act = {"relu": "relu", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}.get(hc.dense_act_fn)
    if act is None:
        raise ValueError(f"t5.from_hf: unsupported T5 feed_forward_proj {hc.feed_forward_proj!r}")
    c = Config(num_layers=hc.num_layers, encoder_num_layers=hc.num_layers, decoder_num_layers=hc.num_decoder_layers,
                  hidden_size=hc.d_model, num_attention_heads=hc.num_heads, kv_channels=hc.d_kv,
                  ffn_hidden_size=hc.d_ff, vocab_size=hc.vocab_size, position_embedding_type="relative",
                  relative_attention_num_buckets=hc.relative_attention_num_buckets,
                  relative_attention_max_distance=hc.relative_attention_max_distance, normalization="RMSNorm",
                  layernorm_epsilon=hc.layer_norm_epsilon, softmax_scale=1.0, activation=act, gated_linear_unit=gated,
                  add_bias_linear=False, share_embeddings_and_output_weights=tied, lm_head_bias=False,
                  scale_decoder_outputs=bool(getattr(hc, "scale_decoder_outputs", hc.tie_word_embeddings)),
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype or next(hf.parameters()).dtype,
                  mask_vocab_padding=True)  # transformers' loss has no padded rows (gpt.Model.postprocess)
    n = c.num_attention_heads
    full = {"embedding.word_embeddings.weight": sd["shared.weight"],
            "encoder.final_layernorm.weight": sd["encoder.final_layer_norm.weight"],
            "decoder.final_layernorm.weight": sd["decoder.final_layer_norm.weight"],
            "encoder_relative_pos_emb.relative_attention_bias.weight":
                sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
            "decoder_relative_pos_emb.relative_attention_bias.weight":
                sd["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]}
    if not tied:
        full["lm_head.output_layer.weight"] = sd["lm_head.weight"]
    for stack, depth in [("encoder", c.encoder_num_layers), ("decoder", c.decoder_num_layers)]:
        for i in range(depth):
            h, o = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            q, k, v = (rearrange(sd[h + f"0.SelfAttention.{t}.weight"], "(n d) x -> n d x", n=n) for t in "qkv")
            full[o + "self_attention.linear_qkv.weight"] = rearrange(torch.stack([q, k, v], 1), "n t d x -> (n t d) x")
            full[o + "self_attention.linear_proj.weight"] = sd[h + "0.SelfAttention.o.weight"]
            full[o + "input_layernorm.weight"] = sd[h + "0.layer_norm.weight"]
            f = "1"
            if stack == "decoder":
                a = h + "1.EncDecAttention."
                k, v = (rearrange(sd[a + f"{t}.weight"], "(n d) x -> n d x", n=n) for t in "kv")
                full[o + "cross_attention.linear_q.weight"] = sd[a + "q.weight"]
                full[o + "cross_attention.linear_kv.weight"] = rearrange(torch.stack([k, v], 1), "n t d x -> (n t d) x")
                full[o + "cross_attention.linear_proj.weight"] = sd[a + "o.weight"]
                full[o + "pre_cross_attn_layernorm.weight"] = sd[h + "1.layer_norm.weight"]
                f = "2"
            m = h + f + ".DenseReluDense."
            full[o + "mlp.linear_fc1.weight"] = torch.cat([sd[m + "wi_0.weight"], sd[m + "wi_1.weight"]]) if gated \
                else sd[m + "wi.weight"]
            full[o + "mlp.linear_fc2.weight"] = sd[m + "wo.weight"]
            full[o + "pre_mlp_layernorm.weight"] = sd[h + f + ".layer_norm.weight"]
    for name in ("embedding.word_embeddings.weight", "lm_head.output_layer.weight"):
        if name in full:
            full[name] = F.pad(full[name], (0, 0, 0, c.padded_vocab_size - c.vocab_size))  # never targets
    return c, full


# ---------------------------------------------------------------------------------------------- Hugging Face: Mamba-2
def mamba_from_hf(hf, Config, dtype=None) -> tuple:
    """(mamba.Config, full state dict) of a `transformers` Mamba2ForCausalLM (logits match its torch path). HF's names and
    layouts are Megatron's ([z, x, B, C, dt] in_proj, [x, B, C] conv), so this is a rename plus vocabulary padding."""
    hc = hf.config
    if hc.model_type != "mamba2":
        raise ValueError(f"mamba.from_hf: model_type {hc.model_type!r} is not 'mamba2'")
    limit = tuple(getattr(hc, "time_step_limit", (0.0, float("inf"))))
    if hc.use_bias or not hc.use_conv_bias or hc.hidden_act != "silu" or limit != (0.0, float("inf")):
        raise ValueError(f"mamba.from_hf: Megatron's mixer has no in/out_proj bias, a conv bias, SiLU and no dt limit; got "
                         f"use_bias={hc.use_bias}, use_conv_bias={hc.use_conv_bias}, hidden_act={hc.hidden_act!r}, "
                         f"time_step_limit={limit}")
    c = Config(num_layers=hc.num_hidden_layers, hidden_size=hc.hidden_size, num_attention_heads=1,
                     vocab_size=hc.vocab_size, mamba_state_dim=hc.state_size, mamba_head_dim=hc.head_dim,
                     mamba_num_groups=hc.n_groups, mamba_num_heads=hc.num_heads, mamba_chunk_size=hc.chunk_size,
                     mamba_conv_kernel=hc.conv_kernel, layernorm_epsilon=hc.layer_norm_epsilon,
                     share_embeddings_and_output_weights=hc.tie_word_embeddings, mask_vocab_padding=True,
                     params_dtype=dtype or next(hf.parameters()).dtype)
    full = {}
    for k, v in hf.state_dict().items():
        k = {"backbone.embeddings.weight": "embedding.word_embeddings.weight", "lm_head.weight": "output_layer.weight",
             "backbone.norm_f.weight": "decoder.final_norm.weight"}.get(k, k.replace("backbone.layers.", "decoder.layers."))
        if k == "output_layer.weight" and c.share_embeddings_and_output_weights:
            continue
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            v = F.pad(v, (0, 0, 0, c.padded_vocab_size - c.vocab_size))  # padded rows are never targets
        full[k] = v.detach()
    return c, full


# ---------------------------------------------------------------------------------------------- into a model
def load(model, full: dict):
    """`model` with the weights of a full (unsharded) state dict {global name: tensor}, as the converters here
    return: each rank keeps its shard (and, under expert parallelism, its own experts)."""
    P.load_full_state_dict(model, full, model.grid)
    return model


# ---------------------------------------------------------------------------------------------- Megatron-core
def megatron_state(state_dict: dict, c, rename=None) -> dict:
    """A Megatron-core model's full (unsharded) state dict — `state_dict()` of a TP=1 model, or a distributed
    checkpoint loaded whole — -> our full state dict for model config `c` (`rename` maps a Megatron name to ours,
    None to drop it).
    Handled on the way in:
      - "module." prefixes (DDP / Float16Module wrappers) and `_extra_state` entries (Transformer Engine metadata);
      - the Transformer Engine spec's fused norms: linear_qkv.layer_norm_{weight,bias} is our input_layernorm,
        linear_fc1.layer_norm_{weight,bias} our pre_mlp_layernorm;
      - MoE experts: the local spec's SequentialMLP experts.local_experts.{i}.linear_fc{1,2}.weight are our
        (TEGroupedMLP-named) experts.linear_fc{1,2}.weight{i};
      - a tied checkpoint's copy of the embedding in the output layer (dropped);
      - vocabulary padding: Megatron pads to a multiple of make_vocab_size_divisible_by·tp, we pad independently of
        TP, so the embedding and output-layer rows (weight and bias) are cut or zero-padded to our
        padded_vocab_size. Rows past vocab_size are padding; the logits of real tokens are unchanged, the loss only
        when the padded sizes differ.
    """
    te_norms = {".self_attention.linear_qkv.layer_norm_": ".input_layernorm.",
                ".mlp.linear_fc1.layer_norm_": ".pre_mlp_layernorm."}
    full = {}
    for name, t in state_dict.items():
        while name.startswith("module."):
            name = name[len("module."):]
        if name.endswith("_extra_state") or t is None:
            continue
        for te, ours in te_norms.items():
            name = name.replace(te, ours)
        name = re.sub(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".experts.\2.weight\1", name)
        name = rename(name) if rename is not None else name
        if name is None or (name.endswith("output_layer.weight") and c.share_embeddings_and_output_weights):
            continue  # an alias, or a tied checkpoint's output-layer copy of the embedding
        full[name] = t.detach()
    for name in [k for k in full if k.endswith(("word_embeddings.weight", "output_layer.weight", "output_layer.bias"))]:
        t, rows = full[name], full[name].shape[0]
        if rows < c.vocab_size:
            raise ValueError(f"{name} has {rows} rows, fewer than vocab_size={c.vocab_size}")
        full[name] = F.pad(t[: c.padded_vocab_size], (0, 0) * (t.ndim - 1) + (0, max(0, c.padded_vocab_size - rows)))
    return full


# ---------------------------------------------------------------------------------------------- Megatron-core: torch_dist
# A checkpoint Megatron-core's dist_checkpointing.save writes with its default backend, "torch_dist":
#   metadata.json   {"sharded_backend": "torch_dist", ...}: how to read the rest (MEGATRON_DIST_METADATA)
#   common.pt       torch.save of what is not sharded (Megatron-LM: its args, iteration, ...; {} from a bare save)
#   .metadata, __R_K.distcp   a torch.distributed.checkpoint: every ShardedTensor under its *sharded key*, whole
#                   (its global shape), plus objects (Transformer Engine's `_extra_state`, RNG states) as bytes.
# A sharded key is not the state_dict name:
#   stacked layers  TransformerBlock saves layer i's tensors as row i of one tensor [L, ...] named without the index
#                   (decoder.layers.self_attention.linear_qkv.weight: [L, rows, h]), unless its layers differ (an MoE
#                   pattern, moe_layer_freq a list or > 1): then decoder.layers.{i}.X, one tensor each;
#   fused norms     the local spec's norms under the Transformer Engine spec's names (input_layernorm.weight as
#                   self_attention.linear_qkv.layer_norm_weight, pre_mlp_layernorm.weight as mlp.linear_fc1.layer_norm_
#                   weight): megatron_state renames both;
#   SwiGLU fc1      saved as two shards per TP rank (gate_r at row r·f/tp, up_r at row f + r·f/tp,
#                   apply_swiglu_sharded_factory), so the global tensor is [gate; up], our layout; with
#                   `singleton_local_shards` as two tensors, KEY_w (gate) and KEY_v (up), joined here;
#   MoE experts     SequentialMLP and TEGroupedMLP both save mlp.experts.experts.linear_fc{1,2}.weight with an expert
#                   axis [E, ...] after the layer axis (experts.experts.{e}.linear_fc... with singleton_local_shards).
MEGATRON_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                          "common_backend_version": 1}
_STACKED = re.compile(r"^(.*\.layers)\.(?!\d+\.)(.+)$")  # a layer-stacked key: .layers. not followed by an index
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.experts\.(linear_fc[12]\.(?:weight|bias)(?:_[wv])?)$")  # [E, ...]
_ONE_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.experts\.(\d+)\.(linear_fc[12]\..+)$")  # singleton_local_shards


_GPT_TENSOR = re.compile(r"^(embedding\.(word|position)_embeddings\.weight|decoder\.final_layernorm\.(weight|bias)|"
                         r"output_layer\.(weight|bias)|decoder\.layers\.\d+\.(input_layernorm|pre_mlp_layernorm|"
                         r"self_attention|mlp)\..+)$")  # what to_megatron_dist writes


class MegatronDistError(ValueError):
    """A Megatron distributed checkpoint this converter cannot read or write; the message names the key or setting."""


def _dist_reader(ckpt_dir: Path):
    """A torch.distributed.checkpoint reader of a torch_dist checkpoint directory (its metadata.json checked) that
    unpickles `.metadata` without Megatron-core: Megatron's MCoreMetadata and MCoreSavePlan (torch's Metadata and
    SavePlan plus `mcore_data`) are read as such dataclasses here; a class outside torch, collections and pathlib is
    refused by name."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import SavePlan

    meta = ckpt_dir / "metadata.json"
    if not meta.is_file():
        raise MegatronDistError(f"{ckpt_dir}: no metadata.json (not a Megatron-core distributed checkpoint)")
    backend = json.loads(meta.read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronDistError(f"{meta}: sharded_backend={backend!r}; only 'torch_dist' is read here")

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict | None = None

    @dataclasses.dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):  # (the metadata keeps every rank's save plan)
        mcore_data: dict | None = None

    megatron = {"MCoreMetadata": MCoreMetadata, "MCoreSavePlan": MCoreSavePlan}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "megatron.core.dist_checkpointing.strategies.torch" and name in megatron:
                return megatron[name]
            if module.split(".")[0] in ("torch", "collections", "pathlib"):  # (DCP's own metadata)
                return super().find_class(module, name)
            raise MegatronDistError(f"{ckpt_dir / '.metadata'}: refusing to unpickle {module}.{name}")

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(ckpt_dir / ".metadata", "rb") as f:
                md = Unpickler(f).load()
            md.storage_meta = md.storage_meta or StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return Reader(str(ckpt_dir))


def megatron_iteration_dir(ckpt_dir) -> Path:
    """The torch_dist directory itself, or, for a Megatron-LM --save directory (latest_checkpointed_iteration.txt
    beside iter_0000100/, or "release" beside release/), the checkpoint its tracker file names."""
    ckpt_dir = Path(ckpt_dir)
    tracker = ckpt_dir / "latest_checkpointed_iteration.txt"
    if (ckpt_dir / "metadata.json").is_file() or not tracker.is_file():
        return ckpt_dir
    text = tracker.read_text().strip()
    if text != "release" and not text.isdigit():
        raise MegatronDistError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
    return ckpt_dir / ("release" if text == "release" else f"iter_{int(text):07d}")


def megatron_dist_state(ckpt_dir) -> dict:
    """A Megatron-core torch_dist checkpoint directory (or a Megatron-LM run's: megatron_iteration_dir) -> {Megatron
    state_dict name: full tensor}, the dict `megatron_state` maps to ours. Megatron-core is not needed (nor imported):
    torch.distributed.checkpoint reads the files. Layer-stacked tensors are split into decoder.layers.{i}.X,
    expert-stacked ones into mlp.experts.local_experts.{e}.linear_fc{1,2}.weight, KEY_w / KEY_v pairs joined into
    [gate; up] (see above).
    Not read: objects (Transformer Engine's _extra_state, RNG states: bytes, no weights) and the optimizer's state
    (keys "optimizer.*"). A key this does not know passes through under its own name (the caller, which knows the
    model, refuses it by name)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt_dir = megatron_iteration_dir(ckpt_dir)
    reader = _dist_reader(ckpt_dir)
    md = reader.read_metadata()
    for key, info in (getattr(md, "mcore_data", None) or {}).items():
        if "nd_reformulated_orig_global_shape" in info and not key.startswith("optimizer."):
            raise MegatronDistError(f"{ckpt_dir}: {key} is saved flattened (nd_reformulated); not read here")
    stored = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}
    if not stored:
        raise MegatronDistError(f"{ckpt_dir}: holds no model tensors")
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is intended
        warnings.simplefilter("ignore")
        dcp.load(stored, storage_reader=reader, no_dist=True)

    def split(name, t):  # (name, tensor) pairs with the layer axis, then the expert axis, made indices of the name
        if (m := _STACKED.match(name)) is not None:
            return [pair for i, row in enumerate(t.unbind(0)) for pair in split(f"{m[1]}.{i}.{m[2]}", row)]
        if (m := _EXPERTS.match(name)) is not None:
            return [(f"{m[1]}.local_experts.{e}.{m[2]}", row) for e, row in enumerate(t.unbind(0))]
        if (m := _ONE_EXPERT.match(name)) is not None:
            return [(f"{m[1]}.local_experts.{m[2]}.{m[3]}", t)]
        return [(name, t)]

    out = {}
    for key, t in stored.items():
        out.update((name, row.clone()) for name, row in split(key, t))
    for name in [k for k in out if k.endswith("_w")]:  # singleton_local_shards' SwiGLU halves: [gate; up]
        up = name[:-2] + "_v"
        if up not in out:
            raise MegatronDistError(f"{ckpt_dir}: {name} (SwiGLU gate) has no {up} (up)")
        out[name[:-2]] = torch.cat([out.pop(name), out.pop(up)])
    return out


# Megatron-LM's args that shape the model, which are train.py's flags under the same names (arguments.py mirrors them)
_MEGATRON_LM_ARCH = ["num_layers", "hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size",
                     "max_position_embeddings", "seq_length", "position_embedding_type", "rotary_base", "rotary_percent",
                     "normalization", "norm_epsilon", "apply_layernorm_1p", "swiglu", "qk_layernorm",
                     "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "num_experts",
                     "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size"]


def megatron_lm_args(ckpt_dir) -> dict:
    """The architecture a Megatron-LM checkpoint records (common.pt's "args", its argparse.Namespace) as train.py flag
    values {dest: value}: the names above are the same; --disable-bias-linear is `not add_bias_linear`; num_query_groups
    counts only with group_query_attention. {} when common.pt holds no args (a bare dist_checkpointing.save).
    common.pt is unpickled with argparse.Namespace, torch, numpy and collections types as themselves and every other
    class (Megatron's enums, its other objects) as an inert stand-in, so that Megatron-LM need not be installed.
    Refused by name: a setting train.py has no flag for (add_qkv_bias)."""
    import argparse
    import pickle

    class StandIn:  # a class this reader does not need: holds what it was given, does nothing
        def __init__(self, *args, **kwargs):
            self.args = args

        def __setstate__(self, state):
            self.state = state

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("argparse", "Namespace") or module.split(".")[0] in ("torch", "numpy", "collections"):
                return super().find_class(module, name)
            return type(name, (StandIn,), {})

    ckpt_dir = megatron_iteration_dir(ckpt_dir)
    _dist_reader(ckpt_dir)  # (its metadata.json checked first)
    common = ckpt_dir / "common.pt"
    if not common.is_file():
        raise MegatronDistError(f"{common} is missing (not a Megatron-core distributed checkpoint)")
    state = torch.load(common, map_location="cpu", weights_only=False,
                       pickle_module=types.SimpleNamespace(Unpickler=Unpickler, load=pickle.load, __name__="pickle"))
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, argparse.Namespace):
        return {}
    a = vars(args)
    if a.get("add_qkv_bias"):
        raise MegatronDistError(f"{common}: Megatron-LM's add_qkv_bias=True has no train.py flag here")
    out = {k: a[k] for k in _MEGATRON_LM_ARCH if k in a}
    if "add_bias_linear" in a:
        out["disable_bias_linear"] = not a["add_bias_linear"]
    if "group_query_attention" in a:
        out["num_query_groups"] = a.get("num_query_groups") if a["group_query_attention"] else None
    return out


def megatron_dist_full(ckpt_dir, model) -> dict:
    """The full state dict (our names) for `model` from a torch_dist checkpoint: megatron_dist_state, then
    megatron_state for model.config; every name and shape must be the model's, or MegatronDistError names the first
    key that is missing, left over, or of another shape."""
    full = megatron_state(megatron_dist_state(ckpt_dir), model.config)
    want = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name in sorted(set(want) - set(full)):
        raise MegatronDistError(f"{ckpt_dir} lacks {name} (a tensor of the model these flags make)")
    for name in sorted(set(full) - set(want)):
        raise MegatronDistError(f"{ckpt_dir}: {name} is not a tensor of the model these flags make")
    for name, t in sorted(full.items()):
        if t.shape != want[name].shape:
            raise MegatronDistError(f"{ckpt_dir}: {name} has shape {list(t.shape)}, the model these flags make has "
                                    f"{list(want[name].shape)}")
    return full


def to_megatron_dist(full: dict, c, out_dir, padded_vocab_size: int | None = None) -> Path:
    """The inverse of megatron_dist_state: our full state dict (one process) of config `c` written as a torch_dist
    checkpoint that Megatron-core's `dist_checkpointing.load(model.sharded_state_dict(), out_dir)` loads into a
    GPTModel of the same architecture (local spec; tests/test_megatron_dist.py). Our names are Megatron's, so this is
    the sharded-key layout above: layers stacked unless moe_layer_freq makes them differ (Megatron's rule), norms and
    experts under their sharded keys, SwiGLU fc1 whole ([gate; up]), an empty `_extra_state` object for each linear
    layer (Megatron's local spec asks for them), metadata.json and an empty common.pt. `padded_vocab_size`: Megatron's
    vocabulary rows (its padding depends on TP: a multiple of make_vocab_size_divisible_by·tp); default ours.
    Refused by name: multi-latent attention and multi-token prediction (their sharded keys are not mapped here), and
    any tensor outside a GPTModel's embedding, decoder layers' attention / MLP / norms, final norm and output layer
    (another model file's: a BERT head, a Mamba mixer, cross-attention)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    for field in ("multi_latent_attention", "mtp_num_layers"):
        if getattr(c, field, None):
            raise MegatronDistError(f"export-megatron: {field}={getattr(c, field)!r} is not mapped to Megatron's "
                                    "sharded keys here")
    for name in full:  # a GPTModel's tensors only (another model's would load nowhere in Megatron)
        if not _GPT_TENSOR.match(name):
            raise MegatronDistError(f"export-megatron: {name} is not a tensor of a Megatron-core GPTModel (only GPT "
                                    "models are written here)")
    out_dir = Path(out_dir)
    rows = padded_vocab_size or c.padded_vocab_size
    if rows < c.vocab_size:
        raise MegatronDistError(f"padded_vocab_size={rows} is smaller than vocab_size={c.vocab_size}")
    freq, L = c.moe_layer_freq, c.num_layers
    stacked = not (isinstance(freq, list) or freq > 1)  # TransformerBlock.sharded_state_dict's homogeneous layers
    norms = {".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
             ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_"}
    experts, state = {}, {}  # {sharded key: {expert: tensor}}, {sharded key: tensor or object}
    for name, t in full.items():
        t = t.detach()
        if name.endswith(("word_embeddings.weight", "output_layer.weight", "output_layer.bias")):  # rows cut or
            t = F.pad(t[:rows], (0, 0) * (t.ndim - 1) + (0, max(0, rows - t.shape[0])))  # zero-padded to Megatron's
        for ours, theirs in norms.items():
            name = name.replace(ours, theirs)
        if (m := re.match(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$", name)) is not None:
            experts.setdefault(f"{m[1]}.experts.{m[2]}.weight", {})[int(m[3])] = t
            continue
        state[name] = t
    for key, by_expert in experts.items():  # [E, ...] in expert order
        if sorted(by_expert) != list(range(len(by_expert))):
            raise MegatronDistError(f"{key}: experts {sorted(by_expert)} are not 0..E-1")
        state[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    for name in [k for k in state if re.match(r"^.*\.layers\.\d+\..*linear_\w+\.weight$", k)]:
        m = re.match(r"^(.*\.layers)\.(\d+)\.(.+)\.weight$", name)  # each linear layer's _extra_state object, per
        n_experts = state[name].shape[0] if ".experts.experts." in name else None  # expert too, at its offsets
        for e in range(n_experts or 1):
            inner_off, inner_shape = ([e], [n_experts]) if n_experts else ([], [])
            key, off, shape = ((f"{m[1]}.{m[3]}", [int(m[2])] + inner_off, [L] + inner_shape) if stacked else
                               (f"{m[1]}.{m[2]}.{m[3]}", inner_off or [0], inner_shape or [1]))
            state[f"{key}._extra_state/shard_{'.'.join(map(str, off))}_{'.'.join(map(str, shape))}"] = [None]
    if stacked:  # row i of decoder.layers.X is layer i's X
        per_layer = {}
        for name in [k for k in state if isinstance(state[k], torch.Tensor) and re.match(r"^.*\.layers\.\d+\.", k)]:
            m = re.match(r"^(.*\.layers)\.(\d+)\.(.+)$", name)
            per_layer.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = state.pop(name)
        for key, by_layer in per_layer.items():
            if sorted(by_layer) != list(range(L)):
                raise MegatronDistError(f"{key}: layers {sorted(by_layer)} are not 0..{L - 1} (num_layers={L})")
            state[key] = torch.stack([by_layer[i] for i in range(L)])
    out_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # (not flattened: an object is saved whole, torch.save([None]), as Megatron
        warnings.simplefilter("ignore")  # saves a ShardedObject's list of data)
        dcp.save(state, checkpoint_id=str(out_dir), planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save({}, out_dir / "common.pt")
    (out_dir / "metadata.json").write_text(json.dumps(MEGATRON_DIST_METADATA))
    return out_dir


# ---------------------------------------------------------------------------------------------- export: ours -> Hugging Face
ExportError = hf.ExportError  # a model Hugging Face's classes cannot represent: one line naming the setting


# Config fields that do not change what an exported model computes (training-only), or that gpt_to_hf reads itself.
_EXPORT_IGNORED = {"mask_vocab_padding", "hidden_dropout", "attention_dropout", "init_method_std", "sequence_parallel",
                   "params_dtype",
                   "label_smoothing", "seed", "make_vocab_size_divisible_by", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                   "moe_token_dispatcher_type", "moe_pad_expert_input_to_capacity"}
_EXPORT_READ = {"num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
                "vocab_size", "max_position_embeddings", "position_embedding_type", "rotary_base", "normalization",
                "layernorm_epsilon", "activation", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "softmax_scale",
                "share_embeddings_and_output_weights", "num_tokentypes", "apply_residual_connection_post_layernorm",
                "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
                "moe_router_pre_softmax", "moe_expert_capacity_factor", "moe_shared_expert_intermediate_size"}


def gpt_to_hf(c, full: dict) -> tuple[dict, dict]:
    """The inverse of gpt_from_hf: (config.json as a dict, {HF name: tensor}) of a GPT2LMHeadModel (learned positions,
    LayerNorm, biases, tied embeddings), a LlamaForCausalLM (RoPE, RMSNorm, SwiGLU, no biases) or, with MoE in every
    layer, a MixtralForCausalLM (Hugging Face hub layout: block_sparse_moe.experts.{j}.w1/w2/w3). `full`: our full
    state dict (one process). Anything else, or any setting those classes cannot express: ExportError naming it."""
    for f in dataclasses.fields(c):  # a field this exporter does not know (a later feature) must be at its default
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name not in _EXPORT_IGNORED | _EXPORT_READ and getattr(c, f.name) != default:
            raise ExportError(f"export: {f.name}={getattr(c, f.name)!r} has no Hugging Face equivalent here")
    n, g, d, h, L = c.num_attention_heads, c.num_query_groups, c.kv_channels, c.hidden_size, c.num_layers
    need = [("num_tokentypes", 0), ("apply_residual_connection_post_layernorm", False)]
    if c.softmax_scale is not None and abs(c.softmax_scale * math.sqrt(d) - 1) > 1e-12:
        need.append(("softmax_scale", None))
    gpt2 = c.position_embedding_type == "learned_absolute"
    acts = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
    if gpt2:
        need += [("normalization", "LayerNorm"), ("gated_linear_unit", False), ("add_bias_linear", True),
                 ("add_qkv_bias", True), ("share_embeddings_and_output_weights", True), ("num_query_groups", n),
                 ("kv_channels", h // n), ("num_experts", None)]
    else:
        need += [("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("gated_linear_unit", True),
                 ("activation", "silu"), ("add_bias_linear", False), ("add_qkv_bias", False)]
        if c.num_experts:
            need += [("moe_router_score_function", "softmax"), ("moe_router_pre_softmax", False),
                     ("moe_expert_capacity_factor", None), ("moe_shared_expert_intermediate_size", None)]
            if not all(c.is_moe_layer(i) for i in range(L)):
                raise ExportError(f"export: moe_layer_freq={c.moe_layer_freq}: Mixtral has MoE in every layer")
    for field, want in need:
        if getattr(c, field) != want:
            raise ExportError(f"export: {field}={getattr(c, field)!r} cannot be represented in Hugging Face's "
                              f"{'GPT-2' if gpt2 else 'Llama/Mixtral'} (needs {want!r})")
    V = c.vocab_size
    sd = {k: v.detach() for k, v in full.items()}
    dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
    out = {}
    if gpt2:
        hc = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=V, n_positions=c.max_position_embeddings,
                  n_embd=h, n_layer=L, n_head=n, n_inner=c.ffn_hidden_size, activation_function=acts[c.activation],
                  layer_norm_epsilon=c.layernorm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  tie_word_embeddings=True, dtype=dtype)
        out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"][:V],
               "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
               "transformer.ln_f.weight": sd["decoder.final_layernorm.weight"],
               "transformer.ln_f.bias": sd["decoder.final_layernorm.bias"]}
        names = {"ln_1": "input_layernorm", "attn.c_attn": "self_attention.linear_qkv", "ln_2": "pre_mlp_layernorm",
                 "attn.c_proj": "self_attention.linear_proj", "mlp.c_fc": "mlp.linear_fc1", "mlp.c_proj": "mlp.linear_fc2"}
        for i in range(L):
            for dst, src in names.items():
                for kind in ("weight", "bias"):
                    t = sd[f"decoder.layers.{i}.{src}.{kind}"]
                    if dst == "attn.c_attn":  # Megatron's per-head [q_h; k_h; v_h] -> [q; k; v] of all heads
                        t = rearrange(t, "(n three d) ... -> (three n d) ...", three=3, n=n)
                    out[f"transformer.h.{i}.{dst}.{kind}"] = t.t() if kind == "weight" and not dst.startswith("ln") else t
        return hc, {k: v.contiguous().clone() for k, v in out.items()}
    moe = bool(c.num_experts)
    hc = dict(architectures=["MixtralForCausalLM" if moe else "LlamaForCausalLM"], model_type="mixtral" if moe else "llama",
              vocab_size=V, hidden_size=h, intermediate_size=c.moe_ffn_hidden_size if moe else c.ffn_hidden_size,
              num_hidden_layers=L, num_attention_heads=n, num_key_value_heads=g, head_dim=d,
              max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon, hidden_act="silu",
              rope_theta=c.rotary_base, rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base},
              tie_word_embeddings=c.share_embeddings_and_output_weights, attention_bias=False, dtype=dtype)
    if moe:
        hc.update(num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk, router_jitter_noise=0.0,
                  sliding_window=None, output_router_logits=False)
    else:
        hc.update(mlp_bias=False)
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if not c.share_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"][:V]
    for i in range(L):
        o, s = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = rearrange(sd[s + "self_attention.linear_qkv.weight"], "(g r) h -> g r h", g=g).split([n // g * d, d, d], 1)
        out.update({o + "input_layernorm.weight": sd[s + "input_layernorm.weight"],
                    o + "self_attn.q_proj.weight": rearrange(q, "g r h -> (g r) h"),
                    o + "self_attn.k_proj.weight": rearrange(k, "g r h -> (g r) h"),
                    o + "self_attn.v_proj.weight": rearrange(v, "g r h -> (g r) h"),
                    o + "self_attn.o_proj.weight": sd[s + "self_attention.linear_proj.weight"],
                    o + "post_attention_layernorm.weight": sd[s + "pre_mlp_layernorm.weight"]})
        if not moe:
            gate, up = sd[s + "mlp.linear_fc1.weight"].chunk(2)  # [gate; up]
            out.update({o + "mlp.gate_proj.weight": gate, o + "mlp.up_proj.weight": up,
                        o + "mlp.down_proj.weight": sd[s + "mlp.linear_fc2.weight"]})
            continue
        out[o + "block_sparse_moe.gate.weight"] = sd[s + "mlp.router.weight"]
        for j in range(c.num_experts):
            gate, up = sd[s + f"mlp.experts.linear_fc1.weight{j}"].chunk(2)
            e = o + f"block_sparse_moe.experts.{j}."
            out.update({e + "w1.weight": gate, e + "w3.weight": up, e + "w2.weight": sd[s + f"mlp.experts.linear_fc2.weight{j}"]})
    return hc, {k: v.contiguous().clone() for k, v in out.items()}


def save_hf(out_dir, hf_config: dict, state: dict, tokenizer=None, chat_template: str | None = None):
    """Write a Hugging Face model directory: config.json and model.safetensors, which
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads offline, and with the tokenizer what serving
    needs: tokenizer.json, tokenizer_config.json (hf_tokenizer_config: its special tokens, longest input and
    `chat_template`), generation_config.json and config.json with our token ids (hf_token_ids). No
    special_tokens_map.json: AutoTokenizer.from_pretrained takes the special tokens from tokenizer_config.json and
    reads that file only to override them (a legacy file)."""
    from safetensors.torch import save_file  # (requirements.txt; installed with transformers too)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        ids = hf_token_ids(tokenizer)
        hf_config = {**hf_config, **ids}  # not Llama's defaults (bos 1, eos 2: other tokens here)
        tokenizer.save(str(out / "tokenizer.json"))
        longest = hf_config.get("max_position_embeddings", hf_config.get("n_positions"))  # Llama's, GPT-2's name
        stops = tokenizer_files.chat_stop_ids(tokenizer)  # (a tokenizer folder's template may end a turn with its own token)
        generation = {**ids, "eos_token_id": stops} if len(stops) > 1 else ids
        for name, content in [("tokenizer_config.json", hf_tokenizer_config(tokenizer, longest, chat_template)),
                              ("generation_config.json", generation)]:
            (out / name).write_text(json.dumps(content, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config, indent=1) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_token_ids(tok) -> dict:
    """The exported token ids (config.json, generation_config.json). eos: our end-of-document token, which ends every
    document and every assistant turn, so generation stops where training taught the model to stop. pad: <pad>.
    bos: the eod token too, as GPT-2's is: our models train without a bos token, and in the pretraining stream the
    token before a document is the previous document's eod. Nothing adds it to an input (the tokenizer has no
    post-processor, the chat template writes none): it only starts a generation from nothing. A Hugging Face
    tokenizer folder with a chat template of its own keeps its own bos token (its template and post-processor write
    it)."""
    sp, bos = tokenizer_files.special_ids(tok), tokenizer_files.roles_of(tok).chat_tokens.get("bos_token")
    return dict(bos_token_id=tok.token_to_id(bos) if bos else sp["eod"], eos_token_id=sp["eod"], pad_token_id=sp["pad"])


def hf_tokenizer_config(tok, model_max_length: int, chat_template: str | None = None) -> dict:
    """tokenizer_config.json: the class that reads tokenizer.json, the special tokens of hf_token_ids as text, the
    longest input (max_position_embeddings), the Jinja chat template (None: none), and decoding as ours does it
    (no clean-up of the spaces before punctuation). A tokenizer folder's own chat template comes with the special
    tokens that folder names (Roles.chat_tokens: the template's variables), so the export renders it as the folder
    did (its pad token only where the template does not read pad_token)."""
    tokens = {name.removesuffix("_id"): tok.id_to_token(i) for name, i in hf_token_ids(tok).items()}
    if chat_tokens := tokenizer_files.roles_of(tok).chat_tokens:
        pad = {} if "pad_token" in chat_tokens or "pad_token" in (chat_template or "") else {"pad_token": tokens["pad_token"]}
        tokens = {**chat_tokens, **pad}
    return dict(tokenizer_class="PreTrainedTokenizerFast", **tokens, model_max_length=model_max_length,
                clean_up_tokenization_spaces=False, **({"chat_template": chat_template} if chat_template else {}))


# ---------------------------------------------------------------------------------------------- Hugging Face: LLaVA
def llava_from_hf(hf, Config, dtype=None) -> tuple:
    """(llava.Config, full state dict) of a `transformers` LlavaForConditionalGeneration: a CLIP vision tower, the
    2-layer projector, a Llama (through gpt_from_hf). Hugging Face takes the image features from
    hidden_states[vision_feature_layer] (index 0 = the embeddings after pre_layrnorm), so our ViT keeps exactly the
    layers before it (Megatron's conversion does the same) and CLIP's post_layernorm, unused, is left out;
    vision_feature_select_strategy "default" drops the class token, "full" keeps it."""
    hc, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    vc, layer, strategy = hc.vision_config, hc.vision_feature_layer, hc.vision_feature_select_strategy
    refuse = [why for bad, why in [
        (vc.model_type != "clip_vision_model", f"vision model_type {vc.model_type!r} (clip_vision_model is)"),
        (not isinstance(layer, int), f"vision_feature_layer={layer} (one layer is supported, not a list)"),
        (strategy not in ("default", "full"), f"vision_feature_select_strategy={strategy!r}"),
        (hc.projector_hidden_act != "gelu", f"projector_hidden_act={hc.projector_hidden_act!r} (gelu is)"),
        (not getattr(hc, "multimodal_projector_bias", True), "a projector without biases"),
        (vc.hidden_act not in ("quick_gelu", "gelu"), f"vision hidden_act={vc.hidden_act!r}"),
        (vc.num_channels != 3, f"num_channels={vc.num_channels}")] if bad]
    if refuse:
        raise ValueError(f"llava.from_hf: unsupported {refuse[0]}")
    L = vc.num_hidden_layers
    used = layer if layer >= 0 else L + 1 + layer  # hidden_states has L + 1 entries
    if not 1 <= used <= L:
        raise ValueError(f"llava.from_hf: vision_feature_layer={layer} selects {used} of {L} layers (1..{L} are supported)")
    text = types.SimpleNamespace(config=hc.text_config, parameters=hf.parameters, state_dict=lambda: {
        k.replace("model.language_model.", "model.", 1): v for k, v in sd.items()})  # the Llama, as gpt_from_hf reads it
    c, full = gpt_from_hf(text, functools.partial(Config, image_token_index=hc.image_token_id), dtype)
    c = dataclasses.replace(c, img_h=vc.image_size, img_w=vc.image_size, patch_dim=vc.patch_size,
                            vision_num_layers=used, vision_hidden_size=vc.hidden_size,
                            vision_num_attention_heads=vc.num_attention_heads, vision_ffn_hidden_size=vc.intermediate_size,
                            vision_activation=vc.hidden_act, vision_layernorm_epsilon=vc.layer_norm_eps,
                            drop_vision_class_token=strategy == "default")
    v, n = "model.vision_tower.", vc.num_attention_heads
    full.update({"vision_model.conv1": sd[v + "embeddings.patch_embedding.weight"],
                 "vision_model.class_token": sd[v + "embeddings.class_embedding"].reshape(1, 1, -1),
                 "vision_model.position_embeddings.weight": sd[v + "embeddings.position_embedding.weight"],
                 "vision_model.ln_pre.weight": sd[v + "pre_layrnorm.weight"],
                 "vision_model.ln_pre.bias": sd[v + "pre_layrnorm.bias"]})
    names = {"layer_norm1": "input_layernorm", "self_attn.out_proj": "self_attention.linear_proj",
             "layer_norm2": "pre_mlp_layernorm", "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}
    for i in range(used):
        h, o = f"{v}encoder.layers.{i}.", f"vision_model.decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, w = (rearrange(sd[h + f"self_attn.{t}_proj.{kind}"], "(n d) ... -> n d ...", n=n) for t in "qkv")
            full[o + f"self_attention.linear_qkv.{kind}"] = rearrange(torch.stack([q, k, w], 1),
                                                                      "n three d ... -> (n three d) ...")
            full.update({o + f"{dst}.{kind}": sd[h + f"{src}.{kind}"] for src, dst in names.items()})
    for i in (1, 2):
        for kind in ("weight", "bias"):
            full[f"vision_projection.encoder.linear_fc{i}.{kind}"] = sd[f"model.multi_modal_projector.linear_{i}.{kind}"]
    return c, full
