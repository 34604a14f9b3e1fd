"""mamba.py: the chunked SSD scan against the sequential recurrence, from_hf against Hugging Face's Mamba-2, the
recurrent generation step against the parallel forward, and TP / SP / DP training against the single process.

Tolerances: float64 1e-10 relative where only the order of floating-point sums differs (chunked vs sequential
scan, TP/DP layouts, step vs forward); from_hf float32 1e-4 (measured ~1e-7: same ops, other einsum orders; a
layout error, e.g. B and C swapped, moves logits by ~1e-1 — checked below).
"""
from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

import mamba
import parallel as P
from equivalence import assert_same, make_batch, named_full, rel_err, train_steps

f64 = torch.float64


# --------------------------------------------------------------------------------------- 1. chunked == sequential
def scan_inputs(b, l, H, Pd, G, N, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=f64)
    u = lambda *s: torch.rand(*s, generator=g, dtype=f64)
    return dict(x=r(b, l, H, Pd), dt=u(b, l, H) * 0.5, A=-u(H) * 4, B=r(b, l, G, N), C=r(b, l, G, N), state=r(b, H, Pd, N))


@given(l=st.integers(1, 40), chunk=st.sampled_from([4, 8, 16]), G=st.sampled_from([1, 2]), R=st.sampled_from([1, 3]),
       initial=st.booleans())
def test_chunked_scan_equals_sequential_loop_forward_and_gradients(l, chunk, G, R, initial):
    """Lengths that are and are not multiples of the chunk (and shorter than one chunk), with/without a start state."""
    inp = scan_inputs(2, l, G * R, 3, G, 5, seed=l)
    if not initial:
        inp["state"] = None
    out = []
    for scan in (mamba.ssd_chunked, mamba.ssd_sequential):
        leaves = {k: v.clone().requires_grad_() for k, v in inp.items() if v is not None}
        y, final = scan(**{**inp, **leaves}, chunk=chunk)
        g = torch.Generator().manual_seed(1)
        (y * torch.randn(y.shape, generator=g, dtype=f64)).sum().add((final * torch.randn(final.shape, generator=g,
                                                                                          dtype=f64)).sum()).backward()
        out.append([y, final] + [leaves[k].grad for k in sorted(leaves)])
    for got, ref in zip(*out):
        assert rel_err(got.detach(), ref.detach()) < 1e-10


def test_stable_segsum_equals_the_naive_one_and_is_stable():
    a = -torch.rand(3, 16, dtype=f64)
    cs = a.cumsum(-1)
    naive = (cs[..., :, None] - cs[..., None, :]).masked_fill(~torch.tril(torch.ones(16, 16, dtype=torch.bool)), -torch.inf)
    assert torch.allclose(mamba.segsum(a).exp(), naive.exp(), rtol=1e-12, atol=1e-14)
    # float32, long decays: the naive difference of two ~-25,800 cumsums keeps ~3 decimals, the stable sum ~6
    big = torch.full((256,), -100.0) - torch.rand(256, generator=torch.Generator().manual_seed(2))
    cs = big.cumsum(-1)
    exact = mamba.segsum(big.double())[-1, -9]  # = -802.676...
    assert abs(mamba.segsum(big)[-1, -9] - exact) < 1e-4 < abs((cs[-1] - cs[-9]) - exact)  # measured 3e-5, 1.7e-3


# --------------------------------------------------------------------------------------- 2. from_hf
def hf_mamba2(groups, chunk):
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=8, expand=2,
        n_groups=groups, chunk_size=chunk)).eval()


@pytest.mark.parametrize("groups,chunk", [(1, 8), (2, 16)])
def test_from_hf_logits_match(groups, chunk):
    hf = hf_mamba2(groups, chunk)
    ours = mamba.from_hf(hf).eval()
    ids = make_batch(1000, 3, 20, seed=1)  # 21 positions: not a multiple of the chunk
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
        per_token = ours(ids[:, :-1], labels=ids[:, 1:])
    assert got.shape == ref.shape and (got - ref).abs().max() < 1e-4
    hf_loss = torch.nn.functional.cross_entropy(ref[:, :-1].reshape(-1, 1000), ids[:, 1:].reshape(-1))
    assert abs(per_token.mean().item() - hf_loss.item()) < 0.05  # ours runs over 24 zero-logit padded rows too
    with torch.no_grad():  # the comparison can fail: swap B and C in layer 0's in_proj
        w = ours.decoder.layers[0].mixer.in_proj.weight
        B = slice(256, 256 + 16 * groups)
        C = slice(B.stop, B.stop + 16 * groups)
        w[B], w[C] = w[C].clone(), w[B].clone()
        assert (ours(ids) - ref).abs().max() > 1e-3


# --------------------------------------------------------------------------------------- 3. recurrent step
TINY = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=101, make_vocab_size_divisible_by=4,
            max_position_embeddings=32, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=4,
            params_dtype=f64)


@pytest.mark.parametrize("pattern,pos", [("M*-M", "rope"), ("MM", "learned_absolute")])
def test_recurrent_step_equals_parallel_forward(pattern, pos):
    c = mamba.Config(**TINY, hybrid_layer_pattern=pattern, position_embedding_type=pos)
    model = mamba.Model(c).eval()
    ids = make_batch(101, 2, 10, seed=4)  # 11 positions, chunk 4
    with torch.no_grad():
        full = model(ids)
        cache = {}
        steps = torch.stack([model.step(ids[:, t], cache) for t in range(ids.shape[1])], dim=1)
        seq = mamba.Model(mamba.Config(**TINY, hybrid_layer_pattern=pattern, position_embedding_type=pos,
                                       mamba_scan="sequential")).eval()(ids)  # the oracle scan, end to end
    assert rel_err(steps, full) < 1e-10 and rel_err(seq, full) < 1e-10
    out = mamba.generate(model, ids[:, :3], 5, temperature=0)
    assert out.shape == (2, 8) and torch.equal(out[:, 3], full[:, 2].argmax(-1))


# --------------------------------------------------------------------------------------- 4. TP / SP / DP
def mamba_case(rank, n, cfg, tp, dp, sp, b, s, plain_in_proj=False, muon=False):
    grid = P.Grid(tp=tp, dp=dp)
    model = mamba.Model(mamba.Config(**cfg, sequence_parallel=sp), grid)
    if plain_in_proj:  # negative control: shard in_proj as one block (rank r: rows r·E/tp..), not per segment
        for layer in model.decoder.layers:
            if layer.symbol == "M":
                layer.mixer.in_proj.weight.partition_stride = 1
        P.init_params(model, cfg["seed"], grid, rename=model.global_name)
    batch = make_batch(cfg["vocab_size"], b, s, seed=7)

    def loss_fn(model, batch):  # this DP rank's rows; the sum is divided by the *global* token count
        local = batch.chunk(dp)[grid.dp.rank]
        P.set_num_tokens(model, batch[:, 1:].numel())  # MoE aux losses follow the same rule (the schedules do this)
        return model(local[:, :-1], labels=local[:, 1:]).sum() / batch[:, 1:].numel()

    rec = train_steps(model, grid, batch, loss_fn=loss_fn, muon=muon)
    return rec if grid.tp.rank == 0 else None


def run_layout(pool, cfg, tp, dp, sp, b, s, **kw):
    recs = [r for r in pool.run(mamba_case, tp * dp, cfg=cfg, tp=tp, dp=dp, sp=sp, b=b, s=s, **kw) if r is not None]
    for r in recs[1:]:  # every DP replica holds the same parameters
        assert all(torch.equal(r["params"][k], recs[0]["params"][k]) for k in r["params"])
    return dict(recs[0], losses=sum(r["losses"] for r in recs))  # each DP rank holds its share of the loss


def reference(cfg, b, s, muon=False):
    return train_steps(mamba.Model(mamba.Config(**cfg)), None, make_batch(cfg["vocab_size"], b, s, seed=7), muon=muon)


@st.composite
def layouts(draw):
    tp, dp = draw(st.sampled_from([(1, 2), (2, 1), (2, 2), (4, 1)]))
    G = tp * draw(st.sampled_from([1, 2]))
    cfg = dict(TINY, hybrid_layer_pattern=draw(st.sampled_from(["MM", "M*", "M-M*", "*M-"])),
               num_query_groups=draw(st.sampled_from([tp, 4])), mamba_num_groups=G,
               mamba_num_heads=G * draw(st.sampled_from([1, 2])), mamba_head_dim=draw(st.sampled_from([4, 8])),
               mamba_state_dim=draw(st.sampled_from([4, 8])), mamba_chunk_size=draw(st.sampled_from([4, 8])),
               vocab_size=draw(st.integers(20, 200)), position_embedding_type=draw(st.sampled_from(["none", "rope"])),
               share_embeddings_and_output_weights=draw(st.booleans()), seed=draw(st.integers(0, 99)))
    return cfg, tp, dp, draw(st.booleans()), dp * draw(st.sampled_from([1, 2])), draw(st.sampled_from([8, 12]))


@pytest.mark.parametrize("tp,dp,sp", [(2, 1, True), (1, 2, False)])
def test_moe_layers_in_the_hybrid_stack_equal_single_process_float64(pool, tp, dp, sp):
    """`E` layers (parallel.MoELayer, top-2 of 4 experts, aux loss on) among Mamba and attention layers."""
    cfg = dict(TINY, hybrid_layer_pattern="ME*E", num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
               mamba_num_groups=2, seed=5)
    def micro_batched(model, batch):  # the aux loss is per micro-batch (as Megatron's): the reference sees dp of them
        P.set_num_tokens(model, batch[:, 1:].numel())
        return sum(model(mb[:, :-1], labels=mb[:, 1:]).sum() for mb in batch.chunk(dp)) / batch[:, 1:].numel()

    ref = train_steps(mamba.Model(mamba.Config(**cfg)), None, make_batch(cfg["vocab_size"], 2 * dp, 8, seed=7),
                      loss_fn=micro_batched)
    assert_same(run_layout(pool, cfg, tp, dp, sp, 2 * dp, 8), ref, rtol=1e-10, what="ME*E")


@given(layouts())
def test_tensor_sequence_data_parallel_equal_single_process_float64(pool, layout):
    cfg, tp, dp, sp, b, s = layout
    got = run_layout(pool, cfg, tp, dp, sp, b, s)
    assert_same(got, reference(cfg, b, s), rtol=1e-10, what=f"tp={tp} dp={dp} sp={sp} b={b} s={s} {cfg}")


def test_in_proj_must_be_sharded_per_segment(pool):
    """Negative control: the same comparison fails when in_proj is split as one block instead of per segment."""
    cfg = dict(TINY, hybrid_layer_pattern="MM", seed=3)
    ref = reference(cfg, 2, 8)
    assert_same(run_layout(pool, cfg, 2, 1, False, 2, 8), ref, rtol=1e-10)
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(run_layout(pool, cfg, 2, 1, False, 2, 8, plain_in_proj=True), ref, rtol=1e-10)


@pytest.mark.parametrize("tp,dp,sp", [(2, 1, True), (2, 2, False)])
def test_muon_equals_single_process_float64(pool, tp, dp, sp):
    """--optimizer muon (parallel.Muon): each TP rank orthogonalizes the whole in_proj, its per-segment shards
    all-gathered, and keeps its own segments' rows; conv1d (3-D), A_log, D and dt_bias stay AdamW's."""
    cfg = dict(TINY, hybrid_layer_pattern="M*-", mamba_num_groups=2, seed=4)
    assert_same(run_layout(pool, cfg, tp, dp, sp, 2 * dp, 8, muon=True), reference(cfg, 2 * dp, 8, muon=True),
                rtol=1e-10, what=f"muon tp={tp} dp={dp} sp={sp}")


def mamba_pp_case(rank, n, cfg, tp, pp, sp, b, s, M):
    """Two AdamW steps through parallel.forward_backward (1F1B over M micro-batches), as equivalence.train_steps."""
    grid = P.Grid(tp=tp, pp=pp)
    c = mamba.Config(**cfg, sequence_parallel=sp)
    offset, layers = c.stage_layers(c.num_layers, grid)  # this stage's layers of the pattern ('|', else even)
    model = mamba.Model(c, grid, grid.pp.rank == 0, grid.pp.rank == pp - 1, offset, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    batch = make_batch(cfg["vocab_size"], b, s, seed=7)
    shape = (s // tp if model.config.sequence_parallel else s, b // M, c.hidden_size)

    def forward_step(model, mb):
        out = model(mb[:, :-1], labels=mb[:, 1:])
        return out.sum() if model.post_process else out

    losses, grads = [], None
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        losses.append(torch.as_tensor(P.forward_backward([model], list(batch.chunk(M)), forward_step,
                                                         batch[:, 1:].numel(), grid, shape, c.params_dtype)))
        P.finalize_grads([model], grid)
        if step == 0:
            grads = named_full(model, grid, grads=True)
        opt.step()
    rec = dict(losses=torch.stack(losses), grads=grads, params=named_full(model, grid), last=model.post_process)
    return rec if grid.tp.rank == 0 else None


@pytest.mark.parametrize("pattern,tp,sp,tied", [("M*-|M", 1, False, False), ("M-M*", 2, True, True)])
def test_pipeline_parallel_equals_single_process_float64(pool, pattern, tp, sp, tied):
    """pp = 2: an uneven '|' cut and an even split; the stage that does not hold a layer kind has none of it."""
    cfg = dict(TINY, hybrid_layer_pattern=pattern, share_embeddings_and_output_weights=tied, seed=11,
               position_embedding_type="rope", num_query_groups=2)
    recs = [r for r in pool.run(mamba_pp_case, 2 * tp, cfg=cfg, tp=tp, pp=2, sp=sp, b=4, s=8, M=2) if r is not None]
    got = dict(losses=next(r["losses"] for r in recs if r["last"]), grads={}, params={})
    for r in recs:  # a tied embedding is held by both ends: the copies must agree, keep one
        for key in ("grads", "params"):
            for name, t in r[key].items():
                assert name not in got[key] or torch.equal(got[key][name], t), name
                got[key][name] = t
    assert_same(got, reference(cfg, 4, 8), rtol=1e-10, what=f"pp=2 tp={tp} sp={sp} {pattern}")


def test_pipeline_stages_compose_to_the_whole_model():
    """The stage split ('|'), layer offsets and global names: two stages in one process compose to the model."""
    c = mamba.Config(**TINY, hybrid_layer_pattern="M*|-M")
    (o0, s0), (o1, s1) = c.stages(2)
    assert (o0, s0, o1, s1) == (0, "M*", 2, "-M")
    whole = mamba.Model(c)
    first, last = mamba.Model(c, None, True, False, o0, len(s0)), mamba.Model(c, None, False, True, o1, len(s1))
    ids = make_batch(101, 2, 9, seed=5)
    loss = whole(ids[:, :-1], labels=ids[:, 1:]).sum()
    last.input_tensor = first(ids[:, :-1])
    staged = last(ids[:, :-1], labels=ids[:, 1:]).sum()
    (loss + staged).backward()
    assert torch.equal(loss, staged)
    grads = {m.global_name(k): p.grad for m in (first, last) for k, p in m.named_parameters()}
    assert grads.keys() == {k for k, _ in whole.named_parameters()}
    assert all(torch.equal(grads[k], p.grad) for k, p in whole.named_parameters())


# --------------------------------------------------------------------------------------- 5. bad configurations
@pytest.mark.parametrize("kw,tp,pp,msg", [
    (dict(hybrid_layer_pattern="M*X"), 1, 1, r"unknown symbols \['X'\]"),
    (dict(hybrid_layer_pattern="ME"), 1, 1, "has MoE layers \\(E\\): set num_experts"),
    (dict(hybrid_layer_pattern="MM", num_layers=3), 1, 1, "num_layers=3 != the 2 layers"),
    (dict(mamba_num_heads=6, mamba_num_groups=4), 1, 1, "mamba_num_heads=6 is not divisible by mamba_num_groups=4"),
    (dict(mamba_num_heads=6, mamba_num_groups=2), 4, 1, "mamba_num_heads=6 is not divisible by .* size 4"),
    (dict(mamba_num_heads=8, mamba_num_groups=2), 4, 1, "mamba_num_groups=2 is not divisible by .* size 4"),
    (dict(hybrid_layer_pattern="MM|M"), 1, 3, "has 2 stages, pipeline-model-parallel size is 3"),
    (dict(mamba_scan="fast"), 1, 1, "mamba_scan='fast'"),
])
def test_bad_configs_are_refused_with_the_values(kw, tp, pp, msg):
    with pytest.raises(ValueError, match=msg):
        mamba.Config(**{**TINY, **kw}).check_layout(tp=tp, pp=pp)
