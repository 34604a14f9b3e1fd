"""KV-cache decoding (transformer.InferenceContext, gpt.generate, mamba.generate) against the recompute oracle.

  - greedy generation with the cache is the recompute path's (gpt.generate(use_cache=False)) token for token, and
    the logits of every step agree: GPT with learned positions, Llama-style GQA with RoPE, multi-latent attention
    (deepseek.py), past the position window
    (where the cached path falls back to the oracle's sliding window), and at TP 2 (each rank caches its own heads);
  - gpt.generate uses the cache by default: after the prompt every forward sees one token;
  - the Mamba hybrid: the InferenceContext holds the Mamba layers' states beside the attention layers' keys;
    mamba.generate (one position per forward) equals a full recompute of the whole hybrid each step, and the step's
    logits the parallel forward's; at TP 2 too; so does gpt.generate's cached path (the prompt in one forward);
  - negative controls: a cache whose new positions ignore the offset (RoPE at position 0) fails the comparison;
    so does one that restarts the Mamba layers from zero states at each call.
Tolerance: logits 1e-10 relative in float64: the cached path computes each position's attention over the same keys
as the recompute, only the matmul shapes (one query row vs all) differ; measured ≤ 5e-15. Random weights use init
std 0.5 so that greedy decoding does not settle on one repeated token (at 0.02 it does) and the token comparison
means something.
"""
from __future__ import annotations

import pytest
import torch

import gpt
import mamba
import parallel as P
import transformer
from equivalence import rel_err

f64 = torch.float64
GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=101,
           make_vocab_size_divisible_by=4, max_position_embeddings=24, hidden_dropout=0.0, attention_dropout=0.0,
           init_method_std=0.5, params_dtype=f64)
LLAMA = dict(GPT, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", activation="silu",
             gated_linear_unit=True, add_bias_linear=False, share_embeddings_and_output_weights=False)


def prompt(b=2, s=5, seed=0):
    return torch.randint(0, GPT["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, n, use_cache):
    """(ids after n greedy tokens, the logits [n, b, V] each step was chosen from)."""
    window, logits = model.config.max_position_embeddings, []
    inner = gpt.cached_next_logits(model, window) if use_cache else (lambda ids: model(ids[:, -window:])[:, -1, :])

    def recorded(ids):
        logits.append(inner(ids))
        return logits[-1]
    return gpt.generate(model, ids, n, temperature=0, next_logits=recorded), torch.stack(logits)


def assert_same_generation(model, ids, n):
    got, got_logits = greedy(model, ids, n, use_cache=True)
    ref, ref_logits = greedy(model, ids, n, use_cache=False)
    assert len(set(ref[:, ids.shape[1]:].flatten().tolist())) >= 8, "a degenerate generation compares nothing"
    err = rel_err(got_logits, ref_logits)
    assert torch.equal(got, ref) and err <= 1e-10, f"cached and recomputed generations differ (logits {err:.2e})"


MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6)  # deepseek.MLASelfAttention caches each head's whole k and v


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MLA], ids=["gpt-learned", "llama-gqa-rope", "mla"])
def test_cached_greedy_equals_recompute(cfg):
    model = gpt.Model(gpt.Config(**cfg))
    assert_same_generation(model, prompt(), 19)  # 5 + 19 = 24 = the window: all of it from the cache


def test_past_the_window_equals_recompute():
    """Past max_position_embeddings the recompute slides its window (every position shifts), and so does the cache."""
    assert_same_generation(gpt.Model(gpt.Config(**LLAMA)), prompt(), 30)


def test_generate_uses_the_cache_by_default():
    model = gpt.Model(gpt.Config(**GPT))
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].shape[1]), with_kwargs=True)
    out = gpt.generate(model, prompt(), 10, temperature=0)
    assert seen == [5] + [1] * 9, seen  # the prompt once, then one token per step
    assert torch.equal(out, greedy(model, prompt(), 10, use_cache=False)[0])


def test_a_cache_that_forgets_the_position_offset_is_caught(monkeypatch):
    """Negative control: RoPE angles of positions 0.. for every call (the offset dropped)."""
    real = gpt.Model.rope_at
    monkeypatch.setattr(gpt.Model, "rope_at", lambda self, pos: real(self, pos - pos.min()))
    with pytest.raises(AssertionError, match="cached and recomputed generations differ"):
        assert_same_generation(gpt.Model(gpt.Config(**LLAMA)), prompt(), 19)


# --------------------------------------------------------------------------------------- TP 2
def tp_generate_case(rank, n, cfg):
    grid = P.Grid(tp=n)
    model = gpt.Model(gpt.Config(**cfg), grid)
    lengths = [model.decoder.layers[0].self_attention.g]  # this rank's key/value heads (and so its cache's)
    got, got_logits = greedy(model, prompt(), 19, use_cache=True)
    ref, ref_logits = greedy(model, prompt(), 19, use_cache=False)
    return dict(got=got, ref=ref, err=rel_err(got_logits, ref_logits), kv_heads=lengths[0])


def test_cached_greedy_at_tp2_equals_single_process(pool):
    results = pool.run(tp_generate_case, 2, cfg=LLAMA)
    single, _ = greedy(gpt.Model(gpt.Config(**LLAMA)), prompt(), 19, use_cache=False)
    for r in results:
        assert r["kv_heads"] == 1 and r["err"] <= 1e-10  # 2 query groups over 2 ranks: one cached head per rank
        assert torch.equal(r["got"], r["ref"]) and torch.equal(r["got"], single)


# --------------------------------------------------------------------------------------- the Mamba hybrid
HYBRID = dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, vocab_size=101,
              make_vocab_size_divisible_by=4, max_position_embeddings=24, mamba_state_dim=8, mamba_head_dim=8,
              mamba_num_groups=2, mamba_chunk_size=4, init_method_std=0.5, params_dtype=f64)


@pytest.mark.parametrize("pos", ["rope", "none"])
def test_mamba_hybrid_generation_equals_recompute(pos):
    model = mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="M*-M*", position_embedding_type=pos)).eval()
    ids = prompt()
    got = mamba.generate(model, ids, 19, temperature=0)  # Mamba states + the attention layers' KV cache
    ref = gpt.generate(model, ids, 19, temperature=0, use_cache=False)  # the whole hybrid's forward each step
    assert torch.equal(got, ref) and len(set(ref[:, 5:].flatten().tolist())) >= 8
    with torch.no_grad():
        cache, full = {}, model(got)
        steps = torch.stack([model.step(got[:, t], cache) for t in range(got.shape[1])], dim=1)
    assert rel_err(steps, full) <= 1e-10
    kv = cache["kv"].key_value_memory_dict
    assert len(kv) == 2 and all(k.shape[2] >= got.shape[1] for k, _ in kv.values())  # both attention layers cached


def tp_mamba_case(rank, n):
    model = mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="M*-M*", position_embedding_type="rope"),
                        P.Grid(tp=n)).eval()
    return mamba.generate(model, prompt(), 19, temperature=0)


def test_mamba_hybrid_generation_at_tp2_equals_single_process(pool):
    single = mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="M*-M*", position_embedding_type="rope")).eval()
    ref = gpt.generate(single, prompt(), 19, temperature=0, use_cache=False)
    for got in pool.run(tp_mamba_case, 2):
        assert torch.equal(got, ref)


def test_hybrid_prefill_and_decode_through_the_cache_equal_recompute():
    """gpt.generate's cached path on the hybrid: the whole prompt in one forward (the chunked scan from zero states),
    then one token per forward, the Mamba states held in the InferenceContext beside the attention keys."""
    model = mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="M*-M*")).eval()
    assert_same_generation(model, prompt(), 19)


def test_a_cache_that_drops_the_recurrent_state_is_caught(monkeypatch):
    """Negative control: every call restarts the Mamba layers from zero states."""
    monkeypatch.setattr(transformer.InferenceContext, "recurrent", lambda self, layer, fn, *xs: fn(*xs, state=None)[0])
    with pytest.raises(AssertionError, match="cached and recomputed generations differ"):
        assert_same_generation(mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="M*-M*")).eval(), prompt(), 19)
