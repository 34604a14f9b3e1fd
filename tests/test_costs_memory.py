"""The memory model (planning/memory.py) against the bytes this CPU keeps, measured, at layouts across TP, SP, PP
(1F1B and interleaved), DP, CP, EP, recomputation and the optimizers (DESIGN.md §6).

Measured on every rank of a gloo world (tests/harness.py's pools): the real model at that layout (gpt.Model chunks of
parallel.build_chunks), its optimizer (train.py's choice: parallel.Optimizer, Muon, DistributedOptimizer,
DistributedMuon), one training step (parallel.forward_backward over the rank's micro-batches). Parameters: the
model's own list, element counts, Muon's eligibility and DDP's bucket group, then their bytes; gradients: the .grad
tensors or DDP's buffer; optimizer: the moments (and master weights where separate), per storage; activations: the
peak over the step of the bytes that autograd's saved tensors keep alive, per storage, parameters excluded
(torch.autograd.graph.saved_tensors_hooks; a storage counts while any saved tensor holds it). Every figure must equal
memory.memory(..., accounting="cpu") to the byte (MoE: given the rows each rank's experts received). Negative controls:
the old sequence-parallel path (the column-parallel linear keeping the gathered input), a 1F1B count of one micro-batch
in flight, MoE's balanced routing and a left-out dispatcher buffer make the prediction fail.

Run:    .venv/bin/python -m pytest -q tests/test_costs_memory.py
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpt
import parallel as P
from equivalence import forward_step, make_batch
from planning import memory
from planning.layout import Layout
from transformer import InferenceContext


# ---------------------------------------------------------------------------------------------- measuring
class LiveSaved:
    """saved_tensors_hooks that keep the bytes of the storages saved tensors hold alive now, and their peak. A saved
    tensor is held detached: a node saving its own output would otherwise hold itself alive (node -> Held -> output
    -> grad_fn = node), a cycle autograd's own saving avoids (e.g. the MoE router's softmax, outside the loss's graph
    without an aux loss, would outlive its micro-batch)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.refs, self.live, self.peak = exclude, {}, 0, 0

    def pack(self, t):
        store = t.untyped_storage()
        return t if store.data_ptr() in self.exclude else Held(self, t.detach(), store.data_ptr(), store.nbytes())

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


def model_config(config: dict, lay: Layout) -> gpt.Config:
    rc = dict(recompute_granularity=lay.recompute)
    if lay.recompute == "full":
        rc.update(recompute_method=config.pop("recompute_method", "uniform"),
                  recompute_num_layers=config.pop("recompute_num_layers", 1))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[lay.dtype]
    return gpt.Config(**config, **rc, sequence_parallel=lay.sequence_parallel, params_dtype=dtype)


def memory_case(rank, n, config: dict, layout: dict, old_sp_path: bool = False):
    """This rank's measured bytes and parameter list, after one training step at `layout`."""
    lay = Layout(**layout)
    grid = P.Grid(tp=lay.tp, pp=lay.pp, dp=lay.dp, cp=lay.cp, ep=lay.ep)
    c = model_config(dict(config), lay)
    P.ColumnParallelLinear.save_shard = not old_sp_path
    try:
        chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid,
                                lay.vpp)
        params = [p for m in chunks for p in m.parameters()]
        routed = {}  # MoE: the rows each layer's local experts receive (global layer; MTP depth d: num_layers + d)
        for m in chunks:
            for name, mod in m.named_modules():
                if isinstance(mod, P.GroupedMLP):
                    _, _, k, *_ = name.split(".")  # decoder.layers.k... or mtp.layers.k...
                    key = (m.layer_offset if name.startswith("decoder") else c.num_layers) + int(k)
                    mod.register_forward_pre_hook(lambda mod, args, key=key: routed.__setitem__(key, len(args[0])))
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
    return dict(state, activations=live.peak, stage=grid.pp.rank, listed=listed, routed=routed)


# ---------------------------------------------------------------------------------------------- the layouts
TINY = dict(num_layers=4, hidden_size=16, num_attention_heads=4, vocab_size=100, make_vocab_size_divisible_by=8,
            max_position_embeddings=16)
MLA = dict(multi_latent_attention=True, position_embedding_type="rope", q_lora_rank=12, kv_lora_rank=8, qk_head_dim=4,
           qk_pos_emb_head_dim=2, v_head_dim=4, mtp_num_layers=1)
MOE = dict(num_experts=4, moe_router_topk=2)
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
    (2, dict(seq=8, cp=2, micro_batch=2, global_batch=2), dict(attention_dropout=0.0)),
    (2, dict(seq=8, cp=2, micro_batch=1, global_batch=1), dict(attention_dropout=0.0, position_embedding_type="rope",
                                                                 qk_layernorm=True)),
    (4, dict(seq=8, tp=2, cp=2, micro_batch=1, global_batch=1, sequence_parallel=True), dict(attention_dropout=0.0)),
    (4, dict(seq=8, tp=2, pp=2, micro_batch=1, global_batch=4, sequence_parallel=True), {}),
    (4, dict(seq=8, tp=2, dp=2, micro_batch=1, global_batch=2, sequence_parallel=True, distributed_optimizer=True), {}),
    (4, dict(seq=8, pp=2, dp=2, micro_batch=1, global_batch=4, distributed_optimizer=True), {}),
    (4, dict(seq=8, pp=4, micro_batch=1, global_batch=4), {}),
    # DeepSeek-V3's multi-latent attention (with and without q-lora) and MTP depths
    (1, dict(seq=8, micro_batch=2, global_batch=2), MLA),
    (1, dict(seq=8, micro_batch=2, global_batch=2, dtype="bf16"), dict(MLA, q_lora_rank=None, normalization="RMSNorm",
                                                                       attention_dropout=0.0, mtp_num_layers=2)),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2), dict(MLA, q_lora_rank=None)),
    (2, dict(seq=8, tp=2, micro_batch=1, global_batch=1, sequence_parallel=True), dict(MLA, normalization="RMSNorm")),
    (2, dict(seq=8, pp=2, micro_batch=1, global_batch=2), dict(mtp_num_layers=2, share_embeddings_and_output_weights=False)),
    # MoE (one micro-batch per rank: the experts' rows depend on its routing), the router's variants, EP, TP
    (1, dict(seq=8, micro_batch=2, global_batch=2), dict(MOE, moe_shared_expert_intermediate_size=8, gated_linear_unit=True,
                                                         activation="silu", moe_aux_loss_coeff=0.01)),
    (1, dict(seq=8, micro_batch=2, global_batch=2, dtype="bf16"), dict(MOE, moe_router_pre_softmax=True)),
    (2, dict(seq=8, dp=2, ep=2, micro_batch=1, global_batch=2), dict(MOE, moe_token_dispatcher_type="alltoall",
                                                                     moe_shared_expert_intermediate_size=8,
                                                                     moe_shared_expert_gate=True)),
    (2, dict(seq=8, dp=2, ep=2, micro_batch=2, global_batch=4), dict(MOE, moe_aux_loss_coeff=0.01)),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2), dict(MOE, moe_shared_expert_intermediate_size=8)),
    (2, dict(seq=8, tp=2, micro_batch=1, global_batch=1, sequence_parallel=True), dict(MOE,
                                                                                      moe_token_dispatcher_type="alltoall")),
    (2, dict(seq=8, pp=2, micro_batch=1, global_batch=2), dict(MLA, **MOE, mtp_num_layers=2)),
    (1, dict(seq=8, micro_batch=2, global_batch=2, recompute="full"), dict(MOE, recompute_num_layers=2)),
    (2, dict(seq=8, dp=2, ep=2, micro_batch=2, global_batch=4), dict(MOE, moe_expert_capacity_factor=1.0)),
    (1, dict(seq=8, micro_batch=2, global_batch=2), dict(MOE, moe_router_pre_softmax=True, moe_z_loss_coeff=1e-3,
                                                         moe_aux_loss_coeff=0.01)),
    (2, dict(seq=8, tp=2, micro_batch=2, global_batch=2, sequence_parallel=True), dict(
        MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=2,
        moe_router_group_topk=1, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
        moe_z_loss_coeff=1e-3)),
    (4, dict(seq=8, tp=2, dp=2, ep=2, micro_batch=1, global_batch=2, sequence_parallel=True),
     dict(MOE, moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=8)),
]


STATE = ("parameters", "gradients", "optimizer")


def check(pool, n, layout, change, what=STATE + ("activations",), routing=True, **kw):
    """Every rank's measured bytes against the model's prediction for it (MoE: given the rows its experts received, unless
    `routing` is False: balanced routing, the model's default)."""
    config = dict(TINY, **change)
    lay = Layout(**layout)
    res = pool.run(memory_case, n, config=config, layout=layout, **kw)
    c = model_config(dict(config), lay)
    for r in res:  # every rank against the prediction for its pipeline stage
        want = memory.state_bytes(c, lay, r["stage"], "cpu")
        chunk_bytes = [memory.chunk_activations(c, lay, *ch, "cpu", routed=r["routed"] if routing else None)
                       for ch in memory.chunks(c, lay, r["stage"])]
        want["activations"] = memory.in_flight(chunk_bytes, lay, r["stage"])
        assert r["listed"] == [tuple(p)[:3] for p in memory.stage_parameters(c, lay, r["stage"])]
        for k in what:
            assert r[k] == want[k], f"{k}: measured {r[k]:,} B, the model says {want[k]:,} B (stage {r['stage']})"
    most = memory.memory(c, lay, "cpu")  # the rank that holds the most
    assert most["total"] == max(sum(r[k] for k in STATE + ("activations",)) for r in res) or \
        "activations" not in what or any(r["routed"] for r in res)  # (MoE: memory.memory assumes balanced routing)
    return res, c, lay


@pytest.mark.parametrize("n,layout,change", LAYOUTS, ids=[
    ",".join(f"{k}={v}" for k, v in {**lay, **ch}.items() if k not in ("seq",)) for _, lay, ch in LAYOUTS])
def test_memory_matches_measured_bytes(pool, n, layout, change):
    check(pool, n, layout, change)


def test_moe_state_matches_measured_bytes(pool):
    """MoE under EP: each rank's E/ep experts in buckets of their own, sharded over expert_dp; its activations given
    the rows each rank's experts received (memory.moe_experts)."""
    check(pool, 2, dict(seq=8, dp=2, ep=2, micro_batch=1, global_batch=2, distributed_optimizer=True),
          dict(num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=8))


def test_moe_items_fail_the_prediction_when_left_out(pool, monkeypatch):
    """Negative controls at EP 2 (all-to-all): balanced routing (the model's default, not the rows each rank's experts
    received) mispredicts, and so does leaving out the dispatcher's (token, expert) pairs (int64 [s·b·k, 2])."""
    layout, change = dict(seq=8, dp=2, ep=2, micro_batch=1, global_batch=2), dict(MOE, moe_token_dispatcher_type="alltoall")
    check(pool, 2, layout, change)  # (exact as it is)
    with pytest.raises(AssertionError, match="activations: measured"):
        check(pool, 2, layout, change, routing=False)
    experts = memory.moe_experts
    monkeypatch.setattr(memory, "moe_experts", lambda c, lay, *a: experts(c, lay, *a) - 16 * lay.seq * lay.micro_batch *
                        c.moe_router_topk)
    with pytest.raises(AssertionError, match="activations: measured"):
        check(pool, 2, layout, change)



@pytest.mark.parametrize("n,layout,change", [
    (2, dict(seq=8, tp=2, micro_batch=1, global_batch=1, sequence_parallel=True), MLA),
    (2, dict(seq=8, pp=2, micro_batch=1, global_batch=2), dict(MLA, q_lora_rank=None)),
    (2, dict(seq=8, pp=2, micro_batch=1, global_batch=2), dict(mtp_num_layers=1, share_embeddings_and_output_weights=False,
                                                               position_embedding_type="learned_absolute")),
    (2, dict(seq=8, dp=2, micro_batch=1, global_batch=2, distributed_optimizer=True, optimizer="muon"),
     dict(MLA, mtp_num_layers=2, num_experts=4, moe_router_topk=2, normalization="RMSNorm"))],
    ids=["tp2-sp", "pp2-no-q-lora", "pp2-mtp-untied-learned", "dp2-distmuon-moe-mtp2"])
def test_mla_and_mtp_state_matches_measured_bytes(pool, n, layout, change):
    """DeepSeek-V3's pieces: multi-latent attention (its replicated down projections, the latents' norms, the split up
    projections) and MTP depths on the last stage (their embedding's copy synced as a tied one); their activations
    too (MoE's given the rows its experts received)."""
    check(pool, n, layout, change)


@given(heads=st.sampled_from([2, 4]), head_dim=st.sampled_from([2, 4, 8]), layers=st.sampled_from([2, 4]),
       seq=st.sampled_from([4, 8, 12]), b=st.integers(1, 3), vocab=st.integers(40, 130),
       split=st.sampled_from(["tp", "tp+sp", "pp", "dp", "cp"]), recompute=st.sampled_from([None, "selective", "full"]))
def test_memory_at_drawn_sizes(pool, heads, head_dim, layers, seq, b, vocab, split, recompute):
    """Sizes and one two-way split drawn; the wide sweep under HYPOTHESIS_PROFILE=deep."""
    dims = dict(tp=2) if split.startswith("tp") else {split: 2}
    change = dict(num_layers=layers, hidden_size=heads * head_dim, num_attention_heads=heads, vocab_size=vocab)
    if split == "cp":
        change["attention_dropout"] = 0.0
    check(pool, 2, dict(seq=seq, micro_batch=b, global_batch=2 * b, sequence_parallel=split == "tp+sp",
                        recompute=recompute, **dims), change)


def test_old_sequence_parallel_path_fails_the_prediction(pool):
    """Negative control: the oracle path of an SP column-parallel linear (parallel.ColumnParallelLinear.save_shard
    False) keeps the gathered input [s, b, h] of linear_qkv, linear_fc1 and the output layer on every TP rank, which
    the model's /t does not predict."""
    layout = dict(seq=8, tp=2, micro_batch=2, global_batch=2, sequence_parallel=True)
    check(pool, 2, layout, {})  # (the same layout passes on the new path)
    with pytest.raises(AssertionError, match="activations: measured"):
        check(pool, 2, layout, {}, old_sp_path=True)


def test_pipeline_keeps_p_minus_r_micro_batches(pool):
    """1F1B on PP 2 with 4 micro-batches: stage 0 holds two micro-batches' activations at its peak, stage 1 one;
    negative control: one micro-batch in flight (no pipeline) undercounts stage 0."""
    res, c, lay = check(pool, 2, dict(seq=8, pp=2, micro_batch=1, global_batch=4), {})
    for r in res:
        (kept, _), = [memory.chunk_activations(c, lay, *ch, "cpu") for ch in memory.chunks(c, lay, r["stage"])]
        assert r["activations"] == (2 - r["stage"]) * kept
        if r["stage"] == 0:
            assert r["activations"] != memory.in_flight([(kept, kept)], dataclasses.replace(lay, pp=1), 0)


def test_kv_cache_bytes():
    """kv_cache_bytes against transformer.InferenceContext's buffers after a prefill (GQA: g key/value heads)."""
    c = gpt.Config(**dict(TINY, num_query_groups=2))
    model, cache = gpt.Model(c).eval(), InferenceContext(max_sequence_length=12)
    with torch.no_grad():
        model(torch.randint(0, c.vocab_size, (3, 5)), inference_context=cache)
    got = sum(t.untyped_storage().nbytes() for kv in cache.key_value_memory_dict.values() for t in kv)
    assert got == memory.kv_cache_bytes(c, batch=3, seq=12, dtype_bytes=4) == 2 * 4 * 3 * 2 * 12 * 4 * 4


# ---------------------------------------------------------------------------------------------- the papers' numbers
def test_gpu_accounting_is_the_papers():
    """Korthikanti et al. 2022, Table 2 (per layer, 16-bit, in s·b·h bytes): 34 + 5as/h; TP 10 + 24/t + 5as/(ht);
    TP + SP (34 + 5as/h)/t; selective 34/t; full 2 (/t with SP). Megatron's bytes per parameter (DESIGN.md §4): bf16
    18, distributed optimizer 6 + 12/d; fp32 16, 8 + 8/d. The interleaved schedule's first stage holds
    1 + (p − 1)/(p·v) times the layers' activations (Megatron's theoretical_memory_usage.py)."""
    s, b, h, a = 128, 2, 256, 8
    c = gpt.Config(num_layers=1, hidden_size=h, num_attention_heads=a)
    for t, sp, rc, per in [(1, False, None, 34 + 5 * a * s / h), (2, False, None, 10 + 24 / 2 + 5 * a * s / (h * 2)),
                           (4, True, None, (34 + 5 * a * s / h) / 4), (4, True, "selective", 34 / 4),
                           (2, False, "full", 2), (2, True, "full", 1)]:
        lay = Layout(seq=s, micro_batch=b, tp=t, sequence_parallel=sp, recompute=rc, dtype="bf16")
        cc = dataclasses.replace(c, recompute_granularity=rc, **(dict(recompute_method="uniform", recompute_num_layers=1)
                                                                 if rc == "full" else {}))
        kept, _ = memory.chunk_activations(cc, lay, False, False, range(1))
        assert kept == per * s * b * h, (t, sp, rc)
    c = gpt.Config(num_layers=8)
    n = sum(p.numel for p in memory.stage_parameters(c, Layout(seq=8), 0))
    for dtype, plain, d, sharded in [("bf16", 18, 4, 6 + 12 / 4), ("fp32", 16, 8, 8 + 8 / 8)]:
        m = memory.memory(c, Layout(seq=8, dtype=dtype))
        assert m["parameters"] + m["gradients"] + m["optimizer"] == plain * n
        m = memory.memory(c, Layout(seq=8, dp=d, dtype=dtype, distributed_optimizer=True))
        assert m["parameters"] + m["gradients"] + m["optimizer"] == pytest.approx(sharded * n, abs=3 * 16 * d)
    for p, v in [(4, 2), (8, 4), (2, 3)]:
        c = gpt.Config(num_layers=p * v * 2, hidden_dropout=0.0)
        lay = Layout(seq=64, pp=p, vpp=v, global_batch=4 * p)
        layer = memory.layer_activations(c, lay)  # every chunk: 2 layers
        assert memory.in_flight([(2 * layer, 2 * layer)] * v, lay, 0) == (1 + (p - 1) / (p * v)) * c.num_layers * layer
