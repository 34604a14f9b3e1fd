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
import math
import os
import time
import typing

import torch

import metrics
import parallel as P

# ---------------------------------------------------------------------------------------------- 1. the layout
# Megatron's names for each field (the planner's JSON uses them).
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "vpp": "num_virtual_stages_per_pipeline_rank", "dp": "data_parallel_size",
                  "cp": "context_parallel_size", "ep": "expert_model_parallel_size", "micro_batch": "micro_batch_size",
                  "global_batch": "global_batch_size", "sequence_parallel": "sequence_parallel",
                  "recompute": "recompute_granularity", "distributed_optimizer": "use_distributed_optimizer",
                  "sharding": "data_parallel_sharding_strategy"}


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
    sharding: str = "no_shard"  # --use-megatron-fsdp's: "optim_grads" (ZeRO-2), "optim_grads_params" (ZeRO-3)
    optimizer: str = "adam"  # "adam" | "muon" | "sgd"
    dtype: str = "fp32"  # the parameters' and activations' dtype: "fp32" | "bf16" | "fp16" (16-bit keeps fp32 main grads)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def micro_batches(self) -> int:  # m
        return self.global_batch // (self.micro_batch * self.dp)


# ---------------------------------------------------------------------------------------------- 2. memory per rank
# memory(c, layout, accounting) -> bytes on the pipeline rank that holds the most: "parameters", "gradients",
# "optimizer", "activations", "total" (+ "stage", that rank). accounting "cpu" is what this CPU keeps, checked to the
# byte (tests/test_costs_memory.py); "gpu" is the papers' 16-bit accounting (Korthikanti et al. 2022, Table 2;
# Megatron's theoretical_memory_usage.py), DESIGN.md §6 lists both and where they differ.
# kv_cache_bytes(c, batch, seq, dtype_bytes, tp) for serving.
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class Param(typing.NamedTuple):
    """One parameter of one rank: its element count, and what the optimizers and DDP's buckets ask of it."""
    numel: int
    muon: bool = False  # parallel.muon_eligible: a hidden matrix
    group: str = "dense"  # DDP's bucket: "dense" (over dp·cp), "expert" (over expert_dp), "tied" (the stages' copy)
    fp32: bool = False  # kept in fp32 whatever the dtype (the MoE router)


def layer_parameters(c, layout: Layout, i: int) -> list[Param]:
    """Global layer i's parameters on one TP (and EP) rank, in the model's order (transformer.TransformerLayer;
    deepseek.MLASelfAttention with multi-latent attention)."""
    t, h, n, g, d, f = layout.tp, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, \
        c.ffn_hidden_size
    norm = lambda size: [Param(size)] * (2 if c.normalization == "LayerNorm" else 1)  # weight (+ bias)
    bias = lambda size, on: [Param(size)] if on else []
    if c.multi_latent_attention:  # the down projections replicated (whole on every TP rank), the up ones split
        qd, rq, rkv = c.qk_head_dim + c.qk_pos_emb_head_dim, c.q_lora_rank, c.kv_lora_rank
        ps = norm(h) + ([Param(n * qd // t * h, True)] if rq is None else  # linear_q_proj, or q's down, norm, up
                        [Param(rq * h, True)] + norm(rq) + [Param(n * qd // t * rq, True)])
        ps += [Param((rkv + c.qk_pos_emb_head_dim) * h, True)] + norm(rkv)  # linear_kv_down_proj, kv_layernorm
        ps += [Param(n * (c.qk_head_dim + c.v_head_dim) // t * rkv, True)]  # linear_kv_up_proj
        ps += [Param(n * c.v_head_dim // t * h, True)] + bias(h, c.add_bias_linear) + norm(h)  # linear_proj, pre-MLP
    else:
        ps = norm(h) + [Param(h * (n + 2 * g) * d // t, True)] + bias((n + 2 * g) * d // t, c.add_qkv_bias)  # QKV
        ps += [Param(n * d // t * h, True)] + bias(h, c.add_bias_linear)  # linear_proj
        ps += (norm(d) + norm(d) if c.qk_layernorm else []) + norm(h)  # q/k norms, pre_mlp_layernorm
    up = 2 if c.gated_linear_unit else 1  # SwiGLU's fc1 is [gate; up]
    if not c.is_moe_layer(i):  # the MLP: fc1 [up·f/t, h], fc2 [h, f/t]
        return ps + [Param(up * f // t * h, True)] + bias(up * f // t, c.add_bias_linear) + \
            [Param(h * f // t, True)] + bias(h, c.add_bias_linear)
    E, fe, etp = c.num_experts, c.moe_ffn_hidden_size, layout.tp  # experts split over TP as the MLP (etp = tp)
    ps += [Param(E * h, True, fp32=True)] + ([Param(E, fp32=True)] if c.add_bias_linear else [])  # the router
    ps += [Param(up * fe // etp * h, True, "expert")] * (E // layout.ep) + [Param(h * fe // etp, True, "expert")] * \
        (E // layout.ep)  # experts.linear_fc1.weight0..., then linear_fc2's
    if c.moe_shared_expert_intermediate_size:
        fs = c.moe_shared_expert_intermediate_size
        ps += ([Param(h, True)] if c.moe_shared_expert_gate else []) + [Param(up * fs // t * h, True)] + \
            bias(up * fs // t, c.add_bias_linear) + [Param(h * fs // t, True)] + bias(h, c.add_bias_linear)  # (gate first)
    return ps


def chunks(c, layout: Layout, stage: int) -> list[tuple[bool, bool, range]]:
    """(pre_process, post_process, global layers) of each virtual chunk on pipeline rank `stage` (parallel.stage_layers)."""
    p, v = layout.pp, layout.vpp
    per = c.num_layers // (p * v)  # layers per chunk
    first = lambda k: k * (c.num_layers // v) + stage * per  # chunk k's first global layer
    return [(stage == 0 and k == 0, stage == p - 1 and k == v - 1, range(first(k), first(k) + per)) for k in range(v)]


def stage_parameters(c, layout: Layout, stage: int, by_unit: bool = False) -> list[Param]:
    """Every parameter pipeline rank `stage` holds: embedding (first chunk), layers, final norm and output layer
    (last chunk; the tied embedding's copy when the first chunk is elsewhere), in the model's order (gpt.Model).
    by_unit: as parallel.FSDP's units instead, a list per layer then per chunk one of the rest."""
    t, h, V, D = layout.tp, c.hidden_size, c.padded_vocab_size, c.mtp_num_layers or 0
    tied = c.share_embeddings_and_output_weights
    norm = [Param(h)] * (2 if c.normalization == "LayerNorm" else 1)
    ps, units = [], []
    for pre, post, layers in chunks(c, layout, stage):
        head, tail, mtp = [], [], []
        if pre or post and D:  # (MTP: the last stage embeds too; both ends' embeddings are one, synced as a tied one)
            group = "tied" if (tied or D) and pre != post else "dense"
            head.append(Param(V // t * h, group=group))  # word embeddings [V/t, h]
            head += [Param(c.max_position_embeddings * h, group="tied" if D and pre != post else "dense")] \
                if c.position_embedding_type == "learned_absolute" else []
            head += [Param(c.num_tokentypes * h)] if c.num_tokentypes else []
        ps += head
        for i in layers:
            units.append(layer_parameters(c, layout, i))
            ps += units[-1]
        if post:
            tail += norm  # final_layernorm
            if not (tied and head):  # output layer [V/t, h]: its own weight, or the tied embedding's last-stage copy
                tail.append(Param(V // t * h, group="tied" if tied else "dense"))
            for _ in range(D):  # deepseek.MTPLayer: enorm, hnorm, eh_proj [h/t, 2h], the last layer's kind, its norm
                mtp.append(norm + norm + [Param(h // t * 2 * h, True)] + layer_parameters(c, layout, c.num_layers - 1)
                           + norm)
        ps += tail + [p for depth in mtp for p in depth]
        units += mtp + [head + tail]
    return units if by_unit else ps


def buckets(ps: list[Param], layout: Layout, bucket_size: int = 4_000_000) -> list[tuple[int, int]]:
    """(size, group size) of DDP's buckets (parallel.DDP: parameters in reverse order, a bucket closed at bucket_size elements,
    padded to a multiple of its group's size: dp·cp, experts expert_dp = dp/ep·cp)."""
    out = []
    for group, limit in (("dense", bucket_size), ("expert", bucket_size), ("tied", math.inf)):
        size = layout.dp * layout.cp // (layout.ep if group == "expert" else 1)
        n, members = 0, [p for p in reversed(ps) if p.group == group]
        for k, p in enumerate(members):
            n += p.numel
            if n >= limit or k == len(members) - 1:
                out.append((-(-n // size) * size, size))
                n = 0
    return out


def fsdp_buckets(c, layout: Layout, stage: int) -> list[tuple[int, int]]:
    """(size, group size) of parallel.FSDP's buckets: one per unit (each layer; each chunk's rest) and group (dense over
    dp·c, experts over expert_dp, the tied embedding its own), padded to a multiple of the group's size."""
    out = []
    for unit in stage_parameters(c, layout, stage, by_unit=True):
        for group in ("dense", "expert", "tied"):
            size = layout.dp * layout.cp // (layout.ep if group == "expert" else 1)
            n = sum(p.numel for p in unit if p.group == group)
            out += [(-(-n // size) * size, size)] if n else []
    return out


def state_bytes(c, layout: Layout, stage: int, accounting: str = "gpu") -> dict:
    """Parameters, gradients and optimizer state on pipeline rank `stage` (Rajbhandari et al. 2020, ZeRO; DESIGN.md
    §4): fp32 main grads and fp32 master weights for 16-bit parameters; AdamW's two fp32 moments, Muon's one momentum
    on its matrices ("gpu"; this CPU's parallel.Muon keeps AdamW's layout, two); the distributed optimizer keeps
    master weights and moments for its 1/(d·c) slice of each padded bucket (parallel.DDP's flat buffers); ZeRO-2
    (sharding optim_grads) also only that slice of the gradients, ZeRO-3 (optim_grads_params) of the parameters too,
    over parallel.FSDP's per-layer buckets; "gpu" adds ZeRO-3's two gathered buckets at a time (the one computing, the
    next prefetched: the largest, twice), which this CPU's count leaves out (it is taken between layers)."""
    ps, B, gpu = stage_parameters(c, layout, stage), BYTES[layout.dtype], accounting == "gpu"
    low = B < 4  # 16-bit parameters
    moments = lambda p: {"sgd": 0, "adam": 2, "muon": 1 if p.muon and gpu else 2}[layout.optimizer]
    own = lambda p: 4 if p.fp32 else B  # (the MoE router is fp32 whatever the dtype)
    zero = layout.sharding in ("optim_grads", "optim_grads_params")
    if not (layout.distributed_optimizer or zero):  # parallel.Optimizer / Muon: whole parameters; torch's AdamW keeps its
        return {"parameters": sum(p.numel * own(p) for p in ps),  # moments in the parameter's dtype
                "gradients": sum(p.numel * (4 if gpu else own(p)) for p in ps),
                "optimizer": sum(p.numel * (moments(p) * (4 if gpu else own(p)) + 4 * (gpu and own(p) < 4))
                                 for p in ps)}
    sizes = fsdp_buckets(c, layout, stage) if zero else buckets(ps, layout)
    n, shard = sum(k for k, _ in sizes), sum(k // size for k, size in sizes)  # buffer length; this rank's slices
    mean_moments = sum(p.numel * moments(p) for p in ps) / max(1, sum(p.numel for p in ps))  # (exact unless gpu Muon)
    zero3 = layout.sharding == "optim_grads_params"
    return {"parameters": (shard + 2 * max(k for k, _ in sizes) * gpu if zero3 else n) * B,
            "gradients": (shard if zero else n) * (4 if low or gpu else B),
            "optimizer": shard * 4 * low + round(shard * 4 * mean_moments)}


def layer_activations(c, layout: Layout, accounting: str = "gpu", i: int = 0, routed=None) -> int:
    """Bytes layer i keeps for backward per micro-batch (Korthikanti et al. 2022, §4 and Table 2): the paper's items
    with our dims (s/c tokens per CP rank; GQA's g key/value heads; f, SwiGLU's 2f), B bytes a value and masks 1 byte
    ("gpu"); this CPU's items (DESIGN.md §6): dropout masks of B bytes, LayerNorm's mean and rstd, and the math SDPA
    (taken with attention dropout): fp32 q·scale, kᵀ (and v, from 16-bit) and three fp32 a·s²·b tensors. MoE layers:
    `routed`, the rows this rank's experts receive (moe_experts); MLA and MoE items: DESIGN.md §6."""
    cpu, B, t = accounting == "cpu", BYTES[layout.dtype], layout.tp
    sp = layout.sequence_parallel and t > 1
    s, b, h, n, g, d = layout.seq // layout.cp, layout.micro_batch, c.hidden_size, c.num_attention_heads, \
        c.num_query_groups, c.kv_channels
    up = 2 if c.gated_linear_unit else 1
    moe = c.is_moe_layer(i)
    f = (c.moe_shared_expert_intermediate_size or 0) if moe else c.ffn_hidden_size  # (MoE: the shared expert's MLP)
    mask = (B if cpu else 1) * (c.hidden_dropout > 0)  # one dropout mask value
    sb = s * b
    whole = sb * h * (2 * B + 2 * mask + 2 * B)  # LayerNorm inputs; hidden-dropout masks; linear_qkv's, fc1's inputs
    experts = 0
    if moe:  # parallel.Router (fp32) on the T = s·b tokens (s/t·b under SP); the dispatcher and experts: moe_experts
        k, E, aux, z = c.moe_router_topk, c.num_experts, bool(c.moe_aux_loss_coeff), bool(c.moe_z_loss_coeff)
        sig, post = c.moe_router_score_function == "sigmoid", not c.moe_router_pre_softmax
        whole += sb * h * (4 - B * (not f)) * (cpu and B < 4)  # 16-bit: the router's fp32 copy of its input (the
        # norm's output, fc1's input above, then kept by a shared expert only)
        whole += 4 * sb * E * (1 + (post and not sig) * aux + z * (sig or not post))  # [T, E]: the scores (sigmoid;
        # pre-softmax) or the top-k's logits (post-softmax; with the aux loss the softmax's too); z-loss: the logits
        whole += sb * k * (8 + 4 * (post and (k > 1 or not sig)))  # the top-k indices (int64) and weights [T, k]
        whole += 4 * sb * (sig * (k > 1) + sig * aux + z)  # sigmoid: the sums [T, 1] the weights and the aux loss's
        # scores are normalised by; z-loss: the logsumexp [T]
        whole += sb * B * (h + 1) * bool(c.moe_shared_expert_gate)  # the shared expert's output [T, h], gate [T, 1]
        seq = c.moe_router_load_balancing_type == "seq_aux_loss"  # the aux loss's token counts (the router's
        experts = 4 * ((b * E if seq else 3 * E + 1) + 1) * aux + 4 * z  # statistics [3E + 1]; per sequence [b, E]),
        experts += moe_experts(c, layout, accounting, routed)  # the losses (scalars: whole under SP too)
        experts += sb * E * (c.moe_expert_capacity_factor is not None)  # capacity: the keep mask (bool [T, E], whole)
    qkv = sb * B * (n + 2 * g) * d  # linear_qkv's output: q, k, v [s, b, (n + 2g)·d]
    split = sb * B * (n * d + up * f + f)  # linear_proj's input; fc1's output (the activation's input); fc2's input
    split += sb * B * f * (cpu and up == 2)  # CPU SwiGLU: also the activation of the gate (transformer.SwiGLU)
    core, new_qk = 0, c.qk_layernorm or c.position_embedding_type in ("rope", "yarn")  # q, k no views of the QKV output
    if cpu and c.qk_layernorm:  # the q and k norms' statistics, per head
        qkv += norm_extra(c, B, sb * (n + g) * d, sb * (n + g))
    # selective recomputation: the core keeps its inputs q, k, v only (transformer.Attention's CP path is not recomputed)
    recomputed = layout.recompute == "selective" and not (cpu and layout.cp > 1)
    if recomputed:
        core = 0
    elif c.attention_dropout > 0:  # softmax, its dropout mask, the dropped probabilities: the paper's 5·a·s²·b
        core = n * s * s * b * (12 if cpu else 2 * B + 1)  # (CPU: SDPA's math path, all fp32)
        if cpu:  # the math path's own fp32 q·scale, kᵀ and v of n heads each, but fp32 multi-head attention's v, a
            qkv = sb * 4 * (2 * n * d + (n + 2 * g) * d if B == 4 and g == n else 3 * n * d)  # view of the QKV output
    elif cpu:  # without dropout: CPU SDPA's flash kernel, its logsumexp [b, n, s] and its q, k, v
        core, qkv = 4 * b * n * s, qkv + sb * B * (n + g) * d * new_qk
        if layout.cp > 1:  # context parallelism's p2p ring (parallel._RingAttention): q, the last K/V block it held
            qkv += sb * B * (2 * g * d - g * d * new_qk)  # [2, b, g, s/c, d] (not k), the merged logsumexp
    stats = 2 * norm_extra(c, B, sb * h, sb) if cpu else 0  # the two norms' statistics
    if c.multi_latent_attention:  # deepseek.MLASelfAttention: the heads' q·scale, k [n·qd] and v [n·dv] (fp32 on
        qd, dv, rq, rkv = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim, c.q_lora_rank or 0, c.kv_lora_rank
        qkv, split = sb * B * n * (2 * qd + dv), split + sb * B * n * (dv - d)  # CPU); linear_proj's input n·dv
        if cpu:  # SDPA's math path (qd != dv): q·scale, k fp32; v a view of linear_kv_up_proj's output (fp32: a copy)
            qkv = sb * 4 * n * 2 * qd + sb * n * (B * (c.qk_head_dim + dv) if B == 4 else 4 * dv)
            core = n * s * s * b * (12 if c.attention_dropout > 0 else 4)  # (no dropout: the softmax's output only)
        # replicated over TP (whole on every rank, /t with SP): q's latent norm's input, its output (linear_q_up_proj's
        # input), linear_kv_down_proj's output [rkv + dr] (kv_layernorm's input is a view of it), kv_layernorm's output
        whole += sb * B * (2 * rq + 2 * rkv + c.qk_pos_emb_head_dim * (not cpu or not fp32_norm(c, B)))
        whole += (norm_extra(c, B, sb * rq, sb) * bool(rq) + norm_extra(c, B, sb * rkv, sb)) * cpu  # their statistics
    # 16-bit RoPE (CPU): apply_rope casts the fp32 angles cos, sin [s, 1, 1, r] to the dtype for q and for k
    angles = 4 * s * rope_dims(c) * B * (cpu and B < 4 and c.position_embedding_type in ("rope", "yarn"))
    if sp:  # sequence parallelism: every item is a sequence shard
        return (whole + qkv + split + core + stats) // t + angles + experts
    return whole + (qkv + split + core) // t + stats + angles + experts


def moe_experts(c, layout: Layout, accounting: str, routed: int | None = None) -> int:
    """What parallel.MoELayer's dispatcher and experts keep per micro-batch: N_s = s·b·k (token, expert) pairs of
    this rank's tokens (all s·b: gathered over TP; with a capacity factor fewer, which this count does not know: the
    all-to-all dispatcher at EP > 1 is then not exact), and N_r = `routed`, the rows its E/ep experts receive — set by
    the routing: given (measured), exact; else balanced, s·b·k. The accounting "gpu" keeps the experts' MLP on the
    N_r rows (16-bit values) and, per pair, its indices, prob (fp32) and expert output (Megatron's permutation map,
    permuted probs, the output the probs weight)."""
    cpu, B, ep, E, k = accounting == "cpu", BYTES[layout.dtype], layout.ep, c.num_experts, c.moe_router_topk
    up, fe, h = 2 if c.gated_linear_unit else 1, c.moe_ffn_hidden_size // layout.tp, c.hidden_size
    sb = layout.seq // layout.cp * layout.micro_batch
    ns = sb * k
    nr = ns if routed is None else routed
    mlp = nr * B * (h + up * fe + fe + fe * (cpu and up == 2))  # x [N_r, h], fc1's output, fc2's input (SwiGLU: silu)
    a2a = c.moe_token_dispatcher_type == "alltoall"
    home = ns if a2a else nr  # the pairs weighted and summed on this rank (all-gather: those of its experts)
    if not cpu:
        return mlp + home * (16 + 4 + h * B)
    a2a = 16 * nr * (a2a and ep > 1)  # all-to-all: the order of the received rows and its inverse (int64)
    # the grouped GEMM's stacked weights [E/ep, h, up·fe], [E/ep, fe, h] and offsets (int32, one per GEMM); the
    # (token, expert) pairs (int64 [N, 2]); each pair's prob [N, 1] (fp32), expert output [N, h] and their product
    return E // ep * (h * (up + 1) * fe * B + 8) + 16 * home + a2a + mlp + home * (4 + h * B + h * 4)


def fp32_norm(c, B: int) -> bool:
    """A 16-bit RMSNorm keeps an fp32 copy of its input, not the input itself (norm_extra counts it as if)."""
    return c.normalization == "RMSNorm" and B < 4


def rope_dims(c) -> int:
    """r, the rotated dims of a head: MLA's qk_pos_emb_head_dim, else int(kv_channels · rotary_percent)."""
    return c.qk_pos_emb_head_dim if c.multi_latent_attention else int(c.kv_channels * c.rotary_percent)


def norm_extra(c, B: int, values: int, rows: int) -> int:
    """What this CPU's norm keeps besides its input: LayerNorm its mean and rstd [s, b, 1]; RMSNorm (torch's
    composite) its rstd [s, b, 1] in fp32 and the normalized input [s, b, h] (16-bit: also the input in fp32)."""
    return 2 * B * rows if c.normalization == "LayerNorm" else 4 * rows + B * values + 4 * values * (B < 4)


def chunk_activations(c, layout: Layout, pre: bool, post: bool, layers: range, accounting: str = "gpu",
                      routed: dict | None = None):
    """(kept, peak): the bytes one virtual chunk keeps per micro-batch after its forward — its layers (under full
    recomputation only each recomputed unit's input), the embedding's (first chunk), the output layer's and the
    loss's (last chunk) — and their peak during its backward (full recomputation: one unit's layers recomputed).
    routed: {global layer (MTP depth d: num_layers + d): rows its experts receive} (moe_experts; default balanced)."""
    routed = routed or {}
    cpu, B, t = accounting == "cpu", BYTES[layout.dtype], layout.tp
    sp = layout.sequence_parallel and t > 1
    s, b, h, V = layout.seq // layout.cp, layout.micro_batch, c.hidden_size, c.padded_vocab_size
    sb, x = s * b, s * b * h * B // (t if sp else 1)  # x: one hidden state [s(/t), b, h]
    if cpu:  # the ids: int64 (t = 1: the micro-batch's own [b, s + 1] tensor; cp: its [b, s/c] copy; t > 1: their
        # masked [b, s] copy and the bool mask); position ids; the embedding's dropout mask
        ids = 8 * b * (layout.seq + 1) if t == 1 and layout.cp == 1 else 8 * sb + sb * (t > 1)
        head = pre * (ids + 8 * s * (c.position_embedding_type == "learned_absolute") + x * (c.hidden_dropout > 0))
        # final LayerNorm input + mean, rstd; the output layer's input; the fp32 softmax [s, b, V/t] (the logits'
        # own buffer, parallel.vocab_parallel_cross_entropy), the target index (int64) and its bool mask
        tail = post * (x + norm_extra(c, B, x // B, sb // (t if sp else 1)) + x + 4 * sb * V // t + 8 * sb + sb)
        rope = c.position_embedding_type in ("rope", "yarn") and B == 4  # the chunk's RoPE angles cos, sin
        head += 2 * 4 * s * rope_dims(c) * rope  # [s, 1, 1, r] fp32 (16-bit: each layer's cast copies instead)
    else:  # Megatron's theoretical_memory_usage.py: the ids 8·s·b and the embedding's dropout mask s·b·h; the
        # output layer's input and the fp32 logits 4·s·b·(h + V); all / t
        head, tail = pre * (8 * sb + sb * h * (c.hidden_dropout > 0)) // t, post * 4 * sb * (h + V) // t
    if post and c.mtp_num_layers:  # deepseek.MTPLayer, each depth: the embedding of the rolled ids (as the head), its
        D, drop = c.mtp_num_layers, x * (c.hidden_dropout > 0)  # layer, the output layer and the loss (as the main's)
        tail += sum(layer_activations(c, layout, accounting, c.num_layers - 1, routed.get(c.num_layers + k))
                    for k in range(D))
        if cpu:  # ids (int64; t > 1 their masked copy and mask), position ids, the dropout mask; enorm's input and
            ne = norm_extra(c, B, x // B, sb // (t if sp else 1))  # statistics, hnorm's (its input is the output
            # layer's already, unless a 16-bit RMSNorm's fp32 copy replaces it), eh_proj's input [s, b, 2h]; the final
            # norm's input, the output layer's; the loss as the main one's; the rolled `valid` [b, s] the loss is
            # masked with; once: the summed loss (fp32)
            tail += D * (8 * sb + sb * (t > 1) + 8 * sb * (c.position_embedding_type == "learned_absolute") + drop +
                         x + 3 * ne + x * fp32_norm(c, B) + 2 * x + 2 * x + 4 * sb * V // t + 9 * sb + B * sb) + 4
        else:  # the ids and dropout mask, enorm's and eh_proj's inputs (1 + 2), the final norm's; the output layer's
            tail += D * ((8 * sb + sb * h * (c.hidden_dropout > 0)) // t + 4 * x + 4 * sb * (h + V) // t)  # input
            # and fp32 logits as the main tail's
    full = [layer_activations(c, layout, accounting, i, routed.get(i)) for i in layers]
    if layout.recompute != "full":
        return head + sum(full) + tail, head + sum(full) + tail
    N, L = c.recompute_num_layers or 1, len(layers)  # transformer.Decoder.recomputed: uniform = units of N layers,
    units = [range(k, min(k + N, L)) for k in range(0, L, N)] if c.recompute_method != "block" else \
        [range(k, k + 1) for k in range(min(N, L))]  # block = the first N layers one by one, the rest as usual
    rest = sum(full[len(units) if c.recompute_method == "block" else L:])
    kept = head + len(units) * x + rest + tail
    # backward of unit k: the units before it keep their inputs, unit k's layers are all recomputed (its input among
    # them); the layers after it and the tail are freed
    peak = max([kept] + [head + k * x + sum(full[i] for i in u) for k, u in enumerate(units)])
    return kept, peak


def in_flight(chunk_bytes: list[tuple[int, int]], layout: Layout, stage: int) -> int:
    """The peak bytes of the micro-batches in flight on pipeline rank `stage`, from its schedule's actions
    (parallel.schedule_1f1b: p − r micro-batches at most; interleaved: (p − r − 1)·2 + (v − 1)·p + 1 chunks; no
    pipeline: one micro-batch): each forward adds its chunk's kept bytes, each backward peaks, then frees them."""
    M = max(1, layout.micro_batches)
    if layout.pp == 1:
        actions = [a for k in range(M) for a in (("F", k, 0), ("B", k, 0))]  # forward_backward_no_pipelining
    else:
        actions = P.schedule_1f1b(layout.pp, stage, M) if layout.vpp == 1 else \
            P.schedule_interleaved(layout.pp, stage, M, layout.vpp)
    live = peak = 0
    for kind, _, v in actions:
        kept, backward = chunk_bytes[v]
        peak = max(peak, live + kept if kind == "F" else live - kept + backward)
        live += kept if kind == "F" else -kept
    return peak


def memory(c, layout: Layout, accounting: str = "gpu") -> dict:
    """Bytes per rank on the pipeline rank that holds the most (every TP, DP, CP rank of a stage holds the same;
    EP ranks the same count of experts)."""
    if accounting not in ("cpu", "gpu"):
        raise ValueError(f"accounting={accounting!r}: 'cpu' or 'gpu'")
    best = None
    for r in range(layout.pp):
        out = state_bytes(c, layout, r, accounting)
        out["activations"] = in_flight([chunk_activations(c, layout, *ch, accounting) for ch in chunks(c, layout, r)],
                                       layout, r)
        out["total"], out["stage"] = sum(out.values()), r
        best = out if best is None or out["total"] > best["total"] else best
    return best


def kv_cache_bytes(c, batch: int, seq: int, dtype_bytes: int = 2, tp: int = 1) -> int:
    """The KV cache of serving: keys and values [b, g/t, seq, d] of every layer (transformer.InferenceContext
    preallocates them to its max_sequence_length)."""
    return 2 * c.num_layers * batch * (c.num_query_groups // tp) * seq * c.kv_channels * dtype_bytes


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
GEMM_EFFICIENCY = 0.71
HBM_PASSES = 2.45


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
    # compute of one micro-batch on one rank: its L/p layers (all v chunks) and, on the last stage, the logits
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
    total = compute + bubble + pp_comm + dp_exposed + optimizer
    counted = flops_per_iteration(c, lo, causal=not paper)
    return {"seconds_per_iteration": total, "tflops_per_gpu": counted / total / lo.world / 1e12,
            "flops": counted, "compute": compute, "bubble": bubble, "bubble_fraction": (p - 1) / (m * v),
            "tp_comm": m * L / p * tp_layer, "cp_comm": m * L / p * cp_layer, "ep_comm": m * moe_layers / p * ep_layer,
            "pp_comm": pp_comm, "dp_comm": dp, "dp_exposed": dp_exposed, "optimizer": optimizer}


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


def params_per_rank(c, layout: Layout) -> int:
    """Parameters of the pipeline rank holding the most (section 2's stage_parameters: the first or the last)."""
    return max(sum(x.numel for x in stage_parameters(c, layout, r)) for r in {0, layout.pp - 1})


# ---------------------------------------------------------------------------------------------- 4. the planner
# plan(c, gpu, gpus, ...) -> the layouts that fit, best predicted throughput first (tools.py plan prints them).
# The share of a GPU's memory a layout may plan for: the rest is the CUDA context, NCCL's buffers and the allocator's
# fragmentation (an assumption, DESIGN.md §12: with 1.0 the paper's layout is in the top three of 7 of Table 1's rows).
USABLE = 0.85
SEARCH = {"micro_batch": (1, 2, 4, 8), "recompute": (None, "selective", "full"), "distributed_optimizer": (False, True),
          "vpp": (1, 2, 4), "cp": (1, 2, 4, 8)}
SHARDING = ("no_shard", "optim_grads", "optim_grads_params")  # with the distributed optimizer: ZeRO-1, -2, -3


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(c, gpus: int, per_node: int, seq: int, global_batch: int, dtype: str, **fixed):
    """Every layout of `gpus` ranks the model allows (TP within a node and dividing the heads and groups; PP dividing
    the layers; interleaving with m divisible by p, as Megatron asks; CP over 2·cp chunks; EP dividing the experts
    and DP·CP); `fixed` pins fields (a value, or a tuple of the values to try)."""
    pick = lambda k, default: fixed[k] if isinstance(fixed.get(k), tuple) else (fixed[k],) if k in fixed else default
    experts = c.num_experts or 1
    for tp in pick("tp", [t for t in divisors(gpus) if per_node % t == 0 and c.num_attention_heads % t == 0
                          and c.num_query_groups % t == 0]):
        for pp in pick("pp", [p for p in divisors(gpus // tp) if c.num_layers % p == 0]):
            for cp in pick("cp", [k for k in SEARCH["cp"] if (gpus // (tp * pp)) % k == 0 and seq % (2 * k) == 0]):
                dp = gpus // (tp * pp * cp)
                if tp * pp * cp * dp != gpus:
                    continue
                for ep in pick("ep", [e for e in divisors(dp * cp) if experts % e == 0] if c.num_experts else [1]):
                    for b in pick("micro_batch", [b for b in SEARCH["micro_batch"] if global_batch % (b * dp) == 0]):
                        m = global_batch // (b * dp)
                        for v in pick("vpp", [v for v in SEARCH["vpp"] if v == 1 or pp > 1 and m % pp == 0
                                              and c.num_layers % (pp * v) == 0]):
                            for r in pick("recompute", SEARCH["recompute"]):
                                for zero in pick("distributed_optimizer", (False, True) if dp > 1 else (False,)):
                                    for shard in pick("sharding", SHARDING if zero else ("no_shard",)):
                                        yield Layout(seq, tp, pp, v, dp, cp, ep, b, global_batch, pick(
                                            "sequence_parallel", (tp > 1,))[0], r, zero, shard, dtype=dtype)


def evaluate(c, layout: Layout, gpu: GPU, accounting: str = "gpu", paper: bool = False, time_=None) -> dict:
    """One layout's memory (the largest rank's) and time, with its flags under Megatron's names."""
    mem, time_ = memory(c, layout, accounting), time_ or step_time(c, layout, gpu, paper)
    flags = {MEGATRON_NAMES[k]: getattr(layout, k) for k in MEGATRON_NAMES}
    return {"memory_bytes": mem["total"], "tflops_per_gpu": time_["tflops_per_gpu"],
            "seconds_per_iteration": time_["seconds_per_iteration"], **flags,
            "use_megatron_fsdp": layout.sharding != "no_shard", "memory": mem, "time": time_,
            "fits": mem["total"] <= USABLE * gpu.memory}


def plan(c, gpu: GPU, gpus: int, seq: int, global_batch: int, dtype: str = "bf16", accounting: str = "gpu",
         paper: bool = False, top: int | None = None, **fixed) -> list[dict]:
    """The `top` fastest layouts that fit in USABLE of gpu.memory (seconds per iteration: the same global batch for
    all). Timed first, all of them; memory (section 2 walks the schedule: slower) in that order until `top` fit."""
    counts = {}  # (tp, pp, vpp, ep) -> params_per_rank

    def count(lo):
        key = lo.tp, lo.pp, lo.vpp, lo.ep
        counts[key] = counts[key] if key in counts else params_per_rank(c, lo)
        return counts[key]
    timed = sorted(((step_time(c, lo, gpu, paper, count(lo)), lo) for lo in layouts(
        c, gpus, gpu.per_node, seq, global_batch, dtype, **fixed)), key=lambda x: x[0]["seconds_per_iteration"])
    found = []
    for time_, lo in timed:
        if top is not None and len(found) == top:
            break
        if sum(state_bytes(c, lo, 0, accounting).values()) > USABLE * gpu.memory:
            continue  # (a cheap bound first: the first stage's state alone does not fit)
        entry = evaluate(c, lo, gpu, accounting, paper, time_)
        found += [entry] if entry["fits"] else []
    return found

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--num-layers-per-virtual-pipeline-stage", "--expert-model-parallel-size")


def layout_of(args, c, gpus: int, dtype: str) -> Layout:
    """The layout train.py's flags name, over `gpus` ranks (DP takes the rest, as Megatron's)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = gpus // (tp * pp * cp)
    if dp < 1 or tp * pp * cp * dp != gpus:
        raise ValueError(f"--gpus {gpus} is not a multiple of TP·PP·CP = {tp * pp * cp}")
    per = args.num_layers_per_virtual_pipeline_stage
    recompute = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    sharding = args.data_parallel_sharding_strategy
    fsdp = args.use_megatron_fsdp and sharding in SHARDING[1:]
    return Layout(args.seq_length, tp, pp, c.num_layers // (pp * per) if per else 1, dp, cp,
                  args.expert_model_parallel_size, args.micro_batch_size,
                  args.global_batch_size or args.micro_batch_size * dp, args.sequence_parallel, recompute,
                  args.use_distributed_optimizer or fsdp, sharding if fsdp else "no_shard", dtype=dtype)


def report(entries: list[dict], gpu: GPU, gpus: int) -> str:
    """tools.py plan's text: one layout's memory and time, or a table of the layouts ranked."""
    G = 1e9
    name = lambda x: (f"TP {x['tensor_model_parallel_size']} PP {x['pipeline_model_parallel_size']} "
                      f"VPP {x['num_virtual_stages_per_pipeline_rank']} DP {x['data_parallel_size']} "
                      f"CP {x['context_parallel_size']} EP {x['expert_model_parallel_size']} "
                      f"mb {x['micro_batch_size']} recompute {x['recompute_granularity'] or '-'} "
                      f"dist-opt {'on' if x['use_distributed_optimizer'] else 'off'}"
                      + (f" fsdp {x['data_parallel_sharding_strategy']}" if x["use_megatron_fsdp"] else ""))
    if len(entries) != 1:
        lines = [f"the {len(entries)} fastest layouts that fit {gpus} x {gpu.name} ({USABLE:.0%} of "
                 f"{gpu.memory / G:.0f} GB):"]
        lines += [f"{i + 1:3d}. {name(x)}: {x['memory_bytes'] / G:.1f} GB, {x['tflops_per_gpu']:.0f} TFLOP/s per GPU, "
                  f"{x['seconds_per_iteration']:.3g} s per iteration" for i, x in enumerate(entries)]
        return "\n".join(lines)
    x = entries[0]
    mem, t = x["memory"], x["time"]
    parts = ", ".join(f"{k} {mem[k] / G:.2f} GB" for k in ("parameters", "gradients", "optimizer", "activations"))
    return "\n".join([
        f"{name(x)} on {gpus} x {gpu.name}",
        f"memory per GPU (pipeline rank {mem['stage']}, the largest): {parts}; total {mem['total'] / G:.2f} GB of "
        f"{gpu.memory / G:.0f} GB ({'fits' if x['fits'] else 'does NOT fit'} in {USABLE:.0%})",
        f"time per iteration: {t['seconds_per_iteration']:.3g} s = compute {t['compute']:.3g} (TP communication "
        f"{t['tp_comm']:.3g} in it) + bubble {t['bubble']:.3g} ({t['bubble_fraction']:.1%}) + PP sends "
        f"{t['pp_comm']:.3g} + DP {t['dp_exposed']:.3g} exposed of {t['dp_comm']:.3g} + optimizer {t['optimizer']:.3g}",
        f"{x['tflops_per_gpu']:.0f} TFLOP/s per GPU ({t['flops'] / 1e15:.4g} PFLOP an iteration, recomputation "
        "included)"])


def plot(entry: dict, path: str):
    """A PNG bar chart of one layout's memory per GPU."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ["parameters", "gradients", "optimizer", "activations", "total"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(keys, [entry["memory"][k] / 1e9 for k in keys], color=["C0", "C1", "C2", "C3", "C7"])
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"TP {entry['tensor_model_parallel_size']} PP {entry['pipeline_model_parallel_size']} "
                 f"DP {entry['data_parallel_size']}: {entry['seconds_per_iteration']:.3g} s/iteration")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
