"""The learning-rate schedule, sample-based training and the batch-size ramp-up against Megatron-core's own code.

  - scheduler.learning_rate equals megatron-core 0.15.3's OptimizerParamScheduler (on CPU, over a dummy torch optimizer)
    set up from our checked flags as megatron/training/training.py's get_optimizer_param_scheduler does, and driven
    as its training loop drives it (the LR a step uses is read before the step; then step(increment = the step's
    global batch)), at every iteration of a run and past its end: iteration-based cosine with --lr-warmup-iters,
    --lr-warmup-fraction, sample-based (--train-samples, --lr-decay-samples, --lr-warmup-samples) with and without
    --rampup-batch-size, linear, constant, inverse-square-root, WSD (each --lr-wsd-decay-style), --lr-warmup-init,
    and the default run. Tolerance: none (==): the same float operations in the same order give the same bits, so
    equality also shows that no step is shifted (a shift moves the rate by ~1e-4 relative or more).
  - scheduler.batch_size (the ramp) gives megatron-core's RampupBatchsizeNumMicroBatchesCalculator's (global batch,
    micro-batches) at every step of a hand-checked case, written out below, and --train-samples gives Megatron's
    iteration count (training.py's update_train_iters, driven by the same calculator).
  - End to end: a tiny train.main run with --rampup-batch-size under torchrun DP=2 (warm ranks) logs the single
    process's losses (float32: 1e-5 relative, reduction order only) and the LR Megatron's scheduler logs; stop + resume
    in the middle of the ramp equals the uninterrupted run bit for bit.
  - The schedule fitted to the time (scheduler.TimeFit: a pretraining run given --exit-duration-in-mins and no length
    runs WSD, its cool-down decided from the time measured so far): under a simulated clock (the elapsed time handed
    in; no sleeping) fast, slow, very slow or slowing down, it completes (the rate after the last step is --min-lr)
    within the time, and is Megatron's WSD with the flags it says repeat it; a run given its length is today's. A
    host that slows down in the cool-down has the rest compressed (the rate continuous, never rising) and completes;
    resumed after the compression, a run keeps it.
    End to end (time.time replaced by a clock that moves one second a step): a run stopped in its cool-down and
    resumed on a clock 100x faster logs the uninterrupted run's rates and losses, bit for bit.
  - A resumed run continues its checkpoint's schedule (scheduler.resumed_schedule, Megatron's _check_and_set): a
    cosine run resumed with make train's flags (no schedule flag; on its own a fitted WSD) logs the uninterrupted
    run's rates and losses, bit for bit; a conflicting --train-iters is refused in one line naming both values; a
    fitted run's decision is kept, other WSD lengths refused; --override-opt_param-scheduler takes the command's.
  - Negative controls: a schedule one step late (the rate of the samples after the step) and a ramp fed iterations
    instead of consumed samples are each caught by the same comparisons; today's cosine under the slow clock is cut by
    the guard far above --min-lr, and so is a fitted length predicted at the mean rate on a clock that slows down,
    and a cool-down never compressed on a clock that slows down in it; a
    resume that forgets the checkpoint's decision decides again, differently; a resume with
    --override-opt_param-scheduler logs other rates than the uninterrupted cosine run.
"""

import json
import shutil
import time

import pytest
import torch

import arguments
import scheduler
import train
from harness import NS_FLOAT32, assert_close, metrics, tiny, torchrun


@pytest.fixture(scope="module")
def mcore():
    """megatron-core's scheduler and ramp calculator (pure Python; its import takes a few seconds)."""
    sched = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    calc = pytest.importorskip("megatron.core.num_microbatches_calculator")
    return sched.OptimizerParamScheduler, calc.RampupBatchsizeNumMicroBatchesCalculator


def checked(argv, world=1):
    return arguments.check_args(arguments.parse_args(argv), world)


def megatron_batches(mcore, args, n):
    """Megatron's global batch size of iterations 0..n-1: its calculator updated with the consumed samples before each
    (training.py's loop: update_num_microbatches(consumed_train_samples, consistency_check=True))."""
    if args.rampup_batch_size is None:
        return [args.global_batch_size] * n
    c = mcore[1](args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False, 1,
                 *args.rampup_batch_size)
    out, consumed = [], 0
    for _ in range(n):
        c.update(consumed, consistency_check=True)
        out.append(c.get_current_global_batch_size())
        consumed += out[-1]
    return out


def megatron_lrs(mcore, args, n):
    """The LR Megatron's iterations 0..n-1 use: OptimizerParamScheduler with the arguments training.py's
    get_optimizer_param_scheduler gives it, stepped by get_num_microbatches() x mbs x dp after each iteration."""
    gbs = args.global_batch_size
    if args.train_samples is None:  # iteration-based: steps are iterations x --global-batch-size
        decay = args.lr_decay_iters * gbs
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_iters * gbs
    else:
        decay, wsd = args.lr_decay_samples, args.lr_wsd_decay_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = mcore[0](opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup,
                 lr_decay_steps=decay, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
                 end_wd=args.weight_decay, wd_incr_steps=decay, wd_incr_style="constant", wsd_decay_steps=wsd,
                 lr_wsd_decay_style=args.lr_wsd_decay_style)
    out = []
    for b in megatron_batches(mcore, args, n):
        out.append(opt.param_groups[0]["lr"])
        s.step(increment=b)
    return out, opt.param_groups[0]["lr"]


def our_lrs(args, n, late=False):
    """Ours, as train_step drives it: learning_rate(progress.lr_steps), then lr_steps += the step's batch.
    late=True is the negative control: each step takes the rate of the samples after it."""
    out, progress = [], train.Progress()
    for _ in range(n):
        b = scheduler.batch_size(progress.consumed_samples, args.global_batch_size, args.rampup_batch_size)
        out.append(scheduler.learning_rate(progress.lr_steps + (b if late else 0), args))
        progress.consumed_samples += b
        progress.lr_steps += b
    return out


def first_difference(ours, theirs):
    return next((f"iteration {i}: ours {a!r}, Megatron's {b!r}" for i, (a, b) in enumerate(zip(ours, theirs))
                 if a != b), None)


SMALL = ["--micro-batch-size", "2", "--global-batch-size", "8"]
CASES = {
    "default run": [],
    "cosine, --lr-warmup-iters": [*SMALL, "--train-iters", "100", "--lr-warmup-iters", "10", "--min-lr", "1e-4"],
    "--lr-warmup-fraction": [*SMALL, "--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-fraction", "0.07"],
    "linear": [*SMALL, "--train-iters", "60", "--lr-decay-style", "linear", "--lr-warmup-iters", "7"],
    "constant": [*SMALL, "--train-iters", "40", "--lr-decay-style", "constant", "--lr-warmup-iters", "5"],
    "inverse-square-root": [*SMALL, "--train-iters", "60", "--lr-decay-style", "inverse-square-root",
                            "--lr-warmup-iters", "6", "--lr-decay-iters", "50"],
    "inverse-square-root, no warmup": [*SMALL, "--train-iters", "30", "--lr-decay-style", "inverse-square-root",
                                       "--lr-warmup-iters", "0"],
    "--lr-warmup-init": [*SMALL, "--train-iters", "50", "--lr-warmup-iters", "9", "--lr-warmup-init", "1e-4"],
    "sample-based": [*SMALL, "--train-samples", "900", "--lr-decay-samples", "700", "--lr-warmup-samples", "60"],
    "sample-based, --lr-warmup-fraction": [*SMALL, "--train-samples", "500", "--lr-warmup-fraction", "0.1"],
    "sample-based, ramp-up": [*SMALL, "--train-samples", "900", "--lr-decay-samples", "800", "--lr-warmup-samples",
                              "100", "--rampup-batch-size", "2", "2", "300", "--lr-decay-style", "linear"],
    **{f"WSD {style}": [*SMALL, "--train-iters", "80", "--lr-decay-style", "WSD", "--lr-wsd-decay-style", style,
                        "--lr-wsd-decay-iters", "25", "--lr-warmup-iters", "5"]
       for style in ("exponential", "linear", "cosine", "minus_sqrt")},
    "WSD, sample-based": [*SMALL, "--train-samples", "640", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "200",
                          "--lr-warmup-samples", "40", "--rampup-batch-size", "4", "2", "100"],
}


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_learning_rate_equals_megatron_scheduler(mcore, argv):
    args = checked(argv)
    n = args.train_iters + 5  # past the end: --min-lr (or --lr, constant)
    theirs, _ = megatron_lrs(mcore, args, n)
    assert first_difference(our_lrs(args, n), theirs) is None
    # negative control: one step late (today's formula before this schedule: iteration i at the rate of i + 1)
    assert first_difference(our_lrs(args, n, late=True), theirs) is not None


# ---------------------------------------------------------------------------------------------- the ramp-up
RAMP = ["--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "40",
        "--train-samples", "100"]
# By hand: (16 - 4) / 4 = 3 increments, one per 40 / 3 = 13.33 samples; the batch of a step after c samples is
# 4 + 4 x floor(c / 13.33) while c <= 40, then 16. Consumed before each step: 0 4 8 12 16 24 32 44 60 76.
HAND = [(4, 1), (4, 1), (4, 1), (4, 1), (8, 2), (8, 2), (12, 3), (16, 4), (16, 4), (16, 4)]  # (batch, micro-batches)


def our_ramp(args, n, counter="samples"):
    """(global batch, micro-batches per DP rank) of steps 0..n-1; counter="iterations" is the negative control."""
    out, consumed = [], 0
    for it in range(n):
        b = scheduler.batch_size(consumed if counter == "samples" else it, args.global_batch_size, args.rampup_batch_size)
        out.append((b, b // (args.micro_batch_size * args.data_parallel_size)))
        consumed += b
    return out


def test_rampup_equals_megatron_calculator(mcore):
    args = checked(RAMP, world=2)  # DP = 2: micro-batches = batch / (2 x 2)
    assert args.data_parallel_size == 2
    c = mcore[1](16, 2, 2, False, 1, 4, 4, 40)
    theirs, consumed = [], 0
    for _ in range(len(HAND)):
        c.update(consumed, consistency_check=True)
        theirs.append((c.get_current_global_batch_size(), c.get()))
        consumed += theirs[-1][0]
    assert theirs == HAND
    assert our_ramp(args, len(HAND)) == HAND
    assert our_ramp(args, len(HAND), counter="iterations") != HAND  # negative control: iterations are not samples
    # --train-samples 100: Megatron's update_train_iters walks the ramp while consumed <= 40 (7 steps, 44 samples),
    # then (100 - 44) // 16 = 3 whole batches
    assert args.train_iters == 7 + 3
    # the same sample-based schedule's LR: Megatron's (a late schedule caught as above)
    theirs, _ = megatron_lrs(mcore, args, args.train_iters)
    assert first_difference(our_lrs(args, args.train_iters), theirs) is None


@pytest.mark.parametrize("argv, error", [
    (["--rampup-batch-size", "4", "4", "40"], "--rampup-batch-size is for sample-based training (--train-samples), "
                                              "not with --train-iters=650"),
    ([*RAMP[:5], "6", "2", "40", *RAMP[8:]], "--rampup-batch-size 6 2 40: the global batch of 6 samples (after 0 "
                                             "samples) is not divisible by --micro-batch-size x data-parallel size = "
                                             "2 x 2 = 4"),
    ([*RAMP[:5], "4", "5", "40", *RAMP[8:]], "INCREMENT must divide the difference 12"),
    ([*RAMP[:5], "16", "4", "40", *RAMP[8:]], "START must be below --global-batch-size=16"),
    ([*RAMP[:5], "4", "4", "0", *RAMP[8:]], "START, INCREMENT and SAMPLES must be >= 1"),
    (["--train-samples", "100", "--train-iters", "5"], "are exclusive"),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], "--lr-warmup-iters is for iteration-based training"),
    (["--train-samples", "100", "--lr-decay-iters", "5"], "use --lr-decay-samples"),
    (["--lr-decay-samples", "100"], "--lr-decay-samples is for sample-based training"),
    (["--lr-warmup-samples", "100"], "--lr-warmup-samples is for sample-based training"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "give one warmup"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-decay-iters", "100", "--exit-duration-in-mins", "8"],  # a length: not fitted
     "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters acts only with --lr-decay-style WSD"),
    (["--lr-warmup-init", "1"], "--lr-warmup-init=1.0 is larger than --lr"),
    (["--train-samples", "10"], "--train-samples=10 is less than one global batch (32)"),
])
def test_schedule_flags_refused_in_one_line(argv, error):
    with pytest.raises(arguments.ConfigError) as e:
        checked(argv, world=2)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_interleaved_schedule_checks_every_step_of_the_ramp():
    """The interleaved schedule needs each step's micro-batch count to be a multiple of pp (2 here, DP = 1): a ramp
    of batches 4, 8, 12, 16 (2, 4, 6, 8 micro-batches of 2) runs; one that starts at 2 (1 micro-batch) is refused."""
    pp = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
          "--micro-batch-size", "2", "--global-batch-size", "16", "--train-samples", "100"]
    assert checked([*pp, "--rampup-batch-size", "4", "4", "40"], world=2).train_iters == 10
    with pytest.raises(arguments.ConfigError, match=r"multiple of pp=2; the global batch of 2 samples \(after 0 "
                                                    r"samples\) has 1"):
        checked([*pp, "--rampup-batch-size", "2", "2", "40"], world=2)


# ---------------------------------------------------------------------------------------------- end to end
def ramp_run(corpus, cache, save, *extra):
    """6 steps of batches 4, 4, 8, 12, 12, 12 (ramp 4 -> 12 by 4 over 16 samples; 52 samples), DP-ready (2 x 2)."""
    return ["--data-path", str(corpus), "--data-cache-dir", str(cache), "--vocab-size", "384", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
            "--global-batch-size", "12", "--rampup-batch-size", "4", "4", "16", "--train-samples", "52", "--lr", "3e-3",
            "--lr-warmup-samples", "8", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "2",
            *NS_FLOAT32, "--save", str(save), *extra]


def test_rampup_run_dp2_equals_single_process_and_resumes_exactly(mcore, corpus, tmp_path):
    cache, one, two, stopped = tmp_path / "cache", tmp_path / "one", tmp_path / "dp2", tmp_path / "stopped"
    train.main(ramp_run(corpus, cache, one))
    torchrun(2, ramp_run(corpus, cache, two))
    (ref, ref_val), (got, got_val) = metrics(one), metrics(two)
    assert sorted(ref) == sorted(got) == list(range(1, 7)) and sorted(ref_val) == sorted(got_val) == [3, 6]
    assert [ref[i]["global_batch_size"] for i in ref] == [4, 4, 8, 12, 12, 12]
    assert [ref[i]["consumed_samples"] for i in ref] == [4, 8, 16, 28, 40, 52]
    for i in ref:
        assert_close(got[i]["loss"], ref[i]["loss"], 1e-5, f"DP=2 loss at iteration {i}")
        assert_close(got[i]["grad_norm"], ref[i]["grad_norm"], 1e-5, f"DP=2 grad norm at iteration {i}")
    for i in ref_val:
        assert_close(got_val[i], ref_val[i], 1e-5, f"DP=2 validation loss at iteration {i}")
    # the logged LR is Megatron's after each step (its training_log reads the scheduler once it has stepped)
    args = checked(ramp_run(corpus, cache, one))
    after = [megatron_lrs(mcore, args, k)[1] for k in range(1, 7)]
    assert [ref[i]["lr"] for i in ref] == after
    # stop after iteration 2 (the ramp at 8 of its 16 samples) and resume: bit-equal to the run that never stopped
    train.main(ramp_run(corpus, cache, stopped, "--exit-interval", "2"))
    train.main(ramp_run(corpus, cache, stopped, "--load", str(stopped)))
    res, res_val = metrics(stopped)
    assert sorted(res) == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr", "global_batch_size", "consumed_samples"):
        assert [res[i][key] for i in res] == [ref[i][key] for i in ref], key
    assert sorted(res_val) == [2, 3, 6] and all(res_val[i] == ref_val[i] for i in (3, 6))  # (2: the stop's)


# ---------------------------------------------------------------------------------------------- fitted to the time
FITTED = ["--exit-duration-in-mins", "8"]  # make train's: no --train-iters -> WSD fitted to the 8 minutes
CLOCKS = {  # seconds an iteration takes, after iteration i (the default run: 0.74 s on a fast day, 1.4 on a slow one)
    "fast (--train-iters binds)": lambda i: 0.3, "fast day": lambda i: 0.74, "slow day": lambda i: 1.45,
    "4x slower": lambda i: 3.0, "slowing down by 20 %": lambda i: 1.0 if i < 150 else 1.2}


def fitted_run(args, tick, start=0, fit=None, stop=None):
    """A fitted run as train.py's loop drives it, on a simulated clock: tick(i) seconds for iteration i, the time
    handed to TimeFit.after_step. Returns (the fit, the logged rate after each iteration {n: lr}, seconds)."""
    fit, gbs, lrs, t = fit or scheduler.TimeFit(args), args.global_batch_size, {}, 0.0
    n = start
    while n < (stop or fit.train_iters) and t <= 60 * args.exit_duration_in_mins:  # (the guard)
        t, n = t + tick(n), n + 1
        fit.after_step(n, t, n - start)
        lrs[n] = scheduler.learning_rate(n * gbs, fit.args)
    return fit, lrs, t


@pytest.mark.parametrize("tick", CLOCKS.values(), ids=CLOCKS.keys())
def test_fitted_schedule_completes_within_the_time(mcore, tick):
    args = checked(FITTED)
    assert (args.lr_decay_style, args.lr_wsd_decay_iters, args.train_iters) == ("WSD", None, 650)
    fit, lrs, secs = fitted_run(args, tick)
    n = max(lrs)
    assert fit.decided and n == fit.train_iters <= 650 and secs <= 60 * 8, (n, fit.train_iters, secs)
    assert fit.shortened is None  # (a rate that holds in the cool-down needs no compressing)
    assert lrs[n] == args.min_lr, f"the schedule did not complete: lr {lrs[n]} after the last iteration {n}"
    assert lrs[n - fit.wsd_iters] == args.lr > lrs[n - fit.wsd_iters + 1]  # held, then annealed over the last M
    assert abs(fit.wsd_iters / n - scheduler.COOLDOWN_SHARE) <= 0.05, (fit.wsd_iters, n)  # its share (rounding, the cap)
    # the flags it says repeat it: Megatron's WSD, iteration for iteration (the rate each step used, and after it)
    repeat = checked(["--train-iters", str(n), "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", str(fit.wsd_iters),
                      "--lr-wsd-decay-style", "linear"])
    assert f"--train-iters {n} --lr-decay-style WSD --lr-wsd-decay-iters {fit.wsd_iters} --lr-wsd-decay-style " \
           "linear repeats it" in fit.said(n)
    theirs, after = megatron_lrs(mcore, repeat, n)
    assert first_difference(our_lrs(fit.args, n), theirs) is None and after == lrs[n]
    assert [lrs[k] for k in range(1, n)] == theirs[1:]


SLOWING_IN_COOLDOWN = lambda i: 0.74 if i < 350 else 0.74 * 1.25  # noqa: E731 (the cool-down starts at ~310)


def test_a_host_that_slows_in_the_cooldown_has_it_compressed_and_completes():
    """On a fast day's clock that slows by 25 % after iteration 350, in the cool-down decided at ~310 (2026-12-07's
    default run: ~20 % slower in its cool-down, cut by the guard at 759 of 777 with the rate above --min-lr): the rest
    of the cool-down is compressed (TimeFit.shorten), the rate never rises nor drops more than 2 steps' worth at once,
    the run completes within the time, and a run resumed after the compression (on a clock 5x faster) keeps it."""
    args = checked(FITTED)
    fit, lrs, secs = fitted_run(args, SLOWING_IN_COOLDOWN)
    n, (was, _) = max(lrs), fit.shortened
    assert fit.decided and n == fit.train_iters < was and secs <= 60 * 8 and lrs[n] == args.min_lr, (n, was, secs)
    assert "the host slowed down: after iteration" in fit.said(n)
    annealing = [lrs[k] for k in range(n - fit.wsd_iters, n + 1) if k in lrs]
    drops = [a - b for a, b in zip(annealing, annealing[1:])]
    assert min(drops) >= 0 and max(drops) <= 2 * (args.lr - args.min_lr) / fit.wsd_iters, (min(drops), max(drops))
    stop = n - 20  # (after the compression: the time it holds is left)
    meta = {"opt_param_scheduler": {"num_steps": stop * args.global_batch_size, **fit.state()}}
    _, resumed, _ = fitted_run(args, lambda i: 0.145, start=stop, fit=scheduler.TimeFit(args, meta))
    assert resumed == {k: v for k, v in lrs.items() if k > stop}


# A slow day's 4-minute run (2026-12-07: 1.3 s an iteration, a 4 s evaluation after every 100th)
PAUSING = lambda i: 1.3 + (4.0 if i % 100 == 0 and i > 0 else 0.0)  # noqa: E731


def test_an_evaluations_pause_is_not_read_as_a_slower_host(monkeypatch):
    """The cool-down's latest-iterations window spans at least one --eval-interval, so the pause after an evaluation
    weighs in it as in the run's average: a host whose speed holds is not compressed, and uses its time. Negative
    control: the window a quarter of the cool-down alone (22 iterations here, as before) reads the pause after
    iteration 100 as a slower host and compresses the run (as two fresh-clone runs did that day), ending earlier."""
    args = checked(["--exit-duration-in-mins", "4"])
    fit, lrs, secs = fitted_run(args, PAUSING)
    assert fit.window == args.eval_interval and fit.shortened is None and lrs[max(lrs)] == args.min_lr, fit.window
    monkeypatch.setattr(scheduler.TimeFit, "latest", lambda self, cooldown: max(scheduler.MEASURED, cooldown // 4))
    short, short_lrs, short_secs = fitted_run(args, PAUSING)
    assert short.shortened is not None and max(short_lrs) < max(lrs) and short_secs < secs, (short.shortened, secs)


def test_a_cooldown_never_compressed_is_cut_when_the_host_slows_in_it(monkeypatch):
    """Negative control: the same clock with the compression off (SHORTEN never reached) is cut by the guard above
    --min-lr, as 2026-12-07's run was."""
    monkeypatch.setattr(scheduler, "SHORTEN", float("inf"))
    args = checked(FITTED)
    fit, lrs, _ = fitted_run(args, SLOWING_IN_COOLDOWN)
    assert fit.decided and fit.shortened is None and max(lrs) < fit.train_iters and lrs[max(lrs)] > args.min_lr


def test_fitted_schedule_negative_control_the_mean_rate_overshoots(monkeypatch):
    """On the clock that slows down by 20 % after iteration 150, a length predicted at the mean rate of every
    iteration timed (not the later half's) runs past the time: the guard cuts the cool-down above --min-lr (its
    compression, which would rescue it, off)."""
    monkeypatch.setattr(scheduler, "RECENT", 0.0)
    monkeypatch.setattr(scheduler, "SHORTEN", float("inf"))
    args = checked(FITTED)
    fit, lrs, secs = fitted_run(args, CLOCKS["slowing down by 20 %"])
    assert fit.decided and max(lrs) < fit.train_iters and lrs[max(lrs)] > args.min_lr, (max(lrs), fit.train_iters)


def test_fitted_schedule_negative_control_todays_cosine_is_cut():
    """Today's schedule (the same run given --train-iters 650: cosine, not fitted) on the slow day's clock: the guard
    cuts it with the rate far above --min-lr, which the test above would catch."""
    args = checked([*FITTED, "--train-iters", "650"])
    fit, lrs, _ = fitted_run(args, CLOCKS["slow day"])
    assert args.lr_decay_style == "cosine" and not fit.fitted and fit.args is args and fit.state() == {}
    assert max(lrs) < 650 and lrs[max(lrs)] > 5 * args.min_lr


@pytest.mark.parametrize("argv", [["--train-iters", "650"], ["--lr-decay-iters", "600"], ["--train-samples", "20000"],
                                  ["--lr-decay-style", "cosine"], ["--task", "sft"]])
def test_a_given_length_is_not_fitted(argv):
    """A run that gives its length (or another decay style, or a post-training task) under --exit-duration-in-mins
    schedules exactly as without it."""
    with_time, without = checked([*FITTED, *argv]), checked(argv)
    assert vars(with_time) == {**vars(without), "exit_duration_in_mins": 8.0}
    assert not scheduler.TimeFit(with_time).fitted


def test_fitted_decision_is_the_checkpoints():
    """Resumed in its cool-down (on a clock 10x faster), a run that reads the decision from the checkpoint's meta.json
    (TimeFit.state) logs the uninterrupted run's rates; one that does not decides again, differently."""
    args = checked(FITTED)
    fit, lrs, _ = fitted_run(args, CLOCKS["slow day"])
    stop = fit.train_iters - fit.wsd_iters // 2
    meta = {"opt_param_scheduler": {"num_steps": stop * args.global_batch_size, **fit.state()}}
    _, resumed, _ = fitted_run(args, lambda i: 0.145, start=stop, fit=scheduler.TimeFit(args, meta))
    assert resumed == {k: v for k, v in lrs.items() if k > stop}
    _, forgot, _ = fitted_run(args, lambda i: 0.145, start=stop, fit=scheduler.TimeFit(args, {}))
    assert max(forgot) != max(lrs) and forgot[max(lrs)] != lrs[max(lrs)]


def test_fitted_run_stopped_in_its_cooldown_resumes_exactly(corpus, tmp_path, monkeypatch):
    """train.main on a clock that moves one second a step (time.time replaced; evaluation and saving take none):
    --train-iters 20 --lr-decay-style WSD in 0.25 minutes fits 14 iterations (the 5 % reserve: 14.25 s), the cool-down
    after iteration 10; stopped at 12 and resumed on a clock 100x faster, it logs the same rates and losses."""
    now, step = [1e9], train.train_step
    monkeypatch.setattr(time, "time", lambda: now[0])
    tick = [1.0]

    def timed_step(run, it):
        now[0] += tick[0]
        return step(run, it)
    monkeypatch.setattr(train, "train_step", timed_step)
    run = lambda save, *extra: tiny(corpus, tmp_path / "cache", save, "--train-iters", "20", "--lr-decay-style", "WSD",
                                    "--exit-duration-in-mins", "0.25", "--eval-interval", "7", *extra)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train.main(run(straight))
    train.main(run(stopped, "--exit-interval", "12"))
    assert (stopped / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    tick[0] = 0.01
    train.main(run(stopped, "--load", str(stopped)))
    (a, _), (b, _) = metrics(straight), metrics(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 15))
    assert a[14]["lr"] == 0.0 and a[10]["lr"] == 3e-3 > a[11]["lr"]  # (--lr given: Megatron's --min-lr 0)
    for key in ("lr", "loss", "grad_norm"):
        assert [b[i][key] for i in b] == [a[i][key] for i in a], key


def test_train_py_compresses_a_cooldown_the_host_slows_down_in(corpus, tmp_path, monkeypatch, capsys):
    """train.main on a clock that moves one second a step, then 1.2 from iteration 15: --exit-duration-in-mins 0.5
    fits 28 iterations, the cool-down after 14; at 1.2 s the rest would end past the 30 s, so it is compressed, said
    in one line, and the run completes (--min-lr after its last step) within the time; its checkpoint records it."""
    now, step = [1e9], train.train_step
    monkeypatch.setattr(time, "time", lambda: now[0])

    def timed_step(run, it):
        now[0] += 1.0 if it < 14 else 1.2
        return step(run, it)
    monkeypatch.setattr(train, "train_step", timed_step)
    save = tmp_path / "run"
    train.main(tiny(corpus, tmp_path / "cache", save, "--train-iters", "40", "--lr-decay-style", "WSD",
                    "--exit-duration-in-mins", "0.5", "--eval-interval", "100"))
    out, (logged, _) = capsys.readouterr().out, metrics(save)
    n = max(logged)
    assert "the cool-down starts after iteration 14: 14 iterations of WSD annealing to iteration 28" in out, out
    assert "the host slowed down: after iteration" in out and n < 28 and logged[n]["lr"] == 0.0, (n, out[-2000:])
    assert 14 + 1.2 * (n - 14) <= 30 and logged[14]["lr"] == 3e-3 > logged[15]["lr"]
    assert all(logged[i]["lr"] >= logged[i + 1]["lr"] for i in range(14, n))
    meta = json.loads((save / f"iter_{n:07d}" / "meta.json").read_text())
    assert meta["opt_param_scheduler"]["lr_decay_steps"] == n * 8, meta["opt_param_scheduler"]  # (global batch 8)


# ---------------------------------------------------------------------------------------------- a resumed schedule
SCHEDULE = {"--train-iters", "--lr", "--lr-warmup-iters"}  # harness.tiny's schedule flags


def plain(argv):
    """argv less the schedule flags (and their values): `make train`'s resume of a run started with them."""
    return [a for i, a in enumerate(argv) if a not in SCHEDULE and (i == 0 or argv[i - 1] not in SCHEDULE)]


def test_cosine_checkpoint_resumed_by_plain_flags_keeps_cosine(corpus, tmp_path, capsys):
    """A run saved under cosine (--train-iters 12), resumed as `make train` resumes it (--exit-duration-in-mins, no
    schedule flag: on its own a fitted WSD at other rates) continues the checkpoint's cosine: the uninterrupted run's
    rates and losses, bit for bit, ending at its iteration 12, and says so in a note. Negative control: the same resume
    with --override-opt_param-scheduler takes the command's schedule (the fitted WSD's warmup at the default --lr),
    whose rates the comparison above would catch."""
    run = lambda save, *extra: tiny(corpus, tmp_path / "cache", save, *extra, iters=12)
    straight, stopped, other = tmp_path / "straight", tmp_path / "stopped", tmp_path / "other"
    train.main(run(straight))
    train.main(run(stopped, "--exit-interval", "6"))
    shutil.copytree(stopped, other)
    resume = lambda save, *extra: plain(run(save, "--load", str(save), "--exit-duration-in-mins", "8", *extra))
    capsys.readouterr()
    train.main(resume(stopped))
    said = capsys.readouterr().out
    assert "note: the learning-rate schedule continues the checkpoint's (lr_decay_style cosine in the checkpoint, " \
           "WSD now" in said, said
    (a, _), (b, _) = metrics(straight), metrics(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 13)) and a[12]["lr"] == 0.0  # (--lr given: --min-lr 0)
    for key in ("lr", "loss", "grad_norm"):
        assert [b[i][key] for i in b] == [a[i][key] for i in a], key
    train.main(resume(other, "--override-opt_param-scheduler", "--exit-interval", "9"))
    (c, _), command = metrics(other), scheduler.TimeFit(checked(resume(other))).args
    assert command.lr_decay_style == "WSD" and command.lr != 3e-3
    assert [c[i]["lr"] for i in range(7, 10)] == [scheduler.learning_rate(i * 8, command) for i in range(7, 10)]
    assert all(c[i]["lr"] != a[i]["lr"] for i in range(7, 10))


def test_conflicting_schedule_flag_is_refused_in_one_line(corpus, tmp_path, capsys):
    """Resumed at iteration 3 with a schedule flag that changes the checkpoint's schedule (cosine over 20 iterations,
    not 12): one line naming both values, exit 2, nothing trained; --use-checkpoint-opt_param-scheduler continues the
    checkpoint's; a checkpoint saved at its schedule's end is extended by the flags (with a note)."""
    run = lambda *extra: tiny(corpus, tmp_path / "cache", tmp_path / "r", "--load", str(tmp_path / "r"), *extra, iters=12)
    train.main(run("--exit-interval", "3"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main([*run(), "--train-iters", "20"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"train.py: error: --load {tmp_path / 'r'}: its learning-rate schedule differs from this "
                          "command's (lr_decay_steps 96 in the checkpoint, 160 now; steps in samples)"), err
    assert "--override-opt_param-scheduler" in err
    assert (tmp_path / "r" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    args = checked([*run(), "--train-iters", "20", "--use-checkpoint-opt_param-scheduler"])
    meta = {"args": vars(checked(run())), "opt_param_scheduler": {"num_steps": 24}, "iteration": 3}
    assert scheduler.TimeFit(args, meta).args.lr_decay_iters == 12
    ended = scheduler.TimeFit(checked([*run(), "--train-iters", "20"]), {**meta, "iteration": 12})  # its schedule done:
    assert ended.args.lr_decay_iters == 20 and "ended at its iteration 12: this command's extends" in ended.note
    with pytest.raises(arguments.ConfigError, match="--override-opt_param-scheduler and --use-checkpoint-opt_param-"):
        checked([*run(), "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])


def test_fitted_checkpoint_resumed_with_other_lengths():
    """A fitted run's decided WSD (TimeFit.state): resumed by make train's flags it keeps its decision; given other
    WSD lengths it is refused naming both; with the override it takes them; given the same lengths it is accepted."""
    args = checked(FITTED)
    fit, _, _ = fitted_run(args, CLOCKS["slow day"])
    meta = {"args": vars(args), "opt_param_scheduler": {"num_steps": 100 * 8, **fit.state()}}
    kept = scheduler.TimeFit(checked(["--exit-duration-in-mins", "4"]), meta)
    assert (kept.train_iters, kept.wsd_iters, kept.note) == (fit.train_iters, fit.wsd_iters, None)
    given = ["--train-iters", str(fit.train_iters), "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear"]
    wsd, gbs = fit.wsd_iters * args.global_batch_size, args.global_batch_size
    with pytest.raises(arguments.ConfigError, match=f"wsd_decay_steps {wsd} in the checkpoint, {wsd + gbs} now"):
        scheduler.TimeFit(checked([*given, "--lr-wsd-decay-iters", str(fit.wsd_iters + 1)]), meta)
    override = scheduler.TimeFit(checked([*given, "--lr-wsd-decay-iters", "7", "--override-opt_param-scheduler"]), meta)
    assert (override.fitted, override.args.lr_wsd_decay_iters) == (False, 7)
    same = checked([*given, "--lr-wsd-decay-iters", str(fit.wsd_iters), "--lr-warmup-iters", "30", "--lr", str(args.lr),
                    "--min-lr", str(args.min_lr)])
    assert scheduler.TimeFit(same, meta).args is same
