"""metrics.flops (Megatron's num_floating_point_operations, megatron/training/training.py) against two independent
counts: a hand count walked over the model's own modules (every GEMM weight 2·tokens·numel, the causal core attention,
the routed experts x top-k, Megatron's scan estimate), and torch.utils.flop_counter.FlopCounterMode on a real forward
+ backward. Also the `tflops` / `mfu` that train.py logs (metrics.throughput, the peak table).

All counts are integers below 2^53 (float64 holds them exactly), so every comparison is exact (==), no tolerance.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_train import SNIPPET, tiny
from torch.utils.flop_counter import FlopCounterMode

import gpt
import mamba
import metrics
import parallel as P
import train
import transformer

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


def hand_count(model, b: int, s: int) -> int:
    """Megatron's counting rules applied to the modules the model holds: each Column/RowParallelLinear weight
    [out, in] costs 2·T·out·in (T = b·s tokens) — attention, MLP, shared expert, Mamba in/out_proj, an untied output
    layer; a tied output layer the embedding's [V, h]; core attention QKᵀ and PV 2·b·n·s²·d each, halved (causal);
    each routed expert's fc1 and fc2 per token x top-k; a Mamba mixer's scan 7·T·d_in·N (Megatron's estimate).
    Not counted (nor by Megatron): the router, norms, convolution, softmax, elementwise. x 3: forward, dgrad, wgrad."""
    c, T, n = model.config, b * s, 0
    for m in model.modules():
        if isinstance(m, (P.ColumnParallelLinear, P.RowParallelLinear)):
            w = m.weight if m.weight is not None else model.embedding.word_embeddings.weight  # tied output layer
            n += 2 * T * w.numel()
        elif isinstance(m, transformer.Attention):
            n += 2 * (2 * b * m.n * s * s * m.d) // 2
        elif isinstance(m, P.GroupedMLP):
            n += 2 * T * c.moe_router_topk * (m.linear_fc1.weight0.numel() + m.linear_fc2.weight0.numel())
        elif isinstance(m, mamba.MambaMixer):
            n += 7 * T * c.d_inner * c.mamba_state_dim
    return 3 * n


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MOE], ids=["gpt2-like", "llama-gqa-swiglu", "moe-topk-shared"])
def test_transformer_formula_equals_the_hand_count(cfg):
    model = gpt.Model(gpt.Config(**cfg))
    assert metrics.flops(model.config, B, S) == hand_count(model, B, S)


def test_hybrid_formula_equals_the_hand_count():
    model = mamba.Model(mamba.Config(**MAMBA))
    assert metrics.flops(model.config, B, S) == hand_count(model, B, S)


def test_a_wrong_formula_is_caught():
    """Negative controls: the hand count sees a formula that forgets SwiGLU's third GEMM, the top-k, the scan."""
    for cfg, wrong in [(LLAMA, dict(gated_linear_unit=False)), (MOE, dict(moe_router_topk=1))]:
        model = gpt.Model(gpt.Config(**cfg))
        assert metrics.flops(dataclasses.replace(model.config, **wrong), B, S) != hand_count(model, B, S)
    model = mamba.Model(mamba.Config(**MAMBA))
    c = model.config
    assert metrics.flops(dataclasses.replace(c, mamba_state_dim=0), B, S) != hand_count(model, B, S)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt2-like", "llama-gqa-swiglu"])
def test_flop_counter_mode_agrees(cfg):
    """torch's FlopCounterMode on a real forward + backward (float64): its matmul FLOPs (mm, addmm, bmm) are the
    formula's minus core attention exactly. Core attention goes through F.scaled_dot_product_attention, which the
    counter counts over the full s x s square (12·b·n·s²·d per layer, not Megatron's causal half) where it knows the
    kernel, and not at all for CPU's fused kernel (torch 2.13): both are accepted, nothing in between. The embedding
    lookup, norms, softmax and the cross-entropy have no matmul; Megatron does not count them either."""
    torch.manual_seed(0)
    model = gpt.Model(gpt.Config(**cfg))
    c = model.config
    ids = torch.randint(0, c.vocab_size, (B, S + 1))
    with FlopCounterMode(display=False) as fc:
        model(ids[:, :-1], ids[:, 1:]).sum().backward()
    counts = {str(op): v for op, v in fc.get_flop_counts()["Global"].items()}
    matmul = sum(v for op, v in counts.items() if op.split(".")[-1] in ("mm", "addmm", "bmm"))
    sdpa = sum(v for op, v in counts.items() if "scaled_dot_product" in op)
    assert all(op.split(".")[-1] in ("mm", "addmm", "bmm") or "scaled_dot" in op for op in counts), counts
    core = 3 * c.num_layers * 2 * B * c.num_attention_heads * c.kv_channels * S * S  # Megatron: causal, x 3
    assert matmul == metrics.flops(c, B, S) - core
    assert sdpa in (0, 2 * core)


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
    per_token = metrics.flops(s["config"], 8, 32) / (8 * 32)  # tiny(): global batch 8, sequence 32
    assert len(recs) == 2
    for r in recs:
        assert "mfu" not in r  # CPU: no peak
        assert r["tflops"] * 1e12 / r["tokens_per_s"] == pytest.approx(per_token, rel=1e-12)

