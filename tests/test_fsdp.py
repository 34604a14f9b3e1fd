"""Fully sharded data parallelism (parallel.py section 14: ZeRO-2 `optim_grads`, ZeRO-3 `optim_grads_params`) against
the single process, through the same loop and comparison as tests/test_data_parallel.py: float64 at 1e-10 relative —
the loss, every gradient after the first backward, the clipping norm at every step, all parameters after 3 steps of
AdamW with clipping. Then the negative controls, the memory per rank and the communication volume per step.

Run:  .venv/bin/python -m pytest -q tests/test_fsdp.py
"""
from __future__ import annotations

import re

import pytest
import test_train
from test_data_parallel import CFG, CLIP, LLAMA, OPT, make_batch, merge, reference
from test_muon import MOE, MUON
from test_muon import reference as muon_reference
from test_train import assert_close, metrics, tiny, torchrun

import arguments
import gpt
import parallel as P
import train
from equivalence import assert_same, clipped_steps, rel_err


def fsdp_case(rank, n, cfg, tp, pp, vp, M, sp, strategy, steps=3, sabotage=None, count=False, b=8, s=8, ep=1,
              muon=False):
    """muon: DistributedMuon (else DistributedOptimizer's AdamW); ep: expert parallelism (cfg with experts).
    sabotage: "wrong_shard" adds each reduce-scatter's result into the neighbour's slice; "no_regather" skips the
    all-gather before backward (ZeRO-3)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp), ep=ep)
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid, vp)
    fsdp = P.FSDP(chunks, grid, strategy)
    if sabotage == "wrong_shard":
        fsdp._drain = lambda bk: _drain_into_wrong_shard(fsdp, bk)
    if sabotage == "no_regather":
        fsdp.gather = lambda unit, prefetch=0, wait=True: None if prefetch == -1 else P.FSDP.gather(fsdp, unit,
                                                                                                   prefetch, wait)
    opt = P.optimizer_over(fsdp, P.DistributedMuon, **MUON, **OPT) if muon else \
        P.optimizer_over(fsdp, P.DistributedOptimizer, **OPT)
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
def test_fsdp_with_muon_and_experts_equals_single_process(pool, strategy):
    """Muon (each bucket's matrices gathered whole for Newton-Schulz, as DistributedMuon) on a MoE model at EP 2 x DP 4:
    the expert buckets sharded over expert_dp (2), the dense ones over DP (4)."""
    got = merge(pool.run(fsdp_case, 4, cfg=MOE, tp=1, pp=1, vp=1, M=2, sp=False, strategy=strategy, ep=2, muon=True))
    ref = muon_reference(cfg=MOE, M=2 * 4)
    assert_same(got, ref, rtol=1e-10, what=f"muon moe ep2 {strategy}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10


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


# ---- train.py: the flags, a loss curve, a resumed run -----------------------------------------------------------
corpus = test_train.corpus  # test_train's fixture: the synthetic corpus


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_train_at_dp2_matches_one_process_resumes_exactly_and_loads_anywhere(corpus, tmp_path, strategy):
    """train.py at DP 2 in float32 logs one process's losses (1e-5); stopped at 2 and resumed, the same losses bit for
    bit; its checkpoint (whole tensors, as every layout's) resumes in one process."""
    cache, one, straight, stopped, back = (tmp_path / n for n in ("cache", "one", "straight", "stopped", "back"))
    fsdp = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy, "--save-interval", "2")
    train.main(tiny(corpus, cache, one, iters=4))
    torchrun(2, tiny(corpus, cache, straight, *fsdp, iters=4))
    torchrun(2, tiny(corpus, cache, stopped, *fsdp, "--exit-interval", "2", iters=4))
    torchrun(2, tiny(corpus, cache, stopped, *fsdp, "--load", str(stopped), iters=4))
    train.main(tiny(corpus, cache, back, "--load", str(straight), "--ckpt-step", "2", iters=4))
    ref, a, b, c = (metrics(d)[0] for d in (one, straight, stopped, back))
    for i in range(1, 5):
        for key in ("loss", "grad_norm"):
            assert_close(a[i][key], ref[i][key], 1e-5, f"{strategy} {key} at iteration {i}")
    assert sorted(b) == [1, 2, 3, 4] and all(b[i][k] == a[i][k] for i in (3, 4) for k in ("loss", "grad_norm")), \
        f"resumed {strategy}: {[b[i]['loss'] for i in (3, 4)]} != {[a[i]['loss'] for i in (3, 4)]}"
    for i in (3, 4):
        assert_close(c[i]["loss"], ref[i]["loss"], 1e-5, f"{strategy}'s checkpoint in one process, iteration {i}")


@pytest.mark.parametrize("argv,error", [
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 is not supported: torch's fully_shard is not wired here"),
    (["--data-parallel-sharding-strategy", "optim_grads"], "is Megatron-FSDP's: add --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--recompute-granularity",
      "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "optim_grads_params with --recompute-granularity full is not supported"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--context-parallel-size", "2"],
     "optim_grads with --context-parallel-size=2 is not supported"),
])
def test_what_fsdp_does_not_compose_is_refused_in_one_line(argv, error):
    with pytest.raises(arguments.ConfigError, match=re.escape(error)):
        arguments.check_args(arguments.parse_args(["--seq-length", "32"] + argv), 4)


def test_strategies_map_to_megatrons_meaning():
    a = lambda s: arguments.check_args(arguments.parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                             s]), 2)
    assert (a("no_shard").use_ddp, a("optim").use_distributed_optimizer, a("optim").use_fsdp) == (False, True, False)
    assert a("optim_grads").use_fsdp and a("optim_grads_params").use_fsdp
