"""The model FLOPs formulas (metrics.flops: Megatron's num_floating_point_operations, megatron/training/training.py;
bert.flops, t5.flops: ours; mamba.flops: Megatron's hybrid count)
against two independent counts: a hand count walked over the model's own modules (every GEMM weight 2·tokens·numel,
the core attention — causal half, BERT's and T5's encoder full square, T5's cross-attention sd x se —, the routed
experts x top-k, Megatron's scan estimate, the norms Megatron's MLA and MTP terms name), and
torch.utils.flop_counter.FlopCounterMode on a real forward + backward. Models: GPT, GQA + SwiGLU, MoE, MLA with and
without q-lora, MTP after a dense and after an MoE layer, the hybrid Mamba, BERT with and without its binary head,
T5 with MoE layers and GQA. Also the `tflops` / `mfu` that train.py logs (metrics.throughput, the peak table).

All counts are integers below 2^53 (float64 holds them exactly), so every comparison is exact (==), no tolerance.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import bert
import deepseek
import gpt
import mamba
import metrics
import parallel as P
import t5
import train
import transformer
from harness import SNIPPET, tiny
from interop import tokenizer_files

B, S = 3, 16  # sequences, sequence length

GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, make_vocab_size_divisible_by=64,
           max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
LLAMA = dict(GPT, num_query_groups=2, ffn_hidden_size=48, gated_linear_unit=True, activation="silu",
             normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False)
MOE = dict(LLAMA, num_layers=3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[1, 0, 1],
           moe_shared_expert_intermediate_size=40, share_embeddings_and_output_weights=False)
MAMBA = dict(hybrid_layer_pattern="M-M*E", hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, gated_linear_unit=True, activation="silu", vocab_size=100, mamba_head_dim=16,
             mamba_num_groups=2, mamba_state_dim=8, mamba_chunk_size=8, num_experts=4, moe_router_topk=2,
             moe_shared_expert_intermediate_size=40, params_dtype=torch.float64)


MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6,
           qk_pos_emb_head_dim=4, v_head_dim=10)  # dn + dr = dv: CPU's fused SDPA kernel runs the core
MLA_FULL_Q = dict(MLA, q_lora_rank=None, v_head_dim=8)  # dn + dr != dv: SDPA's math path (bmm) runs the core
MTP = dict(MLA, mtp_num_layers=2)  # the last layer dense: each depth adds a dense layer
MTP_MOE = dict(MOE, **{k: v for k, v in MTP.items() if k not in LLAMA}, num_query_groups=None)  # ... an MoE layer
BERT = dict(GPT, num_query_groups=2, ffn_hidden_size=48)
SE, SD = 16, 8  # T5's encoder and decoder lengths
T5 = dict(LLAMA, position_embedding_type="relative", max_position_embeddings=SE, num_layers=3, encoder_num_layers=2,
          decoder_num_layers=3, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
          moe_layer_freq=[0, 1, 1])  # relative positions; MoE layers 1 (and 2) of each stack


def linear(model, m, T: int) -> int:
    """A Column/RowParallelLinear or nn.Linear weight [out, in] on T tokens: 2·T·out·in (a tied output layer: the
    embedding's [V, h])."""
    w = m.weight if m.weight is not None else model.embedding.word_embeddings.weight
    return 2 * T * w.numel()


def core(b: int, n: int, sq: int, sk: int, dqk: int, dv: int, causal: bool) -> int:
    """QKᵀ 2·b·n·sq·sk·dqk and PV 2·b·n·sq·sk·dv; causal: half (Megatron's rule)."""
    full = 2 * b * n * sq * sk * (dqk + dv)
    return full // 2 if causal else full


def hand_count(model, b: int, s: int, within=None) -> int:
    """Megatron's counting rules applied to the modules the model holds: each Column/RowParallelLinear and nn.Linear
    (MLA's replicated down projections) weight [out, in] costs 2·T·out·in (T = b·s tokens) — attention, MLP, shared
    expert, Mamba in/out_proj, MTP's eh_proj, an untied output layer, a tied one the embedding's [V, h], the output
    layer once more per MTP depth; core attention QKᵀ and PV 2·b·n·s²·d each, halved (causal), MLA's over dn + dr
    and dv; each routed expert's fc1 and fc2 per token x top-k; a Mamba mixer's scan 7·T·d_in·N (Megatron's
    estimate); the norms Megatron's formula names — MLA's q/kv latent norms, MTP's enorm, hnorm and final_layernorm —
    2·T·width. Not counted (nor by Megatron): the router, the other norms, convolution, softmax, elementwise.
    x 3: forward, dgrad, wgrad. `within`: count only that submodule's modules."""
    c, T, n = model.config, b * s, 0
    within = within or model
    named = [m for a in within.modules() if isinstance(a, deepseek.MLASelfAttention)
             for m in (getattr(a, "q_layernorm", None), a.kv_layernorm) if m is not None]
    named += [m for a in within.modules() if isinstance(a, deepseek.MTPLayer)
              for m in (a.enorm, a.hnorm, a.final_layernorm)]
    for m in within.modules():
        if isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear, nn.Linear)):
            n += linear(model, m, T) * (1 + (c.mtp_num_layers or 0) if m is getattr(model, "output_layer", None) else 1)
        elif isinstance(m, transformer.Attention):
            n += core(b, m.n, s, s, m.d, m.d, causal=True)
        elif isinstance(m, deepseek.MLASelfAttention):
            n += core(b, m.n, s, s, m.dn + m.dr, m.dv, causal=True)
        elif isinstance(m, P.GroupedMLP):
            n += 2 * T * c.moe_router_topk * (m.linear_fc1.weight0.numel() + m.linear_fc2.weight0.numel())
        elif isinstance(m, mamba.MambaMixer):
            n += 7 * T * c.d_inner * c.mamba_state_dim
        elif any(m is x for x in named):
            n += 2 * T * m.weight.numel()
    return 3 * n


def bert_hand_count(model, b: int, s: int) -> int:
    """BERT's modules: every linear on the b·s tokens but the pooler's dense and the binary head (b [CLS] tokens);
    core attention over the full s x s square (bidirectional); MoE as above. x 3."""
    c, T, n = model.config, b * s, 0
    per_sequence = [getattr(model, "pooler", None) and model.pooler.dense, getattr(model, "binary_head", None)]
    for m in model.modules():
        if isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear, nn.Linear)):
            n += linear(model, m, b if any(m is x for x in per_sequence) else T)
        elif isinstance(m, transformer.Attention):
            n += core(b, m.n, s, s, m.d, m.d, causal=False)
        elif isinstance(m, P.GroupedMLP):
            n += 2 * T * c.moe_router_topk * (m.linear_fc1.weight0.numel() + m.linear_fc2.weight0.numel())
    return 3 * n


def t5_hand_count(model, b: int, se: int, sd: int) -> int:
    """T5's modules: the encoder's linears on b·se tokens, its attention over the full se x se; the decoder's on
    b·sd tokens but cross-attention's linear_kv (on the b·se encoder outputs), its self-attention causal (half of
    sd x sd), its cross-attention over sd x se; the output layer (tied: the embedding) on b·sd. x 3."""
    c, n = model.config, 0
    for stack, T, s in ((model.encoder, b * se, se), (model.decoder, b * sd, sd)):
        kv = {id(layer.cross_attention.linear_kv) for layer in stack.layers if hasattr(layer, "cross_attention")}
        cross = {id(layer.cross_attention) for layer in stack.layers if hasattr(layer, "cross_attention")}
        for m in stack.modules():
            if isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear)):
                n += linear(model, m, b * se if id(m) in kv else T)
            elif isinstance(m, transformer.Attention):
                n += core(b, m.n, s, se if id(m) in cross else s, m.d, m.d, causal=stack is model.decoder
                          and id(m) not in cross)
            elif isinstance(m, P.GroupedMLP):
                n += 2 * T * c.moe_router_topk * (m.linear_fc1.weight0.numel() + m.linear_fc2.weight0.numel())
    return 3 * (n + linear(model, model.lm_head.output_layer, b * sd))


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MOE, MLA, MLA_FULL_Q, MTP, MTP_MOE],
                         ids=["gpt2-like", "llama-gqa-swiglu", "moe-topk-shared", "mla-q-lora", "mla-full-q",
                              "mtp-dense", "mtp-moe"])
def test_transformer_formula_equals_the_hand_count(cfg):
    model = gpt.Model(gpt.Config(**cfg))
    assert metrics.flops(model.config, B, S) == hand_count(model, B, S)


@pytest.mark.parametrize("mtp", [None, 2], ids=["hybrid", "hybrid-mtp"])
def test_hybrid_formula_equals_the_hand_count(mtp):
    """With MTP, Megatron's hybrid count has each depth's logit layer but not the depths' own layers: the hand count
    of the model minus that of model.mtp (whose modules do not include the shared output layer)."""
    model = mamba.Model(mamba.Config(**MAMBA, mtp_num_layers=mtp))
    mtp_layers = hand_count(model, B, S, within=model.mtp) if mtp else 0
    assert mamba.flops(model.config, B, S) == hand_count(model, B, S) - mtp_layers


@pytest.mark.parametrize("binary_head", [True, False], ids=["binary-head", "no-binary-head"])
def test_bert_formula_equals_the_hand_count(binary_head):
    model = bert.Model(bert.Config(**BERT, add_binary_head=binary_head))
    assert bert.flops(model.config, B, S) == bert_hand_count(model, B, S)


def test_t5_formula_equals_the_hand_count():
    model = t5.Model(t5.Config(**T5))
    assert t5.flops(model.config, B, SE, SD) == t5_hand_count(model, B, SE, SD)
    assert t5.flops(model.config, B, SE) == t5_hand_count(model, B, SE, t5.decoder_length(SE))


def test_t5_decoder_length_is_the_datasets():
    """flops(t5 config, batch, seq) without decoder_seq (what train.py calls) takes the decoder length that
    t5.SpanCorruptionDataset makes of rows of seq + 1 tokens."""
    class Tok:  # the special tokens are all SpanCorruptionDataset reads from a tokenizer
        def token_to_id(self, t):
            return tokenizer_files.SPECIAL_TOKENS.index(t)

    for seq in (16, 32, 128):
        ds = t5.SpanCorruptionDataset([np.arange(4 * seq) % 50 + 150], [0], argparse.Namespace(seq_length=seq), Tok(), 0)
        assert t5.unpack(torch.from_numpy(ds[0])[None])["text_dec"].shape[1] == t5.decoder_length(seq)


def test_a_wrong_formula_is_caught():
    """Negative controls: the hand count sees a formula that forgets SwiGLU's third GEMM, the top-k, the scan, MLA's
    q-lora or its v_head_dim, the MTP depths (dense, MoE, hybrid); BERT counted as GPT (causal, no heads);
    T5 counted as GPT (no decoder) or with the encoder's length for the decoder's."""
    for cfg, wrong in [(LLAMA, dict(gated_linear_unit=False)), (MOE, dict(moe_router_topk=1)),
                       (MLA, dict(q_lora_rank=None)), (MLA, dict(v_head_dim=6)), (MTP, dict(mtp_num_layers=None)),
                       (MTP_MOE, dict(mtp_num_layers=1))]:
        model = gpt.Model(gpt.Config(**cfg))
        assert metrics.flops(dataclasses.replace(model.config, **wrong), B, S) != hand_count(model, B, S), wrong
    model = mamba.Model(mamba.Config(**MAMBA))
    c = model.config
    no_scan = copy.copy(c)  # (a Config refuses mamba_state_dim=0: the field is set past its checks)
    no_scan.mamba_state_dim = 0
    assert mamba.flops(no_scan, B, S) != hand_count(model, B, S)
    model = mamba.Model(mamba.Config(**MAMBA, mtp_num_layers=1))
    hand = hand_count(model, B, S) - hand_count(model, B, S, within=model.mtp)
    assert mamba.flops(dataclasses.replace(model.config, mtp_num_layers=None), B, S) != hand
    model = bert.Model(bert.Config(**BERT))
    assert metrics.flops(gpt.Config(**BERT), B, S) != bert_hand_count(model, B, S)
    assert bert.flops(model.config, B, S) != hand_count(model, B, S)  # the GPT hand count: causal, heads per token
    model = t5.Model(t5.Config(**T5))
    gpt_fields = {k: v for k, v in T5.items() if k in {f.name for f in dataclasses.fields(gpt.Config)}
                  and k != "position_embedding_type"}
    assert metrics.flops(gpt.Config(**gpt_fields), B, SE) != t5_hand_count(model, B, SE, SD)
    assert t5.flops(model.config, B, SE, SE) != t5_hand_count(model, B, SE, SD)


def sdpa_as_matmuls(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention written out (its math path; no dropout): softmax(q·kᵀ·scale + mask)·v, so that
    FlopCounterMode sees core attention as two bmm over the full sq x sk square, whichever kernel SDPA would pick."""
    assert dropout_p == 0.0
    if enable_gqa:  # k, v [b, g, sk, d] -> [b, n, sk, d]
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)  # [b, n, sq, sk]
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1) @ v


def matmul_flops(run, monkeypatch) -> int:
    """FlopCounterMode over run() (a forward + backward) with SDPA written out: its mm/addmm/bmm FLOPs; it may count
    nothing else."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_as_matmuls)
    with FlopCounterMode(display=False) as fc:
        run()
    counts = {str(op): v for op, v in fc.get_flop_counts().get("Global", {}).items()}
    assert all(op.split(".")[-1] in ("mm", "addmm", "bmm") for op in counts), counts
    return sum(counts.values())


def counter_case(name, monkeypatch):
    """(FlopCounterMode's matmul FLOPs on a real float64 forward + backward, the formula, its core attention as
    Megatron counts it (causal: half), the same over the full squares SDPA computes, the formula's norm terms)."""
    torch.manual_seed(0)
    if name == "bert":
        model = bert.Model(bert.Config(**BERT))
        c = model.config
        ids = torch.randint(0, c.vocab_size, (B, S))
        types = torch.randint(0, 2, (B, S))
        run = lambda: sum(t.sum() for t in model(ids, None, types, lm_labels=ids)).backward()  # noqa: E731
        core_m = 3 * c.num_layers * core(B, c.num_attention_heads, S, S, c.kv_channels, c.kv_channels, False)
        return matmul_flops(run, monkeypatch), bert.flops(c, B, S), core_m, core_m, 0
    if name == "t5":
        model = t5.Model(t5.Config(**dict(T5, num_experts=None)))  # dense: the router's GEMM is not a model FLOP
        c, n, d = model.config, model.config.num_attention_heads, model.config.kv_channels
        enc, dec = torch.randint(0, c.vocab_size, (B, SE)), torch.randint(0, c.vocab_size, (B, SD + 1))
        run = lambda: model(enc, dec[:, :-1], lm_labels=dec[:, 1:]).sum().backward()  # noqa: E731
        core_e, cross = core(B, n, SE, SE, d, d, False), core(B, n, SD, SE, d, d, False)
        core_m = 3 * (c.encoder_num_layers * core_e + c.decoder_num_layers * (core(B, n, SD, SD, d, d, True) + cross))
        core_f = 3 * (c.encoder_num_layers * core_e + c.decoder_num_layers * (core(B, n, SD, SD, d, d, False) + cross))
        return matmul_flops(run, monkeypatch), t5.flops(c, B, SE, SD), core_m, core_f, 0
    model = gpt.Model(gpt.Config(**{"gpt2-like": GPT, "llama-gqa-swiglu": LLAMA, "mla-q-lora": MLA,
                                    "mla-full-q-mtp": dict(MLA_FULL_Q, mtp_num_layers=2)}[name]))
    c, L = model.config, model.config.num_layers + (model.config.mtp_num_layers or 0)
    ids = torch.randint(0, c.vocab_size, (B, S + 1))
    run = lambda: model(ids[:, :-1], ids[:, 1:]).sum().backward()  # noqa: E731
    dqk, dv = (c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim) if c.multi_latent_attention else (c.kv_channels,) * 2
    core_m = 3 * L * core(B, c.num_attention_heads, S, S, dqk, dv, True)
    norms = 3 * 2 * B * S * (L * (c.kv_lora_rank + (c.q_lora_rank or 0)) * c.multi_latent_attention
                             + (c.mtp_num_layers or 0) * 3 * c.hidden_size)  # MLA's latent norms, MTP's three
    return matmul_flops(run, monkeypatch), metrics.flops(c, B, S), core_m, 2 * core_m, norms


@pytest.mark.parametrize("name", ["gpt2-like", "llama-gqa-swiglu", "mla-q-lora", "mla-full-q-mtp", "bert", "t5"])
def test_flop_counter_mode_agrees(name, monkeypatch):
    """torch's FlopCounterMode on a real forward + backward (float64): its matmul FLOPs (mm, addmm, bmm) are the
    formula's, exactly, once two things the formula counts otherwise are swapped: core attention as run (SDPA written
    out as matmuls, sdpa_as_matmuls: CPU's fused kernel would be invisible to the counter, the math path visible, and
    which one runs depends on masks, GQA and head dims) is the full sq x sk square where Megatron counts a causal
    half; and the norm terms Megatron's formula carries (MLA's latent norms, MTP's three) have no matmul. The
    embedding lookup, the other norms, softmax and the cross-entropy have no matmul and are not counted. BERT:
    bidirectional (its full square is the count); T5: encoder, causal decoder, cross-attention over the encoder's
    length, linear_kv on the encoder's tokens."""
    matmul, formula, core_counted, core_run, norms = counter_case(name, monkeypatch)
    assert matmul == formula - core_counted + core_run - norms


def test_throughput_and_mfu(monkeypatch):
    assert metrics.throughput(6e12, 2.0, 3, "cpu", half=True) == dict(tflops=1.0)  # 6e12 FLOPs / 2 s / 3 ranks
    names = {"NVIDIA H100 80GB HBM3": (989.4, 66.9), "NVIDIA H100 PCIe": (756.0, 51.2), "NVIDIA H200": (989.4, 66.9),
             "NVIDIA A100-SXM4-80GB": (312.0, 19.5), "NVIDIA L4": (121.0, 30.3), "NVIDIA A10G": (None, None),
             "NVIDIA L40": (None, None), "NVIDIA GH200 480GB": (989.4, 66.9)}
    for name, (bf16, fp32) in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert (metrics.peak_tflops("cuda:0", True), metrics.peak_tflops("cuda:0", False)) == (bf16, fp32), name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    got = metrics.throughput(989.4e12 * 4, 2.0, 4, "cuda:0", half=True)
    assert got["tflops"] == pytest.approx(494.7, rel=1e-12) and got["mfu"] == pytest.approx(0.5, rel=1e-12)


def test_train_logs_tflops(tmp_path):
    """train.py's metrics.jsonl: tflops · 1e12 / tokens_per_s is the formula's FLOPs per token (the same window time
    divides both), to float rounding (1e-12)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    s = train.train(train.parse_args(tiny(corpus, tmp_path / "cache", tmp_path / "run", "--eval-iters", "0", iters=2)))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    per_token = metrics.flops(s.config, 8, 32) / (8 * 32)  # tiny(): global batch 8, sequence 32
    assert len(recs) == 2
    for r in recs:
        assert "mfu" not in r  # CPU: no peak
        assert r["tflops"] * 1e12 / r["tokens_per_s"] == pytest.approx(per_token, rel=1e-12)



def bench_gemm():
    """bench/bench_gemm.py, imported (its main is behind __name__ == "__main__")."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_gemm", Path(__file__).parent.parent / "bench" / "bench_gemm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gemm_weights(gemms) -> dict:
    """{(out, in): calls} of a GEMM list's forward GEMMs X·Wᵀ [T, in]·[in, out]."""
    out = {}
    for g in gemms:
        if g.name.endswith(" fwd"):
            out[g.n, g.k] = out.get((g.n, g.k), 0) + g.count
    return out


def model_weights(model) -> dict:
    """{(out, in): how many} of the model's linear weights (a tied output layer: the embedding's [V, h])."""
    out = {}
    for m in model.modules():
        if isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear, nn.Linear)):
            w = m.weight if m.weight is not None else model.embedding.word_embeddings.weight
            out[tuple(w.shape)] = out.get(tuple(w.shape), 0) + 1
    return out


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt2-like", "llama-gqa-swiglu"])
def test_bench_gemm_lists_the_models_weight_gemms(cfg):
    """bench_gemm.model_gemms, from the Config alone: its forward GEMMs are the model's linear weights, each as often
    as the model holds it (x 2 micro-batches); each forward's dgrad and wgrad are the same m·k·n; and the list's
    FLOPs plus the core attention are metrics.flops exactly (integers < 2^53: ==). Negative control: the list of a
    config that forgets SwiGLU's fused gate (gated_linear_unit False) misses fc1's [2f, h] weight and its FLOPs."""
    G, M = bench_gemm(), 2
    model = gpt.Model(gpt.Config(**cfg))
    c = model.config
    gemms = G.model_gemms(c, B, S, M)
    assert gemm_weights(gemms) == {k: M * v for k, v in model_weights(model).items()}
    for fwd, dgrad, wgrad in zip(gemms[0::3], gemms[1::3], gemms[2::3]):
        assert sorted((fwd.m, fwd.k, fwd.n)) == sorted((dgrad.m, dgrad.k, dgrad.n)) == sorted((wgrad.m, wgrad.k,
                                                                                               wgrad.n))
    attention = 3 * c.num_layers * core(B * M, c.num_attention_heads, S, S, c.kv_channels, c.kv_channels, causal=True)
    assert sum(g.count * g.flops for g in gemms) + attention == metrics.flops(c, B * M, S)
    if c.gated_linear_unit:
        wrong = G.model_gemms(dataclasses.replace(c, gated_linear_unit=False), B, S, M)
        assert gemm_weights(wrong) != {k: M * v for k, v in model_weights(model).items()}
        assert sum(g.count * g.flops for g in wrong) + attention != metrics.flops(c, B * M, S)


def test_bench_gemm_counts_muons_newton_schulz():
    """bench_gemm.newton_schulz_flops, from the Config alone: torch's FLOP counter over parallel.newton_schulz on
    every Muon matrix of the model (muon_eligible), at 5 and 3 steps. Negative control: a count that forgets the
    transpose to the small Gram side (m <= n) is far off for the MLP's [2f, h] and [h, f] matrices."""
    G = bench_gemm()
    model = gpt.Model(gpt.Config(**LLAMA))
    for steps in (5, 3):
        with FlopCounterMode(display=False) as counter:
            for p in model.parameters():
                if P.muon_eligible(p):
                    P.newton_schulz(p.detach(), steps)
        assert G.newton_schulz_flops(model.config, steps) == counter.get_total_flops()
    wide = sum(5 * (4 * p.shape[0] ** 2 * p.shape[1] + 2 * p.shape[0] ** 3) for p in model.parameters()
               if P.muon_eligible(p))
    assert wide > 1.2 * G.newton_schulz_flops(model.config, 5)
