"""t5.py: Hugging Face parity, the bucket table, TP/SP/DP == single process, decoder causality, span corruption.

Tolerances (as in test_hf.py / test_tensor_parallel.py): float32 logits vs Hugging Face 1e-4 absolute (measured:
~1e-5 on logits of magnitude ~30, 0 on magnitude ~4); float64 layouts vs the single process 1e-10 relative (only the
order of reductions differs).
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given
from hypothesis import strategies as st

import parallel as P
import t5
import transformer
from equivalence import assert_same, train_steps

V = 211


def hf_t5(ff="relu", tied=True, dec_layers=3):
    """tied=False is T5 v1.1: its own lm_head and no output scaling (transformers 5 ties T5's lm_head to the
    embedding whatever tie_word_embeddings says, but only scales the output when it is not False)."""
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=300, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=dec_layers, num_heads=4,
        dropout_rate=0.0, feed_forward_proj=ff, tie_word_embeddings=tied, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if not tied:
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(300, 32))
    return hf.eval()


def padded_inputs():
    g = torch.Generator().manual_seed(1)
    enc, dec = torch.randint(2, 300, (3, 40), generator=g), torch.randint(2, 300, (3, 30), generator=g)
    em, dm = torch.ones(3, 40, dtype=torch.long), torch.ones(3, 30, dtype=torch.long)
    em[1, 25:] = em[2, 5:] = dm[2, 20:] = 0  # padded encoder rows (and one padded decoder row)
    return enc, dec, em, dm


# --------------------------------------------------------------------------------------- 1. Hugging Face
@pytest.mark.parametrize("ff,tied", [("relu", True), ("gated-gelu", False)], ids=["t5-relu-tied", "t5v1.1-gated"])
def test_from_hf_logits_match_with_padding(ff, tied):
    hf = hf_t5(ff, tied)
    ours = t5.from_hf(hf).eval()
    assert ours.config.scale_decoder_outputs == tied and ours.config.share_embeddings_and_output_weights == tied
    enc, dec, em, dm = padded_inputs()
    with torch.no_grad():
        ref = hf(input_ids=enc, attention_mask=em, decoder_input_ids=dec, decoder_attention_mask=dm).logits
        got = ours(enc, dec, em, dm)
        again = ours(None, dec, em, dm, encoder_hidden_states=ours.encode(enc, em))  # reused encoder output
    assert got.shape == ref.shape == (3, 30, 300)
    assert (got - ref).abs().max().item() < 1e-4
    assert torch.equal(got, again)


def test_from_hf_detects_a_wrong_bias_table():
    """The comparison can fail: swapping two heads of the decoder's bias table moves the logits."""
    hf = hf_t5()
    ours = t5.from_hf(hf).eval()
    w = ours.decoder_relative_pos_emb.relative_attention_bias.weight
    enc, dec, em, dm = padded_inputs()
    with torch.no_grad():
        w[:, [0, 1]] = w[:, [1, 0]]
        assert (ours(enc, dec, em, dm) - hf(input_ids=enc, attention_mask=em, decoder_input_ids=dec).logits
                ).abs().max() > 1e-3


def test_greedy_generation_matches_hugging_face():
    hf = hf_t5("gated-gelu", tied=False)
    ours = t5.from_hf(hf)
    enc, _, em, _ = padded_inputs()
    ref = hf.generate(input_ids=enc, attention_mask=em, max_new_tokens=8, do_sample=False, num_beams=1,
                      eos_token_id=None, use_cache=False)[:, 1:]  # HF's output starts with the decoder start token
    got = t5.generate(ours, enc, 8, bos=0, encoder_attn_mask=em)
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------------------- 2. bucket table
# The first relative position (key − query) of every bucket, 32 buckets, max distance 128, worked out by hand from
# DESIGN.md §4: bidirectional nb = 16, max_exact 8, bucket 8 + k starts at ceil(8·16^(k/8)); causal nb = 32,
# max_exact 16, bucket 16 + k starts at ceil(16·8^(k/16)).
BIDIRECTIONAL_FIRST = {0: 0, 1: -1, 2: -2, 3: -3, 4: -4, 5: -5, 6: -6, 7: -7, 8: -8, 9: -12, 10: -16, 11: -23,
                       12: -32, 13: -46, 14: -64, 15: -91,
                       17: 1, 18: 2, 19: 3, 20: 4, 21: 5, 22: 6, 23: 7, 24: 8, 25: 12, 26: 16, 27: 23, 28: 32,
                       29: 46, 30: 64, 31: 91}
CAUSAL_FIRST = {**{k: -k for k in range(17)}, 17: -19, 18: -21, 19: -24, 20: -27, 21: -31, 22: -35, 23: -40,
                24: -46, 25: -52, 26: -59, 27: -67, 28: -77, 29: -87, 30: -99, 31: -113}


def exact_bucket(rel, bidirectional, nb=32, max_distance=128):
    """The formula in integers: floor(log(r/e)/log(D/e)·m) ≥ k  ⇔  r^m·e^k ≥ D^k·e^m (no rounding anywhere)."""
    b = 0
    if bidirectional:
        nb //= 2
        b, rel = (nb if rel > 0 else 0), abs(rel)
    else:
        rel = -min(rel, 0)
    e, m = nb // 2, nb // 2
    if rel < e:
        return b + rel
    k = max(k for k in range(4 * m) if rel**m * e**k >= max_distance**k * e**m)
    return b + min(e + k, nb - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_at_every_boundary(bidirectional):
    table = BIDIRECTIONAL_FIRST if bidirectional else CAUSAL_FIRST
    for bucket, first in table.items():
        step = -1 if first < 0 else 1  # the position just before the boundary (closer to 0) is one bucket lower
        got = transformer.relative_position_bucket(torch.tensor([first, first - step]), bidirectional).tolist()
        assert got[0] == bucket, (first, got)
        assert first == 0 or got[1] == bucket - 1 or (bucket == 17 and got[1] == 0), (first, got)
    rel = torch.arange(-400, 401)
    for nb, dist in [(32, 128), (8, 20), (16, 64)]:
        got = transformer.relative_position_bucket(rel, bidirectional, nb, dist)
        assert got.tolist() == [exact_bucket(int(r), bidirectional, nb, dist) for r in rel]
        assert torch.equal(got, transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            rel, bidirectional, nb, dist))
    if not bidirectional:
        assert transformer.relative_position_bucket(torch.arange(1, 50), False).eq(0).all()  # the future: masked anyway


# --------------------------------------------------------------------------------------- 3. TP / SP / DP
def make_t5_batch(b, seed, raw=20, se=20, sd=8):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(110, V, (b, raw), generator=g)
    return t5.span_corruption(rows, list(range(5, 105)), bos=2, eos=0, pad=1, seed=seed, encoder_seq_length=se,
                              decoder_seq_length=sd)


def t5_case(rank, n, cfg, tp, sp, b, seed, muon=False):
    grid = P.Grid(tp=tp, dp=n // tp) if n > 1 else None
    model = t5.Model(t5.Config(**cfg, sequence_parallel=sp), grid)
    batch = make_t5_batch(b, seed)
    count = batch["loss_mask"].sum()  # the global number of target tokens (DESIGN.md §2)
    dp, r = (grid.dp_size, grid.dp.rank) if grid is not None else (1, 0)
    mine = {k: v.chunk(dp)[r] for k, v in batch.items()}
    rec = train_steps(model, grid, mine, loss_fn=lambda m, bt: t5.t5_loss(m, bt) / count, muon=muon)
    return rec if grid is None or grid.tp.rank == 0 else None


@st.composite
def t5_layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    dp = 4 // tp  # one 4-rank world for every case: starting ranks is the slow part here
    hf_style = draw(st.booleans())
    tied = draw(st.booleans())
    cfg = dict(num_layers=1, encoder_num_layers=draw(st.sampled_from([1, 2])),
               decoder_num_layers=draw(st.sampled_from([1, 2])),
               hidden_size=32, num_attention_heads=4, kv_channels=draw(st.sampled_from([4, 8])),
               ffn_hidden_size=8 * tp, vocab_size=V, make_vocab_size_divisible_by=draw(st.sampled_from([4, 128])),
               max_position_embeddings=20, relative_attention_num_buckets=8, relative_attention_max_distance=12,
               position_embedding_type=draw(st.sampled_from(["relative", "relative", "rope", "learned_absolute"])),
               share_embeddings_and_output_weights=tied, hidden_dropout=0.0, attention_dropout=0.0,
               params_dtype=torch.float64, seed=draw(st.integers(0, 99)))
    if hf_style:  # Google's T5: RMS norm without bias, no scaling, gated GeLU or ReLU, no biases, scaled output
        cfg.update(normalization="RMSNorm", softmax_scale=1.0, add_bias_linear=False, lm_head_bias=False,
                   scale_decoder_outputs=tied, **draw(st.sampled_from([
                       dict(activation="gelu_tanh", gated_linear_unit=True), dict(activation="relu")])))
    return tp, dp, cfg, draw(st.booleans()), 4


@given(t5_layouts())
def test_t5_parallel_equals_single_process_float64(pool, layout):
    tp, dp, cfg, sp, b = layout
    ref = t5_case(0, 1, cfg, 1, False, b, seed=3)
    res = [r for r in pool.run(t5_case, tp * dp, cfg=cfg, tp=tp, sp=sp, b=b, seed=3) if r is not None]
    got = dict(res[0], losses=sum(r["losses"] for r in res))  # each DP rank returns its part of the global loss
    assert_same(got, ref, rtol=1e-10, what=f"tp={tp} dp={dp} sp={sp} {cfg}")


PINNED = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, vocab_size=V,
              max_position_embeddings=20, relative_attention_num_buckets=8, relative_attention_max_distance=12,
              hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)


@pytest.mark.parametrize("tp,cfg", [
    (4, dict(PINNED, normalization="RMSNorm", softmax_scale=1.0, add_bias_linear=False, lm_head_bias=False,
             scale_decoder_outputs=True, activation="gelu_tanh", gated_linear_unit=True)),  # Google's, tied
    (2, dict(PINNED, share_embeddings_and_output_weights=False)),  # Megatron's, untied, with dp = 2
], ids=["hf-style-tp4-sp", "megatron-style-tp2-dp2-sp"])
def test_t5_sequence_parallel_equals_single_process_float64(pool, tp, cfg):
    """Always run with SP on at tp > 1 (the drawn layouts above may not reach it)."""
    ref = t5_case(0, 1, cfg, 1, False, 8, seed=5)
    res = [r for r in pool.run(t5_case, 4, cfg=cfg, tp=tp, sp=True, b=8, seed=5) if r is not None]
    assert_same(dict(res[0], losses=sum(r["losses"] for r in res)), ref, rtol=1e-10, what=f"tp={tp} sp")


@pytest.mark.parametrize("tp,cfg", [
    (2, PINNED), (4, dict(PINNED, normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True))],
    ids=["tp2-dp2-sp", "tp4-sp"])
def test_muon_equals_single_process_float64(pool, tp, cfg):
    """--optimizer muon (parallel.Muon): the encoder's and decoder's matrices (self- and cross-attention) each
    orthogonalized whole across TP; the relative-position tables (a lookup, sharded by heads) stay AdamW's."""
    ref = t5_case(0, 1, cfg, 1, False, 8, seed=6, muon=True)
    res = [r for r in pool.run(t5_case, 4, cfg=cfg, tp=tp, sp=True, b=8, seed=6, muon=True) if r is not None]
    assert_same(dict(res[0], losses=sum(r["losses"] for r in res)), ref, rtol=1e-10, what=f"muon tp={tp}")


MOE_T5 = dict(PINNED, num_layers=3, encoder_num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
              moe_token_dispatcher_type="alltoall", moe_layer_freq=2)


def test_moe_layers_are_the_ones_moe_layer_freq_names():
    """Encoder and decoder each number their layers from 0 (Megatron-core: two TransformerBlocks)."""
    def moe_layers(**kw):
        m = t5.Model(t5.Config(**dict(MOE_T5, **kw)))
        return [[isinstance(layer.mlp, P.MoELayer) for layer in stack.layers] for stack in (m.encoder, m.decoder)]

    assert moe_layers() == [[True, False], [True, False, True]]
    assert moe_layers(moe_layer_freq=[0, 1, 1]) == [[False, True], [False, True, True]]
    assert moe_layers(num_experts=None) == [[False, False], [False, False, False]]
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by expert-model-parallel size 3"):
        t5.Config(**MOE_T5).check_layout(tp=1, pp=1, ep=3)


def t5_moe_case(rank, n, cfg, tp, ep, b, seed):
    grid = P.Grid(tp=tp, dp=n // tp, ep=ep) if n > 1 else None
    model = t5.Model(t5.Config(**cfg), grid)
    batch = make_t5_batch(b, seed)
    count = batch["loss_mask"].sum()
    dp, r = (grid.dp_size, grid.dp.rank) if grid is not None else (1, 0)
    rec = train_steps(model, grid, {k: v.chunk(dp)[r] for k, v in batch.items()},
                      loss_fn=lambda m, bt: t5.t5_loss(m, bt) / count)
    rec["losses"] = rec["losses"] if grid is None or grid.tp.rank == 0 else 0 * rec["losses"]  # a DP rank's part
    return rec  # every rank: its own experts, under their global names


@pytest.mark.parametrize("tp,n", [(1, 2), (2, 4)], ids=["dp2-ep2", "tp2-dp2-ep2"])
def test_t5_moe_expert_parallel_equals_single_process_float64(pool, tp, n):
    """MoE T5 under expert parallelism: each EP rank initializes and trains its own (global) experts."""
    ref = t5_moe_case(0, 1, MOE_T5, 1, 1, 8, seed=7)
    res = pool.run(t5_moe_case, n, cfg=MOE_T5, tp=tp, ep=2, b=8, seed=7)
    got = dict(res[0], losses=sum(r["losses"] for r in res), grads={}, params={})
    for r in res:
        got["grads"].update(r["grads"])
        got["params"].update(r["params"])
    assert "decoder.layers.2.mlp.experts.linear_fc1.weight3" in got["params"]
    assert_same(got, ref, rtol=1e-10, what=f"tp={tp} ep=2")


def test_pipeline_parallelism_is_refused_with_the_value():
    with pytest.raises(ValueError, match="pipeline-model-parallel size 2: T5's encoder and decoder are not split"):
        t5.Config().check_layout(tp=1, pp=2)
    with pytest.raises(ValueError, match="pre_process=True, post_process=False"):
        t5.Model(t5.Config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=50), post_process=False)


# --------------------------------------------------------------------------------------- 4. causality
@given(st.integers(0, 10), st.sampled_from(["relative", "rope", "learned_absolute"]))
def test_decoder_logits_do_not_depend_on_later_decoder_inputs(i, pe):
    torch.manual_seed(0)
    model = t5.Model(t5.Config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V,
                               position_embedding_type=pe, max_position_embeddings=16, hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=torch.float64)).eval()
    enc, _, em, _ = padded_inputs()
    enc, em = enc[:, :16] % V, em[:, :16]
    dec = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(i))
    changed = dec.clone()
    changed[:, i + 1:] = (changed[:, i + 1:] + 7) % V
    enc2 = enc.clone()
    enc2[:, 3] = (enc2[:, 3] + 1) % V  # control: a real (unpadded) encoder token reaches every decoder position
    with torch.no_grad():
        a, b, c = model(enc, dec, em), model(enc, changed, em), model(enc2, dec, em)
    assert torch.equal(a[:, : i + 1], b[:, : i + 1])
    assert i == 11 or (a[:, i + 1:] - b[:, i + 1:]).abs().max() > 1e-6
    assert (a[:, 0] - c[:, 0]).abs().amax(-1).gt(1e-9).all()


# --------------------------------------------------------------------------------------- 5. span corruption
def test_span_corruption_round_trips_and_has_t5_statistics():
    sentinels = list(range(5, 105))
    rows = torch.randint(110, 8000, (16, 129), generator=torch.Generator().manual_seed(0))
    out = t5.span_corruption(rows, sentinels, bos=2, eos=0, pad=1, seed=7, encoder_seq_length=128,
                             decoder_seq_length=32)
    again = t5.span_corruption(rows, sentinels, bos=2, eos=0, pad=1, seed=7, encoder_seq_length=128,
                               decoder_seq_length=32)
    other = t5.span_corruption(rows, sentinels, bos=2, eos=0, pad=1, seed=8, encoder_seq_length=128,
                               decoder_seq_length=32)
    assert all(torch.equal(out[k], again[k]) for k in out) and not torch.equal(out["text_enc"], other["text_enc"])
    noise, spans, se, sd = t5.corrupted_lengths(129)
    assert (noise, spans, se, sd) == (19, 6, 117, 26)  # 15% noise, mean span 19/6 ≈ 3
    assert out["enc_mask"].sum(1).eq(se).all() and out["loss_mask"].sum(1).eq(sd).all()
    assert torch.equal(out["text_dec"][:, 1:sd], out["labels"][:, : sd - 1]) and out["text_dec"][:, 0].eq(2).all()
    for row, enc, lab in zip(rows.tolist(), out["text_enc"].tolist(), out["labels"].tolist()):
        assert enc[se - 1] == 0 and lab[sd - 1] == 0 and set(enc[se:] + lab[sd:]) == {1}
        spans_of, cur = {}, None  # labels: <X0> span0 <X1> span1 ... </s>
        for t in lab[: sd - 1]:
            cur = spans_of.setdefault(t, []) if t in sentinels else (cur.append(t) or cur)
        assert list(spans_of) == sentinels[:spans] and all(spans_of.values())
        rebuilt = [u for t in enc[: se - 1] for u in (spans_of[t] if t in sentinels else [t])]
        assert rebuilt == row
    with pytest.raises(ValueError, match="encoder_seq_length=100"):
        t5.span_corruption(rows, sentinels, 2, 0, 1, 7, encoder_seq_length=100, decoder_seq_length=32)


def test_train_py_recipe_unpacks_and_counts_target_tokens():
    """train.py's hooks: a stacked dataset row [se | text_enc | text_dec | labels | loss_mask] -> the batch back."""
    rows = torch.randint(110, V, (4, 33), generator=torch.Generator().manual_seed(0))
    out = t5.span_corruption(rows, list(range(5, 105)), 2, 0, 1, 3, encoder_seq_length=32, decoder_seq_length=16)
    flat = torch.cat([torch.full((4, 1), 32)] + [out[k] for k in ("text_enc", "text_dec", "labels", "loss_mask")], 1)
    got = t5.unpack(flat)
    assert all(torch.equal(got[k], out[k]) for k in out)
    model = t5.Model(t5.Config(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=V, hidden_dropout=0.0,
                               attention_dropout=0.0))
    loss_func, count = t5.batch_recipe(flat)
    assert count == 4 * t5.corrupted_lengths(33)[3] and torch.isclose(loss_func(model, flat), t5.t5_loss(model, out))


@pytest.mark.parametrize("groups,scale", [(4, 1.0), (2, 0.125)], ids=["mha-unscaled", "gqa-scaled"])
def test_biased_attention_is_sdpa(groups, scale):
    """transformer.Attention.biased_attention (an additive float bias, written out) = SDPA with the same float mask:
    output and the gradients of q, k, v and the bias, float64 to 1e-12, grouped-query heads and a scale included."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, groups, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(1, 4, 6, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    att = types.SimpleNamespace(g=groups, n=4, scale=scale)
    ours = transformer.Attention.biased_attention(att, q, k, v, bias, 0.0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=groups != 4)
    dy = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    g_ours = torch.autograd.grad(ours, (q, k, v, bias), dy)
    g_ref = torch.autograd.grad(ref, (q, k, v, bias), dy)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
