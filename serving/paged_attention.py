"""serving/paged_attention.py — attention over the paged KV cache, each query reading its own request's blocks.

PagedAttention (Kwon et al. 2023, "Efficient memory management for large language model serving with
PagedAttention") reads keys and values straight from the block pool through each request's block table, inside the
kernel. This is that computation in torch ops, for one step's packed row of mixed decode and prefill rows:
  - decode rows (one query each) are batched as (request, block) pairs: the pair's block is read from the pool by its
    id (index_select of whole blocks, each block once), its B scores computed, and a segmented softmax over the pairs
    of each request (their max and sum gathered with scatter_reduce / index_add) weighs the blocks' values;
  - a prefill row (a prompt or a chunk of it: n queries after `cached` positions) is one SDPA over its own blocks,
    with the causal mask offset by its cached positions; so is a step's only decode, unmasked (the pairs'
    bookkeeping costs a lone query more than it saves); blocks that follow each other are read as one slice.
No [T, K] mask over every request's keys and no copy padded to the longest request. The plain path it is tested
against: PagedKVCache.append (every key the step reads, gathered, and the block-diagonal mask). bench/bench_serve.py
--attention-kernels measures it against that path and the other torch mechanisms (per-request SDPA, a padded batch,
flex_attention with a block mask).
Mirrors vLLM's `vllm/attention/ops/paged_attn.py` (paged_attention_v1 for decodes, a prefill kernel beside it).

Run:    .venv/bin/python -m pytest -q tests/test_serve_paged.py
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from einops import rearrange


@dataclasses.dataclass
class Layout:
    """Where one step's rows read: decode rows' (request, block) pairs and each prefill row's blocks."""
    decodes: torch.Tensor | None  # [R] the decode rows' indices in the packed row (None: no decode row)
    pair_row: torch.Tensor | None  # [P] each pair's decode row (0..R-1)
    pair_block: torch.Tensor | None  # [P] each pair's block id
    pair_valid: torch.Tensor | None  # bool [P, B]: the block's positions the row's query sees (its length, no further)
    prefills: list  # [(start in the row, n queries, its blocks [nb] or a slice of ids, cached positions before)]


def layout(tables: list[list[int]], cached: list[int], counts: list[int], block_size: int, device) -> Layout:
    """The layout of a step: request r's block table, its cached positions and its count of new tokens."""
    decodes, pairs, prefills, start = [], [], [], 0  # pairs: (decode row, block id, positions of it seen)
    paired = counts.count(1) > 1  # (a lone decode runs as a row of its own: faster, bench/README.md "Serving")
    for table, c, n in zip(tables, cached, counts):
        if n == 1 and paired:  # a decode: its query at position c sees positions 0..c
            decodes.append(start)
            pairs += [(len(decodes) - 1, table[j], c + 1 - j * block_size) for j in range(-(-(c + 1) // block_size))]
        else:
            run = table[:-(-(c + n) // block_size)]  # its blocks: a slice of the pool when they follow each other
            prefills.append((start, n, slice(run[0], run[-1] + 1) if run == list(range(run[0], run[-1] + 1)) else
                             torch.tensor(run, device=device), c))
        start += n
    if not pairs:
        return Layout(None, None, None, None, prefills)
    row, block, seen = torch.tensor(pairs, dtype=torch.long, device=device).unbind(1)
    return Layout(torch.tensor(decodes, dtype=torch.long, device=device), row, block,
                  torch.arange(block_size, device=device) < seen[:, None], prefills)


def attend(K: torch.Tensor, V: torch.Tensor, q: torch.Tensor, lay: Layout, scale: float) -> torch.Tensor:
    """Pools K [N, g, B, d], V [N, g, B, dv] (this step's keys already written), queries q [1, n, T, d] -> the
    attention output [1, n, T, dv]; grouped-query: query head h reads key/value head h // (n / g)."""
    g, n, dv = K.shape[1], q.shape[1], V.shape[-1]
    out = None if lay.decodes is None and len(lay.prefills) == 1 else q.new_empty(1, n, q.shape[2], dv)  # (None:
    # one request's row, its SDPA's output the step's)
    if lay.decodes is not None:
        R = len(lay.decodes)
        qp = rearrange(q[0, :, lay.decodes], "(g m) r d -> r g m d", g=g)[lay.pair_row]  # [P, g, m, d]
        s = torch.einsum("pgmd,pgbd->pgmb", qp, K.index_select(0, lay.pair_block)) * scale  # [P, g, m, B]
        s = s.masked_fill(~lay.pair_valid[:, None, None], float("-inf"))
        idx = lay.pair_row[:, None, None].expand(-1, g, n // g)
        top = s.new_full((R, g, n // g), float("-inf")).scatter_reduce_(0, idx, s.amax(-1), "amax")  # [R, g, m]
        p = torch.exp(s - top[lay.pair_row][..., None])  # [P, g, m, B]
        num = torch.einsum("pgmb,pgbd->pgmd", p, V.index_select(0, lay.pair_block))  # [P, g, m, dv]
        o = s.new_zeros(R, g, n // g, dv).index_add_(0, lay.pair_row, num)
        o = o / s.new_zeros(R, g, n // g).index_add_(0, lay.pair_row, p.sum(-1))[..., None]
        out[0, :, lay.decodes] = rearrange(o, "r g m d -> (g m) r d")
    for start, t, blocks, cached in lay.prefills:
        k, v = ((P[blocks] if isinstance(blocks, slice) else P.index_select(0, blocks)).transpose(0, 1).flatten(1, 2)
                [None, :, :cached + t] for P in (K, V))  # [nb, g, B, d] -> [1, g, cached + t, d]
        mask = None if t == 1 else torch.ones(t, cached + t, dtype=torch.bool, device=q.device).tril(cached)  # (one
        # query sees every key: unmasked, the same scores)
        o = F.scaled_dot_product_attention(q[:, :, start:start + t], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=g != n)
        if out is None:
            return o
        out[:, :, start:start + t] = o
    return out
