"""transformer.py — the transformer's building blocks every model here shares: norms, attention, MLP, layer, stack.

Mirrors Megatron-LM's `megatron/core/transformer/` — `attention.py`, `mlp.py`, `transformer_layer.py`,
`transformer_block.py` — with the same parameter names and tensor layouts, so a Megatron-core checkpoint loads by
name (fused QKV grouped per query group, SwiGLU fc1 as [gate; up]). A file of its own, as in Megatron, so that
gpt.py holds only the model skeleton (Config, embedding, Model, generation) and each layer is read once, here.
Activation recomputation lives here too (Decoder: full; Attention.core_attention: selective), with the RNG replay
of Megatron's `megatron/core/tensor_parallel/random.py` CheckpointFunction (section "recomputation", at the end).
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
from rope import apply_rope


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


# ---------------------------------------------------------------------------------------------- attention and MLP
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
        q, k, v = (rearrange(t, "s b n d -> b n s d") for t in (q, k, v))
        if inference_context is not None:
            k, v = inference_context.append(self, k, v)  # [b, g, t + s, d]
            sq, sk = q.shape[2], k.shape[2]
            if causal and mask is None and sq != sk:  # query i is position t + i: it sees keys 0 .. t + i
                mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).tril(sk - sq)
        if self.cp_attention is not None:  # context parallelism [b, n, s/cp, d]; causal as SDPA's: only without a mask
            o = self.cp_attention(q, k, v, mask, causal and mask is None, self.scale)
        elif self.recompute and self.training and torch.is_grad_enabled():  # selective recomputation
            o = checkpoint(self.core_attention, self.rng, q, k, v, mask, causal)
        else:
            o = self.core_attention(q, k, v, mask, causal)
        return self.linear_proj(rearrange(o, "b n s d -> s b (n d)"))  # [s(/tp), b, h]

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
        if self.gated and self.act is F.silu:
            y = SwiGLU.apply(y)  # [s, b, f/tp]
        elif self.gated:
            gate, up = y.chunk(2, dim=-1)
            y = self.act(gate) * up
        else:
            y = self.act(y)
        return self.linear_fc2(y)  # [s(/tp), b, h]


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


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x))).

    apply_residual_connection_post_layernorm (legacy Megatron's flag): the residual branch starts from norm(x), not x.
    With it, a stack of these layers plus the final norm is exactly the post-LN transformer of original BERT with its
    norms shifted by one (layer i's input_layernorm = BERT's embedding LayerNorm for i = 0, else layer i−1's output
    LayerNorm) — see convert.bert_from_hf."""

    def __init__(self, c, grid=None, rng=None, layer_number: int = 0, moe: bool | None = None, attention=None):
        super().__init__()
        self.c, self.rng = c, rng
        self.input_layernorm = Norm(c)
        self.self_attention = (attention or Attention)(c, grid, rng=rng)  # the seam: deepseek.MLASelfAttention
        self.pre_mlp_layernorm = Norm(c)
        if c.is_moe_layer(layer_number) if moe is None else moe:  # MoE (parallel.py section 10) instead of the MLP
            self.mlp = moe_layer(c, grid)
        else:
            self.mlp = MLP(c, grid)

    def drop(self, x):  # hidden dropout; under SP the activations are sequence shards -> model-parallel stream
        return P.dropout(x, self.c.hidden_dropout, self.training, self.rng, sharded=self.c.sequence_parallel)

    def forward(self, x, rope=None, mask=None, inference_context=None):  # [s(/tp), b, h]
        post = self.c.apply_residual_connection_post_layernorm
        ln = self.input_layernorm(x)
        x = (ln if post else x) + self.drop(self.self_attention(ln, rope=rope, mask=mask,
                                                                inference_context=inference_context))
        ln = self.pre_mlp_layernorm(x)
        return (ln if post else x) + self.drop(self.mlp(ln))


class Decoder(nn.Module):
    """This stage's layers (Megatron's TransformerBlock), with full recomputation as --recompute-method says:
    uniform = the layers in chunks of recompute_num_layers, each chunk recomputed as one unit (only its input is
    kept); block = the first recompute_num_layers layers each recomputed, the rest not."""

    def __init__(self, c, grid, rng, num_layers: int, post_process: bool, layer_offset: int = 0, attention=None):
        super().__init__()
        self.c, self.rng = c, rng
        self.layers = nn.ModuleList([TransformerLayer(c, grid, rng, layer_offset + i, attention=attention)
                                     for i in range(num_layers)])
        self.final_layernorm = Norm(c) if post_process else None

    def forward(self, x, rope=None, mask=None, inference_context=None):  # [s(/tp), b, h]
        def run(start, end):  # layers start..end−1 as one function of (x, mask)
            def f(x, mask):
                for layer in self.layers[start:end]:
                    x = layer(x, rope=rope, mask=mask, inference_context=inference_context)
                return x
            return f

        c, L = self.c, len(self.layers)
        if c.recompute_granularity == "full" and self.training and torch.is_grad_enabled():
            n = c.recompute_num_layers
            if c.recompute_method == "uniform":
                for start in range(0, L, n):
                    x = checkpoint(run(start, min(start + n, L)), self.rng, x, mask)
            else:  # block
                for i in range(L):
                    x = checkpoint(run(i, i + 1), self.rng, x, mask) if i < n else run(i, i + 1)(x, mask)
        else:
            x = run(0, L)(x, mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x


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
