"""EvalScope's load generator, `evalscope perf` (from .venv-evalscope, which `make test` builds), against our
OpenAI-compatible server (serving/server.py): streamed chat completions of the shipped bracket task's 40 prompts
(evaluation/tasks/brackets.jsonl, one a line: EvalScope's line_by_line dataset, so nothing is downloaded), --max-tokens
each, --number requests at each --parallel concurrency. One row per concurrency from EvalScope's
benchmark_summary.json: requests/s, output tokens/s, mean latency, TTFT and TPOT (time per output token after the
first), failed requests; EvalScope's own tables and files in --outputs-dir. --url: a server already running (`make
serve` in another terminal serves runs/gpt as "gpt" on port 8000); else --load RUN is served here as `make serve`
serves it (evaluation/evaluate.py's serving), then stopped. bench/bench_serve.py measures the engine in-process;
this, the HTTP server under a client's load, as `evalscope perf` measures a vLLM server (evalscope/perf/main.py).

    .venv/bin/python bench/bench_evalscope.py --load runs/gpt --parallel 1 4 --number 8 16        (~1 min)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from evaluation import evaluate  # noqa: E402

COLUMNS = {"concurrency": "Concurrency", "requests": "Total Requests", "req/s": "Req Throughput (req/s)",
           "output tok/s": "Output Throughput (tok/s)", "latency s": "Avg Latency (s)", "TTFT ms": "Avg TTFT (ms)",
           "TPOT ms": "Avg TPOT (ms)", "failed": "Failed Requests"}


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    p = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    p.add_argument("--load", help="serve this run here for the benchmark (as make serve serves it)")
    p.add_argument("--url", help="a server already running, e.g. http://127.0.0.1:8000 (make serve)")
    p.add_argument("--model", help="the served model's name with --url (make serve: the run directory's name)")
    p.add_argument("--parallel", type=int, nargs="+", default=[1, 4], help="concurrent requests, one run each")
    p.add_argument("--number", type=int, nargs="+", default=[8, 16], help="requests at each --parallel")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--outputs-dir", default=None, help="EvalScope's files (default: a temporary folder)")
    a = p.parse_args(argv)
    if (a.load is None) == (a.url is None) or (a.url and not a.model) or len(a.parallel) != len(a.number):
        p.error("--load RUN, or --url URL with --model NAME; as many --number as --parallel")
    return a


@contextlib.contextmanager
def server(a):
    """(base URL, model name) of the server to load: --url's, or --load's served here for the duration."""
    if a.url:
        yield a.url.rstrip("/"), a.model
        return
    with evaluate.serving(a.load, 1) as (base, name, _):
        yield base, name


def main(argv=None):
    a = parse_args(argv)
    if not evaluate.EVALSCOPE.exists():
        sys.exit(f"{evaluate.EVALSCOPE} is missing: make .venv-evalscope/.stamp builds it")
    with tempfile.TemporaryDirectory() as tmp, server(a) as (base, name):
        prompts, out = Path(tmp) / "prompts.txt", Path(a.outputs_dir or tmp) / "perf"
        prompts.write_text("".join(json.loads(line)["prompt"] + "\n" for line in
                                   (Path(ROOT) / "evaluation" / "tasks" / "brackets.jsonl").read_text().splitlines()))
        argv = [str(evaluate.EVALSCOPE), "perf", "--url", base + "/v1/chat/completions", "--model", name, "--api",
                "openai", "--dataset", "line_by_line", "--dataset-path", str(prompts), "--parallel",
                *map(str, a.parallel), "--number", *map(str, a.number), "--max-tokens", str(a.max_tokens), "--stream",
                "--temperature", "0", "--outputs-dir", str(out), "--no-timestamp", "--sleep-interval", "0"]
        r = subprocess.run(argv, env={**os.environ, **evaluate.OFFLINE}, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"evalscope perf failed:\n{(r.stdout + r.stderr)[-3000:]}")
        rows = [list(COLUMNS)]
        for p, n in zip(a.parallel, a.number):
            summary = json.loads((out / name / f"parallel_{p}_number_{n}" / "benchmark_summary.json").read_text())
            rows.append([f"{summary[k]:g}" for k in COLUMNS.values()])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    print("\n".join(" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows))
    return rows


if __name__ == "__main__":
    main()
