"""serving/paged_attention.py (attention reading the block pool through the tables) and the engine's chunked prefill
(a per-step token budget, vLLM's max_num_batched_tokens), against their plain oracles.

  - the paged kernel on one mixed step (decodes, whole prompts, a prompt's later chunk; grouped-query heads, and
    MLA's value width unlike its key width) equals the gather path (every key read gathered, the block-diagonal
    mask: PagedKVCache.append); negative control: one request's block table holding another's block fails;
  - a request decoding alone reads its keys as one run a layer (PagedKVCache.run), equal to its blocks gathered at
    every step, through another request joining and ending; negative control: runs kept across those steps fail;
  - chunked prefill: greedy tokens equal gpt.generate's alone at budgets smaller than one block, smaller than a
    prompt, and larger than every prompt (GQA with RoPE, learned positions, MLA, a Mamba hybrid whose later chunks
    start from the state its earlier ones left, the gather path); no step runs more tokens than the budget, every
    decoding request runs at every step (decodes first), and prompts were cut; negative controls: a later chunk
    that does not see its prompt's earlier chunks, and a hybrid's later chunk started from a zero state, fail;
  - preemption under chunked prefill needs only the blocks a step's tokens touch (vLLM's accounting): a workload that
    fits is never preempted, a true shortage is, answers gpt.generate's; negative control: counting a cut prompt's
    whole remainder preempts the workload that fits;
  - a budget below max_batch (0 included) is refused with vLLM's message, by the engine and by the server before
    it loads the run; a prompt with an image longer than the budget too (it is never cut).
Tolerance: tokens exactly; the kernel's output 1e-12 relative to the gather path's in float64 (the same products,
summed in another order: measured ~1e-16).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from test_kv_cache import GPT, LLAMA, MLA
from test_serve import LLAVA, assert_greedy_equals_generate, greedy, hybrid, serve_all, workload

import gpt
import llava
from equivalence import rel_err
from serving import engine as serve
from serving import paged_attention


def mixed_step(seed=0, tables=None):
    """A step's requests on a pool of 24 blocks of 4: (cached, new tokens) = decodes (1 token), whole prompts (from
    0) and prompts' later chunks, each with a random block table (no block shared)."""
    rng = random.Random(seed)
    shapes = [(7, 1), (0, 5), (12, 1), (3, 6), (0, 1), (4, 1), (8, 4)]
    free = rng.sample(range(24), 24)
    reqs = []
    for i, (c, n) in enumerate(shapes):
        r = serve.Request(i, [0] * (c + n), serve.SamplingParams(), None, cached=c)
        r.blocks = tables[i] if tables else [free.pop() for _ in range(-(-(c + n) // 4))]
        reqs.append(r)
    return reqs, [n for _, n in shapes]


def paged_and_gathered(reqs, counts, n=4, g=2, d=8, dv=8, wrong=None):
    """One attention layer's output both ways, from the same pools and this step's q, k, v (float64)."""
    gen = torch.Generator().manual_seed(1)
    T = sum(counts)
    q, k = (torch.randn(1, h, T, d, generator=gen, dtype=torch.float64) for h in (n, g))
    v = torch.randn(1, g, T, dv, generator=gen, dtype=torch.float64)
    pools = (torch.randn(24, g, 4, d, generator=gen, dtype=torch.float64),
             torch.randn(24, g, 4, dv, generator=gen, dtype=torch.float64))
    out = []
    for attention in ("paged", "gather"):
        cache = serve.PagedKVCache(24, 4, attention=attention)
        cache.pools["layer"] = tuple(p.clone() for p in pools)
        if attention == "paged" and wrong is not None:  # (the paged side reads another table)
            tables = [r.blocks for r in reqs]
            for r, t in zip(reqs, wrong):
                r.blocks = t
            _, mask = cache.plan(reqs, counts, "cpu")
            for r, t in zip(reqs, tables):
                r.blocks = t
        else:
            _, mask = cache.plan(reqs, counts, "cpu")
        if attention == "paged":
            out.append(cache.attend("layer", q, k, v, 0.3))
        else:
            K, V = cache.append("layer", k, v)
            out.append(F.scaled_dot_product_attention(q, K, V, attn_mask=mask[None, None], scale=0.3,
                                                      enable_gqa=g != n))
    return out


@pytest.mark.parametrize("n, g, d, dv", [(4, 2, 8, 8), (4, 4, 12, 8)], ids=["gqa", "mla-widths"])
def test_paged_attention_equals_the_gather_path(n, g, d, dv):
    paged, gathered = paged_and_gathered(*mixed_step(), n=n, g=g, d=d, dv=dv)
    assert rel_err(paged, gathered) <= 1e-12, "paged attention differs from the gather path"


def test_a_wrong_block_table_is_caught():
    """Negative control: the paged side reads request 2's table with its first block request 0's."""
    reqs, counts = mixed_step()
    wrong = [list(r.blocks) for r in reqs]
    wrong[2][0] = wrong[0][0]
    paged, gathered = paged_and_gathered(reqs, counts, wrong=wrong)
    with pytest.raises(AssertionError, match="paged attention differs from the gather path"):
        assert rel_err(paged, gathered) <= 1e-12, "paged attention differs from the gather path"


# --------------------------------------------------------------------------------------- a lone query's run
LONE = [(0, [5, 7, 11, 13, 17], 12), (4, [3, 9], 2)]  # A decodes alone, B joins for two steps and ends, A goes on


class Stale(dict):
    """The mutant's runs: never dropped, and each taken as holding every position before the query's."""

    def __init__(self, cache):
        super().__init__()
        self.cache = cache

    def get(self, layer):
        held = super().get(layer)
        return held and (*held[:2], self.cache.lone)


def lone_runs(cfg, monkeypatch, stale=False):
    """LONE through an engine (greedy), each of PagedKVCache.run's answers checked against the pool's blocks gathered:
    (the engine's tokens, gpt.generate's, whether each answer equalled them). stale: the mutant (runs kept across
    the other request's steps, their positions check defeated)."""
    model, same = gpt.Model(gpt.Config(**cfg)), []
    real_run, real_plan = serve.PagedKVCache.run, serve.PagedKVCache.plan

    def run(self, layer, K, V, k, v):
        out, c = real_run(self, layer, K, V, k, v), self.lone
        want = (rearrange(P[self.run_table[:c // self.block_size + 1]], "nb g b d -> 1 g (nb b) d")[:, :, :c + 1]
                for P in (K, V))
        same.append(all(torch.equal(a, b) for a, b in zip(out, want)))
        return out

    def plan(self, requests, counts, device):
        out = real_plan(self, requests, counts, device)
        if self.run_table is not None:
            self.runs = self.__dict__.setdefault("stale", Stale(self))
        return out
    monkeypatch.setattr(serve.PagedKVCache, "run", run)
    if stale:
        monkeypatch.setattr(serve.PagedKVCache, "plan", plan)
    got = serve_all(serve.Engine(model, num_blocks=12, block_size=4, max_batch=2), LONE, greedy)
    ref = [gpt.generate(model, torch.tensor([p]), m, temperature=0, use_cache=False)[0, len(p):].tolist()
           for _, p, m in LONE]
    return got, ref, same


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MLA], ids=["gpt-mha-learned", "llama-gqa-rope", "mla"])
def test_a_lone_query_reads_its_keys_as_one_run(cfg, monkeypatch):
    """A request decoding alone reads its keys and values as one run a layer (PagedKVCache.run: its blocks gathered
    once, then each step's key appended) instead of gathering its blocks at every step: every run equals the pool's
    blocks gathered, through another request joining and ending (the runs dropped, then gathered again), and the
    tokens are gpt.generate's."""
    got, ref, same = lone_runs(cfg, monkeypatch)
    assert got == ref and len(same) >= 2 * 8 and all(same)


def test_a_run_kept_across_another_requests_steps_is_caught(monkeypatch):
    """Negative control: runs kept across the steps the other request shared (and taken as current) miss the
    positions those steps wrote, and the run check fails."""
    with pytest.raises(AssertionError, match="a run differs from the pool"):
        assert all(lone_runs(LLAMA, monkeypatch, stale=True)[2]), "a run differs from the pool"


# --------------------------------------------------------------------------------------- chunked prefill
def chunked_run(model, budget, max_batch, attention="paged", work=None):
    """`work` through an engine with a token budget, greedy, checked against gpt.generate; returns (counts per
    step, whether some prompt was cut)."""
    engine = serve.Engine(model, num_blocks=40, block_size=4, max_batch=max_batch, max_num_batched_tokens=budget,
                          attention=attention)
    steps, cut = [], []
    plan = engine.cache.plan

    def recorded(requests, counts, device):
        decoding = [r for r in engine.running if r.output and len(r.pending()) == 1]
        assert all(any(r is q for q in requests) for r in decoding), "a decoding request waited"
        cut.extend(r.cached + n < len(r.prompt) for r, n in zip(requests, counts))
        steps.append(list(counts))
        return plan(requests, counts, device)
    engine.cache.plan = recorded
    assert_greedy_equals_generate(model, engine, work or workload(seed=7, n=6))
    assert max(sum(s) for s in steps) <= budget, steps
    return steps, any(cut)


@pytest.mark.parametrize("budget, max_batch", [(3, 3), (5, 4), (64, 4)], ids=["below-a-block", "below-a-prompt",
                                                                              "above-every-prompt"])
def test_chunked_prefill_equals_generate(budget, max_batch):
    steps, cut = chunked_run(gpt.Model(gpt.Config(**LLAMA)), budget, max_batch)
    assert cut == (budget < 6), "the longest prompt is 6 tokens: cut below that budget only"
    assert any(len(s) > 1 and max(s) > 1 for s in steps), "a prompt's chunk ran beside decodes"


@pytest.mark.parametrize("cfg", ["gpt", "mla", "hybrid", "gather"])
def test_chunked_prefill_on_every_layer_kind(cfg):
    """Learned positions, MLA, a Mamba hybrid (its later chunks start from the state the earlier ones left), and
    the gather path, at a budget of 3 (below a block of 4 and most prompts)."""
    model = hybrid() if cfg == "hybrid" else gpt.Model(gpt.Config(**{"gpt": GPT, "mla": MLA}.get(cfg, LLAMA)))
    assert chunked_run(model, 3, 2, attention="gather" if cfg == "gather" else "paged")[1]


def test_a_chunk_blind_to_its_earlier_chunks_is_caught(monkeypatch):
    """Negative control: a prompt's later chunk reading as if nothing were cached before it."""
    real = paged_attention.layout
    monkeypatch.setattr(paged_attention, "layout", lambda tables, cached, counts, b, device: real(
        tables, [0 if n > 1 else c for c, n in zip(cached, counts)], counts, b, device))
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        chunked_run(gpt.Model(gpt.Config(**LLAMA)), 3, 3)


def test_a_hybrid_chunk_from_a_zero_state_is_caught(monkeypatch):
    """Negative control: a Mamba hybrid's later chunk started from zeros, not from its earlier chunks' state."""
    real = serve.PagedKVCache.plan

    def plan(self, requests, counts, device):
        out = real(self, requests, counts, device)
        self.segments = [(slot, fresh or n > 1, n) for slot, fresh, n in self.segments]
        return out
    monkeypatch.setattr(serve.PagedKVCache, "plan", plan)
    with pytest.raises(AssertionError, match="differ from gpt.generate's"):
        chunked_run(hybrid(), 3, 2)


def chunked_preemptions(model, b_tokens: int) -> int:
    """A 3-token prompt answering b_tokens beside a 16-token prompt cut in chunks (a budget of 4), in 5 blocks of 4,
    greedy, checked against gpt.generate: the preemptions."""
    engine = serve.Engine(model, num_blocks=5, block_size=4, max_batch=2, preempt=True, max_num_batched_tokens=4)
    assert_greedy_equals_generate(model, engine, [(0, [5, 6, 7], b_tokens), (0, list(range(20, 36)), 1)])
    return engine.preemptions


def test_preemption_counts_the_blocks_a_step_touches():
    """Answering 3 tokens, the short request holds 2 blocks at most and is gone before the long prompt's last chunk
    needs its 4th block: it fits, and is never preempted (at step 3 the short one's decode needs its 2nd block and
    the long prompt's chunk its 2nd: 2 of the 3 free). Answering 8, it still holds 3 blocks when the long one needs
    its 4th: a true shortage, and the long one is preempted and recomputed."""
    model = gpt.Model(gpt.Config(**LLAMA))
    assert chunked_preemptions(model, 3) == 0
    assert chunked_preemptions(model, 8) > 0


def test_counting_a_cut_prompts_whole_remainder_is_caught(monkeypatch):
    """Negative control: a step asking for the blocks of every running prompt's whole remainder (not its chunk's)."""
    monkeypatch.setattr(serve.Engine, "needs", lambda e: sum(
        e.blocks_for(r.cached + len(r.pending())) - len(r.blocks) for r in e.running))
    assert chunked_preemptions(gpt.Model(gpt.Config(**LLAMA)), 3) == 1


@pytest.mark.parametrize("budget", [0, -1, 3])
def test_a_budget_below_max_batch_is_refused(budget):
    with pytest.raises(ValueError, match=rf"^max_num_batched_tokens \({budget}\) must be greater than or equal to "
                                         r"max_num_seqs \(4\)$"):
        serve.Engine(gpt.Model(gpt.Config(**GPT)), 8, 4, max_batch=4, max_num_batched_tokens=budget)


def test_an_image_prompt_is_not_cut():
    model = llava.Model(llava.Config(**LLAVA, position_embedding_type="rope")).eval()
    engine = serve.Engine(model, 20, 4, max_batch=2, max_num_batched_tokens=6)
    with pytest.raises(ValueError, match=r"^a prompt with inputs \['pixel_values'\] is run whole: its 7 tokens > "
                                         r"max_num_batched_tokens=6$"):
        engine.add_request([1] + [100] * 5 + [2], pixel_values=torch.zeros(3, 8, 8))


@pytest.mark.parametrize("budget", ["0", "8"])
def test_the_server_refuses_a_budget_below_max_batch_before_loading(budget):
    from serving import server
    with pytest.raises(server.ConfigError, match=rf"^--max-num-batched-tokens \({budget}\) must be greater than or "
                                                 r"equal to --max-batch \(32, vLLM's max_num_seqs\)$"):
        server.main(["--load", "no-such-run", "--max-num-batched-tokens", budget])
