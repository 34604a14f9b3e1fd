"""serving/speculative.py: speculative decoding in the engine, with a draft model and with the run's own MTP layer,
against gpt.generate and speculate_one (the plain sequential oracle: every forward over the whole sequence).

  - greedy, K = 1 and 3 drafts a step: continuously batched requests (random prompt lengths and arrival steps,
    different max_tokens, a stop id) give gpt.generate's tokens, and each request's drafts at each step are
    speculate_one's (so are its accepted counts); a draft model (the model's own embedding, first layer and output
    layer: some drafts accepted, some not) and the MTP drafter (its layer and the model's last one steered by one
    shared bias, so that 0 to K drafts are accepted; and an unsteered one); the same at TP 2, ranks in lock-step;
  - the blocks: at every step every block is free or held by one running request, and each running request holds
    exactly the blocks of its cached positions (a rejected draft's are given back); all free at the end; also
    under preemption in a small pool, with prefix caching, with a token budget a step and on the gather path;
  - a draft model equal to the model accepts every draft: k = min(K, tokens left − 1) a step, the stats exact;
  - logprobs are the plain engine's; the server's loop sends each of a step's tokens as its own event; the server
    with --speculative-model answers the openai client with the oracle's text (batched and streamed), a sampled
    request gets a 400 naming it, the acceptance is logged at SIGTERM; bench_serve.py --speculative's rows;
  - refused by name: temperature > 0, a model input, MTP on a model without MTP layers or with prefix caching, a
    draft model of another vocabulary or a shorter context, a Mamba hybrid as model or draft (its recurrent state is
    not rolled back); by the server before serving (exit 2): a draft run of another tokenizer, MTP without MTP
    layers, a malformed --speculative-config;
  - negative controls: an accept rule that also takes the first wrong draft changes the tokens; a draft model that
    keeps its keys of rejected drafts drafts other tokens than the oracle; an engine that keeps the blocks of
    rejected drafts fails the block accounting.
Tolerance: tokens exactly (float64 weights); logprobs 1e-10 relative (the same rows, another packing).
"""
from __future__ import annotations

import collections
import functools
import random
import re

import pytest
import torch
from test_kv_cache import GPT, HYBRID, LLAMA

import gpt
import mamba
import parallel as P
from equivalence import rel_err
from serving import engine as serve
from serving import speculative as spec

STOP = 7  # a stop id some requests meet


def workload(seed=0, n=5, vocab=101):
    """n requests: (arrival step, prompt ids, max_tokens): prompts of 1-7 tokens, 2-9 new tokens, arrivals over 3
    steps."""
    rng = random.Random(seed)
    return [(rng.randint(0, 2), [rng.randrange(vocab) for _ in range(rng.randint(1, 7))], rng.randint(2, 9))
            for _ in range(n)]


@functools.cache
def target_and_draft():
    """A Llama-style target, and a draft model that is its embedding, first layer and output layer."""
    model = gpt.Model(gpt.Config(**LLAMA)).eval()
    draft = gpt.Model(gpt.Config(**dict(LLAMA, num_layers=1))).eval()
    draft.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("decoder.layers.1.")})
    return model, draft


@functools.cache
def mtp_model(steer=15.0, cfg="gpt", grid=None):
    """A model with one MTP layer; steer: a bias added to its last MLP and the MTP layer's (one random direction),
    which pulls both toward the same tokens: the drafts are then accepted 0 to K at a time."""
    model = gpt.Model(gpt.Config(**dict(GPT if cfg == "gpt" else LLAMA, mtp_num_layers=1)), grid).eval()
    if steer:
        u = torch.randn(GPT["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for mlp in (model.decoder.layers[-1].mlp, model.mtp.layers[0].transformer_layer.mlp):
                mlp.linear_fc2.bias += steer * u
    return model


def drafter(kind, k, grid=None):
    if kind == "draft-model":
        model, draft = target_and_draft() if grid is None else tp_target_and_draft(grid)
        return model, spec.DraftModel(draft, k), draft
    model = mtp_model(*(dict(mtp=(15.0,), mtp_llama=(0.0, "llama"))[kind]), grid=grid)
    return model, spec.MTP(model, k), None


def greedy(max_tokens, stop=(STOP,)):
    return serve.SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop)


def accounting(engine):
    """Every block free (or evictable) or in running tables, as many as its count says; each running request holds
    the blocks of its cached positions."""
    cache, tables = engine.cache, collections.Counter(b for r in engine.running for b in r.blocks)
    idle = cache.free + list(cache.evictable)
    assert sorted(idle + list(tables)) == list(range(cache.num_blocks)), "a block both free and held, or lost"
    assert all(cache.refs[b] == tables[b] for b in range(cache.num_blocks)), "a block's count is not its tables'"
    for r in engine.running:
        assert len(r.blocks) == engine.blocks_for(r.cached), (
            f"request {r.id} holds {len(r.blocks)} blocks for {r.cached} cached positions: blocks of rejected drafts "
            "kept")


def serve_all(engine, work, each_step=accounting):
    """Each request added at its arrival step; step until all finish. -> the Requests (work's order), and for each
    the drafts it was proposed at each step, with how many tokens it had then."""
    reqs, proposed, t = {}, {}, 0
    propose = engine.speculator.propose

    def recording(requests, ks):
        drafts = propose(requests, ks)
        for r, d in zip(requests, drafts):
            proposed.setdefault(r.id, []).append((len(r.tokens()), d))
        return drafts
    engine.speculator.propose = recording
    while len(reqs) < len(work) or engine.has_unfinished():
        for i, (arrive, prompt, max_tokens) in enumerate(work):
            if arrive == t:
                reqs[i] = engine.requests[engine.add_request(prompt, greedy(max_tokens))]
        engine.step()
        each_step(engine)
        t += 1
    assert engine.cache.available() == engine.cache.num_blocks and not engine.requests
    return [reqs[i] for i in range(len(work))], [proposed.get(reqs[i].id, []) for i in range(len(work))]


def assert_speculation_is_greedy(model, engine, work, draft_model=None):
    """Every request's tokens are gpt.generate's; the drafts it was proposed at each step draft_one's after its
    tokens then, and its accepted counts how many of them lead its tokens."""
    reqs, proposed = serve_all(engine, work)
    for (_, prompt, max_tokens), r, steps in zip(work, reqs, proposed):
        ref = gpt.generate(model, torch.tensor([prompt]), max_tokens, temperature=0, eod=[STOP],
                           use_cache=False)[0, len(prompt):].tolist()
        assert r.output == ref, f"engine's tokens {r.output} differ from gpt.generate's {ref}"
        tokens = r.tokens()
        for p, d in steps:
            want = spec.draft_one(model, tokens[:p], len(d), draft_model)
            assert d == want, f"request {r.id}: drafts {d} after {p} tokens, draft_one's {want}"
        assert r.accepted == [spec.matched(d, tokens[p:]) for p, d in steps], (r.accepted, steps, tokens)
    return reqs


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kind", ["draft-model", "mtp", "mtp_llama"])
def test_speculative_greedy_equals_generate(kind, k):
    model, drafter_, draft = drafter(kind, k)
    engine = serve.Engine(model, num_blocks=40, block_size=4, max_batch=4, speculator=drafter_)
    reqs = assert_speculation_is_greedy(model, engine, workload(), draft)
    accepted = sum((r.accepted for r in reqs), [])
    stats = engine.speculator.stats()
    assert stats["accepted"] == sum(accepted) and stats["drafted"] > 0
    assert len({len(r.output) for r in reqs}) >= 3 and len(set(sum((r.output for r in reqs), []))) >= 4
    if kind != "mtp_llama":  # (unsteered random weights: its drafts are checked, rarely accepted)
        assert 0 in accepted and set(accepted) - {0}, f"accepted {accepted}: every count alike compares little"


@pytest.mark.parametrize("kind", ["draft-model", "mtp"])
def test_the_plain_oracle_steps_as_the_engine(kind):
    """speculate_one: gpt.generate's tokens, and (K = 3, nothing bounding the drafts) the engine's drafts and
    accepted counts at each step."""
    model, drafter_, draft = drafter(kind, 3)
    work = workload(4)
    reqs, proposed = serve_all(serve.Engine(model, 40, 4, 4, speculator=drafter_), work)
    for (_, prompt, max_tokens), r, steps in zip(work, reqs, proposed):
        tokens, drafts, accepted = spec.speculate_one(model, prompt, max_tokens, 3, draft, stop=(STOP,))
        assert tokens == r.output and drafts == [d for _, d in steps] and accepted == r.accepted


@pytest.mark.parametrize("kind, case", [("draft-model", "preemption"), ("draft-model", "prefix-caching"),
                                        ("draft-model", "budget"), ("draft-model", "gather"), ("mtp", "preemption"),
                                        ("mtp", "budget"), ("mtp", "gather")])
def test_speculation_with_the_engine_features(kind, case):
    """The tokens stay gpt.generate's, the drafts draft_one's and the blocks exact under preemption (a pool of 5
    blocks of 4: the newest requests recomputed, their drafters' state forgotten), prefix caching (every prompt after
    one shared 9-token head; the draft model only), a budget of 6 tokens a step (drafts cut to what is left) and the
    gather path."""
    model, drafter_, draft = drafter(kind, 3)
    kw = dict(preemption=dict(num_blocks=5, preempt=True), budget=dict(max_num_batched_tokens=6),
              gather=dict(attention="gather")).get(case, dict(prefix_caching=True))
    engine = serve.Engine(model, **{"num_blocks": 40, "block_size": 4, "max_batch": 4, **kw}, speculator=drafter_)
    work = workload(1)
    if case == "prefix-caching":
        work = [(t, [3, 1, 4, 1, 5, 9, 2, 6, 5] + p[:4], min(m, 8)) for t, p, m in workload(1)]
    assert_speculation_is_greedy(model, engine, work, draft)
    assert (engine.preemptions > 0) == (case == "preemption") and (engine.reused > 0) == (case == "prefix-caching")


def test_a_draft_equal_to_the_model_accepts_every_draft():
    """Every draft accepted: k = min(K, tokens left − 1) drafts at each step after the prefill's (until a stop id),
    the stats exact."""
    model, _ = target_and_draft()
    engine = serve.Engine(model, num_blocks=40, block_size=4, max_batch=4, speculator=spec.DraftModel(model, 3))
    work = workload(2)
    reqs, proposed = serve_all(engine, work)
    for (_, _, m), r, steps in zip(work, reqs, proposed):
        assert r.accepted == [len(d) for _, d in steps]
        want, n = [], 1  # tokens so far: the prefill's
        while n < m:
            k = min(3, m - n - 1)
            want, n = want + [k] * (k > 0), n + k + 1
        assert r.accepted == want or STOP in r.output, (r.accepted, want)
    assert any(STOP not in r.output for r in reqs)
    s, steps = engine.speculator.stats(), sum(len(r.accepted) for r in reqs)
    assert s["acceptance_rate"] == 1.0 and s["accepted"] == s["drafted"] == sum(sum(r.accepted) for r in reqs)
    assert s["tokens_per_step"] == (s["accepted"] + steps) / steps


def test_logprobs_are_the_plain_engines():
    model, draft = target_and_draft()
    got = []
    for speculator in (None, spec.DraftModel(draft, 3)):
        engine = serve.Engine(model, num_blocks=40, block_size=4, max_batch=4, speculator=speculator)
        ids = [engine.add_request(p, serve.SamplingParams(max_tokens=m, temperature=0, logprobs=3))
               for _, p, m in workload(3)]
        reqs = [engine.requests[i] for i in ids]
        engine.run()
        got.append(reqs)
    for plain, fast in zip(*got):
        assert plain.output == fast.output and len(fast.logprobs) == len(fast.output)
        assert [t for _, top in plain.logprobs for t, _ in top] == [t for _, top in fast.logprobs for t, _ in top]
        assert rel_err(torch.tensor([lp for lp, _ in fast.logprobs]), torch.tensor([lp for lp, _ in plain.logprobs])
                       ) <= 1e-10


def test_refused_by_name():
    model, draft = target_and_draft()
    engine = serve.Engine(model, 40, 4, 4, speculator=spec.DraftModel(draft, 2))
    with pytest.raises(ValueError, match=r"greedy requests only: temperature=0.8 \(rejection sampling is not"):
        engine.add_request([1, 2], serve.SamplingParams(temperature=0.8))
    with pytest.raises(ValueError, match=r"takes no model inputs \(\['labels'\]\)"):
        engine.add_request([1, 2], greedy(3), labels=torch.zeros(3))
    with pytest.raises(ValueError, match="num_speculative_tokens=0 must be >= 1"):
        spec.DraftModel(draft, 0)
    with pytest.raises(ValueError, match="the model has no multi-token-prediction layers"):
        spec.MTP(model, 1)
    with pytest.raises(ValueError, match="the MTP drafter cannot use prefix caching"):
        serve.Engine(mtp_model(), 40, 4, 4, prefix_caching=True, speculator=spec.MTP(mtp_model(), 1))
    other = gpt.Model(gpt.Config(**dict(LLAMA, num_layers=1, vocab_size=97)))
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(97 tokens\) is not the model's \(101\)"):
        serve.Engine(model, 40, 4, 4, speculator=spec.DraftModel(other, 2))
    short = gpt.Model(gpt.Config(**dict(LLAMA, num_layers=1, max_position_embeddings=16)))
    with pytest.raises(ValueError, match=r"draft model's context \(16\) is shorter than the model's \(24\)"):
        serve.Engine(model, 40, 4, 4, speculator=spec.DraftModel(short, 2))
    hybrid = mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="M*", position_embedding_type="none"))
    small = mamba.Model(mamba.Config(**HYBRID, hybrid_layer_pattern="*", position_embedding_type="none"))
    for target, draft in ((hybrid, small), (small, hybrid)):
        with pytest.raises(ValueError, match="cannot serve a model with recurrent layers: a rejected draft's recurrent"):
            serve.Engine(target, 40, 4, 4, speculator=spec.DraftModel(draft, 2))
    serve.Engine(small, 40, 4, 4, speculator=spec.DraftModel(small, 2))  # (attention layers only: served)


def test_wrong_accept_rule_changes_the_tokens(monkeypatch):
    """Negative control: also taking the first wrong draft (the model's own token dropped) diverges."""
    model, drafter_, draft = drafter("draft-model", 3)
    real = spec.accept

    def wrong(d, t, stop=()):  # the first wrong draft taken, then the model's token after it
        a = spec.matched(d, t)
        return real(d, t, stop) if a == len(d) else d[:a + 1] + [t[a + 1]]
    monkeypatch.setattr(spec, "accept", wrong)
    engine = serve.Engine(model, 40, 4, 4, speculator=drafter_)
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        assert_speculation_is_greedy(model, engine, workload(), draft)


def test_draft_keys_kept_after_a_preemption_change_the_drafts(monkeypatch):
    """Negative control: a draft model that does not forget a preempted request (its keys were in the blocks given
    back) drafts other tokens than draft_one (the model's checks keep the tokens right)."""
    model, drafter_, draft = drafter("draft-model", 3)
    monkeypatch.setattr(spec.DraftModel, "forget", lambda self, r: None)
    engine = serve.Engine(model, 5, 4, 4, preempt=True, speculator=drafter_)
    with pytest.raises(AssertionError, match=r"drafts \[.*\] after \d+ tokens, draft_one's"):
        assert_speculation_is_greedy(model, engine, workload(1), draft)


def test_blocks_of_rejected_drafts_kept_are_caught(monkeypatch):
    """Negative control: an engine that keeps the blocks of rejected drafts fails the block accounting."""
    model, drafter_, draft = drafter("draft-model", 3)
    monkeypatch.setattr(spec.Drafter, "rollback", lambda self, r: None)
    engine = serve.Engine(model, 40, 4, 4, speculator=drafter_)
    with pytest.raises(AssertionError, match="blocks of rejected drafts kept"):
        serve_all(engine, workload())


def test_the_servers_loop_sends_each_token():
    """server.Loop (no HTTP): a step that accepts drafts sends each new token as its own event, their texts together
    the request's."""
    from serving import server

    class Tok:
        def decode(self, ids):
            return "".join(f"<{i}>" for i in ids)
    model, drafter_, _ = drafter("draft-model", 3)
    loop, events = server.Loop(serve.Engine(model, 40, 4, 4, speculator=drafter_), Tok(), 1, 0), []

    def on(event):
        events.append(event)
        if event[0] == "token" and event[3] is not None:
            loop.submit(("stop", None))
    loop.submit(("add", "a", [5, 9, 2], greedy(10, stop=()), []), on)
    loop.run()
    tokens = [e for e in events if e[0] == "token"]
    ref = gpt.generate(model, torch.tensor([[5, 9, 2]]), 10, temperature=0, use_cache=False)[0, 3:].tolist()
    assert len(tokens) == 10 and "".join(e[1] for e in tokens) == Tok().decode(ref) and tokens[-1][3] == "length"
    assert drafter_.accepted > 0 and drafter_.verified < 9


# ---------------------------------------------------------------------------------------------- TP 2
@functools.cache
def tp_target_and_draft(grid):
    model = gpt.Model(gpt.Config(**LLAMA), grid).eval()
    draft = gpt.Model(gpt.Config(**dict(LLAMA, num_layers=1)), grid).eval()
    draft.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("decoder.layers.1.")})
    return model, draft


def tp_case(rank, n, kind):
    grid = P.Grid(tp=n)
    model, drafter_, _ = drafter(kind, 3, grid)
    reqs, proposed = serve_all(serve.Engine(model, 40, 4, 4, speculator=drafter_), workload())
    return [(r.output, steps, r.accepted) for r, steps in zip(reqs, proposed)]


@pytest.mark.parametrize("kind", ["draft-model", "mtp"])
def test_speculation_at_tp2_in_lock_step_equals_one_process(pool, kind):
    model, drafter_, _ = drafter(kind, 3)
    reqs, proposed = serve_all(serve.Engine(model, 40, 4, 4, speculator=drafter_), workload())
    one = [(r.output, steps, r.accepted) for r, steps in zip(reqs, proposed)]
    assert sum(a for _, _, acc in one for a in acc) > 0
    for got in pool.run(tp_case, 2, kind=kind):
        assert got == one


# ---------------------------------------------------------------------------------------------- the server
def test_the_server_speculates_and_refuses_by_name(tmp_path, monkeypatch):
    """serving/server.py --speculative-model RUN (a one-layer run of the same tokenizer) answers the openai client
    with the greedy oracle's text (all prompts at once: one batch; streamed too), refuses a sampled request with a
    400 naming it, and logs its acceptance at SIGTERM; it refuses, before serving, a draft run of another tokenizer
    and MTP for a run without MTP layers, each by name (ConfigError: exit 2)."""
    import concurrent.futures

    import openai
    from test_server import PROMPTS, Server, complete, free_port, make_oracle, save_run

    from config import ConfigError
    from interop import tokenizer_files
    from serving import server

    run, small = save_run(tmp_path, "run"), save_run(tmp_path, "draft", "--num-layers", "1")
    (tmp_path / "other").mkdir()
    tokenizer_files.get_tokenizer(["zebra quagga okapi " * 50] * 3, str(tmp_path / "other" / "tokenizer.json"), 384)
    foreign = save_run(tmp_path / "other", "foreign")
    for flags, why in [(["--speculative-model", str(foreign)], "its tokenizer is not --load"),
                       (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
                        "the model has no multi-token-prediction layers"),
                       (["--speculative-config", '{"method": "mtp", "model": "x"}'], "method \"mtp\" \\(no model\\)")]:
        with monkeypatch.context() as m:  # (a refusal missed fails here, before it serves; main takes every core)
            m.setattr(server, "Loop", lambda *a: pytest.fail(f"{flags} not refused"))
            m.setattr(torch, "set_num_threads", lambda n: None)
            with pytest.raises(ConfigError, match=why):
                server.main(["--load", str(run), "--port", str(free_port()), *flags])
    answer, tok = make_oracle(run)
    eod = tokenizer_files.special_ids(tok)["eod"]
    s = Server(run, 1, "--speculative-model", str(small), "--num-speculative-tokens", "3")
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: complete(s.client, p), PROMPTS))
        assert got == [answer(tok.encode(p).ids, [eod]) for p in PROMPTS]
        chunks = s.client.completions.create(model="run", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == got[0][0]
        with pytest.raises(openai.BadRequestError, match="greedy requests only: temperature=0.8"):
            s.client.completions.create(model="run", prompt="x", max_tokens=4, temperature=0.8)
    finally:
        code, out = s.stop()
    assert code == 0 and "speculative decoding: " in out and " accepted (" in out, out[-2000:]


# ---------------------------------------------------------------------------------------------- the bench
def test_bench_serve_speculative_rows(capsys):
    """bench/bench_serve.py --speculative at a tiny size: a row for an early-exit draft (the model's first layer) and
    one for the MTP drafter, each with the same tokens as without speculation."""
    from test_bench_serve import TINY, bench

    for extra in (["--draft", "layers:1"], ["--draft", "mtp", "--model-args", "--num-layers 2 --hidden-size 32 "
                                            "--num-attention-heads 4 --vocab-size 128 --mtp-num-layers 1"]):
        bench().main(["--speculative", "2", "--concurrency", "3", *TINY, *extra])
        rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if re.match(r"\| (layers|mtp)", line)]
        assert len(rows) == 1 and rows[0][2].strip() == "2" and rows[0][-2].strip() == "yes", rows
        assert 0 <= float(rows[0][6].strip().rstrip("%")) <= 100
