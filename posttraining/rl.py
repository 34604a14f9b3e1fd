"""posttraining/rl.py — online reinforcement learning on the parallel backend: GRPO and PPO, their rollouts drawn from
serving/engine.py's engine.

Offline tasks (posttraining/recipes.py) learn from fixed records; GRPO and PPO learn from what the policy itself
writes. Each global batch holds P prompts; before the policy's pass, Task.prepare, on every rank, gathers the policy's
current weights into a one-process replica (in memory), samples G completions of each prompt with serve.Engine on it
(each seeded by (--seed, iteration, record, j): every layout draws the same ones), scores them (a reward function or
a --task rm reward model) and makes advantages of the scores — GRPO: normalised within each prompt's group; PPO: per-
token KL rewards and GAE over a value head beside the output. The steps and the losses: DESIGN.md §7, "Online RL".
Mirrors Hugging Face TRL's trl/trainer/grpo_trainer.py and ppo_trainer.py, the GRPO trainers of ms-swift and NeMo-RL
on Megatron-core (rollouts from an inference engine handed the trainer's weights each step) and OpenRLHF's PPO.
Papers: Shao et al. 2024 (DeepSeekMath: GRPO); Schulman 2020 (the k3 KL estimator); Yu et al. 2025 (DAPO); Ouyang et
        al. 2022 (InstructGPT); Schulman et al. 2016 (GAE) and 2017 (PPO); Huang et al. 2024 (PPO's N+ details).

Run:    make train ARGS="--task ppo --pretrained-checkpoint runs/gpt-sft"      # (--task grpo: README's chain)
        .venv/bin/python tools.py rl --eval runs/gpt-ppo           # held-out reward, greedy and sampled
        .venv/bin/python -m pytest -q tests/test_rl.py

Dimension glossary
  P prompts per global batch   G completions per prompt (--grpo-group-size)   n = P·G/dp completions on this DP rank
  s --seq-length (a row holds s + 1 tokens: the prompt, then its completion, right-padded with eod)
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import random
import sysconfig
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import config
import data
import parallel as P
from config import ConfigError
from data import DataError
from interop import tokenizer_files
from posttraining import lora, recipes
from serving import engine as serve

TASKS = ("grpo", "ppo")
META = recipes.META
# A prompt sample [3, s+1]: row 0 the chat-rendered prompt right-padded with eod; row 1 zeros (its completion's mask
# once rolled out); META: [prompt length, index in the global batch, record index]. A rollout has the same rows.
TOKENS, MASK = 0, 1


# ---------------------------------------------------------------------------------------------- prompts and rewards
@functools.lru_cache(maxsize=1)
def _bracket_lines() -> dict:
    """{held out?: {answer kind: [records]}} over the stdlib's files, each distinct line in the split of its first file."""
    root, picked, seen = Path(sysconfig.get_paths()["stdlib"]), {False: {}, True: {}}, set()
    for f in data.default_corpus_files():
        held = int(hashlib.md5(Path(f).relative_to(root).as_posix().encode()).hexdigest(), 16) % 5 == 0
        for line in Path(f).read_text(encoding="utf-8", errors="replace").splitlines():
            s = line.strip()
            if not 8 <= len(s) <= 40 or s[-1] not in ")]}" or s in seen or s[0] in "#@" or '"' in s or "'" in s:
                continue
            seen.add(s)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ast.parse(s)
            except (SyntaxError, ValueError):
                continue
            cut = len(s.rstrip(")]}"))
            if 0 < cut and not s[cut - 1].isspace():
                answer = s[cut:]
                picked[held].setdefault(answer if answer in (")", "]", "))", "}", "])") else "other", []).append(
                    {"prompt": s[:cut], "answer": answer})
    return picked


def bracket_records(held_out: bool = False) -> list[dict]:
    """The shipped verifiable task, a small code task the stdlib checks: close the brackets of a line of Python.
    From the stdlib's own sources (data.default_corpus_files), every distinct single-line statement of 8-40 characters,
    without quotes, that parses and ends in closing brackets: the prompt is the line without that closing run, the
    answer is the run ("print(len(x" -> "))"). Balanced over the answers, as 77 % of such lines end in one ")": up to
    120 each of ")", "]", "))", "}", "])" and the rest together (720 prompts). Held out: the lines of a fifth of the
    modules (by a hash of the file's path in the stdlib), up to 20 of each (120 prompts), so what carries over to them
    is bracket structure, not remembered lines."""
    picked, n, out = _bracket_lines()[held_out], (20 if held_out else 120), []
    for kind in sorted(picked):
        out += random.Random(kind).sample(picked[kind], min(n, len(picked[kind])))
    random.Random(1).shuffle(out)
    return out


def closes_brackets(prompt: str, completion: str, record: dict) -> float:
    """1 if the completion's first line is the record's answer, or any other text after which the prompt parses (a
    verifiable reward: ast.parse decides); else 0."""
    c = completion.strip().split("\n")[0]
    if c == record["answer"]:
        return 1.0
    try:
        with warnings.catch_warnings():  # ("1abc": a SyntaxWarning on stderr before its SyntaxError)
            warnings.simplefilter("ignore")
            ast.parse(prompt + c)
    except (SyntaxError, ValueError):
        return 0.0
    return float(bool(c))


def load_reward_function(spec: str | None):
    """--reward-function FILE.py:NAME -> the function NAME(prompt, completion, record) -> float of that file."""
    if spec is None:
        return closes_brackets
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
    saved, flags = ckpt.meta["args"], checkpoint.ARCH_FLAGS + list(config.model_file(args.model).ARCH_FLAGS)
    if "lora_base" in ckpt.meta or saved.get("model") != args.model or any(saved.get(k) != vars(args).get(k)
                                                                            for k in flags):
        return None
    chunks = build()
    for c in chunks:
        if c.post_process:
            recipes.add_value_head(c)
    checkpoint.load_weights(ckpt, chunks, mesh)
    return [c.requires_grad_(False).eval() for c in chunks]


class RewardModel:
    """--reward-model RUN of another architecture than the policy's (or a LoRA one): the whole model in every process,
    scoring each rollout as it was trained: its value where it reads the completion's last token
    (recipes.last_token_values)."""

    def __init__(self, load):
        reward_checkpoint(load)
        self.model = checkpoint.load_model(load, flag="--reward-model", extend=recipes.add_value_head).model.eval()

    @torch.no_grad()
    def __call__(self, rows):
        """Rollouts [n, 3, s+1] -> rewards [n]."""
        return recipes.last_token_values(*recipes.run_model(self.model, rows, (recipes.CHOSEN,), value=True))[0]


class PromptDataset(recipes.TaskDataset):
    """Prompt samples [N, 3, s+1] (shuffled per epoch) and the records they came from (the reward function's)."""

    def __init__(self, samples, seed, records):
        super().__init__(samples, seed)
        self.records = records


def build_task_datasets(args, tok):
    """(train, valid or None) PromptDatasets: --data-path's JSON lines ({"prompt": ..., anything the reward function
    reads}) or the shipped bracket records, each prompt a user turn of the chat template (recipes.chat_prompt_ids), split
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
                        raise DataError(f"{path}:{i + 1}: a --task {args.task} record needs a string 'prompt'")
                    records.append({**r, "_where": f"{path}:{i + 1}"})
    else:  # the shipped prompts: their own held-out part, whatever --split says
        train = bracket_records()
        records = [{**r, "_where": f"bracket record {i}"} for i, r in enumerate(train + bracket_records(True))]
    eod, s, room = tokenizer_files.special_ids(tok)["eod"], args.seq_length, args.seq_length - args.rollout_max_new_tokens
    samples = np.full((len(records), 3, s + 1), eod, dtype=np.int64)
    samples[:, MASK] = 0
    for i, r in enumerate(records):
        ids = recipes.chat_prompt_ids([{"role": "user", "content": r["prompt"]}], tok)
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
    and advantages adv [b] (PPO: [b, s], one per token); also the k3 KL [b, s] and where the ratio was clipped [b, s]
    (for the metrics). PPO's policy loss is this at beta 0."""
    ratio = torch.exp(logp - old)
    a = adv[:, None] if adv.dim() == 1 else adv
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.exp(ref - logp) - (ref - logp) - 1 if ref is not None else torch.zeros_like(logp)
    clipped = (ratio * a != surrogate).to(logp.dtype)
    return -(surrogate - beta * kl), kl, clipped


def average(losses, mask, mode: str):
    """The SUM over this micro-batch's units: completion tokens (token) or completions' token means (sequence)."""
    if mode == "token":
        return (losses * mask).sum()
    return ((losses * mask).sum(-1) / mask.sum(-1).clamp_min(1)).sum()


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalized advantage estimation over each completion's tokens: per-token rewards, values and the 0/1 completion
    mask [n, s] -> (advantages, returns) [n, s], 0 off the completion. delta_t = r_t + gamma V_{t+1} - V_t (V after
    the last token: 0), A_t = delta_t + gamma lambda A_{t+1}, R_t = A_t + V_t. One column at a time, as TRL."""
    adv = torch.zeros_like(values)
    next_v = next_a = torch.zeros_like(values[:, 0])  # [n]
    for t in reversed(range(values.shape[1])):
        adv[:, t] = (rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a) * mask[:, t]
        next_v, next_a = values[:, t] * mask[:, t], adv[:, t]
    return adv, (adv + values) * mask


def whiten(x, mask, group):
    """x [n, s] whitened over the completion tokens (mask [n, s]) of every rank of `group` (a collective; None: this
    rank's alone): (x - mean) / sqrt(var + 1e-8), var with Bessel's correction (TRL's masked_whiten; a lone token's
    n - 1 taken as 1); 0 off the mask."""
    total = P.all_reduce(torch.stack([(x * mask).sum(), mask.sum()]), group)  # [sum, count]
    mean = total[0] / total[1]
    var = P.all_reduce(((x - mean) ** 2 * mask).sum().reshape(1), group)[0] / (total[1] - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def ppo_advantages(scores, old, ref, values, mask, kl_coef: float, gamma: float, lam: float, group=None):
    """InstructGPT's per-token rewards, r_t = -kl_coef (old_t - ref_t) plus the completion's score at its last token,
    through GAE -> (advantages whitened over `group`'s completion tokens, returns) [n, s]. scores [n]; the rollout's
    log-probs old, the reference's ref (None: kl_coef 0), its values V_old and the completion mask, [n, s] each."""
    rewards = -kl_coef * (old - ref) * mask if ref is not None else torch.zeros_like(values)
    last = mask.shape[-1] - 1 - mask.flip(-1).argmax(-1)  # [n] each completion's last token
    rewards[torch.arange(len(rewards), device=rewards.device), last] += scores.to(rewards)
    adv, returns = gae(rewards, values, mask, gamma, lam)
    return whiten(adv, mask, group), returns


def value_losses(values, old_values, returns, clip: float):
    """Per-token clipped value losses [b, s] (TRL's vf loss): 1/2 max((V - R)^2, (clip(V, V_old +- clip) - R)^2); also
    where the clipped term is the larger [b, s] (the metric vf_clip_fraction)."""
    clipped = torch.clamp(values, old_values - clip, old_values + clip)
    plain, far = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(plain, far), (far > plain).to(values.dtype)


def add_critic(model):
    """PPO's value head beside the policy's output on its last stage (one trunk, as InstructGPT's policy-and-value
    model): recipes.ValueHead (`value_head.weight`, added to the base), and the stage returns (its usual output,
    values [s(/tp), b, 1]); recipes.run_model hands both on. The rollout replica and the reference go without it."""
    model.value_head = recipes.ValueHead(model.config, model.grid, next(model.parameters()).device)
    output = model.postprocess
    model.postprocess = lambda x, labels=None: (output(x, labels), model.value_head(x))
    return model


@dataclasses.dataclass
class Rollouts:
    """One batch of rollouts on this rank, kept for its --grpo-iterations steps: the micro-batches [b, 3, s+1], the
    global count of loss units, and per completion of the global batch (at its META[1]; this rank's filled):
    advantages ([g] GRPO, [g, s] PPO), the reference's and the rollout policy's log-probs [g, s] (None where not
    needed), and PPO's returns and rollout-time values [g, s]."""
    micro: list
    count: int
    adv: torch.Tensor
    ref: torch.Tensor | None
    old: torch.Tensor | None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None


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


class Task(recipes.Task):
    """GRPO or PPO on this rank's model chunks: prepare() rolls out, scores and keeps the log-probs (PPO: values and
    advantages too); policy_step is the loss. PPO's kl is k1 (old - ref) per completion token at rollout time."""
    METRICS = {"grpo": ["reward", "reward_std", "completion_length", "kl", "clip_fraction", "rollout_seconds"],
               "ppo": ["reward", "reward_std", "completion_length", "kl", "clip_fraction", "value_loss",
                       "vf_clip_fraction", "returns", "values", "rollout_seconds"]}

    def __init__(self, args, chunks, grid, shape, dtype, eod, device="cpu", autocast=None, ref_chunks=None,
                 corpus=None, iteration: int = 0):
        frozen = ref_chunks if isinstance(ref_chunks, Frozen) else Frozen(ref_chunks, None)  # (setup_task's)
        super().__init__(args, chunks, grid, shape, dtype, eod, device, autocast or contextlib.nullcontext,
                         frozen.reference)
        self.tok, self.eod = corpus.tokenizer, tokenizer_files.special_ids(corpus.tokenizer)["eod"]
        self.datasets = {"train": corpus.train, "valid": corpus.valid}
        if args.reward_model is not None and args.reward_function is not None:
            raise ConfigError("--reward-model and --reward-function: give one reward")
        if args.reward_model is not None and tokenizer_files.get_tokenizer(None, None, tokenizer_file=str(
                Path(args.reward_model) / "tokenizer.json")).get_vocab() != self.tok.get_vocab():
            raise ConfigError(f"--reward-model {args.reward_model}: its tokenizer is not the policy's (it would read "
                              "other tokens)")
        self.reward = load_reward_function(args.reward_function) if args.reward_model is None else None
        self.reward_chunks = frozen.reward  # the reward model sharded like the policy, or
        self.reward_model = RewardModel(args.reward_model) if args.reward_model and not frozen.reward else None
        # the iteration seeds the rollouts: a resumed run (iteration = where it resumes) draws what it would have
        self.iteration, self.rollouts, self.replica = iteration, {}, None
        self.kl = args.ppo_kl_coef if self.kind == "ppo" else args.grpo_kl_beta
        self.ref_chunks = self.ref_chunks if self.kl > 0 else None

    def sync_replica(self):
        """The one-process replica (built once, LoRA adapters as the policy's) with the policy's current weights."""
        if self.replica is None:
            c = self.chunks[0]
            self.replica = type(c)(dataclasses.replace(c.config, sequence_parallel=False)).to(self.device)
            if self.lora:
                lora.apply_lora(self.replica, self.a.lora_target_modules, self.a.lora_rank, self.a.lora_alpha, 0.0)
        weights = {k: v for k, v in full_weights(self.chunks, self.grid).items() if not k.startswith("value_head.")}
        P.load_full_state_dict(self.replica, weights, None)
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
        a, grid, dev = self.a, self.grid, self.device
        if batch.shape[1] != 3:
            raise ValueError(f"--task {self.kind}: prompt samples of 3 rows expected, got {batch.shape[1]}")
        g = batch.shape[0] * a.grpo_group_size  # completions in the global batch
        if split != "train" or split not in self.rollouts or self.iteration % a.grpo_iterations == 0:
            start = time.perf_counter()
            mine, rewards = self.rollout(batch.chunk(grid.dp_size)[grid.dp.rank], split)
            mine[:, META, 1] = torch.arange(len(mine)) + grid.dp.rank * len(mine)  # the index in the global batch
            idx, mask = mine[:, META, 1].to(dev), mine[:, MASK, 1:].to(dev, torch.float64)  # [n]; [n, s]
            micro = list(mine.to(dev).split(a.micro_batch_size))
            if self.reward_chunks is not None:  # each completion's value on the last stage (zeros elsewhere: unused)
                scores = self.forward_only(self.reward_chunks, micro, (recipes.CHOSEN,), g, rewards=True)
                rewards = scores[idx, 0].cpu().view_as(rewards)
            count = mine[:, MASK, 1:].sum() if a.grpo_loss_average == "token" else torch.tensor(len(mine))
            count = int(P.all_reduce(count.reshape(1).to(dev), grid.dp)[0])

            def token_logps(chunks, adapters_off=False, values=False):  # [g, s] (and values [g, s]), last stage
                out = self.forward_only(chunks, micro, (recipes.CHOSEN,), g, adapters_off, True, values)
                return tuple(x[:, 0] for x in out) if values else out[:, 0]
            ref = token_logps(self.ref_chunks, self.lora) if self.ref_chunks is not None else None
            if self.kind == "ppo":  # the rollout policy's log-probs (KL reward, ratio) and values (GAE, clipping)
                old, values = token_logps(self.chunks, values=True)
                adv, returns = torch.zeros_like(old), torch.zeros_like(old)
                adv[idx], returns[idx] = ppo_advantages(rewards.flatten(), old[idx], ref[idx] if ref is not None else
                                                        None, values[idx], mask, self.kl, a.ppo_gamma, a.ppo_lambda,
                                                        grid.dp)
                self.rollouts[split] = Rollouts(micro, count, adv, ref, old, returns, values)
                if self.chunks[-1].post_process:
                    on = mask.bool()
                    kl = {"kl": (old - ref)[idx][on]} if ref is not None else {}
                    self.record(split, returns=returns[idx][on], values=values[idx][on], **kl)
            else:
                adv = torch.zeros(g, dtype=torch.float64, device=dev)
                adv[idx] = group_advantages(rewards).flatten().to(dev)
                old = token_logps(self.chunks) if a.grpo_iterations > 1 and split == "train" else None
                self.rollouts[split] = Rollouts(micro, count, adv, ref, old)
            if self.chunks[-1].post_process:
                std = {"reward_std": rewards.std(-1)} if rewards.shape[1] > 1 else {}  # (PPO's G may be 1)
                self.record(split, reward=rewards.flatten(), completion_length=mine[:, MASK].sum(-1).double(),
                            rollout_seconds=torch.tensor([time.perf_counter() - start]), **std)
        if split == "train":
            self.iteration += 1
        ro = self.rollouts[split]
        return ro.micro, lambda model, mb: self.policy_step(model, mb, split), ro.count, self.shape

    def policy_step(self, model, mb, split="train"):
        res = recipes.run_model(model, mb, (recipes.CHOSEN,))
        if not model.post_process:
            return res
        a, ro = self.a, self.rollouts[split]
        logp, mask, idx = -res[0][0], res[1][0], mb[:, META, 1]  # [b, s] each; [b]
        on, old = mask.bool(), ro.old[idx].to(logp.dtype) if ro.old is not None else logp.detach()
        if self.kind == "ppo":
            values = res[2][0]  # [b, s]
            pg, _, clipped = grpo_token_losses(logp, old, None, ro.adv[idx].to(logp.dtype), a.grpo_clip_eps, 0.0)
            vf, vf_clipped = value_losses(values, ro.values[idx].to(values.dtype), ro.returns[idx].to(values.dtype),
                                          a.ppo_cliprange_value)
            self.record(split, clip_fraction=clipped[on], value_loss=vf[on].detach(), vf_clip_fraction=vf_clipped[on])
            return ((pg + a.ppo_vf_coef * vf) * mask).sum()
        losses, kl, clipped = grpo_token_losses(
            logp, old, ro.ref[idx].to(logp.dtype) if ro.ref is not None else None, ro.adv[idx].to(logp.dtype),
            a.grpo_clip_eps, a.grpo_kl_beta)
        self.record(split, kl=kl[on].detach(), clip_fraction=clipped[on])
        return average(losses, mask, a.grpo_loss_average)


@dataclasses.dataclass
class Frozen:
    """What setup_task builds beside the policy, frozen: the reference (KL) and the sharded reward model, or None."""
    reference: list | None
    reward: list | None


def setup_task(args, start, chunks, build, mesh):
    """PPO: the value head on the last stage (add_critic). The frozen reference for the KL term (recipes.setup_task's,
    as DPO's; none when --grpo-kl-beta (GRPO) or --ppo-kl-coef (PPO) is 0) and a --reward-model of the policy's
    architecture sharded like it (reward_chunks), as Frozen; the reference's pointer for meta.json."""
    for c in chunks if args.task == "ppo" else []:
        if c.post_process:
            add_critic(c)
    kl = args.ppo_kl_coef if args.task == "ppo" else args.grpo_kl_beta
    ref, pointer = recipes.setup_task(args, start, chunks, build, mesh, reference=kl > 0)
    return Frozen(ref, reward_chunks(args, build, mesh) if args.reward_model else None), pointer


@torch.no_grad()
def evaluate(load, samples: int = 8, max_new_tokens: int = 8, prompts: int | None = None) -> tuple[float, float]:
    """A saved run's mean reward on the shipped task's held-out prompts (the first `prompts` of them; all: None):
    (greedy, sampled) — its greedy answers, and `samples` answers of each at temperature 1 (the rollouts'
    distribution, the one GRPO and PPO optimise), seeded."""
    run = checkpoint.load_model(load, reward_model=False)
    eod, records = tokenizer_files.special_ids(run.tok)["eod"], bracket_records(held_out=True)[:prompts]
    prompts = [recipes.chat_prompt_ids([{"role": "user", "content": r["prompt"]}], run.tok) for r in records]
    out = []
    for temperature, k in ((0.0, 1), (1.0, samples)):
        engine = serve.Engine(run.model, k * len(records) * (-(-run.args.seq_length // 16) + 1), 16, k * len(records))
        ids = [(r, engine.add_request(ids, serve.SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                                seed=1000 * i + j, stop=(eod,))))
               for i, (r, ids) in enumerate(zip(records, prompts)) for j in range(k)]
        texts = engine.run()
        rewards = [closes_brackets(r["prompt"], run.tok.decode([t for t in texts[rid] if t != eod]), r)
                   for r, rid in ids]
        out.append(sum(rewards) / len(rewards))
    return out[0], out[1]


def main(argv=None) -> int:
    """`python tools.py rl --sft-out FILE`: the shipped prompts' training part with their answers as SFT records
    ({"prompt", "response"}), to teach a model the task's format before GRPO or PPO (the held-out prompts left out).
    `python tools.py rl --eval RUN`: a run's held-out reward, greedy and sampled."""
    import argparse
    p = argparse.ArgumentParser(description="The shipped bracket task: its SFT records, or a run's held-out reward.")
    p.add_argument("--sft-out", help="the JSON-lines file to write the training prompts' SFT records to")
    p.add_argument("--eval", metavar="RUN", help="print a saved run's reward on the held-out prompts")
    p.add_argument("--samples", type=int, default=8, help="--eval: sampled answers per prompt (temperature 1)")
    p.add_argument("--prompts", type=int, default=None, help="--eval: only the first N held-out prompts")
    a = p.parse_args(argv)
    if a.samples < 1 or (a.prompts is not None and a.prompts < 1):
        p.error(f"--samples={a.samples} and --prompts={a.prompts} must be >= 1")
    if a.sft_out:
        Path(a.sft_out).parent.mkdir(parents=True, exist_ok=True)
        records = bracket_records()
        Path(a.sft_out).write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["answer"]}) + "\n"
                                           for r in records))
        print(f"wrote {len(records)} SFT records of the bracket task to {a.sft_out}; train on them: make train "
              f"ARGS=\"--task sft --pretrained-checkpoint RUN --data-path {a.sft_out}\"")
    if a.eval:
        greedy, sampled = evaluate(a.eval, a.samples, prompts=a.prompts)
        print(f"{a.eval}: held-out reward {greedy:.3f} greedy, {sampled:.3f} sampled (temperature 1, {a.samples} each; "
              f"{len(bracket_records(True)[:a.prompts])} prompts)")
    if not (a.sft_out or a.eval):
        p.error("give --sft-out FILE or --eval RUN")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
