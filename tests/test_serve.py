"""serving/engine.py's engine (the paged KV cache and continuous batching) against gpt.generate, the sequential oracle.

  - greedy: every request of a continuously batched run — random prompt lengths, random arrival steps, different
    max_tokens and a stop id, so requests join and leave at different steps — is the token sequence
    gpt.generate(use_cache=False) gives it alone; GPT with learned positions (MHA), Llama-style GQA with RoPE, and
    multi-latent attention (deepseek.py: its pool holds each head's whole key and value, of different widths);
  - sampled with a seed (temperature, top-k, top-p): each request's tokens are those it gets run alone through the
    engine (batch-composition independence: each request draws from its own generator), and those of
    serve.generate_one, the sequential oracle (the static KV cache, one request);
  - the pool never grows, freed blocks are reused, every block is free or held by exactly one running request at
    every step, and all are free at the end;
  - an aborted request (a client gone) leaves the batch and frees its blocks; the others finish unchanged;
  - negative controls: a block table that shares a live block with another request makes the greedy comparison
    fail, and the block invariant too; a request longer than the context or than the pool is refused by number,
    an input the model's forward does not take (pixel_values for a GPT) by name;
  - negative control: requests drawing from one shared generator fail the batch-independence check;
  - gpt.Model.forward checks explicit positions, not a packed row's length, against its learned-position table;
  - Mamba hybrids: attention layers in the paged cache, Mamba layers' (conv, ssm) states in a slot per running
    request (PagedKVCache.recurrent): greedy tokens of a continuously batched run equal the full recompute's,
    mamba.generate's alone and generate_one's; seeded sampling is batch-independent; every slot is free or held by
    one running request; an aborted request's slot is reused from a zero state; negative control: two requests
    sharing a slot fail the comparison and the slot invariant;
  - LLaVA: a request's image (add_request(..., pixel_values=)) goes with its prompt; two image prefills in one step
    are stacked in the row's order: greedy tokens equal the whole forward's (recomputed each step, learned positions
    and RoPE) and generate_one's; negative control: the row's images in reverse order fail the comparison;
  - top-p keeps the smallest set of tokens whose probability reaches p (exact dyadic probabilities); top-k the k
    largest logits (hand-built); admission counts the blocks promised to running requests (a workload that
    overfills the pool otherwise); nothing of a request is kept once it ends (no Request alive, pool all free);
  - preemption (preempt=True, vLLM's recompute mode): in a pool too small for the running requests, the newest are
    preempted and recomputed: greedy tokens are the oracle's, seeded sampled ones generate_one's (Llama and a Mamba
    hybrid); negative control: recomputing from the prompt alone (the sampled tokens' keys lost) fails;
  - prefix caching: a shared system prompt's full blocks are computed once (the exact tokens saved counted), cached
    blocks are evicted least recently used first in a small pool, the block counts right at every step, the tokens
    the oracle's; a model with recurrent layers is refused by name; negative control: blocks cached under their own
    tokens (not the whole prefix) fail;
  - logprobs (N = 0..20 per request): the engine's equal generate_one's and the log_softmax of the whole sequence's
    forward (TOL32, float32); a value outside 0..20 is refused; negative control: logprobs of the tempered logits.
Tolerance: tokens are compared exactly; the logits each token was sampled from, 1e-10 relative to the whole
sequence's forward in float64 (they differ only in the order of float64 sums: the packed row's matmuls have other
shapes; measured <= 3e-15). The random weights (init std 0.5, as tests/test_kv_cache.py's) keep greedy decoding
from repeating one token, so the comparison means something.
"""
from __future__ import annotations

import collections
import random

import pytest
import torch
from test_kv_cache import GPT, HYBRID, LLAMA, MLA

import gpt
import llava
import mamba
from equivalence import rel_err
from serving import engine as serve

CONTEXT = 24  # the configs' max_position_embeddings


def workload(seed=0, n=6):
    """n requests: (arrival step, prompt ids, max_tokens), prompts of 1-9 tokens, 1-12 new tokens (at most the
    context), arrivals over the first 5 steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = rng.randint(1, 9)
        out.append((rng.randint(0, 4), [rng.randrange(GPT["vocab_size"]) for _ in range(s)],
                    rng.randint(1, min(12, CONTEXT - s))))
    return out


def serve_all(engine, work, params, each_step=None, requests=None):
    """Add each request at its arrival step, step until all finish: the tokens of each request in `work`'s order
    (and its Request appended to `requests`, in that order: the engine keeps none once finished)."""
    reqs, t = {}, 0
    while len(reqs) < len(work) or engine.has_unfinished():
        for i, (arrive, prompt, max_tokens) in enumerate(work):
            if arrive == t:
                reqs[i] = engine.requests[engine.add_request(prompt, params(i, max_tokens))]
        engine.step()
        if each_step is not None:
            each_step(engine)
        t += 1
    if requests is not None:
        requests += [reqs[i] for i in range(len(work))]
    return [reqs[i].output for i in range(len(work))]


def greedy(i, max_tokens, stop=()):
    return serve.SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop)


def assert_greedy_equals_generate(model, engine, work, stop=(), each_step=None, requests=None):
    got = serve_all(engine, work, lambda i, m: greedy(i, m, stop), each_step, requests)
    for (_, prompt, max_tokens), tokens in zip(work, got):
        ref = gpt.generate(model, torch.tensor([prompt]), max_tokens, temperature=0, eod=list(stop) or None,
                           use_cache=False)[0, len(prompt):].tolist()
        assert tokens == ref, f"engine's tokens {tokens} differ from gpt.generate's {ref}"
    return got


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MLA], ids=["gpt-mha-learned", "llama-gqa-rope", "mla"])
def test_continuous_batching_greedy_equals_generate(cfg, monkeypatch):
    model = gpt.Model(gpt.Config(**cfg))
    rows, real_sample = {}, serve.sample  # the logits each request sampled from, by its generator
    monkeypatch.setattr(serve, "sample", lambda logits, params, g: (
        rows.setdefault(id(g), []).append(logits), real_sample(logits, params, g))[1])
    engine, steps = serve.Engine(model, num_blocks=40, block_size=4, max_batch=4), []
    plan = engine.cache.plan
    engine.cache.plan = lambda requests, counts, device: (  # record each step: (prefill?, tokens) per request
        steps.append([(r.cached == 0, n) for r, n in zip(requests, counts)]), plan(requests, counts, device))[1]
    work = workload()
    # a stop id: the 4th token the oracle gives the longest request, so that it stops early
    j = max(range(len(work)), key=lambda i: work[i][2])
    stop = (gpt.generate(model, torch.tensor([work[j][1]]), 4, temperature=0, use_cache=False)[0, -1].item(),)
    requests = []
    got = assert_greedy_equals_generate(model, engine, work, stop, requests=requests)
    assert got[j][-1] == stop[0] and len(got[j]) <= 4 < work[j][2]  # it stopped at the stop id
    assert {r.finish_reason for r in requests} == {"stop", "length"}
    assert len({len(t) for t in got}) >= 4, "the requests should finish at different steps"
    assert len(set(sum(got, []))) >= 8, "a degenerate generation compares nothing"
    for r in requests:  # the logits too: the whole sequence's forward, at each sampled position
        full = model(torch.tensor([r.prompt + r.output[:-1]]))[0, len(r.prompt) - 1:]  # [len(output), V]
        assert rel_err(torch.stack(rows[id(r.generator)]), full) <= 1e-10
    assert max(len(s) for s in steps) == 4  # max_batch requests ran together
    assert any(len({prefill for prefill, _ in s}) == 2 for s in steps)  # prefills and decodes shared a step
    assert sum(n for s in steps for _, n in s) == sum(len(p) + len(t) - 1 for (_, p, _), t in zip(work, got))


def assert_batch_independent(model, work):
    def params(i, max_tokens):
        return serve.SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, top_p=0.9, seed=100 + i)
    together = serve_all(serve.Engine(model, 40, 4, max_batch=4), work, params)
    assert len(set(sum(together, []))) >= 8
    for i, (_, prompt, max_tokens) in enumerate(work):
        alone = serve.Engine(model, 40, 4, max_batch=1)
        alone.add_request(prompt, params(i, max_tokens))
        tokens = alone.run()[0]
        assert tokens == together[i], f"request {i}: alone {tokens}, batched {together[i]}"
        assert serve.generate_one(model, prompt, params(i, max_tokens)) == together[i], f"request {i}: oracle"


def test_seeded_sampling_does_not_depend_on_the_batch():
    assert_batch_independent(gpt.Model(gpt.Config(**LLAMA)), workload(seed=1))


def test_one_shared_generator_is_caught(monkeypatch):
    """Negative control: every request drawing from one generator (the draws interleave with the batch's)."""
    shared, real = torch.Generator().manual_seed(0), serve.sample
    monkeypatch.setattr(serve, "sample", lambda logits, params, g: real(logits, params, shared))
    with pytest.raises(AssertionError, match="request .*: alone .*, batched"):
        assert_batch_independent(gpt.Model(gpt.Config(**LLAMA)), workload(seed=1))


def test_packed_positions_are_checked_against_the_table():
    """gpt.Model.forward with explicit positions checks them, not the row's length, against learned positions: a
    packed row longer than the table runs, a position past it is refused."""
    model = gpt.Model(gpt.Config(**GPT))
    model(torch.zeros(1, CONTEXT + 6, dtype=torch.long), position_ids=torch.arange(CONTEXT + 6)[None] % CONTEXT)
    with pytest.raises(ValueError, match="position 24 >= max_position_embeddings=24"):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 24]]))


def block_invariant(engine):
    """Every block is free or in exactly one running request's table."""
    held = [b for r in engine.running for b in r.blocks] + engine.cache.free
    assert sorted(held) == list(range(engine.cache.num_blocks)), f"blocks held or free: {sorted(held)}"


def test_freed_blocks_are_reused_and_the_pool_never_grows():
    model = gpt.Model(gpt.Config(**LLAMA))
    engine = serve.Engine(model, num_blocks=12, block_size=4, max_batch=8)  # too few blocks for all 6 at once
    users, pools = {}, []

    def check(e):
        block_invariant(e)
        for r in e.running:
            for b in r.blocks:
                users.setdefault(b, set()).add(r.id)
        pools.append([(k.data_ptr(), k.shape) for k, _ in e.cache.pools.values()])
    assert_greedy_equals_generate(model, engine, workload(seed=2), each_step=check)
    assert any(len(ids) > 1 for ids in users.values()), "no block was ever used by two requests"
    assert all(p == pools[0] for p in pools) and len(pools[0]) == 2 and pools[0][0][1] == (12, 2, 4, 8)
    assert sorted(engine.cache.free) == list(range(12)) and not engine.running and not engine.waiting


def test_a_block_table_sharing_a_live_block_is_caught(monkeypatch):
    """Negative control: request 1 writes its keys into a block request 0 still reads: the tokens differ."""
    model = gpt.Model(gpt.Config(**LLAMA))
    work = [(0, [1, 2, 3, 4, 5], 12), (1, [6, 7, 8], 12)]
    real = serve.PagedKVCache.plan

    def plan(self, requests, counts, device):  # once both run: request 1's first block is request 0's
        live = {r.id: r for r in requests}
        if 0 in live and 1 in live:
            live[1].blocks[0] = live[0].blocks[0]
        return real(self, requests, counts, device)
    monkeypatch.setattr(serve.PagedKVCache, "plan", plan)
    engine = serve.Engine(model, num_blocks=20, block_size=4, max_batch=4)
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        assert_greedy_equals_generate(model, engine, work)
    engine = serve.Engine(model, num_blocks=20, block_size=4, max_batch=4)
    with pytest.raises(AssertionError, match="blocks held or free"):
        serve_all(engine, work, greedy, block_invariant)


def test_an_aborted_request_frees_its_blocks_and_the_rest_go_on():
    model = gpt.Model(gpt.Config(**LLAMA))
    engine = serve.Engine(model, num_blocks=20, block_size=4, max_batch=4)
    a, b, c = (engine.add_request(p, greedy(0, 8)) for p in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10]))
    engine.step()
    rb, rc = engine.requests[b], engine.requests[c]
    engine.abort(b)  # running: its blocks go back at once
    engine.abort(c)
    block_invariant(engine)
    out = engine.run()
    assert rb.finish_reason == rc.finish_reason == "abort" and len(rb.output) == 1 and sorted(out) == [a]
    ref = gpt.generate(model, torch.tensor([[1, 2, 3, 4, 5]]), 8, temperature=0, use_cache=False)
    assert out[a] == ref[0, 5:].tolist()
    assert sorted(engine.cache.free) == list(range(20))


def test_requests_too_long_are_refused():
    engine = serve.Engine(gpt.Model(gpt.Config(**GPT)), num_blocks=3, block_size=4, max_batch=2)
    with pytest.raises(ValueError, match=r"prompt of 20 tokens \+ max_tokens=5 = 25 > the model's context "
                                         r"max_position_embeddings=24"):
        engine.add_request(list(range(20)), serve.SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match=r"request needs 4 blocks of 4 positions \(13 positions\), the pool has 3"):
        engine.add_request(list(range(10)), serve.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"^inputs \['pixel_values'\]: the model's forward takes no such argument$"):
        engine.add_request([1], serve.SamplingParams(), pixel_values=torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="max_tokens=0"):
        engine.add_request([1], serve.SamplingParams(max_tokens=0))
    engine.add_request(list(range(9)), serve.SamplingParams(max_tokens=4))  # 12 positions: exactly the 3 blocks
    with pytest.raises(ValueError, match="num_blocks=3, block_size=0, max_batch=2: each must be >= 1"):
        serve.Engine(engine.model, num_blocks=3, block_size=0, max_batch=2)
    assert not engine.waiting[0].blocks


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.0625, 0.5, 0.1875, 0.25], dtype=torch.float64)  # exact in binary: sums have no rounding
    # ranked 1, 3, 2, 0; the tokens above each sum to 0, 0.5, 0.75, 0.9375
    for p, kept in [(0.3, [1]), (0.5, [1]), (0.6, [1, 3]), (0.75, [1, 3]), (0.8, [1, 2, 3]), (0.95, [0, 1, 2, 3])]:
        assert serve.top_p_mask(probs, p).nonzero().flatten().tolist() == kept, p
    engine = serve.Engine(gpt.Model(gpt.Config(**GPT)), num_blocks=3, block_size=4, max_batch=2)
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        engine.add_request([1], serve.SamplingParams(top_p=0))


def test_top_k_keeps_the_k_largest_logits():
    """top-k on hand-built logits: the k largest (and any tied with the k-th) keep their softmax share, the others
    none; and sample() draws from exactly them. (Mutant checked: masking `logits <= kth`, k-1 kept, fails both.)"""
    logits = torch.tensor([1.0, 4.0, 2.0, 8.0, 1.0, 2.0]).log()  # softmax: these numbers over their sum
    for k, kept in [(1, [3]), (2, [1, 3]), (3, [1, 2, 3, 5]), (6, list(range(6))), (9, list(range(6)))]:
        want = torch.zeros(6)
        want[kept] = logits.exp()[kept] / logits.exp()[kept].sum()
        got = serve.distribution(logits, serve.SamplingParams(top_k=k))
        assert (got - want).abs().max() <= 1e-6, (k, got, want)
    g = torch.Generator().manual_seed(0)
    draws = {serve.sample(logits, serve.SamplingParams(top_k=2), g) for _ in range(200)}
    assert draws == {1, 3}, draws  # (both: token 1 has probability 1/3 each draw)


def test_admission_counts_the_blocks_promised_to_running_requests():
    """A workload that overfills the pool unless admission counts the blocks running requests will still take: in 4
    blocks of 4, A (2 + 10 tokens: 3 blocks at worst) holds 1 after its prefill; B (3 + 10: 3 blocks) arrives next
    step with 3 free, 2 of them promised to A. B waits until A ends; both are the oracle's tokens, every block free
    or held by one. (Mutant checked: admission ignoring the promised blocks admits B, and A's third block is not
    there: allocate's assertion.)"""
    model = gpt.Model(gpt.Config(**GPT))
    together = []
    assert_greedy_equals_generate(model, serve.Engine(model, num_blocks=4, block_size=4, max_batch=4),
                                  [(0, [1, 2], 10), (1, [3, 4, 5], 10)],
                                  each_step=lambda e: (block_invariant(e), together.append(len(e.running))))
    assert max(together) == 1 and len(together) == 20  # one at a time: B waited (10 steps each)


def test_nothing_of_a_request_is_kept_after_it_ends():
    """Many requests, ended every way (length, a stop id, aborted while waiting and while running): once they end the
    engine holds nothing of them: no request in `requests`, the queue or the batch, every block and state slot free,
    and no Request alive at all (weak references; the caller keeps none). (Mutant checked: `retire` leaving the
    request in `requests`, as before, fails it.)"""
    import gc
    import weakref
    model = gpt.Model(gpt.Config(**GPT))
    engine, rng, alive = serve.Engine(model, num_blocks=12, block_size=4, max_batch=3), random.Random(5), []
    for t in range(60):
        if t < 40:
            for _ in range(rng.randint(0, 2)):
                prompt = [rng.randrange(GPT["vocab_size"]) for _ in range(rng.randint(1, 8))]
                rid = engine.add_request(prompt, serve.SamplingParams(max_tokens=rng.randint(1, 8), temperature=1.0,
                                                                      top_k=20, stop=(7, 11, 13)))
                alive.append(weakref.ref(engine.requests[rid]))
        if t % 7 == 3 and engine.requests:
            engine.abort(rng.choice(sorted(engine.requests)))  # a waiting or a running one
        engine.step()
    assert not engine.has_unfinished() and len(alive) > 30
    assert engine.requests == {} and engine.waiting == [] and engine.running == []
    assert sorted(engine.cache.free) == list(range(12)) and sorted(engine.cache.free_slots) == [0, 1, 2]
    gc.collect()
    assert [w() for w in alive if w() is not None] == []




# --------------------------------------------------------------------------------------- Mamba hybrids
def slot_invariant(engine):
    """Every recurrent-state slot is free or held by exactly one running request."""
    held = [r.slot for r in engine.running] + engine.cache.free_slots
    assert sorted(held) == list(range(engine.max_batch)), f"state slots held or free: {sorted(held)}"


def hybrid(pattern="M*-M*", pos="none"):
    return mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern=pattern, position_embedding_type=pos)).eval()


@pytest.mark.parametrize("pattern,pos", [("M*-M*", "none"), ("*M-M", "rope")])
def test_mamba_hybrid_greedy_equals_its_sequential_generation(pattern, pos):
    """Attention layers in the paged cache, Mamba layers in per-request state slots: each request of a continuously
    batched run is the full recompute's (gpt.generate), mamba.generate's alone (one position per forward, the
    sequential scan) and generate_one's (the static cache)."""
    model, buffers = hybrid(pattern, pos), []
    engine = serve.Engine(model, num_blocks=40, block_size=4, max_batch=4)

    def check(e):
        block_invariant(e)
        slot_invariant(e)
        buffers.append([(t.data_ptr(), t.shape) for ts in e.cache.states.values() for t in ts])
    work = workload(seed=4, n=5)
    got = assert_greedy_equals_generate(model, engine, work, each_step=check)
    assert len(set(sum(got, []))) >= 8 and len({len(t) for t in got}) >= 4
    for (_, prompt, max_tokens), tokens in zip(work, got):
        alone = mamba.generate(model, torch.tensor([prompt]), max_tokens, temperature=0)[0, len(prompt):].tolist()
        assert tokens == alone == serve.generate_one(model, prompt, greedy(0, max_tokens))
    # two state tensors (conv, ssm) per Mamba layer, max_batch slots each, allocated once
    assert len(buffers[0]) == 2 * pattern.count("M") and all(b == buffers[0] for b in buffers)
    assert all(shape[0] == 4 for _, shape in buffers[0])
    assert sorted(engine.cache.free_slots) == [0, 1, 2, 3]


def test_mamba_hybrid_seeded_sampling_does_not_depend_on_the_batch():
    assert_batch_independent(hybrid(), workload(seed=5, n=3))


def test_two_requests_sharing_a_state_slot_are_caught(monkeypatch):
    """Negative control: request 1 is handed request 0's state slot while both run: the tokens differ, and the slot
    invariant fails."""
    real = serve.PagedKVCache.plan

    def plan(self, requests, counts, device):
        live = {r.id: r for r in requests}
        if 0 in live and 1 in live:
            live[1].slot = live[0].slot
        return real(self, requests, counts, device)
    monkeypatch.setattr(serve.PagedKVCache, "plan", plan)
    work, model = [(0, [1, 2, 3, 4, 5], 12), (1, [6, 7, 8], 12)], hybrid()
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        assert_greedy_equals_generate(model, serve.Engine(model, 20, 4, max_batch=4), work)
    with pytest.raises(AssertionError, match="state slots held or free"):
        serve_all(serve.Engine(model, 20, 4, max_batch=4), work, greedy, slot_invariant)


def test_an_aborted_hybrid_request_frees_its_state_slot():
    model = hybrid()
    engine = serve.Engine(model, num_blocks=20, block_size=4, max_batch=2)
    a, b, c = (engine.add_request(p, greedy(0, 6)) for p in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10]))
    engine.step()
    engine.abort(b)  # its slot goes to c, which starts from a zero state at its prefill
    slot_invariant(engine)
    out = engine.run()
    for i, prompt in ((a, [1, 2, 3, 4, 5]), (c, [9, 10])):
        ref = gpt.generate(model, torch.tensor([prompt]), 6, temperature=0, use_cache=False)[0, len(prompt):]
        assert out[i] == ref.tolist()
    assert sorted(engine.cache.free_slots) == [0, 1]


# --------------------------------------------------------------------------------------- LLaVA: an image in the prompt
LLAVA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=101, max_position_embeddings=CONTEXT, normalization="RMSNorm", activation="silu",
             gated_linear_unit=True, add_bias_linear=False, img_h=8, img_w=8, patch_dim=4, vision_num_layers=1,
             vision_hidden_size=16, vision_num_attention_heads=4, vision_ffn_hidden_size=24, image_token_index=100,
             init_method_std=0.5, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)


def image_work(model, seed=6):
    """(arrival, prompt, max_tokens, pixels or None): text, the image's 5 tokens, text; one text-only request; two
    image requests arrive together (their prefills share a step, so their images are stacked in one forward)."""
    rng, n_img = random.Random(seed), model.config.num_image_tokens
    g = torch.Generator().manual_seed(seed)
    out = []
    for arrive in (0, 0, 1, 2, 3):
        a, b = rng.randint(0, 4), rng.randint(1, 4)
        prompt = [rng.randrange(100) for _ in range(a)] + [100] * n_img + [rng.randrange(100) for _ in range(b)]
        out.append((arrive, prompt, rng.randint(3, CONTEXT - len(prompt)), torch.rand(3, 8, 8, generator=g)))
    out[3] = (3, [rng.randrange(100) for _ in range(6)], 10, None)  # text only
    return out


def assert_image_requests_equal_their_oracles(model):
    engine, work, reqs, t = serve.Engine(model, num_blocks=40, block_size=4, max_batch=4), image_work(model), {}, 0
    params = lambda m: serve.SamplingParams(max_tokens=m, temperature=0, stop=(100,))  # never feed an image token
    while len(reqs) < len(work) or engine.has_unfinished():
        for i, (arrive, prompt, m, px) in enumerate(work):
            if arrive == t:
                reqs[i] = engine.requests[engine.add_request(prompt, params(m),
                                                             **({} if px is None else {"pixel_values": px}))]
        engine.step()
        t += 1
    outs = [reqs[i].output for i in range(len(work))]
    assert len(set(sum(outs, []))) >= 8
    for (_, prompt, m, px), tokens in zip(work, outs):
        inputs = {} if px is None else {"pixel_values": px}
        full = gpt.generate(model, torch.tensor([prompt]), m, temperature=0, eod=100, next_logits=lambda ids: model(
            ids, None if px is None else px[None])[:, -1])[0, len(prompt):].tolist()  # the whole forward each step
        assert tokens == full, f"engine's tokens {tokens} differ from the full forward's {full}"
        assert tokens == serve.generate_one(model, prompt, params(m), **inputs)


@pytest.mark.parametrize("pos", ["rope", "learned_absolute"])
def test_llava_image_prompts_equal_the_full_forward(pos):
    """LLaVA through the engine: each request's image (pixel_values) goes with its prompt; a step with several
    prefills stacks their images in the row's order and the model splices each into its own request's image tokens.
    Greedy tokens equal the whole forward's (image and text, recomputed each step) and generate_one's."""
    assert_image_requests_equal_their_oracles(llava.Model(llava.Config(**LLAVA, position_embedding_type=pos)).eval())


def test_images_spliced_into_the_wrong_request_are_caught(monkeypatch):
    """Negative control: the images of a packed row in reverse order (each prefill gets another's image)."""
    real = llava.Model.encode_images
    monkeypatch.setattr(llava.Model, "encode_images", lambda self, px: real(self, px.flip(0)))
    with pytest.raises(AssertionError, match="differ from the full forward's"):
        assert_image_requests_equal_their_oracles(llava.Model(llava.Config(**LLAVA, position_embedding_type="rope")).eval())

TOL32 = 1e-5
"""Logprobs are float32 (log_softmax of the float64 logits cast to float32), of magnitude <= ~10 here: float32's
relative rounding 6e-8 over a few operations puts them within ~1e-6 of the float64 log_softmax (measured 7e-7);
1e-5 leaves a margin. Engine against generate_one: their float64 logits agree to 1e-10 relative (above), so the
float32 casts agree but for a logit on a rounding boundary (one ulp, < 1e-6); the same 1e-5 (measured 0)."""


def assert_logprobs_match(model):
    """The engine's logprobs (continuous batching, greedy and sampled, N from 0 to 20) against generate_one's and
    the float64 log_softmax of the whole sequence's forward; the sampled token's logprob is the one at its id."""
    work, n_top = workload(seed=3), [5, 0, 20, 3, 1, 7]

    def params(i, max_tokens):
        return serve.SamplingParams(max_tokens=max_tokens, temperature=[0, 0.9][i % 2], top_k=[None, 30][i % 2],
                                    seed=200 + i, logprobs=n_top[i])
    engine = serve.Engine(model, 40, 4, max_batch=4)
    requests = []
    got = serve_all(engine, work, params, requests=requests)
    for i, ((_, prompt, max_tokens), tokens) in enumerate(zip(work, got)):
        r, oracle = requests[i], []
        assert serve.generate_one(model, prompt, params(i, max_tokens), logprobs=oracle) == tokens
        assert len(r.logprobs) == len(oracle) == len(tokens)
        full = torch.log_softmax(model(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:], -1)  # [n, V]
        for t, (token, (lp, top), (lp1, top1)) in enumerate(zip(tokens, r.logprobs, oracle)):
            ids = [k for k, _ in top]
            assert ids == [k for k, _ in top1] == full[t].topk(n_top[i]).indices.tolist(), "top ids differ"
            ours = torch.tensor([lp] + [v for _, v in top], dtype=torch.float64)
            assert (ours - torch.tensor([lp1] + [v for _, v in top1], dtype=torch.float64)).abs().max() <= TOL32
            err = (ours - full[t][[token] + ids]).abs().max()
            assert err <= TOL32, f"request {i} token {t}: logprobs {err:.2e} from the full forward's"
            assert all(a >= b for a, b in zip(ours[1:], ours[2:]))  # most probable first
            assert not ids or ours[1] >= lp  # nothing ranks above the most probable token


def test_logprobs_equal_the_oracle_and_the_full_forward():
    assert_logprobs_match(gpt.Model(gpt.Config(**LLAMA)))


def test_logprobs_after_temperature_are_caught(monkeypatch):
    """Negative control: logprobs of the tempered logits (not the raw ones) are off by far more than TOL32."""
    real = serve.token_logprobs
    monkeypatch.setattr(serve, "token_logprobs", lambda logits, token, n: real(logits / 0.9, token, n))
    with pytest.raises(AssertionError, match="logprobs .* from the full forward's"):
        assert_logprobs_match(gpt.Model(gpt.Config(**LLAMA)))


@pytest.mark.parametrize("n", [-1, 21, 2.0])
def test_logprobs_out_of_range_are_refused(n):
    engine = serve.Engine(gpt.Model(gpt.Config(**GPT)), num_blocks=3, block_size=4, max_batch=2)
    with pytest.raises(ValueError, match=rf"^logprobs={n} must be None or an int in 0\.\.20$"):
        engine.add_request([1], serve.SamplingParams(logprobs=n))


# --------------------------------------------------------------------------------------- preemption
def preempting_run(model, work, params, each_step=None):
    """`work` through a pool too small for its requests' worst cases at once, with preemption (vLLM's recompute
    mode): the tokens of each request, and the engine."""
    engine = serve.Engine(model, num_blocks=7, block_size=4, max_batch=4, preempt=True)
    got = serve_all(engine, work, params, lambda e: (block_invariant(e), slot_invariant(e),
                                                     each_step and each_step(e)))
    assert engine.preemptions >= 2 and sorted(engine.cache.free) == list(range(7)), engine.preemptions
    return got, engine


@pytest.mark.parametrize("cfg", [LLAMA, "hybrid"], ids=["llama", "mamba-hybrid"])
def test_preempted_requests_recompute_the_same_answer(cfg):
    """When the pool cannot hold every running request's next block, the newest is preempted (its blocks and state
    slot freed), requeued first and recomputed from its prompt and the tokens it had sampled: greedy, each request's
    tokens are gpt.generate's alone; sampled with a seed, generate_one's (its own generator goes on where it was)."""
    model = hybrid() if cfg == "hybrid" else gpt.Model(gpt.Config(**cfg))
    work = workload(seed=6, n=8)
    got, _ = preempting_run(model, work, lambda i, m: greedy(i, m))
    for (_, prompt, max_tokens), tokens in zip(work, got):
        assert tokens == serve.generate_one(model, prompt, greedy(0, max_tokens)), "greedy"
    sampled = lambda i, m: serve.SamplingParams(max_tokens=m, temperature=0.9, top_k=40, seed=300 + i)
    got, _ = preempting_run(model, work, sampled)
    for i, ((_, prompt, max_tokens), tokens) in enumerate(zip(work, got)):
        assert tokens == serve.generate_one(model, prompt, sampled(i, max_tokens)), f"request {i}: sampled"


def test_a_preemption_that_forgets_the_sampled_tokens_is_caught(monkeypatch):
    """Negative control: recomputing a preempted request from its prompt alone (its sampled tokens' keys lost)."""
    monkeypatch.setattr(serve.Request, "pending", lambda r: r.prompt if r.cached == 0 else r.output[-1:])
    model = gpt.Model(gpt.Config(**LLAMA))
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        engine = serve.Engine(model, num_blocks=7, block_size=4, max_batch=4, preempt=True)
        assert_greedy_equals_generate(model, engine, workload(seed=6, n=8))


# --------------------------------------------------------------------------------------- prefix caching
def shared_invariant(engine):
    """With shared blocks: each block's count is the running tables holding it, and every block is free, cached
    and held by none (evictable), or held; a free block is in no prefix."""
    c, held = engine.cache, collections.Counter(b for r in engine.running for b in r.blocks)
    assert all(c.refs[b] == held[b] for b in range(c.num_blocks)), "block counts"
    assert sorted(c.free + list(c.evictable) + list(held)) == list(range(c.num_blocks)), "blocks free, cached or held"
    assert set(c.evictable) <= set(c.prefix_of) and not set(c.free) & set(c.prefix_of)


SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # a "system prompt": two full blocks of 4 and two tokens


def test_a_shared_prefix_is_computed_once():
    """Requests beginning with one system prompt, arriving after the first has run its prompt: each takes its two
    full blocks from the cache (8 tokens fewer computed each, 40 in all), and the tokens are gpt.generate's. An
    identical 8-token prompt takes one block only: its last token is computed, for the logits."""
    model = gpt.Model(gpt.Config(**LLAMA))
    work = [(t, SYSTEM + [10 + t] * (1 + t % 3), 6) for t in range(6)] + [(6, SYSTEM[:8], 6)]
    computed = {}
    for caching in (False, True):
        engine = serve.Engine(model, num_blocks=40, block_size=4, max_batch=8, prefix_caching=caching)
        assert_greedy_equals_generate(model, engine, work, each_step=shared_invariant)
        computed[caching] = engine.computed
    assert computed[False] - computed[True] == 5 * 8 + 4, computed


@pytest.mark.parametrize("preempt", [False, True], ids=["reserving", "preempting"])
def test_cached_blocks_are_evicted_least_recently_used_first(preempt):
    """A pool too small to keep every prefix: cached blocks no request holds are evicted when new ones are needed,
    the tokens stay gpt.generate's and the block counts right at every step; with preemption too (a preempted
    request's cached blocks are there for it when it comes back, unless evicted)."""
    model = gpt.Model(gpt.Config(**LLAMA))
    rng = random.Random(8)
    heads = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    work = [(t, heads[t % 3] + [rng.randrange(100) for _ in range(rng.randint(1, 5))], rng.randint(2, 6))
            for t in range(12)]
    cached = []
    engine = serve.Engine(model, num_blocks=6 if preempt else 10, block_size=4, max_batch=4 if preempt else 2,
                          preempt=preempt, prefix_caching=True)
    assert_greedy_equals_generate(model, engine, work, each_step=lambda e: (
        shared_invariant(e), cached.append(len(e.cache.prefix_of))))
    assert any(b < a for a, b in zip(cached, cached[1:])), "no cached block was ever evicted"
    assert engine.computed < sum(len(p) + m - 1 for _, p, m in work)  # some prefixes were reused
    assert (engine.preemptions > 0) == preempt, engine.preemptions


def test_blocks_cached_under_their_own_tokens_alone_are_caught(monkeypatch):
    """Negative control: a block cached under its own tokens, not the whole prefix: a prompt whose first block's
    tokens are another's second block takes keys computed after another start, and its tokens differ."""
    monkeypatch.setattr(serve.PagedKVCache, "key", lambda self, tokens, i: tuple(
        tokens[i * self.block_size:(i + 1) * self.block_size]))
    model = gpt.Model(gpt.Config(**LLAMA))
    engine = serve.Engine(model, num_blocks=20, block_size=4, max_batch=4, prefix_caching=True)
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        assert_greedy_equals_generate(model, engine, [(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], 6),
                                                      (1, [5, 6, 7, 8, 5, 6, 7, 8, 10], 6)])


def test_prefix_caching_refuses_recurrent_layers():
    """A Mamba hybrid's recurrent state is not in the blocks: a cached prefix cannot be resumed, and says so."""
    engine = serve.Engine(hybrid(), num_blocks=20, block_size=4, max_batch=2, prefix_caching=True)
    engine.add_request(SYSTEM, greedy(0, 2))
    engine.run()
    engine.add_request(SYSTEM + [7], greedy(0, 2))
    with pytest.raises(ValueError, match="prefix caching cannot serve a model with recurrent layers"):
        engine.run()
