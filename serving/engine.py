"""serving/engine.py — the inference engine for serving: a paged KV cache and continuous batching of many requests.

What gpt.generate does for one batch of equal prompts that start and stop together, this does for a stream of
requests that arrive at any step, each with its own prompt length, sampling settings and stopping point. Each
`Engine.step()` runs ONE forward over every running request: new requests' prompts (prefill, in chunks under a
token budget) and running requests' last tokens (decode) packed side by side in one sequence dimension, each token
at its own position and attending only to its own request's cached keys, read from the blocks through its table
(serving/paged_attention.py; the plain path beside it: the keys gathered, a block-diagonal causal mask); only the
rows a request samples after reach the output layer; a request decoding alone reads its keys as one run a layer,
gathered once and appended to at each step (PagedKVCache.run), unmasked.
The keys and values live in a paged cache (fixed-size blocks, a block table per request: Kwon et al.'s
PagedAttention); a recurrent layer (a Mamba mixer) holds a state slot per request instead; a request may carry its
own model inputs (LLaVA's image) and ask for logprobs. How and why: DESIGN.md §1, "The serving engine".
Mirrors Megatron-LM's `megatron/core/inference/contexts/dynamic_context.py` (DynamicInferenceContext: the block
pool, the per-request block tables, the packed token layout) and `engines/dynamic_engine.py` (DynamicInferenceEngine:
add_request, step, scheduling). Beside it, the plain sequential oracle: `generate_one`, one request alone in the
static KV cache (transformer.InferenceContext).
Paper:  Kwon et al. 2023 (Efficient memory management for large language model serving with PagedAttention).

Run:    .venv/bin/python -m pytest -q tests/test_serve.py tests/test_serve_paged.py

Dimension glossary
  R running requests    T tokens of this step (all requests' new tokens, packed)    K keys read this step (the
  sum of the running requests' lengths)    N blocks in the pool    B block size (positions per block)
  g key/value heads (query groups)    d head dim    V vocabulary
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import math

import torch
import torch.nn.functional as F
from einops import rearrange

from serving import paged_attention, speculative
from serving.sampling import MAX_LOGPROBS, SamplingParams, generator, sample, token_logprobs
from serving.sampling import distribution as distribution  # re-exported: serve.distribution, serve.top_p_mask
from serving.sampling import top_p_mask as top_p_mask
from transformer import InferenceContext


@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = dataclasses.field(default_factory=list)  # the sampled tokens
    blocks: list[int] = dataclasses.field(default_factory=list)  # the block table: position p -> blocks[p // B]
    cached: int = 0  # positions whose keys and values are in the blocks
    hashed: int = 0  # its first blocks offered to the prefix cache (or taken from it)
    slot: int | None = None  # its recurrent-state slot while it runs (PagedKVCache.recurrent)
    inputs: dict = dataclasses.field(default_factory=dict)  # the model's own inputs for its prompt (an image)
    new: int = 0  # tokens its last step sampled (more than one when drafts were accepted: speculative.py)
    accepted: list[int] = dataclasses.field(default_factory=list)  # drafts accepted at each step that had some
    finish_reason: str | None = None  # "length", "stop" or "abort" once finished
    # with params.logprobs = N, per sampled token: (its logprob, [(token id, logprob)] of the N most probable first)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)

    def tokens(self) -> list[int]:
        """Its sequence: the prompt, then every sampled token."""
        return self.prompt + self.output

    def pending(self) -> list[int]:
        """The tokens this step feeds, those not cached: the whole prompt first (prefill; after a preemption, the
        prompt and every token sampled so far: their keys are recomputed; with a cached prefix, the rest), then the
        last sampled token (decode)."""
        p = len(self.prompt)  # (a decode's: a slice of the output, not a copy of the whole sequence)
        return self.output[self.cached - p:] if self.cached >= p else self.prompt[self.cached:] + self.output

    def max_positions(self) -> int:
        """Positions it ever caches: the prompt and every sampled token but the last (which is never fed)."""
        return len(self.prompt) + self.params.max_tokens - 1


# ---------------------------------------------------------------------------------------------- the paged KV cache
class PagedKVCache:
    """Keys and values of every running request in fixed-size blocks (Megatron's DynamicInferenceContext): for each
    attention layer a pool K, V [N, g, B, d] (allocated at the layer's first call, never grown), one free list of
    block ids shared by the layers, and per step a plan — where this step's tokens are written and which slots each
    token reads. Passed to the model as its inference_context: `append(layer, k, v)` is what attention calls.

    Recurrent layers (a Mamba mixer: a conv state and an SSM state per sequence, no keys) call `recurrent` instead:
    each running request holds one of `max_requests` state slots (handed out at admission, back when it finishes,
    as Megatron's dynamic context keeps its "mamba state" per request), and each such layer a buffer per state
    tensor [max_requests, ...], allocated at its first call, never grown. A model without such layers never calls
    it, and its slots stay bookkeeping only.

    Prefix caching (vLLM's automatic prefix caching): a full block is kept under the exact tokens from the sequence's
    start to its end (`prefixes`), and a later request whose tokens begin alike takes it instead of computing it
    again; each block counts the block tables holding it (`refs`), and one no table holds but the prefix table does
    is `evictable`: reusable until a new block is needed and the free list is empty, then the least recently
    released is evicted."""

    def __init__(self, num_blocks: int, block_size: int, max_requests: int = 1, attention: str = "paged"):
        if attention not in ("paged", "gather"):
            raise ValueError(f"attention={attention!r}: 'paged' or 'gather'")
        self.num_blocks, self.block_size, self.max_requests = num_blocks, block_size, max_requests
        self.paged_attention = attention == "paged"  # attention layers call `attend` (else `append`, the oracle)
        self.free = list(range(num_blocks))[::-1]  # block ids, the next one handed out last (0 first: a lone
        # request's blocks follow each other, and attention reads them as a slice of the pool)
        self.pools = {}  # attention layer -> (K, V) [N, g, B, d]
        self.free_slots = list(range(max_requests))[::-1]  # recurrent-state slots, the next one handed out last
        self.states = {}  # recurrent layer -> its state tensors, each [max_requests, ...]
        self.sequence_len_offset = 0  # the static cache's counter, which gpt.Model.forward advances: unused here
        self.refs = [0] * num_blocks  # the block tables holding each block
        self.prefixes = {}  # (prefix caching) a prefix's tokens (a whole number of blocks) -> its last block
        self.prefix_of = {}  # the reverse: block -> its prefix
        self.evictable = collections.OrderedDict()  # cached blocks no table holds, least recently released first
        self.runs, self.run_table, self.lone = {}, None, None  # a lone query's keys as one run (`run`)

    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self, n: int) -> list[int]:
        assert n <= self.available(), (f"{n} blocks asked, {self.available()} free: admission should have "
                                       "prevented it")
        out = []
        for _ in range(n):
            if self.free:
                out.append(self.free.pop())
            else:  # the least recently used cached block, forgotten
                out.append(self.evictable.popitem(last=False)[0])
                del self.prefixes[self.prefix_of.pop(out[-1])]
            self.refs[out[-1]] = 1
        return out

    def release(self, blocks: list[int]):
        self.runs, self.run_table = {}, None
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.prefix_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def key(self, tokens: list[int], i: int) -> tuple:
        """What block i of a sequence holds the keys and values of: every token from the start to its end."""
        return tuple(tokens[:(i + 1) * self.block_size])

    def lookup(self, tokens: list[int], most: int) -> list[int]:
        """The cached blocks of the longest prefix of `tokens` (at most `most` blocks), taken."""
        out = []
        while len(out) < most and (b := self.prefixes.get(self.key(tokens, len(out)))) is not None:
            out.append(b)
            self.refs[b] += 1
            self.evictable.pop(b, None)
        return out

    def offer(self, tokens: list[int], table: list[int], start: int) -> int:
        """Cache the full blocks of a sequence (its `tokens` cached in `table`) from block `start` on; returns the
        full blocks offered (a prefix cached already keeps its block)."""
        full = len(tokens) // self.block_size
        for i in range(start, full):
            key = self.key(tokens, i)
            if key not in self.prefixes and table[i] not in self.prefix_of:
                self.prefixes[key], self.prefix_of[table[i]] = table[i], key
        return max(full, start)

    def slots(self, requests: list[Request], lengths: list[int], starts: list[int]) -> list[list[int]]:
        """[positions, their blocks, their offsets in them], each a list: request r's lengths[r] positions from
        starts[r] on, in the requests' order (built in Python: one tensor a step, not a few per request)."""
        B, pos, blocks = self.block_size, [], []
        for r, n, c in zip(requests, lengths, starts):
            pos += range(c, c + n)
            blocks += [r.blocks[p // B] for p in range(c, c + n)]
        return [pos, blocks, [p % B for p in pos]]

    def plan(self, requests: list[Request], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's layout: request r feeds counts[r] tokens after its `cached` ones. Stores where they are written
        and where each reads, and returns their positions [T] and, for the gather path, the attention mask [T, K]
        (True = attend): token t of request r at position p sees key j iff j is request r's, at a position <= p."""
        def ar(n):
            return torch.arange(n, device=device)
        slots = self.slots(requests, counts, [r.cached for r in requests])
        pos, *self.write = torch.tensor(slots, device=device)  # [T]; (block, offset) [T] where each is written
        lone = requests[0] if len(slots[0]) == 1 else None  # a step of one query (a request decoding alone)
        self.write_one = (slots[1][0], slots[2][0]) if lone else None  # (its key written as a plain copy)
        if lone is None or lone.blocks is not self.run_table:  # (`runs` follow one block table's lone steps)
            self.runs, self.run_table = {}, lone and lone.blocks
        self.lone = lone and lone.cached  # its query's position
        self.segments = [(r.slot, r.cached == 0, n) for r, n in zip(requests, counts)]  # for `recurrent`
        if self.paged_attention:  # each row reads its own blocks (serving/paged_attention.py)
            self.layout = paged_attention.layout([r.blocks for r in requests], [r.cached for r in requests], counts,
                                                 self.block_size, device)
            return pos, None
        key_pos, *self.read = torch.tensor(self.slots(requests, [r.cached + n for r, n in zip(requests, counts)],
                                                      [0] * len(requests)), device=device)  # [K], (block, offset) [K]
        owner = torch.repeat_interleave(ar(len(requests)), torch.tensor(counts, device=device))  # [T]
        key_owner = torch.repeat_interleave(ar(len(requests)), torch.tensor(
            [r.cached + n for r, n in zip(requests, counts)], device=device))  # [K]
        mask = (owner[:, None] == key_owner[None, :]) & (key_pos[None, :] <= pos[:, None])  # [T, K]
        return pos, mask

    def pool(self, layer, k, v):
        """A layer's (K, V) pools, this step's keys and values [1, g, T, d] written into them."""
        if layer not in self.pools:
            self.pools[layer] = tuple(t.new_zeros(self.num_blocks, t.shape[1], self.block_size, t.shape[3])
                                      for t in (k, v))
        for pool, new in zip(self.pools[layer], (k, v)):
            if self.write_one:
                pool[self.write_one[0], :, self.write_one[1]] = new[0, :, 0]  # [g, d]
            else:
                pool[self.write[0], :, self.write[1]] = new[0].transpose(0, 1)  # [T, g, d]
        return self.pools[layer]

    def attend(self, layer, q, k, v, scale: float) -> torch.Tensor:
        """Attention over the pool (the paged path): this step's q [1, n, T, d], k, v [1, g, T, d] -> [1, n, T, d]."""
        K, V = self.pool(layer, k, v)
        if self.run_table is None:
            return paged_attention.attend(K, V, q, self.layout, scale)
        k, v = self.run(layer, K, V, k, v)  # a lone query: its keys as one run, no mask
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])

    def run(self, layer, K, V, k, v):
        """A lone query's keys and values as one run [1, g, c + 1, d] (c = its position; this step's last): its
        blocks gathered once, then each lone step's key appended, as it is written to the pool. Gathering every
        block at every step copied all its keys, a layer, a token (~10 % of a lone request's step here,
        bench/README.md "Serving"). Any other step, or a block released, drops the runs."""
        c, B = self.lone, self.block_size
        runs = self.runs.get(layer)  # (K run, V run, positions held)
        if runs is None or runs[2] != c or c >= runs[0].shape[2]:  # gathered from the pool, room to double
            runs = [P.new_empty(1, P.shape[1], 2 * (c + 1), P.shape[3]) for P in (K, V)]
            for run, P in zip(runs, (K, V)):
                run[0, :, :c] = rearrange(P[self.run_table[:-(-c // B)]], "nb g b d -> g (nb b) d")[:, :c]
        for run, new in zip(runs, (k, v)):
            run[:, :, c:c + 1] = new
        self.runs[layer] = (*runs[:2], c + 1)
        return runs[0][:, :, :c + 1], runs[1][:, :, :c + 1]

    def append(self, layer, k, v):
        """The gather path (the plain oracle): this step's keys and values [1, g, T, d] -> every key and value this
        step's tokens read [1, g, K, d] (the requests' cached ones and their own, in the plan's order; the mask says
        which each token sees)."""
        return tuple(rearrange(P[self.read[0], :, self.read[1]], "k g d -> 1 g k d") for P in self.pool(layer, k, v))

    def recurrent(self, layer, fn, *xs):
        """A recurrent layer over this step's packed row: xs [1, T, ·] -> its output y [1, T, ·]. Each request runs
        fn(*its tokens [b, n, ·], state=) -> (y, the state after) from the state in its slot (a decode, or a prompt's
        later chunk), or from None (zeros) at its prompt's start, and the state after goes back into the slot.
        Decodes (one token each after a held state) run as one batch."""
        starts = [0]
        for _, _, n in self.segments:
            starts.append(starts[-1] + n)
        out = [None] * len(self.segments)
        decodes = [i for i, (_, fresh, n) in enumerate(self.segments) if not fresh and n == 1]
        if decodes:
            rows = torch.tensor([starts[i] for i in decodes], device=xs[0].device)
            slots = torch.tensor([self.segments[i][0] for i in decodes], device=xs[0].device)
            y, state = fn(*(rearrange(x[0, rows], "r e -> r 1 e") for x in xs),
                          state=tuple(t[slots] for t in self.states[layer]))
            self.keep(layer, slots, state)
            for j, i in enumerate(decodes):
                out[i] = y[j]  # [1, ·]
        for i, (slot, fresh, _) in enumerate(self.segments):
            if out[i] is None:
                held = None if fresh else tuple(t[slot:slot + 1] for t in self.states[layer])
                y, state = fn(*(x[:, starts[i]:starts[i + 1]] for x in xs), state=held)
                self.keep(layer, [slot], state)
                out[i] = y[0]  # [n, ·]
        return torch.cat(out)[None]

    def keep(self, layer, slots, state):
        """Write a recurrent layer's states [len(slots), ...] into its buffers at `slots`."""
        if layer not in self.states:
            self.states[layer] = tuple(t.new_zeros(self.max_requests, *t.shape[1:]) for t in state)
        for buffer, t in zip(self.states[layer], state):
            buffer[slots] = t


@torch.no_grad()
def generate_one(model, prompt_ids, params: SamplingParams, logprobs: list | None = None, **inputs) -> list[int]:
    """The sequential oracle the engine is tested against: one request alone, its keys and values in the static
    cache (transformer.InferenceContext), sampled as the engine samples it: a seeded request's tokens are these.
    With params.logprobs set, each token's (logprob, top logprobs), as Request.logprobs, are appended to `logprobs`.
    `inputs`: the model's own inputs for the prompt (as Engine.add_request's), given to its first forward."""
    model.eval()
    device = next(model.parameters()).device
    g, cache, out = generator(params, device), InferenceContext(), []
    ids = torch.tensor([list(prompt_ids)], device=device)  # [1, s]: the prompt, then each sampled token
    inputs = {k: v[None].to(device) for k, v in inputs.items()}  # a batch of one
    while True:
        logits = model(ids, inference_context=cache, **inputs)[0, -1]  # [V]
        inputs = {}
        out.append(sample(logits, params, g))
        if params.logprobs is not None and logprobs is not None:
            logprobs.append(token_logprobs(logits, out[-1], params.logprobs))
        if out[-1] in params.stop or len(out) == params.max_tokens:
            return out
        ids = torch.tensor([out[-1:]], device=device)


# ---------------------------------------------------------------------------------------------- the engine
class Engine:
    """Continuous batching (Megatron's DynamicInferenceEngine; Yu et al. 2022, Orca): requests are added at any
    time; each step admits waiting requests (first come, first served) while there are fewer than max_batch running
    and the free blocks cover every running request's worst case, runs one forward over all of them, samples one
    token per request and retires the finished ones, freeing their blocks and forgetting them (the engine keeps
    only unfinished requests: memory stays flat however many it serves). Admission reserves the worst case
    (prompt + max_tokens − 1 positions), so a running request never waits for a block. With preempt=True, vLLM's
    policy instead: a step asks only for the blocks its scheduled tokens touch (a prompt's chunk, not the whole
    prompt), admission admits while those fit, and when the pool cannot hold them the newest running request is
    preempted: its blocks and slot freed, it goes back to the head of the queue and, readmitted, recomputes its
    keys from its prompt and the tokens it has sampled (vLLM's recompute mode); its answer is unchanged.

    Chunked prefill (vLLM's max_num_batched_tokens): a step runs at most that many tokens: every running request's
    decode first (one token each), then prompts, in arrival order, as far as the budget left goes; a prompt cut
    short goes on next step from where it stopped (its chunk's keys cached, no token sampled until its last one), so
    decodes keep flowing while a long prompt fills. None: no budget, every prompt whole.
    attention="paged": attention layers read the blocks through the tables (serving/paged_attention.py); "gather":
    the plain path it is tested against (every key a step reads gathered, a block-diagonal mask). speculator: a
    drafter (serving/speculative.py): a decode feeds its drafts too and takes the accepted ones with its token."""

    def __init__(self, model, num_blocks: int, block_size: int, max_batch: int, preempt: bool = False,
                 prefix_caching: bool = False, max_num_batched_tokens: int | None = None, attention: str = "paged",
                 speculator: speculative.Drafter | None = None):
        if min(num_blocks, block_size, max_batch) < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}, max_batch={max_batch}: each must be >= 1")
        if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch:  # (vLLM's message)
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to "
                             f"max_num_seqs ({max_batch})")
        self.model, self.max_batch = model.eval(), max_batch  # eval: no dropout while serving
        self.budget = math.inf if max_num_batched_tokens is None else max_num_batched_tokens
        self.cache = PagedKVCache(num_blocks, block_size, max_requests=max_batch, attention=attention)
        self.device = next(model.parameters()).device
        self.context = model.config.max_position_embeddings  # the positions the model was built for
        self.requests: dict[int, Request] = {}  # the unfinished requests (waiting or running), by id
        self.next_id = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preempt, self.preemptions = preempt, 0  # (the count: how many times a request was preempted)
        self.prefix_caching, self.computed, self.reused = prefix_caching, 0, 0  # (tokens run through the model,
        # tokens whose keys and values came from the prefix cache)
        self.speculator = speculator  # speculative decoding's drafter (speculative.py), or None
        if speculator is not None:
            speculator.attach(self)

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.cache.block_size)

    def add_request(self, prompt_ids, params: SamplingParams | None = None, **inputs) -> int:
        """Queue a request (token ids, at least one) and return its id; it joins the batch at a later step. `inputs`:
        the model's own inputs for this prompt, each one sample's tensor (e.g. pixel_values [3, H, W] for the image
        whose tokens the prompt holds); the step that runs the prompt passes each stacked over its prefills."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt or params.max_tokens < 1:
            raise ValueError(f"a request needs a prompt and max_tokens >= 1 (prompt of {len(prompt)} tokens, "
                             f"max_tokens={params.max_tokens})")
        if len(prompt) + params.max_tokens > self.context:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} = "
                             f"{len(prompt) + params.max_tokens} > the model's context max_position_embeddings="
                             f"{self.context}")
        if params.top_p is not None and not 0 < params.top_p <= 1:
            raise ValueError(f"top_p={params.top_p} must be in (0, 1]")
        n = params.logprobs
        if n is not None and not (isinstance(n, int) and 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={n!r} must be None or an int in 0..{MAX_LOGPROBS}")
        if unknown := sorted(set(inputs) - set(inspect.signature(self.model.forward).parameters)):
            raise ValueError(f"inputs {unknown}: the model's forward takes no such argument")
        if inputs and len(prompt) > self.budget:
            raise ValueError(f"a prompt with inputs {sorted(inputs)} is run whole: its {len(prompt)} tokens > "
                             f"max_num_batched_tokens={self.budget}")
        if self.speculator is not None:
            self.speculator.check(params, inputs)
        r = Request(self.next_id, prompt, params, generator(params, self.device), inputs=inputs)
        if self.blocks_for(r.max_positions()) > self.cache.num_blocks:
            raise ValueError(f"request needs {self.blocks_for(r.max_positions())} blocks of {self.cache.block_size} "
                             f"positions ({r.max_positions()} positions), the pool has {self.cache.num_blocks}")
        self.next_id += 1
        self.requests[r.id] = r
        self.waiting.append(r)
        return r.id

    def needs(self) -> int:
        """The blocks the running requests need beyond those they hold: each one's worst case, or (preempt) those its
        tokens scheduled this step touch (vLLM's accounting: a prompt's later chunks ask for their blocks later)."""
        return sum(self.blocks_for(r.cached + n if self.preempt else r.max_positions()) - len(r.blocks)
                   for r, n in zip(self.running, self.schedule()))

    def schedule(self) -> list[int]:
        """This step's tokens per running request: decodes first (one each), then the prompts' chunks in arrival
        order while the budget lasts (0: it waits this step). A prompt with its own inputs (an image, spliced into
        its tokens by the model's forward) is not cut: it waits for a step with room for all of it."""
        left, counts = self.budget, {}
        for r in sorted(self.running, key=lambda r: len(r.pending()) > 1):  # (stable: arrival order otherwise)
            n = len(r.pending())
            counts[r.id] = 0 if n > left and r.inputs and r.cached == 0 else min(n, left)
            left -= counts[r.id]
        return [counts[r.id] for r in self.running]

    def admit(self):
        """Move waiting requests into the batch while a slot, the blocks they need and a token of the step's budget
        are free (with prefix caching, a request first takes the cached blocks of its prompt's longest cached
        prefix; not its last token's)."""
        while self.waiting and len(self.running) < self.max_batch and sum(self.schedule()) < self.budget:
            r = self.waiting[0]
            if self.prefix_caching and not r.inputs:  # (an image's tokens say nothing of the image)
                r.blocks = self.cache.lookup(r.tokens(), (len(r.tokens()) - 1) // self.cache.block_size)
                r.cached, r.hashed = len(r.blocks) * self.cache.block_size, len(r.blocks)
                if r.cached and self.cache.states:  # (states: the model has recurrent layers, and has run)
                    raise ValueError("prefix caching cannot serve a model with recurrent layers: a cached prefix "
                                     "holds keys and values, not the recurrent state after it")
            self.running.append(self.waiting.pop(0))  # (its share of the step: what the schedule leaves it)
            if self.needs() > self.cache.available():
                self.waiting.insert(0, self.running.pop())
                self.cache.release(r.blocks)
                r.blocks, r.cached, r.hashed = [], 0, 0
                break
            r.slot, self.reused = self.cache.free_slots.pop(), self.reused + r.cached

    def forward(self, ids, pos, mask, rows: list[int], inputs: dict) -> torch.Tensor:
        """The model over a step's packed tokens ids [T] at positions pos [T] -> the logits [len(rows), V] of its
        rows `rows` only (those a request samples after): the decoder's output at the other rows (a prompt's
        positions but its last) never reaches the output layer, as vLLM's and HF generate's logits of the last
        positions only. A forward hook on the decoder keeps the rows (after any other hook on it: a drafter's)."""
        kwargs = dict(position_ids=pos[None], mask=None if mask is None else mask[None, None],
                      inference_context=self.cache, **inputs)
        if len(rows) == len(ids):  # (every row: a step of decodes)
            return self.model(ids[None], **kwargs)[0]
        keep = torch.tensor(rows or [len(ids) - 1], device=self.device)  # (none: a step of chunks, one kept)
        hook = self.model.decoder.register_forward_hook(lambda module, args, out: out.index_select(0, keep))
        try:
            return self.model(ids[None], **kwargs)[0]
        finally:
            hook.remove()

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One forward over the running batch: the requests that sampled, each with its `new` tokens last in `output`
        (one, or more with accepted drafts) and a `finish_reason` if it finished (a prompt's chunk that is not its
        last samples nothing, and is not among them). A finished request is the engine's no more: the caller's object
        is its only reference (nothing of a request is kept after it ends)."""
        self.admit()
        while self.preempt and self.needs() > self.cache.available():
            r = self.running[-1]  # the newest: out of the batch, back to the head of the queue
            self.release(r)
            r.cached = r.hashed = 0
            self.waiting.insert(0, r)
            self.preemptions += 1
        scheduled = [(r, n) for r, n in zip(self.running, self.schedule()) if n]
        if not scheduled:
            return []
        batch, counts = map(list, zip(*scheduled))
        ks = self.speculator.counts(batch, counts) if self.speculator else [0] * len(batch)  # drafts (speculative.py)
        for r, n, k in zip(batch, counts, ks):  # grow each block table to hold this step's tokens (and drafts)
            r.blocks += self.cache.allocate(self.blocks_for(r.cached + n + k) - len(r.blocks))
        drafting = [r for r, k in zip(batch, ks) if k]
        drafts = dict(zip([r.id for r in drafting], self.speculator.propose(drafting, [k for k in ks if k]))) if drafting else {}
        fed = [r.pending()[:n] + drafts.get(r.id, []) for r, n in zip(batch, counts)]
        ids = torch.tensor([t for f in fed for t in f], device=self.device)  # [T]
        pos, mask = self.cache.plan(batch, [len(f) for f in fed], self.device)
        inputs = {}  # the prefills' own inputs, stacked in the row's order
        for r in batch:
            for k, v in (r.inputs.items() if r.cached == 0 else ()):
                inputs.setdefault(k, []).append(v)
        inputs = {k: torch.stack(v).to(self.device) for k, v in inputs.items()}
        wholes = [n == len(r.pending()) for r, n in zip(batch, counts)]  # (else a prompt's chunk, not its last)
        ends = list(itertools.accumulate(len(f) for f in fed))
        keep = [i for r, w, end in zip(batch, wholes, ends) if w for i in range(end - len(drafts.get(r.id, ())) - 1, end)]
        logits = self.forward(ids, pos, mask, keep, inputs)  # [len(keep), V]
        self.computed += len(ids)
        sampled, at, each = [], 0, logits.unbind(0)  # (each row: one op, not a slice per request)
        for r, n, f, whole, end in zip(batch, counts, fed, wholes, ends):
            start, d = end - len(f), drafts.get(r.id, [])
            rows = (logits[at:at + len(d) + 1] if d else each[at:at + 1]) if whole else ()  # [1 + k, V]: after its
            at += len(d) + 1 if whole else 0  # last token, then after each draft
            new = [] if not whole else self.speculator.verify(r, d, rows) if d else [sample(rows[0], r.params,
                                                                                           r.generator)]
            r.cached += n + max(len(new) - 1, 0)  # and its accepted drafts (a rejected one's keys lie past)
            if self.speculator:
                self.speculator.seen(r, slice(start, start + n + max(len(new) - 1, 0)))
            if self.prefix_caching and not r.inputs:  # its blocks filled up to here, cached for later requests
                r.hashed = self.cache.offer(r.tokens()[:r.cached], r.blocks, r.hashed)
            if not whole:
                continue
            sampled.append(r)
            for r.new, (token, row) in enumerate(zip(new, rows), 1):
                r.output.append(token)
                if r.params.logprobs is not None:
                    r.logprobs.append(token_logprobs(row, token, r.params.logprobs))
                if token in r.params.stop:
                    r.finish_reason = "stop"
                elif len(r.output) == r.params.max_tokens:
                    r.finish_reason = "length"
                if r.finish_reason is not None:
                    break
            if r.finish_reason is not None:
                self.retire(r)
            elif d:
                self.speculator.rollback(r)
        return sampled

    def abort(self, request_id: int):
        """Finish a request now (a client that went away): out of the queue or the batch, its blocks freed. A request
        already finished (or unknown) is left alone."""
        r = self.requests.get(request_id)
        if r is not None:
            r.finish_reason = "abort"
            if any(w is r for w in self.running):
                self.retire(r)
            else:
                self.waiting = [w for w in self.waiting if w is not r]
                del self.requests[r.id]

    def release(self, r: Request):
        """Out of the batch: its blocks and its state slot go back to the pool at once."""
        self.running.remove(r)
        self.cache.release(r.blocks)
        self.cache.free_slots.append(r.slot)
        r.blocks, r.slot = [], None
        if self.speculator:
            self.speculator.forget(r)

    def retire(self, r: Request):
        """Out of the batch and the engine."""
        self.release(r)
        self.requests.pop(r.id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> dict[int, list[int]]:
        """Step until every request added so far has finished: request id -> its sampled tokens (of each one not
        finished before the call)."""
        requests = dict(self.requests)
        while self.has_unfinished():
            self.step()
        return {i: r.output for i, r in requests.items()}
