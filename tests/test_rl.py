"""GRPO and PPO (posttraining/rl.py): the losses against written-out formulas, the recipe against plain forwards, every layout
against the single process, and the shipped task through train.py.

  - grpo_token_losses + average (token and sequence averaging) equal a per-element float64 formula written with
    `math` here, and their gradient with respect to the log-probs equals the formula's derivative (1e-12 relative:
    the same operations in another order);
  - group_advantages is each reward against its own group's mean over the group's std (Bessel), by hand;
  - the recipe (Task.prepare's rollouts, rewards, advantages, reference and old log-probs, then policy_step, what
    train.py runs) equals the formula applied to plain forwards of the policy and of the reference model on the
    rolled-out tokens and to rewards recomputed from their decoded text, at both steps of --grpo-iterations 2 (the
    second step's ratio is not 1: the old log-probs are those at rollout time);
  - negative controls: advantages normalised over the whole batch instead of each group, the KL term dropped, and the
    old log-probs recomputed after the first update each fail that comparison (they name the mismatch);
  - TP 2 + SP, PP 2, DP 2 with the distributed optimizer, and LoRA at TP 2 + SP equal the single process: the
    rollouts (the replica of gathered weights draws the same tokens), the losses of 2 steps, every gradient after the
    first backward and every parameter after 2 AdamW steps, float64, 1e-10 relative (reduction order; measured ~1e-15);
  - `train.py --task grpo` runs on the shipped bracket prompts, logs reward, KL and clip fraction, and `tools.py rl --eval`
    scores it; elsewhere the prompts are short "a + b" ones (prompts.jsonl), so the rows stay short;
  - a reward model of the policy's architecture is sharded like it: at TP 2 + SP and PP 2 its rewards are the one
    process's and the whole model's;
PPO, the same way:
  - ppo_advantages (InstructGPT's per-token KL rewards plus the score at the last token, GAE, whitening) then
    grpo_token_losses at beta 0 + value_losses equal a token-by-token float64 formula (ppo_formula), loss and its
    gradients with respect to the log-probs and the values (1e-12 relative); negative controls fail it: GAE's gamma
    and lambda swapped, values not bootstrapped (delta_t = r_t - V_t), value clipping dropped; gae by hand on a
    3-token completion;
  - the recipe (rollouts, rewards, the rollout policy's log-probs and values, the reference, GAE, whitening, then
    policy_step with the value head beside the output) equals ppo_formula on plain forwards of the policy with its
    value head and of the reference, at both steps of --grpo-iterations 2 (the second step's ratio is not 1 and its
    value clipping is taken);
  - negative controls: old log-probs recomputed after the update fail that comparison; at DP 2, advantages whitened
    over each rank's tokens instead of the global batch's fail the comparison with the single process;
  - TP 2 + SP, PP 2 (the value head on the last stage only), DP 2 with the distributed optimizer, LoRA at TP 2 + SP
    (the value head trains beside the adapters) and MoE at EP 2 equal the single process, as GRPO's
    (value_head.weight included);
  - `train.py --task ppo` runs, logs its metrics (and evaluates), and a resumed PPO run
    repeats the uninterrupted one (the value head saved and loaded).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from einops import rearrange
from test_posttrain import OPT, _adapt, _merged, _trainable_grads

import arguments
import checkpoint
import data
import gpt
import harness
import parallel as P
import train
from equivalence import assert_same
from harness import SNIPPET
from interop import tokenizer_files
from posttraining import lora, recipes, rl

S, NEW, G = 40, 6, 2  # --seq-length (the "a + b" prompts are 30 tokens in this BPE), new tokens, group size
SHIPPED_S = 72  # (the shipped bracket prompts are up to 63 tokens in this BPE)
HYPER = dict(grpo_group_size=G, grpo_iterations=2, grpo_clip_eps=0.2, grpo_kl_beta=0.3, grpo_loss_average="token",
             ppo_kl_coef=0.3, ppo_gamma=0.9, ppo_lambda=0.8, ppo_vf_coef=0.5, ppo_cliprange_value=0.05,
             rollout_max_new_tokens=NEW, rollout_temperature=1.0, rollout_top_p=0.95,
             reward_function="examples/rewards.py:brevity",
             reward_model=None, seed=5, seq_length=S, data_path=None, valid_fraction=0.0)


# --------------------------------------------------------------------------------------- 1. the loss vs the formula
def formula(logp, old, ref, adv, mask, eps, beta, mode):
    """(loss, d loss / d logp) element by element, with math."""
    b, s = len(logp), len(logp[0])
    loss, grad = 0.0, [[0.0] * s for _ in range(b)]
    for i in range(b):
        n = sum(mask[i])
        for t in range(s):
            if not mask[i][t]:
                continue
            r, a = math.exp(logp[i][t] - old[i][t]), adv[i]
            clipped = min(max(r, 1 - eps), 1 + eps)
            surr, d_surr = (r * a, r * a) if r * a <= clipped * a else (clipped * a, 0.0)
            kl = math.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1
            d_kl = 1 - math.exp(ref[i][t] - logp[i][t])
            w = 1.0 if mode == "token" else 1.0 / n
            loss += w * -(surr - beta * kl)
            grad[i][t] = w * -(d_surr - beta * d_kl)
    return loss, grad


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_grpo_loss_is_the_formula(mode):
    g = torch.Generator().manual_seed(0)
    b, s = 4, 7
    logp = (-torch.rand(b, s, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(b, s, generator=g, dtype=torch.float64)  # ratios inside and outside
    ref = logp.detach() + 0.5 * torch.randn(b, s, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)
    mask = (torch.rand(b, s, generator=g) < 0.7).double()
    mask[:, 0] = 1
    losses, kl, clipped = rl.grpo_token_losses(logp, old, ref, adv, 0.2, 0.3)
    got = rl.average(losses, mask, mode)
    got.backward()
    want, dwant = formula(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.3, mode)
    assert 0 < clipped[mask.bool()].mean() < 1, "the clipped branch and the plain one must both be taken"
    assert abs(got.item() - want) <= 1e-12 * abs(want), (got.item(), want)
    assert torch.allclose(logp.grad, torch.tensor(dwant, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert (kl[mask.bool()] >= 0).all()


def test_advantages_are_normalised_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    want = []
    for row in r.tolist():
        m = sum(row) / len(row)
        sd = math.sqrt(sum((x - m) ** 2 for x in row) / (len(row) - 1))
        want.append([(x - m) / (sd + 1e-4) for x in row])
    assert torch.allclose(rl.group_advantages(r), torch.tensor(want, dtype=torch.float64), rtol=1e-12)
    assert (rl.group_advantages(torch.ones(1, 4, dtype=torch.float64)) == 0).all()  # a tied group teaches nothing


def ppo_formula(logp, values, old, old_values, ref, scores, mask, h):
    """PPO token by token with math: (the loss summed over completion tokens, d loss / d logp, d loss / d values, the
    sum of its terms' sizes). InstructGPT's rewards (-kl_coef (old - ref) per token, the score at the last), GAE over
    each completion's tokens, the advantages whitened over every completion token (Bessel, + 1e-8), then per token
    -min(r A, clip(r) A) + vf_coef 1/2 max((V - R)^2, (clip(V, V_old +- c) - R)^2)."""
    b, s = len(logp), len(logp[0])
    eps, c, kl = h["grpo_clip_eps"], h["ppo_cliprange_value"], h["ppo_kl_coef"]
    gamma, lam = h["ppo_gamma"], h["ppo_lambda"]
    adv, ret = [[0.0] * s for _ in range(b)], [[0.0] * s for _ in range(b)]
    for i in range(b):
        tokens = [t for t in range(s) if mask[i][t]]
        a_next = v_next = 0.0  # after the last token: no value, no advantage
        for t in reversed(tokens):
            r = -kl * (old[i][t] - ref[i][t]) if ref is not None else 0.0
            r += scores[i] if t == tokens[-1] else 0.0
            a_next = r + gamma * v_next - old_values[i][t] + gamma * lam * a_next
            adv[i][t], ret[i][t], v_next = a_next, a_next + old_values[i][t], old_values[i][t]
    on = [(i, t) for i in range(b) for t in range(s) if mask[i][t]]
    mean = sum(adv[i][t] for i, t in on) / len(on)
    sd = math.sqrt(sum((adv[i][t] - mean) ** 2 for i, t in on) / (len(on) - 1) + 1e-8)
    loss, size, d_logp, d_v = 0.0, 0.0, [[0.0] * s for _ in range(b)], [[0.0] * s for _ in range(b)]
    for i, t in on:
        a, ratio = (adv[i][t] - mean) / sd, math.exp(logp[i][t] - old[i][t])
        v, vo, R = values[i][t], old_values[i][t], ret[i][t]
        clipped = min(max(ratio, 1 - eps), 1 + eps)
        pg, d_pg = (-ratio * a, -ratio * a) if ratio * a <= clipped * a else (-clipped * a, 0.0)
        v_clipped = min(max(v, vo - c), vo + c)
        plain, far = (v - R) ** 2, (v_clipped - R) ** 2
        vf, d_vf = (0.5 * plain, v - R) if plain >= far else (0.5 * far, 0.0)
        loss += pg + h["ppo_vf_coef"] * vf
        size += abs(pg) + h["ppo_vf_coef"] * vf
        d_logp[i][t], d_v[i][t] = d_pg, h["ppo_vf_coef"] * d_vf
    return loss, d_logp, d_v, size


def no_bootstrap(rewards, values, mask, gamma, lam):
    """A control's GAE: the gamma V_{t+1} term forgotten (delta_t = r_t - V_t)."""
    adv, next_a = torch.zeros_like(values), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        adv[:, t] = (rewards[:, t] - values[:, t] + gamma * lam * next_a) * mask[:, t]
        next_a = adv[:, t]
    return adv, (adv + values) * mask


@pytest.mark.parametrize("control", [None, "no_reference", "gamma_lambda_swapped", "not_bootstrapped", "no_value_clip"])
def test_ppo_loss_and_gae_are_the_formula(control, monkeypatch):
    """The formula on hand-built rollouts, also without a reference (--ppo-kl-coef 0: the score is the only reward);
    each control (GAE's gamma and lambda swapped, values not bootstrapped, the value loss unclipped) fails it, naming
    the mismatch."""
    g = torch.Generator().manual_seed(0)
    b, s = 4, 8
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = torch.zeros(b, s, dtype=torch.float64)
    for i, (first, n) in enumerate([(2, 5), (3, 2), (1, 7), (4, 1)]):  # each completion's tokens, after its prompt
        mask[i, first:first + n] = 1
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.4 * rand(b, s)).requires_grad_()  # ratios inside and outside the clip range
    ref, old_values, scores = old + 0.5 * rand(b, s), rand(b, s), rand(b)
    ref = None if control == "no_reference" else ref
    values = (old_values + 0.1 * rand(b, s)).requires_grad_()  # values inside and outside V_old +- c
    h = dict(HYPER)
    gamma, lam = (h["ppo_lambda"], h["ppo_gamma"]) if control == "gamma_lambda_swapped" else (h["ppo_gamma"],
                                                                                             h["ppo_lambda"])
    if control == "not_bootstrapped":
        monkeypatch.setattr(rl, "gae", no_bootstrap)
    adv, returns = rl.ppo_advantages(scores, old, ref, old_values, mask, h["ppo_kl_coef"], gamma, lam)
    pg, _, clipped = rl.grpo_token_losses(logp, old, None, adv, h["grpo_clip_eps"], 0.0)
    vf, vf_clipped = rl.value_losses(values, old_values, returns, 1e9 if control == "no_value_clip" else
                                     h["ppo_cliprange_value"])
    got = ((pg + h["ppo_vf_coef"] * vf) * mask).sum()
    got.backward()
    want, d_logp, d_v, _ = ppo_formula(logp.tolist(), values.tolist(), old.tolist(), old_values.tolist(),
                                       ref.tolist() if ref is not None else None, scores.tolist(), mask.tolist(), h)
    if control not in (None, "no_reference"):
        err = abs(got.item() - want) / abs(want)
        assert err > 1e-6, f"{control}: the loss still matches the formula (relative error {err:.1e})"
        return
    on = mask.bool()
    assert 0 < clipped[on].mean() < 1 and 0 < vf_clipped[on].mean() < 1, "both branches of both clips must be taken"
    assert abs(got.item() - want) <= 1e-12 * abs(want), (got.item(), want)
    assert torch.allclose(logp.grad, torch.tensor(d_logp, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert torch.allclose(values.grad, torch.tensor(d_v, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert abs(float(adv[on].mean())) < 1e-12 and abs(float(adv[on].std()) - 1) < 1e-6  # whitened (std: the 1e-8)
    assert (adv[~on] == 0).all() and (returns[~on] == 0).all()


def test_gae_by_hand():
    """A completion of 3 tokens after a prompt token, then padding (whose rewards and values must not leak in):
    gamma 0.9, lambda 0.5, rewards (0, 0, 1), values (0.5, 0.2, 0.4):
      A_2 = 1 - 0.4 = 0.6;  A_1 = 0.9·0.4 - 0.2 + 0.45·0.6 = 0.43;  A_0 = 0.9·0.2 - 0.5 + 0.45·0.43 = -0.1265;
      R = A + V = (0.3735, 0.63, 1.0)."""
    mask = torch.tensor([[0, 1, 1, 1, 0]], dtype=torch.float64)
    rewards = torch.tensor([[7.0, 0.0, 0.0, 1.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[9.0, 0.5, 0.2, 0.4, 3.0]], dtype=torch.float64)
    adv, ret = rl.gae(rewards, values, mask, 0.9, 0.5)
    assert torch.allclose(adv, torch.tensor([[0, -0.1265, 0.43, 0.6, 0]], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(ret, torch.tensor([[0, 0.3735, 0.63, 1.0, 0]], dtype=torch.float64), rtol=0, atol=1e-15)
    swapped, _ = rl.gae(rewards, values, mask, 0.5, 0.9)  # (the control: gamma and lambda swapped differ)
    assert not torch.allclose(swapped, adv)


# --------------------------------------------------------------------------------------- 2. the recipe vs forwards
@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "tokenizer.json"
    tokenizer_files.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], str(path), 384)
    pairs = [(a, b) for a in range(20) for b in range(20)]
    random.Random(0).shuffle(pairs)  # short prompts (prompts.jsonl beside it), "a + b", so rows stay short
    (path.parent / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a} + {b}", "answer": str(a + b)}) + "\n"
                                                       for a, b in pairs))
    return path


def prompts(tok_file) -> str:
    return str(Path(tok_file).parent / "prompts.jsonl")


def config(tok, sp=False, moe=False):
    moe = dict(num_experts=4, moe_router_topk=2) if moe else {}  # (no aux loss: it is per micro-batch, as Megatron's)
    return gpt.Config(**moe, num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      vocab_size=tok.get_vocab_size(), max_position_embeddings=S, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.float64, position_embedding_type="rope",
                      normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
                      init_method_std=0.2, sequence_parallel=sp)


def rl_case(rank, n, tok_file, tp, pp, sp, opt, M, task="grpo", g=4, steps=2, control=None, use_lora=False, ep=1,
            moe=False):
    """`steps` GRPO or PPO steps (g prompts, G completions each) on this rank's chunks, as train.py runs them
    (rl.Task.prepare, then the schedule). opt: None = parallel.Optimizer, True = the distributed optimizer. Also
    returns each step's rollouts and global count, and in one process the weights each step's loss was computed with
    (for the formula)."""
    with pytest.MonkeyPatch.context() as mp:  # (a pool's worker process outlives the case: undone when it ends)
        if control == "local_whitening":  # each DP rank's tokens alone, not the global batch's
            whiten = rl.whiten
            mp.setattr(rl, "whiten", lambda x, mask, group: whiten(x, mask, None))
        return _rl_case(rank, n, tok_file, tp, pp, sp, opt, M, task, g, steps, control, use_lora, ep, moe)


def _rl_case(rank, n, tok_file, tp, pp, sp, opt, M, task, g, steps, control, use_lora, ep, moe):
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tok_file))
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp), ep=ep)
    c = config(tok, sp, moe=moe)
    make = lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl)
    chunks = P.build_chunks(make, c.num_layers, grid, 1)
    chunks = [_adapt(m) for m in chunks] if use_lora else chunks  # the reference: the policy, adapters off
    for m in chunks if task == "ppo" else []:  # the value head, on the last stage only (rl.setup_task)
        if m.post_process:
            rl.add_critic(m)
    c_ref = dataclasses.replace(c, seed=c.seed + 1)  # another model: the KL term counts from the first step
    ref = [m.requires_grad_(False) for m in P.build_chunks(
        lambda pre, post, off, nl: gpt.Model(c_ref, grid, pre, post, off, nl), c.num_layers, grid, 1)]
    if opt is None:
        ddp, optimizer = None, P.Optimizer(chunks, grid, **OPT)
    else:
        ddp = P.DDP(chunks, grid, bucket_size=3000, overlap=True, distributed_optimizer=opt)
        optimizer = P.DistributedOptimizer(ddp, **OPT)
    mbs = g * G // (grid.dp_size * M)
    args = argparse.Namespace(task=task, micro_batch_size=mbs, global_batch_size=g, **{**HYPER, "data_path": prompts(
        tok_file)}, **(dict(
        lora_rank=4, lora_alpha=8.0, lora_target_modules=lora.TARGETS) if use_lora else dict(lora_rank=None)))
    train_ds, _ = rl.build_task_datasets(args, tok)
    corpus = types.SimpleNamespace(tokenizer=tok, train=train_ds, valid=None)
    t = rl.Task(args, chunks, grid, (S // tp if sp else S, mbs, c.hidden_size), c.params_dtype,
                tokenizer_files.special_ids(tok)["eod"], ref_chunks=ref, corpus=corpus)
    batch, losses, grads, seen = data.global_batch(train_ds, start=0, size=g), [], None, []
    for step in range(steps):
        optimizer.zero_grad(M)
        micro, recipe, count, shape = t.prepare(batch)
        ro = t.rollouts["train"]
        if control == "no_kl":  # the KL term dropped
            t.a = argparse.Namespace(**{**vars(t.a), "grpo_kl_beta": 0.0})
        if control == "global_advantages" and step == 0:  # normalised over the whole batch, not each group
            reward = rl.load_reward_function(HYPER["reward_function"])
            rewards = torch.tensor([reward("", x, {}) for x in texts_of(torch.cat(ro.micro), tok)], dtype=torch.float64)
            ro.adv = rl.group_advantages(rewards.reshape(1, -1)).flatten()
        if control == "old_recomputed" and step == 1:  # the old log-probs of the policy after the first update
            ro.old = t.forward_only(chunks, ro.micro, (recipes.CHOSEN,), g * G, per_token=True)[:, 0]
        seen.append(dict(rows=torch.cat(ro.micro).clone(), count=count))
        loss = P.forward_backward(chunks, micro, recipe, count, grid, shape, c.params_dtype)
        optimizer.finish_grad_sync()
        if step == 0:
            grads = _trainable_grads(chunks, ddp, grid)
        if n == 1:  # the oracle recomputes each step's log-probs from these weights
            seen[-1]["state"] = {k: v.clone() for k, v in chunks[0].state_dict().items()}
        optimizer.step()
        losses.append(P.all_reduce(torch.as_tensor(loss, dtype=torch.float64).reshape(1), grid.dp)
                      if grid.pp.rank == pp - 1 else torch.zeros(1, dtype=torch.float64))
    if n == 1:
        seen[0]["ref_state"] = ref[0].state_dict()
    return dict(losses=P.all_reduce(torch.cat(losses), grid.pp), grads=grads, metrics=t.metrics(), seen=seen,
                params={m.global_name(k): P.gather_full(p.data, p, grid) for m in chunks
                        for k, p in m.named_parameters() if p.requires_grad})


def texts_of(rows, tok) -> list[str]:
    """Rollout rows [n, 3, s+1] -> each completion's text, its closing eod left out (what the reward function reads)."""
    eod, out = tokenizer_files.special_ids(tok)["eod"], []
    for row in rows:
        ids = row[rl.TOKENS][row[rl.MASK].bool()].tolist()
        out.append(tok.decode(ids[:-1] if ids[-1] == eod else ids))
    return out


def per_token_logps(model, rows):
    """log p of each next token [n, s] by one plain forward of rows [n, 3, s+1] (a model with a value head beside its
    output: and the values [n, s])."""
    with torch.no_grad():
        out = model(rows[:, rl.TOKENS, :-1], rows[:, rl.TOKENS, 1:])
    return (-out[0], rearrange(out[1], "s n 1 -> n s")) if isinstance(out, tuple) else -out


def expected_ppo_losses(tok_file, out):
    """ppo_formula's loss at each step: scores recomputed from the decoded completions, the policy's log-probs and
    values and the reference's log-probs by plain forwards of the weights of that step (old and V_old: step 0's)."""
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tok_file))
    model, ref_model = rl.add_critic(gpt.Model(config(tok))), gpt.Model(config(tok))
    ref_model.load_state_dict(out["seen"][0]["ref_state"])
    reward = rl.load_reward_function(HYPER["reward_function"])
    want, old, old_values = [], None, None
    for step in out["seen"]:
        rows = step["rows"]
        model.load_state_dict(step["state"])
        logp, values = per_token_logps(model, rows)
        old, old_values = (logp, values) if old is None else (old, old_values)  # the rollout policy's, kept
        ref = per_token_logps(ref_model, rows)
        scores = [reward("", x, {}) for x in texts_of(rows, tok)]
        loss, _, _, size = ppo_formula(logp.tolist(), values.tolist(), old.tolist(), old_values.tolist(), ref.tolist(),
                                       scores, rows[:, rl.MASK, 1:].tolist(), HYPER)
        want.append((loss / step["count"], size / step["count"]))
    return torch.tensor(want, dtype=torch.float64)


def expected_losses(tok_file, out):
    """The formula's loss at each step: rewards recomputed from the decoded completions, advantages by hand within each
    prompt's group, the policy's and the reference's log-probs by plain forwards of the weights of that step (the old
    log-probs: step 0's, at rollout time)."""
    tok = tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(tok_file))
    model, ref_model = gpt.Model(config(tok)), gpt.Model(config(tok))
    ref_model.load_state_dict(out["seen"][0]["ref_state"])
    reward = rl.load_reward_function(HYPER["reward_function"])
    want, old = [], None
    for step in out["seen"]:
        rows = step["rows"]
        model.load_state_dict(step["state"])
        logp = per_token_logps(model, rows)
        old = logp if old is None else old  # --grpo-iterations 2: both steps' ratio against the rollout policy
        ref = per_token_logps(ref_model, rows)
        mask = rows[:, rl.MASK, 1:].double()
        r = [reward("", x, {}) for x in texts_of(rows, tok)]
        adv = []
        for i in range(0, len(r), G):
            grp = r[i:i + G]
            m = sum(grp) / G
            sd = math.sqrt(sum((x - m) ** 2 for x in grp) / (G - 1))
            adv += [(x - m) / (sd + 1e-4) for x in grp]
        assert len(set(r)) > 1, "every completion got the same reward: the advantages would be zero"
        loss, _ = formula(logp.tolist(), old.tolist(), ref.tolist(), adv, mask.tolist(), HYPER["grpo_clip_eps"],
                          HYPER["grpo_kl_beta"], "token")
        # the size of the loss's terms (where the advantages' terms cancel, the loss alone would be too small a yardstick)
        scale = sum(abs(a) * n for a, n in zip(adv, mask.sum(-1).tolist())) / step["count"]
        want.append((loss / step["count"], max(abs(loss / step["count"]), scale)))
    return torch.tensor(want, dtype=torch.float64)


def worst_error(got, want) -> float:
    """The largest |got - formula| over each step's scale (its loss, or the size of its terms where they cancel)."""
    return float(((got - want[:, 0]).abs() / want[:, 1]).max())


EXPECTED = {"grpo": expected_losses, "ppo": expected_ppo_losses}


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_the_recipe_is_the_formula_on_its_rollouts(tok_file, task):
    out = rl_case(0, 1, tok_file, 1, 1, False, None, M=1, task=task)
    want = EXPECTED[task](tok_file, out)
    err = worst_error(out["losses"], want)
    assert err <= 1e-12, f"the recipe's losses {out['losses'].tolist()} are not the formula's {want[:, 0].tolist()}"
    assert out["metrics"]["kl"] > 0 and 0 < out["metrics"]["clip_fraction"] <= 1, out["metrics"]
    if task == "ppo":  # the second step's values moved past V_old +- c somewhere: the clipped value loss was taken
        assert 0 < out["metrics"]["vf_clip_fraction"] < 1 and out["metrics"]["value_loss"] > 0, out["metrics"]


@pytest.mark.parametrize("task, control", [("grpo", "global_advantages"), ("grpo", "no_kl"), ("grpo", "old_recomputed"),
                                           ("ppo", "old_recomputed")])
def test_negative_controls_fail_the_formula(tok_file, task, control):
    out = rl_case(0, 1, tok_file, 1, 1, False, None, M=1, task=task, control=control)
    err = worst_error(out["losses"], EXPECTED[task](tok_file, out))
    assert err > 1e-6, f"{control}: the loss still matches the formula (relative error {err:.1e})"


# --------------------------------------------------------------------------------------- 3. any layout == one process
LAYOUTS = {"tp2-sp": (2, 2, 1, True, None, False), "pp2": (2, 1, 2, False, None, False),
           "dp2-distopt": (2, 1, 1, False, True, False), "tp2-sp-lora": (2, 2, 1, True, None, True),
           "moe-ep2": (2, 1, 1, False, None, False)}


@pytest.mark.parametrize("task, layout", [("grpo", x) for x in LAYOUTS] +
                         [("ppo", x) for x in ("tp2-sp", "pp2", "dp2-distopt", "tp2-sp-lora", "moe-ep2")])
def test_rl_in_any_layout_equals_single_process(pool, tok_file, task, layout):
    """(With LoRA, the rollout replica carries the adapters and the reference is the policy with them off; PPO's value
    head trains beside them.)"""
    n, tp, pp, sp, opt, use_lora = LAYOUTS[layout]
    ep = 2 if layout == "moe-ep2" else 1  # (an MoE policy: the replica gathers each EP rank's experts)
    got = _merged(pool.run(rl_case, n, tok_file=tok_file, tp=tp, pp=pp, sp=sp, opt=opt, M=2, task=task,
                           use_lora=use_lora, ep=ep, moe=ep > 1))
    ref = rl_case(0, 1, tok_file, 1, 1, False, None, M=1, task=task, use_lora=use_lora, moe=ep > 1)
    assert_same(got, ref, rtol=1e-10, what=f"{task} {layout}")
    if task == "ppo":
        assert "value_head.weight" in got["grads"] and "value_head.weight" in got["params"], sorted(got["params"])


def test_ppo_advantages_whitened_per_rank_differ_from_the_global_batch(pool, tok_file):
    """The negative control of the layouts' comparison: at DP 2, each rank whitening its own tokens' advantages
    (whiten with no group) no longer equals the single process."""
    got = _merged(pool.run(rl_case, 2, tok_file=tok_file, tp=1, pp=1, sp=False, opt=True, M=2, task="ppo", steps=1,
                           control="local_whitening"))
    ref = rl_case(0, 1, tok_file, 1, 1, False, None, M=1, task="ppo", steps=1)
    with pytest.raises(AssertionError, match="ppo local whitening"):
        assert_same(got, ref, rtol=1e-10, what="ppo local whitening")


# --------------------------------------------------------------------------------------- 4. through train.py
LOGGED = {"grpo": {"reward", "reward_std", "kl", "clip_fraction", "completion_length", "val_reward"},
          "ppo": {"reward", "reward_std", "kl", "clip_fraction", "completion_length", "value_loss", "vf_clip_fraction",
                  "returns", "values", "rollout_seconds"}}


def test_train_py_runs_grpo_on_the_shipped_task(tok_file, tmp_path):
    task = "grpo"
    save = tmp_path / task
    train.main(["--task", task, "--tokenizer-file", str(tok_file), "--vocab-size", "384", "--num-layers", "2",
                "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SHIPPED_S),
                "--rollout-max-new-tokens", str(NEW), "--micro-batch-size", "4", "--global-batch-size", "4",
                "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
                "--data-cache-dir", str(tmp_path / "cache"), "--save", str(save)])
    records = [__import__("json").loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    logged = {k for r in records for k in r}
    assert LOGGED[task] <= logged, LOGGED[task] - logged
    greedy, sampled = rl.evaluate(save, samples=2)  # tools.py rl --eval: the held-out prompts, greedy and sampled
    assert 0 <= greedy <= 1 and 0 <= sampled <= 1, (greedy, sampled)


def test_a_reward_model_scores_the_rollouts(tok_file, tmp_path, capsys):
    """--reward-model: a --task rm run's values are the rewards (they spread; a tied group would teach nothing); a run
    of another task is refused in one line."""
    shape = ["--tokenizer-file", str(tok_file), "--vocab-size", "384", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", str(S), "--micro-batch-size", "4", "--eval-iters", "0",
             "--log-interval", "1", "--data-cache-dir", str(tmp_path / "cache")]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(__import__("json").dumps({"prompt": f"{i} + 1", "chosen": str(i + 1), "rejected": str(i)})
                             + "\n" for i in range(8)))
    train.main([*shape, "--task", "rm", "--data-path", str(prefs), "--global-batch-size", "4",
                "--train-iters", "1", "--save", str(tmp_path / "rm")])
    train.main([*shape, "--task", "grpo", "--reward-model", str(tmp_path / "rm"), "--rollout-max-new-tokens", str(NEW),
                "--data-path", prompts(tok_file),
                "--global-batch-size", "2", "--train-iters", "1", "--save", str(tmp_path / "grpo")])
    rec = [__import__("json").loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["reward_std"] > 0 and rec["reward"] != 0, rec
    with pytest.raises(SystemExit):
        train.main([*shape, "--task", "grpo", "--reward-model", str(tmp_path / "grpo"), "--global-batch-size", "2",
                    "--data-path", prompts(tok_file),
                    "--rollout-max-new-tokens", str(NEW),
                    "--train-iters", "1", "--save", str(tmp_path / "grpo2")])
    assert "is a --task grpo run, not a reward model (--task rm)" in capsys.readouterr().err


def test_a_reward_model_is_sharded_like_the_policy(tok_file, tmp_path, monkeypatch):
    """A reward model of the policy's architecture is built at the policy's layout (rl.reward_chunks: TP shards, the
    value head on the last pipeline stage) and scores in a forward-only pass: at TP 2 + SP and at PP 2 (train.py on
    warm ranks) the logged rewards are the one process's, and those are the whole-model RewardModel's. Tolerance 1e-5
    relative: float32, the same rollouts (drawn by the one-process replica on every layout), only the reward model's
    reduction order differs. Negative control: a sharded model that reads the value one token early differs."""
    shape = ["--tokenizer-file", str(tok_file), "--vocab-size", "384", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", str(S), "--micro-batch-size", "4", "--eval-iters", "0",
             "--log-interval", "1", "--data-cache-dir", str(tmp_path / "cache")]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(__import__("json").dumps({"prompt": f"{i} + 2", "chosen": str(i + 2), "rejected": str(i)})
                             + "\n" for i in range(8)))
    train.main([*shape, "--task", "rm", "--data-path", str(prefs), "--global-batch-size", "4", "--train-iters", "2",
                "--save", str(tmp_path / "rm")])
    grpo = [*shape, "--task", "grpo", "--reward-model", str(tmp_path / "rm"), "--rollout-max-new-tokens", str(NEW),
            "--data-path", prompts(tok_file),
            "--global-batch-size", "2", "--grpo-group-size", "4", "--train-iters", "1"]

    def rewards(name, extra=(), n=1):
        argv = [*grpo, *extra, "--save", str(tmp_path / name)]
        harness.launch(n, argv) if n > 1 else train.main(argv)
        rec = [__import__("json").loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return torch.tensor([rec[-1]["reward"], rec[-1]["reward_std"]], dtype=torch.float64)

    built = []
    monkeypatch.setattr(rl, "reward_chunks", lambda *a, f=rl.reward_chunks: built.append(f(*a)) or built[-1])
    one = rewards("one")
    assert built[-1] is not None and built[-1][-1].post_process and hasattr(built[-1][-1], "value_head")
    wider = arguments.check_args(arguments.parse_args([*grpo, "--hidden-size", "64"]), 1)
    assert rl.reward_chunks(wider, None, None) is None  # another architecture: read whole (RewardModel), not sharded
    monkeypatch.setattr(rl, "reward_chunks", lambda *a: None)  # the whole model in every process
    torch.testing.assert_close(rewards("whole"), one, rtol=1e-5, atol=0)
    for name, extra in (("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("pp2", ["--pipeline-model-parallel-size", "2"])):
        monkeypatch.undo()
        torch.testing.assert_close(rewards(name, extra, n=2), one, rtol=1e-5, atol=0, msg=name)
    early = recipes.last_token_values
    monkeypatch.setattr(recipes, "last_token_values", lambda v, m: early(v, m.roll(-1, -1)))
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(rewards("early"), one, rtol=1e-5, atol=0)


@pytest.mark.parametrize("flags, error", [
    (["--ppo-gamma", "0"], "--ppo-gamma=0.0 is out of range"), (["--ppo-lambda", "1.5"], "--ppo-lambda=1.5 is out"),
    (["--ppo-vf-coef", "-1"], "--ppo-vf-coef=-1.0 is out"), (["--ppo-kl-coef", "-0.1"], "--ppo-kl-coef=-0.1 is out"),
    (["--ppo-cliprange-value", "0"], "--ppo-cliprange-value=0.0 is out"),
    (["--grpo-group-size", "0"], "--grpo-group-size=0 is out of range (group size >= 1"),
    (["--grpo-loss-average", "sequence"], "--grpo-loss-average=sequence with --task ppo"),
    (["--rampup-batch-size", "2", "2", "8"], "--rampup-batch-size with --task ppo")])
def test_bad_ppo_flags_are_refused_in_one_line(flags, error):
    """(PPO takes one completion per prompt; GRPO needs two to compare.)"""
    argv = ["--task", "ppo", "--seq-length", str(S), "--rollout-max-new-tokens", str(NEW), "--micro-batch-size", "4",
            "--global-batch-size", "4"]
    with pytest.raises(arguments.ConfigError, match=re.escape(error)):
        arguments.check_args(arguments.parse_args(argv + flags), 1)
    arguments.check_args(arguments.parse_args(argv + ["--grpo-group-size", "1"]), 1)  # (the control: accepted)


def test_the_shipped_reward_and_prompts():
    """The bracket check: the answer, or any text after which the line parses, is 1; anything else 0. The prompts:
    balanced over their answers (no constant answer wins), from the stdlib's lines, the held-out ones from other modules
    than the training ones (never trained)."""
    r = {"prompt": "f(x[1", "answer": "])"}
    assert [rl.closes_brackets(r["prompt"], x, r) for x in ("])", " ]) \nmore", "], 2)", ")]", "", "]")] == \
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    train_recs, held = rl.bracket_records(), rl.bracket_records(held_out=True)
    assert len(train_recs) == 720 and len(held) >= 100 and not {x["prompt"] for x in train_recs} & {x["prompt"] for x in held}
    for recs in (train_recs, held):
        assert all(rl.closes_brackets(x["prompt"], x["answer"], x) == 1.0 for x in recs)
        assert max(Counter(x["answer"] for x in recs).values()) <= len(recs) / 4, Counter(x["answer"] for x in recs)
        assert all(rl.closes_brackets(x["prompt"], "", x) == 0.0 for x in recs)  # (no line is whole without them)


@pytest.mark.parametrize("task", ["grpo", "ppo"])
def test_a_resumed_rl_run_repeats_the_uninterrupted_one(tok_file, tmp_path, task):
    """Stopped after iteration 2 (--exit-interval) and resumed, a run logs the uninterrupted run's losses and rewards:
    the rollouts' seeds follow the iteration, not the process (PPO: the value head is saved and loaded with the rest).
    (--grpo-iterations 1: with mu > 1 a run resumed inside a cycle rolls out again.)"""
    argv = lambda save, *more: ["--task", task, "--tokenizer-file", str(tok_file), "--vocab-size", "384",
                                "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                                str(S), "--rollout-max-new-tokens", str(NEW), "--micro-batch-size", "4",
                                "--global-batch-size", "2", "--train-iters", "4", "--eval-iters", "0", "--log-interval",
                                "1", "--reward-function", "examples/rewards.py:brevity", "--lr", "1e-2",
                                "--data-path", prompts(tok_file), "--split", "90,10,0",
                                "--data-cache-dir", str(tmp_path / "cache"), "--load", str(save), "--save", str(save),
                                *more]
    evaluate = ["--eval-iters", "1", "--eval-interval", "4"] if task == "ppo" else []  # (after the last step: PPO's
    train.main(argv(tmp_path / "whole", *evaluate))                                     # valid pass, nothing follows)
    train.main(argv(tmp_path / "resumed", "--exit-interval", "2"))
    train.main(argv(tmp_path / "resumed"))

    def logged(run):
        recs = [__import__("json").loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["iteration"]: (r["loss"], r["reward"]) for r in recs if "loss" in r}
    whole, resumed = logged(tmp_path / "whole"), logged(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4] and len({v[1] for v in whole.values()}) > 1, (whole, resumed)
    assert resumed == whole
    if task == "ppo":  # (PPO's run through train.py: its metrics logged; GRPO's: the test above, with evaluation)
        keys = {k for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines() for k in json.loads(x)}
        assert LOGGED["ppo"] | {"val_reward", "val_value_loss"} <= keys, LOGGED["ppo"] - keys
        assert checkpoint.load_model(tmp_path / "whole").model is not None  # (as tools.py rl --eval: without its value head)
