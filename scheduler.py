"""scheduler.py — how long a run trains (the flags' length, or one fitted to --exit-duration-in-mins: TimeFit; a
resumed run's: its checkpoint's, resumed_schedule), its learning rate at each step, its global batch during a ramp-up,
fp16's loss scale, and what stops it sooner (a signal, --exit-duration-in-mins).

Mirrors megatron/core/optimizer_param_scheduler.py (OptimizerParamScheduler.get_lr: warmup, then constant / linear /
cosine / inverse-square-root / WSD decay, counted in samples of applied steps), megatron/core/
num_microbatches_calculator.py (RampupBatchsizeNumMicroBatchesCalculator), the schedule rules of Megatron's
validate_args, megatron/core/optimizer/grad_scaler.py (the dynamic loss scale), and megatron/training/
dist_signal_handler.py with training.py's exit checks (the stop all ranks agree on). Its own file because three
places read it and none owns it: arguments.py checks the flags (check_schedule_args), train.py drives the optimizer
and stops with it, tests/test_lr_schedule.py checks it against megatron-core.

    python train.py --lr-decay-style WSD --lr-wsd-decay-iters 100 --save runs/wsd   # hold --lr, anneal at the end
    python train.py --exit-duration-in-mins 8 --save runs/fit   # WSD, its cool-down fitted to the 8 minutes
"""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import time

import torch
import torch.distributed as dist

from config import ConfigError


def batch_size(consumed: int, global_batch_size: int, rampup=None) -> int:
    """The global batch size of the step that starts after `consumed` samples: --global-batch-size, or during
    --rampup-batch-size START INCREMENT SAMPLES, Megatron's ramp (megatron/core/num_microbatches_calculator.py,
    RampupBatchsizeNumMicroBatchesCalculator): START + k x INCREMENT, k the whole number of SAMPLES / n
    samples consumed (n = (global_batch_size - START) / INCREMENT increments), until more than SAMPLES are."""
    if rampup is None:
        return global_batch_size
    start, increment, samples = rampup
    if consumed > samples:
        return global_batch_size
    per_increment = samples / ((global_batch_size - start) // increment)  # a float, as Megatron's
    return start + int(consumed / per_increment) * increment



def schedule_steps(args) -> tuple[float, int, int | None]:
    """(warmup, decay, WSD annealing) steps of the learning-rate schedule, counted in samples as Megatron counts them
    (megatron/training/training.py, get_optimizer_param_scheduler): an iteration-based run's --lr-warmup-iters,
    --lr-decay-iters, --lr-wsd-decay-iters times --global-batch-size; a sample-based run's --lr-warmup-samples,
    --lr-decay-samples, --lr-wsd-decay-samples; --lr-warmup-fraction: that fraction of the decay steps."""
    gbs = args.global_batch_size
    if args.train_samples is None:
        decay, warmup = args.lr_decay_iters * gbs, args.lr_warmup_iters * gbs
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
    else:
        decay, wsd, warmup = args.lr_decay_samples, args.lr_wsd_decay_samples, args.lr_warmup_samples
    return (warmup if args.lr_warmup_fraction is None else args.lr_warmup_fraction * decay), decay, wsd


def learning_rate(num_steps: int, args, peak: float | None = None, minimum: float | None = None) -> float:
    """The learning rate after `num_steps` samples of applied steps (megatron/core/optimizer_param_scheduler.py,
    OptimizerParamScheduler.get_lr; the loop adds each applied step's global batch, so a step uses the rate of the
    samples before it, and the first step --lr-warmup-init): a linear warmup from --lr-warmup-init to --lr, then
    --lr-decay-style down to --min-lr, reached at the decay steps and kept after them. constant stays at --lr;
    inverse-square-root decays as sqrt(warmup / n); WSD holds --lr, then anneals over its last WSD steps
    (--lr-wsd-decay-style). Warmup steps >= decay steps (Megatron asserts they are fewer) warm up, then give --min-lr.
    peak / minimum: another parameter group's --lr / --min-lr on the same schedule (--decoupled-lr)."""
    warmup, decay, wsd = schedule_steps(args)
    top, low, n = args.lr if peak is None else peak, args.min_lr if minimum is None else minimum, num_steps
    if warmup > 0 and n <= warmup:
        return args.lr_warmup_init + (top - args.lr_warmup_init) * float(n) / float(warmup)
    style = args.lr_decay_style
    if style == "constant":
        return top
    if n > decay:
        return low
    if style == "inverse-square-root":
        return max(low, top * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = float(n - warmup) / float(decay - warmup)  # in [0, 1]
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif n <= decay - wsd:  # WSD: stable
        coeff = 1.0
    else:  # WSD: annealing, r in (0, 1]
        r = float(n - (decay - wsd)) / float(wsd)
        coeff = {"linear": lambda: 1.0 - r, "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                 "exponential": lambda: 2.0 * math.pow(0.5, r) - 1.0,
                 "minus_sqrt": lambda: 1.0 - math.sqrt(r)}[args.lr_wsd_decay_style]()
    return low + coeff * (top - low)



def set_learning_rates(optimizer, num_steps: int, args):
    """The optimizer's learning rates for the next step (Megatron's OptimizerParamScheduler.step): learning_rate after
    the schedule's `num_steps` (train.py's progress.lr_steps; a --no-load-optim run's start again from 0, as Megatron's
    scheduler state is the optimizer's), and with --decoupled-lr the same schedule from --decoupled-lr to
    --decoupled-min-lr (default --min-lr) for the word embedding and output layer (Megatron's
    _update_min_and_max_lr_in_param_groups)."""
    optimizer.lr = learning_rate(num_steps, args)
    if args.decoupled_lr is not None:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        optimizer.decoupled_lr = learning_rate(num_steps, args, args.decoupled_lr, low)


# ---------------------------------------------------------------------------------------------- a schedule fitted to the time
COOLDOWN_SHARE = 0.5  # a fitted run's cool-down: the last half of its iterations, annealed linearly
RESERVE = 0.05  # ... planned to end at 95 % of --exit-duration-in-mins (the cool-down's timing noise, the last save)
MEASURED = 10  # iterations a process times before it may predict from them
RECENT = 0.5  # ... at the rate of its later half of them (a host that slows down: the mean would overshoot the time)
SHORTEN = 0.99  # a cool-down predicted to end past 99 % of the time is compressed to end at 95 % of it


def fits_time(args) -> bool:
    """WSD with no --lr-wsd-decay-iters under --exit-duration-in-mins: the cool-down is fitted to the time (TimeFit)."""
    return args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.train_samples is None \
        and args.exit_duration_in_mins is not None


class TimeFit:
    """The schedule's length: the flags' (`args`), or, where fits_time, decided while the run trains. A fitted run
    warms up, then holds --lr (WSD's stable phase, which needs no end) until its predicted length N is reached by
    the cool-down's share: N = min(--train-iters, the iterations done + those the time left holds at the rate of
    the later half of the iterations timed so far); the first step after which N - n <= COOLDOWN_SHARE x N fixes
    --train-iters N and --lr-wsd-decay-iters N - n, exactly Megatron's WSD from there on (annealed linearly unless
    --lr-wsd-decay-style says otherwise). A host fast enough for --train-iters starts the cool-down at its last
    half, whatever the clock says. A host that slows down in the cool-down would be cut by the guard above --min-lr:
    where the cool-down's end, at the slower of that rate and the cool-down's own, falls past SHORTEN of the time, the
    rest is compressed to end at 95 % (shorten: the rate at n kept, the same curve over fewer iterations). The latest
    decision is the checkpoint's (state: Megatron's scheduler names, in samples), so a resumed run keeps it;
    `after_step` is given the time (no clock of its own)."""

    def __init__(self, args, meta: dict | None = None):
        """meta: the resumed checkpoint's meta.json (its schedule: resumed_schedule; its opt_param_scheduler holds the
        decision, state), if any. `note`: a line saying the checkpoint's schedule continues where the flags' differ."""
        saved = (meta or {}).get("opt_param_scheduler", {})
        args, self.fitted, self.note = resumed_schedule(args, meta) if meta else (args, fits_time(args), None)
        self.cap, self.decided, self.times = args.train_iters, not self.fitted or "wsd_decay_steps" in saved, []
        self.since = 0 if self.fitted and self.decided else None  # where the cool-down's timings start
        self.shortened = None  # (N, M) before the last shortening
        self.plan(args, *((saved["lr_decay_steps"] // args.global_batch_size,
                           saved["wsd_decay_steps"] // args.global_batch_size) if self.fitted and self.decided else
                          (args.train_iters, round(COOLDOWN_SHARE * args.train_iters) if self.fitted else None)))
        self.window = self.latest(self.wsd_iters or 0)

    def plan(self, args, train_iters: int, wsd_iters: int | None):
        """The flags the schedule reads (scheduler.learning_rate): a copy of args with the fitted length."""
        self.train_iters, self.wsd_iters = train_iters, wsd_iters
        self.args = args if not self.fitted else type(args)(**{**vars(args), "train_iters": train_iters,
                                                                "lr_decay_iters": train_iters,
                                                                "lr_wsd_decay_iters": wsd_iters})

    def after_step(self, n: int, elapsed: float, timed: int) -> bool:
        """After iteration n (`timed` of them in `elapsed` seconds of this process, the time every rank agreed on):
        True if the cool-down is decided, or shortened, now."""
        warmup = schedule_steps(self.args)[0] / self.args.global_batch_size
        if not self.fitted:
            return False
        self.times.append((timed, elapsed))
        minutes = self.args.exit_duration_in_mins  # (None: a fitted checkpoint resumed without it)
        rate = self.iterations_per_second() if timed >= MEASURED and minutes is not None else None
        if self.decided:
            return rate is not None and self.shorten(n, elapsed, rate)
        if n < warmup:
            return False
        total = self.cap
        if rate is not None:
            total = min(total, n + int((60 * minutes * (1 - RESERVE) - elapsed) * rate))
        if total - n > round(COOLDOWN_SHARE * total):
            return False
        self.decided, self.since, self.window = True, len(self.times), self.latest(total - n)
        self.plan(self.args, n + max(1, total - n), max(1, total - n))
        return True

    def latest(self, cooldown: int) -> int:
        """How many of the latest iterations the cool-down's rate reads: a quarter of the cool-down as decided (not as
        shortened), and at least one evaluation period where the run evaluates, so that an evaluation's pause weighs in
        it as in the run's average (a shorter window read the pause after each evaluation as a slower host)."""
        a = self.args
        evaluating = a.eval_interval if a.eval_iters and a.eval_interval and a.eval_interval < self.cap else 0
        return max(MEASURED, cooldown // 4, evaluating)

    def iterations_per_second(self) -> float:
        """The rate of the later half of the iterations timed (RECENT); in the cool-down, the slower of that and the
        rate of the latest iterations (`latest`), which follows a host that slows down after the decision sooner."""
        def since(i):
            (t0, e0), (t1, e1) = self.times[i], self.times[-1]
            return (t1 - t0) / max(e1 - e0, 1e-9)
        recent = since(int(len(self.times) * RECENT))
        latest = self.since is not None and len(self.times) > self.window  # (in the cool-down)
        return min(recent, since(len(self.times) - 1 - self.window)) if latest else recent

    def shorten(self, n: int, elapsed: float, rate: float) -> bool:
        """In the cool-down: True if its end (at `rate` iterations a second) falls past SHORTEN of the time and the
        rest is compressed now to end at 95 % of it: the rate after n is kept, the same curve runs over fewer steps."""
        limit, left = 60 * self.args.exit_duration_in_mins, self.train_iters - n
        if left <= 1 or elapsed + left / max(rate, 1e-9) <= SHORTEN * limit:
            return False
        fits = max(1, min(left - 1, int((limit * (1 - RESERVE) - elapsed) * rate)))  # iterations the time holds
        self.shortened = (self.train_iters, self.wsd_iters)
        # WSD's annealing fraction after n, (N - n) / M, is kept: M' = M x fits / (N - n), N' = n + fits
        self.plan(self.args, n + fits, max(fits, round(self.wsd_iters * fits / left)))
        return True

    def state(self) -> dict:
        """What a checkpoint records (meta.json's opt_param_scheduler): the decided lengths, in samples as Megatron's
        OptimizerParamScheduler names them; nothing for a run whose flags fix its length or that has not decided."""
        gbs = self.args.global_batch_size
        return dict(lr_decay_steps=self.train_iters * gbs, wsd_decay_steps=self.wsd_iters * gbs) if (
            self.fitted and self.decided) else {}

    def said(self, n: int) -> str:
        """The decision, in one line: the flags that repeat it (a shortened cool-down: what changed)."""
        if self.shortened is not None:
            return (f"the host slowed down: after iteration {n} the cool-down is compressed to end at iteration "
                    f"{self.train_iters} (was {self.shortened[0]}), within --exit-duration-in-mins="
                    f"{self.args.exit_duration_in_mins} (WSD from here as --train-iters {self.train_iters} "
                    f"--lr-wsd-decay-iters {self.wsd_iters}; the checkpoints record it)")
        return (f"the cool-down starts after iteration {n}: {self.wsd_iters} iterations of WSD annealing to iteration "
                f"{self.train_iters}, fitted to --exit-duration-in-mins={self.args.exit_duration_in_mins} "
                f"(--train-iters {self.train_iters} --lr-decay-style WSD --lr-wsd-decay-iters {self.wsd_iters} "
                f"--lr-wsd-decay-style {self.args.lr_wsd_decay_style} repeats it)")


# ---------------------------------------------------------------------------------------------- a resumed schedule
# The flags that make a run's learning-rate schedule (arguments.resolve records which of them a command gave:
# schedule_flags_given). A resumed run continues its checkpoint's schedule (resumed_schedule).
SCHEDULE_FLAGS = ("train_iters", "lr_warmup_iters", "lr", "min_lr", "lr_decay_style", "train_samples", "lr_decay_iters",
                  "lr_decay_samples", "lr_warmup_samples", "lr_warmup_fraction", "lr_warmup_init",
                  "lr_wsd_decay_iters", "lr_wsd_decay_samples", "lr_wsd_decay_style")
FITTED = "fitted to the time"  # a fitted run's lengths before it decides them


def scheduler_values(args, fitted: bool, saved: dict) -> dict:
    """The schedule as Megatron's OptimizerParamScheduler.load_state_dict compares it (its state_dict's names, steps
    in samples), plus WSD's and the warmup's start; a fitted run's lengths: its decision in `saved` (TimeFit.state)."""
    warmup, decay, wsd = schedule_steps(args)
    if fitted:
        decay, wsd = saved.get("lr_decay_steps", FITTED), saved.get("wsd_decay_steps", FITTED)
    is_wsd = args.lr_decay_style == "WSD"
    return dict(lr_decay_style=args.lr_decay_style, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
                lr_warmup_init=args.lr_warmup_init, lr_decay_steps=decay, wsd_decay_steps=wsd if is_wsd else None,
                lr_wsd_decay_style=args.lr_wsd_decay_style if is_wsd else None)


def resumed_schedule(args, meta: dict) -> tuple:
    """(the schedule's flags, fitted to the time, a note or None) of a run resuming checkpoint `meta` (its meta.json):
    Megatron's OptimizerParamScheduler.load_state_dict (_check_and_set) compares the flags' values with the
    checkpoint's. Equal: the flags'. Different: --override-opt_param-scheduler takes the flags'; where the command
    gave no schedule flag (SCHEDULE_FLAGS: make train's resume) or --use-checkpoint-opt_param-scheduler, the
    checkpoint's continues (its flags, its decision), with a note; where the checkpoint's schedule has ended (saved
    at its last iteration), the flags' start the run's extension, with a note; otherwise ConfigError naming both
    values of each (DESIGN.md §8)."""
    then = meta.get("args") or vars(args)  # (a meta.json records them; without: this run's)
    theirs = type(args)(**{**vars(args), **{k: then[k] for k in SCHEDULE_FLAGS if k in then}})
    was_fitted = fits_time(type(args)(**{**vars(theirs), "exit_duration_in_mins": then.get("exit_duration_in_mins")}))
    fitted, saved = fits_time(args), meta.get("opt_param_scheduler", {})
    mine = scheduler_values(args, fitted, saved if was_fitted else {})
    ckpt = scheduler_values(theirs, was_fitted, saved)
    diff = {k: (ckpt[k], mine[k]) for k in ckpt if ckpt[k] != mine[k]}
    if not diff or args.override_opt_param_scheduler:
        return args, fitted, None
    told = ", ".join(f"{k} {a} in the checkpoint, {b} now" for k, (a, b) in diff.items())
    if not vars(args).get("schedule_flags_given") or args.use_checkpoint_opt_param_scheduler:
        return theirs, was_fitted, (f"note: the learning-rate schedule continues the checkpoint's ({told}; "
                                    "--override-opt_param-scheduler takes this command's)")
    length = saved["lr_decay_steps"] // args.global_batch_size if was_fitted and "wsd_decay_steps" in saved else (
        None if was_fitted else theirs.train_iters)
    if length is not None and meta.get("iteration", 0) >= length:
        return args, fitted, (f"note: the checkpoint's learning-rate schedule ended at its iteration {length}: this "
                              f"command's extends the run ({told})")
    raise ConfigError(f"--load {args.load}: its learning-rate schedule differs from this command's ({told}; steps in "
                      "samples): leave the schedule flags out to continue the checkpoint's, or pass "
                      "--override-opt_param-scheduler to take this command's")


def check_schedule_args(args, interleaved: bool) -> tuple:
    """The training length, the learning-rate schedule and the batch-size ramp-up: Megatron's rules (validate_args,
    training.py's update_train_iters, the ramp's calculator in megatron/core/num_microbatches_calculator.py). Returns
    what they derive: (--train-iters: a sample-based run's is Megatron's count, --lr-decay-iters, --lr-decay-samples:
    by default the training length, --lr-wsd-decay-style: by default exponential, linear where TimeFit fits it)."""
    iters, samples, ramp = args.train_iters, args.train_samples, args.rampup_batch_size
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are exclusive: "
                          "take this command's learning-rate schedule or the checkpoint's")
    if iters is not None and samples is not None:
        raise ConfigError(f"--train-iters={iters} and --train-samples={samples} are exclusive: train by iterations "
                          "or by samples")
    wsd = args.lr_wsd_decay_iters if iters is not None else args.lr_wsd_decay_samples
    if iters is not None:  # iteration-based: no sample-based flag
        mixed = {"--lr-decay-samples": args.lr_decay_samples is not None, "--lr-warmup-samples": args.lr_warmup_samples,
                 "--lr-wsd-decay-samples": args.lr_wsd_decay_samples is not None, "--rampup-batch-size": ramp}
        bad = next((f for f, on in mixed.items() if on), None)
        if bad:
            raise ConfigError(f"{bad} is for sample-based training (--train-samples), not with --train-iters={iters}"
                              + (" (Megatron refuses a ramp-up with iteration-based training too)" if ramp else ""))
        decay_iters, decay_samples = (iters if args.lr_decay_iters is None else args.lr_decay_iters), None
    else:  # sample-based: no iteration-based flag
        mixed = {"--lr-decay-iters": args.lr_decay_iters is not None, "--lr-warmup-iters": args.lr_warmup_iters,
                 "--lr-wsd-decay-iters": args.lr_wsd_decay_iters is not None}
        bad = next((f for f, on in mixed.items() if on), None)
        if bad:
            raise ConfigError(f"{bad} is for iteration-based training (--train-iters), not with --train-samples="
                              f"{samples}: use {bad.replace('iters', 'samples')}")
        decay_iters, decay_samples = None, (samples if args.lr_decay_samples is None else args.lr_decay_samples)
    warmup = args.lr_warmup_iters or args.lr_warmup_samples
    if args.lr_warmup_fraction is not None and warmup:
        raise ConfigError(f"--lr-warmup-fraction={args.lr_warmup_fraction} and --lr-warmup-"
                          f"{'iters' if iters is not None else 'samples'}={warmup} are exclusive: give one warmup")
    if args.lr_warmup_init > args.lr:
        raise ConfigError(f"--lr-warmup-init={args.lr_warmup_init} is larger than --lr={args.lr}")
    unit = "iters" if iters is not None else "samples"
    fitted = iters is not None and args.lr_decay_iters is None and args.exit_duration_in_mins is not None
    if args.lr_decay_style == "WSD" and wsd is None and not fitted:  # (fitted: TimeFit)
        raise ConfigError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}: the length of its annealing phase (or, "
                          "with --train-iters as the most it runs, --exit-duration-in-mins to fit it to the time)")
    if args.lr_decay_style != "WSD" and (wsd is not None or args.lr_wsd_decay_style is not None):
        flag = f"--lr-wsd-decay-{unit}" if wsd is not None else "--lr-wsd-decay-style"
        raise ConfigError(f"{flag} acts only with --lr-decay-style WSD (it is {args.lr_decay_style})")
    if ramp is not None:
        check_rampup(args, interleaved)
    if samples is not None:  # Megatron's iteration count: the ramp's steps, then whole global batches
        n = consumed = 0
        while ramp is not None and consumed <= ramp[2] and consumed <= samples:
            consumed, n = consumed + batch_size(consumed, args.global_batch_size, ramp), n + 1
        iters = n + max(0, samples - consumed) // args.global_batch_size
        if iters == 0:
            raise ConfigError(f"--train-samples={samples} is less than one global batch ({args.global_batch_size})")
    fit = args.lr_decay_style == "WSD" and wsd is None  # (TimeFit's: annealed linearly unless a style is given)
    return iters, decay_iters, decay_samples, args.lr_wsd_decay_style or ("linear" if fit else "exponential")


def check_rampup(args, interleaved: bool):
    """--rampup-batch-size START INCREMENT SAMPLES (batch_size): Megatron's checks, and every global batch the
    ramp reaches (up to --train-samples) a whole number of micro-batches per data-parallel rank (a multiple of pp
    under the interleaved schedule), as Megatron checks them step by step, here before the run."""
    (start, increment, samples), gbs = args.rampup_batch_size, args.global_batch_size
    ramp = f"--rampup-batch-size {start} {increment} {samples}"
    if min(start, increment, samples) < 1:
        raise ConfigError(f"{ramp}: START, INCREMENT and SAMPLES must be >= 1")
    if start >= gbs or (gbs - start) % increment:
        raise ConfigError(f"{ramp}: START must be below --global-batch-size={gbs} and INCREMENT must divide the "
                          f"difference {gbs - start}")
    rows, pp = args.micro_batch_size * args.data_parallel_size, args.pipeline_model_parallel_size
    consumed = 0
    while consumed <= min(samples, args.train_samples):
        b = batch_size(consumed, gbs, args.rampup_batch_size)
        if b % rows:
            raise ConfigError(f"{ramp}: the global batch of {b} samples (after {consumed} samples) is not divisible by "
                              f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
                              f"{args.data_parallel_size} = {rows}")
        if interleaved and b // rows % pp:
            raise ConfigError(f"{ramp}: interleaved pipelining needs every step's number of micro-batches to be a "
                              f"multiple of pp={pp}; the global batch of {b} samples (after {consumed} samples) has "
                              f"{b // rows}")
        consumed += b


# ---------------------------------------------------------------------------------------------- the loss scale
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


# ---------------------------------------------------------------------------------------------- stopping sooner
class ExitSignals:
    """Megatron's --exit-signal-handler, on by default here: SIGINT (Ctrl-C) and SIGTERM (a scheduler's; torchrun
    passes Ctrl-C and its own SIGTERM on to its ranks) only note the signal, so the step in flight finishes and the
    loop stops, saves and says how to resume. The same signal arriving again within a second (a terminal's Ctrl-C
    reaches torchrun's ranks both directly and through torchrun) is the same request; a later one stops at once."""
    SAME_REQUEST = 1.0  # seconds

    def __init__(self, enabled: bool):
        self.signum, self.t, self.old = 0, 0.0, {}
        if enabled and sys.platform != "win32":
            with contextlib.suppress(ValueError):  # (not the main thread: no handlers; the loop runs as before)
                self.old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(self, signum, frame):
        if self.signum and time.time() - self.t > self.SAME_REQUEST:
            raise KeyboardInterrupt  # a second request: stop now
        self.signum, self.t = self.signum or signum, self.t or time.time()

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)


def agree_to_stop(t0: float, minutes: float | None, signals: ExitSignals) -> tuple[bool, str | None, float]:
    """(--exit-duration-in-mins passed, the name of a signal received, the seconds since t0), as every rank agrees: a
    MAX over ranks, so a signal that reached one rank stops them all after the same step (a rank that stopped alone
    would leave the others waiting in a collective; tests/test_signals.py signals one rank of two), and a TimeFit
    decides alike on every rank."""
    flags = torch.tensor([time.time() - t0, float(signals.signum)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    late = minutes is not None and bool(flags[0] > 60 * minutes)
    return late, signal.Signals(int(flags[1])).name if flags[1] > 0 else None, float(flags[0])
