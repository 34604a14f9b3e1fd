"""Retro (retro.py, retrieval.py): causality of chunked cross-attention, the closed gate equals GPT, TP/SP/DP equal
the single process, and the retrieval database (planted duplicates found, same-document chunks never returned).

Small shapes: chunk length m = 4, k = 2 neighbours, r = 8, 6 layers (one CCA layer, layer 6, owning the 2-layer
encoder) or 9 (CCA layers 6 and 9), h 32, float64. Tolerance for the layouts: 1e-10 relative (reduction order only).
"""
from __future__ import annotations

import functools
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from einops import rearrange
from hypothesis import given
from hypothesis import strategies as st

import bert
import data
import gpt
import parallel as P
import retrieval
import retro
import tools
import train
from equivalence import assert_same, train_steps
from interop import tokenizer_files

CFG = dict(num_layers=6, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=150,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
           retro_chunk_length=4, retro_num_neighbors=2, retro_encoder_hidden_dropout=0.0,
           retro_encoder_attention_dropout=0.0)
M, K, R = 4, 2, 8


def batch(b: int, n: int, seed: int = 0, vocab: int = 150) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, vocab, (b, n + 1), generator=g),
            "neighbors": torch.randint(0, vocab, (b, n // M, K, R), generator=g)}


# --------------------------------------------------------------------------------------------- 1. causality
@functools.cache
def _model(num_layers: int) -> retro.Model:
    return retro.Model(retro.Config(**dict(CFG, num_layers=num_layers))).eval()


@given(num_layers=st.sampled_from([6, 9]), n_chunks=st.integers(2, 4), j=st.integers(0, 3), seed=st.integers(0, 99))
def test_causality_changing_chunk_j_neighbours(num_layers, n_chunks, j, seed):
    """New neighbours for chunk j change no output before position (j+1)·m − 1, and change the outputs from there on:
    those of chunk j's attending window [(j+1)·m − 1, (j+2)·m − 1) always, and all later ones when a self-attention
    layer follows a CCA layer (L = 9: CCA at 6 and 9; with L = 6 the only CCA layer is the last layer)."""
    j = j % n_chunks
    model, n = _model(num_layers), n_chunks * M
    x = batch(2, n, seed)
    other = x["neighbors"].clone()
    other[:, j] = torch.randint(0, 150, (2, K, R), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        a, b = model(x["tokens"][:, :-1], x["neighbors"]), model(x["tokens"][:, :-1], other)
    first = (j + 1) * M - 1
    diff = (a - b).abs().amax(dim=(0, 2))  # [n]
    assert float(diff[:first].sum()) == 0.0, f"outputs before {first} changed: {diff}"
    last = n if num_layers == 9 else min(n, first + M)
    assert bool((diff[first:last] > 1e-8).all()), f"outputs {first}..{last - 1} did not all change: {diff}"
    assert float(diff[last:].sum()) == 0.0 or num_layers == 9


# --------------------------------------------------------------------------------------------- 2. closed gate
@pytest.mark.parametrize("num_layers,rope", [(6, False), (9, True)])
def test_closed_gate_equals_gpt(num_layers, rope):
    cfg = dict(CFG, num_layers=num_layers)
    if rope:
        cfg.update(position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True)
    model = retro.Model(retro.Config(**cfg))
    ref = gpt.Model(gpt.Config(**{k: v for k, v in cfg.items() if not k.startswith("retro")}))
    x = batch(2, 12, 3)
    logits = model(x["tokens"][:, :-1])  # neighbor_ids=None: the gate is closed
    assert torch.equal(logits, ref(x["tokens"][:, :-1]))
    assert not torch.allclose(model(x["tokens"][:, :-1], x["neighbors"]), logits)  # open, the neighbours matter


# --------------------------------------------------------------------------------------------- 3. TP / SP / DP
def _loss_fn(dp_rank, dp, global_tokens):
    def f(model, mb):
        rows = lambda t: t.chunk(dp)[dp_rank]  # noqa: E731
        toks = rows(mb["tokens"])
        return model(toks[:, :-1], rows(mb["neighbors"]), labels=toks[:, 1:]).sum() / global_tokens
    return f


def layout_case(rank, n, tp, sp, num_layers, b=4, s=8, break_sp=False, muon=False):
    grid = P.Grid(tp=tp, dp=n // tp)
    gather = P.gather_from_sp
    if break_sp:  # negative control: the CCA's sequence all-gather reduce-scatters its grad (counts it tp times)
        P.gather_from_sp = lambda x, g, tp_output_grad=True: gather(x, g, True)
    try:
        model = retro.Model(retro.Config(**dict(CFG, num_layers=num_layers), sequence_parallel=sp), grid)
        rec = train_steps(model, grid, batch(b, s, 5), loss_fn=_loss_fn(grid.dp.rank, grid.dp_size, b * s), muon=muon)
    finally:
        P.gather_from_sp = gather
    rec["losses"] = P.all_reduce(rec["losses"], grid.dp)  # each DP rank summed its rows' share of the loss
    return rec if rank == 0 else None


@functools.cache
def _reference(num_layers, b=4, s=8, muon=False):
    model = retro.Model(retro.Config(**dict(CFG, num_layers=num_layers)))
    return train_steps(model, None, batch(b, s, 5), loss_fn=_loss_fn(0, 1, b * s), muon=muon)


@pytest.mark.parametrize("tp,sp,num_layers", [(1, False, 6), (2, True, 6), (2, False, 9), (4, True, 9)])
def test_layouts_equal_single_process(pool, tp, sp, num_layers):
    """One 4-rank world: tp x dp = 4. Loss, every gradient and every parameter after 2 AdamW steps."""
    got = pool.run(layout_case, 4, tp=tp, sp=sp, num_layers=num_layers)[0]
    err = assert_same(got, _reference(num_layers), 1e-10, f"tp={tp} dp={4 // tp} sp={sp} L={num_layers}")
    print(f"retro tp={tp} dp={4 // tp} sp={sp} L={num_layers}: worst relative error {err:.1e}")


@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_muon_equals_single_process(pool, tp, sp):
    """--optimizer muon (parallel.Muon): the decoder's, the CCA's and the neighbour encoder's matrices orthogonalized
    whole across TP (their shards all-gathered), each rank keeping its own; the rest AdamW's."""
    got = pool.run(layout_case, 4, tp=tp, sp=sp, num_layers=9, muon=True)[0]
    assert_same(got, _reference(9, muon=True), 1e-10, f"muon tp={tp} dp={4 // tp} sp={sp}")


def test_negative_control_wrong_sp_gather_fails(pool):
    got = pool.run(layout_case, 4, tp=2, sp=True, num_layers=6, break_sp=True)[0]
    with pytest.raises(AssertionError, match="pre_cross_attn_layernorm"):
        assert_same(got, _reference(6), 1e-10, "broken SP gather")


def test_megatron_reshape_gives_each_chunk_its_own_neighbours():
    """Megatron reshapes its encoder output [r, b·l·k, h] -> [r·k, b·l, h]. Its columns are neighbour-major by then,
    (k bl): RetroEncoderBiasDropoutAdd stacks the k per-neighbour outputs. So each chunk gets exactly its own k
    neighbours, the keys our rearrange of our chunk-major (bl k) columns gives (in another order, which attention
    does not see); a plain reshape of (bl k) columns would mix chunks. test_megatron_parity_retro_moe.py compares
    the two models."""
    r, bl, k = R, 3, K
    ours = torch.arange(bl * k).expand(r, bl * k)  # [r, (bl k)]: column label c·k + j (chunk c, neighbour j)
    megatron = rearrange(ours, "r (bl k) -> r (k bl)", k=k)  # the same tokens, neighbour-major
    mine, theirs = rearrange(ours, "r (bl k) -> (k r) bl", k=k), megatron.reshape(r * k, bl)  # [keys, chunk]
    own = torch.arange(bl)[None, :] * k + torch.arange(k).repeat_interleave(r)[:, None]  # chunk c's labels
    assert (mine == own).all() and (theirs.sort(0).values == own.sort(0).values).all()
    assert (ours.reshape(r * k, bl) // k != torch.arange(bl)).any()  # (bl k) columns reshaped: chunks mixed


def test_pipeline_parallelism_is_refused():
    with pytest.raises(ValueError, match="pipeline-model-parallel size 2: Retro's chunked cross-attention"):
        retro.Config(**CFG).check_layout(tp=1, pp=2)
    with pytest.raises(ValueError, match="layer_offset=6, num_layers=3 must be the whole model"):
        retro.Model(retro.Config(**CFG), None, True, True, 6, 3)


# --------------------------------------------------------------------------------------------- 4. retrieval
def corpus(n_docs=12, length=40, vocab=150, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length) for _ in range(n_docs)]


class _SpecialTok:  # the corpus-tokenizer surface retrieval.ChunkEmbedder uses: tokenizer_files.SPECIAL_TOKENS at ids 0.. (eod 0)
    def get_vocab_size(self):
        return 150

    def token_to_id(self, t):
        return tokenizer_files.SPECIAL_TOKENS.index(t) if t in tokenizer_files.SPECIAL_TOKENS else None


BERT_CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=150,
                max_position_embeddings=16, hidden_dropout=0.1, attention_dropout=0.1)  # dropout: eval() turns it off


def bert_embedder(**kw) -> retrieval.ChunkEmbedder:  # a random-init tiny BERT: frozen is all the embedder needs
    return retrieval.ChunkEmbedder(bert.Model(bert.Config(**dict(BERT_CFG, **kw))), _SpecialTok(), batch_size=8)


def test_bert_chunk_embedder_is_deterministic_unit_norm_and_batch_and_padding_invariant():
    emb = bert_embedder()
    chunks = np.stack(corpus(n_docs=20, length=M, seed=1))  # [20, m] (no eod: tokens 1..149)
    chunks[5], chunks[7, 2:] = chunks[1], 0  # a duplicate; a chunk ending in eods (a document's last chunk)
    e = emb(chunks)  # [20, h], 8 at a time
    assert e.shape == (20, 32) and e.dtype == np.float32
    np.testing.assert_array_equal(e, emb(chunks))
    np.testing.assert_allclose(e[5], e[1], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    one_by_one = np.concatenate([emb(chunks[i: i + 1]) for i in range(20)])
    np.testing.assert_allclose(one_by_one, e, atol=1e-6)
    # eod is dropped wherever it is: [a b eod eod] embeds as the 2-token chunk [a b], as [eod a eod b eod eod]
    a, b = chunks[7, :2]
    same = [emb(np.array([[a, b, 0, 0]])), emb(np.array([[a, b]])), emb(np.array([[0, a, 0, b, 0, 0]]))]
    for x in same:
        np.testing.assert_allclose(x[0], e[7], atol=1e-6)
    with torch.no_grad():  # Megatron's pooling, written out: [cls] a b [sep] unpadded, torch.mean(h[1 : mask - 1])
        h = emb.model.encode(torch.tensor([[tokenizer_files.SPECIAL_TOKENS.index("<cls>"), a, b,
                                            tokenizer_files.SPECIAL_TOKENS.index("<sep>")]]))[:, 0]  # [s, h]
    np.testing.assert_allclose(e[7], torch.nn.functional.normalize(h[1: 4 - 1].mean(0), dim=0).numpy(), atol=1e-6)
    assert not np.allclose(emb(np.array([[b, a]])), e[7], atol=1e-3)  # order matters (positions): not a bag
    assert (emb(np.zeros((1, M), np.int64)) == 0).all()  # eods only: zeros, as Megatron's empty chunk


def test_bert_chunk_embedder_refuses_another_vocabulary():
    with pytest.raises(data.DataError, match="vocabulary of 200 tokens, the corpus tokenizer 150"):
        bert_embedder(vocab_size=200)


@pytest.mark.parametrize("index,embedder", [("flat", "bag"), ("ivf", "bag"), ("flat", "bert"), ("ivf", "bert")])
def test_planted_duplicate_is_nearest_and_same_document_never(index, embedder, tmp_path):
    docs = corpus()
    docs[7][12:16] = docs[2][8:12]  # plant chunk 2 of document 2 as chunk 3 of document 7
    emb = retrieval.BagOfTokensEmbedder(150, dim=64) if embedder == "bag" else bert_embedder()
    db = retrieval.build_database(docs, list(range(12)), M, emb, index=index, nlist=4, cache_dir=str(tmp_path),
                              progress=False)
    assert db.tokens.shape == (120, R)
    queries, qdoc = db.tokens[:, :M], db.doc
    ids, toks = retrieval.query_neighbors(db, queries, qdoc, K, emb)
    assert ids.shape == (120, K) and toks.shape == (120, K, R)
    assert (db.doc[ids] != qdoc[:, None]).all()  # never the query's own document (though its own chunk scores 1)
    assert ids[2 * 10 + 2, 0] == 7 * 10 + 3 and ids[7 * 10 + 3, 0] == 2 * 10 + 2
    np.testing.assert_array_equal(toks[2 * 10 + 2, 0], np.concatenate([docs[7][12:20]]))  # chunk + continuation
    again = retrieval.build_database(docs, list(range(12)), M, emb, index=index, nlist=4, cache_dir=str(tmp_path),
                                 progress=False)  # from the cache
    assert len(list(tmp_path.iterdir())) == 1
    np.testing.assert_array_equal(retrieval.query_neighbors(again, queries, qdoc, K, emb)[0], ids)


# --------------------------------------------------------------------------------------------- 5. train.py hooks
class _Tok:  # the tokenizer surface the hooks use (no special tokens: continuations are padded with 0)
    def get_vocab_size(self):
        return 150

    def token_to_id(self, t):
        return None


def test_train_hooks_samples_carry_other_document_neighbours(tmp_path):
    docs = corpus(n_docs=12, length=41)
    args = SimpleNamespace(retro_chunk_length=M, retro_num_neighbors=K, seq_length=8, valid_fraction=0.2, seed=1,
                           data_cache_dir=str(tmp_path), retro_bert_load=None)
    train_ids, valid_ids, _ = data.split_documents(len(docs), args.valid_fraction, seed=args.seed)
    ds = retro.dataset(docs, train_ids, args, _Tok(), 1)
    valid = retro.dataset(docs, valid_ids, args, _Tok(), 2)  # neighbours from the training database (cached)
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1
    assert set(ds.db.doc) == set(train_ids.tolist())
    token_doc = np.repeat(train_ids, [len(docs[d]) for d in train_ids])
    C = len(ds.neighbors)
    assert (ds.db.doc[ds.neighbors] != token_doc[: C * M: M, None]).all()  # not the chunk's first token's document
    assert (ds.db.doc[ds.neighbors] != token_doc[M - 1: C * M: M, None]).all()  # nor its last's
    model = retro.Model(retro.Config(**CFG))
    mb = torch.from_numpy(np.stack([ds[0], ds[5], valid[1]]))
    assert mb.shape == (3, 9 + 2 * K * R)
    tokens, nbrs = retro.unpack(model, mb)
    assert torch.equal(tokens[0], torch.from_numpy(ds.gpt[0])) and nbrs.shape == (3, 2, K, R)
    start = int(ds.gpt._order(0)[5]) * 8  # sample 5's place in the token stream: its two chunks, queried afresh
    qdoc = np.stack([token_doc[start: start + 8: M], token_doc[start + M - 1: start + 8: M]], 1)
    _, toks = retrieval.query_neighbors(ds.db, ds.gpt.tokens[start: start + 8].reshape(2, M), qdoc, K, ds.embedder)
    assert torch.equal(nbrs[1], torch.from_numpy(toks))
    assert torch.isfinite(retro.loss_func(model, mb))


def test_train_py_retro_with_a_trained_bert_embedder(tmp_path, monkeypatch):
    """`--retro-bert-load`: a 3-iteration BERT run, then a 2-iteration Retro run that embeds its chunks with it."""
    from harness import SNIPPET, metrics, tiny

    src = tmp_path / "corpus"
    src.mkdir()
    for i in range(40):
        (src / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    cache, calls = tmp_path / "cache", []
    train.main(tiny(src, cache, tmp_path / "bert", "--model", "bert", iters=3))
    filled = tools.main(["sample", "--load", str(tmp_path / "bert"), "--prompt", "def add_1(a, <mask>):"])
    assert re.fullmatch(r"def add_1\(a, \[.+\]\):", filled), filled  # tools.py sample: BERT fills the mask
    real = retrieval.ChunkEmbedder.__call__
    monkeypatch.setattr(retrieval.ChunkEmbedder, "__call__", lambda self, x: calls.append(self.name) or real(self, x))
    train.main(tiny(src, cache, tmp_path / "retro", "--model", "retro", "--num-layers", "6", "--retro-chunk-length",
                    "8", "--retro-bert-load", str(tmp_path / "bert"), iters=2))
    losses, _ = metrics(tmp_path / "retro")
    assert sorted(losses) == [1, 2] and all(np.isfinite(r["loss"]) for r in losses.values())
    with pytest.raises(SystemExit, match="^2$"):  # tools.py sample: a one-line refusal that says why
        tools.main(["sample", "--load", str(tmp_path / "retro")])
    assert calls and all(n.startswith("bert-iter3-") for n in calls)  # the database and the queries: BERT's
    assert len([p for p in cache.glob("retrieval-db-*") if p.is_dir()]) == 1  # one database (train and valid share it)
    # other weights, another name: a database or neighbours cached with the iteration-3 BERT are not reused
    train.main(tiny(src, cache, tmp_path / "bert", "--model", "bert", "--load", str(tmp_path / "bert"), iters=4))
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tmp_path / "bert" / "tokenizer.json"))
    assert retrieval.ChunkEmbedder.load(tmp_path / "bert", tok, "--retro-bert-load").name.startswith("bert-iter4-")
    with pytest.raises(data.DataError, match="--retro-bert-load .*/retro: a --model retro run, whose model has no "
                                             "encoder"):
        retrieval.ChunkEmbedder.load(tmp_path / "retro", tok, "--retro-bert-load")
