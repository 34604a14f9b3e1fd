"""t5.py — T5, the encoder-decoder transformer, as a diff on gpt.py: relative position buckets, an encoder stack and a
decoder stack (with cross-attention) sharing one embedding, and the span-corruption data recipe.

Mirrors Megatron-LM's `megatron/core/models/T5/t5_model.py` and `t5_spec.py` (parameter names: `embedding`,
`encoder.layers.{i}`, `decoder.layers.{i}.pre_cross_attn_layernorm`, `.cross_attention.linear_q/linear_kv`,
`lm_head.output_layer`), `models/common/embeddings/relative_pos_embedding.py` (`encoder_relative_pos_emb`,
`decoder_relative_pos_emb`), and Hugging Face's `T5ForConditionalGeneration` (loaded by `from_hf`; a Megatron-core
T5Model by `from_megatron`). One Config holds Google's T5 and Megatron's: DESIGN.md §9, "T5".
Paper:  Raffel et al. 2019, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer".

Run:    make train MODEL=t5        (or: .venv/bin/python train.py --model t5 ...; see README)

Dimension glossary (on top of gpt.py's b, h, n, d, V)
  se encoder length (se/tp under sequence parallelism)   sd decoder length (sd/tp under SP)
  B  relative-position buckets (32)                       n/tp attention heads on this rank
"""
from __future__ import annotations

import argparse
import zlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

import data
import gpt
import metrics
import parallel as P
import transformer
from config import ConfigError
from interop import convert, tokenizer_files


@dataclass
class Config(gpt.Config):
    """gpt.Config plus T5's fields (Megatron's flag names). num_layers is the depth of both stacks unless
    encoder_num_layers / decoder_num_layers say otherwise."""
    FULL_RECOMPUTE = False  # full recomputation: transformer.Decoder's does not pass the encoder output (context)
    POSITION_EMBEDDING_TYPES: ClassVar[tuple] = ("relative", "rope", "learned_absolute")
    UNSUPPORTED: ClassVar[dict] = {
        "pipeline_parallel": "T5's encoder and decoder are not split into pipeline stages (Megatron-core's T5 "
                             "refuses pipelining too)",
        "context_parallel": "T5's cross-attention reads another sequence (the encoder's) and its relative-position "
                            "buckets span the whole sequence; neither is split here",
        "document_packing": "T5's samples are span-corrupted rows (SpanCorruptionDataset), not packed documents",
        "post_training": "the post-training tasks score the next-token log-probs of a decoder-only model",
        **gpt.DEEPSEEK_UNSUPPORTED}
    position_embedding_type: str = "relative"
    encoder_num_layers: int | None = None
    decoder_num_layers: int | None = None
    encoder_seq_length: int = 128  # what the data recipe makes (a raw row of this many tokens, corrupted)
    decoder_seq_length: int | None = None  # the targets padded to it; None: decoder_length(the encoder's length)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    scale_decoder_outputs: bool = False  # Hugging Face/Mesh TF: decoder output x h^-0.5 before the tied lm_head
    lm_head_bias: bool | None = None  # None = Megatron's rule: a bias exactly when the lm_head is tied
    vocab_extra_ids: int = 100  # sentinels <extra_id_i> the span corruption may use (the tokenizer has 100)

    def __post_init__(self):
        self.encoder_num_layers = self.encoder_num_layers or self.num_layers
        self.decoder_num_layers = self.decoder_num_layers or self.num_layers
        if self.lm_head_bias is None:
            self.lm_head_bias = self.share_embeddings_and_output_weights
        super().__post_init__()
        for name in ("encoder_num_layers", "decoder_num_layers", "relative_attention_num_buckets"):
            if getattr(self, name) < 1 or (name.endswith("buckets") and getattr(self, name) < 4):
                raise ValueError(f"{name}={getattr(self, name)} is too small")
        sd = self.decoder_seq_length
        if sd is not None and self.position_embedding_type == "learned_absolute" and sd > self.max_position_embeddings:
            raise ValueError(f"decoder_seq_length={sd} > max_position_embeddings={self.max_position_embeddings}")
        f, L = self.moe_layer_freq, max(self.encoder_num_layers, self.decoder_num_layers)  # each stack counts from 0
        if self.num_experts and isinstance(f, (list, tuple)) and len(f) < L:
            raise ValueError(f"moe_layer_freq has {len(f)} entries for encoder_num_layers={self.encoder_num_layers}, "
                             f"decoder_num_layers={self.decoder_num_layers}")

    def check_layout(self, tp: int = 1, pp: int = 1, ep: int = 1):
        super().check_layout(tp, pp, ep)
        sd = self.decoder_seq_length
        if self.sequence_parallel and sd and sd % tp:
            raise ValueError(f"sequence parallelism splits the decoder's positions: decoder_seq_length={sd} is not "
                             f"divisible by tensor-model-parallel size {tp}")


# ---------------------------------------------------------------------------------------------- the model
def attention_mask(ids, keys=None, causal: bool = False, bias=None):
    """The self-attention mask of ids [b, s] as transformer.Attention takes it: bool [b|1, 1, s|1, s] (True = attend)
    or, with a relative-position bias [1, n/tp, s, s], the bias with the masked entries at the dtype's minimum (not
    −inf: a fully masked row makes no NaNs). keys [b, s]: 1 = a token, 0 = padding (None: every key)."""
    s = ids.shape[1]
    keep = torch.ones(1, 1, s if causal else 1, s, dtype=torch.bool, device=ids.device)  # [1, 1, s|1, s]
    if keys is not None:
        keep = keep & keys.bool()[:, None, None, :]  # [b, 1, s|1, s]
    if causal:
        keep = keep.tril()
    return keep if bias is None else bias.masked_fill(~keep, torch.finfo(bias.dtype).min)


class Model(gpt.Model):
    """T5. forward(encoder_input_ids [b, se], decoder_input_ids [b, sd], encoder_attn_mask [b, se] = None,
    decoder_attn_mask [b, sd] = None, lm_labels [b, sd] = None) -> logits [b, sd, vocab_size] or per-token loss
    [b, sd]. Masks are 1 for tokens, 0 for padding (Hugging Face's convention; the decoder is causal on top).
    `encoder_hidden_states` (from `encode`) skips the encoder: generation encodes once.
    gpt.Model's skeleton with two stacks (and their relative-position tables) for one, and the lm_head."""

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        if c.position_embedding_type == "relative":  # transformer.py's, as Megatron's are its common embeddings
            self.encoder_relative_pos_emb = transformer.RelativePositionEmbedding(c, grid, bidirectional=True)
            self.decoder_relative_pos_emb = transformer.RelativePositionEmbedding(c, grid, bidirectional=False)
        self.encoder = transformer.Decoder(c, grid, self.rng, c.encoder_num_layers, post_process=True)
        return transformer.Decoder(c, grid, self.rng, c.decoder_num_layers, post_process=True, cross=True)

    def build_output_layer(self, c: Config, grid):  # Megatron's T5LMHead: the output layer, with a bias when tied
        self.lm_head = nn.ModuleDict(dict(output_layer=P.ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, grid, bias=c.lm_head_bias, std=c.init_method_std, dtype=c.params_dtype,
            sequence_parallel=c.sequence_parallel, skip_weight=c.share_embeddings_and_output_weights)))

    @property
    def output_layer(self):  # what gpt.Model's logits and embedding_and_output_weights read
        return self.lm_head.output_layer

    def logits(self, x):  # decoder output [sd(/tp), b, h] -> [sd, b, V/tp]
        return super().logits(x * self.config.hidden_size ** -0.5 if self.config.scale_decoder_outputs else x)

    def _embed(self, ids, keys, stack: str):  # ids [b, s] -> x [s(/tp), b, h], its self-attention mask, rope
        self.check_input(ids, stack)
        s, relative = ids.shape[1], self.config.position_embedding_type == "relative"
        bias = getattr(self, f"{stack}_relative_pos_emb")(s, s) if relative else None
        return self.embedding(ids), attention_mask(ids, keys, stack == "decoder", bias), self.rope(s, ids.device)

    def encode(self, encoder_input_ids, encoder_attn_mask=None):
        """[b, se] -> the encoder output [se(/tp), b, h] (bidirectional; padding keys masked)."""
        x, mask, rope = self._embed(encoder_input_ids, encoder_attn_mask, "encoder")
        return self.encoder(x, rope=rope, mask=mask)  # never without a mask: transformer.py's layers are causal then

    def forward(self, encoder_input_ids, decoder_input_ids, encoder_attn_mask=None, decoder_attn_mask=None,
                lm_labels=None, encoder_hidden_states=None):
        if encoder_hidden_states is None:
            encoder_hidden_states = self.encode(encoder_input_ids, encoder_attn_mask)
        x, mask, rope = self._embed(decoder_input_ids, decoder_attn_mask, "decoder")  # x [sd(/tp), b, h]
        context_mask = None if encoder_attn_mask is None else encoder_attn_mask.bool()[:, None, None, :]  # [b, 1, 1, se]
        x = self.decoder(x, rope=rope, mask=mask, context=encoder_hidden_states, context_mask=context_mask)
        return self.postprocess(x, lm_labels)


@torch.no_grad()
def generate(model: Model, encoder_input_ids, max_new_tokens: int, bos: int, eos: int | None = None,
             encoder_attn_mask=None, temperature: float = 0.0, top_k: int | None = None):
    """Greedy decoding by default (gpt.generate's sampling otherwise): encode once, then grow the decoder input
    from bos (full decoder recompute each step: short and obviously right). Returns the generated ids
    [b, ≤ max_new_tokens] (without bos)."""
    enc = []  # the encoder output, computed once on the first step (in gpt.generate's eval mode)

    def next_logits(dec):  # dec [b, t] -> the last position's logits [b, V]
        if not enc:
            enc.append(model.encode(encoder_input_ids, encoder_attn_mask))
        return model(None, dec, encoder_attn_mask, encoder_hidden_states=enc[0])[:, -1]

    dec = torch.full((encoder_input_ids.shape[0], 1), bos, dtype=torch.long, device=encoder_input_ids.device)
    return gpt.generate(model, dec, max_new_tokens, temperature, top_k, eod=eos, next_logits=next_logits)[:, 1:]


def sample(model: Model, tok, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None
           ) -> str:
    """tools.py sample for T5: the prompt, then one masked span (<extra_id_0>), then more of it if the prompt holds
    "<extra_id_0>" itself; decode what the sentinels hide (greedy at temperature 0). Returns the prompt with the
    decoded spans shown."""
    sp = tokenizer_files.special_ids(tok)
    ids = tok.encode(prompt).ids
    if sp["sentinels"][0] not in ids:
        ids = ids + [sp["sentinels"][0]]
    out = generate(model, torch.tensor([ids + [sp["eod"]]]), max_new_tokens, bos=sp["cls"], eos=sp["eod"],
                   temperature=temperature, top_k=top_k)
    return f"{prompt}\n--- decoded spans ---\n{tok.decode(out[0].tolist(), skip_special_tokens=False)}"


# ---------------------------------------------------------------------------------------------- span corruption
def corrupted_lengths(length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0):
    """(noise tokens, spans, encoder length, decoder length) for a raw row of `length` tokens. Every row of one
    length gets the same counts, so a batch has a fixed number of target tokens."""
    num_noise = min(max(round(length * noise_density), 1), length - 1)
    num_spans = max(round(num_noise / mean_noise_span_length), 1)
    return num_noise, num_spans, length - num_noise + num_spans + 1, num_noise + num_spans + 1  # +1: eos


def random_spans_noise_mask(length: int, rng: np.random.Generator, noise_density=0.15, mean_noise_span_length=3.0):
    """bool [length], True = noise: num_noise tokens in num_spans spans alternating with num_spans kept spans (the
    first one kept), span lengths uniformly random (T5's `random_spans_noise_mask`)."""
    num_noise, num_spans, _, _ = corrupted_lengths(length, noise_density, mean_noise_span_length)

    def segment(n, k):  # n items into k non-empty runs: k − 1 distinct cut points among the n − 1 gaps
        cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [n]]))

    runs = np.stack([segment(length - num_noise, num_spans), segment(num_noise, num_spans)], 1).reshape(-1)
    return np.repeat(np.tile([False, True], num_spans), runs)


def span_corruption(tokens, sentinels, bos: int, eos: int, pad: int, seed: int, encoder_seq_length: int,
                    decoder_seq_length: int, noise_density=0.15, mean_noise_span_length=3.0) -> dict:
    """Raw token rows [b, L] -> a T5 batch (Megatron's t5_dataset keys), e.g. for one row
         raw       the cat sat on the mat
         text_enc  the <X0> on the <X1> </s>         noise spans replaced by sentinels, then eos     [b, se]
         text_dec  <bos> <X0> cat sat <X1> mat      bos, then each sentinel and the span it hides   [b, sd]
         labels    <X0> cat sat <X1> mat </s>       text_dec shifted left, ending in eos            [b, sd]
    plus enc_mask [b, se], dec_mask [b, sd] and loss_mask [b, sd] (1 = token, 0 = padding). Each row's noise
    comes from (seed, the row's tokens): the same row gets the same corruption in every layout and on resume."""
    tokens = np.asarray(tokens)
    _, num_spans, se, sd = corrupted_lengths(tokens.shape[1], noise_density, mean_noise_span_length)
    if num_spans > len(sentinels):
        raise ValueError(f"{num_spans} noise spans need as many sentinels; the tokenizer has {len(sentinels)}")
    if se > encoder_seq_length or sd > decoder_seq_length:
        raise ValueError(f"rows of {tokens.shape[1]} tokens corrupt to encoder/decoder lengths {se}/{sd}, longer than "
                         f"encoder_seq_length={encoder_seq_length} / decoder_seq_length={decoder_seq_length}")
    sentinels = np.asarray(sentinels)
    out = {k: np.full((len(tokens), n), pad) for k, n in
           [("text_enc", encoder_seq_length), ("text_dec", decoder_seq_length), ("labels", decoder_seq_length)]}
    for i, row in enumerate(tokens):
        rng = np.random.default_rng([seed, zlib.crc32(row.astype(np.int64).tobytes())])
        noise = random_spans_noise_mask(len(row), rng, noise_density, mean_noise_span_length)
        starts = noise & ~np.roll(noise, 1)  # the first token of each span (noise[0] is never noise)
        sentinel = sentinels[np.cumsum(starts) - 1]  # per token: its span's sentinel (where it is noise)
        enc = np.where(starts, sentinel, row)[~noise | starts]
        tgt = np.insert(row[noise], np.flatnonzero(starts[noise]), sentinels[:num_spans])
        out["text_enc"][i, :se] = np.append(enc, eos)
        out["text_dec"][i, :sd] = np.insert(tgt, 0, bos)
        out["labels"][i, :sd] = np.append(tgt, eos)
    out = {k: torch.from_numpy(v).long() for k, v in out.items()}
    out["enc_mask"] = (torch.arange(encoder_seq_length) < se).long().expand(len(tokens), -1)
    out["loss_mask"] = out["dec_mask"] = (torch.arange(decoder_seq_length) < sd).long().expand(len(tokens), -1)
    return out


def t5_loss(model: Model, batch: dict):
    """The SUM of the batch's target-token losses (DESIGN.md §2: the caller divides by the global count)."""
    per_token = model(batch["text_enc"], batch["text_dec"], batch["enc_mask"], batch["dec_mask"], batch["labels"])
    return (per_token * batch["loss_mask"]).sum()


# ---------------------------------------------------------------------------------------------- train.py hooks
# `make train MODEL=t5`: T5 v1.1-like (train.py's RMS, SwiGLU); Muon at 3x AdamW's rate, 400 iterations in 8 minutes
TRAIN_DEFAULTS = dict(position_embedding_type="relative", train_iters=400, optimizer="muon", lr=9e-3, min_lr=9e-4)


def add_arguments(p):
    """Megatron's T5 flags (pretrain_t5.py's; how they map to --num-layers and --seq-length: DESIGN.md §9, "T5")."""
    p.add_argument("--encoder-num-layers", dest="num_layers", type=int, default=argparse.SUPPRESS,
                   help="the encoder's depth: --num-layers (also the decoder's, unless --decoder-num-layers)")
    p.add_argument("--decoder-num-layers", type=int, default=None, help="the decoder's depth (default: --num-layers)")
    p.add_argument("--encoder-seq-length", dest="seq_length", type=int, default=argparse.SUPPRESS,
                   help="the encoder's input length: --seq-length (rows of it + 1 raw tokens are span-corrupted)")
    p.add_argument("--decoder-seq-length", type=int, default=None, help="the targets padded to this length (default: "
                   "their length, which --seq-length fixes, rounded up to a multiple of 8)")
    p.add_argument("--vocab-extra-ids", type=int, default=100, help="the sentinels <extra_id_i> the span corruption "
                   "may use (at most the tokenizer's 100; Megatron's default 0 would leave T5 none)")


ARCH_FLAGS = ("decoder_num_layers",)  # the decoder's depth shapes the weights (--num-layers is everyone's)


def target_length(args) -> int:
    """The decoder length of a run: --decoder-seq-length, or decoder_length(--seq-length). ConfigError, before
    anything is built, when it cannot hold the targets of rows of --seq-length + 1 tokens, or sentinels are short."""
    _, spans, _, need = corrupted_lengths(args.seq_length + 1)
    sd = getattr(args, "decoder_seq_length", None) or decoder_length(args.seq_length)
    if sd < need:
        raise ConfigError(f"--decoder-seq-length={sd} is shorter than the {need} target tokens span corruption makes "
                          f"of rows of --seq-length + 1 = {args.seq_length + 1} tokens")
    extra, have = getattr(args, "vocab_extra_ids", 100), len(tokenizer_files.SPECIAL_TOKENS) - 5
    if not spans <= extra <= have:
        raise ConfigError(f"--vocab-extra-ids={extra}: rows of {args.seq_length + 1} tokens are corrupted into {spans} "
                          f"spans, each needing a sentinel, and the tokenizer has {have}")
    return sd


def decoder_length(seq: int) -> int:
    """The decoder length of rows of seq + 1 raw tokens: the targets' length, rounded up to a multiple of 8."""
    return -(-corrupted_lengths(seq + 1)[3] // 8) * 8


def config_fields(args, tok) -> dict:  # the decoder length the data pads to, for the FLOPs and the layout checks
    return dict(decoder_seq_length=target_length(args))


class SpanCorruptionDataset:
    """data.GPTDataset rows of seq_length + 1 tokens, span-corrupted. Sample i is one flat row (train.py stacks
    them): [se, text_enc (se), text_dec (sd), labels (sd), loss_mask (sd)]; the first column says where to cut."""

    def __init__(self, source, doc_ids, args, tok, seed):
        self.rows = data.GPTDataset(source, doc_ids, args.seq_length, seed)
        sp = tokenizer_files.special_ids(tok)
        self.kw = dict(sentinels=sp["sentinels"][:getattr(args, "vocab_extra_ids", 100)], bos=sp["cls"], eos=sp["eod"],
                       pad=sp["pad"], seed=seed)
        self.se, self.sd, self.pad = args.seq_length, target_length(args), sp["pad"]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        b = span_corruption(self.rows[i][None], **self.kw, encoder_seq_length=self.se, decoder_seq_length=self.sd)
        return np.concatenate([[self.se]] + [b[k][0].numpy() for k in ("text_enc", "text_dec", "labels", "loss_mask")])


dataset = SpanCorruptionDataset  # train.py: dataset(source, doc_ids, args, tok, seed)


def unpack(mb) -> dict:
    """A stacked SpanCorruptionDataset micro-batch [b, 1 + se + 3·sd] -> span_corruption's dict."""
    se = int(mb[0, 0])
    sd = (mb.shape[1] - 1 - se) // 3
    enc, dec, labels, loss_mask = mb[:, 1:].split([se, sd, sd, sd], dim=1)
    n_enc = corrupted_lengths(se + 1)[2]  # rows of se + 1 raw tokens: every one corrupts to this encoder length
    enc_mask = (torch.arange(se, device=mb.device) < n_enc).long().expand(len(mb), -1)
    return dict(text_enc=enc, text_dec=dec, labels=labels, loss_mask=loss_mask, dec_mask=loss_mask, enc_mask=enc_mask)


def batch_recipe(batch, args=None, corpus=None):
    """(loss_func(model, mb) -> the SUM of its target-token losses, the global batch's count of target tokens)."""
    return (lambda model, mb: t5_loss(model, unpack(mb)).float()), int(unpack(batch)["loss_mask"].sum())


def flops(c: Config, B: int, se: int, sd: int | None = None) -> float:
    """Model FLOPs of one iteration on B samples, encoder on B·se tokens, decoder on B·sd (the Config's
    decoder_seq_length, else decoder_length(se)): our count, DESIGN.md §6; metrics.py's conventions (x 2 x 3)."""
    sd = sd or c.decoder_seq_length or decoder_length(se)
    h, n, g, d = c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels
    enc = sum(metrics.self_attention_flops(c, se, causal=False, mla=False) + metrics.mlp_flops(c, c.is_moe_layer(i))
              for i in range(c.encoder_num_layers))
    cross_q = h * n * d + se * n * d * 2 + n * d * h  # per decoder token: q projection, QKᵀ and PV over se, proj
    dec = sum(metrics.self_attention_flops(c, sd, causal=True, mla=False) + cross_q
              + metrics.mlp_flops(c, c.is_moe_layer(i)) for i in range(c.decoder_num_layers)) + h * c.padded_vocab_size
    cross_kv = c.decoder_num_layers * h * 2 * g * d  # per encoder token: every decoder layer's linear_kv
    return 3 * 2 * B * (se * (enc + cross_kv) + sd * dec)


# ---------------------------------------------------------------------------------------------- checkpoints (interop/convert.py)
def from_megatron(state_dict: dict, config: Config, grid=None) -> Model:
    """A Model with the weights of a Megatron-core T5Model, from its full state dict: our names and layouts are its
    own; its second names for the position embeddings and the lm_head (top-level `position_embeddings.*`,
    `output_layer.*`) are dropped."""
    alias = ("position_embeddings.", "output_layer.")
    full = convert.megatron_state(state_dict, config, lambda k: None if k.startswith(alias) else k)
    return convert.load(Model(config, grid), full)


_S, _O = r"(encoder|decoder)\.block\.(\d+)\.layer\.", r"\1.layers.\2."
HF_RENAMES = [  # T5ForConditionalGeneration -> ours; a block's layer 0 is self-attention, 1 the decoder's cross-attention
    (r"shared\.weight", "embedding.word_embeddings.weight"), (r"(en|de)coder\.embed_tokens\.weight", None),  # (shared)
    (r"lm_head\.weight", "lm_head.output_layer.weight"),
    (r"(encoder|decoder)\.final_layer_norm\.weight", r"\1.final_layernorm.weight"),
    (_S + r"0\.SelfAttention\.relative_attention_bias\.weight", r"\1_relative_pos_emb.relative_attention_bias.weight"),
    (_S + r"0\.SelfAttention\.([qkv])\.weight", _O + r"self_attention.linear_qkv.weight:\3"),
    (_S + r"0\.SelfAttention\.o\.weight", _O + "self_attention.linear_proj.weight"),
    (_S + r"0\.layer_norm\.weight", _O + "input_layernorm.weight"),
    (_S + r"1\.EncDecAttention\.q\.weight", _O + "cross_attention.linear_q.weight"),
    (_S + r"1\.EncDecAttention\.([kv])\.weight", _O + r"cross_attention.linear_kv.weight:\3"),
    (_S + r"1\.EncDecAttention\.o\.weight", _O + "cross_attention.linear_proj.weight"),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight", r"decoder.layers.\1.pre_cross_attn_layernorm.weight"),
    (_S + r"\d\.layer_norm\.weight", _O + "pre_mlp_layernorm.weight"),
    (_S + r"\d\.DenseReluDense\.wi\.weight", _O + "mlp.linear_fc1.weight"),
    (_S + r"\d\.DenseReluDense\.wi_([01])\.weight", _O + r"mlp.linear_fc1.weight:\3"),  # gated: [wi_0; wi_1]
    (_S + r"\d\.DenseReluDense\.wo\.weight", _O + "mlp.linear_fc2.weight")]


def hf_to_ours(src, Config, dtype=None) -> tuple:
    """(Config, full state dict) of a `transformers` T5ForConditionalGeneration (logits match)."""
    hc, sd = src.config, src.state_dict()
    # tied: no lm_head of its own (a folder stores a tied one once), or a live model's lm_head is the embedding
    tied = "lm_head.weight" not in sd or (not sd["lm_head.weight"].is_meta
                                         and sd["lm_head.weight"].data_ptr() == sd["shared.weight"].data_ptr())
    act = {"relu": "relu", "gelu_new": "gelu_tanh", "gelu": "gelu", "silu": "silu"}.get(hc.dense_act_fn)
    if act is None:
        raise ValueError(f"t5.from_hf: unsupported T5 feed_forward_proj {hc.feed_forward_proj!r}")
    c = convert.config_from(Config, src, dtype, dict(
        num_layers="num_layers", encoder_num_layers="num_layers", decoder_num_layers="num_decoder_layers",
        hidden_size="d_model", num_attention_heads="num_heads", kv_channels="d_kv", ffn_hidden_size="d_ff",
        vocab_size="vocab_size", relative_attention_num_buckets="relative_attention_num_buckets",
        relative_attention_max_distance="relative_attention_max_distance", layernorm_epsilon="layer_norm_epsilon"),
        position_embedding_type="relative", normalization="RMSNorm", softmax_scale=1.0, activation=act,
        gated_linear_unit=getattr(hc, "is_gated_act", hc.feed_forward_proj.startswith("gated")), add_bias_linear=False,
        share_embeddings_and_output_weights=tied, lm_head_bias=False,
        scale_decoder_outputs=bool(getattr(hc, "scale_decoder_outputs", hc.tie_word_embeddings)))
    per_head = lambda *t: convert.per_group(*t, groups=c.num_attention_heads)  # [q; k; v] -> per head [q_h; k_h; v_h]
    full = convert.joined(convert.renamed(sd, HF_RENAMES, "t5.from_hf"), ("q", "k", "v"), per_head)
    return c, convert.vocab(c, convert.joined(convert.joined(full, ("k", "v"), per_head), ("0", "1"),
                                              lambda *t: torch.cat(t)))


HF_CONVERTERS = {"t5": hf_to_ours}  # model_type -> converter (interop/hf.py)
from_hf = convert.hf_loader(Model, Config, HF_CONVERTERS, "t5")  # a T5ForConditionalGeneration -> Model
