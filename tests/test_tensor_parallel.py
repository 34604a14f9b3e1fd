"""Tensor and sequence parallelism against the formulas and against the single-process model (DESIGN.md §2-3).

Tolerances: float64 1e-10 relative (only the order of floating-point reductions differs between layouts);
float32 1e-5 (the same at single precision; measured: loss bit-equal, grads 3e-7, params after 2 steps 9e-7). The
float32 case uses AdamW eps 1e-5: Adam's first step is lr·g/(|g| + eps), whose slope lr/eps turns fp32 rounding of a
near-zero gradient into a parameter error of up to lr/eps·δg — 1e5·δg with the default eps 1e-8 (measured 1.2e-5).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import gpt
import parallel as P
from equivalence import assert_same, check_dropout_streams, make_batch, model_dropout_masks_case, train_steps
from harness import CaseFailed


# --------------------------------------------------------------------------------------- 1. mappings vs formulas
def mappings_case(rank, n, seed):
    grid = P.Grid(tp=n)
    g = grid.tp
    out = {}
    for name in ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp",
                 "gather_from_sp", "reduce_scatter_to_sp"]:
        gen = torch.Generator().manual_seed(seed + 17 * rank)
        shape = (4 * n, 3, 4 * n) if name in ("scatter_to_tp", "scatter_to_sp", "reduce_scatter_to_sp",
                                              "copy_to_tp", "reduce_from_tp") else (4, 3, 4)
        x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
        y = getattr(P, name)(x, g)
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        y.backward(dy)
        out[name] = (x.detach(), y.detach(), dy, x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_match_formulas(pool, tp):
    res = pool.run(mappings_case, tp, seed=3)
    assert len(res[0]) == 7  # every mapping of section 2 was run
    for name in res[0]:
        xs, ys, dys, gxs = zip(*[r[name] for r in res])
        for r in range(tp):
            x, y, dy, gx = xs[r], ys[r], dys[r], gxs[r]
            if name == "copy_to_tp":  # f: identity / all-reduce
                exp_y, exp_g = x, sum(dys)
            elif name == "reduce_from_tp":  # g: all-reduce / identity
                exp_y, exp_g = sum(xs), dy
            elif name == "scatter_to_tp":
                exp_y, exp_g = x.chunk(tp, -1)[r], torch.cat([d for d in dys], -1)
            elif name == "gather_from_tp":
                exp_y, exp_g = torch.cat(xs, -1), dy.chunk(tp, -1)[r]
            elif name == "scatter_to_sp":
                exp_y, exp_g = x.chunk(tp, 0)[r], torch.cat(dys, 0)
            elif name == "gather_from_sp":  # Korthikanti et al.'s g: all-gather / reduce-scatter
                exp_y, exp_g = torch.cat(xs, 0), sum(dys).chunk(tp, 0)[r]
            else:  # reduce_scatter_to_sp
                exp_y, exp_g = sum(xs).chunk(tp, 0)[r], torch.cat(dys, 0)
            torch.testing.assert_close(y, exp_y, rtol=1e-12, atol=1e-12, msg=f"{name} forward, rank {r}")
            torch.testing.assert_close(gx, exp_g, rtol=1e-12, atol=1e-12, msg=f"{name} backward, rank {r}")


# --------------------------------------------------------------------------------------- 2. vocab-parallel CE
def ce_case(rank, n, vocab, padded, smoothing, seed, inplace=False):
    grid = P.Grid(tp=n)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 3, padded, generator=gen, dtype=torch.float64) * 3  # [s, b, V] same on all ranks
    target = torch.randint(0, vocab, (5, 3), generator=gen)
    leaf = P.shard(logits, 2, 1, grid.tp.rank, n).requires_grad_()
    local = leaf * 1.0 if inplace else leaf  # in place: logits a layer computed (autograd keeps no copy of them)
    loss = P.vocab_parallel_cross_entropy(local, target, grid, smoothing, inplace=inplace)
    dloss = torch.rand(5, 3, generator=gen, dtype=torch.float64)
    loss.backward(dloss)
    return logits, target, dloss, loss.detach(), leaf.grad


@pytest.mark.parametrize("tp,vocab,smoothing,inplace", [(2, 97, 0.0, False), (4, 250, 0.0, True), (2, 97, 0.1, True),
                                                        (4, 1001, 0.2, False)])
def test_vocab_parallel_cross_entropy(pool, tp, vocab, smoothing, inplace):
    padded = P.pad_vocab(vocab, 8)  # vocab sizes TP does not divide, padded as the model does
    res = pool.run(ce_case, tp, vocab=vocab, padded=padded, smoothing=smoothing, seed=tp + vocab, inplace=inplace)
    logits, target, dloss = res[0][:3]
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, padded), target.reshape(-1), reduction="none",
                          label_smoothing=smoothing).view(5, 3)
    ref.backward(dloss)
    grad = torch.cat([r[4] for r in res], dim=-1)
    for r in res:
        torch.testing.assert_close(r[3], ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, full.grad, rtol=1e-12, atol=1e-12)



@pytest.mark.parametrize("smoothing,inplace", [(0.0, False), (0.1, False), (0.0, True), (0.1, True)])
def test_cross_entropy_one_shard_is_the_function(smoothing, inplace):
    """At tp = 1 vocab_parallel_cross_entropy (the vocab-parallel Function on one shard) is F.cross_entropy: the same
    loss and gradient (padded vocabulary included, smoothed over all V columns), in float64; in place too (the
    logits' buffer becomes the softmax: they are overwritten). Logits spanning 200 nats check the clamp of exp at
    z < −80 (denormals): it changes nothing visible in float64."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 3, P.pad_vocab(97, 8), generator=gen, dtype=torch.float64) * 3
    logits[0, 0, :40] -= 200.0  # z far below −80 (exp(−200) ≈ 1e-87: float64 keeps it, the clamp replaces it)
    target, dloss = torch.randint(0, 97, (5, 3), generator=gen), torch.rand(5, 3, generator=gen, dtype=torch.float64)
    target[0, 0] = 3  # a target in the clamped range: its log-probability is ≈ −200, its gradient ≈ −1
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fused = P.vocab_parallel_cross_entropy(a * 1.0 if inplace else a, target, None, smoothing, inplace=inplace)
    ref = F.cross_entropy(b.reshape(-1, b.shape[-1]), target.reshape(-1), reduction="none",
                          label_smoothing=smoothing).view(target.shape)
    (fused * dloss).sum().backward()
    (ref * dloss).sum().backward()
    torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_cross_entropy_inplace_refuses_other_uses():
    """inplace=True overwrites the logits: a backward through another op that saved them fails autograd's version
    check (no silently wrong gradient), and a leaf that requires grad is refused before anything is overwritten."""
    x = torch.randn(4, 2, 16, dtype=torch.float64, requires_grad=True)
    logits = x * 1.0
    other = logits.pow(2).sum()  # saves the logits
    loss = P.vocab_parallel_cross_entropy(logits, torch.randint(0, 16, (4, 2)), inplace=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()
    before = x.detach().clone()
    with pytest.raises(ValueError, match="inplace=True.*leaf"):
        P.vocab_parallel_cross_entropy(x, torch.randint(0, 16, (4, 2)), inplace=True)
    assert torch.equal(x.detach(), before)


def test_cross_entropy_second_backward_refused():
    """The Function's backward turns its saved softmax into the gradient in place (Megatron's): a second backward
    through the same loss (retain_graph) must fail loudly (autograd's version check), not return a wrong gradient."""
    logits = torch.randn(4, 2, 16, dtype=torch.float64, requires_grad=True)
    loss = P.vocab_parallel_cross_entropy(logits, torch.randint(0, 16, (4, 2))).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_swiglu_function_is_autograd():
    """transformer.SwiGLU (backward into one buffer, no cat) gives autograd's silu(gate) * up and its gradient
    bit for bit."""
    import transformer
    y = torch.randn(5, 3, 2 * 7, dtype=torch.float64)
    a, b = y.clone().requires_grad_(), y.clone().requires_grad_()
    g = torch.randn(5, 3, 7, dtype=torch.float64)
    out = transformer.SwiGLU.apply(a)
    gate, up = b.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out.backward(g)
    ref.backward(g)
    assert torch.equal(out, ref) and torch.equal(a.grad, b.grad)

# --------------------------------------------------------------------------------------- 3. GPT TP == single
def gpt_tp_case(rank, n, cfg, sp, batch_seed, b, s, break_f=False, eps=1e-8):
    grid = P.Grid(tp=n)
    real = P._CopyToTP.__dict__["backward"]  # the staticmethod itself, put back below (this worker lives on)
    if break_f:  # negative control: f's backward forgets its all-reduce
        P._CopyToTP.backward = staticmethod(lambda ctx, dy: (dy, None))
    try:
        model = gpt.Model(gpt.Config(**cfg, sequence_parallel=sp), grid)
        rec = train_steps(model, grid, make_batch(cfg["vocab_size"], b, s, batch_seed), eps=eps)
    finally:
        P._CopyToTP.backward = real
    return rec if rank == 0 else None


def reference(cfg, batch_seed, b, s, eps=1e-8):
    model = gpt.Model(gpt.Config(**cfg))
    return train_steps(model, None, make_batch(cfg["vocab_size"], b, s, batch_seed), eps=eps)


@st.composite
def gpt_layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    groups = tp * draw(st.sampled_from([1, 2])) if tp > 1 else draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2]))  # heads per group 1 = MHA; groups 1 = MQA
    d = draw(st.sampled_from([4, 8]))
    llama = draw(st.booleans())
    cfg = dict(num_layers=2, hidden_size=heads * d if draw(st.booleans()) else 32, num_attention_heads=heads,
               num_query_groups=groups, kv_channels=d, ffn_hidden_size=8 * tp * draw(st.sampled_from([1, 3])),
               vocab_size=draw(st.integers(20, 300)), make_vocab_size_divisible_by=draw(st.sampled_from([4, 128])),
               max_position_embeddings=32,
               position_embedding_type="rope" if draw(st.booleans()) else "learned_absolute",
               normalization="RMSNorm" if llama else "LayerNorm", activation="silu" if llama else "gelu",
               gated_linear_unit=llama, add_bias_linear=not llama,
               share_embeddings_and_output_weights=draw(st.booleans()),
               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64, seed=draw(st.integers(0, 99)))
    return tp, cfg, draw(st.booleans()), draw(st.sampled_from([1, 2])), 4 * draw(st.sampled_from([2, 3]))


TP4_GQA = (4, dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, kv_channels=4,
                   ffn_hidden_size=32, vocab_size=101, make_vocab_size_divisible_by=4, max_position_embeddings=32,
                   position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
                   add_bias_linear=False, share_embeddings_and_output_weights=True, hidden_dropout=0.0,
                   attention_dropout=0.0, params_dtype=torch.float64, seed=3), True, 2, 8)


@given(gpt_layouts())
@example(TP4_GQA)  # the widest layout, whatever the profile draws
def test_gpt_tensor_parallel_equals_single_process_float64(pool, layout):
    tp, cfg, sp, b, s = layout
    got = pool.run(gpt_tp_case, tp, cfg=cfg, sp=sp, batch_seed=7, b=b, s=s)[0]
    assert_same(got, reference(cfg, 7, b, s), rtol=1e-10, what=f"tp={tp} sp={sp} {cfg}")


FP32_CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=201, max_position_embeddings=16, position_embedding_type="rope", normalization="RMSNorm",
                activation="silu", gated_linear_unit=True, add_bias_linear=False,
                share_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0)


def test_gpt_tensor_parallel_float32(pool):
    got = pool.run(gpt_tp_case, 2, cfg=FP32_CFG, sp=True, batch_seed=1, b=2, s=8, eps=1e-5)[0]
    assert_same(got, reference(FP32_CFG, 1, 2, 8, eps=1e-5), rtol=1e-5, what="fp32 tp=2 sp")


def test_wrong_reduction_is_caught(pool):
    """Negative control: with f's backward all-reduce removed, the same comparison must fail."""
    cfg = dict(FP32_CFG, params_dtype=torch.float64)
    ref = reference(cfg, 1, 2, 8)
    assert_same(pool.run(gpt_tp_case, 2, cfg=cfg, sp=False, batch_seed=1, b=2, s=8)[0], ref, 1e-10)
    broken = pool.run(gpt_tp_case, 2, cfg=cfg, sp=False, batch_seed=1, b=2, s=8, break_f=True)[0]
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(broken, ref, rtol=1e-10)


# --------------------------------------------------------------------------------------- 4. SP LayerNorm grads
def sp_norm_grads_case(rank, n, finalize):
    grid = P.Grid(tp=n)
    cfg = dict(FP32_CFG, params_dtype=torch.float64, normalization="LayerNorm", num_query_groups=4)
    model = gpt.Model(gpt.Config(**cfg, sequence_parallel=True), grid)
    batch = make_batch(cfg["vocab_size"], 2, 8, 5)
    per_token = model(batch[:, :-1], labels=batch[:, 1:])
    (per_token.sum() / per_token.numel()).backward()
    if finalize:
        P.finalize_grads(model, grid)
    return {k: p.grad for k, p in model.named_parameters() if "layernorm" in k}


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_norm_grads_identical_on_every_rank(pool, tp):
    res = pool.run(sp_norm_grads_case, tp, finalize=True)
    assert len(res[0]) == 10  # 2 layers x 2 norms x (weight, bias) + final norm (weight, bias)
    for r in res[1:]:
        for k in res[0]:
            assert torch.equal(r[k], res[0][k]), f"{k} differs between TP ranks"
    partial = pool.run(sp_norm_grads_case, tp, finalize=False)  # the check can fail: raw grads are partial
    assert any(not torch.equal(partial[1][k], partial[0][k]) for k in partial[0])


# --------------------------------------------------------------------------------------- 5. RNG tracker
def dropout_masks_case(rank, n):
    grid = P.Grid(tp=n)
    rng = P.RNGTracker(seed=42, grid=grid)
    x = torch.ones(64, 64)
    replicated = P.dropout(x, 0.5, True, rng, sharded=False) != 0
    sharded = P.dropout(x, 0.5, True, rng, sharded=True) != 0
    replicated2 = P.dropout(x, 0.5, True, rng, sharded=False) != 0  # the fork left the default stream in step
    return replicated, sharded, replicated2


def test_rng_tracker_dropout_masks(pool):
    res = pool.run(dropout_masks_case, 4)
    for r in res[1:]:
        assert torch.equal(r[0], res[0][0]) and torch.equal(r[2], res[0][2]), "replicated masks must agree"
        assert not torch.equal(r[1], res[0][1]), "sharded masks must differ between TP ranks"
    assert not torch.equal(res[0][0], res[0][2])  # the default stream advanced


@pytest.mark.parametrize("sp,pos", [(False, "rope"), (True, "rope"), (True, "learned_absolute")],
                         ids=["replicated", "sequence-parallel", "sequence-parallel-learned-positions"])
def test_model_hidden_dropout_streams(pool, sp, pos):
    """A whole model's hidden dropouts on tp=2 (dropout 0.5): without SP the activations are replicated and both
    TP ranks drop the same elements (default stream, seed); with SP every hidden dropout, the embedding's included,
    acts on a sequence shard and draws from the model-parallel stream (seed + 2718 + tp_rank), as in Megatron's
    LanguageModelEmbedding and TransformerLayer. The equivalence tests run with dropout 0 and cannot see this.
    The embedding has two SP paths: RoPE models take the fused reduce-scatter; learned absolute positions add the
    positions to the whole sequence and then split it. Its dropout drawn from the default stream there (as if the
    shard were replicated) makes both TP ranks drop the same positions of their different shards: caught by the
    third case. (Learned positions without SP are left out: their nn.Embedding's initialization draws from the
    default stream, so its masks are not that stream's first draws.) Masks are compared exactly (equal draws of
    one generator)."""
    check_dropout_streams(pool.run(model_dropout_masks_case, 2, tp=2, pp=1, sp=sp, pos=pos), sp)


# --------------------------------------------------------------------------------------- 6. the GEMM hook
def test_linear_impl_is_the_layers_gemm():
    """Column/RowParallelLinear run their local GEMM through `linear_impl(x, weight, bias)` (the hook fp8_enable
    fills): F.linear by default; a replacement is called with the layer's weight and bias (None for the row layer,
    which adds its bias after the reduction) and its result is the layer's."""
    col, row = P.ColumnParallelLinear(8, 6), P.RowParallelLinear(6, 4)
    assert col.linear_impl is F.linear and row.linear_impl is F.linear
    P.init_params(torch.nn.ModuleList([col, row]), 1, None)
    with torch.no_grad():
        col.bias.fill_(0.5), row.bias.fill_(-0.25)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    ref = row(col(x))
    calls = []

    def recording(x, w, b):
        calls.append((w, b))
        return 2 * F.linear(x, w, b)

    col.linear_impl = row.linear_impl = recording
    got = row(col(x))
    assert len(calls) == 2 and calls[0][0] is col.weight and calls[0][1] is col.bias
    assert calls[1][0] is row.weight and calls[1][1] is None
    torch.testing.assert_close(got, 2 * F.linear(2 * F.linear(x, col.weight, col.bias), row.weight) + row.bias)
    assert not torch.allclose(got, ref)


# --------------------------------------------------------------------------------------- 7. SP: the shard kept
def sp_linear_case(rank, n, oracle, frozen, x_grad):
    """One SP column-parallel linear (with bias), forward + backward, by the shard-keeping Function or its oracle
    (gather_from_sp, then F.linear): output, grads, the bytes autograd saved (parameters excluded), collectives."""
    grid = P.Grid(tp=n)
    lin = P.ColumnParallelLinear(8, 4 * n, grid, sequence_parallel=True, dtype=torch.float64)
    P.init_params(lin, 3, grid)
    lin.save_shard = not oracle
    lin.weight.requires_grad_(not frozen)  # frozen: a LoRA base layer (no weight grad, so no gather in backward)
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64, requires_grad=x_grad)  # [s/tp, b, in]
    dy = torch.randn(3 * n, 2, 4, generator=gen, dtype=torch.float64)  # [s, b, out/tp]
    params, saved = {p.untyped_storage().data_ptr() for p in lin.parameters()}, {}

    def pack(v):
        if v.untyped_storage().data_ptr() not in params:
            saved[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return v

    with P.count_collectives() as log, torch.autograd.graph.saved_tensors_hooks(pack, lambda v: v):
        y = lin(x).mul_(2)  # an in-place consumer, as the in-place cross-entropy: the output must not be a view
        y.backward(dy)
    return y.detach(), x.grad, lin.weight.grad, lin.bias.grad, sum(saved.values()), [k for k, _, _ in log]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("frozen,x_grad", [(False, True), (True, True), (False, False)],
                         ids=["trained", "frozen-weight", "input-without-grad"])
def test_sp_column_linear_keeps_the_shard_and_equals_its_oracle(pool, tp, frozen, x_grad):
    """Under SP a column-parallel linear saves its input's sequence shard [s/tp, b, in], not the gathered [s, b, in],
    and all-gathers it again in backward (Megatron's LinearWithGradAccumulationAndAsyncCommunication): output and
    grads bit-equal to the plain oracle's on every rank; one more all-gather, only where the weight takes a grad.
    The output is overwritten in place before backward (autograd refuses that on a custom Function's view)."""
    fused = pool.run(sp_linear_case, tp, oracle=False, frozen=frozen, x_grad=x_grad)
    plain = pool.run(sp_linear_case, tp, oracle=True, frozen=frozen, x_grad=x_grad)
    for r, (a, b) in enumerate(zip(fused, plain)):
        for name, u, v in zip(("output", "input grad", "weight grad", "bias grad"), a[:4], b[:4]):
            assert (u is None) == (v is None) and (u is None or torch.equal(u, v)), f"{name} differs on rank {r}"
        shard = 3 * 2 * 8 * 8  # [s/tp, b, in] float64
        assert a[4] == (0 if frozen else shard) and b[4] == (0 if frozen else tp * shard), (a[4], b[4])
        gather_again = ["all_gather"] if not frozen else []
        scatter = ["reduce_scatter"] if x_grad else []
        assert b[5] == ["all_gather"] + scatter and a[5] == ["all_gather"] + gather_again + scatter, (a[5], b[5])


def activations_case(rank, n, rc, oracle):
    """bench/bench_activations.py's measurement of one GPT layer under TP + SP, and its formula `ours`."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("bench_activations", Path(__file__).parent.parent / "bench" /
                                                  "bench_activations.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    P.ColumnParallelLinear.save_shard = not oracle  # (put back below: this worker lives on)
    try:
        return bench.measure(P.Grid(tp=n), n, True, rc, False), bench.ours(n, True, rc)
    finally:
        P.ColumnParallelLinear.save_shard = True


def check_saved(got: int, want: int, what: str):
    assert got == want, f"{what}: one layer saves {got:,} B for backward, the formula with the shard {want:,} B " \
                        f"({got - want:+,} B)"


@pytest.mark.parametrize("rc", ["off", "selective"])
def test_sp_activation_memory_is_the_formula_with_the_shard(pool, rc):
    """The bytes one GPT layer saves under TP=2 + SP equal bench_activations.ours(), where linear_qkv's and
    linear_fc1's inputs count s/t each (bench/README.md's table). Negative control: the oracle path keeps the
    gathered inputs, 8·s·b·h bytes whole instead of 8·s·b·h/2 — 4·s·b·h = 262,144 B more, named."""
    check_saved(*pool.run(activations_case, 2, rc=rc, oracle=False)[0], f"tp=2 SP recompute {rc}")
    got, want = pool.run(activations_case, 2, rc=rc, oracle=True)[0]
    with pytest.raises(AssertionError, match=re.escape(f"the formula with the shard {want:,} B (+262,144 B)")):
        check_saved(got, want, f"tp=2 SP recompute {rc}, the oracle path")


# --------------------------------------------------------------------------------------- 8. bad configurations
@pytest.mark.parametrize("kw,tp,msg", [
    (dict(num_attention_heads=6, num_query_groups=6, hidden_size=48), 4, "num_attention_heads=6 .* 4"),
    (dict(num_attention_heads=8, num_query_groups=2, hidden_size=64), 4, "num_query_groups=2 .* 4"),
    (dict(ffn_hidden_size=30), 4, "ffn_hidden_size=30 .* 4"),
    (dict(vocab_size=10, make_vocab_size_divisible_by=6), 8, "padded vocabulary=12 .* 8"),
])
def test_bad_layouts_are_refused_with_the_values(kw, tp, msg):
    with pytest.raises(ValueError, match=msg):
        gpt.Config(**kw).check_layout(tp=tp)


def test_bad_grid_and_config_values():
    with pytest.raises(ValueError, match=r"world size 1 != tp\*pp\*dp\*cp = 2\*1\*1\*1"):
        P.Grid(tp=2)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_query_groups=4"):
        gpt.Config(num_attention_heads=6, num_query_groups=4, hidden_size=48)
    with pytest.raises(ValueError, match="hidden_size=50 is not divisible by num_attention_heads=8"):
        gpt.Config(hidden_size=50)


def bad_model_case(rank, n):
    gpt.Config(num_attention_heads=6, hidden_size=48).check_layout(tp=n)  # before any process group
    P.Grid(tp=n)


def test_bad_layout_fails_on_ranks_before_any_collective(pool):
    with pytest.raises(CaseFailed, match="num_attention_heads=6 is not divisible by tensor-model-parallel size 4"):
        pool.run(bad_model_case, 4)
