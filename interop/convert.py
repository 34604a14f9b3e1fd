"""interop/convert.py — the shared machinery of checkpoint conversion, a data layer below the model files: Hugging Face
`transformers` models and Megatron-core state dicts -> (our Config, our full state dict {global parameter name: tensor}).

Each model file owns its mappings: its HF_CONVERTERS declare, per Hugging Face model_type, the Config fields it reads
and a rename table from HF's tensor names to ours, plus only the transforms its layout needs; its from_megatron, the
renames Megatron-core's names need. What they share is here: applying a rename table (a tensor no rule maps is refused
by name), the Config fields every import sets, joining q/k/v and gate/up, vocabulary padding, refusals by name,
Llama's layout (which Mistral, Qwen, Mixtral, LLaVA's language model and DeepSeek-V3's MLPs share) and its RoPE and
MoE fields, Megatron-core's state dicts and distributed checkpoints, and the export of GPT models to Hugging Face.
It imports no model file (parallel.py, transformer.py for YaRN's mscale, interop/tokenizer_files.py for the chat
stop tokens, interop/hf.py for ExportError): parallel, transformer, tokenizer_files, hf <- convert <- deepseek, gpt <-
bert / t5 / mamba / llava / retro. A converter is converter(src, Config, dtype=None) -> (Config, full state dict),
`src` a `transformers` model or interop/hf.py's view of a folder; each model file's from_hf / from_megatron hands
the dict to `load`.
  Hugging Face   GPT-2 and the Llama family (gpt.py), DeepSeek-V3 (deepseek.py), BERT (bert.py), T5 (t5.py), Mamba-2
                 (mamba.py), LLaVA (llava.py): our external oracles — tests/test_hf.py, test_mla_mtp.py, test_bert.py,
                 test_t5.py, test_mamba.py, test_llava.py check that the logits match.
  Megatron-core  GPTModel (dense and MoE), BertModel, T5Model, RetroModel: a rename, since our names and layouts are
                 Megatron's — tests/test_megatron_parity*.py check logits, loss and every gradient in float64.
                 Its distributed checkpoints (dist_checkpointing, torch_dist) are read by megatron_dist_state without
                 Megatron-core (layers and experts un-stacked, SwiGLU halves joined: the dict megatron_state takes)
                 and written by to_megatron_dist, which Megatron-core's dist_checkpointing.load takes
                 (`tools.py import-megatron` / `export-megatron`; tests/test_megatron_dist.py: the logits in float64).
  Export         gpt_to_hf, the inverse of gpt.py's GPT-2 and Llama imports: GPT-2, Llama, Qwen3, Mixtral directories
                 (`tools.py export`) — tests/test_export.py loads them with transformers and compares the logits;
                 save_hf writes them with the tokenizer, its special tokens and chat template (tests/test_serve_export.py).
Mirrors the name maps of Megatron-LM's tools/checkpoint/ loaders and of transformers' Megatron conversion scripts.
The layouts (fused QKV per query group, SwiGLU's [gate; up], vocabulary padding): DESIGN.md §4 "Parameter names and
layouts"; dimension glossary: gpt.py's (n heads, g query groups, d head dim, h hidden, V vocabulary).
"""
from __future__ import annotations

import dataclasses
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

# ---------------------------------------------------------------------------------------------- Hugging Face: the machinery
# A model file declares its converter (HF_CONVERTERS) with these: the Config fields it reads from the HF config
# (config_from), a rename table from HF's tensor names to ours (renamed), and only the transforms its layout needs.
HF_FIELDS = dict(num_layers="num_hidden_layers", hidden_size="hidden_size", num_attention_heads="num_attention_heads",
                 ffn_hidden_size="intermediate_size", vocab_size="vocab_size",
                 max_position_embeddings="max_position_embeddings")  # the attribute names most HF configs share


def config_from(Config, src, dtype, fields: dict, **values):
    """Our Config of a `transformers` model `src`: `fields` {our field: its config's attribute, or a function of the
    config}, then `values`; dropout off, params_dtype src's (or `dtype`), mask_vocab_padding (transformers' loss has
    no padded rows)."""
    read = {k: a(src.config) if callable(a) else getattr(src.config, a) for k, a in fields.items()}
    return Config(**{**read, **values}, hidden_dropout=0.0, attention_dropout=0.0, mask_vocab_padding=True,
                  params_dtype=dtype or next(src.parameters()).dtype)


def refuse(who: str, bad: dict):
    """ValueError naming each setting of `bad` {name: value} (none: nothing to refuse)."""
    if bad:
        raise ValueError(f"{who}: settings this model cannot represent: "
                         + ", ".join(f"{k}={v!r}" for k, v in bad.items()))


def unlike(hc, wants: dict) -> dict:
    """{attribute: value} of the HF config's attributes whose value is not `wants`' (absent: as wanted; a list as a
    tuple, as config.json spells one)."""
    got = {k: getattr(hc, k, v) for k, v in wants.items()}
    return {k: v for k, v in got.items() if (tuple(v) if isinstance(v, list) else v) != wants[k]}


def renamed(sd, renames, who: str) -> dict:
    """{our name: tensor} of a Hugging Face state dict by `renames` [(HF name regex, our name[, transform])]: each
    tensor takes the first rule its whole name matches; our name is a re replacement (r"\\1": the HF name's first
    group), a function of the match, or None: a tensor the model does not read. "{e}" in it splits an expert-stacked
    tensor [E, ...] into one per expert; "name:part" names a piece that `joined` joins. A tensor no rule matches is
    refused by name (unread, it would change the logits unseen)."""
    full = {}
    for k, t in sd.items():
        rule = next(((m, rest) for p, *rest in renames if (m := re.fullmatch(p, k))), None)
        if rule is None:
            raise ValueError(f"{who}: {k} is a tensor this converter does not map")
        m, (ours, *transform) = rule
        if ours is not None:
            t = transform[0](t.detach()) if transform else t.detach()
            name = ours(m) if callable(ours) else m.expand(ours)
            full.update({name.replace("{e}", str(e)): x for e, x in enumerate(t.unbind(0))} if "{e}" in name
                        else {name: t})
    return full


def joined(full: dict, parts: tuple, join) -> dict:
    """`full` with each group of pieces "name:part" (one per part) replaced by name = join(*pieces in `parts` order)."""
    for k in [k for k in full if k.endswith(":" + parts[0])]:
        name = k.rsplit(":", 1)[0]
        full[name] = join(*(full.pop(f"{name}:{p}") for p in parts))
    return full


def per_group(*parts, groups: int):
    """HF's q, k, v (or k, v) of all heads, each [rows, ...] (weight or bias) -> Megatron's fused layout: per query
    group [q heads of g; k_g; v_g] (per head [q_h; k_h; v_h] without GQA)."""
    return rearrange(torch.cat([rearrange(t, "(g r) ... -> g r ...", g=groups) for t in parts], 1), "g r ... -> (g r) ...")


def vocab(c, full: dict) -> dict:
    """`full` less a tied output layer's copy of the embedding, its vocabulary rows (embedding, output-layer weight and
    bias) zero-padded to our padded_vocab_size: padded rows are never targets, their logits are cut."""
    if c.share_embeddings_and_output_weights:
        full = {k: v for k, v in full.items() if not k.endswith("output_layer.weight")}
    for k in [k for k in full if k.endswith(("word_embeddings.weight", "output_layer.weight", "output_layer.bias"))]:
        full[k] = F.pad(full[k], (0, 0) * (full[k].ndim - 1) + (0, c.padded_vocab_size - c.vocab_size))
    return full


# ---------------------------------------------------------------------------------------------- Hugging Face: Llama's layout
def mlp_renames(H: str, O: str) -> list:
    """Rename rules of a Llama-layout MLP (HF layer prefix regex H -> ours O): dense gate/up/down_proj, or MoE: the
    router (mlp.gate), experts stacked as transformers 5 holds them (gate_up_proj [E, 2f, h] is [gate; up] per expert,
    as our fc1; down_proj [E, h, f]) and a shared expert (Qwen-MoE's shared_expert and its sigmoid gate, DeepSeek's
    shared_experts). fc1 = [gate; up] (joined by llama_join)."""
    return [(H + r"mlp\.(gate|up)_proj\.weight", O + r"mlp.linear_fc1.weight:\2"),
            (H + r"mlp\.down_proj\.weight", O + "mlp.linear_fc2.weight"),
            (H + r"mlp\.shared_experts?\.(gate|up)_proj\.weight", O + r"mlp.shared_experts.linear_fc1.weight:\2"),
            (H + r"mlp\.shared_experts?\.down_proj\.weight", O + "mlp.shared_experts.linear_fc2.weight"),
            (H + r"mlp\.shared_expert_gate\.weight", O + "mlp.shared_experts.gate_weight"),
            (H + r"mlp\.gate\.weight", O + "mlp.router.weight"),
            (H + r"mlp\.experts\.gate_up_proj", O + "mlp.experts.linear_fc1.weight{e}"),
            (H + r"mlp\.experts\.down_proj", O + "mlp.experts.linear_fc2.weight{e}")]


_H, _O = r"model\.layers\.(\d+)\.", r"decoder.layers.\1."
LLAMA_TOP = [(r"model\.embed_tokens\.weight", "embedding.word_embeddings.weight"), (r"lm_head\.weight", "output_layer.weight"),
             (r"model\.norm\.weight", "decoder.final_layernorm.weight")]
LLAMA_RENAMES = [*LLAMA_TOP,
                 (_H + r"input_layernorm\.weight", _O + "input_layernorm.weight"),
                 (_H + r"post_attention_layernorm\.weight", _O + "pre_mlp_layernorm.weight"),
                 (_H + r"self_attn\.([qkv])_proj\.(weight|bias)", _O + r"self_attention.linear_qkv.\3:\2"),
                 (_H + r"self_attn\.o_proj\.weight", _O + "self_attention.linear_proj.weight"),
                 (_H + r"self_attn\.([qk])_norm\.weight", _O + r"self_attention.\2_layernorm.weight"),
                 *mlp_renames(_H, _O)]


def llama_join(full: dict, groups: int) -> dict:
    """The pieces LLAMA_RENAMES names joined: q, k, v per query group; fc1 = [gate; up]."""
    return joined(joined(full, ("q", "k", "v"), lambda *t: per_group(*t, groups=groups)), ("gate", "up"),
                  lambda g, u: torch.cat([g, u]))


def llama_layout(src, Config, dtype=None, every_layer: bool = True, moe=None) -> tuple:
    """(gpt.Config, full state dict) of a model in Llama's layout — pre-RMSNorm layers, RoPE (rope_fields),
    grouped-query attention from separate q/k/v_proj, SwiGLU gate/up/down_proj, no other biases — which Mistral,
    Qwen2/3 and the MoE families share (gpt.py's LLAMA_FAMILY). What a family adds, read from the tensors it stores:
    biases on q/k/v_proj (Qwen2's; o_proj none) -> add_qkv_bias; an RMSNorm over each head's d dims on q and k before
    RoPE (Qwen3's q_norm/k_norm) -> qk_layernorm. every_layer: full_attention's; moe(hc): hf_moe_fields' Config fields.
    Refused by name: hidden_act other than silu, attention_bias (Llama's and Qwen3's also bias o_proj, which our
    layers cannot without biasing every linear), mlp_bias, and a sliding window that hides a position."""
    hc = src.config
    bad = [f"{k}={v!r}" for k, v in unlike(hc, dict(hidden_act="silu", attention_bias=False, mlp_bias=False)).items()]
    if bad:
        raise ValueError(f"gpt.from_hf: {hc.model_type} with {', '.join(bad)} is not supported (silu, no biases are)")
    full_attention(hc, every_layer)
    full = renamed(src.state_dict(), LLAMA_RENAMES, f"gpt.from_hf: {hc.model_type}")
    c = config_from(Config, src, dtype, dict(HF_FIELDS, num_query_groups="num_key_value_heads",
                                           layernorm_epsilon="rms_norm_eps", share_embeddings_and_output_weights=
                                           lambda hc: bool(getattr(hc, "tie_word_embeddings", True))),
                  kv_channels=getattr(hc, "head_dim", None), normalization="RMSNorm", **rope_fields(hc),
                  activation="silu", gated_linear_unit=True, add_bias_linear=False,
                  add_qkv_bias=any(k.endswith("linear_qkv.bias:q") for k in full),
                  qk_layernorm=any(k.endswith("q_layernorm.weight") for k in full), **(moe(hc) if moe else {}))
    return c, vocab(c, llama_join(full, c.num_query_groups))
def full_attention(hc, every_layer: bool):
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


def hf_moe_fields(hc, num_experts: int, renormalise: bool, moe_layers: list, shared: int | None = None) -> dict:
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


def _rope_theta(hc) -> float:
    rp = getattr(hc, "rope_parameters", None) or getattr(hc, "rope_scaling", None) or {}
    return float(rp.get("rope_theta", getattr(hc, "rope_theta", 10000.0)))


_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
              "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "attention_factor", "truncate"}}


def rope_fields(hc) -> dict:
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


# ---------------------------------------------------------------------------------------------- into a model
def load(model, full: dict):
    """`model` with the weights of a full (unsharded) state dict {global name: tensor}, as the converters here
    return: each rank keeps its shard (and, under expert parallelism, its own experts)."""
    P.load_full_state_dict(model, full, model.grid)
    return model


def hf_loader(Model, Config, converters: dict, who: str):
    """A model file's from_hf(src, grid=None, dtype=None): its Model with the weights of a `transformers` model whose
    config.model_type is in `converters` (its HF_CONVERTERS) — the logits match; a setting the converter cannot
    represent is refused by name (ValueError)."""
    def from_hf(src, grid=None, dtype=None):
        kind = src.config.model_type
        if kind not in converters:
            raise ValueError(f"{who}.from_hf: unsupported model_type {kind!r} (supported: {', '.join(converters)})")
        config, full = converters[kind](src, Config, dtype)
        return load(Model(config, grid), full)
    return from_hf


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
# Megatron-LM flags that are off unless given, where a model file's default may be on (gpt: --swiglu, --qk-layernorm)
_MEGATRON_LM_OFF = ["swiglu", "qk_layernorm", "apply_layernorm_1p", "untie_embeddings_and_output_weights"]


def megatron_lm_args(ckpt_dir) -> dict:
    """The architecture a Megatron-LM checkpoint records (common.pt's "args", its argparse.Namespace) as train.py flag
    values {dest: value}: the names above are the same (one of _MEGATRON_LM_OFF that args lack: off, Megatron's
    meaning); --disable-bias-linear is `not add_bias_linear`; num_query_groups counts only with group_query_attention.
    {} when common.pt holds no args (a bare dist_checkpointing.save).
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
    out.update({k: False for k in _MEGATRON_LM_OFF if k not in a})  # Megatron's store_true flags: absent = off
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
                "moe_router_pre_softmax", "moe_expert_capacity_factor", "moe_shared_expert_intermediate_size",
                "qk_layernorm"}


def gpt_to_hf(c, full: dict) -> tuple[dict, dict]:
    """The inverse of gpt.py's GPT-2 and Llama imports: (config.json as a dict, {HF name: tensor}) of a GPT2LMHeadModel
    (learned positions, LayerNorm, biases, tied embeddings), a LlamaForCausalLM (RoPE, RMSNorm, SwiGLU, no biases),
    with --qk-layernorm a Qwen3ForCausalLM (Llama's layers and an RMSNorm over each head's q and k before RoPE)
    or, with MoE in every layer, a MixtralForCausalLM (Hugging Face hub layout: block_sparse_moe.experts.{j}.w1/w2/w3).
    `full`: our full state dict (one process). Anything else, or any setting those classes cannot express: ExportError
    naming it."""
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
                 ("kv_channels", h // n), ("num_experts", None), ("qk_layernorm", False)]
    else:
        need += [("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("gated_linear_unit", True),
                 ("activation", "silu"), ("add_bias_linear", False), ("add_qkv_bias", False)]
        if c.qk_layernorm:  # Qwen3 (dense; its MoE sibling, qwen3_moe, is not written here)
            need += [("num_experts", None)]
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
    moe, qwen3 = bool(c.num_experts), c.qk_layernorm
    arch, kind = ("MixtralForCausalLM", "mixtral") if moe else ("Qwen3ForCausalLM", "qwen3") if qwen3 else \
        ("LlamaForCausalLM", "llama")
    hc = dict(architectures=[arch], model_type=kind,
              vocab_size=V, hidden_size=h, intermediate_size=c.moe_ffn_hidden_size if moe else c.ffn_hidden_size,
              num_hidden_layers=L, num_attention_heads=n, num_key_value_heads=g, head_dim=d,
              max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon, hidden_act="silu",
              rope_theta=c.rotary_base, rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base},
              tie_word_embeddings=c.share_embeddings_and_output_weights, attention_bias=False, dtype=dtype)
    if moe:
        hc.update(num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk, router_jitter_noise=0.0,
                  sliding_window=None, output_router_logits=False)
    elif qwen3:
        hc.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * L)
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
        if qwen3:
            out.update({o + f"self_attn.{x}_norm.weight": sd[s + f"self_attention.{x}_layernorm.weight"] for x in "qk"})
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
