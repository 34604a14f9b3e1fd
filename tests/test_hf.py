"""gpt.from_hf against Hugging Face transformers (random weights, offline): logits agree to 1e-4 in float32.

Why 1e-4: both compute the same float32 ops in different orders (fused QKV, SDPA vs eager attention); measured
differences are ~1e-7 on logits of magnitude ~1, so 1e-4 leaves a wide margin and still catches any layout error
(a swapped head or a transposed weight moves logits by ~1e-1).
"""
import pytest
import torch
import transformers

import gpt
import parallel as P
from equivalence import make_batch


def hf_gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0, bos_token_id=0, eos_token_id=0)).eval()


def hf_llama(groups=2, tied=False):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=groups, max_position_embeddings=64, tie_word_embeddings=tied, rope_theta=500.0)).eval()


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama, lambda: hf_llama(groups=1, tied=True),
                                  lambda: hf_llama(groups=8)], ids=["gpt2", "llama-gqa", "llama-mqa-tied", "llama-mha"])
def test_from_hf_logits_match(make):
    hf = make()
    ours = gpt.from_hf(hf).eval()
    ids = make_batch(1000, 3, 20, seed=1)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < 1e-4, err
    # and the loss path agrees with HF's mean next-token loss
    with torch.no_grad():
        per_token = ours(ids[:, :-1], labels=ids[:, 1:])
    hf_loss = torch.nn.functional.cross_entropy(ref[:, :-1].reshape(-1, 1000), ids[:, 1:].reshape(-1))
    # our loss runs over the padded vocabulary (Megatron does too); padded rows are zero -> logit 0 each
    assert abs(per_token.mean().item() - hf_loss.item()) < 0.05


def test_from_hf_detects_a_wrong_layout():
    """The comparison can fail: swapping two query heads in the fused QKV weight moves the logits."""
    hf = hf_llama()
    ours = gpt.from_hf(hf).eval()
    w = ours.decoder.layers[0].self_attention.linear_qkv.weight
    with torch.no_grad():
        d = 8
        w[:d], w[d:2 * d] = w[d:2 * d].clone(), w[:d].clone()
        ids = make_batch(1000, 2, 12, seed=2)
        assert (ours(ids) - hf(ids).logits).abs().max() > 1e-3


def test_generate_greedy_is_deterministic_and_extends():
    model = gpt.from_hf(hf_gpt2())
    ids = make_batch(1000, 2, 4, seed=3)  # [2, 5]
    out1 = gpt.generate(model, ids, 6, temperature=0)
    out2 = gpt.generate(model, ids, 6, temperature=0)
    assert out1.shape == (2, 11) and torch.equal(out1, out2) and torch.equal(out1[:, :5], ids)
    assert P.pad_vocab(1000) == 1024
