"""retro.py — Retro: GPT + chunked cross-attention to retrieved neighbours + a neighbour encoder (the model).

Mirrors Megatron-LM's `megatron/core/models/retro/` — model.py (RetroModel(GPTModel)), config.py (retro_* fields),
decoder_spec.py (CCA layers at range(6 if L <= 15 else 9, L + 1, 3), 1-based; the first owns the encoder),
decoder_attention.py (RetroDecoderCrossAttention, RetroDecoderBiasDropoutAdd), encoder_spec.py and
encoder_attention.py (RetroEncoderCrossAttention, RetroEncoderBiasDropoutAdd, RetroEncoderLayerNorm) — with the same
parameter names (`decoder.layers.5.cross_attention.attn.linear_q`, `...cross_attention.encoder.layers.0...`).
The retrieval database (Megatron's tools/retro + megatron/core/datasets/retro: chunks, embedder, FAISS index,
neighbour query, samples) is the data module retrieval.py; this file's train.py hooks hand it the corpus.
Papers: Borgeaud et al. 2021 (Retro, arXiv:2112.04426); Wang et al. 2023 "Shall we pretrain autoregressive language
        models with retrieval?" (Megatron's Retro).

Run:    make train MODEL=retro      (retrieval.py builds the chunk database beside the token cache on first use)

Dimension glossary
  b batch   n sequence length   m chunk length (retro_chunk_length)   l = n/m chunks per sample
  k neighbours per chunk (retro_num_neighbors)   r = 2m retrieved tokens (a neighbour chunk + its continuation)
  h hidden

Differences from Megatron-core 0.15.3 (tests/test_megatron_parity_retro_moe.py: otherwise equal to 1e-10):
  - RoPE: our encoder rotates the neighbours' positions; Megatron's CCA calls its encoder without rotary embeddings.
  - Megatron's Retro decoder block spec sets no final norm (its GPT specs do); ours has GPT's final norm.
  - Under sequence parallelism the chunked cross-attention gathers the whole sequence, works on replicated
    activations (TP still splits heads) and scatters the result back; the neighbour encoder runs without SP.
  - `neighbor_ids=None` closes the gate: every Retro layer then acts as the plain GPT layer (Megatron has no gate).
  - n must be a multiple of m (Megatron also zero-pads a partial first chunk); the default embedder is a
    deterministic bag of tokens; Megatron's BERT one is retrieval.ChunkEmbedder (train.py --retro-bert-load runs/bert).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

import convert
import gpt
import parallel as P
import retrieval
import transformer


@dataclass
class Config(gpt.Config):
    FULL_RECOMPUTE = False  # full recomputation: Model.forward runs the layers itself, not transformer.Decoder's
    retro_chunk_length: int = 64  # m
    retro_num_neighbors: int = 2  # k
    retro_num_retrieved_chunks: int = 2  # a neighbour and its continuation
    retro_encoder_num_layers: int = 2
    retro_encoder_hidden_dropout: float = 0.1
    retro_encoder_attention_dropout: float = 0.1
    retro_retrieved_length: int | None = None  # r = retro_num_retrieved_chunks · m (derived)

    def __post_init__(self):
        super().__post_init__()
        self.retro_retrieved_length = self.retro_num_retrieved_chunks * self.retro_chunk_length
        if self.num_layers < 6:
            raise ValueError(f"num_layers={self.num_layers}: Retro's first chunked cross-attention layer is layer 6")
        r = self.retro_retrieved_length
        if self.position_embedding_type == "learned_absolute" and r > self.max_position_embeddings:
            raise ValueError(f"retrieved length r={r} > max_position_embeddings={self.max_position_embeddings}")

    @property
    def retro_layer_numbers(self) -> list[int]:  # 1-based, as decoder_spec.py
        return list(range(6 if self.num_layers <= 15 else 9, self.num_layers + 1, 3))

    def check_layout(self, tp: int = 1, pp: int = 1, ep: int = 1):
        if pp > 1:
            raise ValueError(f"Retro does not support pipeline parallelism (pp={pp}), as in Megatron")
        super().check_layout(tp, pp, ep)


def _no_sp(c: Config, **kw) -> Config:
    return dataclasses.replace(c, sequence_parallel=False, **kw)


def _all_true(sq: int, sk: int, device) -> torch.Tensor:  # Megatron's get_all_true_mask: bidirectional attention
    return torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device)


# ---------------------------------------------------------------------------------------------- the encoder
class RetroEncoderCrossAttention(nn.Module):
    """Each neighbour's r tokens attend to the m tokens of the decoder chunk it was retrieved for."""

    def __init__(self, c: Config, grid, rng):
        super().__init__()
        self.k = c.retro_num_neighbors
        self.attn = transformer.Attention(c, grid, cross=True, rng=rng)

    def forward(self, x, chunks):  # x [r, (b l k), h] normed neighbours; chunks [m, (b l), h]
        kv = repeat(chunks, "m bl h -> m (bl k) h", k=self.k)  # the k neighbours of a chunk share its keys/values
        return self.attn(x, kv_input=kv, causal=False)  # [r, (b l k), h]


class RetroEncoderLayerNorm(nn.Module):  # Megatron norms each neighbour separately; per token, that is one norm
    def __init__(self, c: Config):
        super().__init__()
        self.norm = transformer.Norm(c)

    def forward(self, x):
        return self.norm(x)


class RetroEncoderLayer(transformer.TransformerLayer):
    """Layer 1 of the encoder: self-attention over each neighbour, cross-attention to its chunk, MLP."""

    def __init__(self, c: Config, grid, rng, layer_number: int):
        super().__init__(c, grid, rng, layer_number)
        self.pre_cross_attn_layernorm = transformer.Norm(c)
        self.cross_attention = RetroEncoderCrossAttention(c, grid, rng)
        self.pre_mlp_layernorm = RetroEncoderLayerNorm(c)

    def forward(self, x, chunks, rope=None):  # x [r, (b l k), h]
        r = x.shape[0]
        x = x + self.drop(self.self_attention(self.input_layernorm(x), rope=rope, mask=_all_true(r, r, x.device)))
        ln = self.pre_cross_attn_layernorm(x)
        x = ln + self.drop(self.cross_attention(ln, chunks))  # RetroEncoderBiasDropoutAdd: the residual is the norm
        return x + self.drop(self.mlp(self.pre_mlp_layernorm(x)))


class RetroEncoder(nn.Module):  # Megatron's TransformerBlock(pre_process=True, post_process=False): no final norm
    def __init__(self, c: Config, grid, rng):
        super().__init__()
        c = _no_sp(c, hidden_dropout=c.retro_encoder_hidden_dropout,
                   attention_dropout=c.retro_encoder_attention_dropout)
        self.layers = nn.ModuleList([RetroEncoderLayer(c, grid, rng, 0)] + [
            transformer.TransformerLayer(c, grid, rng, i, moe=False) for i in range(1, c.retro_encoder_num_layers)])

    def forward(self, x, chunks, rope=None):  # x [r, (b l k), h] embedded neighbours; chunks [m, (b l), h]
        x = self.layers[0](x, chunks, rope)
        for layer in self.layers[1:]:
            x = layer(x, rope=rope, mask=_all_true(x.shape[0], x.shape[0], x.device))
        return x  # [r, (b l k), h]


# ---------------------------------------------------------------------------------------------- the decoder
class RetroDecoderCrossAttention(nn.Module):
    """Chunked cross-attention (CCA): the sequence, shifted by pad = (n − 1) % m, is cut into l chunks; chunk j's
    m tokens (the last token of chunk j and the first m − 1 of chunk j + 1) attend to chunk j's k encoded neighbours,
    so no token sees neighbours retrieved with tokens after it. The first CCA layer owns the encoder."""

    def __init__(self, c: Config, grid, rng, encoder: bool):
        super().__init__()
        self.m, self.k = c.retro_chunk_length, c.retro_num_neighbors
        self.attn = transformer.Attention(_no_sp(c), grid, cross=True, rng=rng)
        self.encoder = RetroEncoder(c, grid, rng) if encoder else None

    def forward(self, x, context, rope=None):  # x [n, b, h] (normed, whole sequence); context: see below
        n, b, _ = x.shape
        m = self.m
        if self.encoder is not None:  # context = embedded neighbours [r, (b l k), h]
            chunks = rearrange(x, "(l m) b h -> m (b l) h", m=m)
            context = self.encoder(context, chunks, rope)  # [r, (b l k), h]
            context = rearrange(context, "r (bl k) h -> (k r) bl h", k=self.k)  # = Megatron's reshape of (k bl) columns
        pad = (n - 1) % m
        shifted = F.pad(x[pad:], (0, 0, 0, 0, 0, m - 1))  # [l·m, b, h]: attending positions pad, pad+1, ...
        q = rearrange(shifted, "(l m) b h -> m (b l) h", m=m)
        return self.attn(q, kv_input=context, causal=False), context, pad  # [m, (b l), h], [(k r), (b l), h]


class RetroDecoderLayer(transformer.TransformerLayer):
    """GPT layer + (pre_cross_attn_layernorm, cross_attention, RetroDecoderBiasDropoutAdd) between attention and MLP."""

    def __init__(self, c: Config, grid, rng, layer_number: int, encoder: bool):
        super().__init__(c, grid, rng, layer_number)
        self.grid = grid
        self.pre_cross_attn_layernorm = transformer.Norm(c)
        self.cross_attention = RetroDecoderCrossAttention(c, grid, rng, encoder)

    def forward(self, x, context=None, rope=None, mask=None, context_rope=None):  # x [n(/tp), b, h]
        x = x + self.drop(self.self_attention(self.input_layernorm(x), rope=rope, mask=mask))
        if context is not None:  # the gate is open
            tp, sp = P.tp_of(self.grid), self.c.sequence_parallel
            ln = self.pre_cross_attn_layernorm(x)
            ln = P.gather_from_sp(ln, tp, tp_output_grad=False) if sp else ln  # [n, b, h], replicated over TP
            y, context, pad = self.cross_attention(ln, context, context_rope)  # y [m, (b l), h]
            y = P.dropout(y, self.c.hidden_dropout, self.training, self.rng)  # RetroDecoderBiasDropoutAdd
            n, b = ln.shape[:2]
            y = rearrange(y, "m (b l) h -> (l m) b h", b=b)
            y = F.pad(y, (0, 0, 0, 0, pad, 0))[:n]  # un-shift: positions < pad get nothing
            x = x + (P.scatter_to_sp(y, tp) if sp else y)
        return x + self.drop(self.mlp(self.pre_mlp_layernorm(x))), context


class Model(gpt.Model):
    """Retro. forward(input_ids [b, n], neighbor_ids [b, l, k, r] | None, labels=None) -> logits or per-token loss.

    The GPT model with its layers at Megatron's CCA positions swapped for Retro decoder layers. Initialization is by
    global parameter name, so the GPT weights are the ones gpt.Model(same config) has."""

    def __init__(self, config: Config, grid=None, pre_process=True, post_process=True):
        super().__init__(config, grid, pre_process, post_process)  # Config.check_layout refuses pipelining

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        decoder = super().build_decoder(c, grid, layer_offset, num_layers)
        for j, number in enumerate(c.retro_layer_numbers):
            decoder.layers[number - 1] = RetroDecoderLayer(c, grid, self.rng, number - 1, encoder=j == 0)
        return decoder

    def embed_neighbors(self, neighbor_ids):  # [b, l, k, r] -> [r, (b l k), h] (RetroModel's context embedding)
        e = self.embedding
        ids = rearrange(neighbor_ids, "b l k r -> (b l k) r")
        x = e.word_embeddings(ids)  # [(b l k), r, h]
        if hasattr(e, "position_embeddings"):
            x = x + e.position_embeddings(torch.arange(ids.shape[1], device=ids.device))
        x = rearrange(x, "blk r h -> r blk h").contiguous()
        return P.dropout(x, self.config.hidden_dropout, self.training, self.rng)  # replicated: default stream

    def forward(self, input_ids, neighbor_ids=None, labels=None):
        c = self.config
        self.check_input(input_ids)
        b, n = input_ids.shape
        if neighbor_ids is not None:
            want = (b, n // c.retro_chunk_length, c.retro_num_neighbors, c.retro_retrieved_length)
            if n % c.retro_chunk_length or tuple(neighbor_ids.shape) != want:
                raise ValueError(f"input_ids {tuple(input_ids.shape)} and neighbor_ids {tuple(neighbor_ids.shape)}: "
                                 f"need n divisible by m={c.retro_chunk_length} and neighbor_ids [b, l, k, r] = {want}")
        x = self.embedding(input_ids)  # [n(/tp), b, h]
        context = self.embed_neighbors(neighbor_ids) if neighbor_ids is not None else None
        rope, context_rope = self.rope(n, input_ids.device), self.rope(c.retro_retrieved_length, input_ids.device)
        for layer in self.decoder.layers:
            if isinstance(layer, RetroDecoderLayer):
                x, context = layer(x, context, rope=rope, context_rope=context_rope)
            else:
                x = layer(x, rope=rope)
        return self.postprocess(self.decoder.final_layernorm(x), labels)


def from_megatron(state_dict: dict, config: Config, grid=None) -> Model:
    """A Model with the weights of a Megatron-core RetroModel, from its full state dict (see gpt.from_megatron)."""
    return convert.load(Model(config, grid), convert.megatron_state(state_dict, config))


# ---------------------------------------------------------------------------------------------- train.py hooks
TRAIN_DEFAULTS = dict(num_layers=6)  # the first CCA layer is layer 6


def dataset(source, doc_ids, args, tok, seed) -> retrieval.RetroDataset:
    """GPT samples + their chunks' neighbours, flat (see unpack); the database is retrieval.py's, built or reused."""
    return retrieval.RetroDataset(source, doc_ids, args, tok, seed)


def unpack(model: Model, mb):
    """A flat micro-batch [b, n + 1 + l·k·r] -> (tokens [b, n + 1], neighbor_ids [b, l, k, r])."""
    c = model.config
    m, k, r = c.retro_chunk_length, c.retro_num_neighbors, c.retro_retrieved_length
    n = (mb.shape[1] - 1) * m // (m + k * r)
    return mb[:, : n + 1], rearrange(mb[:, n + 1:], "b (l k r) -> b l k r", k=k, r=r)


def loss_func(model: Model, mb):
    """The SUM of the micro-batch's next-token losses (train.py divides by the global token count)."""
    tokens, neighbors = unpack(model, mb)
    return model(tokens[:, :-1], neighbors, labels=tokens[:, 1:]).float().sum()
