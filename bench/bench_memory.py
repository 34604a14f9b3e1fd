"""Memory audit of the distributed optimizer: bytes per parameter held by one DP rank vs the ZeRO-1 formula; then
each --data-parallel-sharding-strategy (parallel.py sections 9 and 14): bytes held and bytes moved per step.

Run:  .venv/bin/python bench/bench_memory.py        (spawns d = 1, 2, 4 gloo ranks on this CPU; ~1 min)

Counted on rank 0 from the real buffers: model parameters, the fp32 gradient buffer, fp32 master weights (a
separate copy only when the parameters are bf16) and the two Adam moments. Formula (DESIGN.md §4, d = DP size):
fp32 parameters 4 + 4 + (4+4)/d = 8 + 8/d;  bf16 parameters + fp32 grads 2 + 4 + (4+4+4)/d = 6 + 12/d.
Buckets are padded to a multiple of d, so the measured value may exceed the formula by a few elements per bucket;
planning/memory.py (state_bytes, accounting "cpu") counts the padding too and must equal it (asserted).
The strategies' table: fp32, one iteration (one micro-batch per rank); held after the step, per parameter: each
storage of the parameters, gradients and Adam state once; ZeRO-3's peak of gathered buckets during it; and the bytes
of its DP collectives (parallel.count_collectives' convention: the whole tensor each works on).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt  # noqa: E402
import parallel as P  # noqa: E402
from planning import memory  # noqa: E402
from planning.layout import Layout  # noqa: E402


def config(dtype):
    return gpt.Config(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=8192, params_dtype=dtype)


def worker(rank, d, dtype, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=d, init_method=f"tcp://127.0.0.1:{port}")
    grid = P.Grid(dp=d)
    model = gpt.Model(config(dtype), grid)
    ddp = P.DDP([model], grid, distributed_optimizer=True)
    opt = P.DistributedOptimizer(ddp)
    n = sum(p.numel() for p in model.parameters())
    el = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    separate_master = [m for m in opt.master if m.data_ptr() != ddp.param_buffer.data_ptr() and m.dtype != dtype]
    total = el([ddp.param_buffer, ddp.grad_buffer]) + el(separate_master) + el(opt.exp_avg) + el(opt.exp_avg_sq)
    if rank == 0:
        out.put((total, n))
    dist.destroy_process_group()


def strategy_worker(rank, d, strategy, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=d, init_method=f"tcp://127.0.0.1:{port}")
    grid = P.Grid(dp=d)
    model = gpt.Model(config(torch.float32), grid)
    buffers = P.DDP([model], grid, distributed_optimizer=strategy == "optim") if strategy in ("no_shard", "optim") \
        else P.FSDP([model], grid, strategy)
    opt = P.optimizer_over(buffers, P.DistributedOptimizer)
    peak, gather = [0], getattr(buffers, "gather", None)
    if strategy == "optim_grads_params":
        def gathering(*a, **k):  # the bytes of every gathered bucket, after each all-gather
            gather(*a, **k)
            peak[0] = max(peak[0], sum(b.full.untyped_storage().nbytes() for b in buffers.buckets))
        buffers.gather = gathering
    tokens = torch.randint(0, 8192, (1, 17), generator=torch.Generator().manual_seed(rank))
    with P.count_collectives() as log:
        opt.zero_grad(1)
        P.forward_backward(model, [tokens], lambda m, mb: m(mb[:, :-1], labels=mb[:, 1:]).sum(), 16 * d, grid)
        opt.finish_grad_sync()
        opt.clip_grad_norm(1.0)
        opt.step()
    seen = {}
    held = lambda ts: sum(seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in ts
                          if t.untyped_storage().data_ptr() not in seen)
    bks = buffers.buckets
    sizes = (held(list(model.parameters()) + [b.param_shard for b in bks]),
             held([b.grad_shard for b in bks] + ([buffers.grad_buffer] if strategy in ("no_shard", "optim") else [])),
             held(opt.exp_avg + opt.exp_avg_sq + opt.master))
    moved = {k: sum(n for kind, g, n in log if kind == k and g == "dp_cp") for k in ("all_reduce", "reduce_scatter",
                                                                                      "all_gather")}
    if rank == 0:
        out.put((sizes, sum(p.numel() for p in model.parameters()), peak[0], moved))
    dist.destroy_process_group()


STRATEGY_FORMULA = {  # bytes per parameter held after the step, fp32: parameters + gradients + Adam's two moments
    "no_shard": lambda d: 4 + 4 + 8, "optim": lambda d: 4 + 4 + 8 / d, "optim_grads": lambda d: 4 + (4 + 8) / d,
    "optim_grads_params": lambda d: (4 + 4 + 8) / d}


def strategies(dps, ctx):
    print("\n| strategy | d | held B/param: params + grads + optimizer = total | formula | ZeRO-3 peak gathered "
          "B/param | moved per step (all-reduce + reduce-scatter + all-gather) / param bytes |\n|---|---|---|---|---|---|")
    for strategy in STRATEGY_FORMULA:
        for d in dps:
            q = ctx.Queue()
            procs = [ctx.Process(target=strategy_worker, args=(r, d, strategy, 29650 + d + 10 * len(strategy), q))
                     for r in range(d)]
            for p in procs:
                p.start()
            (par, gr, opt), n, peak, moved = q.get()
            for p in procs:
                p.join()
            total = par + gr + opt
            assert abs(total / n - STRATEGY_FORMULA[strategy](d)) < 0.01, (strategy, d, total / n)  # (padding)
            print(f"| {strategy} | {d} | {par / n:.2f} + {gr / n:.2f} + {opt / n:.2f} = {total / n:.2f} | "
                  f"{STRATEGY_FORMULA[strategy](d):.2f} | {peak / n:.2f} | " + " + ".join(f"{moved[k] / (4 * n):.2f}"
                  for k in ("all_reduce", "reduce_scatter", "all_gather")) + f" = {sum(moved.values()) / (4 * n):.2f} |")


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes d")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    ctx = mp.get_context("spawn")
    print("| params | d | bytes/param measured | formula | planning/memory.py |\n|---|---|---|---|---|")
    for dtype, formula in [(torch.float32, lambda d: 8 + 8 / d), (torch.bfloat16, lambda d: 6 + 12 / d)]:
        for d in args.dp:
            q = ctx.Queue()
            port = 29600 + d + (10 if dtype == torch.bfloat16 else 0)
            procs = [ctx.Process(target=worker, args=(r, d, dtype, port, q)) for r in range(d)]
            for p in procs:
                p.start()
            total, n = q.get()
            for p in procs:
                p.join()
            layout = Layout(seq=1, dp=d, distributed_optimizer=True, dtype="bf16" if dtype == torch.bfloat16
                                  else "fp32")
            model = sum(memory.state_bytes(config(dtype), layout, 0, "cpu").values())
            assert total == model, f"d={d} {dtype}: measured {total:,} B, planning/memory.py says {model:,} B"
            print(f"| {str(dtype).split('.')[1]} | {d} | {total / n:.4f} | {formula(d):.4f} | {model / n:.4f} |")
    strategies(args.dp, ctx)


if __name__ == "__main__":
    main()
