"""planning/layout.py — how one training run is split over its ranks (TP, PP, VPP, DP, CP, EP, the micro-batches,
recomputation, the optimizer's sharding), as the memory and time models and the planner read it.

Mirrors the parallel-state flags of Megatron-LM's megatron/training/arguments.py (their names are MEGATRON_NAMES,
what the planner's JSON prints); the memory model is planning/memory.py, the time model planning/timing.py, the
planner planning/planner.py (DESIGN.md §6 and §12).

Dimension glossary (every planning/ file): s sequence, b micro-batch, h hidden, a heads, L layers, V padded
vocabulary, t TP, p PP, v virtual stages per rank, d DP, c CP, e EP, m micro-batches per iteration
(global batch / (b·d)).

Run:    .venv/bin/python tools.py plan --help
"""
from __future__ import annotations

import dataclasses

# Megatron's names for each field (the planner's JSON uses them).
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "vpp": "num_virtual_stages_per_pipeline_rank", "dp": "data_parallel_size",
                  "cp": "context_parallel_size", "ep": "expert_model_parallel_size", "micro_batch": "micro_batch_size",
                  "global_batch": "global_batch_size", "sequence_parallel": "sequence_parallel",
                  "recompute": "recompute_granularity", "distributed_optimizer": "use_distributed_optimizer",
                  "sharding": "data_parallel_sharding_strategy"}


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
    sharding: str = "no_shard"  # --use-megatron-fsdp's: "optim_grads" (ZeRO-2), "optim_grads_params" (ZeRO-3)
    optimizer: str = "adam"  # "adam" | "muon" | "sgd"
    dtype: str = "fp32"  # the parameters' and activations' dtype: "fp32" | "bf16" | "fp16" (16-bit keeps fp32 main grads)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def micro_batches(self) -> int:  # m
        return self.global_batch // (self.micro_batch * self.dp)



# Bytes a value of each dtype (16-bit parameters keep fp32 main grads and master weights: planning/memory.py).
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
