"""serving/sampling.py — how a served request draws its tokens: its SamplingParams, greedy or tempered top-k / top-p.

What gpt.sample_next does for a batch, for one request's logits [V] with its own settings and its own generator (so
its tokens do not depend on which requests share its steps), and the logprobs OpenAI's API returns. The engine
(serving/engine.py) samples every request through `sample`; speculative decoding (serving/speculative.py) checks
drafts against the same greedy choice.
Mirrors Megatron-LM's `megatron/core/inference/sampling_params.py` (SamplingParams) and the sampling of its
`text_generation_controllers/text_generation_controller.py`.
Paper:  Holtzman et al. 2020 (The curious case of neural text degeneration: nucleus sampling).

Run:    .venv/bin/python -m pytest -q tests/test_serve.py -k top_
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class SamplingParams:
    """How one request samples: temperature 0 = greedy; top_k / top_p filter the distribution (None: off); `seed`
    seeds the request's own generator, so its tokens do not depend on which requests share its steps; it stops
    after max_tokens tokens or after sampling one of `stop` (that token included, as gpt.generate's eod).
    `logprobs` N in 0..MAX_LOGPROBS records, for each sampled token, its log-probability and the N most probable
    tokens' (None: off); from the raw logits, before temperature, top-k and top-p (vLLM's and OpenAI's meaning)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[int, ...] = ()
    logprobs: int | None = None


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): True for the smallest set of most probable tokens whose probability
    reaches p — token i is kept iff the tokens more probable than it sum to less than p. probs [V] -> bool [V]."""
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # [V] probability of the tokens ranked above each
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order] = before < p
    return keep


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one request's last logits [V]: greedy at temperature 0, else temperature, top-k, top-p, then a
    draw from the request's own generator. In float32, as gpt.sample_next."""
    logits = logits.float()
    if params.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(distribution(logits, params), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a sampled request draws from, logits [V] -> probabilities [V] (unnormalised after top-p: multinomial
    normalises): temperature, then top-k (the k largest logits, and any tied with the k-th), then top-p."""
    logits = logits / params.temperature
    if params.top_k is not None:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if params.top_p is not None:
        probs = probs * top_p_mask(probs, params.top_p)
    return probs


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's log-probability and the n most probable tokens' (most probable first), from one
    request's raw logits [V]: log_softmax in float32, before any temperature or filtering."""
    logp = torch.log_softmax(logits.float(), -1)  # [V]
    top = torch.topk(logp, n)
    return float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist()))


def generator(params: SamplingParams, device) -> torch.Generator:
    """A request's own random stream: from its seed, or from a seed drawn from torch's default generator."""
    seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()))
    return torch.Generator(device).manual_seed(seed)
