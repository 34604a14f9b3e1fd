"""planning/memory.py — the bytes one rank holds for a layout: parameters, gradients (fp32 main grads where they
exist), optimizer state (AdamW, the distributed optimizer's shard, Megatron-FSDP's ZeRO-2/3, Muon), the activations
each layer keeps for backward, the micro-batches a pipeline schedule keeps in flight, and serving's KV cache.

Mirrors megatron/training/theoretical_memory_usage.py and the papers it follows:
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (activations, §4, Table 2:
  34·s·b·h + 5·a·s²·b bytes a layer in 16-bit; /t with TP + SP; selective and full recomputation);
  Rajbhandari et al. 2020, "ZeRO" (parameters, gradients, optimizer state);
  Narayanan et al. 2021 (1F1B holds p − r micro-batches on pipeline rank r; interleaved more).
Two accountings: "cpu", what this CPU keeps, checked to the byte against measured bytes (tests/test_costs_memory.py,
saved-tensor hooks and the optimizer's own state); "gpu", the papers' 16-bit one (DESIGN.md §6 lists both).

    memory(c, layout, accounting) -> bytes on the pipeline rank that holds the most: "parameters", "gradients",
    "optimizer", "activations", "total" (+ "stage", that rank); kv_cache_bytes(c, batch, seq, dtype_bytes, tp).

Run:    .venv/bin/python tools.py plan --gpu a100-80gb --gpus 8 --num-layers 24 --hidden-size 2048 \
            --num-attention-heads 16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
"""
from __future__ import annotations

import math
import typing

import parallel as P
from planning.layout import BYTES, Layout


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


def params_per_rank(c, layout: Layout) -> int:
    """Parameters of the pipeline rank holding the most (stage_parameters: the first or the last)."""
    return max(sum(x.numel for x in stage_parameters(c, layout, r)) for r in {0, layout.pp - 1})
