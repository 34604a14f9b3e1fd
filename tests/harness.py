"""Pools of gloo worker ranks, started once per test session, that run test functions on every rank of a world.

Starting ranks is slow on 2 cores, so a world of n ranks is made once (on first use; each rank forked from
multiprocessing's fork server, which imported torch and train.py once for the session) and every
n-rank test case is sent to it: `pools.run(fn, n, **kwargs)` calls `fn(rank, n, **kwargs)` on ranks 0..n-1 and
returns their results in rank order; n = 1 runs in this process. `fn` must be a module-level function of an
importable module (a test file); it builds its own `parallel.Grid(...)` over the world, as Megatron's
initialize_model_parallel does, so one world serves e.g. tp=4 and tp=2 x dp=2 cases alike. Results travel as
torch.save bytes. If a case fails or hangs on any rank, the pool is torn down and started again (a rank stuck in a collective
cannot be trusted), and the first rank's traceback is raised in the parent.

`launch(n, argv)` is `torchrun --nproc_per_node n train.py argv` without the process starts (a torchrun launch costs
3 Python processes that import torch: ~10 CPU-seconds for a 3-iteration TP=2 run that takes <1 s warm): n warm ranks (started on
first use, `train` imported once) run `train.main(argv)` with the environment torchrun gives (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT on a fresh port), so train.py makes and destroys its own process group each run, as under
torchrun; parallel.py's cache of process groups is emptied before each run, as a fresh process has it. A failed or
hung run tears the ranks down like a failed case (`fails=True`: a run meant to fail, kept warm when every rank
answered). tests/test_failures.py and test_signals.py keep launching the real torchrun (what torchrun itself does:
its report of a rank's exit code, the signal it passes on to its ranks). `in_fresh_process(fn, *args)`: one call in a
new process forked from the same fork server (started before the first test; PRELOAD is what it imports).

The tiny train.py runs the tests share: `tiny(corpus, cache, save, *flags)` (a 2-layer model on conftest.py's
`corpus` of SNIPPETs, its tokens cached in `cache`), `metrics(run)` (its logged losses), `torchrun(n, argv)`.
"""
from __future__ import annotations

import importlib
import io
import json
import multiprocessing as mp
import os
import queue
import random
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = Path(HERE).parent


def free_port() -> int:
    """A port free now, drawn below the kernel's ephemeral range (ip_local_port_range), where bind(0) and every
    outgoing connection take theirs: a port from bind(0), used seconds later (torchrun's store, a server that binds
    once its model is loaded), could meanwhile go to one of the many gloo connections of make test's other worker."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def server_fixture(start):
    """A test file's module-scoped pytest fixture `server`: start(run) (test_server.Server on the file's own `run`
    fixture, a saved run), up for the file's tests and stopped after them, unless a test has stopped it."""
    import pytest  # (not at the top: the pools' worker ranks import this module too)

    @pytest.fixture(scope="module")
    def server(run):
        s = start(run)
        yield s
        if s.proc.poll() is None:
            s.stop()
    return server


def _worker(env, rank, world, port, inq, outq):
    os.environ.clear()
    os.environ.update(env)  # the parent's environment when the rank started, as a spawned process has it
    sys.path[:0] = [str(ROOT), HERE]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=90))
    while True:
        job = inq.get()
        if job is None:
            break
        module, name, n, kwargs = job
        try:
            result = getattr(importlib.import_module(module), name)(rank, n, **kwargs)
            buf = io.BytesIO()
            torch.save(result, buf)
            outq.put((rank, "ok", buf.getvalue()))
        except BaseException:  # noqa: BLE001 — report everything to the parent
            outq.put((rank, "error", traceback.format_exc()))


def _train_worker(env, rank, world, inq, outq):
    """A warm torchrun rank: for each job, train.main(argv) under torchrun's environment; no process group between."""
    os.environ.clear()
    os.environ.update(env, OMP_NUM_THREADS="1")  # as torchrun sets it for nproc > 1
    sys.path[:0] = [str(ROOT), HERE]
    import contextlib

    import torch

    import parallel
    import train

    torch.set_num_threads(1)
    while True:
        job = inq.get()
        if job is None:
            break
        argv, port, cwd, patch = job
        saved = {name: getattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
                 for name in patch}
        for name, value in patch.items():  # this run's patches (launch's `patch`), undone after it
            setattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1], value)
        parallel._GROUPS.clear()  # a fresh process's state: the last run's groups died with its process group
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out, home = io.StringIO(), os.getcwd()
        try:
            os.chdir(cwd or home)  # the run's working directory (relative paths in argv are relative to it)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = train.main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:  # noqa: BLE001 — report everything to the parent
            code = traceback.format_exc()
        finally:
            os.chdir(home)
            for name, value in saved.items():
                setattr(importlib.import_module(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1], value)
        text = out.getvalue()
        outq.put((rank, code, text if len(text) <= 20000 else text[:10000] + "\n...\n" + text[-10000:]))


PRELOAD = ["fork_server"]  # what the fork server imports (tests/fork_server.py)


def start_fork_server():
    """Start the fork server if it is not running: conftest.py starts it before the first test, so that its imports
    (PRELOAD, ~6 s of one core) overlap the first tests; every Pool and in_fresh_process ask too. Python 3.11's fork
    server ignores the sys.path it is given (an ImportError in its preload is silent), so PYTHONPATH names tests/ and
    the repository for it (tests/test_harness.py checks that a forked process has PRELOAD imported)."""
    from multiprocessing import forkserver
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, str(ROOT), *([before] if before else [])])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


class CaseFailed(AssertionError):
    pass


def _call(module, name, args, outq):
    sys.path[:0] = [str(ROOT), HERE]
    try:
        getattr(importlib.import_module(module), name)(*args)
        outq.put(None)
    except BaseException:  # noqa: BLE001 — report everything to the parent
        outq.put(traceback.format_exc())


def in_fresh_process(fn, *args, timeout: float = 600.0):
    """fn(*args) (a module-level function of a test file) in a process forked from the fork server: a new process's
    state (no process group, none of this session's module state) with PRELOAD imported already, without a new
    interpreter's ~4 s of imports. CaseFailed with its traceback if it raises, dies or takes longer than `timeout`."""
    start_fork_server()
    ctx = mp.get_context("forkserver")
    outq = ctx.Queue()
    proc = ctx.Process(target=_call, args=(fn.__module__, fn.__name__, args, outq))  # (not a daemon: it may fork)
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                error = outq.get(timeout=1.0)
                break
            except queue.Empty:
                if not proc.is_alive() and outq.empty():
                    raise CaseFailed(f"{fn.__name__}: its process died (exit code {proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise CaseFailed(f"{fn.__name__}: not done in {timeout:.0f} s") from None
        if error is not None:
            raise CaseFailed(f"{fn.__name__} failed in its process:\n{error}")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


class Pool:
    def __init__(self, world: int = 4, timeout: float = 300.0, target=_worker):
        self.world, self.timeout, self.procs, self.target = world, timeout, [], target
        self._start()

    def _start(self):
        start_fork_server()
        ctx = mp.get_context("forkserver")  # ranks forked from one process that imported torch and train.py once
        port = free_port()
        self.inqs = [ctx.Queue() for _ in range(self.world)]
        self.outq = ctx.Queue()
        port = (port,) if self.target is _worker else ()  # _train_worker's runs each make their own process group
        self.procs = [ctx.Process(target=self.target, args=(dict(os.environ), r, self.world, *port, self.inqs[r],
                                                            self.outq), daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def close(self):
        for q in self.inqs:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.procs = []

    def restart(self):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()
        self._start()

    def run(self, fn, n: int, **kwargs):
        """fn(rank, n, **kwargs) on ranks 0..n-1 (n = the pool's world); returns the list of their results."""
        import torch

        if n != self.world:
            raise ValueError(f"case needs {n} ranks, pool has {self.world}")
        for r in range(n):
            self.inqs[r].put((fn.__module__, fn.__name__, n, kwargs))
        results, errors = {}, {}
        try:
            for _ in range(n):
                rank, status, payload = self.outq.get(timeout=self.timeout)
                (results if status == "ok" else errors)[rank] = payload
                if errors:  # other ranks may now hang in a collective: do not wait for them
                    break
        except queue.Empty:
            errors[-1] = f"timeout after {self.timeout}s; ranks that answered: {sorted(results)}"
        if errors:
            self.restart()
            rank = min(errors)
            raise CaseFailed(f"{fn.__name__} failed on rank {rank} of {n}:\n{errors[rank]}")
        return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(n)]


class Pools:
    """One Pool per world size, started on first use and kept for the session."""

    def __init__(self):
        self.pools: dict[int, Pool] = {}

    def run(self, fn, n: int, **kwargs):
        if n == 1:
            return [fn(0, 1, **kwargs)]
        if n not in self.pools:
            self.pools[n] = Pool(n)
        return self.pools[n].run(fn, n, **kwargs)

    def close(self):
        for p in self.pools.values():
            p.close()


_LAUNCHERS: dict[int, Pool] = {}  # world size -> warm train.py ranks, for the whole session (daemons: end with it)


class Returns:
    """A picklable `lambda: list(value)`: a function's stand-in that launch's `patch` can send to the ranks."""

    def __init__(self, value):
        self.value = list(value)

    def __call__(self):
        return list(self.value)


def launch(n: int, argv: list[str], timeout: float = 300.0, cwd=None, patch=None, fails=False):
    """train.main(argv) on n warm ranks, as `torchrun --nproc_per_node n train.py argv` run in `cwd` (default: where
    the ranks started, the repository root); raises CaseFailed (with the ranks' output) unless every rank returns 0.
    `patch` {"module.name": value} sets those names on the ranks for this run only (as monkeypatch does here).
    Returns each rank's output {rank: text} (the first and last 10,000 characters of a longer one).
    `fails`: a run meant to stop with an error: every rank must answer (exit code, or a traceback) within `timeout`,
    none hang or die (else CaseFailed); returns {rank: (code, text)}, and the ranks stay warm (train.main destroyed
    its process group on the way out)."""
    if n not in _LAUNCHERS:
        _LAUNCHERS[n] = Pool(n, timeout, target=_train_worker)
    pool = _LAUNCHERS[n]
    port = free_port()
    for r in range(n):
        pool.inqs[r].put((list(argv), port, None if cwd is None else str(cwd), dict(patch or {})))
    codes, outs, deadline = {}, {}, time.monotonic() + timeout
    while len(outs) < n:
        try:
            rank, codes[rank], outs[rank] = pool.outq.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(pool.procs) if not p.is_alive()]
            if dead or time.monotonic() > deadline:  # a rank died (e.g. train.py failed to import), or a hang
                codes[-1] = (f"ranks {dead} died (exit codes {[pool.procs[r].exitcode for r in dead]})" if dead else
                             f"timeout after {timeout}s; ranks that answered: {sorted(outs)}")
                break
            continue
        if codes[rank] not in (0, None) and not fails:  # the others may hang in a collective: do not wait for them
            break
    if fails and -1 not in codes:
        return {r: (codes[r], outs[r]) for r in range(n)}
    bad = {r: c for r, c in codes.items() if c not in (0, None)}
    if bad:
        pool.restart()
        rank = min(bad)
        raise CaseFailed(f"train.py on {n} warm ranks failed on rank {rank}: {bad[rank]}\n{outs.get(rank, '')}")
    return outs


# ---------------------------------------------------------------------------------------------- tiny train.py runs
SNIPPET = '''def add_{i}(a, b):
    """Return a + b."""
    return a + b * {i}


class Point{i}:
    def __init__(self, x=0, y=0):
        self.x, self.y = x, y
'''


# The tiny runs compare float32 layouts at 1e-5: Muon's Newton-Schulz runs in float32 there (gpt's default bfloat16
# rounds the layouts' reduction-order differences up to ~1e-4; tests/test_muon.py checks bfloat16's own step)
NS_FLOAT32 = ("--muon-fp32-matmul-prec", "high")


def tiny(corpus, cache, save, *extra, iters=6):
    return ["--data-path", str(corpus), "--data-cache-dir", str(cache), "--vocab-size", "384",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "3e-3",
            "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "2",
            *NS_FLOAT32, "--save", str(save), *extra]


def metrics(run_dir):
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in recs if "loss" in r}, {r["iteration"]: r["val_loss"] for r in recs
                                                               if "val_loss" in r}


def assert_close(a, b, rtol, what):
    assert abs(a - b) <= rtol * abs(b), f"{what}: {a} vs {b} (relative {abs(a - b) / abs(b):.2e} > {rtol})"


def torchrun(nproc, argv):
    """train.py under torchrun, on warm ranks (launch: torchrun's environment, no process starts)."""
    return launch(nproc, argv)
