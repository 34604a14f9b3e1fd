"""metrics.py — what a training run reports: the progress bar, metrics.jsonl, TensorBoard and loss.png, and the
model FLOPs behind its `tflops` (and, on CUDA, `mfu`).

Mirrors the logging half of Megatron-LM's `megatron/training/training.py` (training_log, the TensorBoard writer,
and num_floating_point_operations: the model FLOPs of one iteration, for the GPT, MoE, multi-latent attention, MTP
and hybrid Mamba models; BERT's and T5's counts are ours, from their modules).
A file of its own so train.py stays a loop a reader takes in at once: the loop hands each record here.
Paper: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters" (§5.1, the FLOPs
count: every GEMM 2·m·n·k, run 3 times per iteration: forward, backward's dgrad and wgrad; no recomputation).

Run:    make train MODEL=gpt     (writes runs/gpt/metrics.jsonl, runs/gpt/tensorboard/, runs/gpt/loss.png)
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallel as P


# ---------------------------------------------------------------------------------------------- model FLOPs
#   Dimension glossary: B sequences in the iteration (the global batch), s sequence length, h hidden, L layers,
#   n heads, g query groups, d head dim (kv_channels), f ffn hidden, V padded vocabulary, E experts, k top-k,
#   MLA: rq q_lora_rank, rkv kv_lora_rank, dn qk_head_dim, dr qk_pos_emb_head_dim, dv v_head_dim; D mtp_num_layers;
#   T5: se / sd encoder / decoder length, Le / Ld their layers; Mamba: d_in = H·P the mixer's width, H heads,
#   G groups, N state size.
#   Counted, as Megatron counts them: the GEMMs (weights and core attention, causal: half of QKᵀ and of PV) and the
#   logit layer; MLA's q/kv latent norms and MTP's three norms (Megatron's formula has a term for each). Not counted:
#   the other norms, softmax, activations, RoPE, dropout, the MoE router's h x E GEMM, the embedding lookup, the
#   cross-entropy — and no recomputation (model FLOPs, not hardware FLOPs). Every term below is per token (or per
#   sequence) of the FORWARD, in multiply-adds; x 2 (a multiply-add is 2 FLOPs) x 3 (forward, dgrad, wgrad) at the end.
def flops(c, batch: int, seq: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) on `batch` sequences of `seq` tokens: Megatron's
    transformer_flops (num_floating_point_operations, megatron/training/training.py: GPT, GQA, SwiGLU, MoE top-k +
    shared expert, multi-latent attention, MTP). The default of the model-file contract (config.py): a model file
    with other layers declares its own `flops` from the pieces below (bert.py, t5.py: ours, DESIGN.md §6; mamba.py:
    Megatron's hybrid count). Retro and LLaVA take this count of their decoder (Retro's encoder and chunked
    cross-attention, LLaVA's ViT and projector are not counted: a floor)."""
    h, L, D = c.hidden_size, c.num_layers, c.mtp_num_layers or 0
    moe = [c.is_moe_layer(i) for i in range(L)]
    moe += moe[-1:] * D  # each MTP depth holds one more layer of the last layer's kind (Megatron's last_layer_is_moe)
    layers = sum(self_attention_flops(c, seq, causal=True) + mlp_flops(c, m) for m in moe)
    mtp = D * (3 * h + 2 * h * h)  # per depth: enorm, hnorm, final_layernorm (Megatron's 3h) and eh_proj 2h -> h
    logits = h * c.padded_vocab_size * (1 + D)  # the main logit layer and each depth's
    return 3 * 2 * batch * seq * (layers + mtp + logits)  # 3: forward, dgrad, wgrad; 2: a multiply-add is 2 FLOPs


def self_attention_flops(c, s: int, causal: bool, mla: bool | None = None) -> float:
    """One self-attention layer, forward multiply-adds per token over s keys (causal: half the s x s square).
    Multi-latent attention (deepseek.MLASelfAttention) as Megatron's formula: q = linear_q_proj h -> n(dn+dr), or
    with q-lora linear_q_down_proj h -> rq, q_layernorm (rq: Megatron's "+ 1"), linear_q_up_proj rq -> n(dn+dr);
    linear_kv_down_proj h -> rkv + dr, kv_layernorm (rkv), linear_kv_up_proj rkv -> n(dn+dv); the core QKᵀ over
    dn+dr and PV over dv; linear_proj n·dv -> h. Else GQA: linear_qkv h -> (n+2g)d, QKᵀ and PV over d, linear_proj."""
    h, n = c.hidden_size, c.num_attention_heads
    keys = s / 2 if causal else s
    if c.multi_latent_attention if mla is None else mla:
        rq, rkv, dq, dv = c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
        q = h * n * dq if rq is None else rq * (h + n * dq + 1)
        kv = rkv * (h + n * (c.qk_head_dim + dv) + 1) + h * c.qk_pos_emb_head_dim
        return q + kv + n * dv * h + keys * n * (dq + dv)
    d, g = c.kv_channels, c.num_query_groups
    return h * (n + 2 * g) * d + keys * n * d * 2 + n * d * h  # QKV (GQA: g key/value heads), QKᵀ and PV, proj


def mlp_flops(c, moe: bool) -> float:
    """One MLP (h -> f -> h; SwiGLU: h -> 2f, f -> h) or MoE layer (top-k routed experts + the shared expert),
    forward multiply-adds per token."""
    f = c.moe_ffn_hidden_size * c.moe_router_topk + (c.moe_shared_expert_intermediate_size or 0) if moe \
        else c.ffn_hidden_size
    return c.hidden_size * f * (3 if c.gated_linear_unit else 2)


# Peak dense TFLOP/s (no sparsity) from the vendors' data sheets: (bf16/fp16 tensor cores, fp32 without TF32 —
# torch's default for fp32 matmuls). Matched as whole words in torch.cuda.get_device_name(), first match wins.
PEAK_TFLOPS = [("H100 PCIe", 756.0, 51.2), ("H100 NVL", 835.5, 60.0), ("H100", 989.4, 66.9), ("H200 NVL", 835.5, 60.0),
               ("H200", 989.4, 66.9), ("GH200", 989.4, 66.9),
               ("A100", 312.0, 19.5), ("L40S", 362.1, 91.6), ("L4", 121.0, 30.3), ("A10", 125.0, 31.2),
               ("RTX 4090", 165.2, 82.6)]
_SAID = set()


def peak_tflops(device, half: bool) -> float | None:
    """The device's peak dense TFLOP/s for bf16/fp16 (half) or fp32; None off CUDA or for a device not in the table
    (said once)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((p[1 if half else 2] for p in PEAK_TFLOPS if re.search(rf"\b{p[0]}\b", name)), None)
    if peak is None and name not in _SAID and int(os.environ.get("RANK", "0")) == 0:
        _SAID.add(name)
        print(f"note: no peak TFLOP/s known for {name!r} (metrics.PEAK_TFLOPS): no mfu is logged", flush=True)
    return peak


def throughput(flops_done: float, secs: float, world: int, device, half: bool) -> dict:
    """{tflops: model TFLOP/s per rank (Megatron's throughput: the iterations' FLOPs / time / world size)[, mfu:
    that over the device's peak]}."""
    tflops = flops_done / secs / world / 1e12
    peak = peak_tflops(device, half)
    return dict(tflops=tflops) if peak is None else dict(tflops=tflops, mfu=tflops / peak)


def module_losses(model) -> dict:
    """{name: mean} of the losses modules log themselves (a submodule's `logged_losses()` -> {name: tensor([sum,
    count])} since its last call: deepseek.MTPBlock's per-depth MTP losses), summed over every rank, so the mean is
    over the global batch whichever stage and DP rank holds what (TP copies scale sum and count alike). A
    collective: every rank calls it, with or without such modules."""
    sums = {}
    for m in model.modules():
        for k, v in (m.logged_losses() if callable(getattr(m, "logged_losses", None)) else {}).items():
            sums[k] = sums.get(k, 0) + v
    every = [sums]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sums)
    total = {}
    for d in every:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return {k: float(v[0] / v[1]) for k, v in total.items() if v[1] > 0}


# ---------------------------------------------------------------------------------------------- a run's records
# train.py's loop hands its Run here: the log line of the steps since the last one, the closing line, and what a step
# that cannot be applied reports.
def batch_work(run, samples: int) -> tuple[int, float]:
    """(tokens, Megatron's model FLOPs) of a global batch of `samples` samples: the sequences the model trains on (a
    pair is 2: the task's `sequences`; a reference model's forward passes are not counted) times --seq-length."""
    seqs = samples * (run.task.sequences if run.task is not None else 1)
    return seqs * run.args.seq_length, run.mf.flops(run.config, seqs, run.args.seq_length)


def training_log(run, n: int, window: dict, lr: float) -> dict:
    """The metrics.jsonl line of the iterations since the last one (Megatron's training_log; a collective: every rank
    calls it). `lr` is the rate Megatron logs: the schedule's after the last step (the next step's); tokens/s and FLOPs
    count each step's own global batch; `consumed_samples` and (with a ramp-up) `global_batch_size`, the last step's,
    as Megatron's. `window`: {steps: the train.Steps since the last line, t: when they started, moe_load}."""
    a, steps = run.args, window["steps"]
    dt = time.time() - window["t"]
    finite = [s.loss for s in steps if math.isfinite(s.loss)]  # a skipped NaN step's loss is not averaged
    work = [batch_work(run, s.samples) for s in steps]  # [(tokens, FLOPs)]
    rec = dict(iteration=n, loss=sum(finite) / len(finite) if finite else float("nan"), lr=lr,
               grad_norm=steps[-1].grad_norm, tokens_per_s=sum(t for t, _ in work) / dt,
               skipped=sum(s.skipped for s in steps), consumed_samples=run.progress.consumed_samples)
    if a.rampup_batch_size is not None:
        rec["global_batch_size"] = steps[-1].samples
    rec.update(throughput(sum(f for _, f in work), dt, a.world_size, run.device, a.bf16 or a.fp16))
    if a.decoupled_lr is not None:
        rec["decoupled_lr"] = run.optimizer.decoupled_lr
    if a.fp16:
        rec["loss_scale"] = run.scaler.scale
    if window["moe_load"] is not None:
        rec.update(P.moe_metrics(run.model, window["moe_load"]))
    rec.update(module_losses(run.model))  # losses a module logs itself (MTP's per depth): every rank calls it
    rec.update(run.task.metrics() if run.task is not None else {})  # dpo, kto, rm (a collective too)
    return rec


def random_start(run) -> bool:
    """A post-training task with no checkpoint to start from: it trains a randomly initialized model."""
    return run.args.task != "pretrain" and run.start.base is None and run.start.resume is None


def checkpoint_bytes(run_dir) -> int:
    """Bytes of the checkpoints (iter_*/ directories) in a run directory."""
    return sum(f.stat().st_size for d in Path(run_dir).glob("iter_*") for f in d.rglob("*") if f.is_file())


def say_done(run, n: int, secs: float, samples: int, signaled: str | None):
    """Rank 0's closing lines, once the loop ended after iteration n: the iterations this process ran, its tokens/s
    over the `samples` samples it consumed (evaluation and saving included), where the metrics are; and when a signal
    stopped it, what was saved and how to resume."""
    if run.rank != 0:
        return
    a, tokens = run.args, batch_work(run, samples)[0]
    scores = ", ".join(f"{k.removeprefix('val_').replace('_', ' ')} {v:.3f}" for k, v in run.log.last_eval.items()
                       if k.endswith("accuracy"))  # a preference task's (dpo, rm): how often it ranks the pair right
    disk = f"; checkpoints {checkpoint_bytes(a.save) / 2**20:,.1f} MiB on disk" if a.save else ""
    print(f"done: {max(0, n - run.first)} iterations in {secs:.0f} s ({tokens / secs:.0f} tokens/s with evaluation "
          f"and saving){f'; validation {scores}' if scores else ''}; "
          + (f"metrics, tensorboard/ and loss.png in {run.log.dir}" if run.log.dir else "no --save: no files written")
          + (f" (TensorBoard: {a.tensorboard_dir})" if a.tensorboard_dir else "") + disk
          + (f"; note: --task {a.task} trained from random weights" if random_start(run) else ""), flush=True)
    if signaled:
        print(f"{signaled} after iteration {n}: " + (f"saved {a.save}/iter_{n:07d}; to resume, run the same command"
              + ("" if a.load == a.save else f" with --load {a.save}") if a.save else
              "no --save was given, so nothing is saved"), flush=True)


def nonfinite(loss: float, grad_norm: float, overflow: bool, scaler) -> list[str]:
    """What is wrong with a step, as phrases for the error line: a non-finite loss, a non-finite gradient norm (not
    when fp16's scaler found the overflow and skips the step itself), fp16 stuck at its minimum scale."""
    bad = [f"{k} is {v}" for k, v in (("the loss", loss), ("the gradient norm", grad_norm))
           if not math.isfinite(v) and not (overflow and k == "the gradient norm")]
    if scaler.enabled and scaler.stuck >= scaler.window:
        bad.append(f"fp16: {scaler.stuck} steps in a row overflowed at --min-loss-scale={scaler.min} "
                   f"(--loss-scale-window={scaler.window})")
    return bad


def first_nonfinite_grad(model, rank) -> str:
    """', first non-finite gradient on this rank: NAME', or '' (local: no collective, so any rank may ask)."""
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", p.grad)  # DDP: the fp32 buffer view
        if g is not None and not bool(torch.isfinite(g).all()):
            name = name.split(".", 1)[1] if len(model) == 1 else f"chunk {name}"  # (the ModuleList's index)
            return f" (first non-finite gradient on rank {rank}: {name})"
    return ""


class Logger:
    """Rank 0's metrics.jsonl, TensorBoard events (`tensorboard_dir`, default RUN/tensorboard: Megatron's
    --tensorboard-dir), progress bar and loss.png."""

    def __init__(self, run_dir, rank, start, total, resume, tensorboard_dir=None):
        self.on, self.last_eval = rank == 0, {}
        self.dir = Path(run_dir) if run_dir else None  # no --save: nothing written (--tensorboard-dir's events aside)
        tb = tensorboard_dir or (self.dir / "tensorboard" if self.dir else None)
        self.tensorboard_dir = Path(tb) if tb else None  # (every rank: profiler traces)
        self.path = self.tb = None
        if not self.on:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.path = self.dir / "metrics.jsonl"
            old = self.path.read_text().splitlines() if resume and self.path.exists() else []
            keep = [line for line in old if json.loads(line)["iteration"] <= start]  # drop lines past the checkpoint
            self.path.write_text("".join(line + "\n" for line in keep))
        if self.tensorboard_dir:
            self.tb = SummaryWriter(str(self.tensorboard_dir), purge_step=start + 1)
        self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, mininterval=1.0)

    def log(self, rec):
        if not self.on:
            return
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        for k, v in rec.items() if self.tb else ():
            if k != "iteration" and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, rec["iteration"])
        if "val_loss" in rec:
            self.last_eval = rec
            more = "".join(f", {k.removeprefix('val_').replace('_', ' ')} {rec[k]:.4f}" for k in rec
                           if k == "val_reward" or k.startswith("val_") and k.endswith("accuracy"))
            self.bar.write(f"iteration {rec['iteration']}: validation loss {rec['val_loss']:.4f}{more}")
        elif "test_loss" in rec:  # once, when training has ended (a --split with a test part)
            self.bar.write(f"iteration {rec['iteration']}: test loss {rec['test_loss']:.4f}")
        else:
            more = {k: f"{rec[k]:.3g}" for k in ("tflops", "mfu", "reward", "kl", "accuracy", "preference_accuracy")
                    if k in rec}  # (reward, kl: posttraining/rl.py; the accuracies: dpo's and rm's, recipes.py)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", gnorm=f"{rec['grad_norm']:.3f}",
                                 tok_s=f"{rec['tokens_per_s']:.0f}", **more)

    def close(self):
        if not self.on:
            return
        self.bar.close()
        if self.tb:
            self.tb.close()
        if not self.path:
            return
        recs = [json.loads(line) for line in self.path.read_text().splitlines()]
        from matplotlib.figure import Figure  # (no pyplot: no global figure state, no GUI backend)
        from matplotlib.ticker import MaxNLocator
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        tr = [r for r in recs if "loss" in r]
        va = [r for r in recs if "val_loss" in r]
        ax.plot([r["iteration"] for r in tr], [r["loss"] for r in tr], label="train")
        ax.plot([r["iteration"] for r in va], [r["val_loss"] for r in va], "o-", label="validation")
        ax.set(xlabel="iteration", ylabel="loss (nats/token)", title=str(self.dir))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # (whole iterations: a short run's axis is not 0.25 apart)
        ax.legend()
        fig.savefig(self.dir / "loss.png", dpi=100, pil_kwargs={"compress_level": 1})  # (the default margins and fast
        # compression: a tight bounding box draws the figure twice, and zlib's level 6 took 8 of its ~55 ms)


class Profiler:
    """Megatron's --profile (with its --use-pytorch-profiler): torch.profiler records iterations [--profile-step-start,
    --profile-step-end) (0-based, as Megatron counts the iterations done) on the ranks in --profile-ranks and writes
    each rank's trace into `trace_dir`, the TensorBoard directory, as Megatron's tensorboard_trace_handler does."""

    def __init__(self, args, rank: int, trace_dir: Path):
        self.on, self.prof = args.profile and rank in args.profile_ranks, None
        self.start, self.end, self.dir = args.profile_step_start, args.profile_step_end, trace_dir

    def step(self, it: int):  # before iteration it
        if self.on and it == self.start:
            self.prof = torch.profiler.profile(on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.dir)),
                                               record_shapes=True)
            self.prof.start()
        elif it == self.end:
            self.stop()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
