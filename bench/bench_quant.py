"""Weight-only quantization for serving (posttraining/quantization.py; serving/server.py --quantization): memory,
speed and quality of fp32, int8 and int4 (one scale per 128 input features) on the same model.

For each format the attention and MLP linears are quantized as the server does (quantization.quantize_linears), then:
  - bytes: of those linears' weights as stored (codes + scales), and of the whole model (parameters + buffers);
  - int4 and awq: one scale per --group input features (the server's 128 by default), codes in [-8, 7];
  - tokens/s: n requests arriving together (prompts of 16-64 random tokens, --new-tokens each, greedy) through one
    serve.Engine, the sampled tokens over the wall time (prefills included), for each --concurrency n;
  - awq (--formats, with --load): AWQ's scales searched on the run's first 16 training samples, then int4;
  - quality: with --load RUN, the validation loss of the run's own held-out documents (its --split, --seq-length,
    --eval-batches batches of 16); without, the largest logit difference from fp32 relative to fp32's largest logit,
    on 4 random sequences.
The model: train.py's default GPT (vocabulary 8192) with random weights, or --load RUN (checkpoint.load_model).

    .venv/bin/python bench/bench_quant.py --concurrency 1 8 --new-tokens 32
    .venv/bin/python bench/bench_quant.py --load runs/gpt --formats fp32 int8 int4 awq --concurrency 1
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import arguments  # noqa: E402
import checkpoint  # noqa: E402
import config  # noqa: E402
import data  # noqa: E402
from posttraining import quantization as Q  # noqa: E402
from serving import engine as serve  # noqa: E402


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    p = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    p.add_argument("--load", metavar="RUN", help="a saved run instead of the default GPT with random weights")
    p.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4"], choices=["fp32", "int8", "int4", "awq"],
                   help="awq (with --load): AWQ's scales (tools.awq_scaled), then int4")
    p.add_argument("--group", type=int, default=Q.GROUP, help="int4's and awq's input features a scale (the "
                   "server's: 128; tools.py export's AWQ: the largest power of 2 up to 128 dividing every linear)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests arriving together")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches of 16 (with --load)")
    p.add_argument("--data-cache-dir", default=None, help="the token cache (with --load; default: the run's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args(argv)


def build(a):
    """(model, validation dataset or None): a saved run with its held-out documents, or the default GPT, random."""
    if a.load is None:
        args = arguments.parse_args(["--vocab-size", "8192"])
        return config.model_file(args.model).Model(arguments.model_config(config.model_file(args.model), args)), None
    run = checkpoint.load_model(a.load)
    args = arguments.Args(**{**vars(run.args), **({"data_cache_dir": a.data_cache_dir} if a.data_cache_dir else {})})
    corpus = data.build_data(args, run.model_file.dataset, os.path.join(a.load, "tokenizer.json"), args.vocab_size)
    return run.model, corpus.valid


@torch.no_grad()
def quality(model, ref_logits, ids, valid, batches: int):
    if valid is None:
        return float((model(ids) - ref_logits).abs().max() / ref_logits.abs().max())
    total = 0.0
    for k in range(batches):
        batch = data.global_batch(valid, start=16 * k, size=16)
        total += float(model(batch[:, :-1], labels=batch[:, 1:]).mean())
    return total / batches


def tokens_per_s(model, n: int, new_tokens: int, vocab: int) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    engine = serve.Engine(model, num_blocks=n * -(-(64 + new_tokens) // 16), block_size=16, max_batch=n)
    for p in prompts:
        engine.add_request(p, serve.SamplingParams(max_tokens=new_tokens, temperature=0))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n * new_tokens / (time.perf_counter() - t0)


def main(argv=None):
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    base, valid = build(a)
    base.eval()
    vocab = base.config.vocab_size
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base(ids)
    what = "validation loss" if valid is not None else "logit error / largest fp32 logit"
    print(f"| format | linear weights (MiB) | whole model (MiB) | {what} | "
          + " | ".join(f"tokens/s at {n}" for n in a.concurrency) + " |")
    print("|---" * (4 + len(a.concurrency)) + "|")
    for fmt in a.formats:
        model = copy.deepcopy(base)
        if fmt == "awq":
            import tools
            model = tools.awq_scaled(checkpoint.load_model(a.load), a.load, group=a.group).eval()  # int4's groups
        if fmt != "fp32":
            Q.quantize_linears(model, "int4" if fmt == "awq" else fmt,
                               {**Q.SERVING, "int4": lambda w, shard=Q.WHOLE: Q.IntWeight(w, 4, a.group, shard)})
        whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        speeds = [tokens_per_s(model, n, a.new_tokens, vocab) for n in a.concurrency]
        print(f"| {fmt} | {Q.linear_weight_bytes(model) / 2**20:.2f} | {whole / 2**20:.2f} | "
              f"{quality(model, ref, ids, valid, a.eval_batches):{'.4f' if valid is not None else '.4g'}} | "
              + " | ".join(f"{s:.1f}" for s in speeds) + " |", flush=True)


if __name__ == "__main__":
    main()
