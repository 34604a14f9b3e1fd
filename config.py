"""config.py — what a model is: the Config every model file shares (Megatron's TransformerConfig fields and their
checks), the model-file contract (what a model file declares, and `model_file(name)`, the one function that reads
it, every hook with its default), and the task contract (TASKS: which module runs each --task).

Config mirrors Megatron-LM's `megatron/core/transformer/transformer_config.py` (and MLATransformerConfig): Megatron's
field names, derived fields filled in `__post_init__`, every invalid setting refused there with one line naming the
values. gpt.Config is this class; bert.py, t5.py, mamba.py, retro.py and llava.py extend it.
The contract mirrors Megatron-LM's model providers (what pretrain_gpt.py hands training.py's pretrain():
model_provider, forward_step_func, extra_args_provider, train_valid_test_datasets_provider). `--model NAME` imports
NAME.py (a model file here, or your own on the Python path) and the infrastructure (arguments.py, checkpoint.py,
train.py, tools.py, the packages) asks it everything through the ModelFile this returns; none of them names a model
(tests/test_repo.py checks it). A model file must define
  Config   a dataclass extending config.Config, whose UNSUPPORTED (feature -> why not) and FULL_RECOMPUTE class
           attributes declare what the model cannot do
  Model    Model(config, grid=None, pre_process=True, post_process=True, layer_offset=0, num_layers=None): extend
           gpt.Model (DESIGN.md §1, "One model skeleton")
and may define any hook named in ModelFile; a hook it leaves out takes the default shown there.

Run:    .venv/bin/python -c "import config, gpt; print(gpt.Config()); print(config.model_file('bert'))"
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

import data
import metrics
import parallel as P


class ConfigError(ValueError):
    """A bad configuration: a flag, a combination of flags, or a Config field. The message is one line naming the
    values; train.py prints it as `train.py: error: ...` before any process group exists."""


# The activations a Config may name (transformer.py's MLP and the ViT apply them)
ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu,
               "quick_gelu": lambda x: x * F.sigmoid(1.702 * x)}  # CLIP's (Radford et al. 2021; Megatron's quick_gelu)


@dataclasses.dataclass
class Config:
    """Megatron's TransformerConfig field names. Derived fields are filled in __post_init__."""
    POSITION_EMBEDDING_TYPES: ClassVar[tuple] = ("learned_absolute", "rope", "yarn", "none")  # a model file may add its own
    FULL_RECOMPUTE: ClassVar[bool] = True  # its layer stack runs transformer.Decoder.forward (False: a model file's own)
    # What the model does not do, and why (the one line the refusal prints). A model file's Config adds its own entries;
    # the infrastructure asks (contract.ModelFile.unsupported) and never names a model. The features:
    #   pipeline_parallel, context_parallel, document_packing (--reset-position-ids / --reset-attention-mask /
    #   --eod-mask-loss), post_training (--task sft/dpo/kto/rm), sft_packing (--packing), multi_latent_attention,
    #   multi_token_prediction, prefix_caching (serving's --enable-prefix-caching)
    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int | None = None  # None = multi-head; 1 = multi-query; else grouped-query attention
    kv_channels: int | None = None  # head dim d; None = hidden_size / num_attention_heads
    ffn_hidden_size: int | None = None  # None = 4·h
    vocab_size: int = 8192
    make_vocab_size_divisible_by: int = 128
    mask_vocab_padding: bool = False  # the padded rows out of the loss's softmax: a Hugging Face model's loss (interop/hf.py)
    max_position_embeddings: int = 1024
    position_embedding_type: str = "learned_absolute"  # "learned_absolute" | "rope" | "yarn" | "none"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False  # every norm scales by 1 + gamma, gamma starts at 0 (Norm)
    qk_layernorm: bool = False  # a norm over each head's d dims on q and on k, before RoPE (transformer.Attention)
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
    moe_router_load_balancing_type: str = "aux_loss"  # "aux_loss" (micro-batch) | "seq_aux_loss" (sequence) | "none"
    moe_token_drop_policy: str = "probs"  # capacity keeps each expert's most probable tokens, or ("position") its first
    moe_shared_expert_intermediate_size: int | None = None  # None = no shared expert
    moe_shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x·gate_weightᵀ), a [1, h] weight
    # (Megatron's SharedExpertMLP gate, Qwen2-MoE's shared_expert_gate); as in Megatron, no effect without a shared expert
    # Position scaling (transformer.py's rope section; Megatron's --rotary-percent, --rotary-seq-len-interpolation-factor,
    # --use-rope-scaling, --rope-scaling-factor, and the --yarn-* flags of position_embedding_type "yarn")
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
        if self.mask_vocab_padding and self.label_smoothing:
            raise ValueError(f"label_smoothing={self.label_smoothing} with mask_vocab_padding: smoothing spreads "
                             "probability over the padded rows that the mask removes")
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
                        ("moe_token_dispatcher_type", ("allgather", "alltoall")),
                        ("moe_router_load_balancing_type", ("aux_loss", "seq_aux_loss", "none")),
                        ("moe_token_drop_policy", ("probs", "position"))]
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
            if self.position_embedding_type not in ("rope", "yarn"):  # Megatron's MLA rope_type: rope | yarn
                raise ValueError(f"multi_latent_attention needs position_embedding_type='rope' or 'yarn', not "
                                 f"{self.position_embedding_type!r}")
            if self.position_embedding_type == "yarn" and not self.yarn_correction_range_round_to_int:
                raise ValueError("yarn_correction_range_round_to_int=False: Megatron's MLA YarnRotaryEmbedding always "
                                 "rounds the correction range")
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
        if pp > 1 and "pipeline_parallel" in self.UNSUPPORTED:
            raise ValueError(f"pipeline-model-parallel size {pp}: {self.UNSUPPORTED['pipeline_parallel']}")
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

    def stage_layers(self, num_layers: int, grid, vp: int = 1, chunk: int = 0) -> tuple[int, int]:
        """(first global layer, layer count) of virtual chunk `chunk` on this rank's pipeline stage: Megatron's even
        split (parallel.stage_layers; a model file with its own stage cuts overrides this)."""
        return P.stage_layers(num_layers, grid, vp, chunk)

    def check_context_parallel(self, cp: int, tp: int = 1):
        """Refuse what context parallelism (parallel.py section 12) does not cover, naming the values."""
        if cp == 1:
            return
        if "context_parallel" in self.UNSUPPORTED:
            raise ValueError(f"context-parallel size {cp}: {self.UNSUPPORTED['context_parallel']}")
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


# ==================================================================================================== the contract
ROOT = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------- the defaults
def no_arguments(parser) -> None:
    """A model file without flags of its own."""


def token_windows(source, doc_ids, args, tok, seed):
    """Samples: windows of --seq-length + 1 tokens of the shuffled document stream (data.GPTDataset)."""
    return data.GPTDataset(source, doc_ids, args.seq_length, seed)


def next_token_loss(model, mb, pack=None):
    """The next-token recipe's loss: micro-batch [b, s+1] -> the SUM of its b·s next-token losses (a scalar). With
    `pack` (data.Packing: --reset-position-ids, --reset-attention-mask, --eod-mask-loss) documents packed in a row."""
    if pack is None:
        out = model(mb[:, :-1], mb[:, 1:])  # [b, s] (an inner pipeline stage: its output [s, b, h], sent on as is)
        return out.float().sum() if model.post_process else out
    mask, loss_mask, position_ids = pack(mb[:, :-1])
    out = model(mb[:, :-1], mb[:, 1:], position_ids=position_ids, mask=mask)
    return (out * loss_mask).sum() if model.post_process else out  # the float32 mask: a sum in >= float32


def next_token_recipe(batch, args, corpus):
    """(loss_func(model, mb) -> the SUM of the micro-batch's losses, the global count that divides it, DESIGN.md §2)
    for one global batch [gbs, s+1] of a causal language model: every next token, or with packed documents those
    data.Packing counts. `corpus` (data.Corpus) gives the end-of-document id."""
    pack = data.Packing.from_args(args, corpus.eod)
    if pack is None:
        return next_token_loss, batch[:, 1:].numel()
    return functools.partial(next_token_loss, pack=pack), pack.num_loss_tokens(batch)


# ---------------------------------------------------------------------------------------------- the contract
@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A model file, as the infrastructure sees it: its Config and Model, and each hook (its own or the default)."""
    name: str  # the --model name: the module's
    Config: type
    Model: type
    # flags: add_arguments(parser) adds the model's own flags (Megatron's extra_args_provider); ARCH_FLAGS names those
    # of them that shape the weights (a checkpoint must match them, checkpoint.check_same_model); TRAIN_DEFAULTS are
    # its defaults for train.py's flags (its default run); OPTIMIZER_DEFAULTS {optimizer: defaults} those that replace
    # them where another --optimizer than the one TRAIN_DEFAULTS names runs (its learning rates: else train.py's)
    add_arguments: Callable = no_arguments
    ARCH_FLAGS: tuple = ()
    TRAIN_DEFAULTS: dict = dataclasses.field(default_factory=dict)
    OPTIMIZER_DEFAULTS: dict = dataclasses.field(default_factory=dict)
    # config_fields(args, tok) -> Config fields the model file derives from its flags and the tokenizer (tok None:
    # not known yet), beside those arguments.model_config copies by name
    config_fields: Callable = lambda args, tok: {}
    # derived_flags(args) -> {flag: value} the model file derives from its other flags (Megatron's validate_args for
    # its own flags): arguments.check_args writes them into the checked flags, so a checkpoint records what ran
    derived_flags: Callable = lambda args: {}
    # MEGATRON_SPECS: Megatron's --spec values (module, function) whose layers the model file builds: --spec with one
    # of them is accepted with a note, any other --spec is refused (interop/megatron_flags.py's FALLBACKS / REFUSED)
    MEGATRON_SPECS: tuple = ()
    # data: dataset(source, doc_ids, args, tok, seed) -> its samples (ds[i]: a numpy row; data.global_batch stacks)
    dataset: Callable = token_windows
    # the loss: batch_recipe(batch, args, corpus) -> (loss_func(model, mb) -> SUM of its losses, the global count);
    # on an inner pipeline stage (model.post_process False) loss_func returns the model's output as is (what the stage
    # sends on): it computes nothing else there
    batch_recipe: Callable = next_token_recipe
    # evaluation: eval_counts(model, mb) -> {name: (hits, total)}, extra validation metrics (None: the loss only)
    eval_counts: Callable | None = None
    # metrics: flops(config, batch, seq) -> the model FLOPs of one iteration (Megatron's transformer count)
    flops: Callable = metrics.flops
    # tools.py: sample(model, tok, prompt, max_new_tokens, temperature, top_k) -> text; a causal LM's
    # sample_ids(model, tok, ids, max_new_tokens, temperature, top_k, stop=None) -> the token ids it samples after
    # the prompt's token ids, through the end-of-document token or one of the `stop` ids (tools.py sample --chat: an
    # SFT model's answer to a chat prompt, tokenizer_files.chat_stop_ids);
    # to_hf(config, state) -> (Hugging Face config.json dict, {name: tensor}). None: it does not
    # (UNSUPPORTED["sample"/"export"] says why)
    sample: Callable | None = None
    sample_ids: Callable | None = None
    to_hf: Callable | None = None
    # serving: image_inputs(config) -> (the token ids that stand for one image in a prompt, image -> {forward's argument:
    # tensor}, a PIL image made the model's input): a chat message's image (serving/server.py); None: text only
    image_inputs: Callable | None = None
    # HF_CONVERTERS: {Hugging Face model_type: converter(src, Config, dtype) -> (Config, full state dict)} — the
    # folders tools.py import-hf reads as this model (interop/hf.py)
    HF_CONVERTERS: dict = dataclasses.field(default_factory=dict)
    # HF_LAYOUTS: {model_type: {"renames": [(regex, replacement)], "experts": (gate, up, down), "copies": [(regex,
    # [source names])]}} — how the folder stores what a live `transformers` model holds otherwise (hf.memory_state),
    # and the tensors it stores twice (hf.copies_of); absent: the same names
    HF_LAYOUTS: dict = dataclasses.field(default_factory=dict)

    def unsupported(self, feature: str) -> str | None:
        """Why the model does not support `feature` (a key of config.Config.UNSUPPORTED), or None if it does."""
        return self.Config.UNSUPPORTED.get(feature)

    def refuse(self, feature: str, what: str):
        """ConfigError `--model NAME with WHAT: why` when the model does not support `feature`."""
        if (why := self.unsupported(feature)) is not None:
            raise ConfigError(f"--model {self.name} with {what}: {why}")


HOOKS = [f.name for f in dataclasses.fields(ModelFile) if f.name not in ("name", "Config", "Model")]


# ---------------------------------------------------------------------------------------------- the task contract
# --task NAME (other than pretrain): the module that runs it, named here only; train.py asks task_module(NAME) and
# names none. A task module defines
#   build_task_datasets(args, tok) -> (train, valid or None): the task's samples, in place of the corpus's windows
#   setup_task(args, start, chunks, build, mesh) -> (frozen, pointer): what the task adds to this rank's model chunks
#       before the optimizer is made (a value head; the frozen models beside the policy), and the reference model's
#       checkpoint for meta.json ("reference_base"; None without one)
#   Task(args, chunks, grid, shape, dtype, eod, device, autocast, frozen, corpus=, iteration=): per global batch,
#       prepare(batch, split) -> (this DP rank's micro-batches, loss_func as batch_recipe's, the global count, the p2p
#       shape); metrics(split, prefix) -> {name: mean} (a collective); `sequences`, the sequences per sample that the
#       policy's pass trains on (tokens/s, FLOPs)
TASKS = {"sft": "posttraining.recipes", "dpo": "posttraining.recipes", "kto": "posttraining.recipes",
         "rm": "posttraining.recipes", "grpo": "posttraining.rl", "ppo": "posttraining.rl"}


def task_module(task: str):
    """--task's module (TASKS), imported; None for pretraining."""
    return None if task == "pretrain" else importlib.import_module(TASKS[task])


def model_files() -> list[str]:
    """This repository's model files: the top-level files that define `class Model` (read as text, nothing imported)."""
    return [name for name, (model, _) in _scan(_top_level()) if model]


def default_model() -> str:
    """--model's default: the model file that declares `DEFAULT_MODEL = True` (train.py's default run trains it)."""
    found = [name for name, (_, default) in _scan(_top_level()) if default]
    if len(found) != 1:
        raise ConfigError(f"exactly one model file must declare DEFAULT_MODEL = True, found {found}")
    return found[0]


def _top_level() -> tuple:
    """The top-level .py files, each with its size and modification time (what _scan's cache is keyed on)."""
    return tuple(sorted((p.stem, p.stat().st_mtime_ns, p.stat().st_size) for p in ROOT.glob("*.py")))


@functools.lru_cache(maxsize=4)
def _scan(files: tuple) -> list[tuple[str, tuple[bool, bool]]]:
    """Each top-level file: (defines `class Model`, declares `DEFAULT_MODEL = True`), read once per version of the
    files (every parse_args asks, and a run parses its flags more than once)."""
    text = {name: (ROOT / f"{name}.py").read_text() for name, *_ in files}
    return [(name, (bool(re.search(r"^class Model\b", t, re.M)), bool(re.search(r"^DEFAULT_MODEL = True\b", t, re.M))))
            for name, t in text.items()]


@functools.cache
def model_file(name: str) -> ModelFile:
    """--model NAME: import NAME and read its contract; ConfigError naming the problem if it is not a model file."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        raise ConfigError(f"--model {name!r}: a model is named by its file's module name (one of {model_files()})")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ConfigError(f"--model {name}: no model file {name}.py (this repository has {', '.join(model_files())})"
                          ) from None
    kinds = {k: getattr(module, k, None) for k in ("Config", "Model")}
    if not all(isinstance(v, type) for v in kinds.values()):
        missing = [k for k, v in kinds.items() if not isinstance(v, type)]
        raise ConfigError(f"--model {name}: {module.__file__} is not a model file (it defines no class "
                          f"{' or '.join(missing)}; see config.py)")
    return ModelFile(name=name, **kinds, **{k: getattr(module, k) for k in HOOKS if hasattr(module, k)})
