"""convert.py — checkpoint converters, a data layer below the model files: Hugging Face `transformers` models and
Megatron-core state dicts -> (our Config, our full state dict {global parameter name: tensor}).

It imports no model file (only parallel.py), and returns plain data: a Hugging Face converter takes the HF model
and the model file's Config class (for derived values such as padded_vocab_size and num_query_groups) and returns
(Config, full state dict); `megatron_state` takes the state dict and our config. Each model file's `from_hf` /
`from_megatron` builds its Model and hands it the full state dict with `load`. So the imports run one way,
parallel <- convert <- gpt <- bert / t5 / retro / mamba, and every external layout sits here side by side.
  Hugging Face   GPT-2 and Llama (gpt.py), BERT (bert.py), T5 (t5.py), Mamba-2 (mamba.py): our external oracles —
                 tests/test_hf.py, test_bert.py, test_t5.py, test_mamba.py check that the logits match.
  Megatron-core  GPTModel (dense and MoE), BertModel, T5Model, RetroModel: a rename, since our names and layouts are
                 Megatron's — tests/test_megatron_parity*.py check logits, loss and every gradient in float64.
Mirrors the name maps of Megatron-LM's tools/checkpoint/ loaders and of transformers' Megatron conversion scripts.

Layouts met on the way in
  fused QKV    HF: [q; k; v] of all heads (GPT-2's c_attn, BERT's three Linears, T5's q/k/v, Llama's q/k/v_proj)
               -> Megatron's per query group [q heads of g; k_g; v_g] (per head [q_h; k_h; v_h] without GQA)
  GPT-2        Conv1D stores [in, out]; nn.Linear (and ours) [out, in]
  SwiGLU       HF gate_proj / up_proj (T5: wi_0 / wi_1) -> linear_fc1 = [gate; up]
  BERT         post-LN = our stack with apply_residual_connection_post_layernorm, its norms shifted by one layer
  vocabulary   rows zero-padded (or cut) to our padded_vocab_size, which does not depend on TP; pad rows are never
               targets and their logits are cut before the caller sees them

Dimension glossary: gpt.py's (n heads, g query groups, d head dim, h hidden, V vocabulary).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types

import torch
import torch.nn.functional as F
from einops import rearrange

import parallel as P


# ---------------------------------------------------------------------------------------------- Hugging Face: GPT-2, Llama
def gpt_from_hf(hf, Config, dtype=None) -> tuple:
    """(gpt.Config, full state dict) of a `transformers` GPT2LMHeadModel or LlamaForCausalLM (logits match)."""
    hc, sd = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    dtype = dtype or next(hf.parameters()).dtype
    common = dict(vocab_size=hc.vocab_size, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype)
    if hc.model_type == "gpt2":
        c = Config(num_layers=hc.n_layer, hidden_size=hc.n_embd, num_attention_heads=hc.n_head,
                       ffn_hidden_size=hc.n_inner or 4 * hc.n_embd, max_position_embeddings=hc.n_positions,
                       layernorm_epsilon=hc.layer_norm_epsilon, activation="gelu_tanh", **common)
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
    elif hc.model_type == "llama":
        c = Config(num_layers=hc.num_hidden_layers, hidden_size=hc.hidden_size,
                       num_attention_heads=hc.num_attention_heads, num_query_groups=hc.num_key_value_heads,
                       kv_channels=getattr(hc, "head_dim", None),
                       ffn_hidden_size=hc.intermediate_size, max_position_embeddings=hc.max_position_embeddings,
                       position_embedding_type="rope", rotary_base=_rope_theta(hc), normalization="RMSNorm",
                       layernorm_epsilon=hc.rms_norm_eps, activation="silu", gated_linear_unit=True,
                       add_bias_linear=False, add_qkv_bias=bool(getattr(hc, "attention_bias", False)),
                       share_embeddings_and_output_weights=hc.tie_word_embeddings, **common)
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
                         o + "pre_mlp_layernorm.weight": sd[h + "post_attention_layernorm.weight"],
                         o + "mlp.linear_fc1.weight": torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]]),
                         o + "mlp.linear_fc2.weight": sd[h + "mlp.down_proj.weight"]})
            if c.add_qkv_bias:
                q, k, v = (rearrange(sd[h + f"self_attn.{t}_proj.bias"], "(g r) -> g r", g=g) for t in "qkv")
                full[o + "self_attention.linear_qkv.bias"] = torch.cat([q, k, v], 1).flatten()
    else:
        raise ValueError(f"gpt.from_hf: unsupported model_type {hc.model_type!r} (gpt2 and llama are)")
    for k in [k for k in full if k.endswith("word_embeddings.weight") or k == "output_layer.weight"]:
        full[k] = F.pad(full[k], (0, 0, 0, c.padded_vocab_size - c.vocab_size))  # padded rows are never targets
    return c, full


def _rope_theta(hc) -> float:
    rp = getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {}
    return float(rp.get("rope_theta", getattr(hc, "rope_theta", 10000.0)))


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
                    params_dtype=dtype or next(hf.parameters()).dtype)
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
    tied = hf.lm_head.weight.data_ptr() == hf.shared.weight.data_ptr()
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
                  hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype or hf.shared.weight.dtype)
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
                     share_embeddings_and_output_weights=hc.tie_word_embeddings,
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
