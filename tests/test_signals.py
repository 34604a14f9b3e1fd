"""Ctrl-C and SIGTERM (train.py's --exit-signal-handler, on by default; Megatron's flag): the step in flight finishes,
a checkpoint is saved, one line says where and how to resume, every rank exits; the same command then resumes
bit-exactly (the losses and gradient norms of the resumed iterations equal an uninterrupted run's, ==).

  - one process: SIGINT sent to itself at a random iteration, through train.main;
  - under the real torchrun (the signal goes to torchrun, which passes it on to its ranks, as a terminal's Ctrl-C or
    a scheduler's SIGTERM does): SIGINT at TP 2, SIGTERM at DP 2, each at a random iteration;
  - SIGTERM to one rank of two (a scheduler that signals a single process): both stop after the same step and save it;
  - a second Ctrl-C stops at once; --no-exit-signal-handler leaves the signal's default (KeyboardInterrupt).
The runs that resume and the uninterrupted references use the warm ranks (harness.launch: torchrun's environment).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import harness
import scheduler
import train
from harness import ROOT, metrics, tiny, torchrun

ITERS = 1000  # the runs' --train-iters (the LR schedule's length); every run stops long before, by signal or
# --exit-interval, so the interrupted, the resumed and the uninterrupted runs share one schedule


def run_argv(corpus, cache, run, *extra):
    return tiny(corpus, cache, run, "--load", str(run), "--hidden-dropout", "0.1", *extra, iters=ITERS)


def same_steps(resumed, reference, after: int):
    """The resumed run's iterations after `after` equal the reference's, loss and grad norm, exactly."""
    got, ref = metrics(resumed)[0], metrics(reference)[0]
    its = [i for i in sorted(got) if i > after]
    assert its, f"{resumed}: nothing after iteration {after}"
    for i in its:
        assert (got[i]["loss"], got[i]["grad_norm"]) == (ref[i]["loss"], ref[i]["grad_norm"]), f"iteration {i}"


def test_ctrl_c_in_one_process_saves_and_resumes_bit_exactly(corpus, cache, tmp_path, capsys, monkeypatch):
    k = random.Random().randint(2, 5)  # the iteration during which Ctrl-C arrives
    real, before = train.train_step, signal.getsignal(signal.SIGINT)

    def step(run, it):
        if it + 1 == k:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-iteration: the step still finishes
        return real(run, it)
    monkeypatch.setattr(train, "train_step", step)
    run = tmp_path / "run"
    assert train.main(run_argv(corpus, cache, run)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"SIGINT after iteration {k}: saved {run}/iter_{k:07d}; to resume, run the same command", out[-1]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == str(k)
    monkeypatch.setattr(train, "train_step", real)
    train.main(run_argv(corpus, cache, run, "--exit-interval", str(k + 2)))  # the same command (stopping sooner)
    ref = tmp_path / "ref"
    train.main(run_argv(corpus, cache, ref, "--exit-interval", str(k + 2)))
    same_steps(run, ref, after=k)
    assert signal.getsignal(signal.SIGINT) is before  # the loop put the handler back


def test_a_second_ctrl_c_stops_at_once_and_the_handler_can_be_turned_off(corpus, cache, tmp_path, capsys,
                                                                        monkeypatch):
    real = train.train_step

    def step(run, it):  # Ctrl-C during iteration 2, and again after SAME_REQUEST (a person insisting)
        if it == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.5 * scheduler.ExitSignals.SAME_REQUEST)
            os.kill(os.getpid(), signal.SIGINT)
        return real(run, it)
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(scheduler.ExitSignals, "SAME_REQUEST", 0.1)  # (a second, in a run)
    with pytest.raises(SystemExit, match="^130$"):
        train.main(run_argv(corpus, cache, tmp_path / "twice"))
    assert "train.py: interrupted: stopped at once" in capsys.readouterr().err
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (Python's own, whatever pytest started with)
    try:
        with pytest.raises(SystemExit, match="^130$"):  # without the handler: Python's KeyboardInterrupt at once
            train.main(run_argv(corpus, cache, tmp_path / "off", "--no-exit-signal-handler"))
    finally:
        signal.signal(signal.SIGINT, before)
    assert not (tmp_path / "off" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("layout, sig", [(["--tensor-model-parallel-size", "2"], signal.SIGINT), ([], signal.SIGTERM)],
                         ids=["tp2-sigint", "dp2-sigterm"])
def test_signal_to_torchrun_stops_every_rank_saves_and_resumes_bit_exactly(corpus, cache, tmp_path, layout, sig):
    k = random.Random().randint(2, 6)  # the signal is sent once iteration k is logged
    run = tmp_path / "run"
    argv = run_argv(corpus, cache, run, *layout, "--log-interval", "1")
    port = harness.free_port()
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master-port", str(port), str(ROOT / "train.py"), *argv], cwd=ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not (run / "metrics.jsonl").exists() or k not in metrics(run)[0]:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            proc.send_signal(sig)  # to torchrun, which passes it on to both ranks
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    said = [line for line in text.splitlines() if line.startswith(f"{sig.name} after iteration")]
    assert len(said) == 1, text[-3000:]  # rank 0 says it, once
    n = int(said[0].split()[3].rstrip(":"))
    assert n >= k and said[0].endswith(f"saved {run}/iter_{n:07d}; to resume, run the same command"), said
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == str(n)
    torchrun(2, [*argv, "--exit-interval", str(n + 2)])  # the same command, on warm ranks
    ref = tmp_path / "ref"
    torchrun(2, [*run_argv(corpus, cache, ref, *layout, "--log-interval", "1"), "--exit-interval",
                            str(n + 2)])
    same_steps(run, ref, after=n)


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(corpus, cache, tmp_path):
    """The stop is agreed (scheduler.agree_to_stop: a MAX over the ranks), so SIGTERM to rank 1 alone of a DP=2 run (warm
    ranks) stops both after the same iteration n: both save iter_n (each its own RNG file) and exit 0, and rank 0, never
    signalled, says it. A rank that stopped alone would save while the other waits in the next step's collectives: the
    run would hang and launch fail at its timeout (checked by hand with the all-reduce removed)."""
    run, k, result = tmp_path / "run", 2, {}
    argv = run_argv(corpus, cache, run, "--log-interval", "1")

    def launch():
        try:
            result["out"] = harness.launch(2, argv, timeout=120)
        except BaseException as e:  # noqa: BLE001 — handed to the test's thread
            result["error"] = e
    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or k not in metrics(run)[0]:  # (rank 0 logs after each step)
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.05)
    os.kill(harness._LAUNCHERS[2].procs[1].pid, signal.SIGTERM)  # rank 1's process only
    thread.join(timeout=150)
    assert "out" in result, result
    said = [line for line in result["out"][0].splitlines() if line.startswith("SIGTERM after iteration")]
    assert len(said) == 1 and "SIGTERM" not in result["out"][1], result["out"]
    n = int(said[0].split()[3].rstrip(":"))
    assert n >= k and said[0].endswith(f"saved {run}/iter_{n:07d}; to resume, run the same command"), said
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == str(n)
    assert [p.name for p in run.glob("iter_*")] == [f"iter_{n:07d}"]
    assert all((run / f"iter_{n:07d}" / f"rng_rank{r}.pt").exists() for r in (0, 1))
    assert max(metrics(run)[0]) == n
