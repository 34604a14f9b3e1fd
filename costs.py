"""costs.py — what a parallel layout costs: memory per rank and time per iteration, and the planner that ranks layouts.

Mirrors the arithmetic of Megatron-LM's papers (no single Megatron file does this; the closest are
megatron/training/theoretical_memory_usage.py and the FLOPs formula in megatron/training/training.py):
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (activations);
  Rajbhandari et al. 2020, "ZeRO" (parameters, gradients, optimizer state);
  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (FLOPs per iteration, Eq. 3; pipeline bubble (p-1)/(m·v); Table 1).
Every byte the memory model predicts for this CPU is checked against bytes measured here (tests/test_costs_memory.py);
the time model against the paper's Table 1 (tests/test_costs_time.py, bench/README "Cost model").

Dimension glossary: s sequence, b micro-batch, h hidden, a heads, L layers, V padded vocabulary, t TP, p PP,
v virtual stages per rank, d DP, c CP, e EP, m micro-batches per iteration (global batch / (b·d)).

Run:    .venv/bin/python tools.py plan --help
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

import metrics


# ---------------------------------------------------------------------------------------------- 1. the layout
# Megatron's names for each field (the planner's JSON uses them).
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "vpp": "num_virtual_stages_per_pipeline_rank", "dp": "data_parallel_size",
                  "cp": "context_parallel_size", "ep": "expert_model_parallel_size", "micro_batch": "micro_batch_size",
                  "global_batch": "global_batch_size", "sequence_parallel": "sequence_parallel",
                  "recompute": "recompute_granularity", "distributed_optimizer": "use_distributed_optimizer"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one training run is split over world = tp·pp·dp·cp ranks (EP splits the experts inside dp·cp)."""
    seq: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    sequence_parallel: bool = False
    recompute: str | None = None  # None | "selective" | "full"
    distributed_optimizer: bool = False
    optimizer: str = "adam"  # "adam" | "muon" | "sgd"
    dtype: str = "fp32"  # the parameters' and activations' dtype: "fp32" | "bf16" | "fp16" (16-bit keeps fp32 main grads)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def micro_batches(self) -> int:  # m
        return self.global_batch // (self.micro_batch * self.dp)


# ---------------------------------------------------------------------------------------------- 2. memory per rank
# memory(c, layout, accounting) -> dict of bytes on the rank that holds the most (keys: "parameters", "gradients",
# "optimizer", "activations", "total"); accounting "cpu" is what this CPU keeps (fp32, fp32 dropout masks),
# "gpu" the 16-bit accounting of the paper. kv_cache_bytes(c, batch, seq, dtype_bytes) for serving.


# ---------------------------------------------------------------------------------------------- 3. time per iteration
@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator and its links: bytes/s per direction per GPU; alpha: a message's latency (α-β model)."""
    name: str
    peak: float  # dense 16-bit tensor-core FLOP/s (cpu: its measured fp32 GEMM rate)
    hbm: float  # memory bandwidth, bytes/s
    memory: float  # bytes
    nvlink: float  # intra-node, per GPU
    ib: float  # inter-node, per GPU (one NIC each)
    per_node: int = 8
    alpha_intra: float = 5e-6
    alpha_inter: float = 10e-6


# Data sheets (DESIGN.md §13 lists them): NVIDIA A100 80GB SXM (312 TFLOP/s bf16/fp16 dense, HBM2e 2,039 GB/s, NVLink
# 600 GB/s both ways); H100 SXM5 (989 dense, HBM3 3.35 TB/s, NVLink 900 GB/s); H200 SXM (989, 141 GB HBM3e 4.8 TB/s,
# NVLink 900 GB/s); nodes of 8 with one NIC per GPU: DGX A100 / Selene (ConnectX-6 HDR 200 Gb/s, the paper's §5),
# DGX H100/H200 (ConnectX-7 NDR 400 Gb/s). Latencies: assumed (NCCL's small-message order of magnitude).
GPUS = {"a100-80gb": GPU("a100-80gb", 312e12, 2.039e12, 80e9, 300e9, 25e9),
        "h100-80gb": GPU("h100-80gb", 989e12, 3.35e12, 80e9, 450e9, 50e9),
        "h200": GPU("h200", 989e12, 4.8e12, 141e9, 450e9, 50e9)}
# Fitted on two rows of Table 1 (1.7B and 1T, tests/test_costs_time.py), tested on the other eight: the fraction of
# peak the large GEMMs reach, and how many times each activation byte (Korthikanti's count) crosses HBM per pass.
GEMM_EFFICIENCY = 0.71
HBM_PASSES = 2.45


def cpu_gpu(seconds: float = 0.3) -> GPU:
    """This machine as a GPU: peak = torch's measured fp32 GEMM rate (bench/bench_gemm.py's ceiling, one square
    2048³ GEMM here), all of RAM, gloo over loopback for every link (bench/README "Cost model": measured)."""
    a = torch.randn(2048, 2048)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        n += 1
    rate = n * 2 * 2048 ** 3 / (time.perf_counter() - t0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return GPU("cpu", rate / GEMM_EFFICIENCY, 10e9, ram, 2e9, 2e9, per_node=os.cpu_count() or 1,
               alpha_intra=50e-6, alpha_inter=50e-6)


def bytes_per_value(layout: Layout) -> int:
    return 4 if layout.dtype == "fp32" else 2


def flops_per_iteration(c, layout: Layout, causal: bool = True) -> float:
    """metrics.flops with the recomputation's extra forward: full, every layer's (not the output layer's: Eq. 3's
    V/(16lh) term has no recomputation); selective, the attention core's. causal=False: the core over the whole
    s×s square, as the paper's Eq. 3 counts it (and as its kernels ran it)."""
    B, s, L = layout.global_batch, layout.seq, c.num_layers
    f = metrics.flops(c, B, s)
    if not causal:  # the core over all s keys instead of s/2
        f += 6 * B * s * L * (metrics.self_attention_flops(c, s, False) - metrics.self_attention_flops(c, s, True))
    core = 2 * B * s * L * 2 * (s if not causal else s / 2) * c.num_attention_heads * c.kv_channels
    moe = [c.is_moe_layer(i) for i in range(L)] if c.num_experts else [False] * L
    layers = 2 * B * s * sum(metrics.self_attention_flops(c, s, causal) + metrics.mlp_flops(c, x) for x in moe)
    return f + {"full": layers, "selective": core}.get(layout.recompute, 0.0)


def allreduce_time(n_bytes: float, ranks: int, bw: float, alpha: float) -> float:
    """Ring all-reduce (Patarasuk & Yuan 2009; NCCL's ring): 2(n-1) steps, each moving n_bytes/n over each link."""
    return 0.0 if ranks == 1 else 2 * (ranks - 1) * (alpha + n_bytes / ranks / bw)


def step_time(c, layout: Layout, gpu: GPU, paper: bool = False) -> dict:
    """Seconds per iteration on the slowest rank, and its parts. paper=True: as Narayanan et al. 2021 ran (the
    attention core over the whole s×s square, no flash attention; nothing overlapped); else the core is causal
    and the DP reduction overlaps the last micro-batch's backward (--overlap-grad-reduce), CP's exchange the core.
    tflops_per_gpu counts flops_per_iteration as Megatron's papers do (Eq. 3 for paper=True)."""
    lo = layout
    t, p, v, d, cp, e, b, m = lo.tp, lo.pp, lo.vpp, lo.dp, lo.cp, lo.ep, lo.micro_batch, lo.micro_batches
    h, a, s, L, V = c.hidden_size, c.num_attention_heads, lo.seq / cp, c.num_layers, c.padded_vocab_size
    by, sp, full = bytes_per_value(lo), lo.sequence_parallel, lo.recompute == "full"
    passes = 4 if full else 3  # forward, backward's two GEMMs per forward one (dgrad, wgrad), recomputed forward
    # compute of one micro-batch on one rank: its L/p layers (all v chunks) and, on the last stage, the logits
    moe = [c.is_moe_layer(i) for i in range(L)] if c.num_experts else [False] * L
    dense = b * s * 2 * (metrics.self_attention_flops(c, lo.seq, causal=not paper)  # one layer, FLOPs forward
                         + sum(metrics.mlp_flops(c, x) for x in moe) / L)
    core = 4 * b * s * (lo.seq if paper else lo.seq / 2) * a * c.kv_channels  # QKᵀ and PV (inside `dense` too)
    acts = b * s * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t)) * by / 2  # Korthikanti's bytes per layer
    sel = 1 if lo.recompute == "selective" else 0
    layer = (dense * passes + core * sel) / (t * gpu.peak * GEMM_EFFICIENCY) + \
        HBM_PASSES * (acts * passes + 5 * a * s * s * b * by / 2 / t * sel) / gpu.hbm
    logits = (6 * b * s * h * V / t) / (gpu.peak * GEMM_EFFICIENCY) + HBM_PASSES * 3 * b * s * V / t * 4 / gpu.hbm
    # tensor parallelism: 2 all-reduces per layer forward, 2 backward, 2 more recomputing (SP: a reduce-scatter and
    # an all-gather each, the same volume, and one more all-gather per column-parallel linear in backward)
    intra_t = t <= gpu.per_node
    tbw, talpha = (gpu.nvlink, gpu.alpha_intra) if intra_t else (gpu.ib, gpu.alpha_inter)
    act_bytes = b * s * h * by
    tp_layer = ((2 + full) * 2 + sp) * allreduce_time(act_bytes, t, tbw, talpha)  # (SP: 2 all-gathers = 1)
    # context parallelism: the K/V ring, forward once and backward twice (dK, dV), overlapped with the core
    kv = 2 * b * s * c.num_query_groups * c.kv_channels / t * by
    cp_layer = 3 * (cp - 1) * (gpu.alpha_intra + kv / gpu.nvlink)
    cp_exposed = max(0.0, cp_layer - core * passes / (t * gpu.peak * GEMM_EFFICIENCY) / cp) if not paper else cp_layer
    # expert parallelism: dispatch and combine all-to-alls of the top-k tokens' hidden states, forward and backward
    moe_layers = sum(c.is_moe_layer(i) for i in range(L)) if c.num_experts else 0
    ep_layer = 0.0 if e == 1 else (2 + full) * 2 * (e - 1) / e * (
        gpu.alpha_inter + b * s * c.moe_router_topk * h * by / (gpu.ib if t * e > gpu.per_node else gpu.nvlink))
    per_mb = L / p * (layer + tp_layer + cp_exposed) + moe_layers / p * ep_layer + logits
    # pipeline: each chunk sends its output forward and receives its gradient back: 2·v sends per micro-batch,
    # inter-node once t·d·cp fills a node; the paper's scatter-gather (its §4.1): each of the t ranks sends 1/t
    inter_p = t * d * cp >= gpu.per_node
    send = 0.0 if p == 1 else (gpu.alpha_inter if inter_p else gpu.alpha_intra) + \
        act_bytes / t / (gpu.ib if inter_p else gpu.nvlink) + (0 if sp else act_bytes * (t - 1) / t / tbw)
    pp_comm = 2 * v * send * m
    compute = m * per_mb
    bubble = (p - 1) / (m * v) * compute  # 1F1B / interleaved: (p-1)/(m·v) of the ideal time (the paper's §2.2)
    # data parallelism: the gradients (fp32 main grads) all-reduced, or reduce-scattered and the 16-bit parameters
    # all-gathered (distributed optimizer); over NVLink inside a node, else over the NICs of the group's members there
    n_params = params_per_rank(c, lo)
    g = max(1, min(d, gpu.per_node // (t * cp) if t * cp <= gpu.per_node else 1))
    inter_d = t * cp * d > gpu.per_node
    dbw, dalpha = (gpu.ib * g, gpu.alpha_inter) if inter_d else (gpu.nvlink, gpu.alpha_intra)
    grads = n_params * 4
    dp = allreduce_time(grads, d, dbw, dalpha) if not lo.distributed_optimizer else \
        allreduce_time(grads, d, dbw, dalpha) / 2 + allreduce_time(n_params * by, d, dbw, dalpha) / 2
    dp_exposed = dp if paper else max(0.0, dp - per_mb * 2 / passes)
    # the optimizer step: Adam reads and writes ~30 bytes a parameter (fp32 master, grad, moments; the 16-bit copy)
    optimizer = 30 * n_params / (d if lo.distributed_optimizer else 1) / gpu.hbm
    total = compute + bubble + pp_comm + dp_exposed + optimizer
    counted = flops_per_iteration(c, lo, causal=not paper)
    return {"seconds_per_iteration": total, "tflops_per_gpu": counted / total / lo.world / 1e12,
            "flops": counted, "compute": compute, "bubble": bubble, "bubble_fraction": (p - 1) / (m * v),
            "tp_comm": m * L / p * tp_layer, "cp_comm": m * L / p * cp_layer, "ep_comm": m * moe_layers / p * ep_layer,
            "pp_comm": pp_comm, "dp_comm": dp, "dp_exposed": dp_exposed, "optimizer": optimizer}


def params_per_rank(c, layout: Layout) -> float:
    """Parameters on the rank holding the most: its L/p layers' share over TP (experts over EP) and the embedding."""
    h, L, t = c.hidden_size, c.num_layers, layout.tp
    attn = metrics.self_attention_flops(c, 0, causal=True)  # multiply-adds per token = weights, with s = 0
    mlp = metrics.mlp_flops(c, False)
    layer = (attn + mlp) / t + 4 * h  # (norms, biases)
    return L / layout.pp * layer + c.padded_vocab_size * h / t


# ---------------------------------------------------------------------------------------------- 4. the planner
# plan(c, gpu, gpus, ...) -> the layouts that fit, best predicted throughput first (tools.py plan prints them).
