"""Data parallelism (bucketed, overlapped) and the distributed optimizer against the single process; the plain
optimizer (whole parameters, finalize_grads) through the same interface.

Same global batch everywhere; each DP rank takes its rows. Compared in float64 at 1e-10 relative (reduction order
only): the loss, every gradient after the first backward, the gradient norm used for clipping at every step, and all
parameters after 3 steps of AdamW with clipping.
"""
from __future__ import annotations

import pytest
import torch

import gpt
import parallel as P
from equivalence import assert_same, clipped_steps, forward_step, make_batch, reference_steps, rel_err

CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=211,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
LLAMA = dict(CFG, position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
             add_bias_linear=False, share_embeddings_and_output_weights=False)
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.05  # small enough that clipping is active, so the norm's correctness matters


def dp_case(rank, n, cfg, tp, pp, vp, M, sp, distopt, overlap, b=8, s=8, steps=3):
    """distopt None: the plain P.Optimizer (no DDP); else DDP + P.DistributedOptimizer. The same calls either way."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid, vp)
    if distopt is None:
        ddp, opt = None, P.Optimizer(chunks, grid, **OPT)
    else:
        ddp = P.DDP(chunks, grid, bucket_size=3000, overlap=overlap, distributed_optimizer=distopt)
        opt = P.DistributedOptimizer(ddp, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))
    shape = (s // tp if c.sequence_parallel and tp > 1 else s, micro[0].shape[0], c.hidden_size)

    def first_step(_):
        if ddp is None:
            return dict(grads={m.global_name(k): P.gather_full(p.grad, p, grid).clone() for m in chunks
                               for k, p in m.named_parameters()
                               if not k == "output_layer.weight" or not c.share_embeddings_and_output_weights},
                        launches=None)
        return dict(grads=full_grads(chunks, ddp, grid), launches=(list(ddp.launch_log), ddp.hooks_fired))

    out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), shape, c.params_dtype, CLIP, steps, first_step)
    params = {m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks for k, p in m.named_parameters()
              if not k == "output_layer.weight" or not c.share_embeddings_and_output_weights}
    return dict(out, params=params, buckets=len(ddp.buckets) if ddp else 0)


def full_grads(chunks, ddp, grid):
    """Every parameter's whole gradient: all-gather the DP slices (distributed optimizer), then the TP shards."""
    buf = ddp.grad_buffer.clone()
    for bk in ddp.buckets:
        if ddp.distopt and bk.group.size > 1:  # (an expert bucket's group is expert_dp)
            P.all_gather_single(buf[bk.start:bk.end], ddp.grad_buffer[ddp.owned(bk)].clone(), group=bk.group.pg)
    out, starts = {}, {}
    for bk in ddp.buckets:
        o = bk.start
        for p in bk.params:
            starts[id(p)] = o
            o += p.numel()
    for m in chunks:
        for k, p in m.named_parameters():
            if k == "output_layer.weight" and m.config.share_embeddings_and_output_weights:
                continue  # the last stage's copy of the tied embedding: the first stage reports it
            g = buf[starts[id(p)]:starts[id(p)] + p.numel()].view_as(p)
            out[m.global_name(k)] = P.gather_full(g, p, grid)
    return out


def merge(results):
    out = dict(grads={}, params={})
    for r in results:
        out["grads"].update(r["grads"])
        out["params"].update(r["params"])
    out.update(losses=results[0]["losses"], norms=results[0]["norms"])
    return out


def reference(cfg, M, b=8, s=8, steps=3):
    """The single process: torch.optim.AdamW (no decay on 1-D params) and torch's clip_grad_norm_."""
    model = gpt.Model(gpt.Config(**cfg))
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], foreach=False, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    return reference_steps(model, opt, list(batch.chunk(M)), batch[:, 1:].numel(), CLIP, steps)


@pytest.mark.parametrize("n,cfg,tp,pp,vp,M,sp,distopt", [
    (2, CFG, 1, 1, 1, 2, False, False),
    (2, LLAMA, 1, 1, 1, 1, False, True),
    (4, CFG, 1, 1, 1, 2, False, True),  # dp = 4
    (4, LLAMA, 2, 1, 1, 2, True, True),  # tp 2 (sequence parallel) x dp 2
    (4, CFG, 1, 2, 1, 2, False, True),  # pp 2 x dp 2, tied embedding across stages
    (4, LLAMA, 1, 2, 2, 2, False, False),  # interleaved pp 2 x dp 2
    (8, CFG, 2, 2, 1, 2, True, True),  # tp 2 x pp 2 x dp 2
    (2, CFG, 1, 1, 1, 2, False, None),  # the plain optimizer: dp 2
    (4, LLAMA, 2, 1, 1, 2, True, None),  # the plain optimizer: tp 2 (sequence parallel) x dp 2
    (4, CFG, 1, 2, 1, 2, False, None),  # the plain optimizer: pp 2 x dp 2, tied embedding across stages
], ids=["dp2", "dp2-distopt", "dp4-distopt", "tp2-sp-dp2-distopt", "pp2-dp2-distopt", "vpp-dp2", "tp2-pp2-dp2-distopt",
        "plain-dp2", "plain-tp2-sp-dp2", "plain-pp2-dp2"])
def test_data_parallel_equals_single_process(pool, n, cfg, tp, pp, vp, M, sp, distopt):
    res = pool.run(dp_case, n, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp, distopt=distopt, overlap=True)
    dp = n // (tp * pp)
    ref = reference(cfg, M * dp)
    got = merge(res)
    assert_same(got, ref, rtol=1e-10, what=f"n={n} tp={tp} pp={pp} vp={vp} distopt={distopt}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10, (got["norms"], ref["norms"])
    assert ref["norms"].min() > CLIP  # clipping was active at every step


def test_overlap_launches_a_bucket_before_backward_ends(pool):
    res = pool.run(dp_case, 2, cfg=CFG, tp=1, pp=1, vp=1, M=1, sp=False, distopt=False, overlap=True, steps=1)
    (log, total), buckets = res[0]["launches"], res[0]["buckets"]
    assert buckets >= 3 and len(log) == buckets
    assert min(fired for _, fired in log) < total, f"every reduction waited for the end of backward: {log}"
    res = pool.run(dp_case, 2, cfg=CFG, tp=1, pp=1, vp=1, M=1, sp=False, distopt=False, overlap=False, steps=1)
    (log, total), _ = res[0]["launches"], res[0]["buckets"]
    assert all(fired == total for _, fired in log)  # the check can fail: without overlap all launch at the end


def bf16_case(rank, n, steps=3):
    """bf16 parameters, fp32 gradient buffer and fp32 master weights (sliced over DP with the distributed optimizer)."""
    grid = P.Grid(dp=n)
    model = gpt.Model(gpt.Config(**dict(CFG, params_dtype=torch.bfloat16)), grid)
    ddp = P.DDP([model], grid, bucket_size=3000, distributed_optimizer=True)
    opt = P.DistributedOptimizer(ddp, **OPT)
    assert ddp.param_buffer.dtype == torch.bfloat16 and ddp.grad_buffer.dtype == torch.float32
    assert all(m.dtype == torch.float32 for m in opt.master)
    batch = make_batch(CFG["vocab_size"], 8, 8, 11)
    micro = [batch.chunk(n)[grid.dp.rank]]
    losses = []
    for _ in range(steps):
        opt.zero_grad(1)
        loss = P.forward_backward(model, micro, lambda m, mb: forward_step(m, mb).float(), batch[:, 1:].numel(), grid)
        ddp.finish_grad_sync()
        opt.clip_grad_norm(CLIP)
        opt.step()
        losses.append(P.all_reduce(torch.as_tensor(loss, dtype=torch.float64).reshape(1), grid.dp))
    master = torch.cat([m.clone() for m in opt.master])
    if ddp.distopt and n > 1:  # whole fp32 master weights: all-gather the slices
        full = torch.zeros_like(ddp.grad_buffer)
        for b, m in zip(ddp.buckets, opt.master):
            P.all_gather_single(full[b.start:b.end], m.clone(), group=ddp.dp.pg)
        master = full
    return dict(losses=torch.cat(losses), master=master, params=ddp.param_buffer.float().clone())


def test_bf16_params_with_fp32_master_weights(pool):
    """dp=2 with the distributed optimizer vs one rank, bf16 parameters. The layouts run bf16 matmuls on different
    batch splits, so gradients differ at bf16 resolution; Adam's update per element is at most ~lr per step
    (|m̂/√v̂| ≤ 1), so the fp32 master weights must agree to steps·lr. The bf16 parameters must be exactly the
    rounding of the fp32 master weights, on every layout."""
    two, one = pool.run(bf16_case, 2)[0], pool.run(bf16_case, 1)[0]
    assert rel_err(two["losses"], one["losses"]) < 1e-2
    assert (two["master"] - one["master"]).abs().max() <= 3 * OPT["lr"]
    for r in (one, two):
        assert torch.equal(r["params"], r["master"].bfloat16().float())
    assert not torch.equal(one["params"], one["master"])  # the check can fail: params really are bf16-rounded
