"""This CPU's fp32 GEMM ceiling for the default GPT, with torch's own matmul: every weight GEMM one training iteration
of `make train MODEL=gpt` runs (each linear of a layer and the output layer, forward Y = X·Wᵀ and the two backward
GEMMs, dgrad dX = dY·W and wgrad dW = dYᵀ·X, at the shapes arguments.parse_args + arguments.model_config give), timed
alone (warm-up, then the median of --repeats calls; torch.set_num_threads = the cores this process may use, as
train.py sets), and one large square GEMM as the machine's peak. The ceiling is the FLOP-weighted rate of the model's
GEMMs: the model TFLOP/s train.py would log (metrics.flops, Megatron's num_floating_point_operations) if everything
but these GEMMs took no time. The core attention (QKᵀ and PV: 2.4 % of the default model's FLOPs) is not a weight GEMM
and is left out of the ceiling. Megatron's counterpart is its MFU (achieved model FLOP/s over the peak, Narayanan et
al. 2021 §5.1); here the peak is measured, not a data sheet's. Under --optimizer muon (the default's), Muon's
Newton-Schulz is counted (newton_schulz_flops) and timed at its precision (--muon-fp32-matmul-prec): the logged tflops
leave it out, which bounds the fraction.

With --run DIR, the run's median `tflops` over its logged training windows (metrics.jsonl; train.py's
metrics.throughput: the window's model FLOPs / its time / the world size — per rank, so compare a one-process run)
as a fraction of the ceiling and of the peak. With --profile N, N training iterations of the default model in this
process (train.setup and train.train_step, after one warm-up iteration) under torch.profiler, the ops' self CPU time
grouped (GEMMs, attention, norms, optimizer, elementwise, other) as a fraction of the profiled time.

    .venv/bin/python bench/bench_gemm.py --repeats 10        (~10-20 s; --model-args "..." for another shape)
    .venv/bin/python bench/bench_gemm.py --run runs/gpt --profile 3        (~30 s more: train.py's set-up)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import arguments  # noqa: E402
import config  # noqa: E402
import metrics  # noqa: E402
import parallel as P  # noqa: E402


class Gemm(NamedTuple):
    """One GEMM (m x k)·(k x n) of an iteration, run `count` times (layers x micro-batches)."""
    name: str  # e.g. "linear_qkv dgrad"
    m: int
    k: int
    n: int
    count: int

    @property
    def flops(self) -> int:  # of one call: a multiply-add is 2 FLOPs
        return 2 * self.m * self.k * self.n


def config_of(model_args: list[str]):
    """(the model's Config, micro-batch, sequence length, micro-batches per iteration) from train.py's flags: the
    default GPT unless --model-args say otherwise. The vocabulary is --vocab-size, else train.py's BPE default 8192."""
    args = arguments.check_args(arguments.parse_args(model_args), 1)
    c = arguments.model_config(config.model_file(args.model), args, args.vocab_size or 8192)
    if args.model != "gpt" or c.num_experts or c.multi_latent_attention or c.mtp_num_layers:
        raise SystemExit(f"bench_gemm.py: error: --model-args {' '.join(model_args)!r}: only a dense GPT without MLA "
                         "or MTP is listed (model_gemms)")
    return c, args.micro_batch_size, args.seq_length, args.global_batch_size // args.micro_batch_size


def model_gemms(c, micro_batch: int, seq: int, micro_batches: int = 1) -> list[Gemm]:
    """Every weight GEMM of one training iteration of a dense GPT (gpt.Model, one process): per layer linear_qkv
    h -> (n + 2g)·d, linear_proj n·d -> h, linear_fc1 h -> f (2f with SwiGLU: gate and up fused), linear_fc2 f -> h;
    then the output layer h -> V (padded). Each as forward X·Wᵀ [T, in]·[in, out], dgrad dY·W [T, out]·[out, in] and
    wgrad dYᵀ·X [out, T]·[T, in], T = micro_batch·seq tokens, count = layers (1 for the output layer) x micro-batches.
    Their FLOPs sum to metrics.flops without its core-attention term (tests/test_flops.py holds that exactly)."""
    T, h, L = micro_batch * seq, c.hidden_size, c.num_layers
    nd, gd = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    f = c.ffn_hidden_size
    linears = [("linear_qkv", h, nd + 2 * gd, L), ("linear_proj", nd, h, L),
               ("linear_fc1", h, 2 * f if c.gated_linear_unit else f, L), ("linear_fc2", f, h, L),
               ("output_layer", h, c.padded_vocab_size, 1)]
    out = []
    for name, i, o, n in linears:
        out += [Gemm(f"{name} fwd", T, i, o, n * micro_batches), Gemm(f"{name} dgrad", T, o, i, n * micro_batches),
                Gemm(f"{name} wgrad", o, T, i, n * micro_batches)]
    return out


def newton_schulz_flops(c, steps: int) -> int:
    """FLOPs of Muon's orthogonalization an iteration (--optimizer muon, the default's): parallel.newton_schulz on
    each hidden matrix (the layers' linears; the word embedding and output layer are AdamW's) as [m, n], m <= n,
    `steps` times x·xᵀ (2m²n), gram·gram (2m³) and (…)·x (2m²n). GEMMs the step runs that metrics.flops (Megatron's
    count, the logged tflops) does not count: at the ceiling's rate they bound the logged fraction of it."""
    h, L, f = c.hidden_size, c.num_layers, c.ffn_hidden_size
    nd, gd = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    shapes = [(h, nd + 2 * gd), (nd, h), (h, 2 * f if c.gated_linear_unit else f), (f, h)]
    return L * steps * sum(4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3 for s in shapes)


def newton_schulz_seconds(c, steps: int, dtype: torch.dtype, warmup: int, repeats: int) -> float:
    """Seconds of Muon's orthogonalization an iteration, timed: parallel.newton_schulz on each hidden matrix's shape in
    `dtype` (bfloat16 under --muon-fp32-matmul-prec medium), the median of `repeats` calls each, x the layers."""
    h, f = c.hidden_size, c.ffn_hidden_size
    nd, gd = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    total = 0.0
    for shape in [(h, nd + 2 * gd), (nd, h), (h, 2 * f if c.gated_linear_unit else f), (f, h)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        for _ in range(warmup):
            P.newton_schulz(g, steps)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            P.newton_schulz(g, steps)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times)
    return c.num_layers * total


def time_gemm(g: Gemm, warmup: int, repeats: int, clock=time.perf_counter) -> float:
    """Median seconds of one call (on `clock`), with the operands laid out as F.linear and its autograd use them:
    forward x @ W.t() (W [out, in] row-major), dgrad dY @ W, wgrad dY.t() @ x (the transposed views, not copies)."""
    torch.manual_seed(0)
    kind = g.name.split()[-1]
    if kind == "fwd":  # x [T, in], W [out, in]
        a, b = torch.randn(g.m, g.k), torch.randn(g.n, g.k).t()
    elif kind == "dgrad":  # dY [T, out], W [out, in]
        a, b = torch.randn(g.m, g.k), torch.randn(g.k, g.n)
    elif kind == "wgrad":  # dY [T, out] -> dYᵀ, x [T, in]
        a, b = torch.randn(g.k, g.m).t(), torch.randn(g.k, g.n)
    else:  # a plain square GEMM
        a, b = torch.randn(g.m, g.k), torch.randn(g.k, g.n)
    out = torch.empty(g.m, g.n)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        t0 = clock()
        torch.matmul(a, b, out=out)
        times.append(clock() - t0)
    return statistics.median(times)


def run_tflops(run_dir: Path) -> tuple[float, int]:
    """(median `tflops` over the run's logged training windows, how many) from DIR/metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"bench_gemm.py: error: --run {run_dir}: no metrics.jsonl there")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tf = [r["tflops"] for r in rows if "tflops" in r]
    if not tf:
        raise SystemExit(f"bench_gemm.py: error: --run {run_dir}: metrics.jsonl has no `tflops` line")
    return statistics.median(tf), len(tf)


GROUPS = [  # (group, substrings of an op's name): see group_of
    ("GEMM (mm/addmm/bmm)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("attention", ("attention", "aten::_softmax", "aten::softmax", "_softmax_backward")),
    ("norms", ("rms_norm", "layer_norm", "norm_backward")),
    ("elementwise", ("aten::add", "aten::mul", "aten::sub", "aten::div", "aten::silu", "aten::sigmoid", "aten::copy_",
                     "aten::fill_", "aten::zero_", "aten::neg", "aten::cat", "aten::pow", "aten::rsqrt", "aten::sum",
                     "aten::mean", "aten::exp", "aten::cos", "aten::sin", "aten::where", "aten::clone",
                     "aten::contiguous", "aten::empty_like", "aten::_to_copy", "aten::to", "aten::index",
                     "aten::masked", "aten::clamp", "aten::sqrt", "aten::lerp", "aten::addcdiv", "aten::addcmul")),
]


def group_of(names: list[str]) -> str:
    """The group of an op, from its name and its callers' (innermost first): under the optimizer's marked methods,
    "optimizer"; else the first of them that names a GEMM, an attention or a norm (a composite op's pieces, e.g.
    aten::rms_norm's pow, mean, rsqrt and mul, are its own); else "elementwise" or "other" by the op's own name. A
    composite norm's backward is its pieces' autograd nodes, which name no norm: that counts as elementwise."""
    if any(n.startswith("optimizer.") for n in names):
        return "optimizer (step, clip, zero_grad)"
    for n in names:
        g = next((g for g, keys in GROUPS[:3] if any(k in n for k in keys)), None)
        if g is not None:
            return g
    return "elementwise" if any(k in names[0] for k in GROUPS[3][1]) else "other"


def profile(n: int, model_args: list[str], top: int):
    """N iterations of train.py's step in this process under torch.profiler (one warm-up iteration first)."""
    import train
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):  # (train.py's arguments)
        run = train.setup(train.parse(["--save", f"{tmp}/run", "--eval-iters", "0", *model_args]))
        opt = run.optimizer
        for method in ("step", "clip_grad_norm", "zero_grad"):  # each marked, so their ops group as the optimizer's
            f = getattr(opt, method)
            setattr(opt, method, lambda *a, _f=f, _m=method, **k: _record(_m, _f, *a, **k))
        train.train_step(run, 0)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for it in range(1, n + 1):
                train.train_step(run, it)
        wall = time.perf_counter() - t0
        run.log.close()
    by_group, by_op = defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.name.startswith("optimizer."):
            continue  # the marker range itself (its self time is the Python around the ops)
        names, p = [e.name], e.cpu_parent
        while p is not None:
            names, p = names + [p.name], p.cpu_parent
        g = group_of(names)
        by_group[g] += e.self_cpu_time_total
        by_op[e.name, g] += e.self_cpu_time_total  # (an op in two groups, e.g. aten::mul, has a row in each)
    total = sum(by_group.values())  # µs of self CPU time on the profiled thread
    print(f"\n--profile {n}: {n} iterations in {wall:.2f} s under the profiler ({wall / n:.3f} s/iteration); "
          f"self CPU time of all ops {total / 1e6:.2f} s ({total / 1e6 / wall:.0%} of the wall time: the rest is "
          "Python and the profiler's own cost)")
    print("\n| group | self CPU s / iteration | of the ops' time | of the step (wall) |\n|---|---|---|---|")
    for g, us in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {us / 1e6 / n:.4f} | {us / total:.1%} | {us / 1e6 / wall:.1%} |")
    print(f"\ntop {top} ops by self CPU time:\n\n| op | group | self CPU s / iteration | fraction |\n|---|---|---|---|")
    for (name, g), us in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {name} | {g} | {us / 1e6 / n:.4f} | {us / total:.1%} |")


def _record(name, f, *a, **k):
    with torch.profiler.record_function(f"optimizer.{name}"):
        return f(*a, **k)


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per GEMM (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per GEMM first")
    ap.add_argument("--peak-size", type=int, default=2048, help="the square GEMM's N (N x N x N) for the peak")
    ap.add_argument("--model-args", default="", help="train.py flags for the model's shape (default: train.py's "
                    "defaults, the default GPT), e.g. \"--hidden-size 64 --num-layers 2\"")
    ap.add_argument("--run", type=Path, default=None, help="a run directory: its median tflops against the ceiling")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="N profiled training iterations (0: none)")
    ap.add_argument("--top", type=int, default=15, help="ops listed by --profile")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.warmup < 0 or a.peak_size < 1 or a.profile < 0:
        ap.error(f"--repeats {a.repeats} (>= 1), --warmup {a.warmup} (>= 0), --peak-size {a.peak_size} (>= 1), "
                 f"--profile {a.profile} (>= 0): a value out of range")
    return a


def main():
    a = parse_args()
    model_args = shlex.split(a.model_args)
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may use, as train.py (parallel.init_distributed)
    c, b, s, M = config_of(model_args)
    gemms = model_gemms(c, b, s, M)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; model: {c.num_layers} layers, h "
          f"{c.hidden_size}, {c.num_attention_heads} heads / {c.num_query_groups} query groups x {c.kv_channels}, "
          f"ffn {c.ffn_hidden_size}{' SwiGLU' if c.gated_linear_unit else ''}, vocab {c.padded_vocab_size} (padded); "
          f"{M} micro-batch(es) of {b} x {s} tokens an iteration")
    print("\n| GEMM | (m x k)·(k x n) | calls / iteration | GFLOP / call | ms / call (median) | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    flops = secs = 0.0
    for g in gemms:
        t = time_gemm(g, a.warmup, a.repeats)
        flops, secs = flops + g.count * g.flops, secs + g.count * t
        print(f"| {g.name} | ({g.m} x {g.k})·({g.k} x {g.n}) | {g.count} | {g.flops / 1e9:.3f} | {t * 1e3:.3f} | "
              f"{g.flops / t / 1e9:.1f} |")
    N = a.peak_size
    t = time_gemm(Gemm("square", N, N, N, 1), a.warmup, a.repeats)
    peak = 2 * N ** 3 / t
    total = metrics.flops(c, b * M, s)
    ceiling = flops / secs
    print(f"| square (peak) | ({N} x {N})·({N} x {N}) | – | {2 * N ** 3 / 1e9:.3f} | {t * 1e3:.3f} | {peak / 1e9:.1f} |")
    print(f"\nthe model's weight GEMMs: {flops / 1e9:.2f} GFLOP an iteration ({flops / total:.1%} of metrics.flops's "
          f"{total / 1e9:.2f}; the rest is the core attention) in {secs * 1e3:.1f} ms")
    print(f"ceiling: {ceiling / 1e12:.4f} TFLOP/s ({ceiling / peak:.0%} of the peak); peak ({N}³): "
          f"{peak / 1e12:.4f} TFLOP/s; at the ceiling an iteration of {b * M * s} tokens would take "
          f"{secs * 1e3:.1f} ms ({b * M * s / secs:,.0f} tokens/s)")
    flags = arguments.parse_args(model_args)
    ns = newton_schulz_flops(c, flags.muon_num_ns_steps) if flags.optimizer == "muon" else 0
    bound = 1.0
    if ns:
        fast = P.NS_PRECISION[flags.muon_fp32_matmul_prec] and P.fast_bfloat16(torch.device("cpu"))
        dtype = P.NS_PRECISION[flags.muon_fp32_matmul_prec] if fast else torch.float32  # (as parallel.orthogonalized)
        t_ns = newton_schulz_seconds(c, flags.muon_num_ns_steps, dtype, a.warmup, a.repeats)
        bound = total / ceiling / (total / ceiling + t_ns)
        print(f"Muon's Newton-Schulz: {ns / 1e9:.2f} GFLOP of GEMMs an iteration more, not in metrics.flops, in "
              f"{str(dtype).split('.')[1]} (--muon-fp32-matmul-prec {flags.muon_fp32_matmul_prec}): {t_ns * 1e3:.1f} "
              f"ms timed ({ns / t_ns / 1e12:.4f} TFLOP/s), so the logged tflops reach at most {bound:.1%} of the "
              "ceiling (every GEMM at its rate, nothing else timed)")
    if a.run is not None:
        tf, n = run_tflops(a.run)
        print(f"\n--run {a.run}: median tflops {tf:.4f} over {n} logged windows = {tf * 1e12 / ceiling:.1%} of the "
              f"ceiling ({tf * 1e12 / ceiling / bound:.1%} of its bound), {tf * 1e12 / peak:.1%} of the peak (per "
              "rank: compare a one-process run)")
    if a.profile:
        profile(a.profile, model_args, a.top)


if __name__ == "__main__":
    main()
