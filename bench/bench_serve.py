"""Serving throughput, latency and KV memory: serving.engine.Engine (continuous batching, a paged KV cache) against the
same requests one after another through serving.engine.generate_one (a static KV cache) and, with --hf, transformers.

For each --concurrency n (default 1, 8, 32): n requests at time 0 (random tokens, --prompt-len lengths, --new-tokens
each, greedy), in one engine batch and in order. Columns: tokens/s over the load (prefills included); latency and TTFT
(to the last and first token: mean, p50, p90 nearest-rank; sequentially with the wait for earlier requests); KV memory
(paged blocks held at the peak against the smallest dense [n, max_len] cache; a Mamba model's state slots in both);
same tokens (greedy, fp32: the engine's equal generate_one's unless two logits tie to rounding). --engines gather
paged:2048: a row per engine (the gather path; serving/paged_attention.py, 2,048 tokens a step: chunked prefill).
--hf: the same prompts through Hugging Face generate (our model converted in memory as tools.py export does; one
left-padded batch, then one at a time; exactly --new-tokens each): tokens/s, the engine's ratio to each, and how many
requests got the engine's tokens. --rounds R: every run R times, round-robin, each by its run of median wall time.
The model is train.py's default GPT, random, fp32, its context the longest request;
--model-args changes its shape (train.py's flags); --load RUN serves a trained run (checkpoint.load_model).
Instead of the table: --soak N (N requests through one engine, max(--concurrency) running, twice that queued: the RSS
after each tenth); --system-prompt L (an L-token shared head, prefix caching off and on: tokens computed, wall time);
--attention-kernels (one mixed step's attention, max(--concurrency) − 1 decodes and a prompt, by each mechanism from
one block pool: gather, serving/paged_attention.py, an SDPA per request, a padded batch, --flex's compiled
flex_attention: ms a step, largest difference from gather); --speculative K (greedy requests without and with K drafts
a step, --draft layers:N, mtp or a run, twice in turn: the better tokens/s, acceptance, tokens a step, same tokens).

    .venv/bin/python bench/bench_serve.py --concurrency 1 8 --new-tokens 16 --prompt-len 16 32        (~1 min)
    .venv/bin/python bench/bench_serve.py        (the full table: 1, 8, 32 requests of 16-128 + 64 tokens)
    .venv/bin/python bench/bench_serve.py --concurrency 1 64 --hf        (beside Hugging Face generate)
    .venv/bin/python bench/bench_serve.py --attention-kernels --concurrency 64        (~1 min)
    .venv/bin/python bench/bench_serve.py --speculative 3 --concurrency 8 --new-tokens 32        (~1 min)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import arguments  # noqa: E402
import checkpoint  # noqa: E402
import config  # noqa: E402
from serving import engine as serve  # noqa: E402
from serving import speculative  # noqa: E402


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    p = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests arriving together")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    p.add_argument("--model-args", default="", help='train.py flags for the random model, e.g. "--num-layers 2"')
    p.add_argument("--load", metavar="RUN", help="a saved run (checkpoint.load_model) instead of a random model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--soak", type=int, metavar="N", help="N requests through one engine, RSS after each tenth")
    p.add_argument("--system-prompt", type=int, metavar="L", help="a shared L-token head: prefix caching on and off")
    p.add_argument("--engines", nargs="+", default=["paged"], metavar="ATTENTION[:BUDGET]", help="engines to run, "
                   "each a row, on the same prompts: paged (serving/paged_attention.py) or gather (the plain path), "
                   "with :N a per-step token budget (max_num_batched_tokens: chunked prefill), e.g. gather paged:2048")
    p.add_argument("--attention-kernels", action="store_true", help="instead: one mixed step's attention, each "
                   "torch mechanism, timed")
    p.add_argument("--speculative", type=int, metavar="K", help="instead: without and with speculative decoding, K "
                   "drafts a step")
    p.add_argument("--draft", default="layers:1", help="--speculative's drafter: layers:N (the model's embedding, "
                   "first N layers and output layer), mtp (its MTP layer), or a saved run")
    p.add_argument("--repeats", type=int, default=5, help="--attention-kernels: timed runs of each (the median)")
    p.add_argument("--rounds", type=int, default=1, help="the main table: each run (sequential, HF, every engine) "
                   "this many times, round-robin, each reported by its run of median wall time")
    p.add_argument("--hf", action="store_true", help="the main table: the same prompts through transformers too (the "
                   "model converted as tools.py export does): one left-padded batch, and one prompt at a time")
    p.add_argument("--flex", action="store_true", help="--attention-kernels: flex_attention too (compiled by "
                   "torch.compile: minutes on a CPU)")
    return p.parse_args(argv)


def build(a, max_len: int):
    """The model to serve, in eval mode on a.device: a trained run (--load) or train.py's default GPT, random."""
    if a.load:
        model = checkpoint.load_model(a.load).model
        if model.config.max_position_embeddings < max_len:
            raise SystemExit(f"bench_serve.py: error: --load {a.load}: its context max_position_embeddings="
                             f"{model.config.max_position_embeddings} < the longest request ({max_len} positions)")
    else:
        args = arguments.parse_args(["--vocab-size", "8192", *shlex.split(a.model_args),
                                     "--max-position-embeddings", str(max_len)])
        model = config.model_file(args.model).Model(arguments.model_config(config.model_file(args.model), args))
    return model.to(a.device).eval()


def requests(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """n prompts of uniform random lengths in [lengths] and random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def summary(latencies: list[float]) -> tuple[float, float, float]:
    """(mean, p50, p90) with nearest-rank percentiles: the smallest value with at least p % of them at or below."""
    s = sorted(latencies)
    rank = lambda p: s[max(math.ceil(p / 100 * len(s)), 1) - 1]
    return sum(s) / len(s), rank(50), rank(90)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(model, prompts, new_tokens: int, block_size: int, attention="paged", budget=None):
    """All prompts at once through one Engine: (tokens per request, latencies s, wall s, peak blocks, engine, times
    to first token s)."""
    params = serve.SamplingParams(max_tokens=new_tokens, temperature=0)
    blocks = sum(math.ceil((len(p) + new_tokens - 1) / block_size) for p in prompts)  # every worst case at once
    engine = serve.Engine(model, num_blocks=blocks, block_size=block_size, max_batch=len(prompts),
                          max_num_batched_tokens=budget, attention=attention)
    reqs = [engine.requests[engine.add_request(p, params)] for p in prompts]
    peak, done, first = 0, {}, {}
    allocate = engine.cache.allocate

    def tracked(n):  # the blocks held right after each allocation: their maximum is the peak
        nonlocal peak
        out = allocate(n)
        peak = max(peak, engine.cache.num_blocks - len(engine.cache.free))
        return out
    engine.cache.allocate = tracked
    sync(engine.device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for r in engine.step():
            if r.output and r.id not in first:
                first[r.id] = time.perf_counter() - t0
            if r.finish_reason is not None:
                done[r.id] = time.perf_counter() - t0
    sync(engine.device)
    wall = time.perf_counter() - t0
    return [r.output for r in reqs], [done[r.id] for r in reqs], wall, peak, engine, [first[r.id] for r in reqs]


def run_sequential(model, prompts, new_tokens: int):
    """The prompts one after another through generate_one: (tokens per request, latencies s, wall s)."""
    params = serve.SamplingParams(max_tokens=new_tokens, temperature=0)
    out, latencies, t0 = [], [], time.perf_counter()
    for p in prompts:
        out.append(serve.generate_one(model, p, params))
        latencies.append(time.perf_counter() - t0)
    return out, latencies, time.perf_counter() - t0


def hf_model(a, model):
    """Our model as transformers' class, in memory, converted as tools.py export converts it: an imported run's own
    folder layout (interop/hf.py export_state), else the model file's to_hf (GPT-2, Llama, Mixtral); fp32, eval.
    Generation ends only at max_new_tokens (no eos: exactly --new-tokens each, as the engine's requests)."""
    import transformers

    from interop import hf

    if a.load:
        run = checkpoint.load_model(a.load, build=False)
        arch, mf = run.args.hf_architecture, run.model_file
    else:
        args = arguments.parse_args(["--vocab-size", "8192", *shlex.split(a.model_args)])
        arch, mf = None, config.model_file(args.model)
    full = {k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    if arch:
        hc, state = arch["config"], hf.export_state(arch, full, torch.float32)[0]
    elif mf.to_hf is None:
        raise SystemExit(f"bench_serve.py: error: --hf: --model {mf.name} has no Hugging Face export here")
    else:
        hc, state = mf.to_hf(model.config, full)
    hc = {k: v for k, v in hc.items() if k not in ("dtype", "torch_dtype")}
    out = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hc), dtype=torch.float32)
    missing, unexpected = out.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if out.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise SystemExit(f"bench_serve.py: error: --hf: the export does not fill {out.__class__.__name__}: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    out.tie_weights()
    out.generation_config.update(eos_token_id=None, bos_token_id=None, pad_token_id=0, do_sample=False)
    return out.to(a.device).eval()


@torch.no_grad()
def run_hf(hf_model, prompts, new_tokens: int, left: bool = True):
    """The prompts as one padded batch through transformers' greedy generate, the padding on the left (on the right:
    the negative control, new tokens after padding): (tokens per request, wall s)."""
    device, L = next(hf_model.parameters()).device, max(len(p) for p in prompts)
    pad = lambda p, x: [x] * (L - len(p)) + p if left else p + [x] * (L - len(p))
    ids = torch.tensor([pad(p, 0) for p in prompts], device=device)
    mask = torch.tensor([pad([1] * len(p), 0) for p in prompts], device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, use_cache=True)
    sync(device)
    return [row[L:].tolist() for row in out], time.perf_counter() - t0


def run_hf_sequential(hf_model, prompts, new_tokens: int):
    """The prompts one after another through transformers' generate, unpadded: (tokens per request, wall s)."""
    out, t0 = [], time.perf_counter()
    for p in prompts:
        out += run_hf(hf_model, [p], new_tokens)[0]
    return out, time.perf_counter() - t0


def by_median(results: list[tuple], at: int) -> tuple:
    """Of a run's rounds, the one whose wall time (each result's item `at`) is the median (the lower of two middles)."""
    return sorted(results, key=lambda r: r[at])[(len(results) - 1) // 2]


def kv_bytes(engine) -> tuple[int, int]:
    """(bytes of one block across every attention layer's K and V pools, bytes of all recurrent state slots)."""
    block = sum(t[0].numel() * t.element_size() for pools in engine.cache.pools.values() for t in pools)
    states = sum(t.numel() * t.element_size() for ts in engine.cache.states.values() for t in ts)
    return block, states


def memory(engine, prompts, peak: int, new_tokens: int) -> tuple[int, int]:
    """(paged bytes: the peak blocks × a block's bytes, dense bytes: [n, max_len] positions), state slots in both."""
    block, states = kv_bytes(engine)
    max_len = max(len(p) + new_tokens for p in prompts)
    return peak * block + states, len(prompts) * max_len * block // engine.cache.block_size + states


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(model, a):
    """a.soak requests through one Engine, kept busy (max(a.concurrency) running, as many again queued): the RSS
    after each tenth have finished."""
    n, batch, rng = a.soak, max(a.concurrency), random.Random(a.seed)
    engine = serve.Engine(model, batch * math.ceil((a.prompt_len[1] + a.new_tokens) / a.block_size), a.block_size,
                          batch)
    added = done = 0
    marks, t0 = [], time.perf_counter()
    while done < n:
        while added < n and len(engine.requests) < 2 * batch:
            prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(*a.prompt_len))]
            engine.add_request(prompt, serve.SamplingParams(max_tokens=a.new_tokens, temperature=1.0, seed=added))
            added += 1
        for r in engine.step():
            done += r.finish_reason is not None
            if r.finish_reason is not None and done % max(n // 10, 1) == 0:
                marks.append(rss_mib())
                print(f"| {done:,} | {rss_mib():,.1f} MiB | {time.perf_counter() - t0:,.1f} s |", flush=True)
    print(f"RSS after {n:,} requests / after the first {max(n // 10, 1):,}: {marks[-1] / marks[0]:.4f} "
          f"(engine: {len(engine.requests)} requests held, {len(engine.cache.free)} of {engine.cache.num_blocks} "
          "blocks free)")


def shared_head(model, a):
    """max(a.concurrency) greedy requests, a shared a.system_prompt-token head then their own prompts: the first one
    alone, then the rest; with and without prefix caching: (tokens computed, tokens from the cache, wall s, tokens)."""
    n, rng = max(a.concurrency), random.Random(a.seed)
    head = [rng.randrange(model.config.vocab_size) for _ in range(a.system_prompt)]
    prompts = [head + p for p in requests(n, tuple(a.prompt_len), model.config.vocab_size, a.seed + 1)]
    params = serve.SamplingParams(max_tokens=a.new_tokens, temperature=0)
    rows = []
    for caching in (False, True):
        engine = serve.Engine(model, n * math.ceil((len(max(prompts, key=len)) + a.new_tokens) / a.block_size),
                              a.block_size, n, prefix_caching=caching)
        sync(engine.device)
        t0 = time.perf_counter()
        reqs = [engine.requests[engine.add_request(prompts[0], params)]]
        engine.step()
        reqs += [engine.requests[engine.add_request(p, params)] for p in prompts[1:]]
        engine.run()
        sync(engine.device)
        rows.append((engine.computed, engine.reused, time.perf_counter() - t0, [r.output for r in reqs]))
    return rows


def drafter(model, draft: str, k: int) -> speculative.Drafter:
    """--draft's drafter: the model's MTP layer, its first N layers (early exit: its final norm and output layer
    after them, their weights), or a saved run."""
    if draft == "mtp":
        return speculative.MTP(model, k)
    if draft.startswith("layers:"):
        small = type(model)(dataclasses.replace(model.config, num_layers=int(draft[7:]), mtp_num_layers=None))
        small.load_state_dict({n: w for n, w in model.state_dict().items() if n in small.state_dict()})
        return speculative.DraftModel(small.to(next(model.parameters()).device), k)
    return speculative.DraftModel(checkpoint.load_model(draft).model.to(next(model.parameters()).device), k)


def speculation(model, a):
    """max(a.concurrency) greedy requests through one engine, without and with a.speculative drafts a step, twice in
    turn: [(the better tokens/s, tokens, the drafter or None)] without, with."""
    n = max(a.concurrency)
    prompts = requests(n, tuple(a.prompt_len), model.config.vocab_size, a.seed + n)
    params, rows = serve.SamplingParams(max_tokens=a.new_tokens, temperature=0), [(0, None, None), (0, None, None)]
    for i in (0, 1, 0, 1):
        spec = drafter(model, a.draft, a.speculative) if i else None
        engine = serve.Engine(model, sum(math.ceil((len(p) + a.new_tokens) / a.block_size) for p in prompts),
                              a.block_size, n, speculator=spec)
        reqs = [engine.requests[engine.add_request(p, params)] for p in prompts]
        sync(engine.device)
        t0 = time.perf_counter()
        engine.run()
        sync(engine.device)
        rows[i] = (max(rows[i][0], n * a.new_tokens / (time.perf_counter() - t0)), [r.output for r in reqs], spec)
    return rows


def kernels(model, a):
    """One mixed step's attention through every layer, each torch mechanism, from the same pool: max(--concurrency)
    − 1 decodes (cached lengths drawn from --prompt-len) and one prompt of the longest length; the paged cache's
    plan (each mechanism's own per-step indexing) included. Rows: (mechanism, median ms, max |difference| from the
    gather path)."""
    c, rng, B = model.config, random.Random(a.seed), a.block_size
    n, g, d, L = c.num_attention_heads, c.num_query_groups, c.kv_channels, c.num_layers
    shapes = [(rng.randint(*a.prompt_len), 1) for _ in range(max(a.concurrency) - 1)] + [(0, a.prompt_len[1])]
    N = sum(math.ceil((cached + t) / B) for cached, t in shapes)
    reqs, free, scale = [], random.Random(a.seed).sample(range(N), N), 1 / math.sqrt(d)
    for i, (cached, t) in enumerate(shapes):
        r = serve.Request(i, [0] * (cached + t), serve.SamplingParams(), None, cached=cached)
        r.blocks = [free.pop() for _ in range(math.ceil((cached + t) / B))]
        reqs.append(r)
    counts, T = [t for _, t in shapes], sum(t for _, t in shapes)
    q, k, v = (torch.randn(1, h, T, d, device=a.device) for h in (n, g, g))
    pools = [(torch.randn(N, g, B, d, device=a.device), torch.randn(N, g, B, d, device=a.device)) for _ in range(L)]
    F = torch.nn.functional

    def cache(attention):
        out = serve.PagedKVCache(N, B, attention=attention)
        out.pools = dict(enumerate(pools))
        return out
    gather_cache, paged_cache, loop_cache = cache("gather"), cache("paged"), cache("paged")

    def gather():  # serving/engine.py's plain path: every key read gathered, a block-diagonal [T, K] mask
        _, mask = gather_cache.plan(reqs, counts, a.device)
        return [F.scaled_dot_product_attention(q, *gather_cache.append(i, k, v), attn_mask=mask[None, None],
                                               scale=scale, enable_gqa=g != n) for i in range(L)]

    def paged():  # serving/paged_attention.py
        paged_cache.plan(reqs, counts, a.device)
        return [paged_cache.attend(i, q, k, v, scale) for i in range(L)]

    def per_request():  # one SDPA per request over its own blocks (varlen attention as a loop)
        loop_cache.plan(reqs, counts, a.device)
        out = []
        for i in range(L):
            K, V = loop_cache.pool(i, k, v)
            rows, start = [], 0
            for r, t in zip(reqs, counts):
                blocks = torch.tensor(r.blocks, device=a.device)
                kk, vv = (P[blocks].transpose(0, 1).reshape(1, g, -1, d)[:, :, :r.cached + t] for P in (K, V))
                mask = torch.ones(t, r.cached + t, dtype=torch.bool, device=a.device).tril(r.cached)
                rows.append(F.scaled_dot_product_attention(q[:, :, start:start + t], kk, vv, attn_mask=mask,
                                                           scale=scale, enable_gqa=g != n))
                start += t
            out.append(torch.cat(rows, 2))
        return out

    def padded():  # one batch padded to the longest request, a [R, 1, max_t, max_len] mask
        loop_cache.plan(reqs, counts, a.device)
        nb, mt = max(len(r.blocks) for r in reqs), max(counts)
        table = torch.tensor([r.blocks + [0] * (nb - len(r.blocks)) for r in reqs], device=a.device)
        starts = [0] + torch.tensor(counts).cumsum(0).tolist()
        pos = torch.tensor([[r.cached + min(j, t - 1) for j in range(mt)] for r, t in zip(reqs, counts)],
                           device=a.device)  # [R, mt] each row's query positions (padding: its last)
        mask = (torch.arange(nb * B, device=a.device) <= pos[..., None])[:, None]  # [R, 1, mt, nb·B]
        qi = torch.tensor([[starts[r] + min(j, t - 1) for j in range(mt)] for r, t in enumerate(counts)],
                          device=a.device)
        out = []
        for i in range(L):
            K, V = loop_cache.pool(i, k, v)
            kk, vv = (P[table].permute(0, 2, 1, 3, 4).reshape(len(reqs), g, nb * B, d) for P in (K, V))
            o = F.scaled_dot_product_attention(q[0][:, qi].transpose(0, 1), kk, vv, attn_mask=mask, scale=scale,
                                               enable_gqa=g != n)  # [R, n, mt, d]
            out.append(torch.cat([o[r, :, :t] for r, t in enumerate(counts)], 1)[None])
        return out

    mechanisms = {"gather (the plain path: gathered keys, a [T, K] mask)": gather,
                  "paged (serving/paged_attention.py)": paged, "per-request SDPA over its blocks": per_request,
                  "one padded batch (SDPA, [R, max_t, max_len] mask)": padded}
    ref = gather()  # (this step's keys and values now in the pool)
    try:  # flex_attention over the pool laid out [1, g, N·B, d], its block mask from the tables (compiled: C++)
        if not a.flex:
            raise RuntimeError("not asked (--flex)")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        owner, start = torch.full((N,), -1, device=a.device), torch.zeros(N, dtype=torch.long, device=a.device)
        for r in reqs:
            owner[r.blocks], start[r.blocks] = r.id, torch.arange(len(r.blocks), device=a.device) * B
        q_owner = torch.repeat_interleave(torch.arange(len(reqs), device=a.device), torch.tensor(counts, device=a.device))
        q_pos = torch.cat([torch.arange(t, device=a.device) + r.cached for r, t in zip(reqs, counts)])
        mask_mod = lambda b, h, qi, ki: (owner[ki // B] == q_owner[qi]) & (start[ki // B] + ki % B <= q_pos[qi])
        flat = [tuple(P.permute(1, 0, 2, 3).reshape(1, g, N * B, d) for P in pp) for pp in pools]
        compiled = torch.compile(flex_attention, dynamic=False)
        t0 = time.perf_counter()
        block_mask = create_block_mask(mask_mod, None, None, T, N * B, device=a.device, BLOCK_SIZE=(128, B))
        mask_s = time.perf_counter() - t0

        def flex():
            return [compiled(q, K, V, block_mask=block_mask, scale=scale, enable_gqa=g != n) for K, V in flat]
        flex()  # (compiles)
        mechanisms[f"flex_attention, compiled (its block mask: {mask_s:.1f} s a step, not counted)"] = flex
    except Exception as e:  # (no C++ compiler, or no kernel for this device)
        print(f"flex_attention: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    outs, times = {name: fn() for name, fn in mechanisms.items()}, {name: [] for name in mechanisms}
    for _ in range(a.repeats):  # round-robin: a burst of load on the machine falls on every mechanism alike
        for name, fn in mechanisms.items():
            sync(a.device)
            t0 = time.perf_counter()
            fn()
            sync(a.device)
            times[name].append(time.perf_counter() - t0)
    return [(name, sorted(times[name])[len(times[name]) // 2] * 1e3,
             max(float((x - y).abs().max()) for x, y in zip(outs[name], ref))) for name in mechanisms], shapes


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def main(argv=None):
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    max_len = a.prompt_len[1] + a.new_tokens + (a.system_prompt or 0)
    model = build(a, max_len)
    vocab = model.config.vocab_size
    run_engine(model, requests(2, tuple(a.prompt_len), vocab, a.seed + 1), min(a.new_tokens, 4), a.block_size)  # warm-up
    print(f"$ .venv/bin/python bench/bench_serve.py {shlex.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    if a.soak:
        print("| requests finished | RSS | wall |\n|---|---|---|")
        return soak(model, a)
    if a.system_prompt:
        (off, _, t_off, out_off), (on, reused, t_on, out_on) = shared_head(model, a)
        decode = max(a.concurrency) * (a.new_tokens - 1)  # the decode steps' tokens, the same in both
        print(f"{max(a.concurrency)} requests, a {a.system_prompt}-token head shared: prefill tokens computed "
              f"{off - decode:,} without prefix caching, {on - decode:,} with ({reused:,} from the cache): "
              f"{(off - decode) / (on - decode):.2f}× fewer; wall {t_off:.2f} s -> {t_on:.2f} s ({t_off / t_on:.2f}×); "
              f"same tokens: {'yes' if out_on == out_off else 'NO'}")
        return
    if a.speculative:
        (plain, want, _), (fast, got, spec) = speculation(model, a)
        st = spec.stats()
        print(f"{max(a.concurrency)} greedy requests, {a.new_tokens} new tokens, {torch.get_num_threads()} thread(s), "
              f"load average {os.getloadavg()[0]:.1f}")
        print("| drafter | K | tokens/s without | tokens/s with | speed-up | acceptance rate | tokens a verifying step "
              "| same tokens |\n|---|---|---|---|---|---|---|---|")
        print(f"| {a.draft} | {a.speculative} | {plain:,.1f} | {fast:,.1f} | {fast / plain:.2f}× | "
              f"{st['acceptance_rate']:.1%} | {st['tokens_per_step']:.2f} | {'yes' if got == want else 'NO'} |")
        return
    if a.attention_kernels:
        rows, shapes = kernels(model, a)
        print(f"one step's attention, {model.config.num_layers} layers: {len(shapes) - 1} decodes after "
              f"{a.prompt_len[0]}-{a.prompt_len[1]} cached positions and a {a.prompt_len[1]}-token prompt, "
              f"{model.config.num_attention_heads} heads of {model.config.kv_channels}, blocks of {a.block_size}, "
              f"fp32, {a.device}, {torch.get_num_threads()} thread(s), median of {a.repeats} (round-robin), load average "
              f"{os.getloadavg()[0]:.1f}")
        print("| mechanism | ms a step | × the gather path's time | max abs difference |\n|---|---|---|---|")
        for name, ms, diff in rows:
            print(f"| {name} | {ms:,.2f} | {ms / rows[0][1]:.2f} | {diff:.1e} |")
        return
    what = f"--load {a.load}" if a.load else "train.py's default GPT" + (f" ({a.model_args})" if a.model_args else "")
    print(f"{what}, {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{next(model.parameters()).dtype}, {a.device}, prompts {a.prompt_len[0]}-{a.prompt_len[1]} tokens, "
          f"{a.new_tokens} new tokens, greedy, KV blocks of {a.block_size}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} at the start")
    print("| requests | engine | engine tokens/s | sequential tokens/s | speed-up | engine latency mean / p50 / p90 (s) | "
          "engine TTFT mean / p50 / p90 (s) | sequential latency mean / p50 / p90 (s) | paged KV at peak | "
          "dense KV [n, max_len] | paged / dense | same tokens |" + (" HF batch tokens/s | HF sequential tokens/s | "
          "engine / HF batch | engine / HF sequential | same tokens as HF (batch, sequential) |" if a.hf else ""))
    print("|---" * (17 if a.hf else 12) + "|")
    hf = hf_model(a, model) if a.hf else None
    if hf is not None:
        run_hf(hf, requests(2, tuple(a.prompt_len), vocab, a.seed + 1), min(a.new_tokens, 4))  # warm-up
    for n in a.concurrency:
        prompts = requests(n, tuple(a.prompt_len), vocab, a.seed + n)
        runs = {}  # what -> its rounds' results, each with its wall time
        for _ in range(a.rounds):  # round-robin: a burst of load on the machine falls on every run alike
            runs.setdefault("seq", []).append(run_sequential(model, prompts, a.new_tokens))
            if hf is not None:
                runs.setdefault("hf", []).append(run_hf(hf, prompts, a.new_tokens))
                runs.setdefault("hfs", []).append(run_hf_sequential(hf, prompts, a.new_tokens))
            for spec in a.engines:
                attention, _, budget = spec.partition(":")
                runs.setdefault(spec, []).append(run_engine(model, prompts, a.new_tokens, a.block_size, attention,
                                                            int(budget) if budget else None))
        pick = {k: by_median(v, {"seq": 2, "hf": 1, "hfs": 1}.get(k, 2)) for k, v in runs.items()}  # (wall's place)
        seq_tokens, seq_lat, seq_wall = pick["seq"]
        for spec in a.engines:
            tokens, lat, wall, peak, engine, ttft = pick[spec]
            paged, dense = memory(engine, prompts, peak, a.new_tokens)
            rate, seq_rate = n * a.new_tokens / wall, n * a.new_tokens / seq_wall
            fmt = lambda s: " / ".join(f"{x:.3f}" for x in summary(s))
            print(f"| {n} | {spec} | {rate:,.1f} | {seq_rate:,.1f} | {rate / seq_rate:.2f}× | {fmt(lat)} | {fmt(ttft)} | "
                  f"{fmt(seq_lat)} | {mib(paged)} ({peak} blocks) | {mib(dense)} | {paged / dense:.2f} | "
                  f"{'yes' if all(r[0] == seq_tokens for r in runs[spec]) else 'NO'} |", end="")
            if hf is not None:
                (hf_tokens, hf_wall), (hfs_tokens, hfs_wall) = pick["hf"], pick["hfs"]
                same = lambda got: f"{sum(x == y for x, y in zip(got, tokens))}/{n}"
                hf_rate, hfs_rate = n * a.new_tokens / hf_wall, n * a.new_tokens / hfs_wall
                print(f" {hf_rate:,.1f} | {hfs_rate:,.1f} | {rate / hf_rate:.2f}× | {rate / hfs_rate:.2f}× | "
                      f"{same(hf_tokens)}, {same(hfs_tokens)} |", end="")
            print(flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
