"""Soak test of checkpoint/resume: train while being SIGKILLed at random moments, some right after a save starts;
the final losses, parameters and optimizer state must equal an uninterrupted run's, bit for bit.

Run:  .venv/bin/python bench/soak.py --minutes 10      (or make soak ARGS="--minutes 3"; --nproc 2: torchrun)

1. calibrates (short runs: start-up time, seconds per iteration) and sizes the run to ~1/5 of the budget;
2. runs it uninterrupted (the reference);
3. runs the same command (`--load D --save D`, Megatron's auto-resume idiom) again and again, each launch SIGKILLed
   (the whole process group) after a random delay, or at the first save that starts after it (when a new
   iter_*.tmp/ appears, or 0-50 ms later), until --minutes is spent; then a last launch runs to the end;
4. compares: every logged loss, grad norm and validation loss, and every tensor of the final checkpoints (model,
   AdamW moments, step) with the reference. Prints a table of launches and the verdict; exits 1 on any difference.
Bounded: every launch has a timeout, and every process it started is killed on exit. Not part of `make test`.
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # harness imports the project modules
from harness import SNIPPET  # noqa: E402  the test suite's synthetic corpus, so the soak trains on the same files

LIVE = []  # process groups of running launches, killed on exit


def flags(work, save, iters, nproc):
    tiny = ["--data-path", str(work / "corpus"), "--data-cache-dir", str(work / "cache"), "--vocab-size", "384",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1", "--eval-interval", "10",
            "--eval-iters", "2", "--save-interval", "3", "--train-iters", str(iters), "--save", str(save)]
    if nproc > 1:
        tiny += ["--tensor-model-parallel-size", str(nproc)]
    return tiny


def command(argv, nproc):
    if nproc == 1:
        return [sys.executable, str(ROOT / "train.py"), *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(ROOT / "train.py"), *argv]


def launch(argv, nproc, log):
    env = dict(os.environ, OMP_NUM_THREADS="1") if nproc > 1 else dict(os.environ)
    p = subprocess.Popen(command(argv, nproc), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)  # its own process group: one killpg ends torchrun and its ranks
    LIVE.append(p)
    return p


def kill(p):
    with contextlib.suppress(ProcessLookupError):  # the launch may have ended on its own
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    if p in LIVE:
        LIVE.remove(p)


def run_to_end(argv, nproc, log, timeout):
    p = launch(argv, nproc, log)
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(p)
        raise SystemExit(f"soak: a run did not finish within {timeout:.0f} s (see {log.name})") from None
    LIVE.remove(p)
    if rc != 0:
        raise SystemExit(f"soak: a run failed with exit status {rc} (see {log.name})")


def latest(d):
    f = d / "latest_checkpointed_iteration.txt"
    return int(f.read_text()) if f.exists() else 0


def losses(d):
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return ({r["iteration"]: (r["loss"], r["grad_norm"]) for r in recs if "loss" in r},
            {r["iteration"]: r["val_loss"] for r in recs if "val_loss" in r})


def final_state(d, out):
    """Every tensor of the latest checkpoint (model, optimizer, FP8 state), flattened, read by DCP into one file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(d / f"iter_{latest(d):07d}"), str(out))
    flat = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = x
    walk("", torch.load(out, weights_only=True))
    return flat


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="total budget (calibration + reference + soak)")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (TP = nproc, torchrun) of every run")
    ap.add_argument("--seed", type=int, default=0, help="of the kill schedule")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    return ap.parse_args(argv)


def main():
    a = parse_args()
    rng, t_begin, budget = random.Random(a.seed), time.time(), 60 * a.minutes
    work = Path(a.workdir or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "corpus").mkdir(exist_ok=True)
    for i in range(40):
        (work / "corpus" / f"m{i:02d}.py").write_text(SNIPPET.format(i=i))
    log = open(work / "runs.log", "w")
    try:
        # 1. calibration: start-up time and seconds per iteration (with saving and evaluation), data cache built
        run_to_end(flags(work, work / "calib0", 1, a.nproc), a.nproc, log, 600)
        t = time.time()
        run_to_end(flags(work, work / "calib1", 2, a.nproc), a.nproc, log, 600)
        t2 = time.time() - t
        t = time.time()
        run_to_end(flags(work, work / "calib2", 62, a.nproc), a.nproc, log, 600)
        t62 = time.time() - t
        per_iter = max((t62 - t2) / 60, 1e-3)
        startup = max(t2 - 2 * per_iter, 0.5)
        left = budget - (time.time() - t_begin)
        iters = int(min(max((left / 5 - startup) / per_iter, 30), 20000))
        print(f"calibration: start-up {startup:.1f} s, {per_iter * 1000:.0f} ms per iteration -> {iters} iterations",
              flush=True)
        # 2. the reference, uninterrupted
        ref = work / "reference"
        t = time.time()
        run_to_end(flags(work, ref, iters, a.nproc), a.nproc, log, max(600, 4 * left))
        t_ref = time.time() - t
        per_iter = max((t_ref - startup) / iters, 1e-3)  # measured on the real run (calibration is noisy)
        # 3. the soak: the same command every launch, --load = --save
        soak = work / "soak"
        argv = flags(work, soak, iters, a.nproc) + ["--load", str(soak)]
        kill_until = t_begin + budget - 1.2 * t_ref  # then the last launch runs to the end within the budget
        rows = []
        while True:
            before, t0 = latest(soak), time.time()
            final = time.time() >= kill_until
            mode = "none" if final else rng.choice(["random", "random", "save", "save+delay"])
            # progress per launch so that the kills go on until kill_until (n launches of startup + p iterations),
            # and at least ~30 launches
            todo, time_left = iters - before, kill_until - time.time()
            p_its = todo * startup / (time_left - todo * per_iter) if time_left > todo * per_iter else todo
            delay = rng.uniform(0.5 * startup, startup + 2 * per_iter * min(max(p_its, 3), todo, iters / 30))
            before_delay = None  # "save" modes: the partial saves present at the delay; kill at the next new one
            stale = bool(list(soak.glob("iter_*.tmp")))  # left by the last kill: the launch removes it first
            p = launch(argv, a.nproc, log)
            event = ""
            while p.poll() is None:
                now = time.time() - t0
                if mode == "none":
                    if now > max(600, 4 * t_ref):
                        kill(p)
                        raise SystemExit("soak: the last launch did not finish in time")
                elif mode == "random" and now >= delay:
                    event = f"{now:.1f} s"
                    break
                elif mode.startswith("save") and now >= delay:
                    tmp = {t.name for t in soak.glob("iter_*.tmp")}
                    stale = stale and bool(tmp)  # until the launch has removed the last kill's partial save
                    before_delay = tmp if before_delay is None and not stale else before_delay
                    new = sorted(tmp - before_delay) if before_delay is not None else []
                    if new or now > delay + 5 + 20 * per_iter:
                        if mode == "save+delay":
                            time.sleep(rng.uniform(0, 0.05))
                        event = f"{now:.1f} s, " + (f"saving {new[-1]}" if new else "no save seen")
                        break
                time.sleep(0.005)
            rc = p.poll()
            if rc is None:
                kill(p)
            elif p in LIVE:
                LIVE.remove(p)
            rows.append((len(rows) + 1, before, mode, event or f"exit {rc}", latest(soak),
                         len(list(soak.glob("iter_*.tmp")))))
            if rc is not None:
                if rc != 0:
                    raise SystemExit(f"soak: launch {len(rows)} failed with exit status {rc} (see {log.name})")
                if latest(soak) == iters:
                    break
        # 4. compare
        (a_loss, a_val), (b_loss, b_val) = losses(ref), losses(soak)
        same_log = a_loss == b_loss and a_val == b_val
        sa, sb = final_state(ref, work / "ref.pt"), final_state(soak, work / "soak.pt")
        diff = [k for k in sa if k not in sb or not torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k]))]
        same_state = sorted(sa) == sorted(sb) and not diff
        print(f"\n{'launch':>6} {'from it':>7}  {'kill':<10} {'killed at':<34} {'latest after':>12} {'tmp left':>8}")
        for r in rows:
            print(f"{r[0]:>6} {r[1]:>7}  {r[2]:<10} {r[3]:<34} {r[4]:>12} {r[5]:>8}")
        kills = sum(r[2] != "none" and not r[3].startswith("exit") for r in rows)
        during = sum("saving" in r[3] for r in rows)
        print(f"\ncommand: {' '.join(command(argv, a.nproc))}")
        log.flush()
        removed = (work / "runs.log").read_text().count("a partial checkpoint left by an interrupted save")
        print(f"soak: {len(rows)} launches, {kills} SIGKILLs ({during} during a save; {removed} partial saves removed "
              f"at restart), {iters} iterations; "
              f"reference {t_ref:.0f} s; total {time.time() - t_begin:.0f} s")
        print(f"losses, grad norms, validation ({len(a_loss)} + {len(a_val)} values): "
              f"{'identical' if same_log else 'DIFFERENT'}; final checkpoint ({len(sa)} tensors: model, AdamW): "
              f"{'identical' if same_state else 'DIFFERENT: ' + ', '.join(diff[:5])}")
        print(f"final loss: reference {a_loss[iters][0]:.6f}, soak {b_loss[iters][0]:.6f}")
        return 0 if same_log and same_state else 1
    finally:
        for p in list(LIVE):
            kill(p)
        log.close()
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif a.keep or a.workdir:
            print(f"work directory: {work}")


if __name__ == "__main__":
    sys.exit(main())
