"""retrieval.py — Retro's retrieval database: chunks, a frozen embedder, a FAISS index, neighbour queries.

Why its own file: the retrieval database is a data pipeline, not a model, and Retro's alone (DESIGN.md §1: it sits
just below retro.py in the import layers).
It cuts the training documents into m-token chunks, embeds them with a frozen embedder (a bag of tokens, or a BERT
run trained here), indexes the embeddings with FAISS, queries each stream chunk's k nearest chunks of other
documents, and caches the database and the neighbours beside the token cache. retro.py's model only ever sees the
result, neighbour tokens [b, l, k, r]; Megatron keeps the two apart the same way (preprocessing vs model).
Mirrors Megatron-LM's tools/retro/preprocess_data.py (the driver: build the chunk database, the index, the
neighbours) and tools/bert_embedding/embed.py (the BERT chunk embedder), over Megatron-core's
megatron/core/datasets/retro/ — db/build.py (the chunk database), index/build.py + index/factory.py (the FAISS
index), config/bert_embedders.py (the embedder interface), query/query.py (query_neighbors: each chunk's neighbours,
other documents only). retro.py's RetroDataset (query/retro_dataset.py) turns it into samples.
Papers: Borgeaud et al. 2021 (Retro, arXiv:2112.04426); Wang et al. 2023 "Shall we pretrain autoregressive language
        models with retrieval?" (Megatron's Retro).

Run:    make train MODEL=retro      (retro.dataset -> RetroDataset: builds the database on first use, then reuses it)
        make train MODEL=bert && make train MODEL=retro ARGS="--retro-bert-load runs/bert"   (the BERT embedder)

Dimension glossary
  m chunk length   r = 2m tokens per database row (a chunk + its continuation)   k neighbours per chunk
  n sequence length   l = n/m chunks per sample   N chunks in the database   Q query chunks   D embedder dimension
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import checkpoint  # reads a saved run (as tools.py sample does)
import data
from interop import tokenizer_files


# ---------------------------------------------------------------------------------------------- the embedders
class BagOfTokensEmbedder:
    """The default frozen embedder (no BERT run needed; ChunkEmbedder is Megatron's): the mean of a fixed random
    table E [V, D] (normal, from `seed`) over a chunk's tokens, L2-normalized. Equal multisets embed equally."""

    def __init__(self, vocab_size: int, dim: int = 128, seed: int = 0):
        self.table = np.random.default_rng(seed).standard_normal((vocab_size, dim)).astype(np.float32)
        self.name = f"bag-of-tokens-V{vocab_size}-D{dim}-seed{seed}"

    def __call__(self, chunks: np.ndarray) -> np.ndarray:  # [N, m] -> [N, D]
        e = self.table[chunks].mean(axis=1)
        return e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)


class ChunkEmbedder:
    """Retro's frozen chunk embedder (build_database / query_neighbors): token chunks [N, m] -> [N, h] float32.

    As Megatron's (tools/bert_embedding/embed.py runs BertModel with return_embeddings=True): a chunk goes in as
    [cls] chunk [sep] (token types 0, a padding mask) and its embedding is the mean of the final hidden states (after
    the final norm) over the chunk's own positions, [cls] and [sep] left out: Megatron's `torch.mean(embedding[1 :
    mask - 1], dim=0)`. Megatron re-tokenizes the GPT chunk with BERT's WordPiece, without the eod; this BERT shares
    the corpus tokenizer, so the tokens go in as they are, eod tokens dropped (a chunk of eods only embeds as zeros,
    as Megatron's Hugging Face embedder zeroes its nan). Then L2-normalized: our index searches by inner product,
    i.e. cosine (Megatron's FAISS index is L2 on the raw means). Eval mode, no_grad, float32, batch_size at a time."""

    def __init__(self, model, tok, name: str = "encoder", batch_size: int = 128, device=None):
        c, V = model.config, tok.get_vocab_size()
        if c.vocab_size != V:
            raise data.DataError(f"the chunk embedder has a vocabulary of {c.vocab_size} tokens, the corpus "
                                 f"tokenizer {V}: its run must be trained with the corpus's tokenizer")
        self.special, self.name, self.batch_size = tokenizer_files.special_ids(tok), name, batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.float().eval().requires_grad_(False).to(self.device)

    @classmethod
    def load(cls, load_dir, tok, flag: str, **kw) -> ChunkEmbedder:
        """The embedder of a run train.py saved whose model has an encoder, `encode(ids, padding_mask)` (Megatron's:
        a BERT run, `make train MODEL=bert` -> runs/bert), at its latest checkpoint. Its name (part of the database
        and neighbour cache keys) holds the model, the iteration and a hash of the checkpoint's files, so a cache built
        with other weights is never reused. `flag`: the flag that named the run, for the error messages."""
        run = checkpoint.load_model(load_dir, flag=flag)
        if not callable(getattr(run.model, "encode", None)):
            raise data.DataError(f"{flag} {load_dir}: a --model {run.args.model} run, whose model has no encoder "
                                 "(encode(ids, padding_mask)) to embed chunks with")
        if run.tok.get_vocab_size() == tok.get_vocab_size() and run.tok.get_vocab() != tok.get_vocab():
            raise data.DataError(f"{flag} {load_dir}: the run's tokenizer.json is not the corpus's tokenizer")
        h = hashlib.sha256()
        for f in sorted(Path(run.ckpt.path).iterdir()):
            h.update(f.name.encode() + f.read_bytes())
        return cls(run.model, tok, name=f"{run.args.model}-iter{run.ckpt.meta['iteration']}-{h.hexdigest()[:16]}", **kw)

    @torch.no_grad()
    def __call__(self, chunks: np.ndarray) -> np.ndarray:  # [N, m] -> [N, h]
        sp, c = self.special, self.model.config
        chunks = torch.as_tensor(np.asarray(chunks), dtype=torch.long)
        N, m = chunks.shape
        if c.position_embedding_type == "learned_absolute" and m + 2 > c.max_position_embeddings:
            raise data.DataError(f"chunks of {m} tokens + [cls] + [sep] do not fit the chunk embedder's "
                                 f"max_position_embeddings={c.max_position_embeddings}")
        keep = chunks != sp["eod"]  # [N, m]
        n = keep.sum(1, keepdim=True)  # [N, 1] the chunk's tokens without eod
        pos = torch.arange(m + 2)  # [s] = [cls] chunk [sep] pad...
        real = chunks.gather(1, torch.argsort((~keep).byte(), dim=1, stable=True))  # [N, m] eod moved to the end
        ids = torch.cat([torch.full((N, 1), sp["cls"]), torch.where(pos[1:-1] <= n, real, sp["pad"]),
                         torch.full((N, 1), sp["pad"])], 1)  # [N, s]
        ids[pos == n + 1] = sp["sep"]
        mask, inside = pos <= n + 1, (pos >= 1) & (pos <= n)  # [N, s]: [cls] chunk [sep]; the chunk's positions
        out = []
        for i in range(0, N, self.batch_size):
            b = slice(i, i + self.batch_size)
            x = self.model.encode(ids[b].to(self.device), mask[b].long().to(self.device))  # [s, b, h]
            w = inside[b].to(self.device, x.dtype)  # [b, s]
            e = torch.einsum("sbh,bs->bh", x, w) / w.sum(1, keepdim=True).clamp_min(1)  # mean over the chunk
            out.append(F.normalize(e.float(), dim=-1).cpu())
        return torch.cat(out).numpy()  # [N, h]


# ---------------------------------------------------------------------------------------------- the database
# Megatron's tools/retro in miniature: cut the corpus into m-token chunks, embed each with a frozen embedder, index
# the embeddings with FAISS (inner product of L2-normalized vectors = cosine), and for each query chunk keep the k
# nearest chunks of *other* documents, returned as their r = 2m tokens (the chunk and its continuation).
@dataclass
class Database:
    tokens: np.ndarray  # [N, r] each chunk followed by its continuation in the same document (pad past its end)
    doc: np.ndarray  # [N] the document of each chunk
    index: object  # faiss index over the chunks' embeddings
    m: int


def chunk_documents(token_arrays, doc_ids, m: int, r: int, pad_id: int = 0):
    """Documents -> (chunk tokens + continuation [N, r], document id [N]); a document's last chunk is padded."""
    rows, docs = [], []
    for d, t in zip(doc_ids, token_arrays):
        t = np.asarray(t, dtype=np.int64)
        padded = np.concatenate([t, np.full(r, pad_id, dtype=np.int64)])
        for start in range(0, len(t), m):
            rows.append(padded[start: start + r])
            docs.append(d)
    return np.stack(rows), np.asarray(docs, dtype=np.int64)


def build_database(token_arrays, doc_ids, m: int, embedder, r: int | None = None, index: str = "flat",
                   nlist: int = 64, pad_id: int = 0, cache_dir: str | None = None, progress: bool = True,
                   batch: int = 4096) -> Database:
    """Chunk, embed (with a tqdm bar) and index a corpus; cached under cache_dir/retrieval-db-<hash>/ and reused.
    index: "flat" = exact inner product (IndexFlatIP); "ivf" = IndexIVFFlat with `nlist` lists (large corpora)."""
    import faiss
    from tqdm import tqdm

    r = r or 2 * m
    tokens, doc = chunk_documents(token_arrays, doc_ids, m, r, pad_id)
    key = hashlib.sha256(tokens.tobytes() + doc.tobytes() + f"{m}-{r}-{embedder.name}-{index}-{nlist}".encode())
    path = os.path.join(cache_dir, f"retrieval-db-{key.hexdigest()[:16]}") if cache_dir else None
    if path and os.path.exists(os.path.join(path, "index.faiss")):
        return Database(tokens, doc, faiss.read_index(os.path.join(path, "index.faiss")), m)
    emb = np.concatenate([embedder(tokens[i: i + batch, :m]) for i in tqdm(
        range(0, len(tokens), batch), desc="retrieval: embedding chunks", disable=not progress)]).astype(np.float32)
    if index == "flat":
        ix = faiss.IndexFlatIP(emb.shape[1])
    elif index == "ivf":
        ix = faiss.IndexIVFFlat(faiss.IndexFlatIP(emb.shape[1]), emb.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
        ix.train(emb)
        ix.nprobe = max(1, nlist // 8)
    else:
        raise ValueError(f"index={index!r} is not 'flat' or 'ivf'")
    ix.add(emb)
    if path:
        os.makedirs(path, exist_ok=True)
        np.save(os.path.join(path, "chunks.npy"), tokens)
        np.save(os.path.join(path, "doc.npy"), doc)
        faiss.write_index(ix, os.path.join(path, "index.faiss"))  # last: its presence marks a complete cache
    return Database(tokens, doc, ix, m)


def query_neighbors(db: Database, chunks: np.ndarray, chunk_doc: np.ndarray, k: int, embedder):
    """For query chunks [Q, m] from documents chunk_doc [Q] (or [Q, 2]: a chunk straddling two documents excludes
    both): the k nearest database chunks of other documents. Returns (ids [Q, k], their tokens [Q, k, r]).
    Searches 2k, 4k, ... candidates until k survive the filter."""
    q = embedder(np.asarray(chunks)).astype(np.float32)
    chunk_doc = np.asarray(chunk_doc).reshape(len(q), -1)  # [Q, 1 | 2]
    want = 2 * k
    while True:
        want = min(want, db.index.ntotal)
        _, ids = db.index.search(q, want)  # [Q, want], best first; -1 where an IVF probe found too few
        ok = (ids >= 0) & (db.doc[np.maximum(ids, 0)][:, :, None] != chunk_doc[:, None, :]).all(-1)
        if (ok.sum(1) >= k).all() or want == db.index.ntotal:
            break
        want *= 2
    if (ok.sum(1) < k).any():
        raise ValueError(f"fewer than k={k} chunks from other documents for some query chunks")
    order = np.argsort(~ok, axis=1, kind="stable")[:, :k]  # the first k allowed, in rank order
    out = np.take_along_axis(ids, order, axis=1)
    return out, db.tokens[out]
