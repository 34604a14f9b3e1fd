"""serving/speculative.py — speculative decoding: a cheap drafter proposes K tokens, the model checks them in one step.

A decoding request's step feeds its last token and k <= K drafted ones (after its cached positions, as a prompt's
chunk is fed); the model's greedy tokens at those k + 1 positions accept the drafts up to the first that differs,
then add their own token there, so one step yields 1..k+1 tokens, exactly plain greedy decoding's. The rejected
drafts' keys lie past the request's cached positions: the engine gives back the blocks that held only them.
Two drafters, each writing its own layers' keys into the request's block table (the same positions):
  - DraftModel: a smaller run with the same tokenizer (vLLM's draft model): fed what it has not seen of the
    request's tokens (its keys of a rejected draft are recomputed), then k greedy tokens, one forward each;
  - MTP: the run's own first multi-token-prediction layer (deepseek.py, DeepSeek-V3's use of it): the model's final
    hidden state at the last cached position and the token after it give the next token; then its own output
    hidden state and that draft, k times (vLLM's recursion of one MTP layer).
Greedy only: a request with temperature > 0 is refused by name (rejection sampling is not implemented).
Beside them, the plain sequential oracle `speculate_one`: one request, every forward over its whole sequence, no
cache; its tokens are gpt.generate's and its accepted drafts per step are what the engine's must be.
Mirrors vLLM's `vllm/v1/spec_decode/` (draft_model.py, eagle.py's drafting loop) and the greedy path of its
`vllm/v1/sample/rejection_sampler.py`; how and why: DESIGN.md §1, "The serving engine".
Papers: Leviathan et al. 2023 (Fast inference from transformers via speculative decoding); Chen et al. 2023;
        DeepSeek-AI 2024 (DeepSeek-V3 Technical Report, §2.2: MTP).

Run:    .venv/bin/python -m pytest -q tests/test_serve_speculative.py
"""
from __future__ import annotations

import types

import torch


def accept(drafts: list[int], targets: list[int], stop=()) -> list[int]:
    """Greedy verification: the model's own tokens targets [k + 1] (after the last token, then after each draft)
    against the drafts [k] -> the step's new tokens: the drafts up to the first that differs, then the model's
    token there; cut after a stop id."""
    a = matched(drafts, targets)
    new = targets[:a + 1]
    return next((new[:i + 1] for i, t in enumerate(new) if t in stop), new)


def matched(drafts: list[int], tokens: list[int]) -> int:
    """How many drafts lead tokens: the accepted ones."""
    return next((i for i, (d, t) in enumerate(zip(drafts, tokens)) if d != t), min(len(drafts), len(tokens)))


def greedy(row: torch.Tensor) -> int:
    """The greedy token of one row of logits [V]: sampling.sample's at temperature 0 (argmax in float32)."""
    return int(row.float().argmax())


class Drafter:
    """What the engine asks of a drafter: `check` a request, `counts` (drafts per scheduled request), `propose`,
    `verify` (the step's new tokens of one request), `seen` (its verified rows of the step), `forget` (it left).
    Counts drafted and accepted tokens (vLLM's spec-decode metrics)."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        self.k, self.drafted, self.accepted, self.verified = k, 0, 0, 0

    def attach(self, engine, *models):
        """Serve `engine` (its model and these drafting ones refused if they hold a recurrent state: one token run
        through a one-block cache shows it)."""
        self.engine = engine
        for model in (engine.model, *models):
            probe = type(engine.cache)(1, 1)
            probe.plan([types.SimpleNamespace(cached=0, blocks=[0], slot=0)], [1], engine.device)
            model(torch.zeros(1, 1, dtype=torch.long, device=engine.device), position_ids=torch.zeros(
                1, 1, dtype=torch.long, device=engine.device), inference_context=probe)
            if probe.states:
                raise ValueError("speculative decoding cannot serve a model with recurrent layers: a rejected "
                                 "draft's recurrent state is not rolled back")

    def check(self, params, inputs):
        if params.temperature != 0:
            raise ValueError(f"speculative decoding serves greedy requests only: temperature={params.temperature} "
                             "(rejection sampling is not implemented)")
        if inputs:
            raise ValueError(f"speculative decoding takes no model inputs ({sorted(inputs)}): the drafter cannot see them")

    def counts(self, batch, counts) -> list[int]:
        """Drafts per scheduled request: up to K for a decode, fewer near its max_tokens (a step never yields more
        tokens than it may sample, nor caches positions admission did not reserve), within the step's token budget
        left and (preemption) the blocks no running request needs; 0 for a prompt's chunk."""
        e = self.engine
        left, out = e.budget - sum(counts), []
        free = e.cache.available() - e.needs() if e.preempt else 0
        for r, n in zip(batch, counts):
            decode = r.output and n == len(r.pending()) == 1  # (its last sampled token, nothing else, to feed)
            k = int(min(self.k, r.params.max_tokens - len(r.output) - 1, left)) if decode else 0
            while e.preempt and k and e.blocks_for(r.cached + 1 + k) - e.blocks_for(r.cached + 1) > free:
                k -= 1
            free -= e.blocks_for(r.cached + 1 + k) - e.blocks_for(r.cached + 1) if e.preempt else 0
            left -= k
            out.append(k)
        return out

    def verify(self, r, drafts: list[int], rows: torch.Tensor) -> list[int]:
        """Request r's new tokens from its rows' logits [k + 1, V] (greedy), counted."""
        new = accept(drafts, [greedy(row) for row in rows], r.params.stop)
        r.accepted.append(matched(drafts, new))
        self.drafted, self.accepted, self.verified = (self.drafted + len(drafts), self.accepted + r.accepted[-1],
                                                      self.verified + 1)
        return new

    def rollback(self, r):
        """Give back the blocks past a request's cached positions: those that held only rejected drafts' keys."""
        self.engine.cache.release(r.blocks[self.engine.blocks_for(r.cached):])
        del r.blocks[self.engine.blocks_for(r.cached):]

    def stats(self) -> dict:
        """Drafted and accepted tokens, the acceptance rate, and tokens per verifying step (accepted + 1, but at a
        stop)."""
        return dict(drafted=self.drafted, accepted=self.accepted,
                    acceptance_rate=self.accepted / max(self.drafted, 1),
                    tokens_per_step=(self.accepted + self.verified) / max(self.verified, 1))

    def seen(self, r, hidden_rows: slice):
        """After a step: request r's rows of the model's last hidden states (a drafter that reads them keeps them)."""

    def forget(self, r):
        """Request r ended or was preempted: drop what the drafter keeps for it."""

    def forward(self, requests, cached: list[int], counts: list[int], run):
        """One packed forward of the drafter: request i feeds counts[i] positions after cached[i], in its own block
        table; run(positions [T], mask or None) -> logits [T, V]; returns each request's last row's greedy token."""
        cache = self.engine.cache
        views = [types.SimpleNamespace(cached=c, blocks=r.blocks, slot=None) for r, c in zip(requests, cached)]
        pos, mask = cache.plan(views, counts, self.engine.device)
        logits = run(pos, None if mask is None else mask[None, None])
        ends = torch.tensor(counts).cumsum(0) - 1
        return [greedy(row) for row in logits[ends]]


class DraftModel(Drafter):
    """A smaller model with the same vocabulary; its keys live in the request's blocks (its own layers' pools)."""

    def __init__(self, model, k: int):
        super().__init__(k)
        self.model, self.fed = model.eval(), {}  # request id -> the tokens whose draft keys its blocks hold

    def attach(self, engine):
        super().attach(engine, self.model)
        c, t = self.model.config, engine.model.config
        if c.vocab_size != t.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({c.vocab_size} tokens) is not the model's "
                             f"({t.vocab_size}): a draft model needs the same tokenizer")
        if c.max_position_embeddings < t.max_position_embeddings:
            raise ValueError(f"the draft model's context ({c.max_position_embeddings}) is shorter than the "
                             f"model's ({t.max_position_embeddings})")

    def propose(self, requests, ks: list[int]) -> list[list[int]]:
        drafts, seqs, cached = [[] for _ in requests], [r.tokens() for r in requests], []
        for r, s in zip(requests, seqs):
            cached.append(self.kept(r, s))
        for j in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
            feed = [(seqs[i] + drafts[i])[cached[i]:] for i in live]
            ids = torch.tensor([t for f in feed for t in f], device=self.engine.device)
            tokens = self.forward([requests[i] for i in live], [cached[i] for i in live], [len(f) for f in feed],
                                  lambda pos, mask: self.model(ids[None], position_ids=pos[None], mask=mask,
                                                               inference_context=self.engine.cache)[0])
            for i, f, t in zip(live, feed, tokens):
                drafts[i].append(t)
                cached[i] += len(f)
        for i, r in enumerate(requests):
            self.fed[r.id] = (seqs[i] + drafts[i])[:cached[i]]
        return drafts

    def kept(self, r, seq: list[int]) -> int:
        """Its positions whose draft keys still hold for the request's tokens seq: those of the tokens it was fed
        that are seq's (not a rejected draft's), all but seq's last (fed again: its logits draft the first token)."""
        fed = self.fed.get(r.id, [])
        n = min(len(fed), len(seq) - 1)
        return next((i for i in range(n) if fed[i] != seq[i]), n)

    def forget(self, r):
        self.fed.pop(r.id, None)


class MTP(Drafter):
    """The model's first MTP layer. Its keys at position p come from (the model's final hidden state at p, token
    p + 1): `seen` keeps a request's verified hidden states (a forward hook on the decoder) until they are fed."""

    def __init__(self, model, k: int):
        super().__init__(k)
        if not getattr(model, "mtp_process", False):
            raise ValueError("the model has no multi-token-prediction layers (a run trained with --mtp-num-layers N "
                             "has): the MTP drafter needs them")
        self.model, self.hidden, self.fed = model, {}, {}  # request id -> [hidden [n, h] after `fed`], positions fed
        self.last = None  # the decoder's output [T, h] of the model's last forward (the engine's step)
        self.hook = model.decoder.register_forward_hook(lambda module, args, out: setattr(self, "last", out[:, 0]))

    def attach(self, engine):
        super().attach(engine)
        if engine.prefix_caching:
            raise ValueError("the MTP drafter cannot use prefix caching: a cached prefix holds no hidden states")

    def seen(self, r, rows: slice):
        self.hidden.setdefault(r.id, []).append(self.last[rows])

    def propose(self, requests, ks: list[int]) -> list[list[int]]:
        drafts = [[] for _ in requests]
        h = [torch.cat(self.hidden.pop(r.id)) for r in requests]  # positions fed .. r.cached - 1
        cached = [self.fed.get(r.id, 0) for r in requests]
        nxt = [r.tokens()[c + 1:] for r, c in zip(requests, cached)]  # the token after each of those positions
        for j in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
            ids = torch.tensor([t for i in live for t in nxt[i]], device=self.engine.device)
            hidden = torch.cat([h[i] for i in live])
            out = {}
            tokens = self.forward([requests[i] for i in live], [cached[i] for i in live], [len(nxt[i]) for i in live],
                                  lambda pos, mask: mtp_step(self.model, hidden, ids, pos, mask, self.engine.cache,
                                                             out))
            ends = torch.tensor([len(nxt[i]) for i in live]).cumsum(0) - 1
            for i, t, end in zip(live, tokens, ends):
                drafts[i].append(t)
                cached[i] += len(nxt[i])
                h[i], nxt[i] = out["hidden"][end][None], [t]  # next: its own hidden state, and this draft
        for r in requests:
            self.fed[r.id] = r.cached  # its positions fed from verified inputs; those after are drafts'
        return drafts

    def forget(self, r):
        self.hidden.pop(r.id, None)
        self.fed.pop(r.id, None)


def mtp_step(model, hidden, next_ids, pos, mask=None, cache=None, out=None):
    """The first MTP layer at positions pos [s]: the final hidden states there [s, h] and the tokens after them [s]
    -> logits [s, V] (its hidden states [s, h] in out["hidden"]), as deepseek.MTPLayer computes depth 1."""
    layer = model.mtp.layers[0]
    _, rope = model.positions(next_ids[None], pos[None], cache)
    emb = model.embedding(next_ids[None], pos[None] + 1)  # [s, 1, h]: token p + 1 at its own position
    x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden[:, None])], dim=-1))
    x = layer.final_layernorm(layer.transformer_layer(x, rope=rope, mask=mask, inference_context=cache))
    if out is not None:
        out["hidden"] = x[:, 0]
    return model.postprocess(x)[0]


# ---------------------------------------------------------------------------------------------- the plain oracle
@torch.no_grad()
def draft_one(model, tokens: list[int], k: int, draft_model=None) -> list[int]:
    """The k drafts after `tokens` (at least 2), every forward over the whole sequence: draft_model's greedy tokens,
    or (None) the model's first MTP layer's: its hidden states at positions 0..L-2 with the tokens after them, then
    its own last hidden state with each draft."""
    drafts = []
    if draft_model is not None:
        for _ in range(k):
            drafts.append(greedy(draft_model(torch.tensor([tokens + drafts]))[0, -1]))
        return drafts
    keep = {}
    hook = model.decoder.register_forward_hook(lambda module, args, out: keep.update(h=out[:, 0]))
    try:
        model(torch.tensor([tokens]))
    finally:
        hook.remove()
    h, out = keep["h"][:-1], {}  # positions 0..L-2, each with the token after it
    for _ in range(k):
        nxt = torch.tensor(tokens[1:] + drafts)
        drafts.append(greedy(mtp_step(model, h, nxt, torch.arange(len(nxt)), out=out)[-1]))
        h = torch.cat([h, out["hidden"][-1:]])
    return drafts


@torch.no_grad()
def speculate_one(model, prompt: list[int], max_tokens: int, k: int, draft_model=None, stop=()) -> tuple:
    """One request, greedy, plainly: draft_one's k drafts a step (none at the prompt's step, as the engine's
    prefill), checked by one forward of the model over the whole sequence. -> (its tokens, the drafts of each step
    that had some, the drafts each accepted)."""
    tokens, proposed, accepted = list(prompt), [], []
    while True:
        n = len(tokens) - len(prompt)
        kk = min(k, max_tokens - n - 1) if n else 0
        drafts = draft_one(model, tokens, kk, draft_model) if kk else []
        rows = model(torch.tensor([tokens + drafts]))[0, len(tokens) - 1:]  # [kk + 1, V]
        new = accept(drafts, [greedy(row) for row in rows], stop)
        if kk:
            proposed.append(drafts)
            accepted.append(matched(drafts, new))
        for t in new:
            tokens.append(t)
            if t in stop or len(tokens) - len(prompt) == max_tokens:
                return tokens[len(prompt):], proposed, accepted
