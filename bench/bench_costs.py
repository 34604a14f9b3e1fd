"""The time model on this CPU: timing.step_time's predicted step time, communication and pipeline bubble against a real
train.py run of one process, DP 2, TP 2 and PP 2 (bench/bench_scaling.py's measure: torchrun, gloo, one thread a rank,
every collective inside train.train_step timed). The prediction's GPU is timing.cpu_gpu() on one thread (as a rank has),
its GEMM rate that of the rank's own GEMM shapes (bench/bench_gemm.py's ceiling, split over TP), gloo over loopback
as every link (bandwidth and latency as bench/README measured them); the DP reduction not overlapped (train.py's
default: no --overlap-grad-reduce); the optimizer the run's (the default GPT's Muon). Every rate is measured on the
thread's own clock (time.thread_time), as is the rank's step in the "work" columns: on a machine other processes load,
the wall time holds their time slices; the work the model predicts besides communication and bubble should not.
What a measured collective's time holds: its transfer and the wait for the other rank; bench_scaling keeps the rank
that waits most. For PP 2 that is the first stage: in recv it waits out the bubble and, m times, the last stage's extra
work (the output layer: most of this small model's FLOPs), so PP's column compares the predicted sends + that rank's
idle time (timing.pipeline: the bubble, the imbalance) with it. Megatron's counterpart: none (its
papers' Table 1 is the GPU check, tests/test_costs_time.py).

    .venv/bin/python bench/bench_costs.py --iters 8        (~2-3 min: 4 runs of ~30 s, set-up included)
    .venv/bin/python bench/bench_costs.py --table1         (Narayanan et al. 2021's Table 1 against the model: ~5 s)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

import bench_gemm  # noqa: E402
import bench_scaling  # noqa: E402
import torch  # noqa: E402

import arguments  # noqa: E402
from config import model_file  # noqa: E402
from planning import planner, timing  # noqa: E402
from planning.layout import Layout  # noqa: E402

# name -> (processes, train.py flags); PP 2 with micro-batches of 4: m = 4, a bubble of (p-1)/m = 1/4
bench_scaling.LAYOUTS.update(pp2=(2, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "4"]))
NAMES = ["single_1t", "dp2", "tp2", "pp2"]  # single_1t: one process on one thread, a rank's share


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=NAMES, choices=NAMES)
    ap.add_argument("--iters", type=int, default=8, help="training iterations of each run")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations not counted")
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per iteration, every layout")
    ap.add_argument("--table1", action="store_true", help="only the paper's Table 1: paper, predicted, error, "
                    "and the planner's top three (TP, PP)")
    ap.add_argument("--train-args", default="", help="more train.py flags for every run (a smaller model: "
                    "\"--num-layers 2 --hidden-size 64\")")
    return ap.parse_args(argv)


def gemm_ceiling(c, tokens: int, tp: int) -> float:
    """FLOP/s of one rank's weight GEMMs at their shapes (bench_gemm.model_gemms, split over TP: column-parallel
    linears' outputs, row-parallel ones' inputs), timed here on one thread (its own time), FLOP-weighted."""
    col, axis = ("linear_qkv", "linear_fc1", "output_layer"), {"fwd": "kn", "dgrad": "nk", "wgrad": "nm"}
    flops = secs = 0.0
    for g in bench_gemm.model_gemms(c, tokens, 1):
        name, kind = g.name.split()
        split = axis[kind][name in col]  # the dimension TP divides
        g = g._replace(**{split: getattr(g, split) // tp})
        flops, secs = flops + g.flops * g.count, secs + bench_gemm.time_gemm(g, 1, 5, time.thread_time) * g.count
    return flops / secs


def predicted(name: str, a, gpu: timing.GPU) -> dict:
    """timing.step_time of the layout the run has (train.py's default model and these flags, fp32, causal core), the
    GEMM rate that of the rank's own GEMM shapes."""
    flags = [*bench_scaling.LAYOUTS[name][1], *shlex.split(a.train_args)]
    args = arguments.parse_args(["--global-batch-size", str(a.global_batch), *flags])
    c = arguments.model_config(model_file(args.model), args)
    dp = 2 if name == "dp2" else 1
    lo = Layout(args.seq_length, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, dp=dp,
                      micro_batch=args.micro_batch_size if name == "pp2" else a.global_batch // dp,
                      global_batch=a.global_batch, recompute=args.recompute_granularity, optimizer=args.optimizer,
                      dtype="fp32")
    rate = gemm_ceiling(c, lo.micro_batch * lo.seq, lo.tp)
    core = timing.attention_rate(lo.micro_batch, c.num_attention_heads // lo.tp, lo.seq, c.kv_channels, 0.5,
                                time.thread_time)
    return timing.step_time(c, lo, dataclasses.replace(gpu, peak=rate / timing.GEMM_EFFICIENCY, attention=core),
                           overlap=args.overlap_grad_reduce) | {"gemm_rate": rate}


def table1():
    """tests/test_costs_time.py's rows: the paper's TFLOP/s per GPU, the model's, the planner's top three."""
    from test_costs_time import A100, FIT_ROWS, TABLE1, config, paper_layout
    print("| model | GPUs | TP, PP | paper TFLOP/s per GPU | predicted | error | bubble | TP comm | planner's top three "
          "(TP, PP) |\n|---|---|---|---|---|---|---|---|---|")
    for i, row in enumerate(TABLE1):
        params, heads, h, L, t, p, n, batch, paper = row
        c, lo = config(heads, h, L), paper_layout(row)
        r = timing.step_time(c, lo, A100, paper=True)
        top = planner.plan(c, A100, n, 2048, batch, "fp16", paper=True, top=3, micro_batch=1, recompute="full",
                         distributed_optimizer=False, vpp=1, cp=1, sequence_parallel=False)
        top = ", ".join(f"({x['tensor_model_parallel_size']}, {x['pipeline_model_parallel_size']})" for x in top)
        print(f"| {params}B{' (fit)' if i in FIT_ROWS else ''} | {n} | {t}, {p} | {paper} | {r['tflops_per_gpu']:.1f} "
              f"| {r['tflops_per_gpu'] / paper - 1:+.1%} | {r['bubble'] / r['seconds_per_iteration']:.1%} | "
              f"{r['tp_comm'] / r['seconds_per_iteration']:.1%} | {top} |")


def main():
    if sys.argv[1:2] == ["--worker"]:
        return bench_scaling.worker(sys.argv[2], sys.argv[4:])
    a = parse_args()
    if a.table1:
        return table1()
    print(f"command: .venv/bin/python bench/bench_costs.py {shlex.join(sys.argv[1:])}".rstrip())
    torch.set_num_threads(1)  # a rank's share: torchrun gives each one thread
    gpu = timing.cpu_gpu(1.0, clock=time.thread_time)
    print(f"this CPU on one thread: {gpu.peak * timing.GEMM_EFFICIENCY / 1e9:.1f} GFLOP/s fp32 GEMM, {gpu.hbm / 1e9:.1f} "
          f"GB/s copy, attention core {gpu.attention / 1e9:.1f} GFLOP/s, {gpu.op * 1e6:.1f} µs an eager op (measured, "
          "on its own time); "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    scaling = argparse.Namespace(iters=a.iters, warmup=a.warmup, global_batch=a.global_batch, train_args=a.train_args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.layouts:
            m, p = bench_scaling.measure(name, scaling, Path(tmp)), predicted(name, a, gpu)
            comm = p["dp_exposed"] + p["tp_comm"] + p["pp_comm"] + p["tied_comm"]
            work = p["seconds_per_iteration"] - comm - p["bubble"]  # what the slowest rank's own thread does
            imbalance = max(p["idle"]) - p["bubble"]  # PP: the first rank's wait for the slower last one
            rows.append(f"| {name} | {p['gemm_rate'] / 1e9:.1f} | {p['seconds_per_iteration']:.3f} | {m['step_s']:.3f} | "
                        f"{p['seconds_per_iteration'] / m['step_s'] - 1:+.0%} | {work:.3f} (optimizer "
                        f"{p['optimizer']:.3f}) | {m['cpu_s']:.3f} | {work / m['cpu_s'] - 1:+.0%} | {comm + max(p['idle']):.3f} "
                        f"(bubble {p['bubble']:.3f}, imbalance {imbalance:.3f}) | {m['collective_s']:.3f} |")
            print(f"  {name}: {m['wall']:.0f} s", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end; medians over iterations {a.warmup + 1}-{a.iters}, the "
          "slower rank's (on the rank's thread: the best of them)\n")
    print("| layout | GEMM GFLOP/s at its shapes | predicted s / iteration | measured | error | predicted work s | "
          "measured on the rank's thread s | error | predicted communication + idle s (the most idle rank) | measured in "
          "collectives s |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
