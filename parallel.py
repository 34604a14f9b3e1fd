"""parallel.py — every way mini-megatron splits a model across processes, in one file, one fenced section each.

Contents. One row per fenced section: its lines here (from its opening `# ====` fence to the line before the next
section's fence; the last section runs to the end of the file), its title, and the files it mirrors as its header
names them (Megatron-LM's; Transformer Engine's where Megatron takes the piece from TE). tests/test_repo.py checks the
table; after an edit to this file, refresh its line numbers: .venv/bin/python tests/test_repo.py --fix-parallel-contents
  §    lines      section                                         mirrors
  1    79-210     Grid                                            megatron/core/parallel_state.py
  2    211-397    Mappings                                        megatron/core/tensor_parallel/mappings.py
  3    398-473    Initialization                                  megatron/core/tensor_parallel/layers.py
  4    474-694    Tensor-parallel layers                          megatron/core/tensor_parallel/layers.py
                                                                  megatron/core/tensor_parallel/cross_entropy.py
  5    695-758    RNG tracker and dropout                         megatron/core/tensor_parallel/random.py
  6    759-873    Gradient finalization and shard gathering       megatron/core/distributed/finalize_model_grads.py
  7    874-913    Schedules                                       megatron/core/pipeline_parallel/schedules.py
  8    914-1103   Pipeline parallelism                            megatron/core/pipeline_parallel/schedules.py
                                                                  megatron/core/pipeline_parallel/p2p_communication.py
  9    1104-1404  Data parallelism and the distributed optimizer  megatron/core/distributed/distributed_data_parallel.py
                                                                  megatron/core/distributed/param_and_grad_buffer.py
                                                                  megatron/core/distributed/finalize_model_grads.py
                                                                  megatron/core/optimizer/distrib_optimizer.py
  10a  1405-1549  Mixture of Experts: the router                  megatron/core/transformer/moe/router.py
                                                                  megatron/core/transformer/moe/moe_utils.py
  10b  1550-1753  Mixture of Experts: experts, dispatchers, the layer
                                                                  megatron/core/transformer/moe/token_dispatcher.py
                                                                  megatron/core/transformer/moe/experts.py
                                                                  megatron/core/transformer/moe/moe_utils.py
                                                                  megatron/core/transformer/moe/shared_experts.py
                                                                  megatron/core/transformer/moe/moe_layer.py
  11   1754-1982  FP8                                             megatron/core/fp8_utils.py
                                                                  transformer_engine/pytorch/fp8.py
  12   1983-2246  Context parallelism                             megatron/core/utils.py
                                                                  transformer_engine/pytorch/attention
  13   2247-2385  Muon                                            megatron/core/optimizer/muon.py
  14   2386-2685  Fully sharded data parallelism                  megatron/core/distributed/fsdp/mcore_fsdp_adapter.py

Mirrors Megatron-LM's `megatron/core/parallel_state.py` (the Grid), `megatron/core/tensor_parallel/` (mappings,
layers, cross-entropy, random), `pipeline_parallel/`, `distributed/`, `optimizer/distrib_optimizer.py`,
`transformer/moe/`, `fp8_utils.py`, `optimizer/muon.py` and `distributed/fsdp/`.
Papers: Shoeybi et al. 2019, "Megatron-LM" (tensor parallelism, the f and g operators);
        Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (sequence parallelism);
        Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters" (1F1B, interleaving);
        Rajbhandari et al. 2020, "ZeRO"; Fedus et al. 2021, "Switch Transformers"; Micikevicius et al. 2022, "FP8";
        Liu et al. 2023, "Ring Attention"; Jacobs et al. 2023, "DeepSpeed Ulysses" (context parallelism);
        Jordan et al. 2024, "Muon"; Liu et al. 2025, "Muon is Scalable for LLM Training".

Run its tests:  make test   (or: .venv/bin/python -m pytest -q tests/test_tensor_parallel.py tests/test_pipeline.py ...)

A section calls only the sections above it. MoE and FP8 plug into the core through hooks: a TP layer's
`linear_impl(x, weight, bias)` (section 4; fp8_enable installs the FP8 GEMM there), `set_num_tokens(n)`, which
the schedules call on every submodule that has it (section 7; MoE's Router does, for its aux losses), and
`after_step()`, which the optimizers call once a step is applied (section 9; the Router moves its expert bias).

Dimension glossary (used in every shape comment of the project)
  b  micro-batch size          s  sequence length (s/tp under sequence parallelism, s/cp per context-parallel rank)
  h  hidden size               V  vocabulary size (padded; V/tp per TP rank)
  tp tensor-parallel size      pp pipeline-parallel size     dp data-parallel size     cp context-parallel size
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

# torch 2.13 renamed two collectives; the old names serve older torch (a GPU machine's image, say)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ============================================================================================================
# 1. Grid — mirrors megatron/core/parallel_state.py (initialize_model_parallel, order="tp-cp-ep-dp-pp") and, for the
#    process group it is made over, megatron/training/initialize.py (_initialize_distributed)
# ============================================================================================================
_GROUPS: dict[tuple[int, ...], object] = {}  # process groups are expensive: one per rank tuple, made once


def _group(ranks: list[int]):
    """The process group over `ranks`. Like Megatron, every rank of the world creates every group, in one order."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key)) if len(key) > 1 else None
    return _GROUPS[key]


class Group:
    """One communicator: its size, this rank's index in it, the global ranks, and the torch process group.

    size 1 means "no communication": every collective below returns its input untouched.
    """

    def __init__(self, ranks: list[int], me: int, pg=None, name: str = ""):
        self.ranks, self.size, self.rank, self.pg, self.name = ranks, len(ranks), ranks.index(me), pg, name

    def __repr__(self):
        return f"Group(ranks={self.ranks}, rank={self.rank})"


class Grid:
    """The process grid: the world's ranks laid out as a [pp, dp, cp, tp] array, TP innermost.

        world 8, tp 2, pp 2, dp 2:      pp stage 0        pp stage 1
                                      dp0: [0, 1]       dp0: [4, 5]     <- a TP group is a row
                                      dp1: [2, 3]       dp1: [6, 7]     <- a DP group is a column within a stage
    Ranks next to each other share a TP group: TP talks most, so it gets the fastest links (same node).
    MoE: `ep` consecutive DP ranks form an expert-parallel group (each holds E/ep experts); the ranks holding the
    same experts (dp/ep of them, times cp) form `expert_dp`, over which expert grads are summed. `etp` (1 or tp,
    default tp) is the expert tensor-parallel size: experts sharded over the TP group like the dense MLP, or whole.
    A Grid is a plain object passed to every layer, never a module global. Every rank of the world must build it
    (collectively, like Megatron's initialize_model_parallel), with the same degrees.
    """

    # The degrees: how many ways each dimension splits the work.
    tp_size: int  # tensor parallelism: each layer's weights split over tp ranks
    pp_size: int  # pipeline parallelism: the layers cut into pp stages
    dp_size: int  # data parallelism: dp model replicas, each on its share of the batch
    ep_size: int  # expert parallelism: the experts split over ep ranks, carved out of dp
    cp_size: int  # context parallelism: the sequence split over cp ranks
    etp_size: int  # expert tensor parallelism: 1 (whole experts) or tp (experts split like the dense MLP)
    # This rank's communicators, one per kind of group (the ranks it exchanges that kind of data with).
    tp: Group  # the tp ranks sharing one layer's shards (same pp, dp, cp): the f/g collectives run here
    cp: Group  # the cp ranks holding one sequence's pieces
    dp: Group  # the dp replicas of this rank's shard (same pp, cp, tp)
    dp_cp: Group  # dp x cp: the ranks whose gradients of one (non-expert) parameter are summed
    pp: Group  # the pp stages of this rank's model replica: activations and their grads travel here
    mp: Group  # one model replica (tp x pp), for model-wide reductions (e.g. a grad norm)
    ep: Group  # the ep ranks holding different experts: tokens are dispatched over it
    expert_dp: Group  # the (dp/ep)·cp ranks holding the same experts: expert grads are summed over it
    embedding: Group | None  # first and last pp stage (tied embeddings); None on a middle stage

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, cp: int = 1, etp: int | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        for name, v in dict(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp).items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Grid: {name}={v!r} must be a positive integer")
        if tp * pp * dp * cp != world:
            raise ValueError(f"Grid: world size {world} != tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} = {tp * pp * dp * cp}")
        if dp % ep:
            raise ValueError(f"Grid: expert-parallel size ep={ep} must divide dp={dp} (experts are carved from DP)")
        etp = tp if etp is None else etp
        if etp not in (1, tp):
            raise ValueError(f"Grid: expert tensor-parallel size etp={etp} must be 1 or tp={tp}")
        self.tp_size, self.pp_size, self.dp_size, self.ep_size, self.cp_size = tp, pp, dp, ep, cp
        self.etp_size = etp
        me = dist.get_rank() if dist.is_initialized() else 0
        g = torch.arange(world).view(pp, dp, cp, tp)  # g[p, d, c, t] = global rank
        e = g.view(pp, dp // ep, ep, cp, tp)  # MoE: EP groups are ep consecutive DP ranks (carved from DP)
        layouts = {  # name -> every group of that kind, one per row (the innermost dims are the group)
            "tp": g.reshape(-1, tp),
            "cp": g.permute(0, 1, 3, 2).reshape(-1, cp),
            "dp": g.permute(0, 2, 3, 1).reshape(-1, dp),
            "dp_cp": g.permute(0, 3, 1, 2).reshape(-1, dp * cp),
            "pp": g.permute(1, 2, 3, 0).reshape(-1, pp),
            "mp": g.permute(1, 2, 0, 3).reshape(-1, pp * tp),
            "ep": e.permute(0, 1, 3, 4, 2).reshape(-1, ep),
            "expert_dp": e.permute(0, 2, 4, 1, 3).reshape(-1, dp // ep * cp),
            "embedding": [sorted({int(r[0]), int(r[-1])}) for r in g.permute(1, 2, 3, 0).reshape(-1, pp)],
        }
        mine: dict[str, Group] = {}
        for name, rows in layouts.items():
            for row in rows:  # every rank creates every group, in the same order
                row = [int(r) for r in row]
                pg = _group(row)
                if me in row:
                    mine[name] = Group(row, me, pg, name)
        self.tp, self.cp, self.dp, self.dp_cp = mine["tp"], mine["cp"], mine["dp"], mine["dp_cp"]
        self.pp, self.mp, self.ep, self.expert_dp = mine["pp"], mine["mp"], mine["ep"], mine["expert_dp"]
        self.embedding = mine.get("embedding")  # middle pipeline stages hold no embedding

    def __repr__(self):
        return (f"Grid(tp={self.tp_size}, pp={self.pp_size}, dp={self.dp_size}, cp={self.cp_size}, "
                f"ep={self.ep_size}; tp_rank={self.tp.rank}, pp_rank={self.pp.rank}, dp_rank={self.dp.rank})")


def tp_of(grid: Grid | None) -> Group | None:
    """The TP group, or None when there is nothing to communicate with."""
    return grid.tp if grid is not None and grid.tp.size > 1 else None


def init_distributed(world: int, backend: str | None = None, minutes: int = 10) -> torch.device:
    """This rank's device and, under torchrun (world > 1), the process group: NCCL on CUDA unless --distributed-backend
    says gloo, gloo on CPU (nccl asked without CUDA: arguments.py said so once). One process uses every core it may
    (taskset, cgroups). torchrun's environment says which rank this is (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR)."""
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if world == 1:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    else:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group((backend or "nccl") if cuda else "gloo", timeout=timedelta(minutes=minutes))
    return device


def agree_on_error(error: str | None) -> str | None:
    """The first error any rank found (`error` None: this rank found none), or None: every rank of the world calls it
    at the same point, so a rank that failed alone stops the others there instead of leaving them in a collective."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, error)
    return next((e for e in found if e is not None), None)


# ============================================================================================================
# 2. Mappings — mirrors megatron/core/tensor_parallel/mappings.py
#
#  Each mapping is an autograd function whose backward is the conjugate collective of its forward:
#       name                     forward                    backward            paper
#       copy_to_tp               identity                   all-reduce          f
#       reduce_from_tp           all-reduce                 identity            g (Shoeybi et al.; f̄ in Korthikanti)
#       scatter_to_tp            split last dim             all-gather last     (Megatron: scatter_to_tensor_...)
#       gather_from_tp           all-gather last dim        split last dim
#       scatter_to_sp            split dim 0 (sequence)     all-gather dim 0    (SP entry)
#       gather_from_sp           all-gather dim 0           reduce-scatter      g (Korthikanti et al.): replaces f
#       reduce_scatter_to_sp     reduce-scatter dim 0       all-gather dim 0    ḡ (g-bar, Korthikanti): replaces g
#  Megatron's names: copy_to_tensor_model_parallel_region, reduce_from_..., scatter_to_..., gather_from_...,
#  scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region, reduce_scatter_to_sequence_...
#
#  The communication audit: every collective of this file calls `_log(kind, group, tensor)` right before it runs.
#  Off (COMM_LOG None, the default) that is one `if`; inside `with count_collectives() as log:` each call appends
#  (kind, group name, bytes) to `log`. bytes = numel·element size of the FULL tensor the collective works on:
#  all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the input; all_to_all, send, recv:
#  what this rank sends or receives. So an all-reduce of N bytes and its SP split (reduce-scatter + all-gather)
#  log N each. tests/test_comm_audit.py holds one iteration's log against the analytic volumes (DESIGN.md §4).
# ============================================================================================================
COMM_LOG: list | None = None


@contextlib.contextmanager
def count_collectives():
    """Log this process's collectives as (kind, group name, bytes) while inside the block; yields the list."""
    global COMM_LOG
    prev, COMM_LOG = COMM_LOG, []
    try:
        yield COMM_LOG
    finally:
        COMM_LOG = prev


def _log(kind: str, g: Group, t: torch.Tensor, times: int = 1):
    if COMM_LOG is not None:
        COMM_LOG.append((kind, g.name, times * t.numel() * t.element_size()))


def all_reduce(x, g: Group | None):
    """The sum of x over group g, as a new tensor (a caller's x, e.g. a grad, is never reduced in place); x itself
    when g is None or of size 1. Public: the loop and post-training reduce their losses and metrics with it."""
    if g is None or g.size == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce a caller's tensor (e.g. a grad) in place
    _log("all_reduce", g, x)
    dist.all_reduce(x, group=g.pg)
    return x


def _split(x, g: Group | None, dim: int):
    if g is None or g.size == 1:
        return x
    if x.shape[dim] % g.size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {g.size} equal parts")
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def _gather(x, g: Group | None, dim: int):
    if g is None or g.size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    _log("all_gather", g, out)
    all_gather_single(out, x, group=g.pg)
    return out.movedim(0, dim)


def _reduce_scatter(x, g: Group | None):  # along dim 0
    if g is None or g.size == 1:
        return x
    if x.shape[0] % g.size:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.shape[0]} over {g.size} ranks")
    out = x.new_empty((x.shape[0] // g.size, *x.shape[1:]))
    _log("reduce_scatter", g, x)
    reduce_scatter_single(out, x.contiguous(), group=g.pg)
    return out


class _CopyToTP(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, dy):
        return all_reduce(dy, ctx.g), None


class _ReduceFromTP(torch.autograd.Function):  # g (Shoeybi et al.)
    @staticmethod
    def forward(ctx, x, g):
        return all_reduce(x, g)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, -1)

    @staticmethod
    def backward(ctx, dy):
        return _gather(dy, ctx.g, -1), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _gather(x, g, -1)

    @staticmethod
    def backward(ctx, dy):
        return _split(dy, ctx.g, -1), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _split(x, g, 0)

    @staticmethod
    def backward(ctx, dy):
        return _gather(dy, ctx.g, 0), None


class _GatherFromSP(torch.autograd.Function):  # g (Korthikanti et al.)
    @staticmethod
    def forward(ctx, x, g, tp_output_grad):
        ctx.g, ctx.tp_output_grad = g, tp_output_grad
        return _gather(x, g, 0)

    @staticmethod
    def backward(ctx, dy):
        # The consumer is a TP-sharded op (a column-parallel linear): each rank holds a partial gradient -> sum it.
        # Otherwise every rank already holds the full gradient and just keeps its own slice.
        return (_reduce_scatter(dy, ctx.g) if ctx.tp_output_grad else _split(dy, ctx.g, 0)), None, None


class _ReduceScatterToSP(torch.autograd.Function):  # ḡ (Korthikanti et al.)
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _reduce_scatter(x, g)

    @staticmethod
    def backward(ctx, dy):
        return _gather(dy, ctx.g, 0), None


def copy_to_tp(x, g):
    return _CopyToTP.apply(x, g) if g is not None else x


def reduce_from_tp(x, g):
    return _ReduceFromTP.apply(x, g) if g is not None else x


def scatter_to_tp(x, g):
    return _ScatterToTP.apply(x, g) if g is not None else x


def gather_from_tp(x, g):
    return _GatherFromTP.apply(x, g) if g is not None else x


def scatter_to_sp(x, g):
    return _ScatterToSP.apply(x, g) if g is not None else x


def gather_from_sp(x, g, tp_output_grad: bool = True):
    return _GatherFromSP.apply(x, g, tp_output_grad) if g is not None else x


def reduce_scatter_to_sp(x, g):
    return _ReduceScatterToSP.apply(x, g) if g is not None else x


# ============================================================================================================
# 3. Initialization — mirrors megatron/core/tensor_parallel/layers.py's `use_cpu_initialization` path
#    (_initialize_affine_weight_cpu)
#
#  Every parameter is a slice of a full "master" tensor generated from (seed, the parameter's global name), so a
#  TP=4 model, a TP=1 model and a pipeline stage that owns only layers 6..11 all hold the same numbers.
#  A parameter carries Megatron's attributes: `tensor_model_parallel`, `partition_dim`, `partition_stride`,
#  `sequence_parallel` (a replicated param whose grad is partial under SP), and our `init` recipe.
# ============================================================================================================
def mark(p: nn.Parameter, init: tuple, partition_dim: int = -1, stride: int = 1, sequence_parallel: bool = False):
    """Attach the sharding and init attributes to a parameter (partition_dim -1 = replicated)."""
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = partition_dim >= 0, partition_dim, stride
    p.sequence_parallel, p.init = sequence_parallel, init
    return p


def shard(full: torch.Tensor, dim: int, stride, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of `full` along `dim`. stride > 1 interleaves: SwiGLU fc1 [gate; up] -> [gate_r; up_r].

    `stride` may also be a list of (full) segment sizes, each split over the ranks on its own: Mamba's in_proj
    [z, x, B, C, dt] -> [z_r, x_r, B_r, C_r, dt_r] (Megatron's per-segment split of unequal blocks).
    """
    if dim < 0 or size == 1:
        return full
    if isinstance(stride, (list, tuple)):
        return torch.cat([seg.chunk(size, dim=dim)[rank] for seg in full.split(list(stride), dim=dim)], dim=dim)
    parts = full.chunk(stride * size, dim=dim)  # stride blocks, each cut into `size` pieces
    return torch.cat([parts[i * size + rank] for i in range(stride)], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, stride) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's slice, in rank order."""
    if dim < 0 or len(shards) == 1:
        return shards[0]
    if isinstance(stride, (list, tuple)):  # segment sizes: each rank holds 1/n of every segment
        pieces = [s.split([n // len(shards) for n in stride], dim=dim) for s in shards]
        return torch.cat([pieces[r][i] for i in range(len(stride)) for r in range(len(shards))], dim=dim)
    pieces = [s.chunk(stride, dim=dim) for s in shards]  # [rank][stride block]
    return torch.cat([pieces[r][i] for i in range(stride) for r in range(len(shards))], dim=dim)


def seed_for(seed: int, name: str) -> int:
    """The generator seed of the parameter with global name `name`: (seed · 1,000,003 + crc32(name)) mod 2^63."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_params(module: nn.Module, seed: int, grid: Grid | None, rename=lambda name: name):
    """Fill every marked parameter: build its full master tensor from (seed, global name), keep this rank's slice.

    `rename` maps a local parameter name to its layout-independent global name (pipeline stages offset the
    layer numbers). Shared parameters (tied embeddings) are filled once, from their first name.
    """
    tp = grid.tp if grid is not None else None
    seen = set()
    for name, p in module.named_parameters():
        if id(p) in seen or not hasattr(p, "init"):
            continue
        seen.add(id(p))
        size = tp.size if (tp is not None and p.tensor_model_parallel) else 1
        full_shape = list(p.shape)
        if p.tensor_model_parallel:
            full_shape[p.partition_dim] *= size
        kind, *args = p.init
        if kind in ("normal", "uniform"):  # ("normal", std); ("uniform", fn): fn(a U[0,1) draw) (Mamba's inits)
            gen = torch.Generator().manual_seed(seed_for(seed, rename(name)))
            full = (torch.randn(full_shape, generator=gen, dtype=torch.float64) * args[0] if kind == "normal"
                    else args[0](torch.rand(full_shape, generator=gen, dtype=torch.float64)))
        elif kind in ("zeros", "ones"):
            full = torch.zeros(full_shape) if kind == "zeros" else torch.ones(full_shape)
        else:
            raise ValueError(f"unknown init {p.init} for {name}")
        rank = tp.rank if size > 1 else 0
        p.copy_(shard(full, p.partition_dim, p.partition_stride, rank, size).to(p.dtype))


# ============================================================================================================
# 4. Tensor-parallel layers — mirrors megatron/core/tensor_parallel/layers.py and cross_entropy.py
#
#   ColumnParallelLinear  Y = X·Aᵀ,  A split by rows (output features):   X ─f─> [X·A₁ᵀ | X·A₂ᵀ]   (no comm after)
#   RowParallelLinear     Y = X·Aᵀ,  A split by columns (input features): [X₁ | X₂] -> X₁·A₁ᵀ + X₂·A₂ᵀ ─g─> Y
#   Under sequence parallelism f becomes an all-gather of the sequence (gather_from_sp) and g a reduce-scatter
#   (reduce_scatter_to_sp), so activations between the layers stay split along s. The column-parallel linear then
#   keeps only its input's sequence shard for backward and all-gathers it again there (_LinearWithSequenceGather).
#   The local GEMM is a per-layer hook, `linear_impl(x, weight, bias) -> y`, F.linear by default; a layer whose
#   GEMM runs another way (an FP8 GEMM, Transformer Engine's Linear) gets another callable there.
# ============================================================================================================
def _all_gather_async(x, g: Group):  # along dim 0: x [s/tp, ...] -> ([s, ...], the pending work)
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))
    _log("all_gather", g, out)
    return out, all_gather_single(out, x.contiguous(), group=g.pg, async_op=True)


def _reduce_scatter_async(x, g: Group):  # along dim 0: x [s, ...] -> ([s/tp, ...], the pending work)
    out = x.new_empty((x.shape[0] // g.size, *x.shape[1:]))
    _log("reduce_scatter", g, x)
    return out, reduce_scatter_single(out, x.contiguous(), group=g.pg, async_op=True)


class _LinearWithSequenceGather(torch.autograd.Function):
    """Y = g(X)·Wᵀ + b, a column-parallel linear under sequence parallelism, that keeps X's sequence shard for
    backward, not the gathered g(X): Megatron's LinearWithGradAccumulationAndAsyncCommunication with
    sequence_parallel (Korthikanti et al. 2022 §4.2.2: only the s/t shard is stored; g runs again in backward).
    The plain (sequential) oracle is the layer's other path, `F.linear(gather_from_sp(X), W, b)` (save_shard False,
    or any other linear_impl): the same collectives forward, the same GEMMs, the same numbers (tests compare them),
    but autograd keeps g(X) [s, b, in] whole on every rank. Backward, in Megatron's order (async communication):
        1. g again: all-gather the shard X [s/tp, b, in] -> [s, b, in], asynchronously   (only if W needs a grad)
        2. dgrad  dX = dY·W  [s, b, in], partial sums, queued while the all-gather runs
        3. wait for the all-gather
        4. g's backward: reduce-scatter dX -> [s/tp, b, in], asynchronously
        5. wgrad  dW = dYᵀ·g(X)  [out/tp, in] (and db = Σ dY [out/tp]) while the reduce-scatter runs
        6. wait for the reduce-scatter
    So an SP column-parallel linear moves one more all-gather per backward than the oracle (Megatron's too)."""

    @staticmethod
    def forward(ctx, x, weight, bias, g):  # x [s/tp, b, in] this rank's shard, weight [out/tp, in], bias [out/tp]
        total = _gather(x, g, 0)  # g: all-gather the sequence -> [s, b, in], freed when forward returns
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)  # the shard [s/tp, b, in] only
        ctx.g, ctx.bias = g, bias is not None
        # F.linear's GEMM (addmm, or mm without a bias) written into a tensor of its own: F.linear's 3-d output is a
        # view, and a custom Function's view may not be overwritten in place (the in-place cross-entropy does)
        y = total.new_empty((*total.shape[:-1], weight.shape[0]))  # [s, b, out/tp]
        x2, y2 = total.reshape(-1, total.shape[-1]), y.view(-1, y.shape[-1])  # [s·b, in], [s·b, out/tp]
        if bias is None:
            torch.mm(x2, weight.t(), out=y2)
        else:
            torch.addmm(bias, x2, weight.t(), out=y2)
        return y

    @staticmethod
    def backward(ctx, dy):  # dy [s, b, out/tp]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_w:
            total, gathering = _all_gather_async(x, ctx.g)  # 1. [s, b, in]
        if need_x:
            dx = dy.matmul(weight)  # 2. [s, b, in] partial sums
        if need_w:
            gathering.wait()  # 3.
        if need_x:
            dx, scattering = _reduce_scatter_async(dx, ctx.g)  # 4. [s/tp, b, in]
        if need_w:
            dw = dy.reshape(-1, dy.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))  # 5. [out/tp, in]
        if need_b:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)  # [out/tp]
        if need_x:
            scattering.wait()  # 6.
        return dx, dw, db, None


class ColumnParallelLinear(nn.Module):
    """Linear layer with the weight [out/tp, in] split along the output dim; bias [out/tp] split too."""
    save_shard = True  # under SP with F.linear: keep the input's sequence shard (False: the plain oracle path)

    def __init__(self, in_features, out_features, grid=None, bias=True, std=0.02, gather_output=False,
                 sequence_parallel=False, stride=1, dtype=None, skip_weight=False):
        super().__init__()
        self.tp, self.gather_output, self.sequence_parallel = tp_of(grid), gather_output, sequence_parallel
        n = self.tp.size if self.tp else 1
        if out_features % n:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} not divisible by tp={n}")
        self.weight = None  # skip_weight: the weight is passed to forward (a tied output layer uses the embedding's)
        if not skip_weight:
            self.weight = mark(nn.Parameter(torch.empty(out_features // n, in_features, dtype=dtype)),
                               ("normal", std), partition_dim=0, stride=stride)
        self.bias = mark(nn.Parameter(torch.empty(out_features // n, dtype=dtype)), ("zeros",), 0, stride) if bias else None
        self.linear_impl = F.linear  # the local GEMM hook (see the section's header)

    def forward(self, x, weight=None):  # x [s(/tp), b, in] -> [s, b, out/tp] ([s, b, out] with gather_output)
        w = weight if weight is not None else self.weight
        if self.sequence_parallel and self.tp is not None and self.save_shard and self.linear_impl is F.linear:
            y = _LinearWithSequenceGather.apply(x, w, self.bias, self.tp)  # [s, b, out/tp]
        else:  # the oracle; also any other GEMM (FP8, TE: they keep their own copy of g(X), FP8 in FP8's bytes)
            x = gather_from_sp(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
            y = self.linear_impl(x, w, self.bias)  # [s, b, out/tp]
        return gather_from_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Linear layer with the weight [out, in/tp] split along the input dim; the bias is added after the reduction."""

    def __init__(self, in_features, out_features, grid=None, bias=True, std=0.02, sequence_parallel=False, dtype=None):
        super().__init__()
        self.tp, self.sequence_parallel = tp_of(grid), sequence_parallel
        n = self.tp.size if self.tp else 1
        if in_features % n:
            raise ValueError(f"RowParallelLinear: in_features={in_features} not divisible by tp={n}")
        self.weight = mark(nn.Parameter(torch.empty(out_features, in_features // n, dtype=dtype)), ("normal", std), 1)
        self.bias = mark(nn.Parameter(torch.empty(out_features, dtype=dtype)), ("zeros",),
                         sequence_parallel=sequence_parallel) if bias else None
        self.linear_impl = F.linear  # the local GEMM hook (see the section's header)

    def forward(self, x):  # x [s, b, in/tp] -> [s(/tp), b, out]
        y = self.linear_impl(x, self.weight, None)  # [s, b, out] partial sums
        y = reduce_scatter_to_sp(y, self.tp) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over TP: rank r owns ids [r·V/tp, (r+1)·V/tp); others contribute zeros, then g.
    forward(ids, reduce_scatter=True) (Megatron's reduce_scatter_embeddings, for sequence parallelism when nothing is
    added to the whole sequence after the lookup): ḡ instead of g, the output already sequence-first and split,
    [s/tp, b, h] — one reduce-scatter where g + the split would all-reduce the full sequence (the same bytes)."""

    def __init__(self, num_embeddings, embedding_dim, grid=None, std=0.02, dtype=None):
        super().__init__()
        self.tp = tp_of(grid)
        n, r = (self.tp.size, self.tp.rank) if self.tp else (1, 0)
        if num_embeddings % n:
            raise ValueError(f"VocabParallelEmbedding: vocabulary {num_embeddings} not divisible by tp={n}")
        self.per_rank = num_embeddings // n
        self.start = r * self.per_rank
        self.weight = mark(nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype)), ("normal", std), 0)

    def forward(self, ids, reduce_scatter: bool = False):  # ids [b, s] -> [b, s, h]; reduce_scatter: [s/tp, b, h]
        if self.tp is None:
            y = F.embedding(ids, self.weight)
            return rearrange(y, "b s h -> s b h").contiguous() if reduce_scatter else y
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)  # ids owned by another rank contribute nothing here
        if reduce_scatter:
            return reduce_scatter_to_sp(rearrange(y, "b s h -> s b h"), self.tp)  # ḡ: [s/tp, b, h]
        return reduce_from_tp(y, self.tp)  # g


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log Σⱼ exp(zⱼ) − z_target, with z split over TP along V; three all-reduces (max, target, sum-exp).

    With label smoothing ε (as torch.nn.functional.cross_entropy defines it): loss = (1−ε)·nll + ε·mean_j(−log pⱼ),
    which needs one more sum, Σⱼ zⱼ, packed into the same all-reduce as the target logit.
    """

    @staticmethod
    def forward(ctx, logits, target, g, eps, inplace):  # logits [s, b, V/tp], target [s, b]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # a copy, worked on in place
        elif not inplace:
            logits = logits.clone()
        n, r = (g.size, g.rank) if g is not None else (1, 0)
        vp = logits.shape[-1]
        zmax = logits.max(dim=-1).values
        if g is not None:
            _log("all_reduce", g, zmax)
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=g.pg)  # 1: global max for stability
        z = logits.sub_(zmax.unsqueeze(-1))  # the one [s, b, V/tp] buffer: shifted logits, then exp, then softmax
        local = target - r * vp
        outside = (local < 0) | (local >= vp)
        idx = local.masked_fill(outside, 0).unsqueeze(-1)
        z_target = z.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)
        sums = torch.stack([z_target, z.sum(-1)]) if eps > 0 else z_target.unsqueeze(0)
        # exp of z < −80 is denormal or 0, which a CPU computes ~25× slower (untrained T5 logits reach z ≈ −100):
        # clamped at −80, they change Σ exp(z) ≥ 1 (the max term is exp(0)) by < V·exp(−80) ≈ 1e-31 of it
        softmax = z.clamp_(min=-80.0).exp_()
        sum_exp = softmax.sum(-1)
        sums = all_reduce(sums, g)  # 2: the target logit (owned by one rank) [and Σ z]
        sum_exp = all_reduce(sum_exp, g)  # 3: the softmax denominator
        log_z = sum_exp.log()
        loss = log_z - sums[0]
        if eps > 0:
            V = vp * n
            loss = (1 - eps) * loss + eps * (log_z - sums[1] / V)
        softmax.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, outside)
        ctx.eps, ctx.V = eps, vp * n
        return loss

    @staticmethod
    def backward(ctx, dloss):  # d loss / d z = softmax − (1−ε)·onehot − ε/V
        softmax, idx, outside = ctx.saved_tensors
        grad = softmax  # in place, as Megatron's backward (a second backward then fails autograd's version check)
        if ctx.eps > 0:
            grad -= ctx.eps / ctx.V
        grad.scatter_add_(-1, idx, -(1 - ctx.eps) * (~outside).unsqueeze(-1).to(grad.dtype))
        return grad.mul_(dloss.unsqueeze(-1)), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, grid_or_group=None, label_smoothing: float = 0.0,
                                 inplace: bool = False):
    """Per-token loss [s, b] from vocabulary-sharded logits [s, b, V/tp] without gathering the vocabulary.
    inplace: the logits' buffer becomes the softmax (Megatron's in-place forward): no second [s, b, V/tp] buffer,
    and the logits are overwritten — for a caller that drops them (autograd refuses a backward through any other
    use of them: their version changed)."""
    g = tp_of(grid_or_group) if isinstance(grid_or_group, Grid) else grid_or_group
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if inplace and logits.is_leaf and logits.requires_grad:
        raise ValueError("inplace=True needs logits a layer computed, not a leaf tensor that requires grad "
                         f"(shape {tuple(logits.shape)}): its .grad would share its buffer")
    # also at one shard (g None): one [s, b, V] buffer (the softmax, its own gradient in backward), where
    # F.cross_entropy's log-softmax output, NLL-gradient zeros and log-softmax gradient make three
    return _VocabParallelCrossEntropy.apply(logits, target, g if g is not None and g.size > 1 else None,
                                            float(label_smoothing), inplace)


# ============================================================================================================
# 5. RNG tracker and dropout — mirrors megatron/core/tensor_parallel/random.py
#
#  Two streams: the default one, seeded identically on every TP rank (dropout in replicated regions must agree),
#  and "model-parallel-rng" = seed + 2718 + tp_rank (dropout on sharded activations: attention heads, and everything
#  under sequence parallelism, must differ across ranks or the shards would share one mask).
# ============================================================================================================
class RNGTracker:
    """Named RNG streams that `fork(name)` swaps in and out of torch's default generator (CPU, or CUDA for CUDA x).

    Creating the tracker seeds the default stream (seed + 100·pp_rank, as Megatron's _set_random_seed does).
    """

    def __init__(self, seed: int, grid: Grid | None = None):
        tp_rank = grid.tp.rank if grid is not None else 0
        pp_rank = grid.pp.rank if grid is not None else 0
        self.seed = seed + 100 * pp_rank  # pipeline stages differ; TP and DP ranks agree
        torch.manual_seed(self.seed)  # the default stream (seeds CUDA too)
        self.seeds = {"model-parallel-rng": self.seed + 2718 + tp_rank}
        self.states: dict[tuple[str, str], torch.Tensor] = {}
        self._active: set[str] = set()

    @staticmethod
    def _get(dev):
        return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()

    @staticmethod
    def _set(state, dev):
        torch.cuda.set_rng_state(state, dev) if dev.type == "cuda" else torch.set_rng_state(state)

    def add(self, name: str, seed: int):
        self.seeds[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng", device="cpu"):
        dev = torch.device(device)
        if name in self._active:  # re-entrant: already drawing from this stream
            yield
            return
        orig = self._get(dev)
        key = (name, dev.type)
        if key not in self.states:  # first use on this device type: a fresh generator state from the seed
            torch.cuda.manual_seed(self.seeds[name]) if dev.type == "cuda" else torch.manual_seed(self.seeds[name])
            self.states[key] = self._get(dev)
        self._set(self.states[key], dev)
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self.states[key] = self._get(dev)
            self._set(orig, dev)


def dropout(x, p: float, training: bool, rng: RNGTracker | None = None, sharded: bool = False):
    """F.dropout drawn from the model-parallel stream when `x` is a TP/SP shard, else from the default stream."""
    if p == 0.0 or not training:
        return x
    if sharded and rng is not None:
        with rng.fork(device=x.device):
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


# ============================================================================================================
# 6. Gradient finalization and shard gathering — mirrors megatron/core/distributed/finalize_model_grads.py
#
#  Also the layout-free view of a sharded model that checkpoints and tests use: a parameter's full tensor
#  (gather_full), loading full tensors back into shards (load_full_state_dict), and expert weights named by their
#  global index whatever ep is (expert_global_name).
# ============================================================================================================
def finalize_grads(model: nn.Module | list[nn.Module], grid: Grid | None):
    """Reductions that backward alone cannot do, called once per step after the last micro-batch's backward.

    1. Sequence parallelism: each TP rank saw only s/tp tokens, so replicated parameters used on sharded
       activations (LayerNorm weights, RowParallel biases, ...) hold partial gradients: sum them over TP.
    2. Tied embeddings under pipelining: the first stage's word embedding and the last stage's output layer are
       two copies of one weight; sum their grads over the embedding group so both take the same step.
    3. Data parallelism (plain, unbucketed): sum every gradient over the DP x CP group. No 1/dp here: the loss is
       already divided by the *global* token count (DESIGN.md §2), so the sum is the exact global gradient.
       MoE expert weights (`expert_parallel`) live on one EP rank each: they are summed over `expert_dp` instead.
    `model` may be a list of virtual-pipeline chunks.
    """
    if grid is None:
        return
    chunks = model if isinstance(model, (list, tuple, nn.ModuleList)) else [model]
    params = [p for m in chunks for p in m.parameters() if p.grad is not None]
    if grid.tp.size > 1:
        _sum_grads([p for p in params if getattr(p, "sequence_parallel", False)], grid.tp)
    if grid.embedding is not None and grid.embedding.size > 1:
        _sum_grads([p for p in params if getattr(p, "shared_embedding", False)], grid.embedding)
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    if grid.dp_cp.size > 1:
        _sum_grads([p for p in params if not getattr(p, "expert_parallel", False)], grid.dp_cp)
    if grid.expert_dp.size > 1:
        _sum_grads(experts, grid.expert_dp)


def _sum_grads(params, g: Group, attr: str = "grad"):
    """All-reduce (sum) the grads of `params` over `g` as one flat buffer: one collective, not one per tensor.
    attr: the gradient's attribute (DDP's fp32 buffer views are `main_grad`)."""
    if not params:
        return
    grads = [getattr(p, attr) for p in params]
    flat = all_reduce(torch.cat([t.reshape(-1) for t in grads]), g)
    for t, new in zip(grads, flat.split([t.numel() for t in grads])):
        t.copy_(new.view_as(t))


def gather_full(t: torch.Tensor, p: nn.Parameter, grid: Grid | None) -> torch.Tensor:
    """The full (unsharded) tensor of parameter `p`'s shard `t` (the parameter itself or its gradient)."""
    tp = tp_of(grid)
    if tp is None or not getattr(p, "tensor_model_parallel", False):
        return t
    out = [torch.empty_like(t) for _ in range(tp.size)]
    _log("all_gather", tp, t, times=tp.size)
    dist.all_gather(out, t.contiguous(), group=tp.pg)
    return unshard(out, p.partition_dim, p.partition_stride)


def pad_vocab(vocab_size: int, divisible_by: int = 128) -> int:
    """Vocabulary padded to a multiple of `divisible_by` — NOT of divisible_by·tp as in Megatron (its issue #1754),
    so every TP size trains the same model."""
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


# MoE expert weights are named by their global index (GroupedMLP, section 10, holds E/ep local ones)
_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.weight)(\d+)$")


def expert_global_name(name: str, grid: Grid | None, num_experts: int | None) -> str:
    """experts.linear_fc1.weight{local i} -> weight{ep_rank·E/ep + i}: names (and init) independent of ep."""
    m = _EXPERT.search(name)
    if m is None or grid is None or grid.ep_size == 1:
        return name
    return name[:m.start(2)] + str(grid.ep.rank * (num_experts // grid.ep_size) + int(m.group(2)))


def _another_ranks_expert(name: str, own: dict, grid: Grid | None) -> bool:
    """Whether global expert weight `name` (…experts.linear_fc1.weight{j}) is held by another EP rank: j < E."""
    m = _EXPERT.search(name)
    if m is None or grid is None or grid.ep_size == 1:
        return False
    stem = name[:m.start(2)]
    local = sum(1 for k in own if k.startswith(stem) and k[len(stem):].isdigit())  # E/ep here
    return int(m.group(2)) < local * grid.ep_size


@torch.no_grad()
def load_full_state_dict(module: nn.Module, full: dict[str, torch.Tensor], grid: Grid | None, strict: bool = True):
    """Copy full (unsharded) tensors into `module`, each rank keeping its slice — the inverse of `gather_full`.
    Parameters are looked up by their global name (`module.global_name`, as `init_params`), so an expert-parallel
    rank takes its own experts; `strict`: every parameter is in `full`, and every entry of `full` is one of ours or
    (under EP) one of another rank's experts. Persistent buffers (MoE's expert bias, replicated) load when `full`
    has them; a converter that has none leaves their initial value."""
    tp, rename = tp_of(grid), getattr(module, "global_name", lambda name: name)
    own = {rename(k): p for k, p in module.named_parameters(remove_duplicate=False)}
    persistent = module.state_dict(keep_vars=True)
    buffers = {rename(k): b for k, b in module.named_buffers() if k in persistent}
    missing = [k for k in own if k not in full]
    unexpected = [k for k in full if k not in own and k not in buffers and not _another_ranks_expert(k, own, grid)]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in own.items():
        if name not in full:
            continue
        t = full[name]
        if getattr(p, "tensor_model_parallel", False) and tp is not None:
            t = shard(t, p.partition_dim, p.partition_stride, tp.rank, tp.size)
        if t.shape != p.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} does not fit parameter {tuple(p.shape)}")
        p.copy_(t)
    for name, b in buffers.items():
        if name in full:
            if full[name].shape != b.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(full[name].shape)} does not fit buffer {tuple(b.shape)}")
            b.copy_(full[name])


# ============================================================================================================
# 7. Schedules — mirrors megatron/core/pipeline_parallel/schedules.py (get_forward_backward_func)
#
#  A schedule runs forward and backward over the micro-batches of one step. Every schedule applies the one
#  loss-normalization rule (DESIGN.md §2): each micro-batch contributes (sum of its token losses) / num_tokens,
#  where num_tokens counts the loss tokens of the whole global batch (all micro-batches, all DP ranks).
#  Losses the model adds inside itself follow the same rule: before the first micro-batch, a schedule calls
#  `set_num_tokens(num_tokens)` on every submodule that has that method (MoE's Router does: its aux losses).
# ============================================================================================================
def set_num_tokens(model: nn.Module | list[nn.Module], num_tokens: int | float):
    """Tell every submodule with a `set_num_tokens(n)` method the global batch's loss-token count."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for m in chunk.modules():
            if callable(getattr(m, "set_num_tokens", None)):
                m.set_num_tokens(num_tokens)


def after_step(model: nn.Module | list[nn.Module]):
    """Call every submodule's `after_step()` method: the optimizers (section 9) do, once each step is applied (MoE's
    Router moves its expert bias by the step's global token counts)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for m in chunk.modules():
            if callable(getattr(m, "after_step", None)):
                m.after_step()


def forward_backward_no_pipelining(model: nn.Module, micro_batches, loss_func, num_tokens: int | float):
    """Gradient accumulation: forward + backward each micro-batch in turn. Returns this rank's loss contribution.

    `loss_func(model, micro_batch)` returns the *sum* of the micro-batch's per-token losses (a scalar tensor).
    """
    total = 0.0
    set_num_tokens(model, num_tokens)  # losses inside the model follow the same rule
    for mb in micro_batches:
        loss_sum = loss_func(model, mb)
        (loss_sum / num_tokens).backward()
        total = total + loss_sum.detach() / num_tokens
    return total


# ============================================================================================================
# 8. Pipeline parallelism — mirrors megatron/core/pipeline_parallel/schedules.py and p2p_communication.py
#
#  The layers are cut into pp stages (pp·v chunks with the interleaved schedule: rank r holds chunks
#  r, r+pp, r+2pp, ... of the model, so activations travel 0 -> 1 -> ... -> pp-1 -> 0 -> ... v times).
#  A schedule is just the ordered list of what one rank does: ("F", micro-batch, chunk) and ("B", ...).
#  `run_schedule` executes such a list: a forward receives its input from the previous stage (unless it is the
#  first), a backward receives the output gradient from the next stage (unless it is the last). Sends are
#  asynchronous and every message is tagged (micro-batch, chunk, direction), so the only waits are real data
#  dependencies — the schedule's order alone decides the timetable.
#
#  1F1B, pp = 4, M = 6 micro-batches: the output of timetable(4, 6) below, which runs schedule_1f1b's orders with
#  their data dependencies, each action one time unit (F = forward, B = backward, . = waiting: the bubble;
#  tests/test_pipeline.py holds this picture and README.md's to that output):
#      rank 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5
#      rank 1: .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
#      rank 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5
#      rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
#  warmup = min(pp − rank − 1, M) forwards, then one-forward-one-backward, then the cooldown backwards. A rank
#  never holds more than warmup + 1 micro-batches' activations (vs M for all-forward-then-all-backward).
# ============================================================================================================
def stage_layers(num_layers: int, grid: Grid | None, vp: int = 1, chunk: int = 0) -> tuple[int, int]:
    """(first global layer, layer count) of virtual chunk `chunk` on this rank, as Megatron's get_transformer_layer_offset."""
    pp, r = (grid.pp_size, grid.pp.rank) if grid is not None else (1, 0)
    if num_layers % (pp * vp):
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline size {pp} x virtual stages {vp}")
    per_chunk = num_layers // (pp * vp)
    return chunk * (num_layers // vp) + r * per_chunk, per_chunk


def build_chunks(make, num_layers: int, grid: Grid | None, vp: int = 1, stages=stage_layers) -> list[nn.Module]:
    """This rank's model chunks: make(pre_process, post_process, layer_offset, num_layers) for each virtual stage;
    `stages(num_layers, grid, vp, chunk)` places them (default: stage_layers, the even split; a Config's
    stage_layers, e.g. a Mamba pattern's '|' cuts)."""
    pp, r = (grid.pp_size, grid.pp.rank) if grid is not None else (1, 0)
    if vp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline stages (vp={vp}) need pipeline parallelism (pp > 1)")
    chunks = []
    for v in range(vp):
        offset, n = stages(num_layers, grid, vp, v)
        chunks.append(make(r == 0 and v == 0, r == pp - 1 and v == vp - 1, offset, n))
    for m in (m for c in chunks[1:] for m in c.modules()):  # one RNG tracker per rank, as in Megatron: chunks with
        if isinstance(getattr(m, "rng", None), RNGTracker):  # trackers of one seed would repeat each other's masks
            m.rng = chunks[0].rng
    return chunks


def schedule_1f1b(pp: int, rank: int, M: int) -> list[tuple[str, int, int]]:
    """Megatron's forward_backward_pipelining_without_interleaving, as a list of actions."""
    warmup = min(pp - rank - 1, M)
    actions = [("F", i, 0) for i in range(warmup)]
    for i in range(M - warmup):  # steady state: the forward of i + warmup, then the backward of i
        actions += [("F", i + warmup, 0), ("B", i, 0)]
    return actions + [("B", i, 0) for i in range(M - warmup, M)]  # cooldown


def schedule_interleaved(pp: int, rank: int, M: int, vp: int) -> list[tuple[str, int, int]]:
    """Megatron's forward_backward_pipelining_with_interleaving, as a list of actions.

    Virtual micro-batch k (0 ≤ k < M·v) runs micro-batches in groups of pp: chunk 0 takes micro-batches 0..pp-1,
    then chunk 1 takes the same pp, ..., then chunk 0 takes pp..2pp-1, and so on. Backward walks chunks in reverse.
    Warmup = (pp − rank − 1)·2 + (v − 1)·pp: the first chunk's pp forwards must reach the last rank and come back
    round to this rank's later chunks (the "·2": a rank r must wait for pp−r−1 stages ahead of it on both the way
    out and the way back) before the first backward can start; every forward of the v − 1 earlier chunks of the
    first group is in flight by then, capped at M·v. With M == pp every forward runs first: Megatron's all-warmup
    case until its tunable schedule (Nov. 2024), which applies the formula there too.
    The micro-batch group size is pp (Megatron's default microbatch_group_size_per_vp_stage).
    """
    if M % pp:
        raise ValueError(f"interleaved schedule: number of micro-batches {M} must be a multiple of pp={pp}")
    total = M * vp

    def chunk_and_mb(k, forward):
        chunk = (k % (pp * vp)) // pp
        return (chunk if forward else vp - 1 - chunk), (k // (pp * vp)) * pp + k % pp

    warmup = total if M == pp else min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
    F_ = lambda k: ("F", *reversed(chunk_and_mb(k, True)))  # ("F", mb, chunk)
    B_ = lambda k: ("B", *reversed(chunk_and_mb(k, False)))
    actions = [F_(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [F_(k + warmup), B_(k)]
    return actions + [B_(k) for k in range(total - warmup, total)]


def timetable(pp: int, M: int, vp: int = 1, orders: list | None = None) -> str:
    """The pipeline's timetable as text, simulated from the schedules themselves: one row per rank, one column per
    time unit, each cell the action the rank runs then (F3: forward of micro-batch 3, B3 its backward; with vp > 1
    the chunk follows a dot, F3.1), "." where it waits. `orders`: one action list per rank (default: schedule_1f1b,
    or schedule_interleaved when vp > 1). Every action takes one unit and starts once its rank is free and what it
    needs is done: a forward, the previous stage's forward of its micro-batch (stage = chunk·pp + rank; the first
    stage needs nothing); a backward, its own forward and the next stage's backward (the last stage: its forward
    only). Orders that can never finish are a ValueError (a deadlock)."""
    orders = orders or [schedule_1f1b(pp, r, M) if vp == 1 else schedule_interleaved(pp, r, M, vp) for r in range(pp)]
    done, pos, rows, t, last = {}, [0] * pp, [[] for _ in range(pp)], 0, pp * vp - 1
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ran = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, mb, v = orders[r][pos[r]]
            st = v * pp + r
            needs = [("F", mb, st), ("B", mb, st + 1)][:1 + (st < last)] if kind == "B" else [("F", mb, st - 1)][:st]
            if all(done.get(n, t) < t for n in needs):  # finished by now: started at an earlier time unit
                done[kind, mb, st], pos[r], ran = t, pos[r] + 1, True
                rows[r].append(f"{kind}{mb}" + (f".{v}" if vp > 1 else ""))
            else:
                rows[r].append(".")
        if not ran:
            raise ValueError(f"the schedules deadlock at time {t}: each rank waits at its action {pos}")
        t += 1
    width = max(len(c) for row in rows for c in row)
    return "\n".join(f"rank {r}: " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(rows))


def run_schedule(actions, chunks: list[nn.Module], micro_batches, forward_step, num_tokens, grid: Grid,
                 shape: tuple, dtype, trace: list | None = None):
    """Execute a schedule on this rank. forward_step(model, mb) returns the chunk's output: hidden states
    [s(/tp), b, h] on inner stages, the sum of per-token losses (a scalar) on the last stage.
    Returns this rank's loss contribution (0 unless it holds the last stage)."""
    pp, r, vp = grid.pp_size, grid.pp.rank, len(chunks)
    ranks = grid.pp.ranks
    tag = lambda mb, chunk, backward: (mb * vp + chunk) * 2 + int(backward)
    inputs, outputs, sends, total, in_flight, peak = {}, {}, [], 0.0, 0, 0
    set_num_tokens(chunks, num_tokens)  # losses inside the model follow the same rule (section 7)
    for kind, mb, v in actions:
        model = chunks[v]
        if trace is not None:
            trace.append((kind, mb, v))
        if kind == "F":
            x = None
            if not model.pre_process:  # from (r−1, v), or from (pp−1, v−1) when the ring wraps round
                x = torch.empty(shape, dtype=dtype)
                _log("recv", grid.pp, x)
                dist.irecv(x, ranks[(r - 1) % pp], group=grid.pp.pg, tag=tag(mb, v, False)).wait()
                x.requires_grad_()
            model.input_tensor = x
            out = forward_step(model, micro_batches[mb])
            if model.post_process:
                total = total + out.detach() / num_tokens
            else:
                if tuple(out.shape) != tuple(shape):
                    raise ValueError(f"pipeline: stage {r} chunk {v} sends {tuple(out.shape)}, expected {tuple(shape)}")
                dst_chunk = v if r < pp - 1 else v + 1
                _log("send", grid.pp, out)
                sends.append(dist.isend(out.detach().contiguous(), ranks[(r + 1) % pp], group=grid.pp.pg,
                                        tag=tag(mb, dst_chunk, False)))
            inputs[mb, v], outputs[mb, v] = x, out
            in_flight += 1
            peak = max(peak, in_flight)
        else:
            x, out = inputs.pop((mb, v)), outputs.pop((mb, v))
            if model.post_process:
                (out / num_tokens).backward()
            else:
                dy = torch.empty(shape, dtype=dtype)
                _log("recv", grid.pp, dy)
                dist.irecv(dy, ranks[(r + 1) % pp], group=grid.pp.pg, tag=tag(mb, v, True)).wait()
                torch.autograd.backward(out, dy)
            if x is not None:
                src_chunk = v if r > 0 else v - 1
                _log("send", grid.pp, x.grad)
                sends.append(dist.isend(x.grad.contiguous(), ranks[(r - 1) % pp], group=grid.pp.pg,
                                        tag=tag(mb, src_chunk, True)))
            in_flight -= 1
    for s in sends:
        s.wait()
    run_schedule.peak_in_flight = peak
    return total


def forward_backward(chunks, micro_batches, forward_step, num_tokens, grid: Grid | None, shape=None, dtype=None,
                     trace=None, forward_only=False):
    """Pick the schedule: no pipelining, 1F1B, or interleaved 1F1B (len(chunks) > 1). forward_only (evaluation,
    under torch.no_grad): every forward in the schedule's order, no backward."""
    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    M = len(micro_batches)
    if grid is None or grid.pp_size == 1:
        if forward_only:
            return sum(forward_step(chunks[0], mb).detach() / num_tokens for mb in micro_batches)
        return forward_backward_no_pipelining(chunks[0], micro_batches, forward_step, num_tokens)
    pp, r, vp = grid.pp_size, grid.pp.rank, len(chunks)
    if forward_only:
        order = schedule_1f1b(pp, r, M) if vp == 1 else schedule_interleaved(pp, r, M, vp)
        actions = [a for a in order if a[0] == "F"]
    else:
        actions = schedule_1f1b(pp, r, M) if vp == 1 else schedule_interleaved(pp, r, M, vp)
    return run_schedule(actions, chunks, micro_batches, forward_step, num_tokens, grid, shape, dtype, trace)


# ============================================================================================================
# 9. Data parallelism and the distributed optimizer — mirrors megatron/core/distributed/
#    (distributed_data_parallel.py, param_and_grad_buffer.py, finalize_model_grads.py) and
#    megatron/core/optimizer/distrib_optimizer.py. Paper: Rajbhandari et al. 2020, "ZeRO" (stage 1).
#
#  Gradients live in one contiguous fp32 buffer, parameters laid out in reverse order (≈ the order backward
#  produces their grads) and cut into buckets. When the last micro-batch's backward has filled a bucket, its
#  reduction is launched asynchronously while backward goes on with earlier layers (overlap).
#     plain DP:              all-reduce each bucket             -> every rank holds the whole summed gradient
#     distributed optimizer: reduce-scatter each bucket         -> rank d holds the sum for its 1/dp slice,
#                            AdamW on that slice (fp32 master),    so optimizer state is sharded dp ways,
#                            all-gather the updated parameters     then every rank has the whole model again.
#  No 1/dp scaling: the loss is already divided by the global token count (DESIGN.md §2), so sums are exact.
#  MoE expert weights (expert parallelism) get buckets of their own, reduced over `expert_dp` (the ranks holding the
#  same experts) and, with the distributed optimizer, sharded over it: a bucket carries its process group.
#  Optimizer (whole parameters, finalize_grads) and DistributedOptimizer (DDP's buffers) share one interface and
#  one clipping rule (counted_in_norm, clip_by_global_norm), so the training loop never branches on which it has.
# ============================================================================================================
def decays(p: nn.Parameter) -> bool:
    """Megatron's rule: no weight decay for biases and norm weights (1-D parameters)."""
    return p.dim() > 1


def counted_in_norm(p: nn.Parameter, grid: Grid | None) -> bool:
    """The global gradient norm counts each parameter once: a TP-replicated one (the same grad on every TP rank after
    the reductions) only on TP rank 0, the last stage's copy of the tied embedding not at all."""
    return grid is None or not ((not getattr(p, "tensor_model_parallel", False) and grid.tp.rank > 0)
                                or (getattr(p, "shared_embedding", False) and grid.pp.rank > 0))


def clip_by_global_norm(sq, grads, max_norm: float | None, grid: Grid | None, dp_sliced: bool = False):
    """sq: this rank's sums of squared grads [dense, MoE expert] of the parameters it counts (counted_in_norm). Summed
    over TP x PP (one model replica); when each DP rank holds a slice of the grads (distributed optimizer), over DP x CP
    (for experts that group is EP x expert_dp: all experts, all slices); else the experts over EP (EP ranks hold
    different experts) and nothing over DP: plain DP grads are already summed, so DP ranks agree.
    Scales `grads` by max_norm / norm when above max_norm (0/None: off). Returns the norm before clipping."""
    if grid is not None:
        sq = all_reduce(sq, grid.mp)
        if dp_sliced:
            sq = all_reduce(sq, grid.dp_cp)
        elif grid.ep_size > 1:
            sq[1:] = all_reduce(sq[1:], grid.ep)
    norm = sq.sum().sqrt()
    if max_norm is not None and max_norm > 0 and float(norm) > max_norm:
        for g in grads:
            g.mul_(max_norm / (float(norm) + 1e-6))
    return norm


class Optimizer:
    """AdamW on whole parameters after the plain DP reduction (finalize_grads): torch.optim.AdamW itself, no weight
    decay where `decays` says so (Megatron's FP32Optimizer). The interface DistributedOptimizer shares, so the training
    loop has one path: .lr, zero_grad(M), finish_grad_sync(), clip_grad_norm(max_norm), step(); full_state() ->
    {param: (exp_avg, exp_avg_sq, step)} for checkpoints, load_full_state() after a checkpoint was loaded into it."""

    def __init__(self, chunks, grid: Grid | None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 decoupled_lr=None):
        self.chunks, self.grid, self.lr = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks], grid, lr
        self.decoupled_lr = decoupled_lr
        self.params = [p for p in nn.ModuleList(self.chunks).parameters() if p.requires_grad]  # each once; frozen: none
        own = lambda p: decoupled_lr is not None and getattr(p, "is_embedding_or_output_parameter", False)  # its lr
        gs = [{"params": [p for p in self.params if decays(p) == wd and own(p) == dec], "decoupled": dec,
               "weight_decay": weight_decay if wd else 0.0} for dec in (False, True) for wd in (True, False)]
        self.adam = torch.optim.AdamW([g for g in gs if g["params"] or not g["decoupled"]], lr=lr, betas=betas, eps=eps)
        for p in self.params:  # state up front, so a checkpoint can be loaded into it
            self.adam.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}

    def zero_grad(self, num_micro_batches: int = 1):
        self.adam.zero_grad(set_to_none=False)

    def finish_grad_sync(self):
        finalize_grads(self.chunks, self.grid)  # SP norm grads over TP; tied embedding over stages; sum over DP

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        params = [p for p in self.params if p.grad is not None]
        sq = torch.zeros(2, dtype=torch.float64, device=params[0].device)  # [dense, MoE expert]
        for p in params:
            if counted_in_norm(p, self.grid):
                sq[int(getattr(p, "expert_parallel", False))] += p.grad.double().square().sum()
        return clip_by_global_norm(sq, [p.grad for p in params], max_norm, self.grid)

    def step(self):
        for g in self.adam.param_groups:
            g["lr"] = self.decoupled_lr if g["decoupled"] else self.lr
        self.adam.step()
        after_step(self.chunks)  # the modules' post-step hooks (MoE: the expert bias)

    def full_state(self) -> dict:
        return {p: (self.adam.state[p]["exp_avg"], self.adam.state[p]["exp_avg_sq"], self.adam.state[p]["step"])
                for p in self.params}

    def load_full_state(self):
        """Nothing to copy: full_state() hands out the live moments, so a checkpoint loads straight into them."""


class _Bucket:  # params in buffer[start:end] (padded to a multiple of group.size), reduced over `group`
    def __init__(self, params, start, end, group: Group):
        self.params, self.start, self.end, self.group = params, start, end, group
        self.expert = group.name == "expert_dp"
        self.decoupled = all(getattr(p, "is_embedding_or_output_parameter", False) for p in params)  # --decoupled-lr
        self.ready, self.handle, self.launched = 0, None, False


class DDP:
    """Bucketed, overlapped gradient reduction for a list of model chunks: over DP x CP, experts over expert_dp."""

    def __init__(self, chunks, grid: Grid, bucket_size: int = 4_000_000, overlap: bool = True,
                 distributed_optimizer: bool = False, own_bucket=lambda p: False):  # own_bucket: --decoupled-lr's
        self.chunks = chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
        self.grid, self.dp, self.overlap, self.distopt = grid, grid.dp_cp, overlap, distributed_optimizer
        params = list({id(p): p for m in reversed(chunks) for p in reversed(list(m.parameters()))  # each once, in
                       if p.requires_grad}.values())  # reverse order: the last layers' grads are ready first
        expert = lambda p: getattr(p, "expert_parallel", False)
        tied = lambda p: getattr(p, "shared_embedding", False)  # synced over stages before DP: a bucket of its own
        own = lambda p: own_bucket(p) and not (tied(p) or expert(p))  # --decoupled-lr's: a bucket steps at one lr
        self.buckets, off = [], 0
        for group, ps, limit in ((grid.dp_cp, [p for p in params if not (tied(p) or expert(p) or own(p))], bucket_size),
                                 (grid.expert_dp, [p for p in params if expert(p)], bucket_size),
                                 (grid.dp_cp, [p for p in params if tied(p)], math.inf),
                                 (grid.dp_cp, [p for p in params if own(p)], math.inf)):
            cur, n = [], 0
            for i, p in enumerate(ps):
                cur, n = cur + [p], n + p.numel()
                if n >= limit or i == len(ps) - 1:  # a bucket, padded to a multiple of its group's size so that
                    end = off + -(-n // group.size) * group.size  # a reduce-scatter splits it evenly
                    self.buckets.append(_Bucket(cur, off, end, group))
                    off, cur, n = end, [], 0
        dtype, self.numel = params[0].dtype, off
        self.grad_buffer = torch.zeros(off, dtype=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
        self.param_buffer = torch.zeros(off, dtype=dtype)  # params become views into it (all-gathered in place)
        self.bucket_of, self.offset = {}, {}  # the parameter's bucket, its offset in the flat buffers
        for b in self.buckets:
            o = b.start
            for p in b.params:
                self.param_buffer[o:o + p.numel()].copy_(p.data.reshape(-1))
                p.data = self.param_buffer[o:o + p.numel()].view_as(p)
                p.main_grad = self.grad_buffer[o:o + p.numel()].view_as(p)
                p.register_post_accumulate_grad_hook(self._hook)
                self.bucket_of[p], self.offset[p] = b, o
                o += p.numel()
            b.grad_shard, b.param_shard = self.grad_buffer[self.owned(b)], self.param_buffer[self.owned(b)]  # stepped
        self.launch_log: list[tuple[int, int]] = []  # (bucket, hooks fired so far): the overlap test reads it
        self.zero_grad()

    def zero_grad(self, num_micro_batches: int = 1):
        """Start a step: zero the buffer; a bucket is complete once each of its params has seen M backwards."""
        self.grad_buffer.zero_()
        self.M, self.hooks_fired = num_micro_batches, 0
        for b in self.buckets:
            b.ready, b.handle, b.launched = 0, None, False
            for p in b.params:
                p.grad = None  # autograd must start a fresh .grad, not add into the buffer view
        self.launch_log.clear()

    def _hook(self, p):
        p.main_grad.add_(p.grad)  # accumulate micro-batches in the (fp32) buffer
        p.grad = None
        self.hooks_fired += 1
        b = self.bucket_of[p]
        b.ready += 1
        if self.overlap and b.ready == self.M * len(b.params) and not getattr(p, "shared_embedding", False):
            self._launch(b)  # the bucket's last grad of the step: reduce it while backward goes on

    def _launch(self, b: _Bucket):
        b.launched = True
        self.launch_log.append((self.buckets.index(b), self.hooks_fired))
        if b.group.size == 1:
            return
        buf = self.grad_buffer[b.start:b.end]
        _log("reduce_scatter" if self.distopt else "all_reduce", b.group, buf)
        if self.distopt:
            b.shard = buf.new_empty(buf.numel() // b.group.size)
            b.handle = reduce_scatter_single(b.shard, buf, group=b.group.pg, async_op=True)
        else:
            b.handle = dist.all_reduce(buf, group=b.group.pg, async_op=True)

    def finish_grad_sync(self):
        """Wait for every bucket's reduction (launching the ones backward did not), then the TP and stage sums."""
        emb = self.grid.embedding
        for b in self.buckets:
            if b.launched:
                continue
            if emb is not None and emb.size > 1 and any(getattr(p, "shared_embedding", False) for p in b.params):
                for p in b.params:  # tied embedding: first + last stage's local sums, before the DP sum
                    p.main_grad.copy_(all_reduce(p.main_grad, emb))
            self._launch(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            if self.distopt and b.group.size > 1:  # this rank's slice of the bucket now holds the summed grads
                self.grad_buffer[self.owned(b)].copy_(b.shard)
        if self.grid.tp.size > 1:  # SP partial grads: sum over TP (same buffer layout on every TP rank)
            sp = [p for b in self.buckets for p in b.params if getattr(p, "sequence_parallel", False)]
            _sum_grads(sp, self.grid.tp, "main_grad")
        for p in self.bucket_of:  # plain DP: the whole grad; distributed optimizer: valid on the own slice only
            if p.main_grad.dtype == p.dtype:  # (bf16/fp16 params keep their fp32 grads in the buffer only)
                p.grad = p.main_grad

    def owned(self, b: _Bucket) -> slice:
        """The slice of the flat buffers this rank steps: its 1/size of the bucket over the bucket's group (distopt)."""
        if not self.distopt:
            return slice(b.start, b.end)
        n = (b.end - b.start) // b.group.size
        return slice(b.start + b.group.rank * n, b.start + (b.group.rank + 1) * n)

    def per_element(self, fn, dtype=torch.float32) -> list[torch.Tensor]:  # [fn(p) on each element of this rank's
        whole = torch.zeros(self.numel, dtype=dtype)  # slice of bucket i, for each i] (masks: decay, norm, Muon)
        for p, o in self.offset.items():
            whole[o:o + p.numel()] = fn(p)
        return [whole[self.owned(b)].clone() for b in self.buckets]

    def publish(self, b: _Bucket, master: torch.Tensor):  # after the step: the new parameters on every rank
        if master.data_ptr() != b.param_shard.data_ptr():  # bf16 params: from their fp32 master weights
            b.param_shard.copy_(master)
        if self.distopt and b.group.size > 1:
            _log("all_gather", b.group, self.param_buffer[b.start:b.end])
            all_gather_single(self.param_buffer[b.start:b.end], b.param_shard.clone(), group=b.group.pg)


class DistributedOptimizer:
    """AdamW over flat buffer slices (torch.optim.AdamW's arithmetic, element for element); with ddp.distopt sharded
    over each bucket's group (DP x CP; experts: expert_dp): each rank keeps fp32 master weights and Adam moments for its
    slice only, steps it, and all-gathers the parameters. fp32 parameters: the master weights are the parameter buffer."""

    def __init__(self, ddp: DDP, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled_lr=None):
        self.ddp, self.lr, self.betas, self.eps, self.wd, self.step_count = ddp, lr, betas, eps, weight_decay, 0
        self.decoupled_lr = decoupled_lr  # --decoupled-lr: the lr of the buckets DDP made for own_bucket's params
        self.slices = [ddp.owned(b) for b in ddp.buckets]
        fp32 = ddp.buckets[0].param_shard.dtype == ddp.buckets[0].grad_shard.dtype
        self.master = [b.param_shard if fp32 else b.param_shard.float() for b in ddp.buckets]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.wd_mask = ddp.per_element(lambda p: float(decays(p)), self.master[0].dtype)  # 1 where it decays;
        # norm_mask: 1 where an element counts toward the global gradient norm (counted_in_norm)
        self.norm_mask = ddp.per_element(lambda p: float(counted_in_norm(p, ddp.grid)), self.master[0].dtype)

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        for i, (m, b) in enumerate(zip(self.master, self.ddp.buckets)):
            self.update(i, self.decoupled_lr if b.decoupled and self.decoupled_lr is not None else self.lr)
            self.ddp.publish(b, m)  # the new parameters on every rank (bf16: rounded from the master weights)
        after_step(self.ddp.chunks)  # the modules' post-step hooks (MoE: the expert bias)

    def update(self, i: int, lr: float):
        """AdamW on slice i: its master weights and moments, from its summed gradient."""
        (b1, b2), t = self.betas, self.step_count
        g, m, ea, eas = self.ddp.buckets[i].grad_shard, self.master[i], self.exp_avg[i], self.exp_avg_sq[i]
        m.mul_(1 - lr * self.wd * self.wd_mask[i])  # decoupled weight decay
        ea.lerp_(g, 1 - b1)
        eas.mul_(b2).addcmul_(g, g, value=1 - b2)
        m.addcdiv_(ea, (eas.sqrt() / math.sqrt(1 - b2 ** t)).add_(self.eps), value=-lr / (1 - b1 ** t))

    def zero_grad(self, num_micro_batches: int = 1):
        self.ddp.zero_grad(num_micro_batches)

    def finish_grad_sync(self):
        self.ddp.finish_grad_sync()  # wait for the buckets; SP norm grads over TP; tied embedding over stages

    def full_state(self) -> dict:
        """{param: (exp_avg, exp_avg_sq, step)} whole per parameter — the DP slices all-gathered — for a checkpoint
        that any layout can read. `load_full_state` keeps this rank's slice of what a checkpoint filled in."""
        bufs = []
        for moments in (self.exp_avg, self.exp_avg_sq):
            full = torch.zeros(self.ddp.numel, dtype=moments[0].dtype)
            for s, m, b in zip(self.slices, moments, self.ddp.buckets):
                full[s] = m
                if self.ddp.distopt and b.group.size > 1:
                    _log("all_gather", b.group, full[b.start:b.end])
                    all_gather_single(full[b.start:b.end], full[s].clone(), group=b.group.pg)
            bufs.append(full)
        self._full, out = bufs, {}
        for b in self.ddp.buckets:
            o = b.start
            for p in b.params:
                out[p] = (*(f[o:o + p.numel()].view_as(p) for f in bufs), torch.tensor(float(self.step_count)))
                o += p.numel()
        self._steps = [v[2] for v in out.values()]
        return out

    @torch.no_grad()
    def load_full_state(self):
        self.step_count = int(self._steps[0])
        for moments, full in zip((self.exp_avg, self.exp_avg_sq), self._full):
            for s, m in zip(self.slices, moments):
                m.copy_(full[s])
        for b, m in zip(self.ddp.buckets, self.master):
            if m.data_ptr() != b.param_shard.data_ptr():  # bf16 params
                m.copy_(b.param_shard)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """clip_by_global_norm over this rank's slices (norm_mask: counted_in_norm per element)."""
        grads = [b.grad_shard for b in self.ddp.buckets]
        sq = torch.zeros(2, dtype=torch.float64, device=grads[0].device)  # [dense, MoE expert]
        for g, m, b in zip(grads, self.norm_mask, self.ddp.buckets):
            sq[int(b.expert)] += ((g.double() ** 2) * m).sum()
        return clip_by_global_norm(sq, grads, max_norm, self.ddp.grid, dp_sliced=self.ddp.distopt)


# ============================================================================================================
# 10a. Mixture of Experts: the router — mirrors megatron/core/transformer/moe/: router.py (TopKRouter), moe_utils.py
#     (aux losses, topk_routing_with_score_function, group_limited_topk, MoEAuxLossAutoScaler). Section 10 is cut in
#     two (10a the router, 10b the experts, dispatchers and the layer) to keep each part readable at once.
#     Papers: Shazeer et al. 2017 (sparsely-gated MoE, top-k); Lepikhin et al. 2020 (GShard: capacity, expert
#     parallelism); Fedus et al. 2021 (Switch: the load-balancing loss); Zoph et al. 2022 (ST-MoE: the z-loss);
#     Wang et al. 2024 "Auxiliary-Loss-Free Load Balancing" and DeepSeek-AI 2024 "DeepSeek-V3" (expert bias, groups).
#
#  T = s·b tokens of a micro-batch (s/tp·b per rank under SP), E experts (E/ep on each EP rank), k per token.
#    router   logits = x·Wᵀ [T, E] -> softmax (before or after top-k) or sigmoid -> top-k -> probs [T, E] (zero off
#             the top k) and routing_map [T, E]; capacity C = ceil(T·k/E·factor) keeps each expert's C most probable.
#             DeepSeek-V3 (topk_routing, Megatron's topk_routing_with_score_function): sigmoid scores, the top k
#             renormalised to sum 1, times --moe-router-topk-scaling-factor; group-limited: only experts of the
#             group_topk groups (of num_groups) with the largest sum of their top k/group_topk scores; aux-loss-free
#             balancing: a per-expert bias added to the scores for the SELECTION only (the weights stay unbiased),
#             moved after each optimizer step by rate·sign(mean load − load) of the global batch (Router.after_step).
#  Aux losses follow the one loss rule (DESIGN.md §2): see Router.
# ============================================================================================================
class AuxLossScaler(torch.autograd.Function):
    """Identity on x whose backward also feeds d(aux) = scale: the aux loss joins backward, the main loss stays
    clean (Megatron's MoEAuxLossAutoScaler; deepseek.py attaches the MTP loss with it, as MTPLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        (aux,) = ctx.saved_tensors
        return dy, torch.full_like(aux, ctx.scale), None


def topk_routing(scores, k: int, num_groups=None, group_topk=None, bias=None):
    """Top-k experts per token of scores [T, E] -> (top scores [T, k], indices [T, k]). Megatron's compute_topk and
    group_limited_topk: with group_topk, only the experts of each token's group_topk best groups (of num_groups equal
    groups; a group's score is the sum of its top k/group_topk scores) compete. `bias` [E] (aux-loss-free balancing)
    is added for the selection only: the scores returned are the unbiased ones."""
    sel = scores if bias is None else scores + bias  # [T, E]
    if group_topk:
        by_group = rearrange(sel, "t (g e) -> t g e", g=num_groups)  # [T, G, E/G]
        group_score = by_group.topk(k // group_topk, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, group_score.topk(group_topk, -1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(scores.shape[1] // num_groups, dim=1), float("-inf"))
    idx = sel.topk(k, dim=-1).indices  # [T, k]
    return scores.gather(1, idx), idx


class Router(nn.Module):
    """TopKRouter: weight [E, h] (fp32 under low-precision params), replicated over TP, DP and EP.

    Aux losses, defined per micro-batch over the T tokens the router sees in it (under SP the TP ranks' statistics
    are summed, as Megatron does, so T = s·b whatever tp is):
        switch   coeff · E · Σᵢ fᵢ·Pᵢ,   fᵢ = tokens routed to i / (T·k),  Pᵢ = mean over tokens of score i
                 (moe_router_load_balancing_type "aux_loss"; "seq_aux_loss", DeepSeek-V2's: the same loss of each
                 sequence over its S = T/b tokens, averaged over the b sequences; "none": no switch loss)
        z-loss   coeff · mean over tokens of logsumexp(logits)²
    (Megatron's fᵢ, normalised by T·k: perfectly balanced routing gives coeff; with fᵢ = tokens/T it is coeff·k.)
    The loss rule: each micro-batch's aux losses enter backward weighted by T / num_tokens, where num_tokens is the
    global batch's loss-token count that the schedules divide the main loss by (they call set_num_tokens).
    The total is the token-weighted mean of the micro-batches' aux losses (1/(M·dp) each, for equal micro-batches)
    in every layout; the single process running the same micro-batches gets the same gradients. Unset: weight 1.
    As in Megatron, the switch loss sees the plain top-k of the scores (no groups, no expert bias).
    Expert bias (moe_router_enable_expert_bias): a buffer [E], saved in checkpoints, updated by `after_step` from the
    step's tokens per expert summed over DP x CP (each rank's counts are whole micro-batches: under SP they are summed
    over TP already; PP stages hold different layers), so it is the same on every rank and in every layout.
    """

    def __init__(self, c, grid=None):
        super().__init__()
        self.c, self.E, self.k = c, c.num_experts, c.moe_router_topk
        self.tp = tp_of(grid) if c.sequence_parallel else None  # SP: this rank routes s/tp of the tokens
        self.dp = grid.dp_cp if grid is not None else None  # the expert bias's token counts are summed over it
        dtype = torch.promote_types(c.params_dtype, torch.float32)
        self.weight = mark(nn.Parameter(torch.empty(self.E, c.hidden_size, dtype=dtype)), ("normal", c.init_method_std),
                           sequence_parallel=c.sequence_parallel)
        self.bias = mark(nn.Parameter(torch.empty(self.E, dtype=dtype)), ("zeros",),
                         sequence_parallel=c.sequence_parallel) if c.add_bias_linear else None
        self.num_tokens, self.stats = None, {}
        if c.moe_router_enable_expert_bias:  # Megatron's buffer name; float32 at least, as Megatron keeps it
            self.register_buffer("expert_bias", torch.zeros(self.E, dtype=dtype))
        else:
            self.expert_bias = None
        self.step_tokens = self.weight.new_zeros(self.E)  # [E] tokens per expert in this step's training forwards

    def set_num_tokens(self, num_tokens):  # the schedules' loss-token protocol (section 7): a step begins
        self.num_tokens = num_tokens
        self.step_tokens = self.weight.new_zeros(self.E)  # (on the weight's device)

    @torch.no_grad()
    def after_step(self):  # the optimizers' post-step hook (section 7's after_step): aux-loss-free load balancing
        if self.expert_bias is not None:
            load = all_reduce(self.step_tokens, self.dp)  # [E] the global batch's tokens per expert
            self.expert_bias += self.c.moe_router_bias_update_rate * torch.sign(load.mean() - load)
        self.step_tokens = self.weight.new_zeros(self.E)

    def forward(self, x, b: int = 1):  # x [T, h] (rows (s b): b sequences) -> probs [T, E], routing_map [T, E] bool
        c, E, k = self.c, self.E, self.k
        n = self.tp.size if self.tp is not None else 1
        logits = F.linear(x.to(self.weight.dtype), self.weight, self.bias)  # [T, E]
        T = logits.shape[0] * n  # the micro-batch's tokens
        weight = T / self.num_tokens if self.num_tokens else 1.0
        grad = self.training and torch.is_grad_enabled()
        if c.moe_z_loss_coeff and grad:
            z = torch.logsumexp(logits, -1).square().sum() * c.moe_z_loss_coeff / T  # this rank's part of the mean
            logits = AuxLossScaler.apply(logits, z, weight)
        groups = dict(num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk)
        if c.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, -1)  # [T, E]
            if c.moe_router_pre_softmax:
                top, idx = topk_routing(scores, k, **groups)
            else:
                top, idx = topk_routing(logits, k, **groups)
                top = torch.softmax(top, -1)
        else:  # sigmoid (DeepSeek-V3): top-k of sigmoid scores (+ expert bias for the choice), renormalised if k > 1
            s = torch.sigmoid(logits)
            top, idx = topk_routing(s, k, **groups, bias=self.expert_bias)
            top = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
            scores = s / (s.sum(-1, keepdim=True) + 1e-20)
        if c.moe_router_topk_scaling_factor:
            top = top * c.moe_router_topk_scaling_factor
        probs = torch.zeros_like(logits).scatter(1, idx, top)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        aux_map = routing_map  # the switch loss's routing: plain top-k of the scores (Megatron's aux-loss scores)
        if c.moe_router_group_topk or self.expert_bias is not None:
            aux_map = torch.zeros_like(routing_map).scatter(1, scores.topk(k, dim=-1).indices, True)
        stats = all_reduce(torch.cat([routing_map.sum(0).to(logits.dtype), aux_map.sum(0).to(logits.dtype),
                                       scores.detach().sum(0),
                                       torch.logsumexp(logits.detach(), -1).square().sum()[None]]), self.tp)
        counts, aux_counts = stats[:E], stats[E:2 * E]  # tokens per expert over the micro-batch (all TP ranks)
        self.stats = dict(tokens_per_expert=counts, z_loss=stats[-1] / T,  # both losses without their coefficients,
                          load_balancing_loss=E / (k * T * T) * (stats[2 * E:3 * E] * aux_counts).sum())  # as Megatron
        balance = c.moe_router_load_balancing_type
        if c.moe_aux_loss_coeff and grad and balance == "aux_loss":
            aux = (scores.sum(0) * aux_counts).sum() * (E * c.moe_aux_loss_coeff / (k * T * T))  # this rank's part
            probs = AuxLossScaler.apply(probs, aux, weight)
        elif c.moe_aux_loss_coeff and grad and balance == "seq_aux_loss":  # per sequence (Megatron's reshape of the
            S = T // b  # tokens to [s, b·E]: each (sequence, expert) pair one column), then the mean over b
            seq_counts = all_reduce(aux_map.view(-1, b, E).sum(0).to(logits.dtype), self.tp)  # [b, E] whole over TP
            aux = (scores.view(-1, b, E).sum(0) * seq_counts).sum() * (E * c.moe_aux_loss_coeff / (k * S * S)) / b
            probs = AuxLossScaler.apply(probs, aux, weight)
        return probs, routing_map


# ============================================================================================================
# 10b. Mixture of Experts: experts, dispatchers, the layer — mirrors megatron/core/transformer/moe/:
#     token_dispatcher.py (all-gather and all-to-all dispatchers), experts.py (TEGroupedMLP's names, a grouped GEMM),
#     moe_utils.py (capacity), shared_experts.py, moe_layer.py.
#
#  T = s·b tokens of a micro-batch (s/tp·b per rank under SP), E experts (E/ep on each EP rank), k per token.
#    dispatch, ep = 2: rank 0 holds experts {0, 1}, rank 1 holds {2, 3}; xᵣ = rank r's tokens [T, h]
#      all-gather:  [x₀; x₁] on both ─> rank 0: experts 0,1 on their tokens ─> y⁰ [2T, h] ─┐ reduce-scatter:
#                                  └─> rank 1: experts 2,3 on their tokens ─> y¹ [2T, h] ─┘ rank r gets y⁰ᵣ + y¹ᵣ
#      all-to-all:  rank r sorts its routed tokens by expert [e0|e1|e2|e3] and sends [e0|e1] to rank 0, [e2|e3] to
#                   rank 1; rank 0 holds [x₀→e0|x₀→e1|x₁→e0|x₁→e1], regroups them by expert, runs the experts, and
#                   the reverse all-to-all brings each output home, where it is weighted by its prob and summed.
#    experts  one grouped GEMM over the local experts' token blocks (torch._grouped_mm; a padded bmm in float64).
#    TP       etp = tp: experts are sharded like the dense MLP — tokens and probs all-gathered over TP under SP
#             (copied without), fc2's partial sums reduce-scattered (all-reduced); etp = 1: each rank keeps its own
#             tokens and whole experts (their grads are then SP-partial: summed over TP like LayerNorm's).
# ============================================================================================================
def grouped_mm(x, w, counts):
    """x [N, a] in consecutive row groups of sizes counts [G]; group g times w[g] [a, b] -> [N, b]: one GEMM call.
    torch._grouped_mm where it runs (fp32/bf16, rows of 16-byte multiples), else one padded batched matmul."""
    es = x.element_size()
    if x.dtype in (torch.float32, torch.bfloat16) and (x.shape[1] * es) % 16 == 0 and (w.shape[2] * es) % 16 == 0:
        return torch._grouped_mm(x.contiguous(), w, offs=counts.cumsum(0).to(torch.int32))
    N, G = x.shape[0], w.shape[0]
    grp = torch.repeat_interleave(torch.arange(G, device=x.device), counts)  # [N] group of each row
    pos = torch.arange(N, device=x.device) - (counts.cumsum(0) - counts)[grp]  # row within its group
    buf = x.new_zeros(G, int(counts.max()) if N else 0, x.shape[1]).index_put((grp, pos), x)  # [G, C, a]
    return torch.bmm(buf, w)[grp, pos]


class GroupedMLP(nn.Module):
    """The E/ep local experts, each h -> f -> h without biases (Megatron's GroupedMLP), under TEGroupedMLP's names:
    experts.linear_fc1.weight{i} [f(·2 if gated)/etp, h] and experts.linear_fc2.weight{i} [h, f/etp], i the LOCAL
    index. `expert_global_name` maps it to the global ep_rank·E/ep + i, so init, checkpoints and tests see global
    experts. Every expert weight is `expert_parallel` (its grad is summed over expert_dp, not dp)."""

    def __init__(self, c, grid, activation, num_local: int):
        super().__init__()
        self.gated, self.act, self.tp = c.gated_linear_unit, activation, tp_of(grid)
        n = grid.etp_size if grid is not None else 1
        f, h = c.moe_ffn_hidden_size, c.hidden_size
        if f % n:
            raise ValueError(f"moe_ffn_hidden_size={f} is not divisible by expert tensor-parallel size {n}")
        sp = c.sequence_parallel and n == 1 and self.tp is not None  # whole experts on s/tp tokens: partial grads
        self.linear_fc1, self.linear_fc2 = nn.Module(), nn.Module()
        for i in range(num_local):
            w1 = mark(nn.Parameter(torch.empty(f * (1 + self.gated) // n, h, dtype=c.params_dtype)),
                      ("normal", c.init_method_std), 0 if n > 1 else -1, 1 + self.gated, sequence_parallel=sp)
            w2 = mark(nn.Parameter(torch.empty(h, f // n, dtype=c.params_dtype)), ("normal", c.output_std),
                      1 if n > 1 else -1, sequence_parallel=sp)
            w1.expert_parallel = w2.expert_parallel = True
            self.linear_fc1.register_parameter(f"weight{i}", w1)
            self.linear_fc2.register_parameter(f"weight{i}", w2)

    def activation(self, y):
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            return self.act(gate) * up
        return self.act(y)

    def forward(self, x, counts):  # x [N, h], rows grouped by local expert, counts [E/ep] -> [N, h]
        w1 = torch.stack(list(self.linear_fc1.parameters())).transpose(1, 2).to(x.dtype)  # [E/ep, h, f']
        w2 = torch.stack(list(self.linear_fc2.parameters())).transpose(1, 2).to(x.dtype)  # [E/ep, f/etp, h]
        return grouped_mm(self.activation(grouped_mm(x, w1, counts)), w2, counts)

    def expert(self, i: int, x):  # the dense reference: local expert i on every row of x
        w1, w2 = getattr(self.linear_fc1, f"weight{i}"), getattr(self.linear_fc2, f"weight{i}")
        return F.linear(self.activation(F.linear(x, w1)), w2)


def _a2a(x, g: Group, out_splits, in_splits):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    _log("all_to_all", g, x)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=g.pg)
    return out


class _AllToAll(torch.autograd.Function):  # rows to ranks by split sizes; backward sends the grads back
    @staticmethod
    def forward(ctx, x, g, out_splits, in_splits):
        ctx.g, ctx.splits = g, (in_splits, out_splits)
        return _a2a(x, g, out_splits, in_splits)

    @staticmethod
    def backward(ctx, dy):
        return _a2a(dy, ctx.g, *ctx.splits), None, None, None


class MoELayer(nn.Module):
    """Router -> capacity (optional) -> dispatcher -> grouped experts -> combine, + shared expert. [s(/tp), b, h]."""

    def __init__(self, c, grid=None, activation=F.gelu, shared_expert: nn.Module | None = None):
        super().__init__()
        E, ep = c.num_experts, (grid.ep_size if grid is not None else 1)
        # moe_router_topk, the dispatcher type and E % ep are the Config's checks (Model calls check_layout(tp, pp, ep))
        self.c, self.E, self.local = c, E, E // ep
        self.first = grid.ep.rank * self.local if grid is not None else 0  # global index of local expert 0
        self.ep = grid.ep if ep > 1 else None
        self.sp = tp_of(grid) if c.sequence_parallel else None
        self.etp = tp_of(grid) if grid is not None and grid.etp_size > 1 else None
        self.router = Router(c, grid)
        self.experts = GroupedMLP(c, grid, activation, self.local)
        self.shared_experts = shared_expert
        self.tokens_per_expert = torch.zeros(E)  # summed over training forwards until read (moe_load)

    def forward(self, hidden, dense: bool = False):  # [s(/tp), b, h]
        x = rearrange(hidden, "s b h -> (s b) h")  # [T, h]
        probs, rmap = self.router(x, hidden.shape[1])  # [T, E]
        counts = self.router.stats["tokens_per_expert"]
        if self.c.moe_expert_capacity_factor is not None:
            probs, rmap, counts = self._drop(probs, rmap)
        if self.training:
            self.tokens_per_expert = self.tokens_per_expert + counts.detach().cpu().float()
            self.router.step_tokens = self.router.step_tokens.to(counts.device) + counts.detach()  # (expert bias)
        if dense:
            y = self.reference(x, probs)
        else:
            if self.etp is not None:  # the TP group's experts see all its tokens
                x, probs = (gather_from_sp(t, self.etp) if self.sp else copy_to_tp(t, self.etp) for t in (x, probs))
                rmap = _gather(rmap.to(torch.uint8), self.etp, 0).bool() if self.sp else rmap
            dispatch = self._allgather if self.c.moe_token_dispatcher_type == "allgather" else self._alltoall
            y = dispatch(x, probs, rmap)
            if self.etp is not None:  # fc2 partial sums
                y = reduce_scatter_to_sp(y, self.etp) if self.sp else reduce_from_tp(y, self.etp)
        y = rearrange(y.to(hidden.dtype), "(s b) h -> s b h", b=hidden.shape[1])
        return y + self.shared_experts(hidden) if self.shared_experts is not None else y

    def _drop(self, probs, rmap):
        """Capacity (GShard): expert e keeps C = ceil(T·k/E·factor) of the micro-batch's T tokens: its C most probable
        (moe_token_drop_policy "probs"), or its first C routed ones in (s b) order ("position": the tokens at the end
        are dropped; padding adds the first tokens not routed to it). Under SP the mask is computed on the
        TP-gathered probs, so dropping does not depend on tp."""
        c = self.c
        full_p, full_m = _gather(probs.detach(), self.sp, 0), _gather(rmap.to(torch.uint8), self.sp, 0).bool()
        T = full_p.shape[0]
        C = min(T, math.ceil(T * c.moe_router_topk / self.E * c.moe_expert_capacity_factor))
        if c.moe_token_drop_policy == "position":  # rank: routed tokens first, each group by position
            rank = (~full_m).long() * T + torch.arange(T, device=full_m.device)[:, None]  # [T, E]
            chosen = rank.topk(C, dim=0, largest=False).indices
        else:
            chosen = full_p.topk(C, dim=0).indices
        keep = torch.zeros_like(full_m).scatter(0, chosen, True)  # [T, E]
        keep = keep if c.moe_pad_expert_input_to_capacity else keep & full_m  # padding: C tokens per expert
        mine = _split(keep, self.sp, 0)
        return probs * mine, mine, keep.sum(0)

    def _experts_on(self, x, probs, rmap):  # the local experts on their routed rows of x; [rows, h] out
        sl = slice(self.first, self.first + self.local)
        exp, tok = rmap[:, sl].t().nonzero(as_tuple=True)  # routed (expert, token) pairs, grouped by expert
        ys = self.experts(x[tok], rmap[:, sl].sum(0)) * probs[:, sl][tok, exp, None]
        return torch.zeros((x.shape[0], ys.shape[1]), dtype=ys.dtype, device=x.device).index_add(0, tok, ys)

    def _allgather(self, x, probs, rmap):  # [T, h], [T, E], [T, E] -> [T, h]
        x, probs = gather_from_sp(x, self.ep), gather_from_sp(probs, self.ep)  # [ep·T, ...]; backward reduce-scatter
        rmap = _gather(rmap.to(torch.uint8), self.ep, 0).bool()
        return reduce_scatter_to_sp(self._experts_on(x, probs, rmap), self.ep)

    def _alltoall(self, x, probs, rmap):  # [T, h], [T, E], [T, E] -> [T, h]
        if self.ep is None:
            return self._experts_on(x, probs, rmap)
        g, L = self.ep, self.local
        exp, tok = rmap.t().nonzero(as_tuple=True)  # permute: routed (expert, token) pairs sorted by expert
        send = rmap.sum(0).view(g.size, L)  # [ep, E/ep] rows for each rank's experts
        recv = torch.empty_like(send)  # [ep, E/ep] rows from each rank for my experts
        _log("all_to_all", g, send)
        dist.all_to_all_single(recv, send.contiguous(), group=g.pg)
        s_splits, r_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        xs = _AllToAll.apply(x[tok], g, r_splits, s_splits)  # [rows, h] as (source rank, expert) blocks
        block = torch.arange(L).repeat(g.size) * g.size + torch.arange(g.size).repeat_interleave(L)  # e·ep + src
        order = torch.repeat_interleave(block.to(x.device), recv.flatten()).argsort(stable=True)  # -> expert-major
        ys = self.experts(xs[order], recv.sum(0))[order.argsort()]
        ys = _AllToAll.apply(ys, g, s_splits, r_splits) * probs[tok, exp, None]  # home again: unpermute
        return torch.zeros((x.shape[0], ys.shape[1]), dtype=ys.dtype, device=x.device).index_add(0, tok, ys)

    def reference(self, x, probs):
        """The dense oracle: every expert on every token, weighted by the routing probs (one process only)."""
        if self.ep is not None or self.etp is not None:
            raise ValueError("MoELayer.reference needs all experts whole on one rank (ep = etp = 1)")
        return sum(probs[:, e, None] * self.experts.expert(e, x) for e in range(self.E))


def moe_load(model, reset: bool = True) -> torch.Tensor | None:
    """Tokens per expert [MoE layers, E] routed in training forwards since the last call (this rank's
    micro-batches, whole over TP), or None for a model without MoE layers."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        return None
    out = torch.stack([m.tokens_per_expert for m in layers])
    if reset:
        for m in layers:
            m.tokens_per_expert = torch.zeros(m.E)
    return out


def moe_metrics(model, load) -> dict:
    """MoE logging: tokens per expert over the log window [MoE layers][E] (all DP ranks), the worst layer's
    max/min expert load, and the layers' mean aux losses (last micro-batch, without their coefficients)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    mean = lambda k: sum(float(r.stats[k]) for r in routers) / len(routers)
    return dict(moe_tokens_per_expert=load.long().tolist(),
                moe_load_max_over_min=float((load.max(1).values / load.min(1).values.clamp_min(1)).max()),
                load_balancing_loss=mean("load_balancing_loss"), z_loss=mean("z_loss"))


# ============================================================================================================
# 11. FP8 — mirrors megatron/core/fp8_utils.py and Transformer Engine's transformer_engine/pytorch/fp8.py
#     (DelayedScaling, Float8CurrentScaling; FP8GlobalStateManager's amax reduction) and te.pytorch.Linear.
#     Paper: Micikevicius et al. 2022, "FP8 Formats for Deep Learning".
#
#  Formats: e4m3 (3 mantissa bits, max 448: values) and e5m2 (2 mantissa bits, max 57344: range, for gradients).
#     "e4m3"  : inputs, weights and output gradients all e4m3      "hybrid": e4m3 forward, e5m2 gradients
#  A tensor t is sent to FP8 as  q = fp8(t · scale)  and the GEMM undoes the scales:  Y = (1/sx · 1/sw) · Xq·Wqᵀ.
#  `torch._scaled_mm(a, b, scale_a, scale_b)` takes the DEQUANTIZATION scales (1/scale) and computes
#  scale_a·scale_b·(a @ b) with the products accumulated in fp32 — the real FP8 GEMM on Hopper. On CPU the same
#  product is the fp32 GEMM of the FP8 values (FP8 × FP8 products are exact in fp32), scaled after (_scaled_mm).
#
#     forward   Y  [M, n] = Xq [M, k] · Wqᵀ [k, n]       Xq, Wq e4m3
#     backward  dX [M, k] = dYq [M, n] · Wq  [n, k]      dYq e4m3 or e5m2 (hybrid)
#               dW [n, k] = dYqᵀ [n, M] · Xq [M, k]      (master weights and their grads stay fp32 / bf16)
#  Scale recipes (scale = (fp8_max / amax) / 2^margin; amax = max |t|):
#     tensorwise ("current") : amax of the tensor being cast, now.
#     delayed                : the scale computed after the previous step from a history of the last L amaxes
#                              (max over the history, or the most recent one); this step's amax is recorded
#                              into history[0]. Cheap (no reduction on the critical path), but one step late.
#  Every scale's amax is reduced (MAX) over the TP and DP groups, so every rank casts with the scale the single
#  process would use on the full tensor: a weight shard's amax becomes the full weight's, an input shard's the
#  full input's. Given equal scales the casts are bit-equal, so FP8 under TP/SP/DP equals FP8 on one process.
#  The output layer (logits) stays in high precision, as in Megatron + TE.
# ============================================================================================================
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class FP8Recipe:
    """Megatron's --fp8-format / --fp8-recipe / --fp8-margin / --fp8-amax-history-len / --fp8-amax-compute-algo."""

    def __init__(self, format: str = "hybrid", recipe: str = "delayed", margin: int = 0,
                 amax_history_len: int = 1024, amax_compute_algo: str = "max"):
        for name, v, ok in [("format", format, ("e4m3", "hybrid")), ("recipe", recipe, ("delayed", "tensorwise")),
                            ("amax_compute_algo", amax_compute_algo, ("max", "most_recent"))]:
            if v not in ok:
                raise ValueError(f"FP8Recipe: {name}={v!r} must be one of {ok}")
        if amax_history_len < 1:
            raise ValueError(f"FP8Recipe: amax_history_len={amax_history_len} must be >= 1")
        self.format, self.recipe, self.margin = format, recipe, margin
        self.amax_history_len, self.amax_compute_algo = amax_history_len, amax_compute_algo

    def dtype(self, role: str) -> torch.dtype:  # role: "input" | "weight" | "grad_output"
        return FP8_DTYPES["e5m2" if self.format == "hybrid" and role == "grad_output" else "e4m3"]


class FP8TensorMeta:
    """One tensor slot's scaling state (TE's FP8TensorMeta for one index): amax history [L] and scale."""

    def __init__(self, recipe: FP8Recipe, role: str, groups: tuple):
        self.recipe, self.dtype, self.groups = recipe, recipe.dtype(role), groups
        self.fp8_max = torch.finfo(self.dtype).max
        self.amax_history = torch.zeros(recipe.amax_history_len)  # [L]; [0] = this step's (local until update)
        self.scale = torch.ones(())

    def compute_scale(self, amax: torch.Tensor) -> torch.Tensor:  # TE's _default_sf_compute
        sf = (self.fp8_max / amax) / 2.0 ** self.recipe.margin
        return torch.where((amax > 0) & torch.isfinite(amax), sf, self.scale)  # keep the old scale on 0 / inf

    def quantize(self, t: torch.Tensor, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """t (any shape) -> (fp8 tensor, the float32 scale it was cast with)."""
        if self.scale.device != t.device:  # state lives where the tensors do (NCCL reduces CUDA tensors)
            self.amax_history, self.scale = self.amax_history.to(t.device), self.scale.to(t.device)
        amax = torch.linalg.vector_norm(t.detach(), float("inf")).float()  # max |t| (nan, inf kept): one pass, no copy
        if self.recipe.recipe == "tensorwise":
            scale = self.scale = self.compute_scale(_reduce_max(amax, self.groups))  # kept: the last one used
        else:
            scale = self.scale
            if record:  # eval forwards (no grad) leave the history alone
                self.amax_history[0] = torch.maximum(self.amax_history[0], amax)  # max over micro-batches
        q = (t.float() * scale).clamp_(-self.fp8_max, self.fp8_max).to(self.dtype)  # clamp_: on the product, in place
        return q, scale


def _reduce_max(t: torch.Tensor, groups: tuple) -> torch.Tensor:
    for g in groups:  # TP, then DP(×CP): the max over the whole TP × DP plane
        if g is not None and g.size > 1:
            t = t.clone()
            _log("all_reduce", g, t)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.pg)
    return t


def _scaled_mm(a, b, sa, sb, out_dtype):  # a [M, k] row-major · b [k, n] column-major -> [M, n]
    """The FP8 GEMM (1/sa · 1/sb) · (a @ b), products accumulated in fp32, cast to out_dtype (no bias: the caller
    adds it). CUDA: torch._scaled_mm with the layouts it needs, a row-major and b column-major (also what cuBLASLt
    wants). CPU: the fp32 GEMM of the FP8 values, then the scales. The product of two FP8 numbers is exact in
    fp32 (at most 4 + 4 significant bits, exponents well inside fp32's range), so this is the FP8 GEMM itself;
    the only difference from an FP8 tensor core (or from CPU torch._scaled_mm) is the order of the fp32 sums.
    It is also what cuBLASLt computes: the fp32 accumulator times scale_a·scale_b, then the cast to out_dtype.
    Why not CPU torch._scaled_mm (torch 2.13): on a CPU with AMX it runs oneDNN's FP8 kernel, measured 2,300-3,000x
    slower than the fp32 GEMM on a Xeon; without AMX it scales both operands in fp32 and calls matmul (fast, equal
    to this up to fp32 rounding). This path is one and the same on every CPU (bench/bench_fp8.py: the step time).
    A float64 output (which cuBLASLt, and CPU torch before 2.13, refuse) is the fp32 result cast up: the same
    numbers on every backend."""
    if not a.is_cuda:  # a, b: float8, or (backward's dY) its values already cast to fp32
        acc = a.float() @ b.float()  # [M, n] fp32: the exact FP8 x FP8 products, summed in fp32
        return acc.mul_((1.0 / sa).float() * (1.0 / sb).float()).to(out_dtype)
    if any(d % 16 for d in (*a.shape, b.shape[1])):
        raise ValueError(f"FP8 GEMM on CUDA needs every dimension a multiple of 16: got [{a.shape[0]}, "
                         f"{a.shape[1]}] x [{b.shape[0]}, {b.shape[1]}] (pad the batch x sequence or the hidden size)")
    dev, out = a.device, torch.float32 if out_dtype == torch.float64 else out_dtype
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=(1.0 / sa).to(dev),
                            scale_b=(1.0 / sb).to(dev), out_dtype=out).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, meta, record: bool):  # x [M, k], w [n, k] -> [M, n]; record: add to the amax history
        xq, sx = meta.input.quantize(x, record)
        wq, sw = meta.weight.quantize(w, record)
        ctx.save_for_backward(xq, wq, sx, sw)  # the FP8 copies are what backward needs (¼ of fp32's memory)
        ctx.meta, ctx.x_dtype, ctx.w_dtype = meta, x.dtype, w.dtype
        return _scaled_mm(xq, wq.t(), sx, sw, x.dtype)

    @staticmethod
    def backward(ctx, dy):  # dy [M, n]
        xq, wq, sx, sw = ctx.saved_tensors
        gq, sg = ctx.meta.grad_output.quantize(dy)
        gq = gq if gq.is_cuda else gq.float()  # CPU: the FP8 values as fp32 once, for both GEMMs (see _scaled_mm)
        dx = _scaled_mm(gq, wq, sg, sw, ctx.x_dtype) if ctx.needs_input_grad[0] else None  # [M, k]
        dw = _scaled_mm(gq.t(), xq, sg, sx, ctx.w_dtype) if ctx.needs_input_grad[1] else None  # [n, k]
        return dx, dw, None, None


class FP8LinearMeta:
    """The three scaled tensors of one linear layer: its input, its weight and its output gradient."""

    def __init__(self, recipe: FP8Recipe, groups: tuple):
        self.input, self.weight, self.grad_output = (FP8TensorMeta(recipe, r, groups)
                                                     for r in ("input", "weight", "grad_output"))

    def tensors(self):
        return [self.input, self.weight, self.grad_output]

    def __call__(self, x, w, bias):  # the layer's linear_impl: x [..., k], w [n, k] -> [..., n]
        record = torch.is_grad_enabled()  # training forwards record amaxes, eval forwards do not. Asked here, not in
        # the autograd Function's forward, which always runs without grad (the delayed recipe would never see one)
        y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), w, self, record).view(*x.shape[:-1], w.shape[0])
        return y + bias if bias is not None else y


class FP8State:
    """Every FP8 linear of a model (or pipeline chunk); `update()` after each optimizer step runs the delayed
    recipe: one all-reduce MAX of all this step's amaxes over TP and DP (TE's reduce_and_update_fp8_tensors),
    then per tensor amax = max(history) or history[0], scale = (fp8_max / amax) / 2^margin, history rolls."""

    def __init__(self, recipe: FP8Recipe, metas: list):
        self.recipe, self.metas = recipe, metas

    def tensors(self) -> list[FP8TensorMeta]:
        return [t for m in self.metas if isinstance(m, FP8LinearMeta) for t in m.tensors()]

    def update(self):
        ts = self.tensors()
        if self.recipe.recipe != "delayed" or not ts:
            return
        current = _reduce_max(torch.stack([t.amax_history[0] for t in ts]), ts[0].groups)  # one collective
        for t, a in zip(ts, current):
            t.amax_history[0] = a
            amax = t.amax_history.max() if self.recipe.amax_compute_algo == "max" else t.amax_history[0]
            t.scale = t.compute_scale(amax)
            t.amax_history = torch.roll(t.amax_history, 1)  # history[i] = the amax of i + 1 steps ago (TE rolls by −1:
            # the same window in another order) ...
            t.amax_history[0] = 0.0  # ... and [0] collects the next step's

    def discard(self):
        """A skipped step's amaxes (they may be inf or nan) are dropped: the scales stay what they were."""
        for t in self.tensors():
            t.amax_history[0] = 0.0


def fp8_enable(model: nn.Module, recipe: FP8Recipe, grid: Grid | None = None, impl: str = "local") -> FP8State:
    """Route every Column/RowParallelLinear of `model` (except the output layer) through the FP8 GEMM: its
    `linear_impl` hook (section 4) becomes the layer's FP8LinearMeta, which casts and calls _FP8Linear.
    impl "transformer_engine": a _TELinear instead, TE's Linear under TE's autocast (needs CUDA and transformer_engine).
    Not FP8: the routed MoE experts (GroupedMLP's grouped GEMM; TE would use its GroupedLinear) and the router."""
    if impl not in ("local", "transformer_engine"):
        raise ValueError(f"fp8_enable: impl={impl!r} must be 'local' or 'transformer_engine'")
    if impl == "transformer_engine":
        import importlib.util
        if not (torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")):
            raise RuntimeError("--transformer-impl transformer_engine needs a CUDA GPU and the transformer_engine "
                               f"package (cuda available: {torch.cuda.is_available()}, transformer_engine installed: "
                               f"{importlib.util.find_spec('transformer_engine') is not None}); use --transformer-impl "
                               "local for the plain-PyTorch FP8 path")
    groups = (grid.tp, grid.dp_cp) if grid is not None else ()
    metas = []
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None \
                and not name.endswith("output_layer"):
            m.linear_impl = FP8LinearMeta(recipe, groups) if impl == "local" else _TELinear(m, recipe, grid)
            metas.append(m.linear_impl)
    return FP8State(recipe, metas)


class _TELinear:
    """te.pytorch.Linear (no TE parallelism: our mappings communicate) on our weight shard, under TE's autocast.
    Each call is its own autocast region, so TE's delayed recipe reduces amaxes over the group and updates its
    scales when the call's region ends (per forward, as Megatron's per-micro-batch region does), not in
    FP8State.update. API as in TE 2.20 (`autocast(recipe=, amax_reduction_group=)`; `fp8_autocast` before 2.8)."""

    def __init__(self, layer: nn.Module, recipe: FP8Recipe, grid: Grid | None):
        import transformer_engine.common.recipe as te_recipe
        import transformer_engine.pytorch as te
        w = layer.weight
        if grid is not None and grid.pp_size > 1:
            raise NotImplementedError("TE FP8 backend: the amax reduction group assumes pp = 1")
        if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"TE FP8 backend: params_dtype {w.dtype} (Transformer Engine takes float32, bfloat16 or "
                             "float16 weights; float64 runs with --transformer-impl local)")
        group = dist.group.WORLD if dist.is_initialized() else None  # pp = 1: the world is TP x DP
        fmt = te_recipe.Format.HYBRID if recipe.format == "hybrid" else te_recipe.Format.E4M3
        te_rec = (te_recipe.DelayedScaling(fp8_format=fmt, margin=recipe.margin,
                                           amax_history_len=recipe.amax_history_len,
                                           amax_compute_algo=recipe.amax_compute_algo)
                  if recipe.recipe == "delayed" else te_recipe.Float8CurrentScaling(fp8_format=fmt))
        self.autocast = (lambda: te.autocast(enabled=True, recipe=te_rec, amax_reduction_group=group)) \
            if hasattr(te, "autocast") else (lambda: te.fp8_autocast(enabled=True, fp8_recipe=te_rec, fp8_group=group))
        lin = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=w.dtype, device=w.device)
        lin.weight = w  # TE computes with our master weight (same Parameter: the optimizer, checkpoints see it)
        self.lin = lin  # a plain attribute, not a submodule: the weight must not appear twice in the model

    def __call__(self, x, w, bias):  # the layer's linear_impl: x [..., k] -> [..., n]
        with self.autocast():
            y = self.lin(x)
        return y + bias if bias is not None else y


# ============================================================================================================
# 12. Context parallelism — mirrors megatron/core/utils.py (get_batch_on_this_cp_rank) and the context-parallel
#     attention Megatron takes from Transformer Engine (transformer_engine/pytorch/attention: AttnFuncWithCPAndKVP2P,
#     AttnFuncWithCPAndKVAllGather, AttnFuncWithCPAndQKVOA2A, chosen by Megatron's --cp-comm-type).
#     Papers: Liu et al. 2023, "Ring Attention with Blockwise Transformers" (arXiv:2310.01889); Jacobs et al. 2023,
#     "DeepSpeed Ulysses" (arXiv:2309.14509); Dao et al. 2022, "FlashAttention" (online softmax and its backward).
#
#  The sequence is cut into 2·cp chunks and rank r holds chunks r and 2cp−1−r, so that under a causal mask every
#  rank has the same work (an early chunk sees few keys, its partner many):
#      cp = 2, s = 8:   rank 0 holds positions [0 1 | 6 7]    rank 1 holds [2 3 | 4 5]
#  Only attention mixes positions: embeddings, MLP, norms and the loss run on the rank's s/cp tokens as they are.
#  Parameters are replicated over cp as over dp, so their grads are summed over dp x cp (`dp_cp`, sections 6 and 9);
#  each rank's loss is the sum over its tokens, divided by the global count (DESIGN.md §2) — no mean over cp.
#  The ranks' positions one after the other are the "cp order" ([0 1 6 7 2 3 4 5] above): keys gathered over cp
#  arrive in it, and `get_batch_on_this_cp_rank` puts a key mask's columns in it.
#     p2p (ring)   K/V blocks go round the ring (rank r sends to r+1) while each rank attends its queries to the
#                  block it holds; partial outputs are merged by their log-sum-exp (online softmax). Backward walks
#                  the ring the other way with the K/V blocks and their gradients, dK/dV arriving home at the last
#                  hop. Bytes per rank: (cp−1)/cp of the full K/V forward; twice that backward (K/V and dK/dV).
#     all_gather   all-gather K/V (forward), the local queries attend to every key, reduce-scatter dK/dV (backward).
#     a2a          Ulysses: all-to-all q, k, v from sequence-split [b, n, s/cp, d] to head-split [b, n/cp, s, d],
#                  whole-sequence attention on n/cp heads, all-to-all the output back. Heads and groups % cp == 0.
#  `attention_oracle` is plain attention on the whole sequence: every variant must equal it.
#  Causal, the ring computes only the visible part of a block (`_visible`): its own block whole (masked), half of
#  each other rank's, unmasked — the same work on every rank, as in Megatron. Not here: attention dropout (each
#  block's mask would have to be replayed in the backward ring).
# ============================================================================================================
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def cp_positions(s: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions [s/cp] that cp rank `rank` holds: chunks rank and 2cp−1−rank of the 2·cp equal chunks."""
    chunks = torch.arange(s, device=device).view(2 * cp, s // (2 * cp))
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def cp_order(s: int, cp: int, device=None) -> torch.Tensor:
    """Every rank's positions, rank after rank [s]: the order of anything gathered over cp."""
    return torch.cat([cp_positions(s, cp, r, device) for r in range(cp)])


def cp_split(grid: Grid | None, t, dim: int = 1):
    """This cp rank's positions of a per-token tensor (ids, labels, a loss mask) along `dim`; None stays None."""
    if t is None or grid is None or grid.cp_size == 1:
        return t
    return t.index_select(dim, cp_positions(t.shape[dim], grid.cp_size, grid.cp.rank, t.device))


def get_batch_on_this_cp_rank(grid: Grid | None, input_ids, labels=None, position_ids=None, rope=None, mask=None):
    """This cp rank's share of a micro-batch — the one place the sequence is split (gpt.Model.forward and
    bert.Model.encode call it; the loss recipes cut their per-token masks with `cp_split`).
    ids, labels [b, s] -> [b, s/cp]; positions [s] or [b, s] (arange(s) if None: learned positions and RoPE angles
    follow their tokens) -> [.., s/cp]; RoPE (cos, sin) [s, 1, 1, d] -> [s/cp, 1, 1, d]; a key mask [b|1, 1, 1, s]
    (True = attend) -> its columns in cp order (the keys every variant sees). cp = 1: all returned as given."""
    if grid is None or grid.cp_size == 1:
        return input_ids, labels, position_ids, rope, mask
    s, cp, dev = input_ids.shape[1], grid.cp_size, input_ids.device
    if s % (2 * cp):
        raise ValueError(f"context parallelism needs the sequence length {s} divisible by 2 x cp = {2 * cp}")
    position_ids = torch.arange(s, device=dev) if position_ids is None else position_ids
    if mask is not None:
        if mask.dim() != 4 or mask.shape[-2] != 1 or mask.shape[-1] != s:
            raise ValueError(f"context parallelism takes a key mask [b|1, 1, 1, s={s}], not {tuple(mask.shape)}")
        mask = mask.index_select(-1, cp_order(s, cp, dev))
    rope = tuple(cp_split(grid, t, 0) for t in rope) if rope is not None else None
    return cp_split(grid, input_ids), cp_split(grid, labels), cp_split(grid, position_ids, -1), rope, mask


def _allowed(q_pos, k_pos, causal: bool, key_mask):
    """bool [b|1, 1, sq|1, sk], which key each query may see (None: every one): causal (key position <= query's)
    and the key mask [b|1, 1, 1, sk] (padding)."""
    allowed = (q_pos[:, None] >= k_pos[None, :])[None, None] if causal else None
    if key_mask is not None:
        allowed = key_mask if allowed is None else allowed & key_mask
    return allowed


def _finite(lse):  # a row that sees no key has lse = −inf; subtracting 0 instead keeps its probabilities 0, not NaN
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _attend(q, k, v, allowed, scale: float):
    """Softmax attention of q [b, n, sq, d] over k, v [b, g, sk, d] where `allowed`; query group i serves heads
    i·n/g ... (i+1)·n/g − 1 (GQA). Returns (o [b, n, sq, d], lse [b, n, sq]); a row with no key: o = 0, lse = −inf."""
    m = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(m, dim=1), v.repeat_interleave(m, dim=1)  # [b, n, sk, d]
    scores = torch.einsum("bnqd,bnkd->bnqk", q, k) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, n, sq]
    p = torch.exp(scores - _finite(lse)[..., None])  # [b, n, sq, sk]
    return torch.einsum("bnqk,bnkd->bnqd", p, v), lse


def attention_oracle(q, k, v, mask=None, causal: bool = True, scale: float | None = None):
    """Plain attention on the whole sequence, the reference of every variant: q [b, n, s, d], k, v [b, g, s, d],
    mask a key mask [b|1, 1, 1, s] -> [b, n, s, d]."""
    pos = torch.arange(q.shape[2], device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _attend(q, k, v, _allowed(pos, pos, causal, mask), scale)[0]


def _merge(o, lse, o_j, lse_j):
    """Online softmax: two partial outputs over disjoint key sets, each normalised over its own keys -> the output
    normalised over both: weights exp(lse_i − lse), lse = log(e^lse + e^lse_j)."""
    new = torch.logaddexp(lse, lse_j)
    w, w_j = torch.exp(lse - _finite(new))[..., None], torch.exp(lse_j - _finite(new))[..., None]
    return o * w + o_j * w_j, new


def _attend_backward(q, k, v, allowed, scale, lse, do, delta):
    """FlashAttention's backward for one key block, from the FINAL lse and delta = rowsum(dO ∘ O):
    P = exp(S − lse), dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − delta), dQ = scale·dS·K, dK = scale·dSᵀ·Q (GQA: summed per group)."""
    m = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(m, dim=1), v.repeat_interleave(m, dim=1)  # [b, n, sk, d]
    scores = torch.einsum("bnqd,bnkd->bnqk", q, ke) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.exp(scores - _finite(lse)[..., None])
    ds = p * (torch.einsum("bnqd,bnkd->bnqk", do, ve) - delta[..., None])
    dq = torch.einsum("bnqk,bnkd->bnqd", ds, ke) * scale
    per_group = lambda t: rearrange(t, "b (g m) k d -> b g m k d", m=m).sum(2)  # [b, g, sk, d]
    dk = per_group(torch.einsum("bnqk,bnqd->bnkd", ds, q) * scale)
    dv = per_group(torch.einsum("bnqk,bnqd->bnkd", p, do))
    return dq, dk, dv


def _ring_exchange(x, g: Group, to: int, frm: int, tag: int):
    """Post the send of x to ring neighbour `to` and the receive of the same shape from `frm` (asynchronous: the
    caller computes on its block meanwhile). Returns (the receive buffer, the requests to wait on)."""
    buf = torch.empty_like(x)
    _log("send", g, x)
    _log("recv", g, buf)
    reqs = [dist.isend(x.contiguous(), g.ranks[to % g.size], group=g.pg, tag=tag),
            dist.irecv(buf, g.ranks[frm % g.size], group=g.pg, tag=tag)]
    return buf, reqs


def _visible(q_pos, k_pos, causal: bool, key_mask):
    """One ring block: (rows, cols, mask) — the query rows and key columns that see anything, and the mask on that
    sub-block (None: all of it visible). Causal, load-balanced: the diagonal block is whole with its mask; a block
    of an earlier rank is its first chunk of keys for every query, of a later rank all keys for the second chunk of
    queries — half a block, unmasked (Megatron computes only that half, as here). A padding mask is per batch row:
    every row and column is kept, with the mask."""
    allowed = _allowed(q_pos, k_pos, causal, key_mask)
    rows, cols = torch.arange(len(q_pos), device=q_pos.device), torch.arange(len(k_pos), device=k_pos.device)
    if causal:
        c = q_pos[:, None] >= k_pos[None, :]  # [sq, sk]
        rows, cols = c.any(1).nonzero().squeeze(1), c.any(0).nonzero().squeeze(1)
    if allowed is not None:
        allowed = allowed.index_select(-2, rows) if allowed.shape[-2] > 1 else allowed
        allowed = allowed.index_select(-1, cols)
        allowed = None if bool(allowed.all()) else allowed
    return rows, cols, allowed


class _RingAttention(torch.autograd.Function):
    """p2p: q, k, v [b, n|g, s/cp, d] this rank's tokens -> o [b, n, s/cp, d]. Step i: rank r holds the K/V block of
    rank r−i, passes it to r+1, attends to it (its visible part), merges (online softmax). Backward: the ring in
    reverse (blocks go to r−1), starting from the block forward ended with (rank r+1's); dK/dV travel with their
    block, home after cp−1 hops. `scores` counts the score entries this rank computed (the load balance)."""
    scores = 0

    @staticmethod
    def forward(ctx, q, k, v, key_mask, causal, scale, g):
        cp, r, sl = g.size, g.rank, q.shape[2]
        q_pos = cp_positions(sl * cp, cp, r, q.device)
        kv = torch.stack([k, v])  # [2, b, g, s/cp, d]: the block that travels
        o, lse = torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"))  # nothing seen yet
        _RingAttention.scores = 0
        for i in range(cp):
            j = (r - i) % cp  # whose block this is
            if i < cp - 1:
                nxt, reqs = _ring_exchange(kv, g, r + 1, r - 1, tag=i)
            rows, cols, mask = _visible(q_pos, cp_positions(sl * cp, cp, j, q.device), causal,
                                        key_mask[..., j * sl:(j + 1) * sl] if key_mask is not None else None)
            o_j, lse_j = _attend(q.index_select(2, rows), *kv.index_select(3, cols), mask, scale)
            _RingAttention.scores += len(rows) * len(cols)
            o_j, lse_j = torch.zeros_like(o).index_copy_(2, rows, o_j), torch.full_like(lse, float("-inf")).index_copy_(
                2, rows, lse_j)  # back to all rows: the rows that saw nothing add nothing
            o, lse = _merge(o, lse, o_j, lse_j)
            if i < cp - 1:
                for req in reqs:
                    req.wait()
                kv = nxt
        ctx.save_for_backward(q, kv, o, lse, key_mask)  # kv: the last block held, rank r+1's
        ctx.causal, ctx.scale, ctx.g = causal, scale, g
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, o, lse, key_mask = ctx.saved_tensors
        g, cp, r, sl = ctx.g, ctx.g.size, ctx.g.rank, q.shape[2]
        q_pos, delta = cp_positions(sl * cp, cp, r, q.device), (do * o).sum(-1)  # delta [b, n, s/cp]
        dq, travel = torch.zeros_like(q), torch.stack([kv, torch.zeros_like(kv)])  # [K/V; dK/dV] [2, 2, b, g, s/cp, d]
        for i in range(cp):
            j = (r + 1 + i) % cp  # whose block this is; at i = cp − 1 this rank's own
            rows, cols, mask = _visible(q_pos, cp_positions(sl * cp, cp, j, q.device), ctx.causal,
                                        key_mask[..., j * sl:(j + 1) * sl] if key_mask is not None else None)
            sub = lambda t: t.index_select(2, rows)  # noqa: E731 — this block's visible query rows
            dq_j, dk, dv = _attend_backward(sub(q), *travel[0].index_select(3, cols), mask, ctx.scale, sub(lse),
                                            sub(do), sub(delta))
            dq.index_add_(2, rows, dq_j)
            travel = torch.stack([travel[0], travel[1].index_add(3, cols, torch.stack([dk, dv]))])
            if i < cp - 1:
                travel, reqs = _ring_exchange(travel, g, r - 1, r + 1, tag=cp + i)
                for req in reqs:
                    req.wait()
        return dq, travel[1, 0], travel[1, 1], None, None, None, None


def ring_attention(g: Group, q, k, v, mask, causal: bool, scale: float):
    return _RingAttention.apply(q, k, v, mask, causal, scale, g)


class _GatherSequence(torch.autograd.Function):  # all-gather along dim −2 (the sequence) over cp; reduce-scatter back
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _gather(x, g, -2)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy.movedim(-2, 0), ctx.g).movedim(0, -2), None


def all_gather_attention(g: Group, q, k, v, mask, causal: bool, scale: float):
    s = q.shape[2] * g.size
    kv = _GatherSequence.apply(torch.stack([k, v]), g)  # [2, b, g, s, d], cp order
    allowed = _allowed(cp_positions(s, g.size, g.rank, q.device), cp_order(s, g.size, q.device), causal, mask)
    return _attend(q, kv[0], kv[1], allowed, scale)[0]


def ulysses_attention(g: Group, q, k, v, mask, causal: bool, scale: float):
    cp, s = g.size, q.shape[2] * g.size
    for what, heads in (("attention heads", q.shape[1]), ("query groups", k.shape[1])):
        if heads % cp:
            raise ValueError(f"cp-comm-type a2a: {heads} {what} per TP rank are not divisible by cp={cp}")
    one = [1] * cp

    def to_heads(x):  # [b, h, s/cp, d] -> [b, h/cp, s, d]: piece c of the heads to rank c, the sequence in cp order
        x = _AllToAll.apply(rearrange(x, "b (c h) s d -> c b h s d", c=cp).contiguous(), g, one, one)
        return rearrange(x, "c b h s d -> b h (c s) d")

    def to_sequence(x):  # the inverse: [b, h/cp, s, d] -> [b, h, s/cp, d]
        x = _AllToAll.apply(rearrange(x, "b h (c s) d -> c b h s d", c=cp).contiguous(), g, one, one)
        return rearrange(x, "c b h s d -> b (c h) s d")

    order = cp_order(s, cp, q.device)
    return to_sequence(_attend(to_heads(q), to_heads(k), to_heads(v), _allowed(order, order, causal, mask), scale)[0])


def context_parallel_attention(grid: Grid, comm_type: str):
    """transformer.Attention's attention when cp > 1: attend(q, k, v, mask, causal, scale) -> o, with q [b, n, s/cp, d],
    k, v [b, g, s/cp, d] this rank's tokens (get_batch_on_this_cp_rank's) and mask None or a key mask in cp order.
    Computed in at least float32 (the log-sum-exp merge), returned in q's dtype."""
    impl = {"p2p": ring_attention, "all_gather": all_gather_attention, "a2a": ulysses_attention}[comm_type]

    def attend(q, k, v, mask, causal, scale):
        acc = torch.promote_types(q.dtype, torch.float32)
        return impl(grid.cp, q.to(acc), k.to(acc), v.to(acc), mask, causal, scale).to(q.dtype)
    return attend


# ============================================================================================================
# 13. Muon — mirrors megatron/core/optimizer/muon.py (Megatron-LM's newer releases: its tensor-parallel wrapper)
# and the papers: Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al. 2025,
# "Muon is Scalable for LLM Training" (the update's scale). train.py's --optimizer muon.
# ============================================================================================================
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # Muon's quintic: the steepest slope at zero that still converges


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's orthogonalization of an update g = U·S·Vᵀ: U·f(S/‖g‖_F)·Vᵀ with f the quintic a·s + b·s³ + c·s⁵ applied
    `steps` times (each singular value lands in ~[0.7, 1.2], not exactly 1: far cheaper than an SVD and as good).
    In g's dtype (`orthogonalized` picks it: float32 at the least, bfloat16 at --muon-fp32-matmul-prec medium)."""
    a, b, c = NS_COEFFICIENTS
    tall = g.shape[0] > g.shape[1]
    x = g.mT if tall else g  # [m, n] with m <= n: the Gram matrix x·xᵀ [m, m] is the small one
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT  # [m, m]
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def muon_eligible(p: nn.Parameter) -> bool:
    """Muon's parameters: the hidden matrices — 2-D, not the word embedding or output layer (Megatron's rule) nor
    another lookup table or classifier head (`hidden_matrix` False: Jordan et al.'s rule); AdamW keeps the rest."""
    return p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False) and \
        getattr(p, "hidden_matrix", True)


NS_PRECISION = {"high": None, "medium": torch.bfloat16}  # --muon-fp32-matmul-prec: a float32 update's iteration


def fast_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 natively (a CPU's AVX512-BF16 or AMX, a CUDA GPU's bfloat16 cores): where
    it does not, "medium" computes as "high", as torch's float32 matmul precision "medium" does."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def orthogonalized(update: torch.Tensor, p: nn.Parameter, grid: Grid | None, steps: int, scale: float,
                   precision: str = "high"):
    """scale·√max(rows, cols)·O for matrix p's `update` (this rank's TP shard): O = `newton_schulz` of the whole
    matrix — its TP shards all-gathered (`gather_full`) — then this rank's shard of it, so any layout steps as one
    process does (Megatron's "blockwise" mode, each shard alone, is another optimizer: the tests show it).
    precision "medium": a float32 update's iteration runs in bfloat16 (Jordan et al.'s; ~2.4x float32's GEMM rate
    on a CPU with AVX512-BF16) where the device has it (`fast_bfloat16`); float64 stays float64, as Megatron's fp32
    matmul precision leaves it."""
    full = gather_full(update, p, grid)  # [rows, cols], whole (the all-gather over TP)
    acc = torch.promote_types(full.dtype, torch.float32)
    if acc == torch.float32 and NS_PRECISION[precision] is not None and fast_bfloat16(full.device):
        acc = NS_PRECISION[precision]
    o = newton_schulz(full.to(acc), steps).to(update.dtype)
    if getattr(p, "tensor_model_parallel", False) and tp_of(grid) is not None:
        o = shard(o, p.partition_dim, p.partition_stride, grid.tp.rank, grid.tp.size)
    return o * (scale * max(full.shape) ** 0.5)


class Muon(Optimizer):
    """Muon for the `muon_eligible` matrices, the plain Optimizer's AdamW for the rest; the same interface.

    Each step, per matrix with gradient G: momentum buffer B = μ·B + G; the update G + μ·B (Nesterov) or B is
    `orthogonalized` whole; then p ← p·(1 − lr·wd) − lr·scale·√max(rows, cols)·O. scale 0.2 is Moonshot's rule: the
    update's RMS matches AdamW's, so --lr, its schedule and --weight-decay carry over. The checkpoint keeps AdamW's
    layout: exp_avg holds B, exp_avg_sq stays zero."""

    def __init__(self, chunks, grid: Grid | None, momentum=0.95, nesterov=True, ns_steps=5, scale=0.2,
                 precision="high", **adam):
        super().__init__(chunks, grid, **adam)
        self.momentum, self.nesterov, self.ns_steps, self.scale = momentum, nesterov, ns_steps, scale
        self.precision = precision
        self.weight_decay = self.adam.param_groups[0]["weight_decay"]  # (the decaying group's; matrices all decay)
        self.matrices = [p for p in self.params if muon_eligible(p)]
        for g in self.adam.param_groups:  # AdamW steps the rest (its state stays: the checkpoint's layout)
            g["params"] = [p for p in g["params"] if not muon_eligible(p)]

    def zero_grad(self, num_micro_batches: int = 1):
        super().zero_grad(num_micro_batches)
        for p in self.matrices:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        for p in self.matrices:
            st, g = self.adam.state[p], p.grad
            buf = st["exp_avg"].mul_(self.momentum).add_(g)
            update = g + self.momentum * buf if self.nesterov else buf
            st["step"] += 1
            p.mul_(1 - self.lr * self.weight_decay)
            p.add_(orthogonalized(update, p, self.grid, self.ns_steps, self.scale, self.precision), alpha=-self.lr)
        super().step()  # AdamW on the rest, then the modules' post-step hooks


class DistributedMuon(DistributedOptimizer):
    """Muon over DDP's flat buffers (--use-distributed-optimizer, --overlap-grad-reduce): the same arithmetic as Muon,
    element for element. The momentum is elementwise, so it lives on this rank's DP slice like Adam's moments; the
    update is not, so each bucket's update slices are all-gathered over its group, every matrix in it is
    `orthogonalized` whole, and this rank keeps its slice. Every rank of the group orthogonalizes every matrix of the
    bucket (Megatron's layer-wise distributed optimizer gives each matrix to one rank instead: less compute, more
    bookkeeping). AdamW, as DistributedOptimizer, for everything else."""

    def __init__(self, ddp: DDP, momentum=0.95, nesterov=True, ns_steps=5, scale=0.2, precision="high", **adam):
        super().__init__(ddp, **adam)
        self.momentum, self.nesterov, self.ns_steps, self.scale = momentum, nesterov, ns_steps, scale
        self.precision = precision
        self.muon_mask = ddp.per_element(muon_eligible, torch.bool)  # True on Muon's elements

    def update(self, i: int, lr: float):
        b, muon = self.ddp.buckets[i], self.muon_mask[i]
        if not any(muon_eligible(p) for p in b.params):  # (the same answer on every rank of the bucket's group)
            return super().update(i, lr)
        g, m, ea = self.ddp.buckets[i].grad_shard, self.master[i], self.exp_avg[i]
        buf = torch.where(muon, ea * self.momentum + g, ea)  # B = μ·B + G on Muon's elements
        u = torch.where(muon, g + self.momentum * buf if self.nesterov else buf, 0)
        o, before = self.orthogonalized_slice(i, u), m[muon]
        super().update(i, lr)  # AdamW on every element; Muon's are set right here:
        ea[muon], self.exp_avg_sq[i][muon] = buf[muon], 0
        m[muon] = before * (1 - lr * self.wd) - lr * o[muon]

    def orthogonalized_slice(self, i: int, u: torch.Tensor) -> torch.Tensor:
        """This rank's slice of bucket i's orthogonalized update (zero off Muon's elements), from its slice u."""
        b, s = self.ddp.buckets[i], self.slices[i]
        whole = torch.zeros(b.end - b.start, dtype=u.dtype, device=u.device)  # [bucket]: every rank's slice
        if self.ddp.distopt and b.group.size > 1:
            _log("all_gather", b.group, whole)
            all_gather_single(whole, u.contiguous(), group=b.group.pg)
        else:
            whole.copy_(u)  # (this rank's slice is the whole bucket)
        out, o = torch.zeros_like(whole), 0
        for p in b.params:
            if muon_eligible(p):
                n = p.numel()
                out[o:o + n] = orthogonalized(whole[o:o + n].view_as(p), p, self.ddp.grid, self.ns_steps,
                                              self.scale, self.precision).flatten()
            o += p.numel()
        return out[s.start - b.start:s.stop - b.start]


# ============================================================================================================
# 14. Fully sharded data parallelism — mirrors megatron/core/distributed/fsdp/ (mcore_fsdp_adapter.py) and
#     megatron/core/distributed/fsdp/src/megatron_fsdp/ (megatron_fsdp.py, param_and_grad_buffer.py): Megatron-FSDP,
#     train.py's --use-megatron-fsdp with --data-parallel-sharding-strategy. Paper: Rajbhandari et al. 2020, "ZeRO".
#
#  The parameters are grouped per unit — each transformer layer (an element of a chunk's ModuleList), and the chunk's
#  other parameters (embedding, final norm, output layer) — one flat bucket per unit and process group (dense over
#  DP x CP, MoE experts over expert_dp, the tied embedding its own), each padded to a multiple of the group's size:
#  rank d owns the 1/size slice d, steps it with DistributedOptimizer / DistributedMuon (section 9's, unchanged).
#     optim               ZeRO-1: section 9's DDP with the distributed optimizer (not this class)
#     optim_grads         ZeRO-2: each micro-batch's gradients of a bucket, once backward has made them all, are
#                         reduce-scattered (async) into the owned slice and freed: no whole gradient buffer is kept
#     optim_grads_params  ZeRO-3: also the parameters: only the owned slice persists; a layer's bucket is all-gathered
#                         just before its forward and freed after it, gathered again just before its backward and freed
#                         once its gradients are made; the next layer's all-gather is prefetched (async) meanwhile.
#                         The chunk's other parameters are gathered at its forward and kept until the step's end.
#  Where Megatron-FSDP differs: it reduce-scatters and all-gathers on CUDA streams with double-buffered bucket memory;
#  here gloo's async handles, the freed storage resized to 0 and back (torch FSDP1's trick: parameter views survive).
#  TorchFSDP2 (--use-torch-fsdp2; Megatron's torch_fully_sharded_data_parallel.py): torch's FSDP2 on the same units.
# ============================================================================================================
FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def fsdp_units(chunk: nn.Module) -> list[nn.Module]:
    """A chunk's units in forward order: the elements of its ModuleLists (not nested in another unit), then the chunk
    itself (its remaining parameters)."""
    units = []
    for name, m in chunk.named_modules():
        if isinstance(m, nn.ModuleList) and not any(u in units for u in _ancestors(chunk, name)):
            units += list(m)
    return units + [chunk]


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    out, m = [], root
    for part in name.split(".")[:-1] if name else []:
        m = getattr(m, part)
        out.append(m)
    return out


class _GatherBeforeBackward(torch.autograd.Function):  # identity on a unit's output; its backward gathers the unit
    @staticmethod
    def forward(ctx, x, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fsdp.gather(ctx.unit, prefetch=-1)  # and prefetch the unit backward reaches next
        return g, None, None


class FSDP(DDP):
    """ZeRO-2 (optim_grads) / ZeRO-3 (optim_grads_params) over the same interface as DDP (DistributedOptimizer reads
    buckets' grad_shard and param_shard, per_element, publish, owned). zero_grad, finish_grad_sync as DDP's."""

    def __init__(self, chunks, grid: Grid, strategy: str = "optim_grads_params", prefetch: bool = True):
        if strategy not in FSDP_STRATEGIES[2:]:
            raise ValueError(f"FSDP shards gradients: strategy {strategy!r} is DDP's (section 9)")
        self.chunks = chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        self.grid, self.dp, self.overlap, self.distopt, self.prefetch = grid, grid.dp_cp, True, True, prefetch
        self.zero3, self.strategy = strategy == "optim_grads_params", strategy
        expert = lambda p: getattr(p, "expert_parallel", False)
        tied = lambda p: getattr(p, "shared_embedding", False)
        self.buckets, self.bucket_of, self.offset, self.units, seen, off = [], {}, {}, [], set(), 0
        for chunk in chunks:
            units = fsdp_units(chunk)
            self.units.append(units)
            for u in units:
                u.fsdp_buckets, ps = [], [p for p in u.parameters() if p.requires_grad and id(p) not in seen]
                seen.update(id(p) for p in ps)
                for group, sel in ((grid.dp_cp, lambda p: not (tied(p) or expert(p))), (grid.expert_dp, expert),
                                   (grid.dp_cp, tied)):
                    mine = [p for p in ps if sel(p)]
                    if mine:
                        n = sum(p.numel() for p in mine)
                        b = _Bucket(mine, off, off + -(-n // group.size) * group.size, group)
                        b.unit, b.root, b.tied = u, u is chunk, any(tied(p) for p in mine)
                        self.buckets.append(b)
                        u.fsdp_buckets.append(b)
                        off = b.end
        self.numel, dtype = off, self.buckets[0].params[0].dtype
        self.grad_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        for b in self.buckets:
            size, n, o = b.end - b.start, (b.end - b.start) // b.group.size, 0
            b.full = torch.zeros(size, dtype=dtype)  # the bucket's whole parameters (ZeRO-3: only while gathered)
            for p in b.params:
                b.full[o:o + p.numel()].copy_(p.data.reshape(-1))
                p.data = b.full[o:o + p.numel()].view_as(p)
                self.bucket_of[p], self.offset[p] = b, b.start + o
                p.register_post_accumulate_grad_hook(self._hook)
                o += p.numel()
            own = b.full[b.group.rank * n:(b.group.rank + 1) * n]
            b.param_shard = own.clone() if self.zero3 else own  # what persists of the parameters
            b.grad_shard = torch.zeros(n, dtype=self.grad_dtype)  # the summed gradient of the owned slice
            b.grad, b.gathering = None, None  # a micro-batch's whole gradient while made; a pending all-gather
            if self.zero3:
                self.free(b)
        for b, mask in zip(self.buckets, self.per_element(lambda p: getattr(p, "sequence_parallel", False), torch.bool)):
            b.sp_mask = mask  # (on the owned slice)
        for units in self.units:
            for u in units[:-1]:
                u.register_forward_pre_hook(lambda m, args: self.gather(m, prefetch=1) if self.zero3 else None)
                u.register_forward_hook(self._after_forward)
            units[-1].register_forward_pre_hook(lambda m, args: self.gather(m) if self.zero3 else None)
        self.launch_log, self.gather_log = [], []
        self.zero_grad()

    # ---------------------------------------------------------------- parameters: gathered for use, freed after (ZeRO-3)
    def gather(self, unit: nn.Module, prefetch: int = 0, wait: bool = True):
        """All-gather unit's buckets (wait: until they are whole); prefetch ±1: start the neighbouring unit's.
        gather_log: (bucket, whether an earlier call had launched its all-gather) for each bucket made whole here."""
        for b in unit.fsdp_buckets:
            prefetched = b.gathering is not None
            if b.full.untyped_storage().size() == 0 and b.gathering is None:
                b.full.untyped_storage().resize_(b.full.numel() * b.full.element_size())
                if b.group.size == 1:
                    b.full.copy_(b.param_shard)
                    continue
                _log("all_gather", b.group, b.full)
                b.gathering = all_gather_single(b.full, b.param_shard, group=b.group.pg, async_op=True)
            if wait and b.gathering is not None:
                b.gathering.wait()
                b.gathering = None
                self.gather_log.append((self.buckets.index(b), prefetched))
        units = next(us for us in self.units if unit in us)
        i = units.index(unit) + prefetch
        if prefetch and self.prefetch and 0 <= i < len(units) - 1:  # (the root unit is never prefetched)
            self.gather(units[i], wait=False)

    def free(self, b: _Bucket):
        if b.gathering is not None:
            b.gathering.wait()
            b.gathering = None
        b.full.untyped_storage().resize_(0)

    def _after_forward(self, unit, args, out):
        if not self.zero3:
            return None
        for b in unit.fsdp_buckets:
            self.free(b)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            return _GatherBeforeBackward.apply(out, self, unit)
        return None

    # ---------------------------------------------------------------- gradients: reduce-scattered per micro-batch
    def zero_grad(self, num_micro_batches: int = 1):
        self.M, self.hooks_fired, self.inflight = num_micro_batches, 0, []
        for b in self.buckets:
            b.grad_shard.zero_()
            b.ready, b.launched, b.handle, b.grad, b.recv, b.sent = 0, False, None, None, None, None
            for p in b.params:
                p.grad = None
        self.launch_log.clear()
        self.gather_log.clear()

    def _hook(self, p):
        b, n = self.bucket_of[p], p.numel()
        if b.grad is None:
            b.grad = torch.zeros(b.end - b.start, dtype=self.grad_dtype)
        o = self.offset[p] - b.start
        b.grad[o:o + n].add_(p.grad.reshape(-1))
        p.grad = None
        self.hooks_fired += 1
        b.ready += 1
        if b.ready % len(b.params) == 0 and not b.tied:  # this micro-batch's grads of the bucket are all made
            self._launch(b)
            if self.zero3 and not b.root:
                self.free(b)

    def _drain(self, b: _Bucket):  # wait for the bucket's last reduce-scatter; add its result into the owned slice
        if b.handle is not None:
            b.handle.wait()
            b.grad_shard.add_(b.recv)
            b.handle = b.recv = b.sent = None
            self.inflight.remove(b)

    def _launch(self, b: _Bucket):
        self._drain(b)
        b.launched = True
        self.launch_log.append((self.buckets.index(b), self.hooks_fired))
        if b.group.size == 1:
            b.grad_shard.add_(b.grad)
        else:
            b.recv, b.sent = b.grad.new_empty(b.grad_shard.numel()), b.grad
            _log("reduce_scatter", b.group, b.grad)
            b.handle = reduce_scatter_single(b.recv, b.grad, group=b.group.pg, async_op=True)
            self.inflight.append(b)
            if len(self.inflight) > 2:  # at most two in flight: the whole gradients they read are freed as they end
                self._drain(self.inflight[0])
        b.grad = None  # ZeRO-2: the whole gradient is gone (once the reduce-scatter has read it)

    def finish_grad_sync(self):
        """Wait for every reduce-scatter (the tied embedding's: first + last stage's sums, then reduce-scattered;
        a bucket some of whose gradients backward did not make: what it has); SP norm grads summed over TP on the
        owned slices; ZeRO-3: every bucket freed."""
        emb = self.grid.embedding
        for b in self.buckets:
            if b.grad is not None:
                if b.tied and emb is not None and emb.size > 1:
                    b.grad = all_reduce(b.grad, emb)
                self._launch(b)
        for b in self.buckets:
            self._drain(b)
            if self.grid.tp.size > 1 and b.sp_mask.any():  # the same layout on every TP rank
                b.grad_shard[b.sp_mask] = all_reduce(b.grad_shard[b.sp_mask], self.grid.tp)
            if self.zero3:
                self.free(b)

    def publish(self, b: _Bucket, master: torch.Tensor):
        """ZeRO-2: the new slice all-gathered into the bucket's whole parameters; ZeRO-3: kept (gathered at use)."""
        if master.data_ptr() != b.param_shard.data_ptr():
            b.param_shard.copy_(master)
        if not self.zero3 and b.group.size > 1:
            _log("all_gather", b.group, b.full)
            all_gather_single(b.full, b.param_shard.clone(), group=b.group.pg)

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole inside the block; ZeRO-3: the owned slices taken from them after, then freed (what
        a checkpoint loaded into the block is kept)."""
        for units in self.units:
            for u in units:
                self.gather(u)
        try:
            yield
        finally:
            for b in self.buckets if self.zero3 else []:
                n = b.param_shard.numel()
                b.param_shard.copy_(b.full[b.group.rank * n:(b.group.rank + 1) * n])
                self.free(b)


class _Gathering:  # before DistributedOptimizer / DistributedMuon in the MRO: ZeRO-3's checkpoints
    def full_state(self):
        """The checkpoint reads whole parameters (and a load writes them): gathered until load_full_state or the
        step's finish_grad_sync frees them."""
        self._gathered = self.ddp.gathered()
        self._gathered.__enter__()
        return super().full_state()

    def load_full_state(self):
        self._gathered.__exit__(None, None, None)  # the owned slices from the loaded parameters, then freed
        super().load_full_state()


def optimizer_over(buffers: DDP, optimizer_class, **kw):
    """optimizer_class (DistributedOptimizer or DistributedMuon) over DDP's or FSDP's buckets; with ZeRO-3 its
    checkpoints gather the parameters."""
    zero3 = getattr(buffers, "zero3", False)
    return (type(optimizer_class.__name__, (_Gathering, optimizer_class), {}) if zero3 else optimizer_class)(buffers, **kw)


class TorchFSDP2(Optimizer):
    """--use-torch-fsdp2: each of fsdp_units (a layer), then the chunk (the root), fully_shard'ed over DP x CP, every
    parameter a DTensor Shard(0) (SwiGLU's strided fc1 Shard(1): checkpoint.py's [2, f, h] view stays even at any DP).
    The reduce-scatter SUMS (DESIGN.md §2; gloo has no AVG), on the last micro-batch only; torch's AdamW steps shards."""

    def __init__(self, chunks, grid: Grid, **adam):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import Shard
        mesh = DeviceMesh.from_group(grid.dp_cp.pg, next(chunks[0].parameters()).device.type)
        place = lambda p: Shard(1) if getattr(p, "partition_stride", 1) != 1 and p.dim() > 1 else Shard(0)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # (loss.t(): summed)
        for chunk in chunks:
            marks = {name: dict(p.__dict__) for name, p in chunk.named_parameters()}
            for unit in fsdp_units(chunk):
                fully_shard(unit, mesh=mesh, shard_placement_fn=place)
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
            for name, p in chunk.named_parameters():  # mark()'s attributes on the new (DTensor) Parameters
                p.__dict__.update(marks[name])
            chunk.register_forward_pre_hook(self._count_micro_batch)
        self.fsdp = [m for c in chunks for m in c.modules() if isinstance(m, FSDPModule)]
        super().__init__(chunks, grid, **adam)

    def _count_micro_batch(self, chunk, args):  # the last micro-batch's backward reduce-scatters (not evaluation's)
        if torch.is_grad_enabled():
            self.micro += 1
            chunk.set_requires_gradient_sync(self.micro == self.M)

    def zero_grad(self, num_micro_batches: int = 1):
        self.M, self.micro = num_micro_batches, 0
        self.adam.zero_grad(set_to_none=True)  # (FSDP2 adds each reduce-scatter into an existing sharded grad)

    def finish_grad_sync(self):
        """Nothing: the last micro-batch's backward has reduce-scattered every unit's gradients (torch waits)."""

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:  # each rank's local slices, summed over DP x CP
        params = [p for p in self.params if p.grad is not None]
        sq = torch.tensor([sum(p.grad.to_local().double().square().sum().item() for p in params  # [dense, MoE: none]
                               if counted_in_norm(p, self.grid)), 0.0], dtype=torch.float64, device=params[0].device)
        return clip_by_global_norm(sq, [p.grad for p in params], max_norm, self.grid, dp_sliced=True)

    def full_state(self) -> dict:  # DTensors, saved sharded; the root resharded first (no_grad leaves it gathered)
        for m in self.fsdp:
            m.reshard()
        return super().full_state()
