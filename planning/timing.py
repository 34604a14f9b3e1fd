"""planning/timing.py — the seconds one training iteration takes for a layout on a GPU (or this CPU): FLOPs, GEMM and
memory-bound time, α-β collectives per link, the pipeline's fill, drain and unequal stages, what overlaps, and the
optimizer step.

Mirrors the arithmetic of Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (FLOPs per iteration, its Eq. 3; the 1F1B and interleaved schedules' bubble, §2.2; Table 1, the check)
and megatron/training/training.py's FLOPs count (metrics.py here); the GPUs' figures are the vendors' data sheets.
Checked against hand-worked cases and Table 1 (tests/test_costs_time.py), against this CPU's measured steps
(bench/bench_costs.py). The formulas and their sources: DESIGN.md §12.

    step_time(c, layout, gpu) -> {"seconds_per_iteration", "tflops_per_gpu", "compute", "bubble", "idle" (per
    pipeline rank), "tp_comm", "pp_comm", "dp_exposed", "optimizer", ...}; GPUS: the presets; cpu_gpu(): this machine.

Run:    .venv/bin/python tools.py plan --gpu h100-80gb --gpus 8 --num-layers 24 --hidden-size 2048 \
            --num-attention-heads 16 --pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 32
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

import metrics
from planning.layout import BYTES, Layout
from planning.memory import params_per_rank, stage_parameters


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
    attention: float = 0.0  # the attention core's FLOP/s (cpu: its SDPA kernel's, measured; 0: at the GEMM rate)
    op: float = 0.0  # seconds an eager op costs besides its work (cpu: measured; 0 on GPUs: kernels queue ahead)


# Data sheets (DESIGN.md §12 lists them): NVIDIA A100 80GB SXM (312 TFLOP/s bf16/fp16 dense, HBM2e 2,039 GB/s, NVLink
# 600 GB/s both ways); H100 SXM5 (989 dense, HBM3 3.35 TB/s, NVLink 900 GB/s); H200 SXM (989, 141 GB HBM3e 4.8 TB/s,
# NVLink 900 GB/s); nodes of 8 with one NIC per GPU: DGX A100 / Selene (ConnectX-6 HDR 200 Gb/s, the paper's §5),
# DGX H100/H200 (ConnectX-7 NDR 400 Gb/s). Latencies: assumed (NCCL's small-message order of magnitude).
GPUS = {"a100-80gb": GPU("a100-80gb", 312e12, 2.039e12, 80e9, 300e9, 25e9),
        "h100-80gb": GPU("h100-80gb", 989e12, 3.35e12, 80e9, 450e9, 50e9),
        "h200": GPU("h200", 989e12, 4.8e12, 141e9, 450e9, 50e9)}
# Fitted on two rows of Table 1 (1.7B and 1T, tests/test_costs_time.py), tested on the other eight: the fraction of
# peak the large GEMMs reach, and how many times each activation byte (Korthikanti's count) crosses HBM per pass.
GEMM_EFFICIENCY = 0.70
HBM_PASSES = 2.42


def cpu_gpu(seconds: float = 0.3, attention_shape=(8, 8, 128, 32), clock=time.perf_counter) -> GPU:
    """This machine as a GPU, measured here with torch's threads: peak = a 2048³ fp32 GEMM's best rate / GEMM_EFFICIENCY
    (bench/bench_gemm.py's peak), memory bandwidth = a 64 MB copy's, all of RAM; the attention core's rate
    (attention_rate at [b, heads, s, d]) and an eager op's cost (op_cost); clock: time.thread_time for one thread's
    own time, which other processes' time slices on a loaded machine leave out. Its links are gloo over loopback: ~0.4 GB/s
    and ~1 ms a message, as bench/README measured ("One process vs DP 2 vs TP 2", "Pipeline bubble")."""
    a, x, y = torch.randn(2048, 2048), torch.empty(2 ** 24), torch.empty(2 ** 24)
    gemm, copy = (best_rate(f, work, seconds, clock) for f, work in ((lambda: a @ a, 2 * 2048 ** 3),
                                                                      (lambda: y.copy_(x), 2 * 4 * 2 ** 24)))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return GPU("cpu", gemm / GEMM_EFFICIENCY, copy, ram, 0.4e9, 0.4e9, per_node=os.cpu_count() or 1,
               alpha_intra=1e-3, alpha_inter=1e-3, attention=attention_rate(*attention_shape, seconds, clock),
               op=op_cost(seconds, clock))


def best_rate(f, work: float, seconds: float, clock=time.perf_counter) -> float:
    """work / the best time of f (on `clock`) over `seconds` of short bursts: a ceiling, less hurt by other processes."""
    f()
    best, end = 0.0, time.perf_counter() + seconds / 2
    while time.perf_counter() < end:
        t0 = clock()
        f()
        best = max(best, work / max(clock() - t0, 1e-9))
    return best


def attention_rate(b: int, heads: int, s: int, d: int, seconds: float = 0.3, clock=time.perf_counter) -> float:
    """FLOP/s of the causal attention core (torch's SDPA, forward and backward), counted as step_time counts it: 3x
    the forward's 4·b·s·(s/2)·heads·d."""
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    core = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return best_rate(core, 3 * 4 * b * s * s / 2 * heads * d, seconds, clock)


def op_cost(seconds: float = 0.3, clock=time.perf_counter, links: int = 50) -> float:
    """Seconds per eager op: a chain of `links` tiny silu(y·1.01) through autograd, forward and backward, over its
    4·links + 4 top-level aten ops (mul, silu, and in backward mul, silu_backward each; sum, ones_like, expand, add_)."""
    w = torch.ones(8, requires_grad=True)

    def chain():
        y = w
        for _ in range(links):
            y = torch.nn.functional.silu(y * 1.01)
        y.sum().backward()
    return 1 / best_rate(chain, 4 * links + 4, seconds, clock)


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


def pipeline(stages: list[float], m: int, v: int = 1) -> tuple[float, float, list[float]]:
    """(compute, bubble, idle per rank) of m micro-batches through pipeline ranks whose forward and backward of one
    micro-batch (all v chunks) take stages[r] = T_r seconds. 1F1B: the slowest rank runs its m micro-batches back to
    back; before its first, the first micro-batch's forward crosses the ranks before it, after its last, the last
    one's backward crosses them back: iteration = (m − 1)·max T + Σ T_r, so compute m·max T and bubble Σ T_r − max T.
    Exact for 1F1B when the slowest rank is the last (this model's: alike layers, the output layer on the last);
    with equal stages it is the paper's (p − 1)·(t_f + t_b), (p − 1)/m of the compute (Narayanan et al. 2021, §2.2).
    Interleaved (v chunks a rank): the fill and drain cross chunks 1/v as long, bubble (Σ T_r − max T)/v, the paper's
    (p − 1)/(m·v) when equal. Rank r idles the iteration less its own work: the bubble plus m·(max T − T_r), its
    wait for the slower stage (tests/test_costs_time.py simulates the 1F1B schedule; DESIGN.md §12, "Pipeline")."""
    slow = max(stages)
    compute, bubble = m * slow, (sum(stages) - slow) / v
    return compute, bubble, [compute + bubble - m * x for x in stages]


def step_time(c, layout: Layout, gpu: GPU, paper: bool = False, n_params: int | None = None,
              overlap: bool | None = None) -> dict:
    """Seconds per iteration on the slowest rank, and its parts (DESIGN.md §12). paper=True: as Narayanan et al.
    2021 ran (the attention core over the whole s×s square, no flash attention; nothing overlapped); else the core is
    causal (flash attention), CP's exchange overlaps the core and, with `overlap` (--overlap-grad-reduce; default:
    not paper), the DP reduction the last micro-batch's backward. tflops_per_gpu counts flops_per_iteration as
    Megatron's papers do (Eq. 3 for paper=True). n_params: the largest rank's parameters (params_per_rank), if known."""
    lo = layout
    t, p, v, d, cp, e, b, m = lo.tp, lo.pp, lo.vpp, lo.dp, lo.cp, lo.ep, lo.micro_batch, lo.micro_batches
    h, a, s, L, V = c.hidden_size, c.num_attention_heads, lo.seq / cp, c.num_layers, c.padded_vocab_size
    by, sp, full = BYTES[lo.dtype], lo.sequence_parallel, lo.recompute == "full"
    passes = 4 if full else 3  # forward, backward's two GEMMs per forward one (dgrad, wgrad), recomputed forward
    # one layer's forward and backward for one micro-batch (FLOPs at the GEMM rate, activation bytes at HBM's), the logits'
    moe = [c.is_moe_layer(i) for i in range(L)] if c.num_experts else [False] * L
    dense = b * s * 2 * (metrics.self_attention_flops(c, lo.seq, causal=not paper)  # one layer, FLOPs forward
                         + sum(metrics.mlp_flops(c, x) for x in moe) / L)
    core = 4 * b * s * (lo.seq if paper else lo.seq / 2) * a * c.kv_channels  # QKᵀ and PV (inside `dense` too)
    # Korthikanti's activation bytes per layer; the 5·a·s² of the score matrices only without flash attention (paper)
    scores = 5 * a * s * s * b / t * by / 2 if paper else 0
    acts = b * s * h * (34 / t if sp else 10 + 24 / t) * by / 2 + scores
    sel = 1 if lo.recompute == "selective" else 0
    layer = (dense * passes + core * sel) / (t * gpu.peak * GEMM_EFFICIENCY) + \
        HBM_PASSES * (acts * passes + scores * sel) / gpu.hbm
    logits = (6 * b * s * h * V / t) / (gpu.peak * GEMM_EFFICIENCY) + HBM_PASSES * 3 * b * s * V / t * 4 / gpu.hbm
    if gpu.attention:  # the core at its kernel's own rate, not the GEMMs'
        layer += core * (passes + sel) / t * (1 / gpu.attention - 1 / (gpu.peak * GEMM_EFFICIENCY))
    layer, logits = layer + EAGER_OPS["layer"] * gpu.op, logits + EAGER_OPS["micro_batch"] * gpu.op
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
    # one micro-batch's forward and backward on each pipeline rank: its L/p layers (all v chunks); the last one also
    # the output layer and the loss (its embedding, the first rank's, is a lookup: not counted)
    layers = L / p * (layer + tp_layer + cp_exposed) + moe_layers / p * ep_layer
    stages = [layers + logits * (r == p - 1) for r in range(p)]
    per_mb = max(stages)
    # pipeline: each chunk sends its output forward and receives its gradient back: 2·v sends per micro-batch,
    # inter-node once t·d·cp fills a node; the paper's scatter-gather (its §4.1): each of the t ranks sends 1/t
    inter_p = t * d * cp >= gpu.per_node
    send = 0.0 if p == 1 else (gpu.alpha_inter if inter_p else gpu.alpha_intra) + \
        act_bytes / t / (gpu.ib if inter_p else gpu.nvlink) + (0 if sp else act_bytes * (t - 1) / t / tbw)
    pp_comm = 2 * v * send * m
    # tied embeddings: the first and last stages all-reduce the word embedding's fp32 gradient [V/t, h] once an
    # iteration, after the flush (Megatron's finalize_model_grads: _allreduce_word_embedding_grads), over the PP link
    tied = 0.0 if p == 1 or not c.share_embeddings_and_output_weights else allreduce_time(
        4 * V / t * h, 2, gpu.ib if inter_p else gpu.nvlink, gpu.alpha_inter if inter_p else gpu.alpha_intra)
    compute, bubble, idle = pipeline(stages, m, v)
    # data parallelism: the gradients (fp32 main grads) all-reduced, or reduce-scattered and the 16-bit parameters
    # all-gathered (distributed optimizer); over NVLink inside a node, else over the NICs of the group's members there
    n_params = n_params or params_per_rank(c, lo)
    g = max(1, min(d, gpu.per_node // (t * cp) if t * cp <= gpu.per_node else 1))
    inter_d = t * cp * d > gpu.per_node
    dbw, dalpha = (gpu.ib * g, gpu.alpha_inter) if inter_d else (gpu.nvlink, gpu.alpha_intra)
    grads = n_params * 4
    rs, ag = allreduce_time(grads, d, dbw, dalpha) / 2, allreduce_time(n_params * by, d, dbw, dalpha) / 2
    hide = not paper if overlap is None else overlap
    if lo.sharding == "no_shard":
        dp = 2 * rs if not lo.distributed_optimizer else rs + ag
        dp_exposed = max(0.0, dp - per_mb * 2 / passes) if hide else dp
    else:  # Megatron-FSDP: each micro-batch's gradients reduce-scattered during its backward; ZeRO-3 also all-gathers
        # each layer's parameters before its forward and again before its backward, the next layer's prefetched; ZeRO-2
        # all-gathers the updated parameters once after the step, as the distributed optimizer (section 14 of parallel.py)
        zero3 = lo.sharding == "optim_grads_params"
        per_mb_comm = rs + 2 * ag * zero3
        dp = m * per_mb_comm + ag * (not zero3)
        first = ag / (L / p) if zero3 else ag  # what no compute hides: the first layer's gather, or the last all-gather
        dp_exposed = m * max(0.0, per_mb_comm - per_mb) + first if hide else dp
    optimizer = optimizer_time(c, lo, gpu, n_params)
    total = compute + bubble + pp_comm + tied + dp_exposed + optimizer
    counted = flops_per_iteration(c, lo, causal=not paper)
    return {"seconds_per_iteration": total, "tflops_per_gpu": counted / total / lo.world / 1e12,
            "flops": counted, "compute": compute, "bubble": bubble, "bubble_fraction": bubble / compute,
            "stages": stages, "idle": idle,
            "tp_comm": m * L / p * tp_layer, "cp_comm": m * L / p * cp_layer, "ep_comm": m * moe_layers / p * ep_layer,
            "pp_comm": pp_comm, "tied_comm": tied, "dp_comm": dp, "dp_exposed": dp_exposed, "optimizer": optimizer}


# Eager PyTorch (a device with op > 0: this CPU) runs each op alone: a fixed cost each and a pass over its operands.
# Top-level aten ops, counted with torch.profiler on train.py's steps (DESIGN.md §12): a layer's forward and backward,
# a micro-batch's rest (embedding, output layer, loss, the step's own), per tensor the step of AdamW and of Muon, the
# clip and zero_grad. Bytes an element, read + written (fp32), of the eager optimizer: torch's single-tensor AdamW
# (mul_ 8, lerp_ 12, mul_ + addcmul_ 24, sqrt, div, add_ 24, addcdiv_ 16); the clip's fp64 square-sum (36), its scaling
# (8) and zero_grad (4); Muon on its shard (momentum 20, Nesterov's update 20, weight decay 8, the update 12) and the
# whole matrix (the normalization 12, each Newton-Schulz step's three elementwise passes 20, the scale 8).
EAGER_OPS = {"layer": 145, "micro_batch": 99, "adam": 10, "clip": 10, "muon": 60}
EAGER_BYTES = {"adam": 84, "clip": 48, "muon_shard": 60, "muon_whole": 20 + 20 * 5}
NS_STEPS = 5  # Muon's Newton-Schulz iterations (parallel.Muon's and Megatron's default)


def optimizer_time(c, lo: Layout, gpu: GPU, n_params: int) -> float:
    """The optimizer step on the rank with the most parameters: Adam fused (a GPU) reads and writes ~30 bytes a
    parameter (fp32 master, grad, moments; the 16-bit copy); eager (op > 0) each op a pass (EAGER_BYTES) and a fixed
    cost (EAGER_OPS). Muon: the Newton-Schulz GEMMs of each whole hidden matrix [m, n], m <= n, NS_STEPS x (4·m²·n +
    2·m³) at the GEMM rate (every rank orthogonalizes whole matrices), its TP shards all-gathered first
    (parallel.orthogonalized)."""
    shard = lo.dp if lo.distributed_optimizer or lo.sharding != "no_shard" else 1
    if lo.optimizer != "muon" and not gpu.op:
        return 30 * n_params / shard / gpu.hbm
    r = max({0, lo.pp - 1}, key=lambda r: sum(p.numel for p in stage_parameters(c, lo, r)))
    ps, whole = stage_parameters(c, lo, r), stage_parameters(c, dataclasses.replace(lo, tp=1), r)  # (same order)
    mats = [(p.numel, w.numel) for p, w in zip(ps, whole) if p.muon and lo.optimizer == "muon"]
    h, by, n = c.hidden_size, BYTES[lo.dtype], sum(p.numel for p in ps)
    sides = [sorted((h, k // h)) for _, k in mats]  # each as [h, numel/h] (dense layers'; MLA's, MoE's an estimate)
    ns = sum(NS_STEPS * (4 * m * m * k + 2 * m ** 3) for m, k in sides) / (gpu.peak * GEMM_EFFICIENCY)
    tbw, talpha = (gpu.nvlink, gpu.alpha_intra) if lo.tp <= gpu.per_node else (gpu.ib, gpu.alpha_inter)
    gather = sum(allreduce_time(k * by, lo.tp, tbw, talpha) / 2 for _, k in mats)
    adam = n - sum(k for k, _ in mats)  # AdamW's elements
    if not gpu.op:
        return 30 * n / shard / gpu.hbm + ns + gather
    E, O = EAGER_BYTES, EAGER_OPS
    moved = E["adam"] * adam / shard + E["clip"] * n + sum(E["muon_shard"] * k + E["muon_whole"] * w for k, w in mats)
    ops = O["adam"] * (len(ps) - len(mats)) + O["clip"] * len(ps) + O["muon"] * len(mats)
    return moved / gpu.hbm + ops * gpu.op + ns + gather

