"""Per-expert load under four routers on a short MoE run of train.py: the switch aux loss (softmax router), DeepSeek-V3's
aux-loss-free balancing (sigmoid router + expert bias, no aux loss; Megatron's default rate 1e-3 and 1e-2), and the
sigmoid router with no balancing at all.

Each run is `train.py` in one process on the default corpus with a small model (the machine is shared: a default-size
iteration of the MoE model takes ~30 s there), logging metrics.jsonl every --log-interval iterations; the table shows,
per log window, the worst MoE layer's max/min tokens per expert (1.0 = perfectly balanced) and the loss.

    .venv/bin/python bench/bench_moe_balance.py --iters 60
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "16", "--global-batch-size", "16", "--eval-iters", "0",
         "--num-experts", "8", "--moe-router-topk", "2", "--lr", "3e-3"]
RUNS = {
    "switch aux loss 1e-2 (softmax)": ["--moe-aux-loss-coeff", "1e-2"],
    "expert bias, rate 1e-3 (sigmoid, no aux)": ["--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "0",
                                                 "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                                                 "1e-3"],
    "expert bias, rate 1e-2 (sigmoid, no aux)": ["--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "0",
                                                 "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                                                 "1e-2"],
    "none (sigmoid, no aux, no bias)": ["--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "0"],
}


def parse_args(argv=None):
    """The command line (tests/test_commands.py checks the documented ones with it)."""
    ap = argparse.ArgumentParser(prog=f"bench/{os.path.basename(__file__)}", description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--data-cache-dir", default="data_cache")
    ap.add_argument("--data-path", default=None, help="train.py's --data-path (default: the default corpus)")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            run = os.path.join(tmp, str(len(rows)))
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, *extra, "--train-iters", str(args.iters),
                   "--log-interval", str(args.log_interval), "--data-cache-dir", args.data_cache_dir, "--save", run]
            cmd += ["--data-path", args.data_path] if args.data_path else []
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            with open(os.path.join(run, "metrics.jsonl")) as f:
                recs = [r for r in map(json.loads, f) if "moe_load_max_over_min" in r]
            rows[name] = recs
            print(f"{name}: done", flush=True)
    print(f"command: .venv/bin/python bench/bench_moe_balance.py --iters {args.iters} --log-interval "
          f"{args.log_interval}   (model: {' '.join(SMALL)})")
    its = [r["iteration"] for r in next(iter(rows.values()))]
    print("worst layer's max/min tokens per expert, per window of", args.log_interval, "iterations (loss at the end)")
    print(f"| router | {' | '.join(f'it {i}' for i in its)} | loss |")
    print("|---|" + "---|" * (len(its) + 1))
    for name, recs in rows.items():
        ratios = " | ".join(f"{r['moe_load_max_over_min']:.2f}" for r in recs)
        print(f"| {name} | {ratios} | {recs[-1]['loss']:.3f} |")


if __name__ == "__main__":
    main()
