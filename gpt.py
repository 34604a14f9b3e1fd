"""gpt.py — the reference decoder-only transformer (GPT-2 and Llama families), tensor- and sequence-parallel.

Mirrors Megatron-LM's `megatron/core/models/gpt/gpt_model.py` and `models/common/embeddings/` (its layers, from
`transformer/`, are transformer.py's; its rotary angles rope.py's), with Megatron's parameter names and layouts, so a
Megatron-core checkpoint loads by name. gpt.Model is the skeleton bert.py, t5.py, retro.py and mamba.py extend (their
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
import parallel as P
from rope import rope_cos_sin
from transformer import ACTIVATIONS, Decoder


@dataclasses.dataclass
class Config:
    """Megatron's TransformerConfig field names. Derived fields are filled in __post_init__."""
    POSITION_EMBEDDING_TYPES: ClassVar[tuple] = ("learned_absolute", "rope", "none")  # a model file may add its own
    num_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_query_groups: int | None = None  # None = multi-head; 1 = multi-query; else grouped-query attention
    kv_channels: int | None = None  # head dim d; None = hidden_size / num_attention_heads
    ffn_hidden_size: int | None = None  # None = 4·h
    vocab_size: int = 8192
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 1024
    position_embedding_type: str = "learned_absolute"  # "learned_absolute" | "rope" | "none"
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
                   ("activation", tuple(ACTIVATIONS))]
        if self.num_experts is not None:
            choices += [("moe_router_score_function", ("softmax", "sigmoid")),
                        ("moe_token_dispatcher_type", ("allgather", "alltoall"))]
        for field, allowed in choices:
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not one of {allowed}")
        self.moe_ffn_hidden_size = self.moe_ffn_hidden_size or self.ffn_hidden_size
        if self.num_experts is not None:
            if self.num_experts < 1 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"moe_router_topk={self.moe_router_topk} must be in [1, num_experts={self.num_experts}]")
            f = self.moe_layer_freq
            if isinstance(f, (list, tuple)) and len(f) != self.num_layers:
                raise ValueError(f"moe_layer_freq has {len(f)} entries for num_layers={self.num_layers}")
            self.check_deepseek_routing()
        self.padded_vocab_size = P.pad_vocab(self.vocab_size, self.make_vocab_size_divisible_by)
        self.output_std = self.init_method_std / math.sqrt(2.0 * self.num_layers)  # scaled init of proj and fc2

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
                ("ffn_hidden_size", self.ffn_hidden_size), ("padded vocabulary", self.padded_vocab_size)]

    def check_layout(self, tp: int = 1, pp: int = 1, ep: int = 1):
        """Refuse a parallel layout this model cannot take, naming the values — before any process group exists."""
        if self.num_experts and self.num_experts % ep:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by expert-model-parallel size {ep}")
        for what, v in self.tp_split_sizes():
            if v % tp:
                raise ValueError(f"{what}={v} is not divisible by tensor-model-parallel size {tp}")
        if self.num_layers % pp:
            raise ValueError(f"num_layers={self.num_layers} is not divisible by pipeline-model-parallel size {pp}")


# ---------------------------------------------------------------------------------------------- the GPT model
class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) + optional learned positions + optional token types; output [s(/tp), b, h]."""

    def __init__(self, c: Config, grid=None, rng=None):
        super().__init__()
        self.c, self.grid, self.rng = c, grid, rng
        self.word_embeddings = P.VocabParallelEmbedding(c.padded_vocab_size, c.hidden_size, grid,
                                                        std=c.init_method_std, dtype=c.params_dtype)
        if c.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=c.params_dtype)
            P.mark(self.position_embeddings.weight, ("normal", c.init_method_std))
        if c.num_tokentypes > 0:
            self.tokentype_embeddings = nn.Embedding(c.num_tokentypes, c.hidden_size, dtype=c.params_dtype)
            P.mark(self.tokentype_embeddings.weight, ("normal", c.init_method_std))

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):  # [b, s]
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
        if config.sequence_parallel and tp == 1:  # SP is a TP feature: a no-op without TP
            config = dataclasses.replace(config, sequence_parallel=False)
        c = self.config = config
        self.grid, self.pre_process, self.post_process, self.layer_offset = grid, pre_process, post_process, layer_offset
        self.rng = P.RNGTracker(c.seed, grid)
        self.input_tensor = None  # pipeline stages > 0 receive hidden states instead of ids
        if pre_process:
            self.embedding = Embedding(c, grid, self.rng)
        self.decoder = self.build_decoder(c, grid, layer_offset, c.num_layers if num_layers is None else num_layers)
        if post_process:
            self.build_output_layer(c, grid)
        if c.share_embeddings_and_output_weights and pre_process != post_process:  # a pipeline end: one copy of two
            (self.embedding.word_embeddings if pre_process else self.output_layer).weight.shared_embedding = True
        self.init_params()

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        """This stage's layer stack (global layers layer_offset ... + num_layers − 1), final norm on the last stage."""
        return Decoder(c, grid, self.rng, num_layers, self.post_process, layer_offset)

    def build_output_layer(self, c: Config, grid):
        """The last stage's output layer [h -> V/tp] (no weight of its own when tied to the embedding here)."""
        self.output_layer = P.ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, grid, bias=False, std=c.init_method_std, dtype=c.params_dtype,
            sequence_parallel=c.sequence_parallel, skip_weight=c.share_embeddings_and_output_weights and self.pre_process)

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
        c = self.config
        return rope_cos_sin(s, c.kv_channels, c.rotary_base, device) if c.position_embedding_type == "rope" else None

    def check_input(self, input_ids, what: str = "sequence"):
        c, tp = self.config, (self.grid.tp_size if self.grid is not None else 1)
        s = input_ids.shape[1]
        if c.position_embedding_type == "learned_absolute" and s > c.max_position_embeddings:
            raise ValueError(f"{what} length {s} > max_position_embeddings={c.max_position_embeddings}")
        if c.sequence_parallel and s % tp:
            raise ValueError(f"sequence parallelism needs the {what} length {s} divisible by tp={tp}")

    def forward(self, input_ids, labels=None, position_ids=None, mask=None):
        self.check_input(input_ids)
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor  # [s(/tp), b, h]
        x = self.decoder(x, rope=self.rope(input_ids.shape[1], input_ids.device), mask=mask)
        return self.postprocess(x, labels) if self.post_process else x

    def logits(self, x):
        """Final hidden states [s(/tp), b, h] -> this rank's logits [s, b, V/tp] (the output layer, tied or not)."""
        tied = self.pre_process and self.config.share_embeddings_and_output_weights
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


@torch.no_grad()
def generate(model: Model, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, eod: int | None = None, next_logits=None) -> torch.Tensor:
    """Sample `max_new_tokens` tokens after `ids` [b, s]. `next_logits(ids)` gives the last position's logits
    [b, V]; by default a full recompute of the (windowed) sequence each step: short and obviously right
    (mamba.generate passes its O(1) recurrent step instead, t5.generate its decoder over one encoder output)."""
    was_training = model.training
    model.eval()
    window = model.config.max_position_embeddings
    next_logits = next_logits or (lambda ids: model(ids[:, -window:])[:, -1, :])
    for _ in range(max_new_tokens):
        nxt = sample_next(next_logits(ids), temperature, top_k)  # [b, 1]
        ids = torch.cat([ids, nxt], dim=1)
        if eod is not None and bool((nxt == eod).all()):
            break
    model.train(was_training)
    return ids


# ---------------------------------------------------------------------------------------------- checkpoints (convert.py)
def from_hf(hf, grid=None, dtype=None) -> Model:
    """A Model with the weights of a `transformers` GPT2LMHeadModel or LlamaForCausalLM (logits match)."""
    config, full = convert.gpt_from_hf(hf, Config, dtype)
    return convert.load(Model(config, grid), full)


def from_megatron(state_dict: dict, config: Config, grid=None) -> Model:
    """A Model with the weights of a Megatron-core GPTModel, from its full state dict. Our names and layouts are
    Megatron's local-spec ones, so this is a rename (what it handles: convert.megatron_state)."""
    return convert.load(Model(config, grid), convert.megatron_state(state_dict, config))
