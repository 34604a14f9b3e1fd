"""costs.py — what a parallel layout costs: memory per rank and time per iteration, and the planner that ranks layouts.

Mirrors the arithmetic of Megatron-LM's papers (no single Megatron file does this; the closest are
megatron/training/theoretical_memory_usage.py and the FLOPs formula in megatron/training/training.py):
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (activations);
  Rajbhandari et al. 2020, "ZeRO" (parameters, gradients, optimizer state);
  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (FLOPs per iteration, Eq. 3; pipeline bubble (p-1)/(m·v); Table 1).
Every byte the memory model predicts for this CPU is checked against bytes measured here (tests/test_costs_memory.py);
the time model against the paper's Table 1 (tests/test_costs_time.py, bench/README "Cost model").

Dimension glossary: s sequence, b micro-batch, h hidden, a heads, L layers, V padded vocabulary, t TP, p PP,
v virtual stages per rank, d DP, c CP, e EP, m micro-batches per iteration (global batch / (b·d)).

Run:    .venv/bin/python tools.py plan --help
"""
from __future__ import annotations

import dataclasses


# ---------------------------------------------------------------------------------------------- 1. the layout
# Megatron's names for each field (the planner's JSON uses them).
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "vpp": "num_virtual_stages_per_pipeline_rank", "dp": "data_parallel_size",
                  "cp": "context_parallel_size", "ep": "expert_model_parallel_size", "micro_batch": "micro_batch_size",
                  "global_batch": "global_batch_size", "sequence_parallel": "sequence_parallel",
                  "recompute": "recompute_granularity", "distributed_optimizer": "use_distributed_optimizer"}


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
    optimizer: str = "adam"  # "adam" | "muon" | "sgd"
    dtype: str = "fp32"  # the parameters' and activations' dtype: "fp32" | "bf16" | "fp16" (16-bit keeps fp32 main grads)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def micro_batches(self) -> int:  # m
        return self.global_batch // (self.micro_batch * self.dp)


# ---------------------------------------------------------------------------------------------- 2. memory per rank
# memory(c, layout, accounting) -> dict of bytes on the rank that holds the most (keys: "parameters", "gradients",
# "optimizer", "activations", "total"); accounting "cpu" is what this CPU keeps (fp32, fp32 dropout masks),
# "gpu" the 16-bit accounting of the paper. kv_cache_bytes(c, batch, seq, dtype_bytes) for serving.


# ---------------------------------------------------------------------------------------------- 3. time per iteration
# GPUS (data-sheet peaks and links, sources cited); step_time(c, layout, gpu) -> dict with at least
# "seconds_per_iteration", "tflops_per_gpu" and the parts (compute, bubble, communication per collective, overlapped).


# ---------------------------------------------------------------------------------------------- 4. the planner
# plan(c, gpu, gpus, ...) -> the layouts that fit, best predicted throughput first (tools.py plan prints them).
