"""One process vs DP 2 vs TP 2 (and TP 2 + SP) on this machine, the default GPT at the same global batch: tokens/s,
and the time each rank spends in collectives. Each layout is a real train.py run (train.main; the multi-rank ones
under torchrun, gloo) in a worker that times every torch.distributed collective inside train.train_step (a call's
wall time, waiting for the other rank included; an async one's wait()) and counts its bytes with the communication
audit (parallel.count_collectives: what each collective of this rank works on, the audit's convention). Megatron's
counterparts: data parallelism and its gradient all-reduce; tensor parallelism (Shoeybi et al. 2019: two all-reduces
per layer forward, two backward) and sequence parallelism (Korthikanti et al. 2022: all-gather + reduce-scatter
instead, the same bytes, plus the all-gather each column-parallel linear runs again in backward to keep only its
input's sequence shard).

What to learn on a 2-core CPU: one process uses both cores for every GEMM (2 threads); DP 2 and TP 2 give each rank
one core (torchrun's one thread per rank; the row single_1t is one process on one thread, one such rank's compute
alone), so the machine's compute is the same and the layouts can only lose — by the time in collectives (gloo over
loopback: memory copies plus waiting for the slower rank) and by smaller GEMMs running further below the ceiling
(bench/bench_gemm.py). DP 2 moves the gradients once a step; TP 2 moves activations in every layer, forward and back.

    .venv/bin/python bench/bench_scaling.py --iters 12        (~3 min at full size: 5 runs of ~30 s, set-up included)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name -> (processes, train.py flags besides the batch); each DP rank takes global batch / dp as its micro-batch.
# single_1t: one process held to one thread, the compute of one rank of the others
LAYOUTS = {"single": (1, []), "single_1t": (1, []), "dp2": (2, []), "tp2": (2, ["--tensor-model-parallel-size", "2"]),
           "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])}
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "send", "recv", "isend", "irecv", "broadcast", "barrier"]
# the audit's kind -> the bytes one rank sends over the wire per byte the audit logs, in a group of n ranks (ring
# algorithms): an all-reduce of N bytes 2(n-1)/n·N (a reduce-scatter then an all-gather); an all-gather (the audit
# logs its output) and a reduce-scatter (its input) (n-1)/n·N; all_to_all and send what they send; recv 0 (its sender
# counts it). Every group of these layouts has the world's n ranks.
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0,
        "recv": lambda n: 0.0}


# ---------------------------------------------------------------------------------------------- the worker (a rank)
class _TimedWork:
    """An async collective's handle whose wait() is timed (gloo's work happens until then)."""

    def __init__(self, work, clock):
        self._work, self._clock = work, clock

    def wait(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*a, **k)
        finally:
            self._clock["secs"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed(f, clock):
    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            out = f(*a, **k)
        finally:
            clock["secs"] += time.perf_counter() - t0
        return _TimedWork(out, clock) if out is not None and hasattr(out, "wait") else out
    return call


def worker(out_dir: str, train_argv: list[str]):
    """One rank: train.main(train_argv) with every collective timed and counted inside train_step; writes
    OUT/rank{R}.json = {threads, steps: [{secs, cpu_secs, collective_secs, bytes}]}."""
    import torch
    import torch.distributed as dist

    import parallel as P
    import train
    clock, steps = {"secs": 0.0}, []
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _timed(getattr(dist, name), clock))
    P.all_gather_single = _timed(P.all_gather_single, clock)  # (bound at import: patched where parallel.py calls)
    P.reduce_scatter_single = _timed(P.reduce_scatter_single, clock)
    step = train.train_step

    def timed_step(run, it):
        clock["secs"] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        with P.count_collectives() as log:
            out = step(run, it)
        kinds = {}
        for kind, _, b in log:
            kinds[kind] = kinds.get(kind, 0) + b
        steps.append(dict(secs=time.perf_counter() - t0, cpu_secs=time.thread_time() - c0, collective_secs=clock["secs"],
                          bytes=kinds))
        return out
    train.train_step = timed_step  # (train.loop looks it up at each call)
    if os.environ.get("BENCH_SCALING_THREADS"):  # single_1t: parallel.init_distributed's set_num_threads(cores) held to this
        set_threads, n = torch.set_num_threads, int(os.environ["BENCH_SCALING_THREADS"])
        torch.set_num_threads = lambda _: set_threads(n)
    train.main(train_argv)
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(threads=torch.get_num_threads(), steps=steps)))


# ---------------------------------------------------------------------------------------------- the driver
def measure(name: str, a, tmp: Path) -> dict:
    """Run one layout; {tokens_per_s (metrics.jsonl's median), step_s, cpu_s (the best iteration's time on the
    slower rank's own thread: what other processes' time slices leave out), collective_s, bytes, threads, wall}."""
    import arguments
    nproc, flags = LAYOUTS[name]
    extra = shlex.split(a.train_args)
    gbs = a.global_batch or arguments.parse_args(extra).micro_batch_size  # train.py's: its micro-batch x dp 1
    dp = nproc if name.startswith("dp") else 1
    if gbs % dp:
        raise SystemExit(f"bench_scaling.py: error: --global-batch {gbs} is not divisible by dp {dp}")
    out, run = tmp / name, tmp / f"{name}_run"
    out.mkdir()
    argv = ["--train-iters", str(a.iters), "--eval-iters", "0", "--log-interval", "1", "--save", str(run),
            "--micro-batch-size", str(gbs // dp), "--global-batch-size", str(gbs), *flags, *extra]
    me = [os.path.abspath(__file__), "--worker", str(out), "--"]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                             if nproc > 1 else []), *me, *argv]
    t0 = time.time()
    env = {**os.environ, **({"BENCH_SCALING_THREADS": "1"} if name == "single_1t" else {})}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if r.returncode != 0:
        raise SystemExit(f"bench_scaling.py: {name} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(nproc)]
    keep = slice(a.warmup, None)  # the first steps (allocations, the first gloo connections) are not counted
    counted = range(len(ranks[0]["steps"]))[keep]
    med = lambda key: statistics.median(max(rk["steps"][i][key] for rk in ranks) for i in counted)  # slowest rank's
    logged = statistics.median(sum(ranks[0]["steps"][i]["bytes"].values()) for i in counted)  # rank 0's
    wire = statistics.median(sum(WIRE[k](nproc) * b for k, b in ranks[0]["steps"][i]["bytes"].items())
                             for i in counted)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["iteration"] > a.warmup]
    best = min(max(rk["steps"][i]["cpu_secs"] for rk in ranks) for i in counted)  # as a rate's best burst
    return dict(tokens_per_s=statistics.median(tps), step_s=med("secs"), cpu_s=best,
                collective_s=med("collective_secs"),
                bytes=logged, wire=wire, threads=ranks[0]["threads"], wall=wall)


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--iters", type=int, default=12, help="training iterations of each run")
    ap.add_argument("--warmup", type=int, default=2, help="first iterations not counted")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per iteration, every layout "
                    "(default: train.py's --micro-batch-size, 16)")
    ap.add_argument("--train-args", default="", help="more train.py flags for every run, e.g. a smaller model "
                    "\"--num-layers 2 --hidden-size 64\" or a --data-path")
    a = ap.parse_args(argv)
    if a.iters <= a.warmup or a.warmup < 0:
        ap.error(f"--iters {a.iters} must exceed --warmup {a.warmup} (>= 0): nothing would be counted")
    return a


def main():
    if sys.argv[1:2] == ["--worker"]:  # a rank (see measure): --worker OUT -- train.py's flags
        return worker(sys.argv[2], sys.argv[4:])
    a = parse_args()
    print(f"command: .venv/bin/python bench/bench_scaling.py {shlex.join(sys.argv[1:])}".rstrip())
    print(f"{len(os.sched_getaffinity(0))} cores for this process; load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        res = {}
        for name in a.layouts:
            res[name] = measure(name, a, Path(tmp))
            print(f"  {name}: {res[name]['wall']:.0f} s", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end; {a.iters} iterations a run, the first {a.warmup} not "
          "counted; medians over iterations (per iteration, the slowest rank's)")
    base = res.get("single", {}).get("tokens_per_s")
    print("\n| layout | ranks x threads | tokens/s (metrics.jsonl) | vs one process | s / iteration | collectives "
          "s / iteration | fraction of the step | MB / iteration / rank (audit) | MB sent / iteration / rank (ring) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        nproc = LAYOUTS[name][0]
        vs = f"{r['tokens_per_s'] / base:.2f}x" if base else "–"
        print(f"| {name} | {nproc} x {r['threads']} | {r['tokens_per_s']:,.0f} | {vs} | {r['step_s']:.3f} | "
              f"{r['collective_s']:.3f} | {r['collective_s'] / r['step_s']:.1%} | {r['bytes'] / 1e6:.2f} | "
              f"{r['wire'] / 1e6:.2f} |")
    print("\naudit bytes: parallel.count_collectives's convention (an all-reduce of N bytes logs N; SP's all-gather "
          "and reduce-scatter pair logs N each); sent: what a ring algorithm sends (WIRE): TP 2 + SP sends TP 2's "
          "bytes plus the column-parallel linears' second all-gather (in backward). Collective time includes "
          "waiting for the slower rank.")


if __name__ == "__main__":
    main()
