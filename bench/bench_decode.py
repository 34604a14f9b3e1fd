"""Decode speed with and without the KV cache (transformer.InferenceContext, gpt.generate), one process.

Run:  .venv/bin/python bench/bench_decode.py          (~2 min on a 2-core CPU: 512 and 2,048 tokens, each way)
      .venv/bin/python bench/bench_decode.py --tokens 128 512 --budget 20 --threads 2

The model is train.py's default GPT (arguments.py's defaults through arguments.model_config: 4 layers, hidden 256,
8 heads (no GQA: --num-query-groups is unset), SwiGLU 704, RMSNorm, RoPE, tied embeddings, vocabulary 8192) with
random weights, fp32, batch 1, a 16-token prompt, greedy. Only --max-position-embeddings differs from the defaults
(128): it is set to prompt + the longest generation, so that neither path slides a window. With the cache a step
runs one token through the layers and attends to the t cached keys (O(t)); without it a step recomputes the whole
sequence (O(t²) attention, O(t) everything else), so its per-token cost grows with t. That path is time-boxed
(--budget seconds per run): the table says how many of the tokens it reached, and its tokens/s is over those (the
later, slower tokens are not in it, so it flatters the recompute). The whole run's rate is then estimated: a
recompute step is one forward of the sequence so far, whatever its tokens, so one step is timed at 5 lengths (best
of 2), interpolated linearly at every step's length and summed; the speed-up is against that estimate. Tokens per
CPU second (this process's CPU time) are also given: on a shared machine they move less with the load than the
wall-clock rate. "same tokens" compares the greedy tokens of the two paths over the tokens both produced (fp32:
equal unless two logits tie to rounding).
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import arguments  # noqa: E402
import config  # noqa: E402
import gpt  # noqa: E402


def build(max_len: int):
    args = arguments.parse_args(["--vocab-size", "8192", "--max-position-embeddings", str(max_len)])
    return gpt.Model(arguments.model_config(config.model_file("gpt"), args)).eval()


@torch.no_grad()
def decode(model, ids, n: int, use_cache: bool, budget: float):
    """Greedy tokens after ids [1, s], gpt.generate's loop with a time box: (ids, tokens made, wall s, CPU s)."""
    window = model.config.max_position_embeddings
    step = gpt.cached_next_logits(model, window) if use_cache else (lambda ids: model(ids[:, -window:])[:, -1, :])
    t0, c0, made = time.perf_counter(), time.process_time(), 0
    while made < n and time.perf_counter() - t0 < budget:
        ids = torch.cat([ids, gpt.sample_next(step(ids), 0, None)], dim=1)
        made += 1
    return ids, made, time.perf_counter() - t0, time.process_time() - c0


@torch.no_grad()
def recompute_seconds(model, prompt_len: int, n: int, points: int = 5) -> float:
    """Estimated seconds of n recompute steps: step k runs a forward of prompt_len + k tokens."""
    lengths = [prompt_len + round(i * (n - 1) / (points - 1)) for i in range(points)]
    times = []
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            model(ids)[:, -1, :].argmax(-1)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    return float(np.interp(np.arange(prompt_len, prompt_len + n), lengths, times).sum())


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    p = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--budget", type=float, default=45.0, help="seconds per run (the recompute path stops there)")
    p.add_argument("--threads", type=int, default=1, help="1: on a shared machine 2 threads spin against other jobs")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    model = build(a.prompt_len + max(a.tokens))
    prompt = torch.randint(0, 8192, (1, a.prompt_len), generator=torch.Generator().manual_seed(0))
    decode(model, prompt, 8, True, a.budget)  # warm-up
    print(f"$ .venv/bin/python bench/bench_decode.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(f"train.py's default GPT, {sum(p.numel() for p in model.parameters()):,} parameters, fp32, batch 1, "
          f"prompt {a.prompt_len}, greedy, {a.threads} thread(s), torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    print("| tokens | KV cache: tokens/s (per CPU s) | recompute, measured: tokens/s (per CPU s) | recompute, whole run "
          "(estimated): tokens/s | KV cache / recompute | same tokens |")
    print("|---|---|---|---|---|---|")
    for n in a.tokens:
        cached, made_c, wall_c, cpu_c = decode(model, prompt, n, True, float("inf"))
        plain, made_p, wall_p, cpu_p = decode(model, prompt, n, False, a.budget)
        common = a.prompt_len + made_p
        same = "yes" if torch.equal(cached[:, :common], plain[:, :common]) else "NO"
        reached = "" if made_p == n else f"; first {made_p:,} of {n:,} in the {a.budget:.0f} s box"
        rc, rp, rw = made_c / wall_c, made_p / wall_p, n / recompute_seconds(model, a.prompt_len, n)
        print(f"| {n:,} | {rc:,.0f} ({made_c / cpu_c:,.0f}) | {rp:,.1f} ({made_p / cpu_p:,.1f}{reached}) | "
              f"{rw:,.1f} | {rc / rw:.0f}× | {same} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
