"""gpt.py — the reference decoder-only transformer (GPT-2 and Llama families), tensor- and sequence-parallel.

Mirrors Megatron-LM's `megatron/core/models/gpt/gpt_model.py` and `models/common/embeddings/` (its layers, from
`transformer/`, are transformer.py's; its rotary angles rope.py's; DeepSeek-V3's multi-latent attention and
multi-token prediction deepseek.py's), with Megatron's parameter names and layouts, so a Megatron-core checkpoint
loads by name. gpt.Model is the skeleton bert.py, t5.py, retro.py and mamba.py extend (their
models override its seams): Config, the embedding, the stack of layers, the output layer, generation.
Papers: Radford et al. 2019 (GPT-2); Touvron et al. 2023 (Llama: RMSNorm, SwiGLU, RoPE); Ainslie et al. 2023 (GQA);
        Shoeybi et al. 2019 (Megatron-LM tensor parallelism).

Run:    make train MODEL=gpt        (or: .venv/bin/python train.py --model gpt ...; see README)

Dimension glossary
  b batch    s sequence (s/tp under sequence parallelism)    h hidden    V vocabulary (padded, V/tp per rank)
  n attention heads (local: n/tp)   g query groups = key/value heads (local: g/tp)   d head dim (kv_channels)
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from einops import rearrange
from torch import nn

import convert
import deepseek
import parallel as P
from rope import rope_for
from transformer import ACTIVATIONS, Attention, Decoder, InferenceContext


@dataclasses.dataclass
class Config:
    """Megatron's TransformerConfig field names. Derived fields are filled in __post_init__."""
    POSITION_EMBEDDING_TYPES: ClassVar[tuple] = ("learned_absolute", "rope", "yarn", "none")  # a model file may add its own
    FULL_RECOMPUTE: ClassVar[bool] = True  # its layer stack runs transformer.Decoder.forward (False: a model file's own)
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int | None = None  # None = multi-head; 1 = multi-query; else grouped-query attention
    kv_channels: int | None = None  # head dim d; None = hidden_size / num_attention_heads
    ffn_hidden_size: int | None = None  # None = 4·h
    vocab_size: int = 8192
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 1024
    position_embedding_type: str = "learned_absolute"  # "learned_absolute" | "rope" | "yarn" | "none"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"  # "gelu" (erf) | "gelu_tanh" (GPT-2's) | "silu" | "relu"
    gated_linear_unit: bool = False  # True + silu = SwiGLU
    add_bias_linear: bool = True
    add_qkv_bias: bool | None = None  # None = add_bias_linear
    softmax_scale: float | None = None  # None = 1/sqrt(kv_channels); Google's T5 uses 1.0 (no scaling)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    share_embeddings_and_output_weights: bool = True
    num_tokentypes: int = 0  # token-type (segment) embeddings: BERT's 2 with the binary head
    apply_residual_connection_post_layernorm: bool = False  # residual from the norm's output (original BERT)
    init_method_std: float = 0.02
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    label_smoothing: float = 0.0
    seed: int = 1234
    # Mixture of Experts (parallel.py section 10; Megatron's --num-experts, --moe-*)
    num_experts: int | None = None  # None = dense MLP everywhere
    moe_layer_freq: int | list = 1  # every n-th layer is MoE (layer i with i % n == 0), or a 0/1 list per layer
    moe_ffn_hidden_size: int | None = None  # None = ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # "softmax" | "sigmoid"
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k (else over the k chosen)
    moe_aux_loss_coeff: float = 0.0  # switch load-balancing loss
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  # None = dropless
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "allgather"  # "allgather" | "alltoall"
    moe_shared_expert_intermediate_size: int | None = None  # None = no shared expert
    # Position scaling (rope.py; Megatron's --rotary-percent, --rotary-seq-len-interpolation-factor, --use-rope-scaling,
    # --rope-scaling-factor, and the --yarn-* flags of position_embedding_type "yarn")
    rotary_percent: float = 1.0  # rotate the first int(kv_channels · rotary_percent) dims of each head, pass the rest
    seq_len_interpolation_factor: float | None = None  # linear position interpolation: positions / factor
    rope_scaling: bool = False  # Llama 3.x frequency scaling; the next three are fixed in Megatron (1, 4, 8192)
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    # Activation recomputation (transformer.py; Megatron's --recompute-granularity/-method/-num-layers)
    recompute_granularity: str | None = None  # None | "full" (whole layers) | "selective" (the attention core)
    recompute_method: str | None = None  # full only: "uniform" (chunks of N layers) | "block" (the first N layers)
    recompute_num_layers: int | None = None  # N (full only; per pipeline stage)
    # Context parallelism (parallel.py section 12; the cp size is the Grid's, Megatron's --context-parallel-size)
    cp_comm_type: str = "p2p"  # how attention sees the other ranks' keys: "p2p" (ring) | "all_gather" | "a2a" (Ulysses)
    # multi-latent attention / multi-token prediction (deepseek.py; Megatron's MLATransformerConfig, --mtp-*)
    multi_latent_attention: bool = False  # MLA instead of Attention in every layer (needs rope)
    q_lora_rank: int | None = None  # None = one full q projection (linear_q_proj)
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # the heads' q/k dims without position
    qk_pos_emb_head_dim: int = 64  # the decoupled RoPE dims (one key shared by all heads)
    v_head_dim: int = 128
    mtp_num_layers: int | None = None  # D multi-token prediction depths on the last stage; None = off
    mtp_loss_scaling_factor: float = 0.1  # the MTP loss enters backward as factor / D · Σ_k loss_k
    # DeepSeek-V3 routing (parallel.py section 10a: topk_routing, Router.after_step; Megatron's --moe-router-*)
    moe_router_num_groups: int | None = None  # experts in this many equal groups (group-limited routing)
    moe_router_group_topk: int | None = None  # each token picks its experts from its best this-many groups
    moe_router_topk_scaling_factor: float | None = None  # the top-k weights times this
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias for the selection (sigmoid)
    moe_router_bias_update_rate: float = 1e-3  # the bias moves by rate · sign(mean load − load) after each step

    def __post_init__(self):
        h, n = self.hidden_size, self.num_attention_heads
        if self.kv_channels is None and h % n:
            raise ValueError(f"hidden_size={h} is not divisible by num_attention_heads={n}")
        self.kv_channels, self.num_query_groups = self.kv_channels or h // n, self.num_query_groups or n
        self.ffn_hidden_size = self.ffn_hidden_size or 4 * h
        self.add_qkv_bias = self.add_bias_linear if self.add_qkv_bias is None else self.add_qkv_bias
        if n % self.num_query_groups:
            raise ValueError(f"num_attention_heads={n} is not divisible by num_query_groups={self.num_query_groups}")
        choices = [("position_embedding_type", self.POSITION_EMBEDDING_TYPES), ("normalization", ("LayerNorm", "RMSNorm")),
                   ("activation", tuple(ACTIVATIONS)), ("cp_comm_type", P.CP_COMM_TYPES)]
        if self.num_experts is not None:
            choices += [("moe_router_score_function", ("softmax", "sigmoid")),
                        ("moe_token_dispatcher_type", ("allgather", "alltoall"))]
        for field, allowed in choices:
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not one of {allowed}")
        self.moe_ffn_hidden_size = self.moe_ffn_hidden_size or self.ffn_hidden_size
        self.check_position_scaling_and_recompute()
        if self.num_experts is not None:
            if self.num_experts < 1 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"moe_router_topk={self.moe_router_topk} must be in [1, num_experts={self.num_experts}]")
            f = self.moe_layer_freq
            if isinstance(f, (list, tuple)) and len(f) != self.num_layers:
                raise ValueError(f"moe_layer_freq has {len(f)} entries for num_layers={self.num_layers}")
            self.check_deepseek_routing()
        self.check_mla_mtp()
        self.padded_vocab_size = P.pad_vocab(self.vocab_size, self.make_vocab_size_divisible_by)
        self.output_std = self.init_method_std / math.sqrt(2.0 * self.num_layers)  # scaled init of proj and fc2

    def check_position_scaling_and_recompute(self):
        """Position scaling and recomputation settings, as Megatron's TransformerConfig and validate_args refuse them."""
        r = int(self.kv_channels * self.rotary_percent)
        if not 0 < self.rotary_percent <= 1 or r < 2 or r % 2:
            raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1] and rotate an even number of "
                             f"dims of kv_channels={self.kv_channels} (it rotates {r})")
        for field in ("seq_len_interpolation_factor", "rope_scaling_factor", "yarn_rotary_scaling_factor"):
            if getattr(self, field) is not None and not getattr(self, field) >= 1.0:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        if not 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor:
            raise ValueError(f"rope_scaling_low_freq_factor={self.rope_scaling_low_freq_factor} must be > 0 and < "
                             f"rope_scaling_high_freq_factor={self.rope_scaling_high_freq_factor}")
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ValueError(f"rope_scaling (Llama 3) needs position_embedding_type 'rope', not "
                             f"{self.position_embedding_type!r}")
        if self.position_embedding_type == "yarn" and self.seq_len_interpolation_factor is not None:
            raise ValueError(f"seq_len_interpolation_factor={self.seq_len_interpolation_factor} does not apply to "
                             "yarn (Megatron's YaRN ignores it): use yarn_rotary_scaling_factor")
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g not in (None, "full", "selective") or m not in (None, "uniform", "block"):
            raise ValueError(f"recompute_granularity={g!r} / recompute_method={m!r}: expected full|selective and "
                             "uniform|block")
        if g != "full" and (m is not None or n is not None):
            raise ValueError(f"recompute_method={m!r} and recompute_num_layers={n} apply to recompute_granularity "
                             f"'full' only (it is {g!r})")
        if g == "full" and not self.FULL_RECOMPUTE:
            raise ValueError(f"recompute_granularity 'full' is not implemented for {type(self).__module__}'s layer "
                             "stack (selective is)")
        if g == "full" and (m is None or n is None or n < 1):
            raise ValueError(f"recompute_granularity 'full' needs recompute_method (uniform|block) and "
                             f"recompute_num_layers >= 1 (got {m!r}, {n})")

    def check_mla_mtp(self):
        if self.multi_latent_attention:
            if self.position_embedding_type != "rope":
                raise ValueError(f"multi_latent_attention needs position_embedding_type='rope', not "
                                 f"{self.position_embedding_type!r}")
            dims = dict(kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim,
                        qk_pos_emb_head_dim=self.qk_pos_emb_head_dim, q_lora_rank=self.q_lora_rank or 1)
            if min(dims.values()) < 1 or self.qk_pos_emb_head_dim % 2:
                raise ValueError(f"multi-latent attention dims must be >= 1 (qk_pos_emb_head_dim even): {dims}")
            if self.recompute_granularity == "selective":
                raise ValueError("recompute_granularity 'selective' recomputes transformer.Attention's core; "
                                 "multi-latent attention has no such seam yet (use 'full')")
        if self.mtp_num_layers is not None and (self.mtp_num_layers < 1 or self.mtp_loss_scaling_factor < 0):
            raise ValueError(f"mtp_num_layers={self.mtp_num_layers} must be >= 1 and mtp_loss_scaling_factor="
                             f"{self.mtp_loss_scaling_factor} >= 0")

    def check_deepseek_routing(self):
        """The DeepSeek-V3 routing fields (Megatron's TransformerConfig checks, plus group_topk <= k <= what the groups
        hold, without which a group's score or the top-k would read nothing)."""
        E, k, G, g = self.num_experts, self.moe_router_topk, self.moe_router_num_groups, self.moe_router_group_topk
        if g is not None:
            if G is None or G < 1 or E % G or not 1 <= g <= G:
                raise ValueError(f"moe_router_group_topk={g} needs moe_router_num_groups={G} dividing num_experts={E} "
                                 f"and 1 <= moe_router_group_topk <= moe_router_num_groups")
            if not g <= k <= g * (E // G):
                raise ValueError(f"moe_router_topk={k} must be in [moe_router_group_topk={g}, group_topk x experts per "
                                 f"group = {g * (E // G)}]")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(f"moe_router_enable_expert_bias needs moe_router_score_function='sigmoid', not "
                             f"{self.moe_router_score_function!r} (as Megatron)")
        s, r = self.moe_router_topk_scaling_factor, self.moe_router_bias_update_rate
        if s is not None and not (s > 0 and math.isfinite(s)) or not (r >= 0 and math.isfinite(r)):
            raise ValueError(f"moe_router_topk_scaling_factor={s} must be > 0 and moe_router_bias_update_rate={r} >= 0")

    def is_moe_layer(self, i: int) -> bool:
        """Whether (global, 0-based) layer i uses the MoE layer instead of the MLP (Megatron's moe_layer_freq)."""
        f = self.moe_layer_freq
        return bool(self.num_experts) and bool(f[i] if isinstance(f, (list, tuple)) else i % f == 0)

    def tp_split_sizes(self) -> list[tuple[str, int]]:
        """(what, size) of everything tensor parallelism splits: each must be divisible by tp."""
        return [("num_attention_heads", self.num_attention_heads), ("num_query_groups", self.num_query_groups),
                ("ffn_hidden_size", self.ffn_hidden_size), ("padded vocabulary", self.padded_vocab_size)] + \
            ([("hidden_size (the MTP eh_proj's output)", self.hidden_size)] if self.mtp_num_layers else [])

    def check_layout(self, tp: int = 1, pp: int = 1, ep: int = 1):
        """Refuse a parallel layout this model cannot take, naming the values — before any process group exists."""
        if self.num_experts and self.num_experts % ep:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by expert-model-parallel size {ep}")
        for what, v in self.tp_split_sizes():
            if v % tp:
                raise ValueError(f"{what}={v} is not divisible by tensor-model-parallel size {tp}")
        if self.num_layers % pp:
            raise ValueError(f"num_layers={self.num_layers} is not divisible by pipeline-model-parallel size {pp}")
        if self.recompute_num_layers is not None and self.recompute_num_layers > self.num_layers // pp:
            raise ValueError(f"recompute_num_layers={self.recompute_num_layers} > the {self.num_layers // pp} "
                             f"layers of a pipeline stage (num_layers={self.num_layers}, pp={pp})")

    def check_context_parallel(self, cp: int, tp: int = 1):
        """Refuse what context parallelism (parallel.py section 12) does not cover, naming the values."""
        if cp == 1:
            return
        if self.attention_dropout > 0:
            raise ValueError(f"attention_dropout={self.attention_dropout} with context-parallel size {cp}: dropout on "
                             "the split attention is not implemented (set it to 0)")
        if self.num_experts:
            raise ValueError(f"num_experts={self.num_experts} with context-parallel size {cp}: MoE's router statistics "
                             "(aux losses, capacity) are per micro-batch over all its tokens, a cp rank sees 1/cp")
        if self.multi_latent_attention or self.mtp_num_layers:
            raise ValueError(f"multi_latent_attention / mtp_num_layers with context-parallel size {cp}: MLA has no "
                             "split attention, and MTP rolls the ids along the whole sequence")
        if self.cp_comm_type == "a2a":
            for what, v in (("num_attention_heads", self.num_attention_heads), ("num_query_groups", self.num_query_groups)):
                if (v // tp) % cp:
                    raise ValueError(f"cp_comm_type a2a: {what}={v} / tp={tp} is not divisible by context-parallel size {cp}")


# ---------------------------------------------------------------------------------------------- the GPT model
class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) + optional learned positions + optional token types; output [s(/tp), b, h]."""

    def __init__(self, c: Config, grid=None, rng=None):
        super().__init__()
        self.c, self.grid, self.rng = c, grid, rng
        # SP with nothing added to the whole sequence after the lookup: the lookup's g and the split to sequence
        # shards become one reduce-scatter (Megatron's reduce_scatter_embeddings in LanguageModelEmbedding)
        self.reduce_scatter = c.sequence_parallel and c.position_embedding_type != "learned_absolute" \
            and c.num_tokentypes == 0 and P.tp_of(grid) is not None
        self.word_embeddings = P.VocabParallelEmbedding(c.padded_vocab_size, c.hidden_size, grid,
                                                        std=c.init_method_std, dtype=c.params_dtype)
        if c.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=c.params_dtype)
            P.mark(self.position_embeddings.weight, ("normal", c.init_method_std))
        if c.num_tokentypes > 0:
            self.tokentype_embeddings = nn.Embedding(c.num_tokentypes, c.hidden_size, dtype=c.params_dtype)
            P.mark(self.tokentype_embeddings.weight, ("normal", c.init_method_std))

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):  # [b, s]
        if self.reduce_scatter:
            x = self.word_embeddings(input_ids, reduce_scatter=True)  # [s/tp, b, h]
            return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=True)
        x = self.word_embeddings(input_ids)  # [b, s, h]
        if hasattr(self, "position_embeddings"):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            x = x + self.tokentype_embeddings(tokentype_ids)
        x = rearrange(x, "b s h -> s b h").contiguous()
        if self.c.sequence_parallel:
            x = P.scatter_to_sp(x, P.tp_of(self.grid))  # [s/tp, b, h]
        return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=self.c.sequence_parallel)


class Model(nn.Module):
    """GPT. forward(input_ids [b, s], labels=None) -> logits [b, s, vocab_size], or per-token loss [b, s].

    Pipeline stages: `pre_process` owns the embedding, `post_process` the final norm and output layer;
    `layer_offset`/`num_layers` pick this stage's layers (global layer numbers keep initialization layout-free).
    Also the skeleton bert.py, t5.py, retro.py and mamba.py extend (Megatron's LanguageModule): __init__ checks the
    layout, makes the RNG tracker and embedding, then calls the seams they override — `build_decoder` (the layers),
    `build_output_layer` (output layer and heads), `init_params` (once, last) — and `logits` at run time."""

    def __init__(self, config: Config, grid=None, pre_process=True, post_process=True, layer_offset=0,
                 num_layers=None):
        super().__init__()
        tp, pp, ep = (grid.tp_size, grid.pp_size, grid.ep_size) if grid is not None else (1, 1, 1)
        config.check_layout(tp, pp, ep)
        if grid is not None and grid.cp_size > 1:  # CP lives in transformer.Attention inside gpt's Decoder
            if type(self).build_decoder is not Model.build_decoder:
                raise ValueError(f"{type(self).__module__}.Model builds its own layer stack: context parallelism "
                                 f"(cp={grid.cp_size}) covers the models built on gpt's Decoder (GPT, BERT)")
            config.check_context_parallel(grid.cp_size, tp)
        if config.sequence_parallel and tp == 1:  # SP is a TP feature: a no-op without TP
            config = dataclasses.replace(config, sequence_parallel=False)
        c = self.config = config
        self.grid, self.pre_process, self.post_process, self.layer_offset = grid, pre_process, post_process, layer_offset
        self.rng = P.RNGTracker(c.seed, grid)
        self.input_tensor = None  # pipeline stages > 0 receive hidden states instead of ids
        mtp = post_process and bool(c.mtp_num_layers)  # MTP: the last stage embeds too (Megatron's mtp_process)
        if pre_process or mtp:
            self.embedding = Embedding(c, grid, self.rng)
        self.decoder = self.build_decoder(c, grid, layer_offset, c.num_layers if num_layers is None else num_layers)
        if post_process:
            self.build_output_layer(c, grid)
        if mtp:
            self.mtp = deepseek.MTPBlock(c, grid, self.rng, self.attention_class())
        if pre_process != post_process and c.mtp_num_layers:  # both pipeline ends hold the whole embedding
            for p in self.embedding.parameters():
                p.shared_embedding = True
        elif c.share_embeddings_and_output_weights and pre_process != post_process:  # one copy of two
            (self.embedding.word_embeddings if pre_process else self.output_layer).weight.shared_embedding = True
        self.init_params()

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        """This stage's layer stack (global layers layer_offset ... + num_layers − 1), final norm on the last stage."""
        return Decoder(c, grid, self.rng, num_layers, self.post_process, layer_offset, self.attention_class())

    def attention_class(self):
        """The layers' self-attention: transformer.Attention, or MLA (deepseek.py) with multi_latent_attention."""
        return deepseek.MLASelfAttention if self.config.multi_latent_attention else Attention

    def build_output_layer(self, c: Config, grid):
        """The last stage's output layer [h -> V/tp] (no weight of its own when tied to the embedding here)."""
        self.output_layer = P.ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, grid, bias=False, std=c.init_method_std, dtype=c.params_dtype,
            sequence_parallel=c.sequence_parallel,
            skip_weight=c.share_embeddings_and_output_weights and hasattr(self, "embedding"))

    def init_params(self):
        """Fill every parameter from (seed, its global name), so any layout holds the same model (parallel.py)."""
        P.init_params(self, self.config.seed, self.grid, rename=self.global_name)

    def global_name(self, name: str) -> str:
        """Local parameter name -> the name it has in the whole (unsplit) model."""
        name = P.expert_global_name(name, self.grid, self.config.num_experts)  # local expert i -> global index
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(i) + self.layer_offset}.{rest}"
        if name == "output_layer.weight" and self.config.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"  # a last stage's copy of the tied embedding
        return name

    def rope(self, s, device):
        """(cos, sin) [s, 1, 1, r] of the position embedding (scaled as the config says: rope.py), or None. MLA
        rotates only its decoupled RoPE part, qk_pos_emb_head_dim dims."""
        c = self.config
        return rope_for(c, s, device, d=c.qk_pos_emb_head_dim if c.multi_latent_attention else None)

    def check_input(self, input_ids, what: str = "sequence"):
        c, tp = self.config, (self.grid.tp_size if self.grid is not None else 1)
        s = input_ids.shape[1]
        if c.position_embedding_type == "learned_absolute" and s > c.max_position_embeddings:
            raise ValueError(f"{what} length {s} > max_position_embeddings={c.max_position_embeddings}")
        cp = self.grid.cp_size if self.grid is not None else 1
        if cp > 1 and (s % (2 * cp) or c.sequence_parallel and s // cp % tp):
            raise ValueError(f"context parallelism needs the {what} length {s} divisible by 2 x cp = {2 * cp}"
                             + (f" and by cp x tp = {cp * tp} (sequence parallelism)" if c.sequence_parallel else ""))
        if c.sequence_parallel and s % tp:
            raise ValueError(f"sequence parallelism needs the {what} length {s} divisible by tp={tp}")

    def rope_at(self, position_ids):
        """RoPE angles of explicit positions [b|1, s] (packed documents, decoding after a cache): [s, b|1, 1, d]."""
        rope = self.rope(int(position_ids.max()) + 1, position_ids.device)
        return None if rope is None else tuple(rearrange(t[position_ids], "b s 1 1 d -> s b 1 d") for t in rope)

    def forward(self, input_ids, labels=None, position_ids=None, mask=None, inference_context=None):
        """position_ids [b, s] / mask bool [b, 1, s, s] (True = attend): packed documents (data.Packing), else 0..s-1
        and causal. inference_context (transformer.InferenceContext): the KV cache; input_ids are the positions
        after the cached ones."""
        self.check_input(input_ids)
        s, dev = input_ids.shape[1], input_ids.device
        if inference_context is not None and position_ids is None:
            position_ids = torch.arange(s, device=dev)[None] + inference_context.sequence_len_offset  # [1, s]
        rope = self.rope(s, dev) if position_ids is None else self.rope_at(position_ids)
        # context parallelism: this rank's 2 of the 2·cp sequence chunks, positions and labels with them [b, s/cp]
        input_ids, labels, position_ids, rope, mask = P.get_batch_on_this_cp_rank(
            self.grid, input_ids, labels, position_ids, rope, mask)
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor  # [s(/cp)(/tp), b, h]
        x = self.decoder(x, rope=rope, mask=mask, inference_context=inference_context)
        if inference_context is not None:
            inference_context.sequence_len_offset += s
        if hasattr(self, "mtp") and labels is not None:  # the MTP loss joins backward through x (deepseek.py)
            x = self.mtp(x, input_ids, labels, self.embedding, self.postprocess, rope=rope, mask=mask)
        return self.postprocess(x, labels) if self.post_process else x

    def logits(self, x):
        """Final hidden states [s(/tp), b, h] -> this rank's logits [s, b, V/tp] (the output layer, tied or not)."""
        tied = hasattr(self, "embedding") and self.config.share_embeddings_and_output_weights
        return self.output_layer(x, weight=self.embedding.word_embeddings.weight if tied else None)

    def postprocess(self, x, labels=None):
        """Final hidden states [s(/tp), b, h] -> logits [b, s, vocab_size] or per-token loss [b, s]."""
        logits = self.logits(x)  # [s, b, V/tp]
        if labels is None:
            logits = P.gather_from_tp(logits, P.tp_of(self.grid))  # [s, b, V]
            return rearrange(logits, "s b v -> b s v")[..., : self.config.vocab_size]
        loss = P.vocab_parallel_cross_entropy(logits, labels.t(), self.grid, self.config.label_smoothing)  # [s, b]
        return loss.t()  # [b, s]


def sample_next(logits, temperature: float, top_k: int | None):
    """The next token [b, 1] from the last position's logits [b, V]: greedy at temperature 0, else top-k sampling."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1)


def cached_next_logits(model: Model, window: int):
    """next_logits(ids) with a KV cache (transformer.InferenceContext): the first call runs the whole prompt once
    (prefill), each later call only the newest token (decode), attending to the cached keys and values. Past
    `window` tokens the recompute path slides its window, every position shifts, and no cached key stays valid:
    from there on each step recomputes the last `window` tokens exactly as the recompute path does."""
    cache = InferenceContext(max_sequence_length=window)

    def next_logits(ids):  # ids [b, t]: everything so far, of which the cache holds the first sequence_len_offset
        if ids.shape[1] > window:
            return model(ids[:, -window:])[:, -1, :]
        return model(ids[:, cache.sequence_len_offset:], inference_context=cache)[:, -1, :]
    return next_logits


@torch.no_grad()
def generate(model: Model, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, eod: int | None = None, next_logits=None, use_cache: bool = True) -> torch.Tensor:
    """Sample `max_new_tokens` tokens after `ids` [b, s]. `next_logits(ids)` gives the last position's logits
    [b, V]; by default from a KV cache (`cached_next_logits`: O(t) work per token). use_cache=False is the oracle:
    a full recompute of the (windowed) sequence each step, O(t²), short and obviously right (tests/test_kv_cache.py
    checks the two agree token for token). mamba.generate passes its recurrent step, t5.generate its decoder over
    one encoder output."""
    was_training = model.training
    model.eval()
    window = model.config.max_position_embeddings
    if next_logits is None:
        next_logits = (cached_next_logits(model, window) if use_cache
                       else lambda ids: model(ids[:, -window:])[:, -1, :])
    for _ in range(max_new_tokens):
        nxt = sample_next(next_logits(ids), temperature, top_k)  # [b, 1]
        ids = torch.cat([ids, nxt], dim=1)
        if eod is not None and bool((nxt == eod).all()):
            break
    model.train(was_training)
    return ids


# ---------------------------------------------------------------------------------------------- checkpoints (convert.py)
def from_hf(hf, grid=None, dtype=None) -> Model:
    """A Model with the weights of a `transformers` GPT2LMHeadModel, LlamaForCausalLM or DeepseekV3ForCausalLM
    (MLA, deepseek.py) — the logits match."""
    to_ours = convert.deepseek_from_hf if hf.config.model_type == "deepseek_v3" else convert.gpt_from_hf
    config, full = to_ours(hf, Config, dtype)
    return convert.load(Model(config, grid), full)


def from_megatron(state_dict: dict, config: Config, grid=None) -> Model:
    """A Model with the weights of a Megatron-core GPTModel, from its full state dict. Our names and layouts are
    Megatron's local-spec ones, so this is a rename (what it handles: convert.megatron_state)."""
    return convert.load(Model(config, grid), convert.megatron_state(state_dict, config))
