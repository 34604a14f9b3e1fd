"""Training throughput, ours vs Hugging Face `transformers`, one process, fp32, same config, batch and weights.

A step is forward + backward + torch.optim.AdamW. Ours: `loss = model(ids, labels).sum() / ntokens` (the per-token
loss of train.py's recipe); Hugging Face: `hf(input_ids=ids, labels=ids).loss` (its mean over the shifted tokens).
Our model is `gpt.from_hf(hf)`, so both start from the same weights. Runs are interleaved (ours, HF, ours, HF, ...)
after a warm-up, and each side's median tokens/s over the rounds is reported with the ratio ours / HF.

    .venv/bin/python bench/bench_hf.py [--rounds 5] [--steps 2] [--threads 2] [--only gpt2|llama] [--profile]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import gpt  # noqa: E402

# name -> (description, micro-batch, sequence length)
SHAPES = {
    "gpt2": ("GPT-2 shape: 6 layers, h 384, 6 heads, LayerNorm, gelu_tanh, biases, learned pos., tied", 8, 256),
    "llama": ("Llama default (train.py): 4 layers, h 256, 8 heads, SwiGLU 704, RMSNorm, RoPE, tied", 16, 128),
}


def build_hf(which: str, seq: int):
    import transformers as tr
    torch.manual_seed(0)
    if which == "gpt2":
        cfg = tr.GPT2Config(vocab_size=8192, n_positions=seq, n_embd=384, n_layer=6, n_head=6, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return tr.GPT2LMHeadModel(cfg)
    cfg = tr.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq,
                         tie_word_embeddings=True, attention_dropout=0.0)
    return tr.LlamaForCausalLM(cfg)


def steps_ours(model, opt, ids, labels, n):
    ntok = labels.numel()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels).sum() / ntok
        loss.backward()
        opt.step()
    return loss


def steps_hf(model, opt, ids, n):
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
    return loss


def bench(which: str, rounds: int, steps: int, warmup: int, profile: bool):
    desc, b, s = SHAPES[which]
    hf = build_hf(which, s).float().train()
    ours = gpt.from_hf(hf).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8192, (b, s + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # ours: inputs and next-token labels
    hx = ids[:, :-1].contiguous()  # HF shifts its labels itself: the same s − 1 predictions per row plus one
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o_ours, o_hf = torch.optim.AdamW(ours.parameters(), **kw), torch.optim.AdamW(hf.parameters(), **kw)
    run = {"ours": lambda n: steps_ours(ours, o_ours, x, y, n), "hf": lambda n: steps_hf(hf, o_hf, hx, n)}
    for f in run.values():
        f(warmup)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof
        for name, f in run.items():
            with prof(activities=[ProfilerActivity.CPU]) as p:
                f(2)
            print(f"\n### profile {which} {name} (2 steps)")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    tps = {"ours": [], "hf": []}
    for _ in range(rounds):
        for name, f in run.items():
            t0 = time.perf_counter()
            f(steps)
            tps[name].append(steps * b * s / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in tps.items()}
    return desc, b, s, med, tps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=list(SHAPES), default=None)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables (2 steps each) first")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print(f"command: {' '.join([os.path.relpath(sys.executable)] + sys.argv)}")
    print(f"machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{a.threads} threads, fp32")
    print(f"load at start: {load()}")
    rows = []
    for which in ([a.only] if a.only else list(SHAPES)):
        desc, b, s, med, tps = bench(which, a.rounds, a.steps, a.warmup, a.profile)
        rows.append((desc, b, s, med))
        print(f"{which}: ours {[round(t) for t in tps['ours']]}  hf {[round(t) for t in tps['hf']]}", flush=True)
    print(f"load at end: {load()}")
    print(f"\n{a.rounds} interleaved rounds of {a.steps} steps after {a.warmup} warm-up steps; medians, tokens/s\n")
    print("| model | batch × seq | ours | Hugging Face | ours / HF |")
    print("|---|---|---|---|---|")
    for desc, b, s, med in rows:
        print(f"| {desc} | {b} × {s} | {med['ours']:,.0f} | {med['hf']:,.0f} | {med['ours'] / med['hf']:.2f}× |")


if __name__ == "__main__":
    main()
