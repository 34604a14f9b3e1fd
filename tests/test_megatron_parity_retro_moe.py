"""Parity with Megatron-core for Retro and for a GPT with MoE layers: same weights, same numbers.

The method is test_megatron_parity.py's (its docstring): Megatron-core 0.15.3's model (local spec, CPU shims) and
ours built from one seeded full state dict in Megatron's layout, on the 2-rank gloo pool at TP=1 (x DP=2, both
ranks the same) and TP=2; logits, per-token loss and every gradient compared in float64 to 1e-10 relative.

Retro (RetroModel + get_retro_decoder_block_spec(use_transformer_engine=False)): chunk m = 4, k = 2 neighbours,
r = 8, 6 decoder layers (the chunked cross-attention layer is layer 6 and owns the 2-layer encoder), learned
absolute positions, micro-batch 2 with 3 chunks per sample (shift pad (n − 1) % m = 3), and micro-batch 1 with one
chunk. In-test shims and differences, besides the shared ones:
  - RetroConfig checks the Transformer Engine version (is_te_min_version, which raises without TE): patched to
    "no TE" for the case. Megatron's models also write their attention backend into NVTE_*_ATTN environment
    variables and refuse a value another model left (RetroModel forces "unfused", GPTModel "auto"): megatron_env
    unsets them for a case and restores them after.
  - Megatron takes the neighbours as context_input_ids [(b·l·k), r] (rows b-major, then chunk, then neighbour: how
    its pretrain_retro flattens [b, l, k, r]) with context_position_ids arange(r); context_mask None (its
    get_all_true_mask returns None: bidirectional). Ours takes neighbor_ids [b, l, k, r].
  - Final norm: 0.15.3's get_retro_decoder_block_spec sets no layer_norm, so its RetroModel has no final norm
    (its GPT block specs have one); ours has GPT's. The test gives Megatron's block spec the local norm.
  - The encoder-output reshape: retro.py's docstring used to call Megatron's plain reshape [r, (b·l·k), h] ->
    [r·k, b·l, h] a chunk mixer for b·l > 1. It is not: RetroEncoderBiasDropoutAdd (encoder layer 1) stacks the
    per-neighbour outputs as [r, k, b·l, h], so the encoder's output columns are (k b·l), and the reshape gives
    chunk c exactly its own k neighbours, as our rearrange does (keys in another order, which attention does not
    see). The test shows it at b·l = 6 (and b·l = 1, where any order agrees); the negative control (Megatron's
    encoder output re-read as (b·l k) columns before its reshape: the feared mixing) fails by far.
  - RoPE: Megatron's encoder gets no rotary embedding (RetroDecoderCrossAttention calls its encoder without one),
    ours rotates the neighbours' r positions. A RoPE case shows this is the only difference: with our encoder's
    rotary embedding switched off (patched for the case) it matches to 1e-10, as is it does not.

MoE (GPTModel + get_gpt_decoder_block_spec(use_transformer_engine=False): dense layer 0, MoE layer 1; the local
spec's experts are SequentialMLP, `mlp.experts.local_experts.{i}.linear_fc{1,2}.weight`, which gpt.from_megatron
renames to ours, `mlp.experts.linear_fc{1,2}.weight{i}`): 4 experts, top-2, softmax after top-k, SwiGLU experts,
add_bias_linear False, the all-gather dispatcher, switch load-balancing loss (coeff 1e-2) and z-loss (1e-3) on, and
a shared expert with its sigmoid gate (`shared_experts.gate_weight`, moe_shared_expert_gate: 0.15.3's spec builds
SharedExpertMLP with gate=False, later Megatron reads the config field; the case sets the spec's gate=True).
  - Aux losses: both define them per micro-batch exactly alike (f_i = tokens to i / (T·k): the 1/k is in both;
    z-loss = coeff · mean logsumexp²), and both inject them in backward through an identity autograd function. The
    weight they enter with: Megatron's MoEAuxLossAutoScaler.main_loss_backward_scale (its schedule sets it to
    loss_scale / num_micro_batches), ours T / num_tokens (set_num_tokens: the global batch's loss tokens). The
    test emulates M = 2 equal micro-batches of T = b·s tokens: Megatron's scale 1/2, our num_tokens 2·T, so both
    weigh the aux losses by 1/2; the objective's main part Σ w·loss is the same in both. The router's gradient
    therefore includes both aux losses' gradients and is compared like every other.
  - Megatron 0.15.3's RouterGatingLinearFunction tests `te_general_gemm is not None`, a name its moe_utils defines
    only when TE imports (NameError without TE): the case defines it as None, which selects its torch.mm path.
  - Megatron's router computes softmax with dtype=float32 (topk_routing_with_score_function,
    compute_routing_scores_for_aux_loss): the test lets a float64 softmax stay float64 (torch.softmax patched for
    the case: dtype=float32 on a float64 input -> float64), everything else is Megatron's code.
  - TP=2: Megatron refuses MoE + TP without sequence parallelism in training (MoELayer.forward), and its torch
    norms refuse SP (WrappedTorchNorm asserts), so the case patches WrappedTorchNorm to build the same torch norm
    under SP and mark its weight `sequence_parallel` (what Megatron's Apex / TE norms do); after backward, Megatron's
    own finalize step for SP (_allreduce_non_tensor_model_parallel_grads) sums those grads and the router's over
    TP. Ours runs TP=2 + SP (P.finalize_grads). Experts are tensor-parallel over TP (expert TP = TP in both), EP = 1.
  - Megatron applies the routing prob between fc1's activation and fc2 (MLP per_token_scale), ours after fc2: with
    no bias the same number, rounded differently (~1e-16).
Negative controls: experts loaded in the wrong order (local_experts.0 <-> 1), and our aux losses weighted 1 instead
of Megatron's 1/2 (only gradients differ: the router's by ~1e-2), both fail the comparison.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from einops import rearrange
from test_megatron_parity import (
    RTOL,
    WORLD,
    assert_parity,
    causal_mask,
    compare,
    gather_logits,
    gather_megatron,
    load_into_megatron,
    megatron_on_cpu,
    megatron_transformer_config,
    seeded_full_state,
)

import gpt
import parallel as P
import retro
from equivalence import named_full
from interop import convert


@contextlib.contextmanager
def patched(*patches):
    """setattr(obj, name, new) for each (obj, name, new); on exit the originals restored (absent ones deleted)."""
    saved = [(obj, name, vars(obj).get(name, patched)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            delattr(obj, name) if old is patched else setattr(obj, name, old)


@contextlib.contextmanager
def megatron_env():
    """Megatron's models write their attention backend into NVTE_{FLASH,FUSED,UNFUSED}_ATTN (RetroModel: unfused,
    0/0/1; GPTModel: auto, 1/1/1) and refuse to start when another model left other values: unset them for the
    case, restore them after (the pool's ranks run every parity case in one process)."""
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        yield
    finally:
        for k in names:
            os.environ.pop(k, None)
        os.environ.update(saved)


def run_both(mc, ours, grid, tp, megatron_inputs: dict, our_inputs: dict, labels, weights, sp=False, finalize=None):
    """Logits, per-token loss and full gradients of d(Σ weights·loss) from Megatron's model and ours."""
    logits = gather_logits(mc(**megatron_inputs), tp)
    ref = {"logits": logits[..., : ours.config.vocab_size]}
    loss = mc(**megatron_inputs, labels=labels)
    (loss * weights).sum().backward()
    if finalize is not None:
        finalize()
    ref |= {"loss": loss.detach(), "grads": gather_megatron(mc, tp, ours.config.gated_linear_unit)}

    got = {"logits": ours(**our_inputs).detach()}
    loss = ours(**our_inputs, labels=labels)
    (loss * weights).sum().backward()
    if sp:  # SP-partial grads summed over TP (tp = world: no DP copies to add up)
        P.finalize_grads(ours, grid)
    got |= {"loss": loss.detach(), "grads": named_full(ours, grid, grads=True)}
    return got, ref


# ============================================================================================ 1. Retro
RETRO = dict(num_layers=6, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=150,
             make_vocab_size_divisible_by=8, max_position_embeddings=16, normalization="LayerNorm",
             activation="gelu", position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
             retro_chunk_length=4, retro_num_neighbors=2, retro_encoder_num_layers=2)


def megatron_retro(c: retro.Config, tp: int):
    from megatron.core.models.retro import RetroConfig, RetroModel, get_retro_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    base = megatron_transformer_config(c, tp)
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__ if base.__dataclass_fields__[f].init}
    mcfg = RetroConfig(**fields, retro_chunk_length=c.retro_chunk_length, retro_num_neighbors=c.retro_num_neighbors,
                       retro_num_retrieved_chunks=c.retro_num_retrieved_chunks,
                       retro_encoder_num_layers=c.retro_encoder_num_layers, retro_encoder_hidden_dropout=0.0,
                       retro_encoder_attention_dropout=0.0, retro_split_preprocessing="98,2,0")
    spec = get_retro_decoder_block_spec(mcfg, use_transformer_engine=False)
    assert spec.layer_norm is None  # 0.15.3: no final norm (see the module docstring); give it GPT's local one
    spec.layer_norm = WrappedTorchNorm
    return RetroModel(mcfg, spec,
                      vocab_size=c.padded_vocab_size, max_sequence_length=c.max_position_embeddings,
                      share_embeddings_and_output_weights=c.share_embeddings_and_output_weights,
                      position_embedding_type=c.position_embedding_type, parallel_output=True)


def retro_case(rank, n, tp, b=2, l=3, seed=7, encoder_columns_as="k bl", our_encoder_rope=True, **cfg):  # noqa: E741
    """encoder_columns_as: how the test reads Megatron's encoder output columns — "k bl" is what Megatron does;
    "bl k" (the negative control) permutes them before Megatron's decoder reshape. our_encoder_rope=False runs our
    encoder without rotary embeddings, as Megatron's runs (RoPE configs); cfg overrides RETRO."""
    from megatron.core.models.retro import config as retro_config

    c = retro.Config(**(RETRO | cfg), hidden_dropout=0.0, attention_dropout=0.0, retro_encoder_hidden_dropout=0.0,
                     retro_encoder_attention_dropout=0.0, params_dtype=torch.float64)
    m, k, r = c.retro_chunk_length, c.retro_num_neighbors, c.retro_retrieved_length
    s = l * m
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (b, s + 1), generator=gen)
    neighbors = torch.randint(0, c.vocab_size, (b, l, k, r), generator=gen)  # [b, l, k, r]
    weights = torch.rand(b, s, generator=gen, dtype=torch.float64)
    encoder_forward = retro.RetroEncoder.forward
    no_rope = [] if our_encoder_rope else [(retro.RetroEncoder, "forward", lambda self, x, chunks, rope=None:
                                            encoder_forward(self, x, chunks, None))]
    no_te = (retro_config, "is_te_min_version", lambda *a, **kw: False)  # RetroConfig's TE check, without TE
    with megatron_env(), megatron_on_cpu(tp, seed), patched(no_te, *no_rope):
        mc = megatron_retro(c, tp)
        full = seeded_full_state(mc, tp, seed)
        load_into_megatron(mc, full, tp, gated=False)
        if encoder_columns_as == "bl k":  # negative control: undo Megatron's (k bl) column order before its reshape
            encoder = mc.decoder.layers[c.retro_layer_numbers[0] - 1].cross_attention.encoder
            encoder.register_forward_hook(lambda mod, args, out: rearrange(
                out, "r (k bl) h -> r (bl k) h", k=k).contiguous())
        ours = retro.from_megatron(full, c, grid)
        ctx_ids = rearrange(neighbors, "b l k r -> (b l k) r")
        mega_in = dict(input_ids=ids[:, :-1], position_ids=torch.arange(s).expand(b, s), attention_mask=causal_mask(s),
                       context_input_ids=ctx_ids, context_position_ids=torch.arange(r).expand(ctx_ids.shape[0], r),
                       context_mask=None)
        got, ref = run_both(mc, ours, grid, tp, mega_in, dict(input_ids=ids[:, :-1], neighbor_ids=neighbors),
                            ids[:, 1:], weights)
    return (got, ref) if rank == 0 else None


@pytest.mark.parametrize("tp,b,l", [(1, 2, 3), (2, 2, 3), (2, 1, 1)])  # noqa: E741
def test_retro_matches_megatron(pool, tp, b, l):  # noqa: E741
    got, ref = pool.run(retro_case, WORLD, tp=tp, b=b, l=l)[0]
    assert got["logits"].shape == ref["logits"].shape == (b, l * 4, 150)
    errs = compare(got, ref)
    assert any("cross_attention.encoder.layers.1" in k for k in errs)  # the encoder's gradients are compared
    assert_parity(errs, f"retro tp={tp} b={b} l={l}")


def test_retro_encoder_columns_read_as_bl_k_is_caught(pool):
    """Negative control: Megatron's encoder output read as (b·l k) columns (the order of its input, before
    RetroEncoderBiasDropoutAdd stacks neighbours k-major) hands chunks other chunks' neighbours: far off."""
    got, ref = pool.run(retro_case, WORLD, tp=2, encoder_columns_as="bl k")[0]
    errs = compare(got, ref)
    assert errs["logits"] > 1e-3 and errs["loss"] > 1e-3, errs
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_parity(errs, "encoder columns as (bl k)")


def test_retro_with_rope_differs_only_by_the_encoders_rotary_embedding(pool):
    """The named difference: with RoPE, Megatron's encoder runs without rotary embeddings and ours with them; our
    encoder run without them matches Megatron to 1e-10, with them it does not."""
    got, ref = pool.run(retro_case, WORLD, tp=2, position_embedding_type="rope", our_encoder_rope=False)[0]
    assert_parity(compare(got, ref), "retro rope, our encoder without rotary embeddings")
    got, ref = pool.run(retro_case, WORLD, tp=2, position_embedding_type="rope")[0]
    errs = compare(got, ref)
    assert errs["logits"] > 1e-4 and errs["grad decoder.layers.5.cross_attention.encoder.layers.0.input_layernorm.weight"] > 1e-3


# ============================================================================================ 2. GPT with MoE layers
MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
           vocab_size=250, make_vocab_size_divisible_by=8, max_position_embeddings=16, position_embedding_type="rope",
           rotary_base=500.0, normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
           share_embeddings_and_output_weights=False, num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=24,
           moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_token_dispatcher_type="allgather",
           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
MICRO_BATCHES = 2  # the aux losses' weight 1/M (see the module docstring)


def megatron_moe(c: gpt.Config, tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    mcfg = megatron_transformer_config(
        c, tp, num_moe_experts=c.num_experts, moe_layer_freq=c.moe_layer_freq, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
        moe_router_topk=c.moe_router_topk, moe_aux_loss_coeff=c.moe_aux_loss_coeff, moe_z_loss_coeff=c.moe_z_loss_coeff,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size)
    mcfg.sequence_parallel = tp > 1  # Megatron trains MoE + TP only with SP (see the module docstring)
    spec = get_gpt_decoder_block_spec(mcfg, use_transformer_engine=False, normalization=c.normalization)
    for layer in spec.layer_specs:  # 0.15.3 builds SharedExpertMLP with gate=False (its moe_shared_expert_gate, later)
        shared = getattr(layer.submodules.mlp.submodules, "shared_experts", None)
        if shared is not None:
            shared.params = {**shared.params, "gate": c.moe_shared_expert_gate}
    return GPTModel(mcfg, spec, vocab_size=c.padded_vocab_size, max_sequence_length=c.max_position_embeddings,
                    share_embeddings_and_output_weights=c.share_embeddings_and_output_weights,
                    position_embedding_type=c.position_embedding_type, rotary_base=c.rotary_base, parallel_output=True)


def swap_experts(full: dict, a: int, b: int) -> dict:
    """Negative control: Megatron's local_experts.a and .b exchanged (a plausible off-by-order expert mapping)."""
    swap = {f"local_experts.{a}.": f"local_experts.{b}.", f"local_experts.{b}.": f"local_experts.{a}."}
    out = {}
    for name, t in full.items():
        for x, y in swap.items():
            if x in name:
                name = name.replace(x, y)
                break
        out[name] = t
    return out


def moe_case(rank, n, tp, b=2, s=12, seed=7, wrong_experts=False, aux_weight=None):
    """aux_weight: ours weighs the aux losses by 1/MICRO_BATCHES like Megatron (None), or by this (a control)."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.parallel_state import get_tensor_model_parallel_group
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils

    sp = tp > 1
    c = gpt.Config(**MOE, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64, sequence_parallel=sp)
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (b, s + 1), generator=gen)
    weights = torch.rand(b, s, generator=gen, dtype=torch.float64)

    softmax, norm_new = torch.softmax, torch_norm.WrappedTorchNorm.__new__

    def softmax64(x, dim, dtype=None):  # Megatron's router asks for float32; a float64 input stays float64
        return softmax(x, dim, dtype=torch.float64 if dtype is not None and x.dtype == torch.float64 else dtype)

    def sp_norm(cls, config, *args, **kwargs):  # the torch norm under SP, its weight marked as Apex / TE mark theirs
        no_sp = type(config).__new__(type(config))
        no_sp.__dict__.update(vars(config), sequence_parallel=False)
        norm = norm_new(cls, no_sp, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    shims = [(torch, "softmax", softmax64), (torch_norm.WrappedTorchNorm, "__new__", staticmethod(sp_norm)),
             (moe_utils, "te_general_gemm", None),  # see the module docstring
             (moe_utils.MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0 / MICRO_BATCHES))]
    with megatron_env(), megatron_on_cpu(tp, seed), patched(*shims):
        mc = megatron_moe(c, tp)
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in dict(mc.named_parameters())
        full = seeded_full_state(mc, tp, seed)
        load_into_megatron(mc, full, tp, c.gated_linear_unit)
        ours = gpt.from_megatron(swap_experts(full, 0, 1) if wrong_experts else full, c, grid)
        P.set_num_tokens(ours, b * s * (MICRO_BATCHES if aux_weight is None else 1 / aux_weight))  # T / num_tokens
        mc.ddp_config = type("DDPConfig", (), {"use_megatron_fsdp": False})()  # what Megatron's finalize reads
        got, ref = run_both(mc, ours, grid, tp, dict(input_ids=ids[:, :-1], position_ids=torch.arange(s).expand(b, s),
                                                     attention_mask=causal_mask(s)),
                            dict(input_ids=ids[:, :-1]), ids[:, 1:], weights, sp=sp,
                            finalize=lambda: _allreduce_non_tensor_model_parallel_grads(
                                [mc], mc.config, get_tensor_model_parallel_group()))
        ref["grads"] = convert.megatron_state(ref["grads"], c)  # Megatron's names -> ours, the rename from_megatron uses
        load = P.moe_load(ours)  # tokens per expert [MoE layers, E] (ours, both forwards)
    return (got, ref, load) if rank == 0 else None


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_gpt_matches_megatron(pool, tp):
    got, ref, load = pool.run(moe_case, WORLD, tp=tp)[0]
    errs = compare(got, ref)
    assert "grad decoder.layers.1.mlp.router.weight" in errs and "grad decoder.layers.1.mlp.shared_experts.gate_weight" in errs
    assert int((load > 0).sum()) >= 3, load  # the routing is not degenerate: most experts get tokens
    assert_parity(errs, f"moe tp={tp}")


def test_moe_wrong_expert_order_is_caught(pool):
    """Negative control: experts 0 and 1 loaded in each other's place fail the comparison by far."""
    got, ref, _ = pool.run(moe_case, WORLD, tp=2, wrong_experts=True)[0]
    errs = compare(got, ref)
    assert errs["logits"] > 1e-6 and errs["loss"] > 1e-6, errs
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_parity(errs, "experts 0 and 1 swapped")


def test_moe_aux_loss_weight_mismatch_is_caught(pool):
    """Negative control: our aux losses weighted 1 (as for one micro-batch) against Megatron's 1/2: the router's
    gradient (and those upstream of it) differ, while logits and losses still agree."""
    got, ref, _ = pool.run(moe_case, WORLD, tp=2, aux_weight=1.0)[0]
    errs = compare(got, ref)
    assert errs["logits"] <= RTOL and errs["grad decoder.layers.1.mlp.router.weight"] > 1e-4, errs
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_parity(errs, "aux-loss weight 1 vs 1/2")
