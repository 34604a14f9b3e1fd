"""train.py — the training loop: data -> batches -> forward/backward -> optimizer step, evaluation, logging, saving.

Mirrors Megatron-LM's megatron/training/training.py (pretrain, train_step: gradient accumulation, clipping, the
optimizer step, evaluation) and optimizer/grad_scaler.py (dynamic loss scaling). Like nanoGPT's train.py: one flat
loop you can read. The flags live in arguments.py (megatron/training/arguments.py), checkpoints in checkpoint.py
(checkpointing.py), the optimizers (plain and distributed, one interface) in parallel.py section 9.

    make train MODEL=gpt                                       # the default run below: ~7.5 min on 2 CPU cores
    python train.py --save runs/gpt                            # the same, without make
    python train.py --train-iters 50 --num-layers 2 --save runs/tiny --data-path my.jsonl --json-keys text
    torchrun --nproc_per_node 2 train.py --tensor-model-parallel-size 2 --sequence-parallel --save runs/tp2
    torchrun --nproc_per_node 2 train.py --save runs/dp2       # DP = world / (TP x PP) = 2
    python train.py --load runs/gpt --save runs/gpt --train-iters 2000   # resume (any TP layout)
    python train.py sample --load runs/gpt --prompt "def "     # print generated text

Everything is validated (flags, layout, data, tokenizer) before any process group is made, and bad input ends with
one line `train.py: error: ...`. Data order depends only on (seed, iteration): each DP rank slices the same global batch.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import convert
import data
import lora
import parallel as P
import posttrain
from arguments import ArgumentParser, ConfigError, check_args, model_config, parse_args, print_args
from checkpoint import check_run_dirs, load_checkpoint, load_model, save_checkpoint
from metrics import Logger, flops, module_losses, throughput


# ============================================================================================================
# 1. Data — corpus -> tokenizer -> token cache -> document split -> datasets (data.py does the work)
# ============================================================================================================
def next_token_loss(model, mb, pack=None):
    """The GPT recipe: micro-batch [b, s+1] -> the SUM of its b·s next-token losses (a scalar). With `pack`
    (data.Packing: --reset-position-ids, --reset-attention-mask, --eod-mask-loss) documents packed in a sequence."""
    if pack is None:
        return model(mb[:, :-1], mb[:, 1:]).float().sum()
    mask, loss_mask, position_ids = pack(mb[:, :-1])
    out = model(mb[:, :-1], mb[:, 1:], position_ids=position_ids, mask=mask)  # [b, s] (an inner stage: [s, b, h])
    return (out * loss_mask).sum() if model.post_process else out  # the float32 mask: a sum in >= float32


def prepare(s, batch, args, split="train"):
    """One global batch -> (this DP rank's micro-batches, loss_func(model, mb) -> the SUM of its losses, the global
    count that divides it, the pipeline's p2p shape): pretraining's batch_recipe, or a post-training task's
    (posttrain.Task: the reference model's passes run here; a pair is 2 sequences in the p2p shape's batch dim)."""
    if s["task"] is not None:
        return s["task"].prepare(batch, split)
    recipe, count = batch_recipe(args.model_module, batch, args)
    micro = list(batch.chunk(s["grid"].dp_size)[s["grid"].dp.rank].to(s["device"]).split(args.micro_batch_size))
    return micro, recipe, count, s["p2p_shape"]  # num_micro_batches x [mbs, s+1]


def batch_recipe(module, batch, args):
    """(loss_func(model, mb) -> the SUM of its losses, the global count that divides it) for one global batch.
    A model file may bring batch_recipe(batch) (BERT: divided by the masked tokens) or loss_func(model, mb)."""
    if hasattr(module, "batch_recipe"):
        return module.batch_recipe(batch)
    if (pack := data.Packing.from_args(args)) is not None:  # GPT only (arguments.check_args)
        return functools.partial(next_token_loss, pack=pack), pack.num_loss_tokens(batch)
    return getattr(module, "loss_func", next_token_loss), batch.shape[0] * args.seq_length


# ============================================================================================================
# 2. Optimizer pieces: learning-rate schedule, dynamic loss scaling (the optimizers: parallel.py section 9)
# ============================================================================================================
def learning_rate(it: int, args) -> float:
    """LR for iteration `it` (0-based): linear warmup, then constant / linear / cosine decay to --min-lr
    (megatron/core/optimizer_param_scheduler.py)."""
    warm, decay = args.lr_warmup_iters, args.lr_decay_iters or args.train_iters
    if it < warm:
        return args.lr * (it + 1) / warm
    if it >= decay:
        return args.min_lr
    ratio = (it - warm) / max(1, decay - warm)
    coeff = {"constant": 1.0, "linear": 1.0 - ratio, "cosine": 0.5 * (1.0 + math.cos(math.pi * ratio))}
    return args.min_lr + coeff[args.lr_decay_style] * (args.lr - args.min_lr)


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


# ============================================================================================================
# 3. Training
# ============================================================================================================
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


def setup(args):
    """Validate everything, then make the process group, the grid and the model. Returns a dict of the pieces."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world)
    ckpt, resume = check_run_dirs(args)  # verified checkpoint or None; refuses a missing --load, an overwrite
    # base: weights only (--finetune, --pretrained-checkpoint, a LoRA run's base); sets its tokenizer and vocabulary
    ckpt, base = checkpoint.plan_load(args, ckpt)
    reference = checkpoint.reference_checkpoint(args, ckpt, base)  # dpo, kto: the frozen reference model's weights
    tok, train_ds, valid_ds = data.build_data(args, samples=args.task == "pretrain")
    if args.task != "pretrain":  # post-training: the task's samples (posttrain.py section 1)
        train_ds, valid_ds = posttrain.build_task_datasets(args, tok)
    config = model_config(args.model_module, args)
    checkpoint.check_same_model(args, ckpt, base)
    # ---- nothing above made a process group; everything below may
    keep_freed_memory()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    mesh, tp, pp, dp = None, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    cp = args.context_parallel_size
    if world > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh(device.type, torch.arange(world).view(pp, dp * cp, tp), mesh_dim_names=("pp", "dp_cp", "tp"))
        mesh = mesh["dp_cp", "tp"]  # this stage's ranks: shards over tp, replicated over dp x cp (the Grid's order)
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may use (taskset, cgroups)
    grid = P.Grid(tp=tp, pp=pp, dp=dp, cp=cp, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    make = lambda pre, post, offset, n: args.model_module.Model(  # this rank's pipeline stage (v chunks of it
        config, grid, pre_process=pre, post_process=post, layer_offset=offset, num_layers=n).to(device)  # interleaved)
    build = lambda: ([args.model_module.Model(config, grid).to(device)] if pp == 1 else
                     P.build_chunks(make, config.num_layers, grid, args.virtual_pipeline_model_parallel_size))
    chunks = build()
    for c in chunks if args.lora_rank else []:  # LoRA: the model frozen, adapters on its linears (lora.py)
        lora.apply_lora(c, args.lora_target_modules, args.lora_rank, args.lora_alpha, args.lora_dropout)
    if args.task == "rm":  # a reward model: the value head on the last stage (trainable, with LoRA too)
        posttrain.add_value_heads(chunks)
    ref_chunks = None  # dpo, kto without LoRA: the frozen reference, built like the policy (with LoRA: adapters off)
    if args.task in ("dpo", "kto") and not args.lora_rank:
        ref_chunks = [c.requires_grad_(False) for c in build()]  # the seed's init, or the checkpoint it started from
        if reference is not None:
            checkpoint.load_weights(reference, ref_chunks, mesh)
    model = torch.nn.ModuleList(chunks)  # all of this rank's parameters, for the optimizer and the audits
    model.layout_args = {k: getattr(args, k) for k in ["world_size", "tensor_model_parallel_size",
                                                       "pipeline_model_parallel_size"]}
    return dict(tok=tok, train=train_ds, valid=valid_ds, grid=grid, model=model, chunks=chunks, mesh=mesh, base=base,
                ref_chunks=ref_chunks,
                device=device, ckpt=ckpt, resume=resume, config=config, rank=dist.get_rank() if dist.is_initialized() else 0)


def make_optimizer(chunks, grid, args):
    """AdamW, no weight decay on biases and norm weights: parallel.Optimizer (whole parameters, the plain DP sum), or
    with --use-distributed-optimizer / --overlap-grad-reduce parallel.DistributedOptimizer over parallel.DDP's
    bucketed gradients (the same AdamW, its state sharded over DP). One interface: the loop never asks which."""
    adam = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay)
    if args.use_ddp:
        return P.DistributedOptimizer(P.DDP(chunks, grid, bucket_size=args.ddp_bucket_size, overlap=args.overlap_grad_reduce,
                                            distributed_optimizer=args.use_distributed_optimizer), **adam)
    return P.Optimizer(chunks, grid, **adam)


@torch.no_grad()
def evaluate(s, valid, args, stage_step, autocast):
    """{'val_loss': mean loss per token over --eval-iters fixed global batches of the validation set (the same ones
    each time), plus the model file's eval_counts(model, mb) -> {name: (hits, total)} as ratios (BERT: MLM accuracy;
    without pipelining)}. A pipeline evaluates with the forward-only schedule."""
    chunks, grid, device = s["chunks"], s["grid"], s["device"]
    for c in chunks:
        c.eval()
    extra = getattr(args.model_module, "eval_counts", None) if grid.pp_size == 1 else None
    total, counts = torch.zeros(1, dtype=torch.float64, device=device), {}
    for k in range(args.eval_iters):
        batch = data.global_batch(valid, k, args.global_batch_size)
        micro, recipe, num_tokens, shape = prepare(s, batch, args, "valid")
        with autocast():
            loss = P.forward_backward(chunks, micro, lambda m, mb: stage_step(m, mb, recipe), num_tokens, grid,
                                      shape, s["config"].params_dtype, forward_only=True)
        total += torch.as_tensor(loss, dtype=torch.float64, device=device)
        for mb in micro if extra else []:
            for name, hits in extra(chunks[0], mb).items():
                counts[name] = counts.get(name, 0) + torch.tensor(hits, dtype=torch.float64, device=device)
    total = torch.cat([total] + list(counts.values()))
    for g in (grid.pp, grid.dp, grid.cp):  # the last stage holds the loss; each DP and CP rank its part
        total = P.all_reduce(total, g)
    for c in chunks:
        c.train()
    return dict(val_loss=float(total[0]) / args.eval_iters,
                **{name: float(total[1 + 2 * i] / total[2 + 2 * i]) for i, name in enumerate(counts)},
                **(s["task"].metrics("valid", "val_") if s["task"] is not None else {}))  # (a collective)


def stage_step(model, mb, recipe):
    """The schedule's contract: the SUM of the micro-batch's token losses on the last stage; on any other
    pipeline stage the stage's output hidden states. The recipe calls the model once; a forward hook catches an
    inner stage's output (what the recipe then does with it is discarded)."""
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


def first_nonfinite_grad(model, rank) -> str:
    """', first non-finite gradient on this rank: NAME', or '' (local: no collective, so any rank may ask)."""
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", p.grad)  # DDP: the fp32 buffer view
        if g is not None and not bool(torch.isfinite(g).all()):
            name = name.split(".", 1)[1] if len(model) == 1 else f"chunk {name}"  # (the ModuleList's index)
            return f" (first non-finite gradient on rank {rank}: {name})"
    return ""


def train(args):
    s = setup(args)
    fp8 = P.fp8_enable(s["model"], P.FP8Recipe(args.fp8_format, args.fp8_recipe, args.fp8_margin,
                                               args.fp8_amax_history_len, args.fp8_amax_compute_algo),
                       s["grid"], args.transformer_impl) if args.fp8 else None
    model, chunks, grid, device, rank = s["model"], s["chunks"], s["grid"], s["device"], s["rank"]
    if fp8 is not None and args.num_experts and rank == 0:
        print("note: --fp8 covers the attention and MLP linears; the routed MoE experts keep the parameters' dtype")
    optimizer, scaler = make_optimizer(chunks, grid, args), LossScaler(args)
    tp = args.tensor_model_parallel_size
    s_local = args.seq_length // args.context_parallel_size  # [s/cp(/tp), b, h] between pipeline stages
    s["p2p_shape"] = (s_local // tp if s["config"].sequence_parallel and tp > 1 else s_local,
                      args.micro_batch_size, s["config"].hidden_size)
    start = 0
    if s["base"] is not None:  # model weights only: iteration 0, fresh optimizer and RNG (or a LoRA run's base)
        checkpoint.load_weights(s["base"], chunks, s["mesh"])
        if rank == 0:
            print(f"model weights from {s['base'][0]}" + (" (frozen: LoRA adapters train)" if args.lora_rank else ""))
    if s["ckpt"] is not None:
        start, rng_restored = load_checkpoint(s["ckpt"], chunks, optimizer, scaler, s["mesh"], model.layout_args,
                                              {k: getattr(args, k) for k in ["fp8", "fp8_format", "fp8_recipe",
                                                                             "fp8_amax_history_len"]} if fp8 else None)
        if rank == 0:
            print(f"resumed from {s['ckpt'][0]} at iteration {start}"
                  + ("" if rng_restored else " (different layout: RNG streams not restored)"))
    elif args.load and s["base"] is None and rank == 0:
        print(f"a new run in {args.load}" if args.load == args.save else
              f"WARNING: no checkpoint in --load {args.load}; starting from scratch")
    if rank == 0:
        print_args(args, f"rank 0 holds {sum(p.numel() for p in model.parameters()):,} parameters; {s['grid']}; "
                   f"{len(s['train'])} train samples of {args.seq_length} tokens, "
                   f"{len(s['valid']) if s['valid'] else 0} valid; device {s['device']}")
    run_dir = args.save or time.strftime(f"runs/{args.model}-%Y%m%d-%H%M%S")  # no --save: a fresh directory
    if rank == 0 and args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        s["tok"].save(str(Path(args.save) / "tokenizer.json"))
    log = Logger(run_dir, rank, start, args.train_iters, resume=s["resume"])  # keeps lines <= start of --save's run
    amp = torch.bfloat16 if args.bf16 else torch.float16
    autocast = lambda: torch.autocast(device.type, dtype=amp, enabled=args.bf16 or args.fp16)
    recipe = None  # set per global batch: (loss_func, the count of its loss tokens), see prepare
    s["task"] = None if args.task == "pretrain" else posttrain.Task(  # post-training (posttrain.py section 2)
        args, chunks, grid, s["p2p_shape"], s["config"].params_dtype, device, autocast, s["ref_chunks"])

    def loss_func(model, mb):  # the schedule's contract: see stage_step
        with autocast():
            return stage_step(model, mb, recipe)
    seqs = args.global_batch_size * posttrain.SEQUENCES.get(args.task, 1)  # sequences the model trains on per batch
    tokens_per_batch = seqs * args.seq_length  # (a pair is 2; a reference model's forward passes are not counted)
    flops_per_batch = flops(s["config"], seqs, args.seq_length)  # Megatron's model FLOPs
    params = list(model.parameters())
    t0 = time.time()
    window, it = dict(losses=[], t=t0, skipped=0), start
    for it in range(start, args.train_iters):
        # ---- one global batch; this DP rank's rows; micro-batches (data.global_batch is layout-free)
        batch = data.global_batch(s["train"], it, args.global_batch_size)  # [gbs, s+1] (a task's: [gbs, R, s+1])
        micro_batches, recipe, num_tokens, shape = prepare(s, batch, args)  # num_tokens: the whole global batch's
        optimizer.lr = learning_rate(it, args)
        optimizer.zero_grad(len(micro_batches))
        trace = [] if args.pipeline_trace and it == start else None
        # fp16: backward runs on loss x scale, as sum / (num_tokens / scale), so MoE aux losses are scaled too
        loss = P.forward_backward(chunks, micro_batches, loss_func, num_tokens / scaler.scale, grid, shape,
                                  s["config"].params_dtype, trace=trace) / scaler.scale
        if trace is not None:
            print(f"pipeline trace, rank {rank} (stage {grid.pp.rank}): "
                  + " ".join(f"{k}{mb}" + (f".{v}" if len(chunks) > 1 else "") for k, mb, v in trace), flush=True)
        optimizer.finish_grad_sync()  # SP norm grads over TP; tied embedding over stages; sum over DP
        load = P.moe_load(model)  # MoE: tokens per expert [MoE layers, E] routed in this step, this DP rank
        if load is not None:
            window["moe_load"] = window.get("moe_load", 0) + P.all_reduce(load.to(device), grid.dp).cpu()
        loss = torch.as_tensor(loss, dtype=torch.float64, device=device).reshape(1)
        for g in (grid.pp, grid.dp, grid.cp):  # the last stage holds the loss; each DP and CP rank its part of the mean
            loss = P.all_reduce(loss, g)
        overflow = scaler.unscale_and_check(params)  # fp16: inf/nan grads on any rank -> skip, halve the scale
        grad_norm = float("nan") if overflow else float(optimizer.clip_grad_norm(args.clip_grad))  # each param once
        # ---- non-finite loss or grad norm: stop before the step (so no checkpoint holds it), or skip it. Both values
        # are reduced already (the loss over PP and DP, identical over TP; the norm over the model's ranks, the DP
        # ranks agree), so every rank decides the same and no rank is left waiting in a collective
        bad = [f"{k} is {v}" for k, v in (("the loss", float(loss)), ("the gradient norm", grad_norm))
               if not math.isfinite(v) and not (overflow and k == "the gradient norm")]
        if args.fp16 and scaler.stuck >= scaler.window:
            bad.append(f"fp16: {scaler.stuck} steps in a row overflowed at --min-loss-scale={scaler.min} "
                       f"(--loss-scale-window={scaler.window})")
        skipped = overflow
        if bad and args.check_for_nan_in_loss_and_grad:
            if not args.skip_nonfinite_steps:
                log.close()  # metrics.jsonl and loss.png up to the last logged iteration
                raise TrainingError(f"iteration {it + 1}: {'; '.join(bad)}"
                                    + first_nonfinite_grad(model, rank) + "; the step is not applied, "
                                    "nothing of it is saved (--skip-nonfinite-steps skips such steps instead)")
            skipped = True
        if not skipped:
            optimizer.step()
        if fp8 is not None:  # delayed scaling: this step's amaxes (reduced over TP x DP) -> next step's scales
            fp8.discard() if skipped else fp8.update()
        window["losses"].append(float(loss))
        window["skipped"] += skipped
        n = it + 1  # iterations done (Megatron counts from 1)
        t_end = time.time()
        if rank == 0:
            log.bar.update(1)
        if n % args.log_interval == 0 or n == args.train_iters:
            dt = time.time() - window["t"]
            finite = [x for x in window["losses"] if math.isfinite(x)]  # a skipped NaN step's loss is not averaged
            rec = dict(iteration=n, loss=sum(finite) / len(finite) if finite else float("nan"), lr=learning_rate(it, args),
                       grad_norm=grad_norm, tokens_per_s=len(window["losses"]) * tokens_per_batch / dt,
                       skipped=window["skipped"])
            rec.update(throughput(len(window["losses"]) * flops_per_batch, dt, args.world_size, device, args.bf16 or args.fp16))
            if args.fp16:
                rec["loss_scale"] = scaler.scale
            if "moe_load" in window:
                rec.update(P.moe_metrics(model, window["moe_load"]))
            rec.update(module_losses(model))  # losses a module logs itself (MTP's per depth): every rank calls it
            rec.update(s["task"].metrics() if s["task"] is not None else {})  # dpo, kto, rm (a collective too)
            log.log(rec)
            window = dict(losses=[], t=time.time(), skipped=0)
        stop = args.exit_interval is not None and n % args.exit_interval == 0
        if args.exit_duration_in_mins is not None:  # every rank must agree, or some would wait in a collective
            late = torch.tensor([float(time.time() - t0 > 60 * args.exit_duration_in_mins)])
            if dist.is_initialized():
                dist.all_reduce(late, op=dist.ReduceOp.MAX)
            if late.item() > 0 and n < args.train_iters:
                stop = True
                if rank == 0:
                    log.bar.write(f"--exit-duration-in-mins={args.exit_duration_in_mins} reached: stopping at {n}")
        if s["valid"] is not None and args.eval_iters > 0 and (
                (args.eval_interval and n % args.eval_interval == 0) or n == args.train_iters or stop):
            log.log(dict(iteration=n, **evaluate(s, s["valid"], args, stage_step, autocast)))
        if args.save and ((args.save_interval and n % args.save_interval == 0) or n == args.train_iters or stop):
            save_checkpoint(args, n, chunks, optimizer, scaler, s["mesh"])
        if stop:
            break
        window["t"] += time.time() - t_end  # tokens/s counts training time only, not evaluation or saving
    log.close()
    if rank == 0:
        secs = time.time() - t0
        done = max(0, n - start) if args.train_iters > start else 0
        print(f"done: {done} iterations in {secs:.0f} s ({done * tokens_per_batch / secs:.0f} "
              f"tokens/s with evaluation and saving); metrics, tensorboard/ and loss.png in {run_dir}", flush=True)
    return s


# ============================================================================================================
# 4. Sampling from a saved run (checkpoint.load_model reads it)
# ============================================================================================================
def sample(argv):
    p = ArgumentParser(prog="train.py sample")
    p.add_argument("--load", required=True)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={a.max_new_tokens} must be >= 1")
    if not (a.temperature >= 0 and math.isfinite(a.temperature)):
        raise ConfigError(f"--temperature={a.temperature} must be >= 0 (0 = greedy)")
    if a.top_k < 1:
        raise ConfigError(f"--top-k={a.top_k} must be >= 1")
    model, args, tok, _ = load_model(a.load)
    posttrain.check_generates(args, a.load)
    module = args.model_module
    torch.manual_seed(a.seed)
    if hasattr(module, "sample_text"):  # a model file with its own notion of a sample (T5: fill a masked span)
        text = module.sample_text(model, tok, a.prompt, a.max_new_tokens)
    else:
        ids = torch.tensor([tok.encode(a.prompt).ids])
        out = module.generate(model, ids, a.max_new_tokens, a.temperature, a.top_k, eod=data.special_ids(tok)["eod"])
        text = tok.decode(out[0].tolist())
    print(text)
    return text


def post_training(argv):
    """train.py merge --load RUN --save OUT: a LoRA run's adapters merged into its base, a plain checkpoint;
    train.py export --load RUN --hf-out DIR: a Hugging Face model directory (config.json, model.safetensors)."""
    p = ArgumentParser(prog=f"train.py {argv[0]}")
    p.add_argument("--load", required=True)
    p.add_argument("--save" if argv[0] == "merge" else "--hf-out", required=True)
    a = p.parse_args(argv[1:])
    if argv[0] == "merge":
        return checkpoint.save_merged(a.load, a.save)
    model, args, tok, _ = load_model(a.load)  # a LoRA run: merged
    posttrain.check_generates(args, a.load)
    return convert.save_hf(a.hf_out, *convert.gpt_to_hf(model.config, model.state_dict(), args.model), tok)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["score"]:  # a reward model's reward of each line of a JSON-lines file (posttrain.py)
            return posttrain.score(argv[1:])
        if argv[:1] in (["sample"], ["merge"], ["export"]):
            return sample(argv[1:]) if argv[0] == "sample" else post_training(argv)
        train(parse_args(argv))
    except (ConfigError, data.DataError, TrainingError, convert.ExportError, lora.LoRAError) as e:
        if int(os.environ.get("RANK", "0")) != 0:  # torchrun: every rank finds the same error and rank 0 says it;
            time.sleep(5)  # when it exits, torchrun stops this rank. Still alive: rank 0 did not fail, so this one speaks
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
