"""transformer.py — the transformer's building blocks every model here shares: norms, attention, MLP, layer, stack.

Mirrors Megatron-LM's `megatron/core/transformer/` — `attention.py`, `mlp.py`, `transformer_layer.py`,
`transformer_block.py` — with the same parameter names and tensor layouts, so a Megatron-core checkpoint loads by
name (fused QKV grouped per query group, SwiGLU fc1 as [gate; up]). Read it top down: the layer stack (Decoder ->
TransformerLayer -> Attention, MLP -> Norm), then the layers' optional parts (zero-centered norms, Mamba's gated norm,
the fused SwiGLU, MoE's shared expert, the KV cache), activation recomputation (section "recomputation": Decoder's
full, Attention's selective, with the RNG replay of Megatron's `tensor_parallel/random.py` CheckpointFunction), the
rotary position embeddings with their context-extending scalings (section "rotary position embeddings"), and T5's
learned relative-position bias (section "relative position embeddings").
Papers: Vaswani et al. 2017 (attention); Touvron et al. 2023 (Llama: RMSNorm, SwiGLU); Ainslie et al. 2023 (GQA);
        Shoeybi et al. 2019 (Megatron-LM tensor parallelism: the column/row-parallel split of attention and MLP);
        Chen et al. 2016 and Korthikanti et al. 2022 (activation recomputation, full and selective).

Run:    .venv/bin/python -m pytest -q tests/test_tensor_parallel.py tests/test_long_context.py

Dimension glossary
  b batch    s sequence (s/tp under sequence parallelism)    h hidden
  n attention heads (local: n/tp)   g query groups = key/value heads (local: g/tp)   d head dim (kv_channels)
  f ffn hidden size (f/tp per rank)
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import parallel as P
from config import ACTIVATIONS


# ---------------------------------------------------------------------------------------------- the layer stack, top down
class Decoder(nn.Module):
    """This stage's layers (Megatron's TransformerBlock), then the final norm on the last stage. cross: the layers
    also attend to `context` (an encoder's output: T5's decoder; full recomputation does not pass it)."""

    def __init__(self, c, grid, rng, num_layers: int, post_process: bool, layer_offset: int = 0, attention=None,
                 cross: bool = False):
        super().__init__()
        self.c, self.rng = c, rng
        self.layers = nn.ModuleList([TransformerLayer(c, grid, rng, layer_offset + i, attention=attention, cross=cross)
                                     for i in range(num_layers)])
        self.final_layernorm = Norm(c) if post_process else None

    def forward(self, x, rope=None, mask=None, inference_context=None, context=None, context_mask=None):
        if self.c.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            x = self.recomputed(x, rope, mask, inference_context)
        else:
            for layer in self.layers:  # x [s(/tp), b, h]; the same mask (T5: its relative bias) enters every layer
                x = layer(x, rope=rope, mask=mask, inference_context=inference_context, context=context,
                          context_mask=context_mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x

    def recomputed(self, x, rope, mask, inference_context):
        """The layers under full recomputation (section "recomputation"), as --recompute-method says: uniform = the
        layers in chunks of recompute_num_layers, each chunk recomputed as one unit (only its input is kept);
        block = the first recompute_num_layers layers each recomputed, the rest not."""
        def run(start, end):  # layers start..end−1 as one function of (x, mask)
            def f(x, mask):
                for layer in self.layers[start:end]:
                    x = layer(x, rope=rope, mask=mask, inference_context=inference_context)
                return x
            return f

        n, L = self.c.recompute_num_layers, len(self.layers)
        if self.c.recompute_method == "uniform":
            for start in range(0, L, n):
                x = checkpoint(run(start, min(start + n, L)), self.rng, x, mask)
        else:  # block
            for i in range(L):
                x = checkpoint(run(i, i + 1), self.rng, x, mask) if i < n else run(i, i + 1)(x, mask)
        return x


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x))).

    apply_residual_connection_post_layernorm (legacy Megatron's flag): the residual branch starts from norm(x), not x.
    With it, a stack of these layers plus the final norm is exactly the post-LN transformer of original BERT with its
    norms shifted by one (layer i's input_layernorm = BERT's embedding LayerNorm for i = 0, else layer i−1's output
    LayerNorm) — see bert.hf_to_ours. cross: x + dropout(cross_attn(norm(x), context)) between the two
    (Megatron's pre_cross_attn_layernorm / cross_attention; T5's decoder layers)."""

    def __init__(self, c, grid=None, rng=None, layer_number: int = 0, moe: bool | None = None, attention=None,
                 cross: bool = False):
        super().__init__()
        self.c, self.rng = c, rng
        self.input_layernorm = Norm(c)
        self.self_attention = (attention or Attention)(c, grid, rng=rng)  # the seam: deepseek.MLASelfAttention
        self.pre_mlp_layernorm = Norm(c)
        if c.is_moe_layer(layer_number) if moe is None else moe:  # MoE (parallel.py section 10) instead of the MLP
            self.mlp = moe_layer(c, grid)
        else:
            self.mlp = MLP(c, grid)
        if cross:
            self.pre_cross_attn_layernorm = Norm(c)
            self.cross_attention = Attention(c, grid, cross=True, rng=rng)

    def drop(self, x):  # hidden dropout; under SP the activations are sequence shards -> model-parallel stream
        return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=self.c.sequence_parallel)

    def forward(self, x, rope=None, mask=None, inference_context=None, context=None, context_mask=None):
        post = self.c.apply_residual_connection_post_layernorm  # x [s(/tp), b, h]; context [sk(/tp), b, h]
        ln = self.input_layernorm(x)
        x = (ln if post else x) + self.drop(self.self_attention(ln, rope=rope, mask=mask,
                                                                inference_context=inference_context))
        if context is not None:  # no rope across the two sequences
            ln = self.pre_cross_attn_layernorm(x)
            x = (ln if post else x) + self.drop(self.cross_attention(ln, mask=context_mask, kv_input=context,
                                                                     causal=False))
        ln = self.pre_mlp_layernorm(x)
        return (ln if post else x) + self.drop(self.mlp(ln))


class Attention(nn.Module):
    """Multi-head / grouped-query attention, heads split over TP. Self-attention uses one fused `linear_qkv` whose
    output is grouped per query group, [q heads of the group; k; v] (Megatron's layout); cross-attention uses
    `linear_q` and `linear_kv` ([k; v] per group) on a separate key/value input."""

    def __init__(self, c, grid=None, cross: bool = False, rng=None):
        super().__init__()
        tp = grid.tp.size if grid is not None else 1
        h, d, n, g = c.hidden_size, c.kv_channels, c.num_attention_heads, c.num_query_groups
        self.n, self.g, self.d, self.rng, self.p = n // tp, g // tp, d, rng, c.attention_dropout
        self.recompute = c.recompute_granularity == "selective"
        self.scale = c.softmax_scale if c.softmax_scale is not None else 1.0 / math.sqrt(d)
        kw = dict(grid=grid, bias=c.add_qkv_bias, std=c.init_method_std, sequence_parallel=c.sequence_parallel,
                  dtype=c.params_dtype)
        if cross:
            self.linear_q = P.ColumnParallelLinear(h, n * d, **kw)
            self.linear_kv = P.ColumnParallelLinear(h, 2 * g * d, **kw)
        else:
            self.linear_qkv = P.ColumnParallelLinear(h, (n + 2 * g) * d, **kw)
        self.linear_proj = P.RowParallelLinear(n * d, h, grid, bias=c.add_bias_linear, std=c.output_std,
                                               sequence_parallel=c.sequence_parallel, dtype=c.params_dtype)
        if c.qk_layernorm and not cross:  # Megatron's q_layernorm / k_layernorm (self-attention only): over each
            # head's d dims, weights shared by the heads; a TP rank holds n/tp heads, so its gradient is partial
            # whatever SP is: summed over TP (Megatron's finalize_model_grads does the same for them)
            self.q_layernorm, self.k_layernorm = Norm(c, d, partial_over_tp=True), Norm(c, d, partial_over_tp=True)
        cp = grid is not None and grid.cp_size > 1  # context parallelism: K/V of the other cp ranks (parallel.py §12)
        self.cp_attention = P.context_parallel_attention(grid, c.cp_comm_type) if cp and not cross else None

    def forward(self, x, rope=None, mask=None, kv_input=None, causal=True, inference_context=None):
        """x [s(/tp), b, h] -> [s(/tp), b, h]. mask: bool [b|1, n|1, sq, sk] True = attend, or a float bias.
        inference_context: decoding with a KV cache — this call's positions follow the cached ones (rope holds their
        angles), their keys and values join the cache, and the queries attend to every cached position."""
        if kv_input is None:
            qkv = rearrange(self.linear_qkv(x), "s b (g m d) -> s b g m d", g=self.g, d=self.d)  # m = n/g + 2
            # split, not slices: its backward is one cat (three slices' would be three zero-filled qkv copies, summed)
            q, k, v = qkv.split([self.n // self.g, 1, 1], dim=3)
            q, k, v = rearrange(q, "s b g m d -> s b (g m) d"), k.squeeze(3), v.squeeze(3)  # [s, b, n, d], [s, b, g, d]
        else:
            q = rearrange(self.linear_q(x), "s b (n d) -> s b n d", d=self.d)
            k, v = rearrange(self.linear_kv(kv_input), "s b (g two d) -> two s b g d", two=2, d=self.d).unbind(0)
        if hasattr(self, "q_layernorm"):  # --qk-layernorm: each head's q and k normalised, before RoPE (Megatron's)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, d] -> [b, n, s, d] (a view)
        if getattr(inference_context, "paged_attention", False):  # serving/engine.py's paged cache reads its blocks
            o = inference_context.attend(self, q, k, v, self.scale)  # itself (serving/paged_attention.py)
            return self.linear_proj(o.permute(2, 0, 1, 3).flatten(2))  # [b, n, s, d] -> [s, b, (n d)]
        if inference_context is not None:  # decoding: this call's keys and values join the cached ones
            k, v, mask = with_cache(inference_context, self, q, k, v, mask, causal)  # k, v [b, g, t + s, d]
        if self.cp_attention is not None:  # context parallelism [b, n, s/cp, d]; causal as SDPA's: only without a mask
            o = self.cp_attention(q, k, v, mask, causal and mask is None, self.scale)
        elif self.recompute and self.training and torch.is_grad_enabled():  # selective recomputation
            o = checkpoint(self.core_attention, self.rng, q, k, v, mask, causal)
        else:
            o = self.core_attention(q, k, v, mask, causal)
        return self.linear_proj(o.permute(2, 0, 1, 3).flatten(2))  # [b, n, s, d] -> [s(/tp), b, h = (n d)]

    def core_attention(self, q, k, v, mask, causal):
        """softmax(q·kᵀ·scale + mask) v with attention dropout: q [b, n, s, d], k, v [b, g, sk, d] -> [b, n, s, d].
        What selective recomputation recomputes (Korthikanti et al. 2022: its activations grow with s², its
        FLOPs are few)."""
        p = self.p if self.training else 0.0
        ctx = self.rng.fork(device=q.device) if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with ctx:  # attention dropout acts on heads, which are TP shards: the model-parallel RNG stream
            if mask is not None and mask.is_floating_point():  # an additive bias (T5's relative positions)
                return self.biased_attention(q, k, v, mask, p)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale,
                                                  is_causal=causal and mask is None, enable_gqa=self.g != self.n)

    def biased_attention(self, q, k, v, bias, p):
        """softmax(q·kᵀ·scale + bias) v written out, as Megatron's unfused DotProductAttention: SDPA with a float
        mask that needs a gradient (a learned bias) takes its math path, which also scales q and k and checks each
        row for −inf (T5's encoder attention on CPU, forward + backward: 15 ms against 12.7 ms written out)."""
        if self.g != self.n:  # grouped-query: each key/value head serves n/g query heads, as SDPA's enable_gqa
            k, v = (t.repeat_interleave(self.n // self.g, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-2, -1))  # [b, n, sq, sk]
        if self.scale != 1.0:
            scores.mul_(self.scale)
        probs = F.dropout(torch.softmax(scores.add_(bias), dim=-1), p)
        return torch.matmul(probs, v)  # [b, n, sq, d]


class MLP(nn.Module):
    """h -> f -> h. Gated (SwiGLU): fc1 holds [gate; up] fused, sharded with stride 2 so rank r has [gate_r; up_r]."""

    def __init__(self, c, grid=None, ffn_hidden_size: int | None = None):
        super().__init__()
        f = ffn_hidden_size or c.ffn_hidden_size
        self.gated, self.act = c.gated_linear_unit, ACTIVATIONS[c.activation]
        self.linear_fc1 = P.ColumnParallelLinear(c.hidden_size, f * (2 if self.gated else 1), grid,
                                                 bias=c.add_bias_linear, std=c.init_method_std,
                                                 sequence_parallel=c.sequence_parallel,
                                                 stride=2 if self.gated else 1, dtype=c.params_dtype)
        self.linear_fc2 = P.RowParallelLinear(f, c.hidden_size, grid, bias=c.add_bias_linear, std=c.output_std,
                                              sequence_parallel=c.sequence_parallel, dtype=c.params_dtype)

    def forward(self, x):  # [s(/tp), b, h]
        y = self.linear_fc1(x)  # [s, b, f/tp] or [s, b, 2f/tp]
        if self.gated and self.act is F.silu and torch.is_grad_enabled():
            y = SwiGLU.apply(y)  # [s, b, f/tp]
        elif self.gated:  # (without autograd, the plain ops: an autograd.Function's call costs ~30 µs a layer)
            gate, up = y.chunk(2, dim=-1)
            y = self.act(gate) * up
        else:
            y = self.act(y)
        return self.linear_fc2(y)  # [s(/tp), b, h]


def Norm(c, size: int | None = None, partial_over_tp: bool | None = None) -> nn.Module:
    """LayerNorm or RMSNorm over `size` (default h; MLA's latents: their rank; q/k norms: the head dim d); under
    sequence parallelism its weights see s/tp tokens, so their grads are partial (`partial_over_tp`: summed over TP
    by parallel.finalize_grads; default: under SP). Zero-centered (layernorm_zero_centered_gamma): ZeroCenteredNorm."""
    size = size or c.hidden_size
    if c.layernorm_zero_centered_gamma:
        m = ZeroCenteredNorm(c.normalization, size, c.layernorm_epsilon, c.params_dtype)
    else:
        cls = nn.LayerNorm if c.normalization == "LayerNorm" else nn.RMSNorm
        m = cls(size, eps=c.layernorm_epsilon, dtype=c.params_dtype)
    gamma = ("zeros",) if c.layernorm_zero_centered_gamma else ("ones",)
    partial = c.sequence_parallel if partial_over_tp is None else partial_over_tp
    for name, p in m.named_parameters():
        P.mark(p, gamma if name == "weight" else ("zeros",), sequence_parallel=partial)
    return m


# ---------------------------------------------------------------------------------------------- the optional parts
class ZeroCenteredNorm(nn.Module):
    """Megatron's layernorm_zero_centered_gamma (--apply-layernorm-1p; Transformer Engine's zero_centered_gamma):
    the norm scales by 1 + weight, and the weight starts at 0, so what the optimizer and weight decay see is centered
    on zero. The same function as torch's norm with weight 1 + gamma (tests/test_megatron_flags.py checks it):
        LayerNorm  (x − mean) / sqrt(var + eps) · (1 + weight) + bias
        RMSNorm    x / sqrt(mean(x²) + eps) · (1 + weight)
    Parameter names are torch's (weight, bias), so checkpoints and converters read it as a plain norm's."""

    def __init__(self, normalization: str, size: int, eps: float, dtype=None):
        super().__init__()
        self.shape, self.eps, self.layer_norm = (size,), eps, normalization == "LayerNorm"
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype)) if self.layer_norm else None

    def forward(self, x):
        if self.layer_norm:
            return F.layer_norm(x, self.shape, self.weight + 1, self.bias, self.eps)
        return F.rms_norm(x, self.shape, self.weight + 1, self.eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm(y·silu(z))·weight over groups of group_size channels: mamba_ssm's RMSNormGated (norm_before_gate=False),
    the output norm of mamba.py's mixer. A group never straddles two TP ranks, so the norm is local; its weight is
    this rank's channels' (partition_dim 0)."""

    def __init__(self, d_local: int, group_size: int, eps: float, dtype=None):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = P.mark(nn.Parameter(torch.empty(d_local, dtype=dtype)), ("ones",), partition_dim=0)

    def forward(self, y, z):  # [..., d_local]
        y = rearrange(y * F.silu(z), "... (g e) -> ... g e", e=self.group_size)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return rearrange(y, "... g e -> ... (g e)") * self.weight


class SwiGLU(torch.autograd.Function):
    """silu(gate) · up of fc1's output y = [gate; up] (Megatron's SwiGLUFunction, megatron/core/fusions/
    fused_bias_swiglu.py). Autograd's chunk would join the two halves' gradients with a cat, one more copy of
    [s, b, 2f]; this backward writes each half in place into one buffer. The ops are autograd's own (mul,
    silu_backward), so the gradient is the same to the bit."""

    @staticmethod
    def forward(ctx, y):  # [s, b, 2f] -> [s, b, f]
        gate, up = y.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(y, act)  # what autograd would keep: y (gate and up are its views) and silu(gate)
        return act * up

    @staticmethod
    def backward(ctx, grad):  # [s, b, f] -> [s, b, 2f]
        y, act = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        dy = torch.empty_like(y)
        dgate, dup = dy.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=dgate)
        torch.mul(grad, act, out=dup)
        return dy


class SharedExpertMLP(MLP):
    """An MoE layer's shared expert (Megatron's SharedExpertMLP, moe/shared_experts.py): an MLP of
    moe_shared_expert_intermediate_size that every token goes through. With moe_shared_expert_gate its output is
    scaled per token by sigmoid(x·gate_weightᵀ), gate_weight [1, h] (Qwen2-MoE's shared_expert_gate): replicated
    over TP, it sees this rank's s/tp tokens under SP, so its gradient is then partial and summed over TP (as
    Megatron marks it sequence_parallel)."""

    def __init__(self, c, grid=None):
        super().__init__(c, grid, c.moe_shared_expert_intermediate_size)
        self.gate_weight = P.mark(nn.Parameter(torch.empty(1, c.hidden_size, dtype=c.params_dtype)),
                                  ("normal", c.init_method_std), sequence_parallel=c.sequence_parallel) \
            if c.moe_shared_expert_gate else None

    def forward(self, x):  # [s(/tp), b, h]
        y = super().forward(x)  # [s(/tp), b, h]
        return y if self.gate_weight is None else y * torch.sigmoid(F.linear(x, self.gate_weight))  # gate [s, b, 1]


def moe_layer(c, grid=None):
    """The MoE layer that replaces the MLP (parallel.MoELayer), with its shared expert when the config has one."""
    shared = SharedExpertMLP(c, grid) if c.moe_shared_expert_intermediate_size else None
    return P.MoELayer(c, grid, ACTIVATIONS[c.activation], shared)


class InferenceContext:
    """The KV cache of incremental decoding (Megatron's StaticInferenceContext,
    megatron/core/inference/contexts/static_context.py, and attention.py `_adjust_key_value_for_inference`): for each
    attention layer, this rank's keys and values (its g/tp heads under TP) of every position fed so far, keys after
    RoPE (as Megatron's flash-decode and dynamic paths store them, so an old key is never rotated again).
    A recurrent layer's state rides along (`recurrent`). `sequence_len_offset` = positions already cached; the
    model advances it after each forward. Buffers are preallocated to max_sequence_length, and doubled if a call
    goes past it (amortized O(1) per token)."""

    def __init__(self, max_sequence_length: int | None = None):
        self.max_sequence_length, self.sequence_len_offset, self.key_value_memory_dict = max_sequence_length, 0, {}
        self.recurrent_states = {}  # a recurrent layer (a Mamba mixer) -> its state after the positions so far

    def recurrent(self, layer, fn, *xs):
        """A recurrent layer over this call's positions xs [b, s, ·]: fn(*xs, state=) -> (y, the state after), run from
        the state the previous call left (None at the first: zeros). Returns y. (Megatron's static context keeps the
        Mamba conv and SSM states the same way, beside the keys and values.)"""
        y, self.recurrent_states[layer] = fn(*xs, state=self.recurrent_states.get(layer))
        return y

    def append(self, layer, k, v):
        """This call's keys and values [b, g, s, d] -> those of every position so far [b, g, t + s, d]."""
        t, s = self.sequence_len_offset, k.shape[2]
        K, V = self.key_value_memory_dict.get(layer, (k[:, :, :0], v[:, :, :0]))
        if t + s > K.shape[2]:  # (re)allocate, keeping the t cached positions
            n = max(t + s, self.max_sequence_length or 0, 2 * K.shape[2])
            K, V = (torch.cat([B[:, :, :t], B.new_empty(*B.shape[:2], n - t, B.shape[3])], dim=2) for B in (K, V))
            self.key_value_memory_dict[layer] = (K, V)
        K[:, :, t:t + s], V[:, :, t:t + s] = k, v
        return K[:, :, :t + s], V[:, :, :t + s]


def with_cache(cache, layer, q, k, v, mask=None, causal=True):
    """Decoding: this call's keys and values [b, g, s, d] join the cache (`cache.append`: an InferenceContext, or
    serving/engine.py's paged cache), and its queries q [b, n, s, d] get the mask they need: causal over every
    cached key when none is given (query i is position t + i: it sees keys 0 .. t + i). -> k, v [b, g, t + s, d], mask."""
    k, v = cache.append(layer, k, v)
    sq, sk = q.shape[2], k.shape[2]
    if causal and mask is None and sq != sk:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    return k, v, mask


# ---------------------------------------------------------------------------------------------- recomputation
#  Activation recomputation (Chen et al. 2016, "Training deep nets with sublinear memory cost"; Korthikanti et al.
#  2022 for the selective kind): forward runs fn without keeping its intermediate activations, only its inputs;
#  backward runs fn again, with autograd, and backpropagates through that. The recomputed forward must draw the
#  same dropout masks, so the RNG states are saved at forward and put back for the recompute — torch's default
#  generator (CPU, and CUDA's when on CUDA) and every stream of the RNGTracker — then the backward-time states are
#  restored, so the recompute leaves no trace on the streams. Mirrors CheckpointFunction in Megatron's
#  megatron/core/tensor_parallel/random.py.
def rng_state(rng, device):
    """Everything a dropout may draw from: torch's default generator(s) and the tracker's streams."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, dict(rng.states) if rng is not None else None


def set_rng_state(rng, device, state):
    cpu, cuda, streams = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    if rng is not None:
        rng.states = dict(streams)  # a stream first used inside fn is absent here: it is seeded afresh again


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, rng, *args):  # args: tensors (kept for backward) or anything else (None, flags)
        ctx.fn, ctx.rng = fn, rng
        ctx.device = next(a.device for a in args if torch.is_tensor(a))
        ctx.fwd_state = rng_state(rng, ctx.device)
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad):
        tensors = iter(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        args = [next(tensors) if t else a for a, t in zip(ctx.others, ctx.is_tensor)]
        bwd_state = rng_state(ctx.rng, ctx.device)
        set_rng_state(ctx.rng, ctx.device, ctx.fwd_state)
        with torch.enable_grad():
            out = ctx.fn(*args)
        set_rng_state(ctx.rng, ctx.device, bwd_state)
        torch.autograd.backward(out, grad)
        return (None, None, *[a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args])


def checkpoint(fn, rng, *args):
    """fn(*args) -> one tensor, recomputed in backward with the RNG streams replayed (see above)."""
    if not any(torch.is_tensor(a) and a.requires_grad for a in args):  # an autograd.Function would then record
        return fn(*args)  # no graph at all, and fn's parameters would get no gradient: run it plainly
    return Checkpoint.apply(fn, rng, *args)


# ==================================================================================== rotary position embeddings
# Rotary position embeddings (RoPE): the angles every rope model shares, and the scalings that extend context.
# Mirrors Megatron-LM's `megatron/core/models/common/embeddings/rotary_pos_embedding.py` (rotate-half layout, float32
# angles, `--rotary-percent`, `--rotary-seq-len-interpolation-factor`, `--use-rope-scaling`), `yarn_rotary_pos_embedding.py`
# (`--position-embedding-type yarn`) and `rope_utils.py` (`_apply_rotary_pos_emb_bshd`: rotate the first dims, pass the
# rest). A section of its own because the position scalings live beside the plain angles they modify, each next to
# its formula; gpt.py, the later models and the attention layers all read it.
# Papers: Su et al. 2021 (RoFormer: rotary position embedding); Chen et al. 2023 (Extending context window of LLMs via
#         position interpolation: "linear"); Peng et al. 2023 (YaRN); Meta 2024 (The Llama 3 herd of models: "llama3").
#
#
# Plain RoPE rotates pair (x_i, x_{i+d/2}) of a head by the angle p·θ_i at position p, θ_i = base^(−2i/d), i < d/2.
# Every scaling here changes only the angles (and YaRN also multiplies cos and sin by one number, mscale):
#   linear    p·θ_i / factor                        (all frequencies slowed down: positions interpolated)
#   llama3    θ_i / factor for long wavelengths, θ_i for short ones, a linear blend in between (by wavelength)
#   yarn      θ_i / factor for low-frequency dims, θ_i for high-frequency ones, a ramp in between (by rotation count),
#             and cos, sin × mscale (the "attention concentration": softmax logits grow by mscale²)
#
# Dimension glossary
#   s sequence    b batch    n heads    d head dim    r rotated dims (= int(d · rotary_percent), even)


def rope_cos_sin(s: int, d: int, base: float, device=None):
    """Plain RoPE angles as Megatron computes them (float32, rotate-half layout): cos and sin [s, 1, 1, d]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)  # [s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
    return emb.cos(), emb.sin()


def apply_rope(x, cos_sin):  # x [s, b, n, d]; cos, sin [s, 1, 1, r], r <= d: the first r dims rotate, the rest pass
    cos, sin = (t[: x.shape[0]].to(x.dtype) for t in cos_sin)
    r = cos.shape[-1]
    if r < x.shape[-1]:  # only here the slices and the re-joining cat (each a copy of x, forward and backward)
        return torch.cat([apply_rope(x[..., :r], (cos, sin)), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin  # rotate-half: (x1, x2) -> (−x2, x1)


# ---------------------------------------------------------------------------------------------- the scalings
def llama3_inv_freq(inv_freq, factor: float, low_freq_factor: float, high_freq_factor: float, original_max: int):
    """Llama 3.x (Megatron's RotaryEmbedding._apply_scaling, HF's "llama3"). With wavelength λ_i = 2π/θ_i and the
    original context L: λ_i > L/low_freq_factor -> θ_i/factor; λ_i < L/high_freq_factor -> θ_i; in between
    θ_i·((1−t)/factor + t) with t = (L/λ_i − low_freq_factor) / (high_freq_factor − low_freq_factor) in [0, 1].
    Clamping t to [0, 1] gives all three cases in one line (tests/test_long_context.py checks it against the
    three-branch loop)."""
    wavelen = 2 * math.pi / inv_freq  # [r/2]
    t = ((original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - t) * inv_freq / factor + t * inv_freq


def yarn_correction_range(beta_fast: float, beta_slow: float, r: int, base: float, original_max: int,
                          round_to_int: bool = True):
    """The dims [low, high] over which YaRN ramps. Dim pair i turns L·θ_i/(2π) times over the original context L;
    it turns `rot` times at i = r·ln(L / (2π·rot)) / (2 ln base). Pairs turning more than beta_fast times (i < low)
    keep their frequency (extrapolation); fewer than beta_slow times (i > high) are interpolated (θ_i/factor)."""
    def dim(rot):
        return r * math.log(original_max / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim(beta_fast), dim(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, r - 1)


def yarn_mscale(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """YaRN's attention concentration (Megatron's _yarn_get_concentration_factor): m(f, mscale) / m(f, mscale_all_dim)
    with m(f, x) = 0.1·x·ln f + 1 (1 when f <= 1). cos and sin are multiplied by it, so q·k by its square."""
    def m(x):
        return 1.0 if factor <= 1 else 0.1 * x * math.log(factor) + 1.0
    return float(m(mscale) / m(mscale_all_dim))


def yarn_inv_freq(inv_freq, base: float, factor: float, original_max: int, beta_fast: float, beta_slow: float,
                  round_to_int: bool = True):
    """YaRN's angles (Megatron's YarnRotaryEmbedding): θ_i·(1 − ramp_i) + (θ_i/factor)·ramp_i, where ramp_i rises
    linearly from 0 at i = low to 1 at i = high (yarn_correction_range) and is clamped to [0, 1] outside."""
    r = 2 * inv_freq.shape[0]
    low, high = yarn_correction_range(beta_fast, beta_slow, r, base, original_max, round_to_int)
    high = high + 0.001 if low == high else high  # Megatron's guard against a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp


# ---------------------------------------------------------------------------------------------- from a Config
def rotary_dim(c, d: int | None = None) -> int:
    """r: how many of the head's d dims rotate (Megatron's int(kv_channels · rotary_percent))."""
    return int((d or c.kv_channels) * c.rotary_percent)


def rope_cos_sin_mscale(c, s: int, d: int | None = None, device=None):
    """The angles of a Config's position embedding, for positions 0..s−1 and a rotated head dim d (default: the
    config's rotary_dim; multi-latent attention passes its qk_pos_emb_head_dim). Returns cos, sin [s, 1, 1, d]
    (NOT yet multiplied by mscale) and mscale (1.0 unless YaRN). float32, as Megatron's."""
    d = d or rotary_dim(c)
    inv_freq = 1.0 / (c.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    mscale = 1.0
    if c.position_embedding_type == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, c.rotary_base, c.yarn_rotary_scaling_factor,
                                 c.yarn_original_max_position_embeddings, c.yarn_beta_fast, c.yarn_beta_slow,
                                 c.yarn_correction_range_round_to_int)
        mscale = yarn_mscale(c.yarn_rotary_scaling_factor, c.yarn_mscale, c.yarn_mscale_all_dim)
    elif c.rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, c.rope_scaling_factor, c.rope_scaling_low_freq_factor,
                                   c.rope_scaling_high_freq_factor, c.rope_scaling_original_max_position_embeddings)
    pos = torch.arange(s, dtype=torch.float32, device=device)  # [s]
    if c.seq_len_interpolation_factor is not None:  # linear position interpolation: p -> p / factor
        pos = pos * (1 / c.seq_len_interpolation_factor)  # Megatron's order
    freqs = torch.outer(pos, inv_freq)  # [s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
    return emb.cos(), emb.sin(), mscale


def rope_for(c, s: int, device=None, d: int | None = None):
    """(cos·mscale, sin·mscale) [s, 1, 1, r] for apply_rope (d: the rotated dims, default rotary_dim(c)), or None
    when the config has no rotary embedding."""
    if c.position_embedding_type not in ("rope", "yarn"):
        return None
    cos, sin, mscale = rope_cos_sin_mscale(c, s, d, device=device)
    return (cos, sin) if mscale == 1.0 else (cos * mscale, sin * mscale)


# ==================================================================================== relative position embeddings
# T5's learned relative-position bias (position_embedding_type "relative"): one table per stack, added to every layer's
# attention scores. Mirrors Megatron-LM's `megatron/core/models/common/embeddings/relative_pos_embedding.py` (beside
# the rotary one, as here); the bucket table: DESIGN.md §4, "T5 relative position buckets".
# Paper: Raffel et al. 2019 (T5).


def relative_position_bucket(rel, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
    """rel = key − query (an integer tensor) -> bucket in [0, num_buckets): Mesh TensorFlow's T5 buckets, one per
    near distance, then logarithmic up to max_distance, in float32 like Hugging Face and Megatron."""
    bucket = torch.zeros_like(rel)
    if bidirectional:  # an encoder: half the buckets for keys after the query, half for keys before
        num_buckets //= 2
        bucket = bucket + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:  # a decoder: keys at or before the query (later ones get bucket 0, masked anyway)
        rel = -rel.clamp(max=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    return bucket + torch.where(rel < max_exact, rel, large.clamp(max=num_buckets - 1))


class RelativePositionEmbedding(nn.Module):
    """A stack's learned bias table [B buckets, n heads], heads sharded over TP (partition_dim 1): each rank looks up
    only the bias of its own heads, so no communication is needed and the table's gradient on each rank is complete."""

    def __init__(self, c, grid, bidirectional: bool):
        super().__init__()
        tp = grid.tp_size if grid is not None else 1
        self.bidirectional, self.B = bidirectional, c.relative_attention_num_buckets
        self.max_distance = c.relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(self.B, c.num_attention_heads // tp, dtype=c.params_dtype)
        P.mark(self.relative_attention_bias.weight, ("normal", c.init_method_std), partition_dim=1)

    def forward(self, sq: int, sk: int):  # -> [1, n/tp, sq, sk]
        dev = self.relative_attention_bias.weight.device
        rel = torch.arange(sk, device=dev)[None, :] - torch.arange(sq, device=dev)[:, None]  # [sq, sk] key − query
        bucket = relative_position_bucket(rel, self.bidirectional, self.B, self.max_distance)
        # contiguous once here: every layer adds it to its [b, n, sq, sk] scores, 5× faster than through the view
        return rearrange(self.relative_attention_bias(bucket), "q k n -> 1 n q k").contiguous()
