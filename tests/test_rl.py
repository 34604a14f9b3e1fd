"""GRPO (rl.py): the loss against a written-out formula, the recipe against plain forwards, every layout against the
single process, and the shipped task through train.py.

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
  - `train.py --task grpo` runs on the shipped arithmetic prompts and logs reward, KL and clip fraction.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types

import pytest
import torch
from test_posttrain import OPT, _adapt, _merged, _trainable_grads
from test_train import SNIPPET

import arguments
import data
import gpt
import harness
import lora
import parallel as P
import posttrain
import rl
import train
from equivalence import assert_same

S, NEW, G = 40, 6, 2  # --seq-length (the arithmetic prompts are 30 tokens in this BPE), new tokens, group size
HYPER = dict(grpo_group_size=G, grpo_iterations=2, grpo_clip_eps=0.2, grpo_kl_beta=0.3, grpo_loss_average="token",
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


# --------------------------------------------------------------------------------------- 2. the recipe vs forwards
@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "tokenizer.json"
    data.get_tokenizer([SNIPPET.format(i=i) for i in range(40)], str(path), 384)
    return path


def config(tok, sp=False, moe=False):
    moe = dict(num_experts=4, moe_router_topk=2) if moe else {}  # (no aux loss: it is per micro-batch, as Megatron's)
    return gpt.Config(**moe, num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      vocab_size=tok.get_vocab_size(), max_position_embeddings=S, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.float64, position_embedding_type="rope",
                      normalization="RMSNorm", activation="silu", gated_linear_unit=True, add_bias_linear=False,
                      init_method_std=0.2, sequence_parallel=sp)


def grpo_case(rank, n, tok_file, tp, pp, sp, opt, M, g=4, steps=2, control=None, use_lora=False, ep=1,
              moe=False):
    """`steps` GRPO steps (g prompts, G completions each) on this rank's chunks, as train.py runs them (rl.Task.prepare,
    then the schedule). opt: None = parallel.Optimizer, True = the distributed optimizer. Also returns each step's
    rollouts and global count, and in one process the weights each step's loss was computed with (for the formula)."""
    tok = data.get_tokenizer(None, None, tokenizer_file=str(tok_file))
    grid = P.Grid(tp=tp, pp=pp, dp=n // (tp * pp), ep=ep)
    c = config(tok, sp, moe=moe)
    make = lambda pre, post, off, nl: gpt.Model(c, grid, pre, post, off, nl)
    chunks = P.build_chunks(make, c.num_layers, grid, 1)
    chunks = [_adapt(m) for m in chunks] if use_lora else chunks  # the reference: the policy, adapters off
    c_ref = dataclasses.replace(c, seed=c.seed + 1)  # another model: the KL term counts from the first step
    ref = [m.requires_grad_(False) for m in P.build_chunks(
        lambda pre, post, off, nl: gpt.Model(c_ref, grid, pre, post, off, nl), c.num_layers, grid, 1)]
    if opt is None:
        ddp, optimizer = None, P.Optimizer(chunks, grid, **OPT)
    else:
        ddp = P.DDP(chunks, grid, bucket_size=3000, overlap=True, distributed_optimizer=opt)
        optimizer = P.DistributedOptimizer(ddp, **OPT)
    mbs = g * G // (grid.dp_size * M)
    args = argparse.Namespace(task="grpo", micro_batch_size=mbs, global_batch_size=g, **HYPER, **(dict(
        lora_rank=4, lora_alpha=8.0, lora_target_modules=lora.TARGETS) if use_lora else dict(lora_rank=None)))
    train_ds, _ = rl.build_task_datasets(args, tok)
    corpus = types.SimpleNamespace(tokenizer=tok, train=train_ds, valid=None)
    t = rl.Task(args, chunks, grid, (S // tp if sp else S, mbs, c.hidden_size), c.params_dtype,
                data.special_ids(tok)["eod"], ref_chunks=ref, corpus=corpus)
    batch, losses, grads, seen = data.global_batch(train_ds, start=0, size=g), [], None, []
    for step in range(steps):
        optimizer.zero_grad(M)
        micro, recipe, count, shape = t.prepare(batch)
        mi, adv, r, old, cnt = t.rollouts["train"]
        if control == "no_kl":  # the KL term dropped
            t.a = argparse.Namespace(**{**vars(t.a), "grpo_kl_beta": 0.0})
        if control == "global_advantages" and step == 0:  # normalised over the whole batch, not each group
            reward = rl.load_reward_function(HYPER["reward_function"])
            rewards = torch.tensor([reward("", x, {}) for x in texts_of(torch.cat(mi), tok)], dtype=torch.float64)
            adv = rl.group_advantages(rewards.reshape(1, -1)).flatten()
        if control == "old_recomputed" and step == 1:  # the old log-probs of the policy after the first update
            old = t.forward_only(chunks, mi, (posttrain.CHOSEN,), g * G, per_token=True)[:, 0]
        t.rollouts["train"] = (mi, adv, r, old, cnt)
        seen.append(dict(rows=torch.cat(mi).clone(), count=count))
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
    eod, out = data.special_ids(tok)["eod"], []
    for row in rows:
        ids = row[rl.TOKENS][row[rl.MASK].bool()].tolist()
        out.append(tok.decode(ids[:-1] if ids[-1] == eod else ids))
    return out


def per_token_logps(model, rows):
    """log p of each next token [n, s] by one plain forward of rows [n, 3, s+1]."""
    with torch.no_grad():
        return -model(rows[:, rl.TOKENS, :-1], rows[:, rl.TOKENS, 1:])


def expected_losses(tok_file, out):
    """The formula's loss at each step: rewards recomputed from the decoded completions, advantages by hand within each
    prompt's group, the policy's and the reference's log-probs by plain forwards of the weights of that step (the old
    log-probs: step 0's, at rollout time)."""
    tok = data.get_tokenizer(None, None, tokenizer_file=str(tok_file))
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


def test_the_recipe_is_the_formula_on_its_rollouts(tok_file):
    out = grpo_case(0, 1, tok_file, 1, 1, False, None, M=1)
    want = expected_losses(tok_file, out)
    err = worst_error(out["losses"], want)
    assert err <= 1e-12, f"the recipe's losses {out['losses'].tolist()} are not the formula's {want[:, 0].tolist()}"
    assert out["metrics"]["kl"] > 0 and 0 <= out["metrics"]["clip_fraction"] <= 1, out["metrics"]


@pytest.mark.parametrize("control", ["global_advantages", "no_kl", "old_recomputed"])
def test_negative_controls_fail_the_formula(tok_file, control):
    out = grpo_case(0, 1, tok_file, 1, 1, False, None, M=1, control=control)
    err = worst_error(out["losses"], expected_losses(tok_file, out))
    assert err > 1e-6, f"{control}: the loss still matches the formula (relative error {err:.1e})"


# --------------------------------------------------------------------------------------- 3. any layout == one process
LAYOUTS = {"tp2-sp": (2, 2, 1, True, None, False), "pp2": (2, 1, 2, False, None, False),
           "dp2-distopt": (2, 1, 1, False, True, False), "tp2-sp-lora": (2, 2, 1, True, None, True),
           "moe-ep2": (2, 1, 1, False, None, False)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_in_any_layout_equals_single_process(pool, tok_file, layout):
    """(With LoRA, the rollout replica carries the adapters and the reference is the policy with them off.)"""
    n, tp, pp, sp, opt, use_lora = LAYOUTS[layout]
    ep = 2 if layout == "moe-ep2" else 1  # (an MoE policy: the replica gathers each EP rank's experts)
    got = _merged(pool.run(grpo_case, n, tok_file=tok_file, tp=tp, pp=pp, sp=sp, opt=opt, M=2, use_lora=use_lora,
                           ep=ep, moe=ep > 1))
    ref = grpo_case(0, 1, tok_file, 1, 1, False, None, M=1, use_lora=use_lora, moe=ep > 1)
    assert_same(got, ref, rtol=1e-10, what=f"grpo {layout}")


# --------------------------------------------------------------------------------------- 4. through train.py
def test_train_py_runs_grpo_on_the_shipped_task(tok_file, tmp_path):
    save = tmp_path / "grpo"
    train.main(["--task", "grpo", "--tokenizer-file", str(tok_file), "--vocab-size", "384", "--num-layers", "2",
                "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(S), "--rollout-max-new-tokens",
                str(NEW), "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2", "--eval-iters",
                "1", "--eval-interval", "2", "--log-interval", "1", "--data-cache-dir", str(tmp_path / "cache"),
                "--save", str(save)])
    records = [__import__("json").loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    logged = {k for r in records for k in r}
    assert {"reward", "reward_std", "kl", "clip_fraction", "completion_length", "val_reward"} <= logged, logged


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
                "--global-batch-size", "2", "--train-iters", "1", "--save", str(tmp_path / "grpo")])
    rec = [__import__("json").loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["reward_std"] > 0 and rec["reward"] != 0, rec
    with pytest.raises(SystemExit):
        train.main([*shape, "--task", "grpo", "--reward-model", str(tmp_path / "grpo"), "--global-batch-size", "2",
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
    early = posttrain.last_token_values
    monkeypatch.setattr(posttrain, "last_token_values", lambda v, m: early(v, m.roll(-1, -1)))
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(rewards("early"), one, rtol=1e-5, atol=0)


def test_the_shipped_reward_and_prompts():
    """The arithmetic check: exact 1, a near miss partial credit, no number 0; the held-out prompts are never trained."""
    r = {"prompt": "3 + 4", "answer": "7"}
    assert [rl.arithmetic_reward("3 + 4", x, r) for x in ("7", " 7 apples", "9", "17", "seven", "-7")] == \
        [1.0, 1.0, 0.5 * 0.8, 0.0, 0.0, 0.0]
    train_prompts = {x["prompt"] for x in rl.arithmetic_records()}
    held_out = {x["prompt"] for x in rl.arithmetic_records(held_out=True)}
    assert len(train_prompts) == 360 and len(held_out) == 40 and not train_prompts & held_out


def test_a_resumed_grpo_run_repeats_the_uninterrupted_one(tok_file, tmp_path):
    """Stopped after iteration 2 (--exit-interval) and resumed, a run logs the uninterrupted run's losses and rewards:
    the rollouts' seeds follow the iteration, not the process. (--grpo-iterations 1: with mu > 1 a run resumed inside a
    cycle rolls out again.)"""
    argv = lambda save, *more: ["--task", "grpo", "--tokenizer-file", str(tok_file), "--vocab-size", "384",
                                "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
                                str(S), "--rollout-max-new-tokens", str(NEW), "--micro-batch-size", "4",
                                "--global-batch-size", "2", "--train-iters", "4", "--eval-iters", "0", "--log-interval",
                                "1", "--reward-function", "examples/rewards.py:brevity", "--lr", "1e-2",
                                "--data-cache-dir", str(tmp_path / "cache"), "--load", str(save), "--save", str(save),
                                *more]
    train.main(argv(tmp_path / "whole"))
    train.main(argv(tmp_path / "resumed", "--exit-interval", "2"))
    train.main(argv(tmp_path / "resumed"))

    def logged(run):
        recs = [__import__("json").loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["iteration"]: (r["loss"], r["reward"]) for r in recs if "loss" in r}
    whole, resumed = logged(tmp_path / "whole"), logged(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4] and len({v[1] for v in whole.values()}) > 1, (whole, resumed)
    assert resumed == whole
