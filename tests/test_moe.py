"""Mixture of Experts (parallel.py section 10): the dispatched layer against its dense oracle, the aux losses against
their formulas, and expert-parallel models (with TP, SP, DP, expert-DP, both dispatchers) against the single process.

Tolerances: float64 1e-10 relative (reduction order only: the dispatched layer sums each token's k expert outputs
in another order than the dense loop, the parallel runs sum gradients over ranks). The float32 grouped GEMM
(torch._grouped_mm) is checked against a float64 loop at 1e-5.
Both dispatchers compute the same numbers, so the equivalence alone cannot tell which one ran: every layout case
also counts the MoELayers' dispatch calls and requires that exactly the configured dispatcher ran.
"""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpt
import parallel as P
import transformer
from equivalence import assert_same, make_batch, named_full
from harness import CaseFailed

MOE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, vocab_size=97,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
           num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


# --------------------------------------------------------------------------------------- 1. dispatched == dense
def layer_and_input(cfg, seed):
    c = gpt.Config(**cfg)
    layer = P.MoELayer(c, None, transformer.ACTIVATIONS[c.activation])
    P.init_params(layer, seed, None)
    with torch.no_grad():  # larger router weights: confident, varied routings
        layer.router.weight.mul_(20)
    x = torch.randn(6, 3, c.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return layer, x


def run_layer(layer, x, dense):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = layer(x, dense=dense)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()  # aux + z grads injected too
    return dict(losses=y.detach(), grads={"x": x.grad, **{k: p.grad for k, p in layer.named_parameters()}}, params={})


@given(E=st.sampled_from([2, 4, 8]), k=st.sampled_from([1, 2]), capacity=st.sampled_from([None, 0.5, 1.0, 1.5]),
       pad=st.booleans(), dispatcher=st.sampled_from(["allgather", "alltoall"]), gated=st.booleans(),
       score=st.sampled_from(["softmax", "pre_softmax", "sigmoid"]), seed=st.integers(0, 999))
def test_dispatched_equals_dense_reference(E, k, capacity, pad, dispatcher, gated, score, seed):
    k = min(k, E)
    cfg = dict(MOE, num_experts=E, moe_router_topk=k, moe_expert_capacity_factor=capacity,
               moe_pad_expert_input_to_capacity=pad, moe_token_dispatcher_type=dispatcher, gated_linear_unit=gated,
               activation="silu" if gated else "gelu", moe_router_pre_softmax=score == "pre_softmax",
               moe_router_score_function="sigmoid" if score == "sigmoid" else "softmax")
    layer, x = layer_and_input(cfg, seed)
    got = run_layer(layer, x, dense=False)
    load = P.moe_load(layer)[0]  # this forward's tokens per expert (the count sums over forwards until read)
    ref = run_layer(layer, x, dense=True)
    assert_same(got, ref, rtol=1e-10, what=f"E={E} k={k} capacity={capacity} pad={pad} {dispatcher} {score}")
    if capacity is not None and capacity < 1 and not pad:
        assert load.sum() < x.shape[0] * x.shape[1] * k  # tokens were dropped: the capacity path is exercised
    if capacity is not None and pad:
        assert (load == load[0]).all()  # every expert padded to its capacity


def test_dense_reference_can_fail():
    """Negative control: probs applied to the wrong expert's output must not pass the same comparison."""
    layer, x = layer_and_input(dict(MOE, moe_token_dispatcher_type="alltoall"), 3)
    ref = run_layer(layer, x, dense=True)
    real = layer.experts.forward
    layer.experts.forward = lambda xs, counts: real(xs, counts.flip(0))  # expert blocks mislabelled
    with pytest.raises(AssertionError, match=r"worst relative error .* > 1e-10 at (loss|grad)"):
        assert_same(run_layer(layer, x, dense=False), ref, rtol=1e-10)


def test_grouped_gemm_float32():
    """torch._grouped_mm (float32, the training path) and the padded bmm (float64) against a loop over groups."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(9, 16, generator=g).to(dtype).requires_grad_()
        w = torch.randn(4, 32, 16, generator=g).to(dtype).transpose(1, 2).requires_grad_()
        y = P.grouped_mm(x, w, counts)
        dy = torch.randn(y.shape, generator=g).to(dtype)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
        xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = torch.cat([blk @ wd[i] for i, blk in enumerate(xd.split(counts.tolist()))])
        rx, rw = torch.autograd.grad(ref, (xd, wd), dy.double())
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        for a, b in [(y, ref), (gx, rx), (gw, rw)]:
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------- 3. aux losses by hand
def hand_router(E, k, coeff, zcoeff=None):
    """A router whose logits are its input: h = E, W = I, no bias."""
    c = gpt.Config(hidden_size=E, num_attention_heads=1, params_dtype=torch.float64, add_bias_linear=False,
                   num_experts=E, moe_router_topk=k, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=zcoeff)
    r = P.Router(c)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E, dtype=torch.float64))
    return r


def injected_grad(router, logits):
    router.zero_grad(set_to_none=True)
    probs, _ = router(logits)
    (probs * 0).sum().backward()  # no main loss: only the injected aux gradient reaches the weight
    return router.weight.grad


def test_aux_loss_formula_on_hand_built_routing():
    E, k, coeff = 4, 2, 1e-2
    logits = torch.tensor([[4.0, 1, 0, 0], [3, 0, 2, 0], [0, 5, 1, 0], [1, 0, 0, 2], [2, 3, 0, 0]],
                          dtype=torch.float64)  # T = 5 tokens
    T = logits.shape[0]
    routed = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 1, 0], [1, 0, 0, 1], [1, 1, 0, 0]], dtype=torch.float64)
    f = routed.sum(0) / T  # fraction of tokens sent to each expert (Σf = k)
    P_ = torch.softmax(logits, -1).mean(0)  # mean router probability per expert
    switch = E * (f * P_).sum() * coeff  # Switch Transformers' E·Σ fᵢ·Pᵢ·coeff, fᵢ per token (Σf = k)
    r = hand_router(E, k, coeff)
    _ = r(logits)
    assert r.stats["tokens_per_expert"].tolist() == routed.sum(0).tolist()
    # Megatron (moe_utils.switch_load_balancing_loss_func) normalises fᵢ by T·k, not T: its loss is the above / k
    assert math.isclose(float(r.stats["load_balancing_loss"]) * coeff, float(switch) / k, rel_tol=1e-12)
    w = torch.eye(E, dtype=torch.float64, requires_grad=True)  # the gradient it injects is that loss's gradient
    z = logits @ w.t()
    (E * ((routed.sum(0) / (T * k)) * torch.softmax(z, -1).mean(0)).sum() * coeff).backward()
    torch.testing.assert_close(injected_grad(r, logits), w.grad, rtol=1e-12, atol=1e-15)


def test_aux_loss_balanced_routing():
    E, k, coeff = 4, 2, 1e-2
    logits = torch.stack([torch.roll(torch.tensor([3.0, 2, 1, 0], dtype=torch.float64), i) for i in range(E)])
    r = hand_router(E, k, coeff)
    _ = r(logits)
    counts = r.stats["tokens_per_expert"]
    assert (counts == E * k / E).all()  # every expert gets T·k/E tokens, mean prob 1/E each
    f, P_ = counts / E, torch.softmax(logits, -1).mean(0)
    assert math.isclose(float(E * (f * P_).sum() * coeff), coeff * k, rel_tol=1e-12)  # fᵢ per token: coeff·k
    assert math.isclose(float(r.stats["load_balancing_loss"]) * coeff, coeff, rel_tol=1e-12)  # Megatron's: ÷ k


def test_z_loss_formula():
    E, zc = 4, 1e-3
    logits = torch.randn(7, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    r = hand_router(E, 2, 0.0, zc)
    _ = r(logits)
    assert math.isclose(float(r.stats["z_loss"]), float(torch.logsumexp(logits, -1).square().mean()), rel_tol=1e-12)
    w = torch.eye(E, dtype=torch.float64, requires_grad=True)
    (torch.logsumexp(logits @ w.t(), -1).square().mean() * zc).backward()
    torch.testing.assert_close(injected_grad(r, logits), w.grad, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------------------- 2. EP x TP x SP x DP
def forward_step(model, mb):
    out = model(mb[:, :-1], labels=mb[:, 1:])
    return out.sum() if model.post_process else out


def train(chunks, grid, micro, num_tokens, steps=2):
    """`steps` AdamW steps; the micro-batches go through the schedules (the loss rule's one code path)."""
    model, c = chunks[0], chunks[0].config
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    tp = grid.tp_size if grid is not None else 1
    shape = (micro[0].shape[1] - 1) // (tp if c.sequence_parallel else 1), micro[0].shape[0], c.hidden_size
    losses, grads, loads = [], None, []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = P.forward_backward(chunks, micro, forward_step, num_tokens, grid, shape, c.params_dtype)
        P.finalize_grads(model, grid)
        losses.append(torch.as_tensor(loss, dtype=torch.float64).reshape(1))
        loads.append(P.moe_load(model))
        if step == 0:
            grads = named_full(model, grid, grads=True)
        opt.step()
    return dict(losses=torch.cat(losses), grads=grads, params=named_full(model, grid), load=torch.stack(loads))


DISPATCHERS = ("allgather", "alltoall")


def counting_dispatchers(chunks):
    """Wrap every MoELayer's two dispatch methods (on the instance) to count their calls: {name: calls}."""
    calls = dict.fromkeys(DISPATCHERS, 0)
    for layer in (m for chunk in chunks for m in chunk.modules() if isinstance(m, P.MoELayer)):
        for name in DISPATCHERS:
            real = getattr(layer, f"_{name}")

            def counted(*a, _real=real, _name=name):
                calls[_name] += 1
                return _real(*a)
            setattr(layer, f"_{name}", counted)
    return calls


def moe_case(rank, n, cfg, tp, ep, etp, M, b, s, pp=1, break_aux_rule=False, ignore_dispatcher=False,
             break_gate_sp=False):
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp), ep=ep, etp=etp)
    c = gpt.Config(**cfg)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid)
    if break_gate_sp:  # negative control: shared-expert gates whose SP-partial gradients are not summed over TP
        for m in (m for chunk in chunks for m in chunk.modules() if isinstance(m, transformer.SharedExpertMLP)):
            m.gate_weight.sequence_parallel = False
    if ignore_dispatcher:  # negative control: MoELayers that run the all-gather dispatcher whatever the config says
        for layer in (m for chunk in chunks for m in chunk.modules() if isinstance(m, P.MoELayer)):
            layer.c = dataclasses.replace(layer.c, moe_token_dispatcher_type="allgather")
    if break_aux_rule:  # negative control: these routers ignore the schedules' token count, so every micro-batch's
        for r in (m for chunk in chunks for m in chunk.modules() if isinstance(m, P.Router)):  # aux loss weighs 1
            r.set_num_tokens = lambda num_tokens: None
    calls = counting_dispatchers(chunks)
    batch = make_batch(cfg["vocab_size"], b, s, 5)
    rec = train(chunks, grid, list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M)), batch[:, 1:].numel())
    rec["dispatcher_calls"] = calls
    rec["losses"] = P.all_reduce(P.all_reduce(rec["losses"], grid.dp), grid.pp)  # the last stage has them
    rec["load"] = P.all_reduce(rec["load"], grid.dp)  # each micro-batch's counts are whole on every TP rank
    rec["load"] = P._gather(rec["load"], grid.pp if pp > 1 else None, 1)  # [steps, MoE layers, E] of all stages
    return rec


def single(cfg, M, b, s):
    batch = make_batch(cfg["vocab_size"], b, s, 5)
    model = gpt.Model(gpt.Config(**{**cfg, "sequence_parallel": False}))
    return train([model], None, list(batch.chunk(M)), batch[:, 1:].numel())


def merge(results):  # every rank reports its experts (and its stage's layers) under their global names
    out = dict(results[0], grads={}, params={})
    for r in results:
        out["grads"].update(r["grads"])
        out["params"].update(r["params"])
    return out


def check_layout(pool, n, cfg, tp, ep, etp, M, b=8, s=8, pp=1, **kw):
    dp = n // (tp * pp)
    results = pool.run(moe_case, n, cfg=cfg, tp=tp, ep=ep, etp=etp, M=M, b=b, s=s, pp=pp, **kw)
    want = cfg.get("moe_token_dispatcher_type", gpt.Config.moe_token_dispatcher_type)
    for rank, r in enumerate(results):  # the dispatcher the config names is the one that ran, on every rank
        ran = {k for k, v in r["dispatcher_calls"].items() if v}
        assert ran == {want}, f"rank {rank}: config says {want!r}, dispatchers run: {r['dispatcher_calls']}"
    got = merge(results)
    ref = single(cfg, M * dp, b, s)
    assert len(ref["grads"]) == len(got["grads"])
    assert torch.equal(got["load"], ref["load"]), (got["load"], ref["load"])  # the same routing, token for token
    return assert_same(got, ref, rtol=1e-10, what=f"n={n} tp={tp} pp={pp} ep={ep} etp={etp} {cfg}")


GATED = dict(gated_linear_unit=True, activation="silu", add_bias_linear=False)
AG, A2A = dict(moe_token_dispatcher_type="allgather"), dict(moe_token_dispatcher_type="alltoall")
LAYOUTS = {  # name: (tp, ep, etp, M, pp, config changes); 4 ranks, dp = 4 / (tp·pp)
    "ep4-allgather-capacity": (1, 4, 1, 1, 1, dict(**AG, moe_expert_capacity_factor=1.0)),
    "ep4-alltoall-E8-top1-shared": (1, 4, 1, 2, 1, dict(**A2A, num_experts=8, moe_router_topk=1,
                                                        moe_router_pre_softmax=True,
                                                        moe_shared_expert_intermediate_size=16)),
    "ep2-edp2-allgather-sigmoid": (1, 2, 1, 2, 1, dict(**AG, moe_router_score_function="sigmoid")),
    "ep2-edp2-alltoall-E8-padded": (1, 2, 1, 1, 1, dict(**A2A, num_experts=8, moe_expert_capacity_factor=1.5,
                                                        moe_pad_expert_input_to_capacity=True)),
    "tp2-sp-ep2-etp2-allgather-shared-gate": (2, 2, 2, 2, 1, dict(**AG, sequence_parallel=True,
                                                                  moe_shared_expert_intermediate_size=16,
                                                                  moe_shared_expert_gate=True)),
    "tp2-sp-ep2-etp1-alltoall-capacity": (2, 2, 1, 1, 1, dict(**A2A, sequence_parallel=True,
                                                              moe_expert_capacity_factor=1.0, **GATED)),
    "tp2-ep2-etp2-alltoall-gated-shared-gate": (2, 2, 2, 2, 1, dict(**A2A, moe_router_pre_softmax=True, **GATED,
                                                                   moe_shared_expert_intermediate_size=16,
                                                                   moe_shared_expert_gate=True)),
    "tp2-ep2-etp1-allgather-freq2": (2, 2, 1, 1, 1, dict(**AG, num_layers=4, moe_layer_freq=2)),
    "pp2-ep2-alltoall": (1, 2, 1, 2, 2, dict(**A2A, share_embeddings_and_output_weights=False)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_equals_single_process(pool, name):
    tp, ep, etp, M, pp, changes = LAYOUTS[name]
    named = [d for d in DISPATCHERS if d in name]  # the name says which dispatcher; the config must set that one
    assert named == [changes.get("moe_token_dispatcher_type")], f"{name}: config {changes}"
    check_layout(pool, 4, {**MOE, **changes}, tp, ep, etp, M, pp=pp)


def test_dispatcher_check_can_fail(pool):
    """Negative control: both dispatchers give the same numbers, so only the call count sees a model that runs the
    all-gather dispatcher when the config asks for all-to-all (the bug the layouts named "alltoall" once had)."""
    expected = "config says 'alltoall', dispatchers run: {'allgather': 4, 'alltoall': 0}"  # 2 layers x 2 steps
    with pytest.raises(AssertionError, match=re.escape(expected)):
        check_layout(pool, 4, {**MOE, **A2A}, 1, 2, 1, 1, ignore_dispatcher=True)


@st.composite
def moe_layouts(draw):
    tp, ep = draw(st.sampled_from([(2, 2), (1, 4), (1, 2)]))
    k = draw(st.sampled_from([2, 1]))
    gated = draw(st.booleans())
    cfg = dict(MOE, num_experts=ep * draw(st.sampled_from([1, 2])), moe_router_topk=k,
               moe_router_pre_softmax=k == 1 or draw(st.booleans()),  # top-1 after softmax: every prob is 1
               moe_token_dispatcher_type=draw(st.sampled_from(["alltoall", "allgather"])),
               moe_expert_capacity_factor=draw(st.sampled_from([None, 1.0])),
               moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 16])),
               sequence_parallel=tp > 1 and draw(st.booleans()), gated_linear_unit=gated,
               activation="silu" if gated else "gelu")
    return tp, ep, draw(st.sampled_from([tp, 1])), cfg, draw(st.sampled_from([1, 2]))


@given(moe_layouts())
def test_expert_parallel_property(pool, layout):
    tp, ep, etp, cfg, M = layout
    check_layout(pool, 4, cfg, tp, ep, etp, M)


def test_expert_parallel_8_ranks(pool):
    """tp 2 (SP) x dp 4 with ep 2 (expert-DP groups of 2 under TP) and with ep 4, one dispatcher each."""
    for disp, ep, etp in [("alltoall", 2, 2), ("allgather", 4, 1)]:
        cfg = dict(MOE, num_experts=4, moe_token_dispatcher_type=disp, sequence_parallel=True,
                   moe_shared_expert_intermediate_size=16, moe_expert_capacity_factor=1.0)
        check_layout(pool, 8, cfg, tp=2, ep=ep, etp=etp, M=2)


def test_aux_loss_rule_is_checked(pool):
    """Negative control: per-micro-batch aux losses each weighted 1 (the micro-batch count and DP size leak into
    the router's gradient, Megatron's class of bug) must fail the comparison."""
    cfg = dict(MOE, moe_aux_loss_coeff=1.0, moe_token_dispatcher_type="alltoall")
    res = merge(pool.run(moe_case, 4, cfg=cfg, tp=1, ep=2, etp=1, M=2, b=8, s=8, break_aux_rule=True))
    with pytest.raises(AssertionError, match=r"worst relative error .* > 1e-10 at grad "):
        assert_same(res, single(cfg, 8, 8, 8), rtol=1e-10)


def test_shared_expert_gate_sp_rule_is_checked(pool):
    """Negative control: under SP each TP rank's shared-expert gate sees s/tp tokens; its gradient left unsummed over
    TP must fail the comparison that tp2-sp-ep2-etp2-allgather-shared-gate passes."""
    tp, ep, etp, M, pp, changes = LAYOUTS["tp2-sp-ep2-etp2-allgather-shared-gate"]
    cfg = {**MOE, **changes}
    res = merge(pool.run(moe_case, 4, cfg=cfg, tp=tp, ep=ep, etp=etp, M=M, b=8, s=8, break_gate_sp=True))
    with pytest.raises(AssertionError, match=r"worst relative error .* > 1e-10 at grad .*shared_experts\.gate_weight"):
        assert_same(res, single(cfg, M * 4 // tp, 8, 8), rtol=1e-10)


def test_layout_errors(pool):
    with pytest.raises(ValueError, match="moe_router_topk=5"):
        gpt.Config(**dict(MOE, num_experts=4, moe_router_topk=5))
    with pytest.raises(ValueError, match="moe_token_dispatcher_type='flex'"):
        gpt.Config(**dict(MOE, moe_token_dispatcher_type="flex"))
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by expert-model-parallel size 4"):
        gpt.Config(**dict(MOE, num_experts=6)).check_layout(ep=4)
    with pytest.raises(CaseFailed, match="ep=3 must divide dp=4"):
        pool.run(grid_case, 4, ep=3)


def grid_case(rank, n, ep):
    P.Grid(dp=n, ep=ep)


def megatron_named(cfg, seed=7) -> dict:
    """A Megatron-core MoE GPT's full state dict: a single-process model's, experts renamed to the local spec's
    SequentialMLP `experts.local_experts.{i}.linear_fc{1,2}.weight`."""
    model = gpt.Model(gpt.Config(**{**cfg, "seed": seed}))
    rename = lambda k: re.sub(r"experts\.(linear_fc[12])\.weight(\d+)$", r"experts.local_experts.\2.\1.weight", k)
    return {rename(k): v for k, v in model.state_dict().items()}


def from_megatron_case(rank, n, cfg, tp, ep, etp, drop=None, extra=False):
    grid = P.Grid(tp=tp, dp=n // tp, ep=ep, etp=etp)
    full = megatron_named(cfg)
    if drop is not None:
        del full[drop]
    if extra:  # an expert past num_experts
        k = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
        full[k.replace(".0.linear", f".{cfg['num_experts']}.linear")] = full[k]
    return named_full(gpt.from_megatron(full, gpt.Config(**cfg), grid), grid)


@pytest.mark.parametrize("tp,ep,etp", [(1, 2, 1), (1, 4, 1), (2, 2, 1), (2, 2, 2)])
def test_from_megatron_under_expert_parallelism(pool, tp, ep, etp):
    """A Megatron checkpoint loads on an EP layout: every rank takes its own experts (by global index) and the
    gathered parameters are the checkpoint's, exactly (the model's own init uses another seed, so a rank that kept
    it, or another rank's experts, fails). With EP = 1 this is the Megatron-parity test's loading path."""
    cfg = dict(MOE, moe_token_dispatcher_type="alltoall")
    ref = named_full(gpt.from_megatron(megatron_named(cfg), gpt.Config(**cfg)), None)
    got = {}
    for r in pool.run(from_megatron_case, 4, cfg=cfg, tp=tp, ep=ep, etp=etp):
        got.update(r)
    assert ref and set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    own_init = named_full(gpt.Model(gpt.Config(**cfg)), None)
    assert all(not torch.equal(own_init[k], ref[k]) for k in ref if "weight" in k and "norm" not in k)


def strict_case(rank, n, **kw):  # the KeyError's message (no collective follows: nothing hangs, no pool restart)
    try:
        return from_megatron_case(rank, n, **kw) and None
    except KeyError as e:
        return str(e)


def test_from_megatron_under_expert_parallelism_is_strict(pool):
    """Under EP a rank holds only its experts, yet a checkpoint that lacks one, or has one past num_experts, is
    still refused: by the rank that would hold it, or by every rank."""
    cfg = dict(MOE, moe_token_dispatcher_type="alltoall")
    drop = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    errors = pool.run(strict_case, 4, cfg=cfg, tp=1, ep=2, etp=1, drop=drop)
    assert [e is not None for e in errors] == [False, True, False, True]  # ep rank 1 holds experts 2, 3
    assert "missing ['decoder.layers.1.mlp.experts.linear_fc2.weight3']" in errors[1]
    errors = pool.run(strict_case, 4, cfg=cfg, tp=1, ep=2, etp=1, extra=True)
    assert all("unexpected ['decoder.layers.0.mlp.experts.linear_fc1.weight4']" in e for e in errors)


def test_moe_layer_frequency():
    m = gpt.Model(gpt.Config(**dict(MOE, num_layers=4, moe_layer_freq=[0, 1, 1, 0])))
    assert [isinstance(layer.mlp, P.MoELayer) for layer in m.decoder.layers] == [False, True, True, False]
    m = gpt.Model(gpt.Config(**dict(MOE, num_layers=4, moe_layer_freq=2)))
    assert [isinstance(layer.mlp, P.MoELayer) for layer in m.decoder.layers] == [True, False, True, False]


# --------------------------------------------------------------------------------------- 4. train.py
def test_train_py_logs_expert_load_and_ep2_matches_single_process(tmp_path):
    """train.py with --num-experts: per-expert token counts and aux losses in metrics.jsonl; torchrun with dp 2 and
    --expert-model-parallel-size 2 (all-to-all) logs the same losses, grad norms and loads as one process (fp32)."""
    import train
    from harness import SNIPPET, metrics, tiny, torchrun

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    moe = ["--num-experts", "4", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
           "--eval-iters", "0"]
    train.main(tiny(corpus, tmp_path / "cache", tmp_path / "one", *moe, iters=2))
    one, _ = metrics(tmp_path / "one")
    load = torch.tensor(one[1]["moe_tokens_per_expert"])  # [layers, E]: 8 rows x 32 tokens x top-2 per layer
    assert load.shape == (2, 4) and (load.sum(1) == 8 * 32 * 2).all()
    assert one[1]["moe_load_max_over_min"] >= 1 and one[1]["load_balancing_loss"] > 0 and one[1]["z_loss"] > 0
    torchrun(2, tiny(corpus, tmp_path / "cache", tmp_path / "ep2", *moe, "--expert-model-parallel-size", "2",
                     iters=2))
    ep2, _ = metrics(tmp_path / "ep2")
    for i in one:
        for k in ("loss", "grad_norm"):
            assert abs(ep2[i][k] - one[i][k]) <= 1e-5 * abs(one[i][k]), (i, k, ep2[i][k], one[i][k])
        assert ep2[i]["moe_tokens_per_expert"] == one[i]["moe_tokens_per_expert"]
