"""mamba.py — Mamba-2 (the SSD mixer) and Megatron's hybrid Mamba / attention / MLP stacks, tensor- and sequence-parallel.

Mirrors Megatron-LM's megatron/core/ssm/mamba_mixer.py (MambaMixer), mamba_layer.py (MambaLayer), mlp_layer.py,
mamba_block.py (MambaStack), mamba_hybrid_layer_allocation.py (the pattern symbols) and models/mamba/mamba_model.py,
with the same parameter names and tensor layouts; the scan is the chunked SSD algorithm in einsums (`ssd_chunked`,
where Megatron runs kernels), checked against the recurrence (`ssd_sequential`): DESIGN.md §9, "Mamba".
Papers: Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"; Dao & Gu 2024, "Transformers
are SSMs" (Mamba-2, SSD; `ssd_chunked` follows its Listing 1: state-spaces/mamba's mamba_ssm/modules/ssd_minimal.py).

Run:    make train MODEL=mamba        (a small hybrid: --hybrid-layer-pattern "M-M*-M"; see README)

Dimension glossary (the paper's letters in brackets)
  b batch   s = l sequence [T]   h hidden (d_model)   V vocabulary
  H heads (mamba_num_heads)   P head dim (mamba_head_dim) [P]   N state size (mamba_state_dim) [N]
  d_inner = H·P (= expand·h)   the mixer's width; the SSM runs independently on each head's P channels
  G groups (mamba_num_groups): heads of a group share B and C (like GQA's key/value heads); R = H/G heads per group
  k conv kernel (4)   conv_dim = d_inner + 2·G·N, the channels [x, B, C] that go through the causal conv
  c chunks of q positions (mamba_chunk_size Q); z, s index chunks / positions as sources in the einsums
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

import gpt
import metrics
import parallel as P
import transformer
from config import ConfigError
from interop import convert, megatron_flags

SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE"}  # and "|": a pipeline-stage boundary


class DefaultPattern(str):
    """The default run's pattern (TRAIN_DEFAULTS), told apart from a typed one: it gives way (derived_flags)."""


# `make train MODEL=mamba`: a small hybrid, 3 Mamba + 1 attention + 3 MLP layers (DESIGN.md §9, "Mamba"); Muon at 3x
# AdamW's rate, 350 iterations in 8 minutes (bench/README.md, "Levers for the other default runs")
TRAIN_DEFAULTS = dict(hybrid_layer_pattern=DefaultPattern("M-M*-M-"), num_layers=7, hidden_size=256, num_attention_heads=8,
                      mamba_num_groups=8, mamba_head_dim=32, mamba_state_dim=32, mamba_chunk_size=64, normalization="RMSNorm",
                      position_embedding_type="none", train_iters=350, optimizer="muon", lr=9e-3, min_lr=9e-4)


def add_arguments(p):
    """Megatron's Mamba flags: the hybrid stack and the mixer's dimensions (None = the Config's default)."""
    p.add_argument("--hybrid-layer-pattern", "--hybrid-override-pattern", dest="hybrid_layer_pattern", default=None,
                   help='e.g. "M-M*-M" (M mamba, * attention, - MLP, E MoE, | a pipeline-stage cut); --num-layers '
                        "must match it (--hybrid-override-pattern: Megatron 0.15.3's name)")
    p.add_argument("--hybrid-attention-ratio", type=float, default=0.0, help="without a pattern: the share of "
                   "attention layers of --num-layers, placed as Megatron places them (mamba_hybrid_layer_allocation)")
    p.add_argument("--hybrid-mlp-ratio", type=float, default=0.0, help="the same for MLP layers")
    for name, what in (("state-dim", "N, the SSM state size"), ("head-dim", "P"), ("num-groups", "G, heads sharing B and C"),
                       ("num-heads", "H (default 2·hidden / head-dim)"), ("chunk-size", "Q, the SSD scan's chunk")):
        p.add_argument(f"--mamba-{name}", type=int, default=None, help=what)


# Megatron's mamba/train.sh passes its default stack spec, whose layers (Mamba, attention, MLP) this file builds
MEGATRON_SPECS = (("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"),)
ARCH_FLAGS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")


def derived_flags(args) -> dict:
    """The run's pattern as a plain string (what a checkpoint records): --hybrid-layer-pattern, or Megatron's allocation
    of --num-layers layers by --hybrid-attention-ratio / --hybrid-mlp-ratio (interop/megatron_flags.py); both given,
    they must agree (DESIGN.md §9, "Mamba"). The default run's pattern gives way to the ratios and to another length."""
    pattern, ratios = args.hybrid_layer_pattern, (args.hybrid_attention_ratio, args.hybrid_mlp_ratio)
    if not (0 <= ratios[0] <= 1 and 0 <= ratios[1] <= 1 and sum(ratios) <= 1):
        raise ConfigError(f"--hybrid-attention-ratio={ratios[0]} and --hybrid-mlp-ratio={ratios[1]} must be in [0, 1] "
                          "and sum to at most 1")
    default = isinstance(pattern, DefaultPattern)
    if any(ratios) or default and args.num_layers != len(pattern):
        auto = megatron_flags.hybrid_allocation(args.num_layers, *ratios)
        count = lambda p: {k: p.count(k) for k in SYMBOLS}  # layers of each kind
        if pattern is not None and not default and count(pattern) != count(auto):
            raise ConfigError(f"--hybrid-layer-pattern {pattern!r} has {count(pattern)} layers of each kind; the ratios "
                              f"allocate {auto!r} ({count(auto)}): Megatron requires the same counts")
        pattern = auto if pattern is None or default else pattern
    return dict(hybrid_layer_pattern=None if pattern is None else str(pattern))


@dataclass
class Config(gpt.Config):
    """gpt.Config plus Megatron's Mamba fields; defaults follow Megatron's MambaModel (no positions, RMSNorm)."""
    FULL_RECOMPUTE = False  # full recomputation: its hybrid stack is its own, not transformer.Decoder's
    UNSUPPORTED: ClassVar[dict] = {
        "context_parallel": "Mamba's scan is a recurrence along the sequence: its state is not passed from rank to rank",
        "document_packing": "Mamba's scan carries its state from one document into the next (no block-diagonal mask)",
        "sft_packing": "the scan's state would cross from one packed sample into the next (no block-diagonal mask)",
        "prefix_caching": "a cached prefix holds keys and values, not the recurrent state after it",
        **gpt.DEEPSEEK_UNSUPPORTED}
    num_layers: int | None = None  # None = the pattern's length
    hybrid_layer_pattern: str | None = None  # e.g. "M-M*-M", "MM*|M-M-"; None = "M" * num_layers
    mamba_state_dim: int = 128  # N
    mamba_head_dim: int = 64  # P
    mamba_num_groups: int = 8  # G
    mamba_num_heads: int | None = None  # H; None = 2·hidden_size / mamba_head_dim (expand 2)
    mamba_chunk_size: int = 128  # Q
    mamba_conv_kernel: int = 4  # k
    mamba_scan: str = "chunked"  # "chunked" (SSD) | "sequential" (the oracle: one recurrence step per position)
    position_embedding_type: str = "none"
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
    share_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self):
        p = self.hybrid_layer_pattern if self.hybrid_layer_pattern is not None else "M" * (self.num_layers or 4)
        if bad := sorted(set(p) - set(SYMBOLS) - {"|"}):
            raise ValueError(f"hybrid_layer_pattern={p!r}: unknown symbols {bad}; allowed are M (Mamba), * (attention),"
                             " - (MLP), E (MoE), | (pipeline boundary)")
        layers = p.replace("|", "")
        if not layers or (self.num_layers is not None and self.num_layers != len(layers)):
            raise ValueError(f"num_layers={self.num_layers} != the {len(layers)} layers of hybrid_layer_pattern={p!r}"
                             f" (set --num-layers {len(layers)}, or a pattern of {self.num_layers} layers)")
        small = {f: getattr(self, f) for f in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                                               "mamba_chunk_size", "mamba_conv_kernel") if getattr(self, f) < 1}
        if small or self.mamba_num_heads is not None and self.mamba_num_heads < 1:
            raise ValueError(f"{small or {'mamba_num_heads': self.mamba_num_heads}} must be >= 1")
        self.hybrid_layer_pattern, self.layer_types, self.num_layers = p, layers, len(layers)
        super().__post_init__()
        if "E" in layers and not self.num_experts:
            raise ValueError(f"hybrid_layer_pattern={p!r} has MoE layers (E): set num_experts")
        h, Pd, G = self.hidden_size, self.mamba_head_dim, self.mamba_num_groups
        if self.mamba_num_heads is None and 2 * h % Pd:
            raise ValueError(f"2·hidden_size={2 * h} is not divisible by mamba_head_dim={Pd}")
        self.mamba_num_heads = self.mamba_num_heads or 2 * h // Pd
        if self.mamba_num_heads % G:
            raise ValueError(f"mamba_num_heads={self.mamba_num_heads} is not divisible by mamba_num_groups={G} (groups "
                             f"share B and C among heads: --mamba-num-groups must divide {self.mamba_num_heads})")
        if self.mamba_scan not in ("chunked", "sequential"):
            raise ValueError(f"mamba_scan={self.mamba_scan!r} is not one of ('chunked', 'sequential')")
        self.d_inner = self.mamba_num_heads * Pd
        self.mamba_output_std = self.init_method_std / math.sqrt(self.num_layers)  # MambaStack's out_proj rescale

    def tp_split_sizes(self) -> list[tuple[str, int]]:
        """What TP splits: the vocabulary and the sizes of the layer kinds the pattern uses."""
        kinds = {"M": ["mamba_num_heads", "mamba_num_groups"], "*": ["num_attention_heads", "num_query_groups"],
                 "-": ["ffn_hidden_size"], "E": ["moe_ffn_hidden_size"]}
        names = [n for kind, ns in kinds.items() if kind in self.layer_types for n in ns]
        return [("padded vocabulary", self.padded_vocab_size)] + [(n, getattr(self, n)) for n in names]

    def check_layout(self, tp: int = 1, pp: int = 1, ep: int = 1):
        super().check_layout(tp, 1, ep)  # gpt's TP and EP checks; the pipeline stages are the pattern's:
        self.stages(pp)

    def stage_layers(self, num_layers: int, grid, vp: int = 1, chunk: int = 0) -> tuple[int, int]:
        """(first global layer, layer count) of this rank's pipeline stage: the pattern's '|' cuts, else even."""
        if "|" not in self.hybrid_layer_pattern:
            return super().stage_layers(num_layers, grid, vp, chunk)
        if vp > 1:
            raise ValueError(f"hybrid_layer_pattern={self.hybrid_layer_pattern!r} cuts its own pipeline stages ('|'):"
                             f" virtual pipeline stages (vp={vp}) need a pattern without '|'")
        offset, symbols = self.stages(grid.pp_size if grid is not None else 1)[grid.pp.rank if grid is not None else 0]
        return offset, len(symbols)

    def stages(self, pp: int = 1) -> list[tuple[int, str]]:
        """Each pipeline stage's (first global layer, layer symbols): cut at '|', else evenly (Megatron's MambaStack)."""
        p, L, cut = self.hybrid_layer_pattern, self.num_layers, pp > 1 and "|" in self.hybrid_layer_pattern
        if cut and p.count("|") + 1 != pp:
            raise ValueError(f"hybrid_layer_pattern={p!r} has {p.count('|') + 1} stages, pipeline-model-parallel size is {pp}")
        if not cut and L % pp:
            raise ValueError(f"num_layers={L} is not divisible by pipeline-model-parallel size {pp}")
        parts = p.split("|") if cut else [self.layer_types[i * L // pp:(i + 1) * L // pp] for i in range(pp)]
        return [(sum(map(len, parts[:i])), part) for i, part in enumerate(parts)]


# ---------------------------------------------------------------------------------------------- the SSD scan
def segsum(a):
    """a [..., q] -> [..., q, q]: out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal: exp(out[i, j]) is
    the decay from step j to step i. Sums the masked terms, never two cumulative sums (DESIGN.md §9, "Mamba")."""
    q = a.shape[-1]
    ones = torch.ones(q, q, dtype=torch.bool, device=a.device)
    a = repeat(a, "... d -> ... e d", e=q).masked_fill(~ones.triu(1), 0)  # a[..., e, d] = a[d] where d > e, else 0
    out = a.cumsum(-1)  # out[..., j, i] = Σ_{j < d <= i} a[d]  (the sum runs along the contiguous last dim: fast)
    return out.masked_fill(~ones.triu(), -torch.inf).transpose(-1, -2)  # [..., i, j]


def ssd_chunked(x, dt, A, B, C, chunk: int, state=None):
    """The SSD algorithm (Dao & Gu 2024, Listing 1): the scan as matmuls within chunks plus a short recurrence across.
    x [b, l, H, P], dt [b, l, H] (> 0, discretized), A [H] (< 0), B, C [b, l, G, N], state [b, H, P, N] or None.
    Returns y [b, l, H, P] and the final state [b, H, P, N]. Lengths that are not a multiple of `chunk` are padded
    with dt = 0: a padded step neither decays the state (exp(0·A) = 1) nor adds to it (dt·x = 0)."""
    b, l, H, _ = x.shape
    G = B.shape[2]
    pad = -l % chunk
    x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    X = rearrange(x * dt[..., None], "b (c q) (g r) p -> b c q g r p", q=chunk, g=G)  # dt·x, the input term
    a = rearrange(dt * A, "b (c q) (g r) -> b g r c q", q=chunk, g=G)  # log-decay of each step (A·dt <= 0)
    B, C = (rearrange(t, "b (c q) g n -> b c q g n", q=chunk) for t in (B, C))
    a_cum = a.cumsum(-1)  # [b, g, r, c, q]
    # 1. Diagonal blocks: the output of each chunk from its own inputs (a causal "attention" C·Bᵀ masked by decay)
    L = torch.exp(segsum(a))  # [b, g, r, c, q, s]
    Y_diag = torch.einsum("bcqgn,bcsgn,bgrcqs,bcsgrp->bcqgrp", C, B, L, X)
    # 2. Intra-chunk states: each chunk's final state from its own inputs (B terms, decayed to the chunk's end)
    decay_states = torch.exp(a_cum[..., -1:] - a_cum)  # [b, g, r, c, q]
    states = torch.einsum("bcqgn,bcqgrp->bcgrpn", B, X * rearrange(decay_states, "b g r c q -> b c q g r 1"))
    # 3. Inter-chunk recurrence: the state entering each chunk (a c-step scan, written as one small matmul)
    if state is None:
        state = x.new_zeros(b, H, x.shape[-1], B.shape[-1])
    states = torch.cat([rearrange(state, "b (g r) p n -> b 1 g r p n", g=G), states], dim=1)  # [b, c+1, ...]
    decay_chunk = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b, g, r, z, c]: chunk c's state -> chunk z
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", decay_chunk, states)
    states, final = states[:, :-1], states[:, -1]  # entering chunk 0..c-1; leaving the last chunk
    # 4. State -> output: the entering state read out by C and decayed to each position (off-diagonal blocks)
    Y_off = torch.einsum("bcqgn,bcgrpn,bgrcq->bcqgrp", C, states, torch.exp(a_cum))
    y = rearrange(Y_diag + Y_off, "b c q g r p -> b (c q) (g r) p")[:, :l]
    return y, rearrange(final, "b g r p n -> b (g r) p n")


def ssd_sequential(x, dt, A, B, C, chunk: int | None = None, state=None):
    """The oracle: the recurrence one position at a time (Gu & Dao 2023, eq. 2a-2b, with scalar A per head):
        state_t = exp(dt_t·A)·state_{t-1} + dt_t·x_t ⊗ B_t        y_t = state_t · C_t
    Same signature and result as `ssd_chunked` (`chunk` is ignored). One step of it is the generation step."""
    b, l, H, Pd = x.shape
    B, C = (repeat(t, "b l g n -> b l (g r) n", r=H // t.shape[2]) for t in (B, C))  # each head its group's [b, l, H, N]
    state = x.new_zeros(b, H, Pd, B.shape[-1]) if state is None else state
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # [b, H, 1, 1]
        state = decay * state + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t])  # [b, H, P, N]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


# ---------------------------------------------------------------------------------------------- the mixer
class MambaMixer(nn.Module):
    """in_proj -> [z, x, B, C, dt]; causal depthwise conv + SiLU on [x, B, C]; SSD scan; + D·x; gated norm; out_proj.
    in_proj is column-parallel *per segment*: rank r holds [z_r, x_r, B_r, C_r, dt_r] (its heads' and groups'
    rows of each segment), conv1d the matching [x_r, B_r, C_r] channels; out_proj is row-parallel."""

    def __init__(self, c: Config, grid=None):
        super().__init__()
        tp = grid.tp_size if grid is not None else 1
        self.c, self.H, self.G = c, c.mamba_num_heads // tp, c.mamba_num_groups // tp  # local heads and groups
        self.Pd, self.N, self.k, self.d = c.mamba_head_dim, c.mamba_state_dim, c.mamba_conv_kernel, c.d_inner // tp
        GN, dt_ = c.mamba_num_groups * c.mamba_state_dim, c.params_dtype
        segments = [c.d_inner, c.d_inner, GN, GN, c.mamba_num_heads]  # z, x, B, C, dt (full sizes)
        self.in_proj = P.ColumnParallelLinear(c.hidden_size, sum(segments), grid, bias=False, std=c.init_method_std,
                                              sequence_parallel=c.sequence_parallel, stride=segments, dtype=dt_)
        conv_dim = self.d + 2 * self.G * self.N
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.k, groups=conv_dim, dtype=dt_)  # run by `mix`
        # Megatron's non-Gaussian inits: functions of a U[0,1) draw of the full tensor (parallel.init_params)
        bound = 1 / math.sqrt(self.k)  # kaiming_uniform(a=√5) on [conv_dim, 1, k], and torch's conv bias default
        for p in self.conv1d.parameters():
            P.mark(p, ("uniform", lambda u: (2 * u - 1) * bound), 0, stride=[c.d_inner, GN, GN])
        self.A_log = P.mark(nn.Parameter(torch.empty(self.H, dtype=dt_)),
                            ("uniform", lambda u: torch.log(1 + 15 * u)), 0)  # A ~ U(1, 16)
        self.D = P.mark(nn.Parameter(torch.empty(self.H, dtype=dt_)), ("ones",), 0)
        self.dt_bias = P.mark(nn.Parameter(torch.empty(self.H, dtype=dt_)), ("uniform", _dt_bias), 0)
        self.norm = transformer.GatedRMSNorm(self.d, c.d_inner // c.mamba_num_groups, c.layernorm_epsilon, dt_)
        self.out_proj = P.RowParallelLinear(c.d_inner, c.hidden_size, grid, bias=False, std=c.mamba_output_std,
                                            sequence_parallel=c.sequence_parallel, dtype=dt_)

    def mix(self, z, xBC, dt, scan=ssd_sequential, state=None):
        """l new positions after `state` -> gated y [b, l, d] and the state after them. z [b, l, d], xBC [b, l, conv_dim],
        raw dt [b, l, H]; state = (conv [b, conv_dim, k-1] the last k-1 conv inputs, ssm [b, H, P, N]), or None at the
        start (zeros: the causal conv's left padding, the scan's empty state)."""
        conv, ssm = state if state is not None else (xBC.new_zeros(xBC.shape[0], xBC.shape[2], self.k - 1), None)
        inputs = torch.cat([conv, rearrange(xBC, "b l e -> b e l")], dim=-1)  # [b, conv_dim, k-1+l]
        # the depthwise conv as its k shifted products (torch's conv1d re-plans for each new length: slow to decode)
        w, l = self.conv1d.weight[:, 0], xBC.shape[1]  # [conv_dim, k]
        xBC = sum(inputs[..., j:j + l] * w[:, j, None] for j in range(self.k)) + self.conv1d.bias[:, None]
        x, B, C = F.silu(rearrange(xBC, "b e l -> b l e")).split([self.d, self.G * self.N, self.G * self.N], dim=-1)
        x = rearrange(x, "b l (h p) -> b l h p", p=self.Pd)
        B, C = (rearrange(t, "b l (g n) -> b l g n", n=self.N) for t in (B, C))
        A = -torch.exp(self.A_log)  # [H]
        y, ssm = scan(x, F.softplus(dt + self.dt_bias), A, B, C, self.c.mamba_chunk_size, state=ssm)
        y = y + self.D[:, None] * x  # the D skip
        return self.norm(rearrange(y, "b l h p -> b l (h p)"), z), (inputs[..., inputs.shape[-1] - (self.k - 1):], ssm)

    def forward(self, hidden, inference_context=None):  # [s(/tp), b, h] -> [s(/tp), b, h]
        """inference_context (decoding, serving): its `recurrent` runs `mix` from each sequence's held state."""
        zxbcdt = rearrange(self.in_proj(hidden), "s b e -> b s e")  # all-gathers s under SP
        z, xBC, dt = zxbcdt.split([self.d, self.d + 2 * self.G * self.N, self.H], dim=-1)  # [b, s, d | conv_dim | H]
        chunked = self.c.mamba_scan == "chunked" and xBC.shape[1] > 1  # one position: the recurrence's step
        mix = functools.partial(self.mix, scan=ssd_chunked if chunked else ssd_sequential)
        y = mix(z, xBC, dt)[0] if inference_context is None else inference_context.recurrent(self, mix, z, xBC, dt)
        return self.out_proj(rearrange(y, "b s d -> s b d"))  # [s(/tp), b, h]


def _dt_bias(u, dt_min=1e-3, dt_max=0.1, floor=1e-4):
    """softplus⁻¹ of dt ~ logU(dt_min, dt_max), so that softplus(dt_bias) starts in [dt_min, dt_max] (Megatron's)."""
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


# ---------------------------------------------------------------------------------------------- the hybrid stack
class Layer(nn.Module):
    """One pre-norm residual layer, x + dropout(f(norm(x))), named as Megatron's MambaStack names it:
        M  MambaLayer                          norm, mixer                       (ssm/mamba_layer.py)
        *  TransformerLayer, attention only    input_layernorm, self_attention   (transformer.Attention)
        -  MLPLayer, MLP only                  pre_mlp_layernorm, mlp            (ssm/mlp_layer.py, transformer.MLP)
        E  MoE layer, MoE only                 pre_mlp_layernorm, mlp            (parallel.MoELayer)"""
    NAMES = {"M": ("norm", "mixer"), "*": ("input_layernorm", "self_attention"), "-": ("pre_mlp_layernorm", "mlp"),
             "E": ("pre_mlp_layernorm", "mlp")}

    def __init__(self, symbol: str, c: Config, grid=None, rng=None):
        super().__init__()
        self.symbol, self.c, self.rng = symbol, c, rng
        norm, f = self.NAMES[symbol]
        setattr(self, norm, transformer.Norm(c))
        make = {"M": MambaMixer, "*": functools.partial(transformer.Attention, rng=rng), "-": transformer.MLP,
                "E": transformer.moe_layer}
        setattr(self, f, make[symbol](c, grid))

    def forward(self, x, rope=None, mask=None, inference_context=None):  # [s(/tp), b, h]
        norm, f = (getattr(self, n) for n in self.NAMES[self.symbol])
        ctx = dict(inference_context=inference_context) if self.symbol in "*M" else {}  # KV cache, recurrent states
        y = f(norm(x), rope=rope, mask=mask, **ctx) if self.symbol == "*" else f(norm(x), **ctx)
        return x + P.dropout(y, self.c.hidden_dropout, self.training, self.rng, sharded=self.c.sequence_parallel)


class Stack(nn.Module):
    """Megatron's MambaStack: this stage's layers, then `final_norm` on the last stage."""

    def __init__(self, c: Config, grid, rng, symbols: str, post_process: bool):
        super().__init__()
        self.layers = nn.ModuleList([Layer(s, c, grid, rng) for s in symbols])
        self.final_norm = transformer.Norm(c) if post_process else None

    def forward(self, x, rope=None, mask=None, inference_context=None):
        for layer in self.layers:
            x = layer(x, rope=rope, mask=mask, inference_context=inference_context)
        return self.final_norm(x) if self.final_norm is not None else x


class Model(gpt.Model):
    """Megatron's MambaModel: gpt.Model around the hybrid Stack (this stage's layers: Config.stage_layers places them).
    forward(input_ids [b, s], labels=None) -> logits [b, s, vocab_size] or per-token loss [b, s]."""

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        return Stack(c, grid, self.rng, c.layer_types[layer_offset:layer_offset + num_layers], self.post_process)

    @torch.no_grad()
    def step(self, ids, cache: dict):
        """Logits [b, V] of the newest ids [b], one position after the earlier calls': `cache` ({} at first) holds
        "kv", a transformer.InferenceContext with the Mamba layers' states and the attention layers' keys."""
        if self.config.sequence_parallel or not (self.pre_process and self.post_process):
            raise ValueError("step() runs a whole model without sequence parallelism")
        return self(ids[:, None], inference_context=cache.setdefault("kv", transformer.InferenceContext()))[:, -1]


@torch.no_grad()
def generate(model: Model, ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             eod: int | list[int] | None = None):
    """gpt.generate with the recurrent step: each position (the prompt's too) enters once, O(1) work per token."""
    cache = {}

    def next_logits(ids):  # ids [b, t]: the positions the states have not seen, one step each -> the last logits [b, V]
        seen = cache["kv"].sequence_len_offset if cache else 0
        return [model.step(ids[:, t], cache) for t in range(seen, ids.shape[1])][-1]
    return gpt.generate(model, ids, max_new_tokens, temperature, top_k, eod, next_logits=next_logits)


sample = functools.partial(gpt.sample, generate=generate)  # tools.py sample: gpt's, with the recurrent step
sample_ids = functools.partial(gpt.sample_ids, generate=generate)  # tools.py sample --chat: gpt's, the same way


def flops(c: Config, B: int, s: int) -> float:
    """Megatron's hybrid_flops (megatron/training/training.py), per layer symbol of the pattern (attention, MLP and MoE:
    metrics.py's), forward x 3; d_in is the config's H·P; MTP adds each depth's logit layer only (DESIGN.md §6)."""
    h, d_in, H, G, N = c.hidden_size, c.d_inner, c.mamba_num_heads, c.mamba_num_groups, c.mamba_state_dim
    per_token = {"M": 2 * h * (2 * d_in + 2 * G * N + H)  # in_proj: h -> [z, x, B, C, dt]
                 + 7 * d_in * N  # the scan (Megatron's estimate of the SSD kernels)
                 + 2 * d_in * h,  # out_proj
                 "*": 2 * metrics.self_attention_flops(c, s, causal=True, mla=False),
                 "-": 2 * metrics.mlp_flops(c, moe=False), "E": 2 * metrics.mlp_flops(c, moe=True)}
    logits = 2 * h * c.padded_vocab_size * (1 + (c.mtp_num_layers or 0))  # the logit layer, one per depth
    return 3 * B * s * (sum(per_token[k] for k in c.layer_types) + logits)


# ---------------------------------------------------------------------------------------------- checkpoints (interop/convert.py)
def hf_to_ours(src, Config, dtype=None) -> tuple:
    """(Config, full state dict) of a `transformers` Mamba2ForCausalLM, renamed (logits match its torch path; DESIGN.md §9)."""
    convert.refuse("mamba.from_hf", convert.unlike(src.config, dict(model_type="mamba2", use_bias=False, use_conv_bias=True,
                                                                    hidden_act="silu", time_step_limit=(0, math.inf))))
    c = convert.config_from(Config, src, dtype, dict(
        num_layers="num_hidden_layers", hidden_size="hidden_size", vocab_size="vocab_size", mamba_state_dim="state_size",
        mamba_head_dim="head_dim", mamba_num_groups="n_groups", mamba_num_heads="num_heads",
        mamba_chunk_size="chunk_size", mamba_conv_kernel="conv_kernel", layernorm_epsilon="layer_norm_epsilon",
        share_embeddings_and_output_weights="tie_word_embeddings"), num_attention_heads=1)
    return c, convert.vocab(c, convert.renamed(src.state_dict(), [
        (r"backbone\.embeddings\.weight", "embedding.word_embeddings.weight"), (r"lm_head\.weight", "output_layer.weight"),
        (r"backbone\.norm_f\.weight", "decoder.final_norm.weight"), (r"backbone\.layers\.(.*)", r"decoder.layers.\1")],
        "mamba.from_hf"))


HF_CONVERTERS = {"mamba2": hf_to_ours}  # model_type -> converter (interop/hf.py)
from_hf = convert.hf_loader(Model, Config, HF_CONVERTERS, "mamba")  # a Mamba2ForCausalLM -> Model
