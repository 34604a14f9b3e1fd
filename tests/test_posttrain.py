"""Post-training tasks (posttraining/recipes.py section 2): the losses against float64 hand-written formulas, and every task
under every parallel layout against the single process.

  - each loss (SFT's masked token sum, DPO with cDPO smoothing, KTO, the reward model's Bradley-Terry) equals a
    per-element float64 formula written out with `math` here, loss and gradient (autograd against the formula's
    derivative), to 1e-12 relative (the same operations in another order: measured ~1e-16);
  - DPO's, KTO's and RM's recipes (Task.prepare + policy_step, what train.py runs) equal those formulas applied to
    their flags and to the log-probs / values of plain forwards, sample by sample (float64, 1e-12 relative);
  - SFT (plain and packed), DPO, KTO and RM, with and without LoRA, under TP / SP / PP 1F1B / interleaved PP / DP /
    DDP / the distributed optimizer, equal the single process (one micro-batch of the whole global batch): the losses
    of 2 steps, every trainable gradient after the first backward and every trainable parameter after 2 AdamW steps,
    float64, 1e-10 relative (reduction order only, DESIGN.md §2; measured ~1e-15). The reference model takes part:
    DPO's and KTO's log-probs and KTO's z0 come from it in every layout;
  - negative controls: DPO divided by the micro-batch's pairs, the reference model = the current policy, and KTO's z0
    over one DP rank's samples each fail the comparison ("worst relative error");
  - one-line errors through train.py, and (once the task datasets exist) a torchrun DPO run at TP 2.
Samples are built by hand here, in the SAMPLE FORMAT (posttraining/recipes.py section 1): tokens right-padded with eod, 0/1 mask
rows (1 = a response token, the closing eod included), the META row last.
"""
from __future__ import annotations

import argparse
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import arguments
import checkpoint
import gpt
import parallel as P
import tools
import train
from equivalence import assert_same
from posttraining import lora, recipes

EOD, V, S = 0, 211, 8  # the eod id, vocabulary, --seq-length of the layout tests
CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=V,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64,
           position_embedding_type="rope", normalization="RMSNorm", activation="silu", gated_linear_unit=True,
           add_bias_linear=False)
OPT = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
HYPER = dict(dpo_beta=0.5, dpo_label_smoothing=0.1, kto_beta=0.5, kto_desirable_weight=1.3, kto_undesirable_weight=0.7)


# --------------------------------------------------------------------------------------- 1. the losses vs formulas
def _sig(x):
    return 1 / (1 + math.exp(-x))


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(got, want, what):
    want = torch.as_tensor(want, dtype=torch.float64)
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))
    assert err <= 1e-12, f"{what}: relative error {err:.1e}"


def test_sft_loss_sums_the_masked_tokens():
    losses, mask = _rand(3, 7).abs().requires_grad_(), (_rand(3, 7, seed=1) > 0).double()
    recipes.sft_loss(losses, mask).backward()
    losses, grad = losses.detach(), losses.grad
    want = sum(float(losses[i, t]) for i in range(3) for t in range(7) if mask[i, t])
    _close(recipes.sft_loss(losses, mask).detach(), want, "sft loss")
    _close(grad, mask, "sft gradient")  # d/d loss_t = mask_t
    _close(recipes.sequence_logps(losses, mask).detach(),
           [-sum(float(losses[i, t]) for t in range(7) if mask[i, t]) for i in range(3)], "sequence log-probs")


@pytest.mark.parametrize("eps", [0.0, 0.1], ids=["dpo", "cdpo"])
def test_dpo_loss_is_the_formula(eps):
    beta, (pc, pr, rc, rr) = 0.3, (_rand(6, seed=i) * 3 for i in range(4))
    pc.requires_grad_(), pr.requires_grad_()
    loss = recipes.dpo_loss(pc, pr, rc, rr, beta, eps)
    loss.sum().backward()
    want, dpc, (c, r, a, b) = [], [], (x.detach().tolist() for x in (pc, pr, rc, rr))
    for i in range(6):
        h = beta * ((c[i] - a[i]) - (r[i] - b[i]))
        want.append(-(1 - eps) * math.log(_sig(h)) - eps * math.log(_sig(-h)))
        dpc.append(beta * (-(1 - eps) * (1 - _sig(h)) + eps * _sig(h)))  # dL/dh · dh/dpi_c
    _close(loss.detach(), want, "dpo loss")
    _close(pc.grad, dpc, "dpo d/d pi_chosen")
    _close(pr.grad, [-d for d in dpc], "dpo d/d pi_rejected")


def test_kto_loss_is_the_formula():
    beta, z0, wd, wu = 0.4, 0.25, 1.3, 0.7
    pi, ref, label = _rand(8, seed=5).requires_grad_(), _rand(8, seed=6), torch.tensor([1, 0] * 4)
    loss = recipes.kto_loss(pi, ref, torch.tensor(z0, dtype=torch.float64), label, beta, wd, wu)
    loss.sum().backward()
    want, grad = [], []
    for i in range(8):
        r = pi.tolist()[i] - ref.tolist()[i]
        if label[i]:
            x = _sig(beta * (r - z0))
            want.append(wd * (1 - x))
            grad.append(-wd * beta * x * (1 - x))
        else:
            x = _sig(beta * (z0 - r))
            want.append(wu * (1 - x))
            grad.append(wu * beta * x * (1 - x))
    _close(loss.detach(), want, "kto loss")
    _close(pi.grad, grad, "kto gradient")


def test_rm_loss_is_bradley_terry():
    vc, vr = _rand(5, seed=7).requires_grad_(), _rand(5, seed=8).requires_grad_()
    loss = recipes.rm_loss(vc, vr)
    loss.sum().backward()
    d = [a - b for a, b in zip(vc.tolist(), vr.tolist())]
    _close(loss.detach(), [-math.log(_sig(x)) for x in d], "rm loss")
    _close(vc.grad, [-(1 - _sig(x)) for x in d], "rm d/d v_chosen")
    _close(vr.grad, [1 - _sig(x) for x in d], "rm d/d v_rejected")


def test_last_token_values_read_the_last_response_token():
    values = torch.arange(2 * 3 * 6, dtype=torch.float64).view(2, 3, 6)
    mask = torch.zeros(2, 3, 6)
    mask[0, 0, 2:4] = mask[0, 1, 5] = mask[0, 2, 0:6] = mask[1, :, 1] = 1
    assert recipes.last_token_values(values, mask).tolist() == [[3, 11, 17], [19, 25, 31]]


# --------------------------------------------------------------------------------------- 2. samples by hand
def _sequence(g, s, prompt_len=None):
    """One rendered sequence: (tokens [s+1] right-padded with eod, mask [s+1]: 1 on the response and its eod)."""
    n = int(torch.randint(3, s + 2, (1,), generator=g))  # its tokens, the closing eod included
    p = prompt_len or int(torch.randint(1, n - 1, (1,), generator=g))
    tok, mask = torch.full((s + 1,), EOD), torch.zeros(s + 1, dtype=torch.long)
    tok[:n - 1] = torch.randint(1, V, (n - 1,), generator=g)
    mask[p:n] = 1
    return tok, mask


def make_task_batch(task, n, s=S, seed=0, packing=False):
    """A global batch [n, R, s+1] of `task` samples (SAMPLE FORMAT); META[1] is left 0 (posttrain numbers it)."""
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(n):
        meta = torch.zeros(s + 1, dtype=torch.long)
        if task == "sft" and packing:  # two samples back to back, each ending with its eod
            (t1, m1), (t2, m2) = _sequence(g, s // 2 - 1), _sequence(g, s // 2 - 1)
            n1 = int((t1 != EOD).sum()) + 1
            tok, mask = torch.full((s + 1,), EOD), torch.zeros(s + 1, dtype=torch.long)
            tok[:n1], mask[:n1] = t1[:n1], m1[:n1]
            tok[n1:n1 + s // 2], mask[n1:n1 + s // 2] = t2, m2
            rows = [tok, mask]
        elif task == "sft":
            rows = list(_sequence(g, s))
        else:
            a, b = _sequence(g, s), _sequence(g, s)
            meta[0] = int(torch.randint(0, 2, (1,), generator=g)) if task == "kto" else 0
            rows = [*a, *b]
        out.append(torch.stack(rows + [meta]))
    return torch.stack(out)


def test_hand_built_samples_follow_the_format():
    for task, rows in recipes.ROWS.items():
        b = make_task_batch(task, 4, packing=task == "sft")
        assert b.shape == (4, rows, S + 1)
        for k in range(0, rows - 1, 2):  # every masked token is a real one, and each response ends with its eod
            assert ((b[:, k + 1] == 1) <= ((b[:, k] != EOD) | (b[:, k + 1] == 1))).all()
            last = S - b[:, k + 1].flip(-1).argmax(-1)
            assert (b[torch.arange(4), k, last] == EOD).all()


# --------------------------------------------------------------------------------------- 2b. the recipes vs formulas
# Flag values under which every loss term is visible: smoothing > 0, beta != 1, desirable weight != undesirable
RECIPE_FLAGS = dict(dpo_beta=0.3, dpo_label_smoothing=0.2, kto_beta=0.4, kto_desirable_weight=1.3,
                    kto_undesirable_weight=0.7)
# a 2-layer float64 GPT whose padded vocabulary is V itself: its logits [.., V] are the whole softmax the loss uses
RECIPE_CFG = dict(CFG, num_layers=2, make_vocab_size_divisible_by=1)


def recipe_unit_losses(task, policy, ref, batch):
    """What train.py gets from the task for `batch` [g, R, s+1] on one process: recipes.Task(...).prepare(batch),
    then the recipe (Task.policy_step) on each micro-batch. With --micro-batch-size 1 each micro-batch is one sample,
    so the recipe's sum is that sample's loss: [g] float64. The only place this test builds a Task (its arguments:
    train.py's flags as a Namespace, the model chunks, the grid, the p2p shape, the dtype, the eod id, the reference
    chunks)."""
    args = argparse.Namespace(task=task, packing=False, micro_batch_size=1, global_batch_size=len(batch),
                              lora_rank=None, **RECIPE_FLAGS)
    c = policy.config
    t = recipes.Task(args, [policy], P.Grid(), (S, 1, c.hidden_size), c.params_dtype, EOD,
                       ref_chunks=None if ref is None else [ref])
    micro, recipe, count, _ = t.prepare(batch.clone())
    assert count == len(batch) == len(micro)
    return torch.stack([recipe(policy, mb).detach().reshape(()) for mb in micro])


def _hand_logps(model, tokens, mask):
    """Each sequence's response log-prob from a plain forward: sum over t of mask[t+1]·log softmax(logits[t])[tokens[t+1]]
    (tokens, mask [n, s+1]) -> [n], in float64, by explicit loops."""
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens[:, :-1]).double(), -1)  # [n, s, V]
    return torch.tensor([sum(float(logp[i, t, tokens[i, t + 1]]) for t in range(tokens.shape[1] - 1)
                             if mask[i, t + 1]) for i in range(len(tokens))], dtype=torch.float64)


def _hand_values(model, tokens, mask):
    """A reward model's value of each sequence [n]: its value at the input position whose next token is the last
    response token (the closing eod), from a plain forward (the value head's output [s, n, 1])."""
    with torch.no_grad():
        values = model(tokens[:, :-1])[..., 0].double()  # [s, n]
    last = [max(t for t in range(tokens.shape[1]) if mask[i, t]) for i in range(len(tokens))]
    return torch.tensor([float(values[j - 1, i]) for i, j in enumerate(last)], dtype=torch.float64)


def _recipe_models(task):
    """The policy (seed 2) and, for dpo and kto, a frozen reference of another seed (1), so pi − ref != 0 (and,
    on make_task_batch's seed 11, KTO's z0 ≈ 0.096 > 0, not clamped)."""
    policy = gpt.Model(gpt.Config(**RECIPE_CFG, seed=2))
    if task == "rm":
        recipes.add_value_head(policy)
    ref = gpt.Model(gpt.Config(**RECIPE_CFG, seed=1)).requires_grad_(False) if task in ("dpo", "kto") else None
    return policy, ref


@pytest.mark.parametrize("task", ["dpo", "kto", "rm"])
def test_recipe_losses_are_the_formulas_of_their_flags(task):
    """Each task's recipe (Task.prepare + policy_step, what train.py runs) gives, sample by sample, the loss written
    out here from the flags and the model's own log-probs / values (plain forwards, no Task machinery):
      dpo: −(1 − eps)·logsigmoid(h) − eps·logsigmoid(−h), h = beta·((pi_c − ref_c) − (pi_r − ref_r));
      kto: desirable w_d·(1 − sigmoid(beta·(r − z0))), undesirable w_u·(1 − sigmoid(beta·(z0 − r))), r = pi − ref,
           z0 = max(0, mean over the batch of the KL rows' pi − ref);
      rm:  −logsigmoid(v_chosen − v_rejected), each value at its sequence's last response token.
    The layout tests compare two runs of the same recipe, so a recipe that passes the wrong flags or swaps its
    arguments agrees with itself there; here it is caught: DPO without its label smoothing, KTO's desirable and
    undesirable weights swapped, the reward model's chosen and rejected values swapped (it would learn to prefer the
    rejected answer). float64, 1e-12 relative: the same operations, summation order only (measured <= 7e-16)."""
    batch = make_task_batch(task, 4, seed=11)
    if task == "kto":
        batch[:, -1, 0] = torch.tensor([1, 0, 1, 0])  # both labels, desirable first
    policy, ref = _recipe_models(task)
    got = recipe_unit_losses(task, policy, ref, batch)
    # (tokens, mask) rows [g, s+1]: dpo/rm's chosen and rejected sequences; kto's sample and its KL row
    first, second = (batch[:, 0], batch[:, 1]), (batch[:, 2], batch[:, 3])
    f = RECIPE_FLAGS
    if task == "dpo":
        pi_c, pi_r = _hand_logps(policy, *first), _hand_logps(policy, *second)
        ref_c, ref_r = _hand_logps(ref, *first), _hand_logps(ref, *second)
        eps, h = f["dpo_label_smoothing"], f["dpo_beta"] * ((pi_c - ref_c) - (pi_r - ref_r))
        assert (h.abs() > 1e-3).all(), h  # the smoothing term changes the loss only where h != 0
        want = [-(1 - eps) * math.log(_sig(x)) - eps * math.log(_sig(-x)) for x in h.tolist()]
    elif task == "kto":
        r = (_hand_logps(policy, *first) - _hand_logps(ref, *first)).tolist()
        kl = (_hand_logps(policy, *second) - _hand_logps(ref, *second)).tolist()
        z0, beta = max(0.0, sum(kl) / len(kl)), f["kto_beta"]
        assert z0 > 0, "z0 clamped at 0: the reference point would go untested"
        want = [f["kto_desirable_weight"] * (1 - _sig(beta * (x - z0))) if label else
                f["kto_undesirable_weight"] * (1 - _sig(beta * (z0 - x)))
                for x, label in zip(r, batch[:, -1, 0].tolist())]
    else:
        v_c, v_r = _hand_values(policy, *first), _hand_values(policy, *second)
        assert ((v_c - v_r).abs() > 1e-6).all(), (v_c, v_r)  # a swap changes the loss only where they differ
        want = [-math.log(_sig(x)) for x in (v_c - v_r).tolist()]
    want = torch.tensor(want, dtype=torch.float64)
    err = ((got - want).abs() / want.abs()).max()
    assert err <= 1e-12, f"--task {task}: the recipe's per-sample losses {got.tolist()} are not the formula's " \
                         f"{want.tolist()} (relative error {err:.1e})"


# --------------------------------------------------------------------------------------- 3. any layout == one process
def _adapt(model):
    """LoRA with B drawn like A (layout-free), so the adapted policy differs from its reference (adapters off)."""
    lora.apply_lora(model, lora.TARGETS, 4, 8.0)
    for m in model.modules():
        if isinstance(m, lora.LoRA):
            m.B.init = ("normal", 0.05)
    lora.init_adapters(model)
    return model


def _trainable_grads(chunks, ddp, grid):
    """Every trainable parameter's whole gradient (DDP's buffer, DP slices all-gathered for the distributed optimizer)."""
    at = {}
    if ddp is not None:
        buf = ddp.grad_buffer.clone()
        for bk in ddp.buckets if ddp.distopt and ddp.dp.size > 1 else []:
            P.all_gather_single(buf[bk.start:bk.end], ddp.grad_buffer[ddp.owned(bk)].clone(), group=ddp.dp.pg)
        for bk in ddp.buckets:
            off = bk.start
            for p in bk.params:
                at[id(p)], off = buf[off:off + p.numel()].view_as(p), off + p.numel()
    return {m.global_name(k): P.gather_full(at[id(p)] if ddp is not None else p.grad, p, grid).clone()
            for m in chunks for k, p in m.named_parameters() if p.requires_grad and (ddp is not None or p.grad is not None)}


MAMBA = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=V, max_position_embeddings=16,
             mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=4, params_dtype=torch.float64,
             hybrid_layer_pattern="M*M-")


def task_case(rank, n, task, packing, use_lora, tp, pp, vp, sp, opt, M, g=8, steps=2, control=None, model="gpt"):
    """`steps` steps of `task` on this rank's chunks, as train.py runs them (recipes.Task.prepare, then the schedule).
    opt: None = parallel.Optimizer, False = bucketed DDP, True = the distributed optimizer."""
    import mamba

    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp))
    module = mamba if model == "mamba" else gpt
    c = module.Config(**(MAMBA if model == "mamba" else CFG), sequence_parallel=sp)
    make = lambda pre, post, off, nl: module.Model(c, grid, pre, post, off, nl)
    chunks = P.build_chunks(make, c.num_layers, grid, vp)
    if use_lora:
        chunks = [_adapt(m) for m in chunks]
    if task == "rm":
        for m in chunks:
            if m.post_process:
                recipes.add_value_head(m)
    ref = None
    if task in ("dpo", "kto") and not use_lora:
        ref = [m.requires_grad_(False) for m in P.build_chunks(make, c.num_layers, grid, vp)]
    if control == "reference_is_policy":
        ref = chunks
    if opt is None:
        ddp, optimizer = None, P.Optimizer(chunks, grid, **OPT)
    else:
        ddp = P.DDP(chunks, grid, bucket_size=3000, overlap=True, distributed_optimizer=opt)
        optimizer = P.DistributedOptimizer(ddp, **OPT)
    mbs = g // (grid.dp_size * M)
    args = argparse.Namespace(task=task, packing=packing, micro_batch_size=mbs, global_batch_size=g,
                              lora_rank=4 if use_lora else None, **HYPER)
    t = recipes.Task(args, chunks, grid, (S // tp if sp else S, mbs, c.hidden_size), c.params_dtype, EOD, ref_chunks=ref)
    if control == "z0_of_one_dp_rank":  # the DP all-reduce forgotten: the mean over this rank's samples only
        t.reference_point = lambda diff, n_all: (P.all_reduce(diff.sum().reshape(1), grid.pp)
                                                 / (n_all // grid.dp_size)).clamp_min(0)[0]
    batch = make_task_batch(task, g, packing=packing, seed=3)
    losses, grads = [], None
    for step in range(steps):
        optimizer.zero_grad(M)
        micro, recipe, count, shape = t.prepare(batch)
        if control == "per_micro_batch_count":
            count = mbs
        loss = P.forward_backward(chunks, micro, recipe, count, grid, shape, c.params_dtype)
        optimizer.finish_grad_sync()
        if step == 0:
            grads = _trainable_grads(chunks, ddp, grid)
        optimizer.step()
        losses.append(P.all_reduce(torch.as_tensor(loss, dtype=torch.float64).reshape(1), grid.dp)
                      if grid.pp.rank == pp - 1 else torch.zeros(1, dtype=torch.float64))
    return dict(losses=P.all_reduce(torch.cat(losses), grid.pp), grads=grads, metrics=t.metrics(),
                params={m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks
                        for k, p in m.named_parameters() if p.requires_grad})


def _merged(results):
    out = dict(grads={}, params={}, losses=results[0]["losses"], metrics=results[0]["metrics"])
    for r in results:
        out["grads"].update(r["grads"])
        out["params"].update(r["params"])
    return out


def run_task(pool, task, packing, use_lora, layout, control=None, model="gpt"):
    n, tp, pp, vp, sp, opt = layout
    got = _merged(pool.run(task_case, n, task=task, packing=packing, use_lora=use_lora, tp=tp, pp=pp, vp=vp, sp=sp,
                           opt=opt, M=2, control=control, model=model))
    ref = task_case(0, 1, task, packing, use_lora, 1, 1, 1, False, None, M=1, model=model)  # one process, one micro-batch
    return got, ref


LAYOUTS = {  # (world, tp, pp, vp, sp, optimizer: None plain / False DDP / True distributed)
    "tp2": (2, 2, 1, 1, False, None), "tp2-sp": (2, 2, 1, 1, True, None), "pp2-1f1b": (2, 1, 2, 1, False, None),
    "dp2": (2, 1, 1, 1, False, None), "pp2-vp2-dp2-ddp": (4, 1, 2, 2, False, False),
    "tp2-sp-dp2-distopt": (4, 2, 1, 1, True, True), "tp2-sp-pp2-distopt": (4, 2, 2, 1, True, True),
}
TASKS = [("sft", False), ("sft", True), ("dpo", False), ("kto", False), ("rm", False)]


@given(task=st.sampled_from(TASKS), use_lora=st.booleans(), layout=st.sampled_from(sorted(LAYOUTS)))
def test_task_in_any_layout_equals_single_process(pool, task, use_lora, layout):
    (name, packing) = task
    got, ref = run_task(pool, name, packing, use_lora, LAYOUTS[layout])
    assert_same(got, ref, rtol=1e-10, what=f"{name}{' packed' if packing else ''} lora={use_lora} {layout}")
    for k, v in ref["metrics"].items():
        assert abs(got["metrics"][k] - v) <= 1e-9 * max(1.0, abs(v)), (k, got["metrics"][k], v)


@pytest.mark.parametrize("task,use_lora,layout", [("dpo", False, "pp2-vp2-dp2-ddp"), ("kto", True, "tp2-sp-dp2-distopt"),
                                                  ("rm", False, "tp2-sp-pp2-distopt")])
def test_each_task_with_its_reference_in_a_wide_layout(pool, task, use_lora, layout):
    """Always run (the property test above draws its few CI examples at random): the reference passes under the
    interleaved schedule and DP, KTO's z0 over DP with SP, the value head over SP and PP."""
    got, ref = run_task(pool, task, False, use_lora, LAYOUTS[layout])
    assert_same(got, ref, rtol=1e-10, what=f"{task} lora={use_lora} {layout}")
    if task == "kto":
        assert ref["metrics"]["kl"] > 0, "z0 clamped at 0: the comparison would not see it"


@pytest.mark.parametrize("task,use_lora", [("dpo", False), ("rm", True)])
def test_mamba_tasks_equal_single_process(pool, task, use_lora):
    """--model mamba: DPO with its reference copy, a LoRA reward model (the value head on the hybrid stack), TP 2 + SP."""
    got, ref = run_task(pool, task, False, use_lora, LAYOUTS["tp2-sp"], model="mamba")
    assert_same(got, ref, rtol=1e-10, what=f"mamba {task} lora={use_lora} tp2-sp")


@pytest.mark.parametrize("task,control,layout", [
    ("dpo", "per_micro_batch_count", "dp2"),  # divided by the micro-batch's pairs, not the global batch's
    ("dpo", "reference_is_policy", "tp2"),  # the reference moves with the policy (its second step differs)
    ("kto", "z0_of_one_dp_rank", "dp2"),  # z0 over one DP rank's samples, not the global batch
])
def test_negative_controls_fail(pool, task, control, layout):
    got, ref = run_task(pool, task, False, task == "kto", LAYOUTS[layout], control=control)
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_same(got, ref, rtol=1e-10, what=control)


# --------------------------------------------------------------------------------------- 4. through train.py
def tiny(save, *extra):
    return ["--vocab-size", "384", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--save", str(save), *extra]


def _fails(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("extra,expect", [
    (["--task", "dpo", "--model", "t5"], "--model t5 with --task dpo: the post-training tasks score the next-token"),
    (["--packing"], "--packing packs SFT samples: it needs --task sft (it is pretrain)"),
    (["--task", "sft", "--packing", "--model", "mamba"], "--model mamba with --packing: the scan's state would cross"),
    (["--task", "kto", "--context-parallel-size", "2", "--world"], "--task kto with --context-parallel-size=2"),
    (["--task", "rm", "--mtp-num-layers", "1"], "--task rm with --mtp-num-layers=1"),
    (["--task", "sft", "--reset-attention-mask"], "--reset-attention-mask is pretraining's document packing"),
    (["--task", "dpo", "--dpo-label-smoothing", "0.7"], "--dpo-label-smoothing=0.7 must be in [0, 0.5]"),
    (["--task", "kto", "--kto-beta", "0"], "--kto-beta=0.0 must be > 0"),
])
def test_bad_task_flags_give_one_line(tmp_path, capsys, monkeypatch, extra, expect):
    if "--world" in extra:  # a CP layout needs a world of 2 (checked before any process group)
        extra = [x for x in extra if x != "--world"]
        monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train.data, "build_data", lambda *a, **k: pytest.fail("the data was built before the check"))
    assert expect in _fails(tiny(tmp_path / "run", *extra), capsys)


def test_resuming_with_another_task_is_refused(tmp_path, capsys):
    from harness import SNIPPET

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text(SNIPPET.format(i=i))
    run = tmp_path / "run"
    flags = ["--data-path", str(corpus), "--data-cache-dir", str(tmp_path / "cache"), "--seq-length", "32"]
    train.main(tiny(run, *flags, "--train-iters", "1"))
    capsys.readouterr()
    line = _fails(tiny(run, *flags, "--load", str(run), "--task", "sft"), capsys)
    assert f"--load {run} is a --task pretrain run: resuming it with --task sft is refused" in line


def test_lora_disabled_gives_the_base_model():
    model = gpt.Model(gpt.Config(**CFG))
    ids = make_task_batch("sft", 2)[:, 0, :-1]
    with torch.no_grad():
        base = model(ids)
        _adapt(model)
        adapted = model(ids)
        with lora.disabled(model):
            off = model(ids)
        assert torch.equal(off, base) and not torch.equal(adapted, base) and torch.equal(model(ids), adapted)


class HandBuilt:
    """A stand-in for section 1's TaskDataset: hand-built samples of `task`, numpy [R, s+1] (with an epoch wrap)."""

    def __init__(self, task, n, s, seed):
        self.samples = make_task_batch(task, n, s=s, seed=seed, packing=task == "sft").numpy()
        self.num_rows = self.samples.shape[1]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i % len(self)]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    from harness import SNIPPET

    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        (corpus / f"m{i}.py").write_text(SNIPPET.format(i=i))
    base = tmp_path_factory.mktemp("base")
    train.main(tiny(base, "--data-path", str(corpus), "--data-cache-dir", str(base / "cache"), "--seq-length", "32",
                    "--train-iters", "1"))
    return base


@pytest.mark.parametrize("task", ["sft", "dpo", "kto", "rm", "rm-lora"])
def test_train_py_runs_each_task(base_run, tmp_path, monkeypatch, task):
    """train.py's task path on hand-built samples (section 1's datasets stood in for): 2 iterations with evaluation
    and the task's metrics; the checkpoint records the task. DPO also stops and resumes: the same losses as the
    uninterrupted run (its reference model rebuilt from the recorded base). A LoRA reward model saves its value head
    with its adapters, and checkpoint.load_model (tools.py score) loads it."""
    import json

    task, use_lora = task.split("-")[0], task.endswith("-lora")

    monkeypatch.setattr(recipes, "build_task_datasets", raising=False,
                        value=lambda args, tok: (HandBuilt(args.task, 12, args.seq_length, 0),
                                                 HandBuilt(args.task, 4, args.seq_length, 1)))
    flags = ["--task", task, "--pretrained-checkpoint", str(base_run), "--seq-length", "32", "--eval-iters", "1",
             "--data-cache-dir", str(tmp_path / "cache"), "--lr", "1e-3"] + (["--lora-rank", "2"] if use_lora else [])
    whole, run = tmp_path / "whole", tmp_path / "run"
    train.main(tiny(whole, *flags, "--load", str(whole)))
    recs = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    want = {"dpo": "val_preference_accuracy", "kto": "val_kl", "rm": "val_accuracy", "sft": "val_loss"}[task]
    assert any(want in r for r in recs) and any(want[4:] in r for r in recs), recs
    meta = json.loads((whole / "iter_0000002" / "meta.json").read_text())
    assert meta["args"]["task"] == task
    if task == "dpo":
        assert meta["args"]["reference_base"]["path"] == str((base_run / "iter_0000001").resolve())
        train.main(tiny(run, *flags, "--load", str(run), "--train-iters", "1"))
        train.main(tiny(run, *flags, "--load", str(run)))
        again = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in recs if "loss" in r] == [r["loss"] for r in again if "loss" in r]
    if task == "rm":
        model, args, _, _, _ = checkpoint.load_model(whole, extend=recipes.add_value_head)
        fresh = recipes.add_value_head(gpt.Model(model.config))
        assert not torch.equal(model.value_head.weight, fresh.value_head.weight)  # the trained head, loaded
        assert (args.lora_rank is None) and not any(".lora." in k for k, _ in model.named_parameters())  # merged
        with pytest.raises(SystemExit):
            tools.main(["sample", "--load", str(whole)])


def test_torchrun_tp2_dpo_matches_one_process(tmp_path):
    """`make train NPROC=2 TP=2 ARGS="--task dpo"` in small, on generated example data: float32, 1e-5 relative
    (reduction order only). The example records (recipes.example_records) are those of test_posttrain_data's few
    stdlib modules, with a tokenizer trained on them, given as --data-path and --tokenizer-file: the whole stdlib's
    would add ~25 s (parsing it, and training the default 8192-token BPE on it) and prove nothing more here."""
    import json

    from test_posttrain_data import FILES

    from harness import torchrun
    from interop import tokenizer_files

    def losses(run):
        return {r["iteration"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "loss" in r}
    tok = tokenizer_files.get_tokenizer([open(f, encoding="utf-8").read() for f in FILES], None, vocab_size=1024)
    tok.save(str(tmp_path / "tokenizer.json"))
    records = recipes.example_records("dpo", tok, 128, seed=1234, files=FILES)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n"
                                                  for r in records))
    flags = ["--task", "dpo", "--data-path", str(tmp_path / "pairs.jsonl"), "--tokenizer-file",
             str(tmp_path / "tokenizer.json"), "--data-cache-dir", str(tmp_path / "cache"), "--seq-length", "128",
             "--vocab-size", "8192"]
    train.main(tiny(tmp_path / "one", *flags))
    torchrun(2, tiny(tmp_path / "tp2", *flags, "--tensor-model-parallel-size", "2"))
    one, two = losses(tmp_path / "one"), losses(tmp_path / "tp2")
    assert one.keys() == two.keys() == {1, 2}
    assert all(abs(one[k] - two[k]) <= 1e-5 * abs(one[k]) for k in one), (one, two)


def test_a_task_has_its_own_defaults_below_the_command_and_above_the_model_file():
    """--task grpo takes arguments.ONLINE_RL where pretraining's defaults would not suit (lr 9e-3 for gpt's Muon, 3e-3
    for AdamW, 650 iterations, rows of 128); a flag the command gives wins, with Megatron's rules beside a command's
    own --lr (min-lr 0, no warmup); another task keeps pretraining's defaults for its optimizer (AdamW: train.py's lr).
    Negative control: without the table the pretraining defaults come."""
    pre = arguments.parse_args([])
    grpo = arguments.parse_args(["--task", "grpo"])
    for k, v in arguments.ONLINE_RL.items():
        assert getattr(grpo, k) == v, (k, getattr(grpo, k), v)
    assert (pre.lr, pre.train_iters, pre.seq_length) == (9e-3, 650, 128)  # the model file's and the parser's own
    assert arguments.parse_args(["--task", "sft"]).lr == 3e-3  # a post-training task steps with AdamW: its lr
    own = arguments.parse_args(["--task", "grpo", "--lr", "3e-4", "--seq-length", "64"])
    assert (own.lr, own.min_lr, own.lr_warmup_iters, own.seq_length, own.train_iters) == (3e-4, 0.0, 0, 64, 60)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(arguments, "TASK_DEFAULTS", {})
        assert arguments.parse_args(["--task", "grpo"]).lr == 3e-3
