"""Training throughput, ours vs Hugging Face `transformers`, one process, fp32, same config, batch and weights.

A step is forward + backward + torch.optim.AdamW. Ours: the model's loss as train.py's recipe computes it (the SUM of
the per-token losses / their count, + BERT's binary loss); Hugging Face: `hf(..., labels=...).loss` (its means).
Our model is `<model>.from_hf(hf)`, so both start from the same weights. Rows: GPT-2 (GPT2LMHeadModel) and Llama
(LlamaForCausalLM) as gpt.py, BERT (BertForPreTraining) as bert.py, T5 (T5ForConditionalGeneration) as t5.py, Mamba-2
(Mamba2ForCausalLM, its torch path: no CUDA kernels) as mamba.py — at the shapes of train.py's defaults and each model
file's TRAIN_DEFAULTS where Hugging Face has the architecture (see SHAPES). Each row runs in a fresh process; its runs
are interleaved (ours, HF, ours, HF, ...) after a warm-up, and each side's median tokens/s over the rounds is reported
with the ratio ours / HF. Tokens: the b·s input tokens of a step (T5: the encoder's b·se, as train.py counts). On a
busy machine, `--threads 1 --clock cpu` times each run by this process's CPU time (time.process_time) instead of the
wall clock: with one thread no thread waits for another, so what the process computes is timed, not how long it waited
for a core (the ratio it gives is the one to compare; absolute tokens per CPU-second are not a wall-clock throughput).

    .venv/bin/python bench/bench_hf.py --rounds 9 --threads 2     (or --only ..., --clock cpu, --profile, --parts)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bert  # noqa: E402
import gpt  # noqa: E402
import mamba  # noqa: E402
import t5  # noqa: E402

V = 8192  # train.py's default vocabulary (its BPE)
# name -> (description, micro-batch, sequence length); train.py's defaults: 4 layers, h 256, 8 heads, 16 x 128
SHAPES = {
    "gpt2": ("GPT-2 shape: 6 layers, h 384, 6 heads, LayerNorm, gelu_tanh, biases, learned pos., tied", 8, 256),
    "llama": ("Llama default (train.py): 4 layers, h 256, 8 heads, SwiGLU 704, RMSNorm, RoPE, tied", 16, 128),
    "bert": ("BERT (bert.py): 4 layers, h 256, 8 heads, GeLU 1024, LayerNorm, biases, learned pos. (HF has no "
             "RoPE), tied, binary head; 1/8 of the rows padded", 16, 128),
    "t5": ("T5 (t5.py): 4 + 4 layers, h 256, 8 heads, SwiGLU 704, RMSNorm, relative buckets, untied lm_head; "
           "decoder 32", 16, 128),
    "mamba2": ("Mamba-2 (mamba.py's mixer): 4 Mamba layers (HF has no hybrid), h 256, 16 heads x 32, state 32, "
               "8 groups, chunk 64, untied", 16, 128),
}
T5_DECODER = 32  # t5.py's decoder length for 128-token rows: corrupted_lengths(129)[3] = 26, to a multiple of 8


def build_hf(which: str, seq: int):
    import transformers as tr
    torch.manual_seed(0)
    if which == "gpt2":
        cfg = tr.GPT2Config(vocab_size=V, n_positions=seq, n_embd=384, n_layer=6, n_head=6, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
        return tr.GPT2LMHeadModel(cfg)
    if which == "llama":
        cfg = tr.LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq,
                             tie_word_embeddings=True, attention_dropout=0.0)
        return tr.LlamaForCausalLM(cfg)
    if which == "bert":
        return tr.BertForPreTraining(tr.BertConfig(vocab_size=V, hidden_size=256, num_hidden_layers=4,
                                                   num_attention_heads=8, intermediate_size=1024,
                                                   max_position_embeddings=seq, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0, tie_word_embeddings=True))
    if which == "t5":
        return tr.T5ForConditionalGeneration(tr.T5Config(
            vocab_size=V, d_model=256, d_kv=32, d_ff=704, num_layers=4, num_decoder_layers=4, num_heads=8,
            dropout_rate=0.0, feed_forward_proj="gated-silu", tie_word_embeddings=False, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1))
    return tr.Mamba2ForCausalLM(tr.Mamba2Config(vocab_size=V, hidden_size=256, num_hidden_layers=4, state_size=32,
                                                head_dim=32, num_heads=16, expand=2, n_groups=8, chunk_size=64,
                                                tie_word_embeddings=False))


def steps(model, opt, loss_fn, n):
    loss = None  # (n = 0: --warmup 0)
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
    return loss


def losses(which: str, ours, hf, b: int, s: int):
    """(ours' loss_fn, HF's loss_fn) on the same random batch."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (b, s + 1), generator=g)
    if which == "bert":  # 15 % of the tokens are MLM targets; rows b/8.. padded after 3/4 of the sequence
        x, pad = ids[:, :-1].contiguous(), torch.ones(b, s, dtype=torch.long)
        pad[: max(1, b // 8), 3 * s // 4:] = 0
        types = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()
        masked = (torch.rand(b, s, generator=g) < 0.15) & (pad > 0)
        sop = torch.randint(0, 2, (b,), generator=g)
        hf_labels = x.masked_fill(~masked, -100)

        def ours_loss():
            lm, binary = ours(x, pad, types, lm_labels=x)  # per-token [b, s] (every position), binary [b, 2]
            return (lm * masked).sum() / masked.sum() + F.cross_entropy(binary, sop)
        return ours_loss, lambda: hf(input_ids=x, attention_mask=pad, token_type_ids=types, labels=hf_labels,
                                     next_sentence_label=sop).loss
    if which == "t5":
        enc, dec = ids[:, :-1].contiguous(), torch.randint(2, V, (b, T5_DECODER + 1), generator=g)
        dx, dy = dec[:, :-1].contiguous(), dec[:, 1:].contiguous()
        return (lambda: ours(enc, dx, lm_labels=dy).sum() / dy.numel(),
                lambda: hf(input_ids=enc, decoder_input_ids=dx, labels=dy).loss)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # ours: inputs and next-token labels
    # HF shifts its labels itself: the same s − 1 predictions per row plus one
    return lambda: ours(x, y).sum() / y.numel(), lambda: hf(input_ids=x, labels=x).loss


def bench(which: str, rounds: int, n: int, warmup: int, profile: bool, clock=time.perf_counter):
    desc, b, s = SHAPES[which]
    hf = build_hf(which, s).float().train()
    module = {"gpt2": gpt, "llama": gpt, "bert": bert, "t5": t5, "mamba2": mamba}[which]
    ours = module.from_hf(hf).train()
    ours_loss, hf_loss = losses(which, ours, hf, b, s)
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o_ours, o_hf = torch.optim.AdamW(ours.parameters(), **kw), torch.optim.AdamW(hf.parameters(), **kw)
    run = {"ours": lambda k: steps(ours, o_ours, ours_loss, k), "hf": lambda k: steps(hf, o_hf, hf_loss, k)}
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
            t0 = clock()
            f(n)
            tps[name].append(n * b * s / (clock() - t0))
    med = {k: statistics.median(v) for k, v in tps.items()}
    return desc, b, s, med, tps


def parts(rounds: int, clock):
    """The Llama row's layer 0, piece by piece (forward + backward of .sum()), ours vs HF on the same input: the
    attention block (QKV, RoPE, SDPA, output projection), the MLP, the whole layer, and the head (ours: logits + CE;
    HF: final norm + lm_head + CE). Medians in ms of `clock`."""
    hf = build_hf("llama", 128).float().train()
    ours = gpt.from_hf(hf).train()
    b, s, h = 16, 128, 256
    x = torch.randn(b, s, h, requires_grad=True)
    xs = x.detach().transpose(0, 1).contiguous().requires_grad_()  # ours: [s, b, h]
    rope, pe = ours.rope(s, None), hf.model.rotary_emb(x, torch.arange(s)[None])
    lo, lh = ours.decoder.layers[0], hf.model.layers[0]
    y = torch.randint(0, V, (b, s))
    cases = {
        "attention": (lambda: lo.self_attention(xs, rope=rope), lambda: lh.self_attn(x, pe, None)[0]),
        "MLP": (lambda: lo.mlp(xs), lambda: lh.mlp(x)),
        "layer": (lambda: lo(xs, rope=rope), lambda: lh(x, position_embeddings=pe)),
        "head": (lambda: ours.postprocess(xs, y),
                 lambda: F.cross_entropy(hf.lm_head(hf.model.norm(x)).view(-1, V), y.view(-1), reduction="none")),
    }
    print("\n| Llama layer 0, forward + backward | ours ms | HF ms | ours / HF (time) |\n|---|---|---|---|")
    for name, (fo, fh) in cases.items():
        t = {"ours": [], "hf": []}
        for r in range(rounds + 1):
            for k, f in (("ours", fo), ("hf", fh)):
                t0 = clock()
                out = f()
                (out[0] if isinstance(out, tuple) else out).sum().backward()
                if r:  # the first round warms up
                    t[k].append(1e3 * (clock() - t0))
        m = {k: statistics.median(v) for k, v in t.items()}
        print(f"| {name} | {m['ours']:.1f} | {m['hf']:.1f} | {m['ours'] / m['hf']:.2f} |", flush=True)


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=1, help="steps per timed run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="+", choices=list(SHAPES), default=None)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables (2 steps each) first")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: this process's CPU time (busy machine)")
    ap.add_argument("--parts", action="store_true", help="only time the Llama row's attention / MLP / layer / head")
    ap.add_argument("--row", choices=list(SHAPES), help=argparse.SUPPRESS)  # internal: run one row in this process
    return ap.parse_args(argv)


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    load = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print(f"command: {' '.join([os.path.relpath(sys.executable)] + sys.argv)}")
    print(f"machine: {cpu}, {os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{a.threads} threads, fp32, {a.clock} clock")
    print(f"load at start: {load()}")
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.parts:
        parts(3 * a.rounds, clock)
        print(f"load at end: {load()}")
        return
    if a.row:  # a child: one row, its result as a JSON line for the parent
        desc, b, s, med, tps = bench(a.row, a.rounds, a.steps, a.warmup, a.profile, clock)
        print(f"{a.row}: ours {[round(t) for t in tps['ours']]}  hf {[round(t) for t in tps['hf']]}", flush=True)
        print("ROW " + json.dumps([desc, b, s, med]))
        return
    # each row in a fresh process: one row's allocator state (glibc's heap, its mmap threshold) must not carry into
    # the next — the Llama row run after the GPT-2 row in one process measured 0.97×, alone 1.06-1.10×
    rows = []
    for which in (a.only or list(SHAPES)):
        child = subprocess.run([sys.executable, *sys.argv, "--row", which], capture_output=True, text=True)
        out = [ln for ln in child.stdout.splitlines() if not ln.startswith(("command:", "machine:", "load at"))]
        if child.returncode != 0 or not out or not out[-1].startswith("ROW "):
            sys.exit(f"bench_hf.py: the {which} row failed (exit {child.returncode}):\n{child.stderr[-2000:]}")
        print("\n".join(out[:-1]), flush=True)
        rows.append(json.loads(out[-1][4:]))
    print(f"load at end: {load()}")
    unit = "tokens per CPU-second" if a.clock == "cpu" else "tokens/s"
    print(f"\n{a.rounds} interleaved rounds of {a.steps} steps after {a.warmup} warm-up steps; medians, {unit}\n")
    print("| model | batch × seq | ours | Hugging Face | ours / HF |")
    print("|---|---|---|---|---|")
    for desc, b, s, med in rows:
        print(f"| {desc} | {b} × {s} | {med['ours']:,.0f} | {med['hf']:,.0f} | {med['ours'] / med['hf']:.2f}× |")


if __name__ == "__main__":
    main()
