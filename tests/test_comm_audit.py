"""Communication audit: every collective of one training iteration, counted (parallel.count_collectives), against the
analytic volumes of the papers — exactly, per (kind, group). Any collective the formulas do not predict fails here.

One iteration = train.py's loop body: zero_grad, forward_backward, finish_grad_sync, (MoE) the tokens-per-expert
all-reduce, the loss all-reduces, clip_grad_norm, step. The log is summed over all ranks: a collective over a group
of n ranks appears n times, once per member. Bytes are those of the full tensor a collective works on (the
convention of parallel.py section 2): an all-reduce of N bytes and its SP pair (reduce-scatter + all-gather) log N
each, so TP and TP+SP have the same volume, as Korthikanti et al. 2022 §4.2.2 state — but for the all-gather
that SP's column-parallel linears run again in backward, to keep only their input's sequence shard (the paper's
§4.2.2 and Megatron do the same: memory bought with communication).
"""
from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

import gpt
import parallel as P
from equivalence import make_batch

# The model: 2 layers, h 16, 4 heads, seq 8, micro-batch 2, 2 micro-batches, vocab 64 (no padding), float64, no dropout
SHAPE = dict(L=2, h=16, heads=4, s=8, b=2, M=2, V=64, E=2, k=1)
LAYOUTS = {  # name -> the Grid's degrees and switches
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "tp2_sp_rope": dict(tp=2, sp=True, rope=True),  # no position embedding: the embedding reduce-scatters (ḡ)
    "tp2_fp8": dict(tp=2, fp8=True),  # + the delayed recipe's one amax all-reduce per step (parallel.py section 11)
    "pp2": dict(pp=2),
    "dp2": dict(dp=2),  # parallel.Optimizer: finalize_grads' one flat all-reduce
    "dp2_ddp": dict(dp=2, ddp=True),  # parallel.DDP's bucketed all-reduce (overlapped with backward)
    "dp2_distopt": dict(dp=2, ddp=True, distopt=True),
    "ep2_moe": dict(dp=2, ep=2, moe=True),
    "tp2_pp2_sp": dict(tp=2, pp=2, sp=True),  # the formulas composed: TP inside each stage, SP shards sent over PP
}


def config(L, h, heads, s, V, E, k, sp=False, moe=False, rope=False, **_):
    moe_kw = dict(num_experts=E, moe_router_topk=k, moe_token_dispatcher_type="alltoall") if moe else {}
    return gpt.Config(num_layers=L, hidden_size=h, num_attention_heads=heads, vocab_size=V, make_vocab_size_divisible_by=V,
                      max_position_embeddings=s, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
                      sequence_parallel=sp, position_embedding_type="rope" if rope else "learned_absolute", **moe_kw)


def iteration_case(rank, n, shape, tp=1, pp=1, dp=1, ep=1, sp=False, ddp=False, distopt=False, moe=False, rope=False,
                   fp8=False, extra=False, no_reduce_scatter=False):
    """One training iteration, as train.py runs it, inside count_collectives(); returns this rank's log."""
    grid = P.Grid(tp=tp, pp=pp, dp=dp, ep=ep)
    c = config(**shape, sp=sp, moe=moe, rope=rope)
    L, s, b, M, V = (shape[x] for x in "L s b M V".split())
    make = lambda pre, post, offset, nl: gpt.Model(c, grid, pre_process=pre, post_process=post, layer_offset=offset,
                                                   num_layers=nl)
    chunks = P.build_chunks(make, L, grid)
    if no_reduce_scatter:  # the negative control: the embedding all-reduces and splits though it could reduce-scatter
        chunks[0].embedding.reduce_scatter = False
    fp8 = P.fp8_enable(torch.nn.ModuleList(chunks), P.FP8Recipe(), grid) if fp8 else None  # delayed scaling
    opt = P.DistributedOptimizer(P.DDP(chunks, grid, distributed_optimizer=distopt)) if ddp else P.Optimizer(chunks, grid)
    batch = make_batch(V, b * M * dp, s)
    micro = batch.chunk(dp)[grid.dp.rank].split(b)

    def step(model, mb):  # train.py's stage_step: the sum of token losses on the last stage, else the hidden states
        return model(mb[:, :-1], labels=mb[:, 1:]).sum() if model.post_process else model(mb[:, :-1])

    p2p_shape = (s // tp if sp else s, b, c.hidden_size)
    with P.count_collectives() as log:
        opt.zero_grad(M)
        loss = P.forward_backward(chunks, micro, step, batch[:, 1:].numel(), grid, p2p_shape, torch.float64)
        opt.finish_grad_sync()
        load = P.moe_load(torch.nn.ModuleList(chunks))
        if load is not None:  # train.py logs the tokens per expert of the whole DP group
            P.all_reduce(load, grid.dp)
        loss = torch.as_tensor(loss, dtype=torch.float64).reshape(1)
        for g in (grid.pp, grid.dp):  # train.py: the logged loss, reduced over PP and DP
            loss = P.all_reduce(loss, g)
        if extra:  # the negative control: one all-reduce nobody asked for
            P.all_reduce(loss, grid.tp)
        opt.clip_grad_norm(1.0)
        opt.step()
        if fp8 is not None:  # train.py: after the step, the delayed recipe's amaxes -> next step's scales
            fp8.update()
    return log


def measure(pool, name, shape=SHAPE, **kw) -> dict:
    """{(kind, group): (calls, bytes)} summed over every rank of the layout."""
    lay = LAYOUTS[name]
    n = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1)
    calls, nbytes = Counter(), Counter()
    for log in pool.run(iteration_case, n, shape=shape, **lay, **kw):
        for kind, group, nb in log:
            calls[kind, group] += 1
            nbytes[kind, group] += nb
    return {key: (calls[key], nbytes[key]) for key in calls}


def expected(shape: dict, name: str) -> dict:
    """{(kind, group): (calls, bytes)} summed over ranks, from the formulas. e = 8 bytes (float64); T = s·b tokens of
    a micro-batch; A = s·b·h, one micro-batch's activations; M micro-batches; L layers, L/pp on each stage."""
    L, h, s, b, M, V, E, k = (shape[x] for x in "L h s b M V E k".split())
    lay, e = LAYOUTS[name], 8
    tp, pp, dp, sp = lay.get("tp", 1), lay.get("pp", 1), lay.get("dp", 1), lay.get("sp", False)
    W, stage = tp * pp * dp, tp * dp  # ranks in the world, in one pipeline stage
    T, A, Ls = s * b, s * b * h, L // pp
    out = Counter()

    def add(kind, group, ranks, calls, elems, size=e):  # on each of `ranks` ranks, `calls` collectives of `elems`
        if ranks * calls:
            c, nb = out.get((kind, group), (0, 0))
            out[kind, group] = (c + ranks * calls, nb + ranks * calls * elems * size)

    # the GPT's parameters (Narayanan et al. 2021 §5.1: 12·L·h² + 13·L·h + (V + s)·h, + 2h for the final norm):
    #   layer = LN 2h + QKV 3h² + 3h + proj h² + h + LN 2h + fc1 4h² + 4h + fc2 4h² + h; output layer tied (no weight)
    params = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
    if tp > 1:  # Shoeybi et al. 2019 §3 (per layer: g after attention and MLP forward, f before them in backward)
        add("all_reduce", "tp", stage, 3 * M, T)  # last stage: vocab-parallel cross-entropy's max, target logit, sum-exp
        if sp and lay.get("rope"):  # no position embedding: Megatron's reduce_scatter_embeddings, ḡ for g + split
            add("reduce_scatter", "tp", stage, M, A)  # first stage: the vocab-parallel embedding's ḡ
        else:
            add("all_reduce", "tp", stage, M, A)  # first stage: the vocab-parallel embedding's g (backward: identity)
        if not sp:
            add("all_reduce", "tp", W, 2 * Ls * M, A)  # forward g: attention out (linear_proj), MLP out (linear_fc2)
            add("all_reduce", "tp", W, 2 * Ls * M, A)  # backward f: before linear_qkv and linear_fc1
            add("all_reduce", "tp", stage, M, A)  # last stage: backward f before the output layer (h -> V/tp)
        else:  # Korthikanti et al. 2022 §4.2.2: f -> all-gather (g), g -> reduce-scatter (ḡ), conjugate in backward
            add("all_gather", "tp", W, 2 * Ls * M, A)  # forward g: the sequence gathered before linear_qkv, linear_fc1
            add("reduce_scatter", "tp", W, 2 * Ls * M, A)  # forward ḡ: after linear_proj and linear_fc2
            add("reduce_scatter", "tp", W, 2 * Ls * M, A)  # backward of g
            add("all_gather", "tp", W, 2 * Ls * M, A)  # backward of ḡ
            # backward, g again: a column-parallel linear keeps only its input's sequence shard and all-gathers it
            # again for its weight gradient (§4.2.2; Megatron's LinearWithGradAccumulationAndAsyncCommunication):
            # one more all-gather of A per linear_qkv, linear_fc1 and output layer backward, the memory's price
            add("all_gather", "tp", W, 2 * Ls * M, A)
            add("all_gather", "tp", stage, M, A)  # last stage: the output layer's g (forward), again in backward ...
            add("all_gather", "tp", stage, M, A)
            add("reduce_scatter", "tp", stage, M, A)  # ... and its backward
            add("all_gather", "tp", stage, M, A)  # first stage: backward of the embedding's scatter to the sequence
            # shards, or of its ḡ (learned position embeddings are added to the whole sequence, so there the embedding
            # all-reduces then splits; Megatron's reduce_scatter_embeddings needs no position/tokentype embeddings)
            # SP norm grads (finalize_model_grads): LN weight + bias x 2 per layer, the row-parallel biases of
            # linear_proj and linear_fc2, the last stage's final LN; summed over TP in one flat all-reduce per step
            add("all_reduce", "tp", W - stage, 1, Ls * 6 * h)
            add("all_reduce", "tp", stage, 1, Ls * 6 * h + 2 * h)
    if lay.get("fp8"):  # FP8State.update: one all-reduce MAX of every amax (float32): 4 linears x 3 tensors a layer
        add("all_reduce", "tp", W, 1, Ls * 4 * 3, size=4)  # (Transformer Engine's reduce_and_update_fp8_tensors)
    if tp * pp > 1:
        add("all_reduce", "mp", W, 1, 2)  # grad norm: [dense, expert] sums of squares over the model replica (TP x PP)
    if pp > 1:  # Narayanan et al. 2021: one activation each way per stage boundary and micro-batch
        msg = A // tp if sp else A  # under SP a stage sends its s/tp sequence shard
        for kind in ("send", "recv"):
            add(kind, "pp", W - stage, M, msg)  # every stage but the last sends activations forward (its next receives)
            add(kind, "pp", W - stage, M, msg)  # every stage but the first sends the gradients back
        add("all_reduce", "embedding", 2 * stage, 1, V // tp * h)  # tied word embedding: first + last stage's grads
        add("all_reduce", "pp", W, 1, 1)  # train.py's logged loss: the last stage holds it
    if dp > 1:
        add("all_reduce", "dp", W, 1, 1)  # train.py's logged loss: each DP rank holds its part of the global mean
        assert tp * pp == 1, "the DP formulas below count the parameters of a whole model (tp = pp = 1)"
    if name == "dp2":  # plain DP (finalize_grads): every gradient element summed in one flat all-reduce
        add("all_reduce", "dp_cp", W, 1, params)
    if name == "dp2_ddp":  # DDP: the same sum, of one bucket padded to a multiple of dp (the norm needs nothing more)
        add("all_reduce", "dp_cp", W, 1, -(-params // dp) * dp)
    if lay.get("distopt"):  # ZeRO stage 1 (Rajbhandari et al. 2020): reduce-scatter the grads, all-gather the params
        padded = -(-params // dp) * dp  # one bucket (4M-element buckets), padded to a multiple of dp
        add("reduce_scatter", "dp_cp", W, 1, padded)
        add("all_gather", "dp_cp", W, 1, padded)
        add("all_reduce", "dp_cp", W, 1, 2)  # grad norm: each DP rank holds a slice of the grads
    if lay.get("moe"):  # every layer MoE, E experts, top-k, dropless; the alltoall dispatcher over ep = dp ranks
        # non-expert parameters: a layer is LN 2h + attention 4h² + 4h + LN 2h + router E·h + E (experts: no bias)
        dense = V * h + s * h + L * (2 * h + 4 * h * h + 4 * h + 2 * h + E * h + E) + 2 * h
        add("all_reduce", "dp_cp", W, 1, dense)  # plain DP: every non-expert grad summed (experts: expert_dp = 1 rank)
        add("all_to_all", "ep", W, L * M, E)  # token counts per (rank, expert): int64 [ep, E/ep]
        # tokens: x out and the expert outputs back in forward, both again in backward; over all ranks each moves
        # every routed (token, expert) pair of every rank once: W·T·k rows of h (written as T·k rows per rank)
        add("all_to_all", "ep", W, 4 * L * M, T * k * h)
        add("all_reduce", "dp", W, 1, L * E, size=4)  # train.py's tokens-per-expert log (float32 [L, E])
        add("all_reduce", "ep", W, 1, 1)  # grad norm: the expert part, over the EP ranks that hold different experts
    return dict(out)


def check(measured: dict, want: dict, what: str = ""):
    """measured == expected per (kind, group), calls and bytes; the message is the whole table."""
    keys = sorted(set(measured) | set(want))
    rows = [f"{k[0]:>14} {k[1]:>9}  calls {measured.get(k, (0, 0))[0]:>4} / {want.get(k, (0, 0))[0]:<4} "
            f"bytes {measured.get(k, (0, 0))[1]:>8} / {want.get(k, (0, 0))[1]:<8}"
            + ("" if measured.get(k) == want.get(k) else "   <- MISMATCH") for k in keys]
    bad = [f"{k[0]} over {k[1]}: measured {measured.get(k, (0, 0))[0]} calls / {measured.get(k, (0, 0))[1]} bytes, "
           f"expected {want.get(k, (0, 0))[0]} / {want.get(k, (0, 0))[1]}" for k in keys if measured.get(k) != want.get(k)]
    assert not bad, f"{what}: " + "; ".join(bad) + "\n(measured / expected)\n" + "\n".join(rows)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_iteration_moves_exactly_the_analytic_volume(pool, name):
    check(measure(pool, name), expected(SHAPE, name), name)


def test_an_extra_collective_is_caught(pool):
    """Negative control: one stray all-reduce of the loss over TP (8 bytes, on each of the 2 ranks) fails, naming it."""
    calls, nbytes = expected(SHAPE, "tp2_sp")["all_reduce", "tp"]
    msg = f"all_reduce over tp: measured {calls + 2} calls / {nbytes + 16} bytes, expected {calls} / {nbytes}"
    with pytest.raises(AssertionError, match=re.escape(msg)):
        check(measure(pool, "tp2_sp", extra=True), expected(SHAPE, "tp2_sp"), "tp2_sp + a stray all-reduce")


def test_the_embedding_all_reduce_under_sp_is_caught(pool):
    """Negative control: a rope model's SP embedding that all-reduces the whole sequence then splits it (g + split,
    where Megatron's reduce_scatter_embeddings does one ḡ) fails the audit, naming both kinds."""
    with pytest.raises(AssertionError, match=r"all_reduce over tp: measured \d+ calls.*reduce_scatter over tp"):
        check(measure(pool, "tp2_sp_rope", no_reduce_scatter=True), expected(SHAPE, "tp2_sp_rope"), "tp2_sp_rope")


def test_an_expected_table_off_by_one_is_caught():
    want = expected(SHAPE, "pp2")
    wrong = {**want, ("send", "pp"): (want["send", "pp"][0] - 1, want["send", "pp"][1])}
    with pytest.raises(AssertionError, match=r"send over pp: measured 4 calls"):
        check(want, wrong, "pp2")


def test_off_by_default():
    assert P.COMM_LOG is None
    with P.count_collectives() as log:
        P._log("all_reduce", P.Group([0], 0, name="tp"), torch.zeros(3, dtype=torch.float64))
    assert P.COMM_LOG is None and log == [("all_reduce", "tp", 24)]



COLLECTIVE = re.compile(r"\b(dist\.(all_reduce|all_gather|all_to_all_single|isend|irecv|send|recv|broadcast|reduce_scatter"
                        r"\w*)|all_gather_single|reduce_scatter_single)\(")


def unlogged_collectives(source: str) -> list[tuple[int, str]]:
    """(line number, line) of each collective call with no `_log(` on it or the 5 lines above."""
    lines = source.splitlines()
    return [(i + 1, line.strip()) for i, line in enumerate(lines) if COLLECTIVE.search(line)
            and not any("_log(" in x for x in lines[max(0, i - 5):i + 1])]


def test_every_collective_of_parallel_py_is_logged():
    """The audit sees only what calls _log: a collective added without it would escape the exact comparison above."""
    assert unlogged_collectives(open(P.__file__).read()) == []


def test_an_unlogged_collective_is_found():
    src = "def f(x, g):\n    _log('all_reduce', g, x)\n    dist.all_reduce(x, group=g.pg)\n\n\n\n\n\n" \
          "def h(x, g):\n    dist.all_to_all_single(x, x, group=g.pg)\n"
    assert unlogged_collectives(src) == [(10, "dist.all_to_all_single(x, x, group=g.pg)")]
