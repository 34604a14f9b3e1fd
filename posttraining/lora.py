"""posttraining/lora.py — LoRA: low-rank adapters on the frozen tensor-parallel linears, trained alone, then merged.

Mirrors Megatron-Bridge's megatron/bridge/peft/lora.py (LoRA(target_modules=["linear_qkv", "linear_proj",
"linear_fc1", "linear_fc2"], dim, alpha, dropout) on a frozen Megatron model) and the split of Hugging Face PEFT's
peft/tuners/lora/tp_layer.py (LoraParallelLinear: A split for a RowParallelLinear, B for a ColumnParallelLinear),
on this repo's ColumnParallelLinear / RowParallelLinear (parallel.py section 4).
Paper: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (A Gaussian, B = 0, scale alpha/r).

Run:    .venv/bin/python -m pytest -q tests/test_lora.py
        make train NPROC=2 TP=2 RUN=runs/gpt-lora ARGS="--lora-rank 8 --pretrained-checkpoint runs/gpt"
        python tools.py merge --load runs/gpt-lora --save runs/gpt-merged      # plain weights W + (alpha/r)·B·A

Dimension glossary
  b batch    s sequence (s/tp under sequence parallelism)    i in features    o out features    r LoRA rank
  tp tensor-parallel size

The plain oracle (one process, `reference`):   y = x·Wᵀ + c·(x·Aᵀ)·Bᵀ,   c = alpha/r,   A [r, i],  B [o, r]

Under tensor parallelism the adapter is split like its base weight and uses the base layer's own collective on its
rank-r side (column-parallel base: A replicated, B split; row-parallel: A split, B replicated), so merging needs no
communication and any layout holds the same adapters: the derivation is DESIGN.md §1, "Post-training".
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

import parallel as P
from config import ConfigError

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron's names of the attention/MLP linears


class LoRAError(ConfigError):
    """A target this model cannot take an adapter on; the message names it (train.py prints one line)."""


class LoRA(nn.Module):
    """The adapter of one tensor-parallel linear `base`: forward(x) = c·(x·Aᵀ)·Bᵀ with the base layer's collective
    (DESIGN.md §1, "Post-training": the derivation). `base` itself is not held (it owns this module as `base.lora`)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, rng=None):
        super().__init__()
        self.column = isinstance(base, P.ColumnParallelLinear)
        self.tp, self.sp, self.scale, self.p, self.rng = base.tp, base.sequence_parallel, alpha / rank, dropout, rng
        n, w = (self.tp.size if self.tp else 1), base.weight
        kw = dict(dtype=w.dtype, device=w.device)
        if self.column:  # W [o/tp, i]
            i = w.shape[1]
            self.A = P.mark(nn.Parameter(torch.empty(rank, i, **kw)), ("normal", 1 / math.sqrt(i)),
                            sequence_parallel=self.sp)  # [r, i] replicated
            self.B = P.mark(nn.Parameter(torch.empty(w.shape[0], rank, **kw)), ("zeros",), 0,
                            stride=w.partition_stride)  # [o/tp, r]
        else:  # W [o, i/tp]
            i = w.shape[1] * n
            self.A = P.mark(nn.Parameter(torch.empty(rank, w.shape[1], **kw)), ("normal", 1 / math.sqrt(i)), 1)
            self.B = P.mark(nn.Parameter(torch.empty(w.shape[0], rank, **kw)), ("zeros",),
                            sequence_parallel=self.sp)  # [o, r] replicated
        for p in (self.A, self.B):
            p.lora = True
            p.added_to_base = True  # (checkpoint.added_to_base: a base checkpoint does not hold it)
        self.enabled = True  # off inside `disabled(model)`

    def forward(self, x):  # the base layer's input: column x [s(/tp), b, i]; row x [s, b, i/tp]
        x = P.dropout(x, self.p, self.training, self.rng, sharded=self.sp or not self.column)
        h = F.linear(x, self.A)  # column: [s(/tp), b, r]; row: partial sums [s, b, r]
        if self.column:
            h = P.gather_from_sp(h, self.tp) if self.sp else P.copy_to_tp(h, self.tp)  # f: [s, b, r]
        else:
            h = P.reduce_scatter_to_sp(h, self.tp) if self.sp else P.reduce_from_tp(h, self.tp)  # g: [s(/tp), b, r]
        return self.scale * F.linear(h, self.B)  # column [s, b, o/tp]; row [s(/tp), b, o]


def _add_adapter(module, inputs, output):  # forward hook of an adapted linear: y + the adapter's term
    return output + module.lora(inputs[0]) if module.lora.enabled else output


@contextlib.contextmanager
def disabled(model: nn.Module):
    """`with disabled(model):` the model without its adapters — the frozen base model, bit for bit (DPO's and KTO's
    reference model in a LoRA run, posttraining/recipes.py, as TRL's `disable_adapter()` with PEFT)."""
    adapters = [m for m in model.modules() if isinstance(m, LoRA)]
    for a in adapters:
        a.enabled = False
    try:
        yield model
    finally:
        for a in adapters:
            a.enabled = True


def reference(x, weight, A, B, alpha: float, bias=None):
    """The one-process oracle: x [.., i] -> x·Wᵀ + b + (alpha/r)·(x·Aᵀ)·Bᵀ [.., o], on full (unsplit) tensors."""
    return F.linear(x, weight, bias) + alpha / A.shape[0] * F.linear(F.linear(x, A), B)


def is_adapter(p: nn.Parameter) -> bool:
    return getattr(p, "lora", False)


def apply_lora(model: nn.Module, targets, rank: int, alpha: float | None = None, dropout: float = 0.0) -> list[str]:
    """Freeze every parameter of `model` and give each linear named in `targets` (TARGETS' names) an adapter,
    initialized from (model.config.seed, its global name). Returns the adapted modules' names. A target that names no
    tensor-parallel linear of this model: LoRAError naming it and the names this model has."""
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise LoRAError(f"LoRA target {bad[0]!r} is not one of {', '.join(TARGETS)}")
    linear = (P.ColumnParallelLinear, P.RowParallelLinear)
    found = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets]
    other = [n for n, m in found if not isinstance(m, linear)]  # MoE's grouped experts: no adapter for them here
    if other:
        raise LoRAError(f"LoRA target {other[0]} is not a tensor-parallel linear (MoE's grouped experts): adapters "
                         "on experts are not supported (leave linear_fc1/linear_fc2 out)")
    have = {n.rsplit(".", 1)[-1] for n, _ in found}
    missing = [t for t in targets if t not in have]
    if missing:
        present = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, linear)} & set(TARGETS))
        raise LoRAError(f"LoRA target {missing[0]!r}: this model has no such linear (it has: {', '.join(present)})")
    for p in model.parameters():
        p.requires_grad_(False)
    rng = getattr(model, "rng", None)
    for _, m in found:
        m.lora = LoRA(m, rank, alpha if alpha is not None else rank, dropout, rng)
        m.lora_hook = m.register_forward_hook(_add_adapter)
    init_adapters(model)
    return [n for n, _ in found]


def init_adapters(model: nn.Module):
    """Fill every adapter from (seed, its global name) and its `init` recipe, as parallel.init_params fills weights."""
    rename = getattr(model, "global_name", lambda name: name)
    for name, m in model.named_modules():
        if isinstance(m, LoRA):
            P.init_params(m, model.config.seed, model.grid, rename=lambda n, prefix=name: rename(f"{prefix}.{n}"))


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight, W_t += c·B_t·A_t (each rank its slice, no communication), and remove the
    adapters: a plain model with every parameter trainable again."""
    for m in list(model.modules()):
        if isinstance(getattr(m, "lora", None), LoRA):
            a = m.lora
            m.weight += (a.scale * (a.B.double() @ a.A.double())).to(m.weight.dtype)  # [o(/tp), i(/tp)]
            m.lora_hook.remove()
            del m.lora, m.lora_hook
    for p in model.parameters():
        p.requires_grad_(True)
    return model
