"""DeepSeek-V3 MoE routing (parallel.py section 10: `topk_routing`, `Router`) and expert parallelism under bucketed
DDP and the distributed optimizer (section 9), against plain oracles and the single process.

1. The router against a loop over tokens that spells the rule out (float64): sigmoid scores, the top k renormalised
   to sum 1, times the scaling factor; group-limited top-k (a group's score: the sum of its top k/group_topk scores);
   the expert bias used for the SELECTION only. Also against Megatron-core's own topk_routing_with_score_function.
2. Aux-loss-free balancing: after a step, bias += rate · sign(mean load − load) of the step's training counts.
3. Layouts (tp, sp, pp, dp, ep; the plain optimizer, DDP with --overlap-grad-reduce, the distributed optimizer)
   against one process, all on the DeepSeek router (sigmoid, groups, expert bias, scaling, shared expert, the first
   layer dense through moe_layer_freq): the loss of each of 3 steps, every gradient after the first backward, the
   clipped global grad norm (experts counted once), every parameter after 3 AdamW steps, and the expert bias after
   3 steps, identical on every rank and equal to the single process's.
Tolerances: float64, 1e-10 relative (only the order of reductions differs; measured 4e-15 to 1e-14). The routing choice and
the expert bias are compared exactly: the bias is a sum of ±rate steps taken from integer token counts.
Negative control: expert biases updated from each rank's own counts (no DP sum) fail, naming the bias.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arguments
import config as contract
import gpt
import parallel as P
from equivalence import assert_same, clipped_steps, make_batch, reference_steps, rel_err


# --------------------------------------------------------------------------------------- 1. the router vs a loop
def router(E, k, groups=(None, None), scale=None, bias=False, rate=1e-3, score="sigmoid"):
    """A Router whose logits are its input (h = E, W = I, no bias, no aux losses)."""
    c = gpt.Config(hidden_size=E, num_attention_heads=1, params_dtype=torch.float64, add_bias_linear=False,
                   num_experts=E, moe_router_topk=k, moe_router_score_function=score, moe_aux_loss_coeff=0.0,
                   moe_router_num_groups=groups[0], moe_router_group_topk=groups[1],
                   moe_router_topk_scaling_factor=scale, moe_router_enable_expert_bias=bias,
                   moe_router_bias_update_rate=rate)
    r = P.Router(c)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E, dtype=torch.float64))
    return r


def loop_oracle(logits, k, groups=(None, None), scale=None, bias=None):
    """The rule, token by token, in Python floats: which experts, and with which weights."""
    T, E = logits.shape
    G, g = groups
    probs = torch.zeros(T, E, dtype=torch.float64)
    for t in range(T):
        s = [1 / (1 + math.exp(-float(v))) for v in logits[t]]  # sigmoid scores
        sel = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]  # the bias: selection only
        allowed = list(range(E))
        if g:
            n = E // G
            score = [sum(sorted(sel[j * n:(j + 1) * n], reverse=True)[:k // g]) for j in range(G)]
            best = sorted(range(G), key=lambda j: -score[j])[:g]
            allowed = [e for e in range(E) if e // n in best]
        chosen = sorted(allowed, key=lambda e: -sel[e])[:k]
        total = sum(s[e] for e in chosen)
        for e in chosen:
            probs[t, e] = (s[e] / total if k > 1 else s[e]) * (scale or 1.0)
    return probs, probs != 0


ROUTINGS = {  # name: (E, k, (num_groups, group_topk), scaling factor, expert bias)
    "sigmoid-top1": (6, 1, (None, None), None, False),
    "sigmoid-top3-normalised": (8, 3, (None, None), None, False),
    "groups-4-pick-2-top4": (8, 4, (4, 2), None, False),  # group score: its top 2
    "groups-2-pick-1-top2-scaled": (8, 2, (2, 1), 2.5, False),  # DeepSeek-like: a token stays in one group
    "bias-groups-scaled": (16, 4, (4, 2), 2.5, True),  # DeepSeek-V3's shape: groups of 4, scored by their top 2
    "bias-top2": (6, 2, (None, None), None, True),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_router_matches_the_loop_oracle(name):
    E, k, groups, scale, bias = ROUTINGS[name]
    g = torch.Generator().manual_seed(len(name))
    logits = torch.randn(64, E, dtype=torch.float64, generator=g) * 2
    r = router(E, k, groups, scale, bias)
    b = None
    if bias:  # a bias of the scores' size: it changes many choices
        b = torch.randn(E, dtype=torch.float64, generator=g) * 0.3
        r.expert_bias.copy_(b)
    probs, rmap = r(logits)
    want_p, want_m = loop_oracle(logits, k, groups, scale, b)
    assert torch.equal(rmap, want_m), f"{name}: routing differs for tokens {(rmap != want_m).any(1).nonzero().flatten()}"
    assert rel_err(probs, want_p) < 1e-12, name
    if bias:  # the bias decided: the unbiased choice differs for some tokens, and the weights stayed unbiased
        assert not torch.equal(loop_oracle(logits, k, groups, scale)[1], want_m)
        s = torch.sigmoid(logits)
        w = torch.where(rmap, s, 0)
        torch.testing.assert_close(probs, w / w.sum(-1, keepdim=True) * (scale or 1), rtol=1e-12, atol=0)
    if groups[1]:  # the groups decided: unrestricted top-k would differ for some tokens
        assert not torch.equal(loop_oracle(logits, k, (None, None), scale, b)[1], want_m)


def test_router_matches_megatron_core():
    """Megatron-core 0.15.3's topk_routing_with_score_function on the same logits (CPU, float64, not fused). It takes
    the sigmoid in float32 (`torch.sigmoid(logits.float())`), ours in the router's dtype: weights agree to float32
    rounding (1e-6; measured 6e-8), the choices exactly."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    g = torch.Generator().manual_seed(5)
    for E, k, groups, scale, bias in ROUTINGS.values():
        logits = torch.randn(32, E, dtype=torch.float64, generator=g) * 2
        r = router(E, k, groups, scale, bias)
        b = torch.randn(E, dtype=torch.float64, generator=g) * 0.3 if bias else None
        if bias:
            r.expert_bias.copy_(b)
        probs, rmap = r(logits)
        mp, mm = topk_routing_with_score_function(logits, k, num_groups=groups[0], group_topk=groups[1],
                                                  scaling_factor=scale, score_function="sigmoid", expert_bias=b)
        assert torch.equal(rmap, mm) and rel_err(probs, mp) < 1e-6, (E, k, groups, scale, bias)


def test_loop_oracle_can_fail():
    """Negative control: a router that adds the bias to the weights too (not for the selection only) fails."""
    E, k = 6, 2
    logits = torch.randn(64, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    b = torch.linspace(-0.3, 0.3, E, dtype=torch.float64)
    want_p, want_m = loop_oracle(logits, k, bias=b)
    wrong = torch.where(want_m, torch.sigmoid(logits) + b, 0)  # weights from the biased scores
    wrong = wrong / wrong.sum(-1, keepdim=True)
    assert rel_err(wrong, want_p) > 1e-3


def test_expert_bias_update_rule():
    """bias += rate · sign(mean − load), from the tokens of this step's training forwards (all micro-batches);
    an eval forward does not count; set_num_tokens (a step begins) clears a skipped step's counts."""
    E, k, rate = 4, 2, 0.01
    r = router(E, k, bias=True, rate=rate)
    layer = P.MoELayer(r.c, None)  # the layer counts its routed tokens (after any capacity drop) into its router's
    layer.router = r
    logits = torch.tensor([[4.0, 3, 0, 0], [3, 4, 0, 0], [4, 0, 3, 0], [0, 4, 3, 0]], dtype=torch.float64)
    r.set_num_tokens(16)
    layer(logits[:, None])  # [s, b=1, h=E]
    layer(logits[[0, 3], None])  # a second micro-batch
    with torch.no_grad():
        layer.eval()
        layer(logits.flip(1)[:, None])  # evaluation: not counted
        layer.train()
    load = torch.tensor([4.0, 5, 3, 0], dtype=torch.float64)  # expert 0: 3 + 1 tokens, 1: 3 + 2, 2: 2 + 1; mean 3
    assert torch.equal(r.step_tokens, load)
    r.after_step()
    assert torch.equal(r.expert_bias, rate * torch.tensor([-1.0, -1, 0, 1], dtype=torch.float64))
    assert torch.equal(r.step_tokens, torch.zeros(E, dtype=torch.float64))  # counted afresh next step
    layer(logits[:, None])
    r.set_num_tokens(16)  # the step above was skipped: its counts are dropped
    assert torch.equal(r.step_tokens, torch.zeros(E, dtype=torch.float64))


# --------------------------------------------------------------------------------------- flags and config checks
@pytest.mark.parametrize("cfg,match", [
    (dict(moe_router_num_groups=None, moe_router_group_topk=2), "group_topk=2 needs moe_router_num_groups=None"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups=3 dividing num_experts=8"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=3), "1 <= moe_router_group_topk <= moe_router_num_groups"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=1), r"moe_router_topk=1 must be in \[mo"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3), "group_topk x experts per group = 2"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="softmax"), "needs moe_router_score_function"),
    (dict(moe_router_topk_scaling_factor=0.0), "moe_router_topk_scaling_factor=0.0 must be > 0"),
    (dict(moe_router_bias_update_rate=-1.0), "moe_router_bias_update_rate=-1.0 >= 0"),
])
def test_config_refuses(cfg, match):
    with pytest.raises(ValueError, match=match):
        gpt.Config(**{**DEEPSEEK, **cfg})


def test_flags_reach_the_config_and_are_checked():
    flags = ["--num-experts", "8", "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4",
             "--moe-router-group-topk", "2", "--moe-router-topk", "4", "--moe-router-topk-scaling-factor", "2.5",
             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--num-layers", "2",
             "--moe-layer-freq", "[0,1]", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--micro-batch-size", "4"]
    a = arguments.parse_args(flags)
    a = arguments.check_args(a, 2)  # ep 2 with DDP and the distributed optimizer is accepted
    c = arguments.model_config(contract.model_file(a.model), a, vocab_size=256)  # (the vocabulary comes with the data)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor,
            c.moe_router_enable_expert_bias, c.moe_router_bias_update_rate) == (4, 2, 2.5, True, 0.01)
    a = arguments.parse_args([*flags, "--moe-router-group-topk", "5"])
    with pytest.raises(arguments.ConfigError, match="moe_router_group_topk=5"):
        arguments.check_args(a, 2)


def test_first_layers_dense():
    """DeepSeek-V3's first k dense layers are a moe_layer_freq list ([0]*k + [1]*(L-k)): dense MLPs, then MoE."""
    m = gpt.Model(gpt.Config(**{**DEEPSEEK, "num_layers": 4, "moe_layer_freq": [0, 0, 1, 1]}))
    assert [type(layer.mlp).__name__ for layer in m.decoder.layers] == ["MLP", "MLP", "MoELayer", "MoELayer"]
    assert [n for n, _ in m.named_buffers()] == ["decoder.layers.2.mlp.router.expert_bias",
                                                 "decoder.layers.3.mlp.router.expert_bias"]


def test_from_megatron_loads_the_expert_bias():
    """Megatron-core's TopKRouter keeps the aux-loss-free bias as a persistent buffer, `...mlp.router.expert_bias`
    (float32 [E]; building one needs CUDA, so the state dict here is ours, which has Megatron's names, behind
    Megatron's DDP prefix): gpt.from_megatron loads it into our buffer, and refuses one of the wrong size by name."""
    c = gpt.Config(**{**DEEPSEEK, "num_layers": 4, "moe_layer_freq": [0, 0, 1, 1]})
    sd = {"module." + k: v for k, v in gpt.Model(c).state_dict().items()}
    bias = torch.randn(8, dtype=torch.float64)
    sd["module.decoder.layers.3.mlp.router.expert_bias"] = bias
    m = gpt.from_megatron(sd, c)
    assert torch.equal(m.decoder.layers[3].mlp.router.expert_bias, bias)
    assert not m.decoder.layers[2].mlp.router.expert_bias.any()  # the checkpoint's own zeros
    sd["module.decoder.layers.3.mlp.router.expert_bias"] = torch.zeros(7, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"decoder\.layers\.3\.mlp\.router\.expert_bias: checkpoint shape \(7,\)"):
        gpt.from_megatron(sd, c)


# --------------------------------------------------------------------------------------- 3. layouts vs one process
DEEPSEEK = dict(num_layers=4, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, vocab_size=97,
                max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
                position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
                add_bias_linear=False, num_experts=8, moe_layer_freq=[0, 1, 1, 1], moe_router_topk=2,
                moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
                moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
                moe_aux_loss_coeff=1e-2, moe_shared_expert_intermediate_size=16)
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP = 0.05  # small enough that clipping is active: the norm (experts counted once) matters


def full_grads(chunks, ddp, grid):
    """{global name: whole grad}: DDP's buffer, each bucket's slices all-gathered over the bucket's own group
    (distributed optimizer: DP x CP, or expert_dp for expert buckets), then the TP shards."""
    buf = ddp.grad_buffer.clone()
    for bk in ddp.buckets if ddp.distopt else ():
        if bk.group.size > 1:
            P.all_gather_single(buf[bk.start:bk.end], ddp.grad_buffer[ddp.owned(bk)].clone(), group=bk.group.pg)
    where = {}
    for bk in ddp.buckets:
        o = bk.start
        for p in bk.params:
            where[id(p)], o = o, o + p.numel()
    return {m.global_name(k): P.gather_full(buf[where[id(p)]:where[id(p)] + p.numel()].view_as(p), p, grid)
            for m in chunks for k, p in m.named_parameters() if not k == "output_layer.weight"}


def routing_case(rank, n, cfg, tp, pp, ep, etp, sp, M, mode, b=8, s=8, steps=3, local_bias=False):
    """mode: "plain" (P.Optimizer, finalize_grads), "overlap" (DDP, overlapped all-reduce) or "distopt" (DDP +
    the distributed optimizer, overlapped). The loop is train.py's: zero_grad, forward_backward, finish_grad_sync,
    clip_grad_norm, step (which calls the modules' after_step: the expert bias moves)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp), ep=ep, etp=etp)
    c = gpt.Config(**cfg, sequence_parallel=sp)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid)
    routers = [(m.global_name(k), r) for m in chunks for k, r in m.named_modules() if isinstance(r, P.Router)]
    if local_bias:  # negative control: each rank moves its bias by its own tokens only (no sum over DP)
        for _, r in routers:
            r.dp = None
    ddp = None if mode == "plain" else P.DDP(chunks, grid, bucket_size=2000, distributed_optimizer=mode == "distopt")
    opt = P.Optimizer(chunks, grid, **OPT) if ddp is None else P.DistributedOptimizer(ddp, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 7)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))
    shape = (s // tp if sp and tp > 1 else s, micro[0].shape[0], c.hidden_size)

    def first_step(_):
        return dict(grads=full_grads(chunks, ddp, grid) if ddp else {
            m.global_name(k): P.gather_full(p.grad, p, grid).clone() for m in chunks for k, p in m.named_parameters()
            if not k == "output_layer.weight"})

    out = clipped_steps(chunks, grid, opt, micro, batch[:, 1:].numel(), shape, c.params_dtype, CLIP, steps, first_step)
    params = {m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks for k, p in m.named_parameters()
              if not k == "output_layer.weight"}
    return dict(out, params=params, bias={k + ".expert_bias": r.expert_bias for k, r in routers})


def reference(cfg, M, b=8, s=8, steps=3):
    """One process, torch's own AdamW and clip_grad_norm_; P.after_step is the optimizers' post-step hook."""
    model = gpt.Model(gpt.Config(**cfg))
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], foreach=False, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 7)
    ref = reference_steps(model, opt, list(batch.chunk(M)), batch[:, 1:].numel(), CLIP, steps, after_step=P.after_step)
    return dict(ref, bias={k: v.clone() for k, v in model.named_buffers()})


def compare(pool, n, cfg, tp=1, pp=1, ep=1, etp=None, sp=False, M=1, mode="plain", **kw):
    results = pool.run(routing_case, n, cfg=cfg, tp=tp, pp=pp, ep=ep, etp=etp or tp, sp=sp, M=M, mode=mode, **kw)
    ref = reference(cfg, M * n // (tp * pp))
    what = f"n={n} tp={tp} pp={pp} ep={ep} etp={etp or tp} sp={sp} M={M} {mode}"
    for r in results:  # the expert bias: the same on every rank that holds the layer, and the single process's
        for name, bias in r["bias"].items():
            assert torch.equal(bias, ref["bias"][name]), f"{what}: expert bias {name} differs: {bias} vs {ref['bias'][name]}"
    assert all(v.abs().sum() > 0 for v in ref["bias"].values())  # the bias moved
    got = dict(losses=results[0]["losses"], grads={}, params={})
    for r in results:
        got["grads"].update(r["grads"])
        got["params"].update(r["params"])
    err = assert_same(got, ref, rtol=1e-10, what=what)
    assert rel_err(results[0]["norms"], ref["norms"]) < 1e-10, (what, results[0]["norms"], ref["norms"])
    assert ref["norms"].min() > CLIP  # clipping was active at every step
    return err


LAYOUTS = {  # name: (tp, pp, ep, etp, sp, M, mode); 4 ranks
    "dp4-ep2-overlap": (1, 1, 2, 1, False, 2, "overlap"),
    "dp4-ep2-distopt": (1, 1, 2, 1, False, 1, "distopt"),
    "tp2-sp-ep2-etp1-distopt": (2, 1, 2, 1, True, 2, "distopt"),
    "pp2-ep2-distopt": (1, 2, 2, 1, False, 2, "distopt"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_deepseek_routing_with_ddp_and_distributed_optimizer(pool, name):
    tp, pp, ep, etp, sp, M, mode = LAYOUTS[name]
    compare(pool, 4, DEEPSEEK, tp, pp, ep, etp, sp, M, mode)


@st.composite
def layouts(draw):
    tp, pp, ep = draw(st.sampled_from([(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2), (1, 1, 1), (2, 2, 1)]))
    G, g, k = draw(st.sampled_from([(2, 1, 2), (4, 2, 4), (4, 1, 2), (None, None, 2), (None, None, 1)]))
    cfg = dict(DEEPSEEK, moe_router_num_groups=G, moe_router_group_topk=g, moe_router_topk=k,
               moe_token_dispatcher_type=draw(st.sampled_from(["alltoall", "allgather"])),
               moe_router_topk_scaling_factor=draw(st.sampled_from([None, 2.5])),
               moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 16])))
    return dict(cfg=cfg, tp=tp, pp=pp, ep=ep, etp=draw(st.sampled_from([1, tp])), sp=tp > 1 and draw(st.booleans()),
                M=draw(st.sampled_from([1, 2])), mode=draw(st.sampled_from(["plain", "overlap", "distopt"])))


@settings(max_examples=max(1, settings().max_examples // 2))  # half the profile's: the fixed layouts above run too
@given(layouts())
def test_deepseek_routing_property(pool, layout):
    compare(pool, 4, **layout)


def test_expert_bias_check_can_fail(pool):
    """Negative control: biases moved by each rank's own token counts differ across DP ranks and from one process."""
    with pytest.raises(AssertionError, match=r"expert bias decoder\.layers\.[123]\.mlp\.router\.expert_bias differs"):
        compare(pool, 4, DEEPSEEK, ep=2, mode="distopt", local_bias=True)


def test_expert_bias_is_saved_and_loaded(tmp_path):
    """The expert bias is a buffer, not a parameter: checkpoint_state saves it under its global name (PP stages' layer
    offsets included) and DCP loads it back into a fresh model; a model without expert bias asks for none."""
    import torch.distributed.checkpoint as dcp

    import checkpoint

    cfg = {**DEEPSEEK, "moe_layer_freq": [0, 1, 0, 1]}
    model = gpt.Model(gpt.Config(**cfg))
    for i, r in enumerate(m for m in model.modules() if isinstance(m, P.Router)):
        r.expert_bias.copy_(torch.arange(8.0) * (i + 1))
    state = checkpoint.checkpoint_state([model], None, None)
    assert {k for k in state["model"] if "expert_bias" in k} == {f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 3)}
    with checkpoint._quiet_dcp():
        dcp.save(state, checkpoint_id=str(tmp_path))
        fresh = gpt.Model(gpt.Config(**cfg))
        dcp.load({"model": checkpoint.checkpoint_state([fresh], None, None)["model"]}, checkpoint_id=str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), fresh.buffers())) and len(list(fresh.buffers())) == 2
    plain = gpt.Model(gpt.Config(**{**cfg, "moe_router_enable_expert_bias": False}))
    assert not [k for k in checkpoint.checkpoint_state([plain], None, None)["model"] if "expert_bias" in k]
