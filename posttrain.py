"""posttrain.py — post-training tasks on the parallel backend: SFT, DPO, KTO, reward models (the DATA helper writes
this docstring at the merge)."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

import checkpoint
import data
import lora
import parallel as P
from arguments import ArgumentParser, ConfigError

# ==== 1. Task data (DATA helper): JSON-lines records, chat template, samples, example data, datasets
# (the other helper's section)


# ==== 2. Task losses and the reference model (CORE helper): losses, recipes, reference model, metrics
# One sample = an int64 tensor [R, s+1] (SAMPLE FORMAT, section 1): token rows, 0/1 mask rows (1 = a response token
# whose log-prob counts), and the last row META: meta[0] = KTO's label, meta[1] = the sample's index in its global
# batch (set by `number_samples`). For the model: input = tokens[:-1], labels = tokens[1:], loss mask = mask[1:].
# Dimension glossary: g global batch (samples)   b micro-batch (samples)   k sequences per sample in a pass
#                     s sequence length          h hidden
ROWS = {"sft": 3, "dpo": 5, "kto": 5, "rm": 5}  # rows per sample
META = -1
CHOSEN, REJECTED = (0, 1), (2, 3)  # dpo, rm: (token row, mask row) of each side; kto: (0, 1) the sample, (2, 3) its KL
UNIT = {"sft": "masked tokens", "dpo": "pairs", "kto": "samples", "rm": "pairs"}  # the loss rule's units


def sequence_logps(token_losses, mask):
    """Per-token losses -log p [n, s] and the 0/1 loss mask [n, s] -> each sequence's response log-prob [n]."""
    return -(token_losses * mask).sum(-1)


def sft_loss(token_losses, mask):
    """The SUM of the response tokens' losses (a scalar): divided by the global count of response tokens."""
    return (token_losses * mask).sum()


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta: float, smoothing: float = 0.0):
    """Per-pair DPO losses [n] (Rafailov et al. 2023; TRL's `sigmoid` loss): h = beta·((pi_c − ref_c) − (pi_r − ref_r)),
    −(1 − eps)·logsigmoid(h) − eps·logsigmoid(−h); eps > 0: cDPO (Mitchell 2023), labels flipped with probability eps."""
    h = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    return -(1 - smoothing) * F.logsigmoid(h) - smoothing * F.logsigmoid(-h)


def kto_loss(pi, ref, z0, label, beta: float, w_d: float = 1.0, w_u: float = 1.0):
    """Per-sample KTO losses [n] (Ethayarajh et al. 2024; TRL's kto_trainer): r = pi − ref; desirable (label 1):
    w_d·(1 − sigmoid(beta·(r − z0))), undesirable: w_u·(1 − sigmoid(beta·(z0 − r))); z0 the detached reference point."""
    r = pi - ref
    return torch.where(label.bool(), w_d * (1 - torch.sigmoid(beta * (r - z0))), w_u * (1 - torch.sigmoid(beta * (z0 - r))))


def rm_loss(v_c, v_r):
    """Per-pair Bradley-Terry losses [n] (Ouyang et al. 2022): −logsigmoid(v_chosen − v_rejected)."""
    return -F.logsigmoid(v_c - v_r)


def number_samples(batch):
    """META[1] = each sample's index in its global batch [g, R, s+1] (in place): the key under which the reference
    passes store their values, whichever DP rank, micro-batch and pipeline schedule a sample lands in."""
    batch[:, META, 1] = torch.arange(batch.shape[0])
    return batch


def num_units(task: str, batch) -> int:
    """The global count that divides the summed loss (the one loss rule): response tokens (sft) or samples."""
    return int(batch[:, 1, 1:].sum()) if task == "sft" else batch.shape[0]


def _last_stage_values(model, out):
    """The value head's output [s(/tp), n, 1] -> [n, s]: under SP the sequence gathered, backward = split (each rank
    then holds the whole gradient and keeps its tokens' part; the head's own gradient is summed over TP)."""
    if model.config.sequence_parallel:
        out = P.gather_from_sp(out, P.tp_of(model.grid), tp_output_grad=False)
    return rearrange(out, "s n 1 -> n s")


def run_model(model, mb, sides, eod=None, value=False):
    """The model on the sequences `sides` ((token row, mask row) pairs) of micro-batch mb [b, R, s+1], stacked
    [(k b), s]. Last stage: (per-token losses [k, b, s], or values with the value head; the loss masks [k, b, s]);
    an inner stage: its output hidden states (the schedule sends them). eod: SFT packing, block-causal attention."""
    tokens = rearrange(mb[:, [t for t, _ in sides]], "b k t -> (k b) t")  # [(k b), s+1]
    inp, kw = tokens[:, :-1], {}
    if eod is not None:  # packed samples: positions restart and attention stays inside each (data.py)
        kw["mask"], _, kw["position_ids"] = data.get_ltor_masks_and_position_ids(inp, eod, True, True)
    out = model(inp, **kw) if value else model(inp, tokens[:, 1:], **kw)
    if not model.post_process:
        return out
    out = _last_stage_values(model, out) if value else out
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out  # losses in >= float32
    mask = rearrange(mb[:, [m for _, m in sides], 1:], "b k s -> k b s").to(out.dtype)
    return rearrange(out, "(k b) s -> k b s", k=len(sides)), mask


def last_token_values(values, mask):
    """values [k, b, s], loss masks [k, b, s] -> [k, b]: each sequence's value where the model reads its last response
    token before the closing eod (the input position whose next token is the final masked one; always one of the s
    inputs, also when a sample fills all s+1 tokens)."""
    s = mask.shape[-1]
    last = s - 1 - mask.flip(-1).argmax(-1)  # [k, b] the last 1 of each loss mask
    return values.gather(-1, last[..., None])[..., 0]


class Task:
    """One post-training task on this rank's model chunks: per global batch, `prepare` numbers the samples, splits
    this DP rank's micro-batches, runs the reference passes (dpo, kto) and returns the policy's recipe for the
    schedule. The recipe(model, mb) returns the SUM of the micro-batch's unit losses on the last stage (its hidden
    states elsewhere); train.py divides by the global count of units.
    The reference model (dpo, kto): `ref_chunks` (a frozen copy, built and loaded like the policy), or with LoRA the
    policy itself inside lora.disabled. Its sequence log-probs come from a forward-only pass of the same micro-batches
    under the same pipeline schedule, kept on the last stage at each sample's META[1] index: no collective needed.
    KTO's z0 = max(0, mean over the GLOBAL batch of (policy − reference) log-prob of the KL rows), detached: one more
    forward-only pass of the policy, summed over DP (and the pipeline, whose last stage holds it).
    Forward-only passes run in eval mode (no dropout), as TRL's reference model."""

    def __init__(self, args, chunks, grid, shape, dtype, device="cpu", autocast=contextlib.nullcontext,
                 ref_chunks=None):
        self.a, self.kind, self.chunks, self.grid = args, args.task, chunks, grid
        self.shape, self.dtype, self.device, self.autocast = shape, dtype, device, autocast
        self.lora = bool(getattr(args, "lora_rank", None))
        self.ref_chunks = chunks if self.lora else ref_chunks
        if self.kind in ("dpo", "kto") and self.ref_chunks is None:
            raise ValueError(f"--task {self.kind} needs a reference model (ref_chunks) or LoRA adapters")
        self.sums, self.ref, self.z0 = {}, None, None

    # ---- one global batch
    def prepare(self, batch, split: str = "train"):
        """Global batch [g, R, s+1] -> (this DP rank's micro-batches, recipe(model, mb), global unit count, p2p shape)."""
        a, grid = self.a, self.grid
        if batch.shape[1] != ROWS[self.kind]:
            raise ValueError(f"--task {self.kind}: samples of {ROWS[self.kind]} rows expected, got {batch.shape[1]}")
        batch = number_samples(batch.clone())
        micro = list(batch.chunk(grid.dp_size)[grid.dp.rank].to(self.device).split(a.micro_batch_size))
        if self.kind == "dpo":
            self.ref = self.forward_only(self.ref_chunks, micro, (CHOSEN, REJECTED), batch.shape[0], self.lora)
        elif self.kind == "kto":
            self.ref = self.forward_only(self.ref_chunks, micro, (CHOSEN, REJECTED), batch.shape[0], self.lora)
            kl = self.forward_only(self.chunks, micro, (REJECTED,), batch.shape[0])[:, 0]  # the policy's KL rows
            self.z0 = self.reference_point(kl - self.ref[:, 1], batch.shape[0])
            if (not dist.is_initialized() or dist.get_rank() == 0):
                self.record(split, kl=self.z0.reshape(1))
        rows = 2 if self.kind in ("dpo", "rm") else 1
        t, b, h = self.shape
        return micro, functools.partial(self.policy_step, split=split), num_units(self.kind, batch), (t, b * rows, h)

    def reference_point(self, diff, g: int):
        """KTO's z0 from this rank's (policy − reference) KL-row log-probs at their indices [g] (0 elsewhere)."""
        total = diff.sum().reshape(1)
        for group in (self.grid.dp, self.grid.pp):  # each sample is held by one DP rank's last stage
            total = P._all_reduce(total, group)
        return (total / g).clamp_min(0)[0]

    @torch.no_grad()
    def forward_only(self, chunks, micro, sides, g: int, adapters_off: bool = False):
        """Sequence log-probs [g, k] of `sides` under `chunks` (forward-only schedule, eval mode), filled on the last
        stage at each sample's META[1] (zeros elsewhere)."""
        out = torch.zeros(g, len(sides), dtype=torch.float64, device=self.device)

        def step(model, mb):
            with self.autocast(), lora.disabled(model) if adapters_off else contextlib.nullcontext():
                res = run_model(model, mb, sides)
            if not model.post_process:
                return res
            out[mb[:, META, 1]] = rearrange(sequence_logps(*res), "k b -> b k").double()
            return torch.zeros((), device=self.device)
        was = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        t, b, h = self.shape
        try:
            P.forward_backward(chunks, micro, step, 1, self.grid, (t, b * len(sides), h), self.dtype, forward_only=True)
        finally:
            for c, w in zip(chunks, was):
                c.train(w)
        return out

    # ---- the policy's pass: the schedule's loss_func
    def policy_step(self, model, mb, split="train"):
        a, kind = self.a, self.kind
        if kind == "sft":
            res = run_model(model, mb, (CHOSEN,), eod=a.eod_token if getattr(a, "packing", False) else None)
            return sft_loss(*res) if model.post_process else res
        res = run_model(model, mb, (CHOSEN, REJECTED) if kind in ("dpo", "rm") else (CHOSEN,), value=kind == "rm")
        if not model.post_process:
            return res
        idx = mb[:, META, 1]
        if kind == "rm":
            v_c, v_r = last_token_values(*res)
            self.record(split, accuracy=(v_c > v_r).double(), reward_margin=(v_c - v_r).detach())
            tied = getattr(model.output_layer, "weight", None)  # a last stage's copy of the tied embedding: a zero
            zero = 0 * tied.sum() if tied is not None and tied.requires_grad else 0  # gradient, summed with its twin's
            return rm_loss(v_c, v_r).sum() + zero
        logps = sequence_logps(*res)  # [k, b]
        ref = self.ref[idx].to(logps.dtype)  # [b, 2]
        if kind == "dpo":
            loss = dpo_loss(logps[0], logps[1], ref[:, 0], ref[:, 1], a.dpo_beta, a.dpo_label_smoothing)
            rc, rr = (a.dpo_beta * (logps[0] - ref[:, 0])).detach(), (a.dpo_beta * (logps[1] - ref[:, 1])).detach()
            self.record(split, rewards_chosen=rc, rewards_rejected=rr, reward_margin=rc - rr,
                        preference_accuracy=(rc > rr).double())
            return loss.sum()
        label = mb[:, META, 0]
        loss = kto_loss(logps[0], ref[:, 0], self.z0.to(logps.dtype), label, a.kto_beta, a.kto_desirable_weight,
                        a.kto_undesirable_weight)
        self.record(split, rewards=(a.kto_beta * (logps[0] - ref[:, 0])).detach())
        return loss.sum()

    # ---- metrics: sums and counts on the last stage (TP rank 0 of it), reduced over every rank when logged
    def record(self, split, **values):
        if self.grid.tp.rank != 0:
            return
        for k, v in values.items():
            s = self.sums.setdefault(split, {}).setdefault(k, torch.zeros(2, dtype=torch.float64))
            s += torch.stack([v.double().sum().cpu(), torch.tensor(float(v.numel()), dtype=torch.float64)])

    def metrics(self, split: str = "train", prefix: str = "") -> dict:
        """{prefix + name: mean} since the last call, over every sample of every rank: a collective (every rank calls
        it). sft: none (its loss is already per response token)."""
        names = {"dpo": ["rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy"],
                 "kto": ["kl", "rewards"], "rm": ["accuracy", "reward_margin"]}.get(self.kind, [])
        mine = self.sums.pop(split, {})
        t = torch.stack([mine.get(k, torch.zeros(2, dtype=torch.float64)) for k in names]) if names else None
        if t is None:
            return {}
        if dist.is_initialized():
            t = t.to(self.device)
            dist.all_reduce(t)
        return {prefix + k: float(t[i, 0] / t[i, 1]) for i, k in enumerate(names) if t[i, 1] > 0}


def add_value_heads(chunks):
    """--task rm: the value head on the last stage (gpt.Model.add_value_head). The output layer is then unused: an
    untied one is frozen; a last stage's copy of the tied embedding stays trainable (its first-stage twin learns)."""
    for c in chunks:
        if c.post_process:
            c.add_value_head()
            w = getattr(c.output_layer, "weight", None)
            if w is not None and not getattr(w, "shared_embedding", False):
                w.requires_grad_(False)
    return chunks


def check_generates(args, load):
    """`train.py sample` / `export` need a language model: a reward model's output is a value, not next-token logits."""
    if getattr(args, "task", "pretrain") == "rm":
        raise ConfigError(f"--load {load} is a reward model (--task rm): it scores text (train.py score), it does not "
                          "generate or export as a causal LM")


def score(argv):
    """`train.py score --load RUN --data-path FILE.jsonl`: a reward model's (--task rm) reward of each record of an SFT
    file ({"prompt", "response"} or {"messages"}), one per line, in file order. One process, the whole model."""
    p = ArgumentParser(prog="train.py score")
    p.add_argument("--load", required=True)
    p.add_argument("--data-path", required=True, help="a JSON-lines file of prompts with responses")
    a = p.parse_args(argv)
    if "load_records" not in globals() or "make_sample" not in globals():
        raise ConfigError("train.py score: posttrain.py has no task data (load_records, make_sample)")
    model, args, tok, _ = checkpoint.load_model(a.load)
    if getattr(args, "task", "pretrain") != "rm":
        raise ConfigError(f"--load {a.load} is a --task {getattr(args, 'task', 'pretrain')} run, not a reward model "
                          "(--task rm)")
    eod, rewards = data.special_ids(tok)["eod"], []
    model.eval()
    for i, record in enumerate(globals()["load_records"](a.data_path, "sft")):
        sample = globals()["make_sample"](record, "sft", tok, args.seq_length, eod, f"{a.data_path}: record {i + 1}")
        with torch.no_grad():
            values = last_token_values(*run_model(model, torch.from_numpy(sample)[None], (CHOSEN,), value=True))
        rewards.append(float(values[0, 0]))
        print(f"{rewards[-1]:.6f}", flush=True)
    return rewards
