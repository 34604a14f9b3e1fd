"""The Mamba-2 scan, measured: mamba.ssd_chunked vs the sequential loop (mamba.ssd_sequential) vs Hugging Face's
torch path (transformers' mamba2_chunk_scan, what Mamba2ForCausalLM runs without the CUDA kernels).

Run:  .venv/bin/python bench/bench_mamba_scan.py            (~1-2 min on 2 CPU cores; --device cuda on a GPU)
      .venv/bin/python bench/bench_mamba_scan.py --lengths 256 1024 4096 16384 --batch 4

The scan alone, float32, one layer shaped like mamba2-130m: H = 24 heads of P = 64, N = 128, G = 1, chunk 128.
tokens/s = batch·L / the best of `--repeat` timed runs (after one warm-up). "fwd+bwd" times forward and backward
through every input (x, dt, A, B, C). Both chunked versions are the same algorithm (SSD, Dao & Gu 2024), so they
should be close; the sequential loop does L small steps and loses by a growing factor.
"""
import argparse
import os
import sys
import time

import torch
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mamba  # noqa: E402


def inputs(b, l, H, Pd, G, N, device, grad=False):
    g = torch.Generator().manual_seed(0)
    t = dict(x=torch.randn(b, l, H, Pd, generator=g), dt=torch.rand(b, l, H, generator=g) * 0.1 + 1e-3,
             A=-torch.rand(H, generator=g) * 8 - 1, B=torch.randn(b, l, G, N, generator=g),
             C=torch.randn(b, l, G, N, generator=g))
    return {k: v.to(device).requires_grad_(grad) for k, v in t.items()}


SCANS = {
    "chunked": lambda i, q: mamba.ssd_chunked(i["x"], i["dt"], i["A"], i["B"], i["C"], q)[0],
    "sequential": lambda i, q: mamba.ssd_sequential(i["x"], i["dt"], i["A"], i["B"], i["C"])[0],
    "HF torch": lambda i, q: mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], q),
}


def tokens_per_s(fn, b, l, args, backward=False):
    inp = inputs(b, l, args.heads, args.head_dim, args.groups, args.state, args.device, grad=backward)
    best = float("inf")
    for rep in range(args.repeat + 1):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            y = fn(inp, args.chunk)
            if backward:
                y.sum().backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if rep:  # the first run is the warm-up
            best = min(best, time.perf_counter() - t0)
    return b * l / best


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device {args.device} ({torch.get_num_threads()} threads), float32, b={args.batch}, H={args.heads}, "
          f"P={args.head_dim}, N={args.state}, G={args.groups}, chunk {args.chunk}; tokens/s (higher is better)")
    cols = [(name, False) for name in SCANS] + [("chunked", True), ("HF torch", True)]
    head = [f"{n} {'fwd+bwd' if bwd else 'fwd'}" for n, bwd in cols]
    print(f"| {'L':>6} | " + " | ".join(f"{h:>18}" for h in head) + " | chunked / sequential |")
    print("|" + "---:|" * (len(cols) + 2))
    for l in args.lengths:
        r = [tokens_per_s(SCANS[n], args.batch, l, args, bwd) for n, bwd in cols]
        print(f"| {l:>6} | " + " | ".join(f"{v:>18,.0f}" for v in r) + f" | {r[0] / r[1]:>19.1f}x |", flush=True)


if __name__ == "__main__":
    main()
