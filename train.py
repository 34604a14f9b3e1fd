"""train.py — the training loop: data -> batches -> forward/backward -> optimizer step, evaluation, logging, saving.

Mirrors Megatron-LM's megatron/training/training.py (pretrain, train_step: gradient accumulation, clipping, the
optimizer step, evaluation) and optimizer/grad_scaler.py (dynamic loss scaling). Like nanoGPT's train.py: one flat
loop you can read. Read it top to bottom: `setup` builds everything a run is made of into one `Run`, `train` is the
loop, `train_step` one iteration, `evaluate` the validation pass. The flags live in arguments.py
(megatron/training/arguments.py), a model file's hooks in config.py, checkpoints in checkpoint.py
(checkpointing.py), the optimizers (plain and distributed, one interface) in parallel.py section 9, the post-training
tasks in posttraining/recipes.py; tools.py samples, merges, exports and scores a saved run.

    make train MODEL=gpt                                       # the default run below: ~7.5 min on 2 CPU cores
    python train.py --save runs/gpt                            # the same, without make
    python train.py --train-iters 50 --num-layers 2 --save runs/tiny --data-path my.jsonl --json-keys text
    torchrun --nproc_per_node 2 train.py --tensor-model-parallel-size 2 --sequence-parallel --save runs/tp2
    torchrun --nproc_per_node 2 train.py --save runs/dp2       # DP = world / (TP x PP) = 2
    python train.py --load runs/gpt --save runs/gpt --train-iters 2000   # resume (any TP layout)

Everything is validated (flags, layout, data, tokenizer) before any process group is made, and bad input ends with
one line `train.py: error: ...`. Data order depends only on (seed, samples consumed): each DP rank slices the same
global batch.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import data
import parallel as P
from arguments import Args, ConfigError, check_args, model_config, notes, parse_args, print_args, transformer_impl
from config import ModelFile, model_file
from interop import convert, tokenizer_files
from metrics import Logger, Profiler, module_losses, throughput
from posttraining import lora, recipes, rl
from scheduler import batch_size, learning_rate


# ============================================================================================================
# 1. Optimizer pieces: the learning rates (scheduler.py's schedule), dynamic loss scaling (the optimizers: parallel.py
#    section 9)
# ============================================================================================================
def set_learning_rates(run):
    """The optimizer's learning rates for the next step: learning_rate at the schedule's steps so far
    (run.progress.lr_steps; a --no-load-optim run's start again from 0, as Megatron's scheduler state is the
    optimizer's), and with --decoupled-lr the same schedule from --decoupled-lr to --decoupled-min-lr (default
    --min-lr) for the word embedding and output layer (Megatron's _update_min_and_max_lr_in_param_groups)."""
    a, step = run.args, run.progress.lr_steps
    run.optimizer.lr = learning_rate(step, a)
    if a.decoupled_lr is not None:
        low = a.min_lr if a.decoupled_min_lr is None else a.decoupled_min_lr
        run.optimizer.decoupled_lr = learning_rate(step, a, a.decoupled_lr, low)


class LossScaler:
    """fp16 dynamic loss scaling (megatron/core/optimizer/grad_scaler.py, hysteresis 1): backward runs on
    loss x scale; a step whose grads hold inf/nan on any rank is skipped and halves the scale; `window` clean steps
    in a row double it. With fp32/bf16 the scale is 1 and nothing is ever skipped. `stuck` counts the skipped steps
    in a row taken at the minimum scale: halving can no longer help (the loop stops after `window` of them)."""

    def __init__(self, args):
        self.enabled, self.window, self.min = args.fp16, args.loss_scale_window, args.min_loss_scale
        self.scale, self.clean, self.stuck = (args.initial_loss_scale if args.fp16 else 1.0), 0, 0

    def unscale_and_check(self, params) -> bool:
        """Divide the grads by the scale; True if any rank found inf/nan (then the step must be skipped)."""
        if not self.enabled:
            return False
        bad = torch.zeros(1)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)
                bad += (~torch.isfinite(p.grad)).any().float().cpu()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        overflow = bool(bad.item() > 0)
        if overflow:
            self.stuck = self.stuck + 1 if self.scale <= self.min else 0
            self.scale, self.clean = max(self.scale / 2, self.min), 0
        else:
            self.clean, self.stuck = self.clean + 1, 0
            if self.clean % self.window == 0:
                self.scale *= 2
        return overflow


def make_optimizer(chunks, grid, args):
    """AdamW without weight decay on biases and norm weights (--optimizer muon: Muon for the hidden matrices, AdamW for
    the rest): parallel.Optimizer / Muon (whole parameters, the plain DP sum), or with --use-distributed-optimizer /
    --overlap-grad-reduce parallel.DistributedOptimizer / DistributedMuon over parallel.DDP's bucketed gradients (the
    same arithmetic, the state sharded over DP). One interface: the loop never asks which."""
    adam = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay,
                decoupled_lr=args.decoupled_lr)
    muon = dict(momentum=args.muon_momentum, nesterov=args.muon_use_nesterov, ns_steps=args.muon_num_ns_steps,
                scale=args.muon_matched_adamw_rms)
    if args.use_ddp:  # (--decoupled-lr: those parameters in buckets of their own, each bucket stepping at one lr)
        own = (lambda p: getattr(p, "is_embedding_or_output_parameter", False)) if args.decoupled_lr is not None \
            else (lambda p: False)
        ddp = P.DDP(chunks, grid, bucket_size=args.ddp_bucket_size, overlap=args.overlap_grad_reduce,
                    distributed_optimizer=args.use_distributed_optimizer, own_bucket=own)
        if args.optimizer == "muon":
            return P.DistributedMuon(ddp, **muon, **adam)
        return P.DistributedOptimizer(ddp, **adam)
    if args.optimizer == "muon":
        return P.Muon(chunks, grid, **muon, **adam)
    return P.Optimizer(chunks, grid, **adam)


# ============================================================================================================
# 2. Setup: everything a run is made of, in one Run
# ============================================================================================================
@dataclasses.dataclass
class Progress:
    """Where a run is, as Megatron counts it and meta.json records it: iterations done, samples consumed (args.
    consumed_train_samples: the next global batch starts there) and the learning-rate schedule's steps (its
    OptimizerParamScheduler's num_steps: the samples of the applied steps; a skipped step does not advance it)."""
    iteration: int = 0
    consumed_samples: int = 0
    lr_steps: int = 0

    def batch_size(self, args) -> int:
        """The global batch size of the next step: --global-batch-size, or the --rampup-batch-size ramp's."""
        return batch_size(self.consumed_samples, args.global_batch_size, args.rampup_batch_size)


@dataclasses.dataclass
class Run:
    """A training run, built complete by setup(); the loop reads it (and steps its optimizer)."""
    args: Args  # the flags, read-only
    mf: ModelFile  # the model file's hooks (config.py)
    start: checkpoint.Start  # what the run resumes, or the weights it starts from
    corpus: data.Corpus  # tokenizer, vocabulary, datasets
    config: object  # the model's Config
    grid: P.Grid
    chunks: list  # this rank's model chunks: its pipeline stage (v of them, interleaved), or the whole model
    model: torch.nn.ModuleList  # all of this rank's parameters, for the optimizer and the audits
    mesh: object  # DCP's device mesh of this stage's ranks (None in one process)
    device: torch.device
    rank: int
    optimizer: object  # parallel.Optimizer or DistributedOptimizer
    scaler: LossScaler
    fp8: object  # parallel.fp8_enable's scaling state, or None
    task: recipes.Task | None  # a post-training task's recipe, reference passes and metrics; None: pretraining
    reference_base: dict | None  # dpo, kto: the checkpoint of the frozen reference model (checkpoint.pointer_to)
    p2p_shape: tuple  # [s/cp(/tp), b, h]: what pipeline stages send each other
    autocast: Callable  # bf16/fp16 autocast, or a no-op
    first: int  # the first iteration: 0, or the resumed checkpoint's
    progress: Progress  # where the run is: iteration, samples consumed, the schedule's steps (train_step advances it)
    log: Logger

    @property
    def settings(self) -> dict:
        """What a checkpoint records as the run's "args" (meta.json): the flags, with the vocabulary the run found and
        the reference model's checkpoint."""
        return {**vars(self.args), "vocab_size": self.corpus.vocab_size, "reference_base": self.reference_base}


def keep_freed_memory():
    """glibc gives freed blocks over 32 MiB (mmap'd) and its heap's free top back to the kernel, so each step's
    [s, b, V] logits and other large buffers fault in all their pages again: ~19,000 page faults an iteration of
    the default run, 840 with this. mallopt: no mmap under 1 GiB, no trimming under 2 GiB — freed memory is reused,
    the process stays at its peak. glibc (Linux) only; elsewhere this does nothing."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
            libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD


def setup(args) -> Run:
    """Validate everything, then make the process group, the grid, the model and its optimizer, and load what the run
    starts from. Nothing above the marked line makes a process group: bad input fails on every rank alike, at once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = check_args(args, world)
    for line in notes(args) if int(os.environ.get("RANK", "0")) == 0 else []:  # Megatron flags: what runs instead
        print(line, flush=True)
    mf = model_file(args.model)
    start = checkpoint.plan_start(args)  # verified checkpoints; refuses a missing --load, an overwrite
    corpus = data.build_data(args, mf.dataset, start.tokenizer_file, start.vocab_size, samples=args.task == "pretrain")
    tasks = rl if args.task in rl.TASKS else recipes  # online RL (rl.py) or an offline task (recipes.py)
    if args.task != "pretrain":  # post-training: the task's samples (recipes.py section 1, rl.py's prompts)
        train_ds, valid_ds = tasks.build_task_datasets(args, corpus.tokenizer)
        corpus = dataclasses.replace(corpus, train=train_ds, valid=valid_ds)
    config = model_config(mf, args, corpus.vocab_size, corpus.tokenizer)
    checkpoint.check_same_model(args, start, mf, corpus.vocab_size)
    # ---- nothing above made a process group; everything below may
    keep_freed_memory()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    mesh, tp, pp, dp = None, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    cp = args.context_parallel_size
    if world > 1:
        if cuda:
            torch.cuda.set_device(device)
        backend = (args.distributed_backend or "nccl") if cuda else "gloo"  # (nccl asked without CUDA: said once)
        dist.init_process_group(backend, timeout=timedelta(minutes=args.distributed_timeout_minutes))
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh(device.type, torch.arange(world).view(pp, dp * cp, tp), mesh_dim_names=("pp", "dp_cp", "tp"))
        mesh = mesh["dp_cp", "tp"]  # this stage's ranks: shards over tp, replicated over dp x cp (the Grid's order)
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may use (taskset, cgroups)
    rank = dist.get_rank() if dist.is_initialized() else 0
    grid = P.Grid(tp=tp, pp=pp, dp=dp, cp=cp, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    make = lambda pre, post, offset, n: mf.Model(  # this rank's pipeline stage (v chunks of it interleaved)
        config, grid, pre_process=pre, post_process=post, layer_offset=offset, num_layers=n).to(device)
    build = lambda: P.build_chunks(make, config.num_layers, grid, args.virtual_pipeline_model_parallel_size,
                                   stages=config.stage_layers)
    chunks = build()
    for c in chunks if args.lora_rank else []:  # LoRA: the model frozen, adapters on its linears (posttraining/lora.py)
        lora.apply_lora(c, args.lora_target_modules, args.lora_rank, args.lora_alpha, args.lora_dropout)
    ref_chunks, reference_base = tasks.setup_task(args, start, chunks, build, mesh)  # value head, reference
    model = torch.nn.ModuleList(chunks)
    recipe = P.FP8Recipe(args.fp8_format or "hybrid", args.fp8_recipe, args.fp8_margin, args.fp8_amax_history_len,
                         args.fp8_amax_compute_algo)
    fp8 = P.fp8_enable(model, recipe, grid, transformer_impl(args)) if args.fp8 else None
    if fp8 is not None and args.num_experts and rank == 0:
        print("note: --fp8 covers the attention and MLP linears; the routed MoE experts keep the parameters' dtype")
    optimizer, scaler = make_optimizer(chunks, grid, args), LossScaler(args)
    progress = load_start(args, start, chunks, optimizer, scaler, mesh, fp8, rank)
    first = progress.iteration
    s_local = args.seq_length // cp  # [s/cp(/tp), b, h] between pipeline stages
    p2p_shape = (s_local // tp if config.sequence_parallel and tp > 1 else s_local, args.micro_batch_size,
                 config.hidden_size)
    amp = torch.bfloat16 if args.bf16 else torch.float16
    autocast = lambda: torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16)
    task = None if args.task == "pretrain" else tasks.Task(  # post-training (recipes.py section 2, rl.py)
        args, chunks, grid, p2p_shape, config.params_dtype, corpus.eod, device, autocast, ref_chunks, corpus=corpus,
        iteration=first)
    if rank == 0:
        print_args(args, f"rank 0 holds {sum(p.numel() for p in model.parameters()):,} parameters; {grid}; "
                   f"{len(corpus.train)} train samples of {args.seq_length} tokens, "
                   f"{len(corpus.valid) if corpus.valid else 0} valid"
                   + (f", {len(corpus.test)} test" if corpus.test else "") + f"; device {device}")
    run_dir = args.save or time.strftime(f"runs/{args.model}-%Y%m%d-%H%M%S")  # no --save: a fresh directory
    if rank == 0 and args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        tokenizer_files.save_tokenizer(corpus.tokenizer, Path(args.save) / "tokenizer.json")  # (with its roles, if not ours)
    log = Logger(run_dir, rank, first, args.train_iters, resume=start.continues,  # keeps lines <= first
                 tensorboard_dir=args.tensorboard_dir)
    return Run(args, mf, start, corpus, config, grid, chunks, model, mesh, device, rank, optimizer, scaler, fp8, task,
               reference_base, p2p_shape, autocast, first, progress, log)


def load_start(args, start, chunks, optimizer, scaler, mesh, fp8, rank) -> Progress:
    """Load what the run starts from (checkpoint.plan_start): the base's weights (--finetune, --pretrained-checkpoint,
    a LoRA run's frozen base), then the checkpoint it resumes. Returns where the run starts (its Progress)."""
    if start.base is not None:  # model weights only: iteration 0, fresh optimizer and RNG (or a LoRA run's base)
        checkpoint.load_weights(start.base, chunks, mesh)
        if rank == 0:
            print(f"model weights from {start.base.path}" + (" (frozen: LoRA adapters train)" if args.lora_rank else ""))
    if start.resume is None:
        if args.load and start.base is None and rank == 0:
            print(f"a new run in {args.load}" if args.load == args.save else
                  f"WARNING: no checkpoint in --load {args.load}; starting from scratch")
        if args.task != "pretrain" and start.base is None and rank == 0:
            print(f"note: --task {args.task} starts from random weights (the seed's initialization); pass "
                  "--pretrained-checkpoint DIR to start from a trained model", flush=True)
        return Progress()
    layout = {k: getattr(args, k) for k in ["world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size"]}
    fp8_args = {k: getattr(args, k) for k in ["fp8", "fp8_format", "fp8_recipe", "fp8_amax_history_len"]}
    first, rng_restored = checkpoint.load_checkpoint(start.resume, chunks, optimizer, scaler, mesh, layout,
                                                     fp8_args if fp8 is not None else None,
                                                     load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
    if rank == 0:
        print(f"resumed from {start.resume.path} at iteration {first}"
              + (" (--no-load-optim: a fresh optimizer, loss scale and learning-rate schedule)" if args.no_load_optim
                 else "") + ("" if rng_restored else " (--no-load-rng: RNG streams from the seed)" if args.no_load_rng
                             else " (different layout: RNG streams not restored)"))
    meta = start.resume.meta  # a checkpoint saved before these were recorded: a constant batch, no skipped step
    consumed = meta.get("consumed_train_samples", first * meta["args"]["global_batch_size"])
    steps = 0 if args.no_load_optim else meta.get("opt_param_scheduler", {}).get("num_steps", consumed)
    return Progress(first, consumed, steps)  # --no-load-optim: Megatron's scheduler starts again (its state is not read)


# ============================================================================================================
# 3. One iteration, and evaluation
# ============================================================================================================
def prepare(run: Run, batch, split="train"):
    """One global batch -> (this DP rank's micro-batches, loss_func(model, mb) -> the SUM of its losses, the global
    count that divides it, the pipeline's p2p shape): the model file's batch_recipe, or a post-training task's
    (recipes.Task: the reference model's passes run here; a pair is 2 sequences in the p2p shape's batch dim)."""
    if run.task is not None:
        return run.task.prepare(batch, split)
    recipe, count = run.mf.batch_recipe(batch, run.args, run.corpus)
    micro = list(batch.chunk(run.grid.dp_size)[run.grid.dp.rank].to(run.device).split(run.args.micro_batch_size))
    return micro, recipe, count, run.p2p_shape  # num_micro_batches x [mbs, s+1]


def stage_step(model, mb, recipe, autocast=contextlib.nullcontext):
    """The schedule's contract: the SUM of the micro-batch's token losses on the last stage; on any other
    pipeline stage the stage's output hidden states. The recipe calls the model once; a forward hook catches an
    inner stage's output (what the recipe then does with it is discarded)."""
    with autocast():
        if model.post_process:
            return recipe(model, mb)
        out = []
        hook = model.register_forward_hook(lambda m, i, o: out.append(o))
        try:
            recipe(model, mb)
        finally:
            hook.remove()
        return out[0]


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient): main prints it as one line and exits with 2."""


def nonfinite(loss: float, grad_norm: float, overflow: bool, scaler: LossScaler) -> list[str]:
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


@dataclasses.dataclass
class Step:
    """What one iteration reports."""
    loss: float  # the global batch's mean loss per unit (DESIGN.md §2), the same on every rank
    grad_norm: float
    skipped: bool  # fp16 overflow, or --skip-nonfinite-steps
    moe_load: torch.Tensor | None  # MoE: tokens per expert [MoE layers, E] routed in this step, over DP
    samples: int  # its global batch size


def train_step(run: Run, it: int) -> Step:
    """Iteration `it` (0-based): one global batch through forward/backward (the pipeline schedule, if any), the
    gradients synchronized, clipped and applied — or, if the loss or the gradients are not finite, not applied.
    The batch is the samples from run.progress.consumed_samples on (its size: the ramp-up's, if any), at the learning
    rate of the schedule's steps so far; then the progress moves on (the schedule only if the step was applied)."""
    a, grid, progress = run.args, run.grid, run.progress
    gbs = progress.batch_size(a)
    batch = data.global_batch(run.corpus.train, start=progress.consumed_samples, size=gbs)  # [gbs, s+1] (a task's:
    micro_batches, recipe, num_tokens, shape = prepare(run, batch)  # [gbs, R, s+1]); num_tokens: the global batch's
    set_learning_rates(run)
    run.optimizer.zero_grad(len(micro_batches))
    trace = [] if a.pipeline_trace and it == run.first else None
    # fp16: backward runs on loss x scale, as sum / (num_tokens / scale), so MoE aux losses are scaled too
    loss = P.forward_backward(run.chunks, micro_batches, lambda m, mb: stage_step(m, mb, recipe, run.autocast),
                              num_tokens / run.scaler.scale, grid, shape, run.config.params_dtype,
                              trace=trace) / run.scaler.scale
    if a.empty_unused_memory_level >= 1 and run.device.type == "cuda":  # Megatron's levels: 1 here, 2 also after
        torch.cuda.empty_cache()  # the optimizer step
    if trace is not None:
        print(f"pipeline trace, rank {run.rank} (stage {grid.pp.rank}): "
              + " ".join(f"{k}{mb}" + (f".{v}" if len(run.chunks) > 1 else "") for k, mb, v in trace), flush=True)
    run.optimizer.finish_grad_sync()  # SP norm grads over TP; tied embedding over stages; sum over DP
    load = P.moe_load(run.model)
    load = None if load is None else P.all_reduce(load.to(run.device), grid.dp).cpu()
    loss = torch.as_tensor(loss, dtype=torch.float64, device=run.device).reshape(1)
    for g in (grid.pp, grid.dp, grid.cp):  # the last stage holds the loss; each DP and CP rank its part of the mean
        loss = P.all_reduce(loss, g)
    overflow = run.scaler.unscale_and_check(run.model.parameters())  # fp16: inf/nan grads on any rank -> skip
    grad_norm = float("nan") if overflow else float(run.optimizer.clip_grad_norm(a.clip_grad))  # each param once
    # ---- non-finite loss or grad norm: stop before the step (so no checkpoint holds it), or skip it. Both values are
    # reduced already (the loss over PP and DP, identical over TP; the norm over the model's ranks, the DP ranks
    # agree), so every rank decides the same and no rank is left waiting in a collective
    bad = nonfinite(float(loss), grad_norm, overflow, run.scaler)
    skipped = overflow
    if bad and a.check_for_nan_in_loss_and_grad:
        if not a.skip_nonfinite_steps:
            run.log.close()  # metrics.jsonl and loss.png up to the last logged iteration
            raise TrainingError(f"iteration {it + 1}: {'; '.join(bad)}" + first_nonfinite_grad(run.model, run.rank)
                                + "; the step is not applied, nothing of it is saved (--skip-nonfinite-steps skips "
                                "such steps instead)")
        skipped = True
    if not skipped:
        run.optimizer.step()
    if a.empty_unused_memory_level >= 2 and run.device.type == "cuda":
        torch.cuda.empty_cache()
    if run.fp8 is not None:  # delayed scaling: this step's amaxes (reduced over TP x DP) -> next step's scales
        run.fp8.discard() if skipped else run.fp8.update()
    progress.iteration, progress.consumed_samples = it + 1, progress.consumed_samples + gbs
    progress.lr_steps += 0 if skipped else gbs  # Megatron's opt_param_scheduler.step(increment=gbs), if applied
    return Step(float(loss), grad_norm, skipped, load, gbs)


@torch.no_grad()
def evaluate(run: Run, split: str = "valid") -> dict:
    """{'val_loss': mean loss per unit over --eval-iters fixed global batches of the validation set (the same ones
    each time), plus the model file's eval_counts(model, mb) -> {name: (hits, total)} as ratios (BERT: MLM accuracy;
    without pipelining), plus a task's validation metrics}. A pipeline evaluates with the forward-only schedule.
    split="test": the same on the test set, each name prefixed test_ (test_loss; Megatron's end-of-training test)."""
    a, chunks, grid, device = run.args, run.chunks, run.grid, run.device
    dataset, prefix = (run.corpus.valid, "") if split == "valid" else (run.corpus.test, "test_")
    for c in chunks:
        c.eval()
    extra = run.mf.eval_counts if grid.pp_size == 1 else None
    total, counts = torch.zeros(1, dtype=torch.float64, device=device), {}
    for k in range(a.eval_iters):
        batch = data.global_batch(dataset, start=k * a.global_batch_size, size=a.global_batch_size)
        micro, recipe, num_tokens, shape = prepare(run, batch, "valid")
        loss = P.forward_backward(chunks, micro, lambda m, mb: stage_step(m, mb, recipe, run.autocast), num_tokens,
                                  grid, shape, run.config.params_dtype, forward_only=True)
        total += torch.as_tensor(loss, dtype=torch.float64, device=device)
        for mb in micro if extra else []:
            for name, hits in extra(chunks[0], mb).items():
                counts[name] = counts.get(name, 0) + torch.tensor(hits, dtype=torch.float64, device=device)
    total = torch.cat([total] + list(counts.values()))
    for g in (grid.pp, grid.dp, grid.cp):  # the last stage holds the loss; each DP and CP rank its part
        total = P.all_reduce(total, g)
    for c in chunks:
        c.train()
    return {"test_loss" if prefix else "val_loss": float(total[0]) / a.eval_iters,
            **{prefix + name: float(total[1 + 2 * i] / total[2 + 2 * i]) for i, name in enumerate(counts)},
            **(run.task.metrics("valid", "val_") if run.task is not None else {})}  # (a collective)


# ============================================================================================================
# 4. The loop
# ============================================================================================================
class ExitSignals:
    """Megatron's --exit-signal-handler, on by default here: SIGINT (Ctrl-C) and SIGTERM (a scheduler's; torchrun
    passes Ctrl-C and its own SIGTERM on to its ranks) only note the signal, so the step in flight finishes and the
    loop stops, saves and says how to resume. The same signal arriving again within a second (a terminal's Ctrl-C
    reaches torchrun's ranks both directly and through torchrun) is the same request; a later one stops at once."""

    def __init__(self, enabled: bool):
        self.signum, self.t, self.old = 0, 0.0, {}
        if enabled and sys.platform != "win32":
            with contextlib.suppress(ValueError):  # (not the main thread: no handlers; the loop runs as before)
                self.old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(self, signum, frame):
        if self.signum and time.time() - self.t > 1.0:
            raise KeyboardInterrupt  # a second request: stop now
        self.signum, self.t = self.signum or signum, self.t or time.time()

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)


def agree_to_stop(t0: float, minutes: float | None, signals: ExitSignals) -> tuple[bool, str | None]:
    """(--exit-duration-in-mins passed, the name of a signal received), as every rank agrees (a MAX over ranks: a rank
    that decided alone would leave the others waiting in a collective)."""
    flags = torch.tensor([float(minutes is not None and time.time() - t0 > 60 * minutes), float(signals.signum)])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0] > 0), signal.Signals(int(flags[1])).name if flags[1] > 0 else None


def batch_work(run: Run, samples: int) -> tuple[int, float]:
    """(tokens, Megatron's model FLOPs) of a global batch of `samples` samples: the sequences the model trains on (a
    pair is 2; a reference model's forward passes are not counted) times --seq-length."""
    seqs = samples * recipes.SEQUENCES.get(run.args.task, 1)
    return seqs * run.args.seq_length, run.mf.flops(run.config, seqs, run.args.seq_length)


def train(args) -> Run:
    run = setup(args)
    a, log = run.args, run.log
    t0, signals, consumed = time.time(), ExitSignals(a.exit_signal_handler), run.progress.consumed_samples
    if a.manual_gc:  # Megatron's --manual-gc: no automatic collection; loop() collects at set points
        gc.disable()
        gc.collect()
    try:
        n, signaled = loop(run, t0, signals)
    finally:
        signals.restore()  # (also when the loop raises: a rank that must die on torchrun's SIGTERM then does)
        if a.manual_gc:
            gc.enable()
    if run.corpus.test is not None and a.eval_iters > 0 and n == a.train_iters and not signaled:
        log.log(dict(iteration=n, **evaluate(run, "test")))  # Megatron's test evaluation once training has ended
    log.close()
    if run.rank == 0:
        secs = time.time() - t0
        done, tokens = max(0, n - run.first), batch_work(run, run.progress.consumed_samples - consumed)[0]
        print(f"done: {done} iterations in {secs:.0f} s ({tokens / secs:.0f} "
              f"tokens/s with evaluation and saving); metrics, tensorboard/ and loss.png in {log.dir}"
              + (f" (TensorBoard: {a.tensorboard_dir})" if a.tensorboard_dir else ""), flush=True)
    if signaled and run.rank == 0:
        print(f"{signaled} after iteration {n}: " + (f"saved {a.save}/iter_{n:07d}; to resume, run the same command"
              + ("" if a.load == a.save else f" with --load {a.save}") if a.save else
              "no --save was given, so nothing is saved"), flush=True)
    return run


def loop(run: Run, t0: float, signals: ExitSignals):
    """The iterations: a step, its log line, the stop conditions, evaluation, saving. Returns (the iterations done,
    the name of the signal that stopped it or None)."""
    a, log = run.args, run.log
    window, n, signaled = dict(steps=[], t=t0, moe_load=None), run.first, None  # the steps since the last log line
    profiler = Profiler(a, run.rank, log.tensorboard_dir)
    for it in range(run.first, a.train_iters):
        profiler.step(it)
        step = train_step(run, it)
        if a.manual_gc and a.manual_gc_interval and (it + 1) % a.manual_gc_interval == 0:
            gc.collect()
        n, t_end = it + 1, time.time()  # n: iterations done (Megatron counts from 1)
        window["steps"].append(step)
        if step.moe_load is not None:
            window["moe_load"] = step.moe_load + (0 if window["moe_load"] is None else window["moe_load"])
        if run.rank == 0:
            log.bar.update(1)
        if n % a.log_interval == 0 or n == a.train_iters:
            log.log(log_record(run, n, window))
            window = dict(steps=[], t=time.time(), moe_load=None)
        stop = a.exit_interval is not None and n % a.exit_interval == 0
        late, signaled = agree_to_stop(t0, a.exit_duration_in_mins, signals)
        if late and n < a.train_iters:
            stop = True
            if run.rank == 0:
                log.bar.write(f"--exit-duration-in-mins={a.exit_duration_in_mins} reached: stopping at {n}")
        stop = stop or signaled is not None
        if run.corpus.valid is not None and a.eval_iters > 0 and not signaled and (
                (a.eval_interval and n % a.eval_interval == 0) or n == a.train_iters or stop):
            if a.manual_gc and a.manual_gc_eval:
                gc.collect()
            log.log(dict(iteration=n, **evaluate(run)))
            if a.manual_gc and a.manual_gc_eval:
                gc.collect(generation=0)  # what evaluation made (Megatron's)
        if a.save and ((a.save_interval and n % a.save_interval == 0) or n == a.train_iters or stop):
            checkpoint.save_checkpoint(a.save, n, run.chunks, run.optimizer, run.scaler, run.mesh, run.settings,
                                       run.start.lora_base, progress=dict(
                                           consumed_train_samples=run.progress.consumed_samples,
                                           opt_param_scheduler=dict(num_steps=run.progress.lr_steps)))
        if stop:
            break
        window["t"] += time.time() - t_end  # tokens/s counts training time only, not evaluation or saving
    profiler.stop()
    return n, signaled


def log_record(run: Run, n: int, window: dict) -> dict:
    """The metrics.jsonl line of the iterations since the last one (a collective: every rank calls it). `lr` is the
    rate Megatron logs: the schedule's after the last step (the next step's); tokens/s and FLOPs count each step's
    own global batch; `consumed_samples` and (with a ramp-up) `global_batch_size`, the last step's, as Megatron's."""
    a, steps = run.args, window["steps"]
    dt = time.time() - window["t"]
    finite = [s.loss for s in steps if math.isfinite(s.loss)]  # a skipped NaN step's loss is not averaged
    work = [batch_work(run, s.samples) for s in steps]  # [(tokens, FLOPs)]
    rec = dict(iteration=n, loss=sum(finite) / len(finite) if finite else float("nan"),
               lr=learning_rate(run.progress.lr_steps, a), grad_norm=steps[-1].grad_norm,
               tokens_per_s=sum(t for t, _ in work) / dt, skipped=sum(s.skipped for s in steps),
               consumed_samples=run.progress.consumed_samples)
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


def parse(argv):
    """The flags, with the model's shape taken from the checkpoint the run resumes or starts from unless given
    (checkpoint.saved_flags; Megatron's --use-checkpoint-args): arguments.resolve's layer 5."""
    return parse_args(argv, saved=checkpoint.saved_flags)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] in (["sample"], ["merge"], ["export"], ["score"]):
            raise ConfigError(f"train.py {argv[0]} is now tools.py {argv[0]} (the same flags)")
        train(parse(argv))
    except (ConfigError, data.DataError, TrainingError, convert.ExportError, lora.LoRAError) as e:
        if int(os.environ.get("RANK", "0")) != 0:  # torchrun: every rank finds the same error and rank 0 says it;
            # when it exits, torchrun stops this rank (which takes seconds on a loaded machine). Still alive: rank 0
            time.sleep(15)  # did not fail, so this one speaks
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # before the loop (or a second Ctrl-C in it): nothing more is saved
        if int(os.environ.get("RANK", "0")) == 0:
            print("train.py: interrupted: stopped at once, nothing more saved (the loop, once running, finishes its "
                  "step and saves on the first Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
