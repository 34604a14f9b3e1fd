"""rl.py — online reinforcement learning on the parallel backend: GRPO, its rollouts drawn from serve.py's engine.

Offline tasks (posttrain.py) learn from fixed records; GRPO learns from what the policy itself writes. Each global
batch holds P prompts; before the policy's pass, Task.prepare, on every rank:
  1. gathers the policy's current weights into a one-process replica (TP shards all-gathered, pipeline stages' and
     expert-parallel ranks' parameters exchanged): in memory, never through disk, so rollouts see this step's weights;
  2. samples G completions of each of this DP rank's prompts with serve.Engine on the replica (continuous batching
     over a paged KV cache; completion j of the prompt of record i seeded by (--seed, iteration, i, j), so every
     layout draws the same completions);
  3. scores each with the reward function (--reward-function FILE:NAME; by default the shipped arithmetic check) or
     a reward model trained by --task rm (--reward-model RUN: sharded like the policy, in a forward-only pass of the
     policy's schedule, when it has the policy's architecture; else whole in every process);
  4. group-normalises the rewards into advantages: A = (r - mean of its group) / (std of its group + 1e-4);
  5. runs the frozen reference (forward only) for the KL term, and with --grpo-iterations mu > 1 the policy too, for
     the old log-probs of the clipped ratio (the same rollouts then serve mu optimizer steps, their log-probs kept).
The policy's pass then minimises, per completion token (DeepSeekMath's GRPO objective):
     ratio = exp(logp - old)     kl = exp(ref - logp) - (ref - logp) - 1     (Schulman's k3 estimator, >= 0)
     loss = -(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) - beta * kl)
summed over completion tokens / their global count (--grpo-loss-average token, the one loss rule on tokens; DAPO's),
or each completion's mean summed / the global count of completions (sequence: the GRPO paper's average).
Mirrors Hugging Face TRL's trl/trainer/grpo_trainer.py (the loss, num_generations, num_iterations, beta, epsilon) and
the GRPO trainers of ms-swift and NeMo-RL on Megatron-core (rollouts from an inference engine that is handed the
trainer's weights each step). Papers: Shao et al. 2024, "DeepSeekMath" (GRPO); Schulman 2020, "Approximating KL
divergence" (k3); Yu et al. 2025, "DAPO" (token-level averaging).

Run:    make train ARGS="--task grpo --pretrained-checkpoint runs/gpt-sft"
        .venv/bin/python rl.py --eval runs/gpt-grpo          # greedy reward and exact answers on the held-out prompts
        .venv/bin/python -m pytest -q tests/test_rl.py

Dimension glossary
  P prompts per global batch   G completions per prompt (--grpo-group-size)   n = P·G/dp completions on this DP rank
  s --seq-length (a row holds s + 1 tokens: the prompt, then its completion, right-padded with eod)
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from einops import rearrange

import checkpoint
import contract
import data
import lora
import parallel as P
import posttrain
import serve
from config import ConfigError
from data import DataError

TASKS = ("grpo",)
META = posttrain.META
# A prompt sample [3, s+1]: row 0 the chat-rendered prompt right-padded with eod; row 1 zeros (its completion's mask
# once rolled out); META: [prompt length, index in the global batch, record index]. A rollout has the same rows.
TOKENS, MASK = 0, 1


# ---------------------------------------------------------------------------------------------- prompts and rewards
def arithmetic_records(held_out: bool = False) -> list[dict]:
    """The shipped verifiable task: {"prompt": "a + b", "answer": "a+b"} for a, b < 20, checkable with the stdlib;
    the 40 pairs with a + 2b divisible by 10 are held out (the validation prompts), the other 360 train."""
    pairs = [(a, b) for a in range(20) for b in range(20) if ((a + 2 * b) % 10 == 0) == held_out]
    random.Random(0).shuffle(pairs)
    return [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a, b in pairs]


def arithmetic_reward(prompt: str, completion: str, record: dict) -> float:
    """1 if the completion's first integer is the record's answer (DeepSeekMath's rule-based accuracy); a wrong number
    earns partial credit, 0.5 · max(0, 1 - |error| / 10), so a small model that is rarely exact still sees which of
    its group's answers were closer; no number: 0."""
    m = re.search(r"-?\d+", completion)
    if m is None:
        return 0.0
    error = abs(int(m.group()) - int(record["answer"]))
    return 1.0 if error == 0 else 0.5 * max(0.0, 1 - error / 10)


def load_reward_function(spec: str | None):
    """--reward-function FILE.py:NAME -> the function NAME(prompt, completion, record) -> float of that file."""
    if spec is None:
        return arithmetic_reward
    path, _, name = spec.rpartition(":")
    if not path or not Path(path).is_file():
        raise ConfigError(f"--reward-function {spec}: expected FILE.py:NAME with an existing FILE")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ConfigError(f"--reward-function {spec}: {path} defines no function {name!r}")
    return getattr(module, name)


def reward_checkpoint(load):
    """--reward-model RUN -> its checkpoint, refused in one line unless it is a reward model (--task rm)."""
    ckpt = checkpoint.find_checkpoint(load, None, "--reward-model")
    if ckpt is None:
        raise ConfigError(f"--reward-model {load}: no checkpoint there")
    if ckpt.meta["args"].get("task") != "rm":
        raise ConfigError(f"--reward-model {load} is a --task {ckpt.meta['args'].get('task')} run, not a reward model "
                          "(--task rm)")
    return ckpt


def reward_chunks(args, build, mesh):
    """--reward-model RUN sharded like the policy: when RUN is a whole (not LoRA) reward model of the policy's
    architecture, its chunks built at this run's layout (TP shards, this rank's pipeline stage, the value head on the
    last stage), frozen, its weights read through DCP whatever layout saved them. Otherwise None: RewardModel reads it
    whole in every process."""
    ckpt = reward_checkpoint(args.reward_model)
    saved, flags = ckpt.meta["args"], checkpoint.ARCH_FLAGS + list(contract.model_file(args.model).ARCH_FLAGS)
    if "lora_base" in ckpt.meta or saved.get("model") != args.model or any(saved.get(k) != vars(args).get(k)
                                                                            for k in flags):
        return None
    chunks = build()
    for c in chunks:
        if c.post_process:
            posttrain.add_value_head(c)
    checkpoint.load_weights(ckpt, chunks, mesh)
    return [c.requires_grad_(False).eval() for c in chunks]


class RewardModel:
    """--reward-model RUN of another architecture than the policy's (or a LoRA one): the whole model in every process,
    scoring each rollout as it was trained: its value where it reads the completion's last token
    (posttrain.last_token_values)."""

    def __init__(self, load):
        reward_checkpoint(load)
        self.model = checkpoint.load_model(load, flag="--reward-model", extend=posttrain.add_value_head).model.eval()

    @torch.no_grad()
    def __call__(self, rows):
        """Rollouts [n, 3, s+1] -> rewards [n]."""
        return posttrain.last_token_values(*posttrain.run_model(self.model, rows, (posttrain.CHOSEN,), value=True))[0]


class PromptDataset(posttrain.TaskDataset):
    """Prompt samples [N, 3, s+1] (shuffled per epoch) and the records they came from (the reward function's)."""

    def __init__(self, samples, seed, records):
        super().__init__(samples, seed)
        self.records = records


def build_task_datasets(args, tok):
    """(train, valid or None) PromptDatasets: --data-path's JSON lines ({"prompt": ..., anything the reward function
    reads}) or the arithmetic records, each prompt a user turn of the chat template (posttrain.chat_prompt_ids), split
    by --split's validation fraction."""
    if args.data_path:
        records = []
        for path in [args.data_path] if isinstance(args.data_path, str) else args.data_path:
            for i, line in enumerate(Path(path).read_text().splitlines()):
                if line.strip():
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
                    if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
                        raise DataError(f"{path}:{i + 1}: a --task grpo record needs a string 'prompt'")
                    records.append({**r, "_where": f"{path}:{i + 1}"})
    else:  # the shipped prompts: their own held-out part, whatever --split says
        train = arithmetic_records()
        records = [{**r, "_where": f"arithmetic record {i}"} for i, r in enumerate(train + arithmetic_records(True))]
    eod, s, room = data.special_ids(tok)["eod"], args.seq_length, args.seq_length - args.rollout_max_new_tokens
    samples = np.full((len(records), 3, s + 1), eod, dtype=np.int64)
    samples[:, MASK] = 0
    for i, r in enumerate(records):
        ids = posttrain.chat_prompt_ids([{"role": "user", "content": r["prompt"]}], tok)
        if len(ids) > room:
            raise DataError(f"{r['_where']}: the prompt is {len(ids)} tokens; with --rollout-max-new-tokens="
                            f"{args.rollout_max_new_tokens} at most {room} fit --seq-length {s}")
        samples[i, TOKENS, :len(ids)], samples[i, META, 0], samples[i, META, 2] = ids, len(ids), i
    if args.data_path:
        n_valid = int(round(len(records) * args.valid_fraction))
        order = np.random.default_rng(args.seed).permutation(len(records))
        parts = (order[n_valid:], order[:n_valid])
    else:
        parts = (np.arange(len(train)), np.arange(len(train), len(records)))
    out = [PromptDataset(samples[ids], seed, records) if len(ids) else None
           for ids, seed in zip(parts, (args.seed, args.seed + 1))]
    return out[0], out[1]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards [p, G] -> advantages [p, G]: each reward against its own group's mean, over its std (Bessel's, as TRL)."""
    return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + eps)


def grpo_token_losses(logp, old, ref, adv, clip_eps: float, beta: float):
    """Per-token GRPO losses [b, s] from log-probs of the sampled tokens logp, old [b, s], ref [b, s] or None (beta 0),
    and advantages adv [b]; also the k3 KL [b, s] and where the ratio was clipped [b, s] (for the metrics)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.exp(ref - logp) - (ref - logp) - 1 if ref is not None else torch.zeros_like(logp)
    clipped = (ratio * a != surrogate).to(logp.dtype)
    return -(surrogate - beta * kl), kl, clipped


def average(losses, mask, mode: str):
    """The SUM over this micro-batch's units: completion tokens (token) or completions' token means (sequence)."""
    if mode == "token":
        return (losses * mask).sum()
    return ((losses * mask).sum(-1) / mask.sum(-1).clamp_min(1)).sum()


# ---------------------------------------------------------------------------------------------- the rollout replica
@torch.no_grad()
def full_weights(chunks, grid) -> dict:
    """{global name: whole tensor} of the policy on every rank: TP shards all-gathered (parallel.gather_full), then
    the pipeline stages' and expert-parallel ranks' parameters exchanged (all_gather_object)."""
    mine = {m.global_name(k): P.gather_full(p.detach(), p, grid).clone() for m in chunks
            for k, p in m.named_parameters()}
    mine |= {m.global_name(k): b.clone() for m in chunks for k, b in m.named_buffers() if k in m.state_dict()}
    for group in (grid.ep, grid.pp):
        if group.size > 1:
            parts = [None] * group.size
            dist.all_gather_object(parts, mine, group=group.pg)
            mine = {k: v for part in parts for k, v in part.items()}
    return mine


class Task(posttrain.Task):
    """GRPO on this rank's model chunks: prepare() rolls out, scores and keeps the log-probs; policy_step is the loss."""
    METRICS = {"grpo": ["reward", "reward_std", "completion_length", "kl", "clip_fraction", "rollout_seconds"]}

    def __init__(self, args, chunks, grid, shape, dtype, eod, device="cpu", autocast=None, ref_chunks=None,
                 corpus=None, iteration: int = 0):
        frozen = ref_chunks if isinstance(ref_chunks, Frozen) else Frozen(ref_chunks, None)  # (setup_task's)
        super().__init__(args, chunks, grid, shape, dtype, eod, device, autocast or contextlib.nullcontext,
                         frozen.reference)
        self.tok, self.eod = corpus.tokenizer, data.special_ids(corpus.tokenizer)["eod"]
        self.datasets = {"train": corpus.train, "valid": corpus.valid}
        if args.reward_model is not None and args.reward_function is not None:
            raise ConfigError("--reward-model and --reward-function: give one reward")
        if args.reward_model is not None and data.get_tokenizer(None, None, tokenizer_file=str(
                Path(args.reward_model) / "tokenizer.json")).get_vocab() != self.tok.get_vocab():
            raise ConfigError(f"--reward-model {args.reward_model}: its tokenizer is not the policy's (it would read "
                              "other tokens)")
        self.reward = load_reward_function(args.reward_function) if args.reward_model is None else None
        self.reward_chunks = frozen.reward  # the reward model sharded like the policy, or
        self.reward_model = RewardModel(args.reward_model) if args.reward_model and not frozen.reward else None
        # the iteration seeds the rollouts: a resumed run (iteration = where it resumes) draws what it would have
        self.iteration, self.rollouts, self.replica = iteration, {}, None
        self.ref_chunks = self.ref_chunks if args.grpo_kl_beta > 0 else None

    def sync_replica(self):
        """The one-process replica (built once, LoRA adapters as the policy's) with the policy's current weights."""
        if self.replica is None:
            c = self.chunks[0]
            self.replica = type(c)(dataclasses.replace(c.config, sequence_parallel=False)).to(self.device)
            if self.lora:
                lora.apply_lora(self.replica, self.a.lora_target_modules, self.a.lora_rank, self.a.lora_alpha, 0.0)
        P.load_full_state_dict(self.replica, full_weights(self.chunks, self.grid), None)
        return self.replica.eval()

    def rollout(self, prompts, split):
        """This DP rank's prompts [p, 3, s+1] -> completions [p·G, 3, s+1] (prompt + completion in row 0, the
        completion's tokens masked in row 1) and their rewards [p, G]."""
        a, G = self.a, self.a.grpo_group_size
        records = self.datasets[split].records
        model = self.sync_replica()
        max_batch = len(prompts) * G
        blocks = max_batch * -(-(a.seq_length + 1) // 16)
        engine = serve.Engine(model, blocks, 16, max_batch)
        ids = []
        for row in prompts:
            n, rec = int(row[META, 0]), int(row[META, 2])
            for j in range(G):
                seed = int(np.random.SeedSequence([a.seed, self.iteration, split == "valid", rec, j])
                           .generate_state(1, np.uint64)[0] % 2**62)  # the same on every rank and layout
                params = serve.SamplingParams(max_tokens=a.rollout_max_new_tokens, temperature=a.rollout_temperature,
                                              top_p=a.rollout_top_p if a.rollout_top_p < 1 else None, seed=seed,
                                              stop=(self.eod,))
                ids.append(engine.add_request(row[TOKENS, :n].tolist(), params))
        outputs = engine.run()
        out = prompts.repeat_interleave(G, 0).clone()  # [p·G, 3, s+1]
        rewards = torch.zeros(len(out), dtype=torch.float64)
        for k, rid in enumerate(ids):
            n, rec, completion = int(out[k, META, 0]), int(out[k, META, 2]), outputs[rid]
            out[k, TOKENS, n:n + len(completion)] = torch.tensor(completion)
            out[k, MASK, n:n + len(completion)] = 1
            if self.reward is not None:
                text = self.tok.decode(completion[:-1] if completion[-1] == self.eod else completion)
                record = {k2: v for k2, v in records[rec].items() if k2 != "_where"}
                rewards[k] = float(self.reward(records[rec]["prompt"], text, record))
        if self.reward_model is not None:
            rewards = self.reward_model(out.to(self.device)).double().cpu()
        return out, rewards.view(len(prompts), G)  # (a sharded reward model scores in prepare)

    def prepare(self, batch, split: str = "train"):
        a, grid = self.a, self.grid
        if batch.shape[1] != 3:
            raise ValueError(f"--task grpo: prompt samples of 3 rows expected, got {batch.shape[1]}")
        g = batch.shape[0] * a.grpo_group_size  # completions in the global batch
        if split != "train" or split not in self.rollouts or self.iteration % a.grpo_iterations == 0:
            start = time.perf_counter()
            mine, rewards = self.rollout(batch.chunk(grid.dp_size)[grid.dp.rank], split)
            mine[:, META, 1] = torch.arange(len(mine)) + grid.dp.rank * len(mine)  # the index in the global batch
            micro = list(mine.to(self.device).split(a.micro_batch_size))
            if self.reward_chunks is not None:  # each completion's value on the last stage (zeros elsewhere: unused)
                values = self.forward_only(self.reward_chunks, micro, (posttrain.CHOSEN,), g, value=True)
                rewards = values[mine[:, META, 1].to(self.device), 0].cpu().view_as(rewards)
            adv = torch.zeros(g, dtype=torch.float64)
            adv[mine[:, META, 1]] = group_advantages(rewards).flatten()
            count = mine[:, MASK, 1:].sum() if a.grpo_loss_average == "token" else torch.tensor(len(mine))
            count = int(P.all_reduce(count.reshape(1).to(self.device), grid.dp)[0])
            token_logps = lambda chunks, adapters_off=False: rearrange(self.forward_only(  # [g, s], last stage
                chunks, micro, (posttrain.CHOSEN,), g, adapters_off, per_token=True), "g 1 s -> g s")
            ref = token_logps(self.ref_chunks, self.lora) if self.ref_chunks is not None else None
            old = token_logps(self.chunks) if a.grpo_iterations > 1 and split == "train" else None
            self.rollouts[split] = (micro, adv, ref, old, count)
            if self.chunks[-1].post_process:
                lengths = mine[:, MASK].sum(-1).double()
                self.record(split, reward=rewards.flatten(), reward_std=rewards.std(-1), completion_length=lengths,
                            rollout_seconds=torch.tensor([time.perf_counter() - start]))
        if split == "train":
            self.iteration += 1
        micro, _, _, _, count = self.rollouts[split]
        t, b, h = self.shape
        return micro, lambda model, mb: self.policy_step(model, mb, split), count, (t, b, h)

    def policy_step(self, model, mb, split="train"):
        res = posttrain.run_model(model, mb, (posttrain.CHOSEN,))
        if not model.post_process:
            return res
        _, adv, ref, old, _ = self.rollouts[split]
        logp, mask, idx = -res[0][0], res[1][0], mb[:, META, 1]  # [b, s] each; [b]
        losses, kl, clipped = grpo_token_losses(
            logp, old[idx].to(logp.dtype) if old is not None else logp.detach(),
            ref[idx].to(logp.dtype) if ref is not None else None, adv[idx].to(logp.dtype), self.a.grpo_clip_eps,
            self.a.grpo_kl_beta)
        on = mask.bool()
        self.record(split, kl=kl[on].detach(), clip_fraction=clipped[on])
        return average(losses, mask, self.a.grpo_loss_average)


@dataclasses.dataclass
class Frozen:
    """What setup_task builds beside the policy, frozen: the reference (KL) and the sharded reward model, or None."""
    reference: list | None
    reward: list | None


def setup_task(args, start, chunks, build, mesh):
    """The frozen reference for the KL term (posttrain.setup_task's, as DPO's; none when --grpo-kl-beta is 0) and a
    --reward-model of the policy's architecture sharded like it (reward_chunks), as Frozen; its pointer for meta.json."""
    ref, pointer = posttrain.setup_task(args, start, chunks, build, mesh, reference=args.grpo_kl_beta > 0)
    return Frozen(ref, reward_chunks(args, build, mesh) if args.reward_model else None), pointer


@torch.no_grad()
def evaluate(load, max_new_tokens: int = 8) -> tuple[float, float]:
    """(mean reward, exact accuracy) of a saved run's greedy answers to the shipped task's 40 held-out prompts."""
    run = checkpoint.load_model(load)
    eod = data.special_ids(run.tok)["eod"]
    records = arithmetic_records(held_out=True)
    engine = serve.Engine(run.model, len(records) * -(-run.args.seq_length // 16), 16, len(records))
    ids = [engine.add_request(posttrain.chat_prompt_ids([{"role": "user", "content": r["prompt"]}], run.tok),
                              serve.SamplingParams(max_tokens=max_new_tokens, temperature=0, stop=(eod,)))
           for r in records]
    out = engine.run()
    texts = [run.tok.decode([t for t in out[i] if t != eod]) for i in ids]
    rewards = [arithmetic_reward(r["prompt"], x, r) for r, x in zip(records, texts)]
    return sum(rewards) / len(rewards), sum(x == 1.0 for x in rewards) / len(rewards)


def main(argv=None) -> int:
    """`python rl.py --sft-out FILE`: the shipped prompts' training part with their answers as SFT records
    ({"prompt", "response"}), to teach a model the task's format before GRPO (the held-out prompts left out).
    `python rl.py --eval RUN`: a run's greedy accuracy on the 40 held-out prompts."""
    import argparse
    p = argparse.ArgumentParser(description="The shipped arithmetic task: its SFT records, or a run's accuracy.")
    p.add_argument("--sft-out", help="the JSON-lines file to write the training prompts' SFT records to")
    p.add_argument("--eval", metavar="RUN", help="print a saved run's greedy accuracy on the held-out prompts")
    a = p.parse_args(argv)
    if a.sft_out:
        Path(a.sft_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.sft_out).write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["answer"]}) + "\n"
                                           for r in arithmetic_records()))
    if a.eval:
        reward, exact = evaluate(a.eval)
        print(f"{a.eval}: held-out reward {reward:.3f}, exact answers {exact:.3f} (40 prompts, greedy)")
    if not (a.sft_out or a.eval):
        p.error("give --sft-out FILE or --eval RUN")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
