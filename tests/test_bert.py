"""BERT (bert.py): Hugging Face parity, every layout against the single process, padding invariance, MLM statistics.

Tolerances: from_hf float32 1e-4 (measured ~1e-7: same ops, different order; a wrong layout moves logits ~1e-1);
layouts float64 1e-10 relative (reduction order only); padding invariance float64 1e-12 (padded keys get exactly zero
attention weight; only the blocking of the sums may change); the loss recipe against its formula by hand float64
1e-12 (the same sums in another order). Statistics: 5 binomial standard deviations.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given
from hypothesis import strategies as st

import bert
import parallel as P
from equivalence import assert_same, muon_optimizer

SPECIAL = {"eod": 0, "pad": 1, "cls": 2, "sep": 3, "mask": 4}


def random_docs(vocab, n_docs=12, seed=0):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(5, vocab, int(rng.integers(3, 40))), 0) for _ in range(n_docs)]


def make_batch(vocab, b, s, seed=0, binary_head=True):
    """A global batch [b, 6, s] from the real recipe, with padding in it (short samples)."""
    ds = bert.BertDataset(random_docs(vocab, seed=seed), range(12), s, seed, SPECIAL, vocab, binary_head,
                          short_seq_prob=0.5)
    batch = bert.mlm_batch(ds, 0, b)
    assert (batch[:, bert.PADDING_MASK] == 0).any(), "the test batch must hold padding"
    return batch


# --------------------------------------------------------------------------------------- 1. Hugging Face
def hf_bert(cls="BertForPreTraining", tied=True):
    """A tiny random transformers.`cls` (named, not imported here: the worker ranks that import this file for its
    cases would otherwise each load Hugging Face's model code, seconds of CPU a rank)."""
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.BertConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
        tie_word_embeddings=tied)).eval()


def hf_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 20), generator=g)
    am = torch.ones(3, 20, dtype=torch.long)
    am[1, 12:], am[2, 5:] = 0, 0  # padding
    tt = torch.zeros(3, 20, dtype=torch.long)
    tt[:, 8:] = 1
    return ids, am, tt


@pytest.mark.parametrize("cls,tied", [("BertForPreTraining", True), ("BertForPreTraining", False),
                                      ("BertForMaskedLM", True)], ids=["pretraining", "untied", "mlm"])
def test_from_hf_logits_match(cls, tied):
    hf = hf_bert(cls, tied)
    ours = bert.from_hf(hf).eval()
    ids, am, tt = hf_inputs()
    with torch.no_grad():
        ref, (lm, binary) = hf(input_ids=ids, attention_mask=am, token_type_ids=tt), ours(ids, am, tt)
    lm_ref = ref.prediction_logits if hasattr(ref, "prediction_logits") else ref.logits
    assert lm.shape == lm_ref.shape == (3, 20, 300)
    assert (lm - lm_ref).abs().max() < 1e-4, (lm - lm_ref).abs().max()
    if cls == "BertForPreTraining":
        assert binary.shape == (3, 2) and (binary - ref.seq_relationship_logits).abs().max() < 1e-4
    else:
        assert binary is None
    with torch.no_grad():  # the loss path: per-token CE over Hugging Face's own vocabulary (mask_vocab_padding:
        per_token, _ = ours(ids, am, tt, lm_labels=ids)  # the padded rows out, tests/test_hf_first_loss.py)
    ce = torch.nn.functional.cross_entropy(lm_ref.transpose(1, 2), ids, reduction="none")
    assert (per_token - ce).abs().max() < 1e-4


def test_from_hf_needs_the_post_ln_residual():
    """The check can fail: the same weights in Megatron-core's pre-LN residual layout give other logits."""
    hf, (ids, am, tt) = hf_bert(), hf_inputs()
    ours = bert.from_hf(hf).eval()
    ours.config.apply_residual_connection_post_layernorm = False  # every layer reads this config object
    with torch.no_grad():
        assert (ours(ids, am, tt)[0] - hf(input_ids=ids, attention_mask=am, token_type_ids=tt)
                .prediction_logits).abs().max() > 1e-2


# --------------------------------------------------------------------------------------- 2. layouts
def train_bert(grid, cfg, sp, M, batch, steps=2, muon=False):
    """`steps` AdamW steps (muon: parallel.Muon's) on the global batch [B, 6, s] cut into DP shards and M
    micro-batches per rank."""
    c = bert.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, n: bert.Model(c, grid, pre, post, off, n), c.num_layers, grid)
    opt = muon_optimizer(chunks, grid) if muon else torch.optim.AdamW(
        [p for m in chunks for p in m.parameters()], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    num_masked, num_seqs = bert.num_masked_tokens(batch), batch.shape[0]
    dp, d = (grid.dp_size, grid.dp.rank) if grid is not None else (1, 0)
    micro = list(batch.chunk(dp)[d].chunk(M))
    tp, s = (grid.tp_size if grid is not None else 1), batch.shape[-1]
    shape = (s // tp if chunks[0].config.sequence_parallel else s, micro[0].shape[0], c.hidden_size)
    step_fn = lambda model, mb: bert.loss_func(model, mb, num_masked, num_seqs)  # noqa: E731
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        loss = P.forward_backward(chunks, micro, step_fn, num_masked, grid, shape, c.params_dtype)
        P.finalize_grads(chunks, grid)
        loss = torch.as_tensor(loss, dtype=torch.float64).reshape(1)
        if grid is not None:
            loss = P.all_reduce(P.all_reduce(loss, grid.dp_cp), grid.pp)  # only last stages hold a part
        losses.append(loss)
        if step == 0:
            grads = named(chunks, grid, True)
        opt.step()
    return dict(losses=torch.cat(losses), grads=grads, params=named(chunks, grid, False))


def named(chunks, grid, grads):
    out = {}
    for m in chunks:
        for name, p in m.named_parameters():
            key = m.global_name(name)
            if key != name and not name.startswith("decoder."):
                continue  # a last stage's copy of the tied embedding (kept in sync by finalize_grads)
            out[key] = P.gather_full(p.grad if grads else p.data, p, grid).clone()
    return out


def layout_case(rank, n, cfg, tp, pp, sp, M, batch, muon=False):
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    rec = train_bert(grid, cfg, sp, M, batch, muon=muon)
    return rec if grid.tp.rank == 0 and grid.dp.rank == 0 else None


def merge(results):
    out = dict(grads={}, params={})
    for r in results:
        if r is not None:
            out["grads"].update(r["grads"])
            out["params"].update(r["params"])
            out["losses"] = r["losses"]  # the same on every rank (all-reduced)
    return out


CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, vocab_size=150,
           make_vocab_size_divisible_by=8, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
           params_dtype=torch.float64, seed=3)


def check_layout(pool, cfg, tp, pp, dp, sp, M, b, s, seed=0, muon=False):
    batch = make_batch(cfg["vocab_size"], b, s, seed, cfg.get("add_binary_head", True))
    got = merge(pool.run(layout_case, tp * pp * dp, cfg=cfg, tp=tp, pp=pp, sp=sp, M=M, batch=batch, muon=muon))
    ref = train_bert(None, cfg, False, 1, batch, muon=muon)
    return assert_same(got, ref, rtol=1e-10, what=f"tp={tp} pp={pp} dp={dp} sp={sp} M={M} {cfg}")


# One 4-rank world serves every layout (starting a pool is the slow part): tp 1/2/4 x SP, pp 1/2, dp 1/2/4.
LAYOUTS = [(4, 1, 1), (2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 1, 4)]


@pytest.mark.parametrize("tp,pp,dp,sp", [(4, 1, 1, False), (4, 1, 1, True), (2, 1, 2, False), (2, 1, 2, True),
                                         (2, 2, 1, False), (2, 2, 1, True), (1, 2, 2, False), (1, 1, 4, False)])
def test_layouts_equal_single_process_float64(pool, tp, pp, dp, sp):
    check_layout(pool, CFG, tp, pp, dp, sp, M=2, b=4 * dp, s=8)


@pytest.mark.parametrize("tp,pp,dp,sp", [(2, 2, 1, True), (2, 1, 2, True)])
def test_muon_equals_single_process_float64(pool, tp, pp, dp, sp):
    """--optimizer muon (parallel.Muon) with BERT's heads: the pooler's and LM head's dense matrices are Muon's;
    the binary head (a classifier) and the position and token-type tables stay AdamW's, as the word embedding."""
    cfg = dict(CFG, position_embedding_type="learned_absolute")
    check_layout(pool, cfg, tp, pp, dp, sp, M=2, b=4 * dp, s=8, muon=True)


@given(st.sampled_from(LAYOUTS), st.booleans(),
       st.booleans(), st.booleans(), st.booleans(), st.sampled_from([1, 2]), st.sampled_from([8, 12]),
       st.integers(20, 200))
def test_bert_variants_equal_single_process_float64(pool, layout, sp, binary, post_ln, tied, M, s, vocab):
    tp, pp, dp = layout
    cfg = dict(CFG, add_binary_head=binary, apply_residual_connection_post_layernorm=post_ln, vocab_size=vocab,
               share_embeddings_and_output_weights=tied)
    check_layout(pool, cfg, tp, pp, dp, sp and tp > 1, M, b=2 * M * dp, s=s, seed=vocab)


def test_wrong_pooler_gradient_is_caught(pool):
    """Negative control: under SP, a pooler whose sequence gather reduce-scatters its gradient (summing the tp
    identical copies) instead of slicing it must fail the same comparison."""
    batch = make_batch(CFG["vocab_size"], 4, 8)
    ref = train_bert(None, CFG, False, 1, batch)
    assert_same(merge(pool.run(layout_case, 4, cfg=CFG, tp=4, pp=1, sp=True, M=1, batch=batch)), ref, rtol=1e-10)
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(merge(pool.run(broken_pooler_case, 4, cfg=CFG, batch=batch)), ref, rtol=1e-10)


def broken_pooler_case(rank, n, cfg, batch):
    orig = P.gather_from_sp
    P.gather_from_sp = lambda x, g, tp_output_grad=True: orig(x, g, True)  # reduce-scatter: sums identical grads
    try:
        return layout_case(rank, n, cfg, 4, 1, True, 1, batch)
    finally:
        P.gather_from_sp = orig


# --------------------------------------------------------------------------------------- 2b. the loss formula
@pytest.mark.parametrize("M", [1, 3])
def test_global_loss_equals_the_formula_by_hand(M):
    """The layout tests share bert.loss_func between the parallel runs and the reference, so they cannot check its
    formula. Here the global loss train.py's recipe gives (bert.batch_recipe through the schedule: Σ over
    micro-batches of loss_func / num_masked) must equal DESIGN.md §2's rule computed from the model's raw outputs
    with F.cross_entropy:  Σ masked-LM token losses / num_masked + Σ sentence-order losses / num_seqs.
    Tolerance float64 1e-12 relative: the same numbers summed in another order."""
    cfg = dict(CFG, vocab_size=152, max_position_embeddings=32)  # 152 = 19·8: no padded logits to account for
    model = bert.Model(bert.Config(**cfg))
    assert model.config.padded_vocab_size == cfg["vocab_size"]
    batch = make_batch(cfg["vocab_size"], 6, 32, seed=4)
    recipe, num_masked = bert.batch_recipe(batch)
    num_seqs = batch.shape[0]
    assert num_masked == int(batch[:, bert.LOSS_MASK].sum()) and num_masked != num_seqs  # the weighting matters
    got = float(P.forward_backward([model], list(batch.chunk(M)), recipe, num_masked, None))
    with torch.no_grad():
        logits, binary = model(batch[:, bert.TEXT], batch[:, bert.PADDING_MASK], batch[:, bert.TYPES])
    mask = batch[:, bert.LOSS_MASK].bool()
    lm = F.cross_entropy(logits[mask], batch[:, bert.LABELS][mask], reduction="sum")
    sop = F.cross_entropy(binary, batch[:, bert.IS_RANDOM, 0], reduction="sum")
    want = float(lm / num_masked + sop / num_seqs)
    assert float(sop) > 0.01 * want, "the sentence-order term must weigh in the total"
    assert abs(got - want) <= 1e-12 * abs(want), f"recipe loss {got!r} != hand formula {want!r}"


# --------------------------------------------------------------------------------------- 3. padding invariance
@pytest.mark.parametrize("binary", [True, False])
def test_appended_padding_changes_nothing(binary):
    cfg = dict(CFG, add_binary_head=binary, max_position_embeddings=32)
    model = bert.Model(bert.Config(**cfg)).eval()
    batch = make_batch(cfg["vocab_size"], 4, 12, binary_head=binary)
    more = torch.cat([batch, torch.zeros(4, 6, 9, dtype=batch.dtype)], -1)
    more[:, bert.TEXT, 12:] = SPECIAL["pad"]
    run = lambda b: model(b[:, bert.TEXT], b[:, bert.PADDING_MASK], b[:, bert.TYPES] if binary else None)  # noqa
    with torch.no_grad():
        (lm1, bin1), (lm2, bin2) = run(batch), run(more)
    real = batch[:, bert.PADDING_MASK].bool()
    assert (lm1[real] - lm2[:, :12][real]).abs().max() < 1e-12
    if binary:
        assert (bin1 - bin2).abs().max() < 1e-12
    # and the check can fail: unmask the padding and the real tokens' outputs move
    with torch.no_grad():
        lm3, _ = model(more[:, bert.TEXT], torch.ones_like(more[:, 0]), more[:, bert.TYPES] if binary else None)
    assert (lm1[real] - lm3[:, :12][real]).abs().max() > 1e-6


# --------------------------------------------------------------------------------------- 4. the data recipe
def test_masking_statistics_match_15_80_10_10():
    V, s, n = 1000, 64, 3000
    docs = random_docs(V, n_docs=400, seed=5)
    docs = [np.append(np.random.default_rng(i).integers(5, V, 200), 0) for i in range(400)]
    ds = bert.BertDataset(docs, range(400), s, seed=7, special=SPECIAL, vocab_size=V)
    batch = bert.mlm_batch(ds, 0, n).numpy()
    text, labels, loss_mask = batch[:, bert.TEXT], batch[:, bert.LABELS], batch[:, bert.LOSS_MASK].astype(bool)
    real = batch[:, bert.PADDING_MASK].astype(bool) & (labels != SPECIAL["cls"]) & (labels != SPECIAL["sep"])
    assert not (loss_mask & ~real).any(), "only real, non-special tokens are predicted"
    frac = loss_mask.sum() / real.sum()
    assert abs(frac - 0.15) < 0.005, frac  # round(15%) per sample: off by < 1/2 token each
    m = loss_mask.sum()
    sd = lambda p: 5 * np.sqrt(p * (1 - p) / m)  # noqa: E731
    to_mask = (text[loss_mask] == SPECIAL["mask"]).mean()
    kept = (text[loss_mask] == labels[loss_mask]).mean()
    p_kept = 0.1 + 0.1 / len(ds.random_ids)  # a random replacement may draw the original token
    assert abs(to_mask - 0.8) < sd(0.8) and abs(kept - p_kept) < sd(0.1) and abs(1 - to_mask - kept - 0.1 + 0.1 / len(
        ds.random_ids)) < sd(0.1), (to_mask, kept)
    assert (text[~loss_mask & real] == labels[~loss_mask & real]).all(), "unpredicted tokens are untouched"
    is_random = batch[:, bert.IS_RANDOM, 0]
    assert abs(is_random.mean() - 0.5) < 5 * np.sqrt(0.25 / n)
    # sentence order: segment A then B is the document's text (is_random 0), or B then A (is_random 1)
    stream = {tuple(d[:-1]) for d in docs}
    for row in batch[:50]:
        t = row[bert.LABELS][row[bert.PADDING_MASK] == 1]
        seps = np.flatnonzero(t == SPECIAL["sep"])
        a, b_ = t[1:seps[0]], t[seps[0] + 1:seps[1]]
        joined = tuple(np.concatenate([b_, a] if row[bert.IS_RANDOM, 0] else [a, b_]))
        assert any(joined == doc[i:i + len(joined)] for doc in stream for i in range(len(doc) - len(joined) + 1))
        assert (row[bert.TYPES][: seps[0] + 1] == 0).all() and (row[bert.TYPES][seps[0] + 1: len(t)] == 1).all()


def test_whole_word_masking_masks_whole_words():
    V, s = 200, 48
    starts = np.zeros(V, bool)
    starts[5::3] = True  # every third id begins a word
    docs = [np.append(np.random.default_rng(i).integers(5, V, 60), 0) for i in range(50)]
    ds = bert.BertDataset(docs, range(50), s, 1, SPECIAL, V, word_starts=starts)
    for row in bert.mlm_batch(ds, 0, 100).numpy():
        lab, lm, n = row[bert.LABELS], row[bert.LOSS_MASK], int(row[bert.PADDING_MASK].sum())
        for i in range(2, n - 1):  # a masked continuation token implies its word's previous token is masked
            if lm[i] and not starts[lab[i]] and lab[i - 1] not in (SPECIAL["cls"], SPECIAL["sep"]):
                assert lm[i - 1], (i, lab[: n], lm[: n])
            if lm[i - 1] and not starts[lab[i]] and lab[i] not in (SPECIAL["cls"], SPECIAL["sep"]):
                assert lm[i], (i, lab[: n], lm[: n])


def test_batches_depend_only_on_seed_and_iteration():
    docs = random_docs(100, seed=2)
    a = bert.BertDataset(docs, range(12), 16, 9, SPECIAL, 100)
    b = bert.BertDataset(docs, range(12), 16, 9, SPECIAL, 100)
    assert torch.equal(bert.mlm_batch(a, 3, 4), bert.mlm_batch(b, 3, 4))
    assert torch.equal(bert.mlm_batch(a, 1, 4)[2:], bert.mlm_batch(b, 3, 2))  # sample i is sample i
    assert not torch.equal(bert.mlm_batch(a, 0, 4), bert.mlm_batch(a, 1, 4))


def test_bad_inputs_name_the_values():
    with pytest.raises(ValueError, match="num_tokentypes >= 2 .* got 1"):
        bert.Config(num_tokentypes=1)
    model = bert.Model(bert.Config(**dict(CFG, add_binary_head=False)))
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 7\) != input_ids \(2, 8\)"):
        model(ids, torch.ones(2, 7))
    with pytest.raises(ValueError, match="num_tokentypes=0"):
        model(ids, torch.ones(2, 8), ids)
    with pytest.raises(ValueError, match="span of 20 tokens does not fit seq_length=16"):
        bert.make_bert_sample(np.arange(5, 25), 16, SPECIAL, np.random.default_rng(0), np.arange(5, 30))


def test_parameters_are_initialized_once_after_the_heads_exist(monkeypatch):
    """gpt.Model's skeleton fills every parameter once, at the end of __init__, BERT's heads included."""
    calls, init = [], P.init_params
    monkeypatch.setattr(P, "init_params", lambda module, *a, **kw: (calls.append(module), init(module, *a, **kw)))
    model = bert.Model(bert.Config(**CFG))
    assert calls == [model]
    assert all(hasattr(p, "init") for p in model.parameters())  # none left at torch's default init
