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

Differences from Megatron-core 0.15.3 (tests/test_megatron_parity_retro_moe.py: otherwise equal to 1e-10): DESIGN.md
§9, "Retro" (RoPE in the encoder, GPT's final norm, SP, the gate, whole chunks, the default embedder).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn
from tqdm import tqdm

import data
import gpt
import parallel as P
import retrieval
import transformer
from interop import convert, tokenizer_files


@dataclass
class Config(gpt.Config):
    FULL_RECOMPUTE = False  # full recomputation: Model.forward runs the layers itself, not transformer.Decoder's
    UNSUPPORTED: ClassVar[dict] = {
        "pipeline_parallel": "Retro's chunked cross-attention and neighbour encoder are not split into pipeline "
                             "stages (nor are they in Megatron)",
        "context_parallel": "Retro's chunked cross-attention ties each chunk of the sequence to its retrieved "
                            "neighbours; a split sequence would cut chunks apart",
        "document_packing": "Retro's samples carry their chunks' neighbours (RetroDataset), not packed documents",
        "post_training": "the post-training tasks have no retrieved neighbours to give Retro's chunked cross-attention",
        "sample": "Retro generates with each chunk's retrieved neighbours and tools.py builds no retrieval database; a "
                  "Retro run is judged by train.py's validation loss (with neighbours)",
        **gpt.DEEPSEEK_UNSUPPORTED}
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
            raise ValueError(f"num_layers={self.num_layers}: Retro's first chunked cross-attention layer is layer 6 "
                             "(--num-layers 6 or more)")
        r = self.retro_retrieved_length
        if self.position_embedding_type == "learned_absolute" and r > self.max_position_embeddings:
            raise ValueError(f"retrieved length r={r} > max_position_embeddings={self.max_position_embeddings}")

    @property
    def retro_layer_numbers(self) -> list[int]:  # 1-based, as decoder_spec.py
        return list(range(6 if self.num_layers <= 15 else 9, self.num_layers + 1, 3))


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
# `make train MODEL=retro`: 6 layers (the first CCA layer is layer 6); 160 iterations fit the 8-minute budget on 2 CPU
# cores with Muon for the hidden matrices at 3x AdamW's rate (bench/README.md "Levers for the other default runs")
TRAIN_DEFAULTS = dict(num_layers=6, train_iters=160, optimizer="muon", lr=9e-3, min_lr=9e-4)


def add_arguments(p):
    """Retro's own flags (Megatron's --retro-* names; None = the Config's default)."""
    p.add_argument("--retro-chunk-length", type=int, default=None, help="chunk length m (default 64)")
    p.add_argument("--retro-num-neighbors", type=int, default=None, help="neighbours k per chunk (default 2)")
    p.add_argument("--retro-encoder-num-layers", type=int, default=None, help="neighbour encoder layers (default 2)")
    p.add_argument("--retro-bert-load", default=None, help="embed chunks with this BERT run (train.py --model bert "
                                                            "--save DIR; same tokenizer) instead of a bag of tokens")


ARCH_FLAGS = ("retro_encoder_num_layers",)  # the neighbour encoder's depth (m and k shape the data, not the weights)


class RetroDataset:
    """GPT samples (data.GPTDataset) with the neighbours of their chunks: sample = [tokens (n + 1) | neighbours
    (l·k·r)] flat, so train.py's batches stay one LongTensor. Samples start at multiples of n, so with n % m == 0
    their chunks are chunks of the token stream, whose neighbours are queried once (cached) from the database of
    the *training* documents; a stream chunk straddling two documents excludes both."""

    def __init__(self, source, doc_ids, args, tok, seed):
        m, k = args.retro_chunk_length or Config.retro_chunk_length, args.retro_num_neighbors or Config.retro_num_neighbors
        n, self.k, self.m = args.seq_length, k, m
        if n % m:
            raise data.DataError(f"--seq-length={n} is not a multiple of --retro-chunk-length={m}")
        self.gpt = data.GPTDataset(source, doc_ids, n, seed)
        train_ids = data.split_documents(len(source), args.valid_fraction, seed=args.seed,
                                         test_fraction=getattr(args, "test_fraction", 0.0))[0]  # the database
        bert_dir = args.retro_bert_load  # a trained BERT (Megatron's embedder) or the bag of tokens
        self.embedder = (retrieval.ChunkEmbedder.load(bert_dir, tok, flag="--retro-bert-load") if bert_dir
                         else retrieval.BagOfTokensEmbedder(tok.get_vocab_size()))
        try:
            pad = tokenizer_files.special_ids(tok)["eod"]  # continuations past a document's end are padded with eod
        except data.DataError:
            pad = 0
        lock = open(os.path.join(args.data_cache_dir, ".retro-lock"), "w")  # one rank builds, the others read
        fcntl.flock(lock, fcntl.LOCK_EX)
        self.db = retrieval.build_database([np.asarray(source[d]) for d in train_ids], list(train_ids), m, self.embedder,
                                 pad_id=pad, cache_dir=args.data_cache_dir)
        lengths = [len(source[int(d)]) for d in doc_ids]
        token_doc = np.repeat(np.asarray(doc_ids, dtype=np.int64), lengths)  # the document of each stream token
        C = len(self.gpt.tokens) // m
        key = hashlib.sha256(self.gpt.tokens[: C * m].tobytes() + token_doc.tobytes() + repr(
            (self.db.tokens.shape, int(self.db.tokens.sum()), k, self.embedder.name)).encode()).hexdigest()[:16]
        path = os.path.join(args.data_cache_dir, f"retro-neighbors-{key}.npy")
        if os.path.exists(path):
            self.neighbors = np.load(path)
        else:
            chunks = self.gpt.tokens[: C * m].reshape(C, m)
            docs = np.stack([token_doc[: C * m: m], token_doc[m - 1: C * m: m]], 1)  # first and last token's doc
            self.neighbors = np.concatenate([retrieval.query_neighbors(self.db, chunks[i: i + 4096], docs[i: i + 4096], k,
                                                             self.embedder)[0]
                                             for i in tqdm(range(0, C, 4096), desc="retro: querying neighbours")])
            np.save(path, self.neighbors)  # [C, k] database chunk ids
        lock.close()

    def __len__(self):
        return len(self.gpt)

    def __getitem__(self, i):
        tokens = self.gpt[i]
        epoch, j = divmod(int(i), len(self.gpt))
        first = int(self.gpt._order(epoch)[j]) * self.gpt.seq_length // self.m  # the sample's first stream chunk
        l = self.gpt.seq_length // self.m  # noqa: E741
        nbr = self.db.tokens[self.neighbors[first: first + l]]  # [l, k, r]
        return np.concatenate([tokens, nbr.reshape(-1)])


dataset = RetroDataset  # train.py: dataset(source, doc_ids, args, tok, seed)


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


def batch_recipe(batch, args, corpus=None):
    """(loss_func, the global batch's next-token count: gbs x --seq-length)."""
    return loss_func, batch.shape[0] * args.seq_length
