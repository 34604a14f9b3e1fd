"""Context parallelism (parallel.py section 12): each attention variant against plain attention on the whole
sequence, and context-parallel models (alone and with TP, SP, PP, DP, the distributed optimizer) against the single
process; the flags' refusals; a torchrun run whose checkpoint resumes at cp 1.

Tolerances: float64 1e-10 relative (DESIGN.md §2: only the order of reductions differs — the ring merges partial
softmaxes by their log-sum-exp, gradients are summed over dp x cp; measured ~1e-15 for attention, ~1e-13 for the
models). The torchrun run is float32 against one process: 1e-5 (the same, at single precision).
Negative controls: the ring without its log-sum-exp merge, tokens split contiguously (no load-balancing
permutation), and per-rank mean losses (picotron's mistake: gradients cp times too large) must each fail.
The variants compute the same numbers, so every model case also counts its collectives on the cp group: exactly
the configured variant ran (ring sends, K/V all-gathers, all-to-alls).
"""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_data_parallel import CFG, CLIP, LLAMA, OPT, full_grads, merge, reference

import arguments
import gpt
import parallel as P
import train
from equivalence import assert_same, clipped_steps, make_batch, rel_err
from harness import assert_close, metrics, tiny, torchrun


# --------------------------------------------------------------------------------------- 1. attention variants
def qkvo(b, n, g, s, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for h in (n, g, g, n)]  # q, k, v, dO


def padding_mask(b, s):
    """Key mask [b, 1, 1, s]: sequence i has its last 3·i + 1 positions padded (True = attend)."""
    keep = torch.ones(b, s, dtype=torch.bool)
    for i in range(b):
        keep[i, s - 3 * i - 1:] = False
    return keep[:, None, None, :]


def attention_case(rank, n, comm, causal, heads, groups, s, seed=0, no_merge=False, contiguous=False):
    """This rank's output and input gradients of one variant, on its tokens (load-balanced unless `contiguous`).
    no_merge: the ring sums its partial outputs instead of merging them by their log-sum-exp (negative control)."""
    grid = P.Grid(cp=n)
    q, k, v, do = qkvo(2, heads, groups, s, 4, seed)
    mask = None if causal else padding_mask(2, s)
    mine = torch.arange(s).view(n, -1)[rank] if contiguous else P.cp_positions(s, n, rank)
    local = [t.index_select(2, mine).requires_grad_() for t in (q, k, v)]
    cp_mask = mask.index_select(-1, P.cp_order(s, n)) if mask is not None else None
    merge_ = P._merge
    if no_merge:
        P._merge = lambda o, lse, o_j, lse_j: (o + o_j, torch.logaddexp(lse, lse_j))
    try:
        o = P.context_parallel_attention(grid, comm)(*local, cp_mask, causal, 0.5)
    finally:
        P._merge = merge_
    scores = P._RingAttention.scores
    o.backward(do.index_select(2, mine))
    return dict(positions=mine, o=o.detach(), dq=local[0].grad, dk=local[1].grad, dv=local[2].grad, scores=scores)


def check_attention(res, causal, heads, groups, s, seed=0):
    """Gather the ranks' slices back into sequence order and compare with the oracle's output and gradients."""
    q, k, v, do = qkvo(2, heads, groups, s, 4, seed)
    mask = None if causal else padding_mask(2, s)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = P.attention_oracle(*ref_in, mask=mask, causal=causal, scale=0.5)
    ref.backward(do)
    ref = ref.detach()
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.5, enable_gqa=True)
    assert rel_err(ref, sdpa) < 1e-12  # the oracle is attention
    pos = torch.cat([r["positions"] for r in res])
    assert sorted(pos.tolist()) == list(range(s))  # every token on exactly one rank
    for name, want in (("o", ref), ("dq", ref_in[0].grad), ("dk", ref_in[1].grad), ("dv", ref_in[2].grad)):
        got = torch.empty_like(want).index_copy_(2, pos, torch.cat([r[name] for r in res], dim=2))
        err = rel_err(got, want)
        assert err <= 1e-10, f"{name}: worst relative error {err:.3e} > 1e-10"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "padding"])
@pytest.mark.parametrize("comm", P.CP_COMM_TYPES)
def test_attention_variants_equal_full_attention(pool, cp, causal, comm):
    heads, groups = 8, 4  # GQA: 2 heads per key/value head; a2a needs both divisible by cp
    res = pool.run(attention_case, cp, comm=comm, causal=causal, heads=heads, groups=groups, s=8 * cp)
    check_attention(res, causal, heads, groups, 8 * cp)
    if comm == "p2p" and causal:  # each rank: its diagonal block, then half of each other rank's block
        sl = 8
        assert [r["scores"] for r in res] == [sl * sl + (cp - 1) * sl * sl // 2] * cp


def work(positions, s, cp):
    """Score entries per rank of a causal ring over a layout (positions(rank) -> that rank's positions)."""
    return [sum(len(rows) * len(cols) for rows, cols, _ in
                (P._visible(positions(r), positions(j), True, None) for j in range(cp))) for r in range(cp)]


def test_load_balancing_evens_the_causal_work():
    """Chunks r and 2cp−1−r: every rank computes the same score entries. Contiguous chunks (the control): rank r
    computes r + 1 blocks, the last rank cp times the first."""
    s, cp = 64, 4
    sl = s // cp
    assert work(lambda r: P.cp_positions(s, cp, r), s, cp) == [sl * sl + (cp - 1) * sl * sl // 2] * cp
    assert work(lambda r: torch.arange(s).view(cp, -1)[r], s, cp) == [(r + 1) * sl * sl for r in range(cp)]


@pytest.mark.parametrize("control,expect", [(dict(no_merge=True), "worst relative error"),
                                            (dict(contiguous=True), "worst relative error")],
                         ids=["ring-without-lse-merge", "no-load-balancing-permutation"])
def test_attention_negative_controls(pool, control, expect):
    res = pool.run(attention_case, 2, comm="p2p", causal=True, heads=4, groups=2, s=16, **control)
    with pytest.raises(AssertionError, match=expect):
        check_attention(res, True, 4, 2, 16)


def test_a2a_refuses_heads_not_divisible_by_cp():
    """Refused before any collective (in one process: a cp group of 4 that is never used)."""
    q, k, v, _ = qkvo(1, 8, 2, 4, 4, seed=0)
    with pytest.raises(ValueError, match="2 query groups per TP rank are not divisible by cp=4"):
        P.ulysses_attention(argparse.Namespace(size=4, rank=0), q, k, v, None, True, 0.5)


def cp_bytes_case(rank, n, comm, b, heads, groups, s, d, dtype=torch.float64, repeats=1):
    """One layer's attention forward and backward on this rank: {phase: {kind: bytes}} of the collectives on the cp
    group (parallel.count_collectives) and the mean seconds of forward + backward over `repeats` runs."""
    import time
    grid = P.Grid(cp=n)
    q, k, v, do = (t.to(dtype) for t in qkvo(b, heads, groups, s // n, d, seed=rank))
    attend = P.context_parallel_attention(grid, comm)
    out, t0 = {}, time.perf_counter()
    for _ in range(repeats):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        with P.count_collectives() as fwd:
            o = attend(q_, k_, v_, None, True, 0.5)
        with P.count_collectives() as bwd:
            o.backward(do)
    seconds = (time.perf_counter() - t0) / repeats
    for phase, log in (("forward", fwd), ("backward", bwd)):
        out[phase] = {}
        for kind, group, nbytes in log:
            assert group == "cp", group
            out[phase][kind] = out[phase].get(kind, 0) + nbytes
    return dict(bytes=out, seconds=seconds)


def cp_theory(comm, cp, b, heads, groups, s, d, e=8):
    """The bytes per rank of one layer's attention, by the audit's rule (section 2: an all-gather counts its output,
    a reduce-scatter its input, all-to-all / send / recv what this rank sends or receives), e bytes per element."""
    kv, qo = 2 * b * groups * (s // cp) * d * e, b * heads * (s // cp) * d * e  # this rank's K/V; its q (or o)
    if comm == "p2p":  # cp−1 hops of the K/V block forward; backward cp−1 hops of [K/V; dK/dV]
        return {"forward": {"send": (cp - 1) * kv, "recv": (cp - 1) * kv},
                "backward": {"send": 2 * (cp - 1) * kv, "recv": 2 * (cp - 1) * kv}}
    if comm == "all_gather":  # the whole K/V gathered; its gradient reduce-scattered
        return {"forward": {"all_gather": cp * kv}, "backward": {"reduce_scatter": cp * kv}}
    return {"forward": {"all_to_all": 2 * qo + kv}, "backward": {"all_to_all": 2 * qo + kv}}  # q, k, v in; o out


@pytest.mark.parametrize("cp", [2, 4])
def test_collective_bytes_equal_theory(pool, cp):
    """Per rank and layer, the cp group's collectives are exactly the variant's volume (the ring: (cp−1)/cp of the
    whole K/V each way forward, twice that backward)."""
    shape = dict(b=2, heads=8, groups=4, s=8 * cp, d=4)
    for comm in P.CP_COMM_TYPES:
        for r in pool.run(cp_bytes_case, cp, comm=comm, **shape):
            assert r["bytes"] == cp_theory(comm, cp, **shape), (comm, r["bytes"])


# --------------------------------------------------------------------------------------- 2. models vs one process
def cp_case(rank, n, cfg, tp, pp, cp, sp, distopt, comm, M=2, b=8, s=8, steps=2, local_mean=False):
    """test_data_parallel's dp_case with a cp dimension: distopt None = the plain optimizer (finalize_grads), else
    DDP + DistributedOptimizer. local_mean: each rank divides by its own token count (negative control)."""
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp * cp), cp=cp)
    c = gpt.Config(**cfg, sequence_parallel=sp, cp_comm_type=comm)
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid)
    if distopt is None:
        ddp, opt = None, P.Optimizer(chunks, grid, **OPT)
    else:
        ddp = P.DDP(chunks, grid, bucket_size=3000, overlap=True, distributed_optimizer=distopt)
        opt = P.DistributedOptimizer(ddp, **OPT)
    batch = make_batch(cfg["vocab_size"], b, s, 11)
    micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].chunk(M))  # the cp ranks of a DP rank: the same rows
    shape = (s // cp // (tp if c.sequence_parallel else 1), micro[0].shape[0], c.hidden_size)
    num_tokens = batch[:, 1:].numel() // (cp if local_mean else 1)

    def first_step(log):
        grads = full_grads(chunks, ddp, grid) if ddp is not None else {
            m.global_name(k): P.gather_full(p.grad, p, grid).clone() for m in chunks for k, p in m.named_parameters()
            if not k == "output_layer.weight" or not c.share_embeddings_and_output_weights}
        return dict(grads=grads, cp_log=[(kind, nbytes) for kind, group, nbytes in log if group == "cp"])

    out = clipped_steps(chunks, grid, opt, micro, num_tokens, shape, c.params_dtype, CLIP, steps, first_step, count=True)
    params = {m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks for k, p in m.named_parameters()
              if not k == "output_layer.weight" or not c.share_embeddings_and_output_weights}
    return dict(out, params=params)


CP_KINDS = {"p2p": {"send", "recv"}, "all_gather": {"all_gather", "reduce_scatter"}, "a2a": {"all_to_all"}}
GPT2, LLAMA2 = dict(CFG, num_layers=2), dict(LLAMA, num_layers=2)  # test_data_parallel's models, 2 layers (fast)
LAYOUTS = [  # (world, tp, pp, cp, sp, distopt): cp alone (no DP at all), and cp 2 with each other kind
    (2, 1, 1, 2, False, None), (4, 1, 1, 4, False, None), (4, 2, 1, 2, True, True), (4, 1, 2, 2, False, None),
    (4, 1, 1, 2, False, True), (4, 1, 1, 2, False, None)]


def run_layout(pool, layout, comm, cfg):
    n, tp, pp, cp, sp, distopt = layout
    res = pool.run(cp_case, n, cfg=cfg, tp=tp, pp=pp, cp=cp, sp=sp, distopt=distopt, comm=comm)
    dp = n // (tp * pp * cp)
    got, ref = merge(res), reference(cfg, 2 * dp, steps=2)
    assert_same(got, ref, rtol=1e-10, what=f"{layout} {comm}")
    assert rel_err(got["norms"], ref["norms"]) < 1e-10, (got["norms"], ref["norms"])  # the clipping norm too
    kinds = {kind for r in res for kind, _ in r["cp_log"]}
    assert kinds == CP_KINDS[comm], f"{comm}: the cp group saw {kinds}"  # the configured variant, and only it, ran


@pytest.mark.parametrize("layout,comm,cfg", [
    (LAYOUTS[0], "p2p", GPT2), (LAYOUTS[1], "p2p", LLAMA2), (LAYOUTS[2], "p2p", LLAMA2), (LAYOUTS[3], "all_gather", GPT2),
    (LAYOUTS[4], "a2a", LLAMA2)],
    ids=["cp2-ring", "cp4-ring", "cp2-tp2-sp-distopt-ring", "cp2-pp2-allgather", "cp2-dp2-distopt-a2a"])
def test_context_parallel_model_equals_single_process(pool, layout, comm, cfg):
    run_layout(pool, layout, comm, cfg)


@given(layout=st.sampled_from(LAYOUTS), comm=st.sampled_from(P.CP_COMM_TYPES), llama=st.booleans())
def test_context_parallel_layouts_property(pool, layout, comm, llama):
    """Any layout x variant x model (learned positions + LayerNorm, or RoPE + GQA); a2a where the heads allow it.
    The explicit cases above cover each layout once; HYPOTHESIS_PROFILE=deep draws 60 combinations."""
    n, tp, pp, cp, sp, distopt = layout
    cfg = LLAMA2 if llama else GPT2
    if comm == "a2a" and (cfg["num_query_groups"] // tp) % cp:
        comm = "p2p"
    run_layout(pool, layout, comm, cfg)


def test_per_rank_mean_loss_is_caught(pool):
    """picotron's mistake: each cp rank takes the mean over its own tokens; summed over cp, gradients are cp x too
    large (AdamW hides it in the losses, not in the gradients)."""
    res = pool.run(cp_case, 2, cfg=GPT2, tp=1, pp=1, cp=2, sp=False, distopt=None, comm="p2p", local_mean=True)
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(merge(res), reference(GPT2, 2, steps=2), rtol=1e-10)


def bert_cp_case(rank, n, tp, cp, sp, batch):
    import test_bert
    grid = P.Grid(tp=tp, dp=n // (tp * cp), cp=cp)
    return test_bert.train_bert(grid, dict(test_bert.CFG, add_binary_head=False), sp, 2, batch)


def test_bert_with_padding_equals_single_process(pool, n=4, tp=2, cp=2, sp=True):
    """Bidirectional attention with a padding mask (the key mask travels in cp order), the masked-LM loss over this
    rank's masked tokens, learned positions: a BERT without binary head against one process (float64, 1e-10)."""
    import test_bert
    cfg = dict(test_bert.CFG, add_binary_head=False)
    batch = test_bert.make_batch(cfg["vocab_size"], 4, 8, seed=1, binary_head=False)
    assert (batch[:, 2] == 0).any()  # PADDING_MASK: some keys are padding
    got = test_bert.merge(pool.run(bert_cp_case, n, tp=tp, cp=cp, sp=sp, batch=batch))
    assert_same(got, test_bert.train_bert(None, cfg, False, 1, batch), rtol=1e-10, what=f"BERT tp={tp} cp={cp}")


# --------------------------------------------------------------------------------------- 3. refusals
def check(argv, world):
    return arguments.check_args(arguments.parse_args(argv), world)


@pytest.mark.parametrize("argv,world,expect", [
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, "--seq-length=30 divisible by 2 x cp = 4"),
    (["--context-parallel-size", "2", "--seq-length", "36", "--tensor-model-parallel-size", "4", "--sequence-parallel"],
     8, "--seq-length=36 divisible by cp x TP = 8"),
    (["--context-parallel-size", "2"], 3, "not divisible by tensor x pipeline parallel size 1 x 1 x context-parallel size 2"),
    (["--context-parallel-size", "0"], 1, "--context-parallel-size=0 must be >= 1"),
    (["--context-parallel-size", "2", "--model", "t5"], 2, "T5's cross-attention reads another sequence"),
    (["--context-parallel-size", "2", "--model", "retro"], 2, "Retro's chunked cross-attention"),
    (["--context-parallel-size", "2", "--model", "mamba"], 2, "Mamba's scan is a recurrence"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, "attention_dropout=0.1 with context-parallel"),
    (["--context-parallel-size", "2", "--num-experts", "4"], 2, "num_experts=4 with context-parallel size 2"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-query-groups", "2"], 4,
     "num_query_groups=2 / tp=1 is not divisible by context-parallel size 4"),
    (["--context-parallel-size", "2", "--model", "bert"], 2, "BERT's binary head pools \\[CLS\\]"),
], ids=["seq-2cp", "seq-sp", "world", "zero", "t5", "retro", "mamba", "dropout", "moe", "a2a-groups", "bert-binary"])
def test_bad_context_parallel_flags_are_refused(argv, world, expect):
    with pytest.raises(arguments.ConfigError, match=expect.replace("(", r"\(").replace("+", r"\+")):
        check(argv, world)


def test_good_flags_derive_the_data_parallel_size():
    args = check(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--global-batch-size", "8",
                  "--micro-batch-size", "4"], 8)
    assert args.data_parallel_size == 2 and args.num_micro_batches == 1


def test_models_with_their_own_layer_stack_are_refused_at_build():
    import t5  # its Config is gpt's; its Model builds its own stack
    grid = argparse.Namespace(tp_size=1, pp_size=1, ep_size=1, cp_size=2)
    with pytest.raises(ValueError, match="context-parallel size 2: T5's cross-attention reads another sequence"):
        t5.Model(t5.Config(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64), grid)


# --------------------------------------------------------------------------------------- 4. through torchrun
def test_torchrun_cp2_tp2_sp_resumes_at_cp1_on_the_same_curve(corpus, cache, tmp_path):
    """`make train NPROC=4 TP=2 ARGS="--context-parallel-size 2 --sequence-parallel"`, tiny, 2 iterations, a checkpoint
    after each. One process (cp 1) resumes from the first and runs iteration 2: its loss, grad norm and validation
    loss equal the cp 2 run's (float32, 1e-5) — the cp 2 checkpoint loads at cp 1, and a cp 2 step is a cp 1 step."""
    cp2 = tmp_path / "cp2"
    torchrun(4, tiny(corpus, cache, cp2, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                     "--sequence-parallel", "--save-interval", "1", "--eval-interval", "2", iters=2))
    got, got_val = metrics(cp2)
    assert sorted(got) == [1, 2] and sorted(got_val) == [2]
    one = tmp_path / "cp2_to_1"
    train.main(tiny(corpus, cache, one, "--load", str(cp2), "--ckpt-step", "1", "--eval-interval", "2", iters=2))
    ref, ref_val = metrics(one)
    assert sorted(ref) == [2]
    assert_close(got[2]["loss"], ref[2]["loss"], 1e-5, "cp 2 vs cp 1 loss at iteration 2")
    assert_close(got[2]["grad_norm"], ref[2]["grad_norm"], 1e-5, "cp 2 vs cp 1 grad norm at iteration 2")
    assert_close(got_val[2], ref_val[2], 1e-5, "cp 2 vs cp 1 validation loss at iteration 2")
