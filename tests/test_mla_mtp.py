"""DeepSeek-V3's layers (deepseek.py): multi-latent attention (MLA) and multi-token prediction (MTP) in gpt.Model.

  1. Hugging Face DeepseekV3ForCausalLM (random weights, offline) loaded with gpt.from_hf gives its logits: MLA with
     and without q-lora, interleaved and half-split RoPE, dense and MoE layers with a shared expert; YaRN past the
     original context (its two mscales: cos/sin and the softmax scale), with the softmax mscale removed as control.
  2. MTP against a plain oracle: the loss attached by MTPLossAutoScaler gives exactly the gradient of
     main/N + factor/D · Σ_k mtp_k/N computed by hand (rolls written as slices); the reported loss is the main loss.
  3. Every layout (tp, sp, pp, virtual stages, dp, micro-batches) equals the single process in float64: loss,
     every gradient, parameters after 2 AdamW steps (tests/test_pipeline.py's driver, the real schedules).
  4. Negative controls: MLA's shared position key without f (copy_to_tp), MTP without the global token count.
  5. train.py under torchrun TP=2 with --multi-latent-attention --mtp-num-layers 1 logs the single process's losses.
  6. Megatron-core 0.15.3's GPTModel with MLASelfAttention and 2 MTP depths (local spec, CPU shims) at TP 1 and 2:
     logits, per-token loss, every gradient (MTP's included) — and its TP=2 bug without the shim (see megatron_case);
     and with YaRN (MLATransformerConfig rope_type "yarn") past the original context.
Tolerances (relative to the reference's max): HF float32 logits 1e-4 (op order; measured 0 for dense layers,
2.9e-7 with MoE); HF float64 1e-5 (HF computes RoPE's cos/sin in float32, as we and Megatron do, but by other
float32 ops: measured 1.9e-7); layouts and Megatron float64 1e-10 (reduction order only; measured ~5e-14 and below); the
MTP oracle 1e-12 (one process, the same ops grouped otherwise); torchrun float32 1e-5; Megatron with YaRN 1e-8 (its
float32 interpolated angles round differently by one ulp: measured 1.7e-10).
"""
from __future__ import annotations

import dataclasses
import types

import pytest
import test_megatron_parity as MP
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_pipeline import merge, pipeline_case, train_pipelined

import arguments
import deepseek
import gpt
import parallel as P
from equivalence import assert_same, make_batch, named_full, rel_err
from harness import assert_close, metrics, tiny, torchrun
from interop import convert


# --------------------------------------------------------------------------------------- 1. Hugging Face
def hf_deepseek(q_lora=16, interleave=True, dense=2, layers=2, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
               routed_scaling_factor=1.0, kv_lora_rank=24, q_lora_rank=q_lora, qk_rope_head_dim=8, v_head_dim=12,
               qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=dense,
               max_position_embeddings=64, rope_interleave=interleave, tie_word_embeddings=False)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**cfg, **kw})).to(dtype).eval()
    with torch.no_grad():  # HF initialises some weights to zero or one: draw them all, so every map is exercised
        for p in hf.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.1)
    return hf


def logits_err(hf, ours, seed=1, s=12):
    ids = make_batch(1000, 2, s, seed=seed)
    with torch.no_grad():
        ref = hf(ids).logits
        return (ours(ids) - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("kw", [dict(), dict(q_lora=None), dict(interleave=False), dict(dense=1, layers=3)],
                         ids=["q-lora", "full-q", "rope-halves", "moe-shared-expert"])
def test_from_hf_deepseek_logits_match(kw):
    hf = hf_deepseek(**kw)
    ours = gpt.from_hf(hf).eval()
    assert ours.config.multi_latent_attention and isinstance(ours.decoder.layers[0].self_attention,
                                                             deepseek.MLASelfAttention)
    assert (ours.config.num_experts is not None) == (kw.get("dense") == 1)
    assert logits_err(hf, ours) < 1e-4


def test_from_hf_deepseek_float64():
    hf = hf_deepseek(dtype=torch.float64)
    assert logits_err(hf, gpt.from_hf(hf).eval()) < 1e-5


def test_from_hf_deepseek_rope_layout_can_fail():
    """Negative control: HF's half-split RoPE loaded as if interleaved (no row re-ordering) moves the logits."""
    hf = hf_deepseek(interleave=False)
    hf.config.rope_interleave = True
    config, full = deepseek.hf_to_ours(hf, gpt.Config)
    hf.config.rope_interleave = False
    assert logits_err(hf, convert.load(gpt.Model(config), full).eval()) > 1e-2


def yarn(mscale=1.0, mscale_all_dim=1.0, **kw):  # DeepSeek-V3's rope_scaling, but a 16-token original context
    return dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=40.0, mscale=mscale, beta_fast=32,
                                     mscale_all_dim=mscale_all_dim, beta_slow=1, original_max_position_embeddings=16,
                                     **kw), max_position_embeddings=640)  # 40 x 16, as HF's yarn expects


@pytest.mark.parametrize("kw", [yarn(), dict(yarn(mscale_all_dim=0.5), q_lora=None)], ids=["q-lora-v3", "full-q"])
def test_from_hf_deepseek_yarn_logits_match_past_the_original_context(kw):
    """YaRN MLA at 48 tokens, 3x the original 16: DeepSeek-V3's mscale = mscale_all_dim (cos/sin unscaled, softmax
    × m(40, 1)²), and mscale_all_dim = 0.5 (cos/sin × m(40, 1)/m(40, 0.5) as well). Negative control: the layers'
    softmax scale without its mscale² (1/sqrt(dn + dr), what HF's MLA would use without yarn_apply_mscale) fails."""
    hf = hf_deepseek(**kw)
    ours = gpt.from_hf(hf).eval()
    c = ours.config
    assert (c.position_embedding_type, c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings,
            c.yarn_mscale_all_dim) == ("yarn", 40.0, 16, kw["rope_parameters"]["mscale_all_dim"])
    assert logits_err(hf, ours, s=48) < 1e-4
    for layer in ours.decoder.layers:
        layer.self_attention.scale = 1.0 / (c.qk_head_dim + c.qk_pos_emb_head_dim) ** 0.5
    assert logits_err(hf, ours, s=48) > 1e-2


@pytest.mark.skipif(not hasattr(gpt.Config, "moe_router_num_groups"),
                    reason="gpt.Config has no moe_router_num_groups yet (DeepSeek routing: group top-k, expert bias, "
                           "routed scaling factor in parallel.py's Router)")
def test_from_hf_deepseek_group_routing_logits_match():
    # k / topk_group = 2: a group's score is the sum of its top-2 experts in HF and in Megatron's rule alike
    hf = hf_deepseek(dense=1, layers=3, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4,
                     routed_scaling_factor=2.5)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    assert logits_err(hf, gpt.from_hf(hf).eval()) < 1e-4


@pytest.mark.parametrize("kw,named", [(dict(rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e4)),
                                       "rope_type"),
                                      (yarn(mscale=None), "mscale_all_dim"),
                                      (dict(attention_bias=True), "attention_bias"),
                                      (dict(dense=1, n_group=2, topk_group=2), "topk_group")])  # k / topk_group = 1
def test_from_hf_deepseek_refuses_what_it_cannot_represent(kw, named):
    with pytest.raises(ValueError, match=named):
        gpt.from_hf(hf_deepseek(**kw))


# --------------------------------------------------------------------------------------- 2. MTP against an oracle
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=211,
            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
            normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
            kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, mtp_loss_scaling_factor=0.3)


def oracle_loss(model, ids, labels, num_tokens):
    """main/N + factor/D · Σ_k (Σ of depth k's CE over its valid positions)/N, each depth's inputs written as slices:
    depth k at position i sees token i+k and predicts label i+k, for i < s−k."""
    c, (b, s) = model.config, ids.shape
    rope = model.rope(s, ids.device)
    h = model.decoder(model.embedding(ids), rope=rope)
    total = model.postprocess(h, labels).sum()
    for k, layer in enumerate(model.mtp.layers, start=1):
        pad = torch.zeros(b, k, dtype=ids.dtype)
        ids_k, labels_k = torch.cat([ids[:, k:], pad], 1), torch.cat([labels[:, k:], pad], 1)
        pos_k = torch.cat([torch.arange(k, s), torch.zeros(k, dtype=torch.long)]).expand(b, s)
        h = layer(h, model.embedding(ids_k, pos_k), rope=rope)
        ce = model.postprocess(h, labels_k)[:, : s - k]
        total = total + c.mtp_loss_scaling_factor / c.mtp_num_layers * ce.sum()
    return total / num_tokens


@pytest.mark.parametrize("mla", [False, True], ids=["attention", "mla"])
def test_mtp_gradient_equals_oracle_and_reported_loss_is_the_main_loss(mla):
    c = gpt.Config(**TINY, multi_latent_attention=mla, q_lora_rank=10, mtp_num_layers=2,
                   params_dtype=torch.float64)
    batch = make_batch(c.vocab_size, 3, 10, seed=5)
    ids, labels, N = batch[:, :-1], batch[:, 1:], batch[:, 1:].numel()
    model = gpt.Model(c)
    P.set_num_tokens(model, N)  # what the schedules do
    main = model(ids, labels=labels)
    (main.sum() / N).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    oracle_loss(model, ids, labels, N).backward()
    for k, p in model.named_parameters():
        assert rel_err(got[k], p.grad) < 1e-12, k
    plain = gpt.Model(gpt.Config(**TINY, multi_latent_attention=mla, q_lora_rank=10, params_dtype=torch.float64))
    assert torch.equal(main, plain(ids, labels=labels))  # the same weights (by name): the reported loss is unchanged
    logged = model.mtp.logged_losses()
    assert sorted(logged) == ["mtp_1_loss", "mtp_2_loss"] and logged["mtp_2_loss"][1] == 3 * 8  # s − 2 per row


# --------------------------------------------------------------------------------------- 3. every layout
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 1, 2)]  # (tp, pp, dp): worlds of 2 and 4


@st.composite
def mla_mtp_layouts(draw):
    tp, pp, dp = draw(st.sampled_from(LAYOUTS))
    vp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    M = pp if vp > 1 else draw(st.sampled_from([1, 2]))
    mla, mtp = draw(st.sampled_from([(True, None), (False, 1), (True, 2)]))
    L = 2 * vp if pp > 1 else 2
    moe = draw(st.sampled_from([{}, dict(MOE, moe_layer_freq=[0, 1] * (L // 2))]))  # the MTP layer: MoE, like layer L−1
    cfg = dict(TINY, num_layers=L, multi_latent_attention=mla, mtp_num_layers=mtp, **moe,
               q_lora_rank=draw(st.sampled_from([None, 10])), share_embeddings_and_output_weights=draw(st.booleans()))
    return cfg, tp, pp, vp, M, dp, tp > 1 and draw(st.booleans())


def run_layout(pool, cfg, tp, pp, vp, M, dp, sp, case=pipeline_case):
    b = 2 * M * dp
    got = merge(pool.run(case, tp * pp * dp, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp, b=b, s=8, dtype=torch.float64))
    # the same micro-batches (each DP rank's M): MoE's aux losses are defined per micro-batch (DESIGN.md §2)
    ref = train_pipelined(None, dict(cfg, params_dtype=torch.float64), False, 1, M * dp, b, 8)
    return got, ref


@settings(max_examples=max(1, settings.default.max_examples // 6))  # ci: 1 drawn + the 2 examples; deep: 10
@given(mla_mtp_layouts())
@example((dict(TINY, multi_latent_attention=True, mtp_num_layers=2, q_lora_rank=10, **MOE, moe_layer_freq=[0, 1]),
           2, 1, 1, 2, 1, True))
@example((dict(TINY, num_layers=4, multi_latent_attention=True, mtp_num_layers=1,
               share_embeddings_and_output_weights=False), 1, 2, 2, 2, 2, False))
def test_mla_mtp_layouts_equal_single_process_float64(pool, layout):
    cfg, tp, pp, vp, M, dp, sp = layout
    got, ref = run_layout(pool, cfg, tp, pp, vp, M, dp, sp)
    if cfg["mtp_num_layers"]:
        assert any(k.startswith("mtp.layers.0.eh_proj") for k in got["grads"])
    assert_same(got, ref, rtol=1e-10, what=f"tp={tp} pp={pp} vp={vp} dp={dp} M={M} sp={sp} "
                                           f"mla={cfg['multi_latent_attention']} mtp={cfg['mtp_num_layers']}")


# --------------------------------------------------------------------------------------- 4. negative controls
def no_f_on_position_key_case(rank, n, **kw):
    """MLA's shared position key k_pe enters each rank's heads without f: its gradient stays this rank's part."""
    real = deepseek.P
    deepseek.P = types.SimpleNamespace(**{**vars(P), "copy_to_tp": lambda x, g: x})
    try:
        return pipeline_case(rank, n, **kw)
    finally:
        deepseek.P = real


def mtp_without_global_count_case(rank, n, **kw):
    """MTP ignores the schedules' global token count: each micro-batch's MTP loss is divided by its own b·s."""
    real = deepseek.MTPBlock.set_num_tokens
    deepseek.MTPBlock.set_num_tokens = lambda self, num_tokens: None
    try:
        return pipeline_case(rank, n, **kw)
    finally:
        deepseek.MTPBlock.set_num_tokens = real


@pytest.mark.parametrize("case,mla,mtp,layout", [
    (no_f_on_position_key_case, True, None, (2, 1, 1, 1, 1, False)),
    (mtp_without_global_count_case, False, 1, (1, 2, 1, 2, 1, False))], ids=["mla-no-f", "mtp-local-count"])
def test_negative_controls_are_caught(pool, case, mla, mtp, layout):
    cfg = dict(TINY, multi_latent_attention=mla, mtp_num_layers=mtp)
    got, ref = run_layout(pool, cfg, *layout, case=case)
    with pytest.raises(AssertionError, match=r"worst relative error .* > 1e-10 at (grad|param)"):
        assert_same(got, ref, rtol=1e-10)


def test_config_refuses_bad_mla_mtp_values():
    with pytest.raises(ValueError, match="position_embedding_type='rope' or 'yarn'"):
        gpt.Config(multi_latent_attention=True)
    with pytest.raises(ValueError, match="yarn_correction_range_round_to_int=False"):
        gpt.Config(**dict(TINY, multi_latent_attention=True, position_embedding_type="yarn",
                          yarn_correction_range_round_to_int=False))
    with pytest.raises(ValueError, match="qk_pos_emb_head_dim"):
        gpt.Config(**dict(TINY, qk_pos_emb_head_dim=3), multi_latent_attention=True)
    with pytest.raises(ValueError, match="mtp_num_layers=0"):
        gpt.Config(mtp_num_layers=0)
    for argv, named in [(["--model", "bert", "--mtp-num-layers", "1"],
                         "--model bert with --mtp-num-layers=1: DeepSeek-V3's layers"),
                        (["--mtp-num-layers", "0"], "--mtp-num-layers=0 must be >= 1"),
                        (["--multi-latent-attention", "--position-embedding-type", "none"], "needs position_embedding")]:
        with pytest.raises(arguments.ConfigError, match=named):
            arguments.check_args(arguments.parse_args(argv), 1)


# --------------------------------------------------------------------------------------- 5. train.py
FLAGS = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--mtp-num-layers", "1"]


def test_train_tp2_mla_mtp_logs_the_single_process_losses(corpus, cache, tmp_path):
    import train
    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    train.main(tiny(corpus, cache, one, *FLAGS, "--eval-iters", "0", iters=3))
    torchrun(2, tiny(corpus, cache, tp2, *FLAGS, "--eval-iters", "0", "--tensor-model-parallel-size", "2", iters=3))
    (ref, _), (got, _) = metrics(one), metrics(tp2)
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for i in ref:
        for key in ("loss", "mtp_1_loss", "grad_norm"):
            assert_close(got[i][key], ref[i][key], 1e-5, f"{key} at iteration {i}")


# --------------------------------------------------------------------------------------- 6. Megatron-core parity
def megatron_mla_mtp(c: gpt.Config, tp: int):
    """Megatron-core's GPTModel with MLASelfAttention (local spec, q/kv layernorms on) and an MTP block."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    base = MP.megatron_transformer_config(c, tp)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    ours = dict(multi_latent_attention=True, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                qk_head_dim=c.qk_head_dim, qk_pos_emb_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                rope_type="rope", rotary_base=c.rotary_base, qk_layernorm=True, mtp_num_layers=c.mtp_num_layers,
                mtp_loss_scaling_factor=c.mtp_loss_scaling_factor, calculate_per_token_loss=True)
    if c.position_embedding_type == "yarn":  # MLATransformerConfig's own YaRN fields
        ours.update(rope_type="yarn", rotary_scaling_factor=c.yarn_rotary_scaling_factor, beta_fast=c.yarn_beta_fast,
                    original_max_position_embeddings=c.yarn_original_max_position_embeddings,
                    beta_slow=c.yarn_beta_slow, mscale=c.yarn_mscale, mscale_all_dim=c.yarn_mscale_all_dim)
    mc = MLATransformerConfig(**{k: v for k, v in fields.items() if k not in ours and k != "kv_channels"}, **ours)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):  # the shim: takes MLA's k/v head dims, output n/tp·dv wide
        def __init__(self, *args, k_channels=None, v_channels=None, **kw):
            super().__init__(*args, **kw)
            if v_channels is not None:  # (the base Attention builds one without them first)
                self.hidden_size_per_partition = v_channels * c.num_attention_heads // tp

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization=c.normalization)
    spec.submodules.self_attention.submodules.core_attention = LocalMLACoreAttention
    mtp = get_gpt_mtp_block_spec(mc, spec, use_transformer_engine=False) if c.mtp_num_layers else None
    return GPTModel(mc, spec, vocab_size=c.padded_vocab_size, max_sequence_length=c.max_position_embeddings,
                    share_embeddings_and_output_weights=c.share_embeddings_and_output_weights,
                    position_embedding_type="rope", rotary_base=c.rotary_base, parallel_output=True,
                    mtp_block_spec=mtp)


def megatron_case(rank, n, tp, cfg, b=2, s=12, seed=7, fix_1699=True):
    """test_megatron_parity.gpt_case for MLA + MTP: logits, per-token loss and every gradient of a weighted sum of
    the per-token losses plus the MTP loss. Megatron's MTP term enters as factor/D·Σ·main_loss_backward_scale
    (calculate_per_token_loss), ours as factor/D·Σ/num_tokens: the scale is set to 1/num_tokens.
    fix_1699: Megatron-LM issue #1699 (open in 0.15.3): without sequence parallelism the shared position key
    k_pos_emb [s, b, 1, dr] enters each rank's heads with no TP reduction in backward, so at TP > 1 its gradient
    (and everything upstream: linear_kv_down_proj, the norms, earlier layers, the embedding) is one rank's part.
    The shim puts f (copy_to_tensor_model_parallel_region) in front of its RoPE, as our MLASelfAttention does."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    real_rope = mla.apply_rotary_pos_emb

    def rope_with_f(t, *args, **kw):
        return real_rope(copy_to_tensor_model_parallel_region(t) if t.shape[-2] == 1 else t, *args, **kw)

    c = gpt.Config(**cfg, params_dtype=torch.float64)
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (b, s + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    weights = torch.rand(b, s, generator=gen, dtype=torch.float64)
    saved = MTPLossAutoScaler.main_loss_backward_scale
    with MP.megatron_on_cpu(tp, seed):
        try:
            if fix_1699:
                mla.apply_rotary_pos_emb = rope_with_f
            MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / (b * s), dtype=torch.float64))
            mc = megatron_mla_mtp(c, tp).eval()  # eval: no MTP loss tracker (dropout is 0 anyway)
            full = MP.seeded_full_state(mc, tp, seed)
            MP.load_into_megatron(mc, full, tp, c.gated_linear_unit)
            ours = gpt.from_megatron(full, c, grid)
            P.set_num_tokens(ours, b * s)
            pos, mask = torch.arange(s).expand(b, s), MP.causal_mask(s)
            outs = []  # Megatron's GPTModel with MTP needs labels: its main logits are the output layer's last call
            hook = mc.output_layer.register_forward_hook(lambda m, i, o: outs.append(o[0].transpose(0, 1)))
            loss = mc(inputs, pos, mask, labels=labels)
            hook.remove()
            (loss * weights).sum().backward()
            ref = {"logits": MP.gather_logits(outs[-1], tp)[..., : c.vocab_size], "loss": loss.detach(),
                   "grads": MP.gather_megatron(mc, tp, c.gated_linear_unit)}
        finally:
            MTPLossAutoScaler.main_loss_backward_scale, mla.apply_rotary_pos_emb = saved, real_rope
        got = {"logits": ours(inputs).detach()}
        loss = ours(inputs, labels=labels)
        (loss * weights).sum().backward()
        got |= {"loss": loss.detach(), "grads": named_full(ours, grid, grads=True)}
    return (got, ref) if rank == 0 else None


MEGATRON_MLA = dict(TINY, make_vocab_size_divisible_by=8, multi_latent_attention=True, mtp_num_layers=2)


# YaRN at 12 tokens, 3x a 4-token original context; mscale != mscale_all_dim, so cos/sin and the softmax both scale
MEGATRON_YARN = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=40.0, yarn_beta_fast=8.0,
                     yarn_original_max_position_embeddings=4, yarn_mscale=1.0, yarn_mscale_all_dim=0.5)


@pytest.mark.parametrize("tp,q_lora,extra", [(1, None, {}), (2, 10, {}), (2, 10, MEGATRON_YARN)],
                         ids=["tp1", "tp2-q-lora", "tp2-q-lora-yarn"])
def test_mla_mtp_match_megatron(pool, tp, q_lora, extra):
    got, ref = pool.run(megatron_case, MP.WORLD, tp=tp, cfg=dict(MEGATRON_MLA, q_lora_rank=q_lora, **extra))[0]
    assert any(k.startswith("mtp.layers.1.") for k in ref["grads"])
    errs = MP.compare(got, ref)
    if extra:  # rope.yarn_inv_freq's θ_i/f and Megatron's 1/(f·base^(2i/d)) can differ by one float32 ulp on the
        worst = max(errs, key=errs.get)  # interpolated dims (here 2.9e-11 of 2.5e-4): measured 1.7e-10, not 1e-15
        assert errs[worst] < 1e-8, f"MLA + MTP with YaRN: worst relative error {errs[worst]:.3e} at {worst}"
    else:
        MP.assert_parity(errs, f"MLA + MTP tp={tp} q_lora_rank={q_lora}")


def test_megatron_tp2_without_the_1699_fix_differs(pool):
    """Negative control, and the Megatron bug itself: unpatched, Megatron's TP=2 MLA gradients are wrong upstream of
    the shared position key, and the comparison says where."""
    got, ref = pool.run(megatron_case, MP.WORLD, tp=2, cfg=dict(MEGATRON_MLA, q_lora_rank=10, mtp_num_layers=None),
                        fix_1699=False)[0]
    errs = MP.compare(got, ref)
    assert errs["logits"] < 1e-10 and errs["loss"] < 1e-10  # the forward is right
    with pytest.raises(AssertionError, match="worst relative error .* at grad decoder.layers"):
        MP.assert_parity(errs, "Megatron TP=2 MLA without the fix")
