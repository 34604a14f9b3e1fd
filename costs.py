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
import typing

import parallel as P

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
    multi-latent attention and MTP are not itemised)."""
    t, h, n, g, d, f = layout.tp, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels, \
        c.ffn_hidden_size
    norm = lambda size: [Param(size)] * (2 if c.normalization == "LayerNorm" else 1)  # weight (+ bias)
    bias = lambda size, on: [Param(size)] if on else []
    ps = norm(h) + [Param(h * (n + 2 * g) * d // t, True)] + bias((n + 2 * g) * d // t, c.add_qkv_bias)  # linear_qkv
    ps += [Param(n * d // t * h, True)] + bias(h, c.add_bias_linear)  # linear_proj
    ps += (norm(d) + norm(d) if c.qk_layernorm else []) + norm(h)  # q/k norms, pre_mlp_layernorm
    up = 2 if c.gated_linear_unit else 1  # SwiGLU's fc1 is [gate; up]
    if not c.is_moe_layer(i):  # the MLP: fc1 [up·f/t, h], fc2 [h, f/t]
        return ps + [Param(up * f // t * h, True)] + bias(up * f // t, c.add_bias_linear) + \
            [Param(h * f // t, True)] + bias(h, c.add_bias_linear)
    E, fe, etp = c.num_experts, c.moe_ffn_hidden_size, layout.tp  # experts split over TP as the MLP (etp = tp)
    ps += [Param(E * h, True, fp32=True)] + ([Param(E, fp32=True)] if c.add_bias_linear else [])  # the router
    ps += [Param(up * fe // etp * h, True, "expert"), Param(h * fe // etp, True, "expert")] * (E // layout.ep)
    if c.moe_shared_expert_intermediate_size:
        fs = c.moe_shared_expert_intermediate_size
        ps += [Param(up * fs // t * h, True)] + bias(up * fs // t, c.add_bias_linear) + [Param(h * fs // t, True)] + \
            bias(h, c.add_bias_linear) + ([Param(h)] if c.moe_shared_expert_gate else [])
    return ps


def chunks(c, layout: Layout, stage: int) -> list[tuple[bool, bool, range]]:
    """(pre_process, post_process, global layers) of each virtual chunk on pipeline rank `stage` (parallel.stage_layers)."""
    p, v = layout.pp, layout.vpp
    per = c.num_layers // (p * v)  # layers per chunk
    first = lambda k: k * (c.num_layers // v) + stage * per  # chunk k's first global layer
    return [(stage == 0 and k == 0, stage == p - 1 and k == v - 1, range(first(k), first(k) + per)) for k in range(v)]


def stage_parameters(c, layout: Layout, stage: int) -> list[Param]:
    """Every parameter pipeline rank `stage` holds: embedding (first chunk), layers, final norm and output layer
    (last chunk; the tied embedding's copy when the first chunk is elsewhere), in the model's order (gpt.Model)."""
    t, h, V = layout.tp, c.hidden_size, c.padded_vocab_size
    tied = c.share_embeddings_and_output_weights
    ps = []
    for pre, post, layers in chunks(c, layout, stage):
        if pre:
            ps.append(Param(V // t * h, group="tied" if tied and not post else "dense"))  # word embeddings [V/t, h]
            ps += [Param(c.max_position_embeddings * h)] if c.position_embedding_type == "learned_absolute" else []
            ps += [Param(c.num_tokentypes * h)] if c.num_tokentypes else []
        for i in layers:
            ps += layer_parameters(c, layout, i)
        if post:
            ps += [Param(h)] * (2 if c.normalization == "LayerNorm" else 1)  # final_layernorm
            if not (tied and pre):  # output layer [V/t, h]: its own weight, or the tied embedding's last-stage copy
                ps.append(Param(V // t * h, group="tied" if tied else "dense"))
    return ps


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


def state_bytes(c, layout: Layout, stage: int, accounting: str = "gpu") -> dict:
    """Parameters, gradients and optimizer state on pipeline rank `stage` (Rajbhandari et al. 2020, ZeRO; DESIGN.md
    §4): fp32 main grads and fp32 master weights for 16-bit parameters; AdamW's two fp32 moments, Muon's one momentum
    on its matrices ("gpu"; this CPU's parallel.Muon keeps AdamW's layout, two); the distributed optimizer keeps
    master weights and moments for its 1/(d·c) slice of each padded bucket (parallel.DDP's flat buffers)."""
    ps, B, gpu = stage_parameters(c, layout, stage), BYTES[layout.dtype], accounting == "gpu"
    low = B < 4  # 16-bit parameters
    moments = lambda p: {"sgd": 0, "adam": 2, "muon": 1 if p.muon and gpu else 2}[layout.optimizer]
    own = lambda p: 4 if p.fp32 else B  # (the MoE router is fp32 whatever the dtype)
    if not layout.distributed_optimizer:  # parallel.Optimizer / Muon: whole parameters; torch's AdamW keeps its
        return {"parameters": sum(p.numel * own(p) for p in ps),  # moments in the parameter's dtype
                "gradients": sum(p.numel * (4 if gpu else own(p)) for p in ps),
                "optimizer": sum(p.numel * (moments(p) * (4 if gpu else own(p)) + 4 * (gpu and own(p) < 4))
                                 for p in ps)}
    sizes = buckets(ps, layout)
    n, shard = sum(k for k, _ in sizes), sum(k // size for k, size in sizes)  # buffer length; this rank's slices
    mean_moments = sum(p.numel * moments(p) for p in ps) / max(1, sum(p.numel for p in ps))  # (exact unless gpu Muon)
    return {"parameters": n * B, "gradients": n * (4 if low or gpu else B),
            "optimizer": shard * 4 * low + round(shard * 4 * mean_moments)}


def layer_activations(c, layout: Layout, accounting: str = "gpu", i: int = 0) -> int:
    """Bytes layer i keeps for backward per micro-batch (Korthikanti et al. 2022, §4 and Table 2): the paper's items
    with our dims (s/c tokens per CP rank; GQA's g key/value heads; f, SwiGLU's 2f), B bytes a value and masks 1 byte
    ("gpu"); this CPU's items (DESIGN.md §6): dropout masks of B bytes, LayerNorm's mean and rstd, and the math SDPA
    (taken with attention dropout): fp32 q·scale, kᵀ (and v, from 16-bit) and three fp32 a·s²·b tensors."""
    cpu, B, t = accounting == "cpu", BYTES[layout.dtype], layout.tp
    sp = layout.sequence_parallel and t > 1
    s, b, h, n, g, d = layout.seq // layout.cp, layout.micro_batch, c.hidden_size, c.num_attention_heads, \
        c.num_query_groups, c.kv_channels
    up = 2 if c.gated_linear_unit else 1
    f = c.ffn_hidden_size
    if c.is_moe_layer(i):  # the experts see top-k copies of each token (an estimate: the router's and the
        f = c.moe_router_topk * c.moe_ffn_hidden_size  # dispatcher's buffers are left out)
    mask = (B if cpu else 1) * (c.hidden_dropout > 0)  # one dropout mask value
    sb = s * b
    whole = sb * h * (2 * B + 2 * mask + 2 * B)  # LayerNorm inputs; hidden-dropout masks; linear_qkv's, fc1's inputs
    qkv = sb * B * (n + 2 * g) * d  # linear_qkv's output: q, k, v [s, b, (n + 2g)·d]
    split = sb * B * (n * d + up * f + f)  # linear_proj's input; fc1's output (the activation's input); fc2's input
    split += sb * B * f * (cpu and up == 2)  # CPU SwiGLU: also the activation of the gate (transformer.SwiGLU)
    core, new_qk = 0, c.qk_layernorm or c.position_embedding_type in ("rope", "yarn")  # q, k no views of the QKV output
    if cpu and c.qk_layernorm:  # the q and k norms' statistics, per head
        qkv += norm_extra(c, B, sb * (n + g) * d, sb * (n + g))
    if layout.recompute == "selective" and not (cpu and layout.cp > 1):  # the core recomputed: it keeps its inputs
        pass  # q, k, v only (but transformer.Attention's CP path is not recomputed)
    elif c.attention_dropout > 0:  # softmax, its dropout mask, the dropped probabilities: the paper's 5·a·s²·b
        core = n * s * s * b * (12 if cpu else 2 * B + 1)  # (CPU: SDPA's math path, all fp32)
        if cpu:  # the math path's own fp32 q·scale, kᵀ and v of n heads each, but fp32 multi-head attention's v, a
            qkv = sb * 4 * (2 * n * d + (n + 2 * g) * d if B == 4 and g == n else 3 * n * d)  # view of the QKV output
    elif cpu:  # without dropout: CPU SDPA's flash kernel, its logsumexp [b, n, s] and its q, k, v
        core, qkv = 4 * b * n * s, qkv + sb * B * (n + g) * d * new_qk
        if layout.cp > 1:  # context parallelism's p2p ring (parallel._RingAttention): q, the last K/V block it held
            qkv += sb * B * (2 * g * d - g * d * new_qk)  # [2, b, g, s/c, d] (not k), the merged logsumexp
    stats = 2 * norm_extra(c, B, sb * h, sb) if cpu else 0  # the two norms' statistics
    if sp:  # sequence parallelism: every item is a sequence shard
        return (whole + qkv + split + core + stats) // t
    return whole + (qkv + split + core) // t + stats


def norm_extra(c, B: int, values: int, rows: int) -> int:
    """What this CPU's norm keeps besides its input: LayerNorm its mean and rstd [s, b, 1]; RMSNorm (torch's
    composite) its rstd [s, b, 1] in fp32 and the normalized input [s, b, h]."""
    return 2 * B * rows if c.normalization == "LayerNorm" else 4 * rows + B * values


def chunk_activations(c, layout: Layout, pre: bool, post: bool, layers: range, accounting: str = "gpu"):
    """(kept, peak): the bytes one virtual chunk keeps per micro-batch after its forward — its layers (under full
    recomputation only each recomputed unit's input), the embedding's (first chunk), the output layer's and the
    loss's (last chunk) — and their peak during its backward (full recomputation: one unit's layers recomputed)."""
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
        rope = c.position_embedding_type in ("rope", "yarn")  # the chunk's RoPE angles cos, sin [s, 1, 1, r] fp32
        head += 2 * 4 * s * int(c.kv_channels * c.rotary_percent) * rope
    else:  # Megatron's theoretical_memory_usage.py: the ids 8·s·b and the embedding's dropout mask s·b·h; the
        # output layer's input and the fp32 logits 4·s·b·(h + V); all / t
        head, tail = pre * (8 * sb + sb * h * (c.hidden_dropout > 0)) // t, post * 4 * sb * (h + V) // t
    full = [layer_activations(c, layout, accounting, i) for i in layers]
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
# GPUS (data-sheet peaks and links, sources cited); step_time(c, layout, gpu) -> dict with at least
# "seconds_per_iteration", "tflops_per_gpu" and the parts (compute, bubble, communication per collective, overlapped).


# ---------------------------------------------------------------------------------------------- 4. the planner
# plan(c, gpu, gpus, ...) -> the layouts that fit, best predicted throughput first (tools.py plan prints them).
