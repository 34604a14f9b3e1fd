"""Fully sharded data parallelism (parallel.py section 14: ZeRO-2 `optim_grads`, ZeRO-3 `optim_grads_params`) against
the single process, through the same loop and comparison as tests/test_data_parallel.py: float64 at 1e-10 relative —
the loss, every gradient after the first backward, the clipping norm at every step, all parameters after 3 steps of
AdamW with clipping. Then the negative controls, the memory per rank and the communication volume per step. Then
torch's FSDP2 (--use-torch-fsdp2, parallel.TorchFSDP2) the same way (1e-12), through train.py, and what it refuses.

Run:  .venv/bin/python -m pytest -q tests/test_fsdp.py
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from test_data_parallel import CFG, CLIP, LLAMA, OPT, make_batch, merge, reference
from test_muon import MOE, MUON
from test_muon import reference as muon_reference

import arguments
import gpt
import parallel as P
import train
from equivalence import assert_same, clipped_steps, forward_step, rel_err
from harness import assert_close, metrics, tiny, torchrun
from planning import memory
from planning.layout import Layout


def fsdp_case(rank, n, cfg, tp, pp, vp, M, sp, strategy, steps=3, sabotage=None, count=False, b=8, s=8, ep=1,
              muon=False, cp=1):
    """muon: DistributedMuon (else DistributedOptimizer's AdamW); ep: expert parallelism (cfg with experts); cp:
    context parallelism (ring attention; the cp ranks of a DP rank take the same rows).
    sabotage: "wrong_shard" adds each reduce-scatter's result into the neighbour's slice; "no_regather" skips the
    all-gather before backward (ZeRO-3)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp * cp), ep=ep, cp=cp)
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
    shape = (s // cp // (tp if c.sequence_parallel else 1), micro[0].shape[0], c.hidden_size)
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
        fsdp.inflight.remove(bk)


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
         "pp2-dp2": (4, CFG, 1, 2, 1, 2, False), "vpp2-dp2": (4, LLAMA, 1, 2, 2, 2, False),
         "cp2-dp2": (4, LLAMA, 1, 1, 1, 2, False, 2)}


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_equals_single_process(pool, case, strategy):
    n, cfg, tp, pp, vp, M, sp, cp = (CASES[case] + (1,))[:8]
    res = pool.run(fsdp_case, n, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp, strategy=strategy, cp=cp)
    ref = reference(cfg, M * n // (tp * pp * cp))
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


# ---- memory and communication per rank ---------------------------------------------------------------------------
def budget_case(rank, n, strategy, M=1, prefetch=True, dtype=torch.float64):
    """One training iteration of CFG (4 layers) at DP n, float64, inside count_collectives. Measured: the bytes of
    every storage the parameters, gradients and optimizer state hold after the step, the peak of the gathered
    buckets and of the whole gradients alive during it, the collectives, the all-gathers a prefetch had launched."""
    grid = P.Grid(dp=n)
    chunks = [gpt.Model(gpt.Config(**dict(CFG, params_dtype=dtype)), grid)]
    if strategy in ("no_shard", "optim"):
        buffers = P.DDP(chunks, grid, distributed_optimizer=strategy == "optim")
    else:
        buffers = P.FSDP(chunks, grid, strategy, prefetch=prefetch)
    opt = P.optimizer_over(buffers, P.DistributedOptimizer, **OPT)
    peak = dict(gathered=0, grads=0)
    if strategy.startswith("optim_grads"):
        gather, launch = buffers.gather, buffers._launch

        def gathering(*a, **k):
            gather(*a, **k)
            peak["gathered"] = max(peak["gathered"], sum(b.full.untyped_storage().nbytes() for b in buffers.buckets))

        def launching(b):  # the whole gradients alive: those being made and those a reduce-scatter still reads
            alive = sum(x.nbytes for bk in buffers.buckets for x in (bk.grad, bk.sent) if x is not None)
            peak["grads"] = max(peak["grads"], alive)
            launch(b)
        buffers.gather, buffers._launch = gathering, launching
    micro = list(make_batch(CFG["vocab_size"], 8, 8, 11).chunk(n)[rank].chunk(M))
    with P.count_collectives() as log:
        opt.zero_grad(M)
        P.forward_backward(chunks, micro, forward_step, 8 * 8, grid, (8, micro[0].shape[0], 32), dtype)
        opt.finish_grad_sync()
        opt.clip_grad_norm(CLIP)
        opt.step()
    storages = {}  # data_ptr -> bytes: each storage once
    held = lambda ts: sum(storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                          for t in ts if t.untyped_storage().data_ptr() not in storages)
    bks = buffers.buckets
    params = held([p for p in chunks[0].parameters()] + [b.param_shard for b in bks])
    grads = held([b.grad_shard for b in bks] + ([buffers.grad_buffer] if hasattr(buffers, "grad_buffer") else []))
    optim = held(opt.exp_avg + opt.exp_avg_sq + opt.master)
    units = [[b.end - b.start for b in u.fsdp_buckets] for u in getattr(buffers, "units", [[]])[0]]
    return dict(params=params, grads=grads, optim=optim, numel=buffers.numel, log=log, peak=peak, units=units,
                prefetched=sum(p for _, p in getattr(buffers, "gather_log", [])))


def volume(log, kind):
    return sum(nbytes for k, g, nbytes in log if k == kind and g == "dp_cp")


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_memory_per_rank_is_the_formula(pool, strategy):
    """Bytes per rank after a step (float32, e = 4 bytes; N: the flat buffers' elements, each bucket padded to a
    multiple of DP): parameters, gradients, optimizer (Adam's two moments; fp32 master weights are the parameters)
         no_shard  N·e + N·e + 2N·e         optim (ZeRO-1)  N·e + N·e + 2N·e/DP
         optim_grads (ZeRO-2)  N·e + N·e/DP + 2N·e/DP       optim_grads_params (ZeRO-3)  (N·e + N·e + 2N·e)/DP
    ZeRO-3 also holds, at the peak of the step, its gathered buckets: the root group (embedding, final norm, output
    layer: gathered from the first forward to the step's end) and two layers (the one computing, the one prefetched);
    ZeRO-2/3 the whole gradients of at most the root group and three layers (one being made, two reduce-scattering).
    planning/memory.py (state_bytes, accounting "cpu", Layout.sharding) says the same bytes."""
    dp = 2
    r = pool.run(budget_case, dp, strategy=strategy, dtype=torch.float32)[0]
    N, e = r["numel"], 4
    want = {"no_shard": (N * e, N * e, 2 * N * e), "optim": (N * e, N * e, 2 * N * e // dp),
            "optim_grads": (N * e, N * e // dp, 2 * N * e // dp),
            "optim_grads_params": (N * e // dp, N * e // dp, 2 * N * e // dp)}[strategy]
    assert (r["params"], r["grads"], r["optim"]) == want, (strategy, (r["params"], r["grads"], r["optim"]), want)
    if strategy != "no_shard":  # (the memory model's plain layout is parallel.Optimizer's, not DDP's)
        layout = Layout(seq=8, dp=dp, distributed_optimizer=strategy == "optim", sharding=strategy)
        model = memory.state_bytes(gpt.Config(**dict(CFG, params_dtype=torch.float32)), layout, 0, "cpu")
        assert (model["parameters"], model["gradients"], model["optimizer"]) == want, (strategy, model, want)
    if strategy.startswith("optim_grads"):
        root, layer = r["units"][-1][0] * e, max(u[0] for u in r["units"][:-1]) * e
        assert r["peak"]["grads"] <= root + 3 * layer, r["peak"]
    if strategy == "optim_grads_params":
        assert r["peak"]["gathered"] == root + 2 * layer, (r["peak"], root, layer)


@pytest.mark.parametrize("M", [1, 2])
def test_zero3_moves_three_times_the_parameters(pool, M):
    """Bytes per rank over DP in one step (the comm audit's convention: a collective logs the bytes of the whole
    tensor it works on): plain DP all-reduces N·e (a ring moves 2N·e: reduce-scatter + all-gather); ZeRO-1 and ZeRO-2
    reduce-scatter N·e and all-gather N·e (2N·e); ZeRO-3 all-gathers every layer before its forward and again before
    its backward and reduce-scatters its gradients, per micro-batch — 3N·e at M = 1 but for the root group, gathered
    once per step (kept from its forward to its backward, as torch FSDP2 keeps its root module). Each layer's
    all-gathers but the first's, in either direction, were prefetched; with prefetch off none is (the check can fail)."""
    e, norm = 8, 16  # (+ the gradient norm's all-reduce of [dense, expert] float64)
    dp = {s: pool.run(budget_case, 2, strategy=s, M=M)[0] for s in ("no_shard", "optim", "optim_grads",
                                                                   "optim_grads_params")}
    N = dp["optim_grads"]["numel"]
    assert volume(dp["no_shard"]["log"], "all_reduce") == dp["no_shard"]["numel"] * e
    for s in ("optim", "optim_grads"):
        rs = dp[s]["numel"] * e * (M if s == "optim_grads" else 1)  # ZeRO-2: each micro-batch's gradients
        assert (volume(dp[s]["log"], "reduce_scatter"), volume(dp[s]["log"], "all_gather")) == (rs, dp[s]["numel"] * e)
        assert volume(dp[s]["log"], "all_reduce") == norm
    z3, root = dp["optim_grads_params"], dp["optim_grads_params"]["units"][-1][0]
    layers = N - root
    assert volume(z3["log"], "reduce_scatter") == M * N * e
    assert volume(z3["log"], "all_gather") == (root + 2 * M * layers) * e
    if M == 1:
        assert volume(z3["log"], "all_gather") + volume(z3["log"], "reduce_scatter") == 3 * N * e - root * e
    assert z3["prefetched"] == 2 * M * (len(z3["units"]) - 2)  # L − 1 layers prefetched forward, L − 1 backward
    assert pool.run(budget_case, 2, strategy="optim_grads_params", M=M, prefetch=False)[0]["prefetched"] == 0


# ---- torch's FSDP2 (--use-torch-fsdp2: parallel.TorchFSDP2, fully_shard's DTensor parameters) --------------------
def fsdp2_case(rank, n, cfg, M, cp=1, steps=3, average=False):
    """TorchFSDP2 over DP x CP (cp: ring attention, the cp ranks of a DP rank take the same rows), float64, the same
    loop as fsdp_case; gradients and parameters gathered whole with DTensor.full_tensor(). average: every unit's
    gradient divided by DP x CP (fully_shard's default, the mean) instead of the sum the loss normalization needs."""
    grid = P.Grid(dp=n // cp, cp=cp)
    c = gpt.Config(**cfg)
    chunks = [gpt.Model(c, grid)]
    opt = P.TorchFSDP2(chunks, grid, **OPT)
    for m in opt.fsdp if average else ():
        m.set_gradient_divide_factor(float(n))
    batch = make_batch(cfg["vocab_size"], 8, 8, 11)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))
    whole = lambda get: {chunks[0].global_name(k): get(p).full_tensor().clone() for k, p in chunks[0].named_parameters()}
    made, rs = [], dist.reduce_scatter_single  # fully_shard's reduce-scatters (its DefaultReduceScatter calls this)
    dist.reduce_scatter_single = lambda *a, **k: made.append(1) or rs(*a, **k)
    try:
        out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), (8 // cp, micro[0].shape[0], c.hidden_size),
                            c.params_dtype, CLIP, steps, lambda log: dict(grads=whole(lambda p: p.grad)))
    finally:
        dist.reduce_scatter_single = rs
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in chunks[0].parameters())  # sharded by torch
    return dict(out, params=whole(lambda p: p), reduce_scatters=len(made), units=len(opt.fsdp))


@pytest.mark.parametrize("case,n,cfg,cp", [("dp2", 2, CFG, 1), ("cp2-dp2", 4, LLAMA, 2)])
def test_torch_fsdp2_equals_single_process(pool, case, n, cfg, cp):
    """fully_shard per layer then the root, gradient accumulation 2 (each unit reduce-scattered on the last micro-batch
    only: once a step, counted), clipping over the shards, torch's AdamW on the DTensors: loss, gradients, parameters
    after 3 steps to 1e-12."""
    res = pool.run(fsdp2_case, n, cfg=cfg, M=2, cp=cp)
    got, ref = merge(res), reference(cfg, 2 * n // cp)
    assert_same(got, ref, rtol=1e-12, what=f"torch fsdp2 {case}")
    assert res[0]["reduce_scatters"] == 3 * res[0]["units"] == 3 * (cfg["num_layers"] + 1), \
        (res[0]["reduce_scatters"], res[0]["units"])
    assert rel_err(got["norms"], ref["norms"]) < 1e-12 and ref["norms"].min() > CLIP, (got["norms"], ref["norms"])


def test_torch_fsdp2_averaging_instead_of_summing_halves_the_gradients(pool):
    """fully_shard's default divides the reduced gradient by DP; the loss is already divided by the global count
    (DESIGN.md §2), so the mean is half the gradient at DP 2: the comparison fails at a gradient, by exactly 2."""
    got, ref = merge(pool.run(fsdp2_case, 2, cfg=CFG, M=2, steps=1, average=True)), reference(CFG, 4, steps=1)
    with pytest.raises(AssertionError, match="at grad "):
        assert_same(got, ref, rtol=1e-12, what="averaged")
    assert max(rel_err(2 * got["grads"][k], g) for k, g in ref["grads"].items()) < 1e-12


# ---- train.py: the flags, a loss curve, a resumed run -----------------------------------------------------------


def same_curves(name: str, ref: dict, a: dict, b: dict, c: dict):
    """A DP 2 run (a) follows one process (ref) to 1e-5 (float32 sums in another order, over 4 steps), its resumed
    twin (b) repeats it bit for bit at iterations 3-4, and its checkpoint loaded in one process (c) goes on as ref."""
    for i in range(1, 5):
        for key in ("loss", "grad_norm"):
            assert_close(a[i][key], ref[i][key], 1e-5, f"{name} {key} at iteration {i}")
    assert sorted(b) == [1, 2, 3, 4] and all(b[i][k] == a[i][k] for i in (3, 4) for k in ("loss", "grad_norm")), \
        f"resumed {name}: {[b[i]['loss'] for i in (3, 4)]} != {[a[i]['loss'] for i in (3, 4)]}"
    for i in (3, 4):
        assert_close(c[i]["loss"], ref[i]["loss"], 1e-5, f"{name}'s checkpoint in one process, iteration {i}")


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
    same_curves(strategy, *(metrics(d)[0] for d in (one, straight, stopped, back)))


def test_train_with_torch_fsdp2_matches_one_process_resumes_exactly_and_loads_anywhere(corpus, tmp_path):
    """train.py --use-torch-fsdp2 at DP 2 in float32 logs one process's losses and gradient norms to 1e-5 (float32
    sums in another order: the two ranks' halves reduce-scattered, ~1e-7 per operation over 4 steps); stopped at 2
    and resumed, the same losses bit for bit; its DTensor shards (DCP) resume in one process, and one process's
    checkpoint resumes under FSDP2 at DP 2. (The last save follows an evaluation, whose no_grad forward leaves the root
    gathered: without full_state's reshard it fails, "'Parameter' object has no attribute 'partition_dim'".)"""
    cache, one, straight, stopped, back, forth = (tmp_path / n for n in ("cache", "one", "straight", "stopped", "back",
                                                                         "forth"))
    adam = ("--optimizer", "adam", "--save-interval", "2")  # (gpt's default optimizer is Muon)
    fsdp2 = ("--use-torch-fsdp2", *adam)
    train.main(tiny(corpus, cache, one, *adam, iters=4))
    torchrun(2, tiny(corpus, cache, straight, *fsdp2, iters=4))
    torchrun(2, tiny(corpus, cache, stopped, *fsdp2, "--exit-interval", "2", iters=4))
    torchrun(2, tiny(corpus, cache, stopped, *fsdp2, "--load", str(stopped), iters=4))
    train.main(tiny(corpus, cache, back, *adam, "--load", str(straight), "--ckpt-step", "2", iters=4))
    torchrun(2, tiny(corpus, cache, forth, *fsdp2, "--load", str(one), "--ckpt-step", "2", iters=4))
    ref = metrics(one)[0]
    same_curves("fsdp2", ref, *(metrics(r)[0] for r in (straight, stopped, back)))
    d = metrics(forth)[0]
    for i in (3, 4):
        assert_close(d[i]["loss"], ref[i]["loss"], 1e-5, f"one process's checkpoint under fsdp2, iteration {i}")


@pytest.mark.parametrize("argv,error", [
    *[(["--use-torch-fsdp2", "--optimizer", "adam", *flags], f"--use-torch-fsdp2 with {name} is not supported") for
      flags, name in [(["--use-megatron-fsdp"], "--use-megatron-fsdp"),
                      (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size > 1"),
                      (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1"),
                      (["--num-experts", "4", "--expert-model-parallel-size", "2"], "--num-experts (MoE)"),
                      (["--optimizer", "muon"], "--optimizer muon (torch's AdamW steps the shards: add --optimizer adam)"),
                      (["--fp16"], "--fp16"), (["--fp8"], "--fp8"),
                      (["--lora-rank", "4"], "--lora-rank"), (["--task", "sft"], "--task sft"),
                      (["--decoupled-lr", "1e-3"], "--decoupled-lr"),
                      (["--overlap-grad-reduce"], "--use-distributed-optimizer / --overlap-grad-reduce"),
                      (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                        "1"], "--recompute-granularity full")]],
    (["--data-parallel-sharding-strategy", "optim_grads"], "is Megatron-FSDP's: add --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--recompute-granularity",
      "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "optim_grads_params with --recompute-granularity full is not supported"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--decoupled-lr", "1e-3"],
     "optim_grads with --decoupled-lr is not supported"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--no-load-optim"],
     "optim_grads_params with --finetune / --no-load-optim / --pretrained-checkpoint is not supported"),
])
def test_what_fsdp_does_not_compose_is_refused_in_one_line(argv, error):
    with pytest.raises(arguments.ConfigError, match=re.escape(error)):
        arguments.check_args(arguments.parse_args(["--seq-length", "32"] + argv), 4)


def test_torch_fsdp2_in_one_process_is_refused():
    """fully_shard shards over a process group: one process has none (train.py makes one only under torchrun)."""
    with pytest.raises(arguments.ConfigError, match=re.escape("--use-torch-fsdp2 with one process (it shards over DP x "
                                                              "CP: run under torchrun) is not supported")):
        arguments.check_args(arguments.parse_args(["--use-torch-fsdp2", "--optimizer", "adam"]), 1)
    assert arguments.check_args(arguments.parse_args(["--use-torch-fsdp2", "--optimizer", "adam"]), 2).use_torch_fsdp2


def test_strategies_map_to_megatrons_meaning():
    a = lambda s: arguments.check_args(arguments.parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                             s]), 2)
    assert (a("no_shard").use_ddp, a("optim").use_distributed_optimizer, a("optim").use_fsdp) == (False, True, False)
    assert a("optim_grads").use_fsdp and a("optim_grads_params").use_fsdp
