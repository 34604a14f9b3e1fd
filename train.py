"""train.py — the training loop: data -> batches -> forward/backward -> optimizer step, evaluation, logging, saving.

Mirrors Megatron-LM's megatron/training/training.py (pretrain, train_step: gradient accumulation, clipping, the
optimizer step, evaluation). Like nanoGPT's train.py: one flat loop you can read. Read it top to bottom: `setup`
builds everything a run is made of into one `Run`, `train` is the loop, `train_step` one iteration, `evaluate` the
validation pass. The flags live in arguments.py (megatron/training/arguments.py), a model file's hooks and the --task
modules (config.TASKS, posttraining/) in config.py, checkpoints in checkpoint.py (checkpointing.py), the optimizers
(plain and distributed, one interface) in parallel.py section 9, the learning rate, loss scale and stop conditions in
scheduler.py, the log lines in metrics.py; tools.py samples, merges, exports and scores a saved run.

    make train MODEL=gpt                                       # the default run: its schedule fitted to 8 minutes
    python train.py --save runs/gpt --exit-duration-in-mins 8  # the same, without make
    python train.py --train-iters 50 --num-layers 2 --save runs/tiny --data-path my.jsonl --json-keys text
    torchrun --nproc_per_node 2 train.py --tensor-model-parallel-size 2 --sequence-parallel --save runs/tp2
    torchrun --nproc_per_node 2 train.py --save runs/dp2       # DP = world / (TP x PP) = 2
    python train.py --load runs/gpt --save runs/gpt --train-iters 2000   # resume (any TP layout)

Everything is validated (flags, layout, data, tokenizer) before any process group is made, and bad input ends with
one line `train.py: error: ...` (under torchrun the ranks agree on it, and rank 0 says it). Data order depends only on
(seed, samples consumed): each DP rank slices the same global batch.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import data
import parallel as P
from arguments import Args, ConfigError, check_args, model_config, notes, parse_args, print_args, transformer_impl
from config import ModelFile, model_file, task_module
from interop import tokenizer_files
from metrics import Logger, Profiler, first_nonfinite_grad, nonfinite, say_done, training_log
from scheduler import ExitSignals, LossScaler, TimeFit, agree_to_stop, batch_size, learning_rate, set_learning_rates


# ============================================================================================================
# 1. The optimizer: parallel.py section 9's, as the flags ask (its learning rates: scheduler.set_learning_rates)
# ============================================================================================================
def make_optimizer(chunks, grid, args):
    """AdamW without weight decay on biases and norm weights (--optimizer muon: Muon for the hidden matrices, AdamW for
    the rest): parallel.Optimizer / Muon (whole parameters, the plain DP sum), or with --use-distributed-optimizer /
    --overlap-grad-reduce parallel.DistributedOptimizer / DistributedMuon over parallel.DDP's bucketed gradients (the
    same arithmetic, the state sharded over DP), with --use-megatron-fsdp's optim_grads / optim_grads_params over
    parallel.FSDP's (ZeRO-2 / ZeRO-3); --use-torch-fsdp2: parallel.TorchFSDP2 (torch's fully_shard, its DTensor
    parameters stepped by torch's AdamW). One interface: the loop never asks which."""
    adam = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay,
                decoupled_lr=args.decoupled_lr)
    muon = dict(momentum=args.muon_momentum, nesterov=args.muon_use_nesterov, ns_steps=args.muon_num_ns_steps,
                scale=args.muon_matched_adamw_rms, precision=args.muon_fp32_matmul_prec)
    if args.use_ddp:  # (--decoupled-lr: those parameters in buckets of their own, each bucket stepping at one lr)
        own = (lambda p: getattr(p, "is_embedding_or_output_parameter", False)) if args.decoupled_lr is not None \
            else (lambda p: False)
        ddp = P.FSDP(chunks, grid, args.data_parallel_sharding_strategy) if args.use_fsdp else \
            P.DDP(chunks, grid, bucket_size=args.ddp_bucket_size, overlap=args.overlap_grad_reduce,
                  distributed_optimizer=args.use_distributed_optimizer, own_bucket=own)
        if args.optimizer == "muon":
            return P.optimizer_over(ddp, P.DistributedMuon, **muon, **adam)
        return P.optimizer_over(ddp, P.DistributedOptimizer, **adam)
    if args.optimizer == "muon":
        return P.Muon(chunks, grid, **muon, **adam)
    return (P.TorchFSDP2 if args.use_torch_fsdp2 else P.Optimizer)(chunks, grid, **adam)


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
    task: object | None  # a post-training task's Task (config.py's task contract): its batches, metrics; None: pretraining
    reference_base: dict | None  # dpo, kto: the checkpoint of the frozen reference model (checkpoint.pointer_to)
    p2p_shape: tuple  # [s/cp(/tp), b, h]: what pipeline stages send each other
    autocast: Callable  # bf16/fp16 autocast, or a no-op
    first: int  # the first iteration: 0, or the resumed checkpoint's
    progress: Progress  # where the run is: iteration, samples consumed, the schedule's steps (train_step advances it)
    fit: TimeFit  # the schedule's length: the flags', or fitted to --exit-duration-in-mins (its .args: the schedule's)
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
    starts from. Nothing above the marked line makes a process group: every rank checks the same input, and a rank
    that failed there joins the agreement below it (main), so bad input stops every rank alike, at once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = check_args(args, world)
    say = int(os.environ.get("RANK", "0")) == 0 and not args.check_only
    for line in notes(args) if say else []:  # Megatron flags: what runs instead
        print(line, flush=True)
    mf = model_file(args.model)
    start = checkpoint.plan_start(args)  # verified checkpoints; refuses a missing --load, an overwrite
    if say and args.task != "pretrain" and start.base is None and start.resume is None:
        print(f"note: --task {args.task} starts from random weights: no --pretrained-checkpoint RUN (or --finetune "
              "--load RUN) to post-train", flush=True)
    corpus = data.build_data(args, mf.dataset, start.tokenizer_file, start.vocab_size, samples=args.task == "pretrain")
    tasks = task_module(args.task)  # a post-training task's module (config.TASKS); None: pretraining
    if tasks is not None:  # the task's samples (posttraining/recipes.py section 1, rl.py's prompts)
        train_ds, valid_ds = tasks.build_task_datasets(args, corpus.tokenizer)
        corpus = dataclasses.replace(corpus, train=train_ds, valid=valid_ds)
    config = model_config(mf, args, corpus.vocab_size, corpus.tokenizer)
    checkpoint.check_same_model(args, start, mf, corpus.vocab_size)
    fit = TimeFit(args, None if start.resume is None or args.no_load_optim else start.resume.meta)  # (may refuse)
    if args.check_only:  # (make train runs this in one process before torchrun starts the ranks)
        raise SystemExit(0)
    # ---- nothing above made a process group; everything below may
    keep_freed_memory()
    device = P.init_distributed(world, args.distributed_backend, args.distributed_timeout_minutes)
    if world > 1 and (error := P.agree_on_error(None)) is not None:  # another rank failed above: stop with it
        raise ConfigError(error)
    mesh, tp, pp, dp = None, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    cp = args.context_parallel_size
    if world > 1:
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh(device.type, torch.arange(world).view(pp, dp * cp, tp), mesh_dim_names=("pp", "dp_cp", "tp"))
        mesh = mesh["dp_cp", "tp"]  # this stage's ranks: shards over tp, replicated over dp x cp (the Grid's order)
    rank = dist.get_rank() if dist.is_initialized() else 0
    grid = P.Grid(tp=tp, pp=pp, dp=dp, cp=cp, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    make = lambda pre, post, offset, n: mf.Model(  # this rank's pipeline stage (v chunks of it interleaved)
        config, grid, pre_process=pre, post_process=post, layer_offset=offset, num_layers=n).to(device)
    build = lambda: P.build_chunks(make, config.num_layers, grid, args.virtual_pipeline_model_parallel_size,
                                   stages=config.stage_layers)
    chunks = build()
    checkpoint.add_adapters(chunks, args)  # LoRA (--lora-rank): the model frozen, adapters on its linears
    # a task's additions: a value head on the last stage, the frozen reference (and reward) models beside the policy
    frozen, reference_base = tasks.setup_task(args, start, chunks, build, mesh) if tasks else (None, None)
    model = torch.nn.ModuleList(chunks)
    recipe = P.FP8Recipe(args.fp8_format or "hybrid", args.fp8_recipe, args.fp8_margin, args.fp8_amax_history_len,
                         args.fp8_amax_compute_algo)
    fp8 = P.fp8_enable(model, recipe, grid, transformer_impl(args)) if args.fp8 else None
    if fp8 is not None and args.num_experts and rank == 0:
        print("note: --fp8 covers the attention and MLP linears; the routed MoE experts keep the parameters' dtype")
    optimizer, scaler = make_optimizer(chunks, grid, args), LossScaler(args)
    progress = Progress(*checkpoint.load_start(args, start, chunks, optimizer, scaler, mesh, fp8, rank, fit.note))
    first = progress.iteration
    s_local = args.seq_length // cp  # [s/cp(/tp), b, h] between pipeline stages
    p2p_shape = (s_local // tp if config.sequence_parallel and tp > 1 else s_local, args.micro_batch_size,
                 config.hidden_size)
    amp = torch.bfloat16 if args.bf16 else torch.float16
    autocast = lambda: torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16)
    task = None if tasks is None else tasks.Task(  # post-training (recipes.py section 2, rl.py)
        args, chunks, grid, p2p_shape, config.params_dtype, corpus.eod, device, autocast, frozen, corpus=corpus,
        iteration=first)
    if rank == 0:
        print_args(args, f"rank 0 holds {sum(p.numel() for p in model.parameters()):,} parameters; {grid}; "
                   f"{len(corpus.train)} train samples of {args.seq_length} tokens, "
                   f"{len(corpus.valid) if corpus.valid else 0} valid"
                   + (f", {len(corpus.test)} test" if corpus.test else "") + f"; device {device}")
    if rank == 0 and args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        tokenizer_files.save_tokenizer(corpus.tokenizer, Path(args.save) / "tokenizer.json")  # (with its roles, if not ours)
    log = Logger(args.save, rank, first, fit.train_iters, resume=start.continues,  # keeps lines <= first
                 tensorboard_dir=args.tensorboard_dir)
    return Run(args, mf, start, corpus, config, grid, chunks, model, mesh, device, rank, optimizer, scaler, fp8, task,
               reference_base, p2p_shape, autocast, first, progress, fit, log)


# ============================================================================================================
# 3. One iteration, and evaluation
# ============================================================================================================
def prepare(run: Run, batch, split="train"):
    """One global batch -> (this DP rank's micro-batches, loss_func(model, mb) -> the SUM of its losses, the global
    count that divides it, the pipeline's p2p shape): the model file's batch_recipe, or a post-training task's
    (its Task: the reference model's passes run here; a pair is 2 sequences in the p2p shape's batch dim)."""
    if run.task is not None:
        return run.task.prepare(batch, split)
    recipe, count = run.mf.batch_recipe(batch, run.args, run.corpus)
    micro = list(batch.chunk(run.grid.dp_size)[run.grid.dp.rank].to(run.device).split(run.args.micro_batch_size))
    return micro, recipe, count, run.p2p_shape  # num_micro_batches x [mbs, s+1]


def stage_step(model, mb, recipe, autocast=contextlib.nullcontext):
    """The schedule's contract: the SUM of the micro-batch's token losses on the last stage; on any other pipeline
    stage the stage's output hidden states, which the recipe returns as the model gave them (config.py's batch_recipe
    contract): an inner stage computes only what it sends on."""
    with autocast():
        return recipe(model, mb)


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss or gradient): main prints it as one line and exits with 2."""


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
    gbs = batch_size(progress.consumed_samples, a.global_batch_size, a.rampup_batch_size)  # (the ramp-up's, if any)
    batch = data.global_batch(run.corpus.train, start=progress.consumed_samples, size=gbs)  # [gbs, s+1] (a task's:
    micro_batches, recipe, num_tokens, shape = prepare(run, batch)  # [gbs, R, s+1]); num_tokens: the global batch's
    set_learning_rates(run.optimizer, progress.lr_steps, run.fit.args)
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
def train(args) -> Run:
    run = setup(args)
    a, log = run.args, run.log
    t0, signals, consumed = time.time(), ExitSignals(a.exit_signal_handler), run.progress.consumed_samples
    if a.manual_gc:  # Megatron's --manual-gc: no automatic collection; loop() collects at set points
        gc.disable()
        gc.collect()
    try:
        n, signaled = loop(run, t0, signals)
    except BaseException:
        if run.rank == 0:
            log.bar.close()  # its line ends: the error that stopped the loop is printed on a line of its own
        raise
    finally:
        signals.restore()  # (also when the loop raises: a rank that must die on torchrun's SIGTERM then does)
        if a.manual_gc:
            gc.enable()
    if run.corpus.test is not None and a.eval_iters > 0 and n == run.fit.train_iters and not signaled:
        log.log(dict(iteration=n, **evaluate(run, "test")))  # Megatron's test evaluation once training has ended
    log.close()
    say_done(run, n, time.time() - t0, run.progress.consumed_samples - consumed, signaled)
    return run


def loop(run: Run, t0: float, signals: ExitSignals):
    """The iterations: a step, its log line, the stop conditions, evaluation, saving. Returns (the iterations done,
    the name of the signal that stopped it or None)."""
    a, log = run.args, run.log
    window, n, signaled = dict(steps=[], t=t0, moe_load=None), run.first, None  # the steps since the last log line
    profiler = Profiler(a, run.rank, log.tensorboard_dir)
    for it in range(run.first, run.fit.train_iters):
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
        late, signaled, elapsed = agree_to_stop(t0, a.exit_duration_in_mins, signals)
        if run.fit.after_step(n, elapsed, n - run.first) and run.rank == 0:  # a fitted run's cool-down starts
            log.bar.write(run.fit.said(n))
            log.bar.total = run.fit.train_iters
        last = n == run.fit.train_iters
        if n % a.log_interval == 0 or last:
            log.log(training_log(run, n, window, learning_rate(run.progress.lr_steps, run.fit.args)))
            window = dict(steps=[], t=time.time(), moe_load=None)
        stop = (a.exit_interval is not None and n % a.exit_interval == 0) or (late and not last) or signaled is not None
        if late and not last and run.rank == 0:
            log.bar.write(f"--exit-duration-in-mins={a.exit_duration_in_mins} reached: stopping at {n}")
        if run.corpus.valid is not None and a.eval_iters > 0 and not signaled and (
                (a.eval_interval and n % a.eval_interval == 0) or last or stop):
            if a.manual_gc and a.manual_gc_eval:
                gc.collect()
            log.log(dict(iteration=n, **evaluate(run)))
            if a.manual_gc and a.manual_gc_eval:
                gc.collect(generation=0)  # what evaluation made (Megatron's)
        if a.save and ((a.save_interval and n % a.save_interval == 0) or last or stop):
            checkpoint.save_checkpoint(a.save, n, run.chunks, run.optimizer, run.scaler, run.mesh, run.settings,
                                       run.start.lora_base, progress=dict(
                                           consumed_train_samples=run.progress.consumed_samples,
                                           opt_param_scheduler=dict(num_steps=run.progress.lr_steps, **run.fit.state())),
                                       keep=a.keep_last_checkpoints)
        if stop or last:
            break
        window["t"] += time.time() - t_end  # tokens/s counts training time only, not evaluation or saving
    profiler.stop()
    return n, signaled


def parse(argv):
    """The flags, with the model's shape taken from the checkpoint the run resumes or starts from unless given
    (checkpoint.saved_flags; Megatron's --use-checkpoint-args): arguments.resolve's layer 5."""
    return parse_args(argv, saved=checkpoint.saved_flags)


# What main says in one line `train.py: error: ...` (exit 2): bad input (interop's ExportError and LoRA's LoRAError
# are ConfigErrors), or a run that cannot go on (or cannot save)
ERRORS = (ConfigError, data.DataError, TrainingError, checkpoint.SaveError)


def report(error: Exception):
    """Say `train.py: error: ...` once (rank 0) and exit 2 on every rank, without guessing at time: under torchrun the
    ranks agree first. An error found before the process group exists (flags, layout, data: every rank checks the same
    input) — the rank makes the group here and hands its error to the agreement that the ranks without one join in
    setup; one found after it, every rank meets at once (the same flags; the non-finite check on values reduced over
    ranks). A barrier then holds every rank until rank 0 has said it (torchrun stops the others when one exits)."""
    message, world = str(error), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized() and "MASTER_ADDR" in os.environ:  # (no address: no one to agree with)
        P.init_distributed(world)
        message = P.agree_on_error(message)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()
    raise SystemExit(2) from None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        train(parse(argv))
    except ERRORS as e:
        report(e)
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
