"""Pipeline bubble, measured: 1F1B and interleaved 1F1B on real gloo p2p vs the theory (p−1)/m and (p−1)/(v·m).

Run:  .venv/bin/python bench/bench_pipeline.py      (~1 min; spawns p = 4 gloo ranks)

Each stage is a stand-in whose forward sleeps t/v and backward 2t/v (a chunk holds 1/v of a stage's layers), so the
timing measures the schedule, not CPU contention between ranks on a small machine. The bubble of a rank is
(wall time − its busy time) / busy time, busy = M·v·3t/v = 3·M·t. The step's bubble is rank 0's: it starts the first
forward and ends with the last backward, so its wall time is the step time. What remains above the theory is the
p2p latency per message (gloo over loopback, ~1 ms), which the interleaved schedule pays v times more often.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parallel as P  # noqa: E402

T = 0.04  # seconds of forward per stage per micro-batch


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        time.sleep(t)
        return x * 1.0

    @staticmethod
    def backward(ctx, dy):
        time.sleep(2 * ctx.t)
        return dy, None


class Stage(nn.Module):
    def __init__(self, pre, post, t):
        super().__init__()
        self.pre_process, self.post_process, self.t, self.input_tensor = pre, post, t, None
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, mb):
        x = mb * self.w if self.pre_process else self.input_tensor
        y = _Sleep.apply(x, self.t)
        return y.sum() if self.post_process else y


def worker(rank, p, vp, M, port, out, T=T):
    dist.init_process_group("gloo", rank=rank, world_size=p, init_method=f"tcp://127.0.0.1:{port}")
    grid = P.Grid(pp=p)
    chunks = [Stage(rank == 0 and v == 0, rank == p - 1 and v == vp - 1, T / vp) for v in range(vp)]
    micro = [torch.ones(4) for _ in range(M)]
    step = lambda: P.forward_backward(chunks, micro, lambda m, mb: m(mb), M, grid, shape=(4,), dtype=torch.float32)
    step()  # warm-up: gloo connects each pair of ranks lazily, on its first message
    dist.barrier()
    t0 = time.perf_counter()
    step()
    wall = time.perf_counter() - t0
    out.put((rank, wall / (3 * M * T) - 1))
    dist.destroy_process_group()


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16], help="m")
    ap.add_argument("--t", type=float, default=T, help="seconds of forward per stage and micro-batch")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    ctx = mp.get_context("spawn")
    p, t = 4, args.t
    print(f"p = {p}, forward {t * 1e3:.0f} ms / backward {2 * t * 1e3:.0f} ms per stage and micro-batch\n")
    print("| schedule | m | v | theory (p−1)/(v·m) | measured step bubble | per rank 0..p−1 |\n|---|---|---|---|---|---|")
    for vp, M in [(vp, M) for vp in (1, 2) for M in args.micro_batches]:
        q = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, p, vp, M, 29700 + 10 * vp + M, q, t)) for r in range(p)]
        for pr in procs:
            pr.start()
        res = dict(q.get() for _ in range(p))
        for pr in procs:
            pr.join()
        name = "1F1B" if vp == 1 else "interleaved"
        print(f"| {name} | {M} | {vp} | {(p - 1) / (vp * M):.3f} | {max(res.values()):.3f} | "
              + " ".join(f"{res[r]:.3f}" for r in range(p)) + " |")


if __name__ == "__main__":
    main()
