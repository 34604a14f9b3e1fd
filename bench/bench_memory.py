"""Memory audit of the distributed optimizer: bytes per parameter held by one DP rank vs the ZeRO-1 formula.

Run:  .venv/bin/python bench/bench_memory.py        (spawns d = 1, 2, 4 gloo ranks on this CPU; ~30 s)

Counted on rank 0 from the real buffers: model parameters, the fp32 gradient buffer, fp32 master weights (a
separate copy only when the parameters are bf16) and the two Adam moments. Formula (DESIGN.md §4, d = DP size):
fp32 parameters 4 + 4 + (4+4)/d = 8 + 8/d;  bf16 parameters + fp32 grads 2 + 4 + (4+4+4)/d = 6 + 12/d.
Buckets are padded to a multiple of d, so the measured value may exceed the formula by a few elements per bucket;
costs.py's memory model (costs.state_bytes, accounting "cpu") counts the padding too and must equal it (asserted).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import costs  # noqa: E402
import gpt  # noqa: E402
import parallel as P  # noqa: E402


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


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes d")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    ctx = mp.get_context("spawn")
    print("| params | d | bytes/param measured | formula | costs.py |\n|---|---|---|---|---|")
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
            layout = costs.Layout(seq=1, dp=d, distributed_optimizer=True, dtype="bf16" if dtype == torch.bfloat16
                                  else "fp32")
            model = sum(costs.state_bytes(config(dtype), layout, 0, "cpu").values())
            assert total == model, f"d={d} {dtype}: measured {total:,} B, costs.py says {model:,} B"
            print(f"| {str(dtype).split('.')[1]} | {d} | {total / n:.4f} | {formula(d):.4f} | {model / n:.4f} |")


if __name__ == "__main__":
    main()
