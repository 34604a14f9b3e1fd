"""gpt.py — the reference decoder-only transformer (GPT-2 and Llama families), tensor- and sequence-parallel.

Mirrors Megatron-LM's `megatron/core/models/gpt/gpt_model.py` and `models/common/embeddings/` (its layers, from
`transformer/`, are transformer.py's; its rotary angles too; DeepSeek-V3's multi-latent attention and
multi-token prediction deepseek.py's), with Megatron's parameter names and layouts, so a Megatron-core checkpoint
loads by name. gpt.Model is the skeleton bert.py, t5.py, retro.py and mamba.py extend (their
models override its seams): Config (config.py's), the embedding, the stack of layers, the output layer, generation.
Papers: Radford et al. 2019 (GPT-2); Touvron et al. 2023 (Llama: RMSNorm, SwiGLU, RoPE); Ainslie et al. 2023 (GQA);
        Shoeybi et al. 2019 (Megatron-LM tensor parallelism).

Run:    make train MODEL=gpt        (or: .venv/bin/python train.py --model gpt ...; see README)

Dimension glossary
  b batch    s sequence (s/tp under sequence parallelism)    h hidden    V vocabulary (padded, V/tp per rank)
  n attention heads (local: n/tp)   g query groups = key/value heads (local: g/tp)   d head dim (kv_channels)
"""
# Reading order — from a Config to logits:
#   1. Model.__init__, then Model.forward (the first methods of Model, below): embedding -> decoder -> output layer;
#      Model.postprocess turns the last hidden states into logits or the per-token loss. Embedding follows Model.
#   2. transformer.py, top down: Decoder (the layers, then the final norm) -> TransformerLayer -> Attention, MLP -> Norm.
#   3. Only when you need them, below Model's main line: the seams the later models override (build_decoder, ...),
#      then the optional features, one method each — layout checks (checked_config: pipeline stages, CP, SP),
#      packing and the KV cache (positions), the optimizers' marks (mark_parameters). Context parallelism is
#      parallel.get_batch_on_this_cp_rank, multi-token prediction deepseek.MTPBlock; generation follows Model.
from __future__ import annotations

import dataclasses
import functools

import torch
from einops import rearrange
from torch import nn

import deepseek
import parallel as P
from config import Config
from interop import convert, tokenizer_files
from transformer import Attention, Decoder, InferenceContext, rope_for

# The model-file contract (config.py): gpt.py supports every feature (config.Config.UNSUPPORTED is empty) and
# takes the default hooks but these. `make train MODEL=gpt`: up to 650 iterations of 16 x 128 tokens in the 8-minute
# budget on 2 CPU cores, Muon for the hidden matrices at 3x train.py's (AdamW's) learning rate, its Newton-Schulz in
# bfloat16 (Megatron's default precision), AdamW's beta2 0.99 for the rest, and a norm over each head's q and k (Qwen3's;
# exported as Qwen3ForCausalLM): bench/README.md "Levers for the gpt default run" measured each. train.py's other
# defaults are this model's
TRAIN_DEFAULTS = dict(train_iters=650, optimizer="muon", lr=9e-3, min_lr=9e-4, adam_beta2=0.99, qk_layernorm=True,
                      muon_fp32_matmul_prec="medium")
DEFAULT_MODEL = True  # train.py's --model default (config.default_model)
# What a model built on gpt.py's skeleton but with its own stack cannot take from DeepSeek-V3's layers (deepseek.py)
DEEPSEEK_UNSUPPORTED = dict.fromkeys(["multi_latent_attention", "multi_token_prediction"],
                                     "DeepSeek-V3's layers (deepseek.py) are built and tested for the GPT decoder only")


# ---------------------------------------------------------------------------------------------- the GPT model
class Model(nn.Module):
    """GPT. forward(input_ids [b, s], labels=None) -> logits [b, s, vocab_size], or per-token loss [b, s].

    Pipeline stages: `pre_process` owns the embedding, `post_process` the final norm and output layer;
    `layer_offset`/`num_layers` pick this stage's layers (global layer numbers keep initialization layout-free).
    Also the skeleton bert.py, t5.py, retro.py and mamba.py extend (Megatron's LanguageModule): __init__ checks the
    layout, makes the RNG tracker and embedding, then calls the seams they override — `build_decoder` (the layers),
    `build_output_layer` (output layer and heads), `init_params` (once, last) — and `logits` at run time."""

    # ------------------------------------------------------------------------------ the main line
    def __init__(self, config: Config, grid=None, pre_process=True, post_process=True, layer_offset=0,
                 num_layers=None):
        super().__init__()
        c = self.config = self.checked_config(config, grid, pre_process, post_process, layer_offset, num_layers)
        self.grid, self.pre_process, self.post_process, self.layer_offset = grid, pre_process, post_process, layer_offset
        self.rng = P.RNGTracker(c.seed, grid)  # the dropout streams (parallel.py)
        self.input_tensor = None  # pipeline stages > 0 receive hidden states instead of ids
        self.mtp_process = post_process and bool(c.mtp_num_layers)  # MTP: the last stage embeds too (Megatron's name)
        if pre_process or self.mtp_process:
            self.embedding = Embedding(c, grid, self.rng)  # ids [b, s] -> [s(/tp), b, h]
        self.decoder = self.build_decoder(c, grid, layer_offset, c.num_layers if num_layers is None else num_layers)
        if post_process:
            self.build_output_layer(c, grid)  # [s(/tp), b, h] -> [s, b, V/tp]
        if self.mtp_process:
            self.mtp = deepseek.MTPBlock(c, grid, self.rng, self.attention_class())
        self.mark_parameters()
        self.init_params()

    def forward(self, input_ids, labels=None, position_ids=None, mask=None, inference_context=None,
                decoder_input=None):
        """position_ids [b, s] / mask bool [b, 1, s, s] (True = attend): packed documents (data.Packing), else 0..s-1
        and causal. inference_context (transformer.InferenceContext): the KV cache; input_ids are the positions
        after the cached ones. serving/engine.py's paged cache passes all three: many requests' tokens packed in one
        row, their positions, and a mask [1, 1, s, keys] over the keys its `append` returns. decoder_input
        [s(/tp), b, h]: the embedding's output, made by the caller (Megatron's; LLaVA's, its images spliced in)."""
        self.check_input(input_ids, position_ids=position_ids)
        s = input_ids.shape[1]
        position_ids, rope = self.positions(input_ids, position_ids, inference_context)
        # context parallelism: this rank's 2 of the 2·cp sequence chunks, positions and labels with them [b, s/cp]
        input_ids, labels, position_ids, rope, mask = P.get_batch_on_this_cp_rank(
            self.grid, input_ids, labels, position_ids, rope, mask)
        if decoder_input is None:  # [s(/cp)(/tp), b, h]
            decoder_input = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        x = decoder_input
        x = self.decoder(x, rope=rope, mask=mask, inference_context=inference_context)
        if inference_context is not None:  # the cache now holds these s positions too
            inference_context.sequence_len_offset += s
        if self.mtp_process and labels is not None:  # the MTP loss joins backward through x (deepseek.py)
            x = self.mtp(x, input_ids, labels, self.embedding, self.postprocess, rope=rope, mask=mask)
        return self.postprocess(x, labels) if self.post_process else x

    def postprocess(self, x, labels=None):
        """Final hidden states [s(/tp), b, h] -> logits [b, s, vocab_size] or per-token loss [b, s]."""
        logits = self.logits(x)  # [s, b, V/tp]
        if labels is None:
            logits = P.gather_from_tp(logits, P.tp_of(self.grid))  # [s, b, V]
            return rearrange(logits, "s b v -> b s v")[..., : self.config.vocab_size]
        if self.config.mask_vocab_padding:  # an imported model: its loss over its own vocabulary, as its framework's
            logits = self.mask_vocab_padding(logits)
        # the logits are not needed again: their buffer becomes the softmax (and, in backward, its gradient)
        loss = P.vocab_parallel_cross_entropy(logits, labels.t(), self.grid, self.config.label_smoothing, inplace=True)
        return loss.t()  # [b, s]

    def logits(self, x):
        """Final hidden states [s(/tp), b, h] -> this rank's logits [s, b, V/tp] (the output layer, tied or not)."""
        tied = hasattr(self, "embedding") and self.config.share_embeddings_and_output_weights
        return self.output_layer(x, weight=self.embedding.word_embeddings.weight if tied else None)

    def rope(self, s, device):
        """(cos, sin) [s, 1, 1, r] of the position embedding (scaled as the config says: transformer.py), or None. MLA
        rotates only its decoupled RoPE part, qk_pos_emb_head_dim dims."""
        c = self.config
        return rope_for(c, s, device, d=c.qk_pos_emb_head_dim if c.multi_latent_attention else None)

    # ------------------------------------------------------------------------------ the seams later models override
    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        """This stage's layer stack (global layers layer_offset ... + num_layers − 1), final norm on the last stage."""
        return Decoder(c, grid, self.rng, num_layers, self.post_process, layer_offset, self.attention_class())

    def attention_class(self):
        """The layers' self-attention: transformer.Attention, or MLA (deepseek.py) with multi_latent_attention."""
        return deepseek.MLASelfAttention if self.config.multi_latent_attention else Attention

    def build_output_layer(self, c: Config, grid):
        """The last stage's output layer [h -> V/tp] (no weight of its own when tied to the embedding here)."""
        self.output_layer = P.ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, grid, bias=False, std=c.init_method_std, dtype=c.params_dtype,
            sequence_parallel=c.sequence_parallel,
            skip_weight=c.share_embeddings_and_output_weights and hasattr(self, "embedding"))

    def embedding_and_output_weights(self) -> list:
        """This stage's word-embedding and output-layer weights (a tied output layer has none of its own): what
        Megatron marks is_embedding_or_output_parameter, the parameters --decoupled-lr trains (parallel.decoupled)."""
        layers = [self.embedding.word_embeddings] if hasattr(self, "embedding") else []
        layers += [self.output_layer] if hasattr(self, "output_layer") else []
        return [m.weight for m in layers if m.weight is not None]

    def init_params(self):
        """Fill every parameter from (seed, its global name), so any layout holds the same model (parallel.py)."""
        P.init_params(self, self.config.seed, self.grid, rename=self.global_name)

    def global_name(self, name: str) -> str:
        """Local parameter name -> the name it has in the whole (unsplit) model."""
        name = P.expert_global_name(name, self.grid, self.config.num_experts)  # local expert i -> global index
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(i) + self.layer_offset}.{rest}"
        if name == "output_layer.weight" and self.config.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"  # a last stage's copy of the tied embedding
        return name

    def check_input(self, input_ids, what: str = "sequence", position_ids=None):
        c, tp = self.config, (self.grid.tp_size if self.grid is not None else 1)
        s = input_ids.shape[1]
        if c.position_embedding_type == "learned_absolute" and position_ids is not None:  # the table's rows read
            if int(position_ids.max()) >= c.max_position_embeddings:  # (serving/engine.py packs many requests in one row)
                raise ValueError(f"position {int(position_ids.max())} >= max_position_embeddings="
                                 f"{c.max_position_embeddings}")
        elif c.position_embedding_type == "learned_absolute" and s > c.max_position_embeddings:
            raise ValueError(f"{what} length {s} > max_position_embeddings={c.max_position_embeddings}")
        cp = self.grid.cp_size if self.grid is not None else 1
        if cp > 1 and (s % (2 * cp) or c.sequence_parallel and s // cp % tp):
            raise ValueError(f"context parallelism needs the {what} length {s} divisible by 2 x cp = {2 * cp}"
                             + (f" and by cp x tp = {cp * tp} (sequence parallelism)" if c.sequence_parallel else ""))
        if c.sequence_parallel and s % tp:
            raise ValueError(f"sequence parallelism needs the {what} length {s} divisible by tp={tp}")

    # ------------------------------------------------------------------------------ the optional features
    def checked_config(self, config: Config, grid, pre_process, post_process, layer_offset, num_layers) -> Config:
        """The config checked against this layout (config.check_layout; a model without pipeline stages refuses a
        stage; context parallelism's checks), with sequence parallelism off at tp 1 (it is a TP feature)."""
        tp, pp, ep = (grid.tp_size, grid.pp_size, grid.ep_size) if grid is not None else (1, 1, 1)
        config.check_layout(tp, pp, ep)
        whole = pre_process and post_process and not layer_offset and num_layers in (None, config.num_layers)
        if not whole and "pipeline_parallel" in config.UNSUPPORTED:  # a model without pipeline stages
            raise ValueError(f"{type(self).__module__}.Model has no pipeline stages: pre_process={pre_process}, "
                             f"post_process={post_process}, layer_offset={layer_offset}, num_layers={num_layers} must "
                             f"be the whole model ({config.UNSUPPORTED['pipeline_parallel']})")
        if grid is not None and grid.cp_size > 1:  # CP lives in transformer.Attention inside gpt's Decoder
            config.check_context_parallel(grid.cp_size, tp)  # (a model with its own stack: Config.UNSUPPORTED)
        if config.sequence_parallel and tp == 1:  # SP is a TP feature: a no-op without TP
            config = dataclasses.replace(config, sequence_parallel=False)
        return config

    def mark_parameters(self):
        """What the optimizers and the pipeline's embedding sync read off the parameters (parallel.py)."""
        c = self.config
        if self.pre_process != self.post_process and c.mtp_num_layers:  # both pipeline ends hold the whole embedding
            for p in self.embedding.parameters():
                p.shared_embedding = True
        elif c.share_embeddings_and_output_weights and self.pre_process != self.post_process:  # one copy of two
            (self.embedding.word_embeddings if self.pre_process else self.output_layer).weight.shared_embedding = True
        for p in self.embedding_and_output_weights():  # as Megatron's LanguageModule: --decoupled-lr's parameters
            p.is_embedding_or_output_parameter = True
        for m in self.modules():  # the other lookup tables (positions, token types, relative-position buckets) are
            if isinstance(m, nn.Embedding):  # no hidden layer either: AdamW's under --optimizer muon
                m.weight.hidden_matrix = False

    def positions(self, input_ids, position_ids, inference_context):
        """(position_ids, RoPE angles): 0..s−1 unless given (packed documents, serving's rows); after a KV cache's
        cached positions when decoding. position_ids None means 0..s−1 (rope [s, 1, 1, r])."""
        s, dev = input_ids.shape[1], input_ids.device
        if inference_context is not None and position_ids is None:
            position_ids = torch.arange(s, device=dev)[None] + inference_context.sequence_len_offset  # [1, s]
        return position_ids, (self.rope(s, dev) if position_ids is None else self.rope_at(position_ids))

    def rope_at(self, position_ids):
        """RoPE angles of explicit positions [b|1, s] (packed documents, decoding after a cache): [s, b|1, 1, d], read
        from a table of the next power of two positions, kept for the next call (a decode step reads one row)."""
        n, table = 1 << int(position_ids.max()).bit_length(), getattr(self, "rope_table", None)  # n > every position
        if table is None or table[0] < n or table[1] != position_ids.device:
            self.rope_table = table = (n, position_ids.device, self.rope(n, position_ids.device))
        rope = table[2]
        return None if rope is None else tuple(rearrange(t[position_ids], "b s 1 1 d -> s b 1 d") for t in rope)

    def mask_vocab_padding(self, logits):
        """This rank's logits [s, b, V/tp] with the padded vocabulary rows (>= vocab_size) at −inf."""
        tp = P.tp_of(self.grid)
        first = (tp.rank if tp is not None else 0) * logits.shape[-1]  # this shard's first vocabulary row
        padded = torch.arange(first, first + logits.shape[-1], device=logits.device) >= self.config.vocab_size
        return logits.masked_fill(padded, float("-inf"))


class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) + optional learned positions + optional token types; output [s(/tp), b, h]."""

    def __init__(self, c: Config, grid=None, rng=None):
        super().__init__()
        self.c, self.grid, self.rng = c, grid, rng
        # SP with nothing added to the whole sequence after the lookup: the lookup's g and the split to sequence
        # shards become one reduce-scatter (Megatron's reduce_scatter_embeddings in LanguageModelEmbedding)
        self.reduce_scatter = c.sequence_parallel and c.position_embedding_type != "learned_absolute" \
            and c.num_tokentypes == 0 and P.tp_of(grid) is not None
        self.word_embeddings = P.VocabParallelEmbedding(c.padded_vocab_size, c.hidden_size, grid,
                                                        std=c.init_method_std, dtype=c.params_dtype)
        if c.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=c.params_dtype)
            P.mark(self.position_embeddings.weight, ("normal", c.init_method_std))
        if c.num_tokentypes > 0:
            self.tokentype_embeddings = nn.Embedding(c.num_tokentypes, c.hidden_size, dtype=c.params_dtype)
            P.mark(self.tokentype_embeddings.weight, ("normal", c.init_method_std))

    def forward(self, input_ids, position_ids=None, tokentype_ids=None, words=None):  # [b, s]
        """words [b, s, h]: the word embeddings given instead of looked up (LLaVA's, with its images' rows)."""
        if self.reduce_scatter and words is None:
            x = self.word_embeddings(input_ids, reduce_scatter=True)  # [s/tp, b, h]
            return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=True)
        x = self.word_embeddings(input_ids) if words is None else words  # [b, s, h]
        if hasattr(self, "position_embeddings"):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            x = x + self.tokentype_embeddings(tokentype_ids)
        x = rearrange(x, "b s h -> s b h").contiguous()
        if self.c.sequence_parallel:
            x = P.scatter_to_sp(x, P.tp_of(self.grid))  # [s/tp, b, h]
        return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=self.c.sequence_parallel)


def sample_next(logits, temperature: float, top_k: int | None):
    """The next token [b, 1] from the last position's logits [b, V]: greedy at temperature 0, else top-k sampling."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1)


def cached_next_logits(model: Model, window: int):
    """next_logits(ids) with a KV cache (transformer.InferenceContext): the first call runs the whole prompt once
    (prefill), each later call only the newest token (decode), attending to the cached keys and values. Past
    `window` tokens the recompute path slides its window, every position shifts, and no cached key stays valid:
    from there on each step recomputes the last `window` tokens exactly as the recompute path does."""
    cache = InferenceContext(max_sequence_length=window)

    def next_logits(ids):  # ids [b, t]: everything so far, of which the cache holds the first sequence_len_offset
        if ids.shape[1] > window:
            return model(ids[:, -window:])[:, -1, :]
        return model(ids[:, cache.sequence_len_offset:], inference_context=cache)[:, -1, :]
    return next_logits


@torch.no_grad()
def generate(model: Model, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, eod: int | list[int] | None = None, next_logits=None,
             use_cache: bool = True) -> torch.Tensor:
    """Sample `max_new_tokens` tokens after `ids` [b, s]. `next_logits(ids)` gives the last position's logits
    [b, V]; by default from a KV cache (`cached_next_logits`: O(t) work per token). use_cache=False is the oracle:
    a full recompute of the (windowed) sequence each step, O(t²), short and obviously right (tests/test_kv_cache.py
    checks the two agree token for token). mamba.generate passes its recurrent step, t5.generate its decoder over
    one encoder output. It stops at a step where every row samples `eod` (or one of a list of stop ids)."""
    stops = None if eod is None else torch.tensor(eod if isinstance(eod, (list, tuple)) else [eod])
    was_training = model.training
    model.eval()
    window = model.config.max_position_embeddings
    if next_logits is None:
        next_logits = (cached_next_logits(model, window) if use_cache
                       else lambda ids: model(ids[:, -window:])[:, -1, :])
    for _ in range(max_new_tokens):
        nxt = sample_next(next_logits(ids), temperature, top_k)  # [b, 1]
        ids = torch.cat([ids, nxt], dim=1)
        if stops is not None and bool(torch.isin(nxt, stops.to(nxt.device)).all()):
            break
    model.train(was_training)
    return ids


def sample_ids(model: Model, tok, ids: list[int], max_new_tokens: int, temperature: float = 0.8,
               top_k: int | None = 50, generate=generate, stop: list[int] | None = None) -> list[int]:
    """tools.py sample --chat: the token ids sampled (KV-cached) after the prompt's token ids `ids`, up to and
    including the end-of-document token (or one of the `stop` ids: tokenizer_files.chat_stop_ids), or max_new_tokens of them.
    `generate`: another model file's (mamba.py's)."""
    out = generate(model, torch.tensor([ids]), max_new_tokens, temperature, top_k,
                   eod=stop if stop is not None else tokenizer_files.special_ids(tok)["eod"])
    return out[0, len(ids):].tolist()


def sample(model: Model, tok, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 50,
           generate=generate) -> str:
    """tools.py sample: the prompt and its continuation, sampled (KV-cached) until the end-of-document token or
    max_new_tokens. `generate`: another model file's (mamba.py's recurrent one)."""
    ids = tok.encode(prompt).ids
    return tok.decode(ids + sample_ids(model, tok, ids, max_new_tokens, temperature, top_k, generate))


# ---------------------------------------------------------------------------------------------- checkpoints (interop/convert.py)
to_hf = convert.gpt_to_hf  # tools.py export: a GPT-2, Llama or Mixtral directory (anything else refused by name)


_H, _O = r"transformer\.h\.(\d+)\.", r"decoder.layers.\1."
GPT2_RENAMES = [(r"transformer\.wte\.weight", "embedding.word_embeddings.weight"), (r"lm_head\.weight", "output_layer.weight"),
                (r"transformer\.wpe\.weight", "embedding.position_embeddings.weight"),
                (r"transformer\.ln_f\.(\w+)", r"decoder.final_layernorm.\1"),
                (_H + r"ln_1\.(\w+)", _O + r"input_layernorm.\2"), (_H + r"ln_2\.(\w+)", _O + r"pre_mlp_layernorm.\2"),
                *[(_H + rf"{a}\.(\w+)", _O + rf"{b}.\2", torch.t) for a, b in [  # Conv1D stores [in, out], we [out, in]
                    ("attn.c_attn", "self_attention.linear_qkv"), ("attn.c_proj", "self_attention.linear_proj"),
                    ("mlp.c_fc", "mlp.linear_fc1"), ("mlp.c_proj", "mlp.linear_fc2")]]]


def gpt2_to_ours(src, Config, dtype=None) -> tuple:
    """(Config, full state dict) of a `transformers` GPT2LMHeadModel (logits match)."""
    c = convert.config_from(Config, src, dtype, dict(num_layers="n_layer", hidden_size="n_embd", num_attention_heads=
                                                     "n_head", max_position_embeddings="n_positions", vocab_size=
                                                     "vocab_size", layernorm_epsilon="layer_norm_epsilon",
                                                     share_embeddings_and_output_weights=lambda hc: getattr(
                                                         hc, "tie_word_embeddings", True)),
                            ffn_hidden_size=src.config.n_inner or 4 * src.config.n_embd, activation="gelu_tanh")
    full = convert.renamed(src.state_dict(), GPT2_RENAMES, "gpt.from_hf: gpt2")  # c_attn: [q; k; v] of all heads -> per head
    return c, convert.vocab(c, {k: convert.per_group(*t.chunk(3), groups=c.num_attention_heads) if ".linear_qkv." in k
                                else t for k, t in full.items()})


def qwen_moe(hc, shared=None) -> dict:
    """Qwen-MoE's MoE fields: layer i is MoE unless in mlp_only_layers, when num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0 (Megatron's moe_layer_freq counts from layer 0: a 0/1 list then)."""
    return convert.hf_moe_fields(hc, hc.num_experts, hc.norm_topk_prob, [
        i not in (hc.mlp_only_layers or []) and hc.num_experts > 0 and (i + 1) % hc.decoder_sparse_step == 0
        for i in range(hc.num_hidden_layers)], shared)


# model_type -> (a sliding window on every layer, or on layer_types' sliding ones; the MoE fields of its config): what a
# Llama-layout family adds (Qwen2's q/k/v biases and Qwen3's q/k norms are read from its tensors: convert.llama_layout)
LLAMA_FAMILY = {"llama": (True, None), "mistral": (True, None),
                "mixtral": (True, lambda hc: convert.hf_moe_fields(hc, hc.num_local_experts, True, [1] * hc.num_hidden_layers)),
                "qwen2": (False, None), "qwen3": (False, None),
                "qwen2_moe": (False, lambda hc: qwen_moe(hc, hc.shared_expert_intermediate_size)), "qwen3_moe": (True, qwen_moe)}
# model_type -> converter (src, Config, dtype=None) -> (Config, full state dict): the Hugging Face decoders from_hf reads
HF_CONVERTERS = {"gpt2": gpt2_to_ours, **{t: functools.partial(convert.llama_layout, every_layer=every, moe=moe)
                                          for t, (every, moe) in LLAMA_FAMILY.items()}, "deepseek_v3": deepseek.hf_to_ours}
HF_LAYOUTS = {"mixtral": {"renames": [(r"\.block_sparse_moe\.", ".mlp.")], "experts": ("w1", "w3", "w2")},  # interop/hf.py
              **{t: {"experts": ("gate_proj", "up_proj", "down_proj")} for t in ("qwen2_moe", "qwen3_moe")},
              "deepseek_v3": deepseek.HF_LAYOUT}
from_hf = convert.hf_loader(Model, Config, HF_CONVERTERS, "gpt")  # a GPT-2, Llama-family or DeepSeek-V3 -> Model


def from_megatron(state_dict: dict, config: Config, grid=None) -> Model:
    """A Model with the weights of a Megatron-core GPTModel, from its full state dict. Our names and layouts are
    Megatron's local-spec ones, so this is a rename (what it handles: convert.megatron_state)."""
    return convert.load(Model(config, grid), convert.megatron_state(state_dict, config))
