"""Step time of --fp8 (parallel.py section 11, local FP8 linears) against fp32, one process, on this machine.

Run:  .venv/bin/python bench/bench_fp8.py            (default: 3 warm-up steps, then 7 rounds of 2 steps per mode)
      .venv/bin/python bench/bench_fp8.py --rounds 5 --steps 1 --sizes small

One step is what train.py does per iteration with one micro-batch: forward + backward (parallel.forward_backward),
finish_grad_sync, clip_grad_norm(1.0), AdamW (parallel.Optimizer), and for FP8 the delayed-scaling update.
Models are built directly (gpt.Config / gpt.Model + parallel.fp8_enable), with train.py's defaults: RoPE, RMSNorm,
SwiGLU, no linear biases, tied embeddings, seq 128, micro-batch 16, vocab 8192, FP8 hybrid + delayed scaling.
  default : 4 layers, hidden 256, 8 heads, ffn 704      small : 4 layers, hidden 64, 4 heads, ffn 192
The modes are interleaved (fp32, fp8, fp32, fp8, ...) so a load change on a shared machine hits both; the table
gives the median seconds per step over the rounds, the ratio of the medians and the ratio of the minima (the
least disturbed round of each: on a loaded machine the steadier of the two). On CPU the FP8 GEMM is the fp32
GEMM of the FP8 values (parallel._scaled_mm); what FP8 adds is the casts, the amaxes and the scale updates.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt  # noqa: E402
import parallel as P  # noqa: E402

SIZES = {"default": dict(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=704),
         "small": dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192)}
SEQ, MBS, VOCAB = 128, 16, 8192


def build(size: str, fp8: bool):
    cfg = gpt.Config(**SIZES[size], vocab_size=VOCAB, max_position_embeddings=SEQ, position_embedding_type="rope",
                     normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
                     share_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = gpt.Model(cfg)
    state = P.fp8_enable(model, P.FP8Recipe("hybrid", "delayed")) if fp8 else None
    opt = P.Optimizer([model], None, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return model, state, opt


def step(model, state, opt, batch):
    opt.zero_grad(1)
    loss = P.forward_backward([model], [batch], lambda m, mb: m(mb[:, :-1], mb[:, 1:]).float().sum(),
                              batch.shape[0] * SEQ, None)
    opt.finish_grad_sync()
    opt.clip_grad_norm(1.0)
    opt.step()
    if state is not None:
        state.update()
    return float(loss)


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}")
    ap.add_argument("--sizes", nargs="+", default=["default", "small"], choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per mode (median)")
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    torch.manual_seed(0)
    batch = torch.randint(0, VOCAB, (MBS, SEQ + 1))
    rows = []
    for size in args.sizes:
        runs = {m: build(size, m == "fp8") for m in ("fp32", "fp8")}
        losses = {m: [step(*runs[m], batch) for _ in range(args.warmup)] for m in runs}  # fp8: calibrates scales
        times = {m: [] for m in runs}
        for _ in range(args.rounds):
            for m in runs:  # interleaved
                t = time.perf_counter()
                for _ in range(args.steps):
                    losses[m].append(step(*runs[m], batch))
                times[m].append((time.perf_counter() - t) / args.steps)
        med, best = ({m: f(times[m]) for m in runs} for f in (statistics.median, min))
        rows.append((size, med["fp32"], med["fp8"], med["fp8"] / med["fp32"], best["fp8"] / best["fp32"],
                     losses["fp32"][-1], losses["fp8"][-1]))
    cmd = "python bench/bench_fp8.py " + " ".join(sys.argv[1:])
    print(f"command: {cmd.strip()}   (torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)")
    print("| model | fp32 s/step | fp8 s/step | fp8 / fp32 (medians) | fp8 / fp32 (minima) | last loss fp32 | "
          "last loss fp8 |\n|---|---|---|---|---|---|---|")
    for size, t32, t8, r, rmin, l32, l8 in rows:
        c = SIZES[size]
        name = f"{size}: {c['num_layers']} layers, h {c['hidden_size']}"
        print(f"| {name} | {t32:.4f} | {t8:.4f} | {r:.2f}x | {rmin:.2f}x | {l32:.4f} | {l8:.4f} |")


if __name__ == "__main__":
    main()
