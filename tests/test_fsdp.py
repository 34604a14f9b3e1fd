"""Fully sharded data parallelism (parallel.py section 14: ZeRO-2 `optim_grads`, ZeRO-3 `optim_grads_params`) against
the single process, through the same loop and comparison as tests/test_data_parallel.py: float64 at 1e-10 relative —
the loss, every gradient after the first backward, the clipping norm at every step, all parameters after 3 steps of
AdamW with clipping. Then the negative controls, the memory per rank and the communication volume per step.

Run:  .venv/bin/python -m pytest -q tests/test_fsdp.py
"""
from __future__ import annotations

import pytest
from test_data_parallel import CFG, CLIP, LLAMA, OPT, make_batch, merge, reference

import gpt
import parallel as P
from equivalence import assert_same, clipped_steps, rel_err


def fsdp_case(rank, n, cfg, tp, pp, vp, M, sp, strategy, steps=3, sabotage=None, count=False, b=8, s=8):
    """sabotage: "wrong_shard" adds each reduce-scatter's result into the neighbour's slice; "no_regather" skips the
    all-gather before backward (ZeRO-3)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid, vp)
    fsdp = P.FSDP(chunks, grid, strategy)
    if sabotage == "wrong_shard":
        fsdp._drain = lambda bk: _drain_into_wrong_shard(fsdp, bk)
    if sabotage == "no_regather":
        fsdp.gather = lambda unit, prefetch=0, wait=True: None if prefetch == -1 else P.FSDP.gather(fsdp, unit,
                                                                                                   prefetch, wait)
    opt = P.DistributedOptimizer(fsdp, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))
    shape = (s // tp if c.sequence_parallel and tp > 1 else s, micro[0].shape[0], c.hidden_size)
    keep = lambda m, k: not (k == "output_layer.weight" and c.share_embeddings_and_output_weights)

    def first_step(log):
        return dict(grads=full_grads(chunks, fsdp, grid, keep), log=log)

    out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), shape, c.params_dtype, CLIP, steps, first_step,
                        count=count)
    with fsdp.gathered():
        params = {m.global_name(k): P.gather_full(p.data, p, grid).clone() for m in chunks for k, p in m.named_parameters()
                  if keep(m, k)}
    return dict(out, params=params)


def _drain_into_wrong_shard(fsdp, bk):
    if bk.handle is not None:
        bk.handle.wait()
        bk.grad_shard.add_(bk.recv.roll(1))  # a gradient reduced into the wrong elements of the shard
        bk.handle = bk.recv = bk.sent = None


def full_grads(chunks, fsdp, grid, keep):
    """Every parameter's whole gradient: each bucket's owned slices all-gathered, then the TP shards."""
    out = {}
    for bk in fsdp.buckets:
        whole = bk.grad_shard.new_empty(bk.end - bk.start)
        P.all_gather_single(whole, bk.grad_shard.clone(), group=bk.group.pg) if bk.group.size > 1 \
            else whole.copy_(bk.grad_shard)
        for p in bk.params:
            bk_o = fsdp.offset[p] - bk.start
            p.fsdp_grad = whole[bk_o:bk_o + p.numel()].view(p.shape)
    for m in chunks:
        for k, p in m.named_parameters():
            if keep(m, k):
                out[m.global_name(k)] = P.gather_full(p.fsdp_grad, p, grid)
    return out


CASES = {"dp2": (2, CFG, 1, 1, 1, 2, False), "tp2-sp-dp2": (4, LLAMA, 2, 1, 1, 2, True),
         "pp2-dp2": (4, CFG, 1, 2, 1, 2, False)}


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_equals_single_process(pool, case, strategy):
    n, cfg, tp, pp, vp, M, sp = CASES[case]
    res = pool.run(fsdp_case, n, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp, strategy=strategy)
    ref = reference(cfg, M * n // (tp * pp))
    got = merge(res)
    assert_same(got, ref, rtol=1e-10, what=f"{case} {strategy}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10, (got["norms"], ref["norms"])
    assert ref["norms"].min() > CLIP  # clipping was active at every step


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_gradient_reduced_into_the_wrong_shard_is_caught(pool, strategy):
    res = pool.run(fsdp_case, 2, cfg=CFG, tp=1, pp=1, vp=1, M=2, sp=False, strategy=strategy, steps=1,
                   sabotage="wrong_shard")
    with pytest.raises(AssertionError, match="at grad "):
        assert_same(merge(res), reference(CFG, 4, steps=1), rtol=1e-10, what=strategy)


def test_zero3_without_the_gather_before_backward_fails(pool):
    with pytest.raises(Exception, match="out of bounds for storage of size 0"):
        pool.run(fsdp_case, 2, cfg=CFG, tp=1, pp=1, vp=1, M=1, sp=False, strategy="optim_grads_params", steps=1,
                 sabotage="no_regather")
