"""The memory model (costs.py section 2) against the bytes this CPU keeps, measured, at layouts across TP, SP, PP
(1F1B and interleaved), DP, CP, EP, recomputation and the optimizers (DESIGN.md §6).

Measured on every rank of a gloo world (tests/harness.py's pools): the real model at that layout (gpt.Model chunks of
parallel.build_chunks), its optimizer (train.py's choice: parallel.Optimizer, Muon, DistributedOptimizer,
DistributedMuon), one training step (parallel.forward_backward over the rank's micro-batches). Parameters: the
model's own list, element counts, Muon's eligibility and DDP's bucket group, then their bytes; gradients: the .grad
tensors or DDP's buffer; optimizer: the moments (and master weights where separate), per storage; activations: the
peak over the step of the bytes that autograd's saved tensors keep alive, per storage, parameters excluded
(torch.autograd.graph.saved_tensors_hooks; a storage counts while any saved tensor holds it). Every figure must equal
costs.memory(..., accounting="cpu") to the byte. Negative controls: the old sequence-parallel path (the column-parallel
linear keeping the gathered input) and a 1F1B count of one micro-batch in flight make the prediction fail.

Run:    .venv/bin/python -m pytest -q tests/test_costs_memory.py
"""
from __future__ import annotations

import pytest
import torch

import costs
import gpt
import parallel as P
from equivalence import forward_step, make_batch


# ---------------------------------------------------------------------------------------------- measuring
class LiveSaved:
    """saved_tensors_hooks that keep the bytes of the storages saved tensors hold alive now, and their peak."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.refs, self.live, self.peak = exclude, {}, 0, 0

    def pack(self, t):
        store = t.untyped_storage()
        return t if store.data_ptr() in self.exclude else Held(self, t, store.data_ptr(), store.nbytes())

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, Held) else x


class Held:  # one saved tensor; its storage's bytes leave the count when the last saved tensor on it is freed
    def __init__(self, owner: LiveSaved, t, ptr: int, nbytes: int):
        self.owner, self.t, self.ptr, self.nbytes = owner, t, ptr, nbytes
        owner.refs[ptr] = owner.refs.get(ptr, 0) + 1
        if owner.refs[ptr] == 1:
            owner.live += nbytes
            owner.peak = max(owner.peak, owner.live)

    def __del__(self):
        o = self.owner
        o.refs[self.ptr] -= 1
        if o.refs[self.ptr] == 0:
            del o.refs[self.ptr]
            o.live -= self.nbytes


def nbytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors`."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def model_config(config: dict, lay: costs.Layout) -> gpt.Config:
    rc = dict(recompute_granularity=lay.recompute)
    if lay.recompute == "full":
        rc.update(recompute_method=config.pop("recompute_method", "uniform"),
                  recompute_num_layers=config.pop("recompute_num_layers", 1))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[lay.dtype]
    return gpt.Config(**config, **rc, sequence_parallel=lay.sequence_parallel, params_dtype=dtype)


def memory_case(rank, n, config: dict, layout: dict, old_sp_path: bool = False):
    """This rank's measured bytes and parameter list, after one training step at `layout`."""
    lay = costs.Layout(**layout)
    grid = P.Grid(tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep)
    c = model_config(dict(config), lay)
    P.ColumnParallelLinear.save_shard = not old_sp_path
    try:
        chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid,
                                lay.vpp)
        params = [p for m in chunks for p in m.parameters()]
        group = lambda p: "expert" if getattr(p, "expert_parallel", False) else \
            "tied" if getattr(p, "shared_embedding", False) else "dense"
        listed = [(p.numel(), P.muon_eligible(p), group(p)) for p in params]
        muon = lay.optimizer == "muon"
        if lay.distributed_optimizer:
            ddp = P.DDP(chunks, grid, distributed_optimizer=True)
            opt = P.DistributedMuon(ddp) if muon else P.DistributedOptimizer(ddp)
        else:
            opt = P.Muon(chunks, grid) if muon else P.Optimizer(chunks, grid)
        M, b, s = lay.micro_batches, lay.micro_batch, lay.seq
        batch = make_batch(c.vocab_size, lay.global_batch, s, seed=7)  # [global batch, s + 1], every rank the same
        rows = batch[grid.dp.rank * M * b:(grid.dp.rank + 1) * M * b]  # this DP rank's rows
        micro = [mb.clone() for mb in rows.split(b)]  # each micro-batch its own [b, s + 1] tensor
        sp = c.sequence_parallel and lay.tp > 1
        shape = (s // lay.cp // (lay.tp if sp else 1), b, c.hidden_size)
        live = LiveSaved({p.untyped_storage().data_ptr() for p in params})
        opt.zero_grad(M)
        with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
            P.forward_backward(chunks, micro, forward_step, lay.global_batch * s, grid, shape, c.params_dtype)
        opt.finish_grad_sync()
        opt.step()
    finally:
        P.ColumnParallelLinear.save_shard = True
    if lay.distributed_optimizer:
        state = dict(parameters=nbytes([ddp.param_buffer]), gradients=nbytes([ddp.grad_buffer]),
                     optimizer=nbytes(opt.exp_avg + opt.exp_avg_sq + [m for m in opt.master
                                                                       if m.dtype != ddp.param_buffer.dtype]))
    else:
        st_ = opt.adam.state
        state = dict(parameters=nbytes(params), gradients=nbytes([p.grad for p in params]),
                     optimizer=nbytes([st_[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]))
    return dict(state, activations=live.peak, stage=grid.pp.rank, listed=listed)


# ---------------------------------------------------------------------------------------------- the layouts
TINY = dict(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=100, make_vocab_size_divisible_by=8,
            max_position_embeddings=16)
# (world, layout, config changes): >= 20 layouts over every dimension the model covers
LAYOUTS = [
    (1, dict(seq=8, micro_batch=2, global_batch=2), {}),
    (1, dict(seq=8, micro_batch=1, global_batch=3, recompute="selective"), {}),
    (1, dict(seq=8, micro_batch=2, global_batch=2, recompute="full"), dict(recompute_num_layers=2)),
    (1, dict(seq=8, micro_batch=2, global_batch=2, recompute="full"), dict(recompute_method="block",
                                                                          recompute_num_layers=3)),
    (1, dict(seq=8, micro_batch=2, global_batch=2, optimizer="muon"), dict(share_embeddings_and_output_weights=False)),
    (1, dict(seq=8, micro_batch=2, global_batch=2), dict(position_embedding_type="rope", normalization="RMSNorm",
                                                         gated_linear_unit=True, activation="silu",
                                                         add_bias_linear=False)),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2), {}),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2, sequence_parallel=True), {}),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2, sequence_parallel=True, recompute="selective"), {}),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2, sequence_parallel=True, recompute="full"), {}),
    (2, dict(seq=8, tp=2, micro_batch=1, global_batch=2, recompute="selective", optimizer="muon"), {}),
    (2, dict(seq=8, pp=2, micro_batch=1, global_batch=4), {}),
    (2, dict(seq=8, pp=2, micro_batch=2, global_batch=2), dict(share_embeddings_and_output_weights=False)),
    (2, dict(seq=8, pp=2, vpp=2, micro_batch=1, global_batch=4), {}),
    (2, dict(seq=8, pp=2, micro_batch=1, global_batch=4, recompute="full"), {}),
    (2, dict(seq=8, dp=2, micro_batch=1, global_batch=4), {}),
    (2, dict(seq=8, dp=2, micro_batch=1, global_batch=2, distributed_optimizer=True), {}),
    (2, dict(seq=8, dp=2, micro_batch=1, global_batch=2, distributed_optimizer=True, optimizer="muon"), {}),
    (2, dict(seq=8, dp=2, micro_batch=1, global_batch=2, distributed_optimizer=True, dtype="bf16"), {}),
    (2, dict(seq=8, dp=2, ep=2, micro_batch=1, global_batch=2, distributed_optimizer=True),
     dict(num_experts=4, moe_router_topk=2)),
    (2, dict(seq=8, cp=2, micro_batch=2, global_batch=2), dict(attention_dropout=0.0)),
    (2, dict(seq=8, cp=2, micro_batch=1, global_batch=1), dict(attention_dropout=0.0, position_embedding_type="rope",
                                                                 qk_layernorm=True)),
    (4, dict(seq=8, tp=2, cp=2, micro_batch=1, global_batch=1, sequence_parallel=True), dict(attention_dropout=0.0)),
    (4, dict(seq=8, tp=2, pp=2, micro_batch=1, global_batch=4, sequence_parallel=True), {}),
    (4, dict(seq=8, tp=2, dp=2, micro_batch=1, global_batch=2, sequence_parallel=True, distributed_optimizer=True), {}),
    (4, dict(seq=8, pp=2, dp=2, micro_batch=1, global_batch=4, distributed_optimizer=True), {}),
    (4, dict(seq=8, pp=4, micro_batch=1, global_batch=4), {}),
]


def check(pool, n, layout, change, what=("parameters", "gradients", "optimizer", "activations"), **kw):
    config = dict(TINY, **change)
    lay = costs.Layout(**layout)
    res = pool.run(memory_case, n, config=config, layout=layout, **kw)
    c = model_config(dict(config), lay)
    for r in res:  # every rank against the prediction for its pipeline stage
        want = costs.state_bytes(c, lay, r["stage"], "cpu")
        chunk_bytes = [costs.chunk_activations(c, lay, *ch, "cpu") for ch in costs.chunks(c, lay, r["stage"])]
        want["activations"] = costs.in_flight(chunk_bytes, lay, r["stage"])
        assert r["listed"] == [tuple(p)[:3] for p in costs.stage_parameters(c, lay, r["stage"])]
        for k in what:
            assert r[k] == want[k], f"{k}: measured {r[k]:,} B, the model says {want[k]:,} B (stage {r['stage']})"
    most = costs.memory(c, lay, "cpu")  # the rank that holds the most
    assert most["total"] == max(sum(r[k] for k in ("parameters", "gradients", "optimizer", "activations"))
                                for r in res)
    return res


@pytest.mark.parametrize("n,layout,change", LAYOUTS, ids=[
    ",".join(f"{k}={v}" for k, v in {**lay, **ch}.items() if k not in ("seq",)) for _, lay, ch in LAYOUTS])
def test_memory_matches_measured_bytes(pool, n, layout, change):
    check(pool, n, layout, change)
