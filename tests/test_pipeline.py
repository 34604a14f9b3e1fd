"""Pipeline parallelism: schedules against Megatron's order, and pipelined training against the single process.

Tolerances: float64 1e-10 relative (reduction order only: TP/DP sums). With pp alone in float32 the forward loss is
bit-exact: every stage runs the same ops on the same micro-batch as the single process, and the last stage adds the
micro-batch losses in the same order.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gpt
import parallel as P
from equivalence import assert_same, check_dropout_streams, make_batch, model_dropout_masks_case


# --------------------------------------------------------------------------------------- the training driver
def train_pipelined(grid, cfg, tp_sp, vp, M, b, s, steps=2, seed=7):
    """`steps` AdamW steps of GPT with the global batch [b, s+1] cut into M micro-batches (per DP rank)."""
    c = gpt.Config(**cfg, sequence_parallel=tp_sp)
    chunks = P.build_chunks(lambda pre, post, off, n: gpt.Model(c, grid, pre, post, off, n), c.num_layers, grid, vp)
    params = [p for m in chunks for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    batch = make_batch(cfg["vocab_size"], b, s, seed)  # the global batch, identical on every rank
    dp, d = (grid.dp_size, grid.dp.rank) if grid is not None else (1, 0)
    local = batch.chunk(dp)[d]
    micro = list(local.chunk(M))
    tp = grid.tp_size if grid is not None else 1
    shape = (s // tp if chunks[0].config.sequence_parallel else s, local.shape[0] // M, c.hidden_size)

    def forward_step(model, mb):
        out = model(mb[:, :-1], labels=mb[:, 1:])
        return out.sum() if model.post_process else out

    losses, grads, trace = [], None, []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = P.forward_backward(chunks, micro, forward_step, batch[:, 1:].numel(), grid, shape, c.params_dtype,
                                  trace=trace if step == 0 else None)
        P.finalize_grads(chunks, grid)
        if grid is not None:  # each DP rank holds its share of the global loss
            loss = P.all_reduce(torch.as_tensor(loss, dtype=c.params_dtype), grid.dp_cp)
        losses.append(torch.as_tensor(loss).detach().clone())
        if step == 0:
            grads = _named(chunks, grid, True)
        opt.step()
    return dict(losses=torch.stack(losses), grads=grads, params=_named(chunks, grid, False),
                last=bool(chunks[-1].post_process), trace=trace, peak=getattr(P.run_schedule, "peak_in_flight", 0))


def _named(chunks, grid, grads):
    out = {}
    for m in chunks:
        for name, p in m.named_parameters():
            t = p.grad if grads else p.data
            key = m.global_name(name)
            if key != name and not name.startswith("decoder."):  # a last stage's copy of the tied embedding
                key += "#copy"
            out[key] = P.gather_full(t, p, grid).clone()
    return out


def pipeline_case(rank, n, cfg, tp, pp, vp, M, sp, b, s, dtype):
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    rec = train_pipelined(grid, dict(cfg, params_dtype=dtype), sp, vp, M, b, s)
    return rec if grid.tp.rank == 0 and grid.dp.rank == 0 else None


def merge(results):
    """One record from the pipeline's ranks: every stage's params and grads, the last stage's losses."""
    merged = dict(grads={}, params={})
    for r in results:
        if r is None:
            continue
        for key in ("grads", "params"):
            for name, t in r[key].items():
                if name.endswith("#copy"):  # tied embedding copy on the last stage: identical to the first's
                    merged.setdefault("copies", []).append((key, name[:-5], t))
                else:
                    merged[key][name] = t
        if r["last"]:
            merged["losses"] = r["losses"]
    for key, name, t in merged.get("copies", []):
        assert torch.equal(t, merged[key][name]), f"tied embedding copies differ ({key} {name})"
    return merged


GPT = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=211,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT, position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
             add_bias_linear=False, share_embeddings_and_output_weights=False)


# --------------------------------------------------------------------------------------- 1. exactness
@st.composite
def pipeline_layouts(draw):
    pp = draw(st.sampled_from([2, 4]))
    tp = 1 if pp == 4 else draw(st.sampled_from([1, 2]))
    vp = draw(st.sampled_from([1, 2]))
    M = pp * draw(st.sampled_from([1, 2])) if vp > 1 else draw(st.sampled_from([1, 2, 3, 4]))
    cfg = dict(draw(st.sampled_from([GPT, LLAMA])), num_layers=pp * vp * draw(st.sampled_from([1, 2])))
    return cfg, tp, pp, vp, M, tp > 1 and draw(st.booleans())


@given(pipeline_layouts())
def test_pipeline_equals_single_process_float64(pool, layout):
    cfg, tp, pp, vp, M, sp = layout
    b = M * 2
    got = merge(pool.run(pipeline_case, tp * pp, cfg=cfg, tp=tp, pp=pp, vp=vp, M=M, sp=sp, b=b, s=8,
                         dtype=torch.float64))
    ref = train_pipelined(None, dict(cfg, params_dtype=torch.float64), False, 1, M, b, 8)
    assert_same(got, ref, rtol=1e-10, what=f"tp={tp} pp={pp} vp={vp} M={M} sp={sp}")


@pytest.mark.parametrize("pp,vp,M", [(2, 1, 4), (4, 1, 3), (2, 2, 4)])
def test_pipeline_alone_float32_forward_loss_is_bit_exact(pool, pp, vp, M):
    cfg = dict(GPT, num_layers=4)
    got = merge(pool.run(pipeline_case, pp, cfg=cfg, tp=1, pp=pp, vp=vp, M=M, sp=False, b=M, s=8,
                         dtype=torch.float32))
    ref = train_pipelined(None, dict(cfg, params_dtype=torch.float32), False, 1, M, M, 8)
    assert torch.equal(got["losses"][0], ref["losses"][0]), (got["losses"], ref["losses"])


def test_pipeline_with_data_parallel(pool):
    cfg = dict(LLAMA, num_layers=4)
    got = merge(pool.run(pipeline_case, 4, cfg=cfg, tp=1, pp=2, vp=2, M=2, sp=False, b=8, s=8, dtype=torch.float64))
    ref = train_pipelined(None, dict(cfg, params_dtype=torch.float64), False, 1, 4, 8, 8)
    assert_same(got, ref, rtol=1e-10, what="pp=2 vp=2 dp=2")


def rng_streams_case(rank, n):
    grid = P.Grid(pp=2)
    c = gpt.Config(**dict(GPT, attention_dropout=0.1))
    chunks = P.build_chunks(lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl), c.num_layers, grid, vp=2)
    draws = []
    for chunk in chunks:  # each chunk's first draw from the stream its attention dropout uses
        with chunk.decoder.layers[0].self_attention.rng.fork():
            draws.append(torch.rand(16))
    return draws


def test_virtual_chunks_draw_from_one_rng_stream(pool):
    """Interleaved stages: the chunks on a rank share one RNG tracker (Megatron's is per rank). With a tracker per
    chunk, all seeded alike, chunk 1 repeated chunk 0's dropout masks (layer 0's and layer 2's, say): caught here."""
    for draws in pool.run(rng_streams_case, 2):
        assert not torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence-parallel"])
def test_pipeline_stages_draw_their_own_dropout_masks(pool, sp):
    """tp=2 x pp=2, hidden dropout 0.5: stage p's default stream is seeded seed + 100·p and its model-parallel
    stream seed + 100·p + 2718 + tp_rank (Megatron's _set_random_seed and model_parallel_cuda_manual_seed), so the
    stages draw different masks while a stage's TP ranks agree on replicated activations. Masks compared exactly."""
    check_dropout_streams(pool.run(model_dropout_masks_case, 4, tp=2, pp=2, sp=sp), sp)


def test_stages_sharing_one_stream_are_caught(pool):
    """Negative control: trackers without the 100·pp_rank offset make stage 1 repeat stage 0's masks."""
    with pytest.raises(AssertionError, match="pipeline stages 0 and 1 drew the same dropout masks"):
        check_dropout_streams(pool.run(model_dropout_masks_case, 4, tp=2, pp=2, sp=False, no_stage_offset=True), False)


def forget_embedding_sync_case(rank, n):
    grid = P.Grid(pp=2)
    grid.embedding = None  # negative control: the tied embedding copies are no longer summed
    return train_pipelined(grid, dict(GPT, params_dtype=torch.float64), False, 1, 2, 4, 8)


def test_missing_tied_embedding_reduction_is_caught(pool):
    with pytest.raises(AssertionError, match="tied embedding copies differ"):
        merge(pool.run(forget_embedding_sync_case, 2))


# --------------------------------------------------------------------------------------- 2. schedule order
# Megatron's schedules (megatron/core/pipeline_parallel/schedules.py), written out by hand for small cases as the
# ("F" | "B", micro-batch, model chunk) lists that schedule_1f1b / schedule_interleaved return.
#   forward_backward_pipelining_without_interleaving: warmup = min(pp − rank − 1, M) forwards, then one forward
#     and one backward at a time (the steady 1F1B state), then the remaining backwards (cooldown).
#   forward_backward_pipelining_with_interleaving: virtual micro-batch k = 0 .. M·vp − 1 walks micro-batches in
#     groups of pp, each group through chunk 0, then chunk 1, ...: the k-th forward runs chunk (k // pp) % vp on
#     micro-batch (k // (pp·vp))·pp + k % pp; the k-th backward the same micro-batch on chunk vp − 1 − that.
#     warmup = (pp − rank − 1)·2 + (vp − 1)·pp forwards, capped at M·vp; Megatron before its tunable schedule
#     (Nov. 2024) ran every forward first when M == pp.
# pp=4 vp=2 M=8, the virtual micro-batches k = 0..15 as (micro-batch, chunk):
#     forward:  (0,0) (1,0) (2,0) (3,0) (0,1) (1,1) (2,1) (3,1) (4,0) (5,0) (6,0) (7,0) (4,1) (5,1) (6,1) (7,1)
#     backward: (0,1) (1,1) (2,1) (3,1) (0,0) (1,0) (2,0) (3,0) (4,1) (5,1) (6,1) (7,1) (4,0) (5,0) (6,0) (7,0)
#   rank 0: warmup 3·2 + 4 = 10;  rank 3: warmup 0 + 4 = 4.
def _actions(text: str) -> list[tuple[str, int, int]]:
    """"F0.1 B2.0" -> [("F", 0, 1), ("B", 2, 0)]: kind, micro-batch, chunk."""
    return [(a[0], int(a[1:].split(".")[0]), int(a[1:].split(".")[1])) for a in text.split()]


MEGATRON_SCHEDULES = {  # (pp, vp, M, rank) -> the rank's actions, in order
    # 1F1B, pp=2 M=4: rank 0 warms up with 1 forward, rank 1 (the last stage) with none
    (2, 1, 4, 0): _actions("F0.0  F1.0 B0.0  F2.0 B1.0  F3.0 B2.0  B3.0"),
    (2, 1, 4, 1): _actions("F0.0 B0.0  F1.0 B1.0  F2.0 B2.0  F3.0 B3.0"),
    # 1F1B, pp=4 M=2: rank 0's warmup (3) is capped at M = 2
    (4, 1, 2, 0): _actions("F0.0 F1.0  B0.0 B1.0"),
    (4, 1, 2, 3): _actions("F0.0 B0.0  F1.0 B1.0"),
    # interleaved, pp=2 vp=2 M=4: warmup 1·2 + 2 = 4 on rank 0, 0 + 2 = 2 on rank 1
    (2, 2, 4, 0): _actions("F0.0 F1.0 F0.1 F1.1  F2.0 B0.1  F3.0 B1.1  F2.1 B0.0  F3.1 B1.0  B2.1 B3.1 B2.0 B3.0"),
    (2, 2, 4, 1): _actions("F0.0 F1.0  F0.1 B0.1  F1.1 B1.1  F2.0 B0.0  F3.0 B1.0  F2.1 B2.1  F3.1 B3.1  B2.0 B3.0"),
    # interleaved, pp=4 vp=2 M=8
    (4, 2, 8, 0): _actions("F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0  F6.0 B0.1  F7.0 B1.1  F4.1 B2.1 "
                           "F5.1 B3.1  F6.1 B0.0  F7.1 B1.0  B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0"),
    (4, 2, 8, 3): _actions("F0.0 F1.0 F2.0 F3.0  F0.1 B0.1  F1.1 B1.1  F2.1 B2.1  F3.1 B3.1  F4.0 B0.0  F5.0 B1.0 "
                           "F6.0 B2.0  F7.0 B3.0  F4.1 B4.1  F5.1 B5.1  F6.1 B6.1  F7.1 B7.1  B4.0 B5.0 B6.0 B7.0"),
    # interleaved, pp=2 vp=2 M=2 = pp: every forward first (the older Megatron's all-warmup case), on both ranks
    (2, 2, 2, 0): _actions("F0.0 F1.0 F0.1 F1.1  B0.1 B1.1 B0.0 B1.0"),
    (2, 2, 2, 1): _actions("F0.0 F1.0 F0.1 F1.1  B0.1 B1.1 B0.0 B1.0"),
}


def ours(pp, vp, M, rank):
    return P.schedule_1f1b(pp, rank, M) if vp == 1 else P.schedule_interleaved(pp, rank, M, vp)


@pytest.mark.parametrize("key", MEGATRON_SCHEDULES, ids=lambda k: "pp{}-vp{}-M{}-rank{}".format(*k))
def test_schedules_equal_megatron_tables(key):
    assert ours(*key) == MEGATRON_SCHEDULES[key]


def simulate(orders, pp, vp):
    """Run every rank's order with real data dependencies; return the steps taken (fails on a deadlock)."""
    done, pos, t = set(), [0] * pp, 0
    stage = lambda r, v: v * pp + r  # global stage index of chunk v on rank r
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, mb, v = orders[r][pos[r]]
            st_ = stage(r, v)
            prev = (("F", mb, st_ - 1),) if kind == "F" and st_ > 0 else ()
            if kind == "B":
                prev = (("F", mb, st_),) + ((("B", mb, st_ + 1),) if st_ < pp * vp - 1 else ())
            if all(p in done for p in prev):
                done.add((kind, mb, st_))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at step {t}: positions {pos}"
        t += 1
    return t


@pytest.mark.parametrize("pp,vp,M", [(2, 1, 1), (2, 1, 5), (4, 1, 2), (4, 1, 8), (2, 2, 2), (2, 2, 6), (4, 2, 4),
                                      (4, 2, 8), (4, 3, 12)])
def test_schedules_run_each_action_once_and_cannot_deadlock(pp, vp, M):
    """Beyond the tables: every rank forwards and backwards each (micro-batch, chunk) exactly once, and the ranks'
    orders together finish when each action waits for the actions it needs from the neighbouring stages."""
    orders = [ours(pp, vp, M, r) for r in range(pp)]
    for r, order in enumerate(orders):
        assert sorted(order) == sorted((k, m, v) for k in "FB" for m in range(M) for v in range(vp)), f"rank {r}"
    assert simulate(orders, pp, vp) >= 2 * M * vp


def test_deadlock_simulation_can_fail():
    """Negative control: rank 1 starting with a backward it has no forward for: both ranks end up waiting."""
    orders = [P.schedule_1f1b(2, 0, 2), [("B", 0, 0), ("F", 0, 0), ("F", 1, 0), ("B", 1, 0)]]
    with pytest.raises(AssertionError, match=r"deadlock at step 2: positions \[2, 0\]"):
        simulate(orders, 2, 1)


# ---- the timetable (parallel.timetable): the picture in parallel.py section 8 and in README.md
def timetable_cells(text):
    """{rank: [(time, (kind, mb, chunk)), ...]} from timetable()'s text ("." cells are waits)."""
    cells = {}
    for line in text.splitlines():
        rank, _, row = line.partition(":")
        acts = [(t, c) for t, c in enumerate(row.split()) if c != "."]
        cells[int(rank.split()[1])] = [(t, (c[0], *map(int, (c[1:] + ".0").split(".")[:2]))) for t, c in acts]
    return cells


def dependency_violations(text, pp, vp):
    """Every action of a drawn timetable that does not come strictly after what it needs: a forward after the
    previous stage's forward of its micro-batch, a backward after its own forward and the next stage's backward
    (stage = chunk·pp + rank). Written here from the rule, independently of parallel.timetable's simulation."""
    when = {(k, mb, v * pp + r): t for r, acts in timetable_cells(text).items() for t, (k, mb, v) in acts}
    bad = []
    for (k, mb, stage), t in when.items():
        needs = [("F", mb, stage - 1)] if k == "F" and stage > 0 else []
        if k == "B":
            needs = [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < pp * vp - 1 else [])
        bad += [f"{k}{mb} of stage {stage} at {t} before {n[0]}{n[1]} of stage {n[2]}" for n in needs
                if when.get(n, t) >= t]
    return bad


@pytest.mark.parametrize("pp,vp,M", [(2, 1, 1), (2, 1, 5), (4, 1, 6), (4, 1, 8), (2, 2, 4), (4, 2, 8), (4, 3, 12)])
def test_timetable_runs_the_schedules_and_respects_every_dependency(pp, vp, M):
    """Each rank's row holds its schedule's actions in the schedule's order, and no action starts before what it
    needs has finished (each takes one time unit)."""
    text = P.timetable(pp, M, vp)
    for r, acts in timetable_cells(text).items():
        assert [a for _, a in acts] == ours(pp, vp, M, r), f"rank {r}"
    assert dependency_violations(text, pp, vp) == []


def test_timetable_negative_controls():
    """Two cells of the drawn 1F1B table swapped (the last stage's backward before its forward) are caught; orders
    with two actions swapped (a rank's backward before its forward) cannot run: the simulation reports a deadlock."""
    text = P.timetable(4, 6)
    swapped = text.replace("rank 3: .  .  .  F0 B0", "rank 3: .  .  .  B0 F0")
    assert swapped != text
    assert dependency_violations(swapped, 4, 1) == ["B0 of stage 3 at 3 before F0 of stage 3"]
    orders = [P.schedule_1f1b(2, 0, 2), [("B", 0, 0), ("F", 0, 0), ("F", 1, 0), ("B", 1, 0)]]
    with pytest.raises(ValueError, match=r"deadlock at time 2: each rank waits at its action \[2, 0\]"):
        P.timetable(2, 2, orders=orders)


def test_the_drawn_1f1b_pictures_are_the_code_s_timetable():
    """README.md's picture and parallel.py section 8's comment are parallel.timetable(4, 6)'s output, line by line."""
    want = P.timetable(4, 6).splitlines()
    root = Path(__file__).resolve().parent.parent
    readme = [line for line in (root / "README.md").read_text().splitlines() if line.startswith("rank ")]
    assert readme == want
    comment = [line.removeprefix("#      ") for line in (root / "parallel.py").read_text().splitlines()
               if line.startswith("#      rank ")]
    assert comment == want


def trace_case(rank, n, vp, M):
    grid = P.Grid(pp=n)
    rec = train_pipelined(grid, dict(GPT, params_dtype=torch.float64, num_layers=n * vp), False, vp, M, M, 8, steps=1)
    return rec["trace"], rec["peak"]


@pytest.mark.parametrize("vp,M", [(1, 4), (2, 4)])
def test_executed_trace_and_peak_activations(pool, vp, M):
    """The executor runs the table's actions in the table's order, and holds at most warmup + 1 micro-batches'
    activations (warmup: the forwards before the table's first backward)."""
    pp = 2
    for r, (trace, peak) in enumerate(pool.run(trace_case, pp, vp=vp, M=M)):
        table = MEGATRON_SCHEDULES[pp, vp, M, r]
        assert trace == table, f"rank {r}"
        warmup = next(i for i, (kind, _, _) in enumerate(table) if kind == "B")
        assert 1 <= peak <= warmup + 1, (r, peak, warmup)


# --------------------------------------------------------------------------------------- 3. the loss-token protocol
class _Counting(torch.nn.Module):
    """A submodule with its own loss that wants the global batch's loss-token count (as MoE's Router does)."""

    def __init__(self):
        super().__init__()
        self.w, self.seen = torch.nn.Parameter(torch.ones(())), []

    def set_num_tokens(self, num_tokens):
        self.seen.append(num_tokens)


def test_schedules_tell_the_model_the_global_token_count():
    """Every schedule calls set_num_tokens(num_tokens) on each submodule that has it, once, before the first
    micro-batch's forward."""
    model = torch.nn.Sequential(_Counting())
    seen_at_forward = []

    def forward_step(m, mb):
        seen_at_forward.append(list(m[0].seen))
        return (m[0].w * mb).sum()

    P.forward_backward([model], [torch.ones(2), torch.ones(3)], forward_step, 10, None)
    assert seen_at_forward == [[10], [10]]
    assert float(model[0].w.grad) == 5 / 10  # the loss rule: sum of token losses / num_tokens


# --------------------------------------------------------------------------------------- 4. bad layouts
def test_bad_pipeline_layouts_are_refused():
    with pytest.raises(ValueError, match="num_layers=6 is not divisible by pipeline-model-parallel size 4"):
        gpt.Config(num_layers=6).check_layout(tp=1, pp=4)
    with pytest.raises(ValueError, match="num_layers=2 is not divisible by pipeline size 1 x virtual stages 4"):
        P.stage_layers(2, None, vp=4)
    with pytest.raises(ValueError, match="number of micro-batches 3 must be a multiple of pp=2"):
        P.schedule_interleaved(2, 0, 3, 2)
    with pytest.raises(ValueError, match="need pipeline parallelism"):
        P.build_chunks(lambda *a: None, 4, None, vp=2)
