"""planning/planner.py — which layout to train with: every layout of N GPUs a model allows (TP, PP, VPP, DP, CP, EP,
the micro-batch, recomputation, the distributed optimizer, Megatron-FSDP's sharding), priced by the time model
(planning/timing.py), those that fit in memory (planning/memory.py) ranked fastest first; a layout train.py's flags
name; tools.py plan's text, JSON and PNG.

Megatron-LM has no planner; this one answers what a reader of Narayanan et al. 2021 ("Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", its takeaways: TP up to a node, then PP) would ask of one. Checked:
the paper's (TP, PP) is among the top three in 8 of Table 1's 10 rows (tests/test_costs_time.py; DESIGN.md §12).

Run:    .venv/bin/python tools.py plan --gpus 16 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --top 3
"""
from __future__ import annotations

from planning.layout import MEGATRON_NAMES, Layout
from planning.memory import memory, params_per_rank, state_bytes
from planning.timing import GPU, step_time

# plan(c, gpu, gpus, ...) -> the layouts that fit, best predicted throughput first (tools.py plan prints them).
# The share of a GPU's memory a layout may plan for: the rest is the CUDA context, NCCL's buffers and the allocator's
# fragmentation (an assumption, DESIGN.md §12: with 1.0 the paper's layout is in the top three of 7 of Table 1's rows).
USABLE = 0.85
SEARCH = {"micro_batch": (1, 2, 4, 8), "recompute": (None, "selective", "full"), "distributed_optimizer": (False, True),
          "vpp": (1, 2, 4), "cp": (1, 2, 4, 8)}
SHARDING = ("no_shard", "optim_grads", "optim_grads_params")  # with the distributed optimizer: ZeRO-1, -2, -3


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(c, gpus: int, per_node: int, seq: int, global_batch: int, dtype: str, **fixed):
    """Every layout of `gpus` ranks the model allows (TP within a node and dividing the heads and groups; PP dividing
    the layers; interleaving with m divisible by p, as Megatron asks; CP over 2·cp chunks; EP dividing the experts
    and DP·CP); `fixed` pins fields (a value, or a tuple of the values to try)."""
    pick = lambda k, default: fixed[k] if isinstance(fixed.get(k), tuple) else (fixed[k],) if k in fixed else default
    experts = c.num_experts or 1
    for tp in pick("tp", [t for t in divisors(gpus) if per_node % t == 0 and c.num_attention_heads % t == 0
                          and c.num_query_groups % t == 0]):
        for pp in pick("pp", [p for p in divisors(gpus // tp) if c.num_layers % p == 0]):
            for cp in pick("cp", [k for k in SEARCH["cp"] if (gpus // (tp * pp)) % k == 0 and seq % (2 * k) == 0]):
                dp = gpus // (tp * pp * cp)
                if tp * pp * cp * dp != gpus:
                    continue
                for ep in pick("ep", [e for e in divisors(dp * cp) if experts % e == 0] if c.num_experts else [1]):
                    for b in pick("micro_batch", [b for b in SEARCH["micro_batch"] if global_batch % (b * dp) == 0]):
                        m = global_batch // (b * dp)
                        for v in pick("vpp", [v for v in SEARCH["vpp"] if v == 1 or pp > 1 and m % pp == 0
                                              and c.num_layers % (pp * v) == 0]):
                            for r in pick("recompute", SEARCH["recompute"]):
                                for zero in pick("distributed_optimizer", (False, True) if dp > 1 else (False,)):
                                    for shard in pick("sharding", SHARDING if zero else ("no_shard",)):
                                        yield Layout(seq, tp, pp, v, dp, cp, ep, b, global_batch, pick(
                                            "sequence_parallel", (tp > 1,))[0], r, zero, shard, dtype=dtype)


def evaluate(c, layout: Layout, gpu: GPU, accounting: str = "gpu", paper: bool = False, time_=None) -> dict:
    """One layout's memory (the largest rank's) and time, with its flags under Megatron's names."""
    mem, time_ = memory(c, layout, accounting), time_ or step_time(c, layout, gpu, paper)
    flags = {MEGATRON_NAMES[k]: getattr(layout, k) for k in MEGATRON_NAMES}
    return {"memory_bytes": mem["total"], "tflops_per_gpu": time_["tflops_per_gpu"],
            "seconds_per_iteration": time_["seconds_per_iteration"], **flags,
            "use_megatron_fsdp": layout.sharding != "no_shard", "memory": mem, "time": time_,
            "fits": mem["total"] <= USABLE * gpu.memory}


def plan(c, gpu: GPU, gpus: int, seq: int, global_batch: int, dtype: str = "bf16", accounting: str = "gpu",
         paper: bool = False, top: int | None = None, **fixed) -> list[dict]:
    """The `top` fastest layouts that fit in USABLE of gpu.memory (seconds per iteration: the same global batch for
    all). Timed first, all of them; memory (memory.py walks the schedule: slower) in that order until `top` fit."""
    counts = {}  # (tp, pp, vpp, ep) -> params_per_rank

    def count(lo):
        key = lo.tp, lo.pp, lo.vpp, lo.ep
        counts[key] = counts[key] if key in counts else params_per_rank(c, lo)
        return counts[key]
    timed = sorted(((step_time(c, lo, gpu, paper, count(lo)), lo) for lo in layouts(
        c, gpus, gpu.per_node, seq, global_batch, dtype, **fixed)), key=lambda x: x[0]["seconds_per_iteration"])
    found = []
    for time_, lo in timed:
        if top is not None and len(found) == top:
            break
        if sum(state_bytes(c, lo, 0, accounting).values()) > USABLE * gpu.memory:
            continue  # (a cheap bound first: the first stage's state alone does not fit)
        entry = evaluate(c, lo, gpu, accounting, paper, time_)
        found += [entry] if entry["fits"] else []
    return found

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--num-layers-per-virtual-pipeline-stage", "--expert-model-parallel-size")


def layout_of(args, c, gpus: int, dtype: str) -> Layout:
    """The layout train.py's flags name, over `gpus` ranks (DP takes the rest, as Megatron's)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = gpus // (tp * pp * cp)
    if dp < 1 or tp * pp * cp * dp != gpus:
        raise ValueError(f"--gpus {gpus} is not a multiple of TP·PP·CP = {tp * pp * cp}")
    per = args.num_layers_per_virtual_pipeline_stage
    recompute = args.recompute_granularity or ("selective" if args.recompute_activations else None)
    sharding = args.data_parallel_sharding_strategy
    fsdp = args.use_megatron_fsdp and sharding in SHARDING[1:]
    return Layout(args.seq_length, tp, pp, c.num_layers // (pp * per) if per else 1, dp, cp,
                  args.expert_model_parallel_size, args.micro_batch_size,
                  args.global_batch_size or args.micro_batch_size * dp, args.sequence_parallel, recompute,
                  args.use_distributed_optimizer or fsdp, sharding if fsdp else "no_shard", dtype=dtype)


def report(entries: list[dict], gpu: GPU, gpus: int) -> str:
    """tools.py plan's text: one layout's memory and time, or a table of the layouts ranked."""
    G = 1e9
    name = lambda x: (f"TP {x['tensor_model_parallel_size']} PP {x['pipeline_model_parallel_size']} "
                      f"VPP {x['num_virtual_stages_per_pipeline_rank']} DP {x['data_parallel_size']} "
                      f"CP {x['context_parallel_size']} EP {x['expert_model_parallel_size']} "
                      f"mb {x['micro_batch_size']} recompute {x['recompute_granularity'] or '-'} "
                      f"dist-opt {'on' if x['use_distributed_optimizer'] else 'off'}"
                      + (f" fsdp {x['data_parallel_sharding_strategy']}" if x["use_megatron_fsdp"] else ""))
    if len(entries) != 1:
        lines = [f"the {len(entries)} fastest layouts that fit {gpus} x {gpu.name} ({USABLE:.0%} of "
                 f"{gpu.memory / G:.0f} GB):"]
        lines += [f"{i + 1:3d}. {name(x)}: {x['memory_bytes'] / G:.1f} GB, {x['tflops_per_gpu']:.0f} TFLOP/s per GPU, "
                  f"{x['seconds_per_iteration']:.3g} s per iteration" for i, x in enumerate(entries)]
        return "\n".join(lines)
    x = entries[0]
    mem, t = x["memory"], x["time"]
    parts = ", ".join(f"{k} {mem[k] / G:.2f} GB" for k in ("parameters", "gradients", "optimizer", "activations"))
    return "\n".join([
        f"{name(x)} on {gpus} x {gpu.name}",
        f"memory per GPU (pipeline rank {mem['stage']}, the largest): {parts}; total {mem['total'] / G:.2f} GB of "
        f"{gpu.memory / G:.0f} GB ({'fits' if x['fits'] else 'does NOT fit'} in {USABLE:.0%})",
        f"time per iteration: {t['seconds_per_iteration']:.3g} s = compute {t['compute']:.3g} (TP communication "
        f"{t['tp_comm']:.3g} in it) + bubble {t['bubble']:.3g} ({t['bubble_fraction']:.1%} of the compute; rank 0 idles "
        f"{t['idle'][0]:.3g}) + PP sends {t['pp_comm']:.3g} + tied embedding {t['tied_comm']:.3g} + DP {t['dp_exposed']:.3g} "
        f"exposed of {t['dp_comm']:.3g} + optimizer {t['optimizer']:.3g}",
        f"{x['tflops_per_gpu']:.0f} TFLOP/s per GPU ({t['flops'] / 1e15:.4g} PFLOP an iteration, recomputation "
        "included)"])


def plot(entry: dict, path: str):
    """A PNG bar chart of one layout's memory per GPU."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ["parameters", "gradients", "optimizer", "activations", "total"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(keys, [entry["memory"][k] / 1e9 for k in keys], color=["C0", "C1", "C2", "C3", "C7"])
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"TP {entry['tensor_model_parallel_size']} PP {entry['pipeline_model_parallel_size']} "
                 f"DP {entry['data_parallel_size']}: {entry['seconds_per_iteration']:.3g} s/iteration")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
