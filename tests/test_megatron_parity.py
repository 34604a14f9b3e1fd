"""Parity with Megatron-core itself: the same weights give the same numbers, in float64, at TP 1 and 2.

For each case, on a 2-rank gloo world: build Megatron-core 0.15.3's model (local, non-Transformer-Engine spec) and
fill it from one full, seeded state dict in Megatron's checkpoint layout, each rank keeping the slice its
`partition_dim` / `partition_stride` attributes name; build ours from the same dict with `from_megatron` (sharded by
our Grid). Then compare logits, per-token loss and every parameter's gradient (of a randomly weighted sum of the
per-token losses), all gathered to full tensors: relative error max|ours − Megatron| / max|Megatron| <= 1e-10.
Only the order of floating-point reductions differs (measured worst: ~3e-15). Negative controls load a wrongly
laid out QKV (GPT) or cross-attention KV (T5) and show the comparison fails. Cases: GPT-2 and Llama (GQA, MQA, QKV
bias); BERT (token types, padding, LM head, pooler + binary head); T5 with learned positions (tied lm_head with its
bias) and with RoPE (RMSNorm, SwiGLU, untied; encoder deeper than decoder). TP=1 cases load ours from Megatron's own
`state_dict()` (with its aliases and _extra_state entries), TP=2 cases from the full dict.

Megatron runs on CPU through in-test shims (`megatron_on_cpu`, undone on exit); nothing here is project code.
Differences that are Megatron's or deliberate, and how the test handles them:
  - Vocabulary padding: ours pads to make_vocab_size_divisible_by independent of TP, Megatron's training script to
    divisible_by·tp; GPTModel takes whatever size it is given, so it gets our padded_vocab_size. Our logits stop
    at vocab_size (padding columns dropped), so Megatron's are cut there; the loss still runs over the padded
    vocabulary in both, and the padded rows' gradients are compared.
  - Megatron's vocab-parallel cross-entropy casts logits to float32 whatever the params dtype; the test lets float64
    stay float64 (one patched line, `calculate_logits_max`), everything else is Megatron's code.
  - SwiGLU linear_fc1: Megatron's parameter says partition_stride=1, but its TP shards are [gate_r; up_r] (its
    distributed checkpoint splits them so: apply_swiglu_sharded_factory); the full layout is [gate; up], stride 2.
  - Megatron's local norms (torch.nn.LayerNorm / RMSNorm) ignore params_dtype; the test casts them to float64.
  - Multi-query attention runs at TP=1 only: Megatron (and we) need num_query_groups divisible by tp.
  - Sequence parallelism: compared as ours (TP=2 + SP) against Megatron's TP=2 without SP, which its local
    LayerNorm / RMSNorm refuse; SP moves activations, not numbers.
  - Masks: Megatron gets an explicit causal boolean mask (True = masked; None would allocate on CUDA).
  - BERT padding (a deliberate difference): Megatron's BertModel builds its own mask from the padding, and with the
    local spec ([b, 1, s, s]) it masks padded *queries* as well as keys, so a padded position attends uniformly to
    everything (all scores -10000); ours (and Hugging Face's) masks keys only. Real tokens never see padded ones in
    either, so LM logits and per-token loss are compared at real tokens, the objective weights padded positions 0
    (as the loss mask does in training), and binary logits (position 0) and every gradient are compared in full.
    With Megatron's keys-only mask (`attn_mask_dimensions = "b11s"`, its Transformer Engine path's) the logits
    agree at every position, compared too. Megatron names BERT's stack `encoder`, ours (gpt.Model's) `decoder`.
  - T5 block specs: the stock get_t5_{encoder,decoder}_with_local_block_spec raise NameError (TENorm) without
    Transformer Engine; the test builds the same blocks with WrappedTorchNorm as their final norm.
  - T5 masks: T5Model takes the masks it is given. Ours follow Hugging Face (1 = token, padded keys masked, the
    decoder causal on top); Megatron gets the same masks as booleans, True = masked, at every position. (Its T5
    dataset, like BertModel, also masks padded queries: rows that carry no loss.)
  - T5 RoPE: T5Model takes no rotary_base (RotaryEmbedding's 10000 is used), so the case uses 10000. Relative
    position buckets (our T5 default) are not compared: Megatron's local DotProductAttention refuses an attention
    bias ("Attention bias is not supported for DotProductAttention"); only its Transformer Engine spec runs them.

Adding a model (Retro, MoE): write `megatron_<model>(config)` and a worker beside `gpt_case` that uses the
shared helpers of section 1 (megatron_on_cpu, seeded_full_state, load_into_megatron, gather_megatron, compare).
"""
from __future__ import annotations

import contextlib
import dataclasses
import zlib

import pytest
import torch
import torch.nn.functional as F

import bert
import gpt
import parallel as P
import t5
from equivalence import named_full, rel_err

MEGATRON_VERSION = "0.15.3"  # pinned in requirements-test.txt
RTOL = 1e-10  # float64: only reduction order differs
WORLD = 2  # every case runs on the 2-rank pool; TP=1 cases are TP=1 x DP=2 (both ranks compute the same)


# ============================================================================================ 1. shared helpers
# tp -> Megatron's parallel-state globals after initialize_model_parallel: each call makes ~30 new process groups (two
# gloo threads each) that destroy_model_parallel never frees, so a pool rank running every parity case would pile up
# hundreds of groups and threads that steal the CPU; the groups depend only on (world, tp), so make them once.
_MEGATRON_STATE: dict[int, dict] = {}


@contextlib.contextmanager
def megatron_on_cpu(tp: int, seed: int = 1234):
    """Megatron-core on CPU: the CUDA shims, its parallel_state over the existing default (gloo) group; undone on exit.

    The shims: current_device -> cpu; the CUDA RNG calls (torch.cuda and Megatron's tracker helpers) -> the CPU
    generator; and the float64 cross-entropy (see the module docstring).
    """
    from megatron.core import package_info
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import cross_entropy as mce
    from megatron.core.tensor_parallel import random as mrandom

    assert package_info.__version__ == MEGATRON_VERSION, package_info.__version__
    assert torch.distributed.is_initialized(), "run under the pool: Megatron needs a process group"

    def logits_max(x):  # Megatron: x = x.float() (a copy); here float64 stays float64 (still a copy)
        x = x.clone() if x.dtype == torch.float64 else x.float()
        return x, x.max(dim=-1)[0]

    patches = [(torch.cuda, "current_device", lambda: torch.device("cpu")),
               (torch.cuda, "manual_seed", torch.manual_seed),
               (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
               (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
               (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
               (mce.VocabParallelCrossEntropy, "calculate_logits_max", staticmethod(logits_max))]
    saved = [(obj, name, vars(obj)[name]) for obj, name, _ in patches]
    cpu_rng = torch.get_rng_state()
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        if tp in _MEGATRON_STATE:  # this process made Megatron's groups for tp already: reuse them
            vars(ps).update(_MEGATRON_STATE[tp])
        else:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
            _MEGATRON_STATE[tp] = {k: v for k, v in vars(ps).items() if k.startswith("_") and k.isupper()}
        mrandom.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        ps.destroy_model_parallel()  # Megatron's globals only (the groups live on in _MEGATRON_STATE)
        for obj, name, old in saved:
            setattr(obj, name, old)
        torch.set_rng_state(cpu_rng)


def megatron_transformer_config(c: gpt.Config, tp: int, **extra):
    """Our Config as Megatron's TransformerConfig, with every fusion off and dropout 0 (CPU, float64)."""
    from megatron.core.transformer import TransformerConfig

    act = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
    return TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_query_groups, kv_channels=c.kv_channels, ffn_hidden_size=c.ffn_hidden_size,
        normalization=c.normalization, layernorm_epsilon=c.layernorm_epsilon, activation_func=act[c.activation],
        gated_linear_unit=c.gated_linear_unit, add_bias_linear=c.add_bias_linear, add_qkv_bias=c.add_qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=c.init_method_std,
        tensor_model_parallel_size=tp, sequence_parallel=False, params_dtype=torch.float64,
        pipeline_dtype=torch.float64, use_cpu_initialization=True, apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, **extra)


def megatron_stride(name: str, p, gated: bool) -> int:
    """The stride of Megatron's TP shards: its attribute, except SwiGLU fc1 ([gate_r; up_r], see the docstring)."""
    if gated and ".linear_fc1." in name:
        return 2
    return getattr(p, "partition_stride", 1)


def megatron_params(model):
    """name -> parameter, tied weights once (Megatron's state_dict names = these names)."""
    return dict(model.named_parameters())


def full_shape(p, tp: int) -> list[int]:
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= tp
    return shape


def seeded_full_state(model, tp: int, seed: int) -> dict[str, torch.Tensor]:
    """A full float64 state dict for `model`'s parameters, from (seed, name) only — the same at every TP size.

    Not Megatron's init: norm weights ~1 + N(0, 0.1) and biases N(0, 0.1) instead of ones and zeros, so a layout
    error in them shows; matrices N(0, 0.1).
    """
    out = {}
    for name, p in megatron_params(model).items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t = 0.1 * torch.randn(full_shape(p, tp), generator=gen, dtype=torch.float64)
        out[name] = t + 1.0 if ("layernorm" in name or "layer_norm" in name) and name.endswith("weight") else t
    return out


@torch.no_grad()
def load_into_megatron(model, full: dict, tp: int, gated: bool):
    """Each rank keeps the slice of each full tensor that Megatron's partition_dim / partition_stride name."""
    from megatron.core import parallel_state as ps

    rank = ps.get_tensor_model_parallel_rank()
    for name, p in megatron_params(model).items():
        t = full[name]
        if getattr(p, "tensor_model_parallel", False):
            t = P.shard(t, p.partition_dim, megatron_stride(name, p, gated), rank, tp)
        p.data = t.to(torch.float64).clone()  # also casts Megatron's float32 local norms to float64


def gather_megatron(model, tp: int, gated: bool, grads: bool = True) -> dict[str, torch.Tensor]:
    """Megatron's full gradients (or parameters), gathered over its TP group by its own attributes."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, p in megatron_params(model).items():
        t = p.grad if grads else p.data
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            torch.distributed.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = P.unshard(parts, p.partition_dim, megatron_stride(name, p, gated))
        out[name] = t.detach().clone()
    return out


def gather_logits(logits, tp: int):
    """Megatron's vocabulary-parallel logits [b, s, V/tp] -> [b, s, V]."""
    from megatron.core import parallel_state as ps

    if tp == 1:
        return logits.detach()
    parts = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(parts, logits.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True = masked (Megatron's convention)


def compare(ours: dict, megatron: dict) -> dict[str, float]:
    """Relative error of every entry (logits, loss, ..., each gradient); the names must agree exactly."""
    assert set(ours["grads"]) == set(megatron["grads"]), set(ours["grads"]) ^ set(megatron["grads"])
    assert set(ours) == set(megatron), set(ours) ^ set(megatron)
    errs = {k: rel_err(ours[k], megatron[k]) for k in megatron if k != "grads"}  # logits, loss, and the like
    for name, g in megatron["grads"].items():
        assert ours["grads"][name].shape == g.shape, (name, ours["grads"][name].shape, g.shape)
        errs[f"grad {name}"] = rel_err(ours["grads"][name], g)
    return errs


def assert_parity(errs: dict[str, float], what: str):
    worst = max(errs, key=errs.get)
    assert errs[worst] <= RTOL, f"{what}: worst relative error {errs[worst]:.3e} > {RTOL:.0e} at {worst}"


# ============================================================================================ 2. GPT (GPT-2 / Llama)
def megatron_gpt(c: gpt.Config, tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(megatron_transformer_config(c, tp), get_gpt_layer_local_spec(normalization=c.normalization),
                    vocab_size=c.padded_vocab_size, max_sequence_length=c.max_position_embeddings,
                    share_embeddings_and_output_weights=c.share_embeddings_and_output_weights,
                    position_embedding_type=c.position_embedding_type, rotary_base=c.rotary_base,
                    parallel_output=True)


def grouped_to_plain_qkv(t: torch.Tensor, c: gpt.Config) -> torch.Tensor:
    """Negative control: read Megatron's grouped QKV as if it were [all q; all k; all v] (a plausible wrong guess)."""
    n, g, d = c.num_attention_heads, c.num_query_groups, c.kv_channels
    per = t.view(g, n // g + 2, d, *t.shape[1:])  # [g, q heads of the group + k + v, d, (h)]
    return torch.cat([x.reshape(-1, *t.shape[1:]) for x in (per[:, :-2], per[:, -2], per[:, -1])])


def gpt_case(rank, n, tp, cfg, b=2, s=12, seed=7, wrong_qkv=False, sp=False):
    c = gpt.Config(**cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    ours_c = gpt.Config(**cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
                        sequence_parallel=sp)  # Megatron always runs without SP (its local norms refuse it)
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (b, s + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    weights = torch.rand(b, s, generator=gen, dtype=torch.float64)  # d(objective)/d(per-token loss)
    with megatron_on_cpu(tp, seed):
        mc = megatron_gpt(c, tp)
        full = seeded_full_state(mc, tp, seed)
        load_into_megatron(mc, full, tp, c.gated_linear_unit)
        if wrong_qkv:
            full = {k: grouped_to_plain_qkv(v, c) if "linear_qkv" in k else v for k, v in full.items()}
        ours = gpt.from_megatron(full, ours_c, grid)

        position_ids = torch.arange(s).expand(b, s)
        logits = gather_logits(mc(inputs, position_ids, causal_mask(s)), tp)  # [b, s, padded V]
        ref = {"logits": logits[..., : c.vocab_size]}  # ours returns the real vocabulary's logits only
        loss = mc(inputs, position_ids, causal_mask(s), labels=labels)  # [b, s]
        (loss * weights).sum().backward()
        ref |= {"loss": loss.detach(), "grads": gather_megatron(mc, tp, c.gated_linear_unit)}

        got = {"logits": ours(inputs).detach()}
        loss = ours(inputs, labels=labels)
        (loss * weights).sum().backward()
        if sp:  # SP leaves partial norm/bias grads to sum over TP (tp = world here: no DP copies to add up)
            P.finalize_grads(ours, grid)  # (not without SP: it would sum the TP=1 cases' two DP copies)
        got |= {"loss": loss.detach(), "grads": named_full(ours, grid, grads=True)}
    return (got, ref) if rank == 0 else None


GPT2_LIKE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=250,
                 make_vocab_size_divisible_by=8, max_position_embeddings=16, normalization="LayerNorm",
                 activation="gelu", position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
LLAMA_LIKE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  vocab_size=250, make_vocab_size_divisible_by=8, max_position_embeddings=16,
                  position_embedding_type="rope", rotary_base=500.0, normalization="RMSNorm", activation="silu",
                  gated_linear_unit=True, add_bias_linear=False, share_embeddings_and_output_weights=False)
GPT_CASES = {
    "gpt2-like": GPT2_LIKE,
    "llama-gqa": LLAMA_LIKE,
    "llama-mqa": {**LLAMA_LIKE, "num_query_groups": 1},  # TP=1 only: groups must divide over TP
    "llama-mha-qkv-bias": {**LLAMA_LIKE, "num_query_groups": 4, "add_qkv_bias": True},
}


@pytest.mark.parametrize("name,tp", [("gpt2-like", 1), ("gpt2-like", 2), ("llama-gqa", 1), ("llama-gqa", 2),
                                     ("llama-mqa", 1), ("llama-mha-qkv-bias", 2)])
def test_gpt_matches_megatron(pool, name, tp):
    got, ref = pool.run(gpt_case, WORLD, tp=tp, cfg=GPT_CASES[name])[0]
    assert got["logits"].shape == ref["logits"].shape and got["loss"].shape == ref["loss"].shape
    assert_parity(compare(got, ref), f"{name} tp={tp}")


@pytest.mark.parametrize("name", ["gpt2-like", "llama-gqa"])
def test_gpt_with_sequence_parallelism_matches_megatron(pool, name):
    """Ours at TP=2 with sequence parallelism against Megatron at TP=2 without it (Megatron's local LayerNorm
    refuses SP; SP changes where activations live, not the numbers)."""
    got, ref = pool.run(gpt_case, WORLD, tp=2, cfg=GPT_CASES[name], sp=True)[0]
    assert_parity(compare(got, ref), f"{name} tp=2 sp")


def test_wrong_qkv_layout_is_caught(pool):
    """Negative control: the same comparison with Megatron's grouped QKV read as [q; k; v] fails by far."""
    got, ref = pool.run(gpt_case, WORLD, tp=2, cfg=GPT_CASES["llama-gqa"], wrong_qkv=True)[0]
    errs = compare(got, ref)
    assert errs["logits"] > 1e-3 and errs["loss"] > 1e-3, errs
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_parity(errs, "wrong QKV layout")


def test_from_megatron_renames_te_spec_and_wrappers():
    """A Transformer Engine-spec checkpoint (norms fused into linear_qkv / linear_fc1), wrapped in 'module.', with
    _extra_state entries and Megatron's TP-dependent vocabulary padding, loads to the same model."""
    c = gpt.Config(**LLAMA_LIKE, params_dtype=torch.float64)
    src = gpt.Model(c)
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    te = {}
    for k, v in sd.items():
        k = k.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
        k = k.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
        te["module." + k] = v
        if k.endswith("linear_qkv.weight"):
            te["module." + k.replace("weight", "_extra_state")] = None
    for k in ("module.embedding.word_embeddings.weight", "module.output_layer.weight"):  # Megatron pads by 8·tp
        te[k] = torch.cat([te[k], torch.randn(16, c.hidden_size, dtype=torch.float64)])
    loaded = gpt.from_megatron(te, c)
    for k, v in src.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(KeyError, match="missing"):
        gpt.from_megatron({k: v for k, v in sd.items() if "final_layernorm" not in k}, c)



# ============================================================================================ 3. BERT
def megatron_bert(c: bert.Config, tp: int):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(megatron_transformer_config(c, tp), num_tokentypes=c.num_tokentypes,
                     transformer_layer_spec=bert_layer_local_spec, vocab_size=c.padded_vocab_size,
                     max_sequence_length=c.max_position_embeddings, parallel_output=True,
                     share_embeddings_and_output_weights=c.share_embeddings_and_output_weights,
                     position_embedding_type=c.position_embedding_type, add_binary_head=c.add_binary_head)


def megatron_to_bert_names(d: dict) -> dict:
    return {("decoder." + k[8:] if k.startswith("encoder.") else k): v for k, v in d.items()}


def bert_case(rank, n, tp, cfg, b=3, s=12, seed=7, sp=False):
    c = bert.Config(**cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (b, s), generator=gen)
    lengths = torch.tensor([s, s - 3, s // 2, 2])[:b]
    real = (torch.arange(s) < lengths[:, None]).long()  # [b, s] 1 = token, 0 = padding (both models' input)
    types = (torch.arange(s) >= lengths[:, None] // 2).long() * real  # segment B from the middle of each row
    labels = torch.randint(0, c.vocab_size, (b, s), generator=gen)
    weights = torch.rand(b, s, generator=gen, dtype=torch.float64) * real  # padded positions carry no loss
    binary_weights = torch.rand(b, 2, generator=gen, dtype=torch.float64)
    keep = real.bool()
    with megatron_on_cpu(tp, seed):
        mc = megatron_bert(c, tp)
        full = seeded_full_state(mc, tp, seed)
        load_into_megatron(mc, full, tp, c.gated_linear_unit)
        # TP=1: Megatron's own state_dict() (aliases, _extra_state); TP=2: the full dict
        ours = bert.from_megatron(mc.state_dict() if tp == 1 else full, dataclasses.replace(c, sequence_parallel=sp),
                                  grid)

        logits, binary = mc(ids, real, types)
        ref = {"logits": gather_logits(logits, tp)[..., : c.vocab_size][keep], "binary logits": binary.detach()}
        loss, binary = mc(ids, real, types, lm_labels=labels)
        ((loss * weights).sum() + (binary * binary_weights).sum()).backward()
        ref |= {"loss": loss.detach()[keep], "grads": megatron_to_bert_names(gather_megatron(mc, tp, False))}
        mc.attn_mask_dimensions = "b11s"  # Megatron's mask for its TE path: keys only, as ours
        ref["logits, keys-only mask"] = gather_logits(mc(ids, real, types)[0], tp)[..., : c.vocab_size]

        logits, binary = ours(ids, real, types)
        got = {"logits": logits.detach()[keep], "binary logits": binary.detach(), "logits, keys-only mask": logits.detach()}
        loss, binary = ours(ids, real, types, lm_labels=labels)
        ((loss * weights).sum() + (binary * binary_weights).sum()).backward()
        if sp:
            P.finalize_grads(ours, grid)
        got |= {"loss": loss.detach()[keep], "grads": named_full(ours, grid, grads=True)}
    return (got, ref) if rank == 0 else None


BERT_CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=250,
                make_vocab_size_divisible_by=8, max_position_embeddings=16, num_tokentypes=2, add_binary_head=True)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_bert_matches_megatron(pool, tp, sp):
    """Token types, padded batches, LM head, pooler + binary head: LM logits and per-token loss at real tokens,
    binary logits, every gradient; and, with Megatron's keys-only mask, the logits at every position."""
    got, ref = pool.run(bert_case, WORLD, tp=tp, cfg=BERT_CFG, sp=sp)[0]
    assert_parity(compare(got, ref), f"bert tp={tp} sp={sp}")


# ============================================================================================ 4. T5
def megatron_t5(c: t5.Config, tp: int):
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def block(layer_spec, n):  # the stock get_t5_*_with_local_block_spec: NameError TENorm without Transformer Engine
        return TransformerBlockSubmodules([layer_spec] * n, layer_norm=WrappedTorchNorm)

    config = megatron_transformer_config(c, tp)  # c.num_layers = the decoder's depth
    return T5Model(config, dataclasses.replace(config, num_layers=c.encoder_num_layers),
                   block(t5_spec.encoder_model_with_local_spec(), c.encoder_num_layers),
                   block(t5_spec.decoder_model_with_local_spec(), c.decoder_num_layers),
                   vocab_size=c.padded_vocab_size, max_sequence_length=c.max_position_embeddings,
                   share_embeddings_and_output_weights=c.share_embeddings_and_output_weights,
                   position_embedding_type=c.position_embedding_type, parallel_output=True)


def per_head_kv_to_plain(t: torch.Tensor, c: t5.Config) -> torch.Tensor:
    """Negative control: read Megatron's linear_kv, per head [k_h; v_h], as [all k; all v]."""
    per = t.view(c.num_attention_heads, 2, c.kv_channels, *t.shape[1:])
    return torch.cat([per[:, 0].reshape(-1, *t.shape[1:]), per[:, 1].reshape(-1, *t.shape[1:])])


def t5_case(rank, n, tp, cfg, b=2, se=12, sd=8, seed=7, sp=False, wrong_kv=False):
    c = t5.Config(**cfg, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
    grid = P.Grid(tp=tp, dp=n // tp)
    gen = torch.Generator().manual_seed(seed)
    enc_ids, dec_ids, labels = (torch.randint(0, c.vocab_size, (b, k), generator=gen) for k in (se, sd, sd))
    enc_real = (torch.arange(se) < torch.tensor([se, se - 5])[:, None]).long()  # [b, se] 1 = token (ours, HF's)
    dec_real = (torch.arange(sd) < torch.tensor([sd, sd - 3])[:, None]).long()  # [b, sd]
    weights = torch.rand(b, sd, generator=gen, dtype=torch.float64)
    # Megatron's masks, True = masked, with ours' meaning: padded keys never seen, the decoder causal on top
    pad_keys = ~enc_real.bool()[:, None, None, :]  # [b, 1, 1, se]
    enc_mask, cross_mask = pad_keys.expand(b, 1, se, se), pad_keys.expand(b, 1, sd, se)
    dec_mask = ~dec_real.bool()[:, None, None, :] | causal_mask(sd)  # [b, 1, sd, sd]
    with megatron_on_cpu(tp, seed):
        mc = megatron_t5(c, tp)
        full = seeded_full_state(mc, tp, seed)
        load_into_megatron(mc, full, tp, c.gated_linear_unit)
        if wrong_kv:
            full = {k: per_head_kv_to_plain(v, c) if "linear_kv" in k else v for k, v in full.items()}
        ours = t5.from_megatron(mc.state_dict() if tp == 1 and not wrong_kv else full,
                                dataclasses.replace(c, sequence_parallel=sp), grid)

        logits = gather_logits(mc(enc_ids, dec_ids, enc_mask, dec_mask, cross_mask), tp)
        ref = {"logits": logits[..., : c.vocab_size]}
        loss = mc(enc_ids, dec_ids, enc_mask, dec_mask, cross_mask, lm_labels=labels)  # [b, sd]
        (loss * weights).sum().backward()
        ref |= {"loss": loss.detach(), "grads": gather_megatron(mc, tp, c.gated_linear_unit)}

        got = {"logits": ours(enc_ids, dec_ids, enc_real, dec_real).detach()}
        loss = ours(enc_ids, dec_ids, enc_real, dec_real, lm_labels=labels)
        (loss * weights).sum().backward()
        if sp:
            P.finalize_grads(ours, grid)
        got |= {"loss": loss.detach(), "grads": named_full(ours, grid, grads=True)}
    return (got, ref) if rank == 0 else None


T5_LEARNED = dict(num_layers=2, encoder_num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  vocab_size=250, make_vocab_size_divisible_by=8, max_position_embeddings=16,
                  position_embedding_type="learned_absolute", normalization="LayerNorm", activation="gelu",
                  share_embeddings_and_output_weights=True)  # Megatron's T5: tied, so the lm_head has a bias
T5_ROPE = dict(num_layers=1, encoder_num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
               vocab_size=250, make_vocab_size_divisible_by=8, max_position_embeddings=16,
               position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
               add_bias_linear=False, share_embeddings_and_output_weights=False)  # rotary_base: T5Model's 10000
T5_CASES = {"t5-learned": T5_LEARNED, "t5-rope": T5_ROPE}


@pytest.mark.parametrize("name,tp,sp", [("t5-learned", 1, False), ("t5-learned", 2, False), ("t5-learned", 2, True),
                                        ("t5-rope", 1, False), ("t5-rope", 2, False), ("t5-rope", 2, True)])
def test_t5_matches_megatron(pool, name, tp, sp):
    """Encoder and decoder padding, cross-attention, tied (with bias) and untied lm_head: logits, per-token loss and
    every gradient at every position."""
    got, ref = pool.run(t5_case, WORLD, tp=tp, cfg=T5_CASES[name], sp=sp)[0]
    assert_parity(compare(got, ref), f"{name} tp={tp} sp={sp}")


def test_wrong_cross_attention_kv_layout_is_caught(pool):
    """Negative control: Megatron's per-head [k; v] linear_kv read as [all k; all v] fails the same comparison."""
    got, ref = pool.run(t5_case, WORLD, tp=2, cfg=T5_LEARNED, wrong_kv=True)[0]
    errs = compare(got, ref)
    assert errs["logits"] > 1e-3 and errs["loss"] > 1e-3, errs
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_parity(errs, "wrong cross-attention KV layout")
