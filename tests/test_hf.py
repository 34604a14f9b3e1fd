"""gpt.from_hf against Hugging Face transformers (random weights, offline).

GPT-2 and Llama in float32: logits agree to 1e-4. Both compute the same float32 ops in different orders (fused QKV,
SDPA vs eager attention); measured differences are ~1e-7 on logits of magnitude ~1, so 1e-4 leaves a wide margin and
still catches any layout error (a swapped head or a transposed weight moves logits by ~1e-1).

Llama's family (Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) in float64, every parameter random (norm
weights, biases, gates too, so a dropped one shows), relative error max |ours - HF| / max |HF|:
  1e-10  against HF with its two deliberate float32 roundings lifted (float64_throughout: each RMSNorm normalises
         its input cast to float32, each MoE router takes its softmax in float32; both replaced by the same formula
         in float64). RoPE's cos/sin are float32 on both sides, computed by the same ops (bitwise equal), so what
         remains is reduction order (fused QKV, SDPA, the experts' sums): measured <= 5.3e-15. A negative control
         per feature (a dropped QKV bias, qk-norm or shared-expert gate, the other routing) must fail it.
  1e-5   against HF as it is: its float32 roundings alone move the logits (measured <= 7.5e-7, MoE the most).
"""
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
import transformers

import gpt
import parallel as P
from equivalence import make_batch, rel_err
from interop import convert


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


@pytest.mark.parametrize("make", [hf_gpt2, lambda: hf_llama(groups=1, tied=True)], ids=["gpt2", "llama-tied"])
def test_from_hf_keeps_tied_embeddings_tied(make):
    """A tied model imports tied: the same change to the embedding moves HF's lm_head and our output layer alike. The
    logits test cannot see an untied import (the live state dict carries the tied copy as lm_head.weight); this one
    fails when the converter writes a separate output_layer.weight or shares nothing (share_embeddings_and_output_weights
    False, then the embedding change reaches the input only)."""
    hf = make()
    ours = gpt.from_hf(hf).eval()
    assert ours.config.share_embeddings_and_output_weights and "output_layer.weight" not in ours.state_dict()
    with torch.no_grad():
        emb = hf.get_input_embeddings().weight
        delta = 0.5 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(4))
        emb += delta
        ours.embedding.word_embeddings.weight[:emb.shape[0]] += delta
        ids = make_batch(1000, 2, 12, seed=2)
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4


def test_generate_greedy_is_deterministic_and_extends():
    model = gpt.from_hf(hf_gpt2())
    ids = make_batch(1000, 2, 4, seed=3)  # [2, 5]
    out1 = gpt.generate(model, ids, 6, temperature=0)
    out2 = gpt.generate(model, ids, 6, temperature=0)
    assert out1.shape == (2, 11) and torch.equal(out1, out2) and torch.equal(out1[:, :5], ids)
    assert P.pad_vocab(1000) == 1024


# ---------------------------------------------------------------------------------------------- Llama's family, float64
BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {  # name: (HF class, config); every feature of the converters once
    "mistral": ("Mistral", dict(BASE, sliding_window=None)),
    "mistral-window-64": ("Mistral", dict(BASE, sliding_window=64)),  # = max_position_embeddings: hides nothing
    "mixtral": ("Mixtral", dict(BASE, num_local_experts=4, num_experts_per_tok=2)),  # renormalised top-k
    "qwen2": ("Qwen2", BASE),  # q/k/v biases
    "qwen3": ("Qwen3", dict(BASE, head_dim=16)),  # qk norms; n·d = 128 != h = 64
    "qwen2-moe": ("Qwen2Moe", dict(BASE, **MOE, shared_expert_intermediate_size=48, mlp_only_layers=[0])),  # gated
    "qwen3-moe": ("Qwen3Moe", dict(BASE, **MOE, decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True)),
}


def hf_family(name, seed=0, **changes):
    """A tiny random `transformers` model of FAMILIES[name] in float64, every parameter drawn (norms and biases off
    their 1 and 0, routers spread so that routings vary), eval mode."""
    cls, cfg = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cls + "Config")(**{**cfg, **changes}, experts_implementation="eager")  # (its
    hf = getattr(transformers, cls + "ForCausalLM")(config)  # grouped-GEMM experts take no float64; the loop does)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in hf.named_parameters():
            p.add_((3.0 if k.endswith("gate.weight") else 0.1) * torch.randn(p.shape, generator=g))
    return hf.double().eval()


def router64(m, x):
    """HF's TopKRouter.forward (Mixtral, Qwen2-MoE, Qwen3-MoE) with its softmax in the input's dtype, not float32."""
    logits = F.linear(x.reshape(-1, m.hidden_dim), m.weight)
    top, idx = torch.softmax(logits, -1).topk(m.top_k, -1)
    if getattr(m, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(-1, keepdim=True)
    return logits, top, idx


def float64_throughout(hf):
    """`hf` with its two float32 roundings lifted: RMSNorm (HF: weight · (x·rsqrt(mean(x²) + eps)) computed on x cast
    to float32) as the same formula in the input's dtype, and the routers' softmax (router64)."""
    for m in hf.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = functools.partial(lambda m, x: F.rms_norm(x, m.weight.shape, m.weight, m.variance_epsilon), m)
        elif type(m).__name__.endswith("TopKRouter"):
            m.forward = functools.partial(router64, m)
    return hf


def assert_logits_match(hf, ours, tol):
    ids = make_batch(1000, 3, 20, seed=1)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours.eval()(ids)
    assert got.shape == ref.shape == (3, 21, 1000)
    err = rel_err(got, ref)
    assert err < tol, f"relative error {err:.3e} >= {tol}"


def converted(hf, **changes):
    """Our model of `hf`, with Config fields changed (and the weights they no longer have dropped): a broken converter."""
    c, full = gpt.HF_CONVERTERS[hf.config.model_type](hf, gpt.Config)
    c = dataclasses.replace(c, **changes)
    model = gpt.Model(c)
    names = {k for k, _ in model.named_parameters()}
    return convert.load(model, {k: v for k, v in full.items() if k in names})


@pytest.mark.parametrize("name", FAMILIES)
def test_llama_family_logits_match_float64(name):
    hf = hf_family(name)
    ours = gpt.from_hf(hf)
    assert_logits_match(hf, ours, 1e-5)  # HF as it is: its float32 RMSNorm and router softmax
    assert_logits_match(float64_throughout(hf), ours, 1e-10)


def test_llama_family_config_mapping():
    """What the converters read: the MoE layers, the routing, the shared-expert gate, qk norm, qkv bias, head dim."""
    c = gpt.HF_CONVERTERS["qwen2_moe"](hf_family("qwen2-moe"), gpt.Config)[0]
    assert (c.moe_layer_freq, c.moe_router_pre_softmax, c.moe_shared_expert_intermediate_size, c.moe_shared_expert_gate,
            c.add_qkv_bias, c.ffn_hidden_size, c.moe_ffn_hidden_size) == ([0, 1], True, 48, True, True, 96, 32)
    c = gpt.HF_CONVERTERS["qwen3_moe"](hf_family("qwen3-moe"), gpt.Config)[0]
    assert (c.moe_layer_freq, c.moe_router_pre_softmax, c.qk_layernorm, c.moe_shared_expert_intermediate_size,
            c.add_qkv_bias) == ([0, 1], False, True, None, False)
    c = gpt.HF_CONVERTERS["mixtral"](hf_family("mixtral"), gpt.Config)[0]
    assert (c.moe_layer_freq, c.moe_router_pre_softmax, c.num_experts, c.moe_router_topk) == (1, False, 4, 2)
    c = gpt.HF_CONVERTERS["qwen3"](hf_family("qwen3"), gpt.Config)[0]
    assert (c.kv_channels, c.qk_layernorm, c.add_qkv_bias, c.num_experts) == (16, True, False, None)


@pytest.mark.parametrize("name,changes", [
    ("qwen2", dict(add_qkv_bias=False)),  # the q/k/v biases
    ("qwen3", dict(qk_layernorm=False)),  # the per-head q/k RMSNorms
    ("qwen2-moe", dict(moe_shared_expert_gate=False)),  # sigmoid(shared_expert_gate(x))
    ("qwen2-moe", dict(moe_router_pre_softmax=False)),  # norm_topk_prob=False read as renormalised
    ("qwen3-moe", dict(moe_router_pre_softmax=True)),  # norm_topk_prob=True read as not renormalised
    ("mixtral", dict(moe_router_pre_softmax=True)),  # Mixtral's renormalisation dropped
], ids=["qkv-bias", "qk-norm", "shared-expert-gate", "qwen2-moe-routing", "qwen3-moe-routing", "mixtral-routing"])
def test_llama_family_negative_controls(name, changes):
    """Each feature matters: without it the float64 comparison test_llama_family_logits_match_float64 passes fails."""
    hf = float64_throughout(hf_family(name))
    with pytest.raises(AssertionError, match="relative error .* >= 1e-10"):
        assert_logits_match(hf, converted(hf, **changes), 1e-10)


@pytest.mark.parametrize("name,changes,expect", [
    ("mistral", dict(sliding_window=4), "mistral sliding_window=4 < max_position_embeddings=64"),
    ("mixtral", dict(sliding_window=32), "mixtral sliding_window=32 < max_position_embeddings=64"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
     r"qwen2 sliding_window=4 on layers \[1\] < max_position_embeddings=64"),
    ("qwen3-moe", dict(use_sliding_window=True, sliding_window=4), "qwen3_moe sliding_window=4"),
    ("qwen3", dict(attention_bias=True), "qwen3 with attention_bias=True is not supported"),
    ("mistral", dict(hidden_act="gelu"), "mistral with hidden_act='gelu' is not supported"),
    ("mixtral", dict(router_jitter_noise=0.1), "mixtral router_jitter_noise=0.1 is not supported"),
])
def test_llama_family_refuses_what_it_cannot_represent(name, changes, expect):
    with pytest.raises(ValueError, match=expect) as e:
        gpt.from_hf(hf_family(name, **changes))
    assert "\n" not in str(e.value)


def test_from_hf_refuses_an_unknown_model_type():
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt_neox' \(supported: gpt2, llama, mistral, "
                                         r"mixtral, qwen2, qwen3, qwen2_moe, qwen3_moe, deepseek_v3\)"):
        gpt.from_hf(hf)
