"""convert.gpt_to_hf (tools.py export) against Hugging Face transformers: our model written as a Hugging Face directory
(config.json + model.safetensors), loaded back with `transformers.AutoModelForCausalLM.from_pretrained` offline, gives
our logits. GPT-2, Llama (grouped-query, multi-query, tied or not), Qwen3 (--qk-layernorm) and Mixtral shapes; settings
those classes cannot express are refused with one line naming them. A Hugging Face Mixtral or Qwen3 imported
(gpt.from_hf) and exported again comes back identical, tensor for tensor (bitwise: both ways are renames and
concatenations).

Tolerance: float32, 1e-5 relative (max |ours − HF| / max |HF|): the same ops in different orders (fused QKV, SDPA);
measured ~1e-7. A layout error (a swapped head or projection) moves logits by ~1e-1: the negative control below.
Every parameter is drawn at random (norm weights and biases too, not left at 1 and 0), so a misplaced one shows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import config as contract
import gpt
from equivalence import make_batch, rel_err
from interop import convert

SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=1000, max_position_embeddings=64,
             hidden_dropout=0.0, attention_dropout=0.0)
GPT2 = dict(SMALL, activation="gelu_tanh", ffn_hidden_size=128)
LLAMA = dict(SMALL, num_query_groups=2, ffn_hidden_size=96, position_embedding_type="rope", rotary_base=500.0,
             normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
             share_embeddings_and_output_weights=False, layernorm_epsilon=1e-6)
FAMILIES = {"gpt2": GPT2, "llama-gqa": LLAMA, "llama-mqa-tied": dict(LLAMA, num_query_groups=1,
            share_embeddings_and_output_weights=True), "qwen3": dict(LLAMA, qk_layernorm=True),
            "mixtral": dict(LLAMA, num_experts=4, moe_router_topk=2)}


def ours(cfg, seed=0):
    """Our model with every parameter random (biases and norm weights included), in float32, eval mode."""
    model = gpt.Model(gpt.Config(**cfg)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def export(model, path, tamper=None):
    hc, sd = convert.gpt_to_hf(model.config, model.state_dict())
    if tamper:
        tamper(sd)
    convert.save_hf(path, hc, sd)
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exported_model_gives_our_logits(family, tmp_path):
    model = ours(FAMILIES[family])
    hf = export(model, tmp_path)
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}.get(family, "LlamaForCausalLM")
    ids = make_batch(1000, 3, 20, seed=1)
    with torch.no_grad():
        got, ref = model(ids), hf(ids).logits
    assert got.shape == ref.shape == (3, 21, 1000)
    assert rel_err(got, ref) < 1e-5, rel_err(got, ref)


def test_negative_control_swapped_projection_is_caught(tmp_path):
    """The comparison can fail: k_proj and v_proj exchanged in the export (same shapes) move the logits."""
    model = ours(LLAMA)

    def swap(sd):
        k = "model.layers.0.self_attn."
        sd[k + "k_proj.weight"], sd[k + "v_proj.weight"] = sd[k + "v_proj.weight"], sd[k + "k_proj.weight"]
    hf = export(model, tmp_path, swap)
    ids = make_batch(1000, 2, 12, seed=2)
    with torch.no_grad():
        assert rel_err(model(ids), hf(ids).logits) > 1e-2


@dataclasses.dataclass
class FutureConfig(gpt.Config):  # a setting added later (by another feature) that the exporter does not know
    rope_scaling_factor: float = 1.0


@pytest.mark.parametrize("config,expect", [
    (gpt.Config(**dict(GPT2, share_embeddings_and_output_weights=False)), "share_embeddings_and_output_weights=False"),
    (gpt.Config(**dict(LLAMA, add_qkv_bias=True)), "add_qkv_bias=True"),
    (gpt.Config(**dict(LLAMA, num_experts=4, moe_layer_freq=2)), "moe_layer_freq=2: Mixtral has MoE in every layer"),
    (gpt.Config(**dict(GPT2, normalization="RMSNorm")), "normalization='RMSNorm'"),
    (gpt.Config(**dict(GPT2, qk_layernorm=True)), "qk_layernorm=True cannot be represented in Hugging Face's GPT-2"),
    (gpt.Config(**dict(LLAMA, qk_layernorm=True, num_experts=4)), "num_experts=4 cannot be represented"),
    (gpt.Config(**dict(LLAMA, qk_layernorm=True, normalization="LayerNorm")), "normalization='LayerNorm'"),
    (gpt.Config(**dict(LLAMA, num_tokentypes=2)), "num_tokentypes=2"),
    (FutureConfig(**dict(LLAMA), rope_scaling_factor=4.0), "rope_scaling_factor=4.0 has no Hugging Face equivalent"),
])
def test_settings_hf_cannot_represent_are_refused(config, expect):
    with pytest.raises(convert.ExportError, match=expect) as e:
        convert.gpt_to_hf(config, {})
    assert "\n" not in str(e.value)
    assert contract.model_file("bert").to_hf is None  # tools.py export refuses a model without one (test_contract)
    convert.gpt_to_hf(FutureConfig(**dict(LLAMA)), gpt.Model(FutureConfig(**dict(LLAMA))).state_dict())  # at default: ok


def test_mixtral_import_export_round_trip(tmp_path):
    """A Hugging Face Mixtral -> gpt.from_hf -> gpt_to_hf -> from_pretrained: every tensor comes back identical (the
    export's hub layout, experts.{j}.w1/w2/w3, loaded by transformers into its fused gate_up_proj), the config's shape
    fields too; a swapped w1/w3 (gate and up) of one expert must not."""
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        rope_theta=500.0)).eval()
    with torch.no_grad():  # norms off 1, routers spread
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    want = hf.state_dict()
    model = gpt.from_hf(hf)
    back = export(model, tmp_path / "same")
    assert set(back.state_dict()) == set(want)
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "rms_norm_eps", "tie_word_embeddings")
    assert {f: getattr(back.config, f) for f in fields} == {f: getattr(hf.config, f) for f in fields}
    assert back.config.rope_parameters["rope_theta"] == 500.0

    def swap(sd):
        e = "model.layers.1.block_sparse_moe.experts.2."
        sd[e + "w1.weight"], sd[e + "w3.weight"] = sd[e + "w3.weight"], sd[e + "w1.weight"]
    tampered = export(model, tmp_path / "swapped", swap)
    assert not torch.equal(tampered.state_dict()["model.layers.1.mlp.experts.gate_up_proj"],
                           want["model.layers.1.mlp.experts.gate_up_proj"])


def test_qwen3_import_export_round_trip(tmp_path):
    """A Hugging Face Qwen3 (q_norm/k_norm: our qk_layernorm) -> gpt.from_hf -> gpt_to_hf -> from_pretrained: every
    tensor comes back identical and the config's shape fields too; q_norm and k_norm swapped in one layer must not
    (the logits then move: the test above's tolerance would see it)."""
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=500.0,
        tie_word_embeddings=False)).eval()
    with torch.no_grad():  # the norms off 1, so a misplaced one shows
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    want = hf.state_dict()
    model = gpt.from_hf(hf)
    assert model.config.qk_layernorm
    back = export(model, tmp_path / "same")
    assert type(back).__name__ == "Qwen3ForCausalLM" and set(back.state_dict()) == set(want)
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings")
    assert {f: getattr(back.config, f) for f in fields} == {f: getattr(hf.config, f) for f in fields}

    def swap(sd):
        a = "model.layers.1.self_attn."
        sd[a + "q_norm.weight"], sd[a + "k_norm.weight"] = sd[a + "k_norm.weight"], sd[a + "q_norm.weight"]
    tampered = export(model, tmp_path / "swapped", swap)
    ids = make_batch(1000, 2, 12, seed=3)
    with torch.no_grad():
        assert rel_err(tampered(ids).logits, hf(ids).logits) > 1e-3
