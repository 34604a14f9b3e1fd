"""toy_model.py — a seventh model, added the way a fork adds one: gpt.py's GPT with ScaleNorm instead of LayerNorm or
RMSNorm (Nguyen & Salazar 2019, "Transformers without Tears": g · √h · x / ‖x‖, one learned scalar g per norm).

It proves the model-file contract (config.py): this file and tests/test_contract.py are all it took, and no
infrastructure module names it. `--model toy_model` trains it when tests/ is on the Python path (the tests' is).
It declares what it is like any model file: its Config (a field and what it does not support), its Model (gpt's
skeleton, one seam overridden), its own flag and that the flag shapes the weights, and the hooks it takes from gpt.py.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

import gpt
import parallel as P


@dataclass
class Config(gpt.Config):
    UNSUPPORTED: ClassVar[dict] = {"export": "Hugging Face has no model class with ScaleNorm"}
    scalenorm_learned_gain: bool = True  # False: g stays 1 (no parameter)


class ScaleNorm(nn.Module):
    """x [..., h] -> g · √h · x / ‖x‖. Under sequence parallelism each rank sees s/tp tokens: g's grad is partial."""

    def __init__(self, c: Config, size: int):
        super().__init__()
        self.eps, self.scale = c.layernorm_epsilon, math.sqrt(size)
        if c.scalenorm_learned_gain:
            self.g = P.mark(nn.Parameter(torch.empty((), dtype=c.params_dtype)), ("ones",),
                            sequence_parallel=c.sequence_parallel)

    def forward(self, x):
        y = self.scale * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return self.g * y if hasattr(self, "g") else y


def swap_norms(module: nn.Module, c: Config):
    """Every LayerNorm / RMSNorm inside `module` replaced by a ScaleNorm of the same size (same name)."""
    for name, child in module.named_children():
        if isinstance(child, (nn.LayerNorm, nn.RMSNorm)):
            setattr(module, name, ScaleNorm(c, child.normalized_shape[0]))
        else:
            swap_norms(child, c)


class Model(gpt.Model):
    """gpt.Model whose layer stack (build_decoder, the seam) has ScaleNorms; init_params fills them after."""

    def build_decoder(self, c: Config, grid, layer_offset: int, num_layers: int) -> nn.Module:
        decoder = super().build_decoder(c, grid, layer_offset, num_layers)
        swap_norms(decoder, c)
        return decoder


# ---------------------------------------------------------------------------------------------- the contract's hooks
def add_arguments(p):
    p.add_argument("--scalenorm-learned-gain", action=argparse.BooleanOptionalAction, default=True,
                   help="a learned gain g per ScaleNorm (else g = 1)")


ARCH_FLAGS = ("scalenorm_learned_gain",)  # the gains exist or not
TRAIN_DEFAULTS = dict(num_layers=2)
# generation is gpt's, text and chat (the default run's dataset, recipe and FLOPs are the contract's defaults)
sample, sample_ids = gpt.sample, gpt.sample_ids
